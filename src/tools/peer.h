/* Starting a `kvferry-testpeer engine-peer` child and writing into it:
 * shared by the tests and the engine benchmark. */
#ifndef KVF_CLI_PEER_H
#define KVF_CLI_PEER_H

#include <stdint.h>

#include "proc.h"
#include "util.h"

typedef struct engine_peer {
  proc p;
  char session[KVF_ADDR_MAX + 1];
  uint64_t base; /* address of the peer's registered buffer, in its process */
  uint64_t bytes;
} engine_peer;

/* Start a peer with a buffer of `bytes`; token may be NULL. 0 or -1 (and a
 * message on stderr). */
int engine_peer_start(engine_peer *ep, uint64_t bytes, const char *token);
/* The same with extra engine-peer arguments (NULL-terminated list, or NULL). */
int engine_peer_start_args(engine_peer *ep, uint64_t bytes, const char *token, const char *const *extra);
void engine_peer_stop(engine_peer *ep);

#endif

/* Liveness probe of prefill ranks through their ZMQ control socket (see
 * probe.c): what the decode heartbeat needs beyond the bootstrap server's
 * /health. */
#ifndef KVF_KV_PROBE_H
#define KVF_KV_PROBE_H

#include <stddef.h>
#include <stdint.h>

#include "kvferry.h"
#include "wire/route_json.h"

typedef struct kvf__probe_target {
  char ip[KVF_ADDR_HOST_LEN];
  uint16_t port;
  int rank;   /* for the caller's messages */
  int result; /* out: 0 alive (ZMTP greeting seen), KVF_ECLOSED refused/closed,
                 KVF_ETIMEDOUT no greeting in time, another KVF_E* otherwise */
} kvf__probe_target;

/* Probe every target at once, waiting at most timeout_ms in all. Blocking;
 * any thread; no lock held. */
void kvf__probe_ranks(kvf__probe_target *t, size_t n, int timeout_ms);

#endif

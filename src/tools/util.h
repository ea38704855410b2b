/* Helpers shared by the kvferry command, the test peer and the tests:
 * clocks, a seeded generator, size parsing, the transport option and the
 * stats line (util.c). Part of the tools library (src/tools/): static, public
 * API only, no test hook. */
#ifndef KVF_TOOLS_UTIL_H
#define KVF_TOOLS_UTIL_H

#include <stdint.h>

#include "kvferry/common.h"

/* The sscanf conversion that reads an address (at most KVF_ADDR_MAX bytes)
 * into a buffer of KVF_ADDR_MAX + 1, as peers print them ("ready ADDR"). */
#define CLI_ADDR_SCAN "%263s"
_Static_assert(KVF_ADDR_MAX == 263, "CLI_ADDR_SCAN reads KVF_ADDR_MAX bytes");

int cli_parse_size(const char *s, unsigned long long *out);
int cli_is_tty(void);
/* CLOCK_MONOTONIC in seconds, milliseconds, nanoseconds. */
double cli_now_s(void);
long long cli_now_ms(void);
long long cli_now_ns(void);
/* xorshift64: advances *s and returns it (s must not be 0). */
uint64_t cli_rng_next(uint64_t *s);
/* --transport tcp|ucx|auto: checked against this build, then exported as
 * KVFERRY_TRANSPORT so engines made here and in child processes use it.
 * 0, or -1 with a message on stderr. */
#define CLI_OPT_TRANSPORT 1000
int cli_set_transport(const char *cmd, const char *name);
/* Print "stats <live-rooms> <received> <malformed> <unknown-room>", the sums
 * of the n managers' kvf_manager_stats, and flush stdout (the `stats`
 * command of kv-peer and kv-decode). Main thread. */
struct kvf_manager;
void cli_print_stats(struct kvf_manager **m, int n);

/* The engine a CLI rank's KV manager shares (kvf_manager_config.engine),
 * listening on `host`, and whether its KV pool should come from that engine
 * (kvf_engine_alloc_pool: with UCX shared memory that a same-host peer maps
 * and reads or writes with plain loads and stores, with TCP private memory
 * on transparent huge pages): yes unless $KVFERRY_CLI_MEMORY is "plain"
 * (private memory of ordinary pages, as most callers' allocators give; UCX
 * reaches it through CMA). 0 or a KVF_E* error. */
struct kvf_engine;
int cli_rank_engine(const char *host, struct kvf_engine **out, int *pool);
/* "pool" or "plain": what cli_rank_engine chooses ($KVFERRY_CLI_MEMORY). */
const char *cli_memory_kind(void);
/* Do two same-host CLI processes reach each other over UCX ($KVFERRY_TRANSPORT
 * ucx, or auto in a build with UCX)? */
int cli_ucx_route(void);

#endif

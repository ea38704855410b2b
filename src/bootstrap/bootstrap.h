/* Internal API of the bootstrap layer: the HTTP client a prefill rank uses to
 * register and a decode rank uses to discover prefill ranks and probe
 * liveness (PROTOCOL §4, §7.1). The server's API is public
 * (include/kvferry/bootstrap.h). A client owns one libcurl easy handle, so
 * consecutive requests to the same server reuse one keep-alive connection
 * (the heartbeat's persistent session); it is not thread-safe: one client per
 * thread, or a lock around it. */
#ifndef KVF_BOOTSTRAP_BOOTSTRAP_H
#define KVF_BOOTSTRAP_BOOTSTRAP_H

#include <stddef.h>
#include <stdint.h>

#include "kvferry/bootstrap.h"
#include "wire/route_json.h"

/* Largest reply body the client reads; a bigger one is a protocol error. */
#define BOOTSTRAP_MAX_REPLY (1u << 20)

typedef struct bootstrap_client bootstrap_client;

typedef struct bootstrap_client_opts {
  const char *token;      /* bearer token sent with PUT; NULL = $KVFERRY_BOOTSTRAP_TOKEN, "" = none */
  int connect_timeout_ms; /* per attempt; 0 = 2000 (the reference heartbeat's connect timeout) */
  int timeout_ms;         /* whole request; 0 = $KVFERRY_BOOTSTRAP_TIMEOUT_MS or 5000 */
} bootstrap_client_opts;

/* A client for the server at `addr` ("host:port" or "[v6]:port"). `opts` may
 * be NULL. The caller owns *out (kvf__bootstrap_client_destroy). Errors:
 * KVF_EINVAL (addr empty or not a plain host:port), KVF_ENOMEM, KVF_EIO
 * (libcurl could not initialise). Any thread. */
int kvf__bootstrap_client_create(const char *addr, const bootstrap_client_opts *opts, bootstrap_client **out);
void kvf__bootstrap_client_destroy(bootstrap_client *c);
/* Every request from now on ends by `until_ns` (CLOCK_MONOTONIC; 0: no
 * overall limit, each request has its own timeout): a caller that makes
 * several requests in a row bounds them all together. A request started
 * past it fails at once with KVF_ETIMEDOUT. */
void kvf__bootstrap_client_set_deadline(bootstrap_client *c, int64_t until_ns);
/* A request of c in progress ends (KVF_ESTATE) within about a second of
 * stop(arg) returning nonzero, and one started after fails at once: for a
 * caller whose owner is shutting down (libcurl asks at least once a
 * second while a request waits). NULL: none. */
void kvf__bootstrap_client_set_stop(bootstrap_client *c, int (*stop)(void *arg), void *arg);

/* PUT /route with `reg`. Retries with exponential backoff (50 ms doubling to
 * 1 s) while the failure is one a later try can fix — connection refused,
 * timeout, connection dropped, 5xx — until `deadline_ms` from the call has
 * passed (0 = one try); the reference tries once, which loses the race
 * against a bootstrap server that starts after its ranks (PROTOCOL §8.9).
 * Returns 0 on 200, else the last error: KVF_EINVAL (400, or reg
 * unencodable), KVF_EACCES (401/403), KVF_ETOOBIG (413), KVF_ESTATE (409:
 * world/dp size differ from the first registration), KVF_ECONNREFUSED,
 * KVF_ETIMEDOUT, KVF_ECLOSED, KVF_EIO (5xx), KVF_EPROTO. */
int kvf__bootstrap_client_put_route(bootstrap_client *c, const route_reg *reg, int deadline_ms);

/* GET /route?engine_rank=-1&target_dp_group=-1. On success fills *out (free
 * with kvf__route_parallel_info_free). KVF_ENOTFOUND when the server has no
 * registration yet (null sizes); otherwise the transport errors above, or
 * KVF_EPROTO for a malformed reply. One try. */
int kvf__bootstrap_client_get_parallel_info(bootstrap_client *c, route_parallel_info *out);

/* GET /route?engine_rank=<tp_rank>&target_dp_group=<dp_group>: the address
 * of TP rank `tp_rank` inside DP group `dp_group`. Fills ip (NUL-terminated)
 * and *port on success. KVF_ENOTFOUND on 404 (rank not registered, or outside
 * the layout), KVF_ECONNREFUSED when nothing listens, KVF_ETIMEDOUT when the
 * server does not answer in time, KVF_EPROTO for a malformed reply. One try. */
int kvf__bootstrap_client_get_rank(bootstrap_client *c, int tp_rank, int dp_group, char *ip, size_t iplen,
                                   int *port);

/* GET /health: 0 on 200, else a transport error or KVF_EIO for another
 * status. Reuses the connection between calls (heartbeats). */
int kvf__bootstrap_client_health(bootstrap_client *c);

/* One raw request, for tests and tools: `method` ("GET", "HEAD", "PUT", or
 * any other token), `path` starting with '/', optional body. Sends the bearer
 * token with PUT. On a completed exchange returns 0 with *status set and, if
 * `reply` is not NULL, *reply a malloc'd NUL-terminated copy of the body the
 * caller frees (*reply_len its length, may be NULL). Transport failures return
 * the error codes above. One try. */
int kvf__bootstrap_client_request(bootstrap_client *c, const char *method, const char *path, const char *body,
                                  size_t body_len, long *status, char **reply, size_t *reply_len);

#endif

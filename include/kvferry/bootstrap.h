/*
 * The bootstrap server: the HTTP rendezvous point of one prefill instance
 * (tokenspeed's `--disaggregation-bootstrap-port`, PROTOCOL §4). Prefill ranks
 * PUT /route their ZMQ address; decode ranks GET the parallel layout and the
 * address of the prefill rank they need; GET /health is the decode heartbeat.
 * The wire format is the reference's, so tokenspeed peers can use a kvferry
 * server. Unlike the reference it answers 404 for unknown ranks, 400 for bad
 * input, 413 for oversized bodies, can require a bearer token for PUT, and
 * exports counters on GET /metrics (Prometheus text format).
 *
 * Threads. The server answers requests on its own thread. Every call may be
 * made from any thread except a request handler; kvf_bootstrap_server_destroy
 * must be the last call on a server. Blocking: _create binds and starts the
 * thread (no network wait); _destroy waits for requests in progress, each
 * bounded by idle_timeout_s. Nothing else blocks.
 */
#ifndef KVFERRY_BOOTSTRAP_H
#define KVFERRY_BOOTSTRAP_H

#include "kvferry/common.h"
#include "kvferry/engine.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvf_bootstrap_server kvf_bootstrap_server;

/* Options of kvf_bootstrap_server_create. Always start from
 * kvf_bootstrap_server_config_init: it sets `size`, which lets later library
 * versions add fields at the end without breaking programs built against
 * these headers. */
typedef struct kvf_bootstrap_server_config {
  size_t size;             /* sizeof(kvf_bootstrap_server_config), set by _config_init */
  const char *host;        /* address to bind; default "0.0.0.0" (all IPv4 interfaces, as the reference);
                             an IPv6 literal such as "::" binds IPv6 */
  uint16_t port;           /* default 8998; 0 = any free port (see kvf_bootstrap_server_port) */
  const char *auth_token;  /* bearer token PUT /route must carry; NULL = $KVFERRY_BOOTSTRAP_TOKEN,
                             "" = none. GETs and HEADs stay open. */
  size_t max_body;         /* largest PUT body accepted, bytes; default 65536, 413 beyond */
  unsigned max_conns;      /* concurrent connections; default 1024. Near the limit a new connection
                             evicts the oldest one still waiting for its request headers (else the
                             oldest request in progress). */
  unsigned idle_timeout_s; /* a connection idle this long is closed; default 30. Each request must
                             also be complete within min(this, 10 s) of the connection's start or
                             its previous reply, however its bytes trickle in. */
} kvf_bootstrap_server_config;
/* The size of the first published kvf_bootstrap_server_config (up to
 * idle_timeout_s), the smallest `size` accepted (see
 * KVF_ENGINE_CONFIG_SIZE_V1). */
#define KVF_BOOTSTRAP_SERVER_CONFIG_SIZE_V1                \
  (offsetof(kvf_bootstrap_server_config, idle_timeout_s) + \
   sizeof(((kvf_bootstrap_server_config *)0)->idle_timeout_s))

/* Fill `cfg` with the defaults above and set cfg->size. Any thread. */
KVF_API void kvf_bootstrap_server_config_init(kvf_bootstrap_server_config *cfg);

/* Set the field called `name` (e.g. "port") from its text form, as
 * kvf_engine_config_set does (strings are not copied). 0, KVF_ENOTFOUND,
 * KVF_EINVAL. Any thread, on a cfg no other thread uses. */
KVF_API int kvf_bootstrap_server_config_set(kvf_bootstrap_server_config *cfg, const char *name, const char *value);

/* Bind and start serving on an internal thread. `cfg` may be NULL for the
 * defaults; it is only read during the call (strings are copied). On success
 * the caller owns *out and must release it with kvf_bootstrap_server_destroy.
 * Errors: KVF_EINVAL (bad host, or a config not set up by _config_init),
 * KVF_EIO (bind failed, e.g. port in use), KVF_ENOMEM. Any thread. */
KVF_API int kvf_bootstrap_server_create(const kvf_bootstrap_server_config *cfg, kvf_bootstrap_server **out);

/* The port the server listens on (the chosen one when cfg->port was 0).
 * Any thread, while the server exists. */
KVF_API uint16_t kvf_bootstrap_server_port(const kvf_bootstrap_server *srv);

/* Show the per-peer transport choices of `engine` (kvf_engine_peer_routes)
 * in this server's GET /metrics, as kvferry_engine_peer_route lines (a
 * process that runs its bootstrap server beside its ranks' engines, e.g.
 * kvferry-testpeer kv-peer). The engine must outlive the server, or be destroyed only
 * after it. KVF_ENOMEM past KVF_BOOTSTRAP_MAX_ENGINES. Any thread. */
#define KVF_BOOTSTRAP_MAX_ENGINES 64
KVF_API int kvf_bootstrap_server_add_engine(kvf_bootstrap_server *srv, kvf_engine *engine);

/* More lines for this server's GET /metrics, from the process that runs it
 * (e.g. its KV managers' counters, kvf_manager_metrics): on every request
 * fn(arg, buf, cap) writes Prometheus text lines into buf (at most cap - 1
 * bytes, NUL-terminated; whole lines only) and returns the bytes written;
 * when that comes within 1 KiB of cap it is called again with twice the
 * room, up to 1 MiB, so it may run several times per request. The sources'
 * lines are regrouped by metric family (each family once, with its first
 * HELP and TYPE line), so several managers may write the same families; the
 * whole page is bounded at 4 MiB, cut at a line. It runs on a
 * request thread under the server's lock: quick, no call into the server.
 * arg must stay valid until the server is destroyed. KVF_EINVAL for a NULL
 * srv or fn, KVF_ENOMEM past KVF_BOOTSTRAP_MAX_SOURCES. Any thread. */
#define KVF_BOOTSTRAP_MAX_SOURCES 64
typedef size_t (*kvf_metrics_fn)(void *arg, char *buf, size_t cap);
KVF_API int kvf_bootstrap_server_add_metrics(kvf_bootstrap_server *srv, kvf_metrics_fn fn, void *arg);

/* Stop serving, close every connection and free the server; requests in
 * progress finish first. NULL is ignored. Call once, from any thread except a
 * request handler, with no other call on `srv` in progress. */
KVF_API void kvf_bootstrap_server_destroy(kvf_bootstrap_server *srv);

#ifdef __cplusplus
}
#endif
#endif

/*
 * The transfer engine: the data plane. An engine listens on host:port (its
 * session id), owns a table of registered memory regions that peers may write
 * into, and writes batches of (local source, remote destination, length)
 * blocks into the registered memory of other engines. Semantics follow the
 * Mooncake TransferEngine as tokenspeed uses it.
 */
#ifndef KVFERRY_ENGINE_H
#define KVFERRY_ENGINE_H

#include "kvferry/common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvf_engine kvf_engine;
typedef struct kvf_batch kvf_batch;

typedef struct kvf_engine_config {
  const char *host;        /* address to listen on and advertise; default "127.0.0.1" */
  uint16_t port;           /* 0 = any free port (default) */
  const char *transport;   /* "tcp", "ucx" or "auto"; NULL = $KVFERRY_TRANSPORT, else "auto" (see README) */
  const char *auth_token;  /* shared secret peers must present; NULL = $KVFERRY_AUTH_TOKEN, "" = none */
  int timeout_ms;          /* batch deadline; default 30000, env KVFERRY_TIMEOUT_MS */
  int conns_per_peer;      /* parallel TCP connections per remote session; default 2, env KVFERRY_CONNS_PER_PEER */
  int max_inbound_conns;   /* bound on accepted connections; default 256 */
} kvf_engine_config;

/* One block to write. With count <= 1 it is `len` bytes from local `src` to
 * remote `dst`. With count > 1 it is a strided block: `count` pieces of `len`
 * bytes, piece i from src + i*src_stride to dst + i*dst_stride. */
typedef struct kvf_write {
  uint64_t src;
  uint64_t dst;
  uint64_t len;
  uint64_t count;
  uint64_t src_stride;
  uint64_t dst_stride;
} kvf_write;

/* Engine counters, for metrics and tests. */
typedef struct kvf_engine_stats {
  uint64_t batches_sent;       /* batches this engine completed as a writer */
  uint64_t bytes_sent;
  uint64_t batches_failed;     /* writer side: batches that ended in error */
  uint64_t batches_received;   /* target side: batches accepted and written */
  uint64_t bytes_received;
  uint64_t batches_refused;    /* target side: refused (outside registered memory) */
  uint64_t auth_refused;       /* target side: peers refused for a wrong or missing secret */
  uint64_t protocol_errors;    /* target side: malformed frames (connection dropped) */
  uint64_t conns_refused;      /* target side: over max_inbound_conns */
  uint64_t peers_ucx;          /* writer side: peers routed over UCX (auto/ucx) */
  uint64_t peers_tcp;          /* writer side: peers routed over kvferry's TCP by auto */
} kvf_engine_stats;

/* Fill `cfg` with defaults (environment overrides are applied at create). */
void kvf_engine_config_init(kvf_engine_config *cfg);

/* Create an engine and start listening. `cfg` may be NULL for defaults. The
 * caller owns *out and frees it with kvf_engine_destroy. Any thread. */
int kvf_engine_create(const kvf_engine_config *cfg, kvf_engine **out);

/* Stop listening, fail in-flight batches, join threads, free. Batches still
 * held by the caller must be freed before this call. NULL is a no-op. */
void kvf_engine_destroy(kvf_engine *engine);

/* "host:port" of this engine; owned by the engine, valid until destroy. */
const char *kvf_engine_session_id(const kvf_engine *engine);
/* The port the engine listens on. */
uint16_t kvf_engine_port(const kvf_engine *engine);

/* Register [addr, addr+len) so peers may write into it and local writes may
 * read from it. Overlapping an existing region is KVF_EEXIST. Any thread. */
int kvf_engine_register(kvf_engine *engine, void *addr, size_t len);
/* Unregister the region that starts at addr. KVF_ENOTFOUND if none. Waits for
 * writes into the region that are in progress. Any thread. */
int kvf_engine_unregister(kvf_engine *engine, void *addr);

/* Write `n` blocks to the engine named by `session` ("host:port") and wait
 * until the peer confirms every byte landed, or the deadline passes. The
 * peer refuses the whole batch (KVF_ERANGE, no byte written) unless every
 * destination lies inside memory it registered. Sources must lie in memory
 * registered locally. Any thread; many threads may write at once. */
int kvf_engine_write(kvf_engine *engine, const char *session, const kvf_write *writes, size_t n);

/* Start the same batch asynchronously. The blocks are copied; the source
 * memory must stay valid until the batch completes. The caller owns *out and
 * frees it with kvf_batch_free (which waits for completion first). */
int kvf_engine_submit(kvf_engine *engine, const char *session, const kvf_write *writes, size_t n,
                      kvf_batch **out);

/* 1 = done, 0 = in progress, negative KVF_E* = failed. Never blocks. */
int kvf_batch_poll(kvf_batch *batch);
/* Wait up to timeout_ms (< 0: until the batch deadline) for completion; returns
 * 0 when done, KVF_ETIMEDOUT if still in progress, or the batch's error. */
int kvf_batch_wait(kvf_batch *batch, int timeout_ms);
/* Wait for completion (bounded by the batch deadline) and free. NULL ok. */
void kvf_batch_free(kvf_batch *batch);

/* Memory ordering point for registered memory. Peers write into it from the
 * engine's threads; call this after learning (by any channel: an M3, an ack,
 * a pipe) that bytes have landed and before reading them, and after changing
 * registered memory locally before telling a peer it may write there. It is
 * free on x86 and makes the ordering visible to ThreadSanitizer. Any thread. */
void kvf_engine_sync(kvf_engine *engine);

/* Copy the engine's counters into *out. Any thread. */
void kvf_engine_get_stats(const kvf_engine *engine, kvf_engine_stats *out);

/* The transports this library was built with: "tcp" or "tcp,ucx". Static
 * string. Any thread. */
const char *kvf_engine_transports(void);
/* The engine's transport: "tcp", or "ucx" (which also runs TCP for peers
 * that auto routes there). Owned by the library. Any thread. */
const char *kvf_engine_transport(const kvf_engine *engine);
/* Which transport batches to `session` use and why, e.g. "ucx: same host:
 * UCX shared memory", into out (cap bytes, NUL-terminated). KVF_ENOTFOUND
 * before the first batch to that peer. Any thread. */
int kvf_engine_peer_transport(kvf_engine *engine, const char *session, char *out, size_t cap);

/* Allocate a `len`-byte pool and register it. With UCX it lives in shared
 * memory that a same-host peer maps directly (ucp_rkey_ptr), so writes into
 * it are plain stores; otherwise it is shared anonymous memory. The engine
 * owns the memory: free it with kvf_engine_free_pool (which unregisters it)
 * before destroying the engine. Any thread. */
int kvf_engine_alloc_pool(kvf_engine *engine, size_t len, void **out);
int kvf_engine_free_pool(kvf_engine *engine, void *addr);

#ifdef __cplusplus
}
#endif
#endif

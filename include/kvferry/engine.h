/*
 * The transfer engine: the data plane. An engine listens on host:port (its
 * session id), owns a table of registered memory regions that peers may write
 * into, and writes batches of (local source, remote destination, length)
 * blocks into the registered memory of other engines. Semantics follow the
 * Mooncake TransferEngine as tokenspeed uses it.
 *
 * Threads. Every engine call may be made from any thread, and calls on one
 * engine may run concurrently (many threads may write at once), except
 * kvf_engine_destroy, which must be the last call on the engine. A batch
 * (kvf_batch) is polled, waited for and destroyed by one thread at a time.
 * The engine runs its own threads (accept, inbound connections, senders).
 * Calls that block, and for how long at most:
 *   kvf_engine_write           until the peer confirms, at most timeout_ms
 *   kvf_batch_wait             its timeout_ms (< 0: the batch's deadline)
 *   kvf_batch_destroy          until the batch completes (its deadline)
 *   kvf_engine_unregister      until a write in progress into the region lets go (~100 ms)
 *   kvf_engine_create          binding and starting threads (no network wait)
 *   kvf_engine_destroy         until in-flight batches fail or finish (timeout_ms)
 * Every other call returns without waiting on the network. In particular
 * kvf_engine_submit never connects: a batch to a peer not connected yet (or
 * whose connection failed) is queued to a thread that connects to that peer
 * within the batch's deadline and then sends the peer's queued batches in
 * order, so a peer that never answers delays only its own batches. Past 128
 * peers connecting at once, a further one connects on the submitting thread.
 */
#ifndef KVFERRY_ENGINE_H
#define KVFERRY_ENGINE_H

#include "kvferry/common.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct kvf_engine kvf_engine;
typedef struct kvf_batch kvf_batch;

/* Options of kvf_engine_create. Always start from kvf_engine_config_init:
 * it sets `size`, which lets later library versions add fields at the end
 * without breaking programs built against these headers. */
typedef struct kvf_engine_config {
  size_t size;            /* sizeof(kvf_engine_config), set by kvf_engine_config_init */
  const char *host;       /* address to listen on and advertise; default "127.0.0.1" */
  uint16_t port;          /* 0 = any free port (default) */
  const char *transport;  /* "tcp", "ucx" or "auto"; NULL = $KVFERRY_TRANSPORT, else "auto" (see README) */
  const char *auth_token; /* shared secret peers must present; NULL = $KVFERRY_AUTH_TOKEN, "" = none */
  int timeout_ms;         /* batch deadline; default 30000, env KVFERRY_TIMEOUT_MS */
  int conns_per_peer;     /* parallel TCP connections per remote session; default 2, env KVFERRY_CONNS_PER_PEER */
  int max_inbound_conns;  /* bound on accepted TCP connections; default 256 (UCX rendezvous: README) */
  /* UCX between two kvferry engines: "read" (default) = the target reads
   * each chunk the writer announces (decode-initiated reads: fencing, bounds
   * and completion stay with the side whose memory receives the bytes);
   * "write" = the writer puts into the target's memory. Read mode is used
   * when both engines allow it. NULL = $KVFERRY_UCX_MODE, else "read". */
  const char *ucx_mode;
  /* Read mode, writer side: how long a target may take to read an announced
   * chunk (capped by the batch deadline); the sources stay as they are that
   * long at least, and a read finished later does not count. <= 0 (default)
   * = timeout_ms, the batch deadline, as long as a write over TCP may take
   * (10 s before: an overloaded decode failed rooms that TCP would have
   * finished); env KVFERRY_READ_LEASE_MS. */
  int read_lease_ms;
  /* kvf_engine_alloc_pool locks each pool in memory (mlock), as an RDMA
   * registration pins it: the kernel then never reclaims its pages, which a
   * same-host peer maps, and no load of them faults again (on a guest whose
   * kernel reclaims proactively, unlocked pools made the default path 7x
   * slower at 4 prefill x 4 decode instances; bench/README.md). 1 (default)
   * = lock, best effort (a refusal, e.g. by RLIMIT_MEMLOCK, is logged once
   * and the pool works unlocked); 0 = do not; env KVFERRY_LOCK_POOLS. */
  int lock_pools;
} kvf_engine_config;
/* The size of the first published kvf_engine_config (every field up to
 * max_inbound_conns): the smallest `size` the library accepts, so a program
 * built against those headers keeps working when fields are added at the
 * end. Later fields must start at or past sizeof of that first version. */
#define KVF_ENGINE_CONFIG_SIZE_V1 \
  (offsetof(kvf_engine_config, max_inbound_conns) + sizeof(((kvf_engine_config *)0)->max_inbound_conns))

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
  uint64_t batches_sent; /* batches this engine completed as a writer */
  uint64_t bytes_sent;
  uint64_t batches_failed;   /* writer side: batches that ended in error */
  uint64_t batches_received; /* target side: batches accepted and written */
  uint64_t bytes_received;
  uint64_t batches_refused; /* target side: refused (outside registered memory) */
  uint64_t auth_refused;    /* target side: peers refused for a wrong or missing secret */
  uint64_t protocol_errors; /* target side: malformed frames (connection dropped) */
  uint64_t conns_refused;   /* target side: over max_inbound_conns */
  uint64_t conns_timed_out; /* target side: dropped at the hello or chunk deadline */
  uint64_t conns_evicted;   /* target side: idle or unauthenticated, closed to make room */
  uint64_t peers_ucx;       /* writer side: peers routed over UCX (auto/ucx) */
  uint64_t peers_tcp;       /* writer side: peers routed over kvferry's TCP by auto */
  uint64_t chunks_fenced;   /* tagged chunks refused, their (tag, epoch) not open: by the target over tcp
                               and in UCX read mode, by the writer in UCX write mode (kvf_engine_fence_close) */
  uint64_t peers_read;      /* UCX connections in read mode: writer side, peers that read from this engine;
                               target side, writers this engine reads from */
  uint64_t reads_refused;   /* target side, read mode: notices refused (fence closed, outside memory or bounds) */
  uint64_t reads_late;      /* target side, read mode: chunks read after their lease ended (not counted) */
  uint64_t bytes_read_direct;  /* target side, read mode: bytes read from a same-host writer's private memory
                                 with process_vm_readv (KVFERRY_UCX_CMA; its pools are loaded, elsewhere UCX gets) */
  uint64_t bytes_mapped_ahead; /* target side, read mode: bytes of same-host writers' pools this engine mapped and
                                  read once ahead of its reads (at most 1 GiB per writer; docs/WIRE-EXTENSIONS.md) */
} kvf_engine_stats;

/* Options of one batch (kvf_engine_submit_ex, kvf_engine_write_ex). Always
 * start from kvf_batch_opts_init: it sets `size`, so later versions can add
 * fields at the end. See docs/WIRE-EXTENSIONS.md ("fencing").
 *
 * tag, epoch: the identity of what the batch writes for (kvferry's KV
 * managers: the decode's room id and the fence epoch the decode gave that
 * room). A tagged batch (tag != 0) lands only while the target engine has
 * that (tag, epoch) open (kvf_engine_fence_open); otherwise the target
 * refuses each chunk before writing any byte of it, and the batch fails
 * with KVF_ESTATE. tag 0: untagged, no check (the default). */
typedef struct kvf_batch_opts {
  size_t size;    /* sizeof(kvf_batch_opts), set by kvf_batch_opts_init */
  uint64_t tag;   /* 0 = untagged */
  uint64_t epoch; /* the target's epoch for tag (from its kvf_engine_fence_open) */
} kvf_batch_opts;
/* The size of the first published kvf_batch_opts (up to epoch), the
 * smallest `size` accepted (see KVF_ENGINE_CONFIG_SIZE_V1). */
#define KVF_BATCH_OPTS_SIZE_V1 (offsetof(kvf_batch_opts, epoch) + sizeof(((kvf_batch_opts *)0)->epoch))

/* Fill `cfg` with defaults and set cfg->size (environment overrides are
 * applied at create). Any thread. */
KVF_API void kvf_engine_config_init(kvf_engine_config *cfg);

/* Set the field called `name` (the member's name, e.g. "timeout_ms") from
 * its text form: decimal for numbers; strings are not copied, `value` must
 * stay valid until kvf_engine_create has returned. For bindings and config
 * files. 0; KVF_ENOTFOUND (no such field), KVF_EINVAL (bad value or a cfg
 * not initialised). Any thread, on a cfg no other thread uses. */
KVF_API int kvf_engine_config_set(kvf_engine_config *cfg, const char *name, const char *value);

/* Create an engine and start listening. `cfg` (NULL for defaults) is only
 * read during the call; KVF_EINVAL if it was not set up by
 * kvf_engine_config_init. The caller owns *out and frees it with
 * kvf_engine_destroy. Any thread. */
KVF_API int kvf_engine_create(const kvf_engine_config *cfg, kvf_engine **out);

/* Stop listening, fail in-flight batches, join threads, free. Batches still
 * held by the caller must be destroyed before this call. NULL is a no-op.
 * Blocks up to timeout_ms. Any thread, as the last call on the engine. */
KVF_API void kvf_engine_destroy(kvf_engine *engine);

/* "host:port" of this engine; owned by the engine, valid until destroy.
 * Any thread. */
KVF_API const char *kvf_engine_session_id(const kvf_engine *engine);
/* The port the engine listens on. Any thread. */
KVF_API uint16_t kvf_engine_port(const kvf_engine *engine);

/* Register [addr, addr+len) so peers may write into it and local writes may
 * read from it. Overlapping an existing region is KVF_EEXIST, except for a
 * range that lies inside a pool from kvf_engine_alloc_pool (the pool itself
 * included): that is already registered whole, so the call only counts it
 * and the matching kvf_engine_unregister only uncounts it (the pool stays
 * registered until kvf_engine_free_pool). Any thread. */
KVF_API int kvf_engine_register(kvf_engine *engine, void *addr, size_t len);
/* Unregister the region that starts at addr. KVF_ENOTFOUND if none. A peer's
 * write into the region that is in progress is cut short (its batch is
 * refused with KVF_ERANGE); this waits only until that receiver lets go, about
 * 100 ms at most, and no byte lands in the region after it returns. Register
 * never waits on a peer. Any thread. */
KVF_API int kvf_engine_unregister(kvf_engine *engine, void *addr);

/* Write `n` blocks to the engine named by `session` ("host:port") and wait
 * until the peer confirms every byte landed, or the deadline passes (over
 * UCX in read mode the peer reads the blocks itself: the same call, the
 * source memory read by the peer until it confirms or the read lease ends). The
 * peer refuses the whole batch (KVF_ERANGE, no byte written) unless every
 * destination lies inside memory it registered. Sources must lie in memory
 * registered locally. Any thread; many threads may write at once. */
KVF_API int kvf_engine_write(kvf_engine *engine, const char *session, const kvf_write *writes, size_t n);

/* Start the same batch asynchronously. The blocks are copied; the source
 * memory must stay valid until the batch completes. The caller owns *out and
 * frees it with kvf_batch_destroy (which waits for completion first). Never
 * blocks on the network. Any thread. */
KVF_API int kvf_engine_submit(kvf_engine *engine, const char *session, const kvf_write *writes, size_t n,
                              kvf_batch **out);

/* Fill `o` with defaults (untagged) and set o->size. Any thread. */
KVF_API void kvf_batch_opts_init(kvf_batch_opts *o);

/* kvf_engine_submit / kvf_engine_write with options (NULL = defaults);
 * KVF_EINVAL for opts not set up by kvf_batch_opts_init, or a tag without
 * an epoch. Same ownership and threads as the plain calls. */
KVF_API int kvf_engine_submit_ex(kvf_engine *engine, const char *session, const kvf_write *writes, size_t n,
                                 const kvf_batch_opts *opts, kvf_batch **out);
KVF_API int kvf_engine_write_ex(kvf_engine *engine, const char *session, const kvf_write *writes, size_t n,
                                const kvf_batch_opts *opts);

/* Target-side fences. Open admits tagged batches that name (tag, *epoch)
 * into this engine's registered memory; *epoch is new, unique in this
 * process and never 0; give it to the writer with the tag. Close refuses
 * every later chunk of that pair before any of its bytes is written, and
 * returns only once chunks admitted earlier have stopped writing (a chunk
 * cut short fails at its writer); from then on no byte of a batch tagged
 * with the pair lands here. It waits about 100 ms at most while a chunk's
 * payload is arriving, at most timeout_ms (<= 0: the engine timeout) in all:
 * KVF_ETIMEDOUT means a receiver did not stop in time. KVF_ENOTFOUND when
 * the pair is not open. Untagged batches are never affected. Any thread.
 *
 * Over ucx in read mode (the default between kvferry engines) this engine
 * reads every chunk itself: close stops its own reads of the pair (within
 * one 256 KiB slice; gets in flight are cancelled) and waits for nothing
 * else. In write mode the writer puts into this memory without this
 * engine's CPU, so the target cannot refuse a chunk. Close then also tells every writer
 * connected to this engine's UCX rendezvous that the pair is closed, and
 * returns 0 only once each has confirmed (it starts no new block for the
 * pair, and has flushed what it had posted to this engine, so those bytes
 * are in place before close returns) or its rendezvous connection is gone.
 * Writers learn which pairs are open from the rendezvous as well: a tagged
 * write naming a pair already closed is refused by the writer (KVF_ESTATE,
 * counted in its chunks_fenced); one naming an epoch newer than the
 * writer's last snapshot is written (the target cannot tell). A writer that
 * does not confirm within the timeout (a stopped or hung process) is cut off
 * and close returns KVF_ETIMEDOUT: it starts no new block of the pair when
 * it runs again, but puts it had already posted may still land then, so
 * the pages are safe to reuse only once that writer's process is gone. */
KVF_API int kvf_engine_fence_open(kvf_engine *engine, uint64_t tag, uint64_t *epoch);
KVF_API int kvf_engine_fence_close(kvf_engine *engine, uint64_t tag, uint64_t epoch, int timeout_ms);

/* 0 = done, KVF_EAGAIN = still in progress, another negative KVF_E* = the
 * batch failed (the library-wide rule for polling an operation, see
 * kvferry.h). Never blocks. The batch's thread. */
KVF_API int kvf_batch_poll(kvf_batch *batch);
/* Wait up to timeout_ms (< 0: until the batch deadline) for completion; returns
 * 0 when done, KVF_ETIMEDOUT if still in progress, or the batch's error.
 * The batch's thread. */
KVF_API int kvf_batch_wait(kvf_batch *batch, int timeout_ms);
/* Wait for completion (bounded by the batch deadline) and free. NULL ok.
 * The batch's thread, as the last call on the batch. */
KVF_API void kvf_batch_destroy(kvf_batch *batch);

/* Memory ordering point for registered memory. Peers write into it from the
 * engine's threads; call this after learning (by any channel: an M3, an ack,
 * a pipe) that bytes have landed and before reading them, and after changing
 * registered memory locally before telling a peer it may write there. It is
 * free on x86 and makes the ordering visible to ThreadSanitizer. Any thread. */
KVF_API void kvf_engine_sync(kvf_engine *engine);

/* Copy the engine's counters into *out. Any thread. */
KVF_API void kvf_engine_get_stats(const kvf_engine *engine, kvf_engine_stats *out);

/* The transports this library was built with: "tcp" or "tcp,ucx". Static
 * string. Any thread. */
KVF_API const char *kvf_engine_transports(void);
/* The engine's transport: "tcp", or "ucx" (which also runs TCP for peers
 * that auto routes there). Owned by the library. Any thread. */
KVF_API const char *kvf_engine_transport(const kvf_engine *engine);
/* Which transport batches to `session` use and why, e.g. "ucx: same host:
 * UCX shared memory", into out (cap bytes, NUL-terminated); once this
 * engine has device memory registered it also says how that moves (UCX's
 * CUDA transports, or not at all over TCP). KVF_ENOTFOUND before the first
 * batch to that peer. Any thread. */
KVF_API int kvf_engine_peer_transport(kvf_engine *engine, const char *session, char *out, size_t cap);
/* Every peer this engine has chosen a transport for, one line each:
 * "<session> <tcp|ucx> <why>\n" (the why as kvf_engine_peer_transport
 * says it), into out (cap bytes, NUL-terminated; lines that do not fit are
 * left out). The number of lines written; an engine running transport tcp
 * chooses nothing per peer and writes none. Any thread. */
KVF_API int kvf_engine_peer_routes(kvf_engine *engine, char *out, size_t cap);

/* Allocate a `len`-byte pool and register it. With UCX it lives in shared
 * memory that a same-host peer maps directly (ucp_rkey_ptr), so writes into
 * it are plain stores; otherwise (transport tcp) it is private anonymous
 * memory on 2 MiB boundaries, advised to use transparent huge pages (a
 * child of fork gets a copy-on-write copy, as of malloc'd memory). It is
 * locked in memory unless the config's lock_pools is 0 (best effort). The engine
 * owns the memory: free it with kvf_engine_free_pool (which unregisters it)
 * before destroying the engine. Any thread. */
KVF_API int kvf_engine_alloc_pool(kvf_engine *engine, size_t len, void **out);
KVF_API int kvf_engine_free_pool(kvf_engine *engine, void *addr);

#ifdef __cplusplus
}
#endif
#endif

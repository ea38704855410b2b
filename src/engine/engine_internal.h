/* Internal shape of the transfer engine: the engine object, registered
 * regions, batches split into per-connection chunks, and the table of
 * transport operations that a transport (tcp today; cma, ucx later) fills.
 * The public functions in engine.c are transport-neutral; everything that
 * touches a socket lives in the transport. */
#ifndef KVF_ENGINE_INTERNAL_H
#define KVF_ENGINE_INTERNAL_H

#include "engine/async.h"
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "base/addr.h"
#include "base/map.h"
#include "kvferry/engine.h"

/* ---- registered memory (regions.c) ---- */
typedef struct region {
  uint64_t base;
  uint64_t len;
  atomic_int pins;    /* inbound writes in progress into it */
  atomic_int revoked; /* unregistered: pinned writers stop at their next tick */
  /* 0: host memory; 1: not a readable host mapping here (device memory),
   * which the CPU never copies into or out of; 2: device memory that no
   * transport of this engine can move (kvf__regions_mark_unmovable). */
  int device;
} region;

typedef struct region_table {
  pthread_rwlock_t lock; /* lookups and edits only, never held across I/O */
  region **items;        /* sorted by base, non-overlapping; each owned by the table */
  size_t n, cap;
  pthread_mutex_t pin_lock; /* with pin_cv: unregister waits for a region's pins */
  pthread_cond_t pin_cv;
  atomic_uint revocations; /* bumped by every unregister, so a receiver checks its pins only then */
} region_table;

int kvf__regions_init(region_table *t);
void kvf__regions_destroy(region_table *t);
/* `device`: the range is not readable host memory of this process (what
 * cuMemAlloc memory looks like to the CPU); kvferry's TCP refuses writes
 * into it (TCP_FRAME_DEVICE_MEMORY) instead of copying into it. */
int kvf__regions_add(region_table *t, uint64_t base, uint64_t len, int device);
/* The region at `base` is device memory no transport here can move (UCX
 * without CUDA, or memory the CUDA driver does not know): device = 2. */
void kvf__regions_mark_unmovable(region_table *t, uint64_t base);
/* Take the region out of the table, then wait until no receiver holds a pin
 * on it (about one receive tick at most). */
int kvf__regions_remove(region_table *t, uint64_t base);
/* Is every piece of a (possibly strided) block inside registered memory?
 * `dst` selects the destination side of the block. Caller holds the read lock. */
int kvf__regions_block_ok_locked(const region_table *t, uint64_t addr, uint64_t len, uint64_t count,
                                 uint64_t stride);
/* The same lookups, returning the region (NULL if none). Read lock held. */
region *kvf__regions_find_locked(const region_table *t, uint64_t addr, uint64_t len);
region *kvf__regions_find_block_locked(const region_table *t, uint64_t addr, uint64_t len, uint64_t count,
                                       uint64_t stride);
/* Pin a region found under the read lock so it outlives the lock; unpin
 * (any time, no lock) wakes an unregister waiting on it. */
void kvf__region_pin(region *r);
void kvf__region_unpin(region_table *t, region *r);

/* The longest read lease a UCX writer grants and a target accepts (the
 * engine config's read_lease_ms is capped at it). */
#define ENGINE_MAX_LEASE_MS (3600 * 1000)

/* How often a connect or handshake on a connector thread looks whether the
 * engine is stopping (kvf__fd_wait). */
#define KVF__CONNECT_SLICE_MS 50

/* ---- fences (fence.c) ---- */
typedef struct engine_fence {
  uint64_t tag, epoch;
  int inflight;   /* admitted chunks still being received */
  int closed;     /* kvf_engine_fence_close ran: admit nothing more */
  int abandoned;  /* the closer timed out: the last receiver frees it */
  atomic_int cut; /* read without the lock by receivers between receive calls */
  /* kvf__engine_fence_bound_grids: where a chunk's destinations must lie
   * (the room's own pages), owned by the caller until the pair is closed
   * (`ranges`, kvf__engine_fence_bound's, for a grid of byte ranges);
   * read under the table's lock. ngrids == 0: not bounded. */
  const kvf__fence_grid *grids;
  size_t ngrids;
  kvf__fence_grid ranges;
  /* What landed for the pair (kvf__fence_landed; room traces, issue 25):
   * atomics, written by receivers while they hold the pair (inflight). */
  _Atomic int64_t first_ns, last_ns;
  atomic_ullong bytes, chunks;
  atomic_int how; /* KVF__FENCE_TCP or KVF__FENCE_READ: how the last chunk came */
} engine_fence;

typedef struct engine_fences {
  pthread_mutex_t lock;
  pthread_cond_t cv; /* a fenced pair's last receiver left */
  map open;          /* epoch -> engine_fence */
  spare_list spare;  /* engine_fence records for the next opens */
} engine_fences;

int kvf__fence_init(engine_fences *f);
void kvf__fence_destroy(engine_fences *f);
/* Admit a tagged chunk: the open fence entry with inflight raised, or NULL
 * (counted in chunks_fenced) when the pair is not open. */
engine_fence *kvf__fence_enter(struct kvf_engine *e, uint64_t tag, uint64_t epoch);
/* The same, not counted: the pair of a chunk already admitted, entered
 * again to hand its trailer over (tcp_in.c). */
engine_fence *kvf__fence_reenter(struct kvf_engine *e, uint64_t tag, uint64_t epoch);
void kvf__fence_leave(struct kvf_engine *e, engine_fence *x);
/* A chunk of `bytes` for the pair began landing at t0 and landed at t1 (ns,
 * clock_now_ns); `how` is KVF__FENCE_TCP or KVF__FENCE_READ (async.h). Called
 * while the receiver still holds x, before the chunk's trailer is handed
 * over, so whoever sees the room's completion sees these. No lock. */
void kvf__fence_landed(engine_fence *x, int64_t t0, int64_t t1, uint64_t bytes, int how);
/* A receiver of an admitted chunk checks its destinations against the
 * fence's bounds between _begin (which takes the table's lock; 1 = the pair
 * closed meanwhile: refuse) and _end (which lets it go); _ok says whether
 * every piece of a (strided) block lies inside one bound (always, for a
 * fence without bounds). */
int kvf__fence_bounds_begin(struct kvf_engine *e, engine_fence *x);
int kvf__fence_bounds_ok(const engine_fence *x, uint64_t dst, uint64_t len, uint64_t count, uint64_t stride);
void kvf__fence_bounds_end(struct kvf_engine *e);
/* The pairs open now: every epoch below *next was handed out by this
 * process, and one of this engine's that is not in *epochs (malloc'd, the
 * caller frees it) is closed for good. Any thread. */
int kvf__fence_snapshot(struct kvf_engine *e, uint64_t *next, uint64_t **epochs, size_t *n);

/* ---- batches ---- */
typedef struct kvf_batch {
  struct kvf_engine *engine;
  uint64_t tag, epoch; /* kvf_batch_opts: 0 = untagged */
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int pending; /* chunks not yet acknowledged or failed */
  int status;  /* first error, or 0 */
  int64_t deadline_ns;
  uint64_t bytes;
  int device_src; /* the highest region.device of its sources: TCP refuses 1 and 2, UCX 2 */
  int counted;    /* stats recorded once */
  /* kvf__engine_submit_cb: called once when pending reaches 0, then the
   * batch is freed (no handle was given out) */
  void (*on_done)(void *arg, int status);
  void *on_done_arg;
  struct kvf__batch_group *group; /* told when the batch ends (async.h), or NULL */
} kvf_batch;

/* Descriptors a chunk holds without an allocation of their own (a short
 * room's chunk has a few). */
#define CHUNK_INLINE_WRITES 16

/* A contiguous part of a batch sent on one connection. Descriptors are owned
 * by the chunk. Chunks and batches are recycled through the engine's spare
 * lists (kvf_engine.spare_*). */
typedef struct chunk {
  struct chunk *next;
  atomic_int refs;   /* the transport may hold one while it sends */
  atomic_int status; /* its first error (kvf__chunk_finish, kvf__chunk_fail), or 0 */
  kvf_batch *batch;
  kvf_write *writes; /* inline_writes, or allocated when more are needed */
  int writes_kept;   /* writes holds ENGINE_MAX_DESC_PER_CHUNK and goes back to spare_writes */
  size_t n;
  uint64_t bytes;
  uint64_t seq;
  /* NULL or trailer_buf: delivered to the target's trailer callback after
   * the bytes (async.h) */
  unsigned char *trailer;
  uint32_t tlen;
  kvf_write inline_writes[CHUNK_INLINE_WRITES];
  unsigned char trailer_buf[KVF_ENGINE_MAX_TRAILER];
} chunk;

void kvf__batch_chunk_done(kvf_batch *b, int status);
uint64_t kvf__write_block_bytes(const kvf_write *w);

/* ---- transports ---- */
typedef struct transport_ops {
  const char *name;
  int (*start)(struct kvf_engine *e);
  void (*stop)(struct kvf_engine *e);
  /* Queue the chunks of one batch to `session`; each chunk later reports
   * through kvf__batch_chunk_done. On error nothing was queued. */
  int (*submit)(struct kvf_engine *e, const char *session, chunk **chunks, size_t nchunks);
  /* Optional hooks (NULL in tcp). reg/dereg follow a region into and out of
   * the table; serve takes a TCP_UCX_HELLO_MAGIC connection on the
   * listener after its token was accepted: 1 when it keeps the socket (it
   * closes it later; the listener's thread and slot are let go), 0 when it
   * refused it (the listener closes it); describe writes which transport
   * `session` uses and why;
   * alloc_pool/free_pool place a pool in memory peers can map. */
  int (*reg)(struct kvf_engine *e, void *addr, size_t len);
  void (*dereg)(struct kvf_engine *e, void *addr);
  int (*serve)(struct kvf_engine *e, int fd, const char *peer, unsigned hello_flags);
  int (*describe)(struct kvf_engine *e, const char *session, char *out, size_t cap);
  /* Optional: kvf__engine_peer_path (without it: "tcp", "tcp"). */
  int (*path)(struct kvf_engine *e, const char *session, const char **transport, const char **mode);
  int (*alloc_pool)(struct kvf_engine *e, size_t len, void **out);
  int (*free_pool)(struct kvf_engine *e, void *addr);
  /* Optional: a one-sided transport's part of kvf_engine_fence_close (the
   * pair is already refused by the table): returns once no writer can
   * write for it any more, or `until_ns` passed. */
  int (*fence_close)(struct kvf_engine *e, uint64_t tag, uint64_t epoch, int64_t until_ns);
  /* Optional: kvf_engine_peer_routes. */
  int (*routes)(struct kvf_engine *e, char *out, size_t cap);
} transport_ops;

extern const transport_ops kvf__tcp_transport_ops;
#ifdef KVF_HAVE_UCX
/* The UCX transport (ucx*.c): runs kvf__tcp_transport_ops underneath for the
 * listener, the rendezvous and the peers it routes to TCP. */
extern const transport_ops kvf__ucx_transport_ops;
#endif

typedef struct engine_counters {
  atomic_ullong batches_sent, bytes_sent, batches_failed;
  atomic_ullong batches_received, bytes_received, batches_refused;
  atomic_ullong auth_refused, protocol_errors, conns_refused;
  atomic_ullong conns_timed_out, conns_evicted;
  atomic_ullong peers_ucx, peers_tcp; /* writer side: routing decisions per peer */
  atomic_ullong chunks_fenced;
  atomic_ullong peers_read, reads_refused, reads_late, bytes_read_direct, bytes_mapped_ahead;
} engine_counters;

/* An address range (pools from kvf_engine_alloc_pool, registrations
 * nested in them). */
typedef struct engine_span {
  uint64_t base, len;
} engine_span;

typedef struct kvf_engine {
  kvf_engine_config cfg;
  char host[KVF_ADDR_HOST_LEN];
  char auth_token[256];
  uint16_t port;
  char session_id[KVF_ADDR_LEN];
  region_table regions;
  engine_fences fences;
  engine_counters stats;
  atomic_ullong sync_point; /* see kvf_engine_sync */
  const transport_ops *ops;
  void *transport;  /* transport-private state */
  void *ucx;        /* UCX transport state (ucx.c), beside the tcp state */
  int ucx_explicit; /* transport "ucx" was asked for (not "auto") */
  int ucx_read;     /* ucx_mode "read": UCX peers read from each other (ucx_read.c) */
  /* target side: the trailer callback (async.h); transports call it under
   * the read lock, setting it takes the write lock */
  pthread_rwlock_t trailer_lock;
  kvf__trailer_fn trailer_cb;
  void *trailer_arg;
  kvf__refusal_fn refusal_cb; /* under trailer_lock as well */
  void *refusal_arg;
  kvf__landed_fn landed_cb; /* under trailer_lock as well; landed_on says it is set */
  void *landed_arg;
  atomic_int landed_on;
  /* Pools the engine allocated, and registrations that lie inside one (a
   * manager registering memory it was given from a pool): those are counted
   * here, the pool's region already covers them. Under pools_mu. */
  pthread_mutex_t pools_mu;
  engine_span *pools, *nested;
  size_t npools, cap_pools, nnested, cap_nested;
  atomic_int lock_refused; /* a pool's mlock was refused (logged once; lock_pools) */
  /* Finished batches and chunks kept for the next transfers (no allocation
   * per transfer once warm). Under spare_mu. */
  pthread_mutex_t spare_mu;
  spare_list spare_batches, spare_chunks;
  /* Descriptor arrays of large chunks (ENGINE_MAX_DESC_PER_CHUNK each, at
   * most ENGINE_KEEP_WRITES) kept for the next ones: freed, glibc gave such
   * arrays back to the kernel and every large transfer faulted them in
   * again (engine.c, chunk_new). */
  spare_list spare_writes;
  /* Submits that must connect first, one connector thread per session being
   * connected (connector.c). Under conn_mu; connect_stop ends them. */
  pthread_mutex_t conn_mu;
  pthread_cond_t conn_cv;
  struct engine_connector *connectors;
  atomic_int nconnectors; /* changed under conn_mu; read without it: none runs, nothing to look up */
  atomic_int connect_stop;
} kvf_engine;

/* Hand the chunks of one batch to the transport (connector.c): on the
 * caller's thread unless the transport's submit would have to wait on the
 * network (KVF__SUBMIT_WOULD_BLOCK) or the session's connector thread holds
 * earlier batches; then queued to that connector, behind them, so one
 * thread's batches to a session keep their order. 0, or the transport's
 * error (nothing was queued then). */
int kvf__engine_dispatch(kvf_engine *e, const char *session, chunk **chunks, size_t nchunks);
/* A transport's submit returns this, having touched no chunk, where it
 * would have to wait on the network (connect, or ask the peer for its
 * regions) on a thread that may not (kvf__engine_may_block() is 0):
 * kvf__engine_dispatch then hands the batch to the session's connector. */
#define KVF__SUBMIT_WOULD_BLOCK 1
int kvf__engine_may_block(void);
/* Take a transport's per-session lock for a submit. The lock is held long
 * only by a submit that connects (`connecting` set meanwhile): a thread that
 * may not wait on the network gets KVF__SUBMIT_WOULD_BLOCK instead of
 * waiting behind it (0: locked). */
int kvf__engine_submit_lock(pthread_mutex_t *mu, const atomic_int *connecting);
/* Stop the connector threads: a connect in progress gives up within a
 * slice (KVF__CONNECT_SLICE_MS), queued batches fail with KVF_ECLOSED.
 * Returns once none runs. Before the transport stops. */
void kvf__engine_connectors_stop(kvf_engine *e);

/* Wait until fd is ready for `ev` (POLLIN, POLLOUT) or the deadline passes
 * (KVF_ETIMEDOUT). On a connector thread it also gives up once the engine
 * stops its connectors (KVF_ECLOSED), looking every KVF__CONNECT_SLICE_MS. */
int kvf__fd_wait(int fd, short ev, int64_t deadline_ns);
/* Send `len` bytes / receive exactly `len` bytes before the deadline, on a
 * blocking or non-blocking socket (kvf__fd_wait between the tries). */
int kvf__fd_send_all(int fd, const void *buf, size_t len, int64_t deadline_ns);
int kvf__fd_recv_all(int fd, void *buf, size_t len, int64_t deadline_ns);

/* Target side: hand a chunk's trailer to the callback, if one is set (a
 * transport thread, after the chunk's bytes landed). */
void kvf__engine_deliver_trailer(kvf_engine *e, const unsigned char *data, size_t len, const char *peer);
/* Target side: report a refused tagged chunk to the refusal callback
 * (async.h); `peer` is "ip:port" or an IP address. */
void kvf__engine_deliver_refusal(kvf_engine *e, uint64_t tag, uint64_t epoch, int err, const char *peer);
/* The landed callback (async.h), if one is set: one relaxed load otherwise. */
void kvf__engine_deliver_landed(kvf_engine *e, uint64_t tag, uint64_t epoch, void *dst, size_t len);

/* A blocking TCP connection to host:port made within the deadline, with
 * TCP_NODELAY (tcp_out.c). 0 or KVF_ECONNREFUSED / KVF_ETIMEDOUT (or
 * KVF_ECLOSED: a connector thread told to stop, kvf__fd_wait). */
int kvf__tcp_connect(const char *host, uint16_t port, int64_t deadline_ns, int *fd_out);

/* Split [writes, n) into at most `max_chunks` chunks of roughly equal bytes,
 * each with at most `max_desc` descriptors; a single large block may be cut
 * into pieces. Chunks are taken from b's engine (b->engine may be NULL:
 * allocated) and linked to `b`. The list is `buf` (bufcap entries, may be
 * NULL) when it fits, else allocated: the caller frees *out if it is not
 * buf. */
int kvf__engine_make_chunks(kvf_batch *b, const kvf_write *writes, size_t n, size_t max_chunks, size_t max_desc,
                            chunk **buf, size_t bufcap, chunk ***out, size_t *nout);
void kvf__chunk_free(chunk *c);
/* The chunk's outcome is known (an ack, a failure): record it and drop the
 * owner's reference. Called exactly once per submitted chunk. */
void kvf__chunk_finish(chunk *c, int status);
/* Record err as the chunk's outcome unless it already has an error (a
 * success never overwrites one): its sender's failure after the target
 * acknowledged it too early still fails it. */
void kvf__chunk_fail(chunk *c, int err);
/* Drop a reference taken while sending. Whoever drops the last one reports
 * the outcome to the batch, so the batch completes only after the sending
 * thread is done reading the source memory (an ack can arrive before the
 * sendmsg call that carried the last byte has returned). */
void kvf__chunk_release(chunk *c);

/* A strided block whose destination pieces overlap (count > 1 and
 * dst_stride < len: each piece overwrites the last) is refused on both
 * sides: by the writer's submit (KVF_EINVAL) and by a UCX target reading a
 * notice (KVF_EPROTO), so the bytes a block moves never exceed the
 * destination memory it spans, whatever count a peer sends. */
static inline int kvf__write_overlaps(const kvf_write *w) {
  return w->count > 1 && w->len && w->dst_stride < w->len;
}

#endif

/* Completion callbacks for engine writes, for the KV managers: a transfer
 * whose completion is handled where the transport learns it (the thread that
 * reads the peer's acknowledgement), instead of a thread blocked in
 * kvf_batch_wait that must wake up to pass it on. */
#ifndef KVF_ENGINE_ASYNC_H
#define KVF_ENGINE_ASYNC_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "kvferry/engine.h"

/* A completion trailer: opaque bytes a writer may attach to a batch, which
 * the target engine hands to its trailer callback once the batch's bytes
 * have landed in its memory, before it acknowledges them (between kvferry
 * peers: a room's completion riding behind its data, docs/WIRE-EXTENSIONS.md).
 * Only a batch that travels as one transport chunk (under the engine's
 * split size) carries it; a larger one drops it, so a trailer is an
 * optimisation that must never be the only way a completion gets there. */
#define KVF_ENGINE_MAX_TRAILER 1024

/* Target side: `data` (len bytes, valid during the call) arrived from `peer`
 * (its IP address) behind a chunk whose bytes are in place. Runs on a
 * transport receive thread: must not block for long. */
typedef void (*kvf__trailer_fn)(void *arg, const unsigned char *data, size_t len, const char *peer);

/* Set the engine's one trailer callback: KVF_EEXIST when another is set
 * (a shared engine: the first manager gets it). Any thread. */
int kvf__engine_on_trailer(kvf_engine *engine, kvf__trailer_fn cb, void *arg);
/* Unset it if `arg` set it; returns once no call to it is running. Any
 * thread but the callback's. */
void kvf__engine_off_trailer(kvf_engine *engine, void *arg);

/* Target side: a tagged chunk for the open pair (tag, epoch) from `peer`
 * (its IP address) was refused before any byte landed: `err` is KVF_ERANGE
 * (outside registered memory or the fence's bounds) or KVF_EPROTO (sizes
 * that do not add up). Only a writer that knows the pair's epoch gets
 * here, so the owner may give the pair's work up. Runs on a transport
 * thread: must not block for long. A closed fence (KVF_ESTATE) is not
 * reported: its owner closed it. */
typedef void (*kvf__refusal_fn)(void *arg, uint64_t tag, uint64_t epoch, int err, const char *peer);

/* Set / unset the engine's one refusal callback, as the trailer callback. */
int kvf__engine_on_refusal(kvf_engine *engine, kvf__refusal_fn cb, void *arg);
void kvf__engine_off_refusal(kvf_engine *engine, void *arg);

/* Batches whose ends one thread waits for together (a fan-out chunk's
 * writes to its destinations): a single wake-up when the last one ends, or
 * at the first that fails, instead of one per batch waited for in turn. The
 * owner keeps its batch handles (kvf_batch_wait and kvf_batch_destroy work
 * as usual) and may reuse the group once every batch in it was destroyed. */
typedef struct kvf__batch_group {
  pthread_mutex_t mu;
  pthread_cond_t cv;
  int pending;         /* batches of the group not ended */
  int failed;          /* one ended with an error */
  int64_t deadline_ns; /* the latest of their deadlines */
  int poked;           /* kvf__batch_group_poke since the last poke-aware wait returned */
} kvf__batch_group;
/* 0 or KVF_ENOMEM. */
int kvf__batch_group_init(kvf__batch_group *g);
void kvf__batch_group_destroy(kvf__batch_group *g);
/* Empty it for the next batches (none of its earlier ones still alive). */
void kvf__batch_group_reset(kvf__batch_group *g);
/* Block until every batch submitted into the group ended, one failed, or
 * a second past their latest deadline (the transports fail them by then).
 * The caller then takes each batch's outcome with kvf_batch_wait, which no
 * longer sleeps unless a failure woke it early. Any one thread. */
void kvf__batch_group_wait(kvf__batch_group *g);
/* The same wait, given up at until_ns: 1 when it ended as above, 0 when
 * until_ns came first (the batches go on). */
int kvf__batch_group_wait_until(kvf__batch_group *g, int64_t until_ns);
/* The same wait, also ended by kvf__batch_group_poke (from another thread,
 * before or during it): KVF__GROUP_ENDED as above, KVF__GROUP_POKED when a
 * poke came first (the poke is taken), 0 when until_ns came first. A
 * thread that waits for its writes and for new work at once (a transfer
 * worker's window, prefill/workers.c) is poked when work comes. */
enum { KVF__GROUP_ENDED = 1, KVF__GROUP_POKED = 2 };
int kvf__batch_group_wait_pokeable(kvf__batch_group *g, int64_t until_ns);
void kvf__batch_group_poke(kvf__batch_group *g);

/* Holding a burst's small sends: a thread about to submit several chunks
 * in a row (the prefill's listener, one per M2 of a burst) asks the
 * transports to hold what each would send on its own (UCX read notices go
 * with MSG_MORE) and push it all at kvf__engine_hold_end, so the burst
 * costs the target one segment and one wake-up, not one per chunk. The
 * held bytes are already in the kernel's socket buffers: nothing but the
 * push waits on this thread, and a send from any other thread pushes them
 * too. What a blocking send on this thread would delay is bounded by the
 * kernel's own hold (about 200 ms): kvf__engine_hold_flush before such a
 * send where the caller can (the listener's blocking control sends), and
 * a notice to a full socket, which waits under its peer's lock, goes
 * without MSG_MORE and pushes its own. Thread-local; _end outside a hold
 * does nothing. */
void kvf__engine_hold_begin(void);
void kvf__engine_hold_end(void);
/* Push what is held so far and hold on: before this thread does anything
 * that may wait (a blocking control-plane send), with no engine lock held. */
void kvf__engine_hold_flush(void);
/* For transports: while this thread holds, register push(arg) to run at
 * kvf__engine_hold_end (once per pair) and answer 1: send with the data
 * held. 0 outside a hold or when the hold's list is full: send as usual. */
int kvf__engine_hold_add(void (*push)(void *), void *arg);

/* Target side: bytes [dst, dst + len) of a tagged chunk for the open pair
 * (tag, epoch) are in place, called on the thread that put them there
 * right after it did (so they are still in its cache), before the chunk is
 * acknowledged. Verify mode hashes them here instead of reading them back
 * later (integrity.c). Only where this engine's CPU lands the bytes: TCP
 * receives and UCX read-mode loads from a mapped pool; not for ucp_get or a
 * writer's put. Runs on transport threads, several at once: must not
 * block. */
typedef void (*kvf__landed_fn)(void *arg, uint64_t tag, uint64_t epoch, void *dst, size_t len);

/* Set / unset the engine's one landed callback, as the trailer callback. */
int kvf__engine_on_landed(kvf_engine *engine, kvf__landed_fn cb, void *arg);
void kvf__engine_off_landed(kvf_engine *engine, void *arg);

/* kvf_engine_submit_ex's arguments and what only the library adds to them
 * (a trailer, a completion callback), for kvf__engine_submit_req. */
typedef struct kvf__submit {
  const char *session;
  const kvf_write *writes;
  size_t n;
  const kvf_batch_opts *opts; /* NULL = defaults */
  /* A trailer (NULL/0 = none; at most KVF_ENGINE_MAX_TRAILER bytes): copied,
   * delivered to the target's trailer callback with the batch's last byte
   * when the batch is one transport chunk. */
  const void *trailer;
  size_t tlen;
  /* Set: no batch handle; the engine calls on_done(arg, status) exactly
   * once, when every block is confirmed (0) or one failed (a KVF_E*
   * error), on a transport thread, or on the calling thread before the call
   * returns (nothing to move, or a quick peer). The source memory must stay
   * valid until then. on_done must not block for long (it runs on the
   * thread that reads acknowledgements). On error on_done is never called
   * and nothing was sent. With a trailer, *carried (may be NULL) is set to 1
   * before on_done can run when the trailer goes with the batch, so
   * on_done(0) means the target's trailer callback has had it; 0 when it was
   * dropped. */
  void (*on_done)(void *arg, int status);
  void *arg;
  atomic_int *carried;
  /* Without on_done: the batch joins this group (NULL: none) until it ends. */
  kvf__batch_group *group;
} kvf__submit;

/* Submit s: with s->on_done, out is unused (NULL); without, the caller owns
 * *out (kvf_batch_wait, kvf_batch_destroy). The blocks and the trailer are
 * copied. Never blocks on the network. Any thread. */
int kvf__engine_submit_req(kvf_engine *engine, const kvf__submit *s, kvf_batch **out);

/* kvf__engine_submit_req without on_done, then wait: blocks as
 * kvf_engine_write. Any thread. */
int kvf__engine_write_req(kvf_engine *engine, const kvf__submit *s);

/* The path the engine chose for the peer `session`, as static strings:
 * *transport "tcp" or "ucx", *mode "tcp", "read" (the target reads each
 * chunk) or "write" (one-sided puts). KVF_ENOTFOUND before the first
 * transfer to it chose one. Any thread. */
int kvf__engine_peer_path(kvf_engine *engine, const char *session, const char **transport, const char **mode);

/* kvf_engine_fence_close for a pair whose writes all completed (the room
 * ended Success: its writers flushed before they said so): the same over
 * tcp, but one-sided writers (UCX) are not asked to confirm, which saves a
 * round trip to each of them. Any thread. */
int kvf__engine_fence_retire(kvf_engine *engine, uint64_t tag, uint64_t epoch, int timeout_ms);

/* A fence's bounds in the shape of a room: the same runs of item indices
 * (pages, or state slots) in each of a set of buffers. It costs
 * O(buffers + runs) to hold and one search per piece to check, where the
 * byte ranges it stands for number buffers x runs (a scattered room of 32k
 * pages over 160 KV buffers: 5 million ranges, 82 MB, built per room).
 * A piece lies in the grid when it lies inside one run of one buffer:
 * [base + first * item, base + (first + count) * item), cut at the last
 * whole item of the buffer. */
typedef struct kvf__fence_grid {
  const uint64_t *bufs;  /* nbufs (base, len, item) triples, sorted by base; they may overlap */
  const uint64_t *reach; /* nbufs: reach[i] is the largest base + len of bufs 0..i */
  size_t nbufs;
  const uint64_t *runs; /* nruns (first, count) pairs of item indices, sorted by first, disjoint */
  size_t nruns;
} kvf__fence_grid;

/* Bound what a tagged batch for the open pair (tag, epoch) may write (or,
 * in UCX read mode, have read) here: every destination piece must lie
 * inside one run of one buffer of one of the n grids; a chunk outside them
 * is refused whole (KVF_ERANGE) before any byte lands. Nothing is copied:
 * the grids and what they point to must stay valid and unchanged until the
 * pair's kvf_engine_fence_close or kvf__engine_fence_retire returned. n == 0
 * removes the bound; grids without runs let nothing land. KVF_ENOTFOUND
 * when the pair is not open. Any thread. */
int kvf__engine_fence_bound_grids(kvf_engine *engine, uint64_t tag, uint64_t epoch, const kvf__fence_grid *grids,
                                  size_t n);
/* The same with n plain byte ranges (base, len pairs: ranges[2i],
 * ranges[2i+1]), sorted by base and disjoint: one grid whose only buffer is
 * the whole address space with 1-byte items. */
int kvf__engine_fence_bound(kvf_engine *engine, uint64_t tag, uint64_t epoch, const uint64_t *ranges, size_t n);

/* What landed here for the open pair (tag, epoch) so far (room traces,
 * issue 25): when the first chunk began landing and the last one landed
 * (clock_now_ns; 0 = none), bytes and chunks, and how the last one came
 * (KVF__FENCE_TCP: a TCP receive; KVF__FENCE_READ: this engine read it over
 * UCX; 0: nothing seen, e.g. one-sided UCX writes). KVF_ENOTFOUND when the
 * pair is not open. Any thread. */
enum { KVF__FENCE_TCP = 1, KVF__FENCE_READ = 2 };
typedef struct kvf__fence_stats {
  int64_t first_ns, last_ns;
  uint64_t bytes, chunks;
  int how;
} kvf__fence_stats;
int kvf__engine_fence_stats(kvf_engine *engine, uint64_t tag, uint64_t epoch, kvf__fence_stats *out);

#endif

/* The prefill half of a KV manager (PROTOCOL §1.5, §3.3-§3.5, §6, §7.4),
 * private to src/kv/prefill/: its state, records and cross-file functions.
 * Files: lifecycle.c (start, stop, PUT /route), listener.c (M1, M2, fence),
 * rooms_early.c (room records, early rooms, pending chunks, M3 helpers),
 * sender.c (the kvf_sender API), workers.c (queues and process_chunk),
 * chunk_plan.c (the one per-destination send path: pages to engine writes),
 * verify_send.c (its verify-mode step), direct.c (direct transfers).
 *
 * In short:
 * the PUT /route registration at startup, the listener's handling of M1
 * (decode registrations, keyed by session) and M2 (transfer requests, per
 * room and session), the senders the scheduler drives, and queue_size
 * transfer workers that turn chunks into engine writes and report M3.
 *
 * Tables and bounds. A room is one object, the manager's room table's
 * (kv/rooms.h): status, reason and the rest there, and the prefill's own
 * per-room data, `pf_room`, hung on it as its user pointer and found through
 * it by room id (kvf__pf_room_find). The prefill's data sits behind one
 * mutex (ps->lock): registrations (at most PF_MAX_SESSIONS sessions), the
 * pf_rooms and their transfer infos in arrival order (at most PF_MAX_INFOS).
 * An M2 may arrive before its sender exists (a legitimate race): it is
 * stored in a pf_room without a sender, in the table's early state (not
 * live; issue 13 defect 6). Each early room is charged to the decode session
 * whose M2 created it; a session holds at most PF_MAX_EARLY_PER_SESSION of
 * them and all sessions together at most PF_MAX_EARLY, and the copies of
 * their M2s (up to 8 MiB of indices each) at most
 * PF_MAX_EARLY_BYTES_PER_SESSION and PF_MAX_EARLY_BYTES bytes, so one
 * flooding decode can neither starve the others nor exhaust memory. Early rooms sit on one LRU list (a repeat
 * M2 moves its room to the tail); each M2 drops at most PF_EXPIRE_PER_MSG
 * rooms idle past the waiting timeout from the head (the decode has given
 * up on them by then), so every M2 costs O(1); the listener's tick drops
 * them too when no M2 comes. An M2 that would need an
 * early room past a bound is refused: its decode gets M3 Failed with the
 * reason (kvferry frame 5) at once instead of waiting. kvf_sender_create
 * makes an early room live (it keeps its pf_room); only live rooms count in
 * kvf_manager_get_stats' live_rooms (senders), early ones in rooms_early.
 *
 * Lifetime. A pf_room is reference counted: one reference for its place in
 * the room table and one per chunk that is pending on it or queued/being
 * processed. Destroy clears the room from the table and marks the pf_room
 * dead; a worker that still holds a chunk sees `dead` and drops it, and every call into m->rooms that names
 * the room by id is made under ps->lock after checking `dead`, so a room id
 * reused by a new sender is never touched by an old chunk. Transfer infos
 * are reference counted too, because a repeated M2 replaces one while a
 * worker may be using it. Room and sender records that nothing refers to
 * any more are kept (PF_SPARE_ROOMS each) and reused, and the planning
 * arrays are per worker and grow-only, so a warm manager allocates per room
 * only the M2's copy, a queued chunk's copy (worker path) and the engine's batch.
 * Lock order (the rule of kv/rooms.h): ps->lock, then a queue's lock, then
 * the room table's leaf lock; the table's early/live state and its user
 * pointers change only under ps->lock, so a pf_room found by id stays valid
 * while ps->lock is held. Nothing that blocks (engine writes, M3 sends)
 * runs under ps->lock.
 *
 * Chunks sent before every M2 arrived wait on the room (`pending`) and are
 * queued, in order, when the room becomes Bootstrapped; the sender's poll
 * fails the room after bootstrap_timeout_s in Bootstrapping (which the
 * reference never does, §8 item 2). The queue shard is fixed when the room
 * becomes Bootstrapped, so every chunk of a room runs on one queue, in order
 * (on the thread that holds the room: workers.c).
 *
 * decode_prefix_len (§6.8): kvf_sender_send's pages are the request's full
 * page list, chunk after chunk; the worker skips the first
 * decode_prefix_len / page_size positions (those the decode already holds)
 * and maps position p >= P onto the decode's destination index p - P, as
 * the reference scheduler does before submitting. With a prefix of 0 this is
 * the identity. A layerwise chunk (KVF_SEND_LAYERS) instead names the destination index
 * of its first page itself (the reference's send_layerwise index_slice, the
 * scheduler having already skipped the prefix): such a chunk (`explicit_idx`)
 * maps pages[k] onto destination index pos + k with no skip.
 *
 * Layerwise sends (§6.9, §6.10): a chunk carries the KV layer range
 * [layer_begin, layer_end) it writes; kvf_sender_send's chunks cover every
 * layer. There is no device step counter: the caller submits a layer group
 * once its KV is written, so no worker ever waits on the device (§8 item 2).
 * A room's chunks run in order on one worker, so when the is_last chunk
 * completes, every earlier layer group has landed; Success and the M3 come
 * only then. State buffers go with the chunk that carries state slots: the
 * last chunk, or a layerwise chunk, which then writes the state buffers of
 * its layer range when the manager has state_layer_ids (every state buffer
 * without), so a layer group's recurrent state leaves with its KV (§6.10).
 *
 * Deviations from the reference, on purpose: an M2 from an unregistered
 * session is rejected at the listener (§8 item 3); a decode whose KV pointer
 * count differs from ours fails the room with a reason instead of indexing
 * past its list; a dummy destination makes the room Success on the last
 * chunk only when the room has no real destination (otherwise Success comes
 * from the real transfers, so a dummy cannot report Success before the data
 * landed). L1.5 partial-cache indices (§6.3 modes other than OFF/OFF) are not
 * supported: such a request fails the room with a reason.
 *
 * First-token hand-off (§6.9, §6.11 metadata wait). The token usually rides
 * on the last chunk. A last chunk sent with KVF_SEND_TOKEN_LATER (layerwise:
 * the last layer group goes out before sampling) instead parks the room once
 * it landed on every required destination: the worker stores those
 * destinations in the room (`park`) and moves on, so no worker ever waits
 * for a token. kvf_sender_set_metadata stores the token (first wins) and, if
 * the room is parked, makes it Success and sends the M3s; published before
 * the chunk lands, the worker uses it at once. The reference waits forever;
 * kvferry bounds the wait in kvf_sender_poll: bootstrap_timeout_s after the
 * chunk landed the room fails and the parked destinations get M3 Failed. A
 * parked room that failed another way (abort sends its own M3s and unparks)
 * gets M3 Failed from the next poll. A destroyed room just drops its park. */
#ifndef KVF_KV_PREFILL_INT_H
#define KVF_KV_PREFILL_INT_H

#include <errno.h>
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "base/config.h"
#include "base/hash.h"
#include "base/log.h"
#include "base/map.h"
#include "base/parse.h"
#include "base/wake.h"
#include "bootstrap/bootstrap.h"
#include "engine/async.h"
#include "kv/integrity.h"
#include "kv/manager.h"
#include "kv/plan.h"
#include "kv/rooms.h"

#define PF_TOKEN_LATER (-2)                         /* a chunk's token: "comes through kvf_sender_set_metadata" */
#define PF_MAX_SESSIONS 4096                        /* registered decode sessions */
#define PF_MAX_INFOS 4096                           /* transfer infos (decode sessions) per room */
#define PF_MAX_EARLY 65536                          /* rooms with M2s but no sender yet, all sessions together */
#define PF_MAX_EARLY_BYTES (1024u << 20)            /* bytes of M2 copies in early rooms, all sessions together */
#define PF_MAX_EARLY_BYTES_PER_SESSION (256u << 20) /* ... charged to one decode session */
#define PF_EXPIRE_PER_MSG 4                         /* idle early rooms dropped per M2 at most */
#define PF_EARLY_SWEEP_MS 1000                      /* the listener's tick drops idle early rooms this often */
#define PF_EARLY_SWEEP_ROUNDS 64                    /* ... PF_EXPIRE_PER_MSG at a time, at most this many times */
#define PF_MAX_ENDED 4096                           /* rooms remembered as ended by kvf_sender_destroy */
#define PF_MAX_PENDING 65536                        /* chunks waiting on one room for its M2s */
#define PF_QUEUE_MAX 65536                          /* chunks in one worker FIFO */
#define PF_DIRECT_MAX_BYTES (16u << 20)             /* a room's only chunk up to this size skips the worker */
#define PF_DIRECT_MAX_DESTS 8                       /* ... when it has at most this many destinations */
#define PF_DIRECT_SLOTS 256                         /* direct chunks in flight per prefill rank */
#define PF_SPARE_ROOMS 4096                         /* unreferenced room records kept for reuse */
#define PF_DIRECT_DRAIN_MS 120000                   /* stop: wait this long for direct chunks' engine callbacks */
#define PF_SPARE_INFOS 4096                         /* unreferenced transfer infos kept for reuse */
#define PF_SPARE_M2_BYTES (16u << 10)               /* ... each keeping its M2 copy's block only up to this size */
#define PF_CHUNK_INLINE_PAGES 16                    /* pages a chunk holds without an allocation */
#define PF_CHUNK_INLINE_STATE 4                     /* state slots a chunk holds without an allocation */
#define PF_WORKER_WINDOW 4     /* chunks a worker keeps in flight before waiting (workers.c) */
#define PF_QUEUE_THREADS 4     /* threads that may serve one queue, the first included (workers.c) */
#define PF_HELPER_IDLE_MS 2000 /* a queue's extra thread ends after this long with nothing to do */
#define PF_SLOW_WAIT_MS 200    /* a worker waiting this long may get another thread (workers.c) */
#define PF_M3_BATCH 32         /* deferred M3s held at most; a full queue goes out at once */
#define PF_M3_DEFER_MS 2       /* a deferred M3 goes out within about this long (m3_outbox.c) */

/* Bytes of a failed session's first reason kept (with NUL): the rooms the
 * failed-session TTL fails quote it after the reference's own words. */
#define PF_FAILED_WHY_MAX 192

typedef struct pf_reg {               /* one decode registration (M1) */
  wire_m1 *m1;                        /* heap copy (kvf__wire_m1_dup) */
  int64_t failed_ns;                  /* monotonic time of the last transfer error; 0 = not failed (§7.4) */
  char failed_why[PF_FAILED_WHY_MAX]; /* that error, quoted by the rooms the TTL then fails */
  size_t nearly;                      /* early rooms charged to this session */
  size_t early_bytes;                 /* their M2 copies' bytes */
  int64_t used_ns;                    /* its last M1 or M2: the table, when full, drops the oldest */
  uint64_t gen;                       /* which M1 of the session this is (prefill_state.reg_gen at it) */
  uint64_t mem;                       /* a digest of its buffer addresses (kvf__pf_reg_mem) */
} pf_reg;
/* A digest of the buffer addresses an M1 registers: an M2 planned against
 * other ones (the session registered again, e.g. a restarted decode under
 * the same session id) names pages of memory that is no longer there. */
uint64_t kvf__pf_reg_mem(const wire_m1 *m1);

typedef struct pf_info { /* one M2, shared with workers */
  int refs;
  wire_m2 *m2;   /* heap copy (kvf__wire_m2_dup_into) */
  size_t m2_cap; /* its block's size, kept while the record waits on ps->info_spare */
  struct pf_info *next_spare;
  /* its plan, checked once when the M2 arrives: m2->nfrags fragments, the
   * M2's own (m2->frags) or, when tokens > 1, their per-token cut (frags_cut) */
  const wire_fragment *frags;
  wire_fragment *frags_cut; /* owned; NULL unless tokens > 1 */
  int64_t tokens;           /* tokens per page the runs scale by; 0 = plan refused (plan_why) */
  char plan_why[200];
  /* It came once the room's chunks were being written (pf_room.written):
   * the earlier ones did not go to it, so no completion trailer does. */
  int late;
  /* The registration (pf_reg.gen) in place when it came: a failed write
   * marks the session failed only while that one still is. */
  uint64_t reg_gen;
  uint64_t reg_mem; /* and its pf_reg.mem: planned only against those buffers */
} pf_info;

/* Per destination of a chunk (fan-out), grow-only: its transfer info
 * (referenced while the chunk is written), its engine write in flight or
 * NULL, and the write's bytes; and the group those writes join, so that
 * the worker wakes once when the last of them ends (NULL: none, each is
 * waited for in turn). A worker's window slot takes these over from the
 * scratch (pf_flight). */
typedef struct pf_dest_writes {
  struct pf_info **infos;
  kvf_batch **batches;
  uint64_t *dbytes;
  size_t cap_infos, cap_batches, cap_dbytes;
  kvf__batch_group *group;
} pf_dest_writes;

/* Verify mode cuts a destination's KV pages (and, when the decode asked
 * for digests, its state slots) into this many parts, submitted at once and
 * finished in order: while later parts are on the wire, the prefill
 * rechecks the sources of the parts that landed and the decode checks their
 * digests, so hashing overlaps the transfer instead of following it. */
#define PF_VERIFY_PARTS 16

/* One part of a destination's writes (kvf__pf_plan_dest): its blocks
 * sc->w[w0, w0 + nw), its page pairs [a, a + n) of the KV window or of the
 * state slots, and (verify mode) its digest entries and engine write. */
typedef struct pf_part {
  int state; /* 0: KV pages; else state slots */
  size_t a, n;
  size_t w0, nw;
  size_t d0, nd; /* sc->dg[d0, d0 + nd) */
  kvf_batch *batch;
} pf_part;

/* A transfer context's arrays: the destination pointer lists sized once,
 * the rest grow-only (or fixed), so the hot path does not allocate per room. */
typedef struct pf_scratch {
  uint64_t *dptr, *sptr; /* n_kv, n_state */
  int64_t *src, *dst;
  size_t cap_src, cap_dst;
  plan_run *runs;
  size_t cap_runs;
  kvf_write *w;
  size_t cap_w, nw;
  /* the planned destination's parts (one each for KV and state outside
   * verify mode) and its window: chunk pages from `skip` go to the M2's
   * kv_indices from `dstart` */
  pf_part parts[2 * PF_VERIFY_PARTS];
  size_t nparts, skip;
  int64_t dstart;
  wire_digest *dg; /* verify mode: the digest entries of every part */
  size_t cap_dg;
  pf_dest_writes dw;
  /* per destination of the chunk: done (last chunk), its DEST_* outcome,
   * whether the engine took its completion trailer */
  size_t *done;
  int *res;
  atomic_int *carried;
  size_t cap_done, cap_res, cap_carried;
  struct pf_worker *worker; /* the worker thread whose scratch this is (NULL: the direct path's) */
} pf_scratch;

typedef struct pf_chunk {
  struct pf_chunk *next;
  struct pf_room *r; /* holds a room reference once queued or pending */
  int64_t *pages;
  size_t npages;
  int64_t pos;                   /* index_slice start: position of pages[0] in the request's page list,
                        or (explicit_idx) in the decode's destination list */
  int explicit_idx;              /* pos is a destination index: no decode-prefix skip */
  size_t layer_begin, layer_end; /* KV layer indices written: [layer_begin, layer_end) */
  int is_last;
  int64_t aux_index;
  int64_t token;
  int32_t *cands;
  size_t ncand;
  int64_t *state_slots;
  size_t nstate;
  /* Verify mode: the digest of every (page, KV buffer of the chunk's
   * layers) taken in kvf_sender_send, digests[k * ndig + j] for pages[k]
   * and buffer dig_bufs[j]; NULL when verify mode is off. The sending
   * thread hashes them after it queued the chunk, so the first bytes move
   * while it hashes: digests of pages [0, hashed) are final (the worker
   * waits for more with kvf__pf_wait_hashed). While it hashes it holds the
   * chunk (hold PF_HOLD_HASHING): a kvf__pf_chunk_free meanwhile leaves the
   * free to it (PF_HOLD_FREED). */
  uint64_t *digests;
  size_t *dig_bufs;
  size_t ndig;
  _Atomic size_t hashed;
  atomic_int hold;
  /* Verify mode, set by the worker: every destination asked for digests
   * and gets the send-time page digests (whole-page plans), so it checks
   * its landed bytes against what kvf_sender_send hashed; the recheck of the
   * sources then runs after the M3s instead of before (see workers.c). */
  int recheck_late;
  /* Where pages, candidates and state slots go when few (a short room's
   * chunk: no allocation; chunks are recycled through ps->chunk_spare). */
  int64_t pages_inline[PF_CHUNK_INLINE_PAGES];
  int64_t state_inline[PF_CHUNK_INLINE_STATE];
  int32_t cands_inline[KVF_MAX_CANDIDATES];
} pf_chunk;

typedef struct pf_dest { /* where an M3 goes */
  char host[WIRE_STR_MAX + 1];
  uint16_t port;
  uint64_t epoch; /* the fence epoch of that decode's M2 (0: none), sent back in M3 frame 6 */
} pf_dest;

/* Where the M3 for the decode that sent x goes (copied: x may be freed). */
void kvf__pf_dest_of(const wire_m2 *x, pf_dest *d);

/* An M3's contents (kvf__pf_send_m3). */
typedef struct pf_m3_msg {
  int64_t room;
  int status; /* ROOM_SUCCESS or ROOM_FAILED */
  int64_t token;
  const int32_t *cands;
  size_t ncand;
  const char *reason; /* kvferry's frame 5; NULL: none */
} pf_m3_msg;

typedef struct pf_m3 { /* a deferred M3 Success (m3_outbox.c) */
  pf_dest d;
  int64_t room, token;
  size_t ncand;
  int32_t cands[KVF_MAX_CANDIDATES];
} pf_m3;

typedef struct pf_room {
  int64_t room;
  int refs;
  size_t nchunks; /* chunks accepted from the sender */
  int busy;       /* chunks submitted to the engine and not finished: their reads of the sources may go on */
  int dead;       /* destroyed: chunks still holding it are dropped */
  int dead_told;  /* destroyed, and its decodes told Failed since (once: kvf__pf_dead_room_failed) */
  int has_sender;
  int bootstrapped;
  int written; /* a chunk of it was taken to be written, to the destinations known then (ps->lock) */
  int shard;
  /* Under its queue's lock: the worker thread that holds the room (one of
   * its chunks is being processed or in that worker's window: `held` of
   * them); only that thread takes its next chunk, so a room's chunks still
   * run in order on one thread (workers.c). */
  struct pf_worker *owner;
  int held;
  int64_t create_ns;             /* sender creation, for the bootstrap timeout */
  pf_reg *early_owner;           /* early room: the session it is charged to; NULL otherwise */
  size_t early_bytes;            /* early room: its M2 copies' bytes, charged to early_owner */
  struct pf_room *eprev, *enext; /* the early LRU list */
  int64_t last_m2_ns;
  pf_info **infos; /* arrival order */
  size_t ninfos, cap;
  pf_chunk *pend_head, *pend_tail;
  size_t npending;
  /* PF_TOKEN_LATER: the last chunk landed, waiting for the token */
  pf_dest *park; /* the completed destinations, NULL when not parked */
  size_t npark;
  atomic_int parked; /* park != NULL: kvf_sender_poll reads it without ps->lock */
  int64_t landed_ns;
  struct pf_room *next_spare; /* on ps->room_spare once unreferenced */
  /* The room's trace (kv/trace.h), finished when its last reference goes
   * (kvf__pf_room_unref), so a worker's last steps are in it. final_seen:
   * the sender's thread; tr_status/tr_reason: captured under ps->lock when
   * the sender is destroyed (tr_status -1: not captured, nothing recorded). */
  trace_live tr;
  int final_seen;
  int tr_status;
  char tr_reason[KVF_TRACE_REASON_MAX];
} pf_room;

/* A chunk whose writes a worker submitted and has not waited for yet (the
 * worker's window, workers.c): its n destinations' writes. */
typedef struct pf_flight {
  struct pf_chunk *c;
  size_t n;
  pf_dest_writes dw;
} pf_flight;

/* A thread serving a queue (workers.c). Its scratch and window are its
 * own (this thread only). */
typedef struct pf_worker {
  struct pf_queue *q;
  int helper; /* started while the queue's other threads waited on the network */
  pf_scratch sc;
  /* the window: fl[(fl_head + k) % PF_WORKER_WINDOW], k < fl_n, oldest first */
  pf_flight fl[PF_WORKER_WINDOW];
  unsigned fl_head, fl_n;
  /* While it waits for its window's oldest chunk with nothing to take, it
   * is on its queue's window_waiters (under the queue's lock) and a chunk
   * queued, a room let go or a stop pokes that chunk's group (workers.c). */
  kvf__batch_group *window_group;
  struct pf_worker *next_window_waiter;
} pf_worker;

/* One FIFO of chunks. Its first thread serves it; while every thread of it
 * waits on the network (a destination that is slow to confirm, or stopped)
 * and chunks of other rooms are queued, another thread starts, up to
 * PF_QUEUE_THREADS, so one stuck decode never holds the rooms of others. */
typedef struct pf_queue {
  struct prefill_state *ps;
  pthread_mutex_t lock;
  pthread_cond_t cond;
  pf_chunk *head, *tail;
  size_t count;
  int stop;
  int nthreads, nidle;       /* its threads: all, idle on cond (under lock) */
  atomic_int nwaiting;       /* of them, waiting on the network: a hint read under lock, changed without it */
  pf_worker *window_waiters; /* threads waiting for their window with nothing to take (under lock) */
} pf_queue;

struct kvf_sender {
  kvf_manager *m;
  pf_room *r;
  int64_t room;
  int64_t curr; /* next index_slice start (§6.2) */
  int last_sent;
  struct kvf_sender *next_spare; /* on ps->sender_spare once destroyed */
  /* The room's status cell (kvf__rooms_status_cell), for kvf_sender_poll
   * without a lock; valid until destroy clears the room. */
  const atomic_int *status;
};

/* One destination of a direct chunk: the engine callback's argument. */
typedef struct pf_direct_dest {
  struct pf_direct *owner;
  pf_info *info;      /* referenced */
  atomic_int carried; /* the engine took this destination's completion trailer */
} pf_direct_dest;

/* A direct chunk in flight (see "direct transfers"): from a pool sized once. */
typedef struct pf_direct {
  struct pf_direct *next; /* free list (ps->lock) */
  struct prefill_state *ps;
  pf_room *r; /* referenced */
  int64_t token;
  int32_t cands[KVF_MAX_CANDIDATES];
  size_t ncand;
  uint64_t bytes;
  size_t n;           /* the room's infos, dummies included */
  atomic_size_t left; /* engine writes outstanding + the submitter's guard */
  atomic_int failed;
  pf_direct_dest d[PF_DIRECT_MAX_DESTS];
} pf_direct;

typedef struct prefill_state {
  kvf_manager *m;
  pthread_mutex_t lock;
  /* direct transfers: the records (free list and count under lock), the
   * calling threads' planning scratch (direct_lock, only ever try-locked) */
  pf_direct *direct_pool, *direct_free;
  size_t direct_busy;
  pthread_cond_t direct_cv; /* direct_busy reached 0 */
  pthread_mutex_t direct_lock;
  pf_scratch direct_sc;
  uint64_t *layer_bytes; /* n_layers + 1: KV bytes per page of layers [0, l) */
  pf_room *room_spare;   /* unreferenced rooms kept for reuse (room_new), under lock */
  size_t nroom_spare;
  kvf_sender *sender_spare; /* destroyed senders' records, under lock */
  size_t nsender_spare;
  smap regs;                        /* session -> pf_reg */
  uint64_t reg_gen;                 /* the last pf_reg.gen given (ps->lock) */
  size_t nearly, early_bytes;       /* early rooms, and their M2 copies' bytes */
  int64_t early_swept_ns;           /* the listener's last sweep of idle early rooms (prefill_tick) */
  pf_room *early_head, *early_tail; /* least recently used first */
  /* rooms whose sender was destroyed before they could succeed (rooms_early.c,
   * "Ended rooms"): ended maps room -> ring slot + 1; the ring (allocated at
   * the first) holds the last PF_MAX_ENDED, oldest at ended_first */
  map ended;
  struct pf_ended *ended_ring;
  size_t ended_first, nended;
  int nqueues;
  pf_queue *queues;
  /* plan layouts, converted once from the manager's buffers */
  uint32_t *st_start, *st_bufs;
  plan_layout kv_lay, st_lay;
  /* with state_layer_ids: state buffers grouped by KV layer (nlayers 0 without) */
  uint32_t *stl_start, *stl_bufs;
  plan_layout stl_lay;
  /* deferred M3s (m3_outbox.c, which states the lock rules) */
  pthread_mutex_t m3_lock, m3_send_lock;
  pf_m3 *m3q, *m3out; /* PF_M3_BATCH each: the queue, the batch being sent */
  size_t nm3;
  int64_t m3_since_ns; /* when the oldest queued M3 was queued */
  /* records kept for reuse, under spare_mu (a leaf lock): freed chunks, and
   * unreferenced transfer infos with their M2 blocks */
  pthread_mutex_t spare_mu;
  spare_list chunk_spare;
  /* verify mode: a chunk's send-time hashing progressed (pf_chunk.hashed);
   * hash_mu is a leaf lock */
  pthread_mutex_t hash_mu;
  pthread_cond_t hash_cv;
  pf_info *info_spare;
  size_t ninfo_spare;
} prefill_state;

/* A destination's outcome: DEST_FAIL fails the room; DEST_XFER_FAIL also
 * marks the decode session failed for failed_session_ttl_s (§7.4). */
enum { DEST_OK = 0, DEST_FAIL = 1, DEST_XFER_FAIL = 2 };

/* One chunk to one real destination, the one per-destination send path
 * (kvf__pf_send_dest) of the worker and of direct transfers. */
typedef struct pf_send {
  const pf_chunk *c;
  const pf_info *info;
  /* direct transfers: the engine reports the write's end here instead of
   * through a batch (kvf__engine_submit_cb); NULL on the worker path */
  void (*on_done)(void *arg, int status);
  void *arg;
  atomic_int *carried;     /* set to 1 when the engine took the destination's completion trailer (may be NULL) */
  kvf__batch_group *group; /* worker path: the batch joins it (NULL: none) */
  /* set by kvf__pf_send_dest when it returns DEST_OK */
  kvf_batch *batch; /* the write still in flight (worker path), or NULL: done or nothing to write */
  uint64_t bytes;   /* the bytes it writes (or wrote) */
} pf_send;

/* Verify mode for a destination: the chunk's pages were hashed when sent
 * (the prefill's verify mode), or the decode asked for digests. */
static inline int pf_verifies(const pf_chunk *c, const wire_m2 *x) {
  return c->digests || (x->room_flags & WIRE_ROOM_VERIFY);
}

/* Does chunk c carry its completion to destination i as an engine trailer
 * (docs/WIRE-EXTENSIONS.md, "completion rides the data")? When it is the
 * room's last, i asked for it (M2 frame 15), had every earlier chunk (it
 * came before the room's chunks were written) and the first token is
 * known; verify mode sends its digests first (kvf__pf_send_dest) and never
 * does. */
static inline int pf_trails(const pf_chunk *c, const pf_info *i) {
  return c->is_last && !i->late && (i->m2->room_flags & WIRE_ROOM_FAST_COMPLETION) && c->token != PF_TOKEN_LATER;
}

/* rooms_early.c */
/* The live trace of a pf_room (the role's trace_of). */
const trace_live *kvf__pf_trace_of(void *user);
/* A zeroed chunk (a spare one or a new one), or NULL. Any thread. */
pf_chunk *kvf__pf_chunk_new(prefill_state *ps);
/* Free a chunk's arrays and keep it for kvf__pf_chunk_new. Any thread. */
void kvf__pf_chunk_free(prefill_state *ps, pf_chunk *c);
/* Verify mode, hold values of a chunk (pf_chunk.hold). */
enum { PF_HOLD_NONE = 0, PF_HOLD_HASHING = 1, PF_HOLD_FREED = 2 };
/* Verify mode: wait until the send-time digests of the chunk's pages
 * [0, upto) are taken (the sending thread is hashing them; it never fails
 * once the chunk is queued). Any thread holding the chunk. */
void kvf__pf_wait_hashed(prefill_state *ps, const pf_chunk *c, size_t upto);
/* A zeroed transfer info holding one reference, the caller's (a spare one
 * keeps its M2 block for reuse), or NULL. Any thread. */
pf_info *kvf__pf_info_new(prefill_state *ps);
/* Drop a reference; the last keeps the record for kvf__pf_info_new. Under
 * ps->lock, or by the only holder. */
void kvf__pf_info_unref(prefill_state *ps, pf_info *i);
pf_room *kvf__pf_room_find(prefill_state *ps, int64_t room);
pf_room *kvf__pf_room_new(prefill_state *ps);
void kvf__pf_room_drop(prefill_state *ps, pf_room *r);
void kvf__pf_room_unref(prefill_state *ps, pf_room *r);
/* ps->lock held: one of the room's submitted chunks ended (r->busy). The
 * last one's end is a change event: a Failed room's poll waits for it. */
void kvf__pf_room_busy_done_locked(prefill_state *ps, pf_room *r);
void kvf__pf_chunk_release_locked(prefill_state *ps, pf_chunk *c);
/* Send an M3 (§6.11) to the decode's PULL socket at host:port. Any thread
 * without ps->lock. */
void kvf__pf_send_m3(kvf_manager *m, const char *host, uint16_t port, uint64_t epoch, const pf_m3_msg *msg);
/* M3 Failed (token -1, no candidates), with kvferry's reason frame when
 * reason is not NULL. */
void kvf__pf_send_m3_failed(kvf_manager *m, const char *host, uint16_t port, uint64_t epoch, int64_t room,
                            const char *reason);
pf_dest *kvf__pf_collect_dests(pf_room *r, const char *except, size_t *n);
/* ps->lock held: fail room r (live, with its sender) with `why`. When this
 * is what failed it, its destinations but `except`'s (NULL: none), to tell
 * once ps->lock is let go (kvf__pf_send_failed_all); NULL when it had
 * failed already (they were told then), or there is no one to tell. */
pf_dest *kvf__pf_fail_room_locked(prefill_state *ps, pf_room *r, const char *why, const char *except, size_t *n);
/* ps->lock held: can room r's transfer infos ever complete (§6.11 step 6:
 * Success when as many real destinations as each one's
 * required_dst_info_num have the data)? 0 when they can (or every one is a
 * dummy, step 1); else KVF_EPROTO with the reason in why: decodes that
 * disagree on their number, or dummies counted as destinations, would leave
 * the room Bootstrapped for ever. */
int kvf__pf_dests_check_locked(const pf_room *r, char *why, size_t cap);
/* ps->lock held. A destroyed room (kvf_sender_destroy after its last chunk
 * was sent) that cannot end in Success any more: its decodes are told
 * Failed, once, so none waits for its own timeout. The destinations to tell
 * (send them with kvf__pf_send_failed_all and PF_DESTROYED_REASON), or NULL
 * when they were told already or the room is not destroyed. */
pf_dest *kvf__pf_dead_room_failed_locked(pf_room *r, size_t *n);
#define PF_DESTROYED_REASON "the prefill dropped the request (its sender was destroyed) before it was complete"
void kvf__pf_send_failed_all(kvf_manager *m, int64_t room, pf_dest *d, size_t n, const char *reason);
void kvf__pf_tell_others_failed(kvf_manager *m, int64_t room, pf_dest *d, size_t n, const char *why);
int kvf__pf_room_shard(prefill_state *ps, pf_room *r);
int kvf__pf_queue_push(pf_queue *q, pf_chunk *c);
/* q->lock held: something for a thread of q to take may have come (a chunk
 * queued, a room let go, a stop): wake the threads that wait for their
 * window with nothing to take. */
void kvf__pf_queue_poke_locked(pf_queue *q);
/* kvf_batch_wait(b, -1) on a worker's scratch, in slices of
 * PF_SLOW_WAIT_MS: a long wait lets the queue's other rooms get a thread. */
int kvf__pf_batch_wait(pf_scratch *sc, kvf_batch *b);
/* Start a thread serving q (the first, or a helper). q->lock held; 0 or
 * KVF_ENOMEM. */
int kvf__pf_worker_start_locked(pf_queue *q, int helper);
/* A worker thread is about to wait on the network (a batch, a group of
 * them) and when done waiting: while it waits (and waited long), queued
 * chunks of rooms it does not hold may go to another thread of its queue.
 * No-ops for the direct path's scratch (sc->worker NULL). */
void kvf__pf_wait_begin(pf_scratch *sc);
void kvf__pf_wait_end(pf_scratch *sc);
/* Hand the chunks that waited for the room's M2s over: to a worker's
 * queue, or the room's only chunk in *direct (*dj its slot) to be sent by
 * the caller. A full queue fails the room: *fail_d (with *fail_n) are then
 * the destinations to tell, as kvf__pf_fail_room_locked. */
void kvf__pf_flush_pending(prefill_state *ps, pf_room *r, pf_direct **dj, pf_chunk **direct, pf_dest **fail_d,
                           size_t *fail_n);
void kvf__pf_early_unlink(prefill_state *ps, pf_room *r);
void kvf__pf_early_append(prefill_state *ps, pf_room *r, pf_reg *owner);
void kvf__pf_expire_early(prefill_state *ps, int64_t now);
/* ps->lock held: an early room's M2 copies grew by `add` bytes and shrank by
 * `sub` (a repeat replaced one): charged to its session and the total. */
void kvf__pf_early_charge(prefill_state *ps, pf_room *r, size_t add, size_t sub);
/* Ended rooms, ps->lock held: remember that room's sender was destroyed
 * before the room could succeed (now: clock_now_ns()); has: was it (within
 * the waiting timeout, the oldest forgotten past PF_MAX_ENDED)?; forget: a
 * new sender for the same room id. */
void kvf__pf_ended_add_locked(prefill_state *ps, int64_t room, int64_t now);
int kvf__pf_ended_has_locked(prefill_state *ps, int64_t room, int64_t now);
void kvf__pf_ended_forget_locked(prefill_state *ps, int64_t room);

/* chunk_plan.c */
uint64_t kvf__pf_writes_bytes(const kvf_write *w, size_t n);
int kvf__pf_state_counts_ok(const wire_m2 *x, size_t nsptr, size_t n_state, size_t nstate, char *why,
                            size_t whycap);
pf_reg *kvf__pf_usable_reg_locked(prefill_state *ps, const char *session, int64_t now, char *why, size_t whycap);
int kvf__pf_scratch_grow(void **p, size_t *cap, size_t need, size_t elem);
void kvf__pf_scratch_free(pf_scratch *sc);
void kvf__pf_dest_writes_free(pf_dest_writes *dw);
int kvf__pf_scratch_init(pf_scratch *sc, const manager_buffers *b);
int kvf__pf_info_plan(kvf_manager *m, pf_info *info);
/* The chunk's pages one destination still needs (chunk_plan.c). */
void kvf__pf_dest_window(const pf_chunk *c, const wire_m2 *x, int64_t page_size, size_t *skip, int64_t *dstart,
                         size_t *n);
/* Plan one chunk to one real destination (§6.3-§6.6) into sc: its writes
 * sc->w[0, sc->nw), KV pages then the state slots the chunk carries, in
 * sc->parts. DEST_FAIL with a reason; DEST_OK otherwise. */
int kvf__pf_plan_dest(prefill_state *ps, pf_scratch *sc, const pf_chunk *c, const pf_info *info, char *why,
                      size_t whycap);
/* The engine batch options of a write to x: tagged with the room's fence
 * when the decode gave one (issue 16). */
void kvf__pf_fence_opts(const wire_m2 *x, kvf_batch_opts *opts);
/* The one decision on a failed engine write to a destination, any path:
 * DEST_FAIL (the room only) when the decode's fence refused it, else
 * DEST_XFER_FAIL; the reason goes to why. */
int kvf__pf_xfer_failed(const pf_room *r, const wire_m2 *x, int rc, char *why, size_t whycap);
/* One chunk to one real destination: planned, then written (verify mode:
 * the verify step writes, checks and confirms here) or submitted (s->batch,
 * or s->on_done). DEST_OK, or DEST_FAIL / DEST_XFER_FAIL with the reason. */
int kvf__pf_send_dest(prefill_state *ps, pf_scratch *sc, pf_send *s, char *why, size_t whycap);

/* verify_send.c */
/* The verify step of kvf__pf_send_dest, once sc holds the plan: every part
 * submitted, then in order waited for, its sources rechecked and its
 * digests sent to the decode that asked. */
int kvf__pf_verify_send(prefill_state *ps, pf_scratch *sc, pf_send *s, char *why, size_t whycap);
/* Verify mode: do the chunk's source pages still hold what kvf_sender_send
 * hashed? 0, or KVF_ESTATE with the first changed page named in why
 * (counted in verify_failures). */
int kvf__pf_recheck_chunk(prefill_state *ps, const pf_chunk *c, char *why, size_t whycap);

/* workers.c */
/* Fail the room for its destination `info` (the one whose transfer
 * failed); `mark`: a transfer error, which marks the decode session failed
 * (§7.4) while the registration the M2 came under is still in place. */
void kvf__pf_fail_dest(prefill_state *ps, pf_room *r, const pf_info *info, const char *why, int mark);

/* direct.c */
pf_direct *kvf__pf_direct_take_locked(prefill_state *ps, pf_room *r, const pf_chunk *c, size_t prior);
void kvf__pf_direct_run(prefill_state *ps, pf_direct *dj, const pf_chunk *c);

/* m3_outbox.c */
int kvf__pf_m3_init(prefill_state *ps);
void kvf__pf_m3_free(prefill_state *ps);
/* The M3 msg to destination y, now; but an M3 Success for a destination
 * whose completion trailer the engine took (`carried`) only repeats what
 * the decode had with its bytes, and waits in the outbox to share a trip
 * (at most about PF_M3_DEFER_MS). Any thread without ps->lock. */
void kvf__pf_m3_to(prefill_state *ps, const wire_m2 *y, int carried, const pf_m3_msg *msg);
/* Send the queued M3s: all of them, or (all 0) if full or due. Any thread
 * without ps->lock. */
void kvf__pf_m3_flush(prefill_state *ps, int all);
/* The listener's turn: send the queue if due; the milliseconds until the
 * next one is due, or -1 when none waits. */
int kvf__pf_m3_tick(kvf_manager *m);

#endif

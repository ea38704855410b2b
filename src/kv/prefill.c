/* The prefill half of a KV manager (PROTOCOL §1.5, §3.3-§3.5, §6, §7.4):
 * the PUT /route registration at startup, the listener's handling of M1
 * (decode registrations, keyed by session) and M2 (transfer requests, per
 * room and session), the senders the scheduler drives, and queue_size
 * transfer workers that turn chunks into engine writes and report M3.
 *
 * Tables and bounds. All prefill tables sit behind one mutex (ps->lock):
 * registrations (at most PF_MAX_SESSIONS sessions), per-room state `pf_room`
 * keyed by room id, and per-room transfer infos in arrival order (at most
 * PF_MAX_INFOS). An M2 may arrive before its sender exists (a legitimate
 * race): it is stored in a pf_room without a sender, an "early" room
 * (issue 13 defect 6). Each early room is charged to the decode session
 * whose M2 created it; a session holds at most PF_MAX_EARLY_PER_SESSION of
 * them and all sessions together at most PF_MAX_EARLY, so one flooding
 * decode cannot starve the others. Early rooms sit on one LRU list (a repeat
 * M2 moves its room to the tail); each M2 drops at most PF_EXPIRE_PER_MSG
 * rooms idle past the waiting timeout from the head (the decode has given
 * up on them by then), so every M2 costs O(1). An M2 that would need an
 * early room past a bound is refused: its decode gets M3 Failed with the
 * reason (kvferry frame 5) at once instead of waiting. Early rooms are not
 * in the shared room table (m->rooms holds exactly the rooms with a sender),
 * so kvf_manager_get_stats' live_rooms counts senders only.
 *
 * Lifetime. A pf_room is reference counted: one reference for its map entry
 * and one per chunk that is pending on it or queued/being processed. Destroy
 * removes the map entry and marks the room dead; a worker that still holds
 * a chunk sees `dead` and drops it, and every call into m->rooms that names
 * the room by id is made under ps->lock after checking `dead`, so a room id
 * reused by a new sender is never touched by an old chunk. Transfer infos
 * are reference counted too, because a repeated M2 replaces one while a
 * worker may be using it. Room and sender records that nothing refers to
 * any more are kept (PF_SPARE_ROOMS each) and reused, and the planning
 * arrays are per worker and grow-only, so a warm manager allocates per room
 * only the M2's copy, a queued chunk's copy (worker path) and the engine's batch.
 * Lock order: ps->lock, then a queue's lock, then
 * the room table's internal lock. Nothing that blocks (engine writes, M3
 * sends) runs under ps->lock.
 *
 * Chunks sent before every M2 arrived wait on the room (`pending`) and are
 * queued, in order, when the room becomes Bootstrapped; the sender's poll
 * fails the room after bootstrap_timeout_s in Bootstrapping (which the
 * reference never does, §8 item 2). The queue shard is fixed when the room
 * becomes Bootstrapped, so every chunk of a room runs on one worker in order.
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
#include "base/wake.h"
#include "bootstrap/bootstrap.h"
#include "engine/async.h"
#include "kv/integrity.h"
#include "kv/manager.h"
#include "kv/plan.h"
#include "kv/rooms.h"

#define PF_TOKEN_LATER (-2)             /* a chunk's token: "comes through kvf_sender_set_metadata" */
#define PF_MAX_SESSIONS 4096            /* registered decode sessions */
#define PF_MAX_INFOS 4096               /* transfer infos (decode sessions) per room */
#define PF_MAX_EARLY 65536              /* rooms with M2s but no sender yet, all sessions together */
#define PF_EXPIRE_PER_MSG 4             /* idle early rooms dropped per M2 at most */
#define PF_MAX_PENDING 65536            /* chunks waiting on one room for its M2s */
#define PF_QUEUE_MAX 65536              /* chunks in one worker FIFO */
#define PF_DIRECT_MAX_BYTES (16u << 20) /* a room's only chunk up to this size skips the worker */
#define PF_DIRECT_MAX_DESTS 8           /* ... when it has at most this many destinations */
#define PF_DIRECT_SLOTS 256             /* direct chunks in flight per prefill rank */
#define PF_SPARE_ROOMS 4096             /* unreferenced room records kept for reuse */
#define PF_DIRECT_DRAIN_MS 120000       /* stop: wait this long for direct chunks' engine callbacks */

typedef struct pf_reg { /* one decode registration (M1) */
  wire_m1 *m1;          /* heap copy (kvf__wire_m1_dup) */
  int64_t failed_ns;    /* monotonic time of the last transfer error; 0 = not failed (§7.4) */
  size_t nearly;        /* early rooms charged to this session */
} pf_reg;

typedef struct pf_info { /* one M2, shared with workers */
  int refs;
  wire_m2 *m2; /* heap copy (kvf__wire_m2_dup) */
  /* its plan, converted once when the M2 arrives */
  plan_fragment *frags; /* m2->nfrags, per token when tokens > 1 */
  int64_t tokens;       /* tokens per page the runs scale by; 0 = plan refused (plan_why) */
  char plan_why[200];
} pf_info;

/* A transfer context's arrays: the destination pointer lists sized once,
 * the rest grow-only, so the hot path does not allocate per room. */
typedef struct pf_scratch {
  uint64_t *dptr, *sptr; /* n_kv, n_state */
  int64_t *src, *dst;
  size_t cap_src, cap_dst;
  plan_run *runs;
  size_t cap_runs;
  kvf_write *w;
  size_t cap_w, nw;
  struct pf_info **infos;
  size_t *done;
  size_t cap_infos, cap_done;
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
   * and buffer dig_bufs[j]; NULL when verify mode is off. */
  uint64_t *digests;
  size_t *dig_bufs;
  size_t ndig;
} pf_chunk;

typedef struct pf_dest { /* where an M3 goes */
  char host[WIRE_STR_MAX + 1];
  uint16_t port;
} pf_dest;

typedef struct pf_room {
  int64_t room;
  int refs;
  size_t nchunks; /* chunks accepted from the sender */
  int dead;       /* destroyed: chunks still holding it are dropped */
  int has_sender;
  int bootstrapped;
  int shard;
  int64_t create_ns;             /* sender creation, for the bootstrap timeout */
  pf_reg *early_owner;           /* early room: the session it is charged to; NULL otherwise */
  struct pf_room *eprev, *enext; /* the early LRU list */
  int64_t last_m2_ns;
  pf_info **infos; /* arrival order */
  size_t ninfos, cap;
  pf_chunk *pend_head, *pend_tail;
  size_t npending;
  /* first token published by kvf_sender_set_metadata (immutable once set) */
  int meta_set;
  int64_t meta_token;
  int32_t *meta_cands;
  size_t meta_ncand;
  /* PF_TOKEN_LATER: the last chunk landed, waiting for the token */
  pf_dest *park; /* the completed destinations, NULL when not parked */
  size_t npark;
  int64_t landed_ns;
  struct pf_room *next_spare; /* on ps->room_spare once unreferenced */
} pf_room;

typedef struct pf_queue {
  struct prefill_state *ps;
  pthread_mutex_t lock;
  pthread_cond_t cond;
  pf_chunk *head, *tail;
  size_t count;
  int stop;
  pthread_t thread;
  int started;
  pf_scratch sc; /* the worker's */
} pf_queue;

struct kvf_sender {
  kvf_manager *m;
  pf_room *r;
  int64_t room;
  int64_t curr; /* next index_slice start (§6.2) */
  int last_sent;
  struct kvf_sender *next_spare; /* on ps->sender_spare once destroyed */
};

/* One destination of a direct chunk: the engine callback's argument. */
typedef struct pf_direct_dest {
  struct pf_direct *owner;
  pf_info *info; /* referenced */
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
  smap regs; /* session -> pf_reg */
  map rooms; /* room id -> pf_room */
  size_t nearly;
  pf_room *early_head, *early_tail; /* least recently used first */
  int nqueues;
  pf_queue *queues;
  /* plan layouts, converted once from the manager's buffers */
  size_t *kv_start, *kv_bufs, *st_start, *st_bufs;
  plan_layout kv_lay, st_lay;
  /* with state_layer_ids: state buffers grouped by KV layer (nlayers 0 without) */
  size_t *stl_start, *stl_bufs;
  plan_layout stl_lay;
} prefill_state;

/* ------------------------------------------------------------- helpers */

static void kvf__chunk_free(pf_chunk *c) {
  if (!c) return;
  free(c->pages), free(c->cands), free(c->state_slots);
  free(c->digests), free(c->dig_bufs);
  free(c);
}

static void info_unref(pf_info *i) {
  if (i && --i->refs == 0) {
    free(i->frags);
    free(i->m2);
    free(i);
  }
}

/* ps->lock held: an empty room, a spare one when there is (its infos
 * array kept), so rooms cost no allocation once warm. NULL without memory. */
static pf_room *room_new(prefill_state *ps) {
  pf_room *r = ps->room_spare;
  if (!r) return calloc(1, sizeof *r);
  ps->room_spare = r->next_spare;
  ps->nroom_spare--;
  pf_info **infos = r->infos;
  size_t cap = r->cap;
  memset(r, 0, sizeof *r);
  r->infos = infos, r->cap = cap;
  return r;
}

/* ps->lock held: a room nothing refers to any more (its contents released),
 * kept as a spare (PF_SPARE_ROOMS) or freed; NULL ok. */
static void room_drop(prefill_state *ps, pf_room *r) {
  if (!r) return;
  if (ps->nroom_spare < PF_SPARE_ROOMS) {
    r->next_spare = ps->room_spare;
    ps->room_spare = r;
    ps->nroom_spare++;
    return;
  }
  free(r->infos);
  free(r);
}

/* ps->lock held. */
static void room_unref(prefill_state *ps, pf_room *r) {
  if (--r->refs > 0) return;
  for (size_t i = 0; i < r->ninfos; i++) info_unref(r->infos[i]);
  free(r->meta_cands);
  free(r->park);
  for (pf_chunk *c = r->pend_head, *n; c; c = n) {
    n = c->next;
    kvf__chunk_free(c);
  }
  room_drop(ps, r);
}

/* ps->lock held: drop a chunk and the room reference it holds. */
static void chunk_release_locked(prefill_state *ps, pf_chunk *c) {
  pf_room *r = c->r;
  kvf__chunk_free(c);
  if (r) room_unref(ps, r);
}

/* `reason` (may be NULL) travels in kvferry's M3 frame 5. */
static void send_m3_why(kvf_manager *m, const char *host, uint16_t port, int64_t room, int status, int64_t token,
                        const int32_t *cands, size_t ncand, const char *reason) {
  wire_m3 m3 = {.room = room,
                .status = status,
                .prefill_rank = m->tp_rank,
                .bootstrap_token = token,
                .candidates = wire_array_of(cands, cands ? ncand : 0),
                .reason = reason,
                .reason_len = reason ? strlen(reason) : 0};
  wire_msg msg;
  char why[WIRE_REASON_LEN];
  if (kvf__wire_m3_encode(&m3, &msg, why)) {
    LOG_WARN("kv", "cannot encode the status of room %" PRId64 " for %s:%u: %s", room, host, (unsigned)port, why);
    return;
  }
  kvf__manager_push_send(m, host, port, &msg);
  kvf__wire_msg_free(&msg);
}

static void send_m3(kvf_manager *m, const char *host, uint16_t port, int64_t room, int status, int64_t token,
                    const int32_t *cands, size_t ncand) {
  send_m3_why(m, host, port, room, status, token, cands, ncand, NULL);
}

/* ps->lock held: the non-dummy destinations of r, for M3 Failed. */
static pf_dest *collect_dests(pf_room *r, size_t *n) {
  *n = 0;
  pf_dest *d = calloc(r->ninfos ? r->ninfos : 1, sizeof *d);
  if (!d) return NULL;
  for (size_t i = 0; i < r->ninfos; i++) {
    const wire_m2 *x = r->infos[i]->m2;
    if (x->is_dummy) continue;
    snprintf(d[*n].host, sizeof d[*n].host, "%s", x->endpoint);
    d[*n].port = x->dst_port;
    (*n)++;
  }
  return d;
}

static void send_failed_all(kvf_manager *m, int64_t room, pf_dest *d, size_t n) {
  for (size_t i = 0; i < n; i++) send_m3(m, d[i].host, d[i].port, room, ROOM_FAILED, -1, NULL, 0);
  free(d);
}

/* ps->lock held: the room's queue shard. The reference shards by the
 * destination sessions alone (§6.12), which puts every room from one decode
 * rank on one worker, one synchronous write after another. kvferry mixes in
 * the room id: a room's chunks still run in order on one worker, while rooms
 * to the same decode spread over all workers. The failed-session mark is
 * shared, so a dead session is still seen by every worker at once. */
static int room_shard(prefill_state *ps, pf_room *r) {
  const char *small[PF_DIRECT_MAX_DESTS], **s = small;
  int shard = 0;
  if (r->ninfos > PF_DIRECT_MAX_DESTS && !(s = calloc(r->ninfos, sizeof *s))) return 0;
  for (size_t i = 0; i < r->ninfos; i++) s[i] = r->infos[i]->m2->session;
  if (kvf__plan_queue_shard(s, r->ninfos, ps->nqueues, &shard)) shard = 0;
  uint64_t h = (uint64_t)r->room * 0x9e3779b97f4a7c15ULL;
  shard = (int)(((uint64_t)shard + (h >> 32)) % (uint64_t)ps->nqueues);
  if (s != small) free(s);
  return shard;
}

/* ps->lock held (taken before the queue lock). KVF_ETOOBIG when full. */
static int queue_push(pf_queue *q, pf_chunk *c) {
  pthread_mutex_lock(&q->lock);
  if (q->count >= PF_QUEUE_MAX || q->stop) {
    pthread_mutex_unlock(&q->lock);
    return KVF_ETOOBIG;
  }
  c->next = NULL;
  if (q->tail) q->tail->next = c;
  else q->head = c;
  q->tail = c;
  q->count++;
  pthread_cond_signal(&q->cond);
  pthread_mutex_unlock(&q->lock);
  return 0;
}

static pf_direct *direct_take_locked(prefill_state *ps, pf_room *r, const pf_chunk *c, size_t prior);

/* ps->lock held: queue every pending chunk of a now-Bootstrapped room, in
 * order. A full queue fails the room (the chunk cannot wait forever). A
 * room's only chunk, small enough, is instead returned in *direct (with its
 * record in *dj) for this thread to send once it dropped the lock. */
static void flush_pending(prefill_state *ps, pf_room *r, pf_direct **dj, pf_chunk **direct) {
  pf_chunk *c = r->pend_head;
  if (c && !c->next && (*dj = direct_take_locked(ps, r, c, 1))) {
    r->pend_head = r->pend_tail = NULL;
    r->npending = 0;
    *direct = c;
    return;
  }
  r->pend_head = r->pend_tail = NULL;
  r->npending = 0;
  while (c) {
    pf_chunk *n = c->next;
    if (queue_push(&ps->queues[r->shard], c)) {
      if (r->has_sender && !r->dead) kvf__rooms_fail(ps->m->rooms, r->room, "Prefill transfer queue is full");
      chunk_release_locked(ps, c);
    }
    c = n;
  }
}

/* ps->lock held: the early LRU list (see the file comment). */
static void early_unlink(prefill_state *ps, pf_room *r) {
  if (!r->early_owner) return;
  if (r->eprev) r->eprev->enext = r->enext;
  else ps->early_head = r->enext;
  if (r->enext) r->enext->eprev = r->eprev;
  else ps->early_tail = r->eprev;
  r->eprev = r->enext = NULL;
  r->early_owner->nearly--;
  r->early_owner = NULL;
  ps->nearly--;
}

static void early_append(prefill_state *ps, pf_room *r, pf_reg *owner) {
  r->early_owner = owner;
  r->eprev = ps->early_tail;
  r->enext = NULL;
  if (ps->early_tail) ps->early_tail->enext = r;
  else ps->early_head = r;
  ps->early_tail = r;
  owner->nearly++;
  ps->nearly++;
}

/* ps->lock held: drop a few early rooms idle past the waiting timeout. */
static void expire_early(prefill_state *ps, int64_t now) {
  int64_t max_ns = (int64_t)(ps->m->cfg.waiting_timeout_s * 1e9);
  for (int i = 0; i < PF_EXPIRE_PER_MSG && ps->early_head && now - ps->early_head->last_m2_ns >= max_ns; i++) {
    pf_room *r = ps->early_head;
    early_unlink(ps, r);
    kvf__map_del(&ps->rooms, (uint64_t)r->room, NULL);
    r->dead = 1;
    room_unref(ps, r);
  }
}

/* --------------------------------------------------------------- listener */

static void on_m1(kvf_manager *m, prefill_state *ps, const wire_frame *frames, size_t n, const char *peer) {
  wire_m1 d;
  wire_m1 *copy = NULL;
  char why[WIRE_REASON_LEN];
  if (kvf__wire_m1_decode(frames, n, &d, why)) {
    kvf__manager_reject(m, peer, "M1", why);
    return;
  }
  /* Issue 13 defect 5: a registration names where the decode's memory and
   * status socket are; only that host may make it. */
  if (!kvf__manager_peer_is(m, peer, d.endpoint)) {
    kvf__manager_reject_forged(m, peer, "M1", "the sender is not the decode host the registration names");
    return;
  }
  if (kvf__wire_m1_dup(&d, &copy)) {
    kvf__manager_reject(m, peer, "M1", "out of memory");
    return;
  }
  pthread_mutex_lock(&ps->lock);
  pf_reg *reg = kvf__smap_get(&ps->regs, d.session);
  if (!reg) {
    if (smap_size(&ps->regs) >= PF_MAX_SESSIONS || !(reg = calloc(1, sizeof *reg)) ||
        kvf__smap_put(&ps->regs, d.session, reg, NULL)) {
      pthread_mutex_unlock(&ps->lock);
      free(reg);
      free(copy);
      kvf__manager_reject(m, peer, "M1", "registration table full");
      return;
    }
  } else {
    free(reg->m1);
  }
  reg->m1 = copy;
  reg->failed_ns = 0; /* a new registration clears the failed mark (§3.3, §7.4) */
  pthread_mutex_unlock(&ps->lock);
  if (d.kv_ptrs.count != m->bufs.n_kv)
    LOG_WARN("kv", "decode session %s registered %zu KV buffers, this prefill rank has %zu: its rooms will fail",
             d.session, d.kv_ptrs.count, m->bufs.n_kv);
  atomic_fetch_add(&m->stats.messages_received, 1);
}

static int info_plan(kvf_manager *m, pf_info *info);
static void direct_run(prefill_state *ps, pf_direct *dj, const pf_chunk *c);

static void on_m2(kvf_manager *m, prefill_state *ps, const wire_frame *frames, size_t n, const char *peer) {
  wire_m2 d;
  char why[ROOMS_REASON_MAX];
  if (kvf__wire_m2_decode(frames, n, &d, why)) {
    kvf__manager_reject(m, peer, "M2", why);
    return;
  }
  if (!kvf__manager_peer_is(m, peer, d.endpoint)) {
    kvf__wire_m2_free(&d);
    kvf__manager_reject_forged(m, peer, "M2", "the sender is not the decode host the request names");
    return;
  }
  pf_info *info = calloc(1, sizeof *info);
  if (!info || kvf__wire_m2_dup(&d, &info->m2)) {
    free(info);
    kvf__wire_m2_free(&d);
    kvf__manager_reject(m, peer, "M2", "out of memory");
    return;
  }
  info->refs = 1;
  kvf__wire_m2_free(&d);
  const wire_m2 *x = info->m2;
  if (!x->is_dummy && (x->indices_are_local || x->page_mask.count || x->local_indices.count)) {
    /* L1.5 partial cache indices: not supported, and silently ignoring them
     * would write whole pages to the wrong places. */
    info_unref(info);
    kvf__manager_reject(m, peer, "M2", "L1.5 local indices are not supported");
    return;
  }
  if (info_plan(m, info)) {
    info_unref(info);
    kvf__manager_reject(m, peer, "M2", "out of memory");
    return;
  }

  pthread_mutex_lock(&ps->lock);
  pf_reg *reg = kvf__smap_get(&ps->regs, x->session);
  if (!reg) {
    pthread_mutex_unlock(&ps->lock);
    snprintf(why, sizeof why, "decode session %s never registered (no M1)", x->session);
    info_unref(info);
    kvf__manager_reject(m, peer, "M2", why);
    return;
  }
  int mismatch = !x->is_dummy && reg->m1->kv_ptrs.count != m->bufs.n_kv;
  int64_t now = clock_now_ns();
  expire_early(ps, now);
  pf_room *r = kvf__map_get(&ps->rooms, (uint64_t)x->room);
  if (!r) {
    const char *full = reg->nearly >= PF_MAX_EARLY_PER_SESSION ? "from this decode session"
                       : ps->nearly >= PF_MAX_EARLY            ? "from all decode sessions"
                                                               : NULL;
    if (full || !(r = room_new(ps)) || kvf__map_put(&ps->rooms, (uint64_t)x->room, r, NULL)) {
      room_drop(ps, r);
      pthread_mutex_unlock(&ps->lock);
      atomic_fetch_add(&m->stats.messages_unknown_room, 1);
      snprintf(why, sizeof why,
               "prefill rank %d refused the transfer request: %s requests %s wait for their sender "
               "(limit %d per session, %d in all)",
               m->cfg.engine_rank, full ? "too many" : "out of memory:", full ? full : "no room for more",
               PF_MAX_EARLY_PER_SESSION, PF_MAX_EARLY);
      if (kvf__log_first_time(kvf__log_hash_str("prefill-early-full", (uint64_t)(uintptr_t)m)))
        LOG_WARN("kv", "room %" PRId64 " from %s: %s (further ones are counted, not logged)", x->room,
                 peer ? peer : "?", why);
      /* Tell the decode now: otherwise it waits for its timeout. */
      send_m3_why(m, x->endpoint, x->dst_port, x->room, ROOM_FAILED, -1, NULL, 0, why);
      info_unref(info);
      return;
    }
    r->room = x->room;
    r->refs = 1;
    early_append(ps, r, reg);
  } else if (r->early_owner) {
    pf_reg *owner = r->early_owner; /* a repeat: most recently used now */
    early_unlink(ps, r);
    early_append(ps, r, owner);
  }
  size_t k = 0;
  while (k < r->ninfos && strcmp(r->infos[k]->m2->session, x->session)) k++;
  if (k < r->ninfos) {
    info_unref(r->infos[k]); /* a repeat from the same session replaces it in place */
    r->infos[k] = info;
  } else {
    if (r->ninfos == r->cap) {
      size_t nc = r->cap ? r->cap * 2 : 4;
      pf_info **ni = r->ninfos < PF_MAX_INFOS ? realloc(r->infos, nc * sizeof *ni) : NULL;
      if (!ni) {
        pthread_mutex_unlock(&ps->lock);
        info_unref(info);
        kvf__manager_reject(m, peer, "M2", "too many decode sessions for one room");
        return;
      }
      r->infos = ni;
      r->cap = nc;
    }
    r->infos[r->ninfos++] = info;
  }
  r->last_m2_ns = now;
  if (mismatch && r->has_sender && !r->dead) {
    snprintf(why, sizeof why, "Decode session %s registered %zu KV buffers, this prefill rank has %zu", x->session,
             reg->m1->kv_ptrs.count, m->bufs.n_kv);
    kvf__rooms_fail(m->rooms, r->room, why);
  }
  pf_direct *dj = NULL;
  pf_chunk *direct = NULL;
  if (!r->bootstrapped && (int64_t)r->ninfos == x->required_dst_info_num) {
    r->bootstrapped = 1;
    r->shard = room_shard(ps, r);
    if (r->has_sender) kvf__rooms_update(m->rooms, r->room, ROOM_BOOTSTRAPPED, NULL);
    flush_pending(ps, r, &dj, &direct);
  }
  pthread_mutex_unlock(&ps->lock);
  if (direct) { /* the room's only chunk waited for this M2: send it from here */
    direct_run(ps, dj, direct);
    pthread_mutex_lock(&ps->lock);
    chunk_release_locked(ps, direct);
    pthread_mutex_unlock(&ps->lock);
  }
  atomic_fetch_add(&m->stats.messages_received, 1);
}

/* A kvferry decode failed or dropped a room it asked us to fence: fail the
 * sender's room so it stops writing (its engine would be refused anyway). */
static void on_fence(kvf_manager *m, prefill_state *ps, const wire_frame *frames, size_t n, const char *peer) {
  wire_fence f;
  char why[ROOMS_REASON_MAX];
  if (kvf__wire_fence_decode(frames, n, &f, why)) {
    kvf__manager_reject(m, peer, "fence", why);
    return;
  }
  char host[WIRE_STR_MAX + 1];
  snprintf(host, sizeof host, "%.*s", (int)(strrchr(f.session, ':') - f.session), f.session);
  if (!kvf__manager_peer_is(m, peer, host)) {
    kvf__manager_reject_forged(m, peer, "fence", "the sender is not the decode host the notice names");
    return;
  }
  int hit = 0;
  pthread_mutex_lock(&ps->lock);
  pf_room *r = kvf__map_get(&ps->rooms, (uint64_t)f.room);
  for (size_t i = 0; r && !r->dead && i < r->ninfos && !hit; i++) {
    const wire_m2 *x = r->infos[i]->m2;
    hit = x->fence_epoch == f.epoch && !strcmp(x->session, f.session);
  }
  int st = ROOM_FAILED;
  if (hit && r->has_sender && !kvf__rooms_get_status(m->rooms, f.room, &st) && st != ROOM_FAILED) {
    snprintf(why, sizeof why, "Decode %.200s failed the room: %.250s", f.session,
             *f.reason ? f.reason : "no reason given");
    kvf__rooms_fail(m->rooms, f.room, why);
  }
  pthread_mutex_unlock(&ps->lock);
  if (hit) {
    atomic_fetch_add(&m->stats.messages_received, 1);
    LOG_INFO("kv", "room %" PRId64 ": decode %s failed it (%s); sending stops", f.room, f.session, f.reason);
  } else {
    atomic_fetch_add(&m->stats.messages_unknown_room, 1);
  }
}

void kvf__prefill_on_message(kvf_manager *m, const wire_frame *frames, size_t n, const char *peer) {
  prefill_state *ps = m->prefill;
  if (kvf__wire_is_fence(frames, n)) {
    on_fence(m, ps, frames, n, peer);
    return;
  }
  int kind = kvf__wire_classify(frames, n);
  if (kind == WIRE_MSG_M1) on_m1(m, ps, frames, n, peer);
  else if (kind == WIRE_MSG_M2) on_m2(m, ps, frames, n, peer);
  else kvf__manager_reject(m, peer, "message", "no frames");
}

/* ----------------------------------------------------------------- worker */

enum { DEST_OK = 0, DEST_FAIL = 1, DEST_XFER_FAIL = 2 };

static uint64_t writes_bytes(const kvf_write *w, size_t n) {
  uint64_t b = 0;
  for (size_t i = 0; i < n; i++) b += w[i].len * (w[i].count > 1 ? w[i].count : 1);
  return b;
}

static plan_fragment *convert_frags(const wire_m2 *x) {
  plan_fragment *f = calloc(x->nfrags ? x->nfrags : 1, sizeof *f);
  if (!f) return NULL;
  for (size_t i = 0; i < x->nfrags; i++) {
    const wire_fragment *w = &x->frags[i];
    f[i] = (plan_fragment){.buffer_index = (uint32_t)w->buffer_index,
                           .kind = (plan_kind)w->buffer_kind,
                           .src_rank = (int32_t)w->src_rank,
                           .dst_rank = (int32_t)w->dst_rank,
                           .src_page_stride = (uint64_t)w->src_page_stride_bytes,
                           .dst_page_stride = (uint64_t)w->dst_page_stride_bytes,
                           .src_byte_offset = (uint64_t)w->src_byte_offset,
                           .dst_byte_offset = (uint64_t)w->dst_byte_offset,
                           .bytes_per_page = (uint64_t)w->bytes_per_page,
                           .page_count = w->page_count};
  }
  return f;
}

/* Token-major pages ([token][head][dim], our MHA pool) hold a head range
 * contiguously only per token. A plan that cuts a byte range out of each
 * page (§6.5.7 caveat) is therefore cut per token when the decode says its
 * pages are token-major with our page size (kvferry's M2 frame 14): each
 * KV fragment is rescaled to one token (strides, offsets and bytes / P)
 * and the caller scales page runs to token runs. A slicing plan without
 * that frame, or with another page size, would land wrong bytes: refused.
 * Whole-page fragments (replicated buffers) and page_size 1 need nothing.
 * Returns the tokens per page to scale by (1 = plain), or 0 with a reason. */
static int64_t per_token(plan_fragment *f, size_t n, int64_t P, int64_t layout, char *why, size_t whycap) {
  int slicing = 0;
  for (size_t i = 0; i < n; i++)
    if (f[i].kind != PLAN_MAMBA_STATE &&
        (f[i].bytes_per_page != f[i].src_page_stride || f[i].bytes_per_page != f[i].dst_page_stride))
      slicing = 1;
  if (P <= 1 || !slicing) return 1;
  if (layout != P) {
    if (layout)
      snprintf(why, whycap,
               "Refusing a heterogeneous-TP plan: the decode's pages hold %" PRId64
               " tokens, this prefill's %" PRId64,
               layout, P);
    else
      snprintf(why, whycap,
               "Refusing a heterogeneous-TP plan that cuts head ranges out of whole pages: with "
               "page_size %" PRId64 " and token-major pages that would write wrong bytes (the decode sent no "
               "page layout)",
               P);
    return 0;
  }
  uint64_t u = (uint64_t)P;
  for (size_t i = 0; i < n; i++) {
    plan_fragment *g = &f[i];
    if (g->kind == PLAN_MAMBA_STATE) continue;
    if (g->src_page_stride % u || g->dst_page_stride % u || g->src_byte_offset % u || g->dst_byte_offset % u ||
        g->bytes_per_page % u || (g->page_count >= 0 && g->page_count > INT64_MAX / P)) {
      snprintf(why, whycap,
               "Refusing a fragment of buffer %u: its slice does not split into %" PRId64 " equal token slices",
               (unsigned)g->buffer_index, P);
      return 0;
    }
    g->src_page_stride /= u, g->dst_page_stride /= u;
    g->src_byte_offset /= u, g->dst_byte_offset /= u;
    g->bytes_per_page /= u;
    if (g->page_count >= 0) g->page_count *= P;
  }
  return P;
}

/* Plan and write one set of page pairs (KV when state == 0, state slots
 * otherwise) to the destination. Arrays are sized once per call. */
/* Verify mode and fencing for one write_pairs call: the chunk's page digests
 * for the pairs (pdig[i * nb + j]: pair i, buffer bufs[j]; NULL = verify
 * mode off here), and whether the decode asked for digests. */
typedef struct pf_integ {
  const uint64_t *pdig;
  const size_t *bufs;
  size_t nb;
} pf_integ;

/* The digest entries of what `w` writes, for a decode that asked: from the
 * page digests when the plan moves whole pages (no second pass), else by
 * hashing each block's source pieces now, just before the write. */
static wire_digest *write_digests(prefill_state *ps, const kvf_write *w, size_t nw, const pf_integ *vi, int plain,
                                  const int64_t *dst, size_t n, const uint64_t *dst_ptrs, size_t *nd) {
  const manager_buffers *b = &ps->m->bufs;
  size_t cnt = plain && vi->pdig ? n * vi->nb : nw;
  wire_digest *d = malloc((cnt ? cnt : 1) * sizeof *d);
  if (!d) return NULL;
  if (plain && vi->pdig) {
    for (size_t i = 0; i < n; i++)
      for (size_t j = 0; j < vi->nb; j++) {
        size_t bi = vi->bufs[j];
        uint64_t item = b->kv_item_lens[bi];
        d[i * vi->nb + j] =
            (wire_digest){dst_ptrs[bi] + (uint64_t)dst[i] * item, item, 1, 0, vi->pdig[i * vi->nb + j]};
      }
  } else {
    for (size_t i = 0; i < nw; i++) {
      uint64_t count = w[i].count > 1 ? w[i].count : 1;
      d[i] = (wire_digest){w[i].dst, w[i].len, count, w[i].dst_stride,
                           kvf__hash_block(w[i].src, w[i].len, count, w[i].src_stride)};
    }
  }
  *nd = cnt;
  return d;
}

/* After the write: every source page still holds what kvf_sender_send
 * hashed, or the room fails naming the first page that changed. */
static int recheck_sources(prefill_state *ps, const pf_integ *vi, const int64_t *src, size_t n, int64_t room,
                           char *why, size_t whycap) {
  for (size_t i = 0; i < n; i++)
    for (size_t j = 0; j < vi->nb; j++) {
      uint64_t h = 0;
      if (kvf__integ_page_digest(ps->m, vi->bufs[j], src[i], &h) == 0 && h == vi->pdig[i * vi->nb + j]) continue;
      snprintf(why, whycap,
               "Integrity check failed: source page %" PRId64 " of KV buffer %zu changed while room %" PRId64
               " was being sent (the page was reused before its transfer completed)",
               src[i], vi->bufs[j], room);
      atomic_fetch_add(&ps->m->stats.verify_failures, 1);
      return KVF_ESTATE;
    }
  return 0;
}

/* Plan the engine blocks of n page pairs: *w (malloc'd, NULL when nothing
 * to write) holds *nw blocks. */
static int plan_pairs(prefill_state *ps, int state, size_t l0, size_t l1, const int64_t *src, const int64_t *dst,
                      size_t n, const uint64_t *dst_ptrs, const plan_fragment *frags, size_t nfrags, int frag_mode,
                      int64_t tokens, kvf_write **wout, size_t *nwout) {
  const manager_buffers *b = &ps->m->bufs;
  const plan_layout *lay = state ? &ps->st_lay : &ps->kv_lay;
  plan_mem sm = {state ? b->state_ptrs : b->kv_ptrs, state ? b->state_lens : b->kv_lens,
                 state ? b->n_state : b->n_kv};
  plan_mem dm = {dst_ptrs, NULL, sm.nbufs};
  const uint64_t *item = state ? b->state_item_lens : b->kv_item_lens;
  plan_run *runs = malloc((n ? n : 1) * sizeof *runs);
  kvf_write *w = NULL;
  size_t nruns = 0, nw = 0, cap;
  int rc = runs ? kvf__plan_runs(src, dst, n, runs, &nruns) : KVF_ENOMEM;
  if (rc) goto out;
  /* Per-token fragments (tokens > 1): a run of r pages is r*tokens token
   * slots of the per-token stride, so each (fragment, run) stays one
   * strided block of r*tokens pieces. */
  for (size_t k = 0; tokens > 1 && k < nruns; k++)
    if (__builtin_mul_overflow(runs[k].src, tokens, &runs[k].src) ||
        __builtin_mul_overflow(runs[k].dst, tokens, &runs[k].dst) ||
        __builtin_mul_overflow(runs[k].len, tokens, &runs[k].len)) {
      rc = KVF_ERANGE;
      goto out;
    }
  if (state) l0 = 0, l1 = lay->nlayers;
  cap = frag_mode ? kvf__plan_frag_count(lay, l0, l1, frags, nfrags, state, runs, nruns)
                  : kvf__plan_plain_count(lay, l0, l1, nruns);
  if (!cap) goto out;
  if (!(w = malloc(cap * sizeof *w))) {
    rc = KVF_ENOMEM;
    goto out;
  }
  rc = frag_mode ? kvf__plan_frag_writes(lay, l0, l1, frags, nfrags, state, runs, nruns, &sm, &dm, w, cap, &nw)
                 : kvf__plan_plain_writes(lay, l0, l1, runs, nruns, &sm, &dm, item, w, cap, &nw);
out:
  free(runs);
  if (rc) {
    free(w);
    w = NULL, nw = 0;
  }
  *wout = w;
  *nwout = nw;
  return rc;
}

/* One part of a write_pairs call: pairs [a, a + n), its blocks, its batch
 * and the digests that go to the decode once it landed. */
typedef struct pf_part {
  size_t a, n;
  kvf_write *w;
  size_t nw;
  kvf_batch *batch;
  wire_digest *dg;
  size_t ndg;
} pf_part;

/* Verify mode cuts a call into this many parts, submitted at once and
 * finished in order: while later parts are on the wire, the prefill
 * rechecks the sources of the parts that landed and the decode checks
 * their digests, so hashing overlaps the transfer instead of following it. */
#define PF_VERIFY_PARTS 16

static int write_pairs(prefill_state *ps, const wire_m2 *x, int state, size_t l0, size_t l1, const int64_t *src,
                       const int64_t *dst, size_t n, const uint64_t *dst_ptrs, const plan_fragment *frags,
                       size_t nfrags, int frag_mode, int64_t tokens, const pf_integ *vi, uint64_t *bytes,
                       char *why, size_t whycap, int *xfer) {
  kvf_manager *m = ps->m;
  int have_reason = 0, ask = (x->room_flags & WIRE_ROOM_VERIFY) != 0, plain = !state && !frag_mode && tokens == 1;
  kvf_batch_opts opts;
  kvf_batch_opts_init(&opts);
  if (x->fence_epoch && manager_room_tag(x->room))
    opts.tag = manager_room_tag(x->room), opts.epoch = x->fence_epoch;
  size_t nparts = (ask || vi->pdig) && n >= PF_VERIFY_PARTS ? PF_VERIFY_PARTS : 1, per = (n + nparts - 1) / nparts;
  pf_part *parts = calloc(nparts, sizeof *parts);
  int rc = parts ? 0 : KVF_ENOMEM;
  for (size_t g = 0; !rc && g < nparts; g++) {
    pf_part *p = &parts[g];
    p->a = g * per < n ? g * per : n;
    p->n = n - p->a < per ? n - p->a : per;
    rc = plan_pairs(ps, state, l0, l1, src + p->a, dst + p->a, p->n, dst_ptrs, frags, nfrags, frag_mode, tokens,
                    &p->w, &p->nw);
    if (rc || !p->nw) continue;
    if (ask) {
      pf_integ pv = {vi->pdig ? vi->pdig + p->a * vi->nb : NULL, vi->bufs, vi->nb};
      if (!(p->dg = write_digests(ps, p->w, p->nw, &pv, plain, dst + p->a, p->n, dst_ptrs, &p->ndg))) {
        rc = KVF_ENOMEM;
        break;
      }
    }
    if ((rc = kvf_engine_submit_ex(m->engine, x->session, p->w, p->nw, &opts, &p->batch))) *xfer = 1;
  }
  for (size_t g = 0; !rc && g < nparts; g++) {
    pf_part *p = &parts[g];
    if (!p->batch) continue;
    if ((rc = kvf_batch_wait(p->batch, -1))) {
      *xfer = 1;
      break;
    }
    pf_integ pv = {vi->pdig ? vi->pdig + p->a * vi->nb : NULL, vi->bufs, vi->nb};
    if (!state && pv.pdig && (rc = recheck_sources(ps, &pv, src + p->a, p->n, x->room, why, whycap))) {
      have_reason = 1;
      break;
    }
    if (p->dg) kvf__integ_send_digests(m, x->endpoint, x->dst_port, x->room, x->fence_epoch, p->dg, p->ndg);
    *bytes += writes_bytes(p->w, p->nw);
  }
  if (*xfer && rc == KVF_ESTATE &&
      opts.tag) { /* refused by the decode's fence: the room, not the session, is gone */
    snprintf(why, whycap, "The decode fenced room %" PRId64 " (it failed or dropped it there): write refused",
             x->room);
    *xfer = 0;
    have_reason = 1;
  } else if (*xfer) {
    snprintf(why, whycap, "%s", kvf_strerror(rc)); /* completed by send_to_dest */
  }
  for (size_t g = 0; parts && g < nparts; g++) {
    kvf_batch_destroy(parts[g].batch); /* waits for a part still in flight after an error */
    free(parts[g].w);
    free(parts[g].dg);
  }
  free(parts);
  if (rc && !*xfer && !have_reason)
    snprintf(why, whycap, "%s pages of the chunk cannot be mapped onto decode session %s: %s",
             state ? "State" : "KV", x->session, kvf_strerror(rc));
  return rc;
}

/* Can the chunk's state slots go to this destination: the decode registered
 * as many state buffers as this rank has, and sends one slot or as many as
 * the chunk? 0 with the reason otherwise. */
static int state_counts_ok(const wire_m2 *x, size_t nsptr, size_t n_state, size_t nstate, char *why,
                           size_t whycap) {
  if (nsptr != n_state) {
    snprintf(why, whycap, "Decode session %s registered %zu state buffers, this prefill rank has %zu", x->session,
             nsptr, n_state);
    return 0;
  }
  if (nstate != x->mamba_indices.count && nstate != 1) {
    snprintf(why, whycap, "State slot counts differ: %zu on prefill, %zu on decode", nstate,
             (size_t)x->mamba_indices.count);
    return 0;
  }
  return 1;
}

/* The decode session's registration if writes to it may go ahead (it is
 * registered, not blocked by the failed-session TTL, with our buffer count);
 * NULL with the reason otherwise. With ps->lock held. */
static pf_reg *usable_reg_locked(prefill_state *ps, const char *session, int64_t now, char *why, size_t whycap) {
  kvf_manager *m = ps->m;
  pf_reg *reg = kvf__smap_get(&ps->regs, session);
  if (!reg) {
    snprintf(why, whycap, "Decode session %s is not registered", session);
  } else if (reg->failed_ns && m->cfg.failed_session_ttl_s > 0 &&
             now - reg->failed_ns < (int64_t)(m->cfg.failed_session_ttl_s * 1e9)) {
    snprintf(why, whycap, "Decode instance could be dead, remote mooncake session %s is not alive", session);
  } else if (reg->m1->kv_ptrs.count != m->bufs.n_kv) {
    snprintf(why, whycap, "Decode session %s registered %zu KV buffers, this prefill rank has %zu", session,
             reg->m1->kv_ptrs.count, m->bufs.n_kv);
  } else {
    if (reg->failed_ns) reg->failed_ns = 0; /* the TTL passed */
    return reg;
  }
  return NULL;
}

/* One chunk to one real destination (§6.3-§6.6). DEST_FAIL with a reason,
 * or DEST_XFER_FAIL when the engine refused or failed the write. */
static int send_to_dest(prefill_state *ps, const pf_chunk *c, const wire_m2 *x, uint64_t *bytes, char *why,
                        size_t whycap) {
  kvf_manager *m = ps->m;
  const manager_buffers *b = &m->bufs;
  int64_t page_size = m->cfg.page_size, now = clock_now_ns();
  uint64_t *dptr = NULL, *sptr = NULL;
  size_t nsptr = 0;
  int64_t *src = NULL, *dst = NULL;
  plan_fragment *frags = NULL;
  int ret = DEST_FAIL, xfer = 0;

  pthread_mutex_lock(&ps->lock);
  pf_reg *reg = usable_reg_locked(ps, x->session, now, why, whycap);
  if (reg) {
    nsptr = reg->m1->state_ptrs.count;
    dptr = malloc(b->n_kv * sizeof *dptr);
    sptr = malloc((nsptr ? nsptr : 1) * sizeof *sptr);
    for (size_t i = 0; dptr && i < b->n_kv; i++) dptr[i] = wire_u64_at(reg->m1->kv_ptrs, i);
    for (size_t i = 0; sptr && i < nsptr; i++) sptr[i] = wire_u64_at(reg->m1->state_ptrs, i);
    ret = DEST_OK;
  }
  pthread_mutex_unlock(&ps->lock);
  if (ret != DEST_OK) goto out;
  ret = DEST_FAIL;
  if (!dptr || !sptr) {
    snprintf(why, whycap, "Out of memory");
    goto out;
  }
  if (x->decode_prefix_len % page_size) {
    snprintf(why, whycap, "decode_prefix_len %" PRId64 " is not a multiple of page_size %" PRId64,
             x->decode_prefix_len, page_size);
    goto out;
  }
  if (x->nfrags && !(frags = convert_frags(x))) {
    snprintf(why, whycap, "Out of memory");
    goto out;
  }
  int64_t tokens = 1;
  if (frags && (tokens = per_token(frags, x->nfrags, page_size, x->page_layout, why, whycap)) < 1) goto out;

  /* §6.8: skip the pages the decode already holds; position p maps to
   * destination index p - P. Then truncate to what both sides have (§6.3). */
  int64_t prefix = c->explicit_idx ? 0 : x->decode_prefix_len / page_size;
  size_t skip =
      c->pos < prefix ? (size_t)(prefix - c->pos < (int64_t)c->npages ? prefix - c->pos : (int64_t)c->npages) : 0;
  int64_t dstart = c->pos + (int64_t)skip - prefix;
  size_t ndst = x->kv_indices.count, nsrc = c->npages - skip;
  size_t avail = (uint64_t)dstart < ndst ? ndst - (size_t)dstart : 0;
  size_t n = nsrc < avail ? nsrc : avail;
  if (n) {
    src = malloc(n * sizeof *src);
    dst = malloc(n * sizeof *dst);
    if (!src || !dst) {
      snprintf(why, whycap, "Out of memory");
      goto out;
    }
    memcpy(src, c->pages + skip, n * sizeof *src);
    for (size_t k = 0; k < n; k++) dst[k] = wire_i64_at(x->kv_indices, (size_t)dstart + k);
    pf_integ vi = {c->digests ? c->digests + skip * c->ndig : NULL, c->dig_bufs, c->ndig};
    if (write_pairs(ps, x, 0, c->layer_begin, c->layer_end, src, dst, n, dptr, frags, x->nfrags, x->nfrags > 0,
                    tokens, &vi, bytes, why, whycap, &xfer))
      goto out;
  }

  /* §6.6: state slots in non-layerwise mode, last chunk only. */
  if (c->is_last && b->n_state && nsptr && c->nstate && x->mamba_indices.count) {
    size_t nm = x->mamba_indices.count, np = 0;
    if (!state_counts_ok(x, nsptr, b->n_state, c->nstate, why, whycap)) goto out;
    free(src), free(dst);
    src = malloc(nm * sizeof *src);
    dst = malloc(nm * sizeof *dst);
    if (!src || !dst) {
      snprintf(why, whycap, "Out of memory");
      goto out;
    }
    for (size_t k = 0; k < nm; k++) {
      int64_t s = c->state_slots[c->nstate == 1 ? 0 : k], d = wire_i64_at(x->mamba_indices, k);
      if (s < 0 || d < 0) continue;
      src[np] = s, dst[np] = d, np++;
    }
    /* §8 item 11: with a fragment plan, state goes through it too; a rank
     * whose plan has no state fragment writes no state (the reference
     * would send whole slots of its own, possibly larger, item size). */
    pf_integ none = {NULL, NULL, 0};
    if (np && write_pairs(ps, x, 1, 0, 0, src, dst, np, sptr, frags, x->nfrags, x->nfrags > 0, 1, &none, bytes,
                          why, whycap, &xfer))
      goto out;
  }
  ret = DEST_OK;
out:
  if (ret != DEST_OK && xfer) {
    char err[128];
    snprintf(err, sizeof err, "%.120s", why);
    snprintf(why, whycap, "Failed to send kv chunk of %" PRId64 " to %s:%u (%s)", c->r->room, x->endpoint,
             (unsigned)x->dst_port, err);
    ret = DEST_XFER_FAIL;
  }
  free(frags), free(src), free(dst), free(dptr), free(sptr);
  return ret;
}

/* Grow a scratch array to hold `need` elements of `elem` bytes. Arrays only
 * grow, so a worker stops allocating once it has seen its largest chunk. */
static int scratch_grow(void **p, size_t *cap, size_t need, size_t elem) {
  if (need <= *cap) return 0;
  size_t nc = *cap * 2 > need ? *cap * 2 : need;
  void *q = realloc(*p, nc * elem);
  if (!q) return KVF_ENOMEM;
  *p = q;
  *cap = nc;
  return 0;
}

static void scratch_free(pf_scratch *sc) {
  free(sc->dptr), free(sc->sptr), free(sc->src), free(sc->dst), free(sc->runs), free(sc->w);
  free(sc->infos), free(sc->done);
  memset(sc, 0, sizeof *sc);
}

/* Sized once: the destination pointer lists (n_kv, n_state entries). */
static int scratch_init(pf_scratch *sc, const manager_buffers *b) {
  memset(sc, 0, sizeof *sc);
  sc->dptr = malloc((b->n_kv ? b->n_kv : 1) * sizeof *sc->dptr);
  sc->sptr = malloc((b->n_state ? b->n_state : 1) * sizeof *sc->sptr);
  return sc->dptr && sc->sptr ? 0 : KVF_ENOMEM;
}

/* The M2's plan, once, when it arrives: fragments converted (and cut per
 * token). info->tokens = 0 when the plan is refused (reason in plan_why:
 * its rooms fail when a chunk is sent). KVF_ENOMEM only without memory. */
static int info_plan(kvf_manager *m, pf_info *info) {
  const wire_m2 *x = info->m2;
  info->tokens = 1;
  if (!x->nfrags || x->is_dummy) return 0;
  if (!(info->frags = convert_frags(x))) return KVF_ENOMEM;
  info->tokens =
      per_token(info->frags, x->nfrags, m->cfg.page_size, x->page_layout, info->plan_why, sizeof info->plan_why);
  return 0;
}

/* Plan one set of page pairs (KV when state == 0, state slots otherwise) to
 * the destination, appending the writes to sc->w. Uses only sc's arrays. */
static int plan_pairs_sc(prefill_state *ps, pf_scratch *sc, const wire_m2 *x, int state, size_t l0, size_t l1,
                         const int64_t *src, const int64_t *dst, size_t n, const uint64_t *dst_ptrs,
                         const plan_fragment *frags, size_t nfrags, int frag_mode, int64_t tokens, char *why,
                         size_t whycap) {
  kvf_manager *m = ps->m;
  const manager_buffers *b = &m->bufs;
  /* state 2: state buffers of KV layers [l0, l1) (state_layer_ids) */
  const plan_layout *lay = state == 2 ? &ps->stl_lay : state ? &ps->st_lay : &ps->kv_lay;
  plan_mem sm = {state ? b->state_ptrs : b->kv_ptrs, state ? b->state_lens : b->kv_lens,
                 state ? b->n_state : b->n_kv};
  plan_mem dm = {dst_ptrs, NULL, sm.nbufs};
  const uint64_t *item = state ? b->state_item_lens : b->kv_item_lens;
  size_t nruns = 0, nw = 0, cap;
  int rc = scratch_grow((void **)&sc->runs, &sc->cap_runs, n ? n : 1, sizeof *sc->runs);
  if (!rc) rc = kvf__plan_runs(src, dst, n, sc->runs, &nruns);
  if (rc) goto out;
  plan_run *runs = sc->runs;
  /* Per-token fragments (tokens > 1): a run of r pages is r*tokens token
   * slots of the per-token stride, so each (fragment, run) stays one
   * strided block of r*tokens pieces. */
  for (size_t k = 0; tokens > 1 && k < nruns; k++)
    if (__builtin_mul_overflow(runs[k].src, tokens, &runs[k].src) ||
        __builtin_mul_overflow(runs[k].dst, tokens, &runs[k].dst) ||
        __builtin_mul_overflow(runs[k].len, tokens, &runs[k].len)) {
      rc = KVF_ERANGE;
      goto out;
    }
  if (state == 1) l0 = 0, l1 = lay->nlayers;
  cap = frag_mode ? kvf__plan_frag_count(lay, l0, l1, frags, nfrags, state, runs, nruns)
                  : kvf__plan_plain_count(lay, l0, l1, nruns);
  if (!cap) goto out;
  if ((rc = scratch_grow((void **)&sc->w, &sc->cap_w, sc->nw + cap, sizeof *sc->w))) goto out;
  kvf_write *w = sc->w + sc->nw;
  rc = frag_mode ? kvf__plan_frag_writes(lay, l0, l1, frags, nfrags, state, runs, nruns, &sm, &dm, w, cap, &nw)
                 : kvf__plan_plain_writes(lay, l0, l1, runs, nruns, &sm, &dm, item, w, cap, &nw);
  if (!rc) sc->nw += nw;
out:
  if (rc)
    snprintf(why, whycap, "%s pages of the chunk cannot be mapped onto decode session %s: %s",
             state ? "State" : "KV", x->session, kvf_strerror(rc));
  return rc;
}

/* Plan one chunk to one real destination (§6.3-§6.6): sc->w[0..sc->nw)
 * holds the writes (KV, then state slots) afterwards. DEST_FAIL with a
 * reason; DEST_OK otherwise. No allocation beyond sc's grow-only arrays. */
static int plan_dest(prefill_state *ps, pf_scratch *sc, const pf_chunk *c, const pf_info *info, char *why,
                     size_t whycap) {
  kvf_manager *m = ps->m;
  const wire_m2 *x = info->m2;
  const manager_buffers *b = &m->bufs;
  int64_t page_size = m->cfg.page_size, now = clock_now_ns();
  size_t nsptr = 0;
  int ret = DEST_FAIL;
  sc->nw = 0;

  pthread_mutex_lock(&ps->lock);
  pf_reg *reg = usable_reg_locked(ps, x->session, now, why, whycap);
  if (reg) {
    nsptr = reg->m1->state_ptrs.count;
    for (size_t i = 0; i < b->n_kv; i++) sc->dptr[i] = wire_u64_at(reg->m1->kv_ptrs, i);
    for (size_t i = 0; i < nsptr && i < b->n_state; i++) sc->sptr[i] = wire_u64_at(reg->m1->state_ptrs, i);
    ret = DEST_OK;
  }
  pthread_mutex_unlock(&ps->lock);
  if (ret != DEST_OK) return ret;
  ret = DEST_FAIL;
  if (x->decode_prefix_len % page_size) {
    snprintf(why, whycap, "decode_prefix_len %" PRId64 " is not a multiple of page_size %" PRId64,
             x->decode_prefix_len, page_size);
    return ret;
  }
  if (info->tokens < 1) { /* the plan was refused when the M2 arrived */
    snprintf(why, whycap, "%s", info->plan_why);
    return ret;
  }
  const plan_fragment *frags = info->frags;

  /* §6.8: skip the pages the decode already holds; position p maps to
   * destination index p - P. Then truncate to what both sides have (§6.3). */
  int64_t prefix = c->explicit_idx ? 0 : x->decode_prefix_len / page_size;
  size_t skip =
      c->pos < prefix ? (size_t)(prefix - c->pos < (int64_t)c->npages ? prefix - c->pos : (int64_t)c->npages) : 0;
  int64_t dstart = c->pos + (int64_t)skip - prefix;
  size_t ndst = x->kv_indices.count, nsrc = c->npages - skip;
  size_t avail = (uint64_t)dstart < ndst ? ndst - (size_t)dstart : 0;
  size_t n = nsrc < avail ? nsrc : avail;
  if (n) {
    if (scratch_grow((void **)&sc->dst, &sc->cap_dst, n, sizeof *sc->dst)) {
      snprintf(why, whycap, "Out of memory");
      return ret;
    }
    for (size_t k = 0; k < n; k++) sc->dst[k] = wire_i64_at(x->kv_indices, (size_t)dstart + k);
    if (plan_pairs_sc(ps, sc, x, 0, c->layer_begin, c->layer_end, c->pages + skip, sc->dst, n, sc->dptr, frags,
                      x->nfrags, x->nfrags > 0, info->tokens, why, whycap))
      return ret;
  }

  /* §6.6: state slots, with the chunk that carries them (the last chunk, or
   * a layerwise chunk of the layer group they belong to). */
  if (b->n_state && nsptr && c->nstate && x->mamba_indices.count) {
    size_t nm = x->mamba_indices.count, np = 0;
    if (!state_counts_ok(x, nsptr, b->n_state, c->nstate, why, whycap)) return ret;
    if (scratch_grow((void **)&sc->src, &sc->cap_src, nm, sizeof *sc->src) ||
        scratch_grow((void **)&sc->dst, &sc->cap_dst, nm, sizeof *sc->dst)) {
      snprintf(why, whycap, "Out of memory");
      return ret;
    }
    for (size_t k = 0; k < nm; k++) {
      int64_t s = c->state_slots[c->nstate == 1 ? 0 : k], d = wire_i64_at(x->mamba_indices, k);
      if (s < 0 || d < 0) continue;
      sc->src[np] = s, sc->dst[np] = d, np++;
    }
    /* §8 item 11: with a fragment plan, state goes through it too; a rank
     * whose plan has no state fragment writes no state (the reference
     * would send whole slots of its own, possibly larger, item size). */
    /* A layerwise chunk with state_layer_ids: the state of its layer group. */
    int by_layer = c->explicit_idx && ps->stl_lay.nlayers;
    if (np && plan_pairs_sc(ps, sc, x, by_layer ? 2 : 1, c->layer_begin, c->layer_end, sc->src, sc->dst, np,
                            sc->sptr, frags, x->nfrags, x->nfrags > 0, 1, why, whycap))
      return ret;
  }
  return DEST_OK;
}

/* The decode's fence for its room (issue 16), as engine batch options:
 * untagged when it asked for none. */
static void fence_opts(const wire_m2 *x, kvf_batch_opts *opts) {
  kvf_batch_opts_init(opts);
  if (x->fence_epoch && manager_room_tag(x->room))
    opts->tag = manager_room_tag(x->room), opts->epoch = x->fence_epoch;
}

/* The reason for a failed engine write to one destination. */
static void xfer_why(const pf_room *r, const wire_m2 *x, int rc, char *why, size_t whycap) {
  snprintf(why, whycap, "Failed to send kv chunk of %" PRId64 " to %s:%u (%s)", r->room, x->endpoint,
           (unsigned)x->dst_port, kvf_strerror(rc));
}

/* A room's completion as an engine trailer to destination x (docs/WIRE-
 * EXTENSIONS.md, "completion rides the data"), when it may ride: x asked
 * for it (M2 frame 15), x is the room's only real destination and needs no
 * other, and the first token is known. Its length, or 0: the M3, which
 * goes out either way, then completes the room alone. */
static size_t completion_trailer(prefill_state *ps, int64_t room, const wire_m2 *x, size_t nreal, int64_t token,
                                 const int32_t *cands, size_t ncand, unsigned char *out, size_t cap) {
  if (!(x->room_flags & WIRE_ROOM_FAST_COMPLETION) || nreal != 1 || x->required_dst_info_num != 1 ||
      token == PF_TOKEN_LATER)
    return 0;
  wire_m3 m3 = {.room = room,
                .status = ROOM_SUCCESS,
                .prefill_rank = ps->m->tp_rank,
                .bootstrap_token = token,
                .candidates = wire_array_of(cands, cands ? ncand : 0)};
  wire_msg msg;
  char why[WIRE_REASON_LEN];
  if (kvf__wire_m3_encode(&m3, &msg, why)) return 0;
  size_t len = kvf__trailer_pack(ps->m, &msg, out, cap);
  kvf__wire_msg_free(&msg);
  return len;
}

/* One chunk to one real destination, written and confirmed (worker path).
 * DEST_FAIL with a reason, or DEST_XFER_FAIL when the engine refused or
 * failed the write. */
static int send_to_dest_sc(prefill_state *ps, pf_scratch *sc, const pf_chunk *c, const pf_info *info, size_t nreal,
                           uint64_t *bytes, char *why, size_t whycap) {
  int ret = plan_dest(ps, sc, c, info, why, whycap);
  if (ret != DEST_OK || !sc->nw) return ret;
  unsigned char tb[KVF_ENGINE_MAX_TRAILER];
  size_t tlen =
      c->is_last ? completion_trailer(ps, c->r->room, info->m2, nreal, c->token, c->cands, c->ncand, tb, sizeof tb)
                 : 0;
  kvf_batch_opts opts;
  fence_opts(info->m2, &opts);
  int rc =
      kvf__engine_write_trailer(ps->m->engine, info->m2->session, sc->w, sc->nw, &opts, tlen ? tb : NULL, tlen);
  if (rc) {
    xfer_why(c->r, info->m2, rc, why, whycap);
    return DEST_XFER_FAIL;
  }
  *bytes += writes_bytes(sc->w, sc->nw);
  return DEST_OK;
}

/* Fail the room (if it is still this room) and tell the destination. */
static void fail_dest(prefill_state *ps, pf_room *r, const wire_m2 *x, const char *why, int mark) {
  kvf_manager *m = ps->m;
  pthread_mutex_lock(&ps->lock);
  if (mark && m->cfg.failed_session_ttl_s > 0) {
    pf_reg *reg = kvf__smap_get(&ps->regs, x->session);
    if (reg) reg->failed_ns = clock_now_ns();
  }
  int live = !r->dead;
  if (live) kvf__rooms_fail(m->rooms, r->room, why);
  pthread_mutex_unlock(&ps->lock);
  if (!live) return;
  LOG_WARN("kv", "room %" PRId64 ": %s", r->room, why);
  send_m3(m, x->endpoint, x->dst_port, r->room, ROOM_FAILED, -1, NULL, 0);
}

static void process_chunk(prefill_state *ps, pf_scratch *sc, pf_chunk *c) {
  kvf_manager *m = ps->m;
  pf_room *r = c->r;
  int st = ROOM_FAILED;
  pthread_mutex_lock(&ps->lock);
  if (r->dead || kvf__rooms_get_status(m->rooms, r->room, &st) || st == ROOM_FAILED) {
    pthread_mutex_unlock(&ps->lock);
    return;
  }
  size_t n = r->ninfos;
  if (scratch_grow((void **)&sc->infos, &sc->cap_infos, n ? n : 1, sizeof *sc->infos) ||
      scratch_grow((void **)&sc->done, &sc->cap_done, n ? n : 1, sizeof *sc->done)) {
    kvf__rooms_fail(m->rooms, r->room, "Out of memory in the transfer worker");
    pthread_mutex_unlock(&ps->lock);
    return;
  }
  pf_info **infos = sc->infos;
  size_t *done = sc->done;
  for (size_t i = 0; i < n; i++) (infos[i] = r->infos[i])->refs++;
  pthread_mutex_unlock(&ps->lock);

  uint64_t bytes = 0;
  size_t ndone = 0, nreal = 0, nreal_all = 0;
  int ok = 1, counted = 0;
  char why[ROOMS_REASON_MAX];
  for (size_t i = 0; i < n; i++) nreal_all += !infos[i]->m2->is_dummy;
  for (size_t i = 0; i < n && ok; i++) {
    const wire_m2 *x = infos[i]->m2;
    if (x->is_dummy) continue;
    nreal++;
    /* Verify mode (hashes, digests, parts) takes the integrity path. */
    int rc = c->digests || (x->room_flags & WIRE_ROOM_VERIFY)
                 ? send_to_dest(ps, c, x, &bytes, why, sizeof why)
                 : send_to_dest_sc(ps, sc, c, infos[i], nreal_all, &bytes, why, sizeof why);
    if (rc != DEST_OK) {
      fail_dest(ps, r, x, why, rc == DEST_XFER_FAIL);
      ok = 0; /* §6.11 step 5: stop processing this chunk */
      break;
    }
    if (!c->is_last) continue;
    done[ndone++] = i;
    if ((int64_t)ndone != x->required_dst_info_num) continue;
    /* §6.11 step 6: every required destination has the data. The counters
     * move first, so whoever sees Success also sees them. */
    atomic_fetch_add(&m->stats.chunks_sent, 1);
    atomic_fetch_add(&m->stats.bytes_sent, bytes);
    counted = 1;
    pthread_mutex_lock(&ps->lock);
    int fin = ROOM_FAILED, parked = 0;
    int64_t tok = c->token;
    const int32_t *cd = c->cands;
    size_t ncd = c->ncand;
    if (!r->dead && c->token == PF_TOKEN_LATER) {
      if (r->meta_set) { /* published before the chunk landed */
        tok = r->meta_token, cd = r->meta_cands, ncd = r->meta_ncand;
      } else {
        tok = -1, cd = NULL, ncd = 0; /* the chunk's values, should the room be Failed */
        kvf__rooms_get_status(m->rooms, r->room, &fin);
        if (fin != ROOM_FAILED) {
          pf_dest *d = calloc(ndone, sizeof *d);
          if (d) {
            for (size_t k = 0; k < ndone; k++) {
              const wire_m2 *y = infos[done[k]]->m2;
              snprintf(d[k].host, sizeof d[k].host, "%s", y->endpoint);
              d[k].port = y->dst_port;
            }
            free(r->park); /* a later, larger completed list replaces it */
            r->park = d, r->npark = ndone, r->landed_ns = clock_now_ns();
            parked = 1;
          } else {
            kvf__rooms_fail(m->rooms, r->room, "Out of memory in the transfer worker");
          }
        }
      }
    }
    if (!r->dead && !parked) {
      kvf__rooms_update(m->rooms, r->room, ROOM_SUCCESS, NULL);
      kvf__rooms_get_status(m->rooms, r->room, &fin);
    }
    int dead = r->dead;
    pthread_mutex_unlock(&ps->lock);
    if (dead || parked) break; /* parked: kvf_sender_set_metadata or the poll sends the M3s */
    for (size_t k = 0; k < ndone; k++) {
      const wire_m2 *y = infos[done[k]]->m2;
      send_m3(m, y->endpoint, y->dst_port, r->room, fin == ROOM_SUCCESS ? ROOM_SUCCESS : ROOM_FAILED, tok, cd,
              ncd);
    }
  }
  if (ok && !counted) {
    atomic_fetch_add(&m->stats.chunks_sent, 1);
    atomic_fetch_add(&m->stats.bytes_sent, bytes);
  }
  if (ok && c->is_last && nreal == 0 && n > 0) { /* all destinations are dummies (§6.11 step 1) */
    pthread_mutex_lock(&ps->lock);
    if (!r->dead) kvf__rooms_update(m->rooms, r->room, ROOM_SUCCESS, NULL);
    pthread_mutex_unlock(&ps->lock);
  }
  pthread_mutex_lock(&ps->lock);
  for (size_t i = 0; i < n; i++) info_unref(infos[i]);
  pthread_mutex_unlock(&ps->lock);
}

/* ------------------------------------------------------- direct transfers */

/* A room sent in one chunk small enough (PF_DIRECT_MAX_BYTES) skips the
 * worker: the calling thread plans it and submits one engine write per
 * destination with a completion callback, and the thread that reads the
 * engine's acknowledgements makes the room Success and sends the M3s. No
 * thread wakes up only to pass the chunk on, and the sender's call does not
 * wait for the bytes. Only a room's first and last chunk goes this way, so
 * no earlier chunk of the room can still be in flight when it completes.
 * Records come from a pool sized once (PF_DIRECT_SLOTS); with none free, or
 * the planning scratch busy on another thread, the chunk takes the worker
 * path. */

static void direct_finish(pf_direct *dj) {
  prefill_state *ps = dj->ps;
  kvf_manager *m = ps->m;
  pf_room *r = dj->r;
  size_t upto = 0, nreal = 0;
  int ok = !atomic_load(&dj->failed), success = 0;
  for (size_t i = 0; ok && i < dj->n && !upto; i++) {
    const wire_m2 *x = dj->d[i].info->m2;
    if (x->is_dummy) continue;
    if ((int64_t)++nreal == x->required_dst_info_num) upto = i + 1; /* §6.11 step 6 */
  }
  for (size_t i = upto; ok && i < dj->n; i++) nreal += !dj->d[i].info->m2->is_dummy;
  if (ok) { /* the counters move first, so whoever sees Success also sees them */
    atomic_fetch_add(&m->stats.chunks_sent, 1);
    atomic_fetch_add(&m->stats.bytes_sent, dj->bytes);
  }
  int fin = ROOM_FAILED;
  pthread_mutex_lock(&ps->lock);
  if (ok && !r->dead && (upto || (nreal == 0 && dj->n > 0))) { /* or only dummies (§6.11 step 1) */
    kvf__rooms_update(m->rooms, r->room, ROOM_SUCCESS, NULL);
    kvf__rooms_get_status(m->rooms, r->room, &fin);
    success = upto > 0;
  }
  pthread_mutex_unlock(&ps->lock);
  for (size_t i = 0; success && i < upto; i++) {
    const wire_m2 *y = dj->d[i].info->m2;
    if (y->is_dummy) continue;
    send_m3(m, y->endpoint, y->dst_port, r->room, fin == ROOM_SUCCESS ? ROOM_SUCCESS : ROOM_FAILED, dj->token,
            dj->cands, dj->ncand);
  }
  pthread_mutex_lock(&ps->lock);
  for (size_t i = 0; i < dj->n; i++) info_unref(dj->d[i].info);
  room_unref(ps, r);
  dj->r = NULL;
  dj->next = ps->direct_free;
  ps->direct_free = dj;
  if (--ps->direct_busy == 0) pthread_cond_broadcast(&ps->direct_cv);
  pthread_mutex_unlock(&ps->lock);
}

static void direct_release(pf_direct *dj) {
  if (atomic_fetch_sub(&dj->left, 1) == 1) direct_finish(dj);
}

/* Engine completion of one destination's write (a transport thread). */
static void direct_done(void *arg, int status) {
  pf_direct_dest *d = arg;
  pf_direct *dj = d->owner;
  if (status) {
    char why[ROOMS_REASON_MAX];
    xfer_why(dj->r, d->info->m2, status, why, sizeof why);
    atomic_store(&dj->failed, 1);
    fail_dest(dj->ps, dj->r, d->info->m2, why, 1);
  }
  direct_release(dj);
}

/* ps->lock held: a direct record for the chunk, or NULL (worker path). On
 * success the room and its infos are referenced and ps->direct_lock is held. */
static pf_direct *direct_take_locked(prefill_state *ps, pf_room *r, const pf_chunk *c, size_t prior) {
  int st = ROOM_FAILED;
  if (!c->is_last || c->token == PF_TOKEN_LATER || !r->bootstrapped || r->nchunks != prior || r->dead ||
      r->ninfos > PF_DIRECT_MAX_DESTS || !ps->direct_free || ps->m->cfg.verify || c->digests)
    return NULL;
  for (size_t i = 0; i < r->ninfos; i++) /* verify mode: the integrity path */
    if (r->infos[i]->m2->room_flags & WIRE_ROOM_VERIFY) return NULL;
  uint64_t per_page = ps->layer_bytes[c->layer_end] - ps->layer_bytes[c->layer_begin];
  if (c->npages && per_page > PF_DIRECT_MAX_BYTES / c->npages) return NULL;
  if (kvf__rooms_get_status(ps->m->rooms, r->room, &st) || st == ROOM_FAILED) return NULL;
  if (pthread_mutex_trylock(&ps->direct_lock)) return NULL;
  pf_direct *dj = ps->direct_free;
  ps->direct_free = dj->next;
  ps->direct_busy++;
  dj->r = r;
  r->refs++;
  dj->n = r->ninfos;
  for (size_t i = 0; i < dj->n; i++) {
    dj->d[i] = (pf_direct_dest){.owner = dj, .info = r->infos[i]};
    r->infos[i]->refs++;
  }
  return dj;
}

/* Plan and submit a direct chunk (ps->direct_lock held; released here). */
static void direct_run(prefill_state *ps, pf_direct *dj, const pf_chunk *c) {
  pf_scratch *sc = &ps->direct_sc;
  char why[ROOMS_REASON_MAX];
  dj->ps = ps;
  dj->token = c->token;
  dj->ncand = c->ncand;
  if (c->ncand) memcpy(dj->cands, c->cands, c->ncand * sizeof *c->cands);
  dj->bytes = 0;
  atomic_store(&dj->failed, 0);
  atomic_store(&dj->left, 1); /* this thread's guard: no finish while submitting */
  size_t nreal = 0;
  for (size_t i = 0; i < dj->n; i++) nreal += !dj->d[i].info->m2->is_dummy;
  for (size_t i = 0; i < dj->n; i++) {
    const wire_m2 *x = dj->d[i].info->m2;
    if (x->is_dummy) continue;
    if (plan_dest(ps, sc, c, dj->d[i].info, why, sizeof why) != DEST_OK) {
      atomic_store(&dj->failed, 1);
      fail_dest(ps, dj->r, x, why, 0);
      break; /* §6.11 step 5: stop processing this chunk */
    }
    dj->bytes += writes_bytes(sc->w, sc->nw);
    atomic_fetch_add(&dj->left, 1);
    unsigned char tb[KVF_ENGINE_MAX_TRAILER];
    size_t tlen = completion_trailer(ps, dj->r->room, x, nreal, dj->token, dj->cands, dj->ncand, tb, sizeof tb);
    kvf_batch_opts opts;
    fence_opts(x, &opts);
    int rc = kvf__engine_submit_cb(ps->m->engine, x->session, sc->w, sc->nw, &opts, tlen ? tb : NULL, tlen,
                                   direct_done, &dj->d[i]);
    if (rc) {
      atomic_fetch_sub(&dj->left, 1);
      atomic_store(&dj->failed, 1);
      xfer_why(dj->r, x, rc, why, sizeof why);
      fail_dest(ps, dj->r, x, why, 1);
      break;
    }
  }
  pthread_mutex_unlock(&ps->direct_lock);
  direct_release(dj);
}

static void *worker_main(void *arg) {
  pf_queue *q = arg;
  prefill_state *ps = q->ps;
  for (;;) {
    pthread_mutex_lock(&q->lock);
    while (!q->head && !q->stop) pthread_cond_wait(&q->cond, &q->lock);
    if (q->stop) {
      pthread_mutex_unlock(&q->lock);
      break;
    }
    kvf__wake_count();
    pf_chunk *c = q->head;
    q->head = c->next;
    if (!q->head) q->tail = NULL;
    q->count--;
    pthread_mutex_unlock(&q->lock);
    process_chunk(ps, &q->sc, c);
    pthread_mutex_lock(&ps->lock);
    chunk_release_locked(ps, c);
    pthread_mutex_unlock(&ps->lock);
  }
  return NULL;
}

/* ------------------------------------------------------- start and stop */

static int put_route(kvf_manager *m) {
  const manager_buffers *b = &m->bufs;
  route_reg reg;
  memset(&reg, 0, sizeof reg);
  snprintf(reg.role, sizeof reg.role, "Prefill");
  reg.world_size = m->cfg.world_size;
  reg.dp_size = m->cfg.dp_size;
  snprintf(reg.rank_ip, sizeof reg.rank_ip, "%s", m->host);
  reg.rank_port = m->rank_port;
  reg.engine_rank = m->cfg.engine_rank;
  /* kvferry's page layout: our MHA pages are token-major (§6.5.7 caveat). */
  const uint64_t layout[2] = {(uint64_t)m->cfg.page_size, 1};
  const uint64_t *src[ROUTE_NLISTS] = {b->kv_item_lens, b->kv_unit_lens, b->state_item_lens, b->state_unit_lens,
                                       layout};
  size_t cnt[ROUTE_NLISTS] = {b->n_kv, b->n_kv, b->n_state, b->n_state, 2};
  int rc = 0;
  for (int l = 0; l < ROUTE_NLISTS; l++) {
    reg.lists[l].v = calloc(cnt[l] ? cnt[l] : 1, sizeof(int64_t));
    if (!reg.lists[l].v) rc = KVF_ENOMEM;
    for (size_t i = 0; reg.lists[l].v && i < cnt[l]; i++) reg.lists[l].v[i] = (int64_t)src[l][i];
    reg.lists[l].n = cnt[l];
    reg.lists[l].present = 1;
  }
  bootstrap_client *bc = NULL;
  bootstrap_client_opts opts = {.token = m->bootstrap_token, .timeout_ms = m->cfg.http_timeout_ms};
  if (!rc) rc = kvf__bootstrap_client_create(m->bootstrap_addr, &opts, &bc);
  if (!rc) rc = kvf__bootstrap_client_put_route(bc, &reg, 3 * m->cfg.http_timeout_ms);
  if (rc)
    LOG_ERROR("kv", "prefill rank %d could not register with the bootstrap server %s: %s", m->cfg.engine_rank,
              m->bootstrap_addr, kvf_strerror(rc));
  kvf__bootstrap_client_destroy(bc);
  for (int l = 0; l < ROUTE_NLISTS; l++) free(reg.lists[l].v);
  return rc;
}

static int build_layouts(prefill_state *ps) {
  const manager_buffers *b = &ps->m->bufs;
  size_t nb = b->layer_buf_start[b->n_layers];
  ps->kv_start = malloc((b->n_layers + 1) * sizeof(size_t));
  ps->kv_bufs = malloc((nb ? nb : 1) * sizeof(size_t));
  ps->st_start = malloc(2 * sizeof(size_t));
  ps->st_bufs = malloc((b->n_state ? b->n_state : 1) * sizeof(size_t));
  if (!ps->kv_start || !ps->kv_bufs || !ps->st_start || !ps->st_bufs) return KVF_ENOMEM;
  for (size_t l = 0; l <= b->n_layers; l++) ps->kv_start[l] = b->layer_buf_start[l];
  for (size_t k = 0; k < nb; k++) ps->kv_bufs[k] = b->layer_bufs[k];
  ps->kv_lay = (plan_layout){b->n_layers, ps->kv_start, ps->kv_bufs};
  ps->st_start[0] = 0;
  ps->st_start[1] = b->n_state;
  for (size_t k = 0; k < b->n_state; k++) ps->st_bufs[k] = k;
  ps->st_lay = (plan_layout){1, ps->st_start, ps->st_bufs};
  if (!b->state_layer) return 0;
  /* State buffers by layer (a counting sort), for layerwise chunks. */
  ps->stl_start = calloc(b->n_layers + 1, sizeof(size_t));
  ps->stl_bufs = malloc((b->n_state ? b->n_state : 1) * sizeof(size_t));
  if (!ps->stl_start || !ps->stl_bufs) return KVF_ENOMEM;
  for (size_t k = 0; k < b->n_state; k++) ps->stl_start[b->state_layer[k] + 1]++;
  for (size_t l = 0; l < b->n_layers; l++) ps->stl_start[l + 1] += ps->stl_start[l];
  for (size_t l = 0, k = 0; l < b->n_layers; l++)
    for (size_t j = 0; j < b->n_state; j++)
      if (b->state_layer[j] == l) ps->stl_bufs[k++] = j;
  ps->stl_lay = (plan_layout){b->n_layers, ps->stl_start, ps->stl_bufs};
  return 0;
}

/* The direct-transfer records, their planning scratch and the per-layer
 * page bytes that decide which chunks are small enough: sized once. */
static int direct_init(prefill_state *ps) {
  const manager_buffers *b = &ps->m->bufs;
  ps->layer_bytes = calloc(b->n_layers + 1, sizeof *ps->layer_bytes);
  ps->direct_pool = calloc(PF_DIRECT_SLOTS, sizeof *ps->direct_pool);
  if (!ps->layer_bytes || !ps->direct_pool || scratch_init(&ps->direct_sc, b)) return KVF_ENOMEM;
  for (size_t l = 0; l < b->n_layers; l++) {
    uint64_t sum = 0;
    for (uint32_t k = b->layer_buf_start[l]; k < b->layer_buf_start[l + 1]; k++)
      sum += b->kv_item_lens[b->layer_bufs[k]];
    ps->layer_bytes[l + 1] = ps->layer_bytes[l] + sum;
  }
  for (size_t i = PF_DIRECT_SLOTS; i-- > 0;) {
    ps->direct_pool[i].next = ps->direct_free;
    ps->direct_free = &ps->direct_pool[i];
  }
  return 0;
}

static void free_state(prefill_state *ps) {
  map_iter it;
  void *v;
  kvf__map_iter_init(&it);
  while (kvf__smap_next(&ps->regs, &it, NULL, &v)) {
    pf_reg *reg = v;
    free(reg->m1);
    free(reg);
  }
  kvf__smap_free(&ps->regs);
  kvf__map_iter_init(&it);
  while (kvf__map_next(&ps->rooms, &it, NULL, &v)) {
    pf_room *r = v;
    r->refs = 1; /* workers are gone: nothing else can hold it */
    room_unref(ps, r);
  }
  kvf__map_free(&ps->rooms);
  free(ps->kv_start), free(ps->kv_bufs), free(ps->st_start), free(ps->st_bufs);
  free(ps->stl_start), free(ps->stl_bufs);
  while (ps->room_spare) {
    pf_room *r = ps->room_spare;
    ps->room_spare = r->next_spare;
    free(r->infos);
    free(r);
  }
  while (ps->sender_spare) {
    kvf_sender *s = ps->sender_spare;
    ps->sender_spare = s->next_spare;
    free(s);
  }
  free(ps->layer_bytes), free(ps->direct_pool);
  scratch_free(&ps->direct_sc);
  pthread_cond_destroy(&ps->direct_cv);
  pthread_mutex_destroy(&ps->direct_lock);
  pthread_mutex_destroy(&ps->lock);
  free(ps->queues);
  free(ps);
}

static void stop_workers(prefill_state *ps) {
  for (int i = 0; i < ps->nqueues; i++) {
    pf_queue *q = &ps->queues[i];
    pthread_mutex_lock(&q->lock);
    q->stop = 1;
    pthread_cond_broadcast(&q->cond);
    pthread_mutex_unlock(&q->lock);
  }
  for (int i = 0; i < ps->nqueues; i++) {
    pf_queue *q = &ps->queues[i];
    if (q->started) pthread_join(q->thread, NULL);
    /* chunks never processed: drop them with their room references */
    pthread_mutex_lock(&ps->lock);
    for (pf_chunk *c = q->head, *n; c; c = n) {
      n = c->next;
      chunk_release_locked(ps, c);
    }
    q->head = q->tail = NULL;
    pthread_mutex_unlock(&ps->lock);
    pthread_cond_destroy(&q->cond);
    pthread_mutex_destroy(&q->lock);
    scratch_free(&q->sc);
  }
}

int kvf__prefill_start(kvf_manager *m) {
  prefill_state *ps = calloc(1, sizeof *ps);
  if (!ps) return KVF_ENOMEM;
  ps->m = m;
  pthread_mutex_init(&ps->lock, NULL);
  pthread_mutex_init(&ps->direct_lock, NULL);
  clock_cond_init(&ps->direct_cv);
  int rc = smap_init(&ps->regs);
  if (!rc) rc = kvf__map_init(&ps->rooms);
  if (!rc) rc = build_layouts(ps);
  if (!rc) rc = direct_init(ps);
  ps->nqueues = m->cfg.queue_size;
  if (!rc && !(ps->queues = calloc((size_t)ps->nqueues, sizeof *ps->queues))) rc = KVF_ENOMEM;
  if (rc) goto err_free;
  if (m->bootstrap_addr[0] && (rc = put_route(m))) goto err_free;
  for (int i = 0; i < ps->nqueues; i++) {
    pf_queue *q = &ps->queues[i];
    q->ps = ps;
    pthread_mutex_init(&q->lock, NULL);
    pthread_cond_init(&q->cond, NULL);
  }
  for (int i = 0; i < ps->nqueues; i++)
    if (scratch_init(&ps->queues[i].sc, &m->bufs)) {
      rc = KVF_ENOMEM;
      goto err_workers;
    }
  for (int i = 0; i < ps->nqueues; i++) {
    if (pthread_create(&ps->queues[i].thread, NULL, worker_main, &ps->queues[i])) {
      rc = KVF_ENOMEM;
      goto err_workers;
    }
    ps->queues[i].started = 1;
  }
  m->prefill = ps;
  return 0;

err_workers:
  stop_workers(ps);
err_free:
  free_state(ps);
  return rc;
}

void kvf__prefill_stop(kvf_manager *m) {
  prefill_state *ps = m->prefill;
  if (!ps) return;
  /* Direct chunks end in an engine callback, which the transport always
   * delivers by the batch deadline; the state must outlive them. */
  int64_t until = clock_deadline_ms(PF_DIRECT_DRAIN_MS);
  pthread_mutex_lock(&ps->lock);
  while (ps->direct_busy && clock_now_ns() < until) {
    struct timespec ts = clock_ts_from_ns(until);
    pthread_cond_timedwait(&ps->direct_cv, &ps->lock, &ts);
  }
  size_t busy = ps->direct_busy;
  pthread_mutex_unlock(&ps->lock);
  if (busy) { /* a transport bug: leak the state rather than free it under a callback */
    LOG_ERROR("kv", "prefill stop: %zu direct transfers never completed; their state is leaked", busy);
    stop_workers(ps);
    m->prefill = NULL;
    return;
  }
  stop_workers(ps);
  free_state(ps);
  m->prefill = NULL;
}

/* ----------------------------------------------------------------- sender */

/* ps->lock held: keep a sender's record for the next room (PF_SPARE_ROOMS). */
static void sender_drop_locked(prefill_state *ps, kvf_sender *s) {
  if (ps->nsender_spare >= PF_SPARE_ROOMS) {
    free(s);
    return;
  }
  s->next_spare = ps->sender_spare;
  ps->sender_spare = s;
  ps->nsender_spare++;
}

int kvf_sender_create(kvf_manager *m, int64_t room, kvf_sender **out) {
  if (!m || !out || !m->prefill) return KVF_EINVAL;
  prefill_state *ps = m->prefill;
  pthread_mutex_lock(&ps->lock);
  kvf_sender *s = ps->sender_spare; /* a destroyed sender's record, when there is one */
  if (s) ps->sender_spare = s->next_spare, ps->nsender_spare--;
  pthread_mutex_unlock(&ps->lock);
  if (s) memset(s, 0, sizeof *s);
  else if (!(s = calloc(1, sizeof *s))) return KVF_ENOMEM;
  pthread_mutex_lock(&ps->lock);
  pf_room *r = kvf__map_get(&ps->rooms, (uint64_t)room);
  int rc = r && r->has_sender ? KVF_EEXIST : 0;
  if (!rc) rc = kvf__rooms_create(m->rooms, room, ROOM_BOOTSTRAPPING);
  if (rc) goto err_unlock;
  if (!r) {
    if (!(r = room_new(ps)) || kvf__map_put(&ps->rooms, (uint64_t)room, r, NULL)) {
      room_drop(ps, r);
      kvf__rooms_clear(m->rooms, room, NULL);
      rc = KVF_ENOMEM;
      goto err_unlock;
    }
    r->room = room;
    r->refs = 1;
  } else {
    early_unlink(ps, r); /* the M2s came first */
  }
  r->has_sender = 1;
  r->create_ns = clock_now_ns();
  if (r->bootstrapped) kvf__rooms_update(m->rooms, room, ROOM_BOOTSTRAPPED, NULL);
  pthread_mutex_unlock(&ps->lock);
  s->m = m;
  s->r = r;
  s->room = room;
  *out = s;
  return 0;

err_unlock:
  sender_drop_locked(ps, s);
  pthread_mutex_unlock(&ps->lock);
  return rc;
}

/* Verify mode: digest every (page, buffer) the chunk will send, now, while
 * the caller still guarantees the pages hold the request's KV. A page
 * outside the pool is KVF_ERANGE. */
static int hash_pages(kvf_manager *m, pf_chunk *c) {
  int rc = kvf__integ_layer_bufs(m, c->layer_begin, c->layer_end, &c->dig_bufs, &c->ndig);
  if (rc) return rc;
  size_t nd = c->npages * c->ndig;
  if (!(c->digests = malloc((nd ? nd : 1) * sizeof *c->digests))) return KVF_ENOMEM;
  for (size_t k = 0; k < c->npages; k++)
    for (size_t j = 0; j < c->ndig; j++)
      if ((rc = kvf__integ_page_digest(m, c->dig_bufs[j], c->pages[k], &c->digests[k * c->ndig + j]))) return rc;
  return 0;
}

/* Both send calls: validate, copy and queue (or park) one chunk. pos is the
 * index_slice start; explicit_idx says it is a destination index. */
static int sender_submit(kvf_sender *s, const int64_t *pages, size_t npages, int64_t pos, int explicit_idx,
                         size_t layer_begin, size_t layer_end, int is_last, int64_t aux_index,
                         int64_t bootstrap_token, const int32_t *cands, size_t ncand, const int64_t *state_slots,
                         size_t nstate) {
  prefill_state *ps = s->m->prefill;
  if (is_last) { /* a room's only chunk, small enough: straight to the engine */
    pf_chunk view = {.r = s->r,
                     .pages = (int64_t *)pages,
                     .npages = npages,
                     .pos = pos,
                     .explicit_idx = explicit_idx,
                     .layer_begin = layer_begin,
                     .layer_end = layer_end,
                     .is_last = 1,
                     .aux_index = aux_index,
                     .token = bootstrap_token,
                     .cands = (int32_t *)cands,
                     .ncand = ncand,
                     .state_slots = (int64_t *)state_slots,
                     .nstate = nstate};
    pthread_mutex_lock(&ps->lock);
    pf_direct *dj = direct_take_locked(ps, s->r, &view, 0);
    if (dj) s->r->nchunks++;
    pthread_mutex_unlock(&ps->lock);
    if (dj) {
      direct_run(ps, dj, &view);
      if (s->curr < pos + (int64_t)npages) s->curr = pos + (int64_t)npages;
      s->last_sent = 1;
      return 0;
    }
  }
  pf_chunk *c = calloc(1, sizeof *c);
  if (!c) return KVF_ENOMEM;
  c->pages = malloc((npages ? npages : 1) * sizeof *c->pages);
  c->cands = is_last && ncand ? malloc(ncand * sizeof *c->cands) : NULL;
  c->state_slots = nstate ? malloc(nstate * sizeof *c->state_slots) : NULL;
  if (!c->pages || (is_last && ncand && !c->cands) || (nstate && !c->state_slots)) {
    kvf__chunk_free(c);
    return KVF_ENOMEM;
  }
  if (npages) memcpy(c->pages, pages, npages * sizeof *pages);
  c->npages = npages;
  c->pos = pos;
  c->explicit_idx = explicit_idx;
  c->layer_begin = layer_begin;
  c->layer_end = layer_end;
  c->is_last = is_last != 0;
  /* non-last chunks carry no aux index, token or candidates (§6.2) */
  c->aux_index = is_last ? aux_index : -1;
  c->token = is_last ? bootstrap_token : -1;
  if (c->cands) memcpy(c->cands, cands, ncand * sizeof *cands), c->ncand = ncand;
  if (c->state_slots) memcpy(c->state_slots, state_slots, nstate * sizeof *state_slots), c->nstate = nstate;
  int rc = s->m->cfg.verify ? hash_pages(s->m, c) : 0;
  if (rc) {
    kvf__chunk_free(c);
    return rc;
  }

  int st = ROOM_FAILED;
  pf_room *r = s->r;
  pthread_mutex_lock(&ps->lock);
  if (kvf__rooms_get_status(s->m->rooms, s->room, &st) || st == ROOM_FAILED) {
    kvf__chunk_free(c); /* the reference drops chunks of a failed room silently */
    goto out;
  }
  if (!r->bootstrapped && r->npending >= PF_MAX_PENDING) {
    kvf__chunk_free(c);
    rc = KVF_ETOOBIG;
    goto out;
  }
  c->r = r;
  r->refs++;
  r->nchunks++;
  if (r->bootstrapped) {
    if (queue_push(&ps->queues[r->shard], c)) {
      chunk_release_locked(ps, c);
      rc = KVF_ETOOBIG;
      goto out;
    }
  } else {
    c->next = NULL;
    if (r->pend_tail) r->pend_tail->next = c;
    else r->pend_head = c;
    r->pend_tail = c;
    r->npending++;
  }
out:
  pthread_mutex_unlock(&ps->lock);
  if (!rc) {
    if (s->curr < pos + (int64_t)npages) s->curr = pos + (int64_t)npages;
    if (is_last) s->last_sent = 1;
  }
  return rc;
}

void kvf_send_params_init(kvf_send_params *p) {
  if (!p) return;
  memset(p, 0, sizeof *p);
  p->size = sizeof *p;
  p->aux_index = -1;
  p->bootstrap_token = -1;
}

int kvf_sender_send(kvf_sender *s, const kvf_send_params *in) {
  kvf_send_params p;
  kvf_send_params_init(&p);
  if (!s || !in || kvf__config_copy(&p, sizeof p, in, sizeof p)) return KVF_EINVAL;
  const uint32_t known = KVF_SEND_LAST | KVF_SEND_TOKEN_LATER | KVF_SEND_LAYERS;
  int is_last = (p.flags & KVF_SEND_LAST) != 0, layers = (p.flags & KVF_SEND_LAYERS) != 0;
  if ((p.flags & ~known) || ((p.flags & KVF_SEND_TOKEN_LATER) && !is_last)) return KVF_EINVAL;
  if ((p.npages && !p.pages) || (p.ncand && !p.cands) || (p.nstate && !p.state_slots)) return KVF_EINVAL;
  if (p.bootstrap_token < -1) return KVF_EINVAL;
  if (layers && (p.layer_begin > p.layer_end || p.layer_end > s->m->bufs.n_layers)) return KVF_EINVAL;
  if (p.npages > WIRE_MAX_PAGES || p.ncand > KVF_MAX_CANDIDATES || p.nstate > WIRE_MAX_PAGES ||
      (layers && p.index_begin > (size_t)WIRE_MAX_PAGES))
    return KVF_ETOOBIG;
  if (s->last_sent) return KVF_ESTATE;
  int64_t token = p.bootstrap_token;
  if (p.flags & KVF_SEND_TOKEN_LATER) token = PF_TOKEN_LATER, p.ncand = 0;
  if (!layers)
    return sender_submit(s, p.pages, p.npages, s->curr, 0, 0, s->m->bufs.n_layers, is_last, p.aux_index, token,
                         p.cands, p.ncand, p.state_slots, is_last ? p.nstate : 0);
  /* §6.2: send_layerwise skips an empty non-last chunk (no pages or no
   * layers: nothing to write, and it completes nothing), unless it carries
   * the state of its layer group. */
  if (!is_last && (!p.npages || p.layer_begin == p.layer_end) && !p.nstate) {
    if (s->curr < (int64_t)(p.index_begin + p.npages)) s->curr = (int64_t)(p.index_begin + p.npages);
    return 0;
  }
  return sender_submit(s, p.pages, p.npages, (int64_t)p.index_begin, 1, p.layer_begin, p.layer_end, is_last,
                       p.aux_index, token, p.cands, p.ncand, p.state_slots, p.nstate);
}

int kvf_sender_set_metadata(kvf_sender *s, int64_t bootstrap_token, const int32_t *cands, size_t ncand) {
  if (!s || (ncand && !cands) || bootstrap_token < -1) return KVF_EINVAL;
  if (ncand > KVF_MAX_CANDIDATES) return KVF_ETOOBIG;
  prefill_state *ps = s->m->prefill;
  pf_room *r = s->r;
  int32_t *copy = ncand ? malloc(ncand * sizeof *copy) : NULL;
  if (ncand && !copy) return KVF_ENOMEM;
  if (ncand) memcpy(copy, cands, ncand * sizeof *cands);
  int st = ROOM_FAILED, rc = 0;
  pf_dest *d = NULL;
  size_t nd = 0;
  const int32_t *cd = NULL;
  pthread_mutex_lock(&ps->lock);
  if (r->dead || kvf__rooms_get_status(s->m->rooms, s->room, &st)) {
    rc = KVF_ENOTFOUND;
  } else if (r->meta_set) {
    rc = KVF_EEXIST;
  } else {
    r->meta_set = 1;
    r->meta_token = bootstrap_token;
    r->meta_cands = copy, r->meta_ncand = ncand;
    cd = copy, copy = NULL;
    if (r->park) { /* the KV landed: Success now (§6.11 step 6) */
      d = r->park, nd = r->npark;
      r->park = NULL, r->npark = 0;
      if (st != ROOM_FAILED) {
        kvf__rooms_update(s->m->rooms, s->room, ROOM_SUCCESS, NULL);
        kvf__rooms_get_status(s->m->rooms, s->room, &st);
      }
    }
  }
  pthread_mutex_unlock(&ps->lock);
  free(copy);
  /* cd stays valid: the room lives as long as the sender, and its metadata
   * never changes once set. */
  for (size_t k = 0; k < nd; k++)
    send_m3(s->m, d[k].host, d[k].port, s->room, st == ROOM_SUCCESS ? ROOM_SUCCESS : ROOM_FAILED, bootstrap_token,
            cd, ncand);
  free(d);
  return rc;
}

kvf_poll_status kvf_sender_poll(kvf_sender *s) {
  if (!s) return KVF_POLL_FAILED;
  prefill_state *ps = s->m->prefill;
  pf_dest *d = NULL;
  size_t nd = 0;
  int st = ROOM_FAILED;
  pthread_mutex_lock(&ps->lock);
  if (kvf__rooms_get_status(s->m->rooms, s->room, &st)) st = ROOM_FAILED;
  double limit = s->m->cfg.bootstrap_timeout_s;
  if (st == ROOM_BOOTSTRAPPING && clock_now_ns() - s->r->create_ns >= (int64_t)(limit * 1e9)) {
    char why[ROOMS_REASON_MAX];
    snprintf(why, sizeof why, "Request %" PRId64 " timed out after %.1fs in TransferPoll.Bootstrapping", s->room,
             limit);
    kvf__rooms_fail(s->m->rooms, s->room, why);
    st = ROOM_FAILED;
    d = collect_dests(s->r, &nd);
    LOG_WARN("kv", "%s", why);
  } else if (s->r->park) {
    /* PF_TOKEN_LATER: the KV landed and the token is late (§8 item 2). */
    limit = s->m->cfg.bootstrap_timeout_s;
    if (st != ROOM_FAILED && clock_now_ns() - s->r->landed_ns >= (int64_t)(limit * 1e9)) {
      char why[ROOMS_REASON_MAX];
      snprintf(why, sizeof why, "Request %" PRId64 ": first token not published within %.1fs after its KV landed",
               s->room, limit);
      kvf__rooms_fail(s->m->rooms, s->room, why);
      st = ROOM_FAILED;
      LOG_WARN("kv", "%s", why);
    }
    if (st == ROOM_FAILED) { /* timed out, or failed another way without telling these */
      d = s->r->park, nd = s->r->npark;
      s->r->park = NULL, s->r->npark = 0;
    }
  }
  pthread_mutex_unlock(&ps->lock);
  if (d) send_failed_all(s->m, s->room, d, nd);
  return (kvf_poll_status)st;
}

int kvf_sender_dest_info(kvf_sender *s, size_t *nreal, size_t *ndummy, int64_t *decode_prefix_len) {
  if (!s || !nreal || !ndummy || !decode_prefix_len) return KVF_EINVAL;
  prefill_state *ps = s->m->prefill;
  int rc = 0;
  *nreal = *ndummy = 0;
  *decode_prefix_len = 0;
  pthread_mutex_lock(&ps->lock);
  if (s->r->dead) {
    rc = KVF_ENOTFOUND;
  } else {
    for (size_t i = 0; i < s->r->ninfos; i++) {
      const wire_m2 *x = s->r->infos[i]->m2;
      if (x->is_dummy) {
        (*ndummy)++;
      } else if ((*nreal)++ == 0) {
        *decode_prefix_len = x->decode_prefix_len;
      }
    }
  }
  pthread_mutex_unlock(&ps->lock);
  return rc;
}

void kvf_sender_failure(kvf_sender *s, char *buf, size_t cap) {
  if (!buf || !cap) return;
  buf[0] = 0;
  if (s && kvf__rooms_get_reason(s->m->rooms, s->room, buf, cap)) buf[0] = 0;
}

void kvf_sender_abort(kvf_sender *s, const char *reason) {
  if (!s) return;
  prefill_state *ps = s->m->prefill;
  size_t nd = 0;
  pthread_mutex_lock(&ps->lock);
  kvf__rooms_fail(s->m->rooms, s->room, reason && *reason ? reason : "Aborted");
  pf_dest *d = collect_dests(s->r, &nd);
  free(s->r->park); /* the parked destinations are told here */
  s->r->park = NULL, s->r->npark = 0;
  pthread_mutex_unlock(&ps->lock);
  if (d) send_failed_all(s->m, s->room, d, nd);
}

void kvf_sender_destroy(kvf_sender *s) {
  if (!s) return;
  prefill_state *ps = s->m->prefill;
  pf_room *r = s->r;
  pthread_mutex_lock(&ps->lock);
  kvf__rooms_clear(s->m->rooms, s->room, NULL);
  r->dead = 1;
  if (kvf__map_get(&ps->rooms, (uint64_t)s->room) == r) kvf__map_del(&ps->rooms, (uint64_t)s->room, NULL);
  pf_chunk *c = r->pend_head;
  r->pend_head = r->pend_tail = NULL;
  r->npending = 0;
  while (c) {
    pf_chunk *n = c->next;
    chunk_release_locked(ps, c);
    c = n;
  }
  room_unref(ps, r); /* the map's reference; queued chunks keep theirs */
  sender_drop_locked(ps, s);
  pthread_mutex_unlock(&ps->lock);
}

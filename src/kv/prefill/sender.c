/* The kvf_sender API the scheduler drives (include/kvferry/kv.h): create,
 * send (whole-request chunks or layer groups), set_metadata (the first
 * token, which also releases a parked room), poll (with the bootstrap and
 * token timeouts), abort and destroy. */
#include "kv/prefill/prefill_int.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <unistd.h>

#include "base/env.h"

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
  pf_room *r = kvf__pf_room_find(ps, room);
  int rc = r && r->has_sender ? KVF_EEXIST : 0;
  if (!rc) rc = kvf__rooms_create(m->rooms, room, ROOM_BOOTSTRAPPING); /* an early room becomes live */
  if (rc) goto err_unlock;
  if (!r) {
    if (!(r = kvf__pf_room_new(ps))) {
      kvf__rooms_clear(m->rooms, room, NULL);
      rc = KVF_ENOMEM;
      goto err_unlock;
    }
    r->room = room;
    r->refs = 1;
    kvf__rooms_set_user(m->rooms, room, r); /* cannot fail: live, and ps->lock held */
  } else {
    kvf__pf_early_unlink(ps, r); /* the M2s came first */
  }
  kvf__pf_ended_forget_locked(ps, room); /* the same id again: its M2s are served */
  r->has_sender = 1;
  r->create_ns = clock_now_ns();
  kvf__trace_at(&r->tr, KVF_TRACE_SENDER_CREATED, r->create_ns);
  if (r->bootstrapped) kvf__rooms_update(m->rooms, room, ROOM_BOOTSTRAPPED, NULL);
  char why[ROOMS_REASON_MAX];
  pf_dest *d = NULL; /* the M2s came first and cannot complete: Failed now */
  size_t nd = 0;
  if (r->bootstrapped && kvf__pf_dests_check_locked(r, why, sizeof why))
    d = kvf__pf_fail_room_locked(ps, r, why, NULL, &nd);
  pthread_mutex_unlock(&ps->lock);
  if (d) {
    LOG_WARN("kv", "room %" PRId64 ": %s", room, why);
    kvf__pf_send_failed_all(m, room, d, nd, why);
  }
  s->m = m;
  s->r = r;
  s->room = room;
  s->status = kvf__rooms_status_cell(m->rooms, room); /* live until destroy clears it */
  *out = s;
  return 0;

err_unlock:
  sender_drop_locked(ps, s);
  pthread_mutex_unlock(&ps->lock);
  return rc;
}

/* Verify mode, hashing published every this many pages (the worker's
 * parts are at least one page; a lock and a broadcast per step). */
#define PF_HASH_STEP 4

/* Verify mode, before the chunk is queued: its digest array, and every
 * (page, buffer) it will send checked to lie in the pool (KVF_ERANGE), so
 * that the hashing after the queueing (hash_pages) cannot fail. */
static int hash_prepare(kvf_manager *m, pf_chunk *c) {
  int rc = kvf__integ_layer_bufs(m, c->layer_begin, c->layer_end, &c->dig_bufs, &c->ndig);
  if (rc) return rc;
  for (size_t j = 0; j < c->ndig; j++)
    for (size_t k = 0; k < c->npages; k++)
      if (!kvf__integ_page_in_buffer(m, c->dig_bufs[j], c->pages[k])) return KVF_ERANGE;
  size_t nd = c->npages * c->ndig;
  if (!(c->digests = malloc((nd ? nd : 1) * sizeof *c->digests))) return KVF_ENOMEM;
  return 0;
}

/* Verify mode, a large chunk: the sending thread hashes with up to
 * PF_HASH_HELPERS threads of its own (started for the chunk, joined before
 * kvf_sender_send returns), each claiming the next block of about
 * PF_HASH_BLOCK_BYTES; a chunk of fewer than PF_HASH_PAR_MIN_BYTES is
 * hashed by the sending thread alone. One thread's hashing was the
 * critical path of a large verified transfer: on 16 cores, 512 MiB
 * requests, verify-mode p50 85.3 -> 76.3 ms (medians of 5 alternating
 * pairs; `kvferry bench e2e --verify`). */
#define PF_HASH_HELPERS 7
#define PF_HASH_BLOCK_BYTES (1u << 20)
#define PF_HASH_PAR_MIN_BYTES (16u << 20)

typedef struct hash_job {
  prefill_state *ps;
  pf_chunk *c;
  size_t block; /* pages per block */
  size_t nblocks;
  atomic_size_t next; /* the next block to claim */
  atomic_uchar *done; /* per block: hashed */
  size_t prefix;      /* blocks [0, prefix) all done; under ps->hash_mu */
} hash_job;

/* Hash pages [k, e) of the chunk (every buffer of its layers). */
static void hash_range(prefill_state *ps, pf_chunk *c, size_t k, size_t e) {
  for (; k < e; k++)
    for (size_t j = 0; j < c->ndig; j++)
      kvf__integ_page_digest(ps->m, c->dig_bufs[j], c->pages[k], &c->digests[k * c->ndig + j]); /* checked */
}

/* Publish that pages [0, upto) are hashed to the workers waiting for them. */
static void hashed_publish_locked(prefill_state *ps, pf_chunk *c, size_t upto) {
  atomic_store(&c->hashed, upto);
  pthread_cond_broadcast(&ps->hash_cv);
}

/* Claim and hash blocks until none is left; the digests of the contiguous
 * prefix of finished blocks are published as they complete. */
static void *hash_claim(void *arg) {
  hash_job *h = arg;
  pf_chunk *c = h->c;
  for (;;) {
    size_t b = atomic_fetch_add(&h->next, 1);
    if (b >= h->nblocks) break;
    size_t k = b * h->block, e = k + h->block < c->npages ? k + h->block : c->npages;
    hash_range(h->ps, c, k, e);
    if (b == 0 && c->ndig) kvf__integ_source_hashed(h->ps->m, c->r->room, c->dig_bufs[0], c->pages[0]);
    atomic_store(&h->done[b], 1);
    pthread_mutex_lock(&h->ps->hash_mu);
    size_t p = h->prefix;
    while (p < h->nblocks && atomic_load(&h->done[p])) p++;
    if (p != h->prefix) {
      h->prefix = p;
      hashed_publish_locked(h->ps, c, p * h->block < c->npages ? p * h->block : c->npages);
    }
    pthread_mutex_unlock(&h->ps->hash_mu);
  }
  return NULL;
}

/* How many threads hash a chunk of `bytes` digested bytes in `nblocks`
 * blocks: 1 (the sending thread alone) below PF_HASH_PAR_MIN_BYTES; else
 * KVFERRY_VERIFY_HASH_THREADS when set, or one per two cores from 4 cores
 * (with fewer the transfer's own threads need them); at most
 * PF_HASH_HELPERS + 1. */
static size_t hash_threads(uint64_t bytes, size_t nblocks) {
  static atomic_long want; /* 0: not read yet */
  long n = atomic_load(&want);
  if (!n) {
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    n = kvf__env_get_int("KVFERRY_VERIFY_HASH_THREADS", cores >= 4 ? cores / 2 : 1);
    if (n < 1) n = 1;
    if (n > PF_HASH_HELPERS + 1) n = PF_HASH_HELPERS + 1;
    atomic_store(&want, n);
  }
  if (bytes < PF_HASH_PAR_MIN_BYTES) return 1;
  return (size_t)n < nblocks ? (size_t)n : nblocks;
}

/* Verify mode: digest every (page, buffer) the chunk sends on the sending
 * thread (and its helpers for a large chunk) before kvf_sender_send
 * returns, so while the caller still guarantees the pages hold the
 * request's KV; but after the chunk was queued, so its first parts are on
 * the wire meanwhile and the worker waits only for the pages of the part it
 * finishes (kvf__pf_wait_hashed: the prefix of pages hashed). Then the
 * chunk's hold ends (freed here when someone released it meanwhile). */
static void hash_pages(prefill_state *ps, pf_chunk *c) {
  uint64_t page_bytes = 0;
  for (size_t j = 0; j < c->ndig; j++) page_bytes += ps->m->bufs.kv_item_lens[c->dig_bufs[j]];
  size_t block = page_bytes && page_bytes < PF_HASH_BLOCK_BYTES ? PF_HASH_BLOCK_BYTES / page_bytes : 1;
  if (block < PF_HASH_STEP) block = PF_HASH_STEP;
  size_t nblocks = (c->npages + block - 1) / block;
  size_t nthreads = hash_threads(page_bytes * c->npages, nblocks);
  atomic_uchar few[64];
  hash_job h = {.ps = ps, .c = c, .block = nthreads > 1 ? block : PF_HASH_STEP};
  h.nblocks = (c->npages + h.block - 1) / h.block;
  h.done = h.nblocks <= 64 ? few : malloc(h.nblocks * sizeof *h.done);
  if (!h.done) { /* no memory for the flags: one thread, in steps */
    h.done = few, h.block = c->npages, h.nblocks = 1, nthreads = 1;
  }
  for (size_t i = 0; i < h.nblocks; i++) atomic_init(&h.done[i], 0);
  atomic_init(&h.next, 0);
  pthread_t helpers[PF_HASH_HELPERS];
  size_t started = 0;
  for (; started + 1 < nthreads; started++)
    if (pthread_create(&helpers[started], NULL, hash_claim, &h)) break; /* fewer helpers: still correct */
  hash_claim(&h);
  for (size_t i = 0; i < started; i++) pthread_join(helpers[i], NULL);
  if (h.done != few) free(h.done);
  if (atomic_exchange(&c->hold, PF_HOLD_NONE) == PF_HOLD_FREED) kvf__pf_chunk_free(ps, c);
}

/* ps->lock held: a chunk of the room could not be taken (no memory, too
 * many waiting for the M2, a full queue). The room fails: a later chunk
 * would take its place in the index slice, and the room could end Success
 * without its pages. The destinations to tell once the lock is let go
 * (kvf__pf_send_failed_all with *why), or NULL. */
static pf_dest *chunk_refused_locked(kvf_sender *s, int rc, char *why, size_t cap, size_t *n) {
  *n = 0;
  snprintf(why, cap, "prefill rank %d could not take a chunk of the request (%s)", s->m->cfg.engine_rank,
           kvf_strerror(rc));
  return s->r->dead ? NULL : kvf__pf_fail_room_locked(s->m->prefill, s->r, why, NULL, n);
}

/* The same, ps->lock not held; returns rc. */
static int chunk_refused(kvf_sender *s, int rc) {
  prefill_state *ps = s->m->prefill;
  char why[ROOMS_REASON_MAX];
  size_t n = 0;
  pthread_mutex_lock(&ps->lock);
  pf_dest *d = chunk_refused_locked(s, rc, why, sizeof why, &n);
  pthread_mutex_unlock(&ps->lock);
  if (d) kvf__pf_send_failed_all(s->m, s->room, d, n, why);
  return rc;
}

/* Both send calls: copy and queue (or park) one chunk, given as a view of
 * the caller's arrays (in->r is the sender's room; pages, candidates and
 * state slots are copied, not kept). in->pos is the index_slice start;
 * in->explicit_idx says it is a destination index. */
static int sender_submit(kvf_sender *s, const pf_chunk *in) {
  prefill_state *ps = s->m->prefill;
  int is_last = in->is_last;
  size_t npages = in->npages, nstate = in->nstate, ncand = in->ncand;
  trace_live *tl = &s->r->tr;
  if (kvf__trace_on(tl)) {
    int64_t now = clock_now_ns();
    kvf__trace_at(tl, KVF_TRACE_FIRST_CHUNK_SUBMITTED, now);
    if (is_last) kvf__trace_at(tl, KVF_TRACE_LAST_CHUNK_SUBMITTED, now);
    kvf__trace_add(tl, TRACE_CHUNKS, 1);
  }
  if (is_last) { /* a room's only chunk, small enough: straight to the engine */
    pthread_mutex_lock(&ps->lock);
    pf_direct *dj = kvf__pf_direct_take_locked(ps, s->r, in, 0);
    if (dj) s->r->nchunks++;
    pthread_mutex_unlock(&ps->lock);
    if (dj) {
      kvf__pf_direct_run(ps, dj, in);
      if (s->curr < in->pos + (int64_t)npages) s->curr = in->pos + (int64_t)npages;
      s->last_sent = 1;
      return 0;
    }
  }
  pf_chunk *c = kvf__pf_chunk_new(ps);
  if (!c) return chunk_refused(s, KVF_ENOMEM);
  c->pages = npages <= PF_CHUNK_INLINE_PAGES ? c->pages_inline : malloc(npages * sizeof *c->pages);
  c->cands = is_last && ncand ? c->cands_inline : NULL; /* ncand <= KVF_MAX_CANDIDATES (checked) */
  c->state_slots = !nstate                           ? NULL
                   : nstate <= PF_CHUNK_INLINE_STATE ? c->state_inline
                                                     : malloc(nstate * sizeof *c->state_slots);
  if (!c->pages || (nstate && !c->state_slots)) {
    kvf__pf_chunk_free(ps, c);
    return chunk_refused(s, KVF_ENOMEM);
  }
  if (npages) memcpy(c->pages, in->pages, npages * sizeof *in->pages);
  c->npages = npages;
  c->pos = in->pos;
  c->explicit_idx = in->explicit_idx;
  c->layer_begin = in->layer_begin;
  c->layer_end = in->layer_end;
  c->is_last = is_last != 0;
  /* non-last chunks carry no aux index, token or candidates (§6.2) */
  c->aux_index = is_last ? in->aux_index : -1;
  c->token = is_last ? in->token : -1;
  if (c->cands) memcpy(c->cands, in->cands, ncand * sizeof *in->cands), c->ncand = ncand;
  if (c->state_slots)
    memcpy(c->state_slots, in->state_slots, nstate * sizeof *in->state_slots), c->nstate = nstate;
  int rc = s->m->cfg.verify ? hash_prepare(s->m, c) : 0, hashing = 0;
  if (rc) {
    kvf__pf_chunk_free(ps, c);
    return chunk_refused(s, rc);
  }
  pf_dest *refused = NULL; /* the chunk was refused: the room failed, these are told */
  size_t nrefused = 0;
  char why[ROOMS_REASON_MAX];

  int st = ROOM_FAILED;
  pf_room *r = s->r;
  pthread_mutex_lock(&ps->lock);
  if (kvf__rooms_get_status(s->m->rooms, s->room, &st) || st == ROOM_FAILED) {
    kvf__pf_chunk_free(ps, c); /* the reference drops chunks of a failed room silently */
    goto out;
  }
  if (!r->bootstrapped && r->npending >= PF_MAX_PENDING) {
    kvf__pf_chunk_free(ps, c);
    rc = KVF_ETOOBIG;
    refused = chunk_refused_locked(s, rc, why, sizeof why, &nrefused);
    goto out;
  }
  c->r = r;
  r->refs++;
  r->nchunks++;
  /* From the push on, another thread may release the chunk: hash_pages
   * holds it until its digests are taken. */
  if (c->digests) atomic_store(&c->hold, PF_HOLD_HASHING), hashing = 1;
  if (r->bootstrapped) {
    if (kvf__pf_queue_push(&ps->queues[r->shard], c)) {
      atomic_store(&c->hold, PF_HOLD_NONE), hashing = 0;
      kvf__pf_chunk_release_locked(ps, c);
      rc = KVF_ETOOBIG;
      refused = chunk_refused_locked(s, rc, why, sizeof why, &nrefused);
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
  if (refused) kvf__pf_send_failed_all(s->m, s->room, refused, nrefused, why);
  if (hashing) hash_pages(ps, c);
  if (!rc) {
    if (s->curr < in->pos + (int64_t)npages) s->curr = in->pos + (int64_t)npages;
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
  if (!s || !in || kvf__config_copy(&p, sizeof p, in, KVF_SEND_PARAMS_SIZE_V1)) return KVF_EINVAL;
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
  if (p.flags & KVF_SEND_TOKEN_LATER) p.bootstrap_token = PF_TOKEN_LATER, p.ncand = 0;
  /* The chunk as a view of the caller's arrays; sender_submit copies it. */
  pf_chunk view = {.r = s->r,
                   .pages = (int64_t *)p.pages,
                   .npages = p.npages,
                   .is_last = is_last,
                   .aux_index = p.aux_index,
                   .token = p.bootstrap_token,
                   .cands = (int32_t *)p.cands,
                   .ncand = p.ncand,
                   .state_slots = (int64_t *)p.state_slots,
                   .nstate = p.nstate};
  if (!layers) { /* every layer, from where the last chunk ended; state slots with the last chunk */
    view.pos = s->curr, view.layer_end = s->m->bufs.n_layers;
    if (!is_last) view.nstate = 0;
    return sender_submit(s, &view);
  }
  /* §6.2: send_layerwise skips an empty non-last chunk (no pages or no
   * layers: nothing to write, and it completes nothing), unless it carries
   * the state of its layer group. */
  if (!is_last && (!p.npages || p.layer_begin == p.layer_end) && !p.nstate) {
    if (s->curr < (int64_t)(p.index_begin + p.npages)) s->curr = (int64_t)(p.index_begin + p.npages);
    return 0;
  }
  view.pos = (int64_t)p.index_begin, view.explicit_idx = 1;
  view.layer_begin = p.layer_begin, view.layer_end = p.layer_end;
  return sender_submit(s, &view);
}

int kvf_sender_set_metadata(kvf_sender *s, int64_t bootstrap_token, const int32_t *cands, size_t ncand) {
  if (!s || (ncand && !cands) || bootstrap_token < -1) return KVF_EINVAL;
  if (ncand > KVF_MAX_CANDIDATES) return KVF_ETOOBIG;
  prefill_state *ps = s->m->prefill;
  pf_room *r = s->r;
  int st = ROOM_FAILED, rc = 0;
  pf_dest *d = NULL;
  size_t nd = 0;
  pthread_mutex_lock(&ps->lock);
  if (r->dead || kvf__rooms_get_status(s->m->rooms, s->room, &st)) {
    rc = KVF_ENOTFOUND;
  } else if (!(rc = kvf__rooms_publish_metadata(s->m->rooms, s->room, bootstrap_token, cands, ncand))) {
    if (r->park) { /* the KV landed: Success now (§6.11 step 6) */
      d = r->park, nd = r->npark;
      r->park = NULL, r->npark = 0;
      atomic_store(&r->parked, 0);
      if (st != ROOM_FAILED) {
        kvf__rooms_update(s->m->rooms, s->room, ROOM_SUCCESS, NULL);
        kvf__rooms_get_status(s->m->rooms, s->room, &st);
      }
    }
  }
  pthread_mutex_unlock(&ps->lock);
  pf_m3_msg msg = {.room = s->room,
                   .status = st == ROOM_SUCCESS ? ROOM_SUCCESS : ROOM_FAILED,
                   .token = bootstrap_token,
                   .cands = cands,
                   .ncand = ncand};
  for (size_t k = 0; k < nd; k++) kvf__pf_send_m3(s->m, d[k].host, d[k].port, d[k].epoch, &msg);
  if (nd && st == ROOM_SUCCESS) kvf__trace_now(&r->tr, KVF_TRACE_COMPLETION_SENT);
  free(d);
  return rc;
}

static kvf_poll_status poll_room(kvf_sender *s);

kvf_poll_status kvf_sender_poll(kvf_sender *s) {
  kvf_poll_status st = poll_room(s);
  if (s && !s->r->final_seen && (st == KVF_POLL_SUCCESS || st == KVF_POLL_FAILED)) {
    s->r->final_seen = 1;
    kvf__trace_now(&s->r->tr, KVF_TRACE_FINAL);
  }
  return st;
}

static kvf_poll_status poll_room(kvf_sender *s) {
  if (!s) return KVF_POLL_FAILED;
  prefill_state *ps = s->m->prefill;
  pf_dest *d = NULL;
  size_t nd = 0;
  /* Answered from the room's status cell alone, without a lock (ps->lock
   * is taken by the listener and the completion threads for every room, and
   * a scheduler polls every room it has in flight, often), unless there is
   * something to check: Success is final; a room not Failed and not parked
   * has no deadline to apply but the bootstrap timeout's. */
  int st = atomic_load_explicit(s->status, memory_order_acquire);
  if (st == ROOM_SUCCESS) return KVF_POLL_SUCCESS;
  if (st != ROOM_FAILED && !atomic_load_explicit(&s->r->parked, memory_order_acquire) &&
      (st != ROOM_BOOTSTRAPPING ||
       clock_now_ns() - s->r->create_ns < (int64_t)(s->m->cfg.bootstrap_timeout_s * 1e9)))
    return (kvf_poll_status)st;
  pthread_mutex_lock(&ps->lock);
  if (kvf__rooms_get_status(s->m->rooms, s->room, &st)) st = ROOM_FAILED;
  double limit = s->m->cfg.bootstrap_timeout_s;
  if (st == ROOM_BOOTSTRAPPING && clock_now_ns() - s->r->create_ns >= (int64_t)(limit * 1e9)) {
    char why[ROOMS_REASON_MAX];
    snprintf(why, sizeof why, "Request %" PRId64 " timed out after %.1fs in TransferPoll.Bootstrapping", s->room,
             limit);
    kvf__rooms_fail(s->m->rooms, s->room, why);
    st = ROOM_FAILED;
    d = kvf__pf_collect_dests(s->r, NULL, &nd);
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
      atomic_store(&s->r->parked, 0);
    }
  }
  /* Failed is reported once no transfer of the room may still read its
   * sources (a failed destination's siblings, chunks in the worker's
   * window): until then the caller must not reuse the pages. */
  if (st == ROOM_FAILED && s->r->busy > 0) st = ROOM_TRANSFERRING;
  pthread_mutex_unlock(&ps->lock);
  if (d) kvf__pf_send_failed_all(s->m, s->room, d, nd, NULL);
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
  pf_dest *d = kvf__pf_collect_dests(s->r, NULL, &nd);
  free(s->r->park); /* the parked destinations are told here */
  s->r->park = NULL, s->r->npark = 0;
  atomic_store(&s->r->parked, 0);
  pthread_mutex_unlock(&ps->lock);
  if (d) kvf__pf_send_failed_all(s->m, s->room, d, nd, NULL);
}

void kvf_sender_destroy(kvf_sender *s) {
  if (!s) return;
  prefill_state *ps = s->m->prefill;
  pf_room *r = s->r;
  pf_dest *d = NULL;
  size_t nd = 0;
  int st = ROOM_FAILED;
  pthread_mutex_lock(&ps->lock);
  /* Its last chunk never sent, or still pending (dropped below), or its
   * KV landed and the token never published: its decodes cannot get
   * Success any more and would wait for their own timeout, so they hear
   * Failed now, as from an abort (those whose M2 is here). A last
   * chunk already sent still ends the room on its worker or its direct
   * write: Success (the trailer, the M3s) when it lands with its token
   * known, else Failed (kvf__pf_dead_room_failed_locked). */
  int known = !kvf__rooms_get_status(s->m->rooms, s->room, &st);
  int told = known && st != ROOM_SUCCESS && st != ROOM_FAILED && (!s->last_sent || r->park || r->pend_head);
  if (told) d = kvf__pf_collect_dests(r, NULL, &nd);
  /* A decode whose M2 comes only now hears Failed too (listener.c). */
  if (told || (known && st == ROOM_FAILED)) kvf__pf_ended_add_locked(ps, s->room, clock_now_ns());
  if (kvf__trace_on(&r->tr)) { /* the record is finished with the room's last reference */
    r->tr_status = ROOM_FAILED;
    kvf__rooms_get_status(s->m->rooms, s->room, &r->tr_status);
    kvf__rooms_get_reason(s->m->rooms, s->room, r->tr_reason, sizeof r->tr_reason);
  }
  kvf__rooms_clear(s->m->rooms, s->room, NULL); /* the table held r: nothing else names it by id now */
  r->dead = 1;
  /* A room that failed before had its decodes told then (whoever failed it
   * sent the M3s): its last chunk, still queued and dropped now, must not
   * tell them again (a duplicate Failed that could meet the next use of the
   * room id at a decode that cannot tell uses apart). */
  r->dead_told = told || (known && st == ROOM_FAILED);
  pf_chunk *c = r->pend_head;
  r->pend_head = r->pend_tail = NULL;
  r->npending = 0;
  while (c) {
    pf_chunk *n = c->next;
    kvf__pf_chunk_release_locked(ps, c);
    c = n;
  }
  kvf__pf_room_unref(ps, r); /* the table's reference; queued chunks keep theirs */
  int64_t room = s->room;
  kvf_manager *m = s->m;
  sender_drop_locked(ps, s);
  pthread_mutex_unlock(&ps->lock);
  if (d) kvf__pf_send_failed_all(m, room, d, nd, PF_DESTROYED_REASON);
}

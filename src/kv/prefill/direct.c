/* Direct transfers: a room sent in one small chunk skips the worker queue;
 * the engine's completion callbacks finish the room. */
#include "kv/prefill/prefill_int.h"

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
    kvf__trace_add(&r->tr, TRACE_BYTES, dj->bytes);
  }
  int fin = ROOM_FAILED;
  pthread_mutex_lock(&ps->lock);
  if (ok && !r->dead && (upto || (nreal == 0 && dj->n > 0))) { /* or only dummies (§6.11 step 1) */
    kvf__rooms_update(m->rooms, r->room, ROOM_SUCCESS, NULL);
    kvf__rooms_get_status(m->rooms, r->room, &fin);
    success = upto > 0;
  } else if (ok && r->dead && upto && !r->dead_told) {
    /* Destroyed while its write was in flight: it landed, so its decodes
     * get the M3s they would have had (a direct chunk carries its token). */
    r->dead_told = 1;
    fin = ROOM_SUCCESS, success = 1;
  }
  pthread_mutex_unlock(&ps->lock);
  pf_m3_msg msg = {.room = r->room,
                   .status = fin == ROOM_SUCCESS ? ROOM_SUCCESS : ROOM_FAILED,
                   .token = dj->token,
                   .cands = dj->cands,
                   .ncand = dj->ncand};
  for (size_t i = 0; success && i < upto; i++) {
    const wire_m2 *y = dj->d[i].info->m2;
    if (y->is_dummy) continue;
    kvf__pf_m3_to(ps, y, atomic_load(&dj->d[i].carried), &msg);
  }
  /* With the completion trailer the decode had it with the bytes; the M3
   * (maybe deferred) only repeats it. Either way it has left this side. */
  if (success) kvf__trace_now(&r->tr, KVF_TRACE_COMPLETION_SENT);
  pthread_mutex_lock(&ps->lock);
  kvf__pf_room_busy_done_locked(ps, r);
  for (size_t i = 0; i < dj->n; i++) kvf__pf_info_unref(ps, dj->d[i].info);
  kvf__pf_room_unref(ps, r);
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
  if (!status && kvf__trace_on(&dj->r->tr))
    kvf__trace_at_last(&dj->r->tr, KVF_TRACE_LAST_BYTE_DONE, clock_now_ns());
  if (status) {
    char why[ROOMS_REASON_MAX];
    int res = kvf__pf_xfer_failed(dj->r, d->info->m2, status, why, sizeof why);
    atomic_store(&dj->failed, 1);
    kvf__pf_fail_dest(dj->ps, dj->r, d->info, why, res == DEST_XFER_FAIL);
  }
  direct_release(dj);
}

/* ps->lock held: a direct record for the chunk, or NULL (worker path). On
 * success the room and its infos are referenced and ps->direct_lock is held. */
pf_direct *kvf__pf_direct_take_locked(prefill_state *ps, pf_room *r, const pf_chunk *c, size_t prior) {
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
  r->busy++; /* until direct_finish: every destination's write ended */
  dj->n = r->ninfos;
  r->written = 1; /* a destination that comes from here on misses this chunk */
  for (size_t i = 0; i < dj->n; i++) {
    dj->d[i].owner = dj, dj->d[i].info = r->infos[i];
    atomic_store(&dj->d[i].carried, 0);
    r->infos[i]->refs++;
  }
  return dj;
}

/* Plan and submit a direct chunk (ps->direct_lock held; released here). */
void kvf__pf_direct_run(prefill_state *ps, pf_direct *dj, const pf_chunk *c) {
  pf_scratch *sc = &ps->direct_sc;
  char why[ROOMS_REASON_MAX];
  dj->ps = ps;
  dj->token = c->token;
  dj->ncand = c->ncand;
  if (c->ncand) memcpy(dj->cands, c->cands, c->ncand * sizeof *c->cands);
  dj->bytes = 0;
  atomic_store(&dj->failed, 0);
  atomic_store(&dj->left, 1); /* this thread's guard: no finish while submitting */
  for (size_t i = 0; i < dj->n; i++) {
    const wire_m2 *x = dj->d[i].info->m2;
    if (x->is_dummy) continue;
    pf_send snd = {.c = c,
                   .info = dj->d[i].info,
                   .on_done = direct_done,
                   .arg = &dj->d[i],
                   .carried = &dj->d[i].carried};
    atomic_fetch_add(&dj->left, 1); /* before the submit: its callback may run at once */
    int res = kvf__pf_send_dest(ps, sc, &snd, why, sizeof why);
    if (res != DEST_OK) { /* the callback will not run */
      atomic_fetch_sub(&dj->left, 1);
      atomic_store(&dj->failed, 1);
      kvf__pf_fail_dest(ps, dj->r, dj->d[i].info, why, res == DEST_XFER_FAIL);
      break; /* §6.11 step 5: stop processing this chunk */
    }
    dj->bytes += snd.bytes;
  }
  pthread_mutex_unlock(&ps->direct_lock);
  direct_release(dj);
}

/* The transfer workers: a queue's thread drains its FIFO of chunks (a
 * room's chunks all go to one queue and run in order), writes a chunk to
 * every destination of its room at once (fan-out: submitted together,
 * waited for once), and on the last chunk makes the room Success (or parks
 * it for a later first token) and sends the M3s (§6.11).
 *
 * The window: a chunk that is not its room's last (a layer of a layerwise
 * send, a part of a chunked prefill) stays in flight while the worker
 * submits the next ones, up to PF_WORKER_WINDOW, so the connections never
 * idle between two chunks waiting for the previous one's acknowledgements.
 * Before a last chunk (whose completion must follow every earlier byte of
 * its room) the worker waits for its whole window, or, for a fan-out
 * (last_passes_window), submits the chunk first and waits for the window
 * right after, before any of the chunk's outcomes; it also waits for the
 * window when its FIFO is empty. A room failed by a chunk in the window is
 * reported once; the chunks behind it are waited for or skipped.
 *
 * Threads per queue: one, and more while it waits. A thread that has waited
 * on the network for PF_SLOW_WAIT_MS (a chunk's confirmations) while chunks
 * of rooms no thread holds are queued, with every other thread of the queue
 * waiting too, starts another (up to PF_QUEUE_THREADS), so a decode that
 * stopped answering holds its own rooms and not those behind them. A room is
 * held by the thread that processes one of its chunks or keeps one in its
 * window (pf_room.owner, under the queue's lock): only that thread takes the
 * room's next chunk, which keeps a room's chunks in order and its earlier
 * chunks in the window of the thread that sends its last. The bound: with
 * PF_QUEUE_THREADS rooms of one queue waiting on stopped decodes, the rooms
 * behind them wait until the engine's timeout fails those; only completions
 * that hold no thread (as the direct path's, direct.c) would lift it. */
#include "kv/prefill/prefill_int.h"
#include "base/thread.h"

/* Fail the room (if it is still this room) and tell its destinations: the
 * one whose transfer failed, and (when this failed the room) the others. */
void kvf__pf_fail_dest(prefill_state *ps, pf_room *r, const pf_info *info, const char *why, int mark) {
  kvf_manager *m = ps->m;
  const wire_m2 *x = info->m2;
  pf_dest *d = NULL;
  size_t nd = 0;
  pthread_mutex_lock(&ps->lock);
  if (mark && m->cfg.failed_session_ttl_s > 0) {
    pf_reg *reg = kvf__smap_get(&ps->regs, x->session);
    /* Not a registration that came after the M2 (a decode restarted under
     * the same session id): its new process has not failed. */
    if (reg && reg->gen == info->reg_gen) {
      int64_t now = clock_now_ns();
      /* The first cause of a streak: not marked, or its TTL ran out since */
      if (!reg->failed_ns || now - reg->failed_ns >= (int64_t)(m->cfg.failed_session_ttl_s * 1e9))
        kvf__str_copy(reg->failed_why, sizeof reg->failed_why, why);
      reg->failed_ns = now;
    }
  }
  int live = !r->dead;
  if (live) {
    d = kvf__pf_fail_room_locked(ps, r, why, x->session, &nd);
  } else { /* destroyed with its last chunk in flight: every decode hears it, once */
    d = kvf__pf_dead_room_failed_locked(r, &nd);
  }
  pthread_mutex_unlock(&ps->lock);
  if (!live) {
    if (d) kvf__pf_send_failed_all(m, r->room, d, nd, why);
    return;
  }
  LOG_WARN("kv", "room %" PRId64 ": %s", r->room, why);
  kvf__pf_send_m3_failed(m, x->endpoint, x->dst_port, x->fence_epoch, r->room, NULL);
  if (d) kvf__pf_tell_others_failed(m, r->room, d, nd, why);
}

/* Verify mode, recheck_late: the decodes have checked (or are checking)
 * their landed bytes against the send-time digests, and got our M3
 * Success; the sender ends Success only if no source page changed
 * meanwhile. A page that did was reused before its transfer completed: a
 * bug of the caller's page allocator, reported here, on the side that has
 * it. The decode's bytes are right either way (what the engine read is what
 * the decode checked), so its Success stands. */
static void recheck_after_m3(prefill_state *ps, pf_room *r, const pf_chunk *c) {
  char why[ROOMS_REASON_MAX];
  int bad = kvf__pf_recheck_chunk(ps, c, why, sizeof why);
  pthread_mutex_lock(&ps->lock);
  int live = !r->dead;
  if (live && bad) kvf__rooms_fail(ps->m->rooms, r->room, why);
  if (live && !bad) kvf__rooms_update(ps->m->rooms, r->room, ROOM_SUCCESS, NULL);
  pthread_mutex_unlock(&ps->lock);
  if (live && bad)
    LOG_WARN("kv",
             "room %" PRId64 ": %s; the decode checked the bytes it received against the digests taken at send",
             r->room, why);
}

/* A destination's write of the room confirmed: the room's last byte done
 * so far, and its bytes (trace). */
static void trace_done(pf_room *r, uint64_t bytes) {
  if (!bytes || !kvf__trace_on(&r->tr)) return;
  kvf__trace_at_last(&r->tr, KVF_TRACE_LAST_BYTE_DONE, clock_now_ns());
  kvf__trace_add(&r->tr, TRACE_BYTES, bytes);
}

static void room_unhold(pf_queue *q, pf_room *r);
static void group_wait(pf_scratch *sc, kvf__batch_group *g);

/* Wait for the oldest chunk in the worker's window: the first failed write
 * fails the room and tells its destination (§6.11 step 5); then the chunk
 * is counted (when every write landed) and released. */
static void flight_finish_oldest(prefill_state *ps, pf_worker *w) {
  pf_flight *f = &w->fl[w->fl_head];
  w->fl_head = (w->fl_head + 1) % PF_WORKER_WINDOW;
  w->fl_n--;
  pf_chunk *c = f->c;
  uint64_t bytes = 0;
  char why[ROOMS_REASON_MAX];
  /* A room failed meanwhile (by an earlier chunk of the window, say) was
   * reported once: its writes are only waited for. */
  int st = ROOM_FAILED;
  pthread_mutex_lock(&ps->lock);
  int ok = !c->r->dead && !kvf__rooms_get_status(ps->m->rooms, c->r->room, &st) && st != ROOM_FAILED;
  pthread_mutex_unlock(&ps->lock);
  kvf__pf_wait_begin(&w->sc);
  if (ok && f->dw.group) group_wait(&w->sc, f->dw.group); /* one wake-up for all its destinations */
  for (size_t i = 0; i < f->n; i++) {
    if (!f->dw.batches[i]) continue;
    int err = ok ? kvf_batch_wait(f->dw.batches[i], -1) : 0;
    if (ok && err) {
      int res = kvf__pf_xfer_failed(c->r, f->dw.infos[i]->m2, err, why, sizeof why);
      kvf__pf_fail_dest(ps, c->r, f->dw.infos[i], why, res == DEST_XFER_FAIL);
      ok = 0;
    } else if (ok) {
      bytes += f->dw.dbytes[i];
      trace_done(c->r, f->dw.dbytes[i]);
    }
    kvf_batch_destroy(f->dw.batches[i]); /* waits for writes past a failure */
    f->dw.batches[i] = NULL;
  }
  kvf__pf_wait_end(&w->sc);
  if (ok) {
    atomic_fetch_add(&ps->m->stats.chunks_sent, 1);
    atomic_fetch_add(&ps->m->stats.bytes_sent, bytes);
  }
  room_unhold(w->q, c->r);
  pthread_mutex_lock(&ps->lock);
  kvf__pf_room_busy_done_locked(ps, c->r);
  for (size_t i = 0; i < f->n; i++) kvf__pf_info_unref(ps, f->dw.infos[i]);
  kvf__pf_chunk_release_locked(ps, c);
  pthread_mutex_unlock(&ps->lock);
  f->c = NULL;
}

static void flight_drain(prefill_state *ps, pf_worker *w) {
  while (w->fl_n) flight_finish_oldest(ps, w);
}

/* The group the scratch's writes join, made the first time (NULL without
 * memory: each write is then waited for in turn), and emptied: every batch
 * that was in it has been destroyed. */
static kvf__batch_group *dw_group(pf_dest_writes *dw) {
  if (!dw->group) {
    kvf__batch_group *g = malloc(sizeof *g);
    if (!g || kvf__batch_group_init(g)) {
      free(g);
      return NULL;
    }
    dw->group = g;
  }
  kvf__batch_group_reset(dw->group);
  return dw->group;
}

/* The chunk's writes, all submitted without a failure, go into the window:
 * the next slot takes over the scratch's per-destination arrays. */
static void flight_add(pf_worker *w, pf_chunk *c, size_t n) {
  pf_flight *f = &w->fl[(w->fl_head + w->fl_n) % PF_WORKER_WINDOW];
  w->fl_n++;
  f->c = c, f->n = n;
  pf_dest_writes spare = f->dw;
  f->dw = w->sc.dw, w->sc.dw = spare;
}

/* May last chunk c be submitted while the worker's window still holds
 * earlier chunks, which are then waited for before its own outcomes (and
 * so before any Success or M3)? Only for a fan-out whose destinations take
 * no completion trailer (a trailer is the decode's Success, which must
 * follow every earlier byte, and earlier chunks may travel on other
 * connections), none verifies (verify mode checks part by part after each
 * write), and every one is fenced, so that
 * should an earlier chunk fail the room, the decodes, told of it, refuse
 * the bytes of this one that arrive after (no late write after Failed, as
 * for the window's own chunks). Saves a fan-out room one round trip of all
 * its destinations' acknowledgements. */
static int last_passes_window(prefill_state *ps, const pf_worker *w, const pf_chunk *c) {
  const pf_room *r = c->r;
  size_t nreal = 0;
  int ok = w->fl_n > 0 && !c->digests;
  pthread_mutex_lock(&ps->lock);
  for (size_t i = 0; ok && !r->dead && i < r->ninfos; i++) {
    const wire_m2 *x = r->infos[i]->m2;
    if (x->is_dummy) continue;
    nreal++;
    ok = !pf_verifies(c, x) && !pf_trails(c, r->infos[i]) && x->fence_epoch && manager_room_tag(x->room);
  }
  ok = ok && !r->dead && nreal >= 2;
  pthread_mutex_unlock(&ps->lock);
  return ok;
}

/* Write chunk c; 1 when it went into the worker's window (released when
 * its writes are waited for), 0 when it is done here. */
static int process_chunk(prefill_state *ps, pf_worker *w, pf_chunk *c) {
  pf_scratch *sc = &w->sc;
  kvf_manager *m = ps->m;
  pf_room *r = c->r;
  int st = ROOM_FAILED;
  /* A last chunk's completion follows every earlier byte, and a failure
   * stops it: the window is waited for first, or (a fan-out) right after
   * the chunk is submitted. */
  int pass = c->is_last && last_passes_window(ps, w, c);
  if (c->is_last && !pass) flight_drain(ps, w);
  pthread_mutex_lock(&ps->lock);
  if (r->dead || kvf__rooms_get_status(m->rooms, r->room, &st) || st == ROOM_FAILED) {
    /* A destroyed room's last chunk, dropped: nothing else would tell its
     * decodes (a failed room's were told when it failed). */
    size_t nd = 0;
    pf_dest *d = c->is_last ? kvf__pf_dead_room_failed_locked(r, &nd) : NULL;
    pthread_mutex_unlock(&ps->lock);
    if (d) kvf__pf_send_failed_all(m, r->room, d, nd, PF_DESTROYED_REASON);
    return 0;
  }
  size_t n = r->ninfos;
  if (kvf__pf_scratch_grow((void **)&sc->dw.infos, &sc->dw.cap_infos, n ? n : 1, sizeof *sc->dw.infos) ||
      kvf__pf_scratch_grow((void **)&sc->done, &sc->cap_done, n ? n : 1, sizeof *sc->done) ||
      kvf__pf_scratch_grow((void **)&sc->dw.batches, &sc->dw.cap_batches, n ? n : 1, sizeof *sc->dw.batches) ||
      kvf__pf_scratch_grow((void **)&sc->dw.dbytes, &sc->dw.cap_dbytes, n ? n : 1, sizeof *sc->dw.dbytes) ||
      kvf__pf_scratch_grow((void **)&sc->res, &sc->cap_res, n ? n : 1, sizeof *sc->res) ||
      kvf__pf_scratch_grow((void **)&sc->carried, &sc->cap_carried, n ? n : 1, sizeof *sc->carried)) {
    const char *oom = "Out of memory in the transfer worker";
    size_t nd = 0;
    pf_dest *d = kvf__pf_fail_room_locked(ps, r, oom, NULL, &nd);
    pthread_mutex_unlock(&ps->lock);
    if (d) kvf__pf_send_failed_all(m, r->room, d, nd, oom);
    return 0;
  }
  pf_info **infos = sc->dw.infos;
  size_t *done = sc->done;
  for (size_t i = 0; i < n; i++) (infos[i] = r->infos[i])->refs++;
  r->written = 1; /* a destination that comes from here on misses this chunk */
  r->busy++;      /* until its batches are destroyed (here or in flight_finish_oldest) */
  pthread_mutex_unlock(&ps->lock);

  uint64_t bytes = 0;
  size_t ndone = 0, nreal = 0, nreal_all = 0;
  int ok = 1, counted = 0;
  char why[ROOMS_REASON_MAX];
  for (size_t i = 0; i < n; i++) nreal_all += !infos[i]->m2->is_dummy;
  /* Verify mode, last chunk, first token known (never parked): when every
   * destination checks its landed bytes against the send-time digests, the
   * decode's Success does not wait for the recheck of our sources, which
   * runs after the M3s and only decides this side's status (recheck_late). */
  c->recheck_late = c->is_last && c->digests && c->token != PF_TOKEN_LATER && nreal_all > 0;
  for (size_t i = 0; i < n && c->recheck_late; i++) {
    const wire_m2 *x = infos[i]->m2;
    if (!x->is_dummy && (!(x->room_flags & WIRE_ROOM_VERIFY) || x->nfrags)) c->recheck_late = 0;
  }
  /* Fan-out (issue 12): every destination's write is planned and submitted
   * first and waited for afterwards, so a chunk that several decode ranks
   * need costs its slowest destination, not the sum. The outcomes are then
   * taken in destination order, as when the writes ran one after another:
   * the first failure fails the room and stops the chunk (§6.11 step 5);
   * writes already submitted past it are only waited for. */
  /* A chunk that is not the room's last, outside verify mode, may stay in
   * flight (the window, above). */
  int flies = !c->is_last && n > 0;
  for (size_t i = 0; i < n && flies; i++) flies = !pf_verifies(c, infos[i]->m2);
  size_t nsub = n; /* destinations [0, nsub) have an outcome */
  int refused = 0; /* a submission failed */
  for (size_t i = 0; i < n; i++) {
    sc->dw.batches[i] = NULL, sc->dw.dbytes[i] = 0, sc->res[i] = DEST_OK;
    atomic_store_explicit(&sc->carried[i], 0, memory_order_relaxed);
  }
  kvf__batch_group *g = dw_group(&sc->dw);
  for (size_t i = 0; i < n; i++) {
    const wire_m2 *x = infos[i]->m2;
    if (x->is_dummy) continue;
    /* In verify mode the write is also confirmed and checked here (its
     * batch comes back NULL). */
    pf_send snd = {.c = c, .info = infos[i], .carried = &sc->carried[i], .group = g};
    sc->res[i] = kvf__pf_send_dest(ps, sc, &snd, why, sizeof why);
    sc->dw.batches[i] = snd.batch, sc->dw.dbytes[i] = snd.bytes;
    if (sc->res[i] != DEST_OK) { /* `why` keeps its reason */
      nsub = i + 1, refused = 1;
      break;
    }
  }
  if (flies && !refused) {
    flight_add(w, c, n);
    return 1;
  }
  if (pass) { /* the earlier chunks: one that failed has failed the room and told its destinations */
    flight_drain(ps, w);
    size_t nd = 0;
    pf_dest *d = NULL;
    pthread_mutex_lock(&ps->lock);
    if (r->dead || kvf__rooms_get_status(m->rooms, r->room, &st) || st == ROOM_FAILED) ok = 0;
    if (r->dead) d = kvf__pf_dead_room_failed_locked(r, &nd); /* its earlier chunks' outcomes are unknown */
    pthread_mutex_unlock(&ps->lock);
    if (d) kvf__pf_send_failed_all(m, r->room, d, nd, PF_DESTROYED_REASON);
  }
  /* Completions are reaped together: one wake-up when the last write ends
   * (or one fails), then the outcomes in destination order. */
  kvf__pf_wait_begin(sc);
  if (ok && g) group_wait(sc, g);
  for (size_t i = 0; i < nsub && ok; i++) {
    const wire_m2 *x = infos[i]->m2;
    if (x->is_dummy) continue;
    nreal++;
    int rc = sc->res[i];
    if (rc == DEST_OK && sc->dw.batches[i]) {
      int err = kvf_batch_wait(sc->dw.batches[i], -1); /* sleeps only past a failure (the group woke early) */
      if (err) rc = kvf__pf_xfer_failed(r, x, err, why, sizeof why);
    }
    if (rc != DEST_OK) {
      kvf__pf_fail_dest(ps, r, infos[i], why, rc == DEST_XFER_FAIL);
      ok = 0; /* §6.11 step 5: stop processing this chunk */
      break;
    }
    bytes += sc->dw.dbytes[i];
    trace_done(r, sc->dw.dbytes[i]);
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
    int32_t meta[KVF_MAX_CANDIDATES];
    if (!r->dead && c->token == PF_TOKEN_LATER) {
      if (!kvf__rooms_get_metadata(m->rooms, r->room, &tok, meta, KVF_MAX_CANDIDATES, &ncd)) {
        cd = meta; /* published before the chunk landed */
      } else {
        tok = -1, cd = NULL, ncd = 0; /* the chunk's values, should the room be Failed */
        kvf__rooms_get_status(m->rooms, r->room, &fin);
        if (fin != ROOM_FAILED) {
          pf_dest *d = calloc(ndone, sizeof *d);
          if (d) {
            for (size_t k = 0; k < ndone; k++) kvf__pf_dest_of(infos[done[k]]->m2, &d[k]);
            free(r->park); /* a later, larger completed list replaces it */
            r->park = d, r->npark = ndone, r->landed_ns = clock_now_ns();
            atomic_store(&r->parked, 1);
            parked = 1;
          } else {
            kvf__rooms_fail(m->rooms, r->room, "Out of memory in the transfer worker");
          }
        }
      }
    }
    int late = c->recheck_late && !parked;
    if (!r->dead && !parked) {
      if (!late) kvf__rooms_update(m->rooms, r->room, ROOM_SUCCESS, NULL);
      kvf__rooms_get_status(m->rooms, r->room, &fin);
      if (late && fin != ROOM_FAILED) fin = ROOM_SUCCESS;
    }
    /* Destroyed while its last chunk was in flight: it landed, so its
     * decodes get the M3s it would have had (the trailer already told a
     * kvferry decode), Success with the token; without a token (published
     * later, never now) they hear Failed. */
    pf_dest *dead_d = NULL;
    size_t dead_n = 0;
    if (r->dead) {
      late = 0;
      if (c->token != PF_TOKEN_LATER && !r->dead_told) fin = ROOM_SUCCESS, r->dead_told = 1;
      else dead_d = kvf__pf_dead_room_failed_locked(r, &dead_n), fin = ROOM_FAILED;
    }
    int silent = r->dead && fin != ROOM_SUCCESS;
    pthread_mutex_unlock(&ps->lock);
    if (dead_d) kvf__pf_send_failed_all(m, r->room, dead_d, dead_n, PF_DESTROYED_REASON);
    if (silent || parked) break; /* parked: kvf_sender_set_metadata or the poll sends the M3s */
    pf_m3_msg msg = {.room = r->room,
                     .status = fin == ROOM_SUCCESS ? ROOM_SUCCESS : ROOM_FAILED,
                     .token = tok,
                     .cands = cd,
                     .ncand = ncd};
    for (size_t k = 0; k < ndone; k++)
      kvf__pf_m3_to(ps, infos[done[k]]->m2, atomic_load(&sc->carried[done[k]]), &msg);
    if (msg.status == ROOM_SUCCESS) kvf__trace_now(&r->tr, KVF_TRACE_COMPLETION_SENT);
    if (late && fin == ROOM_SUCCESS) recheck_after_m3(ps, r, c);
  }
  for (size_t i = 0; i < nsub; i++) { /* waits for the writes not taken above */
    kvf_batch_destroy(sc->dw.batches[i]);
    sc->dw.batches[i] = NULL;
  }
  kvf__pf_wait_end(sc);
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
  kvf__pf_room_busy_done_locked(ps, r);
  for (size_t i = 0; i < n; i++) kvf__pf_info_unref(ps, infos[i]);
  pthread_mutex_unlock(&ps->lock);
  return 0;
}

/* q->lock held: the first queued chunk this worker may take (its room held
 * by no thread, or by this one), taken off the FIFO, its room held. */
static pf_chunk *pop_locked(pf_queue *q, pf_worker *w) {
  pf_chunk **pp = &q->head, *prev = NULL;
  for (pf_chunk *c = q->head; c; prev = c, pp = &c->next, c = c->next) {
    if (c->r->owner && c->r->owner != w) continue;
    *pp = c->next;
    if (q->tail == c) q->tail = prev;
    c->next = NULL;
    q->count--;
    c->r->owner = w;
    c->r->held++;
    return c;
  }
  return NULL;
}

/* q->lock held: is a chunk of a room that no thread holds queued? */
static int free_work_locked(const pf_queue *q) {
  for (const pf_chunk *c = q->head; c; c = c->next)
    if (!c->r->owner) return 1;
  return 0;
}

/* q->lock held: if a chunk of a room no thread holds is queued, wake an
 * idle thread of q, or, when every one waits on the network, start another
 * (up to PF_QUEUE_THREADS). */
static void more_hands_locked(pf_queue *q) {
  if (q->stop || !free_work_locked(q)) return;
  if (q->nidle) {
    pthread_cond_signal(&q->cond);
  } else if (atomic_load(&q->nwaiting) == q->nthreads && q->nthreads < PF_QUEUE_THREADS &&
             kvf__pf_worker_start_locked(q, 1) == 0 && kvf__log_first_time(0x70667768u)) {
    LOG_INFO("kv",
             "a transfer queue's threads all wait on slow destinations: an extra thread takes the other "
             "rooms (at most %d per queue)",
             PF_QUEUE_THREADS);
  }
}

void kvf__pf_wait_begin(pf_scratch *sc) {
  if (sc->worker) atomic_fetch_add(&sc->worker->q->nwaiting, 1);
}

/* Between two slices of a wait (PF_SLOW_WAIT_MS): this thread has waited
 * long; if every thread of its queue waits, the rooms behind get another. */
static void wait_slow(pf_scratch *sc) {
  pf_worker *w = sc->worker;
  if (!w) return;
  pthread_mutex_lock(&w->q->lock);
  more_hands_locked(w->q);
  pthread_mutex_unlock(&w->q->lock);
}

int kvf__pf_batch_wait(pf_scratch *sc, kvf_batch *b) {
  for (;;) {
    int st = kvf_batch_wait(b, PF_SLOW_WAIT_MS);
    if (st != KVF_ETIMEDOUT || kvf_batch_poll(b) != KVF_EAGAIN) return st; /* ended (maybe timed out itself) */
    wait_slow(sc);
  }
}

/* kvf__batch_group_wait in slices (wait_slow between them). */
static void group_wait(pf_scratch *sc, kvf__batch_group *g) {
  while (!kvf__batch_group_wait_until(g, clock_now_ns() + (int64_t)PF_SLOW_WAIT_MS * 1000000)) wait_slow(sc);
}

void kvf__pf_wait_end(pf_scratch *sc) {
  if (sc->worker) atomic_fetch_sub(&sc->worker->q->nwaiting, 1);
}

/* A chunk of r is done on its worker (or left its window): the last lets the
 * room go to any thread of the queue. */
static void room_unhold(pf_queue *q, pf_room *r) {
  pthread_mutex_lock(&q->lock);
  if (--r->held == 0) {
    r->owner = NULL;
    if (q->head) { /* its next chunk may wait for a thread */
      pthread_cond_broadcast(&q->cond);
      kvf__pf_queue_poke_locked(q);
    }
  }
  pthread_mutex_unlock(&q->lock);
}

void kvf__pf_queue_poke_locked(pf_queue *q) {
  for (pf_worker *w = q->window_waiters; w; w = w->next_window_waiter) kvf__batch_group_poke(w->window_group);
}

/* q->lock held, nothing to take and a window: wait until the window's
 * oldest chunk ended or something may have come (a poke). 1 when the
 * oldest ended (finish it), 0 when a poke came first (look again). A
 * layerwise send's next layer arrives while its previous layers are in
 * flight: waiting for the oldest alone held the next layer back until the
 * previous one was acknowledged, so the connections idled a round trip per
 * layer (llama-3.1-8b, 4 096 tokens over UCX read mode: 0.2-0.3 ms per
 * layer, 6-9 ms behind a compute as long as the transfer). */
static int window_wait_locked(pf_queue *q, pf_worker *w) {
  kvf__batch_group *g = w->fl[w->fl_head].dw.group;
  if (!g) return 1; /* its batches are waited for one by one */
  w->window_group = g;
  w->next_window_waiter = q->window_waiters;
  q->window_waiters = w;
  pthread_mutex_unlock(&q->lock);
  int res = kvf__batch_group_wait_pokeable(g, INT64_MAX);
  pthread_mutex_lock(&q->lock);
  for (pf_worker **pp = &q->window_waiters; *pp; pp = &(*pp)->next_window_waiter)
    if (*pp == w) {
      *pp = w->next_window_waiter;
      break;
    }
  w->window_group = NULL;
  return res != KVF__GROUP_POKED;
}

/* q->lock held: wait for a chunk to take (NULL: the queue stops, or a
 * helper idle for PF_HELPER_IDLE_MS ends). With nothing to take, the
 * worker's own window is finished, oldest first, while it watches for
 * new chunks. */
static pf_chunk *next_chunk_locked(prefill_state *ps, pf_queue *q, pf_worker *w) {
  for (;;) {
    if (q->stop) return NULL;
    pf_chunk *c = pop_locked(q, w);
    if (c) return c;
    if (w->fl_n) { /* nothing new: wait for the window, or for a chunk */
      if (!window_wait_locked(q, w)) continue;
      pthread_mutex_unlock(&q->lock);
      flight_finish_oldest(ps, w);
      pthread_mutex_lock(&q->lock);
      continue;
    }
    q->nidle++;
    int idle_out = 0;
    if (w->helper) {
      struct timespec ts = clock_ts_from_ns(clock_deadline_ms(PF_HELPER_IDLE_MS));
      idle_out = pthread_cond_timedwait(&q->cond, &q->lock, &ts) == ETIMEDOUT;
    } else {
      pthread_cond_wait(&q->cond, &q->lock);
    }
    q->nidle--;
    if (idle_out) return q->stop ? NULL : pop_locked(q, w); /* nothing for it: the helper ends */
  }
}

static void *worker_main(void *arg) {
  pf_worker *w = arg;
  pf_queue *q = w->q;
  prefill_state *ps = q->ps;
  kvf__thread_name(w->helper ? "kvf-xfer-more" : "kvf-xfer");
  pthread_mutex_lock(&q->lock);
  for (;;) {
    pf_chunk *c = next_chunk_locked(ps, q, w);
    pthread_mutex_unlock(&q->lock);
    if (!c) break;
    kvf__wake_count();
    if (w->fl_n == PF_WORKER_WINDOW) flight_finish_oldest(ps, w);
    if (!process_chunk(ps, w, c)) { /* else it went into the window, its room still held */
      room_unhold(q, c->r);
      pthread_mutex_lock(&ps->lock);
      kvf__pf_chunk_release_locked(ps, c);
      pthread_mutex_unlock(&ps->lock);
    }
    pthread_mutex_lock(&q->lock);
  }
  flight_drain(ps, w); /* stopping: what it has in flight ends first */
  kvf__pf_scratch_free(&w->sc);
  for (int k = 0; k < PF_WORKER_WINDOW; k++) kvf__pf_dest_writes_free(&w->fl[k].dw);
  pthread_mutex_lock(&q->lock);
  q->nthreads--;
  pthread_cond_broadcast(&q->cond); /* kvf__prefill_stop waits for the last */
  pthread_mutex_unlock(&q->lock);
  free(w);
  return NULL;
}

int kvf__pf_worker_start_locked(pf_queue *q, int helper) {
  pf_worker *w = calloc(1, sizeof *w);
  if (!w) return KVF_ENOMEM;
  w->q = q;
  w->helper = helper;
  if (kvf__pf_scratch_init(&w->sc, &q->ps->m->bufs)) {
    free(w);
    return KVF_ENOMEM;
  }
  w->sc.worker = w;
  if (kvf__thread_start_detached(worker_main, w)) {
    kvf__pf_scratch_free(&w->sc);
    free(w);
    return KVF_ENOMEM;
  }
  q->nthreads++;
  return 0;
}

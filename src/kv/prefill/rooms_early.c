/* Prefill room records (reference counted, reused), the early-room rule
 * (an M2 before its sender: charged to its decode session, bounded per
 * session and overall, LRU-expired; see prefill_int.h "Tables and bounds"),
 * the chunks pending on a room until it is Bootstrapped, and the M3 helpers. */
#include "kv/prefill/prefill_int.h"

pf_chunk *kvf__pf_chunk_new(prefill_state *ps) {
  pthread_mutex_lock(&ps->spare_mu);
  pf_chunk *c = kvf__spare_take(&ps->chunk_spare, sizeof *c);
  pthread_mutex_unlock(&ps->spare_mu);
  return c;
}

void kvf__pf_chunk_free(prefill_state *ps, pf_chunk *c) {
  if (!c) return;
  /* still being hashed by its sending thread, which frees it when done */
  if (atomic_exchange(&c->hold, PF_HOLD_FREED) == PF_HOLD_HASHING) return;
  if (c->pages != c->pages_inline) free(c->pages);
  if (c->cands != c->cands_inline) free(c->cands);
  if (c->state_slots != c->state_inline) free(c->state_slots);
  free(c->digests), free(c->dig_bufs);
  pthread_mutex_lock(&ps->spare_mu);
  kvf__spare_give(&ps->chunk_spare, c);
  pthread_mutex_unlock(&ps->spare_mu);
}

pf_info *kvf__pf_info_new(prefill_state *ps) {
  pthread_mutex_lock(&ps->spare_mu);
  pf_info *i = ps->info_spare;
  if (i) ps->info_spare = i->next_spare, ps->ninfo_spare--;
  pthread_mutex_unlock(&ps->spare_mu);
  if (i) {
    wire_m2 *m2 = i->m2;
    size_t cap = i->m2_cap;
    memset(i, 0, sizeof *i);
    i->m2 = m2, i->m2_cap = cap;
  } else if (!(i = calloc(1, sizeof *i))) {
    return NULL;
  }
  i->refs = 1;
  return i;
}

void kvf__pf_info_unref(prefill_state *ps, pf_info *i) {
  if (!i || --i->refs > 0) return;
  free(i->frags_cut);
  i->frags_cut = NULL;
  if (i->m2_cap > PF_SPARE_M2_BYTES) { /* a long request's page list: not kept by every spare for ever */
    free(i->m2);
    i->m2 = NULL, i->m2_cap = 0;
  }
  pthread_mutex_lock(&ps->spare_mu);
  if (ps->ninfo_spare < PF_SPARE_INFOS) {
    i->next_spare = ps->info_spare;
    ps->info_spare = i, ps->ninfo_spare++;
    i = NULL;
  }
  pthread_mutex_unlock(&ps->spare_mu);
  if (i) free(i->m2), free(i);
}

/* ps->lock held: the pf_room of a room id (live or early), or NULL. It
 * stays valid while ps->lock is held: only the prefill, under ps->lock,
 * stores or clears its rooms. */
pf_room *kvf__pf_room_find(prefill_state *ps, int64_t room) {
  void *u = NULL;
  return kvf__rooms_get_user(ps->m->rooms, room, &u) ? NULL : u;
}

/* ps->lock held: an empty room, a spare one when there is (its infos
 * array kept), so rooms cost no allocation once warm. NULL without memory. */
pf_room *kvf__pf_room_new(prefill_state *ps) {
  pf_room *r = ps->room_spare;
  if (!r) {
    r = calloc(1, sizeof *r);
  } else {
    ps->room_spare = r->next_spare;
    ps->nroom_spare--;
    pf_info **infos = r->infos;
    size_t cap = r->cap;
    memset(r, 0, sizeof *r);
    r->infos = infos, r->cap = cap;
  }
  if (r) {
    r->tr_status = -1;
    kvf__trace_begin(ps->m, &r->tr);
  }
  return r;
}

const trace_live *kvf__pf_trace_of(void *user) { return &((pf_room *)user)->tr; }

/* ps->lock held: a room nothing refers to any more (its contents released),
 * kept as a spare (PF_SPARE_ROOMS) or freed; NULL ok. */
void kvf__pf_room_drop(prefill_state *ps, pf_room *r) {
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

void kvf__pf_room_busy_done_locked(prefill_state *ps, pf_room *r) {
  if (--r->busy == 0) kvf__rooms_notify(ps->m->rooms);
}

/* ps->lock held. */
void kvf__pf_room_unref(prefill_state *ps, pf_room *r) {
  if (--r->refs > 0) return;
  /* Every thread that stepped the room has let it go: its record is whole.
   * A room that never had a sender (an early room dropped) is not one. */
  if (r->has_sender && r->tr_status >= 0) kvf__trace_finish(ps->m, &r->tr, r->room, r->tr_status, r->tr_reason);
  else atomic_store(&r->tr.on, 0);
  for (size_t i = 0; i < r->ninfos; i++) kvf__pf_info_unref(ps, r->infos[i]);
  free(r->park);
  for (pf_chunk *c = r->pend_head, *n; c; c = n) {
    n = c->next;
    kvf__pf_chunk_free(ps, c);
  }
  kvf__pf_room_drop(ps, r);
}

/* ps->lock held: drop a chunk and the room reference it holds. */
void kvf__pf_chunk_release_locked(prefill_state *ps, pf_chunk *c) {
  pf_room *r = c->r;
  kvf__pf_chunk_free(ps, c);
  if (r) kvf__pf_room_unref(ps, r);
}

void kvf__pf_send_m3(kvf_manager *m, const char *host, uint16_t port, uint64_t epoch, const pf_m3_msg *s) {
  wire_m3 m3 = {.room = s->room,
                .status = s->status,
                .prefill_rank = m->tp_rank,
                .bootstrap_token = s->token,
                .candidates = wire_array_of(s->cands, s->cands ? s->ncand : 0),
                .reason = s->reason,
                .reason_len = s->reason ? strlen(s->reason) : 0,
                .fence_epoch = epoch};
  wire_msg msg;
  char why[WIRE_REASON_LEN];
  if (kvf__wire_m3_encode(&m3, &msg, why)) {
    LOG_WARN("kv", "cannot encode the status of room %" PRId64 " for %s: %s", s->room, kvf__addr_str(host, port).s,
             why);
    return;
  }
  kvf__manager_push_send(m, host, port, &msg);
  kvf__wire_msg_free(&msg);
}

void kvf__pf_send_m3_failed(kvf_manager *m, const char *host, uint16_t port, uint64_t epoch, int64_t room,
                            const char *reason) {
  kvf__pf_send_m3(m, host, port, epoch,
                  &(pf_m3_msg){.room = room, .status = ROOM_FAILED, .token = -1, .reason = reason});
}

/* ps->lock held: the non-dummy destinations of r, for M3 Failed, but the
 * one of decode session `except` (NULL: none). */
pf_dest *kvf__pf_collect_dests(pf_room *r, const char *except, size_t *n) {
  *n = 0;
  pf_dest *d = calloc(r->ninfos ? r->ninfos : 1, sizeof *d);
  if (!d) return NULL;
  for (size_t i = 0; i < r->ninfos; i++) {
    const wire_m2 *x = r->infos[i]->m2;
    if (x->is_dummy || (except && !strcmp(x->session, except))) continue;
    kvf__pf_dest_of(x, &d[(*n)++]);
  }
  return d;
}

void kvf__pf_dest_of(const wire_m2 *x, pf_dest *d) {
  kvf__str_copy(d->host, sizeof d->host, x->endpoint);
  d->port = x->dst_port;
  d->epoch = x->fence_epoch;
}

pf_dest *kvf__pf_fail_room_locked(prefill_state *ps, pf_room *r, const char *why, const char *except, size_t *n) {
  int st = ROOM_FAILED;
  *n = 0;
  int first = !kvf__rooms_get_status(ps->m->rooms, r->room, &st) && st != ROOM_FAILED;
  kvf__rooms_fail(ps->m->rooms, r->room, why);
  pf_dest *d = first ? kvf__pf_collect_dests(r, except, n) : NULL;
  if (d && !*n) {
    free(d);
    d = NULL;
  }
  return d;
}

int kvf__pf_dests_check_locked(const pf_room *r, char *why, size_t cap) {
  int64_t nreal = 0, ndummy = 0;
  for (size_t i = 0; i < r->ninfos; i++) r->infos[i]->m2->is_dummy ? ndummy++ : nreal++;
  for (size_t i = 0; nreal && i < r->ninfos; i++) {
    const wire_m2 *x = r->infos[i]->m2;
    if (x->is_dummy || x->required_dst_info_num == nreal) continue;
    snprintf(why, cap,
             "the decodes' transfer requests cannot complete: decode session %.200s counts %" PRId64
             " destinations of this prefill rank, %" PRId64 " take data from it (%" PRId64 " dummies)",
             x->session, x->required_dst_info_num, nreal, ndummy);
    return KVF_EPROTO;
  }
  return 0;
}

pf_dest *kvf__pf_dead_room_failed_locked(pf_room *r, size_t *n) {
  *n = 0;
  if (!r->dead || r->dead_told) return NULL;
  r->dead_told = 1;
  return kvf__pf_collect_dests(r, NULL, n);
}

void kvf__pf_send_failed_all(kvf_manager *m, int64_t room, pf_dest *d, size_t n, const char *reason) {
  for (size_t i = 0; i < n; i++) kvf__pf_send_m3_failed(m, d[i].host, d[i].port, d[i].epoch, room, reason);
  free(d);
}

/* The room failed with one decode session: the other destinations can no
 * longer get Success from this rank, so they hear it now (the reference
 * leaves them to their waiting timeout or the scheduler's all-reduce).
 * Frees d. */
void kvf__pf_tell_others_failed(kvf_manager *m, int64_t room, pf_dest *d, size_t n, const char *why) {
  char reason[ROOMS_REASON_MAX];
  snprintf(reason, sizeof reason, "prefill rank %d failed the room with another decode rank: %.200s", m->tp_rank,
           why);
  kvf__pf_send_failed_all(m, room, d, n, reason);
}

/* ps->lock held: the room's queue shard. The reference shards by the
 * destination sessions alone (§6.12), which puts every room from one decode
 * rank on one worker, one synchronous write after another. kvferry mixes in
 * the room id: a room's chunks still run in order on one worker, while rooms
 * to the same decode spread over all workers. The failed-session mark is
 * shared, so a dead session is still seen by every worker at once. */
int kvf__pf_room_shard(prefill_state *ps, pf_room *r) {
  const char *small[PF_DIRECT_MAX_DESTS] = {0}, **s = small;
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
int kvf__pf_queue_push(pf_queue *q, pf_chunk *c) {
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
  pthread_cond_signal(&q->cond); /* an idle thread takes it (workers.c) */
  kvf__pf_queue_poke_locked(q);  /* or one waiting for its window */
  pthread_mutex_unlock(&q->lock);
  return 0;
}

/* ps->lock held: queue every pending chunk of a now-Bootstrapped room, in
 * order. A full queue fails the room (the chunk cannot wait forever). A
 * room's only chunk, small enough, is instead returned in *direct (with its
 * record in *dj) for this thread to send once it dropped the lock. */
void kvf__pf_flush_pending(prefill_state *ps, pf_room *r, pf_direct **dj, pf_chunk **direct, pf_dest **fail_d,
                           size_t *fail_n) {
  pf_chunk *c = r->pend_head;
  if (c && !c->next && (*dj = kvf__pf_direct_take_locked(ps, r, c, 1))) {
    r->pend_head = r->pend_tail = NULL;
    r->npending = 0;
    *direct = c;
    return;
  }
  r->pend_head = r->pend_tail = NULL;
  r->npending = 0;
  while (c) {
    pf_chunk *n = c->next;
    if (kvf__pf_queue_push(&ps->queues[r->shard], c)) {
      if (r->has_sender && !r->dead && !*fail_d)
        *fail_d = kvf__pf_fail_room_locked(ps, r, "Prefill transfer queue is full", NULL, fail_n);
      kvf__pf_chunk_release_locked(ps, c);
    }
    c = n;
  }
}

/* ps->lock held: the early LRU list (see the file comment). */
void kvf__pf_early_unlink(prefill_state *ps, pf_room *r) {
  if (!r->early_owner) return;
  if (r->eprev) r->eprev->enext = r->enext;
  else ps->early_head = r->enext;
  if (r->enext) r->enext->eprev = r->eprev;
  else ps->early_tail = r->eprev;
  r->eprev = r->enext = NULL;
  r->early_owner->nearly--;
  r->early_owner->early_bytes -= r->early_bytes;
  r->early_owner = NULL;
  ps->nearly--;
  ps->early_bytes -= r->early_bytes;
}

void kvf__pf_early_append(prefill_state *ps, pf_room *r, pf_reg *owner) {
  r->early_owner = owner;
  r->eprev = ps->early_tail;
  r->enext = NULL;
  if (ps->early_tail) ps->early_tail->enext = r;
  else ps->early_head = r;
  ps->early_tail = r;
  owner->nearly++;
  owner->early_bytes += r->early_bytes;
  ps->nearly++;
  ps->early_bytes += r->early_bytes;
}

void kvf__pf_early_charge(prefill_state *ps, pf_room *r, size_t add, size_t sub) {
  if (!r->early_owner) return;
  r->early_bytes = r->early_bytes + add - sub;
  r->early_owner->early_bytes = r->early_owner->early_bytes + add - sub;
  ps->early_bytes = ps->early_bytes + add - sub;
}

/* ps->lock held: drop a few early rooms idle past the waiting timeout. */
void kvf__pf_expire_early(prefill_state *ps, int64_t now) {
  int64_t max_ns = (int64_t)(ps->m->cfg.waiting_timeout_s * 1e9);
  for (int i = 0; i < PF_EXPIRE_PER_MSG && ps->early_head && now - ps->early_head->last_m2_ns >= max_ns; i++) {
    pf_room *r = ps->early_head;
    kvf__pf_early_unlink(ps, r);
    kvf__rooms_clear(ps->m->rooms, r->room, NULL);
    r->dead = 1;
    kvf__pf_room_unref(ps, r);
  }
}

/* Ended rooms. A decode's M2 that comes after the prefill destroyed the
 * room's sender (the request was aborted or dropped before this decode
 * asked) would otherwise become an early room that no sender ever takes:
 * its decode would wait for its own timeout. The room ids of senders
 * destroyed before Success are kept, the last PF_MAX_ENDED for the waiting
 * timeout, so such an M2 is answered M3 Failed at once (listener.c). A
 * sender created again for the same id takes it off. */
typedef struct pf_ended {
  int64_t room;
  int64_t at_ns;
} pf_ended;

/* Drop the oldest entry from the ring (and from the map, unless the room
 * was ended again since, in a newer slot). */
static void ended_pop_oldest(prefill_state *ps) {
  size_t slot = ps->ended_first;
  int64_t room = ps->ended_ring[slot].room;
  if ((uintptr_t)kvf__map_get(&ps->ended, (uint64_t)room) == slot + 1)
    kvf__map_del(&ps->ended, (uint64_t)room, NULL);
  ps->ended_first = (slot + 1) % PF_MAX_ENDED;
  ps->nended--;
}

static void ended_expire(prefill_state *ps, int64_t now) {
  int64_t max_ns = (int64_t)(ps->m->cfg.waiting_timeout_s * 1e9);
  while (ps->nended && now - ps->ended_ring[ps->ended_first].at_ns >= max_ns) ended_pop_oldest(ps);
}

void kvf__pf_ended_add_locked(prefill_state *ps, int64_t room, int64_t now) {
  if (!ps->ended_ring) {
    if (kvf__map_init(&ps->ended)) return;
    if (!(ps->ended_ring = calloc(PF_MAX_ENDED, sizeof *ps->ended_ring))) {
      kvf__map_free(&ps->ended);
      return; /* best effort: such a decode then waits for its timeout, as before */
    }
  }
  ended_expire(ps, now);
  if (ps->nended == PF_MAX_ENDED) ended_pop_oldest(ps);
  size_t slot = (ps->ended_first + ps->nended) % PF_MAX_ENDED;
  if (kvf__map_put(&ps->ended, (uint64_t)room, (void *)(uintptr_t)(slot + 1), NULL)) return;
  ps->ended_ring[slot] = (pf_ended){room, now};
  ps->nended++;
}

int kvf__pf_ended_has_locked(prefill_state *ps, int64_t room, int64_t now) {
  if (!ps->ended_ring) return 0;
  ended_expire(ps, now);
  return kvf__map_has(&ps->ended, (uint64_t)room);
}

void kvf__pf_ended_forget_locked(prefill_state *ps, int64_t room) {
  if (ps->ended_ring) kvf__map_del(&ps->ended, (uint64_t)room, NULL);
}

void kvf__pf_wait_hashed(prefill_state *ps, const pf_chunk *c, size_t upto) {
  if (atomic_load(&c->hashed) >= upto) return;
  pthread_mutex_lock(&ps->hash_mu);
  while (atomic_load(&c->hashed) < upto) pthread_cond_wait(&ps->hash_cv, &ps->hash_mu);
  pthread_mutex_unlock(&ps->hash_mu);
}

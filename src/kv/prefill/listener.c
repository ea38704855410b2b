/* The prefill's control messages from decodes (PROTOCOL §3.3-§3.5), on the
 * manager's listener thread: M1 registers a decode session, M2 asks for a
 * room's transfer (creating an early room when no sender exists yet), and
 * a fence message closes a room's writes (issue 16). */
#include "kv/prefill/prefill_int.h"

/* Issue 13 defect 5: an M1 or M2 names where the decode's status socket
 * (endpoint) and memory (its engine session, which also keys the
 * registration) are; only that host may send it. */
static int from_named_decode(kvf_manager *m, const char *peer, const char *endpoint, const char *session) {
  return kvf__manager_peer_is(m, peer, endpoint) && kvf__manager_peer_is(m, peer, session);
}

/* ps->lock held: the registration table is full (PF_MAX_SESSIONS; every
 * decode process that ever registered has a session, a restarted one a new
 * one): drop the registration used least recently that no early room is
 * charged to, so a new decode is not locked out by ones long gone. A
 * decode whose registration was dropped is answered Failed with
 * WIRE_REASON_UNREGISTERED at its next M2 (a kvferry decode then registers
 * again). KVF_ENOMEM when every one has early rooms. */
static int regs_drop_oldest_locked(prefill_state *ps, const char *peer) {
  map_iter it;
  const char *key, *vkey = NULL;
  void *v;
  pf_reg *victim = NULL;
  kvf__map_iter_init(&it);
  while (kvf__smap_next(&ps->regs, &it, &key, &v)) {
    pf_reg *g = v;
    if (!g->nearly && (!victim || g->used_ns < victim->used_ns)) victim = g, vkey = key;
  }
  if (!victim) return KVF_ENOMEM;
  char session[WIRE_STR_MAX + 1];
  kvf__str_copy(session, sizeof session, vkey);
  kvf__smap_del(&ps->regs, session, NULL);
  free(victim->m1);
  free(victim);
  if (kvf__log_first_time(kvf__hash_str("prefill-regs-full", (uint64_t)(uintptr_t)ps)))
    LOG_INFO("kv",
             "registration table full (%d decode sessions): dropped %s, unused the longest, for a new one from %s "
             "(further drops are not logged)",
             PF_MAX_SESSIONS, session, peer ? peer : "?");
  return 0;
}

uint64_t kvf__pf_reg_mem(const wire_m1 *m1) {
  uint64_t h = m1->kv_ptrs.count ? kvf__hash64(m1->kv_ptrs.data, m1->kv_ptrs.count * 8) : 0;
  if (m1->state_ptrs.count) h = h * 31 + kvf__hash64(m1->state_ptrs.data, m1->state_ptrs.count * 8);
  return h;
}

static void on_m1(kvf_manager *m, prefill_state *ps, const wire_frame *frames, size_t n, const char *peer) {
  wire_m1 d;
  wire_m1 *copy = NULL;
  char why[WIRE_REASON_LEN];
  if (kvf__wire_m1_decode(frames, n, &d, why)) {
    kvf__manager_reject(m, peer, "M1", why);
    return;
  }
  if (!from_named_decode(m, peer, d.endpoint, d.session)) {
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
    if ((smap_size(&ps->regs) >= PF_MAX_SESSIONS && regs_drop_oldest_locked(ps, peer)) ||
        !(reg = calloc(1, sizeof *reg)) || kvf__smap_put(&ps->regs, d.session, reg, NULL)) {
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
  reg->used_ns = clock_now_ns();
  reg->failed_ns = 0; /* a new registration clears the failed mark (§3.3, §7.4) */
  reg->failed_why[0] = '\0';
  reg->gen = ++ps->reg_gen;
  reg->mem = kvf__pf_reg_mem(copy);
  pthread_mutex_unlock(&ps->lock);
  if (d.kv_ptrs.count != m->bufs.n_kv)
    LOG_WARN("kv", "decode session %s registered %zu KV buffers, this prefill rank has %zu: its rooms will fail",
             d.session, d.kv_ptrs.count, m->bufs.n_kv);
  atomic_fetch_add(&m->stats.messages_received, 1);
}

static void on_m2(kvf_manager *m, prefill_state *ps, const wire_frame *frames, size_t n, const char *peer) {
  wire_m2 d;
  char why[ROOMS_REASON_MAX];
  if (kvf__wire_m2_decode(frames, n, &d, why)) {
    kvf__manager_reject(m, peer, "M2", why);
    return;
  }
  if (!from_named_decode(m, peer, d.endpoint, d.session)) {
    kvf__wire_m2_free(&d);
    kvf__manager_reject_forged(m, peer, "M2", "the sender is not the decode host the request names");
    return;
  }
  pf_info *info = kvf__pf_info_new(ps);
  if (!info || kvf__wire_m2_dup_into(&d, &info->m2, &info->m2_cap)) {
    kvf__pf_info_unref(ps, info); /* NULL-safe */
    kvf__wire_m2_free(&d);
    kvf__manager_reject(m, peer, "M2", "out of memory");
    return;
  }
  kvf__wire_m2_free(&d);
  const wire_m2 *x = info->m2;
  if (!x->is_dummy && (x->indices_are_local || x->page_mask.count || x->local_indices.count)) {
    /* L1.5 partial cache indices: not supported, and silently ignoring them
     * would write whole pages to the wrong places. */
    kvf__pf_info_unref(ps, info);
    kvf__manager_reject(m, peer, "M2", "L1.5 local indices are not supported");
    return;
  }
  if (kvf__pf_info_plan(m, info)) {
    kvf__pf_info_unref(ps, info);
    kvf__manager_reject(m, peer, "M2", "out of memory");
    return;
  }

  pthread_mutex_lock(&ps->lock);
  pf_reg *reg = kvf__smap_get(&ps->regs, x->session);
  if (!reg) {
    pthread_mutex_unlock(&ps->lock);
    snprintf(why, sizeof why, "decode session %s never registered (no M1)", x->session);
    kvf__manager_reject(m, peer, "M2", why);
    /* Its decode would wait for its timeout: tell it, in words a kvferry
     * decode acts on (it registers again). */
    if (!x->is_dummy) {
      snprintf(why, sizeof why, "prefill rank %d: %s", m->cfg.engine_rank, WIRE_REASON_UNREGISTERED);
      kvf__pf_send_m3_failed(m, x->endpoint, x->dst_port, x->fence_epoch, x->room, why);
    }
    kvf__pf_info_unref(ps, info);
    return;
  }
  reg->used_ns = clock_now_ns();
  info->reg_gen = reg->gen;
  info->reg_mem = reg->mem;
  int mismatch = !x->is_dummy && reg->m1->kv_ptrs.count != m->bufs.n_kv;
  int64_t now = clock_now_ns();
  kvf__pf_expire_early(ps, now);
  pf_room *r = kvf__pf_room_find(ps, x->room);
  if (!r && kvf__pf_ended_has_locked(ps, x->room, now)) {
    /* Its sender was destroyed before it could succeed: none will come. */
    pthread_mutex_unlock(&ps->lock);
    snprintf(why, sizeof why, "prefill rank %d: %s", m->cfg.engine_rank, PF_DESTROYED_REASON);
    if (!x->is_dummy) kvf__pf_send_m3_failed(m, x->endpoint, x->dst_port, x->fence_epoch, x->room, why);
    kvf__pf_info_unref(ps, info);
    atomic_fetch_add(&m->stats.messages_received, 1);
    return;
  }
  /* An early room (no sender yet) is bounded in count and in the bytes of
   * the M2 copies it holds, charged to the session whose M2 created it. */
  size_t cost = info->m2_cap;
  pf_reg *payer = r ? r->early_owner : reg;
  const char *full = NULL;
  int by_bytes = 0;
  if (!r)
    full = reg->nearly >= PF_MAX_EARLY_PER_SESSION ? "from this decode session"
           : ps->nearly >= PF_MAX_EARLY            ? "from all decode sessions"
                                                   : NULL;
  if (!full && payer) {
    if (payer->early_bytes + cost > PF_MAX_EARLY_BYTES_PER_SESSION) full = "from this decode session";
    else if (ps->early_bytes + cost > PF_MAX_EARLY_BYTES) full = "from all decode sessions";
    by_bytes = full != NULL;
  }
  int fresh = !r;
  if (full || (fresh && (!(r = kvf__pf_room_new(ps)) || kvf__rooms_add_early(m->rooms, x->room, r)))) {
    if (fresh) kvf__pf_room_drop(ps, r);
    pthread_mutex_unlock(&ps->lock);
    atomic_fetch_add(&m->stats.messages_unknown_room, 1);
    if (by_bytes)
      snprintf(why, sizeof why,
               "prefill rank %d refused the transfer request: requests %s waiting for their sender hold too "
               "many bytes (limit %u MiB per session, %u MiB in all)",
               m->cfg.engine_rank, full, PF_MAX_EARLY_BYTES_PER_SESSION >> 20, PF_MAX_EARLY_BYTES >> 20);
    else
      snprintf(why, sizeof why,
               "prefill rank %d refused the transfer request: %s requests %s wait for their sender "
               "(limit %d per session, %d in all)",
               m->cfg.engine_rank, full ? "too many" : "out of memory:", full ? full : "no room for more",
               PF_MAX_EARLY_PER_SESSION, PF_MAX_EARLY);
    if (kvf__log_first_time(kvf__hash_str("prefill-early-full", (uint64_t)(uintptr_t)m)))
      LOG_WARN("kv", "room %" PRId64 " from %s: %s (further ones are counted, not logged)", x->room,
               peer ? peer : "?", why);
    /* Tell the decode now: otherwise it waits for its timeout. */
    kvf__pf_send_m3_failed(m, x->endpoint, x->dst_port, x->fence_epoch, x->room, why);
    kvf__pf_info_unref(ps, info);
    return;
  }
  if (fresh) {
    r->room = x->room;
    r->refs = 1;
    kvf__pf_early_append(ps, r, reg);
    kvf__trace_at(&r->tr, KVF_TRACE_M2_RECEIVED, now);
  } else {
    kvf__trace_at(&r->tr, KVF_TRACE_M2_RECEIVED, now); /* the room's first M2 wins */
    if (r->early_owner) {
      pf_reg *owner = r->early_owner; /* a repeat: most recently used now */
      kvf__pf_early_unlink(ps, r);
      kvf__pf_early_append(ps, r, owner);
    }
  }
  size_t k = 0;
  while (k < r->ninfos && strcmp(r->infos[k]->m2->session, x->session)) k++;
  /* A repeat once the room's chunks went to their writes: the pages the
   * first request named may already hold some of the KV and the new ones
   * would get only the rest, so the room fails rather than end Success on
   * partly written pages (the reference replaces the request in place). */
  int st0 = ROOM_FAILED; /* final rooms are only told (tell_failed, below) */
  int open = r->has_sender && !r->dead && !kvf__rooms_get_status(m->rooms, r->room, &st0) && st0 != ROOM_SUCCESS &&
             st0 != ROOM_FAILED;
  int moved = open && k < r->ninfos && r->bootstrapped && r->nchunks > 0;
  if (k == r->ninfos && r->bootstrapped) {
    /* Another decode session once the room had every request it needs
     * (required_dst_info_num): the room's Success counts the first ones, so
     * this one would never get its M3 (the reference leaves it to its
     * timeout), and once chunks went out it would get only the rest of the
     * KV. Refused and told so; nothing is written to it. */
    pf_dest told;
    kvf__pf_dest_of(x, &told);
    int64_t room = r->room;
    size_t have = r->ninfos;
    pthread_mutex_unlock(&ps->lock);
    snprintf(why, sizeof why,
             "prefill rank %d refused the transfer request of decode session %.200s: the room already has the %zu "
             "it needs (required_dst_info_num)",
             m->cfg.engine_rank, x->session, have);
    if (kvf__log_first_time_for_host(peer ? peer : "?", "prefill-extra-m2"))
      LOG_WARN("kv", "room %" PRId64 ": %s (further ones from this host are not logged)", room, why);
    if (!x->is_dummy) kvf__pf_send_m3_failed(m, told.host, told.port, told.epoch, room, why);
    kvf__pf_info_unref(ps, info);
    atomic_fetch_add(&m->stats.messages_received, 1);
    return;
  }
  info->late = r->written;
  if (k < r->ninfos) {
    kvf__trace_add(&r->tr, TRACE_RETRIES, 1);
    kvf__pf_early_charge(ps, r, cost, r->infos[k]->m2_cap);
    kvf__pf_info_unref(ps, r->infos[k]); /* a repeat from the same session replaces it in place */
    r->infos[k] = info;
  } else {
    if (r->ninfos == r->cap) {
      size_t nc = r->cap ? r->cap * 2 : 4;
      pf_info **ni = r->ninfos < PF_MAX_INFOS ? realloc(r->infos, nc * sizeof *ni) : NULL;
      if (!ni) {
        pthread_mutex_unlock(&ps->lock);
        kvf__pf_info_unref(ps, info);
        kvf__manager_reject(m, peer, "M2", "too many decode sessions for one room");
        return;
      }
      r->infos = ni;
      r->cap = nc;
    }
    r->infos[r->ninfos++] = info;
    kvf__pf_early_charge(ps, r, cost, 0);
  }
  r->last_m2_ns = now;
  /* Failures this M2 shows: the other decodes are told here, this one below
   * (tell_failed). */
  pf_dest *fd = NULL;
  size_t nfd = 0;
  if (moved) {
    snprintf(why, sizeof why, "decode session %s asked again for the room after its transfer began", x->session);
    fd = kvf__pf_fail_room_locked(ps, r, why, x->session, &nfd);
  }
  if (mismatch && !fd && open) {
    snprintf(why, sizeof why, "Decode session %s registered %zu KV buffers, this prefill rank has %zu", x->session,
             reg->m1->kv_ptrs.count, m->bufs.n_kv);
    fd = kvf__pf_fail_room_locked(ps, r, why, x->session, &nfd);
  }
  int bootstraps = !r->bootstrapped && (int64_t)r->ninfos == x->required_dst_info_num;
  if (bootstraps && !fd && r->has_sender && !r->dead && kvf__pf_dests_check_locked(r, why, sizeof why)) {
    LOG_WARN("kv", "room %" PRId64 ": %s", r->room, why);
    fd = kvf__pf_fail_room_locked(ps, r, why, x->session, &nfd);
  }
  /* A room that failed before this decode asked (an abort, a timeout, another
   * decode's failure) told only the decodes it knew then: tell this one. One
   * that succeeded had every M2 it needed: this one (a decode that asked
   * again) is served by nothing. */
  int st = ROOM_FAILED, tell_failed = 0;
  pf_dest told; /* copied under the lock: once it is let go the room (and x with it) may be freed */
  if (r->has_sender && !r->dead && !x->is_dummy && !kvf__rooms_get_status(m->rooms, r->room, &st) &&
      (st == ROOM_FAILED || st == ROOM_SUCCESS)) {
    tell_failed = 1;
    kvf__pf_dest_of(x, &told);
    if (st == ROOM_SUCCESS)
      snprintf(why, sizeof why, "prefill rank %d: the room had completed before this transfer request came",
               m->cfg.engine_rank);
    else if (kvf__rooms_get_reason(m->rooms, r->room, why, sizeof why) || !*why)
      snprintf(why, sizeof why, "the prefill failed the request");
  }
  pf_direct *dj = NULL;
  pf_chunk *direct = NULL;
  pf_dest *qd = NULL; /* a full queue failed the room */
  size_t nqd = 0;
  char qwhy[ROOMS_REASON_MAX] = "";
  if (bootstraps) {
    r->bootstrapped = 1;
    r->shard = kvf__pf_room_shard(ps, r);
    if (r->has_sender) kvf__rooms_update(m->rooms, r->room, ROOM_BOOTSTRAPPED, NULL);
    kvf__pf_flush_pending(ps, r, &dj, &direct, &qd, &nqd);
    if (qd) kvf__rooms_get_reason(m->rooms, r->room, qwhy, sizeof qwhy);
  }
  int64_t room = r->room;
  pthread_mutex_unlock(&ps->lock);
  if (fd) kvf__pf_tell_others_failed(m, room, fd, nfd, why);
  if (qd) kvf__pf_send_failed_all(m, room, qd, nqd, qwhy);
  if (tell_failed) kvf__pf_send_m3_failed(m, told.host, told.port, told.epoch, room, why);
  if (direct) { /* the room's only chunk waited for this M2: send it from here */
    kvf__pf_direct_run(ps, dj, direct);
    pthread_mutex_lock(&ps->lock);
    kvf__pf_chunk_release_locked(ps, direct);
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
  if (!kvf__manager_peer_is(m, peer, f.session)) { /* the decode host the session names */
    kvf__manager_reject_forged(m, peer, "fence", "the sender is not the decode host the notice names");
    return;
  }
  int hit = 0;
  pf_dest *d = NULL;
  size_t nd = 0;
  pthread_mutex_lock(&ps->lock);
  pf_room *r = kvf__pf_room_find(ps, f.room);
  for (size_t i = 0; r && !r->dead && i < r->ninfos && !hit; i++) {
    const wire_m2 *x = r->infos[i]->m2;
    hit = x->fence_epoch == f.epoch && !strcmp(x->session, f.session);
  }
  int st = ROOM_FAILED;
  if (hit && r->has_sender && !kvf__rooms_get_status(m->rooms, f.room, &st) && st != ROOM_FAILED) {
    snprintf(why, sizeof why, "Decode %.200s failed the room: %.250s", f.session,
             *f.reason ? f.reason : "no reason given");
    kvf__rooms_fail(m->rooms, f.room, why);
    d = kvf__pf_collect_dests(r, f.session, &nd);
  }
  pthread_mutex_unlock(&ps->lock);
  if (d) kvf__pf_tell_others_failed(m, f.room, d, nd, why);
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

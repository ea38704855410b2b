/* The kvf_receiver API the scheduler drives (include/kvferry/kv.h): create
 * (construction failures leave a receiver that polls Failed, §7.3), init,
 * poll with the waiting timeout, first-token metadata, destroy. */
#include "kv/decode/decode_int.h"

#define DECODE_SPARE_MAX 4096 /* destroyed receivers kept for reuse: no allocation per room */
/* A spare keeps its room-bounds arrays up to this many bytes each: one long,
 * scattered room's (16 bytes a page for the sorted pages and for their
 * runs) would otherwise stay allocated in every spare that once served one. */
#define DECODE_SPARE_ARRAY_MAX (64u << 10)

static kvf_receiver *receiver_take(struct decode_state *ds) {
  pthread_mutex_lock(&ds->lock);
  kvf_receiver *r = ds->spare;
  if (r) ds->spare = r->next_spare, ds->nspare--;
  pthread_mutex_unlock(&ds->lock);
  if (r) { /* zeroed, but its grow-only arrays kept */
    kvf_receiver keep = *r;
    memset(r, 0, sizeof *r);
    r->bounds = keep.bounds, r->bounds_cap = keep.bounds_cap;
    r->sorted = keep.sorted, r->sorted_cap = keep.sorted_cap;
  }
  return r ? r : calloc(1, sizeof *r);
}

static void receiver_give(struct decode_state *ds, kvf_receiver *r) {
  if (r->bounds_cap * sizeof *r->bounds > DECODE_SPARE_ARRAY_MAX)
    free(r->bounds), r->bounds = NULL, r->bounds_cap = 0;
  if (r->sorted_cap * sizeof *r->sorted > DECODE_SPARE_ARRAY_MAX)
    free(r->sorted), r->sorted = NULL, r->sorted_cap = 0;
  pthread_mutex_lock(&ds->lock);
  int keep = ds->nspare < DECODE_SPARE_MAX;
  if (keep) {
    r->next_spare = ds->spare;
    ds->spare = r;
    ds->nspare++;
  }
  pthread_mutex_unlock(&ds->lock);
  if (!keep) kvf__dec_receiver_free(r);
}

const trace_live *kvf__dec_trace_of(void *user) { return &((kvf_receiver *)user)->tr; }

int kvf_receiver_create(kvf_manager *m, const char *bootstrap_addr, int64_t room, kvf_receiver **out) {
  if (!m || !m->decode || !bootstrap_addr || !out) return KVF_EINVAL;
  if (!*bootstrap_addr || strlen(bootstrap_addr) > KVF_ADDR_MAX) return KVF_EINVAL;
  kvf_receiver *r = receiver_take(m->decode);
  if (!r) return KVF_ENOMEM;
  r->m = m;
  r->room = room;
  kvf__str_copy(r->addr, sizeof r->addr, bootstrap_addr);
  kvf__trace_begin(m, &r->tr); /* before the room is visible to the listener */
  kvf__trace_now(&r->tr, KVF_TRACE_CREATED);
  int rc = kvf__rooms_create(m->rooms, room, ROOM_BOOTSTRAPPING);
  if (rc) {
    atomic_store(&r->tr.on, 0); /* not this receiver's room: nothing to record */
    receiver_give(m->decode, r);
    return rc;
  }
  kvf__rooms_set_user(m->rooms, room, r);
  r->status = kvf__rooms_status_cell(m->rooms, room); /* live until destroy clears it */
  char reason[ROOMS_REASON_MAX] = "";
  if (kvf__dec_resolve_receiver(m, r, reason, sizeof reason)) {
    kvf__dec_fail_room(m, room, reason);
  } else {
    kvf__rooms_set_required(m->rooms, room, r->pool->required_prefill_response_num);
    kvf__rooms_update(m->rooms, room, ROOM_BOOTSTRAPPED, NULL);
  }
  *out = r;
  return 0;
}

/* The room's peers (the plan's real target ranks) and the pages it asked
 * for, in its trace; the receiver's thread, before the M2s go out. */
static void trace_peers(kvf_receiver *r, size_t npages) {
  trace_live *tl = &r->tr;
  if (!kvf__trace_on(tl)) return;
  atomic_store(&tl->n[TRACE_DESCS], npages);
  tl->npeers = 0;
  for (int i = 0; i < r->pool->ntargets && tl->npeers < KVF_TRACE_MAX_PEERS; i++) {
    const pool_target *t = &r->pool->targets[i];
    if (t->is_dummy) continue;
    kvf_trace_peer *p = &tl->peers[tl->npeers++];
    snprintf(p->peer, sizeof p->peer, "%.40s:%u", t->ip, (unsigned)t->port);
    p->transport[0] = p->mode[0] = '\0'; /* known once something landed (trace_landed) */
  }
}

/* What the engine saw land for the room (its fence), into its trace: the
 * first and last byte, bytes, chunks and how they came. Over one-sided UCX
 * writes this engine sees nothing: those steps stay unset. Before the fence
 * is closed; the receiver's thread. */
static void trace_landed(kvf_receiver *r, int status) {
  trace_live *tl = &r->tr;
  kvf__fence_stats fs = {0};
  if (!kvf__trace_on(tl)) return;
  if (r->fence_epoch && !kvf__engine_fence_stats(r->m->engine, manager_room_tag(r->room), r->fence_epoch, &fs) &&
      fs.chunks) {
    kvf__trace_at(tl, KVF_TRACE_FIRST_BYTE, fs.first_ns);
    kvf__trace_at(tl, KVF_TRACE_LAST_BYTE, fs.last_ns);
    atomic_store(&tl->n[TRACE_BYTES], fs.bytes);
    atomic_store(&tl->n[TRACE_CHUNKS], fs.chunks);
  }
  const char *engine = kvf_engine_transport(r->m->engine);
  const char *tr = fs.how == KVF__FENCE_TCP ? "tcp" : fs.how == KVF__FENCE_READ ? "ucx" : "";
  const char *mode = fs.how == KVF__FENCE_TCP ? "tcp" : fs.how == KVF__FENCE_READ ? "read" : "";
  if (!fs.how && status == ROOM_SUCCESS && !strcmp(engine, "ucx") && r->fence_epoch)
    tr = "ucx", mode = "write"; /* landed without this engine's CPU: one-sided puts */
  for (uint32_t i = 0; i < tl->npeers; i++) {
    kvf__str_copy(tl->peers[i].transport, sizeof tl->peers[i].transport, tr);
    kvf__str_copy(tl->peers[i].mode, sizeof tl->peers[i].mode, mode);
  }
}

int kvf_receiver_init(kvf_receiver *r, const int64_t *pages, size_t npages, int64_t aux_index,
                      int64_t decode_prefix_len, const int64_t *state_slots, size_t nstate) {
  if (!r || (npages && !pages) || (nstate && !state_slots) || decode_prefix_len < 0) return KVF_EINVAL;
  if (npages > WIRE_MAX_PAGES || nstate > WIRE_MAX_PAGES) return KVF_ETOOBIG;
  for (size_t i = 0; i < npages; i++)
    if (pages[i] < 0) return KVF_EINVAL;
  for (size_t i = 0; i < nstate; i++)
    if (state_slots[i] < 0) return KVF_EINVAL;
  kvf_manager *m = r->m;
  int status = ROOM_FAILED;
  if (!r->pool || kvf__rooms_get_status(m->rooms, r->room, &status) || status == ROOM_FAILED)
    return 0; /* already Failed with its reason: poll reports it */
  pool_entry *p = r->pool;
  char reason[ROOMS_REASON_MAX] = "";
  int rc = 0;
  uint64_t room_flags = 0;
  int again = atomic_load(&r->m2_out); /* a repeated init: a new request in the same room */
  if (again) {
    if (r->fence_epoch) kvf__integ_room_close(m, r->room, r->fence_epoch, 0, 1);
    kvf__trace_add(&r->tr, TRACE_RETRIES, 1);
  }
  trace_peers(r, npages);
  kvf__integ_room_open(m, r->room, p->kvferry_peer, &room_flags, &r->fence_epoch);
  if (r->fence_epoch && kvf__dec_room_bound(m, r, pages, npages, state_slots, nstate))
    LOG_WARN("kv",
             "room %" PRId64 ": no memory for its page bounds; its writes are checked against the engine's "
             "registered memory only",
             r->room);
  /* Only a kvferry prefill (it published its page layout) is asked; verify
   * mode checks digests before Success, which come by the control plane, so
   * such a room is completed by its M3. */
  atomic_store(&r->asked_fast, m->decode->fast && p->kvferry_peer && !(room_flags & WIRE_ROOM_VERIFY));
  atomic_store(&r->m2_epoch, r->fence_epoch);
  atomic_store(&r->m2_out, 1);
  /* The new use of the room id starts only now, after the new epoch is the
   * one M3s must name (rooms.h, "Uses"): an answer to the earlier use that
   * the status listener checked before this point acts on the earlier use,
   * whose responses this forgets, and one checked after it is stale. */
  if (again) kvf__rooms_reset_responses(m->rooms, r->room, ROOM_BOOTSTRAPPED);
  if (kvf__trace_on(&r->tr)) kvf__trace_at_last(&r->tr, KVF_TRACE_M2_SENT, clock_now_ns()); /* the last init's */
  for (int i = 0; i < p->ntargets && !rc; i++) {
    const pool_target *t = &p->targets[i];
    wire_m2 m2;
    memset(&m2, 0, sizeof m2);
    m2.room = r->room;
    kvf__dec_fill_self(m, m2.endpoint, &m2.dst_port, m2.session, &m2.session_port);
    m2.required_dst_info_num = t->required_dst_info_num;
    m2.is_dummy = t->is_dummy;
    if (!t->is_dummy) {
      m2.kv_indices = wire_array_of(pages, npages);
      m2.dst_aux_index = aux_index;
      m2.decode_prefix_len = decode_prefix_len;
      m2.mamba_indices = wire_array_of(state_slots, nstate);
      m2.room_flags = room_flags;
      m2.fence_epoch = r->fence_epoch;
      if (p->fragmented && t->nfrags) {
        m2.frags = p->frags + t->frag_start;
        m2.nfrags = t->nfrags;
        m2.page_layout = p->page_layout;
      }
      if (atomic_load(&r->asked_fast)) m2.room_flags |= WIRE_ROOM_FAST_COMPLETION;
    }
    wire_msg msg;
    char why[WIRE_REASON_LEN] = "";
    if ((rc = kvf__wire_m2_encode(&m2, &msg, why))) {
      kvf__dec_set_reason(reason, sizeof reason, "Could not encode the transfer request for prefill rank %d: %s",
                          t->rank, why);
      break;
    }
    rc = kvf__manager_push_send(m, t->ip, t->port, &msg);
    kvf__wire_msg_free(&msg);
    if (rc)
      kvf__dec_set_reason(reason, sizeof reason, "Could not send the transfer request to prefill rank %s: %s",
                          kvf__addr_str(t->ip, t->port).s, kvf_strerror(rc));
  }
  if (rc) {
    kvf__dec_fail_room(m, r->room, reason);
    return 0;
  }
  r->init_ns = clock_now_ns();
  return 0;
}

/* The room is Failed: refuse its late writes from now on (the engine fence)
 * and tell every kvferry prefill rank of the plan, so its sender fails
 * instead of writing on. Once per receiver. */
static void fence_failed(kvf_receiver *r) {
  if (!r->fence_epoch || r->fenced) return;
  kvf_manager *m = r->m;
  r->fenced = 1;
  char reason[ROOMS_REASON_MAX] = "";
  kvf__rooms_get_reason(m->rooms, r->room, reason, sizeof reason);
  kvf__integ_room_close(m, r->room, r->fence_epoch, 1, 0);
  for (int i = 0; r->pool && i < r->pool->ntargets; i++) {
    const pool_target *t = &r->pool->targets[i];
    if (!t->is_dummy) kvf__integ_send_fence(m, t->ip, t->port, r->room, r->fence_epoch, reason);
  }
}

static kvf_poll_status poll_room(kvf_receiver *r);

kvf_poll_status kvf_receiver_poll(kvf_receiver *r) {
  kvf_poll_status st = poll_room(r);
  if (r && !r->final_seen && (st == KVF_POLL_FAILED || st == KVF_POLL_SUCCESS)) {
    r->final_seen = 1;
    kvf__trace_now(&r->tr, KVF_TRACE_FINAL);
    trace_landed(r, st); /* before a Failed room's fence is closed */
  }
  if (st == KVF_POLL_FAILED && r) fence_failed(r);
  return st;
}

static kvf_poll_status poll_room(kvf_receiver *r) {
  if (!r) return KVF_POLL_FAILED;
  kvf_manager *m = r->m;
  /* One atomic load, no lock: a scheduler polls every room it has in
   * flight, often. */
  int st = atomic_load_explicit(r->status, memory_order_acquire);
  if (st == ROOM_SUCCESS || st == ROOM_FAILED || !r->init_ns) return (kvf_poll_status)st;
  double waited = (double)(clock_now_ns() - r->init_ns) / 1e9;
  if (waited < m->cfg.waiting_timeout_s) return (kvf_poll_status)st;
  char reason[ROOMS_REASON_MAX];
  kvf__dec_set_reason(reason, sizeof reason,
                      "Request %" PRId64 " timed out after %.1fs in TransferPoll.WaitingForInput", r->room,
                      waited);
  /* Fail only if Success did not win the race. */
  int failed = 0;
  kvf__rooms_fail_unless_success(m->rooms, r->room, reason, &failed);
  if (failed) LOG_WARN("kv", "%s", reason);
  return (kvf_poll_status)atomic_load_explicit(r->status, memory_order_acquire);
}

void kvf_receiver_failure(kvf_receiver *r, char *buf, size_t cap) {
  if (!buf || !cap) return;
  buf[0] = 0;
  if (r) kvf__rooms_get_reason(r->m->rooms, r->room, buf, cap);
}

int kvf_receiver_supports_spec(const kvf_receiver *r) {
  if (!r) return KVF_EINVAL;
  return r->pool ? r->pool->supports_spec : KVF_ESTATE;
}

int kvf_receiver_pop_metadata(kvf_receiver *r, int64_t *token, int32_t *cands, size_t cap, size_t *ncand) {
  if (!r || !token || !ncand) return KVF_EINVAL;
  return kvf__rooms_pop_metadata(r->m->rooms, r->room, token, cands, cap, ncand);
}

void kvf_receiver_destroy(kvf_receiver *r) {
  if (!r) return;
  int st = ROOM_FAILED;
  kvf__rooms_get_status(r->m->rooms, r->room, &st);
  if (!r->final_seen) trace_landed(r, st);
  if (st != ROOM_SUCCESS) { /* a late write must not land in pages the caller takes back now */
    if (st != ROOM_FAILED)
      kvf__rooms_fail(r->m->rooms, r->room, "The decode dropped the request (receiver destroyed)");
    fence_failed(r);
  }
  char reason[KVF_TRACE_REASON_MAX] = "";
  if (kvf__trace_on(&r->tr)) {
    kvf__rooms_get_status(r->m->rooms, r->room, &st);
    kvf__rooms_get_reason(r->m->rooms, r->room, reason, sizeof reason);
  }
  kvf__integ_room_close(r->m, r->room, r->fence_epoch, 0, 1);
  kvf__rooms_clear(r->m->rooms, r->room, NULL);
  kvf__trace_finish(r->m, &r->tr, r->room, st, reason); /* the listener can no longer reach it */
  kvf__dec_pool_unref(r->pool);
  receiver_give(r->m->decode, r);
}

/* The decode's status listener: M3s from prefill ranks (only from a rank
 * the room was planned with, issue 13 defect 5) and completions that ride
 * an engine trailer (docs/WIRE-EXTENSIONS.md). */
#include "kv/decode/decode_int.h"
#include "base/hash.h"

typedef struct m3_origin {
  kvf_manager *m;
  const char *peer;
  int64_t rank;   /* the prefill rank the message names; -1: any */
  int verdict;    /* an M3 Success or Failed: the room's completion_seen step (trace) */
  uint64_t epoch; /* the fence epoch the M3 answers (frame 6); 0: not said */
} m3_origin;

_Atomic(kvf__dec_m3_checked_fn) kvf__dec_m3_checked;

/* from_planned_rank's verdict for an M3 that answers an earlier use of the
 * room id (its fence epoch is not the one the room's last M2s carried). */
#define M3_STALE 2

/* Under the room table's lock: did the message come from a rank the room
 * was planned with? (Issue 13 defect 5: PROTOCOL §8 lets any ZMQ peer end
 * any room.) The rank it names must be one of the room's targets that
 * transfers (not a dummy), on the host the plan has for that rank: one rank
 * cannot answer for another (heterogeneous TP counts one response per rank),
 * nor a rank outside the plan. Nobody may answer before the room's M2s went
 * out (a late M3 of an earlier use of the room id). */
static int from_planned_rank(void *user, void *arg) {
  kvf_receiver *r = user;
  const m3_origin *o = arg;
  const pool_entry *p = r && atomic_load(&r->m2_out) ? (const pool_entry *)atomic_load(&r->pool_tag) : NULL;
  for (int i = 0; p && i < p->ntargets; i++) {
    const pool_target *t = &p->targets[i];
    if (!t->is_dummy && (o->rank < 0 || t->rank == o->rank) && kvf__manager_peer_is(o->m, o->peer, t->ip)) {
      if (o->epoch && o->epoch != atomic_load(&r->m2_epoch)) return M3_STALE;
      if (o->verdict) kvf__trace_now(&r->tr, KVF_TRACE_COMPLETION_SEEN); /* the first verdict */
      return 1;
    }
  }
  return 0;
}

/* Under the room table's lock: did the room's M2s ask for a completion
 * trailer? M3_STALE when the trailer's M3 names another fence epoch: it
 * answers an earlier use of the room id (over UCX write mode a trailer is
 * handed over outside the room's fence, so a late one can meet the next). */
static int asked_fast(void *user, void *arg) {
  const kvf_receiver *r = user;
  const uint64_t *epoch = arg;
  if (!r || !atomic_load(&r->asked_fast)) return 0;
  return *epoch && *epoch != atomic_load(&r->m2_epoch) ? M3_STALE : 1;
}

/* An M3 or trailer that answers an earlier use of the room id: counted
 * with the unknown rooms, logged once. */
static void drop_stale(kvf_manager *m, int64_t room, const char *peer, const char *kind) {
  atomic_fetch_add(&m->stats.messages_unknown_room, 1);
  if (kvf__log_first_time(kvf__hash_str("decode-stale-m3", (uint64_t)(uintptr_t)m)))
    LOG_INFO("kv",
             "room %" PRId64 ": %s from %s answers an earlier use of the room id (fence epoch); dropped "
             "(further ones are counted, not logged)",
             room, kind, peer);
}

/* The engine's trailer callback (a transport thread, after the bytes of the
 * chunk that carried it landed): a room's completion riding behind its
 * data, an encoded M3 (and its MAC with a control token). It counts only for
 * a room whose M2s asked for it, and then takes the M3's path: the MAC, the
 * planned-rank origin check, and one response per prefill rank, so the M3
 * that still follows changes nothing. Anything else is rejected and
 * counted, and never makes a room Success. */
void kvf__dec_on_trailer(void *arg, const unsigned char *data, size_t len, const char *peer) {
  kvf_manager *m = arg;
  wire_frame frames[MANAGER_MAX_RECV_FRAMES];
  size_t n = 0, extra = 0;
  wire_m3 m3;
  char why[WIRE_REASON_LEN] = "";
  if (kvf__trailer_unpack(data, len, frames, MANAGER_MAX_RECV_FRAMES, &n, &extra) ||
      kvf__wire_m3_decode(frames, n - (m->ctl_keylen && n > 1 && !extra ? 1 : 0), &m3, why)) {
    kvf__manager_reject(m, peer, "completion trailer", *why ? why : "malformed");
    return;
  }
  int asked = kvf__rooms_with_user(m->rooms, m3.room, asked_fast, &m3.fence_epoch);
  if (asked == M3_STALE) {
    drop_stale(m, m3.room, peer, "completion trailer");
    return;
  }
  if (asked != 1) {
    kvf__manager_reject_forged(m, peer, "completion trailer", "for a room that did not ask for one (no M2 yet)");
    return;
  }
  atomic_fetch_add(&m->stats.completions_fast, 1);
  kvf__manager_dispatch(m, frames, n, extra, peer);
}

/* The same check for a kvferry digests message. */
static int from_planned(kvf_manager *m, int64_t room, const char *peer, uint64_t *use) {
  m3_origin origin = {m, peer, -1, 0, 0};
  return kvf__rooms_with_user_use(m->rooms, room, from_planned_rank, &origin, use) != 0;
}

void kvf__decode_on_message(kvf_manager *m, const wire_frame *frames, size_t n, const char *peer) {
  wire_m3 m3;
  char why[WIRE_REASON_LEN] = "";
  if (kvf__wire_is_digests(frames, n)) {
    kvf__integ_on_digests(m, frames, n, peer, from_planned);
    return;
  }
  if (kvf__wire_m3_decode(frames, n, &m3, why)) {
    kvf__manager_reject(m, peer, "M3", why);
    return;
  }
  m3_origin origin = {m, peer, m3.prefill_rank,
                      m3.status == WIRE_STATUS_SUCCESS || m3.status == WIRE_STATUS_FAILED, m3.fence_epoch};
  /* What follows acts on the use of the room id checked here only
   * (rooms.h, "Uses"): the caller may end it and start the next meanwhile. */
  uint64_t use = 0;
  int rc = kvf__rooms_with_user_use(m->rooms, m3.room, from_planned_rank, &origin, &use);
  kvf__dec_m3_checked_fn seam = atomic_load(&kvf__dec_m3_checked);
  if (seam) seam(m3.room);
  if (rc == M3_STALE) { /* e.g. a deferred duplicate M3 Success arriving after a re-init */
    drop_stale(m, m3.room, peer, "M3");
    return;
  }
  if (rc < 0) { /* no live room: nothing of what follows may act on a use made after this check */
    atomic_fetch_add(&m->stats.messages_unknown_room, 1);
    return;
  }
  if (rc == 0) {
    kvf__manager_reject_forged(m, peer, "M3",
                               "the sender is not the prefill rank it names, "
                               "or not one this room was planned with and asked");
    return;
  }
  if (m3.status == WIRE_STATUS_SUCCESS) {
    int32_t cands[ROOMS_MAX_CANDS];
    if (m3.candidates.count > ROOMS_MAX_CANDS || m3.prefill_rank >= ROOMS_MAX_RANKS) {
      kvf__manager_reject(m, peer, "M3",
                          m3.candidates.count > ROOMS_MAX_CANDS ? "too many speculative candidates"
                                                                : "prefill rank out of range");
      return;
    }
    for (size_t i = 0; i < m3.candidates.count; i++) cands[i] = wire_i32_at(m3.candidates, i);
    /* The bytes the prefill wrote must be visible before anyone sees Success. */
    kvf_engine_sync(m->engine);
    kvf__integ_on_success(m, m3.room, m3.prefill_rank);
    rc = kvf__rooms_record_response(m->rooms, m3.room, use, (int)m3.prefill_rank, m3.bootstrap_token, cands,
                                    m3.candidates.count, NULL);
  } else if (m3.status == WIRE_STATUS_FAILED && m3.reason_len) {
    /* A kvferry prefill says why (M3 frame 5); keep it printable. */
    char said[WIRE_REASON_LEN], reason[ROOMS_REASON_MAX];
    for (size_t i = 0; i < m3.reason_len; i++)
      said[i] = m3.reason[i] >= 0x20 && m3.reason[i] < 0x7f ? m3.reason[i] : '?';
    said[m3.reason_len] = 0;
    kvf__dec_set_reason(reason, sizeof reason, "Failed to get kvcache from prefill rank %" PRId64 " (%s): %s",
                        m3.prefill_rank, peer, said);
    if (strstr(said, WIRE_REASON_UNREGISTERED)) kvf__dec_forget_registration(m, m3.room);
    rc = kvf__rooms_fail_use(m->rooms, m3.room, use, reason);
  } else if (m3.status == WIRE_STATUS_FAILED) {
    rc = kvf__rooms_fail_use(m->rooms, m3.room, use,
                             "Failed to get kvcache from prefill instance, it might be dead");
  } else {
    rc = kvf__rooms_update(m->rooms, m3.room, m3.status, NULL);
  }
  if (rc == KVF_ENOTFOUND) {
    atomic_fetch_add(&m->stats.messages_unknown_room, 1);
  } else if (rc) {
    kvf__manager_reject(m, peer, "M3", kvf_strerror(rc));
  } else {
    atomic_fetch_add(&m->stats.messages_received, 1);
  }
}

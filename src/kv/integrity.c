/* See integrity.h. */
#include "kv/integrity.h"

#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/hash.h"
#include "base/log.h"
#include "base/parse.h"
#include "engine/async.h"
#include "kvferry/engine.h"

/* A fence close waits for receivers for at most this long. */
#define INTEG_FENCE_CLOSE_MS 2000

typedef struct integ_room {
  uint64_t epoch;
  int verify;
  uint8_t ranks[INTEG_MAX_RANKS / 8]; /* prefill ranks that sent digests */
} integ_room;

/* What landed in one KV page (kvf__integ_on_landed): its digest, and the
 * fence epoch of the chunk that brought it (0: nothing yet). Written by
 * landing threads, read by the listener after the prefill's digests
 * message, which follows the chunk's acknowledgement; a pair torn by two
 * landings at once can only send the page to the full check. */
typedef struct integ_landed {
  _Atomic uint64_t hash, epoch;
} integ_landed;

typedef struct integ_state {
  pthread_mutex_t lock;
  map rooms;        /* room (as u64) -> integ_room */
  spare_list spare; /* integ_room records for the next rooms */
  /* verify mode: landed[landed_off[b] + page] for KV buffer b; NULL when
   * verify mode is off or the buffers are too large (INTEG_LANDED_MAX) */
  integ_landed *landed;
  size_t *landed_off;
} integ_state;

/* Verify mode, a decode: the landed table, one entry per whole KV page. */
static void landed_init(kvf_manager *m, integ_state *s) {
  const manager_buffers *b = &m->bufs;
  if (!m->cfg.verify || m->cfg.role != KVF_ROLE_DECODE ||
      !(s->landed_off = malloc((b->n_kv + 1) * sizeof *s->landed_off)))
    return;
  size_t n = 0;
  for (size_t k = 0; k < b->n_kv; k++) {
    s->landed_off[k] = n;
    n += b->kv_item_lens[k] ? b->kv_lens[k] / b->kv_item_lens[k] : 0;
    if (n > INTEG_LANDED_MAX) break;
  }
  s->landed_off[b->n_kv] = n;
  if (n && n <= INTEG_LANDED_MAX && (s->landed = calloc(n, sizeof *s->landed))) return;
  free(s->landed_off);
  s->landed_off = NULL;
}

_Atomic(kvf__integ_tamper_fn) kvf__integ_tamper;
_Atomic(kvf__integ_source_fn) kvf__integ_source_tamper;

int kvf__integ_start(kvf_manager *m) {
  integ_state *s = calloc(1, sizeof *s);
  if (!s) return KVF_ENOMEM;
  pthread_mutex_init(&s->lock, NULL);
  if (kvf__map_init(&s->rooms)) {
    pthread_mutex_destroy(&s->lock);
    free(s);
    return KVF_ENOMEM;
  }
  landed_init(m, s); /* none: every page is read back when checked, as before */
  m->integ = s;
  return 0;
}

void kvf__integ_stop(kvf_manager *m) {
  integ_state *s = m->integ;
  if (!s) return;
  map_iter it;
  void *v;
  kvf__map_iter_init(&it);
  while (kvf__map_next(&s->rooms, &it, NULL, &v)) free(v);
  kvf__map_free(&s->rooms);
  kvf__spare_free(&s->spare);
  free(s->landed), free(s->landed_off);
  pthread_mutex_destroy(&s->lock);
  free(s);
  m->integ = NULL;
}

void kvf__integ_close_open_fences(kvf_manager *m) {
  integ_state *s = m->integ;
  if (!s) return;
  map_iter it;
  uint64_t room;
  void *v;
  /* Listed under the lock, closed outside it: a close waits for the
   * receivers still inside a fence, whose landing calls take it. */
  pthread_mutex_lock(&s->lock);
  size_t n = 0, cap = kvf__map_size(&s->rooms);
  uint64_t(*open)[2] = cap ? malloc(cap * sizeof *open) : NULL;
  kvf__map_iter_init(&it);
  while (open && kvf__map_next(&s->rooms, &it, &room, &v)) {
    integ_room *x = v;
    if (x->epoch && n < cap) open[n][0] = room, open[n][1] = x->epoch, n++;
  }
  pthread_mutex_unlock(&s->lock);
  for (size_t i = 0; i < n; i++)
    kvf_engine_fence_close(m->engine, manager_room_tag((int64_t)open[i][0]), open[i][1], 1000);
  free(open);
}

/* ------------------------------------------------------------ decode */

void kvf__integ_room_open(kvf_manager *m, int64_t room, int kvferry, uint64_t *flags, uint64_t *epoch) {
  integ_state *s = m->integ;
  uint64_t tag = manager_room_tag(room), e = 0;
  *flags = *epoch = 0;
  if (kvferry && tag && kvf_engine_fence_open(m->engine, tag, &e)) e = 0;
  if (!e && !m->cfg.verify) return;
  int rc = KVF_ENOMEM;
  pthread_mutex_lock(&s->lock);
  integ_room *x = kvf__spare_take(&s->spare, sizeof *x);
  if (x) {
    x->epoch = e;
    x->verify = m->cfg.verify;
    void *old = NULL;
    rc = kvf__map_put(&s->rooms, (uint64_t)room, x, &old);
    kvf__spare_give(&s->spare, rc ? x : old); /* a re-init of the same receiver replaces its entry */
  }
  pthread_mutex_unlock(&s->lock);
  if (rc) {
    if (e) kvf_engine_fence_close(m->engine, tag, e, INTEG_FENCE_CLOSE_MS);
    return;
  }
  *epoch = e;
  *flags = m->cfg.verify && kvferry ? WIRE_ROOM_VERIFY : 0;
}

void kvf__integ_room_close(kvf_manager *m, int64_t room, uint64_t epoch, int failed, int forget) {
  integ_state *s = m->integ;
  if (epoch) {
    /* A room that ended Success: its writers flushed before they said so,
     * so one-sided writers need not confirm (async.h). */
    int st = ROOM_FAILED;
    int done = !failed && !kvf__rooms_get_status(m->rooms, room, &st) && st == ROOM_SUCCESS;
    int rc = done ? kvf__engine_fence_retire(m->engine, manager_room_tag(room), epoch, INTEG_FENCE_CLOSE_MS)
                  : kvf_engine_fence_close(m->engine, manager_room_tag(room), epoch, INTEG_FENCE_CLOSE_MS);
    if (rc == 0 && failed) atomic_fetch_add(&m->stats.rooms_fenced, 1);
    if (rc && rc != KVF_ENOTFOUND)
      LOG_ERROR("kv", "room %" PRId64 ": could not fence late writes: %s", room, kvf_strerror(rc));
  }
  if (!forget) return;
  pthread_mutex_lock(&s->lock);
  integ_room *x = kvf__map_get(&s->rooms, (uint64_t)room);
  if (x && x->epoch == epoch) {
    kvf__map_del(&s->rooms, (uint64_t)room, NULL);
    kvf__spare_give(&s->spare, x);
  }
  pthread_mutex_unlock(&s->lock);
}

void kvf__integ_send_fence(kvf_manager *m, const char *ip, uint16_t port, int64_t room, uint64_t epoch,
                           const char *reason) {
  wire_fence f;
  memset(&f, 0, sizeof f);
  f.room = room;
  f.epoch = epoch;
  kvf__str_copy(f.session, sizeof f.session, kvf_manager_session_id(m));
  kvf__str_copy(f.reason, sizeof f.reason, reason ? reason : "");
  wire_msg msg;
  char why[WIRE_REASON_LEN];
  if (kvf__wire_fence_encode(&f, &msg, why)) {
    LOG_WARN("kv", "room %" PRId64 ": cannot encode the fence notice: %s", room, why);
    return;
  }
  kvf__manager_push_post(m, ip, port, &msg); /* from poll and destroy: never waits on the prefill */
  kvf__wire_msg_free(&msg);
}

/* Which registered buffer holds every piece of a digest entry: 0 with the
 * kind, index and item length, or KVF_ERANGE. */
static int locate(const manager_buffers *b, const wire_digest *d, int *state, size_t *idx, uint64_t *item) {
  uint64_t span;
  if (d->count > 1 &&
      (__builtin_mul_overflow(d->count - 1, d->stride, &span) || __builtin_add_overflow(span, d->len, &span)))
    return KVF_ERANGE;
  if (d->count <= 1) span = d->len;
  for (size_t i = 0; i < b->n_kv + b->n_state; i++) {
    int st = i >= b->n_kv;
    size_t k = st ? i - b->n_kv : i;
    uint64_t base = st ? b->state_ptrs[k] : b->kv_ptrs[k], len = st ? b->state_lens[k] : b->kv_lens[k];
    if (d->dst >= base && d->dst - base <= len && span <= len - (d->dst - base)) {
      *state = st, *idx = k, *item = st ? b->state_item_lens[k] : b->kv_item_lens[k];
      return 0;
    }
  }
  return KVF_ERANGE;
}

int kvf__integ_hashes_landing(const kvf_manager *m) {
  const integ_state *s = m->integ;
  return s && s->landed;
}

void kvf__integ_on_landed(void *arg, uint64_t tag, uint64_t epoch, void *dst, size_t len) {
  kvf_manager *m = arg;
  integ_state *s = m->integ;
  const manager_buffers *b = &m->bufs;
  uint64_t a = (uint64_t)(uintptr_t)dst;
  if (!s || !s->landed || !epoch) return;
  for (size_t k = 0; k < b->n_kv; k++) {
    uint64_t base = b->kv_ptrs[k], blen = b->kv_lens[k], item = b->kv_item_lens[k];
    if (a < base || a - base >= blen || !item) continue;
    uint64_t off = a - base, end = len < blen - off ? off + len : blen; /* offsets in the buffer */
    uint64_t p = (off + item - 1) / item;                               /* the first whole page */
    kvf__integ_tamper_fn tamper = atomic_load(&kvf__integ_tamper);
    if (tamper && (p + 1) * item <= end)
      tamper((int64_t)(tag ^ manager_room_tag(0)), (unsigned char *)(uintptr_t)(base + p * item));
    for (; (p + 1) * item <= end; p++) {
      integ_landed *x = &s->landed[s->landed_off[k] + p];
      atomic_store_explicit(&x->hash, kvf__hash64((const void *)(uintptr_t)(base + p * item), (size_t)item),
                            memory_order_relaxed);
      atomic_store_explicit(&x->epoch, epoch, memory_order_release);
    }
    return;
  }
}

/* Did whole KV page `d` of buffer idx land, in the chunk of this epoch,
 * with the digest the prefill sent? (No: the page itself is checked.) */
static int landed_matches(const integ_state *s, const manager_buffers *b, size_t idx, const wire_digest *d,
                          uint64_t epoch) {
  uint64_t item = b->kv_item_lens[idx], off = d->dst - b->kv_ptrs[idx];
  if (!s->landed || d->count > 1 || d->len != item || !item || off % item) return 0;
  const integ_landed *x = &s->landed[s->landed_off[idx] + off / item];
  return atomic_load_explicit(&x->epoch, memory_order_acquire) == epoch &&
         atomic_load_explicit(&x->hash, memory_order_relaxed) == d->hash;
}

void kvf__integ_on_digests(kvf_manager *m, const wire_frame *frames, size_t n, const char *peer,
                           int (*from_planned)(kvf_manager *m, int64_t room, const char *peer, uint64_t *use)) {
  integ_state *s = m->integ;
  wire_digests dg;
  char why[WIRE_REASON_LEN] = "";
  if (kvf__wire_digests_decode(frames, n, &dg, why)) {
    kvf__manager_reject(m, peer, "digests", why);
    return;
  }
  if (dg.prefill_rank >= INTEG_MAX_RANKS) {
    kvf__manager_reject(m, peer, "digests", "prefill rank out of range");
    return;
  }
  uint64_t use = 0;
  if (!from_planned(m, dg.room, peer, &use)) {
    kvf__manager_reject_forged(m, peer, "digests", "the sender is not a prefill rank this room was planned with");
    return;
  }
  pthread_mutex_lock(&s->lock);
  integ_room *x = kvf__map_get(&s->rooms, (uint64_t)dg.room);
  int known = use && x && x->epoch == dg.epoch, verify = known && x->verify;
  if (known) x->ranks[dg.prefill_rank / 8] |= (uint8_t)(1u << (dg.prefill_rank % 8));
  pthread_mutex_unlock(&s->lock);
  if (!known) {
    atomic_fetch_add(&m->stats.messages_unknown_room, 1);
    return;
  }
  atomic_fetch_add(&m->stats.messages_received, 1);
  if (!verify) return;
  int status = ROOM_FAILED;
  if (kvf__rooms_get_status(m->rooms, dg.room, &status) || status == ROOM_FAILED) return;
  kvf_engine_sync(m->engine); /* the bytes the prefill wrote, before reading them */
  const manager_buffers *b = &m->bufs;
  kvf__integ_tamper_fn tamper = atomic_load(&kvf__integ_tamper);
  for (size_t i = 0; i < dg.entries.count; i++) {
    wire_digest d = wire_digest_at(dg.entries, i);
    int st = 0;
    size_t idx = 0;
    uint64_t item = 1;
    char reason[ROOMS_REASON_MAX];
    if (locate(b, &d, &st, &idx, &item)) {
      snprintf(reason, sizeof reason,
               "Integrity check failed: prefill rank %" PRId64 " sent a digest for 0x%" PRIx64 "+%" PRIu64
               ", outside this decode's buffers",
               dg.prefill_rank, d.dst, d.len);
    } else {
      if (tamper && i == 0) tamper(dg.room, (unsigned char *)(uintptr_t)d.dst);
      if (!st && landed_matches(s, b, idx, &d, dg.epoch)) continue; /* hashed as it landed */
      if (kvf__hash_block(d.dst, d.len, d.count, d.stride) == d.hash) continue;
      uint64_t off = d.dst - (st ? b->state_ptrs[idx] : b->kv_ptrs[idx]);
      snprintf(reason, sizeof reason,
               "Integrity check failed: %s buffer %zu page %" PRIu64 " (offset %" PRIu64 ", %" PRIu64
               " bytes from prefill rank %" PRId64 ") differs from what the prefill sent",
               st ? "state" : "KV", idx, item ? off / item : 0, off % (item ? item : 1), d.len * d.count,
               dg.prefill_rank);
    }
    LOG_WARN("kv", "room %" PRId64 ": %s", dg.room, reason);
    if (kvf__rooms_fail_use(m->rooms, dg.room, use, reason) == 0) atomic_fetch_add(&m->stats.verify_failures, 1);
    return;
  }
}

void kvf__integ_on_refused(void *arg, uint64_t tag, uint64_t epoch, int err, const char *peer) {
  kvf_manager *m = arg;
  integ_state *s = m->integ;
  int64_t room = (int64_t)(tag ^ manager_room_tag(0));
  /* The room's use first, then the epoch: the use a repeated init starts
   * comes after its new epoch (receiver.c), so a refusal for the earlier
   * epoch fails at most the earlier use (rooms.h, "Uses"). */
  uint64_t use = 0;
  kvf__rooms_get_use(m->rooms, room, &use);
  pthread_mutex_lock(&s->lock);
  integ_room *x = kvf__map_get(&s->rooms, (uint64_t)room);
  int known = use && x && x->epoch == epoch;
  pthread_mutex_unlock(&s->lock);
  if (!known) return;
  char reason[ROOMS_REASON_MAX];
  snprintf(reason, sizeof reason,
           "Prefill engine %s sent a chunk for this room outside its pages or this decode's registered memory "
           "(%s); "
           "refused, nothing of it landed",
           peer, kvf_strerror(err));
  if (kvf__rooms_fail_use(m->rooms, room, use, reason) == 0) {
    atomic_fetch_add(&m->stats.messages_forged, 1);
    if (kvf__log_first_time_for_host(peer, "kv-refused-chunk"))
      LOG_WARN("kv", "room %" PRId64 ": %s (further ones from this host are not logged)", room, reason);
  }
}

void kvf__integ_on_success(kvf_manager *m, int64_t room, int64_t rank) {
  integ_state *s = m->integ;
  if (rank < 0 || rank >= INTEG_MAX_RANKS) return;
  pthread_mutex_lock(&s->lock);
  integ_room *x = kvf__map_get(&s->rooms, (uint64_t)room);
  int unverified = x && x->verify && !(x->ranks[rank / 8] & (1u << (rank % 8)));
  pthread_mutex_unlock(&s->lock);
  if (!unverified) return;
  atomic_fetch_add(&m->stats.verify_unverified, 1);
  if (kvf__log_first_time(kvf__hash_str("verify-unverified", (uint64_t)(uintptr_t)m)))
    LOG_WARN("kv",
             "room %" PRId64 ": prefill rank %" PRId64 " reported Success without digests (not a kvferry "
             "prefill?): the room is not verified (counted in verify_unverified; further ones are not logged)",
             room, rank);
}

/* ------------------------------------------------------------ prefill */

int kvf__integ_layer_bufs(const kvf_manager *m, size_t l0, size_t l1, size_t **bufs, size_t *nb) {
  const manager_buffers *b = &m->bufs;
  size_t k = 0, cnt = b->layer_buf_start[l1] - b->layer_buf_start[l0];
  size_t *v = malloc((cnt ? cnt : 1) * sizeof *v);
  if (!v) return KVF_ENOMEM;
  for (size_t j = b->layer_buf_start[l0]; j < b->layer_buf_start[l1]; j++) v[k++] = b->layer_bufs[j];
  *bufs = v;
  *nb = k;
  return 0;
}

int kvf__integ_page_in_buffer(const kvf_manager *m, size_t b, int64_t page) {
  uint64_t end;
  return page >= 0 && !__builtin_mul_overflow((uint64_t)page + 1, m->bufs.kv_item_lens[b], &end) &&
         end <= m->bufs.kv_lens[b];
}

int kvf__integ_page_digest(const kvf_manager *m, size_t b, int64_t page, uint64_t *out) {
  const manager_buffers *mb = &m->bufs;
  uint64_t item = mb->kv_item_lens[b];
  if (!kvf__integ_page_in_buffer(m, b, page)) return KVF_ERANGE;
  *out = kvf__hash64((const void *)(uintptr_t)(mb->kv_ptrs[b] + (uint64_t)page * item), (size_t)item);
  return 0;
}

void kvf__integ_source_hashed(const kvf_manager *m, int64_t room, size_t b, int64_t page) {
  kvf__integ_source_fn fn = atomic_load(&kvf__integ_source_tamper);
  uint64_t item = m->bufs.kv_item_lens[b];
  if (fn) fn(room, (unsigned char *)(uintptr_t)(m->bufs.kv_ptrs[b] + (uint64_t)page * item), (size_t)item);
}

int kvf__integ_send_digests(kvf_manager *m, const char *host, uint16_t port, int64_t room, uint64_t epoch,
                            const wire_digest *d, size_t n) {
  size_t off = 0;
  int rc = 0;
  do {
    size_t k = n - off < WIRE_MAX_DIGESTS ? n - off : WIRE_MAX_DIGESTS;
    wire_digests dg = {.room = room,
                       .prefill_rank = m->tp_rank,
                       .epoch = epoch,
                       .entries = wire_array_of(d + off, k)};
    wire_msg msg;
    char why[WIRE_REASON_LEN];
    if ((rc = kvf__wire_digests_encode(&dg, &msg, why))) break;
    rc = kvf__manager_push_send(m, host, port, &msg);
    kvf__wire_msg_free(&msg);
    off += k;
  } while (!rc && off < n);
  return rc;
}

/* The per-manager room table (see rooms.h for the early state and the lock
 * discipline): a hash map from room id to a small heap record, behind one
 * leaf mutex. The record is kept small because a
 * busy decode holds many rooms: responders below 64 live in one inline word
 * and only larger ranks allocate a bitmap; candidate arrays and reasons are
 * allocated only when present. The status rule and the Success bookkeeping
 * follow the reference decode listener (PROTOCOL §2.2, §3.5) except that no
 * message ever creates a room. */
#include "kv/rooms.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "base/map.h"

#define HI_WORDS ((ROOMS_MAX_RANKS - 64) / 64)

typedef struct room_entry {
  int early; /* an early room: only `user` is meaningful, not live */
  /* Written under t->mu; also read without it through
   * kvf__rooms_status_cell, so atomic. */
  atomic_int status;
  int required; /* 0 = never set, which means 1 */
  int nresponded;
  uint64_t resp_lo;      /* responder bits for ranks 0..63 */
  uint64_t *resp_hi;     /* ranks 64..ROOMS_MAX_RANKS-1, allocated on first use */
  int64_t pending_token; /* -1 = none */
  int64_t final_token;   /* -1 = none */
  /* candidates held in the entry (no allocation per room; entries are
   * recycled): the first responder's, then the published ones */
  size_t npending_cands; /* 0 = none */
  size_t nfinal_cands;
  int32_t pending_cands[ROOMS_MAX_CANDS];
  int32_t final_cands[ROOMS_MAX_CANDS];
  int published; /* prefill: kvf__rooms_publish_metadata stored final_* */
  char *reason;
  void *user;
  uint64_t use; /* this use of the room id (rooms.h, "Uses") */
  struct room_entry *next_spare;
} room_entry;

/* Cleared entries kept, zeroed, for the next rooms (no allocation per room
 * once the table has seen its working set). */
#define ROOMS_SPARE_MAX 4096

struct rooms {
  pthread_mutex_t mu;
  map m;
  size_t max_rooms;
  size_t nearly; /* early entries in m */
  rooms_stats st;
  room_entry *spare;
  size_t nspare;
  atomic_int efd;        /* kvf__rooms_event_fd's eventfd; -1 until asked for */
  atomic_int signaled;   /* efd written and not drained since (set and cleared under ev_mu) */
  pthread_mutex_t ev_mu; /* pairs each efd write with its drain; never taken with mu held */
  uint64_t uses;         /* the last use stamp given */
};

/* A room changed (its status is stored): wake whoever sleeps on the event
 * fd, with one write until the next kvf__rooms_event_clear. Called once
 * t->mu is let go: the write wakes a thread, and with the table's lock held
 * every other user of the table (the listener, the transfer threads, the
 * scheduler's calls) waited for that wake-up.
 *
 * No change is missed: the fence below pairs with kvf__rooms_event_clear's
 * (seq_cst fences, as in Dekker's algorithm): either this sees the clear's
 * `signaled` = 0 and writes, or the polls that follow the clear see this
 * change's status. */
static void signal_change(rooms *t) {
  int fd = atomic_load_explicit(&t->efd, memory_order_relaxed);
  if (fd < 0) return;
  atomic_thread_fence(memory_order_seq_cst);
  if (atomic_load_explicit(&t->signaled, memory_order_relaxed)) return; /* a write is pending */
  pthread_mutex_lock(&t->ev_mu);
  if (!atomic_load_explicit(&t->signaled, memory_order_relaxed)) {
    atomic_store_explicit(&t->signaled, 1, memory_order_relaxed);
    uint64_t one = 1;
    if (write(fd, &one, sizeof one) < 0) /* cannot fail short of a bug: the next change retries */
      atomic_store_explicit(&t->signaled, 0, memory_order_relaxed);
  }
  pthread_mutex_unlock(&t->ev_mu);
}

static int status_valid(int s) { return s >= ROOM_FAILED && s <= ROOM_STATUS_MAX; }

/* §2.2 rules 2 and 3. */
static int merge_status(int cur, int s) {
  if (cur == ROOM_FAILED || s == ROOM_FAILED) return ROOM_FAILED;
  return cur > s ? cur : s;
}

static void entry_free(room_entry *e) {
  free(e->resp_hi);
  free(e->reason);
  free(e);
}

int kvf__rooms_table_new(size_t max_rooms, rooms **out) {
  int rc = KVF_ENOMEM;
  rooms *t = calloc(1, sizeof *t);
  if (!t) goto err;
  if (kvf__map_init(&t->m) != 0) goto err_free_table;
  if (pthread_mutex_init(&t->mu, NULL) != 0) goto err_free_map;
  if (pthread_mutex_init(&t->ev_mu, NULL) != 0) {
    pthread_mutex_destroy(&t->mu);
    goto err_free_map;
  }
  atomic_init(&t->efd, -1);
  atomic_init(&t->signaled, 0);
  t->max_rooms = max_rooms ? max_rooms : ROOMS_DEFAULT_MAX;
  *out = t;
  return 0;
err_free_map:
  kvf__map_free(&t->m);
err_free_table:
  free(t);
err:
  return rc;
}

void kvf__rooms_table_free(rooms *t, void (*free_user)(void *)) {
  if (!t) return;
  map_iter it;
  kvf__map_iter_init(&it);
  void *v;
  while (kvf__map_next(&t->m, &it, NULL, &v)) {
    room_entry *e = v;
    if (free_user && e->user) free_user(e->user);
    entry_free(e);
  }
  while (t->spare) {
    room_entry *e = t->spare;
    t->spare = e->next_spare;
    free(e);
  }
  kvf__map_free(&t->m);
  pthread_mutex_destroy(&t->mu);
  pthread_mutex_destroy(&t->ev_mu);
  if (atomic_load(&t->efd) >= 0) close(atomic_load(&t->efd));
  free(t);
}

/* A live room (early ones read as absent), or any room. */
static room_entry *find_any(rooms *t, int64_t room) { return kvf__map_get(&t->m, (uint64_t)room); }
static room_entry *find(rooms *t, int64_t room) {
  room_entry *e = find_any(t, room);
  return e && !e->early ? e : NULL;
}
/* The live room in its use `use` (any use when 0): another use reads as
 * absent. */
static room_entry *find_use(rooms *t, int64_t room, uint64_t use) {
  room_entry *e = find(t, room);
  return e && (!use || e->use == use) ? e : NULL;
}

static size_t nlive(rooms *t) { return kvf__map_size(&t->m) - t->nearly; }

/* Caller holds the lock and has checked that the room is absent. A live
 * room (early 0) is subject to the bound and counted as created. */
static int insert(rooms *t, int64_t room, int status, int early, void *user) {
  if (!early && nlive(t) >= t->max_rooms) {
    t->st.rejected_full++;
    return KVF_ENOMEM;
  }
  room_entry *e = t->spare;
  if (e) {
    t->spare = e->next_spare, t->nspare--;
    e->next_spare = NULL;
  } else if (!(e = calloc(1, sizeof *e))) {
    return KVF_ENOMEM;
  }
  e->early = early;
  e->status = status;
  e->pending_token = -1;
  e->final_token = -1;
  e->use = ++t->uses;
  e->user = user;
  int rc = kvf__map_put(&t->m, (uint64_t)room, e, NULL);
  if (rc != 0) {
    free(e); /* zeroed but for the fields above: nothing else to free */
    return rc;
  }
  if (early) t->nearly++;
  else t->st.created++;
  return 0;
}

int kvf__rooms_create(rooms *t, int64_t room, int status) {
  if (!status_valid(status)) return KVF_EINVAL;
  int rc = 0;
  pthread_mutex_lock(&t->mu);
  room_entry *e = find_any(t, room);
  if (!e) {
    rc = insert(t, room, status, 0, NULL);
  } else if (!e->early) {
    rc = KVF_EEXIST;
  } else if (nlive(t) >= t->max_rooms) {
    t->st.rejected_full++;
    rc = KVF_ENOMEM;
  } else { /* the early room becomes live, with its user pointer */
    e->early = 0;
    e->status = status;
    e->use = ++t->uses;
    t->nearly--;
    t->st.created++;
  }
  pthread_mutex_unlock(&t->mu);
  return rc;
}

int kvf__rooms_add_early(rooms *t, int64_t room, void *user) {
  pthread_mutex_lock(&t->mu);
  int rc = find_any(t, room) ? KVF_EEXIST : insert(t, room, ROOM_BOOTSTRAPPING, 1, user);
  pthread_mutex_unlock(&t->mu);
  return rc;
}

int kvf__rooms_update(rooms *t, int64_t room, int status, int *new_status) {
  int rc = 0, now = 0, changed = 0;
  pthread_mutex_lock(&t->mu);
  room_entry *e = find(t, room);
  if (!status_valid(status)) {
    t->st.rejected_invalid++;
    rc = KVF_EINVAL;
  } else if (!e) {
    t->st.dropped_unknown++;
    rc = KVF_ENOTFOUND;
  } else {
    now = merge_status(e->status, status);
    changed = now != e->status;
    e->status = now;
  }
  pthread_mutex_unlock(&t->mu);
  if (changed) signal_change(t);
  if (rc == 0 && new_status) *new_status = now;
  return rc;
}

const atomic_int *kvf__rooms_status_cell(rooms *t, int64_t room) {
  pthread_mutex_lock(&t->mu);
  room_entry *e = find(t, room);
  pthread_mutex_unlock(&t->mu);
  return e ? &e->status : NULL;
}

int kvf__rooms_get_status(rooms *t, int64_t room, int *status) {
  int rc = KVF_ENOTFOUND, s = 0;
  pthread_mutex_lock(&t->mu);
  room_entry *e = find(t, room);
  if (e) {
    s = e->status;
    rc = 0;
  }
  pthread_mutex_unlock(&t->mu);
  if (rc == 0) *status = s;
  return rc;
}

static void fill_info(const room_entry *e, rooms_info *out) {
  out->status = e->status;
  out->required = e->required ? e->required : 1;
  out->responded = e->nresponded;
  out->has_reason = e->reason != NULL;
  out->has_token = e->final_token != -1;
  out->user = e->user;
}

int kvf__rooms_get_info(rooms *t, int64_t room, rooms_info *out) {
  int rc = KVF_ENOTFOUND;
  rooms_info info;
  pthread_mutex_lock(&t->mu);
  room_entry *e = find(t, room);
  if (e) {
    fill_info(e, &info);
    rc = 0;
  }
  pthread_mutex_unlock(&t->mu);
  if (rc == 0) *out = info;
  return rc;
}

/* Copy of reason bounded by ROOMS_REASON_MAX; made outside the lock. */
static char *reason_dup(const char *reason) {
  if (!reason) reason = "";
  size_t n = strnlen(reason, ROOMS_REASON_MAX - 1);
  char *r = malloc(n + 1);
  if (!r) return NULL;
  memcpy(r, reason, n);
  r[n] = '\0';
  return r;
}

/* Caller holds the lock; takes ownership of r. Failed is final and its
 * first reason stays: a later one (the prefill's failed M3 for a room the
 * decode already failed and fenced) is a consequence, not the cause. 1 when
 * the status changed (the caller signals it once the lock is let go). */
static int fail_entry(room_entry *e, char *r) {
  int changed = e->status != ROOM_FAILED;
  if (e->status == ROOM_FAILED && e->reason && *e->reason) {
    free(r);
    return changed;
  }
  free(e->reason);
  e->reason = r;
  e->status = ROOM_FAILED;
  return changed;
}

/* kvf__rooms_fail and kvf__rooms_fail_unless_success. */
static int fail_room(rooms *t, int64_t room, uint64_t use, const char *reason, int spare_success, int *failed) {
  char *r = reason_dup(reason);
  int rc = 0, did = 0, changed = 0;
  pthread_mutex_lock(&t->mu);
  room_entry *e = find_use(t, room, use);
  if (!e) {
    t->st.dropped_unknown++;
    rc = KVF_ENOTFOUND;
  } else if (!spare_success || e->status != ROOM_SUCCESS) {
    /* Without memory for the text the room still fails: the status is what
     * stops a hang; the reason is a courtesy. */
    changed = fail_entry(e, r);
    r = NULL;
    did = 1;
  }
  pthread_mutex_unlock(&t->mu);
  if (changed) signal_change(t);
  free(r);
  if (failed) *failed = did;
  return rc;
}

int kvf__rooms_fail(rooms *t, int64_t room, const char *reason) { return fail_room(t, room, 0, reason, 0, NULL); }

int kvf__rooms_fail_use(rooms *t, int64_t room, uint64_t use, const char *reason) {
  return fail_room(t, room, use, reason, 0, NULL);
}

int kvf__rooms_fail_unless_success(rooms *t, int64_t room, const char *reason, int *failed) {
  return fail_room(t, room, 0, reason, 1, failed);
}

int kvf__rooms_reset_responses(rooms *t, int64_t room, int status) {
  if (!status_valid(status)) return KVF_EINVAL;
  int rc = 0, changed = 0;
  pthread_mutex_lock(&t->mu);
  room_entry *e = find(t, room);
  if (!e) {
    rc = KVF_ENOTFOUND;
  } else {
    e->nresponded = 0;
    e->resp_lo = 0;
    if (e->resp_hi) memset(e->resp_hi, 0, HI_WORDS * sizeof *e->resp_hi);
    e->pending_token = e->final_token = -1;
    e->npending_cands = e->nfinal_cands = 0;
    e->use = ++t->uses;
    if (e->status != ROOM_FAILED && e->status != status) {
      e->status = status;
      changed = 1;
    }
  }
  pthread_mutex_unlock(&t->mu);
  if (changed) signal_change(t);
  return rc;
}

int kvf__rooms_get_reason(rooms *t, int64_t room, char *buf, size_t cap) {
  if (cap == 0) return KVF_EINVAL;
  int rc = KVF_ENOTFOUND;
  pthread_mutex_lock(&t->mu);
  room_entry *e = find(t, room);
  if (e) {
    const char *r = e->reason ? e->reason : "";
    size_t n = strnlen(r, cap - 1);
    memcpy(buf, r, n);
    buf[n] = '\0';
    rc = 0;
  }
  pthread_mutex_unlock(&t->mu);
  return rc;
}

int kvf__rooms_set_required(rooms *t, int64_t room, int required) {
  if (required < 1 || required > ROOMS_MAX_RANKS) return KVF_EINVAL;
  int rc = KVF_ENOTFOUND;
  pthread_mutex_lock(&t->mu);
  room_entry *e = find(t, room);
  if (e) {
    e->required = required;
    rc = 0;
  }
  pthread_mutex_unlock(&t->mu);
  return rc;
}

/* Adds rank to the responder set. Returns 1 if it was new, 0 if already
 * there, KVF_ENOMEM if the high bitmap could not be allocated. */
static int add_responder(room_entry *e, int rank) {
  uint64_t *word;
  int bit;
  if (rank < 64) {
    word = &e->resp_lo;
    bit = rank;
  } else {
    if (!e->resp_hi && !(e->resp_hi = calloc(HI_WORDS, sizeof *e->resp_hi))) return KVF_ENOMEM;
    word = &e->resp_hi[(rank - 64) / 64];
    bit = (rank - 64) % 64;
  }
  uint64_t m = 1ULL << bit;
  if (*word & m) return 0;
  *word |= m;
  e->nresponded++;
  return 1;
}

int kvf__rooms_record_response(rooms *t, int64_t room, uint64_t use, int prefill_rank, int64_t token,
                               const int32_t *cands, size_t ncand, int *became_success) {
  int rc = 0, became = 0;
  if (ncand > ROOMS_MAX_CANDS || prefill_rank < 0 || prefill_rank >= ROOMS_MAX_RANKS || (ncand && !cands)) {
    pthread_mutex_lock(&t->mu);
    t->st.rejected_invalid++;
    pthread_mutex_unlock(&t->mu);
    return ncand > ROOMS_MAX_CANDS ? KVF_ETOOBIG : KVF_EINVAL;
  }
  pthread_mutex_lock(&t->mu);
  room_entry *e = find_use(t, room, use);
  if (!e) {
    t->st.dropped_unknown++;
    rc = KVF_ENOTFOUND;
    goto out_unlock;
  }
  int added = add_responder(e, prefill_rank);
  if (added < 0) {
    rc = added;
    goto out_unlock;
  }
  if (added == 0) {
    t->st.duplicate_responses++;
    /* The same rank again after Success (a completion trailer's M3 also
     * comes by ZeroMQ): nothing changes, a popped first token stays popped. */
    if (e->status == ROOM_SUCCESS) goto out_unlock;
  }
  if (token != -1 && e->pending_token == -1) e->pending_token = token;
  if (ncand && !e->npending_cands) { /* the first responder's candidates */
    memcpy(e->pending_cands, cands, ncand * sizeof *cands);
    e->npending_cands = ncand;
  }
  int expected = e->required ? e->required : 1;
  if (e->nresponded < expected) goto out_unlock;
  /* Publish before Success. (The reference publishes again on a repeated
   * report after Success; here that changes nothing, see above.) */
  if (e->pending_token != -1) {
    e->final_token = e->pending_token;
    e->pending_token = -1;
  }
  if (e->npending_cands) {
    memcpy(e->final_cands, e->pending_cands, e->npending_cands * sizeof *e->final_cands);
    e->nfinal_cands = e->npending_cands;
    e->npending_cands = 0;
  }
  int before = e->status;
  e->status = merge_status(e->status, ROOM_SUCCESS);
  became = before != ROOM_SUCCESS && e->status == ROOM_SUCCESS;
out_unlock:
  pthread_mutex_unlock(&t->mu);
  if (became) signal_change(t);
  if (rc == 0 && became_success) *became_success = became;
  return rc;
}

int kvf__rooms_pop_metadata(rooms *t, int64_t room, int64_t *token, int32_t *cands, size_t cap, size_t *ncand) {
  int rc = KVF_ENOTFOUND;
  int64_t tok = -1;
  size_t n = 0;
  pthread_mutex_lock(&t->mu);
  room_entry *e = find(t, room);
  if (!e) goto out_unlock;
  if (e->nfinal_cands > cap || (e->nfinal_cands && !cands)) {
    rc = KVF_ETOOBIG;
    goto out_unlock;
  }
  tok = e->final_token;
  e->final_token = -1;
  n = e->nfinal_cands;
  if (n) memcpy(cands, e->final_cands, n * sizeof *cands);
  e->nfinal_cands = 0;
  rc = 0;
out_unlock:
  pthread_mutex_unlock(&t->mu);
  if (rc == 0) {
    *token = tok;
    *ncand = n;
  }
  return rc;
}

int kvf__rooms_publish_metadata(rooms *t, int64_t room, int64_t token, const int32_t *cands, size_t ncand) {
  if (ncand > ROOMS_MAX_CANDS || (ncand && !cands)) return ncand > ROOMS_MAX_CANDS ? KVF_ETOOBIG : KVF_EINVAL;
  int rc = 0;
  pthread_mutex_lock(&t->mu);
  room_entry *e = find(t, room);
  if (!e) {
    rc = KVF_ENOTFOUND;
  } else if (e->published) {
    rc = KVF_EEXIST;
  } else {
    e->published = 1;
    e->final_token = token;
    if (ncand) memcpy(e->final_cands, cands, ncand * sizeof *cands);
    e->nfinal_cands = ncand;
  }
  pthread_mutex_unlock(&t->mu);
  return rc;
}

int kvf__rooms_get_metadata(rooms *t, int64_t room, int64_t *token, int32_t *cands, size_t cap, size_t *ncand) {
  int rc = 0;
  pthread_mutex_lock(&t->mu);
  room_entry *e = find(t, room);
  if (!e) {
    rc = KVF_ENOTFOUND;
  } else if (!e->published) {
    rc = KVF_EAGAIN;
  } else if (e->nfinal_cands > cap || (e->nfinal_cands && !cands)) {
    rc = KVF_ETOOBIG;
  } else {
    *token = e->final_token;
    *ncand = e->nfinal_cands;
    if (e->nfinal_cands) memcpy(cands, e->final_cands, e->nfinal_cands * sizeof *cands);
  }
  pthread_mutex_unlock(&t->mu);
  return rc;
}

/* Run fn on the room's entry (any: early ones too) under the lock; 0, or
 * KVF_ENOTFOUND without running it. */
static int with_entry(rooms *t, int64_t room, int any, void (*fn)(room_entry *e, void *arg), void *arg) {
  pthread_mutex_lock(&t->mu);
  room_entry *e = any ? find_any(t, room) : find(t, room);
  if (e) fn(e, arg);
  pthread_mutex_unlock(&t->mu);
  return e ? 0 : KVF_ENOTFOUND;
}

static void put_user(room_entry *e, void *arg) { e->user = arg; }
static void take_user(room_entry *e, void *arg) { *(void **)arg = e->user; }
static void take_use(room_entry *e, void *arg) { *(uint64_t *)arg = e->use; }

int kvf__rooms_get_use(rooms *t, int64_t room, uint64_t *use) { return with_entry(t, room, 0, take_use, use); }

int kvf__rooms_set_user(rooms *t, int64_t room, void *user) { return with_entry(t, room, 1, put_user, user); }

int kvf__rooms_get_user(rooms *t, int64_t room, void **user) { return with_entry(t, room, 1, take_user, user); }

int kvf__rooms_with_user_use(rooms *t, int64_t room, int (*pred)(void *user, void *arg), void *arg,
                             uint64_t *use) {
  int rc = KVF_ENOTFOUND;
  pthread_mutex_lock(&t->mu);
  room_entry *e = find(t, room);
  if (e) {
    rc = pred(e->user, arg);
    if (use) *use = e->use;
  }
  pthread_mutex_unlock(&t->mu);
  return rc;
}

int kvf__rooms_with_user(rooms *t, int64_t room, int (*pred)(void *user, void *arg), void *arg) {
  return kvf__rooms_with_user_use(t, room, pred, arg, NULL);
}

int kvf__rooms_clear(rooms *t, int64_t room, void **user) {
  void *v = NULL;
  room_entry held = {0};
  pthread_mutex_lock(&t->mu);
  int found = kvf__map_del(&t->m, (uint64_t)room, &v);
  room_entry *e = v;
  if (found) {
    if (e->early) t->nearly--, t->st.early_dropped++;
    else t->st.cleared++;
    held = *e;
    if (t->nspare < ROOMS_SPARE_MAX) { /* kept zeroed for the next room */
      memset(e, 0, sizeof *e);
      e->next_spare = t->spare;
      t->spare = e;
      t->nspare++;
      e = NULL;
    }
  }
  pthread_mutex_unlock(&t->mu);
  if (!found) return KVF_ENOTFOUND;
  if (user) *user = held.user;
  /* outside the lock: what the entry held is unreachable now */
  free(held.resp_hi), free(held.reason);
  free(e);
  return 0;
}

void kvf__rooms_clear_all(rooms *t, void (*release)(void *user, void *arg), void *arg) {
  map_iter it;
  kvf__map_iter_init(&it);
  uint64_t key;
  void *v;
  pthread_mutex_lock(&t->mu);
  while (kvf__map_next(&t->m, &it, &key, &v)) {
    room_entry *e = v;
    if (e->early) t->st.early_dropped++;
    else t->st.cleared++;
    if (release && e->user) release(e->user, arg);
    kvf__map_del(&t->m, key, NULL); /* the iteration tolerates it */
    entry_free(e);
  }
  t->nearly = 0;
  pthread_mutex_unlock(&t->mu);
}

void kvf__rooms_get_stats(rooms *t, rooms_stats *out) {
  pthread_mutex_lock(&t->mu);
  rooms_stats s = t->st;
  s.live = nlive(t);
  s.early = t->nearly;
  pthread_mutex_unlock(&t->mu);
  *out = s;
}

int kvf__rooms_fail_matching(rooms *t, int (*pred)(int64_t room, void *user, void *arg), void *arg,
                             const char *reason, size_t *nfailed) {
  size_t n = 0;
  int changed = 0;
  map_iter it;
  kvf__map_iter_init(&it);
  uint64_t key;
  void *v;
  pthread_mutex_lock(&t->mu);
  while (kvf__map_next(&t->m, &it, &key, &v)) {
    room_entry *e = v;
    if (e->early || e->status == ROOM_SUCCESS || !pred((int64_t)key, e->user, arg)) continue;
    /* One copy per room, because each room owns its reason; a failed copy
     * still fails the room (see kvf__rooms_fail). */
    changed |= fail_entry(e, reason_dup(reason));
    n++;
  }
  pthread_mutex_unlock(&t->mu);
  if (changed) signal_change(t);
  if (nfailed) *nfailed = n;
  return 0;
}

int kvf__rooms_event_fd(rooms *t) {
  pthread_mutex_lock(&t->mu);
  int fd = atomic_load(&t->efd);
  if (fd < 0) {
    fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (fd >= 0) atomic_store(&t->efd, fd);
  }
  pthread_mutex_unlock(&t->mu);
  return fd >= 0 ? fd : KVF_ENOMEM;
}

void kvf__rooms_event_clear(rooms *t) {
  int fd = atomic_load_explicit(&t->efd, memory_order_relaxed);
  if (fd < 0) return;
  if (atomic_load_explicit(&t->signaled, memory_order_relaxed)) {
    pthread_mutex_lock(&t->ev_mu); /* a write under way is done before its drain */
    if (atomic_load_explicit(&t->signaled, memory_order_relaxed)) {
      uint64_t v;
      if (read(fd, &v, sizeof v) < 0) { /* EAGAIN: nothing was pending */
      }
      atomic_store_explicit(&t->signaled, 0, memory_order_relaxed);
    }
    pthread_mutex_unlock(&t->ev_mu);
  }
  atomic_thread_fence(memory_order_seq_cst); /* signal_change's pair: before the caller's polls */
}

void kvf__rooms_notify(rooms *t) { signal_change(t); }

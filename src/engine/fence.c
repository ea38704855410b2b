/* Target-side fences of the transfer engine (issue 16). A tagged batch
 * names a (tag, epoch) pair that the target opened with kvf_engine_fence_open;
 * its chunks are admitted only while that pair is open. Closing a pair
 * refuses every later chunk before any of its bytes is written, and waits
 * for the chunks already admitted to stop writing: a receiver checks the
 * cut flag at every receive tick (the TCP transport's 100 ms),
 * stops writing into the destination and drains the rest. So once
 * kvf_engine_fence_close returned, no byte of a batch with that pair lands.
 *
 * The table is keyed by epoch (unique in the process: a random 32-bit start
 * in the high half, then a counter), holds only open pairs and pairs whose
 * last admitted chunk has not left yet, and is bounded by
 * ENGINE_MAX_FENCES. One mutex guards it; nothing blocks under it except the
 * closer's condition wait.
 *
 * A one-sided transport (UCX: the writer puts into this engine's memory
 * without its CPU) cannot refuse a chunk: close then also runs the
 * transport's fence_close hook, which tells every connected writer and
 * waits for each to confirm (ucx.c), and a writer learns which pairs are
 * open from kvf__fence_snapshot. */
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/log.h"
#include "engine/engine_internal.h"

#define ENGINE_MAX_FENCES (1u << 20)

static atomic_ullong next_epoch;
static pthread_once_t epoch_once = PTHREAD_ONCE_INIT;

/* A random start in the high half, so a restarted process never reuses an
 * epoch a peer may still hold. */
static void epoch_seed(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  uint64_t seed =
      ((uint64_t)ts.tv_nsec * 0x9e3779b97f4a7c15ull) ^ ((uint64_t)getpid() << 17) ^ (uint64_t)ts.tv_sec;
  atomic_store(&next_epoch, (seed & 0x7fffffff00000000ull) | 1);
}

int kvf__fence_init(engine_fences *f) {
  memset(f, 0, sizeof *f);
  pthread_mutex_init(&f->lock, NULL);
  clock_cond_init(&f->cv);
  return kvf__map_init(&f->open);
}

void kvf__fence_destroy(engine_fences *f) {
  map_iter it;
  void *v;
  kvf__map_iter_init(&it);
  while (kvf__map_next(&f->open, &it, NULL, &v)) free(v);
  kvf__map_free(&f->open);
  kvf__spare_free(&f->spare);
  pthread_cond_destroy(&f->cv);
  pthread_mutex_destroy(&f->lock);
}

static uint64_t epoch_new(void) {
  pthread_once(&epoch_once, epoch_seed);
  uint64_t e;
  while ((e = atomic_fetch_add(&next_epoch, 1)) == 0) {
  }
  return e;
}

int kvf_engine_fence_open(kvf_engine *e, uint64_t tag, uint64_t *epoch) {
  if (!e || !tag || !epoch) return KVF_EINVAL;
  int rc = 0;
  pthread_mutex_lock(&e->fences.lock);
  engine_fence *x = kvf__spare_take(&e->fences.spare, sizeof *x);
  if (x) {
    x->tag = tag;
    /* Under the lock: a snapshot (kvf__fence_snapshot) sees every epoch
     * below its `next` either open in the table or closed. */
    x->epoch = epoch_new();
    if (kvf__map_size(&e->fences.open) >= ENGINE_MAX_FENCES) rc = KVF_ENOMEM;
    else rc = kvf__map_put(&e->fences.open, x->epoch, x, NULL);
    if (rc) kvf__spare_give(&e->fences.spare, x);
  } else {
    rc = KVF_ENOMEM;
  }
  pthread_mutex_unlock(&e->fences.lock);
  if (rc) return rc;
  *epoch = x->epoch;
  return 0;
}

static int fence_close(kvf_engine *e, uint64_t tag, uint64_t epoch, int timeout_ms, int one_sided) {
  if (!e || !tag || !epoch) return KVF_EINVAL;
  int64_t until = clock_deadline_ms(timeout_ms > 0 ? timeout_ms : e->cfg.timeout_ms);
  int rc = 0;
  pthread_mutex_lock(&e->fences.lock);
  engine_fence *x = kvf__map_get(&e->fences.open, epoch);
  if (!x || x->tag != tag) {
    rc = KVF_ENOTFOUND;
    goto out;
  }
  x->closed = 1;
  atomic_store(&x->cut, 1);
  while (x->inflight) {
    struct timespec ts = clock_ts_from_ns(until);
    int timed_out = pthread_cond_timedwait(&e->fences.cv, &e->fences.lock, &ts) != 0;
    /* Dropped meanwhile, by another closer of the pair or by its last
     * receiver after an earlier close timed out: closed, nothing in flight,
     * and x may already serve another pair. */
    if (kvf__map_get(&e->fences.open, epoch) != x) goto out;
    if (timed_out && x->inflight) {
      /* A receiver that does not come back is stuck outside a receive call;
       * it drops the entry when it leaves. */
      LOG_ERROR("engine", "fence of tag %llu: %d write(s) still in progress after %d ms", (unsigned long long)tag,
                x->inflight, timeout_ms);
      x->abandoned = 1;
      rc = KVF_ETIMEDOUT;
      goto out;
    }
  }
  kvf__map_del(&e->fences.open, epoch, NULL);
  kvf__spare_give(&e->fences.spare, x);
out:
  pthread_mutex_unlock(&e->fences.lock);
  /* One-sided writers (UCX) are told and confirm (ucx.c). */
  if (one_sided && rc != KVF_ENOTFOUND && e->ops->fence_close) {
    int r2 = e->ops->fence_close(e, tag, epoch, until);
    if (!rc) rc = r2;
  }
  return rc;
}

int kvf_engine_fence_close(kvf_engine *e, uint64_t tag, uint64_t epoch, int timeout_ms) {
  return fence_close(e, tag, epoch, timeout_ms, 1);
}

int kvf__engine_fence_retire(kvf_engine *e, uint64_t tag, uint64_t epoch, int timeout_ms) {
  return fence_close(e, tag, epoch, timeout_ms, 0);
}

int kvf__fence_snapshot(kvf_engine *e, uint64_t *next, uint64_t **epochs, size_t *n) {
  int rc = 0;
  pthread_mutex_lock(&e->fences.lock);
  pthread_once(&epoch_once, epoch_seed);
  *next = atomic_load(&next_epoch);
  size_t cap = kvf__map_size(&e->fences.open);
  uint64_t *v = malloc((cap ? cap : 1) * sizeof *v);
  size_t k = 0;
  if (!v) {
    rc = KVF_ENOMEM;
  } else {
    map_iter it;
    void *val;
    kvf__map_iter_init(&it);
    while (kvf__map_next(&e->fences.open, &it, NULL, &val)) {
      const engine_fence *x = val;
      if (!x->closed) v[k++] = x->epoch;
    }
  }
  pthread_mutex_unlock(&e->fences.lock);
  *epochs = v;
  *n = k;
  return rc;
}

engine_fence *kvf__fence_reenter(kvf_engine *e, uint64_t tag, uint64_t epoch) {
  pthread_mutex_lock(&e->fences.lock);
  engine_fence *x = kvf__map_get(&e->fences.open, epoch);
  if (x && (x->closed || x->tag != tag)) x = NULL;
  if (x) x->inflight++;
  pthread_mutex_unlock(&e->fences.lock);
  return x;
}

engine_fence *kvf__fence_enter(kvf_engine *e, uint64_t tag, uint64_t epoch) {
  engine_fence *x = kvf__fence_reenter(e, tag, epoch);
  if (!x) atomic_fetch_add(&e->stats.chunks_fenced, 1);
  return x;
}

/* The one buffer of a grid of byte ranges: all of memory, 1-byte items. */
static const uint64_t all_memory[3] = {0, UINT64_MAX, 1}, all_memory_reach[1] = {UINT64_MAX};

/* Bound the open pair with n grids, or with n byte ranges (`ranges` set:
 * the fence's own grid over all memory holds them); n == 0 unbinds it. */
static int fence_bound(kvf_engine *e, uint64_t tag, uint64_t epoch, const kvf__fence_grid *grids,
                       const uint64_t *ranges, size_t n) {
  pthread_mutex_lock(&e->fences.lock);
  engine_fence *x = kvf__map_get(&e->fences.open, epoch);
  int rc = x && x->tag == tag && !x->closed ? 0 : KVF_ENOTFOUND;
  if (!rc && ranges) {
    x->ranges = (kvf__fence_grid){all_memory, all_memory_reach, 1, ranges, n};
    grids = &x->ranges, n = n ? 1 : 0;
  }
  if (!rc) {
    x->grids = n ? grids : NULL;
    x->ngrids = n;
  }
  pthread_mutex_unlock(&e->fences.lock);
  return rc;
}

int kvf__engine_fence_bound_grids(kvf_engine *e, uint64_t tag, uint64_t epoch, const kvf__fence_grid *grids,
                                  size_t n) {
  if (!e || !tag || !epoch || (n && !grids)) return KVF_EINVAL;
  return fence_bound(e, tag, epoch, grids, NULL, n);
}

int kvf__engine_fence_bound(kvf_engine *e, uint64_t tag, uint64_t epoch, const uint64_t *ranges, size_t n) {
  if (!e || !tag || !epoch || (n && !ranges)) return KVF_EINVAL;
  return fence_bound(e, tag, epoch, NULL, n ? ranges : NULL, n); /* n == 0: unbound */
}

int kvf__fence_bounds_begin(kvf_engine *e, engine_fence *x) {
  pthread_mutex_lock(&e->fences.lock);
  return x->closed;
}

void kvf__fence_bounds_end(kvf_engine *e) { pthread_mutex_unlock(&e->fences.lock); }

/* Is [a, a+len) inside one run of one of the grid's buffers that hold a?
 * Then *end (may be NULL) is that run's end. One search for the buffers,
 * one per buffer holding a for its run (one, unless buffers overlap). */
static int grid_holds(const kvf__fence_grid *g, uint64_t a, uint64_t len, uint64_t *end) {
  size_t lo = 0, hi = g->nbufs;
  while (lo < hi) { /* past the last buffer starting at or below a */
    size_t mid = (lo + hi) / 2;
    if (g->bufs[3 * mid] <= a) lo = mid + 1;
    else hi = mid;
  }
  /* Buffers 0..lo-1 start at or below a; none before j reaches past a once
   * reach[j] <= a. */
  for (size_t j = lo; j-- > 0 && g->reach[j] > a;) {
    uint64_t base = g->bufs[3 * j], blen = g->bufs[3 * j + 1], item = g->bufs[3 * j + 2];
    if (!item || a - base >= blen) continue;
    uint64_t idx = (a - base) / item, whole = blen / item;
    if (idx >= whole) continue; /* in the buffer's tail, past its last whole item */
    size_t rl = 0, rh = g->nruns;
    while (rl < rh) { /* past the last run starting at or below idx */
      size_t mid = (rl + rh) / 2;
      if (g->runs[2 * mid] <= idx) rl = mid + 1;
      else rh = mid;
    }
    if (!rl) continue;
    uint64_t first = g->runs[2 * (rl - 1)], count = g->runs[2 * (rl - 1) + 1];
    if (idx - first >= count) continue;
    /* first <= idx < whole: no overflow, and the end lies inside the buffer */
    uint64_t stop = base + (count > whole - first ? whole : first + count) * item;
    if (len > stop - a) continue;
    if (end) *end = stop;
    return 1;
  }
  return 0;
}

/* Is [a, a+len) inside the fence's bounds? Then *end (may be NULL) is the
 * end of the run that holds it. */
static int in_bounds(const engine_fence *x, uint64_t a, uint64_t len, uint64_t *end) {
  for (size_t i = 0; i < x->ngrids; i++)
    if (grid_holds(&x->grids[i], a, len, end)) return 1;
  return 0;
}

/* Called with the fence table's lock held, on counts the peer chose: the
 * cost is one search per bound the pieces cross, never one per piece (a
 * descriptor of 2^62 pieces would otherwise hold the lock for good). */
int kvf__fence_bounds_ok(const engine_fence *x, uint64_t dst, uint64_t len, uint64_t count, uint64_t stride) {
  if (!x->grids || !len) return 1; /* no bounds, or nothing written */
  if (count <= 1 || !stride) return in_bounds(x, dst, len, NULL);
  uint64_t last;
  if (__builtin_mul_overflow(count - 1, stride, &last) || __builtin_add_overflow(dst, last, &last) ||
      __builtin_add_overflow(last, len, &last))
    return 0;
  for (uint64_t i = 0; i < count;) {
    uint64_t a = dst + i * stride, end = 0; /* no overflow: a <= the last piece's start */
    if (!in_bounds(x, a, len, &end)) return 0;
    uint64_t more = (end - len - a) / stride; /* further pieces inside the same bound */
    if (more >= count - 1 - i) return 1;
    i += more + 1;
  }
  return 1;
}

void kvf__fence_landed(engine_fence *x, int64_t t0, int64_t t1, uint64_t bytes, int how) {
  int64_t zero = 0, cur = atomic_load(&x->last_ns);
  atomic_compare_exchange_strong(&x->first_ns, &zero, t0 ? t0 : 1);
  while (cur < t1 && !atomic_compare_exchange_weak(&x->last_ns, &cur, t1)) {
  }
  atomic_fetch_add(&x->bytes, bytes);
  atomic_fetch_add(&x->chunks, 1);
  atomic_store(&x->how, how);
}

int kvf__engine_fence_stats(kvf_engine *e, uint64_t tag, uint64_t epoch, kvf__fence_stats *out) {
  if (!e || !tag || !epoch || !out) return KVF_EINVAL;
  pthread_mutex_lock(&e->fences.lock);
  engine_fence *x = kvf__map_get(&e->fences.open, epoch);
  int rc = x && x->tag == tag ? 0 : KVF_ENOTFOUND;
  if (!rc)
    *out = (kvf__fence_stats){atomic_load(&x->first_ns), atomic_load(&x->last_ns), atomic_load(&x->bytes),
                              atomic_load(&x->chunks), atomic_load(&x->how)};
  pthread_mutex_unlock(&e->fences.lock);
  return rc;
}

void kvf__fence_leave(kvf_engine *e, engine_fence *x) {
  pthread_mutex_lock(&e->fences.lock);
  if (--x->inflight == 0 && x->closed) {
    pthread_cond_broadcast(&e->fences.cv);
    /* A closer that timed out left the entry for the last receiver to drop. */
    if (kvf__map_get(&e->fences.open, x->epoch) == x && x->abandoned) {
      kvf__map_del(&e->fences.open, x->epoch, NULL);
      kvf__spare_give(&e->fences.spare, x);
    }
  }
  pthread_mutex_unlock(&e->fences.lock);
}

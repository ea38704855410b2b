/* Registered memory regions of one engine: a sorted, non-overlapping array of
 * region pointers searched by binary search. The read lock is held only for
 * lookups, never across network I/O: the TCP receiver pins the regions a
 * chunk writes into (a per-region counter) under the lock, drops it, and
 * receives. Unregister takes the region out of the table, marks it revoked
 * and waits for its pins to drop; a receiver checks for revocations between
 * receive calls that each end within a tick, and stops writing into a
 * revoked region at once. So register never waits on a peer, and unregister
 * waits at most about one receive tick. */
#include <stdlib.h>
#include <string.h>

#include "engine/engine_internal.h"

int kvf__regions_init(region_table *t) {
  memset(t, 0, sizeof *t);
  pthread_rwlockattr_t a;
  pthread_rwlockattr_init(&a);
  pthread_rwlockattr_setkind_np(&a, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
  int rc = pthread_rwlock_init(&t->lock, &a);
  pthread_rwlockattr_destroy(&a);
  if (rc) return KVF_ENOMEM;
  pthread_mutex_init(&t->pin_lock, NULL);
  pthread_cond_init(&t->pin_cv, NULL);
  atomic_init(&t->revocations, 0);
  return 0;
}

void kvf__regions_destroy(region_table *t) {
  pthread_rwlock_destroy(&t->lock);
  pthread_mutex_destroy(&t->pin_lock);
  pthread_cond_destroy(&t->pin_cv);
  for (size_t i = 0; i < t->n; i++) free(t->items[i]);
  free(t->items);
  t->items = NULL;
  t->n = t->cap = 0;
}

/* Index of the first region with base > addr. */
static size_t upper_bound(const region_table *t, uint64_t addr) {
  size_t lo = 0, hi = t->n;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (t->items[mid]->base <= addr) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

int kvf__regions_add(region_table *t, uint64_t base, uint64_t len, int device) {
  if (len == 0 || base + len < base) return KVF_EINVAL;
  region *r = calloc(1, sizeof *r);
  if (!r) return KVF_ENOMEM;
  r->base = base;
  r->len = len;
  r->device = device;
  int rc = 0;
  pthread_rwlock_wrlock(&t->lock);
  size_t i = upper_bound(t, base);
  if ((i > 0 && t->items[i - 1]->base + t->items[i - 1]->len > base) ||
      (i < t->n && t->items[i]->base < base + len)) {
    rc = KVF_EEXIST;
    goto out_unlock;
  }
  if (t->n == t->cap) {
    size_t cap = t->cap ? t->cap * 2 : 16;
    region **items = realloc(t->items, cap * sizeof *items);
    if (!items) {
      rc = KVF_ENOMEM;
      goto out_unlock;
    }
    t->items = items;
    t->cap = cap;
  }
  memmove(&t->items[i + 1], &t->items[i], (t->n - i) * sizeof *t->items);
  t->items[i] = r;
  t->n++;
  r = NULL;
out_unlock:
  pthread_rwlock_unlock(&t->lock);
  free(r);
  return rc;
}

void kvf__regions_mark_unmovable(region_table *t, uint64_t base) {
  pthread_rwlock_wrlock(&t->lock);
  size_t i = upper_bound(t, base);
  if (i > 0 && t->items[i - 1]->base == base) t->items[i - 1]->device = 2;
  pthread_rwlock_unlock(&t->lock);
}

int kvf__regions_remove(region_table *t, uint64_t base) {
  region *r = NULL;
  pthread_rwlock_wrlock(&t->lock);
  size_t i = upper_bound(t, base);
  if (i > 0 && t->items[i - 1]->base == base) {
    r = t->items[i - 1];
    memmove(&t->items[i - 1], &t->items[i], (t->n - i) * sizeof *t->items);
    t->n--;
    atomic_store(&r->revoked, 1);
    atomic_fetch_add(&t->revocations, 1);
  }
  pthread_rwlock_unlock(&t->lock);
  if (!r) return KVF_ENOTFOUND;
  /* Out of the table, no new pin can reach it; receivers holding one see the
   * revocation within a receive tick and let go. */
  pthread_mutex_lock(&t->pin_lock);
  while (atomic_load(&r->pins) > 0) pthread_cond_wait(&t->pin_cv, &t->pin_lock);
  pthread_mutex_unlock(&t->pin_lock);
  free(r);
  return 0;
}

void kvf__region_pin(region *r) { atomic_fetch_add(&r->pins, 1); }

void kvf__region_unpin(region_table *t, region *r) {
  /* Under pin_lock: once the last pin is gone the remover (which checks
   * the count under this lock) may free r, so r is not read after. */
  pthread_mutex_lock(&t->pin_lock);
  if (atomic_fetch_sub(&r->pins, 1) == 1 && atomic_load(&r->revoked)) pthread_cond_broadcast(&t->pin_cv);
  pthread_mutex_unlock(&t->pin_lock);
}

region *kvf__regions_find_locked(const region_table *t, uint64_t addr, uint64_t len) {
  if (addr + len < addr) return NULL;
  size_t i = upper_bound(t, addr);
  if (i == 0) return NULL;
  region *r = t->items[i - 1];
  return addr >= r->base && addr + len <= r->base + r->len ? r : NULL;
}

region *kvf__regions_find_block_locked(const region_table *t, uint64_t addr, uint64_t len, uint64_t count,
                                       uint64_t stride) {
  if (count <= 1) return kvf__regions_find_locked(t, addr, len);
  /* Pieces are checked as one span [first, last+len): a strided block must
   * stay within one region, which is what every caller wants (one buffer). */
  uint64_t last;
  if (__builtin_mul_overflow(count - 1, stride, &last) || __builtin_add_overflow(addr, last, &last)) return NULL;
  if (last + len < last) return NULL;
  return kvf__regions_find_locked(t, addr, last + len - addr);
}

int kvf__regions_block_ok_locked(const region_table *t, uint64_t addr, uint64_t len, uint64_t count,
                                 uint64_t stride) {
  return kvf__regions_find_block_locked(t, addr, len, count, stride) != NULL;
}

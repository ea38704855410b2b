/* Registered memory regions of one engine: a sorted, non-overlapping array
 * searched by binary search. The TCP receiver holds the read lock while it
 * writes a batch's payload, so unregister waits for writes in progress
 * instead of letting bytes land in memory the owner has taken back. */
#include <stdlib.h>
#include <string.h>

#include "engine/engine_internal.h"

int regions_init(region_table *t) {
  memset(t, 0, sizeof *t);
  pthread_rwlockattr_t a;
  pthread_rwlockattr_init(&a);
  pthread_rwlockattr_setkind_np(&a, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
  int rc = pthread_rwlock_init(&t->lock, &a);
  pthread_rwlockattr_destroy(&a);
  return rc ? KVF_ENOMEM : 0;
}

void regions_destroy(region_table *t) {
  pthread_rwlock_destroy(&t->lock);
  free(t->items);
  t->items = NULL;
  t->n = t->cap = 0;
}

/* Index of the first region with base > addr. */
static size_t upper_bound(const region_table *t, uint64_t addr) {
  size_t lo = 0, hi = t->n;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (t->items[mid].base <= addr) lo = mid + 1;
    else hi = mid;
  }
  return lo;
}

int regions_add(region_table *t, uint64_t base, uint64_t len) {
  if (len == 0 || base + len < base) return KVF_EINVAL;
  int rc = 0;
  pthread_rwlock_wrlock(&t->lock);
  size_t i = upper_bound(t, base);
  if ((i > 0 && t->items[i - 1].base + t->items[i - 1].len > base) ||
      (i < t->n && t->items[i].base < base + len)) {
    rc = KVF_EEXIST;
    goto out_unlock;
  }
  if (t->n == t->cap) {
    size_t cap = t->cap ? t->cap * 2 : 16;
    region *items = realloc(t->items, cap * sizeof *items);
    if (!items) {
      rc = KVF_ENOMEM;
      goto out_unlock;
    }
    t->items = items;
    t->cap = cap;
  }
  memmove(&t->items[i + 1], &t->items[i], (t->n - i) * sizeof *t->items);
  t->items[i] = (region){base, len};
  t->n++;
out_unlock:
  pthread_rwlock_unlock(&t->lock);
  return rc;
}

int regions_remove(region_table *t, uint64_t base) {
  int rc = KVF_ENOTFOUND;
  pthread_rwlock_wrlock(&t->lock);
  size_t i = upper_bound(t, base);
  if (i > 0 && t->items[i - 1].base == base) {
    memmove(&t->items[i - 1], &t->items[i], (t->n - i) * sizeof *t->items);
    t->n--;
    rc = 0;
  }
  pthread_rwlock_unlock(&t->lock);
  return rc;
}

int regions_contains_locked(const region_table *t, uint64_t addr, uint64_t len) {
  if (addr + len < addr) return 0;
  size_t i = upper_bound(t, addr);
  if (i == 0) return 0;
  const region *r = &t->items[i - 1];
  return addr >= r->base && addr + len <= r->base + r->len;
}

int regions_block_ok_locked(const region_table *t, uint64_t addr, uint64_t len, uint64_t count,
                            uint64_t stride) {
  if (count <= 1) return regions_contains_locked(t, addr, len);
  /* Pieces are checked as one span [first, last+len): a strided block must
   * stay within one region, which is what every caller wants (one buffer). */
  uint64_t last;
  if (__builtin_mul_overflow(count - 1, stride, &last) || __builtin_add_overflow(addr, last, &last))
    return 0;
  if (last + len < last) return 0;
  return regions_contains_locked(t, addr, last + len - addr);
}

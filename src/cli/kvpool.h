/* A model-shaped KV pool for one rank (MHA: a K and a V buffer per layer,
 * each `pages` pages of `item_len` bytes), the page-label scheme that the
 * demo, the kv peer and the tests fill and verify with, and a free list of
 * page indices. */
#ifndef KVF_CLI_KVPOOL_H
#define KVF_CLI_KVPOOL_H

#include <stddef.h>
#include <stdint.h>

#include "kvferry.h"

typedef struct kvpool {
  size_t layers, nbuf, pages;
  uint64_t item_len;
  void **ptrs;
  uint64_t *lens, *item_lens;
  kvf_kv_buffers bufs; /* points into the arrays above */
  /* free list of page indices */
  int64_t *free_pages;
  size_t nfree;
} kvpool;

int kvpool_init(kvpool *p, size_t layers, size_t pages, uint64_t item_len);
void kvpool_free(kvpool *p);
/* Take n pages in a scattered order drawn from *rng; -1 if not enough. */
int kvpool_take(kvpool *p, size_t n, uint64_t *rng, int64_t *out);
void kvpool_give(kvpool *p, const int64_t *pages, size_t n);

/* The pattern label of page k of a request in buffer b. */
static inline uint64_t kvpool_label(int64_t room, size_t k, size_t b) {
  return ((uint64_t)room << 24) ^ ((uint64_t)k << 8) ^ (uint64_t)b;
}
/* Fill (prefill) or check (decode) the pages of a request; check returns the
 * number of pages (counting every buffer) that do not hold their pattern. */
void kvpool_fill(kvpool *p, int64_t room, const int64_t *pages, size_t n, uint64_t seed);
size_t kvpool_check(kvpool *p, int64_t room, const int64_t *pages, size_t n, uint64_t seed);

#endif

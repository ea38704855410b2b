/* Model-shaped KV pools (see kvpool.h). */
#include "kvpool.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "pattern.h"

int kvpool_init(kvpool *p, size_t layers, size_t pages, uint64_t item_len) {
  memset(p, 0, sizeof *p);
  p->layers = layers;
  p->nbuf = 2 * layers;
  p->pages = pages;
  p->item_len = item_len;
  p->ptrs = calloc(p->nbuf, sizeof *p->ptrs);
  p->lens = calloc(p->nbuf, sizeof *p->lens);
  p->item_lens = calloc(p->nbuf, sizeof *p->item_lens);
  p->free_pages = calloc(pages, sizeof *p->free_pages);
  if (!p->ptrs || !p->lens || !p->item_lens || !p->free_pages) goto err;
  for (size_t b = 0; b < p->nbuf; b++) {
    p->lens[b] = pages * item_len;
    p->item_lens[b] = item_len;
    p->ptrs[b] = mmap(NULL, p->lens[b], PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (p->ptrs[b] == MAP_FAILED) {
      p->ptrs[b] = NULL;
      goto err;
    }
    memset(p->ptrs[b], 0, p->lens[b]); /* fault in now, as a real pool is */
  }
  for (size_t i = 0; i < pages; i++) p->free_pages[i] = (int64_t)(pages - 1 - i);
  p->nfree = pages;
  p->bufs = (kvf_kv_buffers){.n_kv = p->nbuf, .kv_ptrs = p->ptrs, .kv_lens = p->lens,
                             .kv_item_lens = p->item_lens};
  return 0;
err:
  kvpool_free(p);
  return -1;
}

void kvpool_free(kvpool *p) {
  for (size_t b = 0; p->ptrs && b < p->nbuf; b++)
    if (p->ptrs[b]) munmap(p->ptrs[b], p->lens[b]);
  free(p->ptrs);
  free(p->lens);
  free(p->item_lens);
  free(p->free_pages);
  memset(p, 0, sizeof *p);
}

static uint64_t rng_next(uint64_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

int kvpool_take(kvpool *p, size_t n, uint64_t *rng, int64_t *out) {
  if (n > p->nfree) return -1;
  for (size_t i = 0; i < n; i++) {
    /* Swap a random free entry to the end and pop it: scattered, O(1). */
    size_t j = (size_t)(rng_next(rng) % p->nfree);
    int64_t t = p->free_pages[j];
    p->free_pages[j] = p->free_pages[p->nfree - 1];
    p->nfree--;
    out[i] = t;
  }
  return 0;
}

void kvpool_give(kvpool *p, const int64_t *pages, size_t n) {
  for (size_t i = 0; i < n && p->nfree < p->pages; i++) p->free_pages[p->nfree++] = pages[i];
}

void kvpool_fill(kvpool *p, int64_t room, const int64_t *pages, size_t n, uint64_t seed) {
  for (size_t b = 0; b < p->nbuf; b++)
    for (size_t k = 0; k < n; k++)
      pattern_fill((char *)p->ptrs[b] + pages[k] * p->item_len, p->item_len, seed, kvpool_label(room, k, b));
}

size_t kvpool_check(kvpool *p, int64_t room, const int64_t *pages, size_t n, uint64_t seed) {
  size_t bad = 0;
  for (size_t b = 0; b < p->nbuf; b++)
    for (size_t k = 0; k < n; k++)
      bad += !pattern_check((char *)p->ptrs[b] + pages[k] * p->item_len, p->item_len, seed,
                            kvpool_label(room, k, b));
  return bad;
}

/* Model-shaped KV pools (see kvpool.h). */
#include "kvpool.h"

#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "util.h"
#include "pattern.h"

static kvf_engine *next_engine;

void kvpool_use_engine(kvf_engine *e) { next_engine = e; }

/* nbuf buffers of `pages` pages of item_len bytes, faulted in. */
static int pool_alloc(kvpool *p, size_t layers, size_t nbuf, size_t pages, uint64_t item_len) {
  memset(p, 0, sizeof *p);
  p->engine = next_engine;
  p->layers = layers;
  p->nbuf = nbuf;
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
    if (p->engine) {
      if (kvf_engine_alloc_pool(p->engine, p->lens[b], &p->ptrs[b])) goto err;
    } else {
      p->ptrs[b] = mmap(NULL, p->lens[b], PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (p->ptrs[b] == MAP_FAILED) {
        p->ptrs[b] = NULL;
        goto err;
      }
    }
    memset(p->ptrs[b], 0, p->lens[b]); /* fault in now, as a real pool is */
  }
  for (size_t i = 0; i < pages; i++) p->free_pages[i] = (int64_t)(pages - 1 - i);
  p->nfree = pages;
  p->bufs =
      (kvf_kv_buffers){.n_kv = p->nbuf, .kv_ptrs = p->ptrs, .kv_lens = p->lens, .kv_item_lens = p->item_lens};
  p->page_size = 1;
  return 0;
err:
  kvpool_free(p);
  return -1;
}

int kvpool_init(kvpool *p, size_t layers, size_t pages, uint64_t item_len) {
  return pool_alloc(p, layers, 2 * layers, pages, item_len);
}

/* Head-aware unit lens for every buffer of an allocated pool. */
static int set_heads(kvpool *p, size_t page_size, size_t heads, size_t head0, uint64_t unit) {
  p->page_size = page_size;
  p->heads = heads;
  p->head0 = head0;
  p->unit = unit;
  if (!(p->unit_lens = calloc(p->nbuf, sizeof *p->unit_lens))) {
    kvpool_free(p);
    return -1;
  }
  for (size_t b = 0; b < p->nbuf; b++) p->unit_lens[b] = unit;
  p->bufs.kv_unit_lens = p->unit_lens;
  return 0;
}

int kvpool_init_heads(kvpool *p, size_t layers, size_t pages, size_t page_size, size_t heads, size_t head0,
                      uint64_t unit) {
  if (!page_size || !heads || !unit || kvpool_init(p, layers, pages, page_size * heads * unit)) return -1;
  return set_heads(p, page_size, heads, head0, unit);
}

int kvpool_init_mla(kvpool *p, size_t layers, size_t pages, size_t page_size, uint64_t unit) {
  if (!layers || layers > UINT32_MAX || !page_size || !unit ||
      pool_alloc(p, layers, layers, pages, page_size * unit) || set_heads(p, page_size, 1, 0, unit))
    return -1;
  /* Layer l is buffer l, said explicitly rather than left to the library's
   * odd-count rule (an even layer count would read as K/V pairs). */
  p->layer_start = calloc(layers + 1, sizeof *p->layer_start);
  p->layer_bufs = calloc(layers, sizeof *p->layer_bufs);
  if (!p->layer_start || !p->layer_bufs) {
    kvpool_free(p);
    return -1;
  }
  for (size_t l = 0; l <= layers; l++) p->layer_start[l] = (uint32_t)l;
  for (size_t l = 0; l < layers; l++) p->layer_bufs[l] = (uint32_t)l;
  p->mla = 1;
  p->bufs.n_layers = layers;
  p->bufs.layer_buf_start = p->layer_start;
  p->bufs.layer_bufs = p->layer_bufs;
  return 0;
}

int kvpool_add_state(kvpool *p, size_t nstate, size_t slots, uint64_t item) {
  if (!nstate || !slots || !item || p->nstate) return -1;
  p->state_ptrs = calloc(nstate, sizeof *p->state_ptrs);
  p->state_lens = calloc(nstate, sizeof *p->state_lens);
  p->state_item_lens = calloc(nstate, sizeof *p->state_item_lens);
  if (!p->state_ptrs || !p->state_lens || !p->state_item_lens) return -1;
  p->nstate = nstate;
  p->state_slots = slots;
  p->state_item = item;
  for (size_t j = 0; j < nstate; j++) {
    p->state_lens[j] = slots * item;
    p->state_item_lens[j] = item;
    if (!(p->state_ptrs[j] = calloc(slots, item))) return -1;
  }
  p->bufs.n_state = nstate;
  p->bufs.state_ptrs = p->state_ptrs;
  p->bufs.state_lens = p->state_lens;
  p->bufs.state_item_lens = p->state_item_lens;
  return 0;
}

void kvpool_fill_state(kvpool *p, int64_t room, int64_t slot, uint64_t seed) {
  for (size_t j = 0; j < p->nstate; j++)
    pattern_fill((char *)p->state_ptrs[j] + slot * p->state_item, p->state_item, seed,
                 kvpool_label(room, 0, 1000 + j));
}

size_t kvpool_check_state(kvpool *p, int64_t room, int64_t slot, uint64_t seed) {
  size_t bad = 0;
  for (size_t j = 0; j < p->nstate; j++)
    bad += !pattern_check((char *)p->state_ptrs[j] + slot * p->state_item, p->state_item, seed,
                          kvpool_label(room, 0, 1000 + j));
  return bad;
}

void kvpool_free(kvpool *p) {
  for (size_t j = 0; p->state_ptrs && j < p->nstate; j++) free(p->state_ptrs[j]);
  free(p->state_ptrs);
  free(p->state_lens);
  free(p->state_item_lens);
  free(p->unit_lens);
  free(p->layer_start);
  free(p->layer_bufs);
  for (size_t b = 0; p->ptrs && b < p->nbuf; b++)
    if (p->ptrs[b] && p->engine) kvf_engine_free_pool(p->engine, p->ptrs[b]);
    else if (p->ptrs[b]) munmap(p->ptrs[b], p->lens[b]);
  free(p->ptrs);
  free(p->lens);
  free(p->item_lens);
  free(p->free_pages);
  memset(p, 0, sizeof *p);
}

int kvpool_take(kvpool *p, size_t n, uint64_t *rng, int64_t *out) {
  if (n > p->nfree) return -1;
  for (size_t i = 0; i < n; i++) {
    /* Swap a random free entry to the end and pop it: scattered, O(1). */
    size_t j = (size_t)(cli_rng_next(rng) % p->nfree);
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

/* Unit (token t, local head j) of page `page` in buffer b: token-major. */
static char *unit_at(kvpool *p, size_t b, int64_t page, size_t t, size_t j) {
  return (char *)p->ptrs[b] + (uint64_t)page * p->item_len + (t * p->heads + j) * p->unit;
}

void kvpool_fill(kvpool *p, int64_t room, const int64_t *pages, size_t n, uint64_t seed) {
  if (p->heads) {
    for (size_t b = 0; b < p->nbuf; b++)
      for (size_t k = 0; k < n; k++)
        for (size_t t = 0; t < p->page_size; t++)
          for (size_t j = 0; j < p->heads; j++)
            pattern_fill(unit_at(p, b, pages[k], t, j), p->unit, seed,
                         kvpool_unit_label(room, k * p->page_size + t, p->head0 + j, b));
    return;
  }
  for (size_t b = 0; b < p->nbuf; b++)
    for (size_t k = 0; k < n; k++)
      pattern_fill((char *)p->ptrs[b] + pages[k] * p->item_len, p->item_len, seed, kvpool_label(room, k, b));
}

size_t kvpool_check(kvpool *p, int64_t room, const int64_t *pages, size_t n, uint64_t seed) {
  size_t bad = 0;
  if (p->heads) {
    for (size_t b = 0; b < p->nbuf; b++)
      for (size_t k = 0; k < n; k++)
        for (size_t t = 0; t < p->page_size; t++)
          for (size_t j = 0; j < p->heads; j++)
            bad += !pattern_check(unit_at(p, b, pages[k], t, j), p->unit, seed,
                                  kvpool_unit_label(room, k * p->page_size + t, p->head0 + j, b));
    return bad;
  }
  for (size_t b = 0; b < p->nbuf; b++)
    for (size_t k = 0; k < n; k++)
      bad +=
          !pattern_check((char *)p->ptrs[b] + pages[k] * p->item_len, p->item_len, seed, kvpool_label(room, k, b));
  return bad;
}

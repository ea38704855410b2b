/* A model-shaped KV pool for one rank (MHA: a K and a V buffer per layer,
 * each `pages` pages of `item_len` bytes; MLA: one latent buffer per layer),
 * the page-label scheme that the
 * demo, the kv peer and the tests fill and verify with, and a free list of
 * page indices.
 *
 * A head-aware pool (kvpool_init_heads) knows its pages' layout as the MHA
 * pool of tokenspeed lays them out, token-major: [token][head][dim], so a
 * page is page_size x heads units of `unit` bytes (one head of one token).
 * It fills and checks every unit with a pattern of the GLOBAL (token, head):
 * a rank holding global heads head0 .. head0+heads-1 can tell whether each
 * head slice of each token came from the prefill rank that owns that head,
 * whatever the TP sizes on either side. Optional state slots (Mamba-like
 * buffers, one slot per request) are filled per (room, buffer). */
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
  /* head-aware layout; heads == 0 for a plain pool */
  size_t page_size, heads, head0;
  uint64_t unit;
  uint64_t *unit_lens;
  /* MLA (kvpool_init_mla): nbuf == layers, layer l = buffer l */
  int mla;
  uint32_t *layer_start, *layer_bufs;
  /* state buffers (kvpool_add_state): nstate buffers of state_slots slots */
  size_t nstate, state_slots;
  uint64_t state_item;
  void **state_ptrs;
  uint64_t *state_lens, *state_item_lens;
  /* free list of page indices */
  int64_t *free_pages;
  size_t nfree;
  kvf_engine *engine; /* the KV buffers came from kvf_engine_alloc_pool of it, or NULL (mmap) */
} kvpool;

/* The next kvpool_init* allocates its KV buffers with kvf_engine_alloc_pool
 * of `e` (shared memory a same-host UCX peer maps), NULL: private mmap (the
 * default). The engine must outlive the pool. One thread. */
void kvpool_use_engine(kvf_engine *e);

int kvpool_init(kvpool *p, size_t layers, size_t pages, uint64_t item_len);
/* A head-aware pool: item_len = page_size * heads * unit; this rank holds
 * global KV heads head0 .. head0 + heads - 1 (MLA or replicated: head0 0). */
int kvpool_init_heads(kvpool *p, size_t layers, size_t pages, size_t page_size, size_t heads, size_t head0,
                      uint64_t unit);
/* An MLA pool: one latent buffer per layer (nbuf = layers, layer l = buffer
 * l, given to the library as an explicit layer mapping), page_size tokens a
 * page of `unit` bytes each (the whole latent of one token). The latent is
 * the same on every TP rank: it fills and checks as one head, head 0, on
 * every rank, so the pattern does not depend on the rank. */
int kvpool_init_mla(kvpool *p, size_t layers, size_t pages, size_t page_size, uint64_t unit);
/* Add nstate state buffers of `slots` slots of `item` bytes (after init). */
int kvpool_add_state(kvpool *p, size_t nstate, size_t slots, uint64_t item);
/* Fill (prefill) or check (decode) state slot `slot` with the pattern of
 * (room, buffer); check returns the number of buffers that differ. */
void kvpool_fill_state(kvpool *p, int64_t room, int64_t slot, uint64_t seed);
size_t kvpool_check_state(kvpool *p, int64_t room, int64_t slot, uint64_t seed);
void kvpool_free(kvpool *p);
/* Take n pages in a scattered order drawn from *rng; -1 if not enough. */
int kvpool_take(kvpool *p, size_t n, uint64_t *rng, int64_t *out);
void kvpool_give(kvpool *p, const int64_t *pages, size_t n);

/* The pattern label of page k of a request in buffer b. */
static inline uint64_t kvpool_label(int64_t room, size_t k, size_t b) {
  return ((uint64_t)room << 24) ^ ((uint64_t)k << 8) ^ (uint64_t)b;
}
/* The pattern label of global head h of token `tok` of a request in buffer b. */
static inline uint64_t kvpool_unit_label(int64_t room, uint64_t tok, uint64_t h, size_t b) {
  return ((uint64_t)room * 0x9e3779b97f4a7c15ULL) ^ (tok << 28) ^ (h << 12) ^ (uint64_t)b;
}
/* Fill (prefill) or check (decode) the pages of a request; check returns the
 * number of pages (counting every buffer) that do not hold their pattern;
 * for a head-aware pool, the number of (token, head, buffer) units. */
void kvpool_fill(kvpool *p, int64_t room, const int64_t *pages, size_t n, uint64_t seed);
size_t kvpool_check(kvpool *p, int64_t room, const int64_t *pages, size_t n, uint64_t seed);

#endif

/* A room's bounds: its own pages in every KV buffer and its state slots in
 * every state buffer, handed to the engine as the bounds of the room's
 * fence (engine/async.h, kvf__engine_fence_bound_grids). A chunk for the
 * room whose destination lies outside them is refused by this decode's
 * engine before any byte lands (over kvferry's TCP) or is never read (UCX
 * read mode): a prefill can only fill the pages the decode gave the room,
 * whatever its descriptors say.
 *
 * Held as two grids: the room's runs of consecutive pages (of state slots)
 * once, over the manager's KV (state) buffers, sorted once per manager. A
 * room costs O(pages + slots) here whatever the number of buffers; a piece
 * must lie inside one run of one buffer. */
#include "kv/decode/decode_int.h"

static int cmp_i64(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return x < y ? -1 : x > y;
}

static int cmp_triple(const void *a, const void *b) {
  const uint64_t *x = a, *y = b;
  return x[0] < y[0] ? -1 : x[0] > y[0];
}

static int grow(void **v, size_t *cap, size_t want, size_t elem) {
  if (want <= *cap) return 0;
  size_t n = *cap ? *cap : 64;
  while (n < want) n *= 2;
  void *p = realloc(*v, n * elem);
  if (!p) return KVF_ENOMEM;
  *v = p;
  *cap = n;
  return 0;
}

/* One kind of buffers as a grid's: (base, len, item) sorted by base, and
 * each one's reach. Buffers without items hold nothing and are left out. */
static int bufs_build(bound_bufs *out, const uint64_t *ptrs, const uint64_t *lens, const uint64_t *items,
                      size_t n) {
  out->bufs = malloc((3 * n + 1) * sizeof *out->bufs);
  out->reach = malloc((n + 1) * sizeof *out->reach);
  if (!out->bufs || !out->reach) return KVF_ENOMEM;
  size_t k = 0;
  for (size_t i = 0; i < n; i++) {
    if (!items[i]) continue;
    out->bufs[3 * k] = ptrs[i];
    out->bufs[3 * k + 1] = lens[i];
    out->bufs[3 * k + 2] = items[i];
    k++;
  }
  qsort(out->bufs, k, 3 * sizeof *out->bufs, cmp_triple);
  for (size_t i = 0; i < k; i++) {
    uint64_t end = out->bufs[3 * i] + out->bufs[3 * i + 1];
    out->reach[i] = i && out->reach[i - 1] > end ? out->reach[i - 1] : end;
  }
  out->n = k;
  return 0;
}

int kvf__dec_bound_bufs_build(struct decode_state *ds, const manager_buffers *b) {
  return bufs_build(&ds->bound_kv, b->kv_ptrs, b->kv_lens, b->kv_item_lens, b->n_kv) ||
                 bufs_build(&ds->bound_state, b->state_ptrs, b->state_lens, b->state_item_lens, b->n_state)
             ? KVF_ENOMEM
             : 0;
}

void kvf__dec_bound_bufs_free(struct decode_state *ds) {
  free(ds->bound_kv.bufs), free(ds->bound_kv.reach);
  free(ds->bound_state.bufs), free(ds->bound_state.reach);
}

/* The runs of `idx` (sorted, n of them, none negative) as (first, count)
 * pairs from out[2k]; the new k. */
static size_t add_runs(uint64_t *out, size_t k, const int64_t *idx, size_t n) {
  for (size_t i = 0; i < n;) {
    size_t j = i + 1;
    while (j < n && (idx[j] == idx[j - 1] || idx[j] == idx[j - 1] + 1)) j++;
    out[2 * k] = (uint64_t)idx[i];
    out[2 * k + 1] = (uint64_t)(idx[j - 1] - idx[i]) + 1;
    k++;
    i = j;
  }
  return k;
}

/* Sorted indices of `v` in r->sorted from offset `at`. */
static int sort_into(kvf_receiver *r, size_t at, const int64_t *v, size_t n) {
  if (grow((void **)&r->sorted, &r->sorted_cap, at + n, sizeof *r->sorted)) return KVF_ENOMEM;
  if (!n) return 0;
  memcpy(r->sorted + at, v, n * sizeof *v);
  qsort(r->sorted + at, n, sizeof *v, cmp_i64);
  return 0;
}

int kvf__dec_room_bound(kvf_manager *m, kvf_receiver *r, const int64_t *pages, size_t npages, const int64_t *slots,
                        size_t nslots) {
  const struct decode_state *ds = m->decode;
  if (sort_into(r, 0, pages, npages) || sort_into(r, npages, slots, nslots)) return KVF_ENOMEM;
  if (grow((void **)&r->bounds, &r->bounds_cap, 2 * (npages + nslots) + 1, sizeof *r->bounds)) return KVF_ENOMEM;
  size_t kv = add_runs(r->bounds, 0, r->sorted, npages);
  size_t st = add_runs(r->bounds, kv, r->sorted + npages, nslots) - kv;
  r->grids[0] = (kvf__fence_grid){ds->bound_kv.bufs, ds->bound_kv.reach, ds->bound_kv.n, r->bounds, kv};
  r->grids[1] =
      (kvf__fence_grid){ds->bound_state.bufs, ds->bound_state.reach, ds->bound_state.n, r->bounds + 2 * kv, st};
  /* A room without pages or slots is still bounded: nothing may land. */
  return kvf__engine_fence_bound_grids(m->engine, manager_room_tag(r->room), r->fence_epoch, r->grids, 2);
}

void kvf__dec_receiver_free(kvf_receiver *r) {
  if (!r) return;
  free(r->bounds);
  free(r->sorted);
  free(r);
}

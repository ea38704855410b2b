/* A room's bounds: the byte ranges of its own pages in every KV buffer and
 * of its state slots in every state buffer, handed to the engine as the
 * bounds of the room's fence (engine/async.h, kvf__engine_fence_bound).
 * A chunk for the room whose destination lies outside them is refused by
 * this decode's engine before any byte lands (over kvferry's TCP) or is
 * never read (UCX read mode): a prefill can only fill the pages the decode
 * gave the room, whatever its descriptors say. Runs of consecutive pages
 * make one range each. */
#include "kv/decode/decode_int.h"

static int cmp_i64(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return x < y ? -1 : x > y;
}

static int cmp_range(const void *a, const void *b) {
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

/* Append the runs of `idx` (sorted, npages of them) in one buffer; out
 * holds (base, len) pairs. Indices past the buffer's end are left out (no
 * write can land there: it is not this buffer's memory). */
static size_t add_runs(uint64_t *out, size_t k, uint64_t base, uint64_t blen, uint64_t item, const int64_t *idx,
                       size_t n) {
  if (!item) return k;
  uint64_t pages_in = blen / item;
  for (size_t i = 0; i < n;) {
    size_t j = i + 1;
    while (j < n && (idx[j] == idx[j - 1] || idx[j] == idx[j - 1] + 1)) j++;
    uint64_t first = (uint64_t)idx[i], last = (uint64_t)idx[j - 1];
    i = j;
    if (first >= pages_in) continue;
    if (last >= pages_in) last = pages_in - 1;
    out[2 * k] = base + first * item;
    out[2 * k + 1] = (last - first + 1) * item;
    k++;
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

/* Buffer j of the manager (KV buffers, then state buffers): base, length,
 * item length. */
static void buffer_at(const manager_buffers *b, size_t j, uint64_t *base, uint64_t *len, uint64_t *item) {
  int st = j >= b->n_kv;
  size_t k = st ? j - b->n_kv : j;
  *base = st ? b->state_ptrs[k] : b->kv_ptrs[k];
  *len = st ? b->state_lens[k] : b->kv_lens[k];
  *item = st ? b->state_item_lens[k] : b->kv_item_lens[k];
}

static int cmp_buffer(const void *a, const void *b, void *bufs) {
  uint64_t x, y, l, i;
  buffer_at(bufs, (size_t) * (const int64_t *)a, &x, &l, &i);
  buffer_at(bufs, (size_t) * (const int64_t *)b, &y, &l, &i);
  return x < y ? -1 : x > y;
}

int kvf__dec_room_bound(kvf_manager *m, kvf_receiver *r, const int64_t *pages, size_t npages, const int64_t *slots,
                        size_t nslots) {
  const manager_buffers *b = &m->bufs;
  size_t nbuf = b->n_kv + b->n_state;
  if (sort_into(r, 0, pages, npages) || sort_into(r, npages, slots, nslots)) return KVF_ENOMEM;
  if (grow((void **)&r->sorted, &r->sorted_cap, npages + nslots + nbuf, sizeof *r->sorted)) return KVF_ENOMEM;
  const int64_t *sp = r->sorted, *ss = r->sorted + npages;
  int64_t *order = r->sorted + npages + nslots; /* the buffers by base address */
  for (size_t j = 0; j < nbuf; j++) order[j] = (int64_t)j;
  qsort_r(order, nbuf, sizeof *order, cmp_buffer, (void *)b);
  size_t runs = 0, sruns = 0; /* runs of the pages and of the slots: the ranges per buffer */
  for (size_t i = 0; i < npages; i++) runs += i == 0 || sp[i] > sp[i - 1] + 1;
  for (size_t i = 0; i < nslots; i++) sruns += i == 0 || ss[i] > ss[i - 1] + 1;
  size_t want = b->n_kv * runs + b->n_state * sruns;
  if (grow((void **)&r->bounds, &r->bounds_cap, 2 * (want ? want : 1), sizeof *r->bounds)) return KVF_ENOMEM;
  size_t k = 0;
  for (size_t i = 0; i < nbuf; i++) {
    uint64_t base, len, item;
    size_t j = (size_t)order[i];
    buffer_at(b, j, &base, &len, &item);
    k = j < b->n_kv ? add_runs(r->bounds, k, base, len, item, sp, npages)
                    : add_runs(r->bounds, k, base, len, item, ss, nslots);
  }
  /* Sorted by construction unless buffers overlap (two sharing memory):
   * then sort; ranges that touch or overlap are merged, so the engine gets
   * sorted, disjoint ones. */
  for (size_t i = 1; i < k; i++)
    if (r->bounds[2 * i] < r->bounds[2 * (i - 1)]) {
      qsort(r->bounds, k, 2 * sizeof *r->bounds, cmp_range);
      break;
    }
  size_t out = 0;
  for (size_t i = 0; i < k; i++) {
    uint64_t base = r->bounds[2 * i], len = r->bounds[2 * i + 1];
    uint64_t *prev = out ? &r->bounds[2 * (out - 1)] : NULL;
    if (prev && base <= prev[0] + prev[1]) {
      if (base + len > prev[0] + prev[1]) prev[1] = base + len - prev[0];
      continue;
    }
    r->bounds[2 * out] = base;
    r->bounds[2 * out + 1] = len;
    out++;
  }
  /* No range at all (a room without pages) still bounds it: nothing may land. */
  if (!out) {
    r->bounds[0] = 0;
    r->bounds[1] = 0;
    out = 1;
  }
  return kvf__engine_fence_bound(m->engine, manager_room_tag(r->room), r->fence_epoch, r->bounds, out);
}

void kvf__dec_receiver_free(kvf_receiver *r) {
  if (!r) return;
  free(r->bounds);
  free(r->sorted);
  free(r);
}

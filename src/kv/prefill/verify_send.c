/* The verify-mode step of the per-destination send path (chunk_plan.c;
 * docs/WIRE-EXTENSIONS.md, integrity): once the destination's plan is in
 * the worker's scratch, cut in parts (kvf__pf_plan_dest), every part is
 * submitted at once and then finished in order: waited for, its source
 * pages rechecked against the digests kvf_sender_send took, and its digest
 * entries sent to a decode that asked, so rechecking the sources and the
 * decode's digest checks overlap the transfer. Uses only the scratch's
 * grow-only arrays: no allocation per call. */
#include "kv/prefill/prefill_int.h"

/* The send-time page digests of the chunk's KV pages from window position
 * `a` on (pdig[i * ndig + j]: page a + i, buffer dig_bufs[j]), or NULL
 * when the chunk's pages were not hashed. */
static const uint64_t *part_pdig(const pf_scratch *sc, const pf_chunk *c, size_t a) {
  return c->digests ? c->digests + (sc->skip + a) * c->ndig : NULL;
}

/* Does the plan move whole pages of KV buffers (no fragments, no per-token
 * cut)? Then a part's digests are the page digests taken at send. */
static int part_plain(const pf_part *p, const pf_info *info) {
  return !p->state && !info->m2->nfrags && info->tokens == 1;
}

/* Do part p's digest entries come from the send-time page digests? */
static int part_from_pages(const pf_send *s, const pf_part *p) { return part_plain(p, s->info) && s->c->digests; }

/* The digest entries of what part p writes, for a decode that asked: from
 * the page digests when the plan moves whole pages (no second pass; filled
 * by part_fill once the part landed, as the sending thread may still be
 * taking them), else by hashing each block's source pieces now, just
 * before the write. */
static int part_digests(pf_scratch *sc, const pf_send *s, pf_part *p) {
  const pf_chunk *c = s->c;
  int plain = part_from_pages(s, p);
  size_t cnt = plain ? p->n * c->ndig : p->nw;
  if (kvf__pf_scratch_grow((void **)&sc->dg, &sc->cap_dg, p->d0 + (cnt ? cnt : 1), sizeof *sc->dg))
    return KVF_ENOMEM;
  wire_digest *d = sc->dg + p->d0;
  p->nd = cnt;
  if (plain) return 0;
  for (size_t i = 0; i < p->nw; i++) {
    const kvf_write *w = &sc->w[p->w0 + i];
    uint64_t count = w->count > 1 ? w->count : 1;
    d[i] =
        (wire_digest){w->dst, w->len, count, w->dst_stride, kvf__hash_block(w->src, w->len, count, w->src_stride)};
  }
  return 0;
}

/* A whole-page part's digest entries, from the send-time page digests of
 * its pages (waited for). */
static void part_fill(prefill_state *ps, pf_scratch *sc, const pf_send *s, pf_part *p) {
  const manager_buffers *b = &ps->m->bufs;
  const pf_chunk *c = s->c;
  kvf__pf_wait_hashed(ps, c, sc->skip + p->a + p->n);
  const uint64_t *pdig = part_pdig(sc, c, p->a);
  wire_digest *d = sc->dg + p->d0;
  for (size_t i = 0; i < p->n; i++) {
    int64_t dst = wire_i64_at(s->info->m2->kv_indices, (size_t)sc->dstart + p->a + i);
    for (size_t j = 0; j < c->ndig; j++) {
      size_t bi = c->dig_bufs[j];
      uint64_t item = b->kv_item_lens[bi];
      d[i * c->ndig + j] = (wire_digest){sc->dptr[bi] + (uint64_t)dst * item, item, 1, 0, pdig[i * c->ndig + j]};
    }
  }
}

/* After the write: the chunk's source pages [first, first + n) still hold
 * what kvf_sender_send hashed, or the room fails naming the first page that
 * changed. */
static int recheck_sources(prefill_state *ps, const pf_chunk *c, size_t first, size_t n, char *why,
                           size_t whycap) {
  kvf__pf_wait_hashed(ps, c, first + n);
  const int64_t *src = c->pages + first;
  const uint64_t *pdig = c->digests + first * c->ndig;
  for (size_t i = 0; i < n; i++)
    for (size_t j = 0; j < c->ndig; j++) {
      uint64_t h = 0;
      if (kvf__integ_page_digest(ps->m, c->dig_bufs[j], src[i], &h) == 0 && h == pdig[i * c->ndig + j]) continue;
      snprintf(why, whycap,
               "Integrity check failed: source page %" PRId64 " of KV buffer %zu changed while room %" PRId64
               " was being sent (the page was reused before its transfer completed)",
               src[i], c->dig_bufs[j], c->r->room);
      atomic_fetch_add(&ps->m->stats.verify_failures, 1);
      return KVF_ESTATE;
    }
  return 0;
}

int kvf__pf_recheck_chunk(prefill_state *ps, const pf_chunk *c, char *why, size_t whycap) {
  return c->digests ? recheck_sources(ps, c, 0, c->npages, why, whycap) : 0;
}

int kvf__pf_verify_send(prefill_state *ps, pf_scratch *sc, pf_send *s, char *why, size_t whycap) {
  kvf_manager *m = ps->m;
  const pf_chunk *c = s->c;
  const wire_m2 *x = s->info->m2;
  int ask = (x->room_flags & WIRE_ROOM_VERIFY) != 0, rc = 0, ret = DEST_OK;
  kvf_batch_opts opts;
  kvf__pf_fence_opts(x, &opts);
  size_t nd = 0;
  for (size_t g = 0; g < sc->nparts; g++) {
    pf_part *p = &sc->parts[g];
    p->batch = NULL, p->d0 = nd, p->nd = 0;
    if (!p->nw) continue;
    if (ask && (rc = part_digests(sc, s, p))) {
      snprintf(why, whycap, "Out of memory");
      ret = DEST_FAIL;
      break;
    }
    nd += p->nd;
    if ((rc = kvf_engine_submit_ex(m->engine, x->session, sc->w + p->w0, p->nw, &opts, &p->batch))) {
      ret = kvf__pf_xfer_failed(c->r, x, rc, why, whycap);
      break;
    }
  }
  kvf__pf_wait_begin(sc);
  for (size_t g = 0; ret == DEST_OK && g < sc->nparts; g++) {
    pf_part *p = &sc->parts[g];
    if (!p->batch) continue;
    if ((rc = kvf__pf_batch_wait(sc, p->batch))) {
      ret = kvf__pf_xfer_failed(c->r, x, rc, why, whycap);
      break;
    }
    /* Not rechecked here when the decode checks the send-time digests:
     * whatever the source held when it was read, the decode finds it. */
    if (!p->state && c->digests && !(c->recheck_late && ask && part_plain(p, s->info)) &&
        recheck_sources(ps, c, sc->skip + p->a, p->n, why, whycap)) {
      ret = DEST_FAIL;
      break;
    }
    if (ask && part_from_pages(s, p)) part_fill(ps, sc, s, p);
    if (ask) kvf__integ_send_digests(m, x->endpoint, x->dst_port, x->room, x->fence_epoch, sc->dg + p->d0, p->nd);
    s->bytes += kvf__pf_writes_bytes(sc->w + p->w0, p->nw);
  }
  for (size_t g = 0; g < sc->nparts; g++) { /* waits for a part still in flight after an error */
    kvf_batch_destroy(sc->parts[g].batch);
    sc->parts[g].batch = NULL;
  }
  kvf__pf_wait_end(sc);
  return ret;
}

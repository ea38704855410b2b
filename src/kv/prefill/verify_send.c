/* The verify-mode path (docs/WIRE-EXTENSIONS.md, integrity): a chunk whose
 * pages were hashed, or whose decode asked for digests, is planned per call
 * and written in PF_VERIFY_PARTS parts, so rechecking the sources and the
 * decode's digest checks overlap the transfer. */
#include "kv/prefill/prefill_int.h"

/* Plan and write one set of page pairs (KV when state == 0, state slots
 * otherwise) to the destination. Arrays are sized once per call. */
/* Verify mode and fencing for one write_pairs call: the chunk's page digests
 * for the pairs (pdig[i * nb + j]: pair i, buffer bufs[j]; NULL = verify
 * mode off here), and whether the decode asked for digests. */
typedef struct pf_integ {
  const uint64_t *pdig;
  const size_t *bufs;
  size_t nb;
  int late; /* the worker rechecks the sources after the M3s (pf_chunk.recheck_late) */
} pf_integ;

/* The digest entries of what `w` writes, for a decode that asked: from the
 * page digests when the plan moves whole pages (no second pass), else by
 * hashing each block's source pieces now, just before the write. */
static wire_digest *write_digests(prefill_state *ps, const kvf_write *w, size_t nw, const pf_integ *vi, int plain,
                                  const int64_t *dst, size_t n, const uint64_t *dst_ptrs, size_t *nd) {
  const manager_buffers *b = &ps->m->bufs;
  size_t cnt = plain && vi->pdig ? n * vi->nb : nw;
  wire_digest *d = malloc((cnt ? cnt : 1) * sizeof *d);
  if (!d) return NULL;
  if (plain && vi->pdig) {
    for (size_t i = 0; i < n; i++)
      for (size_t j = 0; j < vi->nb; j++) {
        size_t bi = vi->bufs[j];
        uint64_t item = b->kv_item_lens[bi];
        d[i * vi->nb + j] =
            (wire_digest){dst_ptrs[bi] + (uint64_t)dst[i] * item, item, 1, 0, vi->pdig[i * vi->nb + j]};
      }
  } else {
    for (size_t i = 0; i < nw; i++) {
      uint64_t count = w[i].count > 1 ? w[i].count : 1;
      d[i] = (wire_digest){w[i].dst, w[i].len, count, w[i].dst_stride,
                           kvf__hash_block(w[i].src, w[i].len, count, w[i].src_stride)};
    }
  }
  *nd = cnt;
  return d;
}

/* After the write: every source page still holds what kvf_sender_send
 * hashed, or the room fails naming the first page that changed. */
static int recheck_sources(prefill_state *ps, const pf_integ *vi, const int64_t *src, size_t n, int64_t room,
                           char *why, size_t whycap) {
  for (size_t i = 0; i < n; i++)
    for (size_t j = 0; j < vi->nb; j++) {
      uint64_t h = 0;
      if (kvf__integ_page_digest(ps->m, vi->bufs[j], src[i], &h) == 0 && h == vi->pdig[i * vi->nb + j]) continue;
      snprintf(why, whycap,
               "Integrity check failed: source page %" PRId64 " of KV buffer %zu changed while room %" PRId64
               " was being sent (the page was reused before its transfer completed)",
               src[i], vi->bufs[j], room);
      atomic_fetch_add(&ps->m->stats.verify_failures, 1);
      return KVF_ESTATE;
    }
  return 0;
}

int kvf__pf_recheck_chunk(prefill_state *ps, const pf_chunk *c, char *why, size_t whycap) {
  pf_integ vi = {c->digests, c->dig_bufs, c->ndig, 0};
  return c->digests ? recheck_sources(ps, &vi, c->pages, c->npages, c->r->room, why, whycap) : 0;
}

/* Plan the engine blocks of n page pairs: *w (malloc'd, NULL when nothing
 * to write) holds *nw blocks. */
static int plan_pairs(prefill_state *ps, int state, size_t l0, size_t l1, const int64_t *src, const int64_t *dst,
                      size_t n, const uint64_t *dst_ptrs, const wire_fragment *frags, size_t nfrags, int frag_mode,
                      int64_t tokens, kvf_write **wout, size_t *nwout) {
  const manager_buffers *b = &ps->m->bufs;
  const plan_layout *lay = state ? &ps->st_lay : &ps->kv_lay;
  plan_mem sm = {state ? b->state_ptrs : b->kv_ptrs, state ? b->state_lens : b->kv_lens,
                 state ? b->n_state : b->n_kv};
  plan_mem dm = {dst_ptrs, NULL, sm.nbufs};
  const uint64_t *item = state ? b->state_item_lens : b->kv_item_lens;
  plan_run *runs = malloc((n ? n : 1) * sizeof *runs);
  kvf_write *w = NULL;
  size_t nruns = 0, nw = 0, cap;
  int rc = runs ? kvf__plan_runs(src, dst, n, runs, &nruns) : KVF_ENOMEM;
  if (rc) goto out;
  /* Per-token fragments (tokens > 1): a run of r pages is r*tokens token
   * slots of the per-token stride, so each (fragment, run) stays one
   * strided block of r*tokens pieces. */
  for (size_t k = 0; tokens > 1 && k < nruns; k++)
    if (__builtin_mul_overflow(runs[k].src, tokens, &runs[k].src) ||
        __builtin_mul_overflow(runs[k].dst, tokens, &runs[k].dst) ||
        __builtin_mul_overflow(runs[k].len, tokens, &runs[k].len)) {
      rc = KVF_ERANGE;
      goto out;
    }
  if (state) l0 = 0, l1 = lay->nlayers;
  cap = frag_mode ? kvf__plan_frag_count(lay, l0, l1, frags, nfrags, state, runs, nruns)
                  : kvf__plan_plain_count(lay, l0, l1, nruns);
  if (!cap) goto out;
  if (!(w = malloc(cap * sizeof *w))) {
    rc = KVF_ENOMEM;
    goto out;
  }
  rc = frag_mode ? kvf__plan_frag_writes(lay, l0, l1, frags, nfrags, state, runs, nruns, &sm, &dm, w, cap, &nw)
                 : kvf__plan_plain_writes(lay, l0, l1, runs, nruns, &sm, &dm, item, w, cap, &nw);
out:
  free(runs);
  if (rc) {
    free(w);
    w = NULL, nw = 0;
  }
  *wout = w;
  *nwout = nw;
  return rc;
}

/* One part of a write_pairs call: pairs [a, a + n), its blocks, its batch
 * and the digests that go to the decode once it landed. */
typedef struct pf_part {
  size_t a, n;
  kvf_write *w;
  size_t nw;
  kvf_batch *batch;
  wire_digest *dg;
  size_t ndg;
} pf_part;

/* Verify mode cuts a call into this many parts, submitted at once and
 * finished in order: while later parts are on the wire, the prefill
 * rechecks the sources of the parts that landed and the decode checks
 * their digests, so hashing overlaps the transfer instead of following it. */
#define PF_VERIFY_PARTS 16

static int write_pairs(prefill_state *ps, const wire_m2 *x, int state, size_t l0, size_t l1, const int64_t *src,
                       const int64_t *dst, size_t n, const uint64_t *dst_ptrs, const wire_fragment *frags,
                       size_t nfrags, int frag_mode, int64_t tokens, const pf_integ *vi, uint64_t *bytes,
                       char *why, size_t whycap, int *xfer) {
  kvf_manager *m = ps->m;
  int have_reason = 0, ask = (x->room_flags & WIRE_ROOM_VERIFY) != 0, plain = !state && !frag_mode && tokens == 1;
  kvf_batch_opts opts;
  kvf_batch_opts_init(&opts);
  if (x->fence_epoch && manager_room_tag(x->room))
    opts.tag = manager_room_tag(x->room), opts.epoch = x->fence_epoch;
  size_t nparts = (ask || vi->pdig) && n >= PF_VERIFY_PARTS ? PF_VERIFY_PARTS : 1, per = (n + nparts - 1) / nparts;
  pf_part *parts = calloc(nparts, sizeof *parts);
  int rc = parts ? 0 : KVF_ENOMEM;
  for (size_t g = 0; !rc && g < nparts; g++) {
    pf_part *p = &parts[g];
    p->a = g * per < n ? g * per : n;
    p->n = n - p->a < per ? n - p->a : per;
    rc = plan_pairs(ps, state, l0, l1, src + p->a, dst + p->a, p->n, dst_ptrs, frags, nfrags, frag_mode, tokens,
                    &p->w, &p->nw);
    if (rc || !p->nw) continue;
    if (ask) {
      pf_integ pv = {vi->pdig ? vi->pdig + p->a * vi->nb : NULL, vi->bufs, vi->nb, vi->late};
      if (!(p->dg = write_digests(ps, p->w, p->nw, &pv, plain, dst + p->a, p->n, dst_ptrs, &p->ndg))) {
        rc = KVF_ENOMEM;
        break;
      }
    }
    if ((rc = kvf_engine_submit_ex(m->engine, x->session, p->w, p->nw, &opts, &p->batch))) *xfer = 1;
  }
  for (size_t g = 0; !rc && g < nparts; g++) {
    pf_part *p = &parts[g];
    if (!p->batch) continue;
    if ((rc = kvf_batch_wait(p->batch, -1))) {
      *xfer = 1;
      break;
    }
    pf_integ pv = {vi->pdig ? vi->pdig + p->a * vi->nb : NULL, vi->bufs, vi->nb, vi->late};
    /* Not rechecked here when the decode checks the send-time digests:
     * whatever the source held when it was read, the decode finds it. */
    if (!state && pv.pdig && !(vi->late && ask && plain) &&
        (rc = recheck_sources(ps, &pv, src + p->a, p->n, x->room, why, whycap))) {
      have_reason = 1;
      break;
    }
    if (p->dg) kvf__integ_send_digests(m, x->endpoint, x->dst_port, x->room, x->fence_epoch, p->dg, p->ndg);
    *bytes += kvf__pf_writes_bytes(p->w, p->nw);
  }
  if (*xfer && rc == KVF_ESTATE &&
      opts.tag) { /* refused by the decode's fence: the room, not the session, is gone */
    snprintf(why, whycap, "The decode fenced room %" PRId64 " (it failed or dropped it there): write refused",
             x->room);
    *xfer = 0;
    have_reason = 1;
  } else if (*xfer) {
    snprintf(why, whycap, "%s", kvf_strerror(rc)); /* completed by kvf__pf_send_to_dest */
  }
  for (size_t g = 0; parts && g < nparts; g++) {
    kvf_batch_destroy(parts[g].batch); /* waits for a part still in flight after an error */
    free(parts[g].w);
    free(parts[g].dg);
  }
  free(parts);
  if (rc && !*xfer && !have_reason)
    snprintf(why, whycap, "%s pages of the chunk cannot be mapped onto decode session %s: %s",
             state ? "State" : "KV", x->session, kvf_strerror(rc));
  return rc;
}

/* One chunk to one real destination (§6.3-§6.6). DEST_FAIL with a reason,
 * or DEST_XFER_FAIL when the engine refused or failed the write. */
int kvf__pf_send_to_dest(prefill_state *ps, const pf_chunk *c, const pf_info *info, uint64_t *bytes, char *why,
                         size_t whycap) {
  const wire_m2 *x = info->m2;
  kvf_manager *m = ps->m;
  const manager_buffers *b = &m->bufs;
  int64_t page_size = m->cfg.page_size, now = clock_now_ns();
  uint64_t *dptr = NULL, *sptr = NULL;
  size_t nsptr = 0;
  int64_t *src = NULL, *dst = NULL;
  const wire_fragment *frags = info->frags;
  int ret = DEST_FAIL, xfer = 0;

  pthread_mutex_lock(&ps->lock);
  pf_reg *reg = kvf__pf_usable_reg_locked(ps, x->session, now, why, whycap);
  if (reg) {
    nsptr = reg->m1->state_ptrs.count;
    dptr = malloc(b->n_kv * sizeof *dptr);
    sptr = malloc((nsptr ? nsptr : 1) * sizeof *sptr);
    for (size_t i = 0; dptr && i < b->n_kv; i++) dptr[i] = wire_u64_at(reg->m1->kv_ptrs, i);
    for (size_t i = 0; sptr && i < nsptr; i++) sptr[i] = wire_u64_at(reg->m1->state_ptrs, i);
    ret = DEST_OK;
  }
  pthread_mutex_unlock(&ps->lock);
  if (ret != DEST_OK) goto out;
  ret = DEST_FAIL;
  if (!dptr || !sptr) {
    snprintf(why, whycap, "Out of memory");
    goto out;
  }
  if (x->decode_prefix_len % page_size) {
    snprintf(why, whycap, "decode_prefix_len %" PRId64 " is not a multiple of page_size %" PRId64,
             x->decode_prefix_len, page_size);
    goto out;
  }
  int64_t tokens = info->tokens;
  if (tokens < 1) { /* the plan was refused when the M2 arrived */
    snprintf(why, whycap, "%s", info->plan_why);
    goto out;
  }

  /* §6.8 and §6.3: the chunk's pages the decode still needs, and where. */
  size_t skip, n;
  int64_t dstart;
  kvf__pf_dest_window(c, x, page_size, &skip, &dstart, &n);
  if (n) {
    src = malloc(n * sizeof *src);
    dst = malloc(n * sizeof *dst);
    if (!src || !dst) {
      snprintf(why, whycap, "Out of memory");
      goto out;
    }
    memcpy(src, c->pages + skip, n * sizeof *src);
    for (size_t k = 0; k < n; k++) dst[k] = wire_i64_at(x->kv_indices, (size_t)dstart + k);
    pf_integ vi = {c->digests ? c->digests + skip * c->ndig : NULL, c->dig_bufs, c->ndig, c->recheck_late};
    if (write_pairs(ps, x, 0, c->layer_begin, c->layer_end, src, dst, n, dptr, frags, x->nfrags, x->nfrags > 0,
                    tokens, &vi, bytes, why, whycap, &xfer))
      goto out;
  }

  /* §6.6: state slots in non-layerwise mode, last chunk only. */
  if (c->is_last && b->n_state && nsptr && c->nstate && x->mamba_indices.count) {
    size_t nm = x->mamba_indices.count, np = 0;
    if (!kvf__pf_state_counts_ok(x, nsptr, b->n_state, c->nstate, why, whycap)) goto out;
    free(src), free(dst);
    src = malloc(nm * sizeof *src);
    dst = malloc(nm * sizeof *dst);
    if (!src || !dst) {
      snprintf(why, whycap, "Out of memory");
      goto out;
    }
    for (size_t k = 0; k < nm; k++) {
      int64_t s = c->state_slots[c->nstate == 1 ? 0 : k], d = wire_i64_at(x->mamba_indices, k);
      if (s < 0 || d < 0) continue;
      src[np] = s, dst[np] = d, np++;
    }
    /* §8 item 11: with a fragment plan, state goes through it too; a rank
     * whose plan has no state fragment writes no state (the reference
     * would send whole slots of its own, possibly larger, item size). */
    pf_integ none = {NULL, NULL, 0, 0};
    if (np && write_pairs(ps, x, 1, 0, 0, src, dst, np, sptr, frags, x->nfrags, x->nfrags > 0, 1, &none, bytes,
                          why, whycap, &xfer))
      goto out;
  }
  ret = DEST_OK;
out:
  if (ret != DEST_OK && xfer) {
    char err[128];
    snprintf(err, sizeof err, "%.120s", why);
    snprintf(why, whycap, "Failed to send kv chunk of %" PRId64 " to %s:%u (%s)", c->r->room, x->endpoint,
             (unsigned)x->dst_port, err);
    ret = DEST_XFER_FAIL;
  }
  free(src), free(dst), free(dptr), free(sptr);
  return ret;
}

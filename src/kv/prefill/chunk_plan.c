/* The chunk planner (PROTOCOL §6.3-§6.8): one chunk's page pairs to one
 * destination's engine writes, through the M2's fragments (used as they
 * are, or cut per token once when the M2 arrives) and per-worker grow-only scratch
 * arrays, so the hot path does not allocate; plus the fence options, the
 * completion trailer and the worker path's write to one destination. */
#include "kv/prefill/prefill_int.h"

uint64_t kvf__pf_writes_bytes(const kvf_write *w, size_t n) {
  uint64_t b = 0;
  for (size_t i = 0; i < n; i++) b += w[i].len * (w[i].count > 1 ? w[i].count : 1);
  return b;
}

/* Token-major pages ([token][head][dim], our MHA pool) hold a head range
 * contiguously only per token. A plan that cuts a byte range out of each
 * page (§6.5.7 caveat) is therefore cut per token when the decode says its
 * pages are token-major with our page size (kvferry's M2 frame 14): each
 * KV fragment is rescaled to one token (strides, offsets and bytes / P)
 * and the caller scales page runs to token runs. A slicing plan without
 * that frame, or with another page size, would land wrong bytes: refused.
 * Whole-page fragments (replicated buffers) and page_size 1 need nothing.
 * Returns the tokens per page to scale by (1 = plain: the fragments are
 * used as they are), or 0 with a reason, or -1 without memory; when it
 * returns P > 1, *cut is a malloc'd per-token copy of the n fragments. */
int64_t kvf__pf_per_token(const wire_fragment *f, size_t n, int64_t P, int64_t layout, wire_fragment **cut,
                          char *why, size_t whycap) {
  if (P <= 1 || !kvf__plan_frags_slice_pages(f, n)) return 1;
  if (layout != P) {
    if (layout)
      snprintf(why, whycap,
               "Refusing a heterogeneous-TP plan: the decode's pages hold %" PRId64
               " tokens, this prefill's %" PRId64,
               layout, P);
    else
      snprintf(why, whycap,
               "Refusing a heterogeneous-TP plan that cuts head ranges out of whole pages: with "
               "page_size %" PRId64 " and token-major pages that would write wrong bytes (the decode sent no "
               "page layout)",
               P);
    return 0;
  }
  for (size_t i = 0; i < n; i++) {
    const wire_fragment *g = &f[i];
    if (g->buffer_kind == WIRE_KIND_MAMBA_STATE) continue;
    if (g->src_page_stride_bytes % P || g->dst_page_stride_bytes % P || g->src_byte_offset % P ||
        g->dst_byte_offset % P || g->bytes_per_page % P || (g->page_count >= 0 && g->page_count > INT64_MAX / P)) {
      snprintf(why, whycap,
               "Refusing a fragment of buffer %u: its slice does not split into %" PRId64 " equal token slices",
               (unsigned)g->buffer_index, P);
      return 0;
    }
  }
  wire_fragment *t = malloc(n * sizeof *t);
  if (!t) return -1;
  for (size_t i = 0; i < n; i++) {
    wire_fragment *g = &t[i];
    *g = f[i];
    if (g->buffer_kind == WIRE_KIND_MAMBA_STATE) continue;
    g->src_page_stride_bytes /= P, g->dst_page_stride_bytes /= P;
    g->src_byte_offset /= P, g->dst_byte_offset /= P;
    g->bytes_per_page /= P;
    if (g->page_count >= 0) g->page_count *= P;
  }
  *cut = t;
  return P;
}

/* Can the chunk's state slots go to this destination: the decode registered
 * as many state buffers as this rank has, and sends one slot or as many as
 * the chunk? 0 with the reason otherwise. */
int kvf__pf_state_counts_ok(const wire_m2 *x, size_t nsptr, size_t n_state, size_t nstate, char *why,
                            size_t whycap) {
  if (nsptr != n_state) {
    snprintf(why, whycap, "Decode session %s registered %zu state buffers, this prefill rank has %zu", x->session,
             nsptr, n_state);
    return 0;
  }
  if (nstate != x->mamba_indices.count && nstate != 1) {
    snprintf(why, whycap, "State slot counts differ: %zu on prefill, %zu on decode", nstate,
             (size_t)x->mamba_indices.count);
    return 0;
  }
  return 1;
}

/* The decode session's registration if writes to it may go ahead (it is
 * registered, not blocked by the failed-session TTL, with our buffer count);
 * NULL with the reason otherwise. With ps->lock held. */
pf_reg *kvf__pf_usable_reg_locked(prefill_state *ps, const char *session, int64_t now, char *why, size_t whycap) {
  kvf_manager *m = ps->m;
  pf_reg *reg = kvf__smap_get(&ps->regs, session);
  if (!reg) {
    snprintf(why, whycap, "Decode session %s is not registered", session);
  } else if (reg->failed_ns && m->cfg.failed_session_ttl_s > 0 &&
             now - reg->failed_ns < (int64_t)(m->cfg.failed_session_ttl_s * 1e9)) {
    snprintf(why, whycap, "Decode instance could be dead, remote mooncake session %s is not alive", session);
  } else if (reg->m1->kv_ptrs.count != m->bufs.n_kv) {
    snprintf(why, whycap, "Decode session %s registered %zu KV buffers, this prefill rank has %zu", session,
             reg->m1->kv_ptrs.count, m->bufs.n_kv);
  } else {
    if (reg->failed_ns) reg->failed_ns = 0; /* the TTL passed */
    return reg;
  }
  return NULL;
}

/* Grow a scratch array to hold `need` elements of `elem` bytes. Arrays only
 * grow, so a worker stops allocating once it has seen its largest chunk. */
int kvf__pf_scratch_grow(void **p, size_t *cap, size_t need, size_t elem) {
  if (need <= *cap) return 0;
  size_t nc = *cap * 2 > need ? *cap * 2 : need;
  void *q = realloc(*p, nc * elem);
  if (!q) return KVF_ENOMEM;
  *p = q;
  *cap = nc;
  return 0;
}

void kvf__pf_dest_writes_free(pf_dest_writes *dw) {
  free(dw->infos), free(dw->batches), free(dw->dbytes);
  memset(dw, 0, sizeof *dw);
}

void kvf__pf_scratch_free(pf_scratch *sc) {
  free(sc->dptr), free(sc->sptr), free(sc->src), free(sc->dst), free(sc->runs), free(sc->w);
  kvf__pf_dest_writes_free(&sc->dw);
  free(sc->done), free(sc->res);
  memset(sc, 0, sizeof *sc);
}

/* Sized once: the destination pointer lists (n_kv, n_state entries). */
int kvf__pf_scratch_init(pf_scratch *sc, const manager_buffers *b) {
  memset(sc, 0, sizeof *sc);
  sc->dptr = malloc((b->n_kv ? b->n_kv : 1) * sizeof *sc->dptr);
  sc->sptr = malloc((b->n_state ? b->n_state : 1) * sizeof *sc->sptr);
  return sc->dptr && sc->sptr ? 0 : KVF_ENOMEM;
}

/* The M2's plan, once, when it arrives: its fragments, cut per token when
 * the pages are token-major. info->tokens = 0 when the plan is refused
 * (reason in plan_why: its rooms fail when a chunk is sent). KVF_ENOMEM
 * only without memory. */
int kvf__pf_info_plan(kvf_manager *m, pf_info *info) {
  const wire_m2 *x = info->m2;
  info->tokens = 1;
  info->frags = x->frags;
  if (!x->nfrags || x->is_dummy) return 0;
  info->tokens = kvf__pf_per_token(x->frags, x->nfrags, m->cfg.page_size, x->page_layout, &info->frags_cut,
                                   info->plan_why, sizeof info->plan_why);
  if (info->tokens < 0) return KVF_ENOMEM;
  if (info->frags_cut) info->frags = info->frags_cut;
  return 0;
}

/* Plan one set of page pairs (KV when state == 0, state slots otherwise) to
 * the destination, appending the writes to sc->w. Uses only sc's arrays. */
static int plan_pairs_sc(prefill_state *ps, pf_scratch *sc, const wire_m2 *x, int state, size_t l0, size_t l1,
                         const int64_t *src, const int64_t *dst, size_t n, const uint64_t *dst_ptrs,
                         const wire_fragment *frags, size_t nfrags, int frag_mode, int64_t tokens, char *why,
                         size_t whycap) {
  kvf_manager *m = ps->m;
  const manager_buffers *b = &m->bufs;
  /* state 2: state buffers of KV layers [l0, l1) (state_layer_ids) */
  const plan_layout *lay = state == 2 ? &ps->stl_lay : state ? &ps->st_lay : &ps->kv_lay;
  plan_mem sm = {state ? b->state_ptrs : b->kv_ptrs, state ? b->state_lens : b->kv_lens,
                 state ? b->n_state : b->n_kv};
  plan_mem dm = {dst_ptrs, NULL, sm.nbufs};
  const uint64_t *item = state ? b->state_item_lens : b->kv_item_lens;
  size_t nruns = 0, nw = 0, cap;
  int rc = kvf__pf_scratch_grow((void **)&sc->runs, &sc->cap_runs, n ? n : 1, sizeof *sc->runs);
  if (!rc) rc = kvf__plan_runs(src, dst, n, sc->runs, &nruns);
  if (rc) goto out;
  plan_run *runs = sc->runs;
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
  if (state == 1) l0 = 0, l1 = lay->nlayers;
  cap = frag_mode ? kvf__plan_frag_count(lay, l0, l1, frags, nfrags, state, runs, nruns)
                  : kvf__plan_plain_count(lay, l0, l1, nruns);
  if (!cap) goto out;
  if ((rc = kvf__pf_scratch_grow((void **)&sc->w, &sc->cap_w, sc->nw + cap, sizeof *sc->w))) goto out;
  kvf_write *w = sc->w + sc->nw;
  rc = frag_mode ? kvf__plan_frag_writes(lay, l0, l1, frags, nfrags, state, runs, nruns, &sm, &dm, w, cap, &nw)
                 : kvf__plan_plain_writes(lay, l0, l1, runs, nruns, &sm, &dm, item, w, cap, &nw);
  if (!rc) sc->nw += nw;
out:
  if (rc)
    snprintf(why, whycap, "%s pages of the chunk cannot be mapped onto decode session %s: %s",
             state ? "State" : "KV", x->session, kvf_strerror(rc));
  return rc;
}

/* §6.8: skip the pages the decode already holds (its prefix, unless the
 * chunk names its destination indices); position p maps to destination index
 * p - P. Then truncate to what both sides have (§6.3): *n pages from
 * c->pages + *skip go to the M2's kv_indices from *dstart. */
void kvf__pf_dest_window(const pf_chunk *c, const wire_m2 *x, int64_t page_size, size_t *skip, int64_t *dstart,
                         size_t *n) {
  int64_t prefix = c->explicit_idx ? 0 : x->decode_prefix_len / page_size;
  *skip =
      c->pos < prefix ? (size_t)(prefix - c->pos < (int64_t)c->npages ? prefix - c->pos : (int64_t)c->npages) : 0;
  *dstart = c->pos + (int64_t)*skip - prefix;
  size_t ndst = x->kv_indices.count, nsrc = c->npages - *skip;
  size_t avail = (uint64_t)*dstart < ndst ? ndst - (size_t)*dstart : 0;
  *n = nsrc < avail ? nsrc : avail;
}

/* Plan one chunk to one real destination (§6.3-§6.6): sc->w[0..sc->nw)
 * holds the writes (KV, then state slots) afterwards. DEST_FAIL with a
 * reason; DEST_OK otherwise. No allocation beyond sc's grow-only arrays. */
int kvf__pf_plan_dest(prefill_state *ps, pf_scratch *sc, const pf_chunk *c, const pf_info *info, char *why,
                      size_t whycap) {
  kvf_manager *m = ps->m;
  const wire_m2 *x = info->m2;
  const manager_buffers *b = &m->bufs;
  int64_t page_size = m->cfg.page_size, now = clock_now_ns();
  size_t nsptr = 0;
  int ret = DEST_FAIL;
  sc->nw = 0;

  pthread_mutex_lock(&ps->lock);
  pf_reg *reg = kvf__pf_usable_reg_locked(ps, x->session, now, why, whycap);
  if (reg) {
    nsptr = reg->m1->state_ptrs.count;
    for (size_t i = 0; i < b->n_kv; i++) sc->dptr[i] = wire_u64_at(reg->m1->kv_ptrs, i);
    for (size_t i = 0; i < nsptr && i < b->n_state; i++) sc->sptr[i] = wire_u64_at(reg->m1->state_ptrs, i);
    ret = DEST_OK;
  }
  pthread_mutex_unlock(&ps->lock);
  if (ret != DEST_OK) return ret;
  ret = DEST_FAIL;
  if (x->decode_prefix_len % page_size) {
    snprintf(why, whycap, "decode_prefix_len %" PRId64 " is not a multiple of page_size %" PRId64,
             x->decode_prefix_len, page_size);
    return ret;
  }
  if (info->tokens < 1) { /* the plan was refused when the M2 arrived */
    snprintf(why, whycap, "%s", info->plan_why);
    return ret;
  }
  const wire_fragment *frags = info->frags;

  /* §6.8 and §6.3: the chunk's pages the decode still needs, and where. */
  size_t skip, n;
  int64_t dstart;
  kvf__pf_dest_window(c, x, page_size, &skip, &dstart, &n);
  if (n) {
    if (kvf__pf_scratch_grow((void **)&sc->dst, &sc->cap_dst, n, sizeof *sc->dst)) {
      snprintf(why, whycap, "Out of memory");
      return ret;
    }
    for (size_t k = 0; k < n; k++) sc->dst[k] = wire_i64_at(x->kv_indices, (size_t)dstart + k);
    if (plan_pairs_sc(ps, sc, x, 0, c->layer_begin, c->layer_end, c->pages + skip, sc->dst, n, sc->dptr, frags,
                      x->nfrags, x->nfrags > 0, info->tokens, why, whycap))
      return ret;
  }

  /* §6.6: state slots, with the chunk that carries them (the last chunk, or
   * a layerwise chunk of the layer group they belong to). */
  if (b->n_state && nsptr && c->nstate && x->mamba_indices.count) {
    size_t nm = x->mamba_indices.count, np = 0;
    if (!kvf__pf_state_counts_ok(x, nsptr, b->n_state, c->nstate, why, whycap)) return ret;
    if (kvf__pf_scratch_grow((void **)&sc->src, &sc->cap_src, nm, sizeof *sc->src) ||
        kvf__pf_scratch_grow((void **)&sc->dst, &sc->cap_dst, nm, sizeof *sc->dst)) {
      snprintf(why, whycap, "Out of memory");
      return ret;
    }
    for (size_t k = 0; k < nm; k++) {
      int64_t s = c->state_slots[c->nstate == 1 ? 0 : k], d = wire_i64_at(x->mamba_indices, k);
      if (s < 0 || d < 0) continue;
      sc->src[np] = s, sc->dst[np] = d, np++;
    }
    /* §8 item 11: with a fragment plan, state goes through it too; a rank
     * whose plan has no state fragment writes no state (the reference
     * would send whole slots of its own, possibly larger, item size). */
    /* A layerwise chunk with state_layer_ids: the state of its layer group. */
    int by_layer = c->explicit_idx && ps->stl_lay.nlayers;
    if (np && plan_pairs_sc(ps, sc, x, by_layer ? 2 : 1, c->layer_begin, c->layer_end, sc->src, sc->dst, np,
                            sc->sptr, frags, x->nfrags, x->nfrags > 0, 1, why, whycap))
      return ret;
  }
  return DEST_OK;
}

/* The decode's fence for its room (issue 16), as engine batch options:
 * untagged when it asked for none. */
void kvf__pf_fence_opts(const wire_m2 *x, kvf_batch_opts *opts) {
  kvf_batch_opts_init(opts);
  if (x->fence_epoch && manager_room_tag(x->room))
    opts->tag = manager_room_tag(x->room), opts->epoch = x->fence_epoch;
}

/* The reason for a failed engine write to one destination. */
void kvf__pf_xfer_why(const pf_room *r, const wire_m2 *x, int rc, char *why, size_t whycap) {
  snprintf(why, whycap, "Failed to send kv chunk of %" PRId64 " to %s:%u (%s)", r->room, x->endpoint,
           (unsigned)x->dst_port, kvf_strerror(rc));
}

/* A room's completion as an engine trailer to destination x (docs/WIRE-
 * EXTENSIONS.md, "completion rides the data"), when it may ride: x asked
 * for it (M2 frame 15), x is the room's only real destination and needs no
 * other, and the first token is known. Its length, or 0: the M3, which
 * goes out either way, then completes the room alone. */
size_t kvf__pf_completion_trailer(prefill_state *ps, int64_t room, const wire_m2 *x, size_t nreal, int64_t token,
                                  const int32_t *cands, size_t ncand, unsigned char *out, size_t cap) {
  if (!(x->room_flags & WIRE_ROOM_FAST_COMPLETION) || nreal != 1 || x->required_dst_info_num != 1 ||
      token == PF_TOKEN_LATER)
    return 0;
  wire_m3 m3 = {.room = room,
                .status = ROOM_SUCCESS,
                .prefill_rank = ps->m->tp_rank,
                .bootstrap_token = token,
                .candidates = wire_array_of(cands, cands ? ncand : 0)};
  wire_msg msg;
  char why[WIRE_REASON_LEN];
  if (kvf__wire_m3_encode(&m3, &msg, why)) return 0;
  size_t len = kvf__trailer_pack(ps->m, &msg, out, cap);
  kvf__wire_msg_free(&msg);
  return len;
}

/* One chunk to one real destination, planned and submitted (worker path):
 * *out is the engine write in flight (NULL when there is nothing to write),
 * *bytes its size. DEST_FAIL with a reason, or DEST_XFER_FAIL when the
 * engine refused the write. The blocks are copied at submit, so sc's arrays
 * serve the next destination at once. */
int kvf__pf_submit_dest(prefill_state *ps, pf_scratch *sc, const pf_chunk *c, const pf_info *info, size_t nreal,
                        kvf_batch **out, uint64_t *bytes, char *why, size_t whycap) {
  *out = NULL;
  int ret = kvf__pf_plan_dest(ps, sc, c, info, why, whycap);
  if (ret != DEST_OK || !sc->nw) return ret;
  unsigned char tb[KVF_ENGINE_MAX_TRAILER];
  size_t tlen = c->is_last ? kvf__pf_completion_trailer(ps, c->r->room, info->m2, nreal, c->token, c->cands,
                                                        c->ncand, tb, sizeof tb)
                           : 0;
  kvf_batch_opts opts;
  kvf__pf_fence_opts(info->m2, &opts);
  int rc = kvf__engine_submit_trailer(ps->m->engine, info->m2->session, sc->w, sc->nw, &opts, tlen ? tb : NULL,
                                      tlen, out);
  if (rc) {
    kvf__pf_xfer_why(c->r, info->m2, rc, why, whycap);
    return DEST_XFER_FAIL;
  }
  *bytes = kvf__pf_writes_bytes(sc->w, sc->nw);
  return DEST_OK;
}

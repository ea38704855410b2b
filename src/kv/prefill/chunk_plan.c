/* The one per-destination send path (PROTOCOL §6.3-§6.8) of the worker
 * and of direct transfers: one chunk's page pairs to one destination's
 * engine writes, through the M2's fragments (used as they are, or cut per
 * token once when the M2 arrives) and per-worker grow-only scratch arrays,
 * so the hot path does not allocate; then the write, with the room's fence
 * and, on the last chunk, its completion trailer. Verify mode is a step of
 * this path (verify_send.c): the same plan, cut in parts, written and
 * checked there. A failed write is judged in one place
 * (kvf__pf_xfer_failed). */
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
 * used as they are), or 0 with a reason in info->plan_why, or -1 without
 * memory; when it returns P > 1, info->frags_cut is a malloc'd per-token
 * copy of the M2's fragments. */
static int64_t per_token(pf_info *info, int64_t P) {
  const wire_fragment *f = info->m2->frags;
  size_t n = info->m2->nfrags, whycap = sizeof info->plan_why;
  int64_t layout = info->m2->page_layout;
  char *why = info->plan_why;
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
  info->frags_cut = t;
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
    /* The reference's words, then the failure that marked the session
     * (otherwise only in the log of the room it failed). */
    snprintf(why, whycap,
             "Decode instance could be dead, remote mooncake session %s is not alive (a transfer to it failed "
             "%.1f s ago: %s)",
             session, (double)(now - reg->failed_ns) / 1e9, reg->failed_why);
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
  if (dw->group) kvf__batch_group_destroy(dw->group);
  free(dw->group);
  memset(dw, 0, sizeof *dw);
}

void kvf__pf_scratch_free(pf_scratch *sc) {
  free(sc->dptr), free(sc->sptr), free(sc->src), free(sc->dst), free(sc->runs), free(sc->w);
  kvf__pf_dest_writes_free(&sc->dw);
  free(sc->done), free(sc->res), free(sc->carried), free(sc->dg);
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
  info->tokens = per_token(info, m->cfg.page_size);
  if (info->tokens < 0) return KVF_ENOMEM;
  if (info->frags_cut) info->frags = info->frags_cut;
  return 0;
}

/* One set of page pairs to plan: KV pages of layers [l0, l1) (state 0),
 * or state slots of every state buffer (1) or of the state buffers of KV
 * layers [l0, l1) (2, with state_layer_ids). */
typedef struct pf_pairs {
  int state;
  size_t l0, l1;
  const int64_t *src, *dst;
  size_t n;
  size_t nparts; /* plan_parts: cut into this many parts */
} pf_pairs;

/* Plan the pairs to the destination of `info`, appending the writes to
 * sc->w. Uses only sc's arrays (sc->dptr / sc->sptr hold the destination's
 * buffer addresses). */
static int plan_pairs(prefill_state *ps, pf_scratch *sc, const pf_info *info, const pf_pairs *p, char *why,
                      size_t whycap) {
  const manager_buffers *b = &ps->m->bufs;
  const wire_m2 *x = info->m2;
  int state = p->state, frag_mode = x->nfrags > 0;
  int64_t tokens = state ? 1 : info->tokens;
  size_t l0 = p->l0, l1 = p->l1;
  const plan_layout *lay = state == 2 ? &ps->stl_lay : state ? &ps->st_lay : &ps->kv_lay;
  plan_mem sm = {state ? b->state_ptrs : b->kv_ptrs, state ? b->state_lens : b->kv_lens,
                 state ? b->n_state : b->n_kv};
  plan_mem dm = {state ? sc->sptr : sc->dptr, NULL, sm.nbufs};
  size_t nruns = 0, nw = 0, cap;
  int rc = kvf__pf_scratch_grow((void **)&sc->runs, &sc->cap_runs, p->n ? p->n : 1, sizeof *sc->runs);
  if (!rc) rc = kvf__plan_runs(p->src, p->dst, p->n, sc->runs, &nruns);
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
  plan_xfer px = {.lay = lay,
                  .l0 = l0,
                  .l1 = l1,
                  .runs = runs,
                  .nruns = nruns,
                  .src = &sm,
                  .dst = &dm,
                  .item = state ? b->state_item_lens : b->kv_item_lens,
                  .frags = info->frags,
                  .nfrags = x->nfrags,
                  .state = state};
  cap = frag_mode ? kvf__plan_frag_count(&px) : kvf__plan_plain_count(&px);
  if (!cap) goto out;
  if ((rc = kvf__pf_scratch_grow((void **)&sc->w, &sc->cap_w, sc->nw + cap, sizeof *sc->w))) goto out;
  kvf_write *w = sc->w + sc->nw;
  rc = frag_mode ? kvf__plan_frag_writes(&px, w, cap, &nw) : kvf__plan_plain_writes(&px, w, cap, &nw);
  if (!rc) sc->nw += nw;
out:
  if (rc)
    snprintf(why, whycap, "%s pages of the chunk cannot be mapped onto decode session %s: %s",
             state ? "State" : "KV", x->session, kvf_strerror(rc));
  return rc;
}

/* Plan the pairs in p->nparts parts of equal size (the last shorter, some
 * perhaps empty), each its own runs and blocks, recorded in sc->parts. */
static int plan_parts(prefill_state *ps, pf_scratch *sc, const pf_info *info, const pf_pairs *p, char *why,
                      size_t whycap) {
  size_t per = (p->n + p->nparts - 1) / p->nparts;
  for (size_t g = 0; g < p->nparts; g++) {
    pf_part *part = &sc->parts[sc->nparts++];
    pf_pairs sub = *p;
    size_t a = g * per < p->n ? g * per : p->n;
    sub.src += a, sub.dst += a;
    sub.n = p->n - a < per ? p->n - a : per;
    *part = (pf_part){.state = p->state, .a = a, .n = sub.n, .w0 = sc->nw};
    int rc = plan_pairs(ps, sc, info, &sub, why, whycap);
    if (rc) return rc;
    part->nw = sc->nw - part->w0;
  }
  return 0;
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

/* Plan one chunk to one real destination (§6.3-§6.6), see prefill_int.h.
 * Verify mode cuts the KV pages in PF_VERIFY_PARTS parts (and the state
 * slots too, for a decode that asked for digests), so its step can check
 * part by part. No allocation beyond sc's grow-only arrays. */
int kvf__pf_plan_dest(prefill_state *ps, pf_scratch *sc, const pf_chunk *c, const pf_info *info, char *why,
                      size_t whycap) {
  kvf_manager *m = ps->m;
  const wire_m2 *x = info->m2;
  const manager_buffers *b = &m->bufs;
  int64_t page_size = m->cfg.page_size, now = clock_now_ns();
  size_t nsptr = 0;
  int ret = DEST_FAIL, verify = pf_verifies(c, x), ask = (x->room_flags & WIRE_ROOM_VERIFY) != 0;
  sc->nw = 0, sc->nparts = 0;

  pthread_mutex_lock(&ps->lock);
  pf_reg *reg = kvf__pf_usable_reg_locked(ps, x->session, now, why, whycap);
  if (reg && reg->mem != info->reg_mem) {
    snprintf(why, whycap,
             "decode session %.200s registered other buffers after this request (restarted under the same "
             "session id?): its page indices name memory that is gone",
             x->session);
    reg = NULL;
  }
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
    kvf__str_copy(why, whycap, info->plan_why);
    return ret;
  }

  /* §6.8 and §6.3: the chunk's pages the decode still needs, and where. */
  size_t n;
  kvf__pf_dest_window(c, x, page_size, &sc->skip, &sc->dstart, &n);
  if (n) {
    if (kvf__pf_scratch_grow((void **)&sc->dst, &sc->cap_dst, n, sizeof *sc->dst)) {
      snprintf(why, whycap, "Out of memory");
      return ret;
    }
    for (size_t k = 0; k < n; k++) sc->dst[k] = wire_i64_at(x->kv_indices, (size_t)sc->dstart + k);
    pf_pairs kv = {0, c->layer_begin, c->layer_end, c->pages + sc->skip, sc->dst, n, 1};
    if (verify && n >= PF_VERIFY_PARTS) kv.nparts = PF_VERIFY_PARTS;
    if (plan_parts(ps, sc, info, &kv, why, whycap)) return ret;
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
    pf_pairs st = {by_layer ? 2 : 1, c->layer_begin, c->layer_end, sc->src, sc->dst, np, 1};
    if (ask && np >= PF_VERIFY_PARTS) st.nparts = PF_VERIFY_PARTS;
    if (np && plan_parts(ps, sc, info, &st, why, whycap)) return ret;
  }
  return DEST_OK;
}

void kvf__pf_fence_opts(const wire_m2 *x, kvf_batch_opts *opts) {
  kvf_batch_opts_init(opts);
  if (x->fence_epoch && manager_room_tag(x->room))
    opts->tag = manager_room_tag(x->room), opts->epoch = x->fence_epoch;
}

/* A write refused by the decode's fence (KVF_ESTATE on a write tagged with
 * the room's fence) means the decode failed or dropped that room: the room
 * fails, and nothing else. The decode session is alive and its other rooms
 * go on, so it is not marked failed (which would fail every room to it for
 * failed_session_ttl_s). Any other failure marks it (§7.4). */
int kvf__pf_xfer_failed(const pf_room *r, const wire_m2 *x, int rc, char *why, size_t whycap) {
  kvf_batch_opts opts;
  kvf__pf_fence_opts(x, &opts);
  if (rc == KVF_ESTATE && opts.tag) {
    snprintf(why, whycap, "The decode fenced room %" PRId64 " (it failed or dropped it there): write refused",
             x->room);
    return DEST_FAIL;
  }
  snprintf(why, whycap, "Failed to send kv chunk of %" PRId64 " to %s (%s)", r->room,
           kvf__addr_str(x->endpoint, x->dst_port).s, kvf_strerror(rc));
  return DEST_XFER_FAIL;
}

/* A room's completion as an engine trailer to s's destination, when it
 * may ride (pf_trails). With several real destinations (a fan-out) each one gets
 * its own behind its own last bytes: what this rank sends it is then in
 * place, whatever the other destinations' writes do (a room failed by
 * another one still tells it Failed, which overrides). Its length, or 0:
 * the M3, which goes out either way, then completes the room alone. */
static size_t completion_trailer(prefill_state *ps, const pf_send *s, unsigned char *out, size_t cap) {
  const pf_chunk *c = s->c;
  if (!pf_trails(c, s->info)) return 0;
  wire_m3 m3 = {.room = c->r->room,
                .status = ROOM_SUCCESS,
                .prefill_rank = ps->m->tp_rank,
                .bootstrap_token = c->token,
                .candidates = wire_array_of(c->cands, c->cands ? c->ncand : 0),
                /* The use of the room id it answers, as on the M3 (frame 6):
                 * a trailer the decode handles after that M3 completed the
                 * room, and after the room id's next M2, is stale there. */
                .fence_epoch = s->info->m2->fence_epoch};
  wire_msg msg;
  char why[WIRE_REASON_LEN];
  if (kvf__wire_m3_encode(&m3, &msg, why)) return 0;
  size_t len = kvf__trailer_pack(ps->m, &msg, out, cap);
  kvf__wire_msg_free(&msg);
  return len;
}

/* The destination's engine session in the room's trace, with the transport
 * and mode the engine chose for it (once per destination and room). Only
 * the thread that sends the room's chunks calls this, one at a time. */
static void trace_peer(prefill_state *ps, trace_live *tl, const char *session) {
  if (!kvf__trace_on(tl)) return;
  for (uint32_t i = 0; i < tl->npeers; i++)
    if (!strcmp(tl->peers[i].peer, session)) return;
  if (tl->npeers >= KVF_TRACE_MAX_PEERS) return;
  kvf_trace_peer *p = &tl->peers[tl->npeers];
  const char *transport = "", *mode = "";
  /* Not chosen yet (a peer's first room): filled as the record leaves the
   * ring (trace.c, trace_routes_fill). */
  kvf__engine_peer_path(ps->m->engine, session, &transport, &mode);
  kvf__str_copy(p->peer, sizeof p->peer, session);
  kvf__str_copy(p->transport, sizeof p->transport, transport);
  kvf__str_copy(p->mode, sizeof p->mode, mode);
  tl->npeers++;
}

/* See prefill_int.h. The engine copies the blocks at submit, so sc's arrays
 * serve the next destination at once. */
int kvf__pf_send_dest(prefill_state *ps, pf_scratch *sc, pf_send *s, char *why, size_t whycap) {
  const wire_m2 *x = s->info->m2;
  trace_live *tl = &s->c->r->tr;
  s->batch = NULL, s->bytes = 0;
  int ret = kvf__pf_plan_dest(ps, sc, s->c, s->info, why, whycap);
  /* Nothing to write: done, except that a direct transfer still goes to the
   * engine, whose callback completes it. */
  if (ret != DEST_OK || (!sc->nw && !s->on_done)) return ret;
  if (sc->nw && kvf__trace_on(tl)) {
    kvf__trace_now(tl, KVF_TRACE_FIRST_BYTE_SENT); /* handed to the engine from here on */
    kvf__trace_add(tl, TRACE_DESCS, sc->nw);
  }
  if (pf_verifies(s->c, x)) {
    ret = kvf__pf_verify_send(ps, sc, s, why, whycap);
    trace_peer(ps, tl, x->session);
    return ret;
  }
  unsigned char tb[KVF_ENGINE_MAX_TRAILER];
  size_t tlen = completion_trailer(ps, s, tb, sizeof tb);
  kvf_batch_opts opts;
  kvf__pf_fence_opts(x, &opts);
  kvf__submit req = {.session = x->session,
                     .writes = sc->w,
                     .n = sc->nw,
                     .opts = &opts,
                     .trailer = tlen ? tb : NULL,
                     .tlen = tlen,
                     .on_done = s->on_done,
                     .arg = s->arg,
                     .carried = tlen ? s->carried : NULL,
                     .group = s->group};
  int rc = kvf__engine_submit_req(ps->m->engine, &req, &s->batch);
  if (rc) return kvf__pf_xfer_failed(s->c->r, x, rc, why, whycap);
  s->bytes = kvf__pf_writes_bytes(sc->w, sc->nw);
  trace_peer(ps, tl, x->session);
  return DEST_OK;
}

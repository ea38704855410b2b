/* Transfer planning (see plan.h): page runs, plain and fragment address
 * computation, and the decode-side route planner. The planner restates the
 * reference's rules (PROTOCOL §6.5) step by step so the two can be compared
 * line by line; the address functions add what the reference lacks: range
 * and overflow checks on every index that may come from a peer, and
 * coalescing of a fragment's per-page pieces into one strided block. */
#include "kv/plan.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/addr.h"
#include "wire/messages.h"

/* ---- Page runs ---- */

int kvf__plan_runs(const int64_t *src, const int64_t *dst, size_t n, plan_run *out, size_t *nruns) {
  for (size_t k = 0; k < n; k++)
    if (src[k] < 0 || dst[k] < 0) return KVF_ERANGE;
  size_t m = 0;
  for (size_t k = 0; k < n;) {
    size_t j = k + 1;
    /* Both values are non-negative, so the differences cannot overflow. */
    while (j < n && src[j] - src[j - 1] == 1 && dst[j] - dst[j - 1] == 1) j++;
    out[m].src = src[k];
    out[m].dst = dst[k];
    out[m].len = (int64_t)(j - k);
    m++;
    k = j;
  }
  *nruns = m;
  return 0;
}

/* ---- Buffers ---- */

void kvf__plan_layout_default(size_t n_kv, uint32_t *start, uint32_t *bufs, plan_layout *out) {
  int mha = n_kv % 2 == 0;
  size_t per = mha ? 2 : 1, nlayers = n_kv / per;
  for (size_t l = 0; l <= nlayers; l++) start[l] = (uint32_t)(l * per);
  for (size_t l = 0; l < nlayers; l++) {
    bufs[l * per] = (uint32_t)l;
    if (mha) bufs[l * per + 1] = (uint32_t)(nlayers + l);
  }
  out->nlayers = nlayers;
  out->start = start;
  out->bufs = bufs;
}

static int layer_range_ok(const plan_layout *lay, size_t l0, size_t l1) {
  return lay && l0 <= l1 && l1 <= lay->nlayers && lay->start[l0] <= lay->start[l1];
}

/* `count` pieces of `bytes` at `off` in pages page.. of `stride` bytes. */
typedef struct piece {
  int64_t page, count;
  uint64_t stride, off, bytes;
} piece;

/* Address of piece p in buffer b of memory m (length m->len[b] if known):
 * checks that the last piece ends inside the buffer and that nothing
 * overflows. */
static int span(const plan_mem *m, size_t b, const piece *p, uint64_t *addr) {
  uint64_t first, last, end, base = m->base[b];
  if (p->page < 0 || p->count < 1) return KVF_ERANGE;
  if (__builtin_mul_overflow((uint64_t)p->page, p->stride, &first) ||
      __builtin_add_overflow(first, p->off, &first) ||
      __builtin_mul_overflow((uint64_t)(p->count - 1), p->stride, &last) ||
      __builtin_add_overflow(first, last, &end) || __builtin_add_overflow(end, p->bytes, &end))
    return KVF_ERANGE;
  if (m->len && end > m->len[b]) return KVF_ERANGE;
  if (__builtin_add_overflow(base, first, addr) || __builtin_add_overflow(base, end, &end)) return KVF_ERANGE;
  return 0;
}

/* ---- Plain address computation ---- */

size_t kvf__plan_plain_count(const plan_xfer *x) {
  const plan_layout *lay = x->lay;
  if (!layer_range_ok(lay, x->l0, x->l1)) return 0;
  return (lay->start[x->l1] - lay->start[x->l0]) * x->nruns;
}

int kvf__plan_plain_writes(const plan_xfer *x, kvf_write *out, size_t cap, size_t *nout) {
  const plan_layout *lay = x->lay;
  const plan_mem *src = x->src, *dst = x->dst;
  if (!layer_range_ok(lay, x->l0, x->l1)) return KVF_EINVAL;
  if (kvf__plan_plain_count(x) > cap) return KVF_ETOOBIG;
  size_t n = 0;
  for (size_t i = lay->start[x->l0]; i < lay->start[x->l1]; i++) {
    size_t b = lay->bufs[i];
    if (b >= src->nbufs || b >= dst->nbufs || x->item[b] == 0) return KVF_EINVAL;
    uint64_t it = x->item[b];
    for (size_t k = 0; k < x->nruns; k++) {
      const plan_run *r = &x->runs[k];
      kvf_write w = {.count = 1};
      piece ps = {r->src, r->len, it, 0, it}, pd = {r->dst, r->len, it, 0, it};
      int rc = span(src, b, &ps, &w.src);
      if (rc == 0) rc = span(dst, b, &pd, &w.dst);
      if (rc == 0 && __builtin_mul_overflow(it, (uint64_t)r->len, &w.len)) rc = KVF_ERANGE;
      if (rc != 0) return rc;
      out[n++] = w;
    }
  }
  *nout = n;
  return 0;
}

/* ---- Fragment execution ---- */

static int frag_matches(const wire_fragment *f, size_t b, int state) {
  return f->buffer_index >= 0 && (uint64_t)f->buffer_index == b &&
         ((f->buffer_kind == WIRE_KIND_MAMBA_STATE) == (state != 0));
}

static int64_t frag_pages(const wire_fragment *f, int64_t run_len) {
  return f->page_count >= 0 && f->page_count < run_len ? f->page_count : run_len;
}

int kvf__plan_frags_slice_pages(const wire_fragment *frags, size_t nfrags) {
  for (size_t i = 0; i < nfrags; i++) {
    const wire_fragment *f = &frags[i];
    if (f->buffer_kind != WIRE_KIND_MAMBA_STATE &&
        (f->bytes_per_page != f->src_page_stride_bytes || f->bytes_per_page != f->dst_page_stride_bytes))
      return 1;
  }
  return 0;
}

size_t kvf__plan_frag_count(const plan_xfer *x) {
  const plan_layout *lay = x->lay;
  if (!layer_range_ok(lay, x->l0, x->l1)) return 0;
  size_t n = 0;
  for (size_t i = lay->start[x->l0]; i < lay->start[x->l1]; i++)
    for (size_t f = 0; f < x->nfrags; f++) {
      if (!frag_matches(&x->frags[f], lay->bufs[i], x->state)) continue;
      for (size_t k = 0; k < x->nruns; k++) n += frag_pages(&x->frags[f], x->runs[k].len) > 0;
    }
  return n;
}

/* A fragment must stay inside one page on both sides; anything else from a
 * peer would write into the neighbouring page. */
static int frag_valid(const wire_fragment *f) {
  if (f->bytes_per_page <= 0 || f->src_byte_offset < 0 || f->dst_byte_offset < 0) return 0;
  if (f->src_byte_offset > f->src_page_stride_bytes ||
      f->bytes_per_page > f->src_page_stride_bytes - f->src_byte_offset)
    return 0;
  if (f->dst_byte_offset > f->dst_page_stride_bytes ||
      f->bytes_per_page > f->dst_page_stride_bytes - f->dst_byte_offset)
    return 0;
  return 1;
}

int kvf__plan_frag_writes(const plan_xfer *x, kvf_write *out, size_t cap, size_t *nout) {
  const plan_layout *lay = x->lay;
  const plan_mem *src = x->src, *dst = x->dst;
  if (!layer_range_ok(lay, x->l0, x->l1)) return KVF_EINVAL;
  size_t n = 0;
  for (size_t i = lay->start[x->l0]; i < lay->start[x->l1]; i++) {
    size_t b = lay->bufs[i];
    for (size_t fi = 0; fi < x->nfrags; fi++) {
      const wire_fragment *f = &x->frags[fi];
      if (!frag_matches(f, b, x->state)) continue;
      if (b >= src->nbufs || b >= dst->nbufs) return KVF_EINVAL;
      if (!frag_valid(f)) return KVF_ERANGE;
      for (size_t k = 0; k < x->nruns; k++) {
        const plan_run *r = &x->runs[k];
        int64_t m = frag_pages(f, r->len);
        if (m <= 0) continue;
        if (n == cap) return KVF_ETOOBIG;
        /* frag_valid: every field below is positive (offsets >= 0). */
        uint64_t bpp = (uint64_t)f->bytes_per_page, ss = (uint64_t)f->src_page_stride_bytes,
                 ds = (uint64_t)f->dst_page_stride_bytes;
        kvf_write w = {.len = bpp, .count = 1};
        piece ps = {r->src, m, ss, (uint64_t)f->src_byte_offset, bpp},
              pd = {r->dst, m, ds, (uint64_t)f->dst_byte_offset, bpp};
        int rc = span(src, b, &ps, &w.src);
        if (rc == 0) rc = span(dst, b, &pd, &w.dst);
        if (rc != 0) return rc;
        if (m > 1 && ss == bpp && ds == bpp) {
          /* Whole pages on both sides: the pieces touch, one plain block.
           * span() has shown m*bytes fits in the buffer, so no overflow. */
          w.len = bpp * (uint64_t)m;
        } else if (m > 1) {
          w.count = (uint64_t)m;
          w.src_stride = ss;
          w.dst_stride = ds;
        }
        out[n++] = w;
      }
    }
  }
  *nout = n;
  return 0;
}

/* ---- Route plan ---- */

/* One prefill/decode layout pair (§6.5.1). The decode's replica group is
 * always 1; `R` is the prefill's. */
typedef struct pair {
  uint32_t index;
  int kind;    /* WIRE_KIND_* */
  int sharded; /* 0 = replicated axis */
  int64_t S, U, Ip, Id, R;
} pair;

static void set_err(const plan_route_params *p, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void set_err(const plan_route_params *p, const char *fmt, ...) {
  if (!p->err || !p->err_cap) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(p->err, p->err_cap, fmt, ap);
  va_end(ap);
}

/* Entry `b` of a list that defaults to `def` when the list is empty; a
 * non-empty list too short for b is an error, as in the reference. */
static int list_get(const int64_t *v, size_t n, size_t b, int64_t def, int64_t *out) {
  if (n == 0) {
    *out = def;
    return 0;
  }
  if (b >= n) return KVF_EINVAL;
  *out = v[b];
  return 0;
}

static int make_pair(const plan_route_params *p, size_t b, int kind, int is_kv, pair *out) {
  const char *what = is_kv ? "kv" : "state";
  const int64_t *di = is_kv ? p->d_kv_item : p->d_state_item;
  const int64_t *du = is_kv ? p->d_kv_unit : p->d_state_unit;
  const int64_t *pi = is_kv ? p->p_kv_item : p->p_state_item;
  const int64_t *pu = is_kv ? p->p_kv_unit : p->p_state_unit;
  size_t ndi = is_kv ? p->n_d_kv : p->n_d_state;
  size_t ndu = is_kv ? p->n_d_kv_unit : p->n_d_state_unit;
  size_t npi = is_kv ? p->n_p_kv : p->n_p_state;
  size_t npu = is_kv ? p->n_p_kv_unit : p->n_p_state_unit;
  int64_t Tp = p->prefill_tp_size, Td = p->decode_tp_size;
  int64_t Id, Ip, Ud, Up;

  if (b >= ndi || list_get(du, ndu, b, 1, &Ud) != 0) {
    set_err(p, "%s buffer %zu: decode lists too short", what, b);
    return KVF_EINVAL;
  }
  Id = di[b];
  if (npi == 0) {
    /* The prefill published no item lengths: assume an even split. */
    if (Id <= 0 || __builtin_mul_overflow(Id, Td, &Ip)) goto err_bad_len;
    Ip /= Tp;
  } else if (list_get(pi, npi, b, 0, &Ip) != 0) {
    set_err(p, "%s buffer %zu: prefill item list shorter than the decode's", what, b);
    return KVF_EINVAL;
  }
  if (list_get(pu, npu, b, 1, &Up) != 0) {
    set_err(p, "%s buffer %zu: prefill unit list shorter than the decode's", what, b);
    return KVF_EINVAL;
  }
  if (Up != Ud) {
    set_err(p, "%s buffer %zu: unit length differs (prefill %lld, decode %lld)", what, b, (long long)Up,
            (long long)Ud);
    return KVF_EINVAL;
  }
  int64_t U = Up;
  if (U <= 0 || Ip <= 0 || Id <= 0) goto err_bad_len;
  if (Ip % U != 0 || Id % U != 0) {
    set_err(p, "%s buffer %zu: item lengths %lld/%lld not multiples of unit %lld", what, b, (long long)Ip,
            (long long)Id, (long long)U);
    return KVF_EINVAL;
  }
  int64_t Lp = Ip / U, Ld = Id / U, Gp, Gd;
  if (__builtin_mul_overflow(Lp, Tp, &Gp) || __builtin_mul_overflow(Ld, Td, &Gd)) goto err_bad_len;
  pair pr = {.index = (uint32_t)b, .kind = kind, .U = U, .Ip = Ip, .Id = Id, .R = 1};
  if (Gp == Gd) {
    pr.sharded = 1;
    pr.S = Gd;
  } else if (Ip == Id) {
    pr.sharded = 0;
    pr.S = Ld;
  } else if (is_kv && Gd % Lp == 0 && Gd / Lp <= Tp && Tp % (Gd / Lp) == 0) {
    /* GQA: several prefill ranks hold the same heads. */
    pr.sharded = 1;
    pr.S = Gd;
    pr.R = Tp / (Gd / Lp);
  } else {
    set_err(p,
            "unsupported heterogeneous TP buffer layout: %s buffer %zu, prefill item %lld x tp %lld, "
            "decode item %lld x tp %lld, unit %lld",
            what, b, (long long)Ip, (long long)Tp, (long long)Id, (long long)Td, (long long)U);
    return KVF_EINVAL;
  }
  /* §6.5.2, both sides, sharded layouts only. */
  if (pr.sharded) {
    int64_t Tq = Tp / pr.R;
    if (Tp % pr.R != 0 || pr.S % Tq != 0 || Ip / U < pr.S / Tq || pr.S % Td != 0 || Id / U < pr.S / Td) {
      set_err(p, "%s buffer %zu: shard of %lld units does not divide over tp %lld/%lld", what, b, (long long)pr.S,
              (long long)Tp, (long long)Td);
      return KVF_EINVAL;
    }
  }
  *out = pr;
  return 0;
err_bad_len:
  set_err(p, "%s buffer %zu: item or unit length not positive", what, b);
  return KVF_EINVAL;
}

/* Fragments of pair `pr` between decode rank d and every prefill rank it
 * overlaps (§6.5.3-6.5.4), handed to emit in ascending prefill rank. */
typedef struct overlap { /* one prefill rank's share of a decode rank's slice of a pair */
  int prank, drank;
  int64_t src_off, dst_off, bytes;
} overlap;
typedef int (*emit_fn)(void *ctx, const pair *pr, const overlap *o);

static int pair_overlaps(const pair *pr, int d, int Tp, int Td, emit_fn emit, void *ctx) {
  if (!pr->sharded) {
    int s = (int)(((int64_t)d * Tp) / Td);
    return emit(ctx, pr, &(overlap){s, d, 0, 0, pr->Id});
  }
  int64_t wd = pr->S / Td, d_lo = d * wd, d_hi = d_lo + wd;
  int64_t Tq = Tp / pr->R, wp = pr->S / Tq;
  for (int64_t q = d_lo / wp; q <= (d_hi - 1) / wp && q < Tq; q++) {
    int64_t p_lo = q * wp, p_hi = p_lo + wp;
    int64_t a = d_lo > p_lo ? d_lo : p_lo, e = d_hi < p_hi ? d_hi : p_hi;
    if (a >= e) continue;
    overlap o = {(int)(q * pr->R), d, (a - p_lo) * pr->U, (a - d_lo) * pr->U, (e - a) * pr->U};
    int rc = emit(ctx, pr, &o);
    if (rc != 0) return rc;
  }
  return 0;
}

static int emit_mark(void *ctx, const pair *pr, const overlap *o) {
  (void)pr;
  ((unsigned char *)ctx)[o->prank] = 1;
  return 0;
}

typedef struct frag_vec {
  wire_fragment *v;
  size_t n, cap;
  unsigned char *mark;
} frag_vec;

static int emit_frag(void *ctx, const pair *pr, const overlap *o) {
  frag_vec *fv = ctx;
  if (fv->n == fv->cap) {
    size_t nc = fv->cap ? fv->cap * 2 : 64;
    wire_fragment *nv = realloc(fv->v, nc * sizeof *nv);
    if (!nv) return KVF_ENOMEM;
    fv->v = nv;
    fv->cap = nc;
  }
  fv->v[fv->n++] = (wire_fragment){
      .buffer_index = pr->index,
      .buffer_kind = pr->kind,
      .src_rank = o->prank,
      .dst_rank = o->drank,
      .src_page_stride_bytes = pr->Ip,
      .dst_page_stride_bytes = pr->Id,
      .src_byte_offset = o->src_off,
      .dst_byte_offset = o->dst_off,
      .bytes_per_page = o->bytes,
      .page_count = -1,
  };
  fv->mark[o->prank] = 1;
  return 0;
}

static int sizes_ok(int Td, int d, int Tp) {
  return Td >= 1 && Td <= PLAN_MAX_TP && Tp >= 1 && Tp <= PLAN_MAX_TP && d >= 0 && d < Td;
}

/* Pairs in the reference's order: KV buffers layer by layer, then state. */
static int build_pairs(const plan_route_params *p, pair **out, size_t *npairs) {
  const plan_layout *lay = p->layout;
  size_t nkv = lay ? lay->start[lay->nlayers] : 0;
  size_t n = nkv + p->n_d_state;
  pair *pairs = calloc(n ? n : 1, sizeof *pairs);
  if (!pairs) return KVF_ENOMEM;
  size_t k = 0;
  int rc = 0;
  for (size_t l = 0; lay && l < lay->nlayers && rc == 0; l++) {
    int draft = p->target_layer_num && l >= p->target_layer_num;
    for (size_t i = lay->start[l]; i < lay->start[l + 1] && rc == 0; i++) {
      int first = i == lay->start[l];
      int kind = draft ? (first ? WIRE_KIND_DRAFT_K : WIRE_KIND_DRAFT_V)
                       : (first ? WIRE_KIND_TARGET_K : WIRE_KIND_TARGET_V);
      rc = make_pair(p, lay->bufs[i], kind, 1, &pairs[k++]);
    }
  }
  for (size_t j = 0; j < p->n_d_state && rc == 0; j++) rc = make_pair(p, j, WIRE_KIND_MAMBA_STATE, 0, &pairs[k++]);
  if (rc != 0) {
    free(pairs);
    return rc;
  }
  *out = pairs;
  *npairs = n;
  return 0;
}

int kvf__plan_route_build(const plan_route_params *p, plan_route *out) {
  int Td = p->decode_tp_size, d = p->decode_tp_rank, Tp = p->prefill_tp_size;
  int rc;
  pair *pairs = NULL;
  size_t npairs = 0;
  plan_route r = {0};
  frag_vec fv = {0};
  unsigned char *mark = NULL;

  if (!sizes_ok(Td, d, Tp)) {
    set_err(p, "tp sizes out of range: decode %d rank %d, prefill %d", Td, d, Tp);
    return KVF_EINVAL;
  }
  if ((rc = build_pairs(p, &pairs, &npairs)) != 0) return rc;
  rc = KVF_ENOMEM;
  r.prefill_tp_size = Tp;
  if (!(r.fanout = calloc((size_t)Tp, sizeof *r.fanout))) goto err_free;
  if (!(mark = calloc((size_t)Tp, 1))) goto err_free;

  int identity = Tp == Td;
  for (size_t i = 0; i < npairs; i++) identity &= pairs[i].R == 1;
  if (identity) {
    if (!(r.targets = calloc(1, sizeof *r.targets))) goto err_free;
    for (int q = 0; q < Tp; q++) r.fanout[q] = 1;
    r.is_identity = r.supports_spec = 1;
    r.required_prefill_response_num = 1;
    r.ntargets = 1;
    r.targets[0] = (plan_target){.rank = d, .required_dst_info_num = 1};
    goto done;
  }

  /* Fan-out: how many decode ranks would contact each prefill rank. */
  for (int dd = 0; dd < Td; dd++) {
    memset(mark, 0, (size_t)Tp);
    for (size_t i = 0; i < npairs; i++) pair_overlaps(&pairs[i], dd, Tp, Td, emit_mark, mark);
    for (int q = 0; q < Tp; q++) r.fanout[q] += mark[q];
  }
  memset(mark, 0, (size_t)Tp);
  fv.mark = mark;
  for (size_t i = 0; i < npairs; i++)
    if ((rc = pair_overlaps(&pairs[i], d, Tp, Td, emit_frag, &fv)) != 0) goto err_free;
  rc = KVF_ENOMEM;
  for (int q = 0; q < Tp; q++) r.ntargets += mark[q];
  if (r.ntargets == 0) {
    set_err(p, "no prefill rank holds data for decode rank %d", d);
    rc = KVF_EINVAL;
    goto err_free;
  }
  if (!(r.targets = calloc((size_t)r.ntargets, sizeof *r.targets))) goto err_free;
  if (!(r.frags = malloc((fv.n ? fv.n : 1) * sizeof *r.frags))) goto err_free;
  /* Group by target (ascending), keeping pair order within a target. */
  int t = 0;
  for (int q = 0; q < Tp; q++) {
    if (!mark[q]) continue;
    plan_target *tg = &r.targets[t++];
    tg->rank = q;
    tg->required_dst_info_num = r.fanout[q];
    tg->frag_start = r.nfrags;
    for (size_t i = 0; i < fv.n; i++)
      if (fv.v[i].src_rank == q) r.frags[r.nfrags++] = fv.v[i];
    tg->nfrags = r.nfrags - tg->frag_start;
  }
  r.required_prefill_response_num = r.ntargets;
done:
  free(fv.v);
  free(mark);
  free(pairs);
  *out = r;
  return 0;
err_free:
  free(fv.v);
  free(mark);
  free(pairs);
  kvf__plan_route_free(&r);
  return rc;
}

int kvf__plan_route_add_dummies(plan_route *r, int Td, int d) {
  int Tp = r->prefill_tp_size, nd = 0;
  if (r->is_identity || !r->fanout || !sizes_ok(Td, d, Tp)) return 0;
  for (int q = 0; q < Tp; q++) nd += r->fanout[q] == 0 && (int)(((int64_t)q * Td) / Tp) == d;
  if (nd == 0) {
    for (int q = 0; q < Tp; q++)
      if (r->fanout[q] == 0) r->fanout[q] = 1;
    return 0;
  }
  plan_target *t = calloc((size_t)(r->ntargets + nd), sizeof *t);
  if (!t) return KVF_ENOMEM;
  int n = 0, i = 0;
  for (int q = 0; q < Tp; q++) {
    while (i < r->ntargets && r->targets[i].rank < q) t[n++] = r->targets[i++];
    if (r->fanout[q] == 0 && (int)(((int64_t)q * Td) / Tp) == d)
      t[n++] = (plan_target){.rank = q, .is_dummy = 1, .required_dst_info_num = 1};
  }
  while (i < r->ntargets) t[n++] = r->targets[i++];
  for (int q = 0; q < Tp; q++)
    if (r->fanout[q] == 0) r->fanout[q] = 1;
  free(r->targets);
  r->targets = t;
  r->ntargets = n;
  return 0;
}

int kvf__plan_route_legacy_mla(int Td, int d, int Tp, int l15_cache, plan_route *out) {
  plan_route r = {0};
  if (!sizes_ok(Td, d, Tp)) return KVF_EINVAL;
  int n, k = 1;
  if (l15_cache) n = Tp;
  else if (Td >= Tp) {
    if (Td % Tp) return KVF_EINVAL;
    n = 1;
  } else {
    if (Tp % Td) return KVF_EINVAL;
    k = Tp / Td;
    n = k;
  }
  r.prefill_tp_size = Tp;
  r.targets = calloc((size_t)n, sizeof *r.targets);
  r.fanout = calloc((size_t)Tp, sizeof *r.fanout);
  if (!r.targets || !r.fanout) {
    kvf__plan_route_free(&r);
    return KVF_ENOMEM;
  }
  r.ntargets = n;
  r.supports_spec = 1;
  r.is_identity = !l15_cache && Td == Tp;
  if (l15_cache) {
    /* Every prefill rank holds some pages and every decode rank asks all. */
    for (int q = 0; q < Tp; q++) {
      r.targets[q] = (plan_target){.rank = q, .required_dst_info_num = Td};
      r.fanout[q] = Td;
    }
    r.required_prefill_response_num = Tp;
  } else if (Td >= Tp) {
    int per = Td / Tp;
    r.targets[0] = (plan_target){.rank = d / per, .required_dst_info_num = per};
    for (int q = 0; q < Tp; q++) r.fanout[q] = per;
    r.required_prefill_response_num = 1;
  } else {
    /* Prefill wider: the first of k ranks sends, the others get dummies so
     * they still reach Bootstrapped and Success (§5.3). */
    for (int i = 0; i < k; i++)
      r.targets[i] = (plan_target){.rank = d * k + i, .is_dummy = i > 0, .required_dst_info_num = 1};
    for (int q = 0; q < Tp; q++) r.fanout[q] = 1;
    r.required_prefill_response_num = 1;
  }
  *out = r;
  return 0;
}

void kvf__plan_route_free(plan_route *r) {
  if (!r) return;
  free(r->targets);
  free(r->fanout);
  free(r->frags);
  memset(r, 0, sizeof *r);
}

/* ---- Small routing helpers ---- */

int kvf__plan_dp_group(int64_t room, int64_t dp_size, int64_t *out) {
  if (dp_size <= 0) return KVF_EINVAL;
  int64_t g = room % dp_size;
  if (g < 0) g += dp_size;
  *out = g;
  return 0;
}

int kvf__plan_session_port(const char *s, int *port) {
  uint16_t p;
  if (!s || kvf__addr_parse(s, strlen(s), NULL, 0, &p, NULL)) return KVF_EINVAL;
  *port = p;
  return 0;
}

int kvf__plan_queue_shard(const char *const *sessions, size_t n, int nqueues, int *out) {
  if (nqueues <= 0) return KVF_EINVAL;
  uint64_t sum = 0; /* ports < 2^16, so n < 2^48 sessions cannot overflow */
  for (size_t i = 0; i < n; i++) {
    int port;
    int rc = kvf__plan_session_port(sessions[i], &port);
    if (rc != 0) return rc;
    sum += (uint64_t)port;
  }
  *out = (int)(sum % (uint64_t)nqueues);
  return 0;
}

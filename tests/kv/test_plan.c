/* Unit tests for transfer planning: page runs and plain blocks against
 * PROTOCOL Appendix A.5, the route planner against the worked examples of
 * §6.5.7 (both directions and the GQA replica case) and Appendix A
 * (identity), fragment blocks (§6.5.6) with kvferry's coalescing, range
 * checks, and the DP-group / queue-shard helpers. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "kv/plan.h"
#include "wire/messages.h"

/* ---- Appendix A fixtures ---- */

static const uint64_t A_PBASE[4] = {0x7e1000000000ULL, 0x7e1040000000ULL, 0x7e1080000000ULL, 0x7e10c0000000ULL};
static const uint64_t A_DBASE[4] = {0x7f3a00000000ULL, 0x7f3a40000000ULL, 0x7f3a80000000ULL, 0x7f3ac0000000ULL};
static const uint64_t A_ITEM[4] = {8192, 8192, 8192, 8192};

static void runs_appendix_a(void **state) {
  int64_t src[3] = {20, 21, 25}, dst[3] = {7, 8, 9};
  plan_run runs[3];
  size_t n = 0;
  assert_int_equal(kvf__plan_runs(src, dst, 3, runs, &n), 0);
  assert_int_equal(n, 2);
  assert_int_equal(runs[0].src, 20);
  assert_int_equal(runs[0].dst, 7);
  assert_int_equal(runs[0].len, 2);
  assert_int_equal(runs[1].src, 25);
  assert_int_equal(runs[1].dst, 9);
  assert_int_equal(runs[1].len, 1);
}

static void runs_break_on_either_side(void **state) {
  /* dst breaks (7,8 -> 10), then src repeats, then a long run. */
  int64_t src[8] = {1, 2, 3, 3, 4, 5, 6, 7};
  int64_t dst[8] = {7, 8, 10, 11, 12, 13, 14, 15};
  plan_run runs[8];
  size_t n = 0;
  assert_int_equal(kvf__plan_runs(src, dst, 8, runs, &n), 0);
  assert_int_equal(n, 3);
  assert_int_equal(runs[0].len, 2);
  assert_int_equal(runs[1].src, 3);
  assert_int_equal(runs[1].dst, 10);
  assert_int_equal(runs[1].len, 1);
  assert_int_equal(runs[2].src, 3);
  assert_int_equal(runs[2].dst, 11);
  assert_int_equal(runs[2].len, 5);
  /* Descending pages never merge. */
  int64_t s2[3] = {5, 4, 3}, d2[3] = {5, 4, 3};
  assert_int_equal(kvf__plan_runs(s2, d2, 3, runs, &n), 0);
  assert_int_equal(n, 3);
  /* Empty input, negative indices. */
  n = 9;
  assert_int_equal(kvf__plan_runs(NULL, NULL, 0, NULL, &n), 0);
  assert_int_equal(n, 0);
  int64_t neg[2] = {0, -1}, ok[2] = {0, 1};
  n = 9;
  assert_int_equal(kvf__plan_runs(neg, ok, 2, runs, &n), KVF_ERANGE);
  assert_int_equal(kvf__plan_runs(ok, neg, 2, runs, &n), KVF_ERANGE);
  assert_int_equal(n, 9);
  /* Huge but valid indices do not overflow. */
  int64_t big[2] = {INT64_MAX - 1, INT64_MAX};
  assert_int_equal(kvf__plan_runs(big, big, 2, runs, &n), 0);
  assert_int_equal(n, 1);
  assert_int_equal(runs[0].len, 2);
}

/* The table of Appendix A.5: 8 blocks, layer-major, K then V, runs in order. */
static void plain_writes_appendix_a(void **state) {
  uint32_t start[3], bufs[4];
  plan_layout lay;
  kvf__plan_layout_default(4, start, bufs, &lay);
  assert_int_equal(bufs[0], 0);
  assert_int_equal(bufs[1], 2);
  assert_int_equal(bufs[2], 1);
  assert_int_equal(bufs[3], 3);
  assert_true(lay.nlayers == 2 && start[0] == 0 && start[1] == 2 && start[2] == 4);
  /* The manager's default for an odd count (MLA): one buffer per layer. */
  uint32_t mla_start[4], mla_bufs[3];
  plan_layout mla;
  kvf__plan_layout_default(3, mla_start, mla_bufs, &mla);
  assert_int_equal(mla.nlayers, 3);
  for (uint32_t l = 0; l < 3; l++) assert_true(mla_start[l] == l && mla_bufs[l] == l);
  assert_int_equal(mla_start[3], 3);
  int64_t src[3] = {20, 21, 25}, dst[3] = {7, 8, 9};
  plan_run runs[3];
  size_t nruns;
  assert_int_equal(kvf__plan_runs(src, dst, 3, runs, &nruns), 0);
  plan_mem pm = {.base = A_PBASE, .nbufs = 4}, dm = {.base = A_DBASE, .nbufs = 4};
  plan_xfer x =
      {.lay = &lay, .l0 = 0, .l1 = 2, .runs = runs, .nruns = nruns, .src = &pm, .dst = &dm, .item = A_ITEM};
  assert_int_equal(kvf__plan_plain_count(&x), 8);
  kvf_write w[8];
  size_t n = 0;
  assert_int_equal(kvf__plan_plain_writes(&x, w, 8, &n), 0);
  assert_int_equal(n, 8);
  static const uint64_t want[8][3] = {
      {0x7e1000028000ULL, 0x7f3a0000e000ULL, 16384}, {0x7e1000032000ULL, 0x7f3a00012000ULL, 8192},
      {0x7e1080028000ULL, 0x7f3a8000e000ULL, 16384}, {0x7e1080032000ULL, 0x7f3a80012000ULL, 8192},
      {0x7e1040028000ULL, 0x7f3a4000e000ULL, 16384}, {0x7e1040032000ULL, 0x7f3a40012000ULL, 8192},
      {0x7e10c0028000ULL, 0x7f3ac000e000ULL, 16384}, {0x7e10c0032000ULL, 0x7f3ac0012000ULL, 8192},
  };
  for (int i = 0; i < 8; i++) {
    assert_int_equal(w[i].src, want[i][0]);
    assert_int_equal(w[i].dst, want[i][1]);
    assert_int_equal(w[i].len, want[i][2]);
    assert_true(w[i].count <= 1);
  }
  /* Layerwise: layer 1 alone gives the last four blocks. */
  x.l0 = 1;
  assert_int_equal(kvf__plan_plain_count(&x), 4);
  assert_int_equal(kvf__plan_plain_writes(&x, w, 8, &n), 0);
  assert_int_equal(n, 4);
  assert_int_equal(w[0].src, 0x7e1040028000ULL);
  assert_int_equal(w[3].dst, 0x7f3ac0012000ULL);
  /* No runs: no blocks. */
  x.l0 = 0, x.nruns = 0;
  assert_int_equal(kvf__plan_plain_writes(&x, w, 0, &n), 0);
  assert_int_equal(n, 0);
}

/* kvferry's additions (§8 item 8): a page whose bytes would end past a known
 * buffer length is refused, on either side; so are bad ranges and buffers. */
static void plain_writes_bounds(void **state) {
  uint32_t start[3], bufs[4];
  plan_layout lay;
  kvf__plan_layout_default(4, start, bufs, &lay);
  int64_t src[3] = {20, 21, 25}, dst[3] = {7, 8, 9};
  plan_run runs[3];
  size_t nruns, n = 77;
  assert_int_equal(kvf__plan_runs(src, dst, 3, runs, &nruns), 0);
  kvf_write w[8];
  /* Decode page 9 ends at 10 * 8192 bytes. */
  uint64_t dlen[4] = {81920, 81920, 81920, 81920};
  uint64_t plen[4] = {26 * 8192, 26 * 8192, 26 * 8192, 26 * 8192};
  plan_mem pm = {.base = A_PBASE, .len = plen, .nbufs = 4};
  plan_mem dm = {.base = A_DBASE, .len = dlen, .nbufs = 4};
  plan_xfer x =
      {.lay = &lay, .l0 = 0, .l1 = 2, .runs = runs, .nruns = nruns, .src = &pm, .dst = &dm, .item = A_ITEM};
  assert_int_equal(kvf__plan_plain_writes(&x, w, 8, &n), 0);
  dlen[3] = 81919;
  n = 77;
  assert_int_equal(kvf__plan_plain_writes(&x, w, 8, &n), KVF_ERANGE);
  assert_int_equal(n, 77);
  dlen[3] = 81920;
  plen[1] = 26 * 8192 - 1;
  assert_int_equal(kvf__plan_plain_writes(&x, w, 8, &n), KVF_ERANGE);
  plen[1] = 26 * 8192;
  /* Array too small, bad layer range, decode registered fewer buffers. */
  assert_int_equal(kvf__plan_plain_writes(&x, w, 7, &n), KVF_ETOOBIG);
  plan_xfer y = x;
  y.l0 = 1, y.l1 = 3;
  assert_int_equal(kvf__plan_plain_writes(&y, w, 8, &n), KVF_EINVAL);
  y.l0 = 2, y.l1 = 1;
  assert_int_equal(kvf__plan_plain_count(&y), 0);
  plan_mem short_dm = {.base = A_DBASE, .nbufs = 3};
  y = x, y.dst = &short_dm;
  assert_int_equal(kvf__plan_plain_writes(&y, w, 8, &n), KVF_EINVAL);
  /* Negative or overflowing pages in hand-made runs. */
  plan_run bad = {.src = -1, .dst = 0, .len = 1};
  y = x, y.l1 = 1, y.runs = &bad, y.nruns = 1;
  assert_int_equal(kvf__plan_plain_writes(&y, w, 8, &n), KVF_ERANGE);
  plan_run huge = {.src = INT64_MAX / 2, .dst = 0, .len = 1};
  plan_mem nolen = {.base = A_PBASE, .nbufs = 4};
  y.runs = &huge, y.src = y.dst = &nolen;
  assert_int_equal(kvf__plan_plain_writes(&y, w, 8, &n), KVF_ERANGE);
}

/* ---- Route planner ---- */

static plan_route_params params(int td, int d, int tp, const plan_layout *lay, const int64_t *ditem,
                                const int64_t *pitem, const int64_t *unit, size_t nbufs) {
  plan_route_params p = {
      .decode_tp_size = td,
      .decode_tp_rank = d,
      .prefill_tp_size = tp,
      .layout = lay,
      .d_kv_item = ditem,
      .d_kv_unit = unit,
      .n_d_kv = nbufs,
      .n_d_kv_unit = unit ? nbufs : 0,
      .p_kv_item = pitem,
      .p_kv_unit = unit,
      .n_p_kv = pitem ? nbufs : 0,
      .n_p_kv_unit = unit ? nbufs : 0,
  };
  return p;
}

static void check_frag(const wire_fragment *f, uint32_t buf, int kind, int src_rank, int dst_rank, uint64_t ss,
                       uint64_t ds, uint64_t so, uint64_t dof, uint64_t bytes) {
  assert_int_equal(f->buffer_index, buf);
  assert_int_equal(f->buffer_kind, kind);
  assert_int_equal(f->src_rank, src_rank);
  assert_int_equal(f->dst_rank, dst_rank);
  assert_int_equal(f->src_page_stride_bytes, ss);
  assert_int_equal(f->dst_page_stride_bytes, ds);
  assert_int_equal(f->src_byte_offset, so);
  assert_int_equal(f->dst_byte_offset, dof);
  assert_int_equal(f->bytes_per_page, bytes);
  assert_int_equal(f->page_count, -1);
}

/* Appendix A.2: TP 1 both sides, 4 buffers of 8192 B, unit 256: identity. */
static void route_identity_appendix_a(void **state) {
  uint32_t start[3], bufs[4];
  plan_layout lay;
  kvf__plan_layout_default(4, start, bufs, &lay);
  int64_t item[4] = {8192, 8192, 8192, 8192}, unit[4] = {256, 256, 256, 256};
  plan_route_params p = params(1, 0, 1, &lay, item, item, unit, 4);
  plan_route r;
  assert_int_equal(kvf__plan_route_build(&p, &r), 0);
  assert_int_equal(r.is_identity, 1);
  assert_int_equal(r.supports_spec, 1);
  assert_int_equal(r.ntargets, 1);
  assert_int_equal(r.targets[0].rank, 0);
  assert_int_equal(r.targets[0].is_dummy, 0);
  assert_int_equal(r.targets[0].required_dst_info_num, 1);
  assert_int_equal(r.targets[0].nfrags, 0);
  assert_int_equal(r.required_prefill_response_num, 1);
  assert_int_equal(r.nfrags, 0);
  assert_int_equal(r.fanout[0], 1);
  kvf__plan_route_free(&r);
  /* Same TP 4 on both sides: decode rank 2 talks to prefill rank 2 only. */
  p = params(4, 2, 4, &lay, item, item, unit, 4);
  assert_int_equal(kvf__plan_route_build(&p, &r), 0);
  assert_int_equal(r.is_identity, 1);
  assert_int_equal(r.ntargets, 1);
  assert_int_equal(r.targets[0].rank, 2);
  for (int q = 0; q < 4; q++) assert_int_equal(r.fanout[q], 1);
  kvf__plan_route_free(&r);
}

/* §6.5.7: prefill TP 4 -> decode TP 2, 1-layer MHA (K0, V0), 512 -> 1024 B. */
static void route_prefill_wider(void **state) {
  uint32_t start[2], bufs[2];
  plan_layout lay;
  kvf__plan_layout_default(2, start, bufs, &lay);
  int64_t di[2] = {1024, 1024}, pi[2] = {512, 512}, unit[2] = {256, 256};
  plan_route r;
  for (int d = 0; d < 2; d++) {
    plan_route_params p = params(2, d, 4, &lay, di, pi, unit, 2);
    assert_int_equal(kvf__plan_route_build(&p, &r), 0);
    assert_int_equal(r.is_identity, 0);
    assert_int_equal(r.supports_spec, 0);
    assert_int_equal(r.required_prefill_response_num, 2);
    assert_int_equal(r.ntargets, 2);
    for (int q = 0; q < 4; q++) assert_int_equal(r.fanout[q], 1);
    for (int t = 0; t < 2; t++) {
      const plan_target *tg = &r.targets[t];
      assert_int_equal(tg->rank, 2 * d + t);
      assert_int_equal(tg->required_dst_info_num, 1);
      assert_int_equal(tg->nfrags, 2);
      /* One fragment per KV buffer, in pair order K0 then V0. */
      check_frag(&r.frags[tg->frag_start], 0, WIRE_KIND_TARGET_K, 2 * d + t, d, 512, 1024, 0, 512 * t, 512);
      check_frag(&r.frags[tg->frag_start + 1], 1, WIRE_KIND_TARGET_V, 2 * d + t, d, 512, 1024, 0, 512 * t, 512);
    }
    assert_int_equal(r.nfrags, 4);
    kvf__plan_route_free(&r);
  }
}

/* §6.5.7 reverse: prefill TP 2 -> decode TP 4; decode rank 1 takes the
 * second half of p0's pages; p0 waits for two M2s. */
static void route_decode_wider(void **state) {
  uint32_t start[2], bufs[2];
  plan_layout lay;
  kvf__plan_layout_default(2, start, bufs, &lay);
  int64_t di[2] = {512, 512}, pi[2] = {1024, 1024}, unit[2] = {256, 256};
  plan_route_params p = params(4, 1, 2, &lay, di, pi, unit, 2);
  plan_route r;
  assert_int_equal(kvf__plan_route_build(&p, &r), 0);
  assert_int_equal(r.is_identity, 0);
  assert_int_equal(r.ntargets, 1);
  assert_int_equal(r.targets[0].rank, 0);
  assert_int_equal(r.targets[0].required_dst_info_num, 2);
  assert_int_equal(r.required_prefill_response_num, 1);
  assert_int_equal(r.fanout[0], 2);
  assert_int_equal(r.fanout[1], 2);
  assert_int_equal(r.nfrags, 2);
  check_frag(&r.frags[0], 0, WIRE_KIND_TARGET_K, 0, 1, 1024, 512, 512, 0, 512);
  check_frag(&r.frags[1], 1, WIRE_KIND_TARGET_V, 0, 1, 1024, 512, 512, 0, 512);
  kvf__plan_route_free(&r);
  /* Decode rank 2 takes the first half of p1. */
  p.decode_tp_rank = 2;
  assert_int_equal(kvf__plan_route_build(&p, &r), 0);
  assert_int_equal(r.ntargets, 1);
  assert_int_equal(r.targets[0].rank, 1);
  check_frag(&r.frags[0], 0, WIRE_KIND_TARGET_K, 1, 2, 1024, 512, 0, 0, 512);
  kvf__plan_route_free(&r);
}

/* §6.5.7 GQA replica example: Tp 4, Td 1, 16384 -> 32768, unit 256. */
static void route_gqa_replicas(void **state) {
  uint32_t start[2] = {0, 1}, bufs[1] = {0};
  plan_layout lay = {.nlayers = 1, .start = start, .bufs = bufs};
  int64_t di[1] = {32768}, pi[1] = {16384}, unit[1] = {256};
  plan_route_params p = params(1, 0, 4, &lay, di, pi, unit, 1);
  plan_route r;
  assert_int_equal(kvf__plan_route_build(&p, &r), 0);
  assert_int_equal(r.is_identity, 0);
  assert_int_equal(r.ntargets, 2);
  assert_int_equal(r.targets[0].rank, 0);
  assert_int_equal(r.targets[1].rank, 2);
  assert_int_equal(r.required_prefill_response_num, 2);
  check_frag(&r.frags[r.targets[0].frag_start], 0, WIRE_KIND_TARGET_K, 0, 0, 16384, 32768, 0, 0, 16384);
  check_frag(&r.frags[r.targets[1].frag_start], 0, WIRE_KIND_TARGET_K, 2, 0, 16384, 32768, 0, 16384, 16384);
  int want[4] = {1, 0, 1, 0};
  for (int q = 0; q < 4; q++) assert_int_equal(r.fanout[q], want[q]);
  assert_int_equal(r.targets[0].required_dst_info_num, 1);
  /* §8 item 4: ranks 1 and 3 get dummies from decode rank 0, in rank order;
   * the response count stays 2 (dummies send no M3). */
  assert_int_equal(kvf__plan_route_add_dummies(&r, 1, 0), 0);
  assert_int_equal(r.ntargets, 4);
  for (int q = 0; q < 4; q++) {
    assert_int_equal(r.targets[q].rank, q);
    assert_int_equal(r.targets[q].is_dummy, q % 2);
    assert_int_equal(r.targets[q].required_dst_info_num, 1);
    assert_int_equal(r.fanout[q], 1);
  }
  assert_int_equal(r.targets[1].nfrags, 0);
  assert_int_equal(r.targets[2].nfrags, 1);
  check_frag(&r.frags[r.targets[2].frag_start], 0, WIRE_KIND_TARGET_K, 2, 0, 16384, 32768, 0, 16384, 16384);
  assert_int_equal(r.required_prefill_response_num, 2);
  kvf__plan_route_free(&r);
}

/* Dummies spread over decode ranks: Tp 4 replicated onto Td 2 (sources 0
 * and 2): rank 1 goes to decode 0, rank 3 to decode 1, each exactly once. */
static void route_dummies_spread(void **state) {
  uint32_t start[2] = {0, 1}, bufs[1] = {0};
  plan_layout lay = {.nlayers = 1, .start = start, .bufs = bufs};
  int64_t di[1] = {4096}, pi[1] = {4096}, unit[1] = {4096};
  for (int d = 0; d < 2; d++) {
    plan_route_params p = params(2, d, 4, &lay, di, pi, unit, 1);
    plan_route r;
    assert_int_equal(kvf__plan_route_build(&p, &r), 0);
    assert_int_equal(r.ntargets, 1);
    assert_int_equal(r.targets[0].rank, 2 * d);
    assert_int_equal(kvf__plan_route_add_dummies(&r, 2, d), 0);
    assert_int_equal(r.ntargets, 2);
    assert_int_equal(r.targets[0].rank, 2 * d);
    assert_int_equal(r.targets[0].is_dummy, 0);
    assert_int_equal(r.targets[1].rank, 2 * d + 1);
    assert_int_equal(r.targets[1].is_dummy, 1);
    assert_int_equal(r.required_prefill_response_num, 1);
    kvf__plan_route_free(&r);
  }
}

/* Identical latent buffers with different TP (MLA under the generic
 * planner): replicated, source rank d*Tp/Td, whole pages. Ranks 1 and 3
 * are never contacted (§8 item 4), which fanout makes visible. Also draft
 * kinds, state pairs and "published none". */
static void route_replicated_draft_state(void **state) {
  uint32_t start[3] = {0, 1, 2}, bufs[2] = {0, 1};
  plan_layout lay = {.nlayers = 2, .start = start, .bufs = bufs};
  int64_t item[2] = {1152, 1152}, sd[1] = {4096}, sp[1] = {2048};
  plan_route_params p = params(2, 1, 4, &lay, item, item, NULL, 2);
  p.target_layer_num = 1;
  p.d_state_item = sd;
  p.n_d_state = 1;
  p.p_state_item = sp;
  p.n_p_state = 1;
  plan_route r;
  assert_int_equal(kvf__plan_route_build(&p, &r), 0);
  /* State: 2048 B x prefill TP 4 = 4096 B x decode TP 2 -> sharded; decode
   * rank 1 holds [4096, 8192) = prefill ranks 2 and 3, so rank 3 becomes a
   * target through the state buffer alone. */
  assert_int_equal(r.ntargets, 2);
  assert_int_equal(r.targets[0].rank, 2);
  assert_int_equal(r.targets[0].nfrags, 3);
  assert_int_equal(r.targets[1].rank, 3);
  assert_int_equal(r.targets[1].nfrags, 1);
  assert_int_equal(r.nfrags, 4);
  check_frag(&r.frags[0], 0, WIRE_KIND_TARGET_K, 2, 1, 1152, 1152, 0, 0, 1152);
  check_frag(&r.frags[1], 1, WIRE_KIND_DRAFT_K, 2, 1, 1152, 1152, 0, 0, 1152);
  check_frag(&r.frags[2], 0, WIRE_KIND_MAMBA_STATE, 2, 1, 2048, 4096, 0, 0, 2048);
  check_frag(&r.frags[3], 0, WIRE_KIND_MAMBA_STATE, 3, 1, 2048, 4096, 0, 2048, 2048);
  kvf__plan_route_free(&r);
  /* ...so recompute without state to check the pure replicated case. */
  p.n_d_state = p.n_p_state = 0;
  assert_int_equal(kvf__plan_route_build(&p, &r), 0);
  assert_int_equal(r.ntargets, 1);
  int want[4] = {1, 0, 1, 0};
  for (int q = 0; q < 4; q++) assert_int_equal(r.fanout[q], want[q]);
  kvf__plan_route_free(&r);
  /* And state alone: targets 2 and 3 with mamba_state fragments. */
  uint32_t s0[1] = {0};
  plan_layout empty = {.nlayers = 0, .start = s0, .bufs = NULL};
  p.layout = &empty;
  p.n_d_state = p.n_p_state = 1;
  assert_int_equal(kvf__plan_route_build(&p, &r), 0);
  assert_int_equal(r.ntargets, 2);
  assert_int_equal(r.targets[0].rank, 2);
  assert_int_equal(r.targets[1].rank, 3);
  check_frag(&r.frags[0], 0, WIRE_KIND_MAMBA_STATE, 2, 1, 2048, 4096, 0, 0, 2048);
  check_frag(&r.frags[1], 0, WIRE_KIND_MAMBA_STATE, 3, 1, 2048, 4096, 0, 2048, 2048);
  kvf__plan_route_free(&r);
  /* Published none: Ip = Id*Td/Tp = 1024*2/4 = 512, as in §6.5.7. */
  uint32_t st2[2], bf2[2];
  plan_layout mha;
  kvf__plan_layout_default(2, st2, bf2, &mha);
  int64_t di[2] = {1024, 1024}, unit[2] = {256, 256};
  p = params(2, 0, 4, &mha, di, NULL, unit, 2);
  p.n_p_kv_unit = 0; /* prefill units unpublished -> 1, decode says 256: mismatch */
  char err[160] = "";
  p.err = err;
  p.err_cap = sizeof err;
  assert_int_equal(kvf__plan_route_build(&p, &r), KVF_EINVAL);
  assert_non_null(strstr(err, "unit"));
  p.n_p_kv_unit = 2;
  assert_int_equal(kvf__plan_route_build(&p, &r), 0);
  assert_int_equal(r.ntargets, 2);
  assert_int_equal(r.frags[0].src_page_stride_bytes, 512);
  kvf__plan_route_free(&r);
}

/* Kinds follow the layer: first buffer of a layer is *_k, the others *_v;
 * layers at or past target_layer_num are draft. Pair order is offsets order
 * (K0, V0, K1, V1), not buffer-index order. */
static void route_kinds_and_pair_order(void **state) {
  uint32_t start[3], bufs[4];
  plan_layout lay;
  kvf__plan_layout_default(4, start, bufs, &lay);
  int64_t di[4] = {1024, 1024, 1024, 1024}, pi[4] = {512, 512, 512, 512};
  int64_t unit[4] = {256, 256, 256, 256};
  plan_route_params p = params(1, 0, 2, &lay, di, pi, unit, 4);
  p.target_layer_num = 1;
  plan_route r;
  assert_int_equal(kvf__plan_route_build(&p, &r), 0);
  assert_int_equal(r.ntargets, 2);
  assert_int_equal(r.targets[1].nfrags, 4);
  const wire_fragment *f = &r.frags[r.targets[1].frag_start];
  static const uint32_t want_buf[4] = {0, 2, 1, 3};
  static const int want_kind[4] = {WIRE_KIND_TARGET_K, WIRE_KIND_TARGET_V, WIRE_KIND_DRAFT_K, WIRE_KIND_DRAFT_V};
  for (int i = 0; i < 4; i++) {
    check_frag(&f[i], want_buf[i], want_kind[i], 1, 0, 512, 1024, 0, 512, 512);
  }
  kvf__plan_route_free(&r);
}

static void route_rejects_bad_layouts(void **state) {
  uint32_t start[2], bufs[2];
  plan_layout lay;
  kvf__plan_layout_default(2, start, bufs, &lay);
  char err[200];
  plan_route r;
  memset(&r, 0x5a, sizeof r);
  plan_route before = r;
  /* 3 heads per prefill rank vs 4 per decode rank: no rule fits. */
  int64_t di[2] = {1024, 1024}, pi[2] = {768, 768}, unit[2] = {256, 256};
  plan_route_params p = params(2, 0, 4, &lay, di, pi, unit, 2);
  p.err = err;
  p.err_cap = sizeof err;
  err[0] = '\0';
  assert_int_equal(kvf__plan_route_build(&p, &r), KVF_EINVAL);
  assert_non_null(strstr(err, "unsupported heterogeneous TP buffer layout"));
  assert_memory_equal(&r, &before, sizeof r);
  /* Item not a multiple of the unit. */
  int64_t odd[2] = {1000, 1000};
  p = params(2, 0, 4, &lay, di, odd, unit, 2);
  assert_int_equal(kvf__plan_route_build(&p, &r), KVF_EINVAL);
  /* Prefill list shorter than the decode's buffer count. */
  p = params(2, 0, 4, &lay, di, pi, unit, 2);
  p.n_p_kv = 1;
  assert_int_equal(kvf__plan_route_build(&p, &r), KVF_EINVAL);
  /* Non-positive lengths, bad sizes and ranks. */
  int64_t zero[2] = {0, 0};
  p = params(2, 0, 4, &lay, di, zero, NULL, 2);
  assert_int_equal(kvf__plan_route_build(&p, &r), KVF_EINVAL);
  p = params(2, 2, 4, &lay, di, di, NULL, 2);
  assert_int_equal(kvf__plan_route_build(&p, &r), KVF_EINVAL);
  p = params(0, 0, 4, &lay, di, di, NULL, 2);
  assert_int_equal(kvf__plan_route_build(&p, &r), KVF_EINVAL);
  p = params(2, 0, PLAN_MAX_TP + 1, &lay, di, di, NULL, 2);
  assert_int_equal(kvf__plan_route_build(&p, &r), KVF_EINVAL);
  /* A zero unit length. */
  int64_t zu[2] = {0, 0};
  p = params(2, 0, 4, &lay, di, pi, zu, 2);
  assert_int_equal(kvf__plan_route_build(&p, &r), KVF_EINVAL);
  assert_memory_equal(&r, &before, sizeof r);
}

static void route_legacy_mla(void **state) {
  plan_route r;
  /* Equal TP. */
  assert_int_equal(kvf__plan_route_legacy_mla(2, 1, 2, 0, &r), 0);
  assert_int_equal(r.ntargets, 1);
  assert_int_equal(r.targets[0].rank, 1);
  assert_int_equal(r.targets[0].required_dst_info_num, 1);
  assert_int_equal(r.required_prefill_response_num, 1);
  assert_int_equal(r.supports_spec, 1);
  kvf__plan_route_free(&r);
  /* Decode wider: rank 3 of 4 over 2 prefill ranks -> rank 1, fan-out 2. */
  assert_int_equal(kvf__plan_route_legacy_mla(4, 3, 2, 0, &r), 0);
  assert_int_equal(r.ntargets, 1);
  assert_int_equal(r.targets[0].rank, 1);
  assert_int_equal(r.targets[0].required_dst_info_num, 2);
  assert_int_equal(r.required_prefill_response_num, 1);
  kvf__plan_route_free(&r);
  /* Prefill wider: decode 1 of 2 over 4 -> ranks 2 (real) and 3 (dummy). */
  assert_int_equal(kvf__plan_route_legacy_mla(2, 1, 4, 0, &r), 0);
  assert_int_equal(r.ntargets, 2);
  assert_int_equal(r.targets[0].rank, 2);
  assert_int_equal(r.targets[0].is_dummy, 0);
  assert_int_equal(r.targets[1].rank, 3);
  assert_int_equal(r.targets[1].is_dummy, 1);
  assert_int_equal(r.targets[1].required_dst_info_num, 1);
  assert_int_equal(r.required_prefill_response_num, 1);
  kvf__plan_route_free(&r);
  /* L1.5: all prefill ranks, each waiting for every decode rank. */
  assert_int_equal(kvf__plan_route_legacy_mla(2, 0, 4, 1, &r), 0);
  assert_int_equal(r.ntargets, 4);
  assert_int_equal(r.required_prefill_response_num, 4);
  for (int t = 0; t < 4; t++) {
    assert_int_equal(r.targets[t].rank, t);
    assert_int_equal(r.targets[t].required_dst_info_num, 2);
  }
  kvf__plan_route_free(&r);
  assert_int_equal(kvf__plan_route_legacy_mla(3, 0, 2, 0, &r), KVF_EINVAL);
  assert_int_equal(kvf__plan_route_legacy_mla(2, 0, 3, 0, &r), KVF_EINVAL);
}

/* The planner's fragments carry the wire's kinds and names (one table). */
static void kind_names(void **state) {
  static const char *names[] = {"target_k", "target_v", "draft_k", "draft_v", "mamba_state"};
  for (int k = 0; k <= WIRE_KIND_MAMBA_STATE; k++) {
    assert_string_equal(kvf__wire_buffer_kind_name(k), names[k]);
    assert_int_equal(kvf__wire_buffer_kind_parse(names[k]), k);
  }
  assert_null(kvf__wire_buffer_kind_name(5));
  assert_int_equal(kvf__wire_buffer_kind_parse("target_q"), -1);
}

/* ---- Fragment execution ---- */

/* §6.5.7: prefill rank p1 writes its page 7 into decode-0 page 3 of K0 at
 * +512; a run of three pages becomes one strided block. */
static void frag_writes_worked_example(void **state) {
  uint32_t start[2], bufs[2];
  plan_layout lay;
  kvf__plan_layout_default(2, start, bufs, &lay);
  int64_t di[2] = {1024, 1024}, pi[2] = {512, 512}, unit[2] = {256, 256};
  plan_route_params p = params(2, 0, 4, &lay, di, pi, unit, 2);
  plan_route r;
  assert_int_equal(kvf__plan_route_build(&p, &r), 0);
  const plan_target *t1 = &r.targets[1];
  assert_int_equal(t1->rank, 1);
  const wire_fragment *fr = &r.frags[t1->frag_start];
  uint64_t pbase[2] = {0x100000, 0x200000}, dbase[2] = {0x900000, 0xa00000};
  plan_mem pm = {.base = pbase, .nbufs = 2}, dm = {.base = dbase, .nbufs = 2};

  int64_t src1[1] = {7}, dst1[1] = {3};
  plan_run runs[3];
  size_t nruns, n;
  assert_int_equal(kvf__plan_runs(src1, dst1, 1, runs, &nruns), 0);
  kvf_write w[8];
  plan_xfer x = {.lay = &lay, .l0 = 0, .l1 = 1, .runs = runs, .nruns = nruns, .src = &pm, .dst = &dm};
  x.frags = fr, x.nfrags = t1->nfrags;
  assert_int_equal(kvf__plan_frag_count(&x), 2);
  assert_int_equal(kvf__plan_frag_writes(&x, w, 8, &n), 0);
  assert_int_equal(n, 2);
  assert_int_equal(w[0].src, 0x100000 + 7 * 512);
  assert_int_equal(w[0].dst, 0x900000 + 3 * 1024 + 512);
  assert_int_equal(w[0].len, 512);
  assert_true(w[0].count <= 1);
  assert_int_equal(w[1].src, 0x200000 + 7 * 512); /* V0 */
  assert_int_equal(w[1].dst, 0xa00000 + 3 * 1024 + 512);

  int64_t src3[3] = {7, 8, 9}, dst3[3] = {3, 4, 5};
  assert_int_equal(kvf__plan_runs(src3, dst3, 3, runs, &nruns), 0);
  x.nruns = nruns;
  assert_int_equal(kvf__plan_frag_writes(&x, w, 8, &n), 0);
  assert_int_equal(n, 2);
  assert_int_equal(w[0].count, 3);
  assert_int_equal(w[0].len, 512);
  assert_int_equal(w[0].src_stride, 512);
  assert_int_equal(w[0].dst_stride, 1024);
  assert_int_equal(w[0].src, 0x100000 + 7 * 512);
  assert_int_equal(w[0].dst, 0x900000 + 3 * 1024 + 512);
  /* Piece i of the strided block is exactly the reference's page i. */
  for (uint64_t i = 0; i < 3; i++) {
    assert_int_equal(w[0].src + i * w[0].src_stride, 0x100000 + (uint64_t)src3[i] * 512);
    assert_int_equal(w[0].dst + i * w[0].dst_stride, 0x900000 + (uint64_t)dst3[i] * 1024 + 512);
  }
  /* State mode picks no KV fragments. */
  x.state = 1;
  assert_int_equal(kvf__plan_frag_count(&x), 0);
  assert_int_equal(kvf__plan_frag_writes(&x, w, 8, &n), 0);
  assert_int_equal(n, 0);
  x.state = 0;
  /* Decode buffer length: page 5 + 512 + 512 ends at 6*1024. */
  uint64_t dlen[2] = {6 * 1024, 6 * 1024};
  dm.len = dlen;
  assert_int_equal(kvf__plan_frag_writes(&x, w, 8, &n), 0);
  dlen[1] = 6 * 1024 - 1;
  assert_int_equal(kvf__plan_frag_writes(&x, w, 8, &n), KVF_ERANGE);
  dm.len = NULL;
  assert_int_equal(kvf__plan_frag_writes(&x, w, 1, &n), KVF_ETOOBIG);
  kvf__plan_route_free(&r);
}

static void frag_writes_coalesce_limit_and_reject(void **state) {
  uint32_t start[2] = {0, 1}, bufs[1] = {0};
  plan_layout lay = {.nlayers = 1, .start = start, .bufs = bufs};
  uint64_t pbase[1] = {0x10000}, dbase[1] = {0x80000};
  plan_mem pm = {.base = pbase, .nbufs = 1}, dm = {.base = dbase, .nbufs = 1};
  int64_t src[5] = {1, 2, 3, 10, 11}, dst[5] = {4, 5, 6, 20, 21};
  plan_run runs[5];
  size_t nruns, n;
  assert_int_equal(kvf__plan_runs(src, dst, 5, runs, &nruns), 0);
  assert_int_equal(nruns, 2);
  kvf_write w[8];
  /* Whole pages on both sides (replicated): one plain block per run. */
  wire_fragment whole = {.buffer_index = 0,
                         .buffer_kind = WIRE_KIND_TARGET_K,
                         .src_page_stride_bytes = 1152,
                         .dst_page_stride_bytes = 1152,
                         .bytes_per_page = 1152,
                         .page_count = -1};
  plan_xfer x = {.lay = &lay, .l0 = 0, .l1 = 1, .runs = runs, .nruns = nruns, .src = &pm, .dst = &dm};
  x.frags = &whole, x.nfrags = 1;
  assert_int_equal(kvf__plan_frag_writes(&x, w, 8, &n), 0);
  assert_int_equal(n, 2);
  assert_true(w[0].count <= 1);
  assert_int_equal(w[0].len, 3 * 1152);
  assert_int_equal(w[0].src, 0x10000 + 1152);
  assert_int_equal(w[0].dst, 0x80000 + 4 * 1152);
  assert_int_equal(w[1].len, 2 * 1152);
  /* page_count limits each run; 0 drops every block, and counts agree. */
  wire_fragment lim = whole;
  lim.src_page_stride_bytes = 2048;
  lim.page_count = 2;
  x.frags = &lim;
  assert_int_equal(kvf__plan_frag_count(&x), 2);
  assert_int_equal(kvf__plan_frag_writes(&x, w, 8, &n), 0);
  assert_int_equal(w[0].count, 2);
  assert_int_equal(w[1].count, 2);
  lim.page_count = 0;
  assert_int_equal(kvf__plan_frag_count(&x), 0);
  assert_int_equal(kvf__plan_frag_writes(&x, w, 8, &n), 0);
  assert_int_equal(n, 0);
  /* A fragment that would spill into the next page, or is empty. */
  wire_fragment spill = whole;
  spill.dst_byte_offset = 1;
  x.frags = &spill;
  assert_int_equal(kvf__plan_frag_writes(&x, w, 8, &n), KVF_ERANGE);
  wire_fragment empty = whole;
  empty.bytes_per_page = 0;
  x.frags = &empty;
  assert_int_equal(kvf__plan_frag_writes(&x, w, 8, &n), KVF_ERANGE);
  wire_fragment wrap = whole;
  wrap.src_byte_offset = INT64_MAX - 10;
  x.frags = &wrap;
  assert_int_equal(kvf__plan_frag_writes(&x, w, 8, &n), KVF_ERANGE);
  /* Fragments for buffers not in the layer are ignored; a layer buffer
   * past the decode's registered count is refused. */
  wire_fragment other = whole;
  other.buffer_index = 5;
  x.frags = &other;
  assert_int_equal(kvf__plan_frag_writes(&x, w, 8, &n), 0);
  assert_int_equal(n, 0);
  plan_mem none = {.base = dbase, .nbufs = 0};
  x.frags = &whole, x.dst = &none;
  assert_int_equal(kvf__plan_frag_writes(&x, w, 8, &n), KVF_EINVAL);
  /* State mode uses mamba_state fragments only. */
  wire_fragment st = whole;
  st.buffer_kind = WIRE_KIND_MAMBA_STATE;
  wire_fragment both[2] = {whole, st};
  x.frags = both, x.nfrags = 2, x.state = 1;
  assert_int_equal(kvf__plan_frag_count(&x), 2);
  x.state = 0;
  assert_int_equal(kvf__plan_frag_count(&x), 2);
}

/* ---- Small helpers ---- */

/* ---- Draft layers: fragment JSON equal to the reference's ---- */

/* The reference's encode_transfer_fragments output for the same input (its
 * receiver's _build_non_mla_route_plan run on it): 2 target MHA layers and
 * 1 draft layer, KVArgs.offsets [[0,2],[1,3],[4,5]], target_layer_num 2,
 * unit 256. Case A: decode TP 1 (item 1024) from prefill TP 2 (item 512),
 * targets 0 and 1. Case B: decode TP 2 rank 1 (item 512) from prefill TP 1
 * (item 1024). */
static const char *const DRAFT_JSON_A0 =
    "[{\"buffer_index\":0,\"buffer_kind\":\"target_k\",\"src_rank\":0,\"dst_rank\":0,\"src_page_stride_bytes\":"
    "512,\"dst_page_stride_bytes\":1024,\"src_byte_offset\":0,\"dst_byte_offset\":0,\"bytes_per_page\":512,\"page_"
    "count\":null},"
    "{\"buffer_index\":2,\"buffer_kind\":\"target_v\",\"src_rank\":0,\"dst_rank\":0,\"src_page_stride_bytes\":512,"
    "\"dst_page_stride_bytes\":1024,\"src_byte_offset\":0,\"dst_byte_offset\":0,\"bytes_per_page\":512,\"page_"
    "count\":null},"
    "{\"buffer_index\":1,\"buffer_kind\":\"target_k\",\"src_rank\":0,\"dst_rank\":0,\"src_page_stride_bytes\":512,"
    "\"dst_page_stride_bytes\":1024,\"src_byte_offset\":0,\"dst_byte_offset\":0,\"bytes_per_page\":512,\"page_"
    "count\":null},"
    "{\"buffer_index\":3,\"buffer_kind\":\"target_v\",\"src_rank\":0,\"dst_rank\":0,\"src_page_stride_bytes\":512,"
    "\"dst_page_stride_bytes\":1024,\"src_byte_offset\":0,\"dst_byte_offset\":0,\"bytes_per_page\":512,\"page_"
    "count\":null},"
    "{\"buffer_index\":4,\"buffer_kind\":\"draft_k\",\"src_rank\":0,\"dst_rank\":0,\"src_page_stride_bytes\":512,"
    "\"dst_page_stride_bytes\":1024,\"src_byte_offset\":0,\"dst_byte_offset\":0,\"bytes_per_page\":512,\"page_"
    "count\":null},"
    "{\"buffer_index\":5,\"buffer_kind\":\"draft_v\",\"src_rank\":0,\"dst_rank\":0,\"src_page_stride_bytes\":512,"
    "\"dst_page_stride_bytes\":1024,\"src_byte_offset\":0,\"dst_byte_offset\":0,\"bytes_per_page\":512,\"page_"
    "count\":null}]";
static const char *const DRAFT_JSON_A1 =
    "[{\"buffer_index\":0,\"buffer_kind\":\"target_k\",\"src_rank\":1,\"dst_rank\":0,\"src_page_stride_bytes\":"
    "512,\"dst_page_stride_bytes\":1024,\"src_byte_offset\":0,\"dst_byte_offset\":512,\"bytes_per_page\":512,"
    "\"page_count\":null},"
    "{\"buffer_index\":2,\"buffer_kind\":\"target_v\",\"src_rank\":1,\"dst_rank\":0,\"src_page_stride_bytes\":512,"
    "\"dst_page_stride_bytes\":1024,\"src_byte_offset\":0,\"dst_byte_offset\":512,\"bytes_per_page\":512,\"page_"
    "count\":null},"
    "{\"buffer_index\":1,\"buffer_kind\":\"target_k\",\"src_rank\":1,\"dst_rank\":0,\"src_page_stride_bytes\":512,"
    "\"dst_page_stride_bytes\":1024,\"src_byte_offset\":0,\"dst_byte_offset\":512,\"bytes_per_page\":512,\"page_"
    "count\":null},"
    "{\"buffer_index\":3,\"buffer_kind\":\"target_v\",\"src_rank\":1,\"dst_rank\":0,\"src_page_stride_bytes\":512,"
    "\"dst_page_stride_bytes\":1024,\"src_byte_offset\":0,\"dst_byte_offset\":512,\"bytes_per_page\":512,\"page_"
    "count\":null},"
    "{\"buffer_index\":4,\"buffer_kind\":\"draft_k\",\"src_rank\":1,\"dst_rank\":0,\"src_page_stride_bytes\":512,"
    "\"dst_page_stride_bytes\":1024,\"src_byte_offset\":0,\"dst_byte_offset\":512,\"bytes_per_page\":512,\"page_"
    "count\":null},"
    "{\"buffer_index\":5,\"buffer_kind\":\"draft_v\",\"src_rank\":1,\"dst_rank\":0,\"src_page_stride_bytes\":512,"
    "\"dst_page_stride_bytes\":1024,\"src_byte_offset\":0,\"dst_byte_offset\":512,\"bytes_per_page\":512,\"page_"
    "count\":null}]";
static const char *const DRAFT_JSON_B0 =
    "[{\"buffer_index\":0,\"buffer_kind\":\"target_k\",\"src_rank\":0,\"dst_rank\":1,\"src_page_stride_bytes\":"
    "1024,\"dst_page_stride_bytes\":512,\"src_byte_offset\":512,\"dst_byte_offset\":0,\"bytes_per_page\":512,"
    "\"page_count\":null},"
    "{\"buffer_index\":2,\"buffer_kind\":\"target_v\",\"src_rank\":0,\"dst_rank\":1,\"src_page_stride_bytes\":"
    "1024,\"dst_page_stride_bytes\":512,\"src_byte_offset\":512,\"dst_byte_offset\":0,\"bytes_per_page\":512,"
    "\"page_count\":null},"
    "{\"buffer_index\":1,\"buffer_kind\":\"target_k\",\"src_rank\":0,\"dst_rank\":1,\"src_page_stride_bytes\":"
    "1024,\"dst_page_stride_bytes\":512,\"src_byte_offset\":512,\"dst_byte_offset\":0,\"bytes_per_page\":512,"
    "\"page_count\":null},"
    "{\"buffer_index\":3,\"buffer_kind\":\"target_v\",\"src_rank\":0,\"dst_rank\":1,\"src_page_stride_bytes\":"
    "1024,\"dst_page_stride_bytes\":512,\"src_byte_offset\":512,\"dst_byte_offset\":0,\"bytes_per_page\":512,"
    "\"page_count\":null},"
    "{\"buffer_index\":4,\"buffer_kind\":\"draft_k\",\"src_rank\":0,\"dst_rank\":1,\"src_page_stride_bytes\":1024,"
    "\"dst_page_stride_bytes\":512,\"src_byte_offset\":512,\"dst_byte_offset\":0,\"bytes_per_page\":512,\"page_"
    "count\":null},"
    "{\"buffer_index\":5,\"buffer_kind\":\"draft_v\",\"src_rank\":0,\"dst_rank\":1,\"src_page_stride_bytes\":1024,"
    "\"dst_page_stride_bytes\":512,\"src_byte_offset\":512,\"dst_byte_offset\":0,\"bytes_per_page\":512,\"page_"
    "count\":null}]";

/* Frame 13 of one target: its plan fragments as the decode sends them. */
static char *target_json(const plan_route *r, int t) {
  const plan_target *pt = &r->targets[t];
  char *json = NULL, reason[128] = "";
  size_t len = 0;
  assert_int_equal(kvf__wire_fragments_format(&r->frags[pt->frag_start], pt->nfrags, &json, &len, reason), 0);
  assert_int_equal(strlen(json), len);
  return json;
}

static void route_draft_json_matches_reference(void **state) {
  uint32_t start[4] = {0, 2, 4, 6}, bufs[6] = {0, 2, 1, 3, 4, 5};
  plan_layout lay = {.nlayers = 3, .start = start, .bufs = bufs};
  int64_t wide[6] = {1024, 1024, 1024, 1024, 1024, 1024}, narrow[6] = {512, 512, 512, 512, 512, 512};
  int64_t unit[6] = {256, 256, 256, 256, 256, 256};
  plan_route r;
  char *json;

  plan_route_params p = params(1, 0, 2, &lay, wide, narrow, unit, 6);
  p.target_layer_num = 2;
  assert_int_equal(kvf__plan_route_build(&p, &r), 0);
  assert_int_equal(r.ntargets, 2);
  assert_false(r.supports_spec); /* the reference: supports_remote_spec_candidates False */
  json = target_json(&r, 0);
  assert_string_equal(json, DRAFT_JSON_A0);
  free(json);
  json = target_json(&r, 1);
  assert_string_equal(json, DRAFT_JSON_A1);
  free(json);
  kvf__plan_route_free(&r);

  /* Without the count (0) every layer is labelled target, as before. */
  p.target_layer_num = 0;
  assert_int_equal(kvf__plan_route_build(&p, &r), 0);
  json = target_json(&r, 0);
  assert_null(strstr(json, "draft"));
  free(json);
  kvf__plan_route_free(&r);

  p = params(2, 1, 1, &lay, narrow, wide, unit, 6);
  p.target_layer_num = 2;
  assert_int_equal(kvf__plan_route_build(&p, &r), 0);
  assert_int_equal(r.ntargets, 1);
  assert_int_equal(r.targets[0].required_dst_info_num, 2);
  json = target_json(&r, 0);
  assert_string_equal(json, DRAFT_JSON_B0);
  free(json);
  kvf__plan_route_free(&r);
}

static void dp_group_floor_modulo(void **state) {
  int64_t g = -1;
  assert_int_equal(kvf__plan_dp_group(7215963401LL, 1, &g), 0);
  assert_int_equal(g, 0);
  assert_int_equal(kvf__plan_dp_group(7215963401LL, 4, &g), 0);
  assert_int_equal(g, 1);
  assert_int_equal(kvf__plan_dp_group(-1, 4, &g), 0);
  assert_int_equal(g, 3);
  assert_int_equal(kvf__plan_dp_group(-8, 4, &g), 0);
  assert_int_equal(g, 0);
  assert_int_equal(kvf__plan_dp_group(INT64_MIN, 3, &g), 0);
  assert_int_equal(g, 1); /* Python: -2**63 % 3 == 1 */
  g = 42;
  assert_int_equal(kvf__plan_dp_group(5, 0, &g), KVF_EINVAL);
  assert_int_equal(kvf__plan_dp_group(5, -2, &g), KVF_EINVAL);
  assert_int_equal(g, 42);
}

static void session_port_and_queue_shard(void **state) {
  int port = 0;
  assert_int_equal(kvf__plan_session_port("10.0.0.2:15001", &port), 0);
  assert_int_equal(port, 15001);
  assert_int_equal(kvf__plan_session_port("[::1]:80", &port), 0);
  assert_int_equal(port, 80);
  static const char *bad[] = {"",     "10.0.0.2", ":1",   "a:",   "a:b",   "a:1:2",   "a:65536", "a:0",
                              "a:+1", "a: 1",     "a:1 ", "a:-1", "[]:80", "[::1]80", "[::1",    "a:123456"};
  port = 7;
  for (size_t i = 0; i < sizeof bad / sizeof *bad; i++)
    assert_int_equal(kvf__plan_session_port(bad[i], &port), KVF_EINVAL);
  assert_int_equal(kvf__plan_session_port(NULL, &port), KVF_EINVAL);
  assert_int_equal(port, 7);
  const char *ss[2] = {"10.0.0.2:15001", "10.0.0.3:15002"};
  int shard = -1;
  assert_int_equal(kvf__plan_queue_shard(ss, 2, 4, &shard), 0);
  assert_int_equal(shard, (15001 + 15002) % 4);
  assert_int_equal(kvf__plan_queue_shard(ss, 1, 4, &shard), 0);
  assert_int_equal(shard, 15001 % 4);
  assert_int_equal(kvf__plan_queue_shard(ss, 0, 4, &shard), 0);
  assert_int_equal(shard, 0);
  shard = 9;
  assert_int_equal(kvf__plan_queue_shard(ss, 2, 0, &shard), KVF_EINVAL);
  const char *bs[2] = {"10.0.0.2:15001", "10.0.0.3"};
  assert_int_equal(kvf__plan_queue_shard(bs, 2, 4, &shard), KVF_EINVAL);
  assert_int_equal(shard, 9);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(runs_appendix_a),
      cmocka_unit_test(runs_break_on_either_side),
      cmocka_unit_test(plain_writes_appendix_a),
      cmocka_unit_test(plain_writes_bounds),
      cmocka_unit_test(route_identity_appendix_a),
      cmocka_unit_test(route_prefill_wider),
      cmocka_unit_test(route_decode_wider),
      cmocka_unit_test(route_gqa_replicas),
      cmocka_unit_test(route_dummies_spread),
      cmocka_unit_test(route_replicated_draft_state),
      cmocka_unit_test(route_kinds_and_pair_order),
      cmocka_unit_test(route_rejects_bad_layouts),
      cmocka_unit_test(route_legacy_mla),
      cmocka_unit_test(kind_names),
      cmocka_unit_test(frag_writes_worked_example),
      cmocka_unit_test(frag_writes_coalesce_limit_and_reject),
      cmocka_unit_test(route_draft_json_matches_reference),
      cmocka_unit_test(dp_group_floor_modulo),
      cmocka_unit_test(session_port_and_queue_shard),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

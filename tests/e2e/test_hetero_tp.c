/* End to end, heterogeneous TP: a prefill instance with Tp ranks in one
 * process (`kvferry-testpeer kv-peer --heads ...`) and Td decode ranks, each its own
 * forked process with its own manager, engine and head-aware pool. Every
 * unit (token, head) of every page is labelled with its GLOBAL token and
 * head, so a decode rank proves byte-exactly that each head slice it holds
 * came from the prefill rank that owns that head (PROTOCOL §5, §6.5-§6.6). */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>

#include "kv/manager.h"
#include "tools/kvpool.h"
#include "tools/pattern.h"
#include "tools/proc.h"
#include "kvferry.h"

#define LAYERS 2
#define PAGES 256
#define UNIT 256 /* one head of one token: head_dim 128, bf16 */
#define SEED 1234
#define STATE_ITEM 1024

typedef struct hcase {
  int tp_p, tp_d;
  int page_size;
  int heads_p, heads_d; /* KV heads per rank on each side */
  int kv_heads;         /* global KV heads (0 = heads_p * tp_p) */
  int mla;              /* decode uses the legacy MLA routing (replicated latent) */
  int nstate;           /* state buffers on both sides */
  int chunk;            /* prefill chunk size in pages (0 = one chunk) */
  int npages;
  int prefix;            /* pages the decode already holds (decode_prefix_len / page_size) */
  const char *fail_with; /* expected failure reason substring on the decode, NULL = success */
  int crash;             /* decode rank crash-1 dies after its M2 went out, before the send (0 = none) */
  int trailer;           /* each decode rank takes its Success from the completion trailer behind its own bytes */
} hcase;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

static void start_peer(proc *p, const hcase *c, char *addr, size_t cap) {
  const char *exe = getenv("KVFERRY_TESTPEER");
  assert_non_null(exe);
  char w[16], l[16], pg[16], ps[16], h[16], kh[16], u[16], ns[16], si[16];
  snprintf(w, sizeof w, "%d", c->tp_p);
  snprintf(l, sizeof l, "%d", LAYERS);
  snprintf(pg, sizeof pg, "%d", PAGES);
  snprintf(ps, sizeof ps, "%d", c->page_size);
  snprintf(h, sizeof h, "%d", c->heads_p);
  snprintf(kh, sizeof kh, "%d", c->kv_heads ? c->kv_heads : c->heads_p * c->tp_p);
  snprintf(u, sizeof u, "%d", UNIT);
  snprintf(ns, sizeof ns, "%d", c->nstate);
  snprintf(si, sizeof si, "%d", STATE_ITEM);
  char *argv[] = {(char *)exe,   "kv-peer", "--world",      w,  "--layers",   l,  "--pages", pg,
                  "--page-size", ps,        "--heads",      h,  "--kv-heads", kh, "--unit",  u,
                  "--state",     ns,        "--state-item", si, NULL};
  assert_int_equal(proc_start(p, argv), 0);
  char line[400], fmt[32];
  assert_int_equal(proc_read_line(p, line, sizeof line, 20000), 0);
  snprintf(fmt, sizeof fmt, "ready %%%zus", cap - 1);
  assert_int_equal(sscanf(line, fmt, addr), 1);
}

/* One decode rank, in a forked child: no cmocka calls here, the exit code
 * says what happened (0 = as expected). */
static int decode_rank(const hcase *c, int d, const char *addr, int64_t room) {
  kvpool pool;
  kvf_manager *m = NULL;
  kvf_receiver *rx = NULL;
  int code = 10;
  size_t head0 = c->mla ? 0 : (size_t)d * (size_t)c->heads_d;
  if (kvpool_init_heads(&pool, LAYERS, PAGES, (size_t)c->page_size, (size_t)c->heads_d, head0, UNIT)) return 11;
  if (c->nstate && kvpool_add_state(&pool, (size_t)c->nstate, 8, STATE_ITEM)) goto out_pool;
  kvf_manager_config mc;
  kvf_manager_config_init(&mc);
  mc.role = KVF_ROLE_DECODE;
  mc.engine_rank = d;
  mc.world_size = c->tp_d;
  mc.page_size = c->page_size;
  mc.is_mla = c->mla;
  mc.waiting_timeout_s = 30;
  mc.http_timeout_ms = 3000;
  if (kvf_manager_create(&mc, &pool.bufs, &m)) {
    code = 12;
    goto out_pool;
  }
  if (kvf_receiver_create(m, addr, room, &rx)) {
    code = 13;
    goto out_mgr;
  }
  uint64_t rng = 0x9E3779B97F4A7C15ULL + (uint64_t)d * 7919;
  int64_t pages[PAGES];
  size_t n = (size_t)(c->npages - c->prefix);
  int64_t slot = 5;
  if (kvpool_take(&pool, n, &rng, pages)) goto out_rx;
  kvf_receiver_init(rx, pages, n, 0, (int64_t)c->prefix * c->page_size, c->nstate ? &slot : NULL,
                    c->nstate ? 1 : 0);
  int st;
  if (c->crash == d + 1) { /* Bootstrapped: its M2 went to ZeroMQ; give that time to send it, then die */
    double by = now_s() + 20;
    while (kvf_receiver_poll(rx) < KVF_POLL_BOOTSTRAPPED && now_s() < by) usleep(1000);
    usleep(500 * 1000);
    _exit(0);
  }
  double until = now_s() + 40;
  while ((st = kvf_receiver_poll(rx)) != KVF_POLL_SUCCESS && st != KVF_POLL_FAILED && now_s() < until) usleep(500);
  char why[256];
  kvf_receiver_failure(rx, why, sizeof why);
  if (c->fail_with) {
    code = st == KVF_POLL_FAILED && strstr(why, c->fail_with) ? 0 : 20;
    if (code) fprintf(stderr, "decode rank %d: status %d, reason '%s'\n", d, st, why);
    goto out_rx;
  }
  if (st != KVF_POLL_SUCCESS) {
    fprintf(stderr, "decode rank %d: status %d: %s\n", d, st, why);
    code = 21;
    goto out_rx;
  }
  int64_t tok = 0;
  int32_t cands[4];
  size_t nc = 0;
  kvf_receiver_pop_metadata(rx, &tok, cands, 4, &nc);
  kvf_engine_sync(kvf_manager_engine(m));
  /* The decode's pages are request positions prefix .. npages-1: check
   * them as the tail of a request whose first `prefix` pages it already had. */
  size_t bad = 0;
  for (size_t k = 0; k < n; k++) {
    for (size_t b = 0; b < pool.nbuf; b++)
      for (size_t t = 0; t < pool.page_size; t++)
        for (size_t j = 0; j < pool.heads; j++) {
          char *u = (char *)pool.ptrs[b] + (uint64_t)pages[k] * pool.item_len + (t * pool.heads + j) * pool.unit;
          uint64_t tokpos = ((size_t)c->prefix + k) * pool.page_size + t;
          bad += !pattern_check(u, pool.unit, SEED, kvpool_unit_label(room, tokpos, pool.head0 + j, b));
        }
  }
  size_t sbad = c->nstate ? kvpool_check_state(&pool, room, slot, SEED) : 0;
  if (bad || sbad || tok != 4242 || nc != 2) {
    fprintf(stderr, "decode rank %d: %zu bad units, %zu bad state buffers, token %lld, %zu candidates\n", d, bad,
            sbad, (long long)tok, nc);
    code = 22;
    goto out_rx;
  }
  unsigned long long fast = atomic_load(&m->stats.completions_fast);
  if (c->trailer && fast != 1) {
    fprintf(stderr, "decode rank %d: %llu completions from the trailer, not 1\n", d, fast);
    code = 23;
    goto out_rx;
  }
  code = 0;
out_rx:
  kvf_receiver_destroy(rx);
out_mgr:
  kvf_manager_destroy(m);
out_pool:
  kvpool_free(&pool);
  return code;
}

/* Run one case: the peer, Td forked decode ranks, one request. */
static void run_case(const hcase *c) {
  static int64_t next_room = 91000;
  int64_t room = next_room++;
  proc peer;
  char addr[300];
  start_peer(&peer, c, addr, sizeof addr);
  pid_t kids[8];
  assert_true(c->tp_d <= 8);
  fflush(NULL);
  for (int d = 0; d < c->tp_d; d++) {
    kids[d] = fork();
    assert_true(kids[d] >= 0);
    if (kids[d] == 0) _exit(decode_rank(c, d, addr, room));
  }
  int crashed = 0;
  if (c->crash) { /* the send starts once that rank is gone */
    assert_int_equal(waitpid(kids[c->crash - 1], &crashed, 0), kids[c->crash - 1]);
    kids[c->crash - 1] = 0;
  }
  fprintf(peer.in, "send %lld %d %d 4242 %d %d\n", (long long)room, c->npages, SEED, c->chunk, c->nstate ? 1 : 0);
  fflush(peer.in);
  /* Children first (bounded), then the peer's verdict. */
  int codes[8];
  double until = now_s() + 60;
  for (int d = 0; d < c->tp_d; d++) {
    int status = 0;
    pid_t w = 0;
    if (!kids[d]) {
      codes[d] = WIFEXITED(crashed) ? WEXITSTATUS(crashed) : 97;
      continue;
    }
    while ((w = waitpid(kids[d], &status, WNOHANG)) == 0 && now_s() < until) usleep(2000);
    if (w == 0) {
      kill(kids[d], SIGKILL);
      waitpid(kids[d], &status, 0);
      codes[d] = 99;
    } else {
      codes[d] = WIFEXITED(status) ? WEXITSTATUS(status) : 98;
    }
  }
  char line[512];
  int got = proc_read_line(&peer, line, sizeof line, 20000);
  proc_stop(&peer, 5000);
  for (int d = 0; d < c->tp_d; d++) {
    if (codes[d]) fprintf(stderr, "decode rank %d exited %d\n", d, codes[d]);
    assert_int_equal(codes[d], 0);
  }
  assert_int_equal(got, 0);
  long long r = 0;
  int st = -1;
  assert_int_equal(sscanf(line, "done %lld %d", &r, &st), 2);
  assert_int_equal(r, room);
  if (!c->fail_with) {
    if (st != KVF_POLL_SUCCESS) fprintf(stderr, "prefill: %s\n", line);
    assert_int_equal(st, KVF_POLL_SUCCESS); /* every prefill rank, covered or not, reached Success */
  }
}

static void tp2_to_tp1_page1(void **state) {
  hcase c = {.tp_p = 2, .tp_d = 1, .page_size = 1, .heads_p = 2, .heads_d = 4, .npages = 37};
  run_case(&c);
}

static void tp1_to_tp2_page1(void **state) {
  hcase c = {.tp_p = 1, .tp_d = 2, .page_size = 1, .heads_p = 4, .heads_d = 2, .npages = 37, .chunk = 8};
  run_case(&c);
}

static void tp4_to_tp2_page1(void **state) {
  hcase c = {.tp_p = 4, .tp_d = 2, .page_size = 1, .heads_p = 2, .heads_d = 4, .npages = 40, .chunk = 16};
  run_case(&c);
}

/* GQA with replicated KV heads: 2 global KV heads over prefill TP 4, so
 * ranks {0,1} and {2,3} hold the same heads (R = 2). Ranks 1 and 3 hold
 * nothing the decode needs; they get dummies and must still succeed (§8.4). */
static void gqa_replicated_tp4_to_tp1(void **state) {
  hcase c = {.tp_p = 4, .tp_d = 1, .page_size = 1, .heads_p = 1, .heads_d = 2, .kv_heads = 2, .npages = 21};
  run_case(&c);
}

/* MLA through the generic planner (the reference runtime's path: the latent
 * is "replicated"): one real sender, the other prefill rank a dummy. */
static void mla_replicated_generic_tp2_to_tp1(void **state) {
  hcase c = {.tp_p = 2, .tp_d = 1, .page_size = 16, .heads_p = 1, .heads_d = 1, .kv_heads = 1, .npages = 9};
  run_case(&c);
}

/* MLA through the legacy rows (decode is_mla): prefill wider (the second
 * prefill rank gets a dummy M2) and decode wider (one prefill rank serves
 * both decode ranks, frame 6 = 2). */
static void mla_legacy_tp2_to_tp1_and_tp1_to_tp2(void **state) {
  hcase a = {.tp_p = 2,
             .tp_d = 1,
             .page_size = 16,
             .heads_p = 1,
             .heads_d = 1,
             .kv_heads = 1,
             .mla = 1,
             .npages = 9,
             .chunk = 4};
  run_case(&a);
  hcase b =
      {.tp_p = 1, .tp_d = 2, .page_size = 16, .heads_p = 1, .heads_d = 1, .kv_heads = 1, .mla = 1, .npages = 9};
  run_case(&b);
}

/* Fan-out (issue 12): one prefill rank serves four decode ranks the same
 * latent pages, chunk after chunk, each chunk submitted to the four at once
 * and waited for once; every decode rank checks every byte. Each takes its
 * Success from the completion trailer behind its own last bytes (issue 22),
 * not from the M3 that waits for all four. */
static const hcase fanout_1to4 = {.tp_p = 1,
                                  .tp_d = 4,
                                  .page_size = 16,
                                  .heads_p = 1,
                                  .heads_d = 1,
                                  .kv_heads = 1,
                                  .mla = 1,
                                  .npages = 11,
                                  .chunk = 3,
                                  .trailer = 1};

static void mla_legacy_tp1_to_tp4_chunked_fanout(void **state) { run_case(&fanout_1to4); }

/* State buffers (replicated across TP, like a per-request recurrent state
 * here) next to sharded KV heads: only the planned source rank writes the
 * state slot; the other rank's plan has KV fragments only (§8.11). */
static void state_buffers_tp2_to_tp1(void **state) {
  hcase c =
      {.tp_p = 2, .tp_d = 1, .page_size = 1, .heads_p = 2, .heads_d = 4, .nstate = 2, .npages = 12, .chunk = 5};
  run_case(&c);
}

/* decode_prefix_len: the decode already holds the first pages; chunked. */
static void decode_prefix_tp1_to_tp2_chunked(void **state) {
  hcase c =
      {.tp_p = 1, .tp_d = 2, .page_size = 1, .heads_p = 4, .heads_d = 2, .npages = 30, .prefix = 7, .chunk = 4};
  run_case(&c);
}

/* page_size 16, token-major pages: the plan's per-page head ranges are cut
 * per token on the prefill (kvferry's page-layout frame), one strided block
 * per (fragment, run). */
static void tp2_to_tp1_page16(void **state) {
  hcase c = {.tp_p = 2, .tp_d = 1, .page_size = 16, .heads_p = 2, .heads_d = 4, .npages = 13, .chunk = 5};
  run_case(&c);
}

static void tp1_to_tp2_page16(void **state) {
  hcase c = {.tp_p = 1, .tp_d = 2, .page_size = 16, .heads_p = 4, .heads_d = 2, .npages = 13, .prefix = 2};
  run_case(&c);
}

static void tp4_to_tp2_page16_gqa(void **state) {
  hcase a = {.tp_p = 4, .tp_d = 2, .page_size = 16, .heads_p = 2, .heads_d = 4, .npages = 11};
  run_case(&a);
  hcase b = {.tp_p = 4, .tp_d = 1, .page_size = 16, .heads_p = 1, .heads_d = 2, .kv_heads = 2, .npages = 7};
  run_case(&b);
}

/* One decode rank of a fan-out dies after its transfer request reached the
 * prefill: the prefill's write to it fails, and the other three decode ranks
 * hear at once that the room can no longer succeed (M3 Failed with the
 * reason), instead of waiting out their 30 s waiting timeout. */
static void dead_decode_rank_fails_the_other_ranks_at_once(void **state) {
  hcase c = fanout_1to4;
  c.crash = 3;
  c.fail_with = "failed the room with another decode rank";
  run_case(&c);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(tp2_to_tp1_page1),
      cmocka_unit_test(tp1_to_tp2_page1),
      cmocka_unit_test(tp4_to_tp2_page1),
      cmocka_unit_test(gqa_replicated_tp4_to_tp1),
      cmocka_unit_test(mla_replicated_generic_tp2_to_tp1),
      cmocka_unit_test(mla_legacy_tp2_to_tp1_and_tp1_to_tp2),
      cmocka_unit_test(mla_legacy_tp1_to_tp4_chunked_fanout),
      cmocka_unit_test(dead_decode_rank_fails_the_other_ranks_at_once),
      cmocka_unit_test(state_buffers_tp2_to_tp1),
      cmocka_unit_test(decode_prefix_tp1_to_tp2_chunked),
      cmocka_unit_test(tp2_to_tp1_page16),
      cmocka_unit_test(tp1_to_tp2_page16),
      cmocka_unit_test(tp4_to_tp2_page16_gqa),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

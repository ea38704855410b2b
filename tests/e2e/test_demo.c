/* `kvferry demo` as a user runs it: a short configuration exits 0 with a
 * summary that counts every request and no failure, and a deliberately
 * corrupted page (--corrupt: one byte of one landed page flipped before the
 * decode's ordinary byte check) makes it exit non-zero and name the
 * mismatch; heterogeneous TP (2 -> 1, 1 -> 2) verifies every (token, head)
 * on every decode rank; deepseek-v3 (MLA: one latent buffer per layer, the
 * same on every rank) verifies the whole latent on every decode rank, with
 * equal TP and with prefill TP 2 -> decode TP 1 (the latent replicated).
 * The demo starts its own bootstrap, prefill and decode processes
 * on 127.0.0.1. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <cmocka.h>

/* The last run's arguments and output: printed whole only when a check on
 * it fails (a passing run prints one line), so a failing case stands out in
 * a CI log that keeps only its head and tail. */
static const char *g_args = "", *g_out = "";

static void demo_dump(void) { fprintf(stderr, "---- kvferry demo %s: its whole output ----\n%s", g_args, g_out); }

#define demo_int_equal(a, b)   \
  do {                         \
    long a_ = (a), b_ = (b);   \
    if (a_ != b_) demo_dump(); \
    assert_int_equal(a_, b_);  \
  } while (0)
#define demo_has(out, s)                  \
  do {                                    \
    if (!strstr((out), (s))) demo_dump(); \
    assert_non_null(strstr((out), (s)));  \
  } while (0)
#define demo_lacks(out, s)               \
  do {                                   \
    if (strstr((out), (s))) demo_dump(); \
    assert_null(strstr((out), (s)));     \
  } while (0)

/* Run the CLI with args, stdout and stderr together; the exit status. */
static int run_demo(const char *args, char *out, size_t cap) {
  const char *exe = getenv("KVFERRY_CLI");
  assert_non_null(exe);
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "'%s' demo %s 2>&1", exe, args);
  FILE *f = popen(cmd, "r");
  assert_non_null(f);
  size_t n = fread(out, 1, cap - 1, f);
  out[n] = 0;
  int st = pclose(f), rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
  g_args = args, g_out = out;
  fprintf(stderr, "---- kvferry demo %s: exit %d ----\n", args, rc);
  return rc;
}

/* The value printed after a summary row's label, e.g. "failures   0". */
static long summary_value(const char *out, const char *label) {
  char key[64];
  snprintf(key, sizeof key, "\n  %s ", label);
  const char *p = strstr(out, key);
  if (!p) return -1;
  return strtol(p + strlen(key), NULL, 10);
}

static void short_demo_verifies_every_request(void **state) {
  (void)state;
  static char out[65536];
  demo_int_equal(run_demo("--short", out, sizeof out), 0);
  demo_int_equal(summary_value(out, "requests"), 6);
  demo_int_equal(summary_value(out, "failures"), 0);
  demo_has(out, "demo OK: 6 requests, every byte");
}

static void corrupted_page_is_caught_and_named(void **state) {
  (void)state;
  static char out[65536];
  int rc = run_demo("--short --corrupt", out, sizeof out);
  demo_int_equal(rc, 1);
  demo_int_equal(summary_value(out, "requests"), 6);
  demo_int_equal(summary_value(out, "failures"), 1);
  demo_has(out, "MISMATCH");
  demo_has(out, "byte-mismatch");
  demo_has(out, "demo FAILED");
}

/* Verify mode (issue 16): the byte is flipped inside the decode's library
 * after landing and before its digest check; the library, not the demo's
 * checker, fails the request and names the buffer and page. Also through a
 * heterogeneous-TP plan (per-token strided blocks, hashed as written). */
static void demo_fails_a_corrupted_page_naming_it(const char *args) {
  static char out[65536];
  demo_int_equal(run_demo(args, out, sizeof out), 1);
  demo_int_equal(summary_value(out, "failures"), 1);
  demo_has(out, "FAILED: decode: Integrity check failed: KV buffer ");
  demo_has(out, " page ");
  demo_lacks(out, "MISMATCH"); /* the demo's own checker never saw it */
}

static void verify_mode_fails_a_corrupted_page_naming_it(void **state) {
  (void)state;
  demo_fails_a_corrupted_page_naming_it("--short --verify --corrupt");
}

/* The same through a heterogeneous-TP plan (its own case: each demo run gets
 * the per-case time bound, which matters on a loaded machine under TSan). */
static void verify_mode_fails_a_corrupted_page_prefill_tp2(void **state) {
  (void)state;
  demo_fails_a_corrupted_page_naming_it("--short --verify --corrupt --prefill-tp 2 --decode-tp 1");
}

/* --reuse-early: the prefill overwrites a source page right after its send
 * call; verify mode fails that request and names the page. */
static void verify_mode_names_a_source_page_reused_too_early(void **state) {
  (void)state;
  static char out[65536];
  demo_int_equal(run_demo("--short --verify --reuse-early", out, sizeof out), 1);
  demo_int_equal(summary_value(out, "failures"), 1);
  demo_has(out, "Integrity check failed");
  demo_has(out, "page");
  demo_lacks(out, "MISMATCH");
  demo_has(out, "demo FAILED");
}

/* Verify mode with the send-time digests of a large chunk on several
 * threads (on machines of 4 cores or more by default): clean runs pass and
 * a source page reused after it was hashed is still named. */
static void verify_mode_hashes_on_several_threads(void **state) {
  (void)state;
  static char out[65536];
  setenv("KVFERRY_VERIFY_HASH_THREADS", "4", 1);
  int clean = run_demo("--short --verify", out, sizeof out);
  demo_has(out, "demo OK: 6 requests, every byte");
  int reused = run_demo("--short --verify --reuse-early", out, sizeof out);
  unsetenv("KVFERRY_VERIFY_HASH_THREADS");
  demo_int_equal(clean, 0);
  demo_int_equal(reused, 1);
  demo_has(out, "Integrity check failed");
  demo_lacks(out, "MISMATCH");
}

static void verify_mode_passes_clean_runs(void **state) {
  (void)state;
  static char out[65536];
  demo_int_equal(run_demo("--short --verify --prefill-tp 1 --decode-tp 2", out, sizeof out), 0);
  demo_has(out, "verify mode: every page hashed");
  demo_has(out, "demo OK: 6 requests, every byte");
}

/* Heterogeneous TP: the prefill's ranks and the decode's ranks hold
 * different head slices; every (token, head) on every decode rank must carry
 * the pattern of its global token and head. */
static void short_demo_prefill_tp2_decode_tp1(void **state) {
  (void)state;
  static char out[65536];
  demo_int_equal(run_demo("--short --prefill-tp 2 --decode-tp 1", out, sizeof out), 0);
  demo_int_equal(summary_value(out, "requests"), 6);
  demo_int_equal(summary_value(out, "failures"), 0);
  demo_has(out, "prefill (TP 2)");
  demo_has(out, "demo OK: 6 requests, every byte");
}

static void short_demo_prefill_tp1_decode_tp2(void **state) {
  (void)state;
  static char out[65536];
  demo_int_equal(run_demo("--short --prefill-tp 1 --decode-tp 2", out, sizeof out), 0);
  demo_int_equal(summary_value(out, "requests"), 6);
  demo_int_equal(summary_value(out, "failures"), 0);
  demo_has(out, "decode (TP 2)");
  demo_has(out, "demo OK: 6 requests, every byte");
}

/* MLA: 61 latent buffers (one per layer), every prefill rank holding the
 * same latent; every decode rank checks every (token, layer) latent. */
static void short_demo_deepseek_v3_mla(void **state) {
  (void)state;
  static char out[65536];
  demo_int_equal(run_demo("--short --model deepseek-v3", out, sizeof out), 0);
  demo_int_equal(summary_value(out, "requests"), 6);
  demo_int_equal(summary_value(out, "failures"), 0);
  demo_has(out, "61 layers x MLA latent");
  demo_has(out, "demo OK: 6 requests, every byte");
}

/* MLA with prefill TP 2 -> decode TP 1: the generic planner takes the
 * latent as replicated, one prefill rank serves the decode rank. */
static void short_demo_deepseek_v3_prefill_tp2_decode_tp1(void **state) {
  (void)state;
  static char out[65536];
  demo_int_equal(run_demo("--short --model deepseek-v3 --prefill-tp 2 --decode-tp 1", out, sizeof out), 0);
  demo_int_equal(summary_value(out, "requests"), 6);
  demo_int_equal(summary_value(out, "failures"), 0);
  demo_has(out, "prefill (TP 2)");
  demo_has(out, "(replicated)");
  demo_has(out, "demo OK: 6 requests, every byte");
}

static void unsupported_options_say_why(void **state) {
  (void)state;
  static char out[4096];
  demo_int_equal(run_demo("--model deepseek-v3 --prefill-tp 9", out, sizeof out), 2);
  demo_has(out, "must be 1..8 for deepseek-v3");
  demo_int_equal(run_demo("--prefill-tp 3", out, sizeof out), 2);
  demo_has(out, "must divide the 8 KV heads");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(short_demo_verifies_every_request),
      cmocka_unit_test(corrupted_page_is_caught_and_named),
      cmocka_unit_test(verify_mode_fails_a_corrupted_page_naming_it),
      cmocka_unit_test(verify_mode_fails_a_corrupted_page_prefill_tp2),
      cmocka_unit_test(verify_mode_names_a_source_page_reused_too_early),
      cmocka_unit_test(verify_mode_passes_clean_runs),
      cmocka_unit_test(verify_mode_hashes_on_several_threads),
      cmocka_unit_test(short_demo_prefill_tp2_decode_tp1),
      cmocka_unit_test(short_demo_prefill_tp1_decode_tp2),
      cmocka_unit_test(short_demo_deepseek_v3_mla),
      cmocka_unit_test(short_demo_deepseek_v3_prefill_tp2_decode_tp1),
      cmocka_unit_test(unsupported_options_say_why),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

/* Per-case runs of a cmocka program, for ctest (tests/CMakeLists.txt).
 * Every test program is linked with -Wl,--wrap=_cmocka_run_group_tests, so the
 * cmocka_run_group_tests() of its main lands in __wrap__cmocka_run_group_tests
 * below; the test files are not changed. The environment chooses what runs:
 *   (nothing)                     every case of every group, as cmocka alone would;
 *   KVF_TEST_CASE=<pattern>       only the cases whose name matches the fnmatch(3)
 *                                 pattern (ctest passes one exact name); a pattern
 *                                 that no group holds exits KVF_TEST_CASE_ABSENT,
 *                                 which ctest reports as skipped (a case compiled
 *                                 out by the preprocessor), never as passed;
 *   KVF_TEST_REGISTERED=<a,b,...> runs nothing and fails naming every compiled
 *                                 case missing from the list (the names ctest read
 *                                 from the source), so no case escapes ctest. */
#include <fnmatch.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

/* Exit status of a run whose KVF_TEST_CASE matches no case (ctest's SKIP_RETURN_CODE). */
#define KVF_TEST_CASE_ABSENT 77

int __real__cmocka_run_group_tests(const char *group_name, const struct CMUnitTest *const tests,
                                   const size_t num_tests, CMFixtureFunction group_setup,
                                   CMFixtureFunction group_teardown);
int __wrap__cmocka_run_group_tests(const char *group_name, const struct CMUnitTest *const tests,
                                   const size_t num_tests, CMFixtureFunction group_setup,
                                   CMFixtureFunction group_teardown);

static int case_matched;    /* some group held a case matching KVF_TEST_CASE */
static int case_hook_armed; /* the exit check below is registered */

static void case_absent_check(void) {
  if (!case_matched) {
    fprintf(stderr, "KVF_TEST_CASE=%s: no case of this program matches\n", getenv("KVF_TEST_CASE"));
    _exit(KVF_TEST_CASE_ABSENT);
  }
}

/* 1 when name is an item of the comma-separated list. */
static int in_list(const char *list, const char *name) {
  size_t n = strlen(name);
  for (const char *p = list; p != NULL; p = strchr(p, ',')) {
    if (*p == ',') p++;
    if (strncmp(p, name, n) == 0 && (p[n] == ',' || p[n] == '\0')) return 1;
  }
  return 0;
}

static int check_registered(const char *list, const struct CMUnitTest *tests, size_t num_tests) {
  int missing = 0;
  for (size_t i = 0; i < num_tests; i++) {
    if (tests[i].name != NULL && !in_list(list, tests[i].name)) {
      fprintf(stderr, "case %s is compiled but has no ctest entry: the parser in tests/CMakeLists.txt missed it\n",
              tests[i].name);
      missing++;
    }
  }
  return missing == 0 ? 0 : 1;
}

int __wrap__cmocka_run_group_tests(const char *group_name, const struct CMUnitTest *const tests,
                                   const size_t num_tests, CMFixtureFunction group_setup,
                                   CMFixtureFunction group_teardown) {
  const char *registered = getenv("KVF_TEST_REGISTERED");
  const char *pattern = getenv("KVF_TEST_CASE");
  struct CMUnitTest *chosen = NULL;
  size_t n = 0;
  int rc = 0;

  if (registered != NULL) return check_registered(registered, tests, num_tests);
  if (pattern == NULL || *pattern == '\0')
    return __real__cmocka_run_group_tests(group_name, tests, num_tests, group_setup, group_teardown);
  if (!case_hook_armed) {
    case_hook_armed = 1;
    atexit(case_absent_check);
  }
  chosen = calloc(num_tests > 0 ? num_tests : 1, sizeof(*chosen));
  if (chosen == NULL) {
    fprintf(stderr, "KVF_TEST_CASE: out of memory\n");
    rc = 1;
    goto out;
  }
  for (size_t i = 0; i < num_tests; i++)
    if (tests[i].name != NULL && fnmatch(pattern, tests[i].name, 0) == 0) chosen[n++] = tests[i];
  if (n == 0) goto out; /* another group may hold it; case_absent_check decides at exit */
  case_matched = 1;
  rc = __real__cmocka_run_group_tests(group_name, chosen, n, group_setup, group_teardown);
out:
  free(chosen);
  return rc;
}

/* Unit tests for the base layer: hash maps, env parsing, error texts. */
#include <inttypes.h>
#include <setjmp.h>
#include <stdio.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "base/env.h"
#include "base/hash.h"
#include "base/hostmem.h"
#include "base/log.h"
#include "base/map.h"
#include "base/parse.h"
#include "base/spare.h"
#include "kvferry.h"

static void map_put_get_delete_many(void **state) {
  map m;
  assert_int_equal(kvf__map_init(&m), 0);
  for (uint64_t i = 0; i < 10000; i++) assert_int_equal(kvf__map_put(&m, i * 7919, (void *)(i + 1), NULL), 0);
  assert_int_equal(kvf__map_size(&m), 10000);
  for (uint64_t i = 0; i < 10000; i++) assert_ptr_equal(kvf__map_get(&m, i * 7919), (void *)(i + 1));
  assert_null(kvf__map_get(&m, 3));
  void *old = NULL;
  assert_int_equal(kvf__map_put(&m, 0, (void *)99, &old), 0);
  assert_ptr_equal(old, (void *)1);
  assert_int_equal(kvf__map_size(&m), 10000);
  /* Deleting while iterating visits every entry exactly once. */
  map_iter it;
  kvf__map_iter_init(&it);
  uint64_t key;
  size_t seen = 0;
  while (kvf__map_next(&m, &it, &key, NULL)) {
    assert_int_equal(kvf__map_del(&m, key, NULL), 1);
    seen++;
  }
  assert_int_equal(seen, 10000);
  assert_int_equal(kvf__map_size(&m), 0);
  assert_int_equal(kvf__map_del(&m, 5, NULL), 0);
  kvf__map_free(&m);
}

static void smap_keys_are_copied(void **state) {
  smap m;
  assert_int_equal(smap_init(&m), 0);
  char key[32];
  strcpy(key, "10.0.0.1:8998");
  assert_int_equal(kvf__smap_put(&m, key, (void *)1, NULL), 0);
  strcpy(key, "10.0.0.1:899");
  assert_null(kvf__smap_get(&m, key));
  assert_ptr_equal(kvf__smap_get(&m, "10.0.0.1:8998"), (void *)1);
  void *v = NULL;
  assert_int_equal(kvf__smap_del(&m, "10.0.0.1:8998", &v), 1);
  assert_ptr_equal(v, (void *)1);
  assert_int_equal(smap_size(&m), 0);
  kvf__smap_free(&m);
}

/* A spare list hands back what it was given, zeroed, and keeps at most
 * SPARE_LIST_MAX objects; a map reuses the nodes of deleted entries. */
static void spare_list_recycles_zeroed_and_bounded(void **state) {
  (void)state;
  spare_list l = {0};
  unsigned char *a = kvf__spare_take(&l, 64);
  assert_non_null(a);
  memset(a, 0xab, 64);
  kvf__spare_give(&l, a);
  assert_int_equal(l.n, 1);
  unsigned char *b = kvf__spare_take(&l, 64);
  assert_ptr_equal(b, a);
  for (int i = 0; i < 64; i++) assert_int_equal(b[i], 0);
  assert_int_equal(l.n, 0);
  kvf__spare_give(&l, b);
  kvf__spare_give(&l, NULL); /* a no-op */
  void **many = malloc((SPARE_LIST_MAX + 10) * sizeof *many);
  assert_non_null(many);
  for (int i = 0; i < SPARE_LIST_MAX + 10; i++) assert_non_null(many[i] = kvf__spare_take(&l, 32));
  for (int i = 0; i < SPARE_LIST_MAX + 10; i++) kvf__spare_give(&l, many[i]);
  assert_int_equal(l.n, SPARE_LIST_MAX); /* the rest were freed (ASan checks) */
  free(many);
  kvf__spare_free(&l);
  assert_int_equal(l.n, 0);
  assert_null(l.head);

  map m;
  assert_int_equal(kvf__map_init(&m), 0);
  int v = 1;
  for (uint64_t k = 0; k < 100; k++) assert_int_equal(kvf__map_put(&m, k, &v, NULL), 0);
  for (uint64_t k = 0; k < 100; k++) assert_int_equal(kvf__map_del(&m, k, NULL), 1);
  assert_int_equal(m.spare.n, 100);
  for (uint64_t k = 0; k < 50; k++) assert_int_equal(kvf__map_put(&m, k + 1000, &v, NULL), 0);
  assert_int_equal(m.spare.n, 50);
  assert_ptr_equal(kvf__map_get(&m, 1049), &v);
  kvf__map_free(&m);
}

static void env_parsing_keeps_default_on_garbage(void **state) {
  setenv("KVF_TEST_INT", "42", 1);
  assert_int_equal(kvf__env_get_int("KVF_TEST_INT", 7), 42);
  setenv("KVF_TEST_INT", "4x2", 1);
  assert_int_equal(kvf__env_get_int("KVF_TEST_INT", 7), 7);
  setenv("KVF_TEST_INT", "-3", 1);
  assert_int_equal(kvf__env_get_int("KVF_TEST_INT", 7), -3);
  unsetenv("KVF_TEST_INT");
  assert_int_equal(kvf__env_get_int("KVF_TEST_INT", 7), 7);
  setenv("KVF_TEST_BOOL", "YES", 1);
  assert_int_equal(kvf__env_get_bool("KVF_TEST_BOOL", 0), 1);
  setenv("KVF_TEST_BOOL", "n", 1);
  assert_int_equal(kvf__env_get_bool("KVF_TEST_BOOL", 1), 0);
  setenv("KVF_TEST_BOOL", "maybe", 1);
  assert_int_equal(kvf__env_get_bool("KVF_TEST_BOOL", 1), 1);
  setenv("KVF_TEST_DBL", "2.5", 1);
  assert_true(kvf__env_get_double("KVF_TEST_DBL", 1.0) == 2.5);
  setenv("KVF_TEST_DBL", "2.5s", 1);
  assert_true(kvf__env_get_double("KVF_TEST_DBL", 1.0) == 1.0);
  int64_t v;
  assert_int_equal(kvf__env_parse_i64("", &v), KVF_EINVAL);
  assert_int_equal(kvf__env_parse_i64("-", &v), KVF_EINVAL);
  assert_int_equal(kvf__env_parse_i64(" 1", &v), KVF_EINVAL);
  assert_int_equal(kvf__env_parse_i64("99999999999999999999", &v), KVF_EINVAL);
}

/* The one integer parser, under each caller's rule, and the one
 * constant-time compare. */
static void parse_i64_rules_and_ct_equal(void **state) {
  int64_t v = 0;
  assert_int_equal(kvf__parse_i64("-9223372036854775808", 20, 0, &v), KVF_INT_OK);
  assert_true(v == INT64_MIN);
  assert_int_equal(kvf__parse_i64("9223372036854775808", 19, 0, &v), KVF_INT_RANGE);
  assert_int_equal(kvf__parse_i64("", 0, 0, &v), KVF_INT_EMPTY);
  assert_int_equal(kvf__parse_i64("-", 1, 0, &v), KVF_INT_SYNTAX);
  assert_int_equal(kvf__parse_i64("12x", 3, 0, &v), KVF_INT_SYNTAX);
  assert_int_equal(kvf__parse_i64("12x", 2, 0, &v), KVF_INT_OK); /* only len bytes are read */
  assert_true(v == 12);
  assert_int_equal(kvf__parse_i64("007", 3, 0, &v), KVF_INT_OK);
  assert_int_equal(kvf__parse_i64("007", 3, KVF_INT_CANONICAL, &v), KVF_INT_NONCANON);
  assert_int_equal(kvf__parse_i64("-0", 2, KVF_INT_CANONICAL, &v), KVF_INT_NONCANON);
  assert_int_equal(kvf__parse_i64("0", 1, KVF_INT_CANONICAL, &v), KVF_INT_OK);
  assert_int_equal(kvf__parse_i64(" +7 ", 4, 0, &v), KVF_INT_SYNTAX);
  assert_int_equal(kvf__parse_i64(" +7 ", 4, KVF_INT_LENIENT, &v), KVF_INT_OK);
  assert_true(v == 7);
  assert_int_equal(kvf__parse_i64("  ", 2, KVF_INT_LENIENT, &v), KVF_INT_EMPTY);
  assert_int_equal(kvf__ct_equal("secret", 6, "secret", 6), 1);
  assert_int_equal(kvf__ct_equal("secret", 6, "secreT", 6), 0);
  assert_int_equal(kvf__ct_equal("secret", 6, "secret2", 7), 0);
  assert_int_equal(kvf__ct_equal("secret", 6, "", 0), 0);
  assert_true(kvf__hash_str("a", 0) != kvf__hash_str("a", 1));
  assert_true(kvf__hash_str(NULL, 3) == kvf__hash_str("", 3));
}

/* The one integer formatter prints what printf's PRId64 prints, and what
 * the parser reads back. */
static void fmt_i64_matches_printf(void **state) {
  (void)state;
  const int64_t vals[] = {0,   1,         -1,         9,         10,        -10,          99,
                          100, 123456789, -987654321, INT64_MAX, INT64_MIN, INT64_MIN + 1};
  for (size_t i = 0; i < sizeof vals / sizeof vals[0]; i++) {
    char want[32], got[KVF_I64_DIGITS_MAX + 1];
    int wl = snprintf(want, sizeof want, "%" PRId64, vals[i]);
    size_t gl = kvf__fmt_i64(got, vals[i]);
    got[gl] = 0;
    assert_int_equal(gl, (size_t)wl);
    assert_string_equal(got, want);
    int64_t back = 0;
    assert_int_equal(kvf__parse_i64(got, gl, KVF_INT_CANONICAL, &back), KVF_INT_OK);
    assert_true(back == vals[i]);
  }
}

/* The bounded string copy does what snprintf(dst, cap, "%s", src) does:
 * every length around the capacity, NUL-terminated, nothing past cap. */
static void str_copy_matches_snprintf(void **state) {
  (void)state;
  const char *src = "0123456789abcdef";
  for (size_t cap = 1; cap <= 20; cap++) {
    for (size_t len = 0; len <= 16; len++) {
      char s[17], want[24], got[24];
      memcpy(s, src, len);
      s[len] = 0;
      memset(want, '#', sizeof want);
      memset(got, '#', sizeof got);
      int wl = snprintf(want, cap, "%s", s);
      size_t gl = kvf__str_copy(got, cap, s);
      assert_int_equal(gl, (size_t)wl < cap ? (size_t)wl : cap - 1);
      assert_memory_equal(got, want, sizeof got); /* the guard bytes past cap included */
    }
  }
  char g[4] = "###";
  assert_int_equal(kvf__str_copy(g, 0, "x"), 0); /* no room: nothing written */
  assert_string_equal(g, "###");
  assert_int_equal(kvf__str_copy(g, sizeof g, NULL), 0);
  assert_string_equal(g, "");
}

static void error_texts_and_log_once(void **state) {
  assert_string_equal(kvf_strerror(KVF_ERANGE), "address range outside registered memory");
  assert_string_equal(kvf_strerror(12345), "unknown error");
  uint64_t k = kvf__hash_str("10.0.0.9:1234", 1);
  assert_int_equal(kvf__log_first_time(k), 1);
  assert_int_equal(kvf__log_first_time(k), 0);
}

/* One report per host and kind, whatever port each connection comes from. */
static void log_once_per_host_ignores_the_port(void **state) {
  assert_int_equal(kvf__log_first_time_for_host("10.0.0.7:40001", "frame"), 1);
  assert_int_equal(kvf__log_first_time_for_host("10.0.0.7:40002", "frame"), 0);
  assert_int_equal(kvf__log_first_time_for_host("10.0.0.7:40003", "auth"), 1);
  assert_int_equal(kvf__log_first_time_for_host("10.0.0.8:40001", "frame"), 1);
  assert_int_equal(kvf__log_first_time_for_host("[fd00::1]:5000", "frame"), 1);
  assert_int_equal(kvf__log_first_time_for_host("[fd00::1]:5001", "frame"), 0);
  assert_int_equal(kvf__log_first_time_for_host("[fd00::2]:5000", "frame"), 1);
  /* A bare IPv6 address: its last group is not a port. */
  assert_int_equal(kvf__log_first_time_for_host("fd00::3", "frame"), 1);
  assert_int_equal(kvf__log_first_time_for_host("fd00::4", "frame"), 1);
  assert_int_equal(kvf__log_first_time_for_host("fd00::4", "frame"), 0);
}

/* What may be loaded from directly in another process's shared memory:
 * only readable System V segments cover the range (a POSIX shared memory
 * file, a memfd, private or anonymous memory, a gap, a long path before
 * the range all say no or are passed over). */
static void sysv_shared_ranges_only(void **state) {
  (void)state;
  char long_path[1024];
  memset(long_path, 'x', sizeof long_path - 1);
  long_path[sizeof long_path - 1] = 0;
  char text[4096];
  snprintf(text, sizeof text,
           "00400000-00401000 r-xp 00000000 08:01 42 /usr/bin/%s\n"
           "10000000-10200000 rw-s 00000000 00:01 5 /SYSV00000000 (deleted)\n"
           "10200000-10400000 rw-s 00000000 00:01 6 /SYSV00000000 (deleted)\n"
           "10400000-10600000 rw-s 00000000 00:19 7 /dev/shm/ucx_shm_posix_1234 (deleted)\n"
           "10600000-10800000 rw-s 00000000 00:01 8 /memfd:pool (deleted)\n"
           "10800000-10a00000 rw-p 00000000 00:00 0 \n"
           "10a00000-10c00000 ---s 00000000 00:01 9 /SYSV00000001 (deleted)\n"
           "10e00000-11000000 rw-s 00000000 00:01 10 /SYSV00000002 (deleted)\n",
           long_path);
  FILE *maps = fmemopen(text, strlen(text), "r");
  assert_non_null(maps);
  assert_int_equal(kvf__maps_sysv_shared(maps, 0x10000000, 0x200000), 1);
  assert_int_equal(kvf__maps_sysv_shared(maps, 0x10100000, 0x200000), 1); /* across two segments */
  assert_int_equal(kvf__maps_sysv_shared(maps, 0x10300000, 0x200000), 0); /* into POSIX shared memory */
  assert_int_equal(kvf__maps_sysv_shared(maps, 0x10400000, 0x1000), 0);
  assert_int_equal(kvf__maps_sysv_shared(maps, 0x10600000, 0x1000), 0); /* a memfd */
  assert_int_equal(kvf__maps_sysv_shared(maps, 0x10800000, 0x1000), 0); /* anonymous, private */
  assert_int_equal(kvf__maps_sysv_shared(maps, 0x10a00000, 0x1000), 0); /* not readable */
  assert_int_equal(kvf__maps_sysv_shared(maps, 0x10c00000, 0x1000), 0); /* not mapped */
  assert_int_equal(kvf__maps_sysv_shared(maps, 0x10e00000, 0x200000), 1);
  assert_int_equal(kvf__maps_sysv_shared(maps, 0x10e00000, 0x200001), 0); /* past its end */
  assert_int_equal(kvf__maps_readable(maps, 0x10300000, 0x200000), 1);    /* readable, all the same */
  /* A length that wraps past the end of the address space covers nothing. */
  assert_int_equal(kvf__maps_sysv_shared(maps, 0x10000000, UINT64_MAX - 0x1000), 0);
  assert_int_equal(kvf__maps_readable(maps, 0x10000000, UINT64_MAX - 0x1000), 0);
  fclose(maps);
  /* This process's own memory is not shared. */
  assert_int_equal(kvf__host_sysv_shared((uint64_t)(uintptr_t)text, sizeof text), 0);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(map_put_get_delete_many),
      cmocka_unit_test(smap_keys_are_copied),
      cmocka_unit_test(spare_list_recycles_zeroed_and_bounded),
      cmocka_unit_test(env_parsing_keeps_default_on_garbage),
      cmocka_unit_test(parse_i64_rules_and_ct_equal),
      cmocka_unit_test(fmt_i64_matches_printf),
      cmocka_unit_test(str_copy_matches_snprintf),
      cmocka_unit_test(error_texts_and_log_once),
      cmocka_unit_test(log_once_per_host_ignores_the_port),
      cmocka_unit_test(sysv_shared_ranges_only),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

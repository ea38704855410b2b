/* The streaming copy (base/copy.h) against memcpy: every length around its
 * thresholds (the 256-byte floor, whole 64-byte lines), every destination
 * and source alignment within a line, and nothing written outside the
 * destination. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "base/copy.h"

#define GUARD 128
#define MAX_LEN (3 * 4096 + 129)

static unsigned char src_buf[MAX_LEN + 2 * GUARD] __attribute__((aligned(64)));
static unsigned char dst_buf[MAX_LEN + 2 * GUARD] __attribute__((aligned(64)));

static void fill(unsigned char *p, size_t n, unsigned seed) {
  for (size_t i = 0; i < n; i++) p[i] = (unsigned char)(i * 131u + seed * 7u + (i >> 8));
}

/* Copy src_buf + soff (len bytes) to dst_buf + doff with kvf__copy_stream;
 * the destination equals the source and every other byte is untouched. */
static void check_one(size_t doff, size_t soff, size_t len) {
  memset(dst_buf, 0xA5, sizeof dst_buf);
  kvf__copy_stream(dst_buf + GUARD + doff, src_buf + GUARD + soff, len);
  if (len) assert_memory_equal(dst_buf + GUARD + doff, src_buf + GUARD + soff, len);
  for (size_t i = 0; i < GUARD + doff; i++) assert_int_equal(dst_buf[i], 0xA5);
  for (size_t i = GUARD + doff + len; i < sizeof dst_buf; i++) assert_int_equal(dst_buf[i], 0xA5);
}

static void stream_copy_equals_memcpy_at_every_alignment(void **state) {
  (void)state;
  fill(src_buf, sizeof src_buf, 3);
  static const size_t lens[] = {0, 1, 63, 64, 65, 255, 256, 257, 319, 320, 321, 1000, 4096, 4097, MAX_LEN - 64};
  for (size_t l = 0; l < sizeof lens / sizeof lens[0]; l++)
    for (size_t doff = 0; doff < 64; doff += 7)
      for (size_t soff = 0; soff < 64; soff += 13) check_one(doff, soff, lens[l]);
  check_one(63, 1, MAX_LEN - 64);
  check_one(0, 0, MAX_LEN);
}

/* A large copy (the size the read path streams) lands whole. */
static void stream_copy_moves_a_large_batch(void **state) {
  (void)state;
  const size_t n = KVF_COPY_STREAM_MIN_BATCH + 4096 + 17;
  unsigned char *s = malloc(n), *d = malloc(n + 1);
  assert_non_null(s);
  assert_non_null(d);
  fill(s, n, 9);
  d[n] = 0x5A;
  kvf__copy_stream(d, s, n);
  assert_memory_equal(d, s, n);
  assert_int_equal(d[n], 0x5A);
  free(s);
  free(d);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(stream_copy_equals_memcpy_at_every_alignment),
      cmocka_unit_test(stream_copy_moves_a_large_batch),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

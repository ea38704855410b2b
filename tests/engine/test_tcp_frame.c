/* The engine's inbound framing (src/engine/tcp_frame.c) as a pure function:
 * one case per rejection, each built from a valid stream with one field
 * broken, so a check that stops working fails its own case. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "engine/tcp_frame.h"

#define REGION_BASE 0x100000ull
#define REGION_LEN 0x10000ull

typedef struct stream {
  uint8_t b[4096];
  size_t n;
} stream;

static void put(stream *s, const void *p, size_t n) {
  assert_true(s->n + n <= sizeof s->b);
  memcpy(s->b + s->n, p, n);
  s->n += n;
}

/* hello + token "ab" + one chunk of two descriptors and its payload. */
typedef struct frame {
  tcp_hello hello;
  tcp_chunk_hdr hdr;
  tcp_desc d[2];
} frame;

static frame valid(void) {
  frame f = {
      .hello = {TCP_HELLO_MAGIC, TCP_PROTO_VERSION, 0, 2, 0},
      .hdr = {TCP_CHUNK_MAGIC, 2, 7, 16 + 3 * 8},
      .d = {{REGION_BASE, 16, 1, 0}, {REGION_BASE + 64, 8, 3, 32}},
  };
  return f;
}

static void build(const frame *f, stream *s) {
  s->n = 0;
  put(s, &f->hello, sizeof f->hello);
  put(s, "ab", 2);
  put(s, &f->hdr, sizeof f->hdr);
  put(s, f->d, sizeof f->d);
  static const uint8_t payload[64];
  put(s, payload, f->hdr.total_bytes < sizeof payload ? f->hdr.total_bytes : sizeof payload);
}

static int setup(void **state) {
  region_table *t = calloc(1, sizeof *t);
  if (kvf__regions_init(t) || kvf__regions_add(t, REGION_BASE, REGION_LEN, 0)) return -1;
  *state = t;
  return 0;
}

static int teardown(void **state) {
  kvf__regions_destroy(*state);
  free(*state);
  return 0;
}

static int parse(void **state, const frame *f, tcp_frame_info *info) {
  stream s;
  build(f, &s);
  return kvf__tcp_frame_parse(s.b, s.n, *state, info);
}

static void valid_stream_accepted(void **state) {
  frame f = valid();
  tcp_frame_info info;
  assert_int_equal(parse(state, &f, &info), TCP_FRAME_OK);
  assert_int_equal(info.token_len, 2);
  assert_int_equal(info.chunks, 1);
  assert_int_equal(info.refused, 0);
  assert_int_equal(info.accepted_bytes, 40);
  /* Every proper prefix is short, never accepted or rejected. */
  stream s;
  build(&f, &s);
  for (size_t n = 0; n < s.n; n++)
    if (n != sizeof(tcp_hello) + 2) assert_int_equal(kvf__tcp_frame_parse(s.b, n, *state, &info), TCP_FRAME_SHORT);
}

#define REJECTS(name, mutate, verdict)                             \
  static void name(void **state) {                                 \
    frame f = valid();                                             \
    mutate;                                                        \
    tcp_frame_info info;                                           \
    assert_int_equal(parse(state, &f, &info), verdict);            \
    assert_int_equal(info.chunks, 0);                              \
    assert_true(kvf__tcp_frame_fatal(verdict));                    \
    assert_string_not_equal(kvf__tcp_frame_reason(verdict), "ok"); \
  }

REJECTS(hello_magic, f.hello.magic ^= 1, TCP_FRAME_HELLO_MAGIC)
REJECTS(hello_version, f.hello.version = TCP_PROTO_VERSION + 1, TCP_FRAME_HELLO_VERSION)
REJECTS(token_too_long, f.hello.token_len = TCP_MAX_TOKEN + 1, TCP_FRAME_TOKEN_TOO_LONG)
REJECTS(chunk_magic, f.hdr.magic = TCP_ACK_MAGIC, TCP_FRAME_CHUNK_MAGIC)
REJECTS(no_descriptors, f.hdr.ndesc = 0, TCP_FRAME_NO_DESC)
REJECTS(too_many_descriptors, f.hdr.ndesc = TCP_MAX_DESC + 1, TCP_FRAME_TOO_MANY_DESC)
REJECTS(zero_count, f.d[1].count = 0, TCP_FRAME_ZERO_COUNT)
REJECTS(len_times_count_overflows, (f.d[1].len = 1ull << 62, f.d[1].count = 8), TCP_FRAME_OVERFLOW)
REJECTS(sum_overflows, (f.d[0].len = UINT64_MAX, f.d[1].len = 1, f.d[1].count = 1), TCP_FRAME_OVERFLOW)
REJECTS(total_mismatch, f.hdr.total_bytes += 1, TCP_FRAME_TOTAL_MISMATCH)

/* Out of range is a refusal, not a framing error: the payload is skipped and
 * the stream goes on. One case per way a destination can miss. */
static void out_of_range_refused_stream_continues(void **state) {
  tcp_desc bad[] = {
      {REGION_BASE - 1, 16, 1, 0},              /* starts before the region */
      {REGION_BASE + REGION_LEN - 8, 16, 1, 0}, /* runs past its end */
      {REGION_BASE, 8, 3, REGION_LEN / 2},      /* a strided piece past its end */
      {REGION_BASE, 8, 3, UINT64_MAX / 2},      /* the last piece's address overflows */
      {UINT64_MAX - 4, 16, 1, 0},               /* address wraps */
      {0x10, 16, 1, 0},                         /* nowhere near */
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    frame f = valid();
    f.hdr.total_bytes = 16 + bad[i].len * bad[i].count;
    f.d[0] = bad[i];
    f.d[1] = (tcp_desc){REGION_BASE, 16, 1, 0};
    tcp_frame_info info;
    assert_int_equal(parse(state, &f, &info), TCP_FRAME_OK);
    assert_int_equal(info.chunks, 1);
    assert_int_equal(info.refused, 1);
    assert_false(kvf__tcp_frame_fatal(TCP_FRAME_OUT_OF_RANGE));
  }
}

/* The stage function the receiver uses reports the distinct regions to pin. */
static void ranges_report_regions_to_pin(void **state) {
  region_table *t = *state;
  assert_int_equal(kvf__regions_add(t, REGION_BASE + REGION_LEN, REGION_LEN, 0), 0);
  tcp_desc d[4] = {{REGION_BASE, 8, 1, 0},
                   {REGION_BASE + 8, 8, 1, 0},
                   {REGION_BASE + REGION_LEN, 8, 1, 0},
                   {REGION_BASE + 99, 0, 1, 0}};
  region *pins[4];
  size_t n = 0;
  pthread_rwlock_rdlock(&t->lock);
  assert_int_equal(kvf__tcp_frame_ranges_locked(t, d, 4, pins, &n), TCP_FRAME_OK);
  pthread_rwlock_unlock(&t->lock);
  assert_int_equal(n, 2);
  assert_int_equal(pins[0]->base, REGION_BASE);
  assert_int_equal(pins[1]->base, REGION_BASE + REGION_LEN);
}

/* A tagged chunk (issue 16): the same checks, with its (tag, epoch) read
 * between the header and the descriptors; a cut-off tag is a short stream. */
static void tagged_chunk_accepted(void **state) {
  frame f = valid();
  f.hdr.magic = TCP_CHUNK_TAGGED_MAGIC;
  assert_int_equal(kvf__tcp_frame_chunk_hdr(&f.hdr), TCP_FRAME_OK);
  stream s = {.n = 0};
  tcp_chunk_tag tag = {77, 5};
  static const uint8_t payload[64];
  put(&s, &f.hello, sizeof f.hello);
  put(&s, "ab", 2);
  put(&s, &f.hdr, sizeof f.hdr);
  size_t cut = s.n + 8;
  put(&s, &tag, sizeof tag);
  put(&s, f.d, sizeof f.d);
  put(&s, payload, f.hdr.total_bytes);
  tcp_frame_info info;
  assert_int_equal(kvf__tcp_frame_parse(s.b, s.n, *state, &info), TCP_FRAME_OK);
  assert_int_equal(info.chunks, 1);
  assert_int_equal(info.accepted_bytes, 40);
  assert_int_equal(kvf__tcp_frame_parse(s.b, cut, *state, &info), TCP_FRAME_SHORT);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(tagged_chunk_accepted, setup, teardown),
      cmocka_unit_test_setup_teardown(valid_stream_accepted, setup, teardown),
      cmocka_unit_test_setup_teardown(hello_magic, setup, teardown),
      cmocka_unit_test_setup_teardown(hello_version, setup, teardown),
      cmocka_unit_test_setup_teardown(token_too_long, setup, teardown),
      cmocka_unit_test_setup_teardown(chunk_magic, setup, teardown),
      cmocka_unit_test_setup_teardown(no_descriptors, setup, teardown),
      cmocka_unit_test_setup_teardown(too_many_descriptors, setup, teardown),
      cmocka_unit_test_setup_teardown(zero_count, setup, teardown),
      cmocka_unit_test_setup_teardown(len_times_count_overflows, setup, teardown),
      cmocka_unit_test_setup_teardown(sum_overflows, setup, teardown),
      cmocka_unit_test_setup_teardown(total_mismatch, setup, teardown),
      cmocka_unit_test_setup_teardown(out_of_range_refused_stream_continues, setup, teardown),
      cmocka_unit_test_setup_teardown(ranges_report_regions_to_pin, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

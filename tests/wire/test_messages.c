/* Unit tests for the M1/M2/M3 codecs: the golden bytes of docs/PROTOCOL.md
 * Appendix A and §6.5.5 (encode byte-equal, decode field-equal), round trips
 * of every frame-count form, and one case per rejection rule of §3.3-3.5 and
 * of kvferry's stricter checks, each asserting the error code, the frame
 * named in the reason, and that the output struct was left untouched. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "wire/messages.h"

#define S(lit) (const uint8_t *)(lit), (sizeof(lit) - 1)
#define FR(lit) \
  { (const uint8_t *)(lit), sizeof(lit) - 1 }
#define EMPTY \
  { NULL, 0 }
#define NFR(a) (sizeof(a) / sizeof((a)[0]))

/* ---- Appendix A values ---- */

static const uint8_t a3_kv_bytes[32] = {0x00, 0x00, 0x00, 0x00, 0x3a, 0x7f, 0x00, 0x00, 0x00, 0x00, 0x00,
                                        0x40, 0x3a, 0x7f, 0x00, 0x00, 0x00, 0x00, 0x00, 0x80, 0x3a, 0x7f,
                                        0x00, 0x00, 0x00, 0x00, 0x00, 0xc0, 0x3a, 0x7f, 0x00, 0x00};
static const uint64_t a3_kv_ptrs[4] = {0x7f3a00000000ull, 0x7f3a40000000ull, 0x7f3a80000000ull, 0x7f3ac0000000ull};
static const uint8_t a4_idx_bytes[24] = {7, 0, 0, 0, 0, 0, 0, 0, 8, 0, 0, 0, 0, 0, 0, 0, 9, 0, 0, 0, 0, 0, 0, 0};
static const int64_t a4_pages[3] = {7, 8, 9};
static const uint8_t a6_cand_bytes[12] = {0xc6, 0x06, 0x00, 0x00, 0xa3, 0x08, 0x00, 0x00, 0x5a, 0x00, 0x00, 0x00};
static const int32_t a6_cands[3] = {1734, 2211, 90};

static const char frag_example[] =
    "[{\"buffer_index\":0,\"buffer_kind\":\"target_k\",\"src_rank\":1,\"dst_rank\":0,"
    "\"src_page_stride_bytes\":512,\"dst_page_stride_bytes\":1024,\"src_byte_offset\":0,"
    "\"dst_byte_offset\":512,\"bytes_per_page\":512,\"page_count\":null}]";
static const wire_fragment frag_example_struct = {0, WIRE_KIND_TARGET_K, 1, 0, 512, 1024, 0, 512, 512, -1};

static void assert_frames_equal(const wire_msg *m, const wire_frame *want, size_t n) {
  assert_int_equal(m->nframes, n);
  for (size_t i = 0; i < n; i++) {
    if (m->frames[i].len != want[i].len)
      fail_msg("frame %zu: length %zu, want %zu", i, m->frames[i].len, want[i].len);
    if (want[i].len) assert_memory_equal(m->frames[i].data, want[i].data, want[i].len);
  }
}

/* Field by field: wire_fragment has padding after buffer_kind. */
static void assert_frag_equal(const wire_fragment *a, const wire_fragment *b) {
  assert_int_equal(a->buffer_index, b->buffer_index);
  assert_int_equal(a->buffer_kind, b->buffer_kind);
  assert_int_equal(a->src_rank, b->src_rank);
  assert_int_equal(a->dst_rank, b->dst_rank);
  assert_int_equal(a->src_page_stride_bytes, b->src_page_stride_bytes);
  assert_int_equal(a->dst_page_stride_bytes, b->dst_page_stride_bytes);
  assert_int_equal(a->src_byte_offset, b->src_byte_offset);
  assert_int_equal(a->dst_byte_offset, b->dst_byte_offset);
  assert_int_equal(a->bytes_per_page, b->bytes_per_page);
  assert_int_equal(a->page_count, b->page_count);
}

static void assert_array_equal(wire_array a, wire_array b, size_t elem) {
  assert_int_equal(a.count, b.count);
  if (a.count) assert_memory_equal(a.data, b.data, a.count * elem);
}

/* ---- golden: Appendix A.3 (M1) ---- */

static const wire_frame a3_frames[8] = {FR("None"),        FR("10.0.0.2"), FR("41235"), FR("10.0.0.2:15001"),
                                        {a3_kv_bytes, 32}, EMPTY,          EMPTY,       FR("0")};

static void m1_golden_encode(void **state) {
  wire_m1 m;
  memset(&m, 0, sizeof m);
  strcpy(m.endpoint, "10.0.0.2");
  m.dst_port = 41235;
  strcpy(m.session, "10.0.0.2:15001");
  m.kv_ptrs = wire_array_of(a3_kv_ptrs, 4);
  wire_msg msg;
  char reason[WIRE_REASON_LEN] = "";
  assert_int_equal(kvf__wire_m1_encode(&m, &msg, reason), 0);
  assert_frames_equal(&msg, a3_frames, 8);
  kvf__wire_msg_free(&msg);
}

static void m1_golden_decode(void **state) {
  wire_m1 m;
  char reason[WIRE_REASON_LEN] = "";
  assert_int_equal(kvf__wire_classify(a3_frames, 8), WIRE_MSG_M1);
  assert_int_equal(kvf__wire_m1_decode(a3_frames, 8, &m, reason), 0);
  assert_string_equal(m.endpoint, "10.0.0.2");
  assert_int_equal(m.dst_port, 41235);
  assert_string_equal(m.session, "10.0.0.2:15001");
  assert_int_equal(m.session_port, 15001);
  assert_int_equal(m.kv_ptrs.count, 4);
  for (size_t i = 0; i < 4; i++) assert_true(wire_u64_at(m.kv_ptrs, i) == a3_kv_ptrs[i]);
  assert_int_equal(m.aux_ptrs.count, 0);
  assert_int_equal(m.state_ptrs.count, 0);
  assert_int_equal(m.decode_prefix_len, 0);
}

/* 6- and 7-frame forms of older peers, and trailing frames ignored. */
static void m1_frame_count_forms(void **state) {
  static const uint8_t state_bytes[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  wire_frame f[10] = {FR("None"),        FR("10.0.0.2"), FR("41235"), FR("10.0.0.2:15001"),
                      {a3_kv_bytes, 32}, EMPTY,          FR("4096"),  FR("x"),
                      FR("y"),           FR("z")};
  wire_m1 m;
  char reason[WIRE_REASON_LEN];
  assert_int_equal(kvf__wire_m1_decode(f, 6, &m, reason), 0);
  assert_int_equal(m.decode_prefix_len, 0);
  assert_int_equal(m.state_ptrs.count, 0);
  /* 7 frames: frame 6 is decode_prefix_len. */
  assert_int_equal(kvf__wire_m1_decode(f, 7, &m, reason), 0);
  assert_int_equal(m.decode_prefix_len, 4096);
  assert_int_equal(m.state_ptrs.count, 0);
  f[6].data = NULL, f[6].len = 0;
  assert_int_equal(kvf__wire_m1_decode(f, 7, &m, reason), 0);
  assert_int_equal(m.decode_prefix_len, 0);
  /* >= 8: frame 6 state pointers, frame 7 prefix (empty => 0), rest ignored. */
  f[6] = (wire_frame){state_bytes, 8};
  f[7] = (wire_frame){NULL, 0};
  assert_int_equal(kvf__wire_m1_decode(f, 10, &m, reason), 0);
  assert_int_equal(m.state_ptrs.count, 1);
  assert_true(wire_u64_at(m.state_ptrs, 0) == 0x0807060504030201ull);
  assert_int_equal(m.decode_prefix_len, 0);
  /* The encoder always writes the 8-frame form; it decodes to the same. */
  wire_msg msg;
  assert_int_equal(kvf__wire_m1_encode(&m, &msg, reason), 0);
  assert_int_equal(msg.nframes, 8);
  assert_memory_equal(msg.frames[7].data, "0", 1);
  wire_m1 m2;
  assert_int_equal(kvf__wire_m1_decode(msg.frames, msg.nframes, &m2, reason), 0);
  assert_string_equal(m2.session, m.session);
  assert_array_equal(m2.kv_ptrs, m.kv_ptrs, 8);
  assert_array_equal(m2.state_ptrs, m.state_ptrs, 8);
  kvf__wire_msg_free(&msg);
}

/* ---- golden: Appendix A.4 (M2) and A.7 (dummy) ---- */

static const wire_frame a4_frames[12] = {FR("7215963401"),
                                         FR("10.0.0.2"),
                                         FR("41235"),
                                         FR("10.0.0.2:15001"),
                                         {a4_idx_bytes, 24},
                                         FR("3"),
                                         FR("1"),
                                         FR("0"),
                                         FR("0"),
                                         EMPTY,
                                         EMPTY,
                                         EMPTY};

static void m2_fill_a4(wire_m2 *m) {
  memset(m, 0, sizeof *m);
  m->room = 7215963401;
  strcpy(m->endpoint, "10.0.0.2");
  m->dst_port = 41235;
  strcpy(m->session, "10.0.0.2:15001");
  m->kv_indices = wire_array_of(a4_pages, 3);
  m->dst_aux_index = 3;
  m->required_dst_info_num = 1;
}

static void m2_golden_encode(void **state) {
  wire_m2 m;
  m2_fill_a4(&m);
  wire_msg msg;
  char reason[WIRE_REASON_LEN] = "";
  assert_int_equal(kvf__wire_m2_encode(&m, &msg, reason), 0);
  assert_frames_equal(&msg, a4_frames, 12);
  kvf__wire_msg_free(&msg);
}

static void m2_golden_decode(void **state) {
  wire_m2 m;
  char reason[WIRE_REASON_LEN] = "";
  assert_int_equal(kvf__wire_classify(a4_frames, 12), WIRE_MSG_M2);
  assert_int_equal(kvf__wire_m2_decode(a4_frames, 12, &m, reason), 0);
  assert_true(m.room == 7215963401);
  assert_string_equal(m.endpoint, "10.0.0.2");
  assert_int_equal(m.dst_port, 41235);
  assert_string_equal(m.session, "10.0.0.2:15001");
  assert_int_equal(m.session_port, 15001);
  assert_false(m.is_dummy);
  assert_int_equal(m.kv_indices.count, 3);
  for (size_t i = 0; i < 3; i++) assert_int_equal(wire_i64_at(m.kv_indices, i), a4_pages[i]);
  assert_int_equal(m.dst_aux_index, 3);
  assert_int_equal(m.required_dst_info_num, 1);
  assert_int_equal(m.decode_prefix_len, 0);
  assert_int_equal(m.indices_are_local, 0);
  assert_int_equal(m.page_mask.count, 0);
  assert_int_equal(m.local_indices.count, 0);
  assert_int_equal(m.mamba_indices.count, 0);
  assert_null(m.frags);
  assert_int_equal(m.nfrags, 0);
  kvf__wire_m2_free(&m);
}

static const wire_frame a7_frames[12] = {FR("7215963401"),
                                         FR("10.0.0.2"),
                                         FR("41235"),
                                         FR("10.0.0.2:15001"),
                                         EMPTY,
                                         EMPTY,
                                         FR("1"),
                                         EMPTY,
                                         EMPTY,
                                         EMPTY,
                                         EMPTY,
                                         EMPTY};

static void m2_dummy_golden(void **state) {
  wire_m2 m;
  char reason[WIRE_REASON_LEN] = "";
  assert_int_equal(kvf__wire_m2_decode(a7_frames, 12, &m, reason), 0);
  assert_true(m.is_dummy);
  assert_true(m.room == 7215963401);
  assert_int_equal(m.required_dst_info_num, 1);
  assert_int_equal(m.kv_indices.count, 0);
  wire_msg msg;
  assert_int_equal(kvf__wire_m2_encode(&m, &msg, reason), 0);
  assert_frames_equal(&msg, a7_frames, 12);
  kvf__wire_msg_free(&msg);
  kvf__wire_m2_free(&m);
}

/* A dummy's frames 7.. are never read: absent or garbage both decode. */
static void m2_dummy_ignores_tail(void **state) {
  wire_frame f[12];
  memcpy(f, a7_frames, sizeof f);
  f[7] = (wire_frame)FR("garbage");
  f[9] = (wire_frame)FR("\x07\x07");
  f[11] = (wire_frame)FR("abc");
  wire_m2 m;
  char reason[WIRE_REASON_LEN];
  assert_int_equal(kvf__wire_m2_decode(f, 12, &m, reason), 0);
  assert_true(m.is_dummy);
  assert_int_equal(m.decode_prefix_len, 0);
  assert_int_equal(kvf__wire_m2_decode(f, 7, &m, reason), 0);
  assert_true(m.is_dummy);
}

/* A real target with zero pages sends frame 5, so it is not a dummy. */
static void m2_zero_pages_not_dummy(void **state) {
  wire_frame f[12];
  memcpy(f, a4_frames, sizeof f);
  f[4] = (wire_frame)EMPTY;
  wire_m2 m;
  char reason[WIRE_REASON_LEN];
  assert_int_equal(kvf__wire_m2_decode(f, 12, &m, reason), 0);
  assert_false(m.is_dummy);
  assert_int_equal(m.kv_indices.count, 0);
  assert_int_equal(m.dst_aux_index, 3);
  wire_msg msg;
  assert_int_equal(kvf__wire_m2_encode(&m, &msg, reason), 0);
  assert_frames_equal(&msg, f, 12);
  kvf__wire_msg_free(&msg);
}

/* Short forms: frames 7.. absent take their defaults; >14 frames ignored. */
static void m2_frame_count_forms(void **state) {
  wire_frame f[16];
  memcpy(f, a4_frames, sizeof a4_frames);
  f[7] = (wire_frame)FR("32");
  f[12] = (wire_frame)EMPTY;
  f[13] = (wire_frame)EMPTY;
  f[14] = (wire_frame)FR("whatever");
  f[15] = (wire_frame)FR("\xff");
  wire_m2 m;
  char reason[WIRE_REASON_LEN];
  assert_int_equal(kvf__wire_m2_decode(f, 7, &m, reason), 0);
  assert_int_equal(m.decode_prefix_len, 0);
  assert_int_equal(m.kv_indices.count, 3);
  assert_int_equal(kvf__wire_m2_decode(f, 8, &m, reason), 0);
  assert_int_equal(m.decode_prefix_len, 32);
  for (size_t n = 9; n <= 16; n++) {
    assert_int_equal(kvf__wire_m2_decode(f, n, &m, reason), 0);
    assert_int_equal(m.nfrags, 0);
  }
  /* 13 frames with an empty frame 12: no plan. */
  assert_int_equal(kvf__wire_m2_decode(f, 13, &m, reason), 0);
  assert_null(m.frags);
}

/* The fast-completion bit rides in kvferry's frame 15 (room flags) and
 * comes back; frames 12-14 go out empty without a plan. */
static void m2_features_frame(void **state) {
  (void)state;
  wire_m2 m, d;
  wire_msg msg;
  char reason[WIRE_REASON_LEN];
  m2_fill_a4(&m);
  m.room_flags = WIRE_ROOM_FAST_COMPLETION;
  assert_int_equal(kvf__wire_m2_encode(&m, &msg, reason), 0);
  assert_int_equal(msg.nframes, 16);
  for (int i = 12; i < 15; i++) assert_int_equal(msg.frames[i].len, 0);
  assert_int_equal(kvf__wire_m2_decode(msg.frames, msg.nframes, &d, reason), 0);
  assert_int_equal(d.room_flags, WIRE_ROOM_FAST_COMPLETION);
  assert_null(d.frags);
  kvf__wire_msg_free(&msg);
}

/* Mask, local indices and state slots survive encode/decode, and the mask
 * may sit at an odd address (alignment-safe accessors). */
static void m2_roundtrip_full(void **state) {
  static const int64_t pages[4] = {100, 101, 7, 0};
  static const uint8_t mask[4] = {1, 0, 1, 1};
  static const int64_t local[3] = {5, 6, 9};
  static const int64_t mamba[2] = {3, -1};
  wire_m2 m;
  m2_fill_a4(&m);
  m.room = -42;
  m.kv_indices = wire_array_of(pages, 4);
  m.dst_aux_index = -1;
  m.required_dst_info_num = 3;
  m.decode_prefix_len = 64;
  m.indices_are_local = 1;
  m.page_mask = wire_array_of(mask, 4);
  m.local_indices = wire_array_of(local, 3);
  m.mamba_indices = wire_array_of(mamba, 2);
  wire_msg msg;
  char reason[WIRE_REASON_LEN] = "";
  assert_int_equal(kvf__wire_m2_encode(&m, &msg, reason), 0);
  assert_int_equal(msg.nframes, 12);
  assert_memory_equal(msg.frames[0].data, "-42", 3);
  assert_memory_equal(msg.frames[5].data, "-1", 2);
  assert_memory_equal(msg.frames[8].data, "1", 1);
  /* Re-home every frame at an odd offset before decoding. */
  uint8_t *buf = malloc(4096);
  wire_frame f[12];
  size_t o = 1;
  for (size_t i = 0; i < 12; i++) {
    memcpy(buf + o, msg.frames[i].data ? (const void *)msg.frames[i].data : "", msg.frames[i].len);
    f[i] = (wire_frame){buf + o, msg.frames[i].len};
    o += msg.frames[i].len + 1;
  }
  wire_m2 d;
  assert_int_equal(kvf__wire_m2_decode(f, 12, &d, reason), 0);
  assert_true(d.room == -42);
  assert_int_equal(d.dst_aux_index, -1);
  assert_int_equal(d.required_dst_info_num, 3);
  assert_int_equal(d.decode_prefix_len, 64);
  assert_int_equal(d.indices_are_local, 1);
  for (size_t i = 0; i < 4; i++) assert_int_equal(wire_i64_at(d.kv_indices, i), pages[i]);
  assert_array_equal(d.page_mask, m.page_mask, 1);
  for (size_t i = 0; i < 3; i++) assert_int_equal(wire_i64_at(d.local_indices, i), local[i]);
  assert_int_equal(wire_i64_at(d.mamba_indices, 1), -1);
  /* dup survives the frames going away. */
  wire_m2 *copy = NULL;
  assert_int_equal(kvf__wire_m2_dup(&d, &copy), 0);
  memset(buf, 0xee, 4096);
  free(buf);
  kvf__wire_msg_free(&msg);
  for (size_t i = 0; i < 4; i++) assert_int_equal(wire_i64_at(copy->kv_indices, i), pages[i]);
  assert_memory_equal(copy->page_mask.data, mask, 4);
  assert_int_equal(wire_i64_at(copy->local_indices, 2), 9);
  assert_int_equal(wire_i64_at(copy->mamba_indices, 0), 3);
  assert_string_equal(copy->session, "10.0.0.2:15001");
  /* dup_into a kept block: a smaller M2 reuses it as it is, a larger one grows it. */
  wire_m2 *block = copy;
  size_t cap = 1u << 20; /* pretend it is large: no realloc below */
  block = realloc(block, cap);
  assert_non_null(block);
  wire_m2 small = *block;
  int64_t one = 77;
  small.kv_indices = wire_array_of(&one, 1);
  small.page_mask = wire_array_of(NULL, 0);
  small.local_indices = wire_array_of(NULL, 0);
  small.mamba_indices = wire_array_of(NULL, 0);
  wire_m2 *before = block;
  assert_int_equal(kvf__wire_m2_dup_into(&small, &block, &cap), 0);
  assert_ptr_equal(block, before);
  assert_int_equal(cap, 1u << 20);
  assert_int_equal(block->kv_indices.count, 1);
  assert_int_equal(wire_i64_at(block->kv_indices, 0), 77);
  assert_string_equal(block->session, "10.0.0.2:15001");
  int64_t many[300];
  for (size_t i = 0; i < 300; i++) many[i] = (int64_t)i * 3;
  small.kv_indices = wire_array_of(many, 300);
  cap = 64; /* too small now: grown */
  assert_int_equal(kvf__wire_m2_dup_into(&small, &block, &cap), 0);
  assert_true(cap > 300 * 8);
  assert_int_equal(wire_i64_at(block->kv_indices, 299), 897);
  free(block);
}

static void m2_int64_room_bounds(void **state) {
  wire_frame f[12];
  memcpy(f, a4_frames, sizeof f);
  wire_m2 m;
  char reason[WIRE_REASON_LEN];
  f[0] = (wire_frame)FR("9223372036854775807");
  assert_int_equal(kvf__wire_m2_decode(f, 12, &m, reason), 0);
  assert_true(m.room == INT64_MAX);
  f[0] = (wire_frame)FR("-9223372036854775808");
  assert_int_equal(kvf__wire_m2_decode(f, 12, &m, reason), 0);
  assert_true(m.room == INT64_MIN);
  wire_msg msg;
  assert_int_equal(kvf__wire_m2_encode(&m, &msg, reason), 0);
  assert_int_equal(msg.frames[0].len, 20);
  assert_memory_equal(msg.frames[0].data, "-9223372036854775808", 20);
  kvf__wire_msg_free(&msg);
  f[0] = (wire_frame)FR("0");
  assert_int_equal(kvf__wire_m2_decode(f, 12, &m, reason), 0);
  assert_true(m.room == 0);
}

/* ---- §6.5.5 fragments ---- */

static void frag_example_format(void **state) {
  char *json = NULL;
  size_t len = 0;
  char reason[WIRE_REASON_LEN];
  assert_int_equal(kvf__wire_fragments_format(&frag_example_struct, 1, &json, &len, reason), 0);
  assert_int_equal(len, strlen(frag_example));
  assert_string_equal(json, frag_example);
  free(json);
}

static void frag_example_parse(void **state) {
  wire_fragment *f = NULL;
  size_t n = 0;
  char reason[WIRE_REASON_LEN];
  assert_int_equal(kvf__wire_fragments_parse(S(frag_example), &f, &n, reason), 0);
  assert_int_equal(n, 1);
  assert_frag_equal(&f[0], &frag_example_struct);
  free(f);
}

/* The Python parser ignores order and whitespace; so do we. */
static void frag_parse_order_and_spacing(void **state) {
  static const char js[] =
      "[ {\"page_count\": 7, \"bytes_per_page\": 256, \"dst_byte_offset\": 256,"
      " \"src_byte_offset\": 0, \"dst_page_stride_bytes\": 1024, \"src_page_stride_bytes\": 512,"
      " \"dst_rank\": 1, \"src_rank\": 3, \"buffer_kind\": \"mamba_state\", \"buffer_index\": 2},\n"
      "  {\"buffer_index\": 5, \"buffer_kind\": \"draft_v\", \"src_rank\": 0, \"dst_rank\": 0,"
      " \"src_page_stride_bytes\": 8, \"dst_page_stride_bytes\": 8, \"src_byte_offset\": 0,"
      " \"dst_byte_offset\": 0, \"bytes_per_page\": 8, \"page_count\": null} ]";
  wire_fragment *f = NULL;
  size_t n = 0;
  char reason[WIRE_REASON_LEN];
  assert_int_equal(kvf__wire_fragments_parse(S(js), &f, &n, reason), 0);
  assert_int_equal(n, 2);
  wire_fragment want0 = {2, WIRE_KIND_MAMBA_STATE, 3, 1, 512, 1024, 0, 256, 256, 7};
  wire_fragment want1 = {5, WIRE_KIND_DRAFT_V, 0, 0, 8, 8, 0, 0, 8, -1};
  assert_frag_equal(&f[0], &want0);
  assert_frag_equal(&f[1], &want1);
  char *json;
  size_t len;
  assert_int_equal(kvf__wire_fragments_format(f, n, &json, &len, reason), 0);
  assert_string_equal(json, "[{\"buffer_index\":2,\"buffer_kind\":\"mamba_state\",\"src_rank\":3,"
                            "\"dst_rank\":1,\"src_page_stride_bytes\":512,\"dst_page_stride_bytes\":1024,"
                            "\"src_byte_offset\":0,\"dst_byte_offset\":256,\"bytes_per_page\":256,"
                            "\"page_count\":7},{\"buffer_index\":5,\"buffer_kind\":\"draft_v\","
                            "\"src_rank\":0,\"dst_rank\":0,\"src_page_stride_bytes\":8,"
                            "\"dst_page_stride_bytes\":8,\"src_byte_offset\":0,\"dst_byte_offset\":0,"
                            "\"bytes_per_page\":8,\"page_count\":null}]");
  free(json);
  free(f);
}

/* An M2 with a plan: 14 frames, frame 12 "1", frame 13 the exact JSON. */
static void m2_fragments_golden(void **state) {
  wire_m2 m;
  m2_fill_a4(&m);
  m.frags = &frag_example_struct;
  m.nfrags = 1;
  wire_msg msg;
  char reason[WIRE_REASON_LEN] = "";
  assert_int_equal(kvf__wire_m2_encode(&m, &msg, reason), 0);
  wire_frame want[14];
  memcpy(want, a4_frames, sizeof a4_frames);
  want[12] = (wire_frame)FR("1");
  want[13] = (wire_frame){(const uint8_t *)frag_example, strlen(frag_example)};
  assert_frames_equal(&msg, want, 14);
  wire_m2 d;
  assert_int_equal(kvf__wire_m2_decode(msg.frames, msg.nframes, &d, reason), 0);
  assert_int_equal(d.nfrags, 1);
  assert_frag_equal(d.frags, &frag_example_struct);
  wire_m2 *copy = NULL;
  assert_int_equal(kvf__wire_m2_dup(&d, &copy), 0);
  kvf__wire_m2_free(&d);
  assert_null(d.frags);
  kvf__wire_msg_free(&msg);
  assert_int_equal(copy->nfrags, 1);
  assert_frag_equal(copy->frags, &frag_example_struct);
  kvf__wire_m2_free(copy); /* frags live in the block: nothing to free but the block */
  free(copy);
}

/* ---- golden: Appendix A.6 (M3) ---- */

static const wire_frame a6_frames[5] = {FR("7215963401"), FR("5"), FR("0"), FR("1734"), {a6_cand_bytes, 12}};

static void m3_golden(void **state) {
  wire_m3 m = {7215963401, WIRE_STATUS_SUCCESS, 0, 1734, wire_array_of(a6_cands, 3), NULL, 0, 0};
  wire_msg msg;
  char reason[WIRE_REASON_LEN] = "";
  assert_int_equal(kvf__wire_m3_encode(&m, &msg, reason), 0);
  assert_frames_equal(&msg, a6_frames, 5);
  kvf__wire_msg_free(&msg);
  wire_m3 d;
  assert_int_equal(kvf__wire_m3_decode(a6_frames, 5, &d, reason), 0);
  assert_true(d.room == 7215963401);
  assert_int_equal(d.status, WIRE_STATUS_SUCCESS);
  assert_int_equal(d.prefill_rank, 0);
  assert_int_equal(d.bootstrap_token, 1734);
  assert_int_equal(d.candidates.count, 3);
  for (size_t i = 0; i < 3; i++) assert_int_equal(wire_i32_at(d.candidates, i), a6_cands[i]);
}

/* kvferry's M3 frame 5: a Failed status with its reason; a reference
 * decoder reads 5 frames and ignores it. Decoding cuts an overlong reason. */
static void m3_reason_frame(void **state) {
  (void)state;
  const char *why = "too many requests wait";
  wire_m3 m = {9, WIRE_STATUS_FAILED, 1, -1, {NULL, 0}, why, strlen(why), 0};
  wire_msg msg;
  char reason[WIRE_REASON_LEN];
  assert_int_equal(kvf__wire_m3_encode(&m, &msg, reason), 0);
  assert_int_equal(msg.nframes, 6);
  wire_m3 d;
  assert_int_equal(kvf__wire_m3_decode(msg.frames, msg.nframes, &d, reason), 0);
  assert_int_equal(d.reason_len, strlen(why));
  assert_memory_equal(d.reason, why, strlen(why));
  assert_int_equal(kvf__wire_m3_decode(msg.frames, 5, &d, reason), 0);
  assert_int_equal(d.reason_len, 0);
  char big[1000];
  memset(big, 'x', sizeof big);
  wire_frame f[6];
  memcpy(f, msg.frames, sizeof f);
  f[5] = (wire_frame){(const uint8_t *)big, sizeof big};
  assert_int_equal(kvf__wire_m3_decode(f, 6, &d, reason), 0);
  assert_int_equal(d.reason_len, WIRE_REASON_LEN - 1);
  kvf__wire_msg_free(&msg);
}

/* kvferry's M3 frame 6: the fence epoch of the M2 answered, 8 bytes; frame
 * 5 goes out empty without a reason. A frame 6 of another length, or none,
 * reads as 0 (absent). */
static void m3_fence_epoch_frame(void **state) {
  (void)state;
  wire_m3 m = {9, WIRE_STATUS_SUCCESS, 1, 7, {NULL, 0}, NULL, 0, 0x1122334455667788ULL};
  wire_msg msg;
  char reason[WIRE_REASON_LEN];
  assert_int_equal(kvf__wire_m3_encode(&m, &msg, reason), 0);
  assert_int_equal(msg.nframes, 7);
  assert_int_equal(msg.frames[5].len, 0);
  assert_int_equal(msg.frames[6].len, 8);
  wire_m3 d;
  assert_int_equal(kvf__wire_m3_decode(msg.frames, msg.nframes, &d, reason), 0);
  assert_true(d.fence_epoch == 0x1122334455667788ULL);
  assert_int_equal(d.reason_len, 0);
  assert_int_equal(d.bootstrap_token, 7);
  assert_int_equal(kvf__wire_m3_decode(msg.frames, 6, &d, reason), 0);
  assert_true(d.fence_epoch == 0);
  wire_frame f[7];
  memcpy(f, msg.frames, sizeof f);
  f[6] = (wire_frame){(const uint8_t *)"1234567", 7};
  assert_int_equal(kvf__wire_m3_decode(f, 7, &d, reason), 0);
  assert_true(d.fence_epoch == 0);
  kvf__wire_msg_free(&msg);
}

static void m3_failed_golden(void **state) {
  static const wire_frame want[5] = {FR("7215963401"), FR("0"), FR("0"), FR("-1"), EMPTY};
  wire_m3 m = {7215963401, WIRE_STATUS_FAILED, 0, -1, {NULL, 0}, NULL, 0, 0};
  wire_msg msg;
  char reason[WIRE_REASON_LEN];
  assert_int_equal(kvf__wire_m3_encode(&m, &msg, reason), 0);
  assert_frames_equal(&msg, want, 5);
  kvf__wire_msg_free(&msg);
  wire_m3 d;
  assert_int_equal(kvf__wire_m3_decode(want, 5, &d, reason), 0);
  assert_int_equal(d.status, WIRE_STATUS_FAILED);
  assert_int_equal(d.bootstrap_token, -1);
  assert_int_equal(d.candidates.count, 0);
}

static void m3_frame_count_forms(void **state) {
  wire_frame f[7] = {FR("12"), FR("2"), FR("3"), FR("99"), EMPTY, FR("x"), FR("y")};
  wire_m3 d;
  char reason[WIRE_REASON_LEN];
  assert_int_equal(kvf__wire_m3_decode(f, 3, &d, reason), 0);
  assert_int_equal(d.bootstrap_token, -1); /* absent frame 3 */
  assert_int_equal(d.candidates.count, 0);
  assert_int_equal(d.prefill_rank, 3);
  assert_int_equal(d.status, WIRE_STATUS_BOOTSTRAPPED);
  assert_int_equal(kvf__wire_m3_decode(f, 4, &d, reason), 0);
  assert_int_equal(d.bootstrap_token, 99);
  assert_int_equal(kvf__wire_m3_decode(f, 7, &d, reason), 0); /* extras ignored */
  assert_int_equal(d.candidates.count, 0);
  /* Every status value 0..5 is accepted. */
  static const char *const st[6] = {"0", "1", "2", "3", "4", "5"};
  for (int s = 0; s < 6; s++) {
    f[1] = (wire_frame){(const uint8_t *)st[s], 1};
    assert_int_equal(kvf__wire_m3_decode(f, 5, &d, reason), 0);
    assert_int_equal(d.status, s);
  }
}

/* ---- classification and arguments ---- */

static void classify_kinds(void **state) {
  wire_frame f[1] = {FR("None")};
  assert_int_equal(kvf__wire_classify(f, 1), WIRE_MSG_M1);
  f[0] = (wire_frame)FR("none");
  assert_int_equal(kvf__wire_classify(f, 1), WIRE_MSG_M2);
  f[0] = (wire_frame)FR("None ");
  assert_int_equal(kvf__wire_classify(f, 1), WIRE_MSG_M2);
  f[0] = (wire_frame)EMPTY;
  assert_int_equal(kvf__wire_classify(f, 1), WIRE_MSG_M2);
  assert_int_equal(kvf__wire_classify(f, 0), KVF_EPROTO);
}

static void bad_arguments(void **state) {
  wire_m1 m1;
  wire_m2 m2;
  wire_m3 m3;
  char reason[WIRE_REASON_LEN];
  assert_int_equal(kvf__wire_m1_decode(a3_frames, 8, NULL, reason), KVF_EINVAL);
  assert_int_equal(kvf__wire_m2_decode(NULL, 12, &m2, reason), KVF_EINVAL);
  wire_frame f[12];
  memcpy(f, a4_frames, sizeof f);
  f[9] = (wire_frame){NULL, 4};
  assert_int_equal(kvf__wire_m2_decode(f, 12, &m2, reason), KVF_EINVAL);
  assert_string_equal(reason, "M2: frame 9 has a length but no data");
  assert_int_equal(kvf__wire_m3_decode(a6_frames, 5, NULL, NULL), KVF_EINVAL);
  /* NULL reason is allowed. */
  assert_int_equal(kvf__wire_m1_decode(a4_frames, 12, &m1, NULL), KVF_EPROTO);
  assert_int_equal(kvf__wire_m3_decode(a6_frames, 2, &m3, NULL), KVF_EPROTO);
  assert_int_equal(kvf__wire_m1_encode(NULL, NULL, reason), KVF_EINVAL);
}

/* ---- rejection tables ---- */

typedef struct bad_case {
  size_t nframes; /* frames to pass */
  int i1;         /* frame to replace, -1 none */
  const uint8_t *b1;
  size_t l1;
  int i2;
  const uint8_t *b2;
  size_t l2;
  const char *expect; /* prefix of the reason */
} bad_case;

#define R1(n, i, lit, exp) \
  { n, i, S(lit), -1, NULL, 0, exp }
#define R2(n, i, lit, j, lit2, exp) \
  { n, i, S(lit), j, S(lit2), exp }
#define RN(n, exp) \
  { n, -1, NULL, 0, -1, NULL, 0, exp }

typedef int (*decode_fn)(const wire_frame *, size_t, void *, char *);

static void run_bad_cases(const char *what, const wire_frame *base, size_t nbase, const bad_case *cases,
                          size_t ncases, size_t out_size, decode_fn dec) {
  unsigned char *out = malloc(out_size), *pristine = malloc(out_size);
  memset(pristine, 0xa5, out_size);
  for (size_t k = 0; k < ncases; k++) {
    const bad_case *c = &cases[k];
    wire_frame f[16];
    assert_true(nbase <= 16 && c->nframes <= 16);
    memcpy(f, base, nbase * sizeof *f);
    if (c->i1 >= 0) f[c->i1] = (wire_frame){c->b1, c->l1};
    if (c->i2 >= 0) f[c->i2] = (wire_frame){c->b2, c->l2};
    memcpy(out, pristine, out_size);
    char reason[WIRE_REASON_LEN] = "";
    int rc = dec(f, c->nframes, out, reason);
    if (rc != KVF_EPROTO) fail_msg("%s case %zu (%s): rc %d, want KVF_EPROTO", what, k, c->expect, rc);
    if (strncmp(reason, c->expect, strlen(c->expect)))
      fail_msg("%s case %zu: reason \"%s\", want prefix \"%s\"", what, k, reason, c->expect);
    if (memcmp(out, pristine, out_size))
      fail_msg("%s case %zu (%s): output struct was modified", what, k, c->expect);
  }
  free(out);
  free(pristine);
}

static int dec_m1(const wire_frame *f, size_t n, void *o, char *r) { return kvf__wire_m1_decode(f, n, o, r); }
static int dec_m2(const wire_frame *f, size_t n, void *o, char *r) {
  int rc = kvf__wire_m2_decode(f, n, o, r);
  if (rc == 0) kvf__wire_m2_free(o);
  return rc;
}
static int dec_m3(const wire_frame *f, size_t n, void *o, char *r) { return kvf__wire_m3_decode(f, n, o, r); }

static void m1_rejections(void **state) {
  static char long_name[300];
  memset(long_name, 'a', 256);
  long_name[256] = 0;
  static const bad_case cases[] = {
      RN(5, "M1: 5 frames, needs at least 6"),
      RN(0, "M1: 0 frames"),
      R1(8, 0, "none", "M1 frame 0 (room): \"none\", an M1 must carry \"None\""),
      R1(8, 0, "7215963401", "M1 frame 0 (room)"),
      R1(8, 1, "", "M1 frame 1 (endpoint): empty"),
      R1(8, 1, "10.0.0.2 ", "M1 frame 1 (endpoint)"),
      R1(8, 1, "10.0.\n0.2", "M1 frame 1 (endpoint)"),
      R1(8, 1, "10.0.0.\x80", "M1 frame 1 (endpoint)"),
      R1(8, 2, "0", "M1 frame 2 (dst_port): 0 is outside 1..65535"),
      R1(8, 2, "65536", "M1 frame 2 (dst_port)"),
      R1(8, 2, "-1", "M1 frame 2 (dst_port)"),
      R1(8, 2, "+41235", "M1 frame 2 (dst_port): \"+41235\" is not an ascii int"),
      R1(8, 2, " 41235", "M1 frame 2 (dst_port)"),
      R1(8, 2, "41235\n", "M1 frame 2 (dst_port)"),
      R1(8, 2, "041235", "M1 frame 2 (dst_port): \"041235\" is not a canonical ascii int"),
      R1(8, 2, "", "M1 frame 2 (dst_port): empty"),
      R1(8, 2, "-", "M1 frame 2 (dst_port)"),
      R1(8, 2, "4123a", "M1 frame 2 (dst_port)"),
      R1(8, 3, "10.0.0.2", "M1 frame 3 (session_id): \"10.0.0.2\" is not \"host:port\""),
      R1(8, 3, ":15001", "M1 frame 3 (session_id)"),
      R1(8, 3, "10.0.0.2:", "M1 frame 3 (session_id)"),
      R1(8, 3, "10.0.0.2:0", "M1 frame 3 (session_id)"),
      R1(8, 3, "10.0.0.2:65536", "M1 frame 3 (session_id)"),
      R1(8, 3, "10.0.0.2:1500x", "M1 frame 3 (session_id)"),
      R1(8, 3, "10.0.0.2:015001", "M1 frame 3 (session_id)"),
      R1(8, 3, "", "M1 frame 3 (session_id): empty"),
      R1(8, 4, "0123456789abc", "M1 frame 4 (dst_kv_ptrs): length 13 is not a multiple of 8"),
      R1(8, 5, "1234567", "M1 frame 5 (dst_aux_ptrs): length 7 is not a multiple of 8"),
      R1(8, 6, "123456789", "M1 frame 6 (dst_state_ptrs): length 9 is not a multiple of 8"),
      R1(8, 7, "x", "M1 frame 7 (decode_prefix_len): \"x\" is not an ascii int"),
      R1(8, 7, "-16", "M1 frame 7 (decode_prefix_len): -16 is outside"),
      R1(7, 6, "x", "M1 frame 6 (decode_prefix_len): \"x\" is not an ascii int"),
      R1(7, 6, "00", "M1 frame 6 (decode_prefix_len)"),
      R1(8, 7, "99999999999999999999",
         "M1 frame 7 (decode_prefix_len): \"99999999999999999999\" does not fit in int64"),
  };
  run_bad_cases("M1", a3_frames, 8, cases, NFR(cases), sizeof(wire_m1), dec_m1);
  /* Strings past 255 bytes and pointer frames past 4096 entries. */
  wire_frame f[8];
  memcpy(f, a3_frames, sizeof f);
  wire_m1 m;
  char reason[WIRE_REASON_LEN];
  f[1] = (wire_frame){(const uint8_t *)long_name, 256};
  assert_int_equal(kvf__wire_m1_decode(f, 8, &m, reason), KVF_EPROTO);
  assert_string_equal(reason, "M1 frame 1 (endpoint): 256 bytes, at most 255 allowed");
  f[1] = (wire_frame){(const uint8_t *)long_name, 255};
  assert_int_equal(kvf__wire_m1_decode(f, 8, &m, reason), 0);
  assert_int_equal(strlen(m.endpoint), 255);
  uint8_t *big = calloc(4097, 8);
  f[4] = (wire_frame){big, 4097 * 8};
  assert_int_equal(kvf__wire_m1_decode(f, 8, &m, reason), KVF_EPROTO);
  assert_string_equal(reason, "M1 frame 4 (dst_kv_ptrs): 4097 entries, at most 4096 allowed");
  f[4] = (wire_frame){big, 4096 * 8};
  assert_int_equal(kvf__wire_m1_decode(f, 8, &m, reason), 0);
  free(big);
}

/* 15-frame base: A.4 plus a valid plan and a trailing frame. */
static wire_frame m2_base[15];
static void m2_base_init(void) {
  memcpy(m2_base, a4_frames, sizeof a4_frames);
  m2_base[12] = (wire_frame)FR("1");
  m2_base[13] = (wire_frame){(const uint8_t *)frag_example, strlen(frag_example)};
  m2_base[14] = (wire_frame)FR("ignored");
}

static void m2_base_is_valid(void **state) {
  m2_base_init();
  wire_m2 m;
  char reason[WIRE_REASON_LEN];
  assert_int_equal(kvf__wire_m2_decode(m2_base, 15, &m, reason), 0);
  assert_int_equal(m.nfrags, 1);
  assert_int_equal(m.page_layout, 0); /* not a page size: ignored, as the reference ignores it */
  kvf__wire_m2_free(&m);
  /* kvferry's frame 14: tokens per token-major page, next to a plan only. */
  m2_base[14] = (wire_frame)FR("16");
  assert_int_equal(kvf__wire_m2_decode(m2_base, 15, &m, reason), 0);
  assert_int_equal(m.page_layout, 16);
  wire_msg msg;
  assert_int_equal(kvf__wire_m2_encode(&m, &msg, reason), 0);
  assert_int_equal(msg.nframes, 15);
  assert_int_equal(msg.frames[14].len, 2);
  assert_memory_equal(msg.frames[14].data, "16", 2);
  kvf__wire_msg_free(&msg);
  kvf__wire_m2_free(&m);
  m2_base[14] = (wire_frame)FR("0");
  assert_int_equal(kvf__wire_m2_decode(m2_base, 15, &m, reason), 0);
  assert_int_equal(m.page_layout, 0);
  kvf__wire_m2_free(&m);
}

static void m2_rejections(void **state) {
  m2_base_init();
  static const int64_t neg_page[2] = {4, -3};
  static const bad_case cases[] = {
      RN(6, "M2: 6 frames, needs at least 7"),
      R1(12, 0, "None", "M2 frame 0 (room): \"None\" marks an M1, not an M2"),
      R1(12, 0, "abc", "M2 frame 0 (room): \"abc\" is not an ascii int"),
      R1(12, 0, "", "M2 frame 0 (room): empty"),
      R1(12, 0, "07215963401", "M2 frame 0 (room)"),
      R1(12, 0, "-0", "M2 frame 0 (room): \"-0\" is not a canonical"),
      R1(12, 0, "9223372036854775808", "M2 frame 0 (room): \"9223372036854775808\" does not fit"),
      R1(12, 0, "-9223372036854775809", "M2 frame 0 (room)"),
      R1(12, 0, "1.5", "M2 frame 0 (room)"),
      R1(12, 0, "1_000", "M2 frame 0 (room)"),
      R1(12, 1, "", "M2 frame 1 (endpoint): empty"),
      R1(12, 2, "0", "M2 frame 2 (dst_port)"),
      R1(12, 2, "port", "M2 frame 2 (dst_port)"),
      R1(12, 3, "nocolon", "M2 frame 3 (session_id)"),
      R1(12, 6, "0", "M2 frame 6 (required_dst_info_num): 0 is outside 1..65536"),
      R1(12, 6, "65537", "M2 frame 6 (required_dst_info_num)"),
      R1(12, 6, "", "M2 frame 6 (required_dst_info_num): empty"),
      R1(12, 6, "x", "M2 frame 6 (required_dst_info_num)"),
      R1(12, 4, "0123456789abc", "M2 frame 4 (dst_kv_indices): length 13 is not a multiple of 8"),
      R1(12, 5, "", "M2 frame 5 (dst_aux_index): empty while frame 4 is not"),
      R1(12, 5, "None", "M2 frame 5 (dst_aux_index): \"None\" is not an ascii int"),
      R1(12, 7, "", "M2 frame 7 (decode_prefix_len): empty"),
      R1(12, 7, "-16", "M2 frame 7 (decode_prefix_len)"),
      R1(12, 8, "2", "M2 frame 8 (dst_indices_are_local): 2 is outside 0..1"),
      R1(12, 8, "", "M2 frame 8 (dst_indices_are_local): empty"),
      R1(12, 8, "true", "M2 frame 8 (dst_indices_are_local)"),
      R1(12, 9, "\x01\x00\x02", "M2 frame 9 (dst_page_transfer_mask): entry 2 is 0x02"),
      R1(12, 9, "\x01\x00", "M2 frame 9 (dst_page_transfer_mask): 2 entries, frame 4 has 3 pages"),
      R1(12, 10, "1234567", "M2 frame 10 (dst_page_local_indices): length 7 is not a multiple of 8"),
      R1(12, 11, "123456789", "M2 frame 11 (dst_mamba_indices): length 9 is not a multiple of 8"),
      /* frame 8 = 1: the mask must cover frame 4 and frame 10 the owned pages */
      R1(12, 8, "1", "M2 frame 9 (dst_page_transfer_mask): 0 entries, frame 8 says"),
      R2(12, 8, "1", 9, "\x01\x00\x01", "M2 frame 10 (dst_page_local_indices): 0 entries, frame 9 marks 2"),
      /* plans */
      R1(13, 12, "1", "M2 frame 12 (plan_version): present without frame 13"),
      R1(14, 12, "", "M2 frame 12 (plan_version): empty while frame 13 is not"),
      R1(14, 13, "", "M2 frame 13 (fragments): empty while frame 12 is not"),
      R1(14, 12, "2", "M2 frame 12 (plan_version): version 2 is not supported (expected 1)"),
      R1(14, 12, "0", "M2 frame 12 (plan_version): version 0 is not supported"),
      R1(14, 12, "01", "M2 frame 12 (plan_version)"),
      R1(14, 12, "v1", "M2 frame 12 (plan_version)"),
      R1(14, 13, "[", "M2 frame 13 (fragments): invalid JSON"),
      R1(14, 13, "[]", "M2 frame 13 (fragments): empty fragment list"),
  };
  run_bad_cases("M2", m2_base, 15, cases, NFR(cases), sizeof(wire_m2), dec_m2);

  /* Dummy forms still need valid frames 0, 2, 3 and 6. */
  wire_frame f[15];
  wire_m2 m;
  char reason[WIRE_REASON_LEN];
  memcpy(f, a7_frames, sizeof a7_frames);
  f[6] = (wire_frame)FR("0");
  assert_int_equal(kvf__wire_m2_decode(f, 12, &m, reason), KVF_EPROTO);
  assert_string_equal(reason, "M2 frame 6 (required_dst_info_num): 0 is outside 1..65536");
  memcpy(f, a7_frames, sizeof a7_frames);
  f[2] = (wire_frame)FR("x");
  assert_int_equal(kvf__wire_m2_decode(f, 12, &m, reason), KVF_EPROTO);
  assert_string_equal(reason, "M2 frame 2 (dst_port): \"x\" is not an ascii int");
  memcpy(f, a7_frames, sizeof a7_frames);
  f[0] = (wire_frame)FR("r");
  assert_int_equal(kvf__wire_m2_decode(f, 12, &m, reason), KVF_EPROTO);
  assert_string_equal(reason, "M2 frame 0 (room): \"r\" is not an ascii int");

  /* Negative page and local indices. */
  memcpy(f, a4_frames, sizeof a4_frames);
  f[4] = (wire_frame){(const uint8_t *)neg_page, 16};
  assert_int_equal(kvf__wire_m2_decode(f, 12, &m, reason), KVF_EPROTO);
  assert_string_equal(reason, "M2 frame 4 (dst_kv_indices): entry 1 is -3, must be >= 0");
  memcpy(f, a4_frames, sizeof a4_frames);
  f[10] = (wire_frame){(const uint8_t *)neg_page, 16};
  assert_int_equal(kvf__wire_m2_decode(f, 12, &m, reason), KVF_EPROTO);
  assert_string_equal(reason, "M2 frame 10 (dst_page_local_indices): entry 1 is -3, must be >= 0");

  /* Page frames past 1<<20 entries. */
  uint8_t *big = calloc((size_t)WIRE_MAX_PAGES + 1, 8);
  memcpy(f, a4_frames, sizeof a4_frames);
  f[4] = (wire_frame){big, ((size_t)WIRE_MAX_PAGES + 1) * 8};
  assert_int_equal(kvf__wire_m2_decode(f, 12, &m, reason), KVF_EPROTO);
  assert_string_equal(reason, "M2 frame 4 (dst_kv_indices): 1048577 entries, at most 1048576 allowed");
  f[4] = (wire_frame){big, (size_t)WIRE_MAX_PAGES * 8};
  assert_int_equal(kvf__wire_m2_decode(f, 12, &m, reason), 0);
  assert_int_equal(m.kv_indices.count, WIRE_MAX_PAGES);
  free(big);
}

/* One case per fragment rule, each checked standalone and inside an M2. */
#define FRAG_OK_TAIL                                                                                            \
  "\"src_page_stride_bytes\":512,\"dst_page_stride_bytes\":1024,\"src_byte_offset\":0,\"dst_byte_offset\":512," \
  "\"bytes_per_page\":512,\"page_count\":null"
static void fragment_rejections(void **state) {
  static const struct {
    const char *json;
    const char *expect;
  } cases[] = {
      {"", "empty"},
      {"{}", "not a JSON array"},
      {"[1]", "fragment 0 is not a JSON object"},
      {"[]", "empty fragment list"},
      {"[{\"buffer_index\":0}", "invalid JSON"},
      {"[{}] x", "invalid JSON"},
      {"[{\"buffer_index\":0,\"buffer_kind\":\"target_q\",\"src_rank\":1,\"dst_rank\":0," FRAG_OK_TAIL "}]",
       "fragment 0: buffer_kind is not a known kind string"},
      {"[{\"buffer_index\":0,\"buffer_kind\":3,\"src_rank\":1,\"dst_rank\":0," FRAG_OK_TAIL "}]",
       "fragment 0: buffer_kind is not a known kind string"},
      {"[{\"buffer_index\":0.0,\"buffer_kind\":\"target_k\",\"src_rank\":1,\"dst_rank\":0," FRAG_OK_TAIL "}]",
       "fragment 0: \"buffer_index\" is not an integer"},
      {"[{\"buffer_index\":\"0\",\"buffer_kind\":\"target_k\",\"src_rank\":1,\"dst_rank\":0," FRAG_OK_TAIL "}]",
       "fragment 0: \"buffer_index\" is not an integer"},
      {"[{\"buffer_index\":0,\"buffer_kind\":\"target_k\",\"src_rank\":true,\"dst_rank\":0," FRAG_OK_TAIL "}]",
       "fragment 0: \"src_rank\" is not an integer"},
      {"[{\"buffer_index\":0,\"buffer_kind\":\"target_k\",\"src_rank\":1,\"dst_rank\":null," FRAG_OK_TAIL "}]",
       "fragment 0: \"dst_rank\" is not an integer"},
      {"[{\"buffer_index\":0,\"buffer_kind\":\"target_k\",\"src_rank\":1,\"dst_rank\":0,\"src_rank\":"
       "1," FRAG_OK_TAIL "}]",
       "invalid JSON"}, /* duplicate key */
      {"[{\"buffer_index\":0,\"buffer_kind\":\"target_k\",\"src_rank\":1,\"dst_rank\":0,\"extra\":1," FRAG_OK_TAIL
       "}]",
       "fragment 0: unknown key \"extra\""},
      {"[{\"buffer_index\":4096,\"buffer_kind\":\"target_k\",\"src_rank\":1,\"dst_rank\":0," FRAG_OK_TAIL "}]",
       "fragment 0: buffer_index is outside 0..4095"},
      {"[{\"buffer_index\":-1,\"buffer_kind\":\"target_k\",\"src_rank\":1,\"dst_rank\":0," FRAG_OK_TAIL "}]",
       "fragment 0: buffer_index is outside"},
      {"[{\"buffer_index\":0,\"buffer_kind\":\"target_k\",\"src_rank\":-1,\"dst_rank\":0," FRAG_OK_TAIL "}]",
       "fragment 0: src_rank/dst_rank"},
      {"[{\"buffer_index\":0,\"buffer_kind\":\"target_k\",\"src_rank\":1,\"dst_rank\":0,\"src_page_stride_bytes\":"
       "0,\"dst_page_stride_bytes\":1024,\"src_byte_offset\":0,\"dst_byte_offset\":512,\"bytes_per_page\":512,"
       "\"page_count\":null}]",
       "fragment 0: a page stride is not positive"},
      {"[{\"buffer_index\":0,\"buffer_kind\":\"target_k\",\"src_rank\":1,\"dst_rank\":0,\"src_page_stride_bytes\":"
       "512,\"dst_page_stride_bytes\":1024,\"src_byte_offset\":0,\"dst_byte_offset\":512,\"bytes_per_page\":0,"
       "\"page_count\":null}]",
       "fragment 0: bytes_per_page is not positive"},
      {"[{\"buffer_index\":0,\"buffer_kind\":\"target_k\",\"src_rank\":1,\"dst_rank\":0,\"src_page_stride_bytes\":"
       "512,\"dst_page_stride_bytes\":1024,\"src_byte_offset\":-1,\"dst_byte_offset\":512,\"bytes_per_page\":512,"
       "\"page_count\":null}]",
       "fragment 0: a byte offset is negative"},
      {"[{\"buffer_index\":0,\"buffer_kind\":\"target_k\",\"src_rank\":1,\"dst_rank\":0,\"src_page_stride_bytes\":"
       "512,\"dst_page_stride_bytes\":1024,\"src_byte_offset\":1,\"dst_byte_offset\":512,\"bytes_per_page\":512,"
       "\"page_count\":null}]",
       "fragment 0: src_byte_offset + bytes_per_page exceeds src_page_stride_bytes"},
      {"[{\"buffer_index\":0,\"buffer_kind\":\"target_k\",\"src_rank\":1,\"dst_rank\":0,\"src_page_stride_bytes\":"
       "512,\"dst_page_stride_bytes\":1024,\"src_byte_offset\":0,\"dst_byte_offset\":513,\"bytes_per_page\":512,"
       "\"page_count\":null}]",
       "fragment 0: dst_byte_offset + bytes_per_page exceeds dst_page_stride_bytes"},
      {"[{\"buffer_index\":0,\"buffer_kind\":\"target_k\",\"src_rank\":1,\"dst_rank\":0,\"src_page_stride_bytes\":"
       "512,\"dst_page_stride_bytes\":1024,\"src_byte_offset\":0,\"dst_byte_offset\":512,\"bytes_per_page\":512,"
       "\"page_count\":-1}]",
       "fragment 0: page_count is negative"},
      {"[{\"buffer_index\":0,\"buffer_kind\":\"target_k\",\"src_rank\":1,\"dst_rank\":0,\"src_page_stride_bytes\":"
       "512,\"dst_page_stride_bytes\":1024,\"src_byte_offset\":0,\"dst_byte_offset\":512,\"bytes_per_page\":512,"
       "\"page_count\":1.5}]",
       "fragment 0: \"page_count\" is not an integer"},
      {"[{\"buffer_index\":0,\"buffer_kind\":\"target_k\",\"src_rank\":1,\"dst_rank\":0,\"src_page_stride_bytes\":"
       "99999999999999999999,\"dst_page_stride_bytes\":1024,\"src_byte_offset\":0,\"dst_byte_offset\":512,\"bytes_"
       "per_page\":512,\"page_count\":null}]",
       "invalid JSON"}, /* integer too big for int64 */
  };
  char reason[WIRE_REASON_LEN];
  char want[WIRE_REASON_LEN + 64];
  for (size_t k = 0; k < NFR(cases); k++) {
    wire_fragment *f = (wire_fragment *)0x1;
    size_t n = 77;
    int rc = kvf__wire_fragments_parse((const uint8_t *)cases[k].json, strlen(cases[k].json), &f, &n, reason);
    if (rc != KVF_EPROTO) fail_msg("fragment case %zu: rc %d", k, rc);
    if (strncmp(reason, cases[k].expect, strlen(cases[k].expect)))
      fail_msg("fragment case %zu: reason \"%s\", want \"%s\"", k, reason, cases[k].expect);
    assert_ptr_equal(f, (wire_fragment *)0x1);
    assert_int_equal(n, 77);
    /* Inside an M2 the reason names frame 13. */
    wire_frame fr[14];
    memcpy(fr, a4_frames, sizeof a4_frames);
    fr[12] = (wire_frame)FR("1");
    fr[13] = (wire_frame){(const uint8_t *)cases[k].json, strlen(cases[k].json)};
    wire_m2 m;
    rc = kvf__wire_m2_decode(fr, 14, &m, reason);
    if (!cases[k].json[0]) {
      assert_int_equal(rc, KVF_EPROTO);
      assert_string_equal(reason, "M2 frame 13 (fragments): empty while frame 12 is not");
      continue;
    }
    assert_int_equal(rc, KVF_EPROTO);
    snprintf(want, sizeof want, "M2 frame 13 (fragments): %s", cases[k].expect);
    if (strncmp(reason, want, strlen(want))) fail_msg("M2 fragment case %zu: \"%s\"", k, reason);
  }
  /* Each of the ten keys is required. */
  static const char *const keys[10] = {"buffer_index",    "buffer_kind",           "src_rank",
                                       "dst_rank",        "src_page_stride_bytes", "dst_page_stride_bytes",
                                       "src_byte_offset", "dst_byte_offset",       "bytes_per_page",
                                       "page_count"};
  for (int k = 0; k < 10; k++) {
    char json[512];
    size_t o = 0;
    o += (size_t)snprintf(json + o, sizeof json - o, "[{");
    const char *vals[10] = {"0", "\"target_v\"", "1", "0", "512", "1024", "0", "512", "512", "null"};
    int first = 1;
    for (int j = 0; j < 10; j++) {
      if (j == k) continue;
      o += (size_t)snprintf(json + o, sizeof json - o, "%s\"%s\":%s", first ? "" : ",", keys[j], vals[j]);
      first = 0;
    }
    o += (size_t)snprintf(json + o, sizeof json - o, "}]");
    wire_fragment *f;
    size_t n;
    assert_int_equal(kvf__wire_fragments_parse((const uint8_t *)json, o, &f, &n, reason), KVF_EPROTO);
    snprintf(want, sizeof want, "fragment 0: missing key \"%s\"", keys[k]);
    assert_string_equal(reason, want);
  }
}

/* Fragment count and JSON size bounds, and the largest legal plan. */
static void fragment_bounds(void **state) {
  size_t n = WIRE_MAX_FRAGMENTS + 1;
  wire_fragment *many = calloc(n, sizeof *many);
  for (size_t k = 0; k < n; k++) many[k] = frag_example_struct;
  char reason[WIRE_REASON_LEN];
  char *json;
  size_t len;
  assert_int_equal(kvf__wire_fragments_format(many, n, &json, &len, reason), KVF_EINVAL);
  assert_int_equal(kvf__wire_fragments_format(many, n - 1, &json, &len, reason), 0);
  wire_fragment *back;
  size_t nback;
  assert_int_equal(kvf__wire_fragments_parse((const uint8_t *)json, len, &back, &nback, reason), 0);
  assert_int_equal(nback, n - 1);
  for (size_t k = 0; k < n - 1; k++) assert_frag_equal(&back[k], &many[k]);
  free(back);
  /* 4097 fragments on the wire: a comma and one more object. */
  char *more = malloc(len + 400);
  memcpy(more, json, len - 1);
  size_t ml = len - 1;
  more[ml++] = ',';
  memcpy(more + ml, frag_example + 1, strlen(frag_example) - 1);
  ml += strlen(frag_example) - 1;
  assert_int_equal(kvf__wire_fragments_parse((const uint8_t *)more, ml, &back, &nback, reason), KVF_EPROTO);
  assert_string_equal(reason, "4097 fragments, at most 4096 allowed");
  free(more);
  free(json);
  /* A list of more values than 4096 fragments hold is refused before the
   * parse allocates them (tens of bytes each). */
  size_t nv = 300000, fl = 2 * nv + 1;
  char *flat = malloc(fl);
  flat[0] = '[';
  for (size_t k = 0; k < nv; k++) flat[1 + 2 * k] = '1', flat[2 + 2 * k] = k + 1 < nv ? ',' : ']';
  assert_int_equal(kvf__wire_fragments_parse((const uint8_t *)flat, fl, &back, &nback, reason), KVF_EPROTO);
  assert_string_equal(reason, "300000 values, more than 4096 fragments hold");
  free(flat);
  /* More than 1 MiB of JSON is refused before parsing. */
  size_t big = (size_t)WIRE_MAX_JSON + 1;
  char *pad = malloc(big);
  memset(pad, ' ', big);
  pad[0] = '[';
  pad[big - 1] = ']';
  assert_int_equal(kvf__wire_fragments_parse((const uint8_t *)pad, big, &back, &nback, reason), KVF_EPROTO);
  assert_string_equal(reason, "1048577 bytes, at most 1048576 allowed");
  free(pad);
  /* Huge values in every fragment push the formatted plan past 1 MiB. */
  for (size_t k = 0; k < WIRE_MAX_FRAGMENTS; k++) {
    many[k].src_page_stride_bytes = many[k].dst_page_stride_bytes = INT64_MAX;
    many[k].src_byte_offset = many[k].dst_byte_offset = INT64_MAX / 2;
    many[k].bytes_per_page = INT64_MAX / 4;
    many[k].page_count = INT64_MAX;
    many[k].src_rank = many[k].dst_rank = INT32_MAX;
  }
  assert_int_equal(kvf__wire_fragments_format(many, WIRE_MAX_FRAGMENTS, &json, &len, reason), KVF_ETOOBIG);
  free(many);
}

static void m3_rejections(void **state) {
  static const bad_case cases[] = {
      RN(2, "M3: 2 frames, needs at least 3"),
      R1(5, 0, "", "M3 frame 0 (room): empty"),
      R1(5, 0, "room", "M3 frame 0 (room)"),
      R1(5, 1, "6", "M3 frame 1 (status): 6 is outside 0..5"),
      R1(5, 1, "-1", "M3 frame 1 (status)"),
      R1(5, 1, "05", "M3 frame 1 (status)"),
      R1(5, 1, "", "M3 frame 1 (status): empty"),
      R1(5, 2, "-1", "M3 frame 2 (prefill_rank): -1 is outside 0..2147483647"),
      R1(5, 2, "2147483648", "M3 frame 2 (prefill_rank)"),
      R1(5, 3, "", "M3 frame 3 (bootstrap_token): empty"),
      R1(5, 3, "-2", "M3 frame 3 (bootstrap_token): -2 is outside"),
      R1(4, 3, "tok", "M3 frame 3 (bootstrap_token)"),
      R1(5, 4, "12345", "M3 frame 4 (spec_candidate_ids): length 5 is not a multiple of 4"),
  };
  run_bad_cases("M3", a6_frames, 5, cases, NFR(cases), sizeof(wire_m3), dec_m3);
  uint8_t *big = calloc((size_t)WIRE_MAX_CANDIDATES + 1, 4);
  wire_frame f[5];
  memcpy(f, a6_frames, sizeof f);
  f[4] = (wire_frame){big, ((size_t)WIRE_MAX_CANDIDATES + 1) * 4};
  wire_m3 m;
  char reason[WIRE_REASON_LEN];
  assert_int_equal(kvf__wire_m3_decode(f, 5, &m, reason), KVF_EPROTO);
  assert_string_equal(reason, "M3 frame 4 (spec_candidate_ids): 65 entries, at most 64 allowed");
  free(big);
}

/* Encoders refuse what the decoders would refuse, and leave *out zeroed. */
static void encoder_rejections(void **state) {
  char reason[WIRE_REASON_LEN];
  wire_msg msg, zero;
  memset(&zero, 0, sizeof zero);

  wire_m1 m1;
  memset(&m1, 0, sizeof m1);
  strcpy(m1.endpoint, "10.0.0.2");
  m1.dst_port = 41235;
  strcpy(m1.session, "10.0.0.2:15001");
  assert_int_equal(kvf__wire_m1_encode(&m1, &msg, reason), 0);
  kvf__wire_msg_free(&msg);
  m1.dst_port = 0;
  assert_int_equal(kvf__wire_m1_encode(&m1, &msg, reason), KVF_EINVAL);
  assert_string_equal(reason, "M1 frame 2 (dst_port): 0 is not a port (1..65535)");
  assert_memory_equal(&msg, &zero, sizeof msg);
  m1.dst_port = 1;
  strcpy(m1.session, "10.0.0.2");
  assert_int_equal(kvf__wire_m1_encode(&m1, &msg, reason), KVF_EINVAL);
  assert_string_equal(reason, "M1 frame 3 (session_id): \"10.0.0.2\" is not \"host:port\"");
  strcpy(m1.session, "h:1");
  m1.endpoint[0] = '\0';
  assert_int_equal(kvf__wire_m1_encode(&m1, &msg, reason), KVF_EINVAL);
  assert_string_equal(reason, "M1 frame 1 (endpoint): empty");
  memset(m1.endpoint, 'x', sizeof m1.endpoint); /* unterminated: 256 bytes */
  assert_int_equal(kvf__wire_m1_encode(&m1, &msg, reason), KVF_EINVAL);
  strcpy(m1.endpoint, "e");
  m1.kv_ptrs.count = 2; /* no data */
  assert_int_equal(kvf__wire_m1_encode(&m1, &msg, reason), KVF_EINVAL);
  assert_string_equal(reason, "M1 frame 4 (dst_kv_ptrs): 2 entries but no data");
  m1.kv_ptrs.count = 0;
  m1.decode_prefix_len = -1;
  assert_int_equal(kvf__wire_m1_encode(&m1, &msg, reason), KVF_EINVAL);

  wire_m2 m2;
  m2_fill_a4(&m2);
  m2.required_dst_info_num = 0;
  assert_int_equal(kvf__wire_m2_encode(&m2, &msg, reason), KVF_EINVAL);
  assert_string_equal(reason, "M2 frame 6 (required_dst_info_num): 0 is outside 1..65536");
  m2.required_dst_info_num = 1;
  static const uint8_t bad_mask[3] = {1, 7, 0};
  m2.page_mask = wire_array_of(bad_mask, 3);
  assert_int_equal(kvf__wire_m2_encode(&m2, &msg, reason), KVF_EINVAL);
  assert_string_equal(reason, "M2 frame 9 (dst_page_transfer_mask): entry 1 is 0x07, a bool must be 0x00 or 0x01");
  assert_memory_equal(&msg, &zero, sizeof msg);
  m2.page_mask = wire_array_of(NULL, 0);
  m2.indices_are_local = 2;
  assert_int_equal(kvf__wire_m2_encode(&m2, &msg, reason), KVF_EINVAL);
  m2.indices_are_local = 0;
  m2.decode_prefix_len = -5;
  assert_int_equal(kvf__wire_m2_encode(&m2, &msg, reason), KVF_EINVAL);
  m2.decode_prefix_len = 0;
  wire_fragment fr = frag_example_struct;
  fr.buffer_kind = 9;
  m2.frags = &fr;
  m2.nfrags = 1;
  assert_int_equal(kvf__wire_m2_encode(&m2, &msg, reason), KVF_EINVAL);
  assert_string_equal(reason, "M2 frame 13 (fragments): fragment 0: buffer_kind is unknown");
  assert_memory_equal(&msg, &zero, sizeof msg);
  fr = frag_example_struct;
  fr.page_count = -2;
  assert_int_equal(kvf__wire_m2_encode(&m2, &msg, reason), KVF_EINVAL);
  /* A valid plan with a bad page layout: the plan JSON was already built
   * and must be freed on the error path (LeakSanitizer in `make asan`). */
  fr = frag_example_struct;
  m2.page_layout = -1;
  assert_int_equal(kvf__wire_m2_encode(&m2, &msg, reason), KVF_EINVAL);
  assert_string_equal(reason, "M2 frame 14 (kvferry_page_layout): -1 is outside 0..1048576");
  assert_memory_equal(&msg, &zero, sizeof msg);
  m2.page_layout = 0;
  /* A dummy ignores its array fields. */
  m2.is_dummy = 1;
  assert_int_equal(kvf__wire_m2_encode(&m2, &msg, reason), 0);
  assert_frames_equal(&msg, a7_frames, 12);
  kvf__wire_msg_free(&msg);

  wire_m3 m3 = {1, 6, 0, -1, {NULL, 0}, NULL, 0, 0};
  assert_int_equal(kvf__wire_m3_encode(&m3, &msg, reason), KVF_EINVAL);
  assert_string_equal(reason, "M3 frame 1 (status): 6 is outside 0..5");
  m3.status = 5;
  m3.bootstrap_token = -2;
  assert_int_equal(kvf__wire_m3_encode(&m3, &msg, reason), KVF_EINVAL);
  m3.bootstrap_token = -1;
  m3.prefill_rank = -1;
  assert_int_equal(kvf__wire_m3_encode(&m3, &msg, reason), KVF_EINVAL);
  m3.prefill_rank = 0;
  m3.candidates.count = 1;
  assert_int_equal(kvf__wire_m3_encode(&m3, &msg, reason), KVF_EINVAL);
}

static void m1_dup_outlives_frames(void **state) {
  uint8_t *buf = malloc(64);
  memcpy(buf + 3, a3_kv_bytes, 32); /* unaligned source */
  wire_frame f[8];
  memcpy(f, a3_frames, sizeof f);
  f[4] = (wire_frame){buf + 3, 32};
  wire_m1 m, *copy = NULL;
  char reason[WIRE_REASON_LEN];
  assert_int_equal(kvf__wire_m1_decode(f, 8, &m, reason), 0);
  assert_int_equal(kvf__wire_m1_dup(&m, &copy), 0);
  free(buf);
  assert_int_equal(copy->kv_ptrs.count, 4);
  for (size_t i = 0; i < 4; i++) assert_true(wire_u64_at(copy->kv_ptrs, i) == a3_kv_ptrs[i]);
  assert_true(((uintptr_t)copy->kv_ptrs.data & 7) == 0);
  assert_string_equal(copy->endpoint, "10.0.0.2");
  free(copy);
}

/* kvferry frame 15 (issue 16): room options, without and with a plan; a
 * frame of another length reads as absent. */
static void m2_room_options_frame(void **state) {
  wire_m2 m, back;
  char reason[WIRE_REASON_LEN];
  wire_msg msg;
  assert_int_equal(kvf__wire_m2_decode(a4_frames, 12, &m, reason), 0);
  m.room_flags = WIRE_ROOM_VERIFY;
  m.fence_epoch = 0x123456789abcull;
  assert_int_equal(kvf__wire_m2_encode(&m, &msg, reason), 0);
  assert_int_equal(msg.nframes, 16);
  assert_int_equal(msg.frames[12].len, 0); /* no plan: the reference reads "no plan" */
  assert_int_equal(msg.frames[13].len, 0);
  assert_int_equal(msg.frames[14].len, 0);
  assert_int_equal(msg.frames[15].len, 16);
  assert_int_equal(kvf__wire_m2_decode(msg.frames, msg.nframes, &back, reason), 0);
  assert_int_equal(back.nfrags, 0);
  assert_int_equal(back.page_layout, 0);
  assert_true(back.room_flags == WIRE_ROOM_VERIFY && back.fence_epoch == 0x123456789abcull);
  wire_frame f[16];
  memcpy(f, msg.frames, sizeof f);
  f[15].len = 15;
  assert_int_equal(kvf__wire_m2_decode(f, 16, &back, reason), 0);
  assert_true(back.room_flags == 0 && back.fence_epoch == 0);
  kvf__wire_msg_free(&msg);
  kvf__wire_m2_free(&m);
  /* With a plan and a page layout. */
  m2_base_init();
  m2_base[14] = (wire_frame)FR("16");
  assert_int_equal(kvf__wire_m2_decode(m2_base, 15, &m, reason), 0);
  m.fence_epoch = 7;
  assert_int_equal(kvf__wire_m2_encode(&m, &msg, reason), 0);
  assert_int_equal(msg.nframes, 16);
  assert_int_equal(kvf__wire_m2_decode(msg.frames, msg.nframes, &back, reason), 0);
  assert_int_equal(back.nfrags, 1);
  assert_int_equal(back.page_layout, 16);
  assert_true(back.fence_epoch == 7 && back.room_flags == 0);
  kvf__wire_m2_free(&back);
  kvf__wire_msg_free(&msg);
  kvf__wire_m2_free(&m);
}

static void digests_and_fence_messages(void **state) {
  wire_digest e[2] = {{0x1000, 64, 1, 0, 0xdeadbeefull}, {0x2000, 16, 4, 32, 42}};
  wire_digests d = {.room = -5, .prefill_rank = 3, .epoch = 99, .entries = wire_array_of(e, 2)}, back;
  wire_msg msg;
  char reason[WIRE_REASON_LEN];
  assert_int_equal(kvf__wire_digests_encode(&d, &msg, reason), 0);
  assert_true(kvf__wire_is_digests(msg.frames, msg.nframes));
  assert_false(kvf__wire_is_fence(msg.frames, msg.nframes));
  assert_int_equal(kvf__wire_classify(msg.frames, msg.nframes),
                   WIRE_MSG_M2); /* a tokenspeed prefill would reject it */
  assert_int_equal(kvf__wire_digests_decode(msg.frames, msg.nframes, &back, reason), 0);
  assert_int_equal(back.room, -5);
  assert_int_equal(back.prefill_rank, 3);
  assert_true(back.epoch == 99);
  assert_int_equal(back.entries.count, 2);
  wire_digest x = wire_digest_at(back.entries, 1);
  assert_true(x.dst == 0x2000 && x.len == 16 && x.count == 4 && x.stride == 32 && x.hash == 42);
  wire_frame f[5];
  memcpy(f, msg.frames, sizeof f);
  f[4].len = 41; /* not a whole number of entries */
  assert_int_equal(kvf__wire_digests_decode(f, 5, &back, reason), KVF_EPROTO);
  e[0].count = 0;
  f[4].len = 80;
  assert_int_equal(kvf__wire_digests_decode(f, 5, &back, reason), KVF_EPROTO);
  assert_non_null(strstr(reason, "zero count"));
  kvf__wire_msg_free(&msg);

  wire_fence fe = {.room = 12, .epoch = 5}, fb;
  snprintf(fe.session, sizeof fe.session, "10.0.0.1:1234");
  snprintf(fe.reason, sizeof fe.reason, "Request 12 timed out\x01");
  assert_int_equal(kvf__wire_fence_encode(&fe, &msg, reason), 0);
  assert_true(kvf__wire_is_fence(msg.frames, msg.nframes));
  assert_int_equal(kvf__wire_fence_decode(msg.frames, msg.nframes, &fb, reason), 0);
  assert_int_equal(fb.room, 12);
  assert_true(fb.epoch == 5);
  assert_string_equal(fb.session, "10.0.0.1:1234");
  assert_string_equal(fb.reason, "Request 12 timed out?"); /* non-printable bytes shown as '?' */
  memcpy(f, msg.frames, sizeof f);
  f[3] = (wire_frame)FR("0"); /* epoch 0 is never valid */
  assert_int_equal(kvf__wire_fence_decode(f, 5, &fb, reason), KVF_EPROTO);
  kvf__wire_msg_free(&msg);
  fe.epoch = 0;
  assert_int_equal(kvf__wire_fence_encode(&fe, &msg, reason), KVF_EINVAL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(m1_golden_encode),
      cmocka_unit_test(m1_golden_decode),
      cmocka_unit_test(m1_frame_count_forms),
      cmocka_unit_test(m1_dup_outlives_frames),
      cmocka_unit_test(m2_golden_encode),
      cmocka_unit_test(m2_golden_decode),
      cmocka_unit_test(m2_dummy_golden),
      cmocka_unit_test(m2_dummy_ignores_tail),
      cmocka_unit_test(m2_zero_pages_not_dummy),
      cmocka_unit_test(m2_frame_count_forms),
      cmocka_unit_test(m2_features_frame),
      cmocka_unit_test(m2_roundtrip_full),
      cmocka_unit_test(m2_int64_room_bounds),
      cmocka_unit_test(m2_fragments_golden),
      cmocka_unit_test(frag_example_format),
      cmocka_unit_test(frag_example_parse),
      cmocka_unit_test(frag_parse_order_and_spacing),
      cmocka_unit_test(m3_golden),
      cmocka_unit_test(m3_failed_golden),
      cmocka_unit_test(m3_fence_epoch_frame),
      cmocka_unit_test(m3_reason_frame),
      cmocka_unit_test(m3_frame_count_forms),
      cmocka_unit_test(classify_kinds),
      cmocka_unit_test(bad_arguments),
      cmocka_unit_test(m1_rejections),
      cmocka_unit_test(m2_base_is_valid),
      cmocka_unit_test(m2_room_options_frame),
      cmocka_unit_test(digests_and_fence_messages),
      cmocka_unit_test(m2_rejections),
      cmocka_unit_test(fragment_rejections),
      cmocka_unit_test(fragment_bounds),
      cmocka_unit_test(m3_rejections),
      cmocka_unit_test(encoder_rejections),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

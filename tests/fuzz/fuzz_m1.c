/* libFuzzer target for the M1 registration decoder: any input split into
 * frames (fuzz_msg_frames.h) must either be rejected with a reason, or
 * decode, re-encode (8 frames) and decode again to the same fields; inputs
 * already in the canonical 8-frame form must re-encode to the same bytes. */
#include "fuzz_msg_frames.h"

static int m1_equal(const wire_m1 *a, const wire_m1 *b) {
  return !strcmp(a->endpoint, b->endpoint) && a->dst_port == b->dst_port && !strcmp(a->session, b->session) &&
         a->session_port == b->session_port && fuzz_array_eq(a->kv_ptrs, b->kv_ptrs, 8) &&
         fuzz_array_eq(a->aux_ptrs, b->aux_ptrs, 8) && fuzz_array_eq(a->state_ptrs, b->state_ptrs, 8) &&
         a->decode_prefix_len == b->decode_prefix_len;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_frames ff;
  fuzz_split(data, size, &ff);
  wire_m1 m, again, *copy = NULL;
  char reason[WIRE_REASON_LEN] = "";
  int kind = kvf__wire_classify(ff.f, ff.n);
  int rc = kvf__wire_m1_decode(ff.f, ff.n, &m, reason);
  if (rc) {
    FUZZ_CHECK(rc == KVF_EPROTO && fuzz_reason_ok(reason));
    goto out;
  }
  FUZZ_CHECK(kind == WIRE_MSG_M1);
  wire_msg msg;
  FUZZ_CHECK(kvf__wire_m1_encode(&m, &msg, reason) == 0);
  FUZZ_CHECK(msg.nframes == 8);
  FUZZ_CHECK(kvf__wire_m1_decode(msg.frames, msg.nframes, &again, reason) == 0);
  FUZZ_CHECK(m1_equal(&m, &again));
  if (ff.n == 8 && ff.f[7].len) FUZZ_CHECK(fuzz_frames_eq(ff.f, msg.frames, 0, 8));
  FUZZ_CHECK(kvf__wire_m1_dup(&m, &copy) == 0);
  FUZZ_CHECK(m1_equal(&m, copy));
  free(copy);
  kvf__wire_msg_free(&msg);
out:
  fuzz_release(&ff);
  return 0;
}

/* libFuzzer target for the M3 status decoder: rejected with a reason, or
 * decode -> encode (5 frames, 6 with kvferry's reason frame, 7 with its
 * fence-epoch frame) -> decode gives the same fields, and a complete 5-frame
 * input re-encodes to the same bytes. */
#include "fuzz_msg_frames.h"

static int m3_equal(const wire_m3 *a, const wire_m3 *b) {
  return a->room == b->room && a->status == b->status && a->prefill_rank == b->prefill_rank &&
         a->bootstrap_token == b->bootstrap_token && fuzz_array_eq(a->candidates, b->candidates, 4) &&
         a->reason_len == b->reason_len && (!a->reason_len || !memcmp(a->reason, b->reason, a->reason_len)) &&
         a->fence_epoch == b->fence_epoch;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_frames ff;
  fuzz_split(data, size, &ff);
  wire_m3 m, again;
  char reason[WIRE_REASON_LEN] = "";
  int rc = kvf__wire_m3_decode(ff.f, ff.n, &m, reason);
  if (rc) {
    FUZZ_CHECK(rc == KVF_EPROTO && fuzz_reason_ok(reason));
    goto out;
  }
  FUZZ_CHECK(m.status >= 0 && m.status <= 5 && m.bootstrap_token >= -1);
  wire_msg msg;
  FUZZ_CHECK(kvf__wire_m3_encode(&m, &msg, reason) == 0);
  FUZZ_CHECK(msg.nframes == (m.fence_epoch ? 7u : m.reason_len ? 6u : 5u));
  FUZZ_CHECK(kvf__wire_m3_decode(msg.frames, msg.nframes, &again, reason) == 0);
  FUZZ_CHECK(m3_equal(&m, &again));
  if (ff.n == 5) FUZZ_CHECK(fuzz_frames_eq(ff.f, msg.frames, 0, 5));
  kvf__wire_msg_free(&msg);
out:
  fuzz_release(&ff);
  return 0;
}

/* libFuzzer target for kvferry's own control messages (issue 16): the
 * digests (prefill -> decode) and fence (decode -> prefill) decoders. Each
 * input is tried as both: rejected with a reason, or decode -> encode ->
 * decode gives the same fields. */
#include "fuzz_msg_frames.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_frames ff;
  fuzz_split(data, size, &ff);
  char reason[WIRE_REASON_LEN] = "";
  wire_msg msg;
  wire_digests d, d2;
  int rc = kvf__wire_digests_decode(ff.f, ff.n, &d, reason);
  if (rc) {
    FUZZ_CHECK(rc == KVF_EPROTO && fuzz_reason_ok(reason));
  } else {
    FUZZ_CHECK(kvf__wire_is_digests(ff.f, ff.n) && d.entries.count <= WIRE_MAX_DIGESTS);
    for (size_t i = 0; i < d.entries.count; i++) FUZZ_CHECK(wire_digest_at(d.entries, i).count >= 1);
    if (d.epoch <= INT64_MAX) {
      FUZZ_CHECK(kvf__wire_digests_encode(&d, &msg, reason) == 0);
      FUZZ_CHECK(kvf__wire_digests_decode(msg.frames, msg.nframes, &d2, reason) == 0);
      FUZZ_CHECK(d2.room == d.room && d2.prefill_rank == d.prefill_rank && d2.epoch == d.epoch &&
                 fuzz_array_eq(d.entries, d2.entries, WIRE_DIGEST_BYTES));
      kvf__wire_msg_free(&msg);
    }
  }
  wire_fence f, f2;
  rc = kvf__wire_fence_decode(ff.f, ff.n, &f, reason);
  if (rc) {
    FUZZ_CHECK(rc == KVF_EPROTO && fuzz_reason_ok(reason));
  } else {
    FUZZ_CHECK(f.epoch >= 1 && strlen(f.reason) < sizeof f.reason);
    FUZZ_CHECK(kvf__wire_fence_encode(&f, &msg, reason) == 0);
    FUZZ_CHECK(kvf__wire_fence_decode(msg.frames, msg.nframes, &f2, reason) == 0);
    FUZZ_CHECK(f2.room == f.room && f2.epoch == f.epoch && !strcmp(f2.session, f.session));
    FUZZ_CHECK(!strncmp(f2.reason, f.reason, 200));
    kvf__wire_msg_free(&msg);
  }
  fuzz_release(&ff);
  return 0;
}

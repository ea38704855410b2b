/* libFuzzer target for the M2 transfer-request decoder, fragment JSON
 * included: rejected with a reason, or decode -> encode -> decode gives the
 * same fields and fragments; a complete 12/14-frame input re-encodes to the
 * same bytes in frames 0-11 (6 for a dummy, whose tail is never read). */
#include "fuzz_msg_frames.h"

static int frag_equal(const wire_fragment *a, const wire_fragment *b) {
  return a->buffer_index == b->buffer_index && a->buffer_kind == b->buffer_kind && a->src_rank == b->src_rank &&
         a->dst_rank == b->dst_rank && a->src_page_stride_bytes == b->src_page_stride_bytes &&
         a->dst_page_stride_bytes == b->dst_page_stride_bytes && a->src_byte_offset == b->src_byte_offset &&
         a->dst_byte_offset == b->dst_byte_offset && a->bytes_per_page == b->bytes_per_page &&
         a->page_count == b->page_count;
}

static int m2_equal(const wire_m2 *a, const wire_m2 *b) {
  if (a->room != b->room || strcmp(a->endpoint, b->endpoint) || a->dst_port != b->dst_port ||
      strcmp(a->session, b->session) || a->session_port != b->session_port ||
      a->required_dst_info_num != b->required_dst_info_num || a->is_dummy != b->is_dummy ||
      !fuzz_array_eq(a->kv_indices, b->kv_indices, 8) || a->dst_aux_index != b->dst_aux_index ||
      a->decode_prefix_len != b->decode_prefix_len || a->indices_are_local != b->indices_are_local ||
      !fuzz_array_eq(a->page_mask, b->page_mask, 1) || !fuzz_array_eq(a->local_indices, b->local_indices, 8) ||
      !fuzz_array_eq(a->mamba_indices, b->mamba_indices, 8) || a->nfrags != b->nfrags ||
      a->room_flags != b->room_flags || a->fence_epoch != b->fence_epoch)
    return 0;
  for (size_t k = 0; k < a->nfrags; k++)
    if (!frag_equal(&a->frags[k], &b->frags[k])) return 0;
  return 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  fuzz_frames ff;
  fuzz_split(data, size, &ff);
  wire_m2 m, again, *copy = NULL;
  char reason[WIRE_REASON_LEN] = "";
  int kind = kvf__wire_classify(ff.f, ff.n);
  int rc = kvf__wire_m2_decode(ff.f, ff.n, &m, reason);
  if (rc) {
    FUZZ_CHECK((rc == KVF_EPROTO || rc == KVF_ENOMEM) && fuzz_reason_ok(reason));
    goto out;
  }
  FUZZ_CHECK(kind == WIRE_MSG_M2);
  FUZZ_CHECK(!m.is_dummy || (m.kv_indices.count == 0 && m.nfrags == 0));
  wire_msg msg;
  FUZZ_CHECK(kvf__wire_m2_encode(&m, &msg, reason) == 0);
  /* 12 frames; 14 with a plan; 15 when the plan carries kvferry's page
   * layout; 16 with kvferry's room options (frame 15). */
  size_t want = m.nfrags ? (m.page_layout ? 15u : 14u) : 12u;
  if (m.room_flags || m.fence_epoch) want = 16;
  FUZZ_CHECK(msg.nframes == want);
  FUZZ_CHECK(kvf__wire_m2_decode(msg.frames, msg.nframes, &again, reason) == 0);
  FUZZ_CHECK(m2_equal(&m, &again));
  if (m.is_dummy) FUZZ_CHECK(fuzz_frames_eq(ff.f, msg.frames, 0, 7));
  else if (ff.n == 12 || (ff.n == 14 && m.nfrags)) FUZZ_CHECK(fuzz_frames_eq(ff.f, msg.frames, 0, 12));
  FUZZ_CHECK(kvf__wire_m2_dup(&m, &copy) == 0);
  FUZZ_CHECK(m2_equal(&m, copy));
  free(copy);
  kvf__wire_m2_free(&again);
  kvf__wire_msg_free(&msg);
  kvf__wire_m2_free(&m);
out:
  fuzz_release(&ff);
  return 0;
}

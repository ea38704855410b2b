/* Byte-exact codecs for the three tokenspeed ZMQ control messages
 * (docs/PROTOCOL.md §3): M1 registration and M2 transfer request (decode ->
 * prefill), M3 status (prefill -> decode), plus the fragment-plan JSON that
 * rides in M2 frames 12-13 (§6.5.5). Decoders work on the parts of one ZMQ
 * multipart message exactly as received and validate every frame, more
 * strictly than the reference (§8 item 1): a bad message is rejected with a
 * reason naming the frame, never half-parsed. Encoders produce frames ready
 * for zmq_send and apply the same rules, so kvferry never sends what it
 * would itself refuse. Nothing here logs: the caller knows the peer address
 * and decides how often to report it. Pure functions, any thread.
 *
 * Ownership. Decoded array fields are zero-copy views into the caller's
 * frames (valid while those bytes live); read elements with wire_*_at(),
 * which are alignment-safe. Strings are copied into the struct. The only
 * allocation is an M2's fragment array (one per message, only when it has a
 * plan), released by kvf__wire_m2_free(). kvf__wire_m1_dup/kvf__wire_m2_dup make one
 * self-contained heap copy for storing past the frames' lifetime.
 *
 * Strictness beyond the reference, on decode and encode alike:
 * - ascii ints are canonical: optional '-', digits, no leading zeros, no
 *   "-0", no '+' or whitespace, within int64 (Python's str(int) form);
 * - ports 1..65535, status 0..5, counts and page indices >= 0, fan-out 1..
 *   WIRE_MAX_FANOUT, M2 frame 8 exactly 0 or 1, mask bytes exactly 0 or 1;
 * - endpoint and session: 1..255 bytes of printable ASCII without spaces;
 *   the session is "host:port" (split at the last ':');
 * - bounded arrays (WIRE_MAX_*); when frame 8 says the indices are local,
 *   frame 9 has one entry per frame-4 page and frame 10 one per owned page;
 * - a 13-frame M2 whose frame 12 is non-empty is rejected (a truncated plan
 *   would otherwise silently fall back to whole-page writes);
 * - fragment JSON: exactly the ten keys, integers only, no duplicates, a
 *   non-empty array, strides > 0 and offset + bytes_per_page <= stride on
 *   both sides so a fragment cannot spill into the next page. */
#ifndef KVF_WIRE_MESSAGES_H
#define KVF_WIRE_MESSAGES_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "kvferry/common.h"
#include "kvferry/kv.h" /* KVF_POLL_*: the one definition of the values */

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "kvferry wire arrays are native little-endian; big-endian hosts are not supported"
#endif

enum {
  WIRE_STR_MAX = 255,                       /* endpoint / session bytes */
  WIRE_REASON_LEN = 256,                    /* size of a reason buffer */
  WIRE_MAX_PTRS = 4096,                     /* per M1 pointer frame */
  WIRE_MAX_PAGES = 1 << 20,                 /* per M2 index/mask frame */
  WIRE_MAX_FRAGMENTS = 4096,                /* per M2 plan */
  WIRE_MAX_JSON = 1 << 20,                  /* bytes of M2 frame 13 */
  WIRE_MAX_CANDIDATES = KVF_MAX_CANDIDATES, /* per M3 (the public limit) */
  WIRE_MAX_FANOUT = 1 << 16,                /* M2 required_dst_info_num */
  WIRE_MAX_FRAMES = 16,                     /* most frames an encoder emits (14 + kvferry's frames 14-15) */
  WIRE_MAX_PAGE_SIZE = 1 << 20,             /* tokens per page in the kvferry page-layout frame */
  WIRE_FRAGMENT_VERSION = 1,
};

/* Status values of M3 frame 1 (§2.1). */
enum {
  WIRE_STATUS_FAILED = KVF_POLL_FAILED,
  WIRE_STATUS_BOOTSTRAPPING = KVF_POLL_BOOTSTRAPPING,
  WIRE_STATUS_BOOTSTRAPPED = KVF_POLL_BOOTSTRAPPED,
  WIRE_STATUS_WAITING_FOR_INPUT = KVF_POLL_WAITING_FOR_INPUT,
  WIRE_STATUS_TRANSFERRING = KVF_POLL_TRANSFERRING,
  WIRE_STATUS_SUCCESS = KVF_POLL_SUCCESS,
};

/* One part of a multipart message; the bytes belong to the caller. */
typedef struct wire_frame {
  const uint8_t *data; /* may be NULL when len == 0 */
  size_t len;
} wire_frame;

/* A packed little-endian array: `count` elements, element size implied by
 * the field (u64 pointers, i64 indices, i32 candidates, u8 mask). `data`
 * need not be aligned. */
typedef struct wire_array {
  const uint8_t *data;
  size_t count;
} wire_array;

static inline wire_array wire_array_of(const void *p, size_t count) {
  wire_array a = {(const uint8_t *)p, count};
  return a;
}
static inline uint64_t wire_u64_at(wire_array a, size_t i) {
  uint64_t v;
  memcpy(&v, a.data + i * 8, 8);
  return v;
}
static inline int64_t wire_i64_at(wire_array a, size_t i) {
  int64_t v;
  memcpy(&v, a.data + i * 8, 8);
  return v;
}
static inline int32_t wire_i32_at(wire_array a, size_t i) {
  int32_t v;
  memcpy(&v, a.data + i * 4, 4);
  return v;
}

/* ---- message kinds ---- */

enum { WIRE_MSG_M1 = 1, WIRE_MSG_M2 = 2 };

/* For the prefill listener: WIRE_MSG_M1 if frame 0 is exactly "None",
 * WIRE_MSG_M2 otherwise; KVF_EPROTO for a message with no frames. Decides
 * only the kind: the decoder still validates everything. */
int kvf__wire_classify(const wire_frame *frames, size_t nframes);

/* ---- M1 registration (§3.3) ---- */

typedef struct wire_m1 {
  char endpoint[WIRE_STR_MAX + 1]; /* decode local IP (frame 1) */
  uint16_t dst_port;               /* decode ZMQ rank port (frame 2) */
  char session[WIRE_STR_MAX + 1];  /* "ip:port", registration key (frame 3) */
  uint16_t session_port;           /* port part of session */
  wire_array kv_ptrs;              /* u64, frame 4 */
  wire_array aux_ptrs;             /* u64, frame 5 (empty in practice) */
  wire_array state_ptrs;           /* u64, frame 6 of the 8-frame form */
  int64_t decode_prefix_len;       /* >= 0 */
} wire_m1;

/* Decodes 6, 7 or >= 8 frames (§3.3). On success fills *out and returns 0;
 * otherwise returns KVF_EPROTO (bad message) or KVF_EINVAL (bad arguments),
 * leaves *out untouched and writes a reason to `reason` (if not NULL,
 * WIRE_REASON_LEN bytes). */
int kvf__wire_m1_decode(const wire_frame *frames, size_t nframes, wire_m1 *out, char *reason);

/* ---- M2 transfer request (§3.4) ---- */

enum {
  WIRE_KIND_TARGET_K = 0,
  WIRE_KIND_TARGET_V = 1,
  WIRE_KIND_DRAFT_K = 2,
  WIRE_KIND_DRAFT_V = 3,
  WIRE_KIND_MAMBA_STATE = 4,
};
/* "target_k" ... "mamba_state"; NULL for an unknown kind. The one table of
 * kind names. */
const char *kvf__wire_buffer_kind_name(int kind);
/* The kind named `name`, or -1 for an unknown (or NULL) name. */
int kvf__wire_buffer_kind_parse(const char *name);

/* One fragment of a heterogeneous-TP plan (§6.5.5), JSON key order. */
typedef struct wire_fragment {
  int64_t buffer_index;
  int32_t buffer_kind; /* WIRE_KIND_* */
  int64_t src_rank;
  int64_t dst_rank;
  int64_t src_page_stride_bytes;
  int64_t dst_page_stride_bytes;
  int64_t src_byte_offset;
  int64_t dst_byte_offset;
  int64_t bytes_per_page;
  int64_t page_count; /* -1 for JSON null (all pages) */
} wire_fragment;

typedef struct wire_m2 {
  int64_t room;
  char endpoint[WIRE_STR_MAX + 1];
  uint16_t dst_port; /* where M3 goes */
  char session[WIRE_STR_MAX + 1];
  uint16_t session_port;
  int64_t required_dst_info_num; /* 1..WIRE_MAX_FANOUT */
  int is_dummy;                  /* frames 4 and 5 empty; all below zero */
  wire_array kv_indices;         /* i64 >= 0, frame 4 */
  int64_t dst_aux_index;         /* frame 5, any int64 (unused by prefill) */
  int64_t decode_prefix_len;     /* tokens, >= 0, frame 7 (absent = 0) */
  int indices_are_local;         /* frame 8 (absent = 0) */
  wire_array page_mask;          /* u8 0/1, frame 9; empty = none */
  wire_array local_indices;      /* i64 >= 0, frame 10; empty = none */
  wire_array mamba_indices;      /* i64 (negative = skip), frame 11 */
  const wire_fragment *frags;    /* plan of frames 12-13; NULL/0 = none */
  size_t nfrags;
  int frags_owned; /* internal: frags is heap memory kvf__wire_m2_free releases */
  /* kvferry extension, frame 14, sent only next to a plan: the decode's
   * pages are token-major ([token][head][dim]) with this many tokens per
   * page, and the plan's per-page slices are head ranges to be cut per
   * token. 0 = not sent. The reference parser ignores frames past the 14th
   * (§3.4), so a tokenspeed prefill never sees it; on decode, a frame 14
   * that is not an ascii int in 1..WIRE_MAX_PAGE_SIZE reads as 0. */
  int64_t page_layout;
  /* kvferry extension, frame 15 (docs/WIRE-EXTENSIONS.md, issue 16): 16
   * bytes, u64 flags (WIRE_ROOM_*) then u64 fence epoch, little-endian. Sent
   * by a kvferry decode when either is set (frames 12-14 then go out empty
   * if there is no plan / layout); any other length reads as absent. */
  uint64_t room_flags;  /* WIRE_ROOM_VERIFY: send digests of what you write */
  uint64_t fence_epoch; /* != 0: tag every engine write with (room, epoch) */
} wire_m2;

enum {
  WIRE_ROOM_VERIFY = 1,
  WIRE_ROOM_FAST_COMPLETION = 2, /* the decode takes the room's completion from the engine trailer (issue 14) */
};

/* Decodes an M2 (>= 7 frames). On success fills *out (release with
 * kvf__wire_m2_free) and returns 0; on failure as kvf__wire_m1_decode, or KVF_ENOMEM
 * if the fragment array could not be allocated. */
int kvf__wire_m2_decode(const wire_frame *frames, size_t nframes, wire_m2 *out, char *reason);
/* Releases what a decode allocated and zeroes *m; safe on a zeroed struct. */
void kvf__wire_m2_free(wire_m2 *m);

/* Fragment JSON alone (frame 13). Parse: on success *out is a malloc'd array
 * of *n (>= 1) fragments, caller frees; KVF_EPROTO with a reason for a bad
 * plan (outputs untouched). Format: writes the compact JSON of
 * §6.5.5 into a malloc'd NUL-terminated *json of *len bytes, caller frees;
 * KVF_EINVAL for an invalid fragment, KVF_ETOOBIG past WIRE_MAX_JSON. */
int kvf__wire_fragments_parse(const uint8_t *json, size_t len, wire_fragment **out, size_t *n, char *reason);
int kvf__wire_fragments_format(const wire_fragment *frags, size_t n, char **json, size_t *len, char *reason);

/* ---- M3 status (§3.5) ---- */

typedef struct wire_m3 {
  int64_t room;
  int32_t status;          /* WIRE_STATUS_* */
  int64_t prefill_rank;    /* >= 0 */
  int64_t bootstrap_token; /* -1 = none (also when frame 3 is absent) */
  wire_array candidates;   /* i32, frame 4; empty = none */
  /* kvferry frame 5 (docs/WIRE-EXTENSIONS.md): why a Failed status was sent,
   * UTF-8 text, not NUL-terminated; sent only when reason_len > 0, decoded
   * up to WIRE_REASON_LEN - 1 bytes (the rest is cut). Points into the frame. */
  const char *reason;
  size_t reason_len;
  /* kvferry frame 6: the fence epoch of the M2 this M3 answers (its frame
   * 15), 8 bytes little-endian; sent by a kvferry prefill only to a decode
   * that sent one, so the decode can tell an M3 of an earlier use of the
   * room id from one for its current request. 0 = absent (a frame 6 of
   * another length reads as absent). Frame 5 goes out empty when there is
   * an epoch and no reason. */
  uint64_t fence_epoch;
} wire_m3;

/* The M3 Failed reason (frame 5) a kvferry prefill gives a decode whose
 * session it has no registration for (no M1, or dropped from its full
 * table): a kvferry decode that reads it forgets its cached registration
 * with that prefill, so its next request registers again (M1). */
#define WIRE_REASON_UNREGISTERED "decode session not registered with this prefill rank; register again"

/* Decodes 3 or more frames (§3.5); as kvf__wire_m1_decode. */
int kvf__wire_m3_decode(const wire_frame *frames, size_t nframes, wire_m3 *out, char *reason);

/* ---- self-contained copies ---- */

/* One malloc holding the struct and copies of its arrays (and fragments),
 * 8-byte aligned; release with free(*out). KVF_ENOMEM on failure. */
int kvf__wire_m1_dup(const wire_m1 *m, wire_m1 **out);
int kvf__wire_m2_dup(const wire_m2 *m, wire_m2 **out);
/* The same copy into *block, a malloc'd block of *cap bytes (NULL and 0 at
 * first), grown (*block and *cap updated) when short: a recycled block
 * costs no allocation. On error *block still holds its old bytes. */
int kvf__wire_m2_dup_into(const wire_m2 *m, wire_m2 **block, size_t *cap);

/* ---- encoding ---- */

/* Frames ready to send: frames[0..nframes) in order, the last one without
 * ZMQ_SNDMORE. Array frames point at the arrays of the struct that was
 * encoded (which must outlive the send); text frames point into `text`, so
 * a wire_msg must not be copied or moved while its frames are in use.
 * Release with kvf__wire_msg_free (frees the fragment JSON, if any). */
typedef struct wire_msg {
  wire_frame frames[WIRE_MAX_FRAMES];
  size_t nframes;
  char *json;      /* heap: M2 frame 13 */
  size_t text_len; /* bytes of `text` used */
  char text[1024];
} wire_msg;

void kvf__wire_msg_free(wire_msg *m);

/* Encoders validate their input with the decoder's rules and return 0, or
 * KVF_EINVAL (KVF_ETOOBIG / KVF_ENOMEM for the plan JSON) with a reason and
 * *out zeroed. M1: always 8 frames. M2: 12 frames, 14 when nfrags > 0; a
 * dummy (is_dummy) is the 12-frame form of Appendix A.7; 15 with a plan
 * and page_layout > 0. M3: 5 frames, 6 with a reason. */
int kvf__wire_m1_encode(const wire_m1 *m, wire_msg *out, char *reason);
int kvf__wire_m2_encode(const wire_m2 *m, wire_msg *out, char *reason);
int kvf__wire_m3_encode(const wire_m3 *m, wire_msg *out, char *reason);

/* ---- kvferry-only messages (docs/WIRE-EXTENSIONS.md, issue 16) ---- */

enum {
  WIRE_MAX_DIGESTS = 1 << 16, /* entries per digest message */
  WIRE_DIGEST_BYTES = 40,     /* one entry on the wire */
};

/* One digest entry: the XXH3-64 of a (possibly strided) block exactly as
 * the prefill wrote it into the decode's memory: count pieces of len bytes
 * at dst + i*stride (count >= 1). */
typedef struct wire_digest {
  uint64_t dst, len, count, stride, hash;
} wire_digest;
_Static_assert(sizeof(wire_digest) == WIRE_DIGEST_BYTES, "digest entry layout");

/* Prefill -> decode, after the writes the entries describe completed:
 * "kvferry-digests", room, prefill_rank, fence epoch (ascii ints), then the
 * entries (packed little-endian). */
typedef struct wire_digests {
  int64_t room;
  int64_t prefill_rank;
  uint64_t epoch;
  wire_array entries; /* wire_digest elements; read with wire_digest_at */
} wire_digests;

/* Decode -> prefill, when the decode failed or dropped a room it asked a
 * kvferry prefill to fence: "kvferry-fence", room, the decode's session,
 * fence epoch, reason (text, at most WIRE_REASON_LEN - 1 bytes). */
typedef struct wire_fence {
  int64_t room;
  char session[WIRE_STR_MAX + 1];
  uint64_t epoch;
  char reason[WIRE_REASON_LEN];
} wire_fence;

static inline wire_digest wire_digest_at(wire_array a, size_t i) {
  wire_digest d;
  memcpy(&d, a.data + i * WIRE_DIGEST_BYTES, sizeof d);
  return d;
}

/* Frame 0 names the kind: 1 when it is "kvferry-digests" / "kvferry-fence". */
int kvf__wire_is_digests(const wire_frame *frames, size_t nframes);
int kvf__wire_is_fence(const wire_frame *frames, size_t nframes);
/* As the M-codecs: 0, or KVF_EPROTO / KVF_EINVAL with a reason. The
 * digests' entries frame stays a view into the caller's frame (encode:
 * into the caller's array, which must outlive the send). */
int kvf__wire_digests_decode(const wire_frame *frames, size_t nframes, wire_digests *out, char *reason);
int kvf__wire_digests_encode(const wire_digests *m, wire_msg *out, char *reason);
int kvf__wire_fence_decode(const wire_frame *frames, size_t nframes, wire_fence *out, char *reason);
int kvf__wire_fence_encode(const wire_fence *m, wire_msg *out, char *reason);

#endif

/* M1/M2/M3 codecs and the fragment-plan JSON (see messages.h for the API,
 * ownership and the rules beyond the reference). Decoding parses each frame
 * into a local struct, then runs the same field validators the encoders
 * use, and copies the struct out only when everything passed: a caller
 * never sees half-parsed state, and what we send always passes our own
 * decoder. Reasons name the message, the frame index and its spec name,
 * because that is what an operator needs to find the misbehaving peer. */
#include "wire/messages.h"

#include <inttypes.h>
#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#include "base/addr.h"
#include "base/parse.h"

_Static_assert(sizeof(wire_fragment) % 8 == 0, "fragments pack in dup blocks");

static const char *const m1_names[] = {"room",        "endpoint",     "dst_port",       "session_id",
                                       "dst_kv_ptrs", "dst_aux_ptrs", "dst_state_ptrs", "decode_prefix_len"};
static const char *const m2_names[] = {"room",
                                       "endpoint",
                                       "dst_port",
                                       "session_id",
                                       "dst_kv_indices",
                                       "dst_aux_index",
                                       "required_dst_info_num",
                                       "decode_prefix_len",
                                       "dst_indices_are_local",
                                       "dst_page_transfer_mask",
                                       "dst_page_local_indices",
                                       "dst_mamba_indices",
                                       "plan_version",
                                       "fragments",
                                       "kvferry_page_layout",
                                       "kvferry_room_options"};
static const char *const m3_names[] = {"room",
                                       "status",
                                       "prefill_rank",
                                       "bootstrap_token",
                                       "spec_candidate_ids",
                                       "kvferry_reason",
                                       "kvferry_fence_epoch"};

static const char *const kind_names[] = {"target_k", "target_v", "draft_k", "draft_v", "mamba_state"};

/* Where a check happens, so every rejection reads "M2 frame 4 (name): ...". */
typedef struct ctx {
  const char *msg; /* "M1", "M2", "M3" */
  const char *const *names;
  const wire_frame *f;
  char *reason;
  int err; /* code returned for a failed check: EPROTO decoding, EINVAL encoding */
} ctx;

static void vwhy(char *reason, const char *fmt, va_list ap) {
  if (reason) vsnprintf(reason, WIRE_REASON_LEN, fmt, ap);
}

static void why(char *reason, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void why(char *reason, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vwhy(reason, fmt, ap);
  va_end(ap);
}

/* Failed check on frame `i`: "<msg> frame <i> (<name>): <detail>". */
static int bad(const ctx *c, size_t i, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static int bad(const ctx *c, size_t i, const char *fmt, ...) {
  if (c->reason) {
    int used = snprintf(c->reason, WIRE_REASON_LEN, "%s frame %zu (%s): ", c->msg, i, c->names[i]);
    if (used > 0 && used < WIRE_REASON_LEN) {
      va_list ap;
      va_start(ap, fmt);
      vsnprintf(c->reason + used, (size_t)(WIRE_REASON_LEN - used), fmt, ap);
      va_end(ap);
    }
  }
  return c->err;
}

/* Quotes up to 24 bytes of peer input for a reason, escaping what is not
 * printable so a log line cannot be forged or broken. */
static const char *quote(const uint8_t *p, size_t len, char buf[128]) {
  size_t o = 0;
  buf[o++] = '"';
  for (size_t i = 0; i < len && i < 24; i++) {
    uint8_t ch = p[i];
    if (ch >= 0x20 && ch < 0x7f && ch != '"' && ch != '\\') buf[o++] = (char)ch;
    else o += (size_t)snprintf(buf + o, 5, "\\x%02x", ch);
  }
  buf[o++] = '"';
  if (len > 24) {
    memcpy(buf + o, "...", 3);
    o += 3;
  }
  buf[o] = '\0';
  return buf;
}

/* ---- ascii ints ---- */

/* Frame i as an ascii int in [lo, hi]. */
static int get_int(const ctx *c, size_t i, int64_t lo, int64_t hi, int64_t *out) {
  const wire_frame *f = &c->f[i];
  char q[128];
  int64_t v = 0;
  switch (kvf__parse_i64((const char *)f->data, f->len, KVF_INT_CANONICAL, &v)) {
    case KVF_INT_OK: break;
    case KVF_INT_EMPTY: return bad(c, i, "empty, expected an ascii int");
    case KVF_INT_NONCANON:
      return bad(c, i, "%s is not a canonical ascii int (leading zero or -0)", quote(f->data, f->len, q));
    case KVF_INT_RANGE: return bad(c, i, "%s does not fit in int64", quote(f->data, f->len, q));
    default: return bad(c, i, "%s is not an ascii int", quote(f->data, f->len, q));
  }
  if (v < lo || v > hi) return bad(c, i, "%" PRId64 " is outside %" PRId64 "..%" PRId64, v, lo, hi);
  *out = v;
  return 0;
}

/* ---- shared field validators (decode and encode) ---- */

/* Endpoints and sessions become table keys, log text and connect strings. */
static int check_text(const ctx *c, size_t i, const uint8_t *p, size_t len) {
  char q[128];
  if (len == 0) return bad(c, i, "empty");
  if (len > WIRE_STR_MAX) return bad(c, i, "%zu bytes, at most %d allowed", len, WIRE_STR_MAX);
  for (size_t k = 0; k < len; k++)
    if (p[k] <= 0x20 || p[k] >= 0x7f)
      return bad(c, i, "%s: byte %zu is not printable ASCII (or is a space)", quote(p, len, q), k);
  return 0;
}

/* "host:port" by the library's one address parser (base/addr.h). */
static int check_session(const ctx *c, size_t i, const uint8_t *p, size_t len, uint16_t *port) {
  char q[128];
  int rc = check_text(c, i, p, len);
  if (rc) return rc;
  const char *what;
  if (kvf__addr_parse((const char *)p, len, NULL, 0, port, &what))
    return bad(c, i, "%s %s", quote(p, len, q), what);
  return 0;
}

static int check_port(const ctx *c, size_t i, int64_t v) {
  if (v < 1 || v > 65535) return bad(c, i, "%" PRId64 " is not a port (1..65535)", v);
  return 0;
}

static int check_nonneg_i64(const ctx *c, size_t i, wire_array a) {
  for (size_t k = 0; k < a.count; k++) {
    int64_t v = wire_i64_at(a, k);
    if (v < 0) return bad(c, i, "entry %zu is %" PRId64 ", must be >= 0", k, v);
  }
  return 0;
}

/* Frame i as a packed array of `elem`-byte entries, at most `max` of them. */
static int get_array(const ctx *c, size_t i, size_t elem, size_t max, wire_array *out) {
  const wire_frame *f = &c->f[i];
  if (f->len % elem) return bad(c, i, "length %zu is not a multiple of %zu", f->len, elem);
  if (f->len / elem > max) return bad(c, i, "%zu entries, at most %zu allowed", f->len / elem, max);
  out->data = f->len ? f->data : NULL;
  out->count = f->len / elem;
  return 0;
}

static int check_count(const ctx *c, size_t i, wire_array a, size_t max) {
  if (a.count > max) return bad(c, i, "%zu entries, at most %zu allowed", a.count, max);
  if (a.count && !a.data) return bad(c, i, "%zu entries but no data", a.count);
  return 0;
}

/* Everything about an M2 that does not depend on how it was framed. */
static int check_m2_body(const ctx *c, const wire_m2 *m) {
  int rc;
  if ((rc = check_count(c, 4, m->kv_indices, WIRE_MAX_PAGES))) return rc;
  if ((rc = check_count(c, 9, m->page_mask, WIRE_MAX_PAGES))) return rc;
  if ((rc = check_count(c, 10, m->local_indices, WIRE_MAX_PAGES))) return rc;
  if ((rc = check_count(c, 11, m->mamba_indices, WIRE_MAX_PAGES))) return rc;
  if ((rc = check_nonneg_i64(c, 4, m->kv_indices))) return rc;
  if (m->decode_prefix_len < 0) return bad(c, 7, "%" PRId64 " is negative", m->decode_prefix_len);
  if (m->indices_are_local != 0 && m->indices_are_local != 1)
    return bad(c, 8, "%d is not 0 or 1", m->indices_are_local);
  size_t owned = 0;
  for (size_t k = 0; k < m->page_mask.count; k++) {
    uint8_t b = m->page_mask.data[k];
    if (b > 1) return bad(c, 9, "entry %zu is 0x%02x, a bool must be 0x00 or 0x01", k, b);
    owned += b;
  }
  /* The mask is indexed with frame-4 positions and frame 10 with the owned
   * positions (§6.3); mismatched lengths would read past either array. */
  if (m->page_mask.count && m->page_mask.count != m->kv_indices.count)
    return bad(c, 9, "%zu entries, frame 4 has %zu pages", m->page_mask.count, m->kv_indices.count);
  if (m->indices_are_local) {
    if (m->page_mask.count != m->kv_indices.count)
      return bad(c, 9, "%zu entries, frame 8 says indices are local and frame 4 has %zu pages", m->page_mask.count,
                 m->kv_indices.count);
    if (m->local_indices.count != owned)
      return bad(c, 10, "%zu entries, frame 9 marks %zu pages as owned", m->local_indices.count, owned);
  }
  if ((rc = check_nonneg_i64(c, 10, m->local_indices))) return rc;
  return 0;
}

/* ---- fragments ---- */

const char *kvf__wire_buffer_kind_name(int kind) {
  if (kind < 0 || kind > WIRE_KIND_MAMBA_STATE) return NULL;
  return kind_names[kind];
}

int kvf__wire_buffer_kind_parse(const char *name) {
  for (int kind = 0; name && kind <= WIRE_KIND_MAMBA_STATE; kind++)
    if (!strcmp(name, kind_names[kind])) return kind;
  return -1;
}

/* Commas one fragment brings to its list: 9 between its 10 keys, 1 before
 * the next fragment; one more of slack. */
#define WIRE_FRAG_VALUES 11
static const char *const frag_keys[10] = {"buffer_index",    "buffer_kind",           "src_rank",
                                          "dst_rank",        "src_page_stride_bytes", "dst_page_stride_bytes",
                                          "src_byte_offset", "dst_byte_offset",       "bytes_per_page",
                                          "page_count"};

/* A fragment must stay inside one page on both sides: the prefill trusts it
 * to address decode memory (§6.5.6). */
static int check_fragment(const wire_fragment *f, size_t k, const char *pre, char *reason, int err) {
  const char *what = NULL;
  if (f->buffer_index < 0 || f->buffer_index >= WIRE_MAX_PTRS) what = "buffer_index is outside 0..4095";
  else if (!kvf__wire_buffer_kind_name(f->buffer_kind)) what = "buffer_kind is unknown";
  else if (f->src_rank < 0 || f->src_rank > INT32_MAX || f->dst_rank < 0 || f->dst_rank > INT32_MAX)
    what = "src_rank/dst_rank is outside 0..2^31-1";
  else if (f->src_page_stride_bytes <= 0 || f->dst_page_stride_bytes <= 0) what = "a page stride is not positive";
  else if (f->bytes_per_page <= 0) what = "bytes_per_page is not positive";
  else if (f->src_byte_offset < 0 || f->dst_byte_offset < 0) what = "a byte offset is negative";
  else if (f->src_byte_offset > f->src_page_stride_bytes ||
           f->bytes_per_page > f->src_page_stride_bytes - f->src_byte_offset)
    what = "src_byte_offset + bytes_per_page exceeds src_page_stride_bytes";
  else if (f->dst_byte_offset > f->dst_page_stride_bytes ||
           f->bytes_per_page > f->dst_page_stride_bytes - f->dst_byte_offset)
    what = "dst_byte_offset + bytes_per_page exceeds dst_page_stride_bytes";
  else if (f->page_count < -1) what = "page_count is negative";
  if (!what) return 0;
  why(reason, "%sfragment %zu: %s", pre, k, what);
  return err;
}

static int parse_fragments(const uint8_t *json, size_t len, wire_fragment **out, size_t *n, const char *pre,
                           char *reason) {
  int rc = KVF_EPROTO;
  json_t *root = NULL;
  wire_fragment *frags = NULL;
  if (len == 0) {
    why(reason, "%sempty", pre);
    goto err;
  }
  if (len > WIRE_MAX_JSON) {
    why(reason, "%s%zu bytes, at most %d allowed", pre, len, WIRE_MAX_JSON);
    goto err;
  }
  /* What the parse would allocate is bounded before it runs (it takes tens
   * of bytes per JSON value): a fragment is one object of 10 integers, so a
   * list of at most WIRE_MAX_FRAGMENTS holds at most that many '{' and
   * WIRE_FRAG_VALUES times that many ','. */
  size_t braces = 0, commas = 0;
  for (size_t i = 0; i < len; i++) braces += json[i] == '{', commas += json[i] == ',';
  if (braces > WIRE_MAX_FRAGMENTS) {
    why(reason, "%s%zu fragments, at most %d allowed", pre, braces, WIRE_MAX_FRAGMENTS);
    goto err;
  }
  if (commas > (size_t)WIRE_MAX_FRAGMENTS * WIRE_FRAG_VALUES) {
    why(reason, "%s%zu values, more than %d fragments hold", pre, commas + 1, WIRE_MAX_FRAGMENTS);
    goto err;
  }
  json_error_t jerr;
  root = json_loadb((const char *)json, len, JSON_REJECT_DUPLICATES, &jerr);
  if (!root) {
    why(reason, "%sinvalid JSON at byte %d: %s", pre, jerr.position, jerr.text);
    goto err;
  }
  if (!json_is_array(root)) {
    why(reason, "%snot a JSON array", pre);
    goto err_free_json;
  }
  size_t cnt = json_array_size(root);
  if (cnt == 0) {
    why(reason, "%sempty fragment list (send no plan frames instead)", pre);
    goto err_free_json;
  }
  if (cnt > WIRE_MAX_FRAGMENTS) {
    why(reason, "%s%zu fragments, at most %d allowed", pre, cnt, WIRE_MAX_FRAGMENTS);
    goto err_free_json;
  }
  frags = calloc(cnt, sizeof *frags);
  if (!frags) {
    rc = KVF_ENOMEM;
    why(reason, "%sout of memory for %zu fragments", pre, cnt);
    goto err_free_json;
  }
  for (size_t k = 0; k < cnt; k++) {
    json_t *o = json_array_get(root, k);
    wire_fragment *f = &frags[k];
    if (!json_is_object(o)) {
      why(reason, "%sfragment %zu is not a JSON object", pre, k);
      goto err_free_frags;
    }
    int64_t v[10];
    for (int key = 0; key < 10; key++) {
      json_t *val = json_object_get(o, frag_keys[key]);
      if (!val) {
        why(reason, "%sfragment %zu: missing key \"%s\"", pre, k, frag_keys[key]);
        goto err_free_frags;
      }
      if (key == 1) {
        v[1] = kvf__wire_buffer_kind_parse(json_string_value(val));
        if (v[1] < 0) {
          why(reason, "%sfragment %zu: buffer_kind is not a known kind string", pre, k);
          goto err_free_frags;
        }
      } else if (key == 9 && json_is_null(val)) {
        v[9] = -1;
      } else if (!json_is_integer(val)) {
        why(reason, "%sfragment %zu: \"%s\" is not an integer", pre, k, frag_keys[key]);
        goto err_free_frags;
      } else {
        v[key] = (int64_t)json_integer_value(val);
        if (key == 9 && v[9] < 0) {
          why(reason, "%sfragment %zu: page_count is negative", pre, k);
          goto err_free_frags;
        }
      }
    }
    /* All ten keys are present and duplicates were refused, so a larger
     * object carries a key this version does not define. */
    if (json_object_size(o) != 10) {
      const char *key;
      json_t *val;
      json_object_foreach(o, key, val) {
        int known = 0;
        for (int j = 0; j < 10; j++) known |= !strcmp(key, frag_keys[j]);
        if (!known) {
          char q[128];
          why(reason, "%sfragment %zu: unknown key %s", pre, k, quote((const uint8_t *)key, strlen(key), q));
          break;
        }
      }
      goto err_free_frags;
    }
    f->buffer_index = v[0];
    f->buffer_kind = (int32_t)v[1];
    f->src_rank = v[2];
    f->dst_rank = v[3];
    f->src_page_stride_bytes = v[4];
    f->dst_page_stride_bytes = v[5];
    f->src_byte_offset = v[6];
    f->dst_byte_offset = v[7];
    f->bytes_per_page = v[8];
    f->page_count = v[9];
    if (check_fragment(f, k, pre, reason, KVF_EPROTO)) goto err_free_frags;
  }
  json_decref(root);
  *out = frags;
  *n = cnt;
  return 0;

err_free_frags:
  free(frags);
err_free_json:
  json_decref(root);
err:
  return rc;
}

int kvf__wire_fragments_parse(const uint8_t *json, size_t len, wire_fragment **out, size_t *n, char *reason) {
  if (!out || !n || (len && !json)) {
    why(reason, "fragments: invalid arguments");
    return KVF_EINVAL;
  }
  return parse_fragments(json, len, out, n, "", reason);
}

/* Longest text of one fragment: ten keys and punctuation (~200 bytes) plus
 * nine numbers of at most 20 characters. */
enum { FRAG_TEXT_MAX = 512 };

static int format_fragments(const wire_fragment *frags, size_t n, char **json, size_t *len, const char *pre,
                            char *reason) {
  if (n == 0 || n > WIRE_MAX_FRAGMENTS || !frags) {
    why(reason, "%s%zu fragments, need 1..%d", pre, n, WIRE_MAX_FRAGMENTS);
    return KVF_EINVAL;
  }
  for (size_t k = 0; k < n; k++) {
    int rc = check_fragment(&frags[k], k, pre, reason, KVF_EINVAL);
    if (rc) return rc;
  }
  size_t cap = n * FRAG_TEXT_MAX + 3;
  char *buf = malloc(cap);
  if (!buf) {
    why(reason, "%sout of memory", pre);
    return KVF_ENOMEM;
  }
  size_t o = 0;
  buf[o++] = '[';
  for (size_t k = 0; k < n; k++) {
    const wire_fragment *f = &frags[k];
    char pc[24] = "null";
    if (f->page_count >= 0) snprintf(pc, sizeof pc, "%" PRId64, f->page_count);
    o += (size_t)snprintf(buf + o, cap - o,
                          "%s{\"buffer_index\":%" PRId64 ",\"buffer_kind\":\"%s\",\"src_rank\":%" PRId64
                          ",\"dst_rank\":%" PRId64 ",\"src_page_stride_bytes\":%" PRId64
                          ",\"dst_page_stride_bytes\":%" PRId64 ",\"src_byte_offset\":%" PRId64
                          ",\"dst_byte_offset\":%" PRId64 ",\"bytes_per_page\":%" PRId64 ",\"page_count\":%s}",
                          k ? "," : "", f->buffer_index, kind_names[f->buffer_kind], f->src_rank, f->dst_rank,
                          f->src_page_stride_bytes, f->dst_page_stride_bytes, f->src_byte_offset,
                          f->dst_byte_offset, f->bytes_per_page, pc);
  }
  buf[o++] = ']';
  buf[o] = '\0';
  if (o > WIRE_MAX_JSON) {
    free(buf);
    why(reason, "%s%zu bytes of JSON, at most %d allowed", pre, o, WIRE_MAX_JSON);
    return KVF_ETOOBIG;
  }
  *json = buf;
  *len = o;
  return 0;
}

int kvf__wire_fragments_format(const wire_fragment *frags, size_t n, char **json, size_t *len, char *reason) {
  if (!json || !len) {
    why(reason, "fragments: invalid arguments");
    return KVF_EINVAL;
  }
  return format_fragments(frags, n, json, len, "", reason);
}

/* ---- decoding ---- */

static int frame_is(const wire_frame *f, const char *s) {
  size_t n = strlen(s);
  return f->len == n && (n == 0 || !memcmp(f->data, s, n));
}

/* NULL frames or a NULL data pointer with a length are caller bugs. */
static int check_args(const char *msg, const wire_frame *frames, size_t nframes, const void *out, char *reason) {
  if (!out || (nframes && !frames)) {
    why(reason, "%s: invalid arguments", msg);
    return KVF_EINVAL;
  }
  for (size_t i = 0; i < nframes; i++)
    if (frames[i].len && !frames[i].data) {
      why(reason, "%s: frame %zu has a length but no data", msg, i);
      return KVF_EINVAL;
    }
  return 0;
}

static void copy_text(char *dst, const wire_frame *f) {
  memcpy(dst, f->data, f->len);
  dst[f->len] = '\0';
}

/* Frames 1..3 of M1 and M2: endpoint, dst_port, session ("ip:port"). */
static int get_peer_fields(const ctx *c, char *endpoint, uint16_t *dst_port, char *session,
                           uint16_t *session_port) {
  const wire_frame *f = c->f;
  int64_t v;
  int rc;
  if ((rc = check_text(c, 1, f[1].data, f[1].len))) return rc;
  copy_text(endpoint, &f[1]);
  if ((rc = get_int(c, 2, 1, 65535, &v))) return rc;
  *dst_port = (uint16_t)v;
  if ((rc = check_session(c, 3, f[3].data, f[3].len, session_port))) return rc;
  copy_text(session, &f[3]);
  return 0;
}

int kvf__wire_classify(const wire_frame *frames, size_t nframes) {
  if (nframes == 0 || !frames) return KVF_EPROTO;
  if (frames[0].len && !frames[0].data) return KVF_EINVAL;
  return frame_is(&frames[0], "None") ? WIRE_MSG_M1 : WIRE_MSG_M2;
}

int kvf__wire_m1_decode(const wire_frame *f, size_t n, wire_m1 *out, char *reason) {
  int rc = check_args("M1", f, n, out, reason);
  if (rc) return rc;
  ctx c = {"M1", m1_names, f, reason, KVF_EPROTO};
  wire_m1 m;
  memset(&m, 0, sizeof m);
  if (n < 6) {
    why(reason, "M1: %zu frames, needs at least 6", n);
    return KVF_EPROTO;
  }
  char q[128];
  if (!frame_is(&f[0], "None")) return bad(&c, 0, "%s, an M1 must carry \"None\"", quote(f[0].data, f[0].len, q));
  if ((rc = get_peer_fields(&c, m.endpoint, &m.dst_port, m.session, &m.session_port))) return rc;
  if ((rc = get_array(&c, 4, 8, WIRE_MAX_PTRS, &m.kv_ptrs))) return rc;
  if ((rc = get_array(&c, 5, 8, WIRE_MAX_PTRS, &m.aux_ptrs))) return rc;
  /* 7 frames is the older form whose frame 6 is the prefix length. */
  size_t prefix_frame = n >= 8 ? 7 : 6;
  if (n >= 8 && (rc = get_array(&c, 6, 8, WIRE_MAX_PTRS, &m.state_ptrs))) return rc;
  if (n >= 7 && f[prefix_frame].len) {
    static const char *const m1_old_names[] = {"room",        "endpoint",     "dst_port",         "session_id",
                                               "dst_kv_ptrs", "dst_aux_ptrs", "decode_prefix_len"};
    ctx c7 = c;
    if (n == 7) c7.names = m1_old_names;
    if ((rc = get_int(&c7, prefix_frame, 0, INT64_MAX, &m.decode_prefix_len))) return rc;
  }
  *out = m;
  return 0;
}

int kvf__wire_m2_decode(const wire_frame *f, size_t n, wire_m2 *out, char *reason) {
  int rc = check_args("M2", f, n, out, reason);
  if (rc) return rc;
  ctx c = {"M2", m2_names, f, reason, KVF_EPROTO};
  wire_m2 m;
  memset(&m, 0, sizeof m);
  int64_t v;
  if (n < 7) {
    why(reason, "M2: %zu frames, needs at least 7", n);
    return KVF_EPROTO;
  }
  if (frame_is(&f[0], "None")) return bad(&c, 0, "\"None\" marks an M1, not an M2");
  if ((rc = get_int(&c, 0, INT64_MIN, INT64_MAX, &m.room))) return rc;
  if ((rc = get_peer_fields(&c, m.endpoint, &m.dst_port, m.session, &m.session_port))) return rc;
  if ((rc = get_int(&c, 6, 1, WIRE_MAX_FANOUT, &m.required_dst_info_num))) return rc;

  /* Dummy: byte-exact empty frames 4 and 5; nothing after frame 6 is read. */
  if (f[4].len == 0 && f[5].len == 0) {
    m.is_dummy = 1;
    *out = m;
    return 0;
  }
  if ((rc = get_array(&c, 4, 8, WIRE_MAX_PAGES, &m.kv_indices))) return rc;
  if (f[5].len == 0) return bad(&c, 5, "empty while frame 4 is not (neither dummy nor real)");
  if ((rc = get_int(&c, 5, INT64_MIN, INT64_MAX, &m.dst_aux_index))) return rc;
  if (n >= 8 && (rc = get_int(&c, 7, 0, INT64_MAX, &m.decode_prefix_len))) return rc;
  if (n >= 9) {
    if ((rc = get_int(&c, 8, 0, 1, &v))) return rc;
    m.indices_are_local = (int)v;
  }
  if (n >= 10 && (rc = get_array(&c, 9, 1, WIRE_MAX_PAGES, &m.page_mask))) return rc;
  if (n >= 11 && (rc = get_array(&c, 10, 8, WIRE_MAX_PAGES, &m.local_indices))) return rc;
  if (n >= 12 && (rc = get_array(&c, 11, 8, WIRE_MAX_PAGES, &m.mamba_indices))) return rc;
  if ((rc = check_m2_body(&c, &m))) return rc;

  if (n == 13 && f[12].len) return bad(&c, 12, "present without frame 13 (fragments): truncated plan");
  if (n >= 14 && (f[12].len || f[13].len)) {
    if (!f[12].len) return bad(&c, 12, "empty while frame 13 is not");
    if (!f[13].len) return bad(&c, 13, "empty while frame 12 is not");
    if ((rc = get_int(&c, 12, INT64_MIN, INT64_MAX, &v))) return rc;
    if (v != WIRE_FRAGMENT_VERSION)
      return bad(&c, 12, "version %" PRId64 " is not supported (expected %d)", v, WIRE_FRAGMENT_VERSION);
    wire_fragment *frags = NULL;
    rc = parse_fragments(f[13].data, f[13].len, &frags, &m.nfrags, "M2 frame 13 (fragments): ", reason);
    if (rc) return rc;
    m.frags = frags;
    m.frags_owned = 1;
    /* kvferry's page layout. Frames past the 14th are the reference's to
     * ignore, so anything that is not a page size reads as absent (and a
     * prefill then refuses a plan that needs it, never guesses). */
    ctx quiet = c;
    quiet.reason = NULL;
    if (n >= 15 && f[14].len && get_int(&quiet, 14, 1, WIRE_MAX_PAGE_SIZE, &m.page_layout)) m.page_layout = 0;
  }
  if (n >= 16 && f[15].len == 16) { /* kvferry room options; another length reads as absent */
    memcpy(&m.room_flags, f[15].data, 8);
    memcpy(&m.fence_epoch, f[15].data + 8, 8);
  }
  *out = m;
  return 0;
}

void kvf__wire_m2_free(wire_m2 *m) {
  if (!m) return;
  if (m->frags_owned) free((void *)m->frags);
  memset(m, 0, sizeof *m);
}

int kvf__wire_m3_decode(const wire_frame *f, size_t n, wire_m3 *out, char *reason) {
  int rc = check_args("M3", f, n, out, reason);
  if (rc) return rc;
  ctx c = {"M3", m3_names, f, reason, KVF_EPROTO};
  wire_m3 m;
  memset(&m, 0, sizeof m);
  int64_t v;
  if (n < 3) {
    why(reason, "M3: %zu frames, needs at least 3", n);
    return KVF_EPROTO;
  }
  if ((rc = get_int(&c, 0, INT64_MIN, INT64_MAX, &m.room))) return rc;
  if ((rc = get_int(&c, 1, WIRE_STATUS_FAILED, WIRE_STATUS_SUCCESS, &v))) return rc;
  m.status = (int32_t)v;
  if ((rc = get_int(&c, 2, 0, INT32_MAX, &m.prefill_rank))) return rc;
  m.bootstrap_token = -1;
  if (n >= 4 && (rc = get_int(&c, 3, -1, INT64_MAX, &m.bootstrap_token))) return rc;
  if (n >= 5 && (rc = get_array(&c, 4, 4, WIRE_MAX_CANDIDATES, &m.candidates))) return rc;
  if (n >= 6 && f[5].len) {
    m.reason = (const char *)f[5].data;
    m.reason_len = f[5].len < WIRE_REASON_LEN - 1 ? f[5].len : WIRE_REASON_LEN - 1;
  }
  if (n >= 7 && f[6].len == 8) memcpy(&m.fence_epoch, f[6].data, 8);
  *out = m;
  return 0;
}

/* ---- copies ---- */

static size_t pad8(size_t n) { return (n + 7) & ~(size_t)7; }

/* Copies array `a` of `elem`-byte entries to *cursor, re-pointing it there. */
static void place(wire_array *a, size_t elem, uint8_t **cursor) {
  size_t bytes = a->count * elem;
  if (bytes) memcpy(*cursor, a->data, bytes);
  a->data = bytes ? *cursor : NULL;
  *cursor += pad8(bytes);
}

int kvf__wire_m1_dup(const wire_m1 *m, wire_m1 **out) {
  if (!m || !out || m->kv_ptrs.count > WIRE_MAX_PTRS || m->aux_ptrs.count > WIRE_MAX_PTRS ||
      m->state_ptrs.count > WIRE_MAX_PTRS)
    return KVF_EINVAL;
  size_t size = pad8(sizeof *m) + 8 * (m->kv_ptrs.count + m->aux_ptrs.count + m->state_ptrs.count);
  wire_m1 *d = malloc(size);
  if (!d) return KVF_ENOMEM;
  *d = *m;
  uint8_t *cur = (uint8_t *)d + pad8(sizeof *m);
  place(&d->kv_ptrs, 8, &cur);
  place(&d->aux_ptrs, 8, &cur);
  place(&d->state_ptrs, 8, &cur);
  *out = d;
  return 0;
}

int kvf__wire_m2_dup(const wire_m2 *m, wire_m2 **out) {
  size_t cap = 0;
  if (out) *out = NULL;
  return kvf__wire_m2_dup_into(m, out, &cap);
}

int kvf__wire_m2_dup_into(const wire_m2 *m, wire_m2 **block, size_t *cap) {
  if (!m || !block || !cap || m->kv_indices.count > WIRE_MAX_PAGES || m->page_mask.count > WIRE_MAX_PAGES ||
      m->local_indices.count > WIRE_MAX_PAGES || m->mamba_indices.count > WIRE_MAX_PAGES ||
      m->nfrags > WIRE_MAX_FRAGMENTS)
    return KVF_EINVAL;
  size_t size = pad8(sizeof *m) + 8 * m->kv_indices.count + pad8(m->page_mask.count) + 8 * m->local_indices.count +
                8 * m->mamba_indices.count + m->nfrags * sizeof(wire_fragment);
  wire_m2 *d = *block;
  if (size > *cap) {
    if (!(d = realloc(*block, size))) return KVF_ENOMEM;
    *block = d, *cap = size;
  }
  *d = *m;
  uint8_t *cur = (uint8_t *)d + pad8(sizeof *m);
  place(&d->kv_indices, 8, &cur);
  place(&d->page_mask, 1, &cur);
  place(&d->local_indices, 8, &cur);
  place(&d->mamba_indices, 8, &cur);
  if (m->nfrags) {
    memcpy(cur, m->frags, m->nfrags * sizeof(wire_fragment));
    d->frags = (const wire_fragment *)cur;
  } else {
    d->frags = NULL;
  }
  d->frags_owned = 0; /* lives inside the block: free(d) releases it */
  return 0;
}

/* ---- encoding ---- */

void kvf__wire_msg_free(wire_msg *m) {
  if (!m) return;
  free(m->json);
  memset(m, 0, sizeof *m);
}

static void put_bytes(wire_msg *o, const void *p, size_t len) {
  wire_frame *fr = &o->frames[o->nframes++];
  fr->data = len ? p : NULL;
  fr->len = len;
}

/* Text frames live in o->text; the struct-level limits (two strings of at
 * most 255 bytes, a few 20-digit numbers) keep them well inside it. */
static void put_str(wire_msg *o, const char *s) {
  size_t len = strlen(s);
  char *dst = o->text + o->text_len;
  memcpy(dst, s, len);
  o->text_len += len;
  put_bytes(o, dst, len);
}

static void put_int(wire_msg *o, int64_t v) {
  char *dst = o->text + o->text_len;
  size_t len = kvf__fmt_i64(dst, v); /* snprintf cost ~1 us per M2 or M3 here */
  o->text_len += len;
  put_bytes(o, dst, len);
}

static void put_array(wire_msg *o, wire_array a, size_t elem) { put_bytes(o, a.data, a.count * elem); }

/* A NUL-terminated string field of a struct, with the frame rules. */
static int check_str_field(const ctx *c, size_t i, const char *s, int session, uint16_t *port) {
  size_t len = strnlen(s, WIRE_STR_MAX + 1);
  if (session) return check_session(c, i, (const uint8_t *)s, len, port);
  return check_text(c, i, (const uint8_t *)s, len);
}

/* Frames 1..3 of M1 and M2, as get_peer_fields reads them. */
static int check_peer_fields(const ctx *c, const char *endpoint, int64_t dst_port, const char *session) {
  uint16_t port;
  int rc;
  if ((rc = check_str_field(c, 1, endpoint, 0, NULL))) return rc;
  if ((rc = check_port(c, 2, dst_port))) return rc;
  return check_str_field(c, 3, session, 1, &port);
}

int kvf__wire_m1_encode(const wire_m1 *m, wire_msg *out, char *reason) {
  if (!m || !out) {
    why(reason, "M1: invalid arguments");
    return KVF_EINVAL;
  }
  memset(out, 0, sizeof *out);
  ctx c = {"M1", m1_names, NULL, reason, KVF_EINVAL};
  int rc;
  if ((rc = check_peer_fields(&c, m->endpoint, m->dst_port, m->session))) return rc;
  if ((rc = check_count(&c, 4, m->kv_ptrs, WIRE_MAX_PTRS))) return rc;
  if ((rc = check_count(&c, 5, m->aux_ptrs, WIRE_MAX_PTRS))) return rc;
  if ((rc = check_count(&c, 6, m->state_ptrs, WIRE_MAX_PTRS))) return rc;
  if (m->decode_prefix_len < 0) return bad(&c, 7, "%" PRId64 " is negative", m->decode_prefix_len);
  put_str(out, "None");
  put_str(out, m->endpoint);
  put_int(out, m->dst_port);
  put_str(out, m->session);
  put_array(out, m->kv_ptrs, 8);
  put_array(out, m->aux_ptrs, 8);
  put_array(out, m->state_ptrs, 8);
  put_int(out, m->decode_prefix_len);
  return 0;
}

int kvf__wire_m2_encode(const wire_m2 *m, wire_msg *out, char *reason) {
  if (!m || !out) {
    why(reason, "M2: invalid arguments");
    return KVF_EINVAL;
  }
  memset(out, 0, sizeof *out);
  ctx c = {"M2", m2_names, NULL, reason, KVF_EINVAL};
  int rc;
  if ((rc = check_peer_fields(&c, m->endpoint, m->dst_port, m->session))) return rc;
  if (m->required_dst_info_num < 1 || m->required_dst_info_num > WIRE_MAX_FANOUT)
    return bad(&c, 6, "%" PRId64 " is outside 1..%d", m->required_dst_info_num, WIRE_MAX_FANOUT);
  put_int(out, m->room);
  put_str(out, m->endpoint);
  put_int(out, m->dst_port);
  put_str(out, m->session);
  if (m->is_dummy) {
    /* Appendix A.7: frame 6 is the only non-empty frame after frame 3. */
    put_bytes(out, NULL, 0);
    put_bytes(out, NULL, 0);
    put_int(out, m->required_dst_info_num);
    for (int i = 7; i < 12; i++) put_bytes(out, NULL, 0);
    return 0;
  }
  if ((rc = check_m2_body(&c, m))) goto err;
  put_array(out, m->kv_indices, 8);
  put_int(out, m->dst_aux_index); /* never empty: an empty frame 5 reads as a dummy */
  put_int(out, m->required_dst_info_num);
  put_int(out, m->decode_prefix_len);
  put_int(out, m->indices_are_local);
  put_array(out, m->page_mask, 1);
  put_array(out, m->local_indices, 8);
  put_array(out, m->mamba_indices, 8);
  if (m->nfrags) {
    size_t len;
    rc = format_fragments(m->frags, m->nfrags, &out->json, &len, "M2 frame 13 (fragments): ", reason);
    if (rc) goto err;
    put_int(out, WIRE_FRAGMENT_VERSION);
    put_bytes(out, out->json, len);
    if (m->page_layout < 0 || m->page_layout > WIRE_MAX_PAGE_SIZE) {
      rc = bad(&c, 14, "%" PRId64 " is outside 0..%d", m->page_layout, WIRE_MAX_PAGE_SIZE);
      goto err;
    }
    if (m->page_layout > 0 || m->room_flags || m->fence_epoch) {
      if (m->page_layout > 0) put_int(out, m->page_layout);
      else put_bytes(out, NULL, 0);
    }
  } else if (m->room_flags || m->fence_epoch) {
    put_bytes(out, NULL, 0); /* frames 12-14 empty: no plan, no layout */
    put_bytes(out, NULL, 0);
    put_bytes(out, NULL, 0);
  }
  if (m->room_flags || m->fence_epoch) {
    memcpy(out->text + out->text_len, &m->room_flags, 8);
    memcpy(out->text + out->text_len + 8, &m->fence_epoch, 8);
    put_bytes(out, out->text + out->text_len, 16);
    out->text_len += 16;
  }
  return 0;

err:
  free(out->json); /* the plan JSON, when the error came after it was built */
  memset(out, 0, sizeof *out);
  return rc;
}

int kvf__wire_m3_encode(const wire_m3 *m, wire_msg *out, char *reason) {
  if (!m || !out) {
    why(reason, "M3: invalid arguments");
    return KVF_EINVAL;
  }
  memset(out, 0, sizeof *out);
  ctx c = {"M3", m3_names, NULL, reason, KVF_EINVAL};
  int rc;
  if (m->status < WIRE_STATUS_FAILED || m->status > WIRE_STATUS_SUCCESS)
    return bad(&c, 1, "%d is outside 0..5", (int)m->status);
  if (m->prefill_rank < 0 || m->prefill_rank > INT32_MAX)
    return bad(&c, 2, "%" PRId64 " is outside 0..2^31-1", m->prefill_rank);
  if (m->bootstrap_token < -1) return bad(&c, 3, "%" PRId64 " is below -1", m->bootstrap_token);
  if ((rc = check_count(&c, 4, m->candidates, WIRE_MAX_CANDIDATES))) return rc;
  put_int(out, m->room);
  put_int(out, m->status);
  put_int(out, m->prefill_rank);
  put_int(out, m->bootstrap_token);
  put_array(out, m->candidates, 4);
  if ((m->reason && m->reason_len) || m->fence_epoch) {
    size_t len = !m->reason ? 0 : m->reason_len < WIRE_REASON_LEN - 1 ? m->reason_len : WIRE_REASON_LEN - 1;
    out->frames[out->nframes++] = (wire_frame){(const uint8_t *)(len ? m->reason : ""), len};
  }
  if (m->fence_epoch) {
    memcpy(out->text + out->text_len, &m->fence_epoch, 8);
    out->frames[out->nframes++] = (wire_frame){(const uint8_t *)out->text + out->text_len, 8};
    out->text_len += 8;
  }
  return 0;
}

/* ---- kvferry-only messages ---- */

static const char *const digests_names[] = {"kind", "room", "prefill_rank", "fence_epoch", "entries"};
static const char *const fence_names[] = {"kind", "room", "session_id", "fence_epoch", "reason"};

int kvf__wire_is_digests(const wire_frame *frames, size_t n) {
  return n > 0 && frames && frame_is(&frames[0], "kvferry-digests");
}
int kvf__wire_is_fence(const wire_frame *frames, size_t n) {
  return n > 0 && frames && frame_is(&frames[0], "kvferry-fence");
}

int kvf__wire_digests_decode(const wire_frame *f, size_t n, wire_digests *out, char *reason) {
  int rc = check_args("digests", f, n, out, reason);
  if (rc) return rc;
  ctx c = {"digests", digests_names, f, reason, KVF_EPROTO};
  wire_digests m;
  int64_t v;
  memset(&m, 0, sizeof m);
  if (n < 5 || !kvf__wire_is_digests(f, n)) {
    why(reason, "digests: %zu frames or wrong kind, needs 5", n);
    return KVF_EPROTO;
  }
  if ((rc = get_int(&c, 1, INT64_MIN, INT64_MAX, &m.room))) return rc;
  if ((rc = get_int(&c, 2, 0, INT32_MAX, &m.prefill_rank))) return rc;
  if ((rc = get_int(&c, 3, 0, INT64_MAX, &v))) return rc;
  m.epoch = (uint64_t)v;
  if ((rc = get_array(&c, 4, WIRE_DIGEST_BYTES, WIRE_MAX_DIGESTS, &m.entries))) return rc;
  for (size_t i = 0; i < m.entries.count; i++)
    if (wire_digest_at(m.entries, i).count == 0) return bad(&c, 4, "entry %zu has a zero count", i);
  *out = m;
  return 0;
}

int kvf__wire_digests_encode(const wire_digests *m, wire_msg *out, char *reason) {
  if (!m || !out) {
    why(reason, "digests: invalid arguments");
    return KVF_EINVAL;
  }
  memset(out, 0, sizeof *out);
  ctx c = {"digests", digests_names, NULL, reason, KVF_EINVAL};
  int rc;
  if (m->prefill_rank < 0 || m->prefill_rank > INT32_MAX) return bad(&c, 2, "rank out of range");
  if (m->epoch > INT64_MAX) return bad(&c, 3, "epoch out of range");
  if ((rc = check_count(&c, 4, m->entries, WIRE_MAX_DIGESTS))) return rc;
  put_str(out, "kvferry-digests");
  put_int(out, m->room);
  put_int(out, m->prefill_rank);
  put_int(out, (int64_t)m->epoch);
  put_array(out, m->entries, WIRE_DIGEST_BYTES);
  return 0;
}

int kvf__wire_fence_decode(const wire_frame *f, size_t n, wire_fence *out, char *reason) {
  int rc = check_args("fence", f, n, out, reason);
  if (rc) return rc;
  ctx c = {"fence", fence_names, f, reason, KVF_EPROTO};
  wire_fence m;
  int64_t v;
  uint16_t port;
  memset(&m, 0, sizeof m);
  if (n < 5 || !kvf__wire_is_fence(f, n)) {
    why(reason, "fence: %zu frames or wrong kind, needs 5", n);
    return KVF_EPROTO;
  }
  if ((rc = get_int(&c, 1, INT64_MIN, INT64_MAX, &m.room))) return rc;
  if ((rc = check_session(&c, 2, f[2].data, f[2].len, &port))) return rc;
  copy_text(m.session, &f[2]);
  if ((rc = get_int(&c, 3, 1, INT64_MAX, &v))) return rc;
  m.epoch = (uint64_t)v;
  size_t len = f[4].len < sizeof m.reason - 1 ? f[4].len : sizeof m.reason - 1;
  for (size_t i = 0; i < len; i++)
    m.reason[i] = f[4].data[i] >= 32 && f[4].data[i] < 127 ? (char)f[4].data[i] : '?';
  *out = m;
  return 0;
}

int kvf__wire_fence_encode(const wire_fence *m, wire_msg *out, char *reason) {
  if (!m || !out) {
    why(reason, "fence: invalid arguments");
    return KVF_EINVAL;
  }
  memset(out, 0, sizeof *out);
  ctx c = {"fence", fence_names, NULL, reason, KVF_EINVAL};
  uint16_t port;
  int rc;
  if ((rc = check_str_field(&c, 2, m->session, 1, &port))) return rc;
  if (m->epoch == 0 || m->epoch > INT64_MAX) return bad(&c, 3, "epoch out of range");
  put_str(out, "kvferry-fence");
  put_int(out, m->room);
  put_str(out, m->session);
  put_int(out, (int64_t)m->epoch);
  size_t len = strnlen(m->reason, 200); /* the text buffer holds the other frames too */
  memcpy(out->text + out->text_len, m->reason, len);
  put_bytes(out, out->text + out->text_len, len);
  out->text_len += len;
  return 0;
}

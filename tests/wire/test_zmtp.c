/* The ZMTP receiver (src/wire/zmtp.c) on byte strings: a PUSH peer's
 * greeting and READY open the connection, and its messages come out whole
 * however the bytes are cut; a PING is answered with its PONG; frames past
 * the kept ones are counted; and every breach of the protocol or of a limit
 * (a multipart message that never ends, among them) ends the connection
 * with a reason, without handing over anything of the unfinished message. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "kvferry/common.h"
#include "wire/zmtp.h"

/* What the sink saw. */
typedef struct seen {
  int messages;
  size_t nframes[8], extra[8];
  char text[8][256]; /* a message's frames joined by '|' */
  size_t zs[8];      /* 'z' bytes in a message's frames */
  unsigned char sent[256];
  size_t nsent;
} seen;

static void on_message(void *arg, const wire_frame *f, size_t n, size_t extra) {
  seen *s = arg;
  if (s->messages >= 8) return;
  char *t = s->text[s->messages];
  size_t off = 0;
  for (size_t i = 0; i < n; i++) {
    off += (size_t)snprintf(t + off, 256 - off, "%s%.*s", i ? "|" : "", (int)f[i].len, (const char *)f[i].data);
    if (off >= 256) off = 255;
    for (size_t k = 0; k < f[i].len; k++) s->zs[s->messages] += f[i].data[k] == 'z';
  }
  s->nframes[s->messages] = n;
  s->extra[s->messages] = extra;
  s->messages++;
}

static void on_send(void *arg, const void *p, size_t len) {
  seen *s = arg;
  if (s->nsent + len <= sizeof s->sent) memcpy(s->sent + s->nsent, p, len);
  s->nsent += len;
}

static const zmtp_limits lim = {.kept_frames = 4, .max_frames = 16, .max_msg_bytes = 1000};

/* Append a frame to out: flags, size (long when asked or > 255), bytes. */
static size_t put_frame(unsigned char *out, unsigned flags, const void *p, size_t len, int force_long) {
  size_t o = 0;
  if (len > 255 || force_long) {
    out[o++] = (unsigned char)(flags | 2u);
    for (int i = 7; i >= 0; i--) out[o++] = (unsigned char)((uint64_t)len >> (8 * i));
  } else {
    out[o++] = (unsigned char)flags;
    out[o++] = (unsigned char)len;
  }
  memcpy(out + o, p, len);
  return o + len;
}

/* A PUSH peer's hello, then two messages: "a|bb" and one frame of 300 bytes. */
static size_t sample(unsigned char *out, size_t *hello_len) {
  size_t o = kvf__zmtp_hello(out, "PUSH");
  *hello_len = o;
  o += put_frame(out + o, 1, "a", 1, 0);
  o += put_frame(out + o, 0, "bb", 2, 1); /* a long frame may be short */
  unsigned char big[300];
  memset(big, 'z', sizeof big);
  o += put_frame(out + o, 0, big, sizeof big, 0);
  return o;
}

static void opens_and_delivers_however_cut(void **state) {
  (void)state;
  unsigned char buf[1024];
  size_t hl;
  size_t len = sample(buf, &hl);
  for (size_t step = 1; step <= len; step = step < 8 ? step + 1 : step * 2) {
    zmtp_rx rx;
    kvf__zmtp_rx_init(&rx, &lim);
    seen s = {0};
    zmtp_sink sink = {.arg = &s, .message = on_message, .send = on_send};
    char why[128] = "";
    for (size_t off = 0; off < len; off += step) {
      size_t n = len - off < step ? len - off : step;
      assert_int_equal(kvf__zmtp_rx_feed(&rx, buf + off, n, &sink, why, sizeof why), 0);
    }
    assert_int_equal(s.messages, 2);
    assert_string_equal(s.text[0], "a|bb");
    assert_int_equal(s.nframes[0], 2);
    assert_int_equal(s.nframes[1], 1);
    assert_int_equal(strlen(s.text[1]), 255); /* the printout's cap; the frame is 300 bytes: */
    assert_int_equal(s.zs[1], 300);
    assert_int_equal(s.nsent, 0);
    kvf__zmtp_rx_free(&rx);
  }
}

/* Feed the hello, then `rest`; returns the feed's result and the reason. */
static int after_hello(const void *rest, size_t n, seen *s, char *why, size_t whycap) {
  unsigned char buf[2048];
  size_t o = kvf__zmtp_hello(buf, "PUSH");
  memcpy(buf + o, rest, n);
  zmtp_rx rx;
  kvf__zmtp_rx_init(&rx, &lim);
  zmtp_sink sink = {.arg = s, .message = on_message, .send = on_send};
  int rc = kvf__zmtp_rx_feed(&rx, buf, o + n, &sink, why, whycap);
  char again[128];
  if (rc)
    assert_int_equal(kvf__zmtp_rx_feed(&rx, "", 1, &sink, again, sizeof again), KVF_EPROTO); /* stays broken */
  kvf__zmtp_rx_free(&rx);
  return rc;
}

/* A PING command frame (TTL 10) with `ctx` as its context. */
static size_t put_ping(unsigned char *out, const char *ctx) {
  unsigned char body[64];
  size_t cl = strlen(ctx);
  memcpy(body, "\x04PING\x00\x0a", 7);
  memcpy(body + 7, ctx, cl);
  return put_frame(out, 4, body, 7 + cl, 0);
}

static void ping_gets_its_pong_and_frames_past_the_kept_are_counted(void **state) {
  (void)state;
  unsigned char b[512];
  size_t o = put_ping(b, "ctx");
  const char *parts[] = {"1", "2", "3", "4", "5", "6"};
  for (int i = 0; i < 6; i++) o += put_frame(b + o, i < 5 ? 1u : 0u, parts[i], 1, 0);
  seen s = {0};
  char why[128] = "";
  assert_int_equal(after_hello(b, o, &s, why, sizeof why), 0);
  assert_int_equal(s.nsent, 2 + 5 + 3);
  assert_memory_equal(s.sent, "\x04\x08\x04PONGctx", 10);
  assert_int_equal(s.messages, 1);
  assert_string_equal(s.text[0], "1|2|3|4");
  assert_int_equal(s.nframes[0], 4);
  assert_int_equal(s.extra[0], 2);
}

static void expect_broken(const void *rest, size_t n, const char *reason_part) {
  seen s = {0};
  char why[192] = "";
  assert_int_not_equal(after_hello(rest, n, &s, why, sizeof why), 0);
  if (!strstr(why, reason_part)) fail_msg("reason \"%s\" lacks \"%s\"", why, reason_part);
  assert_int_equal(s.messages, 0); /* nothing of an unfinished message */
}

static void breaches_end_the_connection(void **state) {
  (void)state;
  unsigned char b[4096];
  size_t o = 0;
  /* a multipart message that never ends: frames past max_frames */
  for (int i = 0; i < 17; i++) o += put_frame(b + o, 1, "x", 1, 0);
  expect_broken(b, o, "more than 16 frames");
  /* its bytes past max_msg_bytes, over several frames, each within it */
  unsigned char z[400] = {0};
  o = 0;
  for (int i = 0; i < 3; i++) o += put_frame(b + o, 1, z, sizeof z, 0);
  expect_broken(b, o, "more than 1000 bytes");
  /* a size no message may have, refused from the header alone */
  unsigned char huge[9] = {2, 0x7f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff};
  expect_broken(huge, sizeof huge, "more than 1000 bytes");
  unsigned char reserved[2] = {8, 0};
  expect_broken(reserved, 2, "reserved flag");
  unsigned char more_cmd[16];
  expect_broken(more_cmd, put_frame(more_cmd, 5, "\x04PING\0\0", 7, 0), "MORE flag");
  unsigned char err[32];
  expect_broken(err,
                put_frame(err, 4,
                          "\x05"
                          "ERROR\x03"
                          "bye",
                          10, 0),
                "ERROR: bye");
  unsigned char ready2[ZMTP_HELLO_MAX];
  size_t rl = kvf__zmtp_hello(ready2, "PUSH");
  expect_broken(ready2 + 64, rl - 64, "READY twice"); /* its READY once more */
  unsigned char ping_bad[32];
  expect_broken(ping_bad, put_frame(ping_bad, 4, "\x04PING\0", 6, 0), "malformed PING");
}

/* A PING's context is echoed up to 16 bytes (RFC 37's most; libzmq cuts
 * a longer one the same way). */
static void long_ping_context_is_cut(void **state) {
  (void)state;
  unsigned char b[64];
  size_t o = put_ping(b, "0123456789abcdefXYZ");
  seen s = {0};
  char why[128] = "";
  assert_int_equal(after_hello(b, o, &s, why, sizeof why), 0);
  assert_int_equal(s.nsent, 7 + 16);
  assert_memory_equal(s.sent, "\x04\x15\x04PONG0123456789abcdef", 7 + 16);
}

/* Bytes from a connection's start that must end it with a reason
 * containing `reason_part`, handing nothing over. */
static void expect_refused(const unsigned char *b, size_t len, const char *reason_part) {
  zmtp_rx rx;
  kvf__zmtp_rx_init(&rx, &lim);
  seen s = {0};
  zmtp_sink sink = {.arg = &s, .message = on_message, .send = on_send};
  char why[192] = "";
  assert_int_equal(kvf__zmtp_rx_feed(&rx, b, len, &sink, why, sizeof why), KVF_EPROTO);
  if (!strstr(why, reason_part)) fail_msg("reason \"%s\" lacks \"%s\"", why, reason_part);
  assert_int_equal(s.messages, 0);
  kvf__zmtp_rx_free(&rx);
}

/* The opening: greetings and READYs that do not open a connection. */
static void openings_refused(void **state) {
  (void)state;
  unsigned char b[256];
  struct {
    size_t at;
    unsigned char val;
    const char *why;
  } edits[] = {
      {0, 0x00, "no greeting signature"},    /* not ZMTP (an HTTP request, say) */
      {9, 0x00, "no greeting signature"},    /* not ZMTP */
      {10, 2, "ZMTP 2 is not supported"},    /* ZMTP 2.0 */
      {12, 'C', "security mechanism CULL"},  /* another mechanism */
      {16, 'X', "security mechanism NULLX"}, /* NUL padding broken */
  };
  for (size_t i = 0; i < sizeof edits / sizeof edits[0]; i++) {
    size_t len = kvf__zmtp_hello(b, "PUSH");
    b[edits[i].at] = edits[i].val;
    expect_refused(b, len, edits[i].why);
  }
  const char *types[] = {"PULL", "PUB", "DEALER"}; /* a peer that is not a PUSH socket */
  for (size_t i = 0; i < 3; i++)
    expect_refused(b, kvf__zmtp_hello(b, types[i]), "cannot send to this PULL socket");
  kvf__zmtp_hello(b, "PUSH");
  expect_refused(b, 64 + put_frame(b + 64, 0, "m", 1, 0), "a message before the peer's READY"); /* no READY */
}

/* The hello this end sends is what RFC 23 lays out: checked byte by byte
 * (libzmq's and pyzmq's PUSH sockets accept it: every test that sends a
 * manager a message goes through it). */
static void hello_bytes(void **state) {
  (void)state;
  unsigned char b[ZMTP_HELLO_MAX];
  size_t len = kvf__zmtp_hello(b, "PULL");
  assert_int_equal(len, 64 + 2 + 26);
  assert_int_equal(b[0], 0xFF);
  assert_int_equal(b[9], 0x7F);
  assert_int_equal(b[10], 3);
  assert_int_equal(b[11], 0);
  assert_memory_equal(b + 12, "NULL\0\0\0\0", 8);
  for (size_t i = 32; i < 64; i++) assert_int_equal(b[i], 0);
  assert_memory_equal(b + 64, "\x04\x1a\x05READY\x0bSocket-Type\0\0\0\x04PULL", 2 + 26);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(opens_and_delivers_however_cut),
      cmocka_unit_test(ping_gets_its_pong_and_frames_past_the_kept_are_counted),
      cmocka_unit_test(breaches_end_the_connection),
      cmocka_unit_test(long_ping_context_is_cut),
      cmocka_unit_test(openings_refused),
      cmocka_unit_test(hello_bytes),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

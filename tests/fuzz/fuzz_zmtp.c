/* libFuzzer target for the ZMTP receiver of the managers' control ports
 * (kvf__zmtp_rx_feed, src/wire/zmtp.c), which reads whatever a peer sends.
 * Input: one control byte, then the peer's bytes. Control bit 0 puts a
 * PUSH peer's greeting and READY first (so the fuzzer reaches the frames);
 * bits 1-4 choose the size of the pieces the bytes are fed in. Oracles: the
 * verdict is 0, KVF_EPROTO or KVF_ENOMEM; the messages and answers that
 * come out, and the verdict, are the same whether the bytes come in pieces
 * or at once; no message has more kept frames, frames or bytes than the
 * limits allow; a broken connection stays broken. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/hash.h"
#include "fuzz_check.h"
#include "kvferry/common.h"
#include "wire/zmtp.h"

static const zmtp_limits lim = {.kept_frames = 4, .max_frames = 64, .max_msg_bytes = 4096};

typedef struct trace {
  kvf__hash_state h; /* every message and answer, in order */
  size_t messages, answers;
} trace;

static void on_message(void *arg, const wire_frame *f, size_t n, size_t extra) {
  trace *t = arg;
  size_t bytes = 0;
  FUZZ_CHECK(n <= lim.kept_frames && n + extra <= lim.max_frames);
  FUZZ_CHECK(extra == 0 || n == lim.kept_frames);
  uint64_t head[2] = {n, extra};
  kvf__hash_update(&t->h, head, sizeof head);
  for (size_t i = 0; i < n; i++) {
    FUZZ_CHECK(f[i].len == 0 || f[i].data != NULL);
    bytes += f[i].len;
    uint64_t len = f[i].len;
    kvf__hash_update(&t->h, &len, sizeof len);
    kvf__hash_update(&t->h, f[i].data, f[i].len);
  }
  FUZZ_CHECK(bytes <= lim.max_msg_bytes);
  t->messages++;
}

static void on_send(void *arg, const void *p, size_t len) {
  trace *t = arg;
  FUZZ_CHECK(len >= 7 && len <= 7 + 16); /* a PONG: flags, size, name, up to 16 bytes of context */
  kvf__hash_update(&t->h, "pong", 4);
  kvf__hash_update(&t->h, p, len);
  t->answers++;
}

/* Feed `bytes` in pieces of `piece` (0: at once); the verdict. */
static int run(const uint8_t *bytes, size_t n, size_t piece, trace *t) {
  zmtp_rx rx;
  kvf__zmtp_rx_init(&rx, &lim);
  kvf__hash_begin(&t->h);
  t->messages = t->answers = 0;
  zmtp_sink sink = {.arg = t, .message = on_message, .send = on_send};
  char why[256];
  int rc = 0;
  for (size_t off = 0; off < n && !rc;) {
    size_t k = piece && n - off > piece ? piece : n - off;
    why[0] = 0;
    rc = kvf__zmtp_rx_feed(&rx, bytes + off, k, &sink, why, sizeof why);
    off += k;
  }
  FUZZ_CHECK(rc == 0 || rc == KVF_EPROTO || rc == KVF_ENOMEM);
  if (rc) {
    FUZZ_CHECK(why[0] != 0);
    FUZZ_CHECK(kvf__zmtp_rx_feed(&rx, "x", 1, &sink, why, sizeof why) == KVF_EPROTO);
  }
  kvf__zmtp_rx_free(&rx);
  return rc;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (!size) return 0;
  unsigned ctl = data[0];
  size_t piece = (ctl >> 1) & 15u;
  uint8_t *bytes = malloc(size + ZMTP_HELLO_MAX);
  FUZZ_CHECK(bytes != NULL);
  size_t n = 0;
  if (ctl & 1u) n = kvf__zmtp_hello(bytes, "PUSH");
  memcpy(bytes + n, data + 1, size - 1);
  n += size - 1;
  trace whole, cut;
  int a = run(bytes, n, 0, &whole), b = run(bytes, n, piece ? piece : 1, &cut);
  FUZZ_CHECK(a == b);
  FUZZ_CHECK(whole.messages == cut.messages && whole.answers == cut.answers);
  FUZZ_CHECK(kvf__hash_end(&whole.h) == kvf__hash_end(&cut.h));
  free(bytes);
  return 0;
}

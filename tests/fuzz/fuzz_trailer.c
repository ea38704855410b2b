/* libFuzzer target for the completion trailer a decode receives behind a
 * room's last bytes (kvf__trailer_unpack, src/kv/control.c; read on an
 * engine thread by kvf__dec_on_trailer): a 2-byte frame count, then per
 * frame a 4-byte length and its bytes. Oracles: the verdict is 0 or
 * KVF_EPROTO; accepted frames lie inside the input, back to back, and cover
 * it to the last byte; a smaller capacity gives the same verdict with the
 * rest counted in `extra`; an accepted trailer packs back (kvf__trailer_pack,
 * no control token) to the same bytes and not into one byte less; the M3
 * decoder the decode then runs on the frames rejects with a reason or
 * decodes. */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "kv/manager.h"
#include "wire/messages.h"
#include "fuzz_check.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  static kvf_manager plain; /* no control token: pack adds no MAC frame */
  wire_frame f[MANAGER_MAX_RECV_FRAMES];
  size_t n = 99, extra = 99;
  int rc = kvf__trailer_unpack(data, size, f, MANAGER_MAX_RECV_FRAMES, &n, &extra);
  FUZZ_CHECK(rc == 0 || rc == KVF_EPROTO);
  if (rc) return 0;
  FUZZ_CHECK(size >= 2 && n >= 1 && n <= MANAGER_MAX_RECV_FRAMES);
  FUZZ_CHECK(n + extra == ((size_t)data[0] | (size_t)data[1] << 8));
  const uint8_t *at = data + 2;
  for (size_t i = 0; i < n; i++) {
    uint32_t len;
    memcpy(&len, at, 4);
    FUZZ_CHECK(f[i].data == at + 4 && f[i].len == len);
    FUZZ_CHECK(f[i].len <= size && f[i].data + f[i].len <= data + size);
    at += 4 + len;
  }
  if (!extra) FUZZ_CHECK(at == data + size);

  /* The same trailer with room for one frame: same verdict, the rest counted. */
  wire_frame one[1];
  size_t n1 = 0, extra1 = 0;
  FUZZ_CHECK(kvf__trailer_unpack(data, size, one, 1, &n1, &extra1) == 0);
  FUZZ_CHECK(n1 == 1 && extra1 == n + extra - 1 && one[0].data == f[0].data && one[0].len == f[0].len);

  if (!extra && n <= WIRE_MAX_FRAMES) {
    wire_msg msg;
    memset(&msg, 0, sizeof msg);
    memcpy(msg.frames, f, n * sizeof f[0]);
    msg.nframes = n;
    uint8_t *out = malloc(size);
    FUZZ_CHECK(out != NULL);
    FUZZ_CHECK(kvf__trailer_pack(&plain, &msg, out, size) == size);
    FUZZ_CHECK(memcmp(out, data, size) == 0);
    FUZZ_CHECK(kvf__trailer_pack(&plain, &msg, out, size - 1) == 0);
    free(out);
  }

  wire_m3 m3;
  char why[WIRE_REASON_LEN] = "";
  int m = kvf__wire_m3_decode(f, n, &m3, why);
  FUZZ_CHECK(m == 0 || (m == KVF_EPROTO && why[0]));
  if (m == 0) FUZZ_CHECK(m3.status >= 0 && m3.status <= 5 && m3.bootstrap_token >= -1 && m3.prefill_rank >= 0);
  return 0;
}

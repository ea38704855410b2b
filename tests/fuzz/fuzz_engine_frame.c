/* libFuzzer target for the engine's inbound TCP framing (src/engine/tcp_frame.c):
 * the input is the byte stream one connection sends (hello, token, chunks).
 * Oracles: the verdict is one of the known ones with a reason; an accepted
 * stream is consumed to its last byte; refusals never exceed chunks; and the
 * prefix up to the last whole chunk parses again to the same counts. The
 * region table holds two host regions and one of device memory, never
 * touched (no I/O). */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

#include "engine/tcp_frame.h"
#include "fuzz_check.h"

static region_table *table(void) {
  static region_table t;
  static int ready;
  if (!ready) {
    FUZZ_CHECK(kvf__regions_init(&t) == 0);
    FUZZ_CHECK(kvf__regions_add(&t, 0x100000, 0x10000, 0) == 0);
    FUZZ_CHECK(kvf__regions_add(&t, 0x200000, 0x1000, 0) == 0);
    FUZZ_CHECK(kvf__regions_add(&t, 0x300000, 0x1000, 1) == 0); /* device memory */
    ready = 1;
  }
  return &t;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  region_table *t = table();
  tcp_frame_info info, again;
  int v = kvf__tcp_frame_parse(data, size, t, &info);
  FUZZ_CHECK(v >= 0 && v < TCP_FRAME_NVERDICTS && v != TCP_FRAME_OUT_OF_RANGE && v != TCP_FRAME_DEVICE_MEMORY);
  FUZZ_CHECK(kvf__tcp_frame_reason(v) != NULL);
  FUZZ_CHECK(info.refused <= info.chunks && info.consumed <= size);
  if (v == TCP_FRAME_OK) FUZZ_CHECK(info.consumed == size);
  if (info.consumed) {
    FUZZ_CHECK(kvf__tcp_frame_parse(data, info.consumed, t, &again) == TCP_FRAME_OK);
    FUZZ_CHECK(again.chunks == info.chunks && again.refused == info.refused &&
               again.accepted_bytes == info.accepted_bytes);
  }
  return 0;
}

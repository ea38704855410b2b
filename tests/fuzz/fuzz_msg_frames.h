/* Shared by the M1/M2/M3 fuzz targets: turns one fuzzer input into the
 * parts of a ZMQ multipart message, and checks the decode -> encode ->
 * decode oracle helpers. Input layout: repeated [len][bytes], where len is
 * one byte, or 0xff followed by a little-endian u16 for longer frames; a
 * short tail is truncated. Every frame gets its own exact-size heap copy so
 * ASan sees any read past a frame, as it would with real zmq_msg_t data. */
#ifndef KVF_FUZZ_MSG_FRAMES_H
#define KVF_FUZZ_MSG_FRAMES_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "wire/messages.h"
#include "fuzz_check.h"

enum { FUZZ_MAX_FRAMES = 16 };

typedef struct fuzz_frames {
  wire_frame f[FUZZ_MAX_FRAMES];
  uint8_t *buf[FUZZ_MAX_FRAMES];
  size_t n;
} fuzz_frames;

static inline void fuzz_split(const uint8_t *data, size_t size, fuzz_frames *out) {
  size_t pos = 0;
  memset(out, 0, sizeof *out);
  while (pos < size && out->n < FUZZ_MAX_FRAMES) {
    size_t len = data[pos++];
    if (len == 0xff && size - pos >= 2) {
      len = (size_t)data[pos] | (size_t)data[pos + 1] << 8;
      pos += 2;
    }
    if (len > size - pos) len = size - pos;
    uint8_t *b = len ? malloc(len) : NULL;
    if (len) memcpy(b, data + pos, len);
    out->buf[out->n] = b;
    out->f[out->n].data = b;
    out->f[out->n].len = len;
    out->n++;
    pos += len;
  }
}

static inline void fuzz_release(fuzz_frames *ff) {
  for (size_t i = 0; i < ff->n; i++) free(ff->buf[i]);
}

static inline int fuzz_array_eq(wire_array a, wire_array b, size_t elem) {
  return a.count == b.count && (a.count == 0 || !memcmp(a.data, b.data, a.count * elem));
}

/* Frames [from, to) of the input equal the encoder's output byte for byte. */
static inline int fuzz_frames_eq(const wire_frame *a, const wire_frame *b, size_t from, size_t to) {
  for (size_t i = from; i < to; i++)
    if (a[i].len != b[i].len || (a[i].len && memcmp(a[i].data, b[i].data, a[i].len))) return 0;
  return 1;
}

/* A failed decode always explains itself with a terminated reason. */
static inline int fuzz_reason_ok(const char *reason) {
  return reason[0] != '\0' && memchr(reason, '\0', WIRE_REASON_LEN) != NULL;
}

#endif

/* Inbound framing checks of the engine's TCP transport (see tcp_frame.h and
 * tcp_proto.h for the format). Every check that decides whether network bytes
 * may be written into registered memory lives here, free of I/O, so it can be
 * unit-tested per rejection and fuzzed. */
#include "engine/tcp_frame.h"

#include <stdlib.h>
#include <string.h>

static const char *const reasons[TCP_FRAME_NVERDICTS] = {
    [TCP_FRAME_OK] = "ok",
    [TCP_FRAME_SHORT] = "truncated message",
    [TCP_FRAME_HELLO_MAGIC] = "not a kvferry engine hello",
    [TCP_FRAME_HELLO_VERSION] = "unsupported engine protocol version",
    [TCP_FRAME_TOKEN_TOO_LONG] = "auth token too long",
    [TCP_FRAME_CHUNK_MAGIC] = "malformed chunk header",
    [TCP_FRAME_NO_DESC] = "chunk without descriptors",
    [TCP_FRAME_TOO_MANY_DESC] = "too many descriptors in a chunk",
    [TCP_FRAME_ZERO_COUNT] = "descriptor with a zero count",
    [TCP_FRAME_OVERFLOW] = "descriptor sizes overflow",
    [TCP_FRAME_TOTAL_MISMATCH] = "chunk descriptors do not add up",
    [TCP_FRAME_OUT_OF_RANGE] = "write outside registered memory",
    [TCP_FRAME_DEVICE_MEMORY] =
        "write into device memory, which kvferry's TCP cannot copy into (UCX with CUDA can)",
};

const char *kvf__tcp_frame_reason(int v) {
  return v >= 0 && v < TCP_FRAME_NVERDICTS ? reasons[v] : "unknown verdict";
}

int kvf__tcp_frame_fatal(int v) {
  return v != TCP_FRAME_OK && v != TCP_FRAME_OUT_OF_RANGE && v != TCP_FRAME_DEVICE_MEMORY;
}

int kvf__tcp_frame_hello(const tcp_hello *h) {
  /* A data connection's hello, or a UCX rendezvous (ucx.c): same layout. */
  if (h->magic != TCP_HELLO_MAGIC && h->magic != TCP_UCX_HELLO_MAGIC) return TCP_FRAME_HELLO_MAGIC;
  if (h->version != (h->magic == TCP_UCX_HELLO_MAGIC ? TCP_UCX_PROTO_VERSION : TCP_PROTO_VERSION))
    return TCP_FRAME_HELLO_VERSION;
  if (h->token_len > TCP_MAX_TOKEN) return TCP_FRAME_TOKEN_TOO_LONG;
  return TCP_FRAME_OK;
}

int kvf__tcp_frame_chunk_hdr(const tcp_chunk_hdr *h) {
  if (h->magic != TCP_CHUNK_MAGIC && h->magic != TCP_CHUNK_TAGGED_MAGIC) return TCP_FRAME_CHUNK_MAGIC;
  if (h->ndesc == 0) return TCP_FRAME_NO_DESC;
  if (h->ndesc > TCP_MAX_DESC) return TCP_FRAME_TOO_MANY_DESC;
  return TCP_FRAME_OK;
}

int kvf__tcp_frame_descs(const tcp_chunk_hdr *h, const tcp_desc *d) {
  uint64_t sum = 0;
  for (uint32_t i = 0; i < h->ndesc; i++) {
    uint64_t b;
    if (d[i].count == 0) return TCP_FRAME_ZERO_COUNT;
    if (__builtin_mul_overflow(d[i].len, d[i].count, &b) || __builtin_add_overflow(sum, b, &sum))
      return TCP_FRAME_OVERFLOW;
  }
  return sum == h->total_bytes ? TCP_FRAME_OK : TCP_FRAME_TOTAL_MISMATCH;
}

int kvf__tcp_frame_ranges_locked(const region_table *t, const tcp_desc *d, uint32_t ndesc, region **pins,
                                 size_t *npins) {
  size_t k = 0;
  for (uint32_t i = 0; i < ndesc; i++) {
    if (!d[i].len) continue;
    region *r = kvf__regions_find_block_locked(t, d[i].dst, d[i].len, d[i].count, d[i].stride);
    if (!r) return TCP_FRAME_OUT_OF_RANGE;
    if (r->device) return TCP_FRAME_DEVICE_MEMORY;
    if (pins && (k == 0 || pins[k - 1] != r)) pins[k++] = r;
  }
  if (npins) *npins = k;
  return TCP_FRAME_OK;
}

/* Copy a fixed-size message out of the stream (the bytes may be unaligned). */
static int take(const uint8_t *bytes, size_t len, size_t *off, void *out, size_t n) {
  if (len - *off < n) return TCP_FRAME_SHORT;
  memcpy(out, bytes + *off, n);
  *off += n;
  return TCP_FRAME_OK;
}

int kvf__tcp_frame_parse(const uint8_t *bytes, size_t len, region_table *t, tcp_frame_info *info) {
  memset(info, 0, sizeof *info);
  size_t off = 0;
  tcp_hello h;
  int v = take(bytes, len, &off, &h, sizeof h);
  if (v || (v = kvf__tcp_frame_hello(&h))) return v;
  info->token_len = h.token_len;
  if (len - off < h.token_len) return TCP_FRAME_SHORT;
  off += h.token_len;
  info->consumed = off;
  tcp_desc *d = NULL;
  while (off < len) {
    tcp_chunk_hdr c;
    if ((v = take(bytes, len, &off, &c, sizeof c)) || (v = kvf__tcp_frame_chunk_hdr(&c))) break;
    tcp_chunk_tag tag; /* a tagged chunk's (tag, epoch); fences are not modelled here */
    if (c.magic == TCP_CHUNK_TAGGED_MAGIC && (v = take(bytes, len, &off, &tag, sizeof tag))) break;
    tcp_desc *nd = realloc(d, (size_t)c.ndesc * sizeof *d);
    if (!nd) {
      v = TCP_FRAME_SHORT;
      break;
    }
    d = nd;
    if ((v = take(bytes, len, &off, d, (size_t)c.ndesc * sizeof *d)) || (v = kvf__tcp_frame_descs(&c, d))) break;
    pthread_rwlock_rdlock(&t->lock);
    int r = kvf__tcp_frame_ranges_locked(t, d, c.ndesc, NULL, NULL);
    pthread_rwlock_unlock(&t->lock);
    if (len - off < c.total_bytes) {
      v = TCP_FRAME_SHORT;
      break;
    }
    off += c.total_bytes;
    info->chunks++;
    if (r) info->refused++;
    else info->accepted_bytes += c.total_bytes;
    info->consumed = off;
  }
  free(d);
  return v;
}

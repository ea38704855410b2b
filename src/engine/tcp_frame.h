/* The engine's inbound TCP framing as pure functions: given the bytes a peer
 * sent and the region table, accept or reject with a reason. No I/O and no
 * logging; tcp_in.c calls the stage functions as the bytes
 * arrive, and kvf__tcp_frame_parse runs them over a whole byte string for the
 * unit tests and the fuzzer (tests/fuzz/fuzz_engine_frame.c). */
#ifndef KVF_ENGINE_TCP_FRAME_H
#define KVF_ENGINE_TCP_FRAME_H

#include <stddef.h>
#include <stdint.h>

#include "engine/engine_internal.h"
#include "engine/tcp_proto.h"

typedef enum tcp_frame_verdict {
  TCP_FRAME_OK = 0,
  TCP_FRAME_SHORT,          /* whole-stream parser only: the bytes end inside a message */
  TCP_FRAME_HELLO_MAGIC,    /* not a kvferry engine hello */
  TCP_FRAME_HELLO_VERSION,  /* another protocol version */
  TCP_FRAME_TOKEN_TOO_LONG, /* token_len over TCP_MAX_TOKEN */
  TCP_FRAME_CHUNK_MAGIC,    /* chunk header magic wrong */
  TCP_FRAME_NO_DESC,        /* ndesc == 0 */
  TCP_FRAME_TOO_MANY_DESC,  /* ndesc over TCP_MAX_DESC */
  TCP_FRAME_ZERO_COUNT,     /* a descriptor with count 0 */
  TCP_FRAME_OVERFLOW,       /* len * count or the sum overflows 64 bits */
  TCP_FRAME_TOTAL_MISMATCH, /* descriptors do not add up to total_bytes */
  TCP_FRAME_OUT_OF_RANGE,   /* a destination outside registered memory: refused, stream stays in step */
  TCP_FRAME_DEVICE_MEMORY,  /* a destination in device memory, which the CPU cannot write: refused likewise */
  TCP_FRAME_NVERDICTS
} tcp_frame_verdict;

/* A short fixed reason for a verdict (static string). */
const char *kvf__tcp_frame_reason(int verdict);
/* Does the verdict end the connection (every rejection but OUT_OF_RANGE and
 * DEVICE_MEMORY, whose chunk is drained and refused)? */
int kvf__tcp_frame_fatal(int verdict);

/* The hello: magic, version, token length. */
int kvf__tcp_frame_hello(const tcp_hello *h);
/* A chunk header on its own: magic and descriptor count. */
int kvf__tcp_frame_chunk_hdr(const tcp_chunk_hdr *h);
/* The descriptors against the header: counts, overflow, total. */
int kvf__tcp_frame_descs(const tcp_chunk_hdr *h, const tcp_desc *d);
/* Every non-empty destination inside one registered region. The caller holds
 * t->lock (read). With `pins` non-NULL (room for h->ndesc) it gets the
 * distinct regions the chunk writes into, consecutive repeats folded, and
 * *npins their number; nothing is pinned here. */
int kvf__tcp_frame_ranges_locked(const region_table *t, const tcp_desc *d, uint32_t ndesc, region **pins,
                                 size_t *npins);

typedef struct tcp_frame_info {
  uint32_t token_len;
  uint64_t chunks;  /* chunks fully framed (accepted or refused) */
  uint64_t refused; /* of which out of range */
  uint64_t accepted_bytes;
  size_t consumed; /* bytes up to the end of the last whole chunk */
} tcp_frame_info;

/* One connection's inbound bytes: a hello with its token, then chunks
 * (header, descriptors, payload). Returns TCP_FRAME_OK when the bytes end at
 * a chunk boundary, TCP_FRAME_SHORT when they end inside a message, or the
 * first fatal verdict. Out-of-range chunks are counted in info->refused and
 * parsing goes on, as the receiver does. Takes the region table's read lock;
 * allocates a descriptor array (tests and fuzzing only, not the receive path). */
int kvf__tcp_frame_parse(const uint8_t *bytes, size_t len, region_table *t, tcp_frame_info *info);

#endif

/* The engine's own TCP framing (kvferry to kvferry only; not the tokenspeed
 * wire). Native little-endian, fixed-size headers:
 *   hello   client → server once per connection, followed by the token bytes
 *   reply   server → client: 0 or a negative KVF_E* code, then close if not 0
 *   chunk   header, ndesc descriptors, then the payload bytes of every piece
 *           in descriptor order; a tagged chunk (TCP_CHUNK_TAGGED_MAGIC,
 *           kvf_batch_opts.tag != 0) has a tcp_chunk_tag between the header
 *           and the descriptors, and is written only while the target has
 *           that (tag, epoch) open, else answered with KVF_ESTATE
 *   ack     server → client per chunk, in order: 0 or a negative KVF_E* code
 *   A chunk with a completion trailer (async.h) has TCP_CHUNK_TRAILER_MAGIC
 *   (tagged: TCP_CHUNK_TAGGED_TRAILER_MAGIC) in its header and, after its
 *   payload, a tcp_trailer and tlen bytes (at most KVF_ENGINE_MAX_TRAILER),
 *   handed to the target's trailer callback once the payload landed, before
 *   the ack. */
#ifndef KVF_ENGINE_TCP_PROTO_H
#define KVF_ENGINE_TCP_PROTO_H

#include <stdint.h>

#define TCP_HELLO_MAGIC 0x4b564648u /* "HFVK" */
#define TCP_CHUNK_MAGIC 0x4b564643u
#define TCP_ACK_MAGIC 0x4b564641u
#define TCP_CHUNK_TRAILER_MAGIC 0x4b564645u
#define TCP_TRAILER_MAGIC 0x4b564659u
#define TCP_CHUNK_TAGGED_TRAILER_MAGIC 0x4b564647u
/* A hello with this magic asks for the UCX rendezvous (src/engine/ucx.h)
 * instead of a data connection; the token check is the same. */
#define TCP_UCX_HELLO_MAGIC 0x4b564655u
#define TCP_CHUNK_TAGGED_MAGIC 0x4b564654u
#define TCP_PROTO_VERSION 1
/* A UCX hello carries the rendezvous version instead (UCX_PROTO_VERSION,
 * ucx.h: 2 since read mode changed the info layout). */
#define TCP_UCX_PROTO_VERSION 2
/* tcp_hello.flags of a UCX hello: this writer can be read from (read mode,
 * src/engine/ucx_read.c); the target decides. */
#define TCP_HELLO_CAN_READ 0x1u
#define TCP_MAX_TOKEN 1024
/* A receiver drops a connection whose whole hello (header and token) has not
 * arrived this long after accept, however its bytes trickle in. */
#define TCP_HELLO_DEADLINE_MS 5000
/* Receivers refuse (as a protocol error) chunks with more descriptors. */
#define TCP_MAX_DESC 16384

typedef struct tcp_hello {
  uint32_t magic;
  uint16_t version;
  uint16_t flags;
  uint32_t token_len;
  uint32_t reserved;
} tcp_hello;

typedef struct tcp_reply {
  uint32_t magic;
  int32_t status;
} tcp_reply;

typedef struct tcp_chunk_hdr {
  uint32_t magic;
  uint32_t ndesc;
  uint64_t seq;
  uint64_t total_bytes;
} tcp_chunk_hdr;

typedef struct tcp_chunk_tag {
  uint64_t tag;
  uint64_t epoch;
} tcp_chunk_tag;

typedef struct tcp_desc {
  uint64_t dst;
  uint64_t len;
  uint64_t count; /* >= 1 */
  uint64_t stride;
} tcp_desc;

typedef struct tcp_trailer {
  uint32_t magic; /* TCP_TRAILER_MAGIC */
  uint32_t len;
} tcp_trailer;

typedef struct tcp_ack {
  uint64_t seq;
  int32_t status;
  uint32_t magic;
} tcp_ack;

_Static_assert(sizeof(tcp_hello) == 16, "hello layout");
_Static_assert(sizeof(tcp_chunk_hdr) == 24, "chunk header layout");
_Static_assert(sizeof(tcp_chunk_tag) == 16, "chunk tag layout");
_Static_assert(sizeof(tcp_desc) == 32, "descriptor layout");
_Static_assert(sizeof(tcp_ack) == 16, "ack layout");
_Static_assert(sizeof(tcp_trailer) == 8, "trailer layout");
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "kvferry assumes a little-endian host");

#endif

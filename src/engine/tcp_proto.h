/* The engine's own TCP framing (kvferry to kvferry only; not the tokenspeed
 * wire). Native little-endian, fixed-size headers:
 *   hello   client → server once per connection, followed by the token bytes
 *   reply   server → client: 0 or a negative KVF_E* code, then close if not 0
 *   chunk   header, ndesc descriptors, then the payload bytes of every piece
 *           in descriptor order
 *   ack     server → client per chunk, in order: 0 or a negative KVF_E* code */
#ifndef KVF_ENGINE_TCP_PROTO_H
#define KVF_ENGINE_TCP_PROTO_H

#include <stdint.h>

#define TCP_HELLO_MAGIC 0x4b564648u /* "HFVK" */
#define TCP_CHUNK_MAGIC 0x4b564643u
#define TCP_ACK_MAGIC 0x4b564641u
#define TCP_PROTO_VERSION 1
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

typedef struct tcp_desc {
  uint64_t dst;
  uint64_t len;
  uint64_t count; /* >= 1 */
  uint64_t stride;
} tcp_desc;

typedef struct tcp_ack {
  uint64_t seq;
  int32_t status;
  uint32_t magic;
} tcp_ack;

_Static_assert(sizeof(tcp_hello) == 16, "hello layout");
_Static_assert(sizeof(tcp_chunk_hdr) == 24, "chunk header layout");
_Static_assert(sizeof(tcp_desc) == 32, "descriptor layout");
_Static_assert(sizeof(tcp_ack) == 16, "ack layout");
_Static_assert(__BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__, "kvferry assumes a little-endian host");

#endif

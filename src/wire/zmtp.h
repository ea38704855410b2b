/* The receiving end of ZMTP 3 (RFC 23, ZeroMQ's wire protocol; PING and
 * PONG from RFC 37) as a PULL socket speaks it, for the managers' control
 * ports: kvferry reads its peers' bytes itself (a ZMQ_STREAM socket hands
 * them over raw) so that it can bound every message. libzmq's own PULL
 * socket bounds each frame and the count of whole messages queued, never
 * the frames of one message: a peer that sends frames with the MORE flag
 * and never a last one grew the receiving process until the kernel stopped
 * it (docs/WIRE-EXTENSIONS.md, "Bounds on a peer's message").
 *
 * What a connection goes through: the peer's 64-byte greeting (version 3 or
 * later, the NULL mechanism: kvferry's and tokenspeed's sockets use no
 * other), its READY command (Socket-Type PUSH, the one type that sends to a
 * PULL), then messages: frames, each with its MORE, LONG and COMMAND flags,
 * a 1- or 8-byte size and its bytes. A command between messages is answered
 * (PING gets its PONG, its context cut to 16 bytes as libzmq does) or
 * ignored; ERROR ends the connection. A message is
 * handed over whole once its last frame is in; until then its bytes are
 * kept, growing with what arrived (never sized from a header), up to
 * zmtp_limits. Whatever breaks the protocol or a limit ends the connection
 * with a reason, and nothing of its unfinished message reaches the caller.
 *
 * Pure: no sockets, no threads. One zmtp_rx per connection, used by one
 * thread at a time. */
#ifndef KVF_WIRE_ZMTP_H
#define KVF_WIRE_ZMTP_H

#include <stddef.h>
#include <stdint.h>

#include "wire/messages.h" /* wire_frame */

#define ZMTP_GREETING_LEN 64
#define ZMTP_HELLO_MAX 96       /* kvf__zmtp_hello's bytes at most */
#define ZMTP_KEPT_FRAMES_MAX 32 /* frames of one message handed over; more are counted (zmtp_limits) */
#define ZMTP_COMMAND_MAX 65536u /* bytes of one command (READY carries the peer's properties) */

typedef struct zmtp_limits {
  size_t kept_frames;     /* frames handed over per message (<= ZMTP_KEPT_FRAMES_MAX); more are counted */
  size_t max_frames;      /* frames of one message at all: more ends the connection */
  uint64_t max_msg_bytes; /* bytes of one message, its frames together: more ends the connection */
} zmtp_limits;

typedef struct zmtp_rx {
  zmtp_limits lim;
  int stage;                             /* see zmtp.c */
  unsigned char head[ZMTP_GREETING_LEN]; /* the greeting, then a frame's flags and size, as they come */
  size_t nhead;
  unsigned flags; /* the frame being read */
  uint64_t left;  /* its bytes still to come */
  int in_frame;
  /* the message being assembled: its kept frames' bytes back to back */
  unsigned char *buf;
  size_t len, cap;
  uint64_t msg_bytes; /* all its frames' bytes, counted ones included */
  size_t nframes, extra;
  size_t flen[ZMTP_KEPT_FRAMES_MAX];
  /* a command frame being read (READY, PING, ...): in cmd_small when it
   * fits, else in a buffer of its size freed once it is handled */
  unsigned char *cmd;
  size_t cmd_len;
  unsigned char cmd_small[64];
} zmtp_rx;

/* What a connection's bytes produce: whole messages, and bytes to send back
 * (our PONGs; one that cannot go now is dropped: the peer's heartbeat is
 * its own to miss). */
typedef struct zmtp_sink {
  void *arg;
  void (*message)(void *arg, const wire_frame *frames, size_t n, size_t extra);
  void (*send)(void *arg, const void *bytes, size_t len);
} zmtp_sink;

void kvf__zmtp_rx_init(zmtp_rx *rx, const zmtp_limits *lim);
void kvf__zmtp_rx_free(zmtp_rx *rx);

/* 1 once the peer's greeting and READY are in (messages may come). */
int kvf__zmtp_rx_open(const zmtp_rx *rx);

/* Feed n bytes that arrived on the connection. 0, or KVF_EPROTO (a breach
 * of the protocol or a limit) or KVF_ENOMEM, with the reason in why: the
 * connection must end (a later feed returns KVF_EPROTO). */
int kvf__zmtp_rx_feed(zmtp_rx *rx, const void *bytes, size_t n, const zmtp_sink *sink, char *why, size_t whycap);

/* A PING command (no TTL, no context), to see whether a quiet peer is
 * still there: a ZMTP 3 peer answers PONG. */
#define ZMTP_PING_LEN 9
void kvf__zmtp_ping(unsigned char out[ZMTP_PING_LEN]);

/* What this end sends as soon as a peer connects: its greeting (version 3.0,
 * NULL) and its READY command (Socket-Type `socket_type`, e.g. "PULL").
 * Returns the length written to out (at least ZMTP_HELLO_MAX bytes). */
size_t kvf__zmtp_hello(unsigned char *out, const char *socket_type);

#endif

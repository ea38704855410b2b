/* See zmtp.h. Byte layouts (RFC 23): the greeting is signature (0xFF, 8
 * bytes of padding, 0x7F), version (major, minor), the mechanism's name
 * NUL-padded to 20 bytes, as-server, 31 bytes of filler. A frame is a flags
 * byte (bit 0 MORE, bit 1 LONG, bit 2 COMMAND, the rest zero), its size (1
 * byte, or 8 big-endian with LONG) and its bytes. A command's body is its
 * name (a length byte, then the name) and its data; READY's data is
 * properties, each a name (length byte, name) and a value (4-byte
 * big-endian length, value). */
#include "wire/zmtp.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "base/parse.h"
#include "kvferry/common.h"

#define FLAG_MORE 1u
#define FLAG_LONG 2u
#define FLAG_COMMAND 4u

enum { STAGE_GREETING, STAGE_READY, STAGE_OPEN, STAGE_BROKEN };

/* A message buffer larger than this is freed once its message went out, so
 * that an idle connection holds no more than this (a manager's usual
 * messages are well under it). */
#define ZMTP_BUF_KEEP (16u << 10)
#define PING_CONTEXT_MAX 16 /* RFC 37 */

void kvf__zmtp_rx_init(zmtp_rx *rx, const zmtp_limits *lim) {
  memset(rx, 0, sizeof *rx);
  rx->lim = *lim;
  if (rx->lim.kept_frames > ZMTP_KEPT_FRAMES_MAX) rx->lim.kept_frames = ZMTP_KEPT_FRAMES_MAX;
}

static void cmd_release(zmtp_rx *rx) {
  if (rx->cmd != rx->cmd_small) free(rx->cmd);
  rx->cmd = NULL;
  rx->cmd_len = 0;
}

void kvf__zmtp_rx_free(zmtp_rx *rx) {
  free(rx->buf);
  rx->buf = NULL;
  rx->len = rx->cap = 0;
  cmd_release(rx);
}

int kvf__zmtp_rx_open(const zmtp_rx *rx) { return rx->stage == STAGE_OPEN; }

static int fail(zmtp_rx *rx, int rc, char *why, size_t whycap, const char *text) {
  rx->stage = STAGE_BROKEN;
  if (why) kvf__str_copy(why, whycap, text);
  return rc;
}

static uint32_t be32(const unsigned char *p) {
  return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

/* The peer's READY: 0 when its Socket-Type may send to us (PUSH). */
static int on_ready(const unsigned char *d, size_t len, char *why, size_t whycap) {
  int typed = 0;
  for (size_t off = 0; off < len;) {
    size_t nl = d[off++];
    if (len - off < nl + 4) {
      snprintf(why, whycap, "malformed READY command (a property runs past its end)");
      return KVF_EPROTO;
    }
    const unsigned char *name = d + off;
    off += nl;
    uint32_t vl = be32(d + off);
    off += 4;
    if (vl > len - off) {
      snprintf(why, whycap, "malformed READY command (a property value runs past its end)");
      return KVF_EPROTO;
    }
    if (nl == 11 && !strncasecmp((const char *)name, "Socket-Type", 11)) {
      if (vl != 4 || memcmp(d + off, "PUSH", 4)) {
        snprintf(why, whycap, "peer socket type %.*s cannot send to this PULL socket", (int)(vl < 32 ? vl : 32),
                 (const char *)(d + off));
        return KVF_EPROTO;
      }
      typed = 1;
    }
    off += vl;
  }
  if (!typed) snprintf(why, whycap, "READY command without a Socket-Type");
  return typed ? 0 : KVF_EPROTO;
}

/* A whole command frame (rx->cmd, rx->cmd_len). */
static int on_command(zmtp_rx *rx, const zmtp_sink *sink, char *why, size_t whycap) {
  const unsigned char *b = rx->cmd;
  size_t len = rx->cmd_len;
  if (!len || (size_t)b[0] + 1 > len) return fail(rx, KVF_EPROTO, why, whycap, "malformed command (its name)");
  size_t nl = b[0];
  const char *name = (const char *)b + 1;
  const unsigned char *d = b + 1 + nl;
  size_t dl = len - 1 - nl;
  char text[160];
  if (nl == 5 && !memcmp(name, "ERROR", 5)) {
    size_t rl = dl ? d[0] : 0; /* the reason's length, then the reason */
    if (dl && rl > dl - 1) rl = dl - 1;
    snprintf(text, sizeof text, "the peer sent ERROR: %.*s", (int)(rl < 100 ? rl : 100),
             dl ? (const char *)d + 1 : "");
    return fail(rx, KVF_EPROTO, why, whycap, text);
  }
  if (rx->stage == STAGE_READY) {
    if (nl != 5 || memcmp(name, "READY", 5)) return fail(rx, KVF_EPROTO, why, whycap, "a command before READY");
    int rc = on_ready(d, dl, text, sizeof text);
    if (rc) return fail(rx, rc, why, whycap, text);
    rx->stage = STAGE_OPEN;
    return 0;
  }
  if (nl == 5 && !memcmp(name, "READY", 5)) return fail(rx, KVF_EPROTO, why, whycap, "READY twice");
  if (nl == 4 && !memcmp(name, "PING", 4)) { /* TTL (2 bytes), then a context to echo */
    if (dl < 2) return fail(rx, KVF_EPROTO, why, whycap, "malformed PING command");
    unsigned char pong[2 + 5 + PING_CONTEXT_MAX];
    size_t cl = dl - 2 < PING_CONTEXT_MAX ? dl - 2 : PING_CONTEXT_MAX; /* at most 16 (RFC 37), as libzmq */
    pong[0] = FLAG_COMMAND;
    pong[1] = (unsigned char)(5 + cl);
    memcpy(pong + 2, "\x04PONG", 5);
    memcpy(pong + 7, d + 2, cl);
    if (sink->send) sink->send(sink->arg, pong, 7 + cl); /* one not sent is the peer's to miss */
    return 0;
  }
  return 0; /* PONG, or a command this end does not use */
}

static void message_reset(zmtp_rx *rx) {
  rx->len = 0;
  rx->msg_bytes = 0;
  rx->nframes = rx->extra = 0;
  if (rx->cap > ZMTP_BUF_KEEP) {
    free(rx->buf);
    rx->buf = NULL;
    rx->cap = 0;
  }
}

static void deliver(zmtp_rx *rx, const zmtp_sink *sink) {
  wire_frame f[ZMTP_KEPT_FRAMES_MAX];
  size_t off = 0;
  for (size_t i = 0; i < rx->nframes; i++) {
    f[i] = (wire_frame){rx->flen[i] ? rx->buf + off : NULL, rx->flen[i]};
    off += rx->flen[i];
  }
  if (sink->message) sink->message(sink->arg, f, rx->nframes, rx->extra);
  message_reset(rx);
}

/* A frame's flags and size are in rx->head: check them against the stage
 * and the limits, and start reading its bytes. */
static int frame_begin(zmtp_rx *rx, uint64_t size, char *why, size_t whycap) {
  char text[160];
  if (rx->flags & FLAG_COMMAND) {
    if (rx->flags & FLAG_MORE) return fail(rx, KVF_EPROTO, why, whycap, "a command frame with the MORE flag");
    if (size > ZMTP_COMMAND_MAX) {
      snprintf(text, sizeof text, "a command of %llu bytes (at most %u)", (unsigned long long)size,
               ZMTP_COMMAND_MAX);
      return fail(rx, KVF_EPROTO, why, whycap, text);
    }
    rx->cmd = size <= sizeof rx->cmd_small ? rx->cmd_small : malloc(size);
    if (!rx->cmd) return fail(rx, KVF_ENOMEM, why, whycap, "out of memory for a command");
    rx->cmd_len = 0;
  } else {
    if (rx->stage != STAGE_OPEN) return fail(rx, KVF_EPROTO, why, whycap, "a message before the peer's READY");
    if (rx->nframes + rx->extra + 1 > rx->lim.max_frames) {
      snprintf(text, sizeof text, "a message of more than %zu frames", rx->lim.max_frames);
      return fail(rx, KVF_EPROTO, why, whycap, text);
    }
    if (size > rx->lim.max_msg_bytes - rx->msg_bytes) {
      snprintf(text, sizeof text, "a message of more than %llu bytes", (unsigned long long)rx->lim.max_msg_bytes);
      return fail(rx, KVF_EPROTO, why, whycap, text);
    }
    rx->msg_bytes += size;
    if (rx->nframes < rx->lim.kept_frames) rx->flen[rx->nframes] = 0;
    else rx->extra++;
  }
  rx->left = size;
  rx->in_frame = 1;
  return 0;
}

/* Some of the current frame's bytes. */
static int frame_bytes(zmtp_rx *rx, const unsigned char *p, size_t take, char *why, size_t whycap) {
  if (rx->flags & FLAG_COMMAND) {
    memcpy(rx->cmd + rx->cmd_len, p, take);
    rx->cmd_len += take;
  } else if (rx->nframes < rx->lim.kept_frames) { /* kept (past them, extra counts the frame) */
    if (rx->len + take > rx->cap) {               /* grows with what came, never from a header's size */
      size_t cap = rx->cap ? rx->cap * 2 : 4096;
      if (cap < rx->len + take) cap = rx->len + take;
      if (cap > rx->lim.max_msg_bytes) cap = (size_t)rx->lim.max_msg_bytes;
      unsigned char *nb = realloc(rx->buf, cap);
      if (!nb) return fail(rx, KVF_ENOMEM, why, whycap, "out of memory for a message");
      rx->buf = nb;
      rx->cap = cap;
    }
    memcpy(rx->buf + rx->len, p, take);
    rx->len += take;
    rx->flen[rx->nframes] += take;
  }
  rx->left -= take;
  return 0;
}

/* The current frame is whole. */
static int frame_end(zmtp_rx *rx, const zmtp_sink *sink, char *why, size_t whycap) {
  rx->in_frame = 0;
  if (rx->flags & FLAG_COMMAND) {
    int rc = on_command(rx, sink, why, whycap);
    cmd_release(rx);
    return rc;
  }
  if (rx->nframes < rx->lim.kept_frames) rx->nframes++;
  if (!(rx->flags & FLAG_MORE)) deliver(rx, sink);
  return 0;
}

static int greeting(zmtp_rx *rx, char *why, size_t whycap) {
  const unsigned char *g = rx->head;
  char text[160];
  if (g[0] != 0xFF || (rx->nhead >= 10 && g[9] != 0x7F))
    return fail(rx, KVF_EPROTO, why, whycap, "not a ZMTP peer (no greeting signature)");
  if (rx->nhead >= 11 && g[10] < 3) {
    snprintf(text, sizeof text, "ZMTP %u is not supported (3 or later)", g[10]);
    return fail(rx, KVF_EPROTO, why, whycap, text);
  }
  if (rx->nhead < ZMTP_GREETING_LEN) return 0;
  static const unsigned char null_mech[20] = "NULL";
  if (memcmp(g + 12, null_mech, sizeof null_mech)) {
    snprintf(text, sizeof text, "security mechanism %.20s is not supported (NULL only)", (const char *)g + 12);
    return fail(rx, KVF_EPROTO, why, whycap, text);
  }
  rx->stage = STAGE_READY;
  rx->nhead = 0;
  return 0;
}

int kvf__zmtp_rx_feed(zmtp_rx *rx, const void *bytes, size_t n, const zmtp_sink *sink, char *why, size_t whycap) {
  const unsigned char *p = bytes;
  if (rx->stage == STAGE_BROKEN)
    return fail(rx, KVF_EPROTO, why, whycap, "the connection already broke the protocol");
  while (n) {
    int rc = 0;
    if (rx->stage == STAGE_GREETING) {
      size_t take = ZMTP_GREETING_LEN - rx->nhead < n ? ZMTP_GREETING_LEN - rx->nhead : n;
      memcpy(rx->head + rx->nhead, p, take);
      rx->nhead += take, p += take, n -= take;
      if ((rc = greeting(rx, why, whycap))) return rc;
      continue;
    }
    if (!rx->in_frame) {
      rx->head[rx->nhead++] = *p++;
      n--;
      unsigned fl = rx->head[0];
      if (fl & ~(FLAG_MORE | FLAG_LONG | FLAG_COMMAND))
        return fail(rx, KVF_EPROTO, why, whycap, "a frame with reserved flag bits set");
      size_t need = 1 + (fl & FLAG_LONG ? 8 : 1);
      if (rx->nhead < need) continue;
      uint64_t size = rx->head[1];
      for (size_t i = 2; i < need; i++) size = size << 8 | rx->head[i];
      rx->flags = fl;
      rx->nhead = 0;
      if ((rc = frame_begin(rx, size, why, whycap))) return rc;
    } else {
      size_t take = rx->left < n ? (size_t)rx->left : n;
      if ((rc = frame_bytes(rx, p, take, why, whycap))) return rc;
      p += take, n -= take;
    }
    if (!rx->left && (rc = frame_end(rx, sink, why, whycap))) return rc;
  }
  return 0;
}

void kvf__zmtp_ping(unsigned char out[ZMTP_PING_LEN]) { memcpy(out, "\x04\x07\x04PING\x00\x00", ZMTP_PING_LEN); }

size_t kvf__zmtp_hello(unsigned char *out, const char *socket_type) {
  size_t tl = strlen(socket_type);
  if (tl > 16) tl = 16;
  memset(out, 0, ZMTP_GREETING_LEN);
  out[0] = 0xFF;
  out[9] = 0x7F;
  out[10] = 3; /* ZMTP 3.0 */
  out[11] = 0;
  memcpy(out + 12, "NULL", 4); /* as-server and the filler stay zero */
  unsigned char *b = out + ZMTP_GREETING_LEN;
  size_t body = 1 + 5 + 1 + 11 + 4 + tl;
  b[0] = FLAG_COMMAND;
  b[1] = (unsigned char)body;
  memcpy(b + 2, "\x05READY\x0bSocket-Type", 1 + 5 + 1 + 11);
  b[20] = 0, b[21] = 0, b[22] = 0, b[23] = (unsigned char)tl;
  memcpy(b + 24, socket_type, tl);
  return ZMTP_GREETING_LEN + 2 + body;
}

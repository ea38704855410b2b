/* The decode heartbeat's probe of prefill ranks themselves (issue 13,
 * defects 1 and 2). /health proves only that the bootstrap server answers,
 * and that server may live in another process than the ranks. What every
 * prefill rank exposes, kvferry's and tokenspeed's alike, is its ZMQ PULL
 * socket at the (rank_ip, rank_port) it registered. A ZMTP peer sends its
 * greeting signature (0xFF, 8 bytes, 0x7F) as soon as a connection is
 * accepted (tokenspeed's from libzmq's I/O thread, kvferry's from its
 * listener thread: kv/control.c), so reading those 10 bytes within a
 * deadline tells a live rank (greeting), a dead one (refused, reset, closed)
 * and a stopped or unreachable one (no greeting in time: a stopped process's
 * kernel still completes the TCP handshake, but nobody sends a greeting)
 * apart. Every rank of a round is probed at once, with one overall deadline.
 * The probe closes the connection after the signature; libzmq treats that as
 * a peer that went away during the handshake. */
#include "kv/probe.h"

#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "base/clock.h"

#define PROBE_SIG_LEN 10 /* ZMTP 2/3 greeting signature: 0xFF, 8 bytes of length, 0x7F */

typedef struct probe_sock {
  int fd;
  int connected;
  size_t got;
  unsigned char sig[PROBE_SIG_LEN];
} probe_sock;

/* A non-blocking connect to ip:port; fd -1 and *res set when it fails at once. */
static int start_connect(const kvf__probe_target *t, int *res) {
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM}, *ai = NULL;
  char port[8];
  snprintf(port, sizeof port, "%u", (unsigned)t->port);
  if (getaddrinfo(t->ip, port, &hints, &ai) || !ai) {
    *res = KVF_EINVAL;
    return -1;
  }
  int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) {
    *res = KVF_EIO;
  } else if (connect(fd, ai->ai_addr, ai->ai_addrlen) && errno != EINPROGRESS) {
    *res = errno == ECONNREFUSED ? KVF_ECLOSED : KVF_EIO;
    close(fd);
    fd = -1;
  }
  freeaddrinfo(ai);
  return fd;
}

/* Advance one socket on its poll events; returns 1 when its result is final. */
static int step(probe_sock *s, short revents, int *res) {
  if (!s->connected) {
    int err = 0;
    socklen_t len = sizeof err;
    if (getsockopt(s->fd, SOL_SOCKET, SO_ERROR, &err, &len) || err) {
      *res = err == ECONNREFUSED ? KVF_ECLOSED : KVF_EIO;
      return 1;
    }
    if (!(revents & POLLOUT)) {
      if (!(revents & (POLLHUP | POLLERR))) return 0;
      *res = KVF_ECLOSED; /* hung up without an error: do not poll it again */
      return 1;
    }
    s->connected = 1;
    return 0;
  }
  ssize_t n = recv(s->fd, s->sig + s->got, sizeof s->sig - s->got, 0);
  if (n == 0 || (n < 0 && errno != EAGAIN && errno != EINTR)) {
    *res = KVF_ECLOSED;
    return 1;
  }
  if (n > 0) s->got += (size_t)n;
  if (s->got < sizeof s->sig) return 0;
  *res = s->sig[0] == 0xFF && s->sig[9] == 0x7F ? 0 : KVF_EPROTO;
  return 1;
}

void kvf__probe_ranks(kvf__probe_target *t, size_t n, int timeout_ms) {
  probe_sock *s = calloc(n ? n : 1, sizeof *s);
  struct pollfd *pf = calloc(n ? n : 1, sizeof *pf);
  size_t open = 0;
  for (size_t i = 0; i < n; i++) {
    t[i].result = KVF_ETIMEDOUT;
    if (!s || !pf) {
      t[i].result = KVF_ENOMEM;
      continue;
    }
    s[i].fd = start_connect(&t[i], &t[i].result);
    if (s[i].fd >= 0) open++;
  }
  int64_t deadline = clock_deadline_ms(timeout_ms);
  while (open && s && pf) {
    int64_t left_ms = (deadline - clock_now_ns()) / 1000000;
    if (left_ms <= 0) break;
    for (size_t i = 0; i < n; i++)
      pf[i] = (struct pollfd){.fd = s[i].fd, .events = (short)(s[i].connected ? POLLIN : POLLOUT)};
    int r = poll(pf, n, (int)left_ms);
    if (r < 0 && errno != EINTR) break;
    for (size_t i = 0; r > 0 && i < n; i++) {
      if (s[i].fd < 0 || !pf[i].revents || !step(&s[i], pf[i].revents, &t[i].result)) continue;
      close(s[i].fd);
      s[i].fd = -1;
      open--;
    }
  }
  for (size_t i = 0; s && i < n; i++)
    if (s[i].fd >= 0) close(s[i].fd); /* still waiting: the result stays KVF_ETIMEDOUT */
  free(s);
  free(pf);
}

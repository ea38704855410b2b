/* The TCP transport of the transfer engine.
 *
 * Writer side: one session per remote "host:port", each with a few persistent
 * connections. A connection has a writer thread that sends queued chunks
 * (header, descriptors, then the payload straight from the source memory with
 * sendmsg) and a reader thread that matches in-order acks to in-flight chunks
 * and fails them at their deadline. Small chunks are sent by the submitting
 * thread itself when the connection is idle, which saves two thread wake-ups.
 *
 * Target side: an accept thread and one thread per inbound connection. A
 * chunk's framing is checked (tcp_frame.c) and its destination regions are
 * pinned before any payload byte is read; the payload is then received
 * directly into its destination (no staging copy) without the regions lock,
 * so a slow peer delays nobody else. A refused chunk's payload is drained
 * into a scratch buffer so the stream stays in step, and answered with
 * KVF_ERANGE. Malformed framing closes the connection; it never stops the
 * engine. The hello and each chunk have an overall deadline that trickled
 * bytes do not extend, and when every slot is taken a connection still in its
 * hello, or idle, is evicted to admit a new one. */
#include <errno.h>
#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "base/addr.h"
#include "base/clock.h"
#include "base/log.h"
#include "engine/engine_internal.h"
#include "engine/tcp_frame.h"
#include "engine/tcp_proto.h"

#define TCP_IOV_BATCH 512
#define TCP_INLINE_MAX_BYTES (1u << 20)
#define TCP_MAX_SESSIONS 4096
/* Every blocking receive ends within a tick, so overall deadlines (a batch's,
 * a hello's, an inbound chunk's) and unregisters are noticed in time. */
#define TCP_READER_TICK_MS 100
/* Attempts to evict a connection that keeps changing state under us. */
#define TCP_EVICT_TRIES 8

typedef struct tcp_state tcp_state;

/* ---------------------------------------------------------------- I/O helpers */

static void set_timeout(int fd, int opt, int ms) {
  struct timeval tv = {.tv_sec = ms / 1000, .tv_usec = (ms % 1000) * 1000};
  setsockopt(fd, SOL_SOCKET, opt, &tv, sizeof tv);
}

/* Read exactly len bytes; KVF_ECLOSED on EOF, KVF_ETIMEDOUT on SO_RCVTIMEO. */
static int recv_all(int fd, void *buf, size_t len) {
  char *p = buf;
  while (len) {
    ssize_t r = recv(fd, p, len, MSG_WAITALL);
    if (r > 0) {
      p += r;
      len -= (size_t)r;
    } else if (r == 0) {
      return KVF_ECLOSED;
    } else if (errno != EINTR) {
      return (errno == EAGAIN || errno == EWOULDBLOCK) ? KVF_ETIMEDOUT : KVF_ECLOSED;
    }
  }
  return 0;
}

static int send_all(int fd, const void *buf, size_t len) {
  const char *p = buf;
  while (len) {
    ssize_t r = send(fd, p, len, MSG_NOSIGNAL);
    if (r > 0) {
      p += r;
      len -= (size_t)r;
    } else if (r < 0 && errno != EINTR) {
      return (errno == EAGAIN || errno == EWOULDBLOCK) ? KVF_ETIMEDOUT : KVF_ECLOSED;
    }
  }
  return 0;
}

/* Read one fixed-size message from a socket whose SO_RCVTIMEO is a short
 * tick, without a poll() call first (each system call is costly on these
 * VMs). Returns 0 when the message is in, 1 when a tick passed with nothing
 * read (idle), or an error. Once a first byte has arrived the rest must
 * follow within `rest_ms`. */
static int recv_msg_or_idle(int fd, void *buf, size_t len, int tick_ms, int rest_ms) {
  char *p = buf;
  size_t got = 0;
  int waited = 0;
  while (got < len) {
    ssize_t r = recv(fd, p + got, len - got, MSG_WAITALL);
    if (r > 0) {
      got += (size_t)r;
    } else if (r == 0) {
      return KVF_ECLOSED;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (got == 0) return 1;
      waited += tick_ms;
      if (waited >= rest_ms) return KVF_ETIMEDOUT;
    } else if (errno != EINTR) {
      return KVF_ECLOSED;
    }
  }
  return 0;
}

/* Move an iovec array forward by n bytes. */
static void iov_advance(struct iovec **iov, int *cnt, size_t n) {
  while (n && *cnt) {
    if (n >= (*iov)->iov_len) {
      n -= (*iov)->iov_len;
      (*iov)++;
      (*cnt)--;
    } else {
      (*iov)->iov_base = (char *)(*iov)->iov_base + n;
      (*iov)->iov_len -= n;
      n = 0;
    }
  }
  while (*cnt && (*iov)->iov_len == 0) {
    (*iov)++;
    (*cnt)--;
  }
}

static int iov_xfer(int fd, struct iovec *iov, int cnt, int sending) {
  while (cnt) {
    struct msghdr m = {.msg_iov = iov, .msg_iovlen = (size_t)cnt};
    ssize_t r = sending ? sendmsg(fd, &m, MSG_NOSIGNAL) : recvmsg(fd, &m, MSG_WAITALL);
    if (r > 0) {
      iov_advance(&iov, &cnt, (size_t)r);
    } else if (r == 0 && !sending) {
      return KVF_ECLOSED;
    } else if (r < 0 && errno != EINTR) {
      return (errno == EAGAIN || errno == EWOULDBLOCK) ? KVF_ETIMEDOUT : KVF_ECLOSED;
    }
  }
  return 0;
}

/* Walks the pieces of a block list (strided blocks expand to count pieces)
 * and fills iovec batches, so any number of pieces costs O(1) memory. */
typedef struct piece_iter {
  size_t i;       /* block index */
  uint64_t piece; /* piece within the block */
} piece_iter;

typedef struct piece_src {
  /* Either writer-side blocks (src addresses) or target-side descriptors. */
  const kvf_write *writes;
  const tcp_desc *descs;
  size_t n;
} piece_src;

static int iter_fill(const piece_src *s, piece_iter *it, struct iovec *iov, int max) {
  int k = 0;
  while (k < max && it->i < s->n) {
    uint64_t base, len, count, stride;
    if (s->writes) {
      const kvf_write *w = &s->writes[it->i];
      base = w->src, len = w->len, count = w->count > 1 ? w->count : 1, stride = w->src_stride;
    } else {
      const tcp_desc *d = &s->descs[it->i];
      base = d->dst, len = d->len, count = d->count, stride = d->stride;
    }
    if (len == 0 || it->piece >= count) {
      it->i++;
      it->piece = 0;
      continue;
    }
    iov[k].iov_base = (void *)(uintptr_t)(base + it->piece * stride);
    iov[k].iov_len = len;
    k++;
    it->piece++;
  }
  return k;
}

/* Move every piece; `head` (may be NULL) goes first in the same system call,
 * so a small chunk is one sendmsg: header, descriptors and payload. */
static int xfer_pieces(int fd, const piece_src *s, int sending, const struct iovec *head, int nhead) {
  struct iovec iov[TCP_IOV_BATCH];
  piece_iter it = {0, 0};
  for (;;) {
    int k = 0;
    for (; k < nhead; k++) iov[k] = head[k];
    nhead = 0;
    k += iter_fill(s, &it, iov + k, TCP_IOV_BATCH - k);
    if (k == 0) return 0;
    int rc = iov_xfer(fd, iov, k, sending);
    if (rc) return rc;
  }
}

/* ------------------------------------------------------------ writer side */

typedef struct tcp_conn {
  atomic_int refs;
  int fd;
  atomic_int dead; /* 0, or the error that killed it */
  char peer[300];
  int timeout_ms;
  pthread_mutex_t send_lock; /* serialises bytes on the socket */
  pthread_mutex_t q_lock;    /* guards the two lists below */
  pthread_cond_t q_cv;
  chunk *q_head, *q_tail;    /* waiting to be sent */
  chunk *f_head, *f_tail;    /* sent, waiting for their ack, in wire order */
  uint64_t next_seq;
  pthread_t writer, reader;
} tcp_conn;

typedef struct tcp_session {
  pthread_mutex_t lock;
  char id[300];
  char host[256];
  uint16_t port;
  tcp_conn *conns[16];
  unsigned rr;
} tcp_session;

struct tcp_state {
  kvf_engine *e;
  int listen_fd;
  pthread_t accept_thread;
  atomic_int stopping;
  pthread_mutex_t in_lock;
  struct tcp_inbound *inbound; /* guarded by in_lock, as are the two counts */
  int n_inbound;
  int n_evicted; /* evicted, thread not yet joined */
  pthread_mutex_t sess_lock;
  smap sessions;
};

static void list_push(chunk **head, chunk **tail, chunk *c) {
  c->next = NULL;
  if (*tail) (*tail)->next = c;
  else *head = c;
  *tail = c;
}

static chunk *list_pop(chunk **head, chunk **tail) {
  chunk *c = *head;
  if (c) {
    *head = c->next;
    if (!*head) *tail = NULL;
    c->next = NULL;
  }
  return c;
}


/* Declare the connection dead: wake every thread blocked on it and fail
 * every chunk it holds. Idempotent; any thread. */
static void conn_fail(tcp_conn *c, int err) {
  int expected = 0;
  if (atomic_compare_exchange_strong(&c->dead, &expected, err)) {
    shutdown(c->fd, SHUT_RDWR);
    LOG_DEBUG("tcp", "connection to %s closed: %s", c->peer, kvf_strerror(err));
  }
  pthread_mutex_lock(&c->q_lock);
  chunk *q = c->q_head, *f = c->f_head;
  c->q_head = c->q_tail = c->f_head = c->f_tail = NULL;
  pthread_cond_broadcast(&c->q_cv);
  pthread_mutex_unlock(&c->q_lock);
  int st = atomic_load(&c->dead);
  while (f) {
    chunk *n = f->next;
    chunk_finish(f, st);
    f = n;
  }
  while (q) {
    chunk *n = q->next;
    chunk_finish(q, st);
    q = n;
  }
}

/* Put the chunk on the wire. The caller holds send_lock, so the in-flight
 * list order is the wire order, which is the ack order. */
static void conn_send_locked(tcp_conn *c, chunk *ch) {
  pthread_mutex_lock(&c->q_lock);
  int dead = atomic_load(&c->dead);
  if (!dead) {
    ch->seq = c->next_seq++;
    list_push(&c->f_head, &c->f_tail, ch);
  }
  pthread_mutex_unlock(&c->q_lock);
  if (dead) {
    chunk_finish(ch, dead);
    return;
  }
  tcp_desc descs_small[64], *descs = descs_small;
  if (ch->n > 64 && !(descs = malloc(ch->n * sizeof *descs))) {
    conn_fail(c, KVF_ENOMEM);
    return;
  }
  for (size_t i = 0; i < ch->n; i++) {
    const kvf_write *w = &ch->writes[i];
    descs[i] = (tcp_desc){w->dst, w->len, w->count > 1 ? w->count : 1, w->dst_stride};
  }
  tcp_chunk_hdr h = {TCP_CHUNK_MAGIC, (uint32_t)ch->n, ch->seq, ch->bytes};
  /* The reader may see the ack and finish the chunk before the last send
   * call returns: hold a reference so its blocks stay readable until then. */
  atomic_fetch_add(&ch->refs, 1);
  piece_src src = {.writes = ch->writes, .n = ch->n};
  struct iovec head[2] = {{&h, sizeof h}, {descs, ch->n * sizeof *descs}};
  int rc = xfer_pieces(c->fd, &src, 1, head, 2);
  chunk_release(ch);
  if (descs != descs_small) free(descs);
  if (rc) conn_fail(c, rc == KVF_ETIMEDOUT ? KVF_ETIMEDOUT : KVF_ECLOSED);
}

static void *conn_writer_main(void *arg) {
  tcp_conn *c = arg;
  for (;;) {
    pthread_mutex_lock(&c->q_lock);
    while (!c->q_head && !atomic_load(&c->dead)) pthread_cond_wait(&c->q_cv, &c->q_lock);
    chunk *ch = atomic_load(&c->dead) ? NULL : list_pop(&c->q_head, &c->q_tail);
    pthread_mutex_unlock(&c->q_lock);
    if (!ch) break;
    if (clock_now_ns() > ch->batch->deadline_ns) {
      chunk_finish(ch, KVF_ETIMEDOUT);
      continue;
    }
    pthread_mutex_lock(&c->send_lock);
    conn_send_locked(c, ch);
    pthread_mutex_unlock(&c->send_lock);
  }
  return NULL;
}

static void *conn_reader_main(void *arg) {
  tcp_conn *c = arg;
  while (!atomic_load(&c->dead)) {
    /* The socket's receive timeout is the idle tick (TCP_READER_TICK_MS). */
    tcp_ack a;
    int r = recv_msg_or_idle(c->fd, &a, sizeof a, TCP_READER_TICK_MS, c->timeout_ms);
    if (r == 1) {
      /* Idle tick: a chunk whose deadline passed means the peer stopped
       * answering (SIGSTOP, a hung host): fail the connection, and with it
       * everything it carries, rather than wait on TCP's own timers. */
      pthread_mutex_lock(&c->q_lock);
      int late = c->f_head && clock_now_ns() > c->f_head->batch->deadline_ns;
      pthread_mutex_unlock(&c->q_lock);
      if (late) {
        LOG_WARN("tcp", "peer %s did not confirm a batch before its deadline (%d ms)", c->peer,
                 c->timeout_ms);
        conn_fail(c, KVF_ETIMEDOUT);
      }
      continue;
    }
    if (r) {
      conn_fail(c, KVF_ECLOSED);
      break;
    }
    pthread_mutex_lock(&c->q_lock);
    chunk *ch = c->f_head;
    int ok = ch && a.magic == TCP_ACK_MAGIC && a.seq == ch->seq;
    if (ok) list_pop(&c->f_head, &c->f_tail);
    pthread_mutex_unlock(&c->q_lock);
    if (!ok) {
      LOG_ERROR("tcp", "peer %s sent an unexpected acknowledgement", c->peer);
      conn_fail(c, KVF_EPROTO);
      break;
    }
    chunk_finish(ch, a.status > 0 || a.status < KVF_ETOOBIG ? KVF_EPROTO : a.status);
  }
  return NULL;
}

static void conn_put(tcp_conn *c) {
  if (!c || atomic_fetch_sub(&c->refs, 1) != 1) return;
  conn_fail(c, KVF_ECLOSED);
  pthread_join(c->writer, NULL);
  pthread_join(c->reader, NULL);
  close(c->fd);
  pthread_mutex_destroy(&c->send_lock);
  pthread_mutex_destroy(&c->q_lock);
  pthread_cond_destroy(&c->q_cv);
  free(c);
}

/* Connect with a deadline: a non-blocking connect, then poll. */
static int connect_deadline(const char *host, uint16_t port, int64_t deadline_ns, int *fd_out) {
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                           .ai_flags = AI_NUMERICSERV};
  struct addrinfo *res = NULL;
  char ps[8];
  snprintf(ps, sizeof ps, "%u", (unsigned)port);
  if (getaddrinfo(host, ps, &hints, &res) || !res) return KVF_ECONNREFUSED;
  int rc = KVF_ECONNREFUSED;
  for (struct addrinfo *ai = res; ai; ai = ai->ai_next) {
    int fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (fd < 0) continue;
    int r = connect(fd, ai->ai_addr, ai->ai_addrlen);
    if (r < 0 && errno == EINPROGRESS) {
      int64_t left = (deadline_ns - clock_now_ns()) / 1000000;
      struct pollfd p = {.fd = fd, .events = POLLOUT};
      r = left > 0 && poll(&p, 1, (int)left) == 1 ? 0 : -1;
      int err = 0;
      socklen_t el = sizeof err;
      if (r == 0 && (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el) || err)) r = -1;
      if (left <= 0) rc = KVF_ETIMEDOUT;
    }
    if (r == 0) {
      fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) & ~O_NONBLOCK);
      int one = 1;
      setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
      *fd_out = fd;
      rc = 0;
      break;
    }
    close(fd);
  }
  freeaddrinfo(res);
  return rc;
}

static int conn_open(kvf_engine *e, tcp_session *s, int64_t deadline_ns, tcp_conn **out) {
  int fd = -1;
  int rc = connect_deadline(s->host, s->port, deadline_ns, &fd);
  if (rc) {
    LOG_WARN("tcp", "cannot connect to %s: %s", s->id, kvf_strerror(rc));
    return rc;
  }
  /* Handshake: the hello and our token, then the peer's verdict. */
  int64_t left = (deadline_ns - clock_now_ns()) / 1000000;
  set_timeout(fd, SO_RCVTIMEO, left > 1 ? (int)left : 1);
  set_timeout(fd, SO_SNDTIMEO, left > 1 ? (int)left : 1);
  size_t tl = strlen(e->auth_token);
  tcp_hello h = {TCP_HELLO_MAGIC, TCP_PROTO_VERSION, 0, (uint32_t)tl, 0};
  tcp_reply rep;
  rc = send_all(fd, &h, sizeof h);
  if (!rc && tl) rc = send_all(fd, e->auth_token, tl);
  if (!rc) rc = recv_all(fd, &rep, sizeof rep);
  if (!rc && (rep.magic != TCP_HELLO_MAGIC || rep.status > 0)) rc = KVF_EPROTO;
  if (!rc && rep.status) rc = rep.status == KVF_EACCES ? KVF_EACCES : KVF_ECONNREFUSED;
  if (rc) {
    LOG_WARN("tcp", "handshake with %s failed: %s", s->id, kvf_strerror(rc));
    goto err_close;
  }
  /* Data-phase sends may block while the peer drains; the reader's deadline
   * check is what bounds them (it shuts the socket down). Receives wake at
   * least every tick so the reader can check deadlines. */
  set_timeout(fd, SO_RCVTIMEO, TCP_READER_TICK_MS);
  set_timeout(fd, SO_SNDTIMEO, 0);

  tcp_conn *c = calloc(1, sizeof *c);
  if (!c) {
    rc = KVF_ENOMEM;
    goto err_close;
  }
  atomic_init(&c->refs, 1);
  c->fd = fd;
  c->timeout_ms = e->cfg.timeout_ms;
  snprintf(c->peer, sizeof c->peer, "%s", s->id);
  pthread_mutex_init(&c->send_lock, NULL);
  pthread_mutex_init(&c->q_lock, NULL);
  pthread_cond_init(&c->q_cv, NULL);
  if (pthread_create(&c->writer, NULL, conn_writer_main, c)) goto err_free_conn;
  if (pthread_create(&c->reader, NULL, conn_reader_main, c)) {
    conn_fail(c, KVF_ENOMEM);
    pthread_join(c->writer, NULL);
    goto err_free_conn;
  }
  *out = c;
  return 0;

err_free_conn:
  pthread_mutex_destroy(&c->send_lock);
  pthread_mutex_destroy(&c->q_lock);
  pthread_cond_destroy(&c->q_cv);
  free(c);
  rc = KVF_ENOMEM;
err_close:
  close(fd);
  return rc;
}

static int session_get(tcp_state *t, const char *id, tcp_session **out) {
  int rc = 0;
  pthread_mutex_lock(&t->sess_lock);
  tcp_session *s = smap_get(&t->sessions, id);
  if (!s) {
    if (smap_size(&t->sessions) >= TCP_MAX_SESSIONS) {
      rc = KVF_ENOMEM;
      goto out;
    }
    s = calloc(1, sizeof *s);
    if (!s) {
      rc = KVF_ENOMEM;
      goto out;
    }
    if (kvf__addr_parse(id, strlen(id), s->host, sizeof s->host, &s->port, NULL) ||
        smap_put(&t->sessions, id, s, NULL)) {
      free(s);
      rc = KVF_EINVAL;
      goto out;
    }
    pthread_mutex_init(&s->lock, NULL);
    snprintf(s->id, sizeof s->id, "%s", id);
  }
  *out = s;
out:
  pthread_mutex_unlock(&t->sess_lock);
  return rc;
}

static int tcp_submit(kvf_engine *e, const char *session, chunk **chunks, size_t nchunks) {
  tcp_state *t = e->transport;
  tcp_session *s;
  int rc = session_get(t, session, &s);
  if (rc) return rc;
  int nconn = e->cfg.conns_per_peer;
  size_t use = nchunks < (size_t)nconn ? nchunks : (size_t)nconn;
  tcp_conn *picked[16] = {0};
  int64_t deadline = chunks[0]->batch->deadline_ns;

  pthread_mutex_lock(&s->lock);
  unsigned start = s->rr;
  s->rr += (unsigned)use;
  for (size_t k = 0; k < use; k++) {
    int slot = (int)((start + k) % (unsigned)nconn);
    tcp_conn *c = s->conns[slot];
    if (c && atomic_load(&c->dead)) { /* reconnect after a failure */
      s->conns[slot] = NULL;
      conn_put(c);
      c = NULL;
    }
    if (!c) {
      rc = conn_open(e, s, deadline, &c);
      if (rc) break;
      s->conns[slot] = c;
    }
    atomic_fetch_add(&c->refs, 1);
    picked[k] = c;
  }
  pthread_mutex_unlock(&s->lock);
  if (rc) goto out_put;

  for (size_t i = 0; i < nchunks; i++) {
    tcp_conn *c = picked[i % use];
    chunk *ch = chunks[i];
    /* An idle connection and a small chunk: send from this thread. */
    if (ch->bytes <= TCP_INLINE_MAX_BYTES && pthread_mutex_trylock(&c->send_lock) == 0) {
      pthread_mutex_lock(&c->q_lock);
      int idle = !c->q_head;
      pthread_mutex_unlock(&c->q_lock);
      if (idle) {
        conn_send_locked(c, ch);
        pthread_mutex_unlock(&c->send_lock);
        continue;
      }
      pthread_mutex_unlock(&c->send_lock);
    }
    pthread_mutex_lock(&c->q_lock);
    int dead = atomic_load(&c->dead);
    if (!dead) {
      list_push(&c->q_head, &c->q_tail, ch);
      pthread_cond_signal(&c->q_cv);
    }
    pthread_mutex_unlock(&c->q_lock);
    if (dead) chunk_finish(ch, dead);
  }
out_put:
  for (size_t k = 0; k < use; k++) conn_put(picked[k]);
  return rc;
}

/* ------------------------------------------------------------ target side */

/* Where an inbound connection stands, for eviction when every slot is taken.
 * The connection's thread moves HELLO → IDLE → BUSY → IDLE ...; the accept
 * thread may move HELLO or IDLE to EVICTED (and shut the socket down), never
 * BUSY, so a chunk in progress is never cut to make room. */
enum { IN_HELLO, IN_IDLE, IN_BUSY, IN_EVICTED };

typedef struct tcp_inbound {
  struct tcp_inbound *next;
  tcp_state *t;
  int fd;
  atomic_int finished;
  atomic_int phase;
  atomic_llong idle_since_ns;
  atomic_ullong chunks; /* chunks answered on this connection */
  int64_t accepted_ns;
  uint64_t rx_bytes;    /* bytes received so far (this connection's thread only) */
  pthread_t thread;
  char peer[64];
} tcp_inbound;

/* The regions one chunk writes into, pinned while its payload arrives. */
typedef struct in_pins {
  region **r;
  size_t n;
  unsigned gen; /* the table's revocation count when they were pinned */
} in_pins;

static void peer_name(const struct sockaddr_storage *ss, char *out, size_t cap) {
  char host[INET6_ADDRSTRLEN] = "?", port[8] = "?";
  getnameinfo((const struct sockaddr *)ss, sizeof *ss, host, sizeof host, port, sizeof port,
              NI_NUMERICHOST | NI_NUMERICSERV);
  snprintf(out, cap, "%s:%s", host, port);
}

/* Report a misbehaving peer once per (peer address, kind). */
static void log_peer_once(const char *peer, const char *kind, const char *detail) {
  char key[96];
  const char *colon = strrchr(peer, ':');
  snprintf(key, sizeof key, "%.*s/%s", colon ? (int)(colon - peer) : (int)strlen(peer), peer, kind);
  if (log_first_time(log_hash_str(key, 7)))
    LOG_WARN("tcp", "peer %s: %s (further reports of this kind from it are not logged)", peer, detail);
}

static int pins_revoked(const tcp_inbound *in, const in_pins *p) {
  if (!p || atomic_load(&in->t->e->regions.revocations) == p->gen) return 0;
  for (size_t i = 0; i < p->n; i++)
    if (atomic_load(&p->r[i]->revoked)) return 1;
  return 0;
}

/* Receive into iov[cnt] (advanced as bytes arrive). The socket's receive
 * timeout is one tick (TCP_READER_TICK_MS), so every call ends within it and
 * the overall *deadline_ns holds however slowly the bytes trickle in. With
 * *deadline_ns == 0 the message has not started: a tick with no byte returns
 * 1 (idle), and the first byte sets the deadline to now + budget_ms. With
 * `pins`, the unregistering of a pinned region returns 2 at the next tick.
 * Otherwise 0, KVF_ETIMEDOUT or KVF_ECLOSED. */
static int in_recvv(tcp_inbound *in, struct iovec *iov, int cnt, int64_t *deadline_ns, int budget_ms,
                    const in_pins *pins) {
  while (cnt) {
    struct msghdr m = {.msg_iov = iov, .msg_iovlen = (size_t)cnt};
    ssize_t r = recvmsg(in->fd, &m, MSG_WAITALL);
    if (r > 0) {
      in->rx_bytes += (uint64_t)r;
      iov_advance(&iov, &cnt, (size_t)r);
      if (!*deadline_ns) *deadline_ns = clock_deadline_ms(budget_ms);
    } else if (r == 0) {
      return KVF_ECLOSED;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (!*deadline_ns) return 1;
    } else if (errno != EINTR) {
      return KVF_ECLOSED;
    }
    if (cnt && clock_now_ns() > *deadline_ns) return KVF_ETIMEDOUT;
    if (cnt && pins_revoked(in, pins)) return 2;
  }
  return 0;
}

static int in_recv(tcp_inbound *in, void *buf, size_t len, int64_t *deadline_ns, int budget_ms) {
  struct iovec iov = {buf, len};
  return in_recvv(in, &iov, len ? 1 : 0, deadline_ns, budget_ms, NULL);
}

/* Read and discard n bytes by the deadline, so the stream stays in step. */
static int in_drain(tcp_inbound *in, uint64_t n, int64_t *deadline_ns) {
  char buf[65536];
  while (n) {
    size_t k = n < sizeof buf ? (size_t)n : sizeof buf;
    int rc = in_recv(in, buf, k, deadline_ns, 0);
    if (rc) return rc;
    n -= k;
  }
  return 0;
}

/* Receive a checked chunk's payload straight into its destinations. Returns
 * 2 with *left set to the bytes not yet read when a pinned region was
 * unregistered meanwhile (the caller unpins, then drains them). */
static int in_recv_payload(tcp_inbound *in, const tcp_desc *d, uint32_t n, uint64_t total, const in_pins *pins,
                           int64_t *deadline_ns, uint64_t *left) {
  struct iovec iov[TCP_IOV_BATCH];
  piece_src src = {.descs = d, .n = n};
  piece_iter it = {0, 0};
  uint64_t start = in->rx_bytes;
  for (;;) {
    int k = iter_fill(&src, &it, iov, TCP_IOV_BATCH);
    if (k == 0) return 0;
    int rc = in_recvv(in, iov, k, deadline_ns, 0, pins);
    if (rc == 2) *left = total - (in->rx_bytes - start);
    if (rc) return rc;
  }
}

/* Count and report a peer cut at a deadline (hello or chunk). */
static void in_timed_out(tcp_inbound *in, kvf_engine *e, const char *what) {
  atomic_fetch_add(&e->stats.conns_timed_out, 1);
  log_peer_once(in->peer, "slow", what);
}

static void in_frame_error(tcp_inbound *in, kvf_engine *e, int verdict) {
  char msg[96];
  atomic_fetch_add(&e->stats.protocol_errors, 1);
  snprintf(msg, sizeof msg, "%s; connection dropped", kvf__tcp_frame_reason(verdict));
  log_peer_once(in->peer, "frame", msg);
}

static int inbound_handshake(tcp_inbound *in, kvf_engine *e) {
  tcp_hello h;
  char token[TCP_MAX_TOKEN];
  /* One deadline for the whole hello, from accept: a byte now and then does
   * not extend it. */
  int64_t deadline = in->accepted_ns + (int64_t)TCP_HELLO_DEADLINE_MS * 1000000;
  int rc = in_recv(in, &h, sizeof h, &deadline, 0);
  if (!rc) {
    int v = kvf__tcp_frame_hello(&h);
    if (v) {
      in_frame_error(in, e, v);
      return KVF_EPROTO;
    }
    rc = in_recv(in, token, h.token_len, &deadline, 0);
  }
  if (rc) {
    if (rc == KVF_ETIMEDOUT) in_timed_out(in, e, "no complete hello within the hello deadline; dropped");
    return rc;
  }
  size_t want = strlen(e->auth_token);
  int ok = 1;
  if (want) {
    /* Constant-time compare over the expected length. */
    unsigned diff = h.token_len != want;
    for (size_t i = 0; i < want; i++) diff |= (unsigned)(e->auth_token[i] ^ (i < h.token_len ? token[i] : 0));
    ok = diff == 0;
  }
  tcp_reply rep = {TCP_HELLO_MAGIC, ok ? 0 : KVF_EACCES};
  send_all(in->fd, &rep, sizeof rep);
  if (!ok) {
    atomic_fetch_add(&e->stats.auth_refused, 1);
    log_peer_once(in->peer, "auth", h.token_len ? "wrong auth token; refused" : "no auth token; refused");
    return KVF_EACCES;
  }
  atomic_store(&in->idle_since_ns, clock_now_ns());
  int expect = IN_HELLO;
  return atomic_compare_exchange_strong(&in->phase, &expect, IN_IDLE) ? 0 : KVF_ECLOSED;
}

/* Make room for the descriptors and pins of an ndesc chunk. */
static int in_grow(tcp_desc **descs, region ***pins, size_t *cap, uint32_t ndesc) {
  if (ndesc <= *cap) return 0;
  tcp_desc *d = realloc(*descs, ndesc * sizeof *d);
  if (d) *descs = d;
  region **p = d ? realloc(*pins, ndesc * sizeof *p) : NULL;
  if (!p) return KVF_ENOMEM;
  *pins = p;
  *cap = ndesc;
  return 0;
}

/* One chunk after its header: descriptors, checks, payload; returns the
 * status to acknowledge, or a negative error that ends the connection
 * (reported here). The regions lock is held only to look up and pin. */
static int inbound_chunk(tcp_inbound *in, kvf_engine *e, const tcp_chunk_hdr *h, tcp_desc *descs, region **pinv,
                         int64_t *deadline, int *status) {
  int rc = in_recv(in, descs, h->ndesc * sizeof *descs, deadline, 0);
  if (rc) return rc;
  int v = kvf__tcp_frame_descs(h, descs);
  if (v) {
    in_frame_error(in, e, v);
    return KVF_EPROTO;
  }
  in_pins pins = {.r = pinv};
  pthread_rwlock_rdlock(&e->regions.lock);
  v = kvf__tcp_frame_ranges_locked(&e->regions, descs, h->ndesc, pinv, &pins.n);
  for (size_t i = 0; !v && i < pins.n; i++) kvf__region_pin(pinv[i]);
  pins.gen = atomic_load(&e->regions.revocations);
  pthread_rwlock_unlock(&e->regions.lock);
  uint64_t left = h->total_bytes;
  if (!v) {
    kvf_engine_sync(e); /* order after the owner's last local change */
    rc = in_recv_payload(in, descs, h->ndesc, h->total_bytes, &pins, deadline, &left);
    kvf_engine_sync(e); /* publish the bytes to the owner's next sync */
    for (size_t i = 0; i < pins.n; i++) kvf__region_unpin(&e->regions, pinv[i]);
    if (rc == 2) {
      log_peer_once(in->peer, "revoked", "destination unregistered during a write; rest of the chunk refused");
      v = TCP_FRAME_OUT_OF_RANGE;
      rc = 0;
    } else {
      left = 0;
    }
  } else {
    log_peer_once(in->peer, "range", "write outside registered memory refused");
  }
  if (!rc && left) rc = in_drain(in, left, deadline);
  if (rc) return rc;
  if (v) {
    atomic_fetch_add(&e->stats.batches_refused, 1);
  } else {
    atomic_fetch_add(&e->stats.batches_received, 1);
    atomic_fetch_add(&e->stats.bytes_received, h->total_bytes);
  }
  *status = v ? KVF_ERANGE : 0;
  return 0;
}

static void *inbound_main(void *arg) {
  tcp_inbound *in = arg;
  kvf_engine *e = in->t->e;
  tcp_desc *descs = NULL;
  region **pins = NULL;
  size_t cap = 0;
  if (inbound_handshake(in, e)) goto out;
  for (;;) {
    /* Idle between chunks is fine (a tick with nothing read); from its first
     * byte a chunk (header, descriptors, payload) has the engine timeout in
     * all, however its bytes trickle in. */
    tcp_chunk_hdr h;
    int64_t deadline = 0;
    int rc = in_recv(in, &h, sizeof h, &deadline, e->cfg.timeout_ms);
    if (atomic_load(&in->t->stopping)) break;
    if (rc == 1) continue;
    int expect = IN_IDLE;
    if (rc || !atomic_compare_exchange_strong(&in->phase, &expect, IN_BUSY)) goto out_err;
    int v = kvf__tcp_frame_chunk_hdr(&h);
    if (v) {
      in_frame_error(in, e, v);
      break;
    }
    if (in_grow(&descs, &pins, &cap, h.ndesc)) break;
    int status = 0;
    rc = inbound_chunk(in, e, &h, descs, pins, &deadline, &status);
    if (rc) goto out_err;
    tcp_ack a = {h.seq, status, TCP_ACK_MAGIC};
    if (send_all(in->fd, &a, sizeof a)) break;
    atomic_fetch_add(&in->chunks, 1);
    atomic_store(&in->idle_since_ns, clock_now_ns());
    atomic_store(&in->phase, IN_IDLE);
    continue;
  out_err:
    if (rc == KVF_ETIMEDOUT) in_timed_out(in, e, "chunk not complete within the engine timeout; dropped");
    break;
  }
out:
  free(descs);
  free(pins);
  shutdown(in->fd, SHUT_RDWR);
  atomic_store(&in->finished, 1);
  return NULL;
}

/* Every slot is taken: close the connection that holds one for the least
 * reason, so neither silent nor trickling peers can keep a legitimate one
 * out. Order: the oldest still in its hello, then the oldest idle one that
 * never sent a chunk, then the one idle longest. A connection inside a chunk
 * is never chosen. Caller holds in_lock; 1 if one was evicted. */
static tcp_inbound *pick_victim_locked(tcp_state *t, int *phase_out) {
  tcp_inbound *victim = NULL;
  int vrank = 0;
  int64_t vkey = 0;
  for (tcp_inbound *in = t->inbound; in; in = in->next) {
    int ph = atomic_load(&in->phase), rank;
    int64_t key;
    if (ph == IN_HELLO) rank = 0, key = in->accepted_ns;
    else if (ph == IN_IDLE) rank = atomic_load(&in->chunks) ? 2 : 1, key = atomic_load(&in->idle_since_ns);
    else continue;
    if (!victim || rank < vrank || (rank == vrank && key < vkey)) victim = in, vrank = rank, vkey = key, *phase_out = ph;
  }
  return victim;
}

static int evict_one_locked(tcp_state *t) {
  tcp_inbound *victim = NULL;
  /* The victim's own thread may move it on meanwhile (its hello done, a
   * chunk begun): then look again. */
  for (int tries = 0; !victim && tries < TCP_EVICT_TRIES; tries++) {
    int phase = 0;
    victim = pick_victim_locked(t, &phase);
    if (!victim) return 0;
    if (!atomic_compare_exchange_strong(&victim->phase, &phase, IN_EVICTED)) victim = NULL;
  }
  if (!victim) return 0;
  shutdown(victim->fd, SHUT_RDWR);
  t->n_evicted++;
  atomic_fetch_add(&t->e->stats.conns_evicted, 1);
  log_peer_once(victim->peer, "evict", "connection slots full; idle or unauthenticated connection closed");
  return 1;
}

static void inbound_reap(tcp_state *t, int all) {
  pthread_mutex_lock(&t->in_lock);
  tcp_inbound **pp = &t->inbound;
  while (*pp) {
    tcp_inbound *in = *pp;
    if (all) shutdown(in->fd, SHUT_RDWR);
    if (all || atomic_load(&in->finished)) {
      *pp = in->next;
      t->n_inbound--;
      if (atomic_load(&in->phase) == IN_EVICTED) t->n_evicted--;
      pthread_mutex_unlock(&t->in_lock);
      pthread_join(in->thread, NULL);
      close(in->fd);
      free(in);
      pthread_mutex_lock(&t->in_lock);
    } else {
      pp = &in->next;
    }
  }
  pthread_mutex_unlock(&t->in_lock);
}

/* Is there a slot for one more connection, evicting one if need be? Evicted
 * connections hold their thread until it notices, so the live count is kept
 * under the limit and the total under twice it. */
static int inbound_admit(tcp_state *t) {
  int max = t->e->cfg.max_inbound_conns, ok;
  pthread_mutex_lock(&t->in_lock);
  ok = t->n_inbound < 2 * max && (t->n_inbound - t->n_evicted < max || evict_one_locked(t));
  pthread_mutex_unlock(&t->in_lock);
  return ok;
}

static void *accept_main(void *arg) {
  tcp_state *t = arg;
  kvf_engine *e = t->e;
  while (!atomic_load(&t->stopping)) {
    struct sockaddr_storage ss;
    socklen_t sl = sizeof ss;
    int fd = accept4(t->listen_fd, (struct sockaddr *)&ss, &sl, SOCK_CLOEXEC);
    if (fd < 0) {
      if (errno == EINTR || errno == ECONNABORTED) continue;
      if (atomic_load(&t->stopping)) break;
      if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS || errno == ENOMEM) {
        usleep(10000); /* out of descriptors: back off instead of spinning */
        continue;
      }
      break;
    }
    int64_t now = clock_now_ns();
    inbound_reap(t, 0);
    char peer[64];
    peer_name(&ss, peer, sizeof peer);
    tcp_inbound *in = inbound_admit(t) ? calloc(1, sizeof *in) : NULL;
    if (!in) {
      atomic_fetch_add(&e->stats.conns_refused, 1);
      log_peer_once(peer, "limit", "too many inbound connections; refused");
      close(fd);
      continue;
    }
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    /* Receives end every tick so deadlines and revocations are checked;
     * replies and acks are small, but a peer that never reads is bounded. */
    set_timeout(fd, SO_RCVTIMEO, TCP_READER_TICK_MS);
    set_timeout(fd, SO_SNDTIMEO, e->cfg.timeout_ms);
    in->t = t;
    in->fd = fd;
    in->accepted_ns = now;
    atomic_init(&in->phase, IN_HELLO);
    snprintf(in->peer, sizeof in->peer, "%s", peer);
    /* Listed before its thread starts, so eviction sees every connection. */
    pthread_mutex_lock(&t->in_lock);
    in->next = t->inbound;
    t->inbound = in;
    t->n_inbound++;
    if (pthread_create(&in->thread, NULL, inbound_main, in)) {
      t->inbound = in->next;
      t->n_inbound--;
      close(fd);
      free(in);
    }
    pthread_mutex_unlock(&t->in_lock);
  }
  return NULL;
}

static int listen_on(kvf_engine *e, int *fd_out, uint16_t *port_out) {
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
                           .ai_flags = AI_PASSIVE | AI_NUMERICSERV};
  struct addrinfo *res = NULL;
  char ps[8];
  snprintf(ps, sizeof ps, "%u", (unsigned)e->cfg.port);
  int g = getaddrinfo(e->host, ps, &hints, &res);
  if (g || !res) {
    LOG_ERROR("tcp", "cannot resolve listen address %s: %s", e->host, gai_strerror(g));
    return KVF_EINVAL;
  }
  int fd = socket(res->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
  int one = 1;
  int rc = KVF_EIO;
  if (fd < 0) goto out;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
  if (bind(fd, res->ai_addr, res->ai_addrlen) || listen(fd, 128)) {
    LOG_ERROR("tcp", "cannot listen on %s:%u: %s", e->host, (unsigned)e->cfg.port, strerror(errno));
    close(fd);
    goto out;
  }
  struct sockaddr_storage ss;
  socklen_t sl = sizeof ss;
  getsockname(fd, (struct sockaddr *)&ss, &sl);
  *port_out = ntohs(ss.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&ss)->sin6_port
                                             : ((struct sockaddr_in *)&ss)->sin_port);
  *fd_out = fd;
  rc = 0;
out:
  freeaddrinfo(res);
  return rc;
}

static int tcp_start(kvf_engine *e) {
  tcp_state *t = calloc(1, sizeof *t);
  if (!t) return KVF_ENOMEM;
  t->e = e;
  int rc = smap_init(&t->sessions);
  if (rc) goto err_free;
  rc = listen_on(e, &t->listen_fd, &e->port);
  if (rc) goto err_map;
  pthread_mutex_init(&t->in_lock, NULL);
  pthread_mutex_init(&t->sess_lock, NULL);
  if (pthread_create(&t->accept_thread, NULL, accept_main, t)) {
    rc = KVF_ENOMEM;
    goto err_listen;
  }
  e->transport = t;
  return 0;

err_listen:
  close(t->listen_fd);
  pthread_mutex_destroy(&t->in_lock);
  pthread_mutex_destroy(&t->sess_lock);
err_map:
  smap_free(&t->sessions);
err_free:
  free(t);
  return rc;
}

static void tcp_stop(kvf_engine *e) {
  tcp_state *t = e->transport;
  if (!t) return;
  atomic_store(&t->stopping, 1);
  shutdown(t->listen_fd, SHUT_RDWR);
  pthread_join(t->accept_thread, NULL);
  close(t->listen_fd);
  inbound_reap(t, 1);
  map_iter it;
  map_iter_init(&it);
  void *v;
  while (smap_next(&t->sessions, &it, NULL, &v)) {
    tcp_session *s = v;
    for (int i = 0; i < 16; i++) conn_put(s->conns[i]);
    pthread_mutex_destroy(&s->lock);
    free(s);
  }
  smap_free(&t->sessions);
  pthread_mutex_destroy(&t->in_lock);
  pthread_mutex_destroy(&t->sess_lock);
  free(t);
  e->transport = NULL;
}

const transport_ops tcp_transport_ops = {
    .name = "tcp",
    .start = tcp_start,
    .stop = tcp_stop,
    .submit = tcp_submit,
};

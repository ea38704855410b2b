/* The TCP transport's writer side: one session per remote "host:port", each with a few persistent
 * connections. A connection has a writer thread that sends queued chunks
 * (header, descriptors, then the payload straight from the source memory with
 * sendmsg) and a reader thread that matches in-order acks to in-flight chunks
 * and fails them at their deadline. Small chunks are sent by the submitting
 * thread itself when the connection is idle, which saves two thread wake-ups.
 * Both threads run only while the connection has work: each ends after
 * TCP_CONN_IDLE_MS idle, and the next chunk queued (writer) or sent
 * (reader) starts it again, so an idle peer costs no thread. While no
 * reader runs, a submit first checks that the peer has not closed the
 * idle connection (conn_check_idle) and connects again if it has. */
#include "engine/tcp_int.h"
#include "base/thread.h"
#include "base/parse.h"

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
    kvf__chunk_finish(f, st);
    f = n;
  }
  while (q) {
    chunk *n = q->next;
    kvf__chunk_finish(q, st);
    q = n;
  }
}

static void *conn_writer_main(void *arg);
static void *conn_reader_main(void *arg);

/* Under q_lock: make sure the connection's writer (or reader) runs: start
 * one, joining the one that ended idle first (it released q_lock before
 * returning, so the join does not wait on us). 0 or KVF_ENOMEM. */
static int thread_need_locked(tcp_conn *c, int reader) {
  int *on = reader ? &c->reader_on : &c->writer_on, *joinable = reader ? &c->reader_joinable : &c->writer_joinable;
  pthread_t *t = reader ? &c->reader : &c->writer;
  if (*on) return 0;
  if (*joinable) pthread_join(*t, NULL);
  *joinable = 0;
  if (pthread_create(t, NULL, reader ? conn_reader_main : conn_writer_main, c)) return KVF_ENOMEM;
  *joinable = *on = 1;
  return 0;
}

/* Put the chunk on the wire. The caller holds send_lock, so the in-flight
 * list order is the wire order, which is the ack order. */
static void conn_send_locked(tcp_conn *c, chunk *ch) {
  pthread_mutex_lock(&c->q_lock);
  int dead = atomic_load(&c->dead);
  if (!dead) {
    ch->seq = c->next_seq++;
    /* From the moment it is on the in-flight list the reader may finish the
     * chunk (its ack, or a failed connection): this thread's reference,
     * taken first, keeps the chunk and its batch readable until the last
     * send call returns. */
    atomic_fetch_add(&ch->refs, 1);
    list_push(&c->f_head, &c->f_tail, ch);
    c->sending_deadline_ns = ch->batch->deadline_ns;
  }
  int no_reader = !dead && thread_need_locked(c, 1);
  pthread_mutex_unlock(&c->q_lock);
  if (dead) {
    kvf__chunk_finish(ch, dead);
    return;
  }
  if (no_reader) { /* nobody would read its ack or watch its deadline */
    conn_fail(c, KVF_ENOMEM);
    kvf__chunk_release(ch);
    return;
  }
  tcp_desc descs_small[64], *descs = descs_small;
  if (ch->n > 64 && !(descs = malloc(ch->n * sizeof *descs))) {
    conn_fail(c, KVF_ENOMEM);
    kvf__chunk_release(ch);
    return;
  }
  for (size_t i = 0; i < ch->n; i++) {
    const kvf_write *w = &ch->writes[i];
    descs[i] = (tcp_desc){w->dst, w->len, w->count > 1 ? w->count : 1, w->dst_stride};
  }
  const kvf_batch *b = ch->batch;
  uint32_t magic = b->tag ? (ch->trailer ? TCP_CHUNK_TAGGED_TRAILER_MAGIC : TCP_CHUNK_TAGGED_MAGIC)
                          : (ch->trailer ? TCP_CHUNK_TRAILER_MAGIC : TCP_CHUNK_MAGIC);
  tcp_chunk_hdr h = {magic, (uint32_t)ch->n, ch->seq, ch->bytes};
  tcp_chunk_tag tag = {b->tag, b->epoch};
  piece_src src = {.writes = ch->writes, .n = ch->n};
  struct iovec head[3] = {{&h, sizeof h}, {&tag, b->tag ? sizeof tag : 0}, {descs, ch->n * sizeof *descs}};
  /* The trailer goes behind the payload, on the same connection. */
  tcp_trailer t = {TCP_TRAILER_MAGIC, ch->tlen};
  struct iovec tail[2] = {{&t, sizeof t}, {ch->trailer, ch->tlen}};
  int rc = kvf__tcp_xfer_pieces(c->fd, &src, 1, head, 3, tail, ch->trailer ? 2 : 0);
  pthread_mutex_lock(&c->q_lock);
  c->sending_deadline_ns = 0;
  pthread_mutex_unlock(&c->q_lock);
  /* A send cut short by another thread's conn_fail (the reader's deadline
   * watch shuts the socket down, so the send sees EPIPE) reports that
   * failure, set before the shutdown, not the broken pipe it caused. */
  int err = rc ? atomic_load(&c->dead) : 0;
  if (rc && !err) err = rc == KVF_ETIMEDOUT ? KVF_ETIMEDOUT : KVF_ECLOSED;
  if (err) kvf__chunk_fail(ch, err); /* acknowledged before it went */
  kvf__chunk_release(ch);
  if (descs != descs_small) free(descs);
  if (err) conn_fail(c, err);
}

static void *conn_writer_main(void *arg) {
  kvf__thread_name("kvf-tcp-write");
  tcp_conn *c = arg;
  for (;;) {
    pthread_mutex_lock(&c->q_lock);
    int idle = 0;
    while (!c->q_head && !atomic_load(&c->dead) && !idle) {
      struct timespec ts = clock_ts_from_ns(clock_deadline_ms(TCP_CONN_IDLE_MS));
      idle = pthread_cond_timedwait(&c->q_cv, &c->q_lock, &ts) == ETIMEDOUT && !c->q_head;
    }
    chunk *ch = atomic_load(&c->dead) || idle ? NULL : list_pop(&c->q_head, &c->q_tail);
    if (!ch) c->writer_on = 0; /* the next queued chunk starts another */
    pthread_mutex_unlock(&c->q_lock);
    if (!ch) break;
    kvf__wake_count();
    if (clock_now_ns() > ch->batch->deadline_ns) {
      kvf__chunk_finish(ch, KVF_ETIMEDOUT);
      continue;
    }
    pthread_mutex_lock(&c->send_lock);
    conn_send_locked(c, ch);
    pthread_mutex_unlock(&c->send_lock);
  }
  return NULL;
}

static void *conn_reader_main(void *arg) {
  kvf__thread_name("kvf-tcp-ack");
  tcp_conn *c = arg;
  tcp_ack acks[TCP_ACK_BATCH];
  size_t got = 0; /* bytes in acks: whole acks, then the start of the next */
  int idle_ticks = 0;
  while (!atomic_load(&c->dead)) {
    /* The socket's receive timeout is the idle tick (TCP_READER_TICK_MS). */
    int r =
        kvf__tcp_recv_msg_or_idle(c->fd, acks, sizeof *acks, sizeof acks, &got, TCP_READER_TICK_MS, c->timeout_ms);
    if (r == 1) {
      /* Idle tick: a chunk whose deadline passed means the peer stopped
       * answering (SIGSTOP, a hung host): fail the connection, and with it
       * everything it carries, rather than wait on TCP's own timers. With
       * nothing in flight for TCP_CONN_IDLE_MS this thread ends (the next
       * chunk sent starts another). */
      pthread_mutex_lock(&c->q_lock);
      int64_t now = clock_now_ns();
      int late = (c->f_head && now > c->f_head->batch->deadline_ns) ||
                 (c->sending_deadline_ns && now > c->sending_deadline_ns);
      idle_ticks = c->f_head || c->sending_deadline_ns || got ? 0 : idle_ticks + 1;
      int retire = idle_ticks * TCP_READER_TICK_MS >= TCP_CONN_IDLE_MS;
      if (retire) c->reader_on = 0;
      pthread_mutex_unlock(&c->q_lock);
      if (retire) return NULL;
      if (late) {
        LOG_WARN("tcp", "peer %s did not confirm a batch before its deadline (%d ms)", c->peer, c->timeout_ms);
        conn_fail(c, KVF_ETIMEDOUT);
      }
      continue;
    }
    idle_ticks = 0;
    if (r) {
      conn_fail(c, KVF_ECLOSED);
      break;
    }
    kvf__wake_count();
    size_t n = got / sizeof *acks; /* every ack that came in this read, in order */
    for (size_t i = 0; i < n; i++) {
      const tcp_ack *a = &acks[i];
      pthread_mutex_lock(&c->q_lock);
      chunk *ch = c->f_head;
      int ok = ch && a->magic == TCP_ACK_MAGIC && a->seq == ch->seq;
      if (ok) list_pop(&c->f_head, &c->f_tail);
      pthread_mutex_unlock(&c->q_lock);
      if (!ok) {
        LOG_ERROR("tcp", "peer %s sent an unexpected acknowledgement", c->peer);
        conn_fail(c, KVF_EPROTO);
        return NULL;
      }
      kvf__chunk_finish(ch, a->status > 0 || a->status < KVF_ETOOBIG ? KVF_EPROTO : a->status);
    }
    got -= n * sizeof *acks;
    if (got) memmove(acks, &acks[n], got);
  }
  return NULL;
}

void kvf__tcp_conn_put(tcp_conn *c) {
  if (!c || atomic_fetch_sub(&c->refs, 1) != 1) return;
  conn_fail(c, KVF_ECLOSED);
  /* The last reference: no submit can start a thread any more. */
  if (c->writer_joinable) pthread_join(c->writer, NULL);
  if (c->reader_joinable) pthread_join(c->reader, NULL);
  close(c->fd);
  pthread_mutex_destroy(&c->send_lock);
  pthread_mutex_destroy(&c->q_lock);
  pthread_cond_destroy(&c->q_cv);
  free(c);
}

/* Connect with a deadline: a non-blocking connect, then poll. */
static int connect_deadline(const char *host, uint16_t port, int64_t deadline_ns, int *fd_out) {
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV};
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
      int w = kvf__fd_wait(fd, POLLOUT, deadline_ns);
      r = w ? -1 : 0;
      int err = 0;
      socklen_t el = sizeof err;
      if (r == 0 && (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &el) || err)) r = -1;
      if (w) rc = w; /* timed out, or a stopping engine */
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

int kvf__tcp_connect(const char *host, uint16_t port, int64_t deadline_ns, int *fd_out) {
  return connect_deadline(host, port, deadline_ns, fd_out);
}

static int conn_open(kvf_engine *e, tcp_session *s, int64_t deadline_ns, tcp_conn **out) {
  int fd = -1;
  int rc = connect_deadline(s->host, s->port, deadline_ns, &fd);
  if (rc) {
    LOG_WARN("tcp", "cannot connect to %s: %s", s->id, kvf_strerror(rc));
    return rc;
  }
  /* Handshake: the hello and our token, then the peer's verdict. */
  size_t tl = strlen(e->auth_token);
  tcp_hello h = {TCP_HELLO_MAGIC, TCP_PROTO_VERSION, 0, (uint32_t)tl, 0};
  tcp_reply rep;
  rc = kvf__fd_send_all(fd, &h, sizeof h, deadline_ns);
  if (!rc && tl) rc = kvf__fd_send_all(fd, e->auth_token, tl, deadline_ns);
  if (!rc) rc = kvf__fd_recv_all(fd, &rep, sizeof rep, deadline_ns);
  if (!rc && (rep.magic != TCP_HELLO_MAGIC || rep.status > 0)) rc = KVF_EPROTO;
  if (!rc && rep.status) rc = rep.status == KVF_EACCES ? KVF_EACCES : KVF_ECONNREFUSED;
  if (rc) {
    LOG_WARN("tcp", "handshake with %s failed: %s", s->id, kvf_strerror(rc));
    goto err_close;
  }
  /* Data-phase sends may block while the peer drains; the reader's deadline
   * check is what bounds them (it shuts the socket down). Receives wake at
   * least every tick so the reader can check deadlines. */
  kvf__tcp_set_timeout(fd, SO_RCVTIMEO, TCP_READER_TICK_MS);
  kvf__tcp_set_timeout(fd, SO_SNDTIMEO, 0);

  tcp_conn *c = calloc(1, sizeof *c);
  if (!c) {
    rc = KVF_ENOMEM;
    goto err_close;
  }
  atomic_init(&c->refs, 1);
  c->fd = fd;
  c->timeout_ms = e->cfg.timeout_ms;
  kvf__str_copy(c->peer, sizeof c->peer, s->id);
  pthread_mutex_init(&c->send_lock, NULL);
  pthread_mutex_init(&c->q_lock, NULL);
  clock_cond_init(&c->q_cv);
  *out = c; /* its threads start with its first chunk */
  return 0;

err_close:
  close(fd);
  return rc;
}

static int session_get(tcp_state *t, const char *id, tcp_session **out) {
  int rc = 0;
  pthread_mutex_lock(&t->sess_lock);
  tcp_session *s = kvf__smap_get(&t->sessions, id);
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
        kvf__smap_put(&t->sessions, id, s, NULL)) {
      free(s);
      rc = KVF_EINVAL;
      goto out;
    }
    pthread_mutex_init(&s->lock, NULL);
    kvf__str_copy(s->id, sizeof s->id, id);
  }
  *out = s;
out:
  pthread_mutex_unlock(&t->sess_lock);
  return rc;
}

/* A connection with no reader running (idle): has the peer closed it (an
 * end of stream or an error waiting), or sent bytes no chunk asked for?
 * Then it is failed here, so that the caller connects again instead of
 * losing a chunk to it. */
static void conn_check_idle(tcp_conn *c) {
  pthread_mutex_lock(&c->q_lock);
  int idle = !c->reader_on && !atomic_load(&c->dead);
  pthread_mutex_unlock(&c->q_lock);
  if (!idle) return;
  char b;
  ssize_t r = recv(c->fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
  if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) conn_fail(c, KVF_ECLOSED);
  else if (r > 0) conn_fail(c, KVF_EPROTO);
}

/* An idle connection and a small chunk: send it from this thread (1), or
 * leave it to the caller (0). */
static int send_inline(tcp_conn *c, chunk *ch) {
  if (ch->bytes > TCP_INLINE_MAX_BYTES || pthread_mutex_trylock(&c->send_lock)) return 0;
  pthread_mutex_lock(&c->q_lock);
  int idle = !c->q_head;
  pthread_mutex_unlock(&c->q_lock);
  if (idle) conn_send_locked(c, ch);
  pthread_mutex_unlock(&c->send_lock);
  return idle;
}

int kvf__tcp_submit(kvf_engine *e, const char *session, chunk **chunks, size_t nchunks) {
  tcp_state *t = e->transport;
  if (chunks[0]->batch->device_src) { /* sendmsg would copy from it with the CPU */
    if (kvf__log_first_time(0x74637073u))
      LOG_WARN("tcp",
               "a batch to %s reads from device memory, which kvferry's TCP cannot copy from: refused (device "
               "memory needs transport ucx with a UCX built with CUDA)",
               session);
    return KVF_EINVAL;
  }
  tcp_session *s;
  int rc = session_get(t, session, &s);
  if (rc) return rc;
  int nconn = e->cfg.conns_per_peer;
  /* A batch of one small chunk (a short room) takes the first idle
   * connection in slot order rather than the next in turn: small chunks then
   * share one connection while it keeps up, so the target's thread reads
   * several per wake-up (and one recv) and acknowledges them together,
   * instead of every connection's threads waking for every other chunk.
   * Batches of several chunks spread over the connections in turn. */
  int small = nchunks == 1 && chunks[0]->bytes <= TCP_INLINE_MAX_BYTES;
  size_t use = small ? (size_t)nconn : nchunks < (size_t)nconn ? nchunks : (size_t)nconn;
  tcp_conn *picked[16] = {0};
  int64_t deadline = chunks[0]->batch->deadline_ns;

  if (kvf__engine_submit_lock(&s->lock, &s->connecting)) return KVF__SUBMIT_WOULD_BLOCK;
  unsigned start = small ? 0 : s->rr;
  if (!small) s->rr += (unsigned)use;
  for (size_t k = 0; k < use; k++) {
    int slot = (int)((start + k) % (unsigned)nconn);
    tcp_conn *c = s->conns[slot];
    if (c) conn_check_idle(c);
    if (c && atomic_load(&c->dead)) { /* reconnect after a failure */
      s->conns[slot] = NULL;
      kvf__tcp_conn_put(c);
      c = NULL;
    }
    if (!c) {
      if (!kvf__engine_may_block()) { /* the session's connector connects */
        rc = KVF__SUBMIT_WOULD_BLOCK;
      } else {
        atomic_store(&s->connecting, 1);
        rc = conn_open(e, s, deadline, &c);
        atomic_store(&s->connecting, 0);
      }
      /* A small chunk makes do with the connections it has when another
       * fails to open (one that may not be opened here sends the batch to
       * the connector, which opens it) */
      if (rc && rc != KVF__SUBMIT_WOULD_BLOCK && small && k > 0) rc = 0, use = k;
      if (rc || use == k) break;
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
    int sent = send_inline(c, ch);
    for (size_t k = 1; small && !sent && k < use; k++) sent = send_inline(picked[k], ch);
    if (sent) continue;
    pthread_mutex_lock(&c->q_lock);
    int dead = atomic_load(&c->dead), no_writer = 0;
    if (!dead) {
      list_push(&c->q_head, &c->q_tail, ch);
      pthread_cond_signal(&c->q_cv);
      no_writer = thread_need_locked(c, 0);
    }
    pthread_mutex_unlock(&c->q_lock);
    if (dead) kvf__chunk_finish(ch, dead);
    if (no_writer) conn_fail(c, KVF_ENOMEM); /* fails what it queued, this chunk too */
  }
out_put:
  for (size_t k = 0; k < use; k++) kvf__tcp_conn_put(picked[k]);
  return rc;
}

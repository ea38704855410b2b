/* The TCP transport (see tcp_int.h for its files): blocking I/O helpers
 * with per-call timeouts and iovec batching shared by the writer and the
 * target side, and the transport's start, stop and ops table. */
#include "engine/tcp_int.h"

void kvf__tcp_set_timeout(int fd, int opt, int ms) {
  struct timeval tv = {.tv_sec = ms / 1000, .tv_usec = (ms % 1000) * 1000};
  setsockopt(fd, SOL_SOCKET, opt, &tv, sizeof tv);
}

int kvf__tcp_send_all(int fd, const void *buf, size_t len) {
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

/* Read fixed-size messages from a socket whose SO_RCVTIMEO is a short tick,
 * without a poll() call first (each system call is costly on these VMs):
 * receives into buf, which holds *got bytes already (a message's start),
 * until at least `len` bytes are there, taking up to `cap` (so one call
 * takes every message that has arrived). Returns 0 when they are in, 1 when
 * a tick passed with nothing read and nothing held (idle), or an error.
 * Once a first byte has arrived the rest must follow within `rest_ms`. */
int kvf__tcp_recv_msg_or_idle(int fd, void *buf, size_t len, size_t cap, size_t *got, int tick_ms, int rest_ms) {
  char *p = buf;
  int waited = 0;
  while (*got < len) {
    ssize_t r = recv(fd, p + *got, cap - *got, 0);
    if (r > 0) {
      *got += (size_t)r;
    } else if (r == 0) {
      return KVF_ECLOSED;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (*got == 0) return 1;
      waited += tick_ms;
      if (waited >= rest_ms) return KVF_ETIMEDOUT;
    } else if (errno != EINTR) {
      return KVF_ECLOSED;
    }
  }
  return 0;
}

/* Move an iovec array forward by n bytes. */
void kvf__tcp_iov_advance(struct iovec **iov, int *cnt, size_t n) {
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
      kvf__tcp_iov_advance(&iov, &cnt, (size_t)r);
    } else if (r == 0 && !sending) {
      return KVF_ECLOSED;
    } else if (r < 0 && errno != EINTR) {
      return (errno == EAGAIN || errno == EWOULDBLOCK) ? KVF_ETIMEDOUT : KVF_ECLOSED;
    }
  }
  return 0;
}

int kvf__tcp_iter_fill(const piece_src *s, piece_iter *it, struct iovec *iov, int max) {
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

/* Move every piece; `head` (may be NULL) goes first in the same system call
 * and `tail` (may be NULL) last, so a small chunk is one sendmsg: header,
 * descriptors, payload and trailer (one segment for the target to read, not
 * a segment it may wake up for and then wait behind for the rest). */
int kvf__tcp_xfer_pieces(int fd, const piece_src *s, int sending, const struct iovec *head, int nhead,
                         const struct iovec *tail, int ntail) {
  struct iovec iov[TCP_IOV_BATCH];
  piece_iter it = {0, 0};
  for (;;) {
    int k = 0;
    for (; k < nhead; k++) iov[k] = head[k];
    nhead = 0;
    k += kvf__tcp_iter_fill(s, &it, iov + k, TCP_IOV_BATCH - k);
    if (it.i >= s->n && ntail && k + ntail <= TCP_IOV_BATCH) { /* the pieces are all in: the tail fits */
      for (int j = 0; j < ntail; j++) iov[k++] = tail[j];
      ntail = 0;
    }
    if (k == 0) return 0;
    int rc = iov_xfer(fd, iov, k, sending);
    if (rc) return rc;
  }
}

static int tcp_start(kvf_engine *e) {
  tcp_state *t = calloc(1, sizeof *t);
  if (!t) return KVF_ENOMEM;
  t->e = e;
  int rc = smap_init(&t->sessions);
  if (rc) goto err_free;
  rc = kvf__tcp_listen_on(e, &t->listen_fd, &e->port);
  if (rc) goto err_map;
  pthread_mutex_init(&t->in_lock, NULL);
  pthread_mutex_init(&t->sess_lock, NULL);
  rc = kvf__evpool_start(&kvf__tcp_inbound_ops, t, TCP_IN_CORE_WORKERS, TCP_IN_RETIRE_MS, TCP_READER_TICK_MS,
                         &t->in_pool);
  if (rc) goto err_listen;
  if (pthread_create(&t->accept_thread, NULL, kvf__tcp_accept_main, t)) {
    rc = KVF_ENOMEM;
    goto err_pool;
  }
  e->transport = t;
  return 0;

err_pool:
  kvf__evpool_stop(t->in_pool);
err_listen:
  close(t->listen_fd);
  pthread_mutex_destroy(&t->in_lock);
  pthread_mutex_destroy(&t->sess_lock);
err_map:
  kvf__smap_free(&t->sessions);
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
  /* Held connections end at once, then the parked ones are freed. */
  kvf__tcp_inbound_cut_all(t);
  kvf__evpool_stop(t->in_pool);
  kvf__tcp_inbound_reap(t, 1);
  map_iter it;
  kvf__map_iter_init(&it);
  void *v;
  while (kvf__smap_next(&t->sessions, &it, NULL, &v)) {
    tcp_session *s = v;
    for (int i = 0; i < 16; i++) kvf__tcp_conn_put(s->conns[i]);
    pthread_mutex_destroy(&s->lock);
    free(s);
  }
  kvf__smap_free(&t->sessions);
  pthread_mutex_destroy(&t->in_lock);
  pthread_mutex_destroy(&t->sess_lock);
  free(t);
  e->transport = NULL;
}

const transport_ops kvf__tcp_transport_ops = {
    .name = "tcp",
    .start = tcp_start,
    .stop = tcp_stop,
    .submit = kvf__tcp_submit,
};

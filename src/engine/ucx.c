/* The UCX transport, engine side: one UCP context and worker per engine,
 * the event-driven progress thread, registration (ucp_mem_map + packed
 * rkeys), pools allocated by UCX in shared memory, and the rendezvous server
 * that the TCP listener hands UCX hellos to. The writer side is in
 * ucx_peer.c; the message layout and the locking rules in ucx.h.
 *
 * The TCP transport runs underneath unchanged: its listener is the session
 * id, it answers data connections from TCP peers, and peers that `auto`
 * routes to TCP use it. */
#include "engine/ucx.h"

#include <dirent.h>
#include <errno.h>
#include <poll.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/env.h"
#include "base/log.h"
#include "base/thread.h"
#include "base/parse.h"
#include "engine/tcp_proto.h"

int kvf__ucx_status(ucs_status_t st) {
  switch (st) {
    case UCS_OK: return 0;
    case UCS_ERR_TIMED_OUT:
    case UCS_ERR_ENDPOINT_TIMEOUT: return KVF_ETIMEDOUT;
    case UCS_ERR_NO_MEMORY: return KVF_ENOMEM;
    case UCS_ERR_UNREACHABLE:
    case UCS_ERR_CONNECTION_RESET:
    case UCS_ERR_CANCELED:
    case UCS_ERR_REJECTED: return KVF_ECLOSED;
    default: return KVF_EIO;
  }
}

void kvf__ucx_wake(ucx_state *u) {
  uint64_t one = 1;
  ssize_t r = write(u->wake_fd, &one, sizeof one);
  (void)r; /* a full counter already means "wake up" */
}

int kvf__ucx_rbuf_fill(int fd, ucx_rbuf *r) {
  for (;;) {
    ssize_t n = recv(fd, r->b, r->cap, MSG_DONTWAIT);
    if (n > 0) {
      r->off = 0;
      r->len = (size_t)n;
      return 1;
    }
    if (n == 0) return KVF_ECLOSED;
    if (errno == EINTR) continue;
    if (errno == EAGAIN || errno == EWOULDBLOCK) return 0;
    return errno == ECONNRESET ? KVF_ECLOSED : KVF_EIO;
  }
}

int kvf__ucx_rbuf_recv(int fd, ucx_rbuf *r, void *buf, size_t len, int64_t deadline_ns) {
  char *p = buf;
  while (len) {
    if (r && r->len > r->off) {
      size_t k = r->len - r->off < len ? r->len - r->off : len;
      memcpy(p, r->b + r->off, k);
      r->off += k, p += k, len -= k;
      continue;
    }
    if (!r || !r->b || len >= r->cap / 2) return kvf__fd_recv_all(fd, p, len, deadline_ns);
    int rc = kvf__ucx_rbuf_fill(fd, r);
    if (rc < 0) return KVF_ECLOSED;
    if (!rc && (rc = kvf__fd_wait(fd, POLLIN, deadline_ns))) return rc;
  }
  return 0;
}

int kvf__ucx_rbuf_hold(ucx_rbuf *r, size_t cap) {
  if (r->b) return 0;
  if (!(r->b = malloc(cap))) return KVF_ENOMEM;
  r->cap = cap;
  r->off = r->len = 0;
  return 0;
}

void kvf__ucx_rbuf_release_empty(ucx_rbuf *r) {
  if (!r->b || r->len > r->off) return;
  free(r->b);
  *r = (ucx_rbuf){0};
}

int kvf__ucx_ctl_recv(ucx_ctl *c, void *buf, size_t len, int64_t deadline_ns) {
  return kvf__ucx_rbuf_recv(c->fd, &c->rb, buf, len, deadline_ns);
}

_Atomic(kvf__ucx_done_cut_fn) kvf__ucx_done_cut;

/* Does the next message in c's read-ahead look like a notice that arrived
 * whole and reads at most UCX_DONE_HOLD_BYTES? Then serving it reads
 * nothing more from the socket and soon ends, so answers may wait for it.
 * (A malformed one is refused when served, after the flush that precedes
 * any refusal that ends the connection.) */
static int small_notice_waits(const ucx_ctl *c) {
  const ucx_rbuf *r = &c->rb;
  ucx_notice n;
  if (!r->b || r->len - r->off < sizeof n) return 0;
  memcpy(&n, r->b + r->off, sizeof n);
  if (n.magic != UCX_NOTICE_MAGIC || n.ndesc > UCX_MAX_NOTICE_DESC || n.tlen > KVF_ENGINE_MAX_TRAILER ||
      r->len - r->off - sizeof n < (size_t)n.ndesc * sizeof(kvf_write) + n.tlen)
    return 0;
  uint64_t bytes = 0;
  for (uint32_t i = 0; i < n.ndesc; i++) {
    kvf_write w;
    memcpy(&w, r->b + r->off + sizeof n + (size_t)i * sizeof w, sizeof w);
    uint64_t count = w.count > 1 ? w.count : 1;
    if (w.len > UCX_DONE_HOLD_BYTES || count > UCX_DONE_HOLD_BYTES) return 0;
    if ((bytes += w.len * count) > UCX_DONE_HOLD_BYTES) return 0;
  }
  return 1;
}

int kvf__ucx_ctl_flush(ucx_ctl *c) {
  if (!c->nheld) return 0;
  pthread_mutex_lock(&c->send_mu);
  int rc = kvf__fd_send_all(c->fd, c->held, c->nheld * sizeof *c->held, clock_deadline_ms(UCX_CTL_TIMEOUT_MS));
  pthread_mutex_unlock(&c->send_mu);
  c->nheld = 0;
  return rc;
}

int kvf__ucx_ctl_done(ucx_ctl *c, int status, uint64_t id) {
  c->held[c->nheld++] = (ucx_req){UCX_READ_DONE_MAGIC, (uint32_t)status, id};
  return c->nheld < UCX_DONE_BATCH ? 0 : kvf__ucx_ctl_flush(c);
}

/* ------------------------------------------------------------ host identity */

static void read_first_line(const char *path, char *out, size_t cap) {
  out[0] = '\0';
  FILE *f = fopen(path, "r");
  if (!f) return;
  if (fgets(out, (int)cap, f)) out[strcspn(out, "\n")] = '\0';
  fclose(f);
}

/* Two engines with the same identity share a kernel, an IPC namespace and a
 * network namespace. UCX's shared-memory transports need the first two; the
 * network namespace is there because UCX 1.13's shared-memory endpoints
 * between two network namespaces of one host never complete a put (seen
 * with the fault suite's veth partition test): peers in different network
 * namespaces (containers, netns) take kvferry's TCP under auto. */
static void host_identity(char *out, size_t cap) {
  /* Containers on one host that share no shared memory (or tests) name
   * their own identity. */
  const char *forced = getenv("KVFERRY_UCX_HOST_ID");
  if (forced && *forced) {
    kvf__str_copy(out, cap, forced);
    return;
  }
  char boot[64], host[64] = "", ipc[64] = "", net[64] = "";
  read_first_line("/proc/sys/kernel/random/boot_id", boot, sizeof boot);
  gethostname(host, sizeof host - 1);
  ssize_t n = readlink("/proc/self/ns/ipc", ipc, sizeof ipc - 1);
  ipc[n > 0 ? n : 0] = '\0';
  n = readlink("/proc/self/ns/net", net, sizeof net - 1);
  net[n > 0 ? n : 0] = '\0';
  snprintf(out, cap, "%s|%.24s|%s|%s", boot, host, ipc, net);
}

static int has_rdma_device(void) {
  DIR *d = opendir("/sys/class/infiniband");
  if (!d) return 0;
  int found = 0;
  for (struct dirent *de; (de = readdir(d));)
    if (de->d_name[0] != '.') found = 1;
  closedir(d);
  return found;
}

/* A random value for this engine's CMA probe (ucx_cma_probe): what proves
 * to a same-host target that the pid it was given is this process. */
static uint64_t cma_probe_value(void) {
  uint64_t v = 0;
  if (getrandom(&v, sizeof v, GRND_NONBLOCK) != (ssize_t)sizeof v) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    v = ((uint64_t)ts.tv_nsec * 0x9e3779b97f4a7c15ull) ^ ((uint64_t)getpid() << 32) ^ (uint64_t)ts.tv_sec;
  }
  return v | 1; /* never 0, which an unread probe would hold */
}

/* ucx_reg.pool: a plain registration (its own ucp_mem_map), a registration
 * of a pool (reuses the pool's handle), or a pool itself (not advertised
 * until registered). */
enum { REG_PLAIN = 0, REG_IN_POOL = 1, REG_POOL = 2 };

/* ------------------------------------------------------------ rendezvous server */

int kvf__ucx_build_info(ucx_state *u, uint32_t flags, int64_t echo_ns, char **out, size_t *out_len) {
  ucx_fence_snap snap = {0};
  uint64_t *open = NULL;
  size_t nopen = 0;
  if (kvf__fence_snapshot(u->e, &snap.next, &open, &nopen)) return KVF_ENOMEM;
  snap.nopen = (uint32_t)nopen;
  int regions = !(flags & UCX_INFO_READ);
  int cma = (flags & UCX_INFO_WRITER) && u->cma_value; /* offer direct reads of this process (ucx_read.c) */
  pthread_mutex_lock(&u->reg_mu);
  size_t body = u->addr_len + sizeof snap + nopen * sizeof *open + (cma ? sizeof(ucx_cma_probe) : 0), nadv = 0;
  for (size_t i = 0; regions && i < u->nregs; i++)
    if (u->regs[i].pool != REG_POOL && u->regs[i].rkey_buf) {
      body += sizeof(ucx_region_desc) + u->regs[i].rkey_len;
      nadv++;
    }
  char *m = malloc(sizeof(ucx_info_hdr) + body);
  if (!m) {
    pthread_mutex_unlock(&u->reg_mu);
    free(open);
    return KVF_ENOMEM;
  }
  ucx_info_hdr h = {.magic = UCX_INFO_MAGIC,
                    .nregions = (uint32_t)nadv,
                    .gen = u->gen,
                    .addr_len = (uint32_t)u->addr_len,
                    .body_len = (uint32_t)body,
                    .flags = flags | (cma ? UCX_INFO_CMA : 0),
                    .clock_ns = clock_now_ns(),
                    .echo_ns = echo_ns};
  memcpy(h.host_id, u->host_id, sizeof h.host_id);
  memcpy(m, &h, sizeof h);
  char *p = m + sizeof h;
  memcpy(p, u->addr, u->addr_len);
  p += u->addr_len;
  for (size_t i = 0; regions && i < u->nregs; i++) {
    const ucx_reg *r = &u->regs[i];
    if (r->pool == REG_POOL || !r->rkey_buf) continue; /* a pool's own entry; device memory UCX cannot reach */
    ucx_region_desc d = {r->base, r->len, (uint32_t)r->rkey_len, 0};
    memcpy(p, &d, sizeof d);
    memcpy(p + sizeof d, r->rkey_buf, r->rkey_len);
    p += sizeof d + r->rkey_len;
  }
  pthread_mutex_unlock(&u->reg_mu);
  memcpy(p, &snap, sizeof snap);
  if (nopen) memcpy(p + sizeof snap, open, nopen * sizeof *open);
  if (cma) {
    ucx_cma_probe pr = {UCX_CMA_MAGIC, (uint32_t)getpid(), (uint64_t)(uintptr_t)u->cma_value, *u->cma_value};
    memcpy(p + sizeof snap + nopen * sizeof *open, &pr, sizeof pr);
  }
  free(open);
  *out = m;
  *out_len = sizeof h + body;
  return 0;
}

/* Shut a writer's connection down (its serving thread sees it and ends);
 * a read under way on it does not count from here (ucx_ctl.closing). */
static void ctl_cut(ucx_ctl *c) {
  atomic_store(&c->closing, 1);
  shutdown(c->fd, SHUT_RDWR);
}

/* Built and sent under send_mu: a fence message (ucx_fence_close) for a
 * pair this info still shows open comes after it on the connection. */
static int ctl_send_info(ucx_state *u, ucx_ctl *c, uint64_t *gen_out, int ms) {
  char *m;
  size_t len;
  pthread_mutex_lock(&c->send_mu);
  int rc = kvf__ucx_build_info(u, c->read_mode ? UCX_INFO_READ : 0, 0, &m, &len);
  if (!rc) {
    const ucx_info_hdr *h = (const ucx_info_hdr *)(const void *)m;
    if (gen_out) *gen_out = h->gen;
    if (!c->info_ns) c->info_ns = h->clock_ns;
    if (h->gen > atomic_load(&c->sent_gen)) atomic_store(&c->sent_gen, h->gen);
    rc = kvf__fd_send_all(c->fd, m, len, clock_deadline_ms(ms));
    free(m);
  }
  pthread_mutex_unlock(&c->send_mu);
  if (rc) ctl_cut(c);
  return rc;
}

/* Tell every connected writer about a new generation of registrations;
 * with `wait`, return once each has applied it (see ucx.h). Writers in read
 * mode are given no regions: nothing to tell them (this engine's own reads
 * hold pins that unregister waits for). */
static void push_info(ucx_state *u, uint64_t gen, int wait) {
  pthread_mutex_lock(&u->ctl_mu);
  for (ucx_ctl *c = u->ctls; c; c = c->next)
    if (!c->read_mode) ctl_send_info(u, c, NULL, UCX_CTL_LOCKED_SEND_MS);
  int64_t until = clock_deadline_ms(UCX_CTL_TIMEOUT_MS);
  for (int pending = wait; pending;) {
    pending = 0;
    for (ucx_ctl *c = u->ctls; c; c = c->next) pending |= !c->read_mode && c->acked < gen;
    if (!pending) break;
    struct timespec ts = clock_ts_from_ns(until);
    if (pthread_cond_timedwait(&u->ctl_cv, &u->ctl_mu, &ts) == ETIMEDOUT) {
      for (ucx_ctl *c = u->ctls; c; c = c->next)
        if (!c->read_mode && c->acked < gen) {
          LOG_WARN("ucx", "a writer did not confirm an unregister within %d ms; its connection is cut",
                   UCX_CTL_TIMEOUT_MS);
          ctl_cut(c);
        }
      break;
    }
  }
  pthread_mutex_unlock(&u->ctl_mu);
}

/* kvf_engine_fence_close's part over UCX: tell every connected writer that
 * (tag, epoch) is closed and wait until each confirmed (it writes nothing
 * more for it and flushed what it had in flight) or its connection is gone.
 * A writer that does not confirm by `until` (stopped, or hung) is cut off
 * and the close fails with KVF_ETIMEDOUT: it checks its rendezvous
 * connection before each block of a tagged write, so it starts no new
 * block, but puts it had posted may still land when it runs again
 * (engine.h). Writers in read mode write nothing: this engine reads their
 * chunks, and the fence table already stopped its reads of the pair
 * (fence.c), so they are neither told nor waited for. */
static int ucx_fence_close(kvf_engine *e, uint64_t tag, uint64_t epoch, int64_t until) {
  ucx_state *u = e->ucx;
  ucx_fence_msg m = {UCX_FENCE_MAGIC, 0, tag, epoch, 0};
  int rc = 0;
  pthread_mutex_lock(&u->ctl_mu);
  m.seq = ++u->fence_seq;
  for (ucx_ctl *c = u->ctls; c; c = c->next) {
    if (c->read_mode) continue;
    pthread_mutex_lock(&c->send_mu);
    int64_t by = clock_deadline_ms(UCX_CTL_LOCKED_SEND_MS);
    atomic_store(&c->sent_fence, m.seq);
    if (kvf__fd_send_all(c->fd, &m, sizeof m, by < until ? by : until)) ctl_cut(c);
    pthread_mutex_unlock(&c->send_mu);
  }
  for (;;) {
    int pending = 0;
    for (ucx_ctl *c = u->ctls; c; c = c->next) pending |= !c->read_mode && c->fence_acked < m.seq;
    if (!pending) break;
    struct timespec ts = clock_ts_from_ns(until);
    if (pthread_cond_timedwait(&u->ctl_cv, &u->ctl_mu, &ts) == ETIMEDOUT) {
      for (ucx_ctl *c = u->ctls; c; c = c->next)
        if (!c->read_mode && c->fence_acked < m.seq) {
          LOG_WARN("ucx", "a writer did not confirm the fence of tag %llu in time; its connection is cut",
                   (unsigned long long)tag);
          ctl_cut(c);
          c->fence_acked = m.seq; /* gone for this fence: it reconnects with a new snapshot */
          rc = KVF_ETIMEDOUT;
        }
      break;
    }
  }
  pthread_mutex_unlock(&u->ctl_mu);
  return rc;
}

static void log_malformed(kvf_engine *e, const char *peer) {
  atomic_fetch_add(&e->stats.protocol_errors, 1);
  if (kvf__log_first_time_for_host(peer, "ucx-frame"))
    LOG_WARN("ucx",
             "peer %s: malformed rendezvous request; connection dropped (further ones from it are not logged)",
             peer);
}

/* Read mode: once a connection's notices are served, its worker waits this
 * long for the next before the connection goes back to the event thread.
 * A notice that comes meanwhile (a room's next chunk, the next room) is
 * served at once, without the event thread's wake-up, its hand-off to a
 * worker and the two epoll changes (about 40 µs of two cores here per
 * notice); the wait sleeps in poll, and a worker held by it is one of the
 * pool's, which starts more while other connections have bytes. */
#define UCX_CTL_LINGER_MS 2

/* Read mode, nothing left to read: 1 when bytes (or the close) arrive
 * within UCX_CTL_LINGER_MS, 0 when not. */
static int ctl_linger(ucx_ctl *c) {
  struct pollfd pfd = {.fd = c->fd, .events = POLLIN};
  int n;
  do n = poll(&pfd, 1, UCX_CTL_LINGER_MS);
  while (n < 0 && errno == EINTR);
  return n > 0;
}

/* The messages of a connection a worker took (some bytes arrived): each
 * whole within UCX_CTL_TIMEOUT_MS of its first byte, for as long as more
 * have arrived (in read mode, or arrive within UCX_CTL_LINGER_MS). 0:
 * nothing more now, the connection goes back to the event thread;
 * otherwise the connection ends. */
static int ctl_turn(ucx_state *u, ucx_ctl *c) {
  kvf_engine *e = u->e;
  /* Read mode: notices come back to back, read ahead in one buffer. */
  if (c->read_mode && kvf__ucx_rbuf_hold(&c->rb, UCX_CTL_RBUF)) return KVF_ENOMEM;
  int rc = 0;
  while (!rc && !atomic_load(&u->stopping)) {
    if (c->rb.b && !kvf__ucx_rbuf_waiting(&c->rb)) { /* one recv: whatever arrived, or nothing more now */
      if ((rc = kvf__ucx_ctl_flush(c))) break;
      int got = kvf__ucx_rbuf_fill(c->fd, &c->rb);
      if (!got && ctl_linger(c)) continue;
      if (got <= 0) return got;
    } else if (!c->rb.b) {
      char b;
      ssize_t r = recv(c->fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
      if (r == 0) return KVF_ECLOSED;
      if (r < 0) {
        if (errno == EINTR) continue;
        return errno == EAGAIN || errno == EWOULDBLOCK ? 0 : KVF_ECLOSED;
      }
    }
    ucx_req r;
    int64_t until = clock_deadline_ms(UCX_CTL_TIMEOUT_MS);
    /* Answers held (kvf__ucx_ctl_done) wait only for a small notice that
     * arrived whole; anything else may wait, so they go out first. */
    if (!small_notice_waits(c) && (rc = kvf__ucx_ctl_flush(c))) break;
    if ((rc = kvf__ucx_ctl_recv(c, &r.magic, sizeof r.magic, until))) break;
    if (c->read_mode && r.magic == UCX_INFO_MAGIC) {
      rc = kvf__ucx_serve_writer_info(u, c);
      continue;
    }
    if (c->read_mode && r.magic == UCX_NOTICE_MAGIC) {
      rc = kvf__ucx_serve_notice(u, c);
      continue;
    }
    if (c->read_mode && r.magic == UCX_CLOCK_ANS_MAGIC) {
      rc = kvf__ucx_serve_clock(u, c);
      continue;
    }
    if ((rc = kvf__ucx_ctl_recv(c, (char *)&r + sizeof r.magic, sizeof r - sizeof r.magic, until))) break;
    if (r.magic == UCX_ACK_MAGIC || r.magic == UCX_FENCE_ACK_MAGIC) {
      pthread_mutex_lock(&u->ctl_mu);
      uint64_t *acked = r.magic == UCX_ACK_MAGIC ? &c->acked : &c->fence_acked;
      uint64_t sent = atomic_load(r.magic == UCX_ACK_MAGIC ? &c->sent_gen : &c->sent_fence);
      if (r.gen > sent) r.gen = sent; /* not ahead of what it was sent */
      if (r.gen > *acked) *acked = r.gen;
      pthread_cond_broadcast(&u->ctl_cv);
      pthread_mutex_unlock(&u->ctl_mu);
      continue;
    }
    if (!c->read_mode && r.magic == UCX_TRAILER_MAGIC && r.reserved <= KVF_ENGINE_MAX_TRAILER) {
      unsigned char t[KVF_ENGINE_MAX_TRAILER];
      if ((rc = kvf__ucx_ctl_recv(c, t, r.reserved, until))) break;
      /* The writer flushed the bytes first. The callback gets the IP
       * address, as from the TCP transport. */
      char ip[KVF_ADDR_HOST_LEN];
      if (!kvf__addr_host(c->peer, ip, sizeof ip)) kvf__engine_deliver_trailer(e, t, r.reserved, ip);
      ucx_req ack = {UCX_TRAILER_ACK_MAGIC, 0, 0};
      pthread_mutex_lock(&c->send_mu);
      rc = kvf__fd_send_all(c->fd, &ack, sizeof ack, clock_deadline_ms(UCX_CTL_TIMEOUT_MS));
      pthread_mutex_unlock(&c->send_mu);
      continue;
    }
    if (r.magic != UCX_REQ_MAGIC) {
      log_malformed(e, c->peer);
      return KVF_ECLOSED;
    }
    rc = ctl_send_info(u, c, NULL, UCX_CTL_TIMEOUT_MS);
  }
  kvf__ucx_ctl_flush(c); /* reads that were done are still answered */
  if (rc == KVF_EPROTO) log_malformed(e, c->peer);
  return rc ? rc : KVF_ECLOSED; /* stopping */
}

static int ctl_turn_cb(void *arg, evpool_item *it) {
  ucx_ctl *c = (ucx_ctl *)(void *)((char *)it - offsetof(ucx_ctl, item));
  int rc = ctl_turn(arg, c);
  if (!rc) kvf__ucx_rbuf_release_empty(&c->rb); /* an idle connection holds no read-ahead */
  return rc;
}

/* The connection is over (its worker, or the stop once no worker runs). */
static void ctl_end_cb(void *arg, evpool_item *it) {
  ucx_state *u = arg;
  ucx_ctl *c = (ucx_ctl *)(void *)((char *)it - offsetof(ucx_ctl, item));
  pthread_mutex_lock(&u->ctl_mu);
  for (ucx_ctl **pp = &u->ctls; *pp; pp = &(*pp)->next)
    if (*pp == c) {
      *pp = c->next;
      u->nctls--;
      break;
    }
  pthread_cond_broadcast(&u->ctl_cv);
  pthread_mutex_unlock(&u->ctl_mu);
  kvf__ucx_ctl_reader_free(u, c); /* every read of this connection is over */
  shutdown(c->fd, SHUT_RDWR);
  close(c->fd);
  free(c->rb.b);
  pthread_mutex_destroy(&c->send_mu);
  free(c);
}

static const evpool_ops ctl_pool_ops = {.turn = ctl_turn_cb, .end = ctl_end_cb};

/* After the listener stopped (no new connection comes): cut every
 * connection, let the workers finish theirs, then end the parked ones. */
static void ctl_stop(ucx_state *u) {
  if (!u->ctl_pool) return;
  pthread_mutex_lock(&u->ctl_mu);
  u->ctl_stopping = 1;
  for (ucx_ctl *c = u->ctls; c; c = c->next) ctl_cut(c);
  pthread_mutex_unlock(&u->ctl_mu);
  kvf__evpool_stop(u->ctl_pool);
  u->ctl_pool = NULL;
  for (;;) {
    pthread_mutex_lock(&u->ctl_mu);
    ucx_ctl *c = u->ctls;
    pthread_mutex_unlock(&u->ctl_mu);
    if (!c) break;
    ctl_end_cb(u, &c->item);
  }
}

/* On the TCP inbound thread of a rendezvous connection, after the token
 * was accepted: send the first info, then park the connection with the
 * event thread (this thread and the inbound slot are let go). Read mode
 * when this engine's ucx_mode and the writer's hello allow it. */
static int ucx_serve(kvf_engine *e, int fd, const char *peer, unsigned hello_flags) {
  ucx_state *u = e->ucx;
  ucx_ctl *c = calloc(1, sizeof *c);
  if (!c) return 0;
  c->fd = fd;
  kvf__str_copy(c->peer, sizeof c->peer, peer);
  c->read_mode = e->ucx_read && (hello_flags & TCP_HELLO_CAN_READ) && !atomic_load(&u->device_regs);
  pthread_mutex_init(&c->send_mu, NULL);
  /* The writer applies the first info before it writes: it counts as acked. */
  c->item.fd = fd;
  int read_mode = c->read_mode;
  pthread_mutex_lock(&u->ctl_mu);
  int full = u->nctls >= UCX_MAX_RENDEZVOUS && !u->ctl_stopping;
  int rc = full || u->ctl_stopping ? KVF_EBUSY : ctl_send_info(u, c, &c->acked, UCX_CTL_LOCKED_SEND_MS);
  if (!rc) {
    c->fence_acked = u->fence_seq; /* its snapshot shows every fence closed so far */
    /* Listed first: a worker may take it at once (the pool hands it over
     * under its lock, after everything set here). */
    c->next = u->ctls;
    u->ctls = c;
    u->nctls++;
    if ((rc = kvf__evpool_add(u->ctl_pool, &c->item))) {
      u->ctls = c->next;
      u->nctls--;
    }
  }
  pthread_mutex_unlock(&u->ctl_mu);
  if (rc) {
    if (full) {
      atomic_fetch_add(&e->stats.conns_refused, 1);
      if (kvf__log_first_time_for_host(peer, "ucx-limit"))
        LOG_WARN("ucx", "writer %s: %d rendezvous connections already; refused", peer, UCX_MAX_RENDEZVOUS);
    }
    pthread_mutex_destroy(&c->send_mu);
    free(c);
    return 0;
  }
  if (read_mode) { /* c may be gone already: a worker took it */
    atomic_fetch_add(&e->stats.peers_read, 1);
    LOG_INFO("ucx", "writer %s: read mode (this engine reads its chunks)", peer);
  }
  return 1;
}

/* ------------------------------------------------------------ registration */

static ucx_reg *find_reg(ucx_state *u, uint64_t addr, int pool) {
  for (size_t i = 0; i < u->nregs; i++)
    if (u->regs[i].base == addr && u->regs[i].pool == pool) return &u->regs[i];
  return NULL;
}

static int add_reg(ucx_state *u, ucx_reg r) {
  if (u->nregs == u->cap) {
    size_t cap = u->cap ? u->cap * 2 : 16;
    ucx_reg *n = realloc(u->regs, cap * sizeof *n);
    if (!n) return KVF_ENOMEM;
    u->regs = n;
    u->cap = cap;
  }
  u->regs[u->nregs++] = r;
  return 0;
}

static void del_reg(ucx_state *u, ucx_reg *r) {
  size_t i = (size_t)(r - u->regs);
  memmove(&u->regs[i], &u->regs[i + 1], (u->nregs - i - 1) * sizeof *r);
  u->nregs--;
}

/* The first registration that is not readable host memory (device memory):
 * read mode copies with the reader's CPU, which cannot touch it, so the
 * connections that read (writers this engine reads from, peers that read
 * from this engine) are cut; they connect again in write mode, where UCX
 * moves device memory. What they had in flight fails, as when a peer dies. */
static void device_memory_came(ucx_state *u, const void *addr, size_t len) {
  int cut = 0;
  pthread_mutex_lock(&u->ctl_mu);
  for (ucx_ctl *c = u->ctls; c; c = c->next)
    if (c->read_mode) ctl_cut(c), cut++;
  pthread_mutex_unlock(&u->ctl_mu);
  cut += kvf__ucx_peers_drop_reading(u);
  if (kvf__log_first_time(0x64657669u))
    LOG_INFO("ucx",
             "%p+%zu is not readable host memory (device memory?): peers are written to and write here (UCX write "
             "mode), not read, while it is registered; %d reading connection(s) cut",
             addr, len, cut);
}

static int ucx_reg_hook(kvf_engine *e, void *addr, size_t len) {
  ucx_state *u = e->ucx;
  uint64_t base = (uint64_t)(uintptr_t)addr;
  pthread_mutex_lock(&u->reg_mu);
  ucx_reg *pool = find_reg(u, base, REG_POOL);
  ucp_mem_h memh = pool && pool->len == len ? pool->memh : NULL;
  size_t advertised = 0;
  for (size_t i = 0; i < u->nregs; i++) advertised += u->regs[i].pool != REG_POOL;
  pthread_mutex_unlock(&u->reg_mu);
  if (advertised >= UCX_MAX_REGIONS) return KVF_ENOMEM;
  int rc = 0;
  int owned = !memh;
  /* A pool this engine allocated is host memory; other memory as
   * kvf_engine_register found it (region.device: not a readable mapping). */
  int host = 1;
  if (owned) {
    pthread_rwlock_rdlock(&e->regions.lock);
    region *r = kvf__regions_find_locked(&e->regions, base, len);
    host = !r || !r->device;
    pthread_rwlock_unlock(&e->regions.lock);
  }
  /* Device memory that UCX cannot move (a UCX without CUDA, or memory the
   * CUDA driver does not know): UCX would reach it only with the CPU (its
   * tcp copies on the target's progress thread), so it is not mapped nor
   * advertised, writes into it find no region, and batches from it are
   * refused (kvf__regions_mark_unmovable). */
  int unreachable = !host && (!u->cuda_memory || kvf__ucx_cuda_adopt(u, addr, len) < 0);
  if (unreachable) kvf__regions_mark_unmovable(&e->regions, base);
  if (unreachable && kvf__log_first_time(0x75637564u))
    LOG_WARN("ucx", "%p+%zu is not readable host memory and %s: transfers into or out of it are refused", addr,
             len,
             u->cuda_memory ? "not memory the CUDA driver knows"
                            : "this UCX does not know CUDA memory (ucx_info -v lists --with-cuda when it does)");
  void *rkey = NULL;
  size_t rkey_len = 0;
  kvf__ucx_wlock(u);
  if (owned && !unreachable) {
    ucp_mem_map_params_t mp = {.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH,
                               .address = addr,
                               .length = len};
    ucs_status_t st = ucp_mem_map(u->ctx, &mp, &memh);
    if (st != UCS_OK) {
      LOG_WARN("ucx", "ucp_mem_map %p+%zu: %s", addr, len, ucs_status_string(st));
      rc = KVF_EIO;
    }
  }
  if (!rc && !unreachable) {
    ucs_status_t st = ucp_rkey_pack(u->ctx, memh, &rkey, &rkey_len);
    if (st != UCS_OK || rkey_len > UCX_MAX_RKEY_LEN) {
      LOG_WARN("ucx", "ucp_rkey_pack %p+%zu: %s", addr, len, ucs_status_string(st));
      if (st == UCS_OK) ucp_rkey_buffer_release(rkey);
      if (owned) ucp_mem_unmap(u->ctx, memh);
      rc = KVF_EIO;
    }
  }
  pthread_mutex_unlock(&u->wmu);
  if (rc) return rc;
  pthread_mutex_lock(&u->reg_mu);
  rc = add_reg(u, (ucx_reg){base, len, memh, rkey, rkey_len, owned ? REG_PLAIN : REG_IN_POOL, host});
  uint64_t gen = rc ? 0 : ++u->gen;
  pthread_mutex_unlock(&u->reg_mu);
  if (rc) {
    kvf__ucx_wlock(u);
    if (rkey) ucp_rkey_buffer_release(rkey);
    if (owned && memh) ucp_mem_unmap(u->ctx, memh);
    pthread_mutex_unlock(&u->wmu);
    return rc;
  }
  if (!host && atomic_fetch_add(&u->device_regs, 1) == 0) device_memory_came(u, addr, len);
  push_info(u, gen, 0); /* a writer that misses it asks (peer_refresh) */
  return 0;
}

static void ucx_dereg_hook(kvf_engine *e, void *addr) {
  ucx_state *u = e->ucx;
  uint64_t base = (uint64_t)(uintptr_t)addr;
  pthread_mutex_lock(&u->reg_mu);
  ucx_reg *r = find_reg(u, base, REG_PLAIN);
  if (!r) r = find_reg(u, base, REG_IN_POOL);
  ucx_reg gone = {0};
  uint64_t gen = 0;
  if (r) {
    gone = *r;
    del_reg(u, r);
    gen = ++u->gen;
  }
  pthread_mutex_unlock(&u->reg_mu);
  if (!r) return;
  if (!gone.host) atomic_fetch_sub(&u->device_regs, 1);
  /* Writers apply the new generation first (after their writes into the
   * old one that are under way); a put already posted may still complete
   * (one-sided: the target cannot wait for it), which is why the memory must
   * stay mapped until the owner knows no batch is in flight, as with any
   * RDMA engine. */
  push_info(u, gen, 1);
  kvf__ucx_wlock(u);
  if (gone.rkey_buf) ucp_rkey_buffer_release(gone.rkey_buf);
  if (gone.pool == REG_PLAIN && gone.memh) ucp_mem_unmap(u->ctx, gone.memh);
  pthread_mutex_unlock(&u->wmu);
}

static int ucx_alloc_pool(kvf_engine *e, size_t len, void **out) {
  ucx_state *u = e->ucx;
  ucp_mem_map_params_t mp = {.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                                           UCP_MEM_MAP_PARAM_FIELD_FLAGS,
                             .address = NULL,
                             .length = len,
                             .flags = UCP_MEM_MAP_ALLOCATE};
  ucp_mem_h memh;
  ucp_mem_attr_t attr = {.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS | UCP_MEM_ATTR_FIELD_LENGTH};
  kvf__ucx_wlock(u);
  ucs_status_t st = ucp_mem_map(u->ctx, &mp, &memh);
  if (st == UCS_OK && (st = ucp_mem_query(memh, &attr)) != UCS_OK) ucp_mem_unmap(u->ctx, memh);
  pthread_mutex_unlock(&u->wmu);
  if (st != UCS_OK) {
    LOG_WARN("ucx", "allocating a %zu-byte pool: %s", len, ucs_status_string(st));
    return KVF_ENOMEM;
  }
  pthread_mutex_lock(&u->reg_mu);
  int rc = add_reg(u, (ucx_reg){(uint64_t)(uintptr_t)attr.address, len, memh, NULL, 0, REG_POOL, 1});
  pthread_mutex_unlock(&u->reg_mu);
  if (rc) {
    kvf__ucx_wlock(u);
    ucp_mem_unmap(u->ctx, memh);
    pthread_mutex_unlock(&u->wmu);
    return rc;
  }
  *out = attr.address;
  return 0;
}

static int ucx_free_pool(kvf_engine *e, void *addr) {
  ucx_state *u = e->ucx;
  pthread_mutex_lock(&u->reg_mu);
  ucx_reg *r = find_reg(u, (uint64_t)(uintptr_t)addr, REG_POOL);
  ucp_mem_h memh = r ? r->memh : NULL;
  if (r) del_reg(u, r);
  pthread_mutex_unlock(&u->reg_mu);
  if (!memh) return KVF_ENOTFOUND;
  kvf__ucx_wlock(u);
  ucp_mem_unmap(u->ctx, memh);
  pthread_mutex_unlock(&u->wmu);
  return 0;
}

/* ------------------------------------------------------------ progress */

static void *progress_main(void *arg) {
  kvf__thread_name("kvf-ucx-prog");
  ucx_state *u = arg;
  struct epoll_event ev[16];
  while (!atomic_load(&u->stopping)) {
    kvf__ucx_wlock(u);
    /* Progress may write peers' bytes into registered memory (RMA that the
     * target carries out, as over tcp): order it after the owner's last
     * local change and publish it to the owner's next sync, as tcp_in.c does. */
    kvf_engine_sync(u->e);
    while (ucp_worker_progress(u->w)) {
    }
    kvf_engine_sync(u->e);
    ucs_status_t st = ucp_worker_arm(u->w);
    int busy = u->ops != NULL || atomic_load(&u->npartial), trailers = u->tq != NULL;
    /* Sleep only when the worker is armed and no flushed chunk waits to send
     * its trailer (the progress above may have completed one); with batches
     * in flight wake at least every tick to check their deadlines, and idle
     * at least every UCX_IDLE_TICK_MS (the first op linked while this thread
     * sleeps wakes it when due sooner: kvf__ucx_op_link). */
    int wait_ms = st == UCS_ERR_BUSY || trailers ? 0 : busy ? UCX_TICK_MS : UCX_IDLE_TICK_MS;
    u->wake_by_ns = clock_now_ns() + (int64_t)wait_ms * 1000000;
    pthread_mutex_unlock(&u->wmu);
    int n = epoll_wait(u->epfd, ev, 16, wait_ms);
    for (int i = 0; i < n; i++) {
      void *tag = ev[i].data.ptr;
      if (tag == u) {
        uint64_t v;
        ssize_t r = read(u->wake_fd, &v, sizeof v);
        (void)r;
      } else if (tag) {
        kvf__ucx_peer_event(u, tag, ev[i].events);
      }
    }
    kvf__ucx_reap(u);
    kvf__ucx_partials_check(u);
    kvf__ucx_trailers_send(u);
  }
  return NULL;
}

/* ------------------------------------------------------------ start / stop */

#define UCX_TEARDOWN_ROUNDS 10000 /* progress calls at most, to run cancelled flushes' callbacks */

static void ucx_teardown(ucx_state *u) {
  kvf__ucx_warm_fini(u); /* every connection ended before: no mapping is loaded from */
  kvf__ucx_peers_free(u);
  if (u->w) {
    /* The peers' endpoints were closed with FORCE: flushes still pending
     * (a stopped peer's) are cancelled, but their callbacks, which free
     * each flush's ucx_op, run only inside progress. Bounded: a few idle
     * rounds in a row end it. */
    kvf__ucx_wlock(u);
    for (int i = 0, idle = 0; i < UCX_TEARDOWN_ROUNDS && idle < 3; i++)
      idle = ucp_worker_progress(u->w) ? 0 : idle + 1;
    pthread_mutex_unlock(&u->wmu);
    for (size_t i = 0; i < u->nregs; i++) {
      if (u->regs[i].rkey_buf) ucp_rkey_buffer_release(u->regs[i].rkey_buf);
      if (u->regs[i].pool != REG_IN_POOL && u->regs[i].memh) ucp_mem_unmap(u->ctx, u->regs[i].memh);
    }
    if (u->addr) ucp_worker_release_address(u->w, u->addr);
    ucp_worker_destroy(u->w);
  }
  kvf__ucx_ops_free(u); /* flushes whose callbacks never ran (no worker left to run them) */
  for (size_t i = 0; i < u->nquarantine; i++) free(u->quarantine[i]);
  free(u->quarantine);
  if (u->ctx) ucp_cleanup(u->ctx);
  kvf__ucx_cuda_release(u);
  if (u->epfd >= 0) close(u->epfd);
  if (u->wake_fd >= 0) close(u->wake_fd);
  free(u->regs);
  free(u->cma_value);
  kvf__smap_free(&u->peers);
  pthread_mutex_destroy(&u->wmu);
  pthread_mutex_destroy(&u->reg_mu);
  pthread_mutex_destroy(&u->ctl_mu);
  pthread_cond_destroy(&u->ctl_cv);
  pthread_mutex_destroy(&u->peers_mu);
  pthread_mutex_destroy(&u->q_mu);
  pthread_cond_destroy(&u->q_cv);
  free(u);
}

static int ucx_init(ucx_state *u) {
  ucp_config_t *conf = NULL;
  ucs_status_t st = ucp_config_read(NULL, NULL, &conf);
  if (st != UCS_OK) goto fail;
  /* Unless the user chose (UCX_TLS), UCX runs shared memory, CMA and RDMA
   * only: kvferry's own TCP serves the peers UCX's tcp would (see decide()
   * in ucx_peer.c), and with tcp present UCX may pick it over CMA. */
  const char *tls = getenv("UCX_TLS");
  if ((!tls || !*tls) && (st = ucp_config_modify(conf, "TLS", "^tcp")) != UCS_OK) {
    ucp_config_release(conf);
    goto fail;
  }
  ucp_params_t pp = {.field_mask = UCP_PARAM_FIELD_FEATURES | UCP_PARAM_FIELD_MT_WORKERS_SHARED,
                     .features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP,
                     .mt_workers_shared = 0};
  st = ucp_init(&pp, conf, &u->ctx);
  if (st == UCS_OK) {
    ucp_context_attr_t ca = {.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES};
    u->cuda_memory = ucp_context_query(u->ctx, &ca) == UCS_OK && (ca.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA));
    /* A UCX that knows CUDA memory runs its newer protocols unless the user
     * chose (UCX_PROTO_ENABLE; the default from UCX 1.16): the older ones
     * copy device memory with the CPU in places (the software RMA's put
     * handler; seen killing the target, host to device, on an H200 with UCX
     * 1.13.1), where the newer ones move it with cuda_copy and cuda_ipc
     * (scripts/gpu/README.md). */
    const char *proto = getenv("UCX_PROTO_ENABLE");
    if (u->cuda_memory && (!proto || !*proto) && ucp_config_modify(conf, "PROTO_ENABLE", "y") == UCS_OK) {
      ucp_cleanup(u->ctx);
      u->ctx = NULL;
      st = ucp_init(&pp, conf, &u->ctx);
    }
  }
  ucp_config_release(conf);
  if (st != UCS_OK) goto fail;
  ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                            .thread_mode = UCS_THREAD_MODE_SERIALIZED};
  if ((st = ucp_worker_create(u->ctx, &wp, &u->w)) != UCS_OK) goto fail;
  ucp_worker_attr_t wa = {.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS};
  if ((st = ucp_worker_query(u->w, &wa)) != UCS_OK) goto fail;
  u->addr = wa.address;
  u->addr_len = wa.address_length;
  if (u->addr_len > UCX_MAX_ADDR_LEN) {
    st = UCS_ERR_EXCEEDS_LIMIT;
    goto fail;
  }
  int efd;
  if ((st = ucp_worker_get_efd(u->w, &efd)) != UCS_OK) goto fail;
  u->epfd = epoll_create1(EPOLL_CLOEXEC);
  u->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  struct epoll_event ev = {.events = EPOLLIN, .data.ptr = NULL};
  struct epoll_event wev = {.events = EPOLLIN, .data.ptr = u};
  if (u->epfd < 0 || u->wake_fd < 0 || epoll_ctl(u->epfd, EPOLL_CTL_ADD, efd, &ev) ||
      epoll_ctl(u->epfd, EPOLL_CTL_ADD, u->wake_fd, &wev)) {
    LOG_ERROR("ucx", "epoll setup: %s", strerror(errno));
    return KVF_EIO;
  }
  return 0;
fail:
  LOG_ERROR("ucx", "cannot start UCX: %s", ucs_status_string(st));
  return KVF_EIO;
}

static int ucx_start(kvf_engine *e) {
  ucx_state *u = calloc(1, sizeof *u);
  if (!u) return KVF_ENOMEM;
  u->e = e;
  u->epfd = u->wake_fd = -1;
  pthread_mutex_init(&u->wmu, NULL);
  pthread_mutex_init(&u->reg_mu, NULL);
  pthread_mutex_init(&u->ctl_mu, NULL);
  clock_cond_init(&u->ctl_cv);
  pthread_mutex_init(&u->peers_mu, NULL);
  pthread_mutex_init(&u->q_mu, NULL);
  pthread_cond_init(&u->q_cv, NULL);
  kvf__ucx_warm_init(u);
  int rc = smap_init(&u->peers);
  if (!rc) rc = ucx_init(u);
  if (!rc)
    rc = kvf__evpool_start(&ctl_pool_ops, u, UCX_CTL_CORE_WORKERS, UCX_CTL_RETIRE_MS, UCX_CTL_RETIRE_MS,
                           &u->ctl_pool);
  if (rc) goto err;
  host_identity(u->host_id, sizeof u->host_id);
  u->cma_off = kvf__env_get_int("KVFERRY_UCX_CMA", 1) == 0;
  if (!u->cma_off && (u->cma_value = malloc(sizeof *u->cma_value))) *u->cma_value = cma_probe_value();
  u->rdma = has_rdma_device();
  e->ucx = u;
  rc = kvf__tcp_transport_ops.start(e);
  if (rc) goto err;
  if (pthread_create(&u->progress, NULL, progress_main, u)) {
    kvf__tcp_transport_ops.stop(e);
    rc = KVF_ENOMEM;
    goto err;
  }
  kvf__ucx_copier_start(u);
  return 0;
err:
  ctl_stop(u);
  e->ucx = NULL;
  ucx_teardown(u);
  return rc;
}

static void ucx_stop(kvf_engine *e) {
  ucx_state *u = e->ucx;
  if (!u) return;
  /* The listener first (it hands rendezvous connections over), then the
   * rendezvous server. */
  atomic_store(&u->stopping, 1);
  kvf__tcp_transport_ops.stop(e);
  ctl_stop(u);
  kvf__ucx_wake(u);
  pthread_join(u->progress, NULL);
  pthread_mutex_lock(&u->q_mu);
  pthread_cond_broadcast(&u->q_cv);
  pthread_mutex_unlock(&u->q_mu);
  for (int i = 0; i < u->ncopiers; i++) pthread_join(u->copiers[i], NULL);
  ucx_teardown(u);
  e->ucx = NULL;
}

const transport_ops kvf__ucx_transport_ops = {
    .name = "ucx",
    .start = ucx_start,
    .stop = ucx_stop,
    .submit = kvf__ucx_submit,
    .reg = ucx_reg_hook,
    .dereg = ucx_dereg_hook,
    .serve = ucx_serve,
    .describe = kvf__ucx_describe,
    .path = kvf__ucx_path,
    .alloc_pool = ucx_alloc_pool,
    .free_pool = ucx_free_pool,
    .fence_close = ucx_fence_close,
    .routes = kvf__ucx_routes,
};

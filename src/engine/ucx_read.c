/* The UCX transport, read mode: between two kvferry engines the target (the
 * decode, whose memory receives the bytes) reads each chunk itself instead
 * of the writer putting it, so the side whose memory is at risk drives
 * every byte that lands in it (docs/WIRE-EXTENSIONS.md, "Decode-initiated
 * reads").
 *
 * Writer: a chunk goes to the target as a ready notice on the rendezvous
 * connection (ucx_notice: its id, the batch's fence tag and epoch, the
 * writer's clock and a lease, the descriptors, the completion trailer).
 * The chunk finishes when the target answers "read done", when the target
 * closes the connection (it reads nothing more then), or when the lease
 * ends; until then the sources stay as they are. Before the first notice,
 * and whenever its registrations change, the writer sends its own info
 * (worker address, regions with packed keys).
 *
 * Target: the connection's serving thread checks a notice (the fence pair
 * open, every destination inside this engine's registered memory and the
 * fence's bounds, every source inside a region the writer advertised),
 * reads it (plain loads from a pool UCX mapped here, ucp_get elsewhere: CMA
 * or the NIC), hands the trailer over once the bytes are in place, and
 * answers. A read counts only if it completed before the lease ended by
 * the writer's clock, bounded from above here: the writer's info answers
 * this engine's first info and a clock question answers another, and a
 * message sent at this engine's t0 and answered with the writer's w shows
 * (writer - here) <= w - t0, plus UCX_CLOCK_DRIFT_PPM since then. A closed
 * fence, an unregister or the connection being cut stops a read within one
 * slice (UCX_READ_SLICE); gets in flight are cancelled by closing the
 * endpoint (forced), after which UCX places no more data. */
#include <errno.h>
#include <inttypes.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/copy.h"
#include "base/log.h"
#include "engine/ucx.h"

/* The writer's clock values this engine takes (chosen by the peer, so
 * bounded before any arithmetic on them): a clock more than this far from
 * ours (about 11.6 days) gives no bound, and a notice's sent time past the
 * second limit is refused, so lease ends never overflow. */
#define UCX_CLOCK_SKEW_MAX_NS ((int64_t)1000000000000000)
#define UCX_CLOCK_SENT_MAX_NS ((int64_t)4000000000000000000)

/* ------------------------------------------------------------ writer */

/* Send the iovecs whole before the deadline (a partial send resumes);
 * `more`: MSG_MORE, the kernel holds them for what follows (a hold). */
static int sendv_all(int fd, struct iovec *iov, int cnt, int64_t deadline_ns, int more) {
  while (cnt > 0) {
    struct msghdr mh = {.msg_iov = iov, .msg_iovlen = (size_t)cnt};
    ssize_t r = sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT | (more ? MSG_MORE : 0));
    if (r < 0) {
      if (errno == EINTR) continue;
      if (errno != EAGAIN && errno != EWOULDBLOCK) return KVF_ECLOSED;
      /* Full: the rest goes through the waiting sender, piece by piece. */
      for (int i = 0; i < cnt; i++) {
        int rc = kvf__fd_send_all(fd, iov[i].iov_base, iov[i].iov_len, deadline_ns);
        if (rc) return rc;
      }
      return 0;
    }
    size_t n = (size_t)r;
    while (cnt > 0 && n >= iov->iov_len) n -= iov->iov_len, iov++, cnt--;
    if (cnt > 0) iov->iov_base = (char *)iov->iov_base + n, iov->iov_len -= n;
  }
  return 0;
}

/* The end of a hold (kvf__engine_hold_end): what this thread's notices
 * left held on the peer's connection goes out (setting TCP_NODELAY pushes
 * a socket's pending data). A connection reset since held nothing: its
 * socket closed with it. */
static void notices_push(void *arg) {
  ucx_peer *p = arg;
  pthread_rwlock_rdlock(&p->rw); /* fd changes under it (reset, reconnect) */
  pthread_mutex_lock(&p->mu);
  int one = 1;
  if (p->fd >= 0) setsockopt(p->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  pthread_mutex_unlock(&p->mu);
  pthread_rwlock_unlock(&p->rw);
}

void kvf__ucx_notice_send(ucx_state *u, ucx_peer *p, chunk *c) {
  kvf_engine *e = u->e;
  int64_t now = clock_now_ns();
  int64_t lease = (int64_t)e->cfg.read_lease_ms * 1000000, left = c->batch->deadline_ns - now;
  if (left < lease) lease = left;
  if (lease <= 0) {
    kvf__chunk_finish(c, KVF_ETIMEDOUT);
    return;
  }
  int rc = kvf__ucx_writer_info_refresh(u, p);
  ucx_op *op = rc ? NULL : calloc(1, sizeof *op);
  if (!op) { /* nothing of the notice went out: it fails now */
    if (!rc) rc = KVF_ENOMEM;
    else kvf__ucx_peer_mark_dead(u, p, rc);
    kvf__chunk_finish(c, rc);
    return;
  }
  *op = (ucx_op){.c = c, .p = p, .u = u, .read = 1, .conn_id = p->conn_id, .lease_end_ns = now + lease};
  /* Held while the notice is being sent (its descriptors and trailer are the
   * chunk's): the answer may come, and finish the chunk, before the send
   * call has returned. */
  atomic_fetch_add(&c->refs, 1);
  /* From the link on, `op` belongs to the progress thread (an answer or the
   * reaper may free it at once): only its id is used here. */
  kvf__ucx_wlock(u);
  uint64_t id = op->id = ++p->next_read_id;
  /* Its connection already closed by the target (the progress thread read
   * its end between this thread's checks and here): nothing reads it. */
  if (op->conn_id == p->reads_closed_conn) op->gone = KVF_ECLOSED;
  kvf__ucx_op_link(op); /* the progress thread checks its lease at its next tick (UCX_IDLE_TICK_MS at most) */
  pthread_mutex_unlock(&u->wmu);
  ucx_notice n = {UCX_NOTICE_MAGIC,
                  (uint32_t)c->n,
                  id,
                  c->batch->tag,
                  c->batch->tag ? c->batch->epoch : 0,
                  now,
                  lease,
                  c->tlen,
                  0};
  struct iovec iov[3] = {{&n, sizeof n}, {c->writes, c->n * sizeof *c->writes}, {c->trailer, c->tlen}};
  pthread_mutex_lock(&p->mu);
  /* Marked dead meanwhile (another notice cut short: a whole one must not
   * follow it on the stream): nothing goes out, as with no connection. */
  int fd = atomic_load(&p->dead) ? -1 : p->fd;
  /* In a burst (kvf__engine_hold_begin) the notice waits in the kernel for
   * the next ones (the peer's own lock is taken in the push, never under it). */
  int held = fd >= 0 && kvf__engine_hold_add(notices_push, p);
  rc = fd < 0 ? KVF_ECLOSED : sendv_all(fd, iov, c->tlen ? 3 : 2, clock_deadline_ms(UCX_CTL_TIMEOUT_MS), held);
  pthread_mutex_unlock(&p->mu);
  if (rc) {
    /* Cut short: the target may have the notice whole and read it, so the
     * chunk waits for the lease (or the target closing) like any other;
     * with no connection at all nothing went out. */
    kvf__ucx_peer_mark_dead(u, p, rc);
    if (fd < 0) { /* the reaper fails it at once (if nothing ended it yet) */
      kvf__ucx_wlock(u);
      for (ucx_op *o = u->ops; o; o = o->next)
        if (o->read && o->p == p && o->id == id && !o->gone) o->gone = rc;
      pthread_mutex_unlock(&u->wmu);
      kvf__ucx_wake(u);
    }
  }
  kvf__chunk_release(c); /* the send's reference */
}

void kvf__ucx_read_done(ucx_state *u, ucx_peer *p, uint64_t conn_id, uint64_t id, int status) {
  if (status > 0) status = KVF_EPROTO;
  kvf__ucx_wlock(u);
  ucx_op *op = u->ops;
  while (op && !(op->read && op->p == p && op->id == id && op->conn_id == conn_id)) op = op->next;
  if (op) kvf__ucx_op_unlink(op);
  pthread_mutex_unlock(&u->wmu);
  if (!op) return; /* ended already (its lease): the answer comes too late to matter */
  chunk *c = op->c;
  free(op);
  if (!status) atomic_thread_fence(memory_order_acquire);
  kvf__chunk_finish(c, status);
}

void kvf__ucx_reads_closed_locked(ucx_peer *p, uint64_t conn_id) {
  ucx_state *u = p->u;
  if (conn_id > p->reads_closed_conn) p->reads_closed_conn = conn_id;
  for (ucx_op *op = u->ops; op; op = op->next)
    if (op->read && op->p == p && op->conn_id == conn_id && !op->gone) op->gone = KVF_ECLOSED;
}

void kvf__ucx_reads_closed(ucx_state *u, ucx_peer *p, uint64_t conn_id) {
  kvf__ucx_wlock(u);
  kvf__ucx_reads_closed_locked(p, conn_id);
  pthread_mutex_unlock(&u->wmu);
  kvf__ucx_wake(u);
}

/* ------------------------------------------------------------ target */

static void reader_ep_error(void *arg, ucp_ep_h ep, ucs_status_t st) {
  (void)ep;
  ucx_ctl *c = arg;
  LOG_WARN("ucx", "endpoint for reads from %s failed: %s", c->peer, ucs_status_string(st));
  atomic_store(&c->ep_failed, 1);
}

/* With wmu held: end the endpoint to the writer, cancelling what it still
 * carries; `req`, a flush on it still in progress, is waited for (it ends
 * cancelled) and freed. From here UCX places no more data of those gets. */
static void reader_ep_cancel_locked(ucx_state *u, ucx_ctl *c, void *req) {
  if (c->ep) {
    ucp_request_param_t cp = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS, .flags = UCP_EP_CLOSE_FLAG_FORCE};
    void *creq = ucp_ep_close_nbx(c->ep, &cp);
    c->ep = NULL;
    for (int i = 0; i < 100000 && UCS_PTR_IS_PTR(creq) && ucp_request_check_status(creq) == UCS_INPROGRESS; i++)
      ucp_worker_progress(u->w);
    if (UCS_PTR_IS_PTR(creq)) ucp_request_free(creq);
  }
  for (int i = 0; i < 100000 && req && ucp_request_check_status(req) == UCS_INPROGRESS; i++)
    ucp_worker_progress(u->w);
  if (req) ucp_request_free(req);
  kvf__ucx_warm_stop(u, c);                    /* the keys' mappings end with them */
  kvf__ucx_rregions_free(c->wregs, c->nwregs); /* their keys belonged to the endpoint */
  c->wregs = NULL;
  c->nwregs = 0;
}

/* With wmu held: the endpoint to the writer and its regions, from the
 * writer's last info (kept in waddr: header, then body). UCX parses the
 * body's keys only behind UCX_RKEY_PARSE_PAD zeroed bytes: `padded` is the
 * body as received (kvf__ucx_info_read_rest pads it), or NULL to pad a
 * copy of the kept one here. The kept copy has no pad: 64 KiB of zeros per
 * writer, held for the connection's life, were most of what an idle peer
 * cost (issue 24). The regions UCX mapped here are then mapped ahead
 * (ucx_warm.c), until reader_ep_cancel_locked releases them. */
static int reader_ep_make_locked(ucx_state *u, ucx_ctl *c, const char *padded) {
  if (c->ep && !atomic_load(&c->ep_failed)) return 0;
  if (c->ep) reader_ep_cancel_locked(u, c, NULL);
  atomic_store(&c->ep_failed, 0);
  const ucx_info_hdr *h = c->waddr;
  char *copy = NULL;
  if (!padded) {
    if (!(copy = malloc((size_t)h->body_len + UCX_RKEY_PARSE_PAD))) return KVF_ENOMEM;
    memcpy(copy, (const char *)c->waddr + sizeof *h, h->body_len);
    memset(copy + h->body_len, 0, UCX_RKEY_PARSE_PAD);
    padded = copy;
  }
  int rc = kvf__ucx_ep_create(u, padded, c->same_host, reader_ep_error, c, c->peer, &c->ep);
  size_t off = h->addr_len;
  if (!rc) rc = kvf__ucx_regions_unpack(c->ep, h, padded, &off, c->same_host, c->peer, &c->wregs, &c->nwregs);
  free(copy);
  if (!rc) kvf__ucx_warm_start(u, c);
  return rc;
}

/* The writer's pid if its info offers direct reads (UCX_INFO_CMA) and its
 * probe value reads back through process_vm_readv: then it is this host's
 * process of that pid, in this PID namespace, and this one may read it.
 * 0 otherwise (its private memory is read through UCX), said once. Not
 * where UCX_TLS keeps UCX off shared memory (its tcp on one host, asked for
 * explicitly): there the reader's endpoint would go unused, and UCX 1.13's
 * tcp was seen to abort the process tearing such an endpoint down
 * (ucp_worker_destroy purging a wireup REP, engine_test_*_ucx_tcp). */
static int cma_check(ucx_state *u, const ucx_ctl *c, const ucx_info_hdr *h, const char *body) {
  ucx_cma_probe pr;
  if (u->cma_off || !c->same_host || !(h->flags & UCX_INFO_CMA) ||
      h->body_len < (uint64_t)h->addr_len + sizeof pr || !kvf__ucx_tls_allow_shm())
    return 0;
  memcpy(&pr, body + h->body_len - sizeof pr, sizeof pr);
  if (pr.magic != UCX_CMA_MAGIC || pr.pid == 0 || pr.pid > INT32_MAX) return 0;
  uint64_t v = 0;
  struct iovec local = {&v, sizeof v}, remote = {(void *)(uintptr_t)pr.addr, sizeof v};
  ssize_t n = process_vm_readv((pid_t)pr.pid, &local, 1, &remote, 1, 0);
  if (n == (ssize_t)sizeof v && v == pr.value) return (int)pr.pid;
  if (kvf__log_first_time_for_host(c->peer, "ucx-cma"))
    LOG_INFO("ucx", "writer %s: no direct reads of its private memory (process_vm_readv: %s); through UCX instead",
             c->peer, n < 0 ? strerror(errno) : "another process has that pid here");
  return 0;
}

int kvf__ucx_serve_writer_info(ucx_state *u, ucx_ctl *c) {
  ucx_info_hdr h = {.magic = UCX_INFO_MAGIC};
  char *body = NULL;
  int rc = kvf__ucx_info_read_rest(c->fd, &c->rb, clock_deadline_ms(UCX_CTL_TIMEOUT_MS), &h, &body);
  if (rc) return rc;
  /* UCX parses a worker address with assertions, not checks (a malformed one
   * aborts the process): at least its header byte (object version and
   * flags) must be this worker's own, as between two kvferry engines built
   * on one UCX. An authenticated peer (KVFERRY_AUTH_TOKEN) is trusted with
   * the rest (README, threat model). */
  if (!(h.flags & UCX_INFO_WRITER) || !h.addr_len ||
      *(const unsigned char *)body != *(const unsigned char *)u->addr) {
    free(body);
    return KVF_EPROTO;
  }
  /* Kept (header, body; not the pad) to make the endpoint again after a
   * cancel. */
  char *keep = malloc(sizeof h + h.body_len);
  if (!keep) {
    free(body);
    return KVF_ENOMEM;
  }
  memcpy(keep, &h, sizeof h);
  memcpy(keep + sizeof h, body, h.body_len);
  kvf__ucx_wlock(u);
  if (c->ep) reader_ep_cancel_locked(u, c, NULL); /* new regions: keys on a fresh endpoint */
  free(c->waddr);
  c->waddr = keep;
  c->waddr_len = sizeof h + h.body_len;
  c->same_host = !strcmp(h.host_id, u->host_id);
  c->cma_pid = cma_check(u, c, &h, body);
  rc = reader_ep_make_locked(u, c, body);
  pthread_mutex_unlock(&u->wmu);
  free(body);
  /* The answer to this engine's first info bounds the writer's clock. */
  if (!rc && c->info_ns && h.echo_ns == c->info_ns && h.clock_ns >= c->info_ns - UCX_CLOCK_SKEW_MAX_NS &&
      h.clock_ns <= c->info_ns + UCX_CLOCK_SKEW_MAX_NS) {
    int64_t skew = h.clock_ns - c->info_ns;
    if (!c->have_skew || skew < c->skew_ns) c->skew_ns = skew, c->skew_at_ns = c->info_ns;
    c->have_skew = 1;
  }
  return rc;
}

int kvf__ucx_serve_clock(ucx_state *u, ucx_ctl *c) {
  (void)u;
  ucx_clock_ans a;
  int rc = kvf__ucx_ctl_recv(c, (char *)&a + sizeof a.magic, sizeof a - sizeof a.magic,
                             clock_deadline_ms(UCX_CTL_TIMEOUT_MS));
  if (rc) return rc;
  if (c->ping_ns && a.echo_ns == c->ping_ns && a.clock_ns >= a.echo_ns - UCX_CLOCK_SKEW_MAX_NS &&
      a.clock_ns <= a.echo_ns + UCX_CLOCK_SKEW_MAX_NS) { /* a later bound replaces the older one: clocks drift */
    c->skew_ns = a.clock_ns - a.echo_ns;
    c->skew_at_ns = a.echo_ns;
    c->have_skew = 1;
    c->ping_ns = 0;
  }
  return 0;
}

/* The writer's clock is at most here + this (see the top of the file). */
static int64_t skew_bound(const ucx_ctl *c, int64_t now) {
  int64_t age = now - c->skew_at_ns;
  return c->skew_ns + (age > 0 ? age / (1000000 / UCX_CLOCK_DRIFT_PPM) : 0);
}

/* Ask the writer for its clock again when the bound is old (its answer is
 * read like any message); one question at a time, asked again after the
 * control timeout. */
static void clock_ask(ucx_ctl *c, int64_t now) {
  if (now - c->skew_at_ns < UCX_CLOCK_PING_NS) return;
  if (c->ping_ns && now - c->ping_ns < (int64_t)UCX_CTL_TIMEOUT_MS * 1000000) return;
  now = clock_now_ns(); /* the question's time, as late as can be: the tighter the bound */
  ucx_req q = {UCX_CLOCK_MAGIC, 0, (uint64_t)now};
  pthread_mutex_lock(&c->send_mu);
  if (!kvf__fd_send_all(c->fd, &q, sizeof q, clock_deadline_ms(UCX_CTL_TIMEOUT_MS))) c->ping_ns = now;
  pthread_mutex_unlock(&c->send_mu);
}

/* What one notice reads, and why it stops. */
typedef struct notice_read {
  ucx_state *u;
  ucx_ctl *c;
  const ucx_notice *n;
  engine_fence *fence;
  size_t npins;
  unsigned gen;      /* the region table's revocation count when pinned */
  int64_t lease_end; /* on this engine's clock */
} notice_read;

/* Was the read cut, and with what: the fence closed, a pinned region
 * unregistered, the connection or the engine closing? Atomic loads only:
 * checked before every slice. */
static int read_cut(const notice_read *r) {
  kvf_engine *e = r->u->e;
  if (r->fence && atomic_load(&r->fence->cut)) return KVF_ESTATE;
  if (atomic_load(&e->regions.revocations) != r->gen)
    for (size_t i = 0; i < r->npins; i++)
      if (atomic_load(&r->c->pins[i]->revoked)) return KVF_ERANGE;
  if (atomic_load(&r->c->closing) || atomic_load(&r->u->stopping)) return KVF_ECLOSED;
  return 0;
}

/* read_cut, or the lease over at `now` (the reader's clock). */
static int read_stop_at(const notice_read *r, int64_t now) {
  int rc = read_cut(r);
  return rc ? rc : now >= r->lease_end ? KVF_ETIMEDOUT : 0;
}

static int read_stop(const notice_read *r) { return read_stop_at(r, clock_now_ns()); }

/* Loads read the clock for the lease once per this many bytes, not before
 * every slice: a clock read costs as much as a small slice's copy (a
 * 1-page room is ~64 slices of 16 KiB). Stopping early is only a saving:
 * whether a read counts is decided once every byte is in place, against
 * the clock read then. */
#define UCX_LEASE_CLOCK_BYTES (1u << 20)

/* The span a strided block covers from `base`, or 0 on overflow. */
static int block_span(uint64_t len, uint64_t count, uint64_t stride, uint64_t *span) {
  if (count <= 1) return *span = len, 1;
  return !__builtin_mul_overflow(count - 1, stride, span) && !__builtin_add_overflow(*span, len, span);
}

/* Check every descriptor and pin the destination regions: 0, KVF_ERANGE
 * (outside this engine's memory, the fence's bounds or the writer's
 * regions), KVF_EPROTO (sizes that overflow). */
static int notice_check(notice_read *r, const kvf_write *w, uint32_t ndesc) {
  ucx_ctl *c = r->c;
  kvf_engine *e = r->u->e;
  if (c->pins_cap < ndesc) {
    region **pv = realloc(c->pins, ndesc * sizeof *pv);
    if (!pv) return KVF_ENOMEM;
    c->pins = pv;
    c->pins_cap = ndesc;
  }
  int rc = 0;
  if (r->fence && kvf__fence_bounds_begin(e, r->fence)) rc = KVF_ESTATE;
  pthread_rwlock_rdlock(&e->regions.lock);
  r->gen = atomic_load(&e->regions.revocations);
  for (uint32_t i = 0; !rc && i < ndesc; i++) {
    uint64_t count = w[i].count > 1 ? w[i].count : 1, sspan, dspan;
    if (!w[i].len || kvf__write_overlaps(&w[i]) || !block_span(w[i].len, count, w[i].src_stride, &sspan) ||
        !block_span(w[i].len, count, w[i].dst_stride, &dspan)) {
      rc = KVF_EPROTO;
      break;
    }
    region *dr = kvf__regions_find_block_locked(&e->regions, w[i].dst, w[i].len, count, w[i].dst_stride);
    if (!dr || dr->device || !kvf__ucx_rregion_find(c->wregs, c->nwregs, w[i].src, sspan) ||
        (r->fence && !kvf__fence_bounds_ok(r->fence, w[i].dst, w[i].len, count, w[i].dst_stride))) {
      rc = KVF_ERANGE;
      break;
    }
    kvf__region_pin(dr);
    c->pins[r->npins++] = dr;
  }
  pthread_rwlock_unlock(&e->regions.lock);
  if (r->fence) kvf__fence_bounds_end(e);
  return rc;
}

/* With wmu held: the gets into the bounce buffer were cancelled (or
 * failed): UCX may still place their data there, so the buffer is kept
 * aside until the engine stops and the next get gets a new one. */
static void bounce_quarantine_locked(ucx_state *u, ucx_ctl *c) {
  if (!c->bounce) return;
  if (u->nquarantine == u->cap_quarantine) {
    size_t cap = u->cap_quarantine ? 2 * u->cap_quarantine : 8;
    void **v = realloc(u->quarantine, cap * sizeof *v);
    if (!v) return; /* kept by the connection: it is not reused before its gets are cancelled again */
    u->quarantine = v;
    u->cap_quarantine = cap;
  }
  u->quarantine[u->nquarantine++] = c->bounce;
  c->bounce = NULL;
}

/* With wmu held: progress until none of the connection's gets is in
 * progress any more (bounded: used after their endpoint was closed). */
static void gets_settle_locked(ucx_state *u, ucx_ctl *c) {
  for (int i = 0; i < 100000; i++) {
    int busy = 0;
    for (unsigned k = 0; k < c->nreq && !busy; k++) busy = ucp_request_check_status(c->reqs[k]) == UCS_INPROGRESS;
    if (!busy) break;
    ucp_worker_progress(u->w);
  }
}

/* With wmu held: release the connection's get requests (each is complete,
 * or its endpoint is closed); the first error among them. UCX 1.13 asserts
 * when a software-RMA get (UCX's tcp) is released before it completes, so
 * every get is kept until then. */
static int gets_release_locked(ucx_ctl *c) {
  int rc = 0;
  for (unsigned k = 0; k < c->nreq; k++) {
    ucs_status_t st = ucp_request_check_status(c->reqs[k]);
    if (!rc && st != UCS_OK) rc = st == UCS_INPROGRESS ? KVF_ECLOSED : kvf__ucx_status(st);
    ucp_request_free(c->reqs[k]);
  }
  c->nreq = 0;
  return rc;
}

/* With wmu held: wait for the gets posted on the endpoint, progressing the
 * worker; a stop cancels them (the endpoint closed, its bounce buffer set
 * aside). */
static int gets_wait_locked(notice_read *r) {
  ucx_state *u = r->u;
  ucx_ctl *c = r->c;
  int idle = 0, stop = 0;
  for (unsigned k = 0; k < c->nreq;) {
    if (ucp_request_check_status(c->reqs[k]) != UCS_INPROGRESS) {
      k++;
      continue;
    }
    if (ucp_worker_progress(u->w)) {
      idle = 0;
      continue;
    }
    pthread_mutex_unlock(&u->wmu); /* let the progress thread and the other readers in */
    stop = read_stop(r);
    if (!stop && atomic_load(&c->ep_failed)) stop = KVF_ECLOSED;
    if (!stop) {
      if (++idle < 64) sched_yield();
      else usleep(20);
    }
    kvf__ucx_wlock(u);
    if (stop) break;
  }
  if (stop) {
    reader_ep_cancel_locked(u, c, NULL);
    gets_settle_locked(u, c);
    gets_release_locked(c);
    bounce_quarantine_locked(u, c);
    return stop;
  }
  int rc = gets_release_locked(c);
  if (rc) {
    reader_ep_cancel_locked(u, c, NULL);
    bounce_quarantine_locked(u, c);
  }
  return rc;
}

/* Slices read into the bounce buffer, to copy into place. */
typedef struct bounce_slice {
  uint64_t dst;
  uint32_t off, len;
} bounce_slice;

/* Wait for the gets into the bounce buffer, then copy their slices into
 * place, the fence checked before each. */
static int bounce_drain(notice_read *r, bounce_slice *pend, unsigned *np, uint32_t *used) {
  ucx_state *u = r->u;
  ucx_ctl *c = r->c;
  kvf__ucx_wlock(u);
  int rc = gets_wait_locked(r); /* with no endpoint left, nothing is in progress */
  pthread_mutex_unlock(&u->wmu);
  for (unsigned i = 0; !rc && i < *np; i++) {
    if ((rc = read_stop(r))) break;
    memcpy((void *)(uintptr_t)pend[i].dst, c->bounce + pend[i].off, pend[i].len);
  }
  *np = 0;
  *used = 0;
  return rc;
}

/* A slice to load from a pool mapped here, or with `remote`, to read from
 * the writer's private memory with process_vm_readv (ucx_ctl.cma_pid). */
typedef struct ucx_load {
  void *dst;
  const void *src;
  size_t len;
  int remote;
} ucx_load;

/* Slices of a writer's private memory go to the kernel this many at a time,
 * in one process_vm_readv: one call per slice spent half the bandwidth on
 * the calls for 32 KiB pages (3.4 against 7.9 GB/s on one thread here,
 * 512 MiB of scattered pages). Bounded in bytes so that the fence and the
 * revocations are still checked often and the landing hash finds the bytes
 * in cache. */
#define UCX_CMA_BATCH_SLICES 32u
#define UCX_CMA_BATCH_BYTES (512u * 1024u)

/* Slices [from, to) of a writer's private memory, all remote, straight into
 * place with one call. */
static int cma_read(int pid, const ucx_load *l, size_t from, size_t to, uint64_t bytes) {
  struct iovec local[UCX_CMA_BATCH_SLICES], remote[UCX_CMA_BATCH_SLICES];
  for (size_t i = from; i < to; i++) {
    local[i - from] = (struct iovec){l[i].dst, l[i].len};
    remote[i - from] = (struct iovec){(void *)(uintptr_t)l[i].src, l[i].len};
  }
  ssize_t n = process_vm_readv((pid_t)pid, local, to - from, remote, to - from, 0);
  if (n >= 0 && (uint64_t)n == bytes) return 0;
  if (n < 0 && errno == ESRCH) return KVF_ECLOSED; /* the writer is gone */
  return KVF_ERANGE; /* not mapped there (any more), or no longer readable: nothing counts */
}

/* Copy loads [from, to), the fence checked before each slice, or before
 * each run of remote slices read with one call (at most
 * UCX_CMA_BATCH_SLICES slices, UCX_CMA_BATCH_BYTES bytes); with `stream`,
 * mapped slices past the cache (base/copy.h). */
static int loads_copy(const notice_read *r, const ucx_load *l, size_t from, size_t to, int stream) {
  uint64_t unclocked = 0; /* bytes copied since the lease's clock was read */
  for (size_t i = from, j; i < to; i = j) {
    int clock = i == from || unclocked >= UCX_LEASE_CLOCK_BYTES;
    int rc = clock ? read_stop(r) : read_cut(r);
    if (rc) return rc;
    if (clock) unclocked = 0;
    j = i + 1;
    if (l[i].remote) {
      uint64_t bytes = l[i].len;
      for (; j < to && l[j].remote && j - i < UCX_CMA_BATCH_SLICES && bytes + l[j].len <= UCX_CMA_BATCH_BYTES; j++)
        bytes += l[j].len;
      if ((rc = cma_read(r->c->cma_pid, l, i, j, bytes))) return rc;
      atomic_fetch_add_explicit(&r->u->e->stats.bytes_read_direct, bytes, memory_order_relaxed);
      unclocked += bytes;
    } else if (stream) {
      kvf__copy_stream(l[i].dst, l[i].src, l[i].len);
      unclocked += l[i].len;
    } else {
      memcpy(l[i].dst, l[i].src, l[i].len);
      unclocked += l[i].len;
    }
    for (size_t k = i; r->fence && k < j; k++) /* cache-hot */
      kvf__engine_deliver_landed(r->u->e, r->n->tag, r->n->epoch, l[k].dst, l[k].len);
  }
  return 0;
}

/* A notice's loads copied by two threads, the serving one and a copier:
 * each claims the next `per` loads (about UCX_LOADS_CLAIM_BYTES) until none
 * are left, so a copier that starts late (its wake-up, tens of µs on a VM
 * whose vCPU had halted) takes less, and neither waits for the other's
 * fixed half at the end. */
typedef struct load_share {
  ucx_job job;
  const notice_read *r;
  const ucx_load *l;
  size_t n, per;
  atomic_size_t next; /* the first load not claimed yet */
  atomic_int rc;      /* the first failure; the others stop claiming */
  int stream, done;   /* done: under mu, the copier is through */
  pthread_mutex_t mu;
  pthread_cond_t cv;
} load_share;

static void load_share_work(load_share *s) {
  while (!atomic_load_explicit(&s->rc, memory_order_relaxed)) {
    size_t i = atomic_fetch_add_explicit(&s->next, s->per, memory_order_relaxed);
    if (i >= s->n) return;
    int rc = loads_copy(s->r, s->l, i, s->n - i < s->per ? s->n : i + s->per, s->stream);
    int none = 0;
    if (rc) atomic_compare_exchange_strong(&s->rc, &none, rc);
  }
}

static void load_share_run(void *arg) {
  load_share *s = arg;
  load_share_work(s);
  pthread_mutex_lock(&s->mu);
  s->done = 1;
  pthread_cond_signal(&s->cv);
  pthread_mutex_unlock(&s->mu);
}

/* Below this a notice's loads stay on the serving thread: a hand-off costs
 * a wake-up, and a batch is already cut in one notice per connection
 * (conns_per_peer), which other workers serve at the same time. At 1 MiB a
 * layerwise send's 4 MiB layers (two 2 MiB notices) each paid two hand-offs
 * and fell behind a compute as long as their transfer: 0.35 ms layers,
 * llama-3.1-8b 1024 tokens, the last Success 6.0-10.8 ms (median 10.3)
 * after the compute against 3.3-7.2 ms (median 6.1) at 4 MiB, five
 * alternating runs; e2e and 256-page rooms unchanged within noise. */
#define UCX_LOADS_SPLIT_BYTES (4u << 20)

/* What each of the two threads claims at a time: the lease's clock is read
 * once a claim (UCX_LEASE_CLOCK_BYTES), and a late copier leaves at most
 * one claim for the serving thread to wait on. */
#define UCX_LOADS_CLAIM_BYTES (1u << 20)

/* A notice's loads are copied once this many slices are listed (and at its
 * end): the list costs 24 bytes a slice, and a writer chooses the counts (a
 * 48-byte descriptor of 2^22 one-byte pieces listed 96 MiB before). */
#define UCX_LOADS_WINDOW 8192u

/* Copy the loads, a share of them on a copier thread when there is enough
 * to share: the writer's copiers split a large write the same way. */
static int loads_run(const notice_read *r, const ucx_load *l, size_t n, uint64_t total) {
  ucx_state *u = r->u;
  /* A large window streams, unless the landing hash wants its bytes in cache. */
  const int stream = total >= KVF_COPY_STREAM_MIN_BATCH &&
                     !(r->fence && atomic_load_explicit(&u->e->landed_on, memory_order_relaxed));
  if (n < 2 || total < UCX_LOADS_SPLIT_BYTES || !u->ncopiers) return loads_copy(r, l, 0, n, stream);
  uint64_t per = (uint64_t)n * UCX_LOADS_CLAIM_BYTES / total;
  load_share s = {.r = r, .l = l, .n = n, .per = per ? (size_t)per : 1, .stream = stream};
  atomic_init(&s.next, 0);
  atomic_init(&s.rc, 0);
  pthread_mutex_init(&s.mu, NULL);
  pthread_cond_init(&s.cv, NULL);
  s.job = (ucx_job){.fn = load_share_run, .arg = &s};
  int queued = !kvf__ucx_copier_queue(u, &s.job);
  load_share_work(&s);
  /* A copier that has not taken the job by now has nothing left to do. */
  if (queued && !kvf__ucx_copier_unqueue(u, &s.job)) {
    pthread_mutex_lock(&s.mu);
    while (!s.done) pthread_cond_wait(&s.cv, &s.mu);
    pthread_mutex_unlock(&s.mu);
  }
  pthread_cond_destroy(&s.cv);
  pthread_mutex_destroy(&s.mu);
  return atomic_load(&s.rc);
}

/* Read every piece of the notice into this engine's memory: loads from a
 * mapped pool, gets through the bounce buffer elsewhere. 0 once every byte
 * is in place. */
static int notice_copy(notice_read *r, const kvf_write *w, uint32_t ndesc, uint64_t *bytes) {
  ucx_state *u = r->u;
  ucx_ctl *c = r->c;
  int rc = 0;
  bounce_slice *pend = c->pend;
  unsigned np = 0;
  uint32_t used = 0;
  size_t nload = 0;
  uint64_t load_bytes = 0;
  ucp_request_param_t prm = {.op_attr_mask = 0};
  for (uint32_t i = 0; !rc && i < ndesc; i++) {
    uint64_t count = w[i].count > 1 ? w[i].count : 1;
    const ucx_rregion *src = kvf__ucx_rregion_find(c->wregs, c->nwregs, w[i].src, w[i].len);
    for (uint64_t k = 0; !rc && k < count; k++) {
      uint64_t s = w[i].src + k * w[i].src_stride, d = w[i].dst + k * w[i].dst_stride;
      for (uint64_t off = 0; !rc && off < w[i].len; off += UCX_READ_SLICE) {
        uint32_t len = (uint32_t)(w[i].len - off < UCX_READ_SLICE ? w[i].len - off : UCX_READ_SLICE);
        if ((rc = read_cut(r))) break; /* listing reads nothing: the lease is checked where bytes move */
        src = src && s + off >= src->base && s + off + len <= src->base + src->len
                  ? src
                  : kvf__ucx_rregion_find(c->wregs, c->nwregs, s + off, len);
        if (!src) {
          rc = KVF_ERANGE;
          break;
        }
        *bytes += len;
        if (src->ptr || c->cma_pid) { /* copied below, once every slice is known */
          if (nload == c->loads_cap) {
            size_t cap = c->loads_cap ? 2 * c->loads_cap : 64;
            ucx_load *v = realloc(c->loads, cap * sizeof *v);
            if (!v) {
              rc = KVF_ENOMEM;
              break;
            }
            c->loads = v;
            c->loads_cap = cap;
          }
          c->loads[nload++] =
              src->ptr ? (ucx_load){(void *)(uintptr_t)(d + off), src->ptr + (s + off - src->base), len, 0}
                       : (ucx_load){(void *)(uintptr_t)(d + off), (const void *)(uintptr_t)(s + off), len, 1};
          load_bytes += len;
          if (nload == UCX_LOADS_WINDOW) { /* the list stays bounded whatever counts the writer sends */
            rc = loads_run(r, c->loads, nload, load_bytes);
            nload = 0, load_bytes = 0;
          }
          continue;
        }
        if (np == UCX_BOUNCE_PIECES || used + len > UCX_BOUNCE_BYTES) {
          if ((rc = bounce_drain(r, pend, &np, &used))) break;
        }
        if (!c->bounce && !(c->bounce = malloc(UCX_BOUNCE_BYTES))) {
          rc = KVF_ENOMEM;
          break;
        }
        if (!pend && !(pend = c->pend = malloc(UCX_BOUNCE_PIECES * sizeof *pend))) {
          rc = KVF_ENOMEM;
          break;
        }
        if (!c->reqs && !(c->reqs = malloc(UCX_BOUNCE_PIECES * sizeof *c->reqs))) {
          rc = KVF_ENOMEM;
          break;
        }
        kvf__ucx_wlock(u);
        ucs_status_ptr_t sp = c->ep ? ucp_get_nbx(c->ep, c->bounce + used, len, s + off, src->rkey, &prm)
                                    : UCS_STATUS_PTR(UCS_ERR_NOT_CONNECTED);
        pthread_mutex_unlock(&u->wmu);
        if (UCS_PTR_IS_ERR(sp)) {
          rc = kvf__ucx_status(UCS_PTR_STATUS(sp));
          break;
        }
        if (sp) c->reqs[c->nreq++] = sp; /* released once complete (gets_wait_locked) */
        pend[np++] = (bounce_slice){d + off, used, len};
        used += len;
      }
    }
  }
  if (!rc && nload) rc = loads_run(r, c->loads, nload, load_bytes);
  /* Failed or not, the gets posted end (or are cancelled) before the pins
   * go; their slices are copied only when all went well. */
  if (np) {
    int r2 = rc ? KVF_ECLOSED : 0;
    if (rc) np = 0, r2 = 0;
    int w2 = bounce_drain(r, pend, &np, &used);
    if (!rc) rc = w2 ? w2 : r2;
  }
  return rc;
}

/* Report a notice refused or read late, once per writer host and kind. */
static void notice_refused(ucx_state *u, ucx_ctl *c, const ucx_notice *n, int rc) {
  kvf_engine *e = u->e;
  if (rc == KVF_ETIMEDOUT) {
    atomic_fetch_add(&e->stats.reads_late, 1);
    if (kvf__log_first_time_for_host(c->peer, "ucx-read-late"))
      LOG_WARN("ucx",
               "writer %s: chunk read after its lease (%" PRId64 " ms) ended; not counted (further ones from it "
               "are not logged)",
               c->peer, n->lease_ns / 1000000);
    return;
  }
  if (rc == KVF_ECLOSED) return; /* this engine is stopping or cutting the connection */
  atomic_fetch_add(&e->stats.reads_refused, 1);
  if (rc == KVF_ESTATE) return; /* a closed fence: counted in chunks_fenced, the normal end of a failed room */
  atomic_fetch_add(&e->stats.batches_refused, 1);
  if (kvf__log_first_time_for_host(c->peer, "ucx-read-refused"))
    LOG_WARN("ucx",
             "writer %s: ready notice for tag %" PRIu64 " refused (%s): a source outside its regions or a "
             "destination outside this engine's memory or the room's pages; nothing read (further ones from it "
             "are not logged)",
             c->peer, n->tag, kvf_strerror(rc));
}

int kvf__ucx_serve_notice(ucx_state *u, ucx_ctl *c) {
  kvf_engine *e = u->e;
  ucx_notice n = {.magic = UCX_NOTICE_MAGIC};
  int64_t until = clock_deadline_ms(UCX_CTL_TIMEOUT_MS);
  int rc = kvf__ucx_ctl_recv(c, (char *)&n + sizeof n.magic, sizeof n - sizeof n.magic, until);
  if (rc) return rc;
  if (!c->waddr || n.ndesc == 0 || n.ndesc > UCX_MAX_NOTICE_DESC || n.tlen > KVF_ENGINE_MAX_TRAILER ||
      n.lease_ns <= 0 || n.lease_ns > (int64_t)UCX_MAX_LEASE_MS * 1000000 || (n.tag && !n.epoch) ||
      n.sent_ns < -UCX_CLOCK_SENT_MAX_NS || n.sent_ns > UCX_CLOCK_SENT_MAX_NS)
    return KVF_EPROTO;
  size_t need = (size_t)n.ndesc * sizeof(kvf_write) + n.tlen;
  if (c->cap < need) {
    unsigned char *b = realloc(c->buf, need);
    if (!b) return KVF_ENOMEM;
    c->buf = b;
    c->cap = need;
  }
  if ((rc = kvf__ucx_ctl_recv(c, c->buf, need, until))) return rc;
  const kvf_write *w = (const kvf_write *)(const void *)c->buf;
  const unsigned char *trailer = c->buf + (size_t)n.ndesc * sizeof(kvf_write);

  int64_t now = clock_now_ns();
  notice_read r = {.u = u, .c = c, .n = &n};
  /* Without a bound on the writer's clock no lease can be checked: none is
   * counted (the writer's info answers the first info, so only a writer
   * that echoed something else is here). */
  r.lease_end = c->have_skew ? n.sent_ns + n.lease_ns - skew_bound(c, now) : now;
  uint64_t bytes = 0;
  int status = 0;
  if (n.tag && !(r.fence = kvf__fence_enter(e, n.tag, n.epoch))) status = KVF_ESTATE;
  if (!status && (!c->ep || atomic_load(&c->ep_failed))) { /* again after a cancel: the regions come with it */
    kvf__ucx_wlock(u);
    status = reader_ep_make_locked(u, c, NULL);
    pthread_mutex_unlock(&u->wmu);
  }
  if (!status) status = notice_check(&r, w, n.ndesc);
  int checked = !status; /* a refusal from here on is this engine's (an unregister), not the writer's */
  int64_t t_land = 0;
  if (!status) {
    kvf_engine_sync(e); /* order after the owner's last local change, as tcp_in.c does */
    t_land = r.fence ? clock_now_ns() : 0;
    status = notice_copy(&r, w, n.ndesc, &bytes);
  }
  /* Done reading: it counts only if that was within the lease (by the
   * bound on the writer's clock, taken now) and nothing cut it. */
  int64_t t_done = clock_now_ns();
  if (!status && c->have_skew) r.lease_end = n.sent_ns + n.lease_ns - skew_bound(c, t_done);
  if (!status) status = read_stop_at(&r, t_done);
  if (!status) {
    kvf_engine_sync(e); /* the bytes read, before the trailer's reader looks at them */
    atomic_fetch_add(&e->stats.batches_received, 1);
    atomic_fetch_add(&e->stats.bytes_received, bytes);
    if (r.fence) kvf__fence_landed(r.fence, t_land, t_done, bytes, KVF__FENCE_READ);
    if (n.tlen) {
      /* Handed over before the fence is left, as over tcp: once a fence
       * close returned, no trailer of that epoch arrives. */
      char ip[KVF_ADDR_HOST_LEN];
      if (!kvf__addr_host(c->peer, ip, sizeof ip)) kvf__engine_deliver_trailer(e, trailer, n.tlen, ip);
    }
  }
  for (size_t i = 0; i < r.npins; i++) kvf__region_unpin(&e->regions, c->pins[i]);
  if (r.fence) kvf__fence_leave(e, r.fence);
  if (status) notice_refused(u, c, &n, status);
  /* A writer that knew the open pair sent what may not be read: its owner
   * gives the pair up. */
  if (r.fence && (status == KVF_ERANGE || status == KVF_EPROTO) && !checked)
    kvf__engine_deliver_refusal(e, n.tag, n.epoch, status, c->peer);
  if (c->have_skew) clock_ask(c, t_done);
  kvf__ucx_done_cut_fn cut = atomic_load(&kvf__ucx_done_cut);
  size_t part = cut ? cut(e) : 0;
  if (part > 0 && part < sizeof(ucx_req)) { /* the test seam: part of the answer, and nothing more */
    if ((rc = kvf__ucx_ctl_flush(c))) return rc;
    ucx_req d = {UCX_READ_DONE_MAGIC, (uint32_t)status, n.id};
    pthread_mutex_lock(&c->send_mu);
    int sent = kvf__fd_send_all(c->fd, &d, part, clock_deadline_ms(UCX_CTL_TIMEOUT_MS));
    pthread_mutex_unlock(&c->send_mu);
    return sent;
  }
  return kvf__ucx_ctl_done(c, status, n.id);
}

void kvf__ucx_ctl_reader_free(ucx_state *u, ucx_ctl *c) {
  kvf__ucx_wlock(u);
  reader_ep_cancel_locked(u, c, NULL);
  pthread_mutex_unlock(&u->wmu);
  free(c->waddr);
  free(c->buf);
  free(c->pins);
  free(c->bounce); /* its gets ended with the endpoint above (a cancelled one's buffer is quarantined) */
  c->bounce = NULL;
  free(c->loads);
  c->loads = NULL;
  free(c->pend);
  c->pend = NULL;
  free(c->reqs); /* none left: every notice waits for (or settles) its gets */
  c->reqs = NULL;
  c->waddr = NULL;
  c->buf = NULL;
  c->pins = NULL;
}

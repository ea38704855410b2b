/* The UCX transport, writer side: per peer, the rendezvous connection to
 * its listener, the routing decision (UCX or kvferry's TCP, and why), the
 * endpoint and the peer's advertised regions (the writes themselves are in
 * ucx_write.c). Locking rules in ucx.h. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <unistd.h>

#include "base/addr.h"
#include "base/clock.h"
#include "base/hash.h"
#include "base/hostmem.h"
#include "base/log.h"
#include "base/parse.h"
#include "engine/tcp_proto.h"
#include "engine/ucx.h"

/* ------------------------------------------------------------ peers */

int kvf__ucx_peer_get(ucx_state *u, const char *id, ucx_peer **out) {
  int rc = 0;
  pthread_mutex_lock(&u->peers_mu);
  ucx_peer *p = kvf__smap_get(&u->peers, id);
  if (!p) {
    p = calloc(1, sizeof *p);
    if (!p) {
      rc = KVF_ENOMEM;
      goto out;
    }
    if (kvf__addr_parse(id, strlen(id), p->host, sizeof p->host, &p->port, NULL) ||
        kvf__smap_put(&u->peers, id, p, NULL)) {
      free(p);
      rc = KVF_EINVAL;
      goto out;
    }
    kvf__str_copy(p->id, sizeof p->id, id);
    p->u = u;
    p->fd = -1;
    pthread_mutex_init(&p->conn_mu, NULL);
    /* Writer-preferring, as the region table: a region update (and the
     * unregister waiting for it) is not starved by a stream of batches. */
    pthread_rwlockattr_t ra;
    pthread_rwlockattr_init(&ra);
    pthread_rwlockattr_setkind_np(&ra, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
    pthread_rwlock_init(&p->rw, &ra);
    pthread_rwlockattr_destroy(&ra);
    pthread_mutex_init(&p->mu, NULL);
    pthread_mutex_init(&p->tmu, NULL);
    clock_cond_init(&p->cv);
    if (kvf__map_init(&p->fence_open) || kvf__map_init(&p->fence_closed))
      rc = KVF_ENOMEM; /* a later insert fails */
  }
  *out = p;
out:
  pthread_mutex_unlock(&u->peers_mu);
  return rc;
}

void kvf__ucx_regs_free_locked(ucx_peer *p) {
  kvf__ucx_rregions_free(p->regs, p->nregs);
  p->regs = NULL;
  p->nregs = 0;
}

void kvf__ucx_ep_close_locked(ucx_state *u, ucx_peer *p) {
  if (!p->ep) return;
  ucp_request_param_t cp = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS, .flags = UCP_EP_CLOSE_FLAG_FORCE};
  void *req = ucp_ep_close_nbx(p->ep, &cp);
  if (UCS_PTR_IS_PTR(req)) ucp_request_free(req); /* released when the close completes */
  p->ep = NULL;
}

/* No message of p is partial any more (p->rw held). */
static void partial_clear(ucx_state *u, ucx_peer *p) {
  if (!p->partial_ns) return;
  p->partial_ns = 0;
  atomic_fetch_sub(&u->npartial, 1);
}

/* Has the target closed the rendezvous connection `fd` (its end arrived,
 * or a reset), as far as what has arrived shows? What arrived before the
 * end is dropped (bounded: UCX_RESET_DRAIN_BYTES). Never waits. */
#define UCX_RESET_DRAIN_BYTES (256u << 10)
static int target_closed(int fd) {
  char buf[4096];
  for (size_t got = 0; got < UCX_RESET_DRAIN_BYTES;) {
    ssize_t n = recv(fd, buf, sizeof buf, MSG_DONTWAIT);
    if (n > 0) {
      got += (size_t)n;
      continue;
    }
    if (n < 0 && errno == EINTR) continue;
    return n == 0 || errno == ECONNRESET || errno == EPIPE;
  }
  return 0;
}

/* With p->rw held for writing: drop the endpoint, the rkeys and the
 * rendezvous connection. Flushes still pending fail (UCS_ERR_CANCELED). */
static void peer_reset_locked(ucx_state *u, ucx_peer *p) {
  /* The target closed the connection and the progress thread has not read
   * its end yet (a decode that exited just now): nothing reads this
   * connection's notices any more, so they end now (below). Otherwise a
   * live target may still read those already in its socket after this
   * side closed it, and they keep their lease. */
  int closed_there = p->fd >= 0 && target_closed(p->fd);
  if (p->fd >= 0) {
    epoll_ctl(u->epfd, EPOLL_CTL_DEL, p->fd, NULL);
    close(p->fd);
    p->fd = -1;
  }
  free(p->rb.b); /* what the old connection had sent and nobody read */
  p->rb = (ucx_rbuf){0};
  atomic_store(&p->rb_held, 0);
  partial_clear(u, p);
  kvf__ucx_wlock(u);
  kvf__ucx_regs_free_locked(p);
  kvf__ucx_ep_close_locked(u, p);
  /* No ack comes on a closed connection: fail them now, not at their
   * deadline (when a reconnected peer would be taken for the late one). */
  kvf__ucx_tacks_fail_locked(p, atomic_load(&p->dead) ? atomic_load(&p->dead) : KVF_ECLOSED);
  if (closed_there) kvf__ucx_reads_closed_locked(p, p->conn_id);
  pthread_mutex_unlock(&u->wmu);
  if (closed_there) kvf__ucx_wake(u);
}

void kvf__ucx_peers_free(ucx_state *u) {
  map_iter it;
  kvf__map_iter_init(&it);
  void *v;
  while (kvf__smap_next(&u->peers, &it, NULL, &v)) {
    ucx_peer *p = v;
    peer_reset_locked(u, p);
    pthread_mutex_destroy(&p->conn_mu);
    pthread_rwlock_destroy(&p->rw);
    pthread_mutex_destroy(&p->mu);
    pthread_mutex_destroy(&p->tmu);
    pthread_cond_destroy(&p->cv);
    kvf__map_free(&p->fence_open);
    kvf__map_free(&p->fence_closed);
    free(p);
  }
  /* Let forced closes finish before the worker goes. */
  if (u->w)
    for (int i = 0; i < 1000 && ucp_worker_progress(u->w); i++) {
    }
}

void kvf__ucx_peer_mark_dead(ucx_state *u, ucx_peer *p, int err) {
  int expected = 0;
  if (atomic_compare_exchange_strong(&p->dead, &expected, err)) {
    atomic_store(&u->reap, 1);
    kvf__ucx_wake(u);
  }
}

static void ep_error_cb(void *arg, ucp_ep_h ep, ucs_status_t st) {
  ucx_peer *p = arg;
  LOG_WARN("ucx", "endpoint to %s failed: %s", p->id, ucs_status_string(st));
  kvf__ucx_peer_mark_dead(p->u, p, kvf__ucx_status(st) ? kvf__ucx_status(st) : KVF_ECLOSED);
}

/* ------------------------------------------------------------ rendezvous client */

/* Does the UCX_TLS list allow one of `names`? Unset allows everything; a
 * leading '^' excludes the listed transports. */
static int tls_allows(const char *tls, const char *const *names) {
  if (!tls || !*tls) return 1;
  int negate = tls[0] == '^';
  char buf[256];
  kvf__str_copy(buf, sizeof buf, tls + negate);
  int hit = 0;
  for (char *save = NULL, *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save))
    for (const char *const *n = names; *n; n++)
      if (!strcmp(t, *n) || (!negate && !strcmp(t, "all"))) hit = 1;
  return negate ? !hit : hit;
}

static const char *const SHM_TLS[] = {"sm", "shm", "posix", "sysv", "cma", "knem", "xpmem", "mm", NULL};
static const char *const RDMA_TLS[] = {"ib",   "rc",      "rc_v", "rc_x", "rc_mlx5", "ud",     "ud_v",
                                       "ud_x", "ud_mlx5", "dc",   "dc_x", "dc_mlx5", "rdmacm", NULL};
/* Transports that can carry UCX's peer-failure handling (shared memory
 * cannot in UCX 1.13). */
static const char *const PEER_ERR_TLS[] = {"tcp",  "ib",   "rc",      "rc_v", "rc_x", "rc_mlx5", "ud",
                                           "ud_v", "ud_x", "ud_mlx5", "dc",   "dc_x", "dc_mlx5", NULL};

int kvf__ucx_info_read_rest(int fd, ucx_rbuf *rb, int64_t deadline_ns, ucx_info_hdr *h, char **body) {
  int rc = kvf__ucx_rbuf_recv(fd, rb, (char *)h + sizeof h->magic, sizeof *h - sizeof h->magic, deadline_ns);
  if (rc) return rc;
  if (h->magic != UCX_INFO_MAGIC || h->addr_len == 0 || h->addr_len > UCX_MAX_ADDR_LEN ||
      h->nregions > UCX_MAX_REGIONS || h->body_len > UCX_MAX_INFO_BODY || h->body_len < h->addr_len ||
      memchr(h->host_id, 0, sizeof h->host_id) == NULL)
    return KVF_EPROTO;
  /* ucp_ep_rkey_unpack takes no length: it parses a packed key by the sizes
   * written inside it (a map of memory domains, then at most 255 bytes per
   * domain). A zeroed tail longer than any key can describe keeps a key cut
   * short, or lying about its length, inside this buffer. */
  *body = malloc((size_t)h->body_len + UCX_RKEY_PARSE_PAD);
  if (!*body) return KVF_ENOMEM;
  memset(*body + h->body_len, 0, UCX_RKEY_PARSE_PAD);
  rc = kvf__ucx_rbuf_recv(fd, rb, *body, h->body_len, deadline_ns);
  if (rc) {
    free(*body);
    *body = NULL;
  }
  return rc;
}

static int info_read(int fd, int64_t deadline_ns, ucx_info_hdr *h, char **body) {
  int rc = kvf__fd_recv_all(fd, &h->magic, sizeof h->magic, deadline_ns);
  return rc ? rc : kvf__ucx_info_read_rest(fd, NULL, deadline_ns, h, body);
}

int kvf__ucx_fence_refused(const ucx_peer *p, uint64_t epoch) {
  if (kvf__map_has(&p->fence_closed, epoch)) return 1;
  return epoch < p->fence_next && !kvf__map_has(&p->fence_open, epoch);
}

int kvf__ucx_ctl_pending(const ucx_peer *p) {
  if (p->fd < 0 || atomic_load(&p->fence_wait) || atomic_load(&p->rb_held)) return 1;
  char c;
  ssize_t r = recv(p->fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  return r >= 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

/* With p->rw held for writing: take the fence snapshot at body+off (absent
 * from a peer that predates it: only fence messages count then). */
static int fence_snap_apply(ucx_peer *p, const ucx_info_hdr *h, const char *body, size_t off) {
  ucx_fence_snap snap;
  if (h->body_len - off < sizeof snap) return 0;
  memcpy(&snap, body + off, sizeof snap);
  off += sizeof snap;
  if (snap.nopen > UCX_MAX_OPEN_FENCES || (h->body_len - off) / sizeof(uint64_t) < snap.nopen) return KVF_EPROTO;
  map open;
  if (kvf__map_init(&open)) return KVF_ENOMEM;
  for (uint32_t i = 0; i < snap.nopen; i++) {
    uint64_t ep;
    memcpy(&ep, body + off + i * sizeof ep, sizeof ep);
    if (kvf__map_put(&open, ep, (void *)1, NULL)) {
      kvf__map_free(&open);
      return KVF_ENOMEM;
    }
  }
  kvf__map_free(&p->fence_open);
  p->fence_open = open;
  p->fence_next = snap.next;
  /* Every pair closed before the snapshot is below `next` and not open in
   * it: the closed list starts again. */
  kvf__map_free(&p->fence_closed);
  int rc = kvf__map_init(&p->fence_closed);
  p->fence_asked = 0;
  return rc;
}

static int cmp_rregion(const void *a, const void *b) {
  const ucx_rregion *x = a, *y = b;
  return x->base < y->base ? -1 : x->base > y->base;
}

int kvf__ucx_tls_allow_shm(void) { return tls_allows(getenv("UCX_TLS"), SHM_TLS); }

/* UCX's peer-failure mode restricts it to transports that support it,
 * which on one host means tcp instead of shared memory and CMA. A same-host
 * peer reached over shared memory gets no UCX failure mode: its death is
 * seen through the rendezvous connection and the batch deadline instead. */
static ucp_err_handling_mode_t peer_err_mode(int same_host) {
  const char *tls = getenv("UCX_TLS");
  if (same_host && tls_allows(tls, SHM_TLS)) return UCP_ERR_HANDLING_MODE_NONE;
  return tls_allows(tls, PEER_ERR_TLS) ? UCP_ERR_HANDLING_MODE_PEER : UCP_ERR_HANDLING_MODE_NONE;
}

int kvf__ucx_ep_create(ucx_state *u, const void *address, int same_host, ucp_err_handler_cb_t cb, void *arg,
                       const char *who, ucp_ep_h *out) {
  ucp_ep_params_t ep = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                                      UCP_EP_PARAM_FIELD_ERR_HANDLER,
                        .address = (const ucp_address_t *)address,
                        .err_mode = peer_err_mode(same_host),
                        .err_handler = {.cb = cb, .arg = arg}};
  ucs_status_t st = ucp_ep_create(u->w, &ep, out);
  if (st == UCS_ERR_UNREACHABLE && ep.err_mode == UCP_ERR_HANDLING_MODE_PEER) {
    /* UCX 1.13's shared-memory transports have no peer-failure support;
     * a dead peer is then noticed through the rendezvous connection and
     * the batch deadline (kvf__ucx_peer_event, kvf__ucx_reap). */
    ep.err_mode = UCP_ERR_HANDLING_MODE_NONE;
    st = ucp_ep_create(u->w, &ep, out);
  }
  if (st == UCS_OK && ep.err_mode == UCP_ERR_HANDLING_MODE_NONE) {
    if (kvf__log_first_time(kvf__hash_str("ucx-err-mode-none", 3)))
      LOG_INFO("ucx",
               "the UCX transports to %s have no peer-failure handling; failures are detected "
               "through the rendezvous connection and batch deadlines",
               who);
  }
  if (st != UCS_OK) {
    LOG_WARN("ucx", "cannot reach %s over UCX: %s", who, ucs_status_string(st));
    *out = NULL;
    return kvf__ucx_status(st) == KVF_ECLOSED ? KVF_ECONNREFUSED : kvf__ucx_status(st);
  }
  return 0;
}

void kvf__ucx_rregions_free(ucx_rregion *regs, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (regs[i].rkey) ucp_rkey_destroy(regs[i].rkey);
  free(regs);
}

const ucx_rregion *kvf__ucx_rregion_find(const ucx_rregion *regs, size_t n, uint64_t addr, uint64_t len) {
  size_t lo = 0, hi = n;
  while (lo < hi) {
    size_t mid = (lo + hi) / 2;
    if (regs[mid].base <= addr) lo = mid + 1;
    else hi = mid;
  }
  if (lo == 0 || addr + len < addr) return NULL;
  const ucx_rregion *r = &regs[lo - 1];
  return addr >= r->base && addr + len <= r->base + r->len ? r : NULL;
}

int kvf__ucx_regions_unpack(ucp_ep_h ep, const ucx_info_hdr *h, const char *body, size_t *off_io, int same_host,
                            const char *who, ucx_rregion **out, size_t *nout) {
  ucx_rregion *regs = calloc(h->nregions ? h->nregions : 1, sizeof *regs);
  if (!regs) return KVF_ENOMEM;
  size_t off = *off_io, n = 0;
  int rc = 0;
  for (uint32_t i = 0; i < h->nregions; i++) {
    ucx_region_desc d;
    if (h->body_len - off < sizeof d) {
      rc = KVF_EPROTO;
      break;
    }
    memcpy(&d, body + off, sizeof d);
    off += sizeof d;
    if (d.rkey_len > UCX_MAX_RKEY_LEN || h->body_len - off < d.rkey_len || d.len == 0 || d.base + d.len < d.base) {
      rc = KVF_EPROTO;
      break;
    }
    ucx_rregion *r = &regs[n];
    ucs_status_t st = ucp_ep_rkey_unpack(ep, body + off, &r->rkey);
    off += d.rkey_len;
    if (st != UCS_OK) {
      LOG_WARN("ucx", "peer %s: cannot unpack the key of region 0x%llx: %s", who, (unsigned long long)d.base,
               ucs_status_string(st));
      continue; /* accesses there are refused like unregistered memory */
    }
    r->base = d.base;
    r->len = d.len;
    void *ptr = NULL;
    /* Loaded from directly only when the whole region the peer names is
     * mapped here, from System V segments: a length past its segment would
     * have the loads fault, and a file the peer can shrink (UCX's POSIX
     * shared memory) would have them die of SIGBUS once it did (a region
     * that is not is read through process_vm_readv or UCX, which refuse
     * what is not there). */
    if (same_host && ucp_rkey_ptr(r->rkey, d.base, &ptr) == UCS_OK) {
      if (kvf__host_sysv_shared((uint64_t)(uintptr_t)ptr, d.len) == 1) r->ptr = ptr;
      else if (kvf__log_first_time_for_host(who, "ucx-mapped-shrinkable"))
        LOG_INFO("ucx",
                 "peer %s: region 0x%llx+%llu is not mapped here as System V shared memory "
                 "(its owner could shrink it under the loads); read through process_vm_readv "
                 "or UCX instead (further ones from it are not logged)",
                 who, (unsigned long long)d.base, (unsigned long long)d.len);
    }
    n++;
  }
  if (rc) {
    kvf__ucx_rregions_free(regs, n);
    return rc;
  }
  qsort(regs, n, sizeof *regs, cmp_rregion);
  *off_io = off;
  *out = regs;
  *nout = n;
  return 0;
}

/* With p->rw held for writing: replace the peer's regions with the ones in
 * the message, creating the endpoint first when `create_ep`. The target's
 * info also says whether it reads (read mode). */
static int info_apply(ucx_state *u, ucx_peer *p, const ucx_info_hdr *h, const char *body, int create_ep) {
  int rc = 0;
  ucx_rregion *regs = NULL;
  size_t n = 0, off = h->addr_len;
  kvf__ucx_wlock(u);
  if (create_ep && !p->ep) rc = kvf__ucx_ep_create(u, body, p->same_host, ep_error_cb, p, p->id, &p->ep);
  if (!rc && p->ep) rc = kvf__ucx_regions_unpack(p->ep, h, body, &off, p->same_host, p->id, &regs, &n);
  if (!rc && p->ep) rc = fence_snap_apply(p, h, body, off);
  if (rc) {
    kvf__ucx_rregions_free(regs, n);
  } else if (p->ep) {
    kvf__ucx_regs_free_locked(p);
    p->regs = regs;
    p->nregs = n;
    p->gen = h->gen;
    if (create_ep) p->read_mode = (h->flags & UCX_INFO_READ) != 0; /* fixed for the connection */
    p->target_clock_ns = h->clock_ns;
    int mapped = 0;
    for (size_t i = 0; i < n; i++) mapped |= regs[i].ptr != NULL;
    pthread_mutex_lock(&p->mu);
    p->mapped = mapped;
    pthread_mutex_unlock(&p->mu);
  }
  pthread_mutex_unlock(&u->wmu);
  return rc;
}

/* Connect to the peer's listener and ask for the UCX rendezvous. */
static int ctl_open(kvf_engine *e, ucx_peer *p, int64_t deadline_ns, int *fd_out, ucx_info_hdr *h, char **body) {
  int fd = -1;
  int rc = kvf__tcp_connect(p->host, p->port, deadline_ns, &fd);
  if (rc) return rc;
  size_t tl = strlen(e->auth_token);
  /* With device memory registered here the target is asked to take writes
   * (ucx_state.device_regs). */
  const ucx_state *u = e->ucx;
  int can_read = e->ucx_read && !atomic_load(&u->device_regs);
  tcp_hello hello = {TCP_UCX_HELLO_MAGIC, TCP_UCX_PROTO_VERSION, can_read ? TCP_HELLO_CAN_READ : 0, (uint32_t)tl,
                     0};
  tcp_reply rep;
  rc = kvf__fd_send_all(fd, &hello, sizeof hello, deadline_ns);
  if (!rc && tl) rc = kvf__fd_send_all(fd, e->auth_token, tl, deadline_ns);
  if (!rc) rc = kvf__fd_recv_all(fd, &rep, sizeof rep, deadline_ns);
  if (!rc && (rep.magic != TCP_HELLO_MAGIC || rep.status > 0)) rc = KVF_EPROTO;
  if (!rc && rep.status) rc = rep.status == KVF_EACCES || rep.status == KVF_ESTATE ? rep.status : KVF_EPROTO;
  if (!rc) rc = info_read(fd, deadline_ns, h, body);
  if (rc) {
    close(fd);
    return rc;
  }
  *fd_out = fd;
  return 0;
}

/* Which transport reaches this peer, and why. KVF_ECONNREFUSED when `ucx`
 * was asked for and UCX offers no shared-memory or RDMA path. */
static int decide(ucx_state *u, ucx_peer *p, ucx_route *route, char *why, size_t cap) {
  const char *tls = getenv("UCX_TLS");
  int user_tls = tls && *tls;
  int explicit_ucx = u->e->ucx_explicit;
  if (p->same_host && tls_allows(tls, SHM_TLS)) {
    *route = ROUTE_UCX;
    snprintf(why, cap, "same host: UCX shared memory%s%s", user_tls ? ", UCX_TLS=" : "", user_tls ? tls : "");
  } else if (!p->same_host && u->rdma && tls_allows(tls, RDMA_TLS)) {
    *route = ROUTE_UCX;
    snprintf(why, cap, "RDMA device%s%s", user_tls ? ", UCX_TLS=" : "", user_tls ? tls : "");
  } else if (explicit_ucx && user_tls) {
    *route = ROUTE_UCX;
    snprintf(why, cap, "transport ucx with UCX_TLS=%s set by the user", tls);
    /* UCX 1.13 over UCX_TLS=tcp runs software RMA: gets and puts are active
     * messages that the other worker answers (a get's reply from
     * ucp_get_req_handler, a put's completion from ucp_put_handler). When
     * the process that sent them dies, the answer meets the reset socket:
     * UCX's tcp fails the endpoint (running its error callback, ep_error_cb
     * here) and returns the failure, and ucp_request_try_send() aborts on
     * it ("unexpected error: Endpoint timeout"). Nothing here can stop it:
     * the abort follows the callback in the same call, and requests that
     * arrive after an endpoint failed are dropped (its id is released), so
     * it strikes only when an answer is the first to find the peer dead.
     * Read mode exposes this engine (it answers the target's gets), write
     * mode the target (it answers this engine's puts). auto never takes
     * this path (kvferry's TCP instead). */
    LOG_WARN("ucx",
             "peer %s: UCX without shared memory or RDMA (UCX_TLS=%s): UCX's software RMA can abort the process "
             "answering a peer's gets or puts when that peer dies mid-transfer (UCX 1.13; in read mode this "
             "process, in write mode the target); transport auto uses kvferry's TCP here",
             p->id, tls);
  } else if (explicit_ucx) {
    LOG_ERROR("ucx",
              "transport ucx: no UCX shared-memory or RDMA path to %s (%s); kvferry does not "
              "cross TCP silently: use transport tcp or auto, or set UCX_TLS to allow UCX's tcp",
              p->id, p->same_host ? "UCX_TLS excludes shared memory" : "another host, no RDMA device here");
    return KVF_ECONNREFUSED;
  } else {
    *route = ROUTE_TCP;
    snprintf(why, cap, "auto: no UCX shared-memory or RDMA path (%s)",
             p->same_host ? "UCX_TLS excludes shared memory" : "another host, no RDMA device here");
  }
  return 0;
}

static void set_route(ucx_state *u, ucx_peer *p, ucx_route route, const char *why_in) {
  char why[sizeof p->why];
  int rd = route == ROUTE_UCX && p->read_mode;
  snprintf(why, sizeof why, "%s%s", why_in,
           route != ROUTE_UCX ? ""
           : rd               ? "; read mode (the target reads each chunk)"
                              : "; write mode (puts into the target)");
  pthread_mutex_lock(&p->mu);
  int same = p->route == route && !strcmp(p->why, why);
  p->route = route;
  kvf__str_copy(p->why, sizeof p->why, why);
  pthread_mutex_unlock(&p->mu);
  if (same) return;
  atomic_fetch_add(route == ROUTE_UCX ? &u->e->stats.peers_ucx : &u->e->stats.peers_tcp, 1);
  if (rd) atomic_fetch_add(&u->e->stats.peers_read, 1);
  LOG_INFO("ucx", "peer %s: transport %s (%s)", p->id, route == ROUTE_UCX ? "ucx" : "tcp", p->why);
}

/* Read mode, p->rw held: send this engine's info (worker address, regions,
 * clock) to the target, which reads from them. Under p->mu, as every send
 * on the connection. */
static int writer_info_send_locked(ucx_state *u, ucx_peer *p) {
  char *m;
  size_t len;
  pthread_mutex_lock(&p->mu);
  int rc = kvf__ucx_build_info(u, UCX_INFO_WRITER, p->target_clock_ns, &m, &len);
  if (!rc) {
    p->info_sent_gen = ((const ucx_info_hdr *)(const void *)m)->gen;
    rc = p->fd < 0 ? KVF_ECLOSED : kvf__fd_send_all(p->fd, m, len, clock_deadline_ms(UCX_CTL_TIMEOUT_MS));
    free(m);
  }
  pthread_mutex_unlock(&p->mu);
  return rc;
}

int kvf__ucx_writer_info_refresh(ucx_state *u, ucx_peer *p) {
  pthread_mutex_lock(&u->reg_mu);
  uint64_t gen = u->gen;
  pthread_mutex_unlock(&u->reg_mu);
  pthread_mutex_lock(&p->mu);
  int stale = p->info_sent_gen != gen;
  pthread_mutex_unlock(&p->mu);
  return stale ? writer_info_send_locked(u, p) : 0;
}

/* Make sure the peer has a route, and over UCX a live endpoint. Serialised
 * per peer by conn_mu. */
int kvf__ucx_peer_ensure(ucx_state *u, ucx_peer *p, int64_t deadline_ns, ucx_route *route_out) {
  int rc = 0;
  if (kvf__engine_submit_lock(&p->conn_mu, &p->connecting)) return KVF__SUBMIT_WOULD_BLOCK;
  pthread_rwlock_rdlock(&p->rw);
  int live = p->ep && !atomic_load(&p->dead);
  pthread_rwlock_unlock(&p->rw);
  if (p->route == ROUTE_TCP || (p->route == ROUTE_UCX && live)) goto out;
  if (!kvf__engine_may_block()) { /* the session's connector makes the rendezvous */
    rc = KVF__SUBMIT_WOULD_BLOCK;
    goto out;
  }
  pthread_rwlock_wrlock(&p->rw);
  peer_reset_locked(u, p);
  pthread_rwlock_unlock(&p->rw);
  int fd = -1;
  ucx_info_hdr h;
  char *body = NULL;
  atomic_store(&p->connecting, 1);
  rc = ctl_open(u->e, p, deadline_ns, &fd, &h, &body);
  atomic_store(&p->connecting, 0);
  if (rc == KVF_ESTATE || rc == KVF_EPROTO) { /* the peer has no UCX transport (or predates it) */
    if (u->e->ucx_explicit) {
      LOG_ERROR("ucx", "transport ucx: peer %s does not offer UCX (%s)", p->id,
                rc == KVF_ESTATE ? "its engine runs tcp" : "no rendezvous answer");
      rc = KVF_ECONNREFUSED;
      goto out;
    }
    set_route(u, p, ROUTE_TCP, "auto: the peer's engine does not offer UCX");
    rc = 0;
    goto out;
  }
  if (rc) {
    LOG_WARN("ucx", "rendezvous with %s failed: %s", p->id, kvf_strerror(rc));
    goto out;
  }
  p->same_host = !strcmp(h.host_id, u->host_id);
  ucx_route route = ROUTE_UNKNOWN;
  char why[sizeof p->why];
  rc = decide(u, p, &route, why, sizeof why);
  if (!rc && route == ROUTE_UCX) {
    pthread_rwlock_wrlock(&p->rw);
    rc = info_apply(u, p, &h, body, 1);
    if (!rc) {
      p->fd = fd;
      fd = -1;
      p->conn_id++;
      p->info_sent_gen = 0;
      atomic_store(&p->dead, 0);
      /* Read mode: the target gets this engine's memory before any notice. */
      if (p->read_mode) rc = writer_info_send_locked(u, p);
      struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP, .data.ptr = p};
      if (!rc) epoll_ctl(u->epfd, EPOLL_CTL_ADD, p->fd, &ev);
    }
    pthread_rwlock_unlock(&p->rw);
  }
  if (!rc) set_route(u, p, route, why);
  if (fd >= 0) close(fd);
  free(body);
out:
  *route_out = p->route;
  pthread_mutex_unlock(&p->conn_mu);
  return rc;
}

/* Progress thread: the target closed a fence (ucx_fence_msg). From here no
 * block tagged with it starts (do_chunk checks under p->rw, which this takes
 * for writing); the endpoint is flushed, so what was put before is in
 * place, and then the target hears it. */
static int fence_msg_apply(ucx_state *u, ucx_peer *p, int fd, const ucx_fence_msg *f) {
  int rc = 0, ask = 0, inflight = 0;
  atomic_store(&p->fence_wait, 1); /* tagged writers holding rw let go (fence_gate) */
  pthread_rwlock_wrlock(&p->rw);
  atomic_store(&p->fence_wait, 0);
  if (p->fd != fd) goto out_unlock;
  if (f->epoch < p->fence_next) kvf__map_del(&p->fence_open, f->epoch, NULL);
  else rc = kvf__map_put(&p->fence_closed, f->epoch, (void *)1, NULL);
  if (!rc && kvf__map_size(&p->fence_closed) > UCX_MAX_CLOSED_FENCES && !p->fence_asked)
    ask = p->fence_asked = 1; /* a new snapshot makes the list redundant */
  /* With no block being posted (the write lock): puts not complete for the
   * pair are those of its flushes in flight (which now end KVF_ESTATE) and
   * those of writers paused in fence_gate. None: nothing to wait for,
   * whatever else is in flight. */
  kvf__ucx_wlock(u);
  inflight = kvf__ucx_ops_fence_locked(u, p, f->epoch) + atomic_load(&p->gated);
  pthread_mutex_unlock(&u->wmu);
out_unlock:
  pthread_rwlock_unlock(&p->rw);
  if (rc) return rc;
  /* Under wmu alone: p->ep changes only under it. Puts already posted
   * complete before the flush does; progress here runs their callbacks. */
  int64_t until = clock_deadline_ms(UCX_CTL_TIMEOUT_MS);
  kvf__ucx_wlock(u);
  if (inflight && p->ep) rc = kvf__ucx_flush_wait_locked(u, p, until);
  pthread_mutex_unlock(&u->wmu);
  if (rc) return rc; /* not confirmed: the target cuts the connection at its deadline */
  ucx_req ack = {UCX_FENCE_ACK_MAGIC, 0, f->seq}, req = {UCX_REQ_MAGIC, 0, 0};
  pthread_rwlock_rdlock(&p->rw);
  pthread_mutex_lock(&p->mu);
  if (p->fd == fd) {
    rc = kvf__fd_send_all(fd, &ack, sizeof ack, until);
    if (!rc && ask) rc = kvf__fd_send_all(fd, &req, sizeof req, until);
  }
  pthread_mutex_unlock(&p->mu);
  pthread_rwlock_unlock(&p->rw);
  return rc;
}

/* With p->rw held (the progress thread): whether bytes of the target still
 * wait in p->rb, that is, another message to take at once; the buffer goes
 * when none do (an idle peer holds none). */
static int rb_more_locked(ucx_peer *p) {
  int more = kvf__ucx_rbuf_waiting(&p->rb);
  if (!more) kvf__ucx_rbuf_release_empty(&p->rb);
  atomic_store(&p->rb_held, more);
  return more;
}

/* Progress thread, p->rw held: is the target's next message whole in
 * p->rb? Takes what has arrived without waiting: 1 (whole: reading it does
 * not block), 0 (nothing, or part of one: wait for the socket again), or
 * the connection's error. The buffer grows to the message's size (an info
 * is at most UCX_MAX_INFO_BODY past its header). */
static int rb_whole_message(ucx_state *u, ucx_peer *p, int fd) {
  ucx_rbuf *r = &p->rb;
  for (;;) {
    size_t have = r->len - r->off, need = sizeof(uint32_t);
    if (have >= need) {
      uint32_t magic;
      memcpy(&magic, r->b + r->off, sizeof magic);
      if (magic == UCX_FENCE_MAGIC) {
        need = sizeof(ucx_fence_msg);
      } else if (magic == UCX_INFO_MAGIC) {
        need = sizeof(ucx_info_hdr);
        if (have >= need) {
          ucx_info_hdr h;
          memcpy(&h, r->b + r->off, sizeof h);
          if (h.body_len > UCX_MAX_INFO_BODY) return KVF_EPROTO;
          need += h.body_len;
        }
      } else if (magic == UCX_READ_DONE_MAGIC || magic == UCX_CLOCK_MAGIC || magic == UCX_TRAILER_ACK_MAGIC) {
        need = sizeof(ucx_req);
      } else {
        return 1; /* its reader refuses it */
      }
    }
    if (have >= need) {
      partial_clear(u, p);
      return 1;
    }
    if (r->cap - r->off < need) { /* room for the whole message from the buffer's start */
      if (r->off) memmove(r->b, r->b + r->off, have);
      r->off = 0, r->len = have;
      if (r->cap < need) {
        unsigned char *b = realloc(r->b, need);
        if (!b) return KVF_ENOMEM;
        r->b = b, r->cap = need;
      }
    }
    ssize_t n = recv(fd, r->b + r->len, r->cap - r->len, MSG_DONTWAIT);
    if (n > 0) {
      r->len += (size_t)n;
      continue;
    }
    if (n == 0) return KVF_ECLOSED;
    if (errno == EINTR) continue;
    if (errno != EAGAIN && errno != EWOULDBLOCK) return errno == ECONNRESET ? KVF_ECLOSED : KVF_EIO;
    if (have && !p->partial_ns) {
      p->partial_ns = clock_now_ns();
      atomic_fetch_add(&u->npartial, 1);
    }
    atomic_store(&p->rb_held, have > 0);
    return 0;
  }
}

/* Mark dead, with err, every peer that doom(u, p, now) names (it runs with
 * peers_mu and p->rw held for reading). How many. */
static int peers_doom(ucx_state *u, int (*doom)(ucx_state *, ucx_peer *, int64_t), int64_t now, int err) {
  int n = 0;
  pthread_mutex_lock(&u->peers_mu);
  map_iter it;
  kvf__map_iter_init(&it);
  void *v;
  while (kvf__smap_next(&u->peers, &it, NULL, &v)) {
    ucx_peer *p = v;
    pthread_rwlock_rdlock(&p->rw);
    int doomed = doom(u, p, now);
    pthread_rwlock_unlock(&p->rw);
    if (doomed) kvf__ucx_peer_mark_dead(u, p, err), n++;
  }
  pthread_mutex_unlock(&u->peers_mu);
  return n;
}

/* A message of p stayed partial past its deadline: its socket leaves the
 * epoll set now (progress thread). */
static int partial_expired(ucx_state *u, ucx_peer *p, int64_t now) {
  if (!p->partial_ns || now - p->partial_ns <= (int64_t)UCX_CTL_TIMEOUT_MS * 1000000) return 0;
  if (kvf__log_first_time_for_host(p->id, "ucx-partial"))
    LOG_WARN("ucx", "peer %s sent part of a message and stopped for %d ms; its connection is dropped", p->id,
             UCX_CTL_TIMEOUT_MS);
  if (p->fd >= 0) epoll_ctl(u->epfd, EPOLL_CTL_DEL, p->fd, NULL);
  partial_clear(u, p);
  return 1;
}

void kvf__ucx_partials_check(ucx_state *u) {
  if (atomic_load(&u->npartial)) peers_doom(u, partial_expired, clock_now_ns(), KVF_ETIMEDOUT);
}

static int reads_here(ucx_state *u, ucx_peer *p, int64_t now) {
  (void)u, (void)now;
  return p->ep && p->read_mode;
}

int kvf__ucx_peers_drop_reading(ucx_state *u) { return peers_doom(u, reads_here, 0, KVF_ECLOSED); }

/* One message of the target: 1 when more wait in the read-ahead. */
static int peer_event_one(ucx_state *u, ucx_peer *p, uint32_t events) {
  ucx_info_hdr h;
  ucx_fence_msg f;
  char *body = NULL;
  int rc = KVF_ECLOSED, fence = 0;
  pthread_rwlock_rdlock(&p->rw);
  int fd = p->fd;
  if (fd >= 0 && (events & EPOLLIN)) {
    int64_t until = clock_deadline_ms(UCX_CTL_TIMEOUT_MS);
    /* A whole message in p->rb (what arrived is taken without waiting), or
     * nothing to do now: the reads below never wait on the target. */
    int got = kvf__ucx_rbuf_hold(&p->rb, UCX_PEER_RBUF) ? KVF_ENOMEM : rb_whole_message(u, p, fd);
    rc = got > 0 ? kvf__ucx_rbuf_recv(fd, &p->rb, &h.magic, sizeof h.magic, until) : got == 0 ? 1 : got;
    /* The target closed the connection (or its process is gone): it reads
     * nothing more for this connection's notices (ucx_read.c). Only then:
     * a target this side stops reading may still read them. */
    if (got == KVF_ECLOSED) kvf__ucx_reads_closed(u, p, p->conn_id);
    if (!rc && (h.magic == UCX_READ_DONE_MAGIC || h.magic == UCX_CLOCK_MAGIC)) {
      ucx_req rest;
      rc = kvf__ucx_rbuf_recv(fd, &p->rb, (char *)&rest + sizeof rest.magic, sizeof rest - sizeof rest.magic,
                              until);
      if (!rc && h.magic == UCX_READ_DONE_MAGIC) {
        uint64_t conn = p->conn_id;
        int more = rb_more_locked(p);
        pthread_rwlock_unlock(&p->rw);
        kvf__ucx_read_done(u, p, conn, rest.gen, (int)(int32_t)rest.reserved);
        return more;
      }
      if (!rc) { /* a clock question: answered at once, it bounds the clocks' difference */
        ucx_clock_ans a = {UCX_CLOCK_ANS_MAGIC, 0, (int64_t)rest.gen, clock_now_ns()};
        pthread_mutex_lock(&p->mu);
        rc = kvf__fd_send_all(fd, &a, sizeof a, until);
        pthread_mutex_unlock(&p->mu);
        if (!rc) {
          int more = rb_more_locked(p);
          pthread_rwlock_unlock(&p->rw);
          return more;
        }
      }
    } else if (!rc && h.magic == UCX_TRAILER_ACK_MAGIC) {
      ucx_req rest;
      rc = kvf__ucx_rbuf_recv(fd, &p->rb, (char *)&rest + sizeof rest.magic, sizeof rest - sizeof rest.magic,
                              until);
      if (!rc) {
        int more = rb_more_locked(p);
        pthread_rwlock_unlock(&p->rw);
        kvf__ucx_trailer_acked(u, p);
        pthread_mutex_lock(&p->mu);
        pthread_cond_broadcast(&p->cv); /* writers waiting for it to be read (fence_gate) */
        pthread_mutex_unlock(&p->mu);
        return more;
      }
    } else if (!rc && h.magic == UCX_FENCE_MAGIC) {
      f.magic = h.magic;
      rc = kvf__ucx_rbuf_recv(fd, &p->rb, (char *)&f + sizeof f.magic, sizeof f - sizeof f.magic, until);
      fence = 1;
    } else if (!rc && h.magic == UCX_INFO_MAGIC) {
      rc = kvf__ucx_info_read_rest(fd, &p->rb, until, &h, &body);
    } else if (!rc) {
      rc = KVF_EPROTO;
    }
  }
  if (fd >= 0 && rc < 0) {
    LOG_INFO("ucx", "rendezvous connection to %s ended: %s", p->id, kvf_strerror(rc));
    epoll_ctl(u->epfd, EPOLL_CTL_DEL, fd, NULL);
    kvf__ucx_peer_mark_dead(u, p, KVF_ECLOSED);
  }
  int more = !rc && rb_more_locked(p);
  pthread_rwlock_unlock(&p->rw);
  if (!rc && fence) {
    rc = fence_msg_apply(u, p, fd, &f);
    if (rc) kvf__ucx_peer_mark_dead(u, p, rc);
    pthread_mutex_lock(&p->mu);
    pthread_cond_broadcast(&p->cv); /* writers waiting for it to be read (do_chunk) */
    pthread_mutex_unlock(&p->mu);
    return !rc && more;
  }
  if (rc || !body) return 0;
  pthread_rwlock_wrlock(&p->rw);
  if (p->fd == fd) {
    /* Applied under the write lock: no write into the old regions is under
     * way or can start. Tell the target (its unregister waits for this).
     * Without a live endpoint (the peer failed; a reconnect brings a new
     * connection and a new info) nothing can be written: acknowledged as is,
     * or the target's unregister would wait out its cut-off. */
    if (p->ep && !atomic_load(&p->dead)) rc = info_apply(u, p, &h, body, 0);
    ucx_req ack = {UCX_ACK_MAGIC, 0, h.gen};
    pthread_mutex_lock(&p->mu);
    if (!rc) rc = kvf__fd_send_all(fd, &ack, sizeof ack, clock_deadline_ms(UCX_CTL_TIMEOUT_MS));
    pthread_mutex_unlock(&p->mu);
  }
  pthread_rwlock_unlock(&p->rw);
  free(body);
  if (rc) kvf__ucx_peer_mark_dead(u, p, rc);
  pthread_mutex_lock(&p->mu);
  p->infos++;
  pthread_cond_broadcast(&p->cv);
  pthread_mutex_unlock(&p->mu);
  return !rc && more;
}

/* Progress thread: the rendezvous socket of `p` has news. Every message that
 * arrived is taken before epoll hears of the socket again (the read-ahead
 * holds them; the socket may be empty). */
void kvf__ucx_peer_event(ucx_state *u, ucx_peer *p, uint32_t events) {
  while (peer_event_one(u, p, events) > 0) events = EPOLLIN;
}

/* Ask the peer for its current regions and wait until they are applied. */
void kvf__ucx_peer_refresh(ucx_state *u, ucx_peer *p, int64_t deadline_ns) {
  int64_t until = clock_deadline_ms(UCX_CTL_TIMEOUT_MS);
  if (until > deadline_ns) until = deadline_ns;
  pthread_mutex_lock(&p->mu);
  uint64_t seen = p->infos;
  pthread_mutex_unlock(&p->mu);
  ucx_req req = {UCX_REQ_MAGIC, 0, 0};
  pthread_rwlock_rdlock(&p->rw);
  pthread_mutex_lock(&p->mu);
  int rc = p->fd >= 0 ? kvf__fd_send_all(p->fd, &req, sizeof req, until) : KVF_ECLOSED;
  pthread_mutex_unlock(&p->mu);
  pthread_rwlock_unlock(&p->rw);
  if (rc) return;
  pthread_mutex_lock(&p->mu);
  /* In slices: an engine being destroyed (its connectors told to stop, its
   * progress thread, which would apply the answer, perhaps gone) does not
   * wait out the rest. */
  while (p->infos == seen && !atomic_load(&p->dead) && !atomic_load(&u->stopping) &&
         !atomic_load(&u->e->connect_stop) && clock_now_ns() < until) {
    int64_t slice = clock_deadline_ms(100);
    struct timespec ts = clock_ts_from_ns(slice < until ? slice : until);
    pthread_cond_timedwait(&p->cv, &p->mu, &ts);
  }
  pthread_mutex_unlock(&p->mu);
}

/* What the route text adds for this engine's device memory (region.device
 * 1), which UCX moves through its CUDA transports, never through the
 * shared memory or CMA the route names, and kvferry's TCP refuses. Read
 * before the peer locks: the region table's lock does not nest in them. */
static const char *device_note(kvf_engine *e, ucx_route route) {
  int device = 0;
  pthread_rwlock_rdlock(&e->regions.lock);
  for (size_t i = 0; i < e->regions.n && !device; i++) device = e->regions.items[i]->device == 1;
  pthread_rwlock_unlock(&e->regions.lock);
  if (!device) return "";
  return route == ROUTE_UCX ? "; device memory through UCX's CUDA transports (cuda_ipc, cuda_copy)"
                            : "; device memory cannot move on this route";
}

int kvf__ucx_routes(kvf_engine *e, char *out, size_t cap) {
  ucx_state *u = e->ucx;
  size_t n = 0;
  int lines = 0;
  const char *dev_ucx = device_note(e, ROUTE_UCX), *dev_tcp = device_note(e, ROUTE_TCP);
  pthread_mutex_lock(&u->peers_mu);
  map_iter it;
  kvf__map_iter_init(&it);
  void *v;
  while (kvf__smap_next(&u->peers, &it, NULL, &v)) {
    ucx_peer *p = v;
    char line[sizeof p->id + sizeof p->why + 160];
    pthread_mutex_lock(&p->mu);
    int w = p->route == ROUTE_UNKNOWN
                ? 0
                : snprintf(line, sizeof line, "%s %s %s%s%s\n", p->id, p->route == ROUTE_UCX ? "ucx" : "tcp",
                           p->why, p->mapped ? "; its pool is mapped here (plain stores)" : "",
                           p->route == ROUTE_UCX ? dev_ucx : dev_tcp);
    pthread_mutex_unlock(&p->mu);
    if (w <= 0 || (size_t)w >= sizeof line || (size_t)w >= cap - n) continue;
    memcpy(out + n, line, (size_t)w + 1);
    n += (size_t)w;
    lines++;
  }
  pthread_mutex_unlock(&u->peers_mu);
  return lines;
}

int kvf__ucx_describe(kvf_engine *e, const char *session, char *out, size_t cap) {
  ucx_state *u = e->ucx;
  const char *dev_ucx = device_note(e, ROUTE_UCX), *dev_tcp = device_note(e, ROUTE_TCP);
  pthread_mutex_lock(&u->peers_mu);
  ucx_peer *p = kvf__smap_get(&u->peers, session);
  int rc = KVF_ENOTFOUND;
  if (p) {
    pthread_mutex_lock(&p->mu);
    if (p->route != ROUTE_UNKNOWN) {
      snprintf(out, cap, "%s: %s%s%s", p->route == ROUTE_UCX ? "ucx" : "tcp", p->why,
               p->mapped ? "; its pool is mapped here (plain stores)" : "", /* why names the mode */
               p->route == ROUTE_UCX ? dev_ucx : dev_tcp);
      rc = 0;
    }
    pthread_mutex_unlock(&p->mu);
  }
  pthread_mutex_unlock(&u->peers_mu);
  return rc;
}

int kvf__ucx_path(kvf_engine *e, const char *session, const char **transport, const char **mode) {
  ucx_state *u = e->ucx;
  pthread_mutex_lock(&u->peers_mu);
  ucx_peer *p = kvf__smap_get(&u->peers, session);
  int rc = KVF_ENOTFOUND;
  if (p) {
    pthread_mutex_lock(&p->mu);
    if (p->route != ROUTE_UNKNOWN) {
      int ucx = p->route == ROUTE_UCX;
      *transport = ucx ? "ucx" : "tcp";
      *mode = !ucx ? "tcp" : p->read_mode ? "read" : "write";
      rc = 0;
    }
    pthread_mutex_unlock(&p->mu);
  }
  pthread_mutex_unlock(&u->peers_mu);
  return rc;
}

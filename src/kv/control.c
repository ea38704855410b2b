/* The manager's control plane, shared by both roles: the PULL listener
 * thread (receives M1/M2/M3 and fence messages and dispatches them to the
 * role; it speaks ZMTP's receiving side itself over a ZMQ_STREAM socket, so
 * that every message is bounded as a whole: wire/zmtp.h), the PUSH socket
 * cache per peer endpoint, the rejection log, and the trailer packing.
 *
 * Control-plane authentication (issue 13 defect 5, docs/WIRE-EXTENSIONS.md).
 * With a control token set, every message sent carries one more frame,
 * MANAGER_MAC_LEN bytes: the sender's wall clock in milliseconds (8 bytes,
 * big-endian) and HMAC-SHA256(token, label || clock || for each frame its
 * length (4 bytes, big-endian) and bytes). The listener drops, counts and
 * logs once any message whose last frame is not such a MAC, whose MAC is
 * wrong, or whose clock is more than MANAGER_MAC_WINDOW_S away from ours,
 * before any codec sees it. Without a token nothing is added or checked, so
 * tokenspeed peers keep working. */
#include "kv/manager.h"

#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <malloc.h>
#include <poll.h>
#include <sodium.h>
#include <time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "base/addr.h"
#include "base/config.h"
#include "base/clock.h"
#include "base/env.h"
#include "base/hash.h"
#include "base/log.h"
#include "base/parse.h"
#include "base/thread.h"
#include "base/wake.h"
#include "engine/async.h"
#include "kv/integrity.h"
#include "wire/zmtp.h"

#define MANAGER_MAX_PUSHES 4096
#define MANAGER_MAC_LABEL "kvferry-control-mac-v1"
#define MANAGER_MAC_WINDOW_S 300 /* clock skew and delivery delay accepted, seconds */
/* The listener's longest wait with nothing due: the stop and work queued by
 * other threads wake it (kvf__control_wake), so it needs no poll tick; it
 * wakes this often only for the idle sweep (kvf__control_close_idle_pushes).
 * Without a wake descriptor it checks `stopping` every MANAGER_WAIT_NOWAKE_MS. */
#define MANAGER_WAIT_MS 1000
#define MANAGER_WAIT_NOWAKE_MS 100
#define MANAGER_TICK_MSGS 64 /* reads and messages between two role ticks when the listener is never idle */
_Static_assert(MANAGER_MAC_LEN == 8 + crypto_auth_hmacsha256_BYTES, "MAC frame size");

#define MANAGER_SWEEP_NS 1000000000ll /* how often the listener looks for idle PUSH sockets */

/* One cached PUSH socket. Senders find it under push_lock and count
 * themselves in `users`, then send under its own lock with push_lock let
 * go: a sender waiting on a peer that does not read (up to the socket's
 * send timeout) holds up only the senders to that peer. Taken out of the
 * map (forgotten, idle), it is freed by whoever is last: the remover when
 * no sender holds it, else the last sender (`gone`). */
typedef struct manager_push {
  pthread_mutex_t lock;
  void *sock;
  _Atomic int64_t used_ns; /* the last send's start */
  int users;               /* senders that found it (push_lock) */
  int gone;                /* out of the map (push_lock) */
} manager_push;

static void push_free(manager_push *p) {
  zmq_close(p->sock);
  pthread_mutex_destroy(&p->lock);
  free(p);
}

/* A sender is done with p; frees it when it was the last of a removed one. */
static void push_release(kvf_manager *m, manager_push *p) {
  pthread_mutex_lock(&m->push_lock);
  int last = --p->users == 0 && p->gone;
  pthread_mutex_unlock(&m->push_lock);
  if (last) push_free(p);
}

int kvf__control_socket_limit(void) { return MANAGER_MAX_PUSHES + 1; }

static void reject_log(kvf_manager *m, const char *peer, const char *kind, const char *reason) {
  char key[128];
  snprintf(key, sizeof key, "%s/%s/%p", peer ? peer : "?", kind, (void *)m);
  if (kvf__log_first_time(kvf__hash_str(key, 11)))
    LOG_WARN("kv", "dropped %s from %s: %s (further ones from this peer are counted, not logged)", kind,
             peer ? peer : "unknown peer", reason);
}

void kvf__manager_reject(kvf_manager *m, const char *peer, const char *kind, const char *reason) {
  atomic_fetch_add(&m->stats.messages_malformed, 1);
  reject_log(m, peer, kind, reason);
}

void kvf__manager_reject_forged(kvf_manager *m, const char *peer, const char *kind, const char *reason) {
  atomic_fetch_add(&m->stats.messages_forged, 1);
  reject_log(m, peer, kind, reason);
}

/* An address literal as 16 bytes, IPv4 as IPv4-mapped IPv6; 0 or -1. */
static int ip_bytes(const char *s, unsigned char out[16]) {
  struct in_addr a4;
  if (inet_pton(AF_INET, s, &a4) == 1) {
    memset(out, 0, 10);
    out[10] = out[11] = 0xff;
    memcpy(out + 12, &a4, 4);
    return 0;
  }
  return inet_pton(AF_INET6, s, out) == 1 ? 0 : -1;
}

int kvf__manager_peer_is(const kvf_manager *m, const char *peer, const char *ip) {
  static const unsigned char any6[16], any4[16] = {[10] = 0xff, [11] = 0xff};
  unsigned char a[16], b[16];
  char host[KVF_ADDR_HOST_LEN];
  if (!m->check_peer_ip || !ip) return 1;
  /* The usual case, without parsing (four inet_pton per M2 before): the
   * peer's address literally is the one named, or its host part, IPv4. */
  size_t pl = peer ? strlen(peer) : 0;
  if (pl && !strncmp(ip, peer, pl) && (!ip[pl] || (ip[pl] == ':' && !memchr(peer, ':', pl)))) return 1;
  /* "ip:port" names ip (PROTOCOL §3: where M3 goes); a bare IP literal or
   * host name is itself */
  if (!kvf__addr_host(ip, host, sizeof host)) ip = host;
  /* A host name, or the unspecified address: not checkable here. */
  if (ip_bytes(ip, b) || !memcmp(b, any6, 16) || !memcmp(b, any4, 16)) return 1;
  return peer && !ip_bytes(peer, a) && !memcmp(a, b, sizeof a);
}

/* ------------------------------------------------------------ MAC frame */

static void mac_compute(const kvf_manager *m, const unsigned char clock[8], const wire_frame *f, size_t n,
                        unsigned char out[crypto_auth_hmacsha256_BYTES]) {
  crypto_auth_hmacsha256_state st;
  crypto_auth_hmacsha256_init(&st, m->ctl_key, m->ctl_keylen);
  crypto_auth_hmacsha256_update(&st, (const unsigned char *)MANAGER_MAC_LABEL, sizeof MANAGER_MAC_LABEL);
  crypto_auth_hmacsha256_update(&st, clock, 8);
  for (size_t i = 0; i < n; i++) {
    unsigned char len[4] = {(unsigned char)(f[i].len >> 24), (unsigned char)(f[i].len >> 16),
                            (unsigned char)(f[i].len >> 8), (unsigned char)f[i].len};
    crypto_auth_hmacsha256_update(&st, len, 4);
    if (f[i].len) crypto_auth_hmacsha256_update(&st, f[i].data, f[i].len);
  }
  crypto_auth_hmacsha256_final(&st, out);
  sodium_memzero(&st, sizeof st);
}

void kvf__control_mac(const kvf_manager *m, const wire_frame *f, size_t n, unsigned char out[MANAGER_MAC_LEN]) {
  uint64_t ms = (uint64_t)(clock_wall_s() * 1000);
  for (int i = 0; i < 8; i++) out[i] = (unsigned char)(ms >> (56 - 8 * i));
  mac_compute(m, out, f, n, out + 8);
}

/* 0 when f[n-1] is a good MAC of f[0..n-1), else a reason. */
static const char *mac_check(const kvf_manager *m, const wire_frame *f, size_t n) {
  if (n < 2 || f[n - 1].len != MANAGER_MAC_LEN)
    return "no MAC frame (is KVFERRY_CONTROL_TOKEN the same on both sides?)";
  const unsigned char *mac = f[n - 1].data;
  uint64_t ms = 0;
  for (int i = 0; i < 8; i++) ms = ms << 8 | mac[i];
  unsigned char want[crypto_auth_hmacsha256_BYTES];
  mac_compute(m, mac, f, n - 1, want);
  if (!kvf__ct_equal(want, sizeof want, mac + 8, crypto_auth_hmacsha256_BYTES)) return "wrong MAC";
  double skew = (double)ms / 1000 - clock_wall_s();
  if (skew > MANAGER_MAC_WINDOW_S || skew < -MANAGER_MAC_WINDOW_S) return "MAC clock outside the accepted window";
  return NULL;
}

void kvf__manager_dispatch(kvf_manager *m, const wire_frame *frames, size_t n, size_t extra, const char *peer) {
  if (m->ctl_keylen) {
    const char *bad = extra ? "more frames than any message and its MAC" : mac_check(m, frames, n);
    if (bad) {
      kvf__manager_reject_forged(m, peer, "message", bad);
      return;
    }
    n--; /* the codecs never see the MAC */
  } else if (n > WIRE_MAX_FRAMES) {
    n = WIRE_MAX_FRAMES; /* frames past the last one any message defines are ignored, as the spec says */
  }
  m->role->on_message(m, frames, n, peer);
}

/* Trailer layout: a 2-byte frame count, then per frame a 4-byte length and
 * its bytes (little-endian, as the engine's framing). */
size_t kvf__trailer_pack(const kvf_manager *m, const wire_msg *msg, unsigned char *out, size_t cap) {
  unsigned char mac[MANAGER_MAC_LEN];
  size_t nf = msg->nframes + (m->ctl_keylen ? 1 : 0), len = 2;
  if (m->ctl_keylen) kvf__control_mac(m, msg->frames, msg->nframes, mac);
  if (cap < 2) return 0;
  out[0] = (unsigned char)nf, out[1] = (unsigned char)(nf >> 8);
  for (size_t i = 0; i < nf; i++) {
    const unsigned char *d = i < msg->nframes ? msg->frames[i].data : mac;
    uint32_t fl = (uint32_t)(i < msg->nframes ? msg->frames[i].len : MANAGER_MAC_LEN);
    if (cap - len < 4 || cap - len - 4 < fl) return 0;
    memcpy(out + len, &fl, 4);
    if (fl) memcpy(out + len + 4, d, fl);
    len += 4 + fl;
  }
  return len;
}

int kvf__trailer_unpack(const unsigned char *p, size_t len, wire_frame *f, size_t cap, size_t *n, size_t *extra) {
  if (len < 2) return KVF_EPROTO;
  size_t nf = (size_t)p[0] | (size_t)p[1] << 8, off = 2;
  *n = *extra = 0;
  for (size_t i = 0; i < nf; i++) {
    uint32_t fl;
    if (len - off < 4) return KVF_EPROTO;
    memcpy(&fl, p + off, 4);
    if (len - off - 4 < fl) return KVF_EPROTO;
    if (*n < cap) f[(*n)++] = (wire_frame){p + off + 4, fl};
    else (*extra)++;
    off += 4 + fl;
  }
  return off == len && *n ? 0 : KVF_EPROTO;
}

/* ------------------------------------------------------------ PUSH cache */

static int push_key(char *key, size_t cap, const char *host, uint16_t port) {
  return kvf__addr_format(key, cap, host, port);
}

/* How long kvf__manager_push_post waits for another sender to the same
 * peer to let the socket go before it drops its message. */
#define MANAGER_POST_LOCK_MS 5

static int push_lock_within(pthread_mutex_t *mu, int ms) {
  struct timespec until;
  clock_gettime(CLOCK_REALTIME, &until); /* pthread_mutex_timedlock's clock */
  until.tv_nsec += (long)ms * 1000000L;
  until.tv_sec += until.tv_nsec / 1000000000L;
  until.tv_nsec %= 1000000000L;
  return pthread_mutex_timedlock(mu, &until);
}

static int push_send(kvf_manager *m, const char *host, uint16_t port, const wire_msg *msg, int post) {
  char key[KVF_ADDR_LEN];
  if (!host || !*host || !port || push_key(key, sizeof key, host, port)) return KVF_EINVAL;
  if (!post) kvf__engine_hold_flush(); /* a send may wait (SNDTIMEO): what this thread holds goes first */
  pthread_mutex_lock(&m->push_lock);
  manager_push *p = kvf__smap_get(&m->pushes, key);
  int rc = 0;
  if (!p) {
    if (smap_size(&m->pushes) >= MANAGER_MAX_PUSHES || !(p = calloc(1, sizeof *p))) {
      int full = smap_size(&m->pushes) >= MANAGER_MAX_PUSHES;
      pthread_mutex_unlock(&m->push_lock);
      if (kvf__log_first_time(kvf__hash_str("control-pushes-full", (uint64_t)(uintptr_t)m)))
        LOG_WARN("kv", "message to %s dropped: %s (further ones are not logged)", key,
                 full ? "PUSH sockets are open to as many endpoints as allowed (MANAGER_MAX_PUSHES)"
                      : "out of memory");
      return KVF_ENOMEM;
    }
    pthread_mutex_init(&p->lock, NULL);
    p->sock = zmq_socket(m->zctx, ZMQ_PUSH);
    int linger = 200, hwm = 1000, sndtimeo = 1000, ipv6 = kvf__addr_is_ipv6(host);
    char ep[sizeof "tcp://" + KVF_ADDR_LEN];
    snprintf(ep, sizeof ep, "tcp://%s", key);
    if (!p->sock || zmq_setsockopt(p->sock, ZMQ_LINGER, &linger, sizeof linger) ||
        zmq_setsockopt(p->sock, ZMQ_SNDHWM, &hwm, sizeof hwm) ||
        zmq_setsockopt(p->sock, ZMQ_SNDTIMEO, &sndtimeo, sizeof sndtimeo) ||
        zmq_setsockopt(p->sock, ZMQ_IPV6, &ipv6, sizeof ipv6) || zmq_connect(p->sock, ep) ||
        kvf__smap_put(&m->pushes, key, p, NULL)) {
      LOG_WARN("kv", "cannot open a PUSH socket to %s: %s", ep, zmq_strerror(zmq_errno()));
      if (p->sock) zmq_close(p->sock);
      pthread_mutex_destroy(&p->lock);
      free(p);
      pthread_mutex_unlock(&m->push_lock);
      return KVF_EIO;
    }
  }
  p->users++;
  atomic_store(&p->used_ns, clock_now_ns());
  pthread_mutex_unlock(&m->push_lock);
  unsigned char mac[MANAGER_MAC_LEN];
  size_t nsend = msg->nframes + (m->ctl_keylen ? 1 : 0);
  if (m->ctl_keylen) kvf__control_mac(m, msg->frames, msg->nframes, mac);
  /* Posted: another sender may hold the socket for its whole send timeout. */
  if (post ? push_lock_within(&p->lock, MANAGER_POST_LOCK_MS) : pthread_mutex_lock(&p->lock)) {
    rc = KVF_ETIMEDOUT;
  } else {
    /* Posted: the first frame goes only if the peer's queue has room; the
     * rest of a message whose first frame went in always follows it. */
    for (size_t i = 0; i < nsend && !rc; i++) {
      int flags = (i + 1 < nsend ? ZMQ_SNDMORE : 0) | (post && i == 0 ? ZMQ_DONTWAIT : 0);
      const void *data = i < msg->nframes ? msg->frames[i].data : mac;
      size_t len = i < msg->nframes ? msg->frames[i].len : sizeof mac;
      if (zmq_send(p->sock, data, len, flags) < 0) rc = zmq_errno() == EAGAIN ? KVF_ETIMEDOUT : KVF_EIO;
    }
    pthread_mutex_unlock(&p->lock);
  }
  push_release(m, p);
  if (rc && !post) LOG_WARN("kv", "sending to %s failed: %s", key, kvf_strerror(rc));
  if (rc && post && kvf__log_first_time_for_host(key, "control-post"))
    LOG_WARN("kv",
             "message to %s dropped: %s (its queue is full or another send to it waits; further ones are not "
             "logged)",
             key, kvf_strerror(rc));
  return rc;
}

int kvf__manager_push_send(kvf_manager *m, const char *host, uint16_t port, const wire_msg *msg) {
  return push_send(m, host, port, msg, 0);
}

int kvf__manager_push_post(kvf_manager *m, const char *host, uint16_t port, const wire_msg *msg) {
  return push_send(m, host, port, msg, 1);
}

void kvf__manager_push_forget(kvf_manager *m, const char *host, uint16_t port) {
  char key[KVF_ADDR_LEN];
  if (push_key(key, sizeof key, host, port)) return;
  void *v = NULL;
  pthread_mutex_lock(&m->push_lock);
  manager_push *p = kvf__smap_del(&m->pushes, key, &v) ? v : NULL;
  int now = p && p->users == 0;
  if (p) p->gone = 1; /* a sender still holding it frees it (push_release) */
  pthread_mutex_unlock(&m->push_lock);
  if (now) push_free(p);
}

/* Idle PUSH sockets. A connected PUSH socket costs about 27 KiB at each end
 * (libzmq's pipes and stream buffers), two per peer pair, which was most of
 * what an idle peer cost (issue 24): closed after push_idle_ns without a
 * message, its TCP connection ends and the peer's PULL side frees its
 * share too. Only a socket no sender holds is closed; one taken meanwhile
 * is kept for the next sweep. The next message reconnects (a TCP and ZMTP
 * handshake, well under a millisecond on a LAN). A message still queued
 * for an unreachable peer after push_idle_ns is dropped with the socket
 * (200 ms linger): by then the heartbeat (decode) or the room timeouts
 * (both roles) have failed the rooms it was about. */
size_t kvf__control_close_idle_pushes(kvf_manager *m, int64_t now_ns) {
  enum { SWEEP_MAX = 256 }; /* per sweep; the rest go in the next one */
  manager_push *gone[SWEEP_MAX];
  size_t n = 0;
  if (m->push_idle_ns <= 0) return 0;
  pthread_mutex_lock(&m->push_lock);
  map_iter it;
  kvf__map_iter_init(&it);
  const char *k;
  void *v;
  while (n < SWEEP_MAX && kvf__smap_next(&m->pushes, &it, &k, &v)) {
    manager_push *p = v;
    if (now_ns - atomic_load(&p->used_ns) < m->push_idle_ns || p->users) continue; /* in use: next sweep */
    kvf__smap_del(&m->pushes, k, NULL);                                            /* the iterator tolerates it */
    p->gone = 1;
    gone[n++] = p;
  }
  pthread_mutex_unlock(&m->push_lock);
  for (size_t i = 0; i < n; i++) push_free(gone[i]); /* out of the map, no sender: none can find them */
  if (n) LOG_DEBUG("kv", "closed %zu PUSH socket(s) idle for %.0f s", n, (double)m->push_idle_ns / 1e9);
  /* libzmq frees a closed socket's buffers on its reaper thread within the
   * linger time: one sweep later, hand the freed pages back to the kernel
   * (glibc keeps them otherwise, and a process that served a burst of peers
   * would hold their memory for good). */
  if (m->push_trim_due) malloc_trim(0);
  m->push_trim_due = n > 0;
  return n;
}

void kvf__control_close_pushes(kvf_manager *m) {
  map_iter it;
  kvf__map_iter_init(&it);
  void *v;
  while (kvf__smap_next(&m->pushes, &it, NULL, &v)) push_free(v);
  kvf__smap_free(&m->pushes);
}

/* -------------------------------------------------------------- listener */

/* Wait until the PULL socket may have a message: poll() on its ZMQ_FD (the
 * socket's command mailbox) for at most MANAGER_WAIT_MS, or until the role's
 * timed work is due. Called only after a
 * non-blocking receive found nothing, which also processed every pending
 * command, so the descriptor turns readable exactly when the I/O thread
 * signals new input (zmq_getsockopt(3), ZMQ_FD). zmq_poll would check the
 * socket's events once more before and after the wait, two more system calls
 * each. */
static void listener_wait(kvf_manager *m, int fd) {
  int ms = m->role->tick ? m->role->tick(m) : -1,
      most = m->wake_fd >= 0 ? MANAGER_WAIT_MS : MANAGER_WAIT_NOWAKE_MS;
  if (ms < 0 || ms > most) ms = most;
  int woken = 0;
  if (fd < 0) {
    zmq_pollitem_t pi[2] = {{.socket = m->pull, .events = ZMQ_POLLIN}, {.fd = m->wake_fd, .events = ZMQ_POLLIN}};
    if (zmq_poll(pi, m->wake_fd >= 0 ? 2 : 1, ms) > 0) woken = 1 + (pi[1].revents != 0);
  } else {
    struct pollfd pf[2] = {{.fd = fd, .events = POLLIN}, {.fd = m->wake_fd, .events = POLLIN}};
    if (poll(pf, m->wake_fd >= 0 ? 2 : 1, ms) > 0) woken = 1 + (pf[1].revents != 0);
  }
  if (woken) kvf__wake_count();
  if (woken == 2) { /* kvf__control_wake: clear it; the caller's next turn runs the tick */
    uint64_t v;
    ssize_t r = read(m->wake_fd, &v, sizeof v); /* EAGAIN only if nothing was pending */
    (void)r;
  }
}

void kvf__control_wake(kvf_manager *m) {
  uint64_t one = 1;
  if (m->wake_fd < 0) return;
  ssize_t r = write(m->wake_fd, &one, sizeof one); /* fails only when the counter is full: a wake is pending */
  (void)r;
}

/* One connection to the control port (a peer's PUSH socket, or a probe),
 * known by the routing id ZMQ_STREAM gave it: its ZMTP state and the peer's
 * address. The listener thread's alone. */
#define CTL_ID_MAX 7
typedef struct ctl_conn {
  unsigned char id[CTL_ID_MAX];
  size_t idlen;
  char peer[KVF_ADDR_HOST_LEN];
  int64_t since_ns; /* when it connected */
  int64_t heard_ns; /* when its last bytes came, or it was last asked (conns_sweep) */
  int closing;      /* this side closed it, but the close could not go yet (conns_sweep retries) */
  size_t held;      /* its unfinished message's bytes, as counted in ctl_conns.held */
  zmtp_rx rx;
} ctl_conn;

/* The listener's connections, by routing id. */
typedef struct ctl_conns {
  kvf_manager *m;
  map by_id;
  uint64_t held;  /* bytes of unfinished messages, all connections */
  unsigned turns; /* reads and messages since the last tick */
} ctl_conns;

/* A connection's messages whole and bounded (wire/zmtp.h): frames beyond
 * MANAGER_MAX_RECV_FRAMES are counted as extra (the codecs reject such a
 * message); more than MANAGER_MAX_MSG_FRAMES frames, or more than
 * MANAGER_MAX_MSG_BYTES bytes, end the connection, and so does the one
 * whose bytes would take all connections' unfinished messages past
 * MANAGER_MAX_HELD_BYTES. */
#define MANAGER_MAX_MSG_FRAMES 1024
#define MANAGER_MAX_MSG_BYTES (64u << 20)
#define MANAGER_MAX_HELD_BYTES (256u << 20)
/* Connections at once; more are closed as they come (logged once). */
#define MANAGER_MAX_CONNS 8192
/* A connection that has not opened (greeting and READY) this long after it
 * came is closed: libzmq's own handshake timeout (ZMQ_HANDSHAKE_IVL's
 * default), so that idle connections cannot fill the table. A probe reads
 * the greeting and goes within its own timeout. */
#define MANAGER_HANDSHAKE_NS (30 * 1000000000ll)
/* An open connection quiet this long is asked whether it is still there (a
 * ZMTP PING; libzmq peers answer PONG): libzmq drops the notice that a
 * connection went away when that connection's inbound queue is full, and
 * the send tells a routing id that is gone. */
#define MANAGER_QUIET_NS (10 * 1000000000ll)
/* Reads of at most 8 KiB each that libzmq queues per connection while the
 * listener is behind (ZMQ_RCVHWM). */
#define MANAGER_RCVHWM 1000
/* Messages (MANAGER_SNDHWM) and kernel bytes (MANAGER_SNDBUF) queued to
 * one connection. */
#define MANAGER_SNDHWM 100
#define MANAGER_SNDBUF (64 << 10)
_Static_assert(MANAGER_MAX_RECV_FRAMES <= ZMTP_KEPT_FRAMES_MAX, "zmtp keeps every frame a manager reads");

/* ZMQ_STREAM's routing ids are 5 bytes (libzmq): a 64-bit key holds one,
 * with its length. */
static int conn_key(zmq_msg_t *id, uint64_t *key) {
  size_t n = zmq_msg_size(id);
  if (!n || n > CTL_ID_MAX) return 0;
  uint64_t k = n;
  memcpy((unsigned char *)&k + 1, zmq_msg_data(id), n);
  *key = k;
  return 1;
}

/* What conn_send did. */
enum { SENT = 0, SEND_FULL = 1, SEND_GONE = -1 };

/* Bytes to the peer of c (greeting, PONG, PING; none: close it). SEND_FULL
 * when its queue is full (a peer that does not read), SEND_GONE when the
 * connection is no more. */
static int conn_send(void *port, const ctl_conn *c, const void *bytes, size_t len) {
  if (zmq_send(port, c->id, c->idlen, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0) /* the id frame picks the queue */
    return zmq_errno() == EAGAIN ? SEND_FULL : SEND_GONE;
  return zmq_send(port, bytes, len, ZMQ_DONTWAIT) < 0 ? SEND_GONE : SENT;
}

typedef struct conn_turn {
  ctl_conns *cs;
  ctl_conn *c;
} conn_turn;

static void turn_send(void *arg, const void *bytes, size_t len) {
  conn_turn *t = arg;
  conn_send(t->cs->m->pull, t->c, bytes, len);
}

static void turn_message(void *arg, const wire_frame *frames, size_t n, size_t extra) {
  conn_turn *t = arg;
  t->cs->turns++;
  kvf__manager_dispatch(t->cs->m, frames, n, extra, t->c->peer);
  /* From the second message of a burst on: the first one's transfers go
   * at once (one message alone costs no push), the rest at the burst's
   * end or every ENGINE_HOLD_SENDS (engine.c). */
  kvf__engine_hold_begin();
}

/* Forget c's unfinished message, in the count of all connections'. */
static void conn_drop_message(ctl_conns *cs, ctl_conn *c) {
  cs->held -= c->held;
  c->held = 0;
  kvf__zmtp_rx_free(&c->rx);
}

static void conn_free(ctl_conns *cs, uint64_t key, ctl_conn *c) {
  conn_drop_message(cs, c);
  kvf__map_del(&cs->by_id, key, NULL);
  free(c);
}

/* End a connection from this side (ZMQ_STREAM closes it on an empty
 * message). When its queue is full the close cannot go yet: its bytes are
 * ignored meanwhile and conns_sweep tries again. */
static void conn_close(ctl_conns *cs, uint64_t key, ctl_conn *c) {
  if (conn_send(cs->m->pull, c, "", 0) != SEND_FULL) {
    conn_free(cs, key, c);
    return;
  }
  conn_drop_message(cs, c);
  c->closing = 1;
}

/* A peer connected: greet it as a PULL socket does. */
static void conn_open(ctl_conns *cs, uint64_t key, zmq_msg_t *id, zmq_msg_t *note) {
  kvf_manager *m = cs->m;
  const char *pa = zmq_msg_gets(note, "Peer-Address"); /* the IP, no port */
  ctl_conn *c = calloc(1, sizeof *c);
  if (!c) return; /* unknown here: its bytes are ignored until it goes */
  memcpy(c->id, zmq_msg_data(id), zmq_msg_size(id));
  c->idlen = zmq_msg_size(id);
  if (kvf__map_size(&cs->by_id) >= MANAGER_MAX_CONNS || kvf__map_put(&cs->by_id, key, c, NULL)) {
    conn_send(m->pull, c, "", 0);
    free(c);
    if (kvf__log_first_time(kvf__hash_str("control-conns-full", (uint64_t)(uintptr_t)m)))
      LOG_WARN("kv", "control port: %zu connections open, closing a new one from %s (further ones are not logged)",
               kvf__map_size(&cs->by_id), pa ? pa : "?");
    return;
  }
  kvf__str_copy(c->peer, sizeof c->peer, pa ? pa : "?");
  c->since_ns = c->heard_ns = clock_now_ns();
  const zmtp_limits lim = {.kept_frames = MANAGER_MAX_RECV_FRAMES,
                           .max_frames = MANAGER_MAX_MSG_FRAMES,
                           .max_msg_bytes = MANAGER_MAX_MSG_BYTES};
  kvf__zmtp_rx_init(&c->rx, &lim);
  unsigned char hello[ZMTP_HELLO_MAX];
  size_t n = kvf__zmtp_hello(hello, "PULL");
  if (conn_send(m->pull, c, hello, n) == SEND_GONE) conn_free(cs, key, c);
}

/* What ZMQ_STREAM handed over: a connection's routing id, then what the
 * peer sent (empty: it connected, or went away). */
static void conn_input(ctl_conns *cs, zmq_msg_t *id, zmq_msg_t *data) {
  uint64_t key;
  if (!conn_key(id, &key)) return;
  ctl_conn *c = kvf__map_get(&cs->by_id, key);
  size_t n = zmq_msg_size(data);
  if (!n) {
    if (c) conn_free(cs, key, c); /* it went away */
    else conn_open(cs, key, id, data);
    return;
  }
  if (!c || c->closing) return; /* bytes queued before this side closed it */
  c->heard_ns = 0;              /* heard now: conns_sweep stamps it when it next looks */
  conn_turn t = {cs, c};
  const zmtp_sink sink = {.arg = &t, .message = turn_message, .send = turn_send};
  char why[192];
  int rc = kvf__zmtp_rx_feed(&c->rx, zmq_msg_data(data), n, &sink, why, sizeof why);
  cs->held = cs->held - c->held + c->rx.len;
  c->held = c->rx.len;
  if (!rc && cs->held > MANAGER_MAX_HELD_BYTES) {
    snprintf(why, sizeof why, "the control port holds %u MiB of unfinished messages",
             MANAGER_MAX_HELD_BYTES >> 20);
    rc = KVF_ENOMEM;
  }
  if (rc) {
    kvf__manager_reject(cs->m, c->peer, "connection", why);
    conn_close(cs, key, c);
  }
}

/* About once a second: retry the closes that could not go; close the
 * connections that did not open in time; ask the quiet ones whether they
 * are still there, and forget those that are gone. */
static void conns_sweep(ctl_conns *cs, int64_t now) {
  map_iter it;
  kvf__map_iter_init(&it);
  uint64_t key;
  void *v;
  unsigned char ping[ZMTP_PING_LEN];
  kvf__zmtp_ping(ping);
  while (kvf__map_next(&cs->by_id, &it, &key, &v)) { /* the iteration tolerates a delete */
    ctl_conn *c = v;
    if (c->closing) {
      if (conn_send(cs->m->pull, c, "", 0) != SEND_FULL) conn_free(cs, key, c);
    } else if (!kvf__zmtp_rx_open(&c->rx)) {
      if (now - c->since_ns < MANAGER_HANDSHAKE_NS) continue;
      kvf__manager_reject(cs->m, c->peer, "connection", "no ZMTP greeting and READY within 30 s");
      conn_close(cs, key, c);
    } else if (!c->heard_ns) {
      c->heard_ns = now; /* bytes came since the last look */
    } else if (now - c->heard_ns >= MANAGER_QUIET_NS) {
      c->heard_ns = now;
      if (conn_send(cs->m->pull, c, ping, sizeof ping) == SEND_GONE) conn_free(cs, key, c);
    }
  }
}

/* The listener's timed chores, about once a second. */
static void listener_sweep(ctl_conns *cs) {
  kvf_manager *m = cs->m;
  int64_t now = clock_now_ns();
  if (now - m->push_swept_ns < MANAGER_SWEEP_NS) return;
  m->push_swept_ns = now;
  kvf__control_close_idle_pushes(m, now);
  conns_sweep(cs, now);
}

void *kvf__control_listener_main(void *arg) {
  kvf__thread_name("kvf-listen");
  kvf_manager *m = arg;
  ctl_conns cs = {.m = m};
  kvf__map_init(&cs.by_id);
  zmq_msg_t id, data;
  zmq_msg_init(&id);
  zmq_msg_init(&data);
  int fd = -1;
  size_t fdlen = sizeof fd;
  if (zmq_getsockopt(m->pull, ZMQ_FD, &fd, &fdlen)) fd = -1;
  while (!atomic_load(&m->stopping)) {
    if (cs.turns >= MANAGER_TICK_MSGS) { /* a listener that never waits still ticks and sweeps */
      cs.turns = 0;
      kvf__engine_hold_end(); /* nothing outside a hold */
      if (m->role->tick) m->role->tick(m);
      listener_sweep(&cs);
    }
    /* What is already queued is taken without a wait or a readiness check
     * (a check costs two system calls in libzmq): one wake-up drains a
     * burst, and the first receive that finds nothing leads to the wait. */
    if (zmq_msg_recv(&id, m->pull, ZMQ_DONTWAIT) < 0) {
      kvf__engine_hold_end(); /* the burst's notices go out before any wait */
      listener_wait(m, fd);   /* EAGAIN; any other error waits too, rather than spin */
      listener_sweep(&cs);
      continue;
    }
    /* ZMQ_STREAM: always the id, then one data part (ZeroMQ delivers
     * messages whole). */
    cs.turns++;
    if (!zmq_msg_more(&id) || zmq_msg_recv(&data, m->pull, 0) < 0) continue;
    conn_input(&cs, &id, &data);
  }
  kvf__engine_hold_end();
  map_iter it;
  kvf__map_iter_init(&it);
  uint64_t key;
  void *v;
  while (kvf__map_next(&cs.by_id, &it, &key, &v)) {
    kvf__zmtp_rx_free(&((ctl_conn *)v)->rx);
    free(v);
  }
  kvf__map_free(&cs.by_id);
  zmq_msg_close(&id);
  zmq_msg_close(&data);
  return NULL;
}

/* Bind to an ephemeral port chosen by the kernel (no bind-then-release race
 * as in the reference) and read back which one. */
int kvf__control_bind_pull(kvf_manager *m) {
  /* The PULL side of ZMTP is spoken here (wire/zmtp.h), over raw bytes,
   * so that a peer's message is bounded as a whole, not only its frames. */
  m->pull = zmq_socket(m->zctx, ZMQ_STREAM);
  if (!m->pull) return KVF_EIO;
  int linger = 0, ipv6 = kvf__addr_is_ipv6(m->host), hwm = MANAGER_RCVHWM;
  zmq_setsockopt(m->pull, ZMQ_LINGER, &linger, sizeof linger);
  zmq_setsockopt(m->pull, ZMQ_IPV6, &ipv6, sizeof ipv6);
  zmq_setsockopt(m->pull, ZMQ_RCVHWM, &hwm, sizeof hwm);
  /* What this side sends is small (greetings, PONGs, PINGs): what it keeps
   * for a peer that does not read stays small too. */
  int sndhwm = MANAGER_SNDHWM, sndbuf = MANAGER_SNDBUF;
  zmq_setsockopt(m->pull, ZMQ_SNDHWM, &sndhwm, sizeof sndhwm);
  zmq_setsockopt(m->pull, ZMQ_SNDBUF, &sndbuf, sizeof sndbuf);
  /* Many decode ranks probe this port at once each heartbeat round (a new
   * connection per probe): ZeroMQ's backlog of 100 dropped SYNs past that,
   * and a dropped SYN waits 1 s — the probe's whole timeout. The kernel
   * caps it at net.core.somaxconn. */
  int backlog = MANAGER_MAX_PUSHES;
  zmq_setsockopt(m->pull, ZMQ_BACKLOG, &backlog, sizeof backlog);
  char ep[sizeof "tcp://" + KVF_ADDR_LEN];
  snprintf(ep, sizeof ep, ipv6 ? "tcp://[%s]:*" : "tcp://%s:*", m->host);
  if (zmq_bind(m->pull, ep)) {
    LOG_ERROR("kv", "cannot bind the control socket on %s: %s", ep, zmq_strerror(zmq_errno()));
    return KVF_EIO;
  }
  char last[sizeof "tcp://" + KVF_ADDR_LEN];
  size_t len = sizeof last;
  if (zmq_getsockopt(m->pull, ZMQ_LAST_ENDPOINT, last, &len)) return KVF_EIO;
  const char *hp = strncmp(last, "tcp://", 6) ? last : last + 6;
  if (kvf__addr_parse(hp, strlen(hp), NULL, 0, &m->rank_port, NULL)) return KVF_EIO;
  return 0;
}

/* The TCP transport's target side: an accept thread, and inbound
 * connections parked in an evpool (evpool.h) while idle: a worker of the
 * pool takes one only while its hello or chunks arrive. A
 * chunk's framing is checked (tcp_frame.c) and its destination regions are
 * pinned before any payload byte is read; the payload is then received
 * directly into its destination (no staging copy) without the regions lock,
 * so a slow peer delays nobody else. A refused chunk's payload is drained
 * into a scratch buffer so the stream stays in step, and answered with
 * KVF_ERANGE. Malformed framing closes the connection; it never stops the
 * engine. The hello and each chunk have an overall deadline that trickled
 * bytes do not extend, and when every slot is taken a connection still in its
 * hello, or idle, is evicted to admit a new one. A tagged chunk
 * (kvf_batch_opts.tag) is written only while the target has its (tag, epoch)
 * open (fence.c): refused before any payload byte otherwise (KVF_ESTATE),
 * and cut at the next receive tick when the fence closes meanwhile, as a
 * pinned region's unregistering cuts it. */
#include "engine/tcp_int.h"
#include "base/thread.h"
#include "base/parse.h"

/* Where an inbound connection stands, for eviction when every slot is taken.
 * The worker holding the connection moves HELLO → IDLE → BUSY → IDLE ...; the accept
 * thread may move HELLO or IDLE to EVICTED (and shut the socket down), never
 * BUSY, so a chunk in progress is never cut to make room. */
enum { IN_HELLO, IN_IDLE, IN_BUSY, IN_EVICTED };

typedef struct tcp_inbound {
  evpool_item item; /* its socket (fd below) in the transport's pool */
  struct tcp_inbound *next;
  tcp_state *t;
  int fd;
  atomic_int finished;
  atomic_int phase;
  atomic_llong idle_since_ns;
  atomic_ullong chunks; /* chunks answered on this connection */
  int64_t accepted_ns;
  uint64_t rx_bytes; /* bytes taken so far (this connection's thread only) */
  /* Read-ahead of a data connection (NULL during the hello, so a UCX
   * rendezvous gets its socket with nothing consumed): st_off..st_len of
   * stage are received but not yet taken. This connection's thread only. */
  unsigned char *stage;
  size_t st_off, st_len;
  /* A chunk's descriptors and the regions they pin (cap of each); held
   * while the connection has chunks to read, freed when it parks. */
  tcp_desc *descs;
  region **pins;
  size_t cap;
  /* Acknowledgements not yet sent: they go out together before this thread
   * next reads from the socket, so chunks found whole in the stage are
   * answered by one send. */
  tcp_ack acks[TCP_ACK_BATCH];
  int nack;
  unsigned hello_flags;    /* tcp_hello.flags, for a UCX rendezvous */
  atomic_int handed;       /* the socket went to the UCX rendezvous server (ucx.c), which closes it */
  char peer[KVF_ADDR_LEN]; /* "ip:port", "[ipv6]:port" */
} tcp_inbound;

/* The regions one chunk writes into, pinned while its payload arrives. */
typedef struct in_pins {
  region **r;
  size_t n;
  unsigned gen;        /* the table's revocation count when they were pinned */
  engine_fence *fence; /* a tagged chunk's fence (fence.c): cut = stop like a revocation */
} in_pins;

/* Report a misbehaving peer once per (peer address, kind). */
static void log_peer_once(const char *peer, const char *kind, const char *detail) {
  if (kvf__log_first_time_for_host(peer, kind))
    LOG_WARN("tcp", "peer %s: %s (further reports of this kind from it are not logged)", peer, detail);
}

static int pins_revoked(const tcp_inbound *in, const in_pins *p) {
  if (p && p->fence && atomic_load(&p->fence->cut)) return 1;
  if (!p || atomic_load(&in->t->e->regions.revocations) == p->gen) return 0;
  for (size_t i = 0; i < p->n; i++)
    if (atomic_load(&p->r[i]->revoked)) return 1;
  return 0;
}

/* Copy staged bytes (read ahead by an earlier receive) into iov[cnt], at
 * most `need`; advances the iovecs. Returns the bytes taken. */
static size_t stage_take(tcp_inbound *in, struct iovec **iov, int *cnt, size_t need) {
  size_t avail = in->st_len - in->st_off, n = avail < need ? avail : need, done = 0;
  for (int i = 0; done < n && i < *cnt; i++) {
    size_t k = (*iov)[i].iov_len < n - done ? (*iov)[i].iov_len : n - done;
    if (k) memcpy((*iov)[i].iov_base, in->stage + in->st_off + done, k);
    done += k;
  }
  in->st_off += n;
  kvf__tcp_iov_advance(iov, cnt, n);
  return n;
}

/* Send the acknowledgements held back, within `ms` overall (a peer that
 * reads its acknowledgements a byte at a time does not hold this thread,
 * and the pins and fence of a chunk in progress, longer); 0 or an error. */
static int acks_flush_within(tcp_inbound *in, int ms) {
  int n = in->nack;
  in->nack = 0;
  return n ? kvf__fd_send_all(in->fd, in->acks, (size_t)n * sizeof *in->acks, clock_deadline_ms(ms)) : 0;
}

/* The same within the engine's timeout. */
static int acks_flush(tcp_inbound *in) { return acks_flush_within(in, in->t->e->cfg.timeout_ms); }

/* Receive into iov[cnt] (advanced as bytes arrive). The socket's receive
 * timeout is one tick (TCP_READER_TICK_MS), so every call ends within it and
 * the overall *deadline_ns holds however slowly the bytes trickle in. With
 * *deadline_ns == 0 the message has not started: a tick with no byte returns
 * 1 (idle), and the first byte sets the deadline to now + budget_ms. With
 * `pins`, the unregistering of a pinned region returns 2 at the next tick.
 * Otherwise 0, KVF_ETIMEDOUT or KVF_ECLOSED.
 * Small reads (framing, small payloads) go through the connection's stage:
 * one recv takes whatever has arrived, often a whole chunk and its trailer,
 * and the rest of the chunk is then parsed from memory instead of one system
 * call per part. Reads of TCP_IN_STAGE_BYTES or more go straight into their
 * destination (after the staged bytes), so big payloads are not copied twice. */
static int in_recvv(tcp_inbound *in, struct iovec *iov, int cnt, int64_t *deadline_ns, int budget_ms,
                    const in_pins *pins) {
  size_t need = 0;
  for (int i = 0; i < cnt; i++) need += iov[i].iov_len;
  while (need) {
    /* Every turn, before any byte is taken: the message's overall deadline
     * and the revocation of a pinned region. A peer that keeps pace (each
     * request filled by one read or from the stage) must not outlive them. */
    if (*deadline_ns && clock_now_ns() > *deadline_ns) return KVF_ETIMEDOUT;
    if (pins_revoked(in, pins)) return 2;
    ssize_t r;
    if (in->st_off < in->st_len) {
      r = (ssize_t)stage_take(in, &iov, &cnt, need);
    } else if (in->nack) { /* before this thread may wait: answer what landed */
      if (acks_flush(in)) return KVF_ECLOSED;
      continue; /* the flush may have waited on a peer slow to read: the deadline and the pins again */
    } else if (in->stage && need < TCP_IN_STAGE_BYTES) {
      r = recv(in->fd, in->stage, TCP_IN_STAGE_BYTES, 0);
      if (r > 0) {
        in->st_off = 0, in->st_len = (size_t)r;
        continue; /* taken from the stage at the next turn */
      }
    } else {
      struct msghdr m = {.msg_iov = iov, .msg_iovlen = (size_t)cnt};
      r = recvmsg(in->fd, &m, MSG_WAITALL);
      if (r > 0) kvf__tcp_iov_advance(&iov, &cnt, (size_t)r);
    }
    if (r > 0) {
      in->rx_bytes += (uint64_t)r;
      need -= (size_t)r;
      if (!*deadline_ns) *deadline_ns = clock_deadline_ms(budget_ms);
    } else if (r == 0) {
      return KVF_ECLOSED;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      if (!*deadline_ns) return 1;
    } else if (errno != EINTR) {
      return KVF_ECLOSED;
    }
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
    int k = kvf__tcp_iter_fill(&src, &it, iov, TCP_IOV_BATCH);
    if (k == 0) return 0;
    int rc = in_recvv(in, iov, k, deadline_ns, 0, pins);
    if (rc == 2) *left = total - (in->rx_bytes - start);
    if (rc) return rc;
    for (int i = 0; pins->fence && i < k; i++) /* while the pieces are in this thread's cache */
      kvf__engine_deliver_landed(in->t->e, pins->fence->tag, pins->fence->epoch, iov[i].iov_base, iov[i].iov_len);
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

/* A chunk's trailer, after its payload, within the chunk's deadline: read
 * it whole (bounded) and, when the payload was written (`landed`), hand it
 * to the trailer callback with the peer's IP address; for a tagged chunk
 * (`pair`, its fence already left) only inside the pair again, so once
 * kvf_engine_fence_close has returned no trailer of that epoch arrives (a
 * room id used again must not see the last use's completion), and a writer
 * slow to send the trailer does not hold a close. Non-zero ends the
 * connection. */
static int inbound_trailer(tcp_inbound *in, kvf_engine *e, int landed, const tcp_chunk_tag *pair,
                           int64_t *deadline) {
  tcp_trailer t;
  unsigned char buf[KVF_ENGINE_MAX_TRAILER];
  int rc = in_recv(in, &t, sizeof t, deadline, 0);
  if (rc) return rc;
  if (t.magic != TCP_TRAILER_MAGIC || t.len > sizeof buf) {
    atomic_fetch_add(&e->stats.protocol_errors, 1);
    log_peer_once(in->peer, "frame", "malformed chunk trailer; connection dropped");
    return KVF_EPROTO;
  }
  if ((rc = in_recv(in, buf, t.len, deadline, 0))) return rc;
  char ip[KVF_ADDR_HOST_LEN];
  engine_fence *x = landed && pair ? kvf__fence_reenter(e, pair->tag, pair->epoch) : NULL;
  if (landed && (!pair || x) && !kvf__addr_host(in->peer, ip, sizeof ip))
    kvf__engine_deliver_trailer(e, buf, t.len, ip);
  if (x) kvf__fence_leave(e, x);
  return 0;
}

static int inbound_handshake(tcp_inbound *in, kvf_engine *e) {
  tcp_hello h;
  char token[TCP_MAX_TOKEN];
  int ucx = 0;
  /* One deadline for the whole hello, from accept: a byte now and then does
   * not extend it. */
  int64_t deadline = in->accepted_ns + (int64_t)TCP_HELLO_DEADLINE_MS * 1000000;
  int rc = in_recv(in, &h, sizeof h, &deadline, 0);
  if (!rc) {
    int v = kvf__tcp_frame_hello(&h);
    ucx = h.magic == TCP_UCX_HELLO_MAGIC; /* a UCX rendezvous (ucx.c), same token check */
    in->hello_flags = h.flags;
    if (v) {
      in_frame_error(in, e, v);
      return KVF_EPROTO;
    }
    rc = in_recv(in, token, h.token_len, &deadline, 0);
  }
  /* Closed at the deadline: the pool's tick shut it down (inbound_tick). */
  if (rc == KVF_ECLOSED && clock_now_ns() > deadline) rc = KVF_ETIMEDOUT;
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
  tcp_reply rep = {TCP_HELLO_MAGIC, ok ? (ucx && !e->ops->serve ? KVF_ESTATE : 0) : KVF_EACCES};
  if (!ok) {
    kvf__tcp_send_all(in->fd, &rep, sizeof rep);
    atomic_fetch_add(&e->stats.auth_refused, 1);
    log_peer_once(in->peer, "auth", h.token_len ? "wrong auth token; refused" : "no auth token; refused");
    return KVF_EACCES;
  }
  /* Out of its hello before the writer hears so: answered while still in
   * it, the connection could be evicted as a hello (the oldest first) by
   * the next one the writer opens, and its first chunk would fail. A UCX
   * rendezvous connection goes to ucx.c, which lets its slot go: busy until
   * then, so never evicted as idle. It is authenticated. */
  atomic_store(&in->idle_since_ns, clock_now_ns());
  int expect = IN_HELLO;
  if (!atomic_compare_exchange_strong(&in->phase, &expect, ucx ? IN_BUSY : IN_IDLE)) return KVF_ECLOSED;
  kvf__tcp_send_all(in->fd, &rep, sizeof rep);
  return ucx ? (rep.status ? KVF_ESTATE : 1) : 0;
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
static int inbound_chunk(tcp_inbound *in, kvf_engine *e, const tcp_chunk_hdr *h, const tcp_chunk_tag *tag,
                         int has_trailer, tcp_desc *descs, region **pinv, int64_t *deadline, int *status,
                         int *trailer_read) {
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
  /* A tagged chunk lands only while its fence is open (fence.c): checked
   * before any byte is written, and again at every receive tick. */
  int fenced = 0;
  if (!v && tag && !(pins.fence = kvf__fence_enter(e, tag->tag, tag->epoch))) {
    for (size_t i = 0; i < pins.n; i++) kvf__region_unpin(&e->regions, pinv[i]);
    fenced = 1;
  }
  /* ... and only into the fence's bounds (the room's pages), when set. */
  int bounded = 0; /* refused by the bounds of an open fence: its owner hears of it */
  if (!v && pins.fence) {
    int closed = kvf__fence_bounds_begin(e, pins.fence);
    for (uint32_t i = 0; !closed && !v && i < h->ndesc; i++)
      if (!kvf__fence_bounds_ok(pins.fence, descs[i].dst, descs[i].len, descs[i].count, descs[i].stride))
        v = TCP_FRAME_OUT_OF_RANGE;
    kvf__fence_bounds_end(e);
    bounded = v != 0;
    if (closed || v) {
      for (size_t i = 0; i < pins.n; i++) kvf__region_unpin(&e->regions, pinv[i]);
      kvf__fence_leave(e, pins.fence);
      pins.fence = NULL;
      if (closed && !v) {
        atomic_fetch_add(&e->stats.chunks_fenced, 1);
        fenced = 1;
      }
    }
  }
  uint64_t left = h->total_bytes;
  if (!v && !fenced) {
    kvf_engine_sync(e); /* order after the owner's last local change */
    int64_t t_land = pins.fence ? clock_now_ns() : 0;
    rc = in_recv_payload(in, descs, h->ndesc, h->total_bytes, &pins, deadline, &left);
    kvf_engine_sync(e); /* publish the bytes to the owner's next sync */
    for (size_t i = 0; i < pins.n; i++) kvf__region_unpin(&e->regions, pinv[i]);
    int cut = rc == 2 && pins.fence && atomic_load(&pins.fence->cut);
    if (!rc && pins.fence) kvf__fence_landed(pins.fence, t_land, clock_now_ns(), h->total_bytes, KVF__FENCE_TCP);
    const tcp_chunk_tag *pair = pins.fence ? tag : NULL;
    if (pins.fence) kvf__fence_leave(e, pins.fence); /* from here the chunk writes nothing more */
    if (!rc && has_trailer) {                        /* handed over inside its pair only (inbound_trailer) */
      rc = inbound_trailer(in, e, 1, pair, deadline);
      *trailer_read = 1;
    }
    if (cut) {
      atomic_fetch_add(&e->stats.chunks_fenced, 1);
      fenced = 1;
      rc = 0;
    } else if (rc == 2) {
      log_peer_once(in->peer, "revoked", "destination unregistered during a write; rest of the chunk refused");
      v = TCP_FRAME_OUT_OF_RANGE;
      rc = 0;
    } else {
      left = 0;
    }
  } else if (v == TCP_FRAME_DEVICE_MEMORY) {
    log_peer_once(in->peer, "device",
                  "write into device memory refused: kvferry's TCP copies with the CPU, which "
                  "cannot write it (use transport ucx with a UCX built with CUDA)");
  } else if (v) {
    log_peer_once(in->peer, "range", "write outside registered memory (or its room's pages) refused");
  }
  if (!rc && left) rc = in_drain(in, left, deadline);
  if (rc) return rc;
  if (v) {
    atomic_fetch_add(&e->stats.batches_refused, 1);
    if (tag && bounded) kvf__engine_deliver_refusal(e, tag->tag, tag->epoch, KVF_ERANGE, in->peer);
  } else if (!fenced) {
    atomic_fetch_add(&e->stats.batches_received, 1);
    atomic_fetch_add(&e->stats.bytes_received, h->total_bytes);
  }
  *status = v ? KVF_ERANGE : fenced ? KVF_ESTATE : 0;
  return 0;
}

static void inbound_park_free(tcp_inbound *in) {
  free(in->descs);
  free(in->pins);
  free(in->stage);
  in->descs = NULL;
  in->pins = NULL;
  in->stage = NULL;
  in->cap = 0;
  in->st_off = in->st_len = 0;
}

/* A worker holds the connection (bytes arrived, or it was shut down): the
 * hello, then every chunk that has arrived, each within its deadline. 0
 * parks it again (nothing more to read now), anything else ends it. */
static int inbound_turn(void *arg, evpool_item *it) {
  tcp_state *t = arg;
  tcp_inbound *in = (tcp_inbound *)(void *)((char *)it - offsetof(tcp_inbound, item));
  kvf_engine *e = t->e;
  int ph = atomic_load(&in->phase);
  if (ph == IN_EVICTED) return KVF_ECLOSED;
  if (ph == IN_HELLO) {
    int hs = inbound_handshake(in, e);
    if (hs == 1 && e->ops->serve(e, in->fd, in->peer, in->hello_flags)) {
      atomic_store(&in->handed, 1); /* the socket is the rendezvous server's; this slot is let go */
      return 1;
    }
    if (hs) return hs;
  }
  /* Without a stage, every read goes to the socket. */
  if (!in->stage) in->stage = malloc(TCP_IN_STAGE_BYTES);
  for (;;) {
    if (atomic_load(&t->stopping)) return KVF_ECLOSED;
    if (in->st_off == in->st_len) {
      /* Nothing staged: answer what landed, and park unless bytes wait. */
      if (acks_flush(in)) return KVF_ECLOSED;
      char b;
      ssize_t r = recv(in->fd, &b, 1, MSG_PEEK | MSG_DONTWAIT);
      if (r == 0) return KVF_ECLOSED;
      if (r < 0) {
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) return KVF_ECLOSED;
        inbound_park_free(in);
        return 0;
      }
    }
    /* From its first byte a chunk (header, descriptors, payload) has the
     * engine timeout in all, however its bytes trickle in. */
    tcp_chunk_hdr h;
    int64_t deadline = 0;
    int rc = in_recv(in, &h, sizeof h, &deadline, e->cfg.timeout_ms);
    if (atomic_load(&t->stopping)) return KVF_ECLOSED;
    if (rc == 1) continue;
    int expect = IN_IDLE;
    if (rc || !atomic_compare_exchange_strong(&in->phase, &expect, IN_BUSY)) goto out_err;
    kvf__wake_count();
    /* A chunk with a completion trailer (async.h) frames as a plain one up
     * to its payload; the trailer follows. */
    int has_trailer = h.magic == TCP_CHUNK_TRAILER_MAGIC || h.magic == TCP_CHUNK_TAGGED_TRAILER_MAGIC;
    if (has_trailer) h.magic = h.magic == TCP_CHUNK_TRAILER_MAGIC ? TCP_CHUNK_MAGIC : TCP_CHUNK_TAGGED_MAGIC;
    int v = kvf__tcp_frame_chunk_hdr(&h);
    if (v) {
      in_frame_error(in, e, v);
      return KVF_EPROTO;
    }
    tcp_chunk_tag tag = {0, 0};
    if (h.magic == TCP_CHUNK_TAGGED_MAGIC && (rc = in_recv(in, &tag, sizeof tag, &deadline, 0))) goto out_err;
    if (in_grow(&in->descs, &in->pins, &in->cap, h.ndesc)) return KVF_ENOMEM;
    int status = 0, trailer_read = 0;
    rc = inbound_chunk(in, e, &h, h.magic == TCP_CHUNK_TAGGED_MAGIC ? &tag : NULL, has_trailer, in->descs,
                       in->pins, &deadline, &status, &trailer_read);
    if (!rc && has_trailer && !trailer_read)
      rc = inbound_trailer(in, e, 0, NULL, &deadline); /* read, not delivered */
    if (rc) goto out_err;
    in->acks[in->nack++] = (tcp_ack){h.seq, status, TCP_ACK_MAGIC};
    /* Held back only while more staged chunks follow (one send answers
     * them all); otherwise answered before the connection counts as idle,
     * where it may be evicted. */
    if ((in->nack == TCP_ACK_BATCH || in->st_off == in->st_len) && acks_flush(in)) return KVF_ECLOSED;
    atomic_fetch_add(&in->chunks, 1);
    atomic_store(&in->idle_since_ns, clock_now_ns());
    atomic_store(&in->phase, IN_IDLE);
    continue;
out_err:
    if (rc == KVF_ETIMEDOUT) in_timed_out(in, e, "chunk not complete within the engine timeout; dropped");
    return rc ? rc : KVF_ECLOSED;
  }
}

/* The pool is done with the connection: the reaper frees it. */
static void inbound_end(void *arg, evpool_item *it) {
  tcp_inbound *in = (tcp_inbound *)(void *)((char *)it - offsetof(tcp_inbound, item));
  (void)arg;
  if (!atomic_load(&in->handed)) {
    acks_flush_within(in, TCP_READER_TICK_MS); /* chunks that landed before an error are still answered */
    shutdown(in->fd, SHUT_RDWR);
  }
  inbound_park_free(in);
  atomic_store(&in->finished, 1);
}

/* The event thread, every tick: a connection still in its hello past the
 * hello deadline is shut down, which hands it to a worker that reports it
 * (a silent one never wakes by itself). Nonzero while one is still in its
 * hello within the deadline (the next tick watches it). */
static int inbound_tick(void *arg) {
  tcp_state *t = arg;
  int64_t now = clock_now_ns();
  int watching = 0;
  pthread_mutex_lock(&t->in_lock);
  for (tcp_inbound *in = t->inbound; in; in = in->next) {
    if (atomic_load(&in->phase) != IN_HELLO || atomic_load(&in->finished)) continue;
    if (now > in->accepted_ns + (int64_t)TCP_HELLO_DEADLINE_MS * 1000000) shutdown(in->fd, SHUT_RDWR);
    else watching = 1;
  }
  pthread_mutex_unlock(&t->in_lock);
  return watching;
}

const evpool_ops kvf__tcp_inbound_ops = {.turn = inbound_turn, .end = inbound_end, .tick = inbound_tick};

/* Every slot is taken: close the connection that holds one for the least
 * reason, so neither silent nor trickling peers can keep a legitimate one
 * out. Order: the oldest still in its hello past TCP_HELLO_GRACE_MS, then
 * the oldest idle one that never sent a chunk, then the oldest in its
 * hello within the grace, then the one idle longest. A connection inside a
 * chunk is never chosen. Caller holds in_lock; 1 if one was evicted. */
static tcp_inbound *pick_victim_locked(tcp_state *t, int *phase_out) {
  tcp_inbound *victim = NULL;
  int vrank = 0;
  int64_t vkey = 0, young = clock_now_ns() - (int64_t)TCP_HELLO_GRACE_MS * 1000000;
  for (tcp_inbound *in = t->inbound; in; in = in->next) {
    int ph = atomic_load(&in->phase), rank;
    int64_t key;
    if (ph == IN_HELLO) rank = in->accepted_ns > young ? 2 : 0, key = in->accepted_ns;
    else if (ph == IN_IDLE) rank = atomic_load(&in->chunks) ? 3 : 1, key = atomic_load(&in->idle_since_ns);
    else continue;
    if (!victim || rank < vrank || (rank == vrank && key < vkey))
      victim = in, vrank = rank, vkey = key, *phase_out = ph;
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

void kvf__tcp_inbound_cut_all(tcp_state *t) {
  pthread_mutex_lock(&t->in_lock);
  for (tcp_inbound *in = t->inbound; in; in = in->next)
    if (!atomic_load(&in->finished)) shutdown(in->fd, SHUT_RDWR);
  pthread_mutex_unlock(&t->in_lock);
}

void kvf__tcp_inbound_reap(tcp_state *t, int all) {
  pthread_mutex_lock(&t->in_lock);
  tcp_inbound **pp = &t->inbound;
  while (*pp) {
    tcp_inbound *in = *pp;
    if (all || atomic_load(&in->finished)) {
      *pp = in->next;
      t->n_inbound--;
      if (atomic_load(&in->phase) == IN_EVICTED) t->n_evicted--;
      if (!atomic_load(&in->handed)) close(in->fd);
      inbound_park_free(in);
      free(in);
    } else {
      pp = &in->next;
    }
  }
  pthread_mutex_unlock(&t->in_lock);
}

/* Is there a slot for one more connection, evicting one if need be? Evicted
 * connections hold their slot until a worker notices, so the live count is
 * kept under the limit and the total under twice it. */
static int inbound_admit(tcp_state *t) {
  int max = t->e->cfg.max_inbound_conns, ok;
  pthread_mutex_lock(&t->in_lock);
  ok = t->n_inbound < 2 * max && (t->n_inbound - t->n_evicted < max || evict_one_locked(t));
  pthread_mutex_unlock(&t->in_lock);
  return ok;
}

void *kvf__tcp_accept_main(void *arg) {
  kvf__thread_name("kvf-tcp-accept");
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
    kvf__tcp_inbound_reap(t, 0);
    char peer[KVF_ADDR_LEN];
    kvf__addr_from_sockaddr(peer, sizeof peer, (const struct sockaddr *)&ss);
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
    kvf__tcp_set_timeout(fd, SO_RCVTIMEO, TCP_READER_TICK_MS);
    kvf__tcp_set_timeout(fd, SO_SNDTIMEO, e->cfg.timeout_ms);
    in->t = t;
    in->fd = fd;
    in->item.fd = fd;
    in->accepted_ns = now;
    atomic_init(&in->phase, IN_HELLO);
    kvf__str_copy(in->peer, sizeof in->peer, peer);
    /* Listed before it is parked, so eviction sees every connection. */
    pthread_mutex_lock(&t->in_lock);
    in->next = t->inbound;
    t->inbound = in;
    t->n_inbound++;
    if (kvf__evpool_add(t->in_pool, &in->item)) {
      t->inbound = in->next;
      t->n_inbound--;
      close(fd);
      free(in);
    }
    pthread_mutex_unlock(&t->in_lock);
  }
  return NULL;
}

int kvf__tcp_listen_on(kvf_engine *e, int *fd_out, uint16_t *port_out) {
  struct addrinfo hints = {.ai_family = AF_UNSPEC,
                           .ai_socktype = SOCK_STREAM,
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
  if (bind(fd, res->ai_addr, res->ai_addrlen) || listen(fd, SOMAXCONN)) {
    LOG_ERROR("tcp", "cannot listen on %s: %s", kvf__addr_str(e->host, e->cfg.port).s, strerror(errno));
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

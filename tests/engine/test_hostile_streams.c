/* Random byte streams against a live engine's inbound TCP path (the real
 * reader: its stage, grouped acks, trailers and fences, not only the framing
 * parser the fuzzer covers). A seeded generator writes, over raw sockets on
 * 127.0.0.1, hostile streams (broken hellos, wrong tokens, bad magics,
 * descriptor counts and totals, writes outside registered memory, tagged
 * chunks for fences never opened, malformed trailers, truncations) from one
 * thread, while the main thread writes clean streams (valid chunks in random
 * pieces, with and without trailers and tags) and checks each byte.
 *
 * The registered region is split: clean streams write only its first half,
 * hostile streams only its second half or outside it, so the oracles are
 * exact:
 *   - after each clean stream's acks (all 0), its first half equals a shadow
 *     copy the test keeps, and its trailers arrived whole and in order;
 *   - no byte a fenced chunk carries (values >= 0x80) ever lands, and no
 *     trailer of a fenced chunk reaches the trailer callback;
 *   - the guard pages around the region keep their canary;
 *   - each rejection kind happened (the stream generator reaches them) and a
 *     real writer still lands afterwards.
 * KVF_TEST_SEED picks the seed (printed), KVF_TEST_STREAMS the number of
 * clean streams (hostile ones run alongside until the clean ones end). */
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>

#include "engine/async.h"
#include "engine/tcp_proto.h"
#ifdef KVF_HAVE_UCX
#include "engine/ucx.h"
#endif
#include "kvferry.h"

#define TOKEN "s3cret"
#define GUARD (64u << 10)
#define REGION (1u << 20)
#define HALF (REGION / 2) /* [0, HALF): clean streams; [HALF, REGION): hostile ones */
#define CANARY 0xA5
#define FENCED_VALUE_MIN 0x80 /* payload bytes of chunks for unopened fences */
#define MAX_STREAM (1u << 20) /* bytes one generated stream may hold */
#define ACK_WAIT_MS 5000
#define OPEN_TAG 77

typedef struct rng {
  uint64_t s;
} rng;

static uint64_t next(rng *r) {
  uint64_t z = (r->s += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

static uint64_t below(rng *r, uint64_t n) { return n ? next(r) % n : 0; }
static int chance(rng *r, int percent) { return (int)below(r, 100) < percent; }

typedef struct stream {
  unsigned char *b;
  size_t n;
} stream;

/* The generator keeps each stream under MAX_STREAM; abort (not a cmocka
 * assertion, which only works on the test's own thread) if it does not. */
static void put(stream *s, const void *p, size_t n) {
  if (s->n + n > MAX_STREAM) abort();
  memcpy(s->b + s->n, p, n);
  s->n += n;
}

/* n payload bytes, each in [lo, lo + span). */
static void put_payload(stream *s, rng *r, size_t n, unsigned lo, unsigned span) {
  if (s->n + n > MAX_STREAM) abort();
  for (size_t i = 0; i < n; i++) s->b[s->n + i] = (unsigned char)(lo + below(r, span));
  s->n += n;
}

static void put_hello(stream *s, uint32_t magic, uint16_t version, const char *token, size_t tlen) {
  tcp_hello h = {magic, version, 0, (uint32_t)tlen, 0};
  put(s, &h, sizeof h);
  put(s, token, tlen);
}

/* ---- the target ---- */

typedef struct target {
  kvf_engine *e;
  unsigned char *map, *base; /* base = map + GUARD: the registered region */
  unsigned char shadow[HALF];
  uint64_t epoch;     /* of the open fence (OPEN_TAG) */
  pthread_mutex_t mu; /* trailers seen by the callback */
  unsigned char trailers[64][KVF_ENGINE_MAX_TRAILER];
  size_t trailer_len[64];
  int ntrailers, fenced_trailers, stray_trailers;
  unsigned char ucx_addr_byte; /* the header byte of the target's UCX worker address (0 without UCX) */
} target;

/* Trailer callback (an engine receive thread). A trailer's first byte says
 * who sent it: 'C' a clean stream, 'F' a chunk for an unopened fence (must
 * never arrive), anything else a hostile stream. */
static void on_trailer(void *arg, const unsigned char *data, size_t len, const char *peer) {
  target *t = arg;
  (void)peer;
  pthread_mutex_lock(&t->mu);
  if (len && data[0] == 'F') {
    t->fenced_trailers++;
  } else if (len && data[0] == 'C') {
    if (t->ntrailers < 64) {
      memcpy(t->trailers[t->ntrailers], data, len);
      t->trailer_len[t->ntrailers] = len;
    }
    t->ntrailers++;
  } else {
    t->stray_trailers++;
  }
  pthread_mutex_unlock(&t->mu);
}

static int raw_connect(uint16_t port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(0x7f000001)};
  struct timeval tv = {2, 0}; /* a send never blocks past this: the engine may stop reading */
  if (fd >= 0) setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a)) {
    if (fd >= 0) close(fd);
    return -1;
  }
  return fd;
}

/* Send the stream in random pieces (1 byte to 9 KiB, sometimes the rest at
 * once), so chunk boundaries fall anywhere in the reader's stage. 0, or -1
 * when the engine closed or stopped reading. */
static int send_pieces(int fd, const stream *s, rng *r) {
  size_t off = 0;
  while (off < s->n) {
    size_t k = chance(r, 20) ? s->n - off : 1 + below(r, chance(r, 30) ? 16 : 9216);
    if (k > s->n - off) k = s->n - off;
    ssize_t w = send(fd, s->b + off, k, MSG_NOSIGNAL);
    if (w <= 0) return -1;
    off += (size_t)w;
  }
  return 0;
}

/* Read `want` acks (or until the peer closes, or ACK_WAIT_MS); returns how
 * many came, their statuses and sequence numbers in st[] and seq[]. */
static int read_acks(int fd, int want, int32_t *st, uint64_t *seq, int wait_ms) {
  unsigned char buf[64 * sizeof(tcp_ack)];
  size_t have = 0;
  int got = 0;
  struct timespec t0;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  while (got < want) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    int left = wait_ms - (int)((now.tv_sec - t0.tv_sec) * 1000 + (now.tv_nsec - t0.tv_nsec) / 1000000);
    struct pollfd p = {fd, POLLIN, 0};
    if (left <= 0 || poll(&p, 1, left) <= 0) break;
    ssize_t r = recv(fd, buf + have, sizeof buf - have, 0);
    if (r <= 0) break;
    have += (size_t)r;
    size_t used = 0;
    for (; have - used >= sizeof(tcp_ack) && got < want; used += sizeof(tcp_ack)) {
      tcp_ack a;
      memcpy(&a, buf + used, sizeof a);
      assert_int_equal(a.magic, TCP_ACK_MAGIC);
      st[got] = a.status;
      seq[got] = a.seq;
      got++;
    }
    memmove(buf, buf + used, have - used);
    have -= used;
  }
  return got;
}

/* Read whatever the engine answers (hello reply, acks) until it closes or
 * `wait_ms` passed. */
static void drain(int fd, int wait_ms) {
  char buf[4096];
  struct pollfd p = {fd, POLLIN, 0};
  while (poll(&p, 1, wait_ms) > 0 && recv(fd, buf, sizeof buf, 0) > 0) {
  }
}

/* ---- clean streams: valid chunks into the first half, checked byte by byte ---- */

typedef struct clean_desc {
  uint64_t off, len, count, stride; /* offsets into the region */
  size_t payload_at;                /* where its bytes start in the stream */
} clean_desc;

typedef struct clean_chunk {
  clean_desc d[12];
  int nd;
  int trailer;
  unsigned char tbytes[KVF_ENGINE_MAX_TRAILER];
  size_t tlen;
} clean_chunk;

static void clean_stream(target *t, rng *r, int id, stream *s) {
  clean_chunk ch[4];
  int nch = 1 + (int)below(r, 4);
  s->n = 0;
  put_hello(s, TCP_HELLO_MAGIC, TCP_PROTO_VERSION, TOKEN, strlen(TOKEN));
  for (int c = 0; c < nch; c++) {
    clean_chunk *k = &ch[c];
    int tagged = chance(r, 30);
    k->trailer = chance(r, 40);
    k->nd = 1 + (int)below(r, 12);
    /* Descriptors that do not overlap inside the chunk: a cursor walks the
     * first half from a random start. Some pieces are 64 KiB or more, read
     * straight into place rather than through the stage. */
    uint64_t cur = below(r, HALF / 4), total = 0;
    int nd = 0;
    for (int i = 0; i < k->nd; i++) {
      uint64_t len = chance(r, 5) ? (64u << 10) + below(r, 8192) : 1 + below(r, chance(r, 50) ? 64 : 8192);
      uint64_t count = 1 + below(r, 3), stride = len + below(r, 128);
      uint64_t off = cur + below(r, 256);
      if (off + (count - 1) * stride + len > HALF) break;
      k->d[nd++] = (clean_desc){off, len, count, stride, 0};
      cur = off + (count - 1) * stride + len;
      total += len * count;
    }
    if (!nd) k->d[nd++] = (clean_desc){0, 1, 1, 0, 0}, total = 1;
    k->nd = nd;
    tcp_chunk_hdr h = {tagged ? (k->trailer ? TCP_CHUNK_TAGGED_TRAILER_MAGIC : TCP_CHUNK_TAGGED_MAGIC)
                              : (k->trailer ? TCP_CHUNK_TRAILER_MAGIC : TCP_CHUNK_MAGIC),
                       (uint32_t)nd, (uint64_t)c, total};
    put(s, &h, sizeof h);
    if (tagged) {
      tcp_chunk_tag tag = {OPEN_TAG, t->epoch};
      put(s, &tag, sizeof tag);
    }
    for (int i = 0; i < nd; i++) {
      tcp_desc d = {(uint64_t)(uintptr_t)(t->base + k->d[i].off), k->d[i].len, k->d[i].count, k->d[i].stride};
      put(s, &d, sizeof d);
    }
    for (int i = 0; i < nd; i++) {
      k->d[i].payload_at = s->n;
      put_payload(s, r, k->d[i].len * k->d[i].count, 1, 127);
    }
    if (k->trailer) {
      k->tlen = 1 + below(r, KVF_ENGINE_MAX_TRAILER);
      k->tbytes[0] = 'C';
      for (size_t i = 1; i < k->tlen; i++) k->tbytes[i] = (unsigned char)next(r);
      tcp_trailer tr = {TCP_TRAILER_MAGIC, (uint32_t)k->tlen};
      put(s, &tr, sizeof tr);
      put(s, k->tbytes, k->tlen);
    }
  }
  pthread_mutex_lock(&t->mu);
  t->ntrailers = 0;
  pthread_mutex_unlock(&t->mu);
  int fd = raw_connect(kvf_engine_port(t->e));
  assert_true(fd >= 0);
  assert_int_equal(send_pieces(fd, s, r), 0);
  tcp_reply rep;
  assert_int_equal(recv(fd, &rep, sizeof rep, MSG_WAITALL), (ssize_t)sizeof rep);
  assert_int_equal(rep.status, 0);
  int32_t st[4];
  uint64_t seq[4];
  int got = read_acks(fd, nch, st, seq, ACK_WAIT_MS);
  close(fd);
  if (got != nch) fail_msg("clean stream %d: %d acks of %d", id, got, nch);
  for (int c = 0; c < nch; c++) {
    if (st[c] != 0 || seq[c] != (uint64_t)c)
      fail_msg("clean stream %d chunk %d: ack %d seq %llu", id, c, st[c], (unsigned long long)seq[c]);
  }
  /* Apply the stream to the shadow, chunk by chunk, and compare. */
  for (int c = 0; c < nch; c++)
    for (int i = 0; i < ch[c].nd; i++) {
      const clean_desc *d = &ch[c].d[i];
      for (uint64_t j = 0; j < d->count; j++)
        memcpy(t->shadow + d->off + j * d->stride, s->b + d->payload_at + j * d->len, d->len);
    }
  kvf_engine_sync(t->e);
  if (memcmp(t->shadow, t->base, HALF)) {
    size_t at = 0;
    while (t->shadow[at] == t->base[at]) at++;
    fail_msg("clean stream %d: byte %zu of the clean half is %u, expected %u", id, at, t->base[at], t->shadow[at]);
  }
  pthread_mutex_lock(&t->mu);
  int want = 0;
  for (int c = 0; c < nch; c++) {
    if (!ch[c].trailer) continue;
    if (want >= t->ntrailers || t->trailer_len[want] != ch[c].tlen ||
        memcmp(t->trailers[want], ch[c].tbytes, ch[c].tlen)) {
      pthread_mutex_unlock(&t->mu);
      fail_msg("clean stream %d chunk %d: its trailer did not arrive whole and in order", id, c);
    }
    want++;
  }
  int extra = t->ntrailers - want;
  pthread_mutex_unlock(&t->mu);
  if (extra) fail_msg("clean stream %d: %d trailers more than it sent", id, extra);
}

/* ---- hostile streams: into the second half, outside the region, or broken ---- */

/* One descriptor: in the second half (whole), or one of the ways to reach
 * outside the region (refused). Never anywhere in the first half. */
static tcp_desc hostile_desc(const target *t, rng *r, int *in_range) {
  uint64_t base = (uint64_t)(uintptr_t)t->base;
  uint64_t len = 1 + below(r, chance(r, 10) ? 70000 : 4096), count = 1 + below(r, 3);
  uint64_t stride = chance(r, 15) ? below(r, len + 1) : len + below(r, 64); /* overlapping at times */
  *in_range = 0;
  switch (below(r, 12)) {
    case 0: return (tcp_desc){base + REGION - len / 2, len, 1, 0}; /* runs past the end */
    case 1: return (tcp_desc){base - 8, 16, 1, 0};                 /* starts before it */
    case 2: return (tcp_desc){next(r), len, 1, 0};                 /* anywhere */
    case 3: return (tcp_desc){base + HALF, 8, 1ull << 40, 8};      /* huge count */
    case 4: return (tcp_desc){base + HALF, 1ull << 62, 1, 0};      /* huge length */
    case 5: return (tcp_desc){base + REGION - 16, 8, 3, 8};        /* the last repeat runs past */
    default: break;
  }
  uint64_t extent = (count - 1) * stride + len;
  if (extent > HALF) count = 1, extent = len;
  *in_range = 1;
  return (tcp_desc){base + HALF + below(r, HALF - extent + 1), len, count, stride};
}

static uint64_t sum_bytes(const tcp_desc *d, int n) {
  uint64_t total = 0;
  for (int i = 0; i < n; i++) {
    uint64_t b;
    if (__builtin_mul_overflow(d[i].len, d[i].count, &b) || __builtin_add_overflow(total, b, &total))
      return UINT64_MAX;
  }
  return total;
}

/* Send a hostile stream (cut anywhere at times) on a new connection, read
 * the answers for a while or not at all, close. */
static void send_hostile(target *t, rng *r, stream *s) {
  if (chance(r, 10)) s->n = below(r, s->n + 1);
  int fd = raw_connect(kvf_engine_port(t->e));
  if (fd < 0) return;
  if (!send_pieces(fd, s, r) && chance(r, 50)) drain(fd, 200);
  close(fd);
}

static void hostile_stream(target *t, rng *r, stream *s) {
  static const uint32_t magics[] = {TCP_CHUNK_MAGIC, TCP_CHUNK_TRAILER_MAGIC, TCP_CHUNK_TAGGED_MAGIC,
                                    TCP_CHUNK_TAGGED_TRAILER_MAGIC};
  s->n = 0;
  switch (below(r, 16)) {
    case 0: put_hello(s, 0xdeadbeef, TCP_PROTO_VERSION, TOKEN, strlen(TOKEN)); break;
    case 1: put_hello(s, TCP_HELLO_MAGIC, TCP_PROTO_VERSION + 1, TOKEN, strlen(TOKEN)); break;
    case 2: put_hello(s, TCP_HELLO_MAGIC, TCP_PROTO_VERSION, "wrong!", 6); break;
    case 3: put_hello(s, TCP_HELLO_MAGIC, TCP_PROTO_VERSION, "", 0); break;
    case 4: {
      tcp_hello h = {TCP_HELLO_MAGIC, TCP_PROTO_VERSION, 0, TCP_MAX_TOKEN + 1 + (uint32_t)below(r, 1u << 30), 0};
      put(s, &h, sizeof h);
      break;
    }
    case 5: {
      /* A UCX rendezvous, in read mode or not (hello flags). */
      tcp_hello h = {TCP_UCX_HELLO_MAGIC, chance(r, 10) ? TCP_PROTO_VERSION : TCP_UCX_PROTO_VERSION,
                     chance(r, 50) ? TCP_HELLO_CAN_READ : 0, (uint32_t)strlen(TOKEN), 0};
      put(s, &h, sizeof h);
      put(s, TOKEN, strlen(TOKEN));
    }
#ifdef KVF_HAVE_UCX
      /* Requests and acks with random fields, trailers of any length, and
       * read mode's messages: writer infos, ready notices and clock answers
       * with random fields (an engine without UCX answers the hello with
       * KVF_ESTATE). */
      if (chance(r, 70)) {
        static const uint32_t req_magics[] = {UCX_REQ_MAGIC,      UCX_ACK_MAGIC,    UCX_FENCE_ACK_MAGIC,
                                              UCX_TRAILER_MAGIC,  UCX_NOTICE_MAGIC, UCX_INFO_MAGIC,
                                              UCX_CLOCK_ANS_MAGIC};
        for (int i = 0, n = 1 + (int)below(r, 6); i < n; i++) {
          uint32_t magic = chance(r, 10) ? (uint32_t)next(r) : req_magics[below(r, 7)];
          if (magic == UCX_NOTICE_MAGIC) {
            ucx_notice nt = {magic,
                             (uint32_t)below(r, 5),
                             next(r),
                             chance(r, 50) ? OPEN_TAG : next(r),
                             next(r),
                             (int64_t)next(r),
                             (int64_t)below(r, 1ull << 40),
                             (uint32_t)below(r, 64),
                             0};
            put(s, &nt, sizeof nt);
            for (uint32_t k = 0; k < nt.ndesc; k++) {
              kvf_write d = {next(r),
                             (uint64_t)(uintptr_t)t->base + below(r, 2 * HALF),
                             1 + below(r, 8192),
                             below(r, 3),
                             next(r),
                             below(r, 8192)};
              put(s, &d, sizeof d);
            }
            unsigned char tb[64];
            memset(tb, 'N', sizeof tb);
            put(s, tb, chance(r, 10) ? below(r, nt.tlen + 1) : nt.tlen);
            continue;
          }
          if (magic == UCX_INFO_MAGIC) { /* a writer info with random fields and a garbage body */
            ucx_info_hdr ih;
            memset(&ih, 0, sizeof ih);
            ih.magic = magic, ih.nregions = (uint32_t)below(r, 4), ih.gen = next(r);
            ih.addr_len = (uint32_t)below(r, 256), ih.body_len = (uint32_t)below(r, 512);
            ih.flags = chance(r, 80) ? UCX_INFO_WRITER : (uint32_t)next(r);
            memset(ih.host_id, 'h', sizeof ih.host_id - 1);
            put(s, &ih, sizeof ih);
            unsigned char body[512];
            for (size_t k = 0; k < sizeof body; k++) body[k] = (unsigned char)next(r);
            /* A UCX worker address is parsed by UCX, which aborts on a
             * malformed one: the target refuses one whose header byte is not
             * its own (ucx_read.c); a garbage address behind a valid header
             * byte is out of this test's reach (README, threat model). */
            body[0] = (unsigned char)(t->ucx_addr_byte + 1 + below(r, 255));
            put(s, body, chance(r, 10) ? below(r, ih.body_len + 1) : ih.body_len);
            continue;
          }
          if (magic == UCX_CLOCK_ANS_MAGIC) {
            ucx_clock_ans a = {magic, 0, (int64_t)next(r), (int64_t)next(r)};
            put(s, &a, sizeof a);
            continue;
          }
          ucx_req q = {magic, 0, next(r)};
          unsigned char tb[KVF_ENGINE_MAX_TRAILER + 64];
          if (q.magic == UCX_TRAILER_MAGIC) q.reserved = (uint32_t)below(r, sizeof tb + 1);
          put(s, &q, sizeof q);
          if (q.magic == UCX_TRAILER_MAGIC) {
            memset(tb, 'H', sizeof tb);
            put(s, tb, chance(r, 10) ? below(r, q.reserved + 1) : q.reserved);
          }
        }
        send_hostile(t, r, s);
        return;
      }
#endif
      break;
    default: put_hello(s, TCP_HELLO_MAGIC, TCP_PROTO_VERSION, TOKEN, strlen(TOKEN)); break;
  }
  int nch = 1 + (int)below(r, 4);
  for (int c = 0; c < nch && s->n < MAX_STREAM / 2; c++) {
    uint32_t magic = chance(r, 5) ? (uint32_t)next(r) : magics[below(r, 4)];
    int tagged = magic == TCP_CHUNK_TAGGED_MAGIC || magic == TCP_CHUNK_TAGGED_TRAILER_MAGIC;
    int trailer = magic == TCP_CHUNK_TRAILER_MAGIC || magic == TCP_CHUNK_TAGGED_TRAILER_MAGIC;
    tcp_desc d[8];
    int nd = 1 + (int)below(r, 8), all_in = 1;
    for (int i = 0; i < nd; i++) {
      int in;
      d[i] = hostile_desc(t, r, &in);
      all_in &= in;
    }
    uint64_t total = sum_bytes(d, nd);
    uint32_t ndesc = (uint32_t)nd;
    switch (below(r, 10)) {
      case 0: total += 1; break;
      case 1: total -= 1; break;
      case 2: total = next(r); break;
      case 3: ndesc = chance(r, 50) ? 0 : TCP_MAX_DESC + 1 + (uint32_t)below(r, 1000); break;
      default: break;
    }
    tcp_chunk_hdr h = {magic, ndesc, next(r), total};
    put(s, &h, sizeof h);
    if (tagged) {
      tcp_chunk_tag tag = {OPEN_TAG + 1 + below(r, 1000), next(r)};                   /* a fence never opened */
      if (chance(r, 30)) tag.tag = OPEN_TAG, tag.epoch = t->epoch + 1 + below(r, 10); /* a later epoch */
      put(s, &tag, sizeof tag);
    }
    put(s, d, (size_t)nd * sizeof d[0]);
    /* The payload: what the header claims, or part of it when that is more
     * than this stream holds (then the stream ends there). */
    uint64_t room = MAX_STREAM - s->n - 2048;
    int whole = total <= room && total <= (256u << 10);
    uint64_t bytes = whole ? total : below(r, room < (64u << 10) ? room : (64u << 10));
    if (tagged) put_payload(s, r, bytes, FENCED_VALUE_MIN, 0xff - FENCED_VALUE_MIN);
    else put_payload(s, r, bytes, 1, 127);
    if (!whole) break;
    if (trailer) {
      unsigned char tb[KVF_ENGINE_MAX_TRAILER + 64];
      tcp_trailer tr = {chance(r, 10) ? (uint32_t)next(r) : TCP_TRAILER_MAGIC,
                        (uint32_t)below(r, KVF_ENGINE_MAX_TRAILER + 1)};
      if (chance(r, 15))
        tr.len = KVF_ENGINE_MAX_TRAILER + 1 + (uint32_t)below(r, sizeof tb - KVF_ENGINE_MAX_TRAILER);
      for (size_t i = 0; i < tr.len; i++) tb[i] = (unsigned char)next(r);
      if (tr.len) tb[0] = tagged ? 'F' : 'H';
      put(s, &tr, sizeof tr);
      put(s, tb, chance(r, 5) ? below(r, tr.len + 1) : tr.len);
    }
    (void)all_in;
  }
  send_hostile(t, r, s);
}

typedef struct hostile_arg {
  target *t;
  uint64_t seed;
  atomic_int stop;
  atomic_int streams;
} hostile_arg;

static void *hostile_main(void *p) {
  hostile_arg *a = p;
  rng r = {a->seed ^ 0x5eed};
  stream s = {malloc(MAX_STREAM), 0};
  while (!atomic_load(&a->stop) && a->streams < 5000) {
    hostile_stream(a->t, &r, &s);
    a->streams++;
  }
  free(s.b);
  return NULL;
}

static int legit_write(target *t, unsigned char value) {
  kvf_engine_config cfg;
  kvf_engine_config_init(&cfg);
  cfg.auth_token = TOKEN;
  kvf_engine *w = NULL;
  assert_int_equal(kvf_engine_create(&cfg, &w), 0);
  static unsigned char src[4096];
  memset(src, value, sizeof src);
  assert_int_equal(kvf_engine_register(w, src, sizeof src), 0);
  kvf_write wr = {.src = (uint64_t)(uintptr_t)src, .dst = (uint64_t)(uintptr_t)t->base, .len = sizeof src};
  int rc = kvf_engine_write(w, kvf_engine_session_id(t->e), &wr, 1);
  kvf_engine_destroy(w);
  kvf_engine_sync(t->e);
  return rc ? rc : memcmp(t->base, src, sizeof src) ? -1000 : 0;
}

/* A target with its region registered, the OPEN_TAG fence open and the
 * trailer callback set. */
static target *target_new(void) {
  target *t = calloc(1, sizeof *t);
  pthread_mutex_init(&t->mu, NULL);
  kvf_engine_config cfg;
  kvf_engine_config_init(&cfg);
  cfg.auth_token = TOKEN;
  cfg.timeout_ms = 2000;
  assert_int_equal(kvf_engine_create(&cfg, &t->e), 0);
#ifdef KVF_HAVE_UCX
  if (t->e->ucx) t->ucx_addr_byte = *(const unsigned char *)((ucx_state *)t->e->ucx)->addr;
#endif
  t->map = mmap(NULL, REGION + 2 * GUARD, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  assert_true(t->map != MAP_FAILED);
  memset(t->map, CANARY, REGION + 2 * GUARD);
  t->base = t->map + GUARD;
  memset(t->base, 0, REGION);
  assert_int_equal(kvf_engine_register(t->e, t->base, REGION), 0);
  assert_int_equal(kvf_engine_fence_open(t->e, OPEN_TAG, &t->epoch), 0);
  assert_int_equal(kvf__engine_on_trailer(t->e, on_trailer, t), 0);
  return t;
}

static void target_free(target *t) {
  kvf__engine_off_trailer(t->e, t);
  kvf_engine_destroy(t->e);
  munmap(t->map, REGION + 2 * GUARD);
  pthread_mutex_destroy(&t->mu);
  free(t);
}

static void random_streams_do_no_harm(void **state) {
  (void)state;
  const char *env = getenv("KVF_TEST_SEED");
  uint64_t seed = env ? strtoull(env, NULL, 0) : 1;
  env = getenv("KVF_TEST_STREAMS");
  int nclean = env ? atoi(env) : 150;
  fprintf(stderr, "seed %llu (KVF_TEST_SEED), %d clean streams (KVF_TEST_STREAMS)\n", (unsigned long long)seed,
          nclean);
  target *t = target_new();
  hostile_arg ha = {.t = t, .seed = seed};
  pthread_t th;
  pthread_create(&th, NULL, hostile_main, &ha);
  rng r = {seed};
  stream s = {malloc(MAX_STREAM), 0};
  for (int i = 0; i < nclean; i++) clean_stream(t, &r, i, &s);
  /* The hostile thread runs at least as many streams as the clean ones, and
   * on until each kind of rejection happened (how far the engine reads a
   * stream the writer closes early depends on timing), 30 s at most. */
  kvf_engine_stats st;
  for (int i = 0; i < 3000; i++) {
    kvf_engine_get_stats(t->e, &st);
    if (ha.streams >= nclean && st.auth_refused && st.protocol_errors && st.batches_refused && st.chunks_fenced)
      break;
    usleep(10000);
  }
  atomic_store(&ha.stop, 1);
  pthread_join(th, NULL);
  free(s.b);

  kvf_engine_sync(t->e);
  for (size_t i = 0; i < GUARD; i++) {
    assert_int_equal(t->map[i], CANARY);
    assert_int_equal(t->map[GUARD + REGION + i], CANARY);
  }
  for (size_t i = 0; i < REGION; i++)
    if (t->base[i] >= FENCED_VALUE_MIN)
      fail_msg("byte %zu = %u: a chunk for an unopened fence landed", i, t->base[i]);
  assert_int_equal(memcmp(t->shadow, t->base, HALF), 0);
  kvf_engine_get_stats(t->e, &st);
  fprintf(stderr,
          "%d hostile streams: auth_refused %llu protocol_errors %llu batches_refused %llu chunks_fenced %llu "
          "batches_received %llu; trailers from fenced chunks %d\n",
          atomic_load(&ha.streams), (unsigned long long)st.auth_refused, (unsigned long long)st.protocol_errors,
          (unsigned long long)st.batches_refused, (unsigned long long)st.chunks_fenced,
          (unsigned long long)st.batches_received, t->fenced_trailers);
  assert_int_equal(t->fenced_trailers, 0);
  /* The generator reached every kind of rejection. */
  assert_true(st.auth_refused > 0 && st.protocol_errors > 0 && st.batches_refused > 0 && st.chunks_fenced > 0);
  assert_int_equal(legit_write(t, 0x42), 0);
  target_free(t);
}

/* A writer sends a tagged chunk's payload and holds its trailer back: the
 * pair's close returns at once (the trailer is read outside the pair, and
 * a close does not wait for it), and the trailer that comes after the
 * close is not handed over (it used to hold the close until the engine's
 * timeout, then be handed over anyway). */
static void trailer_held_back_does_not_hold_a_close(void **state) {
  (void)state;
  target *t = target_new();
  stream s = {malloc(4096), 0};
  put_hello(&s, TCP_HELLO_MAGIC, TCP_PROTO_VERSION, TOKEN, strlen(TOKEN));
  tcp_chunk_hdr h = {TCP_CHUNK_TAGGED_TRAILER_MAGIC, 1, 1, 64};
  put(&s, &h, sizeof h);
  tcp_chunk_tag tag = {OPEN_TAG, t->epoch};
  put(&s, &tag, sizeof tag);
  tcp_desc d = {(uint64_t)(uintptr_t)t->base, 64, 1, 0};
  put(&s, &d, sizeof d);
  unsigned char payload[64];
  memset(payload, 7, sizeof payload);
  put(&s, payload, sizeof payload);
  int fd = raw_connect(kvf_engine_port(t->e));
  assert_true(fd >= 0);
  assert_int_equal(send(fd, s.b, s.n, MSG_NOSIGNAL), (ssize_t)s.n);
  kvf__fence_stats fs = {0};
  for (int i = 0; i < 2000 && fs.bytes < 64; i++) { /* the payload landed */
    usleep(1000);
    assert_int_equal(kvf__engine_fence_stats(t->e, OPEN_TAG, t->epoch, &fs), 0);
  }
  assert_int_equal(fs.bytes, 64);
  kvf_engine_sync(t->e);
  assert_int_equal(t->base[63], 7);
  usleep(50000); /* the receiver now waits for the trailer */
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  assert_int_equal(kvf_engine_fence_close(t->e, OPEN_TAG, t->epoch, 1500), 0);
  clock_gettime(CLOCK_MONOTONIC, &t1);
  double waited = (double)(t1.tv_sec - t0.tv_sec) + (double)(t1.tv_nsec - t0.tv_nsec) / 1e9;
  assert_true(waited < 1.0); /* the close's own limit is 1.5 s */
  unsigned char tb[sizeof(tcp_trailer) + 1];
  tcp_trailer tr = {TCP_TRAILER_MAGIC, 1};
  memcpy(tb, &tr, sizeof tr);
  tb[sizeof tr] = 'F'; /* counted in fenced_trailers: must never arrive */
  assert_int_equal(send(fd, tb, sizeof tb, MSG_NOSIGNAL), (ssize_t)sizeof tb);
  tcp_reply rep;
  assert_int_equal(recv(fd, &rep, sizeof rep, MSG_WAITALL), (ssize_t)sizeof rep);
  assert_int_equal(rep.status, 0);
  int32_t st[1];
  uint64_t seq[1];
  assert_int_equal(read_acks(fd, 1, st, seq, ACK_WAIT_MS), 1);
  pthread_mutex_lock(&t->mu);
  int fenced = t->fenced_trailers;
  pthread_mutex_unlock(&t->mu);
  assert_int_equal(fenced, 0);
  close(fd);
  free(s.b);
  target_free(t);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(random_streams_do_no_harm),
      cmocka_unit_test(trailer_held_back_does_not_hold_a_close),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

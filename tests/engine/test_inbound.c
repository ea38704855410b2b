/* Hostile and slow peers against the engine's inbound TCP path (issue 13,
 * defects 3 and 4): raw sockets on 127.0.0.1 that trickle a hello, idle
 * after one, or trickle a payload, while legitimate writers and the owner's
 * register/unregister must go on. Every case is bounded by the engine's named
 * deadlines (5 s hello, the engine timeout for a chunk). */
#include <dirent.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>

#include "procfs.h"

#include "engine/engine_internal.h"
#include "engine/tcp_int.h"
#include "engine/tcp_proto.h"
#include "kvferry.h"

#define FLOOD 300 /* hostile connections, over the default max_inbound_conns (256) */
#define HELLO_DEADLINE_S (TCP_HELLO_DEADLINE_MS / 1000)
#define CHUNK_TIMEOUT_MS 4000
/* "Promptly": what the slow peer must not make anyone wait for is the 4 s
 * chunk deadline; 2 s leaves room for a loaded machine below it. */
#define PROMPT_S 2.0
#define LOAD_SLACK_S 2.5 /* on a deadline a cut must come by (two ctest -j2 on two cores) */

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

static kvf_engine *make_engine(int timeout_ms, const char *token) {
  kvf_engine_config cfg;
  kvf_engine_config_init(&cfg);
  cfg.timeout_ms = timeout_ms;
  cfg.auth_token = token ? token : "";
  kvf_engine *e = NULL;
  assert_int_equal(kvf_engine_create(&cfg, &e), 0);
  return e;
}

static int raw_connect(uint16_t port) {
  int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(port), .sin_addr.s_addr = htonl(0x7f000001)};
  if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a)) {
    if (fd >= 0) close(fd);
    return -1;
  }
  return fd;
}

/* A legitimate writer on fresh connections: one engine per write, so the
 * connection must be admitted while the flood holds the target. */
static int legit_write(kvf_engine *target, unsigned char *dst, unsigned char value, const char *token) {
  kvf_engine *w = make_engine(CHUNK_TIMEOUT_MS, token);
  static unsigned char src[16];
  memset(src, value, sizeof src);
  assert_int_equal(kvf_engine_register(w, src, sizeof src), 0);
  kvf_write wr = {.src = (uint64_t)(uintptr_t)src, .dst = (uint64_t)(uintptr_t)dst, .len = sizeof src};
  int rc = kvf_engine_write(w, kvf_engine_session_id(target), &wr, 1);
  kvf_engine_destroy(w);
  kvf_engine_sync(target);
  if (!rc && dst[0] != value) rc = -1000;
  return rc;
}

/* ---- a flood of connections that send one byte per second ---- */

typedef struct flood {
  uint16_t port;
  int complete_hello; /* 1: send a whole hello then idle; 0: trickle a hello */
  double run_s;
  atomic_int stop;
  atomic_int ready; /* every connection is open */
  int opened, closed;
  double longest; /* seconds from a connection's open to its close by the peer */
  int fds[FLOOD];
  double opened_at[FLOOD];
} flood;

static int peer_closed(int fd) {
  char b[64];
  ssize_t r = recv(fd, b, sizeof b, MSG_DONTWAIT);
  if (r == 0) return 1;
  if (r < 0) return errno != EAGAIN && errno != EWOULDBLOCK;
  return 0; /* a hello reply: still open */
}

static void wait_ready(flood *f) {
  while (!atomic_load(&f->ready)) usleep(10000);
  usleep(300000); /* and accepted */
}

static void *flood_main(void *arg) {
  flood *f = arg;
  int *fds = f->fds;
  static const tcp_hello hello = {TCP_HELLO_MAGIC, TCP_PROTO_VERSION, 0, 0, 0};
  double t0 = now_s(), next_byte = t0;
  int sent = 0;
  for (int i = 0; i < FLOOD; i++) {
    fds[i] = raw_connect(f->port);
    f->opened_at[i] = now_s();
    if (fds[i] >= 0) f->opened++;
    if (fds[i] >= 0 && f->complete_hello) send(fds[i], &hello, sizeof hello, MSG_NOSIGNAL);
  }
  atomic_store(&f->ready, 1);
  t0 = next_byte = now_s(); /* run_s counts from here */
  while (!atomic_load(&f->stop) && now_s() - t0 < f->run_s) {
    int trickle = !f->complete_hello && now_s() >= next_byte && sent < (int)sizeof hello - 1;
    for (int i = 0; i < FLOOD; i++) {
      if (fds[i] < 0) continue;
      if (trickle) send(fds[i], (const char *)&hello + sent, 1, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (peer_closed(fds[i])) {
        close(fds[i]);
        fds[i] = -1;
        f->closed++;
        if (now_s() - f->opened_at[i] > f->longest) f->longest = now_s() - f->opened_at[i];
      }
    }
    if (trickle) {
      sent++;
      next_byte += 1.0;
    }
    usleep(50000);
  }
  for (int i = 0; i < FLOOD; i++)
    if (fds[i] >= 0) close(fds[i]);
  return NULL;
}

/* Defect 3: with a token set, 300 connections trickling a hello one byte a
 * second hold no slot beyond the hello deadline, and a legitimate peer
 * connects and writes throughout. */
static void trickled_hellos_cannot_hold_slots(void **state) {
  (void)state;
  kvf_engine *target = make_engine(CHUNK_TIMEOUT_MS, "tok");
  unsigned char *buf = calloc(1, 4096);
  assert_int_equal(kvf_engine_register(target, buf, 4096), 0);
  flood f = {.port = kvf_engine_port(target), .complete_hello = 0, .run_s = HELLO_DEADLINE_S + 6};
  pthread_t th;
  pthread_create(&th, NULL, flood_main, &f);
  wait_ready(&f);
  for (int i = 1; i <= 5; i++) {
    assert_int_equal(legit_write(target, buf + 64 * i, (unsigned char)i, "tok"), 0);
    usleep(700000);
  }
  pthread_join(th, NULL);
  assert_int_equal(f.opened, FLOOD);
  printf("trickled hellos: %d of %d cut, longest held %.2f s (hello deadline %d s)\n", f.closed, FLOOD, f.longest,
         HELLO_DEADLINE_S);
  assert_int_equal(f.closed, FLOOD);                        /* every trickler cut ... */
  assert_true(f.longest < HELLO_DEADLINE_S + LOAD_SLACK_S); /* ... by the hello deadline, bytes or not */
  kvf_engine_stats st;
  kvf_engine_get_stats(target, &st);
  assert_true(st.conns_timed_out + st.conns_evicted >= FLOOD);
  assert_int_equal(st.batches_received, 5);
  kvf_engine_destroy(target);
  free(buf);
}

/* Defect 3, no token: 300 connections that complete a hello and then never
 * send a chunk are evicted (oldest idle first) to admit a real writer.
 *
 * The flood holds its connections until the writers are done (f.stop), not
 * for a fixed time: with a fixed 3 s a loaded machine could reach the
 * writers after the flood had closed its sockets, so the first writer took
 * a free slot, nothing was evicted for it and the count came up one short. */
static void idle_connections_evicted_for_writers(void **state) {
  (void)state;
  kvf_engine *target = make_engine(CHUNK_TIMEOUT_MS, NULL);
  unsigned char *buf = calloc(1, 4096);
  assert_int_equal(kvf_engine_register(target, buf, 4096), 0);
  flood f = {.port = kvf_engine_port(target), .complete_hello = 1, .run_s = 90}; /* run_s: only a backstop */
  pthread_t th;
  pthread_create(&th, NULL, flood_main, &f);
  wait_ready(&f);
  kvf_engine_config defaults;
  kvf_engine_config_init(&defaults);
  int slots = defaults.max_inbound_conns;
  assert_true(slots < FLOOD);
  kvf_engine_stats st;
  /* The target has taken the whole flood in: its excess was evicted. */
  double t0 = now_s();
  do {
    kvf_engine_get_stats(target, &st);
    if (st.conns_evicted >= FLOOD - (uint64_t)slots) break;
    usleep(50000);
  } while (now_s() - t0 < 30);
  assert_true(st.conns_evicted >= FLOOD - (uint64_t)slots);
  uint64_t flood_evicted = st.conns_evicted;
  for (int i = 1; i <= 3; i++)
    assert_int_equal(legit_write(target, buf + 64 * i, (unsigned char)(10 + i), NULL), 0);
  kvf_engine_get_stats(target, &st);
  atomic_store(&f.stop, 1);
  pthread_join(th, NULL);
  assert_true(st.conns_evicted > flood_evicted); /* the first writer's slot came from the flood */
  kvf_engine_get_stats(target, &st);
  /* The flood's excess, then at least one more for the first writer (later
   * ones may reuse the slot the previous writer freed). */
  assert_true(st.conns_evicted >= FLOOD - (uint64_t)slots + 1);
  assert_int_equal(st.conns_refused, 0);
  assert_int_equal(st.batches_received, 3);
  kvf_engine_destroy(target);
  free(buf);
}

/* ---- idle connections cost no thread ---- */

static int count_threads(void) {
  int n = kvf_test_count_threads();
  assert_true(n > 0);
  return n;
}

/* 64 connections that finished their hello and stay idle add at most 2
 * threads to the target (its pool's core workers) once the workers that
 * took their hellos retired, and a writer still gets through. */
static void idle_connections_hold_no_thread(void **state) {
  (void)state;
  enum { N = 64 };
  kvf_engine *target = make_engine(CHUNK_TIMEOUT_MS, NULL);
  unsigned char *buf = calloc(1, 4096);
  assert_int_equal(kvf_engine_register(target, buf, 4096), 0);
  int before = count_threads();
  static const tcp_hello hello = {TCP_HELLO_MAGIC, TCP_PROTO_VERSION, 0, 0, 0};
  int fds[N];
  for (int i = 0; i < N; i++) {
    fds[i] = raw_connect(kvf_engine_port(target));
    assert_true(fds[i] >= 0);
    assert_int_equal(send(fds[i], &hello, sizeof hello, MSG_NOSIGNAL), (ssize_t)sizeof hello);
  }
  for (int i = 0; i < N; i++) { /* each one's hello was answered */
    tcp_reply rep;
    struct pollfd pf = {.fd = fds[i], .events = POLLIN};
    assert_int_equal(poll(&pf, 1, 10000), 1);
    assert_int_equal(recv(fds[i], &rep, sizeof rep, MSG_WAITALL), (ssize_t)sizeof rep);
    assert_int_equal(rep.status, 0);
  }
  int after = count_threads();
  for (double t0 = now_s(); after > before + 2 && now_s() - t0 < 6; after = count_threads()) usleep(100000);
  printf("threads: %d before, %d with %d idle connections\n", before, after, N);
  assert_true(after <= before + 2);
  assert_int_equal(legit_write(target, buf, 7, NULL), 0);
  for (int i = 0; i < N; i++) assert_false(peer_closed(fds[i])); /* none was cut: slots were free */
  for (int i = 0; i < N; i++) close(fds[i]);
  kvf_engine_destroy(target);
  free(buf);
}

/* An outgoing connection's threads (kvf-tcp-write, kvf-tcp-ack) end once
 * it has been idle TCP_CONN_IDLE_MS and start again with the next chunk, so
 * idle peers hold no thread on the writer either; a connection the peer
 * closed meanwhile (evicted to make room for another writer) is found at
 * the next submit, which connects again rather than failing the chunk. */
static int tcp_out_threads(void) {
  int nw = 0, na = 0;
  kvf_test_thread_sleeps("kvf-tcp-write", &nw);
  kvf_test_thread_sleeps("kvf-tcp-ack", &na);
  return nw + na;
}

static int wait_tcp_out_threads_gone(void) {
  int n = tcp_out_threads();
  for (double t0 = now_s(); n && now_s() - t0 < TCP_CONN_IDLE_MS / 1000.0 + 10; n = tcp_out_threads())
    usleep(100000);
  return n;
}

static void idle_outgoing_connections_hold_no_thread(void **state) {
  (void)state;
  enum { N = 8, BIG = 2 << 20 }; /* BIG: past the inline size, so the writer thread sends it */
  kvf_engine *w = make_engine(CHUNK_TIMEOUT_MS, NULL);
  unsigned char *src = malloc(BIG);
  assert_non_null(src);
  assert_int_equal(kvf_engine_register(w, src, BIG), 0);
  kvf_engine *t[N];
  unsigned char *dst[N];
  for (int i = 0; i < N; i++) {
    t[i] = make_engine(CHUNK_TIMEOUT_MS, NULL);
    assert_non_null(dst[i] = calloc(1, BIG));
    assert_int_equal(kvf_engine_register(t[i], dst[i], BIG), 0);
  }
  for (int round = 1; round <= 2; round++) { /* the second after every thread ended */
    memset(src, 0x40 + round, BIG);
    for (int i = 0; i < N; i++) {
      kvf_write wr = {.src = (uint64_t)(uintptr_t)src, .dst = (uint64_t)(uintptr_t)dst[i], .len = BIG};
      assert_int_equal(kvf_engine_write(w, kvf_engine_session_id(t[i]), &wr, 1), 0);
      kvf_engine_sync(t[i]);
      assert_int_equal(dst[i][0], 0x40 + round);
      assert_int_equal(dst[i][BIG - 1], 0x40 + round);
    }
    int left = wait_tcp_out_threads_gone();
    printf("round %d: outgoing connection threads left after idle: %d\n", round, left);
    assert_int_equal(left, 0);
  }
  for (int i = 0; i < N; i++) kvf_engine_destroy(t[i]), free(dst[i]);

  /* Closed by the peer while idle: a target with two slots (a writer's
   * conns_per_peer) evicts the idle connections for newcomers; the writer's
   * next chunk goes on a new connection. */
  kvf_engine_config tc;
  kvf_engine_config_init(&tc);
  tc.timeout_ms = CHUNK_TIMEOUT_MS;
  tc.max_inbound_conns = 2;
  kvf_engine *one = NULL;
  assert_int_equal(kvf_engine_create(&tc, &one), 0);
  unsigned char *buf = calloc(1, 4096);
  assert_int_equal(kvf_engine_register(one, buf, 4096), 0);
  kvf_write small = {.src = (uint64_t)(uintptr_t)src, .dst = (uint64_t)(uintptr_t)buf, .len = 64};
  assert_int_equal(kvf_engine_write(w, kvf_engine_session_id(one), &small, 1), 0);
  assert_int_equal(wait_tcp_out_threads_gone(), 0);
  kvf_engine_stats st;
  kvf_engine_get_stats(one, &st);
  uint64_t evicted = st.conns_evicted;
  /* Two newcomers that finish their hello take the slots: ours are cut. */
  static const tcp_hello hello = {TCP_HELLO_MAGIC, TCP_PROTO_VERSION, 0, 0, 0};
  int raw[2];
  for (int i = 0; i < 2; i++) {
    assert_true((raw[i] = raw_connect(kvf_engine_port(one))) >= 0);
    assert_int_equal(send(raw[i], &hello, sizeof hello, MSG_NOSIGNAL), (ssize_t)sizeof hello);
  }
  for (double t0 = now_s(); now_s() - t0 < 10; usleep(20000)) {
    kvf_engine_get_stats(one, &st);
    if (st.conns_evicted >= evicted + 2) break;
  }
  assert_true(st.conns_evicted >= evicted + 2);
  memset(src, 0x77, 64);
  assert_int_equal(kvf_engine_write(w, kvf_engine_session_id(one), &small, 1), 0);
  kvf_engine_sync(one);
  assert_int_equal(buf[0], 0x77);
  for (int i = 0; i < 2; i++) close(raw[i]);
  kvf_engine_destroy(one);
  kvf_engine_destroy(w);
  free(buf);
  free(src);
}

/* ---- one peer that trickles a chunk's payload ---- */

typedef struct trickler {
  uint16_t port;
  uint64_t dst, len;
  uint64_t count, stride; /* the descriptor's repeat (0: 1) and stride */
  size_t piece;           /* bytes sent per period (0: 1) */
  double period_s, run_s;
  double started, cut_after; /* cut_after: seconds from the header to the peer's close, < 0 if never */
} trickler;

static void *trickler_main(void *arg) {
  trickler *t = arg;
  t->cut_after = -1;
  int fd = raw_connect(t->port);
  if (fd < 0) return NULL;
  tcp_hello h = {TCP_HELLO_MAGIC, TCP_PROTO_VERSION, 0, 0, 0};
  tcp_reply rep;
  send(fd, &h, sizeof h, MSG_NOSIGNAL);
  if (recv(fd, &rep, sizeof rep, MSG_WAITALL) != sizeof rep || rep.status) goto out;
  struct {
    tcp_chunk_hdr h;
    tcp_desc d;
  } msg = {{TCP_CHUNK_MAGIC, 1, 1, t->len * (t->count ? t->count : 1)},
           {t->dst, t->len, t->count ? t->count : 1, t->stride}};
  send(fd, &msg, sizeof msg, MSG_NOSIGNAL);
  t->started = now_s();
  size_t piece = t->piece ? t->piece : 1;
  unsigned char *bytes = malloc(piece);
  memset(bytes, 0x5a, piece);
  while (now_s() - t->started < t->run_s) {
    if (peer_closed(fd) || send(fd, bytes, piece, MSG_NOSIGNAL | MSG_DONTWAIT) < 0) {
      t->cut_after = now_s() - t->started;
      break;
    }
    usleep((useconds_t)(t->period_s * 1e6));
  }
  free(bytes);
out:
  close(fd);
  return NULL;
}

/* Defect 4: while one peer trickles a payload, register returns and another
 * peer's 16-byte write is acknowledged promptly; the trickler is cut at the
 * chunk deadline (the engine timeout), not kept alive by its bytes. */
static void slow_payload_stalls_nobody(void **state) {
  (void)state;
  kvf_engine *target = make_engine(CHUNK_TIMEOUT_MS, NULL);
  size_t len = 1u << 20;
  unsigned char *a = calloc(1, len), *b = calloc(1, len);
  assert_int_equal(kvf_engine_register(target, a, len), 0);
  trickler t = {.port = kvf_engine_port(target),
                .dst = (uint64_t)(uintptr_t)a,
                .len = 65536,
                .period_s = 0.05,
                .run_s = 2.0 * CHUNK_TIMEOUT_MS / 1000 + 2};
  pthread_t th;
  pthread_create(&th, NULL, trickler_main, &t);
  usleep(300000); /* the payload is trickling */
  double t0 = now_s();
  assert_int_equal(kvf_engine_register(target, b, len), 0);
  double reg_s = now_s() - t0;
  t0 = now_s();
  assert_int_equal(legit_write(target, a + len / 2, 0x77, NULL), 0);
  double write_s = now_s() - t0;
  assert_true(reg_s < PROMPT_S);
  assert_true(write_s < PROMPT_S);
  assert_int_equal(kvf_engine_unregister(target, b), 0);
  pthread_join(th, NULL);
  printf("slow payload: register %.1f ms, other peer's write %.1f ms, trickler cut after %.2f s (deadline %.1f "
         "s)\n",
         reg_s * 1e3, write_s * 1e3, t.cut_after, CHUNK_TIMEOUT_MS / 1000.0);
  assert_true(t.cut_after > CHUNK_TIMEOUT_MS / 1000.0 - 0.5);
  assert_true(t.cut_after < CHUNK_TIMEOUT_MS / 1000.0 + LOAD_SLACK_S);
  kvf_engine_stats st;
  kvf_engine_get_stats(target, &st);
  assert_int_equal(st.conns_timed_out, 1);
  assert_int_equal(st.batches_received, 1);
  kvf_engine_destroy(target);
  free(a);
  free(b);
}

/* A peer that keeps pace: every receive the target makes is filled at once
 * (512 one-byte pieces per 50 ms into registered memory; 64 KiB per 50 ms of
 * a refused chunk the target drains), so no read ever waits. It is still cut
 * at the chunk deadline, and the region it writes into can be unregistered
 * promptly meanwhile. */
static void paced_payload_cut_at_deadline(void **state) {
  (void)state;
  kvf_engine *target = make_engine(CHUNK_TIMEOUT_MS, NULL);
  size_t len = 1u << 20;
  unsigned char *a = calloc(1, len), *c = calloc(1, len);
  assert_int_equal(kvf_engine_register(target, a, len), 0);
  assert_int_equal(kvf_engine_register(target, c, len), 0);
  double run_s = 3.0 * CHUNK_TIMEOUT_MS / 1000 + 2;
  trickler t[3] = {
      /* into a: one byte repeated 2^40 times over the same address */
      {.port = kvf_engine_port(target),
       .dst = (uint64_t)(uintptr_t)a,
       .len = 1,
       .count = 1ull << 40,
       .piece = 512,
       .period_s = 0.05,
       .run_s = run_s},
      /* outside registered memory: refused, then drained */
      {.port = kvf_engine_port(target),
       .dst = 0x1000,
       .len = 1ull << 62,
       .piece = 65536,
       .period_s = 0.05,
       .run_s = run_s},
      /* into c, which is unregistered while the bytes come */
      {.port = kvf_engine_port(target),
       .dst = (uint64_t)(uintptr_t)c,
       .len = 1,
       .count = 1ull << 40,
       .piece = 512,
       .period_s = 0.05,
       .run_s = run_s},
  };
  pthread_t th[3];
  for (int i = 0; i < 3; i++) pthread_create(&th[i], NULL, trickler_main, &t[i]);
  usleep(500000);
  double t0 = now_s();
  assert_int_equal(kvf_engine_unregister(target, c), 0);
  double unreg_s = now_s() - t0;
  for (int i = 0; i < 3; i++) pthread_join(th[i], NULL);
  printf("paced peers cut after %.2f / %.2f / %.2f s (deadline %.1f s); unregister under one: %.1f ms\n",
         t[0].cut_after, t[1].cut_after, t[2].cut_after, CHUNK_TIMEOUT_MS / 1000.0, unreg_s * 1e3);
  assert_true(unreg_s < PROMPT_S);
  for (int i = 0; i < 3; i++) {
    assert_true(t[i].cut_after > 0);
    assert_true(t[i].cut_after < CHUNK_TIMEOUT_MS / 1000.0 + LOAD_SLACK_S);
  }
  kvf_engine_stats st;
  kvf_engine_get_stats(target, &st);
  assert_int_equal(st.conns_timed_out, 3);
  kvf_engine_destroy(target);
  free(a);
  free(c);
}

/* Unregistering the region a slow payload is landing in returns within about
 * a receive tick, and no byte lands in it afterwards. */
static void unregister_cuts_a_slow_write(void **state) {
  (void)state;
  kvf_engine *target = make_engine(CHUNK_TIMEOUT_MS, NULL);
  size_t len = 65536;
  unsigned char *c = calloc(1, len), snap[64];
  assert_int_equal(kvf_engine_register(target, c, len), 0);
  trickler t = {.port = kvf_engine_port(target),
                .dst = (uint64_t)(uintptr_t)c,
                .len = len,
                .period_s = 0.02,
                .run_s = 6.0}; /* longer than PROMPT_S: waiting for the writer would show */
  pthread_t th;
  pthread_create(&th, NULL, trickler_main, &t);
  usleep(400000);
  double t0 = now_s();
  assert_int_equal(kvf_engine_unregister(target, c), 0);
  double unreg_s = now_s() - t0;
  printf("unregister during a slow write: %.1f ms\n", unreg_s * 1e3);
  assert_true(unreg_s < PROMPT_S);
  kvf_engine_sync(target);
  assert_int_equal(c[0], 0x5a); /* some bytes had landed before */
  memcpy(snap, c, sizeof snap);
  pthread_join(th, NULL); /* the trickler goes on for another second */
  kvf_engine_sync(target);
  assert_memory_equal(snap, c, sizeof snap);
  kvf_engine_destroy(target);
  free(c);
}

/* ---- peer-chosen piece counts ---- */

typedef struct fence_closer {
  kvf_engine *e;
  uint64_t tag, epoch;
  atomic_int done;
  int rc;
} fence_closer;

static void *fence_closer_main(void *p) {
  fence_closer *c = p;
  c->rc = kvf_engine_fence_close(c->e, c->tag, c->epoch, 1000);
  atomic_store(&c->done, 1);
  return NULL;
}

static void send_all_or_fail(int fd, const void *p, size_t n) {
  assert_int_equal(send(fd, p, n, MSG_NOSIGNAL), (ssize_t)n);
}

/* A tagged chunk for an open, bounded fence whose one descriptor has length
 * 0 and 2^64-1 pieces of stride 0 (it adds up: total_bytes 0). The target
 * checks the pieces against the fence's bounds one by one under the fence
 * table's mutex: kvf_engine_fence_close (any room's) must still return
 * within its own timeout. */
static void tagged_piece_count_cannot_stall_fences(void **state) {
  (void)state;
  kvf_engine *e = make_engine(CHUNK_TIMEOUT_MS, NULL);
  static unsigned char mem[1 << 16];
  assert_int_equal(kvf_engine_register(e, mem, sizeof mem), 0);
  uint64_t epoch = 0;
  assert_int_equal(kvf_engine_fence_open(e, 5, &epoch), 0);
  static uint64_t bounds[2];
  bounds[0] = (uint64_t)(uintptr_t)mem;
  bounds[1] = 4096;
  assert_int_equal(kvf__engine_fence_bound(e, 5, epoch, bounds, 1), 0);
  int fd = raw_connect(kvf_engine_port(e));
  assert_true(fd >= 0);
  tcp_hello h = {TCP_HELLO_MAGIC, TCP_PROTO_VERSION, 0, 0, 0};
  tcp_chunk_hdr ch = {TCP_CHUNK_TAGGED_MAGIC, 1, 0, 0};
  tcp_chunk_tag tg = {5, epoch};
  tcp_desc d = {(uint64_t)(uintptr_t)mem, 0, UINT64_MAX, 0};
  send_all_or_fail(fd, &h, sizeof h);
  send_all_or_fail(fd, &ch, sizeof ch);
  send_all_or_fail(fd, &tg, sizeof tg);
  send_all_or_fail(fd, &d, sizeof d);
  usleep(300000); /* the target has the chunk */
  fence_closer c = {.e = e, .tag = 5, .epoch = epoch};
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, fence_closer_main, &c), 0);
  double t0 = now_s();
  while (!atomic_load(&c.done) && now_s() - t0 < 3.0) usleep(10000);
  if (!atomic_load(&c.done))
    fail_msg("kvf_engine_fence_close(timeout 1000 ms) still blocked after 3 s: one peer's descriptor count "
             "holds the fence table's lock");
  pthread_join(th, NULL);
  close(fd);
  kvf_engine_destroy(e);
}

/* A fake target that answers the hello, reads one chunk header and
 * acknowledges it at once, without reading the payload. */
typedef struct early_acker {
  int lfd;
  atomic_int stop;
} early_acker;

static void *early_acker_main(void *p) {
  early_acker *a = p;
  int fd = accept(a->lfd, NULL, NULL);
  if (fd < 0) return NULL;
  tcp_hello h;
  if (recv(fd, &h, sizeof h, MSG_WAITALL) != (ssize_t)sizeof h) goto out;
  tcp_reply rep = {TCP_HELLO_MAGIC, 0};
  send(fd, &rep, sizeof rep, MSG_NOSIGNAL);
  tcp_chunk_hdr ch;
  if (recv(fd, &ch, sizeof ch, MSG_WAITALL) != (ssize_t)sizeof ch) goto out;
  tcp_ack ack = {ch.seq, 0, TCP_ACK_MAGIC};
  send(fd, &ack, sizeof ack, MSG_NOSIGNAL);
  while (!atomic_load(&a->stop)) usleep(10000); /* never read the payload */
out:
  close(fd);
  return NULL;
}

/* A batch acknowledged by its target before the payload was sent (a
 * hostile or broken target that then stops reading) must still end by its
 * deadline: kvf_engine_write with timeout_ms 2000 returns within a few
 * seconds, and not with success. */
typedef struct bg_write {
  kvf_engine *w;
  const char *session;
  kvf_write wr;
  atomic_int done;
  int rc;
} bg_write;

static void *bg_write_main(void *p) {
  bg_write *b = p;
  b->rc = kvf_engine_write(b->w, b->session, &b->wr, 1);
  atomic_store(&b->done, 1);
  return NULL;
}

static void ack_before_payload_is_not_success(void **state) {
  (void)state;
  int lfd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(0x7f000001)};
  int small = 4096;
  setsockopt(lfd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
  assert_int_equal(bind(lfd, (struct sockaddr *)&a, sizeof a), 0);
  assert_int_equal(listen(lfd, 4), 0);
  socklen_t al = sizeof a;
  getsockname(lfd, (struct sockaddr *)&a, &al);
  early_acker ea = {.lfd = lfd};
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, early_acker_main, &ea), 0);
  kvf_engine_config cfg;
  kvf_engine_config_init(&cfg);
  cfg.timeout_ms = 2000;
  cfg.conns_per_peer = 1;
  cfg.auth_token = "";
  kvf_engine *w = NULL;
  assert_int_equal(kvf_engine_create(&cfg, &w), 0);
  size_t n = 64u << 20;
  unsigned char *src = malloc(n);
  assert_non_null(src);
  memset(src, 1, n);
  assert_int_equal(kvf_engine_register(w, src, n), 0);
  char session[64];
  snprintf(session, sizeof session, "127.0.0.1:%u", (unsigned)ntohs(a.sin_port));
  static bg_write b;
  b.w = w, b.session = session;
  b.wr = (kvf_write){.src = (uint64_t)(uintptr_t)src, .dst = 0x100000, .len = n};
  pthread_t wt;
  assert_int_equal(pthread_create(&wt, NULL, bg_write_main, &b), 0);
  double t0 = now_s();
  while (!atomic_load(&b.done) && now_s() - t0 < 8.0) usleep(10000);
  if (!atomic_load(&b.done))
    fail_msg("kvf_engine_write (engine timeout 2000 ms) has not returned after 8 s: the target acknowledged the "
             "chunk before reading its payload, then stopped reading");
  printf("kvf_engine_write -> %d (%s) after %.2f s\n", b.rc, kvf_strerror(b.rc), now_s() - t0);
  pthread_join(wt, NULL);
  atomic_store(&ea.stop, 1);
  kvf_engine_destroy(w);
  pthread_join(th, NULL);
  close(lfd);
  free(src);
  assert_int_not_equal(b.rc, 0);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(trickled_hellos_cannot_hold_slots),
      cmocka_unit_test(idle_connections_evicted_for_writers),
      cmocka_unit_test(slow_payload_stalls_nobody),
      cmocka_unit_test(unregister_cuts_a_slow_write),
      cmocka_unit_test(paced_payload_cut_at_deadline),
      cmocka_unit_test(idle_connections_hold_no_thread),
      cmocka_unit_test(idle_outgoing_connections_hold_no_thread),
      cmocka_unit_test(tagged_piece_count_cannot_stall_fences),
      cmocka_unit_test(ack_before_payload_is_not_success),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

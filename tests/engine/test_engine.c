/* Transfer engine tests. Peers are real processes (`kvferry-testpeer engine-peer`,
 * found through KVFERRY_TESTPEER) over 127.0.0.1, except where two engines in one
 * process are enough to show the behaviour. */
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>

#include "base/addr.h"
#include "base/clock.h"
#include "procfs.h"
#include "sockets.h"
#include "tools/pattern.h"
#include "tools/peer.h"
#include "engine/async.h"
#include "engine/engine_internal.h"
#include "kvferry.h"

#define PAGE 4096u
#define PEER_BYTES (16u << 20)

/* Slack for a loaded machine (two ctest -j2 on two cores) on top of a
 * deadline a failure must surface by. */
#define LOAD_SLACK_S 4.0

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

typedef struct fixture {
  engine_peer peer;
  kvf_engine *e;
  unsigned char *pool;
  size_t pool_bytes;
} fixture;

static kvf_engine *make_engine(int timeout_ms, const char *token) {
  kvf_engine_config cfg;
  kvf_engine_config_init(&cfg);
  cfg.timeout_ms = timeout_ms;
  cfg.auth_token = token ? token : "";
  kvf_engine *e = NULL;
  assert_int_equal(kvf_engine_create(&cfg, &e), 0);
  return e;
}

static int setup(void **state) {
  fixture *f = calloc(1, sizeof *f);
  if (engine_peer_start(&f->peer, PEER_BYTES, NULL)) return -1;
  f->pool_bytes = 64u << 20;
  f->pool = mmap(NULL, f->pool_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  f->e = make_engine(2000, NULL);
  assert_int_equal(kvf_engine_register(f->e, f->pool, f->pool_bytes), 0);
  *state = f;
  return 0;
}

static int teardown(void **state) {
  fixture *f = *state;
  kvf_engine_destroy(f->e);
  engine_peer_stop(&f->peer);
  munmap(f->pool, f->pool_bytes);
  free(f);
  return 0;
}

static void ask(fixture *f, const char *cmd, char *reply, size_t cap) {
  assert_int_equal(proc_ask(&f->peer.p, cmd, reply, cap, 20000), 0);
}

/* Scattered pages: a random source page set into a random destination set,
 * one block per page, then the peer checks every page's pattern. */
static void scattered_pages_land_byte_exact(void **state) {
  fixture *f = *state;
  enum { N = 1000 };
  uint64_t npages = PEER_BYTES / PAGE, rng = 42;
  static kvf_write w[N];
  static char line[N * 24 + 64];
  uint8_t *used = calloc(npages, 1);
  int off = snprintf(line, sizeof line, "verify 7 %u ", PAGE);
  for (int i = 0; i < N; i++) {
    uint64_t d;
    do {
      rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
      d = (rng >> 33) % npages;
    } while (used[d]);
    used[d] = 1;
    uint64_t s = (uint64_t)(N - 1 - i) * 3; /* scattered source pages */
    pattern_fill(f->pool + s * PAGE, PAGE, 7, 1000 + d);
    w[i] =
        (kvf_write){.src = (uint64_t)(uintptr_t)(f->pool + s * PAGE), .dst = f->peer.base + d * PAGE, .len = PAGE};
    off += snprintf(line + off, sizeof line - (size_t)off, "%s%llu:%llu", i ? "," : "", (unsigned long long)d,
                    (unsigned long long)(1000 + d));
  }
  assert_int_equal(kvf_engine_write(f->e, f->peer.session, w, N), 0);
  char reply[64];
  ask(f, line, reply, sizeof reply);
  assert_string_equal(reply, "ok 1000");
  free(used);
  kvf_engine_stats st;
  kvf_engine_get_stats(f->e, &st);
  assert_int_equal(st.batches_sent, 1);
  assert_int_equal(st.bytes_sent, (uint64_t)N * PAGE);
}

/* Large blocks are cut across connections; the bytes must still line up. */
static void large_block_split_across_connections(void **state) {
  fixture *f = *state;
  size_t len = 8u << 20;
  for (size_t p = 0; p < len / PAGE; p++) pattern_fill(f->pool + p * PAGE, PAGE, 9, p);
  kvf_write w = {.src = (uint64_t)(uintptr_t)f->pool, .dst = f->peer.base + PAGE, .len = len};
  assert_int_equal(kvf_engine_write(f->e, f->peer.session, &w, 1), 0);
  char cmd[64 + 2048 * 16], reply[64];
  int off = snprintf(cmd, sizeof cmd, "verify 9 %u ", PAGE);
  for (size_t p = 0; p < len / PAGE; p++)
    off += snprintf(cmd + off, sizeof cmd - (size_t)off, "%s%zu:%zu", p ? "," : "", p + 1, p);
  ask(f, cmd, reply, sizeof reply);
  assert_string_equal(reply, "ok 2048");
}

/* Over UCX in write mode writes are one-sided: the target's counters do
 * not see them (the writer refuses out-of-range batches itself), so the
 * target-side counter checks apply to kvferry's TCP and to UCX's read mode
 * (the default), where the target reads every chunk itself. */
static int ucx_write_mode(void) {
  const char *t = getenv("KVFERRY_TRANSPORT"), *m = getenv("KVFERRY_UCX_MODE");
  return t && !strcmp(t, "ucx") && m && !strcmp(m, "write");
}

/* Over UCX's software RMA (explicit ucx, UCX_TLS without shared memory):
 * UCX 1.13 aborts the process that answers a peer's gets or puts when that
 * peer dies mid-transfer (README, Tests: the UCX defect; auto never routes
 * there). */
static int ucx_software_rma(void) {
  const char *t = getenv("KVFERRY_TRANSPORT"), *tls = getenv("UCX_TLS");
  return t && !strcmp(t, "ucx") && tls && !strstr(tls, "posix") && !strstr(tls, "sysv") && !strstr(tls, "sm") &&
         !strstr(tls, "cma");
}

static int target_counts(void) {
  const char *t = getenv("KVFERRY_TRANSPORT");
  return t && (!strcmp(t, "tcp") || !ucx_write_mode());
}

static void outside_registered_memory_refused_untouched(void **state) {
  fixture *f = *state;
  char reply[64];
  ask(f, "fill 0", reply, sizeof reply);
  memset(f->pool, 0xab, 3 * PAGE);
  kvf_write w[3] = {
      {.src = (uint64_t)(uintptr_t)f->pool, .dst = f->peer.base, .len = PAGE},
      {.src = (uint64_t)(uintptr_t)f->pool + PAGE, .dst = f->peer.base + 2 * PAGE, .len = PAGE},
      /* Straddles the end of the peer's region by one byte. */
      {.src = (uint64_t)(uintptr_t)f->pool + 2 * PAGE, .dst = f->peer.base + PEER_BYTES - PAGE + 1, .len = PAGE},
  };
  assert_int_equal(kvf_engine_write(f->e, f->peer.session, w, 3), KVF_ERANGE);
  ask(f, "untouched 0", reply, sizeof reply);
  assert_string_equal(reply, "ok");
  ask(f, "stats", reply, sizeof reply);
  assert_string_equal(reply, target_counts() ? "stats 0 1 0" : "stats 0 0 0");
  /* The connection stays usable after a refusal. */
  assert_int_equal(kvf_engine_write(f->e, f->peer.session, w, 2), 0);
  ask(f, "stats", reply, sizeof reply);
  assert_string_equal(reply, target_counts() ? "stats 1 1 0" : "stats 0 0 0");
}

static void unregistered_source_rejected_locally(void **state) {
  fixture *f = *state;
  static unsigned char stray[PAGE];
  kvf_write w = {.src = (uint64_t)(uintptr_t)stray, .dst = f->peer.base, .len = PAGE};
  assert_int_equal(kvf_engine_write(f->e, f->peer.session, &w, 1), KVF_ERANGE);
}

static void malformed_session_ids(void **state) {
  fixture *f = *state;
  kvf_write w = {.src = (uint64_t)(uintptr_t)f->pool, .dst = f->peer.base, .len = 8};
  const char *bad[] = {"",       "host",     ":80",      "host:",   "host:0", "host:65536", "host:12a",
                       "::1:80", "host:+80", "host: 80", "[::1:80", "a b:80", "host:123456"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
    assert_int_equal(kvf_engine_write(f->e, bad[i], &w, 1), KVF_EINVAL);
  assert_int_equal(kvf_engine_write(f->e, NULL, &w, 1), KVF_EINVAL);
  char host[64];
  uint16_t port;
  assert_int_equal(kvf__addr_parse("[::1]:8080", 10, host, sizeof host, &port, NULL), 0);
  assert_string_equal(host, "::1");
  assert_int_equal(port, 8080);
}

static void async_submit_poll_wait(void **state) {
  fixture *f = *state;
  pattern_fill(f->pool, PAGE, 3, 5);
  kvf_write w = {.src = (uint64_t)(uintptr_t)f->pool, .dst = f->peer.base + 5 * PAGE, .len = PAGE};
  kvf_batch *b = NULL;
  assert_int_equal(kvf_engine_submit(f->e, f->peer.session, &w, 1, &b), 0);
  int r = KVF_EAGAIN;
  for (int i = 0; i < 2000 && (r = kvf_batch_poll(b)) == KVF_EAGAIN; i++) usleep(1000);
  assert_int_equal(r, 0);
  assert_int_equal(kvf_batch_wait(b, 0), 0);
  kvf_batch_destroy(b);
  char reply[64];
  ask(f, "verify 3 4096 5:5", reply, sizeof reply);
  assert_string_equal(reply, "ok 1");
  /* An empty batch completes at once. */
  assert_int_equal(kvf_engine_submit(f->e, f->peer.session, &w, 0, &b), 0);
  assert_int_equal(kvf_batch_poll(b), 0);
  kvf_batch_destroy(b);
}

static void connection_refused_fails_fast(void **state) {
  (void)state; /* the fixture's engine has a 2 s deadline: this case makes its own writer */
  kvf_engine *other = make_engine(2000, NULL);
  char dead[64];
  snprintf(dead, sizeof dead, "127.0.0.1:%u", kvf_engine_port(other));
  kvf_engine_destroy(other); /* nobody listens there now */
  /* A writer with a 10 s deadline, so "fast" has room on a loaded machine
   * and still tells a refusal from a wait for the deadline. */
  kvf_engine *w10 = make_engine(10000, NULL);
  static unsigned char src[8];
  assert_int_equal(kvf_engine_register(w10, src, sizeof src), 0);
  kvf_write w = {.src = (uint64_t)(uintptr_t)src, .dst = 4096, .len = 8};
  double t0 = now_s();
  assert_int_equal(kvf_engine_write(w10, dead, &w, 1), KVF_ECONNREFUSED);
  assert_true(now_s() - t0 < 5.0);
  kvf_engine_destroy(w10);
}

typedef struct writer_arg {
  fixture *f;
  int id;
  int rc;
} writer_arg;

static void *writer_main(void *p) {
  writer_arg *a = p;
  fixture *f = a->f;
  enum { PER = 64, ROUNDS = 20 };
  kvf_write w[PER];
  for (int r = 0; r < ROUNDS && !a->rc; r++) {
    for (int i = 0; i < PER; i++) {
      uint64_t page = (uint64_t)a->id * PER + i; /* disjoint destinations per thread */
      unsigned char *src = f->pool + ((uint64_t)a->id * PER + i) * PAGE;
      pattern_fill(src, PAGE, 100 + (uint64_t)r, page);
      w[i] = (kvf_write){.src = (uint64_t)(uintptr_t)src, .dst = f->peer.base + page * PAGE, .len = PAGE};
    }
    a->rc = kvf_engine_write(f->e, f->peer.session, w, PER);
  }
  return NULL;
}

static void four_threads_write_concurrently(void **state) {
  fixture *f = *state;
  pthread_t t[4];
  writer_arg a[4];
  for (int i = 0; i < 4; i++) {
    a[i] = (writer_arg){f, i, 0};
    pthread_create(&t[i], NULL, writer_main, &a[i]);
  }
  for (int i = 0; i < 4; i++) pthread_join(t[i], NULL);
  for (int i = 0; i < 4; i++) assert_int_equal(a[i].rc, 0);
  char cmd[8192], reply[64];
  int off = snprintf(cmd, sizeof cmd, "verify 119 %u ", PAGE); /* last round: seed 100 + 19 */
  for (int p = 0; p < 256; p++)
    off += snprintf(cmd + off, sizeof cmd - (size_t)off, "%s%d:%d", p ? "," : "", p, p);
  ask(f, cmd, reply, sizeof reply);
  assert_string_equal(reply, "ok 256");
}

static void killed_peer_fails_batch_quickly(void **state) {
  fixture *f = *state;
  if (ucx_software_rma()) { /* this process answers the dying peer's gets: UCX may abort it */
    print_message("skipped over UCX_TLS=%s: UCX 1.13's software RMA can abort this process when the peer "
                  "dies mid-transfer (the known UCX defect, README)\n",
                  getenv("UCX_TLS"));
    skip();
  }
  /* A writer with a 10 s deadline: a failure noticed from the closed
   * connection comes well before it, even on a loaded machine. */
  kvf_engine *e = make_engine(10000, NULL);
  assert_int_equal(kvf_engine_register(e, f->pool, f->pool_bytes), 0);
  /* A batch big enough to still be in flight when the peer dies. */
  kvf_write w[64];
  for (int i = 0; i < 64; i++)
    w[i] = (kvf_write){.src = (uint64_t)(uintptr_t)f->pool + (uint64_t)i * (1u << 20),
                       .dst = f->peer.base + (uint64_t)(i % 16) * (1u << 20),
                       .len = 1u << 20};
  kvf_batch *b[8];
  assert_int_equal(kvf_engine_write(e, f->peer.session, w, 1), 0); /* connections up before the kill */
  for (int i = 0; i < 8; i++) assert_int_equal(kvf_engine_submit(e, f->peer.session, w, 64, &b[i]), 0);
  double t0 = now_s();
  kill(f->peer.p.pid, SIGKILL);
  int failed = 0;
  for (int i = 0; i < 8; i++) {
    int rc = kvf_batch_wait(b[i], -1);
    if (rc) {
      failed++;
      /* refused: a batch whose second connection was made after the kill */
      assert_true(rc == KVF_ECLOSED || rc == KVF_ETIMEDOUT || rc == KVF_ECONNREFUSED);
    }
    kvf_batch_destroy(b[i]);
  }
  assert_true(failed >= 1);
  assert_true(now_s() - t0 < 5.0); /* well inside the 10 s deadline */
  kvf_engine_destroy(e);
  /* A new write to the dead session fails cleanly, not with a hang. */
  assert_int_not_equal(kvf_engine_write(f->e, f->peer.session, w, 1), 0);
}

static void stopped_peer_fails_at_deadline(void **state) {
  fixture *f = *state;
  kvf_write w = {.src = (uint64_t)(uintptr_t)f->pool, .dst = f->peer.base, .len = 4u << 20};
  assert_int_equal(kvf_engine_write(f->e, f->peer.session, &w, 1), 0); /* connections up */
  kill(f->peer.p.pid, SIGSTOP);
  assert_int_equal(kvf_test_wait_stopped(f->peer.p.pid, 10000), 0);
  double t0 = now_s();
  kvf_write big = {.src = (uint64_t)(uintptr_t)f->pool, .dst = f->peer.base, .len = 16u << 20};
  int rc = kvf_engine_write(f->e, f->peer.session, &big, 1);
  double dt = now_s() - t0;
  kill(f->peer.p.pid, SIGCONT);
  /* One-sided UCX writes (CMA, shared memory) land in a stopped process. */
  if (!target_counts() && rc == 0) return;
  assert_int_equal(rc, KVF_ETIMEDOUT);
  assert_true(dt >= 1.8 && dt < 2.0 + LOAD_SLACK_S); /* deadline is 2 s */
  /* A fresh connection to a stopped peer also ends at the deadline. */
  kill(f->peer.p.pid, SIGSTOP);
  /* Without this wait a peer thread not stopped yet could answer the fresh
   * connection on a loaded machine (seen in CI: the write succeeded). */
  assert_int_equal(kvf_test_wait_stopped(f->peer.p.pid, 10000), 0);
  kvf_engine *fresh = make_engine(1000, NULL);
  unsigned char *src = f->pool;
  assert_int_equal(kvf_engine_register(fresh, src, PAGE), 0);
  kvf_write one = {.src = (uint64_t)(uintptr_t)src, .dst = f->peer.base, .len = PAGE};
  t0 = now_s();
  rc = kvf_engine_write(fresh, f->peer.session, &one, 1);
  dt = now_s() - t0;
  kill(f->peer.p.pid, SIGCONT);
  assert_int_equal(rc, KVF_ETIMEDOUT);
  assert_true(dt >= 0.9 && dt < 1.0 + LOAD_SLACK_S); /* deadline is 1 s */
  kvf_engine_destroy(fresh);
}

/* kvf_engine_submit never blocks on the network: a batch to a peer whose
 * handshake never comes back (a stopped process, a host that drops packets)
 * connects on a thread of its own, so the same thread's next batch, to a
 * live peer, completes while the first still waits (its deadline is 20 s).
 * Closing the silent listener resets the half-made connection: the waiting
 * batch fails with it, long before its deadline. */
static void submit_never_waits_for_a_connect(void **state) {
  fixture *f = *state;
  kvf_engine *e = make_engine(20000, NULL);
  assert_int_equal(kvf_engine_register(e, f->pool, f->pool_bytes), 0);
  char silent[KVF_ADDR_LEN];
  int lfd = kvf_test_silent_listener(silent, sizeof silent);
  assert_true(lfd >= 0);
  kvf_write w = {.src = (uint64_t)(uintptr_t)f->pool, .dst = f->peer.base, .len = PAGE};
  kvf_batch *stuck = NULL, *live = NULL;
  assert_int_equal(kvf_engine_submit(e, silent, &w, 1, &stuck), 0);
  assert_int_equal(kvf_engine_submit(e, f->peer.session, &w, 1, &live), 0);
  assert_int_equal(kvf_batch_wait(live, -1), 0);
  kvf_batch_destroy(live);
  assert_int_equal(kvf_batch_wait(stuck, 0), KVF_ETIMEDOUT); /* still connecting */
  /* A second batch to the silent peer queues behind the first, in order. */
  kvf_batch *behind = NULL;
  assert_int_equal(kvf_engine_submit(e, silent, &w, 1, &behind), 0);
  assert_int_equal(kvf_batch_wait(behind, 0), KVF_ETIMEDOUT);
  close(lfd);
  int rc = kvf_batch_wait(stuck, -1);
  assert_true(rc == KVF_ECLOSED || rc == KVF_ECONNREFUSED);
  rc = kvf_batch_wait(behind, -1);
  assert_true(rc == KVF_ECLOSED || rc == KVF_ECONNREFUSED);
  kvf_batch_destroy(stuck);
  kvf_batch_destroy(behind);
  kvf_engine_stats st;
  kvf_engine_get_stats(e, &st);
  assert_int_equal(st.batches_failed, 2);
  assert_int_equal(st.batches_sent, 1);
  kvf_engine_destroy(e);
}

static void auth_token_required(void **state) {
  engine_peer peer;
  assert_int_equal(engine_peer_start(&peer, 1u << 20, "s3cret"), 0);
  static unsigned char src[PAGE];
  kvf_write w = {.src = (uint64_t)(uintptr_t)src, .dst = peer.base, .len = PAGE};
  const char *tokens[] = {NULL, "wrong", "s3cre", "s3cret"};
  int want[] = {KVF_EACCES, KVF_EACCES, KVF_EACCES, 0};
  for (int i = 0; i < 4; i++) {
    kvf_engine *e = make_engine(2000, tokens[i]);
    assert_int_equal(kvf_engine_register(e, src, sizeof src), 0);
    assert_int_equal(kvf_engine_write(e, peer.session, &w, 1), want[i]);
    kvf_engine_destroy(e);
  }
  char reply[64];
  assert_int_equal(proc_ask(&peer.p, "stats", reply, sizeof reply, 5000), 0);
  assert_string_equal(reply, target_counts() ? "stats 1 0 3" : "stats 0 0 3");
  engine_peer_stop(&peer);
}

/* In-process: registration rules and unregister while idle. */
static void register_unregister_rules(void **state) {
  kvf_engine *target = make_engine(2000, NULL), *writer = make_engine(2000, NULL);
  unsigned char *buf = calloc(4, PAGE), *src = calloc(1, PAGE);
  assert_int_equal(kvf_engine_register(target, buf, 4 * PAGE), 0);
  assert_int_equal(kvf_engine_register(target, buf + PAGE, PAGE), KVF_EEXIST);
  assert_int_equal(kvf_engine_register(target, buf, 0), KVF_EINVAL);
  assert_int_equal(kvf_engine_register(target, buf + 8 * PAGE, SIZE_MAX - 4 * PAGE), KVF_EINVAL); /* wraps */
  assert_int_equal(kvf_engine_register(writer, src, PAGE), 0);
  memset(src, 0x11, PAGE);
  kvf_write w = {.src = (uint64_t)(uintptr_t)src, .dst = (uint64_t)(uintptr_t)buf + PAGE, .len = PAGE};
  const char *sid = kvf_engine_session_id(target);
  assert_int_equal(kvf_engine_write(writer, sid, &w, 1), 0);
  kvf_engine_sync(target);
  assert_int_equal(buf[PAGE], 0x11);
  assert_int_equal(kvf_engine_unregister(target, buf + PAGE), KVF_ENOTFOUND);
  assert_int_equal(kvf_engine_unregister(target, buf), 0);
  memset(src, 0x22, PAGE);
  assert_int_equal(kvf_engine_write(writer, sid, &w, 1), KVF_ERANGE);
  kvf_engine_sync(target);
  assert_int_equal(buf[PAGE], 0x11);
  /* Strided block: 4 pieces of 16 bytes every 64 source / 128 destination bytes. */
  assert_int_equal(kvf_engine_register(target, buf, 4 * PAGE), 0);
  memset(buf, 0, 4 * PAGE);
  kvf_engine_sync(target);
  for (unsigned i = 0; i < PAGE; i++) src[i] = (unsigned char)i;
  kvf_write s = {.src = (uint64_t)(uintptr_t)src,
                 .dst = (uint64_t)(uintptr_t)buf,
                 .len = 16,
                 .count = 4,
                 .src_stride = 64,
                 .dst_stride = 128};
  assert_int_equal(kvf_engine_write(writer, sid, &s, 1), 0);
  kvf_engine_sync(target);
  for (int i = 0; i < 4; i++) {
    assert_memory_equal(buf + i * 128, src + i * 64, 16);
    assert_int_equal(buf[i * 128 + 16], 0);
  }
  kvf_engine_destroy(writer);
  kvf_engine_destroy(target);
  free(buf);
  free(src);
}

/* Locked memory of this process (VmLck), KiB; -1 when unreadable. */
static long vm_locked_kib(void) {
  FILE *f = fopen("/proc/self/status", "r");
  char line[256];
  long kib = -1;
  while (f && fgets(line, sizeof line, f))
    if (sscanf(line, "VmLck: %ld kB", &kib) == 1) break;
  if (f) fclose(f);
  return kib;
}

/* kvf_engine_alloc_pool pins its pools (lock_pools, default on): a kernel
 * that reclaims proactively cannot take their pages from under a peer that
 * maps them. Off by the config field or KVFERRY_LOCK_POOLS=0; a pool is
 * unlocked when freed. Skipped where this process may not lock 1 MiB. */
static void alloc_pool_locks_its_pages(void **state) {
  (void)state;
  const size_t len = 1u << 20;
  kvf_engine *e = make_engine(2000, NULL);
  long base = vm_locked_kib();
  void *p = NULL;
  assert_int_equal(kvf_engine_alloc_pool(e, len, &p), 0);
  long locked = vm_locked_kib();
  if (base < 0 || locked - base < (long)(len >> 10)) {
    kvf_engine_free_pool(e, p);
    kvf_engine_destroy(e);
    print_message("VmLck %ld -> %ld KiB: this process may not lock 1 MiB here (RLIMIT_MEMLOCK)\n", base, locked);
    skip();
  }
  memset(p, 0x5a, len); /* a locked pool is an ordinary one otherwise */
  assert_int_equal(kvf_engine_free_pool(e, p), 0);
  assert_int_equal(vm_locked_kib(), base);
  kvf_engine_destroy(e);

  kvf_engine_config cfg;
  kvf_engine_config_init(&cfg);
  assert_int_equal(cfg.lock_pools, 1);
  assert_int_equal(kvf_engine_config_set(&cfg, "lock_pools", "0"), 0);
  assert_int_equal(cfg.lock_pools, 0);
  assert_int_equal(kvf_engine_create(&cfg, &e), 0);
  assert_int_equal(kvf_engine_alloc_pool(e, len, &p), 0);
  assert_int_equal(vm_locked_kib(), base);
  assert_int_equal(kvf_engine_free_pool(e, p), 0);
  kvf_engine_destroy(e);

  setenv("KVFERRY_LOCK_POOLS", "0", 1);
  e = make_engine(2000, NULL);
  unsetenv("KVFERRY_LOCK_POOLS");
  assert_int_equal(kvf_engine_alloc_pool(e, len, &p), 0);
  assert_int_equal(vm_locked_kib(), base);
  assert_int_equal(kvf_engine_free_pool(e, p), 0);
  kvf_engine_destroy(e);
}

/* Chunking keeps every byte exactly once and in order. */
static void chunking_covers_every_byte(void **state) {
  kvf_batch b = {0};
  kvf_write w[3] =
      {{.src = 0, .dst = 1000000, .len = 3u << 20},
       {.src = 1u << 24, .dst = 1u << 25, .len = 100, .count = 5000, .src_stride = 200, .dst_stride = 300},
       {.src = 7, .dst = 9, .len = 0}};
  chunk **c = NULL;
  size_t n = 0;
  assert_int_equal(kvf__engine_make_chunks(&b, w, 3, 2, 4096, NULL, 0, &c, &n), 0);
  assert_true(n >= 2);
  uint64_t total = 0, next_dst = 1000000, pieces = 0;
  for (size_t i = 0; i < n; i++) {
    for (size_t k = 0; k < c[i]->n; k++) {
      kvf_write *p = &c[i]->writes[k];
      if (p->count <= 1 && p->dst < (1u << 25)) {
        assert_int_equal(p->dst, next_dst);
        assert_int_equal(p->src, next_dst - 1000000);
        next_dst += p->len;
      } else {
        assert_int_equal(p->dst, (1u << 25) + pieces * 300);
        assert_int_equal(p->src, (1u << 24) + pieces * 200);
        pieces += p->count;
      }
      total += kvf__write_block_bytes(p);
    }
    kvf__chunk_free(c[i]);
  }
  free(c);
  assert_int_equal(next_dst, 1000000 + (3u << 20));
  assert_int_equal(pieces, 5000);
  assert_int_equal(total, (3u << 20) + 500000);
}

/* Completion trailers (engine/async.h), two engines in this process: the
 * target's callback gets the trailer once the bytes before it are in place,
 * with the writer's IP; a batch too large for one chunk carries none; a
 * second callback on one engine is refused; after off, nothing is called. */
typedef struct trailer_seen {
  const uint8_t *dst, *want;
  size_t len;
  int calls, bytes_in_place;
  char data[64], peer[64];
} trailer_seen;

static pthread_mutex_t trailer_mu = PTHREAD_MUTEX_INITIALIZER;

static void on_trailer(void *arg, const unsigned char *data, size_t len, const char *peer) {
  trailer_seen *t = arg;
  pthread_mutex_lock(&trailer_mu);
  t->calls++;
  t->bytes_in_place = !memcmp(t->dst, t->want, t->len);
  snprintf(t->data, sizeof t->data, "%.*s", (int)len, (const char *)data);
  snprintf(t->peer, sizeof t->peer, "%s", peer);
  pthread_mutex_unlock(&trailer_mu);
}

/* The callback's count once it reached `want` (over TCP it ran before the
 * write returned; over UCX the target reads the trailer from the rendezvous
 * connection after the writer's flush, so it may come just after), or
 * after 5 s. */
static int trailer_calls_of(const int *calls, int want) {
  int n = 0;
  for (int i = 0; i < 5000; i++) {
    pthread_mutex_lock(&trailer_mu);
    n = *calls;
    pthread_mutex_unlock(&trailer_mu);
    if (n >= want) break;
    usleep(1000);
  }
  return n;
}

static int trailer_calls(trailer_seen *t, int want) { return trailer_calls_of(&t->calls, want); }

/* Two engines in this process, no auth token: a writes, b is written. */
static void engine_pair(kvf_engine **a, kvf_engine **b) {
  kvf_engine_config c;
  kvf_engine_config_init(&c);
  c.auth_token = "";
  assert_int_equal(kvf_engine_create(&c, a), 0);
  assert_int_equal(kvf_engine_create(&c, b), 0);
}

static void trailer_after_bytes(void **state) {
  (void)state;
  enum { LEN = 64 << 10, BIG = 2 << 20 };
  kvf_engine *a = NULL, *b = NULL;
  engine_pair(&a, &b);
  uint8_t *src = malloc(BIG), *dst = calloc(1, BIG);
  for (size_t i = 0; i < BIG; i++) src[i] = (uint8_t)(i * 7 + 1);
  assert_int_equal(kvf_engine_register(a, src, BIG), 0);
  assert_int_equal(kvf_engine_register(b, dst, BIG), 0);
  trailer_seen t = {.dst = dst, .want = src, .len = LEN};
  assert_int_equal(kvf__engine_on_trailer(b, on_trailer, &t), 0);
  assert_int_equal(kvf__engine_on_trailer(b, on_trailer, NULL), KVF_EEXIST);
  kvf_write w = {.src = (uint64_t)(uintptr_t)src, .dst = (uint64_t)(uintptr_t)dst, .len = LEN};
  assert_int_equal(kvf__engine_write_req(a, &(kvf__submit){.session = kvf_engine_session_id(b),
                                                           .writes = &w,
                                                           .n = 1,
                                                           .trailer = "room 7 done",
                                                           .tlen = 11}),
                   0);
  assert_int_equal(trailer_calls(&t, 1), 1);
  assert_true(t.bytes_in_place);
  assert_string_equal(t.data, "room 7 done");
  assert_string_equal(t.peer, "127.0.0.1");
  /* Split over connections: no trailer; but a target that reads (UCX read
   * mode) takes the batch as one notice, and the trailer rides it. */
  const char *path_t = NULL, *path_m = NULL;
  int reads = !kvf__engine_peer_path(a, kvf_engine_session_id(b), &path_t, &path_m) && !strcmp(path_m, "read");
  w.len = BIG;
  assert_int_equal(kvf__engine_write_req(a, &(kvf__submit){.session = kvf_engine_session_id(b),
                                                           .writes = &w,
                                                           .n = 1,
                                                           .trailer = "late",
                                                           .tlen = 4}),
                   0);
  usleep(20000);
  assert_int_equal(trailer_calls(&t, 1 + reads), 1 + reads);
  assert_memory_equal(dst, src, BIG);
  kvf__engine_off_trailer(b, &t);
  w.len = LEN;
  assert_int_equal(kvf__engine_write_req(a, &(kvf__submit){.session = kvf_engine_session_id(b),
                                                           .writes = &w,
                                                           .n = 1,
                                                           .trailer = "after off",
                                                           .tlen = 9}),
                   0);
  usleep(20000);
  assert_int_equal(trailer_calls(&t, 1 + reads), 1 + reads);
  unsigned char big[KVF_ENGINE_MAX_TRAILER + 1] = {0};
  assert_int_equal(kvf__engine_write_req(a, &(kvf__submit){.session = kvf_engine_session_id(b),
                                                           .writes = &w,
                                                           .n = 1,
                                                           .trailer = big,
                                                           .tlen = sizeof big}),
                   KVF_EINVAL);
  kvf_engine_destroy(a);
  kvf_engine_destroy(b);
  free(src);
  free(dst);
}

/* A burst of small batches, each with a trailer, written back to back from
 * one thread with larger ones among them: the target reads several small
 * chunks per receive (its stage) and answers them together, a larger chunk
 * goes straight into place, and still every byte lands, every batch
 * completes, and each trailer is handed over once, after the bytes of its
 * own batch are in place. */
typedef struct burst_seen {
  const uint8_t *dst, *want;
  const size_t *off, *len; /* per batch: where it writes, how much */
  int n, calls, bad;
  unsigned char *seen; /* per batch: trailers delivered */
} burst_seen;

static void on_burst_trailer(void *arg, const unsigned char *data, size_t len, const char *peer) {
  (void)peer;
  burst_seen *t = arg;
  int k = -1;
  pthread_mutex_lock(&trailer_mu);
  if (len == sizeof k) memcpy(&k, data, sizeof k);
  if (k < 0 || k >= t->n || memcmp(t->dst + t->off[k], t->want + t->off[k], t->len[k])) t->bad++;
  else t->seen[k]++;
  t->calls++;
  pthread_mutex_unlock(&trailer_mu);
}

static void small_batches_in_a_burst_keep_their_trailers(void **state) {
  (void)state;
  enum { N = 300, AREA = 8 << 20 };
  kvf_engine *a = NULL, *b = NULL;
  engine_pair(&a, &b);
  uint8_t *src = malloc(AREA), *dst = calloc(1, AREA);
  assert_non_null(src);
  assert_non_null(dst);
  for (size_t i = 0; i < AREA; i++) src[i] = (uint8_t)(i * 13 + 5);
  assert_int_equal(kvf_engine_register(a, src, AREA), 0);
  assert_int_equal(kvf_engine_register(b, dst, AREA), 0);
  size_t off[N], len[N], at = 0;
  unsigned char seen[N] = {0};
  for (int k = 0; k < N; k++) { /* mostly under the stage, every 25th over it */
    len[k] = k % 25 == 24 ? (size_t)(96 << 10) + (size_t)k * 1000 : 1 + (size_t)(k * 997) % (20 << 10);
    off[k] = at;
    at += len[k];
  }
  assert_true(at <= AREA);
  burst_seen t = {.dst = dst, .want = src, .off = off, .len = len, .n = N, .seen = seen};
  assert_int_equal(kvf__engine_on_trailer(b, on_burst_trailer, &t), 0);
  kvf_batch *bt[N];
  for (int k = 0; k < N; k++) {
    kvf_write w = {.src = (uint64_t)(uintptr_t)(src + off[k]),
                   .dst = (uint64_t)(uintptr_t)(dst + off[k]),
                   .len = len[k]};
    assert_int_equal(kvf__engine_submit_req(a,
                                            &(kvf__submit){.session = kvf_engine_session_id(b),
                                                           .writes = &w,
                                                           .n = 1,
                                                           .trailer = &k,
                                                           .tlen = sizeof k},
                                            &bt[k]),
                     0);
  }
  for (int k = 0; k < N; k++) {
    assert_int_equal(kvf_batch_wait(bt[k], -1), 0);
    kvf_batch_destroy(bt[k]);
  }
  assert_int_equal(trailer_calls_of(&t.calls, N), N);
  assert_int_equal(t.bad, 0);
  for (int k = 0; k < N; k++) assert_int_equal(seen[k], 1);
  assert_memory_equal(dst, src, at);
  kvf__engine_off_trailer(b, &t);
  kvf_engine_destroy(a);
  kvf_engine_destroy(b);
  free(src);
  free(dst);
}

/* Fan-out: one source, three targets, a batch to each in one group. The
 * group's wait returns once every batch ended, each batch's own outcome is
 * then there without waiting; a batch refused by its target (outside its
 * registered memory) ends the wait too and keeps its error; the group is
 * reused after a reset. */
static void a_group_waits_for_every_batch_once(void **state) {
  (void)state;
  enum { T = 3, LEN = 256 << 10 };
  kvf_engine *a = NULL, *t[T] = {NULL};
  kvf_engine_config c;
  kvf_engine_config_init(&c);
  c.auth_token = "";
  assert_int_equal(kvf_engine_create(&c, &a), 0);
  uint8_t *src = malloc(LEN), *dst[T];
  assert_non_null(src);
  for (size_t i = 0; i < LEN; i++) src[i] = (uint8_t)(i * 11 + 3);
  assert_int_equal(kvf_engine_register(a, src, LEN), 0);
  for (int k = 0; k < T; k++) {
    assert_int_equal(kvf_engine_create(&c, &t[k]), 0);
    dst[k] = calloc(1, LEN);
    assert_non_null(dst[k]);
    assert_int_equal(kvf_engine_register(t[k], dst[k], LEN), 0);
  }
  kvf__batch_group g;
  assert_int_equal(kvf__batch_group_init(&g), 0);
  for (int round = 0; round < 2; round++) {
    kvf__batch_group_reset(&g);
    kvf_batch *b[T];
    for (int k = 0; k < T; k++) {
      /* the second round's last target is asked to take a block past its memory */
      int outside = round == 1 && k == T - 1;
      kvf_write w = {.src = (uint64_t)(uintptr_t)src,
                     .dst = (uint64_t)(uintptr_t)dst[k] + (outside ? LEN / 2 : 0),
                     .len = LEN};
      assert_int_equal(kvf__engine_submit_req(a,
                                              &(kvf__submit){.session = kvf_engine_session_id(t[k]),
                                                             .writes = &w,
                                                             .n = 1,
                                                             .group = &g},
                                              &b[k]),
                       0);
    }
    kvf__batch_group_wait(&g);
    for (int k = 0; k < T; k++) {
      int outside = round == 1 && k == T - 1;
      assert_int_equal(kvf_batch_wait(b[k], -1), outside ? KVF_ERANGE : 0);
      kvf_batch_destroy(b[k]);
      if (!outside) assert_memory_equal(dst[k], src, LEN);
    }
    if (round == 0) { /* every batch ended: nothing left pending in the group */
      pthread_mutex_lock(&g.mu);
      assert_int_equal(g.pending, 0);
      assert_int_equal(g.failed, 0);
      pthread_mutex_unlock(&g.mu);
    }
    for (int k = 0; k < T; k++) memset(dst[k], 0, LEN);
  }
  kvf__batch_group_destroy(&g);
  kvf_engine_destroy(a);
  for (int k = 0; k < T; k++) kvf_engine_destroy(t[k]), free(dst[k]);
  free(src);
}

/* A pokeable group wait (a transfer worker waiting for its window and for
 * new chunks at once) ends on a poke, before or during it, and takes it; a
 * plain wait ignores pokes and leaves them for the next pokeable wait; a
 * group that ended reports that first. The batch in flight is simulated
 * (pending set by hand, as group_join does). */
typedef struct poke_waiter {
  kvf__batch_group *g;
  atomic_int started;
  int res;
} poke_waiter;

static void *poke_waiter_main(void *arg) {
  poke_waiter *w = arg;
  atomic_store(&w->started, 1);
  w->res = kvf__batch_group_wait_pokeable(w->g, INT64_MAX);
  return NULL;
}

static void set_pending(kvf__batch_group *g, int pending) {
  pthread_mutex_lock(&g->mu);
  g->pending = pending;
  g->deadline_ns = clock_now_ns() + 60 * 1000000000LL;
  pthread_cond_broadcast(&g->cv);
  pthread_mutex_unlock(&g->mu);
}

static void a_poke_ends_a_pokeable_wait_only(void **state) {
  (void)state;
  kvf__batch_group g;
  assert_int_equal(kvf__batch_group_init(&g), 0);
  set_pending(&g, 1);
  const int64_t soon_ns = 20 * 1000000LL;
  /* nothing came: the wait runs to its end */
  assert_int_equal(kvf__batch_group_wait_pokeable(&g, clock_now_ns() + soon_ns), 0);
  /* a poke before the wait ends it at once, and is taken */
  kvf__batch_group_poke(&g);
  assert_int_equal(kvf__batch_group_wait_pokeable(&g, INT64_MAX), KVF__GROUP_POKED);
  assert_int_equal(kvf__batch_group_wait_pokeable(&g, clock_now_ns() + soon_ns), 0);
  /* a plain wait ignores it and leaves it for the next pokeable one */
  kvf__batch_group_poke(&g);
  assert_int_equal(kvf__batch_group_wait_until(&g, clock_now_ns() + soon_ns), 0);
  assert_int_equal(kvf__batch_group_wait_pokeable(&g, INT64_MAX), KVF__GROUP_POKED);
  /* a poke during the wait (from another thread) ends it */
  poke_waiter w = {.g = &g};
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, poke_waiter_main, &w), 0);
  while (!atomic_load(&w.started)) usleep(1000);
  usleep(10000); /* most likely asleep in the wait by now; either way the poke ends it */
  kvf__batch_group_poke(&g);
  assert_int_equal(pthread_join(th, NULL), 0);
  assert_int_equal(w.res, KVF__GROUP_POKED);
  /* the batches ended: that is reported, poked or not, and a reset clears
   * the poke for the group's next batches */
  kvf__batch_group_poke(&g);
  set_pending(&g, 0);
  assert_int_equal(kvf__batch_group_wait_pokeable(&g, INT64_MAX), KVF__GROUP_ENDED);
  kvf__batch_group_poke(&g);
  kvf__batch_group_reset(&g);
  set_pending(&g, 1);
  assert_int_equal(kvf__batch_group_wait_pokeable(&g, clock_now_ns() + soon_ns), 0);
  kvf__batch_group_destroy(&g);
}

/* Fences: a tagged batch lands only while its (tag, epoch) is open on the
 * target; a wrong epoch, a closed pair or a pair never opened is refused
 * before any byte is written (KVF_ESTATE, counted); untagged batches are
 * never affected. */
typedef struct refusals {
  atomic_int n;
  uint64_t tag, epoch;
  int err;
} refusals;

static void on_refused(void *arg, uint64_t tag, uint64_t epoch, int err, const char *peer) {
  refusals *r = arg;
  (void)peer;
  r->tag = tag, r->epoch = epoch, r->err = err;
  atomic_fetch_add(&r->n, 1);
}

/* An IPv6 peer is named in brackets wherever the engine hands its name on:
 * the session id is "[::1]:port", a refusal callback (whose text goes into
 * the decode's failure reason and logs) gets "[::1]:port", and a trailer
 * callback gets the bare IP "::1" (as it gets "127.0.0.1"). */
typedef struct v6_seen {
  pthread_mutex_t mu;
  char refused_by[KVF_ADDR_LEN], trailer_from[KVF_ADDR_LEN];
} v6_seen;

static void on_v6_refused(void *arg, uint64_t tag, uint64_t epoch, int err, const char *peer) {
  (void)tag, (void)epoch, (void)err;
  v6_seen *v = arg;
  pthread_mutex_lock(&v->mu);
  snprintf(v->refused_by, sizeof v->refused_by, "%s", peer);
  pthread_mutex_unlock(&v->mu);
}

static void on_v6_trailer(void *arg, const unsigned char *data, size_t len, const char *peer) {
  (void)data, (void)len;
  v6_seen *v = arg;
  pthread_mutex_lock(&v->mu);
  snprintf(v->trailer_from, sizeof v->trailer_from, "%s", peer);
  pthread_mutex_unlock(&v->mu);
}

static void ipv6_peer_names_are_bracketed(void **state) {
  (void)state;
  if (ucx_write_mode()) {
    print_message("refusals come from the target over tcp and UCX read mode only; skipped in write mode\n");
    skip();
  }
  kvf_engine_config c;
  kvf_engine_config_init(&c);
  c.auth_token = "";
  c.host = "::1";
  kvf_engine *t = NULL, *w = NULL;
  if (kvf_engine_create(&c, &t)) {
    print_message("no IPv6 loopback here; skipped\n");
    skip();
  }
  assert_int_equal(kvf_engine_create(&c, &w), 0);
  char want[KVF_ADDR_LEN];
  snprintf(want, sizeof want, "[::1]:%u", (unsigned)kvf_engine_port(t));
  assert_string_equal(kvf_engine_session_id(t), want);
  enum { N = 64 << 10 };
  unsigned char *src = calloc(1, N), *dst = calloc(1, N);
  assert_int_equal(kvf_engine_register(w, src, N), 0);
  assert_int_equal(kvf_engine_register(t, dst, N), 0);
  v6_seen v = {.mu = PTHREAD_MUTEX_INITIALIZER};
  assert_int_equal(kvf__engine_on_refusal(t, on_v6_refused, &v), 0);
  assert_int_equal(kvf__engine_on_trailer(t, on_v6_trailer, &v), 0);
  kvf_write wr = {(uint64_t)(uintptr_t)src, (uint64_t)(uintptr_t)dst, 4096, 1, 0, 0};
  assert_int_equal(kvf__engine_write_req(w, &(kvf__submit){.session = kvf_engine_session_id(t),
                                                           .writes = &wr,
                                                           .n = 1,
                                                           .trailer = "done",
                                                           .tlen = 4}),
                   0);
  for (int i = 0; i < 5000; i++) {
    pthread_mutex_lock(&v.mu);
    int got = v.trailer_from[0] != 0;
    pthread_mutex_unlock(&v.mu);
    if (got) break;
    usleep(1000);
  }
  assert_string_equal(v.trailer_from, "::1");
  uint64_t epoch = 0, half[2] = {(uint64_t)(uintptr_t)dst, N / 2};
  assert_int_equal(kvf_engine_fence_open(t, 9, &epoch), 0);
  assert_int_equal(kvf__engine_fence_bound(t, 9, epoch, half, 1), 0);
  kvf_batch_opts o;
  kvf_batch_opts_init(&o);
  o.tag = 9;
  o.epoch = epoch;
  wr.len = N;
  assert_int_equal(kvf_engine_write_ex(w, kvf_engine_session_id(t), &wr, 1, &o), KVF_ERANGE);
  pthread_mutex_lock(&v.mu);
  char host[KVF_ADDR_HOST_LEN];
  uint16_t port = 0;
  assert_int_equal(kvf__addr_parse(v.refused_by, strlen(v.refused_by), host, sizeof host, &port, NULL), 0);
  pthread_mutex_unlock(&v.mu);
  assert_string_equal(host, "::1");
  assert_int_equal(strncmp(v.refused_by, "[::1]:", 6), 0);
  assert_true(port != 0);
  kvf__engine_off_refusal(t, &v);
  kvf__engine_off_trailer(t, &v);
  assert_int_equal(kvf_engine_fence_close(t, 9, epoch, 1000), 0);
  kvf_engine_destroy(w);
  kvf_engine_destroy(t);
  free(src);
  free(dst);
}

typedef struct closer {
  kvf_engine *e;
  uint64_t epoch;
  int rc;
} closer;

static void *close_pair_5(void *arg) {
  closer *c = arg;
  c->rc = kvf_engine_fence_close(c->e, 5, c->epoch, 5000);
  return NULL;
}

/* A pair whose close timed out (a receiver stuck inside it) is closed
 * again, and the stuck receiver leaves during that wait: its last receiver
 * drops the record, and the second close returns without dropping it once
 * more (it went to the spare list twice, and two later pairs then shared
 * one record: review finding). */
static void fence_closed_twice_while_a_receiver_is_stuck(void **state) {
  (void)state;
  kvf_engine *e = make_engine(1000, "");
  uint64_t epoch = 0;
  assert_int_equal(kvf_engine_fence_open(e, 5, &epoch), 0);
  engine_fence *x = kvf__fence_enter(e, 5, epoch);
  assert_non_null(x);
  assert_int_equal(kvf_engine_fence_close(e, 5, epoch, 50), KVF_ETIMEDOUT);
  closer c = {e, epoch, -1};
  pthread_t t;
  assert_int_equal(pthread_create(&t, NULL, close_pair_5, &c), 0);
  usleep(100000); /* the second close waits (if it has not started yet, it finds the pair gone) */
  kvf__fence_leave(e, x);
  pthread_join(t, NULL);
  assert_true(c.rc == 0 || c.rc == KVF_ENOTFOUND);
  uint64_t e6 = 0, e7 = 0;
  assert_int_equal(kvf_engine_fence_open(e, 6, &e6), 0);
  assert_int_equal(kvf_engine_fence_open(e, 7, &e7), 0);
  engine_fence *x6 = kvf__fence_enter(e, 6, e6), *x7 = kvf__fence_enter(e, 7, e7);
  assert_non_null(x6);
  assert_non_null(x7);
  assert_true(x6 != x7);
  kvf__fence_leave(e, x6);
  kvf__fence_leave(e, x7);
  assert_int_equal(kvf_engine_fence_close(e, 6, e6, 1000), 0);
  assert_int_equal(kvf_engine_fence_close(e, 7, e7, 1000), 0);
  kvf_engine_destroy(e);
}

static void tagged_batches_land_only_while_their_fence_is_open(void **state) {
  if (ucx_write_mode()) {
    /* Target-side fences need the target to see the write: UCX puts are
     * one-sided (kv.h, kvf_receiver_poll, says when pages may be reused). */
    print_message("fences are enforced by the target over tcp and UCX read mode only; skipped in write mode\n");
    skip();
  }
  kvf_engine *t = make_engine(2000, NULL), *w = make_engine(2000, NULL);
  enum { N = 1 << 20 };
  unsigned char *src = malloc(N), *dst = calloc(1, N);
  assert_non_null(src);
  assert_non_null(dst);
  memset(src, 0xab, N);
  assert_int_equal(kvf_engine_register(w, src, N), 0);
  assert_int_equal(kvf_engine_register(t, dst, N), 0);
  uint64_t epoch = 0, other = 0;
  assert_int_equal(kvf_engine_fence_open(t, 77, &epoch), 0);
  assert_int_equal(kvf_engine_fence_open(t, 78, &other), 0);
  assert_true(epoch != 0 && other != 0 && epoch != other);
  kvf_write wr = {(uint64_t)(uintptr_t)src, (uint64_t)(uintptr_t)dst, N, 1, 0, 0};
  kvf_batch_opts o;
  kvf_batch_opts_init(&o);
  o.tag = 77;
  o.epoch = epoch;
  assert_int_equal(kvf_engine_write_ex(w, kvf_engine_session_id(t), &wr, 1, &o), 0);
  kvf_engine_sync(t);
  assert_int_equal(dst[0], 0xab);
  assert_int_equal(dst[N - 1], 0xab);

  /* Bounded to its first half (a room's own pages): a batch reaching past
   * them fails and not one byte lands past them (a chunk inside them may
   * land); one inside them lands. */
  uint64_t half[2] = {(uint64_t)(uintptr_t)dst, N / 2};
  assert_int_equal(kvf__engine_fence_bound(t, 77, epoch, half, 1), 0);
  refusals seen = {0};
  assert_int_equal(kvf__engine_on_refusal(t, on_refused, &seen), 0);
  assert_int_equal(kvf__engine_fence_bound(t, 77, epoch + 12345, half, 1), KVF_ENOTFOUND);
  memset(src, 0xee, N);
  assert_int_equal(kvf_engine_write_ex(w, kvf_engine_session_id(t), &wr, 1, &o), KVF_ERANGE);
  kvf_engine_sync(t);
  for (size_t i = N / 2; i < N; i += 4093) assert_int_equal(dst[i], 0xab);
  /* The fence's owner heard of it (the decode fails the room). */
  assert_true(atomic_load(&seen.n) >= 1);
  assert_true(seen.tag == 77 && seen.epoch == epoch && seen.err == KVF_ERANGE);
  kvf__engine_off_refusal(t, &seen);
  memset(dst, 0xab, N / 2);
  kvf_engine_sync(t);
  kvf_write in_half = {(uint64_t)(uintptr_t)src, (uint64_t)(uintptr_t)dst + 4096, N / 2 - 4096, 1, 0, 0};
  kvf_write strided = {(uint64_t)(uintptr_t)src, (uint64_t)(uintptr_t)dst, 4096, 200, 4096, 4096};
  assert_int_equal(kvf_engine_write_ex(w, kvf_engine_session_id(t), &strided, 1, &o), KVF_ERANGE);
  assert_int_equal(kvf_engine_write_ex(w, kvf_engine_session_id(t), &in_half, 1, &o), 0);
  kvf_engine_sync(t);
  assert_int_equal(dst[4096], 0xee);
  assert_int_equal(dst[N / 2 - 1], 0xee);
  assert_int_equal(dst[N / 2], 0xab);
  assert_int_equal(kvf__engine_fence_bound(t, 77, epoch, NULL, 0), 0);
  memset(dst, 0xab, N);
  kvf_engine_sync(t);

  memset(src, 0xcd, N);
  o.epoch = other; /* another room's epoch */
  assert_int_equal(kvf_engine_write_ex(w, kvf_engine_session_id(t), &wr, 1, &o), KVF_ESTATE);
  o.epoch = epoch;
  assert_int_equal(kvf_engine_fence_close(t, 77, epoch, 1000), 0);
  assert_int_equal(kvf_engine_fence_close(t, 77, epoch, 1000), KVF_ENOTFOUND);
  assert_int_equal(kvf_engine_write_ex(w, kvf_engine_session_id(t), &wr, 1, &o), KVF_ESTATE);
  kvf_engine_sync(t);
  for (size_t i = 0; i < N; i += 4093) assert_int_equal(dst[i], 0xab);
  kvf_engine_stats st;
  kvf_engine_get_stats(t, &st);
  assert_true(st.chunks_fenced >= 2);

  o.tag = 0; /* untagged: no fence applies */
  assert_int_equal(kvf_engine_write_ex(w, kvf_engine_session_id(t), &wr, 1, &o), 0);
  kvf_engine_sync(t);
  assert_int_equal(dst[N / 2], 0xcd);
  o.tag = 5; /* a tag without an epoch is a caller error */
  o.epoch = 0;
  assert_int_equal(kvf_engine_write_ex(w, kvf_engine_session_id(t), &wr, 1, &o), KVF_EINVAL);
  assert_int_equal(kvf_engine_fence_close(t, 78, other, 1000), 0);
  kvf_engine_destroy(w);
  kvf_engine_destroy(t);
  free(src);
  free(dst);
}

/* A fence bounded by grids (a room's page runs over its buffers, as a
 * decode bounds a room): a piece is inside when it lies within one run of
 * one buffer; a run stops at the buffer's last whole page; buffers that
 * overlap are each tried; a piece that crosses from one buffer into the
 * next is outside even when both ends are the room's pages (no planner
 * writes across buffers); a strided block is checked piece by piece. */
static void fence_grids_hold_a_rooms_pages_only(void **state) {
  (void)state;
  enum { IT = 256, NP = 16 };
  const uint64_t A = 0x100000, B = A + IT * NP, C = 0x200000 + 128; /* A and B touch; C overlaps D */
  const uint64_t D = 0x200000;
  /* sorted by base; B's length is not a whole number of pages */
  const uint64_t kv[3 * 4] = {A, IT * NP, IT, B, IT * NP + 100, IT, D, IT * NP, IT, C, IT * NP, IT};
  const uint64_t kv_reach[4] = {A + IT * NP, B + IT * NP + 100, D + IT * NP, C + IT * NP};
  const uint64_t runs[2 * 3] = {2, 3, 9, 1, 15, 5}; /* pages 2-4, 9, 15-19 (16-19 past every buffer's end) */
  const uint64_t st[3] = {0x300000, 64 * 8, 64}, st_reach[1] = {0x300000 + 64 * 8}, sruns[2] = {7, 1};
  kvf__fence_grid g[2] = {{kv, kv_reach, 4, runs, 3}, {st, st_reach, 1, sruns, 1}};
  engine_fence x = {.grids = g, .ngrids = 2};
  assert_true(kvf__fence_bounds_ok(&x, A + 2 * IT, 3 * IT, 1, 0));       /* pages 2-4 whole */
  assert_false(kvf__fence_bounds_ok(&x, A + 2 * IT, 3 * IT + 1, 1, 0));  /* one byte into page 5 */
  assert_false(kvf__fence_bounds_ok(&x, A + 1 * IT + 255, 2, 1, 0));     /* from page 1 into 2 */
  assert_true(kvf__fence_bounds_ok(&x, B + 9 * IT + 10, IT - 10, 1, 0)); /* the end of page 9 */
  assert_false(kvf__fence_bounds_ok(&x, B + 8 * IT, 1, 1, 0));           /* page 8 */
  assert_true(kvf__fence_bounds_ok(&x, A + 15 * IT, IT, 1, 0));          /* page 15, A's last */
  assert_false(kvf__fence_bounds_ok(&x, A + 15 * IT, IT + 1, 1, 0));     /* ... on into B's page 0 */
  assert_false(kvf__fence_bounds_ok(&x, B + 15 * IT, IT + 1, 1, 0));     /* into B's tail of 100 bytes */
  assert_false(kvf__fence_bounds_ok(&x, B + 16 * IT, 1, 1, 0));          /* the tail itself */
  /* Strided: pages 2, 3, 4 of A at 16 bytes each; one more reaches page 5. */
  assert_true(kvf__fence_bounds_ok(&x, A + 2 * IT + 8, 16, 3, IT));
  assert_false(kvf__fence_bounds_ok(&x, A + 2 * IT + 8, 16, 4, IT));
  assert_false(kvf__fence_bounds_ok(&x, A + 2 * IT, 16, UINT64_MAX / IT, IT)); /* stops at page 5 */
  /* Overlapping buffers (C starts 128 bytes into D): each holding the
   * piece is tried. D + 2 * IT is D's page 2 (the room's) and C's page 1
   * (not): inside through D, though C is found first. C's page 4 is the
   * room's and runs 128 bytes into D's page 5 (not): inside through C.
   * D + 5 * IT + 200 is D's page 5 and C's page 5: outside. */
  assert_true(kvf__fence_bounds_ok(&x, D + 2 * IT, 16, 1, 0));
  assert_true(kvf__fence_bounds_ok(&x, C + 4 * IT, IT, 1, 0));
  assert_false(kvf__fence_bounds_ok(&x, C + 4 * IT, IT + 1, 1, 0));
  assert_false(kvf__fence_bounds_ok(&x, D + 5 * IT + 200, 1, 1, 0));
  assert_true(kvf__fence_bounds_ok(&x, D + 9 * IT + IT - 1, 1, 1, 0)); /* D's page 9 (C's 8, not the room's) */
  /* The state grid: slot 7 only. */
  assert_true(kvf__fence_bounds_ok(&x, 0x300000 + 7 * 64, 64, 1, 0));
  assert_false(kvf__fence_bounds_ok(&x, 0x300000 + 6 * 64, 64, 1, 0));
  assert_false(kvf__fence_bounds_ok(&x, 0x300000 + 7 * 64, 65, 1, 0));
  /* Outside every buffer; nothing written is always fine. */
  assert_false(kvf__fence_bounds_ok(&x, 0x50, 1, 1, 0));
  assert_false(kvf__fence_bounds_ok(&x, UINT64_MAX - 1, 1, 1, 0));
  assert_true(kvf__fence_bounds_ok(&x, 0x50, 0, 1, 0));
  /* Grids without runs let nothing land; no grids bound nothing. */
  kvf__fence_grid empty[2] = {{kv, kv_reach, 4, runs, 0}, {st, st_reach, 1, sruns, 0}};
  engine_fence none = {.grids = empty, .ngrids = 2}, open = {0};
  assert_false(kvf__fence_bounds_ok(&none, A + 2 * IT, 1, 1, 0));
  assert_true(kvf__fence_bounds_ok(&open, A + 2 * IT, 1, 1, 0));
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(scattered_pages_land_byte_exact, setup, teardown),
      cmocka_unit_test(trailer_after_bytes),
      cmocka_unit_test(fence_grids_hold_a_rooms_pages_only),
      cmocka_unit_test(small_batches_in_a_burst_keep_their_trailers),
      cmocka_unit_test(a_group_waits_for_every_batch_once),
      cmocka_unit_test(a_poke_ends_a_pokeable_wait_only),
      cmocka_unit_test_setup_teardown(large_block_split_across_connections, setup, teardown),
      cmocka_unit_test_setup_teardown(outside_registered_memory_refused_untouched, setup, teardown),
      cmocka_unit_test_setup_teardown(unregistered_source_rejected_locally, setup, teardown),
      cmocka_unit_test_setup_teardown(malformed_session_ids, setup, teardown),
      cmocka_unit_test_setup_teardown(async_submit_poll_wait, setup, teardown),
      cmocka_unit_test_setup_teardown(connection_refused_fails_fast, setup, teardown),
      cmocka_unit_test_setup_teardown(four_threads_write_concurrently, setup, teardown),
      cmocka_unit_test_setup_teardown(killed_peer_fails_batch_quickly, setup, teardown),
      cmocka_unit_test_setup_teardown(stopped_peer_fails_at_deadline, setup, teardown),
      cmocka_unit_test_setup_teardown(submit_never_waits_for_a_connect, setup, teardown),
      cmocka_unit_test(auth_token_required),
      cmocka_unit_test(register_unregister_rules),
      cmocka_unit_test(alloc_pool_locks_its_pages),
      cmocka_unit_test(chunking_covers_every_byte),
      cmocka_unit_test(tagged_batches_land_only_while_their_fence_is_open),
      cmocka_unit_test(fence_closed_twice_while_a_receiver_is_stuck),
      cmocka_unit_test(ipv6_peer_names_are_bracketed),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

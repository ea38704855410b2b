/* UCX transport tests: two real processes (`kvferry-testpeer engine-peer`) over the
 * UCX_TLS the ctest entry sets (unset: UCX picks shared memory; posix,cma;
 * tcp), plus two engines in one process where that is enough. Skipped with
 * a message when the library was built without UCX. */
#include <dirent.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cmocka.h>

#include "procfs.h"
#include "sockets.h"

#include "base/clock.h"
#include "bootstrap/bootstrap.h"
#include "engine/async.h"

#include "tools/pattern.h"
#include "tools/peer.h"
#include "kvferry.h"
#ifdef KVF_HAVE_UCX
#include <ucp/api/ucp.h>

#include "engine/ucx.h"
#endif
#include <signal.h>

#define PAGE 4096u
#define PEER_BYTES (16u << 20)

static int have_ucx(void) { return strstr(kvf_engine_transports(), "ucx") != NULL; }

#define SKIP_WITHOUT_UCX()                                                                            \
  do {                                                                                                \
    if (!have_ucx()) {                                                                                \
      printf("SKIP: this kvferry was built without UCX (transports: %s)\n", kvf_engine_transports()); \
      skip();                                                                                         \
    }                                                                                                 \
  } while (0)

static kvf_engine *make_engine(const char *transport, int timeout_ms) {
  kvf_engine_config cfg;
  kvf_engine_config_init(&cfg);
  cfg.transport = transport;
  cfg.timeout_ms = timeout_ms;
  cfg.auth_token = "";
  kvf_engine *e = NULL;
  assert_int_equal(kvf_engine_create(&cfg, &e), 0);
  return e;
}

/* Writes `n` scattered pages plus one strided block of 16 pages, then asks
 * the peer to check every page. */
static void write_and_verify(kvf_engine *e, engine_peer *peer, unsigned char *pool, uint64_t seed) {
  enum { N = 200, S = 16 };
  kvf_write w[N + 1];
  char line[16384];
  int off = snprintf(line, sizeof line, "verify %llu %u ", (unsigned long long)seed, PAGE);
  for (int i = 0; i < N; i++) {
    uint64_t s = (uint64_t)(N - 1 - i) * 2, d = (uint64_t)i * 3 + 1;
    pattern_fill(pool + s * PAGE, PAGE, seed, 5000 + d);
    w[i] = (kvf_write){.src = (uint64_t)(uintptr_t)(pool + s * PAGE), .dst = peer->base + d * PAGE, .len = PAGE};
    off += snprintf(line + off, sizeof line - (size_t)off, "%s%llu:%llu", i ? "," : "", (unsigned long long)d,
                    (unsigned long long)(5000 + d));
  }
  /* Strided: source every 2nd page from page 1000, destination every 3rd
   * from page 2000. */
  for (int k = 0; k < S; k++) {
    uint64_t d = 2000 + (uint64_t)k * 3;
    pattern_fill(pool + (1000 + (uint64_t)k * 2) * PAGE, PAGE, seed, 9000 + d);
    off += snprintf(line + off, sizeof line - (size_t)off, ",%llu:%llu", (unsigned long long)d,
                    (unsigned long long)(9000 + d));
  }
  w[N] = (kvf_write){.src = (uint64_t)(uintptr_t)(pool + 1000 * PAGE),
                     .dst = peer->base + 2000 * PAGE,
                     .len = PAGE,
                     .count = S,
                     .src_stride = 2 * PAGE,
                     .dst_stride = 3 * PAGE};
  assert_int_equal(kvf_engine_write(e, peer->session, w, N + 1), 0);
  char reply[64], want[32];
  assert_int_equal(proc_ask(&peer->p, line, reply, sizeof reply, 20000), 0);
  snprintf(want, sizeof want, "ok %d", N + S);
  assert_string_equal(reply, want);
}

/* Plain and strided blocks land byte-exact over UCX, from ordinary memory
 * into ordinary memory, and the route is recorded with its reason. */
/* A target process over UCX and a writer engine here with `bytes` of
 * ordinary memory registered (*pool). */
static kvf_engine *ucx_writer_with_peer(engine_peer *peer, size_t bytes, unsigned char **pool) {
  const char *args[] = {"--transport", "ucx", NULL};
  assert_int_equal(engine_peer_start_args(peer, PEER_BYTES, NULL, args), 0);
  kvf_engine *e = make_engine("ucx", 5000);
  *pool = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  assert_true(*pool != MAP_FAILED);
  assert_int_equal(kvf_engine_register(e, *pool, bytes), 0);
  return e;
}

static void plain_and_strided_land_exact(void **state) {
  SKIP_WITHOUT_UCX();
  engine_peer peer;
  size_t bytes = 8u << 20;
  unsigned char *pool;
  kvf_engine *e = ucx_writer_with_peer(&peer, bytes, &pool);
  write_and_verify(e, &peer, pool, 11);
  char why[256];
  assert_int_equal(kvf_engine_peer_transport(e, peer.session, why, sizeof why), 0);
  printf("route: %s\n", why);
  assert_true(!strncmp(why, "ucx: ", 5));
  kvf_engine_stats st;
  kvf_engine_get_stats(e, &st);
  assert_int_equal(st.peers_ucx, 1);
  assert_int_equal(st.batches_sent, 1);
  kvf_engine_unregister(e, pool);
  kvf_engine_destroy(e);
  munmap(pool, bytes);
  engine_peer_stop(&peer);
}

/* Read mode, same host, memory not from kvf_engine_alloc_pool: the target
 * reads the writer's private memory straight into place with
 * process_vm_readv (every byte counted in bytes_read_direct), or, with
 * KVFERRY_UCX_CMA=0 in the target or a UCX_TLS without shared memory,
 * through UCX; the same bytes land. */
static void private_memory_read_directly(void **state) {
  SKIP_WITHOUT_UCX();
#ifdef KVF_HAVE_UCX
  int shm = kvf__ucx_tls_allow_shm();
#else
  int shm = 0;
#endif
  for (int direct = 1; direct >= 0; direct--) {
    if (!direct) setenv("KVFERRY_UCX_CMA", "0", 1); /* inherited by the target's process */
    engine_peer peer;
    const char *args[] = {"--transport", "ucx", NULL};
    int started = engine_peer_start_args(&peer, PEER_BYTES, NULL, args);
    unsetenv("KVFERRY_UCX_CMA");
    assert_int_equal(started, 0);
    kvf_engine *e = make_engine("ucx", 5000);
    size_t bytes = 8u << 20;
    unsigned char *pool = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    assert_int_equal(kvf_engine_register(e, pool, bytes), 0);
    write_and_verify(e, &peer, pool, 21 + (uint64_t)direct);
    kvf_engine_stats st;
    kvf_engine_get_stats(e, &st);
    char reply[128];
    unsigned long long got = 0, late = 0, refused = 0, cma = 0;
    assert_int_equal(proc_ask(&peer.p, "reads", reply, sizeof reply, 5000), 0);
    assert_int_equal(sscanf(reply, "reads %llu %llu %llu %llu", &got, &late, &refused, &cma), 4);
    printf("direct %d: %s (peers_read %llu)\n", direct, reply, (unsigned long long)st.peers_read);
    const char *mode = getenv("KVFERRY_UCX_MODE"); /* read unless the write-mode rerun */
    int read_mode = !mode || strcmp(mode, "write");
    assert_int_equal(st.peers_read > 0, read_mode);
    assert_int_equal(cma, read_mode && direct && shm ? (200 + 16) * PAGE : 0);
    kvf_engine_unregister(e, pool);
    kvf_engine_destroy(e);
    munmap(pool, bytes);
    engine_peer_stop(&peer);
  }
}

#ifdef KVF_HAVE_UCX
/* The descriptor of the file behind this process's mapping at `addr` (one
 * of its own), or -1: the path in /proc/self/maps, matched among the
 * links in /proc/self/fd. */
static int fd_behind(const void *addr) {
  FILE *maps = fopen("/proc/self/maps", "re");
  char line[512], path[256] = "";
  uint64_t a = (uint64_t)(uintptr_t)addr;
  while (maps && fgets(line, sizeof line, maps)) {
    unsigned long long lo, hi;
    int at = 0;
    if (sscanf(line, "%llx-%llx %*s %*s %*s %*s %n", &lo, &hi, &at) >= 2 && at && lo <= a && a < hi) {
      snprintf(path, sizeof path, "%s", line + at);
      path[strcspn(path, "\n")] = 0;
      break;
    }
  }
  if (maps) fclose(maps);
  DIR *d = *path ? opendir("/proc/self/fd") : NULL;
  int fd = -1;
  for (struct dirent *de; d && fd < 0 && (de = readdir(d));) {
    char link[300], to[256];
    snprintf(link, sizeof link, "/proc/self/fd/%s", de->d_name);
    ssize_t n = readlink(link, to, sizeof to - 1);
    if (n > 0 && (to[n] = 0, !strcmp(to, path))) fd = atoi(de->d_name);
  }
  if (d) closedir(d);
  printf("mapping at %p: '%s' (fd %d)\n", addr, path, fd);
  return fd;
}
#endif

/* A same-host writer whose pool is a file it can shrink (UCX's POSIX shared
 * memory, UCX_ALLOC_PRIO=md:posix) is never loaded from directly: its bytes
 * come through process_vm_readv (bytes_read_direct), and once the writer
 * shrinks the file under the reader's mapping, a read fails instead of
 * killing the reader (SIGBUS on the first load past the new end). */
static void shrinkable_pool_not_loaded_directly(void **state) {
  SKIP_WITHOUT_UCX();
#ifdef KVF_HAVE_UCX
  const char *mode = getenv("KVFERRY_UCX_MODE");
  if ((mode && !strcmp(mode, "write")) || !kvf__ucx_tls_allow_shm()) {
    printf("SKIP: read mode with UCX shared memory only\n");
    skip();
  }
  engine_peer peer;
  const char *args[] = {"--transport", "ucx", NULL};
  assert_int_equal(engine_peer_start_args(&peer, PEER_BYTES, NULL, args), 0);
  setenv("UCX_ALLOC_PRIO", "md:posix", 1);
  kvf_engine *e = make_engine("ucx", 5000);
  unsetenv("UCX_ALLOC_PRIO");
  enum { BYTES = 8u << 20 };
  void *mem = NULL;
  assert_int_equal(kvf_engine_alloc_pool(e, BYTES, &mem), 0);
  unsigned char *pool = mem;
  int fd = fd_behind(pool);
  if (fd < 0) { /* UCX gave no file: nothing to shrink */
    kvf_engine_free_pool(e, mem);
    kvf_engine_destroy(e);
    engine_peer_stop(&peer);
    printf("SKIP: UCX allocated no POSIX shared memory here\n");
    skip();
  }
  write_and_verify(e, &peer, pool, 41);
  char reply[128];
  unsigned long long got = 0, late = 0, refused = 0, cma = 0;
  assert_int_equal(proc_ask(&peer.p, "reads", reply, sizeof reply, 5000), 0);
  assert_int_equal(sscanf(reply, "reads %llu %llu %llu %llu", &got, &late, &refused, &cma), 4);
  assert_int_equal(cma, (200 + 16) * PAGE);
  /* The writer shrinks its pool; this process no longer touches it. */
  assert_int_equal(ftruncate(fd, 0), 0);
  kvf_write w = {.src = (uint64_t)(uintptr_t)(pool + 4 * PAGE), .dst = peer.base, .len = PAGE};
  int rc = kvf_engine_write(e, peer.session, &w, 1);
  printf("read after the shrink: %s\n", kvf_strerror(rc));
  assert_int_not_equal(rc, 0);
  assert_int_equal(proc_ask(&peer.p, "reads", reply, sizeof reply, 5000), 0); /* the reader lives */
  assert_int_equal(sscanf(reply, "reads %llu %llu %llu %llu", &got, &late, &refused, &cma), 4);
  assert_int_equal(kvf_engine_free_pool(e, mem), 0);
  kvf_engine_destroy(e);
  engine_peer_stop(&peer);
#endif
}

/* Are pools from kvf_engine_alloc_pool mapped by their same-host peers?
 * Only System V segments are (engine/ucx_peer.c): UCX allocates pools
 * there unless UCX_TLS leaves System V out (posix,cma: POSIX shared
 * memory, read and written through process_vm_readv/writev instead). */
static int pools_mapped_by_peers(void) {
  const char *tls = getenv("UCX_TLS");
  return !tls || !*tls || strstr(tls, "sysv") || strstr(tls, "sm") || strstr(tls, "shm") || strstr(tls, "mm");
}

/* A target process over UCX with its own pool (--pool) and a writer engine
 * here with a pool of `bytes` from kvf_engine_alloc_pool (*pool). */
static kvf_engine *pool_writer_with_peer(engine_peer *peer, size_t bytes, void **pool) {
  const char *args[] = {"--transport", "ucx", "--pool", NULL};
  assert_int_equal(engine_peer_start_args(peer, PEER_BYTES, NULL, args), 0);
  kvf_engine *e = make_engine("ucx", 5000);
  assert_int_equal(kvf_engine_alloc_pool(e, bytes, pool), 0);
  return e;
}

/* Pools allocated by the engines: same bytes; with shared memory allowed the
 * peer's pool is mapped here and written with plain stores. */
static void allocated_pools_land_exact(void **state) {
  SKIP_WITHOUT_UCX();
  engine_peer peer;
  void *pool = NULL;
  kvf_engine *e = pool_writer_with_peer(&peer, 8u << 20, &pool);
  write_and_verify(e, &peer, pool, 12);
  write_and_verify(e, &peer, pool, 13); /* again, over the same mapping */
  char why[256];
  assert_int_equal(kvf_engine_peer_transport(e, peer.session, why, sizeof why), 0);
  printf("route: %s\n", why);
  const char *mode = getenv("KVFERRY_UCX_MODE");
  if (!mode || strcmp(mode, "write")) /* read mode: the target maps this pool and reads it */
    assert_non_null(strstr(why, "read mode"));
  else if (pools_mapped_by_peers()) assert_non_null(strstr(why, "mapped here"));
  assert_int_equal(kvf_engine_free_pool(e, pool), 0);
  assert_int_equal(kvf_engine_free_pool(e, pool), KVF_ENOTFOUND);
  kvf_engine_destroy(e);
  engine_peer_stop(&peer);
}

/* A batch of 1 MiB or more is stored past the cache where the bytes are
 * copied with the CPU (read mode: the target's loads from the mapped pool;
 * write mode: the writer's stores into the target's mapped pool;
 * base/copy.h): 160 scattered 32 KiB pages (5 MiB, one notice in read
 * mode, past UCX_LOADS_SPLIT_BYTES: shared with a copier thread, each
 * claiming about 1 MiB at a time)
 * from an allocated pool land byte-exact, twice over the same mapping. */
static void large_batches_stream_and_land_exact(void **state) {
  SKIP_WITHOUT_UCX();
  enum { BIG = 32768, N = 160 };
  engine_peer peer;
  void *mem = NULL;
  kvf_engine *e = pool_writer_with_peer(&peer, 16u << 20, &mem);
  unsigned char *pool = mem;
  kvf_write w[N];
  char line[8192];
  for (int round = 0; round < 2; round++) {
    uint64_t seed = 40 + (uint64_t)round;
    int off = snprintf(line, sizeof line, "verify %llu %u ", (unsigned long long)seed, (unsigned)BIG);
    for (int i = 0; i < N; i++) {
      uint64_t sp = (uint64_t)(N - 1 - i) * 2 + (uint64_t)round, d = (uint64_t)i * 5 % 499 + 1;
      pattern_fill(pool + sp * BIG, BIG, seed, 7000 + d);
      w[i] = (kvf_write){.src = (uint64_t)(uintptr_t)(pool + sp * BIG), .dst = peer.base + d * BIG, .len = BIG};
      off += snprintf(line + off, sizeof line - (size_t)off, "%s%llu:%llu", i ? "," : "", (unsigned long long)d,
                      (unsigned long long)(7000 + d));
    }
    assert_int_equal(kvf_engine_write(e, peer.session, w, N), 0);
    char reply[64], want[32];
    assert_int_equal(proc_ask(&peer.p, line, reply, sizeof reply, 20000), 0);
    snprintf(want, sizeof want, "ok %d", N);
    assert_string_equal(reply, want);
  }
  assert_int_equal(kvf_engine_free_pool(e, mem), 0);
  kvf_engine_destroy(e);
  engine_peer_stop(&peer);
}

/* ucx_writer_with_peer with 8 MiB, connected by a first checked write
 * (`seed`); *mode is the connection's UCX mode ("read" or "write"). */
static kvf_engine *connected_ucx_writer(engine_peer *peer, unsigned char **pool, uint64_t seed,
                                        const char **mode) {
  kvf_engine *e = ucx_writer_with_peer(peer, 8u << 20, pool);
  write_and_verify(e, peer, *pool, seed);
  const char *path_t = NULL;
  assert_int_equal(kvf__engine_peer_path(e, peer->session, &path_t, mode), 0);
  return e;
}

/* A batch large enough to be cut across connections (conns_per_peer 2) goes
 * to a reading target as one notice: its notices are served in order on one
 * connection, and the target splits a large one over its own copiers, so a
 * second notice only adds an answer and a hand-off. (A writing peer still
 * gets one chunk per connection.) The first batch cuts as before: the
 * route is not known until it connects. */
static void large_batch_is_one_notice_in_read_mode(void **state) {
  SKIP_WITHOUT_UCX();
  engine_peer peer;
  unsigned char *pool;
  const char *path_m = NULL;
  kvf_engine *e = connected_ucx_writer(&peer, &pool, 31, &path_m); /* 864 KiB */
  char reply[128];
  unsigned long long got0 = 0, got1 = 0, x1, x2, x3;
  assert_int_equal(proc_ask(&peer.p, "reads", reply, sizeof reply, 5000), 0);
  assert_int_equal(sscanf(reply, "reads %llu %llu %llu %llu", &got0, &x1, &x2, &x3), 4);
  write_and_verify(e, &peer, pool, 32);
  assert_int_equal(proc_ask(&peer.p, "reads", reply, sizeof reply, 5000), 0);
  assert_int_equal(sscanf(reply, "reads %llu %llu %llu %llu", &got1, &x1, &x2, &x3), 4);
  printf("path ucx/%s: second batch arrived as %llu message(s)\n", path_m, got1 - got0);
  if (!strcmp(path_m, "read")) assert_int_equal(got1 - got0, 1); /* what a writing target counts differs */
  kvf_engine_unregister(e, pool);
  kvf_engine_destroy(e);
  munmap(pool, 8u << 20);
  engine_peer_stop(&peer);
}

/* Notices submitted while this thread holds (kvf__engine_hold_begin, as
 * the prefill's listener does for a burst of M2s) wait in the kernel
 * (MSG_MORE: queued on the rendezvous socket, unsent) and go at
 * kvf__engine_hold_end: nothing stays unsent, the batches complete and land
 * byte-exact. Without the push the kernel would send them only after its
 * cork ceiling (200 ms here). */
static void held_notices_go_at_the_hold_end(void **state) {
  SKIP_WITHOUT_UCX();
  engine_peer peer;
  unsigned char *pool;
  const char *path_m = NULL;
  kvf_engine *e = connected_ucx_writer(&peer, &pool, 41, &path_m);
  unsigned port = (unsigned)atoi(strrchr(peer.session, ':') + 1);
  enum { N = 3 };
  kvf_batch *b[N];
  char line[256];
  int off = snprintf(line, sizeof line, "verify 42 %u ", PAGE);
  kvf__engine_hold_begin();
  for (int i = 0; i < N; i++) {
    pattern_fill(pool + (uint64_t)i * PAGE, PAGE, 42, 700 + (uint64_t)i);
    kvf_write w =
        {(uint64_t)(uintptr_t)(pool + (uint64_t)i * PAGE), peer.base + (700 + (uint64_t)i) * PAGE, PAGE, 1, 0, 0};
    assert_int_equal(kvf_engine_submit(e, peer.session, &w, 1, &b[i]), 0);
    off += snprintf(line + off, sizeof line - (size_t)off, "%s%d:%d", i ? "," : "", 700 + i, 700 + i);
  }
  long held = kvf_test_unsent_to(port);
  kvf__engine_hold_end();
  long after = kvf_test_unsent_to(port);
  printf("path ucx/%s: %ld bytes held, %ld unsent after the push\n", path_m, held, after);
  assert_true(after <= 0);
  if (!strcmp(path_m, "read")) assert_true(held > 0); /* write mode puts: no notices to hold */
  for (int i = 0; i < N; i++) {
    assert_int_equal(kvf_batch_wait(b[i], 4000), 0);
    kvf_batch_destroy(b[i]);
  }
  char reply[64];
  assert_int_equal(proc_ask(&peer.p, line, reply, sizeof reply, 20000), 0);
  assert_string_equal(reply, "ok 3");
  kvf_engine_unregister(e, pool);
  kvf_engine_destroy(e);
  munmap(pool, 8u << 20);
  engine_peer_stop(&peer);
}

/* A registration that is not readable host memory (device memory; here a
 * PROT_NONE mapping stands for it) turns read mode off, since a reader
 * copies with its CPU: registered on the target before the writer
 * connects, or on the writer, the connection runs in write mode; registered
 * on the target once a reading connection is up, that connection is cut
 * and the next one writes. The bytes land each time. */
static void device_memory_turns_read_mode_off(void **state) {
  SKIP_WITHOUT_UCX();
  const char *mode = getenv("KVFERRY_UCX_MODE");
  int reads = !mode || strcmp(mode, "write");
  enum { LEN = 256 << 10, DEV = 64 << 10 };
  for (int when = 0; when < 3; when++) { /* 0: target, before; 1: target, after; 2: writer, before */
    kvf_engine *t = make_engine("ucx", 5000), *w = make_engine("ucx", 5000);
    unsigned char *src = malloc(LEN), *dst = calloc(1, LEN);
    void *dev = mmap(NULL, DEV, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    assert_true(src && dst && dev != MAP_FAILED);
    for (size_t i = 0; i < LEN; i++) src[i] = (unsigned char)(i * 13 + (size_t)when);
    assert_int_equal(kvf_engine_register(w, src, LEN), 0);
    assert_int_equal(kvf_engine_register(t, dst, LEN), 0);
    if (when != 1) assert_int_equal(kvf_engine_register(when == 0 ? t : w, dev, DEV), 0);
    kvf_write wr = {.src = (uint64_t)(uintptr_t)src, .dst = (uint64_t)(uintptr_t)dst, .len = LEN};
    assert_int_equal(kvf_engine_write(w, kvf_engine_session_id(t), &wr, 1), 0);
    const char *pt = NULL, *pm = NULL;
    assert_int_equal(kvf__engine_peer_path(w, kvf_engine_session_id(t), &pt, &pm), 0);
    printf("device memory registered %s: path %s/%s\n", when == 1 ? "after the first write" : "before", pt, pm);
    if (when == 1) {
      assert_string_equal(pm, reads ? "read" : "write");
      assert_int_equal(kvf_engine_register(t, dev, DEV), 0);
      memset(dst, 0, LEN);
      int rc = KVF_ECLOSED;
      for (int k = 0; k < 20 && rc; k++) { /* the reading connection was cut: the next one writes */
        rc = kvf_engine_write(w, kvf_engine_session_id(t), &wr, 1);
        if (rc) usleep(50000);
      }
      assert_int_equal(rc, 0);
      assert_int_equal(kvf__engine_peer_path(w, kvf_engine_session_id(t), &pt, &pm), 0);
    }
    assert_string_equal(pm, "write");
    assert_memory_equal(dst, src, LEN);
    kvf_engine_destroy(w);
    kvf_engine_destroy(t);
    munmap(dev, DEV);
    free(src);
    free(dst);
  }
}

#ifdef KVF_HAVE_UCX
static const kvf_engine *g_cut_engine; /* its next read-done answer stops after 5 bytes */
static size_t cut_answer_of(const kvf_engine *e) { return e == g_cut_engine ? 5 : 0; }
#endif

/* A reading target that sends part of an answer and stops holds none of the
 * writer's threads: the writer's progress thread takes a target's message
 * only once it is whole, so another target's writes go on meanwhile (the
 * partial read used to wait up to UCX_CTL_TIMEOUT_MS, 5 s, on the thread
 * every peer's answers need); the stalled connection is dropped at that
 * deadline and its batch fails. */
static void target_stopping_mid_answer_delays_no_other_peer(void **state) {
  SKIP_WITHOUT_UCX();
#ifdef KVF_HAVE_UCX
  const char *mode = getenv("KVFERRY_UCX_MODE");
  if (mode && !strcmp(mode, "write")) {
    printf("SKIP: write mode has no read-done answers\n");
    skip();
  }
  enum { LEN = 64 << 10 };
  /* The writer's timeout (8 s) ends the stalled batch: the target may
   * still read its sources until then (the read lease). */
  kvf_engine *w = make_engine("ucx", 8000), *t1 = make_engine("ucx", 8000), *t2 = make_engine("ucx", 8000);
  unsigned char *src = malloc(LEN), *d1 = calloc(1, LEN), *d2 = calloc(1, LEN);
  assert_true(src && d1 && d2);
  for (size_t i = 0; i < LEN; i++) src[i] = (unsigned char)(i * 7 + 3);
  assert_int_equal(kvf_engine_register(w, src, LEN), 0);
  assert_int_equal(kvf_engine_register(t1, d1, LEN), 0);
  assert_int_equal(kvf_engine_register(t2, d2, LEN), 0);
  kvf_write w1 = {.src = (uint64_t)(uintptr_t)src, .dst = (uint64_t)(uintptr_t)d1, .len = LEN};
  kvf_write w2 = {.src = (uint64_t)(uintptr_t)src, .dst = (uint64_t)(uintptr_t)d2, .len = LEN};
  assert_int_equal(kvf_engine_write(w, kvf_engine_session_id(t1), &w1, 1), 0); /* both connected */
  assert_int_equal(kvf_engine_write(w, kvf_engine_session_id(t2), &w2, 1), 0);
  const char *pt = NULL, *pm = NULL;
  assert_int_equal(kvf__engine_peer_path(w, kvf_engine_session_id(t1), &pt, &pm), 0);
  if (strcmp(pm, "read")) {
    printf("SKIP: the path is %s/%s, not read mode\n", pt, pm);
    skip();
  }
  kvf_engine_stats st;
  kvf_engine_get_stats(t1, &st);
  uint64_t read0 = st.batches_received;
  g_cut_engine = t1;
  atomic_store(&kvf__ucx_done_cut, cut_answer_of);
  kvf_batch *b1 = NULL;
  assert_int_equal(kvf_engine_submit(w, kvf_engine_session_id(t1), &w1, 1, &b1), 0);
  for (int i = 0; i < 500; i++) { /* t1 read it and sent its 5 bytes */
    kvf_engine_get_stats(t1, &st);
    if (st.batches_received > read0) break;
    usleep(10000);
  }
  assert_true(st.batches_received > read0);
  usleep(20000); /* the 5 bytes are at the writer */
  memset(d2, 0, LEN);
  int64_t t0 = clock_now_ns();
  assert_int_equal(kvf_engine_write(w, kvf_engine_session_id(t2), &w2, 1), 0);
  double took_s = (clock_now_ns() - t0) / 1e9;
  printf("write to the other target while one stopped mid-answer: %.3f s\n", took_s);
  assert_true(took_s < 2.5); /* held up, it took the 5 s of the partial read */
  assert_memory_equal(d2, src, LEN);
  int rc = kvf_batch_wait(b1, -1); /* the connection was dropped at 5 s; the batch ends with its lease */
  printf("the stalled target's batch: %s\n", kvf_strerror(rc));
  assert_int_not_equal(rc, 0);
  kvf_batch_destroy(b1);
  atomic_store(&kvf__ucx_done_cut, NULL);
  g_cut_engine = NULL;
  kvf_engine_destroy(w);
  kvf_engine_destroy(t1);
  kvf_engine_destroy(t2);
  free(src);
  free(d1);
  free(d2);
#endif
}

/* bytes_mapped_ahead once it reaches `want` (or after 20 s). */
static uint64_t mapped_ahead(kvf_engine *t, uint64_t want) {
  kvf_engine_stats st;
  for (int64_t until = clock_deadline_ms(20000);; usleep(10 * 1000)) {
    kvf_engine_get_stats(t, &st);
    if (st.bytes_mapped_ahead >= want || clock_now_ns() >= until) return st.bytes_mapped_ahead;
  }
}

/* A reader maps a same-host writer's pools ahead of its reads on a thread
 * of its own (ucx_warm.c): all of them, again when the writer's regions
 * change (its info comes again), and it stops before those mappings end,
 * here by the reader's destroy right after a large pool came (under ASan a
 * load after the end would be caught). Where nothing is mapped (UCX_TLS
 * without System V shared memory, write mode) nothing is counted. */
static void writer_pools_mapped_ahead(void **state) {
  SKIP_WITHOUT_UCX();
  const char *mode = getenv("KVFERRY_UCX_MODE");
  int maps = (!mode || strcmp(mode, "write")) && pools_mapped_by_peers();
  enum { SMALL = 8u << 20, BIG = 128u << 20 };
  kvf_engine *t = make_engine("ucx", 10000), *w = make_engine("ucx", 10000);
  unsigned char *dst = mmap(NULL, 2 * PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  assert_int_equal(kvf_engine_register(t, dst, 2 * PAGE), 0);
  void *p1 = NULL, *p2 = NULL, *p3 = NULL;
  assert_int_equal(kvf_engine_alloc_pool(w, SMALL, &p1), 0);
  memset(p1, 0x11, PAGE);
  kvf_write wr = {.src = (uint64_t)(uintptr_t)p1, .dst = (uint64_t)(uintptr_t)dst, .len = PAGE};
  assert_int_equal(kvf_engine_write(w, kvf_engine_session_id(t), &wr, 1), 0);
  assert_int_equal(dst[PAGE - 1], 0x11);
  if (!maps) {
    usleep(100 * 1000);
    assert_int_equal(mapped_ahead(t, 0), 0);
  } else {
    assert_int_equal(mapped_ahead(t, SMALL), SMALL);
    /* A new pool: the writer's info again, and both pools mapped ahead anew. */
    assert_int_equal(kvf_engine_alloc_pool(w, BIG, &p2), 0);
    memset((unsigned char *)p2 + BIG - PAGE, 0x22, PAGE);
    wr = (kvf_write){.src = (uint64_t)(uintptr_t)p2 + BIG - PAGE,
                     .dst = (uint64_t)(uintptr_t)dst + PAGE,
                     .len = PAGE};
    assert_int_equal(kvf_engine_write(w, kvf_engine_session_id(t), &wr, 1), 0);
    assert_int_equal(dst[2 * PAGE - 1], 0x22);
    assert_int_equal(mapped_ahead(t, SMALL + SMALL + BIG), SMALL + SMALL + BIG);
  }
  /* Another pool, read from, and the reader gone while it maps them ahead. */
  assert_int_equal(kvf_engine_alloc_pool(w, BIG, &p3), 0);
  memset(p3, 0x33, PAGE);
  wr = (kvf_write){.src = (uint64_t)(uintptr_t)p3, .dst = (uint64_t)(uintptr_t)dst, .len = PAGE};
  assert_int_equal(kvf_engine_write(w, kvf_engine_session_id(t), &wr, 1), 0);
  assert_int_equal(dst[0], 0x33);
  kvf_engine_stats st;
  kvf_engine_get_stats(t, &st);
  printf("mapped ahead when the reader was destroyed: %llu MiB\n",
         (unsigned long long)(st.bytes_mapped_ahead >> 20));
  kvf_engine_destroy(t);
  kvf_engine_destroy(w);
  munmap(dst, 2 * PAGE);
}

/* A manager registers the memory it is given: a range inside an allocated
 * pool (or the whole pool) is counted, not refused as overlapping, and its
 * unregister leaves the pool registered; a range crossing the pool's end
 * still overlaps. On both transports (tcp allocates shared anonymous memory). */
static void registering_inside_a_pool_is_counted(void **state) {
  (void)state;
  const char *transports[] = {"tcp", have_ucx() ? "ucx" : NULL};
  for (int t = 0; t < 2 && transports[t]; t++) {
    engine_peer peer;
    const char *args[] = {"--transport", transports[t], NULL};
    assert_int_equal(engine_peer_start_args(&peer, PEER_BYTES, NULL, args), 0);
    kvf_engine *e = make_engine(transports[t], 5000);
    enum { POOL = 8u << 20 };
    void *mem = NULL;
    assert_int_equal(kvf_engine_alloc_pool(e, POOL, &mem), 0);
    unsigned char *pool = mem;
    assert_int_equal(kvf_engine_register(e, pool, POOL), 0);            /* the pool itself */
    assert_int_equal(kvf_engine_register(e, pool + 4096, 1u << 20), 0); /* inside it */
    assert_int_equal(kvf_engine_register(e, pool + POOL - 4096, 8192), KVF_EEXIST);
    assert_int_equal(kvf_engine_unregister(e, pool + 4096), 0);
    assert_int_equal(kvf_engine_unregister(e, pool), 0); /* the nested count only */
    write_and_verify(e, &peer, pool, 14);                /* still registered: writes from it work */
    assert_int_equal(kvf_engine_free_pool(e, pool), 0);
    assert_int_equal(kvf_engine_unregister(e, pool), KVF_ENOTFOUND);
    kvf_engine_destroy(e);
    engine_peer_stop(&peer);
  }
}

/* No silent fallback: the route an engine chose for each peer, and why, is
 * in kvf_engine_peer_routes and on a bootstrap server's /metrics. */
static void routes_show_in_metrics(void **state) {
  (void)state;
  SKIP_WITHOUT_UCX();
  engine_peer peer;
  const char *args[] = {"--transport", "ucx", NULL};
  assert_int_equal(engine_peer_start_args(&peer, PEER_BYTES, NULL, args), 0);
  kvf_engine *e = make_engine("ucx", 5000);
  static unsigned char src[PAGE];
  assert_int_equal(kvf_engine_register(e, src, sizeof src), 0);
  kvf_write w = {.src = (uint64_t)(uintptr_t)src, .dst = peer.base, .len = PAGE};
  assert_int_equal(kvf_engine_write(e, peer.session, &w, 1), 0);
  char lines[1024];
  assert_int_equal(kvf_engine_peer_routes(e, lines, sizeof lines), 1);
  printf("routes: %s", lines);
  assert_int_equal(strncmp(lines, peer.session, strlen(peer.session)), 0);
  kvf_bootstrap_server *srv = NULL;
  assert_int_equal(kvf_bootstrap_server_create(NULL, &srv), 0);
  assert_int_equal(kvf_bootstrap_server_add_engine(srv, e), 0);
  char addr[32], *body = NULL;
  snprintf(addr, sizeof addr, "127.0.0.1:%u", (unsigned)kvf_bootstrap_server_port(srv));
  bootstrap_client_opts o = {.token = "", .connect_timeout_ms = 5000, .timeout_ms = 5000};
  bootstrap_client *c = NULL;
  long status = 0;
  assert_int_equal(kvf__bootstrap_client_create(addr, &o, &c), 0);
  assert_int_equal(kvf__bootstrap_client_request(c, "GET", "/metrics", NULL, 0, &status, &body, NULL), 0);
  kvf__bootstrap_client_destroy(c);
  assert_int_equal(status, 200);
  char want[400];
  snprintf(want, sizeof want, "kvferry_engine_peer_route{engine=\"%s\",peer=\"%s\",transport=\"ucx\",why=\"",
           kvf_engine_session_id(e), peer.session);
  const char *hit = strstr(body, want);
  if (hit) printf("%.*s\n", (int)strcspn(hit, "\n"), hit);
  assert_non_null(hit);
  free(body);
  kvf_bootstrap_server_destroy(srv);
  kvf_engine_destroy(e);
  engine_peer_stop(&peer);
}

/* An explicit ucx writer refuses a peer that offers no UCX; auto crosses to
 * kvferry's TCP and says why. */
static void explicit_ucx_never_falls_back(void **state) {
  SKIP_WITHOUT_UCX();
  engine_peer peer;
  const char *args[] = {"--transport", "tcp", NULL};
  assert_int_equal(engine_peer_start_args(&peer, PEER_BYTES, NULL, args), 0);
  static unsigned char src[PAGE];
  kvf_write w = {.src = (uint64_t)(uintptr_t)src, .dst = peer.base, .len = PAGE};
  kvf_engine *e = make_engine("ucx", 3000);
  assert_int_equal(kvf_engine_register(e, src, sizeof src), 0);
  assert_int_equal(kvf_engine_write(e, peer.session, &w, 1), KVF_ECONNREFUSED);
  kvf_engine_destroy(e);
  e = make_engine("auto", 3000);
  assert_int_equal(kvf_engine_register(e, src, sizeof src), 0);
  assert_int_equal(kvf_engine_write(e, peer.session, &w, 1), 0);
  char why[256];
  assert_int_equal(kvf_engine_peer_transport(e, peer.session, why, sizeof why), 0);
  printf("route: %s\n", why);
  assert_true(!strncmp(why, "tcp: auto", 9));
  kvf_engine_stats st;
  kvf_engine_get_stats(e, &st);
  assert_int_equal(st.peers_tcp, 1);
  kvf_engine_destroy(e);
  engine_peer_stop(&peer);
}

/* A peer on "another host" (its identity forced by KVFERRY_UCX_HOST_ID)
 * with no RDMA device here: explicit ucx fails with a clear error unless the
 * user set UCX_TLS; auto takes kvferry's TCP and says why. */
static void other_host_without_rdma(void **state) {
  SKIP_WITHOUT_UCX();
  if (access("/sys/class/infiniband", F_OK) == 0) {
    printf("SKIP: this host has an RDMA device; the no-RDMA path cannot be shown here\n");
    skip();
  }
  setenv("KVFERRY_UCX_HOST_ID", "another-host", 1);
  engine_peer peer;
  const char *args[] = {"--transport", "ucx", NULL};
  int started = engine_peer_start_args(&peer, PEER_BYTES, NULL, args);
  unsetenv("KVFERRY_UCX_HOST_ID");
  assert_int_equal(started, 0);
  static unsigned char src[PAGE];
  kvf_write w = {.src = (uint64_t)(uintptr_t)src, .dst = peer.base, .len = PAGE};
  const char *tls = getenv("UCX_TLS");
  char why[256];
  kvf_engine *e = make_engine("ucx", 3000);
  assert_int_equal(kvf_engine_register(e, src, sizeof src), 0);
  assert_int_equal(kvf_engine_write(e, peer.session, &w, 1), tls && *tls ? 0 : KVF_ECONNREFUSED);
  if (tls && *tls) {
    assert_int_equal(kvf_engine_peer_transport(e, peer.session, why, sizeof why), 0);
    printf("route: %s\n", why);
    assert_non_null(strstr(why, "set by the user"));
  }
  kvf_engine_destroy(e);
  e = make_engine("auto", 3000);
  assert_int_equal(kvf_engine_register(e, src, sizeof src), 0);
  assert_int_equal(kvf_engine_write(e, peer.session, &w, 1), 0);
  assert_int_equal(kvf_engine_peer_transport(e, peer.session, why, sizeof why), 0);
  printf("route: %s\n", why);
  assert_true(!strncmp(why, "tcp: auto", 9));
  kvf_engine_destroy(e);
  engine_peer_stop(&peer);
}

/* The target unregisters and re-registers a region while a writer streams
 * into it and into a region that stays: every batch either lands or is
 * refused with KVF_ERANGE, and the stable region keeps working. */
typedef struct churn {
  kvf_engine *w;
  const char *session;
  unsigned char *src;
  uint64_t stable, moving;
  int rounds, refused, other;
} churn;

static void *churn_writer(void *arg) {
  churn *c = arg;
  for (int i = 0; i < c->rounds; i++) {
    kvf_write w[2] = {{.src = (uint64_t)(uintptr_t)c->src, .dst = c->stable, .len = 64 * 1024},
                      {.src = (uint64_t)(uintptr_t)c->src, .dst = c->moving, .len = 64 * 1024}};
    int rc = kvf_engine_write(c->w, c->session, w, 2);
    if (rc == KVF_ERANGE) c->refused++;
    else if (rc) c->other++;
  }
  return NULL;
}

static void unregister_during_traffic_is_safe(void **state) {
  SKIP_WITHOUT_UCX();
  kvf_engine *t = make_engine("ucx", 5000), *w = make_engine("ucx", 5000);
  size_t len = 1u << 20;
  unsigned char *a = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  unsigned char *b = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  unsigned char *src = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  memset(src, 0x5a, len);
  assert_int_equal(kvf_engine_register(t, a, len), 0);
  assert_int_equal(kvf_engine_register(t, b, len), 0);
  assert_int_equal(kvf_engine_register(w, src, len), 0);
  churn c = {w, kvf_engine_session_id(t), src, (uint64_t)(uintptr_t)a, (uint64_t)(uintptr_t)b, 300, 0, 0};
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, churn_writer, &c), 0);
  for (int i = 0; i < 30; i++) {
    assert_int_equal(kvf_engine_unregister(t, b), 0);
    usleep(1000);
    assert_int_equal(kvf_engine_register(t, b, len), 0);
    usleep(1000);
  }
  pthread_join(th, NULL);
  printf("batches: %d, refused while unregistered: %d\n", c.rounds, c.refused);
  assert_int_equal(c.other, 0);
  /* After the churn the writer has caught up: both regions take writes. */
  kvf_write last[2] = {{.src = (uint64_t)(uintptr_t)src, .dst = c.stable, .len = len},
                       {.src = (uint64_t)(uintptr_t)src, .dst = c.moving, .len = len}};
  assert_int_equal(kvf_engine_write(w, c.session, last, 2), 0);
  kvf_engine_sync(t);
  assert_int_equal(memcmp(a, src, len), 0);
  assert_int_equal(memcmp(b, src, len), 0);
  kvf_engine_destroy(w);
  kvf_engine_destroy(t);
  munmap(a, len);
  munmap(b, len);
  munmap(src, len);
}

/* ---- completion trailers over UCX (two engines in this process) ---- */

enum { TR_THREADS = 4, TR_PER = 200 };

typedef struct trailer_run {
  kvf_engine *w, *t;
  void *wpool, *tpool;
  int callback_us; /* the target's trailer callback takes this long */
  atomic_uchar delivered[TR_THREADS * TR_PER];
  atomic_int early, ok, failed, pending; /* early: on_done(0) before the target had the trailer */
} trailer_run;

static trailer_run *g_tr;

static void tr_on_trailer(void *arg, const unsigned char *d, size_t len, const char *peer) {
  trailer_run *r = arg;
  (void)peer;
  uint32_t id;
  if (len < sizeof id) return;
  memcpy(&id, d, sizeof id);
  if (r->callback_us) usleep((useconds_t)r->callback_us);
  if (id < TR_THREADS * TR_PER) atomic_store(&r->delivered[id], 1);
}

typedef struct tr_ctx {
  trailer_run *r;
  uint32_t id;
} tr_ctx;

static void tr_on_done(void *arg, int st) {
  tr_ctx *c = arg;
  trailer_run *r = c->r;
  if (st == 0) {
    atomic_fetch_add(&r->ok, 1);
    if (!atomic_load(&r->delivered[c->id])) atomic_fetch_add(&r->early, 1);
  } else {
    atomic_fetch_add(&r->failed, 1);
  }
  atomic_fetch_sub(&r->pending, 1);
  free(c);
}

static int tr_submit(trailer_run *r, uint32_t id, size_t page) {
  kvf_write w = {.src = (uint64_t)(uintptr_t)r->wpool + page * PAGE,
                 .dst = (uint64_t)(uintptr_t)r->tpool + page * PAGE,
                 .len = PAGE};
  tr_ctx *c = malloc(sizeof *c);
  *c = (tr_ctx){r, id};
  unsigned char tr[64] = {0};
  memcpy(tr, &id, sizeof id);
  atomic_fetch_add(&r->pending, 1);
  int rc = kvf__engine_submit_req(r->w,
                                  &(kvf__submit){.session = kvf_engine_session_id(r->t),
                                                 .writes = &w,
                                                 .n = 1,
                                                 .trailer = tr,
                                                 .tlen = sizeof tr,
                                                 .on_done = tr_on_done,
                                                 .arg = c},
                                  NULL);
  if (rc) {
    atomic_fetch_sub(&r->pending, 1);
    free(c);
  }
  return rc;
}

static void *tr_writer(void *arg) {
  int t = (int)(intptr_t)arg;
  for (int i = 0; i < TR_PER; i++) {
    if (tr_submit(g_tr, (uint32_t)(t * TR_PER + i), (size_t)t)) break;
    while (atomic_load(&g_tr->pending) > 32) usleep(50);
  }
  return NULL;
}

static trailer_run *tr_start(int timeout_ms, int callback_us) {
  trailer_run *r = calloc(1, sizeof *r);
  r->callback_us = callback_us;
  r->t = make_engine("ucx", timeout_ms);
  r->w = make_engine("ucx", timeout_ms);
  assert_int_equal(kvf_engine_alloc_pool(r->t, 1 << 20, &r->tpool), 0);
  assert_int_equal(kvf_engine_alloc_pool(r->w, 1 << 20, &r->wpool), 0);
  assert_int_equal(kvf__engine_on_trailer(r->t, tr_on_trailer, r), 0);
  return r;
}

/* Several threads send one-chunk batches with trailers to one peer: each
 * batch completes only once the target's callback has had its own trailer
 * (the target acknowledges trailers in the order they were sent). */
static void trailer_acks_match_their_batches(void **state) {
  (void)state;
  SKIP_WITHOUT_UCX();
  trailer_run *r = g_tr = tr_start(10000, 300);
  pthread_t th[TR_THREADS];
  for (int i = 0; i < TR_THREADS; i++) pthread_create(&th[i], NULL, tr_writer, (void *)(intptr_t)i);
  for (int i = 0; i < TR_THREADS; i++) pthread_join(th[i], NULL);
  int64_t until = clock_deadline_ms(30000);
  while (atomic_load(&r->pending) > 0 && clock_now_ns() < until) usleep(1000);
  printf("trailer batches: %d ok, %d failed, %d completed before the target had their trailer\n",
         atomic_load(&r->ok), atomic_load(&r->failed), atomic_load(&r->early));
  assert_int_equal(atomic_load(&r->pending), 0);
  assert_int_equal(atomic_load(&r->ok), TR_THREADS * TR_PER);
  assert_int_equal(atomic_load(&r->early), 0);
  kvf_engine_destroy(r->w);
  kvf_engine_destroy(r->t);
  free(r);
}

/* A batch still waiting for its trailer's acknowledgement when the writer
 * engine is destroyed fails (its on_done runs), as over TCP. */
static void destroy_fails_batches_waiting_for_a_trailer_ack(void **state) {
  (void)state;
  SKIP_WITHOUT_UCX();
  trailer_run *r = tr_start(5000, 1500000); /* the target's callback holds the ack back 1.5 s */
  assert_int_equal(tr_submit(r, 0, 0), 0);
  usleep(200000);
  kvf_engine_destroy(r->w);
  assert_int_equal(atomic_load(&r->pending), 0);
  assert_int_equal(atomic_load(&r->failed), 1);
  kvf_engine_destroy(r->t);
  free(r);
}

/* The writer gave up on the target (a batch past its deadline), its
 * endpoint gone: the target's unregister is still acknowledged at once
 * instead of waiting out the 5 s cut-off. */
static void unregister_prompt_after_the_writer_gave_up(void **state) {
  (void)state;
  SKIP_WITHOUT_UCX();
  trailer_run *r = tr_start(1000, 1500000);
  void *extra = mmap(NULL, 1 << 20, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  assert_true(extra != MAP_FAILED);
  assert_int_equal(kvf_engine_register(r->t, extra, 1 << 20), 0);
  kvf_write w = {.src = (uint64_t)(uintptr_t)r->wpool, .dst = (uint64_t)(uintptr_t)r->tpool, .len = PAGE};
  char tr[8] = "x";
  assert_int_equal(kvf__engine_write_req(r->w, &(kvf__submit){.session = kvf_engine_session_id(r->t),
                                                              .writes = &w,
                                                              .n = 1,
                                                              .trailer = tr,
                                                              .tlen = sizeof tr}),
                   KVF_ETIMEDOUT);
  usleep(1000000); /* the target's callback returns; the writer has reaped the peer */
  int64_t t0 = clock_now_ns();
  kvf_engine_unregister(r->t, extra);
  double ms = (double)(clock_now_ns() - t0) / 1e6;
  printf("unregister after the writer gave up: %.1f ms\n", ms);
  assert_true(ms < 4000); /* the cut-off it must not wait out is 5 s; the rest is slack for load */
  kvf_engine_destroy(r->w);
  kvf_engine_destroy(r->t);
  munmap(extra, 1 << 20);
  free(r);
}

static int read_mode(void) {
  const char *m = getenv("KVFERRY_UCX_MODE");
  return !m || strcmp(m, "write");
}

static void peer_reads(engine_peer *peer, unsigned long long *got, unsigned long long *late,
                       unsigned long long *refused) {
  char reply[128];
  assert_int_equal(proc_ask(&peer->p, "reads", reply, sizeof reply, 5000), 0);
  assert_int_equal(sscanf(reply, "reads %llu %llu %llu", got, late, refused), 3);
}

/* The resumed target refused a chunk read after its lease (counted late,
 * within 5 s) and nothing landed in its memory (every byte still 0). Its
 * count of chunks read in *got. */
static void expect_late_and_untouched(engine_peer *peer, unsigned long long got0, unsigned long long late0,
                                      unsigned long long *got) {
  unsigned long long late, ref;
  char reply[64];
  int64_t until = clock_now_ns() + 5000000000ll;
  do {
    usleep(20000);
    peer_reads(peer, got, &late, &ref);
  } while (late == late0 && clock_now_ns() < until);
  printf("target after SIGCONT: counted %llu, late %llu\n", *got - got0, late - late0);
  assert_true(late > late0);
  assert_int_equal(proc_ask(&peer->p, "untouched 0", reply, sizeof reply, 5000), 0);
  assert_string_equal(reply, "ok");
}

/* A target process over UCX, and a writer engine here whose chunks have a
 * read lease of `lease_ms` and a 20 s deadline. */
static kvf_engine *reading_target_and_writer(engine_peer *peer, const char *lease_ms) {
  const char *args[] = {"--transport", "ucx", NULL};
  assert_int_equal(engine_peer_start_args(peer, PEER_BYTES, NULL, args), 0);
  setenv("KVFERRY_READ_LEASE_MS", lease_ms, 1);
  kvf_engine *e = make_engine("ucx", 20000);
  unsetenv("KVFERRY_READ_LEASE_MS");
  return e;
}

/* Read mode: a target stopped (SIGSTOP) past the lease of a chunk it was
 * told about. The writer's batch fails at the lease's end, the writer
 * reuses its sources with a new pattern, the target resumes: it does not
 * count the chunk (no read of reused sources passes as done), and nothing
 * of it lands in its memory; the next batch works. */
static void stopped_target_past_its_lease_counts_nothing(void **state) {
  (void)state;
  SKIP_WITHOUT_UCX();
  if (!read_mode()) skip();
  engine_peer peer;
  kvf_engine *e = reading_target_and_writer(&peer, "500");
  enum { N = 64 };
  unsigned char *src = malloc(N * PAGE);
  assert_non_null(src);
  assert_int_equal(kvf_engine_register(e, src, N * PAGE), 0);
  char reply[64];
  assert_int_equal(proc_ask(&peer.p, "fill 0", reply, sizeof reply, 5000), 0);
  memset(src, 0, PAGE);
  kvf_write warm = {.src = (uint64_t)(uintptr_t)src, .dst = peer.base, .len = PAGE};
  assert_int_equal(kvf_engine_write(e, peer.session, &warm, 1), 0); /* rendezvous done, read mode set */
  unsigned long long got0, late0, ref0, got;
  peer_reads(&peer, &got0, &late0, &ref0);

  memset(src, 0x11, N * PAGE);
  kvf_write w = {.src = (uint64_t)(uintptr_t)src, .dst = peer.base + PAGE, .len = N * PAGE - PAGE};
  assert_int_equal(kill(peer.p.pid, SIGSTOP), 0);
  assert_int_equal(kvf_test_wait_stopped(peer.p.pid, 5000), 0);
  kvf_batch *b = NULL;
  int64_t t0 = clock_now_ns();
  assert_int_equal(kvf_engine_submit(e, peer.session, &w, 1, &b), 0);
  int rc = kvf_batch_wait(b, -1);
  double waited = (double)(clock_now_ns() - t0) / 1e9;
  kvf_batch_destroy(b);
  printf("batch to a stopped target ended after %.3f s: %s\n", waited, kvf_strerror(rc));
  assert_int_equal(rc, KVF_ETIMEDOUT);
  assert_true(waited >= 0.45 && waited < 10); /* the lease, not the 20 s deadline */
  memset(src, 0x22, N * PAGE);                /* the sources are reused */
  usleep(200000);                             /* the target stays stopped past the lease */
  assert_int_equal(kill(peer.p.pid, SIGCONT), 0);
  expect_late_and_untouched(&peer, got0, late0, &got);
  assert_int_equal(got, got0);
  assert_int_equal(kvf_engine_write(e, peer.session, &warm, 1), 0); /* the pair works again */
  kvf_engine_unregister(e, src);
  kvf_engine_destroy(e);
  free(src);
  engine_peer_stop(&peer);
}

/* Read mode, a notice the target has not answered when the writer drops
 * its rendezvous connection (a submit reconnects a peer marked dead).
 * A live target (stopped here) may still read what is in its socket after
 * this side closed it, so the notice keeps its lease: it fails only at the
 * lease's end, and the target, resumed after that, counts nothing and
 * writes nothing. A target whose process is gone, with its end of the
 * connection not yet read by the writer's progress thread (a decode that
 * exited just after a send failed), reads nothing more: the notice ends at
 * once, not at its lease (a prefill's failed room stayed unfinished for the
 * default 30 s lease). */
static void notice_on_a_dropped_connection_keeps_its_lease_unless_the_target_is_gone(void **state) {
  (void)state;
  SKIP_WITHOUT_UCX();
#ifdef KVF_HAVE_UCX
  if (!read_mode()) skip();
  engine_peer peer;
  kvf_engine *e = reading_target_and_writer(&peer, "1500");
  enum { N = 4 };
  unsigned char *src = calloc(1, (N + 1) * PAGE); /* the last page stays 0: the warm-up writes' source */
  assert_non_null(src);
  assert_int_equal(kvf_engine_register(e, src, (N + 1) * PAGE), 0);
  char reply[64];
  assert_int_equal(proc_ask(&peer.p, "fill 0", reply, sizeof reply, 5000), 0);
  kvf_write warm = {.src = (uint64_t)(uintptr_t)(src + N * PAGE), .dst = peer.base, .len = PAGE};
  assert_int_equal(kvf_engine_write(e, peer.session, &warm, 1), 0); /* rendezvous done, read mode set */
  const char *pt = NULL, *pm = NULL;
  assert_int_equal(kvf__engine_peer_path(e, peer.session, &pt, &pm), 0);
  if (strcmp(pm, "read")) {
    printf("SKIP: the path is %s/%s, not read mode\n", pt, pm);
    engine_peer_stop(&peer);
    kvf_engine_destroy(e);
    free(src);
    skip();
  }
  unsigned long long got0, late0, ref0, got;
  peer_reads(&peer, &got0, &late0, &ref0);
  ucx_peer *p = NULL;
  assert_int_equal(kvf__ucx_peer_get(e->ucx, peer.session, &p), 0);

  /* A live target: the notice keeps its lease. */
  memset(src, 0x11, N * PAGE);
  kvf_write w = {.src = (uint64_t)(uintptr_t)src, .dst = peer.base + PAGE, .len = (N - 1) * PAGE};
  assert_int_equal(kill(peer.p.pid, SIGSTOP), 0);
  assert_int_equal(kvf_test_wait_stopped(peer.p.pid, 5000), 0);
  kvf_batch *b1 = NULL, *b2 = NULL;
  int64_t t0 = clock_now_ns();
  assert_int_equal(kvf_engine_submit(e, peer.session, &w, 1, &b1), 0); /* in its socket, not read */
  usleep(50000);
  kvf__ucx_peer_mark_dead(e->ucx, p, KVF_ECLOSED);
  assert_int_equal(kvf_engine_submit(e, peer.session, &warm, 1, &b2), 0); /* reconnects: closes the old one */
  int rc = kvf_batch_wait(b1, -1);
  double waited = (double)(clock_now_ns() - t0) / 1e9;
  printf("notice to a stopped target, its connection dropped here: ended after %.3f s: %s\n", waited,
         kvf_strerror(rc));
  assert_int_equal(rc, KVF_ETIMEDOUT);
  assert_true(waited >= 1.4);  /* the lease, not the reconnection */
  memset(src, 0x22, N * PAGE); /* the sources are reused */
  usleep(200000);
  assert_int_equal(kill(peer.p.pid, SIGCONT), 0);
  kvf_batch_wait(b2, -1); /* the reconnection, either way */
  kvf_batch_destroy(b1);
  kvf_batch_destroy(b2);
  expect_late_and_untouched(&peer, got0, late0, &got);

  /* A target that is gone, its end not read here yet: the notice ends at once. */
  assert_int_equal(kvf_engine_write(e, peer.session, &warm, 1), 0); /* connected again */
  assert_int_equal(kill(peer.p.pid, SIGSTOP), 0);
  assert_int_equal(kvf_test_wait_stopped(peer.p.pid, 5000), 0);
  assert_int_equal(kvf_engine_submit(e, peer.session, &w, 1, &b1), 0);
  usleep(50000);
  pthread_rwlock_rdlock(&p->rw);
  int pfd = p->fd;
  assert_true(pfd >= 0);
  epoll_ctl(((ucx_state *)e->ucx)->epfd, EPOLL_CTL_DEL, pfd, NULL); /* the progress thread does not see the end */
  pthread_rwlock_unlock(&p->rw);
  assert_int_equal(kill(peer.p.pid, SIGKILL), 0);
  int st = 0;
  assert_int_equal(waitpid(peer.p.pid, &st, 0), peer.p.pid);
  peer.p.pid = -1; /* reaped: engine_peer_stop finds no child left to wait for */
  usleep(50000);   /* its sockets are closed */
  kvf__ucx_peer_mark_dead(e->ucx, p, KVF_ECLOSED);
  t0 = clock_now_ns();
  assert_int_equal(kvf_engine_submit(e, peer.session, &warm, 1, &b2), 0); /* the reconnection's reset */
  rc = kvf_batch_wait(b1, -1);
  waited = (double)(clock_now_ns() - t0) / 1e9;
  printf("notice to a target that is gone: ended after %.3f s: %s\n", waited, kvf_strerror(rc));
  assert_int_equal(rc, KVF_ECLOSED);
  assert_true(waited < 1.0); /* its lease: 1.5 s (30 s by default) */
  kvf_batch_wait(b2, -1);
  kvf_batch_destroy(b1);
  kvf_batch_destroy(b2);
  kvf_engine_unregister(e, src);
  kvf_engine_destroy(e);
  free(src);
  engine_peer_stop(&peer);
#endif
}

#ifdef KVF_HAVE_UCX
/* Send a crafted ready notice on the writer's rendezvous connection. */
static void send_notice(kvf_engine *w, const char *session, const ucx_notice *n, const kvf_write *d) {
  ucx_state *u = w->ucx;
  ucx_peer *p = NULL;
  assert_int_equal(kvf__ucx_peer_get(u, session, &p), 0);
  pthread_mutex_lock(&p->mu);
  assert_true(p->fd >= 0);
  assert_int_equal(kvf__fd_send_all(p->fd, n, sizeof *n, clock_deadline_ms(2000)), 0);
  if (n->ndesc) assert_int_equal(kvf__fd_send_all(p->fd, d, n->ndesc * sizeof *d, clock_deadline_ms(2000)), 0);
  pthread_mutex_unlock(&p->mu);
}

static uint64_t wait_stat(kvf_engine *t, size_t field, uint64_t above) {
  kvf_engine_stats st;
  for (int i = 0; i < 500; i++) {
    kvf_engine_get_stats(t, &st);
    uint64_t v = *(const uint64_t *)(const void *)((const char *)&st + field);
    if (v > above) return v;
    usleep(10000);
  }
  return above;
}
#endif

/* Read mode, a hostile writer: ready notices with a source outside its
 * regions, a destination outside the target's memory, the epoch of a room
 * closed before, or no descriptor at all. Each is refused and counted;
 * nothing is read or written; the last one (malformed) ends the
 * connection, and the writer reconnects. */
static void hostile_ready_notices_refused(void **state) {
  (void)state;
  SKIP_WITHOUT_UCX();
#ifdef KVF_HAVE_UCX
  if (!read_mode()) skip();
  kvf_engine *t = make_engine("ucx", 5000), *w = make_engine("ucx", 5000);
  enum { N = 1 << 20 };
  unsigned char *src = malloc(N), *dst = calloc(1, N), *other = malloc(N);
  assert_true(src && dst && other);
  memset(src, 0x77, N);
  memset(other, 0x66, N);
  assert_int_equal(kvf_engine_register(w, src, N), 0);
  assert_int_equal(kvf_engine_register(t, dst, N), 0);
  const char *session = kvf_engine_session_id(t);
  kvf_write ok = {(uint64_t)(uintptr_t)src, (uint64_t)(uintptr_t)dst, PAGE, 1, 0, 0};
  assert_int_equal(kvf_engine_write(w, session, &ok, 1), 0); /* connection and read mode set up */
  kvf_engine_sync(t);
  memset(dst, 0, PAGE);
  kvf_engine_sync(t);
  uint64_t epoch = 0;
  assert_int_equal(kvf_engine_fence_open(t, 9, &epoch), 0);
  assert_int_equal(kvf_engine_fence_close(t, 9, epoch, 1000), 0);
  kvf_engine_stats st0, st;
  kvf_engine_get_stats(t, &st0);

  ucx_notice n = {UCX_NOTICE_MAGIC, 1, 1000001, 0, 0, clock_now_ns(), 2000000000ll, 0, 0};
  kvf_write d = {(uint64_t)(uintptr_t)other, (uint64_t)(uintptr_t)dst, N, 1, 0, 0}; /* not the writer's memory */
  send_notice(w, session, &n, &d);
  uint64_t refused = wait_stat(t, offsetof(kvf_engine_stats, reads_refused), st0.reads_refused);
  assert_int_equal(refused, st0.reads_refused + 1);
  d = (kvf_write){(uint64_t)(uintptr_t)src, (uint64_t)(uintptr_t)other, PAGE, 1, 0, 0}; /* not the target's */
  n.id++, n.sent_ns = clock_now_ns();
  send_notice(w, session, &n, &d);
  refused = wait_stat(t, offsetof(kvf_engine_stats, reads_refused), refused);
  assert_int_equal(refused, st0.reads_refused + 2);
  d = (kvf_write){(uint64_t)(uintptr_t)src, (uint64_t)(uintptr_t)dst, N, 1, 0, 0};
  n.id++, n.sent_ns = clock_now_ns(), n.tag = 9, n.epoch = epoch; /* a room closed before */
  send_notice(w, session, &n, &d);
  refused = wait_stat(t, offsetof(kvf_engine_stats, reads_refused), refused);
  assert_int_equal(refused, st0.reads_refused + 3);
  kvf_engine_get_stats(t, &st);
  assert_true(st.chunks_fenced > st0.chunks_fenced);
  assert_int_equal(st.batches_received, st0.batches_received);
  kvf_engine_sync(t);
  for (size_t i = 0; i < N; i += 4093) assert_int_equal(dst[i], 0);
  for (size_t i = 0; i < N; i += 4093) assert_int_equal(other[i], 0x66);

  n.id++, n.ndesc = 0, n.tag = 0, n.epoch = 0; /* malformed: the connection ends */
  send_notice(w, session, &n, NULL);
  wait_stat(t, offsetof(kvf_engine_stats, protocol_errors), st0.protocol_errors);
  kvf_engine_get_stats(t, &st);
  assert_true(st.protocol_errors > st0.protocol_errors);
  int rc = KVF_ECLOSED;
  for (int i = 0; i < 20 && rc; i++) { /* the writer sees the connection end, then reconnects */
    rc = kvf_engine_write(w, session, &ok, 1);
    if (rc) usleep(50000);
  }
  assert_int_equal(rc, 0);
  kvf_engine_destroy(w);
  kvf_engine_destroy(t);
  free(src);
  free(dst);
  free(other);
#endif
}

static int count_threads(void) {
  int n = kvf_test_count_threads();
  assert_true(n > 0);
  return n;
}

/* Idle writers cost the target no thread: 32 writers connected (each wrote
 * one page, so its rendezvous connection is open) add at most 4 threads to
 * the process once the workers that served them retired: the core workers
 * (2 each) of the listener's pool and of the rendezvous pool, started on
 * demand. The writers are engines in this process too; a UCX writer adds no
 * thread per peer. */
static void idle_writers_hold_no_thread(void **state) {
  SKIP_WITHOUT_UCX();
  enum { N = 32 };
  kvf_engine *t = make_engine("ucx", 10000);
  unsigned char *dst = mmap(NULL, N * PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  assert_int_equal(kvf_engine_register(t, dst, N * PAGE), 0);
  kvf_engine *w[N];
  static unsigned char src[N][PAGE];
  for (int i = 0; i < N; i++) {
    w[i] = make_engine("ucx", 10000);
    memset(src[i], i + 1, PAGE);
    assert_int_equal(kvf_engine_register(w[i], src[i], PAGE), 0);
  }
  int before = count_threads();
  for (int i = 0; i < N; i++) {
    kvf_write wr = {.src = (uint64_t)(uintptr_t)src[i], .dst = (uint64_t)(uintptr_t)(dst + i * PAGE), .len = PAGE};
    assert_int_equal(kvf_engine_write(w[i], kvf_engine_session_id(t), &wr, 1), 0);
  }
  for (int i = 0; i < N; i++) assert_int_equal(dst[i * PAGE + PAGE - 1], i + 1);
  int after = count_threads();
  /* Extra workers retire after UCX_CTL_RETIRE_MS (2 s) idle. */
  for (int64_t until = clock_deadline_ms(6000); after > before + 4 && clock_now_ns() < until;) {
    usleep(100 * 1000);
    after = count_threads();
  }
  printf("threads: %d before the writers connected, %d with %d idle writers\n", before, after, N);
  kvf_engine_stats st;
  kvf_engine_get_stats(t, &st);
  assert_int_equal(st.conns_refused, 0);
  assert_true(after <= before + 4);
  /* And they still write (each connection back from the event thread). */
  for (int i = 0; i < N; i++) {
    memset(src[i], 0x80 + i, PAGE);
    kvf_write wr = {.src = (uint64_t)(uintptr_t)src[i], .dst = (uint64_t)(uintptr_t)(dst + i * PAGE), .len = PAGE};
    assert_int_equal(kvf_engine_write(w[i], kvf_engine_session_id(t), &wr, 1), 0);
    assert_int_equal(dst[i * PAGE], 0x80 + i);
  }
  for (int i = 0; i < N; i++) kvf_engine_destroy(w[i]);
  kvf_engine_unregister(t, dst);
  kvf_engine_destroy(t);
  munmap(dst, N * PAGE);
}

#ifdef KVF_HAVE_UCX
typedef struct ucx_closer {
  kvf_engine *e;
  uint64_t tag, epoch;
  atomic_int done;
  int rc;
} ucx_closer;

static void *ucx_closer_main(void *p) {
  ucx_closer *c = p;
  c->rc = kvf_engine_fence_close(c->e, c->tag, c->epoch, 1000);
  atomic_store(&c->done, 1);
  return NULL;
}
#endif

/* Read mode: a notice for an open, bounded fence whose one descriptor has
 * 2^62 pieces of one byte at stride 0 (its spans stay inside both
 * regions): refused (its pieces overlap), and kvf_engine_fence_close
 * returns within its timeout (the bounds were once checked piece by piece
 * under the fence table's lock). */
static void notice_piece_count_cannot_stall_fences(void **state) {
  (void)state;
  SKIP_WITHOUT_UCX();
#ifdef KVF_HAVE_UCX
  if (!read_mode()) skip();
  kvf_engine *t = make_engine("ucx", 5000), *w = make_engine("ucx", 5000);
  enum { N = 1 << 20 };
  unsigned char *src = malloc(N), *dst = calloc(1, N);
  assert_true(src && dst);
  memset(src, 0x77, N);
  assert_int_equal(kvf_engine_register(w, src, N), 0);
  assert_int_equal(kvf_engine_register(t, dst, N), 0);
  const char *session = kvf_engine_session_id(t);
  kvf_write ok = {(uint64_t)(uintptr_t)src, (uint64_t)(uintptr_t)dst, PAGE, 1, 0, 0};
  assert_int_equal(kvf_engine_write(w, session, &ok, 1), 0); /* connection and read mode set up */
  uint64_t epoch = 0;
  assert_int_equal(kvf_engine_fence_open(t, 9, &epoch), 0);
  static uint64_t bounds[2];
  bounds[0] = (uint64_t)(uintptr_t)dst;
  bounds[1] = PAGE;
  assert_int_equal(kvf__engine_fence_bound(t, 9, epoch, bounds, 1), 0);
  ucx_notice n = {UCX_NOTICE_MAGIC, 1, 2000001, 9, epoch, clock_now_ns(), 2000000000ll, 0, 0};
  kvf_write d = {(uint64_t)(uintptr_t)src, (uint64_t)(uintptr_t)dst, 1, 1ull << 62, 0, 0};
  send_notice(w, session, &n, &d);
  usleep(300000);
  ucx_closer c = {.e = t, .tag = 9, .epoch = epoch};
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, ucx_closer_main, &c), 0);
  double t0 = clock_now_ns() / 1e9;
  while (!atomic_load(&c.done) && clock_now_ns() / 1e9 - t0 < 3.0) usleep(10000);
  if (!atomic_load(&c.done))
    fail_msg("kvf_engine_fence_close(timeout 1000 ms) still blocked after 3 s: one notice's piece count holds "
             "the fence table's lock (and the regions' read lock)");
  pthread_join(th, NULL);
  kvf_engine_destroy(w);
  kvf_engine_destroy(t);
  free(src);
  free(dst);
#endif
}

/* Read mode, same host: an untagged notice of one 1-byte piece repeated
 * 2^22 times at stride 0 (4 MiB of claimed bytes in a 48-byte descriptor;
 * refused now, its pieces overlap). The target's slice list stays bounded
 * whatever the descriptor's count (it once listed 96 MiB). */
static void notice_piece_count_allocation_bounded(void **state) {
  (void)state;
  SKIP_WITHOUT_UCX();
#ifdef KVF_HAVE_UCX
  if (!read_mode()) skip();
  kvf_engine *t = make_engine("ucx", 5000), *w = make_engine("ucx", 5000);
  enum { N = 1 << 20 };
  unsigned char *src = malloc(N), *dst = calloc(1, N);
  assert_true(src && dst);
  memset(src, 0x77, N);
  assert_int_equal(kvf_engine_register(w, src, N), 0);
  assert_int_equal(kvf_engine_register(t, dst, N), 0);
  const char *session = kvf_engine_session_id(t);
  kvf_write ok = {(uint64_t)(uintptr_t)src, (uint64_t)(uintptr_t)dst, PAGE, 1, 0, 0};
  assert_int_equal(kvf_engine_write(w, session, &ok, 1), 0);
  kvf_engine_stats st0;
  kvf_engine_get_stats(t, &st0);
  ucx_notice n = {UCX_NOTICE_MAGIC, 1, 3000001, 0, 0, clock_now_ns(), 4000000000ll, 0, 0};
  kvf_write d = {(uint64_t)(uintptr_t)src, (uint64_t)(uintptr_t)dst, 1, 1ull << 22, 0, 0};
  send_notice(w, session, &n, &d);
  uint64_t rx = wait_stat(t, offsetof(kvf_engine_stats, batches_received), st0.batches_received);
  uint64_t rf = wait_stat(t, offsetof(kvf_engine_stats, reads_refused), st0.reads_refused);
  ucx_state *u = t->ucx;
  size_t cap = 0;
  pthread_mutex_lock(&u->ctl_mu);
  for (ucx_ctl *c = u->ctls; c; c = c->next)
    if (c->loads_cap > cap) cap = c->loads_cap;
  pthread_mutex_unlock(&u->ctl_mu);
  printf("notice handled (received %llu -> %llu, refused %llu -> %llu); slice list: %zu entries, %zu bytes\n",
         (unsigned long long)st0.batches_received, (unsigned long long)rx, (unsigned long long)st0.reads_refused,
         (unsigned long long)rf, cap, cap * 24);
  kvf_engine_destroy(w);
  kvf_engine_destroy(t);
  free(src);
  free(dst);
  assert_true(cap <= 65536);
#endif
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(stopped_target_past_its_lease_counts_nothing),
      cmocka_unit_test(notice_on_a_dropped_connection_keeps_its_lease_unless_the_target_is_gone),
      cmocka_unit_test(hostile_ready_notices_refused),
      cmocka_unit_test(plain_and_strided_land_exact),
      cmocka_unit_test(private_memory_read_directly),
      cmocka_unit_test(allocated_pools_land_exact),
      cmocka_unit_test(shrinkable_pool_not_loaded_directly),
      cmocka_unit_test(large_batches_stream_and_land_exact),
      cmocka_unit_test(large_batch_is_one_notice_in_read_mode),
      cmocka_unit_test(held_notices_go_at_the_hold_end),
      cmocka_unit_test(device_memory_turns_read_mode_off),
      cmocka_unit_test(target_stopping_mid_answer_delays_no_other_peer),
      cmocka_unit_test(explicit_ucx_never_falls_back),
      cmocka_unit_test(other_host_without_rdma),
      cmocka_unit_test(registering_inside_a_pool_is_counted),
      cmocka_unit_test(writer_pools_mapped_ahead),
      cmocka_unit_test(routes_show_in_metrics),
      cmocka_unit_test(unregister_during_traffic_is_safe),
      cmocka_unit_test(trailer_acks_match_their_batches),
      cmocka_unit_test(destroy_fails_batches_waiting_for_a_trailer_ack),
      cmocka_unit_test(unregister_prompt_after_the_writer_gave_up),
      cmocka_unit_test(idle_writers_hold_no_thread),
      cmocka_unit_test(notice_piece_count_cannot_stall_fences),
      cmocka_unit_test(notice_piece_count_allocation_bounded),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

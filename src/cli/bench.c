/* `kvferry bench`: benchmarks that measure their own baseline in the same
 * run and print the ratio, because these machines are shared and noisy.
 *   kvferry bench engine  plain TCP loopback stream (baseline) vs the engine
 *                         on 1 MiB blocks and on batches of 256 scattered
 *                         32 KiB pages, with peers in separate processes
 *   kvferry bench rooms   whole requests through the KV managers: a prefill
 *                         instance (`kvferry-testpeer kv-peer`) in a child process,
 *                         the decode manager here; rooms per second and the
 *                         latency from the prefill's last send to the
 *                         decode's Success, 1- and 256-page requests, 1 and
 *                         64 in flight; baseline: a ZeroMQ PUSH/PULL round
 *                         trip between the same two kinds of process; and
 *                         fan-out (prefill TP 1 to decode TP 4, 4 to 1)
 *                         against TP 1 to 1 with the same bytes per
 *                         destination
 *   kvferry bench e2e     one llama-3.1-8b request of 4096 tokens (512 MiB)
 *                         through bootstrap + prefill + decode processes,
 *                         as `kvferry demo` runs them: transfer time (the
 *                         decode's M2 to its Success) against the time a
 *                         plain TCP stream measured in the same run needs
 *                         for the same bytes; memcpy for context
 *   kvferry bench layerwise  one llama-3.1-8b request whose prefill "computes"
 *                         each layer (busy work, --layer-ms) and sends each
 *                         layer's KV when computed, against the same request
 *                         sent whole after the last layer: compute time,
 *                         transfer time alone, time to Success for both, and
 *                         hidden_fraction (the share of the transfer that
 *                         finished inside the compute window)
 *   kvferry bench         engine, rooms and e2e
 * --json prints one JSON object per benchmark (engine and rooms: a `cases`
 * array with, per case, name and the case's figures: gbps, baseline_gbps,
 * ratio for engine; rooms_per_s, p50_us, p99_us for rooms); with all three,
 * one object {"engine": ..., "rooms": ..., "e2e": ...}.
 * --plot FILE.svg draws engine throughput against block size and end-to-end
 * throughput against request length as an SVG that kvferry writes itself
 * (svg.c; nothing to install). */
#include <arpa/inet.h>
#include <errno.h>
#include <getopt.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "bench.h"
#include "bench_floor.h"
#include "bench_ucx.h"
#include "cli.h"
#include "kvferry.h"
#include "pd.h"
#include "svg.h"
#include "tools/kvpool.h"
#include "tools/peer.h"

typedef struct bench_opts {
  int json;
  uint64_t block; /* --block: one extra case with this block size */
  int per_batch;
  int quick;             /* --quick: fewer rooms, for CI smoke runs */
  int room_pages;        /* --room-pages: one custom rooms case (with --inflight) */
  uint64_t pool_bytes;   /* --pool: engine cases' pool per side (and the baseline's) */
  int rooms;             /* --rooms: requests in the custom rooms case */
  const char *peers;     /* --peers: bench peers' idle-peer counts */
  uint64_t bytes;        /* per case */
  int inflight;          /* batches in flight */
  const char *plot;      /* --plot FILE.svg */
  double layer_ms;       /* --layer-ms: layerwise compute per layer; < 0 = the measured transfer per layer */
  int idle_compute;      /* --idle-compute: layerwise "compute" sleeps instead of busy work */
  const char *transport; /* --transport (NULL: $KVFERRY_TRANSPORT or auto) */
  int verify;            /* e2e --verify: also a pair in verify mode, requests alternating */
  int fanout_only;       /* rooms --fanout-only: only the fan-out cases */
} bench_opts;

/* A baseline's buffer: private memory, on transparent huge pages when
 * `huge` (as kvf_engine_alloc_pool gives a TCP engine), NULL on failure;
 * freed with munmap. */
static void *bench_buf(uint64_t len, int huge) {
  void *p = mmap(NULL, len, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return NULL;
  if (huge) madvise(p, len, MADV_HUGEPAGE);
  return p;
}

/* Baseline: one blocking TCP stream over loopback, 1 MiB writes, to a child
 * process that receives into a buffer; timed until the child confirms it has
 * every byte. With pool_bytes > 1 MiB both ends walk a pool of that size, as
 * the engine cases do (a page pool is not cache-resident); with 1 MiB both
 * ends reuse one cache-hot buffer. `huge`: the buffers on huge pages, as the
 * pool cases' (on this project's VMs the kernel's copies through ordinary
 * 4 KiB pages were slow until each page had been through them several
 * times: bench/README.md, "Memory"). */
static double bench_tcp_baseline(uint64_t total, uint64_t pool_bytes, int huge) {
  int ls = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t al = sizeof a;
  if (ls < 0 || bind(ls, (struct sockaddr *)&a, sizeof a) || listen(ls, 1) ||
      getsockname(ls, (struct sockaddr *)&a, &al))
    return 0;
  const size_t blk = 1 << 20;
  pid_t pid = fork();
  if (pid == 0) {
    int fd = accept(ls, NULL, NULL);
    char *buf = bench_buf(pool_bytes, huge);
    if (!buf) _exit(1);
    memset(buf, 0, pool_bytes);
    /* Ready only now: faulting in the pool (about 2 s per GiB on these
     * VMs) is not part of the stream's time. */
    char ready = 1;
    if (fd < 0 || send(fd, &ready, 1, 0) != 1) _exit(1);
    uint64_t got = 0;
    while (fd >= 0 && got < total) {
      ssize_t r = recv(fd, buf + got % pool_bytes, blk, MSG_WAITALL);
      if (r <= 0) _exit(1);
      got += (uint64_t)r;
    }
    char ok = 1;
    if (send(fd, &ok, 1, 0) != 1) _exit(1);
    _exit(0);
  }
  close(ls);
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  char *buf = bench_buf(pool_bytes, huge);
  double gbps = 0;
  if (fd >= 0 && buf && connect(fd, (struct sockaddr *)&a, sizeof a) == 0) {
    memset(buf, 7, pool_bytes);
    char ready;
    if (recv(fd, &ready, 1, MSG_WAITALL) != 1) goto done;
    double t0 = cli_now_s();
    uint64_t sent = 0;
    while (sent < total) {
      ssize_t r = send(fd, buf + sent % pool_bytes, blk - sent % blk, MSG_NOSIGNAL);
      if (r <= 0) break;
      sent += (uint64_t)r;
    }
    char ok;
    if (sent >= total && recv(fd, &ok, 1, MSG_WAITALL) == 1) gbps = total / (cli_now_s() - t0) / 1e9;
  }
done:
  if (fd >= 0) close(fd);
  if (buf) munmap(buf, pool_bytes);
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
  return gbps;
}

/* Engine case: batches of `per_batch` blocks of `block` bytes at random
 * block-aligned offsets of a 256 MiB pool on both sides (with `sweep`, block
 * k of one pool to block k of the other instead, in order), `inflight`
 * batches in flight, until `total` bytes have been confirmed. */
static double bench_engine_case(kvf_engine *e, engine_peer *peer, unsigned char *pool, uint64_t pool_bytes,
                                uint64_t block, size_t per_batch, int inflight, uint64_t total, int sweep,
                                int *failed) {
  uint64_t slots = pool_bytes / block, rng = 0x12345678, k = 0;
  size_t nb = (size_t)inflight;
  kvf_write *w = calloc(nb * per_batch, sizeof *w);
  kvf_batch **b = calloc(nb, sizeof *b);
  if (!w || !b) {
    free(w);
    free(b);
    *failed = 1;
    return 0;
  }
  uint64_t per = block * per_batch, submitted = 0, done = 0;
  double t0 = cli_now_s();
  size_t slot = 0;
  while (done < total && !*failed) {
    if (b[slot]) { /* oldest batch in this slot: wait for it first */
      if (kvf_batch_wait(b[slot], -1)) *failed = 1;
      kvf_batch_destroy(b[slot]);
      b[slot] = NULL;
      done += per;
    }
    if (submitted < total) {
      kvf_write *ws = &w[slot * per_batch];
      for (size_t i = 0; i < per_batch; i++, k++) {
        uint64_t from = sweep ? k % slots : cli_rng_next(&rng) % slots;
        uint64_t to = sweep ? k % slots : cli_rng_next(&rng) % slots;
        ws[i] = (kvf_write){.src = (uint64_t)(uintptr_t)pool + from * block,
                            .dst = peer->base + to * block,
                            .len = block};
      }
      if (kvf_engine_submit(e, peer->session, ws, per_batch, &b[slot])) *failed = 1;
      submitted += per;
    }
    slot = (slot + 1) % nb;
  }
  for (size_t i = 0; i < nb; i++)
    if (b[i]) {
      if (kvf_batch_wait(b[i], -1)) *failed = 1;
      kvf_batch_destroy(b[i]);
    }
  double dt = cli_now_s() - t0;
  free(w);
  free(b);
  return *failed ? 0 : done / dt / 1e9;
}

/* An engine, a registered 256 MiB pool and a peer process with its own:
 * what every engine case runs on. */
typedef struct engine_rig {
  engine_peer peer;
  int peer_up;
  unsigned char *pool;
  uint64_t pool_bytes;
  kvf_engine *e;
  int alloc; /* pools from kvf_engine_alloc_pool at both ends */
} engine_rig;

static void engine_rig_stop(engine_rig *g) {
  if (g->alloc && g->pool) kvf_engine_free_pool(g->e, g->pool);
  kvf_engine_destroy(g->e);
  if (g->peer_up) engine_peer_stop(&g->peer);
  if (!g->alloc && g->pool && g->pool != MAP_FAILED) munmap(g->pool, g->pool_bytes);
  memset(g, 0, sizeof *g);
}

static int engine_rig_start(engine_rig *g, uint64_t pool_bytes, int alloc) {
  memset(g, 0, sizeof *g);
  g->pool_bytes = pool_bytes;
  g->alloc = alloc;
  const char *pool_arg[] = {"--pool", NULL};
  if (engine_peer_start_args(&g->peer, g->pool_bytes, NULL, alloc ? pool_arg : NULL)) return -1;
  g->peer_up = 1;
  int bad = kvf_engine_create(NULL, &g->e);
  if (!bad && alloc) {
    void *p = NULL;
    bad = kvf_engine_alloc_pool(g->e, g->pool_bytes, &p);
    g->pool = p;
  } else if (!bad) {
    g->pool = mmap(NULL, g->pool_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    bad = g->pool == MAP_FAILED || kvf_engine_register(g->e, g->pool, g->pool_bytes);
  }
  if (bad) {
    fprintf(stderr, "bench: cannot set up the engine\n");
    engine_rig_stop(g);
    return -1;
  }
  memset(g->pool, 3, g->pool_bytes);
  /* Warm up, untimed: the connections, and every block of both pools moved
   * once, as the same-run baselines touch every page before they are timed
   * (bench_floor.c). On these VMs the kernel's first store into a page is
   * slow even after the process itself stored to it (bench/README.md,
   * "Memory"): a private-memory read, whose target's kernel copies into the
   * pool (process_vm_readv), ran at 5.6-6.7 GB/s into pages the kernel had
   * not stored to before against 13.7-18.1 GB/s after (two threads, a
   * throwaway test), and random blocks left about a third of the pool for
   * the timed case to warm. */
  int failed = 0;
  bench_engine_case(g->e, &g->peer, g->pool, g->pool_bytes, 1 << 20, 16, 2, g->pool_bytes, 1, &failed);
  return 0;
}

typedef struct engine_case {
  const char *name;
  uint64_t block;
  size_t per_batch;
  int alloc; /* into pools from kvf_engine_alloc_pool */
  double gbps, memcpy2, ucx_raw;
  const char *mode;  /* UCX: "read" (the target reads, the default) or "write"; NULL over tcp */
  double write_gbps; /* a read case: its write twin's figure of this run */
  double tcp_base;   /* its TCP baseline: through huge pages for a _pool case over TCP */
  double cma2;       /* private memory over UCX: two threads' process_vm_readv of the same blocks */
} engine_case;

/* Over UCX (explicit, or auto between two processes here) the same-run
 * baselines include a raw UCX put loop, and a second set of cases moves
 * between pools the engines allocated (mapped directly on one host). */
static int bench_uses_ucx(void) {
  const char *t = getenv("KVFERRY_TRANSPORT");
  return strstr(kvf_engine_transports(), "ucx") && (!t || strcmp(t, "tcp"));
}

/* Set the UCX mode the next engines (and the peers they start) use; the
 * caller's setting comes back with mode NULL. */
static void bench_ucx_mode(const char *mode, char *saved, size_t cap) {
  if (mode) {
    const char *cur = getenv("KVFERRY_UCX_MODE");
    snprintf(saved, cap, "%s", cur ? cur : "");
    setenv("KVFERRY_UCX_MODE", mode, 1);
  } else if (*saved) {
    setenv("KVFERRY_UCX_MODE", saved, 1);
  } else {
    unsetenv("KVFERRY_UCX_MODE");
  }
}

static int bench_engine(const bench_opts *o) {
  const uint64_t pool_bytes = o->pool_bytes;
  int ucx = bench_uses_ucx();
  double base = bench_tcp_baseline(o->bytes, pool_bytes, 0);
  /* The pool cases over TCP walk pools on huge pages: so does their baseline. */
  double base_huge = ucx ? 0 : bench_tcp_baseline(o->bytes, pool_bytes, 1);
  double base_hot = bench_tcp_baseline(o->bytes, 1 << 20, 0);
  int rc = 1, failed = 0;
  /* Over UCX every case runs in read mode and in write mode, the read case
   * first with its write twin's figure beside it. */
  engine_case cases[8] = {{"engine_1MiB_blocks", 1 << 20, 16, 0, 0, 0, 0, NULL, 0, 0, 0},
                          {"engine_256x32KiB_scattered", 32 << 10, 256, 0, 0, 0, 0, NULL, 0, 0, 0},
                          {"engine_1MiB_blocks_pool", 1 << 20, 16, 1, 0, 0, 0, NULL, 0, 0, 0},
                          {"engine_256x32KiB_scattered_pool", 32 << 10, 256, 1, 0, 0, 0, NULL, 0, 0, 0}};
  size_t nc = 4;
  if (o->block) { /* a single custom case (and its pool twin) replaces the standard ones */
    cases[0] = (engine_case){"engine_custom", o->block, (size_t)o->per_batch, 0, 0, 0, 0, NULL, 0, 0, 0};
    cases[1] = (engine_case){"engine_custom_pool", o->block, (size_t)o->per_batch, 1, 0, 0, 0, NULL, 0, 0, 0};
    nc = 2;
  }
  if (ucx) {
    for (size_t i = nc; i-- > 0;) {
      cases[2 * i] = cases[i];
      cases[2 * i + 1] = cases[i];
      cases[2 * i].mode = "read";
      cases[2 * i + 1].mode = "write";
    }
    nc *= 2;
  }
  static const char *const modes[] = {"read", "write"};
  for (int m = 0; m < (ucx ? 2 : 1) && !failed; m++)
    for (int alloc = 0; alloc < 2 && !failed; alloc++) {
      engine_rig g;
      int any = 0;
      for (size_t i = 0; i < nc; i++) any |= cases[i].alloc == alloc && (!ucx || !strcmp(cases[i].mode, modes[m]));
      if (!any) continue;
      char saved[16] = "";
      if (ucx) bench_ucx_mode(modes[m], saved, sizeof saved);
      int up = engine_rig_start(&g, pool_bytes, alloc);
      if (ucx) bench_ucx_mode(NULL, saved, sizeof saved);
      if (up) return 1;
      for (size_t i = 0; i < nc && !failed; i++)
        if (cases[i].alloc == alloc && (!ucx || !strcmp(cases[i].mode, modes[m])))
          cases[i].gbps = bench_engine_case(g.e, &g.peer, g.pool, pool_bytes, cases[i].block, cases[i].per_batch,
                                            o->inflight, o->bytes, 0, &failed);
      engine_rig_stop(&g);
    }
  if (failed) {
    fprintf(stderr, "bench: a batch failed\n");
    goto out;
  }
  for (size_t i = 0; i < nc; i++) {
    cases[i].tcp_base = cases[i].alloc && base_huge > 0 ? base_huge : base;
    if (ucx && i % 2) { /* the write twin: same baselines */
      cases[i].memcpy2 = cases[i - 1].memcpy2, cases[i].ucx_raw = cases[i - 1].ucx_raw;
      cases[i].cma2 = cases[i - 1].cma2;
      cases[i - 1].write_gbps = cases[i].gbps;
      continue;
    }
    cases[i].memcpy2 = bench_memcpy2_gbps(pool_bytes, cases[i].block, cases[i].per_batch, o->bytes);
    if (ucx)
      cases[i].ucx_raw = bench_ucx_raw_gbps(pool_bytes, cases[i].block, cases[i].per_batch, o->inflight, o->bytes,
                                            cases[i].alloc);
    if (ucx && !cases[i].alloc) /* private memory on one host comes down to CMA: the bare figure */
      cases[i].cma2 = bench_cma2_gbps(pool_bytes, cases[i].block, cases[i].per_batch, o->bytes);
  }
  const char *tls = getenv("UCX_TLS");
  const char *transport = getenv("KVFERRY_TRANSPORT") ? getenv("KVFERRY_TRANSPORT") : "auto";
  if (o->json) {
    printf("{\"bench\":\"engine\",\"transport\":\"%s\",\"ucx_tls\":\"%s\",\"bytes_per_case\":%llu,"
           "\"inflight\":%d,\"cases\":[",
           transport, tls ? tls : "", (unsigned long long)o->bytes, o->inflight);
    for (size_t i = 0; i < nc; i++) {
      engine_case *c = &cases[i];
      double b = c->tcp_base;
      printf("%s{\"name\":\"%s%s%s\",\"gbps\":%.3f,\"baseline_gbps\":%.3f,\"ratio\":%.3f,\"memcpy2_gbps\":%.3f,"
             "\"memcpy_ratio\":%.3f",
             i ? "," : "", c->name, c->mode ? "_" : "", c->mode ? c->mode : "", c->gbps, b,
             b > 0 ? c->gbps / b : 0, c->memcpy2, c->memcpy2 > 0 ? c->gbps / c->memcpy2 : 0);
      if (ucx)
        printf(",\"mode\":\"%s\",\"ucx_raw_gbps\":%.3f,\"ucx_ratio\":%.3f", c->mode, c->ucx_raw,
               c->ucx_raw > 0 ? c->gbps / c->ucx_raw : 0);
      if (ucx && c->write_gbps > 0) printf(",\"read_over_write\":%.3f", c->gbps / c->write_gbps);
      if (c->cma2 > 0) printf(",\"cma2_gbps\":%.3f,\"cma_ratio\":%.3f", c->cma2, c->gbps / c->cma2);
      printf("}");
    }
    printf("],\"pool_bytes\":%llu,\"baseline\":\"plain TCP loopback, one stream, 1 MiB writes through a pool of "
           "pool_bytes at both ends\",\"memcpy2\":\"2-thread memcpy of the same blocks between two pools of "
           "pool_bytes\",\"ucx_raw\":\"raw UCP put loop of the same blocks into a child process, same "
           "UCX_TLS\",\"cma2\":\"private-memory cases: 2 threads read the same blocks from a child process with "
           "process_vm_readv (the kernel's cross-memory attach), no kvferry "
           "code\",\"baseline_hot_gbps\":%.3f,\"baseline_huge_gbps\":%.3f,\"baseline_huge\":\"the same "
           "stream through pools on transparent huge pages: the baseline of the _pool cases over TCP\"}\n",
           (unsigned long long)pool_bytes, base_hot, base_huge);
  } else {
    printf("transport %s%s%s\n", transport, tls ? ", UCX_TLS=" : "", tls ? tls : "");
    printf("baseline: plain TCP loopback, one stream, 1 MiB writes through a %llu MiB pool at both ends\n"
           "          (the engine cases' footprint): %.2f GB/s\n"
           "          (same, one cache-hot 1 MiB buffer at both ends: %.2f GB/s)\n"
           "memcpy2:  2 threads memcpy the same blocks between two pools of that size\n%s",
           (unsigned long long)(pool_bytes >> 20), base, base_hot,
           ucx ? "ucx raw:  a raw UCP put loop of the same blocks into a child process, same UCX_TLS\n"
                 "mode:     read = the target reads each chunk (the default), write = the writer puts\n"
                 "cma2:     private-memory cases: 2 threads process_vm_readv the same blocks from a child "
                 "process\n"
               : "");
    if (base_huge > 0)
      printf("          (same through pools on huge pages, the _pool cases' baseline: %.2f GB/s)\n", base_huge);
    printf("%-38s %8s %8s %6s %8s %6s", "case", "GB/s", "tcp", "ratio", "memcpy2", "ratio");
    if (ucx) printf(" %8s %6s %6s %8s %6s", "ucx raw", "ratio", "r/w", "cma2", "ratio");
    printf("\n");
    for (size_t i = 0; i < nc; i++) {
      engine_case *c = &cases[i];
      char name[64];
      double b = c->tcp_base;
      snprintf(name, sizeof name, "%s%s%s", c->name, c->mode ? "_" : "", c->mode ? c->mode : "");
      printf("%-38s %8.2f %8.2f %6.2f %8.2f %6.2f", name, c->gbps, b, b > 0 ? c->gbps / b : 0, c->memcpy2,
             c->memcpy2 > 0 ? c->gbps / c->memcpy2 : 0);
      if (ucx) printf(" %8.2f %6.2f", c->ucx_raw, c->ucx_raw > 0 ? c->gbps / c->ucx_raw : 0);
      if (ucx && c->write_gbps > 0) printf(" %6.2f", c->gbps / c->write_gbps);
      else if (ucx) printf(" %6s", "-");
      if (c->cma2 > 0) printf(" %8.2f %6.2f", c->cma2, c->gbps / c->cma2);
      printf("\n");
    }
  }
  rc = 0;
out:
  return rc;
}

/* Which transport and UCX mode a benchmark ran on: the one asked for
 * ($KVFERRY_TRANSPORT or auto, $KVFERRY_UCX_MODE or read) and, with the
 * decode's manager in this process, what its engine runs and whether a
 * prefill connected in read mode. As JSON members, or as one text line. */
void cli_bench_path(FILE *out, kvf_manager *m, int json) {
  const char *asked = getenv("KVFERRY_TRANSPORT"), *mode = getenv("KVFERRY_UCX_MODE");
  if (!asked || !*asked) asked = "auto";
  if (!mode || !*mode) mode = "read";
  const char *engine = m ? kvf_engine_transport(kvf_manager_engine(m)) : "";
  const char *used = "";
  if (m) {
    kvf_engine_stats st;
    kvf_engine_get_stats(kvf_manager_engine(m), &st);
    used = strcmp(engine, "ucx") ? "tcp"
           : st.peers_read       ? "read"
           : st.batches_received ? "write or tcp"
                                 : "none yet";
  }
  if (json)
    fprintf(out, ",\"transport\":\"%s\",\"ucx_mode\":\"%s\",\"engine\":\"%s\",\"mode\":\"%s\"", asked, mode,
            engine, used);
  else
    fprintf(out, "path: transport %s, ucx_mode %s%s%s%s%s\n", asked, mode, m ? "; decode engine " : "", engine,
            m ? ", mode used " : "", used);
}

static int cmp_dbl(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

typedef struct rooms_slot {
  kvf_receiver *rx;
  int64_t room;
  int64_t *pages;
  int active;
} rooms_slot;

#define ROOMS_LAYERS 2
#define ROOMS_ITEM 4096
#define ROOMS_POOL_PAGES 20000

/* The in-process decode of `bench rooms` and `bench layerwise`: its engine
 * and its KV pool. Over TCP the pool comes from kvf_engine_alloc_pool
 * (cli_rank_engine; KVFERRY_CLI_MEMORY=plain for ordinary pages): the
 * kernel copies every byte into it, through huge pages. Over UCX it stays
 * ordinary private memory, as a caller's tensor would be: in read mode this
 * decode copies into it itself, and a UCX pool as the destination measured
 * slower here (256-page rooms, bench/README.md "Memory"). 0, or -1 with
 * nothing left to free. */
static int bench_decode_pool(kvpool *pool, size_t layers, size_t pages, uint64_t item, kvf_engine **e) {
  int use_pool = 0;
  if (cli_rank_engine(NULL, e, &use_pool)) return -1;
  if (strcmp(kvf_engine_transport(*e), "tcp")) use_pool = 0;
  kvpool_use_engine(use_pool ? *e : NULL);
  int rc = kvpool_init(pool, layers, pages, item);
  kvpool_use_engine(NULL);
  if (rc) kvf_engine_destroy(*e);
  return rc ? -1 : 0;
}

/* Once connected to a writer on this host, a UCX reader maps the writer's
 * pools ahead on a thread of its own (ucx_warm.c), taking up to a few
 * hundred ms of a core; rooms read meanwhile still fault their pages in
 * themselves. A long-running decode is past that, so a benchmark of its
 * steady state waits (at most 5 s) until the engine's bytes_mapped_ahead
 * stops growing. */
static void bench_wait_mapped_ahead(kvf_engine *e) {
  kvf_engine_stats a, b;
  kvf_engine_get_stats(e, &a);
  for (double until = cli_now_s() + 5; cli_now_s() < until; a = b) {
    usleep(20 * 1000);
    kvf_engine_get_stats(e, &b);
    if (b.bytes_mapped_ahead == a.bytes_mapped_ahead) break;
  }
}

/* The prefill peer's wake-up counter (its `wakeups` command); -1 on failure. */
static long long peer_wakeups(proc *peer) {
  char line[128];
  long long n = -1;
  fprintf(peer->in, "wakeups\n");
  fflush(peer->in);
  for (int i = 0; i < 1000 && n < 0; i++) {
    if (proc_read_line(peer, line, sizeof line, 5000)) break;
    if (sscanf(line, "wakeups %lld", &n) != 1) n = -1;
  }
  return n;
}

/* What each thread of one side used between two snapshots, per room, into
 * out; the side's total beyond its live threads goes to "(ended threads)".
 * Returns the side's total: the process's, or its threads' sum when that is
 * more (the clocks are read at different instants, in 10 ms ticks, so the
 * threads can come out a tick ahead), so the breakdown adds up to it. */
static long long cpu_side(rooms_cpu *out, const char *side, const proc_threads_cpu *a, const proc_threads_cpu *b,
                          long long total_ns, int rooms) {
  long long live = 0;
  for (size_t i = 0; i < b->n; i++) {
    long long before = 0;
    for (size_t j = 0; j < a->n; j++)
      if (!strcmp(a->t[j].name, b->t[i].name)) before = a->t[j].ns;
    long long d = b->t[i].ns - before;
    if (d <= 0) continue;
    live += d;
    if (out->n < ROOMS_CPU_MAX) {
      out->t[out->n].side = side;
      char *nm = out->t[out->n].thread;
      snprintf(nm, sizeof out->t[out->n].thread, "%s", b->t[i].name);
      for (char *q = nm; *q; q++)
        if (*q == '"' || *q == '\\' || (unsigned char)*q < 0x20) *q = '?'; /* printed in JSON as is */
      out->t[out->n++].us_per_room = d / 1e3 / rooms;
    }
  }
  if (total_ns > live && out->n < ROOMS_CPU_MAX) {
    out->t[out->n].side = side;
    snprintf(out->t[out->n].thread, sizeof out->t[out->n].thread, "(ended threads)");
    out->t[out->n++].us_per_room = (total_ns - live) / 1e3 / rooms;
  }
  return total_ns > live ? total_ns : live;
}

static int cmp_cpu(const void *a, const void *b) {
  double x = ((const rooms_cpu_thread *)a)->us_per_room, y = ((const rooms_cpu_thread *)b)->us_per_room;
  return x < y ? 1 : x > y ? -1 : 0;
}

/* One case: `rooms` requests of `pages` pages, `inflight` at a time. */
int cli_bench_rooms_case(kvf_manager *m, kvpool *pool, proc *peer, const char *baddr, rooms_case *c,
                         int64_t base_room) {
  rooms_slot *slots = calloc((size_t)c->inflight, sizeof *slots);
  double *t_success = calloc((size_t)c->rooms, sizeof *t_success);
  double *t_send = calloc((size_t)c->rooms, sizeof *t_send);
  double *lat = calloc((size_t)c->rooms, sizeof *lat);
  int rc = -1, next = 0, finished = 0, reported = 0, failed = 0;
  uint64_t rng = 0x9e3779b97f4a7c15ULL;
  if (!slots || !t_success || !t_send || !lat) goto out;
  for (int i = 0; i < c->inflight; i++)
    if (!(slots[i].pages = malloc(c->pages * sizeof(int64_t)))) goto out;
  long long wake_peer0 = peer_wakeups(peer);
  uint64_t wake_here0 = kvf_wakeups();
  proc_threads_cpu th_here0, th_peer0, th_here1, th_peer1;
  int by_thread = c->cpu && !proc_threads_cpu_get(0, &th_here0) && !proc_threads_cpu_get(peer->pid, &th_peer0);
  long long cpu_here0 = proc_cpu_ns(0), cpu_peer0 = proc_cpu_ns(peer->pid);
  /* With one room in flight, whose latency this loop measures, it sleeps on
   * the manager's event fd (and the peer's lines when some are due), as a
   * scheduler waiting for its one request would: clear it, poll the rooms,
   * then wait, so no change is missed and a Success wakes it at once (a nap
   * costs its timer slack, 50 us, on every room). With many in flight it
   * naps between turns, as a scheduler stepping a batch polls once a step:
   * waking on every room's change cost more wake-ups than it saved here
   * (1-page rooms, 64 in flight: 9.4-10.2k/s against 12.4-13.1k/s). */
  int efd = c->inflight == 1 ? kvf_manager_event_fd(m) : -1;
  double t0 = cli_now_s(), limit = t0 + 120;
  while ((finished < c->rooms || reported < c->rooms) && cli_now_s() < limit) {
    int progress = 0;
    if (efd >= 0) kvf_manager_event_clear(m);
    for (int i = 0; i < c->inflight; i++) {
      rooms_slot *s = &slots[i];
      if (s->active) {
        int st = kvf_receiver_poll(s->rx);
        if (st != KVF_POLL_SUCCESS && st != KVF_POLL_FAILED) continue;
        t_success[s->room - base_room] = st == KVF_POLL_SUCCESS ? cli_now_s() : -1;
        if (st != KVF_POLL_SUCCESS) failed++;
        kvf_receiver_destroy(s->rx);
        kvpool_give(pool, s->pages, c->pages);
        s->active = 0;
        finished++;
        progress = 1;
      }
      if (!s->active && next < c->rooms) {
        s->room = base_room + next++;
        if (kvf_receiver_create(m, baddr, s->room, &s->rx) || kvpool_take(pool, c->pages, &rng, s->pages) ||
            kvf_receiver_init(s->rx, s->pages, c->pages, 0, 0, NULL, 0))
          goto out;
        /* One in flight: the prefill sends once the M2 is there (wait-m2),
         * so the latency is the transfer's and the completion's, not the
         * M2's race with this command. */
        fprintf(peer->in, "send %lld %zu 0 7 0 0 0 %d\n", (long long)s->room, c->pages, c->inflight == 1);
        s->active = 1;
        progress = 1;
      }
    }
    fflush(peer->in); /* one write for the rooms started this turn */
    char line[512];
    /* The peer's `done` lines lag our Success; read them only when some are
     * due, so an idle loop does not pay a poll() per turn. */
    while (reported < finished && proc_read_line(peer, line, sizeof line, 0) == 0) {
      long long room, ns;
      int st;
      if (sscanf(line, "done %lld %d %lld", &room, &st, &ns) == 3 && room >= base_room &&
          room < base_room + c->rooms) {
        t_send[room - base_room] = ns / 1e9;
        reported++;
        progress = 1;
      }
    }
    /* Nothing moved: sleep until the room changes or a line comes (the
     * timeout only bounds a missed wake-up), or nap. */
    if (!progress && efd >= 0) {
      struct pollfd pf[2] = {{.fd = efd, .events = POLLIN}, {.fd = peer->out_fd, .events = POLLIN}};
      poll(pf, reported < finished ? 2 : 1, 100);
    } else if (!progress) {
      usleep(100);
    }
  }
  double dt = cli_now_s() - t0;
  long long cpu_here1 = proc_cpu_ns(0), cpu_peer1 = proc_cpu_ns(peer->pid);
  c->cpu_us_per_room = cpu_here0 >= 0 && cpu_peer0 >= 0 && cpu_here1 >= cpu_here0 && cpu_peer1 >= cpu_peer0
                           ? (double)(cpu_here1 - cpu_here0 + cpu_peer1 - cpu_peer0) / 1e3 / c->rooms
                           : -1;
  if (c->cpu) c->cpu->n = 0;
  if (by_thread && c->cpu_us_per_room >= 0 && !proc_threads_cpu_get(0, &th_here1) &&
      !proc_threads_cpu_get(peer->pid, &th_peer1)) {
    long long here = cpu_side(c->cpu, "decode", &th_here0, &th_here1, cpu_here1 - cpu_here0, c->rooms);
    long long peer_ns = cpu_side(c->cpu, "prefill", &th_peer0, &th_peer1, cpu_peer1 - cpu_peer0, c->rooms);
    c->cpu_us_per_room = (double)(here + peer_ns) / 1e3 / c->rooms;
    qsort(c->cpu->t, c->cpu->n, sizeof c->cpu->t[0], cmp_cpu);
  }
  uint64_t wake_here = kvf_wakeups() - wake_here0;
  long long wake_peer1 = peer_wakeups(peer);
  c->wakeups_per_room = wake_peer0 >= 0 && wake_peer1 >= wake_peer0
                            ? (double)(wake_here + (uint64_t)(wake_peer1 - wake_peer0)) / c->rooms
                            : -1;
  if (finished < c->rooms || failed) {
    fprintf(stderr, "bench rooms: %s: %d of %d finished, %d failed\n", c->name, finished, c->rooms, failed);
    goto out;
  }
  int n = 0;
  for (int i = 0; i < c->rooms; i++)
    if (t_success[i] > 0 && t_send[i] > 0) lat[n++] = (t_success[i] - t_send[i]) * 1e6;
  qsort(lat, (size_t)n, sizeof *lat, cmp_dbl);
  c->rooms_per_s = c->rooms / dt;
  c->p50_us = n ? lat[n / 2] : 0;
  c->p99_us = n ? lat[(size_t)((n - 1) * 0.99)] : 0;
  rc = 0;
out:
  for (int i = 0; slots && i < c->inflight; i++) {
    if (slots[i].active) kvf_receiver_destroy(slots[i].rx);
    free(slots[i].pages);
  }
  free(slots);
  free(t_success);
  free(t_send);
  free(lat);
  return rc;
}

/* Fan-out: one chunk that several decode ranks need (replicated MLA latent
 * cache, prefill TP 1 to decode TP 2, 4 and 8), and the other way (prefill
 * TP 4 to decode TP 1: one real sender, three dummies). Each case is a
 * bootstrap + kv-peer + kv-decode trio (pd.c); requests of FANOUT_PAGES pages
 * in chunks of FANOUT_CHUNK_PAGES, so every chunk goes through the prefill's
 * transfer workers, sent once the M2s are there. Baseline: the same requests
 * between TP 1 and TP 1, the same bytes per destination. Requests alternate
 * between the trios so the machine's noise hits all of them. */
#define FANOUT_LAYERS 4
#define FANOUT_PAGE_TOKENS 16
#define FANOUT_UNIT 1152 /* one MLA latent token (576 x bf16) */
#define FANOUT_POOL_PAGES 512
#define FANOUT_PAGES 2
#define FANOUT_CHUNK_PAGES 1
#define FANOUT_BYTES_PER_DEST ((uint64_t)FANOUT_PAGES * FANOUT_LAYERS * FANOUT_PAGE_TOKENS * FANOUT_UNIT)

typedef struct fanout_case {
  const char *name;
  int prefill_tp, decode_tp;
  double p50_us, p99_us; /* transfer: the later of the last send and the decode's M2, to Success */
  double req_p50_us;     /* the whole request as the decode sees it: its M2 to its Success */
  double cpu_us;         /* CPU time of both processes (every thread) per request, mean; -1: unknown */
} fanout_case;

/* One request through the trio: its transfer time (the later of the last
 * send and the decode's M2 to the decode's Success) and the request's time
 * (the decode's M2 to its Success: with 4 prefill ranks the real sender may
 * finish before the last rank's send returns, so only this one compares
 * there) in µs. */
static int fanout_request(pd_pair *pp, int64_t room, double *us, double *req_us) {
  pd_req r = {.room = room, .token = 42, .npages = FANOUT_PAGES, .chunk = FANOUT_CHUNK_PAGES, .wait_m2 = 1};
  if (pd_issue(pp, &r)) return -1;
  double until = cli_now_s() + 30;
  while (!(r.prefill_done && r.decode_done) && cli_now_s() < until)
    if (pd_collect(pp, &r, 1, r.room, 200) < 0) break;
  if (!r.prefill_done || !r.decode_done || pd_failed(&r)) {
    fprintf(stderr, "bench rooms: fan-out request %lld failed: %s\n", (long long)room,
            *r.reason ? r.reason : "timed out");
    return -1;
  }
  *us = pd_transfer_s(&r) * 1e6;
  *req_us = r.t_final_ns > r.t_init_ns ? (r.t_final_ns - r.t_init_ns) / 1e3 : 0;
  return 0;
}

/* Runs the cases (cases[0] is the baseline), `runs` requests each. */
#define FANOUT_MAX_CASES 6
static int bench_fanout(fanout_case *cases, size_t nc, int runs) {
  pd_pair pp[FANOUT_MAX_CASES];
  size_t up = 0;
  double *t = calloc(2 * nc * (size_t)runs, sizeof *t), w, wr;
  int rc = -1;
  if (!t || nc > FANOUT_MAX_CASES) goto out;
  for (; up < nc; up++) {
    pd_layout lo = {.layers = FANOUT_LAYERS,
                    .item = (uint64_t)FANOUT_PAGE_TOKENS * FANOUT_UNIT,
                    .pages = FANOUT_POOL_PAGES,
                    .prefill_tp = cases[up].prefill_tp,
                    .decode_tp = cases[up].decode_tp,
                    .page_size = FANOUT_PAGE_TOKENS,
                    .mla = 1,
                    .unit = FANOUT_UNIT};
    char err[256];
    if (pd_start_layout(&pp[up], &lo, err, sizeof err)) {
      fprintf(stderr, "bench rooms: %s: %s\n", cases[up].name, err);
      goto out;
    }
  }
  int64_t room = 1;
  for (size_t c = 0; c < nc; c++) /* warm-up: connections, pools, caches */
    for (int i = 0; i < 5; i++)
      if (fanout_request(&pp[c], room++, &w, &wr)) goto out;
  for (size_t c = 0; c < nc; c++) pd_settle(&pp[c]);
  /* CPU per request: what the two processes of a case ran while its
   * requests ran (the other cases' processes idle meanwhile; their CPU-time
   * clocks, as a request is too short for clock ticks), so a case that is
   * CPU-bound on these cores says so next to its latency; -1 when the
   * clocks cannot say. */
  long long cpu_ns[FANOUT_MAX_CASES] = {0};
  for (int i = 0; i < runs; i++)
    for (size_t c = 0; c < nc; c++) {
      long long p0 = proc_cpu_exact_ns(pp[c].prefill.pid), d0 = proc_cpu_exact_ns(pp[c].decode.pid);
      if (fanout_request(&pp[c], room++, &t[c * (size_t)runs + (size_t)i],
                         &t[(nc + c) * (size_t)runs + (size_t)i]))
        goto out;
      long long p1 = proc_cpu_exact_ns(pp[c].prefill.pid), d1 = proc_cpu_exact_ns(pp[c].decode.pid);
      if (p0 < 0 || d0 < 0 || p1 < p0 || d1 < d0) cpu_ns[c] = -1; /* the clocks cannot say: no figure */
      if (cpu_ns[c] >= 0) cpu_ns[c] += p1 - p0 + d1 - d0;
    }
  for (size_t c = 0; c < nc; c++) {
    double *v = t + c * (size_t)runs;
    qsort(v, (size_t)runs, sizeof *v, cmp_dbl);
    cases[c].p50_us = v[runs / 2];
    cases[c].p99_us = v[(size_t)((runs - 1) * 0.99)];
    v = t + (nc + c) * (size_t)runs;
    qsort(v, (size_t)runs, sizeof *v, cmp_dbl);
    cases[c].req_p50_us = v[runs / 2];
    cases[c].cpu_us = cpu_ns[c] >= 0 ? cpu_ns[c] / 1e3 / runs : -1;
  }
  rc = 0;
out:
  while (up > 0) pd_stop(&pp[--up]);
  free(t);
  return rc;
}

/* Baseline: a ZeroMQ PUSH/PULL round trip (one 3-frame message each way)
 * between this process and a forked child: the floor for any request that
 * needs a control message there and back. Returns the median in µs, 0 on
 * failure. The child is forked before either side creates a ZeroMQ context
 * (a context does not survive fork), and every receive has a timeout. */
static void *zmq_pair_open(void *ctx, int pipe_out, int pipe_in, void **push) {
  void *pull = zmq_socket(ctx, ZMQ_PULL);
  int tmo = 2000, linger = 0;
  char ep[128] = {0}, peer[128] = {0};
  size_t len = sizeof ep;
  zmq_setsockopt(pull, ZMQ_RCVTIMEO, &tmo, sizeof tmo);
  zmq_setsockopt(pull, ZMQ_LINGER, &linger, sizeof linger);
  if (zmq_bind(pull, "tcp://127.0.0.1:*") || zmq_getsockopt(pull, ZMQ_LAST_ENDPOINT, ep, &len) ||
      write(pipe_out, ep, sizeof ep) != (ssize_t)sizeof ep ||
      read(pipe_in, peer, sizeof peer) != (ssize_t)sizeof peer)
    return NULL;
  *push = zmq_socket(ctx, ZMQ_PUSH);
  zmq_setsockopt(*push, ZMQ_LINGER, &linger, sizeof linger);
  zmq_setsockopt(*push, ZMQ_SNDTIMEO, &tmo, sizeof tmo);
  peer[sizeof peer - 1] = 0;
  if (zmq_connect(*push, peer)) return NULL;
  return pull;
}

static double bench_zmq_rtt_us(int rounds) {
  int p2c[2], c2p[2];
  if (pipe(p2c)) return 0;
  if (pipe(c2p)) return 0;
  pid_t pid = fork();
  if (pid == 0) {
    void *ctx = zmq_ctx_new(), *push = NULL;
    void *pull = zmq_pair_open(ctx, c2p[1], p2c[0], &push);
    char buf[128];
    for (int i = 0; pull && i < rounds; i++)
      for (int f = 0; f < 3; f++) {
        int more = 0, n = zmq_recv(pull, buf, sizeof buf, 0);
        if (n < 0) _exit(1);
        size_t ml = sizeof more;
        zmq_getsockopt(pull, ZMQ_RCVMORE, &more, &ml);
        zmq_send(push, buf, (size_t)n < sizeof buf ? (size_t)n : sizeof buf, more ? ZMQ_SNDMORE : 0);
      }
    /* Flush the last echo before leaving: linger 0 would drop it. */
    int linger = 2000;
    if (push) zmq_setsockopt(push, ZMQ_LINGER, &linger, sizeof linger), zmq_close(push);
    if (pull) zmq_close(pull);
    zmq_ctx_term(ctx);
    _exit(0);
  }
  void *ctx = zmq_ctx_new(), *push = NULL;
  void *pull = zmq_pair_open(ctx, p2c[1], c2p[0], &push);
  double *t = calloc((size_t)rounds, sizeof *t), med = 0;
  int ok = pull && t;
  char buf[128];
  for (int i = 0; ok && i < rounds; i++) {
    double a = cli_now_s();
    zmq_send(push, "7215963401", 10, ZMQ_SNDMORE);
    zmq_send(push, "5", 1, ZMQ_SNDMORE);
    zmq_send(push, "0", 1, 0);
    for (int f = 0; f < 3 && ok; f++) ok = zmq_recv(pull, buf, sizeof buf, 0) >= 0;
    t[i] = (cli_now_s() - a) * 1e6;
  }
  if (ok) {
    qsort(t, (size_t)rounds, sizeof *t, cmp_dbl);
    med = t[rounds / 2];
  }
  free(t);
  if (push) zmq_close(push);
  if (pull) zmq_close(pull);
  zmq_ctx_term(ctx);
  close(p2c[0]), close(p2c[1]), close(c2p[0]), close(c2p[1]);
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
  return med;
}

/* One rooms case's traces: the decode's records of the case's rooms still in
 * its manager's ring, and the case's room ids (for the prefill's file). */
typedef struct rooms_trace {
  kvf_room_trace *t, *pf; /* decode, prefill */
  size_t n, npf;
  int64_t lo, hi;
} rooms_trace;

#define ROOMS_TRACE_MAX 1024 /* the ring's default size */

/* After a case: the decode's ring, and the prefill peer's (`traces`). */
static void rooms_trace_take(rooms_trace *rt, kvf_manager *m, proc *peer, int64_t base, int rooms) {
  rt->lo = base, rt->hi = base + rooms;
  rt->t = malloc(ROOMS_TRACE_MAX * sizeof *rt->t);
  rt->pf = malloc(ROOMS_TRACE_MAX * sizeof *rt->pf);
  if (!rt->t || !rt->pf) return;
  rt->n = kvf_manager_trace_copy(m, rt->t, ROOMS_TRACE_MAX);
  fprintf(peer->in, "traces\n");
  fflush(peer->in);
  char line[8192];
  while (!proc_read_line(peer, line, sizeof line, 5000) && strcmp(line, "traces end"))
    if (!strncmp(line, "trace ", 6) && rt->npf < ROOMS_TRACE_MAX &&
        !kvf_trace_parse_json(line + 6, &rt->pf[rt->npf]))
      rt->npf++;
}

/* A case's CPU by thread: a JSON member "cpu_by_thread" (list, largest
 * first), or indented lines. Nothing when it was not measured. */
static void rooms_cpu_print(const rooms_cpu *c, int json) {
  if (!c || !c->n) return;
  if (json) printf(",\"cpu_by_thread\":[");
  else printf("  CPU by thread, us per room (both processes):\n");
  for (size_t i = 0; i < c->n; i++) {
    if (json)
      printf("%s{\"side\":\"%s\",\"thread\":\"%s\",\"us_per_room\":%.2f}", i ? "," : "", c->t[i].side,
             c->t[i].thread, c->t[i].us_per_room);
    else if (c->t[i].us_per_room >= 0.05)
      printf("    %-8s %-16s %8.2f\n", c->t[i].side, c->t[i].thread, c->t[i].us_per_room);
  }
  if (json) printf("]");
}

/* Both sides' breakdowns: a JSON member of the case's object, or tables. */
static void rooms_trace_print(const rooms_trace *rt, int json) {
  if (json) printf(",\"breakdown\":{\"decode\":");
  cli_breakdown_print(rt->t, rt->n, KVF_ROLE_DECODE, rt->lo, rt->hi, json, "  ");
  if (json) printf(",\"prefill\":");
  cli_breakdown_print(rt->pf, rt->npf, KVF_ROLE_PREFILL, rt->lo, rt->hi, json, "  ");
  if (json) printf("}");
}

static int bench_rooms(const bench_opts *o) {
  /* --fanout-only: no rooms case, so none of their baselines either. */
  double rtt_us = o->fanout_only ? 0 : bench_zmq_rtt_us(2000);
  /* For the many-page cases: one cache-hot TCP stream's bandwidth, so
   * ideal_us = room bytes / that + one ZeroMQ round trip. */
  double hot_gbps = o->fanout_only ? 0 : bench_tcp_baseline(o->quick ? 64ull << 20 : 256ull << 20, 1 << 20, 0);
  const char *exe = proc_testpeer_exe();
  char pages[32], layers[16], item[16];
  snprintf(pages, sizeof pages, "%d", ROOMS_POOL_PAGES);
  snprintf(layers, sizeof layers, "%d", ROOMS_LAYERS);
  snprintf(item, sizeof item, "%d", ROOMS_ITEM);
  char *argv[] = {(char *)exe, "kv-peer", "--layers", layers, "--item", item, "--pages", pages, NULL};
  proc peer;
  if (proc_start(&peer, argv)) return 1;
  char line[400], baddr[KVF_ADDR_MAX + 1];
  kvpool pool;
  kvf_engine *eng = NULL;
  kvf_manager *m = NULL, *m3only = NULL;
  int rc = 1;
  /* Room traces, both sides from their managers' rings (the default
   * configuration, so what the overhead runs measure): the decode's here,
   * the prefill's through the peer's `traces` command. */
  rooms_trace rt[8] = {{0}};
  static rooms_cpu cpu[8]; /* each case's CPU by thread */
  double over_ratio = 0, over_off = 0, over_on = 0;
  if (proc_read_line(&peer, line, sizeof line, 20000) || sscanf(line, "ready " CLI_ADDR_SCAN, baddr) != 1) {
    fprintf(stderr, "bench rooms: the prefill peer did not start\n");
    proc_stop(&peer, 1000);
    return 1;
  }
  if (bench_decode_pool(&pool, ROOMS_LAYERS, ROOMS_POOL_PAGES, ROOMS_ITEM, &eng)) goto out_peer;
  kvf_manager_config mc;
  kvf_manager_config_init(&mc);
  mc.role = KVF_ROLE_DECODE;
  mc.engine = eng;
  if (kvf_manager_create(&mc, &pool.bufs, &m)) goto out_pool;
  rooms_case cases[] = {
      {.name = "rooms_1page_inflight1", .pages = 1, .inflight = 1, .rooms = o->quick ? 300 : 2000},
      {.name = "rooms_1page_inflight1_m3_only",
       .pages = 1,
       .inflight = 1,
       .rooms = o->quick ? 300 : 2000,
       .m3_only = 1},
      {.name = "rooms_1page_inflight64", .pages = 1, .inflight = 64, .rooms = o->quick ? 1000 : 10000},
      {.name = "rooms_256page_inflight1", .pages = 256, .inflight = 1, .rooms = o->quick ? 50 : 300},
      {.name = "rooms_256page_inflight64", .pages = 256, .inflight = 64, .rooms = o->quick ? 100 : 600},
  };
  size_t nc = sizeof cases / sizeof cases[0];
  if (o->room_pages) { /* a single custom case replaces the standard ones */
    int n = o->rooms > 0 ? o->rooms : o->quick ? 100 : 1000;
    cases[0] =
        (rooms_case){.name = "rooms_custom", .pages = (size_t)o->room_pages, .inflight = o->inflight, .rooms = n};
    nc = 1;
  }
  if (o->fanout_only) nc = 0;
  for (size_t i = 0; i < nc && i < sizeof cpu / sizeof cpu[0]; i++) cases[i].cpu = &cpu[i];
  int64_t base = 1;
  rooms_case warm = {.name = "warmup", .pages = 1, .inflight = 8, .rooms = 200};
  if (nc && cli_bench_rooms_case(m, &pool, &peer, baddr, &warm, base)) goto out_mgr;
  base += warm.rooms;
  mc.fast_completion = 0;
  mc.engine = NULL; /* its own engine: the buffers are registered in the shared one */
  if (nc && kvf_manager_create(&mc, &pool.bufs, &m3only)) goto out_mgr;
  warm.m3_only = 1;
  if (nc && cli_bench_rooms_case(m3only, &pool, &peer, baddr, &warm, base)) goto out_mgr;
  base += warm.rooms;
  if (nc) {
    bench_wait_mapped_ahead(kvf_manager_engine(m));
    bench_wait_mapped_ahead(kvf_manager_engine(m3only));
  }
  for (size_t i = 0; i < nc; i++) {
    kvf_manager *cm = cases[i].m3_only ? m3only : m;
    if (cli_bench_rooms_case(cm, &pool, &peer, baddr, &cases[i], base)) goto out_mgr;
    rooms_trace_take(&rt[i], cm, &peer, base, cases[i].rooms);
    base += cases[i].rooms;
  }
  /* Tracing's cost: the 1-page, 64-in-flight rate with room traces off on
   * both sides against on, runs alternating so the machine's noise hits
   * both (trace_overhead_ratio = rate off / rate on, 1.0 = free). */
  if (!o->room_pages && !o->fanout_only) {
    double t_off = 0, t_on = 0, n_off = 0, n_on = 0;
    for (int k = 0; k < 6; k++) {
      int on = k % 2;
      rooms_case oc = {.name = on ? "overhead_on" : "overhead_off",
                       .pages = 1,
                       .inflight = 64,
                       .rooms = o->quick ? 500 : 3000};
      fprintf(peer.in, "trace %d\n", on);
      kvf_manager_trace_enable(m, on);
      if (cli_bench_rooms_case(m, &pool, &peer, baddr, &oc, base)) goto out_mgr;
      base += oc.rooms;
      *(on ? &t_on : &t_off) += oc.rooms / oc.rooms_per_s;
      *(on ? &n_on : &n_off) += oc.rooms;
    }
    over_off = n_off / t_off, over_on = n_on / t_on, over_ratio = over_off / over_on;
  }
  fanout_case fo[] = {{.name = "fanout_1to1_base", .prefill_tp = 1, .decode_tp = 1},
                      {.name = "fanout_1to2_mla", .prefill_tp = 1, .decode_tp = 2},
                      {.name = "fanout_1to4_mla", .prefill_tp = 1, .decode_tp = 4},
                      {.name = "fanout_1to8_mla", .prefill_tp = 1, .decode_tp = 8},
                      {.name = "fanout_4to1_mla", .prefill_tp = 4, .decode_tp = 1}};
  size_t nfo = o->room_pages ? 0 : sizeof fo / sizeof fo[0];
  if (nfo && bench_fanout(fo, nfo, o->quick ? 30 : 200)) goto out_mgr;
  if (o->json) {
    printf("{\"bench\":\"rooms\"");
    cli_bench_path(stdout, m, 1);
    printf(",\"model\":{\"layers\":%d,\"page_bytes_per_buffer\":%d,\"buffers\":%d},"
           "\"baseline\":\"ZeroMQ PUSH/PULL round trip between two processes\",\"baseline_rtt_us\":%.1f,"
           "\"baseline_hot_tcp_gbps\":%.3f,\"cases\":[",
           ROOMS_LAYERS, ROOMS_ITEM, 2 * ROOMS_LAYERS, rtt_us, hot_gbps);
    for (size_t i = 0; i < nc; i++) {
      double ideal =
          hot_gbps > 0 ? cases[i].pages * ROOMS_ITEM * 2.0 * ROOMS_LAYERS / (hot_gbps * 1e3) + rtt_us : 0;
      printf("%s{\"name\":\"%s\",\"rooms\":%d,\"rooms_per_s\":%.0f,\"p50_us\":%.1f,\"p99_us\":%.1f,"
             "\"p50_over_zmq_rtt\":%.2f,\"wakeups_per_room\":%.2f,\"cpu_us_per_room\":%.1f,\"ideal_us\":%.1f,"
             "\"p50_over_ideal\":%.2f",
             i ? "," : "", cases[i].name, cases[i].rooms, cases[i].rooms_per_s, cases[i].p50_us, cases[i].p99_us,
             rtt_us > 0 ? cases[i].p50_us / rtt_us : 0, cases[i].wakeups_per_room, cases[i].cpu_us_per_room, ideal,
             ideal > 0 ? cases[i].p50_us / ideal : 0);
      rooms_trace_print(&rt[i], 1);
      rooms_cpu_print(cases[i].cpu, 1);
      printf("}");
    }
    printf("]");
    if (over_ratio > 0)
      printf(",\"trace_overhead_ratio\":%.3f,\"trace_overhead\":{\"case\":\"1 page, 64 in flight\","
             "\"rooms_per_s_off\":%.0f,\"rooms_per_s_on\":%.0f,\"runs\":6}",
             over_ratio, over_off, over_on);
    if (nfo) {
      printf(",\"fanout\":{\"baseline\":\"the same requests between TP 1 and TP 1\",\"layers\":%d,"
             "\"page_tokens\":%d,\"unit\":%d,\"pages\":%d,\"chunk_pages\":%d,\"bytes_per_dest\":%llu,\"cases\":[",
             FANOUT_LAYERS, FANOUT_PAGE_TOKENS, FANOUT_UNIT, FANOUT_PAGES, FANOUT_CHUNK_PAGES,
             (unsigned long long)FANOUT_BYTES_PER_DEST);
      for (size_t i = 0; i < nfo; i++)
        printf("%s{\"name\":\"%s\",\"prefill_tp\":%d,\"decode_tp\":%d,\"p50_us\":%.1f,\"p99_us\":%.1f,"
               "\"p50_over_base\":%.2f,\"req_p50_us\":%.1f,\"req_p50_over_base\":%.2f,\"cpu_us_per_request\":%.1f,"
               "\"cpu_over_base\":%.2f}",
               i ? "," : "", fo[i].name, fo[i].prefill_tp, fo[i].decode_tp, fo[i].p50_us, fo[i].p99_us,
               fo[0].p50_us > 0 ? fo[i].p50_us / fo[0].p50_us : 0, fo[i].req_p50_us,
               fo[0].req_p50_us > 0 ? fo[i].req_p50_us / fo[0].req_p50_us : 0, fo[i].cpu_us,
               fo[0].cpu_us > 0 && fo[i].cpu_us >= 0 ? fo[i].cpu_us / fo[0].cpu_us : -1);
      printf("]}");
    }
    printf("}\n");
  } else {
    printf("rooms through the KV managers (prefill in a child process, %d layers, %d B pages x %d buffers)\n",
           ROOMS_LAYERS, ROOMS_ITEM, 2 * ROOMS_LAYERS);
    cli_bench_path(stdout, m, 0);
    if (nc) {
      printf("baseline: ZeroMQ PUSH/PULL round trip between two processes, p50 %.1f us; one cache-hot TCP stream\n"
             "          %.2f GB/s (ideal = room bytes / that + one round trip)\n",
             rtt_us, hot_gbps);
      printf("%-28s %8s %12s %10s %10s %12s %12s %12s\n", "case", "rooms", "rooms/s", "p50 us", "p99 us",
             "p50/zmq rtt", "wakeups/room", "cpu us/room");
    }
    for (size_t i = 0; i < nc; i++)
      printf("%-28s %8d %12.0f %10.1f %10.1f %12.2f %12.2f %12.1f\n", cases[i].name, cases[i].rooms,
             cases[i].rooms_per_s, cases[i].p50_us, cases[i].p99_us, rtt_us > 0 ? cases[i].p50_us / rtt_us : 0,
             cases[i].wakeups_per_room, cases[i].cpu_us_per_room);
    if (over_ratio > 0)
      printf("trace_overhead_ratio %.3f: 1 page, 64 in flight, %.0f rooms/s with room traces off, %.0f on "
             "(6 runs alternating)\n",
             over_ratio, over_off, over_on);
    for (size_t i = 0; i < nc; i++) {
      printf("per-step breakdown, %s (the rooms still in each side's ring):\n", cases[i].name);
      rooms_trace_print(&rt[i], 0);
      rooms_cpu_print(cases[i].cpu, 0);
    }
    if (nfo) {
      printf("fan-out: MLA requests of %d pages in chunks of %d (%llu B per destination), prefill workers;\n"
             "         baseline: the same requests between TP 1 and TP 1\n",
             FANOUT_PAGES, FANOUT_CHUNK_PAGES, (unsigned long long)FANOUT_BYTES_PER_DEST);
      printf("%-28s %10s %10s %10s %10s %12s %12s %12s %9s\n", "case", "prefill tp", "decode tp", "p50 us",
             "p50/base", "request p50", "request/base", "cpu us/req", "cpu/base");
      for (size_t i = 0; i < nfo; i++)
        printf("%-28s %10d %10d %10.1f %10.2f %12.1f %12.2f %12.1f %9.2f\n", fo[i].name, fo[i].prefill_tp,
               fo[i].decode_tp, fo[i].p50_us, fo[0].p50_us > 0 ? fo[i].p50_us / fo[0].p50_us : 0, fo[i].req_p50_us,
               fo[0].req_p50_us > 0 ? fo[i].req_p50_us / fo[0].req_p50_us : 0, fo[i].cpu_us,
               fo[0].cpu_us > 0 && fo[i].cpu_us >= 0 ? fo[i].cpu_us / fo[0].cpu_us : -1);
    }
  }
  rc = 0;
out_mgr:
  kvf_manager_destroy(m3only);
  kvf_manager_destroy(m);
out_pool:
  kvpool_free(&pool);
  kvf_engine_destroy(eng);
out_peer:
  proc_stop(&peer, 5000);
  for (size_t i = 0; i < sizeof rt / sizeof rt[0]; i++) free(rt[i].t), free(rt[i].pf);
  return rc;
}

/* Baseline for same-host copies: memcpy of `total` bytes between two
 * pre-faulted 256 MiB buffers in this process, one thread. */
static double bench_memcpy_gbps(uint64_t total) {
  const uint64_t n = 256ull << 20;
  char *a = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  char *b = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  double gbps = 0;
  if (a != MAP_FAILED && b != MAP_FAILED) {
    memset(a, 1, n);
    memset(b, 2, n);
    double t0 = cli_now_s();
    for (uint64_t done = 0; done < total; done += n) memcpy(b, a, total - done < n ? total - done : n);
    double dt = cli_now_s() - t0;
    gbps = dt > 0 && b[n / 2] == 1 ? total / dt / 1e9 : 0;
  }
  if (a != MAP_FAILED) munmap(a, n);
  if (b != MAP_FAILED) munmap(b, n);
  return gbps;
}

/* The model the end-to-end benchmark moves: llama-3.1-8b, 32 layers of K and
 * V, 16-token pages of 8 heads x 128 x bf16 = 32 KiB per buffer. */
#define E2E_LAYERS 32
#define E2E_ITEM (32u << 10)
#define E2E_PAGE_TOKENS 16
#define E2E_PAGE_BYTES ((uint64_t)E2E_ITEM * 2 * E2E_LAYERS)

/* `runs` requests of `tokens` tokens, one at a time (seed 0: no pattern, so
 * the time is the transfer's alone); the median and the fastest transfer
 * time in seconds. */
static int e2e_case(pd_pair *pp, size_t tokens, int runs, int64_t *room, double *p50_s, double *min_s) {
  double *t = calloc((size_t)runs, sizeof *t);
  int rc = -1;
  if (!t) return -1;
  for (int i = 0; i < runs; i++) {
    pd_req r = {.room = (*room)++, .token = 42, .npages = (tokens + E2E_PAGE_TOKENS - 1) / E2E_PAGE_TOKENS};
    if (pd_issue(pp, &r)) goto out;
    double until = cli_now_s() + 60;
    while (!(r.prefill_done && r.decode_done) && cli_now_s() < until)
      if (pd_collect(pp, &r, 1, r.room, 200) < 0) break;
    if (!r.prefill_done || !r.decode_done || pd_failed(&r)) {
      fprintf(stderr, "bench e2e: request of %zu tokens failed: %s\n", tokens, *r.reason ? r.reason : "timed out");
      goto out;
    }
    t[i] = pd_transfer_s(&r);
  }
  qsort(t, (size_t)runs, sizeof *t, cmp_dbl);
  *p50_s = t[runs / 2];
  *min_s = t[0];
  rc = 0;
out:
  free(t);
  return rc;
}

/* CPU time per request of each process of the two pairs (seconds; -1 when
 * the clocks cannot say), over the alternated requests: where verify
 * mode's time goes on a machine whose cores are all busy. */
typedef struct e2e_cpu {
  double plain_decode, plain_prefill, verify_decode, verify_prefill;
} e2e_cpu;

/* Adds the CPU `pid` used since `*t0` (read again into *t0) to *sum; *sum
 * becomes -1 for good once a reading fails. */
static void cpu_since(pid_t pid, long long *t0, long long *sum) {
  long long t1 = proc_cpu_exact_ns(pid);
  if (*t0 < 0 || t1 < *t0) *sum = -1;
  if (*sum >= 0) *sum += t1 - *t0;
  *t0 = t1;
}

/* Verify mode against none, in the same run: a second pair started with
 * KVFERRY_VERIFY=1 (both of its processes hash, send and check digests);
 * requests alternate between the pairs so the machine's noise hits both. */
static int e2e_verify_pair(pd_pair *pp, size_t tokens, int runs, int64_t *room, double *p50, double *best,
                           double *v50, double *vbest, e2e_cpu *cpu, char *vtrace, size_t vcap) {
  pd_pair pv;
  char err[256];
  const uint64_t pages = tokens / E2E_PAGE_TOKENS;
  setenv("KVFERRY_VERIFY", "1", 1);
  cli_breakdown_env(vtrace, vcap); /* the verify pair's own room traces: where verify's time goes */
  int rc = pd_start(&pv, E2E_LAYERS, E2E_ITEM, pages, err, sizeof err);
  unsetenv("KVFERRY_VERIFY");
  unsetenv("KVFERRY_TRACE");
  if (rc) {
    fprintf(stderr, "bench e2e: %s\n", err);
    return -1;
  }
  double *t = calloc(2 * (size_t)runs, sizeof *t), w, wm;
  rc = !t || e2e_case(&pv, tokens, 1, room, &w, &wm); /* warm up the verify pair too */
  pd_settle(&pv);
  const pid_t pids[4] = {pp->decode.pid, pp->prefill.pid, pv.decode.pid, pv.prefill.pid};
  long long sum[4] = {0, 0, 0, 0}, t0[4];
  for (int i = 0; !rc && i < runs; i++) {
    for (int k = 0; k < 4; k++) t0[k] = proc_cpu_exact_ns(pids[k]);
    rc = e2e_case(pp, tokens, 1, room, &t[i], &w);
    for (int k = 0; k < 2; k++) cpu_since(pids[k], &t0[k], &sum[k]);
    for (int k = 2; k < 4; k++) t0[k] = proc_cpu_exact_ns(pids[k]); /* only its own requests */
    rc = rc || e2e_case(&pv, tokens, 1, room, &t[runs + i], &w);
    for (int k = 2; k < 4; k++) cpu_since(pids[k], &t0[k], &sum[k]);
  }
  double *out[4] = {&cpu->plain_decode, &cpu->plain_prefill, &cpu->verify_decode, &cpu->verify_prefill};
  for (int k = 0; k < 4; k++) *out[k] = sum[k] >= 0 && runs > 0 ? sum[k] / 1e9 / runs : -1;
  if (!rc) {
    qsort(t, (size_t)runs, sizeof *t, cmp_dbl);
    qsort(t + runs, (size_t)runs, sizeof *t, cmp_dbl);
    *p50 = t[runs / 2], *best = t[0];
    *v50 = t[runs + runs / 2], *vbest = t[runs];
  }
  free(t);
  pd_stop(&pv);
  return rc ? -1 : 0;
}

static int bench_e2e(const bench_opts *o) {
  const size_t tokens = 4096;
  const uint64_t pages = tokens / E2E_PAGE_TOKENS, bytes = pages * E2E_PAGE_BYTES;
  const int runs = o->quick ? 3 : 7;
  /* The baseline is the faster of the two plain streams (cache-hot
   * buffers), so the ideal time is the least a plain socket needs here. */
  double base_pool = bench_tcp_baseline(2 * bytes, 256ull << 20, 0),
         base = bench_tcp_baseline(2 * bytes, 1 << 20, 0);
  double mc = bench_memcpy_gbps(2 * bytes);
  pd_pair pp;
  char err[256], tpath[64], vpath[64] = ""; /* the pairs' room traces, for the per-step breakdowns */
  cli_breakdown_env(tpath, sizeof tpath);
  int started = pd_start(&pp, E2E_LAYERS, E2E_ITEM, pages, err, sizeof err);
  unsetenv("KVFERRY_TRACE");
  if (started) {
    fprintf(stderr, "bench e2e: %s\n", err);
    if (*tpath) unlink(tpath);
    return 1;
  }
  int64_t room = 1;
  double p50 = 0, best = 0, w50, wmin;
  /* Warm up: the decode's M1 registration, connections, first-touch of the
   * engine's buffers. */
  int rc = e2e_case(&pp, tokens, 1, &room, &w50, &wmin);
  pd_settle(&pp);
  double v50 = 0, vbest = 0;
  e2e_cpu cpu = {-1, -1, -1, -1};
  bench_hash_cost hc = {0, 0};
  if (!rc && o->verify) {
    rc = e2e_verify_pair(&pp, tokens, runs, &room, &p50, &best, &v50, &vbest, &cpu, vpath, sizeof vpath);
    if (!rc && bench_hash_floor(bytes, &hc)) hc.cold_s = hc.hot_s = 0;
  } else if (!rc) {
    rc = e2e_case(&pp, tokens, runs, &room, &p50, &best);
  }
  pd_stop(&pp);
  /* The processes' KV pools come from kvf_engine_alloc_pool (over UCX the
   * peer maps them, rkey_ptr; over TCP they are on huge pages); the same
   * request again with private memory of ordinary pages (UCX reaches it
   * through CMA). */
  const char *mem = cli_memory_kind();
  double plain50 = 0, plainbest = 0;
  int plain_case = !rc && !o->verify && !strcmp(mem, "pool");
  if (plain_case) {
    char *prev = getenv("KVFERRY_CLI_MEMORY") ? strdup(getenv("KVFERRY_CLI_MEMORY")) : NULL;
    setenv("KVFERRY_CLI_MEMORY", "plain", 1);
    if (pd_start(&pp, E2E_LAYERS, E2E_ITEM, pages, err, sizeof err)) {
      fprintf(stderr, "bench e2e: %s\n", err);
      rc = 1;
    } else {
      rc = e2e_case(&pp, tokens, 1, &room, &w50, &wmin);
      pd_settle(&pp);
      if (!rc) rc = e2e_case(&pp, tokens, runs, &room, &plain50, &plainbest);
      pd_stop(&pp);
    }
    if (prev) setenv("KVFERRY_CLI_MEMORY", prev, 1);
    else unsetenv("KVFERRY_CLI_MEMORY");
    free(prev);
  }
  if (rc) {
    if (*tpath) unlink(tpath);
    if (*vpath) unlink(vpath);
    return 1;
  }
  double ideal = base > 0 ? bytes / (base * 1e9) : 0, gbps = p50 > 0 ? bytes / p50 / 1e9 : 0;
  /* Verify mode's floor here: its two digest passes and the plain
   * request's decode CPU, spread perfectly over every core, can take no
   * less than this (bench/README.md, "Platform floors"). */
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  const double dec_cpu = cpu.plain_decode;
  double floor_s =
      dec_cpu >= 0 && cores > 0 && hc.cold_s > 0 ? (dec_cpu + hc.cold_s + hc.hot_s) / (double)cores : 0;
  double floor_ratio = p50 > 0 && floor_s > 0 ? (floor_s > p50 ? floor_s / p50 : 1.0) : 0;
  if (o->json) {
    printf("{\"bench\":\"e2e\"");
    cli_bench_path(stdout, NULL, 1);
    printf(",\"model\":\"llama-3.1-8b\",\"tokens\":%zu,\"bytes\":%llu,\"runs\":%d,"
           "\"transfer_s_p50\":%.4f,\"transfer_s_min\":%.4f,\"gbps\":%.3f,"
           "\"baseline\":\"plain TCP loopback, one stream, 1 MiB writes, cache-hot buffers\","
           "\"baseline_gbps\":%.3f,\"baseline_pool_gbps\":%.3f,\"ideal_s\":%.4f,\"ratio\":%.3f,\"memcpy_gbps\":%."
           "3f,"
           "\"memcpy_ratio\":%.3f",
           tokens, (unsigned long long)bytes, runs, p50, best, gbps, base, base_pool, ideal,
           p50 > 0 ? ideal / p50 : 0, mc, mc > 0 ? gbps / mc : 0);
    printf(",\"memory\":\"%s\"", mem);
    if (plain_case)
      printf(",\"plain_memory\":{\"transfer_s_p50\":%.4f,\"transfer_s_min\":%.4f,\"gbps\":%.3f,\"ratio\":%.3f}",
             plain50, plainbest, plain50 > 0 ? bytes / plain50 / 1e9 : 0, plain50 > 0 ? ideal / plain50 : 0);
    if (o->verify) /* the verify pair's figures belong to the same object */
      printf(",\"verify\":{\"transfer_s_p50\":%.4f,\"transfer_s_min\":%.4f,\"overhead_ratio\":%.3f,"
             "\"hash_cold_ms\":%.2f,\"hash_hot_ms\":%.2f,\"plain_decode_cpu_ms\":%.2f,\"cores\":%ld,"
             "\"cpu_floor_ratio\":%.3f,\"plain_prefill_cpu_ms\":%.2f,\"verify_decode_cpu_ms\":%.2f,"
             "\"verify_prefill_cpu_ms\":%.2f}",
             v50, vbest, p50 > 0 ? v50 / p50 : 0, hc.cold_s * 1e3, hc.hot_s * 1e3, dec_cpu * 1e3, cores,
             floor_ratio, cpu.plain_prefill * 1e3, cpu.verify_decode * 1e3, cpu.verify_prefill * 1e3);
    cli_breakdown_file(tpath, 2, 1); /* room 1 warmed up */
    printf("}\n");
  } else {
    cli_bench_path(stdout, NULL, 0);
    printf("end to end: one llama-3.1-8b request of %zu tokens (%llu pages x %d buffers x %u KiB = %llu MiB),\n"
           "bootstrap, prefill and decode in separate processes; transfer = decode M2 -> decode Success; %d "
           "runs\n",
           tokens, (unsigned long long)pages, 2 * E2E_LAYERS, E2E_ITEM >> 10, (unsigned long long)(bytes >> 20),
           runs);
    printf("baseline: plain TCP loopback, one stream, 1 MiB writes, cache-hot buffers: %.2f GB/s\n"
           "          -> ideal %.1f ms for these bytes (through 256 MiB pools at both ends: %.2f GB/s)\n",
           base, ideal * 1e3, base_pool);
    printf("context:  memcpy in one process, one thread: %.2f GB/s -> %.1f ms\n", mc,
           mc > 0 ? bytes / (mc * 1e9) * 1e3 : 0.0);
    printf("%-28s %10s %10s %10s %10s %14s\n", "case", "p50 ms", "min ms", "GB/s", "ideal ms",
           "ratio (ideal/p50)");
    printf("%-28s %10.1f %10.1f %10.2f %10.1f %14.2f\n", "e2e_llama8b_4096tok", p50 * 1e3, best * 1e3, gbps,
           ideal * 1e3, p50 > 0 ? ideal / p50 : 0);
    if (plain_case)
      printf("%-28s %10.1f %10.1f %10.2f %10.1f %14.2f\n", "e2e_llama8b_4096tok_plain", plain50 * 1e3,
             plainbest * 1e3, plain50 > 0 ? bytes / plain50 / 1e9 : 0, ideal * 1e3,
             plain50 > 0 ? ideal / plain50 : 0);
    printf("memory: %s\n", plain_case
                               ? "the first row in pools from kvf_engine_alloc_pool (UCX maps them, rkey_ptr; "
                                 "TCP: huge pages); _plain in private memory of ordinary pages (UCX: CMA)"
                               : mem);
  }
  if (o->verify) {
    double ratio = p50 > 0 ? v50 / p50 : 0;
    if (!o->json)
      printf("%-28s %10.1f %10.1f %10.2f %10s %14s\n"
             "verify mode: p50 %.1f ms against %.1f ms without, overhead ratio %.3f (%+.1f%%); requests "
             "alternated\n"
             "between a pair in verify mode and one without, in the same run\n",
             "e2e_llama8b_4096tok_verify", v50 * 1e3, vbest * 1e3, v50 > 0 ? bytes / v50 / 1e9 : 0, "-", "-",
             v50 * 1e3, p50 * 1e3, ratio, (ratio - 1) * 100);
    if (!o->json && floor_ratio > 0)
      printf("floor: the digests on one thread cost %.1f ms from memory (send) and %.1f ms from cache (landing);\n"
             "with the plain request's decode CPU (%.1f ms) spread over all %ld cores, verify mode cannot take\n"
             "less than %.3f x the plain p50 here (cpu_floor_ratio)\n",
             hc.cold_s * 1e3, hc.hot_s * 1e3, dec_cpu * 1e3, cores, floor_ratio);
    if (!o->json && cpu.verify_decode >= 0)
      printf("CPU per request (ms, every thread of the process): plain decode %.1f, prefill %.1f; verify decode "
             "%.1f,\nprefill %.1f (its send-time digests, then the recheck of its sources after the M3s: two "
             "passes\nover the request's bytes, slower than hash_cold_ms alone while the decode copies)\n",
             cpu.plain_decode * 1e3, cpu.plain_prefill * 1e3, cpu.verify_decode * 1e3, cpu.verify_prefill * 1e3);
  }
  cli_breakdown_file(tpath, 2, 0);      /* text mode (the JSON object has it already); room 1 warmed up */
  if (*vpath && o->json) unlink(vpath); /* text mode only */
  else if (*vpath) {
    printf("verify pair (KVFERRY_VERIFY=1):\n");
    cli_breakdown_file(vpath, 3, 0); /* room 2 warmed it up */
  }
  return 0;
}

/* ---- layerwise: how much of the transfer hides behind the compute ---- */

/* One layerwise-bench request: the decode's receiver here, the prefill's
 * compute and sends in the peer. Times in CLOCK_MONOTONIC seconds, which
 * both processes share. */
typedef struct lw_run {
  double compute_start, compute_end, last_send, success;
} lw_run;

static int lw_request(kvf_manager *m, kvpool *pool, proc *peer, const char *baddr, int64_t room, size_t npages,
                      double layer_ms, int per_layer, int idle, lw_run *out) {
  kvf_receiver *rx = NULL;
  uint64_t rng = 0x9e3779b97f4a7c15ULL ^ (uint64_t)room;
  int64_t *pages = malloc(npages * sizeof *pages);
  int rc = -1, got_lw = 0, got_done = 0, st = KVF_POLL_BOOTSTRAPPING;
  memset(out, 0, sizeof *out);
  if (!pages || kvf_receiver_create(m, baddr, room, &rx) || kvpool_take(pool, npages, &rng, pages)) {
    free(pages);
    kvf_receiver_destroy(rx);
    return -1;
  }
  if (kvf_receiver_init(rx, pages, npages, 0, 0, NULL, 0)) goto out;
  /* Let the M2 land first, as in a running system where the decode asks
   * well before the prefill's forward pass ends. */
  double until = cli_now_s() + 60;
  usleep(20000);
  fprintf(peer->in, "layerwise %lld %zu %lld %d 7 %d\n", (long long)room, npages, (long long)(layer_ms * 1000),
          per_layer, idle);
  fflush(peer->in);
  /* Until Success the loop sleeps on the manager's event fd, as a decode
   * scheduler waiting for this request would: a nap between polls (20 us,
   * until session 18) woke a thread every ~70 us on the two cores that
   * copy the layers. */
  int efd = kvf_manager_event_fd(m);
  while ((st != KVF_POLL_SUCCESS && st != KVF_POLL_FAILED) || !got_lw || !got_done) {
    if (cli_now_s() > until) goto out;
    if (st != KVF_POLL_SUCCESS && st != KVF_POLL_FAILED) {
      if (efd >= 0) kvf_manager_event_clear(m);
      st = kvf_receiver_poll(rx);
      if (st == KVF_POLL_SUCCESS) {
        out->success = cli_now_s();
      } else if (st != KVF_POLL_FAILED && efd >= 0) {
        struct pollfd pf = {.fd = efd, .events = POLLIN};
        poll(&pf, 1, 100); /* the timeout only bounds a missed wake-up */
      } else if (st != KVF_POLL_FAILED) {
        usleep(20);
      }
      continue;
    }
    char line[256];
    long long r, a, b, ns;
    int ps;
    if (proc_read_line(peer, line, sizeof line, 1000)) continue;
    if (sscanf(line, "lw %lld %lld %lld", &r, &a, &b) == 3 && r == room) {
      out->compute_start = a / 1e9, out->compute_end = b / 1e9, got_lw = 1;
    } else if (sscanf(line, "done %lld %d %lld", &r, &ps, &ns) == 3 && r == room) {
      out->last_send = ns / 1e9, got_done = 1;
      if (ps != KVF_POLL_SUCCESS) goto out;
    }
  }
  rc = st == KVF_POLL_SUCCESS ? 0 : -1;
out:
  if (rc) fprintf(stderr, "bench layerwise: request %lld failed or timed out\n", (long long)room);
  kvf_receiver_destroy(rx);
  kvpool_give(pool, pages, npages);
  free(pages);
  return rc;
}

static int cmp_lw_success(const void *a, const void *b) {
  const lw_run *x = a, *y = b;
  double dx = x->success - x->compute_end, dy = y->success - y->compute_end;
  return dx < dy ? -1 : dx > dy;
}

/* `runs` requests of one mode; the run with the median time from the end of
 * the compute to Success. */
static int lw_case(kvf_manager *m, kvpool *pool, proc *peer, const char *baddr, int64_t *room, size_t npages,
                   double layer_ms, int per_layer, int idle, int runs, lw_run *med) {
  lw_run r[16];
  if (runs > 16) runs = 16;
  for (int i = 0; i < runs; i++)
    if (lw_request(m, pool, peer, baddr, (*room)++, npages, layer_ms, per_layer, idle, &r[i])) return -1;
  qsort(r, (size_t)runs, sizeof r[0], cmp_lw_success);
  *med = r[runs / 2];
  return 0;
}

static int bench_layerwise(const bench_opts *o) {
  const size_t tokens = o->quick ? 1024 : 4096, npages = tokens / E2E_PAGE_TOKENS;
  const uint64_t bytes = npages * E2E_PAGE_BYTES;
  const int runs = o->quick ? 3 : 5;
  double rtt_us = bench_zmq_rtt_us(500);
  const char *exe = proc_testpeer_exe();
  char pages_s[32], layers_s[16], item_s[16];
  snprintf(pages_s, sizeof pages_s, "%zu", npages);
  snprintf(layers_s, sizeof layers_s, "%d", E2E_LAYERS);
  snprintf(item_s, sizeof item_s, "%u", E2E_ITEM);
  char *argv[] = {(char *)exe, "kv-peer", "--layers", layers_s, "--item", item_s, "--pages", pages_s, NULL};
  proc peer;
  if (proc_start(&peer, argv)) return 1;
  char line[400], baddr[KVF_ADDR_MAX + 1];
  kvpool pool;
  kvf_engine *eng = NULL;
  kvf_manager *m = NULL;
  int rc = 1;
  if (proc_read_line(&peer, line, sizeof line, 60000) || sscanf(line, "ready " CLI_ADDR_SCAN, baddr) != 1) {
    fprintf(stderr, "bench layerwise: the prefill peer did not start\n");
    proc_stop(&peer, 1000);
    return 1;
  }
  if (bench_decode_pool(&pool, E2E_LAYERS, npages, E2E_ITEM, &eng)) goto out_peer;
  kvf_manager_config mc;
  kvf_manager_config_init(&mc);
  mc.role = KVF_ROLE_DECODE;
  mc.engine = eng;
  if (kvf_manager_create(&mc, &pool.bufs, &m)) goto out_pool;
  int64_t room = 1;
  lw_run warm, alone, whole, lw;
  /* Warm-up (connections, first touch), then the transfer alone: the whole
   * request sent with no compute before it. */
  if (lw_case(m, &pool, &peer, baddr, &room, npages, 0, 0, 0, 1, &warm)) goto out_mgr;
  bench_wait_mapped_ahead(kvf_manager_engine(m));
  if (lw_case(m, &pool, &peer, baddr, &room, npages, 0, 0, 0, runs, &alone)) goto out_mgr;
  double transfer_s = alone.success - alone.last_send;
  /* Default: compute per layer = transfer per layer, as measured. */
  double layer_ms = o->layer_ms >= 0 ? o->layer_ms : transfer_s * 1e3 / E2E_LAYERS;
  if (lw_case(m, &pool, &peer, baddr, &room, npages, layer_ms, 0, o->idle_compute, runs, &whole) ||
      lw_case(m, &pool, &peer, baddr, &room, npages, layer_ms, 1, o->idle_compute, runs, &lw))
    goto out_mgr;
  double compute_s = lw.compute_end - lw.compute_start;
  double whole_after = whole.success - whole.compute_end, lw_after = lw.success - lw.compute_end;
  double whole_ttft = whole.success - whole.compute_start, lw_ttft = lw.success - lw.compute_start;
  /* The share of the transfer that finished inside the compute window. */
  double hidden = transfer_s > 0 ? 1 - lw_after / transfer_s : 0;
  if (hidden < 0) hidden = 0;
  if (hidden > 1) hidden = 1;
  /* The floor of this machine's memory (bench/README.md, "Platform
   * floors"): with the compute per layer set to the transfer alone's, a
   * layer copied r times slower after an idle wait than back to back leaves
   * (r - 1) of the transfer, and the last layer, after the compute. */
  double idle_ratio = 0, ceiling = -1;
  if (o->layer_ms < 0 && !bench_copy_after_idle(bytes / E2E_LAYERS, 8, layer_ms, &idle_ratio) && idle_ratio > 0) {
    ceiling = 1 - (idle_ratio - 1) - idle_ratio / E2E_LAYERS;
    if (ceiling < 0) ceiling = 0;
    if (ceiling > 1) ceiling = 1;
  }
  double layer_xfer_ms = transfer_s * 1e3 / E2E_LAYERS;
  if (o->json) {
    printf("{\"bench\":\"layerwise\"");
    cli_bench_path(stdout, m, 1);
    printf(",\"model\":\"llama-3.1-8b\",\"tokens\":%zu,\"layers\":%d,\"bytes\":%llu,"
           "\"runs\":%d,"
           "\"layer_ms\":%.3f,\"compute_ms\":%.2f,\"transfer_alone_ms\":%.2f,\"transfer_per_layer_ms\":%.3f,"
           "\"whole_success_after_compute_ms\":%.2f,\"whole_time_to_success_ms\":%.2f,"
           "\"layerwise_success_after_last_layer_ms\":%.2f,\"layerwise_time_to_success_ms\":%.2f,"
           "\"hidden_fraction\":%.3f,\"copy_after_idle_ratio\":%.3f,\"hidden_ceiling\":%.3f,"
           "\"baseline_rtt_us\":%.1f,\"compute\":\"%s\","
           "\"after_last_layer_over_layer_plus_rtt\":%.2f}\n",
           tokens, E2E_LAYERS, (unsigned long long)bytes, runs, layer_ms, compute_s * 1e3, transfer_s * 1e3,
           layer_xfer_ms, whole_after * 1e3, whole_ttft * 1e3, lw_after * 1e3, lw_ttft * 1e3, hidden, idle_ratio,
           ceiling, rtt_us, o->idle_compute ? "sleep" : "busy", lw_after * 1e3 / (layer_xfer_ms + rtt_us / 1e3));
  } else {
    cli_bench_path(stdout, m, 0);
    printf("layerwise: one llama-3.1-8b request of %zu tokens (%d layers, %llu MiB), prefill computing each "
           "layer\n"
           "for %.3f ms (%s; default: the transfer time per layer measured below); median of %d runs\n",
           tokens, E2E_LAYERS, (unsigned long long)(bytes >> 20), layer_ms,
           o->idle_compute ? "sleeping, as a GPU leaves the CPU free" : "busy work on a CPU core", runs);
    printf("compute (all layers, %s)        %10.2f ms\n", o->idle_compute ? "sleep" : "busy ", compute_s * 1e3);
    printf("transfer alone (no compute)        %10.2f ms  (%.3f ms per layer; ZeroMQ round trip %.1f us)\n",
           transfer_s * 1e3, layer_xfer_ms, rtt_us);
    printf("whole after the last layer:  Success %8.2f ms after the compute, %8.2f ms after its start\n",
           whole_after * 1e3, whole_ttft * 1e3);
    printf("each layer when computed:    Success %8.2f ms after the compute, %8.2f ms after its start\n",
           lw_after * 1e3, lw_ttft * 1e3);
    printf("hidden_fraction (transfer finished inside the compute): %.3f\n", hidden);
    if (ceiling >= 0)
      printf("floor: one thread copies a layer %.3f x as long after a %.3f ms idle wait as back to back;\n"
             "with the compute per layer set by the transfer alone, hidden_fraction cannot pass %.3f here "
             "(hidden_ceiling)\n",
             idle_ratio, layer_ms, ceiling);
  }
  rc = 0;
out_mgr:
  kvf_manager_destroy(m);
out_pool:
  kvpool_free(&pool);
  kvf_engine_destroy(eng);
out_peer:
  proc_stop(&peer, 5000);
  return rc;
}

/* Does `path` end in `ext` (case-insensitive)? */
static int has_ext(const char *path, const char *ext) {
  size_t n = strlen(path), e = strlen(ext);
  return n >= e && !strcasecmp(path + n - e, ext);
}

#define PLOT_BLOCKS 5  /* engine blocks 4 KiB .. 1 MiB, x4 */
#define PLOT_LENGTHS 5 /* e2e requests 512 .. 8192 tokens, x2 */

/* --plot: engine throughput over block sizes and end-to-end throughput over
 * request lengths, each with the TCP baseline of the same run, written as
 * one SVG by kvferry itself (svg.c), so a plot needs nothing installed.
 * Other formats are refused before anything runs: kvferry writes SVG only
 * (a browser shows it; rsvg-convert or inkscape turn it into a PNG). */
static int bench_plot(const bench_opts *o) {
  if (!has_ext(o->plot, ".svg")) {
    fprintf(stderr,
            "bench: --plot writes SVG, which needs nothing installed: name the file FILE.svg (got '%s'; "
            "for a PNG, convert the SVG, e.g. rsvg-convert -o out.png out.svg)\n",
            o->plot);
    return 2;
  }
  FILE *f = fopen(o->plot, "w");
  if (!f) {
    fprintf(stderr, "bench: cannot write %s: %s\n", o->plot, strerror(errno));
    return 1;
  }
  int rc = 1;
  /* --quick: a 64 MiB engine pool, 64 MiB per engine case and requests of
   * 256..1024 tokens, a few seconds in all (a smoke run: the pool is not
   * the benchmarks' 256 MiB); otherwise 1 GiB per case and 512..8192 tokens. */
  const uint64_t case_bytes = o->quick ? 64ull << 20 : 1ull << 30,
                 rig_pool = o->quick ? 64ull << 20 : 256ull << 20;
  const size_t min_tokens = o->quick ? 256 : 512, max_tokens = o->quick ? 1024 : 8192;
  double base = bench_tcp_baseline(case_bytes, 1 << 20, 0); /* the faster plain stream: cache-hot buffers */
  double bx[PLOT_BLOCKS], by[PLOT_BLOCKS], bb[PLOT_BLOCKS], ex[PLOT_LENGTHS], ey[PLOT_LENGTHS], eb[PLOT_LENGTHS];
  size_t nb = 0, ne = 0;
  engine_rig g;
  if (engine_rig_start(&g, rig_pool, 0)) goto out;
  for (uint64_t block = 4096; block <= (1u << 20); block *= 4) {
    int failed = 0;
    size_t per = (size_t)((8u << 20) / block); /* 8 MiB batches */
    double gbps =
        bench_engine_case(g.e, &g.peer, g.pool, g.pool_bytes, block, per, o->inflight, case_bytes, 0, &failed);
    if (failed) {
      engine_rig_stop(&g);
      goto out;
    }
    bx[nb] = (double)block, by[nb] = gbps, bb[nb++] = base;
    fprintf(stderr, "  engine %7llu B blocks: %.2f GB/s\n", (unsigned long long)block, gbps);
  }
  engine_rig_stop(&g);
  pd_pair pp;
  char err[256];
  if (pd_start(&pp, E2E_LAYERS, E2E_ITEM, max_tokens / E2E_PAGE_TOKENS, err, sizeof err)) {
    fprintf(stderr, "bench e2e: %s\n", err);
    goto out;
  }
  int64_t room = 1;
  double p50, best;
  int bad = e2e_case(&pp, min_tokens, 1, &room, &p50, &best); /* warm-up */
  pd_settle(&pp);
  for (size_t tokens = min_tokens; !bad && tokens <= max_tokens; tokens *= 2) {
    bad = e2e_case(&pp, tokens, o->quick ? 2 : 3, &room, &p50, &best);
    double gbps = bad || p50 <= 0 ? 0 : tokens / E2E_PAGE_TOKENS * E2E_PAGE_BYTES / p50 / 1e9;
    if (bad) break;
    ex[ne] = (double)tokens, ey[ne] = gbps, eb[ne++] = base;
    fprintf(stderr, "  e2e %5zu tokens: %.2f GB/s (p50 %.1f ms)\n", tokens, gbps, p50 * 1e3);
  }
  pd_stop(&pp);
  if (bad) goto out;
  const svg_series engine[] = {{"kvferry engine", bx, by, nb, 0}, {"plain TCP stream (same run)", bx, bb, nb, 1}};
  const svg_series e2e[] = {{"kvferry end to end (M2 -> Success)", ex, ey, ne, 0},
                            {"plain TCP stream (same run)", ex, eb, ne, 1}};
  const svg_line_chart charts[] = {{"transfer engine", "block size (8 MiB batches at random offsets)", "GB/s",
                                    SVG_TICK_BYTES, engine, 2, 0, 30, 600, 470},
                                   {"end to end", "request length (tokens, llama-3.1-8b: 128 KiB per token)",
                                    "GB/s", SVG_TICK_NUMBER, e2e, 2, 600, 30, 600, 470}};
  svg_begin(f, 1200, 500, "kvferry throughput (TCP loopback baseline measured in the same run)");
  for (size_t i = 0; i < 2; i++) svg_draw_line_chart(f, &charts[i]);
  svg_end(f);
  if (fflush(f) || ferror(f)) {
    fprintf(stderr, "bench: writing %s failed: %s\n", o->plot, strerror(errno));
    goto out;
  }
  printf("plot written to %s\n", o->plot);
  rc = 0;
out:
  if (fclose(f) && !rc) {
    fprintf(stderr, "bench: writing %s failed: %s\n", o->plot, strerror(errno));
    rc = 1;
  }
  if (rc) remove(o->plot);
  return rc;
}

static void usage(void) {
  printf(
      "usage: kvferry bench [engine|rooms|e2e|layerwise|peers] [--json] [--quick] [--bytes 2G] [--inflight 4]\n"
      "                     (no benchmark named: all three; --json then prints one object)\n"
      "                     [--block SIZE --per-batch N]   (one custom engine case)\n"
      "                     [--room-pages N --inflight M [--rooms R]]  (one custom rooms case)\n"
      "                     [--fanout-only]  rooms: only the fan-out cases (MLA TP 1 to 1, 2, 4, 8 and 4 to 1)\n"
      "                     [--pool SIZE]  engine: pool per side, also the baseline's (default 256M)\n"
      "                     [--layer-ms MS]  layerwise: compute per layer (default: the measured transfer\n"
      "                                      time per layer); layerwise is not part of the default three\n"
      "                     [--idle-compute]  layerwise: the compute sleeps (a GPU's) instead of busy work\n"
      "                     [--transport tcp|ucx|auto]  engine transport (default $KVFERRY_TRANSPORT or auto)\n"
      "                     [--verify]     e2e: also in verify mode (XXH3 digests), the overhead ratio\n"
      "                     [--peers 1,8,64,256]  peers: idle decode peers of one prefill rank (--quick: 1,8);\n"
      "                                   without --transport both tcp and ucx run\n"
      "       kvferry bench --plot FILE.svg [--quick]   engine and end-to-end throughput against the\n"
      "                     same-run TCP stream, drawn as SVG by kvferry (nothing to install; SVG only)\n");
}

int cli_bench(int argc, char **argv) {
  bench_opts o = {.json = 0,
                  .bytes = 2ull << 30,
                  .inflight = 4,
                  .block = 0,
                  .per_batch = 16,
                  .pool_bytes = 256ull << 20,
                  .layer_ms = -1};
  static const struct option opts[] = {{"json", no_argument, 0, 'j'},
                                       {"bytes", required_argument, 0, 'b'},
                                       {"inflight", required_argument, 0, 'i'},
                                       {"block", required_argument, 0, 'B'},
                                       {"pool", required_argument, 0, 'M'},
                                       {"rooms", required_argument, 0, 'N'},
                                       {"quick", no_argument, 0, 'q'},
                                       {"room-pages", required_argument, 0, 'R'},
                                       {"per-batch", required_argument, 0, 'P'},
                                       {"plot", required_argument, 0, 'p'},
                                       {"layer-ms", required_argument, 0, 'L'},
                                       {"idle-compute", no_argument, 0, 'I'},
                                       {"transport", required_argument, 0, CLI_OPT_TRANSPORT},
                                       {"verify", no_argument, 0, 'V'},
                                       {"fanout-only", no_argument, 0, 'F'},
                                       {"peers", required_argument, 0, 'e'},
                                       {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
  int c;
  unsigned long long v;
  while ((c = getopt_long(argc, argv, "jb:i:B:P:qR:p:M:N:L:IVe:h", opts, NULL)) != -1) {
    switch (c) {
      case 'N':
        o.rooms = atoi(optarg);
        if (o.rooms < 1 || o.rooms > 1000000) return usage(), 2;
        break;
      case 'M':
        if (cli_parse_size(optarg, &v) || v < (2u << 20) || v > (4ull << 30)) return usage(), 2;
        o.pool_bytes = v;
        break;
      case 'R':
        o.room_pages = atoi(optarg);
        if (o.room_pages < 1 || o.room_pages > 4096) return usage(), 2;
        break;
      case 'q': o.quick = 1; break;
      case 'I': o.idle_compute = 1; break;
      case 'L':
        o.layer_ms = atof(optarg);
        if (!(o.layer_ms >= 0 && o.layer_ms <= 10000)) return usage(), 2;
        break;
      case 'V': o.verify = 1; break;
      case 'F': o.fanout_only = 1; break;
      case 'e': o.peers = optarg; break;
      case 'p': o.plot = optarg; break;
      case 'B':
        if (cli_parse_size(optarg, &v) || v == 0 || v > (64u << 20)) return usage(), 2;
        o.block = v;
        break;
      case 'P':
        o.per_batch = atoi(optarg);
        if (o.per_batch < 1 || o.per_batch > 4096) return usage(), 2;
        break;
      case 'j': o.json = 1; break;
      case CLI_OPT_TRANSPORT:
        if (cli_set_transport("bench", optarg)) return 2;
        o.transport = optarg;
        break;
      case 'b':
        if (cli_parse_size(optarg, &v) || v < (1 << 20)) return usage(), 2;
        o.bytes = v;
        break;
      case 'i':
        o.inflight = atoi(optarg);
        if (o.inflight < 1 || o.inflight > 64) return usage(), 2;
        break;
      case 'h': usage(); return 0;
      default: usage(); return 2;
    }
  }
  if (o.plot) return bench_plot(&o);
  const char *which = optind < argc ? argv[optind] : NULL;
  if (!which) { /* all three; --json: one object holding the three */
    int rc = 0;
    if (o.json) printf("{\"engine\":");
    else printf("== engine ==\n");
    fflush(stdout);
    rc |= bench_engine(&o);
    printf(o.json ? ",\"rooms\":" : "\n== rooms ==\n");
    fflush(stdout);
    rc |= bench_rooms(&o);
    printf(o.json ? ",\"e2e\":" : "\n== e2e ==\n");
    fflush(stdout);
    rc |= bench_e2e(&o);
    if (o.json) printf("}\n");
    return rc ? 1 : 0;
  }
  if (!strcmp(which, "engine")) return bench_engine(&o);
  if (!strcmp(which, "rooms")) return bench_rooms(&o);
  if (!strcmp(which, "e2e")) return bench_e2e(&o);
  if (!strcmp(which, "layerwise")) return bench_layerwise(&o);
  if (!strcmp(which, "peers")) {
    peers_opts po = {.json = o.json, .quick = o.quick, .peers = o.peers, .transport = o.transport};
    return cli_bench_peers(&po);
  }
  fprintf(stderr, "bench: unknown benchmark '%s' (available: engine, rooms, e2e, layerwise, peers)\n", which);
  return 2;
}

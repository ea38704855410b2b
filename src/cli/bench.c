/* `kvferry bench`: benchmarks that measure their own baseline in the same
 * run and print the ratio, because these machines are shared and noisy.
 *   kvferry bench engine  plain TCP loopback stream (baseline) vs the engine
 *                         on 1 MiB blocks and on batches of 256 scattered
 *                         32 KiB pages, with peers in separate processes
 * --json prints one JSON object whose `cases` array holds, per case, name,
 * gbps, baseline_gbps and ratio. */
#include <arpa/inet.h>
#include <getopt.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "kvferry.h"
#include "peer.h"

typedef struct bench_opts {
  int json;
  uint64_t block;    /* --block: one extra case with this block size */
  int per_batch;
  uint64_t bytes;    /* per case */
  int inflight;      /* batches in flight */
} bench_opts;

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

static uint64_t rng_next(uint64_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

/* Baseline: one blocking TCP stream over loopback, 1 MiB writes, to a child
 * process that receives into a buffer; timed until the child confirms it has
 * every byte. */
static double bench_tcp_baseline(uint64_t total) {
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
    char *buf = malloc(blk);
    uint64_t got = 0;
    while (fd >= 0 && buf && got < total) {
      ssize_t r = recv(fd, buf, blk, MSG_WAITALL);
      if (r <= 0) _exit(1);
      got += (uint64_t)r;
    }
    char ok = 1;
    if (send(fd, &ok, 1, 0) != 1) _exit(1);
    _exit(0);
  }
  close(ls);
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  char *buf = malloc(blk);
  double gbps = 0;
  if (fd >= 0 && buf && connect(fd, (struct sockaddr *)&a, sizeof a) == 0) {
    memset(buf, 7, blk);
    double t0 = now_s();
    uint64_t sent = 0;
    while (sent < total) {
      ssize_t r = send(fd, buf, blk, MSG_NOSIGNAL);
      if (r <= 0) break;
      sent += (uint64_t)r;
    }
    char ok;
    if (sent >= total && recv(fd, &ok, 1, MSG_WAITALL) == 1) gbps = total / (now_s() - t0) / 1e9;
  }
  if (fd >= 0) close(fd);
  free(buf);
  kill(pid, SIGKILL);
  waitpid(pid, NULL, 0);
  return gbps;
}

/* Engine case: batches of `per_batch` blocks of `block` bytes at random
 * block-aligned offsets of a 256 MiB pool on both sides, `inflight` batches
 * in flight, until `total` bytes have been confirmed. */
static double bench_engine_case(kvf_engine *e, engine_peer *peer, unsigned char *pool, uint64_t pool_bytes,
                                uint64_t block, size_t per_batch, int inflight, uint64_t total,
                                int *failed) {
  uint64_t slots = pool_bytes / block, rng = 0x12345678;
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
  double t0 = now_s();
  size_t slot = 0;
  while (done < total && !*failed) {
    if (b[slot]) { /* oldest batch in this slot: wait for it first */
      if (kvf_batch_wait(b[slot], -1)) *failed = 1;
      kvf_batch_free(b[slot]);
      b[slot] = NULL;
      done += per;
    }
    if (submitted < total) {
      kvf_write *ws = &w[slot * per_batch];
      for (size_t i = 0; i < per_batch; i++) {
        ws[i] = (kvf_write){.src = (uint64_t)(uintptr_t)pool + (rng_next(&rng) % slots) * block,
                            .dst = peer->base + (rng_next(&rng) % slots) * block, .len = block};
      }
      if (kvf_engine_submit(e, peer->session, ws, per_batch, &b[slot])) *failed = 1;
      submitted += per;
    }
    slot = (slot + 1) % nb;
  }
  for (size_t i = 0; i < nb; i++)
    if (b[i]) {
      if (kvf_batch_wait(b[i], -1)) *failed = 1;
      kvf_batch_free(b[i]);
    }
  double dt = now_s() - t0;
  free(w);
  free(b);
  return *failed ? 0 : done / dt / 1e9;
}

static int bench_engine(const bench_opts *o) {
  const uint64_t pool_bytes = 256ull << 20;
  double base = bench_tcp_baseline(o->bytes);
  engine_peer peer;
  if (engine_peer_start(&peer, pool_bytes, NULL)) return 1;
  unsigned char *pool = mmap(NULL, pool_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  kvf_engine *e = NULL;
  int rc = 1;
  if (pool == MAP_FAILED || kvf_engine_create(NULL, &e) || kvf_engine_register(e, pool, pool_bytes)) {
    fprintf(stderr, "bench: cannot set up the engine\n");
    goto out;
  }
  memset(pool, 3, pool_bytes);
  /* Warm up: connections, peer page faults. */
  int failed = 0;
  bench_engine_case(e, &peer, pool, pool_bytes, 1 << 20, 16, 2, pool_bytes, &failed);
  struct {
    const char *name;
    uint64_t block;
    size_t per_batch;
    double gbps;
  } cases[] = {{"engine_1MiB_blocks", 1 << 20, 16, 0}, {"engine_256x32KiB_scattered", 32 << 10, 256, 0}};
  size_t nc = sizeof cases / sizeof cases[0];
  if (o->block) { /* a single custom case replaces the standard ones */
    cases[0].name = "engine_custom";
    cases[0].block = o->block;
    cases[0].per_batch = (size_t)o->per_batch;
    nc = 1;
  }
  for (size_t i = 0; i < nc && !failed; i++)
    cases[i].gbps = bench_engine_case(e, &peer, pool, pool_bytes, cases[i].block, cases[i].per_batch,
                                      o->inflight, o->bytes, &failed);
  if (failed) {
    fprintf(stderr, "bench: a batch failed\n");
    goto out;
  }
  if (o->json) {
    printf("{\"bench\":\"engine\",\"bytes_per_case\":%llu,\"inflight\":%d,\"cases\":[",
           (unsigned long long)o->bytes, o->inflight);
    for (size_t i = 0; i < nc; i++)
      printf("%s{\"name\":\"%s\",\"gbps\":%.3f,\"baseline_gbps\":%.3f,\"ratio\":%.3f}", i ? "," : "",
             cases[i].name, cases[i].gbps, base, base > 0 ? cases[i].gbps / base : 0);
    printf("]}\n");
  } else {
    printf("baseline: plain TCP loopback, one stream, 1 MiB writes: %.2f GB/s\n", base);
    printf("%-30s %10s %10s %8s\n", "case", "GB/s", "base GB/s", "ratio");
    for (size_t i = 0; i < nc; i++)
      printf("%-30s %10.2f %10.2f %8.2f\n", cases[i].name, cases[i].gbps, base,
             base > 0 ? cases[i].gbps / base : 0);
  }
  rc = 0;
out:
  kvf_engine_destroy(e);
  engine_peer_stop(&peer);
  if (pool != MAP_FAILED) munmap(pool, pool_bytes);
  return rc;
}

static void usage(void) {
  printf("usage: kvferry bench [engine] [--json] [--bytes 2G] [--inflight 4]\n"
         "                     [--block SIZE --per-batch N]   (one custom engine case)\n");
}

int cli_bench(int argc, char **argv) {
  bench_opts o = {.json = 0, .bytes = 2ull << 30, .inflight = 4, .block = 0, .per_batch = 16};
  static const struct option opts[] = {{"json", no_argument, 0, 'j'},
                                       {"bytes", required_argument, 0, 'b'},
                                       {"inflight", required_argument, 0, 'i'},
                                       {"block", required_argument, 0, 'B'},
                                       {"per-batch", required_argument, 0, 'P'},
                                       {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
  int c;
  unsigned long long v;
  while ((c = getopt_long(argc, argv, "jb:i:B:P:h", opts, NULL)) != -1) {
    switch (c) {
      case 'B':
        if (cli_parse_size(optarg, &v) || v == 0 || v > (64u << 20)) return usage(), 2;
        o.block = v;
        break;
      case 'P':
        o.per_batch = atoi(optarg);
        if (o.per_batch < 1 || o.per_batch > 4096) return usage(), 2;
        break;
      case 'j': o.json = 1; break;
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
  const char *which = optind < argc ? argv[optind] : "engine";
  if (!strcmp(which, "engine")) return bench_engine(&o);
  fprintf(stderr, "bench: unknown benchmark '%s' (available: engine)\n", which);
  return 2;
}

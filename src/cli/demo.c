/* `kvferry demo`: the main job, end to end, with every byte checked. Until
 * the KV managers land this is the engine demo: a second process
 * (`kvferry engine-peer`) registers a page pool; this process writes rounds
 * of scattered pages into it through the transfer engine (contiguous runs
 * merged into one block) and asks the peer to verify every page. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#include "cli.h"
#include "kvferry.h"
#include "pattern.h"
#include "peer.h"

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

/* Fisher-Yates prefix: the first k entries of perm become a random k-subset. */
static void shuffle_prefix(uint64_t *perm, uint64_t n, uint64_t k, uint64_t *rng) {
  for (uint64_t i = 0; i < k; i++) {
    uint64_t j = i + rng_next(rng) % (n - i);
    uint64_t t = perm[i];
    perm[i] = perm[j];
    perm[j] = t;
  }
}

static int cmp_u64(const void *a, const void *b) {
  uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
  return x < y ? -1 : x > y;
}

static void usage(void) {
  printf("usage: kvferry demo [--pages N] [--page-size BYTES] [--rounds R] [--per-round K]\n"
         "                    [--seed S] [--corrupt]\n"
         "Moves K scattered pages per round from this process into a peer process's\n"
         "pool of N pages through the transfer engine and verifies every byte.\n"
         "--corrupt flips one source byte after the pattern is written, to show that\n"
         "verification catches it (the demo then exits 1).\n");
}

int cli_demo(int argc, char **argv) {
  unsigned long long pages = 4096, page_size = 32768, rounds = 8, per_round = 1024, seed = 1;
  int corrupt = 0;
  static const struct option opts[] = {{"pages", required_argument, 0, 'n'},
                                       {"page-size", required_argument, 0, 's'},
                                       {"rounds", required_argument, 0, 'r'},
                                       {"per-round", required_argument, 0, 'k'},
                                       {"seed", required_argument, 0, 'S'},
                                       {"corrupt", no_argument, 0, 'c'},
                                       {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
  int c;
  while ((c = getopt_long(argc, argv, "n:s:r:k:S:ch", opts, NULL)) != -1) {
    unsigned long long *dst = NULL;
    switch (c) {
      case 'n': dst = &pages; break;
      case 's': dst = &page_size; break;
      case 'r': dst = &rounds; break;
      case 'k': dst = &per_round; break;
      case 'S': dst = &seed; break;
      case 'c': corrupt = 1; continue;
      case 'h': usage(); return 0;
      default: usage(); return 2;
    }
    if (cli_parse_size(optarg, dst) || (*dst == 0 && c != 'S')) {
      fprintf(stderr, "demo: bad value '%s'\n", optarg);
      return 2;
    }
  }
  if (per_round > pages) per_round = pages;
  uint64_t bytes = pages * page_size;

  engine_peer peer;
  if (engine_peer_start(&peer, bytes, NULL)) return 1;
  unsigned char *pool = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  uint64_t *src_perm = malloc(pages * sizeof *src_perm), *dst_perm = malloc(pages * sizeof *dst_perm);
  kvf_write *w = malloc(per_round * sizeof *w);
  size_t line_cap = 64 + per_round * 48;
  char *line = malloc(line_cap);
  kvf_engine *e = NULL;
  int rc = 1, err;
  if (pool == MAP_FAILED || !src_perm || !dst_perm || !w || !line) {
    fprintf(stderr, "demo: out of memory\n");
    goto out;
  }
  if ((err = kvf_engine_create(NULL, &e)) || (err = kvf_engine_register(e, pool, bytes))) {
    fprintf(stderr, "demo: engine: %s\n", kvf_strerror(err));
    goto out;
  }
  printf("kvferry demo: %llu pages of %llu B per round, %llu rounds, peer %s\n", per_round, page_size,
         rounds, peer.session);
  for (uint64_t i = 0; i < pages; i++) src_perm[i] = dst_perm[i] = i;
  uint64_t rng = seed * 0x9e3779b97f4a7c15ULL + 1, moved = 0, blocks = 0, verified = 0;
  double busy = 0;
  int failures = 0;
  for (uint64_t r = 0; r < rounds; r++) {
    shuffle_prefix(src_perm, pages, per_round, &rng);
    shuffle_prefix(dst_perm, pages, per_round, &rng);
    /* Sorted destinations make some runs contiguous, as a real allocator does. */
    qsort(dst_perm, per_round, sizeof *dst_perm, cmp_u64);
    size_t nw = 0;
    for (uint64_t i = 0; i < per_round; i++) {
      uint64_t s = src_perm[i], d = dst_perm[i];
      pattern_fill(pool + s * page_size, page_size, seed, r * pages + d);
      if (nw && w[nw - 1].src + w[nw - 1].len == (uint64_t)(uintptr_t)(pool + s * page_size) &&
          w[nw - 1].dst + w[nw - 1].len == peer.base + d * page_size) {
        w[nw - 1].len += page_size;
      } else {
        w[nw++] = (kvf_write){.src = (uint64_t)(uintptr_t)(pool + s * page_size),
                              .dst = peer.base + d * page_size, .len = page_size};
      }
    }
    if (corrupt && r == rounds - 1) pool[src_perm[per_round / 2] * page_size + 17] ^= 0x5a;
    double t0 = now_s();
    err = kvf_engine_write(e, peer.session, w, nw);
    busy += now_s() - t0;
    if (err) {
      fprintf(stderr, "demo: round %llu: write failed: %s\n", (unsigned long long)r, kvf_strerror(err));
      failures++;
      continue;
    }
    moved += per_round * page_size;
    blocks += nw;
    int off = snprintf(line, line_cap, "verify %llu %llu ", seed, page_size);
    for (uint64_t i = 0; i < per_round; i++)
      off += snprintf(line + off, line_cap - (size_t)off, "%s%llu:%llu", i ? "," : "",
                      (unsigned long long)dst_perm[i], (unsigned long long)(r * pages + dst_perm[i]));
    char reply[128];
    if (proc_ask(&peer.p, line, reply, sizeof reply, 30000)) {
      fprintf(stderr, "demo: peer did not answer the verification\n");
      failures++;
      break;
    }
    if (strncmp(reply, "ok ", 3)) {
      fprintf(stderr, "demo: round %llu: MISMATCH reported by the peer: %s\n", (unsigned long long)r,
              reply);
      failures++;
    } else {
      verified += strtoull(reply + 3, NULL, 10);
    }
    if (cli_is_tty()) {
      fprintf(stderr, "\r  round %llu/%llu", (unsigned long long)r + 1, rounds);
      fflush(stderr);
    }
  }
  if (cli_is_tty()) fprintf(stderr, "\n");
  printf("\n  %-22s %llu\n", "pages verified", (unsigned long long)verified);
  printf("  %-22s %.3f\n", "GiB moved", moved / (double)(1ull << 30));
  printf("  %-22s %llu (runs merged from %llu pages)\n", "engine blocks", (unsigned long long)blocks,
         (unsigned long long)(moved / page_size));
  printf("  %-22s %.2f\n", "GB/s (write + ack)", busy > 0 ? moved / busy / 1e9 : 0.0);
  printf("  %-22s %d\n", "failures", failures);
  rc = failures ? 1 : 0;
  printf("%s\n", rc ? "demo FAILED: see the messages above" : "demo OK: every byte verified");
out:
  kvf_engine_destroy(e);
  engine_peer_stop(&peer);
  if (pool != MAP_FAILED) munmap(pool, bytes);
  free(src_perm);
  free(dst_perm);
  free(w);
  free(line);
  return rc;
}

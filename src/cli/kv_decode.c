/* `kvferry kv-decode`: a decode instance in one process (one decode rank: a
 * KV manager with its own engine and model-shaped pool), the counterpart of
 * `kvferry kv-peer` for the demo and the end-to-end benchmark, which then
 * run prefill and decode as separate processes the way a deployment does.
 * It prints
 *   ready <engine-session>
 * and takes commands on stdin:
 *   recv <room> <npages> <seed> <token> [corrupt]
 *       creates the receiver against the --bootstrap server, takes npages
 *       scattered pages and sends its M2 (kvf_receiver_init); once the room
 *       is final it checks the token, the candidates (token+1, token+2) and
 *       every byte of every page against the request's pattern. `corrupt`
 *       flips one byte of one landed page before the check, to show that the
 *       check catches it. Seed 0 skips the byte check (benchmarks).
 *   quit
 * and reports each request once it is final and checked:
 *   done <room> <poll-status> <bad-pages> <t-init-ns> <t-final-ns> <reason or ->
 * with CLOCK_MONOTONIC times (comparable across processes on one host) of
 * the init call and of the poll that first saw the final status. bad-pages
 * counts (page, buffer) pairs that differ. It exits on EOF of stdin. */
#include <getopt.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "kvferry.h"
#include "kvpool.h"
#include "pattern.h"

#define DEC_MAX_REQS 1024

typedef struct dec_req {
  int active, corrupt;
  int64_t room, token;
  uint64_t seed;
  kvf_receiver *rx;
  int64_t *pages;
  size_t npages;
  long long t_init_ns;
} dec_req;

static long long now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Count the (page, buffer) pairs that do not hold their pattern; describe the
 * first in `why`. kvpool_check only counts, and a user wants to know where. */
static size_t check_pages(kvpool *pool, dec_req *r, char *why, size_t cap) {
  size_t bad = 0;
  for (size_t b = 0; b < pool->nbuf; b++)
    for (size_t k = 0; k < r->npages; k++) {
      const char *p = (const char *)pool->ptrs[b] + r->pages[k] * pool->item_len;
      if (pattern_check(p, pool->item_len, r->seed, kvpool_label(r->room, k, b))) continue;
      if (!bad++)
        snprintf(why, cap, "byte-mismatch:request-page-%zu(pool-page-%lld),layer-%zu-%s", k,
                 (long long)r->pages[k], b % pool->layers, b < pool->layers ? "K" : "V");
    }
  return bad;
}

static void finish(kvf_manager *m, kvpool *pool, dec_req *r, int st, long long t_final) {
  char why[256] = "";
  size_t bad = 0;
  if (st == KVF_POLL_SUCCESS) {
    int64_t tok = -1;
    int32_t cands[8];
    size_t nc = 0;
    kvf_receiver_pop_metadata(r->rx, &tok, cands, 8, &nc);
    /* Bytes landed from the engine's threads: order them before reading. */
    kvf_engine_sync(kvf_manager_engine(m));
    if (r->corrupt && r->npages) {
      /* One byte in the middle of one page of one V buffer, as a torn or
       * misdirected write would leave it; the normal check must find it. */
      size_t b = pool->nbuf - 1, k = r->npages / 2;
      ((unsigned char *)pool->ptrs[b])[r->pages[k] * pool->item_len + pool->item_len / 2] ^= 0x40;
    }
    if (r->seed) bad = check_pages(pool, r, why, sizeof why);
    if (!*why && (tok != r->token || nc != 2 || cands[0] != r->token + 1 || cands[1] != r->token + 2))
      snprintf(why, sizeof why, "metadata-mismatch:token-%lld-want-%lld,candidates-%zu", (long long)tok,
               (long long)r->token, nc);
  } else {
    kvf_receiver_failure(r->rx, why, sizeof why);
    for (char *p = why; *p; p++)
      if (*p == '\n' || *p == ' ') *p = '_';
  }
  printf("done %lld %d %zu %lld %lld %s\n", (long long)r->room, st, bad, r->t_init_ns, t_final, *why ? why : "-");
  fflush(stdout);
  kvf_receiver_destroy(r->rx);
  kvpool_give(pool, r->pages, r->npages);
  free(r->pages);
  memset(r, 0, sizeof *r);
}

static void start(kvf_manager *m, kvpool *pool, const char *baddr, dec_req *r, uint64_t *rng) {
  const char *why = NULL;
  r->pages = malloc((r->npages ? r->npages : 1) * sizeof *r->pages);
  if (!r->pages || kvpool_take(pool, r->npages, rng, r->pages)) {
    free(r->pages);
    r->pages = NULL;
    why = "no-free-pages";
  } else if (kvf_receiver_create(m, baddr, r->room, &r->rx)) {
    kvpool_give(pool, r->pages, r->npages);
    free(r->pages);
    why = "cannot-create-receiver";
  } else {
    r->t_init_ns = now_ns();
    if (kvf_receiver_init(r->rx, r->pages, r->npages, 0, 0, NULL, 0)) why = "cannot-init";
    r->active = 1;
    if (!why) return;
    finish(m, pool, r, KVF_POLL_FAILED, now_ns());
    return;
  }
  printf("done %lld 0 0 0 0 %s\n", (long long)r->room, why);
  fflush(stdout);
  memset(r, 0, sizeof *r);
}

int cli_kv_decode(int argc, char **argv) {
  int layers = 2;
  unsigned long long item = 4096, pages = 4096;
  const char *host = "127.0.0.1", *baddr = NULL;
  static const struct option opts[] = {{"layers", required_argument, 0, 'l'},  {"item", required_argument, 0, 'i'},
                                       {"pages", required_argument, 0, 'p'},   {"host", required_argument, 0, 'H'},
                                       {"bootstrap", required_argument, 0, 'b'}, {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
  int c;
  while ((c = getopt_long(argc, argv, "l:i:p:H:b:h", opts, NULL)) != -1) {
    switch (c) {
      case 'l': layers = atoi(optarg); break;
      case 'i': if (cli_parse_size(optarg, &item)) return 2; break;
      case 'p': if (cli_parse_size(optarg, &pages)) return 2; break;
      case 'H': host = optarg; break;
      case 'b': baddr = optarg; break;
      case 'h':
        printf("usage: kvferry kv-decode --bootstrap HOST:PORT [--layers 2] [--item 4096] [--pages 4096]\n"
               "                         [--host 127.0.0.1]\n");
        return 0;
      default: return 2;
    }
  }
  if (!baddr || layers < 1 || !item || !pages) {
    fprintf(stderr, "kv-decode: --bootstrap HOST:PORT and a non-empty layout are required\n");
    return 2;
  }
  int rc = 1;
  kvpool pool;
  kvf_manager *m = NULL;
  dec_req *reqs = calloc(DEC_MAX_REQS, sizeof *reqs);
  if (!reqs) goto out;
  if (kvpool_init(&pool, (size_t)layers, pages, item)) {
    fprintf(stderr, "kv-decode: cannot allocate a pool of %llu pages x %d buffers x %llu B\n", pages, 2 * layers,
            item);
    goto out_reqs;
  }
  kvf_manager_config mc;
  kvf_manager_config_init(&mc);
  mc.role = KVF_ROLE_DECODE;
  mc.host = host;
  int err = kvf_manager_create(&mc, &pool.bufs, &m);
  if (err) {
    fprintf(stderr, "kv-decode: %s\n", kvf_strerror(err));
    goto out_pool;
  }
  printf("ready %s\n", kvf_manager_session_id(m));
  fflush(stdout);
  uint64_t rng = 0x9E3779B97F4A7C15ULL;
  char line[512];
  size_t llen = 0;
  int eof = 0, nactive = 0;
  while (!eof) {
    /* Spin briefly while rooms are live (waking costs ~30 us here), sleep
     * on stdin otherwise. */
    struct pollfd pf = {.fd = STDIN_FILENO, .events = POLLIN};
    if (poll(&pf, 1, nactive ? 0 : 50) > 0) {
      ssize_t k = read(STDIN_FILENO, line + llen, sizeof line - 1 - llen);
      if (k <= 0) eof = 1;
      else llen += (size_t)k;
      char *nl;
      while ((nl = memchr(line, '\n', llen))) {
        *nl = 0;
        long long room, np, token;
        unsigned long long seed;
        char extra[16] = "";
        if (!strcmp(line, "quit")) {
          eof = 1;
        } else if (sscanf(line, "recv %lld %lld %llu %lld %15s", &room, &np, &seed, &token, extra) >= 4 && np >= 0) {
          dec_req *r = NULL;
          for (int i = 0; i < DEC_MAX_REQS && !r; i++)
            if (!reqs[i].active) r = &reqs[i];
          if (!r) {
            printf("done %lld 0 0 0 0 too-many-requests\n", room);
          } else {
            *r = (dec_req){.room = room, .npages = (size_t)np, .seed = seed, .token = token,
                           .corrupt = !strcmp(extra, "corrupt")};
            start(m, &pool, baddr, r, &rng);
          }
        } else {
          printf("error bad command\n");
        }
        fflush(stdout);
        size_t used = (size_t)(nl - line) + 1;
        memmove(line, nl + 1, llen - used);
        llen -= used;
      }
      if (llen == sizeof line - 1) llen = 0; /* an overlong line is dropped */
    }
    /* Stamp every room that is final before checking any: a check of a
     * large request takes a while and must not delay the others' stamps. */
    int st[DEC_MAX_REQS];
    nactive = 0;
    for (int i = 0; i < DEC_MAX_REQS; i++) {
      st[i] = -1;
      if (!reqs[i].active) continue;
      st[i] = kvf_receiver_poll(reqs[i].rx);
      nactive++;
    }
    long long t = now_ns();
    for (int i = 0; i < DEC_MAX_REQS; i++)
      if (st[i] == KVF_POLL_SUCCESS || st[i] == KVF_POLL_FAILED) {
        finish(m, &pool, &reqs[i], st[i], t);
        nactive--;
      }
    if (nactive) usleep(50);
  }
  rc = 0;
  for (int i = 0; i < DEC_MAX_REQS; i++)
    if (reqs[i].active) {
      kvf_receiver_destroy(reqs[i].rx);
      free(reqs[i].pages);
    }
  kvf_manager_destroy(m);
out_pool:
  kvpool_free(&pool);
out_reqs:
  free(reqs);
out:
  return rc;
}

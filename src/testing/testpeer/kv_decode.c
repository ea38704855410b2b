/* `kvferry-testpeer kv-decode`: a decode instance in one process (--world D decode
 * ranks, each a KV manager with its own engine and model-shaped pool; with
 * --heads the pools are head-aware and rank d holds global KV heads
 * d*heads ..; with --mla they are MLA pools, one latent buffer per layer,
 * the same on every rank, planned by the generic planner as replicated, or
 * with --mla-legacy by the legacy MLA routing), the counterpart of
 * `kvferry-testpeer kv-peer` for the demo and the end-to-end benchmark, which then
 * run prefill and decode as separate processes the way a deployment does.
 * It prints
 *   ready <engine-session>
 * and takes commands on stdin:
 *   recv <room> <npages> <seed> <token> [corrupt|corrupt-landed|poke-late|-] [bootstrap]
 *       creates a receiver on every decode rank against the --bootstrap
 *       server (or the one the line names: a decode instance serving several
 *       prefill instances, `kvferry demo --cluster`), each takes npages
 *       scattered pages of its pool and sends its M2 (kvf_receiver_init); once the room is final on every rank it
 *       checks each rank's token, candidates (token+1, token+2) and every
 *       byte of every page (head-aware: every (token, head) unit) against the
 *       request's pattern. `corrupt` flips one byte of one landed page of the
 *       last rank before the check, to show that the
 *       check catches it. `corrupt-landed` flips one byte of the room's first
 *       page to land, inside the library right before verify mode checks it
 *       against its digest (the testing library's hook, testing/tamper.h),
 *       so the library fails the room naming the page. Seed 0 skips the
 *       byte check (benchmarks).
 *   stats
 *       one line "stats <live-rooms> <received> <malformed> <unknown-room>"
 *       summed over the ranks (as kv-peer's)
 *   quarantine
 *       with --quarantine-ms: checks every page in quarantine now and answers
 *       "quarantine <pages-held> <pages-checked> <pages-changed>" (see below)
 *   quit
 * and reports each request once it is final and checked:
 *   done <room> <poll-status> <bad-pages> <t-init-ns> <t-final-ns> <reason or ->
 * with CLOCK_MONOTONIC times (comparable across processes on one host) of
 * the last rank's init call and of the poll that first saw every rank final
 * (Failed as soon as one rank is). bad-pages counts (rank, page, buffer)
 * triples that differ. It exits on EOF of stdin. With --rank r the process
 * hosts only rank r of the --world ranks (one process per GPU).
 *
 * --quarantine-ms MS is the late-write check: when a room ends Failed, its
 * pages are overwritten with a poison byte at once and kept out of reuse for
 * MS; before they go back to the pool every byte must still be poison. A
 * page that changed was written after its room failed: it is counted and
 * reported as "late-write <room> <pages> <where>". `poke-late` on a recv
 * flips one byte of one page of that room right after the poison, as a late
 * write would, to show that the check catches it. */
#include <getopt.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "testing/tamper.h"
#include "testing/testpeer/testpeer.h"
#include "kvferry.h"
#include "tools/kvpool.h"
#include "tools/pattern.h"

#define DEC_MAX_REQS 1024
#define DEC_MAX_RANKS 64
#define DEC_QUAR_MAX 4096 /* quarantined rooms; the oldest is checked early when full */
#define DEC_POISON 0xA5

/* One decode rank: its manager and its pool. */
typedef struct dec_rank {
  tp_rank r;
  int rank; /* its rank in the decode instance */
} dec_rank;

typedef struct dec_req {
  int active, corrupt, late_poke;
  int64_t room, token;
  uint64_t seed;
  char baddr[KVF_ADDR_MAX + 1];    /* the prefill's bootstrap server; "" = --bootstrap */
  kvf_receiver *rx[DEC_MAX_RANKS]; /* one per decode rank */
  int64_t *pages[DEC_MAX_RANKS];
  size_t npages;
  long long t_init_ns;
} dec_req;

/* The pages of one Failed room, poisoned and out of reuse until `until_ns`. */
typedef struct dec_quar {
  int64_t room;
  int64_t *pages[DEC_MAX_RANKS];
  size_t npages;
  long long until_ns;
} dec_quar;

typedef struct dec_quarantine {
  long long ms; /* 0: no late-write check */
  dec_quar q[DEC_QUAR_MAX];
  size_t head, n;                            /* a ring, oldest first */
  unsigned long long held, checked, changed; /* pages */
} dec_quarantine;

/* Poison the pages of a Failed room and move them (taken from `r`) into
 * quarantine. */
static void quarantine_room(dec_quarantine *qz, dec_rank *rk, int nranks, dec_req *r);

/* Count the (rank, page, buffer) triples that do not hold their pattern
 * (for a head-aware pool: any unit (token, head) of it); describe the first
 * in `why`. kvpool_check only counts, and a user wants to know where. */
static size_t check_pages(kvpool *pool, int rank, const int64_t *pages, dec_req *r, char *why, size_t cap) {
  size_t bad = 0;
  for (size_t b = 0; b < pool->nbuf; b++)
    for (size_t k = 0; k < r->npages; k++) {
      const char *p = (const char *)pool->ptrs[b] + pages[k] * pool->item_len;
      const char *kind = pool->nbuf == pool->layers ? "latent" : b < pool->layers ? "K" : "V";
      if (!pool->heads) {
        if (pattern_check(p, pool->item_len, r->seed, kvpool_label(r->room, k, b))) continue;
        if (!bad++)
          snprintf(why, cap, "byte-mismatch:rank-%d,request-page-%zu(pool-page-%lld),layer-%zu-%s", rank, k,
                   (long long)pages[k], b % pool->layers, kind);
        continue;
      }
      int page_bad = 0;
      for (size_t t = 0; t < pool->page_size; t++)
        for (size_t j = 0; j < pool->heads; j++) {
          uint64_t tok = k * pool->page_size + t, h = pool->head0 + j;
          if (pattern_check(p + (t * pool->heads + j) * pool->unit, pool->unit, r->seed,
                            kvpool_unit_label(r->room, tok, h, b)))
            continue;
          if (!bad && !page_bad)
            snprintf(why, cap,
                     "byte-mismatch:rank-%d,request-page-%zu(pool-page-%lld),token-%llu,head-%llu,layer-%zu-%s",
                     rank, k, (long long)pages[k], (unsigned long long)tok, (unsigned long long)h,
                     b % pool->layers, kind);
          page_bad = 1;
        }
      bad += (size_t)page_bad;
    }
  return bad;
}

/* Check one quarantined room's pages are all still poison; with `give`,
 * count them checked and hand them back to the pools. Returns the pages
 * that changed (then counted and given back whatever `give` says). */
static size_t quarantine_check(dec_quarantine *qz, dec_rank *rk, int nranks, dec_quar *e, int give) {
  size_t changed = 0;
  char where[160] = "";
  for (int d = 0; d < nranks; d++) {
    kvpool *pool = &rk[d].r.pool;
    if (!e->pages[d]) continue;
    kvf_engine_sync(kvf_manager_engine(rk[d].r.m));
    for (size_t k = 0; k < e->npages; k++) {
      int page_changed = 0;
      for (size_t b = 0; b < pool->nbuf && !page_changed; b++) {
        const unsigned char *p = (const unsigned char *)pool->ptrs[b] + e->pages[d][k] * pool->item_len;
        for (uint64_t i = 0; i < pool->item_len; i++)
          if (p[i] != DEC_POISON) {
            if (!changed)
              snprintf(where, sizeof where, "rank-%d,request-page-%zu(pool-page-%lld),buffer-%zu,byte-%llu", d, k,
                       (long long)e->pages[d][k], b, (unsigned long long)i);
            page_changed = 1;
            break;
          }
      }
      changed += (size_t)page_changed;
    }
  }
  if (changed) {
    printf("late-write %lld %zu %s\n", (long long)e->room, changed, where);
    fflush(stdout);
    qz->changed += changed;
    give = 1;
  }
  if (give) {
    for (int d = 0; d < nranks; d++) {
      if (!e->pages[d]) continue;
      qz->checked += e->npages;
      qz->held -= e->npages;
      kvpool_give(&rk[d].r.pool, e->pages[d], e->npages);
      free(e->pages[d]);
      e->pages[d] = NULL;
    }
    e->npages = 0;
  }
  return changed;
}

/* Release the quarantined rooms whose time is up (all with `now` < 0). */
static void quarantine_expire(dec_quarantine *qz, dec_rank *rk, int nranks, long long now) {
  while (qz->n && (now < 0 || qz->q[qz->head].until_ns <= now)) {
    quarantine_check(qz, rk, nranks, &qz->q[qz->head], 1);
    qz->head = (qz->head + 1) % DEC_QUAR_MAX;
    qz->n--;
  }
}

/* The `quarantine` command: check every held page now, keep the unchanged. */
static void quarantine_report(dec_quarantine *qz, dec_rank *rk, int nranks) {
  for (size_t i = 0; i < qz->n; i++) {
    dec_quar *e = &qz->q[(qz->head + i) % DEC_QUAR_MAX];
    if (e->npages) quarantine_check(qz, rk, nranks, e, 0);
  }
  printf("quarantine %llu %llu %llu\n", qz->held, qz->checked, qz->changed);
  fflush(stdout);
}

static void quarantine_room(dec_quarantine *qz, dec_rank *rk, int nranks, dec_req *r) {
  if (qz->n == DEC_QUAR_MAX) quarantine_expire(qz, rk, nranks, qz->q[qz->head].until_ns);
  dec_quar *e = &qz->q[(qz->head + qz->n++) % DEC_QUAR_MAX];
  *e = (dec_quar){.room = r->room, .npages = r->npages, .until_ns = cli_now_ns() + qz->ms * 1000000LL};
  for (int d = 0; d < nranks; d++) {
    kvpool *pool = &rk[d].r.pool;
    e->pages[d] = r->pages[d];
    r->pages[d] = NULL;
    if (!e->pages[d]) continue;
    /* Order the bytes landed so far before the poison: what lands later is late. */
    kvf_engine_sync(kvf_manager_engine(rk[d].r.m));
    for (size_t b = 0; b < pool->nbuf; b++)
      for (size_t k = 0; k < e->npages; k++)
        memset((char *)pool->ptrs[b] + e->pages[d][k] * pool->item_len, DEC_POISON, pool->item_len);
    if (r->late_poke && e->npages)
      ((unsigned char *)pool->ptrs[0])[e->pages[d][e->npages / 2] * pool->item_len + pool->item_len / 3] ^= 0x5A;
    qz->held += e->npages;
  }
}

/* Destroy the room's receivers, give its pages back, clear the slot. */
static void release(dec_rank *rk, int nranks, dec_req *r) {
  for (int d = 0; d < nranks; d++) {
    kvf_receiver_destroy(r->rx[d]);
    if (r->pages[d]) kvpool_give(&rk[d].r.pool, r->pages[d], r->npages);
    free(r->pages[d]);
  }
  memset(r, 0, sizeof *r);
}

static void finish(dec_quarantine *qz, dec_rank *rk, int nranks, dec_req *r, int st, long long t_final) {
  char why[256] = "";
  if (st == KVF_POLL_FAILED && qz->ms) quarantine_room(qz, rk, nranks, r); /* poisoned before anything else */
  size_t bad = 0;
  if (st == KVF_POLL_SUCCESS) {
    for (int d = 0; d < nranks; d++) {
      int64_t tok = -1;
      int32_t cands[8];
      size_t nc = 0;
      kvpool *pool = &rk[d].r.pool;
      kvf_receiver_pop_metadata(r->rx[d], &tok, cands, 8, &nc);
      /* Bytes landed from the engine's threads: order them before reading. */
      kvf_engine_sync(kvf_manager_engine(rk[d].r.m));
      if (r->corrupt && r->npages && d == nranks - 1) {
        /* One byte in the middle of one page of the last buffer of the last
         * rank, as a torn or misdirected write would leave it; the normal
         * check must find it. */
        size_t b = pool->nbuf - 1, k = r->npages / 2;
        ((unsigned char *)pool->ptrs[b])[r->pages[d][k] * pool->item_len + pool->item_len / 2] ^= 0x40;
      }
      if (r->seed)
        bad += check_pages(pool, rk[d].rank, r->pages[d], r, why + strlen(why), sizeof why - strlen(why));
      if (!*why && (tok != r->token || nc != 2 || cands[0] != r->token + 1 || cands[1] != r->token + 2))
        snprintf(why, sizeof why, "metadata-mismatch:rank-%d,token-%lld-want-%lld,candidates-%zu", rk[d].rank,
                 (long long)tok, (long long)r->token, nc);
    }
  } else {
    for (int d = 0; d < nranks && !*why; d++)
      if (kvf_receiver_poll(r->rx[d]) == KVF_POLL_FAILED) kvf_receiver_failure(r->rx[d], why, sizeof why);
    for (char *p = why; *p; p++)
      if (*p == '\n') *p = ' ';
  }
  printf("done %lld %d %zu %lld %lld %s\n", (long long)r->room, st, bad, r->t_init_ns, t_final, *why ? why : "-");
  fflush(stdout);
  release(rk, nranks, r);
}

/* A receiver on every decode rank for the room, each with its own pages. */
static void start(dec_quarantine *qz, dec_rank *rk, int nranks, const char *baddr, dec_req *r, uint64_t *rng) {
  const char *why = NULL;
  if (*r->baddr) baddr = r->baddr;
  if (!baddr) why = "no-bootstrap-address";
  for (int d = 0; d < nranks && !why; d++) {
    r->pages[d] = malloc((r->npages ? r->npages : 1) * sizeof *r->pages[d]);
    if (!r->pages[d] || kvpool_take(&rk[d].r.pool, r->npages, rng, r->pages[d])) {
      free(r->pages[d]);
      r->pages[d] = NULL;
      why = "no-free-pages";
    } else if (kvf_receiver_create(rk[d].r.m, baddr, r->room, &r->rx[d])) {
      r->rx[d] = NULL;
      why = "cannot-create-receiver";
    }
  }
  if (!why) {
    r->active = 1;
    for (int d = 0; d < nranks && !why; d++) {
      r->t_init_ns = cli_now_ns(); /* the last rank's M2: the decode is ready then */
      if (kvf_receiver_init(r->rx[d], r->pages[d], r->npages, 0, 0, NULL, 0)) why = "cannot-init";
    }
    if (!why) return;
    finish(qz, rk, nranks, r, KVF_POLL_FAILED, cli_now_ns());
    return;
  }
  printf("done %lld 0 0 0 0 %s\n", (long long)r->room, why);
  fflush(stdout);
  release(rk, nranks, r);
}

int cli_kv_decode(int argc, char **argv) {
  int layers = 2, world = 1, page_size = 1, heads = 0, mla = 0, rank = -1;
  long long quarantine_ms = 0;
  unsigned long long item = 4096, pages = 4096, unit = 256;
  const char *host = "127.0.0.1", *baddr = NULL;
  static const struct option opts[] = {{"layers", required_argument, 0, 'l'},
                                       {"item", required_argument, 0, 'i'},
                                       {"pages", required_argument, 0, 'p'},
                                       {"host", required_argument, 0, 'H'},
                                       {"bootstrap", required_argument, 0, 'b'},
                                       {"world", required_argument, 0, 'w'},
                                       {"page-size", required_argument, 0, 'P'},
                                       {"heads", required_argument, 0, 'E'},
                                       {"unit", required_argument, 0, 'U'},
                                       {"mla", no_argument, 0, 'M'},
                                       {"mla-legacy", no_argument, 0, 'L'},
                                       {"rank", required_argument, 0, 'r'},
                                       {"transport", required_argument, 0, CLI_OPT_TRANSPORT},
                                       {"quarantine-ms", required_argument, 0, 'Q'},
                                       {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
  int c;
  while ((c = getopt_long(argc, argv, "l:i:p:H:b:w:P:E:U:MLr:Q:h", opts, NULL)) != -1) {
    switch (c) {
      case 'l': layers = atoi(optarg); break;
      case 'i':
        if (cli_parse_size(optarg, &item)) return 2;
        break;
      case 'p':
        if (cli_parse_size(optarg, &pages)) return 2;
        break;
      case 'H': host = optarg; break;
      case 'b': baddr = optarg; break;
      case 'w': world = atoi(optarg); break;
      case 'P': page_size = atoi(optarg); break;
      case 'E': heads = atoi(optarg); break;
      case 'U':
        if (cli_parse_size(optarg, &unit)) return 2;
        break;
      case 'M': mla = 1; break;
      case 'L': mla = 2; break;
      case 'r': rank = atoi(optarg); break;
      case 'Q': quarantine_ms = atoll(optarg); break;
      case CLI_OPT_TRANSPORT:
        if (cli_set_transport("kv-decode", optarg)) return 2;
        break;
      case 'h':
        printf(
            "usage: kvferry-testpeer kv-decode [--bootstrap HOST:PORT] [--layers 2] [--item 4096] [--pages 4096]\n"
            "                         [--host 127.0.0.1] [--world 1] [--rank R] [--transport tcp|ucx|auto]\n"
            "                         [--heads H --unit 256 --page-size 1] [--mla|--mla-legacy]\n"
            "  --bootstrap  the prefill's bootstrap server (else each recv line names one)\n"
            "  --world D  D decode ranks in this process (TP D), each a manager with its own pool\n"
            "  --rank R   only rank R of the D ranks in this process (one process per rank)\n"
            "  --heads H  head-aware pools: rank d holds global KV heads d*H .. d*H+H-1, page-size\n"
            "             tokens a page\n"
            "  --mla      MLA pools: one latent buffer per layer, page-size tokens of --unit bytes a\n"
            "             page, the same on every rank (--heads ignored); the generic planner\n"
            "             treats the latent as replicated when the TP sizes differ\n"
            "  --mla-legacy  MLA pools with the legacy MLA routing (is_mla)\n"
            "  --quarantine-ms MS  late-write check: a Failed room's pages are poisoned, kept out\n"
            "             of reuse for MS and checked before reuse (command `quarantine`)\n");
        return 0;
      default: return 2;
    }
  }
  if (layers < 1 || !item || !pages || world < 1 || world > DEC_MAX_RANKS || page_size < 1 || heads < 0 ||
      ((heads || mla) && !unit) || rank >= world || quarantine_ms < 0) {
    fprintf(stderr, "kv-decode: a non-empty layout (and --rank below --world) is required\n");
    return 2;
  }
  /* The ranks hosted here: first .. first + nlocal - 1. */
  const int first = rank >= 0 ? rank : 0, nlocal = rank >= 0 ? 1 : world;
  int rc = 1, nranks = 0;
  dec_rank *rk = calloc((size_t)nlocal, sizeof *rk);
  dec_req *reqs = calloc(DEC_MAX_REQS, sizeof *reqs);
  dec_quarantine *qz = calloc(1, sizeof *qz);
  if (!reqs || !rk || !qz) goto out;
  qz->ms = quarantine_ms;
  const tp_pool_shape shape = {.layers = layers,
                               .page_size = page_size,
                               .heads = heads,
                               .mla = mla != 0,
                               .pages = pages,
                               .item = item,
                               .unit = unit};
  for (int d = 0; d < nlocal; d++) {
    rk[d].rank = first + d;
    tp_pool_shape s = shape;
    s.head0 = (size_t)rk[d].rank * (size_t)heads; /* head-aware pools: this rank's heads */
    kvf_manager_config mc;
    kvf_manager_config_init(&mc);
    mc.role = KVF_ROLE_DECODE;
    mc.host = host;
    mc.engine_rank = rk[d].rank;
    mc.world_size = world;
    mc.page_size = page_size;
    mc.is_mla = mla == 2;
    char who[48];
    snprintf(who, sizeof who, "kv-decode: decode rank %d", rk[d].rank);
    if (tp_rank_open(who, &s, &mc, &rk[d].r)) goto out;
    nranks = d + 1;
  }
  printf("ready %s\n", kvf_manager_session_id(rk[0].r.m));
  fflush(stdout);
  uint64_t rng = 0x9E3779B97F4A7C15ULL;
  char line[512];
  size_t llen = 0;
  int eof = 0, nactive = 0;
  /* Sleep on stdin and on the ranks' event fds (kvf_manager_event_fd), as
   * a scheduler would: no spinning to steal the cores the transfers use. */
  struct pollfd pfs[1 + DEC_MAX_RANKS];
  pfs[0] = (struct pollfd){.fd = STDIN_FILENO, .events = POLLIN};
  for (int d = 0; d < nranks; d++) {
    pfs[1 + d] = (struct pollfd){.fd = kvf_manager_event_fd(rk[d].r.m), .events = POLLIN};
    if (pfs[1 + d].fd < 0) goto out;
  }
  while (!eof) {
    /* Bounded: the waiting timeouts are applied by the polls below. */
    pfs[0].revents = 0;
    poll(pfs, 1 + (nfds_t)nranks, nactive ? 10 : 50);
    for (int d = 0; d < nranks; d++)
      kvf_manager_event_clear(rk[d].r.m); /* before the polls: a later change wakes the next wait */
    if (pfs[0].revents) {
      ssize_t k = read(STDIN_FILENO, line + llen, sizeof line - 1 - llen);
      if (k <= 0) eof = 1;
      else llen += (size_t)k;
      char *nl;
      while ((nl = memchr(line, '\n', llen))) {
        *nl = 0;
        long long room, np, token;
        unsigned long long seed;
        char extra[16] = "", via[KVF_ADDR_MAX + 1] = "";
        if (!strcmp(line, "quit")) {
          eof = 1;
        } else if (!strcmp(line, "stats")) {
          kvf_manager *ms[DEC_MAX_RANKS];
          for (int d = 0; d < nranks; d++) ms[d] = rk[d].r.m;
          cli_print_stats(ms, nranks);
        } else if (!strcmp(line, "quarantine")) {
          quarantine_report(qz, rk, nranks);
        } else if (sscanf(line, "recv %lld %lld %llu %lld %15s " CLI_ADDR_SCAN, &room, &np, &seed, &token, extra,
                          via) >= 4 &&
                   np >= 0) {
          dec_req *r = NULL;
          for (int i = 0; i < DEC_MAX_REQS && !r; i++)
            if (!reqs[i].active) r = &reqs[i];
          if (!r) {
            printf("done %lld 0 0 0 0 too-many-requests\n", room);
          } else {
            *r = (dec_req){.room = room,
                           .npages = (size_t)np,
                           .seed = seed,
                           .token = token,
                           .corrupt = !strcmp(extra, "corrupt"),
                           .late_poke = !strcmp(extra, "poke-late")};
            snprintf(r->baddr, sizeof r->baddr, "%s", via);
            if (!strcmp(extra, "corrupt-landed")) testing_corrupt_room(room); /* armed before its M2 goes out */
            start(qz, rk, nranks, baddr, r, &rng);
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
    /* Stamp every room that is final on every rank before checking any: a
     * check of a large request takes a while and must not delay the others'
     * stamps. A room is Failed as soon as one rank is, Success once all are. */
    static int st[DEC_MAX_REQS];
    nactive = 0;
    for (int i = 0; i < DEC_MAX_REQS; i++) {
      st[i] = -1;
      if (!reqs[i].active) continue;
      int all = KVF_POLL_SUCCESS;
      for (int d = 0; d < nranks; d++) {
        int s = kvf_receiver_poll(reqs[i].rx[d]);
        if (s < all) all = s;
      }
      st[i] = all;
      nactive++;
    }
    long long t = cli_now_ns();
    for (int i = 0; i < DEC_MAX_REQS; i++)
      if (st[i] == KVF_POLL_SUCCESS || st[i] == KVF_POLL_FAILED) {
        finish(qz, rk, nranks, &reqs[i], st[i], t);
        nactive--;
      }
    if (qz->n) quarantine_expire(qz, rk, nranks, t);
  }
  rc = 0;
out:
  for (int i = 0; reqs && i < DEC_MAX_REQS; i++)
    if (reqs[i].active)
      for (int d = 0; d < nranks; d++) {
        kvf_receiver_destroy(reqs[i].rx[d]);
        free(reqs[i].pages[d]);
      }
  if (qz) quarantine_expire(qz, rk, nranks, -1);
  for (int d = 0; d < nranks; d++) tp_rank_close(&rk[d].r);
  free(rk);
  free(reqs);
  free(qz);
  return rc;
}

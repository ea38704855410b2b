/* `kvferry-testpeer kv-peer`: a whole prefill instance in one process, for the demo,
 * the benchmarks and the end-to-end tests: a bootstrap server and `world`
 * prefill ranks (each a KV manager with its own engine and model-shaped
 * pool). It prints
 *   ready <bootstrap-host:port>
 * and takes commands on stdin:
 *   send <room> <npages> <seed> <token> [chunk] [state] [reuse] [wait-m2]
 *       every TP rank of DP group room % dp creates a sender, fills npages
 *       scattered pages with the request's pattern and sends them in chunks
 *       (the last carries the token and the candidates token+1, token+2);
 *       seed 0 sends the pages as they are (benchmarks: no pattern cost);
 *       state 1 also fills a state slot and sends it with the last chunk;
 *       reuse 1 overwrites the first byte of each rank's first page right
 *       after the send calls (a page reused too early: verify mode names it);
 *       as that may come after the transfer read the page, verify mode also
 *       has the last byte of the first rank's first page changed right after
 *       its digest is taken (testing_reuse_source_early), which it must name
 * With --heads the pools are head-aware (kvpool_init_heads): each rank holds
 * `heads` KV heads of `unit` bytes per token, page_size tokens per page,
 * token-major; of --kv-heads global heads (default heads x tp) rank t holds
 * those of its replica group, heads (t / R) * heads .., R = tp*heads/kv-heads
 * (GQA with fewer KV heads than ranks; MLA: --kv-heads = --heads).
 * With --mla the pools are MLA pools (kvpool_init_mla): one latent buffer per
 * layer, page_size tokens of `unit` bytes a page, the same on every rank.
 * With --rank r (and --bootstrap) the process hosts only rank r of the
 * --world ranks, as one process per GPU does (`kvferry demo --cluster`).
 *   layerwise <room> <npages> <layer-us> <per-layer 0|1> <token> [sleep 0|1]
 *       (benchmarks, one TP rank) a request whose prefill "computes" each
 *       KV layer for layer-us of busy work; per-layer 1 sends each layer's
 *       KV as soon as it is computed (KVF_SEND_LAYERS, the last with the
 *       token), 0 sends the whole request after the last layer; sleep 1
 *       waits instead of busy work (a GPU's compute leaves the CPU free); prints
 *       `lw <room> <compute-start-ns> <compute-end-ns>` once sent
 *   wakeups
 *       prints `wakeups <n>`: the library's thread wake-ups in this process
 *       so far (kvf_wakeups; benchmarks report them per room)
 *   trace 0 | trace 1
 *       room traces off / on for rooms created from now on
 *       (kvf_manager_trace_enable; bench rooms' trace_overhead_ratio)
 *   traces
 *       every rank's ring of finished room traces, one line
 *       "trace <KVFERRY_TRACE JSON>" each, then "traces end"
 *   stats
 *       one line "stats <live-rooms> <received> <malformed> <unknown-room>"
 *       summed over the ranks' kvf_manager_stats (the fault suite checks
 *       that no room is left in the tables and that rejects are counted)
 *   quit
 * and reports each request when its senders are final:
 *   done <room> <poll-status> <last-send-ns> <reason or ->
 * where last-send-ns is CLOCK_MONOTONIC when the last send call began
 * (comparable across processes on one host, for latency measurements).
 * It exits on EOF of stdin, so a test that dies takes its peer with it. */
#include <getopt.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "testing/testpeer/testpeer.h"
#include "kvferry.h"
#include "tools/kvpool.h"
#include "testing/tamper.h"
#include "base/addr.h"

#define PEER_MAX_REQS 4096
#define PEER_STATE_SLOTS 64

typedef struct peer_req {
  int64_t room;
  int rank0, nranks; /* the TP ranks of the room's DP group */
  kvf_sender *tx[64];
  int64_t *pages[64];
  size_t npages;
  int64_t state_slot; /* -1 = none */
  long long last_send_ns;
  int aborted; /* a rank failed: the others were aborted, their polls awaited */
} peer_req;

typedef struct peer_opts {
  int world, dp, layers, chunk;
  unsigned long long item, pages;
  int page_size, heads, kv_heads, nstate, mla;
  unsigned long long unit, state_item;
  const char *host;
  const char *bootstrap; /* external bootstrap server; NULL = start one here */
  int bootstrap_port;    /* port of the one started here; 0 = any free port */
  int max_inbound;       /* engines' max_inbound_conns; 0 = the library's default */
  int rank;              /* the one rank hosted here (needs --bootstrap); -1 = all of them */
} peer_opts;

/* --reuse-early: the scheduler's bug, the page goes to another request at
 * once, while the engine may still be reading it for the transfer. A data
 * race on purpose (verify mode must catch it, tests/e2e/test_demo.c):
 * tests/tsan.supp names this function. */
__attribute__((noinline)) static void reuse_page_early(const kvf_kv_buffers *b, int64_t page) {
  ((volatile unsigned char *)b->kv_ptrs[0])[(uint64_t)page * b->kv_item_lens[0]] ^= 0xff;
}

/* A bootstrap /metrics source: one prefill rank's manager counters. */
static size_t manager_metrics(void *m, char *buf, size_t cap) { return kvf_manager_metrics(m, buf, cap); }

/* The `traces` command: the ranks' rings as KVFERRY_TRACE lines. */
static void print_traces(kvf_manager **mgr, int world) {
  enum { MAX = 1024 };
  kvf_room_trace *t = malloc(MAX * sizeof *t);
  char line[4096];
  for (int r = 0; t && r < world; r++) {
    size_t n = kvf_manager_trace_copy(mgr[r], t, MAX);
    for (size_t i = 0; i < n; i++)
      if (kvf_trace_format_json(&t[i], line, sizeof line)) printf("trace %s", line);
  }
  free(t);
  printf("traces end\n");
  fflush(stdout);
}

static int start_senders(peer_req *r, kvf_manager **mgr, kvpool *pools, unsigned long long seed, long long token,
                         int chunk, int reuse, int wait_m2, uint64_t *rng) {
  for (int i = 0; i < r->nranks; i++) {
    int rank = r->rank0 + i;
    r->pages[i] = malloc((r->npages ? r->npages : 1) * sizeof *r->pages[i]);
    if (!r->pages[i] || kvpool_take(&pools[rank], r->npages, rng, r->pages[i])) {
      free(r->pages[i]);
      r->pages[i] = NULL;
      return -1;
    }
    /* The pages may have been read by an earlier request's transfer: order
     * our writes after those reads (free on x86, visible to TSan). */
    kvf_engine_sync(kvf_manager_engine(mgr[rank]));
    if (seed)
      kvpool_fill(&pools[rank], r->room, r->pages[i], r->npages, seed); /* seed 0: benchmarks, no pattern */
    if (r->state_slot >= 0) kvpool_fill_state(&pools[rank], r->room, r->state_slot, seed);
    if (kvf_sender_create(mgr[rank], r->room, &r->tx[i])) return -1;
    /* wait_m2 (benchmarks): send once the decode's M2 is here, as when a
     * forward pass outlasts the decode's request; at most a second. */
    for (long long until = cli_now_ns() + 1000000000LL;
         wait_m2 && kvf_sender_poll(r->tx[i]) == KVF_POLL_BOOTSTRAPPING && cli_now_ns() < until;)
      sched_yield(); /* leave the core to the threads delivering the M2 */
    int32_t cands[2] = {(int32_t)token + 1, (int32_t)token + 2};
    size_t step = chunk > 0 ? (size_t)chunk : r->npages;
    if (step == 0) step = 1;
    for (size_t off = 0; off < r->npages || off == 0; off += step) {
      size_t n = r->npages - off < step ? r->npages - off : step;
      int last = off + n >= r->npages;
      kvf_send_params p;
      kvf_send_params_init(&p);
      p.pages = r->pages[i] + off, p.npages = n;
      if (last) {
        p.flags = KVF_SEND_LAST;
        p.aux_index = 0;
        p.bootstrap_token = token;
        p.cands = cands, p.ncand = 2;
        if (r->state_slot >= 0) p.state_slots = &r->state_slot, p.nstate = 1;
      }
      /* The KV is ready when the first rank's last send call begins (a real
       * server's TP ranks reach it together; here they take turns, and a
       * later rank's call may begin after the decode's Success): latencies
       * count from here. */
      if (last && !r->last_send_ns) r->last_send_ns = cli_now_ns();
      if (kvf_sender_send(r->tx[i], &p)) return -1;
      if (last) break;
    }
    if (reuse && r->npages) {
      reuse_page_early(&pools[rank].bufs, r->pages[i][0]);
      kvf_engine_sync(kvf_manager_engine(mgr[rank]));
    }
  }
  return 0;
}

/* Busy work until `end_ns` (CLOCK_MONOTONIC): a stand-in for a layer's
 * forward pass that keeps this core busy, as a GPU launch thread would. */
static void busy_until(long long end_ns, uint64_t *acc, int sleep) {
  for (long long now; sleep && (now = cli_now_ns()) < end_ns;) {
    struct timespec ts = {(end_ns - now) / 1000000000LL, (end_ns - now) % 1000000000LL};
    nanosleep(&ts, NULL);
  }
  while (cli_now_ns() < end_ns)
    for (int i = 0; i < 256; i++) *acc = *acc * 6364136223846793005ULL + 1442695040888963407ULL;
}

/* The lowest request slot not in use (*nused grows to cover it), or NULL
 * when all PEER_MAX_REQS are. */
static peer_req *free_req(peer_req *reqs, int *nused) {
  for (int i = 0; i < PEER_MAX_REQS; i++)
    if (!reqs[i].nranks) {
      if (i + 1 > *nused) *nused = i + 1;
      return &reqs[i];
    }
  return NULL;
}

/* The `layerwise` command: compute layer by layer, sending each layer's KV
 * when it is done (per_layer) or the whole request after the last. */
static int start_layerwise(peer_req *r, kvf_manager *m, kvpool *pool, size_t layers, long long layer_us,
                           int per_layer, long long token, int sleep, uint64_t *rng) {
  r->pages[0] = malloc((r->npages ? r->npages : 1) * sizeof *r->pages[0]);
  if (!r->pages[0] || kvpool_take(pool, r->npages, rng, r->pages[0])) {
    free(r->pages[0]);
    r->pages[0] = NULL;
    return -1;
  }
  kvf_engine_sync(kvf_manager_engine(m));
  if (kvf_sender_create(m, r->room, &r->tx[0])) return -1;
  uint64_t acc = 1;
  long long t0 = cli_now_ns();
  for (size_t l = 0; l < layers; l++) {
    busy_until(t0 + (long long)(l + 1) * layer_us * 1000, &acc, sleep);
    if (!per_layer && l + 1 < layers) continue;
    kvf_send_params p;
    kvf_send_params_init(&p);
    p.pages = r->pages[0], p.npages = r->npages;
    if (per_layer) p.flags = KVF_SEND_LAYERS, p.layer_begin = l, p.layer_end = l + 1;
    if (l + 1 == layers) p.flags |= KVF_SEND_LAST, p.aux_index = 0, p.bootstrap_token = token;
    if (kvf_sender_send(r->tx[0], &p)) return -1;
  }
  long long t1 = cli_now_ns();
  r->last_send_ns = t1;
  printf("lw %lld %lld %lld %llu\n", (long long)r->room, t0, t1, (unsigned long long)(acc & 1));
  return 0;
}

static void finish_req(peer_req *r, kvpool *pools, int status, const char *reason) {
  /* Flushed once per main-loop turn, not per line: one write for many rooms. */
  printf("done %lld %d %lld %s\n", (long long)r->room, status, r->last_send_ns, reason && *reason ? reason : "-");
  for (int i = 0; i < r->nranks; i++) {
    if (r->tx[i]) kvf_sender_destroy(r->tx[i]);
    if (r->pages[i]) kvpool_give(&pools[r->rank0 + i], r->pages[i], r->npages);
    free(r->pages[i]);
  }
  memset(r, 0, sizeof *r);
}

int cli_kv_peer(int argc, char **argv) {
  peer_opts o = {.world = 1,
                 .dp = 1,
                 .layers = 2,
                 .chunk = 0,
                 .item = 4096,
                 .pages = 4096,
                 .host = "127.0.0.1",
                 .page_size = 1,
                 .unit = 256,
                 .state_item = 4096,
                 .rank = -1};
  static const struct option opts[] = {{"world", required_argument, 0, 'w'},
                                       {"dp", required_argument, 0, 'd'},
                                       {"layers", required_argument, 0, 'l'},
                                       {"item", required_argument, 0, 'i'},
                                       {"pages", required_argument, 0, 'p'},
                                       {"host", required_argument, 0, 'H'},
                                       {"bootstrap", required_argument, 0, 'b'},
                                       {"bootstrap-port", required_argument, 0, 'B'},
                                       {"page-size", required_argument, 0, 'P'},
                                       {"heads", required_argument, 0, 'E'},
                                       {"kv-heads", required_argument, 0, 'K'},
                                       {"unit", required_argument, 0, 'U'},
                                       {"state", required_argument, 0, 'S'},
                                       {"state-item", required_argument, 0, 'T'},
                                       {"mla", no_argument, 0, 'M'},
                                       {"max-inbound-conns", required_argument, 0, 'C'},
                                       {"rank", required_argument, 0, 'r'},
                                       {"transport", required_argument, 0, CLI_OPT_TRANSPORT},
                                       {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
  int c;
  while ((c = getopt_long(argc, argv, "w:d:l:i:p:H:b:B:P:E:K:U:S:T:MC:r:h", opts, NULL)) != -1) {
    switch (c) {
      case 'w': o.world = atoi(optarg); break;
      case 'd': o.dp = atoi(optarg); break;
      case 'l': o.layers = atoi(optarg); break;
      case 'i':
        if (cli_parse_size(optarg, &o.item)) return 2;
        break;
      case 'p':
        if (cli_parse_size(optarg, &o.pages)) return 2;
        break;
      case 'H': o.host = optarg; break;
      case 'b': o.bootstrap = optarg; break;
      case 'B': o.bootstrap_port = atoi(optarg); break;
      case 'P': o.page_size = atoi(optarg); break;
      case 'E': o.heads = atoi(optarg); break;
      case 'K': o.kv_heads = atoi(optarg); break;
      case 'U':
        if (cli_parse_size(optarg, &o.unit)) return 2;
        break;
      case 'S': o.nstate = atoi(optarg); break;
      case 'T':
        if (cli_parse_size(optarg, &o.state_item)) return 2;
        break;
      case 'M': o.mla = 1; break;
      case 'C': o.max_inbound = atoi(optarg); break;
      case 'r': o.rank = atoi(optarg); break;
      case CLI_OPT_TRANSPORT:
        if (cli_set_transport("kv-peer", optarg)) return 2;
        break;
      case 'h':
        printf("usage: kvferry-testpeer kv-peer [--world 1] [--dp 1] [--layers 2] [--item 4096] [--pages 4096]\n"
               "                       [--host 127.0.0.1] [--bootstrap HOST:PORT (default: start one here)]\n"
               "                       [--bootstrap-port N (the one started here; default any free port)]\n"
               "                       [--heads H --unit 256 --page-size 1 --kv-heads H*tp] [--state N "
               "--state-item 4096]\n"
               "                       [--mla --unit 1152 --page-size 16] [--transport tcp|ucx|auto]\n"
               "                       [--max-inbound-conns N (each rank's engine; default the library's)]\n"
               "                       [--rank R (only rank R of --world, with --bootstrap)]\n"
               "  --mla  MLA pools: one latent buffer per layer, the same on every rank (--heads ignored)\n");
        return 0;
      default: return 2;
    }
  }
  if (o.bootstrap_port < 0 || o.bootstrap_port > 65535) {
    fprintf(stderr, "kv-peer: bad --bootstrap-port\n");
    return 2;
  }
  if (o.world < 1 || o.world > 64 || o.dp < 1 || o.world % o.dp || o.layers < 1 || !o.item || !o.pages) {
    fprintf(stderr, "kv-peer: bad layout\n");
    return 2;
  }
  if (o.rank >= 0 && (o.rank >= o.world || o.dp != 1 || !o.bootstrap)) {
    fprintf(stderr, "kv-peer: --rank needs 0 <= rank < --world, --dp 1 and --bootstrap\n");
    return 2;
  }
  /* The ranks hosted here: first .. first + nlocal - 1 (index r - first). */
  const int first = o.rank >= 0 ? o.rank : 0, nlocal = o.rank >= 0 ? 1 : o.world;
  int tp = o.world / o.dp, rc = 1;
  struct pollfd *pfs = NULL; /* the main loop's: stdin and the ranks' event fds */
  int replica = 1;
  if (o.mla) {
    if (o.page_size < 1 || !o.unit) {
      fprintf(stderr, "kv-peer: bad MLA layout\n");
      return 2;
    }
  } else if (o.heads) {
    if (!o.kv_heads) o.kv_heads = o.heads * tp;
    if (o.page_size < 1 || o.heads < 0 || !o.unit || o.kv_heads < o.heads || (o.heads * tp) % o.kv_heads ||
        o.kv_heads % o.heads) {
      fprintf(stderr, "kv-peer: bad head layout\n");
      return 2;
    }
    replica = o.heads * tp / o.kv_heads;
  }
  if (o.nstate < 0 || o.page_size < 1) {
    fprintf(stderr, "kv-peer: bad layout\n");
    return 2;
  }
  kvf_bootstrap_server_config bc;
  kvf_bootstrap_server_config_init(&bc);
  bc.host = o.host;
  bc.port = (uint16_t)o.bootstrap_port;
  bc.auth_token = NULL; /* $KVFERRY_BOOTSTRAP_TOKEN, which the prefill ranks below send too */
  kvf_bootstrap_server *srv = NULL;
  kvf_manager **mgr = calloc((size_t)nlocal, sizeof *mgr);
  kvpool *pools = calloc((size_t)nlocal, sizeof *pools);
  kvf_engine **engines = calloc((size_t)nlocal, sizeof *engines);
  peer_req *reqs = calloc(PEER_MAX_REQS, sizeof *reqs);
  if (!mgr || !pools || !engines || !reqs || (!o.bootstrap && kvf_bootstrap_server_create(&bc, &srv))) {
    fprintf(stderr, "kv-peer: cannot start the bootstrap server\n");
    goto out;
  }
  char baddr[KVF_ADDR_LEN];
  if (o.bootstrap) snprintf(baddr, sizeof baddr, "%s", o.bootstrap);
  else kvf__addr_format(baddr, sizeof baddr, o.host, kvf_bootstrap_server_port(srv));
  for (int r = 0; r < nlocal; r++) {
    const int g = first + r; /* its rank in the instance */
    int use_pool = 0, erc;
    if (o.max_inbound > 0) { /* bench peers: more decode peers than the default bound */
      kvf_engine_config ec;
      kvf_engine_config_init(&ec);
      ec.host = o.host;
      ec.max_inbound_conns = o.max_inbound;
      erc = kvf_engine_create(&ec, &engines[r]);
      use_pool = !erc && !strcmp(cli_memory_kind(), "pool");
    } else {
      erc = cli_rank_engine(o.host, &engines[r], &use_pool);
    }
    if (erc) {
      fprintf(stderr, "kv-peer: prefill rank %d: engine: %s\n", g, kvf_strerror(erc));
      goto out;
    }
    kvpool_use_engine(use_pool ? engines[r] : NULL);
    if (srv) kvf_bootstrap_server_add_engine(srv, engines[r]); /* its routes in /metrics */
    int prc = o.mla     ? kvpool_init_mla(&pools[r], (size_t)o.layers, o.pages, (size_t)o.page_size, o.unit)
              : o.heads ? kvpool_init_heads(&pools[r], (size_t)o.layers, o.pages, (size_t)o.page_size,
                                            (size_t)o.heads, (size_t)((g % tp) / replica * o.heads), o.unit)
                        : kvpool_init(&pools[r], (size_t)o.layers, o.pages, o.item);
    kvpool_use_engine(NULL);
    if (prc || (o.nstate && kvpool_add_state(&pools[r], (size_t)o.nstate, PEER_STATE_SLOTS, o.state_item)))
      goto out;
    kvf_manager_config mc;
    kvf_manager_config_init(&mc);
    mc.role = KVF_ROLE_PREFILL;
    mc.host = o.host;
    mc.engine_rank = g;
    mc.world_size = o.world;
    mc.dp_size = o.dp;
    mc.bootstrap_addr = baddr;
    mc.page_size = o.page_size;
    mc.engine = engines[r];
    int err = kvf_manager_create(&mc, &pools[r].bufs, &mgr[r]);
    if (err) {
      fprintf(stderr, "kv-peer: prefill rank %d: %s\n", g, kvf_strerror(err));
      goto out;
    }
    if (srv) kvf_bootstrap_server_add_metrics(srv, manager_metrics, mgr[r]); /* its counters in /metrics */
  }
  printf("ready %s\n", baddr);
  fflush(stdout);
  uint64_t rng = 0x2545F4914F6CDD1DULL;
  int nused = 0; /* slots below this may be live */
  char line[512];
  size_t llen = 0;
  int eof = 0;
  /* Sleep on stdin and on the ranks' event fds (kvf_manager_event_fd), as
   * a scheduler would: woken by a command or a room's news, not by a tick. */
  pfs = calloc(1 + (size_t)nlocal, sizeof *pfs);
  if (!pfs) goto out;
  pfs[0] = (struct pollfd){.fd = STDIN_FILENO, .events = POLLIN};
  for (int r = 0; r < nlocal; r++) {
    pfs[1 + r] = (struct pollfd){.fd = kvf_manager_event_fd(mgr[r]), .events = POLLIN};
    if (pfs[1 + r].fd < 0) goto out;
  }
  while (!eof) {
    /* Requests take the lowest free slot: only the first nused can be live.
     * With none live, wait for the next command alone: an idle peer that
     * ticked woke ~1000 times a second, which bench peers counted as the
     * measured prefill's own. With some live, the wait is bounded, as the
     * bootstrap and token timeouts are applied by the polls. */
    while (nused > 0 && !reqs[nused - 1].nranks) nused--;
    pfs[0].revents = 0;
    poll(pfs, nused ? 1 + (nfds_t)nlocal : 1, nused ? 10 : -1);
    for (int r = 0; nused && r < nlocal; r++) kvf_manager_event_clear(mgr[r]); /* before the polls below */
    if (pfs[0].revents) {
      ssize_t k = read(STDIN_FILENO, line + llen, sizeof line - 1 - llen);
      if (k <= 0) eof = 1;
      else llen += (size_t)k;
      char *nl;
      while ((nl = memchr(line, '\n', llen))) {
        *nl = 0;
        long long room, npages, token, layer_us;
        unsigned long long seed;
        int chunk = 0, state = 0, reuse = 0, wait_m2 = 0, per_layer, sleep = 0;
        if (!strcmp(line, "quit")) eof = 1;
        else if (!strcmp(line, "stats")) cli_print_stats(mgr, nlocal);
        else if (!strcmp(line, "wakeups")) printf("wakeups %llu\n", (unsigned long long)kvf_wakeups());
        else if (!strcmp(line, "trace 0") || !strcmp(line, "trace 1")) /* room traces off / on (benchmarks) */
          for (int r = 0; r < nlocal; r++) kvf_manager_trace_enable(mgr[r], line[6] == '1');
        else if (!strcmp(line, "traces")) print_traces(mgr, nlocal);
        else if (sscanf(line, "layerwise %lld %lld %lld %d %lld %d", &room, &npages, &layer_us, &per_layer, &token,
                        &sleep) >= 5 &&
                 npages > 0 && layer_us >= 0 && o.world == 1) {
          peer_req *r = free_req(reqs, &nused);
          if (!r) {
            printf("done %lld 0 0 too-many-requests\n", room);
          } else {
            r->room = room;
            r->npages = (size_t)npages;
            r->nranks = 1;
            r->state_slot = -1;
            if (start_layerwise(r, mgr[0], &pools[0], (size_t)o.layers, layer_us, per_layer, token, sleep, &rng))
              finish_req(r, pools, 0, "cannot-start");
          }
        } else if (sscanf(line, "send %lld %lld %llu %lld %d %d %d %d", &room, &npages, &seed, &token, &chunk,
                          &state, &reuse, &wait_m2) >= 4 &&
                   npages >= 0) {
          peer_req *r = free_req(reqs, &nused);
          if (!r) {
            printf("done %lld 0 0 too-many-requests\n", room);
          } else {
            r->room = room;
            r->npages = (size_t)npages;
            r->rank0 = o.rank >= 0 ? 0 : (int)(((room % o.dp) + o.dp) % o.dp) * tp;
            r->nranks = o.rank >= 0 ? 1 : tp;
            r->state_slot = state && o.nstate ? (int64_t)((size_t)(r - reqs) % PEER_STATE_SLOTS) : -1;
            if (reuse) testing_reuse_source_early(room); /* verify mode: before the transfer, always */
            if (start_senders(r, mgr, pools, seed, token, chunk, reuse, wait_m2, &rng))
              finish_req(r, pools, 0, "cannot-start");
          }
        } else {
          printf("error bad command\n");
        }
        size_t used = (size_t)(nl - line) + 1;
        memmove(line, nl + 1, llen - used);
        llen -= used;
      }
      if (llen == sizeof line - 1) llen = 0; /* an overlong line is dropped */
    }
    for (int i = 0; i < nused; i++) {
      peer_req *r = &reqs[i];
      if (!r->nranks) continue;
      int st = KVF_POLL_SUCCESS, final = 1;
      char reason[256] = "";
      for (int k = 0; k < r->nranks; k++) {
        int s = kvf_sender_poll(r->tx[k]);
        if (s != KVF_POLL_SUCCESS && s != KVF_POLL_FAILED) final = 0;
        if (s == KVF_POLL_FAILED && !*reason) kvf_sender_failure(r->tx[k], reason, sizeof reason);
        if (s < st) st = s;
      }
      /* One rank failed: the request fails on every rank (as a scheduler's
       * all-reduce of the polls decides), but a rank's pages go back only
       * once its own sender is final, since until then its transfer may
       * still read them (kvf_sender_poll): the others are aborted first. */
      if (!final && st == KVF_POLL_FAILED && !r->aborted) {
        for (int k = 0; k < r->nranks; k++) {
          int s = kvf_sender_poll(r->tx[k]);
          if (s != KVF_POLL_SUCCESS && s != KVF_POLL_FAILED) kvf_sender_abort(r->tx[k], reason);
        }
        r->aborted = 1;
      }
      if (final) {
        for (char *p = reason; *p; p++)
          if (*p == '\n') *p = ' ';
        finish_req(r, pools, st, reason);
      }
    }
    fflush(stdout);
  }
  rc = 0;
out:
  for (int i = 0; reqs && i < PEER_MAX_REQS; i++)
    if (reqs[i].nranks) finish_req(&reqs[i], pools, 0, "shutdown");
  fflush(stdout);
  kvf_bootstrap_server_destroy(srv); /* before the managers and engines it shows */
  for (int r = 0; mgr && r < nlocal; r++) kvf_manager_destroy(mgr[r]);
  for (int r = 0; pools && r < nlocal; r++) kvpool_free(&pools[r]);
  for (int r = 0; engines && r < nlocal; r++) kvf_engine_destroy(engines[r]);
  free(engines);
  free(mgr);
  free(pools);
  free(reqs);
  free(pfs);
  return rc;
}

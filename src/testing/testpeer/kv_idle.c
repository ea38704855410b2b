/* `kvferry-testpeer kv-idle`: many idle instances of one rank each in one
 * process, for `kvferry bench peers`: decode instances (default), or with
 * --role prefill prefill instances, each then with its own bootstrap server.
 * Each of the --count instances has its own KV manager, engine, ZeroMQ
 * sockets and a small pool (a decode also its heartbeat), so the process
 * under test sees --count real peers while a benchmark needs a handful of
 * processes, not hundreds. It prints
 *   ready <count> <rss-kib> <threads> <fds>
 * (what creating the instances added to this process: one instance's cost is
 * that over count), for --role prefill then `addr <i> <bootstrap-host:port>`
 * for each instance, and takes commands on stdin:
 *   connect <room0>
 *       (decode) instance i creates a receiver for room room0 + i against
 *       --bootstrap and asks for one page; once every room is final (at most
 *       30 s) it prints `connected <ok> <failed> <first reason or ->`; the
 *       layout (--layers, --item) must be the prefill's. Afterwards the
 *       instances stay connected and heartbeating, doing nothing else.
 *   send <room0>
 *       (prefill) instance i sends one page for room room0 + i to whichever
 *       decode asks for it, and answers as `connect` does once every room is
 *       final.
 *   quit
 * It exits on EOF of stdin, so a benchmark that dies takes it along. */
#include <getopt.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "testing/testpeer/testpeer.h"
#include "tools/proc.h"

#define IDLE_MAX 256
#define IDLE_CONNECT_S 30

typedef struct idle_inst {
  tp_rank r;
  kvf_receiver *rx;
  kvf_sender *tx;               /* --role prefill */
  kvf_bootstrap_server *srv;    /* --role prefill: this instance's own */
  char baddr[KVF_ADDR_MAX + 1]; /* its address */
  int64_t page;
} idle_inst;

static int idle_create(idle_inst *in, int prefill, const char *host, int layers, unsigned long long pages,
                       unsigned long long item) {
  if (prefill) {
    kvf_bootstrap_server_config bc;
    kvf_bootstrap_server_config_init(&bc);
    bc.host = host;
    bc.port = 0;
    if (kvf_bootstrap_server_create(&bc, &in->srv)) {
      fprintf(stderr, "kv-idle: cannot start a bootstrap server\n");
      return -1;
    }
    snprintf(in->baddr, sizeof in->baddr, "%s:%u", host, (unsigned)kvf_bootstrap_server_port(in->srv));
  }
  const tp_pool_shape shape = {.layers = layers, .pages = pages, .item = item};
  kvf_manager_config mc;
  kvf_manager_config_init(&mc);
  mc.role = prefill ? KVF_ROLE_PREFILL : KVF_ROLE_DECODE;
  mc.host = host;
  if (prefill) mc.bootstrap_addr = in->baddr;
  return tp_rank_open("kv-idle", &shape, &mc, &in->r);
}

/* Let an instance's receiver or sender go, and its page back to its pool. */
static void idle_release(idle_inst *in) {
  if (in->rx) kvf_receiver_destroy(in->rx);
  if (in->tx) kvf_sender_destroy(in->tx);
  in->rx = NULL, in->tx = NULL;
  kvpool_give(&in->r.pool, &in->page, 1);
}

/* Poll every instance's receiver (or, sending, its sender) until all are
 * final or IDLE_CONNECT_S pass, let each go, then answer
 * `connected <ok> <failed> <first reason or ->`. failed and why: those that
 * could not even start. */
static void idle_settle(idle_inst *in, int n, int sending, int failed, char *why, size_t cap) {
  int ok = 0;
  long long until = cli_now_ms() + IDLE_CONNECT_S * 1000LL;
  for (int live = n - failed; live > 0 && cli_now_ms() < until;) {
    live = 0;
    for (int i = 0; i < n; i++) {
      if (sending ? !in[i].tx : !in[i].rx) continue;
      int st = sending ? kvf_sender_poll(in[i].tx) : kvf_receiver_poll(in[i].rx);
      if (st != KVF_POLL_SUCCESS && st != KVF_POLL_FAILED) {
        live++;
        continue;
      }
      if (st == KVF_POLL_SUCCESS) ok++;
      else if (failed++, !*why) {
        if (sending) kvf_sender_failure(in[i].tx, why, cap);
        else kvf_receiver_failure(in[i].rx, why, cap);
      }
      idle_release(&in[i]);
    }
    if (live) usleep(1000);
  }
  for (int i = 0; i < n; i++)
    if (in[i].rx || in[i].tx) {
      idle_release(&in[i]);
      if (failed++, !*why) snprintf(why, cap, "no-final-status-within-%ds", IDLE_CONNECT_S);
    }
  for (char *p = why; *p; p++)
    if (*p == '\n' || *p == ' ') *p = '_';
  printf("connected %d %d %s\n", ok, failed, *why ? why : "-");
  fflush(stdout);
}

/* Every instance's room, until all are final or the deadline passes. */
static void idle_connect(idle_inst *in, int n, const char *baddr, long long room0) {
  int failed = 0;
  char why[256] = "";
  uint64_t rng = 0x9E3779B97F4A7C15ULL;
  for (int i = 0; i < n; i++) {
    int took = !kvpool_take(&in[i].r.pool, 1, &rng, &in[i].page);
    if (!took || kvf_receiver_create(in[i].r.m, baddr, room0 + i, &in[i].rx)) {
      if (took) kvpool_give(&in[i].r.pool, &in[i].page, 1);
      in[i].rx = NULL;
      failed++;
      if (!*why) snprintf(why, sizeof why, "cannot-create-receiver");
      continue;
    }
    if (kvf_receiver_init(in[i].rx, &in[i].page, 1, 0, 0, NULL, 0)) {
      idle_release(&in[i]);
      failed++;
      if (!*why) snprintf(why, sizeof why, "cannot-init");
    }
  }
  idle_settle(in, n, 0, failed, why, sizeof why);
}

/* --role prefill: every instance sends its room's one page, then waits as
 * idle_connect does. */
static void idle_send(idle_inst *in, int n, long long room0) {
  int failed = 0;
  char why[256] = "";
  uint64_t rng = 0x2545F4914F6CDD1DULL;
  for (int i = 0; i < n; i++) {
    kvf_send_params p;
    kvf_send_params_init(&p);
    p.pages = &in[i].page, p.npages = 1;
    p.flags = KVF_SEND_LAST, p.aux_index = 0, p.bootstrap_token = 7;
    int took = !kvpool_take(&in[i].r.pool, 1, &rng, &in[i].page);
    if (!took || kvf_sender_create(in[i].r.m, room0 + i, &in[i].tx) || kvf_sender_send(in[i].tx, &p)) {
      if (in[i].tx) kvf_sender_destroy(in[i].tx);
      if (took) kvpool_give(&in[i].r.pool, &in[i].page, 1);
      in[i].tx = NULL;
      if (failed++, !*why) snprintf(why, sizeof why, "cannot-send");
    }
  }
  idle_settle(in, n, 1, failed, why, sizeof why);
}

int cli_kv_idle(int argc, char **argv) {
  int count = 1, layers = 2, prefill = 0;
  unsigned long long item = 4096, pages = 4;
  const char *host = "127.0.0.1", *baddr = NULL;
  static const struct option opts[] =
      {{"count", required_argument, 0, 'n'},  {"bootstrap", required_argument, 0, 'b'},
       {"layers", required_argument, 0, 'l'}, {"item", required_argument, 0, 'i'},
       {"pages", required_argument, 0, 'p'},  {"host", required_argument, 0, 'H'},
       {"role", required_argument, 0, 'r'},   {"transport", required_argument, 0, CLI_OPT_TRANSPORT},
       {"help", no_argument, 0, 'h'},         {0, 0, 0, 0}};
  int c;
  while ((c = getopt_long(argc, argv, "n:b:l:i:p:H:r:h", opts, NULL)) != -1) {
    switch (c) {
      case 'n': count = atoi(optarg); break;
      case 'b': baddr = optarg; break;
      case 'l': layers = atoi(optarg); break;
      case 'i':
        if (cli_parse_size(optarg, &item)) return 2;
        break;
      case 'p':
        if (cli_parse_size(optarg, &pages)) return 2;
        break;
      case 'H': host = optarg; break;
      case 'r':
        if (strcmp(optarg, "decode") && strcmp(optarg, "prefill")) return 2;
        prefill = !strcmp(optarg, "prefill");
        break;
      case CLI_OPT_TRANSPORT:
        if (cli_set_transport("kv-idle", optarg)) return 2;
        break;
      case 'h':
        printf("usage: kvferry-testpeer kv-idle --bootstrap HOST:PORT [--count 1] [--layers 2] [--item 4096]\n"
               "                         [--pages 4] [--host 127.0.0.1] [--transport tcp|ucx|auto]\n"
               "       kvferry-testpeer kv-idle --role prefill [--count 1] ...   (no --bootstrap)\n"
               "  --count N  N instances (TP 1 each: manager, engine, pool), at most %d\n"
               "  --role prefill  prefill instances, each with its own bootstrap server\n",
               IDLE_MAX);
        return 0;
      default: return 2;
    }
  }
  if ((!baddr && !prefill) || count < 1 || count > IDLE_MAX || layers < 1 || !item || !pages) {
    fprintf(stderr, "kv-idle: --bootstrap HOST:PORT, --count 1..%d and a non-empty pool are required\n", IDLE_MAX);
    return 2;
  }
  int rc = 1, n = 0;
  idle_inst *in = calloc((size_t)count, sizeof *in);
  proc_usage u0, u1;
  if (!in || proc_usage_get(0, &u0)) goto out;
  for (; n < count; n++)
    if (idle_create(&in[n], prefill, host, layers, pages, item)) {
      n++; /* partly created: cleaned up below */
      goto out;
    }
  if (proc_usage_get(0, &u1)) goto out;
  printf("ready %d %ld %ld %ld\n", count, u1.rss_kb - u0.rss_kb, u1.threads - u0.threads, u1.fds - u0.fds);
  for (int i = 0; prefill && i < count; i++) printf("addr %d %s\n", i, in[i].baddr);
  fflush(stdout);
  char line[256];
  size_t llen = 0;
  for (int eof = 0; !eof;) {
    struct pollfd pf = {.fd = STDIN_FILENO, .events = POLLIN};
    if (poll(&pf, 1, -1) <= 0) continue; /* no tick: an idle harness wakes nobody */
    ssize_t k = read(STDIN_FILENO, line + llen, sizeof line - 1 - llen);
    if (k <= 0) break;
    llen += (size_t)k;
    char *nl;
    while ((nl = memchr(line, '\n', llen))) {
      *nl = 0;
      long long room0;
      if (!strcmp(line, "quit")) eof = 1;
      else if (!prefill && sscanf(line, "connect %lld", &room0) == 1) idle_connect(in, count, baddr, room0);
      else if (prefill && sscanf(line, "send %lld", &room0) == 1) idle_send(in, count, room0);
      else printf("error bad command\n");
      fflush(stdout);
      size_t used = (size_t)(nl - line) + 1;
      memmove(line, nl + 1, llen - used);
      llen -= used;
    }
    if (llen == sizeof line - 1) llen = 0; /* an overlong line is dropped */
  }
  rc = 0;
out:
  for (int i = 0; in && i < n; i++) {
    if (in[i].rx) kvf_receiver_destroy(in[i].rx);
    if (in[i].tx) kvf_sender_destroy(in[i].tx);
    kvf_bootstrap_server_destroy(in[i].srv); /* before the manager it shows */
    tp_rank_close(&in[i].r);
  }
  free(in);
  return rc;
}

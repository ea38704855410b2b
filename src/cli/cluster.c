/* `kvferry demo --cluster PxD`: P prefill and D decode instances under
 * sustained load, every byte checked. Each prefill instance has its own
 * bootstrap server (`kvferry bootstrap`) and every TP rank of every instance
 * is a process of its own (`kvferry-testpeer kv-peer --rank r`, `kv-decode
 * --rank r`), as one process per GPU is in a deployment. A router spreads
 * requests round-robin over the P x D (prefill, decode) pairs, at most
 * --inflight per pair and as far as both instances' pools have pages. The
 * requests, their patterns and their reports are the demo's (pd.h): a
 * request is complete once every rank process of both sides has reported.
 * It ends with a table: instances, processes, requests, GB/s, p50/p99
 * transfer time, failures, and per process its threads, open descriptors
 * and RSS at the end of the load and the most seen over the run. --netns
 * puts each instance (its bootstrap server and ranks) in a network namespace
 * of its own (netns.h): the instances then reach each other only through
 * veth links and a bridge, as hosts on one switch. */
#include <dirent.h>
#include <getopt.h>
#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cli.h"
#include "kvferry.h"
#include "netns.h"
#include "pd.h"

#define CL_MAX_INSTANCES 64
#define CL_MAX_REQS (1 << 17)
#define CL_SHOW_FAILURES 10
#define CL_READY_MS 120000    /* a rank's start, its pool faulted in */
#define CL_READY_SLICE_MS 250 /* how soon a signal ends the wait for it */

/* One process: what it is and what /proc says about it. */
typedef struct cl_proc {
  proc p;
  int up, inst, rank, kind; /* kind: 0 bootstrap, 1 prefill rank, 2 decode rank */
  long thr, fds, rss_kb;    /* at the end of the load */
  double cpu0, cpu;         /* CPU seconds used at the start and at the end of the load */
  long max_thr, max_fds, max_rss_kb;
} cl_proc;

typedef struct cl_inst {
  int proc0; /* its rank processes: procs[proc0 .. proc0 + its side's TP - 1] */
  int boot;  /* prefill: its bootstrap server's process, else -1 */
  char baddr[KVF_ADDR_MAX + 1];
  const char *host;
  uint64_t free_pages;
} cl_inst;

static volatile sig_atomic_t cl_interrupted;
static void on_signal(int sig) { cl_interrupted = sig; }

void cli_demo_cluster_usage(FILE *f) {
  fprintf(f, "usage: kvferry demo --cluster PxD [--tp 1 | --prefill-tp N --decode-tp M] [--seconds 20]\n"
             "                    [--inflight 2] [--model M]\n"
             "                    [--max-tokens 1024] [--pool-gib G] [--transport tcp|ucx|auto] [--seed S]\n"
             "                    [--netns] [--short]\n"
             "P prefill and D decode instances (e.g. 2x2, 4x4, 8x8) under --seconds of sustained load:\n"
             "each prefill instance has its own bootstrap server, each of the --tp ranks of every\n"
             "instance is a process; requests (128..--max-tokens tokens, log-uniform) go round-robin\n"
             "over the P x D pairs, at most --inflight in flight per pair; every byte is checked.\n"
             "Ends with a table (GB/s, p50/p99 per-request transfer time, failures) and, per process,\n"
             "CPU share, threads, open descriptors and RSS at the end of the load, the most over the run.\n"
             "  --prefill-tp N, --decode-tp M  heterogeneous TP (each divides the 8 KV heads)\n"
             "  --pool-gib G  KV pool per instance (split over its ranks); default: room for two\n"
             "             requests of --max-tokens\n"
             "  --netns    each instance in its own network namespace (10.214.x.y, veth links to a\n"
             "             bridge), removed on exit; needs root and iproute2, else exits 77. UCX then\n"
             "             sees other hosts (no shared memory between instances): auto takes TCP\n"
             "  --short    the CI form: 2x2, TP 1, 5 s, 0.25 GiB pools\n");
}

/* CPU seconds (user + system) a process has used, from /proc/PID/stat; 0 if gone. */
static double cpu_s(pid_t pid) {
  char path[64], buf[1024];
  unsigned long ut = 0, st = 0;
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = 0;
  const char *p = strrchr(buf, ')'); /* the command name may hold spaces */
  if (!p || sscanf(p + 1, " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %lu %lu", &ut, &st) != 2) return 0;
  return (double)(ut + st) / (double)sysconf(_SC_CLK_TCK);
}

/* Threads and RSS from /proc/PID/status, descriptors from /proc/PID/fd. */
static void sample(cl_proc *c, int keep) {
  char path[64], line[256];
  long thr = 0, rss = 0, fds = 0;
  snprintf(path, sizeof path, "/proc/%d/status", (int)c->p.pid);
  FILE *f = fopen(path, "r");
  if (!f) return;
  while (fgets(line, sizeof line, f))
    if (!sscanf(line, "Threads: %ld", &thr)) sscanf(line, "VmRSS: %ld", &rss);
  fclose(f);
  snprintf(path, sizeof path, "/proc/%d/fd", (int)c->p.pid);
  DIR *d = opendir(path);
  for (struct dirent *e; d && (e = readdir(d));) fds += e->d_name[0] != '.';
  if (d) closedir(d);
  if (keep) c->thr = thr, c->fds = fds, c->rss_kb = rss, c->cpu = cpu_s(c->p.pid);
  if (thr > c->max_thr) c->max_thr = thr;
  if (fds > c->max_fds) c->max_fds = fds;
  if (rss > c->max_rss_kb) c->max_rss_kb = rss;
}

/* A rank process's first line, `ready ...` (as pd_wait_ready), waited for
 * in slices so that a signal (cl_interrupted) ends the wait at once:
 * proc_read_line itself waits through EINTR until its deadline. 0 or -1. */
static int wait_ready(proc *p) {
  char line[400];
  const double until = cli_now_s() + CL_READY_MS / 1e3;
  while (!cl_interrupted) {
    if (!proc_read_line(p, line, sizeof line, CL_READY_SLICE_MS)) return strncmp(line, "ready ", 6) ? -1 : 0;
    /* No whole line yet: waiting on makes sense unless the process is gone. */
    struct pollfd pf = {.fd = p->out_fd, .events = POLLIN};
    if ((poll(&pf, 1, 0) > 0 && !(pf.revents & POLLIN)) || cli_now_s() >= until) return -1;
  }
  return -1;
}

static int parse_cluster(const char *s, int *p, int *d) {
  char x;
  return sscanf(s, "%d%c%d", p, &x, d) == 3 && (x == 'x' || x == 'X') && *p >= 1 && *d >= 1 ? 0 : -1;
}

static const char *kind_name(int k) { return k == 0 ? "bootstrap" : k == 1 ? "prefill" : "decode"; }

int cli_demo_cluster(int argc, char **argv) {
  const char *cluster = "2x2";
  /* pool_gib 0: room for two requests of --max-tokens per instance */
  pd_demo_opts o = {.model = "llama-3.1-8b", .seed = 1, .max_tokens = 1024};
  int tp = 1, ptp = 0, dtp = 0, inflight = 2, use_netns = 0, is_short = 0, set_cluster = 0, set_seconds = 0;
  double seconds = 20;
  static const struct option opts[] = {PD_DEMO_LONG_OPTS,
                                       {"cluster", required_argument, 0, 'C'},
                                       {"tp", required_argument, 0, 'p'},
                                       {"prefill-tp", required_argument, 0, 'P'},
                                       {"decode-tp", required_argument, 0, 'D'},
                                       {"seconds", required_argument, 0, 'd'},
                                       {"inflight", required_argument, 0, 'k'},
                                       {"netns", no_argument, 0, 'N'},
                                       {"short", no_argument, 0, 's'},
                                       {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
  int c;
  char *end;
  optind = 1;
  while ((c = getopt_long(argc, argv, PD_DEMO_SHORT_OPTS "C:p:P:D:d:k:Nsh", opts, NULL)) != -1) {
    if (pd_demo_opt(&o, c, optarg)) continue;
    switch (c) {
      case 'C': cluster = optarg, set_cluster = 1; break;
      case 'p': tp = atoi(optarg); break;
      case 'P': ptp = atoi(optarg); break;
      case 'D': dtp = atoi(optarg); break;
      case 'd':
        seconds = strtod(optarg, &end);
        if (*end || !(seconds > 0)) seconds = -1;
        set_seconds = 1;
        break;
      case 'k': inflight = atoi(optarg); break;
      case 'N': use_netns = 1; break;
      case 's': is_short = 1; break;
      case 'h': cli_demo_cluster_usage(stdout); return 0;
      default: cli_demo_cluster_usage(stderr); return 2;
    }
  }
  if (optind < argc) {
    fprintf(stderr, "demo: unexpected argument '%s'\n", argv[optind]);
    return 2;
  }
  if (is_short) { /* explicit options still win */
    if (!set_cluster) cluster = "2x2";
    if (!set_seconds) seconds = 5;
    if (!o.set_pool) o.pool_gib = 0.25;
  }
  unsigned long long seed = o.seed, max_tokens = o.max_tokens;
  double pool_gib = o.pool_gib;
  int P = 0, D = 0;
  if (parse_cluster(cluster, &P, &D) || P + D > CL_MAX_INSTANCES) {
    fprintf(stderr, "demo: --cluster wants PxD (e.g. 2x2, 8x8), at most %d instances in all\n", CL_MAX_INSTANCES);
    return 2;
  }
  const pd_model *md = pd_model_find(o.model);
  if (!md) {
    fprintf(stderr, "demo: unknown model '%s' (%s)\n", o.model, pd_model_names);
    return 2;
  }
  /* --tp for both sides; --prefill-tp / --decode-tp (heterogeneous TP) win. */
  if (!ptp) ptp = tp;
  if (!dtp) dtp = tp;
  if (ptp < 1 || ptp > 8 || dtp < 1 || dtp > 8 || (!md->mla && (md->kv_heads % ptp || md->kv_heads % dtp))) {
    fprintf(stderr, "demo: --tp, --prefill-tp, --decode-tp must be 1..8%s\n",
            md->mla ? "" : " and divide the 8 KV heads (1, 2, 4 or 8)");
    return 2;
  }
  if (o.transport && cli_set_transport("demo", o.transport)) return 2;
  if (seconds <= 0 || seconds > 86400 || inflight < 1 || inflight > 64 || max_tokens < 128 ||
      max_tokens > (1u << 20) || pool_gib < 0 || pool_gib > 1024 || !seed) {
    fprintf(stderr, "demo: bad value (need seconds > 0, inflight 1..64, max-tokens 128..1M, pool-gib > 0, "
                    "seed > 0)\n");
    return 2;
  }
  pd_layout lo;
  const uint64_t page_bytes = pd_model_layout(md, ptp, dtp, &lo); /* one page of the instance, over its ranks */
  const uint64_t page_moved = page_bytes * (uint64_t)(md->mla ? dtp : 1);
  const uint64_t max_pages = (max_tokens + md->page_tokens - 1) / md->page_tokens;
  if (pool_gib == 0) pool_gib = (double)(2 * max_pages * page_bytes) / (1ull << 30);
  const uint64_t pool_pages = (uint64_t)(pool_gib * (1ull << 30)) / page_bytes;
  if (pool_pages < max_pages) {
    fprintf(stderr, "demo: --pool-gib %.3g holds %llu pages of %s, less than one request of %llu tokens\n",
            pool_gib, (unsigned long long)pool_pages, md->name, max_tokens);
    return 2;
  }

  const int nprocs = P * (1 + ptp) + D * dtp, npairs = P * D;
  cl_proc *procs = calloc((size_t)nprocs, sizeof *procs);
  cl_inst *inst = calloc((size_t)(P + D), sizeof *inst);
  pd_req *reqs = calloc(CL_MAX_REQS, sizeof *reqs);
  int *pair_of = calloc(CL_MAX_REQS, sizeof *pair_of), *live = calloc((size_t)npairs * inflight, sizeof *live);
  int *pair_load = calloc((size_t)npairs, sizeof *pair_load),
      *pair_reqs = calloc((size_t)npairs, sizeof *pair_reqs);
  double *lat = calloc(CL_MAX_REQS, sizeof *lat);
  struct pollfd *pf = calloc((size_t)nprocs, sizeof *pf);
  cl_netns *ns = use_netns ? calloc(1, sizeof *ns) : NULL;
  int rc = 1, nlive = 0, issued = 0, completed = 0, failures = 0, shown = 0;
  const char *fatal = NULL;
  char err[400] = "", fatal_buf[300];
  if (!procs || !inst || !reqs || !pair_of || !live || !pair_load || !pair_reqs || !lat || !pf ||
      (use_netns && !ns)) {
    fprintf(stderr, "demo: out of memory\n");
    goto out_free;
  }
  /* Ctrl-C and kill end the run through the cleanup below (processes
   * stopped, namespaces deleted); a dead child's pipe is an error, not a
   * signal. */
  struct sigaction sa = {.sa_handler = on_signal}, old_int, old_term, old_pipe;
  sigemptyset(&sa.sa_mask);
  sigaction(SIGINT, &sa, &old_int);
  sigaction(SIGTERM, &sa, &old_term);
  struct sigaction ign = {.sa_handler = SIG_IGN};
  sigaction(SIGPIPE, &ign, &old_pipe);
  if (use_netns) {
    int nrc = cl_netns_up(ns, P + D, err, sizeof err);
    if (nrc) {
      fprintf(stderr, "demo: %s%s\n", err, nrc > 0 ? "; skipped (exit 77)" : "");
      rc = nrc > 0 ? 77 : 1;
      goto out_signals;
    }
  }

  printf("kvferry demo --cluster %dx%d: %s, %d-token pages (%.0f KiB of KV per token), TP %d prefill, %d decode\n",
         P, D, md->name, md->page_tokens, page_bytes / md->page_tokens / 1024.0, ptp, dtp);
  printf("  %d prefill instances (each a bootstrap server + %d rank process%s), %d decode instances (%d rank "
         "process%s each): %d processes\n",
         P, ptp, ptp > 1 ? "es" : "", D, dtp, dtp > 1 ? "es" : "", nprocs);
  printf("  pools: %llu pages (%.2f GiB) per instance; requests 128..%llu tokens; up to %d in flight per pair, "
         "%d pairs; %.0f s of load; transport %s%s\n",
         (unsigned long long)pool_pages, pool_pages * page_bytes / (double)(1ull << 30), max_tokens, inflight,
         npairs, seconds, getenv("KVFERRY_TRANSPORT") ? getenv("KVFERRY_TRANSPORT") : "auto",
         use_netns ? "" : " (all on 127.0.0.1)");
  if (use_netns)
    printf("  network namespaces %.9s0..%d (10.214.x.y, veth to bridge %s); UCX sees each namespace as another "
           "host: no shared memory between instances\n",
           ns->ns[0], P + D - 1, ns->bridge_name);
  printf("  starting the processes (faulting in the pools)...\n");
  fflush(stdout);

  /* Bootstrap servers first: the prefill ranks register with them. */
  lo.pages = pool_pages;
  int np = 0;
  const double t_start = cli_now_s();
  for (int i = 0; i < P + D; i++) {
    cl_inst *in = &inst[i];
    char *pre[5] = {NULL};
    if (use_netns) cl_netns_prefix(ns, i, pre);
    in->host = use_netns ? ns->host[i] : "127.0.0.1";
    in->free_pages = pool_pages;
    in->boot = -1;
    if (i < P) {
      in->boot = np;
      procs[np] = (cl_proc){.inst = i, .kind = 0};
      if (pd_boot_start(&procs[np].p, use_netns ? pre : NULL, in->host, in->baddr, err, sizeof err)) {
        snprintf(fatal_buf, sizeof fatal_buf, "prefill instance %d: %s", i, err);
        fatal = fatal_buf;
        goto out_stop;
      }
      procs[np++].up = 1;
    }
    in->proc0 = np;
    for (int r = 0; r < (i < P ? ptp : dtp); r++, np++) {
      pd_argv a;
      pd_peer_argv(&a, use_netns ? pre : NULL, &lo, i >= P, i < P ? in->baddr : NULL);
      pd_argv_add(&a, "--rank"), pd_argv_add(&a, "%d", r);
      pd_argv_add(&a, "--host"), pd_argv_add(&a, "%s", in->host);
      procs[np] = (cl_proc){.inst = i < P ? i : i - P, .rank = r, .kind = i < P ? 1 : 2};
      if (proc_start(&procs[np].p, a.v)) {
        snprintf(fatal_buf, sizeof fatal_buf, "cannot start %s instance %d rank %d", kind_name(procs[np].kind),
                 procs[np].inst, r);
        fatal = fatal_buf;
        goto out_stop;
      }
      procs[np].up = 1;
    }
  }
  for (int i = 0; i < nprocs; i++)
    if (procs[i].kind && wait_ready(&procs[i].p)) {
      snprintf(fatal_buf, sizeof fatal_buf, "%s instance %d rank %d did not start (pool of %llu pages)",
               kind_name(procs[i].kind), procs[i].inst, procs[i].rank, (unsigned long long)pool_pages);
      fatal = cl_interrupted ? "interrupted" : fatal_buf;
      goto out_stop;
    }
  printf("  all %d processes up in %.1f s\n", nprocs, cli_now_s() - t_start);
  fflush(stdout);

  uint64_t rng = seed * 0x9e3779b97f4a7c15ULL + 1;
  const int64_t room_base = (int64_t)(seed % 1000000) * 1000000 + 1;
  const int tty = isatty(STDERR_FILENO);
  int cursor = 0, loading = 1;
  size_t next_tokens = pd_draw_tokens(&rng, max_tokens);
  for (int i = 0; i < nprocs; i++) procs[i].cpu0 = cpu_s(procs[i].p.pid);
  const double self_cpu0 = cpu_s(getpid());
  double moved = 0, t0 = cli_now_s(), t_end = t0 + seconds, last_done = t0, last_sample = 0, wall = 0;
  double self_cpu = 0, load_s = seconds;
  while (loading || nlive) {
    if (cl_interrupted) {
      fatal = "interrupted";
      goto out_stop;
    }
    double now = cli_now_s();
    if (loading && (now >= t_end || issued == CL_MAX_REQS)) {
      loading = 0;
      for (int i = 0; i < nprocs; i++) sample(&procs[i], 1); /* the end of the load, requests in flight */
      self_cpu = cpu_s(getpid()) - self_cpu0;
      load_s = now - t0;
    } else if (now - last_sample >= 1) {
      for (int i = 0; i < nprocs; i++) sample(&procs[i], 0);
      last_sample = now;
    }
    /* Admit the next request on the next pair, round-robin, that has room. */
    while (loading && nlive < npairs * inflight) {
      const size_t npg = (next_tokens + (size_t)md->page_tokens - 1) / (size_t)md->page_tokens;
      int pair = -1;
      for (int t = 0; t < npairs && pair < 0; t++) {
        int k = (cursor + t) % npairs, pi = k / D, di = P + k % D;
        if (pair_load[k] < inflight && inst[pi].free_pages >= npg && inst[di].free_pages >= npg) pair = k;
      }
      if (pair < 0) break;
      cursor = pair + 1;
      cl_inst *pin = &inst[pair / D], *din = &inst[P + pair % D];
      pd_req *r = &reqs[issued];
      *r = (pd_req){.room = room_base + issued,
                    .token = 1000 + issued % 100000,
                    .seed = seed,
                    .npages = npg,
                    .prefill_procs = ptp,
                    .decode_procs = dtp};
      for (int k = 0; k < dtp; k++)
        if (pd_issue_decode(&procs[din->proc0 + k].p, r, pin->baddr)) {
          fatal = "cannot talk to a decode process";
          goto out_stop;
        }
      for (int k = 0; k < ptp; k++)
        if (pd_issue_prefill(&procs[pin->proc0 + k].p, r)) {
          fatal = "cannot talk to a prefill process";
          goto out_stop;
        }
      pin->free_pages -= npg;
      din->free_pages -= npg;
      pair_load[pair]++;
      pair_reqs[pair]++;
      pair_of[issued] = pair;
      live[nlive++] = issued++;
      next_tokens = pd_draw_tokens(&rng, max_tokens);
    }
    /* Wait for reports from any rank process. */
    int n = 0;
    for (int i = 0; i < nprocs; i++)
      if (procs[i].kind) pf[n++] = (struct pollfd){.fd = procs[i].p.out_fd, .events = POLLIN};
    if (poll(pf, (nfds_t)n, 100) < 0) continue; /* EINTR: see cl_interrupted */
    int got = 0;
    for (int i = 0, j = 0; i < nprocs; i++) {
      if (!procs[i].kind) continue;
      got += pd_drain(&procs[i].p, procs[i].kind == 2, reqs, (size_t)issued, room_base);
      if ((pf[j].revents & (POLLHUP | POLLERR)) && !(pf[j].revents & POLLIN)) {
        int st = proc_stop(&procs[i].p, 2000); /* how it ended */
        procs[i].up = 0;
        snprintf(fatal_buf, sizeof fatal_buf, "%s instance %d rank %d (pid %d) died (%s %d)",
                 kind_name(procs[i].kind), procs[i].inst, procs[i].rank, (int)procs[i].p.pid,
                 st >= 0 && WIFSIGNALED(st) ? "signal" : "exit status",
                 st < 0            ? -1
                 : WIFSIGNALED(st) ? WTERMSIG(st)
                                   : WEXITSTATUS(st));
        fatal = cl_interrupted ? "interrupted" : fatal_buf; /* ctrl-C reaches the children too */
        goto out_stop;
      }
      j++;
    }
    for (int l = 0; got && l < nlive; l++) {
      int id = live[l];
      pd_req *r = &reqs[id];
      if (!r->prefill_done || !r->decode_done) continue;
      live[l--] = live[--nlive];
      int pair = pair_of[id];
      pair_load[pair]--;
      inst[pair / D].free_pages += r->npages;
      inst[P + pair % D].free_pages += r->npages;
      completed++;
      if (pd_failed(r)) {
        failures++;
        if (shown++ < CL_SHOW_FAILURES) {
          if (tty) fputc('\n', stderr);
          fprintf(stderr, "demo: request %d (prefill %d -> decode %d, %zu pages): FAILED: %s%s\n", id, pair / D,
                  pair % D, r->npages, r->bad_pages ? "MISMATCH, " : "",
                  *r->reason ? r->reason : "failed without a reason");
        }
        continue;
      }
      moved += (double)r->npages * (double)page_moved;
      lat[completed - failures - 1] = pd_transfer_s(r);
    }
    now = cli_now_s();
    if (got) last_done = now;
    else if (nlive && now - last_done > 120) {
      fatal = "no request finished in 120 s";
      goto out_stop;
    }
    if (!loading && !nlive) wall = now - t0;
    if (tty)
      fprintf(stderr, "\r  %s %.0f/%.0f s  %d requests done, %d in flight  %.2f GiB  %.2f GB/s ",
              loading ? "load" : "draining", now - t0 < seconds ? now - t0 : seconds, seconds, completed, nlive,
              moved / (1ull << 30), now > t0 ? moved / (now - t0) / 1e9 : 0.0);
  }
  if (tty) fputc('\n', stderr);
  int ok = completed - failures, pmin = completed, pmax = 0;
  qsort(lat, (size_t)ok, sizeof *lat, pd_cmp_dbl);
  for (int k = 0; k < npairs; k++) {
    if (pair_reqs[k] < pmin) pmin = pair_reqs[k];
    if (pair_reqs[k] > pmax) pmax = pair_reqs[k];
  }
  printf("\n  %-36s %d prefill (TP %d) x %d decode (TP %d)\n", "instances", P, ptp, D, dtp);
  printf("  %-36s %d (%d bootstrap, %d prefill ranks, %d decode ranks)\n", "processes", nprocs, P, P * ptp,
         D * dtp);
  printf("  %-36s %d (%d..%d per pair)\n", "requests", completed, pmin, pmax);
  printf("  %-36s %.2f\n", "GiB moved and verified", moved / (1ull << 30));
  printf("  %-36s %.2f\n", "GB/s in all", wall > 0 ? moved / wall / 1e9 : 0.0);
  printf("  %-36s %.1f / %.1f\n", "transfer ms per request, p50 / p99", ok ? lat[ok / 2] * 1e3 : 0.0,
         ok ? lat[(size_t)((ok - 1) * 0.99)] * 1e3 : 0.0);
  printf("  %-36s %d\n", "failures", failures);
  printf("  (transfer: from the later of the decode's M2 and the prefill's last send to the decode's Success,\n"
         "   over every rank; %.1f s of load and drain, every page's pattern filled and checked)\n",
         wall);
  printf("\n  %-28s  %-27s  %s\n", "", "at the end of the load", "most over the run");
  printf("  %-9s %4s %4s %8s  %5s %7s %5s %7s  %7s %5s %7s\n", "process", "inst", "rank", "pid", "CPU%", "threads",
         "fds", "RSS", "threads", "fds", "RSS");
  long tot_thr = 0, tot_fds = 0, tot_rss = 0;
  double tot_cpu = 0;
  for (int i = 0; i < nprocs; i++) {
    cl_proc *q = &procs[i];
    char rank[12] = "-";
    if (q->kind) snprintf(rank, sizeof rank, "%d", q->rank);
    double pct = q->cpu > q->cpu0 && load_s > 0 ? (q->cpu - q->cpu0) / load_s * 100 : 0;
    printf("  %-9s %4d %4s %8d  %5.0f %7ld %5ld %6.0fM  %7ld %5ld %6.0fM\n", kind_name(q->kind), q->inst, rank,
           (int)q->p.pid, pct, q->thr, q->fds, q->rss_kb / 1024.0, q->max_thr, q->max_fds, q->max_rss_kb / 1024.0);
    tot_thr += q->thr, tot_fds += q->fds, tot_rss += q->rss_kb, tot_cpu += pct;
  }
  printf("  %-9s %4s %4s %8d  %5.0f\n", "demo", "", "", (int)getpid(), load_s > 0 ? self_cpu / load_s * 100 : 0.0);
  printf("  %-9s %4s %4s %8s  %5.0f %7ld %5ld %6.0fM\n", "all", "", "", "", tot_cpu + self_cpu / load_s * 100,
         tot_thr, tot_fds, tot_rss / 1024.0);
  printf("  (CPU%%: over the load, 100 = one core of the %ld here. RSS: the process's own pool and, over UCX\n"
         "   shared memory, the pages of the peers' pools it has mapped and touched: the sum counts those "
         "twice)\n",
         sysconf(_SC_NPROCESSORS_ONLN));
  if (failures)
    printf("demo FAILED: %d of %d requests failed or did not verify; the reasons are above\n", failures,
           completed);
  else if (!completed) printf("demo FAILED: no request completed\n");
  else
    printf("demo OK: %d requests over %d pairs, every byte of %.2f GiB verified\n", completed, npairs,
           moved / (1ull << 30));
  rc = failures || !completed ? 1 : 0;
out_stop:
  if (fatal) {
    if (isatty(STDERR_FILENO)) fputc('\n', stderr);
    fprintf(stderr, "demo FAILED: %s (%d of %d requests finished)\n", fatal, completed, issued);
    printf("demo FAILED: %s\n", fatal);
    rc = 1;
  }
  fflush(stdout);
  /* EOF to every rank first, so that they wind down together. */
  for (int i = 0; i < nprocs; i++)
    if (procs[i].up && procs[i].kind && procs[i].p.in) {
      fclose(procs[i].p.in);
      procs[i].p.in = NULL;
    }
  for (int i = 0; i < nprocs; i++)
    if (procs[i].up && procs[i].kind) proc_stop(&procs[i].p, 10000);
  for (int i = 0; i < nprocs; i++)
    if (procs[i].up && !procs[i].kind) pd_boot_stop(&procs[i].p);
  if (use_netns) cl_netns_down(ns);
out_signals:
  sigaction(SIGINT, &old_int, NULL);
  sigaction(SIGTERM, &old_term, NULL);
  sigaction(SIGPIPE, &old_pipe, NULL);
out_free:
  free(procs);
  free(inst);
  free(reqs);
  free(pair_of);
  free(live);
  free(pair_load);
  free(pair_reqs);
  free(lat);
  free(pf);
  free(ns);
  return rc;
}

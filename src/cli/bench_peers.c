/* `kvferry bench peers` (issue 24): what each connected peer costs one
 * prefill rank, and whether many idle peers slow the rooms of an active one;
 * then the reverse view, a decode rank (this process) with N idle prefill
 * peers (kv-idle --role prefill, each with its own bootstrap server, which
 * this decode heartbeats).
 * The measured process is a prefill instance of one rank (`kvferry-testpeer
 * kv-peer`, which also hosts the bootstrap server, as rank 0 of a deployment
 * does). N idle peers are N decode instances of one rank each, 64 to a
 * `kvferry-testpeer kv-idle` child; each completes one 1-page room with the
 * prefill, so every connection (ZeroMQ PUSH both ways, engine connections,
 * UCX rendezvous) exists, then stays connected and heartbeating. The active
 * decode is a manager in this process. At N = 1, 8, 64, 256 (cumulative:
 * peers are added, never removed) it reads the prefill's threads, open
 * descriptors and VmRSS from /proc and runs 1-page rooms with 64 in flight
 * (rooms/s) and 1 in flight (p50). Per-peer figures are the growth over the
 * prefill after the active decode's warm-up, divided by N; rate_over_1peer
 * is the rate at N over the rate at N = 1 of the same run.
 * A control pair runs beside the measured one all along: a second prefill
 * kv-peer with only the active decode (prefill view), or a second decode
 * manager in this process with only the active prefill (decode view); no
 * idle peer connects to it. Each step alternates rounds of the two pairs, so
 * rate_over_control (the median of each measured round over the control
 * round next to it) sees the same machine as its control: on a shared VM
 * whose speed drifts by 2x over tens of seconds, and with the idle peers'
 * own processes on the same two cores, the measured rate alone moves more
 * between steps than any per-peer cost does. rate_over_1peer_controlled is
 * rate_over_control at N over that at N = 1: what the idle peers' state in
 * the measured process costs its rooms. The targets are printed
 * beside the figures, never asserted. */
#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench.h"
#include "cli.h"
#include "kvferry.h"
#include "tools/kvpool.h"
#include "tools/proc.h"

#define PEERS_MAX 1024
#define PEERS_STEPS 8
#define PEERS_PER_CHILD 64 /* kv-idle instances per child process */
#define PEERS_CHILDREN (PEERS_MAX / PEERS_PER_CHILD + PEERS_STEPS)
#define PEERS_LAYERS 2
#define PEERS_ITEM 4096
#define PEERS_PREFILL_PAGES 512 /* small: the warm-up touches all of it before the baseline */
#define PEERS_DECODE_PAGES 4096
#define PEERS_NAMES 48
#define PEERS_REPS 5           /* rounds of the rooms cases at each N (--quick: 1), each pair */
#define PEERS_WARM_ROOMS 20000 /* the round not counted before each N's rounds */
#define PEERS_IDLE_S 1.0       /* the idle window: CPU time and wake-ups with no room live */

/* The targets, printed beside the figures. */
#define TARGET_THREADS_PER_PEER 1.0
#define TARGET_RSS_KIB_PER_PEER 64.0
#define TARGET_RATE_RATIO 0.9

/* Counts by name: threads by /proc/pid/task/<tid>/comm, descriptors by
 * what fd/<n> links to (socket, eventfd, ...). */
typedef struct name_counts {
  int n;
  char name[PEERS_NAMES][24];
  long count[PEERS_NAMES];
} name_counts;

typedef struct peers_step {
  int peers, connected;
  proc_usage u;
  double idle_cpu_pct, idle_wakeups_per_s; /* the measured process over PEERS_IDLE_S with no room live */
  double peers_cpu_pct;                    /* all the kv-idle children over the same window */
  double rate_runs[PEERS_REPS];            /* each round's rate; rooms_per_s is the best */
  double ctl_runs[PEERS_REPS];             /* the control pair's round beside each */
  double warm_rate;                        /* the warm-up round's, not counted */
  int nruns;
  double rooms_per_s, p50_us, p99_us;
  double ctl_rooms_per_s, rate_over_ctl; /* the control's best; median of rate_runs[k] / ctl_runs[k] */
  char error[160];
} peers_step;

typedef struct peers_run {
  const char *transport;
  int reverse; /* the measured process is a decode rank (this one) with N idle prefill peers */
  int max_inbound;
  proc_usage start, base;
  double base_cpu_pct, base_wakeups_per_s;  /* the idle window after the warm-up */
  double mgr_rss_kib, mgr_threads, mgr_fds; /* one idle decode instance, as kv-idle saw it */
  int nsteps;
  peers_step steps[PEERS_STEPS];
  /* After the last step, once every peer has been idle past the control
   * sockets' idle close ($KVFERRY_CONTROL_IDLE_S): the measured process
   * then, the peers it holds, how long it waited. */
  proc_usage closed; /* against `base`, itself taken past the idle close then */
  int closed_peers;
  double closed_wait_s;
  name_counts thr0, thr1, fd0, fd1; /* at the baseline and at the last step measured */
  int census;                       /* thr1 and fd1 were taken */
  char path[256];                   /* cli_bench_path's JSON members */
} peers_run;

static void counts_add(name_counts *c, const char *name) {
  for (int i = 0; i < c->n; i++)
    if (!strcmp(c->name[i], name)) {
      c->count[i]++;
      return;
    }
  if (c->n == PEERS_NAMES) return;
  snprintf(c->name[c->n], sizeof c->name[0], "%s", name);
  c->count[c->n++] = 1;
}

static long counts_of(const name_counts *c, const char *name) {
  for (int i = 0; i < c->n; i++)
    if (!strcmp(c->name[i], name)) return c->count[i];
  return 0;
}

/* The threads by name and the descriptors by kind of process pid. */
static void peers_census(pid_t pid, name_counts *thr, name_counts *fds) {
  char path[96], buf[256];
  memset(thr, 0, sizeof *thr);
  memset(fds, 0, sizeof *fds);
  snprintf(path, sizeof path, "/proc/%d/task", (int)pid);
  DIR *d = opendir(path);
  for (struct dirent *e; d && (e = readdir(d));) {
    if (e->d_name[0] == '.') continue;
    snprintf(path, sizeof path, "/proc/%d/task/%.20s/comm", (int)pid, e->d_name);
    FILE *f = fopen(path, "r");
    if (!f) continue;
    if (fgets(buf, sizeof buf, f)) {
      buf[strcspn(buf, "\n")] = 0;
      /* "kvf-tcp-in-12" and "kvf-tcp-in-13" are one kind: drop a numeric tail */
      size_t n = strlen(buf);
      while (n && buf[n - 1] >= '0' && buf[n - 1] <= '9') buf[--n] = 0;
      counts_add(thr, buf);
    }
    fclose(f);
  }
  if (d) closedir(d);
  snprintf(path, sizeof path, "/proc/%d/fd", (int)pid);
  d = opendir(path);
  for (struct dirent *e; d && (e = readdir(d));) {
    if (e->d_name[0] == '.') continue;
    snprintf(path, sizeof path, "/proc/%d/fd/%.20s", (int)pid, e->d_name);
    ssize_t n = readlink(path, buf, sizeof buf - 1);
    if (n <= 0) continue;
    buf[n] = 0;
    if (!strncmp(buf, "socket:", 7) || !strncmp(buf, "pipe:", 5)) buf[strcspn(buf, ":")] = 0;
    else if (buf[0] == '/') snprintf(buf, sizeof buf, "file");
    counts_add(fds, buf);
  }
  if (d) closedir(d);
}

#define PEERS_MAX_TASKS 1024 /* threads of the measured process whose wake-ups are told apart */

/* The voluntary context switches of one thread of the measured process: a
 * thread that sleeps and wakes (a timed wait, a poll tick) counts one per
 * wake-up. */
typedef struct peers_task {
  long tid;
  double switches;
} peers_task;

/* CPU time (utime + stime, in clock ticks) of process pid, and each of its
 * threads' voluntary context switches (at most PEERS_MAX_TASKS of them, in
 * t[0..*nt)). -1 if gone. */
static int peers_cpu(pid_t pid, double *ticks, peers_task *t, int *nt) {
  char path[96], buf[1024];
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  FILE *f = fopen(path, "r");
  if (!f) return -1;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = 0;
  char *p = strrchr(buf, ')'); /* the name may hold spaces */
  unsigned long long ut = 0, st = 0;
  if (!p || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) != 2) return -1;
  *ticks = (double)(ut + st);
  *nt = 0;
  snprintf(path, sizeof path, "/proc/%d/task", (int)pid);
  DIR *d = opendir(path);
  for (struct dirent *e; d && *nt < PEERS_MAX_TASKS && (e = readdir(d));) {
    if (e->d_name[0] == '.') continue;
    snprintf(path, sizeof path, "/proc/%d/task/%.20s/status", (int)pid, e->d_name);
    if (!(f = fopen(path, "r"))) continue;
    while (fgets(buf, sizeof buf, f))
      if (!strncmp(buf, "voluntary_ctxt_switches:", 24))
        t[(*nt)++] = (peers_task){strtol(e->d_name, NULL, 10), strtod(buf + 24, NULL)};
    fclose(f);
  }
  if (d) closedir(d);
  return 0;
}

/* Wake-ups between two samples, thread by thread: a thread that began in
 * between counts whole, one that ended in between is missed (a lower bound;
 * summed over the process, its exit made the total go backwards, as when
 * idle TCP connections' threads end). */
static double peers_switches_between(const peers_task *a, int na, const peers_task *b, int nb) {
  double sum = 0;
  for (int i = 0; i < nb; i++) {
    double before = 0;
    for (int k = 0; k < na; k++)
      if (a[k].tid == b[i].tid) before = a[k].switches;
    if (b[i].switches > before) sum += b[i].switches - before;
  }
  return sum;
}

/* The CPU time of the n children, in clock ticks (their wake-ups are not
 * counted: thousands of threads to read). */
static double peers_children_ticks(const proc *c, int n) {
  double sum = 0;
  for (int i = 0; i < n; i++) {
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/stat", (int)c[i].pid);
    FILE *f = fopen(path, "r");
    char buf[1024];
    size_t k = f ? fread(buf, 1, sizeof buf - 1, f) : 0;
    if (f) fclose(f);
    buf[k] = 0;
    char *p = strrchr(buf, ')');
    unsigned long long ut = 0, st = 0;
    if (p && sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) == 2)
      sum += (double)(ut + st);
  }
  return sum;
}

/* The measured process's CPU share (percent of one core) and wake-ups per
 * second while nothing but the peers' background (heartbeats, ticks) runs,
 * and the idle peers' processes' CPU share over the same window: what they
 * take from the two cores the active pair shares with them. */
static void peers_idle(pid_t pid, const proc *children, int nchildren, double *cpu_pct, double *wakeups,
                       double *peers_pct) {
  double t0, t1, s0 = cli_now_s(), c0 = peers_children_ticks(children, nchildren);
  double hz = (double)sysconf(_SC_CLK_TCK);
  static peers_task w0[PEERS_MAX_TASKS], w1[PEERS_MAX_TASKS]; /* the bench's one thread */
  int n0 = 0, n1 = 0;
  *cpu_pct = *wakeups = -1;
  if (peers_pct) *peers_pct = -1;
  if (peers_cpu(pid, &t0, w0, &n0)) return;
  usleep((useconds_t)(PEERS_IDLE_S * 1e6));
  double dt = cli_now_s() - s0;
  if (peers_cpu(pid, &t1, w1, &n1)) return;
  *cpu_pct = (t1 - t0) * 100.0 / hz / dt;
  *wakeups = peers_switches_between(w0, n0, w1, n1) / dt;
  if (peers_pct) *peers_pct = (peers_children_ticks(children, nchildren) - c0) * 100.0 / hz / dt;
}

/* Add idle peers (kv-idle children of at most PEERS_PER_CHILD instances)
 * until *have reach want; each completes one room with the prefill. 0, or
 * -1 with the reason in err. */
static int peers_add(peers_run *run, proc *children, int *nchildren, int *have, int want, proc *peer,
                     const char *baddr, kvf_manager *m, kvpool *pool, int64_t *room, char *err, size_t cap) {
  const char *exe = proc_testpeer_exe();
  char line[400];
  kvf_receiver *rx[PEERS_PER_CHILD];
  int64_t pg[PEERS_PER_CHILD];
  uint64_t rng = 0x9e3779b97f4a7c15ULL;
  while (*have < want) {
    int k = want - *have > PEERS_PER_CHILD ? PEERS_PER_CHILD : want - *have;
    if (*nchildren == PEERS_CHILDREN) return snprintf(err, cap, "too many child processes"), -1;
    char count[16], layers[16], item[16];
    snprintf(count, sizeof count, "%d", k);
    snprintf(layers, sizeof layers, "%d", PEERS_LAYERS);
    snprintf(item, sizeof item, "%d", PEERS_ITEM);
    char *argv[] = {(char *)exe, "kv-idle", "--bootstrap", (char *)baddr, "--count", count,
                    "--layers",  layers,    "--item",      item,          NULL};
    char *argv_pf[] = {(char *)exe, "kv-idle", "--role", "prefill", "--count", count,
                       "--layers",  layers,    "--item", item,      NULL};
    proc *c = &children[*nchildren];
    if (proc_start(c, run->reverse ? argv_pf : argv)) return snprintf(err, cap, "cannot start kv-idle"), -1;
    ++*nchildren;
    int n = 0;
    long rss = 0, thr = 0, fds = 0;
    if (proc_read_line(c, line, sizeof line, 60000) ||
        sscanf(line, "ready %d %ld %ld %ld", &n, &rss, &thr, &fds) != 4 || n != k)
      return snprintf(err, cap, "kv-idle with %d instances did not start", k), -1;
    /* One instance's cost, weighted over every child of the run. */
    double w = (double)*have / (*have + k);
    run->mgr_rss_kib = run->mgr_rss_kib * w + (double)rss / (*have + k);
    run->mgr_threads = run->mgr_threads * w + (double)thr / (*have + k);
    run->mgr_fds = run->mgr_fds * w + (double)fds / (*have + k);
    int ok = 0, failed = 0;
    char why[300] = "";
    if (run->reverse) {
      /* This decode asks each idle prefill instance for one room. */
      int nrx = 0, bad = 0;
      for (int i = 0; i < k && !bad; i++) {
        char addr[KVF_ADDR_MAX + 1];
        int idx;
        if (proc_read_line(c, line, sizeof line, 10000) || sscanf(line, "addr %d " CLI_ADDR_SCAN, &idx, addr) != 2)
          bad = snprintf(err, cap, "kv-idle: no address of prefill instance %d", i);
        else if (kvpool_take(pool, 1, &rng, &pg[i])) bad = snprintf(err, cap, "no free page");
        else if (kvf_receiver_create(m, addr, *room + i, &rx[i]) && (kvpool_give(pool, &pg[i], 1), 1))
          bad = snprintf(err, cap, "cannot create the receiver for idle prefill %d (%s)", i, addr);
        else if (nrx++, kvf_receiver_init(rx[i], &pg[i], 1, 0, 0, NULL, 0)) /* destroyed below */
          bad = snprintf(err, cap, "cannot ask idle prefill %d (%s) for its room", i, addr);
      }
      if (!bad) {
        fprintf(c->in, "send %lld\n", (long long)*room);
        fflush(c->in);
        if (proc_read_line(c, line, sizeof line, 90000) ||
            sscanf(line, "connected %d %d %299s", &ok, &failed, why) != 3)
          bad = snprintf(err, cap, "kv-idle: no answer to send");
      }
      /* This side's view of the rooms decides (at most 30 s more). */
      ok = failed = 0;
      for (long long until = cli_now_ms() + 30000; !bad && ok + failed < nrx && cli_now_ms() < until;) {
        ok = failed = 0;
        for (int i = 0; i < nrx; i++) {
          int st = kvf_receiver_poll(rx[i]);
          ok += st == KVF_POLL_SUCCESS, failed += st == KVF_POLL_FAILED;
          if (st == KVF_POLL_FAILED && !*why) kvf_receiver_failure(rx[i], why, sizeof why);
        }
        if (ok + failed < nrx) usleep(1000);
      }
      for (int i = 0; i < nrx; i++) {
        kvf_receiver_destroy(rx[i]);
        kvpool_give(pool, &pg[i], 1);
      }
      if (bad) return -1;
      failed = k - ok;
      for (char *p = why; *p; p++)
        if (*p == '\n') *p = ' ';
    } else {
      fprintf(c->in, "connect %lld\n", (long long)*room);
      fflush(c->in);
      for (int i = 0; i < k; i++) fprintf(peer->in, "send %lld 1 0 7\n", (long long)(*room + i));
      fflush(peer->in);
      if (proc_read_line(c, line, sizeof line, 90000) ||
          sscanf(line, "connected %d %d %299s", &ok, &failed, why) != 3)
        return snprintf(err, cap, "kv-idle: no answer to connect"), -1;
      /* The prefill's `done` lines of these rooms (bounded; the rooms case
       * skips any that come later). */
      for (int done = 0; done < k && !proc_read_line(peer, line, sizeof line, 10000);)
        done += !strncmp(line, "done ", 5);
    }
    *room += k;
    *have += ok;
    if (failed)
      return snprintf(err, cap, "%d of %d idle peers failed their room: %s", failed, k, *why ? why : "-"), -1;
  }
  return 0;
}

/* The managers' idle close of control sockets, as they resolve it
 * (kvf_manager_config.control_idle_s, $KVFERRY_CONTROL_IDLE_S); 0: none. */
static double peers_idle_close_s(void) {
  kvf_manager_config dc;
  kvf_manager_config_init(&dc);
  const char *env = getenv("KVFERRY_CONTROL_IDLE_S");
  double s = env && *env ? atof(env) : dc.control_idle_s;
  return s > 0 ? s : 0;
}

static int peers_cmp(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static int peers_parse(const char *s, int *out, int max) {
  int n = 0;
  for (const char *p = s; *p;) {
    char *end;
    long v = strtol(p, &end, 10);
    if (end == p || v < 1 || v > PEERS_MAX || n == max || (n && v <= out[n - 1])) return -1;
    out[n++] = (int)v;
    p = *end == ',' ? end + 1 : end;
    if (*end && *end != ',') return -1;
  }
  return n;
}

/* One pair of a rooms case: the decode manager here, its pool, the
 * kv-peer prefill and its bootstrap address. */
typedef struct peers_pair {
  kvf_manager *m;
  kvpool *pool;
  proc *peer;
  const char *baddr;
} peers_pair;

static int peers_case(const peers_pair *p, rooms_case *c, int64_t *base) {
  if (cli_bench_rooms_case(p->m, p->pool, p->peer, p->baddr, c, *base)) return -1;
  *base += c->rooms;
  return 0;
}

/* One step's counted rounds: the measured and the control pair's 64-in-flight
 * rounds alternate (which goes first alternates too), the measured pair's
 * 1-in-flight round after each. */
static int peers_rounds(peers_step *s, const peers_pair *meas, const peers_pair *ctl, int quick, int64_t *base) {
  double p50[PEERS_REPS], p99[PEERS_REPS], ratio[PEERS_REPS];
  int reps = quick ? 1 : PEERS_REPS;
  for (int k = 0; k < reps; k++) {
    rooms_case rate = {.name = "rate", .pages = 1, .inflight = 64, .rooms = quick ? 1000 : 10000};
    rooms_case crate = rate;
    rooms_case lat = {.name = "p50", .pages = 1, .inflight = 1, .rooms = quick ? 200 : 2000};
    if (k % 2 && peers_case(ctl, &crate, base))
      return snprintf(s->error, sizeof s->error, "control rooms failed at 64 in flight"), -1;
    if (peers_case(meas, &rate, base))
      return snprintf(s->error, sizeof s->error, "rooms failed at 64 in flight"), -1;
    if (!(k % 2) && peers_case(ctl, &crate, base))
      return snprintf(s->error, sizeof s->error, "control rooms failed at 64 in flight"), -1;
    if (peers_case(meas, &lat, base))
      return snprintf(s->error, sizeof s->error, "rooms failed at 1 in flight"), -1;
    s->rate_runs[s->nruns] = rate.rooms_per_s;
    s->ctl_runs[s->nruns++] = crate.rooms_per_s;
    if (rate.rooms_per_s > s->rooms_per_s) s->rooms_per_s = rate.rooms_per_s;
    if (crate.rooms_per_s > s->ctl_rooms_per_s) s->ctl_rooms_per_s = crate.rooms_per_s;
    ratio[k] = crate.rooms_per_s > 0 ? rate.rooms_per_s / crate.rooms_per_s : 0;
    p50[k] = lat.p50_us, p99[k] = lat.p99_us;
  }
  qsort(p50, (size_t)reps, sizeof p50[0], peers_cmp);
  qsort(p99, (size_t)reps, sizeof p99[0], peers_cmp);
  qsort(ratio, (size_t)reps, sizeof ratio[0], peers_cmp);
  s->p50_us = p50[reps / 2], s->p99_us = p99[reps / 2], s->rate_over_ctl = ratio[reps / 2];
  return 0;
}

/* Start a kv-peer prefill (argv) and read its bootstrap address into baddr;
 * 0, or -1 having said so (the process, if started, is left to stop). */
static int peers_start_prefill(proc *p, char **argv, char *baddr, const char *what) {
  char line[400];
  if (proc_start(p, argv)) return -1;
  if (!proc_read_line(p, line, sizeof line, 20000) && sscanf(line, "ready " CLI_ADDR_SCAN, baddr) == 1) return 0;
  fprintf(stderr, "bench peers: the %s peer did not start\n", what);
  return 1;
}

/* One transport: the prefill, the active decode here, then the steps. */
static int peers_run_one(peers_run *run, const int *want, int nwant, int quick) {
  char pages[16], layers[16], item[16], maxin[16], baddr[KVF_ADDR_MAX + 1];
  const char *exe = proc_testpeer_exe();
  int rc = 1, nchildren = 0, have = 0;
  proc *children = calloc(PEERS_CHILDREN, sizeof *children);
  if (!children) return 1;
  setenv("KVFERRY_TRANSPORT", run->transport, 1);
  /* The measured process's engine bound on accepted connections: a decode
   * accepts two TCP connections (conns_per_peer) or one UCX rendezvous
   * connection from each prefill, each holding a thread; the default 256
   * would evict idle ones from 128 TCP prefill peers on. A prefill accepts
   * none here (it writes over TCP and connects to the decode's rendezvous
   * over UCX), the bound is raised there too for a deployment that does. */
  run->max_inbound = want[nwant - 1] * 2 + 64 > 256 ? want[nwant - 1] * 2 + 64 : 256;
  snprintf(pages, sizeof pages, "%d", PEERS_PREFILL_PAGES);
  snprintf(layers, sizeof layers, "%d", PEERS_LAYERS);
  snprintf(item, sizeof item, "%d", PEERS_ITEM);
  snprintf(maxin, sizeof maxin, "%d", run->max_inbound);
  char *argv[] = {(char *)exe,           "kv-peer", "--layers", layers, "--item", item, "--pages", pages,
                  "--max-inbound-conns", maxin,     NULL};
  proc peer, cpeer;
  kvpool pool, cpool;
  kvf_manager *m = NULL, *cm = NULL;
  char cbaddr[KVF_ADDR_MAX + 1];
  pid_t mp = getpid(); /* the measured process: this one (reverse) or the prefill */
  int st = peers_start_prefill(&peer, argv, baddr, "prefill");
  if (st < 0) goto out_children;
  if (st) goto out_peer;
  if (!run->reverse) mp = peer.pid;
  /* The control pair's prefill (prefill view); the decode view's control
   * is a second manager here, with the same prefill. */
  if (!run->reverse && (st = peers_start_prefill(&cpeer, argv, cbaddr, "control prefill")) < 0) goto out_peer;
  if (st) goto out_cpeer;
  usleep(200000);
  if (proc_usage_get(mp, &run->start)) goto out_cpeer;
  if (kvpool_init(&pool, PEERS_LAYERS, PEERS_DECODE_PAGES, PEERS_ITEM)) goto out_cpeer;
  kvf_manager_config mc;
  kvf_manager_config_init(&mc);
  mc.role = KVF_ROLE_DECODE;
  kvf_engine_config ec; /* measured (reverse): each idle prefill's connections are accepted ones */
  kvf_engine_config_init(&ec);
  ec.max_inbound_conns = run->max_inbound;
  mc.engine_cfg = &ec;
  if (kvf_manager_create(&mc, &pool.bufs, &m)) goto out_pool;
  if (run->reverse && kvpool_init(&cpool, PEERS_LAYERS, PEERS_DECODE_PAGES, PEERS_ITEM)) goto out_mgr;
  if (run->reverse && kvf_manager_create(&mc, &cpool.bufs, &cm)) goto out_cpool;
  peers_pair meas = {m, &pool, &peer, baddr};
  peers_pair ctl = run->reverse ? (peers_pair){cm, &cpool, &peer, baddr} : (peers_pair){m, &pool, &cpeer, cbaddr};
  int64_t base = 1;
  rooms_case warm = {.name = "warmup", .pages = 1, .inflight = 8, .rooms = quick ? 1000 : 3000};
  rooms_case cwarm = warm;
  if (peers_case(&meas, &warm, &base) || peers_case(&ctl, &cwarm, &base)) goto out_cmgr;
  usleep(300000);
  peers_idle(mp, children, 0, &run->base_cpu_pct, &run->base_wakeups_per_s, NULL);
  if (proc_usage_get(mp, &run->base)) goto out_cmgr;
  /* The same base once the idle close has run (the active pair's sockets,
   * and the heap trimmed after them), for the figures after it. */
  double idle_s = peers_idle_close_s();
  if (idle_s > 0) {
    run->closed_wait_s = idle_s + 2.5; /* the sweep runs once a second */
    usleep((useconds_t)(run->closed_wait_s * 1e6));
    if (proc_usage_get(mp, &run->base)) goto out_cmgr; /* the heap was trimmed in between */
  }
  peers_census(mp, &run->thr0, &run->fd0);
  int64_t idle_room = 1000000000; /* the idle peers' rooms, apart from the measured ones */
  for (int i = 0; i < nwant; i++) {
    peers_step *s = &run->steps[run->nsteps++];
    s->peers = want[i];
    int bad = peers_add(run, children, &nchildren, &have, want[i], &peer, baddr, m, &pool, &idle_room, s->error,
                        sizeof s->error);
    s->connected = have;
    if (!bad) {
      usleep(300000); /* the connections' threads settle */
      peers_idle(mp, children, nchildren, &s->idle_cpu_pct, &s->idle_wakeups_per_s, &s->peers_cpu_pct);
      if (proc_usage_get(mp, &s->u)) snprintf(s->error, sizeof s->error, "the measured process is gone");
    }
    if (bad || s->error[0]) {
      fprintf(stderr, "bench peers: %s%s, %d idle peers: %s\n", run->transport, run->reverse ? " (reverse)" : "",
              want[i], s->error);
      break;
    }
    peers_census(mp, &run->thr1, &run->fd1);
    run->census = 1;
    /* A round of each pair not counted first: the first one after the idle
     * window runs at a third of the rate for a second or two on both
     * transports and at any N (issue 22), and how many of the counted rounds
     * it took with it decided the ratio more than the idle peers did. Then
     * PEERS_REPS rounds of each pair: the best rates (other tenants only ever
     * slow a round down), the median ratio to the control and the median
     * round's latencies. */
    rooms_case warm_up = {.name = "warmup", .pages = 1, .inflight = 64, .rooms = quick ? 300 : PEERS_WARM_ROOMS};
    rooms_case cwarm_up = warm_up;
    if (peers_case(&meas, &warm_up, &base) || peers_case(&ctl, &cwarm_up, &base)) {
      snprintf(s->error, sizeof s->error, "rooms failed at 64 in flight (warm-up)");
      break;
    }
    s->warm_rate = warm_up.rooms_per_s;
    if (peers_rounds(s, &meas, &ctl, quick, &base)) break;
  }
  /* Long idle: the idle close of the control sockets (both ends of every
   * pair, this decode's with the prefill too) has run everywhere. */
  if (run->nsteps && !run->steps[run->nsteps - 1].error[0] && idle_s > 0) {
    usleep((useconds_t)(run->closed_wait_s * 1e6));
    if (!proc_usage_get(mp, &run->closed)) run->closed_peers = run->steps[run->nsteps - 1].connected;
  }
  rc = 0;
  /* The path as JSON members, captured for the report printed later. */
  char *buf = NULL;
  size_t len = 0;
  FILE *mem = open_memstream(&buf, &len);
  if (mem) {
    cli_bench_path(mem, m, 1);
    fclose(mem);
    snprintf(run->path, sizeof run->path, "%s", buf ? buf : "");
    free(buf);
  }
out_cmgr:
  kvf_manager_destroy(cm);
out_cpool:
  if (run->reverse) kvpool_free(&cpool);
out_mgr:
  kvf_manager_destroy(m);
out_pool:
  kvpool_free(&pool);
out_cpeer:
  for (int i = 0; i < nchildren; i++) proc_stop(&children[i], 10000); /* none start before both prefills */
  nchildren = 0;
  if (!run->reverse) proc_stop(&cpeer, 10000);
out_peer:
  proc_stop(&peer, 10000);
out_children:
  for (int i = 0; i < nchildren; i++) proc_stop(&children[i], 10000);
  free(children);
  return rc;
}

static double per_peer(long v, long base, int n) { return n ? (double)(v - base) / n : 0; }

/* RSS per peer as /proc/PID/status splits it: private, shared memory, files. */
typedef struct rss_split {
  double anon, shmem, file;
} rss_split;

static rss_split split_per_peer(const proc_usage *u, const proc_usage *base, int n) {
  return (rss_split){per_peer(u->rss_anon_kb, base->rss_anon_kb, n),
                     per_peer(u->rss_shmem_kb, base->rss_shmem_kb, n),
                     per_peer(u->rss_file_kb, base->rss_file_kb, n)};
}

static void peers_print_growth(const name_counts *a, const name_counts *b, int json, const char *key) {
  int first = 1;
  if (json) printf(",\"%s\":{", key);
  for (int i = 0; i < b->n; i++) {
    long d = b->count[i] - counts_of(a, b->name[i]);
    if (!d) continue;
    if (json) printf("%s\"%s\":%ld", first ? "" : ",", b->name[i], d);
    else printf("%s%s %+ld", first ? "" : ", ", b->name[i], d);
    first = 0;
  }
  for (int i = 0; i < a->n; i++)
    if (!counts_of(b, a->name[i])) {
      if (json) printf("%s\"%s\":%ld", first ? "" : ",", a->name[i], -a->count[i]);
      else printf("%s%s %+ld", first ? "" : ", ", a->name[i], -a->count[i]);
      first = 0;
    }
  if (json) printf("}");
  else printf("%s\n", first ? "(none)" : "");
}

static void peers_print(const peers_run *runs, int nruns, const char *auto_picks, int json) {
  if (json) {
    printf("{\"bench\":\"peers\",\"auto_picks\":\"%s\",\"targets\":{\"threads_per_peer_max\":%.0f,"
           "\"rss_kib_per_peer_max\":%.0f,\"rate_over_1peer_min\":%.1f,\"rate_over_1peer_controlled_min\":%.1f},"
           "\"runs\":[",
           auto_picks, TARGET_THREADS_PER_PEER, TARGET_RSS_KIB_PER_PEER, TARGET_RATE_RATIO, TARGET_RATE_RATIO);
    for (int r = 0; r < nruns; r++) {
      const peers_run *run = &runs[r];
      printf("%s{", r ? "," : "");
      if (*run->path) printf("%s", run->path + 1); /* its members without the leading comma */
      else printf("\"transport\":\"%s\"", run->transport);
      printf(",\"view\":\"%s\",\"measured_max_inbound_conns\":%d,"
             "\"idle_instance\":{\"rss_kib\":%.0f,\"threads\":%.2f,\"fds\":%.2f},"
             "\"measured_start\":{\"threads\":%ld,\"fds\":%ld,\"rss_kib\":%ld},"
             "\"measured_base\":{\"threads\":%ld,\"fds\":%ld,\"rss_kib\":%ld,\"idle_cpu_pct\":%.1f,"
             "\"idle_wakeups_per_s\":%.0f},\"cases\":[",
             run->reverse ? "decode_with_idle_prefills" : "prefill_with_idle_decodes", run->max_inbound,
             run->mgr_rss_kib, run->mgr_threads, run->mgr_fds, run->start.threads, run->start.fds,
             run->start.rss_kb, run->base.threads, run->base.fds, run->base.rss_kb, run->base_cpu_pct,
             run->base_wakeups_per_s);
      double rate1 = run->nsteps ? run->steps[0].rooms_per_s : 0;
      double ctl1 = run->nsteps ? run->steps[0].rate_over_ctl : 0;
      for (int i = 0; i < run->nsteps; i++) {
        const peers_step *s = &run->steps[i];
        printf("%s{\"peers\":%d,\"connected\":%d,", i ? "," : "", s->peers, s->connected);
        if (s->error[0]) {
          printf("\"error\":\"%s\"}", s->error);
          continue;
        }
        rss_split sp = split_per_peer(&s->u, &run->base, s->peers);
        printf("\"threads\":%ld,\"fds\":%ld,\"rss_kib\":%ld,\"threads_per_peer\":%.2f,\"fds_per_peer\":%.2f,"
               "\"rss_kib_per_peer\":%.1f,\"rooms_per_s\":%.0f,\"p50_us\":%.1f,\"p99_us\":%.1f,"
               "\"rate_over_1peer\":%.3f,\"control_rooms_per_s\":%.0f,\"rate_over_control\":%.3f,"
               "\"rate_over_1peer_controlled\":%.3f,\"idle_cpu_pct\":%.1f,\"idle_wakeups_per_s\":%.0f,"
               "\"idle_wakeups_per_s_per_peer\":%.2f,\"idle_peers_cpu_pct\":%.1f,"
               "\"rss_split_kib_per_peer\":{\"anon\":%.1f,\"shmem\":%.1f,\"file\":%.1f},\"rooms_per_s_runs\":[",
               s->u.threads, s->u.fds, s->u.rss_kb, per_peer(s->u.threads, run->base.threads, s->peers),
               per_peer(s->u.fds, run->base.fds, s->peers), per_peer(s->u.rss_kb, run->base.rss_kb, s->peers),
               s->rooms_per_s, s->p50_us, s->p99_us, rate1 > 0 ? s->rooms_per_s / rate1 : 0, s->ctl_rooms_per_s,
               s->rate_over_ctl, ctl1 > 0 ? s->rate_over_ctl / ctl1 : 0, s->idle_cpu_pct, s->idle_wakeups_per_s,
               (s->idle_wakeups_per_s - run->base_wakeups_per_s) / s->peers, s->peers_cpu_pct, sp.anon, sp.shmem,
               sp.file);
        for (int k = 0; k < s->nruns; k++) printf("%s%.0f", k ? "," : "", s->rate_runs[k]);
        printf("],\"control_rooms_per_s_runs\":[");
        for (int k = 0; k < s->nruns; k++) printf("%s%.0f", k ? "," : "", s->ctl_runs[k]);
        printf("],\"warmup_rooms_per_s\":%.0f,\"error\":null}", s->warm_rate);
      }
      printf("]");
      if (run->closed_peers) {
        const proc_usage *c = &run->closed, *b = &run->base;
        int n = run->closed_peers;
        rss_split sp = split_per_peer(c, b, n);
        printf(",\"after_idle_close\":{\"peers\":%d,\"waited_s\":%.1f,\"base_fds\":%ld,\"base_rss_kib\":%ld,"
               "\"threads\":%ld,\"fds\":%ld,\"rss_kib\":%ld,"
               "\"fds_per_peer\":%.2f,\"rss_kib_per_peer\":%.1f,"
               "\"rss_split_kib_per_peer\":{\"anon\":%.1f,\"shmem\":%.1f,\"file\":%.1f}}",
               n, run->closed_wait_s, b->fds, b->rss_kb, c->threads, c->fds, c->rss_kb,
               per_peer(c->fds, b->fds, n), per_peer(c->rss_kb, b->rss_kb, n), sp.anon, sp.shmem, sp.file);
      }
      if (run->census) {
        peers_print_growth(&run->thr0, &run->thr1, 1, "thread_growth");
        peers_print_growth(&run->fd0, &run->fd1, 1, "fd_growth");
      }
      printf("}");
    }
    printf("]}\n");
    return;
  }
  printf("one prefill rank (kv-peer, hosting the bootstrap server) with N idle decode peers, and the reverse:\n"
         "one decode rank with N idle prefill peers (TP 1 each, one room done, still connected), and one active\n"
         "pair measured beside them, with a control pair (no idle peer) whose rounds alternate with theirs;\n"
         "rate/1peer: rooms/s at N over rooms/s at 1; ctl: the measured round over the control round beside it\n"
         "(median); ctl/1peer: that at N over that at 1. `auto` picks %s here\n"
         "targets (issue 24, not asserted): threads/peer <= %.0f, RSS/peer <= %.0f KiB, rate_over_1peer >= %.1f\n",
         auto_picks, TARGET_THREADS_PER_PEER, TARGET_RSS_KIB_PER_PEER, TARGET_RATE_RATIO);
  for (int r = 0; r < nruns; r++) {
    const peers_run *run = &runs[r];
    printf("\n== %s: %s ==  (its max_inbound_conns %d)\n", run->transport,
           run->reverse ? "a decode rank (this process) with N idle prefill peers"
                        : "a prefill rank (kv-peer) with N idle decode peers",
           run->max_inbound);
    printf("measured process at start: %ld threads, %ld fds, %ld KiB; after the active decode's warm-up (base): "
           "%ld, %ld, "
           "%ld KiB\n",
           run->start.threads, run->start.fds, run->start.rss_kb, run->base.threads, run->base.fds,
           run->base.rss_kb);
    printf("measured process idle (no room live, %.0f s) at base: %.1f%% of a core, %.0f wake-ups/s\n",
           PEERS_IDLE_S, run->base_cpu_pct, run->base_wakeups_per_s);
    printf("one idle peer instance costs its kv-idle process %.0f KiB, %.2f threads, %.2f fds\n", run->mgr_rss_kib,
           run->mgr_threads, run->mgr_fds);
    printf("%6s %8s %6s %9s %8s %7s %8s %9s %9s %8s %9s %10s %6s %9s %8s %9s %9s\n", "peers", "threads", "fds",
           "rss KiB", "thr/peer", "fd/peer", "KiB/peer", "rooms/s", "ctl r/s", "p50 us", "p99 us", "rate/1peer",
           "ctl", "ctl/1peer", "idle cpu", "wakeups/s", "peers cpu");
    double rate1 = run->nsteps ? run->steps[0].rooms_per_s : 0;
    double ctl1 = run->nsteps ? run->steps[0].rate_over_ctl : 0;
    for (int i = 0; i < run->nsteps; i++) {
      const peers_step *s = &run->steps[i];
      if (s->error[0]) {
        printf("%6d  FAILED (%d connected): %s\n", s->peers, s->connected, s->error);
        continue;
      }
      printf("%6d %8ld %6ld %9ld %8.2f %7.2f %8.1f %9.0f %9.0f %8.1f %9.1f %10.3f %6.3f %9.3f %7.1f%% %9.0f "
             "%8.1f%%\n",
             s->peers, s->u.threads, s->u.fds, s->u.rss_kb, per_peer(s->u.threads, run->base.threads, s->peers),
             per_peer(s->u.fds, run->base.fds, s->peers), per_peer(s->u.rss_kb, run->base.rss_kb, s->peers),
             s->rooms_per_s, s->ctl_rooms_per_s, s->p50_us, s->p99_us, rate1 > 0 ? s->rooms_per_s / rate1 : 0,
             s->rate_over_ctl, ctl1 > 0 ? s->rate_over_ctl / ctl1 : 0, s->idle_cpu_pct, s->idle_wakeups_per_s,
             s->peers_cpu_pct);
    }
    for (int i = 0; i < run->nsteps; i++) {
      const peers_step *s = &run->steps[i];
      if (s->error[0]) continue;
      rss_split sp = split_per_peer(&s->u, &run->base, s->peers);
      printf("%s%d peers: %.1f private (RssAnon) + %.1f shared memory (RssShmem) + %.1f files",
             i ? "; " : "KiB/peer split: ", s->peers, sp.anon, sp.shmem, sp.file);
    }
    printf("\n");
    if (run->closed_peers) {
      const proc_usage *c = &run->closed, *b = &run->base;
      int n = run->closed_peers;
      rss_split sp = split_per_peer(c, b, n);
      printf("after %.1f s idle (control sockets closed, KVFERRY_CONTROL_IDLE_S), %d peers: %ld fds, %ld KiB: "
             "%.2f fd/peer, %.1f KiB/peer = %.1f private + %.1f shared memory + %.1f files\n",
             run->closed_wait_s, n, c->fds, c->rss_kb, per_peer(c->fds, b->fds, n),
             per_peer(c->rss_kb, b->rss_kb, n), sp.anon, sp.shmem, sp.file);
    }
    if (!run->census) continue;
    printf("threads grown (by name) from base to the last step: ");
    peers_print_growth(&run->thr0, &run->thr1, 0, NULL);
    printf("descriptors grown (by kind): ");
    peers_print_growth(&run->fd0, &run->fd1, 0, NULL);
  }
}

int cli_bench_peers(const peers_opts *o) {
  int want[PEERS_STEPS];
  int nwant = peers_parse(o->peers ? o->peers : o->quick ? "1,8" : "1,8,64,256", want, PEERS_STEPS);
  if (nwant < 1) {
    fprintf(stderr, "bench peers: --peers wants ascending counts 1..%d, comma-separated, at most %d\n", PEERS_MAX,
            PEERS_STEPS);
    return 2;
  }
  const char *saved = getenv("KVFERRY_TRANSPORT");
  char saved_buf[16] = "";
  if (saved) snprintf(saved_buf, sizeof saved_buf, "%s", saved);
  /* What `auto` resolves to: the engine an auto configuration builds. */
  const char *auto_picks = strstr(kvf_engine_transports(), "ucx") ? "ucx" : "tcp";
  const char *list[2];
  int nruns = 0;
  if (o->transport && strcmp(o->transport, "auto")) list[nruns++] = o->transport;
  else if (o->transport) list[nruns++] = auto_picks;
  else {
    list[nruns++] = "tcp";
    if (!strcmp(auto_picks, "ucx")) list[nruns++] = "ucx";
  }
  peers_run *runs = calloc((size_t)nruns * 2, sizeof *runs);
  if (!runs) return 1;
  for (int r = nruns - 1; r >= 0; r--) { /* each transport: the prefill's view, then the decode's */
    runs[2 * r].transport = runs[2 * r + 1].transport = list[r];
    runs[2 * r + 1].reverse = 1;
  }
  nruns *= 2;
  int rc = 0;
  for (int r = 0; r < nruns; r++) {
    rc |= peers_run_one(&runs[r], want, nwant, o->quick);
    for (int i = 0; i < runs[r].nsteps; i++) rc |= runs[r].steps[i].error[0] != 0;
  }
  if (*saved_buf) setenv("KVFERRY_TRANSPORT", saved_buf, 1);
  else unsetenv("KVFERRY_TRANSPORT");
  peers_print(runs, nruns, auto_picks, o->json);
  free(runs);
  return rc ? 1 : 0;
}

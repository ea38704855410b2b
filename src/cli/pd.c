/* A prefill/decode pair of processes and its requests (see pd.h). */
#include "pd.h"

#include <math.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "kvferry.h"

/* The bootstrap server is kvferry's own command; the prefill and decode
 * instances are the test peer's (proc_testpeer_exe). */
static const char *cli_exe(void) {
  const char *exe = getenv("KVFERRY_CLI");
  return exe && *exe ? exe : proc_self_exe();
}

int pd_start(pd_pair *pp, int layers, uint64_t item, uint64_t pages, char *err, size_t cap) {
  pd_layout lo = {.layers = layers, .item = item, .pages = pages, .prefill_tp = 1, .decode_tp = 1};
  return pd_start_layout(pp, &lo, err, cap);
}

const char pd_model_names[] = "llama-3.1-8b, qwen3-32b, deepseek-v3";

/* From the models' configs. */
static const pd_model models[] = {
    {"llama-3.1-8b", 32, 8, 128, 2, 16, 0},
    {"qwen3-32b", 64, 8, 128, 2, 16, 0},
    {"deepseek-v3", 61, 1, 576, 2, 16, 1},
};

const pd_model *pd_model_find(const char *name) {
  for (size_t i = 0; i < sizeof models / sizeof models[0]; i++)
    if (!strcmp(models[i].name, name)) return &models[i];
  return NULL;
}

int pd_demo_opt(pd_demo_opts *o, int c, const char *arg) {
  char *end;
  switch (c) {
    case 'm': o->model = arg; return 1;
    case 't': o->transport = arg; return 1;
    case 'S':
      if (cli_parse_size(arg, &o->seed)) o->seed = 0;
      return 1;
    case 'T':
      if (cli_parse_size(arg, &o->max_tokens)) o->max_tokens = 0;
      o->set_max = 1;
      return 1;
    case 'g':
      o->pool_gib = strtod(arg, &end);
      if (*end || !(o->pool_gib > 0)) o->pool_gib = -1;
      o->set_pool = 1;
      return 1;
    default: return 0;
  }
}

uint64_t pd_model_layout(const pd_model *md, int prefill_tp, int decode_tp, pd_layout *lo) {
  /* One head of one token; each rank's pages hold its heads, token-major.
   * MLA: the whole latent of one token, one buffer per layer. */
  const uint64_t unit = (uint64_t)md->head_dim * md->dtype_bytes;
  const uint64_t item = (uint64_t)md->page_tokens * md->kv_heads * unit;
  *lo = (pd_layout){.layers = md->layers,
                    .item = item,
                    .prefill_tp = prefill_tp,
                    .decode_tp = decode_tp,
                    .page_size = md->page_tokens,
                    .kv_heads = md->mla ? 0 : md->kv_heads,
                    .mla = md->mla,
                    .unit = unit};
  return item * (uint64_t)(md->mla ? md->layers : 2 * md->layers);
}

size_t pd_draw_tokens(uint64_t *rng, uint64_t max) {
  double u = (cli_rng_next(rng) >> 11) * (1.0 / 9007199254740992.0);
  size_t t = (size_t)exp(log(128.0) + u * (log((double)max) - log(128.0)));
  return t < 128 ? 128 : t > max ? (size_t)max : t;
}

int pd_cmp_dbl(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

void pd_argv_init(pd_argv *a, char *const *pre) {
  a->n = 0;
  a->used = 0;
  a->overflow = 0;
  a->v[0] = NULL;
  for (int i = 0; pre && pre[i]; i++) pd_argv_add(a, "%s", pre[i]);
}

void pd_argv_add(pd_argv *a, const char *fmt, ...) {
  size_t room = sizeof a->store - a->used;
  if (a->overflow) return;
  va_list ap;
  va_start(ap, fmt);
  int k = a->n + 1 >= (int)(sizeof a->v / sizeof a->v[0]) || room < 2
              ? -1
              : vsnprintf(a->store + a->used, room, fmt, ap);
  va_end(ap);
  if (k < 0 || (size_t)k >= room) { /* too long: the command fails to start */
    a->overflow = 1;
    a->n = 0;
    a->v[0] = NULL;
    return;
  }
  a->v[a->n++] = a->store + a->used;
  a->v[a->n] = NULL;
  a->used += (size_t)k + 1;
}

void pd_peer_argv(pd_argv *a, char *const *pre, const pd_layout *lo, int decode, const char *baddr) {
  const int tp = decode ? lo->decode_tp : lo->prefill_tp;
  pd_argv_init(a, pre);
  pd_argv_add(a, "%s", proc_testpeer_exe());
  pd_argv_add(a, "%s", decode ? "kv-decode" : "kv-peer");
  if (baddr) pd_argv_add(a, "--bootstrap"), pd_argv_add(a, "%s", baddr);
  pd_argv_add(a, "--layers"), pd_argv_add(a, "%d", lo->layers);
  pd_argv_add(a, "--item"), pd_argv_add(a, "%llu", (unsigned long long)lo->item);
  pd_argv_add(a, "--pages"), pd_argv_add(a, "%llu", (unsigned long long)lo->pages);
  pd_argv_add(a, "--world"), pd_argv_add(a, "%d", tp);
  if (lo->mla || lo->kv_heads) {
    pd_argv_add(a, "--page-size"), pd_argv_add(a, "%d", lo->page_size);
    pd_argv_add(a, "--unit"), pd_argv_add(a, "%llu", (unsigned long long)lo->unit);
  }
  if (lo->mla) {
    pd_argv_add(a, "%s", decode && lo->mla == 2 ? "--mla-legacy" : "--mla");
  } else if (lo->kv_heads) {
    pd_argv_add(a, "--heads"), pd_argv_add(a, "%d", lo->kv_heads / tp);
    if (!decode) pd_argv_add(a, "--kv-heads"), pd_argv_add(a, "%d", lo->kv_heads);
  }
}

int pd_boot_start(proc *boot, char *const *pre, const char *host, char *baddr, char *err, size_t cap) {
  pd_argv a;
  char line[400];
  pd_argv_init(&a, pre);
  pd_argv_add(&a, "%s", cli_exe());
  pd_argv_add(&a, "bootstrap"), pd_argv_add(&a, "--port"), pd_argv_add(&a, "0");
  pd_argv_add(&a, "--host"), pd_argv_add(&a, "%s", host);
  if (proc_start(boot, a.v)) {
    snprintf(err, cap, "cannot start %s bootstrap", cli_exe());
    return -1;
  }
  if (proc_read_line(boot, line, sizeof line, 10000) ||
      sscanf(line, "kvferry bootstrap listening on " CLI_ADDR_SCAN, baddr) != 1) {
    snprintf(err, cap, "the bootstrap server did not start on %s", host);
    pd_boot_stop(boot);
    return -1;
  }
  return 0;
}

void pd_boot_stop(proc *boot) {
  kill(boot->pid, SIGTERM);
  proc_stop(boot, 5000);
}

int pd_wait_ready(proc *p, int timeout_ms) {
  char line[400];
  return proc_read_line(p, line, sizeof line, timeout_ms) || strncmp(line, "ready ", 6) ? -1 : 0;
}

int pd_start_layout(pd_pair *pp, const pd_layout *lo, char *err, size_t cap) {
  memset(pp, 0, sizeof *pp);
  if (pd_boot_start(&pp->boot, NULL, "127.0.0.1", pp->baddr, err, cap)) return -1;
  pp->up = 1;
  pd_argv pa, da;
  pd_peer_argv(&pa, NULL, lo, 0, pp->baddr);
  pd_peer_argv(&da, NULL, lo, 1, pp->baddr);
  const int nbuf = lo->mla ? lo->layers : 2 * lo->layers;
  /* Both fault in their pools at start: let them do it at the same time. */
  if (proc_start(&pp->prefill, pa.v)) {
    snprintf(err, cap, "cannot start the prefill process");
    goto err;
  }
  pp->up |= 2;
  if (proc_start(&pp->decode, da.v)) {
    snprintf(err, cap, "cannot start the decode process");
    goto err;
  }
  pp->up |= 4;
  if (pd_wait_ready(&pp->prefill, 60000)) {
    snprintf(err, cap, "the prefill process did not start (pool of %llu pages x %d buffers)",
             (unsigned long long)lo->pages, nbuf);
    goto err;
  }
  if (pd_wait_ready(&pp->decode, 60000)) {
    snprintf(err, cap, "the decode process did not start (pool of %llu pages x %d buffers)",
             (unsigned long long)lo->pages, nbuf);
    goto err;
  }
  return 0;
err:
  pd_stop(pp);
  return -1;
}

/* Idle: under PD_SETTLE_BUSY_NS of CPU over PD_SETTLE_WINDOW_MS (5 % of a
 * core), waited for at most PD_SETTLE_MAX_MS. */
#define PD_SETTLE_WINDOW_MS 100
#define PD_SETTLE_BUSY_NS 5000000LL
#define PD_SETTLE_MAX_MS 5000

void pd_settle(pd_pair *pp) {
  pid_t pid[2] = {pp->up & 2 ? pp->prefill.pid : 0, pp->up & 4 ? pp->decode.pid : 0};
  long long was[2];
  for (int i = 0; i < 2; i++) was[i] = pid[i] > 0 ? proc_cpu_exact_ns(pid[i]) : -1;
  for (double until = cli_now_s() + PD_SETTLE_MAX_MS / 1e3; cli_now_s() < until;) {
    usleep(PD_SETTLE_WINDOW_MS * 1000);
    int busy = 0;
    for (int i = 0; i < 2; i++) {
      long long now = was[i] >= 0 ? proc_cpu_exact_ns(pid[i]) : -1;
      busy |= now >= 0 && now - was[i] >= PD_SETTLE_BUSY_NS;
      was[i] = now;
    }
    if (!busy) return;
  }
}

void pd_stop(pd_pair *pp) {
  if (pp->up & 4) proc_stop(&pp->decode, 10000);
  if (pp->up & 2) proc_stop(&pp->prefill, 10000);
  if (pp->up & 1) pd_boot_stop(&pp->boot);
  pp->up = 0;
}

int pd_issue(pd_pair *pp, const pd_req *r) {
  return pd_issue_decode(&pp->decode, r, NULL) || pd_issue_prefill(&pp->prefill, r) ? -1 : 0;
}

int pd_issue_decode(proc *decode, const pd_req *r, const char *baddr) {
  const char *how = r->corrupt == 2 ? " corrupt-landed" : r->corrupt ? " corrupt" : baddr ? " -" : "";
  if (fprintf(decode->in, "recv %lld %zu %llu %lld%s%s%s\n", (long long)r->room, r->npages,
              (unsigned long long)r->seed, (long long)r->token, how, baddr ? " " : "", baddr ? baddr : "") < 0 ||
      fflush(decode->in))
    return -1;
  return 0;
}

int pd_issue_prefill(proc *prefill, const pd_req *r) {
  if (fprintf(prefill->in, "send %lld %zu %llu %lld %zu 0 %d %d\n", (long long)r->room, r->npages,
              (unsigned long long)r->seed, (long long)r->token, r->chunk, r->reuse_early, r->wait_m2) < 0 ||
      fflush(prefill->in))
    return -1;
  return 0;
}

/* The first reason wins, except that a prefill told of the failure by the
 * decode (its notice, or a write its fence refused) only echoes it: the
 * decode's own reason then replaces it. */
static void set_reason(pd_req *r, const char *side, const char *why) {
  int echo = strstr(r->reason, " failed the room: ") || strstr(r->reason, "The decode fenced room ");
  int replace = !*r->reason || (!strcmp(side, "decode") && echo);
  if (replace && why && *why && strcmp(why, "-")) snprintf(r->reason, sizeof r->reason, "%s: %.240s", side, why);
}

static long long max_ll(long long a, long long b) { return a > b ? a : b; }

int pd_drain(proc *p, int is_decode, pd_req *reqs, size_t n, int64_t room_base) {
  char line[600];
  int done = 0;
  while (proc_read_line(p, line, sizeof line, 0) == 0) {
    long long room, a, b, c;
    int st, off = 0;
    if (is_decode ? sscanf(line, "done %lld %d %lld %lld %lld %n", &room, &st, &a, &b, &c, &off) < 5
                  : sscanf(line, "done %lld %d %lld %n", &room, &st, &a, &off) < 3)
      continue;
    const char *why = off ? line + off : ""; /* the reason is the rest of the line */
    if (room < room_base || room - room_base >= (long long)n) continue;
    pd_req *r = &reqs[room - room_base];
    int was = r->prefill_done && r->decode_done;
    if (is_decode) {
      r->decode_status = r->decode_reports && r->decode_status < st ? r->decode_status : st;
      r->bad_pages += (size_t)a;
      r->t_init_ns = max_ll(r->t_init_ns, b);
      r->t_final_ns = max_ll(r->t_final_ns, c);
      r->decode_done = ++r->decode_reports >= (r->decode_procs > 0 ? r->decode_procs : 1);
      set_reason(r, "decode", why);
    } else {
      r->prefill_status = r->prefill_reports && r->prefill_status < st ? r->prefill_status : st;
      /* The earliest report: the KV is ready on every rank once one has it
       * (kv_peer.c, start_senders). */
      r->t_send_ns = r->prefill_reports && r->t_send_ns < a ? r->t_send_ns : a;
      r->prefill_done = ++r->prefill_reports >= (r->prefill_procs > 0 ? r->prefill_procs : 1);
      set_reason(r, "prefill", why);
    }
    done += !was && r->prefill_done && r->decode_done;
  }
  return done;
}

int pd_collect(pd_pair *pp, pd_req *reqs, size_t n, int64_t room_base, int timeout_ms) {
  long long until = cli_now_ms() + timeout_ms;
  for (;;) {
    int done = pd_drain(&pp->prefill, 0, reqs, n, room_base) + pd_drain(&pp->decode, 1, reqs, n, room_base);
    long long left = until - cli_now_ms();
    if (done || left <= 0) return done;
    struct pollfd pf[2] = {{.fd = pp->prefill.out_fd, .events = POLLIN},
                           {.fd = pp->decode.out_fd, .events = POLLIN}};
    if (poll(pf, 2, (int)left) < 0) continue;
    for (int i = 0; i < 2; i++)
      if ((pf[i].revents & (POLLHUP | POLLERR)) && !(pf[i].revents & POLLIN)) return -1;
  }
}

int pd_failed(const pd_req *r) {
  return r->prefill_status != KVF_POLL_SUCCESS || r->decode_status != KVF_POLL_SUCCESS || r->bad_pages ||
         *r->reason;
}

double pd_transfer_s(const pd_req *r) {
  long long t0 = r->t_init_ns > r->t_send_ns ? r->t_init_ns : r->t_send_ns;
  return r->t_final_ns > t0 ? (r->t_final_ns - t0) / 1e9 : 0;
}

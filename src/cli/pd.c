/* A prefill/decode pair of processes and its requests (see pd.h). */
#include "pd.h"

#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

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

int pd_start_layout(pd_pair *pp, const pd_layout *lo, char *err, size_t cap) {
  memset(pp, 0, sizeof *pp);
  char *exe = (char *)cli_exe(), *tp = (char *)proc_testpeer_exe(), line[400], l[16], it[32], pg[32];
  char pw[16], dw[16], ps[16], ph[16], dh[16], kh[16], un[32];
  snprintf(l, sizeof l, "%d", lo->layers);
  snprintf(it, sizeof it, "%llu", (unsigned long long)lo->item);
  snprintf(pg, sizeof pg, "%llu", (unsigned long long)lo->pages);
  snprintf(pw, sizeof pw, "%d", lo->prefill_tp);
  snprintf(dw, sizeof dw, "%d", lo->decode_tp);
  snprintf(ps, sizeof ps, "%d", lo->page_size);
  snprintf(ph, sizeof ph, "%d", lo->kv_heads ? lo->kv_heads / lo->prefill_tp : 0);
  snprintf(dh, sizeof dh, "%d", lo->kv_heads ? lo->kv_heads / lo->decode_tp : 0);
  snprintf(kh, sizeof kh, "%d", lo->kv_heads);
  snprintf(un, sizeof un, "%llu", (unsigned long long)lo->unit);
  char *bargv[] = {exe, "bootstrap", "--port", "0", "--host", "127.0.0.1", NULL};
  if (proc_start(&pp->boot, bargv)) {
    snprintf(err, cap, "cannot start %s bootstrap", exe);
    return -1;
  }
  pp->up = 1;
  if (proc_read_line(&pp->boot, line, sizeof line, 10000) ||
      sscanf(line, "kvferry bootstrap listening on " CLI_ADDR_SCAN, pp->baddr) != 1) {
    snprintf(err, cap, "the bootstrap server did not start");
    goto err;
  }
  char *pargv[24] = {tp,        "kv-peer", "--bootstrap", pp->baddr, "--layers", l, "--item", it,
                     "--pages", pg,        "--world",     pw,        NULL};
  char *dargv[24] = {tp,        "kv-decode", "--bootstrap", pp->baddr, "--layers", l, "--item", it,
                     "--pages", pg,          "--world",     dw,        NULL};
  if (lo->mla) {
    char *pa[] = {"--page-size", ps, "--unit", un, "--mla", NULL};
    char *da[] = {"--page-size", ps, "--unit", un, lo->mla == 2 ? "--mla-legacy" : "--mla", NULL};
    memcpy(pargv + 12, pa, sizeof pa);
    memcpy(dargv + 12, da, sizeof da);
  } else if (lo->kv_heads) {
    char *pa[] = {"--page-size", ps, "--heads", ph, "--kv-heads", kh, "--unit", un, NULL};
    char *da[] = {"--page-size", ps, "--heads", dh, "--unit", un, NULL};
    memcpy(pargv + 12, pa, sizeof pa);
    memcpy(dargv + 12, da, sizeof da);
  }
  const int nbuf = lo->mla ? lo->layers : 2 * lo->layers;
  /* Both fault in their pools at start: let them do it at the same time. */
  if (proc_start(&pp->prefill, pargv)) {
    snprintf(err, cap, "cannot start the prefill process");
    goto err;
  }
  pp->up |= 2;
  if (proc_start(&pp->decode, dargv)) {
    snprintf(err, cap, "cannot start the decode process");
    goto err;
  }
  pp->up |= 4;
  if (proc_read_line(&pp->prefill, line, sizeof line, 60000) || strncmp(line, "ready ", 6)) {
    snprintf(err, cap, "the prefill process did not start (pool of %s pages x %d buffers)", pg, nbuf);
    goto err;
  }
  if (proc_read_line(&pp->decode, line, sizeof line, 60000) || strncmp(line, "ready ", 6)) {
    snprintf(err, cap, "the decode process did not start (pool of %s pages x %d buffers)", pg, nbuf);
    goto err;
  }
  return 0;
err:
  pd_stop(pp);
  return -1;
}

void pd_stop(pd_pair *pp) {
  if (pp->up & 4) proc_stop(&pp->decode, 10000);
  if (pp->up & 2) proc_stop(&pp->prefill, 10000);
  if (pp->up & 1) {
    kill(pp->boot.pid, SIGTERM); /* it stops on a signal, not on EOF */
    proc_stop(&pp->boot, 5000);
  }
  pp->up = 0;
}

int pd_issue(pd_pair *pp, const pd_req *r) {
  if (fprintf(pp->decode.in, "recv %lld %zu %llu %lld%s\n", (long long)r->room, r->npages,
              (unsigned long long)r->seed, (long long)r->token,
              r->corrupt == 2 ? " corrupt-landed"
              : r->corrupt    ? " corrupt"
                              : "") < 0 ||
      fflush(pp->decode.in))
    return -1;
  if (fprintf(pp->prefill.in, "send %lld %zu %llu %lld %zu 0 %d %d\n", (long long)r->room, r->npages,
              (unsigned long long)r->seed, (long long)r->token, r->chunk, r->reuse_early, r->wait_m2) < 0 ||
      fflush(pp->prefill.in))
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

/* Take every line already available from one side; count completions. */
static int drain(proc *p, int is_decode, pd_req *reqs, size_t n, int64_t room_base) {
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
    if (is_decode) {
      r->decode_done = 1;
      r->decode_status = st;
      r->bad_pages = (size_t)a;
      r->t_init_ns = b;
      r->t_final_ns = c;
      set_reason(r, "decode", why);
    } else {
      r->prefill_done = 1;
      r->prefill_status = st;
      r->t_send_ns = a;
      set_reason(r, "prefill", why);
    }
    done += r->prefill_done && r->decode_done;
  }
  return done;
}

int pd_collect(pd_pair *pp, pd_req *reqs, size_t n, int64_t room_base, int timeout_ms) {
  long long until = cli_now_ms() + timeout_ms;
  for (;;) {
    int done = drain(&pp->prefill, 0, reqs, n, room_base) + drain(&pp->decode, 1, reqs, n, room_base);
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

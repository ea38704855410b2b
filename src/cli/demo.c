/* `kvferry demo`: the main job, end to end, with every byte checked. It
 * starts on 127.0.0.1 a bootstrap server, a prefill instance (`kvferry
 * kv-peer`) and a decode instance (`kvferry-testpeer kv-decode`) as separate
 * processes, with KV pools shaped like a real model's, then runs requests
 * whose prompt lengths spread log-uniformly over 128..8192 tokens: for each,
 * the decode takes pages and sends its M2, the prefill fills its pages with
 * the request's pattern and sends them, and the decode checks every byte,
 * the first token and the candidates. A progress bar runs on a terminal; a
 * summary table ends the run. Any failure or mismatch is reported with its
 * reason and the exit status is 1. `--corrupt` flips one byte of one landed
 * page on the decode side to show that the ordinary check catches it.
 * --verify turns on the library's verify mode (KVFERRY_VERIFY=1 in both
 * processes): with --corrupt the byte is then flipped inside the decode's
 * library right after landing and before its digest check, so the library
 * itself fails the room naming the buffer and page. The flip is done by the
 * decode process (kvferry-testpeer kv-decode, `corrupt-landed`) through the
 * testing library's hook: the kvferry command and libkvferry.so carry no
 * test hook. --reuse-early has the prefill overwrite a
 * source page right after its send call (a page reused before its transfer
 * completed); with --verify the library fails the room naming the page.
 * --prefill-tp P / --decode-tp D run P prefill ranks (in the kv-peer) and D
 * decode ranks (in the kv-decode), each holding its slice of the KV heads in
 * head-aware token-major pages: every (token, head) of every decode rank is
 * checked against the pattern of its global token and head, so a head slice
 * from the wrong prefill rank or token shows up (heterogeneous TP).
 * --model deepseek-v3 has an MLA latent cache: one buffer per layer holding
 * the 576-value latent (kv_lora_rank 512 + rope 64) of each token, the same
 * on every TP rank. Every prefill rank fills the same (token, layer)
 * pattern; the library's generic planner takes the latent as replicated when
 * the TP sizes differ (one prefill rank serves each decode rank) and as
 * identity when they are equal, and every decode rank checks the whole
 * latent of every token of every layer. */
#include <getopt.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "cli.h"
#include "kvferry.h"
#include "pd.h"

static void usage(FILE *f) {
  fprintf(f, "usage: kvferry demo [--model llama-3.1-8b|qwen3-32b|deepseek-v3] [--requests 32] [--inflight 2]\n"
             "                    [--max-tokens 8192] [--pool-gib G] [--prefill-tp 1] [--decode-tp 1]\n"
             "                    [--transport tcp|ucx|auto] [--seed S] [--corrupt] [--reuse-early] [--verify] "
             "[--short]\n"
             "Starts a bootstrap server, a prefill and a decode instance as processes on 127.0.0.1\n"
             "with model-shaped KV pools (--pool-gib per side; default: room for one request of\n--max-tokens, 1 "
             "GiB for llama-3.1-8b), moves the KV of --requests requests\n"
             "(prompts of 128..--max-tokens tokens, log-uniform) and verifies every byte.\n"
             "  --model    deepseek-v3: MLA, one 576-value latent buffer per layer, the same on every\n"
             "             TP rank (each decode rank checks the whole latent)\n"
             "  --prefill-tp/--decode-tp  TP ranks on each side; each divides the 8 KV heads\n"
             "             (deepseek-v3: any of 1..8)\n"
             "  --short    a few small requests (CI): 6 requests, up to 1024 tokens, 0.25 GiB pools\n"
             "  --corrupt  flip one byte of one landed page before the check: the demo must catch it\n"
             "             and exit 1 (with --verify: flipped after landing, before the library's check,\n"
             "             which fails the request naming the buffer and page; the decode test peer\n"
             "             does it through its testing library, libkvferry has no such hook)\n"
             "  --reuse-early  the prefill overwrites a source page of one request right after sending\n"
             "             it; with --verify the library fails that request naming the page\n"
             "  --verify   the library's verify mode (XXH3 digests of every page, checked on landing)\n"
             "Exit status: 0 all verified, 1 a failure or mismatch (the reason is printed), 2 usage.\n"
             "\n");
  cli_demo_cluster_usage(f);
}

static void progress(int done, int total, double bytes, double t0) {
  const int width = 30;
  int fill = total ? done * width / total : width;
  double dt = cli_now_s() - t0;
  fprintf(stderr, "\r  [");
  for (int i = 0; i < width; i++) fputc(i < fill ? '#' : '.', stderr);
  fprintf(stderr, "] %d/%d requests  %.2f GiB  %.2f GB/s ", done, total, bytes / (1u << 30),
          dt > 0 ? bytes / dt / 1e9 : 0.0);
  fflush(stderr);
}

int cli_demo(int argc, char **argv) {
  for (int i = 1; i < argc; i++)
    if (!strncmp(argv[i], "--cluster", 9) && (!argv[i][9] || argv[i][9] == '='))
      return cli_demo_cluster(argc, argv);
  /* pool_gib 0: room for one request of --max-tokens */
  pd_demo_opts o = {.model = "llama-3.1-8b", .seed = 1, .max_tokens = 8192};
  int requests = 32, inflight = 2, prefill_tp = 1, decode_tp = 1, corrupt = 0, is_short = 0, verify = 0,
      reuse_early = 0;
  int set_requests = 0, set_inflight = 0;
  static const struct option opts[] = {PD_DEMO_LONG_OPTS,
                                       {"requests", required_argument, 0, 'n'},
                                       {"inflight", required_argument, 0, 'k'},
                                       {"prefill-tp", required_argument, 0, 'P'},
                                       {"decode-tp", required_argument, 0, 'D'},
                                       {"corrupt", no_argument, 0, 'c'},
                                       {"verify", no_argument, 0, 'V'},
                                       {"reuse-early", no_argument, 0, 'R'},
                                       {"short", no_argument, 0, 's'},
                                       {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
  int c;
  while ((c = getopt_long(argc, argv, PD_DEMO_SHORT_OPTS "n:k:P:D:csVRh", opts, NULL)) != -1) {
    if (pd_demo_opt(&o, c, optarg)) continue;
    switch (c) {
      case 'n': requests = atoi(optarg), set_requests = 1; break;
      case 'k': inflight = atoi(optarg), set_inflight = 1; break;
      case 'P': prefill_tp = atoi(optarg); break;
      case 'D': decode_tp = atoi(optarg); break;
      case 'c': corrupt = 1; break;
      case 'V': verify = 1; break;
      case 'R': reuse_early = 1; break;
      case 's': is_short = 1; break;
      case 'h': usage(stdout); return 0;
      default: usage(stderr); return 2;
    }
  }
  if (optind < argc) {
    fprintf(stderr, "demo: unexpected argument '%s'\n", argv[optind]);
    return 2;
  }
  if (is_short) { /* explicit options still win */
    if (!set_requests) requests = 6;
    if (!set_inflight) inflight = 2;
    if (!o.set_max) o.max_tokens = 1024;
    if (!o.set_pool) o.pool_gib = 0.25;
  }
  unsigned long long seed = o.seed, max_tokens = o.max_tokens;
  double pool_gib = o.pool_gib;
  const pd_model *md = pd_model_find(o.model);
  if (!md) {
    fprintf(stderr, "demo: unknown model '%s' (%s)\n", o.model, pd_model_names);
    return 2;
  }
  if (md->mla && (prefill_tp < 1 || decode_tp < 1 || prefill_tp > 8 || decode_tp > 8)) {
    fprintf(stderr, "demo: --prefill-tp/--decode-tp must be 1..8 for %s\n", md->name);
    return 2;
  }
  if (!md->mla && (prefill_tp < 1 || decode_tp < 1 || md->kv_heads % prefill_tp || md->kv_heads % decode_tp)) {
    fprintf(stderr, "demo: --prefill-tp/--decode-tp must divide the %d KV heads of %s (1, 2, 4 or 8)\n",
            md->kv_heads, md->name);
    return 2;
  }
  if (o.transport && cli_set_transport("demo", o.transport)) return 2;
  if (requests < 1 || requests > 100000 || inflight < 1 || inflight > 512 || max_tokens < 128 ||
      max_tokens > (1u << 20) || pool_gib < 0 || pool_gib > 1024 || !seed) {
    fprintf(stderr, "demo: bad value (need requests >= 1, inflight 1..512, max-tokens 128..1M, pool-gib > 0, "
                    "seed > 0)\n");
    return 2;
  }

  pd_layout lo;
  const uint64_t page_bytes = pd_model_layout(md, prefill_tp, decode_tp, &lo); /* one page across every buffer */
  const int nbuf = md->mla ? md->layers : 2 * md->layers;
  /* Bytes landed per page: the MLA latent goes whole to every decode rank. */
  const uint64_t page_moved = page_bytes * (uint64_t)(md->mla ? decode_tp : 1);
  /* --inflight defaults to 2: on a 2-core machine more requests in flight
   * only make the pattern fill and check compete with the transfers. */
  /* Faulting in a pool costs about 2 s per GiB on these VMs, so the default
   * is the least that runs every request length: one longest request. */
  if (pool_gib == 0)
    pool_gib = (double)((max_tokens + md->page_tokens - 1) / md->page_tokens * page_bytes) / (1ull << 30);
  const uint64_t pool_pages = (uint64_t)(pool_gib * (1ull << 30)) / page_bytes;
  const uint64_t max_pages_fit = pool_pages;
  if (pool_pages < 8) {
    fprintf(stderr, "demo: --pool-gib %.3g holds only %llu pages of %s (%.1f MiB each); give it more\n", pool_gib,
            (unsigned long long)pool_pages, md->name, page_bytes / 1048576.0);
    return 2;
  }
  if ((max_tokens + md->page_tokens - 1) / md->page_tokens > max_pages_fit) {
    max_tokens = max_pages_fit * (uint64_t)md->page_tokens;
    if (max_tokens < 128) max_tokens = 128;
    fprintf(stderr, "demo: prompts capped at %llu tokens to fit the %.3g GiB pools\n", max_tokens, pool_gib);
  }

  pd_req *reqs = calloc((size_t)requests, sizeof *reqs);
  double *lat = calloc((size_t)requests, sizeof *lat), *rate = calloc((size_t)requests, sizeof *rate);
  size_t *tokens = calloc((size_t)requests, sizeof *tokens);
  int rc = 1;
  pd_pair pp;
  char err[256];
  if (!reqs || !lat || !rate || !tokens) {
    fprintf(stderr, "demo: out of memory\n");
    goto out_free;
  }
  /* Prompt lengths: log-uniform over 128..max_tokens, as chat and RAG
   * traffic spreads over orders of magnitude. */
  uint64_t rng = seed * 0x9e3779b97f4a7c15ULL + 1;
  const int64_t room_base = (int64_t)(seed % 1000000) * 1000000 + 1;
  for (int i = 0; i < requests; i++) {
    size_t t = tokens[i] = pd_draw_tokens(&rng, max_tokens);
    reqs[i] = (pd_req){.room = room_base + i,
                       .token = 1000 + i,
                       .seed = seed,
                       .npages = (t + (size_t)md->page_tokens - 1) / (size_t)md->page_tokens,
                       .corrupt = corrupt && i == requests / 2 ? (verify ? 2 : 1) : 0,
                       .reuse_early = reuse_early && i == requests / 2};
  }
  /* Both processes inherit the library's verify mode. */
  if (verify) setenv("KVFERRY_VERIFY", "1", 1);

  if (md->mla)
    printf("kvferry demo: %s, %d layers x MLA latent of %d values (kv_lora_rank 512 + rope 64), bf16, %d-token "
           "pages (%.1f KiB of KV per token)\n",
           md->name, md->layers, md->head_dim, md->page_tokens, page_bytes / md->page_tokens / 1024.0);
  else
    printf("kvferry demo: %s, %d layers x K,V, %d KV heads x %d, bf16, %d-token pages (%.0f KiB of KV per "
           "token)\n",
           md->name, md->layers, md->kv_heads, md->head_dim, md->page_tokens,
           page_bytes / md->page_tokens / 1024.0);
  printf("  pools: %llu pages (%llu tokens, %.2f GiB) per %s; up to %d requests in flight; transport %s\n",
         (unsigned long long)pool_pages, (unsigned long long)pool_pages * md->page_tokens,
         pool_pages * page_bytes / (double)(1ull << 30), md->mla ? "rank" : "side", inflight,
         getenv("KVFERRY_TRANSPORT") ? getenv("KVFERRY_TRANSPORT") : "auto");
  int ucx_route = cli_ucx_route();
  int pool_mem = !strcmp(cli_memory_kind(), "pool");
  printf("  memory: %s\n", pool_mem && ucx_route ? "pools from kvf_engine_alloc_pool (UCX maps them: rkey_ptr)"
                           : pool_mem  ? "pools from kvf_engine_alloc_pool (private, on transparent huge pages)"
                           : ucx_route ? "private memory registered with the engine (UCX reaches it through CMA)"
                                       : "private memory registered with the engine");
  if (md->mla)
    printf("  TP: prefill %d rank(s), decode %d rank(s), each with the whole latent (%s); every (token, layer) "
           "latent checked on every decode rank\n",
           prefill_tp, decode_tp, prefill_tp == decode_tp ? "identity" : "replicated");
  else
    printf("  TP: prefill %d rank(s) x %d KV heads, decode %d rank(s) x %d KV heads; every (token, head) "
           "checked\n",
           prefill_tp, md->kv_heads / prefill_tp, decode_tp, md->kv_heads / decode_tp);
  if (verify) printf("  verify mode: every page hashed (XXH3) when sent and checked on landing by the library\n");
  printf("  starting the bootstrap server, the prefill and the decode process (faulting in the pools)...\n");
  fflush(stdout);
  lo.pages = pool_pages;
  char tpath[64]; /* the room traces of both processes, for the breakdown at the end */
  cli_breakdown_env(tpath, sizeof tpath);
  int started = pd_start_layout(&pp, &lo, err, sizeof err);
  unsetenv("KVFERRY_TRACE");
  if (started) {
    fprintf(stderr, "demo: %s\n", err);
    if (*tpath) unlink(tpath);
    goto out_free;
  }
  printf("  processes: bootstrap %s, prefill (TP %d) pid %d, decode (TP %d) pid %d\n", pp.baddr, prefill_tp,
         (int)pp.prefill.pid, decode_tp, (int)pp.decode.pid);
  fflush(stdout);

  const int tty = isatty(STDERR_FILENO);
  int next = 0, running = 0, completed = 0, failures = 0;
  uint64_t free_pages = pool_pages;
  double moved = 0, t0 = cli_now_s(), last_progress = t0;
  char *accounted = calloc((size_t)requests, 1);
  const char *fatal = NULL;
  if (!accounted) {
    fatal = "out of memory";
    goto out_stop;
  }
  while (completed < requests) {
    /* Admit in order while both pools (sized alike) hold the next request. */
    while (next < requests && running < inflight && reqs[next].npages <= free_pages) {
      if (pd_issue(&pp, &reqs[next])) {
        fatal = "cannot talk to the prefill or decode process";
        goto out_stop;
      }
      free_pages -= reqs[next].npages;
      next++;
      running++;
    }
    int got = pd_collect(&pp, reqs, (size_t)requests, room_base, 200);
    if (got < 0) {
      fatal = "the prefill or decode process died";
      goto out_stop;
    }
    for (int i = 0; got && i < next; i++) {
      pd_req *r = &reqs[i];
      if (accounted[i] || !r->prefill_done || !r->decode_done) continue;
      accounted[i] = 1;
      completed++;
      running--;
      free_pages += r->npages;
      if (pd_failed(r)) {
        failures++;
        if (tty) fputc('\n', stderr);
        fprintf(stderr, "demo: request %d (%zu tokens, %zu pages): FAILED: %s%s", i, tokens[i], r->npages,
                r->bad_pages ? "MISMATCH, " : "", *r->reason ? r->reason : "failed without a reason");
        if (r->bad_pages)
          fprintf(stderr, " (%zu of %zu pages x buffers x decode ranks differ)", r->bad_pages,
                  r->npages * (size_t)nbuf * (size_t)decode_tp);
        fputc('\n', stderr);
        continue;
      }
      double bytes = (double)r->npages * (double)page_moved, dt = pd_transfer_s(r);
      moved += bytes;
      lat[completed - failures - 1] = dt;
      rate[completed - failures - 1] = dt > 0 ? bytes / dt / 1e9 : 0;
    }
    if (got) last_progress = cli_now_s();
    else if (cli_now_s() - last_progress > 120) {
      fatal = "no request finished in 120 s";
      goto out_stop;
    }
    if (tty) progress(completed, requests, moved, t0);
  }
  double wall = cli_now_s() - t0;
  if (tty) fputc('\n', stderr);
  int ok = completed - failures;
  qsort(lat, (size_t)ok, sizeof *lat, pd_cmp_dbl);
  qsort(rate, (size_t)ok, sizeof *rate, pd_cmp_dbl);
  unsigned long long ntok = 0;
  for (int i = 0; i < requests; i++) ntok += tokens[i];
  printf("\n  %-34s %d\n", "requests", requests);
  printf("  %-34s %llu (%zu..%zu per request)\n", "tokens", ntok, (size_t)128, (size_t)max_tokens);
  printf("  %-34s %.2f\n", "GiB moved and verified", moved / (1ull << 30));
  printf("  %-34s %.2f\n", "GB/s, whole run", wall > 0 ? moved / wall / 1e9 : 0.0);
  printf("  %-34s %.2f\n", "GB/s, per request (median)", ok ? rate[ok / 2] : 0.0);
  printf("  %-34s %.1f / %.1f\n", "transfer ms per request, p50 / p99", ok ? lat[ok / 2] * 1e3 : 0.0,
         ok ? lat[(size_t)((ok - 1) * 0.99)] * 1e3 : 0.0);
  printf("  %-34s %d\n", "failures", failures);
  printf("  (transfer: from the later of the decode's M2 and the prefill's last send to the decode's Success;\n"
         "   the whole run also fills and checks every page's pattern, %.1f s in all)\n",
         wall);
  if (failures)
    printf("demo FAILED: %d of %d requests failed or did not verify; the reasons are above\n", failures, requests);
  else printf("demo OK: %d requests, every byte of %.2f GiB verified\n", requests, moved / (1ull << 30));
  rc = failures ? 1 : 0;
out_stop:
  if (fatal) {
    if (tty) fputc('\n', stderr);
    fprintf(stderr, "demo FAILED: %s (%d of %d requests finished)\n", fatal, completed, requests);
    printf("demo FAILED: %s\n", fatal);
    rc = 1;
  }
  fflush(stdout);
  pd_stop(&pp);
  cli_breakdown_file(tpath, 0, 0);
  free(accounted);
out_free:
  free(reqs);
  free(lat);
  free(rate);
  free(tokens);
  return rc;
}

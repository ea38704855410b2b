/* A prefill/decode pair as three processes on 127.0.0.1 (`kvferry
 * bootstrap`, `kvferry-testpeer kv-peer` as the prefill instance, `kvferry
 * kv-decode` as the decode instance), and the bookkeeping of requests driven
 * through them: shared by `kvferry demo` and `kvferry bench e2e`, so the
 * benchmark measures exactly what the demo shows. */
#ifndef KVF_CLI_PD_H
#define KVF_CLI_PD_H

#include <stddef.h>
#include <stdint.h>

#include "tools/proc.h"
#include "tools/util.h"

typedef struct pd_pair {
  proc boot, prefill, decode;
  int up; /* bit 0 boot, 1 prefill, 2 decode: which to stop */
  char baddr[KVF_ADDR_MAX + 1];
} pd_pair;

/* One request. The caller sets room..corrupt; pd_collect fills the rest. */
typedef struct pd_req {
  int64_t room, token;
  size_t npages;
  uint64_t seed;   /* 0: no pattern fill or check (benchmarks) */
  int corrupt;     /* kv-decode flips one landed byte before its own check (1), or has the
                      library's test hook flip it before verify mode's check (2; the test peer's
                      testing library arms it, the kvferry command has no such hook) */
  int reuse_early; /* kv-peer overwrites a source page right after its send call */
  size_t chunk;    /* pages per send call (0: the whole request in one) */
  int wait_m2;     /* kv-peer sends once the decode's M2 is there (benchmarks) */
  /* Reports to wait for from each side: one per process hosting ranks of the
   * room (`demo --cluster`: a process per rank); 0 counts as 1. */
  int prefill_procs, decode_procs;
  int prefill_reports, decode_reports; /* so far */
  int prefill_done, decode_done;       /* every report in: worst status, summed bad pages, latest times */
  int prefill_status, decode_status;
  size_t bad_pages;
  long long t_send_ns, t_init_ns, t_final_ns;
  char reason[256]; /* first failure reason, empty if none */
} pd_req;

/* The pools' shape. kv_heads 0: plain pools of `pages` pages x 2*layers
 * buffers x item bytes per rank, checked per page. Otherwise head-aware pools
 * (kvpool_init_heads): page_size tokens a page, token-major, `unit` bytes per
 * head per token; each prefill rank holds kv_heads / prefill_tp heads, each
 * decode rank kv_heads / decode_tp, and the decode checks every (token, head)
 * of every rank. mla: MLA pools (kvpool_init_mla) on both sides, one latent
 * buffer per layer of page_size tokens x unit bytes a page, the same on every
 * rank (kv_heads unused), checked whole on every decode rank; 1: the generic
 * planner (replicated latent when the TP sizes differ, identity when equal),
 * 2: the decode with the legacy MLA routing (is_mla). */
typedef struct pd_layout {
  int layers;
  uint64_t item, pages;
  int prefill_tp, decode_tp;
  int page_size, kv_heads, mla;
  uint64_t unit;
} pd_layout;

/* A model's KV shape (bf16, 16-token pages as a serving engine allocates
 * them); MLA: one "head" of head_dim latent values per token and layer, in
 * one buffer per layer. */
typedef struct pd_model {
  const char *name;
  int layers, kv_heads, head_dim, dtype_bytes, page_tokens, mla;
} pd_model;
/* The demo's models by name, or NULL; `names` lists them. */
const pd_model *pd_model_find(const char *name);
extern const char pd_model_names[];

/* The options `kvferry demo` and `kvferry demo --cluster` share, with their
 * getopt codes (PD_DEMO_LONG_OPTS, PD_DEMO_SHORT_OPTS). */
typedef struct pd_demo_opts {
  const char *model, *transport;
  unsigned long long seed, max_tokens; /* 0: a bad value */
  double pool_gib;                     /* 0: the command's default, -1: a bad value */
  int set_max, set_pool;               /* given on the command line */
} pd_demo_opts;
/* clang-format off */
#define PD_DEMO_LONG_OPTS                                                                       \
  {"model", required_argument, 0, 'm'}, {"max-tokens", required_argument, 0, 'T'},              \
  {"pool-gib", required_argument, 0, 'g'}, {"transport", required_argument, 0, 't'},            \
  {"seed", required_argument, 0, 'S'}
/* clang-format on */
#define PD_DEMO_SHORT_OPTS "m:T:g:t:S:"
/* Take getopt's code c if it is a shared option: 1, else 0. */
int pd_demo_opt(pd_demo_opts *o, int c, const char *arg);
/* The pools' layout for md with these TP sizes (pages left 0); returns the
 * bytes of one page of an instance, over all its ranks and buffers. */
uint64_t pd_model_layout(const pd_model *md, int prefill_tp, int decode_tp, pd_layout *lo);
/* A prompt length, log-uniform over 128..max (chat and RAG traffic spreads
 * over orders of magnitude). */
size_t pd_draw_tokens(uint64_t *rng, uint64_t max);
/* qsort order of doubles. */
int pd_cmp_dbl(const void *a, const void *b);

/* A command line built piece by piece (the strings live in it). */
typedef struct pd_argv {
  char *v[64]; /* NULL-terminated */
  int n;
  char store[2048];
  size_t used;
  int overflow; /* an argument did not fit: v is empty (proc_start refuses it) */
} pd_argv;
/* Append one argument, printf-style. One that does not fit empties the
 * whole command line, so it fails to start rather than run with an argument
 * missing. */
void pd_argv_add(pd_argv *a, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Start with `pre` (e.g. {"ip", "netns", "exec", NS, NULL}; NULL: none). */
void pd_argv_init(pd_argv *a, char *const *pre);
/* The test peer's command for one side of the layout (decode 0: kv-peer,
 * 1: kv-decode) against the bootstrap server baddr (NULL: none; the decode's
 * recv lines then name it); the caller may append more options. */
void pd_peer_argv(pd_argv *a, char *const *pre, const pd_layout *lo, int decode, const char *baddr);
/* Start `kvferry bootstrap` on host (argv after `pre`) and read its address
 * into baddr (KVF_ADDR_MAX + 1 bytes). 0, or -1 with why in err. */
int pd_boot_start(proc *boot, char *const *pre, const char *host, char *baddr, char *err, size_t cap);
/* Stop it (it stops on a signal, not on EOF). */
void pd_boot_stop(proc *boot);
/* Wait for a test peer's "ready" line. 0 or -1. */
int pd_wait_ready(proc *p, int timeout_ms);

/* Start the three processes (the prefill hosting prefill_tp ranks, the decode
 * decode_tp ranks). On failure writes why into err and stops what started.
 * 0 or -1. */
int pd_start_layout(pd_pair *pp, const pd_layout *lo, char *err, size_t cap);
/* Plain pools, TP 1 on both sides. */
int pd_start(pd_pair *pp, int layers, uint64_t item, uint64_t pages, char *err, size_t cap);
void pd_stop(pd_pair *pp);
/* After a pair's first requests, wait (at most 5 s) until both instances
 * are idle, so what they start at connect and finish in the background (a
 * UCX reader maps its writers' pools ahead, engine/ucx_warm.c; at most a
 * few hundred ms of a core) does not run in what a benchmark then measures:
 * a running server is long past it. */
void pd_settle(pd_pair *pp);
/* Ask the decode for the pages (M2), then the prefill to send them. */
int pd_issue(pd_pair *pp, const pd_req *r);
/* The same to one process of each side; baddr: the prefill's bootstrap
 * server, for a decode started without one (NULL: its own). 0 or -1. */
int pd_issue_decode(proc *decode, const pd_req *r, const char *baddr);
int pd_issue_prefill(proc *prefill, const pd_req *r);
/* Take every report already available from one process of a side into
 * reqs[room - room_base]; returns how many requests became complete. */
int pd_drain(proc *p, int is_decode, pd_req *reqs, size_t n, int64_t room_base);
/* Read the reports available within timeout_ms into reqs[room - room_base];
 * returns how many requests became complete (both sides reported), or -1
 * if a process died. */
int pd_collect(pd_pair *pp, pd_req *reqs, size_t n, int64_t room_base, int timeout_ms);
/* 1 if a complete request failed in any way (status, bytes, metadata). */
int pd_failed(const pd_req *r);
/* Transfer time in seconds: from the later of the decode's init and the
 * prefill's last send call (its KV is then ready; with several prefill
 * ranks, the first rank's) to the decode's Success. */
double pd_transfer_s(const pd_req *r);

#endif

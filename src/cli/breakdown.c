/* The per-step breakdown of room traces (issue 25) for `kvferry demo` and
 * `kvferry bench rooms|e2e`: for every side, each step's duration from the
 * step reached just before it (in time order, on that side's own clock), as
 * p50 and p99 over the rooms that reached it, and the total from the
 * first step to the last. The durations of one room add up to its total.
 * The records come from a manager's ring (kvf_manager_trace_copy) or from a
 * KVFERRY_TRACE file that child processes wrote (kvf_trace_parse_json):
 * public API only. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "cli.h"
#include "kvferry.h"

static int cmp_i64(const void *a, const void *b) {
  int64_t x = *(const int64_t *)a, y = *(const int64_t *)b;
  return x < y ? -1 : x > y;
}

/* The nearest-rank percentile's index among k sorted values: ceil(pct% of k) - 1. */
static size_t rank_of(size_t k, unsigned pct) { return (k * pct + 99) / 100 - 1; }

int cli_breakdown_read(const char *path, kvf_room_trace **out, size_t *n) {
  FILE *f = fopen(path, "r");
  *out = NULL, *n = 0;
  if (!f) return -1;
  size_t cap = 0;
  char line[8192];
  while (fgets(line, sizeof line, f)) {
    if (*n == cap) {
      size_t nc = cap ? cap * 2 : 256;
      kvf_room_trace *p = realloc(*out, nc * sizeof *p);
      if (!p) break;
      *out = p, cap = nc;
    }
    if (!kvf_trace_parse_json(line, &(*out)[*n])) (*n)++;
  }
  fclose(f);
  return 0;
}

/* Durations (ns) of `step` in the records of `side` with room ids in
 * [lo, hi) (hi 0: any), from the step reached before it; KVF_TRACE_NSTEPS:
 * the total. Returns how many. */
static size_t durations(const kvf_room_trace *t, size_t n, int side, int64_t lo, int64_t hi, int step,
                        int64_t *d) {
  size_t k = 0;
  for (size_t i = 0; i < n; i++) {
    if (t[i].side != side || t[i].room < lo || (hi && t[i].room >= hi)) continue;
    int64_t first = 0, last = 0, prev = 0, self = t[i].t_ns[step < KVF_TRACE_NSTEPS ? step : 0];
    for (int s = 0; s < KVF_TRACE_NSTEPS; s++) {
      int64_t v = t[i].t_ns[s];
      if (!v) continue;
      if (!first || v < first) first = v;
      if (v > last) last = v;
      /* the latest step before this one (ties: the enum's order) */
      if (step < KVF_TRACE_NSTEPS && s != step && (v < self || (v == self && s < step)) && v >= prev) prev = v;
    }
    if (step == KVF_TRACE_NSTEPS) {
      if (first) d[k++] = last - first;
    } else if (self && prev) {
      d[k++] = self - prev;
    }
  }
  return k;
}

void cli_breakdown_print(const kvf_room_trace *t, size_t n, int side, int64_t lo, int64_t hi, int json,
                         const char *indent) {
  int64_t *d = malloc((n ? n : 1) * sizeof *d);
  if (!d) return;
  int first = 1;
  if (json) printf("[");
  else
    printf("%s%-24s %8s %12s %12s   (%s side: each step from the one before it, this side's clock)\n", indent,
           "step", "rooms", "p50 us", "p99 us", side == KVF_ROLE_PREFILL ? "prefill" : "decode");
  for (int s = 0; s <= KVF_TRACE_NSTEPS; s++) {
    size_t k = durations(t, n, side, lo, hi, s, d);
    if (!k) continue;
    qsort(d, k, sizeof *d, cmp_i64);
    double p50 = d[rank_of(k, 50)] / 1e3, p99 = d[rank_of(k, 99)] / 1e3;
    const char *name = s < KVF_TRACE_NSTEPS ? kvf_trace_step_name(s) : "total";
    if (json)
      printf("%s{\"step\":\"%s\",\"rooms\":%zu,\"p50_us\":%.1f,\"p99_us\":%.1f}", first ? "" : ",", name, k, p50,
             p99);
    else printf("%s%-24s %8zu %12.1f %12.1f\n", indent, name, k, p50, p99);
    first = 0;
  }
  if (json) printf("]");
  free(d);
}

int cli_breakdown_tmpfile(char *path, size_t cap) {
  snprintf(path, cap, "/tmp/kvferry-trace-XXXXXX");
  int fd = mkstemp(path);
  if (fd < 0) return -1;
  fclose(fdopen(fd, "w"));
  return 0;
}

int cli_breakdown_env(char *path, size_t cap) {
  if (cli_breakdown_tmpfile(path, cap)) {
    path[0] = '\0';
    return -1;
  }
  setenv("KVFERRY_TRACE", path, 1);
  return 0;
}

void cli_breakdown_file(char *path, int64_t lo, int json) {
  kvf_room_trace *t = NULL;
  size_t n = 0;
  if (!*path) return;
  unsetenv("KVFERRY_TRACE");
  cli_breakdown_read(path, &t, &n);
  unlink(path);
  path[0] = '\0';
  if (json) printf(",\"breakdown\":{\"decode\":");
  else printf("  per-step breakdown of %zu room records (KVFERRY_TRACE of both processes):\n", n);
  cli_breakdown_print(t, n, KVF_ROLE_DECODE, lo, 0, json, "  ");
  if (json) printf(",\"prefill\":");
  cli_breakdown_print(t, n, KVF_ROLE_PREFILL, lo, 0, json, "  ");
  if (json) printf("}");
  free(t);
}

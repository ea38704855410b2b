/* `kvferry trace` output (trace.h): the summary as text or as one JSON
 * object on stdout, and the per-request timeline as SVG (svg.c). Steps are
 * listed in the order of their median time since the first step, so step
 * names the reader does not know still come out in time order. */
#include <errno.h>
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "svg.h"
#include "trace.h"

static const char *const side_names[TRACE_SIDES] = {"decode", "prefill"};

/* The side's step indices by median time since the first step. */
static void step_order(trace_side *sd, size_t *order) {
  double key[TRACE_MAX_NAMES];
  for (size_t i = 0; i < sd->nsteps; i++) {
    order[i] = i;
    key[i] = trace_pct(&sd->steps[i].from_first, 0.5);
  }
  for (size_t i = 1; i < sd->nsteps; i++) /* insertion sort: stable, at most 32 */
    for (size_t j = i; j > 0 && key[order[j - 1]] > key[order[j]]; j--) {
      size_t t = order[j];
      order[j] = order[j - 1], order[j - 1] = t;
    }
}

typedef struct join_counts {
  uint64_t both, decode_only, prefill_only;
} join_counts;

static join_counts count_joined(const trace_summary *s) {
  join_counts j = {0, 0, 0};
  for (size_t i = 0; i < s->rooms_cap; i++) {
    const trace_room *r = &s->rooms[i];
    if (!r->used) continue;
    int d = r->total[TRACE_DECODE] >= 0, p = r->total[TRACE_PREFILL] >= 0;
    j.both += d && p, j.decode_only += d && !p, j.prefill_only += p && !d;
  }
  return j;
}

/* Reasons by count, most first (ties: first seen first). */
static void reason_order(const trace_summary *s, size_t *order) {
  for (size_t i = 0; i < s->nreasons; i++) order[i] = i;
  for (size_t i = 1; i < s->nreasons; i++)
    for (size_t j = i; j > 0 && s->reasons[order[j - 1]].n < s->reasons[order[j]].n; j--) {
      size_t t = order[j];
      order[j] = order[j - 1], order[j - 1] = t;
    }
}

static double ms(double ns) { return ns / 1e6; }

int trace_print_text(trace_summary *s, size_t top) {
  printf("trace %s: %llu lines, %llu records (decode %llu, prefill %llu), %llu bad lines\n", s->path,
         (unsigned long long)s->lines, (unsigned long long)s->records,
         (unsigned long long)s->side[TRACE_DECODE].records, (unsigned long long)s->side[TRACE_PREFILL].records,
         (unsigned long long)s->bad_lines);
  for (uint64_t i = 0; i < s->bad_lines && i < TRACE_BAD_LISTED; i++)
    printf("  line %llu: %s\n", (unsigned long long)s->bad[i].line, s->bad[i].why);
  if (s->bad_lines > TRACE_BAD_LISTED)
    printf("  (%llu more bad lines not listed)\n", (unsigned long long)(s->bad_lines - TRACE_BAD_LISTED));
  printf("records by status:%s\n", s->records ? "" : " (no records)");
  for (int k = 0; k < TRACE_SIDES; k++) {
    const trace_side *sd = &s->side[k];
    if (!sd->records) continue;
    printf("  %-8s", side_names[k]);
    for (size_t i = 0; i < sd->nstatus; i++)
      printf("%s %s %llu", i ? "," : "", sd->status[i].name, (unsigned long long)sd->status[i].n);
    if (sd->status_other) printf(", (other) %llu", (unsigned long long)sd->status_other);
    printf("\n");
  }
  size_t order[TRACE_MAX_REASONS];
  reason_order(s, order);
  if (s->nreasons) {
    printf("failure reasons (top %zu of %zu):\n", top < s->nreasons ? top : s->nreasons, s->nreasons);
    for (size_t i = 0; i < s->nreasons && i < top; i++)
      printf("  %8llu  %-8s %s\n", (unsigned long long)s->reasons[order[i]].n,
             side_names[s->reasons[order[i]].side], s->reasons[order[i]].text);
    if (s->reasons_other)
      printf("  %8llu  (other reasons, past %d distinct)\n", (unsigned long long)s->reasons_other,
             TRACE_MAX_REASONS);
  }
  join_counts j = count_joined(s);
  printf("joined by room id: %llu rooms on both sides, %llu decode only, %llu prefill only\n",
         (unsigned long long)j.both, (unsigned long long)j.decode_only, (unsigned long long)j.prefill_only);
  if (s->rooms_untracked)
    printf("  (%llu records of rooms past the first %u room ids were not joined)\n",
           (unsigned long long)s->rooms_untracked, TRACE_JOIN_MAX);
  for (int k = 0; k < TRACE_SIDES; k++) {
    trace_side *sd = &s->side[k];
    if (!sd->records) continue;
    printf("\n%s: %llu records; ms, p50 and p99, each within one record%s\n", side_names[k],
           (unsigned long long)sd->records,
           sd->total.seen > sd->total.n ? " (from a uniform sample of each figure)" : "");
    printf("  %-28s %9s  %10s %10s  %10s %10s\n", "step", "n", "prev p50", "prev p99", "first p50", "first p99");
    size_t so[TRACE_MAX_NAMES];
    step_order(sd, so);
    for (size_t i = 0; i < sd->nsteps; i++) {
      trace_step *st = &sd->steps[so[i]];
      printf("  %-28s %9llu  %10.3f %10.3f  %10.3f %10.3f\n", st->name, (unsigned long long)st->from_prev.seen,
             ms(trace_pct(&st->from_prev, 0.5)), ms(trace_pct(&st->from_prev, 0.99)),
             ms(trace_pct(&st->from_first, 0.5)), ms(trace_pct(&st->from_first, 0.99)));
    }
    if (sd->steps_other)
      printf("  (%llu steps under names past the first %d not summarised)\n", (unsigned long long)sd->steps_other,
             TRACE_MAX_NAMES);
    printf("  %-28s %9llu  %21s  %10.3f %10.3f\n", "total, first to last step", (unsigned long long)sd->total.seen,
           "", ms(trace_pct(&sd->total, 0.5)), ms(trace_pct(&sd->total, 0.99)));
    if (sd->bytes.seen) printf("  bytes per record p50: %.0f\n", trace_pct(&sd->bytes, 0.5));
    if (sd->gbps.seen)
      printf("  bandwidth p50: %.3f GB/s over %llu records (bytes / (last byte - first byte))\n",
             trace_pct(&sd->gbps, 0.5), (unsigned long long)sd->gbps.seen);
  }
  return fflush(stdout) ? -1 : 0;
}

/* A number, or null for an empty sample. */
static json_t *num(double v) { return isfinite(v) ? json_real(v) : json_null(); }

static json_t *side_json(trace_side *sd) {
  json_t *o = json_object(), *status = json_object(), *steps = json_array();
  json_object_set_new(o, "records", json_integer((json_int_t)sd->records));
  for (size_t i = 0; i < sd->nstatus; i++)
    json_object_set_new(status, sd->status[i].name, json_integer((json_int_t)sd->status[i].n));
  if (sd->status_other) json_object_set_new(status, "(other)", json_integer((json_int_t)sd->status_other));
  json_object_set_new(o, "status", status);
  size_t so[TRACE_MAX_NAMES];
  step_order(sd, so);
  for (size_t i = 0; i < sd->nsteps; i++) {
    trace_step *st = &sd->steps[so[i]];
    json_array_append_new(steps, json_pack("{s:s,s:I,s:o,s:o,s:o,s:o}", "name", st->name, "n",
                                           (json_int_t)st->from_prev.seen, "from_prev_p50_ms",
                                           num(ms(trace_pct(&st->from_prev, 0.5))), "from_prev_p99_ms",
                                           num(ms(trace_pct(&st->from_prev, 0.99))), "from_first_p50_ms",
                                           num(ms(trace_pct(&st->from_first, 0.5))), "from_first_p99_ms",
                                           num(ms(trace_pct(&st->from_first, 0.99)))));
  }
  json_object_set_new(o, "steps", steps);
  json_object_set_new(o, "steps_not_summarised", json_integer((json_int_t)sd->steps_other));
  json_object_set_new(o, "total_p50_ms", num(ms(trace_pct(&sd->total, 0.5))));
  json_object_set_new(o, "total_p99_ms", num(ms(trace_pct(&sd->total, 0.99))));
  double bytes = trace_pct(&sd->bytes, 0.5); /* an integer: 6 significant digits would round it */
  json_object_set_new(o, "bytes_p50", isfinite(bytes) ? json_integer((json_int_t)bytes) : json_null());
  json_object_set_new(o, "bandwidth_p50_gbps", num(trace_pct(&sd->gbps, 0.5)));
  json_object_set_new(o, "bandwidth_records", json_integer((json_int_t)sd->gbps.seen));
  json_object_set_new(o, "sampled", json_boolean(sd->total.seen > sd->total.n));
  return o;
}

int trace_print_json(trace_summary *s, size_t top) {
  json_t *o = json_object(), *bad = json_array(), *sides = json_object(), *reasons = json_array();
  json_object_set_new(o, "file", json_string(s->path));
  json_object_set_new(o, "lines", json_integer((json_int_t)s->lines));
  json_object_set_new(o, "records", json_integer((json_int_t)s->records));
  json_object_set_new(o, "bad_lines", json_integer((json_int_t)s->bad_lines));
  for (uint64_t i = 0; i < s->bad_lines && i < TRACE_BAD_LISTED; i++)
    json_array_append_new(bad, json_pack("{s:I,s:s}", "line", (json_int_t)s->bad[i].line, "error", s->bad[i].why));
  json_object_set_new(o, "bad", bad);
  for (int k = 0; k < TRACE_SIDES; k++) json_object_set_new(sides, side_names[k], side_json(&s->side[k]));
  json_object_set_new(o, "sides", sides);
  size_t order[TRACE_MAX_REASONS];
  reason_order(s, order);
  for (size_t i = 0; i < s->nreasons && i < top; i++) {
    const trace_reason *r = &s->reasons[order[i]];
    json_array_append_new(reasons, json_pack("{s:s,s:s,s:I}", "side", side_names[r->side], "reason", r->text,
                                             "count", (json_int_t)r->n));
  }
  json_object_set_new(o, "failure_reasons", reasons);
  json_object_set_new(o, "distinct_failure_reasons", json_integer((json_int_t)s->nreasons));
  join_counts j = count_joined(s);
  json_t *joined = json_object(), *list = json_array();
  json_object_set_new(joined, "rooms", json_integer((json_int_t)j.both));
  json_object_set_new(joined, "decode_only", json_integer((json_int_t)j.decode_only));
  json_object_set_new(joined, "prefill_only", json_integer((json_int_t)j.prefill_only));
  json_object_set_new(joined, "records_not_joined", json_integer((json_int_t)s->rooms_untracked));
  size_t listed = 0;
  for (size_t i = 0; i < s->rooms_cap && listed < TRACE_JOIN_LISTED; i++) {
    const trace_room *r = &s->rooms[i];
    if (!r->used || r->total[TRACE_DECODE] < 0 || r->total[TRACE_PREFILL] < 0) continue;
    json_array_append_new(list, json_pack("{s:I,s:o,s:o}", "room", (json_int_t)r->room, "decode_total_ms",
                                          json_real(ms(r->total[TRACE_DECODE])), "prefill_total_ms",
                                          json_real(ms(r->total[TRACE_PREFILL]))));
    listed++;
  }
  json_object_set_new(joined, "list", list);
  json_object_set_new(o, "joined", joined);
  int rc = json_dumpf(o, stdout, JSON_COMPACT | JSON_REAL_PRECISION(6));
  json_decref(o);
  printf("\n");
  if (rc || fflush(stdout)) {
    fprintf(stderr, "trace: writing the JSON failed\n");
    return -1;
  }
  return 0;
}

int trace_write_svg(const trace_summary *s, const char *path) {
  svg_timeline_row rows[TRACE_MAX_ROWS];
  const char *names[TRACE_MAX_NAMES + 1];
  size_t nnames = s->nnames;
  for (size_t i = 0; i < nnames; i++) names[i] = s->names[i];
  for (size_t r = 0; r < s->nrows; r++) {
    rows[r] = (svg_timeline_row){s->rows[r].label, s->rows[r].t_ms, s->rows[r].step, s->rows[r].n};
    for (size_t i = 0; i < s->rows[r].n; i++)
      if (s->rows[r].step[i] == TRACE_MAX_NAMES) nnames = TRACE_MAX_NAMES + 1; /* "(other)" is used */
  }
  if (nnames == TRACE_MAX_NAMES + 1) names[TRACE_MAX_NAMES] = s->names[TRACE_MAX_NAMES];
  char title[300], note[160];
  snprintf(title, sizeof title, "kvferry trace %s: one row per record, each from its own first step", s->path);
  if (s->records > s->nrows)
    snprintf(note, sizeof note, "showing the first %zu of %llu records (truncated at %d rows)", s->nrows,
             (unsigned long long)s->records, TRACE_MAX_ROWS);
  else snprintf(note, sizeof note, "all %llu records", (unsigned long long)s->records);
  svg_timeline t = {title, note, names, nnames, rows, s->nrows, 1200};
  FILE *f = fopen(path, "w");
  if (!f) {
    fprintf(stderr, "trace: cannot write %s: %s\n", path, strerror(errno));
    return -1;
  }
  svg_write_timeline(f, &t);
  int bad = fflush(f) || ferror(f);
  if (fclose(f) || bad) {
    fprintf(stderr, "trace: writing %s failed: %s\n", path, strerror(errno));
    remove(path);
    return -1;
  }
  return 0;
}

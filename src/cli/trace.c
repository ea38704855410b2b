/* `kvferry trace FILE`: reads a trace file (one JSON object per finished
 * room and side, trace.h) line by line into a bounded summary and prints it
 * (trace_report.c). Clock rule: every duration is taken within one record,
 * between two steps of the same side; timestamps of two records (two hosts,
 * two clocks) are never subtracted, so the join of a room's two sides shows
 * their totals side by side. A line that is not a well-formed record is
 * counted and listed with its number, never fatal. */
#include "trace.h"

#include <errno.h>
#include <getopt.h>
#include <jansson.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"

static const char *const side_names[TRACE_SIDES] = {"decode", "prefill"};

static int sample_add(trace_sample *x, double v, uint64_t *rng) {
  x->seen++;
  if (x->n < TRACE_RESERVOIR) {
    if (x->n == x->cap) {
      size_t cap = x->cap ? x->cap * 2 : 64;
      if (cap > TRACE_RESERVOIR) cap = TRACE_RESERVOIR;
      double *nv = realloc(x->v, cap * sizeof *nv);
      if (!nv) return -1;
      x->v = nv, x->cap = cap;
    }
    x->v[x->n++] = v;
    return 0;
  }
  uint64_t j = cli_rng_next(rng) % x->seen; /* Algorithm R: keep v with probability n/seen */
  if (j < x->n) x->v[j] = v;
  return 0;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

double trace_pct(trace_sample *x, double p) {
  if (!x->n) return NAN;
  qsort(x->v, x->n, sizeof *x->v, cmp_double);
  size_t rank = (size_t)ceil(p * (double)x->n);
  return x->v[rank ? rank - 1 : 0];
}

/* Makes a kept string printable and valid UTF-8 in place (jansson refuses
 * anything else in its output): control bytes, and bytes of sequences that
 * are invalid or were cut by a length limit, become '?'. */
static void tidy(char *str) {
  unsigned char *p = (unsigned char *)str;
  while (*p) {
    size_t len = *p < 0x80 ? 1 : *p < 0xC2 ? 0 : *p < 0xE0 ? 2 : *p < 0xF0 ? 3 : *p < 0xF5 ? 4 : 0, i = 1;
    while (i < len && (p[i] & 0xC0) == 0x80) i++;
    int bad = !len || i < len || (*p == 0xE0 && p[1] < 0xA0) || (*p == 0xED && p[1] >= 0xA0) ||
              (*p == 0xF0 && p[1] < 0x90) || (*p == 0xF4 && p[1] >= 0x90);
    if (bad || (len == 1 && *p < 0x20)) {
      *p++ = '?';
      continue;
    }
    p += len;
  }
}

static void bad_line(trace_summary *s, const char *why, const char *detail) {
  if (s->bad_lines < TRACE_BAD_LISTED) {
    trace_bad *b = &s->bad[s->bad_lines];
    b->line = s->lines;
    snprintf(b->why, sizeof b->why, "%.80s%s%.110s", why, detail ? ": " : "", detail ? detail : "");
    tidy(b->why);
  }
  s->bad_lines++;
}

/* One record, checked; pointers into the JSON value it was parsed from. */
typedef struct record {
  int side;
  uint64_t room;
  long long rank;
  const char *status, *reason;
  size_t nsteps;
  const char *name[TRACE_MAX_STEPS];
  long long t_ns[TRACE_MAX_STEPS];
  double bytes; /* < 0: absent */
} record;

/* Fills r from a parsed line; NULL, or why it is not a record. */
static const char *check_record(json_t *o, record *r) {
  if (!json_is_object(o)) return "not a JSON object";
  json_t *v = json_object_get(o, "v");
  if (!json_is_integer(v) || json_integer_value(v) != 1) return "\"v\" is not 1";
  const char *side = json_string_value(json_object_get(o, "side"));
  if (!side) return "no \"side\"";
  if (!strcmp(side, "decode")) r->side = TRACE_DECODE;
  else if (!strcmp(side, "prefill")) r->side = TRACE_PREFILL;
  else return "\"side\" is neither decode nor prefill";
  v = json_object_get(o, "room");
  if (!json_is_integer(v) || json_integer_value(v) < 0) return "\"room\" is not an integer >= 0";
  r->room = (uint64_t)json_integer_value(v);
  v = json_object_get(o, "rank");
  r->rank = json_is_integer(v) ? json_integer_value(v) : -1;
  if (!(r->status = json_string_value(json_object_get(o, "status")))) return "no \"status\"";
  v = json_object_get(o, "reason");
  if (v && !json_is_null(v) && !json_is_string(v)) return "\"reason\" is neither a string nor null";
  r->reason = json_string_value(v);
  v = json_object_get(o, "bytes");
  if (v && !json_is_integer(v)) return "\"bytes\" is not an integer";
  r->bytes = v && json_integer_value(v) >= 0 ? (double)json_integer_value(v) : -1;
  json_t *steps = json_object_get(o, "steps");
  if (!json_is_array(steps)) return "no \"steps\" array";
  if (json_array_size(steps) > TRACE_MAX_STEPS) return "more steps than kvferry trace keeps (64)";
  r->nsteps = 0;
  size_t i;
  json_t *st;
  json_array_foreach(steps, i, st) {
    const char *name = json_string_value(json_object_get(st, "name"));
    json_t *t = json_object_get(st, "t_ns");
    if (!name || !*name || !json_is_integer(t)) return "a step without a \"name\" or an integer \"t_ns\"";
    /* t_ns counts from the side's first step: negative is malformed (and
     * differences of non-negative values cannot overflow). */
    if (json_integer_value(t) < 0) return "a step with a negative \"t_ns\"";
    /* Insertion in time order; equal times keep the file's order. */
    size_t at = r->nsteps;
    while (at > 0 && r->t_ns[at - 1] > json_integer_value(t)) {
      r->name[at] = r->name[at - 1], r->t_ns[at] = r->t_ns[at - 1];
      at--;
    }
    r->name[at] = name, r->t_ns[at] = json_integer_value(t);
    r->nsteps++;
  }
  return NULL;
}

/* A name as it is kept: cut to the table's length, then tidied. */
static void keep_name(char *dst, size_t cap, const char *src) {
  snprintf(dst, cap, "%s", src);
  tidy(dst);
}

/* The slot of `name` (kept form) in a table of `n` names of `cap`; cap when
 * it is full. */
static size_t name_slot(char (*names)[TRACE_NAME_LEN], size_t *n, size_t cap, const char *name) {
  for (size_t i = 0; i < *n; i++)
    if (!strcmp(names[i], name)) return i;
  if (*n == cap) return cap;
  snprintf(names[*n], TRACE_NAME_LEN, "%s", name);
  return (*n)++;
}

static size_t step_slot(trace_side *sd, const char *name) {
  size_t i = 0;
  for (; i < sd->nsteps; i++)
    if (!strcmp(sd->steps[i].name, name)) return i;
  if (i == TRACE_MAX_NAMES) return i;
  snprintf(sd->steps[i].name, TRACE_NAME_LEN, "%s", name);
  return sd->nsteps++;
}

static void count_status(trace_side *sd, const char *status) {
  char name[sizeof sd->status[0].name];
  keep_name(name, sizeof name, status);
  for (size_t i = 0; i < sd->nstatus; i++)
    if (!strcmp(sd->status[i].name, name)) {
      sd->status[i].n++;
      return;
    }
  if (sd->nstatus == TRACE_MAX_STATUSES) {
    sd->status_other++;
    return;
  }
  memcpy(sd->status[sd->nstatus].name, name, sizeof name);
  sd->status[sd->nstatus++].n = 1;
}

static int count_reason(trace_summary *s, int side, const char *reason) {
  char text[TRACE_REASON_LEN + 1];
  keep_name(text, sizeof text, reason ? reason : "(no reason)");
  for (size_t i = 0; i < s->nreasons; i++)
    if (s->reasons[i].side == side && !strcmp(s->reasons[i].text, text)) {
      s->reasons[i].n++;
      return 0;
    }
  if (s->nreasons == TRACE_MAX_REASONS) {
    s->reasons_other++;
    return 0;
  }
  trace_reason *r = &s->reasons[s->nreasons];
  if (!(r->text = strdup(text))) return -1;
  r->side = side, r->n = 1;
  s->nreasons++;
  return 0;
}

static uint64_t room_hash(uint64_t x) {
  x ^= x >> 33, x *= 0xff51afd7ed558ccdull, x ^= x >> 33;
  return x;
}

/* The room's slot, added if new; NULL past TRACE_JOIN_MAX (or out of
 * memory: *oom set). */
static trace_room *room_slot(trace_summary *s, uint64_t room, int *oom) {
  if (s->rooms_cap == 0 || (s->nrooms + 1) * 2 > s->rooms_cap) {
    if (s->nrooms >= TRACE_JOIN_MAX) goto find_only;
    size_t cap = s->rooms_cap ? s->rooms_cap * 2 : 1024;
    trace_room *t = calloc(cap, sizeof *t);
    if (!t) {
      *oom = 1;
      return NULL;
    }
    for (size_t i = 0; i < s->rooms_cap; i++) {
      if (!s->rooms[i].used) continue;
      size_t j = room_hash(s->rooms[i].room) & (cap - 1);
      while (t[j].used) j = (j + 1) & (cap - 1);
      t[j] = s->rooms[i];
    }
    free(s->rooms);
    s->rooms = t, s->rooms_cap = cap;
  }
find_only:;
  size_t j = room_hash(room) & (s->rooms_cap - 1);
  while (s->rooms[j].used && s->rooms[j].room != room) j = (j + 1) & (s->rooms_cap - 1);
  if (s->rooms[j].used) return &s->rooms[j];
  if (s->nrooms >= TRACE_JOIN_MAX) return NULL;
  s->rooms[j] = (trace_room){.room = room, .total = {-1, -1}, .used = 1};
  s->nrooms++;
  return &s->rooms[j];
}

static int keep_row(trace_summary *s, const record *r) {
  if (!s->rows && !(s->rows = calloc(TRACE_MAX_ROWS, sizeof *s->rows))) return -1;
  trace_row *row = &s->rows[s->nrows++];
  if (r->rank >= 0)
    snprintf(row->label, sizeof row->label, "%s room %llu rank %lld", side_names[r->side],
             (unsigned long long)r->room, r->rank);
  else snprintf(row->label, sizeof row->label, "%s room %llu", side_names[r->side], (unsigned long long)r->room);
  row->n = r->nsteps;
  for (size_t i = 0; i < r->nsteps; i++) {
    char name[TRACE_NAME_LEN];
    keep_name(name, sizeof name, r->name[i]);
    row->t_ms[i] = (double)(r->t_ns[i] - r->t_ns[0]) / 1e6;
    row->step[i] = name_slot(s->names, &s->nnames, TRACE_MAX_NAMES, name);
  }
  return 0;
}

static int add_record(trace_summary *s, const record *r) {
  trace_side *sd = &s->side[r->side];
  s->records++;
  sd->records++;
  count_status(sd, r->status);
  if (strcmp(r->status, "Success") && count_reason(s, r->side, r->reason)) return -1;
  long long first_byte = -1, last_byte = -1;
  for (size_t i = 0; i < r->nsteps; i++) {
    char name[TRACE_NAME_LEN];
    keep_name(name, sizeof name, r->name[i]);
    size_t k = step_slot(sd, name);
    if (!strncmp(r->name[i], "first_byte", 10) && first_byte < 0) first_byte = r->t_ns[i]; /* t_ns >= 0 */
    if (!strncmp(r->name[i], "last_byte", 9)) last_byte = r->t_ns[i];
    if (k == TRACE_MAX_NAMES) {
      sd->steps_other++;
      continue;
    }
    if (sample_add(&sd->steps[k].from_prev, (double)(r->t_ns[i] - r->t_ns[i ? i - 1 : 0]), &s->rng) ||
        sample_add(&sd->steps[k].from_first, (double)(r->t_ns[i] - r->t_ns[0]), &s->rng))
      return -1;
  }
  double total = r->nsteps ? (double)(r->t_ns[r->nsteps - 1] - r->t_ns[0]) : 0;
  if (r->nsteps && sample_add(&sd->total, total, &s->rng)) return -1;
  if (r->bytes >= 0 && sample_add(&sd->bytes, r->bytes, &s->rng)) return -1;
  if (r->bytes > 0 && first_byte >= 0 && last_byte > first_byte &&
      sample_add(&sd->gbps, r->bytes / (double)(last_byte - first_byte), &s->rng)) /* bytes per ns = GB/s */
    return -1;
  int oom = 0;
  trace_room *room = room_slot(s, r->room, &oom);
  if (oom) return -1;
  if (!room) s->rooms_untracked++;
  else if (total > room->total[r->side]) room->total[r->side] = total; /* total >= 0: steps are in time order */
  if (s->keep_rows && s->nrows < TRACE_MAX_ROWS && keep_row(s, r)) return -1;
  return 0;
}

/* The next line into buf (without its newline): its length, or -1 at the
 * end of the file. A line longer than cap is consumed and reported as
 * *too_long. */
static long read_line(FILE *f, char *buf, size_t cap, int *too_long) {
  size_t n = 0;
  int c;
  *too_long = 0;
  while ((c = getc(f)) != EOF && c != '\n') {
    if (n < cap) buf[n++] = (char)c;
    else *too_long = 1;
  }
  if (c == EOF && n == 0 && !*too_long) return -1;
  return (long)n;
}

static int blank(const char *p, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (p[i] != ' ' && p[i] != '\t' && p[i] != '\r') return 0;
  return 1;
}

int trace_read(FILE *f, trace_summary *s) {
  char *buf = malloc(TRACE_MAX_LINE);
  record *r = malloc(sizeof *r);
  int rc = -1, too_long;
  long n;
  if (!buf || !r) {
    fprintf(stderr, "trace: out of memory\n");
    goto out;
  }
  s->rng = 0x9e3779b97f4a7c15ull;
  snprintf(s->names[TRACE_MAX_NAMES], TRACE_NAME_LEN, "(other)");
  while ((n = read_line(f, buf, TRACE_MAX_LINE, &too_long)) >= 0) {
    s->lines++;
    if (too_long) {
      bad_line(s, "longer than 64 KiB", NULL);
      continue;
    }
    if (blank(buf, (size_t)n)) continue;
    json_error_t err;
    json_t *o = json_loadb(buf, (size_t)n, 0, &err);
    if (!o) {
      bad_line(s, "not JSON", err.text);
      continue;
    }
    const char *why = check_record(o, r);
    if (why) bad_line(s, why, NULL);
    int failed = !why && add_record(s, r);
    json_decref(o);
    if (failed) {
      fprintf(stderr, "trace: out of memory at line %llu\n", (unsigned long long)s->lines);
      goto out;
    }
  }
  if (ferror(f)) {
    fprintf(stderr, "trace: reading %s: %s\n", s->path, strerror(errno));
    goto out;
  }
  rc = 0;
out:
  free(r);
  free(buf);
  return rc;
}

void trace_summary_free(trace_summary *s) {
  for (int k = 0; k < TRACE_SIDES; k++) {
    trace_side *sd = &s->side[k];
    for (size_t i = 0; i < sd->nsteps; i++) free(sd->steps[i].from_prev.v), free(sd->steps[i].from_first.v);
    free(sd->total.v), free(sd->bytes.v), free(sd->gbps.v);
  }
  for (size_t i = 0; i < s->nreasons; i++) free(s->reasons[i].text);
  free(s->rooms);
  free(s->rows);
}

static void usage(FILE *f) {
  fprintf(f,
          "usage: kvferry trace FILE [--json] [--svg OUT.svg] [--top N]     (FILE - reads stdin)\n"
          "  Summarises a trace file (KVFERRY_TRACE=FILE: one JSON line per finished room and side):\n"
          "  records by side and status, the top N failure reasons (default 5), per step the p50/p99\n"
          "  time since the previous step and since the first, the total per room, bytes and the\n"
          "  bandwidth bytes / (last byte - first byte) of the side that has both, and the rooms seen\n"
          "  on both sides (joined by room id; the two sides' clocks are never subtracted).\n"
          "  --json       one JSON object instead of text (with the joined rooms' totals side by side)\n"
          "  --svg FILE   also draw a timeline of the first %d records, one row each, as SVG\n"
          "  Bad lines are counted and listed by line number; exit 0 when the file was read.\n",
          TRACE_MAX_ROWS);
}

int cli_trace(int argc, char **argv) {
  static const struct option opts[] = {{"json", no_argument, 0, 'j'},
                                       {"svg", required_argument, 0, 's'},
                                       {"top", required_argument, 0, 't'},
                                       {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
  int c, json = 0;
  long top = 5;
  const char *svg = NULL;
  while ((c = getopt_long(argc, argv, "js:t:h", opts, NULL)) != -1) {
    switch (c) {
      case 'j': json = 1; break;
      case 's': svg = optarg; break;
      case 't':
        top = strtol(optarg, NULL, 10);
        if (top < 1 || top > TRACE_MAX_REASONS) return usage(stderr), 2;
        break;
      case 'h': usage(stdout); return 0;
      default: usage(stderr); return 2;
    }
  }
  if (optind + 1 != argc) return usage(stderr), 2;
  const char *path = argv[optind];
  FILE *f = strcmp(path, "-") ? fopen(path, "r") : stdin;
  if (!f) {
    fprintf(stderr, "trace: cannot open %s: %s\n", path, strerror(errno));
    return 1;
  }
  int rc = 1;
  trace_summary *s = calloc(1, sizeof *s);
  if (!s) goto out_close;
  s->path = path;
  s->keep_rows = svg != NULL;
  if (trace_read(f, s)) goto out_free;
  if (svg && trace_write_svg(s, svg)) goto out_free;
  if (json ? trace_print_json(s, (size_t)top) : trace_print_text(s, (size_t)top)) goto out_free;
  if (svg && !json) printf("timeline written to %s\n", svg);
  rc = 0;
out_free:
  trace_summary_free(s);
  free(s);
out_close:
  if (f != stdin) fclose(f);
  return rc;
}

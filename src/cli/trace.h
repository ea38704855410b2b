/* The summary behind `kvferry trace` (trace.c reads a trace file into it,
 * trace_report.c prints it as text, JSON or an SVG timeline). A trace file
 * holds one JSON object per finished room and side, written by the library
 * when KVFERRY_TRACE=FILE is set (README, "Traces"). Memory is bounded
 * whatever the file's size: the limits below are stated in the output when
 * they are reached. One thread. */
#ifndef KVF_CLI_TRACE_H
#define KVF_CLI_TRACE_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define TRACE_MAX_LINE (64u << 10) /* a longer line is a bad line */
#define TRACE_MAX_STEPS 64         /* steps in one record; more: a bad line */
#define TRACE_MAX_NAMES 32         /* step names per side; the rest are counted, not summarised */
#define TRACE_NAME_LEN 48          /* step names are kept up to this many bytes */
#define TRACE_RESERVOIR 50000      /* samples kept per figure (a uniform reservoir beyond) */
#define TRACE_MAX_STATUSES 16      /* status names per side; the rest count as "(other)" */
#define TRACE_MAX_REASONS 256      /* distinct failure reasons; the rest count as "(other reasons)" */
#define TRACE_REASON_LEN 200       /* reasons are kept up to this many bytes */
#define TRACE_BAD_LISTED 20        /* bad lines listed with their line number (all are counted) */
#define TRACE_MAX_ROWS 200         /* timeline rows (--svg): the first records of the file */
#define TRACE_JOIN_MAX (1u << 20)  /* room ids remembered for the join; later new ones are not joined */
#define TRACE_JOIN_LISTED 1000     /* joined rooms listed one by one in --json */

enum { TRACE_DECODE, TRACE_PREFILL, TRACE_SIDES };

/* Up to TRACE_RESERVOIR values (an array growing geometrically), then a
 * uniform reservoir sample of everything seen. */
typedef struct trace_sample {
  double *v;
  size_t n, cap;
  uint64_t seen;
} trace_sample;

typedef struct trace_step {
  char name[TRACE_NAME_LEN];
  trace_sample from_prev, from_first; /* ns, within one record */
} trace_step;

typedef struct trace_count {
  char name[32];
  uint64_t n;
} trace_count;

typedef struct trace_side {
  uint64_t records;
  trace_count status[TRACE_MAX_STATUSES];
  size_t nstatus;
  uint64_t status_other;
  trace_step steps[TRACE_MAX_NAMES];
  size_t nsteps;
  uint64_t steps_other; /* step occurrences under names past TRACE_MAX_NAMES */
  trace_sample total;   /* ns, first to last step of a record */
  trace_sample bytes;
  trace_sample gbps; /* bytes / (last_byte* - first_byte*) of one record */
} trace_side;

typedef struct trace_reason {
  int side;
  char *text;
  uint64_t n;
} trace_reason;

/* A room id seen on either side: the largest total of its records there
 * (the slowest rank finishes the room), in ns; -1 when not seen. */
typedef struct trace_room {
  uint64_t room;
  double total[TRACE_SIDES];
  int used;
} trace_room;

typedef struct trace_bad {
  uint64_t line;
  char why[200];
} trace_bad;

/* A timeline row: one record's steps in time order, ms since its first. */
typedef struct trace_row {
  char label[96];
  size_t n;
  double t_ms[TRACE_MAX_STEPS];
  size_t step[TRACE_MAX_STEPS]; /* index into trace_summary.names */
} trace_row;

typedef struct trace_summary {
  const char *path;
  uint64_t lines, records, bad_lines;
  trace_bad bad[TRACE_BAD_LISTED];
  trace_side side[TRACE_SIDES];
  trace_reason reasons[TRACE_MAX_REASONS];
  size_t nreasons;
  uint64_t reasons_other;
  trace_room *rooms; /* open addressing, cap a power of two */
  size_t nrooms, rooms_cap;
  uint64_t rooms_untracked; /* records of rooms past TRACE_JOIN_MAX */
  int keep_rows;            /* --svg: keep the first TRACE_MAX_ROWS records */
  trace_row *rows;
  size_t nrows;
  /* Step names across both sides, for the timeline's colours; the last
   * slot is "(other)". */
  char names[TRACE_MAX_NAMES + 1][TRACE_NAME_LEN];
  size_t nnames;
  uint64_t rng;
} trace_summary;

/* Reads `f` to its end into `s` (zeroed by the caller, path and keep_rows
 * set). 0, or -1 with a message on stderr (out of memory, a read error); bad lines are
 * counted in `s`, never an error. */
int trace_read(FILE *f, trace_summary *s);
void trace_summary_free(trace_summary *s);
/* Percentile p (0..1) of a sample, nearest rank; NAN when empty. Sorts it. */
double trace_pct(trace_sample *x, double p);

/* trace_report.c: the summary on stdout, as text or one JSON object; the
 * timeline as SVG. 0 or -1 with a message on stderr. */
int trace_print_text(trace_summary *s, size_t top);
int trace_print_json(trace_summary *s, size_t top);
int trace_write_svg(const trace_summary *s, const char *path);

#endif

/* A small SVG writer for the kvferry command's plots, so a plot needs nothing
 * installed: line charts over a log2 x axis (`kvferry bench --plot`) and a
 * per-request timeline (`kvferry trace --svg`). Everything is written to a
 * FILE*; text is escaped for XML; points that are not finite (or x <= 0 on
 * the log axis) are skipped. One thread per FILE*, as stdio. */
#ifndef KVF_CLI_SVG_H
#define KVF_CLI_SVG_H

#include <stddef.h>
#include <stdio.h>

/* Opens the document (width x height pixels, white background, a title at
 * the top when `title` is not NULL) and closes it. */
void svg_begin(FILE *f, double width, double height, const char *title);
void svg_end(FILE *f);
/* `s` with & < > " ' escaped; bytes below 0x20 other than tab become '?'. */
void svg_escape(FILE *f, const char *s);

/* Tick labels on the x axis: plain numbers, or bytes as "4 KiB", "1 MiB". */
enum svg_tick_format { SVG_TICK_NUMBER, SVG_TICK_BYTES };

typedef struct svg_series {
  const char *name; /* legend text */
  const double *x, *y;
  size_t n;
  int dashed; /* a baseline: dashed line, no markers */
} svg_series;

/* A line chart in the box (x, y, width, height) of the document: the
 * y axis from 0 to a rounded maximum, the x axis log2 with a tick at each
 * power of two in the data's range, a legend under the axis label. */
typedef struct svg_line_chart {
  const char *title, *xlabel, *ylabel;
  enum svg_tick_format xticks;
  const svg_series *series;
  size_t nseries;
  double x, y, width, height;
} svg_line_chart;

void svg_draw_line_chart(FILE *f, const svg_line_chart *c);

/* One row of a timeline: times in ms from the row's own first step, each
 * with the index of its step name (the colour and legend entry). The segment
 * from step i-1 to step i takes the colour of step i (the phase that ends at
 * it); the first step is a tick. */
typedef struct svg_timeline_row {
  const char *label;
  const double *t_ms;
  const size_t *step;
  size_t n;
} svg_timeline_row;

/* A timeline, one row per request, at most as many rows as given; `note`
 * (may be NULL) is printed under the title, e.g. that rows were left out.
 * The document's size follows from the rows: svg_timeline_height. */
typedef struct svg_timeline {
  const char *title, *note;
  const char *const *step_names; /* legend, indexed by svg_timeline_row.step */
  size_t nsteps;
  const svg_timeline_row *rows;
  size_t nrows;
  double width;
} svg_timeline;

double svg_timeline_height(const svg_timeline *t);
/* A whole document (svg_begin .. svg_end). */
void svg_write_timeline(FILE *f, const svg_timeline *t);

#endif

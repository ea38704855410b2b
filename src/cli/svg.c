/* The SVG writer behind `kvferry bench --plot` and `kvferry trace --svg`
 * (svg.h): plain SVG 1.1 elements (rect, line, polyline, circle, text), no
 * scripts and no external references, so any browser or image viewer shows
 * it and an XML parser reads it. */
#include "svg.h"

#include <math.h>
#include <string.h>

/* Twenty distinguishable colours (a timeline has up to 16 named steps). */
static const char *const palette[] = {"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2",
                                      "#7f7f7f", "#bcbd22", "#17becf", "#aec7e8", "#ffbb78", "#98df8a", "#ff9896",
                                      "#c5b0d5", "#c49c94", "#f7b6d2", "#c7c7c7", "#dbdb8d", "#9edae5"};
#define PALETTE_N (sizeof palette / sizeof palette[0])

void svg_escape(FILE *f, const char *s) {
  for (; s && *s; s++) {
    switch (*s) {
      case '&': fputs("&amp;", f); break;
      case '<': fputs("&lt;", f); break;
      case '>': fputs("&gt;", f); break;
      case '"': fputs("&quot;", f); break;
      case '\'': fputs("&apos;", f); break;
      default: fputc((unsigned char)*s < 0x20 && *s != '\t' ? '?' : *s, f);
    }
  }
}

/* A text element; anchor "start", "middle" or "end"; rotate != 0 turns it
 * about its anchor point. */
static void text(FILE *f, double x, double y, const char *anchor, int size, int rotate, const char *s) {
  fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"%s\" font-size=\"%d\"", x, y, anchor, size);
  if (rotate) fprintf(f, " transform=\"rotate(%d %.1f %.1f)\"", rotate, x, y);
  fputs(">", f);
  svg_escape(f, s);
  fputs("</text>\n", f);
}

void svg_begin(FILE *f, double width, double height, const char *title) {
  fprintf(f,
          "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
          "<svg xmlns=\"http://www.w3.org/2000/svg\" version=\"1.1\" width=\"%.0f\" height=\"%.0f\" "
          "viewBox=\"0 0 %.0f %.0f\" font-family=\"sans-serif\">\n"
          "<rect x=\"0\" y=\"0\" width=\"%.0f\" height=\"%.0f\" fill=\"white\"/>\n",
          width, height, width, height, width, height);
  if (title) {
    fputs("<title>", f);
    svg_escape(f, title);
    fputs("</title>\n", f);
    text(f, width / 2, 22, "middle", 15, 0, title);
  }
}

void svg_end(FILE *f) { fputs("</svg>\n", f); }

/* A round step (1, 2 or 5 times a power of ten) of at least raw. */
static double nice_step(double raw) {
  if (!(raw > 0) || !isfinite(raw)) return 1;
  double p = pow(10, floor(log10(raw))), m = raw / p;
  return (m <= 1 ? 1 : m <= 2 ? 2 : m <= 5 ? 5 : 10) * p;
}

static void tick_label(char *buf, size_t cap, double v, enum svg_tick_format fmt) {
  static const char *const units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  if (fmt == SVG_TICK_BYTES) {
    size_t u = 0;
    while (v >= 1024 && u + 1 < sizeof units / sizeof units[0]) v /= 1024, u++;
    snprintf(buf, cap, "%g %s", v, units[u]);
  } else {
    snprintf(buf, cap, "%g", v);
  }
}

void svg_draw_line_chart(FILE *f, const svg_line_chart *c) {
  double xmin = INFINITY, xmax = -INFINITY, ymax = 0;
  for (size_t s = 0; s < c->nseries; s++)
    for (size_t i = 0; i < c->series[s].n; i++) {
      double x = c->series[s].x[i], y = c->series[s].y[i];
      if (!(x > 0) || !isfinite(x) || !isfinite(y)) continue;
      if (x < xmin) xmin = x;
      if (x > xmax) xmax = x;
      if (y > ymax) ymax = y;
    }
  if (!(xmin <= xmax)) xmin = 1, xmax = 2;
  double lx0 = log2(xmin) - 0.2, lx1 = log2(xmax) + 0.2;
  double ystep = nice_step((ymax > 0 ? ymax * 1.05 : 1) / 5);
  double ytop = ceil((ymax > 0 ? ymax * 1.05 : 1) / ystep) * ystep;
  /* The plot area inside the box; the legend rows go under the x label. */
  double left = c->x + 64, right = c->x + c->width - 16, top = c->y + 36;
  double bottom = c->y + c->height - 44 - 18.0 * (double)c->nseries;
  if (bottom < top + 40) bottom = top + 40;
#define PX(v) (left + (log2(v) - lx0) / (lx1 - lx0) * (right - left))
#define PY(v) (bottom - (v) / ytop * (bottom - top))
  fputs("<g>\n", f);
  if (c->title) text(f, (left + right) / 2, c->y + 22, "middle", 13, 0, c->title);
  char label[64];
  for (double v = 0; v <= ytop + ystep / 2; v += ystep) {
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#dddddd\"/>\n", left, PY(v), right,
            PY(v));
    tick_label(label, sizeof label, v, SVG_TICK_NUMBER);
    text(f, left - 6, PY(v) + 4, "end", 11, 0, label);
  }
  long k0 = (long)ceil(log2(xmin)), k1 = (long)floor(log2(xmax));
  long kstep = (k1 - k0) > 12 ? 2 : 1;
  for (long k = k0; k <= k1; k += kstep) {
    double v = ldexp(1, (int)k);
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#dddddd\"/>\n", PX(v), top, PX(v),
            bottom);
    tick_label(label, sizeof label, v, c->xticks);
    text(f, PX(v), bottom + 16, "middle", 11, 0, label);
  }
  fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" stroke=\"black\"/>\n", left,
          top, right - left, bottom - top);
  if (c->xlabel) text(f, (left + right) / 2, bottom + 34, "middle", 12, 0, c->xlabel);
  if (c->ylabel) text(f, c->x + 16, (top + bottom) / 2, "middle", 12, -90, c->ylabel);
  for (size_t s = 0; s < c->nseries; s++) {
    const svg_series *sr = &c->series[s];
    const char *colour = palette[s % PALETTE_N];
    const char *dash = sr->dashed ? " stroke-dasharray=\"6 4\"" : "";
    fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2\"%s points=\"", colour, dash);
    for (size_t i = 0; i < sr->n; i++)
      if (sr->x[i] > 0 && isfinite(sr->x[i]) && isfinite(sr->y[i]))
        fprintf(f, "%s%.1f,%.1f", i ? " " : "", PX(sr->x[i]), PY(sr->y[i]));
    fputs("\"><title>", f); /* the series' name, shown on hover */
    svg_escape(f, sr->name ? sr->name : "");
    fputs("</title></polyline>\n", f);
    for (size_t i = 0; !sr->dashed && i < sr->n; i++)
      if (sr->x[i] > 0 && isfinite(sr->x[i]) && isfinite(sr->y[i]))
        fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"%s\"/>\n", PX(sr->x[i]), PY(sr->y[i]), colour);
    double ly = bottom + 52 + 18.0 * (double)s;
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" stroke-width=\"2\"%s/>\n",
            left, ly - 4, left + 28, ly - 4, colour, dash);
    text(f, left + 36, ly, "start", 12, 0, sr->name ? sr->name : "");
  }
  fputs("</g>\n", f);
#undef PX
#undef PY
}

/* Timeline layout, in pixels. */
#define TL_LABEL_W 190.0
#define TL_ROW_H 16.0
#define TL_LEGEND_W 170.0

static size_t legend_per_row(const svg_timeline *t) {
  size_t n = (size_t)((t->width - 40) / TL_LEGEND_W);
  return n ? n : 1;
}

static double timeline_top(const svg_timeline *t) {
  size_t per = legend_per_row(t), rows = (t->nsteps + per - 1) / per;
  return 34 + (t->note ? 18 : 0) + 18.0 * (double)rows + 10;
}

double svg_timeline_height(const svg_timeline *t) { return timeline_top(t) + TL_ROW_H * (double)t->nrows + 56; }

void svg_write_timeline(FILE *f, const svg_timeline *t) {
  double height = svg_timeline_height(t), top = timeline_top(t);
  double left = TL_LABEL_W, right = t->width - 20, bottom = top + TL_ROW_H * (double)t->nrows;
  svg_begin(f, t->width, height, t->title);
  if (t->note) text(f, t->width / 2, 40, "middle", 12, 0, t->note);
  size_t per = legend_per_row(t);
  double ly0 = 34 + (t->note ? 18 : 0) + 14;
  for (size_t s = 0; s < t->nsteps; s++) {
    double lx = 20 + TL_LEGEND_W * (double)(s % per), ly = ly0 + 18.0 * (double)(s / per);
    fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"14\" height=\"10\" fill=\"%s\"/>\n", lx, ly - 9,
            palette[s % PALETTE_N]);
    char name[96];
    snprintf(name, sizeof name, "until %s", t->step_names[s]);
    text(f, lx + 18, ly, "start", 11, 0, name);
  }
  double tmax = 0;
  for (size_t r = 0; r < t->nrows; r++)
    for (size_t i = 0; i < t->rows[r].n; i++)
      if (isfinite(t->rows[r].t_ms[i]) && t->rows[r].t_ms[i] > tmax) tmax = t->rows[r].t_ms[i];
  double step = nice_step((tmax > 0 ? tmax : 1) / 8), tend = ceil((tmax > 0 ? tmax : 1) / step) * step;
#define TX(v) (left + (v) / tend * (right - left))
  char label[64];
  for (double v = 0; v <= tend + step / 2; v += step) {
    fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#dddddd\"/>\n", TX(v), top, TX(v),
            bottom);
    tick_label(label, sizeof label, v, SVG_TICK_NUMBER);
    text(f, TX(v), bottom + 16, "middle", 11, 0, label);
  }
  text(f, (left + right) / 2, bottom + 36, "middle", 12, 0, "ms since the request's first step on its own side");
  for (size_t r = 0; r < t->nrows; r++) {
    const svg_timeline_row *row = &t->rows[r];
    double y = top + TL_ROW_H * (double)r;
    text(f, left - 6, y + TL_ROW_H - 4, "end", 11, 0, row->label ? row->label : "");
    for (size_t i = 0; i < row->n; i++) {
      double t1 = row->t_ms[i], t0 = i ? row->t_ms[i - 1] : t1;
      if (!isfinite(t0) || !isfinite(t1) || t1 < 0) continue;
      const char *colour = palette[row->step[i] % PALETTE_N];
      const char *name = row->step[i] < t->nsteps ? t->step_names[row->step[i]] : "?";
      if (i == 0) {
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\"/>\n", TX(t1), y + 2,
                TX(t1), y + TL_ROW_H - 2, colour);
        continue;
      }
      double w = TX(t1) - TX(t0);
      fprintf(f, "<rect x=\"%.2f\" y=\"%.1f\" width=\"%.2f\" height=\"%.1f\" fill=\"%s\"><title>", TX(t0), y + 3,
              w < 1 ? 1 : w, TL_ROW_H - 6, colour);
      svg_escape(f, name);
      fprintf(f, ": +%.3f ms (at %.3f ms)</title></rect>\n", t1 - t0, t1);
    }
  }
  fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" stroke=\"black\"/>\n", left,
          top, right - left, bottom - top);
#undef TX
  svg_end(f);
}

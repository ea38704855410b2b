/* The text of a GET /metrics page (Prometheus exposition format 0.0.4):
 * a growing buffer with an upper bound, and the regrouping of the lines
 * that several sources write (kvf_bootstrap_server_add_metrics: e.g. one KV
 * manager each) so that every metric family appears once, as one group,
 * with at most one HELP and one TYPE line — what strict scrapers demand.
 * Internal to the bootstrap layer; no locking (one page per request). */
#ifndef KVF_BOOTSTRAP_METRICS_TEXT_H
#define KVF_BOOTSTRAP_METRICS_TEXT_H

#include <stddef.h>

/* A buffer of at most `max` bytes (NUL included). Once an append does not
 * fit (or memory runs out) it is `full`: later appends are dropped, and
 * kvf__mtext_finish cuts the text back to its last whole line. */
typedef struct mtext {
  char *buf;
  size_t n, cap, max;
  int full;
} mtext;

void kvf__mtext_init(mtext *t, size_t max);
void kvf__mtext_free(mtext *t);
void kvf__mtext_append(mtext *t, const char *s, size_t len);
void kvf__mtext_appendf(mtext *t, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
/* Cut a full buffer back to its last newline; NUL-terminates. */
void kvf__mtext_finish(mtext *t);

/* Append the lines of in[0..len) to out grouped by metric family, families
 * in the order they first appear: the first HELP and TYPE line of each, then
 * all of its samples in their order. A sample named <base>_bucket, _sum or
 * _count belongs to family <base> when <base> was declared a histogram or
 * summary. Other comments and blank lines are dropped; a last line without
 * its newline is dropped (a source cut short). */
void kvf__metrics_group(const char *in, size_t len, mtext *out);

#endif

/* GET /metrics text: a bounded growing buffer and the regrouping of
 * several sources' lines by metric family (metrics_text.h). */
#include "bootstrap/metrics_text.h"

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define MTEXT_FIRST_CAP 4096

void kvf__mtext_init(mtext *t, size_t max) { *t = (mtext){.max = max}; }

void kvf__mtext_free(mtext *t) {
  free(t->buf);
  *t = (mtext){0};
}

/* Room for `more` bytes and the NUL; 0, or -1 (and full) past max. */
static int mtext_reserve(mtext *t, size_t more) {
  if (t->full) return -1;
  size_t need = t->n + more + 1;
  if (need <= t->cap) return 0;
  if (need > t->max) {
    t->full = 1;
    return -1;
  }
  size_t cap = t->cap ? t->cap : MTEXT_FIRST_CAP;
  while (cap < need) cap *= 2;
  if (cap > t->max) cap = t->max;
  char *b = realloc(t->buf, cap);
  if (!b) {
    t->full = 1;
    return -1;
  }
  t->buf = b;
  t->cap = cap;
  return 0;
}

void kvf__mtext_append(mtext *t, const char *s, size_t len) {
  int was_full = t->full;
  if (!mtext_reserve(t, len)) {
    memcpy(t->buf + t->n, s, len);
    t->n += len;
    t->buf[t->n] = '\0';
    return;
  }
  /* Just became full: keep what fits (kvf__mtext_finish cuts it back to a
   * whole line); nothing is written after that. Full for want of memory
   * rather than room, all of s may fit: never copy more than len. */
  if (was_full || t->n + 1 >= t->max) return;
  char *b = t->cap < t->max ? realloc(t->buf, t->max) : t->buf;
  if (!b) return;
  t->buf = b;
  t->cap = t->max;
  size_t take = t->max - t->n - 1 < len ? t->max - t->n - 1 : len;
  memcpy(t->buf + t->n, s, take);
  t->n += take;
  t->buf[t->n] = '\0';
}

void kvf__mtext_appendf(mtext *t, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  int w = vsnprintf(NULL, 0, fmt, ap);
  va_end(ap);
  if (w < 0 || mtext_reserve(t, (size_t)w)) return;
  va_start(ap, fmt);
  vsnprintf(t->buf + t->n, t->cap - t->n, fmt, ap);
  va_end(ap);
  t->n += (size_t)w;
}

void kvf__mtext_finish(mtext *t) {
  if (t->full) {
    while (t->n && t->buf[t->n - 1] != '\n') t->n--;
  }
  if (!t->buf && mtext_reserve(t, 0)) return;
  t->buf[t->n] = '\0';
}

/* ---- regrouping by family ---- */

typedef struct family {
  const char *name;
  size_t nlen;
  int hist;                /* declared histogram or summary */
  const char *help, *type; /* their first lines (with newline), or NULL */
  size_t help_len, type_len;
  mtext samples;
} family;

typedef struct families {
  family *f;
  size_t n, cap;
} families;

static size_t name_len(const char *s, size_t len) {
  size_t i = 0;
  while (i < len && (s[i] == '_' || s[i] == ':' || (s[i] >= 'a' && s[i] <= 'z') || (s[i] >= 'A' && s[i] <= 'Z') ||
                     (i && s[i] >= '0' && s[i] <= '9')))
    i++;
  return i;
}

static family *find(families *fs, const char *name, size_t nlen) {
  for (size_t i = 0; i < fs->n; i++)
    if (fs->f[i].nlen == nlen && !memcmp(fs->f[i].name, name, nlen)) return &fs->f[i];
  return NULL;
}

static family *find_or_add(families *fs, const char *name, size_t nlen, size_t max) {
  family *f = find(fs, name, nlen);
  if (f) return f;
  if (fs->n == fs->cap) {
    size_t cap = fs->cap ? 2 * fs->cap : 16;
    family *nf = realloc(fs->f, cap * sizeof *nf);
    if (!nf) return NULL;
    fs->f = nf;
    fs->cap = cap;
  }
  f = &fs->f[fs->n++];
  *f = (family){.name = name, .nlen = nlen};
  kvf__mtext_init(&f->samples, max);
  return f;
}

/* The family of a sample: <base> for <base>_bucket/_sum/_count of a declared
 * histogram or summary, else its own name. */
static family *sample_family(families *fs, const char *name, size_t nlen, size_t max) {
  static const char *const suffixes[] = {"_bucket", "_sum", "_count"};
  for (size_t k = 0; k < sizeof suffixes / sizeof suffixes[0]; k++) {
    size_t sl = strlen(suffixes[k]);
    if (nlen <= sl || memcmp(name + nlen - sl, suffixes[k], sl)) continue;
    family *base = find(fs, name, nlen - sl);
    if (base && base->hist) return base;
  }
  return find_or_add(fs, name, nlen, max);
}

/* "# HELP name ..." / "# TYPE name kind": 1 (help), 2 (type) or 0, with the name. */
static int directive(const char *l, size_t len, const char **name, size_t *nlen) {
  int kind = len > 7 && !memcmp(l, "# HELP ", 7) ? 1 : len > 7 && !memcmp(l, "# TYPE ", 7) ? 2 : 0;
  if (!kind) return 0;
  *name = l + 7;
  *nlen = name_len(*name, len - 7);
  return *nlen ? kind : 0;
}

static int declares_hist(const char *l, size_t len) {
  return (len >= 10 && !memcmp(l + len - 10, " histogram", 10)) ||
         (len >= 8 && !memcmp(l + len - 8, " summary", 8));
}

void kvf__metrics_group(const char *in, size_t len, mtext *out) {
  families fs = {0};
  for (size_t at = 0; at < len;) {
    const char *l = in + at, *nl = memchr(l, '\n', len - at);
    if (!nl) break; /* a line cut short */
    size_t ll = (size_t)(nl - l), with_nl = ll + 1;
    at += with_nl;
    const char *name;
    size_t nlen;
    if (l[0] == '#') {
      int kind = directive(l, ll, &name, &nlen);
      family *f = kind ? find_or_add(&fs, name, nlen, out->max) : NULL;
      if (f && kind == 1 && !f->help) f->help = l, f->help_len = with_nl;
      if (f && kind == 2 && !f->type) f->type = l, f->type_len = with_nl, f->hist = declares_hist(l, ll);
      continue;
    }
    if (!(nlen = name_len(l, ll))) continue; /* blank or not a sample */
    family *f = sample_family(&fs, l, nlen, out->max);
    if (f) kvf__mtext_append(&f->samples, l, with_nl);
    else kvf__mtext_append(out, l, with_nl); /* no memory for a family: ungrouped rather than lost */
  }
  for (size_t i = 0; i < fs.n; i++) {
    family *f = &fs.f[i];
    kvf__mtext_finish(&f->samples);
    if (f->help) kvf__mtext_append(out, f->help, f->help_len);
    if (f->type) kvf__mtext_append(out, f->type, f->type_len);
    if (f->samples.n) kvf__mtext_append(out, f->samples.buf, f->samples.n);
    kvf__mtext_free(&f->samples);
  }
  free(fs.f);
}

/* See parse.h. */
#include "base/parse.h"

#include <string.h>

static int is_space(char c) { return c == ' ' || c == '\t' || c == '\n' || c == '\r'; }

int kvf__parse_i64(const char *s, size_t len, unsigned flags, int64_t *out) {
  size_t i = 0;
  if (!s) return KVF_INT_EMPTY;
  if (flags & KVF_INT_LENIENT) {
    while (i < len && is_space(s[i])) i++;
    while (len > i && is_space(s[len - 1])) len--;
  }
  if (i == len) return KVF_INT_EMPTY;
  int neg = s[i] == '-';
  if (neg || ((flags & KVF_INT_LENIENT) && s[i] == '+')) i++;
  if (i == len) return KVF_INT_SYNTAX;
  for (size_t k = i; k < len; k++)
    if (s[k] < '0' || s[k] > '9') return KVF_INT_SYNTAX;
  if ((flags & KVF_INT_CANONICAL) && s[i] == '0' && (len - i > 1 || neg)) return KVF_INT_NONCANON;
  uint64_t limit = neg ? (uint64_t)INT64_MAX + 1 : (uint64_t)INT64_MAX, acc = 0;
  for (; i < len; i++) {
    uint64_t d = (uint64_t)(s[i] - '0');
    if (acc > (limit - d) / 10) return KVF_INT_RANGE;
    acc = acc * 10 + d;
  }
  if (!neg) *out = (int64_t)acc;
  else if (acc == (uint64_t)INT64_MAX + 1) *out = INT64_MIN;
  else *out = -(int64_t)acc;
  return KVF_INT_OK;
}

int kvf__ct_equal(const void *a, size_t alen, const void *b, size_t blen) {
  const unsigned char *x = a, *y = b;
  unsigned char diff = (unsigned char)(alen != blen);
  for (size_t i = 0; i < alen; i++) diff |= (unsigned char)(x[i] ^ (blen ? y[i < blen ? i : 0] : 0));
  return diff == 0;
}

size_t kvf__fmt_i64(char *out, int64_t v) {
  char rev[KVF_I64_DIGITS_MAX];
  size_t n = 0, k = 0;
  uint64_t u = v < 0 ? 0 - (uint64_t)v : (uint64_t)v; /* INT64_MIN too */
  do {
    rev[n++] = (char)('0' + u % 10);
    u /= 10;
  } while (u);
  if (v < 0) out[k++] = '-';
  while (n) out[k++] = rev[--n];
  return k;
}

size_t kvf__str_copy(char *dst, size_t cap, const char *src) {
  if (!cap) return 0;
  size_t n = src ? strnlen(src, cap - 1) : 0;
  memcpy(dst, src ? src : "", n);
  dst[n] = 0;
  return n;
}

/* Strict parsing and comparison of untrusted text, one definition each for
 * the whole library: the decimal integer parser (environment and config
 * values, wire frames, route JSON, HTTP headers), the constant-time
 * comparison of secrets (bootstrap bearer tokens, control-plane MACs), and
 * the bounded string copy.
 * Pure functions, any thread, no allocation. */
#ifndef KVF_BASE_PARSE_H
#define KVF_BASE_PARSE_H

#include <stddef.h>
#include <stdint.h>

/* kvf__parse_i64's verdicts (0 = accepted; not KVF_E* codes: callers that
 * report to a peer name the exact rule that was broken). */
enum { KVF_INT_OK = 0, KVF_INT_EMPTY, KVF_INT_SYNTAX, KVF_INT_NONCANON, KVF_INT_RANGE };

/* Flags of kvf__parse_i64. Without flags: an optional '-', then decimal
 * digits only, within int64. */
#define KVF_INT_CANONICAL 1u /* refuse leading zeros and "-0" (Python's str(int)) */
#define KVF_INT_LENIENT 2u   /* Python's int(str): surrounding whitespace and a '+' sign allowed */

/* Parse s[0..len) (no NUL needed) as a decimal int64 under `flags`; *out is
 * written only on KVF_INT_OK. */
int kvf__parse_i64(const char *s, size_t len, unsigned flags, int64_t *out);

/* Write v in decimal to out (at least KVF_I64_DIGITS_MAX bytes; no NUL),
 * exactly as printf's "%" PRId64 does; returns the length. */
#define KVF_I64_DIGITS_MAX 20
size_t kvf__fmt_i64(char *out, int64_t v);

/* 1 when a[0..alen) equals b[0..blen), in time that depends only on alen
 * (the secret's length), never on where the inputs differ. */
int kvf__ct_equal(const void *a, size_t alen, const void *b, size_t blen);

/* Copy the string src (NULL: "") into dst of `cap` bytes, truncated to
 * cap - 1 and always NUL-terminated when cap > 0; returns the length
 * copied. What snprintf(dst, cap, "%s", src) does, without the format
 * machinery (per-message and per-room paths copy peer names). */
size_t kvf__str_copy(char *dst, size_t cap, const char *src);

#endif

/* Growable parameter structs and setting their fields by name (config.h). */
#include "base/config.h"

#include <errno.h>
#include <limits.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "base/env.h"
#include "kvferry/common.h"

int kvf__config_copy(void *dst, size_t dst_size, const void *src, size_t min_size) {
  size_t n;
  memcpy(&n, src, sizeof n);
  if (n < min_size || n > dst_size) return KVF_EINVAL;
  memcpy(dst, src, n);
  memcpy(dst, &dst_size, sizeof dst_size); /* the copy is a full current struct */
  return 0;
}

static int parse_double(const char *s, double *out) {
  if (!s || !*s) return KVF_EINVAL;
  char *end = NULL;
  errno = 0;
  double v = strtod(s, &end);
  if (errno || *end || !isfinite(v)) return KVF_EINVAL;
  *out = v;
  return 0;
}

int kvf__config_set(void *cfg, size_t min_size, size_t max_size, const kvf__field *fields, size_t nfields,
                    const char *name, const char *value) {
  if (!cfg || !name) return KVF_EINVAL;
  size_t size;
  memcpy(&size, cfg, sizeof size);
  if (size < min_size || size > max_size) return KVF_EINVAL;
  const kvf__field *f = NULL;
  for (size_t i = 0; i < nfields && !f; i++)
    if (!strcmp(fields[i].name, name)) f = &fields[i];
  if (!f) return KVF_ENOTFOUND;
  if (f->offset >= size) return KVF_ENOTFOUND; /* newer than the caller's struct */
  char *p = (char *)cfg + f->offset;
  int64_t v = 0;
  double d = 0;
  if (f->type == KVF__FIELD_STR) {
    memcpy(p, &value, sizeof value);
    return 0;
  }
  if (f->type == KVF__FIELD_DOUBLE) {
    if (parse_double(value, &d)) return KVF_EINVAL;
    memcpy(p, &d, sizeof d);
    return 0;
  }
  if (!value || env_parse_i64(value, &v)) return KVF_EINVAL;
  switch (f->type) {
    case KVF__FIELD_INT: {
      if (v < INT_MIN || v > INT_MAX) return KVF_EINVAL;
      int x = (int)v;
      memcpy(p, &x, sizeof x);
      return 0;
    }
    case KVF__FIELD_UINT: {
      if (v < 0 || (uint64_t)v > UINT_MAX) return KVF_EINVAL;
      unsigned x = (unsigned)v;
      memcpy(p, &x, sizeof x);
      return 0;
    }
    case KVF__FIELD_U16: {
      if (v < 0 || v > UINT16_MAX) return KVF_EINVAL;
      uint16_t x = (uint16_t)v;
      memcpy(p, &x, sizeof x);
      return 0;
    }
    case KVF__FIELD_SIZE: {
      if (v < 0) return KVF_EINVAL;
      size_t x = (size_t)v;
      memcpy(p, &x, sizeof x);
      return 0;
    }
    default: return KVF_EINVAL;
  }
}

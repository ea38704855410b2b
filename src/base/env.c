/* Environment overrides (see env.h). */
#include "base/env.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "base/log.h"
#include "base/parse.h"

int kvf__env_parse_i64(const char *s, int64_t *out) {
  return s && kvf__parse_i64(s, strlen(s), 0, out) == KVF_INT_OK ? 0 : KVF_EINVAL;
}

int64_t kvf__env_get_int(const char *name, int64_t def) {
  const char *v = getenv(name);
  if (!v || !*v) return def;
  int64_t out;
  if (kvf__env_parse_i64(v, &out) == 0) return out;
  LOG_WARN("env", "%s=%s is not an integer; using %lld", name, v, (long long)def);
  return def;
}

double kvf__env_get_double(const char *name, double def) {
  const char *v = getenv(name);
  if (!v || !*v) return def;
  char *end = NULL;
  errno = 0;
  double d = strtod(v, &end);
  if (errno || end == v || *end) {
    LOG_WARN("env", "%s=%s is not a number; using %g", name, v, def);
    return def;
  }
  return d;
}

int kvf__env_get_bool(const char *name, int def) {
  const char *v = getenv(name);
  if (!v || !*v) return def;
  if (!strcasecmp(v, "true") || !strcmp(v, "1") || !strcasecmp(v, "yes") || !strcasecmp(v, "y")) return 1;
  if (!strcasecmp(v, "false") || !strcmp(v, "0") || !strcasecmp(v, "no") || !strcasecmp(v, "n")) return 0;
  LOG_WARN("env", "%s=%s is not a boolean; using %s", name, v, def ? "true" : "false");
  return def;
}

/* Configuration overrides from the environment. Unset means "keep the
 * default"; an unparsable value logs a warning and keeps the default, as the
 * tokenspeed env helper does. */
#ifndef KVF_BASE_ENV_H
#define KVF_BASE_ENV_H

#include <stdint.h>

int64_t kvf__env_get_int(const char *name, int64_t def);
double kvf__env_get_double(const char *name, double def);
/* true/1/yes/y and false/0/no/n, case-insensitive. */
int kvf__env_get_bool(const char *name, int def);
/* Strict decimal integer parse of the whole string (optional '-', no spaces).
 * Returns 0 and sets *out on success, KVF_EINVAL otherwise. */
int kvf__env_parse_i64(const char *s, int64_t *out);

#endif

/* Growable public parameter structs. Every public config/params struct
 * starts with `size_t size`, set by its *_init function to the sizeof the
 * caller was compiled with. The library copies the caller's struct over its
 * own defaults for the first `size` bytes, so a program built against older
 * headers (smaller struct) gets defaults for the newer fields, and a struct
 * that was never initialised (size 0 or garbage) is refused.
 *
 * Field tables let bindings set fields by name (kvf_*_config_set): one row
 * per settable member, with its text-form parser. Pure functions, any
 * thread. */
#ifndef KVF_BASE_CONFIG_H
#define KVF_BASE_CONFIG_H

#include <stddef.h>
#include <stdint.h>

/* Copy src (whose first member is its size) over dst (dst_size bytes,
 * already filled with defaults). 0, or KVF_EINVAL when src->size is below
 * min_size (the first version of the struct) or above dst_size (headers
 * newer than this library). */
int kvf__config_copy(void *dst, size_t dst_size, const void *src, size_t min_size);

typedef enum kvf__field_type {
  KVF__FIELD_STR,    /* const char * (pointer stored, not copied) */
  KVF__FIELD_INT,    /* int */
  KVF__FIELD_UINT,   /* unsigned */
  KVF__FIELD_U16,    /* uint16_t */
  KVF__FIELD_SIZE,   /* size_t */
  KVF__FIELD_DOUBLE, /* double */
} kvf__field_type;

typedef struct kvf__field {
  const char *name;
  kvf__field_type type;
  size_t offset;
} kvf__field;

#define KVF__FIELD(type_, member, kind) {#member, kind, offsetof(type_, member)}

/* Set the field `name` of the struct at cfg from `value` (decimal numbers,
 * doubles as strtod reads them, without trailing garbage). cfg's first
 * member is its size: KVF_EINVAL when it is not min_size..max_size.
 * KVF_ENOTFOUND for an unknown name, KVF_EINVAL for a bad value. */
int kvf__config_set(void *cfg, size_t min_size, size_t max_size, const kvf__field *fields, size_t nfields,
                    const char *name, const char *value);

#endif

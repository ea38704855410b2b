/* Hash maps used by every table in the library: `map` with 64-bit keys
 * (rooms) and `smap` with string keys (sessions, addresses). Chained, grows
 * by doubling, not thread-safe: callers hold their own lock. Iteration with
 * kvf__map_next/kvf__smap_next tolerates deleting the current entry. */
#ifndef KVF_BASE_MAP_H
#define KVF_BASE_MAP_H

#include <stddef.h>
#include <stdint.h>

#include "base/spare.h"

typedef struct map_node {
  struct map_node *next;
  uint64_t hash;
  uint64_t key;
  char *skey; /* owned copy, smap only */
  void *val;
} map_node;

typedef struct map {
  map_node **buckets;
  size_t nbuckets;
  size_t size;
  spare_list spare; /* nodes of deleted entries, for the next inserts */
} map;

typedef struct map_iter {
  size_t bucket;
  map_node *node, *next;
} map_iter;

int kvf__map_init(map *m);
/* Frees the nodes, not the values (use kvf__map_next to free values first). */
void kvf__map_free(map *m);
size_t kvf__map_size(const map *m);

void *kvf__map_get(const map *m, uint64_t key);
int kvf__map_has(const map *m, uint64_t key);
/* Insert or replace; *old (may be NULL) gets the replaced value or NULL. */
int kvf__map_put(map *m, uint64_t key, void *val, void **old);
/* Returns 1 and sets *val (may be NULL) if the key was present, else 0. */
int kvf__map_del(map *m, uint64_t key, void **val);

void kvf__map_iter_init(map_iter *it);
/* Returns 1 with *key and *val set for the next entry, 0 at the end. */
int kvf__map_next(const map *m, map_iter *it, uint64_t *key, void **val);

/* String-keyed: same structure, keys are copied and owned by the map. */
typedef map smap;
#define smap_init kvf__map_init
void kvf__smap_free(smap *m);
#define smap_size kvf__map_size
void *kvf__smap_get(const smap *m, const char *key);
int kvf__smap_put(smap *m, const char *key, void *val, void **old);
int kvf__smap_del(smap *m, const char *key, void **val);
int kvf__smap_next(const smap *m, map_iter *it, const char **key, void **val);

#endif

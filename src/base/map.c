/* Chained hash maps (see map.h). */
#include "base/map.h"

#include <stdlib.h>
#include <string.h>

#include "base/hash.h"
#include "kvferry/common.h"

static uint64_t hash_u64(uint64_t x) {
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  return x;
}

int kvf__map_init(map *m) {
  m->nbuckets = 16;
  m->size = 0;
  m->spare = (spare_list){0};
  m->buckets = calloc(m->nbuckets, sizeof *m->buckets);
  return m->buckets ? 0 : KVF_ENOMEM;
}

static void free_nodes(map *m) {
  for (size_t i = 0; m->buckets && i < m->nbuckets; i++) {
    map_node *n = m->buckets[i];
    while (n) {
      map_node *next = n->next;
      free(n->skey);
      free(n);
      n = next;
    }
  }
  kvf__spare_free(&m->spare);
  free(m->buckets);
  m->buckets = NULL;
  m->nbuckets = m->size = 0;
}

void kvf__map_free(map *m) { free_nodes(m); }
void kvf__smap_free(smap *m) { free_nodes(m); }
size_t kvf__map_size(const map *m) { return m->size; }

static int grow(map *m) {
  size_t nb = m->nbuckets * 2;
  map_node **b = calloc(nb, sizeof *b);
  if (!b) return KVF_ENOMEM;
  for (size_t i = 0; i < m->nbuckets; i++) {
    map_node *n = m->buckets[i];
    while (n) {
      map_node *next = n->next;
      size_t j = n->hash & (nb - 1);
      n->next = b[j];
      b[j] = n;
      n = next;
    }
  }
  free(m->buckets);
  m->buckets = b;
  m->nbuckets = nb;
  return 0;
}

static map_node **find(const map *m, uint64_t h, uint64_t key, const char *skey) {
  map_node **pp = &m->buckets[h & (m->nbuckets - 1)];
  for (; *pp; pp = &(*pp)->next) {
    map_node *n = *pp;
    if (n->hash != h) continue;
    if (skey ? (n->skey && strcmp(n->skey, skey) == 0) : (!n->skey && n->key == key)) return pp;
  }
  return pp;
}

static int put(map *m, uint64_t h, uint64_t key, const char *skey, void *val, void **old) {
  map_node **pp = find(m, h, key, skey);
  if (*pp) {
    if (old) *old = (*pp)->val;
    (*pp)->val = val;
    return 0;
  }
  map_node *n = kvf__spare_take(&m->spare, sizeof *n);
  if (!n) return KVF_ENOMEM;
  if (skey && !(n->skey = strdup(skey))) {
    free(n);
    return KVF_ENOMEM;
  }
  n->hash = h;
  n->key = key;
  n->val = val;
  *pp = n;
  m->size++;
  if (old) *old = NULL;
  if (m->size > m->nbuckets) grow(m); /* failure to grow only costs speed */
  return 0;
}

static int del(map *m, uint64_t h, uint64_t key, const char *skey, void **val) {
  map_node **pp = find(m, h, key, skey);
  if (!*pp) return 0;
  map_node *n = *pp;
  *pp = n->next;
  if (val) *val = n->val;
  free(n->skey);
  kvf__spare_give(&m->spare, n);
  m->size--;
  return 1;
}

void *kvf__map_get(const map *m, uint64_t key) {
  map_node **pp = find(m, hash_u64(key), key, NULL);
  return *pp ? (*pp)->val : NULL;
}
int kvf__map_has(const map *m, uint64_t key) { return *find(m, hash_u64(key), key, NULL) != NULL; }
int kvf__map_put(map *m, uint64_t key, void *val, void **old) {
  return put(m, hash_u64(key), key, NULL, val, old);
}
int kvf__map_del(map *m, uint64_t key, void **val) { return del(m, hash_u64(key), key, NULL, val); }

void *kvf__smap_get(const smap *m, const char *key) {
  map_node **pp = find(m, kvf__hash_str(key, 0), 0, key);
  return *pp ? (*pp)->val : NULL;
}
int kvf__smap_put(smap *m, const char *key, void *val, void **old) {
  return put(m, kvf__hash_str(key, 0), 0, key, val, old);
}
int kvf__smap_del(smap *m, const char *key, void **val) { return del(m, kvf__hash_str(key, 0), 0, key, val); }

void kvf__map_iter_init(map_iter *it) { memset(it, 0, sizeof *it); }

static map_node *iter_step(const map *m, map_iter *it) {
  map_node *n = it->next;
  while (!n) {
    if (it->bucket >= m->nbuckets) return NULL;
    n = m->buckets[it->bucket++];
  }
  it->node = n;
  it->next = n->next;
  return n;
}

int kvf__map_next(const map *m, map_iter *it, uint64_t *key, void **val) {
  map_node *n = iter_step(m, it);
  if (!n) return 0;
  if (key) *key = n->key;
  if (val) *val = n->val;
  return 1;
}

int kvf__smap_next(const smap *m, map_iter *it, const char **key, void **val) {
  map_node *n = iter_step(m, it);
  if (!n) return 0;
  if (key) *key = n->skey;
  if (val) *val = n->val;
  return 1;
}

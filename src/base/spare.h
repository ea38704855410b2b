/* Spare lists: freed objects of one size kept for reuse, so per-room records
 * cost no allocation once a table has seen its working set. Not
 * thread-safe: the owner's lock guards the list. */
#ifndef KVF_BASE_SPARE_H
#define KVF_BASE_SPARE_H

#include <stddef.h>

typedef struct spare_list {
  void *head; /* linked through each object's first pointer-sized bytes */
  size_t n;
} spare_list;

/* Objects kept per list at most; the rest are freed. */
#define SPARE_LIST_MAX 4096

/* A zeroed object of `size` bytes (at least a pointer's): a spare one or a
 * new one; NULL when out of memory. */
void *kvf__spare_take(spare_list *l, size_t size);
/* A kept object as it was left (not zeroed), or NULL when none is kept. */
void *kvf__spare_pop(spare_list *l);
/* Keep p for a later take (or free it when the list is full); p may be NULL. */
void kvf__spare_give(spare_list *l, void *p);
/* Free every object kept. */
void kvf__spare_free(spare_list *l);

#endif

/* Spare lists (see spare.h). */
#include "base/spare.h"

#include <stdlib.h>
#include <string.h>

void *kvf__spare_pop(spare_list *l) {
  void *p = l->head;
  if (!p) return NULL;
  memcpy(&l->head, p, sizeof l->head);
  l->n--;
  return p;
}

void *kvf__spare_take(spare_list *l, size_t size) {
  void *p = kvf__spare_pop(l);
  if (!p) return calloc(1, size);
  memset(p, 0, size);
  return p;
}

void kvf__spare_give(spare_list *l, void *p) {
  if (!p) return;
  if (l->n >= SPARE_LIST_MAX) {
    free(p);
    return;
  }
  memcpy(p, &l->head, sizeof l->head);
  l->head = p;
  l->n++;
}

void kvf__spare_free(spare_list *l) {
  while (l->head) {
    void *p = l->head;
    memcpy(&l->head, p, sizeof l->head);
    free(p);
  }
  l->n = 0;
}

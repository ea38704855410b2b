/* One TP rank's engine, KV pool and manager, made the same way by every
 * subcommand that runs ranks of its own (kv-decode, kv-idle): the pool comes
 * from the engine when its transport wants memory of its own
 * (cli_rank_engine), and whatever was made is undone again on failure. */
#include <stdio.h>

#include "testing/testpeer/testpeer.h"

int tp_rank_open(const char *who, const tp_pool_shape *s, kvf_manager_config *mc, tp_rank *r) {
  *r = (tp_rank){0};
  int use_pool = 0, rc = cli_rank_engine(mc->host, &r->e, &use_pool);
  if (rc) {
    fprintf(stderr, "%s: engine: %s\n", who, kvf_strerror(rc));
    return -1;
  }
  kvpool_use_engine(use_pool ? r->e : NULL);
  const size_t layers = (size_t)s->layers, page_size = (size_t)s->page_size, heads = (size_t)s->heads;
  rc = s->mla  ? kvpool_init_mla(&r->pool, layers, s->pages, page_size, s->unit)
       : heads ? kvpool_init_heads(&r->pool, layers, s->pages, page_size, heads, s->head0, s->unit)
               : kvpool_init(&r->pool, layers, s->pages, s->item);
  kvpool_use_engine(NULL);
  if (rc) {
    fprintf(stderr, "%s: cannot allocate a pool of %llu pages x %d buffers x %llu B\n", who, s->pages,
            s->mla ? s->layers : 2 * s->layers,
            s->mla  ? (unsigned long long)page_size * s->unit
            : heads ? (unsigned long long)page_size * heads * s->unit
                    : s->item);
    goto err_engine;
  }
  mc->engine = r->e;
  if ((rc = kvf_manager_create(mc, &r->pool.bufs, &r->m))) {
    fprintf(stderr, "%s: manager: %s\n", who, kvf_strerror(rc));
    goto err_pool;
  }
  return 0;
err_pool:
  kvpool_free(&r->pool);
err_engine:
  kvf_engine_destroy(r->e);
  *r = (tp_rank){0};
  return -1;
}

void tp_rank_close(tp_rank *r) {
  if (r->m) kvf_manager_destroy(r->m);
  kvpool_free(&r->pool);
  if (r->e) kvf_engine_destroy(r->e);
  *r = (tp_rank){0};
}

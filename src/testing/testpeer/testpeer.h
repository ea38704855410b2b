/* The test peer (`kvferry-testpeer`, built in the build tree, never
 * installed): the fixtures the tests, the fault suite, the demo and the
 * benchmarks run as real processes, one function per subcommand, each taking
 * the arguments after its name. */
#ifndef KVF_TESTING_TESTPEER_H
#define KVF_TESTING_TESTPEER_H

#include "kvferry.h"
#include "tools/kvpool.h"
#include "tools/util.h"

int cli_engine_peer(int argc, char **argv);
int cli_kv_peer(int argc, char **argv);
int cli_kv_decode(int argc, char **argv);
int cli_kv_idle(int argc, char **argv);

/* A rank's pool: plain (item bytes a page in each of 2 x layers buffers),
 * head-aware (heads > 0: page_size tokens of heads x unit bytes, from global
 * head head0) or MLA (mla: one latent buffer a layer, page_size tokens of
 * unit bytes). */
typedef struct tp_pool_shape {
  int layers, page_size, heads, mla;
  unsigned long long pages, item, unit;
  size_t head0;
} tp_pool_shape;

/* One rank: its engine, its pool (from that engine's memory where the
 * transport wants it) and its manager over them. */
typedef struct tp_rank {
  kvf_engine *e;
  kvpool pool;
  kvf_manager *m;
} tp_rank;

/* Make a rank (rank.c): an engine on mc->host, a pool of shape s, then a
 * manager of config mc (its engine set here). 0; -1 with the reason on
 * stderr after `who: `, nothing left made. The rank is the caller's, for
 * tp_rank_close; main thread only (kvpool_use_engine is process-wide). */
int tp_rank_open(const char *who, const tp_pool_shape *s, kvf_manager_config *mc, tp_rank *r);
/* Destroy what tp_rank_open made, manager first; a zeroed rank is fine. */
void tp_rank_close(tp_rank *r);

#endif

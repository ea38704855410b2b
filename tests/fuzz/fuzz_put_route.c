/* libFuzzer target for the bootstrap JSON codecs (src/wire/route_json.c): the
 * PUT /route body a server takes from any host on the network, and the two
 * replies a client takes from a server. A body that parses must re-encode to
 * a body that parses to the same registration, and every accepted value must
 * be inside the bounds the routing table relies on. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "wire/route_json.h"

static void check_bounds(const route_reg *r) {
  if (r->world_size < 1 || r->world_size > ROUTE_MAX_RANKS) abort();
  if (r->dp_size < 1 || r->dp_size > r->world_size || r->world_size % r->dp_size) abort();
  if (r->engine_rank < 0 || r->engine_rank >= r->world_size) abort();
  if (r->rank_port < 1 || r->rank_port > 65535) abort();
  if (!kvf__addr_host_valid(r->rank_ip, strlen(r->rank_ip))) abort();
  for (int i = 0; i < ROUTE_NLISTS; i++) {
    if (r->lists[i].n > ROUTE_MAX_LIST || (!r->lists[i].present && r->lists[i].n)) abort();
    for (size_t j = 0; j < r->lists[i].n; j++)
      if (r->lists[i].v[j] < 0) abort();
  }
}

static int same_reg(const route_reg *a, const route_reg *b) {
  if (strcmp(a->role, b->role) || strcmp(a->rank_ip, b->rank_ip)) return 0;
  if (a->world_size != b->world_size || a->dp_size != b->dp_size || a->rank_port != b->rank_port ||
      a->engine_rank != b->engine_rank || a->enable_mla_l1_5_cache != b->enable_mla_l1_5_cache)
    return 0;
  for (int i = 0; i < ROUTE_NLISTS; i++) {
    if (a->lists[i].present != b->lists[i].present || a->lists[i].n != b->lists[i].n) return 0;
    if (a->lists[i].n && memcmp(a->lists[i].v, b->lists[i].v, a->lists[i].n * sizeof(int64_t))) return 0;
  }
  return 1;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  const char *body = (const char *)data;
  route_reg r;
  char why[160];
  if (kvf__route_json_parse_put(body, size, &r, why, sizeof why) == 0) {
    check_bounds(&r);
    char *again = kvf__route_json_encode_put(&r);
    if (!again) abort();
    route_reg back;
    if (kvf__route_json_parse_put(again, strlen(again), &back, why, sizeof why) != 0) abort();
    if (!same_reg(&r, &back)) abort();
    kvf__route_reg_free(&back);
    free(again);
    kvf__route_reg_free(&r);
  } else if (!memchr(why, '\0', sizeof why)) {
    abort(); /* the reason must be a terminated string */
  }

  route_parallel_info p;
  if (kvf__route_json_parse_parallel_info(body, size, &p) == 0) {
    if ((p.world_size < 0) != (p.dp_size < 0)) abort();
    if (p.world_size > 0 && p.world_size % p.dp_size) abort();
    char *enc = kvf__route_json_encode_parallel_info(&p);
    if (!enc) abort();
    route_parallel_info back;
    if (kvf__route_json_parse_parallel_info(enc, strlen(enc), &back) != 0) abort();
    if (back.world_size != p.world_size || back.dp_size != p.dp_size) abort();
    kvf__route_parallel_info_free(&back);
    free(enc);
    kvf__route_parallel_info_free(&p);
  }

  char ip[KVF_ADDR_HOST_LEN];
  int port = 0;
  if (kvf__route_json_parse_rank(body, size, ip, sizeof ip, &port) == 0) {
    if (port < 1 || port > 65535 || !kvf__addr_host_valid(ip, strlen(ip))) abort();
  }

  int64_t v;
  (void)kvf__route_parse_int(body, size, &v);
  return 0;
}

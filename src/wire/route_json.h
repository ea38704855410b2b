/* JSON bodies of the bootstrap HTTP API (PROTOCOL §4): the PUT /route
 * registration a prefill rank sends, the parallel-info reply and the
 * rank-lookup reply. Parsing is strict and bounded because the PUT body comes
 * from the network (PROTOCOL §8 item 8): every size, rank, port and list
 * length is range-checked here, so the server only ever stores values it can
 * index with. The encoders write Python's default separators (", " and ": ")
 * like the reference peers; whitespace and key order are not significant to
 * any parser on either side. Pure functions, no I/O, any thread. */
#ifndef KVF_WIRE_ROUTE_JSON_H
#define KVF_WIRE_ROUTE_JSON_H

#include <stddef.h>
#include <stdint.h>

#include "base/addr.h"

/* Bounds on values a registration may carry. */
#define ROUTE_MAX_RANKS 4096 /* world_size (every rank of every DP group) */
#define ROUTE_MAX_LIST 4096  /* entries in one of the *_lens lists */
#define ROUTE_ROLE_MAX 63

/* The four optional per-buffer length lists, in the order they are sent,
 * and kvferry's page layout [tokens per page, 1 = token-major]: a kvferry
 * prefill rank sends it in its PUT; a parallel-info reply carries it only
 * when a rank sent it (so replies stay byte-identical to the reference's
 * otherwise, and a tokenspeed server simply drops it). Its presence tells a
 * kvferry decode that the prefill can cut heads per token (§6.5.7 caveat). */
enum {
  ROUTE_KV_ITEM_LENS,
  ROUTE_KV_UNIT_LENS,
  ROUTE_STATE_ITEM_LENS,
  ROUTE_STATE_UNIT_LENS,
  ROUTE_KVF_PAGE_LAYOUT,
  ROUTE_NLISTS
};
extern const char *const kvf__route_list_names[ROUTE_NLISTS];

/* A list of non-negative byte counts. `present` says whether the key was in
 * the body (absent lists keep the server's old value). After a parse `v` is
 * owned by the enclosing struct (freed by its _free function); for encoding
 * the caller's array is only read. */
typedef struct route_lens {
  int64_t *v;
  size_t n;
  int present;
} route_lens;

/* PUT /route body (PROTOCOL §4.2). */
typedef struct route_reg {
  char role[ROUTE_ROLE_MAX + 1];   /* "Prefill" for a prefill rank */
  int64_t world_size;              /* 1..ROUTE_MAX_RANKS */
  int64_t dp_size;                 /* 1..world_size, divides world_size */
  char rank_ip[KVF_ADDR_HOST_LEN]; /* an IPv4/IPv6 literal or a host name (kvf__addr_host_valid) */
  int64_t rank_port;               /* 1..65535 */
  int64_t engine_rank;             /* global rank, 0..world_size-1 */
  int enable_mla_l1_5_cache;
  route_lens lists[ROUTE_NLISTS];
} route_reg;

/* GET /route?engine_rank=-1&target_dp_group=-1 reply (PROTOCOL §4.3). */
typedef struct route_parallel_info {
  int64_t world_size; /* "prefill_tp_size" (really the world size); -1 = null */
  int64_t dp_size;    /* "prefill_dp_size"; -1 = null */
  int enable_mla_l1_5_cache;
  route_lens lists[ROUTE_NLISTS]; /* absent or null in the reply = empty */
} route_parallel_info;

/* Parse and validate a PUT /route body of `len` bytes (need not be
 * NUL-terminated). On success fills *out (free with kvf__route_reg_free) and
 * returns 0. On failure returns KVF_EINVAL (not JSON, missing key, wrong type,
 * value out of bounds) or KVF_ENOMEM, leaves *out untouched and writes a short
 * human-readable reason to `why` (may be NULL). Logs nothing: the caller knows
 * the peer. */
int kvf__route_json_parse_put(const char *body, size_t len, route_reg *out, char *why, size_t whylen);
void kvf__route_reg_free(route_reg *r);

/* True when the registration is from a prefill rank (role "Prefill"); only
 * those are stored in the rank table. */
int kvf__route_reg_is_prefill(const route_reg *r);

/* Encoders: return a malloc'd NUL-terminated string the caller frees, or NULL
 * when out of memory. Lists with present == 0 are left out of a PUT body and
 * sent as [] in a parallel-info reply. */
char *kvf__route_json_encode_put(const route_reg *r);
char *kvf__route_json_encode_parallel_info(const route_parallel_info *p);
char *kvf__route_json_encode_rank(const char *rank_ip, int64_t rank_port);

/* Parse a parallel-info reply. Returns 0 and fills *out (free with
 * kvf__route_parallel_info_free), or KVF_EPROTO for a malformed or inconsistent
 * reply, or KVF_ENOMEM. A server with no registration yet answers null sizes:
 * that parses fine with world_size = dp_size = -1. */
int kvf__route_json_parse_parallel_info(const char *body, size_t len, route_parallel_info *out);
void kvf__route_parallel_info_free(route_parallel_info *p);

/* Parse a rank-lookup reply {"rank_ip": str, "rank_port": int}. Returns 0
 * and fills ip (NUL-terminated, at most iplen-1 chars) and *port, or
 * KVF_EPROTO (malformed, or the address does not fit in iplen). */
int kvf__route_json_parse_rank(const char *body, size_t len, char *ip, size_t iplen, int *port);

/* Strict decimal integer the way the server reads query parameters and the
 * string form of rank_port/engine_rank (Python's int() on the common cases):
 * optional surrounding ASCII whitespace, optional sign, digits, no overflow.
 * Returns 0 and sets *out, or KVF_EINVAL. */
int kvf__route_parse_int(const char *s, size_t len, int64_t *out);

#endif

/* Codecs for the bootstrap JSON bodies (PROTOCOL §4.2-4.4), built on jansson.
 * The PUT parser is the only code that sees a registration before it reaches
 * the routing table, so it enforces every bound the table relies on; it is
 * fuzzed on its own (tests/fuzz/fuzz_put_route.c). Duplicate keys are refused:
 * a Python peer never sends them, and "last one wins" would let one body say
 * two things. */
#include "wire/route_json.h"

#include <jansson.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/parse.h"
#include "kvferry/common.h"

const char *const kvf__route_list_names[ROUTE_NLISTS] = {"kv_item_lens", "kv_unit_lens", "state_item_lens",
                                                         "state_unit_lens", "kvferry_kv_page_layout"};

static void set_why(char *why, size_t whylen, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void set_why(char *why, size_t whylen, const char *fmt, ...) {
  if (!why || !whylen) return;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, whylen, fmt, ap);
  va_end(ap);
}

int kvf__route_parse_int(const char *s, size_t len, int64_t *out) {
  return kvf__parse_i64(s, len, KVF_INT_LENIENT, out) == KVF_INT_OK ? 0 : KVF_EINVAL;
}

/* Python truthiness of a JSON value, which is what the reference stores for
 * enable_mla_l1_5_cache. */
static int json_truthy(const json_t *v) {
  switch (json_typeof(v)) {
    case JSON_NULL:
    case JSON_FALSE: return 0;
    case JSON_TRUE: return 1;
    case JSON_INTEGER: return json_integer_value(v) != 0;
    case JSON_REAL: return json_real_value(v) != 0.0;
    case JSON_STRING: return json_string_length(v) != 0;
    case JSON_ARRAY: return json_array_size(v) != 0;
    case JSON_OBJECT: return json_object_size(v) != 0;
  }
  return 0;
}

static json_t *load(const char *body, size_t len, char *why, size_t whylen) {
  json_error_t jerr;
  json_t *root = json_loadb(body, len, JSON_REJECT_DUPLICATES, &jerr);
  if (!root) {
    set_why(why, whylen, "body is not JSON: %s", jerr.text);
    return NULL;
  }
  if (!json_is_object(root)) {
    set_why(why, whylen, "body is not a JSON object");
    json_decref(root);
    return NULL;
  }
  return root;
}

/* A JSON integer; with `allow_string` also a decimal string, as the reference
 * runs int() over rank_port and engine_rank. Booleans and reals are refused
 * (Python would take them, but no peer sends them). */
static int get_int(json_t *obj, const char *key, int allow_string, int64_t *out, char *why, size_t whylen) {
  json_t *v = json_object_get(obj, key);
  if (!v) {
    set_why(why, whylen, "missing key '%s'", key);
    return KVF_EINVAL;
  }
  if (json_is_integer(v)) {
    *out = json_integer_value(v);
    return 0;
  }
  if (allow_string && json_is_string(v) &&
      kvf__route_parse_int(json_string_value(v), json_string_length(v), out) == 0)
    return 0;
  set_why(why, whylen, "'%s' is not an integer", key);
  return KVF_EINVAL;
}

static int check_range(const char *key, int64_t v, int64_t lo, int64_t hi, char *why, size_t whylen) {
  if (v >= lo && v <= hi) return 0;
  set_why(why, whylen, "'%s' = %lld is outside [%lld, %lld]", key, (long long)v, (long long)lo, (long long)hi);
  return KVF_EINVAL;
}

/* A list of non-negative integers, absent or null meaning "not sent". */
static int get_lens(json_t *obj, const char *key, route_lens *out, int err, char *why, size_t whylen) {
  json_t *v = json_object_get(obj, key);
  memset(out, 0, sizeof *out);
  if (!v || json_is_null(v)) return 0;
  if (!json_is_array(v)) {
    set_why(why, whylen, "'%s' is not a list", key);
    return err;
  }
  size_t n = json_array_size(v);
  if (n > ROUTE_MAX_LIST) {
    set_why(why, whylen, "'%s' has %zu entries, more than %d", key, n, ROUTE_MAX_LIST);
    return err;
  }
  int64_t *vals = NULL;
  if (n) {
    vals = calloc(n, sizeof *vals);
    if (!vals) {
      set_why(why, whylen, "out of memory");
      return KVF_ENOMEM;
    }
  }
  for (size_t i = 0; i < n; i++) {
    json_t *e = json_array_get(v, i);
    if (!json_is_integer(e) || json_integer_value(e) < 0) {
      set_why(why, whylen, "'%s'[%zu] is not a non-negative integer", key, i);
      free(vals);
      return err;
    }
    vals[i] = json_integer_value(e);
  }
  out->v = vals;
  out->n = n;
  out->present = 1;
  return 0;
}

static void free_lists(route_lens *lists) {
  for (int i = 0; i < ROUTE_NLISTS; i++) {
    free(lists[i].v);
    memset(&lists[i], 0, sizeof lists[i]);
  }
}

int kvf__route_json_parse_put(const char *body, size_t len, route_reg *out, char *why, size_t whylen) {
  route_reg r;
  memset(&r, 0, sizeof r);
  if (!body) {
    set_why(why, whylen, "empty body");
    return KVF_EINVAL;
  }
  json_t *root = load(body, len, why, whylen);
  if (!root) return KVF_EINVAL;
  int rc = KVF_EINVAL;

  json_t *role = json_object_get(root, "role");
  if (!role) {
    set_why(why, whylen, "missing key 'role'");
    goto err_free_json;
  }
  if (!json_is_string(role) || json_string_length(role) > ROUTE_ROLE_MAX ||
      strlen(json_string_value(role)) != json_string_length(role)) {
    set_why(why, whylen, "'role' is not a short string");
    goto err_free_json;
  }
  memcpy(r.role, json_string_value(role), json_string_length(role) + 1);

  /* world_size and dp_size are used by the reference without conversion, so
   * only JSON integers are valid; rank_port and engine_rank go through int(). */
  if ((rc = get_int(root, "world_size", 0, &r.world_size, why, whylen))) goto err_free_json;
  if ((rc = get_int(root, "dp_size", 0, &r.dp_size, why, whylen))) goto err_free_json;
  json_t *ip = json_object_get(root, "rank_ip");
  if (!ip) {
    set_why(why, whylen, "missing key 'rank_ip'");
    rc = KVF_EINVAL;
    goto err_free_json;
  }
  if (!json_is_string(ip) || !kvf__addr_host_valid(json_string_value(ip), json_string_length(ip)) ||
      strlen(json_string_value(ip)) != json_string_length(ip)) {
    set_why(why, whylen, "'rank_ip' is not an address");
    rc = KVF_EINVAL;
    goto err_free_json;
  }
  memcpy(r.rank_ip, json_string_value(ip), json_string_length(ip) + 1);
  if ((rc = get_int(root, "rank_port", 1, &r.rank_port, why, whylen))) goto err_free_json;
  if ((rc = get_int(root, "engine_rank", 1, &r.engine_rank, why, whylen))) goto err_free_json;
  json_t *mla = json_object_get(root, "enable_mla_l1_5_cache");
  if (!mla) {
    set_why(why, whylen, "missing key 'enable_mla_l1_5_cache'");
    rc = KVF_EINVAL;
    goto err_free_json;
  }
  r.enable_mla_l1_5_cache = json_truthy(mla);

  /* Bounds: the table is sized from world_size and indexed with engine_rank,
   * so these are what keep a bad PUT from growing or overrunning it. */
  rc = KVF_EINVAL;
  if (check_range("world_size", r.world_size, 1, ROUTE_MAX_RANKS, why, whylen)) goto err_free_json;
  if (check_range("dp_size", r.dp_size, 1, r.world_size, why, whylen)) goto err_free_json;
  if (r.world_size % r.dp_size) {
    set_why(why, whylen, "world_size %lld is not a multiple of dp_size %lld", (long long)r.world_size,
            (long long)r.dp_size);
    goto err_free_json;
  }
  if (check_range("rank_port", r.rank_port, 1, 65535, why, whylen)) goto err_free_json;
  if (check_range("engine_rank", r.engine_rank, 0, r.world_size - 1, why, whylen)) goto err_free_json;

  for (int i = 0; i < ROUTE_NLISTS; i++)
    if ((rc = get_lens(root, kvf__route_list_names[i], &r.lists[i], KVF_EINVAL, why, whylen))) goto err_free_lists;

  json_decref(root);
  *out = r;
  return 0;

err_free_lists:
  free_lists(r.lists);
err_free_json:
  json_decref(root);
  return rc;
}

void kvf__route_reg_free(route_reg *r) {
  if (r) free_lists(r->lists);
}

int kvf__route_reg_is_prefill(const route_reg *r) { return strcmp(r->role, "Prefill") == 0; }

static json_t *lens_to_json(const route_lens *l) {
  json_t *a = json_array();
  if (!a) return NULL;
  for (size_t i = 0; l->present && i < l->n; i++) {
    if (json_array_append_new(a, json_integer(l->v[i]))) {
      json_decref(a);
      return NULL;
    }
  }
  return a;
}

/* Python's json.dumps default: ", " and ": " separators, keys in insertion
 * order (jansson keeps it). */
static char *dump(json_t *obj) {
  char *s = json_dumps(obj, JSON_PRESERVE_ORDER);
  json_decref(obj);
  return s;
}

char *kvf__route_json_encode_put(const route_reg *r) {
  json_t *o = json_object();
  if (!o) return NULL;
  int bad = 0;
  bad |= json_object_set_new(o, "role", json_string(r->role));
  bad |= json_object_set_new(o, "world_size", json_integer(r->world_size));
  bad |= json_object_set_new(o, "dp_size", json_integer(r->dp_size));
  bad |= json_object_set_new(o, "rank_ip", json_string(r->rank_ip));
  bad |= json_object_set_new(o, "rank_port", json_integer(r->rank_port));
  bad |= json_object_set_new(o, "engine_rank", json_integer(r->engine_rank));
  bad |= json_object_set_new(o, "enable_mla_l1_5_cache", json_boolean(r->enable_mla_l1_5_cache));
  for (int i = 0; i < ROUTE_NLISTS; i++)
    if (r->lists[i].present) bad |= json_object_set_new(o, kvf__route_list_names[i], lens_to_json(&r->lists[i]));
  if (bad) {
    json_decref(o);
    return NULL;
  }
  return dump(o);
}

char *kvf__route_json_encode_parallel_info(const route_parallel_info *p) {
  json_t *o = json_object();
  if (!o) return NULL;
  int bad = 0;
  bad |= json_object_set_new(o, "prefill_tp_size", p->world_size < 0 ? json_null() : json_integer(p->world_size));
  bad |= json_object_set_new(o, "prefill_dp_size", p->dp_size < 0 ? json_null() : json_integer(p->dp_size));
  bad |= json_object_set_new(o, "enable_mla_l1_5_cache", json_boolean(p->enable_mla_l1_5_cache));
  for (int i = 0; i < ROUTE_NLISTS; i++)
    if (i != ROUTE_KVF_PAGE_LAYOUT || p->lists[i].n)
      bad |= json_object_set_new(o, kvf__route_list_names[i], lens_to_json(&p->lists[i]));
  if (bad) {
    json_decref(o);
    return NULL;
  }
  return dump(o);
}

char *kvf__route_json_encode_rank(const char *rank_ip, int64_t rank_port) {
  json_t *o = json_object();
  if (!o) return NULL;
  if (json_object_set_new(o, "rank_ip", json_string(rank_ip)) ||
      json_object_set_new(o, "rank_port", json_integer(rank_port))) {
    json_decref(o);
    return NULL;
  }
  return dump(o);
}

/* An integer or null (-1) size field of a parallel-info reply. */
static int get_size_or_null(json_t *obj, const char *key, int64_t *out) {
  json_t *v = json_object_get(obj, key);
  if (!v) return KVF_EPROTO;
  if (json_is_null(v)) {
    *out = -1;
    return 0;
  }
  if (!json_is_integer(v) || json_integer_value(v) < 1 || json_integer_value(v) > ROUTE_MAX_RANKS)
    return KVF_EPROTO;
  *out = json_integer_value(v);
  return 0;
}

int kvf__route_json_parse_parallel_info(const char *body, size_t len, route_parallel_info *out) {
  route_parallel_info p;
  memset(&p, 0, sizeof p);
  if (!body) return KVF_EPROTO;
  json_t *root = load(body, len, NULL, 0);
  if (!root) return KVF_EPROTO;
  int rc = KVF_EPROTO;
  if (get_size_or_null(root, "prefill_tp_size", &p.world_size) ||
      get_size_or_null(root, "prefill_dp_size", &p.dp_size))
    goto err_free_json;
  /* Both sizes come from the same first PUT: both null or both set, and the
   * decode divides one by the other. */
  if ((p.world_size < 0) != (p.dp_size < 0)) goto err_free_json;
  if (p.world_size > 0 && (p.dp_size > p.world_size || p.world_size % p.dp_size)) goto err_free_json;
  json_t *mla = json_object_get(root, "enable_mla_l1_5_cache");
  if (!mla) goto err_free_json;
  p.enable_mla_l1_5_cache = json_truthy(mla);
  for (int i = 0; i < ROUTE_NLISTS; i++)
    if ((rc = get_lens(root, kvf__route_list_names[i], &p.lists[i], KVF_EPROTO, NULL, 0))) goto err_free_lists;
  json_decref(root);
  *out = p;
  return 0;

err_free_lists:
  free_lists(p.lists);
err_free_json:
  json_decref(root);
  return rc;
}

void kvf__route_parallel_info_free(route_parallel_info *p) {
  if (p) free_lists(p->lists);
}

int kvf__route_json_parse_rank(const char *body, size_t len, char *ip, size_t iplen, int *port) {
  if (!body) return KVF_EPROTO;
  json_t *root = load(body, len, NULL, 0);
  if (!root) return KVF_EPROTO;
  int rc = KVF_EPROTO;
  json_t *jip = json_object_get(root, "rank_ip");
  json_t *jport = json_object_get(root, "rank_port");
  if (!json_is_string(jip) || !json_is_integer(jport)) goto out_free_json;
  size_t n = json_string_length(jip);
  if (!kvf__addr_host_valid(json_string_value(jip), n) || strlen(json_string_value(jip)) != n || n >= iplen)
    goto out_free_json;
  json_int_t p = json_integer_value(jport);
  if (p < 1 || p > 65535) goto out_free_json;
  memcpy(ip, json_string_value(jip), n + 1);
  *port = (int)p;
  rc = 0;
out_free_json:
  json_decref(root);
  return rc;
}

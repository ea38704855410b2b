/* Tests of the bootstrap layer: a real server on 127.0.0.1 (port 0) driven
 * through the project's libcurl client — every endpoint and error code,
 * concurrent registration, bounds, tokens, the PUT retry against a server
 * that starts late, and client timeouts against a socket that never answers —
 * plus the JSON codecs on their own, including inputs found by fuzzing. */
#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stdatomic.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>

#include "base/clock.h"
#include "bootstrap/bootstrap.h"
#include "sockets.h"
#include "bootstrap/metrics_text.h"
#include "kvferry.h"
#include "wire/route_json.h"

/* ---- helpers ---- */

/* Upper bounds on how long a call takes are its deadline plus this much
 * scheduling slack on a loaded machine (two ctest -j2 on two cores); what
 * they catch (a deadline ignored, a retry that should not happen) is far
 * beyond. */
#define LOAD_SLACK_MS 3000
#define NOT_RETRIED_MS 5000 /* with a 10 s deadline: one try, not a retry loop */

static kvf_bootstrap_server *start_server(const char *token, size_t max_body, uint16_t port) {
  kvf_bootstrap_server_config cfg;
  kvf_bootstrap_server_config_init(&cfg);
  cfg.host = "127.0.0.1";
  cfg.port = port;
  cfg.auth_token = token ? token : "";
  if (max_body) cfg.max_body = max_body;
  kvf_bootstrap_server *srv = NULL;
  assert_int_equal(kvf_bootstrap_server_create(&cfg, &srv), 0);
  assert_non_null(srv);
  assert_int_not_equal(kvf_bootstrap_server_port(srv), 0);
  return srv;
}

static bootstrap_client *client_for_port(uint16_t port, const char *token, int timeout_ms) {
  char addr[32];
  snprintf(addr, sizeof addr, "127.0.0.1:%u", (unsigned)port);
  bootstrap_client_opts o = {.token = token ? token : "", .connect_timeout_ms = 1000, .timeout_ms = timeout_ms};
  bootstrap_client *c = NULL;
  assert_int_equal(kvf__bootstrap_client_create(addr, &o, &c), 0);
  return c;
}

static bootstrap_client *client_for(kvf_bootstrap_server *srv) {
  return client_for_port(kvf_bootstrap_server_port(srv), NULL, 3000);
}

/* Status of one raw request; the reply body goes to *reply when asked. */
static long raw(bootstrap_client *c, const char *method, const char *path, const char *body, char **reply) {
  long status = 0;
  assert_int_equal(kvf__bootstrap_client_request(c, method, path, body, body ? strlen(body) : 0, &status, reply,
                                                 NULL),
                   0);
  return status;
}

static void reg_init(route_reg *r, int world, int dp, int rank, const char *ip, int port) {
  memset(r, 0, sizeof *r);
  strcpy(r->role, "Prefill");
  r->world_size = world;
  r->dp_size = dp;
  r->engine_rank = rank;
  snprintf(r->rank_ip, sizeof r->rank_ip, "%s", ip);
  r->rank_port = port;
}

static double ms_since(int64_t t0) { return (double)(clock_now_ns() - t0) / 1e6; }

static uint16_t free_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  assert_true(fd >= 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  assert_int_equal(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
  socklen_t l = sizeof a;
  assert_int_equal(getsockname(fd, (struct sockaddr *)&a, &l), 0);
  close(fd);
  return ntohs(a.sin_port);
}

/* Value of an unlabelled or labelled metric line in a /metrics reply. */
static long long metric(const char *text, const char *name) {
  size_t n = strlen(name);
  for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
    if (!strncmp(p, name, n) && p[n] == ' ') return atoll(p + n + 1);
  }
  return -1;
}

static const char *A1_PUT =
    "{\"role\":\"Prefill\",\"world_size\":1,\"dp_size\":1,\"rank_ip\":\"10.0.0.1\",\"rank_port\":39001,"
    "\"engine_rank\":0,\"enable_mla_l1_5_cache\":false,\"kv_item_lens\":[8192,8192,8192,8192],"
    "\"kv_unit_lens\":[256,256,256,256],\"state_item_lens\":[],\"state_unit_lens\":[]}";

/* ---- endpoints ---- */

static void health_get_head_and_unknown_paths(void **state) {
  kvf_bootstrap_server *srv = start_server(NULL, 0, 0);
  bootstrap_client *c = client_for(srv);
  char *body = NULL;
  assert_int_equal(raw(c, "GET", "/health", NULL, &body), 200);
  assert_string_equal(body, "OK");
  free(body);
  body = NULL;
  assert_int_equal(raw(c, "HEAD", "/health", NULL, &body), 200);
  assert_string_equal(body, "");
  free(body);
  /* Keep-alive heartbeats on one handle. */
  for (int i = 0; i < 20; i++) assert_int_equal(kvf__bootstrap_client_health(c), 0);
  assert_int_equal(raw(c, "POST", "/health", "x", NULL), 405);
  assert_int_equal(raw(c, "PUT", "/health", "x", NULL), 405);
  assert_int_equal(raw(c, "GET", "/nope", NULL, NULL), 404);
  assert_int_equal(raw(c, "GET", "/route/extra", NULL, NULL), 404);
  kvf__bootstrap_client_destroy(c);
  kvf_bootstrap_server_destroy(srv);
}

static void parallel_info_is_null_before_any_put(void **state) {
  kvf_bootstrap_server *srv = start_server(NULL, 0, 0);
  bootstrap_client *c = client_for(srv);
  char *body = NULL;
  assert_int_equal(raw(c, "GET", "/route?engine_rank=-1&target_dp_group=-1", NULL, &body), 200);
  assert_string_equal(body,
                      "{\"prefill_tp_size\": null, \"prefill_dp_size\": null, \"enable_mla_l1_5_cache\": false, "
                      "\"kv_item_lens\": [], \"kv_unit_lens\": [], \"state_item_lens\": [], \"state_unit_lens\": "
                      "[]}");
  free(body);
  route_parallel_info p;
  assert_int_equal(kvf__bootstrap_client_get_parallel_info(c, &p), KVF_ENOTFOUND);
  char ip[64];
  int port = 0;
  assert_int_equal(kvf__bootstrap_client_get_rank(c, 0, 0, ip, sizeof ip, &port), KVF_ENOTFOUND);
  kvf__bootstrap_client_destroy(c);
  kvf_bootstrap_server_destroy(srv);
}

/* PROTOCOL Appendix A.1 / A.2, byte for byte where the reference's reply is
 * known. */
static void appendix_a_put_then_discover(void **state) {
  kvf_bootstrap_server *srv = start_server(NULL, 0, 0);
  bootstrap_client *c = client_for(srv);
  char *body = NULL;
  assert_int_equal(raw(c, "PUT", "/route", A1_PUT, &body), 200);
  assert_string_equal(body, "OK");
  free(body);
  body = NULL;
  assert_int_equal(raw(c, "GET", "/route?engine_rank=-1&target_dp_group=-1", NULL, &body), 200);
  assert_string_equal(body, "{\"prefill_tp_size\": 1, \"prefill_dp_size\": 1, \"enable_mla_l1_5_cache\": false, "
                            "\"kv_item_lens\": [8192, 8192, 8192, 8192], \"kv_unit_lens\": [256, 256, 256, 256], "
                            "\"state_item_lens\": [], \"state_unit_lens\": []}");
  free(body);
  body = NULL;
  int64_t room = 7215963401LL;
  route_parallel_info p;
  assert_int_equal(kvf__bootstrap_client_get_parallel_info(c, &p), 0);
  assert_int_equal(p.world_size, 1);
  assert_int_equal(p.dp_size, 1);
  assert_int_equal(p.enable_mla_l1_5_cache, 0);
  assert_int_equal(p.lists[ROUTE_KV_ITEM_LENS].n, 4);
  assert_int_equal(p.lists[ROUTE_KV_ITEM_LENS].v[3], 8192);
  assert_int_equal(p.lists[ROUTE_KV_UNIT_LENS].v[0], 256);
  assert_int_equal(p.lists[ROUTE_STATE_ITEM_LENS].n, 0);
  int group = (int)(room % p.dp_size);
  kvf__route_parallel_info_free(&p);
  assert_int_equal(raw(c, "GET", "/route?engine_rank=0&target_dp_group=0", NULL, &body), 200);
  assert_string_equal(body, "{\"rank_ip\": \"10.0.0.1\", \"rank_port\": 39001}");
  free(body);
  char ip[64];
  int port = 0;
  assert_int_equal(kvf__bootstrap_client_get_rank(c, 0, group, ip, sizeof ip, &port), 0);
  assert_string_equal(ip, "10.0.0.1");
  assert_int_equal(port, 39001);
  /* HEAD on /route answers like GET without a body (aiohttp's add_get). */
  assert_int_equal(raw(c, "HEAD", "/route?engine_rank=0&target_dp_group=0", NULL, NULL), 200);
  kvf__bootstrap_client_destroy(c);
  kvf_bootstrap_server_destroy(srv);
}

struct reg_thread {
  uint16_t port;
  int rank;
  int rc;
};

static void *register_one(void *arg) {
  struct reg_thread *t = arg;
  char addr[32], ip[32];
  snprintf(addr, sizeof addr, "127.0.0.1:%u", (unsigned)t->port);
  bootstrap_client_opts o = {.token = "", .timeout_ms = 3000};
  bootstrap_client *c = NULL;
  t->rc = kvf__bootstrap_client_create(addr, &o, &c);
  if (t->rc) return NULL;
  snprintf(ip, sizeof ip, "10.0.%d.%d", t->rank / 4, t->rank);
  route_reg r;
  reg_init(&r, 8, 2, t->rank, ip, 40000 + t->rank);
  int64_t lens[2] = {8192, 8192};
  r.lists[ROUTE_KV_ITEM_LENS] = (route_lens){lens, 2, 1};
  t->rc = kvf__bootstrap_client_put_route(c, &r, 5000);
  kvf__bootstrap_client_destroy(c);
  return NULL;
}

static void eight_ranks_register_concurrently(void **state) {
  kvf_bootstrap_server *srv = start_server(NULL, 0, 0);
  pthread_t th[8];
  struct reg_thread t[8];
  for (int i = 0; i < 8; i++) {
    t[i] = (struct reg_thread){.port = kvf_bootstrap_server_port(srv), .rank = i, .rc = -100};
    assert_int_equal(pthread_create(&th[i], NULL, register_one, &t[i]), 0);
  }
  for (int i = 0; i < 8; i++) {
    pthread_join(th[i], NULL);
    assert_int_equal(t[i].rc, 0);
  }
  bootstrap_client *c = client_for(srv);
  route_parallel_info p;
  assert_int_equal(kvf__bootstrap_client_get_parallel_info(c, &p), 0);
  assert_int_equal(p.world_size, 8);
  assert_int_equal(p.dp_size, 2);
  kvf__route_parallel_info_free(&p);
  for (int g = 0; g < 2; g++) {
    for (int tp = 0; tp < 4; tp++) {
      int rank = g * 4 + tp, port = 0;
      char ip[64], want[32];
      assert_int_equal(kvf__bootstrap_client_get_rank(c, tp, g, ip, sizeof ip, &port), 0);
      snprintf(want, sizeof want, "10.0.%d.%d", rank / 4, rank);
      assert_string_equal(ip, want);
      assert_int_equal(port, 40000 + rank);
    }
  }
  char ip[64];
  int port = 0;
  assert_int_equal(kvf__bootstrap_client_get_rank(c, 4, 0, ip, sizeof ip, &port), KVF_ENOTFOUND);
  assert_int_equal(kvf__bootstrap_client_get_rank(c, 0, 2, ip, sizeof ip, &port), KVF_ENOTFOUND);
  assert_int_equal(kvf__bootstrap_client_get_rank(c, -1, 0, ip, sizeof ip, &port), KVF_ENOTFOUND);
  assert_int_equal(kvf__bootstrap_client_get_rank(c, 0, -1, ip, sizeof ip, &port), KVF_ENOTFOUND);
  assert_int_equal(port, 0); /* untouched on failure */
  kvf__bootstrap_client_destroy(c);
  kvf_bootstrap_server_destroy(srv);
}

/* Sizes freeze at the first PUT; extras are last-writer-wins; absent lists
 * keep their value; non-prefill roles only contribute sizes and extras. */
static void sizes_freeze_and_extras_follow_the_last_put(void **state) {
  kvf_bootstrap_server *srv = start_server(NULL, 0, 0);
  bootstrap_client *c = client_for(srv);
  route_reg r;
  reg_init(&r, 4, 2, 0, "10.1.0.1", 5000);
  int64_t kv[3] = {1, 2, 3}, st[1] = {77};
  r.lists[ROUTE_KV_ITEM_LENS] = (route_lens){kv, 3, 1};
  r.lists[ROUTE_STATE_ITEM_LENS] = (route_lens){st, 1, 1};
  assert_int_equal(kvf__bootstrap_client_put_route(c, &r, 0), 0);

  reg_init(&r, 4, 2, 3, "10.1.0.4", 5003); /* no lists this time */
  r.enable_mla_l1_5_cache = 1;
  assert_int_equal(kvf__bootstrap_client_put_route(c, &r, 0), 0);
  route_parallel_info p;
  assert_int_equal(kvf__bootstrap_client_get_parallel_info(c, &p), 0);
  assert_int_equal(p.enable_mla_l1_5_cache, 1);
  assert_int_equal(p.lists[ROUTE_KV_ITEM_LENS].n, 3);
  assert_int_equal(p.lists[ROUTE_KV_ITEM_LENS].v[2], 3);
  assert_int_equal(p.lists[ROUTE_STATE_ITEM_LENS].v[0], 77);
  kvf__route_parallel_info_free(&p);

  /* An empty list that is sent does replace the old one. */
  reg_init(&r, 4, 2, 3, "10.1.0.4", 5003);
  r.lists[ROUTE_STATE_ITEM_LENS] = (route_lens){NULL, 0, 1};
  assert_int_equal(kvf__bootstrap_client_put_route(c, &r, 0), 0);
  assert_int_equal(kvf__bootstrap_client_get_parallel_info(c, &p), 0);
  assert_int_equal(p.enable_mla_l1_5_cache, 0);
  assert_int_equal(p.lists[ROUTE_STATE_ITEM_LENS].n, 0);
  assert_int_equal(p.lists[ROUTE_KV_ITEM_LENS].n, 3);
  kvf__route_parallel_info_free(&p);

  /* Different sizes: refused, not mis-filed. */
  reg_init(&r, 8, 2, 5, "10.1.0.6", 5005);
  int64_t t0 = clock_now_ns();
  assert_int_equal(kvf__bootstrap_client_put_route(c, &r, 10000), KVF_ESTATE);
  assert_true(ms_since(t0) < NOT_RETRIED_MS); /* a retry runs to the 10 s deadline */
  reg_init(&r, 4, 1, 2, "10.1.0.3", 5002);
  assert_int_equal(kvf__bootstrap_client_put_route(c, &r, 0), KVF_ESTATE);

  /* A non-prefill role is accepted but not placed in the table. */
  reg_init(&r, 4, 2, 1, "10.9.9.9", 6001);
  strcpy(r.role, "Decode");
  assert_int_equal(kvf__bootstrap_client_put_route(c, &r, 0), 0);
  char ip[64];
  int port = 0;
  assert_int_equal(kvf__bootstrap_client_get_rank(c, 1, 0, ip, sizeof ip, &port), KVF_ENOTFOUND);
  /* Overwrite: a re-registered rank moves. */
  assert_int_equal(kvf__bootstrap_client_get_rank(c, 1, 1, ip, sizeof ip, &port), 0);
  assert_string_equal(ip, "10.1.0.4");
  reg_init(&r, 4, 2, 3, "10.1.0.40", 5040);
  assert_int_equal(kvf__bootstrap_client_put_route(c, &r, 0), 0);
  assert_int_equal(kvf__bootstrap_client_get_rank(c, 1, 1, ip, sizeof ip, &port), 0);
  assert_string_equal(ip, "10.1.0.40");
  assert_int_equal(port, 5040);
  kvf__bootstrap_client_destroy(c);
  kvf_bootstrap_server_destroy(srv);
}

static void bad_requests_get_400_and_change_nothing(void **state) {
  kvf_bootstrap_server *srv = start_server(NULL, 0, 0);
  bootstrap_client *c = client_for(srv);
  static const char *bad_puts[] = {
      "",
      "{",
      "not json",
      "[1, 2]",
      "{\"role\": \"Prefill\"}",
      /* missing each required key in turn */
      "{\"world_size\": 2, \"dp_size\": 1, \"rank_ip\": \"a\", \"rank_port\": 1, \"engine_rank\": 0, "
      "\"enable_mla_l1_5_cache\": false}",
      "{\"role\": \"Prefill\", \"dp_size\": 1, \"rank_ip\": \"a\", \"rank_port\": 1, \"engine_rank\": 0, "
      "\"enable_mla_l1_5_cache\": false}",
      "{\"role\": \"Prefill\", \"world_size\": 2, \"rank_ip\": \"a\", \"rank_port\": 1, \"engine_rank\": 0, "
      "\"enable_mla_l1_5_cache\": false}",
      "{\"role\": \"Prefill\", \"world_size\": 2, \"dp_size\": 1, \"rank_port\": 1, \"engine_rank\": 0, "
      "\"enable_mla_l1_5_cache\": false}",
      "{\"role\": \"Prefill\", \"world_size\": 2, \"dp_size\": 1, \"rank_ip\": \"a\", \"engine_rank\": 0, "
      "\"enable_mla_l1_5_cache\": false}",
      "{\"role\": \"Prefill\", \"world_size\": 2, \"dp_size\": 1, \"rank_ip\": \"a\", \"rank_port\": 1, "
      "\"enable_mla_l1_5_cache\": false}",
      "{\"role\": \"Prefill\", \"world_size\": 2, \"dp_size\": 1, \"rank_ip\": \"a\", \"rank_port\": 1, "
      "\"engine_rank\": 0}",
      /* wrong types */
      "{\"role\": 1, \"world_size\": 2, \"dp_size\": 1, \"rank_ip\": \"a\", \"rank_port\": 1, \"engine_rank\": 0, "
      "\"enable_mla_l1_5_cache\": false}",
      "{\"role\": \"Prefill\", \"world_size\": \"2\", \"dp_size\": 1, \"rank_ip\": \"a\", \"rank_port\": 1, "
      "\"engine_rank\": 0, \"enable_mla_l1_5_cache\": false}",
      "{\"role\": \"Prefill\", \"world_size\": 2.0, \"dp_size\": 1, \"rank_ip\": \"a\", \"rank_port\": 1, "
      "\"engine_rank\": 0, \"enable_mla_l1_5_cache\": false}",
      "{\"role\": \"Prefill\", \"world_size\": 2, \"dp_size\": 1, \"rank_ip\": 10, \"rank_port\": 1, "
      "\"engine_rank\": 0, \"enable_mla_l1_5_cache\": false}",
      "{\"role\": \"Prefill\", \"world_size\": 2, \"dp_size\": 1, \"rank_ip\": \"a\", \"rank_port\": \"x1\", "
      "\"engine_rank\": 0, \"enable_mla_l1_5_cache\": false}",
      "{\"role\": \"Prefill\", \"world_size\": 2, \"dp_size\": 1, \"rank_ip\": \"a\", \"rank_port\": true, "
      "\"engine_rank\": 0, \"enable_mla_l1_5_cache\": false}",
      "{\"role\": \"Prefill\", \"world_size\": 2, \"dp_size\": 1, \"rank_ip\": \"a\", \"rank_port\": 1, "
      "\"engine_rank\": 0, \"enable_mla_l1_5_cache\": false, \"kv_item_lens\": 5}",
      "{\"role\": \"Prefill\", \"world_size\": 2, \"dp_size\": 1, \"rank_ip\": \"a\", \"rank_port\": 1, "
      "\"engine_rank\": 0, \"enable_mla_l1_5_cache\": false, \"kv_item_lens\": [1, \"2\"]}",
      /* absurd values */
      "{\"role\": \"Prefill\", \"world_size\": 100000, \"dp_size\": 1, \"rank_ip\": \"a\", \"rank_port\": 1, "
      "\"engine_rank\": 0, \"enable_mla_l1_5_cache\": false}",
      "{\"role\": \"Prefill\", \"world_size\": 2, \"dp_size\": 0, \"rank_ip\": \"a\", \"rank_port\": 1, "
      "\"engine_rank\": 0, \"enable_mla_l1_5_cache\": false}",
      "{\"role\": \"Prefill\", \"world_size\": 0, \"dp_size\": 0, \"rank_ip\": \"a\", \"rank_port\": 1, "
      "\"engine_rank\": 0, \"enable_mla_l1_5_cache\": false}",
      "{\"role\": \"Prefill\", \"world_size\": 4, \"dp_size\": 3, \"rank_ip\": \"a\", \"rank_port\": 1, "
      "\"engine_rank\": 0, \"enable_mla_l1_5_cache\": false}",
      "{\"role\": \"Prefill\", \"world_size\": 2, \"dp_size\": 4, \"rank_ip\": \"a\", \"rank_port\": 1, "
      "\"engine_rank\": 0, \"enable_mla_l1_5_cache\": false}",
      "{\"role\": \"Prefill\", \"world_size\": 2, \"dp_size\": 1, \"rank_ip\": \"a\", \"rank_port\": 1, "
      "\"engine_rank\": 2, \"enable_mla_l1_5_cache\": false}",
      "{\"role\": \"Prefill\", \"world_size\": 2, \"dp_size\": 1, \"rank_ip\": \"a\", \"rank_port\": 1, "
      "\"engine_rank\": -1, \"enable_mla_l1_5_cache\": false}",
      "{\"role\": \"Prefill\", \"world_size\": 2, \"dp_size\": 1, \"rank_ip\": \"a\", \"rank_port\": 0, "
      "\"engine_rank\": 0, \"enable_mla_l1_5_cache\": false}",
      "{\"role\": \"Prefill\", \"world_size\": 2, \"dp_size\": 1, \"rank_ip\": \"a\", \"rank_port\": 70000, "
      "\"engine_rank\": 0, \"enable_mla_l1_5_cache\": false}",
      "{\"role\": \"Prefill\", \"world_size\": 2, \"dp_size\": 1, \"rank_ip\": \"\", \"rank_port\": 1, "
      "\"engine_rank\": 0, \"enable_mla_l1_5_cache\": false}",
      "{\"role\": \"Prefill\", \"world_size\": 2, \"dp_size\": 1, \"rank_ip\": \"a b\", \"rank_port\": 1, "
      "\"engine_rank\": 0, \"enable_mla_l1_5_cache\": false}",
      "{\"role\": \"Prefill\", \"world_size\": 2, \"dp_size\": 1, \"rank_ip\": \"a\", \"rank_port\": 1, "
      "\"engine_rank\": 0, \"enable_mla_l1_5_cache\": false, \"kv_item_lens\": [-1]}",
      "{\"role\": \"Prefill\", \"world_size\": 99999999999999999999999, \"dp_size\": 1, \"rank_ip\": \"a\", "
      "\"rank_port\": 1, \"engine_rank\": 0, \"enable_mla_l1_5_cache\": false}",
      /* duplicate key */
      "{\"role\": \"Prefill\", \"world_size\": 2, \"world_size\": 4, \"dp_size\": 1, \"rank_ip\": \"a\", "
      "\"rank_port\": 1, \"engine_rank\": 0, \"enable_mla_l1_5_cache\": false}",
  };
  for (size_t i = 0; i < sizeof bad_puts / sizeof bad_puts[0]; i++) {
    char *body = NULL;
    long st = raw(c, "PUT", "/route", bad_puts[i], &body);
    if (st != 400) fprintf(stderr, "case %zu: %ld %s\n", i, st, body);
    assert_int_equal(st, 400);
    assert_true(strlen(body) > 0); /* a reason */
    free(body);
  }
  /* Nothing was stored by any of them. */
  route_parallel_info p;
  assert_int_equal(kvf__bootstrap_client_get_parallel_info(c, &p), KVF_ENOTFOUND);

  /* rank_port and engine_rank may be numeric strings, as int() allows. */
  const char *stringy =
      "{\"role\": \"Prefill\", \"world_size\": 2, \"dp_size\": 1, \"rank_ip\": \"fe80::1%eth0\", "
      "\"rank_port\": \" 39001 \", \"engine_rank\": \"+1\", \"enable_mla_l1_5_cache\": 0}";
  assert_int_equal(raw(c, "PUT", "/route", stringy, NULL), 200);
  char ip[64];
  int port = 0;
  assert_int_equal(kvf__bootstrap_client_get_rank(c, 1, 0, ip, sizeof ip, &port), 0);
  assert_string_equal(ip, "fe80::1%eth0");
  assert_int_equal(port, 39001);

  static const char *bad_gets[] = {
      "/route",
      "/route?engine_rank=0",
      "/route?target_dp_group=0",
      "/route?engine_rank=&target_dp_group=0",
      "/route?engine_rank=a&target_dp_group=0",
      "/route?engine_rank=0&target_dp_group=1.5",
      "/route?engine_rank=0&target_dp_group=99999999999999999999999",
  };
  for (size_t i = 0; i < sizeof bad_gets / sizeof bad_gets[0]; i++) {
    char *body = NULL;
    assert_int_equal(raw(c, "GET", bad_gets[i], NULL, &body), 400);
    if (i == 0) assert_string_equal(body, "Missing inputs for bootstrap server.");
    free(body);
  }
  assert_int_equal(raw(c, "GET", "/route?engine_rank=0&target_dp_group=5", NULL, NULL), 404);
  assert_int_equal(raw(c, "DELETE", "/route", NULL, NULL), 405);
  assert_int_equal(raw(c, "POST", "/route", A1_PUT, NULL), 405);
  assert_int_equal(raw(c, "PATCH", "/route", A1_PUT, NULL), 405);

  char *m = NULL;
  assert_int_equal(raw(c, "GET", "/metrics", NULL, &m), 200);
  assert_int_equal(metric(m, "kvferry_bootstrap_errors_total{kind=\"bad_request\"}"),
                   (long long)(sizeof bad_puts / sizeof bad_puts[0] + sizeof bad_gets / sizeof bad_gets[0]));
  assert_int_equal(metric(m, "kvferry_bootstrap_errors_total{kind=\"method\"}"), 3);
  assert_int_equal(metric(m, "kvferry_bootstrap_errors_total{kind=\"not_found\"}"), 1);
  assert_int_equal(metric(m, "kvferry_bootstrap_registrations_total"), 1);
  assert_int_equal(metric(m, "kvferry_bootstrap_lookups_total"), 1);
  assert_int_equal(metric(m, "kvferry_bootstrap_registered_ranks"), 1);
  free(m);
  kvf__bootstrap_client_destroy(c);
  kvf_bootstrap_server_destroy(srv);
}

/* A metrics source writing `arg` (a line) as often as it fits. */
static size_t repeat_source(void *arg, char *buf, size_t cap) {
  size_t n = 0, len = strlen(arg);
  while (cap - n > len) {
    memcpy(buf + n, arg, len);
    n += len;
  }
  buf[n] = '\0';
  return n;
}

static size_t one_line_source(void *arg, char *buf, size_t cap) {
  int w = snprintf(buf, cap, "kvferry_test_source{id=\"%s\"} 42\n", (const char *)arg);
  return w > 0 && (size_t)w < cap ? (size_t)w : 0;
}

/* GET path over a plain socket with HTTP/1.0, the whole reply (headers and
 * body) as a string: for pages past the project client's reply bound. */
static char *http10_get(uint16_t port, const char *path, size_t *len) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  assert_true(fd >= 0);
  struct sockaddr_in a = {.sin_family = AF_INET,
                          .sin_port = htons(port),
                          .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
  char req[256];
  int w = snprintf(req, sizeof req, "GET %s HTTP/1.0\r\n\r\n", path);
  assert_int_equal(send(fd, req, (size_t)w, 0), w);
  size_t cap = 1 << 20, n = 0;
  char *buf = malloc(cap + 1);
  assert_non_null(buf);
  for (ssize_t r; (r = recv(fd, buf + n, cap - n, 0)) > 0;) {
    n += (size_t)r;
    if (n == cap) {
      buf = realloc(buf, 2 * cap + 1);
      assert_non_null(buf);
      cap *= 2;
    }
  }
  close(fd);
  buf[n] = '\0';
  *len = n;
  return buf;
}

static int count_lines(const char *text, const char *line) {
  int k = 0;
  size_t n = strlen(line);
  for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) k += !strncmp(p, line, n);
  return k;
}

/* kvf_bootstrap_server_add_metrics: each source's lines join the page after
 * the server's own; a source is given room to grow (a manager with a
 * thousand peers' lines is not cut at a fixed size), and only a page past its
 * bound (4 MiB) cuts what comes after it, at a line. */
static void metrics_sources_add_lines(void **state) {
  kvf_bootstrap_server *srv = start_server(NULL, 0, 0);
  assert_int_equal(kvf_bootstrap_server_add_metrics(NULL, one_line_source, "a"), KVF_EINVAL);
  assert_int_equal(kvf_bootstrap_server_add_metrics(srv, NULL, "a"), KVF_EINVAL);
  assert_int_equal(kvf_bootstrap_server_add_metrics(srv, one_line_source, "a"), 0);
  assert_int_equal(kvf_bootstrap_server_add_metrics(srv, one_line_source, "b"), 0);
  bootstrap_client *c = client_for(srv);
  char *m = NULL;
  assert_int_equal(raw(c, "GET", "/metrics", NULL, &m), 200);
  assert_int_equal(metric(m, "kvferry_test_source{id=\"a\"}"), 42);
  assert_int_equal(metric(m, "kvferry_test_source{id=\"b\"}"), 42);
  assert_int_equal(metric(m, "kvferry_bootstrap_registered_ranks"), 0);
  free(m);
  /* Sources that fill whatever they are given: each gets up to 1 MiB, the
   * fifth is past the page's bound. */
  for (int i = 0; i < 5; i++)
    assert_int_equal(kvf_bootstrap_server_add_metrics(srv, repeat_source, "kvferry_test_fill 1\n"), 0);
  for (int i = 8; i <= KVF_BOOTSTRAP_MAX_SOURCES; i++)
    assert_int_equal(kvf_bootstrap_server_add_metrics(srv, one_line_source, "late"), 0);
  assert_int_equal(kvf_bootstrap_server_add_metrics(srv, one_line_source, "over"), KVF_ENOMEM);
  size_t len = 0;
  m = http10_get(kvf_bootstrap_server_port(srv), "/metrics", &len);
  assert_non_null(strstr(m, "200 OK"));
  char *body = strstr(m, "\r\n\r\n");
  assert_non_null(body);
  body += 4;
  size_t blen = len - (size_t)(body - m);
  assert_true(blen > (3u << 20) && blen < (4u << 20));
  assert_int_equal(metric(body, "kvferry_test_source{id=\"a\"}"), 42);
  assert_int_equal(metric(body, "kvferry_test_fill"), 1);
  assert_null(strstr(body, "id=\"late\"")); /* past the page's bound */
  assert_int_equal(body[blen - 1], '\n');   /* whole lines only */
  free(m);
  kvf__bootstrap_client_destroy(c);
  kvf_bootstrap_server_destroy(srv);
}

/* Two managers' lines as kvf_manager_metrics writes them: the same counter
 * families and histograms (each with its TYPE line) from each. */
static size_t manager_like_source(void *arg, char *buf, size_t cap) {
  const char *id = arg;
  int w = snprintf(buf, cap,
                   "kvferry_manager_rooms{session=\"%s\"} 3\n"
                   "# TYPE kvferry_room_seconds histogram\n"
                   "kvferry_room_seconds_bucket{session=\"%s\",le=\"1\"} 1\n"
                   "kvferry_room_seconds_bucket{session=\"%s\",le=\"+Inf\"} 2\n"
                   "kvferry_room_seconds_sum{session=\"%s\"} 1.5\n"
                   "kvferry_room_seconds_count{session=\"%s\"} 2\n"
                   "kvferry_manager_bytes{session=\"%s\"} 9\n",
                   id, id, id, id, id, id);
  return w > 0 && (size_t)w < cap ? (size_t)w : 0;
}

/* Several sources' lines are regrouped: each family once, as one block,
 * one TYPE line (strict scrapers refuse a second TYPE line or a family
 * split in two). */
static void metrics_families_appear_once(void **state) {
  kvf_bootstrap_server *srv = start_server(NULL, 0, 0);
  assert_int_equal(kvf_bootstrap_server_add_metrics(srv, manager_like_source, "m1"), 0);
  assert_int_equal(kvf_bootstrap_server_add_metrics(srv, manager_like_source, "m2"), 0);
  bootstrap_client *c = client_for(srv);
  char *m = NULL;
  assert_int_equal(raw(c, "GET", "/metrics", NULL, &m), 200);
  assert_int_equal(count_lines(m, "# TYPE kvferry_room_seconds histogram"), 1);
  /* every family's lines contiguous: the name changes family at most once per family */
  const char *fams[] = {"kvferry_manager_rooms{", "kvferry_room_seconds", "kvferry_manager_bytes{"};
  for (size_t f = 0; f < sizeof fams / sizeof fams[0]; f++) {
    int runs = 0, in = 0;
    for (const char *p = m; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
      int here =
          !strncmp(p, fams[f], strlen(fams[f])) || (f == 1 && !strncmp(p, "# TYPE kvferry_room_seconds", 27));
      runs += here && !in;
      in = here;
    }
    assert_int_equal(runs, 1);
  }
  assert_int_equal(metric(m, "kvferry_manager_rooms{session=\"m2\"}"), 3);
  assert_int_equal(metric(m, "kvferry_room_seconds_count{session=\"m1\"}"), 2);
  free(m);
  kvf__bootstrap_client_destroy(c);
  kvf_bootstrap_server_destroy(srv);
}

/* The regrouping itself: first HELP/TYPE kept, the rest dropped; a
 * _bucket of an undeclared family is its own family; a last line without its
 * newline (a source cut short) is dropped. */
static void metrics_group_rules(void **state) {
  (void)state;
  const char *in = "# HELP a Help one.\n# TYPE a counter\na{x=\"1\"} 1\nb_bucket{le=\"1\"} 0\n"
                   "# HELP a Help two.\n# TYPE a counter\n# a comment\n\na{x=\"2\"} 2\nb_bucket{le=\"2\"} 0\nc 3";
  mtext out;
  kvf__mtext_init(&out, 1 << 20);
  kvf__metrics_group(in, strlen(in), &out);
  kvf__mtext_finish(&out);
  assert_string_equal(out.buf, "# HELP a Help one.\n# TYPE a counter\na{x=\"1\"} 1\na{x=\"2\"} 2\n"
                               "b_bucket{le=\"1\"} 0\nb_bucket{le=\"2\"} 0\n");
  kvf__mtext_free(&out);
  /* a bound cuts at a whole line */
  kvf__mtext_init(&out, 40);
  kvf__metrics_group(in, strlen(in), &out);
  kvf__mtext_finish(&out);
  assert_string_equal(out.buf, "# HELP a Help one.\n# TYPE a counter\n");
  kvf__mtext_free(&out);
}

static void oversized_bodies_get_413(void **state) {
  kvf_bootstrap_server *srv = start_server(NULL, 0, 0); /* default 64 KiB */
  bootstrap_client *c = client_for(srv);
  size_t n = 100 * 1024;
  char *big = malloc(n + 1);
  memset(big, ' ', n);
  big[n] = '\0';
  assert_int_equal(raw(c, "PUT", "/route", big, NULL), 413);
  /* The server stays usable, with the same client. */
  assert_int_equal(raw(c, "PUT", "/route", A1_PUT, NULL), 200);
  /* Just under the bound is read (and rejected only as bad JSON). */
  big[64 * 1024] = '\0';
  assert_int_equal(raw(c, "PUT", "/route", big, NULL), 400);
  free(big);
  kvf__bootstrap_client_destroy(c);
  kvf_bootstrap_server_destroy(srv);

  /* A small bound refuses a real registration with long lists, and the client
   * does not retry that. */
  srv = start_server(NULL, 512, 0);
  c = client_for(srv);
  route_reg r;
  reg_init(&r, 1, 1, 0, "10.0.0.1", 39001);
  int64_t lens[200];
  for (int i = 0; i < 200; i++) lens[i] = 8192;
  r.lists[ROUTE_KV_ITEM_LENS] = (route_lens){lens, 200, 1};
  int64_t t0 = clock_now_ns();
  assert_int_equal(kvf__bootstrap_client_put_route(c, &r, 10000), KVF_ETOOBIG);
  assert_true(ms_since(t0) < NOT_RETRIED_MS);
  char *m = NULL;
  assert_int_equal(raw(c, "GET", "/metrics", NULL, &m), 200);
  assert_int_equal(metric(m, "kvferry_bootstrap_errors_total{kind=\"too_large\"}"), 1);
  free(m);
  kvf__bootstrap_client_destroy(c);
  kvf_bootstrap_server_destroy(srv);
}

/* A chunked upload has no Content-Length to refuse up front: the server reads
 * up to the bound and then drops the connection. */
static void chunked_oversized_body_is_cut_off(void **state) {
  kvf_bootstrap_server *srv = start_server(NULL, 4096, 0);
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  assert_true(fd >= 0);
  struct timeval tv = {.tv_sec = 3};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  struct sockaddr_in a = {.sin_family = AF_INET,
                          .sin_port = htons(kvf_bootstrap_server_port(srv)),
                          .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  assert_int_equal(connect(fd, (struct sockaddr *)&a, sizeof a), 0);
  const char *head = "PUT /route HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n";
  assert_true(send(fd, head, strlen(head), MSG_NOSIGNAL) > 0);
  char chunk[1024 + 16];
  int hl = snprintf(chunk, sizeof chunk, "400\r\n");
  memset(chunk + hl, ' ', 1024);
  memcpy(chunk + hl + 1024, "\r\n", 2);
  int closed = 0;
  int64_t t0 = clock_now_ns();
  for (int i = 0; i < 1000 && !closed && ms_since(t0) < 5000; i++) {
    if (send(fd, chunk, (size_t)hl + 1026, MSG_NOSIGNAL) < 0) closed = 1;
  }
  if (!closed) {
    /* All sends fit in socket buffers; the server must still end the stream. */
    char buf[256];
    ssize_t r;
    while ((r = recv(fd, buf, sizeof buf, 0)) > 0) {
    }
    closed = r == 0 || r < 0;
  }
  assert_true(closed);
  close(fd);
  bootstrap_client *c = client_for(srv);
  char *m = NULL;
  assert_int_equal(raw(c, "GET", "/metrics", NULL, &m), 200);
  assert_int_equal(metric(m, "kvferry_bootstrap_errors_total{kind=\"too_large\"}"), 1);
  free(m);
  assert_int_equal(kvf__bootstrap_client_health(c), 0);
  kvf__bootstrap_client_destroy(c);
  kvf_bootstrap_server_destroy(srv);
}

static void token_guards_put_only(void **state) {
  kvf_bootstrap_server *srv = start_server("s3cret", 0, 0);
  uint16_t port = kvf_bootstrap_server_port(srv);
  route_reg r;
  reg_init(&r, 1, 1, 0, "10.0.0.1", 39001);

  bootstrap_client *none = client_for_port(port, "", 3000);
  int64_t t0 = clock_now_ns();
  assert_int_equal(kvf__bootstrap_client_put_route(none, &r, 10000), KVF_EACCES);
  assert_true(ms_since(t0) < NOT_RETRIED_MS); /* not retried */
  char *body = NULL;
  assert_int_equal(raw(none, "PUT", "/route", A1_PUT, &body), 401);
  free(body);
  /* GETs stay open. */
  assert_int_equal(kvf__bootstrap_client_health(none), 0);
  route_parallel_info p;
  assert_int_equal(kvf__bootstrap_client_get_parallel_info(none, &p), KVF_ENOTFOUND);

  bootstrap_client *wrong = client_for_port(port, "s3cre", 3000);
  assert_int_equal(kvf__bootstrap_client_put_route(wrong, &r, 0), KVF_EACCES);
  bootstrap_client *longer = client_for_port(port, "s3cret2", 3000);
  assert_int_equal(kvf__bootstrap_client_put_route(longer, &r, 0), KVF_EACCES);
  bootstrap_client *right = client_for_port(port, "s3cret", 3000);
  assert_int_equal(kvf__bootstrap_client_put_route(right, &r, 0), 0);
  char ip[64];
  int rport = 0;
  assert_int_equal(kvf__bootstrap_client_get_rank(none, 0, 0, ip, sizeof ip, &rport), 0);
  assert_int_equal(rport, 39001);
  char *m = NULL;
  assert_int_equal(raw(none, "GET", "/metrics", NULL, &m), 200);
  assert_int_equal(metric(m, "kvferry_bootstrap_errors_total{kind=\"unauthorized\"}"), 4);
  free(m);
  kvf__bootstrap_client_destroy(none);
  kvf__bootstrap_client_destroy(wrong);
  kvf__bootstrap_client_destroy(longer);
  kvf__bootstrap_client_destroy(right);
  kvf_bootstrap_server_destroy(srv);

  /* NULL in the config means $KVFERRY_BOOTSTRAP_TOKEN, for server and client. */
  setenv("KVFERRY_BOOTSTRAP_TOKEN", "from-env", 1);
  kvf_bootstrap_server_config cfg;
  kvf_bootstrap_server_config_init(&cfg);
  cfg.host = "127.0.0.1";
  cfg.port = 0;
  assert_int_equal(kvf_bootstrap_server_create(&cfg, &srv), 0);
  port = kvf_bootstrap_server_port(srv);
  none = client_for_port(port, "", 3000);
  assert_int_equal(kvf__bootstrap_client_put_route(none, &r, 0), KVF_EACCES);
  char addr[32];
  snprintf(addr, sizeof addr, "127.0.0.1:%u", (unsigned)port);
  bootstrap_client *env_client = NULL;
  assert_int_equal(kvf__bootstrap_client_create(addr, NULL, &env_client), 0);
  assert_int_equal(kvf__bootstrap_client_put_route(env_client, &r, 0), 0);
  unsetenv("KVFERRY_BOOTSTRAP_TOKEN");
  kvf__bootstrap_client_destroy(env_client);
  kvf__bootstrap_client_destroy(none);
  kvf_bootstrap_server_destroy(srv);
}

struct late_start {
  uint16_t port;
  kvf_bootstrap_server *srv;
};

static void *start_late(void *arg) {
  struct late_start *ls = arg;
  struct timespec ts = {.tv_sec = 0, .tv_nsec = 300 * 1000000L};
  nanosleep(&ts, NULL);
  kvf_bootstrap_server_config cfg;
  kvf_bootstrap_server_config_init(&cfg);
  cfg.host = "127.0.0.1";
  cfg.port = ls->port;
  cfg.auth_token = "";
  if (kvf_bootstrap_server_create(&cfg, &ls->srv)) ls->srv = NULL;
  return NULL;
}

/* PROTOCOL §8.9: the reference's single PUT loses the race against a
 * bootstrap server that starts after its ranks; ours retries. */
static void put_retries_until_the_server_appears(void **state) {
  struct late_start ls = {.port = free_port()};
  bootstrap_client *c = client_for_port(ls.port, NULL, 1000);
  pthread_t th;
  int64_t t0 = clock_now_ns();
  assert_int_equal(pthread_create(&th, NULL, start_late, &ls), 0);
  route_reg r;
  reg_init(&r, 1, 1, 0, "10.0.0.1", 39001);
  int rc = kvf__bootstrap_client_put_route(c, &r, 5000);
  double took = ms_since(t0);
  pthread_join(th, NULL);
  assert_non_null(ls.srv);
  assert_int_equal(rc, 0);
  assert_true(took >= 250 && took < 5000 + LOAD_SLACK_MS);
  char ip[64];
  int port = 0;
  assert_int_equal(kvf__bootstrap_client_get_rank(c, 0, 0, ip, sizeof ip, &port), 0);
  assert_int_equal(port, 39001);
  kvf_bootstrap_server_destroy(ls.srv);

  /* With the server gone the retry gives up at the deadline. */
  t0 = clock_now_ns();
  rc = kvf__bootstrap_client_put_route(c, &r, 400);
  /* The last try may be cut short by the deadline on a loaded machine. */
  assert_true(rc == KVF_ECONNREFUSED || rc == KVF_ETIMEDOUT);
  took = ms_since(t0);
  assert_true(took >= 350 && took < 400 + LOAD_SLACK_MS);
  /* Deadline 0 is one try. */
  t0 = clock_now_ns();
  assert_int_equal(kvf__bootstrap_client_put_route(c, &r, 0), KVF_ECONNREFUSED);
  assert_true(ms_since(t0) < 1500); /* a retry runs for seconds */
  assert_int_equal(kvf__bootstrap_client_health(c), KVF_ECONNREFUSED);
  char ip2[64];
  assert_int_equal(kvf__bootstrap_client_get_rank(c, 0, 0, ip2, sizeof ip2, &port), KVF_ECONNREFUSED);
  kvf__bootstrap_client_destroy(c);
}

/* A socket that listens but never accepts: the kernel completes the TCP
 * handshake, the request is sent, no reply ever comes. */
static void client_times_out_on_a_silent_server(void **state) {
  char where[64];
  int fd = kvf_test_silent_listener(where, sizeof where);
  assert_true(fd >= 0);
  bootstrap_client *c = client_for_port((uint16_t)atoi(strrchr(where, ':') + 1), NULL, 300);

  int64_t t0 = clock_now_ns();
  char ip[64];
  int port = 0;
  assert_int_equal(kvf__bootstrap_client_get_rank(c, 0, 0, ip, sizeof ip, &port), KVF_ETIMEDOUT);
  double took = ms_since(t0);
  assert_true(took >= 250 && took < 300 + LOAD_SLACK_MS);

  t0 = clock_now_ns();
  assert_int_equal(kvf__bootstrap_client_health(c), KVF_ETIMEDOUT);
  assert_true(ms_since(t0) < 300 + LOAD_SLACK_MS);
  route_parallel_info p;
  assert_int_equal(kvf__bootstrap_client_get_parallel_info(c, &p), KVF_ETIMEDOUT);

  /* With an overall deadline, requests in a row end by it together: 20
   * GETs of 300 ms each (6 s), under a 400 ms deadline, take about 400 ms,
   * and one started past it fails at once. */
  kvf__bootstrap_client_set_deadline(c, clock_deadline_ms(400));
  t0 = clock_now_ns();
  for (int i = 0; i < 20; i++) assert_int_equal(kvf__bootstrap_client_health(c), KVF_ETIMEDOUT);
  took = ms_since(t0);
  assert_true(took >= 350 && took < 400 + LOAD_SLACK_MS);
  t0 = clock_now_ns();
  assert_int_equal(kvf__bootstrap_client_get_rank(c, 0, 0, ip, sizeof ip, &port), KVF_ETIMEDOUT);
  assert_true(ms_since(t0) < 50 + LOAD_SLACK_MS);
  kvf__bootstrap_client_set_deadline(c, 0);

  /* The PUT retries timeouts but never past its deadline. */
  route_reg r;
  reg_init(&r, 1, 1, 0, "10.0.0.1", 39001);
  t0 = clock_now_ns();
  assert_int_equal(kvf__bootstrap_client_put_route(c, &r, 700), KVF_ETIMEDOUT);
  took = ms_since(t0);
  assert_true(took >= 600 && took < 700 + LOAD_SLACK_MS);
  kvf__bootstrap_client_destroy(c);
  close(fd);
}

/* A request to a server that never answers ends soon after the client's
 * stop test turns true (its owner shutting down), not at its timeout, and
 * the next request fails at once. */
static atomic_int g_stop_flag;
static int stop_flag(void *arg) {
  (void)arg;
  return atomic_load(&g_stop_flag);
}
static void *raise_stop_later(void *arg) {
  (void)arg;
  usleep(200000);
  atomic_store(&g_stop_flag, 1);
  return NULL;
}

static void client_stops_when_asked(void **state) {
  (void)state;
  char where[64];
  int fd = kvf_test_silent_listener(where, sizeof where);
  assert_true(fd >= 0);
  bootstrap_client *c = client_for_port((uint16_t)atoi(strrchr(where, ':') + 1), NULL, 8000);
  atomic_store(&g_stop_flag, 0);
  kvf__bootstrap_client_set_stop(c, stop_flag, NULL);
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, raise_stop_later, NULL), 0);
  int64_t t0 = clock_now_ns();
  assert_int_equal(kvf__bootstrap_client_health(c), KVF_ESTATE);
  double took = ms_since(t0);
  printf("a request to a silent server, stopped after 200 ms: %.0f ms\n", took);
  assert_true(took >= 150 && took < 1200 + LOAD_SLACK_MS); /* the timeout is 8 s */
  pthread_join(th, NULL);
  t0 = clock_now_ns();
  assert_int_equal(kvf__bootstrap_client_health(c), KVF_ESTATE);
  assert_true(ms_since(t0) < 50 + LOAD_SLACK_MS);
  kvf__bootstrap_client_destroy(c);
  close(fd);
}

static void start_errors(void **state) {
  kvf_bootstrap_server *srv = start_server(NULL, 0, 0);
  kvf_bootstrap_server_config cfg;
  kvf_bootstrap_server_config_init(&cfg);
  cfg.host = "127.0.0.1";
  cfg.port = kvf_bootstrap_server_port(srv);
  kvf_bootstrap_server *other = NULL;
  assert_int_equal(kvf_bootstrap_server_create(&cfg, &other), KVF_EIO);
  assert_null(other);
  cfg.host = "no.such.host.invalid";
  cfg.port = 0;
  assert_int_equal(kvf_bootstrap_server_create(&cfg, &other), KVF_EINVAL);
  assert_int_equal(kvf_bootstrap_server_create(&cfg, NULL), KVF_EINVAL);
  kvf_bootstrap_server_destroy(srv);
  kvf_bootstrap_server_destroy(NULL);

  bootstrap_client *c = NULL;
  assert_int_equal(kvf__bootstrap_client_create("", NULL, &c), KVF_EINVAL);
  assert_int_equal(kvf__bootstrap_client_create("h:1/route?x", NULL, &c), KVF_EINVAL);
  assert_int_equal(kvf__bootstrap_client_create("user@h:1", NULL, &c), KVF_EINVAL);
  assert_null(c);
}

static void ipv6_loopback_when_available(void **state) {
  kvf_bootstrap_server_config cfg;
  kvf_bootstrap_server_config_init(&cfg);
  cfg.host = "::1";
  cfg.port = 0;
  cfg.auth_token = "";
  kvf_bootstrap_server *srv = NULL;
  if (kvf_bootstrap_server_create(&cfg, &srv) != 0) skip(); /* no IPv6 on this host */
  char addr[32];
  snprintf(addr, sizeof addr, "[::1]:%u", (unsigned)kvf_bootstrap_server_port(srv));
  bootstrap_client_opts o = {.token = ""};
  bootstrap_client *c = NULL;
  assert_int_equal(kvf__bootstrap_client_create(addr, &o, &c), 0);
  assert_int_equal(kvf__bootstrap_client_health(c), 0);
  kvf__bootstrap_client_destroy(c);
  kvf_bootstrap_server_destroy(srv);
}

/* ---- codecs on their own ---- */

static void put_body_round_trips(void **state) {
  route_reg r;
  reg_init(&r, 16, 4, 13, "192.168.1.20", 31337);
  r.enable_mla_l1_5_cache = 1;
  int64_t kv[2] = {0, 123456789012LL};
  r.lists[ROUTE_KV_UNIT_LENS] = (route_lens){kv, 2, 1};
  r.lists[ROUTE_STATE_UNIT_LENS] = (route_lens){NULL, 0, 1};
  char *s = kvf__route_json_encode_put(&r);
  assert_non_null(s);
  assert_string_equal(s,
                      "{\"role\": \"Prefill\", \"world_size\": 16, \"dp_size\": 4, \"rank_ip\": \"192.168.1.20\", "
                      "\"rank_port\": 31337, \"engine_rank\": 13, \"enable_mla_l1_5_cache\": true, "
                      "\"kv_unit_lens\": [0, 123456789012], \"state_unit_lens\": []}");
  route_reg back;
  char why[128];
  assert_int_equal(kvf__route_json_parse_put(s, strlen(s), &back, why, sizeof why), 0);
  assert_string_equal(back.role, "Prefill");
  assert_true(kvf__route_reg_is_prefill(&back));
  assert_int_equal(back.world_size, 16);
  assert_int_equal(back.dp_size, 4);
  assert_int_equal(back.engine_rank, 13);
  assert_int_equal(back.rank_port, 31337);
  assert_int_equal(back.enable_mla_l1_5_cache, 1);
  assert_false(back.lists[ROUTE_KV_ITEM_LENS].present);
  assert_true(back.lists[ROUTE_KV_UNIT_LENS].present);
  assert_int_equal(back.lists[ROUTE_KV_UNIT_LENS].v[1], 123456789012LL);
  assert_true(back.lists[ROUTE_STATE_UNIT_LENS].present);
  assert_int_equal(back.lists[ROUTE_STATE_UNIT_LENS].n, 0);
  kvf__route_reg_free(&back);
  free(s);

  /* Not NUL-terminated input: the parser reads exactly len bytes. */
  size_t n = strlen(A1_PUT);
  char *copy = malloc(n);
  memcpy(copy, A1_PUT, n);
  assert_int_equal(kvf__route_json_parse_put(copy, n, &back, why, sizeof why), 0);
  kvf__route_reg_free(&back);
  assert_int_equal(kvf__route_json_parse_put(copy, n - 1, &back, why, sizeof why), KVF_EINVAL);
  free(copy);

  /* Truthiness of the MLA flag follows Python. */
  const char *truthy =
      "{\"role\": \"x\", \"world_size\": 1, \"dp_size\": 1, \"rank_ip\": \"h\", \"rank_port\": 1, "
      "\"engine_rank\": 0, \"enable_mla_l1_5_cache\": \"no\", \"kv_item_lens\": null}";
  assert_int_equal(kvf__route_json_parse_put(truthy, strlen(truthy), &back, why, sizeof why), 0);
  assert_int_equal(back.enable_mla_l1_5_cache, 1);
  assert_false(kvf__route_reg_is_prefill(&back));
  assert_false(back.lists[ROUTE_KV_ITEM_LENS].present);
  kvf__route_reg_free(&back);
}

static void reply_parsers_are_strict(void **state) {
  route_parallel_info p;
  const char *ok = "{\"prefill_tp_size\":8,\"prefill_dp_size\":2,\"enable_mla_l1_5_cache\":false}";
  assert_int_equal(kvf__route_json_parse_parallel_info(ok, strlen(ok), &p), 0);
  assert_int_equal(p.world_size, 8);
  assert_int_equal(p.lists[ROUTE_KV_ITEM_LENS].n, 0);
  kvf__route_parallel_info_free(&p);
  static const char *bad_infos[] = {
      "{\"prefill_tp_size\":8,\"prefill_dp_size\":3,\"enable_mla_l1_5_cache\":false}",
      "{\"prefill_tp_size\":8,\"prefill_dp_size\":0,\"enable_mla_l1_5_cache\":false}",
      "{\"prefill_tp_size\":null,\"prefill_dp_size\":2,\"enable_mla_l1_5_cache\":false}",
      "{\"prefill_tp_size\":8,\"prefill_dp_size\":2}",
      "{\"prefill_tp_size\":\"8\",\"prefill_dp_size\":2,\"enable_mla_l1_5_cache\":false}",
      "{\"prefill_tp_size\":8,\"prefill_dp_size\":2,\"enable_mla_l1_5_cache\":false,\"kv_item_lens\":[-4]}",
      "[]",
      "",
  };
  for (size_t i = 0; i < sizeof bad_infos / sizeof bad_infos[0]; i++)
    assert_int_equal(kvf__route_json_parse_parallel_info(bad_infos[i], strlen(bad_infos[i]), &p), KVF_EPROTO);

  char ip[16];
  int port = 0;
  const char *rank = "{\"rank_ip\": \"10.0.0.1\", \"rank_port\": 39001}";
  assert_int_equal(kvf__route_json_parse_rank(rank, strlen(rank), ip, sizeof ip, &port), 0);
  assert_string_equal(ip, "10.0.0.1");
  assert_int_equal(port, 39001);
  assert_int_equal(kvf__route_json_parse_rank(rank, strlen(rank), ip, 8, &port), KVF_EPROTO); /* does not fit */
  const char *bad_rank = "{\"rank_ip\": \"10.0.0.1\", \"rank_port\": \"39001\"}";
  assert_int_equal(kvf__route_json_parse_rank(bad_rank, strlen(bad_rank), ip, sizeof ip, &port), KVF_EPROTO);

  int64_t v;
  assert_int_equal(kvf__route_parse_int("-9223372036854775808", 20, &v), 0);
  assert_true(v == INT64_MIN);
  assert_int_equal(kvf__route_parse_int("9223372036854775807", 19, &v), 0);
  assert_true(v == INT64_MAX);
  assert_int_equal(kvf__route_parse_int("9223372036854775808", 19, &v), KVF_EINVAL);
  assert_int_equal(kvf__route_parse_int("-", 1, &v), KVF_EINVAL);
  assert_int_equal(kvf__route_parse_int("  ", 2, &v), KVF_EINVAL);
  assert_int_equal(kvf__route_parse_int("1_0", 3, &v), KVF_EINVAL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(health_get_head_and_unknown_paths),
      cmocka_unit_test(parallel_info_is_null_before_any_put),
      cmocka_unit_test(appendix_a_put_then_discover),
      cmocka_unit_test(eight_ranks_register_concurrently),
      cmocka_unit_test(sizes_freeze_and_extras_follow_the_last_put),
      cmocka_unit_test(bad_requests_get_400_and_change_nothing),
      cmocka_unit_test(oversized_bodies_get_413),
      cmocka_unit_test(chunked_oversized_body_is_cut_off),
      cmocka_unit_test(token_guards_put_only),
      cmocka_unit_test(put_retries_until_the_server_appears),
      cmocka_unit_test(client_times_out_on_a_silent_server),
      cmocka_unit_test(client_stops_when_asked),
      cmocka_unit_test(start_errors),
      cmocka_unit_test(ipv6_loopback_when_available),
      cmocka_unit_test(put_body_round_trips),
      cmocka_unit_test(reply_parsers_are_strict),
      cmocka_unit_test(metrics_sources_add_lines),
      cmocka_unit_test(metrics_families_appear_once),
      cmocka_unit_test(metrics_group_rules),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

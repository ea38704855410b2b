/* The KV manager's shared core (src/kv/manager.c): creation and teardown
 * for both roles, with its own engine or a shared one (what it registered
 * is unregistered, what the caller registered is left alone, and a failed
 * create leaves the shared engine as it was); bad configurations and buffer
 * descriptions refused with KVF_EINVAL; defaults, TOKENSPEED_* overrides
 * and the reference's clamps; the counters and their Prometheus lines. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>

#include "bootstrap/bootstrap.h"
#include "kv/manager.h"
#include "kvferry.h"

#define ITEM 256
#define PAGES 16
#define LOAD_SLACK_S 3.0 /* scheduling on a loaded machine (two ctest -j2 on two cores) */

static unsigned char kv0[ITEM * PAGES], kv1[ITEM * PAGES], st0[64 * 4];

typedef struct bufs_desc {
  void *ptrs[2], *sptrs[1];
  uint64_t lens[2], items[2], slens[1], sitems[1];
  uint32_t start[2], layer_bufs[2];
  kvf_kv_buffers b;
} bufs_desc;

/* Two KV buffers (one MHA layer) and one state buffer. */
static void bufs_init(bufs_desc *d) {
  memset(d, 0, sizeof *d);
  d->ptrs[0] = kv0, d->ptrs[1] = kv1, d->sptrs[0] = st0;
  d->lens[0] = d->lens[1] = sizeof kv0;
  d->items[0] = d->items[1] = ITEM;
  d->slens[0] = sizeof st0, d->sitems[0] = 64;
  d->b = (kvf_kv_buffers){.n_kv = 2,
                          .kv_ptrs = d->ptrs,
                          .kv_lens = d->lens,
                          .kv_item_lens = d->items,
                          .n_state = 1,
                          .state_ptrs = d->sptrs,
                          .state_lens = d->slens,
                          .state_item_lens = d->sitems};
}

static void decode_config(kvf_manager_config *c) {
  kvf_manager_config_init(c);
  c->role = KVF_ROLE_DECODE;
  c->heartbeat_interval_s = 60;
}

/* A decode manager with default settings over d's buffers. */
static kvf_manager *decode_manager(bufs_desc *d) {
  bufs_init(d);
  kvf_manager_config c;
  decode_config(&c);
  kvf_manager *m = NULL;
  assert_int_equal(kvf_manager_create(&c, &d->b, &m), 0);
  return m;
}

static double now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

/* 1 when none of the three buffers is registered in e (registering each
 * succeeds; undone at once). */
static int none_registered(kvf_engine *e) {
  void *all[3] = {kv0, kv1, st0};
  size_t len[3] = {sizeof kv0, sizeof kv1, sizeof st0};
  int ok = 1;
  for (int i = 0; i < 3; i++) {
    int rc = kvf_engine_register(e, all[i], len[i]);
    if (rc) ok = 0;
    else kvf_engine_unregister(e, all[i]);
  }
  return ok;
}

/* A decode manager with its own engine: its session is its engine's, and a
 * peer's write into its KV buffer lands (the buffers are registered). */
static void decode_with_own_engine(void **state) {
  (void)state;
  bufs_desc d;
  kvf_manager *m = decode_manager(&d);
  kvf_engine *own = kvf_manager_engine(m);
  assert_non_null(own);
  assert_string_equal(kvf_manager_session_id(m), kvf_engine_session_id(own));
  assert_true(m->rank_port != 0);
  assert_int_equal(m->bufs.n_layers, 1);

  kvf_engine *w = NULL;
  assert_int_equal(kvf_engine_create(NULL, &w), 0);
  static unsigned char src[ITEM];
  memset(src, 0xAB, sizeof src);
  assert_int_equal(kvf_engine_register(w, src, sizeof src), 0);
  kvf_write wr[2] = {{.src = (uint64_t)(uintptr_t)src, .dst = (uint64_t)(uintptr_t)(kv1 + 3 * ITEM), .len = ITEM},
                     {.src = (uint64_t)(uintptr_t)src, .dst = (uint64_t)(uintptr_t)(st0 + 64), .len = 64}};
  assert_int_equal(kvf_engine_write(w, kvf_manager_session_id(m), wr, 2), 0);
  kvf_engine_sync(own);
  assert_memory_equal(kv1 + 3 * ITEM, src, ITEM);
  assert_memory_equal(st0 + 64, src, 64);
  kvf_engine_destroy(w);
  kvf_manager_destroy(m);
  kvf_manager_destroy(NULL); /* a no-op */
}

/* With a shared engine the manager registers the buffers the engine does
 * not hold yet, unregisters exactly those at destroy, and leaves the one
 * the caller had registered itself. */
static void shared_engine_left_as_found(void **state) {
  (void)state;
  bufs_desc d;
  bufs_init(&d);
  kvf_engine *e = NULL;
  assert_int_equal(kvf_engine_create(NULL, &e), 0);
  assert_int_equal(kvf_engine_register(e, kv1, sizeof kv1), 0); /* the caller's own */
  kvf_manager_config c;
  decode_config(&c);
  c.engine = e;
  kvf_manager *m = NULL;
  assert_int_equal(kvf_manager_create(&c, &d.b, &m), 0);
  assert_ptr_equal(kvf_manager_engine(m), e);
  assert_string_equal(kvf_manager_session_id(m), kvf_engine_session_id(e));
  assert_int_equal(kvf_engine_register(e, kv0, sizeof kv0), KVF_EEXIST); /* the manager's */
  assert_int_equal(kvf_engine_register(e, st0, sizeof st0), KVF_EEXIST);
  kvf_manager_destroy(m);
  assert_int_equal(kvf_engine_unregister(e, kv1), 0); /* still the caller's */
  assert_true(none_registered(e));
  kvf_engine_destroy(e);
}

/* A prefill registers its rank with its bootstrap server (PUT /route) at
 * create; the route names its PULL port. */
static void prefill_registers_its_route(void **state) {
  (void)state;
  bufs_desc d;
  bufs_init(&d);
  kvf_bootstrap_server_config sc;
  kvf_bootstrap_server_config_init(&sc);
  sc.host = "127.0.0.1";
  sc.port = 0;
  kvf_bootstrap_server *srv = NULL;
  assert_int_equal(kvf_bootstrap_server_create(&sc, &srv), 0);
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%u", (unsigned)kvf_bootstrap_server_port(srv));
  kvf_manager_config c;
  kvf_manager_config_init(&c);
  c.role = KVF_ROLE_PREFILL;
  c.bootstrap_addr = addr;
  kvf_manager *m = NULL;
  assert_int_equal(kvf_manager_create(&c, &d.b, &m), 0);
  bootstrap_client_opts o = {.token = "", .connect_timeout_ms = 2000, .timeout_ms = 5000};
  bootstrap_client *cl = NULL;
  assert_int_equal(kvf__bootstrap_client_create(addr, &o, &cl), 0);
  char ip[64];
  int port = 0;
  assert_int_equal(kvf__bootstrap_client_get_rank(cl, 0, 0, ip, sizeof ip, &port), 0);
  assert_string_equal(ip, "127.0.0.1");
  assert_int_equal(port, m->rank_port);
  kvf__bootstrap_client_destroy(cl);
  kvf_manager_destroy(m);
  kvf_bootstrap_server_destroy(srv);
}

/* A prefill whose bootstrap server never answers fails its create once the
 * PUT's retries are spent (3 x http_timeout_ms), and leaves nothing
 * registered in the shared engine. */
static void prefill_without_bootstrap_fails_cleanly(void **state) {
  (void)state;
  bufs_desc d;
  bufs_init(&d);
  kvf_engine *e = NULL;
  assert_int_equal(kvf_engine_create(NULL, &e), 0);
  kvf_engine *probe = NULL; /* a port nobody listens on once this is gone */
  assert_int_equal(kvf_engine_create(NULL, &probe), 0);
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%u", (unsigned)kvf_engine_port(probe));
  kvf_engine_destroy(probe);
  kvf_manager_config c;
  kvf_manager_config_init(&c);
  c.role = KVF_ROLE_PREFILL;
  c.bootstrap_addr = addr;
  c.http_timeout_ms = 200;
  c.engine = e;
  kvf_manager *m = NULL;
  double t0 = now_s();
  int rc = kvf_manager_create(&c, &d.b, &m);
  double took = now_s() - t0;
  printf("create without a bootstrap server: %s after %.2f s\n", kvf_strerror(rc), took);
  assert_true(rc < 0);
  assert_null(m);
  assert_true(took < 3 * 0.2 + LOAD_SLACK_S);
  assert_true(none_registered(e));
  kvf_engine_destroy(e);
}

/* Bad configurations and buffer descriptions: KVF_EINVAL, *out untouched,
 * nothing left registered in the shared engine. */
static void bad_configs_refused(void **state) {
  (void)state;
  kvf_engine *e = NULL;
  assert_int_equal(kvf_engine_create(NULL, &e), 0);
  char long_token[400];
  memset(long_token, 'k', sizeof long_token - 1);
  long_token[sizeof long_token - 1] = 0;
  for (int k = 0; k < 14; k++) {
    bufs_desc d;
    bufs_init(&d);
    kvf_manager_config c;
    decode_config(&c);
    c.engine = e;
    uint32_t bad_ids[1] = {5};
    const char *what = "";
    switch (k) {
      case 0: what = "role 2", c.role = 2; break;
      case 1: what = "world 3, dp 2", c.world_size = 3, c.dp_size = 2; break;
      case 2: what = "rank past the world", c.engine_rank = 1; break;
      case 3: what = "negative rank", c.engine_rank = -1; break;
      case 4: what = "control token of 399 bytes", c.control_token = long_token; break;
      case 5: what = "no KV buffers", d.b.n_kv = 0; break;
      case 6: what = "item length 0", d.items[1] = 0; break;
      case 7: what = "item longer than its buffer", d.items[0] = sizeof kv0 + 1; break;
      case 8: what = "a NULL buffer", d.ptrs[1] = NULL; break;
      case 9:
        what = "layer mapping names buffer 5";
        d.start[0] = 0, d.start[1] = 2, d.layer_bufs[0] = 0, d.layer_bufs[1] = 5;
        d.b.n_layers = 1, d.b.layer_buf_start = d.start, d.b.layer_bufs = d.layer_bufs;
        break;
      case 10: what = "state buffers without pointers", d.b.state_ptrs = NULL; break;
      case 11: what = "state layer past the KV layers", c.state_layer_ids = bad_ids; break;
      case 12: what = "struct not initialised", c.size = 0; break;
      case 13: what = "verify on unreadable memory", c.verify = 1, d.ptrs[1] = (void *)(uintptr_t)4096; break;
    }
    kvf_manager *m = (kvf_manager *)(uintptr_t)0x1;
    int rc = kvf_manager_create(&c, &d.b, &m);
    printf("%-34s -> %s\n", what, kvf_err_name(rc));
    assert_int_equal(rc, KVF_EINVAL);
    assert_ptr_equal(m, (kvf_manager *)(uintptr_t)0x1);
    assert_true(none_registered(e));
  }
  bufs_desc d;
  bufs_init(&d);
  kvf_manager_config c;
  decode_config(&c);
  kvf_manager *m = NULL;
  assert_int_equal(kvf_manager_create(NULL, &d.b, &m), KVF_EINVAL);
  assert_int_equal(kvf_manager_create(&c, NULL, &m), KVF_EINVAL);
  assert_int_equal(kvf_manager_create(&c, &d.b, NULL), KVF_EINVAL);
  assert_null(m);
  kvf_engine_destroy(e);
}

/* Unset fields take the defaults, then TOKENSPEED_DISAGGREGATION_* override,
 * then the reference's clamps apply (PROTOCOL §7.6). */
static void defaults_env_and_clamps(void **state) {
  (void)state;
  bufs_desc d;
  bufs_init(&d);
  unsetenv("KVFERRY_HEARTBEAT_MIN_S");
  kvf_manager_config c;
  decode_config(&c);
  c.bootstrap_timeout_s = 0;
  c.waiting_timeout_s = -1;
  c.http_timeout_ms = 0;
  c.world_size = 0;
  c.page_size = 0;
  setenv("TOKENSPEED_DISAGGREGATION_HEARTBEAT_INTERVAL", "0.5", 1);
  setenv("TOKENSPEED_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", "0", 1);
  setenv("TOKENSPEED_DISAGGREGATION_QUEUE_SIZE", "1000", 1);
  setenv("TOKENSPEED_DISAGGREGATION_WAITING_TIMEOUT", "7", 1);
  kvf_manager *m = NULL;
  assert_int_equal(kvf_manager_create(&c, &d.b, &m), 0);
  unsetenv("TOKENSPEED_DISAGGREGATION_HEARTBEAT_INTERVAL");
  unsetenv("TOKENSPEED_DISAGGREGATION_HEARTBEAT_MAX_FAILURE");
  unsetenv("TOKENSPEED_DISAGGREGATION_QUEUE_SIZE");
  unsetenv("TOKENSPEED_DISAGGREGATION_WAITING_TIMEOUT");
  assert_true(m->cfg.bootstrap_timeout_s == 120);
  assert_true(m->cfg.waiting_timeout_s == 7);
  assert_true(m->cfg.heartbeat_interval_s == 2.0); /* the reference's floor */
  assert_int_equal(m->cfg.heartbeat_max_failures, 1);
  assert_int_equal(m->cfg.queue_size, 64);
  assert_int_equal(m->cfg.http_timeout_ms, 5000);
  assert_int_equal(m->cfg.world_size, 1);
  assert_int_equal(m->cfg.page_size, 1);
  assert_int_equal(m->tp_size, 1);
  assert_int_equal(m->tp_rank, 0);
  kvf_manager_destroy(m);

  /* Rank 5 of world 8 with dp 2: tp 4, tp rank 1, dp rank 1. */
  decode_config(&c);
  c.world_size = 8, c.dp_size = 2, c.engine_rank = 5;
  assert_int_equal(kvf_manager_create(&c, &d.b, &m), 0);
  assert_int_equal(m->tp_size, 4);
  assert_int_equal(m->tp_rank, 1);
  assert_int_equal(m->dp_rank, 1);
  kvf_manager_destroy(m);
}

static const char *find_line(const char *text, const char *prefix, char *line, size_t cap) {
  const char *p = strstr(text, prefix);
  if (!p) return NULL;
  const char *nl = strchr(p, '\n');
  size_t n = nl ? (size_t)(nl - p) : strlen(p);
  snprintf(line, cap, "%.*s", (int)n, p);
  return line;
}

/* The counters and their Prometheus lines: one line per kvf_manager_stats
 * field, labelled with role and session, whole lines only when the buffer
 * is short. */
static void stats_and_metrics(void **state) {
  (void)state;
  bufs_desc d;
  kvf_manager *m = decode_manager(&d);
  kvf__manager_reject(m, "10.0.0.9", "M3", "test: malformed");
  kvf__manager_reject(m, "10.0.0.9", "M3", "test: malformed again");
  kvf__manager_reject_forged(m, "10.0.0.8", "M3", "test: forged");
  assert_int_equal(kvf__rooms_create(m->rooms, 5, KVF_POLL_TRANSFERRING), 0);
  assert_int_equal(kvf__rooms_create(m->rooms, 6, KVF_POLL_TRANSFERRING), 0);
  assert_int_equal(kvf__rooms_clear(m->rooms, 6, NULL), 0);
  kvf_manager_stats st;
  kvf_manager_get_stats(m, &st);
  assert_int_equal(st.messages_malformed, 2);
  assert_int_equal(st.messages_forged, 1);
  assert_int_equal(st.live_rooms, 1);
  assert_int_equal(st.rooms_created, 2);
  assert_int_equal(st.rooms_cleared, 1);
  assert_int_equal(st.messages_received, 0);

  static char buf[16384];
  size_t n = kvf_manager_metrics(m, buf, sizeof buf);
  assert_int_equal(n, strlen(buf));
  size_t lines = 0;
  for (const char *p = buf; *p; p = strchr(p, '\n') + 1) lines += !strncmp(p, "kvferry_manager_", 16);
  assert_int_equal(lines, sizeof(kvf_manager_stats) / sizeof(uint64_t));
  char want[256], line[256];
  snprintf(want, sizeof want, "kvferry_manager_messages_malformed{role=\"decode\",session=\"%s\"} 2",
           kvf_manager_session_id(m));
  assert_non_null(find_line(buf, "kvferry_manager_messages_malformed{", line, sizeof line));
  assert_string_equal(line, want);
  snprintf(want, sizeof want, "kvferry_manager_live_rooms{role=\"decode\",session=\"%s\"} 1",
           kvf_manager_session_id(m));
  assert_non_null(find_line(buf, "kvferry_manager_live_rooms{", line, sizeof line));
  assert_string_equal(line, want);
  /* The counters, then the room-trace histograms (issue 25), each whole:
   * its TYPE line, buckets up to +Inf, _sum and _count. */
  int hist = 0;
  for (const char *p = buf; *p; p = strchr(p, '\n') + 1) {
    if (!strncmp(p, "# TYPE kvferry_room_", 20)) hist = 1;
    else if (hist) assert_int_equal(strncmp(p, "kvferry_room_", 13), 0);
    else assert_int_equal(strncmp(p, "kvferry_manager_", 16), 0);
  }
  assert_true(hist);
  assert_non_null(strstr(buf, "kvferry_room_m2_to_success_seconds_bucket{role=\"decode\""));
  assert_null(strstr(buf, "kvferry_room_queue_wait_seconds")); /* a prefill's only */

  /* A short buffer: whole lines only, NUL-terminated. */
  size_t first = (size_t)(strchr(buf, '\n') - buf) + 1;
  char small[512];
  memset(small, 'x', sizeof small);
  assert_true(first + 10 < sizeof small);
  assert_int_equal(kvf_manager_metrics(m, small, first + 10), first);
  assert_int_equal(strlen(small), first);
  assert_memory_equal(small, buf, first);
  assert_int_equal(kvf_manager_metrics(m, small, first), 0); /* the line and its NUL do not fit */
  assert_string_equal(small, "");
  small[0] = 'x';
  assert_int_equal(kvf_manager_metrics(m, small, 0), 0);
  assert_int_equal(small[0], 'x'); /* cap 0: nothing written */
  assert_int_equal(kvf_manager_metrics(NULL, small, sizeof small), 0);
  assert_string_equal(small, "");

  assert_int_equal(kvf__rooms_clear(m->rooms, 5, NULL), 0);
  kvf_manager_destroy(m);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(decode_with_own_engine),      cmocka_unit_test(shared_engine_left_as_found),
      cmocka_unit_test(prefill_registers_its_route), cmocka_unit_test(prefill_without_bootstrap_fails_cleanly),
      cmocka_unit_test(bad_configs_refused),         cmocka_unit_test(defaults_env_and_clamps),
      cmocka_unit_test(stats_and_metrics),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

/* The test peers started as processes honour the secrets from the
 * environment, as deployments set them (issue 13, "smaller"):
 * `kvferry-testpeer engine-peer` takes KVFERRY_AUTH_TOKEN, and the bootstrap server
 * that `kvferry-testpeer kv-peer` starts takes KVFERRY_BOOTSTRAP_TOKEN. */
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "bootstrap/bootstrap.h"
#include "tools/peer.h"
#include "kvferry.h"

static long put_route(const char *addr, const char *token) {
  static const char body[] =
      "{\"role\":\"Prefill\",\"world_size\":1,\"dp_size\":1,\"rank_ip\":\"10.0.0.9\",\"rank_port\":39009,"
      "\"engine_rank\":0,\"enable_mla_l1_5_cache\":false,\"kv_item_lens\":[64],\"kv_unit_lens\":[64],"
      "\"state_item_lens\":[],\"state_unit_lens\":[]}";
  bootstrap_client_opts o = {.token = token, .connect_timeout_ms = 2000, .timeout_ms = 5000};
  bootstrap_client *c = NULL;
  assert_int_equal(kvf__bootstrap_client_create(addr, &o, &c), 0);
  long status = 0;
  assert_int_equal(kvf__bootstrap_client_request(c, "PUT", "/route", body, strlen(body), &status, NULL, NULL), 0);
  kvf__bootstrap_client_destroy(c);
  return status;
}

static void engine_peer_takes_auth_token_from_env(void **state) {
  (void)state;
  assert_non_null(getenv("KVFERRY_TESTPEER")); /* the peer is the test peer of this build */
  setenv("KVFERRY_AUTH_TOKEN", "from-env", 1);
  engine_peer peer;
  int started = engine_peer_start(&peer, 1u << 20, NULL);
  unsetenv("KVFERRY_AUTH_TOKEN");
  assert_int_equal(started, 0);
  static unsigned char src[4096];
  kvf_write w = {.src = (uint64_t)(uintptr_t)src, .dst = peer.base, .len = sizeof src};
  const char *tokens[] = {"", "from-env"};
  int want[] = {KVF_EACCES, 0};
  for (int i = 0; i < 2; i++) {
    kvf_engine_config cfg;
    kvf_engine_config_init(&cfg);
    cfg.auth_token = tokens[i];
    kvf_engine *e = NULL;
    assert_int_equal(kvf_engine_create(&cfg, &e), 0);
    assert_int_equal(kvf_engine_register(e, src, sizeof src), 0);
    assert_int_equal(kvf_engine_write(e, peer.session, &w, 1), want[i]);
    kvf_engine_destroy(e);
  }
  engine_peer_stop(&peer);
}

static void kv_peer_bootstrap_takes_token_from_env(void **state) {
  (void)state;
  const char *exe = getenv("KVFERRY_TESTPEER");
  assert_non_null(exe);
  char *argv[] = {(char *)exe, "kv-peer", "--world", "1", "--layers", "1", "--item", "64", "--pages", "4", NULL};
  setenv("KVFERRY_BOOTSTRAP_TOKEN", "boot-env", 1);
  proc p;
  int started = proc_start(&p, argv);
  unsetenv("KVFERRY_BOOTSTRAP_TOKEN");
  assert_int_equal(started, 0);
  char line[400], addr[300];
  assert_int_equal(proc_read_line(&p, line, sizeof line, 20000), 0);
  assert_int_equal(sscanf(line, "ready %299s", addr), 1);
  /* Its own prefill rank registered with the token (it is "ready"); a PUT
   * without it is refused, one with it accepted. */
  assert_int_equal(put_route(addr, ""), 401);
  assert_int_equal(put_route(addr, "wrong"), 401);
  assert_int_equal(put_route(addr, "boot-env"), 200);
  proc_stop(&p, 5000);
}

int main(void) {
  signal(SIGPIPE, SIG_IGN);
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(engine_peer_takes_auth_token_from_env),
      cmocka_unit_test(kv_peer_bootstrap_takes_token_from_env),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

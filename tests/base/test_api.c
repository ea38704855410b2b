/* The API v1 conventions that are not tied to a transfer: the error table
 * (kvf_strerror / kvf_err_name from one list), the constants table
 * (kvf_const, what bindings read instead of the headers), version checks,
 * and growable config structs (size set by *_config_init and checked by the
 * library; fields set by name). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <cmocka.h>

#include "kvferry.h"

static void error_table(void **state) {
  (void)state;
  assert_string_equal(kvf_err_name(KVF_EINVAL), "KVF_EINVAL");
  assert_string_equal(kvf_err_name(KVF_EAGAIN), "KVF_EAGAIN");
  assert_string_equal(kvf_err_name(KVF_OK), "KVF_OK");
  assert_string_equal(kvf_err_name(-999), "KVF_E?");
  assert_string_equal(kvf_strerror(KVF_ETOOBIG), "input exceeds a size bound");
  assert_string_equal(kvf_strerror(-999), "unknown error");
  /* every code from 0 down to the last has a distinct name and a text */
  for (int e = 0; e >= KVF_EAGAIN; e--) {
    assert_string_not_equal(kvf_err_name(e), "KVF_E?");
    assert_string_not_equal(kvf_strerror(e), "unknown error");
    int64_t v = 1;
    assert_int_equal(kvf_const(kvf_err_name(e), &v), 0);
    assert_int_equal(v, e);
  }
}

static void constants(void **state) {
  (void)state;
  int64_t v = 0;
  assert_int_equal(kvf_const("KVF_MAX_CANDIDATES", &v), 0);
  assert_int_equal(v, KVF_MAX_CANDIDATES);
  assert_int_equal(kvf_const("KVF_POLL_SUCCESS", &v), 0);
  assert_int_equal(v, KVF_POLL_SUCCESS);
  assert_int_equal(kvf_const("KVF_SEND_TOKEN_LATER", &v), 0);
  assert_int_equal(v, KVF_SEND_TOKEN_LATER);
  assert_int_equal(kvf_const("KVF_SIZEOF_MANAGER_CONFIG", &v), 0);
  assert_int_equal(v, sizeof(kvf_manager_config));
  assert_int_equal(kvf_const("KVF_NOPE", &v), KVF_ENOTFOUND);
  size_t n = 0;
  const char *name;
  while ((name = kvf_const_at(n, &v)) != NULL) {
    int64_t again;
    assert_int_equal(kvf_const(name, &again), 0); /* names are unique enough to find */
    assert_int_equal(again, v);
    n++;
  }
  assert_true(n > 30);
}

static void version(void **state) {
  (void)state;
  assert_string_equal(kvf_version(), KVF_VERSION_STRING);
  assert_true(KVF_VERSION_OK());
  assert_true(kvf_version_compatible(KVF_VERSION_MAJOR, 0));
  assert_false(kvf_version_compatible(KVF_VERSION_MAJOR + 1, 0));
  assert_false(kvf_version_compatible(KVF_VERSION_MAJOR, KVF_VERSION_MINOR + 1));
}

/* A config not set up by its _init is refused; one from older headers
 * (smaller size) is accepted and gets defaults for the rest. */
static void config_size_checked(void **state) {
  (void)state;
  kvf_engine_config ec;
  memset(&ec, 0, sizeof ec);
  kvf_engine *e = NULL;
  assert_int_equal(kvf_engine_create(&ec, &e), KVF_EINVAL);
  assert_null(e);
  kvf_engine_config_init(&ec);
  assert_int_equal(ec.size, sizeof ec);
  ec.size = sizeof ec + 8; /* newer headers than this library */
  assert_int_equal(kvf_engine_create(&ec, &e), KVF_EINVAL);
  ec.size = sizeof ec;
  assert_int_equal(kvf_engine_create(&ec, &e), 0);
  kvf_engine_destroy(e);

  kvf_bootstrap_server_config bc;
  memset(&bc, 0, sizeof bc);
  kvf_bootstrap_server *srv = NULL;
  assert_int_equal(kvf_bootstrap_server_create(&bc, &srv), KVF_EINVAL);
  kvf_manager_config mc;
  memset(&mc, 0, sizeof mc);
  kvf_manager *m = NULL;
  static uint8_t buf[4096];
  void *ptrs[] = {buf};
  uint64_t lens[] = {sizeof buf}, items[] = {64};
  kvf_kv_buffers bufs = {.n_kv = 1, .kv_ptrs = ptrs, .kv_lens = lens, .kv_item_lens = items};
  assert_int_equal(kvf_manager_create(&mc, &bufs, &m), KVF_EINVAL);
  assert_null(m);
}

static void config_set_by_name(void **state) {
  (void)state;
  kvf_engine_config ec;
  kvf_engine_config_init(&ec);
  assert_int_equal(kvf_engine_config_set(&ec, "timeout_ms", "1234"), 0);
  assert_int_equal(ec.timeout_ms, 1234);
  assert_int_equal(kvf_engine_config_set(&ec, "port", "65535"), 0);
  assert_int_equal(ec.port, 65535);
  assert_int_equal(kvf_engine_config_set(&ec, "port", "65536"), KVF_EINVAL);
  assert_int_equal(kvf_engine_config_set(&ec, "timeout_ms", "12x"), KVF_EINVAL);
  assert_int_equal(kvf_engine_config_set(&ec, "host", "10.0.0.1"), 0);
  assert_string_equal(ec.host, "10.0.0.1");
  assert_int_equal(kvf_engine_config_set(&ec, "no_such_field", "1"), KVF_ENOTFOUND);

  kvf_manager_config mc;
  kvf_manager_config_init(&mc);
  assert_int_equal(kvf_manager_config_set(&mc, "role", "prefill"), 0);
  assert_int_equal(mc.role, KVF_ROLE_PREFILL);
  assert_int_equal(kvf_manager_config_set(&mc, "role", "1"), 0);
  assert_int_equal(mc.role, KVF_ROLE_DECODE);
  assert_int_equal(kvf_manager_config_set(&mc, "waiting_timeout_s", "2.5"), 0);
  assert_true(mc.waiting_timeout_s == 2.5);
  assert_int_equal(kvf_manager_config_set(&mc, "waiting_timeout_s", "nan"), KVF_EINVAL);
  assert_int_equal(kvf_manager_config_set(&mc, "max_rooms", "-1"), KVF_EINVAL);
  assert_int_equal(kvf_manager_config_set(&mc, "max_rooms", "100"), 0);
  assert_int_equal(mc.max_rooms, 100);
  assert_int_equal(kvf_manager_config_set(&mc, "engine", "0"), KVF_ENOTFOUND); /* a pointer: set_ptr */
  assert_int_equal(kvf_manager_config_set_ptr(&mc, "engine_cfg", &ec), 0);
  assert_ptr_equal(mc.engine_cfg, &ec);
  assert_int_equal(kvf_manager_config_set_ptr(&mc, "role", &ec), KVF_ENOTFOUND);

  kvf_bootstrap_server_config bc;
  kvf_bootstrap_server_config_init(&bc);
  assert_int_equal(kvf_bootstrap_server_config_set(&bc, "idle_timeout_s", "7"), 0);
  assert_int_equal(bc.idle_timeout_s, 7);
  bc.size = 0;
  assert_int_equal(kvf_bootstrap_server_config_set(&bc, "idle_timeout_s", "7"), KVF_EINVAL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(error_table),
      cmocka_unit_test(constants),
      cmocka_unit_test(version),
      cmocka_unit_test(config_size_checked),
      cmocka_unit_test(config_set_by_name),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

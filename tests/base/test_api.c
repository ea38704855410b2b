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

#include "base/config.h"
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

/* A struct as a program built against the first published headers hands it
 * over: `size` is the first version's, and whatever lies past it in memory
 * (fields that version did not have) is garbage the library must not read. */
#define FIRST_VERSION(type, init_fn, v1, out) \
  do {                                        \
    type full_;                               \
    init_fn(&full_);                          \
    memset(&(out), 0xA5, sizeof(out));        \
    memcpy(&(out), &full_, (v1));             \
    (out).c.size = (v1);                      \
  } while (0)

/* The copy itself: a caller's first-version struct fills only the fields it
 * has; newer fields keep the library's defaults, never the caller's bytes
 * past its size. */
static void config_copy_takes_first_version(void **state) {
  (void)state;
  typedef struct v2 {
    size_t size;
    int a;
    int pad_;
    uint64_t b; /* added in "v2" */
  } v2;
  const size_t v1_size = offsetof(v2, pad_);
  union {
    v2 s;
    unsigned char raw[sizeof(v2)];
  } caller;
  memset(&caller, 0xA5, sizeof caller);
  caller.s.size = v1_size;
  caller.s.a = 7;
  v2 lib = {.size = sizeof(v2), .a = 1, .pad_ = 0, .b = 42};
  assert_int_equal(kvf__config_copy(&lib, sizeof lib, &caller, v1_size), 0);
  assert_int_equal(lib.size, sizeof lib);
  assert_int_equal(lib.a, 7);
  assert_int_equal(lib.b, 42); /* not 0xA5A5...: past the caller's size */
  caller.s.size = v1_size - 1;
  assert_int_equal(kvf__config_copy(&lib, sizeof lib, &caller, v1_size), KVF_EINVAL);
  caller.s.size = sizeof(v2) + 1; /* newer than the library */
  assert_int_equal(kvf__config_copy(&lib, sizeof lib, &caller, v1_size), KVF_EINVAL);
}

/* Every public growable struct of exactly its first published size (garbage
 * past it) is accepted by the calls that take it; one byte less is refused. */
static void config_first_version_accepted(void **state) {
  (void)state;
  union {
    kvf_engine_config c;
    unsigned char raw[sizeof(kvf_engine_config) + 64];
  } ec;
  FIRST_VERSION(kvf_engine_config, kvf_engine_config_init, KVF_ENGINE_CONFIG_SIZE_V1, ec);
  assert_true(KVF_ENGINE_CONFIG_SIZE_V1 <= sizeof(kvf_engine_config));
  assert_int_equal(kvf_engine_config_set(&ec.c, "timeout_ms", "4321"), 0);
  assert_int_equal(kvf_engine_config_set(&ec.c, "transport", "tcp"), 0);
  kvf_engine *e = NULL;
  assert_int_equal(kvf_engine_create(&ec.c, &e), 0);
  assert_non_null(e);
  assert_string_equal(kvf_engine_transport(e), "tcp");

  /* a batch's options of the first size: a write to this engine itself lands */
  union {
    kvf_batch_opts c;
    unsigned char raw[sizeof(kvf_batch_opts) + 64];
  } bo;
  FIRST_VERSION(kvf_batch_opts, kvf_batch_opts_init, KVF_BATCH_OPTS_SIZE_V1, bo);
  static uint8_t src[256], dst[256];
  memset(src, 0x5C, sizeof src);
  memset(dst, 0, sizeof dst);
  assert_int_equal(kvf_engine_register(e, src, sizeof src), 0);
  assert_int_equal(kvf_engine_register(e, dst, sizeof dst), 0);
  kvf_write w = {.src = (uint64_t)(uintptr_t)src, .dst = (uint64_t)(uintptr_t)dst, .len = sizeof src};
  uint64_t wakeups = kvf_wakeups();
  assert_int_equal(kvf_engine_write_ex(e, kvf_engine_session_id(e), &w, 1, &bo.c), 0);
  kvf_engine_sync(e);
  assert_memory_equal(src, dst, sizeof src);
  assert_true(kvf_wakeups() > wakeups); /* the target's reader woke with the chunk */
  bo.c.size = KVF_BATCH_OPTS_SIZE_V1 - 1;
  assert_int_equal(kvf_engine_write_ex(e, kvf_engine_session_id(e), &w, 1, &bo.c), KVF_EINVAL);

  /* a manager (decode) whose engine config is also of the first size */
  union {
    kvf_manager_config c;
    unsigned char raw[sizeof(kvf_manager_config) + 64];
  } mc;
  FIRST_VERSION(kvf_manager_config, kvf_manager_config_init, KVF_MANAGER_CONFIG_SIZE_V1, mc);
  assert_int_equal(kvf_manager_config_set(&mc.c, "role", "decode"), 0);
  assert_int_equal(kvf_manager_config_set(&mc.c, "heartbeat_interval_s", "30"), 0);
  assert_int_equal(kvf_manager_config_set_ptr(&mc.c, "engine_cfg", &ec.c), 0);
  static uint8_t kv[4096];
  void *ptrs[] = {kv};
  uint64_t lens[] = {sizeof kv}, items[] = {64};
  kvf_kv_buffers bufs = {.n_kv = 1, .kv_ptrs = ptrs, .kv_lens = lens, .kv_item_lens = items};
  kvf_manager *m = NULL;
  assert_int_equal(kvf_manager_create(&mc.c, &bufs, &m), 0);
  assert_string_equal(kvf_engine_transport(kvf_manager_engine(m)), "tcp");
  kvf_manager_destroy(m);
  m = NULL;
  mc.c.size = KVF_MANAGER_CONFIG_SIZE_V1 - 1;
  assert_int_equal(kvf_manager_create(&mc.c, &bufs, &m), KVF_EINVAL);
  assert_int_equal(kvf_manager_config_set(&mc.c, "role", "decode"), KVF_EINVAL);
  assert_int_equal(kvf_manager_config_set_ptr(&mc.c, "engine_cfg", &ec.c), KVF_EINVAL);
  assert_null(m);
  mc.c.size = KVF_MANAGER_CONFIG_SIZE_V1;
  ec.c.size = KVF_ENGINE_CONFIG_SIZE_V1 - 1; /* the manager's engine config too */
  assert_int_equal(kvf_manager_create(&mc.c, &bufs, &m), KVF_EINVAL);
  assert_null(m);

  kvf_engine *e2 = NULL;
  assert_int_equal(kvf_engine_create(&ec.c, &e2), KVF_EINVAL);
  assert_int_equal(kvf_engine_config_set(&ec.c, "timeout_ms", "1"), KVF_EINVAL);
  assert_null(e2);
  assert_int_equal(kvf_engine_unregister(e, src), 0);
  assert_int_equal(kvf_engine_unregister(e, dst), 0);
  kvf_engine_destroy(e);

  union {
    kvf_bootstrap_server_config c;
    unsigned char raw[sizeof(kvf_bootstrap_server_config) + 64];
  } bc;
  FIRST_VERSION(kvf_bootstrap_server_config, kvf_bootstrap_server_config_init, KVF_BOOTSTRAP_SERVER_CONFIG_SIZE_V1,
                bc);
  assert_int_equal(kvf_bootstrap_server_config_set(&bc.c, "host", "127.0.0.1"), 0);
  assert_int_equal(kvf_bootstrap_server_config_set(&bc.c, "port", "0"), 0);
  kvf_bootstrap_server *srv = NULL;
  assert_int_equal(kvf_bootstrap_server_create(&bc.c, &srv), 0);
  assert_true(kvf_bootstrap_server_port(srv) != 0);
  kvf_bootstrap_server_destroy(srv);
  srv = NULL;
  bc.c.size = KVF_BOOTSTRAP_SERVER_CONFIG_SIZE_V1 - 1;
  assert_int_equal(kvf_bootstrap_server_create(&bc.c, &srv), KVF_EINVAL);
  assert_null(srv);
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
      cmocka_unit_test(config_copy_takes_first_version),
      cmocka_unit_test(config_first_version_accepted),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

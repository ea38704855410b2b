/* The one host:port parser and formatter (src/base/addr.c): accepted and
 * refused forms, the reasons, the length bound, and format/parse round
 * trips. The engine, bootstrap, kv and wire layers all use these, so these
 * rules are the rules of every address the library takes. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <cmocka.h>

#include "base/addr.h"
#include "bootstrap/bootstrap.h"
#include "kv/plan.h"
#include "kvferry.h"

static int parse(const char *s, char *host, uint16_t *port) {
  return kvf__addr_parse(s, strlen(s), host, KVF_ADDR_HOST_MAX + 1, port, NULL);
}

static void accepted(void **state) {
  (void)state;
  static const struct {
    const char *in, *host;
    unsigned port;
  } ok[] = {
      {"127.0.0.1:8998", "127.0.0.1", 8998}, {"prefill-0.svc_a:1", "prefill-0.svc_a", 1},
      {"[::1]:65535", "::1", 65535},         {"[fe80::1%eth0]:80", "fe80::1%eth0", 80},
      {"[::ffff:10.0.0.1]:5", "::ffff:10.0.0.1", 5},
  };
  for (size_t i = 0; i < sizeof ok / sizeof ok[0]; i++) {
    char host[KVF_ADDR_HOST_MAX + 1];
    uint16_t port = 0;
    assert_int_equal(parse(ok[i].in, host, &port), 0);
    assert_string_equal(host, ok[i].host);
    assert_int_equal(port, ok[i].port);
    /* format gives back the same text */
    char out[KVF_ADDR_MAX + 1];
    assert_int_equal(kvf__addr_format(out, sizeof out, host, port), 0);
    assert_string_equal(out, ok[i].in);
  }
  /* Only the first len bytes count (wire frames are not NUL-terminated). */
  uint16_t port = 0;
  assert_int_equal(kvf__addr_parse("h:12345678", 4, NULL, 0, &port, NULL), 0);
  assert_int_equal(port, 12);
}

static void refused(void **state) {
  (void)state;
  static const struct {
    const char *in, *why;
  } bad[] = {
      {"", "is empty"},
      {"10.0.0.2", "is not \"host:port\""},
      {":80", "has an empty host"},
      {"::1:80", "has a bare IPv6 host (write it in brackets: \"[::1]:port\")"},
      {"fe80::1:80", "has a bare IPv6 host (write it in brackets: \"[::1]:port\")"},
      {"[::1:80", "has an unclosed '[' in the host"},
      {"[]:80", "has an unclosed '[' in the host"},
      {"[10.0.0.1]:80", "has brackets around a host that is not IPv6"},
      {"a b:80", "has a bad character in the host"},
      {"a/b:80", "has a bad character in the host"},
      {"user@h:80", "has a bad character in the host"},
      {"h:", "has a port that is not an integer in 1..65535"},
      {"h:0", "has a port that is not an integer in 1..65535"},
      {"h:080", "has a port that is not an integer in 1..65535"},
      {"h:65536", "has a port that is not an integer in 1..65535"},
      {"h:-1", "has a port that is not an integer in 1..65535"},
      {"h:80x", "has a port that is not an integer in 1..65535"},
      {"h:123456", "has a port that is not an integer in 1..65535"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    const char *why = NULL;
    uint16_t port = 7;
    assert_int_equal(kvf__addr_parse(bad[i].in, strlen(bad[i].in), NULL, 0, &port, &why), KVF_EINVAL);
    assert_non_null(why);
    assert_string_equal(why, bad[i].why);
    assert_int_equal(port, 7); /* untouched on failure */
  }
}

static void length_bound(void **state) {
  (void)state;
  char s[KVF_ADDR_MAX + 16], host[KVF_ADDR_HOST_MAX + 1];
  memset(s, 'a', KVF_ADDR_HOST_MAX);
  snprintf(s + KVF_ADDR_HOST_MAX, sizeof s - KVF_ADDR_HOST_MAX, ":65535");
  uint16_t port;
  assert_int_equal(parse(s, host, &port), 0); /* the longest host fits */
  assert_int_equal(strlen(host), KVF_ADDR_HOST_MAX);
  memset(s, 'a', KVF_ADDR_HOST_MAX + 1);
  snprintf(s + KVF_ADDR_HOST_MAX + 1, sizeof s - KVF_ADDR_HOST_MAX - 1, ":1");
  assert_int_equal(parse(s, host, &port), KVF_EINVAL);
  /* a host buffer that is too small refuses rather than truncating */
  char small[4];
  assert_int_equal(kvf__addr_parse("abcd:1", 6, small, sizeof small, &port, NULL), KVF_EINVAL);
  char out[8];
  assert_int_equal(kvf__addr_format(out, sizeof out, "abcdefgh", 1), KVF_EINVAL);
  assert_string_equal(out, "");
  assert_int_equal(kvf__addr_format(out, sizeof out, "", 1), KVF_EINVAL);
}

/* The layers that take addresses agree with the parser: IPv6 in brackets
 * everywhere, bare IPv6 nowhere. */
static void layers_agree(void **state) {
  (void)state;
  int port = 0;
  assert_int_equal(plan_session_port("[::1]:8080", &port), 0);
  assert_int_equal(port, 8080);
  assert_int_equal(plan_session_port("::1:8080", &port), KVF_EINVAL);
  bootstrap_client *c = NULL;
  assert_int_equal(bootstrap_client_create("[::1]:8998", NULL, &c), 0);
  bootstrap_client_destroy(c);
  assert_int_equal(bootstrap_client_create("::1:8998", NULL, &c), KVF_EINVAL);
  assert_int_equal(bootstrap_client_create("h:80/path", NULL, &c), KVF_EINVAL);
  kvf_engine *e = NULL;
  assert_int_equal(kvf_engine_create(NULL, &e), 0);
  static const kvf_write w = {0};
  assert_int_equal(kvf_engine_write(e, "::1:8080", &w, 1), KVF_EINVAL);
  kvf_engine_destroy(e);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(accepted),
      cmocka_unit_test(refused),
      cmocka_unit_test(length_bound),
      cmocka_unit_test(layers_agree),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

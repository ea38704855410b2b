/* The one host:port parser and formatter (src/base/addr.c): accepted and
 * refused forms, the reasons, the length bound (the longest address), socket
 * peer names (IPv6 in brackets), the host a string names, and format/parse
 * round trips. The engine, bootstrap, kv and wire layers all use these, so these
 * rules are the rules of every address the library takes. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <cmocka.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>

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
      {"127.0.0.1:8998", "127.0.0.1", 8998},
      {"prefill-0.svc_a:1", "prefill-0.svc_a", 1},
      {"[::1]:65535", "::1", 65535},
      {"[fe80::1%eth0]:80", "fe80::1%eth0", 80},
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

/* The longest address the parser takes is KVF_ADDR_MAX bytes: a bracketed
 * IPv6 host of KVF_ADDR_HOST_MAX bytes and a five-digit port; it formats
 * back the same into a buffer of KVF_ADDR_LEN and not into a smaller one. */
static void longest_address(void **state) {
  (void)state;
  char s[KVF_ADDR_MAX + 2], host[KVF_ADDR_HOST_LEN];
  s[0] = '[';
  memcpy(s + 1, "fe80::1%", 8);
  memset(s + 9, 'z', KVF_ADDR_HOST_MAX - 8);
  memcpy(s + 1 + KVF_ADDR_HOST_MAX, "]:65535", 8);
  assert_int_equal(strlen(s), KVF_ADDR_MAX);
  uint16_t port = 0;
  assert_int_equal(parse(s, host, &port), 0);
  assert_int_equal(strlen(host), KVF_ADDR_HOST_MAX);
  assert_int_equal(port, 65535);
  char out[KVF_ADDR_LEN];
  assert_int_equal(kvf__addr_format(out, sizeof out, host, port), 0);
  assert_string_equal(out, s);
  assert_int_equal(kvf__addr_format(out, sizeof out - 1, host, port), KVF_EINVAL);
  assert_string_equal(kvf__addr_str(host, port).s, s);
  /* one byte more in the host, or in the whole address, is refused */
  memcpy(s + 1 + KVF_ADDR_HOST_MAX, "]:655350", 9);
  assert_int_equal(kvf__addr_parse(s, strlen(s), NULL, 0, NULL, NULL), KVF_EINVAL);
  assert_string_equal(kvf__addr_str("", 80).s, "?");
}

/* Peer names of sockets: IPv4 as "ip:port", IPv6 always in brackets (a
 * link-local one with its zone), and they parse back to the same host and
 * port. Other families are refused with "?". */
static void socket_peer_names(void **state) {
  (void)state;
  char out[KVF_ADDR_LEN], host[KVF_ADDR_HOST_LEN];
  uint16_t port = 0;
  struct sockaddr_in a4 = {.sin_family = AF_INET, .sin_port = htons(5000)};
  inet_pton(AF_INET, "10.1.2.3", &a4.sin_addr);
  assert_int_equal(kvf__addr_from_sockaddr(out, sizeof out, (struct sockaddr *)&a4), 0);
  assert_string_equal(out, "10.1.2.3:5000");
  struct sockaddr_in6 a6 = {.sin6_family = AF_INET6, .sin6_port = htons(65535)};
  inet_pton(AF_INET6, "::1", &a6.sin6_addr);
  assert_int_equal(kvf__addr_from_sockaddr(out, sizeof out, (struct sockaddr *)&a6), 0);
  assert_string_equal(out, "[::1]:65535");
  assert_int_equal(parse(out, host, &port), 0);
  assert_string_equal(host, "::1");
  assert_int_equal(port, 65535);
  inet_pton(AF_INET6, "::ffff:10.0.0.1", &a6.sin6_addr);
  assert_int_equal(kvf__addr_from_sockaddr(out, sizeof out, (struct sockaddr *)&a6), 0);
  assert_string_equal(out, "[::ffff:10.0.0.1]:65535");
  inet_pton(AF_INET6, "fe80::1", &a6.sin6_addr);
  a6.sin6_scope_id = 1; /* lo */
  assert_int_equal(kvf__addr_from_sockaddr(out, sizeof out, (struct sockaddr *)&a6), 0);
  assert_int_equal(strncmp(out, "[fe80::1%", 9), 0);
  assert_int_equal(parse(out, host, &port), 0);
  struct sockaddr un = {.sa_family = AF_UNIX};
  assert_int_equal(kvf__addr_from_sockaddr(out, sizeof out, &un), KVF_EINVAL);
  assert_string_equal(out, "?");
  assert_int_equal(kvf__addr_from_sockaddr(out, 8, (struct sockaddr *)&a4), KVF_EINVAL); /* does not fit */
  assert_string_equal(out, "?");
}

/* The host a string names: that of an address, else the whole string (a
 * bare IP literal or host name, as libzmq's Peer-Address or an M1
 * endpoint); a bare IPv6 literal keeps its colons. */
static void host_of(void **state) {
  (void)state;
  static const struct {
    const char *in, *host;
  } cases[] = {
      {"10.0.0.1:80", "10.0.0.1"},  {"[::1]:80", "::1"},      {"[fe80::1%eth0]:9", "fe80::1%eth0"}, {"::1", "::1"},
      {"fe80::1:80", "fe80::1:80"}, {"10.0.0.1", "10.0.0.1"}, {"prefill-0:8998", "prefill-0"},      {"", ""},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char out[KVF_ADDR_HOST_LEN];
    assert_int_equal(kvf__addr_host(cases[i].in, out, sizeof out), 0);
    assert_string_equal(out, cases[i].host);
  }
  char small[4];
  assert_int_equal(kvf__addr_host("abcdef", small, sizeof small), KVF_EINVAL);
  assert_string_equal(small, "");
  /* the rank_ip rule of bootstrap registrations: the host characters, no brackets */
  assert_true(kvf__addr_host_valid("fe80::1%eth0", 12));
  assert_true(kvf__addr_host_valid("prefill-0.svc", 13));
  assert_false(kvf__addr_host_valid("[::1]", 5));
  assert_false(kvf__addr_host_valid("a b", 3));
  assert_false(kvf__addr_host_valid("", 0));
  char big[KVF_ADDR_HOST_MAX + 1];
  memset(big, 'a', sizeof big);
  assert_true(kvf__addr_host_valid(big, KVF_ADDR_HOST_MAX));
  assert_false(kvf__addr_host_valid(big, KVF_ADDR_HOST_MAX + 1));
}

/* The layers that take addresses agree with the parser: IPv6 in brackets
 * everywhere, bare IPv6 nowhere. */
static void layers_agree(void **state) {
  (void)state;
  int port = 0;
  assert_int_equal(kvf__plan_session_port("[::1]:8080", &port), 0);
  assert_int_equal(port, 8080);
  assert_int_equal(kvf__plan_session_port("::1:8080", &port), KVF_EINVAL);
  bootstrap_client *c = NULL;
  assert_int_equal(kvf__bootstrap_client_create("[::1]:8998", NULL, &c), 0);
  kvf__bootstrap_client_destroy(c);
  assert_int_equal(kvf__bootstrap_client_create("::1:8998", NULL, &c), KVF_EINVAL);
  assert_int_equal(kvf__bootstrap_client_create("h:80/path", NULL, &c), KVF_EINVAL);
  kvf_engine *e = NULL;
  assert_int_equal(kvf_engine_create(NULL, &e), 0);
  static const kvf_write w = {0};
  assert_int_equal(kvf_engine_write(e, "::1:8080", &w, 1), KVF_EINVAL);
  kvf_engine_destroy(e);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(accepted),        cmocka_unit_test(refused),           cmocka_unit_test(length_bound),
      cmocka_unit_test(longest_address), cmocka_unit_test(socket_peer_names), cmocka_unit_test(host_of),
      cmocka_unit_test(layers_agree),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

/* The one "host:port" parser and formatter (rules in addr.h). */
#include "base/addr.h"

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>

static int fail(const char **why, const char *text) {
  if (why) *why = text;
  return KVF_EINVAL;
}

static int name_char(char c) {
  return (c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9') || c == '.' || c == '_' ||
         c == '-';
}

static int host_char(char c) { return name_char(c) || c == ':' || c == '%'; }

int kvf__addr_host_valid(const char *h, size_t len) {
  if (!h || len == 0 || len > KVF_ADDR_HOST_MAX) return 0;
  for (size_t i = 0; i < len; i++)
    if (!host_char(h[i])) return 0;
  return 1;
}

int kvf__addr_parse(const char *s, size_t len, char *host, size_t host_cap, uint16_t *port, const char **why) {
  if (!s || len == 0) return fail(why, "is empty");
  if (len > KVF_ADDR_MAX) return fail(why, "is too long");
  size_t colon = len;
  while (colon > 0 && s[colon - 1] != ':') colon--;
  if (colon == 0) return fail(why, "is not \"host:port\"");
  const char *h = s;
  size_t hlen = colon - 1;
  if (hlen > 0 && h[0] == '[') {
    if (hlen < 3 || h[hlen - 1] != ']') return fail(why, "has an unclosed '[' in the host");
    h++, hlen -= 2;
    if (!memchr(h, ':', hlen)) return fail(why, "has brackets around a host that is not IPv6");
    for (size_t i = 0; i < hlen; i++)
      if (!host_char(h[i])) return fail(why, "has a bad character in the host");
  } else {
    if (hlen == 0) return fail(why, "has an empty host");
    for (size_t i = 0; i < hlen; i++) {
      if (h[i] == ':') return fail(why, "has a bare IPv6 host (write it in brackets: \"[::1]:port\")");
      if (!name_char(h[i])) return fail(why, "has a bad character in the host");
    }
  }
  if (hlen > KVF_ADDR_HOST_MAX) return fail(why, "has a host that is too long");
  const char *p = s + colon;
  size_t plen = len - colon;
  if (plen == 0 || plen > 5 || p[0] == '0') return fail(why, "has a port that is not an integer in 1..65535");
  unsigned v = 0;
  for (size_t i = 0; i < plen; i++) {
    if (p[i] < '0' || p[i] > '9') return fail(why, "has a port that is not an integer in 1..65535");
    v = v * 10 + (unsigned)(p[i] - '0');
  }
  if (v > 65535) return fail(why, "has a port that is not an integer in 1..65535");
  if (host) {
    if (hlen >= host_cap) return fail(why, "has a host that is too long");
    memcpy(host, h, hlen);
    host[hlen] = '\0';
  }
  if (port) *port = (uint16_t)v;
  return 0;
}

int kvf__addr_is_ipv6(const char *host) { return host && strchr(host, ':') != NULL; }

int kvf__addr_format(char *out, size_t cap, const char *host, uint16_t port) {
  if (!out || cap == 0) return KVF_EINVAL;
  out[0] = '\0';
  if (!host || !*host) return KVF_EINVAL;
  int n = snprintf(out, cap, kvf__addr_is_ipv6(host) ? "[%s]:%u" : "%s:%u", host, (unsigned)port);
  if (n < 0 || (size_t)n >= cap) {
    out[0] = '\0';
    return KVF_EINVAL;
  }
  return 0;
}

kvf__addr_text kvf__addr_str(const char *host, uint16_t port) {
  kvf__addr_text t;
  if (kvf__addr_format(t.s, sizeof t.s, host, port)) snprintf(t.s, sizeof t.s, "?");
  return t;
}

int kvf__addr_from_sockaddr(char *out, size_t cap, const struct sockaddr *sa) {
  char host[KVF_ADDR_HOST_LEN];
  int rc = KVF_EINVAL;
  if (sa && (sa->sa_family == AF_INET || sa->sa_family == AF_INET6)) {
    int v6 = sa->sa_family == AF_INET6;
    socklen_t len = v6 ? sizeof(struct sockaddr_in6) : sizeof(struct sockaddr_in);
    uint16_t port =
        ntohs(v6 ? ((const struct sockaddr_in6 *)sa)->sin6_port : ((const struct sockaddr_in *)sa)->sin_port);
    if (!getnameinfo(sa, len, host, sizeof host, NULL, 0, NI_NUMERICHOST))
      rc = kvf__addr_format(out, cap, host, port);
  }
  if (rc && out && cap) snprintf(out, cap, "?");
  return rc;
}

int kvf__addr_host(const char *s, char *out, size_t cap) {
  if (!out || cap == 0) return KVF_EINVAL;
  out[0] = '\0';
  if (!s) return KVF_EINVAL;
  size_t len = strlen(s);
  if (!kvf__addr_parse(s, len, out, cap, NULL, NULL)) return 0;
  if (len >= cap) return KVF_EINVAL;
  memcpy(out, s, len + 1);
  return 0;
}

/* "host:port" addresses: the one parser and the one formatter every layer
 * uses (engine session ids, peer names, bootstrap addresses, M1/M2 session
 * and endpoint checks, ZMQ endpoints, rank IPs). Rules, the same everywhere:
 * - host: 1..KVF_ADDR_HOST_MAX bytes; a name or IPv4 literal of
 *   [A-Za-z0-9._-], or an IPv6 literal in brackets, "[::1]:80", of
 *   [A-Za-z0-9.:%_-] (a zone id like "%eth0" allowed); a bare IPv6
 *   ("::1:80") is refused as ambiguous;
 * - port: canonical decimal 1..65535 (no sign, no leading zero);
 * - nothing before or after (no scheme, path, spaces).
 * Every address the library writes is formatted here, so IPv6 is always in
 * brackets. The limits (KVF_ADDR_HOST_MAX, KVF_ADDR_MAX) are public
 * (kvferry/common.h): a buffer of KVF_ADDR_LEN holds any address, one of
 * KVF_ADDR_HOST_LEN any host. Pure functions, any thread. */
#ifndef KVF_BASE_ADDR_H
#define KVF_BASE_ADDR_H

#include <stddef.h>
#include <stdint.h>

#include "kvferry/common.h"

#define KVF_ADDR_LEN (KVF_ADDR_MAX + 1)           /* an address buffer, NUL included */
#define KVF_ADDR_HOST_LEN (KVF_ADDR_HOST_MAX + 1) /* a host buffer, NUL included */

struct sockaddr;

/* Parse the `len` bytes at `s` (need not be NUL-terminated). On success
 * returns 0 and, where the pointers are not NULL, copies the host (without
 * brackets, NUL-terminated; KVF_EINVAL if it does not fit host_cap) and sets
 * *port. On failure returns KVF_EINVAL and, if `why` is not NULL, points it
 * at a static phrase saying what is wrong ("has an empty host", ...). */
int kvf__addr_parse(const char *s, size_t len, char *host, size_t host_cap, uint16_t *port, const char **why);

/* Write "host:port", or "[host]:port" when host is an IPv6 literal (contains
 * ':'), into out. 0, or KVF_EINVAL when host is empty/NULL or it does not
 * fit in cap (out is then an empty string). */
int kvf__addr_format(char *out, size_t cap, const char *host, uint16_t port);

/* An address as text, for log lines and failure reasons:
 *   LOG_WARN("...%s", kvf__addr_str(ip, port).s)
 * (the array lives until the end of the full expression). "?" when host is
 * empty or too long. */
typedef struct kvf__addr_text {
  char s[KVF_ADDR_LEN];
} kvf__addr_text;
kvf__addr_text kvf__addr_str(const char *host, uint16_t port);

/* The numeric address of a socket peer or name (AF_INET or AF_INET6), as
 * kvf__addr_format writes it: "10.0.0.1:5000", "[::1]:5000". 0, or
 * KVF_EINVAL (another family, or it does not fit; out is then "?"). */
int kvf__addr_from_sockaddr(char *out, size_t cap, const struct sockaddr *sa);

/* The host that `s` names, without brackets: the host of an address
 * kvf__addr_parse accepts, otherwise all of `s` (a bare host or IP
 * literal, whose colons are not a port). 0, or KVF_EINVAL when it does not
 * fit in cap (out is then an empty string). */
int kvf__addr_host(const char *s, char *out, size_t cap);

/* 1 when the `len` bytes at h are a host as a peer names itself in a
 * bootstrap registration (rank_ip): 1..KVF_ADDR_HOST_MAX bytes of
 * [A-Za-z0-9.:%_-], without brackets. */
int kvf__addr_host_valid(const char *h, size_t len);

/* 1 when host is an IPv6 literal (needs brackets in an address or URL). */
int kvf__addr_is_ipv6(const char *host);

#endif

/* "host:port" addresses: the one parser and the one formatter every layer
 * uses (engine session ids, bootstrap addresses, M1/M2 session and endpoint
 * checks, ZMQ endpoints). Rules, the same everywhere:
 * - host: 1..KVF_ADDR_HOST_MAX bytes; a name or IPv4 literal of
 *   [A-Za-z0-9._-], or an IPv6 literal in brackets, "[::1]:80", of
 *   [A-Za-z0-9.:%_-] (a zone id like "%eth0" allowed); a bare IPv6
 *   ("::1:80") is refused as ambiguous;
 * - port: canonical decimal 1..65535 (no sign, no leading zero);
 * - nothing before or after (no scheme, path, spaces).
 * Pure functions, any thread. */
#ifndef KVF_BASE_ADDR_H
#define KVF_BASE_ADDR_H

#include <stddef.h>
#include <stdint.h>

#define KVF_ADDR_HOST_MAX 255                 /* bytes of a host, without brackets */
#define KVF_ADDR_MAX (KVF_ADDR_HOST_MAX + 8)  /* "[" host "]:65535" */

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

/* 1 when host is an IPv6 literal (needs brackets in an address or URL). */
int kvf__addr_is_ipv6(const char *host);

#endif

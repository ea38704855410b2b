/* Logging for the whole library: levelled messages to stderr with a
 * component tag, and a "log once per key" helper so that a peer sending bad
 * input is reported once, not once per message. */
#ifndef KVF_BASE_LOG_H
#define KVF_BASE_LOG_H

#include <stdint.h>
#include "kvferry/common.h"

int kvf__log_level(void);
void kvf__log_write(int level, const char *component, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

#define KVF_LOG(level, comp, ...)                                                  \
  do {                                                                             \
    if ((level) <= kvf__log_level()) kvf__log_write((level), (comp), __VA_ARGS__); \
  } while (0)
#define LOG_ERROR(comp, ...) KVF_LOG(KVF_LOG_ERROR, comp, __VA_ARGS__)
#define LOG_WARN(comp, ...) KVF_LOG(KVF_LOG_WARN, comp, __VA_ARGS__)
#define LOG_INFO(comp, ...) KVF_LOG(KVF_LOG_INFO, comp, __VA_ARGS__)
#define LOG_DEBUG(comp, ...) KVF_LOG(KVF_LOG_DEBUG, comp, __VA_ARGS__)

/* Returns 1 the first time `key` (e.g. kvf__hash_str of a peer address and
 * an error kind, base/hash.h) is seen, 0 afterwards; a small fixed table, so very many distinct
 * keys may log again after eviction. Thread-safe. */
int kvf__log_first_time(uint64_t key);

/* kvf__log_first_time keyed by the host part of `peer` ("ip:port",
 * "[ipv6]:port" or a bare host) and `kind`: a peer that misbehaves on many
 * connections (each from a new port) is still reported once per kind. */
int kvf__log_first_time_for_host(const char *peer, const char *kind);

#endif

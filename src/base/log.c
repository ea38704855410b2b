/* Levelled logging to stderr. The level comes from KVFERRY_LOG_LEVEL once,
 * then kvf_set_log_level may change it at any time. */
#include "base/log.h"
#include "base/addr.h"
#include "base/hash.h"

#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <time.h>

static atomic_int g_level = -1;

static int level_from_env(void) {
  const char *v = getenv("KVFERRY_LOG_LEVEL");
  if (!v || !*v) return KVF_LOG_WARN;
  if (!strcasecmp(v, "error")) return KVF_LOG_ERROR;
  if (!strcasecmp(v, "warn") || !strcasecmp(v, "warning")) return KVF_LOG_WARN;
  if (!strcasecmp(v, "info")) return KVF_LOG_INFO;
  if (!strcasecmp(v, "debug")) return KVF_LOG_DEBUG;
  return KVF_LOG_WARN;
}

int kvf__log_level(void) {
  int l = atomic_load_explicit(&g_level, memory_order_relaxed);
  if (l < 0) {
    l = level_from_env();
    atomic_store(&g_level, l);
  }
  return l;
}

void kvf_set_log_level(int level) {
  if (level < KVF_LOG_ERROR) level = KVF_LOG_ERROR;
  if (level > KVF_LOG_DEBUG) level = KVF_LOG_DEBUG;
  atomic_store(&g_level, level);
}

void kvf__log_write(int level, const char *component, const char *fmt, ...) {
  static const char *names[] = {"ERROR", "WARN", "INFO", "DEBUG"};
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  struct tm tm;
  gmtime_r(&ts.tv_sec, &tm);
  /* One fprintf per line keeps lines from different threads whole. */
  fprintf(stderr, "%02d:%02d:%02d.%03ld kvferry %s [%s] %s\n", tm.tm_hour, tm.tm_min, tm.tm_sec,
          ts.tv_nsec / 1000000, names[level & 3], component, msg);
}

#define ONCE_SLOTS 256
static uint64_t g_once[ONCE_SLOTS];
static pthread_mutex_t g_once_lock = PTHREAD_MUTEX_INITIALIZER;

int kvf__log_first_time(uint64_t key) {
  if (key == 0) key = 1;
  unsigned slot = (unsigned)(key % ONCE_SLOTS);
  pthread_mutex_lock(&g_once_lock);
  int first = g_once[slot] != key;
  g_once[slot] = key;
  pthread_mutex_unlock(&g_once_lock);
  return first;
}

int kvf__log_first_time_for_host(const char *peer, const char *kind) {
  char host[KVF_ADDR_HOST_LEN], key[KVF_ADDR_HOST_LEN + 64];
  if (kvf__addr_host(peer ? peer : "", host, sizeof host)) snprintf(host, sizeof host, "%.*s", 255, peer);
  snprintf(key, sizeof key, "%s/%.63s", host, kind ? kind : "");
  return kvf__log_first_time(kvf__hash_str(key, 0x5eedULL));
}

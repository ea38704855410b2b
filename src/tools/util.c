/* Small helpers shared by kvferry, the test peer and the tests (see util.h). */
#include <ctype.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "util.h"
#include "kvferry.h"

int cli_set_transport(const char *cmd, const char *name) {
  if (strcmp(name, "tcp") && strcmp(name, "ucx") && strcmp(name, "auto")) {
    fprintf(stderr, "%s: --transport must be tcp, ucx or auto (not '%s')\n", cmd, name);
    return -1;
  }
  if (!strcmp(name, "ucx") && !strstr(kvf_engine_transports(), "ucx")) {
    fprintf(stderr, "%s: transport 'ucx' is not available; this build has: %s\n", cmd, kvf_engine_transports());
    return -1;
  }
  return setenv("KVFERRY_TRANSPORT", name, 1) ? -1 : 0;
}

/* "4096", "32K", "1M", "2G" (powers of 1024). */
int cli_parse_size(const char *s, unsigned long long *out) {
  char *end = NULL;
  if (!s || !isdigit((unsigned char)*s)) return -1;
  unsigned long long v = strtoull(s, &end, 10);
  switch (toupper((unsigned char)*end)) {
    case 'K':
      v <<= 10;
      end++;
      break;
    case 'M':
      v <<= 20;
      end++;
      break;
    case 'G':
      v <<= 30;
      end++;
      break;
    default: break;
  }
  if (*end == 'i' || *end == 'B') end++;
  if (*end == 'B') end++;
  if (*end) return -1;
  *out = v;
  return 0;
}

int cli_is_tty(void) { return isatty(STDOUT_FILENO) || isatty(STDERR_FILENO); }

double cli_now_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec + ts.tv_nsec / 1e9;
}

long long cli_now_ms(void) { return cli_now_ns() / 1000000; }

long long cli_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

uint64_t cli_rng_next(uint64_t *s) {
  *s ^= *s << 13;
  *s ^= *s >> 7;
  *s ^= *s << 17;
  return *s;
}

void cli_print_stats(kvf_manager **m, int n) {
  unsigned long long live = 0, rx = 0, bad = 0, unknown = 0;
  for (int i = 0; i < n; i++) {
    kvf_manager_stats st;
    kvf_manager_get_stats(m[i], &st);
    live += st.live_rooms;
    rx += st.messages_received;
    bad += st.messages_malformed;
    unknown += st.messages_unknown_room;
  }
  printf("stats %llu %llu %llu %llu\n", live, rx, bad, unknown);
  fflush(stdout);
}

const char *cli_memory_kind(void) {
  const char *m = getenv("KVFERRY_CLI_MEMORY");
  /* every transport: UCX maps such pools, TCP copies through their huge pages */
  return m && !strcmp(m, "plain") ? "plain" : "pool";
}

int cli_rank_engine(const char *host, kvf_engine **out, int *pool) {
  kvf_engine_config c;
  kvf_engine_config_init(&c);
  if (host) c.host = host;
  int rc = kvf_engine_create(&c, out);
  if (!rc) *pool = !strcmp(cli_memory_kind(), "pool");
  return rc;
}

int cli_ucx_route(void) {
  const char *tr = getenv("KVFERRY_TRANSPORT") ? getenv("KVFERRY_TRANSPORT") : "auto";
  return !strcmp(tr, "ucx") || (!strcmp(tr, "auto") && strstr(kvf_engine_transports(), "ucx"));
}

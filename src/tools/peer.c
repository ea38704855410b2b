/* Engine peer child processes (see peer.h). */
#include "peer.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int engine_peer_start(engine_peer *ep, uint64_t bytes, const char *token) {
  return engine_peer_start_args(ep, bytes, token, NULL);
}

int engine_peer_start_args(engine_peer *ep, uint64_t bytes, const char *token, const char *const *extra) {
  char sz[32];
  snprintf(sz, sizeof sz, "%llu", (unsigned long long)bytes);
  const char *exe = proc_testpeer_exe();
  char *argv[16] = {(char *)exe, "engine-peer", "--bytes", sz};
  int n = 4;
  if (token) {
    argv[n++] = "--token";
    argv[n++] = (char *)token;
  }
  for (; extra && *extra && n < 15; extra++) argv[n++] = (char *)*extra;
  memset(ep, 0, sizeof *ep);
  if (proc_start(&ep->p, argv)) {
    fprintf(stderr, "kvferry: cannot start engine peer\n");
    return -1;
  }
  char line[512];
  unsigned long long base = 0, len = 0;
  if (proc_read_line(&ep->p, line, sizeof line, 10000) ||
      sscanf(line, "ready " CLI_ADDR_SCAN " %llx %llu", ep->session, &base, &len) != 3) {
    fprintf(stderr, "kvferry: engine peer did not start\n");
    proc_stop(&ep->p, 1000);
    return -1;
  }
  ep->base = base;
  ep->bytes = len;
  return 0;
}

void engine_peer_stop(engine_peer *ep) { proc_stop(&ep->p, 5000); }

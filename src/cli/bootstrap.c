/* `kvferry bootstrap`: runs a bootstrap rendezvous server in the foreground
 * until SIGINT or SIGTERM. It prints one line with the address it listens on
 * (flushed at once) so scripts and tests that pass --port 0 can read the
 * chosen port. Uses only the public API. */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cli.h"
#include "kvferry.h"

static void usage(FILE *f) {
  fprintf(f, "usage: kvferry bootstrap [--port N] [--host H] [--token T] [--max-body BYTES]\n"
             "  --port N         port to listen on (default 8998; 0 = any free port)\n"
             "  --host H         address to bind (default 0.0.0.0)\n"
             "  --token T        bearer token PUT /route must carry (default $KVFERRY_BOOTSTRAP_TOKEN)\n"
             "  --max-body BYTES largest PUT body (default 64K)\n"
             "Prints 'kvferry bootstrap listening on HOST:PORT' once ready; stops on SIGINT/SIGTERM.\n");
}

int cli_bootstrap(int argc, char **argv) {
  kvf_bootstrap_server_config cfg;
  kvf_bootstrap_server_config_init(&cfg);
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    if (!strcmp(a, "--help") || !strcmp(a, "-h")) {
      usage(stdout);
      return 0;
    }
    if (i + 1 >= argc) {
      fprintf(stderr, "kvferry bootstrap: unknown option or missing value: %s\n", a);
      usage(stderr);
      return 2;
    }
    const char *v = argv[++i];
    if (!strcmp(a, "--port")) {
      char *end = NULL;
      errno = 0;
      long p = strtol(v, &end, 10);
      if (errno || !*v || *end || p < 0 || p > 65535) {
        fprintf(stderr, "kvferry bootstrap: bad port '%s'\n", v);
        return 2;
      }
      cfg.port = (uint16_t)p;
    } else if (!strcmp(a, "--host")) {
      cfg.host = v;
    } else if (!strcmp(a, "--token")) {
      cfg.auth_token = v;
    } else if (!strcmp(a, "--max-body")) {
      unsigned long long n;
      if (cli_parse_size(v, &n) || n == 0 || n > (1ULL << 30)) {
        fprintf(stderr, "kvferry bootstrap: bad size '%s'\n", v);
        return 2;
      }
      cfg.max_body = (size_t)n;
    } else {
      fprintf(stderr, "kvferry bootstrap: unknown option %s\n", a);
      usage(stderr);
      return 2;
    }
  }

  /* Block the stop signals before the server's thread exists, so it inherits
   * the mask and sigwait below is the only place they are taken. */
  sigset_t stop;
  sigemptyset(&stop);
  sigaddset(&stop, SIGINT);
  sigaddset(&stop, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &stop, NULL);

  kvf_bootstrap_server *srv = NULL;
  int rc = kvf_bootstrap_server_create(&cfg, &srv);
  int v6 = strchr(cfg.host, ':') != NULL; /* IPv6 in brackets, as the library writes addresses */
  if (rc) {
    fprintf(stderr, "kvferry bootstrap: cannot start on %s%s%s:%u: %s\n", v6 ? "[" : "", cfg.host, v6 ? "]" : "",
            (unsigned)cfg.port, kvf_strerror(rc));
    return 1;
  }
  printf("kvferry bootstrap listening on %s%s%s:%u\n", v6 ? "[" : "", cfg.host, v6 ? "]" : "",
         (unsigned)kvf_bootstrap_server_port(srv));
  fflush(stdout);

  int sig = 0;
  while (sigwait(&stop, &sig) != 0) {
  }
  fprintf(stderr, "kvferry bootstrap: %s, stopping\n", sig == SIGINT ? "SIGINT" : "SIGTERM");
  kvf_bootstrap_server_destroy(srv);
  return 0;
}

/* `kvferry-testpeer engine-peer`: a transfer-engine target in its own process, for
 * the demo and the tests. It registers a buffer of pages, prints one line
 *   ready <session-id> <buffer-address-hex> <buffer-bytes>
 * and then answers commands on stdin, one per line:
 *   verify <seed> <page-size> <dst:label,...>  → "ok <n>" or "mismatch <dst>"
 *          (dst page must hold the pattern of `label`)
 *   untouched <byte>                           → "ok" if every byte equals it
 *   fill <byte>                                → "ok" after memset
 *   stats                                      → "stats <received> <refused> <auth_refused>"
 *   errors                                     → "errors <protocol_errors> <conns_refused>"
 *   reads                                      → "reads <received> <reads_late> <reads_refused> <bytes_read_direct>"
 *   quit
 * It exits on EOF of stdin, so a test that dies takes its peer with it. */
#include <getopt.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>

#include "testing/testpeer/testpeer.h"
#include "kvferry.h"
#include "tools/pattern.h"

static int verify(unsigned char *buf, size_t len, char *args) {
  unsigned long long seed = 0, page_size = 0;
  int used = 0;
  if (sscanf(args, "%llu %llu %n", &seed, &page_size, &used) < 2 || !page_size) return -1;
  size_t n = 0;
  for (char *tok = strtok(args + used, ","); tok; tok = strtok(NULL, ",")) {
    unsigned long long dst, label;
    if (sscanf(tok, "%llu:%llu", &dst, &label) != 2) return -1;
    if ((dst + 1) * page_size > len || !pattern_check(buf + dst * page_size, page_size, seed, label)) {
      printf("mismatch %llu\n", dst);
      return 1;
    }
    n++;
  }
  printf("ok %zu\n", n);
  return 0;
}

int cli_engine_peer(int argc, char **argv) {
  unsigned long long bytes = 64ull << 20;
  const char *token = NULL, *host = "127.0.0.1", *transport = NULL;
  int use_pool = 0;
  static const struct option opts[] = {{"bytes", required_argument, 0, 'b'},
                                       {"token", required_argument, 0, 't'},
                                       {"host", required_argument, 0, 'H'},
                                       {"transport", required_argument, 0, 'T'},
                                       {"pool", no_argument, 0, 'P'},
                                       {"help", no_argument, 0, 'h'},
                                       {0, 0, 0, 0}};
  int c;
  while ((c = getopt_long(argc, argv, "b:t:H:T:Ph", opts, NULL)) != -1) {
    switch (c) {
      case 'b':
        if (cli_parse_size(optarg, &bytes) || !bytes) {
          fprintf(stderr, "engine-peer: bad --bytes '%s'\n", optarg);
          return 2;
        }
        break;
      case 't': token = optarg; break;
      case 'H': host = optarg; break;
      case 'T': transport = optarg; break;
      case 'P': use_pool = 1; break;
      case 'h':
        printf("usage: kvferry-testpeer engine-peer [--bytes 64M] [--token SECRET (default $KVFERRY_AUTH_TOKEN)] "
               "[--host "
               "127.0.0.1]\n"
               "                           [--transport tcp|ucx|auto] [--pool]\n"
               "  --pool  place the buffer in a pool the engine allocates (kvf_engine_alloc_pool)\n");
        return 0;
      default: return 2;
    }
  }
  kvf_engine_config cfg;
  kvf_engine_config_init(&cfg);
  cfg.host = host;
  cfg.auth_token = token; /* NULL: $KVFERRY_AUTH_TOKEN, as every engine */
  cfg.transport = transport;
  kvf_engine *e = NULL;
  unsigned char *buf = NULL;
  int rc = kvf_engine_create(&cfg, &e);
  if (!rc && use_pool) {
    void *p = NULL;
    rc = kvf_engine_alloc_pool(e, bytes, &p);
    buf = p;
  } else if (!rc) {
    buf = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    rc = buf == MAP_FAILED ? KVF_ENOMEM : kvf_engine_register(e, buf, bytes);
    if (buf == MAP_FAILED) buf = NULL;
  }
  if (rc) {
    fprintf(stderr, "engine-peer: %s\n", kvf_strerror(rc));
    kvf_engine_destroy(e);
    return 1;
  }
  /* Fault the pages in now, as a real KV pool is, so the first writes do not
   * pay for page faults. */
  memset(buf, 0, bytes);
  kvf_engine_sync(e);
  printf("ready %s %llx %llu\n", kvf_engine_session_id(e), (unsigned long long)(uintptr_t)buf, bytes);
  fflush(stdout);
  char *line = NULL;
  size_t cap = 0;
  while (getline(&line, &cap, stdin) > 0) {
    line[strcspn(line, "\n")] = 0;
    kvf_engine_sync(e); /* every command reads or writes the registered buffer */
    if (!strncmp(line, "verify ", 7)) {
      if (verify(buf, bytes, line + 7) < 0) printf("error bad verify command\n");
    } else if (!strncmp(line, "untouched ", 10)) {
      int v = atoi(line + 10);
      size_t i = 0;
      while (i < bytes && buf[i] == (unsigned char)v) i++;
      if (i == bytes) printf("ok\n");
      else printf("touched %zu\n", i);
    } else if (!strncmp(line, "fill ", 5)) {
      memset(buf, atoi(line + 5), bytes);
      kvf_engine_sync(e);
      printf("ok\n");
    } else if (!strcmp(line, "stats")) {
      kvf_engine_stats st;
      kvf_engine_get_stats(e, &st);
      printf("stats %llu %llu %llu\n", (unsigned long long)st.batches_received,
             (unsigned long long)st.batches_refused, (unsigned long long)st.auth_refused);
    } else if (!strcmp(line, "errors")) {
      kvf_engine_stats st;
      kvf_engine_get_stats(e, &st);
      printf("errors %llu %llu\n", (unsigned long long)st.protocol_errors, (unsigned long long)st.conns_refused);
    } else if (!strcmp(line, "reads")) {
      kvf_engine_stats st;
      kvf_engine_get_stats(e, &st);
      printf("reads %llu %llu %llu %llu\n", (unsigned long long)st.batches_received,
             (unsigned long long)st.reads_late, (unsigned long long)st.reads_refused,
             (unsigned long long)st.bytes_read_direct);
    } else if (!strcmp(line, "quit")) {
      break;
    } else {
      printf("error unknown command\n");
    }
    kvf_engine_sync(e); /* ... and before the answer lets a peer write there again */
    fflush(stdout);
  }
  free(line);
  if (use_pool) {
    kvf_engine_free_pool(e, buf);
  } else {
    kvf_engine_unregister(e, buf);
    munmap(buf, bytes);
  }
  kvf_engine_destroy(e);
  return 0;
}

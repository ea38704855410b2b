/* Entry point of kvferry-testpeer: the test fixtures, dispatched by
 * subcommand. Built in the build tree next to kvferry and never installed;
 * the tests, the fault suite, the demo and the benchmarks find it through
 * $KVFERRY_TESTPEER or next to the running kvferry (proc_testpeer_exe). */
#include <stdio.h>
#include <string.h>

#include "kvferry.h"
#include "testing/testpeer/testpeer.h"

struct command {
  const char *name;
  int (*run)(int argc, char **argv);
  const char *help;
};

static const struct command commands[] = {
    {"kv-peer", cli_kv_peer, "run a prefill instance (bootstrap server + ranks) driven over stdin"},
    {"kv-decode", cli_kv_decode, "run a decode instance (model-shaped pools) driven over stdin"},
    {"kv-idle", cli_kv_idle, "run many idle decode instances (TP 1 each) for bench peers"},
    {"engine-peer", cli_engine_peer, "run a transfer engine target with a registered buffer"},
};

static void usage(FILE *f) {
  fprintf(f, "usage: kvferry-testpeer <command> [options]   (test fixtures, not installed)\n\ncommands:\n");
  for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
    fprintf(f, "  %-12s %s\n", commands[i].name, commands[i].help);
}

int main(int argc, char **argv) {
  if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
    if (!strcmp(argv[1], commands[i].name)) return commands[i].run(argc - 1, argv + 1);
  fprintf(stderr, "kvferry-testpeer: unknown command '%s' (kvferry %s)\n", argv[1], kvf_version());
  usage(stderr);
  return 2;
}

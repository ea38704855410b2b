/* Entry point of the kvferry command: dispatches to a subcommand. */
#include <stdio.h>
#include <string.h>

#include "cli.h"
#include "kvferry.h"

struct command {
  const char *name;
  int (*run)(int argc, char **argv);
  const char *help;
};

static const struct command commands[] = {
    {"bootstrap", cli_bootstrap, "run the bootstrap HTTP rendezvous server (--port 8998)"},
    {"demo", cli_demo, "prefill and decode processes move model-shaped KV for N requests; every byte verified"},
    {"bench", cli_bench, "benchmarks with same-run baselines (engine, rooms, e2e; all by default); --json"},
    {"trace", cli_trace, "summarise a KVFERRY_TRACE file: steps p50/p99, failures, both sides; --json, --svg"},
};

static void usage(FILE *f) {
  fprintf(f, "usage: kvferry <command> [options]\n\ncommands:\n");
  for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
    fprintf(f, "  %-12s %s\n", commands[i].name, commands[i].help);
  fprintf(f, "\nkvferry %s; 'kvferry <command> --help' for a command's options\n", kvf_version());
}

int main(int argc, char **argv) {
  if (argc < 2 || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
    usage(argc < 2 ? stderr : stdout);
    return argc < 2 ? 2 : 0;
  }
  if (!strcmp(argv[1], "--version")) {
    printf("kvferry %s (transports: %s)\n", kvf_version(), kvf_engine_transports());
    return 0;
  }
  for (size_t i = 0; i < sizeof commands / sizeof commands[0]; i++)
    if (!strcmp(argv[1], commands[i].name)) return commands[i].run(argc - 1, argv + 1);
  fprintf(stderr, "kvferry: unknown command '%s'\n", argv[1]);
  usage(stderr);
  return 2;
}

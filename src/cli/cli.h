/* The kvferry command: one function per subcommand, each taking the
 * arguments after its name. Subcommands use only the public API. */
#ifndef KVF_CLI_H
#define KVF_CLI_H

#include <stdint.h>

#include "tools/util.h"

int cli_demo(int argc, char **argv);
int cli_bench(int argc, char **argv);
int cli_bootstrap(int argc, char **argv);
int cli_trace(int argc, char **argv);

/* Shared helpers: tools/util.h. */
#endif

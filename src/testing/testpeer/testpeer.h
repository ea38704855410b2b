/* The test peer (`kvferry-testpeer`, built in the build tree, never
 * installed): the fixtures the tests, the fault suite, the demo and the
 * benchmarks run as real processes, one function per subcommand, each taking
 * the arguments after its name. */
#ifndef KVF_TESTING_TESTPEER_H
#define KVF_TESTING_TESTPEER_H

#include "tools/util.h"

int cli_engine_peer(int argc, char **argv);
int cli_kv_peer(int argc, char **argv);
int cli_kv_decode(int argc, char **argv);
int cli_kv_idle(int argc, char **argv);

#endif

/* The kvferry command: one function per subcommand, each taking the
 * arguments after its name. Subcommands use only the public API. */
#ifndef KVF_CLI_H
#define KVF_CLI_H

#include <stdint.h>
#include <stdio.h>

#include "kvferry.h"
#include "tools/util.h"

int cli_demo(int argc, char **argv);
/* cluster.c: `kvferry demo --cluster PxD` (issue 24). */
int cli_demo_cluster(int argc, char **argv);
void cli_demo_cluster_usage(FILE *f);
int cli_bench(int argc, char **argv);
int cli_bootstrap(int argc, char **argv);
int cli_trace(int argc, char **argv);

/* breakdown.c: per-step p50/p99 of room traces (issue 25). */
/* Every record of a KVFERRY_TRACE file into *out (malloc'd, *n of them). 0 or -1. */
int cli_breakdown_read(const char *path, kvf_room_trace **out, size_t *n);
/* The breakdown of the records of `side` whose room ids are in [lo, hi)
 * (hi 0: any): a table (indent before each line) or a JSON array. */
void cli_breakdown_print(const kvf_room_trace *t, size_t n, int side, int64_t lo, int64_t hi, int json,
                         const char *indent);
/* A new empty file for KVFERRY_TRACE, its name in path. 0 or -1. */
int cli_breakdown_tmpfile(char *path, size_t cap);
/* Such a file, named in $KVFERRY_TRACE for the processes started next
 * (path "" on failure). 0 or -1. */
int cli_breakdown_env(char *path, size_t cap);
/* Unset $KVFERRY_TRACE, print both sides' breakdowns of the file's rooms
 * from id lo on (tables, or a ",\"breakdown\":{...}" JSON member), delete
 * it and clear path. Nothing when path is "". */
void cli_breakdown_file(char *path, int64_t lo, int json);

/* Shared helpers: tools/util.h. */
#endif

/* What the sub-benchmarks of `kvferry bench` share across files: the rooms
 * case (bench.c) that `bench peers` (bench_peers.c) reuses to measure the
 * room rate and latency beside many idle peers. */
#ifndef KVF_CLI_BENCH_H
#define KVF_CLI_BENCH_H

#include <stddef.h>
#include <stdio.h>
#include <stdint.h>

#include "kvferry.h"
#include "tools/kvpool.h"
#include "tools/proc.h"

/* Where a rooms case's CPU went: per room, by process side ("decode": the
 * bench process, its decode manager and its loop; "prefill": the kv-peer)
 * and thread name, largest first; "(ended threads)" holds what threads
 * that ended during the case used. */
#define ROOMS_CPU_MAX 24
typedef struct rooms_cpu_thread {
  const char *side;
  char thread[16];
  double us_per_room;
} rooms_cpu_thread;
typedef struct rooms_cpu {
  size_t n;
  rooms_cpu_thread t[ROOMS_CPU_MAX];
} rooms_cpu;

typedef struct rooms_case {
  const char *name;
  size_t pages;
  int inflight;
  int rooms;
  int m3_only; /* through a decode that completes rooms by M3 only, as against a tokenspeed prefill */
  double rooms_per_s, p50_us, p99_us;
  double wakeups_per_room; /* library thread wake-ups, both processes, per room */
  double cpu_us_per_room;  /* CPU time of both processes (every thread) per room; -1 unknown */
  rooms_cpu *cpu;          /* when set: filled with that time by thread */
} rooms_case;

/* One case: `rooms` requests of `pages` pages, `inflight` at a time, room
 * ids from base_room, received by `m` (pages from `pool`) and sent by the
 * `kvferry-testpeer kv-peer` child `peer` whose bootstrap server is baddr.
 * Fills the case's figures; 0, or -1 when a room failed or did not finish
 * within 120 s. */
int cli_bench_rooms_case(kvf_manager *m, kvpool *pool, proc *peer, const char *baddr, rooms_case *c,
                         int64_t base_room);

/* Which transport and UCX mode a benchmark ran on (the one asked for and,
 * with a decode manager `m` of this process, what its engine ran): JSON
 * members ",\"transport\":..." or one text line. */
void cli_bench_path(FILE *out, kvf_manager *m, int json);

/* `kvferry bench peers` (bench_peers.c): the options cli_bench parsed. */
typedef struct peers_opts {
  int json, quick;
  const char *peers;     /* "1,8,64,256" */
  const char *transport; /* tcp, ucx or auto; NULL = tcp and ucx (if built) */
} peers_opts;
int cli_bench_peers(const peers_opts *o);

#endif

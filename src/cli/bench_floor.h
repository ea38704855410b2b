/* Platform floors for `kvferry bench` (bench_floor.c): what this machine
 * charges, with no kvferry code in between, for work a benchmark's target
 * cannot avoid. Each is measured in the same run as the figure it explains
 * (bench/README.md, "Platform floors"). */
#ifndef KVF_CLI_BENCH_FLOOR_H
#define KVF_CLI_BENCH_FLOOR_H

#include <stddef.h>
#include <stdint.h>

/* The two digest passes of verify mode over `bytes`, each on one thread with
 * the library's hash (XXH3-64): cold_s = from memory, as the prefill digests
 * its sources at send; hot_s = 1 MiB pieces each right after it was copied,
 * as the decode digests what landed. 0, or -1 without memory. */
typedef struct bench_hash_cost {
  double cold_s, hot_s;
} bench_hash_cost;
int bench_hash_floor(uint64_t bytes, bench_hash_cost *out);

/* One thread copies `pieces` pieces of `piece` bytes (adjacent, as a layer's
 * pages): back to back, and each after sleeping idle_ms (as layerwise's
 * transfers come, one per layer computed). *ratio = time after idle / time
 * back to back, three alternations of each. 0, or -1 without memory. */
int bench_copy_after_idle(uint64_t piece, int pieces, double idle_ms, double *ratio);

/* Two threads read `total` bytes as random `block`-sized blocks of a child
 * process's pool into this one's with process_vm_readv (the kernel's
 * cross-memory attach, CMA, what reading a same-host peer's private memory
 * comes down to), `per_batch` blocks a batch. GB/s, 0 when it cannot run
 * (no CMA: another user, ptrace scope, a container without it). */
double bench_cma2_gbps(uint64_t pool_bytes, uint64_t block, size_t per_batch, uint64_t total);

#endif

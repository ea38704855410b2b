/* Same-run baselines for `kvferry bench engine` (bench_ucx.c). Each returns
 * GB/s, or 0 when it could not run. */
#ifndef KVF_CLI_BENCH_UCX_H
#define KVF_CLI_BENCH_UCX_H

#include <stddef.h>
#include <stdint.h>

/* Run fn(a) on a second thread and fn(b) on this one; the seconds both took.
 * *two = 0 when the second thread could not start (then only fn(b) ran). */
double bench_run_pair(void *(*fn)(void *), void *a, void *b, int *two);
/* Two threads copy `total` bytes as random `block`-sized blocks between two
 * pools of `pool_bytes`, `per_batch` blocks a batch. */
double bench_memcpy2_gbps(uint64_t pool_bytes, uint64_t block, size_t per_batch, uint64_t total);
/* A raw UCP put loop of the same blocks into a forked child on the current
 * UCX_TLS: ordinary memory at both ends, or (pool) a target pool that UCX
 * allocated. 0 without UCX. */
double bench_ucx_raw_gbps(uint64_t pool_bytes, uint64_t block, size_t per_batch, int inflight, uint64_t total,
                          int pool);

#endif

/* Platform floors measured in the same run as the benchmarks that need them
 * (bench_floor.h): what the machine itself charges for work a target cannot
 * avoid, with no kvferry code in between, so that a figure short of its
 * target says whether kvferry or the machine is in the way. See
 * bench/README.md, "Platform floors". */
#include "bench_floor.h"

#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <xxhash.h>
#if defined(__x86_64__) || defined(__i386__)
#include <xxh_x86dispatch.h> /* the library's digests use the same dispatch (src/base/hash.c) */
#endif

#include "bench_ucx.h"
#include "cli.h"

/* The pieces digested (and, for a hot digest, copied just before): the
 * decode digests each page as it lands, and 1 MiB stays in cache as well. */
#define FLOOR_PIECE (1u << 20)

static void *map_filled(uint64_t n, int c) {
  void *p = mmap(NULL, n, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) return NULL;
  memset(p, c, n);
  return p;
}

int bench_hash_floor(uint64_t bytes, bench_hash_cost *out) {
  memset(out, 0, sizeof *out);
  unsigned char *a = map_filled(bytes, 1), *b = map_filled(bytes, 2);
  int rc = -1;
  if (a && b) {
    volatile uint64_t sink = 0;
    /* Cold: every byte from memory (the buffer is far larger than any
     * cache, and b was written after it), in 1 MiB pieces. */
    double t0 = cli_now_s();
    for (uint64_t off = 0; off < bytes; off += FLOOR_PIECE)
      sink ^= XXH3_64bits(a + off, bytes - off < FLOOR_PIECE ? bytes - off : FLOOR_PIECE);
    out->cold_s = cli_now_s() - t0;
    /* Hot: each piece hashed right after it was copied, so from cache; only
     * the hashing is timed. */
    double hot = 0;
    for (uint64_t off = 0; off < bytes; off += FLOOR_PIECE) {
      size_t len = bytes - off < FLOOR_PIECE ? (size_t)(bytes - off) : FLOOR_PIECE;
      memcpy(b + off, a + off, len);
      double t1 = cli_now_s();
      sink ^= XXH3_64bits(b + off, len);
      hot += cli_now_s() - t1;
    }
    out->hot_s = hot;
    (void)sink;
    rc = 0;
  }
  if (a) munmap(a, bytes);
  if (b) munmap(b, bytes);
  return rc;
}

int bench_copy_after_idle(uint64_t piece, int pieces, double idle_ms, double *ratio) {
  *ratio = 0;
  uint64_t n = piece * (uint64_t)pieces;
  unsigned char *a = map_filled(n, 1), *b = map_filled(n, 2);
  int rc = -1;
  if (a && b) {
    double run[2] = {0, 0};
    long long ns = (long long)(idle_ms * 1e6);
    struct timespec nap = {(time_t)(ns / 1000000000), (long)(ns % 1000000000)};
    for (int rep = 0; rep < 3; rep++) /* alternate, so the machine's drift hits both */
      for (int idle = 0; idle < 2; idle++)
        for (int i = 0; i < pieces; i++) {
          if (idle) nanosleep(&nap, NULL);
          double t0 = cli_now_s();
          memcpy(b + (uint64_t)i * piece, a + (uint64_t)i * piece, piece);
          run[idle] += cli_now_s() - t0;
        }
    if (run[0] > 0) *ratio = run[1] / run[0];
    rc = 0;
  }
  if (a) munmap(a, n);
  if (b) munmap(b, n);
  return rc;
}

typedef struct cma_reader {
  pid_t pid;
  unsigned char *remote, *local;
  uint64_t slots, block, total, rng;
  size_t per_batch;
  int failed;
} cma_reader;

/* Reads cut and batched as kvferry's own (src/engine/ucx_read.c: slices of
 * UCX_READ_SLICE, at most UCX_CMA_BATCH_SLICES of them and
 * UCX_CMA_BATCH_BYTES a call), so the two differ only by what kvferry does
 * around the calls. */
#define FLOOR_CMA_SLICE (256u * 1024u)
#define FLOOR_CMA_IOV 32u
#define FLOOR_CMA_CALL_BYTES (512u * 1024u)

static int cma_flush(const cma_reader *c, const struct iovec *l, const struct iovec *r, size_t n, size_t bytes) {
  return n && process_vm_readv(c->pid, l, n, r, n, 0) != (ssize_t)bytes;
}

static void *cma_main(void *arg) {
  cma_reader *c = arg;
  struct iovec l[FLOOR_CMA_IOV], r[FLOOR_CMA_IOV];
  size_t n = 0, bytes = 0;
  for (uint64_t done = 0; done < c->total && !c->failed; done += c->block * c->per_batch)
    for (size_t i = 0; i < c->per_batch && !c->failed; i++) {
      unsigned char *dst = c->local + (cli_rng_next(&c->rng) % c->slots) * c->block;
      unsigned char *src = c->remote + (cli_rng_next(&c->rng) % c->slots) * c->block;
      for (uint64_t off = 0; off < c->block && !c->failed; off += FLOOR_CMA_SLICE) {
        size_t len = c->block - off < FLOOR_CMA_SLICE ? (size_t)(c->block - off) : FLOOR_CMA_SLICE;
        if (n == FLOOR_CMA_IOV || bytes + len > FLOOR_CMA_CALL_BYTES) {
          c->failed = cma_flush(c, l, r, n, bytes);
          n = bytes = 0;
        }
        l[n] = (struct iovec){dst + off, len};
        r[n++] = (struct iovec){src + off, len};
        bytes += len;
      }
    }
  if (!c->failed) c->failed = cma_flush(c, l, r, n, bytes);
  return NULL;
}

double bench_cma2_gbps(uint64_t pool_bytes, uint64_t block, size_t per_batch, uint64_t total) {
  unsigned char *remote = map_filled(pool_bytes, 1), *local = NULL;
  double gbps = 0;
  int go[2] = {-1, -1};
  pid_t pid = -1;
  if (!remote || pipe(go)) goto out;
  /* The child holds the pool at the same address (its pages shared with
   * this process's until either writes, which neither does) and waits. */
  pid = fork();
  if (pid == 0) {
    char c;
    close(go[1]);
    ssize_t r = read(go[0], &c, 1);
    _exit(r < 0);
  }
  if (pid < 0) goto out;
  /* Filled after the fork: pages shared with the child would each be copied
   * on their first write here. */
  if (!(local = map_filled(pool_bytes, 2))) goto out;
  /* Warm up, untimed, as the engine cases do: every page through the
   * kernel's copy once (bench/README.md, "Memory": on these VMs such copies
   * through 4 KiB pages are slow until each page has been through them). */
  for (uint64_t off = 0; off < pool_bytes; off += FLOOR_PIECE) {
    size_t len = pool_bytes - off < FLOOR_PIECE ? (size_t)(pool_bytes - off) : FLOOR_PIECE;
    struct iovec l = {local + off, len}, r = {remote + off, len};
    if (process_vm_readv(pid, &l, 1, &r, 1, 0) != (ssize_t)len) goto out;
  }
  size_t half = per_batch > 1 ? per_batch / 2 : 1;
  cma_reader c[2] = {{pid, remote, local, pool_bytes / block, block, total / 2, 0x12345678, half, 0},
                     {pid, remote, local, pool_bytes / block, block, total / 2, 0x87654321, half, 0}};
  int two;
  double dt = bench_run_pair(cma_main, &c[1], &c[0], &two);
  uint64_t moved = two ? c[0].total + c[1].total : c[0].total;
  if (!c[0].failed && !c[1].failed && dt > 0) gbps = moved / dt / 1e9;
out:
  if (go[1] >= 0) close(go[1]); /* the child reads EOF and leaves */
  if (go[0] >= 0) close(go[0]);
  if (pid > 0) waitpid(pid, NULL, 0);
  if (remote) munmap(remote, pool_bytes);
  if (local) munmap(local, pool_bytes);
  return gbps;
}

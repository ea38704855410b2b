/* Baselines for `kvferry bench engine` measured in the same run as the
 * engine cases (bench_ucx.h):
 *   memcpy2  two threads copy the same kind of scattered blocks between two
 *            pre-faulted pools of the engine cases' size, in this process
 *   ucx_raw  a raw UCP put loop of the same blocks into a child process
 *            (forked before any UCX call here), on the same UCX_TLS, with no
 *            kvferry code in between: puts, one endpoint flush per batch,
 *            `inflight` flushes outstanding. */
#include "bench_ucx.h"

#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>

#include "cli.h"

typedef struct copier {
  unsigned char *a, *b;
  uint64_t slots, block, total, rng;
  size_t per_batch;
} copier;

static void *copier_main(void *arg) {
  copier *c = arg;
  for (uint64_t done = 0; done < c->total; done += c->block * c->per_batch)
    for (size_t i = 0; i < c->per_batch; i++)
      memcpy(c->b + (cli_rng_next(&c->rng) % c->slots) * c->block,
             c->a + (cli_rng_next(&c->rng) % c->slots) * c->block, c->block);
  return NULL;
}

double bench_run_pair(void *(*fn)(void *), void *a, void *b, int *two) {
  pthread_t th;
  double t0 = cli_now_s();
  *two = pthread_create(&th, NULL, fn, a) == 0;
  fn(b);
  if (*two) pthread_join(th, NULL);
  return cli_now_s() - t0;
}

double bench_memcpy2_gbps(uint64_t pool_bytes, uint64_t block, size_t per_batch, uint64_t total) {
  unsigned char *a = mmap(NULL, pool_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  unsigned char *b = mmap(NULL, pool_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  double gbps = 0;
  if (a != MAP_FAILED && b != MAP_FAILED) {
    memset(a, 1, pool_bytes);
    memset(b, 2, pool_bytes);
    /* Each thread copies half of every batch's blocks. */
    size_t half = per_batch > 1 ? per_batch / 2 : 1;
    copier c[2] = {{a, b, pool_bytes / block, block, total / 2, 0x12345678, half},
                   {a, b, pool_bytes / block, block, total / 2, 0x87654321, half}};
    int two;
    double dt = bench_run_pair(copier_main, &c[1], &c[0], &two);
    uint64_t moved = two ? c[0].total + c[1].total : c[0].total;
    gbps = dt > 0 ? moved / dt / 1e9 : 0;
  }
  if (a != MAP_FAILED) munmap(a, pool_bytes);
  if (b != MAP_FAILED) munmap(b, pool_bytes);
  return gbps;
}

#ifdef KVF_HAVE_UCX
#include <ucp/api/ucp.h>

static int ucx_open(ucp_context_h *ctx, ucp_worker_h *w) {
  ucp_config_t *conf;
  if (ucp_config_read(NULL, NULL, &conf) != UCS_OK) return -1;
  ucp_params_t pp = {.field_mask = UCP_PARAM_FIELD_FEATURES, .features = UCP_FEATURE_RMA | UCP_FEATURE_WAKEUP};
  ucs_status_t st = ucp_init(&pp, conf, ctx);
  ucp_config_release(conf);
  if (st != UCS_OK) return -1;
  ucp_worker_params_t wp = {.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE,
                            .thread_mode = UCS_THREAD_MODE_SINGLE};
  if (ucp_worker_create(*ctx, &wp, w) != UCS_OK) {
    ucp_cleanup(*ctx);
    return -1;
  }
  return 0;
}

/* A memory handle for `bytes` at *addr (mmap'd here), or allocated by UCX
 * when `pool` (then *addr is set). */
static int ucx_map(ucp_context_h ctx, int pool, uint64_t bytes, void **addr, ucp_mem_h *memh) {
  ucp_mem_map_params_t mp = {.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH |
                                           UCP_MEM_MAP_PARAM_FIELD_FLAGS,
                             .address = pool ? NULL : *addr,
                             .length = bytes,
                             .flags = pool ? UCP_MEM_MAP_ALLOCATE : 0};
  if (ucp_mem_map(ctx, &mp, memh) != UCS_OK) return -1;
  ucp_mem_attr_t at = {.field_mask = UCP_MEM_ATTR_FIELD_ADDRESS};
  if (ucp_mem_query(*memh, &at) != UCS_OK) return -1;
  *addr = at.address;
  return 0;
}

static int write_blob(int fd, const void *p, uint64_t len) {
  if (write(fd, &len, sizeof len) != (ssize_t)sizeof len) return -1;
  const char *c = p;
  while (len) {
    ssize_t r = write(fd, c, len);
    if (r <= 0) return -1;
    c += r;
    len -= (uint64_t)r;
  }
  return 0;
}

static void *read_blob(int fd, uint64_t *len) {
  if (read(fd, len, sizeof *len) != (ssize_t)sizeof *len || *len > (1u << 20)) return NULL;
  char *p = malloc(*len ? *len : 1);
  for (uint64_t got = 0; p && got < *len;) {
    ssize_t r = read(fd, p + got, *len - got);
    if (r <= 0) {
      free(p);
      return NULL;
    }
    got += (uint64_t)r;
  }
  return p;
}

/* The child: a worker and a target pool; progress until told to stop. */
static void raw_target(int out_fd, int in_fd, uint64_t bytes, int pool) {
  ucp_context_h ctx;
  ucp_worker_h w;
  void *addr = NULL, *rkey = NULL;
  ucp_mem_h memh;
  size_t rkey_len = 0;
  ucp_worker_attr_t wa = {.field_mask = UCP_WORKER_ATTR_FIELD_ADDRESS};
  if (ucx_open(&ctx, &w)) _exit(1);
  if (!pool) {
    addr = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (addr == MAP_FAILED) _exit(1);
  }
  if (ucx_map(ctx, pool, bytes, &addr, &memh) || ucp_rkey_pack(ctx, memh, &rkey, &rkey_len) != UCS_OK ||
      ucp_worker_query(w, &wa) != UCS_OK)
    _exit(1);
  memset(addr, 0, bytes);
  uint64_t base = (uint64_t)(uintptr_t)addr;
  if (write_blob(out_fd, wa.address, wa.address_length) || write_blob(out_fd, rkey, rkey_len) ||
      write_blob(out_fd, &base, sizeof base))
    _exit(1);
  /* Progress when UCX has work (wire-up, or RMA that needs the target, as
   * over tcp); sleep otherwise, so the target does not take a core. */
  int efd = -1;
  if (ucp_worker_get_efd(w, &efd) != UCS_OK) _exit(1);
  double limit = cli_now_s() + 600;
  for (;;) {
    while (ucp_worker_progress(w)) {
    }
    ucs_status_t st = ucp_worker_arm(w);
    struct pollfd pf[2] = {{.fd = in_fd, .events = POLLIN}, {.fd = efd, .events = POLLIN}};
    if (poll(pf, 2, st == UCS_ERR_BUSY ? 0 : 1000) < 0 || pf[0].revents || cli_now_s() > limit) break;
  }
  _exit(0);
}

static void wait_req(ucp_worker_h w, void *req) {
  if (!UCS_PTR_IS_PTR(req)) return;
  while (ucp_request_check_status(req) == UCS_INPROGRESS) ucp_worker_progress(w);
  ucp_request_free(req);
}

double bench_ucx_raw_gbps(uint64_t pool_bytes, uint64_t block, size_t per_batch, int inflight, uint64_t total,
                          int pool) {
  int to_parent[2], to_child[2];
  if (pipe(to_parent)) return 0;
  if (pipe(to_child)) {
    close(to_parent[0]), close(to_parent[1]);
    return 0;
  }
  fflush(NULL);
  pid_t pid = fork();
  if (pid == 0) {
    close(to_parent[0]);
    close(to_child[1]);
    raw_target(to_parent[1], to_child[0], pool_bytes, pool);
  }
  close(to_parent[1]);
  close(to_child[0]);
  double gbps = 0;
  ucp_context_h ctx = NULL;
  ucp_worker_h w = NULL;
  ucp_ep_h ep = NULL;
  ucp_rkey_h rkey = NULL;
  ucp_mem_h memh = NULL;
  void **reqs = calloc((size_t)inflight, sizeof *reqs);
  uint64_t alen = 0, klen = 0, blen = 0;
  void *raddr = pid > 0 ? read_blob(to_parent[0], &alen) : NULL;
  void *rk = raddr ? read_blob(to_parent[0], &klen) : NULL;
  uint64_t *base = rk ? read_blob(to_parent[0], &blen) : NULL;
  void *src = mmap(NULL, pool_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (!reqs || !base || blen != sizeof *base || src == MAP_FAILED || ucx_open(&ctx, &w)) goto out;
  memset(src, 3, pool_bytes);
  if (ucx_map(ctx, 0, pool_bytes, &src, &memh)) goto out;
  ucp_ep_params_t epp = {.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS, .address = raddr};
  if (ucp_ep_create(w, &epp, &ep) != UCS_OK || ucp_ep_rkey_unpack(ep, rk, &rkey) != UCS_OK) goto out;
  uint64_t slots = pool_bytes / block, rng = 0x12345678, per = block * per_batch;
  ucp_request_param_t prm = {.op_attr_mask = UCP_OP_ATTR_FIELD_MEMH, .memh = memh};
  ucp_request_param_t fprm = {.op_attr_mask = 0};
  double t0 = 0;
  int slot = 0;
  /* One warm-up batch (wire-up), then the timed loop. */
  for (uint64_t done = 0; done < total + per;) {
    if (done == per) t0 = cli_now_s();
    wait_req(w, reqs[slot]);
    reqs[slot] = NULL;
    for (size_t i = 0; i < per_batch; i++) {
      void *r = ucp_put_nbx(ep, (char *)src + (cli_rng_next(&rng) % slots) * block, block,
                            *base + (cli_rng_next(&rng) % slots) * block, rkey, &prm);
      if (UCS_PTR_IS_ERR(r)) goto out;
      if (r) ucp_request_free(r);
    }
    reqs[slot] = ucp_ep_flush_nbx(ep, &fprm);
    if (UCS_PTR_IS_ERR(reqs[slot])) goto out;
    if (done == 0) {
      wait_req(w, reqs[slot]);
      reqs[slot] = NULL;
    }
    done += per;
    slot = (slot + 1) % inflight;
  }
  for (int i = 0; i < inflight; i++) {
    wait_req(w, reqs[i]);
    reqs[i] = NULL;
  }
  gbps = total / (cli_now_s() - t0) / 1e9;
out:
  if (rkey) ucp_rkey_destroy(rkey);
  if (ep) {
    ucp_request_param_t cp = {.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS, .flags = UCP_EP_CLOSE_FLAG_FORCE};
    wait_req(w, ucp_ep_close_nbx(ep, &cp));
  }
  if (memh) ucp_mem_unmap(ctx, memh);
  if (w) ucp_worker_destroy(w);
  if (ctx) ucp_cleanup(ctx);
  if (src != MAP_FAILED) munmap(src, pool_bytes);
  free(raddr);
  free(rk);
  free(base);
  free(reqs);
  if (write(to_child[1], "x", 1) < 0) { /* the child also ends on EOF */
  }
  close(to_child[1]);
  close(to_parent[0]);
  if (pid > 0) waitpid(pid, NULL, 0);
  return gbps;
}
#else
double bench_ucx_raw_gbps(uint64_t pool_bytes, uint64_t block, size_t per_batch, int inflight, uint64_t total,
                          int pool) {
  return 0;
}
#endif

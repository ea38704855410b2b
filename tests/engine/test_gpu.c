/* GPU memory (cuMemAlloc) in the transfer engine. The cases that need a
 * GPU skip, saying why, without the CUDA driver (libcuda.so.1) or a
 * device; the UCX moves also without a UCX built with CUDA (Debian's is
 * not). The two refusal cases run everywhere: on a machine without a GPU a
 * PROT_NONE mapping stands in for device memory.
 *
 * The driver API is loaded with dlopen, so nothing here links against
 * CUDA and any driver's libcuda.so.1 serves (no runtime version to match).
 * scripts/gpu/README.md says how to run these on a GPU machine. */
#include <dlfcn.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>
#include <cmocka.h>

#include "base/hostmem.h"
#include "engine/async.h"

#include "tools/pattern.h"
#include "kvferry.h"
#ifdef KVF_HAVE_UCX
#include <ucp/api/ucp.h>
#endif

#define PAGE (64u << 10)
#define PAGES 64u
#define LEN ((size_t)PAGE * PAGES)

/* ---- the CUDA driver API, as far as these tests use it ---- */

typedef unsigned long long cu_ptr; /* CUdeviceptr */
typedef struct gpu {
  void *lib;
  int (*init)(unsigned);
  int (*device_get)(int *, int);
  int (*ctx_retain)(void **, int);
  int (*ctx_release)(int);
  int (*ctx_set)(void *);
  int (*alloc)(cu_ptr *, size_t);
  int (*free)(cu_ptr);
  int (*htod)(cu_ptr, const void *, size_t);
  int (*dtoh)(void *, cu_ptr, size_t);
  int dev;
  void *ctx;
} gpu;

static gpu g_gpu;
static char g_gpu_why[160];

/* Loads the driver and makes device 0's primary context current in this
 * thread: 1, or 0 with the reason in g_gpu_why. */
static int gpu_open(void) {
  if (g_gpu.ctx) return 1;
  gpu *g = &g_gpu;
  g->lib = dlopen("libcuda.so.1", RTLD_NOW);
  if (!g->lib) {
    snprintf(g_gpu_why, sizeof g_gpu_why, "no CUDA driver (libcuda.so.1: %s)", dlerror());
    return 0;
  }
  struct {
    void **fn;
    const char *name;
  } syms[] = {{(void **)&g->init, "cuInit"},
              {(void **)&g->device_get, "cuDeviceGet"},
              {(void **)&g->ctx_retain, "cuDevicePrimaryCtxRetain"},
              {(void **)&g->ctx_release, "cuDevicePrimaryCtxRelease_v2"},
              {(void **)&g->ctx_set, "cuCtxSetCurrent"},
              {(void **)&g->alloc, "cuMemAlloc_v2"},
              {(void **)&g->free, "cuMemFree_v2"},
              {(void **)&g->htod, "cuMemcpyHtoD_v2"},
              {(void **)&g->dtoh, "cuMemcpyDtoH_v2"}};
  for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++)
    if (!(*syms[i].fn = dlsym(g->lib, syms[i].name))) {
      snprintf(g_gpu_why, sizeof g_gpu_why, "the CUDA driver lacks %s", syms[i].name);
      return 0;
    }
  int rc;
  if ((rc = g->init(0)) || (rc = g->device_get(&g->dev, 0)) || (rc = g->ctx_retain(&g->ctx, g->dev)) ||
      (rc = g->ctx_set(g->ctx))) {
    snprintf(g_gpu_why, sizeof g_gpu_why, "no usable CUDA device (driver error %d)", rc);
    g->ctx = NULL;
    return 0;
  }
  return 1;
}

#define SKIP_WITHOUT_GPU()             \
  do {                                 \
    if (!gpu_open()) {                 \
      printf("SKIP: %s\n", g_gpu_why); \
      skip();                          \
    }                                  \
  } while (0)

/* Does this process's UCX know CUDA memory? */
static int ucx_has_cuda(void) {
#ifdef KVF_HAVE_UCX
  if (!strstr(kvf_engine_transports(), "ucx")) return 0;
  ucp_config_t *conf = NULL;
  ucp_context_h ctx = NULL;
  ucp_params_t pp = {.field_mask = UCP_PARAM_FIELD_FEATURES, .features = UCP_FEATURE_RMA};
  ucp_context_attr_t attr = {.field_mask = UCP_ATTR_FIELD_MEMORY_TYPES};
  int yes = ucp_config_read(NULL, NULL, &conf) == UCS_OK && ucp_init(&pp, conf, &ctx) == UCS_OK &&
            ucp_context_query(ctx, &attr) == UCS_OK && (attr.memory_types & UCS_BIT(UCS_MEMORY_TYPE_CUDA));
  if (ctx) ucp_cleanup(ctx);
  if (conf) ucp_config_release(conf);
  return yes;
#else
  return 0;
#endif
}

#define SKIP_WITHOUT_CUDA_UCX()                                                                       \
  do {                                                                                                \
    SKIP_WITHOUT_GPU();                                                                               \
    if (!ucx_has_cuda()) {                                                                            \
      printf("SKIP: this kvferry's UCX does not know CUDA memory (transports: %s; ucx_info -v lists " \
             "--with-cuda when it does)\n",                                                           \
             kvf_engine_transports());                                                                \
      skip();                                                                                         \
    }                                                                                                 \
  } while (0)

/* An engine of `transport` without auth, or NULL. */
static kvf_engine *engine_new(const char *transport) {
  kvf_engine_config cfg;
  kvf_engine_config_init(&cfg);
  cfg.transport = transport;
  cfg.timeout_ms = 10000;
  cfg.auth_token = "";
  kvf_engine *e = NULL;
  return kvf_engine_create(&cfg, &e) ? NULL : e;
}

static kvf_engine *make_engine(const char *transport) {
  kvf_engine *e = engine_new(transport);
  assert_non_null(e);
  return e;
}

/* One side of a transfer: LEN bytes of host memory or of device memory
 * (then `host` is a staging copy for filling and checking). */
typedef struct side {
  int device;
  unsigned char *host;
  cu_ptr dev;
} side;

static void side_open(side *s, int device) {
  s->device = device;
  s->host = malloc(LEN);
  assert_non_null(s->host);
  memset(s->host, 0, LEN);
  s->dev = 0;
  if (device) {
    assert_int_equal(g_gpu.alloc(&s->dev, LEN), 0);
    assert_int_equal(g_gpu.htod(s->dev, s->host, LEN), 0);
  }
}

static uint64_t side_addr(const side *s) { return s->device ? s->dev : (uint64_t)(uintptr_t)s->host; }

static void side_fill(side *s, uint64_t seed) {
  for (size_t p = 0; p < PAGES; p++) pattern_fill(s->host + p * PAGE, PAGE, seed, p);
  if (s->device) assert_int_equal(g_gpu.htod(s->dev, s->host, LEN), 0);
}

/* The bytes now in the side (device memory copied back to host). */
static const unsigned char *side_bytes(side *s) {
  if (s->device) assert_int_equal(g_gpu.dtoh(s->host, s->dev, LEN), 0);
  return s->host;
}

static void side_close(side *s) {
  if (s->device) g_gpu.free(s->dev);
  free(s->host);
}

/* Page p of the source lands on page PAGES-1-p of the destination (every
 * page its own run, in reverse order), in one batch. */
static void write_reversed(kvf_engine *w, const char *session, side *src, uint64_t dst, uint64_t seed) {
  side_fill(src, seed);
  kvf_write wr[PAGES];
  for (size_t p = 0; p < PAGES; p++)
    wr[p] = (kvf_write){.src = side_addr(src) + p * PAGE, .dst = dst + (PAGES - 1 - p) * PAGE, .len = PAGE};
  assert_int_equal(kvf_engine_write(w, session, wr, PAGES), 0);
}

/* Which page of `dst` does not hold what write_reversed(seed) put there:
 * -1 when all do. */
static int reversed_mismatch(side *dst, uint64_t seed) {
  const unsigned char *got = side_bytes(dst);
  for (size_t p = 0; p < PAGES; p++)
    if (!pattern_check(got + (PAGES - 1 - p) * PAGE, PAGE, seed, p)) return (int)(PAGES - 1 - p);
  return -1;
}

static void move_reversed(kvf_engine *w, kvf_engine *t, side *src, side *dst, uint64_t seed) {
  write_reversed(w, kvf_engine_session_id(t), src, side_addr(dst), seed);
  kvf_engine_sync(t); /* the target's landed bytes, published to this thread */
  assert_int_equal(reversed_mismatch(dst, seed), -1);
}

/* ---- a target in another process ----
 * UCX moves device memory between processes (cuda_ipc; RDMA with GPUDirect
 * between hosts), as a prefill and a decode are; within one process it has
 * no transport for it. The target is this program again (KVF_GPU_TARGET=
 * host|device, before cmocka): it prints "<session> <address>", then
 * answers each "check <seed>" line with "ok" or "bad <page>", until EOF. */
static int gpu_target_main(int device) {
  if (device && !gpu_open()) {
    printf("error %s\n", g_gpu_why);
    return 1;
  }
  kvf_engine *t = engine_new("ucx");
  side dst;
  if (!t) {
    printf("error engine\n");
    return 1;
  }
  side_open(&dst, device);
  if (kvf_engine_register(t, (void *)(uintptr_t)side_addr(&dst), LEN)) {
    printf("error register\n");
    return 1;
  }
  printf("%s %llu\n", kvf_engine_session_id(t), (unsigned long long)side_addr(&dst));
  fflush(stdout);
  char line[128];
  unsigned long long seed;
  while (fgets(line, sizeof line, stdin) && sscanf(line, "check %llu", &seed) == 1) {
    kvf_engine_sync(t);
    int bad = reversed_mismatch(&dst, seed);
    if (bad < 0) printf("ok\n");
    else printf("bad %d\n", bad);
    fflush(stdout);
  }
  kvf_engine_destroy(t);
  side_close(&dst);
  return 0;
}

typedef struct target_proc {
  pid_t pid;
  FILE *to, *from;
  char session[128];
  uint64_t addr;
} target_proc;

static void target_start(target_proc *tp, int device) {
  int in[2], out[2];
  assert_int_equal(pipe(in), 0);
  assert_int_equal(pipe(out), 0);
  tp->pid = fork();
  assert_true(tp->pid >= 0);
  if (tp->pid == 0) {
    dup2(in[0], 0);
    dup2(out[1], 1);
    close(in[1]);
    close(out[0]);
    setenv("KVF_GPU_TARGET", device ? "device" : "host", 1);
    execl("/proc/self/exe", "engine_test_gpu", (char *)NULL);
    _exit(127);
  }
  close(in[0]);
  close(out[1]);
  tp->to = fdopen(in[1], "w");
  tp->from = fdopen(out[0], "r");
  char line[256];
  unsigned long long addr = 0;
  assert_non_null(fgets(line, sizeof line, tp->from));
  printf("target (%s memory): %s", device ? "device" : "host", line);
  assert_int_equal(sscanf(line, "%127s %llu", tp->session, &addr), 2);
  tp->addr = addr;
}

static int target_check(target_proc *tp, uint64_t seed) {
  char line[64];
  fprintf(tp->to, "check %llu\n", (unsigned long long)seed);
  fflush(tp->to);
  assert_non_null(fgets(line, sizeof line, tp->from));
  if (strncmp(line, "ok", 2)) printf("target: %s", line);
  return strncmp(line, "ok", 2) == 0;
}

static void target_stop(target_proc *tp) {
  fclose(tp->to);
  fclose(tp->from);
  int st = 0;
  assert_int_equal(waitpid(tp->pid, &st, 0), tp->pid);
  assert_true(WIFEXITED(st) && WEXITSTATUS(st) == 0);
}

/* A cuMemAlloc range is not a readable mapping of the process: what the
 * engine (UCX: write mode, not read mode) and the KV managers (no verify
 * mode) go by. Prints the maps lines that cover it, for the record. */
static void device_memory_is_not_host_readable(void **state) {
  SKIP_WITHOUT_GPU();
  cu_ptr d = 0;
  assert_int_equal(g_gpu.alloc(&d, LEN), 0);
  FILE *maps = fopen("/proc/self/maps", "re");
  char line[512];
  while (maps && fgets(line, sizeof line, maps)) {
    unsigned long long lo, hi;
    if (sscanf(line, "%llx-%llx", &lo, &hi) == 2 && lo < d + LEN && hi > d) printf("maps: %s", line);
  }
  if (maps) fclose(maps);
  int readable = kvf__host_readable(d, LEN);
  printf("cuMemAlloc %#llx+%zu: host readable %d\n", d, LEN, readable);
  assert_int_equal(readable, 0);
  g_gpu.free(d);
}

/* Over UCX with CUDA, a writer here and a target in another process, write
 * mode (device memory registered on either side turns read mode off): host
 * to device, device to device, device to host, every page its own run,
 * byte-exact, twice over the same connection. */
static void run_ucx(int src_device, int dst_device) {
  SKIP_WITHOUT_CUDA_UCX();
  target_proc tp;
  target_start(&tp, dst_device);
  kvf_engine *w = make_engine("ucx");
  side src;
  side_open(&src, src_device);
  assert_int_equal(kvf_engine_register(w, (void *)(uintptr_t)side_addr(&src), LEN), 0);
  for (uint64_t seed = 31; seed <= 32; seed++) {
    write_reversed(w, tp.session, &src, tp.addr, seed);
    assert_true(target_check(&tp, seed));
  }
  const char *pt = NULL, *pm = NULL;
  assert_int_equal(kvf__engine_peer_path(w, tp.session, &pt, &pm), 0);
  char why[512] = ""; /* room for a user's UCX_TLS and the device note */
  kvf_engine_peer_transport(w, tp.session, why, sizeof why);
  printf("%s to %s: path %s/%s (%s)\n", src_device ? "device" : "host", dst_device ? "device" : "host", pt, pm,
         why);
  assert_string_equal(pm, "write");
  /* the route text says how this engine's own device memory moves */
  assert_true(!src_device || strstr(why, "device memory through UCX's CUDA transports"));
  kvf_engine_destroy(w);
  side_close(&src);
  target_stop(&tp);
}

static void host_to_device_over_ucx(void **state) { run_ucx(0, 1); }
static void device_to_device_over_ucx(void **state) { run_ucx(1, 1); }
static void device_to_host_over_ucx(void **state) { run_ucx(1, 0); }

/* A transport that would copy with the CPU (kvferry's TCP; UCX without
 * CUDA, which does not advertise device memory) refuses a write into or out
 * of device memory with an error instead of crashing or hanging, and the
 * engines go on moving host memory. Device memory where there is a GPU and
 * gpu_allowed, else a PROT_NONE mapping standing in for it. */
static void cpu_transport_refuses_device_memory(const char *transport, int gpu_allowed) {
  int have_gpu = gpu_allowed && gpu_open();
  printf("%s: %s\n", transport, have_gpu ? "device memory from cuMemAlloc" : "a PROT_NONE mapping stands in");
  void *dev = NULL;
  if (have_gpu) {
    cu_ptr d = 0;
    assert_int_equal(g_gpu.alloc(&d, LEN), 0);
    dev = (void *)(uintptr_t)d;
  } else {
    dev = mmap(NULL, LEN, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    assert_true(dev != MAP_FAILED);
  }
  for (int dev_is_dst = 1; dev_is_dst >= 0; dev_is_dst--) {
    kvf_engine *t = make_engine(transport), *w = make_engine(transport);
    side src, dst;
    side_open(&src, 0);
    side_open(&dst, 0);
    assert_int_equal(kvf_engine_register(w, src.host, LEN), 0);
    assert_int_equal(kvf_engine_register(t, dst.host, LEN), 0);
    assert_int_equal(kvf_engine_register(dev_is_dst ? t : w, dev, LEN), 0);
    kvf_write bad = {.src = (uint64_t)(uintptr_t)(dev_is_dst ? src.host : dev),
                     .dst = (uint64_t)(uintptr_t)(dev_is_dst ? dev : dst.host),
                     .len = LEN};
    int rc = kvf_engine_write(w, kvf_engine_session_id(t), &bad, 1);
    printf("writing %s device memory: %s\n", dev_is_dst ? "into" : "out of", kvf_strerror(rc));
    assert_int_not_equal(rc, 0);
    move_reversed(w, t, &src, &dst, 41); /* host memory still moves */
    kvf_engine_destroy(w);
    kvf_engine_destroy(t);
    side_close(&src);
    side_close(&dst);
  }
  if (have_gpu) g_gpu.free((cu_ptr)(uintptr_t)dev);
  else munmap(dev, LEN);
}

static void tcp_refuses_device_memory(void **state) { cpu_transport_refuses_device_memory("tcp", 1); }

/* UCX refuses what it could reach only with the CPU: device memory when it
 * does not know CUDA memory, and, when it does, memory that is neither host
 * memory nor known to the CUDA driver (a PROT_NONE mapping). */
static void ucx_refuses_memory_it_cannot_move(void **state) {
  if (!strstr(kvf_engine_transports(), "ucx")) {
    printf("SKIP: this kvferry was built without UCX\n");
    skip();
  }
  cpu_transport_refuses_device_memory("ucx", !ucx_has_cuda());
}

int main(void) {
  const char *role = getenv("KVF_GPU_TARGET");
  if (role) return gpu_target_main(!strcmp(role, "device"));
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(device_memory_is_not_host_readable), cmocka_unit_test(host_to_device_over_ucx),
      cmocka_unit_test(device_to_device_over_ucx),          cmocka_unit_test(device_to_host_over_ucx),
      cmocka_unit_test(tcp_refuses_device_memory),          cmocka_unit_test(ucx_refuses_memory_it_cannot_move),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

/* The UCX transport and CUDA contexts. UCX's CUDA transports (cuda_ipc,
 * cuda_copy) work in the calling thread's current CUDA context, and this
 * engine's own threads (progress, connectors, the KV managers' transfer
 * workers) have none. Once device memory is registered, a thread that takes
 * the UCX worker (kvf__ucx_wlock) without a current context takes the
 * primary context of that memory's device (the first device registered).
 * The driver API is loaded with dlopen: kvferry links no CUDA library.
 * KVFERRY_UCX_CUDA_CTX=0 leaves the threads' contexts alone. */
#include <dlfcn.h>
#include <pthread.h>

#include "base/env.h"
#include "base/log.h"
#include "engine/ucx.h"

#define CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL 9 /* cuda.h, CUDA 9.2 and later */

static struct {
  int (*init)(unsigned);
  int (*pointer_attr)(void *, int, unsigned long long);
  int (*retain)(void **, int);
  int (*release)(int);
  int (*get_current)(void **);
  int (*set_current)(void *);
} cu;
static pthread_once_t cu_once = PTHREAD_ONCE_INIT;
static int cu_loaded;
static _Thread_local int tl_entered; /* this thread has a current context (its own, or the one set here) */

static void cu_load(void) {
  void *lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!lib) return;
  struct {
    void **fn;
    const char *name;
  } syms[] = {{(void **)&cu.init, "cuInit"},
              {(void **)&cu.pointer_attr, "cuPointerGetAttribute"},
              {(void **)&cu.retain, "cuDevicePrimaryCtxRetain"},
              {(void **)&cu.release, "cuDevicePrimaryCtxRelease_v2"},
              {(void **)&cu.get_current, "cuCtxGetCurrent"},
              {(void **)&cu.set_current, "cuCtxSetCurrent"}};
  for (size_t i = 0; i < sizeof syms / sizeof syms[0]; i++)
    if (!(*syms[i].fn = dlsym(lib, syms[i].name))) return; /* kept loaded: cheap, and dlclose races nothing */
  cu_loaded = cu.init(0) == 0;
}

int kvf__ucx_cuda_adopt(ucx_state *u, const void *addr, size_t len) {
  pthread_once(&cu_once, cu_load);
  int dev = -1;
  if (!cu_loaded ||
      cu.pointer_attr(&dev, CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL, (unsigned long long)(uintptr_t)addr) || dev < 0)
    return -1;
  void *ctx = NULL, *none = NULL;
  if (atomic_load(&u->cuda_ctx) || !kvf__env_get_bool("KVFERRY_UCX_CUDA_CTX", 1)) return dev;
  if (cu.retain(&ctx, dev) || !ctx) {
    LOG_WARN("ucx",
             "%p+%zu: no primary context for CUDA device %d: UCX's CUDA transports use whatever context "
             "each thread has",
             addr, len, dev);
    return dev;
  }
  if (!atomic_compare_exchange_strong(&u->cuda_ctx, &none, ctx)) {
    cu.release(dev);
    return dev;
  }
  u->cuda_dev = dev;
  LOG_INFO("ucx", "device memory on CUDA device %d: this engine's threads use its primary context", dev);
  return dev;
}

void kvf__ucx_cuda_enter(ucx_state *u) {
  void *ctx = atomic_load(&u->cuda_ctx);
  if (!ctx || tl_entered) return;
  tl_entered = 1;
  void *cur = NULL;
  if (cu.get_current(&cur) == 0 && cur) return; /* the caller's own context */
  cu.set_current(ctx);
}

void kvf__ucx_cuda_release(ucx_state *u) {
  if (atomic_load(&u->cuda_ctx)) cu.release(u->cuda_dev);
}

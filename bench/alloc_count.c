/* LD_PRELOAD shim for bench/alloc-per-room.sh: counts malloc, calloc and
 * realloc calls per call site (the caller's return address) and writes them,
 * with the object file and offset dladdr finds, to
 * $KVF_ALLOC_COUNT_DIR/alloc.<pid> when the process exits normally. Only
 * counts; every call goes on to glibc. Not part of the library. */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

#define SITES 8192 /* open-addressed table of call sites; more are not counted */

static _Atomic(uintptr_t) site_pc[SITES];
static atomic_ulong site_calls[SITES];

extern void *__libc_malloc(size_t);
extern void *__libc_calloc(size_t, size_t);
extern void *__libc_realloc(void *, size_t);

static void count(void *ret) {
  uintptr_t pc = (uintptr_t)ret;
  size_t i = (size_t)((pc * 0x9e3779b97f4a7c15ull) >> 51) % SITES;
  for (size_t n = 0; n < SITES; n++, i = (i + 1) % SITES) {
    uintptr_t cur = atomic_load(&site_pc[i]);
    if (cur == 0 && atomic_compare_exchange_strong(&site_pc[i], &cur, pc)) cur = pc;
    if (cur == pc) {
      atomic_fetch_add(&site_calls[i], 1);
      return;
    }
  }
}

void *malloc(size_t n) {
  count(__builtin_return_address(0));
  return __libc_malloc(n);
}
void *calloc(size_t k, size_t n) {
  count(__builtin_return_address(0));
  return __libc_calloc(k, n);
}
void *realloc(void *p, size_t n) {
  count(__builtin_return_address(0));
  return __libc_realloc(p, n);
}

__attribute__((destructor)) static void write_counts(void) {
  const char *dir = getenv("KVF_ALLOC_COUNT_DIR");
  char path[512];
  snprintf(path, sizeof path, "%s/alloc.%d", dir ? dir : "/tmp", (int)getpid());
  FILE *f = fopen(path, "w");
  if (!f) return;
  for (size_t i = 0; i < SITES; i++) {
    uintptr_t pc = atomic_load(&site_pc[i]);
    if (!pc) continue;
    Dl_info di;
    const char *obj = "?";
    uintptr_t base = 0;
    if (dladdr((void *)pc, &di) && di.dli_fname) obj = di.dli_fname, base = (uintptr_t)di.dli_fbase;
    fprintf(f, "%lu %s 0x%lx\n", (unsigned long)atomic_load(&site_calls[i]), obj, (unsigned long)(pc - base));
  }
  fclose(f);
}

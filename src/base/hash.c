/* See hash.h. XXH_STATIC_LINKING_ONLY exposes XXH3_state_t's size so the
 * streaming state can live in the caller's buffer instead of the heap. */
#define XXH_STATIC_LINKING_ONLY
#include "base/hash.h"

#include <string.h>
#include <xxhash.h>
/* The _dispatch entry points Debian's libxxhash exports pick the widest
 * vector unit the CPU has at run time (AVX2 / AVX-512 here: 45 GB/s on
 * cache-hot data against 19 GB/s for the SSE2 baseline the plain names are
 * built for); same digests. The header maps the plain names onto them.
 * Debian builds them for x86 only. */
#if defined(__x86_64__) || defined(__i386__)
#include <xxh_x86dispatch.h>
#endif

_Static_assert(sizeof(XXH3_state_t) <= sizeof(kvf__hash_state), "kvf__hash_state too small for XXH3_state_t");
_Static_assert(_Alignof(XXH3_state_t) <= _Alignof(kvf__hash_state), "kvf__hash_state under-aligned");

uint64_t kvf__hash64(const void *data, size_t len) { return (uint64_t)XXH3_64bits(data, len); }

uint64_t kvf__hash_str(const char *s, uint64_t seed) {
  return (uint64_t)XXH3_64bits_withSeed(s ? s : "", s ? strlen(s) : 0, (XXH64_hash_t)seed);
}

void kvf__hash_begin(kvf__hash_state *st) { XXH3_64bits_reset((XXH3_state_t *)(void *)st->opaque); }

void kvf__hash_update(kvf__hash_state *st, const void *data, size_t len) {
  if (len) XXH3_64bits_update((XXH3_state_t *)(void *)st->opaque, data, len);
}

uint64_t kvf__hash_end(const kvf__hash_state *st) {
  return (uint64_t)XXH3_64bits_digest((const XXH3_state_t *)(const void *)st->opaque);
}

uint64_t kvf__hash_block(uint64_t base, uint64_t len, uint64_t count, uint64_t stride) {
  if (count <= 1) return kvf__hash64((const void *)(uintptr_t)base, (size_t)len);
  kvf__hash_state st;
  kvf__hash_begin(&st);
  for (uint64_t i = 0; i < count; i++)
    kvf__hash_update(&st, (const void *)(uintptr_t)(base + i * stride), (size_t)len);
  return kvf__hash_end(&st);
}

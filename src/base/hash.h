/* Content digests for verify mode (issue 16): a thin wrapper over xxHash's
 * XXH3-64 from Debian's libxxhash-dev, so the rest of the library names one
 * function and the algorithm is chosen in one place. One-shot for a
 * contiguous run, streaming for a strided block (many pieces, one digest).
 * Pure functions, any thread; the streaming state lives on the caller's
 * stack (no allocation). Host memory only: reading device memory from the
 * CPU is undefined, which is why verify mode refuses it. */
#ifndef KVF_BASE_HASH_H
#define KVF_BASE_HASH_H

#include <stddef.h>
#include <stdint.h>

/* XXH3_64bits(data, len): the unseeded 64-bit XXH3 digest. len 0 is valid
 * (data may then be NULL). */
uint64_t kvf__hash64(const void *data, size_t len);

/* Streaming form: hash the concatenation of several pieces. The state is an
 * opaque, suitably aligned buffer (XXH3_state_t is 576 bytes, 64-aligned). */
typedef struct kvf__hash_state {
  _Alignas(64) unsigned char opaque[640];
} kvf__hash_state;

void kvf__hash_begin(kvf__hash_state *st);
void kvf__hash_update(kvf__hash_state *st, const void *data, size_t len);
uint64_t kvf__hash_end(const kvf__hash_state *st);

/* A string's XXH3-64 under `seed`: the one string hash for hash tables and
 * kvf__log_first_time keys. NULL hashes as "". */
uint64_t kvf__hash_str(const char *s, uint64_t seed);

/* Digest of a (possibly strided) block: count pieces of len bytes, piece i
 * at base + i*stride (count <= 1: one piece). Equals kvf__hash64 over the
 * pieces laid end to end. */
uint64_t kvf__hash_block(uint64_t base, uint64_t len, uint64_t count, uint64_t stride);

#endif

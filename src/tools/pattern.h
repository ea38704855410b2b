/* The byte pattern the demo, the engine peer and the tests use to prove that
 * every byte landed where it should: each 8-byte word is a hash of (seed,
 * page index, word index), so a page written to the wrong place, a stale
 * page or a torn page all show up. */
#ifndef KVF_CLI_PATTERN_H
#define KVF_CLI_PATTERN_H

#include <stdint.h>
#include <string.h>

static inline uint64_t pattern_word(uint64_t seed, uint64_t page, uint64_t word) {
  uint64_t z = seed ^ (page * 0x9e3779b97f4a7c15ULL) ^ (word * 0xbf58476d1ce4e5b9ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

/* Fill one page of `size` bytes (any size; a tail shorter than 8 is cut). */
static inline void pattern_fill(void *dst, uint64_t size, uint64_t seed, uint64_t page) {
  unsigned char *p = dst;
  uint64_t w = 0;
  for (; w * 8 + 8 <= size; w++) {
    uint64_t v = pattern_word(seed, page, w);
    memcpy(p + w * 8, &v, 8);
  }
  if (w * 8 < size) {
    uint64_t v = pattern_word(seed, page, w);
    memcpy(p + w * 8, &v, size - w * 8);
  }
}

/* 1 if the page holds exactly the pattern. */
static inline int pattern_check(const void *src, uint64_t size, uint64_t seed, uint64_t page) {
  const unsigned char *p = src;
  uint64_t w = 0;
  for (; w * 8 + 8 <= size; w++) {
    uint64_t v = pattern_word(seed, page, w), got;
    memcpy(&got, p + w * 8, 8);
    if (got != v) return 0;
  }
  if (w * 8 < size) {
    uint64_t v = pattern_word(seed, page, w);
    if (memcmp(p + w * 8, &v, size - w * 8)) return 0;
  }
  return 1;
}

#endif

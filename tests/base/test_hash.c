/* The verify-mode digest (base/hash.h) against xxHash's published XXH3-64
 * sanity vectors (xxHash tests/sanity_test_vectors.h, XSUM_XXH3_testdata,
 * seed 0 rows): the sanity buffer is generated as xxHash's own test does,
 * byte i = top byte of a PRIME32 * PRIME64^i sequence. Each vector is
 * checked one-shot, streamed in uneven pieces, and as a strided block. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "base/hash.h"

#define PRIME32 2654435761u
#define PRIME64 11400714785074694797ull
#define SANITY_LEN (4096 + 64 + 1)

static const struct {
  size_t len;
  uint64_t want;
} vectors[] = {
    {0, 0x2D06800538D394C2ull},    {1, 0xC44BDFF4074EECDBull},    {6, 0x27B56A84CD2D7325ull},
    {12, 0xA713DAF0DFBB77E7ull},   {24, 0xA3FE70BF9D3510EBull},   {48, 0x397DA259ECBA1F11ull},
    {80, 0xBCDEFBBB2C47C90Aull},   {195, 0xCD94217EE362EC3Aull},  {403, 0xCDEB804D65C6DEA4ull},
    {512, 0x617E49599013CB6Bull},  {2048, 0xDD59E2C3A5F038E0ull}, {2099, 0xC6B9D9B3FC9AC765ull},
    {2240, 0x6E73A90539CF2948ull}, {2367, 0xCB37AEB9E5D361EDull},
};

static unsigned char sanity[SANITY_LEN];

static int setup(void **state) {
  uint64_t gen = PRIME32;
  for (size_t i = 0; i < SANITY_LEN; i++) {
    sanity[i] = (unsigned char)(gen >> 56);
    gen *= PRIME64;
  }
  return 0;
}

static void one_shot_matches_published_vectors(void **state) {
  for (size_t i = 0; i < sizeof vectors / sizeof vectors[0]; i++)
    assert_true(kvf__hash64(vectors[i].len ? sanity : NULL, vectors[i].len) == vectors[i].want);
  assert_true(kvf__hash64(NULL, 0) == 0x2D06800538D394C2ull); /* the empty input */
}

static void streaming_in_pieces_matches(void **state) {
  for (size_t i = 0; i < sizeof vectors / sizeof vectors[0]; i++) {
    kvf__hash_state st;
    kvf__hash_begin(&st);
    size_t off = 0, step = 1;
    while (off < vectors[i].len) {
      size_t n = vectors[i].len - off < step ? vectors[i].len - off : step;
      kvf__hash_update(&st, sanity + off, n);
      off += n;
      step = step * 3 + 1;
    }
    assert_true(kvf__hash_end(&st) == vectors[i].want);
  }
}

static void strided_block_hashes_the_pieces_end_to_end(void **state) {
  /* 2048 bytes as 16 pieces of 128 spread with a 300-byte stride. */
  unsigned char *spread = calloc(16, 300);
  assert_non_null(spread);
  for (int k = 0; k < 16; k++) memcpy(spread + k * 300, sanity + k * 128, 128);
  assert_true(kvf__hash_block((uint64_t)(uintptr_t)spread, 128, 16, 300) == 0xDD59E2C3A5F038E0ull);
  assert_true(kvf__hash_block((uint64_t)(uintptr_t)sanity, 2048, 1, 0) == 0xDD59E2C3A5F038E0ull);
  spread[5 * 300 + 7] ^= 1; /* one flipped bit changes the digest */
  assert_true(kvf__hash_block((uint64_t)(uintptr_t)spread, 128, 16, 300) != 0xDD59E2C3A5F038E0ull);
  free(spread);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(one_shot_matches_published_vectors),
      cmocka_unit_test(streaming_in_pieces_matches),
      cmocka_unit_test(strided_block_hashes_the_pieces_end_to_end),
  };
  return cmocka_run_group_tests(tests, setup, NULL);
}

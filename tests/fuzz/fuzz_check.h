/* The fuzz targets' oracle: a failed check aborts, which libFuzzer (and
 * the corpus replays) report with the input. */
#ifndef KVF_FUZZ_CHECK_H
#define KVF_FUZZ_CHECK_H

#include <stdio.h>
#include <stdlib.h>

#define FUZZ_CHECK(cond)                                                          \
  do {                                                                            \
    if (!(cond)) {                                                                \
      fprintf(stderr, "oracle failed at %s:%d: %s\n", __FILE__, __LINE__, #cond); \
      abort();                                                                    \
    }                                                                             \
  } while (0)

#endif

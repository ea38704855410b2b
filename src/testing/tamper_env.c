/* The test build of the shared library (libkvferry-testhook.so, never
 * installed; tests/python points KVFERRY_LIB at it where a test needs it):
 * arms testing_corrupt_room from $KVFERRY_TEST_CORRUPT_ROOM when the library
 * loads. See tamper.h. */
#include <stdint.h>
#include <stdlib.h>

#include "testing/tamper.h"

__attribute__((constructor)) static void arm_from_env(void) {
  const char *c = getenv("KVFERRY_TEST_CORRUPT_ROOM");
  char *end = NULL;
  long long room = c && *c ? strtoll(c, &end, 10) : 0;
  if (c && *c && end && !*end) testing_corrupt_room((int64_t)room);
}

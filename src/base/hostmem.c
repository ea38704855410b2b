/* Readable host memory (hostmem.h). */
#include "base/hostmem.h"

#include <inttypes.h>

int kvf__maps_readable(FILE *maps, uint64_t a, uint64_t len) {
  uint64_t lo, hi, want = a;
  char perms[8];
  rewind(maps);
  while (want < a + len && fscanf(maps, "%" SCNx64 "-%" SCNx64 " %7s%*[^\n]", &lo, &hi, perms) == 3) {
    if (lo <= want && want < hi) {
      if (perms[0] != 'r') return 0;
      want = hi;
    }
  }
  return want >= a + len;
}

int kvf__host_readable(uint64_t a, uint64_t len) {
  FILE *maps = fopen("/proc/self/maps", "re");
  if (!maps) return -1;
  int rc = kvf__maps_readable(maps, a, len);
  fclose(maps);
  return rc;
}

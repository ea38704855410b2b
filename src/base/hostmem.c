/* Readable host memory (hostmem.h). */
#include "base/hostmem.h"

#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

/* Is [a, a + len) covered by readable mappings in `maps`, each a System V
 * segment too when `sysv`? */
static int maps_cover(FILE *maps, uint64_t a, uint64_t len, int sysv) {
  char *line = NULL;
  size_t cap = 0;
  uint64_t want = a;
  if (a + len < a) return 0; /* past the end of the address space */
  rewind(maps);
  while (want < a + len && getline(&line, &cap, maps) > 0) {
    uint64_t lo, hi;
    char perms[8];
    int path = 0; /* lo-hi perms offset dev inode, then the path (none: anonymous) */
    if (sscanf(line, "%" SCNx64 "-%" SCNx64 " %7s %*s %*s %*s %n", &lo, &hi, perms, &path) < 3) continue;
    if (lo <= want && want < hi) {
      if (perms[0] != 'r' || (sysv && (!path || perms[3] != 's' || strncmp(line + path, "/SYSV", 5)))) break;
      want = hi;
    }
  }
  free(line);
  return want >= a + len;
}

int kvf__maps_readable(FILE *maps, uint64_t a, uint64_t len) { return maps_cover(maps, a, len, 0); }

int kvf__maps_sysv_shared(FILE *maps, uint64_t a, uint64_t len) { return maps_cover(maps, a, len, 1); }

/* `check` over this process's maps; -1 when they cannot be read. */
static int self_maps(int (*check)(FILE *, uint64_t, uint64_t), uint64_t a, uint64_t len) {
  FILE *maps = fopen("/proc/self/maps", "re");
  if (!maps) return -1;
  int rc = check(maps, a, len);
  fclose(maps);
  return rc;
}

int kvf__host_readable(uint64_t a, uint64_t len) { return self_maps(kvf__maps_readable, a, len); }

int kvf__host_sysv_shared(uint64_t a, uint64_t len) { return self_maps(kvf__maps_sysv_shared, a, len); }

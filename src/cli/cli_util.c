/* Small helpers shared by the subcommands. */
#include <ctype.h>
#include <stdlib.h>
#include <unistd.h>

#include "cli.h"

/* "4096", "32K", "1M", "2G" (powers of 1024). */
int cli_parse_size(const char *s, unsigned long long *out) {
  char *end = NULL;
  if (!s || !isdigit((unsigned char)*s)) return -1;
  unsigned long long v = strtoull(s, &end, 10);
  switch (toupper((unsigned char)*end)) {
    case 'K': v <<= 10; end++; break;
    case 'M': v <<= 20; end++; break;
    case 'G': v <<= 30; end++; break;
    default: break;
  }
  if (*end == 'i' || *end == 'B') end++;
  if (*end == 'B') end++;
  if (*end) return -1;
  *out = v;
  return 0;
}

int cli_is_tty(void) { return isatty(STDOUT_FILENO) || isatty(STDERR_FILENO); }

/* tests/lib/procfs.h */
#include "procfs.h"

#include <dirent.h>
#include <sys/resource.h>

int kvf_test_count_threads(void) {
  DIR *d = opendir("/proc/self/task");
  if (!d) return -1;
  int n = 0;
  for (struct dirent *de; (de = readdir(d));) n += de->d_name[0] != '.';
  closedir(d);
  return n;
}

int kvf_test_raise_fd_limit(unsigned long need) {
  struct rlimit rl;
  if (getrlimit(RLIMIT_NOFILE, &rl)) return -1;
  if (rl.rlim_cur < need) {
    rl.rlim_cur = rl.rlim_max < need ? rl.rlim_max : need;
    setrlimit(RLIMIT_NOFILE, &rl);
  }
  return getrlimit(RLIMIT_NOFILE, &rl) || rl.rlim_cur < need ? -1 : 0;
}

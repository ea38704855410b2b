/* tests/lib/procfs.h */
#include "procfs.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

long kvf_test_thread_sleeps(const char *prefix, int *nthreads) {
  DIR *d = opendir("/proc/self/task");
  if (!d) return -1;
  long total = 0;
  int n = 0;
  for (struct dirent *de; (de = readdir(d));) {
    if (de->d_name[0] == '.') continue;
    char path[96], line[128], comm[32] = "";
    snprintf(path, sizeof path, "/proc/self/task/%.40s/comm", de->d_name);
    FILE *f = fopen(path, "r");
    if (!f) continue; /* the thread ended meanwhile */
    if (!fgets(comm, sizeof comm, f)) comm[0] = 0;
    fclose(f);
    if (strncmp(comm, prefix, strlen(prefix))) continue;
    snprintf(path, sizeof path, "/proc/self/task/%.40s/status", de->d_name);
    if (!(f = fopen(path, "r"))) continue;
    while (fgets(line, sizeof line, f))
      if (!strncmp(line, "voluntary_ctxt_switches:", 24)) total += strtol(line + 24, NULL, 10), n++;
    fclose(f);
  }
  closedir(d);
  if (nthreads) *nthreads = n;
  return total;
}

/* tests/lib/procfs.h */
#include "procfs.h"

#include <dirent.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <unistd.h>

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

/* The state letter of one /proc stat line: the field after the command,
 * which is in parentheses and may itself hold ") ". */
static char stat_state(const char *path) {
  char buf[512];
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = 0;
  const char *rp = strrchr(buf, ')');
  return rp && rp[1] == ' ' ? rp[2] : 0;
}

/* 1 when every thread of pid is stopped, 0 when one is not, -1 when the
 * process cannot be read. */
static int all_threads_stopped(int pid) {
  char dir[64];
  snprintf(dir, sizeof dir, "/proc/%d/task", pid);
  DIR *d = opendir(dir);
  if (!d) return -1;
  int all = 1, seen = 0;
  for (struct dirent *de; all && (de = readdir(d));) {
    if (de->d_name[0] == '.') continue;
    char path[128];
    snprintf(path, sizeof path, "%s/%.40s/stat", dir, de->d_name);
    char st = stat_state(path);
    if (!st) continue; /* the thread ended meanwhile */
    seen++;
    all = st == 'T' || st == 't';
  }
  closedir(d);
  return seen ? all : -1;
}

int kvf_test_wait_stopped(int pid, int timeout_ms) {
  for (int waited = 0; waited <= timeout_ms; waited++) {
    int r = all_threads_stopped(pid);
    if (r < 0) return -1;
    if (r) return 0;
    usleep(1000);
  }
  return -1;
}

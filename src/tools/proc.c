/* Child processes over pipes (see proc.h). */
#include "proc.h"

#include "util.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

int proc_start(proc *p, char *const argv[]) {
  if (!argv || !argv[0]) return -1; /* a command line that did not fit (pd_argv) */
  int in[2], out[2];
  if (pipe2(in, O_CLOEXEC)) return -1;
  if (pipe2(out, O_CLOEXEC)) {
    close(in[0]);
    close(in[1]);
    return -1;
  }
  pid_t pid = fork();
  if (pid < 0) {
    close(in[0]), close(in[1]), close(out[0]), close(out[1]);
    return -1;
  }
  if (pid == 0) {
    dup2(in[0], STDIN_FILENO);
    dup2(out[1], STDOUT_FILENO);
    execv(argv[0], argv);
    _exit(127);
  }
  close(in[0]);
  close(out[1]);
  p->pid = pid;
  p->in = fdopen(in[1], "w");
  p->out_fd = out[0];
  p->rlen = 0;
  if (!p->in) {
    close(out[0]);
    kill(pid, SIGKILL);
    waitpid(pid, NULL, 0);
    return -1;
  }
  return 0;
}

int proc_read_line(proc *p, char *buf, size_t cap, int timeout_ms) {
  long long until = cli_now_ms() + timeout_ms;
  for (;;) {
    char *nl = memchr(p->rbuf, '\n', p->rlen);
    if (nl || p->rlen == sizeof p->rbuf) {
      size_t len = nl ? (size_t)(nl - p->rbuf) : p->rlen;
      size_t copy = len < cap - 1 ? len : cap - 1;
      memcpy(buf, p->rbuf, copy);
      buf[copy] = 0;
      size_t used = nl ? len + 1 : len;
      memmove(p->rbuf, p->rbuf + used, p->rlen - used);
      p->rlen -= used;
      return 0;
    }
    /* Poll at least once, so a timeout of 0 still takes what is there. */
    long long left = until - cli_now_ms();
    struct pollfd pf = {.fd = p->out_fd, .events = POLLIN};
    int r = poll(&pf, 1, left > 0 ? (int)left : 0);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) return -1;
    ssize_t k = read(p->out_fd, p->rbuf + p->rlen, sizeof p->rbuf - p->rlen);
    if (k < 0 && errno == EINTR) continue;
    if (k <= 0) return -1;
    p->rlen += (size_t)k;
  }
}

int proc_ask(proc *p, const char *line, char *reply, size_t cap, int timeout_ms) {
  if (fprintf(p->in, "%s\n", line) < 0 || fflush(p->in)) return -1;
  return proc_read_line(p, reply, cap, timeout_ms);
}

int proc_stop(proc *p, int timeout_ms) {
  if (p->in) fclose(p->in);
  p->in = NULL;
  int status = -1;
  long long until = cli_now_ms() + timeout_ms;
  for (;;) {
    pid_t r = waitpid(p->pid, &status, WNOHANG);
    if (r == p->pid) break;
    if (r < 0) {
      status = -1;
      break;
    }
    if (cli_now_ms() >= until) {
      kill(p->pid, SIGKILL);
      kill(p->pid, SIGCONT);
      waitpid(p->pid, &status, 0);
      break;
    }
    usleep(5000);
  }
  if (p->out_fd >= 0) close(p->out_fd);
  p->out_fd = -1;
  return status;
}

const char *proc_self_exe(void) {
  static char path[4096];
  ssize_t n = readlink("/proc/self/exe", path, sizeof path - 1);
  if (n <= 0) return "kvferry";
  path[n] = 0;
  return path;
}

/* dir(path) + "/kvferry-testpeer" into out, when that file is executable. */
static int testpeer_beside(const char *path, char *out, size_t cap) {
  const char *slash = path ? strrchr(path, '/') : NULL;
  if (!slash) return -1;
  int n = snprintf(out, cap, "%.*s/kvferry-testpeer", (int)(slash - path), path);
  return n > 0 && (size_t)n < cap && access(out, X_OK) == 0 ? 0 : -1;
}

const char *proc_testpeer_exe(void) {
  static char path[4096];
  const char *env = getenv("KVFERRY_TESTPEER");
  if (env && *env) return env;
  if (testpeer_beside(proc_self_exe(), path, sizeof path) == 0) return path;
  if (testpeer_beside(getenv("KVFERRY_CLI"), path, sizeof path) == 0) return path;
  return "kvferry-testpeer"; /* execv fails: the caller reports that the peer did not start */
}

/* "/proc/PID/leaf", or "/proc/self/leaf" for pid 0. */
static void proc_path(char *out, size_t cap, pid_t pid, const char *leaf) {
  if (pid) snprintf(out, cap, "/proc/%d/%s", (int)pid, leaf);
  else snprintf(out, cap, "/proc/self/%s", leaf);
}

int proc_usage_get(pid_t pid, proc_usage *u) {
  char path[64], line[256];
  proc_usage v = {.threads = -1, .rss_kb = -1};
  proc_path(path, sizeof path, pid, "status");
  FILE *f = fopen(path, "r");
  if (!f) return -1;
  while (fgets(line, sizeof line, f)) {
    if (!strncmp(line, "Threads:", 8)) v.threads = strtol(line + 8, NULL, 10);
    else if (!strncmp(line, "VmRSS:", 6)) v.rss_kb = strtol(line + 6, NULL, 10);
    else if (!strncmp(line, "RssAnon:", 8)) v.rss_anon_kb = strtol(line + 8, NULL, 10);
    else if (!strncmp(line, "RssShmem:", 9)) v.rss_shmem_kb = strtol(line + 9, NULL, 10);
    else if (!strncmp(line, "RssFile:", 8)) v.rss_file_kb = strtol(line + 8, NULL, 10);
  }
  fclose(f);
  proc_path(path, sizeof path, pid, "fd");
  DIR *d = opendir(path);
  if (!d) return -1;
  for (struct dirent *e; (e = readdir(d));)
    if (e->d_name[0] != '.') v.fds++;
  closedir(d);
  if (!pid) v.fds--; /* the one opendir holds */
  if (v.threads < 0 || v.rss_kb < 0) return -1;
  *u = v;
  return 0;
}

/* One /proc stat file: CPU time (utime + stime) in ns and, when `name`,
 * the command name (up to 15 bytes); -1 when unreadable. */
static long long stat_cpu_ns(const char *path, char *name, size_t cap) {
  char buf[1024];
  FILE *f = fopen(path, "r");
  if (!f) return -1;
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = 0;
  /* Fields after the command name (which may hold spaces, in parentheses):
   * state is the 3rd field; utime and stime the 14th and 15th. */
  const char *open = strchr(buf, '('), *p = strrchr(buf, ')');
  unsigned long long ut = 0, st = 0;
  if (!open || !p || p < open ||
      sscanf(p + 1, " %*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut, &st) != 2)
    return -1;
  if (name) snprintf(name, cap, "%.*s", (int)(p - open - 1), open + 1);
  long hz = sysconf(_SC_CLK_TCK);
  return hz > 0 ? (long long)((ut + st) * (1000000000ull / (unsigned long long)hz)) : -1;
}

long long proc_cpu_ns(pid_t pid) {
  char path[64];
  proc_path(path, sizeof path, pid, "stat");
  return stat_cpu_ns(path, NULL, 0);
}

int proc_threads_cpu_get(pid_t pid, proc_threads_cpu *out) {
  char dir[64], path[64 + sizeof((struct dirent *)0)->d_name + 8];
  proc_path(dir, sizeof dir, pid, "task");
  DIR *d = opendir(dir);
  if (!d) return -1;
  out->n = 0;
  for (struct dirent *e; (e = readdir(d));) {
    if (e->d_name[0] == '.') continue;
    char name[PROC_THREAD_NAME_LEN];
    snprintf(path, sizeof path, "%s/%s/stat", dir, e->d_name);
    long long ns = stat_cpu_ns(path, name, sizeof name);
    if (ns < 0) continue; /* ended meanwhile */
    size_t i = 0;
    while (i < out->n && strcmp(out->t[i].name, name)) i++;
    if (i == out->n) {
      if (out->n == PROC_THREAD_NAMES_MAX) continue;
      snprintf(out->t[out->n].name, sizeof out->t[out->n].name, "%s", name);
      out->t[out->n++].ns = 0;
    }
    out->t[i].ns += ns;
  }
  closedir(d);
  return 0;
}

long long proc_cpu_exact_ns(pid_t pid) {
  clockid_t clk;
  struct timespec ts;
  if (clock_getcpuclockid(pid ? pid : getpid(), &clk) || clock_gettime(clk, &ts)) return -1;
  return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

/* Child processes driven over pipes: the demo, the benchmarks and the tests
 * start peers (`kvferry-testpeer engine-peer`, managers, a bootstrap server) as real
 * processes and talk to them line by line. */
#ifndef KVF_CLI_PROC_H
#define KVF_CLI_PROC_H

#include <stdio.h>
#include <sys/types.h>

typedef struct proc {
  pid_t pid;
  FILE *in;   /* child's stdin */
  int out_fd; /* child's stdout */
  char rbuf[4096];
  size_t rlen; /* bytes read but not yet returned as lines */
} proc;

/* Start argv[0] (a path) with argv; stderr is inherited. 0 or -1. */
int proc_start(proc *p, char *const argv[]);
/* Read one line (without '\n') into buf, waiting at most timeout_ms.
 * 0 on success, -1 on EOF, error or timeout. */
int proc_read_line(proc *p, char *buf, size_t cap, int timeout_ms);
/* Send a line and read the one-line answer. */
int proc_ask(proc *p, const char *line, char *reply, size_t cap, int timeout_ms);
/* Close stdin and wait up to timeout_ms for a clean exit, then SIGKILL.
 * Returns the exit status as from waitpid, or -1. */
int proc_stop(proc *p, int timeout_ms);
/* Path of the running executable, for re-launching kvferry itself. */
const char *proc_self_exe(void);
/* Path of the test peer (kvferry-testpeer: kv-peer, kv-decode,
 * engine-peer): $KVFERRY_TESTPEER, else the one next to the running
 * executable, else the one next to $KVFERRY_CLI (the build tree). Not
 * reentrant with itself (a static buffer); any thread otherwise. */
const char *proc_testpeer_exe(void);

/* What a process holds, from /proc/<pid>: threads (status Threads), open
 * descriptors (entries of fd/) and resident memory (status VmRSS, KiB),
 * split as status has it: private memory (RssAnon), pages of shared memory
 * mapped in (RssShmem: another process's pool the engine reads, counted in
 * both) and of files (RssFile: libraries). */
typedef struct proc_usage {
  long threads, fds, rss_kb;
  long rss_anon_kb, rss_shmem_kb, rss_file_kb;
} proc_usage;
/* pid 0 = this process. 0 or -1 (the process is gone or /proc unreadable). */
int proc_usage_get(pid_t pid, proc_usage *u);
/* CPU time (user + system, every thread) the process has used, in ns; pid
 * 0 = this process. -1 when /proc cannot say. */
long long proc_cpu_ns(pid_t pid);

/* CPU time of a process's live threads, summed by thread name (what
 * pthread_setname_np set: "kvf-pool-work", "ZMQbg/IO/0", the process's own
 * name for its main thread); pid 0 = this process. Threads that ended are
 * not in it (proc_cpu_ns counts them). At most PROC_THREAD_NAMES_MAX names;
 * the rest are left out. 0 or -1. */
#define PROC_THREAD_NAMES_MAX 32
#define PROC_THREAD_NAME_LEN 16
typedef struct proc_threads_cpu {
  size_t n;
  struct {
    char name[PROC_THREAD_NAME_LEN];
    long long ns;
  } t[PROC_THREAD_NAMES_MAX];
} proc_threads_cpu;
int proc_threads_cpu_get(pid_t pid, proc_threads_cpu *out);

/* CPU time (user + system, every thread, ended ones too) the process has
 * used, in ns, from its CPU-time clock (clock_getcpuclockid): exact where
 * proc_cpu_ns counts clock ticks (10 ms here), for a figure over a short
 * window. pid 0 = this process. -1 when the clock cannot be read. */
long long proc_cpu_exact_ns(pid_t pid);

#endif

/* What the tests read about their own process: threads (and how often
 * they sleep), and a descriptor
 * limit raised for tests that open thousands of sockets. Linked into every
 * test program (tests/CMakeLists.txt, kvf_test_case). */
#ifndef KVF_TESTS_LIB_PROCFS_H
#define KVF_TESTS_LIB_PROCFS_H

/* Threads of this process (/proc/self/task), or -1. */
int kvf_test_count_threads(void);
/* Raise RLIMIT_NOFILE's soft limit to at least `need` (within the hard
 * limit): 0 when the process may now open `need` descriptors, else -1 (the
 * test should skip: the limit, not the library, would refuse). */
int kvf_test_raise_fd_limit(unsigned long need);
/* The voluntary context switches (each sleep that ended counts one) of
 * this process's threads whose name starts with `prefix` (the library's
 * are "kvf-", src/base/thread.h), summed; how many such threads in
 * *nthreads. -1 when /proc cannot be read. */
long kvf_test_thread_sleeps(const char *prefix, int *nthreads);
/* kill(pid, SIGSTOP) returns before the process has stopped: the stop is
 * taken by one of its threads when it next runs, which then stops the
 * others, and on a loaded machine another thread may meanwhile answer a
 * peer. Wait (up to timeout_ms) until every thread of `pid` is stopped
 * (/proc/<pid>/task/<tid>/stat state T or t): 0 then, -1 at the timeout. */
int kvf_test_wait_stopped(int pid, int timeout_ms);

#endif

/* Thread names: every thread the library starts names itself (at most 15
 * characters, as Linux keeps them) so that `top -H`, gdb, /proc/PID/task/
 * TID/comm and `kvferry bench peers` show which part of kvferry it is.
 * The names, by file:
 *   kvf-listen     kv/control.c     a manager's control listener (ZeroMQ PULL)
 *   kvf-xfer       kv/prefill       a prefill's transfer worker (kvf-xfer-more: an extra one
 *                                   while the others wait on slow destinations, workers.c)
 *   kvf-hb         kv/decode        a decode's heartbeat (kvf-hb-probe: a round's probes)
 *   kvf-trace      kv/trace.c       the KVFERRY_TRACE file writer
 *   kvf-tcp-accept engine/tcp.c     the TCP engine's listener
 *   kvf-tcp-write  engine/tcp_out.c an outgoing TCP connection's sender
 *   kvf-tcp-ack    engine/tcp_out.c an outgoing TCP connection's acknowledgement reader
 *   kvf-connect    engine/connector.c  connects a session for submits queued on it (ends when done)
 *   kvf-pool-ev    engine/evpool.c  a connection pool's event thread (kvf-pool-work: its workers)
 *   kvf-ucx-prog   engine/ucx.c     the UCX engine's progress thread
 *   kvf-ucx-copy   engine/ucx_write.c  a copier of stores into a mapped pool
 *   kvf-ucx-warm   engine/ucx_warm.c   maps same-host writers' pools ahead of reads (ends when done)
 *   kvf-bs-guard   bootstrap/server.c  the bootstrap server's deadline guard */
#ifndef KVF_BASE_THREAD_H
#define KVF_BASE_THREAD_H

#include <pthread.h>

#include "kvferry/common.h"

/* Name the calling thread (longer names are cut to 15 characters). */
static inline void kvf__thread_name(const char *name) {
  char n[16];
  size_t i = 0;
  for (; name[i] && i < sizeof n - 1; i++) n[i] = name[i];
  n[i] = 0;
  pthread_setname_np(pthread_self(), n);
}

/* Start fn(arg) on a detached thread (it ends on its own; whoever waits for
 * it counts it). 0 or KVF_ENOMEM. */
static inline int kvf__thread_start_detached(void *(*fn)(void *), void *arg) {
  pthread_attr_t at;
  pthread_t t;
  pthread_attr_init(&at);
  pthread_attr_setdetachstate(&at, PTHREAD_CREATE_DETACHED);
  int rc = pthread_create(&t, &at, fn, arg);
  pthread_attr_destroy(&at);
  return rc ? KVF_ENOMEM : 0;
}

#endif

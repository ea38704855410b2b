/* Thread wake-up counter: every library thread that returns from a blocking
 * wait (condvar, poll, a socket read with a tick) with work in hand counts
 * one wake-up here, so benchmarks can report wake-ups per room
 * (`kvferry bench rooms`: wakeups_per_room; kvf_wakeups reads it). One process-wide relaxed atomic:
 * a counter, not a synchronisation point. ZeroMQ's own I/O threads are not
 * counted (they are libzmq's). */
#ifndef KVF_BASE_WAKE_H
#define KVF_BASE_WAKE_H

#include <stdatomic.h>
#include <stdint.h>

extern atomic_ullong kvf__wakeups;

/* Count one wake-up with work. Any thread. */
static inline void kvf__wake_count(void) { atomic_fetch_add_explicit(&kvf__wakeups, 1, memory_order_relaxed); }

/* The total so far is public: kvf_wakeups (kvferry/common.h). */

#endif

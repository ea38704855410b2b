/* Monotonic and wall clocks in one place, so deadlines read the same way
 * everywhere: a deadline is an absolute monotonic time in nanoseconds. */
#ifndef KVF_BASE_CLOCK_H
#define KVF_BASE_CLOCK_H

#include <stdint.h>
#include <time.h>

static inline int64_t clock_now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

static inline double clock_wall_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* Absolute CLOCK_MONOTONIC timespec for pthread_cond_timedwait on a condvar
 * created with clock_cond_init. */
static inline struct timespec clock_ts_from_ns(int64_t ns) {
  struct timespec ts = {.tv_sec = ns / 1000000000LL, .tv_nsec = ns % 1000000000LL};
  return ts;
}

static inline int64_t clock_deadline_ms(int ms) { return clock_now_ns() + (int64_t)ms * 1000000LL; }

#include <pthread.h>
/* A condition variable that waits on CLOCK_MONOTONIC. */
static inline int clock_cond_init(pthread_cond_t *c) {
  pthread_condattr_t a;
  pthread_condattr_init(&a);
  pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
  int rc = pthread_cond_init(c, &a);
  pthread_condattr_destroy(&a);
  return rc;
}

#endif

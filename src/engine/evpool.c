/* The event thread and worker pool of evpool.h. */
#include "engine/evpool.h"

#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include "base/clock.h"
#include "base/log.h"
#include "base/thread.h"
#include "kvferry/common.h"

#define EVPOOL_RETRY_MS 100 /* a failed worker start is tried again this often while items wait */

typedef struct evpool_worker {
  struct evpool_worker *next;
  evpool *p;
  pthread_t thread;
  int ended; /* under mu */
} evpool_worker;

struct evpool {
  evpool_ops ops;
  void *arg;
  int core, retire_ms, tick_ms;
  int epfd, wake_fd;
  pthread_t thread;
  atomic_int stopping;
  atomic_int tick_on; /* the tick is wanted (an item was added, or the last tick asked again) */
  pthread_mutex_t mu;
  pthread_cond_t cv;   /* an item was queued, or stop */
  pthread_cond_t done; /* a worker ended */
  evpool_item *q_head, *q_tail;
  int nqueued;
  evpool_worker *workers; /* running or ended, not joined yet */
  int nworkers, nidle;
  int start_failed; /* the last worker start failed (under mu) */
  int starved;      /* items queued, no worker (event thread only) */
};

/* Under mu: wait for the item's next bytes (or close). */
static int arm_locked(evpool *p, evpool_item *it) {
  struct epoll_event ev = {.events = EPOLLIN | EPOLLRDHUP | EPOLLONESHOT, .data.ptr = it};
  return epoll_ctl(p->epfd, EPOLL_CTL_ADD, it->fd, &ev) ? KVF_EIO : 0;
}

static void wake(evpool *p) {
  uint64_t one = 1;
  ssize_t r = write(p->wake_fd, &one, sizeof one); /* fails only when a wake is pending already */
  (void)r;
}

static void *worker_main(void *arg) {
  kvf__thread_name("kvf-pool-work");
  evpool_worker *w = arg;
  evpool *p = w->p;
  pthread_mutex_lock(&p->mu);
  for (;;) {
    evpool_item *it = p->q_head;
    if (!it) {
      if (atomic_load(&p->stopping)) break;
      p->nidle++;
      int to = 0;
      if (p->nworkers > p->core) { /* one past the core retires when idle */
        struct timespec ts = clock_ts_from_ns(clock_deadline_ms(p->retire_ms));
        to = pthread_cond_timedwait(&p->cv, &p->mu, &ts) == ETIMEDOUT;
      } else {
        pthread_cond_wait(&p->cv, &p->mu);
      }
      p->nidle--;
      if (to && !p->q_head && p->nworkers > p->core) break;
      continue;
    }
    p->q_head = it->qnext;
    if (!p->q_head) p->q_tail = NULL;
    p->nqueued--;
    /* Out of the set while held: the turn may close or hand on the socket. */
    epoll_ctl(p->epfd, EPOLL_CTL_DEL, it->fd, NULL);
    pthread_mutex_unlock(&p->mu);
    int rc = p->ops.turn(p->arg, it);
    pthread_mutex_lock(&p->mu);
    if (rc || atomic_load(&p->stopping) || arm_locked(p, it)) {
      pthread_mutex_unlock(&p->mu);
      p->ops.end(p->arg, it);
      pthread_mutex_lock(&p->mu);
    }
  }
  p->nworkers--;
  w->ended = 1;
  pthread_cond_broadcast(&p->done);
  pthread_mutex_unlock(&p->mu);
  wake(p); /* the event thread joins it */
  return NULL;
}

/* Under mu: join the workers that ended. */
static void join_ended_locked(evpool *p) {
  for (evpool_worker **pp = &p->workers; *pp;) {
    evpool_worker *w = *pp;
    if (!w->ended) {
      pp = &w->next;
      continue;
    }
    *pp = w->next;
    pthread_join(w->thread, NULL); /* it only returns from here on */
    free(w);
  }
}

/* Under mu: start one more worker; 0, or -1 (logged once in a row). */
static int start_worker_locked(evpool *p) {
  evpool_worker *w = calloc(1, sizeof *w);
  if (w) {
    w->p = p;
    if (pthread_create(&w->thread, NULL, worker_main, w)) {
      free(w);
      w = NULL;
    }
  }
  if (!w) {
    if (!p->start_failed)
      LOG_WARN("engine", "cannot start a connection worker; %s (every %d ms while none runs)",
               p->nworkers ? "the running ones take the connection" : "trying again", EVPOOL_RETRY_MS);
    p->start_failed = 1;
    return -1;
  }
  p->start_failed = 0;
  w->next = p->workers;
  p->workers = w;
  p->nworkers++;
  return 0;
}

/* Under mu: queue an item with work; start a worker when every idle one
 * already has a queued item to take. */
static void queue_locked(evpool *p, evpool_item *it) {
  it->qnext = NULL;
  if (p->q_tail) p->q_tail->qnext = it;
  else p->q_head = it;
  p->q_tail = it;
  p->nqueued++;
  if (p->nidle < p->nqueued) start_worker_locked(p);
  pthread_cond_signal(&p->cv);
}

static void *event_main(void *arg) {
  kvf__thread_name("kvf-pool-ev");
  evpool *p = arg;
  struct epoll_event ev[64];
  int64_t next_tick = clock_now_ns();
  while (!atomic_load(&p->stopping)) {
    int ticking = p->ops.tick && atomic_load(&p->tick_on);
    int64_t left = (next_tick - clock_now_ns()) / 1000000;
    int wait_ms = !ticking ? -1 : left < 0 ? 0 : (int)left + 1;
    /* Items queued and no worker to take them (starting one failed): try
     * again soon rather than wait for bytes that already came. */
    if (p->starved && (wait_ms < 0 || wait_ms > EVPOOL_RETRY_MS)) wait_ms = EVPOOL_RETRY_MS;
    int n = epoll_wait(p->epfd, ev, 64, wait_ms);
    pthread_mutex_lock(&p->mu);
    for (int i = 0; i < n; i++) {
      if (ev[i].data.ptr == p) {
        uint64_t v;
        ssize_t r = read(p->wake_fd, &v, sizeof v);
        (void)r;
      } else {
        queue_locked(p, ev[i].data.ptr);
      }
    }
    join_ended_locked(p);
    if (p->nqueued && !p->nworkers) start_worker_locked(p);
    p->starved = p->nqueued && !p->nworkers;
    pthread_mutex_unlock(&p->mu);
    if (ticking && clock_now_ns() >= next_tick) {
      /* Cleared first: an add during the tick sets it again. */
      atomic_store(&p->tick_on, 0);
      if (p->ops.tick(p->arg)) atomic_store(&p->tick_on, 1);
      next_tick = clock_deadline_ms(p->tick_ms);
    }
  }
  return NULL;
}

int kvf__evpool_start(const evpool_ops *ops, void *arg, int core, int retire_ms, int tick_ms, evpool **out) {
  evpool *p = calloc(1, sizeof *p);
  if (!p) return KVF_ENOMEM;
  p->ops = *ops;
  p->arg = arg;
  p->core = core;
  p->retire_ms = retire_ms;
  p->tick_ms = tick_ms;
  pthread_mutex_init(&p->mu, NULL);
  clock_cond_init(&p->cv);
  pthread_cond_init(&p->done, NULL);
  int rc = KVF_EIO;
  p->epfd = epoll_create1(EPOLL_CLOEXEC);
  p->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  struct epoll_event wev = {.events = EPOLLIN, .data.ptr = p};
  if (p->epfd < 0 || p->wake_fd < 0 || epoll_ctl(p->epfd, EPOLL_CTL_ADD, p->wake_fd, &wev)) {
    LOG_ERROR("engine", "connection pool: epoll setup: %s", strerror(errno));
    goto err;
  }
  rc = KVF_ENOMEM;
  if (pthread_create(&p->thread, NULL, event_main, p)) goto err;
  *out = p;
  return 0;
err:
  if (p->epfd >= 0) close(p->epfd);
  if (p->wake_fd >= 0) close(p->wake_fd);
  pthread_mutex_destroy(&p->mu);
  pthread_cond_destroy(&p->cv);
  pthread_cond_destroy(&p->done);
  free(p);
  return rc;
}

int kvf__evpool_add(evpool *p, evpool_item *it) {
  pthread_mutex_lock(&p->mu);
  int rc = atomic_load(&p->stopping) ? KVF_ESTATE : arm_locked(p, it);
  pthread_mutex_unlock(&p->mu);
  if (!rc && p->ops.tick && !atomic_exchange(&p->tick_on, 1)) wake(p); /* its deadline is watched from now */
  return rc;
}

void kvf__evpool_stop(evpool *p) {
  if (!p) return;
  pthread_mutex_lock(&p->mu);
  atomic_store(&p->stopping, 1);
  pthread_cond_broadcast(&p->cv);
  pthread_mutex_unlock(&p->mu);
  wake(p);
  pthread_join(p->thread, NULL);
  pthread_mutex_lock(&p->mu);
  /* Queued items no worker will take (none could start): the caller's. */
  if (!p->nworkers) p->q_head = p->q_tail = NULL, p->nqueued = 0;
  while (p->nworkers) pthread_cond_wait(&p->done, &p->mu);
  join_ended_locked(p);
  pthread_mutex_unlock(&p->mu);
  close(p->epfd);
  close(p->wake_fd);
  pthread_mutex_destroy(&p->mu);
  pthread_cond_destroy(&p->cv);
  pthread_cond_destroy(&p->done);
  free(p);
}

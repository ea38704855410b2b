/* Connections that are idle most of the time, served without a thread each:
 * one event thread waits on their sockets (epoll, one-shot), and when bytes
 * (or the peer's close) arrive on one, a worker from a pool takes it and
 * runs the owner's `turn`, which may block on that connection under its own
 * deadlines (a slow peer holds one worker, never the others), then parks
 * it again or ends it. Workers start on demand (one per connection with
 * work, at most); beyond `core`, one idle for `retire_ms` ends. While a
 * worker holds a connection its socket is out of the epoll set, so the
 * owner may close it or hand it on from `turn`.
 *
 * Threads: the owner adds items from any thread; turn, end and tick run on
 * the pool's threads. Whatever a turn did to its item happens before the
 * next turn of that item (they are handed over under the pool's lock). */
#ifndef KVF_ENGINE_EVPOOL_H
#define KVF_ENGINE_EVPOOL_H

#include <pthread.h>
#include <stdatomic.h>

typedef struct evpool_item {
  struct evpool_item *qnext; /* on the workers' queue (pool's lock) */
  int fd;
} evpool_item;

typedef struct evpool_ops {
  /* A worker holds the item: 0 parks it again, anything else ends it (end
   * is called next, by this worker). */
  int (*turn)(void *arg, evpool_item *it);
  /* The pool is done with the item (a turn ended it, or parking failed). */
  void (*end)(void *arg, evpool_item *it);
  /* Optional, on the event thread every tick_ms at least while it returns
   * nonzero (an item still has a deadline to watch), and again after each
   * kvf__evpool_add: deadlines of parked items (shutting one's socket down
   * wakes it to a worker). With nothing to watch the pool sleeps until
   * bytes arrive: an idle pool costs no wake-ups. */
  int (*tick)(void *arg);
} evpool_ops;

typedef struct evpool evpool;

/* Start the event thread (its workers start on demand). 0, KVF_EIO or
 * KVF_ENOMEM; *out is the caller's, for kvf__evpool_stop. */
int kvf__evpool_start(const evpool_ops *ops, void *arg, int core, int retire_ms, int tick_ms, evpool **out);
/* Park an item whose socket is set (from any thread); the pool owns it
 * until its end. KVF_ESTATE once stopping (the caller keeps it). */
int kvf__evpool_add(evpool *p, evpool_item *it);
/* Stop the event thread and wait for the workers: the caller first cut the
 * items' sockets so their turns end. Items still parked or queued are the
 * caller's again (end is not called for them). Frees the pool. */
void kvf__evpool_stop(evpool *p);

#endif

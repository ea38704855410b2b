/* Submits that must connect first. kvf_engine_submit never blocks on the
 * network: a batch to a session whose connections are made goes to the
 * transport on the caller's thread; a batch that would have to connect
 * (the first to a peer, or after its connection failed) is queued to that
 * session's connector thread, which makes the connection (bounded by the
 * batch's deadline) and hands the queue over in order. A peer that never
 * answers its connect or handshake (a stopped process, a host that drops
 * packets) then holds only its own connector, never the scheduler that
 * submitted, nor the batches to other peers.
 *
 * Also here: the deadline-bound socket waits that connects and handshakes
 * use (kvf__fd_wait and the two loops around it); on a connector thread
 * they look at the engine's stop flag every slice, so a stopping engine
 * never waits out a connect. */
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "base/clock.h"
#include "base/log.h"
#include "base/thread.h"
#include "base/parse.h"
#include "engine/engine_internal.h"

/* Sessions connecting at once, each with its own thread. Past it a submit
 * that must connect does so on the caller's thread (logged once). */
#define ENGINE_MAX_CONNECTORS 128

/* A connector thread's engine stop flag (NULL on every other thread). */
static _Thread_local const atomic_int *connect_stop;
/* This thread may wait on the network in a transport's submit: a connector
 * thread, or a submit past ENGINE_MAX_CONNECTORS. */
static _Thread_local int may_block;

int kvf__fd_wait(int fd, short ev, int64_t deadline_ns) {
  for (;;) {
    if (connect_stop && atomic_load(connect_stop)) return KVF_ECLOSED;
    int64_t left = (deadline_ns - clock_now_ns()) / 1000000;
    if (left <= 0) return KVF_ETIMEDOUT;
    if (connect_stop && left > KVF__CONNECT_SLICE_MS) left = KVF__CONNECT_SLICE_MS;
    struct pollfd pf = {.fd = fd, .events = ev};
    int r = poll(&pf, 1, (int)left);
    if (r > 0) return 0;
    if (r < 0 && errno != EINTR) return KVF_EIO;
  }
}

int kvf__fd_send_all(int fd, const void *buf, size_t len, int64_t deadline_ns) {
  const char *p = buf;
  while (len) {
    ssize_t r = send(fd, p, len, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (r > 0) {
      p += r;
      len -= (size_t)r;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      int rc = kvf__fd_wait(fd, POLLOUT, deadline_ns);
      if (rc) return rc;
    } else if (errno != EINTR) {
      return KVF_ECLOSED;
    }
  }
  return 0;
}

int kvf__fd_recv_all(int fd, void *buf, size_t len, int64_t deadline_ns) {
  char *p = buf;
  while (len) {
    ssize_t r = recv(fd, p, len, MSG_DONTWAIT);
    if (r > 0) {
      p += r;
      len -= (size_t)r;
    } else if (r == 0) {
      return KVF_ECLOSED;
    } else if (errno == EAGAIN || errno == EWOULDBLOCK) {
      int rc = kvf__fd_wait(fd, POLLIN, deadline_ns);
      if (rc) return rc;
    } else if (errno != EINTR) {
      return KVF_ECLOSED;
    }
  }
  return 0;
}

/* One batch waiting for its session's connection. */
typedef struct connect_job {
  struct connect_job *next;
  size_t n;
  chunk *chunks[];
} connect_job;

/* A session being connected: its queue, in submit order. */
typedef struct engine_connector {
  struct engine_connector *next;
  kvf_engine *e;
  char session[KVF_ADDR_LEN];
  connect_job *head, *tail;
} engine_connector;

static engine_connector *connector_find_locked(kvf_engine *e, const char *session) {
  for (engine_connector *k = e->connectors; k; k = k->next)
    if (!strcmp(k->session, session)) return k;
  return NULL;
}

static void connector_unlink_locked(kvf_engine *e, engine_connector *k) {
  for (engine_connector **pp = &e->connectors; *pp; pp = &(*pp)->next) {
    if (*pp == k) {
      *pp = k->next;
      return;
    }
  }
}

static void job_fail(connect_job *j, int err) {
  for (size_t i = 0; i < j->n; i++) kvf__chunk_finish(j->chunks[i], err);
  free(j);
}

/* Hand the queue to the transport in order: the first submit connects (on
 * this thread), the next find the connection made. A failed connect fails
 * that batch; the next one tries again within its own deadline. The thread
 * ends when the queue is empty, and with it the session's record, so later
 * submits go straight to the transport. */
static void *connector_main(void *arg) {
  engine_connector *k = arg;
  kvf_engine *e = k->e;
  kvf__thread_name("kvf-connect");
  connect_stop = &e->connect_stop;
  may_block = 1;
  for (;;) {
    pthread_mutex_lock(&e->conn_mu);
    connect_job *j = k->head;
    if (j) {
      k->head = j->next;
      if (!k->head) k->tail = NULL;
    } else {
      connector_unlink_locked(e, k);
      atomic_fetch_sub(&e->nconnectors, 1);
      pthread_cond_broadcast(&e->conn_cv);
    }
    pthread_mutex_unlock(&e->conn_mu);
    if (!j) break;
    int rc = atomic_load(&e->connect_stop) ? KVF_ECLOSED : e->ops->submit(e, k->session, j->chunks, j->n);
    if (rc) job_fail(j, rc);
    else free(j);
  }
  free(k);
  return NULL;
}

static connect_job *job_new(chunk **chunks, size_t n) {
  connect_job *j = malloc(sizeof *j + n * sizeof *chunks);
  if (!j) return NULL;
  j->next = NULL;
  j->n = n;
  memcpy(j->chunks, chunks, n * sizeof *chunks);
  return j;
}

/* Queue the batch to the session's connector, starting one if none runs.
 * 0, or KVF_ENOMEM (nothing queued), or 1: the connectors are all busy. */
static int connector_queue(kvf_engine *e, const char *session, chunk **chunks, size_t nchunks) {
  pthread_mutex_lock(&e->conn_mu);
  engine_connector *k = connector_find_locked(e, session);
  if (!k && atomic_load(&e->nconnectors) >= ENGINE_MAX_CONNECTORS) {
    pthread_mutex_unlock(&e->conn_mu);
    return 1;
  }
  connect_job *j = job_new(chunks, nchunks);
  if (!j) {
    pthread_mutex_unlock(&e->conn_mu);
    return KVF_ENOMEM;
  }
  if (k) {
    if (k->tail) k->tail->next = j;
    else k->head = j;
    k->tail = j;
    pthread_mutex_unlock(&e->conn_mu);
    return 0;
  }
  int started = 0;
  if ((k = calloc(1, sizeof *k))) {
    k->e = e;
    kvf__str_copy(k->session, sizeof k->session, session);
    k->head = k->tail = j;
    started = kvf__thread_start_detached(connector_main, k) == 0;
  }
  if (!started) {
    pthread_mutex_unlock(&e->conn_mu);
    free(k);
    free(j);
    return KVF_ENOMEM;
  }
  k->next = e->connectors; /* the thread waits for conn_mu before it looks */
  e->connectors = k;
  atomic_fetch_add(&e->nconnectors, 1);
  pthread_mutex_unlock(&e->conn_mu);
  return 0;
}

int kvf__engine_dispatch(kvf_engine *e, const char *session, chunk **chunks, size_t nchunks) {
  /* A connector running for the session takes the batch (behind the ones
   * it holds): a batch of this thread's that went to it is still there, so
   * this thread's batches keep their order. Otherwise the transport takes
   * it here unless it would have to wait on the network. */
  int behind = 0;
  if (atomic_load(&e->nconnectors)) {
    pthread_mutex_lock(&e->conn_mu);
    behind = connector_find_locked(e, session) != NULL;
    pthread_mutex_unlock(&e->conn_mu);
  }
  if (!behind) {
    int rc = e->ops->submit(e, session, chunks, nchunks);
    if (rc != KVF__SUBMIT_WOULD_BLOCK) return rc;
    if (atomic_load(&e->connect_stop)) return KVF_ECLOSED; /* the engine is being destroyed */
  }
  int rc = connector_queue(e, session, chunks, nchunks);
  if (rc != 1) return rc;
  if (kvf__log_first_time(0x636f6e6eu))
    LOG_WARN("engine", "%d sessions connecting at once: further connects run on the submitting thread",
             ENGINE_MAX_CONNECTORS);
  may_block = 1;
  rc = e->ops->submit(e, session, chunks, nchunks);
  may_block = 0;
  return rc;
}

int kvf__engine_submit_lock(pthread_mutex_t *mu, const atomic_int *connecting) {
  if (may_block) {
    pthread_mutex_lock(mu);
    return 0;
  }
  if (!pthread_mutex_trylock(mu)) return 0;
  if (atomic_load(connecting)) return KVF__SUBMIT_WOULD_BLOCK; /* held long only by a connect */
  pthread_mutex_lock(mu);
  return 0;
}

int kvf__engine_may_block(void) { return may_block; }

void kvf__engine_connectors_stop(kvf_engine *e) {
  atomic_store(&e->connect_stop, 1);
  pthread_mutex_lock(&e->conn_mu);
  while (atomic_load(&e->nconnectors) > 0) pthread_cond_wait(&e->conn_cv, &e->conn_mu);
  pthread_mutex_unlock(&e->conn_mu);
}

/* Mapping a same-host writer's pools ahead of the first reads (read mode).
 *
 * A reader maps each pool that a writer on this host allocated with
 * kvf_engine_alloc_pool (ucp_rkey_ptr, when the writer's info comes) and
 * copies rooms out of it with plain loads. The first load from each page of
 * such a mapping faults (tens of microseconds on a virtual machine), and
 * where the hypervisor keeps its own page tables (shadow paging, as on the
 * VMs these benchmarks ran on) the first load after the kernel's tables are
 * filled still costs it about 1.5 us a page: 4 KiB copies at random from a
 * 320 MiB mapping took 2.05 us each on the first pass after
 * MADV_POPULATE_READ and 0.56 us on the next. Rooms pay that page by page,
 * until every page has been read once: 1-page rooms at 64 in flight ran at
 * 11-13k rooms/s for their first 150 ms against 30-45k later.
 *
 * So each engine has one thread ("kvf-ucx-warm", started when there is
 * work, ending when there is none) that maps each writer's pools ahead, a
 * slice (UCX_WARM_SLICE) at a time: MADV_POPULATE_READ, then one load per
 * page. At most UCX_POPULATE_MAX per writer, an even share of it from the
 * start of each region. Nothing waits for it: a read of a page it has not
 * reached yet faults that page in itself, as before. Best effort: a slice the
 * kernel will not populate ends that writer's job (its pages fault in on
 * their first read) and is logged once per writer.
 *
 * Lifetime: a job holds copies of the ranges, not the regions. The mappings
 * end when the endpoint's keys are released (ucx_read.c,
 * reader_ep_cancel_locked), which first calls kvf__ucx_warm_stop: it drops
 * the connection's job if the thread has not reached it, or waits until the
 * thread has left it (at most one slice). Locks: warm_mu guards the queue,
 * warm_cur, the thread's state and each connection's `warm`; it is taken
 * under wmu, and nothing is taken under it. */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "base/log.h"
#include "base/parse.h"
#include "base/thread.h"
#include "engine/engine_internal.h"
#include "engine/ucx.h"

typedef struct warm_range {
  uintptr_t a;
  size_t len;
} warm_range;

typedef struct ucx_warm_job {
  struct ucx_warm_job *next;
  ucx_ctl *c; /* c->warm is this job until it ends or is stopped (under warm_mu) */
  atomic_int stop;
  char peer[KVF_ADDR_LEN];
  size_t n;
  warm_range r[];
} ucx_warm_job;

void kvf__ucx_warm_init(ucx_state *u) {
  pthread_mutex_init(&u->warm_mu, NULL);
  pthread_cond_init(&u->warm_cv, NULL);
}

#ifdef MADV_POPULATE_READ
/* One job, slice by slice, until done or stopped. */
static void warm_job_run(ucx_state *u, ucx_warm_job *j, size_t pg) {
  for (size_t i = 0; i < j->n; i++)
    for (size_t off = 0; off < j->r[i].len; off += UCX_WARM_SLICE) {
      if (atomic_load_explicit(&j->stop, memory_order_relaxed)) return;
      size_t len = j->r[i].len - off < UCX_WARM_SLICE ? j->r[i].len - off : UCX_WARM_SLICE;
      volatile const unsigned char *p = (volatile const unsigned char *)(j->r[i].a + off);
      if (madvise((void *)(uintptr_t)p, len, MADV_POPULATE_READ)) {
        if (kvf__log_first_time_for_host(j->peer, "ucx-populate"))
          LOG_INFO("ucx", "writer %s: could not map its pool ahead (%s); first reads fault it in", j->peer,
                   strerror(errno));
        return;
      }
      for (size_t k = 0; k < len; k += pg) (void)p[k]; /* the first load of each page, here */
      atomic_fetch_add_explicit(&u->e->stats.bytes_mapped_ahead, len, memory_order_relaxed);
    }
}

static void *warm_main(void *arg) {
  ucx_state *u = arg;
  kvf__thread_name("kvf-ucx-warm");
  long pg = sysconf(_SC_PAGESIZE);
  pthread_mutex_lock(&u->warm_mu);
  for (ucx_warm_job *j; (j = u->warm_q) != NULL;) {
    u->warm_q = j->next;
    u->warm_cur = j;
    pthread_mutex_unlock(&u->warm_mu);
    warm_job_run(u, j, pg > 0 ? (size_t)pg : 4096);
    pthread_mutex_lock(&u->warm_mu);
    u->warm_cur = NULL;
    if (j->c->warm == j) j->c->warm = NULL; /* ended by itself (a stop cleared it) */
    free(j);
    pthread_cond_broadcast(&u->warm_cv);
  }
  u->warm_running = 0;
  pthread_mutex_unlock(&u->warm_mu);
  return NULL;
}
#endif

void kvf__ucx_warm_start(ucx_state *u, ucx_ctl *c) {
#ifdef MADV_POPULATE_READ
  long pg = sysconf(_SC_PAGESIZE);
  size_t mapped = 0;
  for (size_t i = 0; i < c->nwregs; i++) mapped += c->wregs[i].ptr != NULL;
  /* An even share of the budget per region (KV pages of one index sit in
   * every layer's buffer), whole OS pages. */
  uint64_t share = mapped && pg > 0 ? UCX_POPULATE_MAX / mapped / (uint64_t)pg * (uint64_t)pg : 0;
  if (!share) return;
  ucx_warm_job *j = calloc(1, sizeof *j + mapped * sizeof j->r[0]);
  if (!j) return; /* best effort */
  j->c = c;
  kvf__str_copy(j->peer, sizeof j->peer, c->peer);
  for (size_t i = 0; i < c->nwregs; i++) {
    if (!c->wregs[i].ptr) continue;
    uintptr_t a = (uintptr_t)c->wregs[i].ptr & ~(uintptr_t)(pg - 1);
    size_t len = (size_t)((uintptr_t)c->wregs[i].ptr + c->wregs[i].len - a);
    j->r[j->n++] = (warm_range){a, len > share ? (size_t)share : len};
  }
  kvf__ucx_warm_stop(u, c); /* the mappings an earlier job covered are gone */
  pthread_mutex_lock(&u->warm_mu);
  ucx_warm_job **tail = &u->warm_q;
  while (*tail) tail = &(*tail)->next;
  *tail = j;
  c->warm = j;
  if (!u->warm_running) {
    if (u->warm_joinable) pthread_join(u->warm_thread, NULL); /* it has ended: it set warm_running last */
    u->warm_joinable = u->warm_running = pthread_create(&u->warm_thread, NULL, warm_main, u) == 0;
    if (!u->warm_running) { /* no thread: reads fault the pages in themselves */
      *tail = NULL;
      c->warm = NULL;
      free(j);
    }
  }
  pthread_mutex_unlock(&u->warm_mu);
#else
  (void)u, (void)c;
#endif
}

void kvf__ucx_warm_stop(ucx_state *u, ucx_ctl *c) {
  pthread_mutex_lock(&u->warm_mu);
  ucx_warm_job *j = c->warm;
  if (j) {
    c->warm = NULL;
    atomic_store(&j->stop, 1);
    if (u->warm_cur == j) {
      while (u->warm_cur == j) pthread_cond_wait(&u->warm_cv, &u->warm_mu);
    } else { /* still queued: the thread never sees it */
      for (ucx_warm_job **pp = &u->warm_q; *pp; pp = &(*pp)->next)
        if (*pp == j) {
          *pp = j->next;
          break;
        }
      free(j);
    }
  }
  pthread_mutex_unlock(&u->warm_mu);
}

void kvf__ucx_warm_fini(ucx_state *u) {
  /* Every connection stopped its job before this (their ends come first), so
   * the thread, if any, has ended or is about to. */
  pthread_mutex_lock(&u->warm_mu);
  int join = u->warm_joinable;
  u->warm_joinable = 0;
  pthread_mutex_unlock(&u->warm_mu);
  if (join) pthread_join(u->warm_thread, NULL);
  pthread_mutex_destroy(&u->warm_mu);
  pthread_cond_destroy(&u->warm_cv);
}

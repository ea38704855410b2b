/* The UCX transport, writes: a batch's chunks become ucp_put_nbx calls
 * followed by an endpoint flush, or plain stores into a peer's pool that UCX
 * mapped here (ucp_rkey_ptr), on the submitting thread and the copier
 * threads; the progress thread fails flushes past their deadline and ends
 * the endpoints of dead peers. Locking rules in ucx.h. */
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "base/copy.h"
#include "base/hash.h"
#include "base/log.h"
#include "base/thread.h"
#include "engine/ucx.h"

/* ------------------------------------------------------------ writes */

static const ucx_rregion *rregion_find(const ucx_peer *p, uint64_t addr, uint64_t len) {
  return kvf__ucx_rregion_find(p->regs, p->nregs, addr, len);
}

/* Is every destination of the chunks inside one advertised region? p->rw held. */
static int chunks_ok(const ucx_peer *p, chunk **chunks, size_t n) {
  for (size_t i = 0; i < n; i++)
    for (size_t k = 0; k < chunks[i]->n; k++) {
      const kvf_write *w = &chunks[i]->writes[k];
      uint64_t count = w->count > 1 ? w->count : 1, span;
      if (__builtin_mul_overflow(count - 1, w->dst_stride, &span) || __builtin_add_overflow(span, w->len, &span))
        return 0;
      if (!rregion_find(p, w->dst, span)) return 0;
    }
  return 1;
}

/* Flushes in flight sit on u->ops; one the reaper failed (op->c NULL)
 * moves to u->orphans until its callback, or the teardown, frees it. */
static ucx_op **op_list(ucx_op *op) { return op->c ? &op->u->ops : &op->u->orphans; }

void kvf__ucx_op_unlink(ucx_op *op) {
  ucx_op **head = op_list(op);
  if (op->prev) op->prev->next = op->next;
  if (op->next) op->next->prev = op->prev;
  if (*head == op) *head = op->next;
  op->next = op->prev = NULL;
}

void kvf__ucx_op_link(ucx_op *op) {
  ucx_op **head = op_list(op);
  /* The first op in flight: the progress thread, perhaps in its idle wait
   * (UCX_IDLE_TICK_MS), ticks from now on to watch its deadline. A read op
   * (a notice) needs nothing else from it, so it is woken only when the
   * lease ends before it would wake anyway: with one notice in flight at a
   * time, a wake-up per notice put two context switches and a contended
   * wmu on each notice's way out. */
  if (!*head && head == &op->u->ops && (!op->read || op->gone || op->lease_end_ns < op->u->wake_by_ns))
    kvf__ucx_wake(op->u);
  op->next = *head;
  if (*head) (*head)->prev = op;
  *head = op;
}

int kvf__ucx_ops_fence_locked(ucx_state *u, ucx_peer *p, uint64_t epoch) {
  int n = 0;
  for (ucx_op *op = u->ops; op; op = op->next)
    if (!op->read && op->p == p && op->c->batch->tag && op->c->batch->epoch == epoch) op->fenced = 1, n++;
  return n;
}

void kvf__ucx_ops_free(ucx_state *u) {
  for (ucx_op **head = &u->ops; head; head = head == &u->ops ? &u->orphans : head == &u->orphans ? &u->tq : NULL)
    while (*head) {
      ucx_op *op = *head;
      *head = op->next;
      /* A chunk still waiting for its flush or its trailer's ack fails: its
       * batch's waiter or on_done hears of it, as over TCP. */
      if (op->c) kvf__chunk_finish(op->c, KVF_ECLOSED);
      free(op);
    }
}

/* p->rw and p->tmu held: send the chunk's trailer to the target
 * (ucx_serve). The caller checked the chunk's fence under the same rw hold. */
static int trailer_send(ucx_peer *p, const chunk *c) {
  ucx_req h = {UCX_TRAILER_MAGIC, c->tlen, 0};
  int64_t until = clock_deadline_ms(UCX_CTL_TIMEOUT_MS);
  pthread_mutex_lock(&p->mu);
  /* A peer marked dead gets no more: its connection is reset before the
   * next use, and one trailer cut short (a full socket) must not hold the
   * progress thread UCX_CTL_TIMEOUT_MS again for each trailer queued
   * behind it, nor be followed on the stream by a whole one. */
  int dead = atomic_load(&p->dead);
  int rc = dead ? dead : p->fd < 0 ? KVF_ECLOSED : kvf__fd_send_all(p->fd, &h, sizeof h, until);
  if (!rc) rc = kvf__fd_send_all(p->fd, c->trailer, c->tlen, until);
  pthread_mutex_unlock(&p->mu);
  return rc;
}

static void flush_cb(void *req, ucs_status_t st, void *arg) {
  ucx_op *op = arg;
  /* Under wmu (callbacks run inside progress or a forced close). A chunk
   * the reaper already failed is gone (op->c NULL, op on the orphans). */
  chunk *c = op->c;
  kvf__ucx_op_unlink(op);
  if (c && st == UCS_OK && !op->fenced && op->trailer) { /* its trailer goes out after progress */
    op->next = op->u->tq;
    op->u->tq = op;
    ucp_request_free(req);
    return;
  }
  if (c)
    kvf__chunk_finish(c, st != UCS_OK ? kvf__ucx_status(st) : op->err ? op->err : op->fenced ? KVF_ESTATE : 0);
  free(op);
  ucp_request_free(req);
}

/* p->rw held for reading, wmu not: send the chunk's trailer, its bytes in
 * place. The chunk completes when the target says it handled the trailer
 * (kvf__ucx_trailer_acked), as over TCP, where the ack follows the trailer:
 * the prefill's M3 then never overtakes the completion it duplicates. Until
 * then the op waits on u->ops (the reaper enforces the batch deadline) and
 * on the peer's FIFO. `op` is reused, or NULL. */
static void trailer_out(ucx_state *u, ucx_peer *p, chunk *c, ucx_op *op) {
  /* A fence closed since the flush (the rw hold keeps it so until the send):
   * this chunk fails, as a fenced one, and sends no trailer; the connection
   * and the peer's other batches are not affected. */
  if (c->batch->tag && kvf__ucx_fence_refused(p, c->batch->epoch)) {
    free(op);
    kvf__chunk_finish(c, KVF_ESTATE);
    return;
  }
  if (!op && !(op = calloc(1, sizeof *op))) {
    kvf__chunk_finish(c, KVF_ENOMEM);
    return;
  }
  *op = (ucx_op){.c = c, .p = p, .u = u};
  pthread_mutex_lock(&p->tmu);
  kvf__ucx_wlock(u);
  kvf__ucx_op_link(op);
  if (p->tacks_tail) p->tacks_tail->tnext = op;
  else p->tacks = op;
  p->tacks_tail = op;
  pthread_mutex_unlock(&u->wmu);
  int rc = trailer_send(p, c);
  pthread_mutex_unlock(&p->tmu);
  if (!rc) return;
  kvf__ucx_wlock(u);
  chunk *cc = op->c;
  if (cc) { /* failed now: an orphan on the FIFO until the peer is reset */
    kvf__ucx_op_unlink(op);
    op->c = NULL;
    kvf__ucx_op_link(op);
  }
  pthread_mutex_unlock(&u->wmu);
  if (cc) kvf__chunk_finish(cc, rc);
  kvf__ucx_peer_mark_dead(u, p, rc); /* a trailer cut short leaves the stream unusable */
}

void kvf__ucx_tacks_fail_locked(ucx_peer *p, int err) {
  ucx_op *op = p->tacks;
  p->tacks = p->tacks_tail = NULL;
  while (op) {
    ucx_op *next = op->tnext;
    op->tnext = NULL;
    if (op->c) {
      op->gone = err;
    } else { /* already failed, an orphan kept only for the ack count */
      kvf__ucx_op_unlink(op);
      free(op);
    }
    op = next;
  }
}

void kvf__ucx_trailer_acked(ucx_state *u, ucx_peer *p) {
  kvf__ucx_wlock(u);
  ucx_op *op = p->tacks;
  chunk *c = NULL;
  if (op) {
    p->tacks = op->tnext;
    if (!p->tacks) p->tacks_tail = NULL;
    c = op->c;
    kvf__ucx_op_unlink(op);
    free(op);
  }
  pthread_mutex_unlock(&u->wmu);
  if (c) kvf__chunk_finish(c, 0);
}

void kvf__ucx_trailers_send(ucx_state *u) {
  kvf__ucx_wlock(u);
  ucx_op *list = u->tq;
  u->tq = NULL;
  pthread_mutex_unlock(&u->wmu);
  while (list) {
    ucx_op *op = list;
    list = op->next;
    ucx_peer *p = op->p;
    pthread_rwlock_rdlock(&p->rw);
    trailer_out(u, p, op->c, op);
    pthread_rwlock_unlock(&p->rw);
  }
}

int kvf__ucx_flush_wait_locked(ucx_state *u, ucx_peer *p, int64_t until_ns) {
  ucp_request_param_t fp = {.op_attr_mask = 0};
  ucs_status_ptr_t sp = ucp_ep_flush_nbx(p->ep, &fp);
  if (UCS_PTR_IS_ERR(sp)) return kvf__ucx_status(UCS_PTR_STATUS(sp));
  if (!sp) return 0;
  ucs_status_t st;
  while ((st = ucp_request_check_status(sp)) == UCS_INPROGRESS && clock_now_ns() < until_ns &&
         !atomic_load(&p->dead))
    if (!ucp_worker_progress(u->w)) { /* let the progress thread and other writers in */
      pthread_mutex_unlock(&u->wmu);
      sched_yield();
      kvf__ucx_wlock(u);
    }
  ucp_request_free(sp); /* released when done if it still runs */
  if (st == UCS_INPROGRESS) return atomic_load(&p->dead) ? atomic_load(&p->dead) : KVF_ETIMEDOUT;
  return kvf__ucx_status(st);
}

/* p->rw held for reading (and wmu when *locked): may a block of a chunk
 * tagged with `epoch` start? The target may have sent a fence close that
 * is not read yet (the writer was stopped, or slow): then let the progress
 * thread read it first, locks dropped, and look again. 0, or why not. */
static int fence_gate(ucx_state *u, ucx_peer *p, uint64_t epoch, int *locked, int puts, int64_t deadline_ns) {
  while (kvf__ucx_ctl_pending(p)) {
    if (*locked) pthread_mutex_unlock(&u->wmu);
    *locked = 0;
    /* Puts posted and not flushed yet: a fence confirmation meanwhile must
     * flush (fence_msg_apply). */
    if (puts) atomic_fetch_add(&p->gated, 1);
    pthread_rwlock_unlock(&p->rw);
    kvf__ucx_wake(u);
    pthread_mutex_lock(&p->mu);
    struct timespec ts = clock_ts_from_ns(clock_deadline_ms(1));
    pthread_cond_timedwait(&p->cv, &p->mu, &ts);
    pthread_mutex_unlock(&p->mu);
    pthread_rwlock_rdlock(&p->rw);
    if (puts) atomic_fetch_sub(&p->gated, 1);
    if (atomic_load(&p->dead) || !p->ep) return atomic_load(&p->dead) ? atomic_load(&p->dead) : KVF_ECLOSED;
    /* The progress thread, which would read it, is gone (the engine stops
     * and joins it before the copiers that may be in here). */
    if (atomic_load(&u->stopping)) return KVF_ECLOSED;
    if (clock_now_ns() > deadline_ns) return KVF_ETIMEDOUT;
  }
  return kvf__ucx_fence_refused(p, epoch) ? KVF_ESTATE : 0;
}

/* Write one chunk: plain stores where the peer's region is mapped here,
 * puts and an endpoint flush elsewhere. Reports through kvf__chunk_finish.
 * A tagged chunk passes fence_gate before every block, so once the target
 * closed its fence no further block starts (one in progress completes). */
static void do_chunk(ucx_state *u, ucx_peer *p, chunk *c) {
  int status = 0, puts = 0, locked = 0, pending = 0;
  uint64_t epoch = c->batch->tag ? c->batch->epoch : 0;
  pthread_rwlock_rdlock(&p->rw);
  if (atomic_load(&p->dead) || !p->ep) {
    status = atomic_load(&p->dead) ? atomic_load(&p->dead) : KVF_ECLOSED;
    goto out;
  }
  if (p->read_mode) { /* the target reads it (ucx_read.c) */
    kvf__ucx_notice_send(u, p, c);
    pthread_rwlock_unlock(&p->rw);
    return;
  }
  ucp_request_param_t prm = {.op_attr_mask = 0};
  for (size_t k = 0; k < c->n && !status; k++) {
    const kvf_write *w = &c->writes[k];
    uint64_t count = w->count > 1 ? w->count : 1;
    for (uint64_t i = 0; i < count; i++) {
      uint64_t src = w->src + i * w->src_stride, dst = w->dst + i * w->dst_stride;
      if (epoch && (status = fence_gate(u, p, epoch, &locked, puts, c->batch->deadline_ns))) {
        if (status == KVF_ESTATE) atomic_fetch_add(&u->e->stats.chunks_fenced, 1);
        break;
      }
      const ucx_rregion *r = rregion_find(p, dst, w->len);
      if (!r) { /* the peer unregistered it since the batch was checked */
        status = KVF_ERANGE;
        break;
      }
      if (r->ptr) { /* a large chunk past the cache (base/copy.h) */
        if (c->bytes >= KVF_COPY_STREAM_MIN_BATCH)
          kvf__copy_stream(r->ptr + (dst - r->base), (const void *)(uintptr_t)src, w->len);
        else memcpy(r->ptr + (dst - r->base), (const void *)(uintptr_t)src, w->len);
        continue;
      }
      if (!locked) kvf__ucx_wlock(u);
      locked = 1;
      ucs_status_ptr_t sp = ucp_put_nbx(p->ep, (const void *)(uintptr_t)src, w->len, dst, r->rkey, &prm);
      if (UCS_PTR_IS_ERR(sp)) {
        status = kvf__ucx_status(UCS_PTR_STATUS(sp));
        break;
      }
      if (sp) ucp_request_free(sp); /* released when done; the flush covers it */
      puts++;
    }
  }
  /* The completion trailer follows the bytes, on the rendezvous connection
   * that the target reads in order: after the flush (the progress thread
   * sends it, kvf__ucx_trailers_send), or now when every byte was a store. */
  if (!status && c->tlen && !puts) {
    if (locked) pthread_mutex_unlock(&u->wmu);
    locked = 0;
    trailer_out(u, p, c, NULL); /* it finishes the chunk */
    pending = 1;
  }
  /* Posted puts are always covered by a tracked flush, a failed chunk's
   * too: a fence confirmation flushes while such a flush is in flight. */
  if (puts && !pending && p->ep) {
    ucx_op *op = calloc(1, sizeof *op);
    if (!op) {
      status = KVF_ENOMEM;
      goto out;
    }
    op->c = c;
    op->p = p;
    op->u = u;
    op->err = status;
    op->trailer = !status && c->tlen > 0;
    ucp_request_param_t fp = {.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA,
                              .cb.send = flush_cb,
                              .user_data = op};
    ucs_status_ptr_t sp = ucp_ep_flush_nbx(p->ep, &fp);
    if (UCS_PTR_IS_ERR(sp)) {
      if (!status) status = kvf__ucx_status(UCS_PTR_STATUS(sp));
      free(op);
    } else if (sp == NULL) {
      if (op->trailer) { /* flushed already */
        pthread_mutex_unlock(&u->wmu);
        locked = 0;
        trailer_out(u, p, c, op);
        pending = 1;
      } else {
        free(op);
      }
    } else {
      kvf__ucx_op_link(op);
      pending = 1;
    }
  }
out:
  /* A tagged chunk whose fence closed while it was written fails: the
   * target has given the room up (its bytes landed before it was told). */
  if (!status && !pending && epoch && kvf__ucx_fence_refused(p, epoch)) status = KVF_ESTATE;
  if (locked) pthread_mutex_unlock(&u->wmu);
  pthread_rwlock_unlock(&p->rw);
  if (pending) {
    kvf__ucx_wake(u); /* the progress thread completes the flush */
    return;
  }
  if (!status && atomic_load(&p->dead)) status = atomic_load(&p->dead);
  atomic_thread_fence(memory_order_release);
  kvf__chunk_finish(c, status);
}

static void *copier_main(void *arg) {
  kvf__thread_name("kvf-ucx-copy");
  ucx_state *u = arg;
  for (;;) {
    pthread_mutex_lock(&u->q_mu);
    while (!u->q_head && !atomic_load(&u->stopping)) pthread_cond_wait(&u->q_cv, &u->q_mu);
    ucx_job *j = u->q_head;
    if (j) {
      u->q_head = j->next;
      if (!u->q_head) u->q_tail = NULL;
    }
    pthread_mutex_unlock(&u->q_mu);
    if (!j) return NULL;
    if (j->fn) { /* the job belongs to whoever queued it */
      j->fn(j->arg);
      continue;
    }
    do_chunk(u, j->p, j->c);
    free(j);
  }
}

void kvf__ucx_copier_start(ucx_state *u) {
  int want = u->e->cfg.conns_per_peer - 1;
  if (want > UCX_MAX_COPIERS) want = UCX_MAX_COPIERS;
  for (int i = 0; i < want; i++)
    if (pthread_create(&u->copiers[u->ncopiers], NULL, copier_main, u) == 0) u->ncopiers++;
}

int kvf__ucx_copier_queue(ucx_state *u, ucx_job *j) {
  if (!u->ncopiers) return KVF_EBUSY;
  j->next = NULL;
  pthread_mutex_lock(&u->q_mu);
  if (u->q_tail) u->q_tail->next = j;
  else u->q_head = j;
  u->q_tail = j;
  pthread_cond_signal(&u->q_cv);
  pthread_mutex_unlock(&u->q_mu);
  return 0;
}

int kvf__ucx_copier_unqueue(ucx_state *u, ucx_job *j) {
  int found = 0;
  pthread_mutex_lock(&u->q_mu);
  for (ucx_job **pp = &u->q_head, *prev = NULL; *pp; prev = *pp, pp = &(*pp)->next)
    if (*pp == j) {
      *pp = j->next;
      if (u->q_tail == j) u->q_tail = prev;
      found = 1;
      break;
    }
  pthread_mutex_unlock(&u->q_mu);
  return found;
}

int kvf__ucx_submit(kvf_engine *e, const char *session, chunk **chunks, size_t nchunks) {
  ucx_state *u = e->ucx;
  ucx_peer *p;
  int rc = kvf__ucx_peer_get(u, session, &p);
  if (rc) return rc;
  int64_t deadline = chunks[0]->batch->deadline_ns;
  ucx_route route;
  rc = kvf__ucx_peer_ensure(u, p, deadline, &route);
  if (rc) return rc;
  if (route == ROUTE_TCP) return kvf__tcp_transport_ops.submit(e, session, chunks, nchunks);
  if (chunks[0]->batch->device_src > 1) { /* UCX would read it with the CPU */
    if (kvf__log_first_time(0x75637373u))
      LOG_WARN("ucx", "a batch to %s reads from device memory that UCX cannot move (ucx_reg_hook): refused",
               session);
    return KVF_EINVAL;
  }
  /* The whole batch is checked before any byte moves, as the TCP target
   * does: a region registered since the last message is fetched once. In
   * read mode the target checks every notice itself. */
  pthread_rwlock_rdlock(&p->rw);
  int read_mode = p->read_mode;
  int ok = read_mode || chunks_ok(p, chunks, nchunks);
  pthread_rwlock_unlock(&p->rw);
  if (read_mode) {
    for (size_t i = 0; i < nchunks; i++) do_chunk(u, p, chunks[i]);
    return 0;
  }
  /* A refresh returns at the next info applied, which may be one already on
   * its way (the answer to an earlier request, or a push from before this
   * request reached the target); the target answers requests in order, so a
   * few rounds reach the current regions. */
  if (!ok && !kvf__engine_may_block()) return KVF__SUBMIT_WOULD_BLOCK; /* the connector asks */
  for (int round = 0; !ok && round < UCX_REFRESH_ROUNDS && clock_now_ns() < deadline; round++) {
    kvf__ucx_peer_refresh(u, p, deadline);
    pthread_rwlock_rdlock(&p->rw);
    ok = chunks_ok(p, chunks, nchunks);
    pthread_rwlock_unlock(&p->rw);
  }
  if (!ok) {
    if (kvf__log_first_time(kvf__hash_str(p->id, 13)))
      LOG_WARN("ucx", "write outside the registered memory of %s refused (nothing written)", p->id);
    for (size_t i = 0; i < nchunks; i++) kvf__chunk_finish(chunks[i], KVF_ERANGE);
    return 0;
  }
  /* Large batches come in several chunks. Into a pool mapped here the
   * copier threads take all but the first, which this thread writes; puts
   * are serialised on the worker anyway, so they stay on this thread. */
  pthread_mutex_lock(&p->mu);
  int parallel = p->mapped && u->ncopiers;
  pthread_mutex_unlock(&p->mu);
  for (size_t i = 1; i < nchunks; i++) {
    ucx_job *j = parallel ? malloc(sizeof *j) : NULL;
    if (!j) {
      do_chunk(u, p, chunks[i]);
      continue;
    }
    *j = (ucx_job){NULL, chunks[i], p, NULL, NULL};
    kvf__ucx_copier_queue(u, j); /* parallel: there are copiers */
  }
  do_chunk(u, p, chunks[0]);
  return 0;
}

/* Progress thread: fail flushes past their batch deadline and end the
 * endpoints of dead peers (which cancels what they still carry). */
void kvf__ucx_reap(ucx_state *u) {
  int64_t now = clock_now_ns();
  int any_dead = 0;
  /* A flush past its deadline, or on an endpoint whose peer is gone, fails
   * its chunk now; the late callback only frees the op. */
  kvf__ucx_wlock(u);
  for (ucx_op *op = u->ops, *next; op; op = next) {
    next = op->next;
    if (op->read) { /* read mode: only the target's answer, its closing or the lease ends it */
      int err = op->gone ? op->gone : now > op->lease_end_ns ? KVF_ETIMEDOUT : 0;
      if (!err) continue;
      if (err == KVF_ETIMEDOUT && !atomic_load(&op->p->dead)) {
        LOG_WARN("ucx", "peer %s did not read a chunk within its lease; the chunk fails", op->p->id);
        kvf__ucx_peer_mark_dead(u, op->p, KVF_ETIMEDOUT);
      }
      chunk *c = op->c;
      kvf__ucx_op_unlink(op);
      free(op);
      kvf__chunk_finish(c, err);
      continue;
    }
    int err = op->gone ? op->gone : atomic_load(&op->p->dead);
    if (!err && now > op->c->batch->deadline_ns) {
      err = KVF_ETIMEDOUT;
      if (!atomic_load(&op->p->dead))
        LOG_WARN("ucx", "peer %s did not complete a batch before its deadline (%d ms)", op->p->id,
                 u->e->cfg.timeout_ms);
      kvf__ucx_peer_mark_dead(u, op->p, KVF_ETIMEDOUT);
    }
    if (err) {
      chunk *c = op->c;
      kvf__ucx_op_unlink(op);
      if (op->gone) { /* a trailer op off its dropped connection: nothing else refers to it */
        free(op);
      } else {
        op->c = NULL;
        kvf__ucx_op_link(op); /* its callback, or the teardown, frees it */
      }
      kvf__chunk_finish(c, err);
    }
  }
  pthread_mutex_unlock(&u->wmu);
  if (!atomic_exchange(&u->reap, 0)) return;
  pthread_mutex_lock(&u->peers_mu);
  map_iter it;
  kvf__map_iter_init(&it);
  void *v;
  ucx_peer *dead[64];
  while (kvf__smap_next(&u->peers, &it, NULL, &v)) {
    ucx_peer *p = v;
    if (!atomic_load(&p->dead)) continue;
    if (any_dead == 64) { /* the rest on the next round */
      atomic_store(&u->reap, 1);
      break;
    }
    dead[any_dead++] = p;
  }
  pthread_mutex_unlock(&u->peers_mu);
  for (int i = 0; i < any_dead; i++) {
    ucx_peer *p = dead[i];
    pthread_rwlock_wrlock(&p->rw);
    if (atomic_load(&p->dead)) {
      kvf__ucx_wlock(u);
      kvf__ucx_regs_free_locked(p);
      kvf__ucx_ep_close_locked(u, p);
      pthread_mutex_unlock(&u->wmu);
    }
    pthread_rwlock_unlock(&p->rw);
    pthread_mutex_lock(&p->mu);
    pthread_cond_broadcast(&p->cv);
    pthread_mutex_unlock(&p->mu);
  }
}

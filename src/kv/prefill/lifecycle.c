/* Prefill start and stop: PUT /route registration (§1.5), the plan layouts
 * converted once, the direct-transfer pool, the worker threads, and the
 * teardown that waits for in-flight direct chunks. */
#include "kv/prefill/prefill_int.h"

/* ------------------------------------------------------- start and stop */

static int put_route(kvf_manager *m) {
  const manager_buffers *b = &m->bufs;
  route_reg reg;
  memset(&reg, 0, sizeof reg);
  snprintf(reg.role, sizeof reg.role, "Prefill");
  reg.world_size = m->cfg.world_size;
  reg.dp_size = m->cfg.dp_size;
  kvf__str_copy(reg.rank_ip, sizeof reg.rank_ip, m->host);
  reg.rank_port = m->rank_port;
  reg.engine_rank = m->cfg.engine_rank;
  /* kvferry's page layout: our MHA pages are token-major (§6.5.7 caveat). */
  const uint64_t layout[2] = {(uint64_t)m->cfg.page_size, 1};
  const uint64_t *src[ROUTE_NLISTS] = {b->kv_item_lens, b->kv_unit_lens, b->state_item_lens, b->state_unit_lens,
                                       layout};
  size_t cnt[ROUTE_NLISTS] = {b->n_kv, b->n_kv, b->n_state, b->n_state, 2};
  int rc = 0;
  for (int l = 0; l < ROUTE_NLISTS; l++) {
    reg.lists[l].v = calloc(cnt[l] ? cnt[l] : 1, sizeof(int64_t));
    if (!reg.lists[l].v) rc = KVF_ENOMEM;
    for (size_t i = 0; reg.lists[l].v && i < cnt[l]; i++) reg.lists[l].v[i] = (int64_t)src[l][i];
    reg.lists[l].n = cnt[l];
    reg.lists[l].present = 1;
  }
  bootstrap_client *bc = NULL;
  bootstrap_client_opts opts = {.token = m->bootstrap_token, .timeout_ms = m->cfg.http_timeout_ms};
  if (!rc) rc = kvf__bootstrap_client_create(m->bootstrap_addr, &opts, &bc);
  if (!rc) rc = kvf__bootstrap_client_put_route(bc, &reg, 3 * m->cfg.http_timeout_ms);
  if (rc)
    LOG_ERROR("kv", "prefill rank %d could not register with the bootstrap server %s: %s", m->cfg.engine_rank,
              m->bootstrap_addr, kvf_strerror(rc));
  kvf__bootstrap_client_destroy(bc);
  for (int l = 0; l < ROUTE_NLISTS; l++) free(reg.lists[l].v);
  return rc;
}

static int build_layouts(prefill_state *ps) {
  const manager_buffers *b = &ps->m->bufs;
  ps->st_start = malloc(2 * sizeof *ps->st_start);
  ps->st_bufs = malloc((b->n_state ? b->n_state : 1) * sizeof *ps->st_bufs);
  if (!ps->st_start || !ps->st_bufs) return KVF_ENOMEM;
  ps->kv_lay = b->kv_layout; /* built once by the manager */
  ps->st_start[0] = 0;
  ps->st_start[1] = (uint32_t)b->n_state;
  for (size_t k = 0; k < b->n_state; k++) ps->st_bufs[k] = (uint32_t)k;
  ps->st_lay = (plan_layout){1, ps->st_start, ps->st_bufs};
  if (!b->state_layer) return 0;
  /* State buffers by layer (a counting sort), for layerwise chunks. */
  ps->stl_start = calloc(b->n_layers + 1, sizeof *ps->stl_start);
  ps->stl_bufs = malloc((b->n_state ? b->n_state : 1) * sizeof *ps->stl_bufs);
  if (!ps->stl_start || !ps->stl_bufs) return KVF_ENOMEM;
  for (size_t k = 0; k < b->n_state; k++) ps->stl_start[b->state_layer[k] + 1]++;
  for (size_t l = 0; l < b->n_layers; l++) ps->stl_start[l + 1] += ps->stl_start[l];
  for (size_t l = 0, k = 0; l < b->n_layers; l++)
    for (size_t j = 0; j < b->n_state; j++)
      if (b->state_layer[j] == l) ps->stl_bufs[k++] = (uint32_t)j;
  ps->stl_lay = (plan_layout){b->n_layers, ps->stl_start, ps->stl_bufs};
  return 0;
}

/* The direct-transfer records, their planning scratch and the per-layer
 * page bytes that decide which chunks are small enough: sized once. */
static int direct_init(prefill_state *ps) {
  const manager_buffers *b = &ps->m->bufs;
  ps->layer_bytes = calloc(b->n_layers + 1, sizeof *ps->layer_bytes);
  ps->direct_pool = calloc(PF_DIRECT_SLOTS, sizeof *ps->direct_pool);
  if (!ps->layer_bytes || !ps->direct_pool || kvf__pf_scratch_init(&ps->direct_sc, b)) return KVF_ENOMEM;
  for (size_t l = 0; l < b->n_layers; l++) {
    uint64_t sum = 0;
    for (uint32_t k = b->layer_buf_start[l]; k < b->layer_buf_start[l + 1]; k++)
      sum += b->kv_item_lens[b->layer_bufs[k]];
    ps->layer_bytes[l + 1] = ps->layer_bytes[l] + sum;
  }
  for (size_t i = PF_DIRECT_SLOTS; i-- > 0;) {
    ps->direct_pool[i].next = ps->direct_free;
    ps->direct_free = &ps->direct_pool[i];
  }
  return 0;
}

/* Stop: a room still in the table (early, or a sender never destroyed). */
static void release_room(void *user, void *arg) {
  pf_room *r = user;
  r->refs = 1; /* workers are gone: nothing else can hold it */
  kvf__pf_room_unref(arg, r);
}

static void free_state(prefill_state *ps) {
  map_iter it;
  void *v;
  kvf__map_iter_init(&it);
  while (kvf__smap_next(&ps->regs, &it, NULL, &v)) {
    pf_reg *reg = v;
    free(reg->m1);
    free(reg);
  }
  kvf__smap_free(&ps->regs);
  if (ps->ended_ring) {
    kvf__map_free(&ps->ended);
    free(ps->ended_ring);
  }
  kvf__rooms_clear_all(ps->m->rooms, release_room, ps);
  free(ps->st_start), free(ps->st_bufs);
  free(ps->stl_start), free(ps->stl_bufs);
  while (ps->room_spare) {
    pf_room *r = ps->room_spare;
    ps->room_spare = r->next_spare;
    free(r->infos);
    free(r);
  }
  while (ps->sender_spare) {
    kvf_sender *s = ps->sender_spare;
    ps->sender_spare = s->next_spare;
    free(s);
  }
  kvf__pf_m3_free(ps);
  kvf__spare_free(&ps->chunk_spare); /* after every chunk above was freed */
  while (ps->info_spare) {
    pf_info *i = ps->info_spare;
    ps->info_spare = i->next_spare;
    free(i->m2), free(i);
  }
  pthread_mutex_destroy(&ps->spare_mu);
  free(ps->layer_bytes), free(ps->direct_pool);
  kvf__pf_scratch_free(&ps->direct_sc);
  pthread_cond_destroy(&ps->direct_cv);
  pthread_mutex_destroy(&ps->direct_lock);
  pthread_cond_destroy(&ps->hash_cv);
  pthread_mutex_destroy(&ps->hash_mu);
  pthread_mutex_destroy(&ps->lock);
  free(ps->queues);
  free(ps);
}

/* Stop every queue's threads (each finishes what it has in flight) and wait
 * until the last has ended; chunks never taken are dropped. */
static void stop_workers(prefill_state *ps) {
  for (int i = 0; i < ps->nqueues; i++) {
    pf_queue *q = &ps->queues[i];
    pthread_mutex_lock(&q->lock);
    q->stop = 1;
    pthread_cond_broadcast(&q->cond);
    kvf__pf_queue_poke_locked(q);
    pthread_mutex_unlock(&q->lock);
  }
  for (int i = 0; i < ps->nqueues; i++) {
    pf_queue *q = &ps->queues[i];
    pthread_mutex_lock(&q->lock);
    while (q->nthreads > 0) pthread_cond_wait(&q->cond, &q->lock);
    pthread_mutex_unlock(&q->lock);
    /* chunks never processed: drop them with their room references */
    pthread_mutex_lock(&ps->lock);
    for (pf_chunk *c = q->head, *n; c; c = n) {
      n = c->next;
      kvf__pf_chunk_release_locked(ps, c);
    }
    q->head = q->tail = NULL;
    pthread_mutex_unlock(&ps->lock);
    pthread_cond_destroy(&q->cond);
    pthread_mutex_destroy(&q->lock);
  }
}

int kvf__prefill_start(kvf_manager *m) {
  prefill_state *ps = calloc(1, sizeof *ps);
  if (!ps) return KVF_ENOMEM;
  ps->m = m;
  pthread_mutex_init(&ps->lock, NULL);
  pthread_mutex_init(&ps->direct_lock, NULL);
  clock_cond_init(&ps->direct_cv);
  pthread_mutex_init(&ps->spare_mu, NULL);
  pthread_mutex_init(&ps->hash_mu, NULL);
  pthread_cond_init(&ps->hash_cv, NULL);
  int rc = kvf__pf_m3_init(ps);
  if (!rc) rc = smap_init(&ps->regs);
  if (!rc) rc = build_layouts(ps);
  if (!rc) rc = direct_init(ps);
  ps->nqueues = m->cfg.queue_size;
  if (!rc && !(ps->queues = calloc((size_t)ps->nqueues, sizeof *ps->queues))) rc = KVF_ENOMEM;
  if (rc) goto err_free;
  if (m->bootstrap_addr[0] && (rc = put_route(m))) goto err_free;
  for (int i = 0; i < ps->nqueues; i++) {
    pf_queue *q = &ps->queues[i];
    q->ps = ps;
    pthread_mutex_init(&q->lock, NULL);
    clock_cond_init(&q->cond); /* monotonic: a helper's idle wait (workers.c) */
  }
  for (int i = 0; i < ps->nqueues && !rc; i++) {
    pf_queue *q = &ps->queues[i];
    pthread_mutex_lock(&q->lock);
    rc = kvf__pf_worker_start_locked(q, 0);
    pthread_mutex_unlock(&q->lock);
  }
  if (rc) goto err_workers;
  m->prefill = ps;
  return 0;

err_workers:
  stop_workers(ps);
err_free:
  free_state(ps);
  return rc;
}

void kvf__prefill_stop(kvf_manager *m) {
  prefill_state *ps = m->prefill;
  if (!ps) return;
  /* Direct chunks end in an engine callback, which the transport always
   * delivers by the batch deadline; the state must outlive them. */
  int64_t until = clock_deadline_ms(PF_DIRECT_DRAIN_MS);
  pthread_mutex_lock(&ps->lock);
  while (ps->direct_busy && clock_now_ns() < until) {
    struct timespec ts = clock_ts_from_ns(until);
    pthread_cond_timedwait(&ps->direct_cv, &ps->lock, &ts);
  }
  size_t busy = ps->direct_busy;
  pthread_mutex_unlock(&ps->lock);
  if (busy) { /* a transport bug: leak the state rather than free it under a callback */
    LOG_ERROR("kv", "prefill stop: %zu direct transfers never completed; their state is leaked", busy);
    stop_workers(ps);
    kvf__pf_m3_flush(ps, 1);
    m->prefill = NULL;
    return;
  }
  stop_workers(ps);
  kvf__pf_m3_flush(ps, 1); /* the M3s deferred by the last completions */
  free_state(ps);
  m->prefill = NULL;
}

/* The listener's timed work: the deferred M3s, and about once a second the
 * early rooms idle past the waiting timeout, which an M2 drops a few at a
 * time but nothing else would while no M2 comes. */
static int prefill_tick(kvf_manager *m) {
  prefill_state *ps = m->prefill;
  int64_t now = clock_now_ns();
  if (ps && now - ps->early_swept_ns >= PF_EARLY_SWEEP_MS * 1000000LL) {
    ps->early_swept_ns = now; /* the listener's own */
    pthread_mutex_lock(&ps->lock);
    for (size_t before = ps->nearly + 1, i = 0; ps->nearly < before && i < PF_EARLY_SWEEP_ROUNDS; i++) {
      before = ps->nearly;
      kvf__pf_expire_early(ps, now);
    }
    pthread_mutex_unlock(&ps->lock);
  }
  return kvf__pf_m3_tick(m);
}

const manager_role_ops kvf__prefill_role = {
    .name = "prefill",
    .start = kvf__prefill_start,
    .stop = kvf__prefill_stop,
    .on_message = kvf__prefill_on_message,
    .tick = prefill_tick,
    .trace_of = kvf__pf_trace_of,
};

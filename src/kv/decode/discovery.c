/* Finding a room's prefill ranks (PROTOCOL §5): the bootstrap address's
 * parallel info and route plan (cached per address), the pool entries of
 * resolved target ranks (cached per pool key, M1 sent on creation), and
 * the M2s a receiver sends once it knows its pages (§3.4). */
#include "kv/decode/decode_int.h"

void kvf__dec_pool_unref(pool_entry *p) {
  if (!p || atomic_fetch_sub(&p->refs, 1) != 1) return;
  free(p->targets);
  free(p->frags);
  free(p);
}

void kvf__dec_addr_entry_free(addr_entry *a) {
  if (!a) return;
  kvf__plan_route_free(&a->plan);
  free(a);
}

int64_t *kvf__dec_to_i64(const uint64_t *src, size_t n) {
  int64_t *p = calloc(n ? n : 1, sizeof *p);
  if (p)
    for (size_t i = 0; i < n; i++) p[i] = (int64_t)src[i];
  return p;
}

/* Reasons are cut to the room table's limit on purpose; formatting through
 * a va_list keeps -Wformat-truncation from flagging every long address. */
__attribute__((format(printf, 3, 4))) void kvf__dec_set_reason(char *buf, size_t cap, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, cap, fmt, ap);
  va_end(ap);
}

/* Record the reason and fail the room (it is live: the receiver owns it). */
void kvf__dec_fail_room(kvf_manager *m, int64_t room, const char *reason) {
  LOG_WARN("kv", "room %" PRId64 ": %s", room, reason);
  kvf__rooms_fail(m->rooms, room, reason);
}

/* A bootstrap address whose discovery timed out (a host that is down drops
 * the connection attempts; a server that accepts and never answers) is
 * remembered for one heartbeat interval: the receivers created for it
 * meanwhile fail at once with the same reason, instead of each holding the
 * scheduler's thread for the HTTP timeout while the other prefills'
 * requests wait behind it. Only timeouts are remembered: a refusal or an
 * answer costs no wait, and a prefill that registers later is found by the
 * next create. */
typedef struct addr_down {
  int64_t until_ns;
  char reason[ROOMS_REASON_MAX];
} addr_down;

/* 1 with the remembered reason when `addr` timed out lately. */
static int addr_is_down(struct decode_state *ds, const char *addr, char *reason, size_t rcap) {
  pthread_mutex_lock(&ds->lock);
  addr_down *d = kvf__smap_get(&ds->down, addr);
  int down = d && clock_now_ns() < d->until_ns;
  if (down) kvf__dec_set_reason(reason, rcap, "%s", d->reason);
  pthread_mutex_unlock(&ds->lock);
  return down;
}

/* After a discovery of `addr`: remember a timeout (bounded as the address
 * cache, expired entries dropped first), forget the address otherwise. */
static void addr_note(kvf_manager *m, const char *addr, int rc, const char *reason) {
  struct decode_state *ds = m->decode;
  void *v = NULL;
  pthread_mutex_lock(&ds->lock);
  if (rc != KVF_ETIMEDOUT) {
    if (kvf__smap_del(&ds->down, addr, &v)) free(v);
    pthread_mutex_unlock(&ds->lock);
    return;
  }
  int64_t now = clock_now_ns();
  addr_down *d = kvf__smap_get(&ds->down, addr);
  if (!d && smap_size(&ds->down) >= DECODE_MAX_ADDRS) { /* full: drop the expired ones */
    map_iter it;
    const char *key;
    kvf__map_iter_init(&it);
    while (kvf__smap_next(&ds->down, &it, &key, &v)) /* deleting the current entry is allowed */
      if (((addr_down *)v)->until_ns <= now) {
        char k[KVF_ADDR_LEN];
        kvf__str_copy(k, sizeof k, key);
        if (kvf__smap_del(&ds->down, k, &v)) free(v);
      }
  }
  if (!d && smap_size(&ds->down) < DECODE_MAX_ADDRS && (d = calloc(1, sizeof *d)) &&
      kvf__smap_put(&ds->down, addr, d, NULL)) {
    free(d);
    d = NULL;
  }
  if (d) {
    d->until_ns = now + (int64_t)(m->cfg.heartbeat_interval_s * 1e9);
    kvf__str_copy(d->reason, sizeof d->reason, reason);
  }
  pthread_mutex_unlock(&ds->lock);
}

static bootstrap_client *lookup_client(kvf_manager *m, const char *addr) {
  bootstrap_client_opts o = {.token = "", .connect_timeout_ms = 0, .timeout_ms = m->cfg.http_timeout_ms};
  if (o.timeout_ms < DECODE_HB_CONNECT_MS) o.connect_timeout_ms = o.timeout_ms;
  bootstrap_client *c = NULL;
  if (kvf__bootstrap_client_create(addr, &o, &c)) return NULL;
  /* One discovery (parallel info, then each target rank's address) ends
   * within the HTTP timeout as a whole: a bootstrap server that answers
   * each request just in time must not hold the caller for every target. */
  kvf__bootstrap_client_set_deadline(c, clock_deadline_ms(m->cfg.http_timeout_ms));
  return c;
}

/* Build the addr_entry for `addr`: parallel info over HTTP, then the plan.
 * On failure writes the room's reason and returns an error. */
static int fetch_addr_entry(kvf_manager *m, bootstrap_client **client, const char *addr, addr_entry **out,
                            char *reason, size_t rcap) {
  struct decode_state *ds = m->decode;
  route_parallel_info pi;
  memset(&pi, 0, sizeof pi);
  int rc = KVF_EIO;
  if (!*client) *client = lookup_client(m, addr);
  if (*client) rc = kvf__bootstrap_client_get_parallel_info(*client, &pi);
  if (!rc && (pi.world_size <= 0 || pi.dp_size <= 0 || pi.world_size % pi.dp_size ||
              pi.world_size / pi.dp_size > PLAN_MAX_TP))
    rc = KVF_EPROTO;
  if (rc) {
    kvf__dec_set_reason(reason, rcap, "Could not fetch prefill parallel info from bootstrap_addr: %s", addr);
    goto out;
  }
  addr_entry *a = calloc(1, sizeof *a);
  if (!a) {
    rc = KVF_ENOMEM;
    kvf__dec_set_reason(reason, rcap, "Could not fetch prefill parallel info from bootstrap_addr: %s", addr);
    goto out;
  }
  a->tp_p = pi.world_size / pi.dp_size;
  a->dp_p = pi.dp_size;
  char err[256] = "";
  if (m->cfg.is_mla || pi.enable_mla_l1_5_cache) {
    if (pi.enable_mla_l1_5_cache && !m->cfg.is_mla) {
      snprintf(err, sizeof err, "the prefill enables the MLA L1.5 cache but this decode is not MLA");
      rc = KVF_EINVAL;
    } else {
      rc = kvf__plan_route_legacy_mla(m->tp_size, m->tp_rank, (int)a->tp_p, pi.enable_mla_l1_5_cache, &a->plan);
      if (rc) kvf__str_copy(err, sizeof err, kvf_strerror(rc));
    }
  } else {
    const route_lens *L = pi.lists;
    plan_route_params p = {
        .decode_tp_size = m->tp_size,
        .decode_tp_rank = m->tp_rank,
        .prefill_tp_size = (int)a->tp_p,
        .layout = &ds->layout,
        .target_layer_num = m->cfg.target_layer_num,
        .d_kv_item = ds->d_kv_item,
        .d_kv_unit = ds->d_kv_unit,
        .n_d_kv = m->bufs.n_kv,
        .n_d_kv_unit = m->bufs.n_kv,
        .p_kv_item = L[ROUTE_KV_ITEM_LENS].v,
        .p_kv_unit = L[ROUTE_KV_UNIT_LENS].v,
        .n_p_kv = L[ROUTE_KV_ITEM_LENS].n,
        .n_p_kv_unit = L[ROUTE_KV_UNIT_LENS].n,
        .d_state_item = ds->d_state_item,
        .d_state_unit = ds->d_state_unit,
        .n_d_state = m->bufs.n_state,
        .n_d_state_unit = m->bufs.n_state,
        .p_state_item = L[ROUTE_STATE_ITEM_LENS].v,
        .p_state_unit = L[ROUTE_STATE_UNIT_LENS].v,
        .n_p_state = L[ROUTE_STATE_ITEM_LENS].n,
        .n_p_state_unit = L[ROUTE_STATE_UNIT_LENS].n,
        .err = err,
        .err_cap = sizeof err,
    };
    rc = kvf__plan_route_build(&p, &a->plan);
    /* §8 item 4: uncovered prefill ranks get a dummy, or they never finish. */
    if (!rc) rc = kvf__plan_route_add_dummies(&a->plan, m->tp_size, m->tp_rank);
  }
  /* §6.5.7 caveat, §8 item 11: a plan that cuts head ranges out of a page
   * is right only for pages that hold their heads contiguously. Ours are
   * token-major, so with page_size > 1 the slices must be cut per token,
   * which only a prefill that publishes its page layout (kvferry) does. A
   * tokenspeed prefill would land wrong bytes: refuse instead. */
  int slicing = !rc && kvf__plan_frags_slice_pages(a->plan.frags, a->plan.nfrags);
  a->kvferry_peer = pi.lists[ROUTE_KVF_PAGE_LAYOUT].n >= 2;
  if (!rc && slicing && m->cfg.page_size > 1) {
    const route_lens *lay = &pi.lists[ROUTE_KVF_PAGE_LAYOUT];
    if (lay->n >= 2 && lay->v[1] == 1 && lay->v[0] == m->cfg.page_size) {
      a->page_layout = m->cfg.page_size;
    } else {
      if (lay->n >= 2)
        snprintf(err, sizeof err,
                 "heterogeneous TP needs equal token-major page sizes, prefill has %lld "
                 "(layout %lld), this decode %d",
                 (long long)lay->v[0], (long long)lay->v[1], m->cfg.page_size);
      else
        snprintf(err, sizeof err,
                 "heterogeneous TP with page_size %d: the prefill publishes no page layout (not "
                 "a kvferry peer), and cutting heads per page out of token-major pages would corrupt the KV cache",
                 m->cfg.page_size);
      rc = KVF_EINVAL;
    }
  }
  if (!rc && a->plan.ntargets <= 0) {
    snprintf(err, sizeof err, "the route plan has no target rank");
    rc = KVF_EINVAL;
  }
  /* The pool key's tail: the target ranks joined by ','. */
  size_t used = 0;
  for (int i = 0; !rc && i < a->plan.ntargets; i++) {
    int n = snprintf(a->ranks + used, sizeof a->ranks - used, i ? ",%d" : "%d", a->plan.targets[i].rank);
    if (n < 0 || (size_t)n >= sizeof a->ranks - used) {
      snprintf(err, sizeof err, "too many target ranks");
      rc = KVF_ETOOBIG;
    } else {
      used += (size_t)n;
    }
  }
  if (rc) {
    kvf__dec_set_reason(reason, rcap, "Could not plan the transfer from bootstrap_addr: %s: %s", addr,
                        err[0] ? err : kvf_strerror(rc));
    kvf__dec_addr_entry_free(a);
    goto out;
  }
  *out = a;
out:
  kvf__route_parallel_info_free(&pi);
  return rc;
}

/* A fresh pool entry for the plan of `a` (called under ds->lock: no I/O). */
static pool_entry *pool_from_plan(const addr_entry *a, const char *addr) {
  pool_entry *p = calloc(1, sizeof *p);
  if (!p) return NULL;
  atomic_init(&p->refs, 1);
  kvf__str_copy(p->addr, sizeof p->addr, addr);
  p->ntargets = a->plan.ntargets;
  p->targets = calloc((size_t)p->ntargets, sizeof *p->targets);
  p->fragmented = !a->plan.is_identity && a->plan.nfrags > 0;
  p->page_layout = a->page_layout;
  p->kvferry_peer = a->kvferry_peer;
  p->nfrags = a->plan.nfrags;
  p->frags = calloc(p->nfrags ? p->nfrags : 1, sizeof *p->frags);
  p->required_prefill_response_num = a->plan.required_prefill_response_num;
  p->supports_spec = a->plan.supports_spec;
  if (!p->targets || !p->frags) {
    kvf__dec_pool_unref(p);
    return NULL;
  }
  for (int i = 0; i < p->ntargets; i++) {
    const plan_target *t = &a->plan.targets[i];
    p->targets[i] = (pool_target){.rank = t->rank,
                                  .is_dummy = t->is_dummy,
                                  .required_dst_info_num = t->required_dst_info_num,
                                  .frag_start = t->frag_start,
                                  .nfrags = t->nfrags};
  }
  if (p->nfrags) memcpy(p->frags, a->plan.frags, p->nfrags * sizeof *p->frags);
  return p;
}

void kvf__dec_fill_self(kvf_manager *m, char *endpoint, uint16_t *dst_port, char *session,
                        uint16_t *session_port) {
  kvf__str_copy(endpoint, WIRE_STR_MAX + 1, m->host);
  *dst_port = m->rank_port;
  kvf__str_copy(session, WIRE_STR_MAX + 1, kvf_manager_session_id(m));
  int sp = 0;
  kvf__plan_session_port(session, &sp);
  *session_port = (uint16_t)sp;
}

/* Resolve every target's address and register with it (M1), §5.5. */
static int resolve_and_register(kvf_manager *m, bootstrap_client **client, pool_entry *p, int64_t group,
                                trace_live *tl, char *reason, size_t rcap) {
  if (!*client) *client = lookup_client(m, p->addr);
  for (int i = 0; i < p->ntargets; i++) {
    pool_target *t = &p->targets[i];
    int port = 0;
    int rc = *client ? kvf__bootstrap_client_get_rank(*client, t->rank, (int)group, t->ip, sizeof t->ip, &port)
                     : KVF_EIO;
    if (!rc && (port <= 0 || port > 65535)) rc = KVF_EPROTO;
    if (rc) {
      kvf__dec_set_reason(reason, rcap,
                          "Could not fetch bootstrap info for engine rank: %d and target_dp_group: %" PRId64,
                          m->cfg.engine_rank, group);
      return rc;
    }
    t->port = (uint16_t)port;
  }
  kvf__trace_now(tl, KVF_TRACE_DISCOVERY_DONE);
  wire_m1 m1;
  memset(&m1, 0, sizeof m1);
  kvf__dec_fill_self(m, m1.endpoint, &m1.dst_port, m1.session, &m1.session_port);
  m1.kv_ptrs = wire_array_of(m->bufs.kv_ptrs, m->bufs.n_kv);
  m1.aux_ptrs = wire_array_of(NULL, 0);
  m1.state_ptrs = wire_array_of(m->bufs.state_ptrs, m->bufs.n_state);
  m1.decode_prefix_len = 0;
  wire_msg msg;
  char why[WIRE_REASON_LEN] = "";
  int rc = kvf__wire_m1_encode(&m1, &msg, why);
  if (rc) {
    kvf__dec_set_reason(reason, rcap, "Could not encode the registration for bootstrap_addr %s: %s", p->addr, why);
    return rc;
  }
  kvf__trace_now(tl, KVF_TRACE_M1_SENT); /* handed to ZeroMQ from here on */
  for (int i = 0; i < p->ntargets && !rc; i++) {
    rc = kvf__manager_push_send(m, p->targets[i].ip, p->targets[i].port, &msg);
    if (rc)
      kvf__dec_set_reason(reason, rcap, "Could not register with prefill rank %s (bootstrap_addr: %s): %s",
                          kvf__addr_str(p->targets[i].ip, p->targets[i].port).s, p->addr, kvf_strerror(rc));
  }
  kvf__wire_msg_free(&msg);
  return rc;
}

/* Find or build the pool entry for (addr, room). Returns 0 with a reference
 * in r->pool, or an error with the reason filled. */
int kvf__dec_resolve_receiver(kvf_manager *m, kvf_receiver *r, char *reason, size_t rcap) {
  struct decode_state *ds = m->decode;
  bootstrap_client *client = NULL;
  addr_entry *fresh = NULL;
  pool_entry *np = NULL;
  char key[DECODE_KEY_MAX];
  int64_t group = 0;
  uint64_t epoch = 0;
  int rc = 0;

  pthread_mutex_lock(&ds->lock);
  addr_entry *a = kvf__smap_get(&ds->infos, r->addr);
  pthread_mutex_unlock(&ds->lock);
  if (!a) {
    /* Miss: fetch without the lock, then insert unless another thread won. */
    if (addr_is_down(ds, r->addr, reason, rcap)) {
      rc = KVF_ETIMEDOUT;
      goto cleanup;
    }
    rc = fetch_addr_entry(m, &client, r->addr, &fresh, reason, rcap);
    addr_note(m, r->addr, rc, reason);
    if (rc) goto cleanup;
    pthread_mutex_lock(&ds->lock);
    if (!kvf__smap_get(&ds->infos, r->addr)) {
      if (smap_size(&ds->infos) >= DECODE_MAX_ADDRS) {
        pthread_mutex_unlock(&ds->lock);
        kvf__dec_set_reason(reason, rcap,
                            "Could not fetch prefill parallel info from bootstrap_addr: %s "
                            "(too many prefill instances, limit %d)",
                            r->addr, DECODE_MAX_ADDRS);
        rc = KVF_ENOMEM;
        goto cleanup;
      }
      fresh->epoch = ++ds->next_epoch;
      if ((rc = kvf__smap_put(&ds->infos, r->addr, fresh, NULL))) {
        pthread_mutex_unlock(&ds->lock);
        kvf__dec_set_reason(reason, rcap, "Could not fetch prefill parallel info from bootstrap_addr: %s",
                            r->addr);
        goto cleanup;
      }
      fresh = NULL;
    }
    pthread_mutex_unlock(&ds->lock);
  }

  pthread_mutex_lock(&ds->lock);
  a = kvf__smap_get(&ds->infos, r->addr);
  if (!a) { /* dropped by a node failure in between: the address is dead */
    pthread_mutex_unlock(&ds->lock);
    kvf__dec_set_reason(reason, rcap, "Losing connection with prefill instance (bootstrap_addr: %s)", r->addr);
    rc = KVF_ECLOSED;
    goto cleanup;
  }
  epoch = a->epoch;
  kvf__plan_dp_group(r->room, a->dp_p, &group);
  snprintf(key, sizeof key, "%s_%" PRId64 "_%s", r->addr, group, a->ranks);
  pool_entry *p = kvf__smap_get(&ds->pools, key);
  if (p) {
    atomic_fetch_add(&p->refs, 1);
    r->pool = p;
    atomic_store(&r->pool_tag, (uintptr_t)p);
    atomic_store(&r->epoch, epoch);
    pthread_mutex_unlock(&ds->lock);
    kvf__trace_now(&r->tr, KVF_TRACE_DISCOVERY_DONE); /* cached: no lookup, no M1 */
    goto cleanup;
  }
  np = pool_from_plan(a, r->addr);
  if (np) np->group = group;
  pthread_mutex_unlock(&ds->lock);
  if (!np) {
    kvf__dec_set_reason(reason, rcap,
                        "Could not fetch bootstrap info for engine rank: %d and target_dp_group: %" PRId64,
                        m->cfg.engine_rank, group);
    rc = KVF_ENOMEM;
    goto cleanup;
  }
  /* Lookups and M1 happen before the entry is published, so no other
   * receiver can send an M2 ahead of this M1. Two racing creators both send
   * M1, which the prefill simply overwrites. */
  if (addr_is_down(ds, r->addr, reason, rcap)) {
    rc = KVF_ETIMEDOUT;
    goto cleanup;
  }
  rc = resolve_and_register(m, &client, np, group, &r->tr, reason, rcap);
  addr_note(m, r->addr, rc, reason);
  if (rc) goto cleanup;

  pthread_mutex_lock(&ds->lock);
  a = kvf__smap_get(&ds->infos, r->addr);
  if (!a || a->epoch != epoch) {
    /* The heartbeat declared the address dead while we were resolving; its
     * sweep could not see this receiver yet, so fail it here. */
    pthread_mutex_unlock(&ds->lock);
    kvf__dec_set_reason(reason, rcap, "Losing connection with prefill instance (bootstrap_addr: %s)", r->addr);
    rc = KVF_ECLOSED;
    goto cleanup;
  }
  p = kvf__smap_get(&ds->pools, key);
  if (p) {
    atomic_fetch_add(&p->refs, 1);
    r->pool = p;
  } else {
    r->pool = np;
    /* Past the bound the entry is used uncached: correct, only slower. */
    if (smap_size(&ds->pools) < DECODE_MAX_POOLS && !kvf__smap_put(&ds->pools, key, np, NULL))
      atomic_fetch_add(&np->refs, 1);
    np = NULL;
  }
  atomic_store(&r->pool_tag, (uintptr_t)r->pool);
  atomic_store(&r->epoch, epoch);
  pthread_mutex_unlock(&ds->lock);

cleanup:
  kvf__dec_pool_unref(np);
  kvf__dec_addr_entry_free(fresh);
  kvf__bootstrap_client_destroy(client);
  return rc;
}

static int room_pool_tag(void *user, void *arg) {
  const kvf_receiver *r = user;
  *(uintptr_t *)arg = r ? atomic_load(&r->pool_tag) : 0;
  return 1;
}

void kvf__dec_forget_registration(kvf_manager *m, int64_t room) {
  struct decode_state *ds = m->decode;
  uintptr_t tag = 0;
  if (kvf__rooms_with_user(m->rooms, room, room_pool_tag, &tag) != 1 || !tag) return;
  pool_entry *gone = NULL;
  map_iter it;
  const char *key;
  void *v;
  pthread_mutex_lock(&ds->lock);
  kvf__map_iter_init(&it);
  while (!gone && kvf__smap_next(&ds->pools, &it, &key, &v))
    if ((uintptr_t)v == tag && kvf__smap_del(&ds->pools, key, NULL)) gone = v;
  pthread_mutex_unlock(&ds->lock);
  if (!gone) return; /* forgotten already, or never cached */
  LOG_INFO("kv", "prefill %s dropped this decode's registration: the next request to it registers again",
           gone->addr);
  kvf__dec_pool_unref(gone); /* the map's reference; receivers keep theirs */
}

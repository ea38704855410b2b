/* The decode half of the KV manager (PROTOCOL §1.6, §3.3-3.5, §5, §7.1-7.3):
 * receivers, the status listener and the heartbeat, ported from the
 * reference's MooncakeKVManagerDecode and its receiver.
 *
 * A receiver for (bootstrap address, room) needs the prefill instance's
 * parallel layout, a route plan (which prefill TP ranks to contact and how),
 * and the ZMQ address of each target rank. All three are cached: parallel
 * info and the plan once per bootstrap address (`addr_entry`; the plan only
 * depends on the layout, so it is built once per address instead of once per
 * request, §8.16), the resolved targets once per pool key
 * "<addr>_<dp group>_<ranks>" (`pool_entry`, §5.5), whose creation is also
 * when M1 goes out to every target. Pool entries are reference counted
 * because a receiver keeps using its targets after a node failure dropped
 * them from the cache.
 *
 * Differences from the reference, on purpose:
 * - every construction failure leaves the room Failed with the reference's
 *   reason and returns a receiver that polls Failed; nothing throws or
 *   half-builds (§7.3);
 * - M3s for rooms that are not live are dropped and counted, never stored
 *   (§8.5), and a malformed M3 is rejected without hurting the listener (§8.1);
 * - the waiting timeout fires from init until Success, because the decode
 *   never enters WaitingForInput in practice (§2.4, §8.2);
 * - node failure drops cache entries of exactly that address (not by string
 *   prefix), resets the failure count, and forgets the PUSH sockets of its
 *   ranks, so a restarted prefill gets fresh M1s (§8.10);
 * - the heartbeat probes the cached target ranks themselves (their ZMQ
 *   sockets, kv/probe.c), so a dead or stopped prefill is found whether or
 *   not its bootstrap server lives, and a silent bootstrap server alone does
 *   not condemn live ranks (issue 13 defects 1, 2; rule at probe_addr);
 * - after each good /health probe the heartbeat looks the cached target ranks
 *   up again: a rank re-registered at another (ip, port) restarted, so its
 *   pool entries are dropped and the rooms sent through them fail (§8.10);
 * - an M3 counts only when it comes from the address of a rank the room was
 *   planned with (§8 lets any ZMQ peer end any room; issue 13 defect 5);
 * - HTTP calls never run under the cache lock; scheduler threads use a
 *   short-lived client on cache misses, the heartbeat its own clients.
 *
 * Which rooms belong to an address is found through the room table's user
 * pointer (the receiver) rather than a separate addr->rooms set, so there is
 * nothing to prune and nothing that can grow. */
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "base/log.h"
#include "bootstrap/bootstrap.h"
#include "kv/manager.h"
#include "kv/plan.h"
#include "kv/probe.h"

#define DECODE_MAX_ADDRS 1024     /* bootstrap addresses cached at once */
#define DECODE_MAX_POOLS 65536    /* pool keys cached at once */
#define DECODE_ADDR_MAX 256       /* bytes of a bootstrap address, NUL included */
#define DECODE_KEY_MAX 8192       /* bytes of a pool key */
#define DECODE_HB_CONNECT_MS 2000 /* the reference heartbeat's (2, 3) timeouts */
#define DECODE_HB_TIMEOUT_MS 5000   /* ... each capped at the heartbeat interval */
#define DECODE_PROBE_TIMEOUT_MS 1000 /* a rank's ZMTP greeting (also capped at the interval) */

/* One resolved target prefill rank. */
typedef struct pool_target {
  int rank;
  int is_dummy;
  int required_dst_info_num;
  char ip[ROUTE_IP_MAX + 1];
  uint16_t port;
  size_t frag_start, nfrags;
} pool_target;

/* The targets of one pool key, shared by every receiver using it. */
typedef struct pool_entry {
  atomic_int refs;
  char addr[DECODE_ADDR_MAX];
  int64_t group; /* the target dp group, for the heartbeat's rank revalidation */
  int ntargets;
  pool_target *targets;
  size_t nfrags;
  wire_fragment *frags; /* sent only when the plan is fragmented */
  int fragmented;
  int64_t page_layout; /* M2 frame 14 (kvferry): tokens per token-major page; 0 = not sent */
  int required_prefill_response_num;
  int supports_spec; /* the plan's supports_remote_spec_candidates */
} pool_entry;

/* What is known about one bootstrap address. */
typedef struct addr_entry {
  uint64_t epoch;   /* distinguishes this entry from a later one of the same address */
  int64_t tp_p, dp_p;
  int64_t page_layout; /* see pool_entry */
  plan_route plan;
  char ranks[DECODE_KEY_MAX / 2]; /* target ranks joined by ',' (the pool key's tail) */
} addr_entry;

/* Heartbeat bookkeeping of one address; heartbeat thread only. */
typedef struct hb_peer {
  bootstrap_client *client;
  int failures;
  int seen; /* still in the probe set this round */
} hb_peer;

struct decode_state {
  pthread_mutex_t lock; /* guards infos, pools, next_epoch */
  smap infos;           /* bootstrap addr -> addr_entry */
  smap pools;           /* pool key -> pool_entry (one reference held by the map) */
  uint64_t next_epoch;

  /* Planner inputs that never change, converted once. */
  size_t *lay_start, *lay_bufs;
  plan_layout layout;
  int64_t *d_kv_item, *d_kv_unit, *d_state_item, *d_state_unit;

  pthread_t hb;
  int hb_started;
  pthread_mutex_t hb_lock;
  pthread_cond_t hb_cond;
  int hb_stop;       /* guarded by hb_lock */
  smap hb_peers;     /* heartbeat thread only: addr -> hb_peer */
};

struct kvf_receiver {
  kvf_manager *m;
  int64_t room;
  char addr[DECODE_ADDR_MAX];
  /* Of the addr_entry the receiver was built from; 0 = none. Atomic: the
   * heartbeat's node-failure predicate reads it while create may set it. */
  _Atomic uint64_t epoch;
  pool_entry *pool; /* NULL when construction failed */
  /* The pool entry's address, stored under ds->lock when `pool` is set: the
   * heartbeat's rank-restart predicate compares it while create may set it,
   * and the listener reads the planned ranks through it under the room
   * table's lock (the receiver's reference keeps it alive and unique until
   * kvf_receiver_destroy has cleared the room). */
  _Atomic uintptr_t pool_tag;
};

/* ------------------------------------------------------------ helpers */

static void pool_unref(pool_entry *p) {
  if (!p || atomic_fetch_sub(&p->refs, 1) != 1) return;
  free(p->targets);
  free(p->frags);
  free(p);
}

static void addr_entry_free(addr_entry *a) {
  if (!a) return;
  plan_route_free(&a->plan);
  free(a);
}

static int64_t *to_i64(const uint64_t *src, size_t n) {
  int64_t *p = calloc(n ? n : 1, sizeof *p);
  if (p)
    for (size_t i = 0; i < n; i++) p[i] = (int64_t)src[i];
  return p;
}

/* Reasons are cut to the room table's limit on purpose; formatting through
 * a va_list keeps -Wformat-truncation from flagging every long address. */
__attribute__((format(printf, 3, 4))) static void set_reason(char *buf, size_t cap, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(buf, cap, fmt, ap);
  va_end(ap);
}

/* Record the reason and fail the room (it is live: the receiver owns it). */
static void fail_room(kvf_manager *m, int64_t room, const char *reason) {
  LOG_WARN("kv", "room %" PRId64 ": %s", room, reason);
  rooms_fail(m->rooms, room, reason);
}

static bootstrap_client *lookup_client(kvf_manager *m, const char *addr) {
  bootstrap_client_opts o = {.token = "", .connect_timeout_ms = 0, .timeout_ms = m->cfg.http_timeout_ms};
  if (o.timeout_ms < DECODE_HB_CONNECT_MS) o.connect_timeout_ms = o.timeout_ms;
  bootstrap_client *c = NULL;
  if (bootstrap_client_create(addr, &o, &c)) return NULL;
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
  if (*client) rc = bootstrap_client_get_parallel_info(*client, &pi);
  if (!rc && (pi.world_size <= 0 || pi.dp_size <= 0 || pi.world_size % pi.dp_size ||
              pi.world_size / pi.dp_size > PLAN_MAX_TP))
    rc = KVF_EPROTO;
  if (rc) {
    set_reason(reason, rcap, "Could not fetch prefill parallel info from bootstrap_addr: %s", addr);
    goto out;
  }
  addr_entry *a = calloc(1, sizeof *a);
  if (!a) {
    rc = KVF_ENOMEM;
    set_reason(reason, rcap, "Could not fetch prefill parallel info from bootstrap_addr: %s", addr);
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
      rc = plan_route_legacy_mla(m->tp_size, m->tp_rank, (int)a->tp_p, pi.enable_mla_l1_5_cache, &a->plan);
      if (rc) snprintf(err, sizeof err, "%s", kvf_strerror(rc));
    }
  } else {
    const route_lens *L = pi.lists;
    plan_route_params p = {
        .decode_tp_size = m->tp_size,
        .decode_tp_rank = m->tp_rank,
        .prefill_tp_size = (int)a->tp_p,
        .layout = &ds->layout,
        .target_layer_num = m->cfg.target_layer_num,
        .d_kv_item = ds->d_kv_item, .d_kv_unit = ds->d_kv_unit,
        .n_d_kv = m->bufs.n_kv, .n_d_kv_unit = m->bufs.n_kv,
        .p_kv_item = L[ROUTE_KV_ITEM_LENS].v, .p_kv_unit = L[ROUTE_KV_UNIT_LENS].v,
        .n_p_kv = L[ROUTE_KV_ITEM_LENS].n, .n_p_kv_unit = L[ROUTE_KV_UNIT_LENS].n,
        .d_state_item = ds->d_state_item, .d_state_unit = ds->d_state_unit,
        .n_d_state = m->bufs.n_state, .n_d_state_unit = m->bufs.n_state,
        .p_state_item = L[ROUTE_STATE_ITEM_LENS].v, .p_state_unit = L[ROUTE_STATE_UNIT_LENS].v,
        .n_p_state = L[ROUTE_STATE_ITEM_LENS].n, .n_p_state_unit = L[ROUTE_STATE_UNIT_LENS].n,
        .err = err, .err_cap = sizeof err,
    };
    rc = plan_route_build(&p, &a->plan);
    /* §8 item 4: uncovered prefill ranks get a dummy, or they never finish. */
    if (!rc) rc = plan_route_add_dummies(&a->plan, m->tp_size, m->tp_rank);
  }
  /* §6.5.7 caveat, §8 item 11: a plan that cuts head ranges out of a page
   * is right only for pages that hold their heads contiguously. Ours are
   * token-major, so with page_size > 1 the slices must be cut per token,
   * which only a prefill that publishes its page layout (kvferry) does. A
   * tokenspeed prefill would land wrong bytes: refuse instead. */
  int slicing = 0;
  for (size_t i = 0; !rc && i < a->plan.nfrags; i++) {
    const plan_fragment *f = &a->plan.frags[i];
    if (f->kind != PLAN_MAMBA_STATE &&
        (f->bytes_per_page != f->src_page_stride || f->bytes_per_page != f->dst_page_stride))
      slicing = 1;
  }
  if (!rc && slicing && m->cfg.page_size > 1) {
    const route_lens *lay = &pi.lists[ROUTE_KVF_PAGE_LAYOUT];
    if (lay->n >= 2 && lay->v[1] == 1 && lay->v[0] == m->cfg.page_size) {
      a->page_layout = m->cfg.page_size;
    } else {
      if (lay->n >= 2)
        snprintf(err, sizeof err, "heterogeneous TP needs equal token-major page sizes, prefill has %lld "
                 "(layout %lld), this decode %d", (long long)lay->v[0], (long long)lay->v[1], m->cfg.page_size);
      else
        snprintf(err, sizeof err, "heterogeneous TP with page_size %d: the prefill publishes no page layout (not "
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
    set_reason(reason, rcap, "Could not plan the transfer from bootstrap_addr: %s: %s", addr,
             err[0] ? err : kvf_strerror(rc));
    addr_entry_free(a);
    goto out;
  }
  *out = a;
out:
  route_parallel_info_free(&pi);
  return rc;
}

/* A fresh pool entry for the plan of `a` (called under ds->lock: no I/O). */
static pool_entry *pool_from_plan(const addr_entry *a, const char *addr) {
  pool_entry *p = calloc(1, sizeof *p);
  if (!p) return NULL;
  atomic_init(&p->refs, 1);
  snprintf(p->addr, sizeof p->addr, "%s", addr);
  p->ntargets = a->plan.ntargets;
  p->targets = calloc((size_t)p->ntargets, sizeof *p->targets);
  p->fragmented = !a->plan.is_identity && a->plan.nfrags > 0;
  p->page_layout = a->page_layout;
  p->nfrags = a->plan.nfrags;
  p->frags = calloc(p->nfrags ? p->nfrags : 1, sizeof *p->frags);
  p->required_prefill_response_num = a->plan.required_prefill_response_num;
  p->supports_spec = a->plan.supports_spec;
  if (!p->targets || !p->frags) {
    pool_unref(p);
    return NULL;
  }
  for (int i = 0; i < p->ntargets; i++) {
    const plan_target *t = &a->plan.targets[i];
    p->targets[i] = (pool_target){.rank = t->rank, .is_dummy = t->is_dummy,
                                  .required_dst_info_num = t->required_dst_info_num,
                                  .frag_start = t->frag_start, .nfrags = t->nfrags};
  }
  for (size_t i = 0; i < p->nfrags; i++) {
    const plan_fragment *f = &a->plan.frags[i];
    p->frags[i] = (wire_fragment){.buffer_index = f->buffer_index, .buffer_kind = (int32_t)f->kind,
                                  .src_rank = f->src_rank, .dst_rank = f->dst_rank,
                                  .src_page_stride_bytes = (int64_t)f->src_page_stride,
                                  .dst_page_stride_bytes = (int64_t)f->dst_page_stride,
                                  .src_byte_offset = (int64_t)f->src_byte_offset,
                                  .dst_byte_offset = (int64_t)f->dst_byte_offset,
                                  .bytes_per_page = (int64_t)f->bytes_per_page, .page_count = f->page_count};
  }
  return p;
}

static void fill_self(kvf_manager *m, char *endpoint, uint16_t *dst_port, char *session, uint16_t *session_port) {
  snprintf(endpoint, WIRE_STR_MAX + 1, "%s", m->host);
  *dst_port = m->rank_port;
  snprintf(session, WIRE_STR_MAX + 1, "%s", kvf_manager_session_id(m));
  int sp = 0;
  plan_session_port(session, &sp);
  *session_port = (uint16_t)sp;
}

/* Resolve every target's address and register with it (M1), §5.5. */
static int resolve_and_register(kvf_manager *m, bootstrap_client **client, pool_entry *p, int64_t group,
                                char *reason, size_t rcap) {
  if (!*client) *client = lookup_client(m, p->addr);
  for (int i = 0; i < p->ntargets; i++) {
    pool_target *t = &p->targets[i];
    int port = 0;
    int rc = *client ? bootstrap_client_get_rank(*client, t->rank, (int)group, t->ip, sizeof t->ip, &port)
                     : KVF_EIO;
    if (!rc && (port <= 0 || port > 65535)) rc = KVF_EPROTO;
    if (rc) {
      set_reason(reason, rcap, "Could not fetch bootstrap info for engine rank: %d and target_dp_group: %" PRId64,
               m->cfg.engine_rank, group);
      return rc;
    }
    t->port = (uint16_t)port;
  }
  wire_m1 m1;
  memset(&m1, 0, sizeof m1);
  fill_self(m, m1.endpoint, &m1.dst_port, m1.session, &m1.session_port);
  m1.kv_ptrs = wire_array_of(m->bufs.kv_ptrs, m->bufs.n_kv);
  m1.aux_ptrs = wire_array_of(NULL, 0);
  m1.state_ptrs = wire_array_of(m->bufs.state_ptrs, m->bufs.n_state);
  m1.decode_prefix_len = 0;
  wire_msg msg;
  char why[WIRE_REASON_LEN] = "";
  int rc = wire_m1_encode(&m1, &msg, why);
  if (rc) {
    set_reason(reason, rcap, "Could not encode the registration for bootstrap_addr %s: %s", p->addr, why);
    return rc;
  }
  for (int i = 0; i < p->ntargets && !rc; i++) {
    rc = manager_push_send(m, p->targets[i].ip, p->targets[i].port, &msg);
    if (rc)
      set_reason(reason, rcap, "Could not register with prefill rank %s:%u (bootstrap_addr: %s): %s",
               p->targets[i].ip, (unsigned)p->targets[i].port, p->addr, kvf_strerror(rc));
  }
  wire_msg_free(&msg);
  return rc;
}

/* Find or build the pool entry for (addr, room). Returns 0 with a reference
 * in r->pool, or an error with the reason filled. */
static int resolve_receiver(kvf_manager *m, kvf_receiver *r, char *reason, size_t rcap) {
  struct decode_state *ds = m->decode;
  bootstrap_client *client = NULL;
  addr_entry *fresh = NULL;
  pool_entry *np = NULL;
  char key[DECODE_KEY_MAX];
  int64_t group = 0;
  uint64_t epoch = 0;
  int rc = 0;

  pthread_mutex_lock(&ds->lock);
  addr_entry *a = smap_get(&ds->infos, r->addr);
  pthread_mutex_unlock(&ds->lock);
  if (!a) {
    /* Miss: fetch without the lock, then insert unless another thread won. */
    if ((rc = fetch_addr_entry(m, &client, r->addr, &fresh, reason, rcap))) goto cleanup;
    pthread_mutex_lock(&ds->lock);
    if (!smap_get(&ds->infos, r->addr)) {
      if (smap_size(&ds->infos) >= DECODE_MAX_ADDRS) {
        pthread_mutex_unlock(&ds->lock);
        set_reason(reason, rcap, "Could not fetch prefill parallel info from bootstrap_addr: %s "
                 "(too many prefill instances, limit %d)", r->addr, DECODE_MAX_ADDRS);
        rc = KVF_ENOMEM;
        goto cleanup;
      }
      fresh->epoch = ++ds->next_epoch;
      if ((rc = smap_put(&ds->infos, r->addr, fresh, NULL))) {
        pthread_mutex_unlock(&ds->lock);
        set_reason(reason, rcap, "Could not fetch prefill parallel info from bootstrap_addr: %s", r->addr);
        goto cleanup;
      }
      fresh = NULL;
    }
    pthread_mutex_unlock(&ds->lock);
  }

  pthread_mutex_lock(&ds->lock);
  a = smap_get(&ds->infos, r->addr);
  if (!a) { /* dropped by a node failure in between: the address is dead */
    pthread_mutex_unlock(&ds->lock);
    set_reason(reason, rcap, "Losing connection with prefill instance (bootstrap_addr: %s)", r->addr);
    rc = KVF_ECLOSED;
    goto cleanup;
  }
  epoch = a->epoch;
  plan_dp_group(r->room, a->dp_p, &group);
  snprintf(key, sizeof key, "%s_%" PRId64 "_%s", r->addr, group, a->ranks);
  pool_entry *p = smap_get(&ds->pools, key);
  if (p) {
    atomic_fetch_add(&p->refs, 1);
    r->pool = p;
    atomic_store(&r->pool_tag, (uintptr_t)p);
    atomic_store(&r->epoch, epoch);
    pthread_mutex_unlock(&ds->lock);
    goto cleanup;
  }
  np = pool_from_plan(a, r->addr);
  if (np) np->group = group;
  pthread_mutex_unlock(&ds->lock);
  if (!np) {
    set_reason(reason, rcap, "Could not fetch bootstrap info for engine rank: %d and target_dp_group: %" PRId64,
             m->cfg.engine_rank, group);
    rc = KVF_ENOMEM;
    goto cleanup;
  }
  /* Lookups and M1 happen before the entry is published, so no other
   * receiver can send an M2 ahead of this M1. Two racing creators both send
   * M1, which the prefill simply overwrites. */
  if ((rc = resolve_and_register(m, &client, np, group, reason, rcap))) goto cleanup;

  pthread_mutex_lock(&ds->lock);
  a = smap_get(&ds->infos, r->addr);
  if (!a || a->epoch != epoch) {
    /* The heartbeat declared the address dead while we were resolving; its
     * sweep could not see this receiver yet, so fail it here. */
    pthread_mutex_unlock(&ds->lock);
    set_reason(reason, rcap, "Losing connection with prefill instance (bootstrap_addr: %s)", r->addr);
    rc = KVF_ECLOSED;
    goto cleanup;
  }
  p = smap_get(&ds->pools, key);
  if (p) {
    atomic_fetch_add(&p->refs, 1);
    r->pool = p;
  } else {
    r->pool = np;
    /* Past the bound the entry is used uncached: correct, only slower. */
    if (smap_size(&ds->pools) < DECODE_MAX_POOLS && !smap_put(&ds->pools, key, np, NULL))
      atomic_fetch_add(&np->refs, 1);
    np = NULL;
  }
  atomic_store(&r->pool_tag, (uintptr_t)r->pool);
  atomic_store(&r->epoch, epoch);
  pthread_mutex_unlock(&ds->lock);

cleanup:
  pool_unref(np);
  addr_entry_free(fresh);
  bootstrap_client_destroy(client);
  return rc;
}

/* ------------------------------------------------------------ receiver */

int kvf_receiver_create(kvf_manager *m, const char *bootstrap_addr, int64_t room, kvf_receiver **out) {
  if (!m || !m->decode || !bootstrap_addr || !out) return KVF_EINVAL;
  if (!*bootstrap_addr || strlen(bootstrap_addr) >= DECODE_ADDR_MAX) return KVF_EINVAL;
  kvf_receiver *r = calloc(1, sizeof *r);
  if (!r) return KVF_ENOMEM;
  r->m = m;
  r->room = room;
  snprintf(r->addr, sizeof r->addr, "%s", bootstrap_addr);
  int rc = rooms_create(m->rooms, room, ROOM_BOOTSTRAPPING);
  if (rc) {
    free(r);
    return rc;
  }
  rooms_set_user(m->rooms, room, r);
  char reason[ROOMS_REASON_MAX] = "";
  if (resolve_receiver(m, r, reason, sizeof reason)) {
    fail_room(m, room, reason);
  } else {
    rooms_set_required(m->rooms, room, r->pool->required_prefill_response_num);
    rooms_update(m->rooms, room, ROOM_BOOTSTRAPPED, NULL);
  }
  *out = r;
  return 0;
}

int kvf_receiver_init(kvf_receiver *r, const int64_t *pages, size_t npages, int64_t aux_index,
                      int64_t decode_prefix_len, const int64_t *state_slots, size_t nstate) {
  if (!r || (npages && !pages) || (nstate && !state_slots) || decode_prefix_len < 0) return KVF_EINVAL;
  if (npages > WIRE_MAX_PAGES || nstate > WIRE_MAX_PAGES) return KVF_ETOOBIG;
  for (size_t i = 0; i < npages; i++)
    if (pages[i] < 0) return KVF_EINVAL;
  kvf_manager *m = r->m;
  int status = ROOM_FAILED;
  if (!r->pool || rooms_get_status(m->rooms, r->room, &status) || status == ROOM_FAILED)
    return 0; /* already Failed with its reason: poll reports it */
  pool_entry *p = r->pool;
  char reason[ROOMS_REASON_MAX] = "";
  int rc = 0;
  for (int i = 0; i < p->ntargets && !rc; i++) {
    const pool_target *t = &p->targets[i];
    wire_m2 m2;
    memset(&m2, 0, sizeof m2);
    m2.room = r->room;
    fill_self(m, m2.endpoint, &m2.dst_port, m2.session, &m2.session_port);
    m2.required_dst_info_num = t->required_dst_info_num;
    m2.is_dummy = t->is_dummy;
    if (!t->is_dummy) {
      m2.kv_indices = wire_array_of(pages, npages);
      m2.dst_aux_index = aux_index;
      m2.decode_prefix_len = decode_prefix_len;
      m2.mamba_indices = wire_array_of(state_slots, nstate);
      if (p->fragmented && t->nfrags) {
        m2.frags = p->frags + t->frag_start;
        m2.nfrags = t->nfrags;
        m2.page_layout = p->page_layout;
      }
    }
    wire_msg msg;
    char why[WIRE_REASON_LEN] = "";
    if ((rc = wire_m2_encode(&m2, &msg, why))) {
      set_reason(reason, sizeof reason, "Could not encode the transfer request for prefill rank %d: %s", t->rank,
               why);
      break;
    }
    rc = manager_push_send(m, t->ip, t->port, &msg);
    wire_msg_free(&msg);
    if (rc)
      set_reason(reason, sizeof reason, "Could not send the transfer request to prefill rank %s:%u: %s", t->ip,
               (unsigned)t->port, kvf_strerror(rc));
  }
  if (rc) {
    fail_room(m, r->room, reason);
    return 0;
  }
  rooms_set_init_time(m->rooms, r->room, clock_now_ns());
  return 0;
}

static int match_room(int64_t room, void *user, void *arg) {
  (void)user;
  return room == *(const int64_t *)arg;
}

kvf_poll_status kvf_receiver_poll(kvf_receiver *r) {
  if (!r) return KVF_POLL_FAILED;
  kvf_manager *m = r->m;
  rooms_info info;
  if (rooms_get_info(m->rooms, r->room, &info)) return KVF_POLL_FAILED;
  if (info.status == ROOM_SUCCESS || info.status == ROOM_FAILED) return (kvf_poll_status)info.status;
  if (info.init_time_ns >= 0) {
    double waited = (double)(clock_now_ns() - info.init_time_ns) / 1e9;
    if (waited >= m->cfg.waiting_timeout_s) {
      char reason[ROOMS_REASON_MAX];
      set_reason(reason, sizeof reason, "Request %" PRId64 " timed out after %.1fs in TransferPoll.WaitingForInput",
               r->room, waited);
      /* Fail only if Success did not win the race: fail_matching skips
       * Success rooms atomically. */
      size_t n = 0;
      rooms_fail_matching(m->rooms, match_room, &r->room, reason, &n);
      if (n) LOG_WARN("kv", "%s", reason);
      int s = ROOM_FAILED;
      rooms_get_status(m->rooms, r->room, &s);
      return (kvf_poll_status)s;
    }
  }
  return (kvf_poll_status)info.status;
}

void kvf_receiver_failure(kvf_receiver *r, char *buf, size_t cap) {
  if (!buf || !cap) return;
  buf[0] = 0;
  if (r) rooms_get_reason(r->m->rooms, r->room, buf, cap);
}

int kvf_receiver_supports_spec(const kvf_receiver *r) {
  if (!r) return KVF_EINVAL;
  return r->pool ? r->pool->supports_spec : KVF_ESTATE;
}

int kvf_receiver_pop_metadata(kvf_receiver *r, int64_t *token, int32_t *cands, size_t cap, size_t *ncand) {
  if (!r || !token || !ncand) return KVF_EINVAL;
  return rooms_pop_metadata(r->m->rooms, r->room, token, cands, cap, ncand);
}

void kvf_receiver_destroy(kvf_receiver *r) {
  if (!r) return;
  rooms_clear(r->m->rooms, r->room, NULL);
  pool_unref(r->pool);
  free(r);
}

/* ------------------------------------------------------------ listener */

typedef struct m3_origin {
  kvf_manager *m;
  const char *peer;
} m3_origin;

/* Under the room table's lock: did the M3 come from a rank the room was
 * planned with? (Issue 13 defect 5: PROTOCOL §8 lets any ZMQ peer end any
 * room.) A room without a plan yet has sent no M2, so nobody may answer. */
static int from_planned_rank(void *user, void *arg) {
  const kvf_receiver *r = user;
  const m3_origin *o = arg;
  const pool_entry *p = r ? (const pool_entry *)atomic_load(&r->pool_tag) : NULL;
  for (int i = 0; p && i < p->ntargets; i++)
    if (manager_peer_is(o->m, o->peer, p->targets[i].ip)) return 1;
  return 0;
}

void decode_on_message(kvf_manager *m, const wire_frame *frames, size_t n, const char *peer) {
  wire_m3 m3;
  char why[WIRE_REASON_LEN] = "";
  if (wire_m3_decode(frames, n, &m3, why)) {
    manager_reject(m, peer, "M3", why);
    return;
  }
  m3_origin origin = {m, peer};
  int rc = rooms_with_user(m->rooms, m3.room, from_planned_rank, &origin);
  if (rc == 0) {
    manager_reject_forged(m, peer, "M3", "the sender is not a prefill rank this room was planned with");
    return;
  }
  if (m3.status == WIRE_STATUS_SUCCESS) {
    int32_t cands[ROOMS_MAX_CANDS];
    if (m3.candidates.count > ROOMS_MAX_CANDS || m3.prefill_rank >= ROOMS_MAX_RANKS) {
      manager_reject(m, peer, "M3", m3.candidates.count > ROOMS_MAX_CANDS ? "too many speculative candidates"
                                                                           : "prefill rank out of range");
      return;
    }
    for (size_t i = 0; i < m3.candidates.count; i++) cands[i] = wire_i32_at(m3.candidates, i);
    /* The bytes the prefill wrote must be visible before anyone sees Success. */
    kvf_engine_sync(m->engine);
    rc = rooms_record_response(m->rooms, m3.room, (int)m3.prefill_rank, m3.bootstrap_token, cands,
                               m3.candidates.count, NULL);
  } else if (m3.status == WIRE_STATUS_FAILED && m3.reason_len) {
    /* A kvferry prefill says why (M3 frame 5); keep it printable. */
    char said[WIRE_REASON_LEN], reason[ROOMS_REASON_MAX];
    for (size_t i = 0; i < m3.reason_len; i++)
      said[i] = m3.reason[i] >= 0x20 && m3.reason[i] < 0x7f ? m3.reason[i] : '?';
    said[m3.reason_len] = 0;
    set_reason(reason, sizeof reason, "Failed to get kvcache from prefill rank %" PRId64 " (%s): %s", m3.prefill_rank,
               peer, said);
    rc = rooms_fail(m->rooms, m3.room, reason);
  } else if (m3.status == WIRE_STATUS_FAILED) {
    rc = rooms_fail(m->rooms, m3.room, "Failed to get kvcache from prefill instance, it might be dead");
  } else {
    rc = rooms_update(m->rooms, m3.room, m3.status, NULL);
  }
  if (rc == KVF_ENOTFOUND) {
    atomic_fetch_add(&m->stats.messages_unknown_room, 1);
  } else if (rc) {
    manager_reject(m, peer, "M3", kvf_strerror(rc));
  } else {
    atomic_fetch_add(&m->stats.messages_received, 1);
  }
}

/* ------------------------------------------------------------ heartbeat */

typedef struct dead_addr {
  const char *addr;
  uint64_t epoch;
} dead_addr;

static int match_dead(int64_t room, void *user, void *arg) {
  (void)room;
  const kvf_receiver *r = user;
  const dead_addr *d = arg;
  if (!r) return 0;
  uint64_t e = atomic_load(&r->epoch);
  return e && e <= d->epoch && !strcmp(r->addr, d->addr);
}

/* §7.2, with exact address matching: drop the address's cache entries,
 * forget the sockets to its ranks, fail its live rooms that are not Success. */
static void node_failure(kvf_manager *m, const char *addr, const char *why) {
  struct decode_state *ds = m->decode;
  pool_entry **dropped = NULL;
  size_t ndropped = 0;
  dead_addr d = {addr, 0};

  pthread_mutex_lock(&ds->lock);
  void *v = NULL;
  if (smap_del(&ds->infos, addr, &v)) addr_entry_free(v);
  d.epoch = ds->next_epoch; /* every receiver built for this address so far is affected */
  size_t cap = smap_size(&ds->pools);
  dropped = calloc(cap ? cap : 1, sizeof *dropped);
  map_iter it;
  map_iter_init(&it);
  const char *key;
  while (dropped && smap_next(&ds->pools, &it, &key, &v)) {
    pool_entry *p = v;
    if (strcmp(p->addr, addr)) continue;
    smap_del(&ds->pools, key, NULL);
    dropped[ndropped++] = p;
  }
  pthread_mutex_unlock(&ds->lock);

  for (size_t i = 0; i < ndropped; i++) {
    for (int t = 0; t < dropped[i]->ntargets; t++)
      if (dropped[i]->targets[t].port) manager_push_forget(m, dropped[i]->targets[t].ip, dropped[i]->targets[t].port);
    pool_unref(dropped[i]);
  }
  free(dropped);

  char reason[ROOMS_REASON_MAX];
  set_reason(reason, sizeof reason, "Losing connection with prefill instance (bootstrap_addr: %s)%s%s", addr,
             why ? ": " : "", why ? why : "");
  size_t nfailed = 0;
  rooms_fail_matching(m->rooms, match_dead, &d, reason, &nfailed);
  atomic_fetch_add(&m->stats.node_failures, 1);
  LOG_ERROR("kv", "%s, affected %zu requests", reason, nfailed);
}

static int match_pool(int64_t room, void *user, void *arg) {
  (void)room;
  const kvf_receiver *r = user;
  return r && atomic_load(&r->pool_tag) == (uintptr_t)arg;
}

/* One rank lookup of a revalidation round, shared by the entries that target it. */
typedef struct rank_seen {
  int rank;
  int64_t group;
  int ok; /* the lookup answered; otherwise the /health logic decides */
  char ip[ROUTE_IP_MAX + 1];
  int port;
} rank_seen;

/* §8.10: /health proves only the HTTP thread alive. After a good probe,
 * look the cached targets of `addr` up again; a rank that re-registered at
 * another (ip, port) restarted, so drop the entries that point at its old
 * address, forget that socket and fail the live rooms sent there. A lookup
 * that fails is not a restart. At most one lookup per distinct (rank, group)
 * of the cached entries; no lock is held across HTTP. */
static void revalidate_ranks(kvf_manager *m, bootstrap_client *c, const char *addr) {
  struct decode_state *ds = m->decode;
  pool_entry **ps = NULL;
  char **keys = NULL;
  rank_seen *seen = NULL;
  size_t n = 0, nseen = 0, ntargets = 0;

  pthread_mutex_lock(&ds->lock);
  size_t cap = smap_size(&ds->pools);
  ps = calloc(cap ? cap : 1, sizeof *ps);
  keys = calloc(cap ? cap : 1, sizeof *keys);
  map_iter it;
  map_iter_init(&it);
  const char *key;
  void *v;
  while (ps && keys && n < cap && smap_next(&ds->pools, &it, &key, &v)) {
    pool_entry *p = v;
    if (strcmp(p->addr, addr) || !(keys[n] = strdup(key))) continue;
    atomic_fetch_add(&p->refs, 1);
    ntargets += (size_t)p->ntargets;
    ps[n++] = p;
  }
  pthread_mutex_unlock(&ds->lock);
  if (n) seen = calloc(ntargets ? ntargets : 1, sizeof *seen);

  for (size_t i = 0; seen && i < n; i++) {
    pool_entry *p = ps[i];
    int changed = -1; /* index of the first restarted target */
    const rank_seen *now = NULL;
    for (int t = 0; t < p->ntargets; t++) {
      const pool_target *pt = &p->targets[t];
      rank_seen *s = NULL;
      for (size_t k = 0; k < nseen && !s; k++)
        if (seen[k].rank == pt->rank && seen[k].group == p->group) s = &seen[k];
      if (!s) {
        s = &seen[nseen++];
        *s = (rank_seen){.rank = pt->rank, .group = p->group};
        s->ok = !bootstrap_client_get_rank(c, pt->rank, (int)p->group, s->ip, sizeof s->ip, &s->port) &&
                s->port > 0 && s->port <= 65535;
      }
      if (!s->ok || (!strcmp(s->ip, pt->ip) && s->port == pt->port)) continue;
      if (changed < 0) changed = t, now = s;
      manager_push_forget(m, pt->ip, pt->port);
    }
    if (changed < 0) continue;

    pthread_mutex_lock(&ds->lock);
    int owned = smap_get(&ds->pools, keys[i]) == p && smap_del(&ds->pools, keys[i], NULL);
    pthread_mutex_unlock(&ds->lock);
    if (owned) pool_unref(p); /* the map's reference; ours keeps the tag unique */

    char reason[ROOMS_REASON_MAX];
    set_reason(reason, sizeof reason, "Prefill rank %d of %s restarted (now %s:%d)", p->targets[changed].rank, addr,
               now->ip, now->port);
    size_t nfailed = 0;
    rooms_fail_matching(m->rooms, match_pool, p, reason, &nfailed);
    atomic_fetch_add(&m->stats.node_failures, 1);
    LOG_ERROR("kv", "%s (was %s:%u), affected %zu requests", reason, p->targets[changed].ip,
              (unsigned)p->targets[changed].port, nfailed);
  }

  for (size_t i = 0; i < n; i++) {
    pool_unref(ps[i]);
    free(keys[i]);
  }
  free(ps);
  free(keys);
  free(seen);
}

/* The distinct (ip, port) of every cached target rank of `addr`. */
static kvf__probe_target *collect_ranks(kvf_manager *m, const char *addr, size_t *n) {
  struct decode_state *ds = m->decode;
  kvf__probe_target *t = NULL;
  size_t cap = 0;
  *n = 0;
  pthread_mutex_lock(&ds->lock);
  map_iter it;
  map_iter_init(&it);
  void *v;
  while (smap_next(&ds->pools, &it, NULL, &v)) {
    const pool_entry *p = v;
    if (strcmp(p->addr, addr)) continue;
    for (int i = 0; i < p->ntargets; i++) {
      const pool_target *pt = &p->targets[i];
      size_t k = 0;
      while (k < *n && !(t[k].port == pt->port && !strcmp(t[k].ip, pt->ip))) k++;
      if (k < *n || !pt->port) continue;
      if (*n == cap) {
        size_t nc = cap ? 2 * cap : 8;
        kvf__probe_target *nt = realloc(t, nc * sizeof *nt);
        if (!nt) goto out;
        t = nt, cap = nc;
      }
      t[*n] = (kvf__probe_target){.port = pt->port, .rank = pt->rank};
      snprintf(t[*n].ip, sizeof t[*n].ip, "%s", pt->ip);
      (*n)++;
    }
  }
out:
  pthread_mutex_unlock(&ds->lock);
  return t;
}

static int ms_capped(int ms, double cap_s) {
  double cap_ms = cap_s * 1000;
  return cap_ms < ms ? (cap_ms < 1 ? 1 : (int)cap_ms) : ms;
}

/* One heartbeat probe of `addr` (issue 13, defects 1 and 2). The rule: when
 * the address has cached target ranks, the ranks decide. Any rank that does
 * not answer with a ZMTP greeting (refused, closed, or nothing within the
 * probe timeout) makes the round a failure, whatever /health says; when
 * every rank answers the round is good even if /health fails (a slow or
 * stopped bootstrap server alone condemns no live prefill; it is counted in
 * heartbeat_failures). /health then serves only the restart revalidation.
 * With no cached rank (no receiver got that far), /health alone decides, as
 * in the reference. Returns 0 for a good round; else fills `why`. */
static int probe_addr(kvf_manager *m, hb_peer *p, const char *addr, char *why, size_t cap) {
  double interval = m->cfg.heartbeat_interval_s;
  size_t n = 0;
  kvf__probe_target *t = collect_ranks(m, addr, &n);
  int ranks_ok = 1;
  if (n) {
    kvf__probe_ranks(t, n, ms_capped(DECODE_PROBE_TIMEOUT_MS, interval));
    for (size_t i = 0; i < n && ranks_ok; i++)
      if (t[i].result) {
        ranks_ok = 0;
        set_reason(why, cap, "prefill rank %d at %s:%u does not answer (%s)", t[i].rank, t[i].ip,
                   (unsigned)t[i].port, kvf_strerror(t[i].result));
      }
  }
  free(t);
  if (!ranks_ok) {
    atomic_fetch_add(&m->stats.heartbeat_failures, 1);
    return KVF_ECLOSED;
  }
  if (!p->client) {
    int tmo = ms_capped(DECODE_HB_TIMEOUT_MS, interval);
    bootstrap_client_opts o = {.token = "", .connect_timeout_ms = ms_capped(DECODE_HB_CONNECT_MS, interval),
                               .timeout_ms = tmo};
    bootstrap_client_create(addr, &o, &p->client);
  }
  int rc = p->client ? bootstrap_client_health(p->client) : KVF_EIO;
  if (!rc) {
    revalidate_ranks(m, p->client, addr);
    return 0;
  }
  atomic_fetch_add(&m->stats.heartbeat_failures, 1);
  /* A fresh connection next time, as the reference drops its session. */
  bootstrap_client_destroy(p->client);
  p->client = NULL;
  set_reason(why, cap, "its bootstrap server does not answer /health (%s)", kvf_strerror(rc));
  if (n) {
    LOG_INFO("kv", "%s: %s; its %zu rank(s) answer, so it is not declared dead", addr, why, n);
    return 0;
  }
  return rc;
}

static void hb_peer_free(hb_peer *p) {
  if (!p) return;
  bootstrap_client_destroy(p->client);
  free(p);
}

static void heartbeat_round(kvf_manager *m) {
  struct decode_state *ds = m->decode;
  char **addrs = NULL;
  size_t naddrs = 0;
  pthread_mutex_lock(&ds->lock);
  size_t cap = smap_size(&ds->infos);
  addrs = calloc(cap ? cap : 1, sizeof *addrs);
  map_iter it;
  map_iter_init(&it);
  const char *key;
  while (addrs && naddrs < cap && smap_next(&ds->infos, &it, &key, NULL))
    if ((addrs[naddrs] = strdup(key))) naddrs++;
  pthread_mutex_unlock(&ds->lock);
  if (!addrs) return;

  map_iter_init(&it);
  void *v;
  while (smap_next(&ds->hb_peers, &it, NULL, &v)) ((hb_peer *)v)->seen = 0;
  for (size_t i = 0; i < naddrs; i++) {
    pthread_mutex_lock(&ds->hb_lock);
    int stop = ds->hb_stop;
    pthread_mutex_unlock(&ds->hb_lock);
    if (stop) break;
    hb_peer *p = smap_get(&ds->hb_peers, addrs[i]);
    if (!p) {
      if (!(p = calloc(1, sizeof *p))) continue;
      if (smap_put(&ds->hb_peers, addrs[i], p, NULL)) {
        free(p);
        continue;
      }
    }
    p->seen = 1;
    char why[ROOMS_REASON_MAX / 2] = "";
    int rc = probe_addr(m, p, addrs[i], why, sizeof why);
    if (!rc) {
      p->failures = 0;
      continue;
    }
    LOG_INFO("kv", "Attempting to reconnect to %s (%s)...", addrs[i], why);
    p->failures++;
    if (p->failures >= m->cfg.heartbeat_max_failures) {
      node_failure(m, addrs[i], why);
      p->failures = 0; /* §8.10: a later single miss must not re-trigger */
    }
  }
  /* Forget peers no longer probed (declared dead, or never used again). */
  map_iter_init(&it);
  while (smap_next(&ds->hb_peers, &it, &key, &v)) {
    hb_peer *p = v;
    if (p->seen) continue;
    smap_del(&ds->hb_peers, key, NULL);
    hb_peer_free(p);
  }
  for (size_t i = 0; i < naddrs; i++) free(addrs[i]);
  free(addrs);
}

static void *heartbeat_main(void *arg) {
  kvf_manager *m = arg;
  struct decode_state *ds = m->decode;
  int64_t period_ns = (int64_t)(m->cfg.heartbeat_interval_s * 1e9);
  /* Sleep first, then probe (§7.1); the condvar lets decode_stop wake us.
   * Rounds start at a fixed rate, so a round that waited on its probe
   * timeouts does not push the next one back (detection stays within
   * interval x max_failures plus one probe timeout). */
  int64_t wake = clock_now_ns();
  for (;;) {
    wake += period_ns;
    if (wake < clock_now_ns()) wake = clock_now_ns(); /* overran a whole period: probe at once */
    pthread_mutex_lock(&ds->hb_lock);
    while (!ds->hb_stop && clock_now_ns() < wake) {
      struct timespec ts = clock_ts_from_ns(wake);
      pthread_cond_timedwait(&ds->hb_cond, &ds->hb_lock, &ts);
    }
    int stop = ds->hb_stop;
    pthread_mutex_unlock(&ds->hb_lock);
    if (stop) break;
    heartbeat_round(m);
  }
  return NULL;
}

/* ------------------------------------------------------------ lifecycle */

static void free_state(struct decode_state *ds) {
  if (!ds) return;
  map_iter it;
  void *v;
  map_iter_init(&it);
  while (smap_next(&ds->infos, &it, NULL, &v)) addr_entry_free(v);
  smap_free(&ds->infos);
  map_iter_init(&it);
  while (smap_next(&ds->pools, &it, NULL, &v)) pool_unref(v);
  smap_free(&ds->pools);
  map_iter_init(&it);
  while (smap_next(&ds->hb_peers, &it, NULL, &v)) hb_peer_free(v);
  smap_free(&ds->hb_peers);
  free(ds->lay_start), free(ds->lay_bufs);
  free(ds->d_kv_item), free(ds->d_kv_unit), free(ds->d_state_item), free(ds->d_state_unit);
  pthread_mutex_destroy(&ds->lock);
  pthread_mutex_destroy(&ds->hb_lock);
  pthread_cond_destroy(&ds->hb_cond);
  free(ds);
}

int decode_start(kvf_manager *m) {
  struct decode_state *ds = calloc(1, sizeof *ds);
  if (!ds) return KVF_ENOMEM;
  int rc = KVF_ENOMEM;
  pthread_mutex_init(&ds->lock, NULL);
  pthread_mutex_init(&ds->hb_lock, NULL);
  clock_cond_init(&ds->hb_cond);
  if (smap_init(&ds->infos) || smap_init(&ds->pools) || smap_init(&ds->hb_peers)) goto fail;
  const manager_buffers *b = &m->bufs;
  size_t nb = b->layer_buf_start[b->n_layers];
  ds->lay_start = calloc(b->n_layers + 1, sizeof *ds->lay_start);
  ds->lay_bufs = calloc(nb ? nb : 1, sizeof *ds->lay_bufs);
  ds->d_kv_item = to_i64(b->kv_item_lens, b->n_kv);
  ds->d_kv_unit = to_i64(b->kv_unit_lens, b->n_kv);
  ds->d_state_item = to_i64(b->state_item_lens, b->n_state);
  ds->d_state_unit = to_i64(b->state_unit_lens, b->n_state);
  if (!ds->lay_start || !ds->lay_bufs || !ds->d_kv_item || !ds->d_kv_unit || !ds->d_state_item ||
      !ds->d_state_unit)
    goto fail;
  for (size_t l = 0; l <= b->n_layers; l++) ds->lay_start[l] = b->layer_buf_start[l];
  for (size_t k = 0; k < nb; k++) ds->lay_bufs[k] = b->layer_bufs[k];
  ds->layout = (plan_layout){.nlayers = b->n_layers, .start = ds->lay_start, .bufs = ds->lay_bufs};
  m->decode = ds;
  if (pthread_create(&ds->hb, NULL, heartbeat_main, m)) {
    m->decode = NULL;
    goto fail;
  }
  ds->hb_started = 1;
  return 0;
fail:
  free_state(ds);
  return rc;
}

void decode_stop(kvf_manager *m) {
  struct decode_state *ds = m->decode;
  if (!ds) return;
  if (ds->hb_started) {
    pthread_mutex_lock(&ds->hb_lock);
    ds->hb_stop = 1;
    pthread_cond_signal(&ds->hb_cond);
    pthread_mutex_unlock(&ds->hb_lock);
    pthread_join(ds->hb, NULL);
  }
  m->decode = NULL;
  free_state(ds);
}

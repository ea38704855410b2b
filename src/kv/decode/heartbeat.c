/* The decode heartbeat (§7.1, §8.10): probes every cached bootstrap address
 * and its target ranks, declares node failure (drops cache entries, fails
 * their rooms, forgets PUSH sockets), and revalidates ranks that may have
 * restarted elsewhere. */
#include "kv/decode/decode_int.h"

#include "base/hash.h"
#include "base/thread.h"
#include "base/parse.h"

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
  if (kvf__smap_del(&ds->infos, addr, &v)) kvf__dec_addr_entry_free(v);
  d.epoch = ds->next_epoch; /* every receiver built for this address so far is affected */
  size_t cap = smap_size(&ds->pools);
  dropped = calloc(cap ? cap : 1, sizeof *dropped);
  map_iter it;
  kvf__map_iter_init(&it);
  const char *key;
  while (dropped && kvf__smap_next(&ds->pools, &it, &key, &v)) {
    pool_entry *p = v;
    if (strcmp(p->addr, addr)) continue;
    kvf__smap_del(&ds->pools, key, NULL);
    dropped[ndropped++] = p;
  }
  pthread_mutex_unlock(&ds->lock);

  for (size_t i = 0; i < ndropped; i++) {
    for (int t = 0; t < dropped[i]->ntargets; t++)
      if (dropped[i]->targets[t].port)
        kvf__manager_push_forget(m, dropped[i]->targets[t].ip, dropped[i]->targets[t].port);
    kvf__dec_pool_unref(dropped[i]);
  }
  free(dropped);

  char reason[ROOMS_REASON_MAX];
  kvf__dec_set_reason(reason, sizeof reason, "Losing connection with prefill instance (bootstrap_addr: %s)%s%s",
                      addr, why ? ": " : "", why ? why : "");
  size_t nfailed = 0;
  kvf__rooms_fail_matching(m->rooms, match_dead, &d, reason, &nfailed);
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
  char ip[KVF_ADDR_HOST_LEN];
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
  kvf__map_iter_init(&it);
  const char *key;
  void *v;
  while (ps && keys && n < cap && kvf__smap_next(&ds->pools, &it, &key, &v)) {
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
        s->ok = !kvf__bootstrap_client_get_rank(c, pt->rank, (int)p->group, s->ip, sizeof s->ip, &s->port) &&
                s->port > 0 && s->port <= 65535;
      }
      if (!s->ok || (!strcmp(s->ip, pt->ip) && s->port == pt->port)) continue;
      if (changed < 0) changed = t, now = s;
      kvf__manager_push_forget(m, pt->ip, pt->port);
    }
    if (changed < 0) continue;

    pthread_mutex_lock(&ds->lock);
    int owned = kvf__smap_get(&ds->pools, keys[i]) == p && kvf__smap_del(&ds->pools, keys[i], NULL);
    pthread_mutex_unlock(&ds->lock);
    if (owned) kvf__dec_pool_unref(p); /* the map's reference; ours keeps the tag unique */

    char reason[ROOMS_REASON_MAX];
    kvf__dec_set_reason(reason, sizeof reason, "Prefill rank %d of %s restarted (now %s)",
                        p->targets[changed].rank, addr, kvf__addr_str(now->ip, (uint16_t)now->port).s);
    size_t nfailed = 0;
    kvf__rooms_fail_matching(m->rooms, match_pool, p, reason, &nfailed);
    atomic_fetch_add(&m->stats.node_failures, 1);
    LOG_ERROR("kv", "%s (was %s), affected %zu requests", reason,
              kvf__addr_str(p->targets[changed].ip, p->targets[changed].port).s, nfailed);
  }

  for (size_t i = 0; i < n; i++) {
    kvf__dec_pool_unref(ps[i]);
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
  kvf__map_iter_init(&it);
  void *v;
  while (kvf__smap_next(&ds->pools, &it, NULL, &v)) {
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
      kvf__str_copy(t[*n].ip, sizeof t[*n].ip, pt->ip);
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

static int hb_stopping(struct decode_state *ds) {
  pthread_mutex_lock(&ds->hb_lock);
  int stop = ds->hb_stop;
  pthread_mutex_unlock(&ds->hb_lock);
  return stop;
}

/* kvf__bootstrap_client_set_stop's test: the manager is being destroyed. */
static int hb_stop_cb(void *ds) { return hb_stopping(ds); }

/* One heartbeat probe of `addr` (issue 13, defects 1 and 2). The rule: when
 * the address has cached target ranks, the ranks decide. Any rank that does
 * not answer with a ZMTP greeting (refused, closed, or nothing within the
 * probe timeout) makes the round a failure, whatever /health says; when
 * every rank answers the round is good even if /health fails (a slow or
 * stopped bootstrap server alone condemns no live prefill; it is counted in
 * heartbeat_failures). /health then serves only the restart revalidation.
 * With no cached rank (no receiver got that far), /health alone decides, as
 * in the reference. Returns 0 for a good round; else fills `why`. */
static int probe_addr(kvf_manager *m, const char *addr, char *why, size_t cap) {
  double interval = m->cfg.heartbeat_interval_s;
  size_t n = 0;
  kvf__probe_target *t = collect_ranks(m, addr, &n);
  int ranks_ok = 1;
  if (n) {
    kvf__probe_ranks(t, n, ms_capped(DECODE_PROBE_TIMEOUT_MS, interval));
    for (size_t i = 0; i < n && ranks_ok; i++)
      if (t[i].result) {
        ranks_ok = 0;
        kvf__dec_set_reason(why, cap, "prefill rank %d at %s does not answer (%s)", t[i].rank,
                            kvf__addr_str(t[i].ip, t[i].port).s, kvf_strerror(t[i].result));
      }
  }
  free(t);
  if (!ranks_ok) {
    atomic_fetch_add(&m->stats.heartbeat_failures, 1);
    return KVF_ECLOSED;
  }
  if (hb_stopping(m->decode)) return 0; /* the verdict would not be acted on */
  /* A client (and a connection) per probe, closed after it: one kept per
   * prefill address held a keep-alive connection, an HTTP session on the
   * bootstrap server and libcurl's socket pair, three descriptors and about
   * 25 KiB over the two processes per idle peer (issue 24), to save one
   * TCP handshake every heartbeat_interval. */
  bootstrap_client *c = NULL;
  bootstrap_client_opts o = {.token = "",
                             .connect_timeout_ms = ms_capped(DECODE_HB_CONNECT_MS, interval),
                             .timeout_ms = ms_capped(DECODE_HB_TIMEOUT_MS, interval)};
  kvf__bootstrap_client_create(addr, &o, &c);
  /* /health and the ranks' revalidation share one budget: a bootstrap
   * server answering each request just in time must not delay the round's
   * verdicts on every other prefill by one timeout per rank. */
  kvf__bootstrap_client_set_deadline(c, clock_deadline_ms(o.timeout_ms));
  kvf__bootstrap_client_set_stop(c, hb_stop_cb, m->decode); /* kvf_manager_destroy does not wait it out */
  int rc = c ? kvf__bootstrap_client_health(c) : KVF_EIO;
  if (!rc) revalidate_ranks(m, c, addr);
  kvf__bootstrap_client_destroy(c);
  if (!rc || hb_stopping(m->decode)) return 0;
  atomic_fetch_add(&m->stats.heartbeat_failures, 1);
  kvf__dec_set_reason(why, cap, "its bootstrap server does not answer /health (%s)", kvf_strerror(rc));
  if (n) {
    LOG_INFO("kv", "%s: %s; its %zu rank(s) answer, so it is not declared dead", addr, why, n);
    return 0;
  }
  return rc;
}

void kvf__dec_hb_peer_free(hb_peer *p) { free(p); }

/* One round's probes, spread over up to DECODE_HB_PARALLEL threads: a
 * prefill whose ranks or bootstrap server hang until their timeouts delays
 * no other address's probe. Each address is probed by one thread; the
 * verdicts are acted on afterwards by the heartbeat thread alone. */
typedef struct hb_round {
  kvf_manager *m;
  char **addrs;
  hb_peer **peers;
  int *rcs;
  char (*whys)[ROOMS_REASON_MAX / 2];
  size_t n;
  atomic_size_t next;
} hb_round;

static void *hb_round_worker(void *arg) {
  kvf__thread_name("kvf-hb-probe");
  hb_round *r = arg;
  for (size_t i; (i = atomic_fetch_add(&r->next, 1)) < r->n;)
    r->rcs[i] = hb_stopping(r->m->decode) ? 0 : probe_addr(r->m, r->addrs[i], r->whys[i], sizeof r->whys[i]);
  return NULL;
}

static void hb_round_probe(hb_round *r) {
  pthread_t th[DECODE_HB_PARALLEL - 1];
  size_t nth = 0, want = r->n < DECODE_HB_PARALLEL ? r->n : DECODE_HB_PARALLEL;
  while (nth + 1 < want && !pthread_create(&th[nth], NULL, hb_round_worker, r)) nth++;
  hb_round_worker(r); /* this thread too: the round completes without any helper */
  for (size_t i = 0; i < nth; i++) pthread_join(th[i], NULL);
}

static void heartbeat_round(kvf_manager *m) {
  struct decode_state *ds = m->decode;
  hb_round r = {.m = m};
  pthread_mutex_lock(&ds->lock);
  size_t cap = smap_size(&ds->infos);
  r.addrs = calloc(cap ? cap : 1, sizeof *r.addrs);
  map_iter it;
  kvf__map_iter_init(&it);
  const char *key;
  while (r.addrs && r.n < cap && kvf__smap_next(&ds->infos, &it, &key, NULL))
    if ((r.addrs[r.n] = strdup(key))) r.n++;
  pthread_mutex_unlock(&ds->lock);
  r.peers = calloc(r.n ? r.n : 1, sizeof *r.peers);
  r.rcs = calloc(r.n ? r.n : 1, sizeof *r.rcs);
  r.whys = calloc(r.n ? r.n : 1, sizeof *r.whys);
  if (!r.addrs || !r.peers || !r.rcs || !r.whys) goto out;

  void *v;
  kvf__map_iter_init(&it);
  while (kvf__smap_next(&ds->hb_peers, &it, NULL, &v)) ((hb_peer *)v)->seen = 0;
  size_t kept = 0; /* addresses with a peer record, in r.addrs[0..kept) */
  for (size_t i = 0; i < r.n; i++) {
    hb_peer *p = kvf__smap_get(&ds->hb_peers, r.addrs[i]);
    if (!p && (p = calloc(1, sizeof *p)) && kvf__smap_put(&ds->hb_peers, r.addrs[i], p, NULL)) {
      free(p);
      p = NULL;
    }
    if (!p) {
      free(r.addrs[i]);
      continue;
    }
    p->seen = 1;
    r.addrs[kept] = r.addrs[i];
    r.peers[kept++] = p;
  }
  r.n = kept;
  hb_round_probe(&r);
  for (size_t i = 0; i < r.n && !hb_stopping(ds); i++) {
    hb_peer *p = r.peers[i];
    if (!r.rcs[i]) {
      p->failures = 0;
      continue;
    }
    LOG_INFO("kv", "Attempting to reconnect to %s (%s)...", r.addrs[i], r.whys[i]);
    p->failures++;
    if (p->failures >= m->cfg.heartbeat_max_failures) {
      node_failure(m, r.addrs[i], r.whys[i]);
      p->failures = 0; /* §8.10: a later single miss must not re-trigger */
    }
  }
  /* Forget peers no longer probed (declared dead, or never used again). */
  kvf__map_iter_init(&it);
  while (kvf__smap_next(&ds->hb_peers, &it, &key, &v)) {
    hb_peer *p = v;
    if (p->seen) continue;
    kvf__smap_del(&ds->hb_peers, key, NULL);
    kvf__dec_hb_peer_free(p);
  }
out:
  for (size_t i = 0; r.addrs && i < r.n; i++) free(r.addrs[i]);
  free(r.addrs);
  free(r.peers);
  free(r.rcs);
  free(r.whys);
}

void *kvf__dec_heartbeat_main(void *arg) {
  kvf__thread_name("kvf-hb");
  kvf_manager *m = arg;
  struct decode_state *ds = m->decode;
  int64_t period_ns = (int64_t)(m->cfg.heartbeat_interval_s * 1e9);
  /* Sleep first, then probe (§7.1); the condvar lets kvf__decode_stop wake us.
   * Rounds start at a fixed rate, so a round that waited on its probe
   * timeouts does not push the next one back (detection stays within
   * interval x max_failures plus one probe timeout). */
  /* The first round comes after half to one whole interval, at random: many
   * decode ranks started together would otherwise probe every prefill rank
   * at the same instant each round, a burst of connections per round. */
  int64_t now = clock_now_ns();
  struct {
    int64_t t;
    const void *m;
  } seed = {now, m};
  int64_t wake = now - (int64_t)(kvf__hash64(&seed, sizeof seed) % (uint64_t)(period_ns / 2 + 1));
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

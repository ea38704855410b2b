/* The transfer engine's public face: configuration, registration, batches
 * and their completion. Transport-neutral: a batch is cut into chunks here
 * and handed to the transport's submit; each chunk reports back through
 * kvf__batch_chunk_done, and the batch completes when the last chunk has. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <unistd.h>

#include "base/addr.h"
#include "base/clock.h"
#include "base/config.h"
#include "base/env.h"
#include "base/hostmem.h"
#include "base/log.h"
#include "base/wake.h"
#include "base/parse.h"
#include "engine/async.h"
#include "engine/engine_internal.h"

#define ENGINE_MAX_DESC_PER_CHUNK 4096
/* A chunk of more than ENGINE_KEEP_WRITES_MIN descriptors takes an array of
 * ENGINE_MAX_DESC_PER_CHUNK (192 KiB) that the engine keeps for the next
 * large chunk, up to ENGINE_KEEP_WRITES arrays. Allocated per chunk, such
 * arrays went back to the kernel when freed (glibc trims or unmaps them) and
 * came back as fresh pages: a 4 096-token llama-3.1-8b request (16 384
 * descriptors, 4 chunks) spent 3.3 ms of its 30 ms in the page faults of its
 * descriptor copies before its first notice went out (this VM). */
#define ENGINE_KEEP_WRITES_MIN 1024
#define ENGINE_KEEP_WRITES 8
#define ENGINE_FEW_CHUNKS 8 /* a batch of up to this many chunks lists them on the stack */
/* Below this a batch goes on one connection: a second ack costs more than
 * the parallel copy saves. */
#define ENGINE_SPLIT_MIN_BYTES (512u * 1024u)

void kvf_engine_config_init(kvf_engine_config *cfg) {
  if (!cfg) return;
  memset(cfg, 0, sizeof *cfg);
  cfg->size = sizeof *cfg;
  cfg->host = "127.0.0.1";
  cfg->port = 0;
  cfg->transport = NULL; /* $KVFERRY_TRANSPORT, else "auto" */
  cfg->auth_token = NULL;
  cfg->timeout_ms = 30000;
  cfg->conns_per_peer = 2;
  cfg->max_inbound_conns = 256;
  cfg->ucx_mode = NULL;   /* $KVFERRY_UCX_MODE, else "read" */
  cfg->read_lease_ms = 0; /* the batch deadline (timeout_ms) */
  cfg->lock_pools = 1;
}

static const kvf__field engine_fields[] = {
    KVF__FIELD(kvf_engine_config, host, KVF__FIELD_STR),
    KVF__FIELD(kvf_engine_config, port, KVF__FIELD_U16),
    KVF__FIELD(kvf_engine_config, transport, KVF__FIELD_STR),
    KVF__FIELD(kvf_engine_config, auth_token, KVF__FIELD_STR),
    KVF__FIELD(kvf_engine_config, timeout_ms, KVF__FIELD_INT),
    KVF__FIELD(kvf_engine_config, conns_per_peer, KVF__FIELD_INT),
    KVF__FIELD(kvf_engine_config, max_inbound_conns, KVF__FIELD_INT),
    KVF__FIELD(kvf_engine_config, ucx_mode, KVF__FIELD_STR),
    KVF__FIELD(kvf_engine_config, read_lease_ms, KVF__FIELD_INT),
    KVF__FIELD(kvf_engine_config, lock_pools, KVF__FIELD_INT),
};

int kvf_engine_config_set(kvf_engine_config *cfg, const char *name, const char *value) {
  return kvf__config_set(cfg, KVF_ENGINE_CONFIG_SIZE_V1, sizeof *cfg, engine_fields,
                         sizeof engine_fields / sizeof engine_fields[0], name, value);
}

int kvf_engine_create(const kvf_engine_config *cfg_in, kvf_engine **out) {
  kvf_engine_config cfg;
  kvf_engine_config_init(&cfg);
  if (!out || (cfg_in && kvf__config_copy(&cfg, sizeof cfg, cfg_in, KVF_ENGINE_CONFIG_SIZE_V1))) return KVF_EINVAL;
  if (!cfg.host || !*cfg.host) cfg.host = "127.0.0.1";
  if (!cfg.transport || !*cfg.transport) cfg.transport = getenv("KVFERRY_TRANSPORT");
  if (!cfg.transport || !*cfg.transport) cfg.transport = "auto";
  cfg.timeout_ms = (int)kvf__env_get_int("KVFERRY_TIMEOUT_MS", cfg.timeout_ms > 0 ? cfg.timeout_ms : 30000);
  cfg.conns_per_peer = (int)kvf__env_get_int("KVFERRY_CONNS_PER_PEER", cfg.conns_per_peer);
  if (cfg.timeout_ms <= 0) cfg.timeout_ms = 30000;
  if (cfg.conns_per_peer < 1) cfg.conns_per_peer = 1;
  if (cfg.conns_per_peer > 16) cfg.conns_per_peer = 16;
  if (cfg.max_inbound_conns <= 0) cfg.max_inbound_conns = 256;
  if (!cfg.ucx_mode || !*cfg.ucx_mode) cfg.ucx_mode = getenv("KVFERRY_UCX_MODE");
  if (!cfg.ucx_mode || !*cfg.ucx_mode) cfg.ucx_mode = "read";
  if (strcmp(cfg.ucx_mode, "read") && strcmp(cfg.ucx_mode, "write")) {
    LOG_ERROR("engine", "unknown ucx_mode '%s' (read or write)", cfg.ucx_mode);
    return KVF_EINVAL;
  }
  int ucx_read = !strcmp(cfg.ucx_mode, "read");
  cfg.ucx_mode = ucx_read ? "read" : "write"; /* not the caller's or getenv's string */
  cfg.read_lease_ms = (int)kvf__env_get_int("KVFERRY_READ_LEASE_MS", cfg.read_lease_ms);
  cfg.lock_pools = kvf__env_get_int("KVFERRY_LOCK_POOLS", cfg.lock_pools) != 0;
  if (cfg.read_lease_ms <= 0) cfg.read_lease_ms = cfg.timeout_ms; /* as long as a write over TCP may take */
  if (cfg.read_lease_ms > ENGINE_MAX_LEASE_MS) cfg.read_lease_ms = ENGINE_MAX_LEASE_MS;

  const transport_ops *ops = NULL;
  int want_ucx = !strcmp(cfg.transport, "ucx"), is_auto = !strcmp(cfg.transport, "auto");
  if (!strcmp(cfg.transport, "tcp")) ops = &kvf__tcp_transport_ops;
#ifdef KVF_HAVE_UCX
  if (want_ucx || is_auto) ops = &kvf__ucx_transport_ops;
#else
  if (is_auto) ops = &kvf__tcp_transport_ops;
  if (want_ucx) {
    LOG_ERROR("engine", "transport 'ucx': this kvferry was built without UCX (available: %s)",
              kvf_engine_transports());
    return KVF_EINVAL;
  }
#endif
  if (!ops) {
    LOG_ERROR("engine", "unknown transport '%s' (tcp, ucx or auto; this build has %s)", cfg.transport,
              kvf_engine_transports());
    return KVF_EINVAL;
  }
  if (strlen(cfg.host) > KVF_ADDR_HOST_MAX) return KVF_EINVAL;
  cfg.transport = want_ucx ? "ucx" : is_auto ? "auto" : "tcp"; /* not the caller's or getenv's string */

  kvf_engine *e = calloc(1, sizeof *e);
  if (!e) return KVF_ENOMEM;
  int rc = kvf__regions_init(&e->regions);
  if (rc) goto err_free;
  if ((rc = kvf__fence_init(&e->fences))) goto err_regions;
  pthread_rwlock_init(&e->trailer_lock, NULL);
  pthread_mutex_init(&e->pools_mu, NULL);
  pthread_mutex_init(&e->spare_mu, NULL);
  pthread_mutex_init(&e->conn_mu, NULL);
  clock_cond_init(&e->conn_cv);
  kvf__str_copy(e->host, sizeof e->host, cfg.host);
  const char *tok = cfg.auth_token ? cfg.auth_token : getenv("KVFERRY_AUTH_TOKEN");
  if (tok && strlen(tok) >= sizeof e->auth_token) {
    LOG_ERROR("engine", "auth token longer than %zu bytes", sizeof e->auth_token - 1);
    rc = KVF_EINVAL;
    goto err_regions;
  }
  kvf__str_copy(e->auth_token, sizeof e->auth_token, tok ? tok : "");
  cfg.host = e->host;
  cfg.auth_token = e->auth_token;
  e->cfg = cfg;
  e->ops = ops;
  e->port = cfg.port;
  e->ucx_explicit = want_ucx;
  e->ucx_read = ucx_read;
  rc = ops->start(e);
  if (rc && is_auto && ops != &kvf__tcp_transport_ops) { /* auto: UCX would not start; say so, use TCP */
    LOG_INFO("engine", "transport auto: UCX did not start (%s); using tcp for every peer", kvf_strerror(rc));
    e->ops = ops = &kvf__tcp_transport_ops;
    rc = ops->start(e);
  }
  if (rc) goto err_regions;
  kvf__addr_format(e->session_id, sizeof e->session_id, e->host, e->port);
  LOG_INFO("engine", "listening as %s (transport %s)", e->session_id, ops->name);
  *out = e;
  return 0;

err_regions:
  pthread_mutex_destroy(&e->conn_mu);
  pthread_cond_destroy(&e->conn_cv);
  pthread_mutex_destroy(&e->spare_mu);
  pthread_mutex_destroy(&e->pools_mu);
  pthread_rwlock_destroy(&e->trailer_lock);
  kvf__fence_destroy(&e->fences);
  kvf__regions_destroy(&e->regions);
err_free:
  free(e);
  return rc;
}

void kvf_engine_destroy(kvf_engine *e) {
  if (!e) return;
  kvf__engine_connectors_stop(e); /* none submits once the transport stops */
  e->ops->stop(e);
  free(e->pools);
  free(e->nested);
  kvf__spare_free(&e->spare_batches); /* the transport is stopped: every batch and chunk came back */
  kvf__spare_free(&e->spare_chunks);
  kvf__spare_free(&e->spare_writes);
  pthread_mutex_destroy(&e->spare_mu);
  pthread_mutex_destroy(&e->conn_mu);
  pthread_cond_destroy(&e->conn_cv);
  pthread_mutex_destroy(&e->pools_mu);
  pthread_rwlock_destroy(&e->trailer_lock);
  kvf__fence_destroy(&e->fences);
  kvf__regions_destroy(&e->regions);
  free(e);
}

const char *kvf_engine_session_id(const kvf_engine *e) { return e->session_id; }
uint16_t kvf_engine_port(const kvf_engine *e) { return e->port; }

static int span_push(engine_span **v, size_t *n, size_t *cap, engine_span x) {
  if (*n == *cap) {
    size_t c = *cap ? *cap * 2 : 8;
    engine_span *nv = realloc(*v, c * sizeof *nv);
    if (!nv) return KVF_ENOMEM;
    *v = nv;
    *cap = c;
  }
  (*v)[(*n)++] = x;
  return 0;
}

/* Remove the last span of v starting at base (inside [lo, hi) when lo <
 * hi: every one in it); how many went. */
static size_t span_del(engine_span *v, size_t *n, uint64_t base, uint64_t lo, uint64_t hi) {
  size_t gone = 0;
  for (size_t i = *n; i-- > 0;) {
    int hit = lo < hi ? v[i].base >= lo && v[i].base + v[i].len <= hi : v[i].base == base;
    if (!hit) continue;
    memmove(&v[i], &v[i + 1], (*n - i - 1) * sizeof *v);
    (*n)--;
    gone++;
    if (lo >= hi) break;
  }
  return gone;
}

/* pools_mu held: does [base, base+len) lie inside an allocated pool? */
static int in_pool_locked(const kvf_engine *e, uint64_t base, uint64_t len) {
  for (size_t i = 0; i < e->npools; i++)
    if (base >= e->pools[i].base && base + len <= e->pools[i].base + e->pools[i].len) return 1;
  return 0;
}

int kvf_engine_register(kvf_engine *e, void *addr, size_t len) {
  uint64_t base = (uint64_t)(uintptr_t)addr;
  if (!e || !addr || !len || base + len < base) return KVF_EINVAL;
  int rc = KVF_EEXIST;
  pthread_mutex_lock(&e->pools_mu);
  if (in_pool_locked(e, base, len))
    rc = span_push(&e->nested, &e->nnested, &e->cap_nested, (engine_span){base, len});
  pthread_mutex_unlock(&e->pools_mu);
  if (rc != KVF_EEXIST) return rc; /* inside a pool, already registered whole */
  /* Device memory (not a readable host mapping; cannot tell: host) can be
   * moved only by a UCX built with CUDA: kvferry's TCP refuses writes into
   * it and batches from it rather than copy with the CPU. */
  int device = kvf__host_readable(base, len) == 0;
  if (device && !e->ops->reg && kvf__log_first_time(0x74637064u))
    LOG_WARN("engine",
             "%p+%zu is not readable host memory (device memory?): transport %s copies with the CPU and refuses "
             "writes into or out of it; device memory needs transport ucx with a UCX built with CUDA",
             addr, len, e->ops->name);
  rc = kvf__regions_add(&e->regions, base, len, device);
  if (!rc && e->ops->reg && (rc = e->ops->reg(e, addr, len)))
    kvf__regions_remove(&e->regions, (uint64_t)(uintptr_t)addr);
  if (rc) LOG_WARN("engine", "register %p+%zu failed: %s", addr, len, kvf_strerror(rc));
  return rc;
}

int kvf_engine_unregister(kvf_engine *e, void *addr) {
  if (!e || !addr) return KVF_EINVAL;
  pthread_mutex_lock(&e->pools_mu);
  size_t nested = span_del(e->nested, &e->nnested, (uint64_t)(uintptr_t)addr, 0, 0);
  pthread_mutex_unlock(&e->pools_mu);
  if (nested) return 0; /* the pool's region stays until kvf_engine_free_pool */
  int rc = kvf__regions_remove(&e->regions, (uint64_t)(uintptr_t)addr);
  if (!rc && e->ops->dereg) e->ops->dereg(e, addr);
  return rc;
}

const char *kvf_engine_transports(void) {
#ifdef KVF_HAVE_UCX
  return "tcp,ucx";
#else
  return "tcp";
#endif
}

const char *kvf_engine_transport(const kvf_engine *e) { return e->ops->name; }

int kvf_engine_peer_transport(kvf_engine *e, const char *session, char *out, size_t cap) {
  if (!e || !session || !out || !cap) return KVF_EINVAL;
  if (e->ops->describe) return e->ops->describe(e, session, out, cap);
  snprintf(out, cap, "tcp: transport tcp");
  return 0;
}

int kvf__engine_peer_path(kvf_engine *e, const char *session, const char **transport, const char **mode) {
  if (!e || !session || !transport || !mode) return KVF_EINVAL;
  if (e->ops->path) return e->ops->path(e, session, transport, mode);
  *transport = *mode = "tcp";
  return 0;
}

int kvf_engine_peer_routes(kvf_engine *e, char *out, size_t cap) {
  if (!e || !out || !cap) return KVF_EINVAL;
  out[0] = 0;
  return e->ops->routes ? e->ops->routes(e, out, cap) : 0;
}

/* Length of the registered region that starts at addr, or 0. */
static uint64_t region_len_at(kvf_engine *e, uint64_t addr) {
  uint64_t len = 0;
  pthread_rwlock_rdlock(&e->regions.lock);
  for (size_t i = 0; i < e->regions.n; i++)
    if (e->regions.items[i]->base == addr) len = e->regions.items[i]->len;
  pthread_rwlock_unlock(&e->regions.lock);
  return len;
}

/* kvf_engine_config.lock_pools: pin the pool's pages (best effort; the
 * first refusal is logged with the limit that refused it). */
static void pool_lock(kvf_engine *e, void *p, size_t len) {
  if (!e->cfg.lock_pools || !mlock(p, len)) return;
  int err = errno;
  struct rlimit rl = {0, 0};
  getrlimit(RLIMIT_MEMLOCK, &rl);
  if (!atomic_exchange(&e->lock_refused, 1))
    LOG_WARN("engine",
             "could not lock a %zu-byte pool in memory (%s; RLIMIT_MEMLOCK %llu bytes): its pages may be "
             "reclaimed and fault again on the next load (lock_pools, KVFERRY_LOCK_POOLS=0 to not try)",
             len, strerror(err), (unsigned long long)rl.rlim_cur);
}

/* A pool for an engine whose transport maps none itself (TCP): private
 * anonymous memory aligned to 2 MiB and marked for transparent huge pages
 * (MADV_HUGEPAGE, taken where the kernel's THP setting is `madvise` or
 * `always`), so the kernel's copies in and out of it (every TCP send and
 * receive) walk one page-table entry per 2 MiB. On this project's VMs a
 * TCP stream through ordinary 4 KiB pages ran at 0.39 GB/s until each page
 * had been through the kernel's copies several times, and at 3.27 GB/s
 * from the first byte through huge pages (bench/README.md, "Memory").
 * NULL when out of memory. */
#define POOL_HUGE_ALIGN (2u << 20)
static void *plain_pool_map(size_t len) {
  size_t page = (size_t)sysconf(_SC_PAGESIZE), mapped, span;
  if (__builtin_add_overflow(len, (size_t)page - 1, &mapped)) return NULL;
  mapped &= ~(page - 1);
  if (__builtin_add_overflow(mapped, (size_t)POOL_HUGE_ALIGN, &span)) return NULL;
  char *raw = mmap(NULL, span, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (raw == MAP_FAILED) return NULL;
  char *p = (char *)(((uintptr_t)raw + POOL_HUGE_ALIGN - 1) & ~(uintptr_t)(POOL_HUGE_ALIGN - 1));
  if (p > raw) munmap(raw, (size_t)(p - raw));
  if (raw + span > p + mapped) munmap(p + mapped, (size_t)(raw + span - (p + mapped)));
  madvise(p, mapped, MADV_HUGEPAGE); /* advice: a kernel without THP keeps 4 KiB pages */
  return p;
}

int kvf_engine_alloc_pool(kvf_engine *e, size_t len, void **out) {
  if (!e || !len || !out) return KVF_EINVAL;
  void *p = NULL;
  int rc = 0;
  if (e->ops->alloc_pool) {
    rc = e->ops->alloc_pool(e, len, &p);
  } else if (!(p = plain_pool_map(len))) { /* no transport maps it */
    rc = KVF_ENOMEM;
  }
  if (rc) return rc;
  rc = kvf_engine_register(e, p, len);
  if (!rc) {
    pthread_mutex_lock(&e->pools_mu);
    rc = span_push(&e->pools, &e->npools, &e->cap_pools, (engine_span){(uint64_t)(uintptr_t)p, len});
    pthread_mutex_unlock(&e->pools_mu);
    if (rc) kvf_engine_unregister(e, p);
  }
  if (rc) {
    if (e->ops->free_pool) e->ops->free_pool(e, p);
    else munmap(p, len);
    return rc;
  }
  pool_lock(e, p, len);
  *out = p;
  return 0;
}

int kvf_engine_free_pool(kvf_engine *e, void *addr) {
  if (!e || !addr) return KVF_EINVAL;
  uint64_t base = (uint64_t)(uintptr_t)addr;
  pthread_mutex_lock(&e->pools_mu);
  for (size_t i = 0; i < e->npools; i++)
    if (e->pools[i].base == base) { /* registrations nested in it go with it */
      span_del(e->nested, &e->nnested, 0, base, base + e->pools[i].len);
      span_del(e->pools, &e->npools, base, 0, 0);
      break;
    }
  pthread_mutex_unlock(&e->pools_mu);
  uint64_t len = region_len_at(e, base);
  if (len) kvf_engine_unregister(e, addr);
  if (e->ops->free_pool) return e->ops->free_pool(e, addr);
  if (!len) return KVF_ENOTFOUND;
  munmap(addr, len);
  return 0;
}

void kvf_engine_sync(kvf_engine *e) {
  if (e) atomic_fetch_add_explicit(&e->sync_point, 1, memory_order_acq_rel);
}

void kvf_engine_get_stats(const kvf_engine *e, kvf_engine_stats *o) {
  engine_counters *c = (engine_counters *)&e->stats;
  o->batches_sent = atomic_load(&c->batches_sent);
  o->bytes_sent = atomic_load(&c->bytes_sent);
  o->batches_failed = atomic_load(&c->batches_failed);
  o->batches_received = atomic_load(&c->batches_received);
  o->bytes_received = atomic_load(&c->bytes_received);
  o->batches_refused = atomic_load(&c->batches_refused);
  o->auth_refused = atomic_load(&c->auth_refused);
  o->protocol_errors = atomic_load(&c->protocol_errors);
  o->conns_refused = atomic_load(&c->conns_refused);
  o->conns_timed_out = atomic_load(&c->conns_timed_out);
  o->conns_evicted = atomic_load(&c->conns_evicted);
  o->peers_ucx = atomic_load(&c->peers_ucx);
  o->peers_tcp = atomic_load(&c->peers_tcp);
  o->chunks_fenced = atomic_load(&c->chunks_fenced);
  o->peers_read = atomic_load(&c->peers_read);
  o->reads_refused = atomic_load(&c->reads_refused);
  o->reads_late = atomic_load(&c->reads_late);
  o->bytes_read_direct = atomic_load(&c->bytes_read_direct);
  o->bytes_mapped_ahead = atomic_load(&c->bytes_mapped_ahead);
}

uint64_t kvf__write_block_bytes(const kvf_write *w) { return w->len * (w->count > 1 ? w->count : 1); }

/* Every source piece must lie in locally registered memory, as Mooncake
 * requires; it catches a caller's stale pointer before it reaches a peer. */
static int check_writes(kvf_engine *e, const kvf_write *w, size_t n, uint64_t *total, int *device_src) {
  uint64_t sum = 0;
  int rc = 0;
  *device_src = 0;
  pthread_rwlock_rdlock(&e->regions.lock);
  for (size_t i = 0; i < n; i++) {
    uint64_t count = w[i].count > 1 ? w[i].count : 1, bytes;
    if (__builtin_mul_overflow(w[i].len, count, &bytes) || __builtin_add_overflow(sum, bytes, &sum)) {
      rc = KVF_EINVAL;
      break;
    }
    if (w[i].len == 0) continue;
    if (kvf__write_overlaps(&w[i])) {
      LOG_WARN("engine", "write %zu: %llu pieces of %llu bytes overlap at the destination (stride %llu)", i,
               (unsigned long long)count, (unsigned long long)w[i].len, (unsigned long long)w[i].dst_stride);
      rc = KVF_EINVAL;
      break;
    }
    region *r = kvf__regions_find_block_locked(&e->regions, w[i].src, w[i].len, count, w[i].src_stride);
    if (!r) {
      LOG_WARN("engine", "write %zu: source 0x%llx+%llu is not in registered memory", i,
               (unsigned long long)w[i].src, (unsigned long long)bytes);
      rc = KVF_ERANGE;
      break;
    }
    if (r->device > *device_src) *device_src = r->device;
  }
  pthread_rwlock_unlock(&e->regions.lock);
  if (!rc) *total = sum;
  return rc;
}

void kvf__chunk_free(chunk *c) {
  if (!c) return;
  kvf_engine *e = c->batch ? c->batch->engine : NULL;
  if (!e) {
    if (c->writes != c->inline_writes) free(c->writes);
    free(c);
    return;
  }
  kvf_write *drop = c->writes != c->inline_writes ? c->writes : NULL;
  pthread_mutex_lock(&e->spare_mu);
  if (drop && c->writes_kept && e->spare_writes.n < ENGINE_KEEP_WRITES) {
    kvf__spare_give(&e->spare_writes, drop);
    drop = NULL;
  }
  kvf__spare_give(&e->spare_chunks, c);
  pthread_mutex_unlock(&e->spare_mu);
  free(drop);
}

void kvf__chunk_release(chunk *c) {
  if (!c || atomic_fetch_sub(&c->refs, 1) != 1) return;
  kvf_batch *b = c->batch;
  int status = atomic_load(&c->status);
  kvf__chunk_free(c);
  kvf__batch_chunk_done(b, status);
}

void kvf__chunk_fail(chunk *c, int err) {
  int expected = 0;
  if (err) atomic_compare_exchange_strong(&c->status, &expected, err);
}

void kvf__chunk_finish(chunk *c, int status) {
  kvf__chunk_fail(c, status);
  kvf__chunk_release(c);
}

static chunk *chunk_new(kvf_batch *b, size_t cap) {
  chunk *c;
  kvf_write *kept = NULL;
  int keep = b->engine && cap > ENGINE_KEEP_WRITES_MIN && cap <= ENGINE_MAX_DESC_PER_CHUNK;
  if (b->engine) {
    pthread_mutex_lock(&b->engine->spare_mu);
    c = kvf__spare_take(&b->engine->spare_chunks, sizeof *c);
    if (c && keep) kept = kvf__spare_pop(&b->engine->spare_writes); /* its contents are overwritten */
    pthread_mutex_unlock(&b->engine->spare_mu);
  } else {
    c = calloc(1, sizeof *c);
  }
  if (!c) return NULL;
  c->batch = b;
  c->writes_kept = keep;
  if (keep) c->writes = kept ? kept : malloc(ENGINE_MAX_DESC_PER_CHUNK * sizeof *c->writes);
  else c->writes = cap <= CHUNK_INLINE_WRITES ? c->inline_writes : malloc(cap * sizeof *c->writes);
  if (!c->writes) {
    kvf__chunk_free(c);
    return NULL;
  }
  atomic_init(&c->refs, 1);
  return c;
}

int kvf__engine_make_chunks(kvf_batch *b, const kvf_write *writes, size_t n, size_t max_chunks, size_t max_desc,
                            chunk **buf, size_t bufcap, chunk ***out, size_t *nout) {
  uint64_t total = 0;
  for (size_t i = 0; i < n; i++) total += kvf__write_block_bytes(&writes[i]);
  /* Aim for `want` chunks of `target` bytes; a chunk also closes at max_desc. */
  size_t want = total >= ENGINE_SPLIT_MIN_BYTES ? max_chunks : 1;
  uint64_t target = (total + want - 1) / want;
  if (target == 0) target = 1;
  size_t nc = 0, cap = buf ? bufcap : 0;
  chunk **list = buf, *cur = NULL;
  int rc = 0;
  for (size_t i = 0; i < n; i++) {
    kvf_write w = writes[i];
    if (w.len == 0) continue;
    if (w.count == 0) w.count = 1;
    while (w.count > 0) {
      if (!cur || cur->n == max_desc || cur->bytes >= target) {
        if (nc == cap) {
          size_t ncap = cap ? cap * 2 : want + 1;
          chunk **l = list == buf ? malloc(ncap * sizeof *l) : realloc(list, ncap * sizeof *l);
          if (!l) {
            rc = KVF_ENOMEM;
            goto err_free;
          }
          if (list == buf && nc) memcpy(l, buf, nc * sizeof *l);
          list = l;
          cap = ncap;
        }
        cur = chunk_new(b, max_desc < n ? max_desc : n);
        if (!cur) {
          rc = KVF_ENOMEM;
          goto err_free;
        }
        list[nc++] = cur;
      }
      uint64_t room = target - cur->bytes;
      int last = nc >= want; /* the last wanted chunk takes everything left */
      kvf_write piece = w;
      if (w.count == 1) {
        if (!last && w.len > room) piece.len = room; /* cut a big block across connections */
        w.src += piece.len;
        w.dst += piece.len;
        w.len -= piece.len;
        if (w.len == 0) w.count = 0;
      } else {
        uint64_t pieces = last ? w.count : (room + w.len - 1) / w.len;
        if (pieces > w.count) pieces = w.count;
        piece.count = pieces;
        w.src += pieces * w.src_stride;
        w.dst += pieces * w.dst_stride;
        w.count -= pieces;
      }
      cur->writes[cur->n++] = piece;
      cur->bytes += kvf__write_block_bytes(&piece);
    }
  }
  *out = list;
  *nout = nc;
  return 0;
err_free:
  for (size_t i = 0; i < nc; i++) kvf__chunk_free(list[i]);
  if (list != buf) free(list);
  return rc;
}

static void batch_free(kvf_batch *b) {
  kvf_engine *e = b->engine;
  pthread_cond_destroy(&b->cv);
  pthread_mutex_destroy(&b->mu);
  pthread_mutex_lock(&e->spare_mu);
  kvf__spare_give(&e->spare_batches, b);
  pthread_mutex_unlock(&e->spare_mu);
}

int kvf__batch_group_init(kvf__batch_group *g) {
  memset(g, 0, sizeof *g);
  if (pthread_mutex_init(&g->mu, NULL)) return KVF_ENOMEM;
  if (clock_cond_init(&g->cv)) {
    pthread_mutex_destroy(&g->mu);
    return KVF_ENOMEM;
  }
  return 0;
}

void kvf__batch_group_destroy(kvf__batch_group *g) {
  pthread_cond_destroy(&g->cv);
  pthread_mutex_destroy(&g->mu);
}

void kvf__batch_group_reset(kvf__batch_group *g) {
  pthread_mutex_lock(&g->mu);
  g->pending = g->failed = g->poked = 0;
  g->deadline_ns = 0;
  pthread_mutex_unlock(&g->mu);
}

static int group_wait(kvf__batch_group *g, int64_t until_ns, int pokeable) {
  pthread_mutex_lock(&g->mu);
  int ended = !g->pending || g->failed;
  if (!ended && !(pokeable && g->poked)) kvf__wake_count(); /* this thread sleeps until the transport wakes it */
  int res = KVF__GROUP_ENDED;
  while (g->pending && !g->failed) {
    if (pokeable && g->poked) {
      res = KVF__GROUP_POKED;
      break;
    }
    int64_t bound = g->deadline_ns + 1000000000LL, t = until_ns < bound ? until_ns : bound;
    struct timespec ts = clock_ts_from_ns(t);
    if (pthread_cond_timedwait(&g->cv, &g->mu, &ts) == ETIMEDOUT) {
      if (t < bound) res = 0; /* until_ns came first; else the batches' own deadline passed */
      break;
    }
  }
  if (pokeable) g->poked = 0;
  pthread_mutex_unlock(&g->mu);
  return res;
}

int kvf__batch_group_wait_until(kvf__batch_group *g, int64_t until_ns) {
  return group_wait(g, until_ns, 0) == KVF__GROUP_ENDED;
}

int kvf__batch_group_wait_pokeable(kvf__batch_group *g, int64_t until_ns) { return group_wait(g, until_ns, 1); }

void kvf__batch_group_poke(kvf__batch_group *g) {
  pthread_mutex_lock(&g->mu);
  g->poked = 1;
  pthread_cond_broadcast(&g->cv);
  pthread_mutex_unlock(&g->mu);
}

void kvf__batch_group_wait(kvf__batch_group *g) { kvf__batch_group_wait_until(g, INT64_MAX); }

static void group_join(kvf__batch_group *g, int64_t deadline_ns) {
  pthread_mutex_lock(&g->mu);
  g->pending++;
  if (deadline_ns > g->deadline_ns) g->deadline_ns = deadline_ns;
  pthread_mutex_unlock(&g->mu);
}

static void group_end(kvf__batch_group *g, int status) {
  pthread_mutex_lock(&g->mu);
  g->pending--;
  if (status) g->failed = 1;
  if (!g->pending || status) pthread_cond_broadcast(&g->cv);
  pthread_mutex_unlock(&g->mu);
}

void kvf__batch_chunk_done(kvf_batch *b, int status) {
  void (*cb)(void *, int) = NULL;
  void *cb_arg = NULL;
  int cb_status = 0;
  pthread_mutex_lock(&b->mu);
  if (status && !b->status) b->status = status;
  if (--b->pending == 0) {
    if (!b->counted) {
      b->counted = 1;
      engine_counters *c = &b->engine->stats;
      if (b->status) {
        atomic_fetch_add(&c->batches_failed, 1);
      } else {
        atomic_fetch_add(&c->batches_sent, 1);
        atomic_fetch_add(&c->bytes_sent, b->bytes);
      }
    }
    if (b->on_done) cb = b->on_done, cb_arg = b->on_done_arg, cb_status = b->status;
    else pthread_cond_broadcast(&b->cv);
    /* Under b->mu: whoever sees the batch ended (and may destroy it, then
     * reuse the group) sees the group told. */
    if (b->group) group_end(b->group, b->status);
  }
  pthread_mutex_unlock(&b->mu);
  if (cb) { /* nobody holds a handle: the batch goes, then its owner hears */
    batch_free(b);
    cb(cb_arg, cb_status);
  }
}

void kvf_batch_opts_init(kvf_batch_opts *o) {
  if (!o) return;
  memset(o, 0, sizeof *o);
  o->size = sizeof *o;
}

/* kvf_engine_submit_ex, and kvf__engine_submit_req (async.h). */
/* How many chunks a batch of `total` bytes to `session` aims for: one per
 * connection (conns_per_peer), so the connections and their threads copy in
 * parallel; one where the peer reads (UCX read mode): its notices are served
 * in order on one connection, and the reader splits a large one across its
 * own copier threads, so more chunks only add notices, acknowledgements and
 * copier hand-offs (a layerwise send's 16 MiB layers in two notices each
 * fell behind a compute as long as their transfer, issue 22). One chunk
 * also lets a completion trailer ride a large batch. */
static size_t batch_cut(kvf_engine *e, const char *session, uint64_t total) {
  const char *transport, *mode;
  if (total < ENGINE_SPLIT_MIN_BYTES || e->cfg.conns_per_peer <= 1) return 1;
  if (e->ops->path && !e->ops->path(e, session, &transport, &mode) && !strcmp(mode, "read")) return 1;
  return (size_t)e->cfg.conns_per_peer;
}

static int engine_submit(kvf_engine *e, const kvf__submit *s, kvf_batch **out) {
  const char *session = s->session;
  const kvf_write *writes = s->writes;
  size_t n = s->n, tlen = s->tlen;
  const void *trailer = s->trailer;
  void (*on_done)(void *, int) = s->on_done;
  void *arg = s->arg;
  const kvf_batch_opts *opts_in = s->opts;
  kvf_batch_opts opts;
  kvf_batch_opts_init(&opts);
  if (!e || !session || (!out && !on_done) || (n && !writes) || (tlen && !trailer) ||
      tlen > KVF_ENGINE_MAX_TRAILER)
    return KVF_EINVAL;
  if (opts_in && kvf__config_copy(&opts, sizeof opts, opts_in, KVF_BATCH_OPTS_SIZE_V1)) return KVF_EINVAL;
  if (opts.tag && !opts.epoch) return KVF_EINVAL;
  char host[KVF_ADDR_HOST_LEN];
  uint16_t port;
  if (kvf__addr_parse(session, strlen(session), host, sizeof host, &port, NULL)) {
    LOG_WARN("engine", "malformed session id '%.64s' (want host:port)", session);
    return KVF_EINVAL;
  }
  uint64_t total = 0;
  int device_src = 0;
  int rc = check_writes(e, writes, n, &total, &device_src);
  if (rc) return rc;

  pthread_mutex_lock(&e->spare_mu);
  kvf_batch *b = kvf__spare_take(&e->spare_batches, sizeof *b);
  pthread_mutex_unlock(&e->spare_mu);
  if (!b) return KVF_ENOMEM;
  pthread_mutex_init(&b->mu, NULL);
  clock_cond_init(&b->cv);
  b->engine = e;
  b->tag = opts.tag;
  b->epoch = opts.epoch;
  b->bytes = total;
  b->device_src = device_src;
  b->deadline_ns = clock_deadline_ms(e->cfg.timeout_ms);
  b->on_done = on_done;
  b->on_done_arg = arg;
  b->group = NULL; /* joins below, once it has chunks in flight */

  chunk *few[ENGINE_FEW_CHUNKS], **chunks = NULL;
  size_t nchunks = 0;
  rc = kvf__engine_make_chunks(b, writes, n, batch_cut(e, session, total), ENGINE_MAX_DESC_PER_CHUNK, few,
                               ENGINE_FEW_CHUNKS, &chunks, &nchunks);
  if (rc) goto err_batch;
  if (tlen && nchunks == 1) { /* a trailer rides only on a batch of one chunk (async.h) */
    chunks[0]->trailer = chunks[0]->trailer_buf;
    memcpy(chunks[0]->trailer, trailer, tlen);
    chunks[0]->tlen = (uint32_t)tlen;
  }
  if (s->carried) atomic_store(s->carried, tlen && nchunks == 1);
  if (nchunks == 0) { /* nothing to move: done at once, as Mooncake does */
    if (chunks != few) free(chunks);
    if (on_done) {
      batch_free(b);
      on_done(arg, 0);
    } else {
      *out = b;
    }
    return 0;
  }
  b->pending = (int)nchunks;
  /* Before the chunks go: one may end at once. */
  kvf__batch_group *group = on_done ? NULL : s->group;
  if (group) group_join(group, b->deadline_ns), b->group = group;
  rc = kvf__engine_dispatch(e, session, chunks, nchunks);
  if (rc) {
    if (group) group_end(group, 0); /* nothing was sent: it never ends otherwise */
    for (size_t i = 0; i < nchunks; i++) kvf__chunk_free(chunks[i]);
    if (chunks != few) free(chunks);
    atomic_fetch_add(&e->stats.batches_failed, 1);
    goto err_batch;
  }
  if (chunks != few) free(chunks);
  if (!on_done) *out = b; /* with on_done, b may already be gone */
  return 0;

err_batch:
  batch_free(b);
  return rc;
}

int kvf_engine_submit(kvf_engine *e, const char *session, const kvf_write *writes, size_t n, kvf_batch **out) {
  if (!out) return KVF_EINVAL;
  return engine_submit(e, &(kvf__submit){.session = session, .writes = writes, .n = n}, out);
}

int kvf_engine_submit_ex(kvf_engine *e, const char *session, const kvf_write *writes, size_t n,
                         const kvf_batch_opts *opts, kvf_batch **out) {
  if (!out) return KVF_EINVAL;
  return engine_submit(e, &(kvf__submit){.session = session, .writes = writes, .n = n, .opts = opts}, out);
}

int kvf__engine_submit_req(kvf_engine *e, const kvf__submit *s, kvf_batch **out) {
  if (!s || (!s->on_done && !out)) return KVF_EINVAL;
  return engine_submit(e, s, s->on_done ? NULL : out);
}

int kvf__engine_write_req(kvf_engine *e, const kvf__submit *s) {
  if (!s || s->on_done) return KVF_EINVAL;
  kvf_batch *b = NULL;
  int rc = engine_submit(e, s, &b);
  if (rc) return rc;
  rc = kvf_batch_wait(b, -1);
  kvf_batch_destroy(b);
  return rc;
}

int kvf__engine_on_trailer(kvf_engine *e, kvf__trailer_fn cb, void *arg) {
  if (!e || !cb) return KVF_EINVAL;
  pthread_rwlock_wrlock(&e->trailer_lock);
  int rc = e->trailer_cb ? KVF_EEXIST : 0;
  if (!rc) e->trailer_cb = cb, e->trailer_arg = arg;
  pthread_rwlock_unlock(&e->trailer_lock);
  return rc;
}

void kvf__engine_off_trailer(kvf_engine *e, void *arg) {
  if (!e) return;
  pthread_rwlock_wrlock(&e->trailer_lock);
  if (e->trailer_cb && e->trailer_arg == arg) e->trailer_cb = NULL, e->trailer_arg = NULL;
  pthread_rwlock_unlock(&e->trailer_lock);
}

void kvf__engine_deliver_trailer(kvf_engine *e, const unsigned char *data, size_t len, const char *peer) {
  pthread_rwlock_rdlock(&e->trailer_lock);
  if (e->trailer_cb) e->trailer_cb(e->trailer_arg, data, len, peer);
  pthread_rwlock_unlock(&e->trailer_lock);
}

int kvf__engine_on_refusal(kvf_engine *e, kvf__refusal_fn cb, void *arg) {
  if (!e || !cb) return KVF_EINVAL;
  pthread_rwlock_wrlock(&e->trailer_lock);
  int rc = e->refusal_cb ? KVF_EEXIST : 0;
  if (!rc) e->refusal_cb = cb, e->refusal_arg = arg;
  pthread_rwlock_unlock(&e->trailer_lock);
  return rc;
}

void kvf__engine_off_refusal(kvf_engine *e, void *arg) {
  if (!e) return;
  pthread_rwlock_wrlock(&e->trailer_lock);
  if (e->refusal_cb && e->refusal_arg == arg) e->refusal_cb = NULL, e->refusal_arg = NULL;
  pthread_rwlock_unlock(&e->trailer_lock);
}

void kvf__engine_deliver_refusal(kvf_engine *e, uint64_t tag, uint64_t epoch, int err, const char *peer) {
  pthread_rwlock_rdlock(&e->trailer_lock);
  if (e->refusal_cb) e->refusal_cb(e->refusal_arg, tag, epoch, err, peer);
  pthread_rwlock_unlock(&e->trailer_lock);
}

int kvf__engine_on_landed(kvf_engine *e, kvf__landed_fn cb, void *arg) {
  if (!e || !cb) return KVF_EINVAL;
  pthread_rwlock_wrlock(&e->trailer_lock);
  int rc = e->landed_cb ? KVF_EEXIST : 0;
  if (!rc) e->landed_cb = cb, e->landed_arg = arg, atomic_store(&e->landed_on, 1);
  pthread_rwlock_unlock(&e->trailer_lock);
  return rc;
}

void kvf__engine_off_landed(kvf_engine *e, void *arg) {
  if (!e) return;
  pthread_rwlock_wrlock(&e->trailer_lock);
  if (e->landed_cb && e->landed_arg == arg)
    e->landed_cb = NULL, e->landed_arg = NULL, atomic_store(&e->landed_on, 0);
  pthread_rwlock_unlock(&e->trailer_lock);
}

void kvf__engine_deliver_landed(kvf_engine *e, uint64_t tag, uint64_t epoch, void *dst, size_t len) {
  if (!atomic_load_explicit(&e->landed_on, memory_order_relaxed)) return;
  pthread_rwlock_rdlock(&e->trailer_lock);
  if (e->landed_cb) e->landed_cb(e->landed_arg, tag, epoch, dst, len);
  pthread_rwlock_unlock(&e->trailer_lock);
}

int kvf_batch_poll(kvf_batch *b) {
  if (!b) return KVF_EINVAL;
  pthread_mutex_lock(&b->mu);
  int r = b->pending ? KVF_EAGAIN : b->status;
  pthread_mutex_unlock(&b->mu);
  return r;
}

int kvf_batch_wait(kvf_batch *b, int timeout_ms) {
  if (!b) return KVF_EINVAL;
  /* The transport fails chunks at the batch deadline; the extra second only
   * guards against a transport bug turning into a hang. */
  int64_t until = timeout_ms < 0 ? b->deadline_ns + 1000000000LL : clock_deadline_ms(timeout_ms);
  pthread_mutex_lock(&b->mu);
  if (b->pending) kvf__wake_count(); /* this thread sleeps until the transport wakes it */
  while (b->pending) {
    struct timespec ts = clock_ts_from_ns(until);
    if (pthread_cond_timedwait(&b->cv, &b->mu, &ts) == ETIMEDOUT && b->pending) break;
  }
  int r = b->pending ? KVF_ETIMEDOUT : b->status;
  pthread_mutex_unlock(&b->mu);
  return r;
}

void kvf_batch_destroy(kvf_batch *b) {
  if (!b) return;
  /* Chunks point at the batch, so it may only go once all have reported. */
  pthread_mutex_lock(&b->mu);
  while (b->pending) pthread_cond_wait(&b->cv, &b->mu);
  pthread_mutex_unlock(&b->mu);
  batch_free(b);
}

int kvf_engine_write(kvf_engine *e, const char *session, const kvf_write *writes, size_t n) {
  return kvf_engine_write_ex(e, session, writes, n, NULL);
}

int kvf_engine_write_ex(kvf_engine *e, const char *session, const kvf_write *writes, size_t n,
                        const kvf_batch_opts *opts) {
  kvf_batch *b = NULL;
  int rc = kvf_engine_submit_ex(e, session, writes, n, opts, &b);
  if (rc) return rc;
  rc = kvf_batch_wait(b, -1);
  kvf_batch_destroy(b);
  return rc;
}

/* ---- holding a burst's small sends (async.h) ---- */

#define ENGINE_HOLD_MAX 16 /* peers one hold pushes; past them, sends go as usual */
/* Every this many held sends one goes as usual, which pushes its socket:
 * the first chunk of a long burst does not wait for the whole burst. */
#define ENGINE_HOLD_SENDS 16

static _Thread_local struct {
  int on;
  unsigned n, sends;
  struct {
    void (*push)(void *);
    void *arg;
  } held[ENGINE_HOLD_MAX];
} engine_hold;

void kvf__engine_hold_begin(void) { engine_hold.on = 1; }

int kvf__engine_hold_add(void (*push)(void *), void *arg) {
  if (!engine_hold.on || ++engine_hold.sends % ENGINE_HOLD_SENDS == 0) return 0;
  for (unsigned i = 0; i < engine_hold.n; i++)
    if (engine_hold.held[i].push == push && engine_hold.held[i].arg == arg) return 1;
  if (engine_hold.n == ENGINE_HOLD_MAX) return 0;
  engine_hold.held[engine_hold.n].push = push;
  engine_hold.held[engine_hold.n].arg = arg;
  engine_hold.n++;
  return 1;
}

void kvf__engine_hold_flush(void) {
  for (unsigned i = 0; i < engine_hold.n; i++) engine_hold.held[i].push(engine_hold.held[i].arg);
  engine_hold.n = 0;
}

void kvf__engine_hold_end(void) {
  kvf__engine_hold_flush();
  engine_hold.on = 0;
  engine_hold.sends = 0;
}

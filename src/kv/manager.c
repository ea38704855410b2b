/* The shared core of the KV managers (see manager.h): configuration,
 * buffers, engine, rooms, create/destroy and stats. The PULL listener and
 * the PUSH socket cache are in control.c. */
#include "kv/manager.h"

#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <unistd.h>
#include <zmq.h>

#include "base/addr.h"
#include "base/config.h"
#include "base/clock.h"
#include "base/env.h"
#include "base/hostmem.h"
#include "base/log.h"
#include "base/wake.h"
#include "base/parse.h"
#include "kv/integrity.h"

void kvf_manager_config_init(kvf_manager_config *cfg) {
  if (!cfg) return;
  memset(cfg, 0, sizeof *cfg);
  cfg->size = sizeof *cfg;
  cfg->role = KVF_ROLE_DECODE;
  cfg->host = "127.0.0.1";
  cfg->world_size = 1;
  cfg->dp_size = 1;
  cfg->page_size = 1;
  cfg->bootstrap_timeout_s = 120;
  cfg->waiting_timeout_s = 300;
  cfg->heartbeat_interval_s = 5;
  cfg->heartbeat_max_failures = 2;
  cfg->failed_session_ttl_s = 30;
  cfg->queue_size = 4;
  cfg->http_timeout_ms = 5000;
  cfg->max_rooms = 0;
  cfg->fast_completion = 1;
  cfg->trace_rooms = 1024;
  cfg->control_idle_s = MANAGER_PUSH_IDLE_S;
}

static const kvf__field manager_fields[] = {
    KVF__FIELD(kvf_manager_config, role, KVF__FIELD_INT),
    KVF__FIELD(kvf_manager_config, host, KVF__FIELD_STR),
    KVF__FIELD(kvf_manager_config, engine_rank, KVF__FIELD_INT),
    KVF__FIELD(kvf_manager_config, world_size, KVF__FIELD_INT),
    KVF__FIELD(kvf_manager_config, dp_size, KVF__FIELD_INT),
    KVF__FIELD(kvf_manager_config, page_size, KVF__FIELD_INT),
    KVF__FIELD(kvf_manager_config, is_mla, KVF__FIELD_INT),
    KVF__FIELD(kvf_manager_config, bootstrap_addr, KVF__FIELD_STR),
    KVF__FIELD(kvf_manager_config, bootstrap_token, KVF__FIELD_STR),
    KVF__FIELD(kvf_manager_config, bootstrap_timeout_s, KVF__FIELD_DOUBLE),
    KVF__FIELD(kvf_manager_config, waiting_timeout_s, KVF__FIELD_DOUBLE),
    KVF__FIELD(kvf_manager_config, heartbeat_interval_s, KVF__FIELD_DOUBLE),
    KVF__FIELD(kvf_manager_config, heartbeat_max_failures, KVF__FIELD_INT),
    KVF__FIELD(kvf_manager_config, failed_session_ttl_s, KVF__FIELD_DOUBLE),
    KVF__FIELD(kvf_manager_config, queue_size, KVF__FIELD_INT),
    KVF__FIELD(kvf_manager_config, http_timeout_ms, KVF__FIELD_INT),
    KVF__FIELD(kvf_manager_config, max_rooms, KVF__FIELD_SIZE),
    KVF__FIELD(kvf_manager_config, target_layer_num, KVF__FIELD_SIZE),
    KVF__FIELD(kvf_manager_config, control_token, KVF__FIELD_STR),
    KVF__FIELD(kvf_manager_config, fast_completion, KVF__FIELD_INT),
    KVF__FIELD(kvf_manager_config, verify, KVF__FIELD_INT),
    KVF__FIELD(kvf_manager_config, trace_rooms, KVF__FIELD_SIZE),
    KVF__FIELD(kvf_manager_config, control_idle_s, KVF__FIELD_DOUBLE),
};

int kvf_manager_config_set(kvf_manager_config *cfg, const char *name, const char *value) {
  if (name && value && !strcmp(name, "role") && (!strcmp(value, "prefill") || !strcmp(value, "decode")))
    value = !strcmp(value, "prefill") ? "0" : "1";
  return kvf__config_set(cfg, KVF_MANAGER_CONFIG_SIZE_V1, sizeof *cfg, manager_fields,
                         sizeof manager_fields / sizeof manager_fields[0], name, value);
}

int kvf_manager_config_set_ptr(kvf_manager_config *cfg, const char *name, void *value) {
  if (!cfg || !name || cfg->size < KVF_MANAGER_CONFIG_SIZE_V1 || cfg->size > sizeof *cfg) return KVF_EINVAL;
  if (!strcmp(name, "engine")) cfg->engine = value;
  else if (!strcmp(name, "engine_cfg")) cfg->engine_cfg = value;
  else if (!strcmp(name, "state_layer_ids")) cfg->state_layer_ids = value;
  else return KVF_ENOTFOUND;
  return 0;
}

/* Defaults for unset fields, then the tokenspeed environment names, then
 * the clamps the reference applies (PROTOCOL §7.6). */
static void resolve_config(kvf_manager_config *c) {
  kvf_manager_config d;
  kvf_manager_config_init(&d);
  if (c->world_size <= 0) c->world_size = 1;
  if (c->dp_size <= 0) c->dp_size = 1;
  if (c->page_size <= 0) c->page_size = 1;
  if (c->bootstrap_timeout_s <= 0) c->bootstrap_timeout_s = d.bootstrap_timeout_s;
  if (c->waiting_timeout_s <= 0) c->waiting_timeout_s = d.waiting_timeout_s;
  if (c->heartbeat_interval_s <= 0) c->heartbeat_interval_s = d.heartbeat_interval_s;
  if (c->heartbeat_max_failures <= 0) c->heartbeat_max_failures = d.heartbeat_max_failures;
  if (c->failed_session_ttl_s < 0) c->failed_session_ttl_s = d.failed_session_ttl_s;
  if (c->queue_size <= 0) c->queue_size = d.queue_size;
  if (c->http_timeout_ms <= 0) c->http_timeout_ms = d.http_timeout_ms;
  c->bootstrap_timeout_s =
      (double)kvf__env_get_int("TOKENSPEED_DISAGGREGATION_BOOTSTRAP_TIMEOUT", (int64_t)c->bootstrap_timeout_s);
  c->waiting_timeout_s =
      (double)kvf__env_get_int("TOKENSPEED_DISAGGREGATION_WAITING_TIMEOUT", (int64_t)c->waiting_timeout_s);
  c->heartbeat_interval_s =
      kvf__env_get_double("TOKENSPEED_DISAGGREGATION_HEARTBEAT_INTERVAL", c->heartbeat_interval_s);
  c->heartbeat_max_failures =
      (int)kvf__env_get_int("TOKENSPEED_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", c->heartbeat_max_failures);
  c->failed_session_ttl_s =
      (double)kvf__env_get_int("TOKENSPEED_DISAGGREGATION_FAILED_SESSION_TTL", (int64_t)c->failed_session_ttl_s);
  c->queue_size = (int)kvf__env_get_int("TOKENSPEED_DISAGGREGATION_QUEUE_SIZE", c->queue_size);
  c->verify = kvf__env_get_int("KVFERRY_VERIFY", c->verify) != 0;
  int64_t tr = kvf__env_get_int("KVFERRY_TRACE_ROOMS", (int64_t)c->trace_rooms);
  c->trace_rooms = tr > 0 ? (size_t)tr : 0;
  if (c->control_idle_s == 0) c->control_idle_s = d.control_idle_s;
  double idle = kvf__env_get_double("KVFERRY_CONTROL_IDLE_S", c->control_idle_s); /* 0 or less: never */
  c->control_idle_s = idle > 0 ? idle : -1;
  /* The reference's floors: a heartbeat faster than 2 s or a threshold of 0
   * would declare healthy peers dead. KVFERRY_HEARTBEAT_MIN_S lets tests go
   * below 2 s; production keeps the floor. */
  double floor_s = kvf__env_get_double("KVFERRY_HEARTBEAT_MIN_S", 2.0);
  if (c->heartbeat_interval_s < floor_s) c->heartbeat_interval_s = floor_s;
  if (c->heartbeat_max_failures < 1) c->heartbeat_max_failures = 1;
  if (c->failed_session_ttl_s < 0) c->failed_session_ttl_s = 0;
  if (c->queue_size < 1) c->queue_size = 1;
  if (c->queue_size > 64) c->queue_size = 64;
}

static uint64_t *dup_u64(const uint64_t *src, size_t n, uint64_t def, int *err) {
  uint64_t *p = calloc(n ? n : 1, sizeof *p);
  if (!p) {
    *err = KVF_ENOMEM;
    return NULL;
  }
  for (size_t i = 0; i < n; i++) p[i] = src ? src[i] : def;
  return p;
}

static void free_buffers(manager_buffers *b) {
  free(b->kv_ptrs), free(b->kv_lens), free(b->kv_item_lens), free(b->kv_unit_lens);
  free(b->layer_buf_start), free(b->layer_bufs);
  free(b->state_ptrs), free(b->state_lens), free(b->state_item_lens), free(b->state_unit_lens);
  free(b->state_layer);
  memset(b, 0, sizeof *b);
}

static int copy_buffers(manager_buffers *b, const kvf_kv_buffers *in) {
  int err = 0;
  memset(b, 0, sizeof *b);
  if (!in || in->n_kv == 0 || !in->kv_ptrs || !in->kv_lens || !in->kv_item_lens) return KVF_EINVAL;
  if (in->n_state && (!in->state_ptrs || !in->state_lens || !in->state_item_lens)) return KVF_EINVAL;
  b->n_kv = in->n_kv;
  b->kv_ptrs = dup_u64(NULL, in->n_kv, 0, &err);
  for (size_t i = 0; b->kv_ptrs && i < in->n_kv; i++) b->kv_ptrs[i] = (uint64_t)(uintptr_t)in->kv_ptrs[i];
  b->kv_lens = dup_u64(in->kv_lens, in->n_kv, 0, &err);
  b->kv_item_lens = dup_u64(in->kv_item_lens, in->n_kv, 0, &err);
  b->kv_unit_lens = dup_u64(in->kv_unit_lens, in->n_kv, 1, &err);
  b->n_state = in->n_state;
  b->state_ptrs = dup_u64(NULL, in->n_state, 0, &err);
  for (size_t i = 0; b->state_ptrs && i < in->n_state; i++)
    b->state_ptrs[i] = (uint64_t)(uintptr_t)in->state_ptrs[i];
  b->state_lens = dup_u64(in->state_lens, in->n_state, 0, &err);
  b->state_item_lens = dup_u64(in->state_item_lens, in->n_state, 0, &err);
  b->state_unit_lens = dup_u64(in->state_unit_lens, in->n_state, 1, &err);
  if (err) goto err_free;
  for (size_t i = 0; i < b->n_kv; i++)
    if (!b->kv_ptrs[i] || !b->kv_item_lens[i] || b->kv_lens[i] < b->kv_item_lens[i] || !b->kv_unit_lens[i]) {
      LOG_ERROR("kv", "KV buffer %zu: null pointer or item length 0 or larger than the buffer", i);
      err = KVF_EINVAL;
      goto err_free;
    }
  if (in->layer_buf_start) {
    b->n_layers = in->n_layers;
    size_t nb = in->layer_buf_start[in->n_layers];
    b->layer_buf_start = malloc((in->n_layers + 1) * sizeof *b->layer_buf_start);
    b->layer_bufs = malloc((nb ? nb : 1) * sizeof *b->layer_bufs);
    if (!b->layer_buf_start || !b->layer_bufs) {
      err = KVF_ENOMEM;
      goto err_free;
    }
    memcpy(b->layer_buf_start, in->layer_buf_start, (in->n_layers + 1) * sizeof *b->layer_buf_start);
    memcpy(b->layer_bufs, in->layer_bufs, nb * sizeof *b->layer_bufs);
    for (size_t l = 0; l < in->n_layers; l++)
      if (b->layer_buf_start[l] > b->layer_buf_start[l + 1]) err = KVF_EINVAL;
    for (size_t k = 0; k < nb; k++)
      if (b->layer_bufs[k] >= b->n_kv) err = KVF_EINVAL;
    if (err) {
      LOG_ERROR("kv", "layer mapping names a buffer that does not exist");
      goto err_free;
    }
    b->kv_layout = (plan_layout){.nlayers = b->n_layers, .start = b->layer_buf_start, .bufs = b->layer_bufs};
  } else {
    /* The planner's default: MHA for an even count, MLA for an odd one. */
    b->layer_buf_start = malloc((b->n_kv + 1) * sizeof *b->layer_buf_start);
    b->layer_bufs = malloc(b->n_kv * sizeof *b->layer_bufs);
    if (!b->layer_buf_start || !b->layer_bufs) {
      err = KVF_ENOMEM;
      goto err_free;
    }
    kvf__plan_layout_default(b->n_kv, b->layer_buf_start, b->layer_bufs, &b->kv_layout);
    b->n_layers = b->kv_layout.nlayers;
  }
  return 0;
err_free:
  free_buffers(b);
  return err ? err : KVF_ENOMEM;
}

/* Undo register_buffers (only the buffers this manager registered). */
static void unregister_buffers(kvf_manager *m) {
  for (size_t i = 0; m->own_regions && i < m->bufs.n_kv + m->bufs.n_state; i++)
    if (m->own_regions[i])
      kvf_engine_unregister(m->engine,
                            (void *)(uintptr_t)(i < m->bufs.n_kv ? m->bufs.kv_ptrs[i]
                                                                 : m->bufs.state_ptrs[i - m->bufs.n_kv]));
  free(m->own_regions);
  m->own_regions = NULL;
}

/* Register every KV and state buffer with the engine. A buffer already
 * registered (KVF_EEXIST: a shared engine where another manager of this
 * process holds the same memory) is used as is and left to its owner; the
 * flags in own_regions say which ones this manager must unregister. On
 * failure the buffers registered so far are unregistered again, so a shared
 * engine is left as it was. */
static int register_buffers(kvf_manager *m) {
  size_t n = m->bufs.n_kv + m->bufs.n_state;
  m->own_regions = calloc(n, 1);
  if (!m->own_regions) return KVF_ENOMEM;
  for (size_t i = 0; i < n; i++) {
    int kv = i < m->bufs.n_kv;
    size_t k = kv ? i : i - m->bufs.n_kv;
    uint64_t ptr = kv ? m->bufs.kv_ptrs[k] : m->bufs.state_ptrs[k];
    uint64_t len = kv ? m->bufs.kv_lens[k] : m->bufs.state_lens[k];
    int rc = kvf_engine_register(m->engine, (void *)(uintptr_t)ptr, len);
    if (rc == KVF_EEXIST) continue;
    if (rc) {
      unregister_buffers(m);
      return rc;
    }
    m->own_regions[i] = 1;
  }
  return 0;
}

/* Verify mode hashes buffers on the CPU, so they must be host memory. A
 * device buffer (cudaMalloc) is not a readable mapping of the process. The
 * plan for device memory (a GPU hashing kernel, or hashing a host staging
 * copy) is in docs/WIRE-EXTENSIONS.md; until then it is refused here. */
static int check_host_memory(const manager_buffers *b) {
  FILE *maps = fopen("/proc/self/maps", "r");
  if (!maps) return 0; /* cannot tell: let it run */
  int rc = 0;
  for (size_t i = 0; i < b->n_kv + b->n_state && !rc; i++) {
    int st = i >= b->n_kv;
    size_t k = st ? i - b->n_kv : i;
    uint64_t p = st ? b->state_ptrs[k] : b->kv_ptrs[k], len = st ? b->state_lens[k] : b->kv_lens[k];
    if (len && !kvf__maps_readable(maps, p, len)) {
      LOG_ERROR("kv",
                "verify mode needs host memory: %s buffer %zu at 0x%" PRIx64 " (+%" PRIu64
                " bytes) is not readable host memory (device memory cannot be hashed on the CPU yet)",
                st ? "state" : "KV", k, p, len);
      rc = KVF_EINVAL;
    }
  }
  fclose(maps);
  return rc;
}

int kvf_manager_create(const kvf_manager_config *cfg_in, const kvf_kv_buffers *bufs, kvf_manager **out) {
  kvf_manager_config cfg;
  kvf_manager_config_init(&cfg);
  if (!cfg_in || !out || kvf__config_copy(&cfg, sizeof cfg, cfg_in, KVF_MANAGER_CONFIG_SIZE_V1)) return KVF_EINVAL;
  if (cfg.role != KVF_ROLE_PREFILL && cfg.role != KVF_ROLE_DECODE) return KVF_EINVAL;
  kvf_manager *m = calloc(1, sizeof *m);
  if (!m) return KVF_ENOMEM;
  m->wake_fd =
      eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC); /* -1: the listener wakes on its own within MANAGER_WAIT_NOWAKE_MS */
  m->cfg = cfg;
  resolve_config(&m->cfg);
  kvf_manager_config *c = &m->cfg;
  int rc = KVF_EINVAL;
  if ((c->host && strlen(c->host) > KVF_ADDR_HOST_MAX) ||
      (c->bootstrap_addr && strlen(c->bootstrap_addr) > KVF_ADDR_MAX)) {
    LOG_ERROR("kv", "the host or the bootstrap address is longer than an address can be");
    goto err_free;
  }
  kvf__str_copy(m->host, sizeof m->host, c->host && *c->host ? c->host : "127.0.0.1");
  c->host = m->host;
  kvf__str_copy(m->bootstrap_addr, sizeof m->bootstrap_addr, c->bootstrap_addr ? c->bootstrap_addr : "");
  c->bootstrap_addr = m->bootstrap_addr;
  const char *tok = c->bootstrap_token ? c->bootstrap_token : getenv("KVFERRY_BOOTSTRAP_TOKEN");
  kvf__str_copy(m->bootstrap_token, sizeof m->bootstrap_token, tok ? tok : "");
  c->bootstrap_token = m->bootstrap_token;
  const char *ctl = c->control_token ? c->control_token : getenv("KVFERRY_CONTROL_TOKEN");
  m->ctl_keylen = ctl ? strlen(ctl) : 0;
  if (m->ctl_keylen >= sizeof m->ctl_key) {
    LOG_ERROR("kv", "the control token is longer than %zu bytes", sizeof m->ctl_key - 1);
    goto err_free;
  }
  if (m->ctl_keylen) memcpy(m->ctl_key, ctl, m->ctl_keylen);
  c->control_token = (const char *)m->ctl_key;
  if (m->ctl_keylen && sodium_init() < 0) {
    LOG_ERROR("kv", "libsodium failed to initialise");
    goto err_free;
  }
  m->check_peer_ip = kvf__env_get_int("KVFERRY_CHECK_PEER_IP", 1) != 0;
  m->push_idle_ns = c->control_idle_s > 0 ? (int64_t)(c->control_idle_s * 1e9) : 0;
  if (c->world_size % c->dp_size || c->engine_rank < 0 || c->engine_rank >= c->world_size) {
    LOG_ERROR("kv", "bad parallel layout: rank %d of world %d with dp %d", c->engine_rank, c->world_size,
              c->dp_size);
    goto err_free;
  }
  m->tp_size = c->world_size / c->dp_size;
  m->tp_rank = c->engine_rank % m->tp_size;
  m->dp_rank = c->engine_rank / m->tp_size;
  if ((rc = copy_buffers(&m->bufs, bufs))) goto err_free;
  if (c->state_layer_ids && m->bufs.n_state) { /* validated and copied; the caller's is read only here */
    if (!(m->bufs.state_layer = malloc(m->bufs.n_state * sizeof *m->bufs.state_layer))) rc = KVF_ENOMEM;
    for (size_t i = 0; !rc && i < m->bufs.n_state; i++)
      if ((m->bufs.state_layer[i] = c->state_layer_ids[i]) >= m->bufs.n_layers) rc = KVF_EINVAL;
    if (rc) {
      LOG_ERROR("kv", "state_layer_ids: %s", rc == KVF_EINVAL ? "a layer index past the KV layers" : "no memory");
      goto err_bufs;
    }
  }
  c->state_layer_ids = NULL;
  if (c->verify && (rc = check_host_memory(&m->bufs))) goto err_bufs;
  if ((rc = kvf__rooms_table_new(c->max_rooms, &m->rooms))) goto err_bufs;
  if ((rc = kvf__trace_ring_new(c->trace_rooms, &m->trace))) goto err_rooms;

  if (c->engine) {
    m->engine = c->engine;
  } else {
    kvf_engine_config ec;
    kvf_engine_config_init(&ec);
    if (c->engine_cfg && (rc = kvf__config_copy(&ec, sizeof ec, c->engine_cfg, KVF_ENGINE_CONFIG_SIZE_V1)))
      goto err_rooms;
    if (!ec.host || !strcmp(ec.host, "127.0.0.1")) ec.host = m->host;
    if ((rc = kvf_engine_create(&ec, &m->engine))) goto err_rooms;
    m->own_engine = 1;
  }
  c->engine = m->engine;
  c->engine_cfg = NULL; /* the caller's, read only during create */
  kvf__trace_ring_engine(m->trace, m->engine);
  if ((rc = register_buffers(m))) goto err_engine;

  pthread_mutex_init(&m->push_lock, NULL);
  if ((rc = smap_init(&m->pushes))) goto err_lock;
  m->zctx = zmq_ctx_new();
  /* ZeroMQ's default of 1023 sockets per context would refuse PUSH sockets
   * long before the cache's bound (kvf__control_push_limit). */
  if (!m->zctx) {
    rc = KVF_EIO;
    goto err_pushes;
  }
  if (zmq_ctx_set(m->zctx, ZMQ_MAX_SOCKETS, kvf__control_socket_limit())) {
    rc = KVF_EIO;
    goto err_zmq;
  }
  if ((rc = kvf__control_bind_pull(m))) goto err_zmq;
  if ((rc = kvf__integ_start(m))) goto err_zmq;
  m->role = c->role == KVF_ROLE_DECODE ? &kvf__decode_role : &kvf__prefill_role;
  if ((rc = m->role->start(m))) goto err_integ;
  if (pthread_create(&m->listener, NULL, kvf__control_listener_main, m)) {
    rc = KVF_ENOMEM;
    goto err_role;
  }
  m->listener_started = 1;
  LOG_INFO("kv", "%s manager rank %d: engine %s, control port %u", m->role->name, c->engine_rank,
           kvf_engine_session_id(m->engine), (unsigned)m->rank_port);
  *out = m;
  return 0;

err_role:
  m->role->stop(m);
err_integ:
  kvf__integ_stop(m);
err_zmq:
  if (m->pull) zmq_close(m->pull);
  zmq_ctx_term(m->zctx);
err_pushes:
  kvf__smap_free(&m->pushes);
err_lock:
  pthread_mutex_destroy(&m->push_lock);
  unregister_buffers(m);
err_engine:
  kvf__trace_ring_stop(m->trace); /* its writer asks the engine for routes */
  if (m->own_engine) kvf_engine_destroy(m->engine);
err_rooms:
  kvf__rooms_table_free(m->rooms, NULL);
  kvf__trace_ring_free(m->trace);
err_bufs:
  free_buffers(&m->bufs);
err_free:
  if (m->wake_fd >= 0) close(m->wake_fd);
  free(m);
  return rc;
}

void kvf_manager_destroy(kvf_manager *m) {
  if (!m) return;
  atomic_store(&m->stopping, 1);
  kvf__control_wake(m);
  if (m->listener_started) pthread_join(m->listener, NULL);
  kvf__integ_close_open_fences(m); /* their bounds point into the role's state */
  m->role->stop(m);
  kvf__integ_stop(m);
  zmq_close(m->pull);
  kvf__control_close_pushes(m);
  zmq_ctx_term(m->zctx);
  pthread_mutex_destroy(&m->push_lock);
  unregister_buffers(m);
  kvf__trace_ring_stop(m->trace); /* every record is finished; its writer asks the engine for routes */
  if (m->own_engine) kvf_engine_destroy(m->engine);
  kvf__rooms_table_free(m->rooms, NULL);
  kvf__trace_ring_free(m->trace);
  free_buffers(&m->bufs);
  sodium_memzero(m->ctl_key, sizeof m->ctl_key);
  if (m->wake_fd >= 0) close(m->wake_fd);
  free(m);
}

const char *kvf_manager_session_id(const kvf_manager *m) { return kvf_engine_session_id(m->engine); }
kvf_engine *kvf_manager_engine(kvf_manager *m) { return m->engine; }

int kvf_manager_event_fd(kvf_manager *m) { return m ? kvf__rooms_event_fd(m->rooms) : KVF_EINVAL; }

void kvf_manager_event_clear(kvf_manager *m) {
  if (m) kvf__rooms_event_clear(m->rooms);
}

void kvf_manager_get_stats(kvf_manager *m, kvf_manager_stats *o) {
  memset(o, 0, sizeof *o);
  o->messages_received = atomic_load(&m->stats.messages_received);
  o->messages_malformed = atomic_load(&m->stats.messages_malformed);
  o->messages_unknown_room = atomic_load(&m->stats.messages_unknown_room);
  o->chunks_sent = atomic_load(&m->stats.chunks_sent);
  o->bytes_sent = atomic_load(&m->stats.bytes_sent);
  o->heartbeat_failures = atomic_load(&m->stats.heartbeat_failures);
  o->node_failures = atomic_load(&m->stats.node_failures);
  o->messages_forged = atomic_load(&m->stats.messages_forged);
  o->verify_failures = atomic_load(&m->stats.verify_failures);
  o->verify_unverified = atomic_load(&m->stats.verify_unverified);
  o->rooms_fenced = atomic_load(&m->stats.rooms_fenced);
  rooms_stats rs;
  kvf__rooms_get_stats(m->rooms, &rs);
  o->live_rooms = rs.live;
  o->rooms_created = rs.created;
  o->rooms_cleared = rs.cleared;
  o->rooms_early = rs.early;
  o->rooms_early_dropped = rs.early_dropped;
  o->rooms_rejected_full = rs.rejected_full;
  o->rooms_dropped_unknown = rs.dropped_unknown;
  o->rooms_rejected_invalid = rs.rejected_invalid;
  o->rooms_duplicate_responses = rs.duplicate_responses;
}

/* kvf_manager_stats field by field, for kvf_manager_metrics. */
#define STAT_FIELD(f) \
  { #f, offsetof(kvf_manager_stats, f) }
static const struct {
  const char *name;
  size_t off;
} stat_fields[] = {
    STAT_FIELD(messages_received),
    STAT_FIELD(messages_malformed),
    STAT_FIELD(messages_unknown_room),
    STAT_FIELD(live_rooms),
    STAT_FIELD(chunks_sent),
    STAT_FIELD(bytes_sent),
    STAT_FIELD(heartbeat_failures),
    STAT_FIELD(node_failures),
    STAT_FIELD(messages_forged),
    STAT_FIELD(verify_failures),
    STAT_FIELD(verify_unverified),
    STAT_FIELD(rooms_fenced),
    STAT_FIELD(rooms_created),
    STAT_FIELD(rooms_cleared),
    STAT_FIELD(rooms_early),
    STAT_FIELD(rooms_early_dropped),
    STAT_FIELD(rooms_rejected_full),
    STAT_FIELD(rooms_dropped_unknown),
    STAT_FIELD(rooms_rejected_invalid),
    STAT_FIELD(rooms_duplicate_responses),
};
#undef STAT_FIELD
_Static_assert(sizeof stat_fields / sizeof stat_fields[0] == sizeof(kvf_manager_stats) / sizeof(uint64_t),
               "every kvf_manager_stats field has its /metrics line");

size_t kvf_manager_metrics(kvf_manager *m, char *buf, size_t cap) {
  if (!buf || !cap) return 0;
  buf[0] = '\0';
  if (!m) return 0;
  kvf_manager_stats st;
  kvf_manager_get_stats(m, &st);
  const char *session = kvf_manager_session_id(m);
  size_t n = 0;
  for (size_t i = 0; i < sizeof stat_fields / sizeof stat_fields[0]; i++) {
    uint64_t v;
    memcpy(&v, (const char *)&st + stat_fields[i].off, sizeof v);
    int w = snprintf(buf + n, cap - n, "kvferry_manager_%s{role=\"%s\",session=\"%s\"} %llu\n",
                     stat_fields[i].name, m->role->name, session, (unsigned long long)v);
    if (w < 0 || (size_t)w >= cap - n) { /* whole lines only */
      buf[n] = '\0';
      return n;
    }
    n += (size_t)w;
  }
  return kvf__trace_metrics(m, buf, n, cap);
}

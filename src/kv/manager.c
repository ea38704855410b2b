/* The shared core of the KV managers (see manager.h): configuration,
 * buffers, engine, rooms, the PULL listener and the PUSH socket cache.
 *
 * Control-plane authentication (issue 13 defect 5, docs/WIRE-EXTENSIONS.md).
 * With a control token set, every message sent carries one more frame,
 * MANAGER_MAC_LEN bytes: the sender's wall clock in milliseconds (8 bytes,
 * big-endian) and HMAC-SHA256(token, label || clock || for each frame its
 * length (4 bytes, big-endian) and bytes). The listener drops, counts and
 * logs once any message whose last frame is not such a MAC, whose MAC is
 * wrong, or whose clock is more than MANAGER_MAC_WINDOW_S away from ours,
 * before any codec sees it. Without a token nothing is added or checked, so
 * tokenspeed peers keep working. */
#include "kv/manager.h"

#include <arpa/inet.h>
#include <errno.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <zmq.h>

#include "base/addr.h"
#include "base/config.h"
#include "base/clock.h"
#include "base/env.h"
#include "base/log.h"

#define MANAGER_MAX_FRAME_BYTES (64ll << 20) /* ZMQ_MAXMSGSIZE: bigger frames drop the peer */
#define MANAGER_MAX_PUSHES 4096
#define MANAGER_MAC_LABEL "kvferry-control-mac-v1"
#define MANAGER_MAC_WINDOW_S 300 /* clock skew and delivery delay accepted, seconds */
_Static_assert(MANAGER_MAC_LEN == 8 + crypto_auth_hmacsha256_BYTES, "MAC frame size");
#define MANAGER_MAX_RECV_FRAMES (WIRE_MAX_FRAMES + 1) /* the largest message and its MAC */

typedef struct manager_push {
  pthread_mutex_t lock;
  void *sock;
} manager_push;

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
};

int kvf_manager_config_set(kvf_manager_config *cfg, const char *name, const char *value) {
  if (name && value && !strcmp(name, "role") && (!strcmp(value, "prefill") || !strcmp(value, "decode")))
    value = !strcmp(value, "prefill") ? "0" : "1";
  return kvf__config_set(cfg, sizeof *cfg, sizeof *cfg, manager_fields,
                         sizeof manager_fields / sizeof manager_fields[0], name, value);
}

int kvf_manager_config_set_ptr(kvf_manager_config *cfg, const char *name, void *value) {
  if (!cfg || !name || cfg->size != sizeof *cfg) return KVF_EINVAL;
  if (!strcmp(name, "engine")) cfg->engine = value;
  else if (!strcmp(name, "engine_cfg")) cfg->engine_cfg = value;
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
  c->bootstrap_timeout_s = (double)env_get_int("TOKENSPEED_DISAGGREGATION_BOOTSTRAP_TIMEOUT", (int64_t)c->bootstrap_timeout_s);
  c->waiting_timeout_s = (double)env_get_int("TOKENSPEED_DISAGGREGATION_WAITING_TIMEOUT", (int64_t)c->waiting_timeout_s);
  c->heartbeat_interval_s = env_get_double("TOKENSPEED_DISAGGREGATION_HEARTBEAT_INTERVAL", c->heartbeat_interval_s);
  c->heartbeat_max_failures = (int)env_get_int("TOKENSPEED_DISAGGREGATION_HEARTBEAT_MAX_FAILURE", c->heartbeat_max_failures);
  c->failed_session_ttl_s = (double)env_get_int("TOKENSPEED_DISAGGREGATION_FAILED_SESSION_TTL", (int64_t)c->failed_session_ttl_s);
  c->queue_size = (int)env_get_int("TOKENSPEED_DISAGGREGATION_QUEUE_SIZE", c->queue_size);
  /* The reference's floors: a heartbeat faster than 2 s or a threshold of 0
   * would declare healthy peers dead. KVFERRY_HEARTBEAT_MIN_S lets tests go
   * below 2 s; production keeps the floor. */
  double floor_s = env_get_double("KVFERRY_HEARTBEAT_MIN_S", 2.0);
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
  } else {
    /* MHA: K of every layer, then V of every layer; an odd count is one
     * buffer per layer (MLA). */
    int mha = b->n_kv % 2 == 0;
    b->n_layers = mha ? b->n_kv / 2 : b->n_kv;
    size_t per = mha ? 2 : 1;
    b->layer_buf_start = malloc((b->n_layers + 1) * sizeof *b->layer_buf_start);
    b->layer_bufs = malloc(b->n_kv * sizeof *b->layer_bufs);
    if (!b->layer_buf_start || !b->layer_bufs) {
      err = KVF_ENOMEM;
      goto err_free;
    }
    for (size_t l = 0; l <= b->n_layers; l++) b->layer_buf_start[l] = (uint32_t)(l * per);
    for (size_t l = 0; l < b->n_layers; l++) {
      b->layer_bufs[l * per] = (uint32_t)l;
      if (mha) b->layer_bufs[l * per + 1] = (uint32_t)(b->n_layers + l);
    }
  }
  return 0;
err_free:
  free_buffers(b);
  return err ? err : KVF_ENOMEM;
}

static void reject_log(kvf_manager *m, const char *peer, const char *kind, const char *reason) {
  char key[128];
  snprintf(key, sizeof key, "%s/%s/%p", peer ? peer : "?", kind, (void *)m);
  if (log_first_time(log_hash_str(key, 11)))
    LOG_WARN("kv", "dropped %s from %s: %s (further ones from this peer are counted, not logged)", kind,
             peer ? peer : "unknown peer", reason);
}

void manager_reject(kvf_manager *m, const char *peer, const char *kind, const char *reason) {
  atomic_fetch_add(&m->stats.messages_malformed, 1);
  reject_log(m, peer, kind, reason);
}

void manager_reject_forged(kvf_manager *m, const char *peer, const char *kind, const char *reason) {
  atomic_fetch_add(&m->stats.messages_forged, 1);
  reject_log(m, peer, kind, reason);
}

/* An address literal as 16 bytes, IPv4 as IPv4-mapped IPv6; 0 or -1. */
static int ip_bytes(const char *s, unsigned char out[16]) {
  struct in_addr a4;
  if (inet_pton(AF_INET, s, &a4) == 1) {
    memset(out, 0, 10);
    out[10] = out[11] = 0xff;
    memcpy(out + 12, &a4, 4);
    return 0;
  }
  return inet_pton(AF_INET6, s, out) == 1 ? 0 : -1;
}

int manager_peer_is(const kvf_manager *m, const char *peer, const char *ip) {
  static const unsigned char any6[16], any4[16] = {[10] = 0xff, [11] = 0xff};
  unsigned char a[16], b[16];
  char head[64];
  if (!m->check_peer_ip || !ip) return 1;
  /* "ip:x" names the host before the first ':' (PROTOCOL §3: where M3 goes) */
  const char *colon = strchr(ip, ':');
  if (ip_bytes(ip, b) && colon && !strchr(colon + 1, ':') && (size_t)(colon - ip) < sizeof head) {
    snprintf(head, sizeof head, "%.*s", (int)(colon - ip), ip);
    ip = head;
  }
  /* A host name, or the unspecified address: not checkable here. */
  if (ip_bytes(ip, b) || !memcmp(b, any6, 16) || !memcmp(b, any4, 16)) return 1;
  return peer && !ip_bytes(peer, a) && !memcmp(a, b, sizeof a);
}

/* ------------------------------------------------------------ MAC frame */

static void mac_compute(const kvf_manager *m, const unsigned char clock[8], const wire_frame *f, size_t n,
                        unsigned char out[crypto_auth_hmacsha256_BYTES]) {
  crypto_auth_hmacsha256_state st;
  crypto_auth_hmacsha256_init(&st, m->ctl_key, m->ctl_keylen);
  crypto_auth_hmacsha256_update(&st, (const unsigned char *)MANAGER_MAC_LABEL, sizeof MANAGER_MAC_LABEL);
  crypto_auth_hmacsha256_update(&st, clock, 8);
  for (size_t i = 0; i < n; i++) {
    unsigned char len[4] = {(unsigned char)(f[i].len >> 24), (unsigned char)(f[i].len >> 16),
                            (unsigned char)(f[i].len >> 8), (unsigned char)f[i].len};
    crypto_auth_hmacsha256_update(&st, len, 4);
    if (f[i].len) crypto_auth_hmacsha256_update(&st, f[i].data, f[i].len);
  }
  crypto_auth_hmacsha256_final(&st, out);
  sodium_memzero(&st, sizeof st);
}

void kvf__control_mac(const kvf_manager *m, const wire_frame *f, size_t n, unsigned char out[MANAGER_MAC_LEN]) {
  uint64_t ms = (uint64_t)(clock_wall_s() * 1000);
  for (int i = 0; i < 8; i++) out[i] = (unsigned char)(ms >> (56 - 8 * i));
  mac_compute(m, out, f, n, out + 8);
}

/* 0 when f[n-1] is a good MAC of f[0..n-1), else a reason. */
static const char *mac_check(const kvf_manager *m, const wire_frame *f, size_t n) {
  if (n < 2 || f[n - 1].len != MANAGER_MAC_LEN) return "no MAC frame (is KVFERRY_CONTROL_TOKEN the same on both sides?)";
  const unsigned char *mac = f[n - 1].data;
  uint64_t ms = 0;
  for (int i = 0; i < 8; i++) ms = ms << 8 | mac[i];
  unsigned char want[crypto_auth_hmacsha256_BYTES];
  mac_compute(m, mac, f, n - 1, want);
  if (crypto_verify_32(want, mac + 8)) return "wrong MAC";
  double skew = (double)ms / 1000 - clock_wall_s();
  if (skew > MANAGER_MAC_WINDOW_S || skew < -MANAGER_MAC_WINDOW_S) return "MAC clock outside the accepted window";
  return NULL;
}

/* ------------------------------------------------------------ PUSH cache */

static int push_key(char *key, size_t cap, const char *host, uint16_t port) {
  return kvf__addr_format(key, cap, host, port);
}

int manager_push_send(kvf_manager *m, const char *host, uint16_t port, const wire_msg *msg) {
  char key[300];
  if (!host || !*host || !port || push_key(key, sizeof key, host, port)) return KVF_EINVAL;
  pthread_mutex_lock(&m->push_lock);
  manager_push *p = smap_get(&m->pushes, key);
  int rc = 0;
  if (!p) {
    if (smap_size(&m->pushes) >= MANAGER_MAX_PUSHES || !(p = calloc(1, sizeof *p))) {
      pthread_mutex_unlock(&m->push_lock);
      return KVF_ENOMEM;
    }
    pthread_mutex_init(&p->lock, NULL);
    p->sock = zmq_socket(m->zctx, ZMQ_PUSH);
    int linger = 200, hwm = 1000, sndtimeo = 1000, ipv6 = strchr(host, ':') != NULL;
    char ep[320];
    snprintf(ep, sizeof ep, "tcp://%s", key);
    if (!p->sock || zmq_setsockopt(p->sock, ZMQ_LINGER, &linger, sizeof linger) ||
        zmq_setsockopt(p->sock, ZMQ_SNDHWM, &hwm, sizeof hwm) ||
        zmq_setsockopt(p->sock, ZMQ_SNDTIMEO, &sndtimeo, sizeof sndtimeo) ||
        zmq_setsockopt(p->sock, ZMQ_IPV6, &ipv6, sizeof ipv6) || zmq_connect(p->sock, ep) ||
        smap_put(&m->pushes, key, p, NULL)) {
      LOG_WARN("kv", "cannot open a PUSH socket to %s: %s", ep, zmq_strerror(zmq_errno()));
      if (p->sock) zmq_close(p->sock);
      pthread_mutex_destroy(&p->lock);
      free(p);
      pthread_mutex_unlock(&m->push_lock);
      return KVF_EIO;
    }
  }
  unsigned char mac[MANAGER_MAC_LEN];
  size_t nsend = msg->nframes + (m->ctl_keylen ? 1 : 0);
  if (m->ctl_keylen) kvf__control_mac(m, msg->frames, msg->nframes, mac);
  pthread_mutex_lock(&p->lock);
  pthread_mutex_unlock(&m->push_lock);
  for (size_t i = 0; i < nsend && !rc; i++) {
    int flags = i + 1 < nsend ? ZMQ_SNDMORE : 0;
    const void *data = i < msg->nframes ? msg->frames[i].data : mac;
    size_t len = i < msg->nframes ? msg->frames[i].len : sizeof mac;
    if (zmq_send(p->sock, data, len, flags) < 0) rc = zmq_errno() == EAGAIN ? KVF_ETIMEDOUT : KVF_EIO;
  }
  pthread_mutex_unlock(&p->lock);
  if (rc) LOG_WARN("kv", "sending to %s failed: %s", key, kvf_strerror(rc));
  return rc;
}

void manager_push_forget(kvf_manager *m, const char *host, uint16_t port) {
  char key[300];
  if (push_key(key, sizeof key, host, port)) return;
  void *v = NULL;
  pthread_mutex_lock(&m->push_lock);
  int had = smap_del(&m->pushes, key, &v);
  pthread_mutex_unlock(&m->push_lock);
  if (had) {
    manager_push *p = v;
    /* A sender may still hold p->lock: take it before closing. */
    pthread_mutex_lock(&p->lock);
    zmq_close(p->sock);
    pthread_mutex_unlock(&p->lock);
    pthread_mutex_destroy(&p->lock);
    free(p);
  }
}

static void close_pushes(kvf_manager *m) {
  map_iter it;
  map_iter_init(&it);
  void *v;
  while (smap_next(&m->pushes, &it, NULL, &v)) {
    manager_push *p = v;
    zmq_close(p->sock);
    pthread_mutex_destroy(&p->lock);
    free(p);
  }
  smap_free(&m->pushes);
}

/* -------------------------------------------------------------- listener */

static void *listener_main(void *arg) {
  kvf_manager *m = arg;
  zmq_msg_t parts[MANAGER_MAX_RECV_FRAMES];
  for (size_t i = 0; i < MANAGER_MAX_RECV_FRAMES; i++) zmq_msg_init(&parts[i]);
  while (!atomic_load(&m->stopping)) {
    zmq_pollitem_t pi = {.socket = m->pull, .events = ZMQ_POLLIN};
    int r = zmq_poll(&pi, 1, 100);
    if (r <= 0) continue;
    size_t n = 0, extra = 0;
    int more = 1;
    char peer[64] = "?";
    while (more) {
      zmq_msg_t *part = n < MANAGER_MAX_RECV_FRAMES ? &parts[n] : NULL;
      zmq_msg_t sink;
      if (!part) {
        zmq_msg_init(&sink);
        part = &sink;
      }
      if (zmq_msg_recv(part, m->pull, 0) < 0) {
        if (part == &sink) zmq_msg_close(&sink);
        more = 0;
        break;
      }
      if (n == 0) {
        const char *pa = zmq_msg_gets(part, "Peer-Address");
        if (pa) snprintf(peer, sizeof peer, "%s", pa);
      }
      more = zmq_msg_more(part);
      if (part == &sink) {
        zmq_msg_close(&sink);
        extra++;
      } else {
        n++;
      }
    }
    wire_frame frames[MANAGER_MAX_RECV_FRAMES];
    for (size_t i = 0; i < n; i++)
      frames[i] = (wire_frame){zmq_msg_data(&parts[i]), zmq_msg_size(&parts[i])};
    if (m->ctl_keylen) {
      const char *bad = extra ? "more frames than any message and its MAC" : mac_check(m, frames, n);
      if (bad) {
        manager_reject_forged(m, peer, "message", bad);
        continue;
      }
      n--; /* the codecs never see the MAC */
    } else if (n > WIRE_MAX_FRAMES) {
      n = WIRE_MAX_FRAMES; /* frames past the last one any message defines are ignored, as the spec says */
    }
    if (m->decode) decode_on_message(m, frames, n, peer);
    else prefill_on_message(m, frames, n, peer);
  }
  for (size_t i = 0; i < MANAGER_MAX_RECV_FRAMES; i++) zmq_msg_close(&parts[i]);
  return NULL;
}

/* Bind to an ephemeral port chosen by the kernel (no bind-then-release race
 * as in the reference) and read back which one. */
static int bind_pull(kvf_manager *m) {
  m->pull = zmq_socket(m->zctx, ZMQ_PULL);
  if (!m->pull) return KVF_EIO;
  int64_t maxmsg = MANAGER_MAX_FRAME_BYTES;
  int linger = 0, ipv6 = strchr(m->host, ':') != NULL, hwm = 10000;
  zmq_setsockopt(m->pull, ZMQ_MAXMSGSIZE, &maxmsg, sizeof maxmsg);
  zmq_setsockopt(m->pull, ZMQ_LINGER, &linger, sizeof linger);
  zmq_setsockopt(m->pull, ZMQ_IPV6, &ipv6, sizeof ipv6);
  zmq_setsockopt(m->pull, ZMQ_RCVHWM, &hwm, sizeof hwm);
  char ep[300];
  snprintf(ep, sizeof ep, ipv6 ? "tcp://[%s]:*" : "tcp://%s:*", m->host);
  if (zmq_bind(m->pull, ep)) {
    LOG_ERROR("kv", "cannot bind the control socket on %s: %s", ep, zmq_strerror(zmq_errno()));
    return KVF_EIO;
  }
  char last[300];
  size_t len = sizeof last;
  if (zmq_getsockopt(m->pull, ZMQ_LAST_ENDPOINT, last, &len)) return KVF_EIO;
  const char *hp = strncmp(last, "tcp://", 6) ? last : last + 6;
  if (kvf__addr_parse(hp, strlen(hp), NULL, 0, &m->rank_port, NULL)) return KVF_EIO;
  return 0;
}

/* Undo register_buffers (only the buffers this manager registered). */
static void unregister_buffers(kvf_manager *m) {
  for (size_t i = 0; m->own_regions && i < m->bufs.n_kv + m->bufs.n_state; i++)
    if (m->own_regions[i])
      kvf_engine_unregister(m->engine, (void *)(uintptr_t)(i < m->bufs.n_kv ? m->bufs.kv_ptrs[i]
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

int kvf_manager_create(const kvf_manager_config *cfg_in, const kvf_kv_buffers *bufs, kvf_manager **out) {
  kvf_manager_config cfg;
  kvf_manager_config_init(&cfg);
  if (!cfg_in || !out || kvf__config_copy(&cfg, sizeof cfg, cfg_in, sizeof cfg)) return KVF_EINVAL;
  if (cfg.role != KVF_ROLE_PREFILL && cfg.role != KVF_ROLE_DECODE) return KVF_EINVAL;
  kvf_manager *m = calloc(1, sizeof *m);
  if (!m) return KVF_ENOMEM;
  m->cfg = cfg;
  resolve_config(&m->cfg);
  kvf_manager_config *c = &m->cfg;
  int rc = KVF_EINVAL;
  snprintf(m->host, sizeof m->host, "%s", c->host && *c->host ? c->host : "127.0.0.1");
  c->host = m->host;
  snprintf(m->bootstrap_addr, sizeof m->bootstrap_addr, "%s", c->bootstrap_addr ? c->bootstrap_addr : "");
  c->bootstrap_addr = m->bootstrap_addr;
  const char *tok = c->bootstrap_token ? c->bootstrap_token : getenv("KVFERRY_BOOTSTRAP_TOKEN");
  snprintf(m->bootstrap_token, sizeof m->bootstrap_token, "%s", tok ? tok : "");
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
  m->check_peer_ip = env_get_int("KVFERRY_CHECK_PEER_IP", 1) != 0;
  if (c->world_size % c->dp_size || c->engine_rank < 0 || c->engine_rank >= c->world_size) {
    LOG_ERROR("kv", "bad parallel layout: rank %d of world %d with dp %d", c->engine_rank, c->world_size,
              c->dp_size);
    goto err_free;
  }
  m->tp_size = c->world_size / c->dp_size;
  m->tp_rank = c->engine_rank % m->tp_size;
  m->dp_rank = c->engine_rank / m->tp_size;
  if ((rc = copy_buffers(&m->bufs, bufs))) goto err_free;
  if ((rc = rooms_table_new(c->max_rooms, &m->rooms))) goto err_bufs;

  if (c->engine) {
    m->engine = c->engine;
  } else {
    kvf_engine_config ec;
    kvf_engine_config_init(&ec);
    if (c->engine_cfg && (rc = kvf__config_copy(&ec, sizeof ec, c->engine_cfg, sizeof ec))) goto err_rooms;
    if (!ec.host || !strcmp(ec.host, "127.0.0.1")) ec.host = m->host;
    if ((rc = kvf_engine_create(&ec, &m->engine))) goto err_rooms;
    m->own_engine = 1;
  }
  c->engine = m->engine;
  c->engine_cfg = NULL; /* the caller's, read only during create */
  if ((rc = register_buffers(m))) goto err_engine;

  pthread_mutex_init(&m->push_lock, NULL);
  if ((rc = smap_init(&m->pushes))) goto err_lock;
  m->zctx = zmq_ctx_new();
  if (!m->zctx) {
    rc = KVF_EIO;
    goto err_pushes;
  }
  if ((rc = bind_pull(m))) goto err_zmq;
  rc = c->role == KVF_ROLE_DECODE ? decode_start(m) : prefill_start(m);
  if (rc) goto err_zmq;
  if (pthread_create(&m->listener, NULL, listener_main, m)) {
    rc = KVF_ENOMEM;
    goto err_role;
  }
  m->listener_started = 1;
  LOG_INFO("kv", "%s manager rank %d: engine %s, control port %u", c->role == KVF_ROLE_DECODE ? "decode" : "prefill",
           c->engine_rank, kvf_engine_session_id(m->engine), (unsigned)m->rank_port);
  *out = m;
  return 0;

err_role:
  if (c->role == KVF_ROLE_DECODE) decode_stop(m);
  else prefill_stop(m);
err_zmq:
  if (m->pull) zmq_close(m->pull);
  zmq_ctx_term(m->zctx);
err_pushes:
  smap_free(&m->pushes);
err_lock:
  pthread_mutex_destroy(&m->push_lock);
  unregister_buffers(m);
err_engine:
  if (m->own_engine) kvf_engine_destroy(m->engine);
err_rooms:
  rooms_table_free(m->rooms, NULL);
err_bufs:
  free_buffers(&m->bufs);
err_free:
  free(m);
  return rc;
}

void kvf_manager_destroy(kvf_manager *m) {
  if (!m) return;
  atomic_store(&m->stopping, 1);
  if (m->listener_started) pthread_join(m->listener, NULL);
  if (m->cfg.role == KVF_ROLE_DECODE) decode_stop(m);
  else prefill_stop(m);
  zmq_close(m->pull);
  close_pushes(m);
  zmq_ctx_term(m->zctx);
  pthread_mutex_destroy(&m->push_lock);
  unregister_buffers(m);
  if (m->own_engine) kvf_engine_destroy(m->engine);
  rooms_table_free(m->rooms, NULL);
  free_buffers(&m->bufs);
  sodium_memzero(m->ctl_key, sizeof m->ctl_key);
  free(m);
}

const char *kvf_manager_session_id(const kvf_manager *m) { return kvf_engine_session_id(m->engine); }
kvf_engine *kvf_manager_engine(kvf_manager *m) { return m->engine; }

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
  o->live_rooms = rooms_count(m->rooms);
}

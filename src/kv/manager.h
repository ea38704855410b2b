/* The part of a KV manager both roles share: configuration (defaults, then
 * TOKENSPEED_DISAGGREGATION_* overrides), the copied buffer description, the
 * transfer engine, the room table, the ZMQ PULL socket with its listener
 * thread, and a cache of PUSH sockets per peer endpoint. decode.c and
 * prefill.c add their role's state behind `decode` / `prefill` and receive
 * every control message through their on_message hook, on the listener
 * thread, which owns the PULL socket. */
#ifndef KVF_KV_MANAGER_H
#define KVF_KV_MANAGER_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "base/map.h"
#include "kv/rooms.h"
#include "kvferry/kv.h"
#include "wire/messages.h"

/* Rooms with an M2 but no sender yet that one decode session may hold on a
 * prefill rank (prefill.c; issue 13 defect 6). */
#define PF_MAX_EARLY_PER_SESSION 4096

typedef struct manager_counters {
  atomic_ullong messages_received, messages_malformed, messages_unknown_room;
  atomic_ullong chunks_sent, bytes_sent, heartbeat_failures, node_failures, messages_forged;
} manager_counters;

/* Buffers as copied from kvf_kv_buffers, with the layer mapping resolved. */
typedef struct manager_buffers {
  size_t n_kv;
  uint64_t *kv_ptrs, *kv_lens, *kv_item_lens, *kv_unit_lens;
  size_t n_layers;
  uint32_t *layer_buf_start; /* n_layers + 1 */
  uint32_t *layer_bufs;
  size_t n_state;
  uint64_t *state_ptrs, *state_lens, *state_item_lens, *state_unit_lens;
} manager_buffers;

struct kvf_manager {
  kvf_manager_config cfg; /* resolved: defaults and env applied; strings point into the fields below */
  char host[256];
  char bootstrap_addr[300];
  char bootstrap_token[256];
  int tp_size, tp_rank, dp_rank; /* tp_rank = attn_tp_rank = engine_rank % tp */
  manager_buffers bufs;
  kvf_engine *engine;
  int own_engine;
  uint8_t *own_regions; /* n_kv + n_state flags: 1 = this manager registered that buffer */
  rooms *rooms;
  manager_counters stats;

  void *zctx;
  void *pull;           /* owned by the listener thread once it runs */
  uint16_t rank_port;   /* the PULL socket's port */
  pthread_t listener;
  int listener_started;
  atomic_int stopping;

  /* Control-plane authentication (issue 13 defect 5): the HMAC key, 0 bytes
   * = off; whether a message's sender IP must match what it claims or what
   * the room was planned with ($KVFERRY_CHECK_PEER_IP, default 1). */
  unsigned char ctl_key[257]; /* NUL-terminated: cfg.control_token points here */
  size_t ctl_keylen;
  int check_peer_ip;

  pthread_mutex_t push_lock; /* guards `pushes` (the map, not the sockets) */
  smap pushes;               /* "host:port" -> manager_push */

  struct decode_state *decode;
  struct prefill_state *prefill;
};

/* Role hooks, implemented in decode.c and prefill.c. start runs after the
 * common parts are up (the listener is not started yet); stop before they
 * are torn down, after the listener has been joined. on_message runs on the
 * listener thread with frames valid only during the call; `peer` is the
 * sender's address as libzmq reports it ("?" if unknown), for logs and for
 * the sender checks (manager_peer_is). With a control token the frames are
 * already authenticated and exclude the MAC frame. */
int decode_start(kvf_manager *m);
void decode_stop(kvf_manager *m);
void decode_on_message(kvf_manager *m, const wire_frame *frames, size_t n, const char *peer);
int prefill_start(kvf_manager *m);
void prefill_stop(kvf_manager *m);
void prefill_on_message(kvf_manager *m, const wire_frame *frames, size_t n, const char *peer);

/* Send an encoded message to the PULL socket at host:port through the cached
 * PUSH socket for that endpoint (one lock per socket, so FIFO order holds per
 * endpoint). Never blocks longer than about a second: a peer that does not
 * drain gets KVF_ETIMEDOUT. Any thread. */
int manager_push_send(kvf_manager *m, const char *host, uint16_t port, const wire_msg *msg);
/* Forget the cached PUSH socket to host:port (after the peer restarted). */
void manager_push_forget(kvf_manager *m, const char *host, uint16_t port);

/* Log a malformed message once per (peer host, kind) and count it. */
void manager_reject(kvf_manager *m, const char *peer, const char *kind, const char *reason);
/* The same for a message that is well formed but not from whom it should be
 * (counted in messages_forged). */
void manager_reject_forged(kvf_manager *m, const char *peer, const char *kind, const char *reason);
/* 1 when `peer` (libzmq's Peer-Address of a message) is the address `ip`
 * (an IPv4/IPv6 literal; IPv4-mapped IPv6 counts as IPv4), or when the check
 * is off or `ip` is a host name (not checkable without DNS); 0 otherwise. */
int manager_peer_is(const kvf_manager *m, const char *peer, const char *ip);

/* The MAC frame (see manager.c) of frames f[0..n) under m's control token:
 * MANAGER_MAC_LEN bytes into out. Any thread. */
#define MANAGER_MAC_LEN 40 /* 8 bytes of clock + HMAC-SHA256 */
void kvf__control_mac(const kvf_manager *m, const wire_frame *f, size_t n, unsigned char out[MANAGER_MAC_LEN]);

#endif

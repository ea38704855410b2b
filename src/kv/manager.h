/* The part of a KV manager both roles share: configuration (defaults, then
 * TOKENSPEED_DISAGGREGATION_* overrides), the copied buffer description, the
 * transfer engine, the room table, the ZMQ PULL socket with its listener
 * thread, and a cache of PUSH sockets per peer endpoint (control.c). The
 * roles (kv/decode/, kv/prefill/) add their state behind `decode` /
 * `prefill` and receive every control message through their on_message
 * hook, on the listener thread, which owns the PULL socket. */
#ifndef KVF_KV_MANAGER_H
#define KVF_KV_MANAGER_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>

#include "base/addr.h"
#include "base/map.h"
#include "kv/plan.h"
#include "kv/rooms.h"
#include "kv/trace.h"
#include "kvferry/kv.h"
#include "wire/messages.h"

/* Rooms with an M2 but no sender yet that one decode session may hold on a
 * prefill rank (prefill/rooms_early.c; issue 13 defect 6). */
#define PF_MAX_EARLY_PER_SESSION 4096

typedef struct manager_counters {
  atomic_ullong messages_received, messages_malformed, messages_unknown_room;
  atomic_ullong chunks_sent, bytes_sent, heartbeat_failures, node_failures, messages_forged;
  atomic_ullong completions_fast; /* decode: room completions taken from engine trailers */
  atomic_ullong verify_failures, verify_unverified, rooms_fenced;
} manager_counters;

/* The engine fence tag of a room (kvf_batch_opts.tag): never 0 except for
 * the one room id INT64_MIN, which is then sent unfenced. */
static inline uint64_t manager_room_tag(int64_t room) { return (uint64_t)room ^ 0x8000000000000000ull; }

/* Buffers as copied from kvf_kv_buffers, with the layer mapping resolved. */
typedef struct manager_buffers {
  size_t n_kv;
  uint64_t *kv_ptrs, *kv_lens, *kv_item_lens, *kv_unit_lens;
  size_t n_layers;
  /* The KV layer map, stored once: the caller's (kvf_kv_buffers) copied, or
   * kvf__plan_layout_default's; kv_layout is the planner's view of it (kv/plan.h),
   * for both roles. */
  uint32_t *layer_buf_start; /* n_layers + 1 */
  uint32_t *layer_bufs;
  plan_layout kv_layout;
  size_t n_state;
  uint64_t *state_ptrs, *state_lens, *state_item_lens, *state_unit_lens;
  uint32_t *state_layer; /* n_state KV layer indices (config state_layer_ids), or NULL */
} manager_buffers;

/* A role (prefill or decode) plugged into the shared core through one
 * table, as the engine's transports are (engine_internal.h): kvf_manager_create
 * picks it once from cfg.role, and nothing else asks which role runs. start
 * runs after the common parts are up (the listener is not started yet); stop
 * before they are torn down, after the listener has been joined (also after
 * a failed start). on_message runs on the listener thread with frames valid
 * only during the call; `peer` is the sender's address as libzmq reports it
 * ("?" if unknown), for logs and for the sender checks
 * (kvf__manager_peer_is). With a control token the frames are already
 * authenticated and exclude the MAC frame. */
typedef struct manager_role_ops {
  const char *name; /* "prefill" or "decode", for logs */
  int (*start)(kvf_manager *m);
  void (*stop)(kvf_manager *m);
  void (*on_message)(kvf_manager *m, const wire_frame *frames, size_t n, const char *peer);
  /* Optional, on the listener thread before it waits and every
   * MANAGER_TICK_MSGS messages: the role's timed work; returns the longest
   * the listener may wait before the next call, in ms (-1: no limit). */
  int (*tick)(kvf_manager *m);
  /* The live trace record (kv/trace.h) of a live room's user pointer; runs
   * under the room table's lock (kvf__rooms_with_user). */
  const trace_live *(*trace_of)(void *user);
} manager_role_ops;

/* The two roles: decode/lifecycle.c, prefill/lifecycle.c. */
extern const manager_role_ops kvf__decode_role, kvf__prefill_role;

/* Their hooks (decode/lifecycle.c, decode/status_listener.c;
 * prefill/lifecycle.c, prefill/listener.c). */
int kvf__decode_start(kvf_manager *m);
void kvf__decode_stop(kvf_manager *m);
void kvf__decode_on_message(kvf_manager *m, const wire_frame *frames, size_t n, const char *peer);
int kvf__prefill_start(kvf_manager *m);
void kvf__prefill_stop(kvf_manager *m);
void kvf__prefill_on_message(kvf_manager *m, const wire_frame *frames, size_t n, const char *peer);

struct kvf_manager {
  kvf_manager_config cfg; /* resolved: defaults and env applied; strings point into the fields below */
  char host[KVF_ADDR_HOST_LEN];
  char bootstrap_addr[KVF_ADDR_LEN];
  char bootstrap_token[256];
  int tp_size, tp_rank, dp_rank; /* tp_rank = attn_tp_rank = engine_rank % tp */
  manager_buffers bufs;
  kvf_engine *engine;
  int own_engine;
  uint8_t *own_regions; /* n_kv + n_state flags: 1 = this manager registered that buffer */
  rooms *rooms;
  manager_counters stats;

  void *zctx;
  /* The control port: a ZMQ_STREAM socket on which the listener speaks
   * ZMTP's PULL side itself (wire/zmtp.h, control.c), to bound each message
   * as a whole. Owned by the listener thread once it runs. */
  void *pull;
  uint16_t rank_port; /* the PULL socket's port */
  pthread_t listener;
  int listener_started;
  atomic_int stopping;
  int wake_fd; /* eventfd the listener polls besides the PULL socket (kvf__control_wake); -1: none */

  /* Control-plane authentication (issue 13 defect 5): the HMAC key, 0 bytes
   * = off; whether a message's sender IP must match what it claims or what
   * the room was planned with ($KVFERRY_CHECK_PEER_IP, default 1). */
  unsigned char ctl_key[257]; /* NUL-terminated: cfg.control_token points here */
  size_t ctl_keylen;
  int check_peer_ip;

  pthread_mutex_t push_lock; /* guards `pushes` (the map, not the sockets) */
  smap pushes;               /* "host:port" -> manager_push */
  int64_t push_idle_ns;      /* a PUSH socket unused this long is closed ($KVFERRY_CONTROL_IDLE_S); 0: never */
  int64_t push_swept_ns;     /* the listener's last look for idle ones (its thread only) */
  int push_trim_due;         /* that look closed some: trim the heap at the next (its thread only) */

  const manager_role_ops *role; /* set once, before the role starts */
  struct decode_state *decode;
  struct prefill_state *prefill;
  struct integ_state *integ; /* verify mode and fences (integrity.c) */
  trace_ring *trace;         /* finished rooms' traces and the histograms (trace.c) */
};

/* Send an encoded message to the PULL socket at host:port through the cached
 * PUSH socket for that endpoint (one lock per socket, so FIFO order holds per
 * endpoint). Never blocks longer than about a second: a peer that does not
 * drain gets KVF_ETIMEDOUT. Any thread. */
int kvf__manager_push_send(kvf_manager *m, const char *host, uint16_t port, const wire_msg *msg);
/* The same for a message that may be lost (a fence notice: the engine's
 * fence already holds without it), sent from a call that must not wait on
 * the network: never waits on the peer, and at most MANAGER_POST_LOCK_MS for
 * another sender to the same peer; dropped (KVF_ETIMEDOUT, logged once per
 * peer) when the peer's queue is full or that sender holds on. */
int kvf__manager_push_post(kvf_manager *m, const char *host, uint16_t port, const wire_msg *msg);
/* Forget the cached PUSH socket to host:port (after the peer restarted). */
void kvf__manager_push_forget(kvf_manager *m, const char *host, uint16_t port);

/* A control message's frames (with `extra` more than fit) from `peer`:
 * the MAC check when a control token is set, then the role's on_message.
 * The listener's path, also taken by completions that ride the engine
 * (decode). Any thread. */
void kvf__manager_dispatch(kvf_manager *m, const wire_frame *frames, size_t n, size_t extra, const char *peer);
/* An encoded message (and its MAC frame, with a control token) as an engine
 * trailer: its length, or 0 when it does not fit in cap. Any thread. */
size_t kvf__trailer_pack(const kvf_manager *m, const wire_msg *msg, unsigned char *out, size_t cap);
/* A trailer's frames, pointing into p (at most cap; the rest counted in
 * *extra); KVF_EPROTO when malformed. Any thread. */
int kvf__trailer_unpack(const unsigned char *p, size_t len, wire_frame *f, size_t cap, size_t *n, size_t *extra);
#define MANAGER_MAX_RECV_FRAMES (WIRE_MAX_FRAMES + 1) /* the largest message and its MAC */

/* Log a malformed message once per (peer host, kind) and count it. */
void kvf__manager_reject(kvf_manager *m, const char *peer, const char *kind, const char *reason);
/* The same for a message that is well formed but not from whom it should be
 * (counted in messages_forged). */
void kvf__manager_reject_forged(kvf_manager *m, const char *peer, const char *kind, const char *reason);
/* 1 when `peer` (libzmq's Peer-Address of a message) is the address `ip`
 * (an IPv4/IPv6 literal; IPv4-mapped IPv6 counts as IPv4), or when the check
 * is off or `ip` is a host name (not checkable without DNS); 0 otherwise. */
int kvf__manager_peer_is(const kvf_manager *m, const char *peer, const char *ip);

/* The MAC frame (see control.c) of frames f[0..n) under m's control token:
 * MANAGER_MAC_LEN bytes into out. Any thread. */
#define MANAGER_MAC_LEN 40 /* 8 bytes of clock + HMAC-SHA256 */
/* Seconds a PUSH socket may go unused before it is closed (the default of
 * $KVFERRY_CONTROL_IDLE_S; kvf__control_close_idle_pushes). */
#define MANAGER_PUSH_IDLE_S 30
void kvf__control_mac(const kvf_manager *m, const wire_frame *f, size_t n, unsigned char out[MANAGER_MAC_LEN]);

/* control.c, for kvf_manager_create / destroy: bind the PULL socket to a
 * kernel-chosen port (m->rank_port), the listener thread's body, and closing
 * every cached PUSH socket (after the listener stopped). */
int kvf__control_bind_pull(kvf_manager *m);
/* Sockets one manager's ZeroMQ context may hold: its PULL socket and up to
 * MANAGER_MAX_PUSHES cached PUSH sockets (one per peer address), for
 * ZMQ_MAX_SOCKETS. Each takes descriptors too (a connection and a mailbox):
 * a process that talks to thousands of peers needs RLIMIT_NOFILE to match. */
int kvf__control_socket_limit(void);
/* Wake the listener from its wait, so that it runs the role's timed work
 * (tick) now: for work queued by another thread that is due before the
 * listener's current wait ends. Any thread. */
void kvf__control_wake(kvf_manager *m);
void *kvf__control_listener_main(void *arg);
void kvf__control_close_pushes(kvf_manager *m);
/* Close the PUSH sockets unused for m->push_idle_ns (the listener calls it
 * about once a second); a later message to that peer opens a new one.
 * Returns how many it closed. */
size_t kvf__control_close_idle_pushes(kvf_manager *m, int64_t now_ns);

#endif

/* The decode half of the KV manager (PROTOCOL §1.6, §3.3-3.5, §5, §7.1-7.3):
 * receivers, the status listener and the heartbeat, ported from the
 * reference's MooncakeKVManagerDecode and its receiver. Private to
 * src/kv/decode/: discovery.c (parallel info, route plans, pool entries,
 * M1/M2), receiver.c (the kvf_receiver API), status_listener.c (M3s and
 * completion trailers), heartbeat.c (probes, node failure, rank
 * revalidation), lifecycle.c (start and stop).
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
 *   short-lived client on cache misses, the heartbeat one per probe.
 *
 * Which rooms belong to an address is found through the room table's user
 * pointer (the receiver) rather than a separate addr->rooms set, so there is
 * nothing to prune and nothing that can grow. */
#ifndef KVF_KV_DECODE_INT_H
#define KVF_KV_DECODE_INT_H

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "base/clock.h"
#include "base/log.h"
#include "base/parse.h"
#include "bootstrap/bootstrap.h"
#include "engine/async.h"
#include "kv/integrity.h"
#include "kv/manager.h"
#include "kv/plan.h"
#include "kv/probe.h"

#define DECODE_MAX_ADDRS 1024        /* bootstrap addresses cached at once */
#define DECODE_MAX_POOLS 65536       /* pool keys cached at once */
#define DECODE_KEY_MAX 8192          /* bytes of a pool key */
#define DECODE_HB_CONNECT_MS 2000    /* the reference heartbeat's (2, 3) timeouts */
#define DECODE_HB_TIMEOUT_MS 5000    /* ... each capped at the heartbeat interval */
#define DECODE_PROBE_TIMEOUT_MS 1000 /* a rank's ZMTP greeting (also capped at the interval) */
#define DECODE_HB_PARALLEL 16        /* threads probing prefill instances at once in one heartbeat round */

/* One resolved target prefill rank. */
typedef struct pool_target {
  int rank;
  int is_dummy;
  int required_dst_info_num;
  char ip[KVF_ADDR_HOST_LEN];
  uint16_t port;
  size_t frag_start, nfrags;
} pool_target;

/* The targets of one pool key, shared by every receiver using it. */
typedef struct pool_entry {
  atomic_int refs;
  char addr[KVF_ADDR_LEN];
  int64_t group; /* the target dp group, for the heartbeat's rank revalidation */
  int ntargets;
  pool_target *targets;
  size_t nfrags;
  wire_fragment *frags; /* sent only when the plan is fragmented */
  int fragmented;
  int64_t page_layout; /* M2 frame 14 (kvferry): tokens per token-major page; 0 = not sent */
  int kvferry_peer;    /* the prefill published kvferry's page layout: M2 frame 15 goes out */
  int required_prefill_response_num;
  int supports_spec; /* the plan's supports_remote_spec_candidates */
} pool_entry;

/* What is known about one bootstrap address. */
typedef struct addr_entry {
  uint64_t epoch; /* distinguishes this entry from a later one of the same address */
  int64_t tp_p, dp_p;
  int64_t page_layout; /* see pool_entry */
  int kvferry_peer;    /* see pool_entry */
  plan_route plan;
  char ranks[DECODE_KEY_MAX / 2]; /* target ranks joined by ',' (the pool key's tail) */
} addr_entry;

/* Heartbeat bookkeeping of one address; heartbeat thread only. */
typedef struct hb_peer {
  int failures;
  int seen; /* still in the probe set this round */
} hb_peer;

/* One kind of a manager's buffers (KV, or state) as fence grids hold them
 * (engine/async.h, kvf__fence_grid): n (base, len, item) triples sorted by
 * base, and each one's reach. */
typedef struct bound_bufs {
  uint64_t *bufs, *reach;
  size_t n;
} bound_bufs;

struct decode_state {
  int fast;             /* this manager holds the engine's trailer callback: M2s ask for the fast completion */
  pthread_mutex_t lock; /* guards infos, down, pools, next_epoch, spare */
  struct kvf_receiver *spare; /* destroyed receivers kept for the next rooms (DECODE_SPARE_MAX) */
  size_t nspare;
  smap infos; /* bootstrap addr -> addr_entry */
  smap down;  /* bootstrap addr -> addr_down: its discovery timed out lately (discovery.c) */
  smap pools; /* pool key -> pool_entry (one reference held by the map) */
  uint64_t next_epoch;
  int refusals; /* this manager has the engine's refusal callback (integrity.c) */
  int landed;   /* and its landed callback (verify mode: pages hashed as they land) */

  /* The KV and state buffers sorted by address, as the rooms' fence
   * bounds use them (room_bounds.c). */
  bound_bufs bound_kv, bound_state;

  /* Planner inputs that never change, converted once (the layout by the
   * manager: m->bufs.kv_layout). */
  plan_layout layout;
  int64_t *d_kv_item, *d_kv_unit, *d_state_item, *d_state_unit;

  pthread_t hb;
  int hb_started;
  pthread_mutex_t hb_lock;
  pthread_cond_t hb_cond;
  int hb_stop;   /* guarded by hb_lock */
  smap hb_peers; /* heartbeat thread only: addr -> hb_peer */
};

struct kvf_receiver {
  kvf_manager *m;
  int64_t room;
  char addr[KVF_ADDR_LEN];
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
  /* Set just before the M2s go out when they ask for the fast completion:
   * only then may a completion come in an engine trailer. */
  atomic_int asked_fast;
  /* Set just before this receiver's first M2 goes out: until then no prefill
   * has been asked, so no M3 or trailer may count for the room (a late one
   * from an earlier use of the same room id included). */
  atomic_int m2_out;
  /* The fence epoch the last init's M2s carried (0: none), for the status
   * listener: a kvferry prefill's M3 names the epoch it answers (frame 6),
   * and one that names another answers an earlier use of the room id. */
  _Atomic uint64_t m2_epoch;
  struct kvf_receiver *next_spare; /* on ds->spare once destroyed */
  /* Fencing (integrity.c): the room's engine fence epoch, 0 = unfenced;
   * `fenced` once it was closed on Failed. The receiver's thread only. */
  uint64_t fence_epoch;
  int fenced;
  /* The fence's bounds (room_bounds.c): what a prefill may write, or have
   * read, here: the room's runs of pages, then of state slots, as (first,
   * count) pairs in `bounds`, over the manager's buffers (`grids`). Kept
   * across reuse of the receiver (grow-only, no allocation per room once
   * warm); valid until the fence is closed. */
  kvf__fence_grid grids[2];
  uint64_t *bounds;
  size_t bounds_cap;
  int64_t *sorted; /* scratch: the room's pages, sorted */
  size_t sorted_cap;
  /* The room's trace (kv/trace.h): steps from this thread, the listener
   * (completion_seen, under the room table's lock) and the engine's fence
   * (what landed, read at the first final poll). */
  trace_live tr;
  int final_seen; /* a poll returned Success or Failed */
  /* What kvf_receiver_poll reads, without the room table's lock: the
   * room's status cell (kvf__rooms_status_cell, valid until destroy clears
   * the room) and when the last init sent its M2s (0: not yet), which
   * starts the waiting timeout. The receiver's thread only. */
  const atomic_int *status;
  int64_t init_ns;
};

/* room_bounds.c */
/* The manager's KV and state buffers as the fence grids' buffers, once, at
 * start (ds->bound_kv, ds->bound_state); _free frees them. */
int kvf__dec_bound_bufs_build(struct decode_state *ds, const manager_buffers *b);
void kvf__dec_bound_bufs_free(struct decode_state *ds);
/* Bound the room's fence to its own pages (every KV buffer's pages, every
 * state buffer's slots): a chunk for the room landing elsewhere is refused
 * by this engine. KVF_ENOMEM leaves the fence without bounds. */
int kvf__dec_room_bound(kvf_manager *m, kvf_receiver *r, const int64_t *pages, size_t npages, const int64_t *slots,
                        size_t nslots);
void kvf__dec_receiver_free(kvf_receiver *r);

/* discovery.c */
void kvf__dec_pool_unref(pool_entry *p);
void kvf__dec_addr_entry_free(addr_entry *a);
int64_t *kvf__dec_to_i64(const uint64_t *src, size_t n);
__attribute__((format(printf, 3, 4))) void kvf__dec_set_reason(char *buf, size_t cap, const char *fmt, ...);
void kvf__dec_fail_room(kvf_manager *m, int64_t room, const char *reason);
void kvf__dec_fill_self(kvf_manager *m, char *endpoint, uint16_t *dst_port, char *session, uint16_t *session_port);
int kvf__dec_resolve_receiver(kvf_manager *m, kvf_receiver *r, char *reason, size_t rcap);
/* A prefill rank of room's plan has no registration of this decode
 * (WIRE_REASON_UNREGISTERED: its table dropped it): forget the room's cached
 * pool entry, so the next receiver for that prefill registers again (M1). */
void kvf__dec_forget_registration(kvf_manager *m, int64_t room);
/* The live trace of a receiver (the role's trace_of). */
const trace_live *kvf__dec_trace_of(void *user);

/* status_listener.c */
void kvf__dec_on_trailer(void *arg, const unsigned char *data, size_t len, const char *peer);
/* Test seam (tests/kv/test_decode.c; NULL in every shipped program): called
 * on the status listener's thread between an M3's origin check and what
 * the M3 does to its room. */
typedef void (*kvf__dec_m3_checked_fn)(int64_t room);
extern _Atomic(kvf__dec_m3_checked_fn) kvf__dec_m3_checked;

/* heartbeat.c */
void kvf__dec_hb_peer_free(hb_peer *p);
void *kvf__dec_heartbeat_main(void *arg);

#endif

/* Room traces inside the KV managers (issue 25; public side in
 * include/kvferry/trace.h, schema in docs/TRACE.md).
 *
 * A room's live record (`trace_live`) sits in the role's own per-room
 * object, which is recycled through spare lists (the decode's kvf_receiver,
 * the prefill's pf_room), so recording allocates nothing. Steps and counters
 * are atomics written by whichever thread observes them (first-wins for
 * "first" steps, latest-wins for "last" ones), so no lock is taken for a
 * step; a step costs one clock_gettime (vDSO) and one compare-and-swap, and
 * nothing at all for a room recorded with tracing off.
 *
 * When the room's object is released for good (decode: kvf_receiver_destroy;
 * prefill: the pf_room's last reference, so a worker's last step is in),
 * kvf__trace_finish copies the record into the manager's ring (one leaf
 * mutex, held for a copy), feeds the /metrics histograms (atomics) and, with
 * KVFERRY_TRACE=FILE, appends one JSON line with one write() (O_APPEND: several
 * processes may share the file). */
#ifndef KVF_KV_TRACE_H
#define KVF_KV_TRACE_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "base/clock.h"
#include "kvferry/trace.h"

struct kvf_manager;
struct kvf_engine;
typedef struct trace_ring trace_ring;

/* Counters of a live record (kvf__trace_add). */
enum { TRACE_BYTES, TRACE_DESCS, TRACE_CHUNKS, TRACE_RETRIES, TRACE_NCOUNTERS };

typedef struct trace_live {
  atomic_int on; /* this room is recorded (decided at kvf__trace_begin) */
  _Atomic int64_t t[KVF_TRACE_NSTEPS];
  atomic_ullong n[TRACE_NCOUNTERS];
  int64_t t0_unix_ns;
  /* the owner's thread fills these before kvf__trace_finish */
  uint32_t npeers;
  kvf_trace_peer peers[KVF_TRACE_MAX_PEERS];
} trace_live;

/* Manager create / destroy: the ring of `cap` finished records (0: no
 * ring, tracing off), the histograms and the KVFERRY_TRACE file. */
int kvf__trace_ring_new(size_t cap, trace_ring **out);
/* The engine whose routes fill a prefill record's missing transport and
 * mode as the record leaves the ring (trace_routes_fill): set once the
 * manager has its engine. kvf__trace_ring_stop appends what is left to the
 * KVFERRY_TRACE file and ends its writer: before the engine is destroyed. */
void kvf__trace_ring_engine(trace_ring *r, struct kvf_engine *e);
void kvf__trace_ring_stop(trace_ring *r);
void kvf__trace_ring_free(trace_ring *r);

/* Start a room's record (its first step comes next): recorded only while
 * the manager's tracing is on. The caller owns tl exclusively here. */
void kvf__trace_begin(struct kvf_manager *m, trace_live *tl);

static inline int kvf__trace_on(const trace_live *tl) {
  return atomic_load_explicit(&tl->on, memory_order_relaxed);
}
/* The step's time, if not set yet (the first observation wins). */
static inline void kvf__trace_at(trace_live *tl, int step, int64_t ns) {
  int64_t zero = 0;
  if (kvf__trace_on(tl)) atomic_compare_exchange_strong(&tl->t[step], &zero, ns ? ns : 1);
}
static inline void kvf__trace_now(trace_live *tl, int step) {
  if (kvf__trace_on(tl)) kvf__trace_at(tl, step, clock_now_ns());
}
/* The step's time, moved later (the last observation wins). */
static inline void kvf__trace_at_last(trace_live *tl, int step, int64_t ns) {
  if (!kvf__trace_on(tl)) return;
  int64_t cur = atomic_load(&tl->t[step]);
  while (cur < ns && !atomic_compare_exchange_weak(&tl->t[step], &cur, ns)) {
  }
}
static inline void kvf__trace_add(trace_live *tl, int counter, uint64_t v) {
  if (kvf__trace_on(tl)) atomic_fetch_add_explicit(&tl->n[counter], v, memory_order_relaxed);
}

/* Fill *out from a live record (finished 0; the caller sets room, side,
 * status and reason). Any thread (atomic reads). */
void kvf__trace_snapshot(struct kvf_manager *m, const trace_live *tl, int64_t room, kvf_room_trace *out);
/* The room is done on this side: its record (status, reason: "" or NULL
 * for none) goes into the ring, the histograms and the KVFERRY_TRACE file;
 * tl is off afterwards. Every other writer of tl has released it. Any
 * thread; takes only the ring's leaf lock. */
void kvf__trace_finish(struct kvf_manager *m, trace_live *tl, int64_t room, int status, const char *reason);

/* The histogram lines of kvf_manager_metrics (role and session labels):
 * whole lines only, into buf + n (cap - n left); returns the new n. */
size_t kvf__trace_metrics(struct kvf_manager *m, char *buf, size_t n, size_t cap);

#endif

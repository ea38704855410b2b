/* The room object of one KV manager (decode or prefill), one table of them
 * per manager: for every room its transfer status (PROTOCOL §2), the
 * failure reason, the prefill ranks that reported Success, the first token
 * and speculative candidates carried by those reports (§3.5), the time of
 * the last transfer request and the role's own per-room data (`user`: the
 * decode's receiver, the prefill's pf_room).
 *
 * A room is live (created by the local manager: a receiver or a sender) or
 * early: the prefill keeps an M2 that arrived before its sender in an early
 * room, which holds only its user pointer, is not live (every by-id call
 * below but get_user, set_user and clear sees it as absent, count and
 * stats.live leave it out) and becomes live, keeping its user pointer, when
 * kvf__rooms_create names it. Early rooms are bounded by their owner (the
 * prefill's PF_MAX_EARLY rule), live rooms by the table (max_rooms).
 *
 * Unlike the reference, the table never grows from network input: a message
 * about a room that is not live (never created, or already cleared) is
 * dropped and counted (`dropped_unknown`), never stored (§8 items 5, 6).
 * kvf__rooms_clear removes a room, after which the id may be reused from
 * scratch.
 *
 * Lock discipline (the one rule for rooms, both roles). Every function may
 * be called from any thread. One mutex inside the table guards every record, and it is a leaf: no function calls out while
 * holding it except the predicate of kvf__rooms_with_user /
 * kvf__rooms_fail_matching and the release callback of kvf__rooms_clear_all
 * (which must not call into the table), and nothing here blocks, allocates
 * under it beyond the map's own growth, or logs. A role that keeps its own
 * per-room data behind its own lock takes that lock first and the table's
 * second, never the reverse: the prefill holds ps->lock (then possibly a
 * queue's lock) while it calls in here, which is what lets it look a room's
 * pf_room up by id and act on it atomically (prefill_int.h, "Lifetime").
 * The decode's receiver is owned by its caller; the status listener reads
 * it only through kvf__rooms_with_user's predicate.
 *
 * Uses. A room id may be used again: created anew after a clear, or reset
 * by kvf__rooms_reset_responses (the decode's repeated init). Each use gets
 * a stamp, unique in the table. A message checked against one use (a
 * predicate of kvf__rooms_with_user_use) acts on that use only
 * (kvf__rooms_record_response, kvf__rooms_fail_use): between the check and
 * the act the caller's thread may lose the CPU while the id's owner ends the
 * use and starts the next, which an answer to the earlier use must not
 * complete or fail.
 *
 * Functions return 0 or a negative KVF_E* code and set output parameters
 * only on success. Nothing here logs: callers know the peer and log once. */
#ifndef KVF_KV_ROOMS_H
#define KVF_KV_ROOMS_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "kvferry/common.h"
#include "kvferry/kv.h" /* KVF_POLL_*: the one definition of the values */

/* Status values, wire-exact (§2.1): sent as ascii ints in M3, MIN-reduced
 * across ranks, so Failed must stay the smallest. */
enum {
  ROOM_FAILED = KVF_POLL_FAILED,
  ROOM_BOOTSTRAPPING = KVF_POLL_BOOTSTRAPPING,
  ROOM_BOOTSTRAPPED = KVF_POLL_BOOTSTRAPPED,
  ROOM_WAITING_FOR_INPUT = KVF_POLL_WAITING_FOR_INPUT,
  ROOM_TRANSFERRING = KVF_POLL_TRANSFERRING,
  ROOM_SUCCESS = KVF_POLL_SUCCESS,
};
#define ROOM_STATUS_MAX ROOM_SUCCESS

/* Bounds on what one room keeps, so a peer cannot make a room large. */
#define ROOMS_MAX_RANKS 4096               /* prefill ranks accepted in kvf__rooms_record_response: [0, 4096) */
#define ROOMS_MAX_CANDS KVF_MAX_CANDIDATES /* speculative candidate ids per message */
#define ROOMS_REASON_MAX 512               /* failure reasons are truncated to this many bytes (with NUL) */
#define ROOMS_DEFAULT_MAX (1u << 20)       /* live rooms when kvf__rooms_table_new gets 0 */

typedef struct rooms rooms;

/* Counters, for kvf_manager_stats (and tests). */
typedef struct rooms_stats {
  uint64_t live;                /* live rooms now */
  uint64_t early;               /* early rooms now */
  uint64_t created;             /* rooms made live by kvf__rooms_create */
  uint64_t cleared;             /* live rooms removed by kvf__rooms_clear / kvf__rooms_clear_all */
  uint64_t early_dropped;       /* early rooms removed without ever becoming live */
  uint64_t dropped_unknown;     /* update/fail/response for a room that is not live */
  uint64_t rejected_full;       /* creations refused by the live-room bound */
  uint64_t rejected_invalid;    /* bad status value, rank or candidate count */
  uint64_t duplicate_responses; /* Success reports from a rank already counted */
} rooms_stats;

/* The live room's status, readable without the table's lock: what
 * kvf__rooms_get_status would say, at the cost of one atomic load (a
 * scheduler polls every room it has in flight, often). The cell stays valid
 * until the room is cleared, which only the room's owner does (its
 * receiver's or sender's destroy; kvf__rooms_clear_all at teardown), so the
 * owner may keep it. NULL if the room is not live. The reason and the
 * rest are still read through the calls below. */
const atomic_int *kvf__rooms_status_cell(rooms *t, int64_t room);

/* A snapshot of one room, for polling, timeouts and the heartbeat. */
typedef struct rooms_info {
  int status;
  int required;  /* responses needed for Success (1 when never set) */
  int responded; /* distinct prefill ranks that reported Success */
  int has_reason;
  int has_token; /* a published (final) token is waiting to be popped */
  void *user;
} rooms_info;

/* Create an empty table holding at most `max_rooms` live rooms (0 = the
 * default ROOMS_DEFAULT_MAX). The caller owns *out. */
int kvf__rooms_table_new(size_t max_rooms, rooms **out);
/* Free the table and every room in it. `free_user` (may be NULL) is called
 * on each non-NULL user pointer still stored. NULL table is a no-op. Must not
 * race with any other call on the table. */
void kvf__rooms_table_free(rooms *t, void (*free_user)(void *));

/* Make room live with `status` (0..5): a new room, or an early one, which
 * keeps its user pointer. KVF_EEXIST if the room is already live (a reused
 * id must be cleared first so it cannot inherit an old terminal status, §8
 * item 6), KVF_ENOMEM at the live-room bound, KVF_EINVAL for a bad status. */
int kvf__rooms_create(rooms *t, int64_t room, int status);

/* Store an early room holding `user`. KVF_EEXIST if the room is present
 * (live or early), KVF_ENOMEM without memory. Not subject to max_rooms: the
 * caller bounds its early rooms. */
int kvf__rooms_add_early(rooms *t, int64_t room, void *user);

/* §2.2 on a live room only: Failed if either is Failed, else max(current,
 * status). An unknown room is not created: KVF_ENOTFOUND, counted in
 * dropped_unknown. *new_status (may be NULL) gets the resulting status. */
int kvf__rooms_update(rooms *t, int64_t room, int status, int *new_status);

/* Current status into *status; KVF_ENOTFOUND if not live (not counted). */
int kvf__rooms_get_status(rooms *t, int64_t room, int *status);
/* Snapshot of a live room; KVF_ENOTFOUND otherwise. */
int kvf__rooms_get_info(rooms *t, int64_t room, rooms_info *out);

/* Record `reason` (copied, truncated to ROOMS_REASON_MAX-1 bytes; overwrites
 * an earlier one) and mark the room Failed, overriding even Success. Unknown
 * room: KVF_ENOTFOUND, counted in dropped_unknown, nothing stored. */
int kvf__rooms_fail(rooms *t, int64_t room, const char *reason);
/* kvf__rooms_fail, only while the room is in use `use` (see "Uses";
 * another use: KVF_ENOTFOUND, counted in dropped_unknown). */
int kvf__rooms_fail_use(rooms *t, int64_t room, uint64_t use, const char *reason);
/* kvf__rooms_fail unless the room is Success already (checked and set under
 * one lock: a Success that wins the race stands). *failed (may be NULL):
 * whether this call failed it. */
int kvf__rooms_fail_unless_success(rooms *t, int64_t room, const char *reason, int *failed);
/* A new use of a live room (the decode's repeated init): forget every
 * response and first-token value of the earlier one and go back to
 * `status` (unless Failed). */
int kvf__rooms_reset_responses(rooms *t, int64_t room, int status);
/* Copy the recorded reason into buf (always NUL-terminated, truncated to
 * cap-1). A live room without a reason yields "". KVF_ENOTFOUND if not live,
 * KVF_EINVAL if cap is 0. The reason stays until kvf__rooms_clear. */
int kvf__rooms_get_reason(rooms *t, int64_t room, char *buf, size_t cap);

/* Number of distinct prefill ranks whose Success must arrive before the room
 * becomes Success (required_prefill_response_num); 1..ROOMS_MAX_RANKS. Set it
 * before sending the transfer requests; it is not re-evaluated against
 * responses that already arrived. */
int kvf__rooms_set_required(rooms *t, int64_t room, int required);

/* A Success report (M3) from `prefill_rank`, following the reference decode
 * listener exactly (§3.5): the rank joins the room's responder set (counted
 * once); a token != -1 and a non-empty candidate list are kept pending if
 * none is pending yet (first valid wins); once the set reaches the required
 * count the pending token/candidates are published BEFORE the status becomes
 * Success, so a poller that sees Success can pop them. `cands` may be NULL
 * when ncand is 0; ncand 0 means "no candidates" (an empty wire frame).
 * *became_success (may be NULL) is 1 iff this call moved the room to Success.
 * `use` != 0: only while the room is in that use ("Uses"). Unknown room (or
 * another use): KVF_ENOTFOUND, counted, nothing created. Rank outside
 * [0, ROOMS_MAX_RANKS): KVF_EINVAL; ncand > ROOMS_MAX_CANDS: KVF_ETOOBIG
 * (both counted in rejected_invalid, room untouched). */
int kvf__rooms_record_response(rooms *t, int64_t room, uint64_t use, int prefill_rank, int64_t token,
                               const int32_t *cands, size_t ncand, int *became_success);

/* Take the published token (-1 if none) and candidates out of a live room.
 * Candidates are copied into cands (capacity cap; ROOMS_MAX_CANDS always
 * suffices) and *ncand gets their count, 0 meaning none. KVF_ETOOBIG (nothing
 * taken) if cap is too small. */
int kvf__rooms_pop_metadata(rooms *t, int64_t room, int64_t *token, int32_t *cands, size_t cap, size_t *ncand);

/* The prefill's side of the first token (kvf_sender_set_metadata): publish
 * the room's token and candidates once, into the same fields a decode's
 * Success publishes into (cands is copied). 0; KVF_EEXIST if already
 * published, KVF_ENOTFOUND if not live, KVF_ETOOBIG past ROOMS_MAX_CANDS. */
int kvf__rooms_publish_metadata(rooms *t, int64_t room, int64_t token, const int32_t *cands, size_t ncand);
/* A copy of what kvf__rooms_publish_metadata stored (it stays): 0,
 * KVF_EAGAIN if nothing is published yet, KVF_ENOTFOUND if not live,
 * KVF_ETOOBIG if cap is short. */
int kvf__rooms_get_metadata(rooms *t, int64_t room, int64_t *token, int32_t *cands, size_t cap, size_t *ncand);

/* The role's per-room pointer, of a live or early room (KVF_ENOTFOUND
 * otherwise); the table never dereferences or frees it except through
 * kvf__rooms_table_free's and kvf__rooms_clear_all's callbacks. */
int kvf__rooms_set_user(rooms *t, int64_t room, void *user);
int kvf__rooms_get_user(rooms *t, int64_t room, void **user);
/* pred(user, arg) on a live room's user pointer, under the table lock (so
 * the pointer cannot be cleared meanwhile; pred must not call into the
 * table). Returns pred's answer (pred returns 0 or more), KVF_ENOTFOUND if
 * not live. */
int kvf__rooms_with_user(rooms *t, int64_t room, int (*pred)(void *user, void *arg), void *arg);
/* The stamp of the live room's current use ("Uses"); KVF_ENOTFOUND if not
 * live. */
int kvf__rooms_get_use(rooms *t, int64_t room, uint64_t *use);
/* kvf__rooms_with_user, and *use (may be NULL) gets the stamp of the use
 * pred saw. */
int kvf__rooms_with_user_use(rooms *t, int64_t room, int (*pred)(void *user, void *arg), void *arg, uint64_t *use);

/* Remove the room (live or early) and everything it holds; the id may then
 * be created anew. *user (may be NULL) gets the stored user pointer, which
 * the caller now owns. KVF_ENOTFOUND if absent. */
int kvf__rooms_clear(rooms *t, int64_t room, void **user);
/* Remove every room, live and early, handing each non-NULL user pointer to
 * release(user, arg) under the table lock (release must not call into the
 * table). For a role's shutdown. */
void kvf__rooms_clear_all(rooms *t, void (*release)(void *user, void *arg), void *arg);

/* The counters, live and early counts included. */
void kvf__rooms_get_stats(rooms *t, rooms_stats *out);

/* Change events (kvf_manager_event_fd). The table's eventfd, made on the
 * first call (a negative KVF_* error if it cannot be): from then on a room
 * whose status changes (a status, Success by the last response, a failure)
 * or a kvf__rooms_notify makes it readable, with one write until the next
 * kvf__rooms_event_clear. Without the fd a change costs nothing more. */
int kvf__rooms_event_fd(rooms *t);
/* Drain the eventfd: not readable until the next change. */
void kvf__rooms_event_clear(rooms *t);
/* A change the table cannot see (the prefill: a room's last transfer
 * ended, which its sender's poll waits for). */
void kvf__rooms_notify(rooms *t);

/* For the heartbeat's node-failure handling (§7.2): every live room that is
 * not Success and for which pred(room, user, arg) is non-zero gets `reason`
 * and Failed. pred runs under the table lock. *nfailed (may be NULL) gets the
 * number of rooms failed. */
int kvf__rooms_fail_matching(rooms *t, int (*pred)(int64_t room, void *user, void *arg), void *arg,
                             const char *reason, size_t *nfailed);

#endif

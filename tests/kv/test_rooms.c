/* Unit tests for the room table: the §2.2 status rule, room reuse, bounds,
 * messages for unknown rooms, the Success bookkeeping of §3.5, and a
 * concurrent workout that runs under TSan (the kv layer is "threaded"). */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include <poll.h>
#include <sched.h>
#include <pthread.h>
#include <stdatomic.h>

#include "kv/rooms.h"

static rooms *new_table(size_t max) {
  rooms *t = NULL;
  assert_int_equal(kvf__rooms_table_new(max, &t), 0);
  assert_non_null(t);
  return t;
}

static int status_of(rooms *t, int64_t room) {
  int s = -1;
  assert_int_equal(kvf__rooms_get_status(t, room, &s), 0);
  return s;
}

static uint64_t live_count(rooms *t) {
  rooms_stats st;
  kvf__rooms_get_stats(t, &st);
  return st.live;
}

/* The published token alone (its candidates, if any, are taken too). */
static int pop_token(rooms *t, int64_t room, int64_t *tok) {
  int32_t cands[ROOMS_MAX_CANDS];
  size_t n;
  return kvf__rooms_pop_metadata(t, room, tok, cands, ROOMS_MAX_CANDS, &n);
}

/* Every (current, incoming) pair of §2.2: Failed sticky and overriding
 * (Success included), otherwise max. */
static void update_rule_table(void **state) {
  rooms *t = new_table(0);
  for (int cur = 0; cur <= ROOM_STATUS_MAX; cur++)
    for (int s = 0; s <= ROOM_STATUS_MAX; s++) {
      int64_t room = cur * 10 + s;
      assert_int_equal(kvf__rooms_create(t, room, cur), 0);
      int now = -1;
      assert_int_equal(kvf__rooms_update(t, room, s, &now), 0);
      int want = (cur == ROOM_FAILED || s == ROOM_FAILED) ? ROOM_FAILED : (cur > s ? cur : s);
      assert_int_equal(now, want);
      assert_int_equal(status_of(t, room), want);
    }
  /* Explicit cases the spec calls out. */
  assert_int_equal(kvf__rooms_create(t, 100, ROOM_SUCCESS), 0);
  assert_int_equal(kvf__rooms_update(t, 100, ROOM_FAILED, NULL), 0);
  assert_int_equal(status_of(t, 100), ROOM_FAILED);
  assert_int_equal(kvf__rooms_update(t, 100, ROOM_SUCCESS, NULL), 0);
  assert_int_equal(status_of(t, 100), ROOM_FAILED);
  assert_int_equal(kvf__rooms_create(t, 101, ROOM_BOOTSTRAPPED), 0);
  assert_int_equal(kvf__rooms_update(t, 101, ROOM_BOOTSTRAPPING, NULL), 0);
  assert_int_equal(status_of(t, 101), ROOM_BOOTSTRAPPED);
  /* Bad status values are refused and change nothing. */
  assert_int_equal(kvf__rooms_update(t, 101, 6, NULL), KVF_EINVAL);
  assert_int_equal(kvf__rooms_update(t, 101, -1, NULL), KVF_EINVAL);
  assert_int_equal(kvf__rooms_create(t, 102, 6), KVF_EINVAL);
  assert_int_equal(status_of(t, 101), ROOM_BOOTSTRAPPED);
  kvf__rooms_table_free(t, NULL);
}

static int any_room(int64_t room, void *user, void *arg) { return 1; }

static void count_release(void *user, void *arg) { ++*(int *)arg; }

/* An early room (the prefill's M2 before its sender) holds only its user
 * pointer: no status call sees it, no count includes it, the live bound
 * applies only when it becomes live, and it keeps its pointer then. */
static void early_rooms_are_not_live(void **state) {
  rooms *t = new_table(2);
  int a, b, s;
  void *u = NULL;
  assert_int_equal(kvf__rooms_add_early(t, 1, &a), 0);
  assert_int_equal(kvf__rooms_add_early(t, 1, &b), KVF_EEXIST);
  assert_int_equal(kvf__rooms_get_status(t, 1, &s), KVF_ENOTFOUND);
  assert_int_equal(kvf__rooms_update(t, 1, ROOM_SUCCESS, NULL), KVF_ENOTFOUND);
  assert_int_equal(kvf__rooms_fail(t, 1, "x"), KVF_ENOTFOUND);
  assert_int_equal(kvf__rooms_record_response(t, 1, 0, 0, 5, NULL, 0, NULL), KVF_ENOTFOUND);
  assert_int_equal(live_count(t), 0);
  assert_int_equal(kvf__rooms_get_user(t, 1, &u), 0);
  assert_ptr_equal(u, &a);
  /* Early rooms do not count against the live bound; becoming live does. */
  assert_int_equal(kvf__rooms_add_early(t, 2, &b), 0);
  assert_int_equal(kvf__rooms_create(t, 10, ROOM_BOOTSTRAPPING), 0);
  assert_int_equal(kvf__rooms_create(t, 11, ROOM_BOOTSTRAPPING), 0);
  assert_int_equal(kvf__rooms_create(t, 1, ROOM_BOOTSTRAPPING), KVF_ENOMEM);
  assert_int_equal(kvf__rooms_get_status(t, 1, &s), KVF_ENOTFOUND);
  assert_int_equal(kvf__rooms_clear(t, 10, NULL), 0);
  assert_int_equal(kvf__rooms_create(t, 1, ROOM_BOOTSTRAPPED), 0);
  assert_int_equal(status_of(t, 1), ROOM_BOOTSTRAPPED);
  assert_int_equal(kvf__rooms_get_user(t, 1, &u), 0);
  assert_ptr_equal(u, &a);
  assert_int_equal(kvf__rooms_create(t, 1, ROOM_BOOTSTRAPPED), KVF_EEXIST);
  assert_int_equal(kvf__rooms_add_early(t, 1, &b), KVF_EEXIST);
  /* The heartbeat's pass fails live rooms only. */
  size_t n = 0;
  assert_int_equal(kvf__rooms_fail_matching(t, any_room, NULL, "gone", &n), 0);
  assert_int_equal(n, 2);
  rooms_stats st;
  kvf__rooms_get_stats(t, &st);
  assert_int_equal(st.live, 2);
  assert_int_equal(st.early, 1);
  assert_int_equal(st.created, 3);
  assert_int_equal(st.cleared, 1);
  assert_int_equal(st.rejected_full, 1);
  assert_int_equal(st.early_dropped, 0);
  assert_int_equal(kvf__rooms_clear(t, 2, &u), 0);
  assert_ptr_equal(u, &b);
  kvf__rooms_get_stats(t, &st);
  assert_int_equal(st.early, 0);
  assert_int_equal(st.early_dropped, 1);
  assert_int_equal(st.cleared, 1);
  /* Shutdown: every room goes, each user pointer handed over once. */
  assert_int_equal(kvf__rooms_add_early(t, 3, &b), 0);
  int released = 0;
  kvf__rooms_clear_all(t, count_release, &released);
  assert_int_equal(released, 2); /* rooms 1 and 3; room 11 has none */
  assert_int_equal(live_count(t), 0);
  assert_int_equal(kvf__rooms_get_user(t, 3, &u), KVF_ENOTFOUND);
  kvf__rooms_get_stats(t, &st);
  assert_int_equal(st.cleared, 3);
  assert_int_equal(st.early_dropped, 2);
  assert_int_equal(kvf__rooms_create(t, 3, ROOM_BOOTSTRAPPING), 0); /* the table works on */
  kvf__rooms_table_free(t, NULL);
}

/* A live room cannot be created again; once cleared, the id starts afresh
 * without the old status, reason, responders or token (§8 item 6). */
static void reuse_after_clear(void **state) {
  rooms *t = new_table(0);
  int64_t room = 7215963401;
  assert_int_equal(kvf__rooms_create(t, room, ROOM_BOOTSTRAPPING), 0);
  assert_int_equal(kvf__rooms_create(t, room, ROOM_BOOTSTRAPPING), KVF_EEXIST);
  assert_int_equal(kvf__rooms_set_required(t, room, 2), 0);
  assert_int_equal(kvf__rooms_record_response(t, room, 0, 0, 1734, NULL, 0, NULL), 0);
  assert_int_equal(kvf__rooms_fail(t, room, "first life"), 0);
  int dummy = 5;
  assert_int_equal(kvf__rooms_set_user(t, room, &dummy), 0);
  void *user = NULL;
  assert_int_equal(kvf__rooms_clear(t, room, &user), 0);
  assert_ptr_equal(user, &dummy);
  assert_int_equal(kvf__rooms_clear(t, room, NULL), KVF_ENOTFOUND);
  int s;
  assert_int_equal(kvf__rooms_get_status(t, room, &s), KVF_ENOTFOUND);

  assert_int_equal(kvf__rooms_create(t, room, ROOM_BOOTSTRAPPING), 0);
  rooms_info info;
  assert_int_equal(kvf__rooms_get_info(t, room, &info), 0);
  assert_int_equal(info.status, ROOM_BOOTSTRAPPING);
  assert_int_equal(info.required, 1);
  assert_int_equal(info.responded, 0);
  assert_int_equal(info.has_reason, 0);
  assert_int_equal(info.has_token, 0);
  assert_null(info.user);
  char buf[64];
  assert_int_equal(kvf__rooms_get_reason(t, room, buf, sizeof buf), 0);
  assert_string_equal(buf, "");
  /* With the default of one responder a single Success completes it. */
  int became = 0;
  assert_int_equal(kvf__rooms_record_response(t, room, 0, 0, 42, NULL, 0, &became), 0);
  assert_int_equal(became, 1);
  int64_t tok;
  assert_int_equal(pop_token(t, room, &tok), 0);
  assert_int_equal(tok, 42);
  kvf__rooms_table_free(t, NULL);
}

static void many_rooms_created_and_cleared(void **state) {
  rooms *t = new_table(0);
  for (int64_t r = 0; r < 10000; r++) {
    assert_int_equal(kvf__rooms_create(t, r * 7919 - 5000, ROOM_BOOTSTRAPPING), 0);
    assert_int_equal(kvf__rooms_fail(t, r * 7919 - 5000, "x"), 0);
  }
  assert_int_equal(live_count(t), 10000);
  for (int64_t r = 0; r < 10000; r++) assert_int_equal(kvf__rooms_clear(t, r * 7919 - 5000, NULL), 0);
  assert_int_equal(live_count(t), 0);
  rooms_stats st;
  kvf__rooms_get_stats(t, &st);
  assert_int_equal(st.created, 10000);
  assert_int_equal(st.cleared, 10000);
  assert_int_equal(st.live, 0);
  kvf__rooms_table_free(t, NULL);
}

static void live_room_bound(void **state) {
  rooms *t = new_table(3);
  for (int r = 0; r < 3; r++) assert_int_equal(kvf__rooms_create(t, r, ROOM_BOOTSTRAPPING), 0);
  assert_int_equal(kvf__rooms_create(t, 3, ROOM_BOOTSTRAPPING), KVF_ENOMEM);
  assert_int_equal(kvf__rooms_create(t, 4, ROOM_BOOTSTRAPPED), KVF_ENOMEM);
  /* An update of a live room is not a creation, so the bound does not apply. */
  assert_int_equal(kvf__rooms_update(t, 2, ROOM_BOOTSTRAPPED, NULL), 0);
  rooms_stats st;
  kvf__rooms_get_stats(t, &st);
  assert_int_equal(st.rejected_full, 2);
  assert_int_equal(kvf__rooms_clear(t, 0, NULL), 0);
  assert_int_equal(kvf__rooms_create(t, 3, ROOM_BOOTSTRAPPING), 0);
  assert_int_equal(live_count(t), 3);
  kvf__rooms_table_free(t, NULL);
}

/* The reference's late Failed M3 creates an entry (§8 item 5); here every
 * message for a room that is not live is dropped and counted. */
static void unknown_room_messages_dropped(void **state) {
  rooms *t = new_table(0);
  int32_t cands[2] = {1, 2};
  assert_int_equal(kvf__rooms_update(t, 9, ROOM_SUCCESS, NULL), KVF_ENOTFOUND);
  assert_int_equal(kvf__rooms_fail(t, 9, "Failed to get kvcache from prefill instance, it might be dead"),
                   KVF_ENOTFOUND);
  int became = 7;
  assert_int_equal(kvf__rooms_record_response(t, 9, 0, 0, 5, cands, 2, &became), KVF_ENOTFOUND);
  assert_int_equal(became, 7); /* outputs untouched on failure */
  assert_int_equal(live_count(t), 0);
  int s;
  assert_int_equal(kvf__rooms_get_status(t, 9, &s), KVF_ENOTFOUND);
  /* A cleared room is unknown again. */
  assert_int_equal(kvf__rooms_create(t, 10, ROOM_BOOTSTRAPPING), 0);
  assert_int_equal(kvf__rooms_clear(t, 10, NULL), 0);
  assert_int_equal(kvf__rooms_update(t, 10, ROOM_FAILED, NULL), KVF_ENOTFOUND);
  assert_int_equal(live_count(t), 0);
  rooms_stats st;
  kvf__rooms_get_stats(t, &st);
  assert_int_equal(st.dropped_unknown, 4);
  /* Local reads of an unknown room fail without counting as drops. */
  int64_t tok = 3;
  assert_int_equal(pop_token(t, 9, &tok), KVF_ENOTFOUND);
  assert_int_equal(tok, 3);
  char buf[8];
  assert_int_equal(kvf__rooms_get_reason(t, 9, buf, sizeof buf), KVF_ENOTFOUND);
  kvf__rooms_get_stats(t, &st);
  assert_int_equal(st.dropped_unknown, 4);
  kvf__rooms_table_free(t, NULL);
}

static int any_user(void *user, void *arg) {
  (void)user, (void)arg;
  return 1;
}

/* A message checked against one use of a room id acts on that use only:
 * after a reset (the decode's repeated init) or a clear and create, its
 * Success or Failed is dropped as for an unknown room; on the use it was
 * checked against it counts. */
static void answers_act_on_the_use_they_were_checked_against(void **state) {
  (void)state;
  rooms *t = new_table(0);
  uint64_t u1 = 0, u2 = 0, u3 = 0, u4 = 0;
  assert_int_equal(kvf__rooms_create(t, 8, ROOM_BOOTSTRAPPED), 0);
  assert_int_equal(kvf__rooms_with_user_use(t, 8, any_user, NULL, &u1), 1);
  assert_true(u1 != 0);
  assert_int_equal(kvf__rooms_reset_responses(t, 8, ROOM_BOOTSTRAPPED), 0);
  assert_int_equal(kvf__rooms_with_user_use(t, 8, any_user, NULL, &u2), 1);
  assert_true(u2 != u1);
  rooms_stats st;
  kvf__rooms_get_stats(t, &st);
  uint64_t dropped = st.dropped_unknown;
  assert_int_equal(kvf__rooms_record_response(t, 8, u1, 0, 7, NULL, 0, NULL), KVF_ENOTFOUND);
  assert_int_equal(kvf__rooms_fail_use(t, 8, u1, "stale"), KVF_ENOTFOUND);
  assert_int_equal(status_of(t, 8), ROOM_BOOTSTRAPPED);
  kvf__rooms_get_stats(t, &st);
  assert_int_equal(st.dropped_unknown, dropped + 2);
  /* Cleared and created again: another use again. */
  assert_int_equal(kvf__rooms_clear(t, 8, NULL), 0);
  assert_int_equal(kvf__rooms_create(t, 8, ROOM_BOOTSTRAPPED), 0);
  assert_int_equal(kvf__rooms_with_user_use(t, 8, any_user, NULL, &u3), 1);
  assert_true(u3 != u1 && u3 != u2);
  assert_int_equal(kvf__rooms_record_response(t, 8, u2, 0, 7, NULL, 0, NULL), KVF_ENOTFOUND);
  assert_int_equal(status_of(t, 8), ROOM_BOOTSTRAPPED);
  /* The use it was checked against, or any (0): it counts. */
  assert_int_equal(kvf__rooms_record_response(t, 8, u3, 0, 7, NULL, 0, NULL), 0);
  assert_int_equal(status_of(t, 8), ROOM_SUCCESS);
  assert_int_equal(kvf__rooms_reset_responses(t, 8, ROOM_BOOTSTRAPPED), 0);
  assert_int_equal(kvf__rooms_with_user_use(t, 8, any_user, NULL, &u4), 1);
  uint64_t now = 0;
  assert_int_equal(kvf__rooms_get_use(t, 8, &now), 0);
  assert_true(now == u4);
  assert_int_equal(kvf__rooms_fail_use(t, 8, u4, "now"), 0);
  assert_int_equal(status_of(t, 8), ROOM_FAILED);
  kvf__rooms_table_free(t, NULL);
}

/* Two responders expected; a duplicate counts once; the first valid token
 * and candidates win even when they come from the first responder; nothing
 * is published before the count is reached. */
static void first_token_wins_two_responders(void **state) {
  rooms *t = new_table(0);
  int64_t room = 55;
  int32_t a[3] = {1734, 2211, 90}, b[2] = {7, 8};
  assert_int_equal(kvf__rooms_create(t, room, ROOM_BOOTSTRAPPED), 0);
  assert_int_equal(kvf__rooms_set_required(t, room, 2), 0);
  int became = -1;
  /* Rank 1 first, with no token: must not block rank 0's token later. */
  assert_int_equal(kvf__rooms_record_response(t, room, 0, 1, -1, NULL, 0, &became), 0);
  assert_int_equal(became, 0);
  assert_int_equal(kvf__rooms_record_response(t, room, 0, 1, 1734, a, 3, &became), 0);
  assert_int_equal(became, 0);
  assert_int_equal(status_of(t, room), ROOM_BOOTSTRAPPED);
  int64_t tok;
  int32_t got[ROOMS_MAX_CANDS];
  size_t n = 99;
  /* Pending values are not visible before Success. */
  assert_int_equal(kvf__rooms_pop_metadata(t, room, &tok, got, ROOMS_MAX_CANDS, &n), 0);
  assert_int_equal(tok, -1);
  assert_int_equal(n, 0);
  rooms_info info;
  assert_int_equal(kvf__rooms_get_info(t, room, &info), 0);
  assert_int_equal(info.responded, 1);
  assert_int_equal(info.required, 2);
  /* Rank 0 completes the set; its different token/candidates lose. */
  assert_int_equal(kvf__rooms_record_response(t, room, 0, 0, 555, b, 2, &became), 0);
  assert_int_equal(became, 1);
  assert_int_equal(status_of(t, room), ROOM_SUCCESS);
  /* Candidate buffer too small: nothing is taken. */
  assert_int_equal(kvf__rooms_pop_metadata(t, room, &tok, got, 2, &n), KVF_ETOOBIG);
  assert_int_equal(kvf__rooms_pop_metadata(t, room, &tok, got, ROOMS_MAX_CANDS, &n), 0);
  assert_int_equal(tok, 1734);
  assert_int_equal(n, 3);
  assert_memory_equal(got, a, sizeof a);
  /* Popped once. */
  assert_int_equal(kvf__rooms_pop_metadata(t, room, &tok, got, ROOMS_MAX_CANDS, &n), 0);
  assert_int_equal(tok, -1);
  assert_int_equal(n, 0);
  rooms_stats st;
  kvf__rooms_get_stats(t, &st);
  assert_int_equal(st.duplicate_responses, 1);
  /* A further report after Success does not report a second transition. */
  assert_int_equal(kvf__rooms_record_response(t, room, 0, 0, -1, NULL, 0, &became), 0);
  assert_int_equal(became, 0);
  kvf__rooms_table_free(t, NULL);
}

static void high_ranks_and_bounds(void **state) {
  rooms *t = new_table(0);
  int32_t c[ROOMS_MAX_CANDS + 1] = {0};
  assert_int_equal(kvf__rooms_create(t, 1, ROOM_BOOTSTRAPPED), 0);
  assert_int_equal(kvf__rooms_set_required(t, 1, 3), 0);
  assert_int_equal(kvf__rooms_set_required(t, 1, 0), KVF_EINVAL);
  assert_int_equal(kvf__rooms_set_required(t, 1, ROOMS_MAX_RANKS + 1), KVF_EINVAL);
  assert_int_equal(kvf__rooms_set_required(t, 2, 1), KVF_ENOTFOUND);
  assert_int_equal(kvf__rooms_record_response(t, 1, 0, -1, 5, NULL, 0, NULL), KVF_EINVAL);
  assert_int_equal(kvf__rooms_record_response(t, 1, 0, ROOMS_MAX_RANKS, 5, NULL, 0, NULL), KVF_EINVAL);
  assert_int_equal(kvf__rooms_record_response(t, 1, 0, 0, 5, c, ROOMS_MAX_CANDS + 1, NULL), KVF_ETOOBIG);
  assert_int_equal(kvf__rooms_record_response(t, 1, 0, 0, 5, NULL, 2, NULL), KVF_EINVAL);
  rooms_stats st;
  kvf__rooms_get_stats(t, &st);
  assert_int_equal(st.rejected_invalid, 4);
  rooms_info info;
  assert_int_equal(kvf__rooms_get_info(t, 1, &info), 0);
  assert_int_equal(info.responded, 0);
  /* Ranks on both sides of the inline word, and the top rank. */
  int became = 0;
  assert_int_equal(kvf__rooms_record_response(t, 1, 0, 63, -1, NULL, 0, &became), 0);
  assert_int_equal(kvf__rooms_record_response(t, 1, 0, 64, -1, c, ROOMS_MAX_CANDS, &became), 0);
  assert_int_equal(kvf__rooms_record_response(t, 1, 0, 64, -1, NULL, 0, &became), 0);
  assert_int_equal(became, 0);
  assert_int_equal(kvf__rooms_record_response(t, 1, 0, ROOMS_MAX_RANKS - 1, 9, NULL, 0, &became), 0);
  assert_int_equal(became, 1);
  int64_t tok;
  assert_int_equal(pop_token(t, 1, &tok), 0);
  assert_int_equal(tok, 9);
  kvf__rooms_table_free(t, NULL);
}

/* The prefill publishes a room's first token once (kvf_sender_set_metadata)
 * and reads it as often as it needs; the table owns the candidates. */
static void prefill_publishes_metadata_once(void **state) {
  rooms *t = new_table(0);
  int64_t tok = 7;
  int32_t got[ROOMS_MAX_CANDS];
  size_t n = 9;
  int32_t c[ROOMS_MAX_CANDS + 1] = {4, 5, 6};
  assert_int_equal(kvf__rooms_publish_metadata(t, 3, 11, c, 3), KVF_ENOTFOUND);
  assert_int_equal(kvf__rooms_get_metadata(t, 3, &tok, got, ROOMS_MAX_CANDS, &n), KVF_ENOTFOUND);
  assert_int_equal(kvf__rooms_create(t, 3, ROOM_BOOTSTRAPPED), 0);
  assert_int_equal(kvf__rooms_get_metadata(t, 3, &tok, got, ROOMS_MAX_CANDS, &n), KVF_EAGAIN);
  assert_int_equal(tok, 7);
  assert_int_equal(kvf__rooms_publish_metadata(t, 3, 11, c, ROOMS_MAX_CANDS + 1), KVF_ETOOBIG);
  assert_int_equal(kvf__rooms_publish_metadata(t, 3, 11, c, 3), 0); /* copied */
  c[2] = 99;
  int32_t d[1] = {1};
  assert_int_equal(kvf__rooms_publish_metadata(t, 3, 12, d, 1), KVF_EEXIST);
  for (int k = 0; k < 2; k++) {
    assert_int_equal(kvf__rooms_get_metadata(t, 3, &tok, got, ROOMS_MAX_CANDS, &n), 0);
    assert_int_equal(tok, 11);
    assert_int_equal(n, 3);
    assert_int_equal(got[2], 6);
  }
  assert_int_equal(kvf__rooms_get_metadata(t, 3, &tok, got, 2, &n), KVF_ETOOBIG);
  assert_int_equal(kvf__rooms_publish_metadata(t, 3, -1, NULL, 2), KVF_EINVAL);
  /* Gone with the room: a reused id starts unpublished. */
  assert_int_equal(kvf__rooms_clear(t, 3, NULL), 0);
  assert_int_equal(kvf__rooms_create(t, 3, ROOM_BOOTSTRAPPED), 0);
  assert_int_equal(kvf__rooms_get_metadata(t, 3, &tok, got, ROOMS_MAX_CANDS, &n), KVF_EAGAIN);
  assert_int_equal(kvf__rooms_publish_metadata(t, 3, -1, NULL, 0), 0);
  assert_int_equal(kvf__rooms_get_metadata(t, 3, &tok, got, ROOMS_MAX_CANDS, &n), 0);
  assert_int_equal(tok, -1);
  assert_int_equal(n, 0);
  kvf__rooms_table_free(t, NULL);
}

static void failed_room_ignores_success(void **state) {
  rooms *t = new_table(0);
  assert_int_equal(kvf__rooms_create(t, 4, ROOM_BOOTSTRAPPED), 0);
  assert_int_equal(kvf__rooms_fail(t, 4, "Losing connection"), 0);
  int became = -1;
  assert_int_equal(kvf__rooms_record_response(t, 4, 0, 0, 11, NULL, 0, &became), 0);
  assert_int_equal(became, 0);
  assert_int_equal(status_of(t, 4), ROOM_FAILED);
  /* Failed overrides Success; the first reason stays (a later one is a
   * consequence of the failure, e.g. the prefill's failed M3 for a room
   * the decode fenced). */
  assert_int_equal(kvf__rooms_create(t, 5, ROOM_BOOTSTRAPPED), 0);
  assert_int_equal(kvf__rooms_record_response(t, 5, 0, 0, 11, NULL, 0, &became), 0);
  assert_int_equal(became, 1);
  assert_int_equal(kvf__rooms_fail(t, 5, "one"), 0);
  assert_int_equal(kvf__rooms_fail(t, 5, "two"), 0);
  assert_int_equal(status_of(t, 5), ROOM_FAILED);
  char buf[16];
  assert_int_equal(kvf__rooms_get_reason(t, 5, buf, sizeof buf), 0);
  assert_string_equal(buf, "one");
  assert_int_equal(kvf__rooms_get_reason(t, 5, buf, 2), 0);
  assert_string_equal(buf, "o");
  assert_int_equal(kvf__rooms_get_reason(t, 5, buf, 0), KVF_EINVAL);
  /* Long reasons are truncated to the bound. */
  char big[2000];
  memset(big, 'r', sizeof big - 1);
  big[sizeof big - 1] = '\0';
  assert_int_equal(kvf__rooms_create(t, 6, ROOM_BOOTSTRAPPED), 0);
  assert_int_equal(kvf__rooms_fail(t, 6, big), 0);
  char out[2000];
  assert_int_equal(kvf__rooms_get_reason(t, 6, out, sizeof out), 0);
  assert_int_equal(strlen(out), ROOMS_REASON_MAX - 1);
  kvf__rooms_table_free(t, NULL);
}

static int is_tagged(int64_t room, void *user, void *arg) { return user == arg; }

static int nfreed;
static void free_user(void *u) { nfreed++; }

/* The heartbeat's node-failure pass: tagged rooms that are not Success
 * fail with the reason; others are left alone. */
static void fail_matching(void **state) {
  rooms *t = new_table(0);
  int tag_a, tag_b;
  for (int r = 0; r < 6; r++) {
    assert_int_equal(kvf__rooms_create(t, r, ROOM_BOOTSTRAPPED), 0);
    assert_int_equal(kvf__rooms_set_user(t, r, r < 4 ? (void *)&tag_a : (void *)&tag_b), 0);
  }
  assert_int_equal(kvf__rooms_update(t, 0, ROOM_SUCCESS, NULL), 0);
  size_t n = 0;
  assert_int_equal(
      kvf__rooms_fail_matching(t, is_tagged, &tag_a,
                               "Losing connection with prefill instance (bootstrap_addr: 10.0.0.1:8998)", &n),
      0);
  assert_int_equal(n, 3);
  assert_int_equal(status_of(t, 0), ROOM_SUCCESS);
  assert_int_equal(status_of(t, 1), ROOM_FAILED);
  assert_int_equal(status_of(t, 4), ROOM_BOOTSTRAPPED);
  char buf[128];
  assert_int_equal(kvf__rooms_get_reason(t, 3, buf, sizeof buf), 0);
  assert_string_equal(buf, "Losing connection with prefill instance (bootstrap_addr: 10.0.0.1:8998)");
  rooms_info info;
  assert_int_equal(kvf__rooms_get_info(t, 1, &info), 0);
  assert_int_equal(info.has_reason, 1);
  void *u = NULL;
  assert_int_equal(kvf__rooms_get_user(t, 4, &u), 0);
  assert_ptr_equal(u, &tag_b);
  int nf = 0;
  for (int r = 0; r < 6; r++) nf += status_of(t, r) == ROOM_FAILED;
  assert_int_equal(nf, 3);
  nfreed = 0;
  kvf__rooms_table_free(t, free_user);
  assert_int_equal(nfreed, 6);
}

/* The listener publishes the token before Success, so a poller on another
 * thread that sees Success always finds it. */
#define PUB_ROOMS 2000
typedef struct pub_ctx {
  rooms *t;
  atomic_int bad;
} pub_ctx;

static void *poller(void *arg) {
  pub_ctx *c = arg;
  for (int64_t r = 0; r < PUB_ROOMS; r++) {
    int s = -1;
    while (kvf__rooms_get_status(c->t, r, &s) != 0 || s != ROOM_SUCCESS) {
    }
    int64_t tok = -1;
    if (pop_token(c->t, r, &tok) != 0 || tok != 1000 + r) atomic_fetch_add(&c->bad, 1);
  }
  return NULL;
}

/* The same through the rooms' status cells, as kvf_receiver_poll reads
 * them: no lock until the token is popped. */
static void *cell_poller(void *arg) {
  pub_ctx *c = arg;
  for (int64_t r = 0; r < PUB_ROOMS; r++) {
    const atomic_int *cell = kvf__rooms_status_cell(c->t, r);
    if (!cell) {
      atomic_fetch_add(&c->bad, 1);
      continue;
    }
    while (atomic_load_explicit(cell, memory_order_acquire) != ROOM_SUCCESS) {
    }
    int64_t tok = -1;
    if (pop_token(c->t, r, &tok) != 0 || tok != 1000 + r) atomic_fetch_add(&c->bad, 1);
  }
  return NULL;
}

static void token_visible_when_success_seen_in(void *(*poll_fn)(void *)) {
  pub_ctx c = {.t = new_table(0)};
  atomic_init(&c.bad, 0);
  for (int64_t r = 0; r < PUB_ROOMS; r++) {
    assert_int_equal(kvf__rooms_create(c.t, r, ROOM_BOOTSTRAPPED), 0);
    assert_int_equal(kvf__rooms_set_required(c.t, r, 2), 0);
  }
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, poll_fn, &c), 0);
  for (int64_t r = 0; r < PUB_ROOMS; r++) {
    assert_int_equal(kvf__rooms_record_response(c.t, r, 0, 0, 1000 + r, NULL, 0, NULL), 0);
    assert_int_equal(kvf__rooms_record_response(c.t, r, 0, 1, 77, NULL, 0, NULL), 0);
  }
  pthread_join(th, NULL);
  assert_int_equal(atomic_load(&c.bad), 0);
  kvf__rooms_table_free(c.t, NULL);
}

static void token_visible_when_success_seen(void **state) {
  (void)state;
  token_visible_when_success_seen_in(poller);
}

static void token_visible_when_success_seen_in_the_cell(void **state) {
  (void)state;
  token_visible_when_success_seen_in(cell_poller);
}

/* A live room's status cell says what kvf__rooms_get_status says, through
 * every change, until the room is cleared; unknown and early rooms have
 * none. */
static void status_cell_follows_the_room(void **state) {
  (void)state;
  rooms *t = new_table(0);
  int user = 0;
  assert_null(kvf__rooms_status_cell(t, 7));
  assert_int_equal(kvf__rooms_add_early(t, 7, &user), 0);
  assert_null(kvf__rooms_status_cell(t, 7)); /* early: not live */
  assert_int_equal(kvf__rooms_create(t, 7, ROOM_BOOTSTRAPPING), 0);
  const atomic_int *cell = kvf__rooms_status_cell(t, 7);
  assert_non_null(cell);
  assert_int_equal(atomic_load(cell), ROOM_BOOTSTRAPPING);
  const int steps[] = {ROOM_BOOTSTRAPPED, ROOM_WAITING_FOR_INPUT, ROOM_TRANSFERRING};
  for (size_t i = 0; i < sizeof steps / sizeof steps[0]; i++) {
    assert_int_equal(kvf__rooms_update(t, 7, steps[i], NULL), 0);
    assert_int_equal(atomic_load(cell), steps[i]);
    assert_int_equal(atomic_load(cell), status_of(t, 7));
  }
  assert_int_equal(kvf__rooms_reset_responses(t, 7, ROOM_BOOTSTRAPPED), 0); /* a repeated init */
  assert_int_equal(atomic_load(cell), status_of(t, 7));
  assert_int_equal(kvf__rooms_fail(t, 7, "gone"), 0);
  assert_int_equal(atomic_load(cell), ROOM_FAILED);
  assert_int_equal(kvf__rooms_update(t, 7, ROOM_SUCCESS, NULL), 0); /* Failed stays */
  assert_int_equal(atomic_load(cell), ROOM_FAILED);

  assert_int_equal(kvf__rooms_create(t, 8, ROOM_BOOTSTRAPPED), 0);
  const atomic_int *cell8 = kvf__rooms_status_cell(t, 8);
  assert_non_null(cell8);
  assert_ptr_not_equal(cell8, cell);
  assert_int_equal(kvf__rooms_set_required(t, 8, 2), 0);
  assert_int_equal(kvf__rooms_record_response(t, 8, 0, 0, 5, NULL, 0, NULL), 0);
  assert_int_equal(atomic_load(cell8), ROOM_BOOTSTRAPPED); /* one of two */
  assert_int_equal(kvf__rooms_record_response(t, 8, 0, 1, 5, NULL, 0, NULL), 0);
  assert_int_equal(atomic_load(cell8), ROOM_SUCCESS);

  assert_int_equal(kvf__rooms_clear(t, 7, NULL), 0);
  assert_null(kvf__rooms_status_cell(t, 7));
  assert_int_equal(kvf__rooms_create(t, 7, ROOM_BOOTSTRAPPING), 0); /* anew, maybe in a recycled entry */
  cell = kvf__rooms_status_cell(t, 7);
  assert_non_null(cell);
  assert_int_equal(atomic_load(cell), ROOM_BOOTSTRAPPING);
  kvf__rooms_table_free(t, NULL);
}

/* Four threads hammer private and shared rooms at once; afterwards the
 * table is consistent and empties completely. */
#define NTHREADS 4
#define SHARED 16
typedef struct hammer_ctx {
  rooms *t;
  int id;
} hammer_ctx;

static void *hammer(void *arg) {
  hammer_ctx *h = arg;
  rooms *t = h->t;
  int32_t cands[4] = {1, 2, 3, 4};
  for (int i = 0; i < 3000; i++) {
    int64_t own = 1000000 + h->id * 100000 + i;
    int64_t shared = i % SHARED;
    int s;
    /* Private room: full life cycle. */
    if (kvf__rooms_create(t, own, ROOM_BOOTSTRAPPING) != 0) abort();
    kvf__rooms_set_required(t, own, 2);
    kvf__rooms_update(t, own, ROOM_BOOTSTRAPPED, NULL);
    kvf__rooms_record_response(t, own, 0, 0, i, cands, 4, NULL);
    kvf__rooms_record_response(t, own, 0, 1, -1, NULL, 0, NULL);
    if (kvf__rooms_get_status(t, own, &s) != 0 || s != ROOM_SUCCESS) abort();
    int64_t tok;
    int32_t got[ROOMS_MAX_CANDS];
    size_t n;
    if (kvf__rooms_pop_metadata(t, own, &tok, got, ROOMS_MAX_CANDS, &n) != 0 || tok != i || n != 4) abort();
    if (kvf__rooms_clear(t, own, NULL) != 0) abort();
    /* Shared rooms: racing creators, updaters, failers and clearers; any
     * result code is allowed, nothing may crash or race. */
    kvf__rooms_create(t, shared, ROOM_BOOTSTRAPPING);
    /* and early rooms the threads race to add, make live and clear */
    kvf__rooms_add_early(t, SHARED + shared, h);
    if (i % 3 == 0) kvf__rooms_create(t, SHARED + shared, ROOM_BOOTSTRAPPING);
    kvf__rooms_update(t, shared, (i + h->id) % (ROOM_STATUS_MAX + 1), NULL);
    kvf__rooms_record_response(t, shared, 0, h->id, i, cands, (size_t)(i % 5), NULL);
    if (i % 7 == 0) kvf__rooms_fail(t, shared, "shared failure");
    if (i % 11 == h->id) kvf__rooms_clear(t, shared, NULL);
    if (i % 5 == h->id) kvf__rooms_clear(t, SHARED + shared, NULL);
    kvf__rooms_get_status(t, shared, &s);
    char buf[32];
    kvf__rooms_get_reason(t, shared, buf, sizeof buf);
    pop_token(t, shared, &tok);
    if (i % 97 == 0) {
      rooms_stats st;
      kvf__rooms_get_stats(t, &st);
      live_count(t);
    }
  }
  return NULL;
}

static void concurrent_updates_and_clears(void **state) {
  rooms *t = new_table(0);
  pthread_t th[NTHREADS];
  hammer_ctx ctx[NTHREADS];
  for (int i = 0; i < NTHREADS; i++) {
    ctx[i] = (hammer_ctx){.t = t, .id = i};
    assert_int_equal(pthread_create(&th[i], NULL, hammer, &ctx[i]), 0);
  }
  for (int i = 0; i < NTHREADS; i++) pthread_join(th[i], NULL);
  assert_true(live_count(t) <= 2 * SHARED);
  for (int64_t r = 0; r < 2 * SHARED; r++) kvf__rooms_clear(t, r, NULL);
  assert_int_equal(live_count(t), 0);
  rooms_stats st;
  kvf__rooms_get_stats(t, &st);
  assert_int_equal(st.created, st.cleared);
  kvf__rooms_table_free(t, NULL);
}

static int match_none(int64_t room, void *user, void *arg) {
  (void)room, (void)user, (void)arg;
  return 0;
}
static int match_room3(int64_t room, void *user, void *arg) {
  (void)user, (void)arg;
  return room == 3;
}

/* Is the event fd readable now? */
static int readable(int fd) {
  struct pollfd p = {.fd = fd, .events = POLLIN};
  return poll(&p, 1, 0) == 1;
}

/* kvf_manager_event_fd's table side: a change of a room's state makes the
 * fd readable until cleared; what changes nothing (the same status again,
 * a response short of Success, a second failure) does not; notify does. */
static void change_events(void **state) {
  (void)state;
  rooms *t;
  assert_int_equal(kvf__rooms_table_new(0, &t), 0);
  assert_int_equal(kvf__rooms_create(t, 1, ROOM_BOOTSTRAPPING), 0); /* before the fd: costs nothing, no event */
  int fd = kvf__rooms_event_fd(t);
  assert_true(fd >= 0);
  assert_int_equal(kvf__rooms_event_fd(t), fd); /* one per table */
  assert_false(readable(fd));
  assert_int_equal(kvf__rooms_update(t, 1, ROOM_BOOTSTRAPPING, NULL), 0);
  assert_false(readable(fd));
  assert_int_equal(kvf__rooms_update(t, 1, ROOM_WAITING_FOR_INPUT, NULL), 0);
  assert_true(readable(fd));
  assert_int_equal(kvf__rooms_update(t, 1, ROOM_TRANSFERRING, NULL), 0); /* coalesced: still one event */
  kvf__rooms_event_clear(t);
  assert_false(readable(fd));
  kvf__rooms_event_clear(t); /* nothing pending: harmless */
  assert_false(readable(fd));
  /* Success by the last of two responses, not by the first. */
  assert_int_equal(kvf__rooms_set_required(t, 1, 2), 0);
  assert_int_equal(kvf__rooms_record_response(t, 1, 0, 0, 5, NULL, 0, NULL), 0);
  assert_false(readable(fd));
  int became = 0;
  assert_int_equal(kvf__rooms_record_response(t, 1, 0, 1, 5, NULL, 0, &became), 0);
  assert_true(became);
  assert_true(readable(fd));
  kvf__rooms_event_clear(t);
  /* A failure, once; a second one changes nothing. */
  assert_int_equal(kvf__rooms_create(t, 2, ROOM_WAITING_FOR_INPUT), 0);
  assert_false(readable(fd));
  assert_int_equal(kvf__rooms_fail(t, 2, "first"), 0);
  assert_true(readable(fd));
  kvf__rooms_event_clear(t);
  assert_int_equal(kvf__rooms_fail(t, 2, "second"), 0);
  assert_false(readable(fd));
  int failed = 1;
  assert_int_equal(kvf__rooms_fail_unless_success(t, 1, "late", &failed), 0); /* Success stands */
  assert_false(failed);
  assert_false(readable(fd));
  kvf__rooms_notify(t);
  assert_true(readable(fd));
  kvf__rooms_event_clear(t);
  /* Rooms failed together (a prefill found dead): an event; none when
   * nothing matched. */
  assert_int_equal(kvf__rooms_create(t, 3, ROOM_TRANSFERRING), 0);
  size_t nf = 9;
  assert_int_equal(kvf__rooms_fail_matching(t, match_none, NULL, "dead", &nf), 0);
  assert_int_equal(nf, 0);
  assert_false(readable(fd));
  assert_int_equal(kvf__rooms_fail_matching(t, match_room3, NULL, "dead", &nf), 0);
  assert_int_equal(nf, 1);
  assert_true(readable(fd));
  kvf__rooms_table_free(t, NULL);
}

/* The event fd's promise with changes from another thread (the status
 * listener, a transfer thread): a scheduler that clears, polls its rooms
 * and then sleeps on the fd is always woken by a change it has not seen.
 * The changer signals after letting the table's lock go, so its signal and
 * the poller's clear race here, at random offsets. A missed wake-up leaves
 * the poller asleep for its whole bound while a room it waits for is
 * Success, and the test fails. */
enum { EVENT_RACE_ROOMS = 20000 };
#define EVENT_RACE_SLEEP_MS 3000 /* a wake-up missed, not a slow machine: the changer ends in milliseconds */

typedef struct event_race {
  rooms *t;
  atomic_int done; /* the changer made every change */
} event_race;

static void *event_race_changer(void *arg) {
  event_race *x = arg;
  uint64_t rng = 0x9e3779b97f4a7c15ULL;
  for (int i = 0; i < EVENT_RACE_ROOMS; i++) {
    if (i % 2) kvf__rooms_update(x->t, i, ROOM_SUCCESS, NULL);
    else kvf__rooms_record_response(x->t, i, 0, 0, -1, NULL, 0, NULL);
    rng = rng * 6364136223846793005ULL + 1442695040888963407ULL;
    unsigned spin = (unsigned)(rng >> 56); /* 0..255: the next change lands anywhere in the poller's turn */
    for (volatile unsigned k = 0; k < spin * 8; k++) {
    }
    if (spin < 32) sched_yield();
  }
  atomic_store(&x->done, 1);
  return NULL;
}

static void no_change_is_missed_by_a_sleeping_poller(void **state) {
  (void)state;
  event_race x = {.t = new_table(EVENT_RACE_ROOMS + 1)};
  for (int i = 0; i < EVENT_RACE_ROOMS; i++) assert_int_equal(kvf__rooms_create(x.t, i, ROOM_TRANSFERRING), 0);
  int fd = kvf__rooms_event_fd(x.t);
  assert_true(fd >= 0);
  pthread_t th;
  assert_int_equal(pthread_create(&th, NULL, event_race_changer, &x), 0);
  int next = 0, sleeps = 0, missed = 0;
  for (int stalls = 0; stalls < 20;) { /* a changer starved that long is a broken machine */
    kvf__rooms_event_clear(x.t);
    while (next < EVENT_RACE_ROOMS && status_of(x.t, next) == ROOM_SUCCESS) next++;
    if (next == EVENT_RACE_ROOMS) break;
    struct pollfd p = {.fd = fd, .events = POLLIN};
    sleeps++;
    if (poll(&p, 1, EVENT_RACE_SLEEP_MS) == 0) { /* asleep the whole bound */
      /* Missed only if the change it waits for was made; a changer that
       * did not run (a loaded machine) is waited for again. */
      if ((missed = status_of(x.t, next) == ROOM_SUCCESS || atomic_load(&x.done))) break;
      stalls++;
    }
  }
  pthread_join(th, NULL);
  assert_int_equal(missed, 0);
  assert_int_equal(next, EVENT_RACE_ROOMS);
  assert_true(sleeps > 0);
  kvf__rooms_table_free(x.t, NULL);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(update_rule_table),
      cmocka_unit_test(early_rooms_are_not_live),
      cmocka_unit_test(reuse_after_clear),
      cmocka_unit_test(many_rooms_created_and_cleared),
      cmocka_unit_test(live_room_bound),
      cmocka_unit_test(unknown_room_messages_dropped),
      cmocka_unit_test(answers_act_on_the_use_they_were_checked_against),
      cmocka_unit_test(first_token_wins_two_responders),
      cmocka_unit_test(high_ranks_and_bounds),
      cmocka_unit_test(prefill_publishes_metadata_once),
      cmocka_unit_test(failed_room_ignores_success),
      cmocka_unit_test(fail_matching),
      cmocka_unit_test(token_visible_when_success_seen),
      cmocka_unit_test(token_visible_when_success_seen_in_the_cell),
      cmocka_unit_test(status_cell_follows_the_room),
      cmocka_unit_test(concurrent_updates_and_clears),
      cmocka_unit_test(change_events),
      cmocka_unit_test(no_change_is_missed_by_a_sleeping_poller),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

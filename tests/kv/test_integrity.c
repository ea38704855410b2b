/* Verify mode and room fencing (src/kv/integrity.c) on a real decode
 * manager: the digests a prefill sends are checked against the bytes that
 * landed, a mismatch fails the room with a reason that names the buffer and
 * page, digests from the wrong peer or for another epoch change nothing, and
 * closing a room's fence refuses its late writes. The prefill helpers
 * (page digests, a layer's buffers) are checked against the buffers. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include "base/hash.h"
#include "kv/integrity.h"
#include "kv/manager.h"
#include "kv/rooms.h"
#include "kvferry.h"

#define ITEM 256 /* bytes of one page */
#define PAGES 16 /* pages per buffer */
#define SITEM 64 /* bytes of one state slot */
#define SSLOTS 8 /* slots of the state buffer */
#define PEER "127.0.0.1"

typedef struct fixture {
  unsigned char *kv[2];
  unsigned char *state;
  kvf_manager *m;
} fixture;

static int setup(void **state) {
  fixture *f = calloc(1, sizeof *f);
  for (int i = 0; i < 2; i++) {
    f->kv[i] = malloc(ITEM * PAGES);
    for (size_t j = 0; j < ITEM * PAGES; j++) f->kv[i][j] = (unsigned char)(j * 7 + i);
  }
  f->state = malloc(SITEM * SSLOTS);
  for (size_t j = 0; j < SITEM * SSLOTS; j++) f->state[j] = (unsigned char)(j * 3);
  void *ptrs[2] = {f->kv[0], f->kv[1]}, *sptrs[1] = {f->state};
  uint64_t lens[2] = {ITEM * PAGES, ITEM * PAGES}, items[2] = {ITEM, ITEM};
  uint64_t slens[1] = {SITEM * SSLOTS}, sitems[1] = {SITEM};
  kvf_kv_buffers b = {.n_kv = 2,
                      .kv_ptrs = ptrs,
                      .kv_lens = lens,
                      .kv_item_lens = items,
                      .n_state = 1,
                      .state_ptrs = sptrs,
                      .state_lens = slens,
                      .state_item_lens = sitems};
  kvf_manager_config c;
  kvf_manager_config_init(&c);
  c.role = KVF_ROLE_DECODE;
  c.verify = 1;
  c.heartbeat_interval_s = 60;
  kvf_engine_config ec;
  kvf_engine_config_init(&ec);
  ec.transport = "tcp"; /* the target can refuse a fenced write itself */
  c.engine_cfg = &ec;
  assert_int_equal(kvf_manager_create(&c, &b, &f->m), 0);
  *state = f;
  return 0;
}

static int teardown(void **state) {
  fixture *f = *state;
  kvf_manager_destroy(f->m);
  for (int i = 0; i < 2; i++) free(f->kv[i]);
  free(f->state);
  free(f);
  return 0;
}

/* As the decode's check answers for a planned rank: yes, and the room's
 * current use (0 when it is not live). */
static int planned(kvf_manager *m, int64_t room, const char *peer, uint64_t *use) {
  (void)peer;
  *use = 0;
  kvf__rooms_get_use(m->rooms, room, use);
  return 1;
}

static int not_planned(kvf_manager *m, int64_t room, const char *peer, uint64_t *use) {
  (void)m, (void)room, (void)peer;
  *use = 0;
  return 0;
}

/* A live room with verify asked, as kvf_receiver_init leaves it. */
static uint64_t open_room(fixture *f, int64_t room) {
  uint64_t flags = 0, epoch = 0;
  assert_int_equal(kvf__rooms_create(f->m->rooms, room, ROOM_TRANSFERRING), 0);
  kvf__integ_room_open(f->m, room, 1, &flags, &epoch);
  assert_int_equal(flags, WIRE_ROOM_VERIFY);
  assert_true(epoch != 0); /* a kvferry prefill over the TCP engine: fenced */
  return epoch;
}

static void close_room(fixture *f, int64_t room, uint64_t epoch) {
  kvf__integ_room_close(f->m, room, epoch, 0, 1);
  kvf__rooms_clear(f->m->rooms, room, NULL);
}

static wire_digest page_digest(const unsigned char *buf, size_t page) {
  uint64_t dst = (uint64_t)(uintptr_t)(buf + page * ITEM);
  return (wire_digest){dst, ITEM, 1, 0, kvf__hash_block(dst, ITEM, 1, 0)};
}

/* Hand the listener a digests message from rank 0, as it arrives. */
static void deliver(fixture *f, int64_t room, uint64_t epoch, const wire_digest *d, size_t n,
                    int (*from)(kvf_manager *, int64_t, const char *, uint64_t *)) {
  wire_digests dg = {.room = room, .prefill_rank = 0, .epoch = epoch, .entries = wire_array_of(d, n)};
  wire_msg msg;
  char why[WIRE_REASON_LEN] = "";
  assert_int_equal(kvf__wire_digests_encode(&dg, &msg, why), 0);
  assert_true(kvf__wire_is_digests(msg.frames, msg.nframes));
  kvf__integ_on_digests(f->m, msg.frames, msg.nframes, PEER, from);
  kvf__wire_msg_free(&msg);
}

static int room_status(fixture *f, int64_t room) {
  int st = -1;
  assert_int_equal(kvf__rooms_get_status(f->m->rooms, room, &st), 0);
  return st;
}

static void room_reason(fixture *f, int64_t room, char *buf, size_t cap) {
  assert_int_equal(kvf__rooms_get_reason(f->m->rooms, room, buf, cap), 0);
}

/* Digests that match the landed bytes (whole pages and a strided block)
 * leave the room as it was and count the message. */
static void matching_digests_keep_the_room(void **state) {
  fixture *f = *state;
  uint64_t epoch = open_room(f, 11);
  wire_digest d[3] = {page_digest(f->kv[0], 0), page_digest(f->kv[1], PAGES - 1)};
  uint64_t base = (uint64_t)(uintptr_t)(f->kv[1] + ITEM); /* 32 bytes of each of pages 1..4 */
  d[2] = (wire_digest){base, 32, 4, ITEM, kvf__hash_block(base, 32, 4, ITEM)};
  kvf_manager_stats before, after;
  kvf_manager_get_stats(f->m, &before);
  deliver(f, 11, epoch, d, 3, planned);
  kvf_manager_get_stats(f->m, &after);
  assert_int_equal(room_status(f, 11), ROOM_TRANSFERRING);
  assert_int_equal(after.messages_received, before.messages_received + 1);
  assert_int_equal(after.verify_failures, before.verify_failures);
  close_room(f, 11, epoch);
}

/* A page that differs from what the prefill hashed fails the room, and the
 * reason names the buffer and the page (the first bad entry). */
static void corrupted_page_named_in_the_reason(void **state) {
  fixture *f = *state;
  uint64_t epoch = open_room(f, 12);
  wire_digest d[3] = {page_digest(f->kv[0], 2), page_digest(f->kv[1], 5), page_digest(f->kv[1], 9)};
  f->kv[1][5 * ITEM + 17] ^= 0x01; /* one bit of page 5 of buffer 1 landed wrong */
  f->kv[1][9 * ITEM] ^= 0x80;      /* and page 9: only the first is named */
  kvf_manager_stats before, after;
  kvf_manager_get_stats(f->m, &before);
  deliver(f, 12, epoch, d, 3, planned);
  kvf_manager_get_stats(f->m, &after);
  assert_int_equal(room_status(f, 12), ROOM_FAILED);
  char reason[ROOMS_REASON_MAX];
  room_reason(f, 12, reason, sizeof reason);
  printf("reason: %s\n", reason);
  assert_non_null(strstr(reason, "Integrity check failed: KV buffer 1 page 5 (offset 0, 256 bytes"));
  assert_non_null(strstr(reason, "prefill rank 0"));
  assert_int_equal(after.verify_failures, before.verify_failures + 1);
  f->kv[1][5 * ITEM + 17] ^= 0x01;
  f->kv[1][9 * ITEM] ^= 0x80;
  close_room(f, 12, epoch);
}

/* The same for a state buffer's slot, at an offset inside its item. */
static void corrupted_state_slot_named(void **state) {
  fixture *f = *state;
  uint64_t epoch = open_room(f, 13);
  uint64_t dst = (uint64_t)(uintptr_t)(f->state + 3 * SITEM + 8);
  wire_digest d = {dst, 16, 1, 0, kvf__hash_block(dst, 16, 1, 0) ^ 1};
  deliver(f, 13, epoch, &d, 1, planned);
  assert_int_equal(room_status(f, 13), ROOM_FAILED);
  char reason[ROOMS_REASON_MAX];
  room_reason(f, 13, reason, sizeof reason);
  assert_non_null(strstr(reason, "state buffer 0 page 3 (offset 8, 16 bytes"));
  close_room(f, 13, epoch);
}

/* A digest for memory outside every buffer (past the end, or a strided
 * block whose span overflows) fails the room rather than reading there. */
static void digest_outside_the_buffers_fails_the_room(void **state) {
  fixture *f = *state;
  const struct {
    int64_t room;
    wire_digest d;
  } cases[] = {
      {14, {(uint64_t)(uintptr_t)(f->kv[0] + ITEM * PAGES - 8), 16, 1, 0, 0}},
      {15, {(uint64_t)(uintptr_t)f->kv[0], 8, 3, UINT64_MAX / 2, 0}},
      {16, {(uint64_t)(uintptr_t)f->kv[1] + ITEM, 8, 2, ITEM * PAGES, 0}},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    uint64_t epoch = open_room(f, cases[i].room);
    deliver(f, cases[i].room, epoch, &cases[i].d, 1, planned);
    assert_int_equal(room_status(f, cases[i].room), ROOM_FAILED);
    char reason[ROOMS_REASON_MAX];
    room_reason(f, cases[i].room, reason, sizeof reason);
    assert_non_null(strstr(reason, "outside this decode's buffers"));
    close_room(f, cases[i].room, epoch);
  }
}

/* Wrong digests from a peer the room was not planned with are dropped and
 * counted as forged; for another epoch (an earlier use of the room id) as
 * an unknown room; a malformed message as malformed. None fails the room. */
static void wrong_sender_or_epoch_changes_nothing(void **state) {
  fixture *f = *state;
  uint64_t epoch = open_room(f, 17);
  wire_digest bad = page_digest(f->kv[0], 1);
  bad.hash ^= 1;
  kvf_manager_stats before, after;
  kvf_manager_get_stats(f->m, &before);
  deliver(f, 17, epoch, &bad, 1, not_planned);
  deliver(f, 17, epoch + 1000, &bad, 1, planned);
  wire_frame junk[2] = {{(const uint8_t *)"kvferry-digests", 15}, {(const uint8_t *)"x", 1}};
  kvf__integ_on_digests(f->m, junk, 2, PEER, planned);
  kvf_manager_get_stats(f->m, &after);
  assert_int_equal(room_status(f, 17), ROOM_TRANSFERRING);
  assert_int_equal(after.messages_forged, before.messages_forged + 1);
  assert_int_equal(after.messages_unknown_room, before.messages_unknown_room + 1);
  assert_int_equal(after.messages_malformed, before.messages_malformed + 1);
  assert_int_equal(after.verify_failures, before.verify_failures);
  close_room(f, 17, epoch);
}

/* A failed room's fence close refuses a late tagged write into its pages
 * (no byte lands) and counts rooms_fenced; before the close it lands. */
static void closed_fence_refuses_late_writes(void **state) {
  fixture *f = *state;
  int64_t room = 18;
  uint64_t epoch = open_room(f, room);
  kvf_engine_config ec;
  kvf_engine_config_init(&ec);
  ec.transport = "tcp";
  kvf_engine *w = NULL;
  assert_int_equal(kvf_engine_create(&ec, &w), 0);
  static unsigned char src[ITEM];
  memset(src, 0xC3, sizeof src);
  assert_int_equal(kvf_engine_register(w, src, sizeof src), 0);
  kvf_batch_opts o;
  kvf_batch_opts_init(&o);
  o.tag = manager_room_tag(room);
  o.epoch = epoch;
  kvf_write wr = {.src = (uint64_t)(uintptr_t)src, .dst = (uint64_t)(uintptr_t)(f->kv[0] + 4 * ITEM), .len = ITEM};
  assert_int_equal(kvf_engine_write_ex(w, kvf_manager_session_id(f->m), &wr, 1, &o), 0);
  kvf_engine_sync(kvf_manager_engine(f->m));
  assert_memory_equal(f->kv[0] + 4 * ITEM, src, ITEM);

  kvf_manager_stats before, after;
  kvf_manager_get_stats(f->m, &before);
  assert_int_equal(kvf__rooms_fail(f->m->rooms, room, "test: failed"), 0);
  kvf__integ_room_close(f->m, room, epoch, 1, 1);
  kvf_manager_get_stats(f->m, &after);
  assert_int_equal(after.rooms_fenced, before.rooms_fenced + 1);
  memset(src, 0x3C, sizeof src);
  wr.dst += ITEM; /* page 5 */
  unsigned char page5[ITEM];
  memcpy(page5, f->kv[0] + 5 * ITEM, ITEM);
  assert_int_equal(kvf_engine_write_ex(w, kvf_manager_session_id(f->m), &wr, 1, &o), KVF_ESTATE);
  kvf_engine_sync(kvf_manager_engine(f->m));
  assert_memory_equal(f->kv[0] + 5 * ITEM, page5, ITEM);
  assert_int_equal(kvf_engine_unregister(w, src), 0);
  kvf_engine_destroy(w);
  kvf__rooms_clear(f->m->rooms, room, NULL);
  /* the write that landed put 0xC3 into page 4: restore the fixture's bytes */
  for (size_t j = 4 * ITEM; j < 5 * ITEM; j++) f->kv[0][j] = (unsigned char)(j * 7);
}

/* The landing thread's path (kvf__integ_on_landed, the engine's landed
 * callback): pages hashed as they land. A byte that landed wrong is caught
 * and named as when the page is read back; a landed digest that does not
 * match sends the page to the full check, which passes a page that is right
 * after all; the landed digest stands for the page only in the digests of
 * its own epoch (a page kept from an earlier room is read back). The test
 * runs the callback itself, as a landing thread would: no engine traffic. */
static void pages_hashed_as_they_land_still_catch_corruption(void **state) {
  fixture *f = *state;
  kvf_manager_stats before, after;
  char reason[ROOMS_REASON_MAX];
  assert_true(kvf__integ_hashes_landing(f->m));
  /* A corrupted landing: caught, the page named. */
  uint64_t e1 = open_room(f, 31);
  wire_digest d3 = page_digest(f->kv[0], 3);
  f->kv[0][3 * ITEM + 40] ^= 0x10;                                                     /* landed wrong */
  kvf__integ_on_landed(f->m, manager_room_tag(31), e1, f->kv[0] + 2 * ITEM, 2 * ITEM); /* pages 2 and 3 */
  kvf_manager_get_stats(f->m, &before);
  deliver(f, 31, e1, &d3, 1, planned);
  kvf_manager_get_stats(f->m, &after);
  assert_int_equal(room_status(f, 31), ROOM_FAILED);
  room_reason(f, 31, reason, sizeof reason);
  assert_non_null(strstr(reason, "Integrity check failed: KV buffer 0 page 3 (offset 0, 256 bytes"));
  assert_int_equal(after.verify_failures, before.verify_failures + 1);
  f->kv[0][3 * ITEM + 40] ^= 0x10;
  close_room(f, 31, e1);

  /* A landed digest that differs while the page is right: the full check
   * decides, and the room stands. Then a clean landing, a later change to
   * the page (by no writer of this room) is not what the check looks at. */
  uint64_t e2 = open_room(f, 32);
  wire_digest d5 = page_digest(f->kv[1], 5), d6 = page_digest(f->kv[1], 6);
  f->kv[1][5 * ITEM] ^= 0x01;
  kvf__integ_on_landed(f->m, manager_room_tag(32), e2, f->kv[1] + 5 * ITEM, ITEM);
  f->kv[1][5 * ITEM] ^= 0x01;
  kvf__integ_on_landed(f->m, manager_room_tag(32), e2, f->kv[1] + 6 * ITEM, ITEM);
  f->kv[1][6 * ITEM + 1] ^= 0x02;
  wire_digest d56[2] = {d5, d6};
  deliver(f, 32, e2, d56, 2, planned);
  assert_int_equal(room_status(f, 32), ROOM_TRANSFERRING); /* page 6 passed on its landed digest */
  close_room(f, 32, e2);

  /* The next room's digests for page 6 do not take that landing's digest:
   * the page is read back, and it differs. */
  uint64_t e3 = open_room(f, 33);
  assert_true(e3 != e2);
  deliver(f, 33, e3, &d6, 1, planned);
  assert_int_equal(room_status(f, 33), ROOM_FAILED);
  room_reason(f, 33, reason, sizeof reason);
  assert_non_null(strstr(reason, "KV buffer 1 page 6"));
  f->kv[1][6 * ITEM + 1] ^= 0x02;
  close_room(f, 33, e3);
}

/* Prefill helpers: a page's digest is the hash of exactly that page, pages
 * outside the buffer are refused; the MHA layout's one layer holds both
 * buffers. */
static void prefill_page_digest_and_layer_bufs(void **state) {
  fixture *f = *state;
  uint64_t h = 0;
  for (size_t b = 0; b < 2; b++) {
    assert_int_equal(kvf__integ_page_digest(f->m, b, 0, &h), 0);
    assert_int_equal(h, kvf__hash64(f->kv[b], ITEM));
    assert_int_equal(kvf__integ_page_digest(f->m, b, PAGES - 1, &h), 0);
    assert_int_equal(h, kvf__hash64(f->kv[b] + (PAGES - 1) * ITEM, ITEM));
  }
  uint64_t kept = 12345;
  h = kept;
  assert_int_equal(kvf__integ_page_digest(f->m, 0, PAGES, &h), KVF_ERANGE);
  assert_int_equal(kvf__integ_page_digest(f->m, 0, -1, &h), KVF_ERANGE);
  assert_int_equal(kvf__integ_page_digest(f->m, 0, INT64_MAX, &h), KVF_ERANGE);
  assert_int_equal(h, kept); /* not written on failure */
  size_t *bufs = NULL, nb = 0;
  assert_int_equal(kvf__integ_layer_bufs(f->m, 0, 1, &bufs, &nb), 0);
  assert_int_equal(nb, 2);
  assert_int_equal(bufs[0], 0);
  assert_int_equal(bufs[1], 1);
  free(bufs);
  assert_int_equal(kvf__integ_layer_bufs(f->m, 1, 1, &bufs, &nb), 0);
  assert_int_equal(nb, 0);
  free(bufs);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test_setup_teardown(matching_digests_keep_the_room, setup, teardown),
      cmocka_unit_test_setup_teardown(corrupted_page_named_in_the_reason, setup, teardown),
      cmocka_unit_test_setup_teardown(corrupted_state_slot_named, setup, teardown),
      cmocka_unit_test_setup_teardown(digest_outside_the_buffers_fails_the_room, setup, teardown),
      cmocka_unit_test_setup_teardown(wrong_sender_or_epoch_changes_nothing, setup, teardown),
      cmocka_unit_test_setup_teardown(closed_fence_refuses_late_writes, setup, teardown),
      cmocka_unit_test_setup_teardown(prefill_page_digest_and_layer_bufs, setup, teardown),
      cmocka_unit_test_setup_teardown(pages_hashed_as_they_land_still_catch_corruption, setup, teardown),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

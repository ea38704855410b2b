/* Room traces (issue 25) end to end: a bootstrap server, a prefill manager
 * and a decode manager in this process, talking over real sockets on
 * 127.0.0.1 (libzmq, HTTP, the TCP engine). For rooms that succeed (one
 * direct chunk, and several chunks through the transfer workers), fail
 * (the prefill aborts) and time out (no prefill ever sends), each side's
 * record must hold the steps that exist on its path, in causal order, and
 * add up: every step lies between the test's own clock readings taken
 * before the room began and after both sides were done (one host, one
 * CLOCK_MONOTONIC: exact, no tolerance needed), the steps' durations sum to
 * first-to-final exactly, and the cross-side checks below (valid only
 * because both sides share this host's clock) hold. Also: the
 * KVFERRY_TRACE lines equal the ring's records, the ring keeps only the
 * last N rooms, and trace_rooms 0 / kvf_manager_trace_enable(0) record
 * nothing. Every wait is bounded. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <cmocka.h>

#include "tools/kvpool.h"
#include "kvferry.h"

#define LAYERS 2
#define ITEM 4096
#define PAGES 256

static int64_t now_ns(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (int64_t)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

typedef struct rig {
  kvf_bootstrap_server *srv;
  char baddr[64];
  kvpool ppool, dpool;
  kvf_manager *pm, *dm;
} rig;

/* trace_rooms of each side (0 off); waiting_s: the decode's waiting
 * timeout; both engines on `transport`. */
static void rig_start_on(rig *g, size_t p_trace, size_t d_trace, double waiting_s, const char *transport) {
  memset(g, 0, sizeof *g);
  kvf_bootstrap_server_config bc;
  kvf_bootstrap_server_config_init(&bc);
  bc.host = "127.0.0.1";
  bc.port = 0;
  bc.auth_token = "";
  assert_int_equal(kvf_bootstrap_server_create(&bc, &g->srv), 0);
  snprintf(g->baddr, sizeof g->baddr, "127.0.0.1:%u", (unsigned)kvf_bootstrap_server_port(g->srv));
  assert_int_equal(kvpool_init(&g->ppool, LAYERS, PAGES, ITEM), 0);
  assert_int_equal(kvpool_init(&g->dpool, LAYERS, PAGES, ITEM), 0);
  kvf_engine_config ec;
  kvf_engine_config_init(&ec);
  ec.transport = transport; /* what each side can observe depends on it: see docs/TRACE.md */
  ec.auth_token = "";
  kvf_manager_config c;
  kvf_manager_config_init(&c);
  assert_int_equal(c.trace_rooms, 1024); /* on by default */
  c.engine_cfg = &ec;
  c.role = KVF_ROLE_PREFILL;
  c.bootstrap_addr = g->baddr;
  c.trace_rooms = p_trace;
  assert_int_equal(kvf_manager_create(&c, &g->ppool.bufs, &g->pm), 0);
  kvf_manager_config_init(&c);
  c.engine_cfg = &ec;
  c.role = KVF_ROLE_DECODE;
  c.trace_rooms = d_trace;
  c.waiting_timeout_s = waiting_s;
  assert_int_equal(kvf_manager_create(&c, &g->dpool.bufs, &g->dm), 0);
}

/* The TCP engine, whose landings each side observes. */
static void rig_start(rig *g, size_t p_trace, size_t d_trace, double waiting_s) {
  rig_start_on(g, p_trace, d_trace, waiting_s, "tcp");
}

/* Both sides append their records to a new file made from the mkstemp
 * template `path` (KVFERRY_TRACE); the prefill's ring keeps 1024, the
 * decode's d_trace. */
static void rig_start_to_file(rig *g, char *path, size_t d_trace, const char *transport) {
  int fd = mkstemp(path);
  assert_true(fd >= 0);
  close(fd);
  setenv("KVFERRY_TRACE", path, 1);
  rig_start_on(g, 1024, d_trace, 30, transport);
  unsetenv("KVFERRY_TRACE");
}

static void rig_stop(rig *g) {
  kvf_manager_destroy(g->dm);
  kvf_manager_destroy(g->pm);
  kvf_bootstrap_server_destroy(g->srv);
  kvpool_free(&g->dpool);
  kvpool_free(&g->ppool);
}

typedef enum { RUN_OK, RUN_ABORT, RUN_NO_SENDER } run_kind;

/* One room through both sides: `chunks` send calls of `per` pages each.
 * *t0 / *t1: this thread's clock before the room began and after both
 * sides were destroyed. Returns the decode's final status. */
static int run_room(rig *g, int64_t room, int chunks, size_t per, run_kind kind, int64_t *t0, int64_t *t1) {
  size_t npages = (size_t)chunks * per;
  int64_t dpages[PAGES], spages[PAGES];
  for (size_t i = 0; i < npages; i++) dpages[i] = (int64_t)(i * 2), spages[i] = (int64_t)(i * 3 % PAGES);
  *t0 = now_ns();
  kvf_receiver *rx = NULL;
  kvf_sender *tx = NULL;
  assert_int_equal(kvf_receiver_create(g->dm, g->baddr, room, &rx), 0);
  assert_int_equal(kvf_receiver_init(rx, dpages, npages, 0, 0, NULL, 0), 0);
  if (kind != RUN_NO_SENDER) assert_int_equal(kvf_sender_create(g->pm, room, &tx), 0);
  if (kind == RUN_ABORT) {
    /* Abort once the M2 is in, so the decode is told. */
    size_t nreal = 0, nd = 0;
    int64_t pre = 0;
    for (int64_t until = now_ns() + 10000000000LL; nreal == 0 && now_ns() < until; usleep(1000))
      assert_int_equal(kvf_sender_dest_info(tx, &nreal, &nd, &pre), 0);
    assert_int_equal(nreal, 1);
    kvf_sender_abort(tx, "aborted by the test");
  } else if (kind == RUN_OK) {
    for (int k = 0; k < chunks; k++) {
      kvf_send_params p;
      kvf_send_params_init(&p);
      p.pages = spages + (size_t)k * per;
      p.npages = per;
      if (k == chunks - 1) p.flags = KVF_SEND_LAST, p.bootstrap_token = 7;
      assert_int_equal(kvf_sender_send(tx, &p), 0);
    }
  }
  int ds = -1, ps = tx ? -1 : KVF_POLL_FAILED;
  for (int64_t until = now_ns() + 20000000000LL; (ds < 0 || ps < 0) && now_ns() < until; usleep(200)) {
    int s = kvf_receiver_poll(rx);
    if (ds < 0 && (s == KVF_POLL_SUCCESS || s == KVF_POLL_FAILED)) ds = s;
    if (tx && ps < 0) {
      s = kvf_sender_poll(tx);
      if (s == KVF_POLL_SUCCESS || s == KVF_POLL_FAILED) ps = s;
    }
  }
  assert_true(ds >= 0 && ps >= 0);
  kvf_receiver_destroy(rx);
  kvf_sender_destroy(tx);
  *t1 = now_ns();
  return ds;
}

/* The finished record of `room` on m (a worker may release the prefill's
 * last reference just after the sender's destroy: wait for it, briefly). */
static void get_finished(kvf_manager *m, int64_t room, kvf_room_trace *t) {
  for (int i = 0; i < 2000; i++) {
    if (!kvf_manager_trace_get(m, room, t) && t->finished) return;
    usleep(1000);
  }
  fail_msg("room %lld: no finished trace", (long long)room);
}

#define T(tr, s) ((tr)->t_ns[KVF_TRACE_##s])
/* a happened no later than b, both reached */
#define BEFORE(tr, a, b)                                                                       \
  do {                                                                                         \
    if (!T(tr, a) || !T(tr, b) || T(tr, a) > T(tr, b))                                         \
      fail_msg("room %lld: %s (%lld) should come before %s (%lld)", (long long)(tr)->room, #a, \
               (long long)T(tr, a), #b, (long long)T(tr, b));                                  \
  } while (0)

/* Every reached step inside [t0, t1]; sorted steps' durations add up to
 * first-to-last exactly; the steps of the other side are 0. */
static void check_common(const kvf_room_trace *t, int side, int64_t t0, int64_t t1) {
  assert_int_equal(t->side, side);
  assert_int_equal(t->finished, 1);
  int64_t first = INT64_MAX, last = 0, sum = 0, prev = 0;
  int64_t v[KVF_TRACE_NSTEPS];
  int n = 0;
  for (int s = 0; s < KVF_TRACE_NSTEPS; s++) {
    if (!t->t_ns[s]) continue;
    int dec = s <= KVF_TRACE_COMPLETION_SEEN, pf = s >= KVF_TRACE_M2_RECEIVED && s < KVF_TRACE_FINAL;
    if ((side == KVF_ROLE_DECODE && pf) || (side == KVF_ROLE_PREFILL && dec))
      fail_msg("room %lld: step %s on the wrong side", (long long)t->room, kvf_trace_step_name(s));
    if (t->t_ns[s] < t0 || t->t_ns[s] > t1)
      fail_msg("room %lld: step %s outside the test's bracket", (long long)t->room, kvf_trace_step_name(s));
    if (t->t_ns[s] < first) first = t->t_ns[s];
    if (t->t_ns[s] > last) last = t->t_ns[s];
    int k = n++;
    while (k > 0 && v[k - 1] > t->t_ns[s]) v[k] = v[k - 1], k--;
    v[k] = t->t_ns[s];
  }
  for (int k = 0; k < n; k++) sum += k ? v[k] - prev : 0, prev = v[k];
  assert_int_equal(sum, last - first);
  assert_true(last - first <= t1 - t0);
  assert_true(T(t, FINAL) > 0);                                     /* both sides polled to the end */
  if (side == KVF_ROLE_DECODE) assert_int_equal(T(t, FINAL), last); /* nothing after the final poll */
}

static void check_success_pair(rig *g, int64_t room, int chunks, size_t per, int m1, int64_t t0, int64_t t1) {
  kvf_room_trace d, p;
  get_finished(g->dm, room, &d);
  get_finished(g->pm, room, &p);
  /* The bracket closes once both records are finished: the prefill's last
   * steps (a worker's completion_sent) may follow the sender's Success,
   * hence its destroy. */
  t1 = now_ns();
  check_common(&d, KVF_ROLE_DECODE, t0, t1);
  check_common(&p, KVF_ROLE_PREFILL, t0, t1);
  assert_int_equal(d.status, KVF_POLL_SUCCESS);
  assert_int_equal(p.status, KVF_POLL_SUCCESS);
  assert_string_equal(d.reason, "");
  /* decode: its path in order; M1 only when this room registered (a cache miss) */
  BEFORE(&d, CREATED, DISCOVERY_DONE);
  if (m1) {
    BEFORE(&d, DISCOVERY_DONE, M1_SENT);
    BEFORE(&d, M1_SENT, M2_SENT);
  } else {
    assert_int_equal(T(&d, M1_SENT), 0);
  }
  BEFORE(&d, DISCOVERY_DONE, M2_SENT);
  BEFORE(&d, M2_SENT, FIRST_BYTE);
  BEFORE(&d, FIRST_BYTE, LAST_BYTE);
  BEFORE(&d, LAST_BYTE, COMPLETION_SEEN);
  BEFORE(&d, COMPLETION_SEEN, FINAL);
  uint64_t bytes = (uint64_t)chunks * per * 2 * LAYERS * ITEM;
  assert_int_equal(d.bytes, bytes); /* landed here, as the TCP engine saw it */
  assert_int_equal(d.descs, (uint64_t)chunks * per);
  assert_true(d.chunks >= 1);
  assert_int_equal(d.npeers, 1);
  assert_string_equal(d.peers[0].transport, "tcp");
  assert_string_equal(d.peers[0].mode, "tcp");
  assert_string_equal(d.engine, kvf_manager_session_id(g->dm));
  /* prefill: the sender's steps after its creation, the bytes after both
   * the chunk and the M2 */
  BEFORE(&p, SENDER_CREATED, FIRST_CHUNK_SUBMITTED);
  BEFORE(&p, FIRST_CHUNK_SUBMITTED, LAST_CHUNK_SUBMITTED);
  BEFORE(&p, FIRST_CHUNK_SUBMITTED, FIRST_BYTE_SENT);
  BEFORE(&p, M2_RECEIVED, FIRST_BYTE_SENT);
  BEFORE(&p, FIRST_BYTE_SENT, LAST_BYTE_DONE);
  BEFORE(&p, LAST_BYTE_DONE, COMPLETION_SENT);
  BEFORE(&p, LAST_BYTE_DONE, FINAL);
  assert_int_equal(p.bytes, bytes);
  assert_int_equal(p.chunks, (uint64_t)chunks);
  assert_true(p.descs >= 1);
  assert_int_equal(p.npeers, 1);
  assert_string_equal(p.peers[0].peer, kvf_manager_session_id(g->dm));
  assert_string_equal(p.peers[0].transport, "tcp");
  /* across the sides (one host, one clock): each effect after its cause */
  assert_true(T(&d, M2_SENT) <= T(&p, M2_RECEIVED));
  assert_true(T(&p, FIRST_BYTE_SENT) <= T(&d, FIRST_BYTE));
  assert_true(T(&d, LAST_BYTE) <= T(&p, LAST_BYTE_DONE));
}

static void success_rooms_have_every_step_in_order(void **state) {
  (void)state;
  rig g;
  rig_start(&g, 1024, 1024, 30);
  int64_t t0, t1;
  /* the first room registers (M1) and goes direct; the second uses the
   * cache and the transfer workers (several chunks) */
  assert_int_equal(run_room(&g, 100, 1, 4, RUN_OK, &t0, &t1), KVF_POLL_SUCCESS);
  check_success_pair(&g, 100, 1, 4, 1, t0, t1);
  assert_int_equal(run_room(&g, 101, 3, 8, RUN_OK, &t0, &t1), KVF_POLL_SUCCESS);
  check_success_pair(&g, 101, 3, 8, 0, t0, t1);
  /* the histograms saw them: two successful rooms on each side */
  static char text[32768];
  kvf_manager_metrics(g.dm, text, sizeof text);
  assert_non_null(strstr(text, "kvferry_room_m2_to_success_seconds_count{role=\"decode\""));
  char want[200];
  snprintf(want, sizeof want, "kvferry_room_bytes_count{role=\"decode\",session=\"%s\"} 2\n",
           kvf_manager_session_id(g.dm));
  assert_non_null(strstr(text, want));
  kvf_manager_metrics(g.pm, text, sizeof text);
  snprintf(want, sizeof want, "kvferry_room_queue_wait_seconds_count{role=\"prefill\",session=\"%s\"} 2\n",
           kvf_manager_session_id(g.pm));
  assert_non_null(strstr(text, want));
  rig_stop(&g);
}

/* The first room to a decode is submitted before the UCX engine's
 * connector has chosen the route to it; the prefill's record still names
 * the route the room took (filled as the record leaves the ring), in the
 * getters and in the KVFERRY_TRACE file alike. */
static void prefill_record_names_the_route_of_a_peers_first_room(void **state) {
  (void)state;
#ifndef KVF_HAVE_UCX
  skip();
#else
  char path[] = "/tmp/kvf-test-trace-route-XXXXXX";
  rig g;
  rig_start_to_file(&g, path, 1024, "ucx");
  int64_t t0, t1;
  assert_int_equal(run_room(&g, 300, 1, 4, RUN_OK, &t0, &t1), KVF_POLL_SUCCESS); /* direct */
  assert_int_equal(run_room(&g, 301, 3, 8, RUN_OK, &t0, &t1), KVF_POLL_SUCCESS); /* the workers */
  char mode[sizeof((kvf_trace_peer *)0)->mode] = ""; /* as the decode saw the rooms land */
  for (int64_t room = 300; room <= 301; room++) {
    kvf_room_trace p, d, all[4];
    get_finished(g.pm, room, &p);
    get_finished(g.dm, room, &d);
    assert_int_equal(p.npeers, 1);
    assert_string_equal(p.peers[0].transport, "ucx");
    assert_true(!strcmp(p.peers[0].mode, "read") || !strcmp(p.peers[0].mode, "write"));
    assert_string_equal(p.peers[0].mode, d.peers[0].mode); /* as the decode saw it land */
    size_t n = kvf_manager_trace_copy(g.pm, all, 4);
    int seen = 0;
    for (size_t i = 0; i < n; i++)
      if (all[i].room == room) assert_string_equal(all[i].peers[0].transport, "ucx"), seen = 1;
    assert_true(seen);
    snprintf(mode, sizeof mode, "%s", d.peers[0].mode);
  }
  rig_stop(&g); /* the file's writer has appended every record */
  FILE *f = fopen(path, "r");
  assert_non_null(f);
  static char line[65536];
  int prefill_lines = 0;
  while (fgets(line, sizeof line, f)) {
    kvf_room_trace t;
    assert_int_equal(kvf_trace_parse_json(line, &t), 0);
    if (t.side != KVF_ROLE_PREFILL) continue;
    prefill_lines++;
    assert_int_equal(t.npeers, 1);
    assert_string_equal(t.peers[0].transport, "ucx");
    assert_string_equal(t.peers[0].mode, mode);
  }
  fclose(f);
  unlink(path);
  assert_int_equal(prefill_lines, 2);
#endif
}

static void failed_room_records_the_reason_on_both_sides(void **state) {
  (void)state;
  rig g;
  rig_start(&g, 1024, 1024, 30);
  int64_t t0, t1;
  assert_int_equal(run_room(&g, 200, 1, 4, RUN_ABORT, &t0, &t1), KVF_POLL_FAILED);
  kvf_room_trace d, p;
  get_finished(g.dm, 200, &d);
  get_finished(g.pm, 200, &p);
  t1 = now_ns(); /* as in check_success_pair */
  check_common(&d, KVF_ROLE_DECODE, t0, t1);
  check_common(&p, KVF_ROLE_PREFILL, t0, t1);
  assert_int_equal(d.status, KVF_POLL_FAILED);
  assert_int_equal(p.status, KVF_POLL_FAILED);
  assert_non_null(strstr(p.reason, "aborted by the test"));
  assert_true(d.reason[0] != '\0');
  BEFORE(&d, M2_SENT, COMPLETION_SEEN); /* the prefill's M3 Failed */
  BEFORE(&d, COMPLETION_SEEN, FINAL);
  assert_int_equal(T(&d, FIRST_BYTE), 0); /* nothing was sent: never invented */
  assert_int_equal(T(&p, FIRST_BYTE_SENT), 0);
  assert_int_equal(T(&p, FIRST_CHUNK_SUBMITTED), 0);
  BEFORE(&p, M2_RECEIVED, FINAL);
  BEFORE(&p, SENDER_CREATED, FINAL);
  assert_true(T(&d, M2_SENT) <= T(&p, M2_RECEIVED));
  rig_stop(&g);
}

static void timed_out_room_ends_at_its_deadline(void **state) {
  (void)state;
  rig g;
  rig_start(&g, 1024, 1024, 1); /* waiting timeout 1 s */
  int64_t t0, t1;
  assert_int_equal(run_room(&g, 300, 1, 4, RUN_NO_SENDER, &t0, &t1), KVF_POLL_FAILED);
  kvf_room_trace d;
  get_finished(g.dm, 300, &d);
  check_common(&d, KVF_ROLE_DECODE, t0, t1);
  assert_int_equal(d.status, KVF_POLL_FAILED);
  assert_non_null(strstr(d.reason, "timed out"));
  BEFORE(&d, CREATED, M2_SENT);
  BEFORE(&d, M2_SENT, FINAL);
  assert_int_equal(T(&d, COMPLETION_SEEN), 0);
  assert_int_equal(T(&d, FIRST_BYTE), 0);
  int64_t waited = T(&d, FINAL) - T(&d, M2_SENT);
  assert_true(waited >= 1000000000LL);               /* not before the deadline */
  assert_true(waited < 1000000000LL + 5000000000LL); /* nor long after (loaded machine slack) */
  /* no sender ever existed: the prefill records nothing for the room */
  kvf_room_trace p;
  assert_int_equal(kvf_manager_trace_get(g.pm, 300, &p), KVF_ENOTFOUND);
  rig_stop(&g);
}

static void ring_keeps_the_last_n_and_the_file_matches(void **state) {
  (void)state;
  char path[] = "/tmp/kvf-trace-XXXXXX";
  rig g;
  rig_start_to_file(&g, path, 4, "tcp"); /* the decode keeps 4 */
  int64_t t0, t1;
  for (int i = 0; i < 7; i++) assert_int_equal(run_room(&g, 400 + i, 1, 2, RUN_OK, &t0, &t1), KVF_POLL_SUCCESS);
  kvf_room_trace ring[8], two[2];
  assert_int_equal(kvf_manager_trace_copy(g.dm, ring, 8), 4);
  for (int i = 0; i < 4; i++) assert_int_equal(ring[i].room, 403 + i); /* oldest first */
  assert_int_equal(kvf_manager_trace_copy(g.dm, two, 2), 2);
  assert_int_equal(two[0].room, 405);
  kvf_room_trace t;
  assert_int_equal(kvf_manager_trace_get(g.dm, 400, &t), KVF_ENOTFOUND); /* dropped from the ring */
  get_finished(g.pm, 406, &t);
  rig_stop(&g);
  /* one line per finished room per side, each equal to the ring's record
   * (decode: its last 4 are still in the ring) */
  FILE *f = fopen(path, "r");
  assert_non_null(f);
  char line[4096];
  int nd = 0, np = 0;
  while (fgets(line, sizeof line, f)) {
    kvf_room_trace x;
    assert_int_equal(kvf_trace_parse_json(line, &x), 0);
    assert_non_null(strstr(line, "\"v\":1,"));
    assert_non_null(strstr(line, "{\"name\":")); /* steps, the first at 0 */
    assert_non_null(strstr(line, "\"t_ns\":0}"));
    if (x.side == KVF_ROLE_DECODE) {
      nd++;
      if (x.room >= 403) { /* still in the ring: the same record, steps as offsets from the first */
        const kvf_room_trace *r = &ring[x.room - 403];
        int64_t first = INT64_MAX;
        for (int k = 0; k < KVF_TRACE_NSTEPS; k++)
          if (r->t_ns[k] && r->t_ns[k] < first) first = r->t_ns[k];
        for (int k = 0; k < KVF_TRACE_NSTEPS; k++)
          assert_int_equal(x.t_ns[k], r->t_ns[k] ? r->t_ns[k] - first + 1 : 0);
        assert_int_equal(x.bytes, r->bytes);
        assert_int_equal(x.t0_unix_ns, r->t0_unix_ns);
        assert_string_equal(x.engine, r->engine);
      }
      assert_int_equal(x.status, KVF_POLL_SUCCESS);
      assert_true(x.t_ns[KVF_TRACE_CREATED] == 1); /* the first step: offset 0 (+1: reached) */
      assert_true(x.t_ns[KVF_TRACE_FINAL] > 1);
    } else {
      np++;
      assert_true(x.t_ns[KVF_TRACE_LAST_BYTE_DONE] > 0);
    }
    assert_int_equal(x.bytes, 2ull * 2 * LAYERS * ITEM);
  }
  fclose(f);
  unlink(path);
  assert_int_equal(nd, 7);
  assert_int_equal(np, 7);
}

static void json_line_round_trips(void **state) {
  (void)state;
  kvf_room_trace t, back;
  memset(&t, 0, sizeof t);
  t.room = 42, t.side = KVF_ROLE_PREFILL, t.rank = 3, t.status = KVF_POLL_FAILED, t.finished = 1;
  t.t_ns[KVF_TRACE_M2_RECEIVED] = 1000, t.t_ns[KVF_TRACE_SENDER_CREATED] = 900, t.t_ns[KVF_TRACE_FINAL] = 5000;
  t.bytes = 10, t.descs = 2, t.chunks = 1, t.retries = 1, t.npeers = 1, t.t0_unix_ns = 1700000000000000000LL;
  snprintf(t.engine, sizeof t.engine, "10.0.0.1:5000");
  snprintf(t.reason, sizeof t.reason, "a \"quoted\"\\ reason\n");
  snprintf(t.peers[0].peer, sizeof t.peers[0].peer, "10.0.0.2:6000");
  snprintf(t.peers[0].transport, sizeof t.peers[0].transport, "tcp");
  snprintf(t.peers[0].mode, sizeof t.peers[0].mode, "tcp");
  char line[2048];
  size_t n = kvf_trace_format_json(&t, line, sizeof line);
  assert_true(n > 0 && line[n - 1] == '\n' && strlen(line) == n);
  /* steps in time order, offsets from the first */
  assert_non_null(strstr(line, "\"steps\":[{\"name\":\"sender_created\",\"t_ns\":0},{\"name\":\"m2_received\","
                               "\"t_ns\":100},{\"name\":\"final\",\"t_ns\":4100}]"));
  assert_non_null(strstr(line, "\"side\":\"prefill\",\"room\":42,\"engine\":\"10.0.0.1:5000\",\"rank\":3,"
                               "\"status\":\"Failed\""));
  assert_int_equal(kvf_trace_parse_json(line, &back), 0);
  assert_int_equal(back.room, 42);
  assert_int_equal(back.side, KVF_ROLE_PREFILL);
  assert_int_equal(back.status, KVF_POLL_FAILED);
  assert_string_equal(back.reason, t.reason);
  assert_int_equal(back.t_ns[KVF_TRACE_FINAL] - back.t_ns[KVF_TRACE_SENDER_CREATED], 4100);
  assert_string_equal(back.peers[0].peer, "10.0.0.2:6000");
  assert_int_equal(back.retries, 1);
  assert_int_equal(kvf_trace_format_json(&t, line, 40), 0); /* does not fit: nothing */
  assert_int_equal(kvf_trace_parse_json("{\"v\":2}", &back), KVF_EINVAL);
  t.reason[0] = '\0';
  kvf_trace_format_json(&t, line, sizeof line);
  assert_non_null(strstr(line, "\"reason\":null"));
  assert_string_equal(kvf_trace_step_name(KVF_TRACE_M2_SENT), "m2_sent");
  assert_null(kvf_trace_step_name(KVF_TRACE_NSTEPS));
}

static void off_records_nothing(void **state) {
  (void)state;
  rig g;
  rig_start(&g, 0, 1024, 30); /* the prefill off from the start */
  int64_t t0, t1;
  kvf_room_trace t;
  assert_int_equal(kvf_manager_trace_enable(g.pm, 1), KVF_ESTATE);
  assert_int_equal(kvf_manager_trace_enable(g.dm, 0), 0); /* the decode off from now on */
  assert_int_equal(run_room(&g, 500, 1, 2, RUN_OK, &t0, &t1), KVF_POLL_SUCCESS);
  assert_int_equal(kvf_manager_trace_get(g.pm, 500, &t), KVF_ENOTFOUND);
  assert_int_equal(kvf_manager_trace_get(g.dm, 500, &t), KVF_ENOTFOUND);
  assert_int_equal(kvf_manager_trace_copy(g.pm, &t, 1), 0);
  assert_int_equal(kvf_manager_trace_copy(g.dm, &t, 1), 0);
  static char text[32768];
  kvf_manager_metrics(g.pm, text, sizeof text);
  assert_null(strstr(text, "kvferry_room_"));
  assert_int_equal(kvf_manager_trace_enable(g.dm, 1), 0); /* and on again */
  assert_int_equal(run_room(&g, 501, 1, 2, RUN_OK, &t0, &t1), KVF_POLL_SUCCESS);
  get_finished(g.dm, 501, &t);
  rig_stop(&g);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(success_rooms_have_every_step_in_order),
      cmocka_unit_test(prefill_record_names_the_route_of_a_peers_first_room),
      cmocka_unit_test(failed_room_records_the_reason_on_both_sides),
      cmocka_unit_test(timed_out_room_ends_at_its_deadline),
      cmocka_unit_test(ring_keeps_the_last_n_and_the_file_matches),
      cmocka_unit_test(json_line_round_trips),
      cmocka_unit_test(off_records_nothing),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

/* The prefill manager against a fake decode made of real parts on
 * 127.0.0.1: a transfer engine with registered buffers, a ZMQ PULL socket
 * for M3 and a PUSH socket into the prefill's control port carrying M1/M2
 * encoded with the wire codecs. Covers single and multi-chunk transfers
 * (bytes compared), a chunk that waits for its M2, the bootstrap timeout,
 * malformed and unregistered messages, an engine-refused write, PUT /route
 * to a real bootstrap server, many senders created and destroyed, and
 * layerwise sends (two MHA layers, per-layer bytes and one M3), and the
 * first token published after the KV landed (KVF_SEND_TOKEN_LATER), and
 * layerwise sends whose state buffers go with their layer group, and a
 * write refused by the decode's room fence, which fails that room only;
 * the last two in verify mode too (pages hashed at send, digests asked by
 * the decode and checked here against the landed bytes), and a fan-out room
 * (two decode ranks) whose last chunk goes out before an earlier chunk still
 * in flight fails (one M3 Failed to each rank, no byte after its fence
 * closes). Every wait is bounded in time. */
#include <inttypes.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <cmocka.h>

#include <poll.h>
#include <pthread.h>
#include <sys/socket.h>
#include <unistd.h>
#include <time.h>
#include <zmq.h>

#include "base/clock.h"
#include "base/hash.h"
#include "bootstrap/bootstrap.h"
#include "engine/async.h"
#include "kv/manager.h"
#include "kv/prefill/prefill_int.h" /* PF_MAX_PENDING */
#include "kvferry/bootstrap.h"
#include "kvferry/kv.h"
#include "sockets.h"
#include "wire/messages.h"

#define NKV_MAX 4 /* up to two MHA layers: K0 K1 V0 V1 */
#define NKV g_nkv /* KV buffers of this test: 2 (one layer) unless a test sets 4 */
#define NPAGES 32
#define ITEM 64
#define NSTATE_MAX 2 /* state buffers: one per layer of a 2-layer hybrid model */
#define STATE_SLOTS 4
#define STATE_ITEM 48

typedef struct fixture {
  uint8_t *pbuf[NKV_MAX]; /* prefill buffers */
  kvf_manager *m;
  /* fake decode */
  kvf_engine *eng;
  uint8_t *dbuf[NKV_MAX];
  uint8_t *pstate[NSTATE_MAX], *dstate[NSTATE_MAX]; /* g_nstate state buffers on each side */
  void *zctx, *pull, *push;
  uint16_t pull_port;
  char session[64];
  /* digest messages received (verify mode): entries that match the bytes
   * landed here, entries that do not */
  size_t digests_ok, digests_bad;
} fixture;

static int g_page_size = 1;     /* the prefill manager's tokens per page */
static int g_nkv = 2;           /* KV buffers (MHA: 2 per layer) */
static int g_nstate = 0;        /* state buffers; state buffer j belongs to KV layer j */
static int g_verify = 0;        /* the prefill runs in verify mode (hashes pages at send) */
static uint64_t g_room_flags;   /* the M2s' WIRE_ROOM_* flags (WIRE_ROOM_VERIFY: digests asked) */
static uint64_t g_fence_epoch;  /* the next M2's fence epoch (0: unfenced) */
static int64_t g_required = 1;  /* the M2s' required_dst_info_num (decode ranks per room) */
static const char *g_transport; /* both engines' transport; NULL: the default */
static double g_waiting_s;      /* the prefill's waiting_timeout_s; 0: the default */

static void sleep_ms(int ms) {
  struct timespec ts = {ms / 1000, (ms % 1000) * 1000000L};
  nanosleep(&ts, NULL);
}

static void fx_manager(fixture *f, const char *bootstrap_addr) {
  uint64_t lens[NKV_MAX], items[NKV_MAX];
  void *ptrs[NKV_MAX];
  for (int b = 0; b < NKV; b++) {
    f->pbuf[b] = malloc(NPAGES * ITEM);
    assert_non_null(f->pbuf[b]);
    for (size_t i = 0; i < NPAGES * ITEM; i++) f->pbuf[b][i] = (uint8_t)(b * 101 + i * 7 + i / ITEM);
    ptrs[b] = f->pbuf[b];
    lens[b] = NPAGES * ITEM;
    items[b] = ITEM;
  }
  kvf_kv_buffers bufs = {.n_kv = (size_t)NKV, .kv_ptrs = ptrs, .kv_lens = lens, .kv_item_lens = items};
  void *sptrs[NSTATE_MAX];
  uint64_t slens[NSTATE_MAX], sitems[NSTATE_MAX];
  static const uint32_t slayers[NSTATE_MAX] = {0, 1};
  for (int j = 0; j < g_nstate; j++) {
    f->pstate[j] = malloc(STATE_SLOTS * STATE_ITEM);
    assert_non_null(f->pstate[j]);
    for (size_t i = 0; i < STATE_SLOTS * STATE_ITEM; i++) f->pstate[j][i] = (uint8_t)(j * 37 + i * 3 + 1);
    sptrs[j] = f->pstate[j];
    slens[j] = STATE_SLOTS * STATE_ITEM;
    sitems[j] = STATE_ITEM;
  }
  bufs.n_state = (size_t)g_nstate;
  bufs.state_ptrs = sptrs, bufs.state_lens = slens, bufs.state_item_lens = sitems;
  kvf_manager_config cfg;
  kvf_manager_config_init(&cfg);
  if (g_nstate) assert_int_equal(kvf_manager_config_set_ptr(&cfg, "state_layer_ids", (void *)slayers), 0);
  cfg.role = KVF_ROLE_PREFILL;
  cfg.bootstrap_addr = bootstrap_addr;
  cfg.queue_size = 2;
  cfg.page_size = g_page_size;
  cfg.verify = g_verify;
  if (g_waiting_s > 0) cfg.waiting_timeout_s = g_waiting_s;
  kvf_engine_config ec;
  kvf_engine_config_init(&ec);
  ec.timeout_ms = 5000;
  ec.transport = g_transport;
  cfg.engine_cfg = &ec;
  assert_int_equal(kvf_manager_create(&cfg, &bufs, &f->m), 0);
}

/* A decode rank's own parts: its engine with registered buffers and its
 * PULL socket for M3 (in f->zctx). */
static void fx_rank_open(fixture *f) {
  kvf_engine_config ec;
  kvf_engine_config_init(&ec);
  ec.timeout_ms = 5000;
  ec.transport = g_transport;
  assert_int_equal(kvf_engine_create(&ec, &f->eng), 0);
  snprintf(f->session, sizeof f->session, "%s", kvf_engine_session_id(f->eng));
  for (int b = 0; b < NKV; b++) {
    f->dbuf[b] = calloc(NPAGES, ITEM);
    assert_non_null(f->dbuf[b]);
    assert_int_equal(kvf_engine_register(f->eng, f->dbuf[b], NPAGES * ITEM), 0);
  }
  for (int j = 0; j < g_nstate; j++) {
    f->dstate[j] = calloc(STATE_SLOTS, STATE_ITEM);
    assert_non_null(f->dstate[j]);
    assert_int_equal(kvf_engine_register(f->eng, f->dstate[j], STATE_SLOTS * STATE_ITEM), 0);
  }
  kvf_engine_sync(f->eng);
  f->pull = zmq_socket(f->zctx, ZMQ_PULL);
  int linger = 0;
  zmq_setsockopt(f->pull, ZMQ_LINGER, &linger, sizeof linger);
  assert_int_equal(zmq_bind(f->pull, "tcp://127.0.0.1:*"), 0);
  char ep[128];
  size_t len = sizeof ep;
  assert_int_equal(zmq_getsockopt(f->pull, ZMQ_LAST_ENDPOINT, ep, &len), 0);
  f->pull_port = (uint16_t)atoi(strrchr(ep, ':') + 1);
}

static void fx_rank_close(fixture *f) {
  zmq_close(f->pull);
  kvf_engine_destroy(f->eng);
  for (int b = 0; b < NKV; b++) free(f->dbuf[b]);
  for (int j = 0; j < g_nstate; j++) free(f->dstate[j]);
}

static void fx_decode(fixture *f) {
  f->zctx = zmq_ctx_new();
  fx_rank_open(f);
  f->push = zmq_socket(f->zctx, ZMQ_PUSH);
  int linger = 0;
  zmq_setsockopt(f->push, ZMQ_LINGER, &linger, sizeof linger);
  char ep[128];
  snprintf(ep, sizeof ep, "tcp://127.0.0.1:%u", (unsigned)f->m->rank_port);
  assert_int_equal(zmq_connect(f->push, ep), 0);
}

/* A second rank of the fake decode (a decode TP rank that receives the same
 * KV, as with MLA): its own engine session, buffers and M3 socket, since the
 * prefill keys a room's destinations by session and sends each its own M3.
 * Shares f's prefill manager and buffers and its PUSH socket; closed with
 * fx_rank_close after the manager is destroyed and before fx_teardown(f). */
static void fx_second_rank(fixture *g, const fixture *f) {
  memset(g, 0, sizeof *g);
  g->m = f->m;
  memcpy(g->pbuf, f->pbuf, sizeof g->pbuf);
  g->zctx = f->zctx;
  g->push = f->push;
  fx_rank_open(g);
}

static void fx_setup(fixture *f, const char *bootstrap_addr) {
  memset(f, 0, sizeof *f);
  fx_manager(f, bootstrap_addr);
  fx_decode(f);
}

static void fx_teardown(fixture *f) {
  kvf_manager_destroy(f->m);
  zmq_close(f->push);
  fx_rank_close(f);
  zmq_ctx_term(f->zctx);
  for (int b = 0; b < NKV; b++) free(f->pbuf[b]);
  for (int j = 0; j < g_nstate; j++) free(f->pstate[j]);
}

static void send_frames(fixture *f, const wire_frame *fr, size_t n) {
  for (size_t i = 0; i < n; i++)
    assert_true(zmq_send(f->push, fr[i].data, fr[i].len, i + 1 < n ? ZMQ_SNDMORE : 0) >= 0);
}

static void send_msg(fixture *f, const wire_msg *msg) { send_frames(f, msg->frames, msg->nframes); }

static uint64_t stat_received(fixture *f) {
  kvf_manager_stats st;
  kvf_manager_get_stats(f->m, &st);
  return st.messages_received;
}
static uint64_t stat_malformed(fixture *f) {
  kvf_manager_stats st;
  kvf_manager_get_stats(f->m, &st);
  return st.messages_malformed;
}

/* Wait (bounded) until the listener has counted `want` accepted messages. */
static void wait_received(fixture *f, uint64_t want) {
  int64_t end = clock_now_ns() + 5000000000LL;
  while (stat_received(f) < want && clock_now_ns() < end) sleep_ms(2);
  assert_true(stat_received(f) >= want);
}
static void wait_malformed(fixture *f, uint64_t want) {
  int64_t end = clock_now_ns() + 5000000000LL;
  while (stat_malformed(f) < want && clock_now_ns() < end) sleep_ms(2);
  assert_true(stat_malformed(f) >= want);
}

/* The decode host M1 and M2 name (frame 1, `endpoint`). */
static const char *g_endpoint = "127.0.0.1";

/* An M1 for `session` (the fixture's own, or another decode process's)
 * naming the fixture's host and PULL port, with its first `nkv` KV
 * buffers. */
static void send_m1_as(fixture *f, const char *session, int nkv) {
  uint64_t ptrs[NKV_MAX];
  for (int b = 0; b < NKV; b++) ptrs[b] = (uint64_t)(uintptr_t)f->dbuf[b];
  wire_m1 m1;
  memset(&m1, 0, sizeof m1);
  snprintf(m1.endpoint, sizeof m1.endpoint, "%s", g_endpoint);
  m1.dst_port = f->pull_port;
  snprintf(m1.session, sizeof m1.session, "%s", session);
  m1.kv_ptrs = wire_array_of(ptrs, (size_t)nkv);
  uint64_t sptrs[NSTATE_MAX];
  for (int j = 0; j < g_nstate; j++) sptrs[j] = (uint64_t)(uintptr_t)f->dstate[j];
  m1.state_ptrs = wire_array_of(sptrs, (size_t)g_nstate);
  wire_msg msg;
  char why[WIRE_REASON_LEN];
  assert_int_equal(kvf__wire_m1_encode(&m1, &msg, why), 0);
  send_msg(f, &msg);
  kvf__wire_msg_free(&msg);
}

static void send_m1(fixture *f) { send_m1_as(f, f->session, NKV); }

/* Over the TCP engine (g_transport, which the test resets), the fake
 * decode registered (its M1 received). */
static void fx_setup_tcp_registered(fixture *f) {
  g_transport = "tcp";
  fx_setup(f, "");
  send_m1(f);
  wait_received(f, 1);
}

static void send_m2_full(fixture *f, int64_t room, const int64_t *dst, size_t n, int64_t prefix,
                         const int64_t *mamba, size_t nmamba) {
  wire_m2 m2;
  memset(&m2, 0, sizeof m2);
  m2.room = room;
  snprintf(m2.endpoint, sizeof m2.endpoint, "%s", g_endpoint);
  m2.dst_port = f->pull_port;
  snprintf(m2.session, sizeof m2.session, "%s", f->session);
  m2.required_dst_info_num = g_required;
  m2.kv_indices = wire_array_of(dst, n);
  m2.dst_aux_index = 0;
  m2.decode_prefix_len = prefix;
  m2.mamba_indices = wire_array_of(mamba, nmamba);
  m2.room_flags = g_room_flags;
  m2.fence_epoch = g_fence_epoch;
  wire_msg msg;
  char why[WIRE_REASON_LEN];
  assert_int_equal(kvf__wire_m2_encode(&m2, &msg, why), 0);
  send_msg(f, &msg);
  kvf__wire_msg_free(&msg);
}

/* A dummy M2 (§3.4: this decode rank takes nothing from this prefill
 * rank). */
static void send_m2_dummy(fixture *f, int64_t room) {
  wire_m2 m2;
  memset(&m2, 0, sizeof m2);
  m2.room = room;
  snprintf(m2.endpoint, sizeof m2.endpoint, "%s", g_endpoint);
  m2.dst_port = f->pull_port;
  snprintf(m2.session, sizeof m2.session, "%s", f->session);
  m2.required_dst_info_num = g_required;
  m2.is_dummy = 1;
  wire_msg msg;
  char why[WIRE_REASON_LEN];
  assert_int_equal(kvf__wire_m2_encode(&m2, &msg, why), 0);
  send_msg(f, &msg);
  kvf__wire_msg_free(&msg);
}

static void send_m2_prefix(fixture *f, int64_t room, const int64_t *dst, size_t n, int64_t prefix) {
  send_m2_full(f, room, dst, n, prefix, NULL, 0);
}

static void send_m2(fixture *f, int64_t room, const int64_t *dst, size_t n) { send_m2_prefix(f, room, dst, n, 0); }

/* The usual start of a test: the decode registers (M1) and asks for `room`
 * (M2), and the prefill has both before the test goes on. */
static void register_and_request(fixture *f, int64_t room, const int64_t *dst, size_t n) {
  send_m1(f);
  send_m2(f, room, dst, n);
  wait_received(f, 2);
}

/* The tests' shorthand for kvf_sender_send: one whole-page chunk / one
 * layerwise chunk from positional values; token TOKEN_LATER stands for
 * the KVF_SEND_TOKEN_LATER flag. */
#define TOKEN_LATER (-2)
static int send_params(kvf_sender *s, kvf_send_params *p, int is_last, int64_t aux, int64_t token,
                       const int32_t *cands, size_t ncand, const int64_t *states, size_t nstate) {
  p->flags |= is_last ? KVF_SEND_LAST : 0;
  if (token == TOKEN_LATER) p->flags |= KVF_SEND_TOKEN_LATER;
  else p->bootstrap_token = token;
  p->aux_index = aux;
  p->cands = cands, p->ncand = ncand;
  p->state_slots = states, p->nstate = nstate;
  return kvf_sender_send(s, p);
}

static int send_chunk(kvf_sender *s, const int64_t *pages, size_t npages, int is_last, int64_t aux, int64_t token,
                      const int32_t *cands, size_t ncand, const int64_t *states, size_t nstate) {
  kvf_send_params p;
  kvf_send_params_init(&p);
  p.pages = pages, p.npages = npages;
  return send_params(s, &p, is_last, aux, token, cands, ncand, states, nstate);
}

static int send_layers(kvf_sender *s, const int64_t *pages, size_t npages, size_t index_begin, size_t layer_begin,
                       size_t layer_end, int is_last, int64_t aux, int64_t token, const int32_t *cands,
                       size_t ncand, const int64_t *states, size_t nstate) {
  kvf_send_params p;
  kvf_send_params_init(&p);
  p.flags = KVF_SEND_LAYERS;
  p.pages = pages, p.npages = npages;
  p.index_begin = index_begin, p.layer_begin = layer_begin, p.layer_end = layer_end;
  return send_params(s, &p, is_last, aux, token, cands, ncand, states, nstate);
}

static kvf_sender *new_sender(fixture *f, int64_t room) {
  kvf_sender *s = NULL;
  assert_int_equal(kvf_sender_create(f->m, room, &s), 0);
  return s;
}

/* A digest message (verify mode, the decode asked): each entry is checked
 * against the bytes landed in this process's decode memory, as the decode
 * manager does. The prefill sends a part's digests once its write landed,
 * on the same PUSH socket as the room's M3, so they come before it. */
static void check_digests(fixture *f, const wire_frame *fr, size_t n) {
  wire_digests dg;
  char why[WIRE_REASON_LEN];
  assert_int_equal(kvf__wire_digests_decode(fr, n, &dg, why), 0);
  kvf_engine_sync(f->eng);
  for (size_t i = 0; i < dg.entries.count; i++) {
    wire_digest d = wire_digest_at(dg.entries, i);
    if (kvf__hash_block(d.dst, d.len, d.count, d.stride) == d.hash) f->digests_ok++;
    else f->digests_bad++;
  }
}

/* Receive one M3 within 5 s (digest messages before it are checked and
 * counted); copies candidates into cands (cap KVF_MAX_CANDIDATES). */
static char g_last_reason[WIRE_REASON_LEN]; /* the last M3's reason (frame 5), "" without one */

static void recv_m3(fixture *f, wire_m3 *out, int32_t *cands, size_t *ncand) {
  for (;;) {
    zmq_msg_t parts[8];
    size_t n = 0;
    zmq_pollitem_t pi = {.socket = f->pull, .events = ZMQ_POLLIN};
    assert_int_equal(zmq_poll(&pi, 1, 5000), 1);
    int more = 1;
    while (more && n < 8) {
      zmq_msg_init(&parts[n]);
      assert_true(zmq_msg_recv(&parts[n], f->pull, 0) >= 0);
      more = zmq_msg_more(&parts[n]);
      n++;
    }
    wire_frame fr[8];
    for (size_t i = 0; i < n; i++) fr[i] = (wire_frame){zmq_msg_data(&parts[i]), zmq_msg_size(&parts[i])};
    int digests = kvf__wire_is_digests(fr, n);
    if (digests) {
      check_digests(f, fr, n);
    } else {
      char why[WIRE_REASON_LEN];
      assert_int_equal(kvf__wire_m3_decode(fr, n, out, why), 0);
      snprintf(g_last_reason, sizeof g_last_reason, "%.*s", (int)out->reason_len, out->reason ? out->reason : "");
      *ncand = out->candidates.count < KVF_MAX_CANDIDATES ? out->candidates.count : KVF_MAX_CANDIDATES;
      for (size_t i = 0; i < *ncand; i++) cands[i] = wire_i32_at(out->candidates, i);
      out->candidates = wire_array_of(NULL, 0);
    }
    for (size_t i = 0; i < n; i++) zmq_msg_close(&parts[i]);
    if (!digests) return;
  }
}

/* The next M3 (digests skipped) is a Failed one for `room`; it is returned
 * (its reason and candidates point nowhere any more; reason_len stays). */
static wire_m3 expect_failed_m3(fixture *f, int64_t room) {
  wire_m3 m3;
  int32_t c[KVF_MAX_CANDIDATES];
  size_t nc;
  recv_m3(f, &m3, c, &nc);
  assert_int_equal(m3.room, room);
  assert_int_equal(m3.status, WIRE_STATUS_FAILED);
  m3.reason = NULL;
  return m3;
}

static int wait_final(kvf_sender *s, int ms) {
  int64_t end = clock_now_ns() + (int64_t)ms * 1000000;
  int st = kvf_sender_poll(s);
  while (st != KVF_POLL_SUCCESS && st != KVF_POLL_FAILED && clock_now_ns() < end) {
    sleep_ms(2);
    st = kvf_sender_poll(s);
  }
  return st;
}

static void check_pages(fixture *f, const int64_t *src, const int64_t *dst, size_t n) {
  kvf_engine_sync(f->eng);
  for (int b = 0; b < NKV; b++)
    for (size_t k = 0; k < n; k++)
      assert_memory_equal(f->dbuf[b] + dst[k] * ITEM, f->pbuf[b] + src[k] * ITEM, ITEM);
}

static void expect_success_m3(fixture *f, int64_t room, int64_t token, const int32_t *cands, size_t ncand) {
  wire_m3 m3;
  int32_t got[KVF_MAX_CANDIDATES];
  size_t ng = 0;
  recv_m3(f, &m3, got, &ng);
  assert_int_equal(m3.room, room);
  assert_int_equal(m3.status, WIRE_STATUS_SUCCESS);
  assert_int_equal(m3.prefill_rank, 0);
  assert_int_equal(m3.bootstrap_token, token);
  assert_int_equal(ng, ncand);
  for (size_t i = 0; i < ncand; i++) assert_int_equal(got[i], cands[i]);
}

/* MHA with NKV buffers: layer l is buffers {l, NKV/2 + l}. */
static void check_layer(fixture *f, int l, const int64_t *src, const int64_t *dst, size_t n) {
  kvf_engine_sync(f->eng);
  int bufs[2] = {l, NKV / 2 + l};
  for (int i = 0; i < 2; i++)
    for (size_t k = 0; k < n; k++)
      assert_memory_equal(f->dbuf[bufs[i]] + dst[k] * ITEM, f->pbuf[bufs[i]] + src[k] * ITEM, ITEM);
}

static void check_layer_zero(fixture *f, int l, const int64_t *dst, size_t n) {
  kvf_engine_sync(f->eng);
  uint8_t zero[ITEM] = {0};
  int bufs[2] = {l, NKV / 2 + l};
  for (int i = 0; i < 2; i++)
    for (size_t k = 0; k < n; k++) assert_memory_equal(f->dbuf[bufs[i]] + dst[k] * ITEM, zero, ITEM);
}

/* No M3 arrives within ms. */
static void expect_no_m3(fixture *f, int ms) {
  int64_t end = clock_now_ns() + (int64_t)ms * 1000000;
  for (int64_t left = ms; left > 0; left = (end - clock_now_ns()) / 1000000) {
    zmq_pollitem_t pi = {.socket = f->pull, .events = ZMQ_POLLIN};
    if (zmq_poll(&pi, 1, (long)left) == 0) return;
    zmq_msg_t parts[8];
    size_t n = 0;
    for (int more = 1; more && n < 8; n++) {
      zmq_msg_init(&parts[n]);
      assert_true(zmq_msg_recv(&parts[n], f->pull, 0) >= 0);
      more = zmq_msg_more(&parts[n]);
    }
    wire_frame fr[8];
    for (size_t i = 0; i < n; i++) fr[i] = (wire_frame){zmq_msg_data(&parts[i]), zmq_msg_size(&parts[i])};
    int digests = kvf__wire_is_digests(fr, n);
    if (digests) check_digests(f, fr, n); /* verify mode: digests may come, an M3 may not */
    for (size_t i = 0; i < n; i++) zmq_msg_close(&parts[i]);
    assert_true(digests);
  }
}

static uint64_t stat_chunks(fixture *f) {
  kvf_manager_stats st;
  kvf_manager_get_stats(f->m, &st);
  return st.chunks_sent;
}

/* Wait (bounded) until the workers have counted `want` chunks. */
static void wait_chunks(fixture *f, uint64_t want) {
  int64_t end = clock_now_ns() + 5000000000LL;
  while (stat_chunks(f) < want && clock_now_ns() < end) sleep_ms(2);
  assert_int_equal(stat_chunks(f), want);
}

/* ---------------------------------------------------------------- tests */

/* Token-major pages of 4 tokens x 2 heads x 8 bytes (ITEM 64) sent to a
 * decode with 4 heads per token (stride 128), into heads 2-3: the plan
 * (§6.5.5, per page: offset 32, 32 bytes) is right only for head-major
 * pages. Without kvferry's page-layout frame the prefill refuses; with it,
 * every token's 16-byte head slice lands at its own token's heads 2-3. */
static void token_major_slices(void **state) {
  (void)state;
  g_page_size = 4;
  for (int with_layout = 0; with_layout < 2; with_layout++) {
    fixture f;
    fx_setup(&f, "");
    int64_t room = 70 + with_layout;
    kvf_sender *s = NULL;
    assert_int_equal(kvf_sender_create(f.m, room, &s), 0);
    send_m1(&f);
    wire_fragment fr[2];
    for (int b = 0; b < 2; b++)
      fr[b] = (wire_fragment){.buffer_index = b,
                              .buffer_kind = b ? WIRE_KIND_TARGET_V : WIRE_KIND_TARGET_K,
                              .src_rank = 0,
                              .dst_rank = 0,
                              .src_page_stride_bytes = ITEM,
                              .dst_page_stride_bytes = 2 * ITEM,
                              .src_byte_offset = 0,
                              .dst_byte_offset = ITEM / 2,
                              .bytes_per_page = ITEM,
                              .page_count = -1};
    fr[0].bytes_per_page = fr[1].bytes_per_page = ITEM; /* whole source page into half a decode page */
    fr[0].dst_byte_offset = fr[1].dst_byte_offset = ITEM;
    int64_t src[] = {3, 4, 9}, dst[] = {1, 2, 5};
    wire_m2 m2;
    memset(&m2, 0, sizeof m2);
    m2.room = room;
    snprintf(m2.endpoint, sizeof m2.endpoint, "127.0.0.1");
    m2.dst_port = f.pull_port;
    snprintf(m2.session, sizeof m2.session, "%s", f.session);
    m2.required_dst_info_num = 1;
    m2.kv_indices = wire_array_of(dst, 3);
    m2.frags = fr;
    m2.nfrags = 2;
    m2.page_layout = with_layout ? 4 : 0;
    wire_msg msg;
    char why[WIRE_REASON_LEN];
    assert_int_equal(kvf__wire_m2_encode(&m2, &msg, why), 0);
    assert_int_equal(msg.nframes, with_layout ? 15 : 14);
    send_msg(&f, &msg);
    kvf__wire_msg_free(&msg);
    assert_int_equal(send_chunk(s, src, 3, 1, 0, 7, NULL, 0, NULL, 0), 0);
    int st = wait_final(s, 5000);
    wire_m3 m3;
    int32_t c[KVF_MAX_CANDIDATES];
    size_t nc;
    recv_m3(&f, &m3, c, &nc);
    if (!with_layout) {
      assert_int_equal(st, KVF_POLL_FAILED);
      assert_int_equal(m3.status, WIRE_STATUS_FAILED);
      char reason[512];
      kvf_sender_failure(s, reason, sizeof reason);
      assert_non_null(strstr(reason, "Refusing a heterogeneous-TP plan"));
      kvf_engine_sync(f.eng);
      for (int b = 0; b < NKV; b++)
        for (size_t i = 0; i < NPAGES * ITEM; i++) assert_int_equal(f.dbuf[b][i], 0); /* nothing written */
    } else {
      assert_int_equal(st, KVF_POLL_SUCCESS);
      assert_int_equal(m3.status, WIRE_STATUS_SUCCESS);
      kvf_engine_sync(f.eng);
      /* per token: source token t (16 bytes) -> decode token t, bytes 16..32 */
      for (int b = 0; b < NKV; b++)
        for (int k = 0; k < 3; k++)
          for (int t = 0; t < 4; t++)
            assert_memory_equal(f.dbuf[b] + dst[k] * 2 * ITEM + t * 32 + 16, f.pbuf[b] + src[k] * ITEM + t * 16,
                                16);
    }
    kvf_sender_destroy(s);
    fx_teardown(&f);
  }
  g_page_size = 1;
}

static void one_chunk(void **state) {
  (void)state;
  fixture f;
  fx_setup(&f, "");
  kvf_sender *s = new_sender(&f, 7);
  assert_int_equal(kvf_sender_create(f.m, 7, &(kvf_sender *){NULL}), KVF_EEXIST);
  assert_int_equal(kvf_sender_poll(s), KVF_POLL_BOOTSTRAPPING);
  int64_t src[] = {0, 1, 2, 7, 8}, dst[] = {3, 4, 5, 9, 15};
  register_and_request(&f, 7, dst, 5);
  assert_int_equal(kvf_sender_poll(s), KVF_POLL_BOOTSTRAPPED);
  int32_t cands[] = {11, 12, 13};
  assert_int_equal(send_chunk(s, src, 5, 1, 0, 42, cands, 3, NULL, 0), 0);
  assert_int_equal(wait_final(s, 5000), KVF_POLL_SUCCESS);
  expect_success_m3(&f, 7, 42, cands, 3);
  check_pages(&f, src, dst, 5);
  /* untouched page stays zero */
  uint8_t zero[ITEM] = {0};
  assert_memory_equal(f.dbuf[0] + 0 * ITEM, zero, ITEM);
  kvf_manager_stats st;
  kvf_manager_get_stats(f.m, &st);
  assert_int_equal(st.chunks_sent, 1);
  assert_int_equal(st.bytes_sent, 5 * ITEM * NKV);
  assert_int_equal(send_chunk(s, src, 1, 1, 0, -1, NULL, 0, NULL, 0), KVF_ESTATE);
  kvf_sender_destroy(s);
  kvf_manager_get_stats(f.m, &st);
  assert_int_equal(st.live_rooms, 0);
  fx_teardown(&f);
}

/* A scheduler that sleeps on kvf_manager_event_fd between its polls: clear,
 * poll, wait. The final state must be seen right after a wake-up by the fd
 * (poll returned 1), never by the wait running out, which is how a missed
 * event would show (the budget is long enough to pass the test anyway). */
static int wait_final_on_events(kvf_manager *m, kvf_sender *s, int ms) {
  int fd = kvf_manager_event_fd(m);
  assert_true(fd >= 0);
  int64_t end = clock_now_ns() + (int64_t)ms * 1000000;
  int woke = 1; /* the first poll needs no event */
  for (;;) {
    kvf_manager_event_clear(m);
    int st = kvf_sender_poll(s);
    if (st == KVF_POLL_SUCCESS || st == KVF_POLL_FAILED) {
      assert_true(woke);
      return st;
    }
    int64_t left = (end - clock_now_ns()) / 1000000;
    assert_true(left > 0);
    struct pollfd p = {.fd = fd, .events = POLLIN};
    woke = poll(&p, 1, (int)left) == 1;
  }
}

/* A sender for `room` whose decode names as its engine session a socket
 * that listens and never accepts (a stopped decode: the connect completes
 * in the kernel, the handshake never gets an answer); the room is
 * requested (M2). Returns the listening socket. */
static int silent_request(fixture *f, int64_t room, const int64_t *dst, size_t n, kvf_sender **out) {
  char real[sizeof f->session];
  snprintf(real, sizeof real, "%s", f->session);
  int silent = kvf_test_silent_listener(f->session, sizeof f->session);
  assert_true(silent >= 0);
  *out = new_sender(f, room);
  register_and_request(f, room, dst, n);
  snprintf(f->session, sizeof f->session, "%s", real);
  return silent;
}

/* A decode that never answers the engine's handshake holds only its own
 * room: kvf_sender_send returns at once (the connect runs on the engine's
 * connector), and the next room, to a live decode, reaches Success while
 * the first still waits for its connection (the engine's timeout is 5 s).
 * Closing the silent socket resets the half-made connection and the first
 * room fails. */
static void silent_decode_holds_only_its_room(void **state) {
  (void)state;
  fixture f;
  fx_setup(&f, "");
  int64_t src[] = {0, 1, 2}, dst[] = {3, 4, 5};
  kvf_sender *stuck = NULL;
  int silent = silent_request(&f, 31, dst, 3, &stuck);
  kvf_sender *live = new_sender(&f, 32);
  register_and_request(&f, 32, dst, 3);
  assert_int_equal(send_chunk(stuck, src, 3, 1, 0, 4, NULL, 0, NULL, 0), 0);
  assert_int_equal(send_chunk(live, src, 3, 1, 0, 5, NULL, 0, NULL, 0), 0);
  assert_int_equal(wait_final(live, 4000), KVF_POLL_SUCCESS);
  assert_int_equal(kvf_sender_poll(stuck), KVF_POLL_BOOTSTRAPPED); /* not final: its chunk waits for the connect */
  expect_success_m3(&f, 32, 5, NULL, 0);
  check_pages(&f, src, dst, 3);
  close(silent);
  assert_int_equal(wait_final(stuck, 4000), KVF_POLL_FAILED);
  kvf_sender_destroy(stuck);
  kvf_sender_destroy(live);
  fx_teardown(&f);
}

/* Decodes that stop answering hold only their own rooms on the worker path
 * too: rooms of two chunks each (the first stays in the worker's window, the
 * last waits for both) to three silent decodes, then to a live one. Each
 * queue's thread that has waited PF_SLOW_WAIT_MS on a silent decode gets
 * another thread for the other rooms (up to PF_QUEUE_THREADS per queue, more
 * than the three that can wait), so every live room succeeds while the silent ones still wait
 * (the engine's timeout is 20 s); before, a live room behind a silent one
 * on its queue waited for that timeout. */
static void silent_decodes_hold_only_their_rooms_on_workers(void **state) {
  (void)state;
  enum { NSTUCK = 3, NLIVE = 8 };
  fixture f;
  fx_setup(&f, "");
  int64_t src[] = {0, 1, 2, 3}, dst[] = {3, 4, 5, 6};
  kvf_sender *stuck[NSTUCK], *live[NLIVE];
  int silent[NSTUCK];
  for (int i = 0; i < NSTUCK; i++) {
    silent[i] = silent_request(&f, 100 + i, dst, 4, &stuck[i]);
    assert_int_equal(send_chunk(stuck[i], src, 2, 0, 0, 4, NULL, 0, NULL, 0), 0);
    assert_int_equal(send_chunk(stuck[i], src + 2, 2, 1, 0, 4, NULL, 0, NULL, 0), 0);
  }
  for (int i = 0; i < NLIVE; i++) {
    live[i] = new_sender(&f, 200 + i);
    register_and_request(&f, 200 + i, dst, 4);
    assert_int_equal(send_chunk(live[i], src, 2, 0, 0, 5, NULL, 0, NULL, 0), 0);
    assert_int_equal(send_chunk(live[i], src + 2, 2, 1, 0, 5, NULL, 0, NULL, 0), 0);
  }
  for (int i = 0; i < NLIVE; i++) assert_int_equal(wait_final(live[i], 15000), KVF_POLL_SUCCESS);
  for (int i = 0; i < NSTUCK; i++) assert_int_equal(kvf_sender_poll(stuck[i]), KVF_POLL_BOOTSTRAPPED);
  check_pages(&f, src, dst, 4);
  for (int i = 0; i < NSTUCK; i++) close(silent[i]); /* resets the half-made connections */
  for (int i = 0; i < NSTUCK; i++) assert_int_equal(wait_final(stuck[i], 15000), KVF_POLL_FAILED);
  for (int i = 0; i < NSTUCK; i++) kvf_sender_destroy(stuck[i]);
  for (int i = 0; i < NLIVE; i++) kvf_sender_destroy(live[i]);
  fx_teardown(&f);
}

/* kvf_manager_event_fd wakes a sleeping scheduler when its room succeeds,
 * and when a failed room's last transfer ends (the sender's poll reports
 * Failed only then: that end is an event too, not only the failure). */
static void event_fd_wakes_the_scheduler(void **state) {
  (void)state;
  fixture f;
  fx_setup(&f, "");
  kvf_sender *s = new_sender(&f, 21);
  int64_t src[] = {0, 1, 2}, dst[] = {3, 4, 5};
  register_and_request(&f, 21, dst, 3);
  assert_int_equal(send_chunk(s, src, 3, 1, 0, 9, NULL, 0, NULL, 0), 0);
  assert_int_equal(wait_final_on_events(f.m, s, 8000), KVF_POLL_SUCCESS);
  expect_success_m3(&f, 21, 9, NULL, 0);
  kvf_sender_destroy(s);
  /* A refused write: the room fails; Failed once its chunks ended. */
  kvf_sender *s2 = new_sender(&f, 22);
  int64_t bad[] = {NPAGES - 1, NPAGES + 100};
  send_m2(&f, 22, bad, 2);
  assert_int_equal(send_chunk(s2, src, 2, 1, 0, 3, NULL, 0, NULL, 0), 0);
  assert_int_equal(wait_final_on_events(f.m, s2, 8000), KVF_POLL_FAILED);
  kvf_sender_destroy(s2);
  /* Aborted while its chunk is in flight to a decode engine that never
   * answers (a socket that accepts and stays silent, so the chunk ends at
   * the engine's timeout, 5 s): Failed waits for that end, and only the
   * end's own event can wake the wait in time. */
  kvf_sender *s3 = NULL;
  int silent = silent_request(&f, 23, dst, 3, &s3);
  assert_int_equal(send_chunk(s3, src, 3, 1, 0, 4, NULL, 0, NULL, 0), 0);
  /* The engine connecting to the silent socket: the chunk is in flight (the
   * room counts it before its submit), whenever its M2 got through. */
  struct pollfd lp = {.fd = silent, .events = POLLIN};
  assert_int_equal(poll(&lp, 1, 20000), 1);
  int conn = accept(silent, NULL, NULL);
  assert_true(conn >= 0);
  kvf_sender_abort(s3, "aborted by the test");
  assert_int_equal(kvf_sender_poll(s3), KVF_POLL_TRANSFERRING); /* its chunk may still read the sources */
  assert_int_equal(wait_final_on_events(f.m, s3, 15000), KVF_POLL_FAILED);
  kvf_sender_destroy(s3);
  close(conn);
  close(silent);
  /* Made once, closed with the manager (fx_teardown). */
  assert_int_equal(kvf_manager_event_fd(f.m), kvf_manager_event_fd(f.m));
  assert_int_equal(kvf_manager_event_fd(NULL), KVF_EINVAL);
  kvf_manager_event_clear(NULL);
  fx_teardown(&f);
}

/* One candidate limit, public and shared with the decode: a sender with
 * KVF_MAX_CANDIDATES + 1 ids is refused at the call (the decode would drop
 * such an M3 and its room would wait for the waiting timeout); exactly the
 * limit still works end to end. */
static void candidate_limit(void **state) {
  (void)state;
  fixture f;
  fx_setup(&f, "");
  kvf_sender *s = new_sender(&f, 9);
  int64_t src[] = {0, 1}, dst[] = {2, 3};
  register_and_request(&f, 9, dst, 2);
  int32_t cands[KVF_MAX_CANDIDATES + 1];
  for (int i = 0; i <= KVF_MAX_CANDIDATES; i++) cands[i] = 100 + i;
  assert_int_equal(send_chunk(s, src, 2, 1, 0, 42, cands, KVF_MAX_CANDIDATES + 1, NULL, 0), KVF_ETOOBIG);
  assert_int_equal(kvf_sender_set_metadata(s, 42, cands, KVF_MAX_CANDIDATES + 1), KVF_ETOOBIG);
  assert_int_equal(kvf_sender_poll(s), KVF_POLL_BOOTSTRAPPED);
  assert_int_equal(send_chunk(s, src, 2, 1, 0, 42, cands, KVF_MAX_CANDIDATES, NULL, 0), 0);
  assert_int_equal(wait_final(s, 5000), KVF_POLL_SUCCESS);
  expect_success_m3(&f, 9, 42, cands, KVF_MAX_CANDIDATES);
  kvf_sender_destroy(s);
  fx_teardown(&f);
}

/* kvf_send_params: refused without kvf_send_params_init, with unknown
 * flags, TOKEN_LATER without LAST, or a token below -1; a struct from older
 * headers (smaller size) is accepted, one from newer headers is not. */
static void send_params_checked(void **state) {
  (void)state;
  fixture f;
  fx_setup(&f, "");
  kvf_sender *s = new_sender(&f, 8);
  int64_t src[] = {0, 1}, dst[] = {2, 3};
  register_and_request(&f, 8, dst, 2);
  kvf_send_params p;
  memset(&p, 0, sizeof p);
  p.pages = src, p.npages = 2, p.flags = KVF_SEND_LAST;
  assert_int_equal(kvf_sender_send(s, &p), KVF_EINVAL); /* size 0: never initialised */
  kvf_send_params_init(&p);
  assert_int_equal(p.size, sizeof p);
  assert_int_equal(p.bootstrap_token, -1);
  p.pages = src, p.npages = 2;
  p.size = sizeof p + 8;
  assert_int_equal(kvf_sender_send(s, &p), KVF_EINVAL);
  p.size = sizeof p;
  p.flags = 1u << 7;
  assert_int_equal(kvf_sender_send(s, &p), KVF_EINVAL);
  p.flags = KVF_SEND_TOKEN_LATER;
  assert_int_equal(kvf_sender_send(s, &p), KVF_EINVAL);
  p.flags = KVF_SEND_LAST;
  p.bootstrap_token = -2;
  assert_int_equal(kvf_sender_send(s, &p), KVF_EINVAL);
  assert_int_equal(kvf_sender_send(s, NULL), KVF_EINVAL);
  assert_int_equal(kvf_sender_poll(s), KVF_POLL_BOOTSTRAPPED);
  p.bootstrap_token = 77;
  assert_int_equal(kvf_sender_send(s, &p), 0);
  assert_int_equal(wait_final(s, 5000), KVF_POLL_SUCCESS);
  expect_success_m3(&f, 8, 77, NULL, 0);
  check_pages(&f, src, dst, 2);
  kvf_sender_destroy(s);
  fx_teardown(&f);
}

static void many_chunks(void **state) {
  (void)state;
  fixture f;
  fx_setup(&f, "");
  int64_t src[] = {10, 11, 12, 4, 5, 6, 0}, dst[] = {0, 1, 2, 3, 8, 9, 14};
  send_m1(&f);
  send_m2(&f, -3, dst, 7); /* M2 before the sender: stored as an early room */
  wait_received(&f, 2);
  kvf_sender *s = new_sender(&f, -3);
  assert_int_equal(kvf_sender_poll(s), KVF_POLL_BOOTSTRAPPED);
  assert_int_equal(send_chunk(s, src, 3, 0, -1, -1, NULL, 0, NULL, 0), 0);
  assert_int_equal(send_chunk(s, src + 3, 2, 0, -1, -1, NULL, 0, NULL, 0), 0);
  assert_int_equal(send_chunk(s, src + 5, 2, 1, 3, 99, NULL, 0, NULL, 0), 0);
  assert_int_equal(wait_final(s, 5000), KVF_POLL_SUCCESS);
  expect_success_m3(&f, -3, 99, NULL, 0);
  check_pages(&f, src, dst, 7);
  kvf_manager_stats st;
  kvf_manager_get_stats(f.m, &st);
  assert_int_equal(st.chunks_sent, 3);
  kvf_sender_destroy(s);
  fx_teardown(&f);
}

/* The room table's counters reach kvf_manager_stats: M2s before their
 * sender are early rooms (not live), a sender makes its early room live,
 * destroying it clears it; an early room still there at shutdown is freed
 * with the manager. */
static void early_rooms_in_stats(void **state) {
  (void)state;
  fixture f;
  fx_setup(&f, "");
  int64_t dst[] = {1, 2};
  send_m1(&f);
  send_m2(&f, 41, dst, 2);
  send_m2(&f, 42, dst, 2);
  wait_received(&f, 3);
  kvf_manager_stats st;
  kvf_manager_get_stats(f.m, &st);
  assert_int_equal(st.rooms_early, 2);
  assert_int_equal(st.live_rooms, 0);
  assert_int_equal(st.rooms_created, 0);
  kvf_sender *s = new_sender(&f, 41);
  assert_int_equal(kvf_sender_poll(s), KVF_POLL_BOOTSTRAPPED);
  kvf_sender *again = NULL;
  assert_int_equal(kvf_sender_create(f.m, 41, &again), KVF_EEXIST);
  kvf_manager_get_stats(f.m, &st);
  assert_int_equal(st.rooms_early, 1);
  assert_int_equal(st.live_rooms, 1);
  assert_int_equal(st.rooms_created, 1);
  kvf_sender_destroy(s);
  kvf_manager_get_stats(f.m, &st);
  assert_int_equal(st.live_rooms, 0);
  assert_int_equal(st.rooms_cleared, 1);
  assert_int_equal(st.rooms_early, 1);
  assert_int_equal(st.rooms_early_dropped, 0);
  /* The same counters as /metrics lines, whole lines only. */
  char text[4096], want[160];
  size_t n = kvf_manager_metrics(f.m, text, sizeof text);
  assert_int_equal(n, strlen(text));
  snprintf(want, sizeof want, "\nkvferry_manager_rooms_early{role=\"prefill\",session=\"%s\"} 1\n",
           kvf_manager_session_id(f.m));
  assert_non_null(strstr(text, want));
  snprintf(want, sizeof want, "\nkvferry_manager_rooms_cleared{role=\"prefill\",session=\"%s\"} 1\n",
           kvf_manager_session_id(f.m));
  assert_non_null(strstr(text, want));
  n = kvf_manager_metrics(f.m, text, 100);
  assert_true(n > 0 && n < 100 && text[n - 1] == '\n' && text[n] == '\0');
  assert_int_equal(kvf_manager_metrics(f.m, text, 0), 0);
  fx_teardown(&f);
}

/* Early rooms (M2s before their sender) are bounded in the bytes of the M2
 * copies they hold, not only in number: M2s of 1M pages (8 MiB each) from
 * one decode fill its 256 MiB share after about 31 rooms, and the next ones
 * are answered Failed at once instead of held. */
static void early_rooms_bounded_in_bytes(void **state) {
  (void)state;
  fixture f;
  fx_setup(&f, "");
  enum { N = 40, PAGES = 1 << 20 };
  int64_t *dst = calloc(PAGES, sizeof *dst);
  assert_non_null(dst);
  send_m1(&f);
  for (int i = 0; i < N; i++) send_m2(&f, 200 + i, dst, PAGES);
  free(dst);
  wire_m3 m3;
  int32_t c[KVF_MAX_CANDIDATES];
  size_t nc;
  int64_t first = -1;
  int refused = 0;
  do { /* 320 MiB of M2s to take in: generous under sanitizers on a loaded machine */
    zmq_pollitem_t pi = {.socket = f.pull, .events = ZMQ_POLLIN};
    assert_int_equal(zmq_poll(&pi, 1, 60000), 1);
    recv_m3(&f, &m3, c, &nc);
    assert_int_equal(m3.status, WIRE_STATUS_FAILED);
    assert_non_null(strstr(g_last_reason, "too many bytes"));
    if (first < 0) first = m3.room;
    refused++;
  } while (m3.room != 200 + N - 1);
  assert_true(first >= 200 + 28 && first <= 200 + 32);
  assert_int_equal(refused, 200 + N - first);
  kvf_manager_stats st;
  kvf_manager_get_stats(f.m, &st);
  assert_int_equal(st.rooms_early, (uint64_t)(first - 200));
  fx_teardown(&f);
}

/* Early rooms idle past the waiting timeout are dropped by the listener's
 * tick, not only by the next M2 (with none, they were held for good). */
static void idle_early_rooms_dropped_without_m2s(void **state) {
  (void)state;
  g_waiting_s = 0.3;
  fixture f;
  fx_setup(&f, "");
  g_waiting_s = 0;
  int64_t dst[] = {1};
  send_m1(&f);
  for (int i = 0; i < 3; i++) send_m2(&f, 250 + i, dst, 1);
  wait_received(&f, 4);
  kvf_manager_stats st;
  int64_t end = clock_now_ns() + 10000000000LL;
  do {
    sleep_ms(50);
    kvf_manager_get_stats(f.m, &st);
  } while (st.rooms_early && clock_now_ns() < end);
  assert_int_equal(st.rooms_early, 0);
  fx_teardown(&f);
}

/* A chunk submitted before the M2 waits on the room and completes after. */
static void chunk_waits_for_m2(void **state) {
  (void)state;
  fixture f;
  fx_setup(&f, "");
  kvf_sender *s = new_sender(&f, 100);
  int64_t src[] = {5, 6}, dst[] = {1, 2};
  assert_int_equal(send_chunk(s, src, 2, 1, 0, 5, NULL, 0, NULL, 0), 0);
  sleep_ms(100);
  assert_int_equal(kvf_sender_poll(s), KVF_POLL_BOOTSTRAPPING);
  send_m1(&f);
  send_m2(&f, 100, dst, 2);
  assert_int_equal(wait_final(s, 5000), KVF_POLL_SUCCESS);
  expect_success_m3(&f, 100, 5, NULL, 0);
  check_pages(&f, src, dst, 2);
  kvf_sender_destroy(s);
  fx_teardown(&f);
}

/* §6.8: the sender's pages are the full list; the decode already holds the
 * first decode_prefix_len / page_size of them, which are skipped, also
 * across chunk boundaries. */
static void decode_prefix_skipped(void **state) {
  (void)state;
  fixture f;
  fx_setup(&f, "");
  kvf_sender *s = new_sender(&f, 31);
  int64_t src[] = {9, 8, 7, 6, 5}, dst[] = {0, 1, 2};
  send_m1(&f);
  send_m2_prefix(&f, 31, dst, 3, 2);
  assert_int_equal(send_chunk(s, src, 1, 0, -1, -1, NULL, 0, NULL, 0), 0);
  assert_int_equal(send_chunk(s, src + 1, 2, 0, -1, -1, NULL, 0, NULL, 0), 0);
  assert_int_equal(send_chunk(s, src + 3, 2, 1, 0, 1, NULL, 0, NULL, 0), 0);
  assert_int_equal(wait_final(s, 5000), KVF_POLL_SUCCESS);
  expect_success_m3(&f, 31, 1, NULL, 0);
  check_pages(&f, src + 2, dst, 3);
  kvf_sender_destroy(s);
  fx_teardown(&f);
}

static void bootstrap_timeout(void **state) {
  (void)state;
  setenv("TOKENSPEED_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "1", 1);
  fixture f;
  fx_setup(&f, "");
  unsetenv("TOKENSPEED_DISAGGREGATION_BOOTSTRAP_TIMEOUT");
  kvf_sender *s = new_sender(&f, 5);
  int64_t src[] = {1};
  assert_int_equal(send_chunk(s, src, 1, 1, 0, -1, NULL, 0, NULL, 0), 0);
  int64_t t0 = clock_now_ns();
  assert_int_equal(wait_final(s, 4000), KVF_POLL_FAILED);
  assert_true(clock_now_ns() - t0 >= 500000000LL);
  char why[256];
  kvf_sender_failure(s, why, sizeof why);
  assert_non_null(strstr(why, "Request 5 timed out after 1.0s in TransferPoll.Bootstrapping"));
  kvf_sender_destroy(s);
  fx_teardown(&f);
}

static void malformed_and_unregistered(void **state) {
  (void)state;
  fixture f;
  fx_setup(&f, "");
  /* M1 with a non-numeric port, M2 with a short index frame, a lone frame */
  wire_frame bad1[] = {{(const uint8_t *)"None", 4},
                       {(const uint8_t *)"127.0.0.1", 9},
                       {(const uint8_t *)"x", 1},
                       {(const uint8_t *)"1.2.3.4:5", 9},
                       {NULL, 0},
                       {NULL, 0}};
  send_frames(&f, bad1, 6);
  wire_frame bad2[] = {{(const uint8_t *)"3", 1},   {(const uint8_t *)"127.0.0.1", 9},
                       {(const uint8_t *)"9", 1},   {(const uint8_t *)"1.2.3.4:5", 9},
                       {(const uint8_t *)"abc", 3}, {(const uint8_t *)"0", 1},
                       {(const uint8_t *)"1", 1}};
  send_frames(&f, bad2, 7);
  wire_frame bad3[] = {{(const uint8_t *)"junk", 4}};
  send_frames(&f, bad3, 1);
  wait_malformed(&f, 3);
  /* M2 from a session that never sent M1: rejected, room stays
   * Bootstrapping; its decode is told why (it would wait for its timeout) */
  kvf_sender *s = new_sender(&f, 1);
  int64_t dst[] = {0};
  send_m2(&f, 1, dst, 1);
  wait_malformed(&f, 4);
  assert_int_equal(stat_received(&f), 0);
  assert_int_equal(kvf_sender_poll(s), KVF_POLL_BOOTSTRAPPING);
  expect_failed_m3(&f, 1);
  assert_non_null(strstr(g_last_reason, WIRE_REASON_UNREGISTERED));
  /* the listener still works */
  send_m1(&f);
  send_m2(&f, 1, dst, 1);
  int64_t src[] = {3};
  assert_int_equal(send_chunk(s, src, 1, 1, 0, -1, NULL, 0, NULL, 0), 0);
  assert_int_equal(wait_final(s, 5000), KVF_POLL_SUCCESS);
  expect_success_m3(&f, 1, -1, NULL, 0);
  check_pages(&f, src, dst, 1);
  kvf_sender_destroy(s);
  fx_teardown(&f);
}

/* Issue 13 defect 5, prefill side: M1 and M2 that claim the decode host
 * 127.0.0.1, or its engine session, but come from 127.0.0.2 are dropped and
 * counted as forged (a forged M1 could point the prefill's writes at any
 * memory of that session);
 * the same messages from the claimed host then serve the room. */
static void forged_m1_m2_from_other_host(void **state) {
  (void)state;
  fixture f;
  fx_setup(&f, "");
  void *real = f.push;
  f.push = zmq_socket(f.zctx, ZMQ_PUSH);
  int linger = 0;
  zmq_setsockopt(f.push, ZMQ_LINGER, &linger, sizeof linger);
  char ep[128];
  snprintf(ep, sizeof ep, "tcp://127.0.0.2:0;127.0.0.1:%u", (unsigned)f.m->rank_port);
  assert_int_equal(zmq_connect(f.push, ep), 0);
  kvf_sender *s = new_sender(&f, 2);
  int64_t dst[] = {1};
  send_m1(&f);
  send_m2(&f, 2, dst, 1);
  kvf_manager_stats st;
  int64_t end = clock_now_ns() + 5000000000LL;
  do {
    sleep_ms(2);
    kvf_manager_get_stats(f.m, &st);
  } while (st.messages_forged < 2 && clock_now_ns() < end);
  assert_int_equal(st.messages_forged, 2);
  /* From 127.0.0.2 naming itself as the endpoint but 127.0.0.1's engine as
   * the session: that would replace 127.0.0.1's registration. Forged too. */
  g_endpoint = "127.0.0.2";
  send_m1(&f);
  send_m2(&f, 2, dst, 1);
  g_endpoint = "127.0.0.1";
  do {
    sleep_ms(2);
    kvf_manager_get_stats(f.m, &st);
  } while (st.messages_forged < 4 && clock_now_ns() < end);
  assert_int_equal(st.messages_forged, 4);
  assert_int_equal(stat_received(&f), 0);
  assert_int_equal(kvf_sender_poll(s), KVF_POLL_BOOTSTRAPPING);
  zmq_close(f.push);
  f.push = real;
  send_m1(&f);
  send_m2(&f, 2, dst, 1);
  int64_t src[] = {4};
  assert_int_equal(send_chunk(s, src, 1, 1, 0, -1, NULL, 0, NULL, 0), 0);
  assert_int_equal(wait_final(s, 5000), KVF_POLL_SUCCESS);
  expect_success_m3(&f, 2, -1, NULL, 0);
  check_pages(&f, src, dst, 1);
  kvf_sender_destroy(s);
  fx_teardown(&f);
}

/* Decode indices past the decode's registered buffer: the engine refuses,
 * the room fails with a reason and the decode gets M3 Failed. */
static void refused_write_fails_room(void **state) {
  (void)state;
  fixture f;
  fx_setup(&f, "");
  kvf_sender *s = new_sender(&f, 9);
  int64_t src[] = {0, 1}, dst[] = {NPAGES - 1, NPAGES + 100};
  send_m1(&f);
  send_m2(&f, 9, dst, 2);
  assert_int_equal(send_chunk(s, src, 2, 1, 0, 3, NULL, 0, NULL, 0), 0);
  assert_int_equal(wait_final(s, 8000), KVF_POLL_FAILED);
  char why[256];
  kvf_sender_failure(s, why, sizeof why);
  char want[128];
  snprintf(want, sizeof want, "Failed to send kv chunk of 9 to 127.0.0.1:%u", (unsigned)f.pull_port);
  assert_non_null(strstr(why, want));
  wire_m3 m3;
  int32_t c[KVF_MAX_CANDIDATES];
  size_t nc;
  recv_m3(&f, &m3, c, &nc);
  assert_int_equal(m3.room, 9);
  assert_int_equal(m3.status, WIRE_STATUS_FAILED);
  assert_int_equal(m3.bootstrap_token, -1);
  kvf_engine_stats es;
  kvf_engine_get_stats(f.eng, &es);
  assert_true(es.batches_refused >= 1);
  /* the session is now marked failed: the next room to it fails at once */
  kvf_sender *s2 = NULL;
  assert_int_equal(kvf_sender_create(f.m, 10, &s2), 0);
  int64_t ok_dst[] = {2};
  send_m2(&f, 10, ok_dst, 1);
  assert_int_equal(send_chunk(s2, src, 1, 1, 0, -1, NULL, 0, NULL, 0), 0);
  assert_int_equal(wait_final(s2, 5000), KVF_POLL_FAILED);
  char why2[512];
  kvf_sender_failure(s2, why2, sizeof why2);
  assert_non_null(strstr(why2, "is not alive"));
  assert_non_null(strstr(why2, want)); /* and why: the first room's failure */
  recv_m3(&f, &m3, c, &nc);
  assert_int_equal(m3.status, WIRE_STATUS_FAILED);
  /* a new M1 clears the mark */
  kvf_sender *s3 = NULL;
  assert_int_equal(kvf_sender_create(f.m, 11, &s3), 0);
  send_m1(&f);
  send_m2(&f, 11, ok_dst, 1);
  assert_int_equal(send_chunk(s3, src, 1, 1, 0, -1, NULL, 0, NULL, 0), 0);
  assert_int_equal(wait_final(s3, 5000), KVF_POLL_SUCCESS);
  kvf_sender_destroy(s);
  kvf_sender_destroy(s2);
  kvf_sender_destroy(s3);
  fx_teardown(&f);
}

/* A refused write in a chunk that is not the room's last, while the worker
 * keeps it in flight (its window): the room fails, the decode gets one M3
 * Failed, and the chunks behind it, the last one included, make no
 * Success. */
static void refused_write_in_window_fails_room(void **state) {
  (void)state;
  fixture f;
  fx_setup(&f, "");
  kvf_sender *s = new_sender(&f, 12);
  int64_t src[] = {0, 1, 2, 3, 4}, dst[] = {0, NPAGES + 100, 2, 3, 4};
  send_m1(&f);
  send_m2(&f, 12, dst, 5);
  assert_int_equal(send_chunk(s, src, 2, 0, -1, -1, NULL, 0, NULL, 0), 0);
  assert_int_equal(send_chunk(s, src + 2, 1, 0, -1, -1, NULL, 0, NULL, 0), 0);
  assert_int_equal(send_chunk(s, src + 3, 1, 0, -1, -1, NULL, 0, NULL, 0), 0);
  assert_int_equal(send_chunk(s, src + 4, 1, 1, 0, 7, NULL, 0, NULL, 0), 0);
  assert_int_equal(wait_final(s, 8000), KVF_POLL_FAILED);
  char why[256];
  kvf_sender_failure(s, why, sizeof why);
  assert_non_null(strstr(why, "Failed to send kv chunk of 12"));
  wire_m3 m3;
  int32_t c[KVF_MAX_CANDIDATES];
  size_t nc;
  recv_m3(&f, &m3, c, &nc);
  assert_true(m3.room == 12 && m3.status == WIRE_STATUS_FAILED);
  expect_no_m3(&f, 300); /* no second M3, no Success: the chunks behind it were waited for or skipped */
  assert_int_equal(kvf_sender_poll(s), KVF_POLL_FAILED);
  kvf_sender_destroy(s);
  fx_teardown(&f);
}

/* The decode's room fence (issue 16) refuses a write: the decode failed or
 * dropped that room. The room fails with that reason and its decode gets
 * one M3 Failed, but the decode session is not marked failed (the decode
 * gave up one room, it is not dead): its other rooms, before and after,
 * still succeed. Refused on the direct path (a room's only chunk), in the
 * worker's window (the first chunk of two) and, in verify mode, in the
 * verify step. Over tcp, where the decode's engine refuses each chunk
 * before any byte of it lands. */
static void fence_refusal(int verify) {
  g_verify = verify;
  g_room_flags = verify ? WIRE_ROOM_VERIFY : 0;
  fixture f;
  fx_setup_tcp_registered(&f);
  /* in this order, each finished before the next starts */
  const struct {
    int64_t room;
    int fenced, nchunks;
    int64_t dst[2];
  } rm[] = {{51, 1, 1, {1, 2}}, {52, 0, 1, {3, 4}}, {53, 1, 2, {5, 6}}, {54, 0, 2, {7, 8}}, {55, 0, 1, {9, 10}}};
  const size_t nrm = sizeof rm / sizeof rm[0];
  int64_t src[] = {20, 21};
  for (size_t i = 0; i < nrm; i++) {
    uint64_t tag = manager_room_tag(rm[i].room), epoch = 0;
    assert_int_equal(kvf_engine_fence_open(f.eng, tag, &epoch), 0);
    kvf_sender *s = new_sender(&f, rm[i].room);
    g_fence_epoch = epoch;
    send_m2(&f, rm[i].room, rm[i].dst, 2);
    g_fence_epoch = 0;
    wait_received(&f, 2 + i);
    if (rm[i].fenced) assert_int_equal(kvf_engine_fence_close(f.eng, tag, epoch, 5000), 0);
    if (rm[i].nchunks == 2) {
      assert_int_equal(send_chunk(s, src, 1, 0, -1, -1, NULL, 0, NULL, 0), 0);
      assert_int_equal(send_chunk(s, src + 1, 1, 1, 0, 7, NULL, 0, NULL, 0), 0);
    } else {
      assert_int_equal(send_chunk(s, src, 2, 1, 0, 7, NULL, 0, NULL, 0), 0);
    }
    if (rm[i].fenced) {
      assert_int_equal(wait_final(s, 8000), KVF_POLL_FAILED);
      char why[256], want[96];
      kvf_sender_failure(s, why, sizeof why);
      snprintf(want, sizeof want, "The decode fenced room %" PRId64, rm[i].room);
      assert_non_null(strstr(why, want));
      wire_m3 m3;
      int32_t c[KVF_MAX_CANDIDATES];
      size_t nc;
      recv_m3(&f, &m3, c, &nc);
      assert_int_equal(m3.room, rm[i].room);
      assert_int_equal(m3.status, WIRE_STATUS_FAILED);
      check_layer_zero(&f, 0, rm[i].dst, 2); /* not one byte landed */
    } else {
      assert_int_equal(wait_final(s, 8000), KVF_POLL_SUCCESS);
      expect_success_m3(&f, rm[i].room, 7, NULL, 0);
      check_pages(&f, src, rm[i].dst, 2);
      assert_int_equal(kvf_engine_fence_close(f.eng, tag, epoch, 5000), 0);
    }
    kvf_sender_destroy(s);
  }
  expect_no_m3(&f, 100); /* one M3 per room */
  kvf_engine_stats es;
  kvf_engine_get_stats(f.eng, &es);
  assert_true(es.chunks_fenced >= 2);
  kvf_manager_stats st;
  kvf_manager_get_stats(f.m, &st);
  assert_int_equal(st.verify_failures, 0);
  assert_int_equal(f.digests_bad, 0);
  assert_int_equal(f.digests_ok, verify ? 3 * 2 * 2 : 0); /* the open rooms' pages, K and V; none refused */
  fx_teardown(&f);
  g_verify = 0;
  g_room_flags = 0;
  g_transport = NULL;
}

static void fence_refusal_fails_only_that_room(void **state) {
  (void)state;
  fence_refusal(0);
}

static void fence_refusal_fails_only_that_room_verify(void **state) {
  (void)state;
  fence_refusal(1);
}

/* Fan-out rooms (two decode ranks, as with MLA), every destination fenced:
 * the worker submits a room's last chunk while its window still holds the
 * earlier ones, and waits for them only after (workers.c,
 * last_passes_window). An earlier chunk fails there, with the last one
 * already out:
 *  - room 91: rank B's fence is closed before the room starts, so B refuses
 *    every chunk; the session is not marked failed (the decode gave up one
 *    room), so room 92 to both ranks, through the same path, succeeds;
 *  - room 93: B's second page is outside its buffer, so its engine refuses
 *    the second chunk, while the last chunk's writes to both ranks go
 *    through; here the last chunk's own outcomes are all good, and must not
 *    make a Success. (B's session is then marked failed, §7.4.)
 * Each failed room ends Failed with that chunk's reason and each rank gets
 * exactly one M3, Failed, and none after; once a rank has that M3 and closes
 * its fence, as a decode does, no byte of the room lands on it any more (the
 * last chunk's may have landed before). Over tcp, where a fenced chunk is
 * refused before any of its bytes lands. */
static void fanout_last_chunk_with_failed_window(void **state) {
  (void)state;
  g_transport = "tcp";
  fixture f, g;
  fx_setup(&f, "");
  fx_second_rank(&g, &f);
  fixture *rk[2] = {&f, &g}; /* ranks A and B, in the room's destination order */
  send_m1(&f);
  send_m1(&g);
  wait_received(&f, 2);
  g_required = 2;
  enum { FENCED, OK, OUTSIDE };
  const struct {
    int64_t room;
    int how;
    int64_t dst[2][4]; /* [rank]: one page a chunk */
  } rm[] = {{91, FENCED, {{0, 1, 2, 3}, {4, 5, 6, 7}}},
            {92, OK, {{8, 9, 10, 11}, {12, 13, 14, 15}}},
            {93, OUTSIDE, {{16, 17, 18, 19}, {20, NPAGES + 100, 22, 23}}}};
  int64_t src[] = {1, 3, 5, 7};
  for (int k = 0; k < 3; k++) {
    int64_t room = rm[k].room;
    uint64_t tag = manager_room_tag(room), epoch[2];
    for (int i = 0; i < 2; i++) assert_int_equal(kvf_engine_fence_open(rk[i]->eng, tag, &epoch[i]), 0);
    kvf_sender *s = new_sender(&f, room);
    g_fence_epoch = epoch[0];
    send_m2(&f, room, rm[k].dst[0], 4);
    wait_received(&f, 3 + 2 * (uint64_t)k);
    /* Queued together when B's M2 makes the room Bootstrapped, the chunks
     * reach the worker back to back: the three first stay in flight (the
     * window) and the last one is submitted before they are waited for. */
    for (int c = 0; c < 4; c++)
      assert_int_equal(send_chunk(s, src + c, 1, c == 3, c == 3 ? 0 : -1, c == 3 ? 7 : -1, NULL, 0, NULL, 0), 0);
    if (rm[k].how == FENCED) assert_int_equal(kvf_engine_fence_close(g.eng, tag, epoch[1], 5000), 0);
    g_fence_epoch = epoch[1];
    send_m2(&g, room, rm[k].dst[1], 4);
    g_fence_epoch = 0;
    wait_received(&f, 4 + 2 * (uint64_t)k);
    if (rm[k].how == OK) {
      assert_int_equal(wait_final(s, 8000), KVF_POLL_SUCCESS);
      for (int i = 0; i < 2; i++) {
        expect_success_m3(rk[i], room, 7, NULL, 0);
        check_pages(rk[i], src, rm[k].dst[i], 4);
        assert_int_equal(kvf_engine_fence_close(rk[i]->eng, tag, epoch[i], 5000), 0);
      }
      expect_no_m3(&f, 50);
      expect_no_m3(&g, 50);
      kvf_sender_destroy(s);
      continue;
    }
    /* Each rank, told of the failure, fences the room: from then on its
     * pages keep what they have. */
    uint8_t *snap[2][NKV_MAX];
    for (int i = 0; i < 2; i++) {
      wire_m3 m3;
      int32_t c[KVF_MAX_CANDIDATES];
      size_t nc;
      recv_m3(rk[i], &m3, c, &nc);
      assert_int_equal(m3.room, room);
      assert_int_equal(m3.status, WIRE_STATUS_FAILED);
      if (i == 0 || rm[k].how != FENCED) /* room 91: B's is closed already */
        assert_int_equal(kvf_engine_fence_close(rk[i]->eng, tag, epoch[i], 5000), 0);
      kvf_engine_sync(rk[i]->eng);
      for (int b = 0; b < NKV; b++) {
        snap[i][b] = malloc(NPAGES * ITEM);
        assert_non_null(snap[i][b]);
        memcpy(snap[i][b], rk[i]->dbuf[b], NPAGES * ITEM);
      }
    }
    assert_int_equal(wait_final(s, 8000), KVF_POLL_FAILED);
    char why[256], want[128];
    kvf_sender_failure(s, why, sizeof why);
    if (rm[k].how == FENCED) snprintf(want, sizeof want, "The decode fenced room %" PRId64, room);
    else
      snprintf(want, sizeof want, "Failed to send kv chunk of %" PRId64 " to 127.0.0.1:%u", room,
               (unsigned)g.pull_port);
    assert_non_null(strstr(why, want));
    expect_no_m3(&f, 300); /* one M3 each, no Success after it */
    expect_no_m3(&g, 50);
    assert_int_equal(kvf_sender_poll(s), KVF_POLL_FAILED);
    for (int i = 0; i < 2; i++) {
      kvf_engine_sync(rk[i]->eng);
      for (int b = 0; b < NKV; b++) {
        assert_memory_equal(rk[i]->dbuf[b], snap[i][b], NPAGES * ITEM);
        free(snap[i][b]);
      }
    }
    if (rm[k].how == FENCED) check_layer_zero(&g, 0, rm[k].dst[1], 4); /* B refused every chunk whole */
    kvf_sender_destroy(s);
  }
  kvf_engine_stats es;
  kvf_engine_get_stats(g.eng, &es);
  assert_true(es.chunks_fenced >= 1 && es.batches_refused >= 1);
  g_required = 1;
  kvf_manager_destroy(f.m);
  f.m = NULL;
  fx_rank_close(&g);
  fx_teardown(&f);
  g_transport = NULL;
}

/* Trailers a fake decode rank's engine received (the decode side's
 * completion-trailer callback, engine/async.h). */
static atomic_int g_trailers[2];

static void count_trailer(void *arg, const unsigned char *data, size_t len, const char *peer) {
  (void)data, (void)len, (void)peer;
  atomic_fetch_add((atomic_int *)arg, 1);
}

/* A chunk the sender cannot take (here: one more than PF_MAX_PENDING
 * waiting for the M2) fails the room with a reason, and the decode that
 * asks next hears Failed: a later chunk would otherwise take its place in
 * the index slice and the room could end Success without its pages. */
static void refused_chunk_fails_the_room(void **state) {
  (void)state;
  fixture f;
  fx_setup_tcp_registered(&f);
  kvf_sender *s = new_sender(&f, 97);
  int64_t page = 1;
  int rc = 0;
  size_t i = 0;
  for (; i <= PF_MAX_PENDING && !rc; i++) rc = send_chunk(s, &page, 1, 0, -1, -1, NULL, 0, NULL, 0);
  assert_int_equal(rc, KVF_ETOOBIG);
  assert_int_equal(i, PF_MAX_PENDING + 1);
  assert_int_equal(kvf_sender_poll(s), KVF_POLL_FAILED);
  char why[256];
  kvf_sender_failure(s, why, sizeof why);
  assert_non_null(strstr(why, "could not take a chunk"));
  int64_t dst[] = {0};
  send_m2(&f, 97, dst, 1);
  expect_failed_m3(&f, 97);
  kvf_sender_destroy(s);
  fx_teardown(&f);
  g_transport = NULL;
}

/* A decode session that registers again (M1) after asking for a room:
 * with the same buffers (a repeated M1) the room goes on; with other ones
 * (a decode restarted under the same session id) the room's page indices
 * name memory that is gone, so the room fails instead of writing there. */
static void reregistration_with_other_buffers_fails_earlier_requests(void **state) {
  (void)state;
  fixture f;
  fx_setup_tcp_registered(&f);
  int64_t src[] = {2, 4}, dst[] = {1, 3};
  for (int other = 0; other < 2; other++) {
    int64_t room = 110 + other;
    kvf_sender *s = new_sender(&f, room);
    send_m2(&f, room, dst, 2);
    wait_received(&f, 2 + 2 * (size_t)other);
    if (other) { /* the buffers swapped: the same memory, other addresses per buffer */
      uint8_t *t = f.dbuf[0];
      f.dbuf[0] = f.dbuf[1], f.dbuf[1] = t;
    }
    send_m1(&f);
    wait_received(&f, 3 + 2 * (size_t)other);
    assert_int_equal(send_chunk(s, src, 2, 1, 0, 7, NULL, 0, NULL, 0), 0);
    if (!other) {
      assert_int_equal(wait_final(s, 8000), KVF_POLL_SUCCESS);
      expect_success_m3(&f, room, 7, NULL, 0);
      check_pages(&f, src, dst, 2);
    } else {
      assert_int_equal(wait_final(s, 8000), KVF_POLL_FAILED);
      char why[256];
      kvf_sender_failure(s, why, sizeof why);
      assert_non_null(strstr(why, "registered other buffers"));
      expect_failed_m3(&f, room);
      uint8_t *t = f.dbuf[0];
      f.dbuf[0] = f.dbuf[1], f.dbuf[1] = t;
    }
    kvf_sender_destroy(s);
  }
  fx_teardown(&f);
  g_transport = NULL;
}

/* A trailer's M3 as the decode reads it (a copy taken in the engine's
 * callback: the bytes are the engine's only during the call). */
typedef struct {
  pthread_mutex_t mu;
  int n;
  unsigned char data[KVF_ENGINE_MAX_TRAILER];
  size_t len;
} trailer_copy;

static void copy_trailer(void *arg, const unsigned char *data, size_t len, const char *peer) {
  (void)peer;
  trailer_copy *t = arg;
  pthread_mutex_lock(&t->mu);
  if (len <= sizeof t->data) memcpy(t->data, data, len), t->len = len;
  t->n++;
  pthread_mutex_unlock(&t->mu);
}

/* The trailer names the fence epoch of the M2 it answers, as the M3 does
 * (frame 6): the decode drops one that its M3 overtook once the room id is
 * used again (e2e late_m3_of_an_earlier_use_does_not_complete_the_next). */
static void trailer_names_the_fence_epoch(void **state) {
  (void)state;
  g_transport = "tcp";
  fixture f;
  fx_setup(&f, "");
  trailer_copy t = {.mu = PTHREAD_MUTEX_INITIALIZER};
  assert_int_equal(kvf__engine_on_trailer(f.eng, copy_trailer, &t), 0);
  send_m1(&f);
  wait_received(&f, 1);
  uint64_t tag = manager_room_tag(96), epoch = 0;
  assert_int_equal(kvf_engine_fence_open(f.eng, tag, &epoch), 0);
  g_room_flags = WIRE_ROOM_FAST_COMPLETION;
  g_fence_epoch = epoch;
  int64_t src[] = {2, 4}, dst[] = {1, 3};
  kvf_sender *s = new_sender(&f, 96);
  send_m2(&f, 96, dst, 2);
  g_fence_epoch = 0;
  g_room_flags = 0;
  wait_received(&f, 2);
  assert_int_equal(send_chunk(s, src, 2, 1, 0, 7, NULL, 0, NULL, 0), 0);
  assert_int_equal(wait_final(s, 8000), KVF_POLL_SUCCESS);
  expect_success_m3(&f, 96, 7, NULL, 0);
  check_pages(&f, src, dst, 2);
  int got = 0;
  for (int64_t until = clock_deadline_ms(5000); !got && clock_now_ns() < until; sleep_ms(1)) {
    pthread_mutex_lock(&t.mu);
    got = t.n;
    pthread_mutex_unlock(&t.mu);
  }
  kvf__engine_off_trailer(f.eng, &t);
  assert_int_equal(t.n, 1);
  wire_frame fr[MANAGER_MAX_RECV_FRAMES];
  size_t n = 0, extra = 0;
  assert_int_equal(kvf__trailer_unpack(t.data, t.len, fr, MANAGER_MAX_RECV_FRAMES, &n, &extra), 0);
  wire_m3 m3;
  char why[WIRE_REASON_LEN];
  assert_int_equal(kvf__wire_m3_decode(fr, n, &m3, why), 0);
  assert_int_equal(m3.room, 96);
  assert_int_equal(m3.status, WIRE_STATUS_SUCCESS);
  assert_int_equal(m3.bootstrap_token, 7);
  assert_true(m3.fence_epoch == epoch);
  assert_int_equal(kvf_engine_fence_close(f.eng, tag, epoch, 5000), 0);
  kvf_sender_destroy(s);
  fx_teardown(&f);
  g_transport = NULL;
}

/* A decode session whose M2 comes once the room has every request it needs
 * (a restarted decode under a new session, a stray rank; here after the
 * first chunk landed) would miss the earlier chunks and never get its M3:
 * it is told Failed at once and nothing goes to it, and the room goes on
 * for the others, whose completion trailer still rides the data. Rank A
 * asks first (required_dst_info_num 1); B after A's first chunk landed. */
static void extra_destination_is_refused(void **state) {
  (void)state;
  g_transport = "tcp";
  fixture f, g;
  fx_setup(&f, "");
  fx_second_rank(&g, &f);
  fixture *rk[2] = {&f, &g};
  for (int i = 0; i < 2; i++) {
    atomic_store(&g_trailers[i], 0);
    assert_int_equal(kvf__engine_on_trailer(rk[i]->eng, count_trailer, &g_trailers[i]), 0);
  }
  send_m1(&f);
  send_m1(&g);
  wait_received(&f, 2);
  g_room_flags = WIRE_ROOM_FAST_COMPLETION;
  int64_t src[] = {1, 3, 5, 7}, dst[2][4] = {{0, 1, 2, 3}, {4, 5, 6, 7}};
  kvf_sender *s = new_sender(&f, 95);
  send_m2(&f, 95, dst[0], 4);
  wait_received(&f, 3);
  assert_int_equal(send_chunk(s, src, 2, 0, 0, -1, NULL, 0, NULL, 0), 0);
  kvf_engine_stats es = {0};
  for (int64_t until = clock_deadline_ms(5000); es.batches_received < 1 && clock_now_ns() < until; sleep_ms(1))
    kvf_engine_get_stats(f.eng, &es);
  assert_true(es.batches_received >= 1); /* A's first chunk landed: the room's chunks are being written */
  send_m2(&g, 95, dst[1], 4);
  expect_failed_m3(&g, 95);
  assert_non_null(strstr(g_last_reason, "required_dst_info_num"));
  assert_int_equal(send_chunk(s, src + 2, 2, 1, 0, 7, NULL, 0, NULL, 0), 0);
  assert_int_equal(wait_final(s, 8000), KVF_POLL_SUCCESS);
  expect_success_m3(&f, 95, 7, NULL, 0);
  check_pages(&f, src, dst[0], 4);
  kvf_engine_get_stats(g.eng, &es);
  assert_int_equal(es.batches_received, 0); /* nothing went to B */
  assert_int_equal(atomic_load(&g_trailers[0]), 1);
  assert_int_equal(atomic_load(&g_trailers[1]), 0);
  kvf_sender_destroy(s);
  g_room_flags = 0;
  for (int i = 0; i < 2; i++) kvf__engine_off_trailer(rk[i]->eng, &g_trailers[i]);
  kvf_manager_destroy(f.m);
  f.m = NULL;
  fx_rank_close(&g);
  fx_teardown(&f);
  g_transport = NULL;
}

static void abort_tells_decode(void **state) {
  (void)state;
  fixture f;
  fx_setup(&f, "");
  kvf_sender *s = new_sender(&f, 21);
  int64_t dst[] = {1};
  register_and_request(&f, 21, dst, 1);
  kvf_sender_abort(s, "scheduler gave up");
  assert_int_equal(kvf_sender_poll(s), KVF_POLL_FAILED);
  char why[128];
  kvf_sender_failure(s, why, sizeof why);
  assert_string_equal(why, "scheduler gave up");
  expect_failed_m3(&f, 21);
  kvf_sender_destroy(s);
  fx_teardown(&f);
}

/* A decode that asks only after the prefill ended its room hears Failed at
 * once, not at its own timeout: the room's sender destroyed before any M2
 * came (a request dropped early), or aborted while its sender lives, and a
 * repeat after that destroy. A sender created again for the same room id
 * serves it as any other; asked again after its Success, it answers Failed
 * to that request alone. */
static void late_m2_for_an_ended_room_fails_at_once(void **state) {
  (void)state;
  fixture f;
  fx_setup(&f, "");
  int64_t src[] = {0, 1}, dst[] = {4, 5};
  send_m1(&f);
  wait_received(&f, 1);
  kvf_sender *s = new_sender(&f, 31);
  kvf_sender_destroy(s);
  send_m2(&f, 31, dst, 2);
  assert_true(expect_failed_m3(&f, 31).reason_len > 0);

  s = new_sender(&f, 32);
  kvf_sender_abort(s, "scheduler gave up");
  send_m2(&f, 32, dst, 2);
  assert_true(expect_failed_m3(&f, 32).reason_len > 0);
  kvf_sender_destroy(s);
  send_m2(&f, 32, dst, 2);
  expect_failed_m3(&f, 32);

  s = new_sender(&f, 31);
  send_m2(&f, 31, dst, 2);
  int32_t cands[] = {5};
  assert_int_equal(send_chunk(s, src, 2, 1, 0, 9, cands, 1, NULL, 0), 0);
  assert_int_equal(wait_final(s, 5000), KVF_POLL_SUCCESS);
  expect_success_m3(&f, 31, 9, cands, 1);
  send_m2(&f, 31, dst, 2); /* asked again after Success: nothing will serve it */
  assert_true(expect_failed_m3(&f, 31).reason_len > 0);
  assert_int_equal(kvf_sender_poll(s), KVF_POLL_SUCCESS); /* the sender's own outcome stands */
  kvf_sender_destroy(s);
  expect_no_m3(&f, 200);
  fx_teardown(&f);
}

/* Teardown of a fixture with a second decode rank g (fx_second_rank). */
static void fx_teardown_two(fixture *f, fixture *g) {
  kvf_manager_destroy(f->m);
  f->m = NULL;
  fx_rank_close(g);
  zmq_close(f->push);
  fx_rank_close(f);
  zmq_ctx_term(f->zctx);
  for (int b = 0; b < NKV; b++) free(f->pbuf[b]);
}

/* Transfer requests that can never complete (§6.11 step 6 counts real
 * destinations against required_dst_info_num): one real decode and one
 * dummy, both counting 2. The room used to stay Bootstrapped for ever, its
 * real decode untold; it fails at once, and that decode hears it. */
static void dummy_counted_as_destination_fails_at_once(void **state) {
  (void)state;
  fixture f, g;
  fx_setup(&f, "");
  fx_second_rank(&g, &f);
  g_required = 2;
  kvf_sender *s = new_sender(&f, 35);
  int64_t dst[] = {1};
  send_m1(&f);
  send_m1(&g);
  send_m2(&f, 35, dst, 1);
  send_m2_dummy(&g, 35);
  wait_received(&f, 4);
  g_required = 1;
  assert_int_equal(kvf_sender_poll(s), KVF_POLL_FAILED);
  assert_true(expect_failed_m3(&f, 35).reason_len > 0);
  kvf_sender_destroy(s);
  fx_teardown_two(&f, &g);
}

/* A decode rank registered with another KV buffer count asks for a room
 * another rank already asked for: the room fails, and both hear it (the
 * first used to wait for its own timeout). */
static void mismatched_decode_fails_the_room_for_all(void **state) {
  (void)state;
  fixture f, g;
  fx_setup(&f, "");
  fx_second_rank(&g, &f);
  g_required = 2;
  kvf_sender *s = new_sender(&f, 36);
  int64_t dst[] = {1};
  send_m1(&f);
  send_m1_as(&g, g.session, NKV - 1);
  send_m2(&f, 36, dst, 1);
  wait_received(&f, 3);
  send_m2(&g, 36, dst, 1);
  wait_received(&f, 4);
  g_required = 1;
  assert_int_equal(wait_final(s, 3000), KVF_POLL_FAILED);
  assert_true(expect_failed_m3(&g, 36).reason_len > 0);
  assert_true(expect_failed_m3(&f, 36).reason_len > 0);
  kvf_sender_destroy(s);
  fx_teardown_two(&f, &g);
}

/* The registration table is bounded (PF_MAX_SESSIONS) and every decode
 * process that ever registered has a session (a restart, a new one): full,
 * it drops the one unused the longest for a new decode, instead of locking
 * new decodes out for good. A decode whose registration was dropped (or
 * never came) is answered Failed, in words a kvferry decode acts on. */
static void full_registration_table_drops_the_oldest(void **state) {
  (void)state;
  fixture f;
  fx_setup(&f, "");
  send_m1(&f); /* the oldest: dropped below */
  wait_received(&f, 1);
  char sess[64];
  for (int i = 1; i < 4096; i++) { /* decode processes that came and went */
    snprintf(sess, sizeof sess, "127.0.0.1:%d", i);
    send_m1_as(&f, sess, NKV);
  }
  wait_received(&f, 4096);
  send_m1_as(&f, "127.0.0.1:5000", NKV); /* a new decode: the table is full */
  wait_received(&f, 4097);
  int64_t src[] = {2}, dst[] = {1};
  send_m2(&f, 37, dst, 1); /* the fixture's session was dropped */
  expect_failed_m3(&f, 37);
  assert_non_null(strstr(g_last_reason, WIRE_REASON_UNREGISTERED));
  kvf_sender *s = new_sender(&f, 38);
  send_m1(&f); /* it registers again */
  send_m2(&f, 38, dst, 1);
  assert_int_equal(send_chunk(s, src, 1, 1, 0, -1, NULL, 0, NULL, 0), 0);
  assert_int_equal(wait_final(s, 5000), KVF_POLL_SUCCESS);
  expect_success_m3(&f, 38, -1, NULL, 0);
  kvf_sender_destroy(s);
  fx_teardown(&f);
}

/* A sender destroyed before its last chunk tells its decode Failed, with
 * the reason, instead of leaving it to its own timeout; one destroyed after
 * Success sends nothing more. */
static void destroy_before_last_chunk_tells_decode(void **state) {
  (void)state;
  fixture f;
  fx_setup(&f, "");
  kvf_sender *s = new_sender(&f, 23);
  int64_t src[] = {0, 1}, dst[] = {4, 5};
  register_and_request(&f, 23, dst, 2);
  assert_int_equal(send_chunk(s, src, 1, 0, 0, -1, NULL, 0, NULL, 0), 0); /* not the last */
  wait_chunks(&f, 1);
  kvf_sender_destroy(s);
  assert_true(expect_failed_m3(&f, 23).reason_len > 0);

  s = new_sender(&f, 24);
  register_and_request(&f, 24, dst, 2);
  int32_t cands[] = {5};
  assert_int_equal(send_chunk(s, src, 2, 1, 0, 9, cands, 1, NULL, 0), 0);
  assert_int_equal(wait_final(s, 5000), KVF_POLL_SUCCESS);
  expect_success_m3(&f, 24, 9, cands, 1);
  kvf_sender_destroy(s);
  expect_no_m3(&f, 200);
  fx_teardown(&f);
}

/* A sender destroyed while its last chunk is still being written: that
 * write still ends the room for its decodes, which would otherwise wait for
 * their own timeout (an M3-only decode, as tokenspeed's, gets no trailer).
 * Here the decode never accepts the connection: nothing comes while the
 * write may still land, and closing the socket fails the write, which tells
 * the decode Failed; one chunk (the direct path once the M2 is in) and two
 * (the worker path). */
static void destroy_with_last_chunk_in_flight_tells_decode(void **state) {
  (void)state;
  fixture f;
  fx_setup(&f, "");
  int64_t src[] = {0, 1, 2, 3}, dst[] = {3, 4, 5, 6};
  for (int chunks = 1; chunks <= 2; chunks++) {
    int64_t room = 40 + chunks;
    kvf_sender *s = NULL;
    int silent = silent_request(&f, room, dst, 4, &s);
    size_t first = chunks == 2 ? 2 : 0;
    if (first) assert_int_equal(send_chunk(s, src, first, 0, 0, -1, NULL, 0, NULL, 0), 0);
    assert_int_equal(send_chunk(s, src + first, 4 - first, 1, 0, 4, NULL, 0, NULL, 0), 0);
    sleep_ms(50); /* the chunk reaches its write, which waits for the connection */
    kvf_sender_destroy(s);
    expect_no_m3(&f, 100);
    close(silent);
    assert_true(expect_failed_m3(&f, room).reason_len > 0);
  }
  fx_teardown(&f);
}

/* Senders destroyed right after their last chunk, against a live decode:
 * whichever point the chunk had reached, the decode hears exactly one M3,
 * Success with the token when the write had begun (it lands), Failed with
 * the reason when the worker had not taken the chunk yet. Before, a
 * destroy that came before the write's end left the decode to its timeout. */
static void destroy_right_after_last_chunk_ends_room(void **state) {
  (void)state;
  fixture f;
  fx_setup(&f, "");
  int64_t src[] = {0, 1, 2, 3}, dst[] = {3, 4, 5, 6};
  int32_t cands[] = {8};
  int success = 0, failed = 0;
  for (int i = 0; i < 20; i++) {
    int64_t room = 60 + i;
    kvf_sender *s = new_sender(&f, room);
    uint64_t got = stat_received(&f);
    send_m1(&f);
    send_m2(&f, room, dst, 4);
    if (i % 2) wait_received(&f, got + 2); /* else the chunks may still wait for the M2 (pending) */
    assert_int_equal(send_chunk(s, src, 2, 0, 0, -1, NULL, 0, NULL, 0), 0);
    assert_int_equal(send_chunk(s, src + 2, 2, 1, 0, 7, cands, 1, NULL, 0), 0);
    wait_received(&f, got + 2); /* the decode told of the room ... */
    kvf_sender_destroy(s);      /* ... then the sender goes */
    wire_m3 m3;
    int32_t gc[KVF_MAX_CANDIDATES];
    size_t ng = 0;
    recv_m3(&f, &m3, gc, &ng);
    assert_int_equal(m3.room, room);
    if (m3.status == WIRE_STATUS_SUCCESS) {
      assert_int_equal(m3.bootstrap_token, 7);
      assert_int_equal(ng, 1);
      success++;
    } else {
      assert_int_equal(m3.status, WIRE_STATUS_FAILED);
      assert_true(m3.reason_len > 0);
      failed++;
    }
  }
  expect_no_m3(&f, 200);
  printf("destroyed right after the last chunk: %d Success, %d Failed\n", success, failed);
  fx_teardown(&f);
}

/* Senders created and destroyed, some with chunks pending or queued. */
static void many_senders(void **state) {
  (void)state;
  fixture f;
  fx_setup(&f, "");
  send_m1(&f);
  wait_received(&f, 1);
  int64_t src[] = {1, 2};
  for (int i = 0; i < 1000; i++) {
    kvf_sender *s = NULL;
    assert_int_equal(kvf_sender_create(f.m, 1000 + i, &s), 0);
    if (i % 3 == 0) assert_int_equal(send_chunk(s, src, 2, 0, -1, -1, NULL, 0, NULL, 0), 0);
    /* rooms whose writes may overlap in time land on different pages */
    int64_t dst[] = {2 * (i / 10 % (NPAGES / 2)), 2 * (i / 10 % (NPAGES / 2)) + 1};
    if (i % 10 == 0) {
      send_m2(&f, 1000 + i, dst, 2); /* may arrive before or after the destroy */
      assert_int_equal(send_chunk(s, src, 2, 0, -1, -1, NULL, 0, NULL, 0), 0);
    }
    kvf_sender_destroy(s);
  }
  kvf_manager_stats st;
  kvf_manager_get_stats(f.m, &st);
  assert_int_equal(st.live_rooms, 0);
  /* and the same ids are usable again */
  kvf_sender *s = new_sender(&f, 1000);
  kvf_sender_destroy(s);
  fx_teardown(&f);
}

/* Appendix A in layerwise mode, interval 1: 2 MHA layers [K0 K1 V0 V1],
 * prefill pages [20, 21, 25] onto decode pages [7, 8, 9]. Layer 0 lands
 * alone and reports nothing; layer 1 with is_last completes the room with
 * exactly one M3 Success carrying the token and candidates (A.6). */
static void layerwise_appendix_a(void **state) {
  (void)state;
  g_nkv = 4;
  fixture f;
  fx_setup(&f, "");
  int64_t room = 7215963401LL;
  kvf_sender *s = new_sender(&f, room);
  int64_t src[] = {20, 21, 25}, dst[] = {7, 8, 9};
  register_and_request(&f, room, dst, 3);
  /* §6.11 bounds: a layer range past the 2 KV layers, or reversed */
  assert_int_equal(send_layers(s, src, 3, 0, 0, 3, 0, -1, -1, NULL, 0, NULL, 0), KVF_EINVAL);
  assert_int_equal(send_layers(s, src, 3, 0, 2, 1, 0, -1, -1, NULL, 0, NULL, 0), KVF_EINVAL);
  assert_int_equal(send_layers(s, src, 3, 0, 2, 3, 1, 3, -1, NULL, 0, NULL, 0), KVF_EINVAL);
  assert_int_equal(send_layers(NULL, src, 3, 0, 0, 1, 0, -1, -1, NULL, 0, NULL, 0), KVF_EINVAL);

  assert_int_equal(send_layers(s, src, 3, 0, 0, 1, 0, -1, -1, NULL, 0, NULL, 0), 0);
  wait_chunks(&f, 1);
  check_layer(&f, 0, src, dst, 3);
  check_layer_zero(&f, 1, dst, 3);
  expect_no_m3(&f, 100);
  assert_int_equal(kvf_sender_poll(s), KVF_POLL_BOOTSTRAPPED);

  int32_t cands[] = {1734, 2211, 90};
  assert_int_equal(send_layers(s, src, 3, 0, 1, 2, 1, 3, 1734, cands, 3, NULL, 0), 0);
  assert_int_equal(wait_final(s, 5000), KVF_POLL_SUCCESS);
  expect_success_m3(&f, room, 1734, cands, 3);
  check_layer(&f, 0, src, dst, 3);
  check_layer(&f, 1, src, dst, 3);
  expect_no_m3(&f, 100); /* exactly one */
  kvf_manager_stats st;
  kvf_manager_get_stats(f.m, &st);
  assert_int_equal(st.chunks_sent, 2);
  assert_int_equal(st.bytes_sent, 3 * ITEM * 4);
  assert_int_equal(send_layers(s, src, 1, 0, 0, 1, 1, 3, -1, NULL, 0, NULL, 0), KVF_ESTATE);
  kvf_sender_destroy(s);
  fx_teardown(&f);
  g_nkv = 2;
}

/* The §6.9 example: page 16, decode_prefix_len 32, prompt 100, forward
 * chunks of 48 tokens. Chunk A -> pages [2,3) slice [0,1), B -> [3,6)
 * slice [1,4), C -> [6,7) slice [4,5); each sent layer by layer, the last
 * layer of C with is_last. index_begin is already after the prefix: no
 * page is skipped again, and the prefix pages go nowhere. */
/* A hybrid model, 2 KV layers and one state buffer per layer: a layerwise
 * chunk that carries the state slot writes its layer group's state with its
 * KV, byte for byte, and leaves the other group's state alone until that
 * group's chunk (the last) goes. The same in verify mode, where the decode
 * also gets the digests of both (7 entries a chunk: 3 pages x K, V from the
 * send-time page digests, and the state slot's block), each matching what
 * landed. */
static void state_with_layer_group(int verify) {
  g_nkv = 4;
  g_nstate = 2;
  g_verify = verify;
  g_room_flags = verify ? WIRE_ROOM_VERIFY : 0;
  fixture f;
  fx_setup(&f, "");
  int64_t room = 88;
  kvf_sender *s = new_sender(&f, room);
  int64_t src[] = {3, 4, 9}, dst[] = {10, 11, 12}, pslot[] = {2}, dslot[] = {1};
  send_m1(&f);
  send_m2_full(&f, room, dst, 3, 0, dslot, 1);
  wait_received(&f, 2);
  uint8_t zero[STATE_ITEM] = {0};

  assert_int_equal(send_layers(s, src, 3, 0, 0, 1, 0, -1, -1, NULL, 0, pslot, 1), 0);
  wait_chunks(&f, 1);
  check_layer(&f, 0, src, dst, 3);
  check_layer_zero(&f, 1, dst, 3);
  assert_memory_equal(f.dstate[0] + dslot[0] * STATE_ITEM, f.pstate[0] + pslot[0] * STATE_ITEM, STATE_ITEM);
  assert_memory_equal(f.dstate[1] + dslot[0] * STATE_ITEM, zero, STATE_ITEM); /* layer 1's: not yet */
  expect_no_m3(&f, 50);

  assert_int_equal(send_layers(s, src, 3, 0, 1, 2, 1, 0, 5, NULL, 0, pslot, 1), 0);
  assert_int_equal(wait_final(s, 5000), KVF_POLL_SUCCESS);
  expect_success_m3(&f, room, 5, NULL, 0);
  check_layer(&f, 1, src, dst, 3);
  kvf_engine_sync(f.eng);
  for (int j = 0; j < 2; j++)
    assert_memory_equal(f.dstate[j] + dslot[0] * STATE_ITEM, f.pstate[j] + pslot[0] * STATE_ITEM, STATE_ITEM);
  for (int j = 0; j < 2; j++) /* the other slots stay untouched */
    for (int k = 0; k < STATE_SLOTS; k++)
      if (k != dslot[0]) assert_memory_equal(f.dstate[j] + k * STATE_ITEM, zero, STATE_ITEM);
  kvf_manager_stats st;
  kvf_manager_get_stats(f.m, &st);
  assert_int_equal(st.bytes_sent, 3 * ITEM * 4 + 2 * STATE_ITEM);
  assert_int_equal(st.verify_failures, 0);
  assert_int_equal(f.digests_bad, 0);
  assert_int_equal(f.digests_ok, verify ? 2 * (3 * 2 + 1) : 0);
  kvf_sender_destroy(s);
  fx_teardown(&f);
  g_nkv = 2;
  g_nstate = 0;
  g_verify = 0;
  g_room_flags = 0;
}

static void layerwise_state_with_layer_group(void **state) {
  (void)state;
  state_with_layer_group(0);
}

static void layerwise_state_with_layer_group_verify(void **state) {
  (void)state;
  state_with_layer_group(1);
}

static void layerwise_windows(void **state) {
  (void)state;
  g_nkv = 4;
  g_page_size = 16;
  fixture f;
  fx_setup(&f, "");
  kvf_sender *s = new_sender(&f, 77);
  int64_t occupied[] = {10, 11, 12, 13, 14, 15, 16}; /* ceil(100 / 16) pages */
  int64_t dst[] = {20, 3, 4, 5, 30};                 /* the decode's pages after its prefix */
  send_m1(&f);
  send_m2_prefix(&f, 77, dst, 5, 32);
  wait_received(&f, 2);
  const struct { size_t start, end; } win[] = {{2, 3}, {3, 6}, {6, 7}};
  const size_t pp = 2;
  for (int c = 0; c < 3; c++)
    for (size_t l = 0; l < 2; l++) {
      int last = c == 2 && l == 1;
      assert_int_equal(send_layers(s, occupied + win[c].start, win[c].end - win[c].start, win[c].start - pp, l,
                                   l + 1, last, last ? 0 : -1, last ? 5 : -1, NULL, 0, NULL, 0),
                       0);
    }
  assert_int_equal(wait_final(s, 5000), KVF_POLL_SUCCESS);
  expect_success_m3(&f, 77, 5, NULL, 0);
  check_layer(&f, 0, occupied + pp, dst, 5);
  check_layer(&f, 1, occupied + pp, dst, 5);
  int64_t others[] = {0, 1, 2, 6, 10, 11, 12};
  check_layer_zero(&f, 0, others, 7);
  check_layer_zero(&f, 1, others, 7);
  assert_int_equal(stat_chunks(&f), 6);
  expect_no_m3(&f, 50);
  kvf_sender_destroy(s);
  fx_teardown(&f);
  g_page_size = 1;
  g_nkv = 2;
}

/* §6.2: an empty non-last chunk (no pages, or no layers) is skipped; an
 * empty last chunk still completes the room. */
static void layerwise_empty_chunks(void **state) {
  (void)state;
  g_nkv = 4;
  fixture f;
  fx_setup(&f, "");
  kvf_sender *s = new_sender(&f, 88);
  int64_t src[] = {1, 2}, dst[] = {5, 6};
  register_and_request(&f, 88, dst, 2);
  assert_int_equal(send_layers(s, NULL, 0, 0, 0, 2, 0, -1, -1, NULL, 0, NULL, 0), 0);
  assert_int_equal(send_layers(s, src, 2, 0, 1, 1, 0, -1, -1, NULL, 0, NULL, 0), 0);
  assert_int_equal(send_layers(s, src, 2, 0, 0, 2, 0, -1, -1, NULL, 0, NULL, 0), 0);
  wait_chunks(&f, 1);
  assert_int_equal(kvf_sender_poll(s), KVF_POLL_BOOTSTRAPPED);
  assert_int_equal(send_layers(s, NULL, 0, 2, 0, 0, 1, 0, 8, NULL, 0, NULL, 0), 0);
  assert_int_equal(wait_final(s, 5000), KVF_POLL_SUCCESS);
  expect_success_m3(&f, 88, 8, NULL, 0);
  check_layer(&f, 0, src, dst, 2);
  check_layer(&f, 1, src, dst, 2);
  assert_int_equal(stat_chunks(&f), 2);
  kvf_sender_destroy(s);
  fx_teardown(&f);
  g_nkv = 2;
}

/* ---- first-token hand-off (KVF_SEND_TOKEN_LATER, kvf_sender_set_metadata) ---- */

/* Layerwise: the last layer group lands before sampling; the M3 and Success
 * wait for the token, which then rides on the M3. Published twice: the
 * first wins. */
static void token_after_landing(void **state) {
  (void)state;
  g_nkv = 4;
  fixture f;
  fx_setup(&f, "");
  kvf_sender *s = new_sender(&f, 61);
  int64_t src[] = {3, 4}, dst[] = {10, 11};
  register_and_request(&f, 61, dst, 2);
  int32_t ignored[] = {5};
  assert_int_equal(send_layers(s, src, 2, 0, 0, 1, 0, -1, -1, NULL, 0, NULL, 0), 0);
  assert_int_equal(send_layers(s, src, 2, 0, 1, 2, 1, 0, TOKEN_LATER, ignored, 1, NULL, 0), 0);
  wait_chunks(&f, 2);
  check_layer(&f, 0, src, dst, 2);
  check_layer(&f, 1, src, dst, 2);
  expect_no_m3(&f, 150);
  assert_int_equal(kvf_sender_poll(s), KVF_POLL_BOOTSTRAPPED);
  int32_t cands[] = {7, 8};
  assert_int_equal(kvf_sender_set_metadata(s, -3, NULL, 0), KVF_EINVAL);
  assert_int_equal(kvf_sender_set_metadata(s, 4242, NULL, 1), KVF_EINVAL);
  assert_int_equal(kvf_sender_set_metadata(s, 4242, cands, 2), 0);
  assert_int_equal(kvf_sender_poll(s), KVF_POLL_SUCCESS);
  expect_success_m3(&f, 61, 4242, cands, 2);
  assert_int_equal(kvf_sender_set_metadata(s, 1, NULL, 0), KVF_EEXIST);
  expect_no_m3(&f, 100); /* exactly one */
  kvf_sender_destroy(s);
  fx_teardown(&f);
  g_nkv = 2;
}

/* Published before the last chunk landed (here before the M2 even came):
 * kept and used when the chunk lands. */
static void token_before_landing(void **state) {
  (void)state;
  fixture f;
  fx_setup(&f, "");
  kvf_sender *s = new_sender(&f, 62);
  int64_t src[] = {1, 2, 3}, dst[] = {4, 5, 6};
  assert_int_equal(send_chunk(s, src, 3, 1, 0, TOKEN_LATER, NULL, 0, NULL, 0), 0);
  int32_t cands[] = {9};
  assert_int_equal(kvf_sender_set_metadata(s, 17, cands, 1), 0);
  assert_int_equal(kvf_sender_poll(s), KVF_POLL_BOOTSTRAPPING);
  send_m1(&f);
  send_m2(&f, 62, dst, 3);
  assert_int_equal(wait_final(s, 5000), KVF_POLL_SUCCESS);
  expect_success_m3(&f, 62, 17, cands, 1);
  check_pages(&f, src, dst, 3);
  kvf_sender_destroy(s);
  fx_teardown(&f);
}

/* Never published: the reference waits forever; kvferry fails the room
 * bootstrap_timeout_s after the KV landed and tells the decode. */
static void token_never_published(void **state) {
  (void)state;
  setenv("TOKENSPEED_DISAGGREGATION_BOOTSTRAP_TIMEOUT", "1", 1);
  fixture f;
  fx_setup(&f, "");
  unsetenv("TOKENSPEED_DISAGGREGATION_BOOTSTRAP_TIMEOUT");
  kvf_sender *s = new_sender(&f, 63);
  int64_t src[] = {1}, dst[] = {2};
  register_and_request(&f, 63, dst, 1);
  assert_int_equal(send_chunk(s, src, 1, 1, 0, TOKEN_LATER, NULL, 0, NULL, 0), 0);
  wait_chunks(&f, 1);
  int64_t t0 = clock_now_ns();
  assert_int_equal(wait_final(s, 4000), KVF_POLL_FAILED);
  assert_true(clock_now_ns() - t0 >= 500000000LL);
  char why[256];
  kvf_sender_failure(s, why, sizeof why);
  assert_string_equal(why, "Request 63: first token not published within 1.0s after its KV landed");
  assert_int_equal(expect_failed_m3(&f, 63).bootstrap_token, -1);
  /* a late publication changes nothing and sends nothing */
  assert_int_equal(kvf_sender_set_metadata(s, 5, NULL, 0), 0);
  assert_int_equal(kvf_sender_poll(s), KVF_POLL_FAILED);
  expect_no_m3(&f, 100);
  kvf_sender_destroy(s);
  fx_teardown(&f);
}

/* Waiting rooms destroyed, aborted or cleared: no crash, nothing leaked,
 * an abort tells the decode once, a cleared room is KVF_ENOTFOUND. */
static void token_wait_ends(void **state) {
  (void)state;
  fixture f;
  fx_setup(&f, "");
  /* each room its own destination page: their writes may land at once */
  int64_t src[] = {1}, dst[] = {2, 3, 4};
  send_m1(&f);
  wait_received(&f, 1);
  kvf_sender *s[3] = {NULL, NULL, NULL};
  for (int i = 0; i < 3; i++) {
    assert_int_equal(kvf_sender_create(f.m, 64 + i, &s[i]), 0);
    send_m2(&f, 64 + i, &dst[i], 1);
    assert_int_equal(send_chunk(s[i], src, 1, 1, 0, TOKEN_LATER, NULL, 0, NULL, 0), 0);
  }
  wait_chunks(&f, 3);
  expect_no_m3(&f, 100);
  kvf_sender_destroy(s[0]); /* destroyed while waiting: its decode hears Failed */
  expect_failed_m3(&f, 64);
  kvf_sender_abort(s[1], "gave up");
  expect_failed_m3(&f, 65);
  assert_int_equal(kvf_sender_poll(s[1]), KVF_POLL_FAILED);
  assert_int_equal(kvf_sender_set_metadata(s[1], 3, NULL, 0), 0);
  expect_no_m3(&f, 100);
  assert_int_equal(kvf__rooms_clear(f.m->rooms, 66, NULL), 0);
  assert_int_equal(kvf_sender_set_metadata(s[2], 3, NULL, 0), KVF_ENOTFOUND);
  kvf_sender_destroy(s[1]);
  kvf_sender_destroy(s[2]);
  /* the id is usable again, and a new room knows nothing of the old one */
  kvf_sender *t = NULL;
  assert_int_equal(kvf_sender_create(f.m, 64, &t), 0);
  send_m2(&f, 64, dst, 1);
  assert_int_equal(send_chunk(t, src, 1, 1, 0, 11, NULL, 0, NULL, 0), 0);
  assert_int_equal(wait_final(t, 5000), KVF_POLL_SUCCESS);
  expect_success_m3(&f, 64, 11, NULL, 0);
  kvf_sender_destroy(t);
  fx_teardown(&f);
}

static void registers_with_bootstrap(void **state) {
  (void)state;
  kvf_bootstrap_server_config bc;
  kvf_bootstrap_server_config_init(&bc);
  bc.host = "127.0.0.1";
  bc.port = 0;
  bc.auth_token = "";
  kvf_bootstrap_server *srv = NULL;
  assert_int_equal(kvf_bootstrap_server_create(&bc, &srv), 0);
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%u", (unsigned)kvf_bootstrap_server_port(srv));
  fixture f;
  fx_setup(&f, addr);
  /* the rank is now findable: GET the rank lookup */
  bootstrap_client *c = NULL;
  assert_int_equal(kvf__bootstrap_client_create(addr, NULL, &c), 0);
  char ip[64];
  int port = 0;
  assert_int_equal(kvf__bootstrap_client_get_rank(c, 0, 0, ip, sizeof ip, &port), 0);
  assert_string_equal(ip, "127.0.0.1");
  assert_int_equal(port, f.m->rank_port);
  kvf__bootstrap_client_destroy(c);
  fx_teardown(&f);
  kvf_bootstrap_server_destroy(srv);
  /* an unreachable bootstrap server fails manager creation */
  setenv("KVFERRY_BOOTSTRAP_TIMEOUT_MS", "200", 1);
  uint64_t lens[1] = {ITEM}, items[1] = {ITEM};
  uint8_t buf[ITEM];
  void *ptrs[1] = {buf};
  kvf_kv_buffers bufs = {.n_kv = 1, .kv_ptrs = ptrs, .kv_lens = lens, .kv_item_lens = items};
  kvf_manager_config cfg;
  kvf_manager_config_init(&cfg);
  cfg.role = KVF_ROLE_PREFILL;
  cfg.bootstrap_addr = addr; /* stopped above */
  cfg.http_timeout_ms = 200;
  kvf_manager *m = NULL;
  assert_int_not_equal(kvf_manager_create(&cfg, &bufs, &m), 0);
  assert_null(m);
  unsetenv("KVFERRY_BOOTSTRAP_TIMEOUT_MS");
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(one_chunk),
      cmocka_unit_test(event_fd_wakes_the_scheduler),
      cmocka_unit_test(silent_decode_holds_only_its_room),
      cmocka_unit_test(silent_decodes_hold_only_their_rooms_on_workers),
      cmocka_unit_test(token_major_slices),
      cmocka_unit_test(candidate_limit),
      cmocka_unit_test(send_params_checked),
      cmocka_unit_test(many_chunks),
      cmocka_unit_test(early_rooms_in_stats),
      cmocka_unit_test(early_rooms_bounded_in_bytes),
      cmocka_unit_test(idle_early_rooms_dropped_without_m2s),
      cmocka_unit_test(chunk_waits_for_m2),
      cmocka_unit_test(decode_prefix_skipped),
      cmocka_unit_test(bootstrap_timeout),
      cmocka_unit_test(malformed_and_unregistered),
      cmocka_unit_test(forged_m1_m2_from_other_host),
      cmocka_unit_test(refused_write_fails_room),
      cmocka_unit_test(refused_write_in_window_fails_room),
      cmocka_unit_test(abort_tells_decode),
      cmocka_unit_test(late_m2_for_an_ended_room_fails_at_once),
      cmocka_unit_test(full_registration_table_drops_the_oldest),
      cmocka_unit_test(dummy_counted_as_destination_fails_at_once),
      cmocka_unit_test(mismatched_decode_fails_the_room_for_all),
      cmocka_unit_test(destroy_before_last_chunk_tells_decode),
      cmocka_unit_test(destroy_with_last_chunk_in_flight_tells_decode),
      cmocka_unit_test(destroy_right_after_last_chunk_ends_room),
      cmocka_unit_test(many_senders),
      cmocka_unit_test(layerwise_appendix_a),
      cmocka_unit_test(layerwise_windows),
      cmocka_unit_test(layerwise_empty_chunks),
      cmocka_unit_test(registers_with_bootstrap),
      cmocka_unit_test(layerwise_state_with_layer_group),
      cmocka_unit_test(layerwise_state_with_layer_group_verify),
      cmocka_unit_test(fence_refusal_fails_only_that_room),
      cmocka_unit_test(fence_refusal_fails_only_that_room_verify),
      cmocka_unit_test(fanout_last_chunk_with_failed_window),
      cmocka_unit_test(extra_destination_is_refused),
      cmocka_unit_test(trailer_names_the_fence_epoch),
      cmocka_unit_test(refused_chunk_fails_the_room),
      cmocka_unit_test(reregistration_with_other_buffers_fails_earlier_requests),
      cmocka_unit_test(token_after_landing),
      cmocka_unit_test(token_before_landing),
      cmocka_unit_test(token_never_published),
      cmocka_unit_test(token_wait_ends),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

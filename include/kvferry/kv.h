/*
 * KV managers: the decode side (receivers) and the prefill side (senders) of
 * the tokenspeed "mooncake" PD protocol. One manager per rank owns a transfer
 * engine, a ZMQ PULL socket and the room table. A room is one request's KV
 * transfer; a receiver (decode) or sender (prefill) is its handle.
 *
 * Threads. A manager runs its own threads (control listener; decode:
 * heartbeat; prefill: transfer workers). Every call may be made from any
 * thread, with two rules: calls on one handle (a kvf_receiver or kvf_sender)
 * must not overlap, i.e. a handle is used by one thread at a time (in
 * tokenspeed that is the scheduler's loop, but any thread will do); and
 * kvf_manager_destroy comes after every handle of the manager is destroyed
 * and no other call on it is in progress. Calls on different handles, and
 * the manager's getters, may run concurrently. Calls that block, and for how
 * long at most:
 *   kvf_manager_create    prefill: PUT /route to the bootstrap server,
 *                         retried within 3 x http_timeout_ms
 *   kvf_manager_destroy   joins its threads; a transfer in flight ends within
 *                         the engine's timeout_ms
 *   kvf_receiver_create   on a cache miss, HTTP GETs to the bootstrap server
 *                         (parallel info, then each target rank's address;
 *                         each bounded by http_timeout_ms), then one ZMQ
 *                         send of M1 per target rank (1 s send timeout each);
 *                         after such a lookup timed out, creates for that
 *                         bootstrap address fail at once, with the same
 *                         reason, for one heartbeat_interval_s
 *   kvf_receiver_init     one ZMQ send of M2 per target rank (1 s each)
 *   kvf_sender_set_metadata, kvf_sender_poll, kvf_sender_abort
 *                         may send M3s: one ZMQ send per decode destination
 *                         (1 s each)
 * Every other call returns without waiting on the network; sends are queued
 * to the manager's transfer workers.
 *
 * Polls. kvf_receiver_poll and kvf_sender_poll return the room's state, a
 * kvf_poll_status (the spec's TransferPoll values), never an error code.
 */
#ifndef KVFERRY_KV_H
#define KVFERRY_KV_H

#include "kvferry/common.h"
#include "kvferry/engine.h"

#ifdef __cplusplus
extern "C" {
#endif

/* A room's state: the spec's TransferPoll values (docs/PROTOCOL.md §2.1), also
 * the status numbers on the wire. Not an error code: FAILED is 0. Success
 * and Failed are final, with one exception on a decode: when one kvferry
 * prefill rank writes to several decode ranks (a fan-out, e.g. MLA), each
 * rank reaches Success as soon as its own bytes are in place, and a rank
 * that has Success still turns Failed when another rank's write fails the
 * room (Failed overrides, as in the reference, §2.2). Its own pages are
 * then whole; combine the ranks' polls (tokenspeed takes their minimum) to
 * decide about the request. */
typedef enum kvf_poll_status {
  KVF_POLL_FAILED = 0,
  KVF_POLL_BOOTSTRAPPING = 1,
  KVF_POLL_BOOTSTRAPPED = 2,
  KVF_POLL_WAITING_FOR_INPUT = 3,
  KVF_POLL_TRANSFERRING = 4,
  KVF_POLL_SUCCESS = 5,
} kvf_poll_status;

enum { KVF_ROLE_PREFILL = 0, KVF_ROLE_DECODE = 1 };

/* Most speculative candidate ids one room carries (one M3). Both sides use
 * this one limit: a sender refuses more (KVF_ETOOBIG), a decode drops an M3
 * with more. */
#define KVF_MAX_CANDIDATES 64

/* The rank's buffers. KV buffer i holds pages of kv_item_lens[i] bytes from
 * kv_ptrs[i] (kv_lens[i] bytes in all). Layers: layer l uses the buffers
 * layer_bufs[layer_buf_start[l] .. layer_buf_start[l+1]); when layer_buf_start
 * is NULL the MHA layout is assumed: n_kv/2 layers, layer l = {l, n_kv/2 + l}.
 * unit lens (bytes of one head of one token) may be NULL (= 1). All arrays
 * are copied at manager creation. */
typedef struct kvf_kv_buffers {
  size_t n_kv;
  void *const *kv_ptrs;
  const uint64_t *kv_lens;
  const uint64_t *kv_item_lens;
  const uint64_t *kv_unit_lens;
  size_t n_layers;
  const uint32_t *layer_buf_start; /* n_layers + 1 entries, or NULL */
  const uint32_t *layer_bufs;
  size_t n_state;
  void *const *state_ptrs;
  const uint64_t *state_lens;
  const uint64_t *state_item_lens;
  const uint64_t *state_unit_lens;
} kvf_kv_buffers;

/* Options of kvf_manager_create. Always start from kvf_manager_config_init:
 * it sets `size`, which lets later library versions add fields at the end
 * without breaking programs built against these headers. */
typedef struct kvf_manager_config {
  size_t size;                         /* sizeof(kvf_manager_config), set by kvf_manager_config_init */
  int role;                            /* KVF_ROLE_PREFILL or KVF_ROLE_DECODE */
  const char *host;                    /* local IP for the engine, PULL socket and adverts; default 127.0.0.1 */
  int engine_rank;                     /* global rank in its instance; default 0 */
  int world_size;                      /* default 1 */
  int dp_size;                         /* default 1; tp = world_size / dp_size */
  int page_size;                       /* tokens per page (for decode_prefix_len); default 1 */
  int is_mla;                          /* MLA backend (legacy MLA routing); default 0 */
  const char *bootstrap_addr;          /* prefill: "host:port" of its bootstrap server (PUT /route) */
  const char *bootstrap_token;         /* prefill: bearer token for PUT /route; NULL = $KVFERRY_BOOTSTRAP_TOKEN */
  kvf_engine *engine;                  /* optional shared engine (not owned); NULL = create one */
  const kvf_engine_config *engine_cfg; /* for the engine created when `engine` is NULL; NULL = defaults
                                          with `host` above; read only during kvf_manager_create */
  /* Timeouts and sizes; <= 0 picks the default, then TOKENSPEED_DISAGGREGATION_* env overrides. */
  double bootstrap_timeout_s;  /* sender in Bootstrapping; default 120 */
  double waiting_timeout_s;    /* receiver waiting for the transfer after init; default 300 */
  double heartbeat_interval_s; /* decode; default 5, at least 2 */
  int heartbeat_max_failures;  /* decode; default 2, at least 1 */
  double failed_session_ttl_s; /* prefill; default 30 (env value 0 disables) */
  int queue_size;              /* prefill transfer queues/workers; default 4 */
  int http_timeout_ms;         /* bootstrap HTTP calls; default 5000 */
  size_t max_rooms;            /* live-room bound; default 1<<20 */
  /* Decode: KV layers [0, target_layer_num) of the layer layout are the
   * target model's, the rest the draft model's (the reference's
   * KVArgs.target_layer_num): heterogeneous-TP plans label the latter's
   * fragments draft_k/draft_v. 0 (default) = every layer is a target layer. */
  size_t target_layer_num;
  /* Shared secret that authenticates every control message (M1/M2/M3) with an
   * HMAC frame (docs/WIRE-EXTENSIONS.md); every kvferry peer of the deployment
   * must use the same one, and tokenspeed peers cannot join while it is set.
   * NULL = $KVFERRY_CONTROL_TOKEN; "" (or unset) = off. */
  const char *control_token;
  /* Prefill, hybrid models: the KV layer index (< n_layers) of each state
   * buffer, kvf_kv_buffers.n_state entries, read only during
   * kvf_manager_create; NULL (default) = none. A layerwise chunk
   * (KVF_SEND_LAYERS) that carries state slots writes the state buffers of
   * its layer range [layer_begin, layer_end), so state goes with its layer
   * group; without ids it writes every state buffer. */
  const uint32_t *state_layer_ids;
  /* Decode: ask kvferry prefills to send each room's completion on the
   * engine connection right behind its last bytes (M2 frame 15,
   * docs/WIRE-EXTENSIONS.md), so Success needs no control-plane hop; the M3
   * still comes and tokenspeed prefills ignore the request. Default 1; 0 =
   * completion by M3 only. */
  int fast_completion;
  /* Verify mode (issue 16; docs/WIRE-EXTENSIONS.md "Integrity"): 1 = a
   * prefill hashes (XXH3-64) every page it sends when kvf_sender_send is
   * called, rehashes it after the write completed and fails the room if it
   * changed (a page reused too early; when the decode checks the send-time
   * digests, this recheck runs after the decode was told Success and
   * decides the sender's status only), and sends the digests of what it
   * wrote to decodes that asked; a decode asks (M2) and recomputes the
   * digests over the landed bytes before Success, failing the room with the
   * buffer and page on a mismatch. Default 0; env KVFERRY_VERIFY=1 turns it
   * on. Host memory only: kvf_manager_create refuses it (KVF_EINVAL) when
   * a buffer is not readable host memory (device memory). */
  int verify;
  /* Room traces (issue 25, include/kvferry/trace.h, docs/TRACE.md): the
   * finished rooms kept in the manager's ring, allocated once at create;
   * 0 = off (nothing recorded, no KVFERRY_TRACE lines, no histograms in
   * kvf_manager_metrics). Default 1024; env KVFERRY_TRACE_ROOMS overrides.
   * Added after KVF_MANAGER_CONFIG_SIZE_V1: a program built against older
   * headers gets the default. */
  size_t trace_rooms;
  /* Both roles: a control (ZeroMQ PUSH) socket to a peer that carried no
   * message for this long is closed, and the peer's end of the connection
   * with it; the next message to that peer connects again (a TCP and ZMTP
   * handshake). An open pair costs about 54 KiB over both processes, most
   * of what an idle peer costs. Default 30 s (0 picks it); negative = never
   * close; env KVFERRY_CONTROL_IDLE_S (seconds, 0 = never) overrides.
   * Added after trace_rooms, like it. */
  double control_idle_s;
} kvf_manager_config;
/* The size of the first published kvf_manager_config (up to verify), the
 * smallest `size` accepted (see KVF_ENGINE_CONFIG_SIZE_V1). */
#define KVF_MANAGER_CONFIG_SIZE_V1 \
  (offsetof(kvf_manager_config, verify) + sizeof(((kvf_manager_config *)0)->verify))

typedef struct kvf_manager kvf_manager;
typedef struct kvf_receiver kvf_receiver;
typedef struct kvf_sender kvf_sender;

typedef struct kvf_manager_stats {
  uint64_t messages_received;     /* control messages accepted */
  uint64_t messages_malformed;    /* rejected by the codecs (logged once per peer) */
  uint64_t messages_unknown_room; /* for a room not live here: dropped */
  uint64_t live_rooms;
  uint64_t chunks_sent; /* prefill: chunks written and confirmed */
  uint64_t bytes_sent;
  uint64_t heartbeat_failures; /* decode: failed probes */
  uint64_t node_failures;      /* decode: prefill instances declared dead */
  uint64_t messages_forged;    /* from a peer the room was not planned with, or a missing/wrong MAC: dropped */
  uint64_t verify_failures;    /* verify mode: rooms failed by a digest mismatch (decode) or a source
                                   page that changed during its transfer (prefill) */
  uint64_t verify_unverified;  /* decode, verify mode: Success reports from a prefill that sent no
                                   digests (a tokenspeed prefill): the room succeeded unverified */
  uint64_t rooms_fenced;       /* decode: failed or dropped rooms whose late writes are now refused */
  /* the room table (both roles; live_rooms above is its live count) */
  uint64_t rooms_created;             /* rooms made live: receivers / senders created */
  uint64_t rooms_cleared;             /* live rooms removed: receivers / senders destroyed */
  uint64_t rooms_early;               /* prefill, now: rooms whose M2 came before their sender */
  uint64_t rooms_early_dropped;       /* prefill: such rooms dropped without a sender (expired) */
  uint64_t rooms_rejected_full;       /* creations refused at max_rooms live rooms */
  uint64_t rooms_dropped_unknown;     /* status changes for a room not live here: dropped */
  uint64_t rooms_rejected_invalid;    /* status reports with a bad status, rank or candidate count */
  uint64_t rooms_duplicate_responses; /* decode: Success reports from a prefill rank already counted */
} kvf_manager_stats;

/* Fill `cfg` with the defaults above and set cfg->size. Any thread. */
KVF_API void kvf_manager_config_init(kvf_manager_config *cfg);
/* Set the field called `name` (e.g. "waiting_timeout_s", "role" as 0/1 or
 * "prefill"/"decode") from its text form, as kvf_engine_config_set does
 * (strings are not copied). The pointer fields `engine` and `engine_cfg`
 * are set directly or with kvf_manager_config_set_ptr. 0, KVF_ENOTFOUND,
 * KVF_EINVAL. Any thread, on a cfg no other thread uses. */
KVF_API int kvf_manager_config_set(kvf_manager_config *cfg, const char *name, const char *value);
/* Set the pointer field `name` ("engine", "engine_cfg" or
 * "state_layer_ids"), for bindings.
 * 0, KVF_ENOTFOUND, KVF_EINVAL. Any thread, on a cfg no other thread uses. */
KVF_API int kvf_manager_config_set_ptr(kvf_manager_config *cfg, const char *name, void *value);

/* Create a manager for one rank: engine (or the shared one), buffer
 * registration, PULL socket and listener thread; prefill: PUT /route to its
 * bootstrap server (retried within http_timeout_ms * 3) and transfer
 * workers; decode: heartbeat thread. `cfg` and `bufs` are only read during
 * the call; KVF_EINVAL if cfg was not set up by kvf_manager_config_init. On
 * failure nothing stays registered in a shared engine. The caller owns *out
 * (kvf_manager_destroy). Any thread. */
KVF_API int kvf_manager_create(const kvf_manager_config *cfg, const kvf_kv_buffers *bufs, kvf_manager **out);
/* Stop threads, close sockets, free rooms, unregister the buffers it
 * registered. Every handle must be destroyed first. NULL ok. Any thread, as
 * the last call on the manager. */
KVF_API void kvf_manager_destroy(kvf_manager *m);
/* The engine's session id "ip:port"; owned by the manager. Any thread. */
KVF_API const char *kvf_manager_session_id(const kvf_manager *m);
/* The manager's engine (its own or the shared one); borrowed, valid while
 * the manager lives. Any thread. */
KVF_API kvf_engine *kvf_manager_engine(kvf_manager *m);
/* Copy the manager's counters into *out. Any thread. */
KVF_API void kvf_manager_get_stats(kvf_manager *m, kvf_manager_stats *out);
/* The same counters as Prometheus text, one line per kvf_manager_stats
 * field: kvferry_manager_<field>{role="prefill",session="ip:port"} <value>
 * (no HELP/TYPE lines, so the lines of several managers can share a page,
 * e.g. a bootstrap server's GET /metrics through
 * kvf_bootstrap_server_add_metrics), then, while room traces are on
 * (trace_rooms > 0), the room histograms of docs/TRACE.md, each with its
 * "# TYPE" line and the same labels. Writes whole lines only, at most
 * cap - 1 bytes, NUL-terminated when cap > 0; returns the bytes written.
 * Any thread. */
KVF_API size_t kvf_manager_metrics(kvf_manager *m, char *buf, size_t cap);
/* A file descriptor that becomes readable when one of this manager's rooms
 * may have changed state: a receiver or sender room reached Success or
 * Failed, or changed status on the way, or a failed sender room's last
 * transfer ended (what kvf_sender_poll waits for). A scheduler sleeps on it
 * (poll, epoll, an asyncio reader, beside its other descriptors) instead of
 * spinning on the polls, and wakes at once when there is news. It stays
 * readable until kvf_manager_event_clear. Use: clear, poll the rooms, then
 * wait on the fd (with a timeout: the waiting and bootstrap timeouts are
 * applied by the polls, not by events); a change after the clear leaves
 * the fd readable, so none is missed. Made on the first call (until then
 * changes cost nothing more); owned by the manager, closed with it. The fd,
 * or KVF_ENOMEM / KVF_EINVAL. Any thread. */
KVF_API int kvf_manager_event_fd(kvf_manager *m);
/* Make the event fd unreadable until the next change. Any thread. */
KVF_API void kvf_manager_event_clear(kvf_manager *m);

/* ---- decode side ---- */

/* Create the receiver for `room` from the prefill instance whose bootstrap
 * server is `bootstrap_addr` ("host:port"): parallel-info and rank lookups
 * (cached), M1 registration once per target set. BLOCKS on a cache miss:
 * HTTP lookups, each bounded by http_timeout_ms, and a ZMQ send per target
 * (see Threads above). Never fails because of the peer: a lookup failure
 * leaves the receiver Failed with a reason. KVF_EINVAL for an empty address
 * or one longer than KVF_ADDR_MAX; KVF_EEXIST if the room is already live on
 * this manager. The caller owns *out (kvf_receiver_destroy). Any
 * thread. */
KVF_API int kvf_receiver_create(kvf_manager *m, const char *bootstrap_addr, int64_t room, kvf_receiver **out);
/* Send M2: destination pages (after the decode prefix), request-pool slot,
 * decode_prefix_len in tokens, optional state slots (arrays only read during
 * the call). Starts the waiting timeout. A send failure fails the room (with
 * a reason) and still returns 0. Called again, a new request in the same
 * room: a kvferry prefill's answers to the earlier one no longer count, and
 * one whose writes for the room had begun fails it. With a tokenspeed
 * prefill nothing tells the two apart: reuse a room id only once its
 * earlier request's status can no longer arrive. The receiver's thread. */
KVF_API int kvf_receiver_init(kvf_receiver *r, const int64_t *pages, size_t npages, int64_t aux_index,
                              int64_t decode_prefix_len, const int64_t *state_slots, size_t nstate);
/* The room's current state; Success and Failed are final. Fails the room
 * when the waiting timeout has passed. The receiver's thread.
 *
 * Reusing the pages (fencing, issue 16). When this call returns Failed
 * for a room whose prefill is a kvferry prefill on the TCP engine, the
 * room's engine fence is already closed: from then on no byte of any write
 * for this room lands in the pages, so they may be given to another request
 * at once; the prefill is told and its sender ends Failed. The first such
 * call may block up to ~100 ms (a write in progress is cut at its next
 * receive tick; at most 2 s in all if a receiving thread is stuck). After
 * Success every write has landed and nothing more comes. Against a
 * tokenspeed prefill (its engine is not kvferry's, or it sends no fence
 * epoch) nothing can be refused: a late write can land until that prefill's
 * own transfer timeout, so do not reuse the pages of a Failed room before
 * then (see docs/WIRE-EXTENSIONS.md). Over UCX (a kvferry prefill whose
 * engine writes into this decode one-sided, kvf_engine_peer_transport) the
 * decode cannot refuse a write: the first Failed call tells every prefill
 * engine connected over UCX and waits until each confirmed that it writes
 * nothing more for the room and flushed what it had posted (about one round
 * trip plus that flush), so the same guarantee holds when it returns. A
 * prefill that does not confirm within 2 s (stopped, hung) is cut off and
 * the failure to fence is logged ("could not fence late writes"): it starts
 * no new write for the room when it runs again, but what it had already
 * posted may land then, so reuse those pages only once that prefill process
 * is gone (kvf_engine_fence_close). Otherwise never blocks: the notice that
 * tells a kvferry prefill of the Failed room is dropped, not waited for,
 * when that prefill does not drain its queue (the fence holds without it). */
KVF_API kvf_poll_status kvf_receiver_poll(kvf_receiver *r);
/* Copy the failure reason (empty if none) into buf (cap bytes, always
 * terminated). The receiver's thread. */
KVF_API void kvf_receiver_failure(kvf_receiver *r, char *buf, size_t cap);
/* After Success: the first token (-1 none) and up to cap speculative ids
 * (*ncand set; 0 none; KVF_MAX_CANDIDATES always suffices). Pops: a second
 * call returns -1 / 0. The receiver's thread. */
KVF_API int kvf_receiver_pop_metadata(kvf_receiver *r, int64_t *token, int32_t *cands, size_t cap, size_t *ncand);
/* The route plan's supports_remote_spec_candidates (the reference's
 * receiver attribute): 1 for identity and legacy-MLA plans, 0 for
 * fragmented (heterogeneous-TP) ones, whose speculative ids the reference's
 * decode scheduler ignores. KVF_ESTATE when construction failed (no plan).
 * The receiver's thread. */
KVF_API int kvf_receiver_supports_spec(const kvf_receiver *r);
/* Clear the room from every table and free the handle. A room that is not
 * Success is failed and fenced first, as kvf_receiver_poll does (the same
 * short wait), so its pages may be reused once this returns (same limits
 * as above for a tokenspeed prefill). NULL ok. The receiver's thread, as
 * its last call. */
KVF_API void kvf_receiver_destroy(kvf_receiver *r);

/* ---- prefill side ---- */

/* Create the sender for `room` (Bootstrapping until every expected decode
 * rank has sent its M2). KVF_EEXIST if live. The caller owns *out
 * (kvf_sender_destroy). Never blocks. Any thread. */
KVF_API int kvf_sender_create(kvf_manager *m, int64_t room, kvf_sender **out);

/* Flags of kvf_send_params. */
enum {
  /* This chunk ends the room: it carries the aux index, the first token,
   * speculative ids and state slots (state buffers go with it); Success and
   * the decode's M3 come only after it landed. */
  KVF_SEND_LAST = 1u << 0,
  /* With KVF_SEND_LAST: the first token will come through
   * kvf_sender_set_metadata (PROTOCOL §6.9, §6.11 metadata wait; layerwise
   * sends the last layer group before sampling). bootstrap_token and the
   * candidates of this chunk are then ignored. */
  KVF_SEND_TOKEN_LATER = 1u << 1,
  /* Layerwise (PROTOCOL §6.9, the reference's send_layerwise): only the KV
   * of layers [layer_begin, layer_end), written from destination index
   * index_begin on. */
  KVF_SEND_LAYERS = 1u << 2,
};

/* One chunk for kvf_sender_send. Start from kvf_send_params_init (it sets
 * `size`, so later versions can add fields at the end, and the defaults:
 * no flags, aux_index -1, bootstrap_token -1, no arrays). Arrays are only
 * read during the call.
 *
 * Without KVF_SEND_LAYERS the pages are mapped onto the decode's destination
 * pages in order, after its decode_prefix_len pages, continuing where the
 * previous chunk stopped; index_begin and the layer range are ignored.
 *
 * With KVF_SEND_LAYERS only layers [layer_begin, layer_end) of the `npages`
 * prefill pages are written. index_begin is the position of pages[0] in the
 * decode's destination page list, i.e. already after the decode's prefix
 * (§6.9 index_slice = [start - pp, end - pp)): no decode_prefix_len pages are
 * skipped, the caller has done it. The sender's running index becomes
 * max(current, index_begin + npages); do not mix layerwise and whole-page
 * chunks in one room. Call it as each layer group's KV is written: kvferry
 * has no device step counter (§6.10), the readiness wait is the caller's, so
 * the library never waits on the device (§8 item 2). The same pages may be
 * sent once per layer group. A non-last chunk with no pages or no layers is
 * skipped (§6.2) and returns 0. A last chunk may have an empty layer range;
 * a room's chunks are written in submission order, so every earlier layer
 * group has landed when the last one has. */
typedef struct kvf_send_params {
  size_t size;          /* sizeof(kvf_send_params), set by kvf_send_params_init */
  uint32_t flags;       /* KVF_SEND_LAST | KVF_SEND_TOKEN_LATER | KVF_SEND_LAYERS */
  const int64_t *pages; /* prefill page indices */
  size_t npages;
  size_t index_begin;      /* KVF_SEND_LAYERS: destination index of pages[0] */
  size_t layer_begin;      /* KVF_SEND_LAYERS: first layer */
  size_t layer_end;        /* KVF_SEND_LAYERS: one past the last layer */
  int64_t aux_index;       /* last chunk: the request-pool slot; -1 none */
  int64_t bootstrap_token; /* last chunk: the first token, -1 none */
  const int32_t *cands;    /* last chunk: speculative ids, at most KVF_MAX_CANDIDATES */
  size_t ncand;
  const int64_t *state_slots; /* last chunk, or (KVF_SEND_LAYERS) the chunk of the state's layer group:
                                 state slots (see kvf_manager_config.state_layer_ids) */
  size_t nstate;
} kvf_send_params;
/* The size of the first published kvf_send_params (up to nstate), the
 * smallest `size` accepted (see KVF_ENGINE_CONFIG_SIZE_V1). */
#define KVF_SEND_PARAMS_SIZE_V1 (offsetof(kvf_send_params, nstate) + sizeof(((kvf_send_params *)0)->nstate))

/* Fill *p with the defaults above and set p->size. Any thread. */
KVF_API void kvf_send_params_init(kvf_send_params *p);

/* Submit a chunk (see kvf_send_params). A chunk sent before the decode's M2
 * arrived waits for it (bounded by the bootstrap timeout). Does not wait
 * for the transfer: a room's only chunk (up to 16 MiB, its M2s in) is
 * planned and handed to the engine on this thread, which may put a small
 * one on the socket itself; other chunks are queued to the transfer
 * workers; poll for the outcome.
 * Errors: KVF_EINVAL (NULL array with a count, unknown flag, TOKEN_LATER
 * without LAST, bootstrap_token < -1, layer_begin > layer_end or layer_end
 * past the KV layer count, a params struct not set up by
 * kvf_send_params_init); KVF_ETOOBIG (more than KVF_MAX_CANDIDATES
 * candidates, lists or index_begin past the wire limits, too many chunks
 * waiting for the M2, the transfer queue full); KVF_ENOMEM; KVF_ESTATE after
 * the last chunk. A chunk refused for lack of room (waiting for the M2, the
 * queue full, no memory) fails the room with a reason and its decodes are
 * told: a later chunk would otherwise take its place and the room could
 * end Success without its pages. The sender's thread. */
KVF_API int kvf_sender_send(kvf_sender *s, const kvf_send_params *p);

/* Publish the room's first token (-1 none) and speculative ids (the
 * reference's set_prefill_metadata) for a last chunk sent with
 * KVF_SEND_TOKEN_LATER. Once that chunk has landed on every destination,
 * this sends the M3 Success with them and makes the room Success; published
 * earlier, they are kept and used when the chunk lands. While the room
 * waits, kvf_sender_poll bounds the wait (the reference waits forever, §8
 * item 2): bootstrap_timeout_s after the chunk landed it fails the room
 * ("Request <R>: first token not published within <X>s after its KV
 * landed") and sends M3 Failed. 0; KVF_EEXIST if already published (the
 * first wins); KVF_ENOTFOUND if the room is no longer known; KVF_EINVAL;
 * KVF_ETOOBIG (more than KVF_MAX_CANDIDATES). The sender's thread. */
KVF_API int kvf_sender_set_metadata(kvf_sender *s, int64_t bootstrap_token, const int32_t *cands, size_t ncand);
/* The decode destinations known so far (the reference's
 * transfer_infos[room]): M2s received from real (*nreal) and dummy (*ndummy)
 * destinations, and the decode_prefix_len (tokens) of the first real one (0
 * when none). 0; KVF_ENOTFOUND if the room is gone. Any thread. */
KVF_API int kvf_sender_dest_info(kvf_sender *s, size_t *nreal, size_t *ndummy, int64_t *decode_prefix_len);
/* The room's current state; Success and Failed are final. Applies the
 * bootstrap and token-wait timeouts. Failed is reported once no transfer of
 * the room may still read its source pages (a failed room's other writes
 * end within the engine's timeout_ms, or its read lease in UCX read mode):
 * from Success or Failed on, the pages may be reused. The sender's thread. */
KVF_API kvf_poll_status kvf_sender_poll(kvf_sender *s);
/* Copy the failure reason (empty if none) into buf (cap bytes, always
 * terminated). The sender's thread. */
KVF_API void kvf_sender_failure(kvf_sender *s, char *buf, size_t cap);
/* Fail the room with `reason` and tell every known decode destination; a
 * decode whose M2 comes later is told Failed when it comes (the reason
 * too), also after kvf_sender_destroy (below). The sender's thread. */
KVF_API void kvf_sender_abort(kvf_sender *s, const char *reason);
/* Clear the room and free the handle; chunks not yet written are dropped
 * (one being written finishes on its worker, still reading its source
 * pages). A room not final whose last chunk was never sent, or still waited
 * for the room's M2s, or whose token was never published, is reported
 * Failed to its decodes (M3, as by kvf_sender_abort), which would otherwise
 * wait for their own timeout; so is a decode whose M2 comes after the
 * destroy (the prefill keeps the last 4096 such room ids for the waiting
 * timeout; a new sender for the same id takes its id off). A last chunk
 * already being written still ends the room for its decodes: M3 Success
 * with its token when the write lands, Failed when it fails or was dropped
 * before it began.
 * So reuse the pages of a sender destroyed before it was final only
 * once that write can have ended (the engine's timeout_ms); or abort it
 * (kvf_sender_abort) and poll until Failed first, as when another TP rank's
 * sender of the same request failed. NULL ok. The sender's thread, as its
 * last call. */
KVF_API void kvf_sender_destroy(kvf_sender *s);

#ifdef __cplusplus
}
#endif
#endif

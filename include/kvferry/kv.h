/*
 * KV managers: the decode side (receivers) and the prefill side (senders) of
 * the tokenspeed "mooncake" PD protocol. One manager per rank owns a transfer
 * engine, a ZMQ PULL socket and the room table. Poll values are numerically
 * the spec's TransferPoll values.
 */
#ifndef KVFERRY_KV_H
#define KVFERRY_KV_H

#include "kvferry/common.h"
#include "kvferry/engine.h"

#ifdef __cplusplus
extern "C" {
#endif

/* TransferPoll values (PROTOCOL.md §2.1). */
enum {
  KVF_POLL_FAILED = 0,
  KVF_POLL_BOOTSTRAPPING = 1,
  KVF_POLL_BOOTSTRAPPED = 2,
  KVF_POLL_WAITING_FOR_INPUT = 3,
  KVF_POLL_TRANSFERRING = 4,
  KVF_POLL_SUCCESS = 5,
};

enum { KVF_ROLE_PREFILL = 0, KVF_ROLE_DECODE = 1 };

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

typedef struct kvf_manager_config {
  int role;                   /* KVF_ROLE_PREFILL or KVF_ROLE_DECODE */
  const char *host;           /* local IP for the engine, PULL socket and adverts; default 127.0.0.1 */
  int engine_rank;            /* global rank in its instance; default 0 */
  int world_size;             /* default 1 */
  int dp_size;                /* default 1; tp = world_size / dp_size */
  int page_size;              /* tokens per page (for decode_prefix_len); default 1 */
  int is_mla;                 /* MLA backend (legacy MLA routing); default 0 */
  const char *bootstrap_addr; /* prefill: "host:port" of its bootstrap server (PUT /route) */
  const char *bootstrap_token;/* prefill: bearer token for PUT /route; NULL = $KVFERRY_BOOTSTRAP_TOKEN */
  kvf_engine *engine;         /* optional shared engine (not owned); NULL = create one */
  kvf_engine_config engine_cfg; /* used when engine is NULL */
  /* Timeouts and sizes; <= 0 picks the default, then TOKENSPEED_DISAGGREGATION_* env overrides. */
  double bootstrap_timeout_s;   /* sender in Bootstrapping; default 120 */
  double waiting_timeout_s;     /* receiver waiting for the transfer after init; default 300 */
  double heartbeat_interval_s;  /* decode; default 5, at least 2 */
  int heartbeat_max_failures;   /* decode; default 2, at least 1 */
  double failed_session_ttl_s;  /* prefill; default 30 (env value 0 disables) */
  int queue_size;               /* prefill transfer queues/workers; default 4 */
  int http_timeout_ms;          /* bootstrap HTTP calls; default 5000 */
  size_t max_rooms;             /* live-room bound; default 1<<20 */
  /* Shared secret that authenticates every control message (M1/M2/M3) with an
   * HMAC frame (docs/WIRE-EXTENSIONS.md); every kvferry peer of the deployment
   * must use the same one, and tokenspeed peers cannot join while it is set.
   * NULL = $KVFERRY_CONTROL_TOKEN; "" (or unset) = off. */
  const char *control_token;
} kvf_manager_config;

typedef struct kvf_manager kvf_manager;
typedef struct kvf_receiver kvf_receiver;
typedef struct kvf_sender kvf_sender;

typedef struct kvf_manager_stats {
  uint64_t messages_received;   /* control messages accepted */
  uint64_t messages_malformed;  /* rejected by the codecs (logged once per peer) */
  uint64_t messages_unknown_room; /* for a room not live here: dropped */
  uint64_t live_rooms;
  uint64_t chunks_sent;         /* prefill: chunks written and confirmed */
  uint64_t bytes_sent;
  uint64_t heartbeat_failures;  /* decode: failed probes */
  uint64_t node_failures;       /* decode: prefill instances declared dead */
  uint64_t messages_forged;     /* from a peer the room was not planned with, or a missing/wrong MAC: dropped */
} kvf_manager_stats;

void kvf_manager_config_init(kvf_manager_config *cfg);

/* Create a manager for one rank: engine (or the shared one), buffer
 * registration, PULL socket and listener thread; prefill: PUT /route to its
 * bootstrap server (retried within http_timeout_ms * 3) and transfer
 * workers; decode: heartbeat thread. The caller owns *out. Any thread. */
int kvf_manager_create(const kvf_manager_config *cfg, const kvf_kv_buffers *bufs, kvf_manager **out);
/* Stop threads, close sockets, free rooms and handles' state. Handles must
 * be destroyed first. NULL ok. */
void kvf_manager_destroy(kvf_manager *m);
/* The engine's session id "ip:port"; owned by the manager. */
const char *kvf_manager_session_id(const kvf_manager *m);
kvf_engine *kvf_manager_engine(kvf_manager *m);
void kvf_manager_get_stats(kvf_manager *m, kvf_manager_stats *out);

/* ---- decode side ---- */

/* Create the receiver for `room` from the prefill instance whose bootstrap
 * server is `bootstrap_addr` ("host:port"): parallel-info and rank lookups
 * (cached), M1 registration once per target set. Never fails because of the
 * peer: a lookup failure leaves the receiver Failed with a reason. Fails
 * (KVF_EEXIST) if the room is already live on this manager. Scheduler thread. */
int kvf_receiver_create(kvf_manager *m, const char *bootstrap_addr, int64_t room, kvf_receiver **out);
/* Send M2: destination pages (after the decode prefix), request-pool slot,
 * decode_prefix_len in tokens, optional state slots. Starts the waiting timeout. */
int kvf_receiver_init(kvf_receiver *r, const int64_t *pages, size_t npages, int64_t aux_index,
                      int64_t decode_prefix_len, const int64_t *state_slots, size_t nstate);
/* Current KVF_POLL_* value; Success/Failed are final. */
int kvf_receiver_poll(kvf_receiver *r);
/* Copy the failure reason (empty if none). */
void kvf_receiver_failure(kvf_receiver *r, char *buf, size_t cap);
/* After Success: the first token (-1 none) and up to cap speculative ids
 * (*ncand set; 0 none). Pops: a second call returns -1 / 0. */
int kvf_receiver_pop_metadata(kvf_receiver *r, int64_t *token, int32_t *cands, size_t cap, size_t *ncand);
/* Clear the room from every table and free the handle. NULL ok. */
void kvf_receiver_destroy(kvf_receiver *r);

/* ---- prefill side ---- */

/* Create the sender for `room` (Bootstrapping until every expected decode
 * rank has sent its M2). KVF_EEXIST if live. Scheduler thread. */
int kvf_sender_create(kvf_manager *m, int64_t room, kvf_sender **out);
/* Submit a chunk: prefill page indices (mapped onto the decode's pages in
 * order), is_last, and on the last chunk the first token (-1 none),
 * speculative ids and state slots. A chunk sent before the decode's M2
 * arrived waits for it (bounded by the bootstrap timeout). */
int kvf_sender_send(kvf_sender *s, const int64_t *pages, size_t npages, int is_last, int64_t aux_index,
                    int64_t bootstrap_token, const int32_t *cands, size_t ncand,
                    const int64_t *state_slots, size_t nstate);
/* Layerwise send (PROTOCOL §6.9, the reference's send_layerwise): submit the
 * KV of layer indices [layer_begin, layer_end) only, for `npages` prefill
 * pages. index_begin is the position of pages[0] in the decode's
 * destination page list, i.e. already after the decode's prefix (§6.9
 * index_slice = [start - pp, end - pp)): unlike kvf_sender_send, no
 * decode_prefix_len pages are skipped here, the caller has done it. The
 * sender's running index becomes max(current, index_begin + npages); do not
 * mix this call with kvf_sender_send in one room.
 *
 * Call it as each layer group's KV is written: kvferry has no device step
 * counter (§6.10), the readiness wait is the caller's, so the library never
 * waits on the device (§8 item 2). The same pages may be sent once per layer
 * group. A non-last chunk with no pages or no layers is skipped (§6.2) and
 * returns 0. The chunk with is_last set ends the room: it carries the
 * aux index, first token (-1 none), speculative ids and state slots (state
 * buffers go with it), and Success and the decode's M3 come only after it
 * landed; a room's chunks are written in submission order, so every earlier
 * layer group has landed by then. A last chunk may have an empty layer
 * range. KVF_EINVAL if layer_begin > layer_end or layer_end exceeds the KV
 * layer count; KVF_ETOOBIG for lists (or index_begin) past the wire limits;
 * KVF_ESTATE after the last chunk. */
int kvf_sender_send_layers(kvf_sender *s, const int64_t *pages, size_t npages, size_t index_begin,
                           size_t layer_begin, size_t layer_end, int is_last, int64_t aux_index,
                           int64_t bootstrap_token, const int32_t *cands, size_t ncand,
                           const int64_t *state_slots, size_t nstate);

/* bootstrap_token value for the last chunk (kvf_sender_send or
 * kvf_sender_send_layers): "the first token will come through
 * kvf_sender_set_metadata" (PROTOCOL §6.9, §6.11 metadata wait; layerwise
 * sends the last layer group before sampling). The chunk's candidates are
 * then ignored. -1 still means "no token": the M3 carries -1 at once. */
#define KVF_TOKEN_LATER (-2)

/* Publish the room's first token (-1 none) and speculative ids (the
 * reference's set_prefill_metadata). Once the KVF_TOKEN_LATER last chunk has
 * landed on every destination, this sends the M3 Success with them and makes
 * the room Success; published earlier, they are kept and used when the chunk
 * lands. While the room waits, kvf_sender_poll bounds the wait (the reference
 * waits forever, §8 item 2): bootstrap_timeout_s after the chunk landed it
 * fails the room ("Request <R>: first token not published within <X>s after
 * its KV landed") and sends M3 Failed. 0; KVF_EEXIST if already published
 * (the first wins); KVF_ENOTFOUND if the room is no longer known; KVF_EINVAL,
 * KVF_ETOOBIG (ncand past the wire limit). Scheduler thread. */
int kvf_sender_set_metadata(kvf_sender *s, int64_t bootstrap_token, const int32_t *cands, size_t ncand);
int kvf_sender_poll(kvf_sender *s);
void kvf_sender_failure(kvf_sender *s, char *buf, size_t cap);
/* Fail the room with `reason` and tell every known decode destination. */
void kvf_sender_abort(kvf_sender *s, const char *reason);
void kvf_sender_destroy(kvf_sender *s);

#ifdef __cplusplus
}
#endif
#endif

/* Transfer planning, pure arithmetic shared by both managers: which prefill
 * ranks a decode rank pulls from and which byte ranges of each page (the
 * route plan, PROTOCOL §5.2, §6.5), and how a list of page pairs turns into
 * the kvf_write blocks the engine executes (§6.4, §6.5.6), plus the two
 * small routing functions of §0/§1.1 (DP group) and §6.12 (queue shard).
 *
 * Nothing here locks, logs or keeps state; every function may be called from
 * any thread. Functions on the per-chunk path (kvf__plan_runs, plan_*_writes)
 * never allocate: callers size their arrays once per room with the *_count
 * functions. Addresses are checked against buffer lengths where the caller
 * knows them, because a page index from the network must never steer a write
 * outside a buffer (§8 item 8). Functions return 0 or a negative KVF_E* code;
 * output parameters are set only on success, except that the contents of
 * caller arrays are unspecified after a failure. */
#ifndef KVF_KV_PLAN_H
#define KVF_KV_PLAN_H

#include <stddef.h>
#include <stdint.h>

#include "kvferry/common.h"
#include "kvferry/engine.h"
#include "wire/messages.h"

/* Largest TP size the planner accepts on either side. */
#define PLAN_MAX_TP 4096

/* ---- Page runs (§6.4) ---- */

/* A maximal run: src pages s0..s0+len-1 map to dst pages d0..d0+len-1. */
typedef struct plan_run {
  int64_t src;
  int64_t dst;
  int64_t len;
} plan_run;

/* Group the aligned pairs (src[k], dst[k]), k < n, into maximal runs in which
 * both sides step by exactly +1. `out` must hold n entries (the worst case);
 * *nruns gets the count. A negative index is KVF_ERANGE. */
int kvf__plan_runs(const int64_t *src, const int64_t *dst, size_t n, plan_run *out, size_t *nruns);

/* ---- Buffers ---- */

/* Which buffers belong to each KV layer index (`offsets` of §6.1), in CSR
 * form: layer l owns bufs[start[l] .. start[l+1]). MHA: {l, L+l}; MLA: {l}.
 * The same uint32_t arrays as kvf_kv_buffers' layer_buf_start/layer_bufs,
 * so the manager keeps its layer map once and points a layout into it. */
typedef struct plan_layout {
  size_t nlayers;
  const uint32_t *start; /* nlayers + 1 entries, start[0] == 0 */
  const uint32_t *bufs;  /* start[nlayers] buffer indices */
} plan_layout;

/* The layout of n_kv buffers when the caller gives none (kvf_kv_buffers
 * without layer_buf_start): an even count is MHA, n_kv/2 layers with
 * buffers K0..K(L-1) then V0..V(L-1), so layer l owns {l, L+l}; an odd count
 * is one buffer per layer (MLA). start needs nlayers + 1 entries (at most
 * n_kv + 1), bufs n_kv. */
void kvf__plan_layout_default(size_t n_kv, uint32_t *start, uint32_t *bufs, plan_layout *out);

/* One side's buffers: base addresses and, where known, byte lengths. */
typedef struct plan_mem {
  const uint64_t *base;
  const uint64_t *len; /* NULL = lengths unknown, ranges unchecked on this side */
  size_t nbufs;
} plan_mem;

/* One call of the address functions below: the buffers of layers [l0, l1)
 * of lay, the page runs, both sides' memory, and what the mode needs: the
 * prefill's item lengths (plain) or the fragments (fragment mode; state !=
 * 0 matches the layout's buffers against mamba_state fragments, 0 against
 * the other kinds). A struct, so a new input does not change every call. */
typedef struct plan_xfer {
  const plan_layout *lay;
  size_t l0, l1;
  const plan_run *runs;
  size_t nruns;
  const plan_mem *src, *dst;  /* not read by the *_count functions */
  const uint64_t *item;       /* plain mode */
  const wire_fragment *frags; /* fragment mode: nfrags of them */
  size_t nfrags;
  int state;
} plan_xfer;

/* ---- Plain (identity) address computation (§6.4) ---- */

/* Blocks kvf__plan_plain_writes emits for x (its layers and runs); 0 if the
 * layer range is invalid. */
size_t kvf__plan_plain_count(const plan_xfer *x);

/* Blocks for KV layers [l0, l1): layer-major, buffer order within the layer,
 * run order within the buffer; for buffer b and run (s0, d0, r):
 *   src = src.base[b] + s0*item[b], dst = dst.base[b] + d0*item[b],
 *   len = item[b]*r, count 1
 * (`item` is the prefill's item lengths, used for both sides as the
 * reference does, §6.4). Checks: buffer index within both sides
 * (KVF_EINVAL), item > 0 (KVF_EINVAL), pages non-negative and, where lengths
 * are given, (page+r)*item <= len on each side (KVF_ERANGE); arithmetic
 * overflow is KVF_ERANGE. KVF_ETOOBIG if cap is short of the count. State
 * buffers (§6.6) use the same function with a layout of one layer listing
 * the state buffers. */
int kvf__plan_plain_writes(const plan_xfer *x, kvf_write *out, size_t cap, size_t *nout);

/* ---- Route plan (§5.2, §6.5) ---- */

/* Fragments (§6.5.5) are the wire's type, wire_fragment (wire/messages.h):
 * the planner emits them, the M2 carries them and the executor below reads
 * them as they are, with no conversion. buffer_kind is a WIRE_KIND_*. */

/* Inputs of the generic planner, as the decode rank knows them. Lists from
 * the prefill are the parallel-info reply's; an empty prefill item list is
 * "published none" (Id*Td/Tp is substituted), an empty unit list means 1. */
typedef struct plan_route_params {
  int decode_tp_size;
  int decode_tp_rank;
  int prefill_tp_size;
  const plan_layout *layout;            /* decode's KV layers -> buffer indices */
  size_t target_layer_num;              /* layer indices >= this are draft; 0 = all target */
  const int64_t *d_kv_item, *d_kv_unit; /* decode lists; unit may be NULL (all 1) */
  size_t n_d_kv, n_d_kv_unit;
  const int64_t *p_kv_item, *p_kv_unit; /* prefill lists (may be empty) */
  size_t n_p_kv, n_p_kv_unit;
  const int64_t *d_state_item, *d_state_unit; /* decode state buffers: n_d_state of them */
  size_t n_d_state, n_d_state_unit;
  const int64_t *p_state_item, *p_state_unit;
  size_t n_p_state, n_p_state_unit;
  char *err; /* optional: on failure, a reason is written here */
  size_t err_cap;
} plan_route_params;

typedef struct plan_target {
  int rank;                  /* prefill TP rank to contact */
  int is_dummy;              /* legacy MLA: handshake only, no data, no M3 */
  int required_dst_info_num; /* M2 frame 6 for this target (its fan-out) */
  size_t frag_start;         /* this target's fragments: frags[frag_start ..+nfrags) */
  size_t nfrags;
} plan_target;

typedef struct plan_route {
  int is_identity;   /* whole pages, no fragment frames (§6.4 on the prefill) */
  int supports_spec; /* supports_remote_spec_candidates */
  int required_prefill_response_num;
  int ntargets;
  plan_target *targets; /* ascending rank order */
  int prefill_tp_size;
  int *fanout; /* fanout[p], p < prefill_tp_size: decode ranks that contact p */
  size_t nfrags;
  wire_fragment *frags; /* grouped by target, pair order within a target */
} plan_route;

/* The generic planner (§6.5.1-6.5.4) for one decode TP rank. The caller owns
 * *out and frees it with kvf__plan_route_free. KVF_EINVAL for sizes out of range
 * or any layout the reference rejects (the reason goes to p->err). Prefill
 * ranks with fanout 0 are never targets (§8 item 4: the manager decides
 * whether to send them dummies). */
int kvf__plan_route_build(const plan_route_params *p, plan_route *out);

/* §8 item 4: give every prefill rank that no decode rank contacts (fanout
 * 0: GQA replica groups, replicated buffers with Tp > Td) one dummy M2, so
 * it still reaches Bootstrapped and, on its last chunk, Success. Prefill
 * rank q is handed to decode rank (q * Td) / Tp, so exactly one decode rank
 * sends it a dummy and every decode rank agrees on fanout[q] = 1. Adds the
 * dummies of decode rank d to r->targets (kept in ascending rank order;
 * required_prefill_response_num unchanged: dummies send no M3). A no-op for
 * an identity plan. KVF_ENOMEM leaves r unchanged. */
int kvf__plan_route_add_dummies(plan_route *r, int decode_tp_size, int decode_tp_rank);

/* The legacy MLA rows and the L1.5 row of §5.2 (no fragments). */
int kvf__plan_route_legacy_mla(int decode_tp_size, int decode_tp_rank, int prefill_tp_size, int l15_cache,
                               plan_route *out);

/* Free what a plan_route_* call allocated; the struct is zeroed. */
void kvf__plan_route_free(plan_route *r);

/* ---- Fragment execution (§6.5.6) ---- */

/* 1 if a KV fragment cuts a byte range out of a page on either side (not
 * whole pages): such a plan needs pages that hold their heads contiguously
 * (§6.5.7 caveat); 0 otherwise. mamba_state fragments do not count. */
int kvf__plan_frags_slice_pages(const wire_fragment *frags, size_t nfrags);

/* Exact number of blocks kvf__plan_frag_writes emits for the same x. */
size_t kvf__plan_frag_count(const plan_xfer *x);

/* Blocks for fragment mode, in the reference's order: for each buffer b of
 * layers [l0, l1) (state != 0: every buffer listed in the layout, matched
 * against mamba_state fragments; else against the other kinds), each fragment
 * of b in list order, each run: the m = min(r, page_count if set) pages of
 * the run become ONE block, strided when m > 1:
 *   src = src.base[b] + s0*src_page_stride_bytes + src_byte_offset   (that stride)
 *   dst = dst.base[b] + d0*dst_page_stride_bytes + dst_byte_offset   (that stride)
 *   len = bytes_per_page, count = m
 * and a plain block of m*bytes_per_page when both strides equal
 * bytes_per_page. Buffers without a fragment are skipped. Fragments come
 * from the network, so each is checked: bytes_per_page > 0, offsets >= 0 and
 * offset + bytes <= stride on each side (no spill into the next page), pages
 * in range of known buffer lengths, no overflow (KVF_ERANGE); buffer index
 * past either side: KVF_EINVAL. KVF_ETOOBIG if cap is short. */
int kvf__plan_frag_writes(const plan_xfer *x, kvf_write *out, size_t cap, size_t *nout);

/* ---- Small routing helpers ---- */

/* room mod dp_size as a non-negative floor modulo (§0). KVF_EINVAL if
 * dp_size <= 0. */
int kvf__plan_dp_group(int64_t room, int64_t dp_size, int64_t *out);

/* Port of a session id "host:port" (or "[v6]:port"): host non-empty, exactly
 * one ':' outside brackets, port all digits in 1..65535. KVF_EINVAL else. */
int kvf__plan_session_port(const char *session, int *port);

/* Queue shard of a room (§6.12): sum of the session ports mod nqueues.
 * KVF_EINVAL for nqueues <= 0 or a malformed session id. */
int kvf__plan_queue_shard(const char *const *sessions, size_t n, int nqueues, int *out);

#endif

/* Verify mode and room fencing (issue 16), the parts shared by the decode
 * and prefill halves of the KV manager. See docs/WIRE-EXTENSIONS.md
 * ("Integrity and fencing") for the wire side and the guarantees.
 *
 * Decode: each room a receiver inits gets an entry (room -> fence epoch,
 * verify asked, which prefill ranks sent digests) in a table behind one
 * mutex, so the listener thread never touches a receiver (which the
 * application may destroy at any time). The engine fence of the room is
 * opened at init and closed when the receiver sees Failed or is destroyed.
 *
 * Prefill: page digests taken when kvf_sender_send is called, the digest
 * entries of what a worker wrote, and the re-check of the sources after the
 * write. Pure helpers over the manager's buffers; no table. */
#ifndef KVF_KV_INTEGRITY_H
#define KVF_KV_INTEGRITY_H

#include "kv/manager.h"

/* Test seam, NULL in every shipped program: only the testing library
 * (src/testing/tamper.c), linked into the test peer and a test build of the
 * shared library, sets it; nothing in the library or the environment can.
 * Called with a landed block before it is hashed, so a test can change a
 * landed byte and see verify mode catch it: on the landing thread with the
 * first whole page of each landed piece (kvf__integ_on_landed), and on the
 * listener thread with the first block of each verified digests message. */
typedef void (*kvf__integ_tamper_fn)(int64_t room, unsigned char *landed);
extern _Atomic(kvf__integ_tamper_fn) kvf__integ_tamper;
/* Test seam of the same kind on the prefill: called on the sending thread
 * with the first (page, buffer) source of a verify-mode chunk (`len` bytes)
 * right after its digest was taken and before any worker may read it, so a
 * test can reuse a source page too early at a point the transfer cannot have
 * passed yet (kvferry demo --verify --reuse-early). */
typedef void (*kvf__integ_source_fn)(int64_t room, unsigned char *src, size_t len);
extern _Atomic(kvf__integ_source_fn) kvf__integ_source_tamper;

/* Bound on one room's entry: prefill ranks tracked for digests. */
#define INTEG_MAX_RANKS ROOMS_MAX_RANKS
/* Bound on the landed table (16 bytes a page; calloc'd, so only the pages
 * that landed are touched): 2^24 pages, 512 GiB of 32 KiB pages. */
#define INTEG_LANDED_MAX (1u << 24)

int kvf__integ_start(kvf_manager *m);
void kvf__integ_stop(kvf_manager *m);
/* At kvf_manager_destroy, before the role stops: close the engine fence of
 * every room still open (receivers the caller did not destroy first), so
 * no chunk lands for them, or reads their bounds, once the manager is gone
 * (the engine may be shared and outlive it). */
void kvf__integ_close_open_fences(kvf_manager *m);

/* ---- decode ---- */

/* At receiver init: open the room's engine fence and note verify mode, for
 * a kvferry prefill (`kvferry`); a tokenspeed prefill gets neither (its M2
 * stays byte-exact) but a Success from it is counted as unverified when
 * verify mode is on. *flags / *epoch go into the M2s (0 / 0 when the room
 * is not fenced: a tokenspeed prefill, tag 0, or no memory). */
void kvf__integ_room_open(kvf_manager *m, int64_t room, int kvferry, uint64_t *flags, uint64_t *epoch);
/* Close the fence (no write of the room lands after this returns; nothing
 * to close for epoch 0) and, when `forget`, drop the room's entry. Counts
 * rooms_fenced when `failed`. */
void kvf__integ_room_close(kvf_manager *m, int64_t room, uint64_t epoch, int failed, int forget);
/* Tell a kvferry prefill rank that the room failed here (best effort). */
void kvf__integ_send_fence(kvf_manager *m, const char *ip, uint16_t port, int64_t room, uint64_t epoch,
                           const char *reason);
/* Listener: a digests message (verifies the landed bytes; dropped as forged
 * unless from_planned says the sender is a rank of the room's plan, as for
 * an M3, and fails the room only in the use from_planned saw, *use, 0: no
 * live room; rooms.h, "Uses"); an M3 Success
 * from `rank` (counts a Success without digests when verify was asked). */
void kvf__integ_on_digests(kvf_manager *m, const wire_frame *frames, size_t n, const char *peer,
                           int (*from_planned)(kvf_manager *m, int64_t room, const char *peer, uint64_t *use));
void kvf__integ_on_success(kvf_manager *m, int64_t room, int64_t rank);
/* Engine refusal callback (engine/async.h; arg: the manager): a chunk for
 * the room's open fence came outside its bounds or the decode's memory, so
 * its prefill cannot be trusted with the room: it fails with a reason. */
void kvf__integ_on_refused(void *arg, uint64_t tag, uint64_t epoch, int err, const char *peer);
/* Verify mode keeps a table of what landed (one digest and epoch per KV
 * page of this decode's buffers, sized once at start; none when the
 * buffers hold more than INTEG_LANDED_MAX pages): 1 when it does. */
int kvf__integ_hashes_landing(const kvf_manager *m);
/* Engine landed callback (engine/async.h; arg: the manager): every whole
 * KV page of the piece is hashed now, on the landing thread while its bytes
 * are in cache, and its digest recorded with the fence epoch, so that the
 * digests message of that page finds it and does not read the page back
 * (a digest that does not match what landed is still checked against the
 * page itself before the room fails). Partial pages, state slots and bytes
 * a writer put (UCX write mode, ucp_get) are checked as before. */
void kvf__integ_on_landed(void *arg, uint64_t tag, uint64_t epoch, void *dst, size_t len);

/* ---- prefill ---- */

/* The KV buffer indices of layers [l0, l1), in layout order: *nb of them in
 * a malloc'd array (caller frees). */
int kvf__integ_layer_bufs(const kvf_manager *m, size_t l0, size_t l1, size_t **bufs, size_t *nb);
/* Does page `page` lie whole inside KV buffer b? */
int kvf__integ_page_in_buffer(const kvf_manager *m, size_t b, int64_t page);
/* Digest of page `page` of KV buffer b (bounds-checked: KVF_ERANGE). */
int kvf__integ_page_digest(const kvf_manager *m, size_t b, int64_t page, uint64_t *out);
/* Hand page `page` of KV buffer b (in bounds: hash_prepare checked it) of
 * `room` to kvf__integ_source_tamper when a test set it. */
void kvf__integ_source_hashed(const kvf_manager *m, int64_t room, size_t b, int64_t page);
/* Send `n` digest entries for `room` to a decode's PULL socket (split into
 * messages of at most WIRE_MAX_DIGESTS; one empty message when n == 0). */
int kvf__integ_send_digests(kvf_manager *m, const char *host, uint16_t port, int64_t room, uint64_t epoch,
                            const wire_digest *d, size_t n);

#endif

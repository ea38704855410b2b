/* Copies of bytes that nobody here reads soon: a large transfer's pages,
 * which land in the decode's memory for its GPU or a later step, not for
 * this thread. memcpy's stores first read each destination line into the
 * cache (the line is written whole, but the CPU does not know that), so a
 * scattered 512 MiB copy in 32 KiB slices moves three bytes over the memory
 * bus for every byte copied; glibc streams past the cache only for single
 * copies larger than a share of the last-level cache, which slices never
 * are. Measured here (2 cores, 32 KiB slices of 512 MiB in a scattered
 * order): memcpy 96-114 ms on one thread, 56-71 ms on two; streaming stores
 * 65-80 ms on one thread, 39-53 ms on two. */
#ifndef KVF_BASE_COPY_H
#define KVF_BASE_COPY_H

#include <stddef.h>

/* A batch of copies this large (bytes in all) streams: half a core's L2
 * here (2 MiB), so a larger batch's first slices would mostly leave the
 * cache before anyone read them. Below it, memcpy keeps the bytes in cache
 * for whoever reads them next (a small room's page, a landing hash). */
#define KVF_COPY_STREAM_MIN_BATCH (1u << 20)

/* memcpy(dst, src, len), the destination written with non-temporal stores
 * (x86-64: SSE2 streaming stores, whole 64-byte lines; the unaligned head
 * and tail and copies under 256 bytes by memcpy) and fenced before return,
 * so the bytes are as visible to other threads and devices as after a
 * memcpy once it returns. Elsewhere memcpy. The ranges must not overlap. */
void kvf__copy_stream(void *dst, const void *src, size_t len);

#endif

/* Is a range of this process's address space readable host memory? Device
 * memory (cudaMalloc) is not a readable mapping of the process, so this
 * tells the two apart without a GPU library: the KV managers refuse verify
 * mode for device buffers (kv/manager.c), and a UCX engine with device
 * memory registered is written to, not read from (engine/ucx.c: the reader
 * copies with its CPU). */
#ifndef KVF_BASE_HOSTMEM_H
#define KVF_BASE_HOSTMEM_H

#include <stdint.h>
#include <stdio.h>

/* Is [a, a + len) covered by readable mappings in `maps` (an open
 * /proc/self/maps, read from its start)? 1 or 0. */
int kvf__maps_readable(FILE *maps, uint64_t a, uint64_t len);

/* The same for this process: 1, 0, or -1 when /proc/self/maps cannot be
 * read (cannot tell). */
int kvf__host_readable(uint64_t a, uint64_t len);

#endif

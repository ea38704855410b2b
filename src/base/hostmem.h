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

/* Is [a, a + len) covered by readable System V shared memory segments
 * ("/SYSV..." in `maps`)? A segment's size is fixed when it is made and it
 * stays whole while attached, whereas a file (POSIX shared memory, a memfd)
 * can be shrunk by its owner under another process's mapping, whose next
 * load past the new end kills that process (SIGBUS). So memory another
 * process shares is loaded from directly only when this holds (UCX read
 * and write modes, engine/ucx_peer.c). 1 or 0. */
int kvf__maps_sysv_shared(FILE *maps, uint64_t a, uint64_t len);

/* The same for this process: 1, 0, or -1 when /proc/self/maps cannot be
 * read. */
int kvf__host_sysv_shared(uint64_t a, uint64_t len);

#endif

/* The process-wide thread wake-up counter (base/wake.h). */
#include "base/wake.h"

#include "kvferry/common.h"

atomic_ullong kvf__wakeups;

uint64_t kvf_wakeups(void) { return atomic_load_explicit(&kvf__wakeups, memory_order_relaxed); }

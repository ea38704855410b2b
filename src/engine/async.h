/* Completion callbacks for engine writes, for the KV managers: a transfer
 * whose completion is handled where the transport learns it (the thread that
 * reads the peer's acknowledgement), instead of a thread blocked in
 * kvf_batch_wait that must wake up to pass it on. */
#ifndef KVF_ENGINE_ASYNC_H
#define KVF_ENGINE_ASYNC_H

#include <stddef.h>

#include "kvferry/engine.h"

/* Like kvf_engine_submit, but no batch handle: the engine calls
 * on_done(arg, status) exactly once, when every block is confirmed (0) or
 * one failed (a KVF_E* error), on a transport thread, or on the calling
 * thread before this call returns (nothing to move, or a quick peer). The
 * source memory must stay valid until then. on_done must not block for long
 * (it runs on the thread that reads acknowledgements). On error on_done is
 * never called and nothing was sent. Any thread. */
int kvf__engine_submit_cb(kvf_engine *engine, const char *session, const kvf_write *writes, size_t n,
                          void (*on_done)(void *arg, int status), void *arg);

#endif

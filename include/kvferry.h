/*
 * kvferry — moves the KV cache of LLM requests from prefill to decode instances.
 *
 * This umbrella header is the whole public API (API version 1, see
 * KVF_VERSION_*). Everything it does not declare is internal. Conventions:
 * - functions return 0 on success or a negative KVF_E* code (kvf_strerror,
 *   kvf_err_name); output parameters are set only on success;
 * - lifecycle: kvf_<object>_create / kvf_<object>_destroy (destroy takes
 *   NULL); configs and parameter structs start with a `size` member set by
 *   their *_init function, always call it first;
 * - polling an operation (kvf_batch_poll): 0 = done, KVF_EAGAIN = not yet,
 *   another negative code = failed. Polling a room (kvf_receiver_poll,
 *   kvf_sender_poll) returns its state, a kvf_poll_status, never an error;
 * - every function says who owns what it returns and which threads may call
 *   it; each part's header starts with a "Threads" section saying which calls
 *   block and for how long at most.
 */
#ifndef KVFERRY_H
#define KVFERRY_H

#include "kvferry/common.h"
#include "kvferry/bootstrap.h"
#include "kvferry/engine.h"
#include "kvferry/kv.h"
#include "kvferry/trace.h"

#endif

/*
 * kvferry — moves the KV cache of LLM requests from prefill to decode instances.
 *
 * This umbrella header is the whole public API. Everything it does not declare
 * is internal. Conventions: functions return 0 on success or a negative KVF_E*
 * code (see kvf_strerror); output parameters are set only on success; every
 * function says who owns what it returns and which threads may call it.
 */
#ifndef KVFERRY_H
#define KVFERRY_H

#include "kvferry/common.h"
#include "kvferry/bootstrap.h"
#include "kvferry/engine.h"
#include "kvferry/kv.h"

#endif

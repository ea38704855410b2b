/* Corrupting one landed byte on purpose, to show that verify mode catches
 * it: the testing library arms the library's internal hook
 * (kvf__integ_tamper, kv/integrity.h), which no shipped program can reach.
 * The test peer arms it for a room it is told to corrupt (`recv ... corrupt-
 * verify`, kvferry demo --verify --corrupt); a test build of the shared
 * library (libkvferry-testhook.so, tamper_env.c) arms it from
 * $KVFERRY_TEST_CORRUPT_ROOM when it loads, for the Python tests. Part of
 * the testing library (static, never installed). */
#ifndef KVF_TESTING_TAMPER_H
#define KVF_TESTING_TAMPER_H

#include <stdint.h>

/* Flip one byte of the first page of `room` that lands in this process, right
 * before the library checks it against its digest (verify mode only): once,
 * for the first manager that checks a page of that room. Any thread; a later
 * call replaces an earlier one that has not fired yet. */
void testing_corrupt_room(int64_t room);

/* The prefill's side (verify mode): flip the last byte of the first source
 * page of `room` that this process hashes, right after its digest was taken
 * and before the transfer may read it, as a scheduler that reuses a page
 * too early would (kvf__integ_source_tamper; the test peer's `send ...
 * reuse`). Once; any thread; a later call replaces an earlier one. */
void testing_reuse_source_early(int64_t room);

#endif

/* See tamper.h. */
#include "testing/tamper.h"

#include <stdatomic.h>

#include "kv/integrity.h"

static _Atomic int64_t g_room;
static atomic_int g_armed;

static void flip_once(int64_t room, unsigned char *landed) {
  if (room != atomic_load(&g_room)) return;
  int armed = 1;
  if (atomic_compare_exchange_strong(&g_armed, &armed, 0)) *(volatile unsigned char *)landed ^= 0x5a;
}

void testing_corrupt_room(int64_t room) {
  atomic_store(&g_room, room);
  atomic_store(&g_armed, 1);
  atomic_store(&kvf__integ_tamper, flip_once);
}

static _Atomic int64_t g_src_room;
static atomic_int g_src_armed;

static void reuse_once(int64_t room, unsigned char *src, size_t len) {
  if (room != atomic_load(&g_src_room) || !len) return;
  int armed = 1;
  if (atomic_compare_exchange_strong(&g_src_armed, &armed, 0)) ((volatile unsigned char *)src)[len - 1] ^= 0xff;
}

void testing_reuse_source_early(int64_t room) {
  atomic_store(&g_src_room, room);
  atomic_store(&g_src_armed, 1);
  atomic_store(&kvf__integ_source_tamper, reuse_once);
}

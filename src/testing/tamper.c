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

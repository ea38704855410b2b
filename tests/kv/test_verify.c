/* Verify mode's host-memory rule (issue 16): the CPU cannot hash device
 * memory, so kvf_manager_create refuses verify mode when a buffer is not a
 * readable mapping of the process (what a cudaMalloc pointer looks like from
 * the CPU; here a PROT_NONE mapping stands in for it), and accepts the same
 * buffers without verify mode. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <cmocka.h>

#include "kvferry.h"

#define LEN (1u << 20)

static int make(void *ptr, int verify, kvf_manager **out) {
  void *ptrs[1] = {ptr};
  uint64_t lens[1] = {LEN}, items[1] = {4096};
  kvf_kv_buffers b = {.n_kv = 1, .kv_ptrs = ptrs, .kv_lens = lens, .kv_item_lens = items};
  kvf_manager_config c;
  kvf_manager_config_init(&c);
  c.role = KVF_ROLE_DECODE;
  assert_int_equal(kvf_manager_config_set(&c, "verify", verify ? "1" : "0"), 0);
  return kvf_manager_create(&c, &b, out);
}

static void verify_mode_needs_host_memory(void **state) {
  (void)state;
  void *host = mmap(NULL, LEN, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  void *unreadable = mmap(NULL, LEN, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  assert_true(host != MAP_FAILED && unreadable != MAP_FAILED);
  kvf_manager *m = NULL;
  assert_int_equal(make(unreadable, 1, &m), KVF_EINVAL);
  assert_null(m);
  assert_int_equal(make(unreadable, 0, &m), 0); /* without verify mode nothing reads it on the CPU */
  kvf_manager_destroy(m);
  m = NULL;
  assert_int_equal(make(host, 1, &m), 0);
  kvf_manager_destroy(m);
  munmap(host, LEN);
  munmap(unreadable, LEN);
}

/* An address with no mapping at all (a device pointer outside any host
 * mapping, where the driver reserved none) is refused too, as is a buffer
 * that is host memory only in part. */
static void verify_mode_refuses_unmapped_and_partly_mapped_buffers(void **state) {
  (void)state;
  char *two = mmap(NULL, 2 * LEN, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  assert_true(two != MAP_FAILED);
  assert_int_equal(munmap(two + LEN, LEN), 0); /* [two, two+LEN) mapped, the next LEN not */
  kvf_manager *m = NULL;
  assert_int_equal(make(two + LEN, 1, &m), KVF_EINVAL);
  assert_int_equal(make(two + LEN / 2, 1, &m), KVF_EINVAL);
  assert_null(m);
  assert_int_equal(make(two, 1, &m), 0);
  kvf_manager_destroy(m);
  munmap(two, LEN);
}

int main(void) {
  const struct CMUnitTest tests[] = {
      cmocka_unit_test(verify_mode_needs_host_memory),
      cmocka_unit_test(verify_mode_refuses_unmapped_and_partly_mapped_buffers),
  };
  return cmocka_run_group_tests(tests, NULL, NULL);
}

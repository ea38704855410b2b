/* A program written against the installed headers only: two transfer
 * engines in one process, one registers a destination buffer, the other
 * writes a pattern into it; the bytes are checked. Exit 0 on success. */
#include <kvferry.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#if KVF_VERSION_MAJOR < 0
#error "kvferry version macros missing"
#endif

#define LEN (1 << 20)

int main(void) {
  kvf_engine *a = NULL, *b = NULL;
  unsigned char *src = malloc(LEN), *dst = calloc(1, LEN);
  int rc = 1;
  if (!KVF_VERSION_OK()) {
    fprintf(stderr, "consumer: built for kvferry %s, loaded %s\n", KVF_VERSION_STRING, kvf_version());
    goto out;
  }
  if (!src || !dst) goto out;
  for (size_t i = 0; i < LEN; i++) src[i] = (unsigned char)(i * 31 + 7);
  if (kvf_engine_create(NULL, &a) || kvf_engine_create(NULL, &b)) {
    fprintf(stderr, "consumer: engine create failed\n");
    goto out;
  }
  int err;
  if ((err = kvf_engine_register(a, src, LEN)) || (err = kvf_engine_register(b, dst, LEN))) {
    fprintf(stderr, "consumer: register: %s (%s)\n", kvf_err_name(err), kvf_strerror(err));
    goto out;
  }
  kvf_engine_sync(b);
  kvf_write w = {.src = (uint64_t)(uintptr_t)src, .dst = (uint64_t)(uintptr_t)dst, .len = LEN};
  if ((err = kvf_engine_write(a, kvf_engine_session_id(b), &w, 1))) {
    fprintf(stderr, "consumer: write: %s (%s)\n", kvf_err_name(err), kvf_strerror(err));
    goto out;
  }
  kvf_engine_sync(b);
  if (memcmp(src, dst, LEN)) {
    fprintf(stderr, "consumer: bytes differ\n");
    goto out;
  }
  printf("consumer: kvferry %s moved %d bytes from %s to %s\n", kvf_version(), LEN, kvf_engine_session_id(a),
         kvf_engine_session_id(b));
  rc = 0;
out:
  kvf_engine_destroy(a);
  kvf_engine_destroy(b);
  free(src);
  free(dst);
  return rc;
}

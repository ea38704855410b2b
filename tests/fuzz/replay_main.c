/* Replays every file of a fuzz target's corpus folder (seeds and kept crash
 * inputs) through its LLVMFuzzerTestOneInput, so the regular test suite —
 * including its ASan+UBSan run — checks them without libFuzzer. */
#include <dirent.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int main(int argc, char **argv) {
  if (argc != 2) {
    fprintf(stderr, "usage: %s CORPUS_DIR\n", argv[0]);
    return 2;
  }
  DIR *d = opendir(argv[1]);
  if (!d) {
    perror(argv[1]);
    return 1;
  }
  struct dirent *e;
  int n = 0;
  while ((e = readdir(d))) {
    if (e->d_name[0] == '.') continue;
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", argv[1], e->d_name);
    FILE *f = fopen(path, "rb");
    if (!f) continue;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *buf = malloc(len > 0 ? (size_t)len : 1);
    if (buf && fread(buf, 1, (size_t)len, f) == (size_t)len) {
      LLVMFuzzerTestOneInput(buf, (size_t)len);
      n++;
    }
    free(buf);
    fclose(f);
  }
  closedir(d);
  printf("replayed %d inputs from %s\n", n, argv[1]);
  return n > 0 ? 0 : 1;
}

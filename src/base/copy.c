/* See copy.h. */
#include "base/copy.h"

#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__SSE2__)
#include <emmintrin.h>

#define STREAM_LINE 64u
#define STREAM_MIN 256u

void kvf__copy_stream(void *dst, const void *src, size_t len) {
  if (len < STREAM_MIN) {
    memcpy(dst, src, len);
    return;
  }
  unsigned char *d = dst;
  const unsigned char *s = src;
  size_t head = (STREAM_LINE - ((uintptr_t)d & (STREAM_LINE - 1))) & (STREAM_LINE - 1);
  memcpy(d, s, head); /* the destination from here on is whole lines */
  d += head, s += head, len -= head;
  for (; len >= STREAM_LINE; d += STREAM_LINE, s += STREAM_LINE, len -= STREAM_LINE) {
    __m128i a = _mm_loadu_si128((const __m128i *)(const void *)s);
    __m128i b = _mm_loadu_si128((const __m128i *)(const void *)(s + 16));
    __m128i c = _mm_loadu_si128((const __m128i *)(const void *)(s + 32));
    __m128i e = _mm_loadu_si128((const __m128i *)(const void *)(s + 48));
    _mm_stream_si128((__m128i *)(void *)d, a);
    _mm_stream_si128((__m128i *)(void *)(d + 16), b);
    _mm_stream_si128((__m128i *)(void *)(d + 32), c);
    _mm_stream_si128((__m128i *)(void *)(d + 48), e);
  }
  memcpy(d, s, len);
  _mm_sfence(); /* streaming stores are weakly ordered: done before any release that follows */
}

#else

void kvf__copy_stream(void *dst, const void *src, size_t len) { memcpy(dst, src, len); }

#endif

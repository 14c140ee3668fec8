#include "checkpoint/codec/byte_planes.h"

#include <cstring>

#if defined(__SSE2__)
#include <emmintrin.h>
#endif

namespace checkpoint {

namespace {

template <typename U>
inline U rotl1(U x) {
  return static_cast<U>((x << 1) | (x >> (sizeof(U) * 8 - 1)));
}

template <typename U>
inline U rotr1(U x) {
  return static_cast<U>((x >> 1) | (x << (sizeof(U) * 8 - 1)));
}

// Elements [from, count) one at a time; the SIMD loops leave the tail here.
template <typename U>
void split_scalar(const uint8_t* in, size_t from, size_t count, bool rotate, uint8_t* out) {
  for (size_t i = from; i < count; ++i) {
    U x;
    std::memcpy(&x, in + i * sizeof(U), sizeof(U));
    if (rotate) x = rotl1(x);
    for (size_t k = 0; k < sizeof(U); ++k) out[k * count + i] = static_cast<uint8_t>(x >> (8 * k));
  }
}

template <typename U>
void merge_scalar(const uint8_t* const* planes, size_t from, size_t count, bool rotate, uint8_t* out) {
  for (size_t i = from; i < count; ++i) {
    U x = 0;
    for (size_t k = 0; k < sizeof(U); ++k) x |= static_cast<U>(static_cast<U>(planes[k][i]) << (8 * k));
    if (rotate) x = rotr1(x);
    std::memcpy(out + i * sizeof(U), &x, sizeof(U));
  }
}

void split_any(const uint8_t* in, size_t count, size_t e, uint8_t* out) {
  for (size_t i = 0; i < count; ++i) {
    for (size_t k = 0; k < e; ++k) out[k * count + i] = in[i * e + k];
  }
}

void merge_any(const uint8_t* planes, size_t count, size_t e, uint8_t* out) {
  for (size_t i = 0; i < count; ++i) {
    for (size_t k = 0; k < e; ++k) out[i * e + k] = planes[k * count + i];
  }
}

void merge_any_from(const uint8_t* const* planes, size_t count, size_t e, uint8_t* out) {
  for (size_t i = 0; i < count; ++i) {
    for (size_t k = 0; k < e; ++k) out[i * e + k] = planes[k][i];
  }
}

#if defined(__SSE2__)

// 16 elements of 4 bytes per step: plane k is byte k of each 32-bit lane,
// narrowed by two saturating packs (the values are 0..255, so nothing
// saturates).
size_t split4_sse2(const uint8_t* in, size_t count, bool rotate, uint8_t* out) {
  const __m128i low = _mm_set1_epi32(0xFF);
  size_t i = 0;
  for (; i + 16 <= count; i += 16) {
    __m128i x[4];
    for (int j = 0; j < 4; ++j) {
      x[j] = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + 4 * i + 16 * j));
      if (rotate) x[j] = _mm_or_si128(_mm_slli_epi32(x[j], 1), _mm_srli_epi32(x[j], 31));
    }
    const __m128i b0[4] = {_mm_and_si128(x[0], low), _mm_and_si128(x[1], low),
                           _mm_and_si128(x[2], low), _mm_and_si128(x[3], low)};
    const __m128i b1[4] = {_mm_and_si128(_mm_srli_epi32(x[0], 8), low),
                           _mm_and_si128(_mm_srli_epi32(x[1], 8), low),
                           _mm_and_si128(_mm_srli_epi32(x[2], 8), low),
                           _mm_and_si128(_mm_srli_epi32(x[3], 8), low)};
    const __m128i b2[4] = {_mm_and_si128(_mm_srli_epi32(x[0], 16), low),
                           _mm_and_si128(_mm_srli_epi32(x[1], 16), low),
                           _mm_and_si128(_mm_srli_epi32(x[2], 16), low),
                           _mm_and_si128(_mm_srli_epi32(x[3], 16), low)};
    const __m128i b3[4] = {_mm_srli_epi32(x[0], 24), _mm_srli_epi32(x[1], 24),
                           _mm_srli_epi32(x[2], 24), _mm_srli_epi32(x[3], 24)};
    const __m128i* planes[4] = {b0, b1, b2, b3};
    for (int k = 0; k < 4; ++k) {
      const __m128i* b = planes[k];
      const __m128i packed = _mm_packus_epi16(_mm_packs_epi32(b[0], b[1]), _mm_packs_epi32(b[2], b[3]));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + k * count + i), packed);
    }
  }
  return i;
}

size_t merge4_sse2(const uint8_t* const* planes, size_t count, bool rotate, uint8_t* out) {
  size_t i = 0;
  for (; i + 16 <= count; i += 16) {
    const __m128i p0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(planes[0] + i));
    const __m128i p1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(planes[1] + i));
    const __m128i p2 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(planes[2] + i));
    const __m128i p3 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(planes[3] + i));
    const __m128i lo01 = _mm_unpacklo_epi8(p0, p1), hi01 = _mm_unpackhi_epi8(p0, p1);
    const __m128i lo23 = _mm_unpacklo_epi8(p2, p3), hi23 = _mm_unpackhi_epi8(p2, p3);
    __m128i e[4] = {_mm_unpacklo_epi16(lo01, lo23), _mm_unpackhi_epi16(lo01, lo23),
                    _mm_unpacklo_epi16(hi01, hi23), _mm_unpackhi_epi16(hi01, hi23)};
    for (int j = 0; j < 4; ++j) {
      if (rotate) e[j] = _mm_or_si128(_mm_srli_epi32(e[j], 1), _mm_slli_epi32(e[j], 31));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 4 * i + 16 * j), e[j]);
    }
  }
  return i;
}

// 16 elements of 2 bytes per step.
size_t split2_sse2(const uint8_t* in, size_t count, bool rotate, uint8_t* out) {
  const __m128i low = _mm_set1_epi16(0xFF);
  size_t i = 0;
  for (; i + 16 <= count; i += 16) {
    __m128i x0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + 2 * i));
    __m128i x1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(in + 2 * i + 16));
    if (rotate) {
      x0 = _mm_or_si128(_mm_slli_epi16(x0, 1), _mm_srli_epi16(x0, 15));
      x1 = _mm_or_si128(_mm_slli_epi16(x1, 1), _mm_srli_epi16(x1, 15));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + i),
                     _mm_packus_epi16(_mm_and_si128(x0, low), _mm_and_si128(x1, low)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + count + i),
                     _mm_packus_epi16(_mm_srli_epi16(x0, 8), _mm_srli_epi16(x1, 8)));
  }
  return i;
}

size_t merge2_sse2(const uint8_t* const* planes, size_t count, bool rotate, uint8_t* out) {
  size_t i = 0;
  for (; i + 16 <= count; i += 16) {
    const __m128i p0 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(planes[0] + i));
    const __m128i p1 = _mm_loadu_si128(reinterpret_cast<const __m128i*>(planes[1] + i));
    __m128i e0 = _mm_unpacklo_epi8(p0, p1);
    __m128i e1 = _mm_unpackhi_epi8(p0, p1);
    if (rotate) {
      e0 = _mm_or_si128(_mm_srli_epi16(e0, 1), _mm_slli_epi16(e0, 15));
      e1 = _mm_or_si128(_mm_srli_epi16(e1, 1), _mm_slli_epi16(e1, 15));
    }
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2 * i), e0);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(out + 2 * i + 16), e1);
  }
  return i;
}

#else

size_t split4_sse2(const uint8_t*, size_t, bool, uint8_t*) { return 0; }
size_t merge4_sse2(const uint8_t* const*, size_t, bool, uint8_t*) { return 0; }
size_t split2_sse2(const uint8_t*, size_t, bool, uint8_t*) { return 0; }
size_t merge2_sse2(const uint8_t* const*, size_t, bool, uint8_t*) { return 0; }

#endif

}  // namespace

void split_planes(const uint8_t* in, size_t count, size_t e, bool rotate, uint8_t* out) {
  switch (e) {
    case 1:
      if (rotate) {
        split_scalar<uint8_t>(in, 0, count, true, out);
      } else if (count) {
        std::memcpy(out, in, count);
      }
      return;
    case 2: split_scalar<uint16_t>(in, split2_sse2(in, count, rotate, out), count, rotate, out); return;
    case 4: split_scalar<uint32_t>(in, split4_sse2(in, count, rotate, out), count, rotate, out); return;
    case 8: split_scalar<uint64_t>(in, 0, count, rotate, out); return;
    default: split_any(in, count, e, out); return;  // callers allow rotation for 1, 2, 4, 8 only
  }
}

void merge_planes(const uint8_t* planes, size_t count, size_t e, bool rotate, uint8_t* out) {
  if (e > kMaxPlanes) {
    merge_any(planes, count, e, out);  // callers allow rotation for 1, 2, 4, 8 only
    return;
  }
  const uint8_t* from[kMaxPlanes];
  for (size_t k = 0; k < e; ++k) from[k] = planes + k * count;
  merge_planes_from(from, count, e, rotate, out);
}

void merge_planes_from(const uint8_t* const* planes, size_t count, size_t e, bool rotate,
                       uint8_t* out) {
  switch (e) {
    case 1:
      if (rotate) {
        merge_scalar<uint8_t>(planes, 0, count, true, out);
      } else if (count) {
        std::memcpy(out, planes[0], count);
      }
      return;
    case 2: merge_scalar<uint16_t>(planes, merge2_sse2(planes, count, rotate, out), count, rotate, out); return;
    case 4: merge_scalar<uint32_t>(planes, merge4_sse2(planes, count, rotate, out), count, rotate, out); return;
    case 8: merge_scalar<uint64_t>(planes, 0, count, rotate, out); return;
    default: merge_any_from(planes, count, e, out); return;
  }
}

namespace {

template <typename U>
void rotate_all(const uint8_t* in, size_t count, bool left, uint8_t* out) {
  for (size_t i = 0; i < count; ++i) {
    U x;
    std::memcpy(&x, in + i * sizeof(U), sizeof(U));
    x = left ? rotl1(x) : rotr1(x);
    std::memcpy(out + i * sizeof(U), &x, sizeof(U));
  }
}

}  // namespace

void rotate_elements(const uint8_t* in, size_t count, size_t e, bool left, uint8_t* out) {
  switch (e) {
    case 1: rotate_all<uint8_t>(in, count, left, out); return;
    case 2: rotate_all<uint16_t>(in, count, left, out); return;
    case 4: rotate_all<uint32_t>(in, count, left, out); return;
    case 8: rotate_all<uint64_t>(in, count, left, out); return;
    default: return;  // callers check e
  }
}

}  // namespace checkpoint

// Helpers shared by the two x86 vector layers (vec_avx2.h, vec_avx512.h): SSE-level code
// that reads the same on both, so that each fact about x86 is stated once.
#pragma once

#include <immintrin.h>
#include <stdint.h>

#include <cstring>

namespace vec::x86 {

// The float16 at p + i * stride (unaligned) in int16 lane i for i < n (n <= 8), 0 past n.
// Built in registers: a wide load over narrow stores would wait for them to retire.
inline __m128i gather_f16x8(const uint8_t* p, int64_t stride, int n) {
  auto h = [&](int i) -> short {
    uint16_t v = 0;
    if (i < n) std::memcpy(&v, p + i * stride, 2);
    return short(v);
  };
  return _mm_setr_epi16(h(0), h(1), h(2), h(3), h(4), h(5), h(6), h(7));
}

// The float16 at p (unaligned) in every int16 lane (for F16C's conversions).
inline __m128i set1_f16(const uint8_t* p) {
  uint16_t h;
  std::memcpy(&h, p, 2);
  return _mm_set1_epi16(short(h));
}

}  // namespace vec::x86

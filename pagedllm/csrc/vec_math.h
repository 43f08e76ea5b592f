// AVX-512 helpers shared by the kernels.
#pragma once
#include <immintrin.h>
#include <stdint.h>

// The first min(n, 16) lanes (none for n <= 0): the mask of a row's last, partial vector.
inline __mmask16 low_mask(int64_t n) { return n >= 16 ? 0xFFFF : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1); }

// exp(x) for x <= 0: 2^(x log2 e), the fraction by a degree-6 polynomial (relative error
// < 2e-7); very negative x flush to 0.
inline __m512 exp_nonpositive(__m512 x) {
  x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
  const __m512 t = _mm512_mul_ps(x, _mm512_set1_ps(1.44269504f));
  const __m512 n = _mm512_roundscale_ps(t, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  const __m512 f = _mm512_mul_ps(_mm512_sub_ps(t, n), _mm512_set1_ps(0.69314718f));  // f in [0, ln 2)
  __m512 p = _mm512_set1_ps(1.0f / 720);
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 120));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 24));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f / 6));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  p = _mm512_fmadd_ps(p, f, _mm512_set1_ps(1.0f));
  return _mm512_scalef_ps(p, n);
}

// 16 float32 -> bfloat16, rounded to nearest even.
inline __m256i to_bf16(__m512 v) {
  __m512i u = _mm512_castps_si512(v);
  u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
  return _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16));
}

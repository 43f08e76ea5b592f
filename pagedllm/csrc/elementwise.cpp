// The float32 elementwise steps of a decoder layer, each fused into one pass over its rows:
// residual add + RMSNorm, RoPE, SiLU-and-mul, and the K/V write through the slot mapping;
// and greedy sampling's row-wise argmax.
// In PyTorch each is 2-6 ops (a pass over memory and ~5-10 us of dispatch apiece): 30
// layers x ~20 ops was most of a decode step's time outside the GEMMs and attention.
// Rows are split over the OpenMP threads only when there are enough of them to pay for it.
#include <immintrin.h>
#include <stdint.h>

#include <cmath>

#include "vec_math.h"

namespace {

constexpr int64_t kParallelRows = 64;  // fewer rows: one thread (a parallel region costs more)

inline __m512 silu(__m512 g) {  // g * sigmoid(g), sigmoid from e = exp(-|g|) <= 1: no overflow
  const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_setzero_ps(), _mm512_abs_ps(g)));
  const __m512 r = _mm512_div_ps(_mm512_set1_ps(1.f), _mm512_add_ps(_mm512_set1_ps(1.f), e));
  const __mmask16 neg = _mm512_cmp_ps_mask(g, _mm512_setzero_ps(), _CMP_LT_OQ);
  return _mm512_mul_ps(g, _mm512_mask_mul_ps(r, neg, r, e));  // g < 0: e / (1 + e)
}

inline void store_row(float* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) _mm512_mask_storeu_ps(dst + i, low_mask(n - i), _mm512_maskz_loadu_ps(low_mask(n - i), src + i));
}

inline void store_row(uint16_t* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; i += 16)
    _mm256_mask_storeu_epi16(dst + i, low_mask(n - i), to_bf16(_mm512_maskz_loadu_ps(low_mask(n - i), src + i)));
}

template <typename T>
void write_kv(const float* k, const float* v, int64_t ld, T* k_cache, T* v_cache, const int64_t* slots, int64_t n,
              int64_t width) {
#pragma omp parallel for schedule(static) if (n >= kParallelRows)
  for (int64_t t = 0; t < n; ++t) {
    store_row(k_cache + slots[t] * width, k + t * ld, width);
    store_row(v_cache + slots[t] * width, v + t * ld, width);
  }
}

}  // namespace

extern "C" {

// residual[T, H] += x (x may be null: residual is the input as is); out = residual *
// rsqrt(mean(residual^2) + eps) * weight. Zhang & Sennrich 2019, "Root Mean Square Layer
// Normalization". All float32, rows contiguous.
void add_rms_norm(const float* x, float* residual, const float* weight, float* out, int64_t T, int64_t H, float eps) {
#pragma omp parallel for schedule(static) if (T >= kParallelRows)
  for (int64_t t = 0; t < T; ++t) {
    float* r = residual + t * H;
    __m512 ss = _mm512_setzero_ps();
    for (int64_t i = 0; i < H; i += 16) {
      const __mmask16 m = low_mask(H - i);
      __m512 v = _mm512_maskz_loadu_ps(m, r + i);
      if (x) {
        v = _mm512_add_ps(v, _mm512_maskz_loadu_ps(m, x + t * H + i));
        _mm512_mask_storeu_ps(r + i, m, v);
      }
      ss = _mm512_fmadd_ps(v, v, ss);
    }
    const __m512 scale = _mm512_set1_ps(1.f / std::sqrt(_mm512_reduce_add_ps(ss) / H + eps));
    for (int64_t i = 0; i < H; i += 16) {
      const __mmask16 m = low_mask(H - i);
      const __m512 v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, r + i), scale);
      _mm512_mask_storeu_ps(out + t * H + i, m, _mm512_mul_ps(v, _mm512_maskz_loadu_ps(m, weight + i)));
    }
  }
}

// RoPE in place, GPT-NeoX / HF rotate_half layout (Su et al. 2021, "RoFormer", §3.4): x has
// T rows (stride ldx) of `heads` heads of D floats; cos_sin: [T, 2, D], each token's cos and
// sin with rotate_half's sign folded in (negated in the first half).
// x1' = x1 cos + x2 sin_signed, x2' = x2 cos + x1 sin_signed, for the halves x1, x2 of a head.
void rotary_inplace(float* x, int64_t ldx, const float* cos_sin, int64_t T, int64_t heads, int64_t D) {
  const int64_t half = D / 2;
#pragma omp parallel for schedule(static) if (T >= kParallelRows)
  for (int64_t t = 0; t < T; ++t) {
    const float* c = cos_sin + t * 2 * D;
    const float* s = c + D;
    for (int64_t h = 0; h < heads; ++h) {
      float* x1 = x + t * ldx + h * D;
      float* x2 = x1 + half;
      for (int64_t i = 0; i < half; i += 16) {
        const __mmask16 m = low_mask(half - i);
        const __m512 a = _mm512_maskz_loadu_ps(m, x1 + i), b = _mm512_maskz_loadu_ps(m, x2 + i);
        const __m512 c1 = _mm512_maskz_loadu_ps(m, c + i), c2 = _mm512_maskz_loadu_ps(m, c + half + i);
        const __m512 s1 = _mm512_maskz_loadu_ps(m, s + i), s2 = _mm512_maskz_loadu_ps(m, s + half + i);
        _mm512_mask_storeu_ps(x1 + i, m, _mm512_fmadd_ps(b, s1, _mm512_mul_ps(a, c1)));
        _mm512_mask_storeu_ps(x2 + i, m, _mm512_fmadd_ps(a, s2, _mm512_mul_ps(b, c2)));
      }
    }
  }
}

// gate_up: T rows (stride ld) of [gate (I floats), up (I floats)]; gate <- silu(gate) * up,
// in place (the down projection reads the gate half as strided rows).
void silu_and_mul(float* gate_up, int64_t ld, int64_t T, int64_t I) {
#pragma omp parallel for schedule(static) if (T >= kParallelRows)
  for (int64_t t = 0; t < T; ++t) {
    float* g = gate_up + t * ld;
    for (int64_t i = 0; i < I; i += 16) {
      const __mmask16 m = low_mask(I - i);
      _mm512_mask_storeu_ps(g + i, m, _mm512_mul_ps(silu(_mm512_maskz_loadu_ps(m, g + i)), _mm512_maskz_loadu_ps(m, g + I + i)));
    }
  }
}

// This step's K and V (n rows of `width` = Hkv * D floats, row stride ld) into their cache
// slots: k_cache[slots[t]] = k[t], likewise V, in the cache's dtype (float32, or bfloat16
// rounded to nearest even when cache_bf16).
void write_kv_cache(int cache_bf16, const float* k, const float* v, int64_t ld, void* k_cache, void* v_cache,
                    const int64_t* slots, int64_t n, int64_t width) {
  if (cache_bf16)
    write_kv(k, v, ld, static_cast<uint16_t*>(k_cache), static_cast<uint16_t*>(v_cache), slots, n, width);
  else
    write_kv(k, v, ld, static_cast<float*>(k_cache), static_cast<float*>(v_cache), slots, n, width);
}

// out[r] = the first index of the largest of x[r, 0..n) (rows of stride n), as torch.argmax.
// torch's CPU max/argmax reduction reads a [32, 49152] logits tensor at about 3 GB/s.
void argmax_rows(const float* x, int64_t rows, int64_t n, int64_t* out) {
#pragma omp parallel for schedule(static) if (rows >= 4)
  for (int64_t r = 0; r < rows; ++r) {
    const float* row = x + r * n;
    __m512 best = _mm512_set1_ps(-3.4e38f);
    __m512i best_i = _mm512_setzero_si512(), idx = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    for (int64_t i = 0; i < n; i += 16) {  // per lane: the first index of its largest value
      const __m512 v = _mm512_mask_loadu_ps(_mm512_set1_ps(-3.4e38f), low_mask(n - i), row + i);
      const __mmask16 gt = _mm512_cmp_ps_mask(v, best, _CMP_GT_OQ);
      best = _mm512_mask_mov_ps(best, gt, v);
      best_i = _mm512_mask_mov_epi32(best_i, gt, idx);
      idx = _mm512_add_epi32(idx, _mm512_set1_epi32(16));
    }
    const float top = _mm512_reduce_max_ps(best);
    const __mmask16 at_top = _mm512_cmp_ps_mask(best, _mm512_set1_ps(top), _CMP_EQ_OQ);
    out[r] = _mm512_mask_reduce_min_epi32(at_top, best_i);
  }
}

}  // extern "C"

// Paged attention for decode on CPU: one query token per request, K/V read in place
// through the block table (no gather, no padding). Kwon et al. 2023, "Efficient Memory
// Management for Large Language Model Serving with PagedAttention", §4.1.
//
// Layouts: q, out [B, Hq, D] float32; caches [num_blocks, BS, Hkv, D] float32 or bfloat16; block_tables [B, max_blocks];
// seq_lens [B]; window > 0: only the last `window` keys are read (sliding-window attention;
// keys at positions < seq_len - window are never touched), 0: all.
// Work is split over (request, kv head) pairs, so the G = Hq / Hkv query heads that share a
// KV head read its keys and values once. Keys are taken a block at a time with an online
// softmax (Milakov & Gimelshein 2018, "Online normalizer calculation for softmax"): each K
// and V row is read once, and the next block's rows are prefetched while this one is used.
// Scores and accumulators are float32 whatever the storage dtype. Needs AVX-512F.
#include <immintrin.h>

#include <cmath>
#include <cstdint>
#include <cstring>

namespace {

constexpr int kMaxGroup = 8;  // query heads per KV head handled by this kernel
constexpr int kMaxBlock = 64;  // tokens per block handled by this kernel

inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) {  // 16 bfloat16 -> float32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
inline void store16(float* p, __m512 v) { _mm512_storeu_ps(p, v); }
inline void store16(uint16_t* p, __m512 v) {  // round to nearest even
  __m512i u = _mm512_castps_si512(v);
  u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
  _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}

// exp(x) for x <= 0 (scores minus their running max): 2^(x log2 e), the fraction by a
// degree-6 polynomial (relative error < 2e-7); very negative x flush to 0.
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

// G query heads per KV head and the head size D are compile-time constants, so the
// queries and accumulators of a KV head (G x D/16 vectors) stay in registers.
template <typename T, int D, int G>
void decode_attention(const float* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                      int64_t max_blocks, const int64_t* seq_lens, float* out, int64_t B, int64_t Hkv,
                      int64_t BS, float scale, int64_t window) {
  constexpr int ND = D / 16;
  const int64_t Hq = Hkv * G;
  const int64_t stride = Hkv * D;  // between consecutive slots of one head
#pragma omp parallel for schedule(dynamic, 1)
  for (int64_t item = 0; item < B * Hkv; ++item) {
    const int64_t b = item / Hkv, h = item % Hkv;
    const int64_t S = seq_lens[b];
    const int64_t first = (window > 0 && S > window) ? S - window : 0;  // first key read
    const int64_t* table = block_tables + b * max_blocks;
    __m512 qv[G][ND], acc[G][ND];
    alignas(64) float p[G][kMaxBlock];
    float m[G], l[G];
    for (int g = 0; g < G; ++g) {
      for (int c = 0; c < ND; ++c) {
        qv[g][c] = _mm512_mul_ps(load16(q + (b * Hq + h * G + g) * D + 16 * c), _mm512_set1_ps(scale));
        acc[g][c] = _mm512_setzero_ps();
      }
      m[g] = -1e30f;  // finite: -ffast-math assumes no infinities
      l[g] = 0.f;
    }
    for (int64_t blk = first / BS; blk * BS < S; ++blk) {
      const int64_t lo = blk * BS > first ? 0 : first - blk * BS, hi = S - blk * BS < BS ? S - blk * BS : BS;
      const T* kb = k_cache + (table[blk] * BS * Hkv + h) * D;
      const T* vb = v_cache + (table[blk] * BS * Hkv + h) * D;
      if ((blk + 1) * BS < S) {  // the next block's rows of this head, into cache meanwhile
        const char* kn = reinterpret_cast<const char*>(k_cache + (table[blk + 1] * BS * Hkv + h) * D);
        const char* vn = reinterpret_cast<const char*>(v_cache + (table[blk + 1] * BS * Hkv + h) * D);
        // Every line of each row: a head's rows are 128-256 byte pieces Hkv * D apart, which
        // the hardware prefetchers miss (first line only: 23.4 ms, every line: 16.6 ms, for a
        // batch-32 step of SmolLM2 at context ~300).
        for (int64_t s = 0; s < BS; ++s)
          for (int64_t line = 0; line < D * int64_t(sizeof(T)); line += 64) {
            _mm_prefetch(kn + s * stride * sizeof(T) + line, _MM_HINT_T0);
            _mm_prefetch(vn + s * stride * sizeof(T) + line, _MM_HINT_T0);
          }
      }
      // Scores of this block's keys.
      for (int64_t s = lo; s < hi; ++s) {
        __m512 k[ND];
        for (int c = 0; c < ND; ++c) k[c] = load16(kb + s * stride + 16 * c);
        for (int g = 0; g < G; ++g) {
          __m512 dot = _mm512_mul_ps(qv[g][0], k[0]);
          for (int c = 1; c < ND; ++c) dot = _mm512_fmadd_ps(qv[g][c], k[c], dot);
          p[g][s] = _mm512_reduce_add_ps(dot);
        }
      }
      // Online softmax: rescale what was accumulated to the new running max.
      for (int g = 0; g < G; ++g) {
        float mx = m[g];
        for (int64_t s = lo; s < hi; ++s) mx = p[g][s] > mx ? p[g][s] : mx;
        const float corr = std::exp(m[g] - mx);  // 0 on the first block
        m[g] = mx;
        float sum = 0.f;
        for (int64_t s = lo; s < hi; s += 16) {
          const __mmask16 mask = hi - s >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << (hi - s)) - 1);
          const __m512 e = exp_nonpositive(_mm512_sub_ps(_mm512_maskz_loadu_ps(mask, p[g] + s), _mm512_set1_ps(mx)));
          _mm512_mask_storeu_ps(p[g] + s, mask, e);
          sum += _mm512_mask_reduce_add_ps(mask, e);
        }
        l[g] = l[g] * corr + sum;
        if (corr != 1.f)
          for (int c = 0; c < ND; ++c) acc[g][c] = _mm512_mul_ps(acc[g][c], _mm512_set1_ps(corr));
      }
      // Weighted values.
      for (int64_t s = lo; s < hi; ++s) {
        __m512 v[ND];
        for (int c = 0; c < ND; ++c) v[c] = load16(vb + s * stride + 16 * c);
        for (int g = 0; g < G; ++g) {
          const __m512 w = _mm512_set1_ps(p[g][s]);
          for (int c = 0; c < ND; ++c) acc[g][c] = _mm512_fmadd_ps(w, v[c], acc[g][c]);
        }
      }
    }
    for (int g = 0; g < G; ++g) {
      const __m512 inv = _mm512_set1_ps(1.f / l[g]);
      for (int c = 0; c < ND; ++c) store16(out + (b * Hq + h * G + g) * D + 16 * c, _mm512_mul_ps(acc[g][c], inv));
    }
  }
}

template <typename T, int D, int G = 1>
int dispatch_group(int64_t group, const float* q, const T* kc, const T* vc, const int64_t* bt, int64_t mb,
                   const int64_t* sl, float* out, int64_t B, int64_t Hkv, int64_t BS, float scale, int64_t window) {
  if (group == G) {
    decode_attention<T, D, G>(q, kc, vc, bt, mb, sl, out, B, Hkv, BS, scale, window);
    return 0;
  }
  if constexpr (G < kMaxGroup) return dispatch_group<T, D, G + 1>(group, q, kc, vc, bt, mb, sl, out, B, Hkv, BS, scale, window);
  return -1;
}

template <typename T>
int dispatch(const void* q, const void* kc, const void* vc, const int64_t* bt, int64_t mb,
             const int64_t* sl, void* out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
             int64_t BS, float scale, int64_t window) {
  if (Hq % Hkv || BS > kMaxBlock) return -1;
  auto args = [&](auto fn) {
    return fn(Hq / Hkv, static_cast<const float*>(q), static_cast<const T*>(kc), static_cast<const T*>(vc), bt, mb, sl,
              static_cast<float*>(out), B, Hkv, BS, scale, window);
  };
  switch (D) {
    case 64: return args(dispatch_group<T, 64>);
    case 128: return args(dispatch_group<T, 128>);
    case 256: return args(dispatch_group<T, 256>);
    default: return -1;
  }
}

}  // namespace

extern "C" int paged_decode_attention(int cache_bf16, const void* q, const void* k_cache,
                                      const void* v_cache, const int64_t* block_tables,
                                      int64_t max_blocks, const int64_t* seq_lens, void* out,
                                      int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t BS,
                                      float scale, int64_t window) {
  if (cache_bf16)
    return dispatch<uint16_t>(q, k_cache, v_cache, block_tables, max_blocks, seq_lens, out, B, Hq,
                              Hkv, D, BS, scale, window);
  return dispatch<float>(q, k_cache, v_cache, block_tables, max_blocks, seq_lens, out, B, Hq, Hkv,
                         D, BS, scale, window);
}

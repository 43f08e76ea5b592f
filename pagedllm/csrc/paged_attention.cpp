// Paged attention for decode on CPU: one query token per request, K/V read in place
// through the block table (no gather, no padding). Kwon et al. 2023, "Efficient Memory
// Management for Large Language Model Serving with PagedAttention", §4.1.
//
// Layouts: q, out [B, Hq, D]; caches [num_blocks, BS, Hkv, D]; block_tables [B, max_blocks];
// seq_lens [B]; window > 0: only the last `window` keys are read (sliding-window attention;
// keys at positions < seq_len - window are skipped), 0: all. Scores and accumulators are float32 whatever the storage dtype.
// Work is split over (request, kv head) pairs, so the G = Hq / Hkv query heads that share a
// KV head read its keys and values once.
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

namespace {

inline float to_float(float x) { return x; }
inline float to_float(uint16_t x) {  // bfloat16 bits -> float
  uint32_t u = static_cast<uint32_t>(x) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline void from_float(float x, float* dst) { *dst = x; }
inline void from_float(float x, uint16_t* dst) {  // round to nearest even
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u += 0x7FFF + ((u >> 16) & 1);
  *dst = static_cast<uint16_t>(u >> 16);
}

template <typename T, int D>
void decode_attention(const T* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                      int64_t max_blocks, const int64_t* seq_lens, T* out, int64_t B, int64_t Hq,
                      int64_t Hkv, int64_t BS, float scale, int64_t window) {
  const int64_t G = Hq / Hkv;
#pragma omp parallel
  {
    std::vector<float> scores;
    std::vector<float> qf(G * D), acc(G * D);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item = 0; item < B * Hkv; ++item) {
      const int64_t b = item / Hkv, h = item % Hkv;
      const int64_t S = seq_lens[b];
      const int64_t first = (window > 0 && S > window) ? S - window : 0;  // first key read
      const int64_t L = S - first;  // keys read
      const int64_t* table = block_tables + b * max_blocks;
      scores.resize(G * L);
      for (int64_t g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d) qf[g * D + d] = to_float(q[(b * Hq + h * G + g) * D + d]) * scale;

      for (int64_t i = 0; i < L; ++i) {
        const int64_t pos = first + i;
        const T* k = k_cache + ((table[pos / BS] * BS + pos % BS) * Hkv + h) * D;
        float kf[D];
        for (int d = 0; d < D; ++d) kf[d] = to_float(k[d]);
        for (int64_t g = 0; g < G; ++g) {
          float s = 0.f;
#pragma omp simd reduction(+ : s)
          for (int d = 0; d < D; ++d) s += qf[g * D + d] * kf[d];
          scores[g * L + i] = s;
        }
      }
      for (int64_t g = 0; g < G; ++g) {
        float* s = scores.data() + g * L;
        float m = s[0];
        for (int64_t i = 1; i < L; ++i) m = s[i] > m ? s[i] : m;
        float sum = 0.f;
        for (int64_t i = 0; i < L; ++i) {
          s[i] = std::exp(s[i] - m);
          sum += s[i];
        }
        const float inv = 1.f / sum;
        for (int64_t i = 0; i < L; ++i) s[i] *= inv;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t i = 0; i < L; ++i) {
        const int64_t pos = first + i;
        const T* v = v_cache + ((table[pos / BS] * BS + pos % BS) * Hkv + h) * D;
        float vf[D];
        for (int d = 0; d < D; ++d) vf[d] = to_float(v[d]);
        for (int64_t g = 0; g < G; ++g) {
          const float p = scores[g * L + i];
          for (int d = 0; d < D; ++d) acc[g * D + d] += p * vf[d];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int d = 0; d < D; ++d) from_float(acc[g * D + d], out + (b * Hq + h * G + g) * D + d);
    }
  }
}

template <typename T>
int dispatch(const void* q, const void* kc, const void* vc, const int64_t* bt, int64_t mb,
             const int64_t* sl, void* out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
             int64_t BS, float scale, int64_t window) {
  auto args = [&](auto fn) {
    fn(static_cast<const T*>(q), static_cast<const T*>(kc), static_cast<const T*>(vc), bt, mb, sl,
       static_cast<T*>(out), B, Hq, Hkv, BS, scale, window);
  };
  switch (D) {
    case 64: args(decode_attention<T, 64>); return 0;
    case 128: args(decode_attention<T, 128>); return 0;
    case 256: args(decode_attention<T, 256>); return 0;
    default: return -1;
  }
}

}  // namespace

extern "C" int paged_decode_attention(int is_bf16, const void* q, const void* k_cache,
                                      const void* v_cache, const int64_t* block_tables,
                                      int64_t max_blocks, const int64_t* seq_lens, void* out,
                                      int64_t B, int64_t Hq, int64_t Hkv, int64_t D, int64_t BS,
                                      float scale, int64_t window) {
  if (is_bf16)
    return dispatch<uint16_t>(q, k_cache, v_cache, block_tables, max_blocks, seq_lens, out, B, Hq,
                              Hkv, D, BS, scale, window);
  return dispatch<float>(q, k_cache, v_cache, block_tables, max_blocks, seq_lens, out, B, Hq, Hkv,
                         D, BS, scale, window);
}

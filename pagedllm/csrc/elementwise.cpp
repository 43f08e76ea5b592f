// The float32 elementwise steps of a decoder layer, each fused into one pass over its rows:
// residual add + RMSNorm, RoPE, SiLU-and-mul (GELU-and-mul), and the K/V write through the slot mapping;
// and greedy sampling's row-wise argmax.
// Why: in PyTorch each is several ops, a pass over memory and a dispatch apiece, which add up
// to most of a decode step's time outside the GEMMs and attention (docs/benchmarks.md).
// Rows are split over the thread team (parallel.h) only when there are enough of them to pay for it.
#include <stdint.h>

#include <cmath>
#include <cstring>
#include <type_traits>

#include "kv_rows.h"
#include "pagedllm_abi.h"
#include "parallel.h"
#include "vec.h"

using namespace vec;

namespace {

constexpr int64_t kParallelRows = 64;  // fewer rows: one thread (a parallel region costs more)
constexpr float kLaneIndex[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};

inline void store_row(float* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) store_first(dst + i, load_first(src + i, n - i), n - i);
}

inline void store_row(uint16_t* dst, const float* src, int64_t n) {
  for (int64_t i = 0; i < n; i += 16) store_bf16_first(dst + i, load_first(src + i, n - i), n - i);
}

// One head's D values (D a multiple of 16) as codes and their scale (kv_rows.h): scale =
// max|x| / the code's largest magnitude (127, e4m3's 448), rounded up to float16; code =
// x * (1 / scale) rounded to nearest even (at most the largest magnitude: the scale was rounded up).
template <typename T>
  requires kv::kQuantized<T>
inline void store_row(T* dst, const float* src, int64_t D) {
  constexpr float limit = std::is_same_v<T, int8_t> ? 127.f : 448.f;
  F32x16 amax = zero();
  for (int64_t i = 0; i < D; i += 16) amax = max(amax, abs(load(src + i)));
  const uint16_t scale_bits = kv::encode_scale(reduce_max(amax) * (1.f / limit));
  const float scale = kv::decode_scale(scale_bits);
  const F32x16 inv = set1(scale > 0.f ? 1.f / scale : 0.f);
  for (int64_t i = 0; i < D; i += 16) {
    const F32x16 y = mul(load(src + i), inv);
    if constexpr (std::is_same_v<T, int8_t>) {
      store_i8(dst + i, round_i32(y));
    } else {
      alignas(64) float ys[16];
      store(ys, y);
      for (int j = 0; j < 16; ++j) dst[i + j].bits = kv::encode_e4m3(ys[j]);
    }
  }
  std::memcpy(dst + D, &scale_bits, sizeof(scale_bits));
}

// Float rows are written whole (Hkv * D values), 8-bit ones head by head.
template <typename T>
void write_kv(const float* k, const float* v, int64_t ld, T* k_cache, T* v_cache, const int64_t* slots, int64_t n,
              int64_t Hkv, int64_t D) {
  const int64_t row = kv::row_width<T>(D);
  par::parallel_for(n, [&](int64_t t) {
    if constexpr (kv::kQuantized<T>) {
      for (int64_t h = 0; h < Hkv; ++h) {
        store_row(k_cache + (slots[t] * Hkv + h) * row, k + t * ld + h * D, D);
        store_row(v_cache + (slots[t] * Hkv + h) * row, v + t * ld + h * D, D);
      }
    } else {
      store_row(k_cache + slots[t] * Hkv * D, k + t * ld, Hkv * D);
      store_row(v_cache + slots[t] * Hkv * D, v + t * ld, Hkv * D);
    }
  }, kParallelRows);
}

// gate <- act(gate) * up over rows of [gate (I), up (I)], stride ld, in place.
template <F32x16 (*Act)(F32x16)>
void act_and_mul(float* gate_up, int64_t ld, int64_t T, int64_t I) {
  par::parallel_for(T, [&](int64_t t) {
    float* g = gate_up + t * ld;
    for (int64_t i = 0; i < I; i += 16)
      store_first(g + i, mul(Act(load_first(g + i, I - i)), load_first(g + I + i, I - i)), I - i);
  }, kParallelRows);
}

}  // namespace

extern "C" {

// residual[T, H] += x (x may be null: residual is the input as is); out = residual *
// rsqrt(mean(residual^2) + eps) * weight. Zhang & Sennrich 2019, "Root Mean Square Layer
// Normalization". All float32, rows contiguous.
void add_rms_norm(const float* x, float* residual, const float* weight, float* out, int64_t T, int64_t H, float eps) {
  par::parallel_for(T, [&](int64_t t) {
    float* r = residual + t * H;
    F32x16 ss = zero();
    for (int64_t i = 0; i < H; i += 16) {
      F32x16 v = load_first(r + i, H - i);
      if (x) {
        v = add(v, load_first(x + t * H + i, H - i));
        store_first(r + i, v, H - i);
      }
      ss = fma(v, v, ss);
    }
    const F32x16 scale = set1(1.f / std::sqrt(reduce_add(ss) / H + eps));
    for (int64_t i = 0; i < H; i += 16)
      store_first(out + t * H + i, mul(mul(load_first(r + i, H - i), scale), load_first(weight + i, H - i)), H - i);
  }, kParallelRows);
}

// RoPE in place, GPT-NeoX / HF rotate_half layout (Su et al. 2021, "RoFormer", §3.4): x has
// T rows (stride ldx) of `heads` heads of D floats, of which the leading R (even, at most D;
// fewer with partial rotary embeddings) are rotated; cos_sin: [T, 2, R], each token's cos
// and sin with rotate_half's sign folded in (negated in the first half).
// x1' = x1 cos + x2 sin_signed, x2' = x2 cos + x1 sin_signed, for the halves x1, x2 of a
// head's R rotated dims; its D - R others unchanged. Then, with `scale` ([heads, D], or null:
// none), each head's values, all D, times its row of scale (an int8 cache's query and key
// channel scales, layers/key_scales.py), as a second multiply.
void rotary_inplace(float* x, int64_t ldx, const float* cos_sin, int64_t T, int64_t heads, int64_t D, int64_t R,
                    const float* scale) {
  const int64_t half = R / 2;
  par::parallel_for(T, [&](int64_t t) {
    const float* c = cos_sin + t * 2 * R;
    const float* s = c + R;
    for (int64_t h = 0; h < heads; ++h) {
      float* x1 = x + t * ldx + h * D;
      float* x2 = x1 + half;
      for (int64_t i = 0; i < half; i += 16) {
        const int64_t n = half - i;
        const F32x16 a = load_first(x1 + i, n), b = load_first(x2 + i, n);
        F32x16 y1 = fma(b, load_first(s + i, n), mul(a, load_first(c + i, n)));
        F32x16 y2 = fma(a, load_first(s + half + i, n), mul(b, load_first(c + half + i, n)));
        if (scale) {
          y1 = mul(y1, load_first(scale + h * D + i, n));
          y2 = mul(y2, load_first(scale + h * D + half + i, n));
        }
        store_first(x1 + i, y1, n);
        store_first(x2 + i, y2, n);
      }
      if (scale)  // the unrotated dims: the multiply alone
        for (int64_t i = R; i < D; i += 16)
          store_first(x1 + i, mul(load_first(x1 + i, D - i), load_first(scale + h * D + i, D - i)), D - i);
    }
  }, kParallelRows);
}

// gate_up: T rows (stride ld) of [gate (I floats), up (I floats)]; gate <- silu(gate) * up,
// in place (the down projection reads the gate half as strided rows).
void silu_and_mul(float* gate_up, int64_t ld, int64_t T, int64_t I) { act_and_mul<silu>(gate_up, ld, T, I); }

// The same with GELU's tanh approximation (Gemma 3's MLP): gate <- gelu_tanh(gate) * up.
void gelu_tanh_and_mul(float* gate_up, int64_t ld, int64_t T, int64_t I) { act_and_mul<gelu_tanh>(gate_up, ld, T, I); }

// This step's K and V (n rows of Hkv heads of D floats, row stride ld) into their cache
// slots: k_cache[slots[t]] = k[t], likewise V, in the cache's kind (float32; bfloat16 rounded
// to nearest even; int8 or fp8 e4m3 codes with a scale per head, kv_rows.h). The 8-bit rows
// are quantized here, once: nothing rewrites a slot's row until its block is freed.
int write_kv_cache(int cache_kind, const float* k, const float* v, int64_t ld, void* k_cache, void* v_cache,
                   const int64_t* slots, int64_t n, int64_t Hkv, int64_t D) {
  auto run = [&](auto* typed) {
    using T = std::remove_pointer_t<decltype(typed)>;
    if (kv::kQuantized<T> && D % 16) return -1;
    write_kv(k, v, ld, static_cast<T*>(k_cache), static_cast<T*>(v_cache), slots, n, Hkv, D);
    return 0;
  };
  return kv::with_cache_kind(cache_kind, run);
}

// out[r] = the first index of the largest of x[r, 0..n) (rows of stride n), as torch.argmax.
// Why: torch's CPU max/argmax reduction reads logits far below memory bandwidth (docs/benchmarks.md).
// Indices are carried as float32 lanes: exact below 2^24, far above any vocabulary.
void argmax_rows(const float* x, int64_t rows, int64_t n, int64_t* out) {
  par::parallel_for(rows, [&](int64_t r) {
    const float* row = x + r * n;
    F32x16 best = set1(-3.4e38f), best_i = zero();
    F32x16 idx = load(kLaneIndex);
    for (int64_t i = 0; i < n; i += 16) {  // per lane: the first index of its largest value
      const F32x16 v = load_first(row + i, n - i, -3.4e38f);
      const M16 greater = gt(v, best);
      best = select(greater, v, best);
      best_i = select(greater, idx, best_i);
      idx = add(idx, set1(16.f));
    }
    alignas(64) float values[16], indices[16];
    store(values, best), store(indices, best_i);
    const float top = reduce_max(best);
    float first = 3.4e38f;
    for (int l = 0; l < 16; ++l)
      if (values[l] == top && indices[l] < first) first = indices[l];
    out[r] = static_cast<int64_t>(first);
  }, 4);
}

}  // extern "C"

// The K/V cache's row formats, per cache kind (pagedllm_abi.h's PAGEDLLM_CACHE_*): how the
// attention kernels read one head's row of D values and how the K/V write stores it.
// - float32, bfloat16: D values.
// - int8, fp8 (e4m3): D one-byte codes, then the row's float16 scale (PAGEDLLM_KV_SCALE_BYTES);
//   value = code * scale. One scale per token and KV head, set when the row is written (the
//   row's max |x| over the code's largest magnitude, 127 or e4m3's 448, rounded up to float16,
//   so that no code exceeds it) and never changed: a row is quantized once, and a block's rows
//   never share a scale that a later token could outgrow. The scale sits after its codes, in
//   the row's own cache lines.
// Kernels take the row's codes unscaled (load16) and fold the scale into one multiply per row
// (a score, a softmax weight) where they can, or widen it scaled (load16_scaled).
#pragma once

#include <stdint.h>

#include <cmath>
#include <cstring>
#include <type_traits>

#include "pagedllm_abi.h"
#include "vec.h"

namespace kv {

struct E4M3 {  // one fp8 e4m3 code
  uint8_t bits;
};

template <typename T>
inline constexpr bool kQuantized = std::is_same_v<T, int8_t> || std::is_same_v<T, E4M3>;

// Whether the attention kernels multiply a cache of T's rows as integer codes (int8: its
// scores against quantize_query's codes, below), on every ISA.
template <typename T>
inline constexpr bool kIntCodes = std::is_same_v<T, int8_t>;

// Elements of T from one head's row to the next in a slot (D, or D + the scale's bytes).
template <typename T>
constexpr int64_t row_width(int64_t D) {
  return kQuantized<T> ? D + PAGEDLLM_KV_SCALE_BYTES : D;
}

// The smallest float16 >= s for s >= 0, saturated at 65504 (the largest float16): an 8-bit
// row's scale.
inline uint16_t encode_scale(float s) {
  s = std::fmin(s, 65504.f);
  if (s < 0x1p-14f) return uint16_t(std::ceil(s * 0x1p24f));  // zero, subnormal: steps of 2^-24 (1024: 2^-14)
  uint32_t b;
  std::memcpy(&b, &s, sizeof(b));
  b += 0x1FFF;  // up to 10 mantissa bits (a carry raises the exponent)
  return uint16_t((((b >> 23) - 112) << 10) | ((b >> 13) & 0x3FF));  // exponent rebiased 127 -> 15
}

// The value of a non-negative float16 (an 8-bit row's scale; infinity and NaN kept).
inline float decode_scale(uint16_t h) {
  if (h < 0x400) return float(h) * 0x1p-24f;  // zero, subnormal
  const uint32_t b = (uint32_t(h) << 13) + ((h >= 0x7C00 ? 224u : 112u) << 23);  // exponent 15 -> 127 (31 -> 255)
  float s;
  std::memcpy(&s, &b, sizeof(s));
  return s;
}

// The scale of the row at p (1 for float rows).
template <typename T>
inline float row_scale(const T* p, int64_t D) {
  if constexpr (kQuantized<T>) {
    uint16_t h;
    std::memcpy(&h, p + D, sizeof(h));
    return decode_scale(h);
  } else {
    return 1.f;
  }
}

// The scales of the 16 rows at cache + rows[s] of an 8-bit cache, lane s: row s's (one vector
// conversion of the 16 float16 values); lanes outside [lo, hi) are 0, their rows not read.
template <typename T>
  requires kQuantized<T>
inline vec::F32x16 row_scales16(const T* cache, const int64_t* rows, int64_t D, int64_t lo = 0, int64_t hi = 16) {
  alignas(64) uint16_t h[16];
  for (int s = 0; s < 16; ++s) {
    h[s] = 0;
    if (s >= lo && s < hi) std::memcpy(&h[s], cache + rows[s] + D, sizeof(h[s]));
  }
  return vec::load_f16(h);
}

// 16 values of a row from p, widened to float32 (codes unscaled).
inline vec::F32x16 load16(const float* p) { return vec::load(p); }
inline vec::F32x16 load16(const uint16_t* p) { return vec::load_bf16(p); }
inline vec::F32x16 load16(const int8_t* p) { return vec::load_s8_f32(p); }
inline vec::F32x16 load16(const E4M3* p) { return vec::load_e4m3(&p->bits); }

// The same times the row's scale s (the values as stored; s = 1 for float rows is skipped).
template <typename T>
inline vec::F32x16 load16_scaled(const T* p, float s) {
  if constexpr (kQuantized<T>) return vec::mul(load16(p), vec::set1(s));
  else return load16(p);
}

// Scores over an int8 cache are integer dot products of key codes with query codes: each
// query head's D values times the softmax scale (x = q * scale) become D codes in [-127, 127],
// code = x * (127 / max|x|) rounded to nearest even, and the returned code scale max|x| / 127
// (0, with 0 codes, for a zero row); a score is then (codes . key codes) * code scale * the
// key row's scale. D: a multiple of 16.
template <int D>
inline float quantize_query(const float* q, float scale, int8_t* codes) {
  using namespace vec;
  F32x16 x[D / 16], a = zero();
  for (int c = 0; c < D / 16; ++c) {
    x[c] = mul(load(q + 16 * c), set1(scale));
    a = max(a, abs(x[c]));
  }
  const float amax = reduce_max(a);
  const F32x16 inv = set1(amax > 0.f ? 127.f / amax : 0.f);
  for (int c = 0; c < D / 16; ++c) store_i8(codes + 16 * c, round_i32(mul(x[c], inv)));
  return amax / 127.f;
}

// A tile's largest softmax weight at or below which its weights' codes are 0 (pagedllm_abi.h's
// PAGEDLLM_INT8_WEIGHT_FLOOR_EXP): 2^-120.
inline constexpr float kWeightFloor = [] {
  float f = 1.f;
  for (int e = 0; e > PAGEDLLM_INT8_WEIGHT_FLOOR_EXP; --e) f *= 0.5f;
  return f;
}();

// p.V over an int8 cache (decode and prefill alike) takes a tile's softmax weights w (times
// their value rows' scales) as codes in [0, 127]: round_i32(w * inv), inv = 127 / mx for the
// tile's largest weight mx (0 where mx <= kWeightFloor: every code 0), the codes' scale
// mx / 127. Per lane: mx may differ between lanes, or be one value in all of them.
struct WeightCodeScale {
  vec::F32x16 inv, scale;
};
inline WeightCodeScale weight_code_scale(vec::F32x16 mx) {
  using namespace vec;
  return {select(gt(mx, set1(kWeightFloor)), div(set1(127.f), mx), zero()), div(mx, set1(127.f))};
}

// fn(static_cast<T*>(nullptr)) with T the element type of `cache_kind`'s rows
// (PAGEDLLM_CACHE_*: float, bfloat16 bits, int8, E4M3); -1 for any other kind.
template <typename Fn>
inline int with_cache_kind(int cache_kind, Fn&& fn) {
  switch (cache_kind) {
    case PAGEDLLM_CACHE_F32: return fn(static_cast<float*>(nullptr));
    case PAGEDLLM_CACHE_BF16: return fn(static_cast<uint16_t*>(nullptr));
    case PAGEDLLM_CACHE_INT8: return fn(static_cast<int8_t*>(nullptr));
    case PAGEDLLM_CACHE_FP8: return fn(static_cast<E4M3*>(nullptr));
    default: return -1;
  }
}

// float -> e4m3 rounded to nearest even, |y| saturated at 448 (y finite), as torch's
// float8_e4m3fn conversion rounds.
inline uint8_t encode_e4m3(float y) {
  uint32_t u;
  std::memcpy(&u, &y, sizeof(u));
  const uint8_t sign = uint8_t((u >> 24) & 0x80);
  const float a = y < 0.f ? -y : y;
  if (a >= 448.f) return sign | 0x7E;
  if (a < 0.015625f) return sign | uint8_t(std::nearbyint(a * 512.f));  // below 2^-6: steps of 2^-9 (8: 2^-6)
  uint32_t b;
  std::memcpy(&b, &a, sizeof(b));
  b += 0x7FFFF + ((b >> 20) & 1);  // to 3 mantissa bits, nearest even
  const uint32_t code = ((((b >> 23) - 120) << 3) | ((b >> 20) & 7));  // exponent rebiased 127 -> 7
  return sign | uint8_t(code > 0x7E ? 0x7E : code);
}

}  // namespace kv

// vec.h on ARM NEON (aarch64: Apple silicon, AWS Graviton, Ampere): four q registers per
// F32x16. The int8 dot product is sdot (vdotq_s32, s8 x s8) where the target has the dotprod
// extension (Armv8.2+), else widening multiplies (smull) and pairwise adds; 4-bit weight codes
// in [0, 15] are valid s8, so the same instructions take them.
#pragma once

#include <arm_neon.h>
#include <stdint.h>

#include <cstring>

namespace vec {

inline constexpr const char* kName = "neon";
inline constexpr int kF32Regs = 8;
inline constexpr int kGemmRowsF32 = 2;  // 16 accumulators + 8 weight registers of 32
inline constexpr int kGemmRowsI8 = 2;
inline constexpr int kGemmRowsI8Wide = 0;  // no int16 prefill tile: sdot, or widening multiplies, at every M
inline constexpr int kGemmRowsQ4 = 2;
inline constexpr int kGemmRowsKQ = 2;
inline constexpr int kKQuantRecordFrom = 2;  // as AVX2's (not measured on an ARM core)

struct F32x16 { float32x4_t v[4]; };
struct I32x16 { int32x4_t v[4]; };
struct DotWX;  // declared for gemm.h's tile_w8a8_wide, which is never instantiated here
struct WideW;
DotWX dot_wide_prepare(const int32_t* pair);
WideW dot_wide_load(const int16_t* w);
I32x16 dot_wide(I32x16 acc, const DotWX& x, WideW w);
struct M16 { uint32x4_t v[4]; };

inline F32x16 zero() { return {{vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f), vdupq_n_f32(0.f)}}; }
inline F32x16 set1(float x) { return {{vdupq_n_f32(x), vdupq_n_f32(x), vdupq_n_f32(x), vdupq_n_f32(x)}}; }
inline F32x16 load(const float* p) { return {{vld1q_f32(p), vld1q_f32(p + 4), vld1q_f32(p + 8), vld1q_f32(p + 12)}}; }
inline void store(float* p, F32x16 a) {
  for (int i = 0; i < 4; ++i) vst1q_f32(p + 4 * i, a.v[i]);
}

inline M16 mask_range(int lo, int hi) {
  M16 m;
  for (int i = 0; i < 4; ++i) {
    const int32x4_t lane = vaddq_s32(int32x4_t{0, 1, 2, 3}, vdupq_n_s32(4 * i));
    m.v[i] = vandq_u32(vcgeq_s32(lane, vdupq_n_s32(lo)), vcltq_s32(lane, vdupq_n_s32(hi)));
  }
  return m;
}
inline M16 mask_first(int64_t n) { return mask_range(0, n >= 16 ? 16 : n <= 0 ? 0 : int(n)); }
inline M16 operator&(M16 a, M16 b) {
  for (int i = 0; i < 4; ++i) a.v[i] = vandq_u32(a.v[i], b.v[i]);
  return a;
}
inline bool any(M16 a) { return vmaxvq_u32(vorrq_u32(vorrq_u32(a.v[0], a.v[1]), vorrq_u32(a.v[2], a.v[3]))) != 0; }

inline F32x16 load_first(const float* p, int64_t n) {
  if (n >= 16) return load(p);
  float tmp[16] = {};
  if (n > 0) std::memcpy(tmp, p, size_t(n) * sizeof(float));
  return load(tmp);
}
inline void store_first(float* p, F32x16 a, int64_t n) {
  if (n >= 16) return store(p, a);
  float tmp[16];
  store(tmp, a);
  if (n > 0) std::memcpy(p, tmp, size_t(n) * sizeof(float));
}

inline F32x16 load_bf16(const uint16_t* p) {
  const uint16x8_t a = vld1q_u16(p), b = vld1q_u16(p + 8);
  return {{vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(a), 16)), vreinterpretq_f32_u32(vshll_high_n_u16(a, 16)),
           vreinterpretq_f32_u32(vshll_n_u16(vget_low_u16(b), 16)), vreinterpretq_f32_u32(vshll_high_n_u16(b, 16))}};
}
inline uint16x4_t round_bf16(float32x4_t a) {  // round to nearest even
  const uint32x4_t u = vreinterpretq_u32_f32(a);
  const uint32x4_t odd = vandq_u32(vshrq_n_u32(u, 16), vdupq_n_u32(1));
  return vmovn_u32(vshrq_n_u32(vaddq_u32(u, vaddq_u32(vdupq_n_u32(0x7FFF), odd)), 16));
}
inline void store_bf16_first(uint16_t* p, F32x16 a, int64_t n) {
  uint16_t tmp[16];
  vst1q_u16(tmp, vcombine_u16(round_bf16(a.v[0]), round_bf16(a.v[1])));
  vst1q_u16(tmp + 8, vcombine_u16(round_bf16(a.v[2]), round_bf16(a.v[3])));
  if (n > 0) std::memcpy(p, tmp, size_t(n >= 16 ? 16 : n) * sizeof(uint16_t));
}

#define PAGEDLLM_VEC_BINARY(name, op)                          \
  inline F32x16 name(F32x16 a, F32x16 b) {                     \
    for (int i = 0; i < 4; ++i) a.v[i] = op(a.v[i], b.v[i]); \
    return a;                                                  \
  }
PAGEDLLM_VEC_BINARY(add, vaddq_f32)
PAGEDLLM_VEC_BINARY(sub, vsubq_f32)
PAGEDLLM_VEC_BINARY(mul, vmulq_f32)
PAGEDLLM_VEC_BINARY(div, vdivq_f32)
PAGEDLLM_VEC_BINARY(max, vmaxq_f32)
#undef PAGEDLLM_VEC_BINARY
inline F32x16 fma(F32x16 a, F32x16 b, F32x16 c) {
  for (int i = 0; i < 4; ++i) c.v[i] = vfmaq_f32(c.v[i], a.v[i], b.v[i]);
  return c;
}
inline F32x16 abs(F32x16 a) {
  for (int i = 0; i < 4; ++i) a.v[i] = vabsq_f32(a.v[i]);
  return a;
}
inline F32x16 floor(F32x16 a) {
  for (int i = 0; i < 4; ++i) a.v[i] = vrndmq_f32(a.v[i]);
  return a;
}
inline F32x16 ldexp(F32x16 p, F32x16 n) {  // n integral, the result normal: add n to the exponent
  for (int i = 0; i < 4; ++i)
    p.v[i] = vreinterpretq_f32_s32(vaddq_s32(vreinterpretq_s32_f32(p.v[i]), vshlq_n_s32(vcvtq_s32_f32(n.v[i]), 23)));
  return p;
}
inline float reduce_add(F32x16 a) { return vaddvq_f32(vaddq_f32(vaddq_f32(a.v[0], a.v[1]), vaddq_f32(a.v[2], a.v[3]))); }
inline float reduce_max(F32x16 a) { return vmaxvq_f32(vmaxq_f32(vmaxq_f32(a.v[0], a.v[1]), vmaxq_f32(a.v[2], a.v[3]))); }
// Lane i = reduce_add(v[i]).
inline F32x16 reduce_add16(const F32x16 (&v)[16]) {
  float s[16];
  for (int i = 0; i < 16; ++i) s[i] = reduce_add(v[i]);
  return load(s);
}

#define PAGEDLLM_VEC_CMP(name, op)                             \
  inline M16 name(F32x16 a, F32x16 b) {                        \
    M16 m;                                                     \
    for (int i = 0; i < 4; ++i) m.v[i] = op(a.v[i], b.v[i]); \
    return m;                                                  \
  }
PAGEDLLM_VEC_CMP(lt, vcltq_f32)
PAGEDLLM_VEC_CMP(gt, vcgtq_f32)
PAGEDLLM_VEC_CMP(le, vcleq_f32)
PAGEDLLM_VEC_CMP(eq, vceqq_f32)
#undef PAGEDLLM_VEC_CMP
inline F32x16 select(M16 m, F32x16 a, F32x16 b) {
  for (int i = 0; i < 4; ++i) a.v[i] = vbslq_f32(m.v[i], a.v[i], b.v[i]);
  return a;
}
inline F32x16 maskz(M16 m, F32x16 a) {
  for (int i = 0; i < 4; ++i) a.v[i] = vreinterpretq_f32_u32(vandq_u32(m.v[i], vreinterpretq_u32_f32(a.v[i])));
  return a;
}

// The transpose-and-add tree (see vec_avx512.h). Layouts here: after N = 1 each key's 8
// partial sums in two q registers; after N = 2 one key per q register; after N = 4 two
// adjacent lanes per key; N = 8: key s in lane s.
template <int N>
inline F32x16 merge(F32x16 a, F32x16 b) {
  if constexpr (N <= 2) {
    return {{vaddq_f32(a.v[0], a.v[1]), vaddq_f32(a.v[2], a.v[3]), vaddq_f32(b.v[0], b.v[1]), vaddq_f32(b.v[2], b.v[3])}};
  } else {
    return {{vpaddq_f32(a.v[0], a.v[1]), vpaddq_f32(a.v[2], a.v[3]), vpaddq_f32(b.v[0], b.v[1]), vpaddq_f32(b.v[2], b.v[3])}};
  }
}

inline float32x4_t dup_f16(const uint8_t* p) {  // the float16 at p (unaligned) in every lane
  uint16_t h;
  std::memcpy(&h, p, 2);
  return vcvt_f32_f16(vreinterpret_f16_u16(vdup_n_u16(h)));
}
inline F32x16 halves_f16(const uint8_t* a, const uint8_t* b) {
  const float32x4_t x = dup_f16(a), y = dup_f16(b);
  return {{x, x, y, y}};
}
inline F32x16 load_f16(const uint16_t* p) {
  F32x16 r;
  for (int i = 0; i < 4; ++i) r.v[i] = vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p + 4 * i)));
  return r;
}

inline F32x16 f16_pairs(const uint8_t* p, int64_t stride, int n) {
  uint16_t h[8] = {};
  for (int i = 0; i < n; ++i) std::memcpy(&h[i], p + i * stride, 2);
  const uint16x8_t v = vld1q_u16(h);
  const uint16x8_t lo = vzip1q_u16(v, v), hi = vzip2q_u16(v, v);
  F32x16 r;
  r.v[0] = vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(lo)));
  r.v[1] = vcvt_f32_f16(vreinterpret_f16_u16(vget_high_u16(lo)));
  r.v[2] = vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(hi)));
  r.v[3] = vcvt_f32_f16(vreinterpret_f16_u16(vget_high_u16(hi)));
  return r;
}

inline I32x16 zero_i32() { return {{vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)}}; }
inline I32x16 splat_i32(int32_t a) { return {{vdupq_n_s32(a), vdupq_n_s32(a), vdupq_n_s32(a), vdupq_n_s32(a)}}; }
inline I32x16 round_i32(F32x16 a) { return {{vcvtnq_s32_f32(a.v[0]), vcvtnq_s32_f32(a.v[1]), vcvtnq_s32_f32(a.v[2]), vcvtnq_s32_f32(a.v[3])}}; }
inline F32x16 to_f32(I32x16 a) { return {{vcvtq_f32_s32(a.v[0]), vcvtq_f32_s32(a.v[1]), vcvtq_f32_s32(a.v[2]), vcvtq_f32_s32(a.v[3])}}; }
inline void store_i8(int8_t* p, I32x16 a) {
  const int16x8_t lo = vcombine_s16(vqmovn_s32(a.v[0]), vqmovn_s32(a.v[1]));
  const int16x8_t hi = vcombine_s16(vqmovn_s32(a.v[2]), vqmovn_s32(a.v[3]));
  vst1q_s8(p, vcombine_s8(vqmovn_s16(lo), vqmovn_s16(hi)));
}

struct DotX { int8x16_t x; };  // the 4 x values, in every 32-bit lane
inline DotX dot_prepare(const int32_t* quad) { return {vreinterpretq_s8_s32(vld1q_dup_s32(quad))}; }
inline I32x16 dot_init(const int32_t*) { return {{vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0), vdupq_n_s32(0)}}; }
inline int32x4_t dot4(int32x4_t acc, int8x16_t w, int8x16_t x) {  // acc[l] += sum_j x[j] * w[4 l + j]
#ifdef __ARM_FEATURE_DOTPROD
  return vdotq_s32(acc, w, x);
#else
  const int16x8_t lo = vmull_s8(vget_low_s8(w), vget_low_s8(x)), hi = vmull_high_s8(w, x);
  return vaddq_s32(acc, vpaddq_s32(vpaddlq_s16(lo), vpaddlq_s16(hi)));
#endif
}
inline I32x16 dot(I32x16 acc, DotX x, const int8_t* w) {
  for (int i = 0; i < 4; ++i) acc.v[i] = dot4(acc.v[i], vld1q_s8(w + 16 * i), x.x);
  return acc;
}

struct Q4W { int8x16_t lo[4], hi[4]; };  // columns 0-15 and 16-31, 4 codes per int32 lane
inline Q4W dot_q4_load(const uint8_t* nibbles64) {
  Q4W w;
  for (int i = 0; i < 4; ++i) {
    const uint8x16_t v = vld1q_u8(nibbles64 + 16 * i);
    w.lo[i] = vreinterpretq_s8_u8(vandq_u8(v, vdupq_n_u8(0x0F)));
    w.hi[i] = vreinterpretq_s8_u8(vshrq_n_u8(v, 4));
  }
  return w;
}
inline Q4W dot_u8_load(const uint8_t* codes128) {  // codes <= 127 are valid s8
  Q4W w;
  for (int i = 0; i < 4; ++i) w.lo[i] = vld1q_s8(reinterpret_cast<const int8_t*>(codes128) + 16 * i),
                              w.hi[i] = vld1q_s8(reinterpret_cast<const int8_t*>(codes128) + 64 + 16 * i);
  return w;
}
inline void store_q4w(uint8_t* codes128, const Q4W& w) {
  for (int i = 0; i < 4; ++i) vst1q_s8(reinterpret_cast<int8_t*>(codes128) + 16 * i, w.lo[i]),
                              vst1q_s8(reinterpret_cast<int8_t*>(codes128) + 64 + 16 * i, w.hi[i]);
}
using DotQ4X = DotX;
inline DotQ4X dot_q4_prepare(const int32_t* quad) { return dot_prepare(quad); }
using Q4Sum = I32x16;  // sdot (or the widening multiplies) sums into int32 directly
inline Q4Sum q4sum_zero() { return zero_i32(); }
inline I32x16 q4sum_i32(Q4Sum s) { return s; }
inline I32x16 q4sum_add(I32x16 acc, Q4Sum s) {
  for (int i = 0; i < 4; ++i) acc.v[i] = vaddq_s32(acc.v[i], s.v[i]);
  return acc;
}
inline constexpr int q4sum_steps(int) { return 1 << 20; }
inline void dot_q4(Q4Sum& lo, Q4Sum& hi, DotQ4X x, const Q4W& w) {
  for (int i = 0; i < 4; ++i) lo.v[i] = dot4(lo.v[i], w.lo[i], x.x), hi.v[i] = dot4(hi.v[i], w.hi[i], x.x);
}

// Bytes of GGUF blocks (the K-quant GEMM): four q registers of 16 bytes.
struct U8x64 { uint8x16_t v[4]; };
inline U8x64 load_u8x64(const uint8_t* p) { return {{vld1q_u8(p), vld1q_u8(p + 16), vld1q_u8(p + 32), vld1q_u8(p + 48)}}; }
inline void store_u8x64(uint8_t* p, U8x64 a) {
  for (int i = 0; i < 4; ++i) vst1q_u8(p + 16 * i, a.v[i]);
}
inline U8x64 load_2x32(const uint8_t* a, const uint8_t* b) { return {{vld1q_u8(a), vld1q_u8(a + 16), vld1q_u8(b), vld1q_u8(b + 16)}}; }
inline U8x64 dup32(const uint8_t* p) { return load_2x32(p, p); }
inline U8x64 splat_u32(uint32_t v) {
  const uint8x16_t x = vreinterpretq_u8_u32(vdupq_n_u32(v));
  return {{x, x, x, x}};
}
inline U8x64 pack_u8x4(I32x16 a, I32x16 b, I32x16 c, I32x16 d) {
  U8x64 r;
  for (int i = 0; i < 4; ++i)
    r.v[i] = vreinterpretq_u8_s32(vorrq_s32(vorrq_s32(a.v[i], vshlq_n_s32(b.v[i], 8)),
                                            vorrq_s32(vshlq_n_s32(c.v[i], 16), vshlq_n_s32(d.v[i], 24))));
  return r;
}
inline void interleave_rows4(const int8_t* const r[4], int8_t* out) {
  for (int q = 0; q < 4; ++q) {  // each 16-byte quarter, as x86's unpacks per 128-bit lane
    const int8x16_t a = vld1q_s8(r[0] + 16 * q), b = vld1q_s8(r[1] + 16 * q);
    const int8x16_t c = vld1q_s8(r[2] + 16 * q), d = vld1q_s8(r[3] + 16 * q);
    const int16x8_t ab_lo = vreinterpretq_s16_s8(vzip1q_s8(a, b)), ab_hi = vreinterpretq_s16_s8(vzip2q_s8(a, b));
    const int16x8_t cd_lo = vreinterpretq_s16_s8(vzip1q_s8(c, d)), cd_hi = vreinterpretq_s16_s8(vzip2q_s8(c, d));
    const int16x8_t parts[4] = {vzip1q_s16(ab_lo, cd_lo), vzip2q_s16(ab_lo, cd_lo), vzip1q_s16(ab_hi, cd_hi),
                                vzip2q_s16(ab_hi, cd_hi)};
    for (int m = 0; m < 4; ++m) vst1q_s8(out + 64 * m + 16 * q, vreinterpretq_s8_s16(parts[m]));
  }
}
inline U8x64 shr_and_halves(U8x64 a, int lo, int hi, uint8_t mask) {
  const int8x16_t slo = vdupq_n_s8(int8_t(-lo)), shi = vdupq_n_s8(int8_t(-hi));
  const uint8x16_t m = vdupq_n_u8(mask);
  for (int i = 0; i < 4; ++i) a.v[i] = vandq_u8(vshlq_u8(a.v[i], i < 2 ? slo : shi), m);
  return a;
}
inline U8x64 shr_and(U8x64 a, int n, uint8_t mask) { return shr_and_halves(a, n, n, mask); }
inline U8x64 shl_u8(U8x64 a, int n) {
  for (int i = 0; i < 4; ++i) a.v[i] = vshlq_u8(a.v[i], vdupq_n_s8(int8_t(n)));
  return a;
}
inline U8x64 or_u8(U8x64 a, U8x64 b) {
  for (int i = 0; i < 4; ++i) a.v[i] = vorrq_u8(a.v[i], b.v[i]);
  return a;
}
inline U8x64 nibbles_2x16(const uint8_t* a, const uint8_t* b) {
  const uint8x16_t x = vld1q_u8(a), y = vld1q_u8(b), low = vdupq_n_u8(0x0F);
  return {{vandq_u8(x, low), vshrq_n_u8(x, 4), vandq_u8(y, low), vshrq_n_u8(y, 4)}};
}
inline void transpose_u32(U8x64 (&v)[16]) {
  uint32x4_t w[16][4];  // row i, words 4 q .. 4 q + 3
  for (int i = 0; i < 16; ++i)
    for (int q = 0; q < 4; ++q) w[i][q] = vreinterpretq_u32_u8(v[i].v[q]);
  for (int a = 0; a < 4; ++a)    // rows 4a .. 4a + 3
    for (int q = 0; q < 4; ++q) {  // words 4q .. 4q + 3: a 4 x 4 transpose, to v[4q + j].v[a]
      const uint32x4_t r0 = w[4 * a][q], r1 = w[4 * a + 1][q], r2 = w[4 * a + 2][q], r3 = w[4 * a + 3][q];
      const uint64x2_t t0 = vreinterpretq_u64_u32(vtrn1q_u32(r0, r1)), t1 = vreinterpretq_u64_u32(vtrn2q_u32(r0, r1));
      const uint64x2_t t2 = vreinterpretq_u64_u32(vtrn1q_u32(r2, r3)), t3 = vreinterpretq_u64_u32(vtrn2q_u32(r2, r3));
      v[4 * q].v[a] = vreinterpretq_u8_u64(vtrn1q_u64(t0, t2)), v[4 * q + 1].v[a] = vreinterpretq_u8_u64(vtrn1q_u64(t1, t3));
      v[4 * q + 2].v[a] = vreinterpretq_u8_u64(vtrn2q_u64(t0, t2)), v[4 * q + 3].v[a] = vreinterpretq_u8_u64(vtrn2q_u64(t1, t3));
    }
}
inline U8x64 bits_to_bytes(uint64_t bits, uint8_t value) {
  const uint8x16_t bit = {1, 2, 4, 8, 16, 32, 64, 128, 1, 2, 4, 8, 16, 32, 64, 128};
  U8x64 r;
  for (int i = 0; i < 4; ++i) {  // register i: bits 16 i .. 16 i + 15
    const uint8x16_t spread = vcombine_u8(vdup_n_u8(uint8_t(bits >> (16 * i))), vdup_n_u8(uint8_t(bits >> (16 * i + 8))));
    r.v[i] = vandq_u8(vtstq_u8(spread, bit), vdupq_n_u8(value));
  }
  return r;
}
inline void dot_q4_bits(Q4W& w, uint64_t lo, uint64_t hi, uint8_t value) {
  const U8x64 a = bits_to_bytes(lo, value), b = bits_to_bytes(hi, value);
  for (int i = 0; i < 4; ++i)
    w.lo[i] = vorrq_s8(w.lo[i], vreinterpretq_s8_u8(a.v[i])), w.hi[i] = vorrq_s8(w.hi[i], vreinterpretq_s8_u8(b.v[i]));
}
inline F32x16 u8_f32(uint8x16_t v) {  // 16 bytes widened to float
  const uint16x8_t lo = vmovl_u8(vget_low_u8(v)), hi = vmovl_high_u8(v);
  return {{vcvtq_f32_u32(vmovl_u16(vget_low_u16(lo))), vcvtq_f32_u32(vmovl_high_u16(lo)),
           vcvtq_f32_u32(vmovl_u16(vget_low_u16(hi))), vcvtq_f32_u32(vmovl_high_u16(hi))}};
}
inline F32x16 load_u8_f32(const uint8_t* p) { return u8_f32(vld1q_u8(p)); }
inline F32x16 u8_f32(uint64_t lo, uint64_t hi) { return u8_f32(vcombine_u8(vcreate_u8(lo), vcreate_u8(hi))); }
inline F32x16 load_s8_f32(const int8_t* p) {
  const int8x16_t v = vld1q_s8(p);
  const int16x8_t lo = vmovl_s8(vget_low_s8(v)), hi = vmovl_high_s8(v);
  return {{vcvtq_f32_s32(vmovl_s16(vget_low_s16(lo))), vcvtq_f32_s32(vmovl_high_s16(lo)),
           vcvtq_f32_s32(vmovl_s16(vget_low_s16(hi))), vcvtq_f32_s32(vmovl_high_s16(hi))}};
}
// e4m3's bits moved into float16's, as in vec_avx512.h, converted by the hardware, times 2^8.
inline F32x16 load_e4m3(const uint8_t* p) {
  const uint8x16_t b = vld1q_u8(p);
  auto half = [](uint16x8_t w) {
    return vorrq_u16(vshlq_n_u16(vandq_u16(w, vdupq_n_u16(0x80)), 8), vshlq_n_u16(vandq_u16(w, vdupq_n_u16(0x7F)), 7));
  };
  const uint16x8_t lo = half(vmovl_u8(vget_low_u8(b))), hi = half(vmovl_high_u8(b));
  const float32x4_t k = vdupq_n_f32(256.f);
  return {{vmulq_f32(vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(lo))), k),
           vmulq_f32(vcvt_f32_f16(vreinterpret_f16_u16(vget_high_u16(lo))), k),
           vmulq_f32(vcvt_f32_f16(vreinterpret_f16_u16(vget_low_u16(hi))), k),
           vmulq_f32(vcvt_f32_f16(vreinterpret_f16_u16(vget_high_u16(hi))), k)}};
}
inline F32x16 expand4(F32x16 a, int c) {
  const float32x4_t s = a.v[c];
  return {{vdupq_laneq_f32(s, 0), vdupq_laneq_f32(s, 1), vdupq_laneq_f32(s, 2), vdupq_laneq_f32(s, 3)}};
}
inline I32x16 dot_u8s8(I32x16 acc, U8x64 w, const int8_t* x) {  // codes <= 127 are valid s8
  for (int i = 0; i < 4; ++i) acc.v[i] = dot4(acc.v[i], vreinterpretq_s8_u8(w.v[i]), vld1q_s8(x + 16 * i));
  return acc;
}
inline I32x16 dot_u8s8_splat(I32x16 acc, U8x64 w, uint32_t x) {
  const int8x16_t xv = vreinterpretq_s8_u32(vdupq_n_u32(x));
  for (int i = 0; i < 4; ++i) acc.v[i] = dot4(acc.v[i], vreinterpretq_s8_u8(w.v[i]), xv);
  return acc;
}
inline constexpr bool kDotXSums = false;  // sdot is s8 x s8
using S8W = U8x64;
inline S8W prepare_s8(U8x64 w) { return w; }
inline I32x16 dot_s8(const S8W& w, const int8_t* x, const int32_t*) { return dot_u8s8(zero_i32(), w, x); }

}  // namespace vec

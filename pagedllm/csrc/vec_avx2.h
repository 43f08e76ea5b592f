// vec.h on AVX2 + FMA (AMD Zen 1-3, Intel Haswell to Comet Lake, and Intel client CPUs with
// AVX-512 fused off): two ymm per F32x16 (lanes 0-7, 8-15), predicates as all-ones lanes.
// No VNNI here: the int8 dot product is vpmaddubsw on |x| and w signed as x (each pair sum
// |x0 w0 + x1 w1| <= 2 * 127 * 127 fits in int16, unlike u8 x + 128), widened by vpmaddwd,
// as llama.cpp's AVX2 Q8_0 dot product does. 4-bit weight codes are u8 already: vpmaddubsw
// takes them with x as it is.
#pragma once

#include <immintrin.h>
#include <stdint.h>

#include <cstring>

#include "vec_x86.h"

namespace vec {

inline constexpr const char* kName = "avx2";
inline constexpr int kF32Regs = 8;
inline constexpr int kGemmRowsF32 = 3;  // 12 ymm accumulators; weights come from L1 as FMA operands
inline constexpr int kGemmRowsI8 = 2;
inline constexpr int kGemmRowsI8Wide = 2;  // 8 int32 accumulators + 4 weight registers
inline constexpr int kGemmRowsQ4 = 2;  // 8 int16 accumulators; the 8 float32 ones wait in L1 between groups
inline constexpr int kGemmRowsKQ = 3;  // activation rows per K-quant tile (6 accumulators, no spills)
inline constexpr int kKQuantRecordFrom = 2;  // a K-quant panel's tiles x (1 + bit planes) from which its first
                                            // tile stores what it decodes for the others (kquant_panels.h)

struct F32x16 { __m256 lo, hi; };
struct I32x16 { __m256i lo, hi; };
struct M16 { __m256 lo, hi; };

// Pins each accumulator of the 4-bit dot product after every step: otherwise GCC regroups a
// micro-tile's integer adds into trees of products that 16 ymm registers cannot hold, and
// spills them to the stack (docs/benchmarks.md, int8 prefill GEMMs, has the cost).
template <typename... V>
inline void keep_in_registers(V&... v) {
  ([&] { __asm__("" : "+x"(v)); }(), ...);
}

inline F32x16 zero() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F32x16 set1(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline F32x16 load(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store(float* p, F32x16 a) { _mm256_storeu_ps(p, a.lo), _mm256_storeu_ps(p + 8, a.hi); }

inline M16 mask_range(int lo, int hi) {  // lo <= lane < hi
  const __m256i i0 = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7), i1 = _mm256_add_epi32(i0, _mm256_set1_epi32(8));
  const __m256i l = _mm256_set1_epi32(lo - 1), h = _mm256_set1_epi32(hi);
  return {_mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(i0, l), _mm256_cmpgt_epi32(h, i0))),
          _mm256_castsi256_ps(_mm256_and_si256(_mm256_cmpgt_epi32(i1, l), _mm256_cmpgt_epi32(h, i1)))};
}
inline M16 mask_first(int64_t n) { return mask_range(0, n >= 16 ? 16 : n <= 0 ? 0 : int(n)); }
inline M16 operator&(M16 a, M16 b) { return {_mm256_and_ps(a.lo, b.lo), _mm256_and_ps(a.hi, b.hi)}; }
inline bool any(M16 a) { return _mm256_movemask_ps(_mm256_or_ps(a.lo, a.hi)) != 0; }

inline F32x16 load_first(const float* p, int64_t n) {
  if (n >= 16) return load(p);
  const M16 m = mask_first(n);
  return {_mm256_maskload_ps(p, _mm256_castps_si256(m.lo)), _mm256_maskload_ps(p + 8, _mm256_castps_si256(m.hi))};
}
inline void store_first(float* p, F32x16 a, int64_t n) {
  if (n >= 16) return store(p, a);
  const M16 m = mask_first(n);
  _mm256_maskstore_ps(p, _mm256_castps_si256(m.lo), a.lo);
  _mm256_maskstore_ps(p + 8, _mm256_castps_si256(m.hi), a.hi);
}

inline __m256 widen_bf16(__m128i h) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16)); }
inline F32x16 load_bf16(const uint16_t* p) {
  return {widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          widen_bf16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
inline __m256i round_bf16(__m256 a) {  // the rounded-to-nearest-even upper halves, as int32
  const __m256i u = _mm256_castps_si256(a);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_srli_epi32(_mm256_add_epi32(u, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), odd)), 16);
}
inline void store_bf16_first(uint16_t* p, F32x16 a, int64_t n) {
  // packus works per 128-bit lane: (lo0-3 hi0-3 lo4-7 hi4-7), put back in order.
  const __m256i h = _mm256_permute4x64_epi64(_mm256_packus_epi32(round_bf16(a.lo), round_bf16(a.hi)), 0xD8);
  if (n >= 16) return _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), h);
  alignas(32) uint16_t tmp[16];
  _mm256_store_si256(reinterpret_cast<__m256i*>(tmp), h);
  if (n > 0) std::memcpy(p, tmp, size_t(n) * sizeof(uint16_t));
}

#define PAGEDLLM_VEC_BINARY(name, op) \
  inline F32x16 name(F32x16 a, F32x16 b) { return {op(a.lo, b.lo), op(a.hi, b.hi)}; }
PAGEDLLM_VEC_BINARY(add, _mm256_add_ps)
PAGEDLLM_VEC_BINARY(sub, _mm256_sub_ps)
PAGEDLLM_VEC_BINARY(mul, _mm256_mul_ps)
PAGEDLLM_VEC_BINARY(div, _mm256_div_ps)
PAGEDLLM_VEC_BINARY(max, _mm256_max_ps)
#undef PAGEDLLM_VEC_BINARY
inline F32x16 fma(F32x16 a, F32x16 b, F32x16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline F32x16 abs(F32x16 a) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  return {_mm256_andnot_ps(sign, a.lo), _mm256_andnot_ps(sign, a.hi)};
}
inline F32x16 floor(F32x16 a) { return {_mm256_floor_ps(a.lo), _mm256_floor_ps(a.hi)}; }
inline __m256 ldexp8(__m256 p, __m256 n) {  // n integral, the result normal: add n to the exponent
  return _mm256_castsi256_ps(_mm256_add_epi32(_mm256_castps_si256(p), _mm256_slli_epi32(_mm256_cvtps_epi32(n), 23)));
}
inline F32x16 ldexp(F32x16 p, F32x16 n) { return {ldexp8(p.lo, n.lo), ldexp8(p.hi, n.hi)}; }

inline float hsum(__m256 a) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps(a, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}
inline float reduce_add(F32x16 a) { return hsum(_mm256_add_ps(a.lo, a.hi)); }
// Lane i = reduce_add(v[i]) bit for bit: the same tree (lanes j + 8, then j + 4, j + 2, j + 1
// added to lane j), for 16 vectors at once.
inline F32x16 reduce_add16(const F32x16 (&v)[16]) {
  __m256 u[8], w[4], x[2];
  for (int k = 0; k < 8; ++k) {  // 128-bit half h: v[2k + h]'s j + (j + 8), then + (j + 4)
    const __m256 a = _mm256_add_ps(v[2 * k].lo, v[2 * k].hi), b = _mm256_add_ps(v[2 * k + 1].lo, v[2 * k + 1].hi);
    u[k] = _mm256_add_ps(_mm256_permute2f128_ps(a, b, 0x20), _mm256_permute2f128_ps(a, b, 0x31));
  }
  for (int k = 0; k < 4; ++k)  // half h: v[4k + h]'s j + (j + 2) in lanes 0-1, v[4k + 2 + h]'s in 2-3
    w[k] = _mm256_add_ps(_mm256_shuffle_ps(u[2 * k], u[2 * k + 1], 0x44), _mm256_shuffle_ps(u[2 * k], u[2 * k + 1], 0xEE));
  for (int k = 0; k < 2; ++k)  // lane 4h + i: v[8k + 2i + h]'s sum
    x[k] = _mm256_add_ps(_mm256_shuffle_ps(w[2 * k], w[2 * k + 1], 0x88), _mm256_shuffle_ps(w[2 * k], w[2 * k + 1], 0xDD));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  return {_mm256_permutevar8x32_ps(x[0], order), _mm256_permutevar8x32_ps(x[1], order)};
}
inline float reduce_max(F32x16 a) {
  const __m256 m8 = _mm256_max_ps(a.lo, a.hi);
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(m8), _mm256_extractf128_ps(m8, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  return _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
}

#define PAGEDLLM_VEC_CMP(name, pred) \
  inline M16 name(F32x16 a, F32x16 b) { return {_mm256_cmp_ps(a.lo, b.lo, pred), _mm256_cmp_ps(a.hi, b.hi, pred)}; }
PAGEDLLM_VEC_CMP(lt, _CMP_LT_OQ)
PAGEDLLM_VEC_CMP(gt, _CMP_GT_OQ)
PAGEDLLM_VEC_CMP(le, _CMP_LE_OQ)
PAGEDLLM_VEC_CMP(eq, _CMP_EQ_OQ)
#undef PAGEDLLM_VEC_CMP
inline F32x16 select(M16 m, F32x16 a, F32x16 b) { return {_mm256_blendv_ps(b.lo, a.lo, m.lo), _mm256_blendv_ps(b.hi, a.hi, m.hi)}; }
inline F32x16 maskz(M16 m, F32x16 a) { return {_mm256_and_ps(m.lo, a.lo), _mm256_and_ps(m.hi, a.hi)}; }

// The transpose-and-add tree (see vec_avx512.h). Layouts here: after N = 1 each half holds
// one key's 8 partial sums; after N = 2 each 128-bit lane (x x y y) for two keys; after
// N = 4 each half (a b c d | a b c d) for four keys, two partials each; N = 8: key s in lane s.
template <int N>
inline F32x16 merge(F32x16 a, F32x16 b) {
  if constexpr (N == 1) {
    return {_mm256_add_ps(a.lo, a.hi), _mm256_add_ps(b.lo, b.hi)};
  } else if constexpr (N == 2 || N == 4) {
    return {_mm256_hadd_ps(a.lo, a.hi), _mm256_hadd_ps(b.lo, b.hi)};
  } else {
    auto fold = [](__m256 x, __m256 y) {
      return _mm256_add_ps(_mm256_permute2f128_ps(x, y, 0x20), _mm256_permute2f128_ps(x, y, 0x31));
    };
    return {fold(a.lo, a.hi), fold(b.lo, b.hi)};
  }
}

inline F32x16 halves_f16(const uint8_t* a, const uint8_t* b) {
  return {_mm256_cvtph_ps(x86::set1_f16(a)), _mm256_cvtph_ps(x86::set1_f16(b))};
}
inline F32x16 load_f16(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}

// Lanes 2i and 2i + 1: the float16 at p + i * stride (unaligned) for i < n (n <= 8), 0 past
// n. Built in registers: a wide load over narrow stores would wait for them to retire.
inline F32x16 f16_pairs(const uint8_t* p, int64_t stride, int n) {
  const __m128i v = x86::gather_f16x8(p, stride, n);
  return {_mm256_cvtph_ps(_mm_unpacklo_epi16(v, v)), _mm256_cvtph_ps(_mm_unpackhi_epi16(v, v))};
}

inline I32x16 zero_i32() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline I32x16 splat_i32(int32_t a) { return {_mm256_set1_epi32(a), _mm256_set1_epi32(a)}; }
inline I32x16 round_i32(F32x16 a) { return {_mm256_cvtps_epi32(a.lo), _mm256_cvtps_epi32(a.hi)}; }
inline F32x16 to_f32(I32x16 a) { return {_mm256_cvtepi32_ps(a.lo), _mm256_cvtepi32_ps(a.hi)}; }
inline void store_i8(int8_t* p, I32x16 a) {
  const __m256i h = _mm256_permute4x64_epi64(_mm256_packs_epi32(a.lo, a.hi), 0xD8);  // 16 int16 in order
  _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm_packs_epi16(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1)));
}

struct DotX { __m256i x, ax; };  // x and |x|, in every lane
inline DotX dot_prepare(const int32_t* quad) {
  const __m256i x = _mm256_set1_epi32(*quad);
  return {x, _mm256_abs_epi8(x)};
}
inline I32x16 dot_init(const int32_t*) { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline __m256i dot8(__m256i acc, const DotX& x, const int8_t* w) {
  const __m256i sw = _mm256_sign_epi8(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(w)), x.x);
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(x.ax, sw), _mm256_set1_epi16(1)));
}
inline I32x16 dot(I32x16 acc, const DotX& x, const int8_t* w) { return {dot8(acc.lo, x, w), dot8(acc.hi, x, w + 32)}; }

// The w8a8 GEMM's prefill tile on int16 codes: vpmaddwd takes two signed operands (no sign
// trick), 16 exact multiply-adds per instruction against dot's 32 for three multiplier-pipe
// instructions (vpsignb, vpmaddubsw, vpmaddwd). Both steps are pinned: GCC otherwise folds the
// weight loads into every row's vpmaddwd (loads, not multiplies, then bound the tile) and
// copies the accumulators around after each add.
struct DotWX { __m256i x; };  // a pair of int16 codes, in every int32 lane
inline DotWX dot_wide_prepare(const int32_t* pair) { return {_mm256_set1_epi32(*pair)}; }
struct WideW { __m256i lo, hi; };  // 16 columns' pairs of int16 weights, loaded once for every row
inline WideW dot_wide_load(const int16_t* w) {
  __m256i lo = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w));
  __m256i hi = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(w + 16));
  __asm__("" : "+x"(lo), "+x"(hi));
  return {lo, hi};
}
inline I32x16 dot_wide(I32x16 acc, DotWX x, WideW w) {  // acc[l] += x0 w[2 l] + x1 w[2 l + 1]
  __m256i t;
  __asm__("vpmaddwd %[x], %[wl], %[t]\n\t"
          "vpaddd %[t], %[al], %[al]\n\t"
          "vpmaddwd %[x], %[wh], %[t]\n\t"
          "vpaddd %[t], %[ah], %[ah]"
          : [al] "+x"(acc.lo), [ah] "+x"(acc.hi), [t] "=&x"(t)
          : [x] "x"(x.x), [wl] "x"(w.lo), [wh] "x"(w.hi));
  return acc;
}

struct Q4W { __m256i lo0, lo1, hi0, hi1; };  // columns 0-7, 8-15, 16-23, 24-31
inline Q4W dot_q4_load(const uint8_t* nibbles64) {
  const __m256i a = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibbles64));
  const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(nibbles64 + 32)), low = _mm256_set1_epi8(0x0F);
  return {_mm256_and_si256(a, low), _mm256_and_si256(b, low), _mm256_and_si256(_mm256_srli_epi16(a, 4), low),
          _mm256_and_si256(_mm256_srli_epi16(b, 4), low)};
}
inline Q4W dot_u8_load(const uint8_t* codes128) {
  auto at = [&](int i) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(codes128 + 32 * i)); };
  return {at(0), at(1), at(2), at(3)};
}
inline void store_q4w(uint8_t* codes128, const Q4W& w) {
  const __m256i v[4] = {w.lo0, w.lo1, w.hi0, w.hi1};
  for (int i = 0; i < 4; ++i) _mm256_storeu_si256(reinterpret_cast<__m256i*>(codes128 + 32 * i), v[i]);
}
struct DotQ4X { __m256i x; };  // the 4 s8 codes, in every lane
inline DotQ4X dot_q4_prepare(const int32_t* quad) { return {_mm256_set1_epi32(*quad)}; }
// A group's sums as int16 pairs (columns 0-7, 8-15): each vpmaddubsw pair of a code in
// [0, 15] and an x in [-127, 127] is at most 3810 in magnitude, so a group's 8 quads add up to
// 30480 without overflow and the widening vpmaddwd runs once per group, not once per quad.
struct Q4Sum { __m256i lo, hi; };
inline Q4Sum q4sum_zero() { return {_mm256_setzero_si256(), _mm256_setzero_si256()}; }
inline I32x16 q4sum_i32(Q4Sum s) {
  const __m256i ones = _mm256_set1_epi16(1);
  return {_mm256_madd_epi16(s.lo, ones), _mm256_madd_epi16(s.hi, ones)};
}
inline I32x16 q4sum_add(I32x16 acc, Q4Sum s) {
  const I32x16 w = q4sum_i32(s);
  return {_mm256_add_epi32(acc.lo, w.lo), _mm256_add_epi32(acc.hi, w.hi)};
}
// dot_q4 steps a Q4Sum takes when the codes are in [0, code_max] (the int16 pairs' bound).
inline constexpr int q4sum_steps(int code_max) { return 32767 / (2 * 127 * code_max); }
inline void dot_q4(Q4Sum& lo, Q4Sum& hi, DotQ4X x, const Q4W& w) {
  lo = {_mm256_add_epi16(lo.lo, _mm256_maddubs_epi16(w.lo0, x.x)), _mm256_add_epi16(lo.hi, _mm256_maddubs_epi16(w.lo1, x.x))};
  hi = {_mm256_add_epi16(hi.lo, _mm256_maddubs_epi16(w.hi0, x.x)), _mm256_add_epi16(hi.hi, _mm256_maddubs_epi16(w.hi1, x.x))};
  keep_in_registers(lo.lo, lo.hi, hi.lo, hi.hi);
}

// Bytes of GGUF blocks (the K-quant GEMM): two ymm, bytes 0-31 and 32-63.
struct U8x64 { __m256i lo, hi; };
inline __m256i load256(const uint8_t* p) { return _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)); }
inline U8x64 load_u8x64(const uint8_t* p) { return {load256(p), load256(p + 32)}; }
inline void store_u8x64(uint8_t* p, U8x64 a) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), a.lo), _mm256_storeu_si256(reinterpret_cast<__m256i*>(p + 32), a.hi);
}
inline U8x64 load_2x32(const uint8_t* a, const uint8_t* b) { return {load256(a), load256(b)}; }
inline U8x64 dup32(const uint8_t* p) {
  const __m256i v = load256(p);
  return {v, v};
}
inline U8x64 splat_u32(uint32_t v) {
  const __m256i x = _mm256_set1_epi32(int(v));
  return {x, x};
}
inline __m256i pack_bytes4(__m256i a, __m256i b, __m256i c, __m256i d) {
  return _mm256_or_si256(_mm256_or_si256(a, _mm256_slli_epi32(b, 8)), _mm256_or_si256(_mm256_slli_epi32(c, 16), _mm256_slli_epi32(d, 24)));
}
inline U8x64 pack_u8x4(I32x16 a, I32x16 b, I32x16 c, I32x16 d) {
  return {pack_bytes4(a.lo, b.lo, c.lo, d.lo), pack_bytes4(a.hi, b.hi, c.hi, d.hi)};
}
inline void interleave_rows4(const int8_t* const r[4], int8_t* out) {
  for (int h = 0; h < 2; ++h) {  // bytes 0-31, then 32-63: the same per 16-byte quarter
    const auto at = [&](int j) { return load256(reinterpret_cast<const uint8_t*>(r[j]) + 32 * h); };
    const __m256i a = at(0), b = at(1), c = at(2), d = at(3);
    const __m256i ab_lo = _mm256_unpacklo_epi8(a, b), ab_hi = _mm256_unpackhi_epi8(a, b);
    const __m256i cd_lo = _mm256_unpacklo_epi8(c, d), cd_hi = _mm256_unpackhi_epi8(c, d);
    const __m256i parts[4] = {_mm256_unpacklo_epi16(ab_lo, cd_lo), _mm256_unpackhi_epi16(ab_lo, cd_lo),
                              _mm256_unpacklo_epi16(ab_hi, cd_hi), _mm256_unpackhi_epi16(ab_hi, cd_hi)};
    for (int m = 0; m < 4; ++m) _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 64 * m + 32 * h), parts[m]);
  }
}
inline __m256i shr_and8(__m256i v, int n, uint8_t mask) {
  return _mm256_and_si256(_mm256_srl_epi16(v, _mm_cvtsi32_si128(n)), _mm256_set1_epi8(char(mask)));
}
inline U8x64 shr_and_halves(U8x64 a, int lo, int hi, uint8_t mask) { return {shr_and8(a.lo, lo, mask), shr_and8(a.hi, hi, mask)}; }
inline U8x64 shr_and(U8x64 a, int n, uint8_t mask) { return shr_and_halves(a, n, n, mask); }
inline U8x64 shl_u8(U8x64 a, int n) {
  const __m128i count = _mm_cvtsi32_si128(n);
  return {_mm256_sll_epi16(a.lo, count), _mm256_sll_epi16(a.hi, count)};
}
inline U8x64 or_u8(U8x64 a, U8x64 b) { return {_mm256_or_si256(a.lo, b.lo), _mm256_or_si256(a.hi, b.hi)}; }
inline __m256i nibbles16(const uint8_t* p) {  // 16 bytes -> their low nibbles, then their high ones
  const __m256i v = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_and_si256(_mm256_blend_epi32(v, _mm256_srli_epi16(v, 4), 0xF0), _mm256_set1_epi8(0x0F));
}
inline U8x64 nibbles_2x16(const uint8_t* a, const uint8_t* b) { return {nibbles16(a), nibbles16(b)}; }
// 8 x 8 32-bit words: in[i] word j -> out[j] word i.
inline void transpose8x8(const __m256i (&in)[8], __m256i (&out)[8]) {
  __m256i t[8], s[8];
  for (int k = 0; k < 4; ++k)
    t[2 * k] = _mm256_unpacklo_epi32(in[2 * k], in[2 * k + 1]), t[2 * k + 1] = _mm256_unpackhi_epi32(in[2 * k], in[2 * k + 1]);
  for (int g = 0; g < 2; ++g) {  // s[4g + j], 128-bit half h: word 4h + j of rows 4g .. 4g + 3
    const __m256i* p = t + 4 * g;
    s[4 * g] = _mm256_unpacklo_epi64(p[0], p[2]), s[4 * g + 1] = _mm256_unpackhi_epi64(p[0], p[2]);
    s[4 * g + 2] = _mm256_unpacklo_epi64(p[1], p[3]), s[4 * g + 3] = _mm256_unpackhi_epi64(p[1], p[3]);
  }
  for (int j = 0; j < 4; ++j)
    out[j] = _mm256_permute2x128_si256(s[j], s[4 + j], 0x20), out[4 + j] = _mm256_permute2x128_si256(s[j], s[4 + j], 0x31);
}
inline void transpose_u32(U8x64 (&v)[16]) {
  __m256i in[4][8], out[4][8];  // quarter 2a + b: rows 8a .. 8a + 7, words 8b .. 8b + 7
  for (int i = 0; i < 8; ++i)
    in[0][i] = v[i].lo, in[1][i] = v[i].hi, in[2][i] = v[8 + i].lo, in[3][i] = v[8 + i].hi;
  for (int q = 0; q < 4; ++q) transpose8x8(in[q], out[q]);
  for (int j = 0; j < 8; ++j) v[j] = {out[0][j], out[2][j]}, v[8 + j] = {out[1][j], out[3][j]};
}
inline U8x64 bits_to_bytes(uint64_t bits, uint8_t value) {
  // Byte i takes the byte of `bits` holding bit i, keeps bit i % 8 and is `value` where it is set
  // (every 128-bit lane holds all 8 bytes of `bits`).
  const __m256i all = _mm256_set1_epi64x(static_cast<long long>(bits));
  const __m256i bit = _mm256_set1_epi64x(int64_t(0x8040201008040201ULL)), v = _mm256_set1_epi8(char(value));
  auto spread = [&](__m256i index) {
    const __m256i b = _mm256_and_si256(_mm256_shuffle_epi8(all, index), bit);
    return _mm256_and_si256(_mm256_cmpeq_epi8(b, bit), v);
  };
  return {spread(_mm256_setr_epi64x(0, 0x0101010101010101LL, 0x0202020202020202LL, 0x0303030303030303LL)),
          spread(_mm256_setr_epi64x(0x0404040404040404LL, 0x0505050505050505LL, 0x0606060606060606LL,
                                    0x0707070707070707LL))};
}
inline void dot_q4_bits(Q4W& w, uint64_t lo, uint64_t hi, uint8_t value) {
  const U8x64 a = bits_to_bytes(lo, value), b = bits_to_bytes(hi, value);
  w.lo0 = _mm256_or_si256(w.lo0, a.lo), w.lo1 = _mm256_or_si256(w.lo1, a.hi);
  w.hi0 = _mm256_or_si256(w.hi0, b.lo), w.hi1 = _mm256_or_si256(w.hi1, b.hi);
}
inline F32x16 u8_f32(__m128i v) {  // 16 bytes widened to float
  return {_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(v, 8)))};
}
inline F32x16 load_u8_f32(const uint8_t* p) { return u8_f32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline F32x16 u8_f32(uint64_t lo, uint64_t hi) {
  return u8_f32(_mm_set_epi64x(static_cast<long long>(hi), static_cast<long long>(lo)));
}
inline F32x16 load_s8_f32(const int8_t* p) {
  const __m128i v = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  return {_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v)), _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(v, 8)))};
}
// e4m3's bits moved into float16's, as in vec_avx512.h, converted by F16C, times 2^8.
inline F32x16 load_e4m3(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  auto half = [](__m128i bytes) {  // the low 8 bytes
    const __m128i w = _mm_cvtepu8_epi16(bytes);
    const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x80)), 8),
                                   _mm_slli_epi16(_mm_and_si128(w, _mm_set1_epi16(0x7F)), 7));
    return _mm256_mul_ps(_mm256_cvtph_ps(h), _mm256_set1_ps(256.f));
  };
  return {half(b), half(_mm_srli_si128(b, 8))};
}
inline F32x16 expand4(F32x16 a, int c) {
  const __m256 src = c < 2 ? a.lo : a.hi;
  const __m256i o = _mm256_set1_epi32(4 * (c % 2));
  return {_mm256_permutevar8x32_ps(src, _mm256_add_epi32(o, _mm256_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1))),
          _mm256_permutevar8x32_ps(src, _mm256_add_epi32(o, _mm256_setr_epi32(2, 2, 2, 2, 3, 3, 3, 3)))};
}
inline __m256i madd_u8s8(__m256i acc, __m256i w, __m256i x) {  // pairs w x fit in int16 (the caller's bound)
  return _mm256_add_epi32(acc, _mm256_madd_epi16(_mm256_maddubs_epi16(w, x), _mm256_set1_epi16(1)));
}
inline I32x16 dot_u8s8(I32x16 acc, U8x64 w, const int8_t* x) {
  const uint8_t* p = reinterpret_cast<const uint8_t*>(x);
  return {madd_u8s8(acc.lo, w.lo, load256(p)), madd_u8s8(acc.hi, w.hi, load256(p + 32))};
}
inline I32x16 dot_u8s8_splat(I32x16 acc, U8x64 w, uint32_t x) {
  const __m256i xv = _mm256_set1_epi32(int(x));
  return {madd_u8s8(acc.lo, w.lo, xv), madd_u8s8(acc.hi, w.hi, xv)};
}
inline constexpr bool kDotXSums = false;  // x negated where w < 0 instead
using S8W = U8x64;
inline S8W prepare_s8(U8x64 w) { return w; }
inline I32x16 dot_s8(const S8W& w, const int8_t* x, const int32_t*) {  // |w| times x signed as w
  const uint8_t* p = reinterpret_cast<const uint8_t*>(x);
  const __m256i zero = _mm256_setzero_si256();
  return {madd_u8s8(zero, _mm256_abs_epi8(w.lo), _mm256_sign_epi8(load256(p), w.lo)),
          madd_u8s8(zero, _mm256_abs_epi8(w.hi), _mm256_sign_epi8(load256(p + 32), w.hi))};
}

}  // namespace vec

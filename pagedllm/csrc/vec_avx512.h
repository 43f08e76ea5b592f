// vec.h on AVX-512 (F, BW, VL, DQ): one zmm per F32x16, a __mmask16 per M16. The int8 dot
// product is VNNI's vpdpbusd where the target has it (u8 x s8: the weights are stored as q +
// 128, and the 128 * sum(x) that adds is taken off where the accumulator starts), else
// vpmaddubsw on |x| and w negated where x < 0, widened by vpmaddwd. The 4-bit x int8 product needs no such trick:
// weight codes in [0, 15] are u8 and x is s8, so vpdpbusd (or vpmaddubsw, pairs <= 2 * 15 * 127)
// takes both as they are.
#pragma once

#include <immintrin.h>
#include <stdint.h>

#include "vec_x86.h"

namespace vec {

inline constexpr const char* kName = "avx512";
inline constexpr int kF32Regs = 32;     // F32x16 values that fit in the register file
inline constexpr int kGemmRowsF32 = 12;  // rows of a float32 GEMM micro-tile (24 accumulators)
inline constexpr int kGemmRowsI8 = 5;    // rows of a w8a8 micro-tile: 10 int32 sums in flight, as many as
                                        // vpdpbusd's latency x throughput (5 x 2) keeps busy, + 10 float32
inline constexpr int kGemmRowsI8Wide = 0;  // no int16 prefill tile: VNNI, or the masked sign trick, at every M
inline constexpr int kGemmRowsQ4 = 6;    // rows of a w4a8 micro-tile (12 int32 + 12 float32 accumulators; the
                                        // nibbles' unpacking spread over more rows)
inline constexpr int kGemmRowsKQ = 4;    // activation rows per K-quant tile (4 accumulators + 4 scale registers)
inline constexpr int kKQuantRecordFrom = 6;  // a K-quant panel's tiles x (1 + bit planes) from which its first
                                            // tile stores what it decodes for the others (kquant_panels.h)

struct F32x16 { __m512 v; };
struct I32x16 { __m512i v; };
struct DotWX;  // declared for gemm.h's tile_w8a8_wide, which is never instantiated here
struct WideW;
DotWX dot_wide_prepare(const int32_t* pair);
WideW dot_wide_load(const int16_t* w);
I32x16 dot_wide(I32x16 acc, const DotWX& x, WideW w);
struct M16 { __mmask16 m; };

inline F32x16 zero() { return {_mm512_setzero_ps()}; }
inline F32x16 set1(float x) { return {_mm512_set1_ps(x)}; }
inline F32x16 load(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store(float* p, F32x16 a) { _mm512_storeu_ps(p, a.v); }

inline M16 mask_first(int64_t n) { return {n >= 16 ? __mmask16(0xFFFF) : n <= 0 ? __mmask16(0) : __mmask16((1u << n) - 1)}; }
inline M16 mask_range(int lo, int hi) { return {__mmask16(((1u << hi) - 1) & ~((1u << lo) - 1))}; }
inline M16 operator&(M16 a, M16 b) { return {__mmask16(a.m & b.m)}; }
inline bool any(M16 a) { return a.m != 0; }

inline F32x16 load_first(const float* p, int64_t n) { return {_mm512_maskz_loadu_ps(mask_first(n).m, p)}; }
inline void store_first(float* p, F32x16 a, int64_t n) { _mm512_mask_storeu_ps(p, mask_first(n).m, a.v); }

inline F32x16 load_bf16(const uint16_t* p) {
  const __m512i u = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(u, 16))};
}
inline void store_bf16_first(uint16_t* p, F32x16 a, int64_t n) {
  __m512i u = _mm512_castps_si512(a.v);  // round to nearest even: + 0x7FFF + the kept lowest bit
  u = _mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1))));
  _mm256_mask_storeu_epi16(p, mask_first(n).m, _mm512_cvtepi32_epi16(_mm512_srli_epi32(u, 16)));
}

inline F32x16 add(F32x16 a, F32x16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline F32x16 sub(F32x16 a, F32x16 b) { return {_mm512_sub_ps(a.v, b.v)}; }
inline F32x16 mul(F32x16 a, F32x16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F32x16 div(F32x16 a, F32x16 b) { return {_mm512_div_ps(a.v, b.v)}; }
inline F32x16 fma(F32x16 a, F32x16 b, F32x16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline F32x16 max(F32x16 a, F32x16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline F32x16 abs(F32x16 a) { return {_mm512_abs_ps(a.v)}; }
inline F32x16 floor(F32x16 a) { return {_mm512_roundscale_ps(a.v, _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC)}; }
inline F32x16 ldexp(F32x16 p, F32x16 n) { return {_mm512_scalef_ps(p.v, n.v)}; }
inline float reduce_add(F32x16 a) { return _mm512_reduce_add_ps(a.v); }
inline float reduce_max(F32x16 a) { return _mm512_reduce_max_ps(a.v); }
// Lane i = reduce_add(v[i]) bit for bit: the same tree (lanes j + 8, then j + 4, j + 2, j + 1
// added to lane j; GCC's _mm512_reduce_add_ps), for 16 vectors at once.
inline F32x16 reduce_add16(const F32x16 (&v)[16]) {
  __m512 u[8], w[4], x[2];
  for (int k = 0; k < 8; ++k)  // lanes 0-7: v[2k]'s j + (j + 8); lanes 8-15: v[2k + 1]'s
    u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k].v, v[2 * k + 1].v, 0x44),
                         _mm512_shuffle_f32x4(v[2 * k].v, v[2 * k + 1].v, 0xEE));
  for (int k = 0; k < 4; ++k)  // 128-bit lane q: v[4k + q]'s j + (j + 4)
    w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], 0xDD));
  for (int k = 0; k < 2; ++k)  // 128-bit lane q: v[8k + q]'s j + (j + 2) in lanes 0-1, v[8k + 4 + q]'s in 2-3
    x[k] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * k], w[2 * k + 1], 0x44), _mm512_shuffle_ps(w[2 * k], w[2 * k + 1], 0xEE));
  // lane 4q + i: v[4i + q]'s sum
  const __m512 s = _mm512_add_ps(_mm512_shuffle_ps(x[0], x[1], 0x88), _mm512_shuffle_ps(x[0], x[1], 0xDD));
  return {_mm512_permutexvar_ps(_mm512_setr_epi32(0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15), s)};
}

inline M16 lt(F32x16 a, F32x16 b) { return {_mm512_cmp_ps_mask(a.v, b.v, _CMP_LT_OQ)}; }
inline M16 gt(F32x16 a, F32x16 b) { return {_mm512_cmp_ps_mask(a.v, b.v, _CMP_GT_OQ)}; }
inline M16 le(F32x16 a, F32x16 b) { return {_mm512_cmp_ps_mask(a.v, b.v, _CMP_LE_OQ)}; }
inline M16 eq(F32x16 a, F32x16 b) { return {_mm512_cmp_ps_mask(a.v, b.v, _CMP_EQ_OQ)}; }
inline F32x16 select(M16 m, F32x16 a, F32x16 b) { return {_mm512_mask_mov_ps(b.v, m.m, a.v)}; }
inline F32x16 maskz(M16 m, F32x16 a) { return {_mm512_maskz_mov_ps(m.m, a.v)}; }

// One step of the transpose-and-add tree that turns 16 vectors of partial sums (one per key)
// into one vector of the 16 sums: a and b each hold N keys' partial sums, the result 2N keys'.
// Per 128-bit lane, N = 1 gives (a b a b), N = 2 gives (a0 a1 b0 b1); N = 4 gives 128-bit
// lanes (a a b b) of 4 keys each, N = 8 the 16 keys in order (key s in lane s).
template <int N>
inline F32x16 merge(F32x16 a, F32x16 b) {
  if constexpr (N == 1) {
    return {_mm512_add_ps(_mm512_unpacklo_ps(a.v, b.v), _mm512_unpackhi_ps(a.v, b.v))};
  } else if constexpr (N == 2) {
    const __m512d x = _mm512_castps_pd(a.v), y = _mm512_castps_pd(b.v);
    return {_mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)), _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)))};
  } else {
    return {_mm512_add_ps(_mm512_shuffle_f32x4(a.v, b.v, 0x88), _mm512_shuffle_f32x4(a.v, b.v, 0xDD))};
  }
}

inline F32x16 halves_f16(const uint8_t* a, const uint8_t* b) {
  return {_mm512_cvtph_ps(_mm256_set_m128i(x86::set1_f16(b), x86::set1_f16(a)))};
}
inline F32x16 load_f16(const uint16_t* p) { return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }

inline F32x16 f16_pairs(const uint8_t* p, int64_t stride, int n) {
  const __m128i v = x86::gather_f16x8(p, stride, n);
  return {_mm512_cvtph_ps(_mm256_set_m128i(_mm_unpackhi_epi16(v, v), _mm_unpacklo_epi16(v, v)))};
}

inline I32x16 zero_i32() { return {_mm512_setzero_si512()}; }
inline I32x16 splat_i32(int32_t a) { return {_mm512_set1_epi32(a)}; }
inline I32x16 round_i32(F32x16 a) { return {_mm512_cvtps_epi32(a.v)}; }
inline F32x16 to_f32(I32x16 a) { return {_mm512_cvtepi32_ps(a.v)}; }
#ifdef __AVX512VNNI__
inline constexpr bool kDotXSums = true;  // weights stored as q + 128 (u8), sums start at -128 * x's code sums
struct DotX { __m512i x; };  // the 4 s8 x codes, in every lane (vpdpbusd's broadcast operand)
inline DotX dot_prepare(const int32_t* quad) { return {_mm512_set1_epi32(*quad)}; }
inline I32x16 dot_init(const int32_t* xsum128) { return {_mm512_set1_epi32(*xsum128)}; }
inline I32x16 dot(I32x16 acc, DotX x, const int8_t* w) { return {_mm512_dpbusd_epi32(acc.v, _mm512_loadu_si512(w), x.x)}; }
#else
inline constexpr bool kDotXSums = false;  // x negated where w < 0 instead
struct DotX { __m512i ax; __mmask64 neg; };  // |x| in every lane; the bytes where x < 0
inline DotX dot_prepare(const int32_t* quad) {
  const __m512i x = _mm512_set1_epi32(*quad);
  return {_mm512_abs_epi8(x), _mm512_movepi8_mask(x)};
}
inline I32x16 dot_init(const int32_t*) { return {_mm512_setzero_si512()}; }
inline I32x16 dot(I32x16 acc, DotX x, const int8_t* w) {  // |x| * (w signed as x): pairs fit in int16
  const __m512i wv = _mm512_loadu_si512(w);
  const __m512i sw = _mm512_mask_sub_epi8(wv, x.neg, _mm512_setzero_si512(), wv);
  return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(_mm512_maddubs_epi16(x.ax, sw), _mm512_set1_epi16(1)))};
}
#endif

inline void store_i8(int8_t* p, I32x16 a) { _mm_storeu_si128(reinterpret_cast<__m128i*>(p), _mm512_cvtepi32_epi8(a.v)); }
struct Q4W { __m512i lo, hi; };  // columns 0-15 and 16-31, 4 u8 codes per int32 lane
inline Q4W dot_q4_load(const uint8_t* nibbles64) {
  const __m512i v = _mm512_loadu_si512(nibbles64), low = _mm512_set1_epi8(0x0F);
  return {_mm512_and_si512(v, low), _mm512_and_si512(_mm512_srli_epi16(v, 4), low)};
}
inline Q4W dot_u8_load(const uint8_t* codes128) { return {_mm512_loadu_si512(codes128), _mm512_loadu_si512(codes128 + 64)}; }
inline void store_q4w(uint8_t* codes128, const Q4W& w) { _mm512_storeu_si512(codes128, w.lo), _mm512_storeu_si512(codes128 + 64, w.hi); }
struct DotQ4X { __m512i x; };  // the 4 s8 codes, in every lane
inline DotQ4X dot_q4_prepare(const int32_t* quad) { return {_mm512_set1_epi32(*quad)}; }
#ifdef __AVX512VNNI__
using Q4Sum = I32x16;  // vpdpbusd sums into int32 directly
inline Q4Sum q4sum_zero() { return zero_i32(); }
inline I32x16 q4sum_i32(Q4Sum s) { return s; }
inline I32x16 q4sum_add(I32x16 acc, Q4Sum s) { return {_mm512_add_epi32(acc.v, s.v)}; }
inline constexpr int q4sum_steps(int) { return 1 << 20; }
inline void dot_q4(Q4Sum& lo, Q4Sum& hi, DotQ4X x, const Q4W& w) {
  lo.v = _mm512_dpbusd_epi32(lo.v, w.lo, x.x);
  hi.v = _mm512_dpbusd_epi32(hi.v, w.hi, x.x);
}
#else
struct Q4Sum { __m512i v; };  // int16 pair sums, widened once per group (as vec_avx2.h's)
inline Q4Sum q4sum_zero() { return {_mm512_setzero_si512()}; }
inline I32x16 q4sum_i32(Q4Sum s) { return {_mm512_madd_epi16(s.v, _mm512_set1_epi16(1))}; }
inline I32x16 q4sum_add(I32x16 acc, Q4Sum s) { return {_mm512_add_epi32(acc.v, q4sum_i32(s).v)}; }
inline constexpr int q4sum_steps(int code_max) { return 32767 / (2 * 127 * code_max); }  // int16 pairs, as vec_avx2.h's
inline void dot_q4(Q4Sum& lo, Q4Sum& hi, DotQ4X x, const Q4W& w) {
  lo.v = _mm512_add_epi16(lo.v, _mm512_maddubs_epi16(w.lo, x.x));
  hi.v = _mm512_add_epi16(hi.v, _mm512_maddubs_epi16(w.hi, x.x));
  __asm__("" : "+v"(lo.v), "+v"(hi.v));  // as vec_avx2.h's keep_in_registers
}
#endif

// Bytes of GGUF blocks (the K-quant GEMM): one zmm; shifts act on 16-bit lanes, so each
// operation's contract (vec.h) keeps bits from crossing into a neighbouring byte.
struct U8x64 { __m512i v; };
inline U8x64 load_u8x64(const uint8_t* p) { return {_mm512_loadu_si512(p)}; }
inline void store_u8x64(uint8_t* p, U8x64 a) { _mm512_storeu_si512(p, a.v); }
inline U8x64 load_2x32(const uint8_t* a, const uint8_t* b) {
  return {_mm512_inserti64x4(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))),
                             _mm256_loadu_si256(reinterpret_cast<const __m256i*>(b)), 1)};
}
inline U8x64 dup32(const uint8_t* p) { return {_mm512_broadcast_i64x4(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))}; }
inline U8x64 splat_u32(uint32_t v) { return {_mm512_set1_epi32(int(v))}; }
inline U8x64 pack_u8x4(I32x16 a, I32x16 b, I32x16 c, I32x16 d) {
  return {_mm512_or_si512(_mm512_or_si512(a.v, _mm512_slli_epi32(b.v, 8)),
                          _mm512_or_si512(_mm512_slli_epi32(c.v, 16), _mm512_slli_epi32(d.v, 24)))};
}
inline void interleave_rows4(const int8_t* const r[4], int8_t* out) {
  const __m512i a = _mm512_loadu_si512(r[0]), b = _mm512_loadu_si512(r[1]);
  const __m512i c = _mm512_loadu_si512(r[2]), d = _mm512_loadu_si512(r[3]);
  const __m512i ab_lo = _mm512_unpacklo_epi8(a, b), ab_hi = _mm512_unpackhi_epi8(a, b);
  const __m512i cd_lo = _mm512_unpacklo_epi8(c, d), cd_hi = _mm512_unpackhi_epi8(c, d);
  _mm512_storeu_si512(out, _mm512_unpacklo_epi16(ab_lo, cd_lo));
  _mm512_storeu_si512(out + 64, _mm512_unpackhi_epi16(ab_lo, cd_lo));
  _mm512_storeu_si512(out + 128, _mm512_unpacklo_epi16(ab_hi, cd_hi));
  _mm512_storeu_si512(out + 192, _mm512_unpackhi_epi16(ab_hi, cd_hi));
}
inline U8x64 shr_and_halves(U8x64 a, int lo, int hi, uint8_t mask) {
  const __m512i counts = _mm512_inserti64x4(_mm512_set1_epi16(short(lo)), _mm256_set1_epi16(short(hi)), 1);
  return {_mm512_and_si512(_mm512_srlv_epi16(a.v, counts), _mm512_set1_epi8(char(mask)))};
}
inline U8x64 shr_and(U8x64 a, int n, uint8_t mask) {
  return {_mm512_and_si512(_mm512_srl_epi16(a.v, _mm_cvtsi32_si128(n)), _mm512_set1_epi8(char(mask)))};
}
inline U8x64 shl_u8(U8x64 a, int n) { return {_mm512_sll_epi16(a.v, _mm_cvtsi32_si128(n))}; }
inline U8x64 or_u8(U8x64 a, U8x64 b) { return {_mm512_or_si512(a.v, b.v)}; }
inline U8x64 nibbles_2x16(const uint8_t* a, const uint8_t* b) {
  const __m128i x = _mm_loadu_si128(reinterpret_cast<const __m128i*>(a)), y = _mm_loadu_si128(reinterpret_cast<const __m128i*>(b));
  const __m512i xxyy = _mm512_inserti64x4(_mm512_castsi256_si512(_mm256_set_m128i(x, x)), _mm256_set_m128i(y, y), 1);
  const __m512i counts = _mm512_set_epi64(4 * 0x0001000100010001LL, 4 * 0x0001000100010001LL, 0, 0, 4 * 0x0001000100010001LL,
                                          4 * 0x0001000100010001LL, 0, 0);
  return {_mm512_and_si512(_mm512_srlv_epi16(xxyy, counts), _mm512_set1_epi8(0x0F))};
}
inline U8x64 bits_to_bytes(uint64_t bits, uint8_t value) { return {_mm512_maskz_mov_epi8(bits, _mm512_set1_epi8(char(value)))}; }
inline void dot_q4_bits(Q4W& w, uint64_t lo, uint64_t hi, uint8_t value) {
  const __m512i v = _mm512_set1_epi8(char(value));
  w.lo = _mm512_mask_add_epi8(w.lo, lo, w.lo, v), w.hi = _mm512_mask_add_epi8(w.hi, hi, w.hi, v);
}
inline void transpose_u32(U8x64 (&v)[16]) {
  __m512i t[16], s[16];
  for (int k = 0; k < 8; ++k) {  // per 128-bit lane: (a0 b0 a1 b1), (a2 b2 a3 b3) of rows 2k, 2k + 1
    t[2 * k] = _mm512_unpacklo_epi32(v[2 * k].v, v[2 * k + 1].v);
    t[2 * k + 1] = _mm512_unpackhi_epi32(v[2 * k].v, v[2 * k + 1].v);
  }
  for (int g = 0; g < 4; ++g) {  // s[4g + j], 128-bit lane L: word 4L + j of rows 4g .. 4g + 3
    const __m512i* p = t + 4 * g;
    s[4 * g] = _mm512_unpacklo_epi64(p[0], p[2]), s[4 * g + 1] = _mm512_unpackhi_epi64(p[0], p[2]);
    s[4 * g + 2] = _mm512_unpacklo_epi64(p[1], p[3]), s[4 * g + 3] = _mm512_unpackhi_epi64(p[1], p[3]);
  }
  for (int j = 0; j < 4; ++j) {  // the 4 x 4 128-bit lanes of s[j], s[4 + j], s[8 + j], s[12 + j] transposed
    const __m512i x0 = _mm512_shuffle_i32x4(s[j], s[4 + j], 0x44), x1 = _mm512_shuffle_i32x4(s[j], s[4 + j], 0xEE);
    const __m512i y0 = _mm512_shuffle_i32x4(s[8 + j], s[12 + j], 0x44), y1 = _mm512_shuffle_i32x4(s[8 + j], s[12 + j], 0xEE);
    v[j].v = _mm512_shuffle_i32x4(x0, y0, 0x88), v[4 + j].v = _mm512_shuffle_i32x4(x0, y0, 0xDD);
    v[8 + j].v = _mm512_shuffle_i32x4(x1, y1, 0x88), v[12 + j].v = _mm512_shuffle_i32x4(x1, y1, 0xDD);
  }
}
inline F32x16 u8_f32(__m128i v) { return {_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(v))}; }  // 16 bytes widened to float
inline F32x16 load_u8_f32(const uint8_t* p) { return u8_f32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))); }
inline F32x16 u8_f32(uint64_t lo, uint64_t hi) {
  return u8_f32(_mm_set_epi64x(static_cast<long long>(hi), static_cast<long long>(lo)));
}
inline F32x16 load_s8_f32(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
// e4m3's bits moved into float16's (sign to bit 15, exponent and mantissa to bits 7-13: an
// exponent biased by 7 where float16's is by 15, so the float16 is the value * 2^-8, subnormals
// included), converted by the hardware, times 2^8.
inline F32x16 load_e4m3(const uint8_t* p) {
  const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                    _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
  return {_mm512_mul_ps(_mm512_cvtph_ps(h), _mm512_set1_ps(256.f))};
}
inline F32x16 expand4(F32x16 a, int c) {
  const __m512i idx = _mm512_add_epi32(_mm512_set1_epi32(4 * c), _mm512_setr_epi32(0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3));
  return {_mm512_permutexvar_ps(idx, a.v)};
}
#ifdef __AVX512VNNI__
inline I32x16 dot_u8s8(I32x16 acc, U8x64 w, const int8_t* x) { return {_mm512_dpbusd_epi32(acc.v, w.v, _mm512_loadu_si512(x))}; }
inline I32x16 dot_u8s8_splat(I32x16 acc, U8x64 w, uint32_t x) { return {_mm512_dpbusd_epi32(acc.v, w.v, _mm512_set1_epi32(int(x)))}; }
// w + 128 as u8, so that a row's dot product is one vpdpbusd that starts from -128 * its x sums.
struct S8W { __m512i u; };
inline S8W prepare_s8(U8x64 w) { return {_mm512_xor_si512(w.v, _mm512_set1_epi8(char(0x80)))}; }
inline I32x16 dot_s8(const S8W& w, const int8_t* x, const int32_t* xsum128) {
  return {_mm512_dpbusd_epi32(_mm512_loadu_si512(xsum128), w.u, _mm512_loadu_si512(x))};
}
#else
inline I32x16 dot_u8s8(I32x16 acc, U8x64 w, const int8_t* x) {
  return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(_mm512_maddubs_epi16(w.v, _mm512_loadu_si512(x)), _mm512_set1_epi16(1)))};
}
inline I32x16 dot_u8s8_splat(I32x16 acc, U8x64 w, uint32_t x) {
  return {_mm512_add_epi32(acc.v, _mm512_madd_epi16(_mm512_maddubs_epi16(w.v, _mm512_set1_epi32(int(x))), _mm512_set1_epi16(1)))};
}
using S8W = U8x64;
inline S8W prepare_s8(U8x64 w) { return w; }
inline I32x16 dot_s8(const S8W& w, const int8_t* x, const int32_t*) {  // pairs |w| |x| <= 2 * 128 * 127 fit in int16
  const __m512i xv = _mm512_loadu_si512(x);
  const __m512i sx = _mm512_mask_sub_epi8(xv, _mm512_movepi8_mask(w.v), _mm512_setzero_si512(), xv);
  return {_mm512_madd_epi16(_mm512_maddubs_epi16(_mm512_abs_epi8(w.v), sx), _mm512_set1_epi16(1))};
}
#endif
#ifdef __AVX512BF16__
#define PAGEDLLM_VEC_BF16_DOT 1
inline constexpr bool kBf16Dot = true;
struct BF16x32 { __m512i v; };
inline BF16x32 load_pairs(const uint32_t* p) { return {_mm512_loadu_si512(p)}; }
inline BF16x32 set1_pair(uint32_t pair) { return {_mm512_set1_epi32(int(pair))}; }
inline void store_pairs(uint32_t* p, BF16x32 a) { _mm512_storeu_si512(p, a.v); }
inline BF16x32 pack_pairs(F32x16 lo, F32x16 hi) {  // vcvtne2ps2bf16 gives lo's 16 then hi's: interleave
  const __m512i h = reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi.v, lo.v));
  return {_mm512_permutexvar_epi16(_mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7,
                                                    22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0), h)};
}
inline BF16x32 round_pairs(F32x16 lo, F32x16 hi) { return {reinterpret_cast<__m512i>(_mm512_cvtne2ps_pbh(hi.v, lo.v))}; }
inline BF16x32 zip_bf16(const uint16_t* a, const uint16_t* b) {
  const __m512i idx = _mm512_set_epi16(47, 15, 46, 14, 45, 13, 44, 12, 43, 11, 42, 10, 41, 9, 40, 8, 39, 7, 38, 6, 37, 5,
                                       36, 4, 35, 3, 34, 2, 33, 1, 32, 0);
  return {_mm512_permutex2var_epi16(_mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(a))), idx,
                                    _mm512_castsi256_si512(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(b))))};
}
inline F32x16 dot_pairs(F32x16 acc, BF16x32 a, BF16x32 b) {
  return {_mm512_dpbf16_ps(acc.v, reinterpret_cast<__m512bh>(a.v), reinterpret_cast<__m512bh>(b.v))};
}
#endif

}  // namespace vec

// The vector layer every kernel is written against: one logical vector of 16 float32 lanes
// (F32x16), 16 int32 lanes (I32x16) and a 16-lane predicate (M16), implemented per
// instruction set in the header the compiler's target selects:
//   AVX-512 (F/BW/VL/DQ, + VNNI, + BF16)  vec_avx512.h   one zmm register
//   AVX2 + FMA (+ F16C)                   vec_avx2.h     two ymm registers
//   ARM NEON (+ dotprod)                  vec_neon.h     four q registers
//   anything else, or PAGEDLLM_VEC_SCALAR vec_scalar.h   16 floats (the reference)
// A fixed 16-lane width keeps every kernel's tiling (16 keys per tile, 32-column GEMM panels)
// the same on all of them; the register budget differs, so each header also says how many
// F32x16 values fit in its registers (kF32Regs), how many GEMM rows a micro-tile keeps, and
// from how much work a K-quant panel's decoded scales and codes are kept for its later tiles
// (kKQuantRecordFrom).
// The build (pagedllm/kernels/build.py) compiles with explicit flags per ISA, never
// -march=native. The same layered design as vLLM's CPU backend and ggml's per-ISA code.
//
// Every header provides, in namespace vec:
//   F32x16  zero, set1, load, store, load_first/store_first (lanes < n; n may be <= 0 or
//           >= 16), load_bf16 (16 bfloat16 widened), store_bf16_first (rounded to nearest
//           even), add, sub, mul, div, fma (a * b + c), max, abs, floor, ldexp (p * 2^n for
//           integral n), reduce_add, reduce_max, reduce_add16(v[16]) (lane i = reduce_add(v[i]),
//           the same bits), merge<N> (the transpose-and-add tree, below)
//   M16     lt, gt, le, eq, mask_first(n), mask_range(lo, hi), &, any, select, maskz
//   I32x16  splat_i32 (one int32 in every lane), round_i32 (to nearest even), to_f32
//   int8    store_i8 (16 activation codes in [-127, 127] as plain s8), kDotXSums (constexpr:
//           the dot product takes u8 weights and s8 x, as VNNI's vpdpbusd does, so w8a8's
//           weight codes q are stored as the byte q + 128 and each sum starts at -128 times
//           x's code sum; else the weight codes are plain s8), DotX dot_prepare(a quad of 4 x
//           codes), I32x16 dot_init(xsum128: -128 times x's code sum over the quads that
//           follow, read where kDotXSums; else 0 lanes), I32x16 dot(acc, DotX, 64 stored weight
//           bytes): acc[l] += sum_j x[j] * w[4 l + j], w the stored byte (q + 128 where kDotXSums)
//   int4    (the w4a8 GEMM, kGemmRowsQ4 rows per micro-tile) load_f16 (16 float16 widened),
//           I32x16 zero_i32, Q4W dot_q4_load(64 bytes of nibbles: byte i holds column i/4's
//           code i%4 in its low nibble, column 16 + i/4's in its high one; loaded once, used
//           by every row), DotQ4X dot_q4_prepare(a
//           quad of 4 s8 codes), Q4Sum (one group's partial sums of 16 columns, in whatever
//           width the ISA adds them: int16 pairs on AVX2) q4sum_zero, dot_q4(lo, hi, DotQ4X,
//           Q4W): lo[l] += sum_j x[j] * low nibble of byte 4 l + j, hi[l] the same with the
//           high nibbles (codes in [0, 15] are u8 and s8 alike: no offset or sign trick), at
//           most QG / 4 = 8 times per Q4Sum (a group), then I32x16 q4sum_i32(Q4Sum) or
//           q4sum_add(acc, Q4Sum) (acc + the widened sums). Q4W dot_u8_load(128 bytes of codes
//           in [0, 63], one per byte: byte i < 64 column i/4's code i%4, byte 64 + i column
//           16 + i/4's) takes dot_q4 at most q4sum_steps(code max) times per Q4Sum (constexpr;
//           >= 8 for codes <= 15), store_q4w(128 bytes, Q4W) its inverse (a Q4W of such codes
//           stored in that layout)
//   GGUF    (the K-quant GEMM, kGemmRowsKQ rows per tile) U8x64, 64 bytes in order:
//           load_u8x64, store_u8x64, load_2x32(a, b) (32 bytes of each), dup32(p) (the same 32
//           bytes twice), nibbles_2x16(a, b) (16 bytes of each as their low then their high
//           nibbles: a's 32 codes, then b's), shr_and(v, n, mask) (each byte (b >> n) & mask),
//           shr_and_halves(v, lo, hi, mask) (bytes 0-31 shifted by lo, 32-63 by hi), shl_u8(v,
//           n), or_u8, bits_to_bytes(bits, value) (byte i = value where bit i is set, else 0),
//           dot_q4_bits(Q4W& w, lo, hi, value) (byte i of w's columns 0-15 gains value where bit
//           i of lo is set, of 16-31 where bit i of hi is; those bytes have value's bits clear:
//           the fifth and sixth bits of kquant_panels.h's codes),
//           transpose_u32(v[16]) (16 x 16 32-bit words: word j of v[i] moves to word i of v[j]);
//           shifts may move bits between the bytes of a 16-bit lane: a shr_and mask must be
//           below 2^(8 - n), and shl_u8's bytes below 2^(8 - n). I32x16 dot_u8s8(acc, U8x64 w,
//           64 s8 x): acc[l] += sum_j w[4 l + j] x[4 l + j] with w in [0, 127] (AVX2's vpmaddubsw
//           pairs fit in int16). S8W prepare_s8(U8x64 w) once per chunk of s8 codes (Q8_0's,
//           -128 included), then for each row of x (in [-127, 127]) I32x16 dot_s8(S8W, 64 s8 x,
//           xsum128): lane l = sum_j w[4 l + j] x[4 l + j]; where kDotXSums, xsum128[l] = -128 *
//           sum_j x[4 l + j] (kquant's quantize_rows computes it; the other ISAs ignore it).
//           dot_u8s8_splat(acc, w, x): the same against x's 4 bytes (s8) in every lane,
//           pack_u8x4(a, b, c, d) (lanes in [0, 255]: byte 4 l + j = lane l of the j-th),
//           splat_u32(v) (v's 4 bytes in every 32-bit lane), interleave_rows4(r[4], out) (64
//           bytes of each of 4 rows into 4 x 64 bytes: out[64 m + 16 q + 4 i + j] = r[j][16 q +
//           4 m + i], the order x86's unpacks give per 16-byte quarter q; with dot_u8s8 over
//           out + 64 m, lane 4 q + i of the sums takes element 16 q + 4 m + i of the rows),
//           load_u8_f32 / load_s8_f32 (16 bytes widened to float), u8_f32(lo, hi) (the same
//           from registers: the 8 bytes of uint64 lo, little-endian, then hi's), f16_pairs(p, stride, n)
//           (lanes 2i and 2i + 1: the float16 at p + i * stride for i < n <= 8, 0 past n;
//           built in registers), expand4(v, c): lane l = v[4 c + l / 4] (the scale of each
//           16-byte quarter of a U8x64, per 4-lane dot sum), halves_f16(a, b) (lanes 0-7
//           the float16 at a, 8-15 the one at b, unaligned).
//   bf16    kBf16Dot (constexpr: the ISA multiplies bfloat16 pairs, AVX-512 BF16's vdpbf16ps,
//           at the float32 FMA's instruction rate: twice its multiply-adds), BF16x32 (16 lanes
//           of a bfloat16 pair each: the low half the pair's first value), load_pairs /
//           store_pairs (16 pairs as uint32), set1_pair (one pair in every lane), pack_pairs(lo,
//           hi) (lane l = (lo[l], hi[l]), each rounded to nearest even), round_pairs(lo, hi) (the 32
//           values lo then hi rounded, in order: lane l = values 2l, 2l + 1), zip_bf16(a, b) (16
//           bfloat16 values at each: lane l = (a[l], b[l])), F32x16 dot_pairs(acc, a,
//           b): acc[l] + the two products of a's pair l and b's (each exact; their addition to acc
//           rounded as the hardware does it, so a pair's grouping is part of the result;
//           denormal inputs and results flush to 0). Where kBf16Dot is false, BF16x32 is an
//           empty placeholder and its functions are declared below, never defined: kernels
//           take them only under `if constexpr`.
//   fp8     load_e4m3 (16 bytes of float8 e4m3, OCP's "e4m3fn": bias 7, subnormals, no
//           infinities, 0x7F / 0xFF NaN and never stored by us, widened to float32 exactly)
#pragma once

#include <stdint.h>

#if defined(PAGEDLLM_VEC_SCALAR)
#include "vec_scalar.h"
#elif defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512VL__) && defined(__AVX512DQ__)
#include "vec_avx512.h"
#elif defined(__AVX2__) && defined(__FMA__)
#include "vec_avx2.h"
#elif defined(__ARM_NEON) && defined(__aarch64__)
#include "vec_neon.h"
#else
#include "vec_scalar.h"
#endif

namespace vec {

#ifndef PAGEDLLM_VEC_BF16_DOT
inline constexpr bool kBf16Dot = false;
struct BF16x32 {};
BF16x32 load_pairs(const uint32_t* p);
BF16x32 set1_pair(uint32_t pair);
void store_pairs(uint32_t* p, BF16x32 a);
BF16x32 pack_pairs(F32x16 lo, F32x16 hi);
BF16x32 round_pairs(F32x16 lo, F32x16 hi);
BF16x32 zip_bf16(const uint16_t* a, const uint16_t* b);
F32x16 dot_pairs(F32x16 acc, BF16x32 a, BF16x32 b);
#endif

// v, as a value the compiler must take as it is: under -ffast-math it may regroup a chain of
// products (a * b * c) differently where the same code is inlined twice, so that the same
// inputs round differently; a product pinned by opaque is computed once, as written.
template <typename V>
inline V opaque(V v) {
  __asm__("" : "+m"(v));
  return v;
}

// exp(x) for x <= 0: 2^(x log2 e), the fraction by a degree-6 polynomial (relative error
// < 2e-7); very negative x flush to 0 (2^-126 and below are never produced).
inline F32x16 exp_nonpositive(F32x16 x) {
  x = max(x, set1(-87.0f));
  const F32x16 t = mul(x, set1(1.44269504f));
  const F32x16 n = floor(t);
  const F32x16 f = mul(sub(t, n), set1(0.69314718f));  // f in [0, ln 2)
  F32x16 p = set1(1.0f / 720);
  p = fma(p, f, set1(1.0f / 120));
  p = fma(p, f, set1(1.0f / 24));
  p = fma(p, f, set1(1.0f / 6));
  p = fma(p, f, set1(0.5f));
  p = fma(p, f, set1(1.0f));
  p = fma(p, f, set1(1.0f));
  return ldexp(p, n);
}

// g * sigmoid(g), the sigmoid from e = exp(-|g|) <= 1 so nothing overflows.
inline F32x16 silu(F32x16 g) {
  const F32x16 e = exp_nonpositive(sub(zero(), abs(g)));
  const F32x16 r = div(set1(1.f), add(set1(1.f), e));
  return mul(g, select(lt(g, zero()), mul(r, e), r));  // g < 0: e / (1 + e)
}

// GELU, tanh approximation (Hendrycks & Gimpel 2016): 0.5 g (1 + tanh(u)) with
// u = sqrt(2 / pi) (g + 0.044715 g^3), computed as g * sigmoid(2 u) (the same identity), the
// sigmoid as in silu so nothing overflows.
inline F32x16 gelu_tanh(F32x16 g) {
  const F32x16 u2 = mul(set1(1.5957691216f), fma(mul(set1(0.044715f), mul(g, g)), g, g));  // 2 u
  const F32x16 e = exp_nonpositive(sub(zero(), abs(u2)));
  const F32x16 r = div(set1(1.f), add(set1(1.f), e));
  return mul(g, select(lt(u2, zero()), mul(r, e), r));
}

// The first min(n, 16) values of p (lanes beyond are `fill`).
inline F32x16 load_first(const float* p, int64_t n, float fill) { return select(mask_first(n), load_first(p, n), set1(fill)); }

// One group of 32 values of a row of x (zeros past K): scale = max|x| / 127 and the 32 codes
// x / scale rounded to nearest even (llama.cpp's Q8_0 / Q8_1 activations), as two I32x16.
struct GroupCodes {
  float scale;
  I32x16 lo, hi;
};
inline GroupCodes quantize_group(const float* row, int64_t K, int64_t k0) {
  const F32x16 v0 = load_first(row + k0, K - k0), v1 = load_first(row + k0 + 16, K - k0 - 16);
  const float a = reduce_max(max(abs(v0), abs(v1)));
  const F32x16 inv = set1(a > 0.f ? 127.f / a : 0.f);
  return {a / 127.f, round_i32(mul(v0, inv)), round_i32(mul(v1, inv))};
}

}  // namespace vec

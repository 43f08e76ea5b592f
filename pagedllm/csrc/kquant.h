// GGUF weights multiplied as the file stores them, the parts that kquant.cpp (one layer) and
// moe.cpp (a layer's active experts) both drive: Q4_K, Q5_K and Q6_K super-blocks of 256
// weights, Q8_0 and Q5_0 blocks of 32 (the block structs of llama.cpp's ggml-common.h), each
// row of a weight [N, K] being its blocks one after another. Nothing is repacked, so a GEMV
// reads exactly the file's bytes per weight (Q4_K 4.5 bits, Q6_K 6.56, Q5_0 5.5, Q8_0 8.5).
//
// Arithmetic (llama.cpp's Q4_K x Q8_K family): x is quantized once per call, per row and
// group of 32, symmetric to int8 (vec.h's quantize_group, as the w8a8 / w4a8 GEMMs do), with
// each 16 codes' sum. A weight is w = ws * q + off per 16 weights, with q the stored unsigned
// code and ws, off from the block's scales:
//   Q4_K, Q5_K  ws = d * sc (6-bit), off = -dmin * m (6-bit), per 32; q in [0, 15] / [0, 31]
//   Q6_K        ws = d * sc (int8), off = -32 ws, per 16; q in [0, 63]
//   Q5_0        ws = d, off = -16 d, per 32; q in [0, 31]
//   Q8_0        ws = d, off = 0, per 32; q the stored int8 (the only signed codes)
// so y = sum over 64-weight chunks of (int8 dot products of q and x codes, 4 per int32 lane)
// * ws * x scale, plus sum over 16-weight pieces of off * (x scale * code sum). The unit of the
// loops is 256 weights (a super-block, or 8 blocks of 32): its 16 pieces' ws and off fill one
// F32x16 each, and its 4 chunks one U8x64 each, decoded in registers by the vector layer.
#pragma once

#include <stdint.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "aligned.h"
#include "gemm.h"
#include "pagedllm_abi.h"
#include "parallel.h"
#include "vec.h"

namespace kquant {

using namespace vec;

inline constexpr int64_t UNIT = 256;   // weights per loop unit: a super-block, or 8 blocks of 32
inline constexpr int64_t CHUNK = 64;   // weights per U8x64
inline constexpr int64_t XF = 32;      // floats per unit of a quantized x row: 16 scales, then 16 sums
inline constexpr int64_t XS = 16;      // floats per chunk of a quantized x row: its two groups' scales, 8 lanes each
inline constexpr int64_t xs_floats(int64_t kp) { return kp / CHUNK * XS; }  // chunk scales per row of kp codes
inline constexpr int64_t SPAN = 16;    // output rows per unit of thread work

// A float16 (at p, unaligned) in every lane.
inline F32x16 splat_f16(const uint8_t* p) { return f16_pairs(p, 0, 8); }

// Per 16 weights of a unit of 8 blocks of 32 (`chunks` of them real, two blocks each): each
// block's float16 d at byte 0, twice; zero past the real blocks.
inline F32x16 block_scales(const uint8_t* b, int64_t block_bytes, int chunks) {
  return chunks == 4 ? f16_pairs(b, block_bytes, 8) : f16_pairs(b, block_bytes, 2 * chunks);  // a whole unit: unrolled
}

// A uint32's 4 bytes each twice, in order: byte i of v at bytes 2i and 2i + 1.
inline uint64_t bytes_twice(uint32_t v) {
  uint64_t x = v;
  x = (x | x << 16) & 0x0000FFFF0000FFFFull;
  x = (x | x << 8) & 0x00FF00FF00FF00FFull;
  return x | x << 8;
}

// Q4_K and Q5_K: d, dmin (float16) at bytes 0 and 2, then 8 scales and 8 mins of 6 bits in 12
// bytes (scales 0-3 and mins 0-3 in the low 6 bits of bytes 0-7, the rest split between the
// low / high nibbles of bytes 8-11 and the top 2 bits of bytes 0-7), unpacked four at a time
// in 32-bit words and kept in registers (a round trip through memory stalls on the store).
inline void scales_mins(const uint8_t* b, F32x16& ws, F32x16& off) {
  uint32_t s[3];
  std::memcpy(s, b + 4, 12);
  constexpr uint32_t kLow6 = 0x3F3F3F3F, kLow4 = 0x0F0F0F0F, kLow2 = 0x03030303;
  const F32x16 sc = u8_f32(bytes_twice(s[0] & kLow6), bytes_twice((s[2] & kLow4) | (s[0] >> 6 & kLow2) << 4));
  const F32x16 mn = u8_f32(bytes_twice(s[1] & kLow6), bytes_twice((s[2] >> 4 & kLow4) | (s[1] >> 6 & kLow2) << 4));
  ws = mul(splat_f16(b), sc);
  off = sub(zero(), mul(splat_f16(b + 2), mn));
}

// Each format: kElems weights in kBytes per block; unit(row, u): unit u's first byte;
// scales(b, chunks, ws, off): ws and off per 16 weights of the unit (`chunks` of its 4 chunks
// real); codes(b, c): chunk c's 64 codes; kSigned: codes are s8 (else u8 in [0, kCodeMax]);
// kPieces: distinct scales per 32 weights (1: ws and off come in equal pairs); kBlockScales:
// ws is each block's float16 d at its byte 0, off is 0; kCodeShift: off = kCodeShift * ws
// (a weight is ws (q + kCodeShift)), or 0 where off is the block's own.

struct Q4K {  // d, dmin, scales[12], qs[128]: chunk c = qs[32c..] low nibbles, then high
  static inline constexpr int64_t kElems = 256, kBytes = 144;
  static constexpr bool kSigned = false;
  static constexpr int kCodeMax = 15, kPieces = 1;
  static constexpr bool kBlockScales = false;
  static constexpr int kCodeShift = 0;
  static const uint8_t* unit(const uint8_t* row, int64_t u) { return row + u * kBytes; }
  static void scales(const uint8_t* b, int, F32x16& ws, F32x16& off) { scales_mins(b, ws, off); }
  static U8x64 codes(const uint8_t* b, int c) { return shr_and_halves(dup32(b + 16 + 32 * c), 0, 4, 0x0F); }
};

struct Q5K {  // d, dmin, scales[12], qh[32], qs[128]: Q4_K's nibbles, bit 2c / 2c + 1 of qh the fifth
  static inline constexpr int64_t kElems = 256, kBytes = 176;
  static constexpr bool kSigned = false;
  static constexpr int kCodeMax = 31, kPieces = 1;
  static constexpr bool kBlockScales = false;
  static constexpr int kCodeShift = 0;
  static const uint8_t* unit(const uint8_t* row, int64_t u) { return row + u * kBytes; }
  static void scales(const uint8_t* b, int, F32x16& ws, F32x16& off) { scales_mins(b, ws, off); }
  static U8x64 codes(const uint8_t* b, int c) {
    const U8x64 low = shr_and_halves(dup32(b + 48 + 32 * c), 0, 4, 0x0F);
    return or_u8(low, shl_u8(shr_and_halves(dup32(b + 16), 2 * c, 2 * c + 1, 1), 4));
  }
};

struct Q6K {  // ql[128], qh[64], scales[16] (int8), d: per half h of 128, ql[64h..] low nibbles
  // (chunk 2h) then high (2h + 1); qh[32h..] bits 0-1, 2-3 (chunk 2h), 4-5, 6-7 (2h + 1) on top
  static inline constexpr int64_t kElems = 256, kBytes = 210;
  static constexpr bool kSigned = false;
  static constexpr int kCodeMax = 63, kPieces = 2;
  static constexpr bool kBlockScales = false;
  static constexpr int kCodeShift = -32;
  static const uint8_t* unit(const uint8_t* row, int64_t u) { return row + u * kBytes; }
  static void scales(const uint8_t* b, int, F32x16& ws, F32x16& off) {
    ws = mul(splat_f16(b + 208), load_s8_f32(reinterpret_cast<const int8_t*>(b + 192)));
    off = mul(ws, set1(float(kCodeShift)));
  }
  static U8x64 codes(const uint8_t* b, int c) {
    const int h = c / 2, q = c % 2;
    const U8x64 low = shr_and(load_u8x64(b + 64 * h), 4 * q, 0x0F);
    return or_u8(low, shl_u8(shr_and_halves(dup32(b + 128 + 32 * h), 4 * q, 4 * q + 2, 3), 4));
  }
};

struct Q80 {  // d, qs[32] (int8)
  static inline constexpr int64_t kElems = 32, kBytes = 34;
  static constexpr bool kSigned = true;
  static constexpr int kCodeMax = 127, kPieces = 1;
  static constexpr bool kBlockScales = true;
  static constexpr int kCodeShift = 0;
  static const uint8_t* unit(const uint8_t* row, int64_t u) { return row + u * 8 * kBytes; }
  static void scales(const uint8_t* b, int chunks, F32x16& ws, F32x16& off) {
    ws = block_scales(b, kBytes, chunks);
    off = zero();
  }
  static U8x64 codes(const uint8_t* b, int c) { return load_2x32(b + 2 * c * kBytes + 2, b + (2 * c + 1) * kBytes + 2); }
};

struct Q50 {  // d, qh (32 fifth bits), qs[16]: weight j < 16 in the low nibble of qs[j], j + 16 in its high one
  static inline constexpr int64_t kElems = 32, kBytes = 22;
  static constexpr bool kSigned = false;
  static constexpr int kCodeMax = 31, kPieces = 1;
  static constexpr bool kBlockScales = false;
  static constexpr int kCodeShift = -16;
  static const uint8_t* unit(const uint8_t* row, int64_t u) { return row + u * 8 * kBytes; }
  static void scales(const uint8_t* b, int chunks, F32x16& ws, F32x16& off) {
    ws = block_scales(b, kBytes, chunks);
    off = mul(ws, set1(float(kCodeShift)));
  }
  static U8x64 codes(const uint8_t* b, int c) {
    const uint8_t *x = b + 2 * c * kBytes, *y = x + kBytes;
    uint32_t hx, hy;
    std::memcpy(&hx, x + 2, 4), std::memcpy(&hy, y + 2, 4);
    return or_u8(nibbles_2x16(x + 6, y + 6), bits_to_bytes(hx | uint64_t(hy) << 32, 0x10));
  }
};

// fn(Format{}) for a type the GEMM takes; false for any other.
template <typename Fn>
inline bool with_format(int64_t type, Fn fn) {
  switch (type) {
    case PAGEDLLM_GGML_Q4_K: return fn(Q4K{}), true;
    case PAGEDLLM_GGML_Q5_K: return fn(Q5K{}), true;
    case PAGEDLLM_GGML_Q6_K: return fn(Q6K{}), true;
    case PAGEDLLM_GGML_Q8_0: return fn(Q80{}), true;
    case PAGEDLLM_GGML_Q5_0: return fn(Q50{}), true;
    default: return false;
  }
}

inline int64_t row_bytes(int64_t type, int64_t K) {
  int64_t bytes = 0;
  with_format(type, [&](auto f) {
    using F = decltype(f);
    if (K > 0 && K % (F::kElems == UNIT ? UNIT : CHUNK) == 0) bytes = K / F::kElems * F::kBytes;
  });
  return bytes;
}

// x [M, K] (stride ldx) -> codes [M][Kp] (Kp: K rounded up to UNIT, zeros past K); per row
// and unit XF floats: each 16 codes' scale, then each 16 codes' sum times that scale; and per
// row and chunk XS floats: the scale of its first 32 codes in lanes 0-7, of the next in 8-15
// (the block-scale formats' operand, as their chunk's two block scales lie); where
// vec::kDotXSums, per row and 4 codes xsum128 = -128 * their sum (dot_s8's), else nothing.
inline void quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K, int8_t* codes, float* f, float* xs,
                          int32_t* xsum128) {
  const int64_t kp = (K + UNIT - 1) / UNIT * UNIT, lf = kp / UNIT * XF, ls = xs_floats(kp);
  par::parallel_for(M, [&](int64_t m) {
    int8_t* row = codes + m * kp;
    for (int64_t g = 0; g < kp / 32; ++g) {
      float* uf = f + m * lf + g / 8 * XF;
      const int64_t p = g % 8 * 2;
      float scale = 0.f;
      if (g * 32 >= K) {
        std::memset(row + g * 32, 0, 32);
        uf[p] = uf[p + 1] = uf[16 + p] = uf[17 + p] = 0.f;
      } else {
        const GroupCodes q = quantize_group(x + m * ldx, K, g * 32);
        store_i8(row + g * 32, q.lo);
        store_i8(row + g * 32 + 16, q.hi);
        scale = uf[p] = uf[p + 1] = q.scale;
        uf[16 + p] = q.scale * reduce_add(to_f32(q.lo));  // exact integer sums
        uf[17 + p] = q.scale * reduce_add(to_f32(q.hi));
      }
      std::fill_n(xs + m * ls + g * (XS / 2), XS / 2, scale);
    }
    if constexpr (kDotXSums)
      for (int64_t l = 0; l < kp / 4; ++l)
        xsum128[m * kp / 4 + l] = -128 * (row[4 * l] + row[4 * l + 1] + row[4 * l + 2] + row[4 * l + 3]);
  }, 17);
}

// xsum128 + i, or null where the ISA's dot_s8 takes no x sums (kDotXSums false: empty).
inline const int32_t* xsum_at(const int32_t* xsum128, int64_t i) { return kDotXSums ? xsum128 + i : nullptr; }

// sums[r][j] = row w . x row r as 16 partial sums (their reduce_add is the dot product), for R
// rows of quantized x (codes stride kp, floats stride lf, chunk scales stride kp / CHUNK * XS).
// The block-scale formats (Q8_0: one scale per 32 weights, no offset) skip the unit's scale
// gather: a chunk's two block scales, spread over its halves once for all R rows, times each
// row's chunk scales (the same products in the same lanes as the gathered way, so the same
// bits, in fewer instructions per block and row). Never inlined: inside rows_times_x's loops
// GCC compiled AVX2's one-row Q4_K tile 10-15% slower (docs/benchmarks.md, "session 20").
template <class F, int R>
[[gnu::noinline]] void tile(const uint8_t* w, int64_t K, const int8_t* xq, int64_t kp, const float* xf, int64_t lf,
                            const float* xs, const int32_t* xsum128, F32x16 (*sums)[SPAN], int64_t j) {
  constexpr bool kPerBlock = F::kBlockScales;
  const int64_t ls = xs_floats(kp), kq4 = kp / 4;
  F32x16 acc[R];
  for (int r = 0; r < R; ++r) acc[r] = zero();
  const int64_t units = (K + UNIT - 1) / UNIT;
  for (int64_t u = 0; u < units; ++u) {
    const int chunks = int(std::min(UNIT, K - u * UNIT) / CHUNK);
    const uint8_t* b = F::unit(w, u);
    F32x16 ws, off, s[R];
    if constexpr (!kPerBlock) {
      F::scales(b, chunks, ws, off);
      for (int r = 0; r < R; ++r) {
        const float* f = xf + r * lf + u * XF;
        s[r] = mul(ws, load(f));
        acc[r] = fma(off, load(f + 16), acc[r]);
      }
    }
    auto chunk = [&](int c) __attribute__((always_inline)) {  // inlined: a call costs more than a chunk
      const U8x64 q = F::codes(b, c);
      [[maybe_unused]] const S8W qs = F::kSigned ? prepare_s8(q) : S8W{};
      F32x16 d;
      if constexpr (kPerBlock) d = halves_f16(b + 2 * c * F::kBytes, b + (2 * c + 1) * F::kBytes);
      for (int r = 0; r < R; ++r) {
        const int8_t* x = xq + r * kp + u * UNIT + c * CHUNK;
        I32x16 p;
        if constexpr (F::kSigned) p = dot_s8(qs, x, xsum_at(xsum128, r * kq4 + u * (UNIT / 4) + c * (CHUNK / 4)));
        else p = dot_u8s8(zero_i32(), q, x);
        F32x16 sc;
        if constexpr (kPerBlock) {  // the same products as mul(ws, f), lanes as expand4's
          sc = mul(d, load(xs + r * ls + (u * (UNIT / CHUNK) + c) * XS));
        } else {
          sc = expand4(s[r], c);
        }
        acc[r] = fma(to_f32(p), sc, acc[r]);
      }
    };
    if (chunks == 4) {
      chunk(0), chunk(1), chunk(2), chunk(3);
    } else {
      for (int c = 0; c < chunks; ++c) chunk(c);
    }
  }
  for (int r = 0; r < R; ++r) sums[r][j] = acc[r];
}

// Whether w is a weight [N, K] the GEMM takes: 1 to PAGEDLLM_KQUANT_MAX_PARTS parts, each of a
// type it reads at this K, all as stored or (`panels`) all carrying PAGEDLLM_KQUANT_PANELS
// (kquant_panels.h's layout), their rows adding up to N.
inline bool fits(const KQuantWeight& w, int64_t N, int64_t K, bool panels = false) {
  if (w.num_parts < 1 || w.num_parts > PAGEDLLM_KQUANT_MAX_PARTS) return false;
  int64_t rows = 0;
  for (int64_t p = 0; p < w.num_parts; ++p) {
    const KQuantPart& part = w.parts[p];
    if ((part.type & PAGEDLLM_KQUANT_PANELS) != (panels ? PAGEDLLM_KQUANT_PANELS : 0) ||
        row_bytes(part.type & ~PAGEDLLM_KQUANT_PANELS, K) == 0 || part.rows < 0 || (part.rows > 0 && !part.blocks))
      return false;
    rows += part.rows;
  }
  return rows == N;
}

// M rows of x quantized once for the GEMM (quantize_rows): codes [M][kp], floats [M][lf],
// chunk scales [M][kp / CHUNK * XS], and where vec::kDotXSums xsum128 [M][kp / 4].
struct QuantizedX {
  int64_t kp, lf;
  aligned::vector<int8_t> codes;
  aligned::vector<float> f, xs;
  aligned::vector<int32_t> xsum128;

  QuantizedX() : kp(0), lf(0) {}
  QuantizedX(const float* x, int64_t ldx, int64_t M, int64_t K)
      : kp((K + UNIT - 1) / UNIT * UNIT),
        lf(kp / UNIT * XF),
        codes(static_cast<size_t>(M * kp)),
        f(static_cast<size_t>(M * lf)),
        xs(static_cast<size_t>(M * xs_floats(kp))),
        xsum128(kDotXSums ? static_cast<size_t>(M * kp / 4) : 0) {
    quantize_rows(x, ldx, M, K, codes.data(), f.data(), xs.data(), xsum128.data());
  }
};

// Rows of x per chunk whose codes fit in L2 while every weight row reads them.
inline int64_t chunk_rows(int64_t kp) { return std::max<int64_t>(kGemmRowsKQ, 262144 / kp / kGemmRowsKQ * kGemmRowsKQ); }

// fn(u, chunks, b, ws, off) for each unit u of a row of K weights in format F: its blocks b,
// its whole chunks of CHUNK weights, and its 16 scales and offsets (weight = code * ws + off
// per 16 weights) unpacked to float.
template <class F, class Fn>
inline void for_each_unit(const uint8_t* row, int64_t K, Fn&& fn) {
  for (int64_t u = 0; u < (K + UNIT - 1) / UNIT; ++u) {
    const int chunks = int(std::min(UNIT, K - u * UNIT) / CHUNK);
    const uint8_t* b = F::unit(row, u);
    F32x16 ws, off;
    F::scales(b, chunks, ws, off);
    float wa[16], oa[16];
    store(wa, ws), store(oa, off);
    fn(u, chunks, b, static_cast<const float*>(wa), static_cast<const float*>(oa));
  }
}

// Rows [0, nrows) (nrows <= PANEL) of a weight in format F (row stride rb bytes, K weights)
// decoded for the prefill GEMM's tiles (gemm.h): codes [K/4][PANEL][4], row n's code of weight
// k at (k / 4 * PANEL + n) * 4 + k % 4 (u8 codes, or Q8_0's s8); ws, off [K / 32 * kPieces][PANEL]
// per piece of 32 / kPieces weights. Rows past nrows are zero. The codes of 16 rows' chunks
// are transposed in registers (vec's transpose_u32), each quad's 16 columns one store.
inline constexpr int64_t PANEL = 32;
inline constexpr int64_t kMaxUnitBytes = 8 * Q80::kBytes;  // a unit's bytes in the largest format
template <class F>
inline void decode_panel(const uint8_t* rows, int64_t rb, int64_t nrows, int64_t K, uint8_t* codes, float* ws,
                         float* off) {
  static_assert(F::kElems == UNIT ? F::kBytes <= kMaxUnitBytes : UNIT / F::kElems * F::kBytes <= kMaxUnitBytes);
  constexpr int64_t per_unit = UNIT / 32 * F::kPieces;  // pieces per unit
  alignas(64) static constexpr uint8_t kZeroUnit[kMaxUnitBytes] = {};  // the codes of a row past nrows
  std::fill(ws, ws + K / 32 * F::kPieces * PANEL, 0.f);
  std::fill(off, off + K / 32 * F::kPieces * PANEL, 0.f);
  for (int64_t n = 0; n < nrows; ++n) {
    for_each_unit<F>(rows + n * rb, K, [&](int64_t u, int chunks, const uint8_t*, const float* wa, const float* oa) {
      for (int64_t i = 0; i < 2 * chunks * F::kPieces; ++i) {
        const int64_t j = i * (2 / F::kPieces);  // the piece's first 16-weight scale
        ws[(u * per_unit + i) * PANEL + n] = wa[j];
        off[(u * per_unit + i) * PANEL + n] = oa[j];
      }
    });
  }
  for (int64_t n0 = 0; n0 < PANEL; n0 += 16) {
    for (int64_t u = 0; u < (K + UNIT - 1) / UNIT; ++u) {
      const int chunks = int(std::min(UNIT, K - u * UNIT) / CHUNK);
      const uint8_t* b[16];
      for (int i = 0; i < 16; ++i) b[i] = n0 + i < nrows ? F::unit(rows + (n0 + i) * rb, u) : kZeroUnit;
      for (int c = 0; c < chunks; ++c) {
        U8x64 v[16];
        for (int i = 0; i < 16; ++i) v[i] = F::codes(b[i], c);
        transpose_u32(v);
        uint8_t* dst = codes + ((u * UNIT + c * CHUNK) / 4 * PANEL + n0) * 4;
        for (int q = 0; q < 16; ++q) store_u8x64(dst + q * PANEL * 4, v[q]);
      }
    }
  }
}

// Consecutive rows of a weight, within one part: rows [n0, n1) of part `part`,
// output columns [col, col + n1 - n0).
struct Span {
  int64_t part, n0, n1, col;
};

// The spans of a weight that `fits` (of `rows` rows, the last of a part fewer), in output
// column order: the unit threads share out.
inline std::vector<Span> spans_of(const KQuantWeight& w, int64_t rows = SPAN) {
  std::vector<Span> spans;
  int64_t col = 0;
  for (int64_t p = 0; p < w.num_parts; ++p) {
    for (int64_t n0 = 0; n0 < w.parts[p].rows; n0 += rows)
      spans.push_back({p, n0, std::min(n0 + rows, w.parts[p].rows), col + n0});
    col += w.parts[p].rows;
  }
  return spans;
}

// Weight rows that rows_times_x asks the memory system for ahead of the row it reads: at one
// row of x the loop reads each weight once and is bound by memory, and an Intel core's
// prefetchers alone kept too few lines in flight (SmolLM2's Q8_0 lm_head read at 12-22 GB/s
// of a 20-26 GB/s host, docs/benchmarks.md, "Intel Xeon, session 18").
constexpr int64_t kPrefetchRows = 8;

// Rows [n0, n1) of `part` (of output columns col, col + 1, ...) against `rows` rows of x
// from row m0 of xq: y[(m0 + m) * ldy + col + n - n0] (+ bias[col + n - n0] where bias). Per
// SPAN weight rows and tile of kGemmRowsKQ (or kGemmRowsKQ + 1) rows of x, the tiles' partial
// sums are reduced together (reduce_add16: each output's sum in the same order as its own
// reduce_add).
inline void rows_times_x(const KQuantPart& part, int64_t n0, int64_t n1, int64_t col, int64_t K, const QuantizedX& xq,
                         int64_t m0, int64_t rows, const float* bias, float* y, int64_t ldy) {
  with_format(part.type, [&](auto f) {
    using F = decltype(f);
    const int64_t rb = K / F::kElems * F::kBytes, kp = xq.kp, ls = xs_floats(kp);
    // A last tile of one row would decode every weight chunk again for that row alone: a
    // remainder of one joins the last full tile (speculative verification's k + 1 rows).
    const int64_t body = rows > kGemmRowsKQ && rows % kGemmRowsKQ == 1 ? rows - kGemmRowsKQ - 1 : rows;
    const uint8_t* blocks = static_cast<const uint8_t*>(part.blocks);
    F32x16 sums[kGemmRowsKQ + 1][SPAN];
    for (int64_t b0 = n0; b0 < n1; b0 += SPAN) {
      const int64_t count = std::min(SPAN, n1 - b0), c0 = col + b0 - n0;
      for (auto& s : sums) std::fill(s + count, s + SPAN, zero());
      const F32x16 b = bias ? load_first(bias + c0, count) : zero();
      auto rows_tile = [&](auto r, int64_t m) {
        constexpr int R = decltype(r)::value;
        const int64_t mx = m0 + m;
        for (int64_t n = b0; n < b0 + count; ++n) {
          if (m == 0 && n + kPrefetchRows < part.rows)  // that row, line by line (it may be another span's)
            for (int64_t i = 0; i < rb; i += 64) __builtin_prefetch(blocks + (n + kPrefetchRows) * rb + i);
          tile<F, R>(blocks + n * rb, K, xq.codes.data() + mx * kp, kp, xq.f.data() + mx * xq.lf, xq.lf,
                     xq.xs.data() + mx * ls, xsum_at(xq.xsum128.data(), mx * kp / 4), sums, n - b0);
        }
        for (int i = 0; i < R; ++i) store_first(y + (mx + i) * ldy + c0, add(reduce_add16(sums[i]), b), count);
      };
      gemm::panel_rows<kGemmRowsKQ>(body, rows_tile);
      if (body < rows) rows_tile(std::integral_constant<int, kGemmRowsKQ + 1>{}, body);
    }
  });
}

}  // namespace kquant

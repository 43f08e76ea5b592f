// The GEMM micro-kernels on packed weights that linear.cpp (one layer) and moe.cpp (a layer's
// active experts) both drive, and the on-the-fly quantization of their int8 activations.
// Weight formats and panel layouts: linear.cpp's header comment. Each tile computes R rows x
// one 32-column panel of y while it walks K once; a row's result depends only on that row
// (every row takes the same instructions whatever the batch), so callers may split rows and
// panels over threads any way they like.
#pragma once

#include <stdint.h>

#include <algorithm>
#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#include "pagedllm_abi.h"
#include "parallel.h"
#include "vec.h"

namespace gemm {

using namespace vec;

constexpr int64_t NB = PAGEDLLM_PANEL;             // output columns per panel
constexpr int64_t QG = PAGEDLLM_QUANT_GROUP;       // k per quantization group, of weights and of activations alike
constexpr int64_t Q4_NIBBLES = QG / 4 * 64;        // bytes of codes per panel and group
constexpr int64_t Q4_BYTES = Q4_NIBBLES + 4 * NB;  // + d and m, float16 per column
constexpr int64_t Q4S_BYTES = Q4_NIBBLES + 2 * NB;  // a symmetric weight's (every m = -8 d): + d only
static_assert(Q4_BYTES == PAGEDLLM_Q4A8_GROUP_BYTES && Q4S_BYTES == PAGEDLLM_Q4A8_SYMMETRIC_GROUP_BYTES,
              "pagedllm_abi.h declares another w4a8 layout");
// Bytes per panel and group of a w4a8 weight, symmetric or not.
constexpr int64_t q4_group_bytes(bool symmetric) { return symmetric ? Q4S_BYTES : Q4_BYTES; }

// The locality a tile of R rows asks for a line of its panel ahead with
// (__builtin_prefetch(p, 0, kWeightLocality<R>)): into L2 (prefetcht1) for one row, into L1
// (prefetcht0) for more. A single row (a batch-1 GEMV) uses the weights faster than memory
// brings them, and a core keeps few misses of L1 in flight (its fill buffers) but many of L2:
// asked into L1, batch-1 GEMMs read their weights 5-30% slower. More rows are bound by their
// arithmetic, and their loads would wait on L2 (16 rows 2-5% slower asked into L2); AVX2's and
// NEON's prefill tiles are 2-3 rows, and AVX-512's K-quant tiles 4. A constant, not a function:
// a call GCC left out of line cost the float32 tile its registers (2.6x slower).
// docs/benchmarks.md, "AMD EPYC Zen 4, session 48".
template <int R>
constexpr int kWeightLocality = R == 1 ? 2 : 3;

// f.template operator()<flag>() for a flag known at run time (f: a lambda templated on one
// bool): the one branch between a tile's two instantiations, as linear.cpp and moe.cpp take it.
template <class F>
inline void with_flag(bool flag, const F& f) {
  if (flag)
    f.template operator()<true>();
  else
    f.template operator()<false>();
}

template <int R>
inline void store(F32x16 (&acc)[R][2], float* y, int64_t ldy, int64_t ncols) {
  for (int r = 0; r < R; ++r) {
    store_first(y + r * ldy, acc[r][0], ncols);
    store_first(y + r * ldy + 16, acc[r][1], ncols - 16);
  }
}

template <int R>
inline void init(F32x16 (&acc)[R][2], const float* bias) {
  for (int r = 0; r < R; ++r) {
    acc[r][0] = bias ? load(bias) : zero();
    acc[r][1] = bias ? load(bias + 16) : zero();
  }
}

// x: R rows of K floats (stride ldx); panel: [K][32] float32.
template <int R>
inline void tile_f32(const float* x, int64_t ldx, const float* panel, int64_t K, const float* bias, float* y,
                     int64_t ldy, int64_t ncols) {
  F32x16 acc[R][2];
  init<R>(acc, bias);
  for (int64_t k = 0; k < K; ++k) {
    __builtin_prefetch(panel + (k + 8) * NB, 0, kWeightLocality<R>);
    __builtin_prefetch(panel + (k + 8) * NB + 16, 0, kWeightLocality<R>);
    const F32x16 w0 = load(panel + k * NB), w1 = load(panel + k * NB + 16);
    for (int r = 0; r < R; ++r) {
      const F32x16 a = set1(x[r * ldx + k]);
      acc[r][0] = fma(a, w0, acc[r][0]);
      acc[r][1] = fma(a, w1, acc[r][1]);
    }
  }
  store<R>(acc, y, ldy, ncols);
}

// A group's 32 weight scales, one per column: float32, or float16 (Q8_0's d as the file stores it).
inline void load_scales(const float* p, F32x16& d0, F32x16& d1) { d0 = load(p), d1 = load(p + 16); }
inline void load_scales(const uint16_t* p, F32x16& d0, F32x16& d1) { d0 = load_f16(p), d1 = load_f16(p + 16); }

// out[r] += xscale[r * G] * wscale * acc[r] (one group's int32 sums of R rows x 32 columns;
// wscale float32 or float16 [32]); kColumnScales (the weight scales per column, applied once
// by finish): out[r] += xscale[r * G] * acc[r].
template <int R, bool kColumnScales, typename WS = float>
inline void add_scaled(F32x16 (&out)[R][2], const I32x16 (&acc)[R][2], const WS* wscale, const float* xscale,
                       int64_t G) {
  if constexpr (kColumnScales) {
    for (int r = 0; r < R; ++r) {
      const F32x16 s = set1(xscale[r * G]);
      out[r][0] = fma(to_f32(acc[r][0]), s, out[r][0]);
      out[r][1] = fma(to_f32(acc[r][1]), s, out[r][1]);
    }
  } else {
    F32x16 d0, d1;
    load_scales(wscale, d0, d1);
    for (int r = 0; r < R; ++r) {
      const F32x16 s = set1(xscale[r * G]);
      out[r][0] = fma(to_f32(acc[r][0]), mul(d0, s), out[r][0]);
      out[r][1] = fma(to_f32(acc[r][1]), mul(d1, s), out[r][1]);
    }
  }
}

// y = out * wscale + bias (per-column weight scales [32], bias null or [32]) into R rows of y.
template <int R>
inline void finish(F32x16 (&out)[R][2], const float* wscale, const float* bias, float* y, int64_t ldy, int64_t ncols) {
  const F32x16 d0 = load(wscale), d1 = load(wscale + 16);
  const F32x16 b0 = bias ? load(bias) : zero(), b1 = bias ? load(bias + 16) : zero();
  for (int r = 0; r < R; ++r) {
    out[r][0] = fma(out[r][0], d0, b0);
    out[r][1] = fma(out[r][1], d1, b1);
  }
  store<R>(out, y, ldy, ncols);
}

// A w8a8 weight code q as the panels hold it (the byte q + 128 where vec.h's kDotXSums), and back.
inline int8_t stored_code(int8_t q) { return kDotXSums ? static_cast<int8_t>(q ^ 0x80) : q; }

// x: R rows of kq quads of s8 codes (stride ldx, in int32), groups of QG/4 quads; xscale: R rows
// of G scales (stride G); xsum128: R rows of G (stride G; quantize_rows', read where
// kDotXSums); panel: [kq][32][4] stored codes (stored_code). kColumnScales (w8a8): wscale
// [32] float32, one per column, y[r, n] = wscale[n] * sum_g xscale[r, g] * (sum_k x w) + bias[n];
// else (Q8_0's blocks) wscale [G][32] float32 or float16, y[r, n] = sum_g xscale[r, g] *
// wscale[g, n] * (sum_k x w) + bias[n] (a multiply more per group and accumulator). ahead:
// null, or the next panel (and, for Q8_0, its scales) to ask for into L2 group by group as
// this tile walks its own (linear.cpp's for_panel_tiles).
template <int R, bool kColumnScales, typename WS = float>
inline void tile_w8a8(const int32_t* x, int64_t ldx, const float* xscale, const int8_t* panel, int64_t G,
                      const int32_t* xsum128, const WS* wscale, const float* bias, float* y, int64_t ldy,
                      int64_t ncols, const int8_t* ahead = nullptr, const WS* ahead_scales = nullptr) {
  constexpr int64_t quads = QG / 4;
  F32x16 out[R][2];
  init<R>(out, kColumnScales ? nullptr : bias);
  for (int64_t g = 0; g < G; ++g) {
    I32x16 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = dot_init(kDotXSums ? xsum128 + r * G + g : nullptr);
    const int8_t* pg = panel + g * quads * 4 * NB;
    if (ahead) {
      for (int64_t line = 0; line < quads * 4 * NB; line += 64)
        __builtin_prefetch(ahead + g * quads * 4 * NB + line, 0, 2);
      if (!kColumnScales) __builtin_prefetch(ahead_scales + g * NB, 0, 2);
    }
    for (int64_t k = 0; k < quads; ++k) {
      const int8_t* w = pg + k * 4 * NB;
      // Both lines of the quad 4 groups on: a batch-1 GEMV streams the panel from memory
      // (asking for every other line left it 15-25% slower, docs/benchmarks.md, session 31).
      __builtin_prefetch(pg + (k + 4 * quads) * 4 * NB, 0, kWeightLocality<R>);
      __builtin_prefetch(pg + (k + 4 * quads) * 4 * NB + 2 * NB, 0, kWeightLocality<R>);
      for (int r = 0; r < R; ++r) {
        const DotX a = dot_prepare(x + r * ldx + g * quads + k);
        acc[r][0] = dot(acc[r][0], a, w);
        acc[r][1] = dot(acc[r][1], a, w + 2 * NB);
      }
    }
    add_scaled<R, kColumnScales, WS>(out, acc, kColumnScales ? nullptr : wscale + g * NB, xscale + g, G);
  }
  if constexpr (kColumnScales)
    finish<R>(out, wscale, bias, y, ldy, ncols);
  else
    store<R>(out, y, ldy, ncols);
}

// A panel's int8 codes widened for tile_w8a8_wide: kq quads of [32][4] (linear_pack_w8a8's
// panel) -> 2 kq pairs of [32][2] int16 (pair 2 q + h holds k = 4 q + 2 h and 4 q + 2 h + 1).
inline void widen_panel(const int8_t* packed, int64_t kq, int16_t* wide) {
  for (int64_t q = 0; q < kq; ++q)
    for (int h = 0; h < 2; ++h)
      for (int64_t c = 0; c < NB; ++c)
        for (int j = 0; j < 2; ++j)
          wide[((2 * q + h) * NB + c) * 2 + j] = stored_code(packed[(q * NB + c) * 4 + 2 * h + j]);
}

// tile_w8a8 for ISAs with kGemmRowsI8Wide > 0: x as R rows of 2 kq pairs of int16 codes
// (quantize_rows' kWide; stride ldx, in int32), panel as widen_panel's, wscale per column; the
// same y, the same int32 sums (exact) scaled in the same order.
template <int R>
inline void tile_w8a8_wide(const int32_t* x, int64_t ldx, const float* xscale, const int16_t* panel, int64_t G,
                           const float* wscale, const float* bias, float* y, int64_t ldy, int64_t ncols) {
  constexpr int64_t pairs = QG / 2;
  F32x16 out[R][2];
  init<R>(out, nullptr);
  for (int64_t g = 0; g < G; ++g) {
    I32x16 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = zero_i32();
    const int16_t* pg = panel + g * pairs * 2 * NB;
    __builtin_prefetch(pg + 2 * pairs * 2 * NB, 0, kWeightLocality<R>);
    for (int64_t k = 0; k < pairs; ++k) {
      const auto w0 = dot_wide_load(pg + k * 2 * NB), w1 = dot_wide_load(pg + k * 2 * NB + NB);
      for (int r = 0; r < R; ++r) {
        const auto a = dot_wide_prepare(x + r * ldx + g * pairs + k);
        acc[r][0] = dot_wide(acc[r][0], a, w0);
        acc[r][1] = dot_wide(acc[r][1], a, w1);
      }
    }
    add_scaled<R, true, float>(out, acc, nullptr, xscale + g, G);
  }
  finish<R>(out, wscale, bias, y, ldy, ncols);
}

// x: R rows of kq quads of s8 codes (stride ldx, in int32), groups of QG/4 quads; xscale, xsum:
// R rows of G (stride G), xsum = xscale * the group's code sum; panel: G groups of Q4_BYTES.
// y[r, n] = sum_g xscale[r, g] * d[g, n] * (sum_k x q) + xsum[r, g] * m[g, n] + bias[n].
// kSymmetric (every m = -8 d: GGUF Q4_0; the panel's groups are of Q4S_BYTES, without m):
// xcsum, R rows of G (stride G), the group's code sum (quantize_rows' csum), starts the int32
// sums at -8 xcsum, and xsum is not read:
// y[r, n] = sum_g xscale[r, g] * d[g, n] * (sum_k x (q - 8)) + bias[n], a multiply and an FMA
// a group and accumulator where m's term took a third (on AVX-512 VNNI these share the pipes
// of the dot products: docs/benchmarks.md, "AMD EPYC Zen 4, session 51"). ahead: as
// tile_w8a8's.
template <int R, bool kSymmetric = false>
inline void tile_q4a8(const int32_t* x, int64_t ldx, const float* xscale, const float* xsum, const int32_t* xcsum,
                      const uint8_t* panel, int64_t G, const float* bias, float* y, int64_t ldy, int64_t ncols,
                      const uint8_t* ahead = nullptr) {
  constexpr int64_t quads = QG / 4, GB = q4_group_bytes(kSymmetric);
  F32x16 out[R][2];
  init<R>(out, bias);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* pg = panel + g * GB;
    __builtin_prefetch(pg + 4 * GB, 0, kWeightLocality<R>);
    if (ahead)
      for (int64_t line = 0; line < GB; line += 64) __builtin_prefetch(ahead + g * GB + line, 0, 2);
    Q4Sum acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = q4sum_zero();
#pragma GCC unroll 8
    for (int64_t k = 0; k < quads; ++k) {
      if (k % 2 == 0) __builtin_prefetch(pg + 4 * GB + 64 * (k / 2 + 1), 0, kWeightLocality<R>);
      const Q4W w = dot_q4_load(pg + k * 64);
      for (int r = 0; r < R; ++r) dot_q4(acc[r][0], acc[r][1], dot_q4_prepare(x + r * ldx + g * quads + k), w);
    }
    const uint16_t* dm = reinterpret_cast<const uint16_t*>(pg + Q4_NIBBLES);
    const F32x16 d0 = load_f16(dm), d1 = load_f16(dm + 16);
    if constexpr (kSymmetric) {
      for (int r = 0; r < R; ++r) {
        const F32x16 s = set1(xscale[r * G + g]);
        const I32x16 start = splat_i32(-8 * xcsum[r * G + g]);
        out[r][0] = fma(to_f32(q4sum_add(start, acc[r][0])), mul(d0, s), out[r][0]);
        out[r][1] = fma(to_f32(q4sum_add(start, acc[r][1])), mul(d1, s), out[r][1]);
      }
    } else {
      const F32x16 m0 = load_f16(dm + NB), m1 = load_f16(dm + NB + 16);
      for (int r = 0; r < R; ++r) {
        const F32x16 s = set1(xscale[r * G + g]), t = set1(xsum[r * G + g]);
        out[r][0] = fma(to_f32(q4sum_i32(acc[r][0])), mul(d0, s), fma(m0, t, out[r][0]));
        out[r][1] = fma(to_f32(q4sum_i32(acc[r][1])), mul(d1, s), fma(m1, t, out[r][1]));
      }
    }
  }
  store<R>(out, y, ldy, ncols);
}

static_assert(QG == 32, "vec.h's quantize_group quantizes activations in groups of 32");

// The M rows of x (stride ldx) quantized per group of QG k for the integer GEMMs: codes
// [M][kq] (four s8 per int32; Kp = kq * 4 = K rounded up to QG; with kWide int16 instead, [M][2
// kq] in int32: tile_w8a8_wide's input) and scale [M][G]; with kSums (w4a8, llama.cpp's Q8_1,
// and the K-quants' unsigned codes: tile_q4a8's and tile_u8a8's input) also csum [M][G], the
// group's code sum, and sum [M][G] = scale * csum, with kSums16 as well csum16 and sum16
// [M][2G], the same per half group (tile_u8a8's for 16-weight scales); without (w8a8, Q8_0:
// tile_w8a8's input), where the vector layer's dot product starts from x's sums (kDotXSums),
// xsum128 [M][G] = -128 * the group's code sum.
struct QuantizedRows {
  std::vector<int32_t> codes;
  std::vector<float> scale, sum, sum16;
  std::vector<int32_t> csum, csum16, xsum128;
};
template <bool kSums, bool kSums16 = false, bool kWide = false>
inline QuantizedRows quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K) {
  static_assert(kSums || !kSums16, "half-group sums go with the plain s8 codes");
  static_assert(!(kSums && kWide), "int16 codes are w8a8's");
  const int64_t G = (K + QG - 1) / QG, kq = G * QG / 4 * (kWide ? 2 : 1);  // kq: a row's int32
  constexpr bool kXSums128 = kDotXSums && !kSums && !kWide;
  QuantizedRows q{std::vector<int32_t>(static_cast<size_t>(M * kq)), std::vector<float>(static_cast<size_t>(M * G)),
                  std::vector<float>(kSums ? static_cast<size_t>(M * G) : 0),
                  std::vector<float>(kSums16 ? static_cast<size_t>(2 * M * G) : 0),
                  std::vector<int32_t>(kSums ? static_cast<size_t>(M * G) : 0),
                  std::vector<int32_t>(kSums16 ? static_cast<size_t>(2 * M * G) : 0),
                  std::vector<int32_t>(kXSums128 ? static_cast<size_t>(M * G) : 0)};
  par::parallel_for(M, [&](int64_t m) {
    const float* src = x + m * ldx;
    int8_t* row = reinterpret_cast<int8_t*>(q.codes.data() + m * kq);
    // Code sums (exact integers in float, |sum| <= 32 * 127) of up to 16 groups (8 with
    // kSums16: a vector per half) reduced at once by reduce_add16, not one tree per group.
    constexpr int64_t kPer = kSums16 ? 2 : 1, kBatch = 16 / kPer;
    F32x16 pending[16];
    for (F32x16& v : pending) v = zero();
    int64_t g0 = 0;  // the first group whose sums are pending
    const auto flush = [&](int64_t g1) {
      float s[16];
      store(s, reduce_add16(pending));
      for (int64_t g = g0; g < g1; ++g) {
        const float* h = s + (g - g0) * kPer;
        const float sum = kSums16 ? h[0] + h[1] : h[0];
        const int64_t i = m * G + g;
        if constexpr (kSums) q.sum[i] = q.scale[i] * sum, q.csum[i] = static_cast<int32_t>(sum);
        if constexpr (kSums16) {
          q.sum16[2 * i] = q.scale[i] * h[0], q.sum16[2 * i + 1] = q.scale[i] * h[1];
          q.csum16[2 * i] = static_cast<int32_t>(h[0]), q.csum16[2 * i + 1] = static_cast<int32_t>(h[1]);
        }
        if constexpr (kXSums128) q.xsum128[i] = -128 * static_cast<int32_t>(sum);
      }
      g0 = g1;
    };
    for (int64_t g = 0; g < G; ++g) {
      const GroupCodes c = quantize_group(src, K, g * QG);
      q.scale[m * G + g] = c.scale;
      if constexpr (kWide) {
        int8_t s8[QG];
        store_i8(s8, c.lo);
        store_i8(s8 + 16, c.hi);
        std::copy(s8, s8 + QG, reinterpret_cast<int16_t*>(q.codes.data() + m * kq) + g * QG);
      } else {
        store_i8(row + g * QG, c.lo);
        store_i8(row + g * QG + 16, c.hi);
      }
      if constexpr (kSums || kXSums128) {
        if constexpr (kSums16) {
          pending[2 * (g - g0)] = to_f32(c.lo);
          pending[2 * (g - g0) + 1] = to_f32(c.hi);
        } else {
          pending[g - g0] = add(to_f32(c.lo), to_f32(c.hi));
        }
        if (g + 1 - g0 == kBatch || g + 1 == G) flush(g + 1);
      }
    }
  }, 17);
  return q;
}

// x, xscale: as tile_q4a8; src: a panel of 32 columns of unsigned codes in [0, kMax] and their
// scales, read through src.codes(quad) (a Q4W: the quad's codes of the 32 columns, vec.h's
// dot_u8_load layout), src.scales(piece, ws, off) (ws and, where kShift is 0, off of the
// piece's 32 columns, in two F32x16) and src.prefetch(quad) (a hint, once per quad in order);
// each group of QG k in P pieces of QG / P k (a weight is ws q + off), with per row xsum
// [G * P] (stride G * P) = xscale * the piece's code sum (quantize_rows' sum for P = 1, sum16
// for P = 2).
// y[r, n] = sum over pieces xscale[r, g] * ws[p, n] * (sum_k x q) + xsum[r, p] * off[p, n].
// With kShift != 0 the offset is kShift * ws (Q5_0's -16 d, Q6_K's -32 ws): the code sums
// xcsum (quantize_rows' csum or csum16) start the int32 sums at kShift * csum, off and xsum
// are not read, and y[r, n] = sum over pieces xscale[r, g] * ws[p, n] * (sum_k x (q + kShift)):
// one product per piece where the offset took two. The int32 sums are exact and their scaling
// is the same instructions whatever the source, so two sources of the same codes and scales
// give the same bits. Never inlined (as kquant.h's tile): inlined into kquant.cpp's panel
// loop, AVX2's Q4_K tile ran slower (docs/benchmarks.md, session 24).
template <int R, int P, int kMax, int kShift, class Src>
[[gnu::noinline]] void tile_u8a8(const int32_t* x, int64_t ldx, const float* xscale, const float* xsum, const int32_t* xcsum,
                      const Src& src, int64_t G, float* y, int64_t ldy, int64_t ncols) {
  constexpr int quads = QG / 4, pq = quads / P;  // quads per piece
  constexpr int S = std::min(pq, q4sum_steps(kMax));  // quads per Q4Sum before it widens to int32
  static_assert(quads % P == 0 && pq % S == 0, "a piece is whole quads, in whole Q4Sums");
  F32x16 out[R][2];
  init<R>(out, nullptr);
  for (int64_t g = 0; g < G; ++g) {
    for (int p = 0; p < P; ++p) {
      const int64_t piece = g * P + p, q0 = g * quads + p * pq;
      I32x16 acc[R][2];
      for (int s0 = 0; s0 < pq; s0 += S) {
        Q4Sum t[R][2];
        for (int r = 0; r < R; ++r) t[r][0] = t[r][1] = q4sum_zero();
#pragma GCC unroll 8
        for (int k = 0; k < S; ++k) {
          src.template prefetch<R>(q0 + s0 + k);
          const Q4W w = src.codes(q0 + s0 + k);
          for (int r = 0; r < R; ++r) dot_q4(t[r][0], t[r][1], dot_q4_prepare(x + r * ldx + q0 + s0 + k), w);
        }
        for (int r = 0; r < R; ++r) {
          if (s0 == 0 && kShift != 0) {
            const I32x16 start = splat_i32(kShift * xcsum[r * G * P + piece]);
            acc[r][0] = q4sum_add(start, t[r][0]), acc[r][1] = q4sum_add(start, t[r][1]);
          } else {
            for (int h = 0; h < 2; ++h) acc[r][h] = s0 == 0 ? q4sum_i32(t[r][h]) : q4sum_add(acc[r][h], t[r][h]);
          }
        }
      }
      F32x16 ws[2], off[2];
      src.scales(piece, ws, off);
      if constexpr (kShift != 0) {
        for (int r = 0; r < R; ++r) {
          const F32x16 s = set1(xscale[r * G + g]);
          out[r][0] = fma(to_f32(acc[r][0]), mul(ws[0], s), out[r][0]);
          out[r][1] = fma(to_f32(acc[r][1]), mul(ws[1], s), out[r][1]);
        }
      } else {
        for (int r = 0; r < R; ++r) {
          const F32x16 s = set1(xscale[r * G + g]), t = set1(xsum[r * G * P + piece]);
          out[r][0] = fma(to_f32(acc[r][0]), mul(ws[0], s), fma(off[0], t, out[r][0]));
          out[r][1] = fma(to_f32(acc[r][1]), mul(ws[1], s), fma(off[1], t, out[r][1]));
        }
      }
    }
  }
  store<R>(out, y, ldy, ncols);
}

// The scales part of a tile_u8a8 source whose scales were decoded once into floats: ws and off
// [G * P][32].
struct ScaleRows {
  const float *ws, *off;
  void scales(int64_t piece, F32x16 (&w)[2], F32x16 (&o)[2]) const {
    w[0] = load(ws + piece * NB), w[1] = load(ws + piece * NB + 16);
    o[0] = load(off + piece * NB), o[1] = load(off + piece * NB + 16);
  }
};

// tile_u8a8's source of a panel unpacked to bytes: codes [kq][32][4] one per byte (vec.h's
// dot_u8_load layout: per quad, columns 0-15's four codes, then 16-31's), scales as ScaleRows.
struct BytePanel : ScaleRows {
  const uint8_t* bytes;
  Q4W codes(int64_t quad) const { return dot_u8_load(bytes + quad * 4 * NB); }
  template <int R>
  void prefetch(int64_t) const {}
};

// Rows per chunk whose activations stay in L2 while every panel reads them: float32 x of K
// (512 KiB), int8 codes of kq quads (1 MiB); a multiple of the micro-tile rows (of every
// integer tile's for the codes).
inline int64_t chunk_rows_f32(int64_t K) { return std::max<int64_t>(12, (131072 / K) / 12 * 12); }
inline int64_t chunk_rows_i8(int64_t kq) {
  constexpr int64_t tiles = std::lcm(std::lcm(kGemmRowsI8, kGemmRowsQ4), std::max(kGemmRowsI8Wide, 1));
  constexpr int64_t least = (24 + tiles - 1) / tiles * tiles;
  return std::max(least, (262144 / (4 * kq)) / tiles * tiles);
}

// Rows 0..M of one panel: full tiles of MR rows, then one tile of the rest (its size
// dispatched at compile time). tile(integral_constant R, first row).
template <int MR, typename Tile>
inline void panel_rows(int64_t M, Tile tile) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) tile(std::integral_constant<int, MR>{}, m);
  const int64_t rest = M - m;
  [&]<int... I>(std::integer_sequence<int, I...>) {
    ((rest == I + 1 ? (tile(std::integral_constant<int, I + 1>{}, m), 0) : 0), ...);
  }(std::make_integer_sequence<int, MR - 1>{});
}

}  // namespace gemm

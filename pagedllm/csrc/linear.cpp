// y[M, N] = x[M, K] @ w[N, K]^T + bias, float32 activations, weights packed once at load time.
//
// Two weight formats, each in panels of 32 output columns (N padded to a multiple of 32 with
// zeros):
// - float32, [K][32] per panel (--dtype float32: exact, batch-invariant);
// - int8 with int8 activations (w8a8): weights and x both symmetric per group of QG = 32 k
//   (llama.cpp's Q8_0 x Q8_0), four products per int32 lane summed by the vector layer's int8
//   dot product (VNNI vpdpbusd, AVX2 vpmaddubsw + vpmaddwd, NEON sdot), each group's int32
//   sum scaled into a float32 accumulator. Panels [Kp/4][32][4] (K padded to QG).
// - 4-bit with int8 activations (w4a8): weights asymmetric per group of QG k, w = d q + m with
//   q in [0, 15] (GGUF Q4_1; Q4_0 is m = -8 d), x symmetric as for w8a8 (llama.cpp's Q4_1 x
//   Q8_1 dot product): y = sum_g xs (d sum(q x) + m sum(x)). Per panel and group, Q4_BYTES:
//   QG/4 quads of 64 bytes of nibbles (vec.h's dot_q4_load layout), then d and m as float16
//   [32] each: 0.625 bytes per weight, against w8a8's 1.25, for batches bound by memory.
// A micro-tile keeps R rows x 32 columns of y in registers while it walks K once (R per ISA:
// vec::kGemmRows*); every row takes the same instructions in the same order whatever M is, so
// a row's result does not depend on the rest of the batch. Threads split the panels.
#include <stdint.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <utility>
#include <vector>

#include "pagedllm_abi.h"
#include "vec.h"

using namespace vec;

namespace {

constexpr int64_t NB = PAGEDLLM_PANEL;  // output columns per panel
constexpr int64_t QG = PAGEDLLM_QUANT_GROUP;  // k per quantization group, of weights and of activations alike
constexpr int64_t Q4_NIBBLES = QG / 4 * 64;       // bytes of codes per panel and group
constexpr int64_t Q4_BYTES = Q4_NIBBLES + 4 * NB;  // + d and m, float16 per column
static_assert(Q4_BYTES == PAGEDLLM_Q4A8_GROUP_BYTES, "pagedllm_abi.h declares another w4a8 layout");

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
void tile_f32(const float* x, int64_t ldx, const float* panel, int64_t K, const float* bias, float* y, int64_t ldy,
              int64_t ncols) {
  F32x16 acc[R][2];
  init<R>(acc, bias);
  for (int64_t k = 0; k < K; ++k) {
    __builtin_prefetch(panel + (k + 8) * NB);
    __builtin_prefetch(panel + (k + 8) * NB + 16);
    const F32x16 w0 = load(panel + k * NB), w1 = load(panel + k * NB + 16);
    for (int r = 0; r < R; ++r) {
      const F32x16 a = set1(x[r * ldx + k]);
      acc[r][0] = fma(a, w0, acc[r][0]);
      acc[r][1] = fma(a, w1, acc[r][1]);
    }
  }
  store<R>(acc, y, ldy, ncols);
}

// x: R rows of kq quads of codes (store_codes; stride ldx, in int32), groups of QG/4 quads; xscale: R rows
// of G scales (stride G); panel: [kq][32][4] int8; wscale, wsum128: [G][32].
// y[r, n] = sum_g xscale[r, g] * wscale[g, n] * (sum_k x w) + bias[n].
template <int R>
void tile_w8a8(const int32_t* x, int64_t ldx, const float* xscale, const int8_t* panel, int64_t G,
               const int32_t* wsum128, const float* wscale, const float* bias, float* y, int64_t ldy, int64_t ncols) {
  constexpr int64_t quads = QG / 4;
  F32x16 out[R][2];
  init<R>(out, bias);
  for (int64_t g = 0; g < G; ++g) {
    I32x16 acc[R][2];
    const I32x16 init0 = dot_init(wsum128 + g * NB), init1 = dot_init(wsum128 + g * NB + 16);
    for (int r = 0; r < R; ++r) acc[r][0] = init0, acc[r][1] = init1;
    const int8_t* pg = panel + g * quads * 4 * NB;
    __builtin_prefetch(pg + 4 * quads * 4 * NB);
    for (int64_t k = 0; k < quads; ++k) {
      const int8_t* w = pg + k * 4 * NB;
      __builtin_prefetch(pg + (k + 4 * quads) * 4 * NB + 2 * NB);
      for (int r = 0; r < R; ++r) {
        const DotX a = dot_prepare(x + r * ldx + g * quads + k);
        acc[r][0] = dot(acc[r][0], a, w);
        acc[r][1] = dot(acc[r][1], a, w + 2 * NB);
      }
    }
    const F32x16 d0 = load(wscale + g * NB), d1 = load(wscale + g * NB + 16);
    for (int r = 0; r < R; ++r) {
      const F32x16 s = set1(xscale[r * G + g]);
      out[r][0] = fma(to_f32(acc[r][0]), mul(d0, s), out[r][0]);
      out[r][1] = fma(to_f32(acc[r][1]), mul(d1, s), out[r][1]);
    }
  }
  store<R>(out, y, ldy, ncols);
}

// x: R rows of kq quads of s8 codes (stride ldx, in int32), groups of QG/4 quads; xscale, xsum:
// R rows of G (stride G), xsum = xscale * the group's code sum; panel: G groups of Q4_BYTES.
// y[r, n] = sum_g xscale[r, g] * d[g, n] * (sum_k x q) + xsum[r, g] * m[g, n] + bias[n].
template <int R>
void tile_q4a8(const int32_t* x, int64_t ldx, const float* xscale, const float* xsum, const uint8_t* panel, int64_t G,
               const float* bias, float* y, int64_t ldy, int64_t ncols) {
  constexpr int64_t quads = QG / 4;
  F32x16 out[R][2];
  init<R>(out, bias);
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* pg = panel + g * Q4_BYTES;
    __builtin_prefetch(pg + 4 * Q4_BYTES);
    I32x16 acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = zero_i32();
    for (int64_t k = 0; k < quads; ++k) {
      if (k % 2 == 0) __builtin_prefetch(pg + 4 * Q4_BYTES + 64 * (k / 2 + 1));
      const Q4W w = dot_q4_load(pg + k * 64);
      for (int r = 0; r < R; ++r) dot_q4(acc[r][0], acc[r][1], dot_q4_prepare(x + r * ldx + g * quads + k), w);
    }
    const uint16_t* dm = reinterpret_cast<const uint16_t*>(pg + Q4_NIBBLES);
    const F32x16 d0 = load_f16(dm), d1 = load_f16(dm + 16), m0 = load_f16(dm + NB), m1 = load_f16(dm + NB + 16);
    for (int r = 0; r < R; ++r) {
      const F32x16 s = set1(xscale[r * G + g]), t = set1(xsum[r * G + g]);
      out[r][0] = fma(to_f32(acc[r][0]), mul(d0, s), fma(m0, t, out[r][0]));
      out[r][1] = fma(to_f32(acc[r][1]), mul(d1, s), fma(m1, t, out[r][1]));
    }
  }
  store<R>(out, y, ldy, ncols);
}

static_assert(QG == 32, "vec.h's quantize_group quantizes activations in groups of 32");

// The M rows of x (stride ldx) quantized per group of QG k for the integer GEMMs: codes
// [M][kq] (four int8 per int32; Kp = kq * 4 = K rounded up to QG) and scale [M][G]; with
// kSums (w4a8, llama.cpp's Q8_1) also sum [M][G] = scale * the group's code sum and the codes
// as plain s8, else (w8a8, Q8_0) in the encoding the vector layer's dot product takes.
struct QuantizedRows {
  std::vector<int32_t> codes;
  std::vector<float> scale, sum;
};
template <bool kSums>
QuantizedRows quantize_rows(const float* x, int64_t ldx, int64_t M, int64_t K) {
  const int64_t G = (K + QG - 1) / QG, kq = G * QG / 4;
  QuantizedRows q{std::vector<int32_t>(static_cast<size_t>(M * kq)), std::vector<float>(static_cast<size_t>(M * G)),
                  std::vector<float>(kSums ? static_cast<size_t>(M * G) : 0)};
#pragma omp parallel for schedule(static) if (M > 16)
  for (int64_t m = 0; m < M; ++m) {
    const float* src = x + m * ldx;
    int8_t* row = reinterpret_cast<int8_t*>(q.codes.data() + m * kq);
    for (int64_t g = 0; g < G; ++g) {
      const GroupCodes c = quantize_group(src, K, g * QG);
      q.scale[m * G + g] = c.scale;
      if constexpr (kSums) {
        store_i8(row + g * QG, c.lo);
        store_i8(row + g * QG + 16, c.hi);
        q.sum[m * G + g] = c.scale * reduce_add(add(to_f32(c.lo), to_f32(c.hi)));  // an exact integer sum
      } else {
        store_codes(row + g * QG, c.lo);
        store_codes(row + g * QG + 16, c.hi);
      }
    }
  }
  return q;
}

// Rows m..M of one panel: full tiles of MR rows, then one tile of the rest (its size
// dispatched at compile time).
template <int MR, typename Tile>
void panel_rows(int64_t M, Tile tile) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) tile(std::integral_constant<int, MR>{}, m);
  const int64_t rest = M - m;
  [&]<int... I>(std::integer_sequence<int, I...>) {
    ((rest == I + 1 ? (tile(std::integral_constant<int, I + 1>{}, m), 0) : 0), ...);
  }(std::make_integer_sequence<int, MR - 1>{});
}

// f(p, ncols, bias of the panel or null) for every 32-column panel p (ncols of them real),
// the panels split over the threads.
template <typename F>
void for_panels(int64_t N, const float* bias, F f) {
  const int64_t panels = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) f(p, N - p * NB < NB ? N - p * NB : NB, bias ? bias + p * NB : nullptr);
}

}  // namespace

extern "C" {

// w: [N, K] float32 -> float32 panels [ceil(N/32)][K][32], zero padded.
void linear_pack_f32(const float* w, float* packed, int64_t N, int64_t K) {
  const int64_t panels = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t k = 0; k < K; ++k)
      for (int64_t c = 0; c < NB; ++c) packed[(p * K + k) * NB + c] = p * NB + c < N ? w[(p * NB + c) * K + k] : 0.f;
}

// w: [N, K] float32 -> int8 panels [ceil(N/32)][Kp/4][32][4] (Kp = K rounded up to QG), and
// per panel and group of QG k: wscale [panels][Kp/QG][32] = max|w| / 127 and
// wsum128 = -128 * sum of the codes (int32; where the int8 dot product feeds x as x + 128, its
// accumulator starts there), all zero padded.
void linear_pack_w8a8(const float* w, int8_t* packed, float* wscale, int32_t* wsum128, int64_t N, int64_t K) {
  const int64_t G = (K + QG - 1) / QG, kq = G * QG / 4, panels = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t c = 0; c < NB; ++c) {
      const int64_t n = p * NB + c;
      for (int64_t g = 0; g < G; ++g) {
        float amax = 0.f;
        for (int64_t k = g * QG; k < std::min(K, (g + 1) * QG) && n < N; ++k) amax = std::max(amax, std::abs(w[n * K + k]));
        const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        int32_t sum = 0;
        for (int64_t k = g * QG; k < (g + 1) * QG; ++k) {
          const int8_t q = (n < N && k < K) ? static_cast<int8_t>(std::nearbyint(w[n * K + k] * inv)) : 0;
          packed[((p * kq + k / 4) * NB + c) * 4 + k % 4] = q;
          sum += q;
        }
        wscale[(p * G + g) * NB + c] = scale;
        wsum128[(p * G + g) * NB + c] = -128 * sum;
      }
    }
}

// x: [M, K] float32 with row stride ldx; y: [M, N] float32; packed, wscale, wsum128 from
// linear_pack_w8a8; bias: null or float32 padded to ceil(N/32)*32. Each row of x is
// quantized on the fly, symmetric per group of QG k (scale = max|x| / 127, codes rounded to
// nearest even), as llama.cpp's Q8_0 x Q8_0 dot product does.
void linear_w8a8(const float* x, int64_t ldx, const int8_t* packed, const float* wscale, const int32_t* wsum128,
                 const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t G = (K + QG - 1) / QG, kq = G * QG / 4;
  const QuantizedRows xq = quantize_rows<false>(x, ldx, M, K);
  // Rows in chunks whose codes fit in L2, each chunk over all panels (as linear_f32).
  const int64_t chunk = std::max<int64_t>(24, (262144 / (4 * kq)) / 24 * 24);
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t rows = std::min(chunk, M - m0);
    for_panels(N, bias, [&](int64_t p, int64_t ncols, const float* b) {
      panel_rows<kGemmRowsI8>(rows, [&](auto r, int64_t m) {
        tile_w8a8<decltype(r)::value>(xq.codes.data() + (m0 + m) * kq, kq, xq.scale.data() + (m0 + m) * G,
                                      packed + p * kq * 4 * NB, G, wsum128 + p * G * NB, wscale + p * G * NB, b,
                                      y + (m0 + m) * N + p * NB, N, ncols);
      });
    });
  }
}

// q: [N, K] codes in [0, 15] (one per byte); d, m: [N, ceil(K/QG)] float16 bits (w = d q + m)
// -> packed [ceil(N/32)][ceil(K/QG)][Q4_BYTES], codes, d and m zero padded (a padded k has
// code 0 and its x code is 0 too, so m counts only real k).
void linear_pack_q4a8(const uint8_t* q, const uint16_t* d, const uint16_t* m, uint8_t* packed, int64_t N, int64_t K) {
  const int64_t G = (K + QG - 1) / QG, panels = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t g = 0; g < G; ++g) {
      uint8_t* pg = packed + (p * G + g) * Q4_BYTES;
      uint16_t* dm = reinterpret_cast<uint16_t*>(pg + Q4_NIBBLES);
      for (int64_t c = 0; c < NB; ++c) {
        const int64_t n = p * NB + c;
        dm[c] = n < N ? d[n * G + g] : 0;
        dm[NB + c] = n < N ? m[n * G + g] : 0;
      }
      for (int64_t i = 0; i < Q4_NIBBLES; ++i) {  // quad i / 64, byte i % 64 (vec.h's dot_q4_load layout)
        const int64_t k = g * QG + i / 64 * 4 + i % 4, c = i % 64 / 4;
        auto code = [&](int64_t n) { return n < N && k < K ? uint8_t(q[n * K + k] & 0x0F) : uint8_t(0); };
        pg[i] = uint8_t(code(p * NB + c) | code(p * NB + 16 + c) << 4);
      }
    }
}

// x: [M, K] float32 with row stride ldx; y: [M, N] float32; packed from linear_pack_q4a8;
// bias: null or float32 padded to ceil(N/32)*32. Each row of x is quantized on the fly as
// for linear_w8a8, with each group's code sum (llama.cpp's Q8_1 activations).
void linear_q4a8(const float* x, int64_t ldx, const uint8_t* packed, const float* bias, float* y, int64_t M, int64_t N,
                 int64_t K) {
  const int64_t G = (K + QG - 1) / QG, kq = G * QG / 4;
  const QuantizedRows xq = quantize_rows<true>(x, ldx, M, K);
  const int64_t chunk = std::max<int64_t>(24, (262144 / (4 * kq)) / 24 * 24);  // as linear_w8a8
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t rows = std::min(chunk, M - m0);
    for_panels(N, bias, [&](int64_t p, int64_t ncols, const float* b) {
      panel_rows<kGemmRowsQ4>(rows, [&](auto r, int64_t m) {
        tile_q4a8<decltype(r)::value>(xq.codes.data() + (m0 + m) * kq, kq, xq.scale.data() + (m0 + m) * G,
                                      xq.sum.data() + (m0 + m) * G, packed + p * G * Q4_BYTES, G, b,
                                      y + (m0 + m) * N + p * NB, N, ncols);
      });
    });
  }
}

// x: [M, K] float32 with row stride ldx; y: [M, N] float32; bias: null or float32 padded to
// ceil(N/32)*32.
void linear_f32(const float* x, int64_t ldx, const float* packed, const float* bias, float* y, int64_t M, int64_t N,
                int64_t K) {
  // Rows in chunks whose x fits in L2 (512 KiB), each chunk over all panels: x is read from
  // L2 by every panel instead of from L3/DRAM (prefill's gain: docs/benchmarks.md).
  const int64_t chunk = std::max<int64_t>(12, (131072 / K) / 12 * 12);
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t rows = std::min(chunk, M - m0);
    for_panels(N, bias, [&](int64_t p, int64_t ncols, const float* b) {
      panel_rows<kGemmRowsF32>(rows, [&](auto r, int64_t m) {
        tile_f32<decltype(r)::value>(x + (m0 + m) * ldx, ldx, packed + p * K * NB, K, b, y + (m0 + m) * N + p * NB,
                                     N, ncols);
      });
    });
  }
}

}  // extern "C"

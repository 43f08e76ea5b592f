// y[M, N] = x[M, K] @ w[N, K]^T + bias, float32 activations, weights packed once at load time.
//
// The weight formats, each in panels of 32 output columns (N padded to a multiple of 32 with
// zeros):
// - float32, [K][32] per panel (--dtype float32: exact, batch-invariant);
// - int8 with int8 activations (w8a8): weights symmetric per output column (one scale per row
//   of w), x symmetric per group of QG = 32 k, four products per int32 lane summed by the
//   vector layer's int8 dot product (VNNI vpdpbusd, AVX2 vpmaddubsw + vpmaddwd, NEON sdot),
//   each group's int32 sum times x's group scale added into a float32 accumulator, which the
//   column's scale multiplies once at the end. Panels [Kp/4][32][4] (K padded to QG) of codes
//   in the byte encoding that dot product takes (gemm.h's stored_code).
// - 4-bit with int8 activations (w4a8): weights asymmetric per group of QG k, w = d q + m with
//   q in [0, 15] (GGUF Q4_1; Q4_0 is m = -8 d), x symmetric as for w8a8 (llama.cpp's Q4_1 x
//   Q8_1 dot product): y = sum_g xs (d sum(q x) + m sum(x)). Per panel and group, Q4_BYTES:
//   QG/4 quads of 64 bytes of nibbles (vec.h's dot_q4_load layout), then d and m as float16
//   [32] each: 0.625 bytes per weight, against w8a8's 1.0, for batches bound by memory. A
//   symmetric weight (every m = -8 d: GGUF Q4_0's blocks) keeps no m (Q4S_BYTES, 0.5625 bytes
//   per weight, the file's own) and runs tile_q4a8's kSymmetric.
// - GGUF Q8_0 with int8 activations (q8a8): w = d q per group of QG k of a row (d float16, as
//   the file stores it), llama.cpp's Q8_0 x Q8_0 product: y = sum_g xs d sum(q x). w8a8's
//   panels of codes, and per panel [G][32] float16 d: the file's 1.0625 bytes per weight, the
//   per-group scaling amortized over a group's 8 dot products of a 32-column tile (the
//   K-quant GEMM's Q8_0 rows take it per 64 products and activation row).
// A micro-tile (gemm.h, shared with moe.cpp) keeps R rows x 32 columns of y in registers while
// it walks K once (R per ISA: vec::kGemmRows*); every row takes the same instructions in the
// same order whatever M is, so a row's result does not depend on the rest of the batch. On AVX2
// (and the scalar reference) w8a8 from kWideRows rows runs another tile on int16 codes
// (tile_w8a8_wide): its int32 sums are exact too and scaled in the same order, so a row's
// result is still the same bit for bit.
// Threads split the panels.
#include <stdint.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>

#include "amx.h"
#include "gemm.h"
#include "pagedllm_abi.h"
#include "parallel.h"

using namespace gemm;

namespace {

// f(p, ncols, bias of the panel or null) for every 32-column panel p (ncols of them real),
// the panels split over the threads.
template <typename F>
void for_panels(int64_t N, const float* bias, F f) {
  const int64_t panels = (N + NB - 1) / NB;
  par::parallel_for(panels, [&](int64_t p) { f(p, N - p * NB < NB ? N - p * NB : NB, bias ? bias + p * NB : nullptr); });
}

// Panels a tile of rows runs over before the next tile of rows, from kPanelBlockRows rows: its
// rows of y are then written in runs of up to 8 x 128 bytes, not 128 bytes at rows 4 N bytes
// apart, each line of y fetched for ownership on its own (in a harness, those stores cost a
// w4a8 tile loop over 1024 rows 13-17% of its time: docs/benchmarks.md, session 47). The
// block's weights (160-440 KiB of w4a8 or q8a8 for SmolLM2's layers) stay in L2 for the
// chunk's later tiles; a decode step's few rows keep reading one panel from L1.
constexpr int64_t kPanelBlock = 8, kPanelBlockRows = 128;

// tile(R, m, p, ncols, bias of the panel or null, next) for rows [0, rows) in micro-tiles of
// MR rows (panel_rows) and every 32-column panel p (ncols of them real): the panels split over
// the threads in ranges, each range in blocks (kPanelBlock), each block's tiles of rows in
// order, each tile over the block's panels. The tiles' arithmetic does not depend on the order.
// next: a panel for the tile to ask for into L2 as it goes (its `ahead`), or -1. With one
// panel at a time (a decode step's rows), the panel's second tile asks for the range's next
// panel: the first tile of a panel streams it from memory and the others reread it from L1,
// so without this each panel's first tile waited on memory while nothing was in flight during
// the others (in a harness over 30 layers, batch 8-16 w4a8 GEMMs 1.10x, the Q8_0 lm_head
// 1.17-1.45x; docs/benchmarks.md, session 49). A lone tile of 2 to MR rows asks for it too
// (the lm_head at 2-5 rows 1.7-1.9x, session 52); a single row streams alone (asking, its
// GEMV ran slower: session 49).
template <int MR, typename Tile>
void for_panel_tiles(int64_t N, int64_t rows, const float* bias, Tile tile) {
  const int64_t panels = (N + NB - 1) / NB, block = rows >= kPanelBlockRows ? kPanelBlock : 1;
  par::parallel_chunks(panels, [&](int64_t begin, int64_t end) {
    for (int64_t p0 = begin; p0 < end; p0 += block) {
      const int64_t p1 = std::min(end, p0 + block);
      panel_rows<MR>(rows, [&](auto r, int64_t m) {
        const int64_t next = block == 1 && (m == MR || (rows > 1 && rows <= MR)) && p0 + 1 < end ? p0 + 1 : -1;
        for (int64_t p = p0; p < p1; ++p)
          tile(r, m, p, std::min(NB, N - p * NB), bias ? bias + p * NB : nullptr, next);
      });
    }
  });
}

// From this many rows linear_w8a8 widens each weight panel to int16 once per chunk of rows
// and runs tile_w8a8_wide (ISAs with kGemmRowsI8Wide > 0); below, widening the panels costs
// more than the faster tile saves (docs/benchmarks.md, "Int8 prefill GEMMs").
constexpr int64_t kWideRows = 32;

// Below this max|w| a w8a8 row is all zero codes (127 / amax would overflow float32 near 3.7e-37).
constexpr float kTinyRowMax = 1e-30f;

// linear_w8a8 on int16 codes: x quantized as there, stored as int16; per chunk of rows and
// panel, the panel widened once (widen_panel) for all the chunk's tiles of MR rows (a template
// so that ISAs without the int16 tile never instantiate it).
template <int MR>
void linear_w8a8_wide(const float* x, int64_t ldx, const int8_t* packed, const float* wscale, const float* bias,
                      float* y, int64_t M, int64_t N, int64_t K) {
  const int64_t G = (K + QG - 1) / QG, kq = G * QG / 4;
  const QuantizedRows xq = quantize_rows<false, false, true>(x, ldx, M, K);
  const int64_t chunk = chunk_rows_i8(2 * kq);  // codes twice as wide
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t rows = std::min(chunk, M - m0);
    for_panels(N, bias, [&](int64_t p, int64_t ncols, const float* b) {
      const std::unique_ptr<int16_t[]> wide(new int16_t[kq * 4 * NB]);
      widen_panel(packed + p * kq * 4 * NB, kq, wide.get());
      panel_rows<MR>(rows, [&](auto r, int64_t m) {
        tile_w8a8_wide<decltype(r)::value>(xq.codes.data() + (m0 + m) * 2 * kq, 2 * kq, xq.scale.data() + (m0 + m) * G,
                                           wide.get(), G, wscale + p * NB, b, y + (m0 + m) * N + p * NB, N, ncols);
      });
    });
  }
}

}  // namespace

extern "C" {

// w: [N, K] float32 -> float32 panels [ceil(N/32)][K][32], zero padded.
void linear_pack_f32(const float* w, float* packed, int64_t N, int64_t K) {
  const int64_t panels = (N + NB - 1) / NB;
  par::parallel_for(panels, [&](int64_t p) {
    for (int64_t k = 0; k < K; ++k)
      for (int64_t c = 0; c < NB; ++c) packed[(p * K + k) * NB + c] = p * NB + c < N ? w[(p * NB + c) * K + k] : 0.f;
  });
}

// w: [N, K] float32 -> int8 panels [ceil(N/32)][Kp/4][32][4] (Kp = K rounded up to QG), codes
// round(w * 127 / amax) with amax a row's max|w|, or rowmax[n] where given (a tensor-parallel
// rank's slice of longer rows: the whole rows' maxima, so every rank's codes are the unsharded
// ones; >= the slice's own), each as gemm.h's stored_code encodes it for this ISA's dot
// product; per column wscale [panels][32] = amax / 127; padded with zero codes and scales. A
// row whose amax is under kTinyRowMax gets zero codes. w and rowmax finite (the caller's check).
void linear_pack_w8a8(const float* w, const float* rowmax, int8_t* packed, float* wscale, int64_t N, int64_t K) {
  const int64_t kq = (K + QG - 1) / QG * QG / 4, panels = (N + NB - 1) / NB;
  par::parallel_for(panels, [&](int64_t p) {
    for (int64_t c = 0; c < NB; ++c) {
      const int64_t n = p * NB + c;
      float amax = rowmax && n < N ? rowmax[n] : 0.f;
      for (int64_t k = 0; k < K && n < N && !rowmax; ++k) amax = std::max(amax, std::abs(w[n * K + k]));
      const float inv = amax > kTinyRowMax ? 127.f / amax : 0.f;  // 127 / amax finite
      wscale[p * NB + c] = amax / 127.f;
      for (int64_t k = 0; k < kq * 4; ++k) {
        const int8_t q = (n < N && k < K) ? static_cast<int8_t>(std::nearbyint(w[n * K + k] * inv)) : 0;
        packed[((p * kq + k / 4) * NB + c) * 4 + k % 4] = stored_code(q);
      }
    }
  });
}

// x: [M, K] float32 with row stride ldx; y: [M, N] float32; packed, wscale from
// linear_pack_w8a8; bias: null or float32 padded to ceil(N/32)*32. Each row of x is
// quantized on the fly, symmetric per group of QG k (scale = max|x| / 127, codes rounded to
// nearest even), as llama.cpp's Q8_0 activations are; rows from prompt_from on go to the AMX
// tiles instead where they run (pagedllm_abi.h).
void linear_w8a8(const float* x, int64_t ldx, const int8_t* packed, const float* wscale, const float* bias, float* y,
                 int64_t M, int64_t N, int64_t K, int64_t prompt_from) {
  M = amx::prompt_rows(x, ldx, y, N, M, prompt_from, [&](const float* xp, float* yp, int64_t rows) {
    amx::linear_w8a8(xp, ldx, packed, wscale, bias, yp, rows, N, K);
  });
  if (M == 0) return;
  const int64_t G = (K + QG - 1) / QG, kq = G * QG / 4;
  if constexpr (kGemmRowsI8Wide > 0) {
    if (M >= kWideRows) return linear_w8a8_wide<kGemmRowsI8Wide>(x, ldx, packed, wscale, bias, y, M, N, K);
  }
  const QuantizedRows xq = quantize_rows<false>(x, ldx, M, K);
  // Rows in chunks whose codes fit in L2, each chunk over all panels (as linear_f32).
  const int64_t chunk = chunk_rows_i8(kq);
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t rows = std::min(chunk, M - m0);
    for_panel_tiles<kGemmRowsI8>(N, rows, bias, [&](auto r, int64_t m, int64_t p, int64_t ncols, const float* b,
                                                    int64_t next) {
      tile_w8a8<decltype(r)::value, true>(xq.codes.data() + (m0 + m) * kq, kq, xq.scale.data() + (m0 + m) * G,
                                          packed + p * kq * 4 * NB, G, xq.xsum128.data() + (m0 + m) * G,
                                          wscale + p * NB, b, y + (m0 + m) * N + p * NB, N, ncols,
                                          next < 0 ? nullptr : packed + next * kq * 4 * NB);
    });
  }
}

// blocks: [N][K / QG] GGUF Q8_0 blocks (34 bytes: float16 d, 32 int8 codes), K a multiple of
// QG -> packed [ceil(N/32)][K/4][32][4] (linear_pack_w8a8's layout and byte encoding) and d
// [ceil(N/32)][K / QG][32] float16 bits, zero padded. Returns -1 (nothing written) where a code
// is -128 and this ISA's dot product takes no x sums (kDotXSums false: its sign trick cannot
// negate -128; llama.cpp's and gguf's quantizers write codes in [-127, 127]), else 0.
int linear_pack_q8_0(const uint8_t* blocks, int8_t* packed, uint16_t* d, int64_t N, int64_t K) {
  constexpr int64_t kBlock = 2 + QG;
  const int64_t G = K / QG, kq = K / 4, panels = (N + NB - 1) / NB;
  if (K % QG) return -1;
  if (!kDotXSums) {
    for (int64_t n = 0; n < N; ++n)
      for (int64_t g = 0; g < G; ++g)
        if (std::memchr(blocks + (n * G + g) * kBlock + 2, 0x80, QG)) return -1;
  }
  par::parallel_for(panels, [&](int64_t p) {
    for (int64_t c = 0; c < NB; ++c) {
      const int64_t n = p * NB + c;
      for (int64_t g = 0; g < G; ++g) {
        const uint8_t* b = n < N ? blocks + (n * G + g) * kBlock : nullptr;
        uint16_t dg = 0;
        if (b) std::memcpy(&dg, b, 2);
        d[(p * G + g) * NB + c] = dg;
        for (int64_t k = g * QG; k < (g + 1) * QG; ++k) {
          const int8_t q = b ? static_cast<int8_t>(b[2 + k - g * QG]) : 0;
          packed[((p * kq + k / 4) * NB + c) * 4 + k % 4] = stored_code(q);
        }
      }
    }
  });
  return 0;
}

// x: [M, K] float32 with row stride ldx; y: [M, N] float32; packed, d from linear_pack_q8_0;
// bias: null or float32 padded to ceil(N/32)*32. Each row of x is quantized on the fly as for
// linear_w8a8 (the same tile, each group's sums scaled by its column's d and x's scale); rows
// from prompt_from on go to the AMX tiles instead where they run (pagedllm_abi.h).
void linear_q8a8(const float* x, int64_t ldx, const int8_t* packed, const uint16_t* d, const float* bias, float* y,
                 int64_t M, int64_t N, int64_t K, int64_t prompt_from) {
  M = amx::prompt_rows(x, ldx, y, N, M, prompt_from, [&](const float* xp, float* yp, int64_t rows) {
    amx::linear_q8a8(xp, ldx, packed, d, bias, yp, rows, N, K);
  });
  if (M == 0) return;
  const int64_t G = K / QG, kq = K / 4;
  const QuantizedRows xq = quantize_rows<false>(x, ldx, M, K);
  const int64_t chunk = chunk_rows_i8(kq);  // as linear_w8a8
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t rows = std::min(chunk, M - m0);
    for_panel_tiles<kGemmRowsI8>(N, rows, bias, [&](auto r, int64_t m, int64_t p, int64_t ncols, const float* b,
                                                    int64_t next) {
      tile_w8a8<decltype(r)::value, false>(xq.codes.data() + (m0 + m) * kq, kq, xq.scale.data() + (m0 + m) * G,
                                           packed + p * kq * 4 * NB, G, xq.xsum128.data() + (m0 + m) * G,
                                           d + p * G * NB, b, y + (m0 + m) * N + p * NB, N, ncols,
                                           next < 0 ? nullptr : packed + next * kq * 4 * NB,
                                           next < 0 ? nullptr : d + next * G * NB);
    });
  }
}

// q: [N, K] codes in [0, 15] (one per byte); d, m: [N, ceil(K/QG)] float16 bits (w = d q + m),
// m null for a symmetric weight (every m = -8 d) -> packed [ceil(N/32)][ceil(K/QG)][Q4_BYTES]
// (Q4S_BYTES where symmetric: no m), codes, d and m zero padded (a padded k has code 0 and its
// x code is 0 too, so m, or -8, counts only real k).
void linear_pack_q4a8(const uint8_t* q, const uint16_t* d, const uint16_t* m, uint8_t* packed, int64_t N, int64_t K) {
  const int64_t G = (K + QG - 1) / QG, panels = (N + NB - 1) / NB, GB = q4_group_bytes(m == nullptr);
  par::parallel_for(panels, [&](int64_t p) {
    for (int64_t g = 0; g < G; ++g) {
      uint8_t* pg = packed + (p * G + g) * GB;
      uint16_t* dm = reinterpret_cast<uint16_t*>(pg + Q4_NIBBLES);
      for (int64_t c = 0; c < NB; ++c) {
        const int64_t n = p * NB + c;
        dm[c] = n < N ? d[n * G + g] : 0;
        if (m) dm[NB + c] = n < N ? m[n * G + g] : 0;
      }
      for (int64_t i = 0; i < Q4_NIBBLES; ++i) {  // quad i / 64, byte i % 64 (vec.h's dot_q4_load layout)
        const int64_t k = g * QG + i / 64 * 4 + i % 4, c = i % 64 / 4;
        auto code = [&](int64_t n) { return n < N && k < K ? uint8_t(q[n * K + k] & 0x0F) : uint8_t(0); };
        pg[i] = uint8_t(code(p * NB + c) | code(p * NB + 16 + c) << 4);
      }
    }
  });
}

// x: [M, K] float32 with row stride ldx; y: [M, N] float32; packed from linear_pack_q4a8;
// bias: null or float32 padded to ceil(N/32)*32; symmetric: nonzero for panels packed with m
// null (tile_q4a8's kSymmetric). Each row of x is quantized on the fly as for linear_w8a8, with each
// group's code sum (llama.cpp's Q8_1 activations); rows from prompt_from on go to the AMX tiles
// instead where they run (pagedllm_abi.h).
void linear_q4a8(const float* x, int64_t ldx, const uint8_t* packed, const float* bias, float* y, int64_t M, int64_t N,
                 int64_t K, int64_t symmetric, int64_t prompt_from) {
  M = amx::prompt_rows(x, ldx, y, N, M, prompt_from, [&](const float* xp, float* yp, int64_t rows) {
    amx::linear_q4a8(xp, ldx, packed, bias, yp, rows, N, K, symmetric != 0);
  });
  if (M == 0) return;
  const int64_t G = (K + QG - 1) / QG, kq = G * QG / 4;
  const QuantizedRows xq = quantize_rows<true>(x, ldx, M, K);
  const int64_t chunk = chunk_rows_i8(kq);  // as linear_w8a8
  with_flag(symmetric != 0, [&]<bool kSymmetric>() {
    for (int64_t m0 = 0; m0 < M; m0 += chunk) {
      const int64_t rows = std::min(chunk, M - m0);
      for_panel_tiles<kGemmRowsQ4>(N, rows, bias, [&](auto r, int64_t m, int64_t p, int64_t ncols, const float* b,
                                                      int64_t next) {
        const int64_t at = (m0 + m) * G, panel = G * q4_group_bytes(kSymmetric);
        tile_q4a8<decltype(r)::value, kSymmetric>(xq.codes.data() + (m0 + m) * kq, kq, xq.scale.data() + at,
                                                  xq.sum.data() + at, xq.csum.data() + at, packed + p * panel, G, b,
                                                  y + (m0 + m) * N + p * NB, N, ncols,
                                                  next < 0 ? nullptr : packed + next * panel);
      });
    }
  });
}

// x: [M, K] float32 with row stride ldx; y: [M, N] float32; bias: null or float32 padded to
// ceil(N/32)*32.
void linear_f32(const float* x, int64_t ldx, const float* packed, const float* bias, float* y, int64_t M, int64_t N,
                int64_t K) {
  // Rows in chunks whose x fits in L2 (512 KiB), each chunk over all panels: x is read from
  // L2 by every panel instead of from L3/DRAM (prefill's gain: docs/benchmarks.md).
  const int64_t chunk = chunk_rows_f32(K);
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t rows = std::min(chunk, M - m0);
    for_panel_tiles<kGemmRowsF32>(N, rows, bias, [&](auto r, int64_t m, int64_t p, int64_t ncols, const float* b,
                                                     int64_t) {
      tile_f32<decltype(r)::value>(x + (m0 + m) * ldx, ldx, packed + p * K * NB, K, b, y + (m0 + m) * N + p * NB, N,
                                   ncols);
    });
  }
}

}  // extern "C"

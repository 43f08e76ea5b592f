// The K-quant GEMM of one layer and the blocks' dequantization (formats and arithmetic:
// kquant.h). A weight repacked into panels (kquant_panels.h: what the layers run) takes one
// tile for every M, as the prefill panels below compute it. Blocks as stored (a weight with
// Q8_0 codes of -128 off VNNI, which panels cannot hold) take one of two ways, by M:
// - decode (M < PREFILL_ROWS): threads split the output rows (16-row spans, over the parts of
//   a fused weight). Each row's decoded chunk is used by kGemmRowsKQ activation rows at once;
//   x's codes are read in chunks of rows that fit in L2, so a batch-1 step reads each weight
//   byte once and a prefill reads it once per chunk of rows.
// - prefill: threads split 32-row panels; each panel's codes are unpacked once per chunk of x
//   rows into bytes in the packed GEMMs' panel layout (kquant.h's decode_panel), its scales
//   into floats, and gemm.h's micro-tiles run over it: tile_w8a8 for Q8_0 (the same arithmetic
//   as the decode path, Q8_0 x Q8_0), tile_u8a8 for the unsigned codes (Q4_K, Q5_K, Q6_K, Q5_0:
//   per piece of 32 or 16 weights, the int32 sum of q x scaled by ws and x's scale, plus off
//   times x's scaled code sum: the decode path's sums, grouped by piece instead of by chunk;
//   Q6_K's and Q5_0's offsets, a multiple of ws, added to the int32 sums instead).
#include <stdint.h>

#include <algorithm>
#include <cstring>
#include <vector>

#include "aligned.h"
#include "amx.h"
#include "gemm.h"
#include "kquant.h"
#include "kquant_panels.h"
#include "pagedllm_abi.h"
#include "parallel.h"

using namespace kquant;

namespace {

// Rows of x from which the panel GEMM is the faster way (docs/benchmarks.md, int8 GEMMs).
constexpr int64_t PREFILL_ROWS = 8;

int prefill(const float* x, int64_t ldx, const KQuantWeight& w, const float* bias, float* y, int64_t M, int64_t N,
            int64_t K) {
  using namespace gemm;
  static_assert(PANEL == NB, "a decoded panel is a packed GEMM panel");
  const int64_t G = K / QG, kq = K / 4;
  const PanelActs acts(x, ldx, M, K, {&w});
  const QuantizedRows &xs = acts.xs, &xu = acts.xu;
  const std::vector<Span> panels = spans_of(w, PANEL);
  const int64_t chunk = panel_chunk_rows(M, kq);  // each panel's unpacking spread over >= 240 rows
  const int64_t num_panels = static_cast<int64_t>(panels.size());
  // Panels with a Q8_0 code of -128, which the sign trick of the w8a8 dot product (AVX2,
  // AVX-512 without VNNI) cannot negate, where the codes are s8 (not kDotXSums): the decode
  // path's arithmetic takes them (never met in files quantized to +-127, as llama.cpp's and
  // gguf's quantizers write them).
  std::vector<char> to_decode_path(static_cast<size_t>(num_panels), 0);
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t rows = std::min(chunk, M - m0);
    par::parallel_for(num_panels, [&](int64_t i) {
      if (to_decode_path[i]) return;
      const Span& sp = panels[i];
      const KQuantPart& part = w.parts[sp.part];
      const int64_t ncols = sp.n1 - sp.n0;
      thread_local aligned::vector<uint8_t> codes;
      thread_local aligned::vector<float> ws, off;
      codes.resize(static_cast<size_t>(K * PANEL));
      ws.resize(static_cast<size_t>(2 * G * PANEL)), off.resize(ws.size());
      float* out = y + m0 * N + sp.col;
      with_format(part.type, [&](auto f) {
        using F = decltype(f);
        const int64_t rb = K / F::kElems * F::kBytes;
        decode_panel<F>(static_cast<const uint8_t*>(part.blocks) + sp.n0 * rb, rb, ncols, K, codes.data(), ws.data(),
                        off.data());
        if constexpr (F::kSigned) {
          if constexpr (kDotXSums) {
            for (uint8_t& c : codes) c ^= 0x80;  // as tile_w8a8 reads them (gemm.h's stored_code)
          } else if (std::memchr(codes.data(), 0x80, codes.size())) {
            to_decode_path[i] = 1;
            return;
          }
          panel_rows<kGemmRowsI8>(rows, [&](auto r, int64_t m) {
            tile_w8a8<decltype(r)::value, false>(xs.codes.data() + (m0 + m) * kq, kq, xs.scale.data() + (m0 + m) * G,
                                                 reinterpret_cast<const int8_t*>(codes.data()), G,
                                                 xs.xsum128.data() + (m0 + m) * G, ws.data(), nullptr, out + m * N, N,
                                                 ncols);
          });
        } else {
          const std::vector<float>& sums = F::kPieces == 2 ? xu.sum16 : xu.sum;
          const std::vector<int32_t>& csums = F::kPieces == 2 ? xu.csum16 : xu.csum;
          panel_rows<kGemmRowsQ4>(rows, [&](auto r, int64_t m) {
            const int64_t row = (m0 + m) * G * F::kPieces;
            tile_u8a8<decltype(r)::value, F::kPieces, F::kCodeMax, F::kCodeShift>(
                xu.codes.data() + (m0 + m) * kq, kq, xu.scale.data() + (m0 + m) * G, sums.data() + row,
                csums.data() + row, BytePanel{{ws.data(), off.data()}, codes.data()}, G, out + m * N, N, ncols);
          });
        }
      });
      if (bias && !to_decode_path[i])  // added last, as the decode path does
        for (int64_t m = 0; m < rows; ++m)
          for (int64_t n = 0; n < ncols; ++n) out[m * N + n] += bias[sp.col + n];
    });
  }
  if (std::find(to_decode_path.begin(), to_decode_path.end(), 1) != to_decode_path.end()) {
    const QuantizedX xq(x, ldx, M, K);
    par::parallel_for(num_panels, [&](int64_t i) {
      const Span& sp = panels[i];
      if (to_decode_path[i]) rows_times_x(w.parts[sp.part], sp.n0, sp.n1, sp.col, K, xq, 0, M, bias, y, N);
    });
  }
  return 0;
}

// linear_kquant on a weight of panels (kquant_panels.h): threads split the 32-row panels of all
// parts, each running R rows at a time over K once (rows in chunks, panel_chunk_rows). One
// tile for every M: a row's bits do not depend on the batch.
void panels(const float* x, int64_t ldx, const KQuantWeight& w, const float* bias, float* y, int64_t M, int64_t N,
            int64_t K) {
  const PanelActs a(x, ldx, M, K, {&w});
  const std::vector<Span> spans = spans_of(w, PANEL);
  const int64_t chunk = panel_chunk_rows(M, K / 4);
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t rows = std::min(chunk, M - m0);
    par::parallel_for(static_cast<int64_t>(spans.size()), [&](int64_t i) {
      panel_times_x(w.parts[spans[i].part], spans[i], K, a, m0, rows, bias, y, N);
    });
  }
}

}  // namespace

extern "C" {

int64_t kquant_panel_bytes(int64_t type, int64_t rows, int64_t K) {
  return rows < 0 ? 0 : (rows + PANEL - 1) / PANEL * PANEL * row_bytes(type, K);
}

int kquant_pack_panels(int64_t type, const void* blocks, int64_t rows, int64_t K, void* out) {
  const int64_t rb = row_bytes(type, K);
  if (rb == 0 || rows < 0) return -1;
  const uint8_t* in = static_cast<const uint8_t*>(blocks);
  uint8_t* dst = static_cast<uint8_t*>(out);
  const int64_t num_panels = (rows + PANEL - 1) / PANEL;
  if (type == PAGEDLLM_GGML_Q8_0)
    return linear_pack_q8_0(in, reinterpret_cast<int8_t*>(dst), reinterpret_cast<uint16_t*>(dst + num_panels * K * PANEL),
                            rows, K);
  with_format(type, [&](auto f) {
    using F = decltype(f);
    if constexpr (!F::kSigned) {
      const int64_t bytes = K / PanelLayout<F>::kUnit * unit_bytes<F>;
      par::parallel_for(num_panels, [&](int64_t p) {
        pack_panel<F>(in + p * PANEL * rb, rb, std::min(PANEL, rows - p * PANEL), K, dst + p * bytes);
      });
    }
  });
  return 0;
}

int64_t kquant_row_bytes(int64_t type, int64_t K) { return row_bytes(type, K); }

int linear_kquant(const float* x, int64_t ldx, const KQuantWeight* w, const float* bias, float* y, int64_t M, int64_t N,
                  int64_t K, int64_t prompt_from) {
  const bool as_stored = fits(*w, N, K);
  if (!as_stored && !fits(*w, N, K, true)) return -1;
  if (M <= 0 || N == 0) return 0;
  if (!as_stored) {
    M = amx::prompt_rows(x, ldx, y, N, M, prompt_from, [&](const float* xp, float* yp, int64_t rows) {
      amx::linear_kquant(xp, ldx, *w, bias, yp, rows, N, K);
    });
    if (M > 0) panels(x, ldx, *w, bias, y, M, N, K);
    return 0;
  }
  if (M >= PREFILL_ROWS) return prefill(x, ldx, *w, bias, y, M, N, K);
  const std::vector<Span> spans = spans_of(*w);
  const QuantizedX xq(x, ldx, M, K);
  // Rows of x in chunks whose codes fit in L2, each chunk over every weight row.
  const int64_t chunk = chunk_rows(xq.kp), num_spans = static_cast<int64_t>(spans.size());
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t rows = std::min(chunk, M - m0);
    par::parallel_for(num_spans, [&](int64_t s) {
      const Span& span = spans[s];
      rows_times_x(w->parts[span.part], span.n0, span.n1, span.col, K, xq, m0, rows, bias, y, N);
    });
  }
  return 0;
}

int kquant_dequantize(int64_t type, const void* blocks, const int64_t* rows, int64_t R, int64_t K, float* out) {
  const int64_t rb = row_bytes(type, K);
  if (rb == 0) return -1;
  with_format(type, [&](auto f) {
    using F = decltype(f);
    par::parallel_for(R, [&](int64_t r) {
      const uint8_t* row = static_cast<const uint8_t*>(blocks) + (rows ? rows[r] : r) * rb;
      for_each_unit<F>(row, K, [&](int64_t u, int chunks, const uint8_t* b, const float* wsa, const float* offa) {
        for (int c = 0; c < chunks; ++c) {
          uint8_t q[64];
          store_u8x64(q, F::codes(b, c));
          for (int i = 0; i < 4; ++i) {
            const F32x16 v = F::kSigned ? load_s8_f32(reinterpret_cast<const int8_t*>(q + 16 * i)) : load_u8_f32(q + 16 * i);
            store(out + r * K + u * UNIT + c * CHUNK + 16 * i, fma(v, set1(wsa[4 * c + i]), set1(offa[4 * c + i])));
          }
        }
      });
    });
  });
  return 0;
}

}  // extern "C"

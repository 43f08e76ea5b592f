// GGUF blocks repacked once at load into 32-row panels that keep the file's bytes: the K-quant
// GEMM's layout for every M (kquant.cpp's linear_kquant on a weight whose parts carry
// PAGEDLLM_KQUANT_PANELS). Read as stored (kquant.h), a row's sums are scaled per 64 weights
// and per activation row, and below 8 rows in another order than the prefill panels, so a
// request's logits moved with the batch and a decode step's few rows cost nearly one each.
// Repacked, every M runs gemm.h's tile_u8a8 (or tile_w8a8 for Q8_0): the same arithmetic as
// the prefill panels the stored blocks are unpacked into, each group's scaling shared by a
// 32-column tile, the codes' bits and the scales decoded in registers.
//
// A part of `rows` rows is ceil(rows / 32) panels (rows past the part's zero), each a run of
// units of U weights per row (a super-block, or a block of 32) of 32 rows:
//   Q5_0 (U 32)   d [32] float16 | nibbles | bits 4 (704 bytes: 32 blocks of 22)
//   Q4_K (U 256)  d [32], dmin [32] float16 | scale bytes [12][32] | nibbles (4608: 32 x 144)
//   Q5_K (U 256)  as Q4_K | bits 4 (5632: 32 x 176)
//   Q6_K (U 256)  d [32] float16 | scales int8 [16][32] | nibbles | bits 4 | bits 5 (6720: 32 x 210)
// nibbles: per quad of 4 k, 64 bytes in vec.h's dot_q4_load layout (byte i: column i / 4's
// code i % 4 in its low nibble, column 16 + i / 4's in its high one); bits j: per quad 16
// bytes, a uint64 for columns 0-15 then one for 16-31, bit i the (4 + j)th bit of the code
// that nibble i carries (vec.h's dot_q4_bits). The scale bytes are the file's, column by
// column, so each piece's ws and off are those kquant.h's formats decode, bit for bit.
// Q8_0 parts are linear.cpp's q8a8 panels: every panel's codes, then every panel's d.
#pragma once

#include <stdint.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#include "aligned.h"
#include "gemm.h"
#include "kquant.h"

namespace kquant {

// The panel layout of format F: weights per unit, bytes before the unit's nibbles, bit planes.
template <class F>
struct PanelLayout;
template <>
struct PanelLayout<Q50> { static constexpr int64_t kUnit = 32, kHead = 64, kPlanes = 1; };
template <>
struct PanelLayout<Q4K> { static constexpr int64_t kUnit = 256, kHead = 512, kPlanes = 0; };
template <>
struct PanelLayout<Q5K> { static constexpr int64_t kUnit = 256, kHead = 512, kPlanes = 1; };
template <>
struct PanelLayout<Q6K> { static constexpr int64_t kUnit = 256, kHead = 576, kPlanes = 2; };

template <class F>
inline constexpr int64_t unit_bytes = PanelLayout<F>::kHead + PanelLayout<F>::kUnit * (16 + 4 * PanelLayout<F>::kPlanes);

// tile_u8a8's source (gemm.h) for one panel of format F at `panel`.
template <class F>
struct PackedPanel {
  using L = PanelLayout<F>;
  static constexpr int64_t kQuads = L::kUnit / 4, kPieces = L::kUnit / 32 * F::kPieces, kBytes = unit_bytes<F>;
  // Units ahead that prefetch asks for: about 4 KiB, at least one.
  static constexpr int64_t kAhead = std::max<int64_t>(1, 4096 / kBytes), kLines = (kBytes + 63) / 64;
  static_assert(kBytes == F::kBytes * 32 * L::kUnit / F::kElems, "a panel keeps the file's bytes");
  const uint8_t* panel;

  Q4W codes(int64_t quad) const {
    const uint8_t* b = panel + quad / kQuads * kBytes;
    const int64_t q = quad % kQuads;
    Q4W w = dot_q4_load(b + L::kHead + q * 64);
    for (int j = 0; j < L::kPlanes; ++j) {
      uint64_t bits[2];
      std::memcpy(bits, b + L::kHead + L::kUnit * 16 + j * L::kUnit * 4 + q * 16, 16);
      dot_q4_bits(w, bits[0], bits[1], uint8_t(16 << j));
    }
    return w;
  }

  // Quad q of a unit asks for its share of the lines of the unit kAhead on (for a tile of R
  // rows: gemm.h's kWeightLocality).
  template <int R>
  void prefetch(int64_t quad) const {
    const int64_t q = quad % kQuads;
    const uint8_t* ahead = panel + (quad / kQuads + kAhead) * kBytes;
    for (int64_t l = q * kLines / kQuads; l < (q + 1) * kLines / kQuads; ++l)
      __builtin_prefetch(ahead + 64 * l, 0, gemm::kWeightLocality<R>);
  }

  void scales(int64_t piece, F32x16 (&ws)[2], F32x16 (&off)[2]) const {
    const uint8_t* b = panel + piece / kPieces * kBytes;
    const int64_t i = piece % kPieces;
    const uint16_t* d = reinterpret_cast<const uint16_t*>(b);
    for (int h = 0; h < 2; ++h) {
      if constexpr (std::is_same_v<F, Q50>) {
        ws[h] = load_f16(d + 16 * h);
      } else if constexpr (std::is_same_v<F, Q6K>) {
        ws[h] = mul(load_f16(d + 16 * h), load_s8_f32(reinterpret_cast<const int8_t*>(b + 64 + i * 32 + 16 * h)));
      } else {  // Q4_K, Q5_K: kquant.h's scales_mins, 16 columns' 6-bit scale and min of piece i at once
        auto word = [&](int64_t byte, int w) {
          uint64_t v;
          std::memcpy(&v, b + 128 + byte * 32 + 16 * h + 8 * w, 8);
          return v;
        };
        constexpr uint64_t kLow6 = 0x3F3F3F3F3F3F3F3Full, kLow4 = 0x0F0F0F0F0F0F0F0Full, kLow2 = 0x0303030303030303ull;
        uint64_t sc[2], mn[2];
        for (int w = 0; w < 2; ++w) {
          if (i < 4) {
            sc[w] = word(i, w) & kLow6, mn[w] = word(i + 4, w) & kLow6;
          } else {
            sc[w] = (word(i + 4, w) & kLow4) | (word(i - 4, w) >> 6 & kLow2) << 4;
            mn[w] = (word(i + 4, w) >> 4 & kLow4) | (word(i, w) >> 6 & kLow2) << 4;
          }
        }
        ws[h] = mul(load_f16(d + 16 * h), u8_f32(sc[0], sc[1]));
        off[h] = sub(zero(), mul(load_f16(d + 32 + 16 * h), u8_f32(mn[0], mn[1])));
      }
    }
  }
};

// The first tile's source over a panel of format F whose later tiles read what it records: its
// codes and scales read (and prefetched) as PackedPanel's, each piece's scales also stored as
// floats into ws and off [pieces][32] (gemm.h's ScaleRows), and where bytes is not null each
// quad's codes into bytes (gemm.h's BytePanel).
template <class F>
struct RecordingPanel {
  PackedPanel<F> packed;
  float *ws, *off;
  uint8_t* bytes;

  Q4W codes(int64_t quad) const {
    const Q4W w = packed.codes(quad);
    if (bytes) store_q4w(bytes + quad * 4 * PANEL, w);
    return w;
  }
  template <int R>
  void prefetch(int64_t quad) const { packed.template prefetch<R>(quad); }
  void scales(int64_t piece, F32x16 (&w)[2], F32x16 (&o)[2]) const {
    o[0] = o[1] = zero();  // stored as zero where the offset is in the codes (kShift: Q5_0, Q6_K)
    packed.scales(piece, w, o);
    for (int h = 0; h < 2; ++h) store(ws + piece * PANEL + 16 * h, w[h]), store(off + piece * PANEL + 16 * h, o[h]);
  }
};

// A later tile's source over a panel of format F: the codes as packed (PackedPanel's), the
// scales as RecordingPanel stored them. No prefetch: the first tile brought the panel into L2.
template <class F>
struct PackedCodes : gemm::ScaleRows {
  PackedPanel<F> packed;
  Q4W codes(int64_t quad) const { return packed.codes(quad); }
  template <int R>
  void prefetch(int64_t) const {}
};

// Rows [0, nrows) (nrows <= 32) of a part in format F (row stride rb bytes, K weights) -> one
// panel at out (K / U units of unit_bytes<F>; rows past nrows zero).
template <class F>
inline void pack_panel(const uint8_t* rows, int64_t rb, int64_t nrows, int64_t K, uint8_t* out) {
  using L = PanelLayout<F>;
  constexpr int64_t kBytes = unit_bytes<F>;
  std::memset(out, 0, static_cast<size_t>(K / L::kUnit * kBytes));
  for (int64_t n = 0; n < nrows; ++n) {
    const uint8_t* row = rows + n * rb;
    for (int64_t k0 = 0; k0 < K; k0 += UNIT) {  // a row's codes in k order, a loop unit at a time
      uint8_t codes[UNIT];
      const uint8_t* b = F::unit(row, k0 / UNIT);
      const int chunks = int(std::min(UNIT, K - k0) / CHUNK);
      for (int c = 0; c < chunks; ++c) store_u8x64(codes + c * CHUNK, F::codes(b, c));
      for (int64_t k = k0; k < k0 + chunks * CHUNK; ++k) {
        uint8_t* u = out + k / L::kUnit * kBytes;
        const int64_t q = k % L::kUnit / 4, byte = q * 64 + n % 16 * 4 + k % 4, hi = n / 16;
        const uint8_t code = codes[k - k0];
        u[L::kHead + byte] |= uint8_t((code & 0x0F) << (4 * hi));
        for (int j = 0; j < L::kPlanes; ++j)
          if (code >> (4 + j) & 1) u[L::kHead + L::kUnit * 16 + j * L::kUnit * 4 + q * 16 + hi * 8 + (byte - q * 64) / 8] |=
                                       uint8_t(1 << ((byte - q * 64) % 8));
      }
    }
    for (int64_t u = 0; u < K / L::kUnit; ++u) {  // the scales, as the file stores them
      uint8_t* dst = out + u * kBytes;
      const uint8_t* blk = row + u * L::kUnit / F::kElems * F::kBytes;
      if constexpr (std::is_same_v<F, Q50>) {
        std::memcpy(dst + 2 * n, blk, 2);
      } else if constexpr (std::is_same_v<F, Q6K>) {
        std::memcpy(dst + 2 * n, blk + 208, 2);
        for (int i = 0; i < 16; ++i) dst[64 + i * 32 + n] = blk[192 + i];
      } else {
        std::memcpy(dst + 2 * n, blk, 2), std::memcpy(dst + 64 + 2 * n, blk + 2, 2);
        for (int i = 0; i < 12; ++i) dst[128 + i * 32 + n] = blk[4 + i];
      }
    }
  }
}

// Rows of x quantized for the panel tiles (weights in panels, and kquant.cpp's stored blocks
// unpacked to panels): s8 codes (tile_w8a8's) where a part is Q8_0, codes
// with their sums (tile_u8a8's; per half group too where a part has 16-weight pieces) where
// another is; each empty where no part needs it.
struct PanelActs {
  gemm::QuantizedRows xs, xu;

  PanelActs() = default;
  // For the parts of the weights (as stored, or carrying PAGEDLLM_KQUANT_PANELS).
  PanelActs(const float* x, int64_t ldx, int64_t M, int64_t K, const std::vector<const KQuantWeight*>& weights) {
    bool signed_codes = false, unsigned_codes = false, halves = false;
    for (const KQuantWeight* w : weights)
      for (int64_t p = 0; p < w->num_parts; ++p)
        if (w->parts[p].rows > 0)
          with_format(w->parts[p].type & ~PAGEDLLM_KQUANT_PANELS, [&](auto f) {
            using F = decltype(f);
            (F::kSigned ? signed_codes : unsigned_codes) = true;
            halves |= F::kPieces == 2;
          });
    if (signed_codes) xs = gemm::quantize_rows<false>(x, ldx, M, K);
    if (unsigned_codes) xu = halves ? gemm::quantize_rows<true, true>(x, ldx, M, K) : gemm::quantize_rows<true>(x, ldx, M, K);
  }
};

// Rows per chunk of M (each panel runs over a chunk's rows before the next chunk): x's codes
// in L2 (as linear_w8a8's), but at least 240 rows, over which a panel's decoding to bytes is
// spread; M split into equal chunks, as many as the nearest whole number of those.
inline int64_t panel_chunk_rows(int64_t M, int64_t kq) {
  const int64_t target = std::max<int64_t>(gemm::chunk_rows_i8(kq), 240);
  const int64_t chunks = std::max<int64_t>(1, (M + target / 2) / target);
  return (M + chunks - 1) / chunks;
}

// y[(m0 + m) * ldy + sp.col + j] for m < rows, j < sp.n1 - sp.n0: rows [m0, m0 + rows) of a's x
// times the panel of `part` (kquant_pack_panels' layout) holding rows [sp.n0, sp.n1), plus
// bias[sp.col + j] where bias (added last, as rows_times_x adds it).
inline void panel_times_x(const KQuantPart& part, const Span& sp, int64_t K, const PanelActs& a, int64_t m0,
                          int64_t rows, const float* bias, float* y, int64_t ldy) {
  using namespace gemm;
  const int64_t G = K / QG, kq = K / 4, ncols = sp.n1 - sp.n0, panel = sp.n0 / PANEL;
  const uint8_t* blocks = static_cast<const uint8_t*>(part.blocks);
  float* out = y + m0 * ldy + sp.col;
  with_format(part.type & ~PAGEDLLM_KQUANT_PANELS, [&](auto f) {
    using F = decltype(f);
    if constexpr (F::kSigned) {  // linear.cpp's q8a8 panels: every panel's codes, then every panel's d
      const int64_t num_panels = (part.rows + PANEL - 1) / PANEL;
      const int8_t* codes = reinterpret_cast<const int8_t*>(blocks) + panel * K * PANEL;
      const uint16_t* d = reinterpret_cast<const uint16_t*>(blocks + num_panels * K * PANEL) + panel * G * PANEL;
      panel_rows<kGemmRowsI8>(rows, [&](auto r, int64_t m) {
        tile_w8a8<decltype(r)::value, false>(a.xs.codes.data() + (m0 + m) * kq, kq, a.xs.scale.data() + (m0 + m) * G,
                                             codes, G, a.xs.xsum128.data() + (m0 + m) * G, d, nullptr, out + m * ldy,
                                             ldy, ncols);
      });
    } else {
      const std::vector<float>& sums = F::kPieces == 2 ? a.xu.sum16 : a.xu.sum;
      const std::vector<int32_t>& csums = F::kPieces == 2 ? a.xu.csum16 : a.xu.csum;
      const PackedPanel<F> packed{blocks + panel * (K / PanelLayout<F>::kUnit) * unit_bytes<F>};
      // The first tile from `first`, the others from `rest`.
      auto run = [&](const auto& first, const auto& rest) {
        panel_rows<kGemmRowsQ4>(rows, [&](auto r, int64_t m) {
          const int64_t row = (m0 + m) * G * F::kPieces;
          auto tile = [&](const auto& src) {
            tile_u8a8<decltype(r)::value, F::kPieces, F::kCodeMax, F::kCodeShift>(
                a.xu.codes.data() + (m0 + m) * kq, kq, a.xu.scale.data() + (m0 + m) * G, sums.data() + row,
                csums.data() + row, src, G, out + m * ldy, ldy, ncols);
          };
          if (m == 0)
            tile(first);
          else
            tile(rest);
        });
      };
      // Every tile decodes the panel's scales and any bit planes again, unless there are two or
      // more and tiles x (1 + bit planes) reaches the ISA's kKQuantRecordFrom (vec.h): then the
      // first stores its scales as floats, and codes with bit planes as bytes, for the others
      // (docs/benchmarks.md, session 37). The same codes and scales, the same bits.
      constexpr int64_t kPlanes = PanelLayout<F>::kPlanes;
      const int64_t tiles = (rows + kGemmRowsQ4 - 1) / kGemmRowsQ4;
      if (tiles < 2 || tiles * (1 + kPlanes) < kKQuantRecordFrom) return run(packed, packed);
      thread_local aligned::vector<float> ws, off;
      ws.resize(static_cast<size_t>(G * F::kPieces * PANEL)), off.resize(ws.size());
      const ScaleRows scales{ws.data(), off.data()};
      if constexpr (kPlanes == 0) {
        run(RecordingPanel<F>{packed, ws.data(), off.data(), nullptr}, PackedCodes<F>{scales, packed});
      } else {
        thread_local aligned::vector<uint8_t> bytes;
        bytes.resize(static_cast<size_t>(K * PANEL));
        run(RecordingPanel<F>{packed, ws.data(), off.data(), bytes.data()}, BytePanel{scales, bytes.data()});
      }
    }
  });
  if (bias)
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t j = 0; j < ncols; ++j) out[m * ldy + j] += bias[sp.col + j];
}

}  // namespace kquant

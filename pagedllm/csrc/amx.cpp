// The int8 formats' GEMMs for prompt rows on Intel AMX tiles in bfloat16 (amx.h).
//
// Per 32-column panel (the threads split the panels): its weights are decoded once into
// bfloat16 laid out as AMX's B operand (per group of 32 k and half panel, 16 rows of k pairs x
// 16 columns x 2): w4a8's d q + m, q8a8's d q, a K-quant panel's ws (q + shift) + off, w8a8's
// codes q (its column scales multiply the sums), by the thread during its previous panel's
// products; then every 32 rows of x (converted once per call to bfloat16, zero padded to
// whole tiles and groups) take 4 tile products per group: rows 0-15 and 16-31 by columns 0-15
// and 16-31, float32 sums kept in 4 tiles over all of K and stored once.
#include "amx.h"

#include <atomic>

#include "pagedllm_abi.h"

#if defined(__x86_64__) && defined(__AVX512BF16__)
#define PAGEDLLM_AMX_BUILT 1
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <vector>

#include "aligned.h"
#include "gemm.h"
#include "kquant_panels.h"
#include "parallel.h"
#endif

namespace amx {
namespace {

std::atomic<bool> switched_on{false};  // the library's loader sets it (PAGEDLLM_DISABLE_AMX)

// The CPU's AMX-BF16 and AMX-TILE (CPUID leaf 7, EDX bits 22 and 24), and Linux's grant of the
// tile data to this process (XFEATURE_XTILEDATA, 18; the grant covers every thread).
bool usable() {
#ifdef PAGEDLLM_AMX_BUILT
  static const bool granted = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d >> 22 & 1) || !(d >> 24 & 1)) return false;
    constexpr long kReqXcompPerm = 0x1023, kXTileData = 18;
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXTileData) == 0;
  }();
  return granted;
#else
  return false;
#endif
}

}  // namespace

bool active() { return switched_on.load(std::memory_order_relaxed) && usable(); }

}  // namespace amx

extern "C" int gemm_amx(int mode) {
  if (mode >= 0) amx::switched_on.store(mode != 0, std::memory_order_relaxed);
  return amx::active() ? 1 : 0;
}

#ifdef PAGEDLLM_AMX_BUILT
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")

namespace amx {
namespace {

using gemm::NB;
using gemm::q4_group_bytes;
using vec::F32x16;
using vec::Q4W;
using gemm::Q4_NIBBLES;
using gemm::QG;

constexpr int kTile = 16;                  // rows (and float32 columns) of a tile
constexpr int64_t kBRows = QG / 2;         // B rows per group: pairs of k
constexpr int64_t kGroupB = 2 * kBRows * NB;  // bfloat16 of one group's B, both halves

// The GEMM's tiles (start_tiles' shape): 0-3: C, float32 sums of rows 16 i .. 16 i + 15 by
// columns 16 j .. 16 j + 15 (tile 2 i + j); 4, 5: A, 16 rows of x by one group's 32 k; 6, 7: B,
// one group's 16 k pairs by 16 columns (half j of the panel).
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};
TileConfig make_config() {
  TileConfig c;
  for (int t = 0; t < 8; ++t) c.rows[t] = kTile, c.colsb[t] = 64;
  return c;
}
const TileConfig kConfig = make_config();

}  // namespace

void start_tiles() { _tile_loadconfig(&kConfig); }
void stop_tiles() { _tile_release(); }

namespace {

constexpr int64_t kTileX = kTile * QG;  // bfloat16 of one A tile: 16 rows by one group's 32 k

// x [M][K] float32 (stride ldx) -> bfloat16 rounded to nearest even, zero padded to Mp rows and
// G groups, as A tiles, each 1 KiB in a row: [Mp / 16][G][16 rows][32 k] (tile loads of 16
// lines 64 bytes apart; rows of x 2 Kp bytes apart made each load 16 lines of L2).
void to_bf16(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t Mp, int64_t G, uint16_t* out) {
  par::parallel_for(Mp, [&](int64_t m) {
    uint16_t* row = out + m / kTile * G * kTileX + m % kTile * QG;
    for (int64_t k = 0; k < G * QG; k += 16) {
      const __mmask16 live = m < M ? static_cast<__mmask16>(k + 16 <= K ? 0xFFFF : k < K ? (1u << (K - k)) - 1 : 0) : 0;
      const __m512 v = _mm512_maskz_loadu_ps(live, x + m * ldx + k);
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + k / QG * kTileX + k % QG), (__m256i)_mm512_cvtneps_pbh(v));
    }
  }, 17);
}

// Word i of a B tile's row: column i / 2, element i % 2 of its k pair, from [k0 x 16 | k1 x 16].
__m512i pair_order() {
  alignas(64) uint16_t order[32];
  for (int i = 0; i < 32; ++i) order[i] = static_cast<uint16_t>(i % 2 * 16 + i / 2);
  return _mm512_load_si512(order);
}

// w[j]: k = 4 q + j of 16 columns -> rows 2 q and 2 q + 1 of a B tile at out (k pairs 2 q, 2 q + 1).
inline void store_quad(const __m512 (&w)[4], __m512i order, uint16_t* out) {
  for (int t = 0; t < 2; ++t) {
    const __m512i pair = (__m512i)_mm512_cvtne2ps_pbh(w[2 * t + 1], w[2 * t]);
    _mm512_storeu_si512(out + t * NB, _mm512_permutexvar_epi16(order, pair));
  }
}

// Groups [g0, g1) of a w4a8 panel (groups of q4_group_bytes(symmetric): with m, or
// without where every m is -8 d) -> bfloat16 weights d q + m as B tiles take them: [group][2
// halves][16 k pairs][16 columns][2] (groups at their own places in b).
void unpack_q4(const uint8_t* panel, bool symmetric, int64_t g0, int64_t g1, uint16_t* b) {
  const __m512i order = pair_order(), low4 = _mm512_set1_epi32(0x0F0F0F0F), byte = _mm512_set1_epi32(0xFF);
  for (int64_t g = g0; g < g1; ++g) {
    const uint8_t* pg = panel + g * q4_group_bytes(symmetric);
    const uint16_t* dm = reinterpret_cast<const uint16_t*>(pg + Q4_NIBBLES);
    for (int h = 0; h < 2; ++h) {
      const __m512 d = _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + kTile * h)));
      const __m512 m = symmetric ? _mm512_mul_ps(d, _mm512_set1_ps(-8.f))
                                 : _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(dm + NB + kTile * h)));
      uint16_t* out = b + g * kGroupB + h * kBRows * NB;
      for (int64_t q = 0; q < QG / 4; ++q) {  // quad q: lane c holds k = 4 q .. 4 q + 3 of columns c and 16 + c
        const __m512i bytes = _mm512_loadu_si512(pg + q * 64);
        const __m512i codes = _mm512_and_si512(h ? _mm512_srli_epi32(bytes, 4) : bytes, low4);
        __m512 w[4];
        for (int j = 0; j < 4; ++j)
          w[j] = _mm512_fmadd_ps(d, _mm512_cvtepi32_ps(_mm512_and_si512(_mm512_srli_epi32(codes, 8 * j), byte)), m);
        store_quad(w, order, out + 2 * q * NB);
      }
    }
  }
}

// Groups [g0, g1) of a w8a8 panel ([G * QG / 4][32][4] stored codes, gemm.h's stored_code) ->
// bfloat16 weights laid out as unpack_q4's: the codes q (exact: |q| <= 127; w8a8's column
// scales apply to the sums), or with d ([G][32] float16: q8a8's Q8_0 scales) d q.
void unpack_w8a8(const int8_t* panel, const uint16_t* d, int64_t g0, int64_t g1, uint16_t* b) {
  const __m512i order = pair_order(), flip = _mm512_set1_epi32(gemm::kDotXSums ? int(0x80808080) : 0);
  for (int64_t g = g0; g < g1; ++g)
    for (int h = 0; h < 2; ++h) {
      uint16_t* out = b + g * kGroupB + h * kBRows * NB;
      const __m256i dh = d ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(d + g * NB + kTile * h)) : __m256i{};
      const __m512 scale = d ? _mm512_cvtph_ps(dh) : _mm512_set1_ps(1.f);
      for (int64_t q = 0; q < QG / 4; ++q) {  // quad q: lane c holds k = 4 q .. 4 q + 3 of column 16 h + c
        const int8_t* quad = panel + ((g * QG / 4 + q) * NB + kTile * h) * 4;
        const __m512i codes = _mm512_xor_si512(_mm512_loadu_si512(quad), flip);
        __m512 w[4];
        for (int j = 0; j < 4; ++j)
          w[j] = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_srai_epi32(_mm512_slli_epi32(codes, 24 - 8 * j), 24)), scale);
        store_quad(w, order, out + 2 * q * NB);
      }
    }
}

// Groups [g0, g1) of a K-quant panel (kquant_panels.h's layout; not Q8_0) -> bfloat16 weights
// ws (q + shift) + off, laid out as unpack_q4's: the codes and scales as the vector tiles
// decode them.
template <class F>
void unpack_kquant(const uint8_t* panel, int64_t g0, int64_t g1, uint16_t* b) {
  constexpr int P = F::kPieces, kQuads = QG / 4 / P;  // quads per piece
  const kquant::PackedPanel<F> src{panel};
  const __m512i order = pair_order(), byte = _mm512_set1_epi32(0xFF), shift = _mm512_set1_epi32(F::kCodeShift);
  for (int64_t g = g0; g < g1; ++g)
    for (int piece = 0; piece < P; ++piece) {
      F32x16 ws[2], off[2] = {vec::zero(), vec::zero()};  // off stays zero where the shift is in the codes
      src.scales(g * P + piece, ws, off);
      for (int q = 0; q < kQuads; ++q) {
        const int64_t quad = g * QG / 4 + piece * kQuads + q;
        const Q4W w = src.codes(quad);
        for (int h = 0; h < 2; ++h) {
          const __m512i codes = h ? w.hi : w.lo;  // lane c: k = 4 quad .. 4 quad + 3 of column 16 h + c
          __m512 v[4];
          for (int j = 0; j < 4; ++j) {
            const __m512i code = _mm512_add_epi32(_mm512_and_si512(_mm512_srli_epi32(codes, 8 * j), byte), shift);
            v[j] = _mm512_fmadd_ps(ws[h].v, _mm512_cvtepi32_ps(code), off[h].v);
          }
          store_quad(v, order, b + g * kGroupB + h * kBRows * NB + 2 * (piece * kQuads + q) * NB);
        }
      }
    }
}

// Where a panel's products go: y's columns [0, ncols) at y (row stride ldy), each sum times
// wscale[column] (null: 1) plus bias[column] (null: 0).
struct PanelOut {
  float* y;
  int64_t ncols;
  const float* wscale;
  const float* bias;
};

// During group g of a block's K loop, asks for write access to rows 2 g and 2 g + 1 of its y
// (rows [0, rows) from y, stride ldy; 32 columns, two lines each), so that the block's stores
// find their lines in L1, where each waited for the line's read from L3 (~25% of a 256-row
// gate/up GEMM's time, docs/benchmarks.md, session 43). With fewer than 16 groups the last
// rows are not asked for.
inline void want_rows(float* y, int64_t ldy, int64_t rows, int64_t g) {
  for (int64_t r = 2 * g; r < 2 * g + 2 && r < rows; ++r) {
    __builtin_prefetch(y + r * ldy, 1, 3);
    __builtin_prefetch(y + r * ldy + kTile, 1, 3);
  }
}

// y = x w^T by panels on AMX tiles, for the M rows of x [M, K]: panel(i, b, g0, g1) writes
// groups [g0, g1) of panel i's weights into b as B tiles (unpack_q4's layout) and returns where
// its outputs go. A thread decodes the next panel of its chunk while the tile unit multiplies
// the current one, a share after each group's products: decoding and multiplying in turn left
// each unit idle while the other worked (docs/benchmarks.md, session 45).
template <typename Panel>
void gemm(const float* x, int64_t ldx, int64_t M, int64_t K, int64_t ldy, int64_t panels, Panel panel) {
  const int64_t G = (K + QG - 1) / QG, Kp = G * QG, Mp = (M + 2 * kTile - 1) / (2 * kTile) * (2 * kTile);
  // Kept from call to call (the caller's thread's): fresh pages for every call cost as much
  // as a layer's GEMM here.
  static thread_local aligned::vector<uint16_t> xb;  // tile rows on cache lines (aligned.h)
  if (xb.size() < static_cast<size_t>(Mp * Kp)) xb.resize(static_cast<size_t>(Mp * Kp));
  uint16_t* xs = xb.data();  // (the helper threads' own xb is another vector)
  to_bf16(x, ldx, M, K, Mp, G, xs);
  const int64_t steps = Mp / (2 * kTile) * G;  // group products of a panel
  par::parallel_chunks(panels, [&](int64_t begin, int64_t end) {
    static thread_local aligned::vector<uint16_t> wbs[2];  // this panel's B tiles and the next one's
    for (aligned::vector<uint16_t>& w : wbs) w.resize(static_cast<size_t>(G * kGroupB));
    panel(begin, wbs[0].data(), 0, G);
    start_tiles();
    for (int64_t p = begin; p < end; ++p) {
      const uint16_t* wb = wbs[(p - begin) % 2].data();
      uint16_t* next = p + 1 < end ? wbs[(p - begin + 1) % 2].data() : nullptr;
      int64_t step = 0, decoded = 0;  // of this panel's products; of the next panel's groups
      const auto decode_share = [&] {
        if (!next) return;
        const int64_t upto = ++step * G / steps;
        if (upto > decoded) panel(p + 1, next, decoded, upto), decoded = upto;
      };
      const PanelOut o = panel(p, nullptr, 0, 0);
      alignas(64) float sums[2 * kTile][NB];
      const auto columns = [](int64_t n) { return static_cast<__mmask16>(n >= kTile ? 0xFFFF : n > 0 ? (1u << n) - 1 : 0); };
      const __mmask16 live[2] = {columns(o.ncols), columns(o.ncols - kTile)};  // y's columns in each half
      __m512 b[2], ws[2];
      for (int h = 0; h < 2; ++h) {
        b[h] = o.bias ? _mm512_maskz_loadu_ps(live[h], o.bias + kTile * h) : _mm512_setzero_ps();
        ws[h] = o.wscale ? _mm512_maskz_loadu_ps(live[h], o.wscale + kTile * h) : _mm512_set1_ps(1.f);
      }
      for (int64_t m0 = 0; m0 < Mp; m0 += 2 * kTile) {
        const uint16_t* a = xs + m0 * Kp;  // two A tiles' rows: [2][G][16][32]
        float* const y = o.y + m0 * ldy;
        const int64_t rows = std::min<int64_t>(2 * kTile, M - m0);
        if (rows <= kTile) {  // the last rows fit one A tile: half the products (a short prompt)
          _tile_zero(0);
          _tile_zero(1);
          for (int64_t g = 0; g < G; ++g) {
            want_rows(y, ldy, rows, g);
            _tile_loadd(4, a + g * kTileX, 64);
            _tile_loadd(6, wb + g * kGroupB, 64);
            _tile_loadd(7, wb + g * kGroupB + kBRows * NB, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            decode_share();
          }
        } else {
          _tile_zero(0);
          _tile_zero(1);
          _tile_zero(2);
          _tile_zero(3);
          for (int64_t g = 0; g < G; ++g) {
            want_rows(y, ldy, rows, g);
            _tile_loadd(4, a + g * kTileX, 64);
            _tile_loadd(5, a + (G + g) * kTileX, 64);
            _tile_loadd(6, wb + g * kGroupB, 64);
            _tile_loadd(7, wb + g * kGroupB + kBRows * NB, 64);
            _tile_dpbf16ps(0, 4, 6);
            _tile_dpbf16ps(1, 4, 7);
            _tile_dpbf16ps(2, 5, 6);
            _tile_dpbf16ps(3, 5, 7);
            decode_share();
          }
          _tile_stored(2, &sums[kTile][0], NB * 4);
          _tile_stored(3, &sums[kTile][kTile], NB * 4);
        }
        _tile_stored(0, &sums[0][0], NB * 4);
        _tile_stored(1, &sums[0][kTile], NB * 4);
        for (int64_t r = 0; r < rows; ++r) {
          float* out = y + r * ldy;
          _mm512_mask_storeu_ps(out, live[0], _mm512_fmadd_ps(_mm512_load_ps(&sums[r][0]), ws[0], b[0]));
          _mm512_mask_storeu_ps(out + kTile, live[1], _mm512_fmadd_ps(_mm512_load_ps(&sums[r][kTile]), ws[1], b[1]));
        }
      }
    }
    stop_tiles();
  });
}

// Panel p of a weight with N columns in one run of panels: its outputs in y (stride N).
PanelOut nth(int64_t p, float* y, int64_t N, const float* wscale, const float* bias) {
  const int64_t ncols = std::min<int64_t>(NB, N - p * NB);
  return {y + p * NB, ncols, wscale ? wscale + p * NB : nullptr, bias ? bias + p * NB : nullptr};
}

}  // namespace

void linear_q4a8(const float* x, int64_t ldx, const uint8_t* packed, const float* bias, float* y, int64_t M, int64_t N,
                 int64_t K, bool symmetric) {
  const int64_t G = (K + QG - 1) / QG;
  gemm(x, ldx, M, K, N, (N + NB - 1) / NB, [&](int64_t p, uint16_t* b, int64_t g0, int64_t g1) {
    unpack_q4(packed + p * G * q4_group_bytes(symmetric), symmetric, g0, g1, b);
    return nth(p, y, N, nullptr, bias);
  });
}

void linear_w8a8(const float* x, int64_t ldx, const int8_t* packed, const float* wscale, const float* bias, float* y,
                 int64_t M, int64_t N, int64_t K) {
  const int64_t G = (K + QG - 1) / QG;
  gemm(x, ldx, M, K, N, (N + NB - 1) / NB, [&](int64_t p, uint16_t* b, int64_t g0, int64_t g1) {
    unpack_w8a8(packed + p * G * QG * NB, nullptr, g0, g1, b);
    return nth(p, y, N, wscale, bias);
  });
}

void linear_q8a8(const float* x, int64_t ldx, const int8_t* packed, const uint16_t* d, const float* bias, float* y,
                 int64_t M, int64_t N, int64_t K) {
  const int64_t G = K / QG;
  gemm(x, ldx, M, K, N, (N + NB - 1) / NB, [&](int64_t p, uint16_t* b, int64_t g0, int64_t g1) {
    unpack_w8a8(packed + p * G * QG * NB, d + p * G * NB, g0, g1, b);
    return nth(p, y, N, nullptr, bias);
  });
}

void linear_kquant(const float* x, int64_t ldx, const KQuantWeight& w, const float* bias, float* y, int64_t M,
                   int64_t N, int64_t K) {
  struct Span {
    int64_t part, panel, col;  // panel of the part, its first column of y
  };
  std::vector<Span> spans;
  for (int64_t part = 0, col = 0; part < w.num_parts; col += w.parts[part++].rows)
    for (int64_t p = 0; p * NB < w.parts[part].rows; ++p) spans.push_back({part, p, col + p * NB});
  const int64_t G = K / QG;
  gemm(x, ldx, M, K, N, static_cast<int64_t>(spans.size()), [&](int64_t i, uint16_t* b, int64_t g0, int64_t g1) {
    const Span& s = spans[i];
    const KQuantPart& part = w.parts[s.part];
    const uint8_t* blocks = static_cast<const uint8_t*>(part.blocks);
    kquant::with_format(part.type & ~PAGEDLLM_KQUANT_PANELS, [&](auto f) {
      using F = decltype(f);
      if constexpr (F::kSigned) {  // linear.cpp's q8a8 panels: every panel's codes, then every panel's d
        const int64_t num_panels = (part.rows + NB - 1) / NB;
        const uint16_t* d = reinterpret_cast<const uint16_t*>(blocks + num_panels * K * NB);
        unpack_w8a8(reinterpret_cast<const int8_t*>(blocks) + s.panel * K * NB, d + s.panel * G * NB, g0, g1, b);
      } else {
        unpack_kquant<F>(blocks + s.panel * (K / kquant::PanelLayout<F>::kUnit) * kquant::unit_bytes<F>, g0, g1, b);
      }
    });
    return PanelOut{y + s.col, std::min<int64_t>(NB, part.rows - s.panel * NB), nullptr, bias ? bias + s.col : nullptr};
  });
}

}  // namespace amx

#pragma GCC pop_options
#else
namespace amx {
void linear_q4a8(const float*, int64_t, const uint8_t*, const float*, float*, int64_t, int64_t, int64_t, bool) {}
void linear_w8a8(const float*, int64_t, const int8_t*, const float*, const float*, float*, int64_t, int64_t, int64_t) {}
void linear_q8a8(const float*, int64_t, const int8_t*, const uint16_t*, const float*, float*, int64_t, int64_t,
                 int64_t) {}
void linear_kquant(const float*, int64_t, const KQuantWeight&, const float*, float*, int64_t, int64_t, int64_t) {}
}  // namespace amx
#endif

// LoRA updates of many adapters in one call (Punica's SGMV: segmented gather matrix-vector):
// per run of tokens of one adapter, y += (x A^T) B^T, the shrink into the parts' summed rank
// (at most PAGEDLLM_LORA_MAX_RANK), then, per part of a fused projection (q/k/v, gate/up),
// the expand of that part's rank into that part's outputs alone.
// Why one call: in PyTorch a run costs two matmuls and their dispatch per projection, and a
// decode step of 16 adapters has 16 runs in each of its projections (docs/benchmarks.md).
// How: the tokens of a run go in micro-tiles of up to kTile, so that each load of A or B (and
// its widening from bfloat16) feeds kTile tokens' FMAs, as the GEMMs' micro-tiles do; the
// tiles are the thread team's items, each one's shrink and expands in one parallel region.
// A and B come in panels of 16 columns (pagedllm_abi.h), so that a pass over one block of
// accumulators reads its weights as one sequential stream: a step reads each adapter's A and B
// once from memory, and the hardware prefetchers follow a sequential stream where they
// followed strided rows of A^T and B^T badly (docs/benchmarks.md, "LoRA adapters").
// Each token's arithmetic is the same whatever its tile (a fixed order over K and the rank):
// results do not depend on the rest of the batch.
#include <stdint.h>

#include <algorithm>
#include <vector>

#include "pagedllm_abi.h"
#include "parallel.h"
#include "vec.h"

using namespace vec;

namespace {

constexpr int64_t kParallelTokens = 16;  // fewer tokens: one thread (a parallel region costs more)
constexpr int kTile = 4;                 // tokens of one run per micro-tile
// 16-lane vectors of accumulators per token in one pass (a shrink's rank chunks, an expand's
// outputs): kTile times this plus the loaded A or B vectors must fit in the registers.
constexpr int kWide = kF32Regs >= 32 ? 4 : 1;
constexpr int64_t kH = PAGEDLLM_LORA_MAX_RANK;  // a token's row of shrunk values

constexpr int64_t kAhead = 1024;  // bytes of A or B prefetched ahead of the loads

// Each 16-column row of A or B is loaded with a prefetch of the row kAhead bytes further on
// in its panel stream: the hardware prefetchers stop at each 4 KiB page.
template <typename W>
inline void prefetch_ahead(const W* p) {
  __builtin_prefetch(reinterpret_cast<const char*>(p) + kAhead);
}

inline F32x16 load_w(const float* p) { return load(p); }
inline F32x16 load_w(const uint16_t* p) { return load_bf16(p); }

int64_t round16(int64_t n) { return (n + 15) / 16 * 16; }

// h[t][16 c] for the tile's T tokens and C chunks of 16 ranks: x[t] (K) times a (C panels
// [K, 16], one after another).
template <int T, int C, typename W>
void shrink_pass(const float* x, int64_t ldx, const W* a, int64_t K, float* h) {
  F32x16 acc[T][C];
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < C; ++c) acc[t][c] = zero();
  for (int64_t k = 0; k < K; ++k) {
    F32x16 w[C];
    for (int c = 0; c < C; ++c) {
      prefetch_ahead(a + (c * K + k) * 16);
      w[c] = load_w(a + (c * K + k) * 16);
    }
    for (int t = 0; t < T; ++t) {
      const F32x16 xt = set1(x[t * ldx + k]);
      for (int c = 0; c < C; ++c) acc[t][c] = fma(xt, w[c], acc[t][c]);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < C; ++c) store(h + t * kH + 16 * c, acc[t][c]);
}

// y[t][16 v] (V vectors from column n of N) += h[t][:r] b (the part's panels [r, 16], one
// after another).
template <int T, int V, typename W>
void expand_pass(const float* h, const W* b, int64_t r, float* y, int64_t ldy, int64_t n, int64_t N) {
  F32x16 acc[T][V];
  for (int t = 0; t < T; ++t)
    for (int v = 0; v < V; ++v) acc[t][v] = load_first(y + t * ldy + n + 16 * v, N - n - 16 * v);
  const W* panel = b + n * r;  // panel n / 16 starts at (n / 16) r 16
  for (int64_t j = 0; j < r; ++j) {
    F32x16 w[V];
    for (int v = 0; v < V; ++v) {
      prefetch_ahead(panel + (v * r + j) * 16);
      w[v] = load_w(panel + (v * r + j) * 16);
    }
    for (int t = 0; t < T; ++t) {
      const F32x16 ht = set1(h[t * kH + j]);
      for (int v = 0; v < V; ++v) acc[t][v] = fma(ht, w[v], acc[t][v]);
    }
  }
  for (int t = 0; t < T; ++t)
    for (int v = 0; v < V; ++v) store_first(y + t * ldy + n + 16 * v, acc[t][v], N - n - 16 * v);
}

struct Call {
  const float* x;
  int64_t ldx;
  float* y;
  int64_t ldy;
  int64_t K;
  const int64_t* widths;
  int64_t num_parts;
};

// One micro-tile: T tokens (rows x, y) of one run with A^T a, B b and part ranks `ranks`.
template <int T, typename W>
void tile(const Call& c, const float* x, float* y, const W* a, const W* b, const int64_t* ranks) {
  int64_t R = 0;
  for (int64_t p = 0; p < c.num_parts; ++p) R += ranks[p];
  const int64_t chunks = round16(R) / 16;
  alignas(64) float h[T * kH];
  for (int64_t c0 = 0; c0 < chunks; c0 += kWide) {
    const W* a0 = a + 16 * c0 * c.K;
    float* h0 = h + 16 * c0;
    switch (std::min<int64_t>(kWide, chunks - c0)) {
      case 1: shrink_pass<T, 1>(x, c.ldx, a0, c.K, h0); break;
      case 2: shrink_pass<T, 2>(x, c.ldx, a0, c.K, h0); break;
      case 3: shrink_pass<T, 3>(x, c.ldx, a0, c.K, h0); break;
      default: shrink_pass<T, 4>(x, c.ldx, a0, c.K, h0);
    }
  }
  int64_t r0 = 0, n0 = 0;
  for (int64_t p = 0; p < c.num_parts; ++p) {
    const int64_t r = ranks[p], N = c.widths[p], N16 = round16(N);
    if (r > 0) {
      int64_t n = 0;
      for (; n + 16 * kWide <= N16; n += 16 * kWide) expand_pass<T, kWide>(h + r0, b, r, y + n0, c.ldy, n, N);
      for (; n < N16; n += 16) expand_pass<T, 1>(h + r0, b, r, y + n0, c.ldy, n, N);
      b += r * N16;
    }
    r0 += r;
    n0 += N;
  }
}

template <typename W>
void run(const Call& c, const int64_t* segments, int64_t S, const int64_t* a, const int64_t* b, const int64_t* ranks) {
  std::vector<int64_t> tiles;  // (segment, first token) per micro-tile of a run with a rank
  int64_t tokens = 0;
  for (int64_t s = 0; s < S; ++s) {
    const int64_t* rs = ranks + s * PAGEDLLM_LORA_MAX_PARTS;
    if (std::all_of(rs, rs + c.num_parts, [](int64_t r) { return r == 0; })) continue;
    for (int64_t t = segments[2 * s]; t < segments[2 * s + 1]; t += kTile) tiles.insert(tiles.end(), {s, t});
    tokens += segments[2 * s + 1] - segments[2 * s];
  }
  auto one = [&](int64_t i) {
    const int64_t s = tiles[2 * i], t = tiles[2 * i + 1], n = std::min<int64_t>(kTile, segments[2 * s + 1] - t);
    const float* x = c.x + t * c.ldx;
    float* y = c.y + t * c.ldy;
    const W* as = reinterpret_cast<const W*>(a[s]);
    const W* bs = reinterpret_cast<const W*>(b[s]);
    const int64_t* rs = ranks + s * PAGEDLLM_LORA_MAX_PARTS;
    static_assert(kTile == 4, "one case per tile size");
    switch (n) {
      case 1: tile<1>(c, x, y, as, bs, rs); break;
      case 2: tile<2>(c, x, y, as, bs, rs); break;
      case 3: tile<3>(c, x, y, as, bs, rs); break;
      default: tile<4>(c, x, y, as, bs, rs);
    }
  };
  const int64_t n = static_cast<int64_t>(tiles.size()) / 2;
  if (tokens < kParallelTokens) {
    for (int64_t i = 0; i < n; ++i) one(i);
  } else {
    par::parallel_for(n, one);
  }
}

}  // namespace

extern "C" {

int lora_sgmv(const float* x, int64_t ldx, float* y, int64_t ldy, int64_t K, const int64_t* part_widths,
              int64_t num_parts, const int64_t* segments, int64_t num_segments, const int64_t* a, const int64_t* b,
              const int64_t* ranks, int64_t dtype) {
  if (num_parts < 1 || num_parts > PAGEDLLM_LORA_MAX_PARTS) return -1;
  if (dtype != PAGEDLLM_LORA_F32 && dtype != PAGEDLLM_LORA_BF16) return -1;
  for (int64_t p = 0; p < num_parts; ++p)
    if (part_widths[p] < 0) return -1;
  for (int64_t s = 0; s < num_segments; ++s) {
    if (segments[2 * s] < 0 || segments[2 * s + 1] < segments[2 * s]) return -1;
    int64_t R = 0;
    for (int64_t p = 0; p < num_parts; ++p) {
      const int64_t r = ranks[s * PAGEDLLM_LORA_MAX_PARTS + p];
      if (r < 0 || r > PAGEDLLM_LORA_MAX_RANK) return -1;
      R += r;
    }
    if (R > PAGEDLLM_LORA_MAX_RANK) return -1;
  }
  const Call c{x, ldx, y, ldy, K, part_widths, num_parts};
  if (dtype == PAGEDLLM_LORA_BF16)
    run<uint16_t>(c, segments, num_segments, a, b, ranks);
  else
    run<float>(c, segments, num_segments, a, b, ranks);
  return 0;
}

}  // extern "C"

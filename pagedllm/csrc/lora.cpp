// LoRA updates of many adapters in one call (Punica's SGMV: segmented gather matrix-vector):
// per run of tokens of one adapter, y += (x A^T) B^T, the shrink into the adapter's rank R
// (kept in registers, R <= PAGEDLLM_LORA_MAX_RANK), then the expand into the N outputs.
// Why one call: in PyTorch a run costs two matmuls and their dispatch per projection, and a
// decode step of 16 adapters has 16 runs in each of its projections (docs/benchmarks.md).
// Each token's update reads only its own row: results do not depend on the rest of the batch.
#include <stdint.h>

#include "pagedllm_abi.h"
#include "parallel.h"
#include "vec.h"

using namespace vec;

namespace {

constexpr int64_t kParallelTokens = 16;  // fewer tokens: one thread (a parallel region costs more)
constexpr int64_t kChunks = PAGEDLLM_LORA_MAX_RANK / 16;

// y[N] += (x[K] A^T) B^T for one token; a_t [K, R], b_t [R, N] row-major.
void lora_token(const float* x, float* y, const float* a_t, const float* b_t, int64_t K, int64_t N, int64_t R) {
  F32x16 acc[kChunks];
  const int64_t chunks = (R + 15) / 16;
  for (int64_t c = 0; c < chunks; ++c) acc[c] = zero();
  for (int64_t k = 0; k < K; ++k) {
    const F32x16 xk = set1(x[k]);
    const float* row = a_t + k * R;
    for (int64_t c = 0; c < chunks; ++c) acc[c] = fma(xk, load_first(row + 16 * c, R - 16 * c), acc[c]);
  }
  alignas(64) float h[PAGEDLLM_LORA_MAX_RANK];
  for (int64_t c = 0; c < chunks; ++c) store(h + 16 * c, acc[c]);
  for (int64_t n = 0; n < N; n += 16) {
    F32x16 out = load_first(y + n, N - n);
    for (int64_t r = 0; r < R; ++r) out = fma(set1(h[r]), load_first(b_t + r * N + n, N - n), out);
    store_first(y + n, out, N - n);
  }
}

}  // namespace

extern "C" {

int lora_sgmv(const float* x, int64_t ldx, float* y, int64_t ldy, int64_t K, int64_t N, const int64_t* segments,
              int64_t num_segments, const int64_t* a_t, const int64_t* b_t, const int64_t* ranks) {
  int64_t tokens = 0;
  for (int64_t s = 0; s < num_segments; ++s) {
    if (ranks[s] < 0 || ranks[s] > PAGEDLLM_LORA_MAX_RANK || segments[2 * s + 1] < segments[2 * s]) return -1;
    tokens += segments[2 * s + 1] - segments[2 * s];
  }
  // Token i of the call: the segment it falls in, by a walk (segments are few).
  par::parallel_for(tokens, [&](int64_t i) {
    int64_t s = 0, first = 0;
    while (i >= first + segments[2 * s + 1] - segments[2 * s]) first += segments[2 * s + 1] - segments[2 * s], ++s;
    if (ranks[s] == 0) return;
    const int64_t t = segments[2 * s] + i - first;
    lora_token(x + t * ldx, y + t * ldy, reinterpret_cast<const float*>(a_t[s]), reinterpret_cast<const float*>(b_t[s]),
               K, N, ranks[s]);
  }, kParallelTokens);
  return 0;
}

}  // extern "C"

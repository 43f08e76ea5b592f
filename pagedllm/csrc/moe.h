// What fused_moe (moe.cpp) covers, for callers that must check before writing anything
// (decoder.cpp's decode_layers).
#pragma once

#include <stdint.h>

#include "kquant.h"
#include "pagedllm_abi.h"

// Whether `m` is a block fused_moe runs: top_k in [1, num_experts], a float32 router of
// [num_experts, hidden], and every expert's layers of a known kind and of their shapes (GGUF
// blocks: of types and sizes the K-quant GEMM takes, as stored or in panels, kquant::fits).
inline bool moe_supported(const MoeDesc& m) {
  auto fits = [](const LinearDesc& l, int64_t n, int64_t k) {
    if (l.kind < 0 || l.kind >= PAGEDLLM_LINEAR_KINDS || l.n != n || l.k != k || !l.w) return false;
    if (l.kind != PAGEDLLM_LINEAR_KQUANT) return true;
    const KQuantWeight& w = *static_cast<const KQuantWeight*>(l.w);
    return kquant::fits(w, n, k) || kquant::fits(w, n, k, true);
  };
  if (m.num_experts < 1 || m.top_k < 1 || m.top_k > m.num_experts || m.hidden < 1 || m.intermediate < 1) return false;
  if (m.router.kind != PAGEDLLM_LINEAR_F32 || !fits(m.router, m.num_experts, m.hidden)) return false;
  for (int64_t e = 0; e < m.num_experts; ++e)
    if (!fits(m.gate_up[e], 2 * m.intermediate, m.hidden) || !fits(m.down[e], m.hidden, m.intermediate)) return false;
  return true;
}

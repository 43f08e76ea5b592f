// A mixture-of-experts block (Mixtral, Qwen3-MoE) in one call: router logits, softmax and
// top-k per token, the step's tokens grouped by expert, each active expert's gate/up GEMM,
// SiLU-and-mul and down GEMM on its own tokens only, and the weighted sum back per token.
//
// Contract (MoeDesc in pagedllm_abi.h): x [T, hidden] float32 (row stride ldx) -> y [T,
// hidden] float32. Per token t: p = softmax(router x_t) over all experts; the top_k experts
// by p (the lower index first among equal ones), weights p_e, divided by their sum when
// `renormalize`; y_t = sum over its experts, in ascending expert order, of
// w_e * down_e(silu(gate_e x_t) * up_e x_t). Experts may mix the GEMM kinds: float32, w8a8,
// w4a8 and q8a8 panels (linear.cpp's formats, the same micro-kernels, gemm.h) and GGUF blocks as stored
// (Q4_K, Q5_K, Q6_K, Q8_0, Q5_0, a fused gate/up's parts each in its own format: kquant.cpp's
// layers, the same tiles, kquant.h), or repacked into panels (kquant_panels.h). An int8 expert quantizes its inputs per row and group of
// 32 as its layer alone does, so an expert computes for a token exactly what its layer alone
// would. A token's output depends only on that token (rows never mix, and its sum runs in
// expert order): results are batch-invariant.
//
// Work split over the threads. Tokens are sorted by expert into R = T * top_k rows (an
// expert's rows consecutive, in token order). The gate/up GEMM is then ONE parallel loop over
// work items, each item one slice of one active expert's weight over a chunk of that expert's
// rows (chunks sized so the rows' activations stay in L2): a 32-column panel for the packed
// kinds and GGUF blocks in panels (what the layers hold, kquant_panels.h), a span of 16 weight
// rows for GGUF blocks as stored (kquant.h's unit). Items are claimed one at
// a time by the thread team (parallel.h), so no thread owns an expert. The down GEMM is a
// second such loop.
//
// A batch-1 decode step that touches 8 experts (Qwen3-30B-A3B: hidden H = 2048, expert
// intermediate I = 768, top-8 of 128) thus runs:
//   1. the router GEMV [128, 2048] (float32, split over its 4 panels) and the top-8 choice;
//   2. the token's row copied 8 times (one row per expert), each copy quantized per kind in use;
//   3. one loop over 8 * 2I / 32 = 384 gate/up items of Q4_K panels, each 32 rows x 2048
//      weights = 36 KiB of blocks (768 items of 16 rows for blocks as stored);
//   4. SiLU-and-mul on the 8 rows (one thread: under 64 rows), their quantization;
//   5. one loop over 8 * H / 32 = 512 down items (1024 as stored), each 32 rows x 768 weights
//      (Q6_K: 19.7 KiB);
//   6. the weighted sum of the 8 rows into y.
// With 16 threads each thread streams about 1/16 of the 8 experts' weights, each weight byte
// read once, and the step waits on 2 parallel loops for the experts (plus the router's), not
// 16 (and in each only for items a thread claimed).
// Experts that got no token cost nothing; prefill batches reuse each panel or span over an
// expert's rows chunk as the dense GEMMs do.
#include <stdint.h>

#include <algorithm>
#include <cmath>
#include <initializer_list>
#include <vector>

#include "aligned.h"
#include "gemm.h"
#include "kquant.h"
#include "kquant_panels.h"
#include "moe.h"
#include "pagedllm_abi.h"
#include "parallel.h"

using namespace gemm;

namespace {

constexpr int64_t kParallelRows = 64;  // fewer rows: their elementwise passes run on one thread

// Whether a KQUANT layer's blocks are kquant_pack_panels' panels (else as stored).
bool is_panels(const LinearDesc& l) {
  return (static_cast<const KQuantWeight*>(l.w)->parts[0].type & PAGEDLLM_KQUANT_PANELS) != 0;
}

// R rows of K floats (stride ld) in every form the active experts' kinds read: the floats,
// gemm.h's quantize_rows codes for tile_w8a8 (w8) and tile_q4a8 (q4), and kquant.h's for
// GGUF blocks as stored (kqx) or in panels (kp: for the `panels` weights), each empty where
// no active expert takes it.
struct Acts {
  const float* f32;
  int64_t ld, K, G, kq;
  QuantizedRows w8, q4;
  kquant::QuantizedX kqx;
  kquant::PanelActs kp;

  Acts(const float* x, int64_t ld_, int64_t R, int64_t K_, bool need_w8, bool need_q4, bool need_kq,
       const std::vector<const KQuantWeight*>& panels)
      : f32(x),
        ld(ld_),
        K(K_),
        G((K_ + QG - 1) / QG),
        kq((K_ + QG - 1) / QG * QG / 4),
        w8(need_w8 ? quantize_rows<false>(x, ld_, R, K_) : QuantizedRows{}),
        q4(need_q4 ? quantize_rows<true>(x, ld_, R, K_) : QuantizedRows{}),
        kqx(need_kq ? kquant::QuantizedX(x, ld_, R, K_) : kquant::QuantizedX{}),
        kp(panels.empty() ? kquant::PanelActs{} : kquant::PanelActs(x, ld_, R, K_, panels)) {}
};

// One work item: of expert `expert`'s layer, one 32-column panel `panel` (packed kinds), one
// span of up to 16 weight rows (GGUF blocks as stored) or of a 32-row panel's rows (GGUF
// blocks in panels), over its rows [row0, row0 + rows).
struct Item {
  int64_t expert, row0, rows, panel;
  kquant::Span span;
};

// y[row0.., the item's panel or span columns] (row stride ldy) for one item of layer l.
void run_item(const LinearDesc& l, const Acts& a, const Item& it, float* y, int64_t ldy) {
  if (l.kind == PAGEDLLM_LINEAR_KQUANT) {
    const KQuantPart& part = static_cast<const KQuantWeight*>(l.w)->parts[it.span.part];
    if (is_panels(l))
      kquant::panel_times_x(part, it.span, a.K, a.kp, it.row0, it.rows, l.bias, y, ldy);
    else
      kquant::rows_times_x(part, it.span.n0, it.span.n1, it.span.col, a.K, a.kqx, it.row0, it.rows, l.bias, y, ldy);
    return;
  }
  const int64_t p = it.panel, ncols = std::min(NB, l.n - p * NB), G = a.G, kq = a.kq;
  const float* bias = l.bias ? l.bias + p * NB : nullptr;
  float* out = y + it.row0 * ldy + p * NB;
  switch (l.kind) {
    case PAGEDLLM_LINEAR_F32: {
      const float* panel = static_cast<const float*>(l.w) + p * a.K * NB;
      panel_rows<kGemmRowsF32>(it.rows, [&](auto r, int64_t m) {
        tile_f32<decltype(r)::value>(a.f32 + (it.row0 + m) * a.ld, a.ld, panel, a.K, bias, out + m * ldy, ldy, ncols);
      });
      break;
    }
    case PAGEDLLM_LINEAR_W8A8: {
      const int8_t* panel = static_cast<const int8_t*>(l.w) + p * kq * 4 * NB;
      panel_rows<kGemmRowsI8>(it.rows, [&](auto r, int64_t m) {
        const int64_t row = it.row0 + m;
        tile_w8a8<decltype(r)::value, true>(a.w8.codes.data() + row * kq, kq, a.w8.scale.data() + row * G, panel, G,
                                            a.w8.xsum128.data() + row * G, l.wscale + p * NB, bias, out + m * ldy, ldy,
                                            ncols);
      });
      break;
    }
    case PAGEDLLM_LINEAR_Q8A8: {
      const int8_t* panel = static_cast<const int8_t*>(l.w) + p * kq * 4 * NB;
      const uint16_t* d = reinterpret_cast<const uint16_t*>(l.wscale) + p * G * NB;
      panel_rows<kGemmRowsI8>(it.rows, [&](auto r, int64_t m) {
        const int64_t row = it.row0 + m;
        tile_w8a8<decltype(r)::value, false>(a.w8.codes.data() + row * kq, kq, a.w8.scale.data() + row * G, panel, G,
                                             a.w8.xsum128.data() + row * G, d, bias, out + m * ldy, ldy, ncols);
      });
      break;
    }
    default: {  // Q4A8, Q4A8_SYMMETRIC
      with_flag(l.kind == PAGEDLLM_LINEAR_Q4A8_SYMMETRIC, [&]<bool kSymmetric>() {
        const uint8_t* panel = static_cast<const uint8_t*>(l.w) + p * G * q4_group_bytes(kSymmetric);
        panel_rows<kGemmRowsQ4>(it.rows, [&](auto r, int64_t m) {
          const int64_t at = (it.row0 + m) * G;
          tile_q4a8<decltype(r)::value, kSymmetric>(a.q4.codes.data() + (it.row0 + m) * kq, kq, a.q4.scale.data() + at,
                                                    a.q4.sum.data() + at, a.q4.csum.data() + at, panel, G, bias,
                                                    out + m * ldy, ldy, ncols);
        });
      });
    }
  }
}

// y [R, layers[e].n] = each active expert's layer over its rows [start[e], start[e + 1]) of
// `a`, all experts' panels in one parallel loop (the header comment's split).
void grouped_gemm(const LinearDesc* layers, const std::vector<int64_t>& start, const Acts& a, float* y, int64_t ldy) {
  std::vector<Item> items;
  const int64_t E = static_cast<int64_t>(start.size()) - 1;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t count = start[e + 1] - start[e];
    if (count == 0) continue;
    const LinearDesc& l = layers[e];
    if (l.kind == PAGEDLLM_LINEAR_KQUANT) {
      const bool panels = is_panels(l);
      const std::vector<kquant::Span> spans =
          kquant::spans_of(*static_cast<const KQuantWeight*>(l.w), panels ? kquant::PANEL : kquant::SPAN);
      const int64_t chunk = panels ? kquant::panel_chunk_rows(count, a.kq) : kquant::chunk_rows(a.kqx.kp);
      for (int64_t r0 = 0; r0 < count; r0 += chunk)
        for (const kquant::Span& span : spans) items.push_back({e, start[e] + r0, std::min(chunk, count - r0), 0, span});
      continue;
    }
    const int64_t chunk = l.kind == PAGEDLLM_LINEAR_F32 ? chunk_rows_f32(a.K) : chunk_rows_i8(a.kq);
    const int64_t panels = (l.n + NB - 1) / NB;
    for (int64_t r0 = 0; r0 < count; r0 += chunk)
      for (int64_t p = 0; p < panels; ++p) items.push_back({e, start[e] + r0, std::min(chunk, count - r0), p, {}});
  }
  const int64_t n = static_cast<int64_t>(items.size());
  par::parallel_for(n, [&](int64_t i) { run_item(layers[items[i].expert], a, items[i], y, ldy); }, 2, 1);
}

// Whether an active expert's layer is of one of `kinds` (KQUANT: GGUF blocks as stored, not in
// panels).
bool any_kind(const LinearDesc* layers, const std::vector<int64_t>& start, std::initializer_list<int64_t> kinds) {
  for (size_t e = 0; e + 1 < start.size(); ++e) {
    const int64_t kind = layers[e].kind;
    if (start[e + 1] > start[e] && std::find(kinds.begin(), kinds.end(), kind) != kinds.end() &&
        (kind != PAGEDLLM_LINEAR_KQUANT || !is_panels(layers[e])))
      return true;
  }
  return false;
}

// The active experts' layers of GGUF blocks in panels.
std::vector<const KQuantWeight*> active_panels(const LinearDesc* layers, const std::vector<int64_t>& start) {
  std::vector<const KQuantWeight*> w;
  for (size_t e = 0; e + 1 < start.size(); ++e)
    if (start[e + 1] > start[e] && layers[e].kind == PAGEDLLM_LINEAR_KQUANT && is_panels(layers[e]))
      w.push_back(static_cast<const KQuantWeight*>(layers[e].w));
  return w;
}

}  // namespace

extern "C" {

// See the header comment. Returns 0, or -1 with nothing written (moe_supported fails).
int fused_moe(const MoeDesc* m, const float* x, int64_t ldx, int64_t T, float* y) {
  if (!moe_supported(*m)) return -1;
  const int64_t E = m->num_experts, k = m->top_k, H = m->hidden, I = m->intermediate, R = T * k;
  if (T == 0) return 0;

  // Router logits, then per token its top_k experts (ascending expert order) and weights.
  std::vector<float> logits(T * E);
  linear_f32(x, ldx, static_cast<const float*>(m->router.w), m->router.bias, logits.data(), T, E, H);
  std::vector<int64_t> choice(R);
  std::vector<float> weight(R);
  par::parallel_for(T, [&](int64_t t) {
    const float* l = logits.data() + t * E;
    int64_t* c = choice.data() + t * k;
    float* w = weight.data() + t * k;
    for (int64_t j = 0; j < k; ++j) c[j] = -1;
    for (int64_t e = 0; e < E; ++e) {  // insertion into the k best so far, by logit (softmax is monotonic)
      int64_t j = k;
      while (j > 0 && (c[j - 1] < 0 || l[e] > l[c[j - 1]])) --j;
      if (j == k) continue;
      for (int64_t i = k - 1; i > j; --i) c[i] = c[i - 1];
      c[j] = e;
    }
    const float top = l[c[0]];
    float all = 0.f, kept = 0.f;
    for (int64_t e = 0; e < E; ++e) all += std::exp(l[e] - top);
    for (int64_t j = 0; j < k; ++j) kept += (w[j] = std::exp(l[c[j]] - top));
    const float denominator = m->renormalize ? kept : all;
    for (int64_t j = 0; j < k; ++j) w[j] /= denominator;
    for (int64_t j = 1; j < k; ++j)  // ascending expert order: the order the outputs are summed in
      for (int64_t i = j; i > 0 && c[i - 1] > c[i]; --i) std::swap(c[i - 1], c[i]), std::swap(w[i - 1], w[i]);
  }, kParallelRows);

  // Rows sorted by expert: start[e] .. start[e + 1] are expert e's, in token order.
  std::vector<int64_t> start(E + 1, 0), row_of(R), token_of(R);
  for (int64_t s = 0; s < R; ++s) ++start[choice[s] + 1];
  for (int64_t e = 0; e < E; ++e) start[e + 1] += start[e];
  std::vector<int64_t> next(start.begin(), start.end() - 1);
  for (int64_t s = 0; s < R; ++s) token_of[row_of[s] = next[choice[s]]++] = s / k;

  aligned::vector<float> xs(R * H), h(R * 2 * I), out(R * H);
  par::parallel_for(
      R, [&](int64_t r) { std::copy(x + token_of[r] * ldx, x + token_of[r] * ldx + H, xs.data() + r * H); },
      kParallelRows);
  {
    const Acts a(xs.data(), H, R, H,
                 any_kind(m->gate_up, start, {PAGEDLLM_LINEAR_W8A8, PAGEDLLM_LINEAR_Q8A8}),
                 any_kind(m->gate_up, start, {PAGEDLLM_LINEAR_Q4A8, PAGEDLLM_LINEAR_Q4A8_SYMMETRIC}),
                 any_kind(m->gate_up, start, {PAGEDLLM_LINEAR_KQUANT}),
                 active_panels(m->gate_up, start));
    grouped_gemm(m->gate_up, start, a, h.data(), 2 * I);
  }
  silu_and_mul(h.data(), 2 * I, R, I);
  {
    const Acts a(h.data(), 2 * I, R, I,
                 any_kind(m->down, start, {PAGEDLLM_LINEAR_W8A8, PAGEDLLM_LINEAR_Q8A8}),
                 any_kind(m->down, start, {PAGEDLLM_LINEAR_Q4A8, PAGEDLLM_LINEAR_Q4A8_SYMMETRIC}),
                 any_kind(m->down, start, {PAGEDLLM_LINEAR_KQUANT}),
                 active_panels(m->down, start));
    grouped_gemm(m->down, start, a, out.data(), H);
  }

  // y_t = sum of its experts' outputs, weighted, in ascending expert order.
  par::parallel_for(T, [&](int64_t t) {
    for (int64_t i = 0; i < H; i += 16) {
      F32x16 acc = zero();
      for (int64_t j = 0; j < k; ++j)
        acc = fma(set1(weight[t * k + j]), load_first(out.data() + row_of[t * k + j] * H + i, H - i), acc);
      store_first(y + t * H + i, acc, H - i);
    }
  }, kParallelRows);
  return 0;
}

}  // extern "C"

// A whole decoder over one step's tokens in one call: decodes, speculative verification (each
// of its rows a decode query over the keys up to its position) and prefill chunks side by side;
// Llama, SmolLM2, Qwen2/3, Mistral, Phi-3, their mixtures of experts and Gemma 3. Per layer:
// residual add + RMSNorm, the fused q/k/v GEMM, the q/k head norms (Gemma 3), RoPE, the K/V
// write, paged decode attention (with the layer's sliding window), paged prefill attention
// (causal, from each request's offset) for the prompt chunks,
// o_proj (and its norm, Gemma 3), residual add + RMSNorm, gate/up GEMM, SiLU- or GELU-and-mul,
// down_proj (and its norm, Gemma 3), or a mixture-of-experts block in their place (moe.cpp);
// then the final norm. It calls the same kernels, in the same order and on the same inputs,
// as the models' Python modules do one call at a time, so its outputs are theirs bit for bit.
// Why: at batch 1 a step is some 300 small kernels, and the Python and ctypes around each
// call cost about as much as the kernel; one call per step removes that, as llama.cpp's graph
// does (figures: docs/benchmarks.md, "where a small GEMV's time goes"). A speculative
// verification step of 1 + k tokens is as small, and a busy server's steps mix decodes with
// prefill chunks: both run here too. A step with LoRA adapters adds each projection's updates
// right after its GEMM (lora_sgmv), as the modules' LoRA layers do.
#include <stdint.h>

#include <algorithm>
#include <chrono>

#include "aligned.h"
#include "head_dims.h"
#include "moe.h"
#include "pagedllm_abi.h"

namespace {

// y = layer l of x's M rows; rows from prompt_from on are prompt tokens (pagedllm_abi.h's linear_q4a8).
void linear(const LinearDesc& l, const float* x, int64_t ldx, float* y, int64_t M, int64_t prompt_from) {
  switch (l.kind) {
    case PAGEDLLM_LINEAR_F32:
      linear_f32(x, ldx, static_cast<const float*>(l.w), l.bias, y, M, l.n, l.k);
      break;
    case PAGEDLLM_LINEAR_W8A8:
      linear_w8a8(x, ldx, static_cast<const int8_t*>(l.w), l.wscale, l.bias, y, M, l.n, l.k, prompt_from);
      break;
    case PAGEDLLM_LINEAR_Q4A8:
    case PAGEDLLM_LINEAR_Q4A8_SYMMETRIC:
      linear_q4a8(x, ldx, static_cast<const uint8_t*>(l.w), l.bias, y, M, l.n, l.k,
                  l.kind == PAGEDLLM_LINEAR_Q4A8_SYMMETRIC, prompt_from);
      break;
    case PAGEDLLM_LINEAR_Q8A8:
      linear_q8a8(x, ldx, static_cast<const int8_t*>(l.w), reinterpret_cast<const uint16_t*>(l.wscale), l.bias, y, M,
                  l.n, l.k, prompt_from);
      break;
    default:
      linear_kquant(x, ldx, static_cast<const KQuantWeight*>(l.w), l.bias, y, M, l.n, l.k, prompt_from);
  }
}

// y += the step's LoRA updates of layer i's projection p, its outputs in `num_parts` parts of
// `widths` (nothing without adapters).
void lora(const DecoderDesc* m, int64_t i, int64_t p, const float* x, int64_t ldx, float* y, int64_t ldy, int64_t K,
          const int64_t* widths, int64_t num_parts) {
  const LoRAStep* s = m->lora;
  if (s == nullptr) return;
  const int64_t at = (4 * i + p) * s->num_runs;
  lora_sgmv(x, ldx, y, ldy, K, widths, num_parts, s->runs, s->num_runs, s->a + at, s->b + at,
            s->ranks + at * PAGEDLLM_LORA_MAX_PARTS, s->dtype);
}

// Rows per pass of a long step's MLP (gate/up, activation, down): the gate/up output of a
// pass (Qwen2.5-0.5B: 10 MiB at 256 rows) stays in the caches for the activation and the down
// GEMM instead of going out to memory and back (docs/benchmarks.md, session 24). A step of
// fewer than 2 * kMlpRows rows takes one pass; else equal passes of at least kMlpRows rows:
// every GEMM call then has more rows than the K-quant GEMM's switch to its prefill panels (8),
// from where every linear kind computes each row the same whatever rows share the call, so a
// row's bits are those of one call over all T rows.
constexpr int64_t kMlpRows = 256;

// Everything the kernels below could refuse, checked before anything is written.
bool supported(const DecoderDesc* m, int64_t P) {
  const int64_t D = m->head_dim, Hq = m->num_heads, Hkv = m->num_kv_heads;
  if (!head_dims::supported(D) || Hkv <= 0 || Hq % Hkv || Hq / Hkv > PAGEDLLM_MAX_GROUP) return false;
  if (m->rotary_dim <= 0 || m->rotary_dim > D || m->rotary_dim % 2) return false;
  if (P > 0 && m->block_size > PAGEDLLM_MAX_PREFILL_BLOCK) return false;
  if (m->cache_kind < PAGEDLLM_CACHE_F32 || m->cache_kind > PAGEDLLM_CACHE_FP8) return false;
  for (int64_t i = 0; i < m->num_layers; ++i) {
    const LayerDesc& layer = m->layers[i];
    if (layer.group < 0 || layer.group >= m->num_groups || layer.rope < 0 || layer.rope > 1) return false;
    if (layer.moe && !moe_supported(*layer.moe)) return false;
    for (const LinearDesc* l : {&layer.qkv, &layer.o, &layer.gate_up, &layer.down}) {
      if (layer.moe && (l == &layer.gate_up || l == &layer.down)) continue;
      if (l->kind < 0 || l->kind >= PAGEDLLM_LINEAR_KINDS) return false;
      const KQuantWeight* w = static_cast<const KQuantWeight*>(l->w);
      if (l->kind == PAGEDLLM_LINEAR_KQUANT && !kquant::fits(*w, l->n, l->k) && !kquant::fits(*w, l->n, l->k, true))
        return false;
    }
  }
  if (const LoRAStep* s = m->lora) {
    for (int64_t r = 0; r < s->num_runs; ++r)
      if (s->runs[2 * r] < 0 || s->runs[2 * r + 1] < s->runs[2 * r]) return false;
    if (s->dtype != PAGEDLLM_LORA_F32 && s->dtype != PAGEDLLM_LORA_BF16) return false;
    for (int64_t j = 0; j < 4 * m->num_layers * s->num_runs; ++j) {
      int64_t R = 0;
      for (int64_t p = 0; p < PAGEDLLM_LORA_MAX_PARTS; ++p) {
        const int64_t r = s->ranks[j * PAGEDLLM_LORA_MAX_PARTS + p];
        if (r < 0) return false;
        R += r;
      }
      if (R > PAGEDLLM_LORA_MAX_RANK) return false;
    }
  }
  return true;
}

// RMSNorm of each of `heads` heads of D floats in place, in each of B rows (stride ld).
void norm_heads(float* x, int64_t ld, int64_t B, int64_t heads, int64_t D, const float* weight, float eps) {
  for (int64_t b = 0; b < B; ++b) add_rms_norm(nullptr, x + b * ld, weight, x + b * ld, heads, D, eps);
}

// The parts DecoderDesc.profile times, in pagedllm_abi.h's order.
enum Part { kNorms, kQkv, kRope, kKvWrite, kAttention, kO, kGateUp, kAct, kDown, kMoe };

// Runs f; when the decoder is profiled, adds its wall time to the part's slot.
template <typename F>
inline void timed(const DecoderDesc* m, Part part, F f) {
  if (!m->profile) return f();
  const auto start = std::chrono::steady_clock::now();
  f();
  m->profile[part] += std::chrono::nanoseconds(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

extern "C" {

// The contract is pagedllm_abi.h's. Returns 0, or -1 with nothing written (an unknown
// linear kind, group or table, an attention shape, a rotary_dim or block size the kernels lack).
int decode_layers(const DecoderDesc* m, float* stream, const float* const* cos_sin, const StepGroup* groups,
                  const int64_t* seq_lens, const int64_t* spans, int64_t T, int64_t B, int64_t P,
                  int64_t prompt_from, float* out) {
  if (!supported(m, P)) return -1;
  if (const LoRAStep* s = m->lora)
    for (int64_t r = 0; r < s->num_runs; ++r)
      if (s->runs[2 * r + 1] > T) return -1;
  const int64_t H = m->hidden, D = m->head_dim, Hq = m->num_heads, Hkv = m->num_kv_heads;
  const int64_t q_width = Hq * D, kv_width = Hkv * D, qkv_width = q_width + 2 * kv_width, I = m->intermediate;
  const int64_t qkv_parts[3] = {q_width, kv_width, kv_width}, o_part[1] = {H}, gate_up_parts[2] = {I, I};
  // LoRA's runs address all T rows: with adapters the MLP takes one pass.
  const int64_t mlp_passes = m->lora ? 1 : std::max<int64_t>(1, T / kMlpRows), mlp_rows = (T + mlp_passes - 1) / mlp_passes;
  aligned::vector<float> normed(T * H), qkv(T * qkv_width), q(B * q_width), attn(T * q_width), y(T * H),
      gate_up(mlp_rows * 2 * I);
  using Attention = decltype(&paged_decode_attention_f32);
  const Attention attention = m->cache_kind == PAGEDLLM_CACHE_BF16   ? paged_decode_attention_bf16
                              : m->cache_kind == PAGEDLLM_CACHE_INT8 ? paged_decode_attention_int8
                              : m->cache_kind == PAGEDLLM_CACHE_FP8  ? paged_decode_attention_fp8
                                                                     : paged_decode_attention_f32;
  auto act_and_mul = m->gelu ? gelu_tanh_and_mul : silu_and_mul;
  for (int64_t i = 0; i < m->num_layers; ++i) {
    const LayerDesc& l = m->layers[i];
    const StepGroup& g = groups[l.group];
    timed(m, kNorms, [&] { add_rms_norm(i ? y.data() : nullptr, stream, l.input_norm, normed.data(), T, H, m->eps); });
    timed(m, kQkv, [&] {
      linear(l.qkv, normed.data(), H, qkv.data(), T, prompt_from);
      lora(m, i, 0, normed.data(), H, qkv.data(), qkv_width, H, qkv_parts, 3);
    });
    timed(m, kNorms, [&] {
      if (l.q_norm) norm_heads(qkv.data(), qkv_width, T, Hq, D, l.q_norm, m->eps);
      if (l.k_norm) norm_heads(qkv.data() + q_width, qkv_width, T, Hkv, D, l.k_norm, m->eps);
    });
    timed(m, kRope, [&] {
      rotary_inplace(qkv.data(), qkv_width, cos_sin[l.rope], T, Hq + Hkv, D, m->rotary_dim, l.qk_scale);
    });
    timed(m, kKvWrite, [&] {
      write_kv_cache(int(m->cache_kind), qkv.data() + q_width, qkv.data() + q_width + kv_width, qkv_width,
                     l.k_cache, l.v_cache, g.slots, T, Hkv, D);
    });
    timed(m, kAttention, [&] {
      if (B > 0) {
        for (int64_t b = 0; b < B; ++b)  // the kernel reads q as dense [B, Hq, D]
          std::copy(qkv.data() + b * qkv_width, qkv.data() + b * qkv_width + q_width, q.data() + b * q_width);
        attention(q.data(), l.k_cache, l.v_cache, g.block_tables, g.max_blocks, seq_lens, attn.data(), B, Hq, Hkv,
                  D, m->block_size, m->scale, l.window);
      }
      if (P > 0)
        paged_prefill_attention(int(m->cache_kind), qkv.data(), qkv_width, l.k_cache, l.v_cache,
                                g.prefill_block_tables, g.prefill_max_blocks, spans, spans + P, spans + 2 * P,
                                attn.data(), P, Hq, Hkv, D, m->block_size, m->scale, l.window);
    });
    timed(m, kO, [&] {
      linear(l.o, attn.data(), q_width, y.data(), T, prompt_from);
      lora(m, i, 1, attn.data(), q_width, y.data(), H, q_width, o_part, 1);
    });
    timed(m, kNorms, [&] {
      if (l.attn_out_norm) add_rms_norm(nullptr, y.data(), l.attn_out_norm, y.data(), T, H, m->eps);
      add_rms_norm(y.data(), stream, l.mlp_norm, normed.data(), T, H, m->eps);
    });
    if (l.moe) {
      timed(m, kMoe, [&] { fused_moe(l.moe, normed.data(), H, T, y.data()); });
    } else {
      for (int64_t m0 = 0; m0 < T; m0 += mlp_rows) {
        const int64_t rows = std::min(mlp_rows, T - m0);
        const float* x = normed.data() + m0 * H;
        timed(m, kGateUp, [&] {
          linear(l.gate_up, x, H, gate_up.data(), rows, prompt_from - m0);
          lora(m, i, 2, x, H, gate_up.data(), 2 * I, H, gate_up_parts, 2);
        });
        timed(m, kAct, [&] { act_and_mul(gate_up.data(), 2 * I, rows, I); });
        timed(m, kDown, [&] {
          linear(l.down, gate_up.data(), 2 * I, y.data() + m0 * H, rows, prompt_from - m0);
          lora(m, i, 3, gate_up.data(), 2 * I, y.data() + m0 * H, H, I, o_part, 1);
        });
      }
    }
    if (l.mlp_out_norm) timed(m, kNorms, [&] { add_rms_norm(nullptr, y.data(), l.mlp_out_norm, y.data(), T, H, m->eps); });
  }
  timed(m, kNorms, [&] { add_rms_norm(y.data(), stream, m->final_norm, out, T, H, m->eps); });
  return 0;
}

}  // extern "C"

// A whole decoder over a batch of decode tokens in one call: Llama, SmolLM2, Qwen2 and
// Gemma 3. Per layer: residual add + RMSNorm, the fused q/k/v GEMM, the q/k head norms
// (Gemma 3), RoPE, the K/V write, paged decode attention (with the layer's sliding window),
// o_proj (and its norm, Gemma 3), residual add + RMSNorm, gate/up GEMM, SiLU- or GELU-and-mul,
// down_proj (and its norm, Gemma 3); then the final norm. It calls the same kernels, in the
// same order and on the same inputs, as the models' Python modules do one call at a time, so
// its outputs are theirs bit for bit.
// Why: at batch 1 a step is ~300 small kernels (~10-40 us each), and the Python and ctypes
// around each call cost as much as the kernel (docs/benchmarks.md, "where a small GEMV's time
// goes"); one call per step removes that, as llama.cpp's graph does.
#include <stdint.h>

#include <algorithm>
#include <vector>

extern "C" {
int linear_w8a8(const float* x, int64_t ldx, const int8_t* packed, const float* wscale, const int32_t* wsum128,
                const float* bias, float* y, int64_t M, int64_t N, int64_t K);
int linear_q4a8(const float* x, int64_t ldx, const uint8_t* packed, const float* bias, float* y, int64_t M, int64_t N,
                int64_t K);
void linear_f32(const float* x, int64_t ldx, const float* packed, const float* bias, float* y, int64_t M, int64_t N,
                int64_t K);
void add_rms_norm(const float* x, float* residual, const float* weight, float* out, int64_t T, int64_t H, float eps);
void rotary_inplace(float* x, int64_t ldx, const float* cos_sin, int64_t T, int64_t heads, int64_t D);
void silu_and_mul(float* gate_up, int64_t ld, int64_t T, int64_t I);
void gelu_tanh_and_mul(float* gate_up, int64_t ld, int64_t T, int64_t I);
void write_kv_cache(int cache_bf16, const float* k, const float* v, int64_t ld, void* k_cache, void* v_cache,
                    const int64_t* slots, int64_t n, int64_t width);
int paged_decode_attention_bf16(const void* q, const void* k_cache, const void* v_cache, const int64_t* block_tables,
                                int64_t max_blocks, const int64_t* seq_lens, void* out, int64_t B, int64_t Hq,
                                int64_t Hkv, int64_t D, int64_t BS, float scale, int64_t window);
int paged_decode_attention_f32(const void* q, const void* k_cache, const void* v_cache, const int64_t* block_tables,
                               int64_t max_blocks, const int64_t* seq_lens, void* out, int64_t B, int64_t Hq,
                               int64_t Hkv, int64_t D, int64_t BS, float scale, int64_t window);

// One packed linear layer (kernels/ops.py LinearDesc): kind 0 float32 panels (w), 1 w8a8 (w
// int8 panels, wscale, wsum128), 2 w4a8 (w uint8 panels); bias null or padded to panels.
struct LinearDesc {
  int64_t kind, n, k;
  const void* w;
  const float* wscale;
  const int32_t* wsum128;
  const float* bias;
};

// One layer. Norm weights are [hidden] ([head_dim] for q_norm, k_norm); those marked
// "or null" are Gemma 3's and absent in Llama-family layers.
struct LayerDesc {
  const float* input_norm;     // before attention, the residual add fused in
  const float* mlp_norm;       // before the MLP, the residual add fused in
  const float* attn_out_norm;  // on o_proj's output, or null
  const float* mlp_out_norm;   // on down_proj's output, or null
  const float* q_norm;         // on each query head before RoPE, or null
  const float* k_norm;         // on each key head before RoPE, or null
  LinearDesc qkv, o, gate_up, down;
  void* k_cache;  // [blocks, block_size, Hkv, D], float32 or bfloat16 (DecoderDesc::cache_bf16)
  void* v_cache;
  int64_t window;  // attend to the last `window` keys; 0: all
  int64_t group;   // its KV cache group: which StepGroup holds its slots and block tables
  int64_t rope;    // which cos/sin table: 0 global, 1 local (Gemma 3's sliding layers)
};

struct DecoderDesc {
  int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size, cache_bf16;
  int64_t gelu;        // 0: SiLU-and-mul, 1: GELU (tanh)-and-mul
  int64_t num_groups;  // KV cache groups: the StepGroups passed
  float eps, scale;
  const LayerDesc* layers;
  const float* final_norm;
};

// One KV cache group's view of the step: slots [B], block tables [B, max_blocks], int64.
struct StepGroup {
  const int64_t* slots;
  const int64_t* block_tables;
  int64_t max_blocks;
};
}

namespace {

constexpr int64_t kMaxGroup = 8;  // paged_attention.cpp's: query heads per KV head

void linear(const LinearDesc& l, const float* x, int64_t ldx, float* y, int64_t M) {
  if (l.kind == 0) linear_f32(x, ldx, static_cast<const float*>(l.w), l.bias, y, M, l.n, l.k);
  else if (l.kind == 1) linear_w8a8(x, ldx, static_cast<const int8_t*>(l.w), l.wscale, l.wsum128, l.bias, y, M, l.n, l.k);
  else linear_q4a8(x, ldx, static_cast<const uint8_t*>(l.w), l.bias, y, M, l.n, l.k);
}

// Everything the kernels below could refuse, checked before anything is written.
bool supported(const DecoderDesc* m) {
  const int64_t D = m->head_dim, Hq = m->num_heads, Hkv = m->num_kv_heads;
  if ((D != 64 && D != 128 && D != 256) || Hkv <= 0 || Hq % Hkv || Hq / Hkv > kMaxGroup) return false;
  for (int64_t i = 0; i < m->num_layers; ++i) {
    const LayerDesc& layer = m->layers[i];
    if (layer.group < 0 || layer.group >= m->num_groups || layer.rope < 0 || layer.rope > 1) return false;
    for (const LinearDesc* l : {&layer.qkv, &layer.o, &layer.gate_up, &layer.down})
      if (l->kind < 0 || l->kind > 2) return false;
  }
  return true;
}

// RMSNorm of each of `heads` heads of D floats in place, in each of B rows (stride ld).
void norm_heads(float* x, int64_t ld, int64_t B, int64_t heads, int64_t D, const float* weight, float eps) {
  for (int64_t b = 0; b < B; ++b) add_rms_norm(nullptr, x + b * ld, weight, x + b * ld, heads, D, eps);
}

}  // namespace

extern "C" {

// stream: [B, hidden] float32, the (scaled) embeddings on entry, the residual stream on
// return; cos_sin: two [B, 2, D] tables (rotary_inplace's layout; global, local); groups:
// one StepGroup per KV cache group; seq_lens: [B] (keys per request, this token's included);
// out: [B, hidden], the final norm's output. Every request has one query token. Returns 0,
// or -1 with nothing written (an unknown linear kind, group or table, an attention shape
// the kernel lacks).
int decode_layers(const DecoderDesc* m, float* stream, const float* const* cos_sin, const StepGroup* groups,
                  const int64_t* seq_lens, int64_t B, float* out) {
  if (!supported(m)) return -1;
  const int64_t H = m->hidden, D = m->head_dim, Hq = m->num_heads, Hkv = m->num_kv_heads;
  const int64_t q_width = Hq * D, kv_width = Hkv * D, qkv_width = q_width + 2 * kv_width, I = m->intermediate;
  std::vector<float> normed(B * H), qkv(B * qkv_width), q(B * q_width), attn(B * q_width), y(B * H),
      gate_up(B * 2 * I);
  auto attention = m->cache_bf16 ? paged_decode_attention_bf16 : paged_decode_attention_f32;
  auto act_and_mul = m->gelu ? gelu_tanh_and_mul : silu_and_mul;
  for (int64_t i = 0; i < m->num_layers; ++i) {
    const LayerDesc& l = m->layers[i];
    const StepGroup& g = groups[l.group];
    add_rms_norm(i ? y.data() : nullptr, stream, l.input_norm, normed.data(), B, H, m->eps);
    linear(l.qkv, normed.data(), H, qkv.data(), B);
    if (l.q_norm) norm_heads(qkv.data(), qkv_width, B, Hq, D, l.q_norm, m->eps);
    if (l.k_norm) norm_heads(qkv.data() + q_width, qkv_width, B, Hkv, D, l.k_norm, m->eps);
    rotary_inplace(qkv.data(), qkv_width, cos_sin[l.rope], B, Hq + Hkv, D);
    write_kv_cache(m->cache_bf16, qkv.data() + q_width, qkv.data() + q_width + kv_width, qkv_width, l.k_cache,
                   l.v_cache, g.slots, B, kv_width);
    for (int64_t b = 0; b < B; ++b)  // the kernel reads q as dense [B, Hq, D]
      std::copy(qkv.data() + b * qkv_width, qkv.data() + b * qkv_width + q_width, q.data() + b * q_width);
    attention(q.data(), l.k_cache, l.v_cache, g.block_tables, g.max_blocks, seq_lens, attn.data(), B, Hq, Hkv, D,
              m->block_size, m->scale, l.window);
    linear(l.o, attn.data(), q_width, y.data(), B);
    if (l.attn_out_norm) add_rms_norm(nullptr, y.data(), l.attn_out_norm, y.data(), B, H, m->eps);
    add_rms_norm(y.data(), stream, l.mlp_norm, normed.data(), B, H, m->eps);
    linear(l.gate_up, normed.data(), H, gate_up.data(), B);
    act_and_mul(gate_up.data(), 2 * I, B, I);
    linear(l.down, gate_up.data(), 2 * I, y.data(), B);
    if (l.mlp_out_norm) add_rms_norm(nullptr, y.data(), l.mlp_out_norm, y.data(), B, H, m->eps);
  }
  add_rms_norm(y.data(), stream, m->final_norm, out, B, H, m->eps);
  return 0;
}

}  // extern "C"

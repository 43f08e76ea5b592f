// A whole Llama-family decoder (Llama, SmolLM2, Qwen2) over a batch of decode tokens in one
// call: per layer residual add + RMSNorm, the fused q/k/v GEMM, RoPE, the K/V write, paged
// decode attention, o_proj, residual add + RMSNorm, gate/up GEMM, SiLU-and-mul, down_proj;
// then the final norm. It calls the same kernels, in the same order and on the same inputs,
// as the model's Python modules do one call at a time, so its outputs are theirs bit for bit.
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

struct LayerDesc {
  const float* input_norm;
  const float* post_norm;
  LinearDesc qkv, o, gate_up, down;
  void* k_cache;  // [blocks, block_size, Hkv, D], float32 or bfloat16 (DecoderDesc::cache_bf16)
  void* v_cache;
};

struct DecoderDesc {
  int64_t num_layers, hidden, num_heads, num_kv_heads, head_dim, intermediate, block_size, cache_bf16;
  float eps, scale;
  const LayerDesc* layers;
  const float* final_norm;
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
  for (int64_t i = 0; i < m->num_layers; ++i)
    for (const LinearDesc* l : {&m->layers[i].qkv, &m->layers[i].o, &m->layers[i].gate_up, &m->layers[i].down})
      if (l->kind < 0 || l->kind > 2) return false;
  return true;
}

}  // namespace

extern "C" {

// stream: [B, hidden] float32, the embeddings on entry, the residual stream on return;
// cos_sin: [B, 2, D] (rotary_inplace's layout); slots: [B]; block_tables: [B, max_blocks];
// seq_lens: [B] (keys per request, this token's included); out: [B, hidden], the final
// norm's output. Every request has one query token. Returns 0, or -1 with nothing written
// (an unknown linear kind, an attention shape the kernel lacks).
int llama_decode(const DecoderDesc* m, float* stream, const float* cos_sin, const int64_t* slots,
                 const int64_t* block_tables, int64_t max_blocks, const int64_t* seq_lens, int64_t B, float* out) {
  if (!supported(m)) return -1;
  const int64_t H = m->hidden, D = m->head_dim, q_width = m->num_heads * D, kv_width = m->num_kv_heads * D;
  const int64_t qkv_width = q_width + 2 * kv_width, I = m->intermediate;
  std::vector<float> normed(B * H), qkv(B * qkv_width), q(B * q_width), attn(B * q_width), y(B * H),
      gate_up(B * 2 * I);
  auto attention = m->cache_bf16 ? paged_decode_attention_bf16 : paged_decode_attention_f32;
  for (int64_t i = 0; i < m->num_layers; ++i) {
    const LayerDesc& l = m->layers[i];
    add_rms_norm(i ? y.data() : nullptr, stream, l.input_norm, normed.data(), B, H, m->eps);
    linear(l.qkv, normed.data(), H, qkv.data(), B);
    rotary_inplace(qkv.data(), qkv_width, cos_sin, B, m->num_heads + m->num_kv_heads, D);
    write_kv_cache(m->cache_bf16, qkv.data() + q_width, qkv.data() + q_width + kv_width, qkv_width, l.k_cache,
                   l.v_cache, slots, B, kv_width);
    for (int64_t b = 0; b < B; ++b)  // the kernel reads q as dense [B, Hq, D]
      std::copy(qkv.data() + b * qkv_width, qkv.data() + b * qkv_width + q_width, q.data() + b * q_width);
    attention(q.data(), l.k_cache, l.v_cache, block_tables, max_blocks, seq_lens, attn.data(), B, m->num_heads,
              m->num_kv_heads, D, m->block_size, m->scale, 0);
    linear(l.o, attn.data(), q_width, y.data(), B);
    add_rms_norm(y.data(), stream, l.post_norm, normed.data(), B, H, m->eps);
    linear(l.gate_up, normed.data(), H, gate_up.data(), B);
    silu_and_mul(gate_up.data(), 2 * I, B, I);
    linear(l.down, gate_up.data(), 2 * I, y.data(), B);
  }
  add_rms_norm(y.data(), stream, m->final_norm, out, B, H, m->eps);
  return 0;
}

}  // extern "C"

/* The C interface of the native kernels: every function the library exports, every struct
 * passed across it and every limit, declared here and nowhere else. Each csrc/ translation
 * unit and the self-test include this file; pagedllm/kernels/abi.py binds Python to the
 * library by reading it. It is therefore written in the small subset of C that abi.py's
 * parser accepts (its docstring lists it): integer and brace-list #defines, typedef'd structs
 * with one type per declaration, and prototypes with named parameters, one per line or not.
 *
 * Layouts: tensors are row-major; "bf16" caches hold bfloat16 as uint16_t; every int64_t
 * array is contiguous. K/V caches are [blocks, block_size, Hkv, row] of a cache kind
 * (PAGEDLLM_CACHE_*): row = D values, or for the 8-bit kinds D one-byte codes followed by the
 * row's float16 scale (PAGEDLLM_KV_SCALE_BYTES; value = code * scale; csrc/kv_rows.h). Functions returning int return 0 on success and -1 (nothing written)
 * for a shape or kind they do not cover.
 */
#pragma once

#include <stdint.h>

/* Query heads per KV head the decode attention is instantiated for (1 .. this). */
#define PAGEDLLM_MAX_GROUP 8
/* Head sizes the decode and prefill attention are instantiated for. */
#define PAGEDLLM_HEAD_DIMS {64, 128, 256}
/* Room for PAGEDLLM_HEAD_DIMS in PagedllmLimits. */
#define PAGEDLLM_MAX_HEAD_DIMS 8
/* The largest KV block size (tokens) the prefill attention takes. */
#define PAGEDLLM_MAX_PREFILL_BLOCK 64
/* Output columns per packed GEMM panel. */
#define PAGEDLLM_PANEL 32
/* Input features per quantization group, of int8 weights and activations alike. */
#define PAGEDLLM_QUANT_GROUP 32
/* Bytes per panel and group of a w4a8 weight: 512 of nibbles, then d and m float16 [32]; of
 * a symmetric one (every m = -8 d: GGUF Q4_0), the nibbles and d. */
#define PAGEDLLM_Q4A8_GROUP_BYTES 640
#define PAGEDLLM_Q4A8_SYMMETRIC_GROUP_BYTES 576
/* LinearDesc.kind */
#define PAGEDLLM_LINEAR_F32 0
#define PAGEDLLM_LINEAR_W8A8 1
#define PAGEDLLM_LINEAR_Q4A8 2
#define PAGEDLLM_LINEAR_KQUANT 3
#define PAGEDLLM_LINEAR_Q8A8 4
#define PAGEDLLM_LINEAR_Q4A8_SYMMETRIC 5
/* Kinds are 0 .. PAGEDLLM_LINEAR_KINDS - 1. */
#define PAGEDLLM_LINEAR_KINDS 6
/* GGUF block formats the K-quant GEMM reads as the file stores them (ggml's type ids). */
#define PAGEDLLM_GGML_Q5_0 6
#define PAGEDLLM_GGML_Q8_0 8
#define PAGEDLLM_GGML_Q4_K 12
#define PAGEDLLM_GGML_Q5_K 13
#define PAGEDLLM_GGML_Q6_K 14
/* K/V cache kinds (cache_kind arguments, DecoderDesc.cache_kind). */
#define PAGEDLLM_CACHE_F32 0
#define PAGEDLLM_CACHE_BF16 1
#define PAGEDLLM_CACHE_INT8 2
#define PAGEDLLM_CACHE_FP8 3
/* Bytes after each head's D codes in an 8-bit cache's row: its float16 scale. */
#define PAGEDLLM_KV_SCALE_BYTES 2
/* Over an int8 cache, attention's softmax weights per tile of 16 keys become codes
   w * 127 / (the tile's largest); a tile whose largest is at most 2^this contributes nothing
   (127 / largest would leave float's range). */
#define PAGEDLLM_INT8_WEIGHT_FLOOR_EXP -120
/* Row blocks of other formats one K-quant weight may stack (a fused q/k/v). */
#define PAGEDLLM_KQUANT_MAX_PARTS 4
/* A KQuantPart type with this bit: its blocks are kquant_pack_panels' layout, not the file's. */
#define PAGEDLLM_KQUANT_PANELS 256
/* The largest summed LoRA rank of one projection's update (lora_sgmv). */
#define PAGEDLLM_LORA_MAX_RANK 512
/* Parts of one projection a LoRA update may have (a fused q/k/v: 3). */
#define PAGEDLLM_LORA_MAX_PARTS 3
/* Element types of LoRA A and B (lora_sgmv's dtype, LoRAStep.dtype). */
#define PAGEDLLM_LORA_F32 0
#define PAGEDLLM_LORA_BF16 1

#ifdef __cplusplus
extern "C" {
#endif

/* The limits above as this library was compiled with them (pagedllm_limits()). */
typedef struct PagedllmLimits {
  int64_t max_group;
  int64_t num_head_dims;
  int64_t head_dims[PAGEDLLM_MAX_HEAD_DIMS];
  int64_t max_prefill_block;
  int64_t panel;
  int64_t quant_group;
  int64_t q4a8_group_bytes;
} PagedllmLimits;

/* `rows` consecutive rows of a weight, each kquant_row_bytes(type, K) bytes of GGUF blocks
 * exactly as the file stores them; or, where type carries PAGEDLLM_KQUANT_PANELS, those rows
 * repacked by kquant_pack_panels. */
typedef struct KQuantPart {
  int64_t type;
  int64_t rows;
  const void* blocks;
} KQuantPart;

/* A K-quant weight [N, K]: its parts' rows stacked in order (N = their sum). */
typedef struct KQuantWeight {
  int64_t num_parts;
  KQuantPart parts[PAGEDLLM_KQUANT_MAX_PARTS];
} KQuantWeight;

/* One packed linear layer: kind PAGEDLLM_LINEAR_F32 (w: linear_pack_f32's panels),
 * PAGEDLLM_LINEAR_W8A8 (w, wscale: linear_pack_w8a8's), PAGEDLLM_LINEAR_Q4A8 (w:
 * linear_pack_q4a8's), PAGEDLLM_LINEAR_Q4A8_SYMMETRIC (w: linear_pack_q4a8's with m null,
 * run as linear_q4a8's symmetric), PAGEDLLM_LINEAR_KQUANT (w: a KQuantWeight) or PAGEDLLM_LINEAR_Q8A8
 * (w, wscale: linear_pack_q8_0's codes and float16 d); bias null or float32 padded to whole
 * panels. */
typedef struct LinearDesc {
  int64_t kind;
  int64_t n;
  int64_t k;
  const void* w;
  const float* wscale;
  const float* bias;
} LinearDesc;

/* A mixture-of-experts block (moe.cpp): a router [num_experts, hidden] (kind
 * PAGEDLLM_LINEAR_F32; its logits are softmaxed over all experts and the top_k kept,
 * renormalized to sum to 1 when `renormalize`), and per expert a gate/up layer
 * [2 intermediate, hidden] (gate rows first) and a down layer [hidden, intermediate], each of
 * any kind (KQUANT: GGUF blocks as stored, as linear_kquant takes them); `intermediate` is
 * this rank's share. */
typedef struct MoeDesc {
  int64_t num_experts;
  int64_t top_k;
  int64_t renormalize;
  int64_t hidden;
  int64_t intermediate;
  LinearDesc router;
  const LinearDesc* gate_up; /* [num_experts] */
  const LinearDesc* down;    /* [num_experts] */
} MoeDesc;

/* One decoder layer. Norm weights are [hidden] ([head_dim] for q_norm, k_norm); those marked
 * "or null" are Gemma 3's and absent in Llama-family layers. */
typedef struct LayerDesc {
  const float* input_norm;    /* before attention, the residual add fused in */
  const float* mlp_norm;      /* before the MLP, the residual add fused in */
  const float* attn_out_norm; /* on o_proj's output, or null */
  const float* mlp_out_norm;  /* on down_proj's output, or null */
  const float* q_norm;        /* on each query head before RoPE, or null */
  const float* k_norm;        /* on each key head before RoPE, or null */
  const float* qk_scale;      /* [Hq + Hkv, head_dim]: each q and k head times its row after RoPE, or null */
  LinearDesc qkv;
  LinearDesc o;
  LinearDesc gate_up;
  LinearDesc down;
  const MoeDesc* moe; /* a mixture of experts in place of gate_up and down, or null */
  void* k_cache; /* [blocks, block_size, Hkv, row] of DecoderDesc.cache_kind */
  void* v_cache;
  int64_t window; /* attend to the last `window` keys; 0: all */
  int64_t group;  /* its KV cache group: which StepGroup holds its slots and block tables */
  int64_t rope;   /* which cos/sin table: 0 global, 1 local (Gemma 3's sliding layers) */
} LayerDesc;

/* The parts of a decode_layers step that DecoderDesc.profile times (a projection's LoRA update
 * counted with its GEMM), in its order: the RMSNorms
 * (input, post-attention, q/k heads, sandwich and final), the q/k/v GEMM, RoPE, the K/V write,
 * attention (decode and prefill), the o GEMM, the gate/up GEMM, the gated activation, the down
 * GEMM, the mixture-of-experts blocks. */
#define PAGEDLLM_PROFILE_PARTS 10

/* A step's LoRA updates for decode_layers (lora_sgmv per projection): num_runs runs of
 * tokens, runs [num_runs, 2] (first, end); for layer i, projection p (0 qkv, 1 o, 2 gate_up,
 * 3 down) and run s, entry e = (4 i + p) num_runs + s of a and b (addresses of A and B as
 * lora_sgmv takes them) and row e of ranks [4 num_layers num_runs, PAGEDLLM_LORA_MAX_PARTS]
 * (the rank of each part: q, k, v; o; gate, up; down; 0: nothing added); dtype: A and B's
 * PAGEDLLM_LORA_*. */
typedef struct LoRAStep {
  int64_t num_runs;
  const int64_t* runs;
  const int64_t* a;
  const int64_t* b;
  const int64_t* ranks;
  int64_t dtype;
} LoRAStep;

/* A whole decoder: sizes, activation, KV cache groups, layers and final norm. */
typedef struct DecoderDesc {
  int64_t num_layers;
  int64_t hidden;
  int64_t num_heads;
  int64_t num_kv_heads;
  int64_t head_dim;
  int64_t rotary_dim; /* RoPE's leading dims of each q/k head (cos_sin's width): even, at most head_dim */
  int64_t intermediate;
  int64_t block_size;
  int64_t cache_kind; /* PAGEDLLM_CACHE_* */
  int64_t gelu;       /* 0: SiLU-and-mul, 1: GELU (tanh)-and-mul */
  int64_t num_groups; /* KV cache groups: the StepGroups passed */
  float eps;
  float scale;
  const LayerDesc* layers; /* [num_layers] */
  const float* final_norm;
  int64_t* profile; /* null, or [PAGEDLLM_PROFILE_PARTS]: nanoseconds per part, added by each call */
  const LoRAStep* lora; /* the step's LoRA updates, or null: none */
} DecoderDesc;

/* One KV cache group's view of a step of T tokens, B decodes first, then P multi-token
 * requests: slots [T]; the decodes' block tables [B, max_blocks]; the others' [P,
 * prefill_max_blocks] (null when P is 0). */
typedef struct StepGroup {
  const int64_t* slots;
  const int64_t* block_tables;
  int64_t max_blocks;
  const int64_t* prefill_block_tables;
  int64_t prefill_max_blocks;
} StepGroup;

/* --- what this library is (abi.cpp) --- */

/* The limits this library was compiled with. */
const PagedllmLimits* pagedllm_limits(void);
/* The CPU features (Linux /proc/cpuinfo names, space separated) this library's machine code
 * uses, read from the compiler's target macros: a CPU lacking one of them cannot load it. */
const char* pagedllm_requires(void);

/* --- decode and prefill attention (paged_attention.cpp, prefill_attention.cpp) --- */

/* q, out [B, Hq, D] float32; caches [blocks, BS, Hkv, row] float32 (_f32), bf16 (_bf16), int8
 * (_int8) or fp8 e4m3 (_fp8); block_tables [B, max_blocks]; seq_lens [B]; window > 0: only the
 * last `window` keys. */
int paged_decode_attention_bf16(const void* q, const void* k_cache, const void* v_cache, const int64_t* block_tables,
                                int64_t max_blocks, const int64_t* seq_lens, void* out, int64_t B, int64_t Hq,
                                int64_t Hkv, int64_t D, int64_t BS, float scale, int64_t window);
int paged_decode_attention_f32(const void* q, const void* k_cache, const void* v_cache, const int64_t* block_tables,
                               int64_t max_blocks, const int64_t* seq_lens, void* out, int64_t B, int64_t Hq,
                               int64_t Hkv, int64_t D, int64_t BS, float scale, int64_t window);
int paged_decode_attention_int8(const void* q, const void* k_cache, const void* v_cache, const int64_t* block_tables,
                                int64_t max_blocks, const int64_t* seq_lens, void* out, int64_t B, int64_t Hq,
                                int64_t Hkv, int64_t D, int64_t BS, float scale, int64_t window);
int paged_decode_attention_fp8(const void* q, const void* k_cache, const void* v_cache, const int64_t* block_tables,
                               int64_t max_blocks, const int64_t* seq_lens, void* out, int64_t B, int64_t Hq,
                               int64_t Hkv, int64_t D, int64_t BS, float scale, int64_t window);
/* q: rows of Hq * D float32 at stride ldq; caches of cache_kind; per request r < R its block
 * table, first query row, query count and keys after this step; out [rows, Hq * D], only
 * requests' rows written; window > 0: a query at p sees keys p - window + 1 .. p. */
int paged_prefill_attention(int cache_kind, const float* q, int64_t ldq, const void* k_cache, const void* v_cache,
                            const int64_t* block_tables, int64_t max_blocks, const int64_t* query_starts,
                            const int64_t* query_lens, const int64_t* seq_lens, float* out, int64_t R, int64_t Hq,
                            int64_t Hkv, int64_t D, int64_t BS, float scale, int64_t window);

/* --- GEMMs on packed weights (linear.cpp): y [M, N] = x [M, K] (row stride ldx) w.T + bias --- */

/* w [N, K] float32 -> panels [ceil(N/32)][K][32], zero padded. */
void linear_pack_f32(const float* w, float* packed, int64_t N, int64_t K);
void linear_f32(const float* x, int64_t ldx, const float* packed, const float* bias, float* y, int64_t M, int64_t N,
                int64_t K);
/* w [N, K] -> int8 codes symmetric per row (scale max|w| / 127, or rowmax / 127 where not
 * null: [N] float32) in the panels' byte encoding for this library's ISA, and the rows' scales. */
void linear_pack_w8a8(const float* w, const float* rowmax, int8_t* packed, float* wscale, int64_t N, int64_t K);
/* Rows prompt_from .. M - 1 of x: as linear_q4a8's below. */
void linear_w8a8(const float* x, int64_t ldx, const int8_t* packed, const float* wscale, const float* bias, float* y,
                 int64_t M, int64_t N, int64_t K, int64_t prompt_from);
/* q [N, K] 4-bit codes (uint8), d and m [N, ceil(K/32)] float16 -> w4a8 panels; m null: a
 * symmetric weight (every m = -8 d), whose panels hold no m. */
void linear_pack_q4a8(const uint8_t* q, const uint16_t* d, const uint16_t* m, uint8_t* packed, int64_t N, int64_t K);
/* symmetric: nonzero for panels packed with m null (every m = -8 d, GGUF Q4_0: the -8 is
 * applied to the integer sums). Rows prompt_from .. M - 1 of x are prompt tokens (pass M
 * for none): where gemm_amx runs they take Intel AMX tiles in bfloat16 (amx.h: x and the
 * weights rounded to bfloat16 instead of x quantized to int8), the other rows the int8 tiles.
 * Either way a row's result does not depend on the call's other rows. */
void linear_q4a8(const float* x, int64_t ldx, const uint8_t* packed, const float* bias, float* y, int64_t M, int64_t N,
                 int64_t K, int64_t symmetric, int64_t prompt_from);
/* The prompt rows of linear_w8a8, linear_q8a8, linear_q4a8 and linear_kquant on AMX, where
 * the CPU has AMX-BF16 and Linux grants the tiles (off until switched on; the Python loader
 * switches it on unless PAGEDLLM_DISABLE_AMX=1): mode 0 switches them off, 1 on, -1 leaves
 * them; returns 1 where they run now, else 0. */
int gemm_amx(int mode);
/* GGUF Q8_0 blocks [N][K/32] (K a multiple of 32) -> q8a8 panels: w8a8's codes and per group
 * of 32 k the columns' float16 d. Returns -1 (nothing written) where a code is -128 and this
 * library's int8 dot product cannot take it, else 0. */
int linear_pack_q8_0(const uint8_t* blocks, int8_t* packed, uint16_t* d, int64_t N, int64_t K);
/* Rows prompt_from .. M - 1 of x: as linear_q4a8's. */
void linear_q8a8(const float* x, int64_t ldx, const int8_t* packed, const uint16_t* d, const float* bias, float* y,
                 int64_t M, int64_t N, int64_t K, int64_t prompt_from);

/* --- GGUF blocks as stored (kquant.cpp) --- */

/* Bytes of one row of K weights in GGUF type `type`; 0 where the K-quant GEMM does not take
 * the type or K (Q4_K, Q5_K, Q6_K: K a multiple of 256; Q8_0, Q5_0: of 64). */
int64_t kquant_row_bytes(int64_t type, int64_t K);
/* y [M, N] = x [M, K] (row stride ldx) w.T + bias (null or float32 [>= N]), x quantized to
 * int8 per row and group of 32 once per call; the parts all as stored or all in panels (then
 * each row's bits do not depend on M, and rows prompt_from .. M - 1 are as linear_q4a8's;
 * as stored, prompt_from is not read). Returns -1 (nothing written) where a part's type or K
 * is not taken, the parts mix the two layouts, or their rows do not add up to N. */
int linear_kquant(const float* x, int64_t ldx, const KQuantWeight* w, const float* bias, float* y, int64_t M, int64_t N,
                  int64_t K, int64_t prompt_from);
/* `rows` rows of GGUF blocks of type `type` (kquant_row_bytes(type, K) bytes each) -> the
 * panels linear_kquant reads for every M where the part's type carries PAGEDLLM_KQUANT_PANELS
 * (kquant_panels.h): kquant_panel_bytes(type, rows, K) bytes (the blocks of rows rounded up
 * to 32). Returns -1 (nothing written) where that is 0, or a Q8_0 code is -128 and this
 * library's int8 dot product cannot take it; else 0. */
int64_t kquant_panel_bytes(int64_t type, int64_t rows, int64_t K);
int kquant_pack_panels(int64_t type, const void* blocks, int64_t rows, int64_t K, void* out);
/* out [R, K] float32 = the weights of rows[0..R) (null: rows 0..R-1) of a weight whose rows
 * are kquant_row_bytes(type, K) bytes of blocks; -1 (nothing written) where that is 0. */
int kquant_dequantize(int64_t type, const void* blocks, const int64_t* rows, int64_t R, int64_t K, float* out);

/* --- fused elementwise ops (elementwise.cpp) --- */

/* residual [T, H] += x (x may be null); out = RMSNorm(residual) * weight. */
void add_rms_norm(const float* x, float* residual, const float* weight, float* out, int64_t T, int64_t H, float eps);
/* RoPE in place on the leading R dims (R even, at most D) of T rows (stride ldx) of `heads`
 * heads of D, the rest unchanged; cos_sin [T, 2, R]; then each head times its row of scale
 * [heads, D] (null: none). */
void rotary_inplace(float* x, int64_t ldx, const float* cos_sin, int64_t T, int64_t heads, int64_t D, int64_t R,
                    const float* scale);
/* gate_up: T rows (stride ld) of [gate I, up I]; gate <- act(gate) * up in place. */
void silu_and_mul(float* gate_up, int64_t ld, int64_t T, int64_t I);
void gelu_tanh_and_mul(float* gate_up, int64_t ld, int64_t T, int64_t I);
/* k_cache[slots[t]] = k[t], v likewise (n rows of Hkv heads of D floats, stride ld), in the
 * cache's kind (8-bit: quantized per head with its scale); -1 (nothing written) for an unknown
 * kind, or an 8-bit one with D not a multiple of 16. */
int write_kv_cache(int cache_kind, const float* k, const float* v, int64_t ld, void* k_cache, void* v_cache,
                   const int64_t* slots, int64_t n, int64_t Hkv, int64_t D);
/* out[r] = the first index of the largest of x[r, 0..n). */
void argmax_rows(const float* x, int64_t rows, int64_t n, int64_t* out);

/* --- random sampling (sampling.cpp) --- */

/* out[r] = one token of row r of x [rows, n] (row stride ld), drawn at u[r] in (0, 1] from
 * softmax(x / temperature[r]) kept by top_k[r] (<= 0 or >= n: off), then top_p[r] of the top-k
 * mass (>= 1: off), then min_p[r] times the largest probability (0: off); temperature[r] > 0.
 * Rows with top-k or top-p draw most likely first, the others in vocabulary order; -inf
 * logits are never drawn; a row with no finite maximum gets 0. */
void sample_rows(const float* x, int64_t ld, int64_t rows, int64_t n, const float* temperature,
                 const int64_t* top_k, const float* top_p, const float* min_p, const float* u, int64_t* out);

/* --- penalties (penalties.cpp) --- */

/* In place on `rows` rows of logits x (row r at x + row_ids[r] * ld, n values), row r's token
 * history being tokens[offsets[r] .. offsets[r + 1]) (each in [0, n)), the first num_prompt[r]
 * its prompt's, the rest its output's: each distinct token's logit divided by repetition[r]
 * where positive, else multiplied by it (1: off); then each distinct output token's logit
 * minus frequency[r] times its count in the output, minus presence[r] (0 and 0: off). */
void apply_penalties(float* x, int64_t ld, int64_t rows, int64_t n, const int64_t* row_ids, const int32_t* tokens,
                     const int64_t* offsets, const int64_t* num_prompt, const float* repetition,
                     const float* presence, const float* frequency);

/* --- log-probabilities (logprobs.cpp) --- */

/* Per row r of x [rows, n] (row stride ld), lse = log sum exp x[r]: ids[r, 0] = token[r] and
 * logprobs[r, 0] = x[r, token[r]] - lse; ids[r, 1 + k], logprobs[r, 1 + k] for k < num_top
 * (<= n) the k-th largest logit's token and log-probability, largest first, equal logits by
 * lower id (ids, logprobs: [rows, num_top + 1]); rank[r] = the number of tokens with
 * x >= x[r, token[r]]. Rows of finite logits (-inf allowed, never all). */
void logprobs_rows(const float* x, int64_t ld, int64_t rows, int64_t n, const int64_t* token, int64_t num_top,
                   int64_t* ids, float* logprobs, int64_t* rank);

/* --- a mixture-of-experts block (moe.cpp) --- */

/* y [T, hidden] = the block of x [T, hidden] (row stride ldx): each token's top_k experts'
 * SwiGLU outputs, weighted by their router probabilities and summed. */
int fused_moe(const MoeDesc* m, const float* x, int64_t ldx, int64_t T, float* y);

/* --- LoRA (lora.cpp) --- */

/* For every token t of each segment s, the tokens [segments[2 s], segments[2 s + 1]) (rows of
 * x, stride ldx, K inputs; rows of y, stride ldy): y[t] += (x[t] A_s^T) B_s^T, where y's
 * outputs are num_parts parts of part_widths[p] columns each, one after another, and segment
 * s's part p has rank r = ranks[s PAGEDLLM_LORA_MAX_PARTS + p] (0: that part gets nothing).
 * a[s]: the address of A_s^T [K, R16] in panels of 16 columns ([R16 / 16, K, 16], each panel
 * row-major), R the summed rank and R16 it rounded up to 16: the parts' rank columns in
 * order, those past R read but unused. b[s]: the address of each part's B^T [r, N16] in
 * panels of 16 columns ([N16 / 16, r, 16]; N16: its width rounded up to 16, the columns past
 * it read but unused), the parts of rank > 0 one after another. dtype: A and B's element type,
 * PAGEDLLM_LORA_F32 or PAGEDLLM_LORA_BF16 (bfloat16 bits, widened exactly; the arithmetic is
 * float32). Returns -1 (nothing written) for a part count outside [1,
 * PAGEDLLM_LORA_MAX_PARTS], a negative width, a rank below 0 or a summed rank above
 * PAGEDLLM_LORA_MAX_RANK, a reversed segment or an unknown dtype. */
int lora_sgmv(const float* x, int64_t ldx, float* y, int64_t ldy, int64_t K, const int64_t* part_widths,
              int64_t num_parts, const int64_t* segments, int64_t num_segments, const int64_t* a, const int64_t* b,
              const int64_t* ranks, int64_t dtype);

/* --- a whole decoder step (decoder.cpp) --- */

/* A step of T tokens: B decodes (one token each) first, then P requests of several tokens
 * (speculative verification, then prefill chunks from row prompt_from: the prompt rows of
 * the int8 layers, as linear_q4a8's; T for none). stream [T, hidden]: embeddings in, residual
 * stream out; cos_sin: two [T, 2, rotary_dim] tables (global, local); groups: one per KV cache group;
 * seq_lens [B]: the decodes' keys; spans [3, P]: per multi-token request its first row, its
 * row count and its keys after the step (null when P is 0); out [T, hidden]: the final norm's
 * output. */
int decode_layers(const DecoderDesc* m, float* stream, const float* const* cos_sin, const StepGroup* groups,
                  const int64_t* seq_lens, const int64_t* spans, int64_t T, int64_t B, int64_t P,
                  int64_t prompt_from, float* out);

/* --- compute probes for bench roofline (probe.cpp): every OpenMP thread runs the loop --- */

/* Per thread n dependent integer adds (one per cycle): threads * n / seconds is the clock. */
int64_t probe_add_chain(int64_t n);
/* Per thread 8 n 16-lane float32 FMAs on independent chains: 256 n FLOP per thread. */
float probe_fma_f32(int64_t n);
/* Per thread 8 n vector-layer int8 dots on independent chains: 1024 n int8 OP per thread. */
int64_t probe_dot_i8(int64_t n);
/* Per thread 8 n int8 dots as probe_dot_i8's with `fmas` (0-4) float32 FMAs of their own after
 * every 8, on independent chains: where both issue on the same pipes the time is the sum of
 * each alone. Returns a lane of the result (-1 for fmas out of range). */
float probe_dot_fma_i8(int64_t n, int64_t fmas);

/* --- the kernels' thread team (parallel.cpp) --- */

/* Jobs the team has run split over threads since the library loaded (serial ones not counted). */
int64_t team_jobs(void);
/* n empty jobs of one chunk per thread on the team: what handing a job out and waiting for it
 * costs. Returns n. */
int64_t probe_team_handoff(int64_t n);

#ifdef __cplusplus
}
#endif

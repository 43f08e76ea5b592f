// The int8 formats' GEMMs for prompt rows on Intel AMX (the TMUL unit) in bfloat16: linear.cpp's
// linear_w8a8, linear_q8a8, linear_q4a8 and kquant.cpp's linear_kquant send them the rows from
// prompt_from on (prompt_rows, below) where the CPU has AMX-BF16, Linux grants this process the
// tile data and gemm_amx left it on (active()). Built into the avx512_bf16 variant only (every
// AMX CPU runs it); elsewhere active() is false and they are never called.
//
// Not the vector tiles' int8 product: x is rounded to bfloat16 (not quantized per group of 32
// to int8) and each weight to bfloat16 (w4a8's d q + m; q8a8's d q; a K-quant's ws (q + shift) +
// off; w8a8's code q, exact, its column's scale applied to the sum), their products summed in
// float32 over all of K in the tiles.
// The roundings are finer than int8 x's (a relative 2^-9 against up to 1/254 of the group's
// largest |x|), but the bits differ from the vector tiles', so which rows take them is a
// property of the token, not of the batch: a prompt's tokens, however they are chunked
// (after a prefix-cache hit too), and never decode or speculative rows. Why bfloat16 and not
// AMX's int8: x's scale per group of 32 would force a tile store per 16 x 16 x 32 product
// (docs/benchmarks.md, "Intel Xeon with AMX, session 39").
#pragma once

#include <stdint.h>

#include <algorithm>

#include "pagedllm_abi.h"

namespace amx {

// Whether the AMX path runs (these GEMMs, and prefill attention's bfloat16 scores): the CPU
// has AMX-TILE and AMX-BF16, Linux granted the tile data (arch_prctl ARCH_REQ_XCOMP_PERM,
// asked once per process), and gemm_amx switched it on.
// (Hidden, as parallel.h's: the library exports the header's C functions and nothing else.)
__attribute__((visibility("hidden"))) bool active();

// The tile shape every AMX user here takes (8 tiles of 16 rows x 64 bytes), loaded on the
// calling thread; stop_tiles gives the tile state back. Built where the GEMMs are (the
// avx512_bf16 variant); call only where active().
__attribute__((visibility("hidden"))) void start_tiles();
__attribute__((visibility("hidden"))) void stop_tiles();

// y = x w^T + bias (the operands of linear_w8a8, linear_q8a8, linear_q4a8, pagedllm_abi.h) for
// M >= 1 rows on AMX tiles, each row's result independent of the others; call only where active().
__attribute__((visibility("hidden"))) void linear_q4a8(const float* x, int64_t ldx, const uint8_t* packed,
                                                      const float* bias, float* y, int64_t M, int64_t N, int64_t K,
                                                      bool symmetric);
__attribute__((visibility("hidden"))) void linear_w8a8(const float* x, int64_t ldx, const int8_t* packed,
                                                      const float* wscale, const float* bias, float* y, int64_t M,
                                                      int64_t N, int64_t K);
__attribute__((visibility("hidden"))) void linear_q8a8(const float* x, int64_t ldx, const int8_t* packed,
                                                      const uint16_t* d, const float* bias, float* y, int64_t M,
                                                      int64_t N, int64_t K);
// linear_kquant's, for a weight whose every part is in panels (PAGEDLLM_KQUANT_PANELS).
__attribute__((visibility("hidden"))) void linear_kquant(const float* x, int64_t ldx, const KQuantWeight& w,
                                                        const float* bias, float* y, int64_t M, int64_t N, int64_t K);

// Rows prompt_from .. M - 1 of x (clamped to [0, M]; y's rows alike, stride ldy) through
// gemm(x rows, y rows, count) where active(); returns the rows left for the vector tiles: M,
// or prompt_from.
template <typename F>
inline int64_t prompt_rows(const float* x, int64_t ldx, float* y, int64_t ldy, int64_t M, int64_t prompt_from, F gemm) {
  prompt_from = std::clamp<int64_t>(prompt_from, 0, M);
  if (prompt_from == M || !active()) return M;
  gemm(x + prompt_from * ldx, y + prompt_from * ldy, M - prompt_from);
  return prompt_from;
}

}  // namespace amx

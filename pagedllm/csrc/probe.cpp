// What the cores can do, for `pagedllm bench roofline`: each probe runs the same loop on every
// OpenMP thread at once, so the caller's wall time over the call is what all cores sustain
// together. Nothing here touches memory beyond a few cache lines: these are compute ceilings.
#include <stdint.h>

#include <algorithm>

#include "pagedllm_abi.h"
#include "vec.h"

using namespace vec;

namespace {

// Each probe's work is 8 n vector operations per thread (pagedllm_abi.h), run as rounds over
// kChains independent accumulators: enough to cover an FMA's latency (4 cycles at 2 a cycle)
// on every ISA, and with AVX-512's 32 registers vpdpbusd's too (5 cycles at 2 a cycle); few
// enough that they and the operands stay in registers (AVX2's 16 ymm hold 6 two-register
// F32x16 and the operands; 8 would spill two chains to the stack, whose store-to-load round
// trip then paces the loop).
constexpr int kChains = std::min(12, kF32Regs - 2);

// step(c) for 8 n chain steps: full rounds over the kChains chains, then the rest.
template <typename Step>
inline void rounds(int64_t n, Step step) {
  for (int64_t i = 0; i < 8 * n / kChains; ++i)
    for (int c = 0; c < kChains; ++c) step(c);
  for (int c = 0; c < 8 * n % kChains; ++c) step(c);
}

// GCC 12 copies each int32 accumulator of probe_dot_i8's loop to another register and back
// around every AVX-512 vpdpbusd (two moves a dot); an Intel core runs those moves on the vector
// ports, and the int8 peak read half the instruction's rate there. An empty asm that takes the
// accumulator in its register keeps it in place. (AVX2's and NEON's loops have no such copies.)
inline I32x16 in_place(I32x16 acc) {
#ifdef __AVX512F__
  __asm__("" : "+v"(acc.v));
#endif
  return acc;
}

// probe_dot_fma_i8's chains: int8 dots on kMixDots, float32 FMAs on kMixFmas of their own,
// with the operands in registers (AVX2's and NEON's F32x16 take two and four registers, so 4 +
// 1 chains; a dot's chain there is one add, so 4 cover its latency). A round is kMixRound dots
// over the chains in turn, every index a constant.
constexpr int kMixDots = kF32Regs >= 32 ? 16 : 4, kMixFmas = kF32Regs >= 32 ? 4 : 1;
constexpr int kMixRound = std::max(8, kMixDots);

// 8 n int8 dots (as probe_dot_i8's, n rounded down to whole rounds) and F float32 FMAs after
// every 8, per thread.
template <int F>
float dot_fma_mix(int64_t n) {
  float total = 0.f;
#pragma omp parallel reduction(+ : total)
  {
    alignas(64) int8_t w[64] = {};
    alignas(64) int8_t codes[16];
    store_i8(codes, round_i32(zero()));
    const DotX x = dot_prepare(reinterpret_cast<const int32_t*>(codes));
    I32x16 acc[kMixDots];
    F32x16 facc[kMixFmas];
    for (int c = 0; c < kMixDots; ++c) acc[c] = zero_i32();
    for (int c = 0; c < kMixFmas; ++c) facc[c] = set1(0.001f * c);
    const F32x16 a = set1(0.999f);
    const int8_t* wp = w;
    for (int64_t i = 0; i < 8 * n / kMixRound; ++i) {
      __asm__ volatile("" : "+r"(wp));
#pragma GCC unroll 16
      for (int k = 0; k < kMixRound; ++k) acc[k % kMixDots] = in_place(dot(acc[k % kMixDots], x, wp));
#pragma GCC unroll 8
      for (int k = 0; k < F * kMixRound / 8; ++k) facc[k % kMixFmas] = fma(facc[k % kMixFmas], a, a);
    }
    F32x16 s = facc[0];
    for (int c = 1; c < kMixFmas; ++c) s = add(s, facc[c]);
    for (int c = 0; c < kMixDots; ++c) s = add(s, to_f32(acc[c]));
    total += reduce_add(s);
  }
  return total;
}

}  // namespace

extern "C" {

// Per thread, a chain of n dependent integer additions (n rounded down to a multiple of 8):
// one per cycle on every core this project targets, so threads * n / seconds is the
// sustained clock. The empty asm keeps the compiler from folding the chain. Each step adds a
// register, not a constant: Intel's cores since Golden Cove (Sapphire and Emerald Rapids)
// fold additions of a constant into the register renamer, several a cycle, and a chain of
// them read about four times the clock there. Returns n.
int64_t probe_add_chain(int64_t n) {
  int64_t total = 0;
#pragma omp parallel reduction(max : total)
  {
    int64_t x = 0, one = 1;
    __asm__ volatile("" : "+r"(one));  // a value the compiler cannot see: an add of a register
    for (int64_t i = 0; i + 8 <= n; i += 8) {
#define PAGEDLLM_STEP x += one; __asm__ volatile("" : "+r"(x));
      PAGEDLLM_STEP PAGEDLLM_STEP PAGEDLLM_STEP PAGEDLLM_STEP PAGEDLLM_STEP PAGEDLLM_STEP PAGEDLLM_STEP PAGEDLLM_STEP
#undef PAGEDLLM_STEP
    }
    total = x;
  }
  return total;
}

// Per thread, 8 n F32x16 fused multiply-adds on independent chains: 2 * 16 * 8 * n float32
// operations per thread. Returns a lane of the result (so the loop is kept).
float probe_fma_f32(int64_t n) {
  float total = 0.f;
#pragma omp parallel reduction(+ : total)
  {
    F32x16 acc[kChains];
    for (int c = 0; c < kChains; ++c) acc[c] = set1(0.001f * c);
    const F32x16 a = set1(0.999f), b = set1(0.0001f);
    rounds(n, [&](int c) { acc[c] = fma(acc[c], a, b); });
    F32x16 s = acc[0];
    for (int c = 1; c < kChains; ++c) s = add(s, acc[c]);
    total += reduce_add(s);
  }
  return total;
}

// Per thread, 8 n int8 dot products of the vector layer on independent chains (dot: 64
// multiply-adds each, the kernels' own instruction sequence per ISA): 2 * 64 * 8 * n int8
// operations per thread. Returns a lane of the result.
int64_t probe_dot_i8(int64_t n) {
  int64_t total = 0;
#pragma omp parallel reduction(+ : total)
  {
    alignas(64) int8_t w[64] = {};  // zeros: no sum can overflow, and no core skips a multiply by them
    alignas(64) int8_t codes[16];
    store_i8(codes, round_i32(zero()));
    const DotX x = dot_prepare(reinterpret_cast<const int32_t*>(codes));
    I32x16 acc[kChains];
    for (int c = 0; c < kChains; ++c) acc[c] = zero_i32();
    const int8_t* wp = w;
    rounds(n, [&](int c) {
      // wp may point anywhere now: the dots are redone each step. (A "memory" clobber would
      // also keep the accumulators in memory, a store and a load around every dot.)
      if (c == 0) __asm__ volatile("" : "+r"(wp));
      acc[c] = in_place(dot(acc[c], x, wp));
    });
    F32x16 s = to_f32(acc[0]);
    for (int c = 1; c < kChains; ++c) s = add(s, to_f32(acc[c]));
    total += static_cast<int64_t>(reduce_add(s));
  }
  return total;
}

float probe_dot_fma_i8(int64_t n, int64_t fmas) {
  switch (fmas) {
    case 0: return dot_fma_mix<0>(n);
    case 1: return dot_fma_mix<1>(n);
    case 2: return dot_fma_mix<2>(n);
    case 3: return dot_fma_mix<3>(n);
    case 4: return dot_fma_mix<4>(n);
    default: return -1.f;
  }
}

}  // extern "C"

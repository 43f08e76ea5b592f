// What this library is: the limits it was compiled with and the CPU features its machine code
// needs, both read by the Python loader (pagedllm/kernels/library.py) before it trusts it.
#include "head_dims.h"
#include "pagedllm_abi.h"

namespace {

PagedllmLimits make_limits() {
  PagedllmLimits l{};
  l.max_group = PAGEDLLM_MAX_GROUP;
  l.num_head_dims = static_cast<int64_t>(head_dims::kCount);
  for (std::size_t i = 0; i < head_dims::kCount; ++i) l.head_dims[i] = head_dims::kAll[i];
  l.max_prefill_block = PAGEDLLM_MAX_PREFILL_BLOCK;
  l.panel = PAGEDLLM_PANEL;
  l.quant_group = PAGEDLLM_QUANT_GROUP;
  l.q4a8_group_bytes = PAGEDLLM_Q4A8_GROUP_BYTES;
  return l;
}

const PagedllmLimits kLimits = make_limits();

// Every target macro the kernels' headers (vec*.h) or the compiler's code generation act on,
// by the name Linux gives the feature in /proc/cpuinfo.
constexpr const char kRequires[] = ""
#ifdef __AVX2__
    " avx2"
#endif
#ifdef __FMA__
    " fma"
#endif
#ifdef __F16C__
    " f16c"
#endif
#ifdef __AVX512F__
    " avx512f"
#endif
#ifdef __AVX512BW__
    " avx512bw"
#endif
#ifdef __AVX512VL__
    " avx512vl"
#endif
#ifdef __AVX512DQ__
    " avx512dq"
#endif
#ifdef __AVX512VNNI__
    " avx512_vnni"
#endif
#ifdef __AVX512BF16__
    " avx512_bf16"
#endif
#if defined(__aarch64__) && defined(__ARM_NEON)
    " asimd"
#endif
#ifdef __ARM_FEATURE_DOTPROD
    " asimddp"
#endif
    "";

}  // namespace

extern "C" {

const PagedllmLimits* pagedllm_limits(void) { return &kLimits; }

const char* pagedllm_requires(void) { return kRequires[0] ? kRequires + 1 : kRequires; }

}  // extern "C"

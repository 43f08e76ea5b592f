// Compile-time dispatch over the head sizes the attention kernels are instantiated for
// (PAGEDLLM_HEAD_DIMS, declared once in pagedllm_abi.h).
#pragma once

#include <stdint.h>

#include <cstddef>
#include <type_traits>
#include <utility>

#include "pagedllm_abi.h"

namespace head_dims {

inline constexpr int kAll[] = PAGEDLLM_HEAD_DIMS;
inline constexpr std::size_t kCount = sizeof(kAll) / sizeof(kAll[0]);
static_assert(kCount <= PAGEDLLM_MAX_HEAD_DIMS, "PagedllmLimits.head_dims has no room for PAGEDLLM_HEAD_DIMS");

template <typename F, std::size_t... I>
int dispatch(int64_t d, F&& fn, std::index_sequence<I...>) {
  int status = -1;
  (void)((d == kAll[I] ? (status = fn(std::integral_constant<int, kAll[I]>{}), true) : false) || ...);
  return status;
}

// fn(std::integral_constant<int, D>{}) for the supported D equal to d, its result; -1 where
// d is not one of them.
template <typename F>
int with(int64_t d, F&& fn) {
  return dispatch(d, fn, std::make_index_sequence<kCount>{});
}

constexpr bool supported(int64_t d) {
  for (int v : kAll)
    if (v == d) return true;
  return false;
}

}  // namespace head_dims

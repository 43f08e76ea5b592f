// Heap arrays that start on a cache line. malloc's 16-byte alignment put every 64-byte vector
// (or AMX tile row) of a scratch array across two lines: each load read two, and an AMX tile
// load 32 lines for 16 rows (docs/benchmarks.md, session 43).
#pragma once

#include <stddef.h>

#include <new>
#include <vector>

namespace aligned {

inline constexpr size_t kLine = 64;

template <typename T>
struct LineAllocator {
  using value_type = T;
  LineAllocator() = default;
  template <typename U>
  LineAllocator(const LineAllocator<U>&) {}
  T* allocate(size_t n) { return static_cast<T*>(::operator new(n * sizeof(T), std::align_val_t{kLine})); }
  void deallocate(T* p, size_t) { ::operator delete(p, std::align_val_t{kLine}); }
  template <typename U>
  bool operator==(const LineAllocator<U>&) const { return true; }
};

// A std::vector whose data() is a multiple of 64 bytes.
template <typename T>
using vector = std::vector<T, LineAllocator<T>>;

}  // namespace aligned

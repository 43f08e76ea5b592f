// How the kernels split work over threads: par::parallel_for runs f(i) for every i in [0, n)
// on the calling thread and a persistent team of helper threads, claiming chunks of items
// from a shared counter.
// Why not OpenMP's parallel for: its region ends in a barrier that waits for every thread of
// the team, so when the OS deschedules one (another process wants the core) every region of
// a decode step, hundreds of them, waits out that thread's time slice. Here the caller waits
// only for chunks that were claimed: a helper that is not running claims nothing, and the
// caller does its share (docs/benchmarks.md, "Threads on shared cores").
// The team size is OpenMP's (omp_get_max_threads of the calling thread, which
// torch.set_num_threads sets: torch and the kernels share one OpenMP runtime).
#pragma once

#include <stdint.h>

namespace par {

// body(ctx, begin, end) handles items [begin, end).
using Body = void (*)(const void* ctx, int64_t begin, int64_t end);

// Runs body over [0, n) in chunks of `grain` items (at least 1) on the team, the calling
// thread included; returns when every item is done. Serial when the team has one thread,
// there is one chunk, the caller is itself inside a parallel_for, or another thread's
// parallel_for holds the team.
// Hidden: the library exports the header's C functions and nothing else.
__attribute__((visibility("hidden"))) void run(int64_t n, int64_t grain, Body body, const void* ctx);

// The team size a parallel_for started now would have (1 inside a parallel_for).
__attribute__((visibility("hidden"))) int team_size();

// Items per chunk that split n items into about four chunks per thread, so that a slow
// thread's last chunk is short.
inline int64_t default_grain(int64_t n) {
  const int64_t chunks = 4 * static_cast<int64_t>(team_size());
  return (n + chunks - 1) / chunks;
}

// f(begin, end) over chunks of [0, n), `grain` items each (0: default_grain(n)), split over
// the team when n >= min_n (else one call over all of [0, n)). A chunk's items run on one
// thread in order, so f may prepare an item while it handles the one before (decode attention
// prefetches the next one's keys).
template <typename F>
void parallel_chunks(int64_t n, const F& f, int64_t min_n = 2, int64_t grain = 0) {
  if (n <= 0) return;
  if (n < min_n) return f(int64_t{0}, n);
  run(n, grain > 0 ? grain : default_grain(n),
      [](const void* ctx, int64_t begin, int64_t end) { (*static_cast<const F*>(ctx))(begin, end); }, &f);
}

// f(i) for every i in [0, n), as parallel_chunks splits it.
template <typename F>
void parallel_for(int64_t n, const F& f, int64_t min_n = 2, int64_t grain = 0) {
  parallel_chunks(n, [&f](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) f(i);
  }, min_n, grain);
}

}  // namespace par

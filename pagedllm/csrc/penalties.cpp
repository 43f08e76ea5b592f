// Repetition, presence and frequency penalties of a step's rows in one call, each row's token
// history walked once, in place of PyTorch's sparse gathers and scatters built from Python
// lists of every row's prompt and output (timings: docs/benchmarks.md, session 28).
#include <stdint.h>

#include <vector>

#include "pagedllm_abi.h"
#include "parallel.h"

extern "C" {

void apply_penalties(float* x, int64_t ld, int64_t rows, int64_t n, const int64_t* row_ids, const int32_t* tokens,
                     const int64_t* offsets, const int64_t* num_prompt, const float* repetition,
                     const float* presence, const float* frequency) {
  par::parallel_for(rows, [&](int64_t r) {
    float* row = x + row_ids[r] * ld;
    const int32_t* t = tokens + offsets[r];
    const int64_t total = offsets[r + 1] - offsets[r];
    thread_local std::vector<int32_t> count;  // zero between rows: each pass resets what it marks
    if (int64_t(count.size()) < n) count.assign(n, 0);
    if (const float p = repetition[r]; p != 1.f) {
      for (int64_t i = 0; i < total; ++i)
        if (count[t[i]] == 0) count[t[i]] = 1, row[t[i]] = row[t[i]] > 0.f ? row[t[i]] / p : row[t[i]] * p;
      for (int64_t i = 0; i < total; ++i) count[t[i]] = 0;
    }
    if (presence[r] != 0.f || frequency[r] != 0.f) {
      for (int64_t i = num_prompt[r]; i < total; ++i) ++count[t[i]];
      for (int64_t i = num_prompt[r]; i < total; ++i)
        if (const int32_t c = count[t[i]]; c > 0) row[t[i]] = row[t[i]] - frequency[r] * float(c) - presence[r], count[t[i]] = 0;
    }
  });
}

}  // extern "C"

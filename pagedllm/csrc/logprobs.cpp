// Log-probabilities of one token per row of logits and of the row's most likely tokens, with
// the token's rank, in two vector passes per row: what the sampler returns for `logprobs` and
// `prompt_logprobs`. Why: in PyTorch the same is logsumexp, a [rows, n] comparison for the
// ranks and a top-k, four passes and a boolean tensor per call (timings: docs/benchmarks.md,
// session 28).
#include <stdint.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "pagedllm_abi.h"
#include "parallel.h"
#include "vec.h"

using namespace vec;

namespace {

// Past a row's end: below every logit (a finite number: the kernels build with -ffast-math).
constexpr float kBelow = -3.0e38f;

struct Entry {
  float x;
  int64_t id;
};

// Pass 1 over a row of n: its maximum, how many values are below t (the padding of the last
// block included), and its `top` largest values in best[0, top) (largest first, equal values
// by lower id; best has room for top).
float scan(const float* x, int64_t n, float t, int64_t top, Entry* best, int64_t* below) {
  F32x16 hi = set1(kBelow), less = zero();
  const F32x16 vt = set1(t), one = set1(1.f);
  int64_t filled = 0;
  float floor = kBelow;  // the top-th largest so far, once there are top
  for (int64_t i = 0; i < n; i += 16) {
    const F32x16 v = i + 16 <= n ? load(x + i) : load_first(x + i, n - i, kBelow);
    hi = max(hi, v);
    less = add(less, maskz(lt(v, vt), one));
    if (top == 0 || (filled == top && !any(gt(v, set1(floor))))) continue;
    for (int64_t j = i; j < std::min(i + 16, n); ++j) {
      if (filled == top && !(x[j] > floor)) continue;
      int64_t k = filled < top ? filled++ : top - 1;  // insert x[j], dropping the smallest when full
      while (k > 0 && best[k - 1].x < x[j]) best[k] = best[k - 1], --k;
      best[k] = {x[j], j};
      if (filled == top) floor = best[top - 1].x;
    }
  }
  *below = static_cast<int64_t>(reduce_add(less));
  return reduce_max(hi);
}

// Values summed in float lanes before their sum joins the row's in double: one float sum per
// lane over a whole row drifts by more than 1e-5 in the log at vocabularies of 10^5 and more.
constexpr int64_t kChunk = 1024;

// Pass 2: log sum exp(x - m) + m over a row of n whose maximum is m.
float log_norm(const float* x, int64_t n, float m) {
  const F32x16 vm = set1(m);
  double total = 0.0;
  for (int64_t c = 0; c < n; c += kChunk) {
    F32x16 s = zero();
    for (int64_t i = c; i < std::min(c + kChunk, n); i += 16) {
      const F32x16 v = i + 16 <= n ? load(x + i) : load_first(x + i, n - i, kBelow);
      s = add(s, select(gt(v, set1(kBelow)), exp_nonpositive(sub(v, vm)), zero()));
    }
    total += reduce_add(s);
  }
  return m + float(std::log(total));
}

}  // namespace

extern "C" {

void logprobs_rows(const float* x, int64_t ld, int64_t rows, int64_t n, const int64_t* token, int64_t num_top,
                   int64_t* ids, float* logprobs, int64_t* rank) {
  const int64_t padded = (n + 15) / 16 * 16, width = num_top + 1;
  par::parallel_for(rows, [&](int64_t r) {
    const float* row = x + r * ld;
    const float t = row[token[r]];
    thread_local std::vector<Entry> best;
    best.resize(num_top);
    int64_t below = 0;
    const float m = scan(row, n, t, num_top, best.data(), &below);
    const float norm = log_norm(row, n, m);
    rank[r] = n - below + (t > kBelow ? padded - n : 0);  // the padding is below t where t is above kBelow
    ids[r * width] = token[r], logprobs[r * width] = t - norm;
    for (int64_t k = 0; k < num_top; ++k)
      ids[r * width + 1 + k] = best[k].id, logprobs[r * width + 1 + k] = best[k].x - norm;
  });
}

}  // extern "C"

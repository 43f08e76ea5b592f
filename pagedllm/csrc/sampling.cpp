// Random sampling of one token per row of logits, every stage of a row in one call: the
// softmax at a temperature, top-k, top-p, min-p and the draw at a given uniform.
// Why: in PyTorch the same row is some forty ops over the vocabulary (softmax, block maxima,
// topk, gather, cumsum, searchsorted...), each a dispatch and a pass of its own, which at
// batch 1 cost about a tenth of a decode step (docs/benchmarks.md). Here a row is a vector pass
// for its maximum and one for its weights' sum: with top-k / top-p that pass also collects the
// tokens near the maximum, sorted only as far as the kept prefix reaches; without, a last pass
// stops at the drawn token.
//
// Semantics are the sampler's (pagedllm/layers/sampler.py), with vLLM's order: top-k keeps
// the k most likely tokens; top-p keeps each token whose more likely tokens hold less than
// top_p of the top-k mass; min-p keeps p >= min_p * max p. A row with top-k or top-p draws
// among its kept tokens from the most likely down; a row with neither draws in vocabulary
// order (over the tokens min-p keeps): the first token whose cumulative mass reaches u times
// the kept mass. Tokens at -inf have probability 0 and are never drawn.
#include <stdint.h>

#include <algorithm>
#include <utility>
#include <vector>

#include "pagedllm_abi.h"
#include "parallel.h"
#include "vec.h"

using namespace vec;

namespace {

// A logit at or below this is banned (-inf): compared as a finite number, since the kernels
// build with -ffast-math, under which the compiler may take any test for infinity as false.
constexpr float kBanned = -3.0e38f;
// Candidates of a top-k / top-p row: tokens with p >= p_max * exp(-c), c from this list
// (0: every token not banned, last), widened while the kept prefix may reach past them.
constexpr float kCutoffs[] = {16.f, 32.f, 64.f, 0.f};

// Values i .. i + 15 of a row of n (banned past its end).
inline F32x16 load_block(const float* x, int64_t i, int64_t n) {
  return i + 16 <= n ? load(x + i) : load_first(x + i, n - i, kBanned);
}

// exp((v - m) * inv_t) of 16 values, 0 where v is banned.
inline F32x16 weights16(F32x16 v, F32x16 m, F32x16 inv_t) {
  return select(gt(v, set1(kBanned)), exp_nonpositive(mul(sub(v, m), inv_t)), zero());
}

struct Row {
  const float* x;
  int64_t n;
  float m, inv_t;
  // Token i's weight exp((x - m) * inv_t) = p / max p, as weights16 computes it.
  float weight(int64_t i) const {
    return x[i] <= kBanned ? 0.f : reduce_max(exp_nonpositive(set1((x[i] - m) * inv_t)));
  }
};

// The token at the inverse CDF of u over weights w (in the order given; ids alongside).
int64_t draw(const std::vector<std::pair<float, int64_t>>& kept, float u) {
  double total = 0.0;  // sums in double: a flat row's nucleus is thousands of tiny weights
  for (const auto& c : kept) total += c.first;
  const double target = u * total;
  double mass = 0.0;
  for (const auto& c : kept) {
    mass += c.first;
    if (mass >= target && c.first > 0.f) return c.second;
  }
  for (auto it = kept.rbegin(); it != kept.rend(); ++it)  // rounding left the target unreached
    if (it->first > 0.f) return it->second;
  return kept.empty() ? 0 : kept.front().second;
}

using Candidate = std::pair<float, int64_t>;  // (logit, id)
inline bool more_likely(const Candidate& a, const Candidate& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// A row with top-k or top-p: the tokens near the maximum are the candidates, sorted only as
// far as the kept prefix reaches.
int64_t draw_truncated(const Row& r, int64_t top_k, float top_p, float min_p, float u) {
  const int64_t k = top_k > 0 && top_k < r.n ? top_k : r.n;
  const F32x16 m = set1(r.m), inv_t = set1(r.inv_t);
  std::vector<Candidate> cand;
  std::vector<std::pair<float, int64_t>> kept;  // (weight, id), most likely first
  double z = 0.0;  // the row's weight sum (top-p without top-k), taken in the first pass
  for (float c : kCutoffs) {
    const bool all = c == 0.f, first = c == kCutoffs[0];
    const float cut = all ? kBanned : r.m - c / r.inv_t;
    cand.clear();
    const F32x16 vcut = set1(cut);
    F32x16 zs = zero();
    for (int64_t i = 0; i < r.n; i += 16) {
      const F32x16 v = load_block(r.x, i, r.n);
      if (first && k == r.n) zs = add(zs, weights16(v, m, inv_t));
      if (!any(gt(v, vcut))) continue;
      for (int64_t j = i; j < std::min(i + 16, r.n); ++j)
        if (r.x[j] > cut) cand.emplace_back(r.x[j], j);
    }
    if (first) z = reduce_add(zs);
    if (!all && int64_t(cand.size()) < k && k < r.n) continue;  // top-k reaches past the cut
    double mass_limit = top_p * z;
    if (k < int64_t(cand.size())) {  // top-k: only the k most likely can be kept
      std::nth_element(cand.begin(), cand.begin() + k, cand.end(), more_likely);
      cand.resize(k);
    }
    if (k < r.n) {  // top-p acts on the top-k distribution
      double top_k_mass = 0.0;
      for (const auto& e : cand) top_k_mass += r.weight(e.second);
      mass_limit = top_p * top_k_mass;
    }
    // Keep each token whose more likely tokens hold less than the limit; sorting in growing
    // steps, since a flat row's nucleus is thousands of tokens and a peaked one's a few.
    const int64_t size = int64_t(cand.size());
    kept.clear();
    double before = 0.0;
    for (int64_t j = 0, sorted = 0; j < size && (top_p >= 1.f || before < mass_limit); ++j) {
      if (j == sorted) {
        sorted = std::min(size, std::max<int64_t>(64, 4 * sorted));
        std::partial_sort(cand.begin() + j, cand.begin() + sorted, cand.end(), more_likely);
      }
      kept.emplace_back(r.weight(cand[j].second), cand[j].second);
      before += kept.back().first;
    }
    if (!all && int64_t(kept.size()) == size && k == r.n && before < mass_limit) continue;  // past the cut
    if (min_p > 0.f)  // the most likely token has weight 1 and is always kept
      kept.erase(std::remove_if(kept.begin() + 1, kept.end(), [&](const auto& e) { return e.first < min_p; }),
                 kept.end());
    return draw(kept, u);
  }
  return 0;  // not reached: the last cutoff takes every token not banned
}

// A row with neither: in vocabulary order, over the tokens with p >= min_p * max p.
int64_t draw_in_order(const Row& r, float min_p, float u) {
  const F32x16 m = set1(r.m), inv_t = set1(r.inv_t), floor_w = set1(min_p);
  auto block = [&](int64_t i) {  // the kept weights of tokens i .. i + 15
    const F32x16 w = weights16(load_block(r.x, i, r.n), m, inv_t);
    return select(lt(w, floor_w), zero(), w);
  };
  double total = 0.0;
  for (int64_t i = 0; i < r.n; i += 16) total += reduce_add(block(i));
  const double target = u * total;
  double mass = 0.0;
  int64_t last = 0;  // the last token with a kept weight scanned
  alignas(64) float w[16];
  for (int64_t i = 0; i < r.n; i += 16) {
    const F32x16 b = block(i);
    const float sum = reduce_add(b);
    if (sum <= 0.f) continue;
    if (mass + sum < target) {  // whole blocks are skipped: one sum each
      mass += sum;
      continue;
    }
    store(w, b);
    for (int j = 0; j < 16 && i + j < r.n; ++j) {
      if (w[j] <= 0.f) continue;
      last = i + j;
      mass += w[j];
      if (mass >= target) return last;
    }
  }
  return last;  // rounding left the target unreached
}

}  // namespace

extern "C" {

void sample_rows(const float* x, int64_t ld, int64_t rows, int64_t n, const float* temperature,
                 const int64_t* top_k, const float* top_p, const float* min_p, const float* u, int64_t* out) {
  par::parallel_for(rows, [&](int64_t r) {
    const float* row = x + r * ld;
    F32x16 best = set1(kBanned);
    for (int64_t i = 0; i < n; i += 16) best = max(best, load_block(row, i, n));
    const float m = reduce_max(best);
    if (!(m > kBanned && m < -kBanned)) {  // every token banned, or +inf / NaN: the caller reports the row
      out[r] = 0;
      return;
    }
    const Row row_of{row, n, m, 1.f / temperature[r]};
    out[r] = (top_k[r] > 0 && top_k[r] < n) || top_p[r] < 1.f ? draw_truncated(row_of, top_k[r], top_p[r], min_p[r], u[r])
                                                               : draw_in_order(row_of, min_p[r], u[r]);
  });
}

}  // extern "C"

// Random sampling of one token per row of logits, every stage of a row in one call: the
// softmax at a temperature, top-k, top-p, min-p and the draw at a given uniform.
// Why: in PyTorch the same row is some forty ops over the vocabulary (softmax, block maxima,
// topk, gather, cumsum, searchsorted...), each a dispatch and a pass of its own, which at
// batch 1 cost about a tenth of a decode step (docs/benchmarks.md). Here a row is a vector pass
// for its maximum and one for its weights' sum; with top-k / top-p that pass also counts the
// tokens and weight within a few cutoffs of the maximum, one more collects the tokens within
// the narrowest cutoff that holds the kept ones, and top-k, top-p and the draw select among
// those by weight in expected linear time (nothing is sorted but the last few of a selection);
// without, a last pass stops at the drawn token.
//
// Semantics are the sampler's (pagedllm/layers/sampler.py), in vLLM V1's order: min-p keeps
// p >= min_p * max p; top-k keeps the k most likely of those; top-p keeps each token whose
// more likely tokens hold less than top_p of the mass min-p and top-k keep. A row with top-k
// (even one at or past the vocabulary, which keeps every token) or top-p draws among its kept
// tokens from the most likely down; a row with neither draws in vocabulary order (over the
// tokens min-p keeps): the first token whose cumulative mass reaches u times the kept mass.
// Tokens at -inf have probability 0 and are never drawn.
#include <stdint.h>

#include <algorithm>
#include <bit>
#include <type_traits>
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
// Candidates of a top-k / top-p row: the tokens with p >= p_max * exp(-c), c from this list
// (0: every token not banned, last). The row's first pass counts the tokens (top-k) or sums
// the weights (top-p alone) above the first kCounted cutoffs, and the candidates are taken at
// the first of those that holds the k most likely tokens or top_p of the mass; the later ones
// are for rows where it does not (a flat row, or rounding at the limit).
constexpr float kCutoffs[] = {2.f, 4.f, 8.f, 16.f, 32.f, 64.f, 0.f};
constexpr int kCounted = 4;

// Whether v is neither infinite nor NaN, from its bits: under -ffast-math the compiler may take
// std::isfinite as true, and a comparison with a finite bound would refuse the largest finite
// logits.
inline bool finite(float v) { return (std::bit_cast<uint32_t>(v) & 0x7f800000u) != 0x7f800000u; }

// Values i .. i + 15 of a row of n (banned past its end).
inline F32x16 load_block(const float* x, int64_t i, int64_t n) {
  return i + 16 <= n ? load(x + i) : load_first(x + i, n - i, kBanned);
}

// exp((v - m) * inv_t) of 16 values, 0 where v is banned.
inline F32x16 weights16(F32x16 v, F32x16 m, F32x16 inv_t) {
  return select(gt(v, set1(kBanned)), exp_nonpositive(mul(sub(v, m), inv_t)), zero());
}

// weights16 with 0 also where the weight is below min_w (min-p; min_w 0 keeps every weight).
inline F32x16 kept_weights16(F32x16 v, F32x16 m, F32x16 inv_t, F32x16 min_w) {
  const F32x16 w = weights16(v, m, inv_t);
  return select(lt(w, min_w), zero(), w);
}

struct Row {
  const float* x;
  int64_t n;
  float m, inv_t;
};

struct Candidate {
  float x, w;  // logit, weight p / max p
  int64_t id;
};
inline bool more_likely(const Candidate& a, const Candidate& b) { return a.x > b.x || (a.x == b.x && a.id < b.id); }

// c[0, n) reordered so that its first b + 1 entries are the b + 1 most likely (in any order) and
// c[b] the least likely of them, for the least b at which the weights of the b + 1 reach limit
// (in the order most likely first); returns b, or -1 where all n stay below it. Expected O(n):
// a quickselect on the weight, not a sort.
int64_t reach(Candidate* c, int64_t n, double limit) {
  int64_t lo = 0, hi = n;  // c[0, lo) is in the prefix, c[hi, n) past it
  double acc = 0.0;        // the weight of c[0, lo)
  // Partitions allowed before the rest is sorted: three times a balanced run's, so that
  // pivots that keep splitting off little (inputs median-of-three fails on) cost a sort at most.
  int budget = 3 * (64 - __builtin_clzll(uint64_t(n) | 1));
  while (hi - lo > 24 && budget-- > 0) {
    const int64_t mid = lo + (hi - lo) / 2;  // median of three as the pivot, moved to c[hi - 1]
    if (more_likely(c[mid], c[lo])) std::swap(c[mid], c[lo]);
    if (more_likely(c[hi - 1], c[lo])) std::swap(c[hi - 1], c[lo]);
    if (more_likely(c[mid], c[hi - 1])) std::swap(c[mid], c[hi - 1]);
    const Candidate pivot = c[hi - 1];
    int64_t i = lo;
    double left = 0.0;
    for (int64_t j = lo; j < hi - 1; ++j)
      if (more_likely(c[j], pivot)) left += c[j].w, std::swap(c[i++], c[j]);
    std::swap(c[i], c[hi - 1]);
    if (acc + left >= limit) {  // reached before the pivot
      hi = i;
      continue;
    }
    acc += left + c[i].w;
    if (acc >= limit) return i;
    lo = i + 1;
  }
  std::sort(c + lo, c + hi, more_likely);
  for (int64_t j = lo; j < hi; ++j) {
    acc += c[j].w;
    if (acc >= limit) return j;
  }
  // c[hi] (a pivot) reaches it where a partition's sum and the one-by-one sums round apart.
  return hi < n ? hi : -1;
}

// The token at the inverse CDF of u over the kept candidates, most likely first.
int64_t draw(Candidate* kept, int64_t n, float u) {
  double total = 0.0;  // sums in double: a flat row's nucleus is thousands of tiny weights
  for (int64_t j = 0; j < n; ++j) total += kept[j].w;
  const int64_t b = reach(kept, n, u * total);
  if (b >= 0 && kept[b].w > 0.f) return kept[b].id;
  const Candidate* last = nullptr;  // rounding left the target unreached: the least likely drawable
  for (int64_t j = 0; j < n; ++j)
    if (kept[j].w > 0.f && (last == nullptr || more_likely(*last, kept[j]))) last = &kept[j];
  return last != nullptr ? last->id : kept[0].id;
}

// A row with top-k or top-p: the tokens near the maximum are the candidates; top-k selects
// among them, top-p reaches into them by weight, neither sorts them. Min-p (a weight below
// min_p) removes tokens before either, so the first pass counts and sums only the tokens it
// keeps, and a cutoff that holds all of them holds every token the row can draw.
int64_t draw_truncated(const Row& r, int64_t top_k, float top_p, float min_p, float u) {
  const int64_t k = top_k > 0 && top_k < r.n ? top_k : r.n;
  const bool pruned = min_p > 0.f;  // min-p removes tokens
  const F32x16 m = set1(r.m), inv_t = set1(r.inv_t), one = set1(1.f), min_w = set1(min_p);
  F32x16 cuts[kCounted], above[kCounted];  // per counted cutoff: tokens (top-k) or weight (top-p) above it
  for (int l = 0; l < kCounted; ++l) cuts[l] = set1(r.m - kCutoffs[l] / r.inv_t), above[l] = zero();
  int first = k < r.n || top_p < 1.f ? 0 : int(std::size(kCutoffs)) - 1;  // else every token is kept
  F32x16 zs = zero(), ns = zero();  // top-p alone: the kept weight; top-k under min-p: the kept tokens
  auto count = [&](auto has_pruned) {  // the counts pick the first cutoff
    constexpr bool kPruned = decltype(has_pruned)::value;
    for (int64_t i = 0; i < r.n; i += 16) {
      const F32x16 v = load_block(r.x, i, r.n);
      if (k == r.n || kPruned) {
        const F32x16 w = kPruned ? kept_weights16(v, m, inv_t, min_w) : weights16(v, m, inv_t);
        if constexpr (kPruned) {
          if (k < r.n) {  // top-k counts the tokens min-p keeps
            const F32x16 kept = maskz(gt(w, zero()), one);
            ns = add(ns, kept);
            for (int l = 0; l < kCounted; ++l) above[l] = add(above[l], maskz(gt(v, cuts[l]), kept));
            continue;
          }
        }
        for (int l = 0; l < kCounted; ++l) above[l] = add(above[l], maskz(gt(v, cuts[l]), w));
        zs = add(zs, w);
      } else {
        for (int l = 0; l < kCounted; ++l) above[l] = add(above[l], maskz(gt(v, cuts[l]), one));
      }
    }
  };
  if (first == 0) pruned ? count(std::true_type{}) : count(std::false_type{});
  const double z = reduce_add(zs);  // the kept weight (top-p without top-k)
  const int64_t survivors = int64_t(reduce_add(ns));  // the tokens min-p keeps (top-k under min-p)
  auto enough = [&](int l) {
    const float a = reduce_add(above[l]);
    if (pruned && k < r.n && int64_t(a) >= survivors) return true;  // every token min-p keeps
    return k < r.n ? a >= float(k) : a >= top_p * z;
  };
  while (first < kCounted && !enough(first)) ++first;
  std::vector<Candidate> cand;
  alignas(64) float w16[16];
  for (int c = first; c < int(std::size(kCutoffs)); ++c) {
    const bool all = kCutoffs[c] == 0.f;
    const float cut = all ? kBanned : r.m - kCutoffs[c] / r.inv_t;
    cand.clear();
    const F32x16 vcut = set1(cut);
    for (int64_t i = 0; i < r.n; i += 16) {
      const F32x16 v = load_block(r.x, i, r.n);
      if (!any(gt(v, vcut))) continue;
      store(w16, kept_weights16(v, m, inv_t, min_w));
      for (int64_t j = i; j < std::min(i + 16, r.n); ++j)
        if (r.x[j] > cut && (!pruned || w16[j - i] > 0.f)) cand.push_back({r.x[j], w16[j - i], j});
    }
    // The candidates are every token the row can draw: the last cutoff, or (top-k under min-p)
    // every token min-p keeps. A nucleus of top-p alone that all min-p keeps cannot reach falls
    // short only by rounding, and the next cutoff takes the same tokens.
    const bool whole = all || (pruned && k < r.n && int64_t(cand.size()) >= survivors);
    if (!whole && int64_t(cand.size()) < k && k < r.n) continue;  // top-k reaches past the cut
    double mass_limit = top_p * z;
    if (k < int64_t(cand.size())) {  // top-k: only the k most likely can be kept
      std::nth_element(cand.begin(), cand.begin() + k, cand.end(), more_likely);
      cand.resize(k);
    }
    if (k < r.n) {  // top-p acts on the top-k distribution
      double top_k_mass = 0.0;
      for (const Candidate& e : cand) top_k_mass += e.w;
      mass_limit = top_p * top_k_mass;
    }
    // Keep each token whose more likely tokens hold less than the limit: the least prefix
    // whose weight reaches it.
    int64_t kept = int64_t(cand.size());
    if (top_p < 1.f) {
      const int64_t b = reach(cand.data(), kept, mass_limit);
      if (b < 0 && !whole && k == r.n) continue;  // the nucleus reaches past the cut
      if (b >= 0) kept = b + 1;
    }
    return draw(cand.data(), kept, u);
  }
  return 0;  // not reached: the last cutoff takes every token not banned
}

// A row with neither: in vocabulary order, over the tokens with p >= min_p * max p.
int64_t draw_in_order(const Row& r, float min_p, float u) {
  const F32x16 m = set1(r.m), inv_t = set1(r.inv_t), floor_w = set1(min_p);
  auto block = [&](int64_t i) { return kept_weights16(load_block(r.x, i, r.n), m, inv_t, floor_w); };
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
    if (!(m > kBanned && finite(m))) {  // every token banned, or +inf / NaN: the caller reports the row
      out[r] = 0;
      return;
    }
    const Row row_of{row, n, m, 1.f / temperature[r]};
    out[r] = top_k[r] > 0 || top_p[r] < 1.f ? draw_truncated(row_of, top_k[r], top_p[r], min_p[r], u[r])
                                            : draw_in_order(row_of, min_p[r], u[r]);
  });
}

}  // extern "C"

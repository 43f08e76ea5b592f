// Paged attention for decode on CPU: one query token per request, K/V read in place
// through the block table (no gather, no padding). Kwon et al. 2023, "Efficient Memory
// Management for Large Language Model Serving with PagedAttention", §4.1.
//
// Layouts: q, out [B, Hq, D] float32; caches [num_blocks, BS, Hkv, row] float32, bfloat16, int8
// or fp8 e4m3 (an 8-bit row: D codes and the row's scale, kv_rows.h); block_tables [B, max_blocks];
// seq_lens [B]; window > 0: only the last `window` keys are read (sliding-window attention;
// keys at positions < seq_len - window are never touched), 0: all.
// The G = Hq / Hkv query heads that share a KV head read its keys and values once; a context
// of kSplitFrom keys or more is split into pieces merged at the end (so that one request keeps
// the threads busy). Work goes to threads by (request, piece), every KV head of it together
// (each slot read whole), a few pairs a claim, each pair's last tile prefetching the next
// one's first; or by (request, piece, KV head) when there are fewer pairs than threads. Keys
// are taken in tiles of 16 positions (from a multiple of 16; rows looked up in the block
// table, so any block size works) with an online softmax (Milakov & Gimelshein 2018, "Online
// normalizer calculation for softmax"); each K and V row is read once, and each key scored
// asks for the K and V rows of the key in its lane kAhead tiles on, into L2 (one key's lines
// at a time, spread over the arithmetic).
// - Scores: each key's dot product with a query head is left as a vector of 16 partial sums,
//   and the tile's 16 vectors are summed by a transpose-and-add tree into one vector holding
//   its 16 scores (about 3 uops a key, against ~10 for a horizontal sum each), on which the
//   softmax then works in place.
// Scores and accumulators are float32 whatever the storage dtype (bfloat16 rows are widened
// 16 values at a time; 8-bit codes too, unscaled: a key's scale multiplies its score once, a
// value's its softmax weight, a tile's 16 scales as one vector), with two exceptions:
// - a bfloat16 cache on an ISA that multiplies bfloat16 pairs (vec.h's kBf16Dot): q.K takes
//   the rows' consecutive elements as stored against the queries rounded to bfloat16, and p.V
//   two keys' elements against their weights rounded (kPairs), with float32 sums;
// - an int8 cache, on every ISA (kIntCodes): q.K is an integer dot product of the key's codes
//   as stored with each query head's codes (kv::quantize_query), exact in int32, then times
//   the query's code scale and the key's row scale; p.V too: per query head and tile, the
//   weights times their value rows' scales become codes in [0, 127] (w * 127 / the tile's
//   largest, rounded to nearest even) whose integer sums with the value codes, four keys per
//   instruction, are added to the float32 accumulators times the tile's code scale.
// Written on the vector layer (vec.h): one source for every ISA.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "aligned.h"
#include "head_dims.h"
#include "kv_rows.h"
#include "pagedllm_abi.h"
#include "parallel.h"
#include "vec.h"

using namespace vec;

namespace {

constexpr int kTile = 16;     // keys scored together: one per lane

// A row of D values (8-bit: codes, unscaled) as D/16 float32 vectors.
template <int D, typename T>
inline void load_row(const T* p, F32x16* v) {
  for (int c = 0; c < D / 16; ++c) v[c] = kv::load16(p + 16 * c);
}

// Every line of a head's row at p, asked for ahead into L2 (prefetcht1), not L1: a core keeps
// few misses of L1 in flight (its fill buffers), and on a Zen 4, with every line of a tile
// asked into L1, those and not DRAM bounded the stream (K/V from DRAM 1.5x faster into L2; on
// session 45's Intel host with AMX no different; docs/benchmarks.md, "AMD EPYC Zen 4, session
// 48"). The load a tile later finds the line in L2.
template <int D, typename T>
inline void prefetch_row(const T* p) {
  for (int64_t line = 0; line < kv::row_width<T>(D) * int64_t(sizeof(T)); line += 64)
    __builtin_prefetch(reinterpret_cast<const char*>(p) + line, 0, 2);
}

// Whether both products take bfloat16 pairs (vec.h's kBf16Dot) over rows of T: q.K a bfloat16
// row's consecutive elements as stored against the queries rounded to bfloat16
// (HeadState::qp), p.V two keys' elements against their weights rounded to bfloat16.
template <typename T>
inline constexpr bool kPairs = kBf16Dot && std::is_same_v<T, uint16_t>;

// Where kv::kIntCodes<T> (an int8 cache), q.K and p.V are integer dot products of codes: the
// key row's D codes against the query head's (HeadState::q8), 64 at a time (vec.h's dot_s8);
// four value rows' codes against their weights' (dot_u8s8). The accumulators then hold
// element 64 k + 16 q + 4 m + i of a row in vector 4 k + m, lane 4 q + i (interleave_rows4's
// order): store_values puts them back in order.
using kv::kIntCodes;

// One (request, KV head)'s attention state over keys [first, end) of its block table: the
// G query heads (scaled), their running max (m, the same in every lane), lane-wise sums of
// weights (l) and unnormalized weighted values (acc). G and D are compile-time constants, so
// a KV head's queries and accumulators are fixed arrays of G x D/16 vectors: in registers
// where they fit (AVX-512) and the state is a local, else the accumulators in register
// blocks per tile (ValueBlocks).
template <typename T, int D, int G>
struct HeadState {
  static constexpr int kI = kIntCodes<T> ? G : 1;  // room for int8 queries, where they are used
  F32x16 q[G][D / 16], acc[G][D / 16], m[G], l[G];
  BF16x32 qp[G][D / 32];  // q rounded to bfloat16 pairs, where kBf16Dot
  alignas(64) int8_t q8[kI][D];  // kIntCodes: each query head's codes,
  alignas(64) int32_t qsum[kI][D / 4];  // -128 times each quad of them summed (vec.h's kDotXSums),
  float qs[kI];  // and their code scale
};

// scores[g] = q[g] . k for the N keys whose rows are at offsets rows[S0 .. S0 + N) in cache,
// in the tree's layout for N (for N = 16: key s in lane s): st's q in float32, qp in bfloat16
// pairs where kPairs<T>, the codes q8 where kIntCodes<T> (then the integer sums, unscaled,
// exact in float32: |sum| <= D * 127 * 127 < 2^24). Depth first, so that only a few partial
// vectors are live at once. With `ahead` (a later tile's row offsets, or null), each key's
// turn also asks for the K and V rows of the key in its lane of that tile.
template <int D, int G, int N, int S0 = 0, typename T>
inline void tile_scores(const HeadState<T, D, G>& st, const T* cache, const T* v_cache, const int64_t* rows,
                        const int64_t* ahead, F32x16 (&scores)[G]) {
  if constexpr (N == 1) {
    if (ahead) {
      prefetch_row<D>(cache + ahead[S0]);
      prefetch_row<D>(v_cache + ahead[S0]);
    }
    if constexpr (kIntCodes<T>) {
      const uint8_t* row = reinterpret_cast<const uint8_t*>(cache + rows[S0]);
      S8W k[D / 64];
      for (int c = 0; c < D / 64; ++c) k[c] = prepare_s8(load_u8x64(row + 64 * c));
      for (int g = 0; g < G; ++g) {
        F32x16 d = to_f32(dot_s8(k[0], st.q8[g], st.qsum[g]));
        for (int c = 1; c < D / 64; ++c) d = add(d, to_f32(dot_s8(k[c], st.q8[g] + 64 * c, st.qsum[g] + 16 * c)));
        scores[g] = d;
      }
    } else if constexpr (kPairs<T>) {
      const uint32_t* row = reinterpret_cast<const uint32_t*>(cache + rows[S0]);
      BF16x32 k[D / 32];
      for (int c = 0; c < D / 32; ++c) k[c] = load_pairs(row + 16 * c);
      for (int g = 0; g < G; ++g) {
        F32x16 d = dot_pairs(zero(), st.qp[g][0], k[0]);
        for (int c = 1; c < D / 32; ++c) d = dot_pairs(d, st.qp[g][c], k[c]);
        scores[g] = d;
      }
    } else {
      F32x16 k[D / 16];
      load_row<D>(cache + rows[S0], k);
      for (int g = 0; g < G; ++g) {
        F32x16 d = mul(st.q[g][0], k[0]);
        for (int c = 1; c < D / 16; ++c) d = fma(st.q[g][c], k[c], d);
        scores[g] = d;
      }
    }
  } else {
    F32x16 a[G], b[G];
    tile_scores<D, G, N / 2, S0>(st, cache, v_cache, rows, ahead, a);
    tile_scores<D, G, N / 2, S0 + N / 2>(st, cache, v_cache, rows, ahead, b);
    for (int g = 0; g < G; ++g) scores[g] = merge<N / 2>(a[g], b[g]);
  }
}

// How the weighted-value sum of a tile (a [G x 16] by [16 x D] product) keeps its
// accumulators in registers, as a GEMM micro-kernel does: in blocks of kHeads query heads x
// kCols vectors of the row, each block's accumulators loaded once per tile and every value
// row's kCols vectors widened once per block. Where all G x D/16 fit (AVX-512) one block
// holds them all; with 16 registers (AVX2, NEON) a block is the whole group over a part of
// the row (G = 8: half the group), which would otherwise reload and store every accumulator
// at every key.
template <int D, int G>
struct ValueBlocks {
  static constexpr int kBudget = kF32Regs - 1;  // accumulators; one register for the value and weight
  static constexpr int kCols = [] {
    int c = 1;
    while (2 * c * G <= kBudget && 2 * c <= D / 16) c *= 2;
    return c;
  }();
  static constexpr int kHeads = [] {
    const int blocks = (G * kCols + kBudget - 1) / kBudget;
    return (G + blocks - 1) / blocks;
  }();
};

// acc[g] += sum over keys s in [lo, hi) of p[g][s] * (value row at rows[s]), per element in
// key order; where kPairs<T>, keys 2i and 2i + 1 of the tile together, their weights rounded to
// bfloat16 (p is 0 outside [lo, hi), whose clamped rows are finite).
template <int D, int G, typename T>
inline void add_weighted_values(const T* v_cache, const int64_t* rows, int lo, int hi, const float (&p)[G][kTile],
                                F32x16 (&acc)[G][D / 16]) {
  using B = ValueBlocks<D, G>;
  if constexpr (kIntCodes<T>) {
    // The tile's value rows, four keys at a time, in 64-element chunks (vt[quad][chunk]), and
    // each head's weights as codes with one scale.
    alignas(64) int8_t vt[kTile / 4][D / 64][4 * 64];
    for (int qd = 0; qd < kTile / 4; ++qd)
      for (int k = 0; k < D / 64; ++k) {
        const int8_t* r[4];
        for (int j = 0; j < 4; ++j) r[j] = v_cache + rows[4 * qd + j] + 64 * k;
        interleave_rows4(r, vt[qd][k]);
      }
    alignas(64) int8_t pc[G][kTile];
    F32x16 ps[G];
    for (int g = 0; g < G; ++g) {
      const F32x16 w = load(p[g]);
      const kv::WeightCodeScale cs = kv::weight_code_scale(set1(reduce_max(w)));
      store_i8(pc[g], round_i32(mul(w, cs.inv)));
      ps[g] = cs.scale;
    }
    for (int c0 = 0; c0 < D / 16; c0 += B::kCols)
      for (int g0 = 0; g0 < G; g0 += B::kHeads) {
        constexpr int kH = B::kHeads, kC = B::kCols;
        I32x16 a[kH][kC];
        for (int g = 0; g < kH; ++g)
          for (int c = 0; c < kC; ++c) a[g][c] = zero_i32();
        for (int qd = 0; qd < kTile / 4; ++qd)
          for (int g = 0; g < kH; ++g) {
            if (g0 + g >= G) break;
            uint32_t quad;
            std::memcpy(&quad, pc[g0 + g] + 4 * qd, sizeof(quad));
            const U8x64 w = splat_u32(quad);
            for (int c = 0; c < kC; ++c) a[g][c] = dot_u8s8(a[g][c], w, vt[qd][(c0 + c) / 4] + 64 * ((c0 + c) % 4));
          }
        for (int g = 0; g < kH; ++g)
          for (int c = 0; c < kC; ++c)
            if (g0 + g < G) acc[g0 + g][c0 + c] = fma(to_f32(a[g][c]), ps[g0 + g], acc[g0 + g][c0 + c]);
      }
    return;
  }
  [[maybe_unused]] alignas(64) uint32_t wp[kPairs<T> ? G : 1][kTile / 2];  // (p[g][2i], p[g][2i + 1]) rounded
  if constexpr (kPairs<T>)
    for (int g = 0; g < G; ++g) store_bf16_first(reinterpret_cast<uint16_t*>(wp[g]), load(p[g]), kTile);
  for (int c0 = 0; c0 < D / 16; c0 += B::kCols)
    for (int g0 = 0; g0 < G; g0 += B::kHeads) {
      constexpr int kH = B::kHeads, kC = B::kCols;
      F32x16 a[kH][kC];
      for (int g = 0; g < kH; ++g)
        for (int c = 0; c < kC; ++c)
          if (g0 + g < G) a[g][c] = acc[g0 + g][c0 + c];
      if constexpr (kPairs<T>) {
        for (int s = lo & ~1; s < hi; s += 2) {
          BF16x32 v[kC];
          for (int c = 0; c < kC; ++c)
            v[c] = zip_bf16(v_cache + rows[s] + 16 * (c0 + c), v_cache + rows[s + 1] + 16 * (c0 + c));
          for (int g = 0; g < kH; ++g) {
            if (g0 + g >= G) break;
            const BF16x32 wg = set1_pair(wp[g0 + g][s / 2]);
            for (int c = 0; c < kC; ++c) a[g][c] = dot_pairs(a[g][c], wg, v[c]);
          }
        }
      } else {
        for (int s = lo; s < hi; ++s) {
          F32x16 v[kC];
          for (int c = 0; c < kC; ++c) v[c] = kv::load16(v_cache + rows[s] + 16 * (c0 + c));
          for (int g = 0; g < kH; ++g) {
            if (g0 + g >= G) break;
            const F32x16 w = set1(p[g0 + g][s]);
            for (int c = 0; c < kC; ++c) a[g][c] = fma(w, v[c], a[g][c]);
          }
        }
      }
      for (int g = 0; g < kH; ++g)
        for (int c = 0; c < kC; ++c)
          if (g0 + g < G) acc[g0 + g][c0 + c] = a[g][c];
    }
}

// A request's keys in pieces attended in parallel, their partial softmaxes merged
// (flash-decoding: Dao et al. 2023, "Flash-Decoding for long-context inference"): from
// kSplitFrom keys an even number of pieces of at most about kPiece keys, of equal length
// (boundaries rounded down to a tile), so that one request keeps two threads equally busy; a
// piece is one stream through the blocks, restarted at its first tile, so pieces stay long.
// The split is a function of the request's own keys, not of the batch or the team: a
// request's output does not depend on what it is batched with.
constexpr int64_t kPiece = 1024, kSplitFrom = 256;

// (request, piece) pairs a thread claims at once in decode_attention: each but the first has its
// first tile prefetched; more would leave a longer tail where one thread works alone.
constexpr int64_t kChunkUnits = 4;

template <typename T, int D, int G>
inline void start_head(const float* q, float scale, HeadState<T, D, G>& st) {
  for (int g = 0; g < G; ++g) {
    if constexpr (kIntCodes<T>) {
      st.qs[g] = kv::quantize_query<D>(q + g * D, scale, st.q8[g]);
      for (int i = 0; i < D / 4; ++i) {
        const int8_t* quad = st.q8[g] + 4 * i;
        st.qsum[g][i] = kDotXSums ? -128 * (quad[0] + quad[1] + quad[2] + quad[3]) : 0;
      }
    }
    load_row<D>(q + g * D, st.q[g]);
    for (int c = 0; c < D / 16; ++c) {
      st.q[g][c] = mul(st.q[g][c], set1(scale));
      st.acc[g][c] = zero();
    }
    st.m[g] = set1(-1e30f);  // finite: -ffast-math assumes no infinities
    st.l[g] = zero();
    if constexpr (kBf16Dot)
      for (int c = 0; c < D / 32; ++c) st.qp[g][c] = round_pairs(st.q[g][2 * c], st.q[g][2 * c + 1]);
  }
}

// The tile of key positions [t0, t0 + 16) into a head's state; rows: its keys' row offsets in
// k_cache / v_cache (clamped into [first, end), see attend); the lanes of keys outside
// [first, end) get weight 0; ahead: a later tile's row offsets to prefetch, or null.
template <typename T, int D, int G>
inline void attend_tile(const T* k_cache, const T* v_cache, const int64_t* rows, const int64_t* ahead, int64_t t0,
                        int64_t first, int64_t end, HeadState<T, D, G>& st) {
  constexpr int ND = D / 16;
  F32x16 scores[G];
  tile_scores<D, G, kTile>(st, k_cache, v_cache, rows, ahead, scores);
  // 8-bit rows: the tile's 16 key scales multiply its scores (lane s: key s) and its 16
  // value scales the softmax weights, one vector multiply per query head each.
  F32x16 k_scales = set1(1.f), v_scales = set1(1.f);
  if constexpr (kv::kQuantized<T>) {
    static_assert(kTile == 16);
    k_scales = kv::row_scales16(k_cache, rows, D);
    v_scales = kv::row_scales16(v_cache, rows, D);
  }
  // Online softmax over the tile.
  const int lo = t0 > first ? 0 : int(first - t0), hi = end - t0 < kTile ? int(end - t0) : kTile;
  const M16 valid = mask_range(lo, hi);
  alignas(64) float p[G][kTile];
  for (int g = 0; g < G; ++g) {
    if constexpr (kIntCodes<T>) scores[g] = mul(scores[g], opaque(mul(k_scales, set1(st.qs[g]))));
    else if constexpr (kv::kQuantized<T>) scores[g] = mul(scores[g], k_scales);
    // m holds the same value in every lane; the tile's max is taken only where it exceeds m.
    const F32x16 in_range = select(valid, scores[g], st.m[g]);
    if (any(gt(in_range, st.m[g]))) {  // a new running max: rescale the sums so far
      const F32x16 mx = set1(reduce_max(in_range));
      const F32x16 corr = exp_nonpositive(sub(st.m[g], mx));  // 0 on the first tile
      st.l[g] = mul(st.l[g], corr);
      for (int c = 0; c < ND; ++c) st.acc[g][c] = mul(st.acc[g][c], corr);
      st.m[g] = mx;
    }
    const F32x16 e = maskz(valid, exp_nonpositive(sub(scores[g], st.m[g])));
    st.l[g] = add(st.l[g], e);
    if constexpr (kv::kQuantized<T>) store(p[g], mul(e, v_scales));
    else store(p[g], e);
  }
  add_weighted_values<D, G>(v_cache, rows, lo, hi, p, st.acc);
}

// The row offsets of the tile of key positions [t0, t0 + 16) of a block table's keys
// [first, end): position p's slot times `stride` (a head adds its own offset), the keys outside
// [first, end) clamped into it, so that every row read is one of the range's.
inline void tile_rows(const int64_t* table, int64_t BS, int64_t stride, int64_t first, int64_t end, int64_t t0,
                      int64_t* off) {
  const int64_t lo = t0 > first ? t0 : first, last = (t0 + kTile < end ? t0 + kTile : end) - 1;
  if (lo / BS == last / BS) {
    const int64_t base = (table[lo / BS] * BS + lo % BS - lo) * stride;  // + stride * position
    for (int s = 0; s < kTile; ++s) off[s] = base + stride * (t0 + s < lo ? lo : t0 + s > last ? last : t0 + s);
  } else {
    for (int s = 0; s < kTile; ++s) {
      const int64_t x = t0 + s < lo ? lo : t0 + s > last ? last : t0 + s;
      off[s] = (table[x / BS] * BS + x % BS) * stride;
    }
  }
}

// Keys [first, end) of a block table in tiles: fn(t0, rows, ahead) per tile of 16 positions
// from a multiple of 16 (so that with blocks of 16, 32, ... a tile lies in one block), rows
// being its keys' slot offsets (tile_rows); ahead: the same of the tile kAhead tiles on, whose
// rows the tile's keys prefetch one key at a time (tile_scores): one prefetch per line read,
// spread over the arithmetic; past the range, the last tile's ahead is `next` (the first
// tile of the range its thread attends next, or null). A tile's lines asked for at once
// (hundreds of prefetches in a burst, to L2 three tiles ahead and to L1 one ahead) ran 2-3x
// slower from DRAM and from L3 alike (docs/benchmarks.md, "AMD EPYC Zen 5, session 22").
constexpr int kAhead = 1;  // tiles between a key read and the key it prefetches (docs/benchmarks.md, session 27)
template <typename Fn>
inline void for_tiles(const int64_t* table, int64_t BS, int64_t stride, int64_t first, int64_t end,
                      const int64_t* next, Fn fn) {
  // Rows of tiles t .. t + kAhead (a ring): t is used, t + kAhead prefetched.
  constexpr int kRing = 4;
  static_assert(kAhead < kRing);
  alignas(64) int64_t rows[kRing][kTile];
  const int64_t t_first = first - first % kTile;
  for (int i = 0; i < kAhead; ++i)
    if (t_first + i * kTile < end) tile_rows(table, BS, stride, first, end, t_first + i * kTile, rows[i]);
  for (int64_t t0 = t_first, t = 0; t0 < end; t0 += kTile, ++t) {
    const int64_t* ahead = t0 + kTile < end ? nullptr : next;
    if (t0 + kAhead * kTile < end) {
      tile_rows(table, BS, stride, first, end, t0 + kAhead * kTile, rows[(t + kAhead) % kRing]);
      ahead = rows[(t + kAhead) % kRing];
    }
    fn(t0, rows[t % kRing], ahead);
  }
}

// KV head h's attention over keys [first, end): its rows are h * RW into each slot.
template <typename T, int D, int G>
inline void attend(const float* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t BS,
                   int64_t stride, int64_t h, float scale, int64_t first, int64_t end, HeadState<T, D, G>& r) {
  constexpr int64_t RW = kv::row_width<T>(D);  // elements of a head's row
  HeadState<T, D, G> st;  // local, so that it stays in registers where it fits
  start_head<T, D, G>(q, scale, st);
  const T *kc = k_cache + h * RW, *vc = v_cache + h * RW;
  for_tiles(table, BS, stride, first, end, nullptr, [&](int64_t t0, const int64_t* rows, const int64_t* ahead) {
    attend_tile<T, D, G>(kc, vc, rows, ahead, t0, first, end, st);
  });
  r = st;
}

// Every KV head of a request over keys [first, end), tile by tile: a tile's slots are read
// whole (all Hkv heads' rows, one stream through the block) instead of one head's rows in
// every Hkv-th piece of it. Each head's state takes the same operations in the same order
// as in attend, so the results are the same bit for bit. next: for_tiles'.
template <typename T, int D, int G>
inline void attend_heads(const float* q, const T* k_cache, const T* v_cache, const int64_t* table, int64_t BS,
                         int64_t Hkv, float scale, int64_t first, int64_t end, const int64_t* next,
                         HeadState<T, D, G>* r) {
  constexpr int64_t RW = kv::row_width<T>(D);
  for (int64_t h = 0; h < Hkv; ++h) start_head<T, D, G>(q + h * G * D, scale, r[h]);
  for_tiles(table, BS, Hkv * RW, first, end, next, [&](int64_t t0, const int64_t* rows, const int64_t* ahead) {
    for (int64_t h = 0; h < Hkv; ++h)
      attend_tile<T, D, G>(k_cache + h * RW, v_cache + h * RW, rows, ahead, t0, first, end, r[h]);
  });
}

// dst[0 .. D) = a row's accumulators times scale, in element order (kIntCodes' accumulators
// keep them in interleave_rows4's order).
template <typename T, int D>
inline void store_values(float* dst, const F32x16 (&acc)[D / 16], F32x16 scale) {
  if constexpr (kIntCodes<T>) {
    alignas(64) float v[D];
    for (int c = 0; c < D / 16; ++c) store(v + 16 * c, mul(acc[c], scale));
    for (int k = 0; k < D / 64; ++k)
      for (int m = 0; m < 4; ++m)
        for (int q = 0; q < 4; ++q)
          for (int i = 0; i < 4; ++i) dst[64 * k + 16 * q + 4 * m + i] = v[16 * (4 * k + m) + 4 * q + i];
  } else {
    for (int c = 0; c < D / 16; ++c) store(dst + 16 * c, mul(acc[c], scale));
  }
}

template <typename T, int D, int G>
void decode_attention(const float* q, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                      int64_t max_blocks, const int64_t* seq_lens, float* out, int64_t B, int64_t Hkv,
                      int64_t BS, float scale, int64_t window) {
  constexpr int ND = D / 16;
  const int64_t Hq = Hkv * G;
  const int64_t stride = Hkv * kv::row_width<T>(D);  // between consecutive slots of one head
  auto first_key = [&](int64_t b) {
    const int64_t S = seq_lens[b];
    return (window > 0 && S > window) ? S - window : int64_t{0};
  };
  auto pieces = [&](int64_t b) {
    const int64_t keys = seq_lens[b] - first_key(b);
    return keys < kSplitFrom ? int64_t{1} : 2 * ((keys + 2 * kPiece - 1) / (2 * kPiece));
  };
  // Work items: (request, piece, KV head), item_start[b] being request b's first, a piece's
  // KV heads consecutive. With at least as many (request, piece) pairs as threads, a pair's
  // heads are attended together (attend_heads: each slot read whole, one stream per piece);
  // with fewer, each head is an item of its own, so that the team has work. Either way a
  // head's arithmetic is the same.
  static thread_local std::vector<int64_t> item_start;
  item_start.resize(B + 1);
  item_start[0] = 0;
  bool split = false;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t n = pieces(b);
    split |= n > 1;
    item_start[b + 1] = item_start[b] + Hkv * n;
  }
  const bool fused = item_start[B] / Hkv >= par::team_size();
  // A split item's partial: per query head its max, sum of weights and D weighted values.
  constexpr int64_t kSlot = G * (D + 2);
  static thread_local aligned::vector<float> partials;
  if (split && partials.size() < size_t(item_start[B] * kSlot)) partials.resize(item_start[B] * kSlot);
  const int64_t* starts = item_start.data();
  float* slots = partials.data();
  // Head h of item's (request, piece), its state done: the output, or the piece's partial.
  auto finish = [&](int64_t item, int64_t b, int64_t n, int64_t h, const HeadState<T, D, G>& r) {
    if (n == 1) {
      for (int g = 0; g < G; ++g) {
        store_values<T, D>(out + (b * Hq + h * G + g) * D, r.acc[g], set1(1.f / reduce_add(r.l[g])));
      }
      return;
    }
    float* slot = slots + item * kSlot;
    for (int g = 0; g < G; ++g, slot += D + 2) {
      slot[0] = reduce_max(r.m[g]);
      slot[1] = reduce_add(r.l[g]);
      for (int c = 0; c < ND; ++c) store(slot + 2 + 16 * c, r.acc[g][c]);
    }
  };
  // Unit of work u: its first item, request b (of n pieces), KV head h, piece i, keys [lo, hi).
  struct Unit {
    int64_t item, b, n, h, i, lo, hi;
  };
  const int64_t step = fused ? Hkv : 1;  // items per unit
  auto unit_at = [&](int64_t u) {
    Unit w;
    w.item = u * step;
    w.b = std::upper_bound(starts, starts + B + 1, w.item) - starts - 1;
    w.n = (starts[w.b + 1] - starts[w.b]) / Hkv;
    w.h = (w.item - starts[w.b]) % Hkv;
    w.i = (w.item - starts[w.b]) / Hkv;
    const int64_t S = seq_lens[w.b], f = first_key(w.b);
    auto boundary = [&](int64_t j) { return j == 0 ? f : j == w.n ? S : (f + (S - f) * j / w.n) / kTile * kTile; };
    w.lo = boundary(w.i);
    w.hi = boundary(w.i + 1);
    return w;
  };
  if (fused) {
    // Units in chunks of at most kChunkUnits (fewer where there are under four chunks a
    // thread): a unit's last tile prefetches the first tile of the chunk's next unit.
    const int64_t units = item_start[B] / step;
    par::parallel_chunks(units, [&](int64_t begin, int64_t end) {
      static thread_local std::vector<HeadState<T, D, G>> states;
      states.resize(Hkv);
      alignas(64) int64_t next_rows[kTile];
      for (int64_t u = begin; u < end; ++u) {
        const Unit w = unit_at(u);
        const int64_t* next = nullptr;
        if (u + 1 < end) {
          const Unit v = unit_at(u + 1);
          tile_rows(block_tables + v.b * max_blocks, BS, stride, v.lo, v.hi, v.lo - v.lo % kTile, next_rows);
          next = next_rows;
        }
        attend_heads<T, D, G>(q + w.b * Hq * D, k_cache, v_cache, block_tables + w.b * max_blocks, BS, Hkv, scale,
                              w.lo, w.hi, next, states.data());
        for (int64_t k = 0; k < Hkv; ++k) finish(w.item + k, w.b, w.n, k, states[k]);
      }
    }, 2, std::min(kChunkUnits, par::default_grain(units)));
  } else {
    par::parallel_for(item_start[B], [&](int64_t u) {
      const Unit w = unit_at(u);
      HeadState<T, D, G> r;
      attend<T, D, G>(q + (w.b * Hq + w.h * G) * D, k_cache, v_cache, block_tables + w.b * max_blocks, BS, stride,
                      w.h, scale, w.lo, w.hi, r);
      finish(w.item, w.b, w.n, w.h, r);
    }, 2, split ? Hkv : 1);
  }
  if (!split) return;
  // Merge each split (request, KV head)'s pieces, in piece order: weights rescaled to the
  // largest max.
  par::parallel_for(B * Hkv, [&](int64_t bh) {
    const int64_t b = bh / Hkv, h = bh % Hkv, n = (starts[b + 1] - starts[b]) / Hkv;
    if (n == 1) return;
    const float* first_slot = slots + (starts[b] + h) * kSlot;  // piece i's is Hkv slots on
    for (int g = 0; g < G; ++g) {
      float mx = -1e30f;
      for (int64_t i = 0; i < n; ++i) mx = std::max(mx, first_slot[i * Hkv * kSlot + g * (D + 2)]);
      F32x16 acc[ND], l = zero();
      for (int c = 0; c < ND; ++c) acc[c] = zero();
      for (int64_t i = 0; i < n; ++i) {
        const float* slot = first_slot + i * Hkv * kSlot + g * (D + 2);
        const F32x16 w = exp_nonpositive(set1(slot[0] - mx));
        l = fma(w, set1(slot[1]), l);
        for (int c = 0; c < ND; ++c) acc[c] = fma(w, load(slot + 2 + 16 * c), acc[c]);
      }
      store_values<T, D>(out + (b * Hq + h * G + g) * D, acc, div(set1(1.f), l));
    }
  }, 2, 1);
}

template <typename T, int D, int G = 1>
int dispatch_group(int64_t group, const float* q, const T* kc, const T* vc, const int64_t* bt, int64_t mb,
                   const int64_t* sl, float* out, int64_t B, int64_t Hkv, int64_t BS, float scale, int64_t window) {
  if (group == G) {
    decode_attention<T, D, G>(q, kc, vc, bt, mb, sl, out, B, Hkv, BS, scale, window);
    return 0;
  }
  if constexpr (G < PAGEDLLM_MAX_GROUP) return dispatch_group<T, D, G + 1>(group, q, kc, vc, bt, mb, sl, out, B, Hkv, BS, scale, window);
  return -1;
}

template <typename T>
int dispatch(const void* q, const void* kc, const void* vc, const int64_t* bt, int64_t mb,
             const int64_t* sl, void* out, int64_t B, int64_t Hq, int64_t Hkv, int64_t D,
             int64_t BS, float scale, int64_t window) {
  if (Hq % Hkv) return -1;
  auto args = [&](auto fn) {
    return fn(Hq / Hkv, static_cast<const float*>(q), static_cast<const T*>(kc), static_cast<const T*>(vc), bt, mb, sl,
              static_cast<float*>(out), B, Hkv, BS, scale, window);
  };
  return head_dims::with(D, [&](auto d) { return args(dispatch_group<T, decltype(d)::value>); });
}

}  // namespace

// Built once per cache kind (kernels/build.py, PAGED_ATTENTION_CACHE = a PAGEDLLM_CACHE_*):
// each build is 24 instantiations of the kernel, about half a minute of the compiler, and the
// builds run on as many cores.
#if PAGED_ATTENTION_CACHE == PAGEDLLM_CACHE_BF16
#define PAGED_ATTENTION_ENTRY paged_decode_attention_bf16
using CacheT = uint16_t;
#elif PAGED_ATTENTION_CACHE == PAGEDLLM_CACHE_INT8
#define PAGED_ATTENTION_ENTRY paged_decode_attention_int8
using CacheT = int8_t;
#elif PAGED_ATTENTION_CACHE == PAGEDLLM_CACHE_FP8
#define PAGED_ATTENTION_ENTRY paged_decode_attention_fp8
using CacheT = kv::E4M3;
#else
#define PAGED_ATTENTION_ENTRY paged_decode_attention_f32
using CacheT = float;
#endif

int PAGED_ATTENTION_ENTRY(const void* q, const void* k_cache, const void* v_cache, const int64_t* block_tables,
                          int64_t max_blocks, const int64_t* seq_lens, void* out, int64_t B, int64_t Hq, int64_t Hkv,
                          int64_t D, int64_t BS, float scale, int64_t window) {
  return dispatch<CacheT>(q, k_cache, v_cache, block_tables, max_blocks, seq_lens, out, B, Hq, Hkv, D, BS, scale,
                          window);
}

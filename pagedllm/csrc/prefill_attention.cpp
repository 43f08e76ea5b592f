// Paged attention for prefill and chunked prefill on CPU: a request's n new query tokens
// attend causally (optionally within a sliding window) over its whole context, read in place
// through its block table, the step's own K/V included (written to the cache just before).
//
// FlashAttention-2's loop order (Dao 2023, "FlashAttention-2", §3.1) on the vector layer
// (vec.h): a tile is 16 query vectors, one per F32x16 lane, that share a KV head (the G query
// heads of a row are consecutive lanes, so grouped-query K/V are read once for all of them).
// Per block of keys, each key's scores for the 16 lanes come from the transposed queries
// multiplied with the key's broadcast elements; an online softmax per lane (running max and
// sum in registers) rescales the output, kept transposed ([D][16 lanes]) in L1. Work items are
// (request, KV head, up to kTiles consecutive tiles): the item's tiles share each preparation
// of a block and each broadcast element, every tile doing the same arithmetic in the same order
// as it would alone (a row's result does not depend on its neighbours). Masked scores are
// dropped by lane masks, so a lane whose keys all lie in later blocks gets weight 0, not exp(0).
// A block's K/V rows are prepared (below) into L1 once per item.
//
// What each cache kind computes:
// - float32: float32 throughout; q.K and p.V are FMAs of rows widened as stored.
// - bfloat16, fp8: float32, but for pair mode: on an ISA that multiplies bfloat16 pairs
//   (vec.h's kBf16Dot) and an even block size, both products take pairs, twice the
//   multiply-adds per instruction: q.K pairs a key's consecutive elements, p.V consecutive
//   keys. The queries (pre-scaled) and the softmax weights are rounded to bfloat16, as the
//   bfloat16 K/V are stored (fp8 rows: code times scale, rounded). Where Intel AMX runs
//   (amx::active()) and D is a multiple of 32, q.K's pairs are summed on the tiles instead
//   (amx_scores16, below).
// - int8: a score is an integer dot product. Each query vector is quantized once
//   (kv::quantize_query: D codes of q * scale and one code scale per lane), and
//   score = float(query codes . key codes) * (key row scale * the lane's code scale), the dot
//   product exact in int32 (vec.h's w8a8 primitives: the key's quads broadcast as x, the
//   tile's codes as the weights), so the same on every ISA. p.V too, as the decode kernel
//   computes it: per lane and group of 16 keys from a multiple of 16, the softmax weights times
//   their value rows' scales become codes in [0, 127] (w * 127 / the group's largest), whose
//   int32 sums with the value codes, four keys per instruction, go into the output times the
//   group's code scale. Keys are taken kMaxBlock at a time whatever the block size (looked up
//   key by key), the groups of a span summed into the output in registers.
// The running max, sums and output stay float32. Pairs of keys and groups are absolute (2m,
// 2m + 1; 16m .. 16m + 15), so a row's result still does not depend on its neighbours, the
// step's chunking or the tile's first key.
#include <stdint.h>

#include <algorithm>
#include <cstring>
#include <type_traits>
#include <vector>

#if defined(__x86_64__) && defined(__AVX512BF16__)
#define PREFILL_AMX 1
#include <immintrin.h>
#endif

#include "amx.h"
#include "gemm.h"
#include "head_dims.h"
#include "kv_rows.h"
#include "pagedllm_abi.h"
#include "parallel.h"
#include "vec.h"

using namespace vec;

namespace {

constexpr int kLanes = 16;
constexpr int kMaxBlock = PAGEDLLM_MAX_PREFILL_BLOCK;
// Query tiles that share each prepared block of keys, and independent FMA chains per tile
// (together they hide the FMA latency, 4 cycles at 2 per cycle): a key element broadcast
// once feeds every tile's chain. Sized so that tiles x chains accumulators fit in registers.
constexpr int kTiles = kF32Regs >= 32 ? 3 : 1;
constexpr int kChains = kF32Regs >= 32 ? 8 : 4;
// Integer scores take the kChains keys in halves: on AVX-512 GCC carries each int32 sum through
// the loop with a copy (I32x16 holds int64 lanes, the dot product's builtin takes int32 lanes),
// so a sum takes two registers, and kTiles x kChains of them spilled on every step.
constexpr int kIntChains = kChains / 2;
// Over an int8 cache p.V takes the softmax weights as codes per group of kGroup keys from a
// multiple of kGroup (the decode kernel's tiles), and steps keys a span of kMaxBlock at a time.
constexpr int kGroup = 16;
static_assert(kMaxBlock % kGroup == 0, "an int8 span is whole groups");

// Whether a tile's scores may come from AMX tiles (amx_scores16): pair mode, D whole tiles of 32.
template <int D, bool P, bool I>
inline constexpr bool kAmxScores = P && !I && D % 32 == 0;

#ifdef PREFILL_AMX
#pragma GCC push_options
#pragma GCC target("amx-tile,amx-bf16")
// Pair mode's scores on Intel AMX tiles (where amx::active(), D a multiple of 32): the block's
// prepared K rows are an A operand as they lie ([key][D / 2] pairs), a tile's transposed query
// pairs ([D / 2][16 lanes]) a B operand, so one tile of sums holds 16 keys' scores for the 16
// lanes, key by key as the vector loop leaves them. The products are the same bfloat16 pairs,
// summed in float32 in the tile unit's order (not the vector loop's: other bits, as far from
// exact), and a score depends only on its key's row and its lane's query, not on the rest of the
// tile or the block. amx_scores16: out[j][lane] = sum over d of K row j . the lane's query, for
// the 16 rows at k (stride bytes apart), on amx::start_tiles' tiles 0 (the sums), 1 (16 K rows
// by 32 elements) and 2 (16 query pairs by 16 lanes).
__attribute__((noinline)) void amx_scores16(const uint32_t* k, int64_t stride, const uint32_t* qt, int64_t D,
                                            float* out) {
  _tile_zero(0);
  for (int64_t c = 0; c < D / 32; ++c) {
    _tile_loadd(1, k + 16 * c, stride);
    _tile_loadd(2, qt + 16 * kLanes * c, 4 * kLanes);
    _tile_dpbf16ps(0, 1, 2);
  }
  _tile_stored(0, out, 4 * kLanes);
}
#pragma GCC pop_options
#endif

// One head's row as D float32 values.
template <typename T>
inline void load_row(float* dst, const T* src, int64_t D) {
  const float s = kv::row_scale(src, D);
  for (int64_t d = 0; d < D; d += 16) store(dst + d, kv::load16_scaled(src + d, s));
}

// A tile of 16 query vectors, one per lane, and its online softmax: queries transposed and
// pre-scaled (float32 [D][16 lanes]; in pair mode P bfloat16 pairs of elements [D / 2][16];
// with integer scores I, quads of codes [D / 4][16 lanes][4] stored as w8a8 weights are,
// gemm::stored_code, and each lane's code scale qs), the output transposed ([D][16 lanes], in
// L1), each lane's running max and sum.
template <int D, bool P, bool I>
struct Tile {
  alignas(64) std::conditional_t<I, int8_t[D / 4][4 * kLanes],
                                 std::conditional_t<P, uint32_t[D / 2][kLanes], float[D][kLanes]>> qt;
  alignas(64) float ot[D][kLanes];
  F32x16 qs, pos, m, l;  // qs: I only
  int64_t lo_key, hi_key;  // keys [lo_key, hi_key) hold every key some lane sees
  int64_t all_lo, all_hi;  // keys [all_lo, all_hi) are seen by every lane (none when all_lo >= all_hi)
};

// Keys k0 .. k0 + nk - 1 of one block as the products read them, rows from nk up to the next
// multiple of kChains zero: float32 rows; in pair mode K rows of bfloat16 pairs of elements
// ([key][D / 2]) and V's pairs of keys ([key / 2][D]: element d of keys 2i and 2i + 1). With
// integer codes I (an int8 cache; rows zero up to a multiple of kGroup, and outside the keys
// read), K is the rows' codes as stored, in quads ([key][D / 4]), with each key's -128 x code
// sum (dot_init's, read where kDotXSums) and row scale (0 for the zero rows); V is each quad of
// keys' codes interleaved (vec.h's interleave_rows4, per 64 elements: word 16 m + 4 q + i of
// a chunk holds element 16 q + 4 m + i of the four rows), with each key's row scale.
template <int D, bool P, bool I>
struct Block {
  alignas(64) std::conditional_t<I, int32_t[kMaxBlock][D / 4],
                                 std::conditional_t<P, uint32_t[kMaxBlock][D / 2], float[kMaxBlock][D]>> k;
  alignas(64) std::conditional_t<I, uint32_t[kMaxBlock / 4][D],
                                 std::conditional_t<P, uint32_t[kMaxBlock / 2][D], float[kMaxBlock][D]>> v;
  int32_t ksum128[I ? kMaxBlock : 1];
  float kscale[I ? kMaxBlock : 1];
  float vscale[I ? kMaxBlock : 1];
};

// Tiles t[0..NT) attend to the nk keys of b from key k0 on. Keys a lane may not see are
// dropped by its masks (causal: key <= pos; window: key > pos - window), so a tile given more
// keys than its own range computes exactly what it would on its own range: a dropped key adds
// 0 to the sum and to every output element.
template <int NT, int D, bool P, bool I>
void attend(Tile<D, P, I>* const* t, const Block<D, P, I>& b, int64_t k0, int64_t nk, F32x16 win_v,
            [[maybe_unused]] bool amx_scores) {
  constexpr int64_t kStep = I ? kGroup : kChains;  // a multiple of kChains
  const int64_t nkc = (nk + kStep - 1) / kStep * kStep;
  F32x16 s[NT][kMaxBlock];
  int64_t scored = 0;  // keys whose scores are in s
#ifdef PREFILL_AMX
  if constexpr (kAmxScores<D, P, I>) {
    if (amx_scores) {  // rows nkc .. the next multiple of 16 give sums that are never read
      alignas(64) float sums[16][kLanes];
      for (int64_t i0 = 0; i0 < nkc; i0 += 16)
        for (int u = 0; u < NT; ++u) {
          amx_scores16(b.k[i0], sizeof(b.k[0]), t[u]->qt[0], D, sums[0]);
          for (int j = 0; j < 16 && i0 + j < nkc; ++j) s[u][i0 + j] = load(sums[j]);
        }
      scored = nkc;
    }
  }
#endif
  for (int64_t i = scored; i < nkc; i += kChains) {
    if constexpr (I) {  // int32 sums of the key's quads (broadcast) times the lanes' quads
      for (int h = 0; h < kChains; h += kIntChains) {
        I32x16 a[NT][kIntChains];
        for (int u = 0; u < NT; ++u)
          for (int j = 0; j < kIntChains; ++j) a[u][j] = dot_init(&b.ksum128[i + h + j]);
        for (int d = 0; d < D / 4; ++d)
          for (int j = 0; j < kIntChains; ++j) {
            const DotX kd = dot_prepare(&b.k[i + h + j][d]);
            for (int u = 0; u < NT; ++u) a[u][j] = dot(a[u][j], kd, t[u]->qt[d]);
          }
        for (int u = 0; u < NT; ++u)
          for (int j = 0; j < kIntChains; ++j) s[u][i + h + j] = to_f32(a[u][j]);  // exact; scaled below
      }
    } else {
      F32x16 a[NT][kChains];
      for (int u = 0; u < NT; ++u)
        for (int j = 0; j < kChains; ++j) a[u][j] = zero();
      if constexpr (P) {
        for (int d = 0; d < D / 2; ++d) {
          BF16x32 qd[NT];
          for (int u = 0; u < NT; ++u) qd[u] = load_pairs(t[u]->qt[d]);
          for (int j = 0; j < kChains; ++j) {
            const BF16x32 kd = set1_pair(b.k[i + j][d]);
            for (int u = 0; u < NT; ++u) a[u][j] = dot_pairs(a[u][j], qd[u], kd);
          }
        }
      } else {
        for (int d = 0; d < D; ++d) {
          F32x16 qd[NT];
          for (int u = 0; u < NT; ++u) qd[u] = load(t[u]->qt[d]);
          for (int j = 0; j < kChains; ++j) {
            const F32x16 kd = set1(b.k[i + j][d]);
            for (int u = 0; u < NT; ++u) a[u][j] = fma(qd[u], kd, a[u][j]);
          }
        }
      }
      for (int u = 0; u < NT; ++u)
        for (int j = 0; j < kChains; ++j) s[u][i + j] = a[u][j];
    }
  }
  F32x16 corr[NT];
  bool rescale[NT];  // some lane's max moved (elsewhere corr is exactly 1)
  for (int u = 0; u < NT; ++u) {
    // Causal and window masks per lane (none where every lane sees the block's keys: the same
    // values); the block's max; the online softmax's rescale.
    const bool all = k0 >= t[u]->all_lo && k0 + nk <= t[u]->all_hi;
    M16 valid[kMaxBlock];
    F32x16 mx = t[u]->m;
    for (int64_t i = 0; i < nkc; ++i) {
      // Integer scores: the exact sum times (key scale x code scale), rounded once. An FMA (with
      // 0): -ffast-math may regroup two multiplies, and not alike in every instantiation
      // (attend<1> and attend<3> gave a row different bits).
      if constexpr (I) s[u][i] = fma(s[u][i], mul(set1(b.kscale[i]), t[u]->qs), zero());
      if (all) {
        if (i < nk) mx = max(mx, s[u][i]);
        continue;
      }
      const F32x16 kp = set1(static_cast<float>(k0 + i));
      valid[i] = i < nk ? le(kp, t[u]->pos) & gt(kp, sub(t[u]->pos, win_v)) : mask_first(0);
      mx = select(valid[i], max(mx, s[u][i]), mx);
    }
    rescale[u] = any(gt(mx, t[u]->m));
    corr[u] = exp_nonpositive(sub(t[u]->m, mx));
    t[u]->m = mx;
    F32x16 l = mul(t[u]->l, corr[u]);
    for (int64_t i = 0; i < nkc; ++i) {
      s[u][i] = all ? (i < nk ? exp_nonpositive(sub(s[u][i], mx)) : zero()) : maskz(valid[i], exp_nonpositive(sub(s[u][i], mx)));
      l = add(l, s[u][i]);
    }
    t[u]->l = l;
  }
  if constexpr (I) {
    // Output += P V in integers, per tile and group of kGroup keys: the weights times their
    // value rows' scales as codes in [0, 127] per lane (w * 127 / the lane's largest in the
    // group, rounded to nearest even), four keys' codes per lane against each value element's
    // four codes (broadcast once for every tile), the int32 sums times the lane's code scale
    // (largest / 127) into the output, group after group. Words w0 .. w0 + 3 of an interleaved
    // chunk are elements d0 .. d0 + 3: four chains per tile, each output vector loaded and
    // stored once per span, not once per group.
    constexpr int kMaxGroups = kMaxBlock / kGroup;
    const int64_t ng = nkc / kGroup;
    U8x64 pq[kMaxGroups][NT][kGroup / 4];
    F32x16 ps[kMaxGroups][NT];
    for (int64_t g = 0; g < ng; ++g)
      for (int u = 0; u < NT; ++u) {
        F32x16 w[kGroup], mx = zero();
        for (int i = 0; i < kGroup; ++i) {
          w[i] = mul(s[u][kGroup * g + i], set1(b.vscale[kGroup * g + i]));
          mx = max(mx, w[i]);
        }
        const kv::WeightCodeScale cs = kv::weight_code_scale(mx);
        ps[g][u] = cs.scale;
        for (int qd = 0; qd < kGroup / 4; ++qd) {
          const F32x16* x = w + 4 * qd;
          pq[g][u][qd] = pack_u8x4(round_i32(mul(x[0], cs.inv)), round_i32(mul(x[1], cs.inv)),
                                   round_i32(mul(x[2], cs.inv)), round_i32(mul(x[3], cs.inv)));
        }
      }
    for (int c = 0; c < D / 64; ++c)
      for (int m = 0; m < 4; ++m)
        for (int q = 0; q < 4; ++q) {
          const int w0 = 64 * c + 16 * m + 4 * q, d0 = 64 * c + 16 * q + 4 * m;
          F32x16 o[NT][4];
          for (int u = 0; u < NT; ++u)
            for (int j = 0; j < 4; ++j) {
              o[u][j] = load(t[u]->ot[d0 + j]);
              if (rescale[u]) o[u][j] = mul(o[u][j], corr[u]);
            }
          for (int64_t g = 0; g < ng; ++g) {
            const uint32_t(*v)[D] = b.v + kGroup / 4 * g;
            I32x16 a[NT][4];
            for (int u = 0; u < NT; ++u)
              for (int j = 0; j < 4; ++j) a[u][j] = zero_i32();
            for (int qd = 0; qd < kGroup / 4; ++qd)
              for (int j = 0; j < 4; ++j) {
                const uint32_t x = v[qd][w0 + j];
                for (int u = 0; u < NT; ++u) a[u][j] = dot_u8s8_splat(a[u][j], pq[g][u][qd], x);
              }
            for (int u = 0; u < NT; ++u)
              for (int j = 0; j < 4; ++j) o[u][j] = fma(to_f32(a[u][j]), ps[g][u], o[u][j]);
          }
          for (int u = 0; u < NT; ++u)
            for (int j = 0; j < 4; ++j) store(t[u]->ot[d0 + j], o[u][j]);
        }
    return;
  }
  // Output += P V, transposed, C value elements at a time (one chain each per tile). Pair mode
  // takes half the chains: the weights of a pair of keys stay in registers beside them.
  constexpr int C = P ? kChains / 2 : kChains;
  [[maybe_unused]] BF16x32 pp[P ? NT : 1][P ? kMaxBlock / 2 : 1];  // pair mode: the weights of keys 2i, 2i + 1
  if constexpr (P) {
    for (int u = 0; u < NT; ++u)
      for (int64_t i = 0; i < nkc; i += 2) pp[u][i / 2] = pack_pairs(s[u][i], s[u][i + 1]);
  }
  for (int d = 0; d < D; d += C) {
    F32x16 o[NT][C];
    for (int u = 0; u < NT; ++u)
      for (int j = 0; j < C; ++j) o[u][j] = rescale[u] ? mul(load(t[u]->ot[d + j]), corr[u]) : load(t[u]->ot[d + j]);
    if constexpr (P) {
      for (int64_t i = 0; i < nkc / 2; ++i) {
        BF16x32 pi[NT];
        for (int u = 0; u < NT; ++u) pi[u] = pp[u][i];
        for (int j = 0; j < C; ++j) {
          const BF16x32 vd = set1_pair(b.v[i][d + j]);
          for (int u = 0; u < NT; ++u) o[u][j] = dot_pairs(o[u][j], pi[u], vd);
        }
      }
    } else {
      for (int64_t i = 0; i < nkc; ++i)
        for (int j = 0; j < C; ++j) {
          const F32x16 vd = set1(b.v[i][d + j]);
          for (int u = 0; u < NT; ++u) o[u][j] = fma(s[u][i], vd, o[u][j]);
        }
    }
    for (int u = 0; u < NT; ++u)
      for (int j = 0; j < C; ++j) store(t[u]->ot[d + j], o[u][j]);
  }
}

// attend<n> for a count n in [1, kTiles] known only at run time.
template <int D, bool P, bool I, int N = kTiles>
void attend_n(int n, Tile<D, P, I>* const* t, const Block<D, P, I>& b, int64_t k0, int64_t nk, F32x16 win_v,
              bool amx_scores) {
  if constexpr (N > 1) {
    if (n < N) return attend_n<D, P, I, N - 1>(n, t, b, k0, nk, win_v, amx_scores);
  }
  attend<N, D, P, I>(t, b, k0, nk, win_v, amx_scores);
}

// Rows k0 .. k0 + nk - 1 of a block (k, v: the first key's row of the head; stride: elements
// from one key's row to the next) into b, zeros up to nkc rows.
template <typename T, int D, bool P>
void prepare(Block<D, P, false>& b, const T* k, const T* v, int64_t stride, int64_t nk, int64_t nkc) {
  for (int64_t i = 0; i < nkc; ++i) {
    const T* row = k + i * stride;
    if constexpr (P) {
      uint16_t* dst = reinterpret_cast<uint16_t*>(b.k[i]);
      if (i >= nk) {
        std::fill_n(dst, D, uint16_t(0));
      } else if constexpr (std::is_same_v<T, uint16_t>) {
        std::memcpy(dst, row, D * sizeof(uint16_t));
      } else {
        const float sc = kv::row_scale(row, D);
        for (int64_t d = 0; d < D; d += 16) store_bf16_first(dst + d, kv::load16_scaled(row + d, sc), 16);
      }
    } else {
      if (i < nk) load_row(b.k[i], row, D);
      else std::fill_n(b.k[i], D, 0.f);
    }
  }
  if constexpr (P) {
    for (int64_t i = 0; i < nkc; i += 2) {
      const float s0 = i < nk ? kv::row_scale(v + i * stride, D) : 0.f;
      const float s1 = i + 1 < nk ? kv::row_scale(v + (i + 1) * stride, D) : 0.f;
      for (int64_t d = 0; d < D; d += 16) {
        const F32x16 a = i < nk ? kv::load16_scaled(v + i * stride + d, s0) : zero();
        const F32x16 c = i + 1 < nk ? kv::load16_scaled(v + (i + 1) * stride + d, s1) : zero();
        store_pairs(b.v[i / 2] + d, pack_pairs(a, c));
      }
    }
  } else {
    for (int64_t i = 0; i < nkc; ++i) {
      if (i < nk) load_row(b.v[i], v + i * stride, D);
      else std::fill_n(b.v[i], D, 0.f);
    }
  }
}

// An int8 cache's keys g0 .. g0 + nkc - 1 into b (integer codes): key g0 + i's rows at offset
// rows[i] in k and v for i in [lo, nk), every other row zero (not read).
template <int D>
void prepare_codes(Block<D, false, true>& b, const int8_t* k, const int8_t* v, const int64_t* rows, int64_t lo,
                   int64_t nk, int64_t nkc) {
  alignas(64) static constexpr int8_t kZeros[D] = {};
  for (int64_t i = 0; i < nkc; ++i) {
    int8_t* dst = reinterpret_cast<int8_t*>(b.k[i]);
    if (i >= lo && i < nk) std::memcpy(dst, k + rows[i], D);
    else std::fill_n(dst, D, int8_t(0));
  }
  // 16 keys at a time: their K and V row scales (one conversion of 16 float16 values each; 0
  // for the zero rows) and code sums (dot products with ones, summed per key by the
  // transpose-and-add tree; exact: |sum| <= 127 D < 2^24).
  for (int64_t i0 = 0; i0 < nkc; i0 += 16) {
    store(b.kscale + i0, kv::row_scales16(k, rows + i0, D, lo - i0, nk - i0));
    store(b.vscale + i0, kv::row_scales16(v, rows + i0, D, lo - i0, nk - i0));
    alignas(64) float sums[16] = {};
    if constexpr (kDotXSums) {
      F32x16 part[16];
      for (int j = 0; j < 16; ++j) {
        I32x16 a = zero_i32();
        for (int c = 0; c < D / 64; ++c)
          a = dot_u8s8(a, splat_u32(0x01010101u), reinterpret_cast<const int8_t*>(b.k[i0 + j]) + 64 * c);
        part[j] = to_f32(a);
      }
      store(sums, reduce_add16(part));
    }
    for (int j = 0; j < 16; ++j) b.ksum128[i0 + j] = -128 * static_cast<int32_t>(sums[j]);
  }
  for (int64_t qd = 0; qd < nkc / 4; ++qd)
    for (int c = 0; c < D / 64; ++c) {
      const int8_t* r[4];
      for (int j = 0; j < 4; ++j) {
        const int64_t i = 4 * qd + j;
        r[j] = (i >= lo && i < nk ? v + rows[i] : kZeros) + 64 * c;
      }
      interleave_rows4(r, reinterpret_cast<int8_t*>(b.v[qd]) + 256 * c);
    }
}

template <typename T, int D, bool P, bool I>
void prefill_attention(const float* q, int64_t ldq, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                       int64_t max_blocks, const int64_t* query_starts, const int64_t* query_lens,
                       const int64_t* seq_lens, float* out, int64_t R, int64_t Hq, int64_t Hkv, int64_t BS,
                       float scale, int64_t window) {
  constexpr int64_t RW = kv::row_width<T>(D);  // elements of a head's row
  const int64_t G = Hq / Hkv, stride = Hkv * RW;  // stride: between consecutive slots of one head
  // Items: (request, KV head, group of up to kTiles consecutive tiles of 16 query vectors).
  std::vector<int64_t> first_item(R + 1, 0);
  const auto tiles_of = [&](int64_t r) { return (query_lens[r] * G + kLanes - 1) / kLanes; };
  for (int64_t r = 0; r < R; ++r) first_item[r + 1] = first_item[r] + Hkv * ((tiles_of(r) + kTiles - 1) / kTiles);
#ifdef PREFILL_AMX
  const bool amx_scores = kAmxScores<D, P, I> && amx::active();
#else
  constexpr bool amx_scores = false;
#endif
  par::parallel_for(first_item[R], [&](int64_t item) {
#ifdef PREFILL_AMX
    if (amx_scores) amx::start_tiles();
#endif
    const int64_t r = std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
    const int64_t groups = (first_item[r + 1] - first_item[r]) / Hkv;
    const int64_t h = (item - first_item[r]) / groups, group = (item - first_item[r]) % groups;
    const int64_t n = query_lens[r], S = seq_lens[r], first_pos = S - n;
    const int64_t* table = block_tables + r * max_blocks;
    const int nt = static_cast<int>(std::min<int64_t>(kTiles, tiles_of(r) - group * kTiles));

    // Tile u's lanes: vector j = (group * kTiles + u) * 16 + lane is query row j / G, head h * G + j % G.
    Tile<D, P, I> tiles[kTiles];
    int64_t lo_key = S, hi_key = 0;
    for (int u = 0; u < nt; ++u) {
      Tile<D, P, I>& t = tiles[u];
      alignas(64) float qpos[kLanes];
      [[maybe_unused]] alignas(64) float qsc[kLanes];  // I: the lanes' code scales
      [[maybe_unused]] alignas(64) int8_t codes[I ? D : 1];  // I: one lane's codes
      [[maybe_unused]] alignas(64) float qtmp[P && !I ? D : 1][kLanes];  // pair mode: the queries before rounding
      [[maybe_unused]] float (*qf)[kLanes] = nullptr;  // the float32 queries (not I)
      if constexpr (P && !I) qf = qtmp;
      else if constexpr (!I) qf = t.qt;
      // I: lane's codes into the tile's quads as the dot product reads them.
      [[maybe_unused]] const auto put_codes = [&](int lane) {
        for (int d = 0; d < D; ++d) t.qt[d / 4][4 * lane + d % 4] = gemm::stored_code(codes[d]);
      };
      t.lo_key = S, t.hi_key = 0, t.all_lo = 0, t.all_hi = S;
      for (int lane = 0; lane < kLanes; ++lane) {
        const int64_t j = (group * kTiles + u) * kLanes + lane, row = j / G;
        for (int d = 0; d < D; ++d) t.ot[d][lane] = 0.f;
        if (row >= n) {
          qpos[lane] = -1.f;  // no keys: every score masked
          t.all_hi = 0;
          if constexpr (I) {
            qsc[lane] = 0.f;
            std::fill_n(codes, D, int8_t(0));
            put_codes(lane);
          } else {
            for (int d = 0; d < D; ++d) qf[d][lane] = 0.f;
          }
          continue;
        }
        const int64_t pos = first_pos + row;
        qpos[lane] = static_cast<float>(pos);
        t.lo_key = std::min(t.lo_key, window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0);
        t.hi_key = std::max(t.hi_key, pos + 1);
        t.all_lo = std::max(t.all_lo, window > 0 ? pos - window + 1 : 0), t.all_hi = std::min(t.all_hi, pos + 1);
        const float* src = q + (query_starts[r] + row) * ldq + (h * G + j % G) * D;
        if constexpr (I) {
          qsc[lane] = kv::quantize_query<D>(src, scale, codes);
          put_codes(lane);
        } else {
          for (int d = 0; d < D; ++d) qf[d][lane] = src[d] * scale;
        }
      }
      if constexpr (I) {
        t.qs = load(qsc);
      } else if constexpr (P) {
        for (int d = 0; d < D; d += 2) store_pairs(t.qt[d / 2], pack_pairs(load(qf[d]), load(qf[d + 1])));
      }
      t.pos = load(qpos);
      t.m = set1(-1e30f), t.l = zero();  // finite: -ffast-math
      lo_key = std::min(lo_key, t.lo_key), hi_key = std::max(hi_key, t.hi_key);
    }
    const F32x16 win_v = set1(window > 0 ? static_cast<float>(window) : 1e30f);
    Block<D, P, I> b;

    // Per span of keys (a block; over an int8 cache, kMaxBlock keys from a multiple of it, their
    // rows looked up key by key, so that the output is loaded and stored once per kMaxBlock
    // keys), the tiles whose own range reaches into it (every tile sees the same spans it would
    // alone), all fed from one preparation of its rows.
    const int64_t SP = I ? kMaxBlock : BS;
    for (int64_t blk = lo_key / SP; blk * SP < hi_key; ++blk) {
      Tile<D, P, I>* active[kTiles];
      int na = 0;
      int64_t k0 = (blk + 1) * SP, k1 = blk * SP;
      for (int u = 0; u < nt; ++u) {
        Tile<D, P, I>& t = tiles[u];
        if (t.lo_key / SP > blk || blk * SP >= t.hi_key) continue;
        active[na++] = &t;
        k0 = std::min(k0, std::max(blk * SP, t.lo_key)), k1 = std::max(k1, std::min((blk + 1) * SP, t.hi_key));
      }
      if (na == 0) continue;
      if constexpr (I) {
        // From the first key's group on: the keys before k0 (below every active lane's window)
        // are zero rows, masked.
        const int64_t g0 = k0 - k0 % kGroup, nk = k1 - g0, nkc = (nk + kGroup - 1) / kGroup * kGroup;
        alignas(64) int64_t rows[kMaxBlock];
        for (int64_t x = k0; x < k1; ++x) rows[x - g0] = (table[x / BS] * BS + x % BS) * stride + h * RW;
        prepare_codes(b, k_cache, v_cache, rows, k0 - g0, nk, nkc);
        attend_n<D, P, I>(na, active, b, g0, nk, win_v, false);
      } else {
        if constexpr (P) k0 &= ~int64_t(1);  // absolute pairs of keys for p.V (BS is even: still in the block)
        const int64_t nk = k1 - k0, nkc = (nk + kChains - 1) / kChains * kChains;
        const int64_t first = table[blk] * BS * stride + h * RW + (k0 - blk * BS) * stride;
        prepare(b, k_cache + first, v_cache + first, stride, nk, nkc);
        attend_n<D, P, I>(na, active, b, k0, nk, win_v, amx_scores);
      }
    }
    for (int u = 0; u < nt; ++u) {
      const Tile<D, P, I>& t = tiles[u];
      alignas(64) float inv[kLanes];
      store(inv, div(set1(1.f), t.l));
      for (int64_t lane = 0; lane < kLanes; ++lane) {
        const int64_t j = (group * kTiles + u) * kLanes + lane;
        if (j / G >= n) break;
        float* dst = out + (query_starts[r] + j / G) * Hq * D + (h * G + j % G) * D;
        for (int d = 0; d < D; ++d) dst[d] = t.ot[d][lane] * inv[lane];
      }
    }
#ifdef PREFILL_AMX
    if (amx_scores) amx::stop_tiles();
#endif
  }, 2, 1);
}

template <typename T>
int dispatch(const float* q, int64_t ldq, const void* kc, const void* vc, const int64_t* bt, int64_t mb,
             const int64_t* qs, const int64_t* ql, const int64_t* sl, float* out, int64_t R, int64_t Hq, int64_t Hkv,
             int64_t D, int64_t BS, float scale, int64_t window) {
  if (Hq % Hkv || BS > kMaxBlock) return -1;
  const T* k = static_cast<const T*>(kc);
  const T* v = static_cast<const T*>(vc);
  return head_dims::with(D, [&](auto d) {
    constexpr int kD = decltype(d)::value;
    if constexpr (kv::kIntCodes<T>) {
      prefill_attention<T, kD, false, true>(q, ldq, k, v, bt, mb, qs, ql, sl, out, R, Hq, Hkv, BS, scale, window);
      return 0;
    } else {
      if constexpr (kBf16Dot && !std::is_same_v<T, float>) {
        if (BS % 2 == 0) {
          prefill_attention<T, kD, true, false>(q, ldq, k, v, bt, mb, qs, ql, sl, out, R, Hq, Hkv, BS, scale, window);
          return 0;
        }
      }
      prefill_attention<T, kD, false, false>(q, ldq, k, v, bt, mb, qs, ql, sl, out, R, Hq, Hkv, BS, scale, window);
      return 0;
    }
  });
}

}  // namespace

// q: rows of Hq * D float32 at row stride ldq (this step's queries, flattened over requests);
// caches [num_blocks, BS, Hkv, row] of cache_kind (kv_rows.h); per request r < R: block_tables
// [R, max_blocks], query_starts (first row in q and out), query_lens (n), seq_lens (context
// after this step; the queries are its last n positions). out: [rows, Hq * D] float32, only
// the requests' rows written. window > 0: a query at p sees keys p - window + 1 .. p.
// Returns -1 (nothing written) for an unsupported shape or cache kind.
int paged_prefill_attention(int cache_kind, const float* q, int64_t ldq, const void* k_cache, const void* v_cache,
                            const int64_t* block_tables, int64_t max_blocks, const int64_t* query_starts,
                            const int64_t* query_lens, const int64_t* seq_lens, float* out, int64_t R, int64_t Hq,
                            int64_t Hkv, int64_t D, int64_t BS, float scale, int64_t window) {
  auto run = [&](auto* typed) {
    return dispatch<std::remove_pointer_t<decltype(typed)>>(q, ldq, k_cache, v_cache, block_tables, max_blocks,
                                                           query_starts, query_lens, seq_lens, out, R, Hq, Hkv, D, BS,
                                                           scale, window);
  };
  return kv::with_cache_kind(cache_kind, run);
}

// Paged attention for prefill and chunked prefill on CPU: a request's n new query tokens
// attend causally (optionally within a sliding window) over its whole context, read in place
// through its block table, the step's own K/V included (written to the cache just before).
//
// FlashAttention-2's loop order (Dao 2023, "FlashAttention-2", §3.1) on the vector layer
// (vec.h): a tile is 16 query vectors, one per F32x16 lane, that share a KV head (the G query
// heads of a row are consecutive lanes, so grouped-query K/V are read once for all of them).
// Per block of keys, each key's scores for the 16 lanes come from D FMAs of the transposed
// queries with the key's broadcast elements; an online softmax per lane (running max and sum in
// registers) rescales the output, kept transposed ([D][16 lanes]) in L1. Work items are
// (request, KV head, up to kTiles consecutive tiles): the item's tiles share each widening of
// a block and each broadcast element, every tile doing the same arithmetic in the same order as
// it would alone (a row's result does not depend on its neighbours). Masked scores are dropped
// by lane masks, so a lane whose keys all lie in later blocks gets weight 0, not exp(0). All
// arithmetic float32, whatever the storage dtype: a block's K/V rows are widened (8-bit codes
// times their row's scale, kv_rows.h) into L1 once per item.
#include <stdint.h>

#include <algorithm>
#include <type_traits>
#include <vector>

#include "head_dims.h"
#include "kv_rows.h"
#include "pagedllm_abi.h"
#include "parallel.h"
#include "vec.h"

using namespace vec;

namespace {

constexpr int kLanes = 16;
constexpr int kMaxBlock = PAGEDLLM_MAX_PREFILL_BLOCK;
// Query tiles that share each widened block of keys, and independent FMA chains per tile
// (together they hide the FMA latency, 4 cycles at 2 per cycle): a key element broadcast
// once feeds every tile's chain. Sized so that tiles x chains accumulators fit in registers.
constexpr int kTiles = kF32Regs >= 32 ? 3 : 1;
constexpr int kChains = kF32Regs >= 32 ? 8 : 4;

// One head's row as D float32 values.
template <typename T>
inline void load_row(float* dst, const T* src, int64_t D) {
  const float s = kv::row_scale(src, D);
  for (int64_t d = 0; d < D; d += 16) store(dst + d, kv::load16_scaled(src + d, s));
}

// A tile of 16 query vectors, one per lane, and its online softmax: queries transposed and
// pre-scaled, the output transposed ([D][16 lanes], in L1), each lane's running max and sum.
template <int D>
struct Tile {
  alignas(64) float qt[D][kLanes];
  alignas(64) float ot[D][kLanes];
  F32x16 pos, m, l;
  int64_t lo_key, hi_key;  // keys [lo_key, hi_key) hold every key some lane sees
};

// Tiles t[0..NT) attend to keys k0 .. k0 + nk - 1 of one block, widened into kb / vb (rows
// from nk up to the next multiple of kChains zero). Keys a lane may not see are dropped by
// its masks (causal: key <= pos; window: key > pos - window), so a tile given more keys than
// its own range computes exactly what it would on its own range: a dropped key adds 0 to the
// sum and to every output element.
template <int NT, int D>
void attend(Tile<D>* const* t, const float (*kb)[D], const float (*vb)[D], int64_t k0, int64_t nk, F32x16 win_v) {
  const int64_t nkc = (nk + kChains - 1) / kChains * kChains;
  F32x16 s[NT][kMaxBlock];
  for (int64_t i = 0; i < nkc; i += kChains) {
    F32x16 a[NT][kChains];
    for (int u = 0; u < NT; ++u)
      for (int j = 0; j < kChains; ++j) a[u][j] = zero();
    for (int d = 0; d < D; ++d) {
      F32x16 qd[NT];
      for (int u = 0; u < NT; ++u) qd[u] = load(t[u]->qt[d]);
      for (int j = 0; j < kChains; ++j) {
        const F32x16 kd = set1(kb[i + j][d]);
        for (int u = 0; u < NT; ++u) a[u][j] = fma(qd[u], kd, a[u][j]);
      }
    }
    for (int u = 0; u < NT; ++u)
      for (int j = 0; j < kChains; ++j) s[u][i + j] = a[u][j];
  }
  F32x16 corr[NT];
  for (int u = 0; u < NT; ++u) {
    // Causal and window masks per lane; the block's max; the online softmax's rescale.
    M16 valid[kMaxBlock];
    F32x16 mx = t[u]->m;
    for (int64_t i = 0; i < nkc; ++i) {
      const F32x16 kp = set1(static_cast<float>(k0 + i));
      valid[i] = i < nk ? le(kp, t[u]->pos) & gt(kp, sub(t[u]->pos, win_v)) : mask_first(0);
      mx = select(valid[i], max(mx, s[u][i]), mx);
    }
    corr[u] = exp_nonpositive(sub(t[u]->m, mx));
    t[u]->m = mx;
    F32x16 l = mul(t[u]->l, corr[u]);
    for (int64_t i = 0; i < nkc; ++i) {
      s[u][i] = maskz(valid[i], exp_nonpositive(sub(s[u][i], mx)));
      l = add(l, s[u][i]);
    }
    t[u]->l = l;
  }
  // Output += P V, transposed, kChains value elements at a time (one chain each per tile).
  for (int d = 0; d < D; d += kChains) {
    F32x16 o[NT][kChains];
    for (int u = 0; u < NT; ++u)
      for (int j = 0; j < kChains; ++j) o[u][j] = mul(load(t[u]->ot[d + j]), corr[u]);
    for (int64_t i = 0; i < nkc; ++i)
      for (int j = 0; j < kChains; ++j) {
        const F32x16 vd = set1(vb[i][d + j]);
        for (int u = 0; u < NT; ++u) o[u][j] = fma(s[u][i], vd, o[u][j]);
      }
    for (int u = 0; u < NT; ++u)
      for (int j = 0; j < kChains; ++j) store(t[u]->ot[d + j], o[u][j]);
  }
}

// attend<n> for a count n in [1, kTiles] known only at run time.
template <int D, int N = kTiles>
void attend_n(int n, Tile<D>* const* t, const float (*kb)[D], const float (*vb)[D], int64_t k0, int64_t nk,
              F32x16 win_v) {
  if constexpr (N > 1) {
    if (n < N) return attend_n<D, N - 1>(n, t, kb, vb, k0, nk, win_v);
  }
  attend<N, D>(t, kb, vb, k0, nk, win_v);
}

template <typename T, int D>
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
  par::parallel_for(first_item[R], [&](int64_t item) {
    const int64_t r = std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
    const int64_t groups = (first_item[r + 1] - first_item[r]) / Hkv;
    const int64_t h = (item - first_item[r]) / groups, group = (item - first_item[r]) % groups;
    const int64_t n = query_lens[r], S = seq_lens[r], first_pos = S - n;
    const int64_t* table = block_tables + r * max_blocks;
    const int nt = static_cast<int>(std::min<int64_t>(kTiles, tiles_of(r) - group * kTiles));

    // Tile u's lanes: vector j = (group * kTiles + u) * 16 + lane is query row j / G, head h * G + j % G.
    Tile<D> tiles[kTiles];
    int64_t lo_key = S, hi_key = 0;
    for (int u = 0; u < nt; ++u) {
      Tile<D>& t = tiles[u];
      alignas(64) float qpos[kLanes];
      t.lo_key = S, t.hi_key = 0;
      for (int lane = 0; lane < kLanes; ++lane) {
        const int64_t j = (group * kTiles + u) * kLanes + lane, row = j / G;
        for (int d = 0; d < D; ++d) t.ot[d][lane] = 0.f;
        if (row >= n) {
          qpos[lane] = -1.f;  // no keys: every score masked
          for (int d = 0; d < D; ++d) t.qt[d][lane] = 0.f;
          continue;
        }
        const int64_t pos = first_pos + row;
        qpos[lane] = static_cast<float>(pos);
        t.lo_key = std::min(t.lo_key, window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0);
        t.hi_key = std::max(t.hi_key, pos + 1);
        const float* src = q + (query_starts[r] + row) * ldq + (h * G + j % G) * D;
        for (int d = 0; d < D; ++d) t.qt[d][lane] = src[d] * scale;
      }
      t.pos = load(qpos);
      t.m = set1(-1e30f), t.l = zero();  // finite: -ffast-math
      lo_key = std::min(lo_key, t.lo_key), hi_key = std::max(hi_key, t.hi_key);
    }
    const F32x16 win_v = set1(window > 0 ? static_cast<float>(window) : 1e30f);
    alignas(64) float kb[kMaxBlock][D], vb[kMaxBlock][D];

    // Per block of keys, the tiles whose own range reaches into it (every tile sees the same
    // blocks it would alone), all fed from one widening of the block's rows.
    for (int64_t blk = lo_key / BS; blk * BS < hi_key; ++blk) {
      Tile<D>* active[kTiles];
      int na = 0;
      int64_t k0 = (blk + 1) * BS, k1 = blk * BS;
      for (int u = 0; u < nt; ++u) {
        Tile<D>& t = tiles[u];
        if (t.lo_key / BS > blk || blk * BS >= t.hi_key) continue;
        active[na++] = &t;
        k0 = std::min(k0, std::max(blk * BS, t.lo_key)), k1 = std::max(k1, std::min((blk + 1) * BS, t.hi_key));
      }
      if (na == 0) continue;
      const int64_t nk = k1 - k0, nkc = (nk + kChains - 1) / kChains * kChains;
      const int64_t base = table[blk] * BS * stride + h * RW;
      for (int64_t i = 0; i < nkc; ++i) {
        if (i < nk) {
          load_row(kb[i], k_cache + base + (k0 - blk * BS + i) * stride, D);
          load_row(vb[i], v_cache + base + (k0 - blk * BS + i) * stride, D);
        } else {
          std::fill_n(kb[i], D, 0.f), std::fill_n(vb[i], D, 0.f);
        }
      }
      attend_n<D>(na, active, kb, vb, k0, nk, win_v);
    }
    for (int u = 0; u < nt; ++u) {
      const Tile<D>& t = tiles[u];
      alignas(64) float inv[kLanes];
      store(inv, div(set1(1.f), t.l));
      for (int64_t lane = 0; lane < kLanes; ++lane) {
        const int64_t j = (group * kTiles + u) * kLanes + lane;
        if (j / G >= n) break;
        float* dst = out + (query_starts[r] + j / G) * Hq * D + (h * G + j % G) * D;
        for (int d = 0; d < D; ++d) dst[d] = t.ot[d][lane] * inv[lane];
      }
    }
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
    prefill_attention<T, decltype(d)::value>(q, ldq, k, v, bt, mb, qs, ql, sl, out, R, Hq, Hkv, BS, scale, window);
    return 0;
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

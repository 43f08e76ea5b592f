// Paged attention for prefill and chunked prefill on CPU: a request's n new query tokens
// attend causally (optionally within a sliding window) over its whole context, read in place
// through its block table, the step's own K/V included (written to the cache just before).
//
// FlashAttention-2's loop order (Dao 2023, "FlashAttention-2", §3.1) on the vector layer
// (vec.h): a tile is 16 query vectors, one per F32x16 lane, that share a KV head (the G query heads of a row are
// consecutive lanes, so grouped-query K/V are read once for all of them). Per block of keys,
// each key's scores for the 16 lanes come from D FMAs of the transposed queries with the key's
// broadcast elements; an online softmax per lane (running max and sum in registers) rescales
// the output, kept transposed ([D][16 lanes]) in L1. Work items are (request, KV head, tile).
// Masked scores are dropped by lane masks, so a lane whose keys all lie in later blocks gets
// weight 0, not exp(0). All arithmetic float32, whatever the storage dtype: a block's K/V rows
// are widened (8-bit codes times their row's scale, kv_rows.h) into L1 once per tile.
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
// Independent FMA chains that hide the FMA latency (4 cycles at 2 per cycle): eight F32x16
// where they fit in registers (AVX-512), else four (each already 2-4 registers).
constexpr int kChains = kF32Regs >= 32 ? 8 : 4;

// One head's row as D float32 values.
template <typename T>
inline void load_row(float* dst, const T* src, int64_t D) {
  const float s = kv::row_scale(src, D);
  for (int64_t d = 0; d < D; d += 16) store(dst + d, kv::load16_scaled(src + d, s));
}

template <typename T, int D>
void prefill_attention(const float* q, int64_t ldq, const T* k_cache, const T* v_cache, const int64_t* block_tables,
                       int64_t max_blocks, const int64_t* query_starts, const int64_t* query_lens,
                       const int64_t* seq_lens, float* out, int64_t R, int64_t Hq, int64_t Hkv, int64_t BS,
                       float scale, int64_t window) {
  constexpr int64_t RW = kv::row_width<T>(D);  // elements of a head's row
  const int64_t G = Hq / Hkv, stride = Hkv * RW;  // stride: between consecutive slots of one head
  // Items: (request, KV head, tile of 16 query vectors), tiles of a request in order.
  std::vector<int64_t> first_item(R + 1, 0);
  for (int64_t r = 0; r < R; ++r) first_item[r + 1] = first_item[r] + Hkv * ((query_lens[r] * G + kLanes - 1) / kLanes);
  par::parallel_for(first_item[R], [&](int64_t item) {
    const int64_t r = std::upper_bound(first_item.begin(), first_item.end(), item) - first_item.begin() - 1;
    const int64_t tiles = (first_item[r + 1] - first_item[r]) / Hkv;
    const int64_t h = (item - first_item[r]) / tiles, tile = (item - first_item[r]) % tiles;
    const int64_t n = query_lens[r], S = seq_lens[r], first_pos = S - n;
    const int64_t* table = block_tables + r * max_blocks;

    // The tile's lanes: vector j = tile * 16 + lane is query row j / G, head h * G + j % G.
    alignas(64) float qt[D][kLanes];  // queries transposed, pre-scaled
    alignas(64) float ot[D][kLanes] = {};
    alignas(64) float qpos[kLanes];
    int64_t lanes = 0, lo_key = S, hi_key = 0;
    for (int lane = 0; lane < kLanes; ++lane) {
      const int64_t j = tile * kLanes + lane, row = j / G;
      if (row >= n) {
        qpos[lane] = -1.f;  // no keys: every score masked
        for (int d = 0; d < D; ++d) qt[d][lane] = 0.f;
        continue;
      }
      ++lanes;
      const int64_t pos = first_pos + row;
      qpos[lane] = static_cast<float>(pos);
      lo_key = std::min(lo_key, window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0);
      hi_key = std::max(hi_key, pos + 1);
      const float* src = q + (query_starts[r] + row) * ldq + (h * G + j % G) * D;
      for (int d = 0; d < D; ++d) qt[d][lane] = src[d] * scale;
    }
    const F32x16 pos_v = load(qpos);
    const F32x16 win_v = set1(window > 0 ? static_cast<float>(window) : 1e30f);
    F32x16 m = set1(-1e30f), l = zero();  // finite: -ffast-math
    alignas(64) float kb[kMaxBlock][D], vb[kMaxBlock][D];
    F32x16 s[kMaxBlock];
    M16 valid[kMaxBlock];

    for (int64_t blk = lo_key / BS; blk * BS < hi_key; ++blk) {
      const int64_t k0 = std::max(blk * BS, lo_key), k1 = std::min((blk + 1) * BS, hi_key), nk = k1 - k0;
      const int64_t base = table[blk] * BS * stride + h * RW;
      // Keys in groups of kChains, one chain each; a partial group is padded with zero keys
      // that the masks drop.
      const int64_t nkc = (nk + kChains - 1) / kChains * kChains;
      for (int64_t i = 0; i < nkc; ++i) {
        if (i < nk) {
          load_row(kb[i], k_cache + base + (k0 - blk * BS + i) * stride, D);
          load_row(vb[i], v_cache + base + (k0 - blk * BS + i) * stride, D);
        } else {
          std::fill_n(kb[i], D, 0.f), std::fill_n(vb[i], D, 0.f);
        }
      }
      for (int64_t i = 0; i < nkc; i += kChains) {
        F32x16 a[kChains];
        for (int j = 0; j < kChains; ++j) a[j] = zero();
        for (int d = 0; d < D; ++d) {
          const F32x16 qd = load(qt[d]);
          for (int j = 0; j < kChains; ++j) a[j] = fma(qd, set1(kb[i + j][d]), a[j]);
        }
        for (int j = 0; j < kChains; ++j) s[i + j] = a[j];
      }
      // Causal and window masks per lane; the block's max.
      F32x16 mx = m;
      for (int64_t i = 0; i < nkc; ++i) {
        const F32x16 kp = set1(static_cast<float>(k0 + i));
        valid[i] = i < nk ? le(kp, pos_v) & gt(kp, sub(pos_v, win_v)) : mask_first(0);
        mx = select(valid[i], max(mx, s[i]), mx);
      }
      const F32x16 corr = exp_nonpositive(sub(m, mx));
      m = mx;
      l = mul(l, corr);
      for (int64_t i = 0; i < nkc; ++i) {
        s[i] = maskz(valid[i], exp_nonpositive(sub(s[i], m)));
        l = add(l, s[i]);
      }
      // Output += P V, transposed, kChains value elements at a time (one chain each).
      for (int d = 0; d < D; d += kChains) {
        F32x16 o[kChains];
        for (int j = 0; j < kChains; ++j) o[j] = mul(load(ot[d + j]), corr);
        for (int64_t i = 0; i < nkc; ++i)
          for (int j = 0; j < kChains; ++j) o[j] = fma(s[i], set1(vb[i][d + j]), o[j]);
        for (int j = 0; j < kChains; ++j) store(ot[d + j], o[j]);
      }
    }
    alignas(64) float inv[kLanes];
    store(inv, div(set1(1.f), l));
    for (int64_t lane = 0; lane < lanes; ++lane) {
      const int64_t j = tile * kLanes + lane;
      float* dst = out + (query_starts[r] + j / G) * Hq * D + (h * G + j % G) * D;
      for (int d = 0; d < D; ++d) dst[d] = ot[d][lane] * inv[lane];
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

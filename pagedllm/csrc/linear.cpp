// y[M, N] = x[M, K] @ w[N, K]^T + bias, float32 activations, weights packed once at load time.
//
// Three weight formats. Two are chosen per call by layers/linear.py:
// - float32 panels, for batches of many rows (compute bound: FMA on float32 runs at twice
//   the rate of vdpbf16ps on the CPUs we measured);
// - bfloat16 panels, for a few rows (bound by reading the weight: half the bytes), through
//   AVX512-BF16's vdpbf16ps; x is rounded to bfloat16, accumulation stays float32.
// A panel holds 32 output columns: float32 as [K][32], bfloat16 as [K/2][32][2] (a pair of
// consecutive k per column, the vdpbf16ps operand layout). N is padded to a multiple of 32
// and K to even with zeros.
// The third, int8 weights with int8 activations (--quantization w8a8), runs on AVX512-VNNI's
// vpdpbusd (u8 x s8, four products per int32 lane: 4x the float32 FMA rate here): each row of
// x is quantized on the fly, symmetric per token (scale = max|x| / 127), shifted by 128 to
// unsigned; 128 * sum_k w[n, k] is subtracted back in the epilogue. Panels [K/4][32][4]. A micro-tile keeps R rows x 32 columns of y in registers while
// it walks K once; every row takes the same instructions in the same order whatever M is,
// so a row's result does not depend on the rest of the batch. Threads split the panels.
#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

constexpr int64_t NB = 32;  // output columns per panel

inline __mmask16 low_mask(int64_t n) { return n >= 16 ? 0xFFFF : n <= 0 ? 0 : static_cast<__mmask16>((1u << n) - 1); }

template <int R>
inline void store(__m512 (&acc)[R][2], float* y, int64_t ldy, int64_t ncols) {
  const __mmask16 m0 = low_mask(ncols), m1 = low_mask(ncols - 16);
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(y + r * ldy, m0, acc[r][0]);
    _mm512_mask_storeu_ps(y + r * ldy + 16, m1, acc[r][1]);
  }
}

template <int R>
inline void init(__m512 (&acc)[R][2], const float* bias) {
  for (int r = 0; r < R; ++r) {
    acc[r][0] = bias ? _mm512_loadu_ps(bias) : _mm512_setzero_ps();
    acc[r][1] = bias ? _mm512_loadu_ps(bias + 16) : _mm512_setzero_ps();
  }
}

// x: R rows of K floats (stride ldx); panel: [K][32] float32.
template <int R>
void tile_f32(const float* x, int64_t ldx, const float* panel, int64_t K, const float* bias, float* y, int64_t ldy,
              int64_t ncols) {
  __m512 acc[R][2];
  init<R>(acc, bias);
  for (int64_t k = 0; k < K; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + 8) * NB), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + 8) * NB + 16), _MM_HINT_T0);
    const __m512 w0 = _mm512_loadu_ps(panel + k * NB), w1 = _mm512_loadu_ps(panel + k * NB + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 a = _mm512_set1_ps(x[r * ldx + k]);
      acc[r][0] = _mm512_fmadd_ps(a, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(a, w1, acc[r][1]);
    }
  }
  store<R>(acc, y, ldy, ncols);
}

#ifdef __AVX512VNNI__
// x: R rows of kq groups of 4 uint8 (stride ldx, in uint32); panel: [kq][32][4] int8.
// y = (acc - wsum128[n]) * xscale[r] * wscale[n] + bias[n].
template <int R>
void tile_w8a8(const uint32_t* x, int64_t ldx, const float* xscale, const int8_t* panel, int64_t kq,
               const int32_t* wsum128, const float* wscale, const float* bias, float* y, int64_t ldy, int64_t ncols) {
  __m512i acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_si512();
  for (int64_t k = 0; k < kq; ++k) {
    const __m512i w0 = _mm512_loadu_si512(panel + k * 4 * NB);
    const __m512i w1 = _mm512_loadu_si512(panel + k * 4 * NB + 2 * NB);
    for (int r = 0; r < R; ++r) {
      const __m512i a = _mm512_set1_epi32(static_cast<int>(x[r * ldx + k]));
      acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], a, w0);
      acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], a, w1);
    }
  }
  __m512 out[R][2];
  for (int j = 0; j < 2; ++j) {
    const __m512i ws = _mm512_loadu_si512(wsum128 + 16 * j);
    const __m512 sc = _mm512_loadu_ps(wscale + 16 * j);
    const __m512 b = bias ? _mm512_loadu_ps(bias + 16 * j) : _mm512_setzero_ps();
    for (int r = 0; r < R; ++r) {
      const __m512 v = _mm512_cvtepi32_ps(_mm512_sub_epi32(acc[r][j], ws));
      out[r][j] = _mm512_fmadd_ps(v, _mm512_mul_ps(sc, _mm512_set1_ps(xscale[r])), b);
    }
  }
  store<R>(out, y, ldy, ncols);
}
#endif

#ifdef __AVX512BF16__
// x: R rows of kp bf16 pairs (stride ldx, in uint32); panel: [kp][32][2] bfloat16.
template <int R>
void tile_bf16(const uint32_t* x, int64_t ldx, const uint16_t* panel, int64_t kp, const float* bias, float* y,
               int64_t ldy, int64_t ncols) {
  __m512 acc[R][2];
  init<R>(acc, bias);
  for (int64_t k = 0; k < kp; ++k) {
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + 16) * 2 * NB), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(panel + (k + 16) * 2 * NB + NB), _MM_HINT_T0);
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + k * 2 * NB);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + k * 2 * NB + NB);
    for (int r = 0; r < R; ++r) {
      const __m512bh a = (__m512bh)_mm512_set1_epi32(static_cast<int>(x[r * ldx + k]));
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], a, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], a, w1);
    }
  }
  store<R>(acc, y, ldy, ncols);
}
#endif

// Rows m..M of one panel: full tiles of MR rows, then one tile of the rest (its size
// dispatched at compile time).
template <int MR, typename Tile>
void panel_rows(int64_t M, Tile tile) {
  int64_t m = 0;
  for (; m + MR <= M; m += MR) tile(std::integral_constant<int, MR>{}, m);
  const int64_t rest = M - m;
  [&]<int... I>(std::integer_sequence<int, I...>) {
    ((rest == I + 1 ? (tile(std::integral_constant<int, I + 1>{}, m), 0) : 0), ...);
  }(std::make_integer_sequence<int, MR - 1>{});
}

// f(p, ncols, bias of the panel or null) for every 32-column panel p (ncols of them real),
// the panels split over the threads.
template <typename F>
void for_panels(int64_t N, const float* bias, F f) {
  const int64_t panels = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p) f(p, N - p * NB < NB ? N - p * NB : NB, bias ? bias + p * NB : nullptr);
}

// w [N, K] -> panels [ceil(N/32)][ceil(K/V)][32][V]: V consecutive k of a column side by
// side (the operand layout of FMA, vdpbf16ps and vpdpbusd for V = 1, 2, 4), zero padded.
template <typename T, int V>
void pack_panels(const T* w, T* packed, int64_t N, int64_t K) {
  const int64_t kv = (K + V - 1) / V, panels = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t kk = 0; kk < kv; ++kk)
      for (int64_t c = 0; c < NB; ++c)
        for (int64_t j = 0; j < V; ++j) {
          const int64_t n = p * NB + c, k = V * kk + j;
          packed[((p * kv + kk) * NB + c) * V + j] = (n < N && k < K) ? w[n * K + k] : T(0);
        }
}

}  // namespace

extern "C" {

int linear_bf16_available() {
#ifdef __AVX512BF16__
  return 1;
#else
  return 0;
#endif
}

int linear_w8a8_available() {
#ifdef __AVX512VNNI__
  return 1;
#else
  return 0;
#endif
}

// w: [N, K] float32 -> float32 panels [ceil(N/32)][K][32], zero padded.
void linear_pack_f32(const float* w, float* packed, int64_t N, int64_t K) { pack_panels<float, 1>(w, packed, N, K); }

// w: [N, K] bfloat16 bits -> bfloat16 panels [ceil(N/32)][ceil(K/2)][32][2], zero padded.
void linear_pack_bf16(const uint16_t* w, uint16_t* packed, int64_t N, int64_t K) {
  pack_panels<uint16_t, 2>(w, packed, N, K);
}

// w: [N, K] int8 -> int8 panels [ceil(N/32)][ceil(K/4)][32][4], zero padded.
void linear_pack_s8(const int8_t* w, int8_t* packed, int64_t N, int64_t K) { pack_panels<int8_t, 4>(w, packed, N, K); }

// x: [M, K] float32 with row stride ldx; y: [M, N] float32; wsum128 (int32), wscale and bias
// (float32, bias may be null) padded to ceil(N/32)*32. Returns -1 without AVX512-VNNI.
int linear_w8a8(const float* x, int64_t ldx, const int8_t* packed, const int32_t* wsum128, const float* wscale,
                const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
#ifdef __AVX512VNNI__
  const int64_t kq = (K + 3) / 4;
  std::vector<uint32_t> xq(static_cast<size_t>(M * kq));
  std::vector<float> xscale(static_cast<size_t>(M));
#pragma omp parallel for schedule(static) if (M > 16)
  for (int64_t m = 0; m < M; ++m) {  // per-token symmetric int8, stored as uint8 = q + 128
    const float* src = x + m * ldx;
    __m512 amax = _mm512_setzero_ps();
    for (int64_t k = 0; k < K; k += 16)
      amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_maskz_loadu_ps(low_mask(K - k), src + k)));
    const float a = _mm512_reduce_max_ps(amax);
    xscale[m] = a > 0.f ? a / 127.f : 1.f;
    const __m512 inv = _mm512_set1_ps(a > 0.f ? 127.f / a : 0.f);
    uint8_t* row = reinterpret_cast<uint8_t*>(xq.data() + m * kq);
    memset(row, 128, kq * 4);  // padding: q = 0 (its weights are 0 anyway)
    for (int64_t k = 0; k < K; k += 16) {
      const __mmask16 mask = low_mask(K - k);
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(_mm512_maskz_loadu_ps(mask, src + k), inv));  // round to even
      _mm_mask_storeu_epi8(row + k, mask, _mm512_cvtepi32_epi8(_mm512_add_epi32(q, _mm512_set1_epi32(128))));
    }
  }
  for_panels(N, bias, [&](int64_t p, int64_t ncols, const float* b) {  // 6 rows: 12 accumulators (more spill)
    // 6 rows (12 accumulators): at 12 rows GCC spills the int32 accumulators, half the speed.
    panel_rows<6>(M, [&](auto r, int64_t m) {
      tile_w8a8<decltype(r)::value>(xq.data() + m * kq, kq, xscale.data() + m, packed + p * kq * 4 * NB, kq,
                                    wsum128 + p * NB, wscale + p * NB, b, y + m * N + p * NB, N, ncols);
    });
  });
  return 0;
#else
  (void)x, (void)ldx, (void)packed, (void)wsum128, (void)wscale, (void)bias, (void)y, (void)M, (void)N, (void)K;
  return -1;
#endif
}

// x: [M, K] float32 with row stride ldx; y: [M, N] float32; bias: null or float32 padded to
// ceil(N/32)*32.
void linear_f32(const float* x, int64_t ldx, const float* packed, const float* bias, float* y, int64_t M, int64_t N,
                int64_t K) {
  // Rows in chunks whose x fits in L2 (512 KiB), each chunk over all panels: x is read from
  // L2 by every panel instead of from L3/DRAM (prefill: 1.3x at 2048 x 576 -> 3072).
  const int64_t chunk = std::max<int64_t>(12, (131072 / K) / 12 * 12);
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t rows = std::min(chunk, M - m0);
    for_panels(N, bias, [&](int64_t p, int64_t ncols, const float* b) {
      panel_rows<12>(rows, [&](auto r, int64_t m) {
        tile_f32<decltype(r)::value>(x + (m0 + m) * ldx, ldx, packed + p * K * NB, K, b, y + (m0 + m) * N + p * NB,
                                     N, ncols);
      });
    });
  }
}

// As linear_f32 over bfloat16 panels (x rounded to bfloat16). Returns -1 without AVX512-BF16.
int linear_bf16(const float* x, int64_t ldx, const uint16_t* packed, const float* bias, float* y, int64_t M, int64_t N,
                int64_t K) {
#ifdef __AVX512BF16__
  const int64_t kp = (K + 1) / 2;
  std::vector<uint32_t> pairs(static_cast<size_t>(M * kp));
  for (int64_t m = 0; m < M; ++m) {
    uint16_t* row = reinterpret_cast<uint16_t*>(pairs.data() + m * kp);
    const float* src = x + m * ldx;
    int64_t k = 0;
    for (; k + 16 <= K; k += 16)
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + k), (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(src + k)));
    if (k < K) {
      const __mmask16 mask = low_mask(K - k);
      _mm256_mask_storeu_epi16(row + k, mask, (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(mask, src + k)));
    }
    if (K % 2) row[K] = 0;
  }
  for_panels(N, bias, [&](int64_t p, int64_t ncols, const float* b) {
    panel_rows<8>(M, [&](auto r, int64_t m) {
      tile_bf16<decltype(r)::value>(pairs.data() + m * kp, kp, packed + p * kp * 2 * NB, kp, b, y + m * N + p * NB, N,
                                    ncols);
    });
  });
  return 0;
#else
  (void)x, (void)ldx, (void)packed, (void)bias, (void)y, (void)M, (void)N, (void)K;
  return -1;
#endif
}

}  // extern "C"

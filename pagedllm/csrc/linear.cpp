// y[M, N] = x[M, K] @ w[N, K]^T + bias, float32 activations, weights packed once at load time.
//
// Two weight formats, each in panels of 32 output columns (N padded to a multiple of 32 with
// zeros):
// - float32, [K][32] per panel (--dtype float32: exact, batch-invariant);
// - int8 with int8 activations (w8a8, the default under --dtype auto): weights and x both
//   symmetric per group of QG = 32 k (llama.cpp's Q8_0 x Q8_0), the products summed on
//   AVX512-VNNI's vpdpbusd (u8 x s8, four products per int32 lane: 4x the float32 FMA rate
//   on the CPUs we measured), each group's int32 sum scaled into a float32 accumulator.
//   Panels [Kp/4][32][4] (K padded to QG).
// A micro-tile keeps R rows x 32 columns of y in registers while it walks K once; every row
// takes the same instructions in the same order whatever M is, so a row's result does not
// depend on the rest of the batch. Threads split the panels.
#include <immintrin.h>
#include <stdint.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <utility>
#include <vector>

#include "vec_math.h"

namespace {

constexpr int64_t NB = 32;  // output columns per panel

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
constexpr int64_t QG = 32;  // k per quantization group, of weights and of activations alike

// x: R rows of kq quads of uint8 (stride ldx, in uint32), groups of QG/4 quads; xscale: R rows
// of G scales (stride G); panel: [kq][32][4] int8; wscale, wsum: [G][32].
// y[r, n] = sum_g xscale[r, g] * wscale[g, n] * (sum_k (x + 128) w - 128 * sum_k w) + bias[n].
template <int R>
void tile_w8a8(const uint32_t* x, int64_t ldx, const float* xscale, const int8_t* panel, int64_t G,
               const int32_t* wsum128, const float* wscale, const float* bias, float* y, int64_t ldy, int64_t ncols) {
  constexpr int64_t quads = QG / 4;
  __m512 out[R][2];
  init<R>(out, bias);
  for (int64_t g = 0; g < G; ++g) {
    const __m512i ws0 = _mm512_loadu_si512(wsum128 + g * NB), ws1 = _mm512_loadu_si512(wsum128 + g * NB + 16);
    __m512i acc[R][2];
    for (int r = 0; r < R; ++r) acc[r][0] = ws0, acc[r][1] = ws1;  // starts at -128 * sum_k w
    const int8_t* pg = panel + g * quads * 4 * NB;
    _mm_prefetch(reinterpret_cast<const char*>(pg + 4 * quads * 4 * NB), _MM_HINT_T0);
    for (int64_t k = 0; k < quads; ++k) {
      const __m512i w0 = _mm512_loadu_si512(pg + k * 4 * NB);
      const __m512i w1 = _mm512_loadu_si512(pg + k * 4 * NB + 2 * NB);
      _mm_prefetch(reinterpret_cast<const char*>(pg + (k + 4 * quads) * 4 * NB + 2 * NB), _MM_HINT_T0);
      for (int r = 0; r < R; ++r) {
        const __m512i a = _mm512_set1_epi32(static_cast<int>(x[r * ldx + g * quads + k]));
        acc[r][0] = _mm512_dpbusd_epi32(acc[r][0], a, w0);
        acc[r][1] = _mm512_dpbusd_epi32(acc[r][1], a, w1);
      }
    }
    const __m512 d0 = _mm512_loadu_ps(wscale + g * NB), d1 = _mm512_loadu_ps(wscale + g * NB + 16);
    for (int r = 0; r < R; ++r) {
      const __m512 s = _mm512_set1_ps(xscale[r * G + g]);
      out[r][0] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][0]), _mm512_mul_ps(d0, s), out[r][0]);
      out[r][1] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][1]), _mm512_mul_ps(d1, s), out[r][1]);
    }
  }
  store<R>(out, y, ldy, ncols);
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

}  // namespace

extern "C" {

int linear_w8a8_available() {
#ifdef __AVX512VNNI__
  return 1;
#else
  return 0;
#endif
}

// w: [N, K] float32 -> float32 panels [ceil(N/32)][K][32], zero padded.
void linear_pack_f32(const float* w, float* packed, int64_t N, int64_t K) {
  const int64_t panels = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t k = 0; k < K; ++k)
      for (int64_t c = 0; c < NB; ++c) packed[(p * K + k) * NB + c] = p * NB + c < N ? w[(p * NB + c) * K + k] : 0.f;
}

// w: [N, K] float32 -> int8 panels [ceil(N/32)][Kp/4][32][4] (Kp = K rounded up to QG), and
// per panel and group of QG k: wscale [panels][Kp/QG][32] = max|w| / 127 and
// wsum128 = -128 * sum of the codes (int32), all zero padded. Returns -1 without AVX512-VNNI.
int linear_pack_w8a8(const float* w, int8_t* packed, float* wscale, int32_t* wsum128, int64_t N, int64_t K) {
#ifdef __AVX512VNNI__
  const int64_t G = (K + QG - 1) / QG, kq = G * QG / 4, panels = (N + NB - 1) / NB;
#pragma omp parallel for schedule(static)
  for (int64_t p = 0; p < panels; ++p)
    for (int64_t c = 0; c < NB; ++c) {
      const int64_t n = p * NB + c;
      for (int64_t g = 0; g < G; ++g) {
        float amax = 0.f;
        for (int64_t k = g * QG; k < std::min(K, (g + 1) * QG) && n < N; ++k) amax = std::max(amax, std::abs(w[n * K + k]));
        const float scale = amax / 127.f, inv = amax > 0.f ? 127.f / amax : 0.f;
        int32_t sum = 0;
        for (int64_t k = g * QG; k < (g + 1) * QG; ++k) {
          const int8_t q = (n < N && k < K) ? static_cast<int8_t>(std::nearbyint(w[n * K + k] * inv)) : 0;
          packed[((p * kq + k / 4) * NB + c) * 4 + k % 4] = q;
          sum += q;
        }
        wscale[(p * G + g) * NB + c] = scale;
        wsum128[(p * G + g) * NB + c] = -128 * sum;
      }
    }
  return 0;
#else
  (void)w, (void)packed, (void)wscale, (void)wsum128, (void)N, (void)K;
  return -1;
#endif
}

// x: [M, K] float32 with row stride ldx; y: [M, N] float32; packed, wscale, wsum128 from
// linear_pack_w8a8; bias: null or float32 padded to ceil(N/32)*32. Each row of x is
// quantized on the fly, symmetric per group of QG k (scale = max|x| / 127), as llama.cpp's
// Q8_0 x Q8_0 dot product does, and shifted by 128 to unsigned for vpdpbusd (u8 x s8).
// Returns -1 without AVX512-VNNI.
int linear_w8a8(const float* x, int64_t ldx, const int8_t* packed, const float* wscale, const int32_t* wsum128,
                const float* bias, float* y, int64_t M, int64_t N, int64_t K) {
#ifdef __AVX512VNNI__
  const int64_t G = (K + QG - 1) / QG, kq = G * QG / 4;
  std::vector<uint32_t> xq(static_cast<size_t>(M * kq));
  std::vector<float> xscale(static_cast<size_t>(M * G));
#pragma omp parallel for schedule(static) if (M > 16)
  for (int64_t m = 0; m < M; ++m) {
    const float* src = x + m * ldx;
    uint8_t* row = reinterpret_cast<uint8_t*>(xq.data() + m * kq);
    for (int64_t g = 0; g < G; ++g) {
      const int64_t k0 = g * QG;
      const __mmask16 m0 = low_mask(K - k0), m1 = low_mask(K - k0 - 16);
      const __m512 v0 = _mm512_maskz_loadu_ps(m0, src + k0), v1 = _mm512_maskz_loadu_ps(m1, src + k0 + 16);
      const float a = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(v0), _mm512_abs_ps(v1)));
      xscale[m * G + g] = a / 127.f;
      const __m512 inv = _mm512_set1_ps(a > 0.f ? 127.f / a : 0.f);
      const __m512i off = _mm512_set1_epi32(128);  // round to even, then to unsigned
      _mm_storeu_si128(reinterpret_cast<__m128i*>(row + k0),
                       _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v0, inv)), off)));
      _mm_storeu_si128(reinterpret_cast<__m128i*>(row + k0 + 16),
                       _mm512_cvtepi32_epi8(_mm512_add_epi32(_mm512_cvtps_epi32(_mm512_mul_ps(v1, inv)), off)));
    }
  }
  // Rows in chunks whose codes fit in L2, each chunk over all panels (as linear_f32).
  const int64_t chunk = std::max<int64_t>(24, (262144 / (4 * kq)) / 24 * 24);
  for (int64_t m0 = 0; m0 < M; m0 += chunk) {
    const int64_t rows = std::min(chunk, M - m0);
    for_panels(N, bias, [&](int64_t p, int64_t ncols, const float* b) {
      // 4 rows: 8 int32 + 8 float32 accumulators stay in registers.
      panel_rows<4>(rows, [&](auto r, int64_t m) {
        tile_w8a8<decltype(r)::value>(xq.data() + (m0 + m) * kq, kq, xscale.data() + (m0 + m) * G,
                                      packed + p * kq * 4 * NB, G, wsum128 + p * G * NB, wscale + p * G * NB, b,
                                      y + (m0 + m) * N + p * NB, N, ncols);
      });
    });
  }
  return 0;
#else
  (void)x, (void)ldx, (void)packed, (void)wscale, (void)wsum128, (void)bias, (void)y, (void)M, (void)N, (void)K;
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

}  // extern "C"

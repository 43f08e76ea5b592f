// A self-test of every kernel against plain C++ references, for ISAs that the Python suite
// cannot run here: scripts/test_aarch64.sh cross-compiles it with the kernels for NEON and runs
// it under qemu-aarch64. Links with the kernels' objects; prints one line per check and
// "N passed, M failed"; exits non-zero on any failure.
#include <stdint.h>

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <tuple>
#include <thread>
#include <utility>
#include <vector>

#include "../pagedllm_abi.h"
#include "../parallel.h"
#include "../vec.h"

namespace {

int passed = 0, failed = 0;

struct Rng {  // xorshift64: the same inputs on every machine
  uint64_t s = 0x9E3779B97F4A7C15ull;
  float normal() {  // sum of uniforms: close enough to a normal for test data
    float x = 0.f;
    for (int i = 0; i < 4; ++i) {
      s ^= s << 13, s ^= s >> 7, s ^= s << 17;
      x += float(s >> 40) / float(1 << 24) - 0.5f;
    }
    return x * 1.7f;
  }
  std::vector<float> normals(size_t n) {
    std::vector<float> v(n);
    for (float& x : v) x = normal();
    return v;
  }
};

// Attention in bfloat16 pairs, where the ISA multiplies them (vec.h's kBf16Dot: prefill over a
// bfloat16 or 8-bit cache, decode over a bfloat16 one): the queries and softmax weights rounded
// to 8 significant bits move these unit-normal outputs by a few 2^-9 steps (the Python tests
// hold the kernels to the rounding's bound, tests/utils.py); elsewhere float32 rounding only.
constexpr float kPairTolerance = vec::kBf16Dot ? 0x1p-6f : 1e-4f;

float max_error(const std::vector<float>& a, const std::vector<float>& b) {
  float e = 0.f;
  for (size_t i = 0; i < a.size(); ++i) e = std::fmax(e, std::fabs(a[i] - b[i]) / (1.f + std::fabs(b[i])));
  return e;
}

void check(const char* name, float error, float tolerance) {
  const bool ok = error <= tolerance;  // false for NaN too
  (ok ? passed : failed) += 1;
  std::printf("%-40s max error %.3g (tolerance %.3g) %s\n", name, error, tolerance, ok ? "ok" : "FAILED");
}

uint16_t to_bf16(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return uint16_t((u + 0x7FFF + ((u >> 16) & 1)) >> 16);
}
float from_bf16(uint16_t h) {
  const uint32_t u = uint32_t(h) << 16;
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// Activations as the integer GEMMs quantize them: codes per group of 32 k, symmetric, rounded
// to nearest even (zeros past K).
void quantize(const float* row, int64_t K, std::vector<int8_t>& codes, std::vector<float>& scales) {
  for (int64_t g = 0; g * 32 < K; ++g) {
    float amax = 0.f;
    for (int64_t k = g * 32; k < K && k < (g + 1) * 32; ++k) amax = std::fmax(amax, std::fabs(row[k]));
    scales.push_back(amax / 127.f);
    for (int64_t k = g * 32; k < (g + 1) * 32; ++k)
      codes.push_back(k < K && amax > 0.f ? int8_t(std::nearbyint(row[k] * (127.f / amax))) : int8_t(0));
  }
}

void test_linear() {
  Rng rng;
  const int64_t M = 7, N = 45, K = 70;  // ragged edges: N and K not multiples of 32
  const auto x = rng.normals(M * K), w = rng.normals(N * K), b = rng.normals(N);
  std::vector<float> ref(M * N), bias((N + 31) / 32 * 32, 0.f), y(M * N);
  std::copy(b.begin(), b.end(), bias.begin());
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) {
      double s = b[n];
      for (int64_t k = 0; k < K; ++k) s += double(x[m * K + k]) * w[n * K + k];
      ref[m * N + n] = float(s);
    }
  std::vector<float> packed((N + 31) / 32 * 32 * K);
  linear_pack_f32(w.data(), packed.data(), N, K);
  linear_f32(x.data(), K, packed.data(), bias.data(), y.data(), M, N, K);
  check("linear_f32", max_error(y, ref), 1e-4f);

  // w8a8: against the same arithmetic in plain integers (x's codes per group of 32 k, w's per
  // row, symmetric, rounded to nearest even; each group's int32 sum scaled by x's group scale,
  // the row's sum by w's scale).
  const int64_t G = (K + 31) / 32, panels = (N + 31) / 32;
  for (int64_t m = 0; m < M; ++m) {
    std::vector<int8_t> xc;
    std::vector<float> xs;
    quantize(x.data() + m * K, K, xc, xs);
    for (int64_t n = 0; n < N; ++n) {
      float amax = 0.f;
      for (int64_t k = 0; k < K; ++k) amax = std::fmax(amax, std::fabs(w[n * K + k]));
      double s = 0;
      for (int64_t g = 0; g < G; ++g) {
        int32_t dot = 0;
        for (int64_t k = g * 32; k < K && k < (g + 1) * 32; ++k)
          dot += int32_t(xc[k]) * int8_t(std::nearbyint(w[n * K + k] * (127.f / amax)));
        s += double(dot) * xs[g];
      }
      ref[m * N + n] = float(s * (amax / 127.f) + b[n]);
    }
  }
  std::vector<int8_t> q(panels * 32 * G * 32);
  std::vector<float> scale(panels * 32);
  linear_pack_w8a8(w.data(), nullptr, q.data(), scale.data(), N, K);
  linear_w8a8(x.data(), K, q.data(), scale.data(), bias.data(), y.data(), M, N, K, M);
  check("linear_w8a8", max_error(y, ref), 1e-4f);

  // w4a8: codes in [0, 15] with float16 d, m per group (w = d q + m), x as for w8a8 (rows at
  // stride K + 3), against the same arithmetic in plain integers.
  const int64_t ldx = K + 3;
  std::vector<float> xs_rows(M * ldx);
  for (int64_t m = 0; m < M; ++m) std::copy(x.begin() + m * K, x.begin() + (m + 1) * K, xs_rows.begin() + m * ldx);
  std::vector<uint8_t> codes(N * K);
  std::vector<uint16_t> d16(N * G), m16(N * G);
  std::vector<float> d(N * G), mn(N * G);
  auto f16 = [](int k, int shift) {  // k * 2^-shift, k in [-1023, 1023]: exact in float16
    const float v = std::ldexp(float(k), -shift);
    int e;
    const float f = std::frexp(std::fabs(v), &e);  // |v| = f 2^e, f in [0.5, 1)
    const uint16_t sign = k < 0 ? 0x8000 : 0;
    const uint16_t bits = k == 0 ? 0 : uint16_t(sign | (e + 14) << 10 | (uint32_t(f * 2048.f) & 0x3FF));
    return std::pair<uint16_t, float>(bits, v);
  };
  for (int64_t i = 0; i < N * K; ++i) codes[i] = uint8_t(int(std::fabs(rng.normal()) * 5.f) % 16);
  for (int64_t i = 0; i < N * G; ++i) {
    std::tie(d16[i], d[i]) = f16(1 + int(std::fabs(rng.normal()) * 300.f) % 1000, 12);
    std::tie(m16[i], mn[i]) = f16(int(rng.normal() * 300.f) % 1000, 10);
  }
  // ref[m, n] = b[n] + sum_g xscale[m, g] (dg[n, g] sum_k xc w + mg[n, g] sum_k xc) over the
  // rows of xr ([M, Kr], quantized as the kernels do), code(n, k) the weight's integer code;
  // mg null: no m term (Q8_0). The Q4 and Q8_0 GEMMs' reference in plain integers.
  const auto group_reference = [&](const float* xr, int64_t Kr, auto code, const float* dg, const float* mg) {
    const int64_t Gr = (Kr + 31) / 32;
    for (int64_t m = 0; m < M; ++m) {
      std::vector<int8_t> xc;
      std::vector<float> xsc;
      quantize(xr + m * Kr, Kr, xc, xsc);
      for (int64_t n = 0; n < N; ++n) {
        double s = b[n];
        for (int64_t g = 0; g < Gr; ++g) {
          int32_t dot = 0, sum = 0;
          for (int64_t k = g * 32; k < Kr && k < (g + 1) * 32; ++k) dot += int32_t(xc[k]) * code(n, k), sum += xc[k];
          s += double(xsc[g]) * (double(dg[n * Gr + g]) * dot + (mg ? double(mg[n * Gr + g]) * sum : 0.0));
        }
        ref[m * N + n] = float(s);
      }
    }
  };
  std::vector<uint8_t> q4(panels * G * PAGEDLLM_Q4A8_GROUP_BYTES);
  for (const int64_t symmetric : {0, 1}) {
    if (symmetric) {  // Q4_0's blocks, every m = -8 d: packed without m, the -8 into the integer sums
      for (int64_t i = 0; i < N * G; ++i) m16[i] = uint16_t(0x8000 | (d16[i] + (3 << 10))), mn[i] = -8.f * d[i];
    }
    group_reference(x.data(), K, [&](int64_t n, int64_t k) { return int32_t(codes[n * K + k]); }, d.data(), mn.data());
    linear_pack_q4a8(codes.data(), d16.data(), symmetric ? nullptr : m16.data(), q4.data(), N, K);
    std::fill(y.begin(), y.end(), 0.f);
    linear_q4a8(xs_rows.data(), ldx, q4.data(), bias.data(), y.data(), M, N, K, symmetric, M);
    check(symmetric ? "linear_q4a8 symmetric" : "linear_q4a8", max_error(y, ref), 1e-4f);
  }

  // q8a8: GGUF Q8_0 blocks (float16 d, 32 int8 codes in [-127, 127]) of K8 = 96 weights a row
  // (Q8_0 rows are whole blocks), x as for w8a8, against the same arithmetic in plain integers.
  const int64_t K8 = 96, G8 = K8 / 32;
  const auto x8 = rng.normals(M * K8);
  std::vector<uint8_t> blocks(N * G8 * 34);
  std::vector<int8_t> q8(N * K8);
  std::vector<float> d8(N * G8);
  for (int64_t i = 0; i < N * G8; ++i) {
    uint16_t bits;
    std::tie(bits, d8[i]) = f16(1 + int(std::fabs(rng.normal()) * 300.f) % 1000, 12);
    std::memcpy(blocks.data() + i * 34, &bits, 2);
    for (int j = 0; j < 32; ++j) {
      q8[i * 32 + j] = int8_t(int(rng.normal() * 60.f) % 128);
      blocks[i * 34 + 2 + j] = uint8_t(q8[i * 32 + j]);
    }
  }
  group_reference(x8.data(), K8, [&](int64_t n, int64_t k) { return int32_t(q8[n * K8 + k]); }, d8.data(), nullptr);
  std::vector<int8_t> p8(panels * 32 * K8);
  std::vector<uint16_t> pd(panels * G8 * 32);
  const int packed_q8 = linear_pack_q8_0(blocks.data(), p8.data(), pd.data(), N, K8);
  linear_q8a8(x8.data(), K8, p8.data(), pd.data(), bias.data(), y.data(), M, N, K8, M);
  check("linear_q8a8", packed_q8 == 0 ? max_error(y, ref) : 1e9f, 1e-4f);
}

// The token sample_rows draws at u, in double precision: softmax(x / t); min-p drops p < min_p
// * max p; with top-k or top-p the tokens left most likely first, k of them, each whose more
// likely ones hold less than top_p of their mass, else every token left in id order; then the
// first token whose cumulative mass reaches u times the kept mass.
int64_t sample_reference(const std::vector<float>& x, float t, int64_t k, float top_p, float min_p, float u) {
  const int64_t n = int64_t(x.size());
  const double mx = *std::max_element(x.begin(), x.end());
  std::vector<int64_t> order(n);
  for (int64_t i = 0; i < n; ++i) order[i] = i;
  auto w = [&](int64_t i) {  // 0 for a banned token (no isinf under -ffast-math) or one min-p drops
    const double v = x[i] < -1e30f ? 0.0 : std::exp((x[i] - mx) / t);
    return v < min_p ? 0.0 : v;
  };
  std::vector<std::pair<double, int64_t>> kept;
  const int64_t kk = k > 0 && k < n ? k : n;
  if (k > 0 || top_p < 1.f) {  // a top-k at or past n keeps every token, most likely first
    std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return x[a] > x[b]; });
    double mass = 0.0, before = 0.0;
    for (int64_t j = 0; j < kk; ++j) mass += w(order[j]);
    for (int64_t j = 0; j < kk && (top_p >= 1.f || before < top_p * mass); ++j)
      kept.emplace_back(w(order[j]), order[j]), before += w(order[j]);
  } else {
    for (int64_t i = 0; i < n; ++i) kept.emplace_back(w(i), i);
  }
  double total = 0.0;
  for (const auto& e : kept) total += e.first;
  double mass = 0.0;
  for (const auto& e : kept)
    if (e.first > 0.0 && (mass += e.first) >= u * total) return e.second;
  return -1;
}

void test_elementwise() {
  Rng rng;
  const int64_t T = 3, H = 40, D = 32;
  {  // residual add + RMSNorm
    const auto x = rng.normals(T * H), w = rng.normals(H);
    auto residual = rng.normals(T * H);
    std::vector<float> ref(T * H), out(T * H), r0 = residual;
    for (int64_t t = 0; t < T; ++t) {
      double ss = 0;
      for (int64_t i = 0; i < H; ++i) r0[t * H + i] += x[t * H + i], ss += double(r0[t * H + i]) * r0[t * H + i];
      const float inv = float(1.0 / std::sqrt(ss / H + 1e-6));
      for (int64_t i = 0; i < H; ++i) ref[t * H + i] = r0[t * H + i] * inv * w[i];
    }
    add_rms_norm(x.data(), residual.data(), w.data(), out.data(), T, H, 1e-6f);
    check("add_rms_norm", std::fmax(max_error(out, ref), max_error(residual, r0)), 1e-5f);
  }
  // RoPE: 2 heads of D, rows of stride 2 D + 5, over all D or the leading R = 3 D / 4 (partial
  // rotary: the other D - R unchanged); then a scale per channel, all D.
  for (const int64_t R : {D, 3 * D / 4})
    for (const bool scaled : {false, true}) {
      const int64_t heads = 2, ld = heads * D + 5;
      auto x = rng.normals(T * ld);
      const auto cs = rng.normals(T * 2 * R);
      const auto scale = rng.normals(heads * D);
      auto ref = x;
      for (int64_t t = 0; t < T; ++t)
        for (int64_t h = 0; h < heads; ++h) {
          float* r = ref.data() + t * ld + h * D;
          const float* c = cs.data() + t * 2 * R;
          for (int64_t i = 0; i < R / 2; ++i) {
            const float a = x[t * ld + h * D + i], b = x[t * ld + h * D + R / 2 + i];
            r[i] = a * c[i] + b * c[R + i];
            r[R / 2 + i] = b * c[R / 2 + i] + a * c[R + R / 2 + i];
          }
          for (int64_t i = 0; i < D && scaled; ++i) r[i] *= scale[h * D + i];
        }
      rotary_inplace(x.data(), ld, cs.data(), T, heads, D, R, scaled ? scale.data() : nullptr);
      const char* names[2][2] = {{"rotary_inplace", "rotary_inplace, scaled"},
                                 {"rotary_inplace, partial", "rotary_inplace, partial, scaled"}};
      check(names[R < D][scaled], max_error(x, ref), 1e-5f);
    }
  {  // SiLU-and-mul over rows of [gate (I), up (I)], I = 37
    const int64_t I = 37;
    auto g = rng.normals(T * 2 * I);
    auto ref = g;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < I; ++i) {
        const float v = g[t * 2 * I + i];
        ref[t * 2 * I + i] = v / (1.f + std::exp(-v)) * g[t * 2 * I + I + i];
      }
    silu_and_mul(g.data(), 2 * I, T, I);
    check("silu_and_mul", max_error(g, ref), 1e-5f);
  }
  {  // GELU (tanh approximation)-and-mul, gates up to |30|: both tails
    const int64_t I = 37;
    auto g = rng.normals(T * 2 * I);
    for (float& v : g) v *= 10.f;
    auto ref = g;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < I; ++i) {
        const float v = g[t * 2 * I + i];
        const float u = 0.7978845608f * (v + 0.044715f * v * v * v);
        ref[t * 2 * I + i] = 0.5f * v * (1.f + std::tanh(u)) * g[t * 2 * I + I + i];
      }
    gelu_tanh_and_mul(g.data(), 2 * I, T, I);
    check("gelu_tanh_and_mul", max_error(g, ref), 1e-4f);
  }
  {  // K/V cache write, float32 and bfloat16, width not a multiple of 16
    const int64_t width = 40, slots_n = 8;
    const auto k = rng.normals(T * width), v = rng.normals(T * width);
    const int64_t slots[T] = {5, 0, 7};
    std::vector<float> kc(slots_n * width, 0.f), vc(slots_n * width, 0.f), kr = kc, vr = vc;
    std::vector<uint16_t> kb(slots_n * width, 0), vb(slots_n * width, 0);
    for (int64_t t = 0; t < T; ++t)
      for (int64_t i = 0; i < width; ++i) kr[slots[t] * width + i] = k[t * width + i], vr[slots[t] * width + i] = v[t * width + i];
    write_kv_cache(PAGEDLLM_CACHE_F32, k.data(), v.data(), width, kc.data(), vc.data(), slots, T, 1, width);
    write_kv_cache(PAGEDLLM_CACHE_BF16, k.data(), v.data(), width, kb.data(), vb.data(), slots, T, 1, width);
    float bf_error = 0.f;
    for (size_t i = 0; i < kb.size(); ++i)
      bf_error = std::fmax(bf_error, float(kb[i] != to_bf16(kr[i])) + float(vb[i] != to_bf16(vr[i])));
    check("write_kv_cache float32", std::fmax(max_error(kc, kr), max_error(vc, vr)), 0.f);
    check("write_kv_cache bfloat16 (bits differ)", bf_error, 0.f);
  }
  {  // argmax: ties resolve to the first index
    const int64_t n = 1000;
    auto x = rng.normals(2 * n);
    x[617] = 50.f, x[3] = 50.f, x[n + 999] = 60.f;
    int64_t out[2];
    argmax_rows(x.data(), 2, n, out);
    check("argmax_rows", float(out[0] != 3) + float(out[1] != 999), 0.f);
  }
  {  // random sampling at fixed uniforms: the token a double-precision reference of the rules draws
    const int64_t n = 1000;
    auto x = rng.normals(n);
    for (int64_t i = 0; i < n; i += 9) x[i] = -INFINITY;  // banned tokens
    struct Case { float t; int64_t k; float p, min_p, u; };
    const Case cases[] = {{1.f, 0, 1.f, 0.f, .37f},  {.7f, 20, 1.f, 0.f, .61f}, {1.3f, 0, .9f, 0.f, .83f},
                          {1.f, 50, .8f, 0.f, .2f},  {1.f, 0, 1.f, .05f, .55f}, {.8f, 0, .95f, .1f, .9f},
                          {2.f, 0, .999f, 0.f, .7f}, {.5f, 1, 1.f, 0.f, .99f},  {1.f, 2000, 1.f, 0.f, .45f},
                          {1.f, 50, 1.f, .05f, .3f}, {1.f, 50, .9f, .02f, .6f}, {.3f, 400, .95f, .01f, .8f}};
    float wrong = 0.f;
    for (const Case& c : cases) {
      int64_t got;
      sample_rows(x.data(), n, 1, n, &c.t, &c.k, &c.p, &c.min_p, &c.u, &got);
      wrong += float(got != sample_reference(x, c.t, c.k, c.p, c.min_p, c.u));
    }
    check("sample_rows (cases drawn otherwise)", wrong, 0.f);
  }
  {  // logprobs: log-softmax in double, the 5 largest by lower id among equals, the rank
    const int64_t n = 1003, top = 5;
    auto x = rng.normals(2 * n);
    for (int64_t i = 0; i < n; i += 9) x[i] = -INFINITY;  // banned tokens in row 0
    x[n + 40] = x[n + 700] = x[n + 5] = 9.f;                // a three-way tie on top of row 1
    const int64_t token[2] = {1001, 6};
    int64_t ids[2 * (top + 1)], rank[2];
    float lps[2 * (top + 1)];
    logprobs_rows(x.data(), n, 2, n, token, top, ids, lps, rank);
    float error = 0.f, wrong = 0.f;
    for (int64_t r = 0; r < 2; ++r) {
      const float* row = x.data() + r * n;
      double m = -INFINITY, z = 0.0;
      for (int64_t i = 0; i < n; ++i) m = std::fmax(m, double(row[i]));
      for (int64_t i = 0; i < n; ++i) z += row[i] == -INFINITY ? 0.0 : std::exp(double(row[i]) - m);
      std::vector<int64_t> order(n);
      for (int64_t i = 0; i < n; ++i) order[i] = i;
      std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return row[a] > row[b]; });
      int64_t at_least = 0;
      for (int64_t i = 0; i < n; ++i) at_least += row[i] >= row[token[r]];
      wrong += float(rank[r] != at_least) + float(ids[r * (top + 1)] != token[r]);
      for (int64_t k = 0; k <= top; ++k) {
        const int64_t id = k == 0 ? token[r] : order[k - 1];
        wrong += float(ids[r * (top + 1) + k] != id);
        error = std::fmax(error, float(std::fabs(lps[r * (top + 1) + k] - (double(row[id]) - m - std::log(z)))));
      }
    }
    check("logprobs_rows (ids and ranks wrong)", wrong, 0.f);
    check("logprobs_rows", error, 1e-5f);
  }
  {  // penalties: repetition over prompt + output once per distinct token, then the output's counts
    float x[2][6] = {{3.f, -1.f, 2.f, -2.f, .5f, 1.f}, {1.f, 1.f, 1.f, 1.f, 1.f, 1.f}};
    const int64_t row_ids[1] = {0}, offsets[2] = {0, 7}, num_prompt[1] = {3};
    const int32_t tokens[7] = {0, 1, 0, 3, 3, 3, 1};  // prompt 0 1 0, output 3 3 3 1
    const float rep[1] = {2.f}, pres[1] = {.5f}, freq[1] = {.25f};
    apply_penalties(&x[0][0], 6, 1, 6, row_ids, tokens, offsets, num_prompt, rep, pres, freq);
    const float want[6] = {1.5f, -2.f - .25f - .5f, 2.f, -4.f - .75f - .5f, .5f, 1.f};
    float error = 0.f;
    for (int i = 0; i < 6; ++i) error = std::fmax(error, std::fabs(x[0][i] - want[i]) + std::fabs(x[1][i] - 1.f));
    check("apply_penalties", error, 1e-6f);
  }
}

// Causal attention of each request's last n positions over its context, per query head, from
// dense K/V [S][Hkv][D] (already rounded to the cache dtype).
void attention_reference(const float* q, const std::vector<float>& k, const std::vector<float>& v, int64_t n,
                         int64_t S, int64_t Hq, int64_t Hkv, int64_t D, float scale, int64_t window, float* out) {
  for (int64_t i = 0; i < n; ++i)
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t kh = h / (Hq / Hkv), pos = S - n + i;
      std::vector<double> p(S, 0.0);
      double mx = -1e300, sum = 0;
      for (int64_t j = 0; j <= pos; ++j) {
        if (window > 0 && j <= pos - window) continue;
        double s = 0;
        for (int64_t d = 0; d < D; ++d) s += double(q[(i * Hq + h) * D + d]) * k[(j * Hkv + kh) * D + d];
        p[j] = s * scale, mx = std::fmax(mx, p[j]);
      }
      for (int64_t j = 0; j <= pos; ++j)
        if (!(window > 0 && j <= pos - window)) p[j] = std::exp(p[j] - mx), sum += p[j];
        else p[j] = 0;
      for (int64_t d = 0; d < D; ++d) {
        double o = 0;
        for (int64_t j = 0; j <= pos; ++j) o += p[j] * v[(j * Hkv + kh) * D + d];
        out[(i * Hq + h) * D + d] = float(o / sum);
      }
    }
}

template <typename T>
void test_attention(bool bf16, int64_t window) {
  Rng rng;
  const int64_t BS = 16, Hq = 6, Hkv = 2, D = 64, blocks = 16;
  const float scale = 0.125f;
  const int64_t S[2] = {37, 21}, n[2] = {1, 9};  // a decode and a prefill chunk (positions 12..20)
  const int64_t table[2][3] = {{4, 9, 1}, {12, 0, 7}};
  std::vector<T> kc(blocks * BS * Hkv * D), vc(kc.size());
  std::vector<float> kd[2], vd[2];
  for (int r = 0; r < 2; ++r) {
    kd[r] = rng.normals(S[r] * Hkv * D), vd[r] = rng.normals(S[r] * Hkv * D);
    for (int64_t j = 0; j < S[r]; ++j)
      for (int64_t e = 0; e < Hkv * D; ++e) {
        const int64_t slot = (table[r][j / BS] * BS + j % BS) * Hkv * D + e;
        if constexpr (sizeof(T) == 2) {
          kc[slot] = to_bf16(kd[r][j * Hkv * D + e]), vc[slot] = to_bf16(vd[r][j * Hkv * D + e]);
          kd[r][j * Hkv * D + e] = from_bf16(kc[slot]), vd[r][j * Hkv * D + e] = from_bf16(vc[slot]);
        } else {
          kc[slot] = kd[r][j * Hkv * D + e], vc[slot] = vd[r][j * Hkv * D + e];
        }
      }
  }
  char name[64];
  {  // decode: request 0 alone
    const auto q = rng.normals(Hq * D);
    std::vector<float> out(Hq * D), ref(Hq * D);
    const int64_t bt[3] = {table[0][0], table[0][1], table[0][2]}, sl[1] = {S[0]};
    const int status = (bf16 ? paged_decode_attention_bf16 : paged_decode_attention_f32)(
        q.data(), kc.data(), vc.data(), bt, 3, sl, out.data(), 1, Hq, Hkv, D, BS, scale, window);
    attention_reference(q.data(), kd[0], vd[0], 1, S[0], Hq, Hkv, D, scale, window, ref.data());
    std::snprintf(name, sizeof(name), "decode attention %s window %lld", bf16 ? "bf16" : "f32", (long long)window);
    check(name, status == 0 ? max_error(out, ref) : 1e9f, bf16 ? kPairTolerance : 1e-4f);
  }
  {  // prefill: both requests in one call (the decode is a one-row chunk)
    const int64_t rows = n[0] + n[1];
    const auto q = rng.normals(rows * Hq * D);
    std::vector<float> out(rows * Hq * D), ref(rows * Hq * D);
    const int64_t bt[6] = {table[0][0], table[0][1], table[0][2], table[1][0], table[1][1], table[1][2]};
    const int64_t starts[2] = {0, n[0]}, sl[2] = {S[0], S[1]};
    const int status = paged_prefill_attention(bf16 ? PAGEDLLM_CACHE_BF16 : PAGEDLLM_CACHE_F32, q.data(), Hq * D, kc.data(), vc.data(), bt, 3, starts, n, sl,
                                               out.data(), 2, Hq, Hkv, D, BS, scale, window);
    for (int r = 0; r < 2; ++r)
      attention_reference(q.data() + starts[r] * Hq * D, kd[r], vd[r], n[r], S[r], Hq, Hkv, D, scale, window,
                          ref.data() + starts[r] * Hq * D);
    std::snprintf(name, sizeof(name), "prefill attention %s window %lld", bf16 ? "bf16" : "f32", (long long)window);
    check(name, status == 0 ? max_error(out, ref) : 1e9f, bf16 ? kPairTolerance : 1e-4f);
  }
}

// An e4m3 code's value, from its definition (bias 7, subnormals, no infinities).
float from_e4m3(uint8_t c) {
  const int e = (c >> 3) & 15, m = c & 7;
  const float a = e ? std::ldexp(1.f + m / 8.f, e - 7) : std::ldexp(m / 8.f, -6);
  return c & 0x80 ? -a : a;
}

float from_f16(const uint8_t* p) {  // a normal float16 or zero
  const uint16_t h = uint16_t(p[0] | p[1] << 8);
  const int e = (h >> 10) & 0x1F;
  const float f = e ? std::ldexp(float(1024 | (h & 0x3FF)), e - 25) : 0.f;
  return h & 0x8000 ? -f : f;
}

// The scale of an 8-bit cache row (D codes, then a float16).
float row8_scale(const int8_t* row, int64_t D) { return from_f16(reinterpret_cast<const uint8_t*>(row + D)); }
// The value of element d of an 8-bit cache row.
float from_row8(int kind, const int8_t* row, int64_t D, int64_t d) {
  return (kind == PAGEDLLM_CACHE_INT8 ? float(row[d]) : from_e4m3(uint8_t(row[d]))) * row8_scale(row, D);
}

// The queries the kernels score over an int8 cache (kv_rows.h's quantize_query), as values
// to score at `scale`: per head of D, x = q * scale in codes round(x * 127 / max|x|) (nearest
// even), times max|x| / 127 / scale.
std::vector<float> int8_cache_queries(const float* q, int64_t heads, int64_t D, float scale) {
  std::vector<float> out(heads * D, 0.f);
  for (int64_t h = 0; h < heads; ++h) {
    float amax = 0.f;
    for (int64_t d = 0; d < D; ++d) amax = std::fmax(amax, std::fabs(q[h * D + d] * scale));
    if (amax == 0.f) continue;
    for (int64_t d = 0; d < D; ++d)
      out[h * D + d] = std::nearbyint(q[h * D + d] * scale * (127.f / amax)) * (amax / 127.f) / scale;
  }
  return out;
}

// Decode (one query at position S - 1) over an int8 cache as the kernels compute it
// (paged_attention.cpp's kIntCodes; prefill_attention.cpp's I, query by query): each query head scored as int8_cache_queries; per tile
// of 16 positions from a multiple of 16, the weights times the value rows' scales (vs,
// [S, Hkv]) as codes in [0, 127] (w * 127 / the tile's largest, rounded) against the value
// codes (vq, [S, Hkv, D]), times the largest / 127.
void decode_reference_int8(const float* q, const std::vector<float>& k, const std::vector<float>& vq,
                           const std::vector<float>& vs, int64_t S, int64_t Hq, int64_t Hkv, int64_t D, float scale,
                           int64_t window, float* out) {
  const int64_t first = window > 0 && S > window ? S - window : 0;
  for (int64_t h = 0; h < Hq; ++h) {
    const int64_t kh = h / (Hq / Hkv);
    const std::vector<float> x = int8_cache_queries(q + h * D, 1, D, scale);
    std::vector<double> e(S, 0.0);
    double mx = -1e300, sum = 0;
    for (int64_t j = first; j < S; ++j) {
      double s = 0;
      for (int64_t d = 0; d < D; ++d) s += double(x[d]) * k[(j * Hkv + kh) * D + d];
      e[j] = s * scale, mx = std::fmax(mx, e[j]);
    }
    for (int64_t j = first; j < S; ++j) e[j] = std::exp(e[j] - mx), sum += e[j];
    std::vector<double> o(D, 0.0);
    for (int64_t t0 = first - first % 16; t0 < S; t0 += 16) {
      double top = 0;
      for (int64_t j = std::max(t0, first); j < std::min(t0 + 16, S); ++j) top = std::fmax(top, e[j] * vs[j * Hkv + kh]);
      for (int64_t j = std::max(t0, first); j < std::min(t0 + 16, S); ++j) {
        const double w = top > std::ldexp(1.0, PAGEDLLM_INT8_WEIGHT_FLOOR_EXP) ? std::nearbyint(e[j] * vs[j * Hkv + kh] * 127.0 / top) * top / 127.0 : 0.0;
        for (int64_t d = 0; d < D; ++d) o[d] += w * vq[(j * Hkv + kh) * D + d];
      }
    }
    for (int64_t d = 0; d < D; ++d) out[h * D + d] = float(o[d] / sum);
  }
}

// 8-bit caches: K/V written by write_kv_cache (checked against the inputs at the code's
// rounding), then the decode and prefill attention against the reference over the K/V as
// stored (int8: decode_reference_int8, at each prefill query's position); and every e4m3 code read back through a
// one-key prefill (its output is V's row).
void test_attention_8bit(int kind, int64_t window) {
  Rng rng;
  const char* kname = kind == PAGEDLLM_CACHE_INT8 ? "int8" : "fp8";
  const int64_t BS = 16, Hq = 6, Hkv = 2, D = 64, RW = D + PAGEDLLM_KV_SCALE_BYTES, blocks = 16;
  const float scale = 0.125f;
  const int64_t S[2] = {37, 21}, n[2] = {1, 9};
  const int64_t table[2][3] = {{4, 9, 1}, {12, 0, 7}};
  std::vector<int8_t> kc(blocks * BS * Hkv * RW), vc(kc.size());
  std::vector<float> kd[2], vd[2];
  const float limit = kind == PAGEDLLM_CACHE_INT8 ? 127.f : 448.f;  // the largest code's magnitude
  float write_error = 0.f, scale_error = 0.f;
  for (int r = 0; r < 2; ++r) {
    const auto k = rng.normals(S[r] * Hkv * D), v = rng.normals(S[r] * Hkv * D);
    std::vector<int64_t> slots(S[r]);
    for (int64_t j = 0; j < S[r]; ++j) slots[j] = table[r][j / BS] * BS + j % BS;
    write_kv_cache(kind, k.data(), v.data(), Hkv * D, kc.data(), vc.data(), slots.data(), S[r], Hkv, D);
    kd[r].resize(k.size()), vd[r].resize(v.size());
    for (int64_t j = 0; j < S[r]; ++j)
      for (int64_t h = 0; h < Hkv; ++h) {
        const int8_t *krow = kc.data() + (slots[j] * Hkv + h) * RW, *vrow = vc.data() + (slots[j] * Hkv + h) * RW;
        const float sk = row8_scale(krow, D), sv = row8_scale(vrow, D);
        float amax_k = 0.f, amax_v = 0.f;
        for (int64_t d = 0; d < D; ++d)
          amax_k = std::fmax(amax_k, std::fabs(k[(j * Hkv + h) * D + d])), amax_v = std::fmax(amax_v, std::fabs(v[(j * Hkv + h) * D + d]));
        // scale * limit / max|x| in [1, 1 + 2^-10] (rounded up to float16): its distance from 1 + 2^-11
        scale_error = std::fmax(scale_error, std::fmax(std::fabs(sk * limit / amax_k - 1.00048828f), std::fabs(sv * limit / amax_v - 1.00048828f)));
        for (int64_t d = 0; d < D; ++d) {
          const int64_t e = (j * Hkv + h) * D + d;
          kd[r][e] = from_row8(kind, krow, D, d), vd[r][e] = from_row8(kind, vrow, D, d);
          // int8: half a step of the row's scale; e4m3: half a unit in the last place (2^-4 of the value), or of 2^-9 * scale.
          const float tk = kind == PAGEDLLM_CACHE_INT8 ? sk / 2.f : std::fmax(std::fabs(k[e]) / 16.f, sk / 1024.f);
          const float tv = kind == PAGEDLLM_CACHE_INT8 ? sv / 2.f : std::fmax(std::fabs(v[e]) / 16.f, sv / 1024.f);
          write_error = std::fmax(write_error, std::fmax(std::fabs(kd[r][e] - k[e]) / tk, std::fabs(vd[r][e] - v[e]) / tv));
        }
      }
  }
  // int8: each request's value codes (vq, [S, Hkv, D]) and row scales (vs, [S, Hkv]) as stored.
  std::vector<float> vq[2], vs[2];
  for (int r = 0; r < 2 && kind == PAGEDLLM_CACHE_INT8; ++r) {
    vq[r].resize(vd[r].size()), vs[r].resize(S[r] * Hkv);
    for (int64_t j = 0; j < S[r]; ++j)
      for (int64_t h = 0; h < Hkv; ++h) {
        const int8_t* vrow = vc.data() + ((table[r][j / BS] * BS + j % BS) * Hkv + h) * RW;
        vs[r][j * Hkv + h] = row8_scale(vrow, D);
        for (int64_t d = 0; d < D; ++d) vq[r][(j * Hkv + h) * D + d] = float(vrow[d]);
      }
  }
  char name[64];
  std::snprintf(name, sizeof(name), "write_kv_cache %s (error / half a step)", kname);
  check(name, write_error, 1.0001f);
  std::snprintf(name, sizeof(name), "write_kv_cache %s scale (max|x| / %g up to float16)", kname, limit);
  check(name, scale_error, 0.000489f);
  {
    const auto q = rng.normals(Hq * D);
    std::vector<float> out(Hq * D), ref(Hq * D);
    const int64_t bt[3] = {table[0][0], table[0][1], table[0][2]}, sl[1] = {S[0]};
    const int status = (kind == PAGEDLLM_CACHE_INT8 ? paged_decode_attention_int8 : paged_decode_attention_fp8)(
        q.data(), kc.data(), vc.data(), bt, 3, sl, out.data(), 1, Hq, Hkv, D, BS, scale, window);
    if (kind == PAGEDLLM_CACHE_INT8) {
      decode_reference_int8(q.data(), kd[0], vq[0], vs[0], S[0], Hq, Hkv, D, scale, window, ref.data());
    } else {
      attention_reference(q.data(), kd[0], vd[0], 1, S[0], Hq, Hkv, D, scale, window, ref.data());
    }
    std::snprintf(name, sizeof(name), "decode attention %s window %lld", kname, (long long)window);
    check(name, status == 0 ? max_error(out, ref) : 1e9f, 1e-4f);
  }
  {
    const int64_t rows = n[0] + n[1];
    const auto q = rng.normals(rows * Hq * D);
    std::vector<float> out(rows * Hq * D), ref(rows * Hq * D);
    const int64_t bt[6] = {table[0][0], table[0][1], table[0][2], table[1][0], table[1][1], table[1][2]};
    const int64_t starts[2] = {0, n[0]}, sl[2] = {S[0], S[1]};
    const int status = paged_prefill_attention(kind, q.data(), Hq * D, kc.data(), vc.data(), bt, 3, starts, n, sl,
                                               out.data(), 2, Hq, Hkv, D, BS, scale, window);
    for (int r = 0; r < 2; ++r) {
      if (kind != PAGEDLLM_CACHE_INT8) {
        attention_reference(q.data() + starts[r] * Hq * D, kd[r], vd[r], n[r], S[r], Hq, Hkv, D, scale, window,
                            ref.data() + starts[r] * Hq * D);
        continue;
      }
      for (int64_t i = 0; i < n[r]; ++i)  // as decode at each query's position
        decode_reference_int8(q.data() + (starts[r] + i) * Hq * D, kd[r], vq[r], vs[r], S[r] - n[r] + i + 1, Hq, Hkv,
                              D, scale, window, ref.data() + (starts[r] + i) * Hq * D);
    }
    std::snprintf(name, sizeof(name), "prefill attention %s window %lld", kname, (long long)window);
    check(name, status == 0 ? max_error(out, ref) : 1e9f, kind == PAGEDLLM_CACHE_INT8 ? 1e-4f : kPairTolerance);
  }
  // Every code but the NaNs, 64 per one-key V row, read back through the softmax's 1 / l
  // (l = 1 here): relative error, since with -ffast-math GCC turns x86 vector divisions into a
  // reciprocal estimate and one Newton step (within 2 ulp); a misread code is off by >= 1/16.
  if (kind == PAGEDLLM_CACHE_FP8 && window == 0) {
    float code_error = 0.f;
    for (int part = 0; part < 4; ++part) {
      std::vector<int8_t> k1(RW, 0), v1(RW, 0);
      const uint16_t half = 0x3800;  // the scale: 0.5 in float16
      std::memcpy(v1.data() + D, &half, 2), std::memcpy(k1.data() + D, &half, 2);
      const float s = row8_scale(v1.data(), D);
      for (int64_t d = 0; d < D; ++d) v1[d] = int8_t((part * 64 + d) % 256 == 0x7F || part * 64 + d == 0xFF ? 0 : part * 64 + d);
      std::vector<float> q1(D, 1.f), out(D);
      const int64_t bt[1] = {0}, starts[1] = {0}, one[1] = {1};
      paged_prefill_attention(kind, q1.data(), D, k1.data(), v1.data(), bt, 1, starts, one, one, out.data(), 1, 1, 1, D,
                              1, 1.f, 0);
      for (int64_t d = 0; d < D; ++d) {
        const float want = from_e4m3(uint8_t(v1[d])) * s;
        code_error = std::fmax(code_error, std::fabs(out[d] - want) / std::fmax(std::fabs(want), 1e-30f));
      }
    }
    check("fp8 e4m3: every code read back (relative)", code_error, 0x1p-22f);
  }
}

// Weight e of a row of GGUF blocks, read as ggml-common.h lays them out.
float gguf_weight(int64_t type, const uint8_t* row, int64_t e) {
  if (type == PAGEDLLM_GGML_Q8_0) {
    const uint8_t* b = row + e / 32 * 34;
    return from_f16(b) * float(int8_t(b[2 + e % 32]));
  }
  if (type == PAGEDLLM_GGML_Q5_0) {
    const uint8_t* b = row + e / 32 * 22;
    const int64_t j = e % 32;
    const uint32_t qh = uint32_t(b[2] | b[3] << 8 | b[4] << 16 | uint32_t(b[5]) << 24);
    const int q = (j < 16 ? b[6 + j] & 15 : b[6 + j - 16] >> 4) | ((qh >> j) & 1) << 4;
    return from_f16(b) * float(q - 16);
  }
  const int64_t j = e % 256;
  if (type == PAGEDLLM_GGML_Q6_K) {
    const uint8_t* b = row + e / 256 * 210;
    const int64_t h = j / 128, quarter = j % 128 / 32, l = j % 32;
    const uint8_t low = b[64 * h + l + 32 * (quarter & 1)];
    const int q = (quarter < 2 ? low & 15 : low >> 4) | ((b[128 + 32 * h + l] >> (2 * quarter)) & 3) << 4;
    return from_f16(b + 208) * float(int8_t(b[192 + j / 16])) * float(q - 32);
  }
  const bool q5 = type == PAGEDLLM_GGML_Q5_K;
  const uint8_t* b = row + e / 256 * (q5 ? 176 : 144);
  const uint8_t *s = b + 4, *qs = b + (q5 ? 48 : 16);
  const int64_t sub = j / 32, l = j % 32;
  const int sc = sub < 4 ? s[sub] & 63 : (s[sub + 4] & 15) | (s[sub - 4] >> 6) << 4;
  const int mn = sub < 4 ? s[sub + 4] & 63 : (s[sub + 4] >> 4) | (s[sub] >> 6) << 4;
  int q = sub % 2 ? qs[32 * (sub / 2) + l] >> 4 : qs[32 * (sub / 2) + l] & 15;
  if (q5) q |= ((b[16 + l] >> sub) & 1) << 4;
  return from_f16(b) * float(sc) * float(q) - from_f16(b + 2) * float(mn);
}

// N rows of K weights of GGUF type `type` as random bytes, d = 2^-10 (and dmin = 2^-11).
std::vector<uint8_t> random_blocks(Rng& rng, int64_t type, int64_t N, int64_t K) {
  const bool super = type == PAGEDLLM_GGML_Q4_K || type == PAGEDLLM_GGML_Q5_K || type == PAGEDLLM_GGML_Q6_K;
  const int64_t rb = kquant_row_bytes(type, K), block = super ? 256 : 32, block_bytes = rb / (K / block);
  std::vector<uint8_t> w(N * rb);
  for (uint8_t& byte : w) {
    rng.s ^= rng.s << 13, rng.s ^= rng.s >> 7, rng.s ^= rng.s << 17;
    byte = uint8_t(rng.s >> 56);
  }
  for (int64_t i = 0; i < N * K / block; ++i) {
    uint8_t* b = w.data() + i * block_bytes;
    uint8_t* d = type == PAGEDLLM_GGML_Q6_K ? b + 208 : b;
    d[0] = 0x00, d[1] = 0x14;  // 2^-10
    if (type == PAGEDLLM_GGML_Q4_K || type == PAGEDLLM_GGML_Q5_K) b[2] = 0x00, b[3] = 0x10;  // dmin 2^-11
    if (type == PAGEDLLM_GGML_Q8_0)  // codes in [-127, 127], as quantizers write them
      for (int j = 2; j < 34; ++j) b[j] = b[j] == 0x80 ? 0x81 : b[j];
  }
  return w;
}

// GGUF blocks as stored: random bytes (d = 2^-10, dmin = 2^-11) dequantized and multiplied by
// linear_kquant (3 rows: the decode path; 11: the prefill panels), against the layouts read in
// plain C++ and int8 activations.
void test_kquant(int64_t M) {
  Rng rng;
  const int64_t N = 37;
  const int64_t types[] = {PAGEDLLM_GGML_Q4_K, PAGEDLLM_GGML_Q5_K, PAGEDLLM_GGML_Q6_K, PAGEDLLM_GGML_Q8_0,
                           PAGEDLLM_GGML_Q5_0};
  const char* names[] = {"Q4_K", "Q5_K", "Q6_K", "Q8_0", "Q5_0"};
  for (int t = 0; t < 5; ++t) {
    const int64_t type = types[t], K = t < 3 ? 512 : 640, rb = kquant_row_bytes(type, K);
    const std::vector<uint8_t> w = random_blocks(rng, type, N, K);
    std::vector<float> ref_w(N * K), dq(N * K);
    for (int64_t n = 0; n < N; ++n)
      for (int64_t k = 0; k < K; ++k) ref_w[n * K + k] = gguf_weight(type, w.data() + n * rb, k);
    kquant_dequantize(type, w.data(), nullptr, N, K, dq.data());
    char name[64];
    std::snprintf(name, sizeof name, "kquant_dequantize %s", names[t]);
    check(name, max_error(dq, ref_w), 1e-6f);
    const auto x = rng.normals(M * K);
    std::vector<float> ref(M * N), y(M * N);
    for (int64_t m = 0; m < M; ++m) {
      std::vector<int8_t> xc;
      std::vector<float> xs;
      quantize(x.data() + m * K, K, xc, xs);
      for (int64_t n = 0; n < N; ++n) {
        double s = 0.;
        for (int64_t k = 0; k < K; ++k) s += double(xs[k / 32]) * xc[k] * ref_w[n * K + k];
        ref[m * N + n] = float(s);
      }
    }
    KQuantWeight kw{};
    kw.num_parts = 1, kw.parts[0].type = type, kw.parts[0].rows = N, kw.parts[0].blocks = w.data();
    const int status = linear_kquant(x.data(), K, &kw, nullptr, y.data(), M, N, K, M);
    std::snprintf(name, sizeof name, "linear_kquant %s, %d rows", names[t], int(M));
    check(name, status == 0 ? max_error(y, ref) : 1e9f, 1e-4f);
    // The same rows repacked into panels: within the same bound, and row by row (one at a time,
    // the decode batch size) the bits of the stored blocks' prefill panels at 11 rows.
    std::vector<uint8_t> panels(kquant_panel_bytes(type, N, K));
    const int packed = kquant_pack_panels(type, w.data(), N, K, panels.data());
    kw.parts[0].type = type | PAGEDLLM_KQUANT_PANELS, kw.parts[0].blocks = panels.data();
    std::vector<float> yp(M * N);
    for (int64_t m = 0; m < M; ++m) linear_kquant(x.data() + m * K, K, &kw, nullptr, yp.data() + m * N, 1, N, K, 1);
    std::snprintf(name, sizeof name, "linear_kquant %s panels, %d rows", names[t], int(M));
    check(name, packed == 0 ? max_error(yp, ref) : 1e9f, 1e-4f);
    if (M >= 8) {
      std::snprintf(name, sizeof name, "linear_kquant %s panels = prefill panels", names[t]);
      check(name, packed == 0 ? max_error(yp, y) : 1e9f, 0.f);
    }
  }
}

// fused_moe with float32 experts against the formula: softmax over the experts, top 2
// renormalized, each expert's SwiGLU, weighted sum; T = 5 tokens of 6 experts leave some idle.
void test_moe() {
  Rng rng;
  const int64_t T = 5, E = 6, top = 2, H = 40, I = 36;  // ragged: neither a multiple of 32
  const auto x = rng.normals(T * H), router = rng.normals(E * H);
  std::vector<std::vector<float>> gate_up, down, packed_gu, packed_d;
  std::vector<LinearDesc> gu_desc(E), d_desc(E);
  std::vector<float> packed_router((E + 31) / 32 * 32 * H);
  linear_pack_f32(router.data(), packed_router.data(), E, H);
  for (int64_t e = 0; e < E; ++e) {
    gate_up.push_back(rng.normals(2 * I * H)), down.push_back(rng.normals(H * I));
    for (float& w : gate_up[e]) w *= 0.2f;
    for (float& w : down[e]) w *= 0.2f;
    packed_gu.emplace_back((2 * I + 31) / 32 * 32 * H), packed_d.emplace_back((H + 31) / 32 * 32 * I);
    linear_pack_f32(gate_up[e].data(), packed_gu[e].data(), 2 * I, H);
    linear_pack_f32(down[e].data(), packed_d[e].data(), H, I);
    gu_desc[e] = {PAGEDLLM_LINEAR_F32, 2 * I, H, packed_gu[e].data(), nullptr, nullptr};
    d_desc[e] = {PAGEDLLM_LINEAR_F32, H, I, packed_d[e].data(), nullptr, nullptr};
  }
  const MoeDesc m = {E, top, 1, H, I, {PAGEDLLM_LINEAR_F32, E, H, packed_router.data(), nullptr, nullptr},
                     gu_desc.data(), d_desc.data()};
  std::vector<float> y(T * H), ref(T * H, 0.f);
  const int status = fused_moe(&m, x.data(), H, T, y.data());
  for (int64_t t = 0; t < T; ++t) {
    std::vector<double> logit(E);
    for (int64_t e = 0; e < E; ++e)
      for (int64_t k = 0; k < H; ++k) logit[e] += double(router[e * H + k]) * x[t * H + k];
    int64_t best[2] = {0, 1};
    if (logit[1] > logit[0]) std::swap(best[0], best[1]);
    for (int64_t e = 2; e < E; ++e)
      if (logit[e] > logit[best[0]]) best[1] = best[0], best[0] = e;
      else if (logit[e] > logit[best[1]]) best[1] = e;
    const double w0 = 1.0 / (1.0 + std::exp(logit[best[1]] - logit[best[0]]));
    for (int j = 0; j < 2; ++j) {
      const int64_t e = best[j];
      std::vector<double> h(I);
      for (int64_t i = 0; i < I; ++i) {
        double g = 0, u = 0;
        for (int64_t k = 0; k < H; ++k)
          g += double(gate_up[e][i * H + k]) * x[t * H + k], u += double(gate_up[e][(I + i) * H + k]) * x[t * H + k];
        h[i] = g / (1.0 + std::exp(-g)) * u;
      }
      for (int64_t n = 0; n < H; ++n) {
        double s = 0;
        for (int64_t i = 0; i < I; ++i) s += double(down[e][n * I + i]) * h[i];
        ref[t * H + n] += float((j == 0 ? w0 : 1.0 - w0) * s);
      }
    }
  }
  check("fused_moe float32 experts", status == 0 ? max_error(y, ref) : 1e9f, 1e-4f);
}

// The thread team: every item of every job runs exactly once, whatever the sizes and chunks,
// with jobs nested inside jobs and jobs started by several threads at once.
void test_parallel() {
  omp_set_num_threads(4);
  float misses = 0.f;
  for (int64_t n : {1, 2, 3, 17, 1000, 100003})
    for (int64_t grain : {0, 1, 7, 4096}) {
      std::vector<std::atomic<int>> hits(n);
      par::parallel_for(n, [&](int64_t i) { hits[i].fetch_add(1); }, 2, grain);
      for (auto& h : hits) misses += h.load() != 1;
    }
  check("parallel_for: every item once", misses, 0.f);

  std::vector<std::atomic<int>> nested(64 * 64);
  par::parallel_for(64, [&](int64_t i) { par::parallel_for(64, [&](int64_t j) { nested[i * 64 + j].fetch_add(1); }); });
  misses = 0.f;
  for (auto& h : nested) misses += h.load() != 1;
  check("parallel_for: nested jobs", misses, 0.f);

  std::atomic<int> wrong{0};
  std::vector<std::thread> callers;
  for (int c = 0; c < 4; ++c)
    callers.emplace_back([&] {
      omp_set_num_threads(4);
      for (int job = 0; job < 300; ++job) {
        std::vector<std::atomic<int>> hits(257);
        par::parallel_for(257, [&](int64_t i) { hits[i].fetch_add(1); }, 2, 3);
        for (auto& h : hits) wrong += h.load() != 1;
      }
    });
  for (auto& t : callers) t.join();
  check("parallel_for: four callers at once", float(wrong.load()), 0.f);
}

// fused_moe with experts as GGUF blocks (gate/up Q4_K + Q5_K parts; down Q6_K or Q8_0) against
// the same experts one token at a time through linear_kquant and silu_and_mul: the grouping by
// expert changes nothing in a token's rows. 7 tokens of 4 experts, top 2 of the softmax.
void test_moe_kquant() {
  Rng rng;
  const int64_t T = 7, E = 4, top = 2, H = 256, I = 256;
  const auto x = rng.normals(T * H), router = rng.normals(E * H);
  std::vector<float> packed_router((E + 31) / 32 * 32 * H);
  linear_pack_f32(router.data(), packed_router.data(), E, H);
  std::vector<std::vector<uint8_t>> gate(E), up(E), down(E);
  std::vector<KQuantWeight> gu_w(E), d_w(E);
  std::vector<LinearDesc> gu_desc(E), d_desc(E);
  for (int64_t e = 0; e < E; ++e) {
    const int64_t down_type = e % 2 ? PAGEDLLM_GGML_Q8_0 : PAGEDLLM_GGML_Q6_K;
    gate[e] = random_blocks(rng, PAGEDLLM_GGML_Q4_K, I, H), up[e] = random_blocks(rng, PAGEDLLM_GGML_Q5_K, I, H);
    down[e] = random_blocks(rng, down_type, H, I);
    gu_w[e] = {};
    gu_w[e].num_parts = 2;
    gu_w[e].parts[0] = {PAGEDLLM_GGML_Q4_K, I, gate[e].data()}, gu_w[e].parts[1] = {PAGEDLLM_GGML_Q5_K, I, up[e].data()};
    d_w[e] = {};
    d_w[e].num_parts = 1, d_w[e].parts[0] = {down_type, H, down[e].data()};
    gu_desc[e] = {PAGEDLLM_LINEAR_KQUANT, 2 * I, H, &gu_w[e], nullptr, nullptr};
    d_desc[e] = {PAGEDLLM_LINEAR_KQUANT, H, I, &d_w[e], nullptr, nullptr};
  }
  const MoeDesc m = {E, top, 0, H, I, {PAGEDLLM_LINEAR_F32, E, H, packed_router.data(), nullptr, nullptr},
                     gu_desc.data(), d_desc.data()};
  // fused_moe against its experts one token at a time (the softmax in double).
  auto check_experts = [&](const char* name) {
    std::vector<float> y(T * H), ref(T * H, 0.f), h(2 * I), out(H);
    const int status = fused_moe(&m, x.data(), H, T, y.data());
    for (int64_t t = 0; t < T; ++t) {
      std::vector<double> logit(E), p(E);
      double sum = 0;
      for (int64_t e = 0; e < E; ++e) {
        for (int64_t k = 0; k < H; ++k) logit[e] += double(router[e * H + k]) * x[t * H + k];
      }
      for (int64_t e = 0; e < E; ++e) sum += (p[e] = std::exp(logit[e]));
      std::vector<int64_t> order = {0, 1, 2, 3};
      std::sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return logit[a] > logit[b]; });
      std::sort(order.begin(), order.begin() + top);  // summed in ascending expert order
      for (int64_t j = 0; j < top; ++j) {
        const int64_t e = order[j];
        linear_kquant(x.data() + t * H, H, &gu_w[e], nullptr, h.data(), 1, 2 * I, H, 1);
        silu_and_mul(h.data(), 2 * I, 1, I);
        linear_kquant(h.data(), 2 * I, &d_w[e], nullptr, out.data(), 1, H, I, 1);
        for (int64_t n = 0; n < H; ++n) ref[t * H + n] += float(p[e] / sum) * out[n];
      }
    }
    check(name, status == 0 ? max_error(y, ref) : 1e9f, 1e-4f);
  };
  check_experts("fused_moe GGUF-block experts");
  // The same experts repacked into panels.
  std::vector<std::vector<uint8_t>> packed;
  auto repack = [&](KQuantWeight& w, int64_t K) {
    for (int64_t p = 0; p < w.num_parts; ++p) {
      KQuantPart& part = w.parts[p];
      packed.emplace_back(kquant_panel_bytes(part.type, part.rows, K));
      kquant_pack_panels(part.type, part.blocks, part.rows, K, packed.back().data());
      part.type |= PAGEDLLM_KQUANT_PANELS, part.blocks = packed.back().data();
    }
  };
  for (int64_t e = 0; e < E; ++e) repack(gu_w[e], H), repack(d_w[e], I);
  check_experts("fused_moe GGUF-block experts in panels");
}

}  // namespace

int main() {
  test_parallel();
  test_linear();
  for (const int64_t M : {3, 11}) test_kquant(M);
  test_elementwise();
  test_moe();
  test_moe_kquant();
  for (int64_t window : {0, 5}) {
    test_attention<float>(false, window);
    test_attention<uint16_t>(true, window);
    test_attention_8bit(PAGEDLLM_CACHE_INT8, window);
    test_attention_8bit(PAGEDLLM_CACHE_FP8, window);
  }
  std::printf("%d passed, %d failed\n", passed, failed);
  return failed ? 1 : 0;
}

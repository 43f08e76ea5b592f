// vec.h in plain C++: 16 floats per F32x16, for any CPU the other headers do not cover, and
// the reference the per-ISA headers are tested against (the compiler may still vectorize the
// loops for the baseline ISA).
#pragma once

#include <stdint.h>

#include <cmath>
#include <cstring>

namespace vec {

inline constexpr const char* kName = "scalar";
inline constexpr int kF32Regs = 4;
inline constexpr int kGemmRowsF32 = 4;
inline constexpr int kGemmRowsI8 = 2;
inline constexpr int kGemmRowsI8Wide = 2;
inline constexpr int kGemmRowsQ4 = 2;
inline constexpr int kGemmRowsKQ = 2;
inline constexpr int kKQuantRecordFrom = 2;

struct F32x16 { float v[16]; };
struct I32x16 { int32_t v[16]; };
struct M16 { uint32_t bits; };  // lane i set: bit i

template <typename F>
inline F32x16 lanes(F f) {
  F32x16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = f(i);
  return r;
}

inline F32x16 zero() { return lanes([](int) { return 0.f; }); }
inline F32x16 set1(float x) { return lanes([x](int) { return x; }); }
inline F32x16 load(const float* p) { return lanes([p](int i) { return p[i]; }); }
inline void store(float* p, F32x16 a) { std::memcpy(p, a.v, sizeof(a.v)); }

inline M16 mask_range(int lo, int hi) { return {((1u << hi) - 1) & ~((1u << lo) - 1)}; }
inline M16 mask_first(int64_t n) { return mask_range(0, n >= 16 ? 16 : n <= 0 ? 0 : int(n)); }
inline M16 operator&(M16 a, M16 b) { return {a.bits & b.bits}; }
inline bool any(M16 a) { return a.bits != 0; }

inline F32x16 load_first(const float* p, int64_t n) { return lanes([p, n](int i) { return i < n ? p[i] : 0.f; }); }
inline void store_first(float* p, F32x16 a, int64_t n) {
  for (int i = 0; i < 16 && i < n; ++i) p[i] = a.v[i];
}

inline F32x16 load_bf16(const uint16_t* p) {
  return lanes([p](int i) {
    const uint32_t u = uint32_t(p[i]) << 16;
    float f;
    std::memcpy(&f, &u, sizeof(f));
    return f;
  });
}
inline void store_bf16_first(uint16_t* p, F32x16 a, int64_t n) {
  for (int i = 0; i < 16 && i < n; ++i) {
    uint32_t u;
    std::memcpy(&u, &a.v[i], sizeof(u));
    p[i] = uint16_t((u + 0x7FFF + ((u >> 16) & 1)) >> 16);  // round to nearest even
  }
}

inline F32x16 add(F32x16 a, F32x16 b) { return lanes([&](int i) { return a.v[i] + b.v[i]; }); }
inline F32x16 sub(F32x16 a, F32x16 b) { return lanes([&](int i) { return a.v[i] - b.v[i]; }); }
inline F32x16 mul(F32x16 a, F32x16 b) { return lanes([&](int i) { return a.v[i] * b.v[i]; }); }
inline F32x16 div(F32x16 a, F32x16 b) { return lanes([&](int i) { return a.v[i] / b.v[i]; }); }
inline F32x16 fma(F32x16 a, F32x16 b, F32x16 c) { return lanes([&](int i) { return std::fma(a.v[i], b.v[i], c.v[i]); }); }
inline F32x16 max(F32x16 a, F32x16 b) { return lanes([&](int i) { return a.v[i] > b.v[i] ? a.v[i] : b.v[i]; }); }
inline F32x16 abs(F32x16 a) { return lanes([&](int i) { return std::fabs(a.v[i]); }); }
inline F32x16 floor(F32x16 a) { return lanes([&](int i) { return std::floor(a.v[i]); }); }
inline F32x16 ldexp(F32x16 p, F32x16 n) { return lanes([&](int i) { return std::ldexp(p.v[i], int(n.v[i])); }); }
inline float reduce_add(F32x16 a) {
  float s = 0.f;
  for (float x : a.v) s += x;
  return s;
}
inline float reduce_max(F32x16 a) {
  float m = a.v[0];
  for (float x : a.v) m = x > m ? x : m;
  return m;
}
inline F32x16 reduce_add16(const F32x16 (&v)[16]) { return lanes([&](int i) { return reduce_add(v[i]); }); }

template <typename P>
inline M16 compare(F32x16 a, F32x16 b, P pred) {
  uint32_t bits = 0;
  for (int i = 0; i < 16; ++i) bits |= uint32_t(pred(a.v[i], b.v[i])) << i;
  return {bits};
}
inline M16 lt(F32x16 a, F32x16 b) { return compare(a, b, [](float x, float y) { return x < y; }); }
inline M16 gt(F32x16 a, F32x16 b) { return compare(a, b, [](float x, float y) { return x > y; }); }
inline M16 le(F32x16 a, F32x16 b) { return compare(a, b, [](float x, float y) { return x <= y; }); }
inline M16 eq(F32x16 a, F32x16 b) { return compare(a, b, [](float x, float y) { return x == y; }); }
inline F32x16 select(M16 m, F32x16 a, F32x16 b) { return lanes([&](int i) { return (m.bits >> i) & 1 ? a.v[i] : b.v[i]; }); }
inline F32x16 maskz(M16 m, F32x16 a) { return select(m, a, zero()); }

// The transpose-and-add tree (see vec_avx512.h), key-major here: after merge<N> the 2N keys'
// partial sums take 8 / N adjacent lanes each (N = 8: key s in lane s).
template <int N>
inline F32x16 merge(F32x16 a, F32x16 b) {
  constexpr int in = 16 / N, out = 8 / N;  // partial sums per key before and after
  return lanes([&](int i) {
    const F32x16& src = i < 8 ? a : b;
    const int key = (i % 8) / out, j = i % out;
    return src.v[key * in + 2 * j] + src.v[key * in + 2 * j + 1];
  });
}

inline float half_to_float(uint32_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1F, man = h & 0x3FF;
  if (exp == 0) return std::copysign(std::ldexp(float(man), -24), sign ? -1.f : 1.f);  // zero, subnormal
  const uint32_t u = sign | (exp == 31 ? 0x7F800000u : (exp + 112) << 23) | man << 13;  // 112 = 127 - 15
  float f;
  std::memcpy(&f, &u, sizeof(f));
  return f;
}
inline F32x16 load_f16(const uint16_t* p) { return lanes([p](int i) { return half_to_float(p[i]); }); }
inline F32x16 halves_f16(const uint8_t* a, const uint8_t* b) {
  const float x = half_to_float(uint32_t(a[0] | a[1] << 8)), y = half_to_float(uint32_t(b[0] | b[1] << 8));
  return lanes([x, y](int i) { return i < 8 ? x : y; });
}

inline F32x16 f16_pairs(const uint8_t* p, int64_t stride, int n) {
  uint16_t h[16] = {};
  for (int i = 0; i < n; ++i) {
    std::memcpy(&h[2 * i], p + i * stride, 2);
    h[2 * i + 1] = h[2 * i];
  }
  return load_f16(h);
}

inline I32x16 zero_i32() { return I32x16{}; }
inline I32x16 splat_i32(int32_t a) {
  I32x16 r;
  for (int32_t& x : r.v) x = a;
  return r;
}
inline I32x16 round_i32(F32x16 a) {
  I32x16 r;
  for (int i = 0; i < 16; ++i) r.v[i] = int32_t(std::nearbyint(a.v[i]));
  return r;
}
inline F32x16 to_f32(I32x16 a) { return lanes([&](int i) { return float(a.v[i]); }); }
inline void store_i8(int8_t* p, I32x16 a) {
  for (int i = 0; i < 16; ++i) p[i] = int8_t(a.v[i]);
}

struct DotX { int8_t x[4]; };
inline DotX dot_prepare(const int32_t* quad) {
  DotX d;
  std::memcpy(d.x, quad, 4);
  return d;
}
inline I32x16 dot_init(const int32_t*) { return I32x16{}; }
inline I32x16 dot(I32x16 acc, const DotX& x, const int8_t* w) {
  for (int l = 0; l < 16; ++l)
    for (int j = 0; j < 4; ++j) acc.v[l] += int32_t(x.x[j]) * w[4 * l + j];
  return acc;
}

struct DotWX { int16_t x[2]; };
inline DotWX dot_wide_prepare(const int32_t* pair) {
  DotWX d;
  std::memcpy(d.x, pair, 4);
  return d;
}
struct WideW { const int16_t* w; };
inline WideW dot_wide_load(const int16_t* w) { return {w}; }
inline I32x16 dot_wide(I32x16 acc, const DotWX& x, WideW w) {
  for (int l = 0; l < 16; ++l) acc.v[l] += int32_t(x.x[0]) * w.w[2 * l] + int32_t(x.x[1]) * w.w[2 * l + 1];
  return acc;
}

struct Q4W { uint8_t lo[64], hi[64]; };  // columns 0-15 and 16-31, 4 codes per column
inline Q4W dot_q4_load(const uint8_t* nibbles64) {
  Q4W w;
  for (int i = 0; i < 64; ++i) w.lo[i] = nibbles64[i] & 0x0F, w.hi[i] = nibbles64[i] >> 4;
  return w;
}
inline Q4W dot_u8_load(const uint8_t* codes128) {
  Q4W w;
  std::memcpy(w.lo, codes128, 64), std::memcpy(w.hi, codes128 + 64, 64);
  return w;
}
inline void store_q4w(uint8_t* codes128, const Q4W& w) { std::memcpy(codes128, w.lo, 64), std::memcpy(codes128 + 64, w.hi, 64); }
using DotQ4X = DotX;
inline DotQ4X dot_q4_prepare(const int32_t* quad) { return dot_prepare(quad); }
using Q4Sum = I32x16;
inline Q4Sum q4sum_zero() { return I32x16{}; }
inline I32x16 q4sum_i32(const Q4Sum& s) { return s; }
inline I32x16 q4sum_add(I32x16 acc, const Q4Sum& s) {
  for (int l = 0; l < 16; ++l) acc.v[l] += s.v[l];
  return acc;
}
inline constexpr int q4sum_steps(int) { return 1 << 20; }
inline void dot_q4(Q4Sum& lo, Q4Sum& hi, const DotQ4X& x, const Q4W& w) {
  for (int l = 0; l < 16; ++l)
    for (int j = 0; j < 4; ++j) lo.v[l] += int32_t(x.x[j]) * w.lo[4 * l + j], hi.v[l] += int32_t(x.x[j]) * w.hi[4 * l + j];
}

// Bytes of GGUF blocks (the K-quant GEMM).
struct U8x64 { uint8_t b[64]; };
inline U8x64 load_u8x64(const uint8_t* p) {
  U8x64 r;
  std::memcpy(r.b, p, 64);
  return r;
}
inline void store_u8x64(uint8_t* p, const U8x64& a) { std::memcpy(p, a.b, 64); }
inline U8x64 load_2x32(const uint8_t* a, const uint8_t* b) {
  U8x64 r;
  std::memcpy(r.b, a, 32), std::memcpy(r.b + 32, b, 32);
  return r;
}
inline U8x64 dup32(const uint8_t* p) { return load_2x32(p, p); }
inline U8x64 shr_and_halves(U8x64 a, int lo, int hi, uint8_t mask) {
  for (int i = 0; i < 64; ++i) a.b[i] = uint8_t((a.b[i] >> (i < 32 ? lo : hi)) & mask);
  return a;
}
inline U8x64 shr_and(U8x64 a, int n, uint8_t mask) { return shr_and_halves(a, n, n, mask); }
inline U8x64 shl_u8(U8x64 a, int n) {
  for (uint8_t& x : a.b) x = uint8_t(x << n);
  return a;
}
inline U8x64 or_u8(U8x64 a, const U8x64& b) {
  for (int i = 0; i < 64; ++i) a.b[i] |= b.b[i];
  return a;
}
inline U8x64 nibbles_2x16(const uint8_t* a, const uint8_t* b) {
  U8x64 r;
  for (int i = 0; i < 16; ++i) r.b[i] = a[i] & 0x0F, r.b[16 + i] = a[i] >> 4, r.b[32 + i] = b[i] & 0x0F, r.b[48 + i] = b[i] >> 4;
  return r;
}
inline void transpose_u32(U8x64 (&v)[16]) {
  U8x64 t[16];
  for (int i = 0; i < 16; ++i)
    for (int j = 0; j < 16; ++j) std::memcpy(t[j].b + 4 * i, v[i].b + 4 * j, 4);
  for (int j = 0; j < 16; ++j) v[j] = t[j];
}
inline U8x64 bits_to_bytes(uint64_t bits, uint8_t value) {
  U8x64 r;
  for (int i = 0; i < 64; ++i) r.b[i] = (bits >> i) & 1 ? value : 0;
  return r;
}
inline void dot_q4_bits(Q4W& w, uint64_t lo, uint64_t hi, uint8_t value) {
  for (int i = 0; i < 64; ++i) w.lo[i] |= (lo >> i) & 1 ? value : 0, w.hi[i] |= (hi >> i) & 1 ? value : 0;
}
inline F32x16 load_u8_f32(const uint8_t* p) { return lanes([p](int i) { return float(p[i]); }); }
inline F32x16 u8_f32(uint64_t lo, uint64_t hi) {
  return lanes([lo, hi](int i) { return float(((i < 8 ? lo : hi) >> (8 * (i % 8))) & 0xFF); });
}
inline F32x16 load_s8_f32(const int8_t* p) { return lanes([p](int i) { return float(p[i]); }); }
inline F32x16 load_e4m3(const uint8_t* p) {
  return lanes([p](int i) {
    const int e = (p[i] >> 3) & 0xF, m = p[i] & 7;
    const float a = e ? std::ldexp(float(8 + m), e - 10) : std::ldexp(float(m), -9);  // 2^(e-7) (1 + m/8); subnormal m 2^-9
    return p[i] & 0x80 ? -a : a;
  });
}
inline F32x16 expand4(F32x16 a, int c) { return lanes([&](int i) { return a.v[4 * c + i / 4]; }); }
inline I32x16 dot_u8s8(I32x16 acc, const U8x64& w, const int8_t* x) {
  for (int l = 0; l < 16; ++l)
    for (int j = 0; j < 4; ++j) acc.v[l] += int32_t(w.b[4 * l + j]) * x[4 * l + j];
  return acc;
}
inline U8x64 splat_u32(uint32_t v) {
  U8x64 r;
  for (int i = 0; i < 64; ++i) r.b[i] = uint8_t(v >> (8 * (i % 4)));
  return r;
}
inline I32x16 dot_u8s8_splat(I32x16 acc, const U8x64& w, uint32_t x) {
  for (int l = 0; l < 16; ++l)
    for (int j = 0; j < 4; ++j) acc.v[l] += int32_t(w.b[4 * l + j]) * int8_t(uint8_t(x >> (8 * j)));
  return acc;
}
inline U8x64 pack_u8x4(const I32x16& a, const I32x16& b, const I32x16& c, const I32x16& d) {
  U8x64 r;
  for (int l = 0; l < 16; ++l)
    r.b[4 * l] = uint8_t(a.v[l]), r.b[4 * l + 1] = uint8_t(b.v[l]), r.b[4 * l + 2] = uint8_t(c.v[l]), r.b[4 * l + 3] = uint8_t(d.v[l]);
  return r;
}
inline void interleave_rows4(const int8_t* const r[4], int8_t* out) {
  for (int m = 0; m < 4; ++m)
    for (int q = 0; q < 4; ++q)
      for (int i = 0; i < 4; ++i)
        for (int j = 0; j < 4; ++j) out[64 * m + 16 * q + 4 * i + j] = r[j][16 * q + 4 * m + i];
}
inline constexpr bool kDotXSums = false;
using S8W = U8x64;
inline S8W prepare_s8(const U8x64& w) { return w; }
inline I32x16 dot_s8(const S8W& w, const int8_t* x, const int32_t*) {
  I32x16 acc = zero_i32();
  for (int l = 0; l < 16; ++l)
    for (int j = 0; j < 4; ++j) acc.v[l] += int32_t(int8_t(w.b[4 * l + j])) * x[4 * l + j];
  return acc;
}

}  // namespace vec

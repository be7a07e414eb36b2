// A 16-float vector and the few operations the attention kernel needs, on AVX-512, on AVX2 + FMA (two
// 8-float halves) and in plain C++ elsewhere (what -march=native enables decides, at compile time).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif

namespace ferrum_cpu {

#if defined(__AVX512F__)
#define FERRUM_SIMD "avx512"
struct F16 {
  __m512 v;
};
inline F16 zero16() { return {_mm512_setzero_ps()}; }
inline F16 splat(float x) { return {_mm512_set1_ps(x)}; }
inline F16 load16(const float* p) { return {_mm512_loadu_ps(p)}; }
inline void store16(float* p, F16 a) { _mm512_storeu_ps(p, a.v); }
inline F16 fma16(F16 a, F16 b, F16 c) { return {_mm512_fmadd_ps(a.v, b.v, c.v)}; }
inline F16 add16(F16 a, F16 b) { return {_mm512_add_ps(a.v, b.v)}; }
inline F16 mul16(F16 a, F16 b) { return {_mm512_mul_ps(a.v, b.v)}; }
inline F16 max16(F16 a, F16 b) { return {_mm512_max_ps(a.v, b.v)}; }
inline float hmax16(F16 a) { return _mm512_reduce_max_ps(a.v); }
inline F16 load16(const c10::BFloat16* p) {
  const __m512i wide = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
  return {_mm512_castsi512_ps(_mm512_slli_epi32(wide, 16))};
}
inline F16 load16(const c10::Half* p) {
  return {_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)))};
}
inline F16 load16(const int8_t* p) {
  return {_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))))};
}
inline float hsum16(F16 a) { return _mm512_reduce_add_ps(a.v); }
// other element types (double): through a float buffer
template <typename T>
inline F16 load16(const T* p) {
  float f[16];
  for (int i = 0; i < 16; ++i) f[i] = static_cast<float>(p[i]);
  return load16(static_cast<const float*>(f));
}
// each lane rounded to bfloat16's precision (to nearest, ties to even), still a float
inline F16 round_bf16(F16 a) {
  const __m512i bits = _mm512_castps_si512(a.v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i up = _mm512_add_epi32(bits, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb));
  return {_mm512_castsi512_ps(_mm512_and_si512(up, _mm512_set1_epi32(int(0xFFFF0000u))))};
}
inline void store16(c10::BFloat16* p, F16 a) {  // a's lanes already hold bfloat16 values
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p),
                      _mm512_cvtepi32_epi16(_mm512_srli_epi32(_mm512_castps_si512(round_bf16(a).v), 16)));
}
// lane j: the sum of the lanes of a[j]
inline F16 sum16(const F16* a) {
  __m512 x[8], y[4];
  for (int i = 0; i < 8; ++i)
    x[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i].v, a[2 * i + 1].v),
                         _mm512_unpackhi_ps(a[2 * i].v, a[2 * i + 1].v));
  for (int i = 0; i < 4; ++i) {
    const __m512d l = _mm512_castps_pd(x[2 * i]), h = _mm512_castps_pd(x[2 * i + 1]);
    y[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(l, h)), _mm512_castpd_ps(_mm512_unpackhi_pd(l, h)));
  }
  const __m512 u0 = _mm512_add_ps(_mm512_shuffle_f32x4(y[0], y[1], 0x88), _mm512_shuffle_f32x4(y[0], y[1], 0xDD));
  const __m512 u1 = _mm512_add_ps(_mm512_shuffle_f32x4(y[2], y[3], 0x88), _mm512_shuffle_f32x4(y[2], y[3], 0xDD));
  return {_mm512_add_ps(_mm512_shuffle_f32x4(u0, u1, 0x88), _mm512_shuffle_f32x4(u0, u1, 0xDD))};
}
// e^x lane by lane for x in [-103, 88] (clamped there), relative error about 2e-7
inline F16 exp16(F16 a) {
  const __m512 x = _mm512_min_ps(_mm512_max_ps(a.v, _mm512_set1_ps(-103.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693147181f), x);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return {_mm512_scalef_ps(p, n)};
}

#elif defined(__AVX2__) && defined(__FMA__)
#define FERRUM_SIMD "avx2"
struct F16 {
  __m256 lo, hi;
};
inline F16 zero16() { return {_mm256_setzero_ps(), _mm256_setzero_ps()}; }
inline F16 splat(float x) { return {_mm256_set1_ps(x), _mm256_set1_ps(x)}; }
inline F16 load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
inline void store16(float* p, F16 a) {
  _mm256_storeu_ps(p, a.lo);
  _mm256_storeu_ps(p + 8, a.hi);
}
inline F16 fma16(F16 a, F16 b, F16 c) { return {_mm256_fmadd_ps(a.lo, b.lo, c.lo), _mm256_fmadd_ps(a.hi, b.hi, c.hi)}; }
inline F16 add16(F16 a, F16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
inline F16 mul16(F16 a, F16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
inline F16 max16(F16 a, F16 b) { return {_mm256_max_ps(a.lo, b.lo), _mm256_max_ps(a.hi, b.hi)}; }
inline float hmax16(F16 a) {
  const __m256 s = _mm256_max_ps(a.lo, a.hi);
  const __m128 q = _mm_max_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  const __m128 d = _mm_max_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_max_ss(d, _mm_movehdup_ps(d)));
}
inline __m256 bf16x8(const c10::BFloat16* p) {
  const __m256i wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(wide, 16));
}
inline F16 load16(const c10::BFloat16* p) { return {bf16x8(p), bf16x8(p + 8)}; }
inline __m256 i8x8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
}
inline F16 load16(const int8_t* p) { return {i8x8(p), i8x8(p + 8)}; }
inline float hsum16(F16 a) {
  const __m256 s = _mm256_add_ps(a.lo, a.hi);
  const __m128 q = _mm_add_ps(_mm256_castps256_ps128(s), _mm256_extractf128_ps(s, 1));
  const __m128 d = _mm_add_ps(q, _mm_movehl_ps(q, q));
  return _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)));
}
#if defined(__F16C__)
inline F16 load16(const c10::Half* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
#else
inline F16 load16(const c10::Half* p) {
  float f[16];
  for (int i = 0; i < 16; ++i) f[i] = static_cast<float>(p[i]);
  return load16(f);
}
#endif
// other element types (double): through a float buffer
template <typename T>
inline F16 load16(const T* p) {
  float f[16];
  for (int i = 0; i < 16; ++i) f[i] = static_cast<float>(p[i]);
  return load16(static_cast<const float*>(f));
}
inline __m256 round_bf16x8(__m256 a) {
  const __m256i bits = _mm256_castps_si256(a);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i up = _mm256_add_epi32(bits, _mm256_add_epi32(_mm256_set1_epi32(0x7FFF), lsb));
  return _mm256_castsi256_ps(_mm256_and_si256(up, _mm256_set1_epi32(int(0xFFFF0000u))));
}
inline F16 round_bf16(F16 a) { return {round_bf16x8(a.lo), round_bf16x8(a.hi)}; }
inline void store16(c10::BFloat16* p, F16 a) {
  float f[16];
  store16(f, round_bf16(a));
  for (int i = 0; i < 16; ++i) p[i] = c10::BFloat16(f[i]);  // exact: f holds bfloat16 values
}
// the 8 lanes: the sums of a[0..7]'s lanes
inline __m256 sum8(const __m256* a) {
  const __m256 h0 = _mm256_hadd_ps(_mm256_hadd_ps(a[0], a[1]), _mm256_hadd_ps(a[2], a[3]));
  const __m256 h1 = _mm256_hadd_ps(_mm256_hadd_ps(a[4], a[5]), _mm256_hadd_ps(a[6], a[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(h0, h1, 0x20), _mm256_permute2f128_ps(h0, h1, 0x31));
}
inline F16 sum16(const F16* a) {
  __m256 s[16];
  for (int i = 0; i < 16; ++i) s[i] = _mm256_add_ps(a[i].lo, a[i].hi);
  return {sum8(s), sum8(s + 8)};
}
inline __m256 exp8(__m256 a) {
  const __m256 x = _mm256_min_ps(_mm256_max_ps(a, _mm256_set1_ps(-87.f)), _mm256_set1_ps(88.f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693147181f), x);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
inline F16 exp16(F16 a) { return {exp8(a.lo), exp8(a.hi)}; }

#else
#define FERRUM_SIMD "generic"
struct F16 {
  float x[16];
};
inline F16 zero16() { return F16{}; }
inline F16 splat(float v) {
  F16 r;
  for (int i = 0; i < 16; ++i) r.x[i] = v;
  return r;
}
template <typename T>
inline F16 load16(const T* p) {
  F16 r;
  for (int i = 0; i < 16; ++i) r.x[i] = static_cast<float>(p[i]);
  return r;
}
inline void store16(float* p, F16 a) { std::memcpy(p, a.x, sizeof a.x); }
inline float hsum16(F16 a) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += a.x[i];
  return s;
}
inline F16 fma16(F16 a, F16 b, F16 c) {
  for (int i = 0; i < 16; ++i) c.x[i] += a.x[i] * b.x[i];
  return c;
}
inline F16 add16(F16 a, F16 b) {
  for (int i = 0; i < 16; ++i) a.x[i] += b.x[i];
  return a;
}
inline F16 mul16(F16 a, F16 b) {
  for (int i = 0; i < 16; ++i) a.x[i] *= b.x[i];
  return a;
}
inline F16 max16(F16 a, F16 b) {
  for (int i = 0; i < 16; ++i) a.x[i] = std::max(a.x[i], b.x[i]);
  return a;
}
inline float hmax16(F16 a) {
  float m = a.x[0];
  for (int i = 1; i < 16; ++i) m = std::max(m, a.x[i]);
  return m;
}
inline F16 round_bf16(F16 a) {
  for (int i = 0; i < 16; ++i) a.x[i] = static_cast<float>(c10::BFloat16(a.x[i]));
  return a;
}
inline void store16(c10::BFloat16* p, F16 a) {
  for (int i = 0; i < 16; ++i) p[i] = c10::BFloat16(a.x[i]);
}
inline F16 sum16(const F16* a) {
  F16 r;
  for (int j = 0; j < 16; ++j) {
    float s = 0.f;
    for (int i = 0; i < 16; ++i) s += a[j].x[i];
    r.x[j] = s;
  }
  return r;
}
inline F16 exp16(F16 a) {
  for (int i = 0; i < 16; ++i) a.x[i] = std::exp(a.x[i]);
  return a;
}
#endif

}  // namespace ferrum_cpu

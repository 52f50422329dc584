// Element access and math shared by the CPU kernels: float32 and bfloat16 (raw uint16 bits),
// all arithmetic in float32.

#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

inline float to_float(float x) { return x; }

inline float to_float(uint16_t x) {
  uint32_t bits = uint32_t(x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
}

inline void store(float x, float* out) { *out = x; }

inline void store(float x, uint16_t* out) {  // round to nearest even, as torch's .to(bf16)
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  *out = uint16_t((bits & 0x7fffffffu) > 0x7f800000u ? 0x7fc0u : rounded);  // NaN stays NaN
}

// x as type T would hold it: the rounding torch applies between two ops in bfloat16.
template <typename T>
inline float round_as(float x) {
  T held;
  store(x, &held);
  return to_float(held);
}

// exp(x) in a form the compiler vectorizes (std::exp stays a scalar call): Cephes' expf,
// 2^n * p(r) with |r| <= ln2 / 2, within 2 ulp of expf for x in [-87, 88].
inline float vector_exp(float x) {
  x = x < -87.f ? -87.f : (x > 88.f ? 88.f : x);  // beyond, 2^n is denormal or infinite
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.f;
  const uint32_t bits = uint32_t(int32_t(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, sizeof two_n);
  return p * two_n;
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }

inline __m512 load16(const uint16_t* p) {  // bfloat16 bits are a float's upper half
  const __m256i half = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(half), 16));
}

// vector_exp, 16 lanes at a time.
inline __m512 exp16(__m512 x) {
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(
      _mm512_fmadd_ps(x, _mm512_set1_ps(1.44269504088896341f), _mm512_set1_ps(0.5f)),
      _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fmadd_ps(n, _mm512_set1_ps(2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);  // p * 2^n
}

inline void store16(__m512 v, float* p) { _mm512_storeu_ps(p, v); }

// `round16` and `store16` round to nearest even, as `store` does, 16 lanes at a time.
inline __m512i bf16_bits(__m512 v) {  // in the low half of each lane
  const __m512i bits = _mm512_castps_si512(v);
  const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
  const __m512i bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff));
  const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, bias), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(rounded, nan, _mm512_set1_epi32(0x7fc0));
}

inline void store16(__m512 v, uint16_t* p) {
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(p), _mm512_cvtepi32_epi16(bf16_bits(v)));
}

template <typename T>
inline __m512 round16(__m512 v) {
  if constexpr (sizeof(T) == 2)
    return _mm512_castsi512_ps(_mm512_slli_epi32(bf16_bits(v), 16));
  else
    return v;
}
#endif

}  // namespace

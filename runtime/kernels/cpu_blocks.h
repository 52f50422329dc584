// GGUF's quantized blocks as the kernels read them: cpu_quant.cpp in the file's layout,
// cpu_repacked.cpp with rows interleaved. The block types, their float16 scales, and the int8
// products summed 4 to a lane that both multiply with.

#pragma once

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

#include "cpu_lanes.h"

// The intrinsics each width uses where the CPU has them; elsewhere (the other width, built by
// the tests on any CPU, or another architecture) plain loops that compute the same lanes.
#if RUNTIME_LANES == 16 && defined(__AVX512BW__)
#define QUANT_AVX512 1
#elif RUNTIME_LANES == 8 && defined(__AVX2__)
#define QUANT_AVX2 1
#endif

// Whether dot4's products of unsigned bytes up to 255 are exact: vpdpbusd sums them in int32,
// but without VNNI vpmaddubsw first adds pairs into int16, which saturates past 32767.
#if defined(QUANT_AVX512) && defined(__AVX512VNNI__)
#define QUANT_DOT_VNNI 1
#elif defined(QUANT_AVX2) && defined(__AVXVNNI__)
#define QUANT_DOT_VNNI 1
#endif
#if defined(QUANT_DOT_VNNI) || !(defined(QUANT_AVX512) || defined(QUANT_AVX2))
#define QUANT_EXACT_BYTES 1
#endif

namespace {

constexpr int kBlock = 32;          // weights per block, in each type here
constexpr int kBytes = kLanes * 4;  // bytes per vector

typedef int8_t vi8 __attribute__((vector_size(kBytes)));
typedef uint8_t vu8 __attribute__((vector_size(kBytes)));
typedef int32_t vi32 __attribute__((vector_size(kBytes)));

// runtime/kernels/quant_formats.py: QuantFormat.code
enum QType { kQ8_0 = 0, kQ4_0 = 1, kQ4_1 = 2 };

// GGUF's block layouts (ggml-common.h), byte for byte
struct BlockQ8_0 {
  uint16_t d;
  int8_t qs[kBlock];
};
struct BlockQ4_0 {
  uint16_t d;
  uint8_t qs[kBlock / 2];  // byte j: weight j in its low nibble, weight j + 16 in its high one
};
struct BlockQ4_1 {
  uint16_t d, m;
  uint8_t qs[kBlock / 2];
};
static_assert(sizeof(BlockQ8_0) == 34 && sizeof(BlockQ4_0) == 18 && sizeof(BlockQ4_1) == 20);

template <int T>
struct Layout;
template <>
struct Layout<kQ8_0> {
  using Block = BlockQ8_0;
};
template <>
struct Layout<kQ4_0> {
  using Block = BlockQ4_0;
};
template <>
struct Layout<kQ4_1> {
  using Block = BlockQ4_1;
};

inline float half_to_float(uint16_t h) {
#if defined(__F16C__)
  return _cvtsh_ss(h);
#else
  const uint32_t sign = uint32_t(h & 0x8000u) << 16, exponent = (h >> 10) & 0x1fu;
  const uint32_t mantissa = h & 0x3ffu;
  if (exponent == 0) {  // zero or subnormal: mantissa * 2^-24
    const float value = float(mantissa) * 5.9604645e-8f;
    return sign ? -value : value;
  }
  const uint32_t bits =
      sign | (exponent == 0x1f ? 0x7f800000u : (exponent + 112) << 23) | (mantissa << 13);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f;
#endif
}

// A block of 32 of x as int8 values `out` (llama.cpp's Q8_0 of activations): its scale, amax / 127.
inline float quantize_block(const float* in, int8_t* out) {
  float amax = 0.f;
  for (int j = 0; j < kBlock; ++j) amax = std::max(amax, std::fabs(in[j]));
  const float d = amax / 127.f, inverse = d > 0.f ? 1.f / d : 0.f;
  for (int j = 0; j < kBlock; ++j) out[j] = int8_t(std::nearbyint(in[j] * inverse));
  return d;
}

// acc plus, in lane i, the sum of the 4 products a[4i + j] * b[4i + j].
inline vi32 dot4_add(vi32 acc, vu8 a, vi8 b) {
#if defined(QUANT_AVX512) && defined(QUANT_DOT_VNNI)
  return vi32(_mm512_dpbusd_epi32(__m512i(acc), __m512i(a), __m512i(b)));
#elif defined(QUANT_AVX512)
  const __m512i pairs = _mm512_maddubs_epi16(__m512i(a), __m512i(b));
  return acc + vi32(_mm512_madd_epi16(pairs, _mm512_set1_epi16(1)));
#elif defined(QUANT_AVX2) && defined(QUANT_DOT_VNNI)
  return vi32(_mm256_dpbusd_avx_epi32(__m256i(acc), __m256i(a), __m256i(b)));
#elif defined(QUANT_AVX2)
  const __m256i pairs = _mm256_maddubs_epi16(__m256i(a), __m256i(b));
  return acc + vi32(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
#else
  for (int i = 0; i < kLanes; ++i) {
    int32_t sum = 0;
    for (int j = 4 * i; j < 4 * i + 4; ++j) sum += int32_t(a[j]) * int32_t(b[j]);
    acc[i] += sum;
  }
  return acc;
#endif
}

inline vi32 dot4(vu8 a, vi8 b) { return dot4_add(vi32{}, a, b); }

}  // namespace

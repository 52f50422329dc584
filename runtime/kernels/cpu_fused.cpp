// The small ops between the matmuls, fused: each reads its input once and writes once, where
// torch runs three to eight kernels (and, in a decode step, pays their dispatch each time).
// Each rounds where the torch path rounds, so bfloat16 results match it, not just float32.
//
// Rows of `dim` elements are contiguous; rows are spread over OpenMP threads only when there
// are enough elements, since starting a parallel region (~2 us with the threads spinning)
// costs more than a small decode's work, and otherwise run with no region at all (cpu_rows.h).
// SmolLM2's batch 32 in bfloat16 on an AMD EPYC, one thread against two: silu_and_mul
// [32, 2 x 1536] 35 -> 22 us, add + norm [32, 576] 17 -> 10 us, rotary [32, 12, 64] 16 ->
// 10 us.

#include <cstdint>

#include "cpu_common.h"
#include "cpu_rows.h"

namespace {

constexpr int64_t kElementsPerThread = 8192;

inline bool split(int64_t rows, int64_t width) {
  return rows > 1 && rows * width >= 2 * kElementsPerThread;
}

// residual == nullptr: out = w * norm(x). Otherwise residual += x (rounded to T, in place) and
// out = w * norm(residual). norm(v) = v / sqrt(mean(v^2) + eps), rounded to T before the
// weight multiplies it, as Hugging Face's RMSNorm does.
template <typename T>
void add_rms_norm(T* out, T* residual, const T* x, const T* weight, int64_t rows, int64_t dim,
                  float eps, int threads) {
  for_rows(rows, threads, split(rows, dim), [&](int64_t r) {
    const T* in = x + r * dim;
    T* sum = residual ? residual + r * dim : nullptr;
    float squares = 0.f;
    if (sum) {
#pragma omp simd reduction(+ : squares)
      for (int64_t d = 0; d < dim; ++d) {
        const float v = round_as<T>(to_float(sum[d]) + to_float(in[d]));
        store(v, sum + d);
        squares += v * v;
      }
      in = sum;
    } else {
#pragma omp simd reduction(+ : squares)
      for (int64_t d = 0; d < dim; ++d) squares += to_float(in[d]) * to_float(in[d]);
    }
    const float inv = 1.f / std::sqrt(squares / float(dim) + eps);
    T* o = out + r * dim;
#pragma omp simd
    for (int64_t d = 0; d < dim; ++d)
      store(to_float(weight[d]) * round_as<T>(to_float(in[d]) * inv), o + d);
  });
}

inline float silu(float g) { return g / (1.f + vector_exp(-g)); }

// out[r, i] = silu(x[r, i]) * x[r, inter + i]: gate and up halves of a fused projection.
// (Written with intrinsics where AVX-512 exists: gcc's own vectorization of this loop ran
// 5x slower than torch.)
template <typename T>
void silu_and_mul(T* out, const T* x, int64_t rows, int64_t inter, int threads) {
  for_rows(rows, threads, split(rows, 2 * inter), [&](int64_t r) {
    const T* gate = x + r * 2 * inter;
    const T* up = gate + inter;
    T* o = out + r * inter;
    int64_t i = 0;
#if defined(__AVX512F__)
    const __m512 one = _mm512_set1_ps(1.f);
    for (; i + 16 <= inter; i += 16) {
      const __m512 g = load16(gate + i);
      const __m512 minus_g = _mm512_sub_ps(_mm512_setzero_ps(), g);
      const __m512 s = _mm512_div_ps(g, _mm512_add_ps(one, exp16(minus_g)));
      store16(_mm512_mul_ps(round16<T>(s), load16(up + i)), o + i);
    }
#endif
    for (; i < inter; ++i) store(round_as<T>(silu(to_float(gate[i]))) * to_float(up[i]), o + i);
  });
}

// In place on x [tokens, heads, dim] (token stride given, heads packed): x * cos +
// roll(x, dim / 2) * sin_signed, with cos and sin_signed [tokens, dim] (see rotary.py).
template <typename T>
void rotary(T* x, int64_t token_stride, int64_t tokens, int64_t heads, int64_t dim,
            const T* cos, const T* sin_signed, int threads) {
  const int64_t half = dim / 2;
  for_rows(tokens, threads, split(tokens, heads * dim), [&](int64_t t) {
    const T* c = cos + t * dim;
    const T* s = sin_signed + t * dim;
    for (int64_t h = 0; h < heads; ++h) {
      T* v = x + t * token_stride + h * dim;
#pragma omp simd
      for (int64_t i = 0; i < half; ++i) {
        const float lo = to_float(v[i]), hi = to_float(v[i + half]);
        const float new_lo = round_as<T>(lo * to_float(c[i])) + hi * to_float(s[i]);
        const float new_hi = round_as<T>(hi * to_float(c[i + half])) + lo * to_float(s[i + half]);
        store(new_lo, v + i);
        store(new_hi, v + i + half);
      }
    }
  });
}

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16; returns 0, or 5 for another dtype.
int fused_add_rms_norm(int dtype, void* out, void* residual, const void* x, const void* weight,
                       int64_t rows, int64_t dim, float eps, int threads) {
  if (dtype == 0)
    return add_rms_norm(static_cast<float*>(out), static_cast<float*>(residual),
                        static_cast<const float*>(x), static_cast<const float*>(weight), rows,
                        dim, eps, threads),
           0;
  if (dtype == 1)
    return add_rms_norm(static_cast<uint16_t*>(out), static_cast<uint16_t*>(residual),
                        static_cast<const uint16_t*>(x), static_cast<const uint16_t*>(weight),
                        rows, dim, eps, threads),
           0;
  return 5;
}

int fused_silu_and_mul(int dtype, void* out, const void* x, int64_t rows, int64_t inter,
                       int threads) {
  if (dtype == 0)
    return silu_and_mul(static_cast<float*>(out), static_cast<const float*>(x), rows, inter,
                        threads),
           0;
  if (dtype == 1)
    return silu_and_mul(static_cast<uint16_t*>(out), static_cast<const uint16_t*>(x), rows,
                        inter, threads),
           0;
  return 5;
}

int fused_rotary(int dtype, void* x, int64_t token_stride, int64_t tokens, int64_t heads,
                 int64_t dim, const void* cos, const void* sin_signed, int threads) {
  if (dtype == 0)
    return rotary(static_cast<float*>(x), token_stride, tokens, heads, dim,
                  static_cast<const float*>(cos), static_cast<const float*>(sin_signed),
                  threads),
           0;
  if (dtype == 1)
    return rotary(static_cast<uint16_t*>(x), token_stride, tokens, heads, dim,
                  static_cast<const uint16_t*>(cos), static_cast<const uint16_t*>(sin_signed),
                  threads),
           0;
  return 5;
}

}  // extern "C"

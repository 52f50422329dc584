// The tiles of decode attention (cpu_attention.cpp): a tile is up to kTile consecutive
// cached tokens of one block, scored against (qk) or weighting (pv) the queries of one kv
// head's group. Three variants: plain loops that -O3 vectorizes, AVX-512 intrinsics on rows
// converted to float32, and AVX512-BF16 dot products straight on bfloat16 rows.

#pragma once

#include <cstdint>
#include <type_traits>

#include "cpu_common.h"

namespace {

constexpr int kTile = 16;  // tokens whose scores are computed together

// The n rows of a tile as float32: float32 rows where they lie in the cache, others converted
// into `tile` (copying float32 rows first took ~23% of one row's decode attention).
template <typename T>
const float* float_rows(const T* rows, int n, int64_t dim, float* __restrict tile) {
  if constexpr (std::is_same_v<T, float>) {
    return rows;
  } else {
    for (int64_t i = 0; i < n * dim; ++i) tile[i] = to_float(rows[i]);
    return tile;
  }
}

// A tile of `n` <= kTile consecutive cached tokens (rows of head_dim) of one block.
// qk_tile: their scores against the group's queries (`qf`, scaled, group x dim), written to
// scores[g * len + i]. pv_tile: adds their values, weighted by probs[g * len + i], to `acc`
// (group x dim). `tile` is kTile x dim floats of scratch.
template <typename T, int kDim>
void qk_tile(const float* __restrict qf, const T* rows, int n, int64_t group, int64_t dim_rt,
             float* __restrict scores, int64_t len, float* __restrict tile) {
  const int64_t dim = kDim > 0 ? kDim : dim_rt;
  const float* values = float_rows(rows, n, dim, tile);
  for (int64_t g = 0; g < group; ++g)
    for (int i = 0; i < n; ++i) {
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t d = 0; d < dim; ++d) dot += qf[g * dim + d] * values[i * dim + d];
      scores[g * len + i] = dot;
    }
}

template <typename T, int kDim>
void pv_tile(const float* __restrict probs, const T* rows, int n, int64_t group, int64_t dim_rt,
             int64_t len, float* __restrict acc, float* __restrict tile) {
  const int64_t dim = kDim > 0 ? kDim : dim_rt;
  const float* values = float_rows(rows, n, dim, tile);
  for (int64_t g = 0; g < group; ++g)
    for (int i = 0; i < n; ++i) {
      const float p = probs[g * len + i];
#pragma omp simd
      for (int64_t d = 0; d < dim; ++d) acc[g * dim + d] += p * values[i * dim + d];
    }
}

// Each of the `group` rows of `scores` (len floats) becomes exp(score - the row's max); the
// max and the sum of the exps go to top[g] and total[g].
inline void exp_rows(float* scores, int64_t group, int64_t len, float* top, float* total) {
  for (int64_t g = 0; g < group; ++g) {
    float* __restrict s = scores + g * len;
    float most = -INFINITY;
    for (int64_t t = 0; t < len; ++t) most = s[t] > most ? s[t] : most;
    float sum = 0.f;
#pragma omp simd reduction(+ : sum)
    for (int64_t t = 0; t < len; ++t) {
      s[t] = vector_exp(s[t] - most);
      sum += s[t];
    }
    top[g] = most;
    total[g] = sum;
  }
}

// Each of the `group` rows of `scores` (len floats) becomes its softmax.
inline void softmax_rows(float* scores, int64_t group, int64_t len, float* top, float* total) {
  exp_rows(scores, group, len, top, total);
  for (int64_t g = 0; g < group; ++g) {
    float* __restrict s = scores + g * len;
    const float inv = 1.f / total[g];
#pragma omp simd
    for (int64_t t = 0; t < len; ++t) s[t] *= inv;
  }
}

#if defined(__AVX512F__)
// Lane i of the result is the sum of v[i]'s 16 lanes: a transposing tree of 15 adds, where
// 16 separate horizontal sums would take ~10 dependent instructions each.
inline __m512 sum_each(const __m512* v) {
  __m512 pairs[8], quads[4], halves[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: (a, b, a, b)
    pairs[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                             _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  for (int i = 0; i < 4; ++i)  // per 128-bit lane: (a, b, c, d)
    quads[i] = _mm512_add_ps(_mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0x44),
                             _mm512_shuffle_ps(pairs[2 * i], pairs[2 * i + 1], 0xEE));
  for (int i = 0; i < 2; ++i)  // 128-bit lanes: (0-3, 0-3, 4-7, 4-7) + 8 * i
    halves[i] = _mm512_add_ps(_mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0x44),
                              _mm512_shuffle_f32x4(quads[2 * i], quads[2 * i + 1], 0xEE));
  return _mm512_add_ps(_mm512_shuffle_f32x4(halves[0], halves[1], 0x88),
                       _mm512_shuffle_f32x4(halves[0], halves[1], 0xDD));
}

inline void exp_rows_avx512(float* scores, int64_t group, int64_t len, float* top,
                            float* total) {
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * len;
    __m512 most = _mm512_set1_ps(-INFINITY);
    for (int64_t t = 0; t < len; t += 16) {
      const __mmask16 m = len - t >= 16 ? __mmask16(0xffff) : __mmask16((1u << (len - t)) - 1u);
      most = _mm512_mask_max_ps(most, m, most, _mm512_maskz_loadu_ps(m, s + t));
    }
    top[g] = _mm512_reduce_max_ps(most);
    const __m512 max = _mm512_set1_ps(top[g]);
    __m512 sum = _mm512_setzero_ps();
    for (int64_t t = 0; t < len; t += 16) {
      const __mmask16 m = len - t >= 16 ? __mmask16(0xffff) : __mmask16((1u << (len - t)) - 1u);
      const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(m, s + t), max));
      _mm512_mask_storeu_ps(s + t, m, e);
      sum = _mm512_mask_add_ps(sum, m, sum, e);
    }
    total[g] = _mm512_reduce_add_ps(sum);
  }
}

inline void softmax_rows_avx512(float* scores, int64_t group, int64_t len, float* top,
                                float* total) {
  exp_rows_avx512(scores, group, len, top, total);
  for (int64_t g = 0; g < group; ++g) {
    float* s = scores + g * len;
    const __m512 inv = _mm512_set1_ps(1.f / total[g]);
    for (int64_t t = 0; t < len; t += 16) {
      const __mmask16 m = len - t >= 16 ? __mmask16(0xffff) : __mmask16((1u << (len - t)) - 1u);
      _mm512_mask_storeu_ps(s + t, m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, s + t), inv));
    }
  }
}

template <typename T, int kDim>
void qk_tile_avx512(const float* __restrict qf, const T* rows, int n, int64_t group,
                    float* __restrict scores, int64_t len, float* __restrict tile) {
  constexpr int kChunks = kDim / 16;
  const float* values = float_rows(rows, n, kDim, tile);
  const __mmask16 valid = __mmask16((1u << n) - 1u);
  for (int64_t g = 0; g < group; ++g) {
    __m512 q[kChunks], dots[kTile];
    for (int c = 0; c < kChunks; ++c) q[c] = _mm512_loadu_ps(qf + g * kDim + 16 * c);
    for (int i = 0; i < kTile; ++i) {
      __m512 dot = _mm512_setzero_ps();
      if (i < n)
        for (int c = 0; c < kChunks; ++c)
          dot = _mm512_fmadd_ps(q[c], _mm512_loadu_ps(values + i * kDim + 16 * c), dot);
      dots[i] = dot;
    }
    _mm512_mask_storeu_ps(scores + g * len, valid, sum_each(dots));
  }
}

template <typename T, int kDim>
void pv_tile_avx512(const float* __restrict probs, const T* rows, int n, int64_t group,
                    int64_t len, float* __restrict acc, float* __restrict tile) {
  constexpr int kChunks = kDim / 16;
  const float* values = float_rows(rows, n, kDim, tile);
  for (int64_t g = 0; g < group; ++g) {
    __m512 sum[kChunks];
    for (int c = 0; c < kChunks; ++c) sum[c] = _mm512_loadu_ps(acc + g * kDim + 16 * c);
    for (int i = 0; i < n; ++i) {
      const __m512 p = _mm512_set1_ps(probs[g * len + i]);
      for (int c = 0; c < kChunks; ++c)
        sum[c] = _mm512_fmadd_ps(p, _mm512_loadu_ps(values + i * kDim + 16 * c), sum[c]);
    }
    for (int c = 0; c < kChunks; ++c) _mm512_storeu_ps(acc + g * kDim + 16 * c, sum[c]);
  }
}
#else
// Declared only, so that attend_group's `if constexpr (kAvx512)` branches parse on a CPU
// without AVX-512; kAvx512 is never true there, so nothing instantiates them.
void exp_rows_avx512(float* scores, int64_t group, int64_t len, float* top, float* total);
void softmax_rows_avx512(float* scores, int64_t group, int64_t len, float* top, float* total);
template <typename T, int kDim>
void qk_tile_avx512(const float* qf, const T* rows, int n, int64_t group, float* scores,
                    int64_t len, float* tile);
template <typename T, int kDim>
void pv_tile_avx512(const float* probs, const T* rows, int n, int64_t group, int64_t len,
                    float* acc, float* tile);
#endif

#if defined(__AVX512BF16__)
// bfloat16 with AVX512-BF16: vdpbf16ps multiplies pairs of bf16 lanes exactly and adds both
// products to a float32 lane, so dot products run straight on the cached rows (no conversion
// to float32 first) at twice the width of an FMA. Scores stay float32; the probabilities are
// rounded to bf16 before they weight V, as the torch path's bf16 matmul rounds them.

// The n <= kTile tokens' scores against each of the group's queries (bf16, unscaled).
template <int kDim>
void qk_tile_bf16(const uint16_t* __restrict q, float scale, const uint16_t* rows, int n,
                  int64_t group, float* __restrict scores, int64_t len) {
  constexpr int kChunks = kDim / 32;
  const __mmask16 valid = __mmask16((1u << n) - 1u);
  for (int64_t g = 0; g < group; ++g) {
    __m512bh qv[kChunks];
    for (int c = 0; c < kChunks; ++c) qv[c] = (__m512bh)_mm512_loadu_si512(q + g * kDim + 32 * c);
    __m512 dots[kTile];
    for (int i = 0; i < kTile; ++i) {
      __m512 dot = _mm512_setzero_ps();
      if (i < n)
        for (int c = 0; c < kChunks; ++c)
          dot = _mm512_dpbf16_ps(dot, qv[c],
                                 (__m512bh)_mm512_loadu_si512(rows + i * kDim + 32 * c));
      dots[i] = dot;
    }
    _mm512_mask_storeu_ps(scores + g * len, valid,
                          _mm512_mul_ps(sum_each(dots), _mm512_set1_ps(scale)));
  }
}

// Where element d of a head lies in `acc` as pv_tile_bf16 keeps it: rows t and t + 1 are
// interleaved by 16-bit unpacks, which work per 128-bit lane, so of 32 elements the `lo`
// accumulator holds 0-3, 8-11, 16-19, 24-27 and `hi` (16 floats later) the others.
inline int64_t interleaved(int64_t d) {
  const int64_t chunk = d / 32, lane = d % 32 / 8, k = d % 8;
  return 32 * chunk + (k < 4 ? 4 * lane + k : 16 + 4 * lane + k - 4);
}

// Adds the n <= kTile tokens' values, weighted by probs[g * len + i], to acc (interleaved);
// tokens go in pairs, an odd last one with a zero partner.
template <int kDim>
void pv_tile_bf16(const float* __restrict probs, const uint16_t* rows, int n, int64_t group,
                  int64_t len, float* __restrict acc) {
  constexpr int kChunks = kDim / 32;
  for (int64_t g = 0; g < group; ++g) {
    float* sums = acc + g * kDim;
    __m512 lo[kChunks], hi[kChunks];
    for (int c = 0; c < kChunks; ++c) {
      lo[c] = _mm512_loadu_ps(sums + 32 * c);
      hi[c] = _mm512_loadu_ps(sums + 32 * c + 16);
    }
    // the probabilities rounded to bf16 (nearest even), in pairs; lanes past n are zero
    const __mmask16 valid = __mmask16((1u << n) - 1u);
    alignas(32) int32_t pairs[kTile / 2];
    _mm256_store_si256(reinterpret_cast<__m256i*>(pairs),
                       (__m256i)_mm512_cvtneps_pbh(_mm512_maskz_loadu_ps(valid, probs + g * len)));
    for (int i = 0; i < n; i += 2) {
      const bool pair = i + 1 < n;
      const __m512bh p = (__m512bh)_mm512_set1_epi32(pairs[i / 2]);
      for (int c = 0; c < kChunks; ++c) {
        const __m512i r0 = _mm512_loadu_si512(rows + i * kDim + 32 * c);
        const __m512i r1 =  // past n: rows of another sequence, or never written
            pair ? _mm512_loadu_si512(rows + (i + 1) * kDim + 32 * c) : _mm512_setzero_si512();
        lo[c] = _mm512_dpbf16_ps(lo[c], p, (__m512bh)_mm512_unpacklo_epi16(r0, r1));
        hi[c] = _mm512_dpbf16_ps(hi[c], p, (__m512bh)_mm512_unpackhi_epi16(r0, r1));
      }
    }
    for (int c = 0; c < kChunks; ++c) {
      _mm512_storeu_ps(sums + 32 * c, lo[c]);
      _mm512_storeu_ps(sums + 32 * c + 16, hi[c]);
    }
  }
}

#endif

}  // namespace

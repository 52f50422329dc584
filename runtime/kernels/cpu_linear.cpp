// y = x W^T + b for the few rows of a decode step: x [M, K], W [N, K] as the checkpoint
// stores it, y [M, N]; float32 or bfloat16 (weights widened to float32 as they are read, all
// arithmetic in float32).
//
// With M of 1 to a few dozen rows a decode step's linears are a pass over their weights, and
// the time is how fast that pass streams. BLAS does not stream: MKL's sgemm copies the
// weights into its packed layout on every call, and oneDNN has no bfloat16 path without
// AVX-512 (torch then runs a scalar loop). Here each weight is read once: a tile of kTileN
// weight rows, held in L1, is multiplied with every row of x, kTileM rows at a time,
// kTileM x kTileN dot products accumulated in vector registers, while the next tile is
// prefetched. Weight tiles are spread over OpenMP threads. On an AVX2 EPYC, one thread,
// [8, 256] x [256, 4096] in float32: MKL 424 us with the weights in cache, 1,260 from
// memory; this 302 and 637. In bfloat16 torch took 4-6x as long as this.

#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "cpu_common.h"
#include "cpu_lanes.h"

#pragma GCC optimize("fp-contract=fast")  // acc += x * w as one FMA (ISO C++ mode forbids it)

namespace {

constexpr int kTileN = 4;  // weight rows per tile
constexpr int kTileM = 2;  // x rows per tile: kTileM * kTileN accumulators, kTileN weights
constexpr int64_t kBlockFloats = 96 * 1024;  // rows of x per block: 384 KB of L2
constexpr int64_t kMinBlock = 128;  // but not fewer rows: each block reads every weight again

// out[m, n] for TM rows of x (float32, `k` apart) and TN weight rows (TM * TN <= 8).
template <int TM, int TN>
void tile(float* out, int64_t out_stride, const float* x, const float* w, int64_t k) {
  static_assert(TM * TN <= 8, "one vector of sums");
  vfloat acc[TM][TN] = {};
  int64_t i = 0;
  for (; i + kLanes <= k; i += kLanes) {
    // each weight and x vector loaded once into a register (gcc folded the loads into the
    // FMAs, loading every weight vector once per row of x: 10 loads per 8 FMAs, more than
    // the load ports take; 6 with this, and 10-20% faster)
    vfloat wv[TN], xv[TM];
    for (int n = 0; n < TN; ++n) {
      wv[n] = load_lanes(w + n * k + i);
      keep_in_register(wv[n]);
    }
    for (int m = 0; m < TM; ++m) {
      xv[m] = load_lanes(x + m * k + i);
      keep_in_register(xv[m]);
    }
    for (int m = 0; m < TM; ++m)
      for (int n = 0; n < TN; ++n) acc[m][n] += xv[m] * wv[n];
  }
  vfloat8 folded[8] = {};
  for (int m = 0; m < TM; ++m)
    for (int n = 0; n < TN; ++n) folded[m * TN + n] = fold8(acc[m][n]);
  const vfloat8 sums = sum_each(folded);
  for (int m = 0; m < TM; ++m)
    for (int n = 0; n < TN; ++n) {
      float total = sums[m * TN + n];
      for (int64_t j = i; j < k; ++j) total += x[m * k + j] * w[n * k + j];
      out[m * out_stride + n] = total;
    }
}

// Weight rows [n0, n0 + TN) against every row of x. bfloat16 weights are widened into
// `wide` (TN * k floats, in L1) once, rather than once per tile of x.
template <typename T, int TN>
void weight_tile(float* out, const float* x, const T* w, int64_t rows, int64_t n, int64_t k,
                 int64_t n0, float* wide) {
  // the next tile's weights on their way from memory while this one computes: without
  // this, a step waited for each tile's weights, then computed, never both at once
  const char* next = reinterpret_cast<const char*>(w + (n0 + TN) * k);
  const char* end = reinterpret_cast<const char*>(w + n * k);
  for (int64_t b = 0; b < int64_t(TN * k * sizeof(T)) && next + b < end; b += 64)
    __builtin_prefetch(next + b, 0, 1);
  const float* wt;
  if constexpr (sizeof(T) == 4) {
    wt = reinterpret_cast<const float*>(w) + n0 * k;
  } else {
    for (int64_t i = 0; i < TN * k; ++i) wide[i] = to_float(w[n0 * k + i]);
    wt = wide;
  }
  int64_t m = 0;
  for (; m + kTileM <= rows; m += kTileM)
    tile<kTileM, TN>(out + m * n + n0, n, x + m * k, wt, k);
  for (; m < rows; ++m) tile<1, TN>(out + m * n + n0, n, x + m * k, wt, k);
}

template <typename T>
void linear(T* y, const T* x, const T* w, const T* bias, int64_t rows, int64_t n, int64_t k,
            float* scratch, int threads) {
  // float32 is read and written where it lies; bfloat16 x is widened once (a few KB), and
  // its results gathered in float32 before rounding
  const float* xf;
  float* acc;
  float* wide = scratch + rows * (k + n);  // kTileN * k floats per thread (bfloat16 only)
  if constexpr (sizeof(T) == 4) {
    xf = reinterpret_cast<const float*>(x);
    acc = reinterpret_cast<float*>(y);
  } else {
    float* widened = scratch;
    for (int64_t i = 0; i < rows * k; ++i) widened[i] = to_float(x[i]);
    xf = widened;
    acc = scratch + rows * k;
  }
  const int64_t tiles = n / kTileN;
  // rows in blocks whose float32 copy stays in L2 while every weight tile passes over it (a
  // prefill's x re-read from L3 once per weight tile ran at two thirds of the speed)
  const int64_t block = std::max<int64_t>(kMinBlock, kBlockFloats / k / kTileM * kTileM);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
    float* mine = wide + int64_t(omp_get_thread_num()) * kTileN * k;
    for (int64_t m0 = 0; m0 < rows; m0 += block) {
      const int64_t count = std::min(block, rows - m0);
#pragma omp for schedule(static)
      for (int64_t t = 0; t < tiles; ++t)
        weight_tile<T, kTileN>(acc + m0 * n, xf + m0 * k, w, count, n, k, t * kTileN, mine);
    }
  }
  for (int64_t n0 = tiles * kTileN; n0 < n; ++n0)
    weight_tile<T, 1>(acc, xf, w, rows, n, k, n0, wide);
  if (sizeof(T) == 4 && !bias) return;  // the results are y already
  for (int64_t m = 0; m < rows; ++m)
    for (int64_t j = 0; j < n; ++j) {
      const float b = bias ? to_float(bias[j]) : 0.f;
      store(acc[m * n + j] + b, y + m * n + j);
    }
}

}  // namespace

extern "C" {

// dtype 0: float32, 1: bfloat16 (x, w, bias and y alike). scratch (bfloat16 only): rows *
// (k + n) + threads * 4 * k floats. bias may be null.
int skinny_linear(int dtype, void* y, const void* x, const void* w, const void* bias,
                  int64_t rows, int64_t n, int64_t k, float* scratch, int threads) {
  if (dtype == 0)
    linear(static_cast<float*>(y), static_cast<const float*>(x), static_cast<const float*>(w),
           static_cast<const float*>(bias), rows, n, k, scratch, threads);
  else if (dtype == 1)
    linear(static_cast<uint16_t*>(y), static_cast<const uint16_t*>(x),
           static_cast<const uint16_t*>(w), static_cast<const uint16_t*>(bias), rows, n, k,
           scratch, threads);
  else
    return 100 + dtype;
  return 0;
}

}  // extern "C"

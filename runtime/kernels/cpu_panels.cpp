// y = x W^T + b with the weight packed once into panels: bfloat16 on CPUs with AVX512-BF16,
// float32 on any (in vectors of the CPU's width).
//
// A panel is 32 weight rows (output columns) laid out k by k, so one load holds the weights
// of 16 (or 8) columns at one k: for float32 [k][32]; for bfloat16 [k / 2][32][2], pairs of
// k, the operand VDPBF16PS multiplies with a pair of x's values broadcast to every lane. A
// micro-kernel keeps up to 12 rows of x x 32 columns of sums in 24 registers (AVX2: 6 rows x
// 16 columns in 12, half a panel a pass) and walks the panel once (from L1/L2) for those
// rows; panels are spread over OpenMP threads, so every thread streams its own part of the
// weight once per block of rows, start to end.
//
// Why not oneDNN, whose GEMM the packed weights went to before: at a decode step's few rows
// it runs far from the machine's rate. SmolLM2-135M's 120 layer matrices, weights from
// memory, AMD EPYC Zen 4 (AVX512-BF16), 2 threads, bfloat16: 1 row 10.2 ms against 6.4 here
// (the weight bandwidth), 8 rows 10.8 against 6.4, 32 rows 21.7 against 17.0 (313 against 400
// GFLOP/s), 512 rows 256 against 248; float32: 1 row 19.7 against 12.9, 8 rows 19.2 against
// 12.8, 32 rows 39.5 against 34.8, 512 rows 523 against 531. (CPUs with AMX keep oneDNN for
// bfloat16: its AMX path is not matched here; panel_isa says which panels a build takes.)

#include <omp.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <utility>

#include "cpu_common.h"
#include "cpu_lanes.h"

#pragma GCC optimize("fp-contract=fast")  // acc += x * w as one FMA (ISO C++ mode forbids it)

#if defined(__AVX512BF16__) && !defined(__AMX_BF16__)
#define PANELS_AVX512_BF16
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 32;  // weight rows (output columns) per panel: two vectors
constexpr int kRowsBf16 = 12;  // rows of x per micro-kernel call: 12 x 2 sums in registers
constexpr int64_t kRowBlockBytes = 512 * 1024;  // rows of x a pass over the weight serves

int64_t panels_of(int64_t n) { return (n + kPanel - 1) / kPanel; }

// out [panels][k / G][32][G] from w [n, k], G = 4 / sizeof(T) (the values one 32-bit lane
// holds); columns past n are zeros.
template <typename T>
void pack(T* out, const T* w, int64_t n, int64_t k, int threads) {
  constexpr int64_t G = 4 / sizeof(T);
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t p = 0; p < panels_of(n); ++p)
    for (int64_t i = 0; i < k / G; ++i)
      for (int64_t c = 0; c < kPanel; ++c) {
        const int64_t col = p * kPanel + c;
        T* to = out + ((p * (k / G) + i) * kPanel + c) * G;
        for (int64_t j = 0; j < G; ++j) to[j] = col < n ? w[col * k + G * i + j] : T{};
      }
}

// float32: y[r, 0:width] for R rows of x against two vectors of columns of a panel (the
// whole panel in AVX-512's vectors, half of it in AVX2's, whose 16 registers hold 6 rows'
// sums for 16 columns, not for 32), plus bias (or null).
constexpr int kPassWidth = 2 * kLanes;

template <int R>
inline __attribute__((always_inline)) void pass_f32(float* y, int64_t n, const float* x,
                                                    int64_t k, const float* panel,
                                                    const float* bias, int width) {
  vfloat acc[R][2] = {};
  for (int64_t i = 0; i < k; ++i) {
    vfloat w0 = load_lanes(panel + i * kPanel), w1 = load_lanes(panel + i * kPanel + kLanes);
    keep_in_register(w0);  // loaded once, not folded into every row's FMA
    keep_in_register(w1);
    for (int r = 0; r < R; ++r) {
      const vfloat xv = vfloat{} + x[r * k + i];
      acc[r][0] += xv * w0;
      acc[r][1] += xv * w1;
    }
  }
  for (int r = 0; r < R; ++r) {
    alignas(64) float sums[kPassWidth];
    __builtin_memcpy(sums, acc[r], sizeof sums);
    for (int c = 0; c < width; ++c) y[r * n + c] = sums[c] + (bias ? bias[c] : 0.f);
  }
}

template <int R>
void micro_f32(float* y, int64_t n, const float* x, int64_t k, const float* panel,
               const float* bias, int cols) {
  pass_f32<R>(y, n, x, k, panel, bias, std::min(cols, kPassWidth));
  if constexpr (kPassWidth < kPanel) {
    if (cols > kPassWidth)
      pass_f32<R>(y + kPassWidth, n, x, k, panel + kPassWidth, bias ? bias + kPassWidth : bias,
                  cols - kPassWidth);
  }
}

#if defined(PANELS_AVX512_BF16)

// y[r, 0:cols] for R rows of x against one panel; bias (32 floats' worth, or null) added in
// float32 before the sums are rounded to bfloat16.
template <int R>
void micro_bf16(uint16_t* y, int64_t n, const uint16_t* x, int64_t k, const uint16_t* panel,
                const uint16_t* bias, int cols) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int32_t* pairs_of_x = reinterpret_cast<const int32_t*>(x);  // two bf16 in one int32
  for (int64_t i = 0; i < k / 2; ++i) {
    const __m512bh w0 = (__m512bh)_mm512_loadu_si512(panel + i * 2 * kPanel);
    const __m512bh w1 = (__m512bh)_mm512_loadu_si512(panel + i * 2 * kPanel + 32);
    for (int r = 0; r < R; ++r) {
      const __m512bh pair = (__m512bh)_mm512_set1_epi32(pairs_of_x[r * (k / 2) + i]);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], pair, w0);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], pair, w1);
    }
  }
  const __mmask16 low = cols >= 16 ? 0xffff : (1u << cols) - 1;
  const __mmask16 high = cols >= 32 ? 0xffff : cols <= 16 ? 0 : (1u << (cols - 16)) - 1;
  alignas(64) float b[kPanel] = {};
  for (int c = 0; bias && c < cols; ++c) b[c] = to_float(bias[c]);
  const __m512 b0 = _mm512_load_ps(b), b1 = _mm512_load_ps(b + 16);
  for (int r = 0; r < R; ++r) {
    const __m256bh y0 = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][0], b0));
    const __m256bh y1 = _mm512_cvtneps_pbh(_mm512_add_ps(acc[r][1], b1));
    _mm256_mask_storeu_epi16(y + r * n, low, (__m256i)y0);
    _mm256_mask_storeu_epi16(y + r * n + 16, high, (__m256i)y1);
  }
}

#endif  // PANELS_AVX512_BF16

template <typename T>
using Micro = void (*)(T*, int64_t, const T*, int64_t, const T*, const T*, int);

template <int... R>
constexpr std::array<Micro<float>, sizeof...(R) + 1> f32_micros(
    std::integer_sequence<int, 0, R...>) {
  return {nullptr, micro_f32<R>...};
}

// float32's micro-kernels by rows: 12 rows x 2 vectors of 16 lanes (24 of AVX-512's 32
// registers), or 6 x 2 of 8 (12 of AVX2's 16)
constexpr int kRowsF32 = kLanes == 16 ? 12 : 6;
constexpr auto kMicroF32 = f32_micros(std::make_integer_sequence<int, kRowsF32 + 1>());

#if defined(PANELS_AVX512_BF16)
template <int... R>
constexpr std::array<Micro<uint16_t>, sizeof...(R) + 1> bf16_micros(
    std::integer_sequence<int, 0, R...>) {
  return {nullptr, micro_bf16<R>...};
}
constexpr auto kMicroBf16 = bf16_micros(std::make_integer_sequence<int, kRowsBf16 + 1>());
#endif

// rows of x in even groups of at most N - 1 rows (32 rows: 11 + 11 + 10, not 12 + 12 + 8:
// each group walks the panel once, and a short one does so for few sums)
template <typename T, size_t N>
void panel_rows(const std::array<Micro<T>, N>& micro, T* y, const T* x, const T* panel,
                const T* bias, int64_t rows, int64_t n, int64_t k, int cols) {
  const int64_t most = int64_t(N) - 1, groups = (rows + most - 1) / most;
  for (int64_t g = 0, r0 = 0; g < groups; ++g) {
    const int64_t count = (rows - r0) / (groups - g);
    micro[count](y + r0 * n, n, x + r0 * k, k, panel, bias, cols);
    r0 += count;
  }
}

template <typename T, size_t N>
void linear(const std::array<Micro<T>, N>& micro, T* y, const T* x, const T* packed,
            const T* bias, int64_t rows, int64_t n, int64_t k, int threads) {
  // a prefill's rows in blocks that stay in L2 while every panel passes over them
  const int64_t block =
      std::max<int64_t>(int64_t(N) - 1, kRowBlockBytes / (int64_t(sizeof(T)) * k));
#pragma omp parallel num_threads(threads) if (threads > 1)
  for (int64_t m0 = 0; m0 < rows; m0 += block) {
    const int64_t count = std::min(block, rows - m0);
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels_of(n); ++p) {
      const int cols = int(std::min(kPanel, n - p * kPanel));
      panel_rows(micro, y + m0 * n + p * kPanel, x + m0 * k, packed + p * k * kPanel,
                 bias ? bias + p * kPanel : nullptr, count, n, k, cols);
    }
  }
}

}  // namespace

extern "C" {

// Which panels this build's linears should take: 1 bfloat16 (AVX512-BF16 without AMX), 2
// float32 (AVX-512: against oneDNN as fast or faster at every number of rows; in AVX2's
// vectors, measured with AVX-512 turned off on the same EPYC, 0.75-0.83x of oneDNN's AVX2
// GEMM from 32 rows on, so there the packed weights stay oneDNN's). Both multiply anywhere
// the build has them: float32 panels always, in whatever vectors the CPU has.
int panel_isa() {
  int kinds = kLanes == 16 ? 2 : 0;
#if defined(PANELS_AVX512_BF16)
  kinds |= 1;
#endif
  return kinds;
}

// dtype 0: float32, 1: bfloat16 (k even). packed: panels_of(n) * 32 * k values.
int panel_pack(int dtype, void* packed, const void* w, int64_t n, int64_t k, int threads) {
  if (dtype == 0) {
    pack(static_cast<float*>(packed), static_cast<const float*>(w), n, k, threads);
    return 0;
  }
  if (dtype != 1) return 100 + dtype;
  if (!(panel_isa() & 1)) return 20;
  if (k % 2) return 21;
  pack(static_cast<uint16_t*>(packed), static_cast<const uint16_t*>(w), n, k, threads);
  return 0;
}

// y [rows, n] = x [rows, k] W^T + bias, all of `dtype`, W as `panel_pack` packed it; bias may
// be null.
int panel_linear(int dtype, void* y, const void* x, const void* packed, const void* bias,
                 int64_t rows, int64_t n, int64_t k, int threads) {
  if (dtype == 0) {
    linear(kMicroF32, static_cast<float*>(y), static_cast<const float*>(x),
           static_cast<const float*>(packed), static_cast<const float*>(bias), rows, n, k,
           threads);
    return 0;
  }
  if (dtype != 1) return 100 + dtype;
  if (k % 2) return 21;
#if defined(PANELS_AVX512_BF16)
  linear(kMicroBf16, static_cast<uint16_t*>(y), static_cast<const uint16_t*>(x),
         static_cast<const uint16_t*>(packed), static_cast<const uint16_t*>(bias), rows, n, k,
         threads);
  return 0;
#else
  (void)y, (void)x, (void)packed, (void)bias, (void)rows, (void)n, (void)threads;
  return 20;
#endif
}

}  // extern "C"

// y = x W^T + b in bfloat16 on CPUs with AVX512-BF16, the weight packed once into panels.
//
// A panel is 32 weight rows (output columns) laid out pair of k by pair of k: [k / 2][32][2]
// bfloat16, so one 64-byte load holds two k of 16 columns, the operand VDPBF16PS multiplies
// with a pair of x's values broadcast to every lane. A micro-kernel keeps up to 12 rows of x
// x 32 columns of sums in 24 registers and walks the panel once (from L1/L2) for those rows;
// panels are spread over OpenMP threads, so every thread streams its own part of the weight
// once per block of rows, start to end.
//
// Why not oneDNN, whose bf16 GEMM the packed weights went to before: at a decode step's few
// rows it runs far from the machine's rate. SmolLM2-135M's 120 layer matrices, weights from
// memory, AMD EPYC Zen 4 (AVX512-BF16), 2 threads: 1 row 10.2 ms against 6.4 here (the weight
// bandwidth), 8 rows 10.8 against 6.4, 32 rows 21.7 against 17.0 (313 against 400 GFLOP/s),
// 512 rows 256 against 248. (CPUs with AMX keep oneDNN, whose AMX path this does not match.)

#include <omp.h>

#include <algorithm>
#include <cstdint>

#include "cpu_common.h"

#if defined(__AVX512BF16__) && !defined(__AMX_BF16__)
#define PANELS_AVX512_BF16
#include <immintrin.h>
#endif

namespace {

constexpr int64_t kPanel = 32;  // weight rows (output columns) per panel: two vectors
constexpr int kRows = 12;  // rows of x per micro-kernel call: 12 x 2 sums in registers
constexpr int64_t kRowBlockBytes = 512 * 1024;  // rows of x a pass over the weight serves

int64_t panels_of(int64_t n) { return (n + kPanel - 1) / kPanel; }

// out [panels][k / 2][32][2] from w [n, k]; columns past n are zeros.
void pack(uint16_t* out, const uint16_t* w, int64_t n, int64_t k, int threads) {
  const int64_t pairs = k / 2;
#pragma omp parallel for num_threads(threads) schedule(static)
  for (int64_t p = 0; p < panels_of(n); ++p)
    for (int64_t i = 0; i < pairs; ++i)
      for (int64_t c = 0; c < kPanel; ++c) {
        const int64_t col = p * kPanel + c;
        uint16_t* to = out + ((p * pairs + i) * kPanel + c) * 2;
        to[0] = col < n ? w[col * k + 2 * i] : 0;
        to[1] = col < n ? w[col * k + 2 * i + 1] : 0;
      }
}

#if defined(PANELS_AVX512_BF16)

// y[r, 0:cols] for R rows of x against one panel; bias (32 floats' worth, or null) added in
// float32 before the sums are rounded to bfloat16.
template <int R>
void micro(uint16_t* y, int64_t n, const uint16_t* x, int64_t k, const uint16_t* panel,
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

using Micro = void (*)(uint16_t*, int64_t, const uint16_t*, int64_t, const uint16_t*,
                       const uint16_t*, int);
constexpr Micro kMicro[kRows + 1] = {nullptr,   micro<1>, micro<2>,  micro<3>, micro<4>,
                                     micro<5>,  micro<6>, micro<7>,  micro<8>, micro<9>,
                                     micro<10>, micro<11>, micro<12>};

// rows of x in even groups of at most kRows (32 rows: 11 + 11 + 10, not 12 + 12 + 8: each
// group walks the panel once, and a short one does so for few sums)
void panel_rows(uint16_t* y, const uint16_t* x, const uint16_t* panel, const uint16_t* bias,
                int64_t rows, int64_t n, int64_t k, int cols) {
  const int64_t groups = (rows + kRows - 1) / kRows;
  for (int64_t g = 0, r0 = 0; g < groups; ++g) {
    const int64_t count = (rows - r0) / (groups - g);
    kMicro[count](y + r0 * n, n, x + r0 * k, k, panel, bias, cols);
    r0 += count;
  }
}

void linear(uint16_t* y, const uint16_t* x, const uint16_t* packed, const uint16_t* bias,
            int64_t rows, int64_t n, int64_t k, int threads) {
  // a prefill's rows in blocks that stay in L2 while every panel passes over them
  const int64_t block = std::max<int64_t>(kRows, kRowBlockBytes / (2 * k));
#pragma omp parallel num_threads(threads) if (threads > 1)
  for (int64_t m0 = 0; m0 < rows; m0 += block) {
    const int64_t count = std::min(block, rows - m0);
#pragma omp for schedule(static)
    for (int64_t p = 0; p < panels_of(n); ++p) {
      const int cols = int(std::min(kPanel, n - p * kPanel));
      panel_rows(y + m0 * n + p * kPanel, x + m0 * k, packed + p * k * kPanel,
                 bias ? bias + p * kPanel : nullptr, count, n, k, cols);
    }
  }
}

#endif  // PANELS_AVX512_BF16

}  // namespace

extern "C" {

// 1 where this build multiplies panels (AVX512-BF16 without AMX), else 0.
int panel_isa() {
#if defined(PANELS_AVX512_BF16)
  return 1;
#else
  return 0;
#endif
}

// packed: panels_of(n) * 32 * k bfloat16 (k even).
int panel_pack(void* packed, const void* w, int64_t n, int64_t k, int threads) {
  if (!panel_isa()) return 20;
  if (k % 2) return 21;
  pack(static_cast<uint16_t*>(packed), static_cast<const uint16_t*>(w), n, k, threads);
  return 0;
}

// y [rows, n] = x [rows, k] W^T + bias, all bfloat16, W as `panel_pack` packed it; bias may
// be null.
int panel_linear(void* y, const void* x, const void* packed, const void* bias, int64_t rows,
                 int64_t n, int64_t k, int threads) {
  if (k % 2) return 21;
#if defined(PANELS_AVX512_BF16)
  linear(static_cast<uint16_t*>(y), static_cast<const uint16_t*>(x),
         static_cast<const uint16_t*>(packed), static_cast<const uint16_t*>(bias), rows, n, k,
         threads);
  return 0;
#else
  (void)y, (void)x, (void)packed, (void)bias, (void)rows, (void)n, (void)threads;
  return 20;
#endif
}

}  // extern "C"

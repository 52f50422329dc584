// y = x W^T + b with W kept in GGUF's blocks, as llama.cpp keeps it: Q8_0, Q4_0 and Q4_1, 32
// weights a block with a float16 scale d (and for Q4_1 a float16 minimum m). x [M, K] float32,
// W [N, K / 32] blocks (the file's bytes, a row of blocks per output), y [M, N] float32.
//
// As llama.cpp does, each row of x is first quantized to 8 bits per block of 32 (a float32
// scale each), so a block of a dot product is 32 int8 products summed exactly in int32
// (vpmaddubsw + vpmaddwd on AVX2, vpdpbusd with AVX-512 VNNI: 32 or 64 products an
// instruction, where float32 FMAs do 8 or 16) and scaled once, by d_w * d_x. The weights
// stream once per call, as in cpu_linear.cpp: a tile of kTileN weight rows against every row
// of x, kTileM rows at a time, the tiles spread over OpenMP threads.
//
// A block's value is d * q (Q8_0: q int8; Q4_0: q = nibble - 8) or d * q + m (Q4_1: q the
// nibble). The products want one unsigned operand: the 4-bit nibbles (0..15) are, and
// their offset is folded into a per-block term: Q4_0 is d * nibble + (-8 d), so both 4-bit
// types add min * d_x * sum(x_q) per block, with that sum taken once per row of x. Q8_0
// weights are signed: their magnitudes multiply x with the weights' signs moved onto it
// (llama.cpp's trick; |w| <= 128 and |x_q| <= 127 keep vpmaddubsw's int16 pairs from
// saturating).
//
// Vectors hold kLanes int32 lanes, each the sum of 4 products: a block fills 8 lanes, so
// AVX2 takes one block a step and AVX-512 two (the second zero past the end of a row with an
// odd number of blocks). The per-block scales are spread over their block's lanes, and the
// lanes are summed only once, at the end of the row.

#include "cpu_blocks.h"

#pragma GCC optimize("fp-contract=fast")  // acc += a * b as one FMA (ISO C++ mode forbids it)

namespace {

constexpr int kPerStep = kLanes / 8;  // blocks per vector
// weight rows per tile, and rows of x: kTileM * kTileN accumulators, and a step of kTileN
// weight rows in registers (AVX2 has 16 of them: with 4 rows they spilled, 25-40% slower)
constexpr int kTileN = kLanes == 16 ? 4 : 2;
constexpr int kTileM = 2;

// -- the primitives: loads, int8 products, signs ------------------------------------------

#if defined(QUANT_AVX512) || defined(QUANT_AVX2)
inline __m256i nibbles256(const uint8_t* qs) {  // one Q4 block's 32 weights, 0..15
  const __m128i q = _mm_loadu_si128(reinterpret_cast<const __m128i*>(qs));
  return _mm256_and_si256(_mm256_set_m128i(_mm_srli_epi16(q, 4), q), _mm256_set1_epi8(15));
}
#endif

// The nibbles of a step's blocks (`second`: null past the end of the row).
inline vu8 load_nibbles(const uint8_t* first, const uint8_t* second) {
#if defined(QUANT_AVX512)
  const __m256i high = second ? nibbles256(second) : _mm256_setzero_si256();
  return vu8(_mm512_inserti64x4(_mm512_castsi256_si512(nibbles256(first)), high, 1));
#elif defined(QUANT_AVX2)
  (void)second;
  return vu8(nibbles256(first));
#else
  uint8_t bytes[kBytes] = {};
  for (int b = 0; b < kPerStep && (b == 0 || second); ++b)
    for (int j = 0; j < kBlock / 2; ++j) {
      const uint8_t q = (b ? second : first)[j];
      bytes[b * kBlock + j] = q & 15;
      bytes[b * kBlock + j + kBlock / 2] = q >> 4;
    }
  vu8 v;
  std::memcpy(&v, bytes, sizeof v);
  return v;
#endif
}

inline vi8 load_bytes(const int8_t* first, const int8_t* second) {
#if defined(QUANT_AVX512)
  const __m256i low = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(first));
  const __m256i high = second ? _mm256_loadu_si256(reinterpret_cast<const __m256i*>(second))
                              : _mm256_setzero_si256();
  return vi8(_mm512_inserti64x4(_mm512_castsi256_si512(low), high, 1));
#else
  vi8 v = {};
  std::memcpy(&v, first, kBlock);
  if (kPerStep > 1 && second) std::memcpy(reinterpret_cast<int8_t*>(&v) + kBlock, second, kBlock);
  return v;
#endif
}

inline vu8 magnitudes(vi8 w) {
#if defined(QUANT_AVX512)
  return vu8(_mm512_abs_epi8(__m512i(w)));
#elif defined(QUANT_AVX2)
  return vu8(_mm256_abs_epi8(__m256i(w)));
#else
  const vu8 bits = vu8(w);
  return w < 0 ? vu8{} - bits : bits;  // -128 is 128, unsigned
#endif
}

// x with the signs of w: x where w > 0, -x where w < 0 (where w is 0 the product is 0 anyway).
inline vi8 with_signs(vi8 x, vi8 w) {
#if defined(QUANT_AVX512)
  const __mmask64 negative = _mm512_movepi8_mask(__m512i(w));
  return vi8(_mm512_mask_sub_epi8(__m512i(x), negative, _mm512_setzero_si512(), __m512i(x)));
#elif defined(QUANT_AVX2)
  return vi8(_mm256_sign_epi8(__m256i(x), __m256i(w)));
#else
  return w < 0 ? -x : x;
#endif
}

// Per-block values spread over their block's 8 lanes.
inline vfloat per_block(const float* values) {
  vfloat v = vfloat{} + values[0];
  for (int b = 1; b < kPerStep; ++b) {
    vi32 upper = {};  // the lanes of block b
    for (int i = 8 * b; i < 8 * b + 8; ++i) upper[i] = -1;
    v = upper ? vfloat{} + values[b] : v;
  }
  return v;
}

inline uint32_t load32(const uint8_t* p) {
  uint32_t v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

// A step's float16 scales d (and, `Min`, the minimums m stored after them) as float32 lanes,
// each block's over its 8 lanes; `second` null: a zero second block (past the end of a row).
template <bool Min>
inline void load_scales(const uint8_t* first, const uint8_t* second, vfloat& d, vfloat& m) {
#if defined(QUANT_AVX512)
  // [d0, m0, d1, m1] (or [d0, d1]) in one conversion, then each spread over its lanes
  const uint32_t low = Min ? load32(first) : load32(first) & 0xffffu;
  const uint32_t high = second ? (Min ? load32(second) : load32(second) & 0xffffu) : 0u;
  const __m128i halves =
      Min ? _mm_insert_epi32(_mm_cvtsi32_si128(int(low)), int(high), 1)
          : _mm_cvtsi32_si128(int(low | high << 16));
  const __m512 four = _mm512_castps128_ps512(_mm_cvtph_ps(halves));
  const __m512i d_lanes = Min ? _mm512_set_epi32(2, 2, 2, 2, 2, 2, 2, 2, 0, 0, 0, 0, 0, 0, 0, 0)
                              : _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  d = vfloat(_mm512_permutexvar_ps(d_lanes, four));
  if (Min) {
    const __m512i m_lanes = _mm512_set_epi32(3, 3, 3, 3, 3, 3, 3, 3, 1, 1, 1, 1, 1, 1, 1, 1);
    m = vfloat(_mm512_permutexvar_ps(m_lanes, four));
  }
#else
  float ds[kPerStep] = {}, ms[kPerStep] = {};
  for (int b = 0; b < kPerStep && (b == 0 || second); ++b) {
    const uint32_t bits = load32(b ? second : first);
    ds[b] = half_to_float(uint16_t(bits));
    if (Min) ms[b] = half_to_float(uint16_t(bits >> 16));
  }
  d = per_block(ds);
  if (Min) m = per_block(ms);
#endif
}

// -- x, quantized -----------------------------------------------------------------------------

// Rows of x quantized to int8 per block of 32, a step's worth of blocks per vector (a row's
// last step padded with zeros): the values, each block's scale d_x spread over its lanes, and
// d_x * (the sum of 4 values) per lane, which the 4-bit types' minimums multiply.
struct QuantizedRows {
  vi8* q;
  vfloat* d;
  vfloat* sums;
  int64_t steps;  // per row
};

void quantize_row(const float* x, int64_t blocks, const QuantizedRows& rows, int64_t r) {
  int8_t* q = reinterpret_cast<int8_t*>(rows.q + r * rows.steps);
  float scales[2 * kPerStep] = {};
  for (int64_t s = 0; s < rows.steps; ++s) {
    for (int b = 0; b < kPerStep; ++b) {
      const int64_t block = s * kPerStep + b;
      int8_t* out = q + block * kBlock;
      scales[b] = 0.f;
      if (block >= blocks) {
        std::memset(out, 0, kBlock);
        continue;
      }
      scales[b] = quantize_block(x + block * kBlock, out);
    }
    const vfloat d = per_block(scales);
    rows.d[r * rows.steps + s] = d;
    const vi32 sums = dot4(vu8{} + 1, rows.q[r * rows.steps + s]);
    rows.sums[r * rows.steps + s] = __builtin_convertvector(sums, vfloat) * d;
  }
}

// -- the weights, a step at a time --------------------------------------------------------

// One step's blocks of one weight row, ready to multiply.
struct Step {
  vu8 w;        // the unsigned operand: Q4 nibbles, or Q8_0 magnitudes
  vi8 signs;    // Q8_0: the weights, whose signs go onto x
  vfloat d;     // each block's scale
  vfloat min;   // Q4_1: m; Q4_0: -8 d
};

// The step of blocks from `s` of one weight row; `Tail`: its one block, the row's last.
template <int T, bool Tail>
inline Step load_step(const uint8_t* row, int64_t s) {
  using Block = typename Layout<T>::Block;
  const Block* first = reinterpret_cast<const Block*>(row) + s * kPerStep;
  const Block* second = Tail || kPerStep == 1 ? nullptr : first + 1;
  const auto* first_bytes = reinterpret_cast<const uint8_t*>(first);
  const auto* second_bytes = reinterpret_cast<const uint8_t*>(second);
  Step step;
  load_scales<T == kQ4_1>(first_bytes, second_bytes, step.d, step.min);
  if constexpr (T == kQ4_0) step.min = step.d * -8.f;
  if constexpr (T == kQ8_0) {
    step.signs = load_bytes(first->qs, second ? second->qs : nullptr);
    step.w = magnitudes(step.signs);
  } else {
    step.w = load_nibbles(first->qs, second ? second->qs : nullptr);
  }
  return step;
}

// acc[m][n] += the products of step s of TM rows of x (from row m0) and TN weight rows.
template <int T, int TM, int TN, bool Tail>
inline void accumulate(vfloat (&acc)[TM][TN], const QuantizedRows& x, int64_t m0,
                       const uint8_t* w, int64_t row_bytes, int64_t s) {
  Step ws[TN];
  for (int n = 0; n < TN; ++n) ws[n] = load_step<T, Tail>(w + n * row_bytes, s);
  for (int m = 0; m < TM; ++m) {
    const int64_t at = (m0 + m) * x.steps + s;
    const vi8 xq = x.q[at];
    const vfloat xd = x.d[at];
    for (int n = 0; n < TN; ++n) {
      const vi32 dot =
          T == kQ8_0 ? dot4(ws[n].w, with_signs(xq, ws[n].signs)) : dot4(ws[n].w, xq);
      acc[m][n] += __builtin_convertvector(dot, vfloat) * (ws[n].d * xd);
      if constexpr (T != kQ8_0) acc[m][n] += ws[n].min * x.sums[at];
    }
  }
}

// out[m, n] for TM rows of x (from row m0) and TN weight rows (`row_bytes` apart).
template <int T, int TM, int TN>
void tile(float* out, int64_t out_stride, const QuantizedRows& x, int64_t m0,
          const uint8_t* w, int64_t row_bytes, int64_t blocks) {
  static_assert(TM * TN <= 8, "one vector of sums");
  vfloat acc[TM][TN] = {};
  const int64_t full = blocks / kPerStep;  // steps whose every block is in the row
  for (int64_t s = 0; s < full; ++s) accumulate<T, TM, TN, false>(acc, x, m0, w, row_bytes, s);
  if (full < x.steps) accumulate<T, TM, TN, true>(acc, x, m0, w, row_bytes, full);
  vfloat8 folded[8] = {};
  for (int m = 0; m < TM; ++m)
    for (int n = 0; n < TN; ++n) folded[m * TN + n] = fold8(acc[m][n]);
  const vfloat8 sums = sum_each(folded);
  for (int m = 0; m < TM; ++m)
    for (int n = 0; n < TN; ++n) out[m * out_stride + n] = sums[m * TN + n];
}

// Weight rows [n0, n0 + TN) against every row of x.
template <int T, int TN>
void weight_tile(float* y, int64_t n, const QuantizedRows& x, int64_t rows, const uint8_t* w,
                 int64_t row_bytes, int64_t blocks, int64_t n0) {
  // the next tile on its way from memory while this one computes (cpu_linear.cpp: without
  // it a step waited for each tile's weights, then computed, never both at once)
  const uint8_t* next = w + (n0 + TN) * row_bytes;
  const uint8_t* end = w + n * row_bytes;
  for (int64_t b = 0; b < TN * row_bytes && next + b < end; b += 64)
    __builtin_prefetch(next + b, 0, 1);
  const uint8_t* tile_rows = w + n0 * row_bytes;
  int64_t m = 0;
  for (; m + kTileM <= rows; m += kTileM)
    tile<T, kTileM, TN>(y + m * n + n0, n, x, m, tile_rows, row_bytes, blocks);
  for (; m < rows; ++m) tile<T, 1, TN>(y + m * n + n0, n, x, m, tile_rows, row_bytes, blocks);
}

template <int T>
void quant_linear(float* y, const float* x, const uint8_t* w, const float* bias, int64_t rows,
                  int64_t n, int64_t k, void* scratch, int threads) {
  using Block = typename Layout<T>::Block;
  const int64_t blocks = k / kBlock, row_bytes = blocks * int64_t(sizeof(Block));
  const int64_t steps = (blocks + kPerStep - 1) / kPerStep;
  QuantizedRows xq{static_cast<vi8*>(scratch), nullptr, nullptr, steps};
  xq.d = reinterpret_cast<vfloat*>(xq.q + rows * steps);
  xq.sums = xq.d + rows * steps;
  // a decode step's few rows (the layer takes larger batches to BLAS: int8 products with a
  // float scaling per block lose to float32 FMAs at full rate): all of them against each tile
  const int64_t tiles = n / kTileN;
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) quantize_row(x + r * k, blocks, xq, r);
#pragma omp for schedule(static)
    for (int64_t t = 0; t < tiles; ++t)
      weight_tile<T, kTileN>(y, n, xq, rows, w, row_bytes, blocks, t * kTileN);
  }
  for (int64_t n0 = tiles * kTileN; n0 < n; ++n0)
    weight_tile<T, 1>(y, n, xq, rows, w, row_bytes, blocks, n0);
  if (bias)
    for (int64_t m = 0; m < rows; ++m)
      for (int64_t j = 0; j < n; ++j) y[m * n + j] += bias[j];
}

// Elements below which a dequantize stays on the calling thread: a decode step's embeddings
// (a few rows) take a microsecond, and a region would wait for a second thread that the
// server's other processes may hold just then, at the start of every step.
constexpr int64_t kDequantizeSplit = 1 << 16;

// The float32 rows [n, k] the blocks stand for, into `out`.
template <int T>
void dequantize_rows(float* out, const uint8_t* w, int64_t n, int64_t k, int threads) {
  using Block = typename Layout<T>::Block;
  const int64_t blocks = k / kBlock;
#pragma omp parallel for num_threads(threads) if (threads > 1 && n * k >= kDequantizeSplit) \
    schedule(static)
  for (int64_t r = 0; r < n; ++r)
    for (int64_t i = 0; i < blocks; ++i) {
      const Block& b = reinterpret_cast<const Block*>(w)[r * blocks + i];
      float* o = out + r * k + i * kBlock;
      const float d = half_to_float(b.d);
      if constexpr (T == kQ8_0) {
        for (int j = 0; j < kBlock; ++j) o[j] = d * float(b.qs[j]);
      } else {
        float m = -8.f * d;
        if constexpr (T == kQ4_1) m = half_to_float(b.m);
        for (int j = 0; j < kBlock / 2; ++j) o[j] = d * float(b.qs[j] & 15) + m;
        for (int j = 0; j < kBlock / 2; ++j) o[j + kBlock / 2] = d * float(b.qs[j] >> 4) + m;
      }
    }
}

}  // namespace

extern "C" {

// qtype: 0 Q8_0, 1 Q4_0, 2 Q4_1. x [rows, k] float32 with k a multiple of 32; w: n rows of
// k / 32 blocks; y [rows, n] float32; bias [n] float32 or null; scratch (x quantized: its
// values and two float vectors per step of blocks, the same size for both widths, rounded up
// to whole AVX-512 steps): rows * ceil(k / 64) * 192 bytes, 64-byte aligned.
int quant_linear(int qtype, float* y, const float* x, const uint8_t* w, const float* bias,
                 int64_t rows, int64_t n, int64_t k, void* scratch, int threads) {
  if (k % kBlock) return 10;
  if (qtype == kQ8_0)
    quant_linear<kQ8_0>(y, x, w, bias, rows, n, k, scratch, threads);
  else if (qtype == kQ4_0)
    quant_linear<kQ4_0>(y, x, w, bias, rows, n, k, scratch, threads);
  else if (qtype == kQ4_1)
    quant_linear<kQ4_1>(y, x, w, bias, rows, n, k, scratch, threads);
  else
    return 11;
  return 0;
}

// The float32 matrix [n, k] of n rows of blocks of type qtype, into out.
int quant_dequantize(int qtype, float* out, const uint8_t* w, int64_t n, int64_t k,
                     int threads) {
  if (k % kBlock) return 10;
  if (qtype == kQ8_0)
    dequantize_rows<kQ8_0>(out, w, n, k, threads);
  else if (qtype == kQ4_0)
    dequantize_rows<kQ4_0>(out, w, n, k, threads);
  else if (qtype == kQ4_1)
    dequantize_rows<kQ4_1>(out, w, n, k, threads);
  else
    return 11;
  return 0;
}

}  // extern "C"

extern "C" {

// Which products this build computes with: 3 AVX-512 VNNI, 2 AVX-512, 1 AVX2, 0 plain loops.
int quant_isa() {
#if defined(QUANT_AVX512) && defined(__AVX512VNNI__)
  return 3;
#elif defined(QUANT_AVX512)
  return 2;
#elif defined(QUANT_AVX2)
  return 1;
#else
  return 0;
#endif
}

}  // extern "C"

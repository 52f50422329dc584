// y = x W^T + b for a decode step's few rows, W GGUF's blocks repacked once (quant_repack) so
// that a vector's lanes are weight rows, as llama.cpp's interleaved CPU types (Q4_0x8) are.
//
// In the file's layout (cpu_quant.cpp) a block's products land in 8 lanes that are scaled
// apart and summed across at the end: each block of each row costs a float16 conversion, a
// spread of it over the lanes and the float work for 8 lanes, which held Q4_1 to 10-14 GB/s of
// blocks a core. Here lane r is weight row r throughout: a block of kRows rows is 4 vectors of
// 4 bytes a row (8 for Q8_0), each multiplied by the 4 matching bytes of x broadcast to every
// lane, and its kRows scales are one vector of float16: no spreading, no folding, one
// conversion and two FMAs a block for kRows rows. SmolLM2's 120 layer matrices in Q4_1, from
// memory, 2 threads of an AMD EPYC (AVX-512 VNNI), ms from Python: 1 row 4.9 -> 2.65 (25 GB/s
// of blocks; 40 GB/s a core from L2), 8 rows 14.3 -> 5.1, 32 rows 49.8 -> 15.7; the Q8_0 LM
// head (49152 x 576) in a decode step of one row 1.04 -> 0.91 (near the copy rate).
//
// A group of kRows weight rows keeps its blocks in order, each [values | d | m]:
//   Q4_0, Q4_1: 4 vectors; vector v, lane r: bytes 4v..4v+3 of row r's block as the file has
//     them, whose low nibbles are weights 4v..4v+3 and high ones weights 16+4v..16+4v+3
//   Q8_0: 8 vectors; vector v, lane r: weights 4v..4v+3 of row r plus 128, unsigned
//   d: kRows float16 (row r's at r); m (Q4_1 only): kRows float16
// the file's bytes in another order, no more of them. A weight is d * u + min for u its
// unsigned nibble or byte and min m (Q4_1), -8d (Q4_0) or -128d (Q8_0), so as in
// cpu_quant.cpp the block's sum is d * d_x * sum(u x_q) + min * d_x * sum(x_q).

#include <vector>

#include "cpu_blocks.h"

#pragma GCC optimize("fp-contract=fast")  // acc += a * b as one FMA (ISO C++ mode forbids it)

namespace {

constexpr int kRows = kLanes;  // weight rows a group: one a lane
// rows of x a pass over a group's blocks (the group stays in L1 for the next pass): their
// int32 sums (two chains each, so a row's 8 products a block are not one serial chain) and
// float32 sums in registers
constexpr int kTileM = kLanes == 16 ? 4 : 2;  // 2, 6 or 8 with AVX-512: no faster

// The block types repacked: Q4_0 and Q4_1 everywhere; Q8_0 (its bytes made unsigned, up to 255)
// where dot4's products of those are exact: with VNNI, or in the plain loops.
#if defined(QUANT_EXACT_BYTES)
constexpr int kFormats = 1 << kQ8_0 | 1 << kQ4_0 | 1 << kQ4_1;
#else
constexpr int kFormats = 1 << kQ4_0 | 1 << kQ4_1;
#endif

template <int T>
struct Repacked {
  static constexpr int kVectors = T == kQ8_0 ? 8 : 4;  // of values, a block
  static constexpr int kValueBytes = kVectors * kBytes;
  static constexpr bool kMin = T == kQ4_1;  // m stored after d
  static constexpr int kBlockBytes = kValueBytes + (kMin ? 4 : 2) * kRows;
  static_assert(kBlockBytes == kRows * int(sizeof(typename Layout<T>::Block)));
};

// Rows of x quantized as cpu_quant.cpp does: int8 values [rows, k], and for each block of a
// row its scale d_x and d_x * the sum of its values, [rows, blocks] each.
struct QuantizedX {
  int8_t* q;
  float *d, *sums;
  int64_t k, blocks;
};

void quantize_row(const float* x, const QuantizedX& xq, int64_t r) {
  for (int64_t b = 0; b < xq.blocks; ++b) {
    int8_t* q = xq.q + r * xq.k + b * kBlock;
    const float d = quantize_block(x + r * xq.k + b * kBlock, q);
    int32_t sum = 0;
    for (int j = 0; j < kBlock; ++j) sum += q[j];
    xq.d[r * xq.blocks + b] = d;
    xq.sums[r * xq.blocks + b] = d * float(sum);
  }
}

inline vu8 load_bytes(const uint8_t* p) {
  vu8 v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline vi8 broadcast4(const int8_t* p) {  // 4 bytes of x in every lane
  int32_t word;
  std::memcpy(&word, p, sizeof word);
  return vi8(vi32{} + word);
}

inline vfloat load_halves(const uint8_t* p) {  // kRows float16 as float32
#if defined(QUANT_AVX512)
  return vfloat(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(QUANT_AVX2) && defined(__F16C__)
  return vfloat(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  vfloat v;
  for (int i = 0; i < kLanes; ++i) {
    uint16_t h;
    std::memcpy(&h, p + 2 * i, sizeof h);
    v[i] = half_to_float(h);
  }
  return v;
#endif
}

// y[m0 + m, n0 .. n0 + kRows) for TM rows of x, from one group's blocks.
template <int T, int TM>
void group_tile(float* y, int64_t n, const QuantizedX& x, int64_t m0, const uint8_t* group,
                int64_t n0, const float* bias) {
  using R = Repacked<T>;
  vfloat acc[TM] = {};
  for (int64_t b = 0; b < x.blocks; ++b) {
    const uint8_t* block = group + b * R::kBlockBytes;
    vi32 dots[TM][2] = {};
    for (int v = 0; v < 4; ++v) {  // weights 4v.. and 16 + 4v.. of each row
      vu8 low = load_bytes(block + v * kBytes), high;
      if constexpr (T == kQ8_0) {
        high = load_bytes(block + (v + 4) * kBytes);
      } else {
        high = low >> 4;
        low &= 15;
      }
      for (int m = 0; m < TM; ++m) {
        const int8_t* xq = x.q + (m0 + m) * x.k + b * kBlock + 4 * v;
        dots[m][0] = dot4_add(dots[m][0], low, broadcast4(xq));
        dots[m][1] = dot4_add(dots[m][1], high, broadcast4(xq + kBlock / 2));
      }
    }
    const vfloat d = load_halves(block + R::kValueBytes);
    vfloat min;
    if constexpr (R::kMin)
      min = load_halves(block + R::kValueBytes + 2 * kRows);
    else
      min = d * (T == kQ4_0 ? -8.f : -128.f);
    for (int m = 0; m < TM; ++m) {
      const int64_t at = (m0 + m) * x.blocks + b;
      const vfloat dot = __builtin_convertvector(dots[m][0] + dots[m][1], vfloat);
      acc[m] += dot * (d * x.d[at]);
      acc[m] += min * x.sums[at];
    }
  }
  for (int m = 0; m < TM; ++m) {
    if (bias) acc[m] += load_lanes(bias + n0);
    std::memcpy(y + (m0 + m) * n + n0, &acc[m], sizeof acc[m]);
  }
}

// x's rows quantized in `bytes` (rows * (k + k / 4)): values, then scales, then sums
QuantizedX quantized_x(void* bytes, int64_t rows, int64_t k) {
  QuantizedX xq{static_cast<int8_t*>(bytes), nullptr, nullptr, k, k / kBlock};
  xq.d = reinterpret_cast<float*>(xq.q + rows * k);
  xq.sums = xq.d + rows * xq.blocks;
  return xq;
}

template <int T>
void groups_of(float* y, const QuantizedX& xq, const uint8_t* w, const float* bias,
               int64_t rows, int64_t n, int64_t g) {
  const uint8_t* group = w + g * xq.blocks * Repacked<T>::kBlockBytes;
  int64_t m = 0;
  for (; m + kTileM <= rows; m += kTileM)
    group_tile<T, kTileM>(y, n, xq, m, group, g * kRows, bias);
  for (; m < rows; ++m) group_tile<T, 1>(y, n, xq, m, group, g * kRows, bias);
}

// A decode step's few rows: every thread quantizes them for itself (under a microsecond)
// where one would quantize them for all behind a barrier: a barrier less in each of a step's
// ~120 products, one that waits on whichever thread the server's other processes preempted.
constexpr int64_t kOwnRows = kTileM;

// x's rows quantized by the calling thread, in its own buffer
QuantizedX own_quantized(const float* x, int64_t rows, int64_t k) {
  thread_local std::vector<int8_t> own;
  own.resize(size_t(rows * (k + k / 4)));
  const QuantizedX xq = quantized_x(own.data(), rows, k);
  for (int64_t r = 0; r < rows; ++r) quantize_row(x, xq, r);
  return xq;
}

template <int T>
void repacked_linear(float* y, const float* x, const uint8_t* w, const float* bias,
                     int64_t rows, int64_t n, int64_t k, void* scratch, int threads) {
  const int64_t groups = n / kRows;
  if (rows <= kOwnRows) {
#pragma omp parallel num_threads(threads) if (threads > 1)
    {
      const QuantizedX xq = own_quantized(x, rows, k);
#pragma omp for schedule(static) nowait
      for (int64_t g = 0; g < groups; ++g) groups_of<T>(y, xq, w, bias, rows, n, g);
    }
    return;
  }
  const QuantizedX xq = quantized_x(scratch, rows, k);
#pragma omp parallel num_threads(threads) if (threads > 1)
  {
#pragma omp for schedule(static)
    for (int64_t r = 0; r < rows; ++r) quantize_row(x, xq, r);
#pragma omp for schedule(static) nowait
    for (int64_t g = 0; g < groups; ++g) groups_of<T>(y, xq, w, bias, rows, n, g);
  }
}

// The file's blocks [n, blocks] into groups of kRows rows, laid out as above.
template <int T>
void repack(uint8_t* out, const uint8_t* w, int64_t n, int64_t blocks, int threads) {
  using Block = typename Layout<T>::Block;
  using R = Repacked<T>;
#pragma omp parallel for num_threads(threads) if (threads > 1) schedule(static)
  for (int64_t g = 0; g < n / kRows; ++g)
    for (int64_t b = 0; b < blocks; ++b) {
      uint8_t* o = out + (g * blocks + b) * R::kBlockBytes;
      for (int r = 0; r < kRows; ++r) {
        const Block& src = reinterpret_cast<const Block*>(w)[(g * kRows + r) * blocks + b];
        for (int v = 0; v < R::kVectors; ++v)
          for (int j = 0; j < 4; ++j) {
            const int i = 4 * v + j;
            o[v * kBytes + 4 * r + j] = T == kQ8_0 ? uint8_t(src.qs[i] + 128) : src.qs[i];
          }
        std::memcpy(o + R::kValueBytes + 2 * r, &src.d, 2);
        if constexpr (R::kMin) std::memcpy(o + R::kValueBytes + 2 * kRows + 2 * r, &src.m, 2);
      }
    }
}

// 0, or why (qtype, k, n) cannot be repacked: codes as quant_linear's, 12 n not whole groups.
int refuse(int qtype, int64_t n, int64_t k) {
  if (k % kBlock) return 10;
  if (qtype < 0 || qtype > kQ4_1 || !(kFormats >> qtype & 1)) return 11;
  return n % kRows ? 12 : 0;
}

}  // namespace

extern "C" {

// The block types this build repacks, a bit (1 << qtype) each.
int repacked_formats() { return kFormats; }

// Weight rows a group interleaves: n must be a multiple of it.
int repacked_rows() { return kRows; }

// w: n rows of k / 32 blocks of type qtype (0 Q8_0, 1 Q4_0, 2 Q4_1); out: as many bytes.
int quant_repack(int qtype, uint8_t* out, const uint8_t* w, int64_t n, int64_t k,
                 int threads) {
  if (const int code = refuse(qtype, n, k)) return code;
  if (qtype == kQ8_0) repack<kQ8_0>(out, w, n, k / kBlock, threads);
  if (qtype == kQ4_0) repack<kQ4_0>(out, w, n, k / kBlock, threads);
  if (qtype == kQ4_1) repack<kQ4_1>(out, w, n, k / kBlock, threads);
  return 0;
}

// As quant_linear, with w repacked by quant_repack; scratch: rows * (k + k / 4) bytes.
int repacked_linear(int qtype, float* y, const float* x, const uint8_t* w, const float* bias,
                    int64_t rows, int64_t n, int64_t k, void* scratch, int threads) {
  if (const int code = refuse(qtype, n, k)) return code;
  if (qtype == kQ8_0) repacked_linear<kQ8_0>(y, x, w, bias, rows, n, k, scratch, threads);
  if (qtype == kQ4_0) repacked_linear<kQ4_0>(y, x, w, bias, rows, n, k, scratch, threads);
  if (qtype == kQ4_1) repacked_linear<kQ4_1>(y, x, w, bias, rows, n, k, scratch, threads);
  return 0;
}

// The groups [first, end) of repacked_linear's y (kRows columns each) on the calling thread
// alone: how cpu_team.h's two threads share a product.
int repacked_groups(int qtype, float* y, const float* x, const uint8_t* w, const float* bias,
                    int64_t rows, int64_t n, int64_t k, int64_t first, int64_t end) {
  if (const int code = refuse(qtype, n, k)) return code;
  if (first < 0 || end > n / kRows) return 13;
  if (first >= end) return 0;
  const QuantizedX xq = own_quantized(x, rows, k);
  for (int64_t g = first; g < end; ++g) {
    if (qtype == kQ8_0) groups_of<kQ8_0>(y, xq, w, bias, rows, n, g);
    if (qtype == kQ4_0) groups_of<kQ4_0>(y, xq, w, bias, rows, n, g);
    if (qtype == kQ4_1) groups_of<kQ4_1>(y, xq, w, bias, rows, n, g);
  }
  return 0;
}

}  // extern "C"

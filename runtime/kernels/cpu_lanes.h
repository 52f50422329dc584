// The vector width of the streaming matmuls (cpu_linear.cpp, cpu_quant.cpp) and the sums
// they end with. GCC vector extensions: one source for AVX2 (8 floats a vector) and AVX-512
// (16); tests build the other width on any CPU with -DRUNTIME_LINEAR_LANES=8 or 16, which gcc
// splits into the vectors the CPU has.

#pragma once

#if defined(RUNTIME_LINEAR_LANES)
#define RUNTIME_LANES RUNTIME_LINEAR_LANES
#elif defined(__AVX512F__)
#define RUNTIME_LANES 16
#else
#define RUNTIME_LANES 8
#endif

namespace {

constexpr int kLanes = RUNTIME_LANES;
typedef float vfloat __attribute__((vector_size(kLanes * 4)));
typedef float vfloat8 __attribute__((vector_size(32)));

// An empty asm that takes v in a vector register: gcc cannot fold its load into an FMA.
template <typename V>
inline void keep_in_register(V& v) {
#if defined(__AVX512F__)
  asm("" : "+v"(v));
#elif defined(__AVX__)
  if constexpr (sizeof v == 32) asm("" : "+x"(v));
#endif
  (void)v;
}

inline vfloat load_lanes(const float* p) {
  vfloat v;
  __builtin_memcpy(&v, p, sizeof v);
  return v;
}

inline vfloat8 fold8(vfloat v) {  // lanes i and i + 8 added: the 8-lane sums are the same
  if constexpr (kLanes == 16)
    return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7) +
           __builtin_shufflevector(v, v, 8, 9, 10, 11, 12, 13, 14, 15);
  else
    return __builtin_shufflevector(v, v, 0, 1, 2, 3, 4, 5, 6, 7);
}

// Lane i: the sum of the lanes of v[i]. A transposing tree of 7 additions, where summing each
// vector on its own costs 8 shuffle-and-add chains: with K = 256 those ate half the time.
inline vfloat8 sum_each(const vfloat8 v[8]) {
  vfloat8 pairs[4], quads[2];
  for (int i = 0; i < 4; ++i)  // [a01, b01, a23, b23, a45, b45, a67, b67] of a, b = v[2i], v[2i+1]
    pairs[i] = __builtin_shufflevector(v[2 * i], v[2 * i + 1], 0, 8, 2, 10, 4, 12, 6, 14) +
               __builtin_shufflevector(v[2 * i], v[2 * i + 1], 1, 9, 3, 11, 5, 13, 7, 15);
  for (int i = 0; i < 2; ++i)  // [a0-3, b0-3, c0-3, d0-3, a4-7, b4-7, c4-7, d4-7]
    quads[i] = __builtin_shufflevector(pairs[2 * i], pairs[2 * i + 1], 0, 1, 8, 9, 4, 5, 12, 13) +
               __builtin_shufflevector(pairs[2 * i], pairs[2 * i + 1], 2, 3, 10, 11, 6, 7, 14, 15);
  return __builtin_shufflevector(quads[0], quads[1], 0, 1, 2, 3, 8, 9, 10, 11) +
         __builtin_shufflevector(quads[0], quads[1], 4, 5, 6, 7, 12, 13, 14, 15);
}

}  // namespace

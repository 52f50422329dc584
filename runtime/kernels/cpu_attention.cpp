// Paged attention on CPU, reading K/V blocks where they lie (no gather copy).
//
// The KV cache of one layer is [2, kv_heads, num_blocks, block_size, head_dim] (see
// runtime/layers/attention.py). Plain C ABI, loaded with ctypes: no torch headers, so it
// compiles in about a second. Element types: float32 and bfloat16 (as raw uint16 bits);
// scores and sums are float32, as torch's softmax(dtype=float32) path. With AVX-512 and a
// head_dim of 64 or 128 the inner loops are written with intrinsics (cpu_attention_tiles.h);
// elsewhere plain loops that -O3 vectorizes. OpenMP (torch's own libgomp, already loaded)
// splits the (sequence, kv head) pairs over threads.
//
// Every index that comes from the caller is checked: a bad slot or block id returns an
// error code instead of touching memory outside the cache.

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_attention_tiles.h"
#include "cpu_common.h"

namespace {

struct Decode {  // one call's arguments, as paged_decode received them
  void* out;
  const void* q;
  int64_t q_token_stride;
  const void* cache;
  const int64_t* tables;
  int64_t table_width;
  const int64_t* lens;
  int64_t batch, num_heads, kv_heads, num_blocks, block_size, dim;
  float scale;
  int threads;
};

// Scratch of one thread, sized for the longest sequence.
struct Scratch {
  std::vector<float> scores, qf, acc, tile;
  Scratch(int64_t group, int64_t longest, int64_t dim)
      : scores(group * longest), qf(group * dim), acc(group * dim), tile(kTile * dim) {}
};

// Blocks fetched ahead of the one being read, into L2. A block of one head lies anywhere in
// the cache and is short (16 tokens: 2 KB in bfloat16): the hardware prefetcher cannot run
// ahead across blocks, so this does. Measured on an AMD EPYC (Zen 4), decode attention of
// batch 32 over 192 tokens: no fetching 14.7 ms, one block ahead into L1 9.4, two ahead into
// L2 7.5 (four: 8-9; L1 at any distance slower than L2).
constexpr int64_t kBlocksAhead = 2;

inline void fetch_block(const void* block, int64_t bytes) {
  const char* p = static_cast<const char*>(block);
  for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(p + line, 0, 1);
}

// Calls f(rows, n, first) for each tile of the `len` cached tokens, in order: `rows` points
// at `n` consecutive token rows of one block, `first` is the first one's position.
template <typename T, typename F>
void for_each_tile(const T* plane, const int64_t* table, int64_t len, int64_t block_size,
                   int64_t dim, F f) {
  const int64_t block_bytes = block_size * dim * int64_t(sizeof(T));
  for (int64_t start = 0; start < len; start += block_size) {
    const T* block = plane + table[start / block_size] * block_size * dim;
    const int64_t ahead = start + kBlocksAhead * block_size;
    if (ahead < len) fetch_block(plane + table[ahead / block_size] * block_size * dim, block_bytes);
    const int64_t in_block = len - start < block_size ? len - start : block_size;
    for (int64_t off = 0; off < in_block; off += kTile) {
      const int n = int(in_block - off < kTile ? in_block - off : kTile);
      f(block + off * dim, n, start + off);
    }
  }
}

// One (sequence, kv head): its query heads against its cached tokens.
template <typename T, int kDim, bool kAvx512>
void attend_group(const Decode& a, int64_t b, int64_t h, Scratch& s) {
  const int64_t dim = kDim > 0 ? kDim : a.dim, group = a.num_heads / a.kv_heads;
  const int64_t len = a.lens[b], first_head = h * group;
  const int64_t plane = a.num_blocks * a.block_size * dim;  // one kv head's K (or V)
  const T* cache = static_cast<const T*>(a.cache);
  const T* q = static_cast<const T*>(a.q) + b * a.q_token_stride + first_head * dim;
  const int64_t* table = a.tables + b * a.table_width;
  float* scores = s.scores.data();
  for (int64_t i = 0; i < group * dim; ++i) s.qf[i] = to_float(q[i]) * a.scale;
  for_each_tile(cache + h * plane, table, len, a.block_size, dim,
                [&](const T* rows, int n, int64_t first) {
                  if constexpr (kAvx512)
                    qk_tile_avx512<T, kDim>(s.qf.data(), rows, n, group, scores + first, len,
                                            s.tile.data());
                  else
                    qk_tile<T, kDim>(s.qf.data(), rows, n, group, dim, scores + first, len,
                                     s.tile.data());
                });
  if constexpr (kAvx512)
    softmax_rows_avx512(scores, group, len);
  else
    softmax_rows(scores, group, len);
  std::fill(s.acc.begin(), s.acc.end(), 0.f);
  for_each_tile(cache + (a.kv_heads + h) * plane, table, len, a.block_size, dim,
                [&](const T* rows, int n, int64_t first) {
                  if constexpr (kAvx512)
                    pv_tile_avx512<T, kDim>(scores + first, rows, n, group, len, s.acc.data(),
                                            s.tile.data());
                  else
                    pv_tile<T, kDim>(scores + first, rows, n, group, dim, len, s.acc.data(),
                                     s.tile.data());
                });
  T* out = static_cast<T*>(a.out) + (b * a.num_heads + first_head) * dim;
  for (int64_t i = 0; i < group * dim; ++i) store(s.acc[i], out + i);
}

#if defined(__AVX512BF16__)
// attend_group for bfloat16, with the AVX512-BF16 tiles.
template <int kDim>
void attend_group_bf16(const Decode& a, int64_t b, int64_t h, Scratch& s) {
  const int64_t group = a.num_heads / a.kv_heads, len = a.lens[b], first_head = h * group;
  const int64_t plane = a.num_blocks * a.block_size * kDim;
  const auto* cache = static_cast<const uint16_t*>(a.cache);
  const auto* q = static_cast<const uint16_t*>(a.q) + b * a.q_token_stride + first_head * kDim;
  const int64_t* table = a.tables + b * a.table_width;
  float* scores = s.scores.data();
  for_each_tile(cache + h * plane, table, len, a.block_size, kDim,
                [&](const uint16_t* rows, int n, int64_t first) {
                  qk_tile_bf16<kDim>(q, a.scale, rows, n, group, scores + first, len);
                });
  softmax_rows_avx512(scores, group, len);
  std::fill(s.acc.begin(), s.acc.end(), 0.f);
  for_each_tile(cache + (a.kv_heads + h) * plane, table, len, a.block_size, kDim,
                [&](const uint16_t* rows, int n, int64_t first) {
                  pv_tile_bf16<kDim>(scores + first, rows, n, group, len, s.acc.data());
                });
  auto* out = static_cast<uint16_t*>(a.out) + (b * a.num_heads + first_head) * kDim;
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < kDim; ++d) store(s.acc[g * kDim + interleaved(d)], out + g * kDim + d);
}
#endif

// One (sequence, kv head), by the fastest variant this CPU has for T and head_dim.
template <typename T, int kDim, bool kAvx512>
void attend(const Decode& a, int64_t b, int64_t h, Scratch& s) {
#if defined(__AVX512BF16__)
  if constexpr (kAvx512 && sizeof(T) == 2) return attend_group_bf16<kDim>(a, b, h, s);
#endif
  attend_group<T, kDim, kAvx512>(a, b, h, s);
}

template <typename T, int kDim, bool kAvx512>
void decode(const Decode& a) {
  int64_t longest = 0;
  for (int64_t b = 0; b < a.batch; ++b) longest = a.lens[b] > longest ? a.lens[b] : longest;
  const int64_t group = a.num_heads / a.kv_heads;
#pragma omp parallel num_threads(a.threads)
  {
    Scratch scratch(group, longest, a.dim);
#pragma omp for schedule(dynamic, 1) collapse(2)
    for (int64_t b = 0; b < a.batch; ++b)
      for (int64_t h = 0; h < a.kv_heads; ++h) attend<T, kDim, kAvx512>(a, b, h, scratch);
  }
}

// Checks every index the kernel will follow, then picks the variant for head_dim.
template <typename T>
int decode_checked(const Decode& a) {
  if (a.kv_heads <= 0 || a.num_heads % a.kv_heads != 0 || a.block_size <= 0) return 1;
  for (int64_t b = 0; b < a.batch; ++b) {
    if (a.lens[b] <= 0 || a.lens[b] > a.table_width * a.block_size) return 2;
    const int64_t* table = a.tables + b * a.table_width;
    for (int64_t i = 0; i < (a.lens[b] + a.block_size - 1) / a.block_size; ++i)
      if (table[i] < 0 || table[i] >= a.num_blocks) return 3;
  }
#if defined(__AVX512F__)
  if (a.dim == 64) return decode<T, 64, true>(a), 0;
  if (a.dim == 128) return decode<T, 128, true>(a), 0;
#endif
  return decode<T, 0, false>(a), 0;
}

template <typename T>
int store_kv(void* cache, const void* kv, int64_t kv_token_stride, const int64_t* slots,
             int64_t tokens, int64_t kv_heads, int64_t num_slots, int64_t dim) {
  for (int64_t t = 0; t < tokens; ++t)
    if (slots[t] < 0 || slots[t] >= num_slots) return 4;
  auto* c = static_cast<T*>(cache);
  auto* src = static_cast<const T*>(kv);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t j = 0; j < 2 * kv_heads; ++j)  // K heads, then V heads
      std::memcpy(c + (j * num_slots + slots[t]) * dim, src + t * kv_token_stride + j * dim,
                  sizeof(T) * dim);
  return 0;
}

}  // namespace

extern "C" {

// dtype: 0 float32, 1 bfloat16. Returns 0, or a nonzero code for a bad argument.
int paged_decode(int dtype, void* out, const void* q, int64_t q_token_stride, const void* cache,
                 const int64_t* tables, int64_t table_width, const int64_t* lens, int64_t batch,
                 int64_t num_heads, int64_t kv_heads, int64_t num_blocks, int64_t block_size,
                 int64_t dim, float scale, int threads) {
  const Decode a{out,   q,         q_token_stride, cache,      tables,     table_width, lens,
                 batch, num_heads, kv_heads,       num_blocks, block_size, dim,         scale,
                 threads};
  if (dtype == 0) return decode_checked<float>(a);
  if (dtype == 1) return decode_checked<uint16_t>(a);
  return 5;
}

int paged_store_kv(int dtype, void* cache, const void* kv, int64_t kv_token_stride,
                   const int64_t* slots, int64_t tokens, int64_t kv_heads, int64_t num_slots,
                   int64_t dim) {
  if (dtype == 0)
    return store_kv<float>(cache, kv, kv_token_stride, slots, tokens, kv_heads, num_slots, dim);
  if (dtype == 1)
    return store_kv<uint16_t>(cache, kv, kv_token_stride, slots, tokens, kv_heads, num_slots,
                              dim);
  return 5;
}

}  // extern "C"

// Paged attention on CPU, reading K/V blocks where they lie (no gather copy).
//
// The KV cache of one layer is [2, kv_heads, num_blocks, block_size, head_dim] (see
// runtime/layers/attention.py). Plain C ABI, loaded with ctypes: no torch headers, so it
// compiles in about a second. Element types: float32 and bfloat16 (as raw uint16 bits);
// scores and sums are float32, as torch's softmax(dtype=float32) path. With AVX-512 and a
// head_dim of 64 or 128 the inner loops are written with intrinsics (cpu_attention_tiles.h);
// elsewhere plain loops that -O3 vectorizes. OpenMP (torch's own libgomp, already loaded)
// splits the (query row, kv head) pairs over threads.
//
// Two entry points over the same rows: paged_decode, one query row per sequence, and
// paged_extend, the prefill chunks, each of whose query tokens is a row of its own that
// attends to the cache up to its position (causal by each row's length). The cached keys a
// chunk's rows share stay in L1/L2 between them; on an AMD EPYC this ran SmolLM2's prefill
// attention 2-2.7x faster than torch's flash SDPA in bfloat16 (4 x 128 tokens, 30 layers:
// 53.6 -> 19.9 ms; 512 tokens: 136 -> 68 ms) and no slower in float32.
//
// Every index that comes from the caller is checked: a bad slot or block id returns an
// error code instead of touching memory outside the cache.

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_attention_tiles.h"
#include "cpu_common.h"

namespace {

struct Shape {  // what every row of one call shares
  const void* cache;
  int64_t num_heads, kv_heads, num_blocks, block_size, dim;
  float scale;
  int threads;
  int64_t first_item = 0, end_item = -1;  // of rows x kv heads; -1: to the last
};

// One query row: a token's query heads, where their output goes, and the cached tokens it
// attends to (the first `len` of its sequence's block table).
struct Row {
  const void* q;
  void* out;
  const int64_t* table;
  int64_t len;
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

// One (row, kv head): the row's query heads of that group against its cached tokens.
template <typename T, int kDim, bool kAvx512>
void attend_group(const Shape& a, const Row& r, int64_t h, Scratch& s) {
  const int64_t dim = kDim > 0 ? kDim : a.dim, group = a.num_heads / a.kv_heads;
  const int64_t len = r.len, first_head = h * group;
  const int64_t plane = a.num_blocks * a.block_size * dim;  // one kv head's K (or V)
  const T* cache = static_cast<const T*>(a.cache);
  const T* q = static_cast<const T*>(r.q) + first_head * dim;
  const int64_t* table = r.table;
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
  T* out = static_cast<T*>(r.out) + first_head * dim;
  for (int64_t i = 0; i < group * dim; ++i) store(s.acc[i], out + i);
}

#if defined(__AVX512BF16__)
// attend_group for bfloat16, with the AVX512-BF16 tiles.
template <int kDim>
void attend_group_bf16(const Shape& a, const Row& r, int64_t h, Scratch& s) {
  const int64_t group = a.num_heads / a.kv_heads, len = r.len, first_head = h * group;
  const int64_t plane = a.num_blocks * a.block_size * kDim;
  const auto* cache = static_cast<const uint16_t*>(a.cache);
  const auto* q = static_cast<const uint16_t*>(r.q) + first_head * kDim;
  const int64_t* table = r.table;
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
  auto* out = static_cast<uint16_t*>(r.out) + first_head * kDim;
  for (int64_t g = 0; g < group; ++g)
    for (int64_t d = 0; d < kDim; ++d) store(s.acc[g * kDim + interleaved(d)], out + g * kDim + d);
}
#endif

// One (row, kv head), by the fastest variant this CPU has for T and head_dim.
template <typename T, int kDim, bool kAvx512>
void attend(const Shape& a, const Row& r, int64_t h, Scratch& s) {
#if defined(__AVX512BF16__)
  if constexpr (kAvx512 && sizeof(T) == 2) return attend_group_bf16<kDim>(a, r, h, s);
#endif
  attend_group<T, kDim, kAvx512>(a, r, h, s);
}

template <typename T, int kDim, bool kAvx512>
void attend_rows(const Shape& a, const std::vector<Row>& rows) {
  int64_t longest = 0;
  for (const Row& r : rows) longest = r.len > longest ? r.len : longest;
  const int64_t group = a.num_heads / a.kv_heads, heads = a.kv_heads;
  const int64_t end = a.end_item < 0 ? int64_t(rows.size()) * heads : a.end_item;
  if (a.threads <= 1) {  // no region: even one of one thread costs ~0.8 us (cpu_rows.h)
    Scratch scratch(group, longest, a.dim);
    for (int64_t i = a.first_item; i < end; ++i)
      attend<T, kDim, kAvx512>(a, rows[i / heads], i % heads, scratch);
    return;
  }
#pragma omp parallel num_threads(a.threads)
  {
    Scratch scratch(group, longest, a.dim);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = a.first_item; i < end; ++i)
      attend<T, kDim, kAvx512>(a, rows[i / heads], i % heads, scratch);
  }
}

// Checks every index the rows will follow, then picks the variant for head_dim.
template <typename T>
int attend_checked(const Shape& a, const std::vector<Row>& rows, int64_t table_width) {
  if (a.kv_heads <= 0 || a.num_heads % a.kv_heads != 0 || a.block_size <= 0) return 1;
  for (const Row& r : rows) {
    if (r.len <= 0 || r.len > table_width * a.block_size) return 2;
    for (int64_t i = 0; i < (r.len + a.block_size - 1) / a.block_size; ++i)
      if (r.table[i] < 0 || r.table[i] >= a.num_blocks) return 3;
  }
#if defined(__AVX512F__)
  if (a.dim == 64) return attend_rows<T, 64, true>(a, rows), 0;
  if (a.dim == 128) return attend_rows<T, 128, true>(a, rows), 0;
#endif
  return attend_rows<T, 0, false>(a, rows), 0;
}

int attend_any(int dtype, const Shape& a, const std::vector<Row>& rows, int64_t table_width) {
  if (dtype == 0) return attend_checked<float>(a, rows, table_width);
  if (dtype == 1) return attend_checked<uint16_t>(a, rows, table_width);
  return 5;
}

// Where token t's row starts in a tensor of dtype's elements, `stride` elements a token.
template <typename P>
inline P* token_row(P* base, int dtype, int64_t t, int64_t stride) {
  using Byte = std::conditional_t<std::is_const_v<P>, const char, char>;
  return reinterpret_cast<Byte*>(base) + t * stride * (dtype == 0 ? 4 : 2);
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

int paged_decode_items(int dtype, void* out, const void* q, int64_t q_token_stride,
                       const void* cache, const int64_t* tables, int64_t table_width,
                       const int64_t* lens, int64_t batch, int64_t num_heads, int64_t kv_heads,
                       int64_t num_blocks, int64_t block_size, int64_t dim, float scale,
                       int threads, int64_t first, int64_t end);

// dtype: 0 float32, 1 bfloat16. Returns 0, or a nonzero code for a bad argument.
// Sequence b's query is row b of q; it attends to the first lens[b] tokens of table b.
int paged_decode(int dtype, void* out, const void* q, int64_t q_token_stride, const void* cache,
                 const int64_t* tables, int64_t table_width, const int64_t* lens, int64_t batch,
                 int64_t num_heads, int64_t kv_heads, int64_t num_blocks, int64_t block_size,
                 int64_t dim, float scale, int threads) {
  return paged_decode_items(dtype, out, q, q_token_stride, cache, tables, table_width, lens,
                            batch, num_heads, kv_heads, num_blocks, block_size, dim, scale,
                            threads, 0, -1);
}

// paged_decode's items [first, end) only (an item: one row's kv head with its query heads;
// end -1: to the last): how cpu_team.h's threads share a decode step's attention.
int paged_decode_items(int dtype, void* out, const void* q, int64_t q_token_stride,
                       const void* cache, const int64_t* tables, int64_t table_width,
                       const int64_t* lens, int64_t batch, int64_t num_heads, int64_t kv_heads,
                       int64_t num_blocks, int64_t block_size, int64_t dim, float scale,
                       int threads, int64_t first, int64_t end) {
  if (first < 0 || end > batch * kv_heads || (end >= 0 && end < first)) return 6;
  const Shape a{cache, num_heads, kv_heads, num_blocks, block_size, dim, scale, threads,
                first, end};
  std::vector<Row> rows(batch);
  for (int64_t b = 0; b < batch; ++b)
    rows[b] = Row{token_row(q, dtype, b, q_token_stride),
                  token_row(out, dtype, b, num_heads * dim),
                  tables + b * table_width, lens[b]};
  return attend_any(dtype, a, rows, table_width);
}

// Prefill chunk p: rows q_starts[p] .. + q_lens[p] of q (of `tokens`), the last q_lens[p] of
// the first context_lens[p] tokens of table p; query i attends to the tokens up to itself.
// Rows of q that no chunk covers are left unwritten in out.
int paged_extend(int dtype, void* out, const void* q, int64_t q_token_stride, int64_t tokens,
                 const void* cache, const int64_t* tables, int64_t table_width,
                 const int64_t* q_starts, const int64_t* q_lens, const int64_t* context_lens,
                 int64_t chunks, int64_t num_heads, int64_t kv_heads, int64_t num_blocks,
                 int64_t block_size, int64_t dim, float scale, int threads) {
  const Shape a{cache, num_heads, kv_heads, num_blocks, block_size, dim, scale, threads};
  std::vector<Row> rows;
  for (int64_t p = 0; p < chunks; ++p) {
    const int64_t first = q_starts[p], n = q_lens[p], context = context_lens[p];
    if (first < 0 || n <= 0 || n > tokens - first || context < n) return 2;
    for (int64_t i = 0; i < n; ++i)
      rows.push_back(Row{token_row(q, dtype, first + i, q_token_stride),
                         token_row(out, dtype, first + i, num_heads * dim),
                         tables + p * table_width, context - n + i + 1});
  }
  return attend_any(dtype, a, rows, table_width);
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

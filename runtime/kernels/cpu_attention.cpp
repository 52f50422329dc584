// Paged attention on CPU, reading K/V blocks where they lie (no gather copy).
//
// The KV cache of one layer is [2, kv_heads, num_blocks, block_size, head_dim] (see
// runtime/layers/attention.py). Plain C ABI, loaded with ctypes: no torch headers, so it
// compiles in about a second. Element types: float32 and bfloat16 (as raw uint16 bits);
// scores and sums are float32, as torch's softmax(dtype=float32) path. With AVX-512 and a
// head_dim of 64 or 128 the inner loops are written with intrinsics (cpu_attention_tiles.h);
// elsewhere plain loops that -O3 vectorizes. OpenMP (torch's own libgomp, already loaded)
// splits the work over threads: prefill's (query row, kv head) pairs, and decode's items, a
// row's kv head over a chunk of its cached tokens (kDecodeChunk below).
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
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "cpu_attention_tiles.h"
#include "cpu_common.h"
#include "cpu_rows.h"

namespace {

struct Shape {  // what every row of one call shares
  const void* cache;
  int64_t num_heads, kv_heads, num_blocks, block_size, dim;
  float scale;
  int threads;
  int64_t first_item = 0, end_item = -1;  // decode items (kDecodeChunk); -1: to the last
};

// One query row: a token's query heads, where their output goes, and the cached tokens it
// attends to (the first `len` of its sequence's block table).
struct Row {
  const void* q;
  void* out;
  const int64_t* table;
  int64_t len;
};

// Scratch of one thread, sized for the longest stretch of cached tokens it scores at once.
struct Scratch {
  std::vector<float> scores, qf, acc, tile, top, total;
  Scratch(int64_t group, int64_t longest, int64_t dim) { resize(group, longest, dim); }
  void resize(int64_t group, int64_t longest, int64_t dim) {
    scores.resize(group * longest), qf.resize(group * dim), acc.resize(group * dim);
    tile.resize(kTile * dim), top.resize(group), total.resize(group);
  }
};

// A decode row's work comes in items: one kv head over one chunk of up to kDecodeChunk of
// its cached tokens, so that two threads share even one row of 3 kv heads about evenly
// (whole heads went 2:1, and a step's attention took the longer share). An item leaves its
// part of the softmax unnormalized: per query head of the group the scores' max, the sum of
// their exps and the values weighted by those exps, [group] + [group] + [group x dim]
// floats (`Partial`); merging a head's chunks rescales each to the largest max. The chunks
// depend on a row's length and the batch's shape, never on the threads, so that every way
// of sharing the items gives the same bits. SmolLM2 Q4_1, one row, the one-call decode step
// on 2 threads of an AMD EPYC, alternating with whole heads in one process: 3.42 -> 3.08 ms
// a step at ~200 cached tokens, 5.19 -> 4.98 at ~1000 (KV reads are near the memory's rate
// there).
// Rows whose kv heads are this many items or more (a batch of 3 rows of SmolLM2) keep whole
// heads, normalized straight into their outputs as before: enough items to share, and
// chunks there only cost (their partials, a head's chunks on different threads): batch 32 at
// 600 cached tokens took 1190 us a layer in chunks against 844 in whole heads.
constexpr int64_t kDecodeChunk = 64, kChunkedBelow = 8;
constexpr int64_t kMergesToSpread = 64;  // (row, kv head) merges worth a region

// The tokens of a chunk in a call over `rows` rows: the batch's shape decides, never the threads.
inline int64_t chunk_tokens(int64_t rows, int64_t kv_heads) {
  return rows * kv_heads < kChunkedBelow ? kDecodeChunk : int64_t(1) << 40;
}

inline int64_t decode_chunks(int64_t len, int64_t chunk) { return (len + chunk - 1) / chunk; }

inline int64_t partial_floats(int64_t group, int64_t dim) { return group * (dim + 2); }

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

// Calls f(rows, n, first) for each tile of the cached tokens [begin, end), in order: `rows`
// points at `n` consecutive token rows of one block, `first` is the first one's position.
// Blocks are fetched ahead up to `fetch_end` (>= end), the row's length: a chunk's reads
// fetch the next chunk's first blocks, which the same thread reads next.
template <typename T, typename F>
void for_each_tile(const T* plane, const int64_t* table, int64_t begin, int64_t end,
                   int64_t fetch_end, int64_t block_size, int64_t dim, F f) {
  const int64_t block_bytes = block_size * dim * int64_t(sizeof(T));
  for (int64_t start = begin - begin % block_size; start < end; start += block_size) {
    const T* block = plane + table[start / block_size] * block_size * dim;
    const int64_t ahead = start + kBlocksAhead * block_size;
    if (ahead < fetch_end)
      fetch_block(plane + table[ahead / block_size] * block_size * dim, block_bytes);
    const int64_t from = begin > start ? begin - start : 0;
    const int64_t in_block = end - start < block_size ? end - start : block_size;
    for (int64_t off = from; off < in_block; off += kTile) {
      const int n = int(in_block - off < kTile ? in_block - off : kTile);
      f(block + off * dim, n, start + off);
    }
  }
}

// The first blocks of [begin, end) fetched, for a pass that starts there soon: a chunk's V
// pass after its short K pass (a whole row's K pass is long enough for the prefetchers).
template <typename T>
void fetch_first(const T* plane, const int64_t* table, int64_t begin, int64_t end,
                 int64_t len, int64_t block_size, int64_t dim) {
  if (begin == 0 && end == len) return;
  const int64_t first = begin - begin % block_size;
  for (int64_t b = 0; b < kBlocksAhead && first + b * block_size < end; ++b)
    fetch_block(plane + table[first / block_size + b] * block_size * dim,
                block_size * dim * int64_t(sizeof(T)));
}

// One (row, kv head) over the cached tokens [begin, end): the row's query heads of that
// group scored against them, the exps of the scores less each head's max (normalized to
// probabilities where `normalize`), and the values weighted by them summed in s.acc; each
// head's max and sum of exps in s.top and s.total.
template <typename T, int kDim, bool kAvx512>
void weigh_values(const Shape& a, const Row& r, int64_t h, int64_t begin, int64_t end,
                  bool normalize, Scratch& s) {
  const int64_t dim = kDim > 0 ? kDim : a.dim, group = a.num_heads / a.kv_heads;
  const int64_t len = end - begin, first_head = h * group;
  const int64_t plane = a.num_blocks * a.block_size * dim;  // one kv head's K (or V)
  const T* cache = static_cast<const T*>(a.cache);
  const T* q = static_cast<const T*>(r.q) + first_head * dim;
  float* scores = s.scores.data();  // token t's score of head g: scores[g * len + t - begin]
  for (int64_t i = 0; i < group * dim; ++i) s.qf[i] = to_float(q[i]) * a.scale;
  fetch_first(cache + (a.kv_heads + h) * plane, r.table, begin, end, r.len, a.block_size, dim);
  for_each_tile(cache + h * plane, r.table, begin, end, r.len, a.block_size, dim,
                [&](const T* rows, int n, int64_t first) {
                  float* at = scores + (first - begin);
                  if constexpr (kAvx512)
                    qk_tile_avx512<T, kDim>(s.qf.data(), rows, n, group, at, len, s.tile.data());
                  else
                    qk_tile<T, kDim>(s.qf.data(), rows, n, group, dim, at, len, s.tile.data());
                });
  if constexpr (kAvx512)
    (normalize ? softmax_rows_avx512 : exp_rows_avx512)(s.scores.data(), group, len,
                                                         s.top.data(), s.total.data());
  else
    (normalize ? softmax_rows : exp_rows)(s.scores.data(), group, len, s.top.data(),
                                          s.total.data());
  std::fill(s.acc.begin(), s.acc.end(), 0.f);
  for_each_tile(cache + (a.kv_heads + h) * plane, r.table, begin, end, r.len, a.block_size,
                dim, [&](const T* rows, int n, int64_t first) {
                  const float* at = scores + (first - begin);
                  if constexpr (kAvx512)
                    pv_tile_avx512<T, kDim>(at, rows, n, group, len, s.acc.data(), s.tile.data());
                  else
                    pv_tile<T, kDim>(at, rows, n, group, dim, len, s.acc.data(), s.tile.data());
                });
}

#if defined(__AVX512BF16__)
// weigh_values for bfloat16, with the AVX512-BF16 tiles; s.acc holds each head's sums in
// pv_tile_bf16's interleaved order.
template <int kDim>
void weigh_values_bf16(const Shape& a, const Row& r, int64_t h, int64_t begin, int64_t end,
                       bool normalize, Scratch& s) {
  const int64_t group = a.num_heads / a.kv_heads, len = end - begin, first_head = h * group;
  const int64_t plane = a.num_blocks * a.block_size * kDim;
  const auto* cache = static_cast<const uint16_t*>(a.cache);
  const auto* q = static_cast<const uint16_t*>(r.q) + first_head * kDim;
  float* scores = s.scores.data();
  fetch_first(cache + (a.kv_heads + h) * plane, r.table, begin, end, r.len, a.block_size,
              kDim);
  for_each_tile(cache + h * plane, r.table, begin, end, r.len, a.block_size, kDim,
                [&](const uint16_t* rows, int n, int64_t first) {
                  qk_tile_bf16<kDim>(q, a.scale, rows, n, group, scores + (first - begin), len);
                });
  (normalize ? softmax_rows_avx512 : exp_rows_avx512)(s.scores.data(), group, len,
                                                       s.top.data(), s.total.data());
  std::fill(s.acc.begin(), s.acc.end(), 0.f);
  for_each_tile(cache + (a.kv_heads + h) * plane, r.table, begin, end, r.len, a.block_size,
                kDim,
                [&](const uint16_t* rows, int n, int64_t first) {
                  pv_tile_bf16<kDim>(scores + (first - begin), rows, n, group, len, s.acc.data());
                });
}
#endif

// Where element d of a head lies in s.acc as weigh_values left it.
template <typename T, int kDim, bool kAvx512>
inline int64_t acc_index(int64_t d) {
#if defined(__AVX512BF16__)
  if constexpr (kAvx512 && sizeof(T) == 2) return d / kDim * kDim + interleaved(d % kDim);
#endif
  return d;
}

// weigh_values by the fastest variant this CPU has for T and head_dim.
template <typename T, int kDim, bool kAvx512>
void weigh(const Shape& a, const Row& r, int64_t h, int64_t begin, int64_t end, bool normalize,
           Scratch& s) {
#if defined(__AVX512BF16__)
  if constexpr (kAvx512 && sizeof(T) == 2)
    return weigh_values_bf16<kDim>(a, r, h, begin, end, normalize, s);
#endif
  weigh_values<T, kDim, kAvx512>(a, r, h, begin, end, normalize, s);
}

// One prefill row's kv head over all its cached tokens, normalized, into the row's output.
template <typename T, int kDim, bool kAvx512>
void attend(const Shape& a, const Row& r, int64_t h, Scratch& s) {
  const int64_t group = a.num_heads / a.kv_heads;
  weigh<T, kDim, kAvx512>(a, r, h, 0, r.len, true, s);
  T* out = static_cast<T*>(r.out) + h * group * a.dim;
  for (int64_t i = 0; i < group * a.dim; ++i)
    store(s.acc[acc_index<T, kDim, kAvx512>(i)], out + i);
}

template <typename T, int kDim, bool kAvx512>
void attend_rows(const Shape& a, const std::vector<Row>& rows) {
  int64_t longest = 0;
  for (const Row& r : rows) longest = r.len > longest ? r.len : longest;
  const int64_t group = a.num_heads / a.kv_heads, heads = a.kv_heads;
  const int64_t end = int64_t(rows.size()) * heads;
  if (a.threads <= 1) {  // no region: even one of one thread costs ~0.8 us (cpu_rows.h)
    Scratch scratch(group, longest, a.dim);
    for (int64_t i = 0; i < end; ++i)
      attend<T, kDim, kAvx512>(a, rows[i / heads], i % heads, scratch);
    return;
  }
#pragma omp parallel num_threads(a.threads)
  {
    Scratch scratch(group, longest, a.dim);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = 0; i < end; ++i)
      attend<T, kDim, kAvx512>(a, rows[i / heads], i % heads, scratch);
  }
}

// The decode rows' items in order: row b's are items[b] .. items[b + 1], kv head by kv head,
// chunk by chunk.
std::vector<int64_t> item_starts(const std::vector<Row>& rows, int64_t kv_heads) {
  const int64_t chunk = chunk_tokens(int64_t(rows.size()), kv_heads);
  std::vector<int64_t> starts(rows.size() + 1, 0);
  for (size_t b = 0; b < rows.size(); ++b)
    starts[b + 1] = starts[b] + kv_heads * decode_chunks(rows[b].len, chunk);
  return starts;
}

// Decode item i: a whole head normalized into its row's output, as prefill does, or a
// chunk's partial written at partials + i * partial_floats.
template <typename T, int kDim, bool kAvx512>
void decode_item(const Shape& a, const std::vector<Row>& rows,
                 const std::vector<int64_t>& starts, int64_t i, float* partials, Scratch& s) {
  const auto b = std::upper_bound(starts.begin(), starts.end(), i) - starts.begin() - 1;
  const Row& r = rows[b];
  const int64_t chunk = chunk_tokens(int64_t(rows.size()), a.kv_heads);
  if (chunk != kDecodeChunk) return attend<T, kDim, kAvx512>(a, r, i - starts[b], s);
  const int64_t chunks = decode_chunks(r.len, chunk), local = i - starts[b];
  const int64_t begin = local % chunks * chunk;
  const int64_t end = std::min(begin + chunk, r.len);
  weigh<T, kDim, kAvx512>(a, r, local / chunks, begin, end, false, s);
  const int64_t group = a.num_heads / a.kv_heads;
  float* p = partials + i * partial_floats(group, a.dim);
  std::copy(s.top.begin(), s.top.end(), p);
  std::copy(s.total.begin(), s.total.end(), p + group);
  for (int64_t d = 0; d < group * a.dim; ++d)
    p[2 * group + d] = s.acc[acc_index<T, kDim, kAvx512>(d)];
}

// The calling thread's scratch for decode items, kept from call to call: a decode step's
// team calls for its items once a layer on each thread.
Scratch& decode_scratch(int64_t group, int64_t tokens, int64_t dim) {
  thread_local Scratch scratch(0, 0, 0);
  scratch.resize(group, tokens, dim);
  return scratch;
}

template <typename T, int kDim, bool kAvx512>
void decode_items(const Shape& a, const std::vector<Row>& rows, float* partials) {
  const std::vector<int64_t> starts = item_starts(rows, a.kv_heads);
  const int64_t group = a.num_heads / a.kv_heads;
  const int64_t end = a.end_item < 0 ? starts.back() : a.end_item;
  int64_t longest = 0;  // an item's tokens at most
  for (const Row& r : rows) longest = std::max(longest, r.len);
  longest = std::min(longest, chunk_tokens(int64_t(rows.size()), a.kv_heads));
  if (a.threads <= 1) {
    Scratch& scratch = decode_scratch(group, longest, a.dim);
    for (int64_t i = a.first_item; i < end; ++i)
      decode_item<T, kDim, kAvx512>(a, rows, starts, i, partials, scratch);
    return;
  }
#pragma omp parallel num_threads(a.threads)
  {
    Scratch& scratch = decode_scratch(group, longest, a.dim);
#pragma omp for schedule(dynamic, 1)
    for (int64_t i = a.first_item; i < end; ++i)
      decode_item<T, kDim, kAvx512>(a, rows, starts, i, partials, scratch);
  }
}

// Row r's kv head h from its `chunks` partials: each chunk's exps rescaled to the largest
// max, then divided by their sum.
template <typename T>
void merge_head(const Shape& a, const Row& r, int64_t h, const float* partials, int64_t chunks) {
  const int64_t group = a.num_heads / a.kv_heads, dim = a.dim;
  const int64_t size = partial_floats(group, dim);
  T* out = static_cast<T*>(r.out) + h * group * dim;
  thread_local std::vector<float> weights;
  weights.resize(chunks);
  for (int64_t g = 0; g < group; ++g) {
    float top = -INFINITY, total = 0.f;
    for (int64_t c = 0; c < chunks; ++c) top = std::max(top, partials[c * size + g]);
    for (int64_t c = 0; c < chunks; ++c) {
      weights[c] = std::exp(partials[c * size + g] - top);
      total += weights[c] * partials[c * size + group + g];
    }
    const float inv = 1.f / total;
    for (int64_t d = 0; d < dim; ++d) {
      float sum = 0.f;
      for (int64_t c = 0; c < chunks; ++c)
        sum += weights[c] * partials[c * size + 2 * group + g * dim + d];
      store(sum * inv, out + g * dim + d);
    }
  }
}

template <typename T>
void merge_rows(const Shape& a, const std::vector<Row>& rows, const float* partials) {
  const std::vector<int64_t> starts = item_starts(rows, a.kv_heads);
  const int64_t heads = a.kv_heads, size = partial_floats(a.num_heads / heads, a.dim);
  const int64_t n = int64_t(rows.size()) * heads;
  const int64_t chunk = chunk_tokens(int64_t(rows.size()), heads);
  for_rows(n, a.threads, n >= kMergesToSpread, [&](int64_t i) {
    const Row& r = rows[i / heads];
    const int64_t chunks = decode_chunks(r.len, chunk);
    merge_head<T>(a, r, i % heads, partials + (starts[i / heads] + i % heads * chunks) * size,
                  chunks);
  });
}

// Checks every index the rows will follow.
int check_rows(const Shape& a, const std::vector<Row>& rows, int64_t table_width) {
  if (a.kv_heads <= 0 || a.num_heads % a.kv_heads != 0 || a.block_size <= 0) return 1;
  for (const Row& r : rows) {
    if (r.len <= 0 || r.len > table_width * a.block_size) return 2;
    for (int64_t i = 0; i < (r.len + a.block_size - 1) / a.block_size; ++i)
      if (r.table[i] < 0 || r.table[i] >= a.num_blocks) return 3;
  }
  return 0;
}

// Prefill rows into their outputs, or decode items (into outputs or partials), by the
// variant for head_dim.
template <typename T, int kDim, bool kAvx512>
void run(const Shape& a, const std::vector<Row>& rows, bool decode, float* partials) {
  if (decode)
    decode_items<T, kDim, kAvx512>(a, rows, partials);
  else
    attend_rows<T, kDim, kAvx512>(a, rows);
}

template <typename T>
int run_checked(const Shape& a, const std::vector<Row>& rows, int64_t table_width, bool decode,
                float* partials) {
  if (const int code = check_rows(a, rows, table_width)) return code;
  if (decode && (a.first_item < 0 || a.end_item > item_starts(rows, a.kv_heads).back() ||
                 (a.end_item >= 0 && a.end_item < a.first_item)))
    return 6;
#if defined(__AVX512F__)
  if (a.dim == 64) return run<T, 64, true>(a, rows, decode, partials), 0;
  if (a.dim == 128) return run<T, 128, true>(a, rows, decode, partials), 0;
#endif
  return run<T, 0, false>(a, rows, decode, partials), 0;
}

int run_any(int dtype, const Shape& a, const std::vector<Row>& rows, int64_t table_width,
            bool decode = false, float* partials = nullptr) {
  if (dtype == 0) return run_checked<float>(a, rows, table_width, decode, partials);
  if (dtype == 1) return run_checked<uint16_t>(a, rows, table_width, decode, partials);
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

// The decode rows: query b is row b of q, attending to the first lens[b] tokens of table b,
// its output row b of out.
std::vector<Row> decode_rows(int dtype, void* out, const void* q, int64_t q_token_stride,
                             const int64_t* tables, int64_t table_width, const int64_t* lens,
                             int64_t batch, int64_t num_heads, int64_t dim) {
  std::vector<Row> rows(batch);
  for (int64_t b = 0; b < batch; ++b)
    rows[b] = Row{token_row(q, dtype, b, q_token_stride),
                  token_row(out, dtype, b, num_heads * dim), tables + b * table_width, lens[b]};
  return rows;
}

}  // namespace

extern "C" {

// How many items rows of these lengths make (counts[0]) and the floats of their partials
// (counts[1]): what paged_decode_items fills and paged_decode_merge reads.
int paged_decode_partials(const int64_t* lens, int64_t batch, int64_t num_heads,
                          int64_t kv_heads, int64_t dim, int64_t* counts) {
  if (kv_heads <= 0 || num_heads % kv_heads != 0) return 1;
  counts[0] = 0;
  for (int64_t b = 0; b < batch; ++b) {
    if (lens[b] <= 0) return 2;
    counts[0] += kv_heads * decode_chunks(lens[b], chunk_tokens(batch, kv_heads));
  }
  const bool chunked = chunk_tokens(batch, kv_heads) == kDecodeChunk;  // else no partials
  counts[1] = chunked ? counts[0] * partial_floats(num_heads / kv_heads, dim) : 0;
  return 0;
}

// Items [first, end) of the decode rows (end -1: to the last; an item: one row's kv head over
// one chunk of its tokens, or all of them) into their partials (or a whole head's into its
// output): how cpu_team.h's threads share a decode step's attention. paged_decode_merge then
// makes the chunked heads' outputs.
int paged_decode_items(int dtype, void* out, float* partials, const void* q,
                       int64_t q_token_stride, const void* cache, const int64_t* tables,
                       int64_t table_width, const int64_t* lens, int64_t batch,
                       int64_t num_heads, int64_t kv_heads, int64_t num_blocks,
                       int64_t block_size, int64_t dim, float scale, int threads, int64_t first,
                       int64_t end) {
  const Shape a{cache, num_heads, kv_heads, num_blocks, block_size, dim, scale, threads,
                first, end};
  const std::vector<Row> rows = decode_rows(dtype, out, q, q_token_stride, tables,
                                            table_width, lens, batch, num_heads, dim);
  return run_any(dtype, a, rows, table_width, true, partials);
}

// The decode rows' outputs from every item's partial.
int paged_decode_merge(int dtype, void* out, const float* partials, const int64_t* lens,
                       int64_t batch, int64_t num_heads, int64_t kv_heads, int64_t dim,
                       int threads) {
  if (kv_heads <= 0 || num_heads % kv_heads != 0) return 1;
  for (int64_t b = 0; b < batch; ++b)
    if (lens[b] <= 0) return 2;
  if (chunk_tokens(batch, kv_heads) != kDecodeChunk) return 0;  // whole heads: written
  const Shape a{nullptr, num_heads, kv_heads, 0, 0, dim, 0.f, threads};
  const std::vector<Row> rows = decode_rows(dtype, out, nullptr, 0, nullptr, 0, lens, batch,
                                            num_heads, dim);
  if (dtype == 0) return merge_rows<float>(a, rows, partials), 0;
  if (dtype == 1) return merge_rows<uint16_t>(a, rows, partials), 0;
  return 5;
}

// dtype: 0 float32, 1 bfloat16. Returns 0, or a nonzero code for a bad argument.
// Sequence b's query is row b of q; it attends to the first lens[b] tokens of table b.
int paged_decode(int dtype, void* out, const void* q, int64_t q_token_stride, const void* cache,
                 const int64_t* tables, int64_t table_width, const int64_t* lens, int64_t batch,
                 int64_t num_heads, int64_t kv_heads, int64_t num_blocks, int64_t block_size,
                 int64_t dim, float scale, int threads) {
  int64_t counts[2];
  if (const int code = paged_decode_partials(lens, batch, num_heads, kv_heads, dim, counts))
    return code;
  std::vector<float> partials(counts[1]);
  const int code = paged_decode_items(dtype, out, partials.data(), q, q_token_stride, cache, tables,
                                      table_width, lens, batch, num_heads, kv_heads, num_blocks,
                                      block_size, dim, scale, threads, 0, -1);
  return code ? code
              : paged_decode_merge(dtype, out, partials.data(), lens, batch, num_heads, kv_heads,
                                   dim, threads);
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
  return run_any(dtype, a, rows, table_width);
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

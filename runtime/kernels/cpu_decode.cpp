// A pure decode step's decoder layers in one call: the same kernels, with the same arguments,
// that the model's Python calls one by one (runtime/models/llama.py), chained here instead.
//
// At a decode step's few rows each kernel call is short (a norm of one row takes ~1 us) and
// what surrounds it in Python is not: a Linear's product, a norm's checks, the views between
// them cost 5-10 us a call, a dozen calls a layer. SmolLM2's 30 layers, batch 1, AMD EPYC
// (benchmarks/where_time_goes.py, ms a step): bfloat16 15.3 -> 8.7-11.0, float32 17.1 ->
// 14.7, Q4_1 blocks 10.4 -> 7.0. The per-layer description comes from
// runtime/layers/decode_layers.py (`LayerSpec` below, as int64 words); what a step changes
// comes as arguments. A step of repacked GGUF blocks and few rows runs in one region whose
// threads share each product part by part (cpu_team.h), the final norm and LM head included
// where the step ends in the logits.

#include <omp.h>

#include <cstdint>
#include <cstring>
#include <initializer_list>
#include <vector>

#include "cpu_team.h"

extern "C" {
int fused_add_rms_norm(int dtype, void* out, void* residual, const void* x, const void* weight,
                       int64_t rows, int64_t dim, float eps, int threads);
int fused_silu_and_mul(int dtype, void* out, const void* x, int64_t rows, int64_t inter,
                       int threads);
int fused_rotary(int dtype, void* x, int64_t token_stride, int64_t tokens, int64_t heads,
                 int64_t dim, const void* cos, const void* sin_signed, int threads);
int paged_store_kv(int dtype, void* cache, const void* kv, int64_t kv_token_stride,
                   const int64_t* slots, int64_t tokens, int64_t kv_heads, int64_t num_slots,
                   int64_t dim);
int paged_decode(int dtype, void* out, const void* q, int64_t q_token_stride, const void* cache,
                 const int64_t* tables, int64_t table_width, const int64_t* lens, int64_t batch,
                 int64_t num_heads, int64_t kv_heads, int64_t num_blocks, int64_t block_size,
                 int64_t dim, float scale, int threads);
int paged_decode_partials(const int64_t* lens, int64_t batch, int64_t num_heads,
                          int64_t kv_heads, int64_t dim, int64_t* counts);
int paged_decode_items(int dtype, void* out, float* partials, const void* q,
                       int64_t q_token_stride, const void* cache, const int64_t* tables,
                       int64_t table_width, const int64_t* lens, int64_t batch,
                       int64_t num_heads, int64_t kv_heads, int64_t num_blocks,
                       int64_t block_size, int64_t dim, float scale, int threads, int64_t first,
                       int64_t end);
int paged_decode_merge(int dtype, void* out, const float* partials, const int64_t* lens,
                       int64_t batch, int64_t num_heads, int64_t kv_heads, int64_t dim,
                       int threads);
int skinny_linear(int dtype, void* y, const void* x, const void* w, const void* bias,
                  int64_t rows, int64_t n, int64_t k, float* scratch, int threads);
int panel_linear(int dtype, void* y, const void* x, const void* packed, const void* bias,
                 int64_t rows, int64_t n, int64_t k, int threads);
int quant_linear(int qtype, float* y, const float* x, const uint8_t* w, const float* bias,
                 int64_t rows, int64_t n, int64_t k, void* scratch, int threads);
int repacked_linear(int qtype, float* y, const float* x, const uint8_t* w, const float* bias,
                    int64_t rows, int64_t n, int64_t k, void* scratch, int threads);
int repacked_groups(int qtype, float* y, const float* x, const uint8_t* w, const float* bias,
                    int64_t rows, int64_t n, int64_t k, int64_t first, int64_t end);
int repacked_rows();
}

namespace {

// How a layer's linear multiplies, as decode_layers.py's LINEAR_KINDS number them.
enum Kind : int64_t { kStreamed = 0, kPanels = 1, kBlocks = 2, kRepacked = 3 };

struct LinearSpec {
  int64_t kind, format;  // format: the GGUF block type (kBlocks, kRepacked)
  int64_t weight, bias;  // addresses; bias 0: none
  int64_t n, k;
};

struct LayerSpec {
  int64_t input_norm, post_norm;  // the norms' weights
  LinearSpec qkv, o, gate_up, down;
};
static_assert(sizeof(LayerSpec) == 26 * sizeof(int64_t), "decode_layers.py's SPEC_WORDS");

// The final norm and the LM head, where the step ends in every row's logits.
struct HeadSpec {
  int64_t norm;  // its weight
  LinearSpec linear;
};
static_assert(sizeof(HeadSpec) == 7 * sizeof(int64_t), "decode_layers.py's HEAD_WORDS");

const void* at(int64_t address) { return reinterpret_cast<const void*>(address); }

// What a step shares between its layers.
struct Step {
  int dtype;
  int64_t rows, hidden, heads, kv_heads, dim;
  float eps, scale;
  const void *cos, *sin;
  const int64_t *slots, *tables, *lens;
  int64_t table_width, num_blocks, block_size;
  void* scratch;
  int threads;
  StepTeam* team;  // the step's threads (cpu_team.h), or none: OpenMP regions
  float* partials;  // the team's attention items' (cpu_attention.cpp), reused by every layer
  int64_t items;
};

// One repacked product, as cpu_team.h's threads share it: groups of repacked_rows() columns.
struct RepackedJob {
  int64_t format;
  float* y;
  const float* x;
  const uint8_t* w;
  const float* bias;
  int64_t rows, n, k;
};

void repacked_part(const void* job, int64_t first, int64_t end) {
  const auto& j = *static_cast<const RepackedJob*>(job);
  repacked_groups(int(j.format), j.y, j.x, j.w, j.bias, j.rows, j.n, j.k, first, end);
}

int shared_product(const Step& s, const LinearSpec& l, void* y, const void* x) {
  const RepackedJob job{l.format, static_cast<float*>(y), static_cast<const float*>(x),
                        static_cast<const uint8_t*>(at(l.weight)),
                        static_cast<const float*>(at(l.bias)), s.rows, l.n, l.k};
  // an empty range checks the arguments, so that no part can fail
  if (const int code = repacked_groups(int(l.format), job.y, job.x, job.w, job.bias, s.rows,
                                       l.n, l.k, 0, 0))
    return code;
  s.team->share(repacked_part, &job, l.n / repacked_rows());
  return 0;
}

int product(const Step& s, const LinearSpec& l, void* y, const void* x) {
  if (s.team) return shared_product(s, l, y, x);  // every linear is repacked (team_applies)
  switch (l.kind) {
    case kStreamed:
      return skinny_linear(s.dtype, y, x, at(l.weight), at(l.bias), s.rows, l.n, l.k,
                           static_cast<float*>(s.scratch), s.threads);
    case kPanels:
      return panel_linear(s.dtype, y, x, at(l.weight), at(l.bias), s.rows, l.n, l.k,
                          s.threads);
    case kBlocks:
      return quant_linear(int(l.format), static_cast<float*>(y), static_cast<const float*>(x),
                          static_cast<const uint8_t*>(at(l.weight)),
                          static_cast<const float*>(at(l.bias)), s.rows, l.n, l.k, s.scratch,
                          s.threads);
    case kRepacked:
      return repacked_linear(int(l.format), static_cast<float*>(y),
                             static_cast<const float*>(x),
                             static_cast<const uint8_t*>(at(l.weight)),
                             static_cast<const float*>(at(l.bias)), s.rows, l.n, l.k,
                             s.scratch, s.threads);
  }
  return 30;
}

// Buffers of one step, each [rows, width] in the model's dtype.
struct Work {
  void *h, *qkv, *attn, *gate_up, *act;
};

// q against the cache, all of the step's rows
int attend(const Step& s, const Work& w, const void* cache) {
  const int64_t stride = (s.heads + 2 * s.kv_heads) * s.dim;
  return paged_decode(s.dtype, w.attn, w.qkv, stride, cache, s.tables, s.table_width, s.lens,
                      s.rows, s.heads, s.kv_heads, s.num_blocks, s.block_size, s.dim, s.scale,
                      s.threads);
}

// q against the cache: items [first, end) into the step's partials, or whole heads into
// w.attn (end -1: all)
int attend_items(const Step& s, const Work& w, const void* cache, int64_t first, int64_t end) {
  const int64_t stride = (s.heads + 2 * s.kv_heads) * s.dim;
  return paged_decode_items(s.dtype, w.attn, s.partials, w.qkv, stride, cache, s.tables,
                            s.table_width, s.lens, s.rows, s.heads, s.kv_heads, s.num_blocks,
                            s.block_size, s.dim, s.scale, 1, first, end);
}

struct AttentionJob {
  const Step* s;
  const Work* w;
  const void* cache;
};

void attention_part(const void* job, int64_t first, int64_t end) {
  const auto& j = *static_cast<const AttentionJob*>(job);
  attend_items(*j.s, *j.w, j.cache, first, end);
}

int shared_attention(const Step& s, const Work& w, const void* cache) {
  if (const int code = attend_items(s, w, cache, 0, 0)) return code;  // the checks, no items
  const AttentionJob job{&s, &w, cache};
  s.team->share(attention_part, &job, s.items);
  return paged_decode_merge(s.dtype, w.attn, s.partials, s.lens, s.rows, s.heads, s.kv_heads,
                            s.dim, 1);
}

// attention: the fused q/k/v heads rotated, k and v stored, q against the cache
int attention(const Step& s, const LayerSpec& l, const Work& w, void* cache, void* y) {
  const int64_t stride = (s.heads + 2 * s.kv_heads) * s.dim;  // one token's q, k and v
  const int64_t size = s.dtype == 0 ? 4 : 2;
  int code = product(s, l.qkv, w.qkv, w.h);
  if (!code)
    code = fused_rotary(s.dtype, w.qkv, stride, s.rows, s.heads + s.kv_heads, s.dim, s.cos,
                        s.sin, s.threads);
  if (!code)
    code = paged_store_kv(s.dtype, cache, static_cast<char*>(w.qkv) + s.heads * s.dim * size,
                          stride, s.slots, s.rows, s.kv_heads, s.num_blocks * s.block_size,
                          s.dim);
  if (!code) code = s.team ? shared_attention(s, w, cache) : attend(s, w, cache);
  return code ? code : product(s, l.o, y, w.attn);
}

// residual += y (the previous layer's output), h = its norm; the first layer has no y, and
// norms the embeddings, which stay the residual
int layer(const Step& s, const LayerSpec& l, const Work& w, void* cache, void* residual,
          void* y, bool first) {
  int code = fused_add_rms_norm(s.dtype, w.h, first ? nullptr : residual,
                                first ? residual : y, at(l.input_norm), s.rows, s.hidden, s.eps,
                                s.threads);
  if (!code) code = attention(s, l, w, cache, y);
  if (!code)
    code = fused_add_rms_norm(s.dtype, w.h, residual, y, at(l.post_norm), s.rows, s.hidden,
                              s.eps, s.threads);
  if (!code) code = product(s, l.gate_up, w.gate_up, w.h);
  if (!code)
    code = fused_silu_and_mul(s.dtype, w.act, w.gate_up, s.rows, l.gate_up.n / 2, s.threads);
  return code ? code : product(s, l.down, y, w.act);
}

// What the layers of a step run over.
struct Chain {
  const LayerSpec* specs;
  int64_t layers;
  Work w;
  void *cache;
  int64_t cache_stride;
  void *residual, *y;
  const HeadSpec* head;  // none: the step ends with the last layer's output
  void* logits;          // [rows, the head's n] float32
};

int layers_of(const Step& s, const Chain& c) {
  const int64_t size = s.dtype == 0 ? 4 : 2;
  for (int64_t i = 0; i < c.layers; ++i) {
    char* layer_cache = static_cast<char*>(c.cache) + i * c.cache_stride * size;
    const int code = layer(s, c.specs[i], c.w, layer_cache, c.residual, c.y, i == 0);
    if (code) return code;
  }
  if (!c.head) return 0;
  const int code = fused_add_rms_norm(s.dtype, c.w.h, c.residual, c.y, at(c.head->norm),
                                      s.rows, s.hidden, s.eps, s.threads);
  return code ? code : product(s, c.head->linear, c.logits, c.w.h);
}

// Rows up to which the two threads share a step's products by halves (cpu_team.h): a few,
// whose products are short and many; more rows keep OpenMP's regions.
constexpr int64_t kTeamRows = 4;

bool team_applies(const Step& s, const LayerSpec* specs, int64_t layers, const HeadSpec* head) {
  if (s.threads < 2 || s.rows > kTeamRows || s.dtype != 0) return false;
  if (head && head->linear.kind != kRepacked) return false;
  for (int64_t i = 0; i < layers; ++i)
    for (const LinearSpec* l : {&specs[i].qkv, &specs[i].o, &specs[i].gate_up, &specs[i].down})
      if (l->kind != kRepacked) return false;
  return true;
}

}  // namespace

extern "C" {

// The layers of a decode step: `residual` holds the embeddings coming in and the residual
// stream going out, `y` the last layer's output (the final norm's other input). The first
// layer norms the embeddings; every later one adds its predecessor's output first, in place.
// cache: layer 0's [2, kv_heads, num_blocks, block_size, dim], the next `cache_stride`
// elements on. work: h, qkv, attn, gate_up, act; scratch: what the linears need. head (or
// null): the final norm and the LM head, whose products of every row go to `logits`.
int decode_layers(int dtype, const int64_t* spec, int64_t layers, void* residual, void* y,
                  int64_t rows, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t dim,
                  float eps, float scale, const void* cos, const void* sin, void* cache,
                  int64_t cache_stride, int64_t num_blocks, int64_t block_size,
                  const int64_t* slots, const int64_t* tables, int64_t table_width,
                  const int64_t* lens, void* const* work, void* scratch, int threads,
                  const int64_t* head, void* logits) {
  if (dtype != 0 && dtype != 1) return 100 + dtype;
  Step s{dtype, rows, hidden, heads, kv_heads, dim, eps, scale, cos, sin, slots,
         tables, lens, table_width, num_blocks, block_size, scratch, threads, nullptr,
         nullptr, 0};
  const Work w{work[0], work[1], work[2], work[3], work[4]};
  const auto* specs = reinterpret_cast<const LayerSpec*>(spec);
  const auto* head_spec = reinterpret_cast<const HeadSpec*>(head);
  const Chain chain{specs, layers, w, cache, cache_stride, residual, y, head_spec, logits};
  if (!team_applies(s, specs, layers, head_spec)) return layers_of(s, chain);
  int64_t counts[2];
  if (const int code = paged_decode_partials(lens, rows, heads, kv_heads, dim, counts))
    return code;
  std::vector<float> partials(counts[1]);
  StepTeam team(threads);
  int code = 0;
  s.team = &team;
  s.partials = partials.data();
  s.items = counts[0];
  s.threads = 1;  // the rest of a layer (norms, rotary) on the calling thread
#pragma omp parallel num_threads(threads)
  {
    if (omp_get_thread_num() == 0) {
      code = layers_of(s, chain);
      team.finish();
    } else {
      team.help();
    }
  }
  return code;
}

}  // extern "C"

// A pure decode step's decoder layers in one call: the same kernels, with the same arguments,
// that the model's Python calls one by one (runtime/models/llama.py), chained here instead.
//
// At a decode step's few rows each kernel call is short (a norm of one row takes ~1 us) and
// what surrounds it in Python is not: a Linear's product, a norm's checks, the views between
// them cost 5-10 us a call, a dozen calls a layer. SmolLM2's 30 layers, batch 1, AMD EPYC
// (benchmarks/where_time_goes.py, ms a step): bfloat16 15.3 -> 8.7-11.0, float32 17.1 ->
// 14.7, Q4_1 blocks 10.4 -> 7.0. The per-layer description comes from
// runtime/layers/decode_layers.py (`LayerSpec` below, as int64 words); what a step changes
// comes as arguments.

#include <cstdint>
#include <cstring>

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
int skinny_linear(int dtype, void* y, const void* x, const void* w, const void* bias,
                  int64_t rows, int64_t n, int64_t k, float* scratch, int threads);
int panel_linear(int dtype, void* y, const void* x, const void* packed, const void* bias,
                 int64_t rows, int64_t n, int64_t k, int threads);
int quant_linear(int qtype, float* y, const float* x, const uint8_t* w, const float* bias,
                 int64_t rows, int64_t n, int64_t k, void* scratch, int threads);
int repacked_linear(int qtype, float* y, const float* x, const uint8_t* w, const float* bias,
                    int64_t rows, int64_t n, int64_t k, void* scratch, int threads);
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
};

int product(const Step& s, const LinearSpec& l, void* y, const void* x) {
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
  if (!code)
    code = paged_decode(s.dtype, w.attn, w.qkv, stride, cache, s.tables, s.table_width, s.lens,
                        s.rows, s.heads, s.kv_heads, s.num_blocks, s.block_size, s.dim, s.scale,
                        s.threads);
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

}  // namespace

extern "C" {

// The layers of a decode step: `residual` holds the embeddings coming in and the residual
// stream going out, `y` the last layer's output (the final norm's other input). The first
// layer norms the embeddings; every later one adds its predecessor's output first, in place.
// cache: layer 0's [2, kv_heads, num_blocks, block_size, dim], the next `cache_stride`
// elements on. work: h, qkv, attn, gate_up, act; scratch: what the linears need.
int decode_layers(int dtype, const int64_t* spec, int64_t layers, void* residual, void* y,
                  int64_t rows, int64_t hidden, int64_t heads, int64_t kv_heads, int64_t dim,
                  float eps, float scale, const void* cos, const void* sin, void* cache,
                  int64_t cache_stride, int64_t num_blocks, int64_t block_size,
                  const int64_t* slots, const int64_t* tables, int64_t table_width,
                  const int64_t* lens, void* const* work, void* scratch, int threads) {
  if (dtype != 0 && dtype != 1) return 100 + dtype;
  const Step s{dtype, rows, hidden, heads, kv_heads, dim, eps, scale, cos, sin, slots,
               tables, lens, table_width, num_blocks, block_size, scratch, threads};
  const Work w{work[0], work[1], work[2], work[3], work[4]};
  const auto* specs = reinterpret_cast<const LayerSpec*>(spec);
  const int64_t size = dtype == 0 ? 4 : 2;
  for (int64_t i = 0; i < layers; ++i) {
    char* layer_cache = static_cast<char*>(cache) + i * cache_stride * size;
    const int code = layer(s, specs[i], w, layer_cache, residual, y, i == 0);
    if (code) return code;
  }
  return 0;
}

}  // extern "C"

// Greedy sampling in two passes over each row of float32 logits: the largest logit (its first
// index, as torch.argmax picks it), then the log-sum-exp, for the token's log-probability.
// For 32 x 4096 logits on one thread: ~70 us, where torch's argmax alone (a scalar loop) took
// ~240 and argmax, log_softmax and gather together ~340. Rows go to threads once there are
// 128k logits (SmolLM2's 32 x 49,152 on an AMD EPYC: 407 -> 210 us on two).

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "cpu_common.h"

namespace {

float row_max(const float* x, int64_t n) {
  float top = -INFINITY;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 tops = _mm512_set1_ps(-INFINITY);
  for (; i + 16 <= n; i += 16) tops = _mm512_max_ps(tops, _mm512_loadu_ps(x + i));
  top = _mm512_reduce_max_ps(tops);
#endif
  for (; i < n; ++i) top = x[i] > top ? x[i] : top;
  return top;
}

// (first index of `top`, sum of exp(x - top)) of one row.
void pick_and_sum(const float* x, int64_t n, float top, int64_t* index, float* sum) {
  int64_t first = -1, i = 0;
  float total = 0.f;
#if defined(__AVX512F__)
  const __m512 tops = _mm512_set1_ps(top);
  __m512 totals = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    if (first < 0) {
      const __mmask16 hit = _mm512_cmp_ps_mask(v, tops, _CMP_EQ_OQ);
      if (hit) first = i + __builtin_ctz(hit);
    }
    totals = _mm512_add_ps(totals, exp16(_mm512_sub_ps(v, tops)));
  }
  total = _mm512_reduce_add_ps(totals);
#endif
  for (; i < n; ++i) {
    if (first < 0 && x[i] == top) first = i;
    total += vector_exp(x[i] - top);
  }
  *index = first < 0 ? 0 : first;  // a row of NaNs: token 0
  *sum = total;
}

}  // namespace

extern "C" {

// logits [rows, vocab] float32, contiguous. tokens[r]: the argmax; logprobs[r]: its
// log-probability under softmax(logits[r]). Returns 0, as every kernel here returns a code.
int greedy_pick(const float* logits, int64_t rows, int64_t vocab, int64_t* tokens,
                float* logprobs, int threads) {
#pragma omp parallel for num_threads(threads) if (rows > 1 && rows * vocab >= (1 << 17))
  for (int64_t r = 0; r < rows; ++r) {
    const float* x = logits + r * vocab;
    const float top = row_max(x, vocab);
    float sum;
    pick_and_sum(x, vocab, top, tokens + r, &sum);
    logprobs[r] = x[tokens[r]] - top - std::log(sum);
  }
  return 0;
}

}  // extern "C"

// Sampling without sorting the vocabulary: temperature, min-p, top-k and top-p, drawing the
// token the torch sampler (runtime/worker/sampler.py) draws from the same uniform number. That
// sampler sorts the probabilities (most likely first, equal ones by index), cuts the sorted
// list after min-p, top-k and top-p, and inverts the cumulative mass. Every kept set is a
// prefix of that order, so each step is "the first token in the order whose running count or
// mass reaches a threshold". Here the order is found a bin at a time: tokens are binned by the
// top bits of their probability's bit pattern (positive floats order as their patterns do),
// the bins walked from the top with their counts and masses, and only the bin where the
// threshold is reached is sorted. A row of 32k probabilities takes a few passes instead of a
// sort (~3 ms a row on one thread). Masses are float64, as the torch sampler's are.

namespace {

constexpr int kShift = 19;  // a bin: 8 exponent bits and 4 mantissa bits, 1/16 of a binade
constexpr int kBins = (0x3F800000 >> kShift) + 1;  // no probability lies above 1.0

// The end of a kept prefix: tokens more likely than `value`, or as likely and not later.
struct Cut {
  float value;
  int64_t index;
};

inline bool is_kept(float p, int64_t i, Cut cut) {
  return p > cut.value || (p == cut.value && i <= cut.index);
}

inline int bin_of(float p) {  // NaN (a model that overflowed) and above 1.0: the top bin
  uint32_t bits;
  std::memcpy(&bits, &p, sizeof bits);
  return std::min(int((bits & 0x7fffffffu) >> kShift), kBins - 1);
}

inline Cut earlier(Cut a, Cut b) {  // the cut that keeps fewer tokens
  return (b.value > a.value || (b.value == a.value && b.index < a.index)) ? b : a;
}

// One row's probabilities, binned; scratch reused across rows (one per thread).
int64_t first_index_of(const float* x, int64_t n, float value) {
  for (int64_t i = 0; i < n; ++i)
    if (x[i] == value) return i;
  return 0;  // a row of NaNs: token 0, as greedy_pick
}

class Row {
 public:
  // softmax(x / t) as torch computes it (max subtracted, float32 sum), then the bins.
  void fill(const float* x, int64_t n, float t, float top) {
    n_ = n;
    p_.resize(n);
    bin_.resize(n);
    float total = 0.f;
#pragma omp simd reduction(+ : total)
    for (int64_t i = 0; i < n; ++i) {
      const float d = x[i] / t - top;
      p_[i] = d < -87.f ? 0.f : vector_exp(d);  // exp(-inf): 0, a masked token stays out
      total += p_[i];
    }
    top_ = 1.f / total;  // exp(0) / total, as torch scales: by the reciprocal
    count_.assign(kBins, 0);
    mass_.assign(kBins, 0.0);
    for (int64_t i = 0; i < n; ++i) {
      p_[i] *= top_;
      const int b = bin_of(p_[i]);
      bin_[i] = uint16_t(b);
      count_[b] += 1;
      mass_[b] += p_[i];
    }
  }

  float most_likely() const { return top_; }

  // Mass of the tokens `cut` keeps.
  double kept_mass(Cut cut) {
    const int last = bin_of(cut.value);
    double mass = 0.0;
    for (int b = kBins - 1; b > last; --b) mass += mass_[b];
    for (const auto& [p, i] : members(last, cut)) mass += p;
    return mass;
  }

  // The first kept token, in the sampler's order, at which the running count (by_mass false)
  // or mass reaches `threshold` (exceeds it, if strict); the last kept token if none does.
  Cut first_reaching(Cut cut, bool by_mass, double threshold, bool strict) {
    const int last = bin_of(cut.value);
    double before = 0.0;
    for (int b = kBins - 1; b >= last; --b) {
      const double whole = by_mass ? mass_[b] : double(count_[b]);
      if (b > last && whole == 0.0) continue;
      if (b > last && !reaches(before + whole, threshold, strict)) {
        before += whole;
        continue;
      }
      const auto& sorted = members(b, cut);
      for (const auto& [p, i] : sorted) {
        before += by_mass ? double(p) : 1.0;
        if (reaches(before, threshold, strict)) return {p, i};
      }
      if (b == last) break;
    }
    return last_kept(cut);
  }

 private:
  static bool reaches(double total, double threshold, bool strict) {
    return strict ? total > threshold : total >= threshold;
  }

  // The kept tokens of bin b, most likely first, equal ones by index.
  const std::vector<std::pair<float, int64_t>>& members(int b, Cut cut) {
    members_.clear();
    for (int64_t i = 0, left = count_[b]; i < n_ && left > 0; ++i) {
      if (bin_[i] != b) continue;
      left -= 1;
      if (is_kept(p_[i], i, cut)) members_.emplace_back(p_[i], i);
    }
    std::sort(members_.begin(), members_.end(), [](const auto& a, const auto& b) {
      return a.first > b.first || (a.first == b.first && a.second < b.second);
    });
    return members_;
  }

  Cut last_kept(Cut cut) {
    for (int b = bin_of(cut.value); b < kBins; ++b) {
      if (count_[b] == 0) continue;
      const auto& sorted = members(b, cut);
      if (!sorted.empty()) return {sorted.back().first, sorted.back().second};
    }
    return {top_, 0};  // unreachable: the most likely token is always kept
  }

  int64_t n_ = 0;
  float top_ = 0.f;
  std::vector<float> p_;
  std::vector<uint16_t> bin_;
  std::vector<int32_t> count_;
  std::vector<double> mass_;
  std::vector<std::pair<float, int64_t>> members_;
};

int64_t sample_row(Row& row, const float* x, int64_t n, float t, int64_t top_k, float top_p,
                   float min_p, double u) {
  const float top = row_max(x, n);
  if (!(t > 0.f) || !std::isfinite(top)) return first_index_of(x, n, top);
  row.fill(x, n, t, top / t);
  // min-p, against the most likely token: every token at or above the threshold stays
  Cut cut{min_p * row.most_likely(), n - 1};
  if (top_k > 0 && top_k < n)  // ranked over all tokens, before anything is dropped
    cut = earlier(cut, row.first_reaching({0.f, n - 1}, false, double(top_k), false));
  if (top_p < 1.f)  // the last kept token whose mass before it is under top_p of the kept
    cut = earlier(cut, row.first_reaching(cut, true, double(top_p) * row.kept_mass(cut), false));
  const Cut drawn = row.first_reaching(cut, true, u * row.kept_mass(cut), true);
  return drawn.index;
}

}  // namespace

extern "C" {

// logits [rows, vocab] float32, rows `stride` apart; per row the temperature (0: greedy),
// top-k (0: all), top-p, min-p and a uniform number in (0, 1). tokens[r]: the token drawn.
int sample_pick(const float* logits, int64_t stride, int64_t rows, int64_t vocab,
                const float* temperatures,
                const int64_t* top_ks, const float* top_ps, const float* min_ps,
                const double* uniforms, int64_t* tokens, int threads) {
#pragma omp parallel num_threads(threads) if (rows > 1 && threads > 1)
  {
    Row row;
#pragma omp for schedule(dynamic, 1)
    for (int64_t r = 0; r < rows; ++r)
      tokens[r] = sample_row(row, logits + r * stride, vocab, temperatures[r], top_ks[r],
                             top_ps[r], min_ps[r], uniforms[r]);
  }
  return 0;
}

}  // extern "C"

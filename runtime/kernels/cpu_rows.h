// A loop over rows that enters an OpenMP region only when it spreads the rows over threads.
//
// `#pragma omp parallel for if (false)` still calls into libgomp, which builds and frees a
// team of one thread for it: ~0.8 us a call on an AMD EPYC, nested in a decode step's thread
// team (cpu_team.h) as much, against ~0.05 us for the loop of a one-row norm. A one-row decode
// step of SmolLM2 calls the small kernels ~210 times (norms, rotary, SiLU, attention), all on
// its calling thread.

#pragma once

#include <cstdint>

namespace {

// body(i) for each i in [0, n): over `threads` OpenMP threads if `spread` and threads > 1,
// else in order on the calling thread. Each row's results are the same either way.
template <typename F>
inline void for_rows(int64_t n, int threads, bool spread, F body) {
  if (spread && threads > 1) {
#pragma omp parallel for num_threads(threads)
    for (int64_t i = 0; i < n; ++i) body(i);
  } else {
    for (int64_t i = 0; i < n; ++i) body(i);
  }
}

}  // namespace

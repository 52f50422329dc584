// Threads that share a decode step's products without waiting for each other to start
// (cpu_decode.cpp).
//
// An OpenMP region ends when every thread of its team has arrived. On a machine whose cores
// the server's other processes share, one of the step's threads is preempted for each
// token's burst of their work (~1-1.5 ms of CPU on 2 cores: the scheduler's, the API's, the
// client's), and the others wait at the next of the step's ~150 joins for as long. Here the
// calling thread posts each product as one part a thread, multiplies the first, and then
// takes every part no helper has claimed yet: a helper that is not running when a product
// is posted costs nothing, the caller streams on without it. Only a helper preempted in the
// middle of its part is waited for. A part is one contiguous range of the weights, as each
// thread's share of an OpenMP loop is (the prefetchers follow one stream a thread).
//
// `next_` holds the product's number (its epoch) and its next unclaimed part in one word, so
// that a claim is one compare-exchange that fails once the caller has posted another
// product; the next product is posted only once every part of this one is done, so a
// claimed product's description stays valid while its part runs.

#pragma once

#include <sched.h>

#include <atomic>
#include <cstdint>

namespace {

inline void spin_pause() {
#if defined(__x86_64__)
  __builtin_ia32_pause();
#endif
}

class StepTeam {
 public:
  using Run = void (*)(const void* job, int64_t begin, int64_t end);

  explicit StepTeam(int threads) : parts_(threads) {}

  // Caller: run(job, 0, end), part by part, with whichever helpers claim parts first.
  void share(Run run, const void* job, int64_t end) {
    job_ = Job{run, job, end};
    done_.store(0, std::memory_order_relaxed);
    epoch_ += 1;
    next_.store(epoch_ << kPartBits | 1, std::memory_order_release);  // part 0: the caller's
    int64_t own = 1;
    run_part(job_, 0);
    for (int64_t part; (part = claim(epoch_)) >= 0; ++own) run_part(job_, part);
    while (own + int64_t(done_.load(std::memory_order_acquire)) < parts_) spin_pause();
  }

  // Helper: parts of whichever products it finds posted, until the caller calls finish().
  void help() {
    for (uint64_t idle = 1; !finished_.load(std::memory_order_acquire); ++idle) {
      const uint64_t word = next_.load(std::memory_order_acquire);
      const int64_t part = (word & kPartMask) < uint64_t(parts_) ? claim(word >> kPartBits) : -1;
      if (part < 0) {
        // a long wait (~0.5 ms: more threads than cores?) lets whatever else is ready run
        if (idle % kSpinsBeforeYield == 0) sched_yield();
        spin_pause();
        continue;
      }
      idle = 0;
      const Job job = job_;
      run_part(job, part);
      done_.fetch_add(1, std::memory_order_release);
    }
  }

  void finish() { finished_.store(true, std::memory_order_release); }

 private:
  static constexpr int kPartBits = 16;
  static constexpr uint64_t kSpinsBeforeYield = 1 << 14;
  static constexpr uint64_t kPartMask = (uint64_t(1) << kPartBits) - 1;

  struct Job {
    Run run;
    const void* job;
    int64_t end;
  };

  void run_part(const Job& job, int64_t part) const {
    job.run(job.job, job.end * part / parts_, job.end * (part + 1) / parts_);
  }

  // The next unclaimed part of product `epoch`, now this thread's; -1 if none is left (or
  // another product has been posted since).
  int64_t claim(uint64_t epoch) {
    uint64_t word = next_.load(std::memory_order_acquire);
    while (word >> kPartBits == epoch && (word & kPartMask) < uint64_t(parts_))
      if (next_.compare_exchange_weak(word, word + 1, std::memory_order_acq_rel))
        return int64_t(word & kPartMask);
    return -1;
  }

  const int64_t parts_;
  uint64_t epoch_ = 0;  // the caller's alone
  Job job_{};
  alignas(64) std::atomic<uint64_t> next_{kPartMask};  // nothing to claim before a post
  alignas(64) std::atomic<uint64_t> done_{0};  // parts the helpers finished of this product
  alignas(64) std::atomic<bool> finished_{false};
};

}  // namespace

// A persistent thread pool for the native decode layers (cpu_decode.cpp): one job per forward.
//
// `run(n, f)` calls f(tid) on n threads, the caller being tid 0, and returns when all are done;
// inside f, `barrier()` waits for the job's other threads (every phase of a layer ends in one).
// Threads are started once and kept: between jobs a worker spins for a short while (the next
// decode step usually comes within that), then sleeps on a condition variable, so an idle engine
// costs no CPU. Barriers spin with `pause`, then yield, so a thread whose partner lost its core to
// another process gives the core up instead of burning it.

#pragma once

#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>
#if defined(__x86_64__)
#include <immintrin.h>
#endif

namespace dsa {

inline void relax() {
#if defined(__x86_64__)
  _mm_pause();
#endif
}

// Spin `spins` rounds on `done()`, then yield between checks.
template <typename F>
inline void wait_until(const F& done, int64_t spins) {
  for (int64_t i = 0; !done(); ++i) {
    if (i < spins) {
      relax();
    } else {
      std::this_thread::yield();
    }
  }
}

class Pool {
 public:
  static constexpr int64_t kBarrierSpins = 1 << 12;  // ~0.1 ms before yielding
  static constexpr int64_t kIdleSpins = 1 << 14;  // ~0.4 ms between jobs, then sleep

  void run(int n, const std::function<void(int)>& f) {
    if (n <= 1) {
      n_ = 1;
      f(0);
      return;
    }
    if (pid_ != getpid()) forget_workers();  // a forked child has none of the parent's threads
    while (static_cast<int>(workers_.size()) < n - 1) {
      // the generation before this job's: a worker that starts late still takes this job
      const int tid = static_cast<int>(workers_.size()) + 1;
      const uint64_t seen = generation_.load(std::memory_order_acquire);
      workers_.emplace_back([this, tid, seen] { work(tid, seen); });
    }
    job_ = &f;
    n_ = n;
    done_.store(0, std::memory_order_relaxed);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    f(0);
    wait_until([&] { return done_.load(std::memory_order_acquire) == n - 1; }, kBarrierSpins);
    job_ = nullptr;
  }

  // Every thread of the running job waits here until all have arrived.
  void barrier() {
    if (n_ <= 1) return;
    const uint64_t phase = phase_.load(std::memory_order_acquire);
    if (arrived_.fetch_add(1, std::memory_order_acq_rel) == n_ - 1) {
      arrived_.store(0, std::memory_order_relaxed);
      phase_.store(phase + 1, std::memory_order_release);
      return;
    }
    wait_until([&] { return phase_.load(std::memory_order_acquire) != phase; }, kBarrierSpins);
  }

  int threads() const { return n_; }

 private:
  void work(int tid, uint64_t seen) {
    bool busy = false;  // took part in the last job: spin for the next one before sleeping
    for (;;) {
      const auto fresh = [&] { return generation_.load(std::memory_order_acquire) != seen; };
      if (busy) {
        for (int64_t i = 0; i < kIdleSpins && !fresh(); ++i) relax();
      }
      if (!fresh()) {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, fresh);
      }
      seen = generation_.load(std::memory_order_acquire);
      busy = tid < n_;
      if (busy) {
        (*job_)(tid);
        done_.fetch_add(1, std::memory_order_acq_rel);
      }
    }
  }

  void forget_workers() {
    for (auto& w : workers_) w.detach();
    workers_.clear();
    pid_ = getpid();
  }

  std::vector<std::thread> workers_;
  const std::function<void(int)>* job_ = nullptr;
  int n_ = 1;
  pid_t pid_ = getpid();
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> done_{0};
  std::atomic<int> arrived_{0};
  std::atomic<uint64_t> phase_{0};
  std::mutex mutex_;
  std::condition_variable wake_;
};

// The process's pool, never destroyed (its threads end with the process).
inline Pool& pool() {
  static Pool* p = new Pool();
  return *p;
}

// [begin, end) of part `part` of `n` equal parts of [0, total), in units of `unit`.
inline std::pair<int64_t, int64_t> share(int64_t total, int part, int n, int64_t unit = 1) {
  const int64_t units = (total + unit - 1) / unit;
  const int64_t b = units * part / n * unit, e = units * (part + 1) / n * unit;
  return {std::min(b, total), std::min(e, total)};
}

}  // namespace dsa

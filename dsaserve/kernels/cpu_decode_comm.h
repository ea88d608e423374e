// The native decode step's collectives between the CPU ranks of one node (--tp / --ep), over the
// shared-memory file that distributed/shm_comm.py maps: the same layout and protocol, so the
// step's all-reduces and all-gathers continue the Python group's sequence of messages (the rank
// rounds' headers use it between steps) without leaving the C++ call.
//
// Layout (shm_comm.py): per rank a 128-byte line [sequence, size of area 0, size of area 1, ...],
// then two data areas of one SLOT_BYTES slot per rank. A message: write this rank's part into
// its slot of area seq % 2, publish its size and then the sequence number (release), wait until
// every rank has published it (acquire), check that every rank sent as many bytes, read the
// slots. Sums run in rank order on every rank, so every rank gets the same bits.
//
// A rank that does not arrive within the timeout (it died; the watchdog will say which) sets
// `error`: the step's threads finish their phases on whatever the buffers hold and
// cpu_decode.cpp raises after the job, instead of throwing inside the thread pool.

#pragma once

#include <sched.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstring>
#include <string>
#include <thread>

#include "cpu_decode_pool.h"

namespace dsa {

class Comm {
 public:
  static constexpr int64_t kSlotBytes = 1 << 20;  // shm_comm.SLOT_BYTES
  static constexpr int64_t kFlagStride = 16;  // shm_comm.FLAG_STRIDE (int64s per rank's line)
  static constexpr int64_t kSpin = 2000;  // shm_comm.SPIN
  static constexpr double kYieldSeconds = 0.005, kMaxSleepSeconds = 0.002;

  Comm() = default;
  Comm(uint8_t* base, int64_t size, int64_t index, double timeout)
      : base_(base), size_(size), index_(index), timeout_(timeout) {}

  bool active() const { return size_ > 1; }
  int64_t size() const { return size_; }
  int64_t index() const { return index_; }

  // x [n] summed over the group, in place.
  void all_reduce(float* x, int64_t n) {
    const int64_t per = kSlotBytes / static_cast<int64_t>(sizeof(float));
    for (int64_t at = 0; at < n; at += per) {
      const int64_t m = std::min(per, n - at);
      const float* const* slots = exchange(x + at, m * sizeof(float));
      if (!slots) return;
      for (int64_t i = 0; i < m; ++i) {
        float sum = slots[0][i] + slots[1][i];
        for (int64_t r = 2; r < size_; ++r) sum += slots[r][i];
        x[at + i] = sum;
      }
    }
  }

  // Every rank's x [n] into out [size, n], in rank order.
  void all_gather(const float* x, int64_t n, float* out) {
    const int64_t per = kSlotBytes / static_cast<int64_t>(sizeof(float));
    for (int64_t at = 0; at < n; at += per) {
      const int64_t m = std::min(per, n - at);
      const float* const* slots = exchange(x + at, m * sizeof(float));
      if (!slots) return;
      for (int64_t r = 0; r < size_; ++r) std::copy_n(slots[r], m, out + r * n + at);
    }
  }

  int64_t seq = 0;  // the last message's sequence number (the Python group's, handed over)
  double waited = 0;  // seconds spent waiting for the other ranks (ParallelState.comm_seconds)
  std::string error;  // set when a collective failed: every later one returns at once

 private:
  int64_t* line(int64_t r) const { return reinterpret_cast<int64_t*>(base_) + r * kFlagStride; }
  uint8_t* slot(int64_t area, int64_t r) const {
    return base_ + size_ * kFlagStride * 8 + (area * size_ + r) * kSlotBytes;
  }

  // Publish `bytes` of `part`; the group's slots (as floats) or nullptr after a failure.
  const float* const* exchange(const float* part, int64_t bytes) {
    if (!error.empty()) return nullptr;
    ++seq;
    const int64_t area = seq % 2;
    std::memcpy(slot(area, index_), part, bytes);
    __atomic_store_n(line(index_) + 1 + area, bytes, __ATOMIC_RELAXED);
    __atomic_store_n(line(index_), seq, __ATOMIC_RELEASE);
    if (!wait(seq)) return nullptr;
    for (int64_t r = 0; r < size_; ++r) {
      if (__atomic_load_n(line(r) + 1 + area, __ATOMIC_RELAXED) != bytes) {
        error = "shared-memory collective: the group's ranks sent different sizes for one "
                "message (ranks out of step)";
        return nullptr;
      }
      slots_[r] = reinterpret_cast<const float*>(slot(area, r));
    }
    return slots_;
  }

  bool arrived(int64_t s) const {
    for (int64_t r = 0; r < size_; ++r)
      if (__atomic_load_n(line(r), __ATOMIC_ACQUIRE) < s) return false;
    return true;
  }

  // shm_comm.ShmGroup._wait: spin, then yield the core, then sleep in growing steps.
  bool wait(int64_t s) {
    if (arrived(s)) return true;
    const auto start = std::chrono::steady_clock::now();
    const auto seconds = [&] {
      return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    };
    for (int64_t polls = 0; !arrived(s); ++polls) {
      if (polls < kSpin) {
        relax();
        continue;
      }
      const double so_far = seconds();
      if (so_far > timeout_) {
        error = "shared-memory collective: a rank of the group did not arrive within " +
                std::to_string(timeout_) + "s";
        return false;
      }
      if (so_far < kYieldSeconds) {
        sched_yield();
      } else {
        const double pause = std::min(kMaxSleepSeconds, 0.05 * so_far);
        std::this_thread::sleep_for(std::chrono::duration<double>(pause));
      }
    }
    waited += seconds();
    return true;
  }

  uint8_t* base_ = nullptr;
  int64_t size_ = 1, index_ = 0;
  double timeout_ = 0;
  const float* slots_[64] = {};
};

}  // namespace dsa

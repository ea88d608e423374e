// The "columns" phases of the native decode step: a list of linears over a batch's rows, their
// output columns dealt to the threads in blocks of 4 by cost (columns x rows x inputs), so a
// phase of several small linears (a router beside a shared expert, the busy routed experts)
// splits as evenly as one large one.

#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "cpu_decode_math.h"

namespace dsa {

// Rows of a batch: row t at base + index[t] * stride (index absent: t * stride).
struct RowsRef {
  const float* base = nullptr;
  int64_t stride = 0;
  const int64_t* index = nullptr;
  const float* at(int64_t t) const { return base + (index ? index[t] : t) * stride; }
};

// y[t][o] = x[t] . w[o] (+ bias) for o in [o0, o1), 64 rows at a time.
inline void linear_ref(const RowsRef& x, int64_t rows, const Mat& w, int64_t o0, int64_t o1,
                       float* y, int64_t y_stride) {
  const float* xs[64];
  float* ys[64];
  for (int64_t t0 = 0; t0 < rows; t0 += 64) {
    const int64_t n = std::min<int64_t>(64, rows - t0);
    for (int64_t t = 0; t < n; ++t) {
      xs[t] = x.at(t0 + t);
      ys[t] = y + (t0 + t) * y_stride;
    }
    linear_rows(xs, n, w, o0, o1, ys);
  }
}

struct Job {
  Mat w;
  int64_t rows = 0;
  RowsRef x;
  float* y = nullptr;  // [rows, w.rows]
  int64_t y_stride = 0;
  // pairs: w is [gate | up] (2 I rows); unit i makes gate i and up i, then act[t][i] =
  // silu(gate) * up, so the thread that wrote a pair is the one that reads it.
  bool pairs = false;
  float* act = nullptr;
  int64_t act_stride = 0;
  // residual: after its columns, residual[t][o] += y[t][o] (the o_proj's x + attention).
  float* residual = nullptr;
  int64_t residual_stride = 0;

  static Job linear(const Mat& w, int64_t rows, const float* x, int64_t x_stride, float* y,
                    int64_t y_stride) {
    Job j;
    j.w = w;
    j.rows = rows;
    j.x.base = x;
    j.x.stride = x_stride;
    j.y = y;
    j.y_stride = y_stride;
    return j;
  }

  int64_t units() const { return pairs ? w.rows / 2 : w.rows; }
  int64_t unit_cost() const { return (pairs ? 2 : 1) * w.cols * std::max<int64_t>(rows, 1); }

  void run(int64_t u0, int64_t u1) const {
    if (u0 >= u1 || rows == 0) return;
    if (!pairs) {
      linear_ref(x, rows, w, u0, u1, y, y_stride);
      if (residual)
        for (int64_t t = 0; t < rows; ++t)
          for (int64_t o = u0; o < u1; ++o)
            residual[t * residual_stride + o] += y[t * y_stride + o];
      return;
    }
    const int64_t inner = w.rows / 2;
    linear_ref(x, rows, w, u0, u1, y, y_stride);
    linear_ref(x, rows, w, inner + u0, inner + u1, y, y_stride);
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t i = u0; i < u1; ++i)
        act[t * act_stride + i] = silu_mul(y[t * y_stride + i], y[t * y_stride + inner + i]);
  }
};

// This thread's share of `jobs`: blocks of 4 units, each to the thread whose share of the total
// cost holds the block's start.
inline void run_jobs(const Job* jobs, size_t n, int tid, int nth) {
  int64_t total = 0;
  for (size_t j = 0; j < n; ++j) total += jobs[j].units() * jobs[j].unit_cost();
  const int64_t lo = total * tid / nth, hi = total * (tid + 1) / nth;
  int64_t start = 0;  // the cost before job j
  for (size_t j = 0; j < n; ++j) {
    const Job& job = jobs[j];
    const int64_t block = 4 * job.unit_cost(), units = job.units();
    if (units == 0) continue;
    const auto first = [&](int64_t cost) {  // the first block starting at or after `cost`
      return std::clamp<int64_t>((cost - start + block - 1) / block, 0, (units + 3) / 4);
    };
    const int64_t b = first(lo), e = first(hi);
    job.run(std::min(4 * b, units), std::min(4 * e, units));
    start += units * job.unit_cost();
  }
}

}  // namespace dsa

// The FFN half of a native decode layer (cpu_decode_layer.h): the dense MLP or the shared expert,
// the noaux_tc router, and the routed experts, each busy expert over all of its rows at once.

#pragma once

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <vector>

namespace dsa {

// noaux_tc routing of rows [b, e): sigmoid scores; the bias steers the choice only;
// group-limited top-k; the weights renormalised and scaled.
inline void Layer::route(const Ctx& c) const {
  Scratch& w = c.w;
  const auto [b, e] = c.my_all_rows();
  const int64_t per_group = routed / groups;
  thread_local std::vector<float> score, choice, gscore, v;
  thread_local std::vector<int64_t> order, gorder;
  thread_local std::vector<uint8_t> keep;
  score.resize(routed), choice.resize(routed), order.resize(routed);
  gscore.resize(groups), gorder.resize(groups), keep.resize(groups);
  for (int64_t t = b; t < e; ++t) {
    const float* logits = w.router.data() + t * routed;
    for (int64_t x = 0; x < routed; ++x) {
      score[x] = 1.0f / (1.0f + std::exp(-logits[x]));
      choice[x] = score[x] + (router_bias ? router_bias[x] : 0.0f);
    }
    if (groups > 1) {
      for (int64_t g = 0; g < groups; ++g) {
        v.assign(choice.begin() + g * per_group, choice.begin() + (g + 1) * per_group);
        std::partial_sort(v.begin(), v.begin() + 2, v.end(), std::greater<float>());
        gscore[g] = v[0] + v[1];
        gorder[g] = g;
      }
      std::stable_sort(gorder.begin(), gorder.end(),
                       [&](int64_t a, int64_t z) { return gscore[a] > gscore[z]; });
      std::fill(keep.begin(), keep.end(), 0);
      for (int64_t g = 0; g < topk_group; ++g) keep[gorder[g]] = 1;
      for (int64_t x = 0; x < routed; ++x)
        if (!keep[x / per_group]) choice[x] = -std::numeric_limits<float>::infinity();
    }
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int64_t a, int64_t z) { return choice[a] > choice[z]; });
    float total = 0;
    for (int64_t j = 0; j < top_k; ++j) total += score[order[j]];
    // this row's experts in increasing order: the order their outputs are summed in
    std::sort(order.begin(), order.begin() + top_k);
    for (int64_t j = 0; j < top_k; ++j) {
      float weight = score[order[j]];
      if (normalise) weight = weight / (total + 1e-20f);
      w.eidx[t * top_k + j] = order[j];
      w.ew[t * top_k + j] = weight * static_cast<float>(f_[kScaling]);
    }
  }
}

inline void Layer::ffn(const Ctx& c) const {
  Scratch& w = c.w;
  const Step& s = c.s;
  // every group's rows under DP attention (Ctx::gather_groups), else this group's
  const int64_t rows = s.all_rows, hidden = w.hidden, inner = mlp_gate_up.rows / 2;
  thread_local std::vector<Job> jobs;
  jobs.clear();
  Job gate_up = Job::linear(mlp_gate_up, rows, w.h.data(), hidden, w.gu.data(), 2 * inner);
  gate_up.pairs = true;
  gate_up.act = w.act.data();
  gate_up.act_stride = inner;
  jobs.push_back(gate_up);
  if (experts) jobs.push_back(Job::linear(router, rows, w.h.data(), hidden, w.router.data(),
                                          routed));
  run_jobs(jobs.data(), jobs.size(), c.tid, c.nth);
  c.barrier();
  Job down = Job::linear(mlp_down, rows, w.act.data(), inner, w.shared.data(), hidden);
  jobs.clear();
  jobs.push_back(down);
  // Each thread groups the rows by expert itself (the same lists on every thread); under
  // --ep only this rank's experts, [expert_first, expert_first + experts) (where: -1 else).
  thread_local std::vector<int64_t> count, offset, members, where;
  const auto local = [&](int64_t i) { return w.eidx[i] - expert_first; };
  if (experts) {
    route(c);
    c.barrier();
    count.assign(experts, 0);
    for (int64_t i = 0; i < rows * top_k; ++i)
      if (local(i) >= 0 && local(i) < experts) ++count[local(i)];
    offset.assign(experts + 1, 0);
    for (int64_t x = 0; x < experts; ++x) offset[x + 1] = offset[x] + count[x];
    members.resize(rows * top_k);
    where.resize(rows * top_k);
    count.assign(experts, 0);
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t j = 0; j < top_k; ++j) {
        const int64_t x = local(t * top_k + j);
        if (x < 0 || x >= experts) {
          where[t * top_k + j] = -1;
          continue;
        }
        const int64_t at = offset[x] + count[x]++;
        members[at] = t;
        where[t * top_k + j] = at;
      }
    const int64_t e_inner = experts ? exp_down[0].cols : 0;
    for (int64_t x = 0; x < experts; ++x) {
      const int64_t n = offset[x + 1] - offset[x];
      if (n == 0) continue;
      Job j = Job::linear(exp_gate_up[x], n, w.h.data(), hidden,
                          w.egu.data() + offset[x] * 2 * e_inner, 2 * e_inner);
      j.x.index = members.data() + offset[x];
      j.pairs = true;
      j.act = w.eact.data() + offset[x] * e_inner;
      j.act_stride = e_inner;
      jobs.push_back(j);
    }
    run_jobs(jobs.data(), jobs.size(), c.tid, c.nth);
    c.barrier();
    jobs.clear();
    for (int64_t x = 0; x < experts; ++x) {
      const int64_t n = offset[x + 1] - offset[x];
      if (n == 0) continue;
      jobs.push_back(Job::linear(exp_down[x], n, w.eact.data() + offset[x] * e_inner, e_inner,
                                 w.eout.data() + offset[x] * hidden, hidden));
    }
  }
  run_jobs(jobs.data(), jobs.size(), c.tid, c.nth);
  c.barrier();
  // x += routed + shared, routed summed over the row's experts in increasing order. Under
  // --tp / --ep each rank has a part of both: routed + shared is summed over the ranks first.
  const bool split = s.world && s.world->active();
  const auto [b, e] = c.my_all_rows();
  thread_local std::vector<float> sum;
  sum.resize(hidden);
  for (int64_t t = b; t < e; ++t) {
    float* x = w.x.data() + t * hidden;
    float* shared = w.shared.data() + t * hidden;
    if (!experts) {
      if (!split)
        for (int64_t i = 0; i < hidden; ++i) x[i] += shared[i];
      continue;
    }
    std::fill(sum.begin(), sum.end(), 0.0f);
    for (int64_t j = 0; j < top_k; ++j) {
      if (where[t * top_k + j] < 0) continue;  // another rank's expert
      const float* y = w.eout.data() + where[t * top_k + j] * hidden;
      const float weight = w.ew[t * top_k + j];
      for (int64_t i = 0; i < hidden; ++i) sum[i] += y[i] * weight;
    }
    if (split) {
      for (int64_t i = 0; i < hidden; ++i) shared[i] = sum[i] + shared[i];
    } else {
      for (int64_t i = 0; i < hidden; ++i) x[i] += sum[i] + shared[i];
    }
  }
  if (!split) return;
  c.all_reduce(s.world, w.shared.data(), rows * hidden);
  const auto [ob, oe] = c.my_rows();  // this group's rows: [own_begin, ...) of every group's
  const float* mine = w.shared.data() + s.own_begin * hidden;
  for (int64_t i = ob * hidden; i < oe * hidden; ++i) w.x[i] += mine[i];
}

}  // namespace dsa

// One decoder layer of the native decode step (cpu_decode.cpp), phase by phase on the pool.
//
// Each phase is split across the job's threads: "rows" phases by batch row, "columns" phases by
// output columns of a linear over every row (cpu_decode_jobs.h), and a barrier ends each phase
// whose outputs the next reads across threads. The order of every sum is fixed (see
// cpu_decode_math.h), so the thread count never changes a result.

#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "cpu_decode_comm.h"
#include "cpu_decode_indexer.h"
#include "cpu_decode_jobs.h"
#include "cpu_decode_kv.h"
#include "cpu_decode_math.h"
#include "cpu_decode_pool.h"

namespace dsa {

using at::Tensor;

// The order of a layer's tensors, ints and floats (engine/decode/native.py layer_fields); its
// scales are two more tensor lists in Slot order (an FP8 weight's grid, or an NVFP4 one's group
// scales and then its row scales; empty for the others).
enum Slot {
  kInNorm, kWIn, kBIn, kQaNorm, kWQres, kKvNorm, kWUkT, kWUv, kWO, kBO, kPostNorm, kMlpGateUp,
  kMlpDown, kRouter, kRouterBias, kExpGateUp, kExpDown, kIdxNormW, kIdxNormB, kWIdx, kNumSlots
};
enum Int {
  kLayerId, kIndexCache, kQLora, kRank, kRope, kIdxDim, kIdxHeads, kHeads, kNope, kV,
  kIdxInterleave, kTopk, kNGroup, kTopkGroup, kTopK, kNormalise, kExpertFirst, kNumInts
};
enum Float { kInEps, kQaEps, kKvEps, kPostEps, kIdxEps, kScale, kScaling, kNumFloats };

// Weight `t` (matrix `index` of a stack of them), with its scale grid where it is FP8, or its
// e4m3 group scales and per-row global scales (`scale2`) where it is NVFP4 (uint8 codes).
inline Mat mat(const Tensor& t, const Tensor& scale = {}, int64_t index = -1,
               const Tensor& scale2 = {}) {
  Mat m;
  if (!t.defined() || t.numel() == 0) return m;
  const auto type = t.scalar_type();
  TORCH_CHECK(t.is_contiguous() && (type == at::kFloat || type == at::kBFloat16 ||
                                    type == at::kFloat8_e4m3fn || type == at::kByte),
              "native decode weights: contiguous fp32, bf16, float8_e4m3fn or NVFP4 codes");
  m.rows = t.size(-2);
  m.cols = t.size(-1);
  m.kind = type == at::kBFloat16 ? kBF16 : type == at::kFloat8_e4m3fn ? kFP8 : kF32;
  const int64_t at = index < 0 ? 0 : index * m.rows;  // the first row of matrix `index`
  m.data = static_cast<const uint8_t*>(t.data_ptr()) + at * m.cols * t.element_size();
  if (type == at::kByte) {
    m.kind = kNVFP4;
    m.cols *= 2;
    TORCH_CHECK(m.cols % 16 == 0 && scale.defined() &&
                scale.scalar_type() == at::kFloat8_e4m3fn && scale.size(-1) == m.cols / 16 &&
                scale.size(-2) == m.rows && scale2.defined() &&
                scale2.scalar_type() == at::kFloat && scale2.numel() == scale.numel() / scale.size(-1),
                "an NVFP4 weight needs its e4m3 [rows, cols / 16] and fp32 [rows] scales");
    m.scale8 = static_cast<const uint8_t*>(scale.data_ptr()) + at * (m.cols / 16);
    m.scale2 = scale2.data_ptr<float>() + at;
  }
  if (m.kind == kFP8) {
    TORCH_CHECK(scale.defined() && scale.scalar_type() == at::kFloat && scale.is_contiguous(),
                "an FP8 weight needs its fp32 scale grid");
    m.scale_rows = scale.size(-2) == m.rows ? 1 : kScaleBlock;
    m.scale_cols = (m.cols + kScaleBlock - 1) / kScaleBlock;
    TORCH_CHECK(scale.size(-1) == m.scale_cols &&
                scale.size(-2) == (m.rows + m.scale_rows - 1) / m.scale_rows,
                "FP8 scale grid does not fit its weight");
    m.scale = scale.data_ptr<float>() + (index < 0 ? 0 : index * scale.size(-2) * m.scale_cols);
  }
  return m;
}

inline const float* f32(const Tensor& t) {
  if (!t.defined() || t.numel() == 0) return nullptr;
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), "fp32 norm / bias");
  return t.data_ptr<float>();
}

// A candidate of the indexer's top-k as the ranks exchange it (position -1: none).
struct RankCand {
  float score;
  int32_t position;
};

// What one step computes: the batch (from Python) and where its outputs go.
struct Step {
  int64_t rows = 0;
  const int64_t *ids, *positions, *out_slots, *slots, *lengths;
  int64_t slot_stride = 0, half = 0;
  const float *cos, *sin;
  const Tensor *kv_cache, *index_cache;
  float* logits;  // [rows, vocab]
  bool with_logits = true;  // false: the final norm and the taps only
  const std::vector<int64_t>* taps = nullptr;  // layers whose outputs go to `tapped`
  float* tapped = nullptr;  // [rows, taps * hidden]
  // Under --tp / --ep (cpu_decode_comm.h): the attention group's collectives (the o_proj's
  // partial sums, the vocab-parallel embedding) and the world's (the MLP and experts' partial
  // sums, the vocab-parallel logits); inactive on one rank.
  Comm* attn = nullptr;
  Comm* world = nullptr;
  // DP attention: every attention group's rows (`group_rows`, group g's first rank g *
  // `attn_tp`) go through the MLP block and the LM head together; this group's rows are
  // [own_begin, own_begin + rows) of those `all_rows` (one group: all_rows == rows).
  const int64_t* group_rows = nullptr;
  int64_t groups = 1, attn_tp = 1, own_begin = 0, all_rows = 0, most = 0;  // most: the largest
  bool dp() const { return groups > 1; }
};

struct Layer;
struct Head;

// Every buffer of a step, sized once per step for the largest layer (no allocation inside).
struct Scratch {
  std::vector<float> x, h, parts, qres, qp, qfull, iq, iw, scores, ov, attn, router, gu, act,
      shared, ew, egu, eact, eout, vocab_part, gathered;
  std::vector<int64_t> picks, eidx, npicks;  // picks [rows, topk]; npicks: 0 = all keys
  std::vector<std::vector<Cand>> cands;  // [rows * threads]: each thread's share of a row
  std::vector<RankCand> rank_cands;  // --tp: this rank's k best per row, then every rank's
  int64_t hidden = 0, topk = 0, top_k = 0, threads = 1;
  // `rows`: this group's; `all_rows`: every group's (the MLP block's), `most`: the largest
  // group's (DP attention; else both are `rows`).
  void size(const std::vector<Layer>& layers, const Head& head, int64_t rows, int64_t length,
            int threads, int64_t ranks, int64_t all_rows, int64_t most);
};

// A thread's view of the running step.
struct Ctx {
  const Step& s;
  Scratch& w;
  Pool& pool;
  int tid, nth;
  std::pair<int64_t, int64_t> my_rows() const { return share(s.rows, tid, nth); }
  // This thread's share of every group's rows (the MLP block's; this group's alone without DP).
  std::pair<int64_t, int64_t> my_all_rows() const { return share(s.all_rows, tid, nth); }
  void barrier() const { pool.barrier(); }
  // x [n] summed over `comm`'s ranks by thread 0, between two barriers.
  void all_reduce(Comm* comm, float* x, int64_t n) const {
    if (!comm || !comm->active()) return;
    barrier();
    if (tid == 0) comm->all_reduce(x, n);
    barrier();
  }
  // DP attention: x [rows, width] (this group's rows) becomes [all_rows, width], every group's
  // rows in group order (distributed/parallel_state.py gather_groups: each rank sends its
  // rows padded to the largest group's, group g's are taken from its first rank).
  void gather_groups(float* x, int64_t width) const {
    if (!s.dp()) return;
    barrier();
    if (tid == 0 && s.most > 0) {
      float* all = w.gathered.data();  // [world, most, width]
      s.world->all_gather(x, s.most * width, all);
      for (int64_t g = 0, at = 0; g < s.groups; at += s.group_rows[g++])
        std::copy_n(all + g * s.attn_tp * s.most * width, s.group_rows[g] * width, x + at * width);
    }
    barrier();
  }
  const float* cos(int64_t t) const { return s.cos + s.positions[t] * s.half; }
  const float* sin(int64_t t) const { return s.sin + s.positions[t] * s.half; }
};

struct Layer {
  Layer(const std::vector<Tensor>& t, const std::vector<Tensor>& sc, const std::vector<Tensor>& sc2,
        const std::vector<int64_t>& i, const std::vector<double>& f)
      : t_(t), sc_(sc), sc2_(sc2), f_(f) {
    TORCH_CHECK(t.size() == kNumSlots && sc.size() == kNumSlots && sc2.size() == kNumSlots &&
                i.size() == kNumInts && f.size() == kNumFloats, "layer fields");
    layer_id = i[kLayerId], index_cache = i[kIndexCache], q_lora = i[kQLora], rank = i[kRank];
    rope = i[kRope], idx_dim = i[kIdxDim], idx_heads = i[kIdxHeads], heads = i[kHeads];
    nope = i[kNope], v = i[kV], interleave = i[kIdxInterleave] != 0, topk = i[kTopk];
    groups = i[kNGroup], topk_group = i[kTopkGroup], top_k = i[kTopK], normalise = i[kNormalise];
    expert_first = i[kExpertFirst];
    w_in = mat(t[kWIn], sc[kWIn]), w_qres = mat(t[kWQres], sc[kWQres]), w_o = mat(t[kWO], sc[kWO]);
    w_idx = mat(t[kWIdx]);
    w_in.bias = f32(t[kBIn]), w_o.bias = f32(t[kBO]);
    mlp_gate_up = mat(t[kMlpGateUp], sc[kMlpGateUp]), mlp_down = mat(t[kMlpDown], sc[kMlpDown]);
    router = mat(t[kRouter]);
    routed = router.rows;  // every expert's score; this rank holds `experts` from expert_first
    experts = t[kExpGateUp].defined() && t[kExpGateUp].numel() ? t[kExpGateUp].size(0) : 0;
    for (int64_t e = 0; e < experts; ++e) {
      exp_gate_up.push_back(mat(t[kExpGateUp], sc[kExpGateUp], e, sc2[kExpGateUp]));
      exp_down.push_back(mat(t[kExpDown], sc[kExpDown], e, sc2[kExpDown]));
    }
    in_norm = f32(t[kInNorm]), qa_norm = f32(t[kQaNorm]), kv_norm = f32(t[kKvNorm]);
    post_norm = f32(t[kPostNorm]), idx_norm_w = f32(t[kIdxNormW]), idx_norm_b = f32(t[kIdxNormB]);
    router_bias = f32(t[kRouterBias]);
    w_uk_t = mat(t[kWUkT]), w_uv = mat(t[kWUv]);  // per head: [rank, nope], [v, rank]
    qk = nope + rope;
  }

  void forward(const Ctx& c, const Rows& kv, const Rows& keys) const;
  int64_t parts_width() const { return w_in.rows + w_idx.rows; }

  int64_t layer_id, index_cache, q_lora, rank, rope, idx_dim, idx_heads, heads, nope, v, topk;
  int64_t groups, topk_group, top_k, normalise, experts, routed, expert_first, qk;
  bool interleave;
  Mat w_in, w_idx, w_qres, w_o, mlp_gate_up, mlp_down, router, w_uk_t, w_uv;
  std::vector<Mat> exp_gate_up, exp_down;
  const float *in_norm, *qa_norm, *kv_norm, *post_norm, *idx_norm_w, *idx_norm_b, *router_bias;
  std::vector<Tensor> t_, sc_, sc2_;  // keep the weights and scales alive
  std::vector<double> f_;

 private:
  void project(const Ctx& c, const Rows& kv, const Rows& keys) const;
  void queries(const Ctx& c) const;
  void select(const Ctx& c, const Rows& keys) const;
  void merge_ranks(const Ctx& c, Comm* group) const;
  void attend(const Ctx& c, const Rows& kv) const;
  void ffn(const Ctx& c) const;
  void route(const Ctx& c) const;
};

// The embedding before the layers, the final norm and the LM head after them.
struct Head {
  Head() = default;
  // `embed_start`: the first token id of this rank's embedding rows; `vocab`: the whole vocab
  // (this rank's LM head rows are its part of it, padded: layers/linear.py ParallelLMHead).
  Head(const std::vector<Tensor>& t, double eps, int64_t embed_start, int64_t vocab)
      : t_(t), eps(eps), embed_start(embed_start), vocab(vocab) {
    TORCH_CHECK(t.size() == 3, "head: embedding, norm, lm_head");
    embed = mat(t[0]), norm = f32(t[1]), lm = mat(t[2]);
    hidden = lm.cols;
  }

  void embed_rows(const Ctx& c) const {
    const auto [b, e] = c.my_rows();
    for (int64_t t = b; t < e; ++t) {
      float* x = c.w.x.data() + t * hidden;
      const int64_t id = c.s.ids[t] - embed_start;
      if (id < 0 || id >= embed.rows) {  // another rank's part of the vocab
        std::fill_n(x, hidden, 0.0f);
      } else if (embed.kind == kBF16) {
        bf16_to_floats(static_cast<const uint16_t*>(embed.data) + id * hidden, hidden, x);
      } else {
        std::copy_n(static_cast<const float*>(embed.data) + id * hidden, hidden, x);
      }
    }
    c.all_reduce(c.s.attn, c.w.x.data(), c.s.rows * hidden);  // the vocab-parallel parts
  }

  // `normed` runs after this thread's rows are normed (the last layer's tap reads them).
  template <typename F>
  void logits(const Ctx& c, F normed) const {
    const auto [b, e] = c.my_rows();
    for (int64_t t = b; t < e; ++t)
      rms_norm(c.w.x.data() + t * hidden, hidden, norm, eps, c.w.h.data() + t * hidden);
    normed();
    if (!c.s.with_logits) return;  // a verify's states only (the rank rounds' FORWARD)
    c.barrier();
    Comm* world = c.s.world;
    if (!world || !world->active()) {
      Job job = Job::linear(lm, c.s.rows, c.w.h.data(), hidden, c.s.logits, vocab);
      run_jobs(&job, 1, c.tid, c.nth);
      return;
    }
    c.gather_groups(c.w.h.data(), hidden);  // DP attention: every group's rows
    const int64_t rows = c.s.all_rows, part = lm.rows, n = rows * part;
    Job job = Job::linear(lm, rows, c.w.h.data(), hidden, c.w.vocab_part.data(), part);
    run_jobs(&job, 1, c.tid, c.nth);
    c.barrier();
    if (c.tid != 0 || n == 0) return;
    float* all = c.w.vocab_part.data() + n;  // [ranks, rows, part]
    world->all_gather(c.w.vocab_part.data(), n, all);
    for (int64_t r = 0; r < world->size(); ++r) {
      const int64_t width = std::clamp<int64_t>(vocab - r * part, 0, part);
      for (int64_t t = 0; t < c.s.rows; ++t)
        std::copy_n(all + (r * rows + c.s.own_begin + t) * part, width,
                    c.s.logits + t * vocab + r * part);
    }
  }

  std::vector<Tensor> t_;
  double eps = 1e-6;
  Mat embed, lm;
  const float* norm = nullptr;
  int64_t embed_start = 0, vocab = 0, hidden = 0;
};

}  // namespace dsa

#include "cpu_decode_attention.h"
#include "cpu_decode_ffn.h"

namespace dsa {

// x [T, hidden] through the layer, in place. Starts and ends with a "rows" phase, so the
// previous layer's last phase and this one's first need no barrier between them.
inline void Layer::forward(const Ctx& c, const Rows& kv, const Rows& keys) const {
  Scratch& w = c.w;
  const auto [b, e] = c.my_rows();
  for (int64_t t = b; t < e; ++t)
    rms_norm(w.x.data() + t * w.hidden, w.hidden, in_norm, f_[kInEps], w.h.data() + t * w.hidden);
  c.barrier();
  project(c, kv, keys);
  queries(c);
  if (index_cache >= 0) select(c, keys);  // else: the previous full layer's picks
  attend(c, kv);
  for (int64_t t = b; t < e; ++t)
    rms_norm(w.x.data() + t * w.hidden, w.hidden, post_norm, f_[kPostEps],
             w.h.data() + t * w.hidden);
  c.barrier();
  c.gather_groups(w.h.data(), w.hidden);  // DP attention: the MLP block takes every group's
  ffn(c);
}

inline void Scratch::size(const std::vector<Layer>& layers, const Head& head, int64_t rows,
                          int64_t length, int nth, int64_t ranks, int64_t all_rows,
                          int64_t most) {
  hidden = head.hidden;
  int64_t parts_w = 0, qp_w = 0, qfull_w = 0, iq_w = 0, iw_w = 0, ov_w = 0, gu_w = 0;
  int64_t router_w = 0, egu_w = 0, eact_w = 0, act_w = 0, qres_w = 0;
  topk = top_k = 0;
  for (const Layer& L : layers) {
    parts_w = std::max(parts_w, L.parts_width());
    qres_w = std::max(qres_w, L.q_lora);
    qp_w = std::max(qp_w, L.w_qres.rows);
    qfull_w = std::max(qfull_w, L.heads * (L.rank + L.rope));
    iq_w = std::max(iq_w, L.idx_heads * L.idx_dim);
    iw_w = std::max(iw_w, L.idx_heads);
    ov_w = std::max(ov_w, L.heads * L.v);
    gu_w = std::max(gu_w, L.mlp_gate_up.rows);
    act_w = std::max(act_w, L.mlp_gate_up.rows / 2);
    router_w = std::max(router_w, L.routed);
    topk = std::max(topk, L.topk);
    top_k = std::max(top_k, L.top_k);
    if (L.experts) {
      egu_w = std::max(egu_w, L.exp_gate_up[0].rows);
      eact_w = std::max(eact_w, L.exp_down[0].cols);
    }
  }
  const auto fit = [](auto& v, int64_t n) {
    if (static_cast<int64_t>(v.size()) < n) v.resize(n);
  };
  const int64_t all = std::max(rows, all_rows);  // the MLP block's rows
  fit(x, rows * hidden), fit(h, all * hidden), fit(attn, rows * hidden);
  fit(shared, all * hidden), fit(parts, rows * parts_w), fit(qres, rows * qres_w);
  fit(qp, rows * qp_w), fit(qfull, rows * qfull_w), fit(iq, rows * iq_w), fit(iw, rows * iw_w);
  fit(ov, rows * ov_w), fit(gu, all * gu_w), fit(act, all * act_w);
  fit(router, all * router_w), fit(ew, all * top_k), fit(eidx, all * top_k);
  fit(egu, all * top_k * egu_w), fit(eact, all * top_k * eact_w);
  fit(eout, all * top_k * hidden), fit(picks, rows * topk);
  if (ranks > 1) fit(vocab_part, all * head.lm.rows * (1 + ranks));  // this rank's, then all
  if (ranks > 1) fit(gathered, ranks * most * hidden);  // DP attention's gather_groups
  if (ranks > 1) fit(rank_cands, (1 + ranks) * rows * topk);  // the indexer's, under --tp
  scores.resize(rows * length);  // the stride of a row's scores is `length`
  npicks.assign(rows, 0);
  if (static_cast<int64_t>(cands.size()) < rows * nth) cands.resize(rows * nth);
  threads = nth;
}

}  // namespace dsa

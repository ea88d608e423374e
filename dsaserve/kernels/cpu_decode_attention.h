// The attention half of a native decode layer (cpu_decode_layer.h): the projections, the new
// token's latent entry and index key into the pool, the absorbed queries, the indexer's top-k
// and the sparse attention over the selected entries, read where they lie in the pool.

#pragma once

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace dsa {

// parts = h W_in^T (q_a | kv_a | index key | index head weights: the last from W_in, or from
// w_idx where W_in is FP8 and the head weights are not); the new entry and key into the pool;
// q_resid; qp = q_resid W_qres^T (q heads | index q heads).
inline void Layer::project(const Ctx& c, const Rows& kv, const Rows& keys) const {
  Scratch& w = c.w;
  const int64_t rows = c.s.rows, hidden = w.hidden, width = parts_width(), entry = rank + rope;
  const Job in[2] = {Job::linear(w_in, rows, w.h.data(), hidden, w.parts.data(), width),
                     Job::linear(w_idx, rows, w.h.data(), hidden, w.parts.data() + w_in.rows,
                                 width)};
  run_jobs(in, w_idx.rows ? 2 : 1, c.tid, c.nth);
  c.barrier();
  const auto [b, e] = c.my_rows();
  const int64_t half = rope / 2, k_off = q_lora + rank + rope, w_off = k_off + idx_dim;
  const float w_scale = static_cast<float>(std::pow(idx_heads, -0.5) * std::pow(idx_dim, -0.5));
  thread_local std::vector<float> tmp;
  tmp.resize(std::max(entry, idx_dim));
  for (int64_t t = b; t < e; ++t) {
    const float* p = w.parts.data() + t * width;
    rms_norm(p, q_lora, qa_norm, f_[kQaEps], w.qres.data() + t * q_lora);
    rms_norm(p + q_lora, rank, kv_norm, f_[kKvEps], tmp.data());
    rotate(p + q_lora + rank, c.cos(t), c.sin(t), half, true, tmp.data() + rank);
    kv.store(c.s.out_slots[t], tmp.data());
    if (index_cache < 0) continue;
    // LayerNorm of the key (biased variance, as F.layer_norm), then rotary on its first dims.
    const float* k = p + k_off;
    float mean = 0, var = 0;
    for (int64_t i = 0; i < idx_dim; ++i) mean += k[i];
    mean /= idx_dim;
    for (int64_t i = 0; i < idx_dim; ++i) var += (k[i] - mean) * (k[i] - mean);
    const float r = 1.0f / std::sqrt(var / idx_dim + static_cast<float>(f_[kIdxEps]));
    thread_local std::vector<float> normed, key;
    normed.resize(idx_dim);
    key.resize(idx_dim);
    for (int64_t i = 0; i < idx_dim; ++i) normed[i] = (k[i] - mean) * r * idx_norm_w[i] + idx_norm_b[i];
    rotate(normed.data(), c.cos(t), c.sin(t), half, interleave, key.data());
    std::copy(normed.begin() + rope, normed.end(), key.begin() + rope);
    keys.store(c.s.out_slots[t], key.data());
    for (int64_t h = 0; h < idx_heads; ++h) w.iw[t * idx_heads + h] = p[w_off + h] * w_scale;
  }
  c.barrier();
  Job q = Job::linear(w_qres, rows, w.qres.data(), q_lora, w.qp.data(), w_qres.rows);
  run_jobs(&q, 1, c.tid, c.nth);
  c.barrier();
}

// q_full [T, H, rank + rope]: q_nope absorbed through W_UK, q_pe rotated; the index queries.
inline void Layer::queries(const Ctx& c) const {
  Scratch& w = c.w;
  const int64_t entry = rank + rope, half = rope / 2, width = w_qres.rows;
  const int64_t per_row = heads + (index_cache >= 0 ? idx_heads : 0);
  const auto [b, e] = share(c.s.rows * per_row, c.tid, c.nth);
  for (int64_t item = b; item < e; ++item) {
    const int64_t t = item / per_row, h = item % per_row;
    const float* q = w.qp.data() + t * width;
    if (h < heads) {
      float* out = w.qfull.data() + (t * heads + h) * entry;
      Mat uk = w_uk_t;
      uk.data = static_cast<const uint8_t*>(w_uk_t.data) +
                h * rank * nope * w_uk_t.elem_bytes();
      RowsRef x{q + h * qk, 0, nullptr};
      linear_ref(x, 1, uk, 0, rank, out, 0);
      rotate(q + h * qk + nope, c.cos(t), c.sin(t), half, true, out + rank);
    } else {
      const int64_t hi = h - heads;
      const float* src = q + heads * qk + hi * idx_dim;
      float* out = w.iq.data() + (t * idx_heads + hi) * idx_dim;
      rotate(src, c.cos(t), c.sin(t), half, interleave, out);
      std::copy(src + rope, src + idx_dim, out + rope);
    }
  }
  c.barrier();
}

// This rank's k best of a row (fewer where its share of the keys is short, the rest marked by
// position -1), as (score, position) slots of the candidates every rank sends.
inline void share_best(std::vector<Cand>& all, int64_t k, RankCand* out) {
  const int64_t n = std::min<int64_t>(k, all.size());
  std::nth_element(all.begin(), all.begin() + std::max<int64_t>(n - 1, 0), all.end(), better);
  for (int64_t j = 0; j < k; ++j)
    out[j] = j < n ? RankCand{all[j].first, static_cast<int32_t>(all[j].second)} : RankCand{0, -1};
}

// The top-k of each row longer than topk: its keys dealt to the threads (each a range of the
// concatenated rows, scored and reduced to its own k best), then the ranges merged per row.
// Under --tp the attention group's ranks (which hold the same rows and keys) each score their
// share of the keys, and exchange their k best per row before the merge: the same scores and
// the same earliest-wins merge, so the same picks as one rank.
inline void Layer::select(const Ctx& c, const Rows& keys) const {
  Scratch& w = c.w;
  const Step& s = c.s;
  int64_t total = 0;
  for (int64_t t = 0; t < s.rows; ++t) total += s.lengths[t] > topk ? s.lengths[t] : 0;
  Comm* group = s.attn && s.attn->active() ? s.attn : nullptr;
  const int64_t ranks = group ? group->size() : 1, me = group ? group->index() : 0;
  const auto [rlo, rhi] = share(total, static_cast<int>(me), static_cast<int>(ranks), 64);
  auto [lo, hi] = share(rhi - rlo, c.tid, c.nth, 64);  // this thread's part of this rank's
  lo += rlo, hi += rlo;
  int64_t start = 0;
  const int64_t stride = w.scores.size() / std::max<int64_t>(s.rows, 1);
  for (int64_t t = 0; t < s.rows; ++t) {
    const int64_t length = s.lengths[t];
    auto& mine = w.cands[t * c.nth + c.tid];
    mine.clear();
    if (length <= topk) continue;
    const int64_t b = std::clamp(lo - start, int64_t{0}, length);
    const int64_t e = std::clamp(hi - start, int64_t{0}, length);
    start += length;
    if (b >= e) continue;
    float* scores = w.scores.data() + t * stride;
    score_keys(w.iq.data() + t * idx_heads * idx_dim, w.iw.data() + t * idx_heads, keys,
               s.slots + t * s.slot_stride, length, b, e, idx_heads, scores);
    topk_range(scores, b, e, topk, mine);
  }
  c.barrier();
  const auto [rb, re] = c.my_rows();
  thread_local std::vector<Cand> all;
  for (int64_t t = rb; t < re; ++t) {
    w.npicks[t] = s.lengths[t] > topk ? topk : 0;  // 0: the whole context
    if (!w.npicks[t]) continue;
    all.clear();
    for (int k = 0; k < c.nth; ++k) {
      const auto& part = w.cands[t * c.nth + k];
      all.insert(all.end(), part.begin(), part.end());
    }
    if (group) {
      share_best(all, topk, w.rank_cands.data() + t * topk);
    } else {
      merge_topk(all, topk, w.picks.data() + t * w.topk);
    }
  }
  c.barrier();
  if (group && total > 0) merge_ranks(c, group);  // (every rank has the same rows)
}

// Every rank's k best per row, gathered (thread 0), then merged per row into the picks.
inline void Layer::merge_ranks(const Ctx& c, Comm* group) const {
  Scratch& w = c.w;
  const Step& s = c.s;
  const int64_t ranks = group->size(), n = s.rows * topk;
  static_assert(sizeof(RankCand) == 2 * sizeof(float), "two floats a candidate");
  if (c.tid == 0 && n > 0)
    group->all_gather(reinterpret_cast<const float*>(w.rank_cands.data()), 2 * n,
                      reinterpret_cast<float*>(w.rank_cands.data() + n));
  c.barrier();
  const auto [rb, re] = c.my_rows();
  thread_local std::vector<Cand> all;
  for (int64_t t = rb; t < re; ++t) {
    if (!w.npicks[t]) continue;
    all.clear();
    for (int64_t r = 0; r < ranks; ++r) {
      const RankCand* part = w.rank_cands.data() + n + r * n + t * topk;
      for (int64_t j = 0; j < topk; ++j)
        if (part[j].position >= 0) all.emplace_back(part[j].score, part[j].position);
    }
    merge_topk(all, topk, w.picks.data() + t * w.topk);
  }
  c.barrier();
}

// softmax(q . entry * scale) over each row's selected entries (all of its context when it has
// no more than topk), times their latent part, then W_UV: [T, H, v]. Split by (row, head); a
// thread dequantises a row's entries once for all of its heads.
inline void Layer::attend(const Ctx& c, const Rows& kv) const {
  Scratch& w = c.w;
  const Step& s = c.s;
  const int64_t entry = rank + rope;
  const auto [b, e] = share(s.rows * heads, c.tid, c.nth);
  thread_local std::vector<float> buf, p, latent;
  thread_local std::vector<const float*> ptr;
  int64_t loaded = -1;
  for (int64_t item = b; item < e; ++item) {
    const int64_t t = item / heads, h = item % heads;
    const int64_t picked = w.npicks[t];  // the last full layer's (a shared layer has none)
    const int64_t n = picked ? picked : s.lengths[t];
    if (t != loaded) {
      buf.resize(n * entry);
      ptr.resize(n);
      p.resize(n);
      for (int64_t j = 0; j < n; ++j) {
        const int64_t at = picked ? w.picks[t * w.topk + j] : j;
        ptr[j] = kv.load(s.slots[t * s.slot_stride + at], buf.data() + j * entry);
      }
      loaded = t;
    }
    const float* q = w.qfull.data() + (t * heads + h) * entry;
    float top = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) {
      p[j] = dot(q, ptr[j], entry) * static_cast<float>(f_[kScale]);
      top = std::max(top, p[j]);
    }
    float sum = 0;
    for (int64_t j = 0; j < n; ++j) {
      p[j] = std::exp(p[j] - top);
      sum += p[j];
    }
    latent.assign(rank, 0.0f);
    for (int64_t j = 0; j < n; ++j) {
      const float weight = p[j] / sum;
      for (int64_t i = 0; i < rank; ++i) latent[i] += weight * ptr[j][i];
    }
    Mat uv = w_uv;
    uv.data = static_cast<const uint8_t*>(w_uv.data) + h * v * rank * w_uv.elem_bytes();
    RowsRef x{latent.data(), 0, nullptr};
    linear_ref(x, 1, uv, 0, v, w.ov.data() + (t * heads + h) * v, 0);
  }
  c.barrier();
  Job o = Job::linear(w_o, s.rows, w.ov.data(), heads * v, w.attn.data(), w.hidden);
  const bool split = s.attn && s.attn->active();  // this rank's heads: a partial sum
  if (!split) {
    o.residual = w.x.data();
    o.residual_stride = w.hidden;
  }
  run_jobs(&o, 1, c.tid, c.nth);
  if (!split) {
    c.barrier();
    return;
  }
  c.all_reduce(s.attn, w.attn.data(), s.rows * w.hidden);  // (its barriers end the phase)
  const auto [rb, re] = c.my_rows();
  for (int64_t i = rb * w.hidden; i < re * w.hidden; ++i) w.x[i] += w.attn[i];
}

}  // namespace dsa

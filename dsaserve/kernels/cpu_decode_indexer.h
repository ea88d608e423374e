// The DSA indexer's decode half for the native layers: each cached key's score where it lies in
// the pool, and the top-k with equal scores to the earlier position.
//
// score(l) = sum_h w[h] relu(q[h] . k(slots[l])), -inf where the row cannot see key l. Keys are
// read in place (fp32) or dequantised a block at a time (bf16, FP8) into a buffer that stays in
// L1; the block kernel keeps 8 heads to a vector register and several keys in flight, and a
// key's score takes the same operations wherever its block starts (a thread's range included).

#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "cpu_decode_kv.h"
#include "cpu_decode_math.h"

namespace dsa {

// One key's score in plain loops (head counts the vector kernel does not take).
inline float score_key(const float* q, const float* w, const float* key, int64_t heads,
                       int64_t dim) {
  float score = 0;
  for (int64_t h = 0; h < heads; ++h) score += w[h] * std::max(dot(q + h * dim, key, dim), 0.0f);
  return score;
}

#if defined(__AVX2__) && defined(__FMA__)
// KB = 8 / N8 keys against heads = 8 * N8 (qt is q transposed: [dim, heads]): one multiply-add
// per dimension advances 8 heads' dot products; only the weighted head sum is horizontal.
template <int N8>
void score_block8(const float* qt, const float* w, const float* const* key, int n, int64_t dim,
                  float* out) {
  constexpr int KB = 8 / N8;
  __m256 acc[KB][N8];
  for (int j = 0; j < KB; ++j)
    for (int c = 0; c < N8; ++c) acc[j][c] = _mm256_setzero_ps();
  for (int64_t i = 0; i < dim; ++i) {
    __m256 qv[N8];
    for (int c = 0; c < N8; ++c) qv[c] = _mm256_loadu_ps(qt + i * 8 * N8 + 8 * c);
    for (int j = 0; j < KB; ++j) {
      const __m256 kv = _mm256_broadcast_ss(key[j] + i);
      for (int c = 0; c < N8; ++c) acc[j][c] = _mm256_fmadd_ps(qv[c], kv, acc[j][c]);
    }
  }
  float scores[KB];  // every key's (a fixed loop keeps acc in registers), then the n asked for
  for (int j = 0; j < KB; ++j) {
    __m256 sum = _mm256_setzero_ps();
    for (int c = 0; c < N8; ++c)
      sum = _mm256_fmadd_ps(_mm256_loadu_ps(w + 8 * c), _mm256_max_ps(acc[j][c],
                            _mm256_setzero_ps()), sum);  // clang-format off
    const __m128 half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
    const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
    scores[j] = _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
  }
  for (int j = 0; j < n; ++j) out[j] = scores[j];
}
#endif

// Scores of keys [begin, end) of one row into out[begin, end): q [heads, dim], w [heads].
inline void score_keys(const float* q, const float* w, const Rows& keys, const int64_t* slots,
                       int64_t length, int64_t begin, int64_t end, int64_t heads, float* out) {
  const int64_t dim = keys.width;
  constexpr float kNone = -std::numeric_limits<float>::infinity();
  bool vector = false;
#if defined(__AVX2__) && defined(__FMA__)
  vector = heads == 8 || heads == 16 || heads == 32 || heads == 64;
#endif
  const int kb = vector ? static_cast<int>(8 / (heads / 8)) : 1;
  thread_local std::vector<float> qt, buf, zeros;
  buf.resize(kb * dim);
  zeros.assign(dim, 0.0f);
  if (vector) {
    qt.resize(heads * dim);
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < dim; ++i) qt[i * heads + h] = q[h * dim + i];
  }
  const bool fp8 = keys.kind == Kv::kFP8;
  for (int64_t l = begin; l < end; l += kb) {
    const int n = static_cast<int>(std::min<int64_t>(kb, end - l));
    const float* key[8];
    float scale[8];
    for (int j = 0; j < kb; ++j) {
      key[j] = zeros.data();
      if (j >= n || l + j >= length) continue;
      if (fp8) {  // e4m3 values unscaled: relu(s x) = s relu(x), so the scale goes on the score
        const uint8_t* r = keys.row(slots[l + j]);
        std::memcpy(&scale[j], r + dim, 4);
        dequantize(r, dim, 1.0f, buf.data() + j * dim);
        key[j] = buf.data() + j * dim;
      } else {
        key[j] = keys.load(slots[l + j], buf.data() + j * dim);
      }
    }
#if defined(__AVX2__) && defined(__FMA__)
    // the keys 4 blocks on, every line of each: rows come from the page table in any order
    for (int j = 0; j < kb && l + 4 * kb + j < end; ++j) {
      const char* row = reinterpret_cast<const char*>(keys.row(slots[l + 4 * kb + j]));
      for (int64_t b = 0; b < keys.row_bytes; b += 64) _mm_prefetch(row + b, _MM_HINT_T0);
    }
    if (vector) {
      const auto block = heads == 8    ? score_block8<1>
                         : heads == 16 ? score_block8<2>
                         : heads == 32 ? score_block8<4>
                                       : score_block8<8>;
      block(qt.data(), w, key, n, dim, out + l);
    } else {
      for (int j = 0; j < n; ++j) out[l + j] = score_key(q, w, key[j], heads, dim);
    }
#else
    for (int j = 0; j < n; ++j) out[l + j] = score_key(q, w, key[j], heads, dim);
#endif
    if (fp8)
      for (int j = 0; j < n && l + j < length; ++j) out[l + j] *= scale[j];
  }
  for (int64_t l = std::max(begin, length); l < end; ++l) out[l] = kNone;
}

// (score, position): a is better than b when higher, or equal and earlier.
using Cand = std::pair<float, int64_t>;

inline bool better(const Cand& a, const Cand& b) {
  return a.first > b.first || (a.first == b.first && a.second < b.second);
}

// The k best of scores[begin, end) into heap (unordered): one pass in position order with a
// heap of the k best so far, its worst on top; a later key enters only with a strictly higher
// score, so one comparison settles almost every key.
inline void topk_range(const float* scores, int64_t begin, int64_t end, int64_t k,
                       std::vector<Cand>& heap) {
  heap.clear();
  for (int64_t i = begin; i < end; ++i) {
    const float score = scores[i];
    if (static_cast<int64_t>(heap.size()) < k) {
      heap.emplace_back(score, i);
      std::push_heap(heap.begin(), heap.end(), better);
    } else if (score > heap.front().first) {
      std::pop_heap(heap.begin(), heap.end(), better);
      heap.back() = {score, i};
      std::push_heap(heap.begin(), heap.end(), better);
    }
  }
}

// The k best of several ranges' candidates (each range's own k best), positions increasing:
// the same set as one pass over the whole row, since `better` is a total order.
inline void merge_topk(std::vector<Cand>& all, int64_t k, int64_t* out) {
  std::nth_element(all.begin(), all.begin() + (k - 1), all.end(), better);
  for (int64_t j = 0; j < k; ++j) out[j] = all[j].second;
  std::sort(out, out + k);
}

// Positions of the k largest scores of a row (dsaserve/kernels/topk.py topk_earliest, one row).
inline void topk_earliest_row(const float* scores, int64_t length, int64_t k,
                              std::vector<Cand>& heap, int64_t* out) {
  topk_range(scores, 0, length, k, heap);
  for (int64_t j = 0; j < k; ++j) out[j] = heap[j].second;
  std::sort(out, out + k);
}

}  // namespace dsa

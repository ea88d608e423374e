// The decode layers of a DSA MoE model for small all-decode batches on CPU, in one C++ call.
//
// The same math as dsaserve/layers/fused.py (FusedDecode), which stays the reference: a decode
// step at batch 1 costs per-op overhead (a few thousand small PyTorch calls from Python) and
// weight reads (MKL's single-row GEMM streams weights at about a third of this CPU's memory
// bandwidth). Here every layer runs without returning to Python: norms, rotary, routing, the
// indexer's scores and top-k (equal scores: the earlier position wins), the attention over the
// selected entries and the small-batch GEMMs are plain loops reading the pool in place; the
// absorption GEMMs and the larger batches' linears are ATen calls. Built at first use by
// dsaserve/kernels/cpu_decode.py (torch.utils.cpp_extension), used only in fp32.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#if defined(__AVX2__)
#include <immintrin.h>
#endif
#include <limits>
#include <vector>

namespace {

using torch::Tensor;

constexpr int64_t kSmallRows = 8;  // up to this many rows a linear streams its weights itself
// A loop is split across threads only when each thread gets about this much work (multiply-adds):
// below it, waking the other threads costs more than they save.
constexpr int64_t kSplitWork = 1 << 15;

// The threads a forward was given. ATen's own small ops (the absorption GEMMs here) get
// slower, not faster, when split over threads, so a forward runs them on one thread and splits
// only its own large loops over all of them (`split`).
thread_local int g_threads = 1;

class OneThread {
 public:
  OneThread() : threads_(at::get_num_threads()) {
    g_threads = threads_;
    if (threads_ > 1) at::set_num_threads(1);
  }
  ~OneThread() {
    if (threads_ > 1) at::set_num_threads(threads_);
  }

 private:
  int threads_;
};

template <typename F>
void split(int64_t begin, int64_t end, int64_t grain, const F& f) {
  if (g_threads <= 1 || end - begin <= grain) {
    f(begin, end);
    return;
  }
  at::set_num_threads(g_threads);
  at::parallel_for(begin, end, grain, f);
  at::set_num_threads(1);
}

// sum_i a[i] * b[i] in 16 independent lanes (the compiler vectorises them without reordering
// any lane's sum), then the lanes and the tail: the dot product of every plain loop here.
inline float dot(const float* a, const float* b, int64_t n) {
  float acc[16] = {0};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += a[i + j] * b[i + j];
  float s = 0;
  for (int j = 0; j < 16; ++j) s += acc[j];
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

// y[t, o] = sum_i x[t, i] * w[o, i] (+ b[o]) for a few rows t: each weight row is read once.
void small_linear(const float* x, int64_t rows, int64_t in, const float* w, int64_t out,
                  const float* bias, float* y, int64_t y_stride) {
  const int64_t grain = std::max<int64_t>(1, kSplitWork / std::max<int64_t>(1, in * rows));
  split(0, out, grain, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      const float* wr = w + o * in;
      for (int64_t t = 0; t < rows; ++t) {
        const float s = dot(wr, x + t * in, in);
        y[t * y_stride + o] = bias ? s + bias[o] : s;
      }
    }
  });
}

// x [T, in] (contiguous) @ w[out, in]^T (+ b): the loop above for a few rows, MKL beyond.
Tensor linear(const Tensor& x, const Tensor& w, const Tensor& b) {
  const int64_t rows = x.size(0), in = x.size(1), out = w.size(0);
  if (rows > kSmallRows) return b.defined() ? at::linear(x, w, b) : at::linear(x, w);
  Tensor y = torch::empty({rows, out}, x.options());
  small_linear(x.data_ptr<float>(), rows, in, w.data_ptr<float>(), out,
               b.defined() ? b.data_ptr<float>() : nullptr, y.data_ptr<float>(), out);
  return y;
}

// RMSNorm of each row of x [T, n] (row stride `stride`) into out (row stride `out_stride`).
void rms_norm(const float* x, int64_t rows, int64_t n, int64_t stride, const float* w,
              double eps, float* out, int64_t out_stride) {
  for (int64_t t = 0; t < rows; ++t) {
    const float* xr = x + t * stride;
    float ss = 0;
    for (int64_t i = 0; i < n; ++i) ss += xr[i] * xr[i];
    const float r = 1.0f / std::sqrt(ss / n + static_cast<float>(eps));
    for (int64_t i = 0; i < n; ++i) out[t * out_stride + i] = xr[i] * r * w[i];
  }
}

Tensor rms_norm(const Tensor& x, const Tensor& w, double eps) {
  TORCH_CHECK(x.stride(1) == 1, "rms_norm: rows must be contiguous");
  Tensor out = torch::empty({x.size(0), x.size(1)}, x.options());
  rms_norm(x.data_ptr<float>(), x.size(0), x.size(1), x.stride(0), w.data_ptr<float>(), eps,
           out.data_ptr<float>(), x.size(1));
  return out;
}

// Rotary as dsaserve/layers/fused.py `rotation`: out[j] = x[f] cos - x[s] sin,
// out[j + half] = x[s] cos + x[f] sin, with (f, s) = (2j, 2j + 1) interleaved, else (j, j + half).
void rotate(const float* x, const float* cos, const float* sin, int64_t half, bool interleave,
            float* out) {
  for (int64_t j = 0; j < half; ++j) {
    const float a = interleave ? x[2 * j] : x[j];
    const float b = interleave ? x[2 * j + 1] : x[j + half];
    out[j] = a * cos[j] - b * sin[j];
    out[j + half] = b * cos[j] + a * sin[j];
  }
}

// One key's score in plain loops (other head counts, CPUs without AVX2/FMA).
float score_key(const float* q, const float* w, const float* key, int64_t heads, int64_t dim) {
  float score = 0;
  for (int64_t h = 0; h < heads; ++h) score += w[h] * std::max(dot(q + h * dim, key, dim), 0.0f);
  return score;
}

#if defined(__AVX2__) && defined(__FMA__)
// Keys [begin, end) in blocks of 8 / N8 keys, 8 heads to a vector (heads = 8 * N8, N8 <= 8): q
// is transposed (qt [dim, heads]) so that one multiply-add per dimension advances the dot products
// of 8 heads at once, with 8 independent accumulators in flight, and only the final weighted head
// sum is horizontal. A block past `end` is filled with zero keys, so every key's score takes the
// same operations wherever the blocks (and the threads' ranges) start.
template <int N8>
void score_block8(const float* qt, const float* w, const float* cache, const int64_t* slots,
                  const bool* valid, const float* zeros, int64_t begin, int64_t end, int64_t dim,
                  float* out) {
  constexpr int KB = 8 / N8;
  __m256 wv[N8];
  for (int c = 0; c < N8; ++c) wv[c] = _mm256_loadu_ps(w + 8 * c);
  for (int64_t l = begin; l < end; l += KB) {
    const float* key[KB];
    for (int j = 0; j < KB; ++j)
      key[j] = l + j < end && valid[l + j] ? cache + slots[l + j] * dim : zeros;
    if (l + 4 * KB < end && valid[l + 4 * KB])
      _mm_prefetch(reinterpret_cast<const char*>(cache + slots[l + 4 * KB] * dim), _MM_HINT_T0);
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
    for (int j = 0; j < KB && l + j < end; ++j) {
      __m256 sum = _mm256_setzero_ps();
      for (int c = 0; c < N8; ++c)
        sum = _mm256_fmadd_ps(wv[c], _mm256_max_ps(acc[j][c], _mm256_setzero_ps()), sum);
      const __m128 half = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
      const __m128 pair = _mm_add_ps(half, _mm_movehl_ps(half, half));
      out[l + j] = _mm_cvtss_f32(_mm_add_ss(pair, _mm_shuffle_ps(pair, pair, 1)));
    }
  }
}
#endif

// Index scores of keys [begin, end) of one row, read in place from the pool (cache [slots, dim]):
// out[l] = sum_h w[h] relu(q[h] . k(slots[l])), -inf where the row cannot see key l. Reading each
// key once from wherever its page lies, while it is in cache, instead of gathering every key
// into one tensor for a GEMM first: at 60k keys the gather alone cost as much as the scoring.
void score_keys(const float* q, const float* w, const float* cache, const int64_t* slots,
                const bool* valid, int64_t begin, int64_t end, int64_t heads, int64_t dim,
                float* out) {
  bool done = false;
#if defined(__AVX2__) && defined(__FMA__)
  if (heads == 8 || heads == 16 || heads == 32 || heads == 64) {
    std::vector<float> qt(heads * dim), zeros(dim, 0.0f);
    for (int64_t h = 0; h < heads; ++h)
      for (int64_t i = 0; i < dim; ++i) qt[i * heads + h] = q[h * dim + i];
    const auto block = heads == 8    ? score_block8<1>
                       : heads == 16 ? score_block8<2>
                       : heads == 32 ? score_block8<4>
                                     : score_block8<8>;
    block(qt.data(), w, cache, slots, valid, zeros.data(), begin, end, dim, out);
    done = true;
  }
#endif
  if (!done)
    for (int64_t l = begin; l < end; ++l)
      if (valid[l]) out[l] = score_key(q, w, cache + slots[l] * dim, heads, dim);
  for (int64_t l = begin; l < end; ++l)
    if (!valid[l]) out[l] = -std::numeric_limits<float>::infinity();
}

// Positions of the k largest scores of a row, equal scores to the earlier position, in
// increasing position order (dsaserve/layers/topk.py topk_earliest, row by row). One pass in
// position order with a heap of the k best so far, its worst on top (the lowest score; of equal
// scores the later position): a later key enters only with a strictly higher score, so one
// comparison settles almost every key.
void topk_earliest_row(const float* scores, int64_t length, int64_t k,
                       std::vector<std::pair<float, int64_t>>& heap, int64_t* out) {
  const auto better = [](const std::pair<float, int64_t>& a, const std::pair<float, int64_t>& b) {
    return a.first > b.first || (a.first == b.first && a.second < b.second);
  };
  heap.clear();
  for (int64_t i = 0; i < length; ++i) {
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
  for (int64_t j = 0; j < k; ++j) out[j] = heap[j].second;
  std::sort(out, out + k);
}

struct Layer {
  std::vector<Tensor> t;  // the tensors, in the order of the Slot enum
  std::vector<int64_t> i;  // the sizes and switches, in the order of the Int enum
  std::vector<double> f;  // the epsilons and scales, in the order of the Float enum
};

enum Slot {
  kInNorm, kWIn, kBIn, kQaNorm, kWQres, kKvNorm, kWUk, kWUvT, kWO, kBO, kPostNorm, kMlpGateUp,
  kMlpDown, kRouter, kRouterBias, kExpGateUp, kExpDown, kIdxNormW, kIdxNormB, kSlots
};
enum Int {
  kLayerId, kIndexCache, kQLora, kRank, kRope, kIdxDim, kIdxHeads, kHeads, kNope, kVDim,
  kIdxInterleave, kTopk, kNGroup, kTopkGroup, kTopK, kNormalise, kInts
};
enum Float { kInEps, kQaEps, kKvEps, kPostEps, kIdxEps, kScale, kScaling, kFloats };

class DecodeLayers {
 public:
  explicit DecodeLayers(std::vector<std::vector<Tensor>> tensors,
                        std::vector<std::vector<int64_t>> ints,
                        std::vector<std::vector<double>> floats) {
    for (size_t l = 0; l < tensors.size(); ++l) {
      TORCH_CHECK(tensors[l].size() == kSlots && ints[l].size() == kInts &&
                  floats[l].size() == kFloats, "decode layer ", l, ": wrong field count");
      for (Tensor& t : tensors[l])
        if (t.numel() == 0) t = Tensor();  // an empty tensor stands for an absent one
      layers_.push_back({tensors[l], ints[l], floats[l]});
    }
  }

  // x [T, H] through every layer. rot: [T, rope/2] cos and sin; the caches per layer id and
  // indexer cache index; slots/valid [T, Lmax] the rows' padded contexts; out_slots [T].
  Tensor forward(Tensor x, const Tensor& cos, const Tensor& sin,
                 const Tensor& kv_cache, const Tensor& index_cache,
                 const Tensor& slots, const Tensor& valid, const Tensor& out_slots) {
    at::NoGradGuard no_grad;
    OneThread one_thread;
    Tensor selected;  // [T, topk] positions into the padded context, or undefined (dense)
    for (const Layer& layer : layers_) x = run(layer, x, cos, sin, kv_cache, index_cache, slots,
                                               valid, out_slots, selected);
    return x;
  }

 private:
  Tensor run(const Layer& L, const Tensor& x, const Tensor& cos, const Tensor& sin,
             const Tensor& kv_cache, const Tensor& index_cache,
             const Tensor& slots, const Tensor& valid, const Tensor& out_slots,
             Tensor& selected) const {
    const auto& T = L.t;
    const auto& I = L.i;
    const int64_t rows = x.size(0), half = I[kRope] / 2;
    Tensor h = rms_norm(x, T[kInNorm], L.f[kInEps]);
    Tensor parts = linear(h, T[kWIn], T[kBIn]);  // [T, q_lora | rank + rope | dI | nI]
    const int64_t width = parts.size(1);
    Tensor q_resid = rms_norm(parts.narrow(1, 0, I[kQLora]), T[kQaNorm], L.f[kQaEps]);
    Tensor qp = linear(q_resid, T[kWQres], Tensor());  // [T, heads * qk (| nI * dI)]
    const int64_t qk = I[kNope] + I[kRope], heads = I[kHeads];
    const float* c = cos.data_ptr<float>();
    const float* s = sin.data_ptr<float>();

    // The latent entry [latent | rotated k_pe] into the cache.
    const int64_t entry_dim = I[kRank] + I[kRope];
    Tensor entry = torch::empty({rows, entry_dim}, x.options());
    const float* pp = parts.data_ptr<float>();
    float* ep = entry.data_ptr<float>();
    rms_norm(pp + I[kQLora], rows, I[kRank], width, T[kKvNorm].data_ptr<float>(), L.f[kKvEps],
             ep, entry_dim);
    for (int64_t t = 0; t < rows; ++t) {
      rotate(pp + t * width + I[kQLora] + I[kRank], c + t * half, s + t * half, half, true,
             ep + t * entry_dim + I[kRank]);
    }
    const Tensor cache = kv_cache[I[kLayerId]];
    cache.index_copy_(0, out_slots, entry);

    if (I[kIndexCache] >= 0) selected = indexer(L, parts, qp, c, s, index_cache, slots, valid,
                                                out_slots);

    // q_full [T, H, rank + rope]: q_nope absorbed through W_UK, q_pe rotated.
    Tensor q = qp.narrow(1, 0, heads * qk).view({rows, heads, qk});
    Tensor q_lat = at::bmm(q.narrow(2, 0, I[kNope]).transpose(0, 1), T[kWUk]).transpose(0, 1);
    Tensor q_full = torch::empty({rows, heads, entry_dim}, x.options());
    q_full.narrow(2, 0, I[kRank]).copy_(q_lat);
    const float* qptr = qp.data_ptr<float>();
    float* qf = q_full.data_ptr<float>();
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t hd = 0; hd < heads; ++hd)
        rotate(qptr + t * qp.size(1) + hd * qk + I[kNope], c + t * half, s + t * half, half, true,
               qf + (t * heads + hd) * entry_dim + I[kRank]);

    // Attention over each row's top-k entries (or its whole context), absorbed form.
    Tensor out = attend(q_full, cache, slots, valid, selected, I[kRank], L.f[kScale]);
    out = at::bmm(out.transpose(0, 1), T[kWUvT]).transpose(0, 1).reshape({rows, -1});
    Tensor y = x + linear(out.contiguous(), T[kWO], T[kBO]);

    h = rms_norm(y, T[kPostNorm], L.f[kPostEps]);
    return y + ffn(L, h);
  }

  // softmax(q . entry * scale) over each row's allowed entries, times their latent part:
  // [T, H, E] -> [T, H, rank]. Entries are read in place from the pool (no gather).
  static Tensor attend(const Tensor& q_full, const Tensor& cache, const Tensor& slots,
                       const Tensor& valid, const Tensor& selected, int64_t rank, double scale) {
    const int64_t rows = q_full.size(0), heads = q_full.size(1), dim = q_full.size(2);
    const int64_t length = slots.size(1), n = selected.defined() ? selected.size(1) : length;
    Tensor out = torch::zeros({rows, heads, rank}, q_full.options());
    const float* qp = q_full.data_ptr<float>();
    const float* cp = cache.data_ptr<float>();
    const int64_t* sp = slots.data_ptr<int64_t>();
    const bool* vp = valid.data_ptr<bool>();
    const int64_t* pick = selected.defined() ? selected.data_ptr<int64_t>() : nullptr;
    float* op = out.data_ptr<float>();
    const int64_t grain = std::max<int64_t>(1, kSplitWork / std::max<int64_t>(1, 2 * n * dim));
    split(0, rows * heads, grain, [&](int64_t begin, int64_t end) {
      std::vector<float> p(n);
      std::vector<const float*> entry(n);
      for (int64_t th = begin; th < end; ++th) {
        const int64_t t = th / heads;
        const float* q = qp + th * dim;
        float top = -std::numeric_limits<float>::infinity();
        for (int64_t j = 0; j < n; ++j) {
          const int64_t at = pick ? pick[t * n + j] : j;
          entry[j] = nullptr;
          p[j] = -std::numeric_limits<float>::infinity();
          if (!vp[t * length + at]) continue;
          entry[j] = cp + sp[t * length + at] * dim;
          p[j] = dot(q, entry[j], dim) * static_cast<float>(scale);
          top = std::max(top, p[j]);
        }
        float total = 0;
        for (int64_t j = 0; j < n; ++j) {
          p[j] = entry[j] ? std::exp(p[j] - top) : 0.0f;
          total += p[j];
        }
        float* o = op + th * rank;
        for (int64_t j = 0; j < n; ++j) {
          if (!entry[j]) continue;
          const float w = p[j] / total;
          for (int64_t i = 0; i < rank; ++i) o[i] += w * entry[j][i];
        }
      }
    });
    return out;
  }

  Tensor indexer(const Layer& L, const Tensor& parts, const Tensor& qp, const float* c,
                 const float* s, const Tensor& index_cache, const Tensor& slots,
                 const Tensor& valid, const Tensor& out_slots) const {
    const auto& T = L.t;
    const auto& I = L.i;
    const int64_t rows = parts.size(0), width = parts.size(1), dim = I[kIdxDim];
    const int64_t n_heads = I[kIdxHeads], half = I[kRope] / 2, rope = I[kRope];
    const bool inter = I[kIdxInterleave] != 0;
    const int64_t k_off = I[kQLora] + I[kRank] + I[kRope], w_off = k_off + dim;
    const int64_t q_off = I[kHeads] * (I[kNope] + I[kRope]);
    const float* pp = parts.data_ptr<float>();
    const float* qptr = qp.data_ptr<float>();
    const float* nw = T[kIdxNormW].data_ptr<float>();
    const float* nb = T[kIdxNormB].data_ptr<float>();
    Tensor key = torch::empty({rows, dim}, parts.options());
    Tensor q = torch::empty({rows, n_heads, dim}, parts.options());
    Tensor weights = torch::empty({rows, n_heads}, parts.options());
    float* kp = key.data_ptr<float>();
    float* qo = q.data_ptr<float>();
    float* wp = weights.data_ptr<float>();
    std::vector<float> tmp(dim);
    const float w_scale = static_cast<float>(std::pow(n_heads, -0.5) * std::pow(dim, -0.5));
    for (int64_t t = 0; t < rows; ++t) {
      // LayerNorm of the key (biased variance, as F.layer_norm), then rotary on its first dims.
      const float* kr = pp + t * width + k_off;
      float mean = 0;
      for (int64_t i = 0; i < dim; ++i) mean += kr[i];
      mean /= dim;
      float var = 0;
      for (int64_t i = 0; i < dim; ++i) var += (kr[i] - mean) * (kr[i] - mean);
      const float r = 1.0f / std::sqrt(var / dim + static_cast<float>(L.f[kIdxEps]));
      for (int64_t i = 0; i < dim; ++i) tmp[i] = (kr[i] - mean) * r * nw[i] + nb[i];
      rotate(tmp.data(), c + t * half, s + t * half, half, inter, kp + t * dim);
      std::copy(tmp.begin() + rope, tmp.end(), kp + t * dim + rope);
      for (int64_t hd = 0; hd < n_heads; ++hd) {
        const float* qr = qptr + t * qp.size(1) + q_off + hd * dim;
        float* qd = qo + (t * n_heads + hd) * dim;
        rotate(qr, c + t * half, s + t * half, half, inter, qd);
        std::copy(qr + rope, qr + dim, qd + rope);
        wp[t * n_heads + hd] = pp[t * width + w_off + hd] * w_scale;
      }
    }
    const Tensor cache = index_cache[I[kIndexCache]];
    cache.index_copy_(0, out_slots, key);
    const int64_t length = slots.size(1), topk = I[kTopk];
    if (length <= topk) return Tensor();
    // I(t, l) = sum_h w_h relu(q_h . k_l), each key scored where it lies in the pool.
    Tensor scores = torch::empty({rows, length}, parts.options());
    TORCH_CHECK(valid.is_contiguous() && slots.is_contiguous() && cache.is_contiguous(),
                "indexer: contiguous rows");
    const int64_t grain = std::max<int64_t>(64, kSplitWork / std::max<int64_t>(1, n_heads * dim));
    for (int64_t t = 0; t < rows; ++t) {
      const int64_t* sl = slots.data_ptr<int64_t>() + t * length;
      const bool* ok = valid.data_ptr<bool>() + t * length;
      float* out = scores.data_ptr<float>() + t * length;
      split(0, length, grain, [&](int64_t begin, int64_t end) {
        score_keys(qo + t * n_heads * dim, wp + t * n_heads, cache.data_ptr<float>(), sl, ok,
                   begin, end, n_heads, dim, out);
      });
    }
    const float* sc = scores.data_ptr<float>();
    Tensor picks = torch::empty({rows, topk}, slots.options().dtype(torch::kLong));
    int64_t* op = picks.data_ptr<int64_t>();
    std::vector<std::pair<float, int64_t>> heap;
    for (int64_t t = 0; t < rows; ++t) topk_earliest_row(sc + t * length, length, topk, heap,
                                                         op + t * topk);
    return picks;
  }

  Tensor ffn(const Layer& L, const Tensor& h) const {
    const auto& T = L.t;
    const auto& I = L.i;
    const int64_t rows = h.size(0), hidden = h.size(1);
    Tensor out = swiglu(h, T[kMlpGateUp], T[kMlpDown]);  // dense MLP or the shared expert
    if (!T[kRouter].defined()) return out;
    // noaux_tc routing: sigmoid scores; the bias steers the choice only; group-limited top-k.
    Tensor logits = linear(h, T[kRouter], Tensor());
    const int64_t experts = logits.size(1), top_k = I[kTopK], groups = I[kNGroup];
    const int64_t per_group = experts / groups;
    const float* lp = logits.data_ptr<float>();
    const float* bias = T[kRouterBias].data_ptr<float>();
    std::vector<float> score(experts), choice(experts), gscore(groups);
    std::vector<int64_t> order(experts), gorder(groups);
    std::vector<std::vector<std::pair<int64_t, float>>> assigned(experts);  // (row, weight)
    for (int64_t t = 0; t < rows; ++t) {
      for (int64_t e = 0; e < experts; ++e) {
        score[e] = 1.0f / (1.0f + std::exp(-lp[t * experts + e]));
        choice[e] = score[e] + bias[e];
      }
      if (groups > 1) {
        for (int64_t g = 0; g < groups; ++g) {
          std::vector<float> v(choice.begin() + g * per_group,
                               choice.begin() + (g + 1) * per_group);
          std::partial_sort(v.begin(), v.begin() + 2, v.end(), std::greater<float>());
          gscore[g] = v[0] + v[1];
          gorder[g] = g;
        }
        std::stable_sort(gorder.begin(), gorder.end(),
                         [&](int64_t a, int64_t b) { return gscore[a] > gscore[b]; });
        std::vector<bool> keep(groups, false);
        for (int64_t g = 0; g < I[kTopkGroup]; ++g) keep[gorder[g]] = true;
        for (int64_t e = 0; e < experts; ++e)
          if (!keep[e / per_group]) choice[e] = -std::numeric_limits<float>::infinity();
      }
      for (int64_t e = 0; e < experts; ++e) order[e] = e;
      std::stable_sort(order.begin(), order.end(),
                       [&](int64_t a, int64_t b) { return choice[a] > choice[b]; });
      float total = 0;
      for (int64_t j = 0; j < top_k; ++j) total += score[order[j]];
      for (int64_t j = 0; j < top_k; ++j) {
        float weight = score[order[j]];
        if (I[kNormalise]) weight = weight / (total + 1e-20f);
        assigned[order[j]].emplace_back(t, weight * static_cast<float>(L.f[kScaling]));
      }
    }
    // Each busy expert over its rows: every weight row read once for all of them.
    Tensor routed = torch::zeros_like(h);
    float* rp = routed.data_ptr<float>();
    const float* hp = h.data_ptr<float>();
    const Tensor& gate_up = T[kExpGateUp];
    const Tensor& down = T[kExpDown];
    const int64_t inner = down.size(2);
    std::vector<float> xs, gu, act, y;
    for (int64_t e = 0; e < experts; ++e) {
      const auto& mine = assigned[e];
      const int64_t n = static_cast<int64_t>(mine.size());
      if (n == 0) continue;
      xs.resize(n * hidden);
      gu.resize(n * 2 * inner);
      act.resize(n * inner);
      y.resize(n * hidden);
      for (int64_t r = 0; r < n; ++r)
        std::copy(hp + mine[r].first * hidden, hp + (mine[r].first + 1) * hidden,
                  xs.begin() + r * hidden);
      small_linear(xs.data(), n, hidden, gate_up[e].data_ptr<float>(), 2 * inner, nullptr,
                   gu.data(), 2 * inner);
      for (int64_t r = 0; r < n; ++r)
        for (int64_t i = 0; i < inner; ++i) {
          const float g = gu[r * 2 * inner + i];
          act[r * inner + i] = g / (1.0f + std::exp(-g)) * gu[r * 2 * inner + inner + i];
        }
      small_linear(act.data(), n, inner, down[e].data_ptr<float>(), hidden, nullptr, y.data(),
                   hidden);
      for (int64_t r = 0; r < n; ++r) {
        float* dst = rp + mine[r].first * hidden;
        for (int64_t i = 0; i < hidden; ++i) dst[i] += y[r * hidden + i] * mine[r].second;
      }
    }
    return routed + out;
  }

  static Tensor swiglu(const Tensor& h, const Tensor& gate_up, const Tensor& down) {
    Tensor gu = linear(h, gate_up, Tensor());
    const int64_t inner = gu.size(1) / 2;
    Tensor act = torch::empty({h.size(0), inner}, h.options());
    const float* g = gu.data_ptr<float>();
    float* a = act.data_ptr<float>();
    for (int64_t t = 0; t < h.size(0); ++t)
      for (int64_t i = 0; i < inner; ++i) {
        const float v = g[t * 2 * inner + i];
        a[t * inner + i] = v / (1.0f + std::exp(-v)) * g[t * 2 * inner + inner + i];
      }
    return linear(act, down, Tensor());
  }

  std::vector<Layer> layers_;
};

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<DecodeLayers>(m, "DecodeLayers")
      .def(pybind11::init<std::vector<std::vector<Tensor>>, std::vector<std::vector<int64_t>>,
                          std::vector<std::vector<double>>>())
      .def("forward", &DecodeLayers::forward);
  // The final norm and the LM head of the decode step, the same loops as inside the layers.
  m.def("rms_norm", [](const Tensor& x, const Tensor& w, double eps) {
    return rms_norm(x.contiguous(), w.contiguous(), eps);
  });
  m.def("linear", [](const Tensor& x, const Tensor& w) {
    OneThread one_thread;
    return linear(x.contiguous(), w, Tensor());
  });
  // One row's index scores over its keys in the pool (the loop inside the layers' indexer):
  // q [H, D] and w [H] fp32, pool [S, D], slots [L] int64, valid [L] bool -> [L].
  m.def("index_scores", [](const Tensor& q, const Tensor& w, const Tensor& pool,
                           const Tensor& slots, const Tensor& valid) {
    TORCH_CHECK(q.is_contiguous() && w.is_contiguous() && pool.is_contiguous() &&
                    slots.is_contiguous() && valid.is_contiguous(),
                "index_scores: contiguous tensors");
    Tensor out = torch::empty({slots.size(0)}, q.options());
    score_keys(q.data_ptr<float>(), w.data_ptr<float>(), pool.data_ptr<float>(),
               slots.data_ptr<int64_t>(), valid.data_ptr<bool>(), 0, slots.size(0), q.size(0),
               q.size(1), out.data_ptr<float>());
    return out;
  });
  // The indexer's top-k of each row of scores [R, L] (fp32): [R, k] positions, increasing.
  m.def("topk_earliest", [](const Tensor& scores, int64_t k) {
    const Tensor sc = scores.contiguous();
    Tensor out = torch::empty({sc.size(0), k}, sc.options().dtype(torch::kLong));
    std::vector<std::pair<float, int64_t>> heap;
    for (int64_t r = 0; r < sc.size(0); ++r)
      topk_earliest_row(sc.data_ptr<float>() + r * sc.size(1), sc.size(1), k, heap,
                        out.data_ptr<int64_t>() + r * k);
    return out;
  });
}

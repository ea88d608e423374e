// A DFlash / DFlash2 drafter's block forward on CPU in one C++ call (engine/spec/draft_native.py).
//
// The same math as dsaserve/models/dflash.py `DFlashDraftModel.block_hidden` with the torch
// `draft_attention` op (kernels/draft_attention.py), which stay the reference and the path on
// other devices: every layer's input norm, (DFlash2) grouped dynamic causal convolution, q / k /
// v projections, q / k norms and rotary, attention of each block row over the request's cached
// context entries (a sliding window where the layer has one) and the block's own keys (causal
// where the layer is), o_proj, the convolution after it, the residual, and the same around the
// SwiGLU MLP; the final norm. Also the context entries (`context_entries`), written into the
// cache where the tokens' slots are. Linears use the native decode step's blocked loops
// (cpu_decode_jobs.h, cpu_decode_math.h) over fp32 or bf16 weights; activations are fp32; the
// context cache is fp32 or bf16. The drafter is small (a few layers, hidden ~200), so its cost in
// torch is the per-op overhead, not the arithmetic: here it is one call on the calling thread.

// Only the headers used: <torch/extension.h> alone takes ~20 s of each build to parse.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "cpu_decode_jobs.h"
#include "cpu_decode_math.h"

namespace dsa {
namespace {

using at::Tensor;

Mat mat_of(const Tensor& w, const Tensor& bias) {
  TORCH_CHECK(w.dim() == 2 && w.is_contiguous(), "a contiguous 2-d weight");
  TORCH_CHECK(w.scalar_type() == at::kFloat || w.scalar_type() == at::kBFloat16,
              "weights: fp32 or bf16");
  Mat m;
  m.data = w.data_ptr();
  m.rows = w.size(0);
  m.cols = w.size(1);
  m.kind = w.scalar_type() == at::kBFloat16 ? kBF16 : kF32;
  if (bias.defined() && bias.numel()) {
    TORCH_CHECK(bias.scalar_type() == at::kFloat && bias.numel() == m.rows, "bias: fp32 [rows]");
    m.bias = bias.data_ptr<float>();
  }
  return m;
}

const float* fp32(const Tensor& t) {
  TORCH_CHECK(t.scalar_type() == at::kFloat && t.is_contiguous(), "fp32, contiguous");
  return t.data_ptr<float>();
}

// One layer's weights: tensors in engine/spec/draft_native.py `layer_tensors` order.
struct Layer {
  std::vector<Tensor> keep;  // owns what the pointers below read
  const float *in_norm, *post_norm, *q_norm, *k_norm;
  Mat qkv, o, gate_up, down, att_proj, mlp_proj;
  const float *att_base = nullptr, *mlp_base = nullptr;  // [2, K, H] fp32 (DFlash2)
  bool causal = false;
  int64_t window = 0;  // 0: the whole context

  Layer(const std::vector<Tensor>& t, bool causal_, int64_t window_)
      : keep(t), causal(causal_), window(window_) {
    TORCH_CHECK(t.size() == 14, "14 tensors per drafter layer");
    in_norm = fp32(t[0]);
    post_norm = fp32(t[1]);
    q_norm = fp32(t[2]);
    k_norm = fp32(t[3]);
    qkv = mat_of(t[4], t[5]);
    o = mat_of(t[6], t[7]);
    gate_up = mat_of(t[8], at::Tensor());
    down = mat_of(t[9], at::Tensor());
    if (t[10].numel()) {
      att_proj = mat_of(t[10], at::Tensor());
      att_base = fp32(t[11]);
      mlp_proj = mat_of(t[12], at::Tensor());
      mlp_base = fp32(t[13]);
    }
  }
};

void linear(const float* x, int64_t rows, const Mat& w, float* y) {
  RowsRef r;
  r.base = x;
  r.stride = w.cols;
  linear_ref(r, rows, w, 0, w.rows, y, w.rows);
}

class DraftBlock {
 public:
  // ints: hidden, heads, kv_heads, head_dim, conv kernel size, conv group size; causal and
  // window: per layer (window 0: none); eps: every norm's; scale: the attention's.
  DraftBlock(std::vector<std::vector<Tensor>> layers, std::vector<int64_t> causal,
             std::vector<int64_t> windows, std::vector<int64_t> ints, Tensor final_norm,
             Tensor fc, Tensor hidden_norm, double eps, double scale)
      : final_norm_(final_norm), fc_w_(fc), hidden_norm_(hidden_norm), eps_(eps),
        scale_(static_cast<float>(scale)) {
    TORCH_CHECK(ints.size() == 6 && causal.size() == layers.size() &&
                    windows.size() == layers.size(), "drafter shape");
    hidden_ = ints[0];
    heads_ = ints[1];
    kv_heads_ = ints[2];
    dim_ = ints[3];
    conv_k_ = ints[4];
    conv_group_ = ints[5];
    for (size_t l = 0; l < layers.size(); ++l)
      layers_.emplace_back(layers[l], causal[l] != 0, windows[l]);
    fp32(final_norm_);
    fp32(hidden_norm_);
    fc_ = mat_of(fc_w_, at::Tensor());
  }

  // The context entries of N tokens (DFlashDraftModel.context_entries): taps [N, fc inputs] fp32
  // (the tapped target states), cos / sin [N, dim / 2] at their positions, written into cache
  // [layers, slots, 2 * kv_heads * dim] (fp32 or bf16, rounded to nearest even) at slots [N].
  void write_entries(const Tensor& taps, const Tensor& cos, const Tensor& sin, const Tensor& cache,
                     const Tensor& slots) {
    const int64_t n = taps.size(0), kw = kv_heads_ * dim_, qw = heads_ * dim_;
    const int64_t qkvw = qw + 2 * kw, width = 2 * kw;
    TORCH_CHECK(taps.dim() == 2 && taps.size(1) == fc_.cols && cos.size(0) == n &&
                    sin.sizes() == cos.sizes() && cos.size(1) == dim_ / 2 && slots.numel() == n &&
                    slots.scalar_type() == at::kLong && slots.is_contiguous(),
                "entries: taps [N, fc inputs], cos / sin [N, dim / 2], slots [N] int64");
    TORCH_CHECK(cache.dim() == 3 && cache.is_contiguous() && cache.size(2) == width &&
                    cache.size(0) == static_cast<int64_t>(layers_.size()) &&
                    (cache.scalar_type() == at::kFloat ||
                     cache.scalar_type() == at::kBFloat16), "cache: [layers, slots, kv_dim]");
    const int64_t* sl = slots.data_ptr<int64_t>();
    for (int64_t t = 0; t < n; ++t)
      TORCH_CHECK(sl[t] >= 0 && sl[t] < cache.size(1), "slot out of range");
    std::vector<float> context(n * hidden_), normed(n * hidden_), kv(n * qkvw), entry(width);
    linear(fp32(taps), n, fc_, context.data());
    norm_rows(context.data(), n, fp32(hidden_norm_), normed.data());
    const float *c = fp32(cos), *s = fp32(sin);
    const bool bf16 = cache.scalar_type() == at::kBFloat16;
    RowsRef x;
    x.base = normed.data();
    x.stride = hidden_;
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& L = layers_[l];
      linear_ref(x, n, L.qkv, qw, qkvw, kv.data(), qkvw);  // k_proj, v_proj rows of qkv
      for (int64_t t = 0; t < n; ++t) {
        float* row = kv.data() + t * qkvw + qw;  // [K | V]
        for (int64_t h = 0; h < kv_heads_; ++h)
          norm_rope(row + h * dim_, L.k_norm, c + t * (dim_ / 2), s + t * (dim_ / 2));
        const int64_t at = (static_cast<int64_t>(l) * cache.size(1) + sl[t]) * width;
        if (bf16) {
          uint16_t* out = static_cast<uint16_t*>(cache.data_ptr()) + at;
          for (int64_t j = 0; j < width; ++j) out[j] = float_to_bf16(row[j]);
        } else {
          std::copy_n(row, width, static_cast<float*>(cache.data_ptr()) + at);
        }
      }
    }
  }

  // noise [R * B, hidden] fp32 (the block's embeddings, scaled); cos / sin [R * B, dim / 2] fp32
  // at the rows' positions; cache [layers, slots, 2 * kv_heads * dim] fp32 or bf16; slots[r]
  // int64 (request r's slots: its context entries at positions 0 .. lens[r] - 1 are
  // cache[:, slots[r][0 .. lens[r] - 1]]; its block sits at positions lens[r] .. + B - 1).
  // Returns the normed hidden states [R * B, hidden] fp32.
  Tensor forward(const Tensor& noise, const Tensor& cos, const Tensor& sin, const Tensor& cache,
                 const std::vector<Tensor>& slots, const std::vector<int64_t>& lens) {
    const int64_t reqs = static_cast<int64_t>(lens.size());
    const int64_t n = noise.size(0), block = reqs ? n / reqs : 0;
    TORCH_CHECK(noise.dim() == 2 && noise.size(1) == hidden_ && block * reqs == n &&
                    slots.size() == lens.size(), "noise: [R * B, hidden]");
    TORCH_CHECK(cos.size(0) == n && cos.size(1) == dim_ / 2 && sin.sizes() == cos.sizes(),
                "rotary tables: [R * B, dim / 2]");
    TORCH_CHECK(cache.dim() == 3 && cache.is_contiguous() &&
                    cache.size(0) == static_cast<int64_t>(layers_.size()) &&
                    cache.size(2) == 2 * kv_heads_ * dim_ &&
                    (cache.scalar_type() == at::kFloat ||
                     cache.scalar_type() == at::kBFloat16), "cache: [layers, slots, kv_dim]");
    for (int64_t r = 0; r < reqs; ++r)
      TORCH_CHECK(slots[r].scalar_type() == at::kLong && slots[r].is_contiguous() &&
                      lens[r] >= 0 && slots[r].numel() >= lens[r], "slots: int64, one per entry");
    Tensor out = at::empty({n, hidden_}, noise.options());
    std::vector<float> x(fp32(noise), fp32(noise) + n * hidden_);
    const int64_t qw = heads_ * dim_, kw = kv_heads_ * dim_, qkvw = qw + 2 * kw;
    h_.resize(n * hidden_);
    conv_.resize(n * hidden_);
    sub_.resize(n * std::max(hidden_, qw));
    qkv_.resize(n * qkvw);
    attn_.resize(n * qw);
    dyn_.resize(n * 2 * conv_k_ * std::max<int64_t>(conv_group_ ? hidden_ / conv_group_ : 0, 1));
    const int64_t inter = layers_.empty() ? 0 : layers_[0].down.cols;
    gu_.resize(n * 2 * inter);
    act_.resize(n * inter);
    const float *c = fp32(cos), *s = fp32(sin);
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& L = layers_[l];
      // attention
      norm_rows(x.data(), n, L.in_norm, h_.data());
      const float* in = pre_conv(L.att_proj, L.att_base, h_.data(), n, block);
      linear(in, n, L.qkv, qkv_.data());
      for (int64_t t = 0; t < n; ++t) {
        float* row = qkv_.data() + t * qkvw;
        for (int64_t h = 0; h < heads_ + kv_heads_; ++h)
          norm_rope(row + h * dim_, h < heads_ ? L.q_norm : L.k_norm, c + t * (dim_ / 2),
                    s + t * (dim_ / 2));
      }
      attend(L, static_cast<int64_t>(l), cache, slots, lens, block);
      linear(attn_.data(), n, L.o, sub_.data());
      add_post_conv(L.att_proj, L.att_base, n, block, x.data());
      // MLP
      norm_rows(x.data(), n, L.post_norm, h_.data());
      in = pre_conv(L.mlp_proj, L.mlp_base, h_.data(), n, block);
      linear(in, n, L.gate_up, gu_.data());
      for (int64_t t = 0; t < n; ++t)
        for (int64_t i = 0; i < inter; ++i)
          act_[t * inter + i] = silu_mul(gu_[t * 2 * inter + i], gu_[t * 2 * inter + inter + i]);
      linear(act_.data(), n, L.down, sub_.data());
      add_post_conv(L.mlp_proj, L.mlp_base, n, block, x.data());
    }
    float* o = out.data_ptr<float>();
    norm_rows(x.data(), n, fp32(final_norm_), o);
    return out;
  }

 private:
  void norm_rows(const float* x, int64_t n, const float* w, float* out) const {
    for (int64_t t = 0; t < n; ++t) rms_norm(x + t * hidden_, hidden_, w, eps_, out + t * hidden_);
  }

  // One head's q or k in place: RMSNorm over its dim, then NeoX rotary.
  void norm_rope(float* v, const float* w, const float* cos, const float* sin) const {
    float tmp[512];
    TORCH_CHECK(dim_ <= 512, "head_dim <= 512");
    rms_norm(v, dim_, w, eps_, tmp);
    rotate(tmp, cos, sin, dim_ / 2, false, v);
  }

  // out[t, c] = sum_o (base[which, o, c] + dyn[t, which, o, c / group]) * x[t - o, c] within
  // each request's block (zeros before it): GroupedDynamicCausalConv._convolve.
  void convolve(const float* x, const float* base, int which, int64_t n, int64_t block,
                float* out) const {
    const int64_t groups = hidden_ / conv_group_, dw = 2 * conv_k_ * groups;
    for (int64_t t = 0; t < n; ++t) {
      const int64_t b = t % block;
      const float* d = dyn_.data() + t * dw + which * conv_k_ * groups;
      for (int64_t ch = 0; ch < hidden_; ++ch) {
        const int64_t g = ch / conv_group_;
        float acc = 0;
        for (int64_t k = 0; k < conv_k_ && k <= b; ++k)
          acc += (base[(which * conv_k_ + k) * hidden_ + ch] + d[k * groups + g]) *
                 x[(t - k) * hidden_ + ch];
        out[t * hidden_ + ch] = acc;
      }
    }
  }

  // The sublayer's input: h itself, or (DFlash2) its pre-convolution, keeping the dynamic kernels.
  const float* pre_conv(const Mat& proj, const float* base, const float* h, int64_t n,
                        int64_t block) {
    if (!base) return h;
    linear(h, n, proj, dyn_.data());
    convolve(h, base, 0, n, block, conv_.data());
    return conv_.data();
  }

  // x += the sublayer's output sub_ (after its post-convolution, DFlash2).
  void add_post_conv(const Mat& proj, const float* base, int64_t n, int64_t block, float* x) {
    const float* y = sub_.data();
    if (base) {
      convolve(sub_.data(), base, 1, n, block, conv_.data());
      y = conv_.data();
    }
    for (int64_t i = 0; i < n * hidden_; ++i) x[i] += y[i];
  }

  template <typename T>
  static float load(const T* p, int64_t i) {
    if constexpr (std::is_same_v<T, float>) {
      return p[i];
    } else {
      return bf16_to_float(p[i]);
    }
  }

  // attn_[t, head] = softmax(q . keys * scale) . values over the row's allowed context entries
  // and block rows.
  void attend(const Layer& L, int64_t layer, const Tensor& cache, const std::vector<Tensor>& slots,
              const std::vector<int64_t>& lens, int64_t block) {
    if (cache.scalar_type() == at::kFloat) {
      attend_as(L, static_cast<const float*>(cache.data_ptr()), layer, cache, slots, lens, block);
    } else {
      attend_as(L, static_cast<const uint16_t*>(cache.data_ptr()), layer, cache, slots, lens,
                block);
    }
  }

  template <typename T>
  void attend_as(const Layer& L, const T* base, int64_t layer, const Tensor& cache,
                 const std::vector<Tensor>& slots, const std::vector<int64_t>& lens,
                 int64_t block) {
    const int64_t width = cache.size(2), kw = kv_heads_ * dim_, qw = heads_ * dim_;
    const int64_t qkvw = qw + 2 * kw, group = heads_ / kv_heads_;
    const T* layer_base = base + layer * cache.size(1) * width;
    const float scale = scale_;
    std::vector<float> ctx, score, acc(dim_);
    for (size_t r = 0; r < lens.size(); ++r) {
      const int64_t len = lens[r];
      const int64_t* sl = slots[r].data_ptr<int64_t>();
      ctx.resize(len * width);  // the request's context entries, fp32
      for (int64_t i = 0; i < len; ++i) {
        const T* e = layer_base + sl[i] * width;
        for (int64_t j = 0; j < width; ++j) ctx[i * width + j] = load(e, j);
      }
      score.resize(len + block);
      for (int64_t b = 0; b < block; ++b) {
        const int64_t t = static_cast<int64_t>(r) * block + b, p = len + b;
        const int64_t lo = L.window ? std::max<int64_t>(0, p - L.window + 1) : 0;
        const int64_t last = L.causal ? b : block - 1;
        for (int64_t h = 0; h < heads_; ++h) {
          const int64_t kh = h / group;
          const float* q = qkv_.data() + t * qkvw + h * dim_;
          float best = -std::numeric_limits<float>::infinity();
          for (int64_t i = lo; i < len; ++i) {
            score[i] = dot(q, ctx.data() + i * width + kh * dim_, dim_) * scale;
            best = std::max(best, score[i]);
          }
          for (int64_t j = 0; j <= last; ++j) {
            const float* k = qkv_.data() + (r * block + j) * qkvw + qw + kh * dim_;
            score[len + j] = dot(q, k, dim_) * scale;
            best = std::max(best, score[len + j]);
          }
          float total = 0;
          std::fill(acc.begin(), acc.end(), 0.0f);
          const auto add = [&](int64_t i, const float* v) {
            const float e = std::exp(score[i] - best);
            total += e;
            for (int64_t d = 0; d < dim_; ++d) acc[d] += e * v[d];
          };
          for (int64_t i = lo; i < len; ++i) add(i, ctx.data() + i * width + kw + kh * dim_);
          for (int64_t j = 0; j <= last; ++j)
            add(len + j, qkv_.data() + (r * block + j) * qkvw + qw + kw + kh * dim_);
          float* out = attn_.data() + t * qw + h * dim_;
          for (int64_t d = 0; d < dim_; ++d) out[d] = acc[d] / total;
        }
      }
    }
  }

  std::vector<Layer> layers_;
  Tensor final_norm_, fc_w_, hidden_norm_;
  Mat fc_;
  double eps_;
  float scale_;
  int64_t hidden_ = 0, heads_ = 0, kv_heads_ = 0, dim_ = 0, conv_k_ = 0, conv_group_ = 0;
  std::vector<float> h_, conv_, sub_, qkv_, attn_, dyn_, gu_, act_;
};

}  // namespace
}  // namespace dsa

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<dsa::DraftBlock>(m, "DraftBlock")
      .def(pybind11::init<std::vector<std::vector<at::Tensor>>, std::vector<int64_t>,
                          std::vector<int64_t>, std::vector<int64_t>, at::Tensor, at::Tensor,
                          at::Tensor, double, double>())
      .def("write_entries", &dsa::DraftBlock::write_entries,
           pybind11::call_guard<pybind11::gil_scoped_release>())
      .def("forward", &dsa::DraftBlock::forward,
           pybind11::call_guard<pybind11::gil_scoped_release>());
}

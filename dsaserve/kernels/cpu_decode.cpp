// The decode step of a DSA MoE model for all-decode batches on CPU, in one C++ call.
//
// The same math as dsaserve/engine/decode/fused.py (FusedDecode), which stays the reference: the
// embedding, every decoder layer, the final norm and the LM head run without returning to
// Python. One job on the persistent pool (cpu_decode_pool.h) per step: every thread walks the
// layers, each phase split across the threads (a linear by output columns over all of the
// batch's rows, so each weight row is read once per step; the attention by (row, head); the
// indexer's scoring by keys; the routed experts by their output columns), with a barrier
// between phases. Every output element is computed by one thread in a fixed order, so the
// result does not depend on the thread count. Weights are fp32 or bf16, the pool fp32, bf16 or
// FP8 (cpu_decode_kv.h); activations are fp32. Under --tp / --ep each rank runs its shard of the
// step here, the partial sums and the vocab-parallel parts exchanged over shared memory inside
// the call (cpu_decode_comm.h). Built at first use by engine/decode/native.py.

// Only the headers used: <torch/extension.h> alone takes ~20 s of each build to parse.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "cpu_decode_comm.h"
#include "cpu_decode_indexer.h"
#include "cpu_decode_kv.h"
#include "cpu_decode_layer.h"
#include "cpu_decode_math.h"
#include "cpu_decode_pool.h"

namespace dsa {
namespace {

using at::Tensor;

Kv kv_kind(const Tensor& cache) {
  if (cache.scalar_type() == at::kFloat) return Kv::kF32;
  if (cache.scalar_type() == at::kBFloat16) return Kv::kBF16;
  TORCH_CHECK(cache.scalar_type() == at::kByte, "KV pool: fp32, bf16 or FP8 bytes");
  return Kv::kFP8;
}

// Layer `layer` of a [layers, slots, row] pool as Rows of `width` values (`rank` latent ones).
Rows pool_rows(const Tensor& cache, int64_t layer, int64_t width, int64_t rank) {
  TORCH_CHECK(cache.is_contiguous(), "KV pool: contiguous");
  Rows r;
  r.kind = kv_kind(cache);
  r.row_bytes = cache.size(2) * cache.element_size();
  r.base = static_cast<uint8_t*>(cache.data_ptr()) + layer * cache.size(1) * r.row_bytes;
  r.width = width;
  r.rank = rank;
  r.group = std::gcd(rank, int64_t{128});
  return r;
}

class DecodeLayers {
 public:
  DecodeLayers(std::vector<std::vector<Tensor>> tensors, std::vector<std::vector<Tensor>> scales,
               std::vector<std::vector<Tensor>> row_scales, std::vector<std::vector<int64_t>> ints,
               std::vector<std::vector<double>> floats, std::vector<Tensor> head, double norm_eps,
               int64_t embed_start, int64_t vocab) {
    for (size_t l = 0; l < tensors.size(); ++l)
      layers_.emplace_back(tensors[l], scales[l], row_scales[l], ints[l], floats[l]);
    head_ = Head(head, norm_eps, embed_start, vocab);
  }

  // This rank's place in its ranks' shared-memory files (distributed/shm_comm.py's mappings,
  // kept alive here): the world's, and its attention group's where that is a smaller group
  // (DP attention with several ranks a group; `attn` false: the world's, or none).
  void set_comm(const Tensor& memory, int64_t ranks, int64_t index, double timeout, bool attn) {
    TORCH_CHECK(memory.scalar_type() == at::kByte && memory.is_contiguous() &&
                    memory.numel() >= ranks * (Comm::kFlagStride * 8 + 2 * Comm::kSlotBytes) &&
                    ranks <= 64 && index >= 0 && index < ranks,
                "set_comm: a shared-memory group's mapping");
    (attn ? attn_memory_ : world_memory_) = memory;
    (attn ? attn_ : world_) = Comm(memory.data_ptr<uint8_t>(), ranks, index, timeout);
  }

  // Logits [T, vocab] of a step whose rows each decode one token: row t (token ids[t] at
  // position p = positions[t]) writes its entry and index key at slots[t, p] and attends
  // slots[t, :p + 1]. cos / sin [positions, rope / 2] are the rotary tables. `taps` (layer
  // indices, a DFlash drafter's target layers) copy each layer's output into `tapped` [T,
  // taps * hidden] fp32 (the last layer's after the final norm); none: `tapped` is empty.
  // Without `with_logits` the LM head is skipped (the logits returned are empty): the taps
  // are what the caller wants.
  // DP attention: `group_rows` (every attention group's rows, `attn_tp` ranks a group; this
  // rank's group `group`) go through the MLP block and the LM head together; empty: one group.
  Tensor forward(const Tensor& ids, const Tensor& positions, const Tensor& slots,
                 const Tensor& kv_cache, const Tensor& index_cache, const Tensor& cos,
                 const Tensor& sin, const std::vector<int64_t>& taps, const Tensor& tapped,
                 bool with_logits, const std::vector<int64_t>& group_rows, int64_t group,
                 int64_t attn_tp) {
    for (const Tensor* t : {&ids, &positions, &slots})
      TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous(), "int64, contiguous");
    TORCH_CHECK(cos.scalar_type() == at::kFloat && cos.is_contiguous() && sin.is_contiguous(),
                "rotary tables: fp32");
    const int64_t rows = ids.size(0);
    TORCH_CHECK(positions.size(0) == rows && slots.dim() == 2 && slots.size(0) >= rows,
                "one position and one slot row per token");
    Step s;
    s.all_rows = s.most = rows;
    if (group_rows.size() > 1) {
      TORCH_CHECK(world_.active() && group >= 0 && group < static_cast<int64_t>(group_rows.size()) &&
                      group_rows[group] == rows && attn_tp * static_cast<int64_t>(group_rows.size()) ==
                      world_.size(), "DP attention: this group's rows among every group's");
      s.groups = static_cast<int64_t>(group_rows.size());
      s.group_rows = group_rows.data();
      s.attn_tp = attn_tp;
      s.all_rows = std::accumulate(group_rows.begin(), group_rows.end(), int64_t{0});
      s.own_begin = std::accumulate(group_rows.begin(), group_rows.begin() + group, int64_t{0});
      s.most = *std::max_element(group_rows.begin(), group_rows.end());
    }
    s.rows = rows;
    s.ids = ids.data_ptr<int64_t>();
    s.positions = positions.data_ptr<int64_t>();
    s.slots = slots.data_ptr<int64_t>();
    s.slot_stride = slots.size(1);
    s.cos = cos.data_ptr<float>();
    s.sin = sin.data_ptr<float>();
    s.half = cos.size(1);
    lengths_.resize(rows);
    out_slots_.resize(rows);
    int64_t longest = 0;
    for (int64_t t = 0; t < rows; ++t) {
      const int64_t p = s.positions[t];
      TORCH_CHECK(p >= 0 && p < s.slot_stride && p < cos.size(0), "position out of range");
      lengths_[t] = p + 1;
      out_slots_[t] = s.slots[t * s.slot_stride + p];
      longest = std::max(longest, p + 1);
    }
    s.lengths = lengths_.data();
    s.out_slots = out_slots_.data();
    s.kv_cache = &kv_cache;
    s.index_cache = &index_cache;
    s.taps = &taps;
    if (!taps.empty()) {
      TORCH_CHECK(tapped.scalar_type() == at::kFloat && tapped.is_contiguous() &&
                      tapped.size(0) == rows &&
                      tapped.size(1) == static_cast<int64_t>(taps.size()) * head_.hidden,
                  "tapped: fp32 [rows, taps * hidden]");
      for (const int64_t l : taps)
        TORCH_CHECK(l >= 0 && l < num_layers(), "tap: a layer index");
      s.tapped = tapped.data_ptr<float>();
    }
    TORCH_CHECK(with_logits || !taps.empty(), "a step without logits needs taps");
    Tensor logits = at::empty({with_logits ? rows : 0, head_.vocab}, cos.options());
    s.logits = logits.data_ptr<float>();  // (no rows: maybe null, and never written)
    s.with_logits = with_logits;
    const int threads = std::max(1, std::min<int>(threads_ ? threads_ : at::get_num_threads(), 64));
    scratch_.size(layers_, head_, rows, longest, threads, world_.size(), s.all_rows, s.most);
    if (world_.active()) s.world = &world_;
    s.attn = attn_.active() ? &attn_ : s.dp() ? nullptr : s.world;  // DP: the group's, if any
    run(s, threads);
    TORCH_CHECK(world_.error.empty(), world_.error);
    TORCH_CHECK(attn_.error.empty(), attn_.error);
    return logits;
  }

  int64_t num_layers() const { return static_cast<int64_t>(layers_.size()); }

  // The sequence number of the shared-memory group's last message: handed over from the Python
  // group before a step and back after it (both write the same file, in turn).
  int64_t comm_seq() const { return world_.seq; }
  void set_comm_seq(int64_t seq) { world_.seq = seq; }
  double comm_wait() const { return world_.waited + attn_.waited; }
  int64_t attn_seq() const { return attn_.seq; }
  void set_attn_seq(int64_t seq) { attn_.seq = seq; }

  // Layer l's output rows (`from` [T, hidden]) into each tapped column block naming l, for
  // this thread's rows (the rows it wrote itself, so no barrier is needed).
  static void tap(const Ctx& c, int64_t l, const float* from) {
    const std::vector<int64_t>& taps = *c.s.taps;
    const int64_t hidden = c.w.hidden, width = hidden * static_cast<int64_t>(taps.size());
    const auto [b, e] = c.my_rows();
    for (size_t k = 0; k < taps.size(); ++k) {
      if (taps[k] != l) continue;
      for (int64_t t = b; t < e; ++t)
        std::copy_n(from + t * hidden, hidden, c.s.tapped + t * width + k * hidden);
    }
  }

  // The pool's threads for a step: 0 (the default) follows torch's intra-op thread count and
  // lets the chooser below fall back to one thread where that is faster; n > 0: always n.
  int threads_ = 0;

 private:
  void run(const Step& s, int threads) {
    std::vector<Rows> kv(layers_.size()), keys(layers_.size());
    for (size_t l = 0; l < layers_.size(); ++l) {
      const Layer& L = layers_[l];
      kv[l] = pool_rows(*s.kv_cache, L.layer_id, L.rank + L.rope, L.rank);
      if (L.index_cache >= 0) keys[l] = pool_rows(*s.index_cache, L.index_cache, L.idx_dim, 0);
    }
    Pool& p = pool();
    const int n = threads_ ? threads : chooser_.threads(threads);  // a fixed count: no chooser
    const std::function<void(int)> job = [&](int tid) {
      Ctx c{s, scratch_, p, tid, n};
      head_.embed_rows(c);
      const int64_t last = num_layers() - 1;
      for (size_t l = 0; l < layers_.size(); ++l) {
        layers_[l].forward(c, kv[l], keys[l]);
        if (static_cast<int64_t>(l) != last) tap(c, l, c.w.x.data());
      }
      head_.logits(c, [&] { tap(c, last, c.w.h.data()); });
    };
    const auto start = std::chrono::steady_clock::now();
    p.run(n, job);
    chooser_.took(n, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  }

  // On a machine shared with other work, the other threads may not get a core when a barrier
  // waits for them, and a step on several threads becomes slower than on one. Every 32nd step
  // runs on one thread; each thread count keeps a moving average of its step time, and the
  // faster is used. Results are the same bits either way, so this only changes the speed.
  struct Chooser {
    int64_t steps = 0, single_steps = 0;
    double one = 0, many = 0;  // seconds per step, moving averages
    int threads(int wanted) {
      if (wanted <= 1) return 1;
      const int preferred = one > 0 && many > 0 && one < many ? 1 : wanted;
      const bool probe = ++steps % 32 == 0 || (steps > 1 && one == 0);  // try the other one
      const int n = probe ? (preferred == 1 ? wanted : 1) : preferred;
      single_steps += n == 1;
      return n;
    }
    void took(int n, double seconds) {
      double& avg = n == 1 ? one : many;
      avg = avg == 0 ? seconds : 0.8 * avg + 0.2 * seconds;
    }
  };
  Chooser chooser_;

 public:
  // Steps run, and of them on one thread although more were asked for (the chooser above).
  std::pair<int64_t, int64_t> thread_steps() const { return {chooser_.steps, chooser_.single_steps}; }

 private:

  std::vector<Layer> layers_;
  Head head_;
  Comm world_, attn_;
  Tensor world_memory_, attn_memory_;
  Scratch scratch_;
  std::vector<int64_t> lengths_, out_slots_;
};

// The old single-purpose entry points, kept for tests and bench/indexer_cost.py.
Tensor index_scores(const Tensor& q, const Tensor& w, const Tensor& pool_keys, const Tensor& slots,
                    const Tensor& valid) {
  TORCH_CHECK(q.is_contiguous() && w.is_contiguous() && pool_keys.is_contiguous() &&
                  slots.is_contiguous() && valid.is_contiguous(),
              "index_scores: contiguous tensors");
  const int64_t length = slots.size(0);
  Tensor out = at::empty({length}, q.options());
  const Tensor pool3 = pool_keys.unsqueeze(0);
  const Rows keys = pool_rows(pool3, 0, pool_keys.size(1), 0);
  score_keys(q.data_ptr<float>(), w.data_ptr<float>(), keys, slots.data_ptr<int64_t>(), length,
             0, length, q.size(0), out.data_ptr<float>());
  const bool* ok = valid.data_ptr<bool>();
  float* o = out.data_ptr<float>();
  for (int64_t l = 0; l < length; ++l)
    if (!ok[l]) o[l] = -std::numeric_limits<float>::infinity();
  return out;
}

Tensor topk_earliest(const Tensor& scores, int64_t k) {
  const Tensor sc = scores.contiguous();
  Tensor out = at::empty({sc.size(0), k}, sc.options().dtype(at::kLong));
  std::vector<Cand> heap;
  for (int64_t r = 0; r < sc.size(0); ++r)
    topk_earliest_row(sc.data_ptr<float>() + r * sc.size(1), sc.size(1), k, heap,
                      out.data_ptr<int64_t>() + r * k);
  return out;
}

// The stored form of rows [R, width] in a pool like `like` (tests check it against kv_quant.py).
Tensor store_rows(const Tensor& x, const Tensor& like, int64_t rank) {
  Tensor out = at::empty({1, x.size(0), like.size(-1)}, like.options());
  const Rows r = pool_rows(out, 0, x.size(1), rank);
  const Tensor xc = x.contiguous();
  for (int64_t i = 0; i < x.size(0); ++i) r.store(i, xc.data_ptr<float>() + i * x.size(1));
  return out[0];
}

}  // namespace
}  // namespace dsa

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  pybind11::class_<dsa::DecodeLayers>(m, "DecodeLayers")
      .def(pybind11::init<std::vector<std::vector<at::Tensor>>,
                          std::vector<std::vector<at::Tensor>>,
                          std::vector<std::vector<at::Tensor>>,
                          std::vector<std::vector<int64_t>>, std::vector<std::vector<double>>,
                          std::vector<at::Tensor>, double, int64_t, int64_t>())
      .def("forward", &dsa::DecodeLayers::forward, pybind11::call_guard<pybind11::gil_scoped_release>())
      .def_property_readonly("num_layers", &dsa::DecodeLayers::num_layers)
      .def("set_comm", &dsa::DecodeLayers::set_comm)
      .def_property("comm_seq", &dsa::DecodeLayers::comm_seq, &dsa::DecodeLayers::set_comm_seq)
      .def_property("attn_seq", &dsa::DecodeLayers::attn_seq, &dsa::DecodeLayers::set_attn_seq)
      .def_property_readonly("comm_wait", &dsa::DecodeLayers::comm_wait)
      .def_readwrite("threads", &dsa::DecodeLayers::threads_)
      .def_property_readonly("thread_steps", &dsa::DecodeLayers::thread_steps);
  // One row's index scores over its keys in the pool: q [H, D] and w [H] fp32, pool [S, D],
  // slots [L] int64, valid [L] bool -> [L].
  m.def("index_scores", &dsa::index_scores);
  // The indexer's top-k of each row of scores [R, L] (fp32): [R, k] positions, increasing.
  m.def("topk_earliest", &dsa::topk_earliest);
  m.def("store_rows", &dsa::store_rows);
  m.def("avx512", [] {
#if defined(__AVX512F__)
    return true;
#else
    return false;
#endif
  });
}

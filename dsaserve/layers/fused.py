"""A decode-only forward over the model's own weights with fewer, larger ops (CPU per-step cost).

A decode step at small batch costs per-op overhead, not weight reads: each layer runs ~170 small
PyTorch ops. This path runs the same math as `DsaMoeForCausalLM.forward` for batches that are
all decode rows, with:

- one GEMM for everything that reads a layer's normed input x (q_a_proj | kv_a_proj_with_mqa |
  indexer wk | indexer weights_proj) and one for everything that reads q_resid (q_b_proj |
  indexer wq_b); the shared expert's (and dense MLP's) gate and up in one GEMM. The fused
  weights are built once at load time and share nothing with the modules' parameters (which stay
  as the checkpoint names them).
- rotary as one batched matmul per rotated tensor with per-step [T, d, d] rotations (built once
  per step for every layer), instead of ~11 slicing/elementwise ops.
- `torch.rms_norm` / `layer_norm` kernels instead of the composite norms.

- attention and the indexer's scores in bmm form with the absorbed W_UK / W_UV pre-laid-out
  (no einsum dispatch); the experts and the router are the layers' own. Every output
element is the same dot product as in the layered path, so results agree to float rounding
(fp32 logprobs within 1e-5, same greedy tokens: tests/test_fused_decode.py). Prefill, mixed
batches, the MTP layer and models not in plain fp32 linears (bf16, FP8) keep the layered path.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dsaserve.distributed.linear import ColumnParallelLinear, RowParallelLinear
from dsaserve.engine.forward_batch import ForwardBatch, current_batch, gather_rows
from dsaserve.kernels import cpu_decode
from dsaserve.layers.indexer import Indexer, Selection
from dsaserve.layers.mla import MLAttention
from dsaserve.layers.moe import MLP, MoE
from dsaserve.layers.taps import join_taps


class LayerWeights(NamedTuple):
    w_in: torch.Tensor  # [q_lora + rank + rope (+ dI + nI), H]
    b_in: torch.Tensor | None
    w_qres: torch.Tensor  # [heads * qk_head (+ nI * dI), q_lora]
    mlp_gate_up: torch.Tensor  # [2 I, H] of the dense MLP or the shared expert
    w_uk: torch.Tensor  # [H, nope, rank] (contiguous copy of kv_b_proj's key half)
    w_uv_t: torch.Tensor  # [H, rank, v]
    split_in: list[int]
    split_qres: list[int]


def _plain(*modules: nn.Module) -> bool:
    """Whole, unquantised Linears (a one-rank parallel Linear is a whole one)."""
    return all(_whole(m) for m in modules)


def _whole(module: nn.Module) -> bool:
    if type(module) in (nn.Linear, nn.LayerNorm):
        return True
    if isinstance(module, ColumnParallelLinear | RowParallelLinear):
        return getattr(module.weight, "shard", None) is None  # one rank (the engine checks)
    return False


def _fused_weights(layer: nn.Module) -> LayerWeights | None:
    attn: MLAttention = layer.self_attn
    ffn = layer.mlp.shared_experts if isinstance(layer.mlp, MoE) else layer.mlp
    experts = layer.mlp.experts if isinstance(layer.mlp, MoE) else None
    if ffn is None or (experts is not None and experts.down_proj.dtype != torch.float32):
        return None  # FP8 experts (kernels/fp8_experts.py) run the `moe` op, layered
    into = [attn.q_a_proj, attn.kv_a_proj_with_mqa]
    from_q = [attn.q_b_proj]
    if attn.indexer is not None:
        into += [attn.indexer.wk, attn.indexer.weights_proj]
        from_q.append(attn.indexer.wq_b)
    linears = [*into, *from_q, attn.o_proj, ffn.gate_proj, ffn.up_proj, ffn.down_proj]
    # fp32 only: in bf16 the layered path's roundings (norms upcast, rotary per product) are
    # what the bf16 path-agreement bounds of docs/determinism.md were measured on.
    if not _plain(*linears) or {m.weight.dtype for m in linears} != {torch.float32}:
        return None
    w_in = torch.cat([m.weight for m in into])
    biases = [m.bias for m in into]
    b_in = None
    if any(b is not None for b in biases):
        b_in = torch.cat([b if b is not None else w_in.new_zeros(m.weight.shape[0])
                          for b, m in zip(biases, into)])  # fmt: skip
    w_uk, w_uv = attn.absorbed()
    return LayerWeights(
        w_in,
        b_in,
        torch.cat([m.weight for m in from_q]),
        torch.cat([ffn.gate_proj.weight, ffn.up_proj.weight]),
        w_uk.contiguous(),
        w_uv.transpose(1, 2).contiguous(),
        [m.weight.shape[0] for m in into],
        [m.weight.shape[0] for m in from_q],
    )


def rotation(cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """[T, d, d] matrices R with x @ R == apply_rotary(x, cos, sin, interleave) per row."""
    tokens, half = cos.shape
    rot = cos.new_zeros(tokens, 2 * half, 2 * half)
    idx = torch.arange(half)
    first, second = (2 * idx, 2 * idx + 1) if interleave else (idx, idx + half)
    # out[:, :half] = x1 cos - x2 sin; out[:, half:] = x2 cos + x1 sin
    rot[:, first, idx] = cos
    rot[:, second, idx] = -sin
    rot[:, second, idx + half] = cos
    rot[:, first, idx + half] = sin
    return rot


def _rotate(x: torch.Tensor, rot: torch.Tensor) -> torch.Tensor:
    """x [T, ..., d] @ rot [T, d, d], the middle dims flattened into the batched GEMM."""
    shape = x.shape
    return torch.bmm(x.reshape(shape[0], -1, shape[-1]), rot).view(shape)


def _attend(attn: MLAttention, q_full, cache, batch: ForwardBatch, selected) -> torch.Tensor:
    """MLAttention._attend_decode for all-decode rows, in bmm form: q [T, H, 576] over each
    row's whole padded context or its top-k entries; returns [T, H, rank]."""
    slots, allowed = batch.decode_slots, batch.decode_valid
    if selected is not None:
        slots, allowed = slots.gather(1, selected), allowed.gather(1, selected)  # [T, k]
    ctx = gather_rows(cache, slots)  # [T, L or k, 576]
    scores = torch.bmm(q_full, ctx.transpose(1, 2)) * attn.scale  # [T, H, L]
    scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
    return torch.bmm(scores.softmax(dim=-1), ctx[..., : attn.rank])


def _select(indexer: Indexer, batch: ForwardBatch, q, weights, cache) -> torch.Tensor | None:
    """Indexer._select_decode for all-decode rows: every row is a decode row, so no row gather
    (the `indexer` op is the torch reference here: the fused path runs over torch kernels)."""
    if batch.decode_slots.shape[1] <= indexer.topk:
        return None
    return batch.kernels.indexer(q, weights, cache, batch.decode_slots, batch.decode_valid,
                                 indexer.topk)  # fmt: skip


class FusedDecode:
    """The decode forward of `model` (a loaded DsaMoeForCausalLM), or None where not applicable."""

    def __init__(self, model: nn.Module, weights: list[LayerWeights], native=None) -> None:
        self.model = model
        self.weights = weights
        self.indexer_interleave = model.config.indexer_rope_interleave
        self.native = native  # kernels/cpu_decode.py's DecodeLayers, or None: the Python layers
        self._segments: dict[tuple[int, ...], list | None] = {}  # taps -> native layer runs

    @classmethod
    def build(cls, model: nn.Module, native: bool = False) -> FusedDecode | None:
        layers = model.model.layers[: model.config.num_hidden_layers]
        weights = [_fused_weights(layer) for layer in layers]
        if any(w is None for w in weights):
            return None
        on_cpu = all(w.w_in.device.type == "cpu" for w in weights)
        return cls(model, weights, cpu_decode.build(layers, weights) if native and on_cpu else None)

    @staticmethod
    def accepts(batch: ForwardBatch) -> bool:
        """All rows are decode rows (in order): no prefill chunk, no extend run."""
        rows = batch.decode_rows.numel()
        return not batch.extends and rows == batch.input_ids.shape[0] and rows > 0

    @torch.inference_mode()
    def forward(self, taps: tuple[int, ...] = ()) -> torch.Tensor:
        """Final normed hidden states [T, H]; with `taps` (a DFlash drafter's target layers),
        [final ‖ those layers' outputs], as `DsaMoeForCausalLM.forward(taps)`."""
        batch = current_batch()
        model = self.model
        x = model.model.embed_tokens(batch.input_ids)
        cos, sin = model.rotary.cos_sin(batch.positions, x.dtype)
        last = len(self.weights) - 1
        segments = self._native_segments(taps)
        if segments is not None:
            outputs = {}
            for end, run in segments:  # consecutive layer runs, each ending at a tap (or last)
                x = run.forward(x, cos.contiguous(), sin.contiguous(), batch.kv_cache,
                                batch.index_cache, batch.decode_slots, batch.decode_valid,
                                batch.out_slots)  # fmt: skip
                outputs[end] = x
            norm = model.model.norm
            final = cpu_decode.extension().rms_norm(x, norm.weight, norm.eps)
            return join_taps(final, outputs, taps, last)
        rot = rotation(cos, sin, interleave=True)
        rot_index = rot if self.indexer_interleave else rotation(cos, sin, interleave=False)
        selection, outputs = None, {}
        for i, (layer, weights) in enumerate(zip(model.model.layers, self.weights)):
            x, selection = self._layer(layer, weights, x, (rot, rot_index), selection)
            if i in taps:
                outputs[i] = x
        norm = model.model.norm
        return join_taps(torch.rms_norm(x, norm.weight.shape, norm.weight, norm.eps), outputs,
                         taps, last)  # fmt: skip

    def _native_segments(self, taps: tuple[int, ...]) -> list | None:
        """[(last layer, native run)] covering every layer, split after each tap; None for the
        Python layers: no native build, or a split before a layer that reuses the previous
        layer's indexer selection (a native run starts with none)."""
        if self.native is None:
            return None
        if taps not in self._segments:
            layers = self.model.model.layers[: len(self.weights)]
            ends = sorted({*(t for t in taps if t < len(self.weights) - 1), len(self.weights) - 1})
            starts = [0, *(e + 1 for e in ends[:-1])]
            splittable = all(layers[s].self_attn.indexer is not None for s in starts[1:])
            self._segments[taps] = [
                (e, self.native if (s, e) == (0, len(self.weights) - 1) else
                 cpu_decode.build(list(layers[s : e + 1]), self.weights[s : e + 1]))
                for s, e in zip(starts, ends)
            ] if splittable else None  # fmt: skip
        return self._segments[taps]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's logits of `hidden` (the LM head as a native small-batch linear)."""
        head = self.model.lm_head
        one_rank = self.model.parallel.world == 1  # (the engine uses this path on one rank only)
        if self.native is None or not one_rank or head.weight.dtype != torch.float32:
            return self.model.logits(hidden)
        return cpu_decode.extension().linear(hidden, head.weight)

    def _layer(self, layer, weights: LayerWeights, x, rots, shared: Selection | None):
        ln = layer.input_layernorm
        h = torch.rms_norm(x, ln.weight.shape, ln.weight, ln.eps)
        attn, selection = self._attention(layer.self_attn, weights, h, rots, shared)
        x = x + attn
        ln = layer.post_attention_layernorm
        h = torch.rms_norm(x, ln.weight.shape, ln.weight, ln.eps)
        return x + self._ffn(layer.mlp, weights, h), selection

    def _attention(self, attn: MLAttention, weights: LayerWeights, x, rots, shared):
        batch = current_batch()
        tokens, heads = x.shape[0], attn.n_heads
        parts = F.linear(x, weights.w_in, weights.b_in).split(weights.split_in, dim=-1)
        q_a, kv = parts[0], parts[1]
        ln = attn.q_a_layernorm
        q_resid = torch.rms_norm(q_a, ln.weight.shape, ln.weight, ln.eps)
        q_parts = F.linear(q_resid, weights.w_qres).split(weights.split_qres, dim=-1)
        q = q_parts[0].view(tokens, heads, attn.nope_dim + attn.rope_dim)
        q_nope, q_pe = q.split([attn.nope_dim, attn.rope_dim], dim=-1)
        latent, k_pe = kv.split([attn.rank, attn.rope_dim], dim=-1)
        ln = attn.kv_a_layernorm
        latent = torch.rms_norm(latent, ln.weight.shape, ln.weight, ln.eps)
        cache = batch.kv_cache[attn.layer_id]
        entry = torch.cat([latent, _rotate(k_pe, rots[0])], -1)  # [T, 576]
        cache.index_copy_(0, batch.out_slots, entry.to(cache.dtype))
        if attn.indexer is not None:
            shared = self._indexer(attn.indexer, parts[2], parts[3], q_parts[1], rots[1])
        q_lat = torch.bmm(q_nope.transpose(0, 1), weights.w_uk).transpose(0, 1)  # [T, H, rank]
        q_full = torch.cat([q_lat, _rotate(q_pe, rots[0])], -1)  # [T, H, 576]
        out = _attend(attn, q_full, cache, batch, shared.decode)  # [T, H, rank]
        out = torch.bmm(out.transpose(0, 1), weights.w_uv_t).transpose(0, 1)  # [T, H, v]
        return attn.o_proj(out.reshape(tokens, -1)), shared

    def _indexer(self, indexer: Indexer, k, weights, q, rot) -> Selection:
        batch = current_batch()
        q = q.view(-1, indexer.n_heads, indexer.head_dim)  # [T, nI, dI]
        norm = indexer.k_norm
        k = F.layer_norm(k, norm.normalized_shape, norm.weight, norm.bias, norm.eps)
        d = indexer.rope_dim
        q = torch.cat([_rotate(q[..., :d], rot), q[..., d:]], dim=-1)
        k = torch.cat([_rotate(k[..., :d], rot), k[..., d:]], dim=-1)
        cache = batch.index_cache[indexer.cache_index]
        cache.index_copy_(0, batch.out_slots, k.to(cache.dtype))
        weights = weights.float() * (indexer.n_heads**-0.5 * indexer.head_dim**-0.5)
        return Selection([], _select(indexer, batch, q, weights, cache))

    @staticmethod
    def _ffn(mlp: nn.Module, weights: LayerWeights, x: torch.Tensor) -> torch.Tensor:
        dense = mlp if isinstance(mlp, MLP) else mlp.shared_experts
        gate, up = F.linear(x, weights.mlp_gate_up).chunk(2, dim=-1)
        out = dense.down_proj(F.silu(gate) * up)
        if isinstance(mlp, MoE):
            index, routing = mlp.gate(x)
            out = mlp.experts(x, index, routing) + out
        return out

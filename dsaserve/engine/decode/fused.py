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
batches, the MTP layer and models not in plain fp32 linears keep the layered path; the native
form also takes bf16 weights and block-FP8 ones kept as stored (their scales beside them).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from dsaserve.engine.decode import native as native_layers
from dsaserve.kernels.block_fp8 import FP8_DTYPE, KEPT_BLOCK
from dsaserve.layers.forward_batch import ForwardBatch, current_batch, gather_rows
from dsaserve.layers.fp8_linear import Fp8Linear
from dsaserve.layers.indexer import Indexer, Selection
from dsaserve.layers.linear import ColumnParallelLinear, RowParallelLinear
from dsaserve.layers.mla import MLAttention
from dsaserve.layers.moe import MLP, MoE
from dsaserve.layers.rotary import rotation

NATIVE_DTYPES = (torch.float32, torch.bfloat16)


class LayerWeights(NamedTuple):
    w_in: torch.Tensor  # [q_lora + rank + rope (+ dI + nI), H]
    b_in: torch.Tensor | None
    w_qres: torch.Tensor  # [heads * qk_head (+ nI * dI), q_lora]
    mlp_gate_up: torch.Tensor  # [2 I, H] of the dense MLP or the shared expert
    w_uk: torch.Tensor  # [H, nope, rank] (contiguous copy of kv_b_proj's key half)
    w_uv_t: torch.Tensor  # [H, rank, v]
    split_in: list[int]
    split_qres: list[int]
    # block FP8: the stacks' scale grids, and the indexer's head weights (not quantised, so
    # not in the FP8 w_in, which then ends at the index key)
    scales: tuple[torch.Tensor | None, ...] = (None, None, None)  # w_in, w_qres, mlp_gate_up
    w_idx: torch.Tensor | None = None  # [nI, H]


def _plain(modules: list[nn.Module], ranks: bool) -> bool:
    """Linears the fused forms read: whole ones (a one-rank parallel Linear is a whole one), or
    with `ranks` (the native layers under --tp / --ep) this rank's slices."""
    return all(_whole(m, ranks) for m in modules)


def _whole(module: nn.Module, ranks: bool) -> bool:
    if type(module) in (nn.Linear, nn.LayerNorm):
        return True
    if isinstance(module, ColumnParallelLinear | RowParallelLinear | Fp8Linear):
        return ranks or getattr(module.weight, "shard", None) is None
    return False


def stacked(weights: list[torch.Tensor]) -> torch.Tensor:
    """`weights` stacked by rows in one tensor, each of them then a view of its rows: the fused
    forms read the stack and the layered model the views, so memory holds the bytes once (the
    same values, each view contiguous: the layered model's math is unchanged)."""
    stack = torch.cat([w.detach() for w in weights])
    row = 0
    for weight in weights:
        weight.data = stack[row : row + weight.shape[0]]
        row += weight.shape[0]
    return stack


def _stack(linears: list[nn.Module]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The linears' weights stacked (`stacked`), and for FP8 ones their scale grids: stacked too
    where every weight fills whole 128-row blocks, else one scale row per weight row (a small
    new tensor: a weight of 576 rows ends inside a block)."""
    weight = stacked([m.weight for m in linears])
    if weight.dtype != FP8_DTYPE:
        return weight, None
    scales = [m.weight_scale_inv for m in linears]
    if all(m.weight.shape[0] % KEPT_BLOCK == 0 for m in linears):
        return weight, stacked(scales)
    per_row = [s.detach().repeat_interleave(KEPT_BLOCK, 0)[: m.weight.shape[0]]
               for s, m in zip(scales, linears)]  # fmt: skip
    return weight, torch.cat(per_row)


def _native_dtypes(groups: list[list[nn.Module]], linears: list[nn.Module], experts) -> bool:
    """Each stacked group of one dtype; the float weights of one of NATIVE_DTYPES (the others
    block FP8: fp32 or bf16 activations either way)."""
    if any(len({m.weight.dtype for m in group}) != 1 for group in groups):
        return False
    dtypes = {m.weight.dtype for m in linears}
    if experts is not None:
        dtypes.add(experts.down_proj.dtype)
    floats = dtypes - {FP8_DTYPE, torch.uint8}  # uint8: NVFP4 experts' codes
    return len(floats) <= 1 and floats <= set(NATIVE_DTYPES)


def _fused_weights(layer: nn.Module, ranks: bool) -> LayerWeights | None:
    attn: MLAttention = layer.self_attn
    ffn = layer.mlp.shared_experts if isinstance(layer.mlp, MoE) else layer.mlp
    experts = layer.mlp.experts if isinstance(layer.mlp, MoE) else None
    if ffn is None:
        return None
    into = [attn.q_a_proj, attn.kv_a_proj_with_mqa]
    from_q = [attn.q_b_proj]
    head_weights = []
    if attn.indexer is not None:
        into.append(attn.indexer.wk)
        head_weights.append(attn.indexer.weights_proj)
        from_q.append(attn.indexer.wq_b)
    gate_up = [ffn.gate_proj, ffn.up_proj]
    linears = [*into, *head_weights, *from_q, attn.o_proj, *gate_up, ffn.down_proj]
    # fp32 or bf16 (one dtype) or block FP8: the Python path runs fp32 only (in bf16 the layered
    # path's roundings are what docs/determinism.md's bf16 bounds were measured on); the native
    # layers read bf16 and FP8 weights too, with fp32 activations.
    if not _plain(linears, ranks) or not _native_dtypes([into, from_q, gate_up], linears, experts):
        return None
    fp8 = into[0].weight.dtype == FP8_DTYPE
    if not fp8:
        into, head_weights = into + head_weights, []
    w_in, in_scale = _stack(into)
    biases = [m.bias for m in into]
    given = [b for b in biases if b is not None]
    b_in = None
    if given:
        b_in = torch.cat([b if b is not None else given[0].new_zeros(m.weight.shape[0])
                          for b, m in zip(biases, into)])  # fmt: skip
    w_qres, qres_scale = _stack(from_q)
    mlp_gate_up, gate_up_scale = _stack(gate_up)
    w_uk, w_uv = attn.absorbed()
    return LayerWeights(
        w_in,
        b_in,
        w_qres,
        mlp_gate_up,
        w_uk.contiguous(),
        w_uv.transpose(1, 2).contiguous(),
        [m.weight.shape[0] for m in into],
        [m.weight.shape[0] for m in from_q],
        (in_scale, qres_scale, gate_up_scale),
        head_weights[0].weight.detach() if head_weights else None,
    )


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
    """The decode forward of `model` (a loaded DsaMoeForCausalLM), or None where not applicable.

    Two forms: the native layers (engine/decode/native.py: embedding to logits in one C++ call,
    fp32, bf16 or block-FP8 weights, an fp32, bf16 or FP8 pool; under --tp / --ep this rank's
    shard, its collectives inside the call), and the Python layers below (fp32 weights and pool,
    one rank only: the reference, and what `--enable-torch-compile` traces)."""

    def __init__(self, model: nn.Module, weights: list[LayerWeights], native=None) -> None:
        self.model = model
        self.weights = weights
        self.indexer_interleave = model.config.indexer_rope_interleave
        self.native = native  # engine/decode/native.py's DecodeLayers, or None: the Python layers
        self.python = weights[0].w_in.dtype == torch.float32
        self._rotary = (torch.zeros(0, 1), torch.zeros(0, 1))  # cos, sin [positions, rope / 2]

    @classmethod
    def build(cls, model: nn.Module, native: bool = False, cache_dtype: torch.dtype = torch.float32,
              parallel=None) -> FusedDecode | None:  # fmt: skip
        """None where neither form runs: the native one takes fp32 / bf16 / block-FP8 weights and an
        fp32, bf16 or FP8 (uint8) pool; the Python one fp32 weights and an fp32 pool. `parallel`
        (a ParallelState of several ranks): the native form only, over this rank's shard."""
        ranks = parallel is not None and parallel.world > 1
        layers = model.model.layers[: model.config.num_hidden_layers]
        weights = [_fused_weights(layer, ranks) for layer in layers]
        if any(w is None for w in weights):
            return None
        on_cpu = all(w.w_in.device.type == "cpu" for w in weights)
        python = not ranks and weights[0].w_in.dtype == cache_dtype == torch.float32
        stored = cache_dtype in (torch.float32, torch.bfloat16, torch.uint8)
        built = None
        if native and on_cpu and stored:
            built = native_layers.build(model, layers, weights, parallel if ranks else None)
        if built is None and not python:
            return None
        return cls(model, weights, built)

    @staticmethod
    def accepts(batch: ForwardBatch) -> bool:
        """All rows are decode rows (in order): no prefill chunk, no extend run."""
        rows = batch.decode_rows.numel()
        return not batch.extends and rows == batch.input_ids.shape[0] and rows > 0

    @torch.inference_mode()
    def forward(self) -> torch.Tensor:
        """The logits [T, V] of every row of the installed (all-decode) batch."""
        batch = current_batch()
        if self.native is not None:
            return self.decode_logits(batch.input_ids, batch.positions, batch.decode_slots,
                                      batch.kv_cache, batch.index_cache)  # fmt: skip
        model = self.model
        x = model.model.embed_tokens(batch.input_ids)
        cos, sin = model.rotary.cos_sin(batch.positions, x.dtype)
        rot = rotation(cos, sin, interleave=True)
        rot_index = rot if self.indexer_interleave else rotation(cos, sin, interleave=False)
        selection = None
        for layer, weights in zip(model.model.layers, self.weights):
            x, selection = self._layer(layer, weights, x, (rot, rot_index), selection)
        norm = model.model.norm
        return self.model.logits(torch.rms_norm(x, norm.weight.shape, norm.weight, norm.eps))

    def decode_logits(self, ids, positions, slots, kv_cache, index_cache,
                      last: int | None = None, taps: tuple[int, ...] = (),
                      with_logits: bool = True, groups: tuple | None = None):  # fmt: skip
        """The native step: row t (token ids[t] at position p = positions[t]) writes its entry
        at slots[t, p] and attends slots[t, :p + 1]; returns fp32 logits [T, V]. `last`: the
        largest position, where the caller knows it. With `taps` (a DFlash drafter's target
        layers), (logits, [T, len(taps) * H] those layers' outputs, the last layer's after the
        final norm, as `join_taps`); without `with_logits` the LM head is skipped (its logits
        are [0, V]). `groups` (ranks under DP attention): (every attention group's rows, this
        rank's group, ranks a group): the MLP block and the LM head take every group's rows."""
        if last is None:
            last = int(positions.max()) if positions.numel() else 0  # a group without rows
        cos, sin = self.rotary_tables(last + 1)
        hidden = self.model.config.hidden_size
        tapped = torch.empty(ids.shape[0], len(taps) * hidden) if taps else native_layers.NONE
        rows, group, attn_tp = groups if groups is not None else ([], 0, 1)
        rows = list(rows) if len(rows) > 1 else []  # one group: no gathers
        logits = self.native.forward(ids, positions, slots.contiguous(), kv_cache, index_cache,
                                     cos, sin, list(taps), tapped, with_logits, rows, group,
                                     attn_tp)  # fmt: skip
        return (logits, tapped) if taps else logits

    def rotary_tables(self, positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 cos / sin [n, rope / 2] for positions 0..n-1 (n >= positions), grown by doubling."""
        if self._rotary[0].shape[0] < positions:
            n = max(positions, 2 * self._rotary[0].shape[0], 1024)
            cos, sin = self.model.rotary.cos_sin(torch.arange(n), torch.float32)
            self._rotary = (cos.contiguous(), sin.contiguous())
        return self._rotary

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

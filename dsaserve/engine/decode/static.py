"""The decode forward a CUDA graph can hold: static shapes, tensor-only, no host synchronisation.

A captured step replays the same kernels with the same shapes on whatever the static input
buffers hold, so nothing in it may read a device value on the host (`.item()`, `.tolist()`,
`int(t)`, `bool(t)`, `nonzero`, boolean-mask indexing) or size a tensor from data. Over an
all-decode `ForwardBatch` whose every tensor has a fixed shape (rows padded to the bucket, the
slot table and its mask padded to the context bucket) this is the layered model's forward with
one part swapped:

- attention, the indexer and the KV writes are the layers' own (`MLAttention.forward` over
  decode rows is already tensor-only: index_copy_ writes, gathers through the slot table, the
  indexer's top-k by `topk_earliest` (cumsum / scatter, no sort), masks instead of lengths).
  Whether the indexer runs at all is decided by the slot table's width (a Python int), so a
  context bucket above `index_topk` always runs it: a row shorter than index_topk then selects
  its whole context plus masked picks, which is what dense attention computes.
- the routed experts run the `moe` op (torch: `static_experts`, kernels/static_moe.py; triton:
  `grouped_experts`, kernels/triton_moe.py) instead of `Experts.forward`, whose grouping is
  done on the host.

The layers are called as modules, so FP8 Linears (`Fp8Linear`), bf16 and fp32 weights, an FP8
KV cache and every kernel backend work unchanged. Under `--tp N` each rank runs it over its
shard (heads, vocab and every expert's slice), its collectives the layers' own device
all-reduces and all-gathers (NCCL, which a graph captures; shared memory on CPU); the rank rounds
that agree on the batch and the bucket stay outside, on the host (engine/ranks/rounds.py). Under DP
attention every group replays the same bucket (the largest group's rows, the widest context),
so the MLP's gather over the groups has static shapes. Not with EP (the local experts are picked
on the host) or a context-parallel or layer-split cache.
tests/test_static_decode.py runs it with every tensor on the `meta` device, where any host read
of a value raises, and checks that the layered and the fused decode paths do raise there.
"""

from __future__ import annotations

import torch
from torch import nn

from dsaserve.layers.forward_batch import current_batch
from dsaserve.layers.moe import MoE
from dsaserve.layers.taps import join_taps


class StaticDecode:
    """The capturable decode forward of `model` (a loaded one-rank DsaMoeForCausalLM)."""

    def __init__(self, model: nn.Module, taps: tuple[int, ...] = ()) -> None:
        self.model = model
        self.layers = model.model.layers[: model.config.num_hidden_layers]
        self.taps = taps  # a DFlash drafter's target layers: their outputs join the result

    @staticmethod
    def supports(model: nn.Module) -> bool:
        """Every expert local (no EP), no context-parallel attention."""
        layers = model.model.layers[: model.config.num_hidden_layers]
        local = all(
            not isinstance(layer.mlp, MoE)
            or layer.mlp.experts.gate_up_proj.shape[0] == layer.mlp.experts.num_experts
            for layer in layers
        )
        return local and all(x.self_attn.cp is None for x in layers)

    @torch.inference_mode()
    def forward(self) -> torch.Tensor:
        """Final normed hidden states [T, H] of the installed all-decode batch (with taps,
        [final ‖ tapped layers' outputs], as `DsaMoeForCausalLM.forward`)."""
        batch = current_batch()
        model = self.model
        x = model.model.embed_tokens(batch.input_ids)
        cos, sin = model.rotary.cos_sin(batch.positions, x.dtype)
        selection, outputs = None, {}
        for i, layer in enumerate(self.layers):
            attn, selection = layer.self_attn(layer.input_layernorm(x), cos, sin, selection)
            x = x + attn
            x = x + self._mlp(layer.mlp, layer.post_attention_layernorm(x))
            if i in self.taps:
                outputs[i] = x
        return join_taps(model.model.norm(x), outputs, self.taps, len(self.layers) - 1)

    def _mlp(self, mlp: nn.Module, h: torch.Tensor) -> torch.Tensor:
        """As `DecoderLayer._mlp`: over every attention group's rows (each padded to the bucket
        the groups share), each rank's part summed over all ranks."""
        p = self.model.parallel
        return p.own_rows(p.all_reduce_world(self._ffn(mlp, p.gather_groups(h))))

    @staticmethod
    def _ffn(mlp: nn.Module, h: torch.Tensor) -> torch.Tensor:
        if not isinstance(mlp, MoE):
            return mlp(h)
        index, weights = mlp.gate(h)
        out = current_batch().kernels.moe(mlp.experts, h, index, weights)  # the `moe` op
        return out + mlp.shared_experts(h) if mlp.shared_experts is not None else out

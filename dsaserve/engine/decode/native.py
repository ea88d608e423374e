"""The native CPU decode layers (kernels/cpu_decode.cpp): built once per machine, for FusedDecode.

`DecodeLayers` runs every decoder layer of an all-decode fp32 batch in one C++ call (the same
math as fused.py, which stays the reference and the fallback). The extension is
compiled with the machine's own compiler at first use (`torch.utils.cpp_extension`, about 30 s
on two cores; cached under `$TORCH_EXTENSIONS_DIR`, by default ~/.cache/torch_extensions), with
`-O3 -march=native`, since it is built where it runs, under kernels/native_build.py's lock and
timeout. Where it cannot be built (no compiler, a compile error, a timeout) the engine says so
once and keeps the Python fused path.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch
from torch import nn

from dsaserve.distributed.parallel_state import ParallelState
from dsaserve.kernels import native_build
from dsaserve.layers.mla import MLAttention
from dsaserve.layers.moe import MoE

SOURCE = Path(native_build.__file__).parent / "cpu_decode.cpp"
NONE = torch.empty(0)  # stands for an absent tensor (no bias, a dense layer's router)


@functools.cache
def extension():
    """The compiled module, or None (with one warning naming why) where it cannot be built."""
    return native_build.load_or_none(
        "dsaserve_cpu_decode",
        SOURCE,
        "the native decode layers",
        "native CPU decode unavailable; using the Python fused path",
    )


def _or_none(t: torch.Tensor | None) -> torch.Tensor:
    return NONE if t is None else t.detach().contiguous()


def _small(t: torch.Tensor | None) -> torch.Tensor:
    """Norm weights, biases: fp32 copies (a bf16 model's included; they are tiny)."""
    return NONE if t is None else t.detach().float().contiguous()


def _scale(module: nn.Module | None, name: str = "weight") -> torch.Tensor | None:
    """A block-FP8 weight's scale grid (`{name}_scale_inv`), an NVFP4 one's group scales
    (`{name}_scale`), or None for a float one."""
    return getattr(module, f"{name}_scale_inv", getattr(module, f"{name}_scale", None))


def layer_fields(layer: nn.Module, weights) -> tuple[list, list, list, list[int], list[float]]:
    """The tensors, their scales and row scales, the ints and floats of one layer, in
    cpu_decode_layer.h's Slot / Int / Float order. Matrices keep their dtype (fp32, bf16, block
    FP8 or NVFP4 with their scales: the native loops read each as stored)."""
    attn: MLAttention = layer.self_attn
    mlp = layer.mlp
    moe = isinstance(mlp, MoE)
    dense = mlp.shared_experts if moe else mlp
    idx = attn.indexer
    o_bias = attn.o_proj.bias if getattr(attn.o_proj, "part_index", 0) == 0 else None  # once
    small = [layer.input_layernorm.weight, weights.b_in, attn.q_a_layernorm.weight,
             attn.kv_a_layernorm.weight, o_bias, layer.post_attention_layernorm.weight,
             mlp.gate.e_score_correction_bias if moe else None,
             idx.k_norm.weight if idx is not None else None,
             idx.k_norm.bias if idx is not None else None]  # fmt: skip
    in_norm, b_in, qa_norm, kv_norm, b_o, post_norm, router_bias, k_norm_w, k_norm_b = (
        _small(t) for t in small
    )
    tensors = [
        in_norm, _or_none(weights.w_in), b_in, qa_norm, _or_none(weights.w_qres), kv_norm,
        weights.w_uk.transpose(1, 2).contiguous(),  # [H, rank, nope]
        weights.w_uv_t.transpose(1, 2).contiguous(),  # [H, v, rank]
        _or_none(attn.o_proj.weight), b_o, post_norm, _or_none(weights.mlp_gate_up),
        _or_none(dense.down_proj.weight), _or_none(mlp.gate.weight if moe else None),
        router_bias, _or_none(mlp.experts.gate_up_proj if moe else None),
        _or_none(mlp.experts.down_proj if moe else None), k_norm_w, k_norm_b,
        _or_none(weights.w_idx),
    ]  # fmt: skip
    experts = mlp.experts if moe else None
    in_scale, qres_scale, gate_up_scale = weights.scales
    # by Slot: kWIn, kWQres, kWO, kMlpGateUp, kMlpDown, kExpGateUp, kExpDown (NONE elsewhere)
    scaled = {1: in_scale, 4: qres_scale, 8: _scale(attn.o_proj), 11: gate_up_scale,
              12: _scale(dense.down_proj), 15: _scale(experts, "gate_up_proj"),
              16: _scale(experts, "down_proj")}  # fmt: skip
    scales = [_or_none(scaled.get(slot)) for slot in range(len(tensors))]
    # NVFP4 experts: each row's global scale
    rowed = {15: getattr(experts, "gate_up_proj_scale_2", None),
             16: getattr(experts, "down_proj_scale_2", None)}  # fmt: skip
    row_scales = [_or_none(rowed.get(slot)) for slot in range(len(tensors))]
    config = layer.mlp.gate if moe else None
    ints = [
        attn.layer_id, idx.cache_index if idx is not None else -1, attn.q_a_proj.weight.shape[0],
        attn.rank, attn.rope_dim, idx.head_dim if idx is not None else 0,
        idx.n_heads if idx is not None else 0, attn.n_heads, attn.nope_dim, attn.v_dim,
        int(idx.interleave) if idx is not None else 0, idx.topk if idx is not None else 0,
        config.n_group if moe else 1, config.topk_group if moe else 1,
        config.top_k if moe else 0, int(config.normalise) if moe else 0,
        experts.first if moe else 0,  # under --ep this rank's experts start there
    ]  # fmt: skip
    floats = [
        layer.input_layernorm.eps, attn.q_a_layernorm.eps, attn.kv_a_layernorm.eps,
        layer.post_attention_layernorm.eps, idx.k_norm.eps if idx is not None else 1e-6,
        attn.scale, config.scaling if moe else 1.0,
    ]  # fmt: skip
    return tensors, scales, row_scales, ints, [float(f) for f in floats]


def build(model: nn.Module, layers: list[nn.Module], weights: list,
          parallel: ParallelState | None = None) -> object | None:  # fmt: skip
    """A DecodeLayers over `layers` (with their FusedDecode weights) and the model's embedding,
    final norm and LM head, or None without the build. `parallel` (several ranks): this rank's
    shard, exchanging its parts over the ranks' shared-memory files (`world_shm`, and under DP
    attention its group's `attn_shm`)."""
    module = extension()
    if module is None:
        return None
    fields = [layer_fields(layer, w) for layer, w in zip(layers, weights)]
    norm, embed = model.model.norm, model.model.embed_tokens
    head = [_or_none(embed.weight), _small(norm.weight), _or_none(model.lm_head.weight)]
    built = module.DecodeLayers(*(list(column) for column in zip(*fields)), head,
                                float(norm.eps), getattr(embed, "start", 0),
                                model.config.vocab_size)  # fmt: skip
    if parallel is not None:
        world, attn = parallel.world_shm, parallel.attn_shm
        built.set_comm(world.memory, world.size, world.index, world.timeout, False)
        if attn is not None and attn is not world:  # DP attention, several ranks a group
            built.set_comm(attn.memory, attn.size, attn.index, attn.timeout, True)
    return built

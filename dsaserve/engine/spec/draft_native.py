"""The DFlash drafter's block forward as one C++ call on CPU (kernels/dflash_block.cpp).

`DFlashDraftModel.block_hidden` with the torch `draft_attention` op stays the reference and the
path on other devices; on CPU a drafter of fp32 or bf16 weights runs its layers here instead, the
same math in fp32 (a bf16 drafter's weights are read as they are, its activations kept in fp32),
since a small drafter's cost in torch is its ~1500 ops' overhead, not their arithmetic. Built
with the machine's compiler at first use, like the native decode layers (engine/decode/native.py);
where it cannot be built the engine says so once and keeps the torch path.
"""

from __future__ import annotations

import functools
from pathlib import Path

import torch

from dsaserve.kernels import native_build
from dsaserve.models.dflash import DFlashDraftModel

SOURCE = Path(native_build.__file__).parent / "dflash_block.cpp"
NONE = torch.empty(0)


@functools.cache
def extension():
    """The compiled module, or None (with one warning naming why) where it cannot be built."""
    return native_build.load_or_none(
        "dsaserve_dflash_block",
        SOURCE,
        "the native DFlash drafter",
        "native DFlash drafter unavailable; using the torch path",
    )


def _weight(*linears) -> torch.Tensor:
    return torch.cat([linear.weight.detach() for linear in linears]).contiguous()


def _bias(*linears) -> torch.Tensor:
    if all(linear.bias is None for linear in linears):
        return NONE
    return torch.cat([linear.bias.detach().float() if linear.bias is not None
                      else torch.zeros(linear.out_features) for linear in linears])  # fmt: skip


def _small(t: torch.Tensor) -> torch.Tensor:
    return t.detach().float().contiguous()


def layer_tensors(layer) -> list[torch.Tensor]:
    """One draft layer's tensors in dflash_block.cpp's `Layer` order."""
    attn, mlp = layer.self_attn, layer.mlp
    conv = [NONE] * 4
    if layer.attention_conv is not None:
        a, m = layer.attention_conv, layer.mlp_conv
        conv = [_weight(a.kernel_projection), _small(a.base_kernel),
                _weight(m.kernel_projection), _small(m.base_kernel)]  # fmt: skip
    return [
        _small(layer.input_layernorm.weight), _small(layer.post_attention_layernorm.weight),
        _small(attn.q_norm.weight), _small(attn.k_norm.weight),
        _weight(attn.q_proj, attn.k_proj, attn.v_proj),
        _bias(attn.q_proj, attn.k_proj, attn.v_proj), _weight(attn.o_proj), _bias(attn.o_proj),
        _weight(mlp.gate_proj, mlp.up_proj), _weight(mlp.down_proj), *conv,
    ]  # fmt: skip


class NativeBlock:
    """`block_hidden` and `context_entries` of a drafter on CPU; built by `build`, whose weights
    it copies (rebuild after changing them)."""

    def __init__(self, module, drafter: DFlashDraftModel, windows: list[int | None],
                 scale: float) -> None:  # fmt: skip
        config = drafter.config
        ints = [config.hidden_size, config.num_heads, config.num_kv_heads, config.head_dim,
                config.conv_kernel_size, config.conv_group_size]  # fmt: skip
        self.drafter = drafter
        self.block = module.DraftBlock(
            [layer_tensors(layer) for layer in drafter.layers], [int(c) for c in config.causal],
            [w or 0 for w in windows], ints, _small(drafter.norm.weight), _weight(drafter.fc),
            _small(drafter.hidden_norm.weight), float(config.rms_norm_eps), float(scale),
        )  # fmt: skip

    def hidden(self, noise: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor,
               slots: list[torch.Tensor], lens: list[int]) -> torch.Tensor:  # fmt: skip
        """noise [R, B, H] at positions [R, B] (request r's block starts at lens[r], after its
        context entries cache[:, slots[r][:lens[r]]]) -> the normed hidden [R, B, H], in the
        noise's dtype."""
        rows, block, hidden = noise.shape
        cos, sin = self.drafter.cos_sin(positions, torch.float32)
        flat = noise.reshape(rows * block, hidden).float().contiguous()
        out = self.block.forward(flat, cos.contiguous(), sin.contiguous(), cache, slots, lens)
        return out.view(rows, block, hidden).to(noise.dtype)

    def write(self, cache: torch.Tensor, taps: torch.Tensor, positions: torch.Tensor,
              slots: torch.Tensor) -> None:  # fmt: skip
        """`DraftContext.write`: the entries of the tokens whose tapped states are `taps` [N,
        n * H] at `positions` [N], into `cache` at `slots` [N]."""
        cos, sin = self.drafter.cos_sin(positions, torch.float32)
        self.block.write_entries(taps.float().contiguous(), cos, sin, cache, slots.contiguous())


def build(drafter: DFlashDraftModel, cache: torch.Tensor,
          windows: list[int | None], scale: float) -> NativeBlock | None:  # fmt: skip
    """The native block forward for `drafter` with context `cache`, or None where it does not
    apply (not on CPU, other dtypes, no build)."""
    dtypes = (torch.float32, torch.bfloat16)
    weights = drafter.fc.weight
    if weights.device.type != "cpu" or cache.device.type != "cpu":
        return None
    if weights.dtype not in dtypes or cache.dtype not in dtypes:
        return None
    module = extension()
    return None if module is None else NativeBlock(module, drafter, windows, scale)

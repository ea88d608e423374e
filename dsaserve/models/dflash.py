"""DFlash / DFlash2 block-diffusion drafters: a small Qwen3-style dense stack beside the target.

The math is the public reference's (z-lab/dflash, `dflash/model.py`); parameter names equal its
safetensors names, so a published drafter loads by lookup (`dflash_loader.py`).

- **Context.** The target's hidden states at `target_layer_ids` (layer i's output; the last
  layer's after the final norm, as transformers' `hidden_states[i + 1]`) are concatenated and
  projected: c = hidden_norm(fc([h_a ‖ h_b ‖ …])). Every draft layer keys and values the
  context from the same c (k_norm, RoPE at the token's position), so a context token's entry is
  computed once, when the target has computed it, and cached (`context_entries`).
- **Block.** Queries are the block's noise embeddings: the target's embedding of
  [last verified token, mask × (block_size - 1)] at positions p .. p + block_size - 1. Each layer
  attends non-causally over [its context entries ‖ the block's own K/V] (a config may make the
  block causal, or window the context), then the SwiGLU MLP; `norm` ends the stack. Block row j
  (j >= 1) predicts the token at position p + j through the target's LM head, times
  `output_multiplier`, soft-capped by `final_logit_softcapping`.
- **DFlash2** adds, per layer, grouped dynamic causal convolutions along the block around the
  attention and around the MLP, and a candidate selector that walks the block left to right
  over each row's top-k tokens, scoring a candidate by its logit plus a low-rank bigram term
  with the token chosen before it (`dflash_selector.py`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from dsaserve.layers.moe import MLP
from dsaserve.layers.norm import RMSNorm
from dsaserve.layers.rotary import Rotary, apply_rotary, rotation
from dsaserve.models.dflash_config import DFlashConfig
from dsaserve.models.dflash_selector import CandidateSelector

# attend(layer, q [R, B, heads, d], k, v [R, B, kv_heads, d]) -> [R, B, heads, d]:
# the block's queries over that layer's context entries and the block's own keys and values
Attend = Callable[[int, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
Rope = Callable[[torch.Tensor], torch.Tensor]  # [N, heads, d] -> rotated at each row's position


def _norm(norm: RMSNorm, x: torch.Tensor) -> torch.Tensor:
    """`norm(x)`; in fp32 as one fused op (the same formula)."""
    if x.dtype != torch.float32 or norm.weight.dtype != torch.float32:
        return norm(x)
    return F.rms_norm(x, norm.weight.shape, norm.weight, norm.eps)


def _projections(module: nn.Module, names: tuple[str, ...], x: torch.Tensor) -> list[torch.Tensor]:
    """The bias-free Linears `names` of `module` applied to x. Serving (no autograd) runs them as
    one GEMM over their concatenated weights, rebuilt whenever a weight changes; training runs
    them one by one."""
    linears = [getattr(module, name) for name in names]
    if torch.is_grad_enabled() or any(linear.bias is not None for linear in linears):
        return [linear(x) for linear in linears]
    key = "_fused_" + "_".join(names)
    versions = tuple((linear.weight._version, linear.weight.data_ptr()) for linear in linears)
    cached = module.__dict__.get(key)
    if cached is None or cached[0] != versions:
        cached = (versions, torch.cat([linear.weight for linear in linears]))
        module.__dict__[key] = cached
    return list(F.linear(x, cached[1]).split([linear.out_features for linear in linears], -1))


class GroupedDynamicCausalConv(nn.Module):
    """out[t] = sum_o (base[o] + dynamic_t[o]) * x[t - o] per group of channels, along the block.

    `base_kernel` [2, K, H] holds a static kernel for the pre- and the post-convolution;
    `kernel_projection` makes both dynamic kernels (one scalar per group and tap) from the
    block input, so the post-convolution of the attention (or MLP) output uses kernels read off
    that sublayer's input."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [R, B, H] -> (pre-convolved x, the post-convolution's dynamic kernels)."""
        dynamic = self.kernel_projection(x).view(*x.shape[:-1], 2, self.kernel_size, self.groups)
        return self._convolve(x, dynamic[..., 0, :, :], self.base_kernel[0]), dynamic[..., 1, :, :]

    def finish(self, x: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        return self._convolve(x, dynamic, self.base_kernel[1])

    def _convolve(self, x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        rows, length, hidden = x.shape
        k, g = self.kernel_size, self.groups
        blocks = F.pad(x.view(rows, length, g, self.group_size), (0, 0, 0, 0, k - 1, 0))
        # taps[:, t, :, :, o] = x[t - o] (zeros before the block): windows of k, newest first
        taps = blocks.unfold(1, k, 1).flip(-1)  # [R, L, G, g, K]
        kernel = base.to(x.dtype).view(k, g, self.group_size).permute(1, 2, 0)  # [G, g, K]
        kernel = kernel + dynamic.reshape(rows, length, k, g).permute(0, 1, 3, 2)[:, :, :, None]
        return (kernel * taps).sum(-1).view(rows, length, hidden)


class DraftAttention(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        h, d, bias = config.hidden_size, config.head_dim, config.attention_bias
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, d
        self.q_proj = nn.Linear(h, config.num_heads * d, bias=bias)
        self.k_proj = nn.Linear(h, config.num_kv_heads * d, bias=bias)
        self.v_proj = nn.Linear(h, config.num_kv_heads * d, bias=bias)
        self.o_proj = nn.Linear(config.num_heads * d, h, bias=bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def keys_values(self, x: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        """x [N, H] -> roped, normed keys and values [N, kv_heads, d]."""
        k, v = _projections(self, ("k_proj", "v_proj"), x)
        return self._rope_keys(k, rope), v.view(x.shape[0], self.num_kv_heads, self.head_dim)

    def _rope_keys(self, k: torch.Tensor, rope: Rope) -> torch.Tensor:
        return rope(_norm(self.k_norm, k.view(k.shape[0], self.num_kv_heads, self.head_dim)))

    def forward(self, x: torch.Tensor, rope: Rope, attend: Callable) -> torch.Tensor:
        rows, block, hidden = x.shape
        flat = x.reshape(rows * block, hidden)
        q, k, v = _projections(self, ("q_proj", "k_proj", "v_proj"), flat)
        q = rope(_norm(self.q_norm, q.view(rows * block, self.num_heads, self.head_dim)))
        k = self._rope_keys(k, rope)
        shape = (rows, block, -1, self.head_dim)
        out = attend(q.view(shape), k.view(shape), v.view(shape))  # [R, B, heads, d]
        return self.o_proj(out.reshape(rows, block, -1))


class DraftLayer(nn.Module):
    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        h = config.hidden_size
        self.self_attn = DraftAttention(config)
        self.mlp = MLP(h, config.intermediate_size)
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.attention_conv = self.mlp_conv = None
        if config.is_v2:
            k, g = config.conv_kernel_size, config.conv_group_size
            self.attention_conv = GroupedDynamicCausalConv(h, k, g)
            self.mlp_conv = GroupedDynamicCausalConv(h, k, g)

    def forward(self, x: torch.Tensor, rope: Rope, attend: Callable) -> torch.Tensor:
        x = x + self._around(self.attention_conv, _norm(self.input_layernorm, x),
                             lambda h: self.self_attn(h, rope, attend))  # fmt: skip
        return x + self._around(self.mlp_conv, _norm(self.post_attention_layernorm, x), self._mlp)

    def _mlp(self, h: torch.Tensor) -> torch.Tensor:
        gate, up = _projections(self.mlp, ("gate_proj", "up_proj"), h)
        return self.mlp.down_proj(F.silu(gate) * up)

    @staticmethod
    def _around(conv, h: torch.Tensor, sublayer: Callable) -> torch.Tensor:
        if conv is None:
            return sublayer(h)
        h, dynamic = conv.prepare(h)
        return conv.finish(sublayer(h), dynamic)


class DFlashDraftModel(nn.Module):
    """The drafter's own weights (the embedding and LM head are the target's)."""

    def __init__(self, config: DFlashConfig) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        self.layers = nn.ModuleList([DraftLayer(config) for _ in range(config.num_layers)])
        self.fc = nn.Linear(len(config.target_layer_ids) * h, h, bias=False)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.candidate_selector = CandidateSelector(config) if config.is_v2 else None
        self.rotary = Rotary(config.rope)

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        if self.rotary.inv_freq.device != positions.device:
            self.rotary.inv_freq = self.rotary.inv_freq.to(positions.device)
        return self.rotary.cos_sin(positions.reshape(-1), dtype)

    def context_entries(self, taps: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """taps [N, len(target_layer_ids) * H] at `positions` [N] -> [layers, N, 2 * kv_heads * d]:
        each layer's [K ‖ V] entry of those context tokens (what the drafter caches)."""
        context = self.hidden_norm(self.fc(taps))
        cos, sin = self.cos_sin(positions, context.dtype)
        rope = lambda t: apply_rotary(t, cos, sin, interleave=False)  # noqa: E731
        entries = []
        for layer in self.layers:
            k, v = layer.self_attn.keys_values(context, rope)
            entries.append(torch.cat([k.flatten(1), v.flatten(1)], dim=-1))  # [K ‖ V]
        return torch.stack(entries)

    def block_hidden(
        self, noise: torch.Tensor, positions: torch.Tensor, attend: Attend
    ) -> torch.Tensor:
        """noise [R, B, H] (the block's embeddings) at positions [R, B] -> normed hidden
        [R, B, H]."""
        # one [rows, d, d] rotation per block row, applied to every layer's q and k in one bmm
        rot = rotation(*self.cos_sin(positions, noise.dtype), interleave=False)
        rope = lambda t: torch.bmm(t, rot)  # noqa: E731  t [rows, heads, d]
        x = noise
        for i, layer in enumerate(self.layers):
            x = layer(x, rope, lambda q, k, v, i=i: attend(i, q, k, v))
        return _norm(self.norm, x)

    def logits(self, hidden: torch.Tensor, lm_head: Callable[[torch.Tensor], torch.Tensor]):
        """The drafter's fp32 logits of rows `hidden` [..., H] through the target's LM head."""
        return self.scale_logits(lm_head(hidden).float())

    def scale_logits(self, raw: torch.Tensor) -> torch.Tensor:
        """LM-head outputs -> the drafter's logits: times `output_multiplier`, soft-capped. Both
        are increasing maps (a positive multiplier), so they keep every row's order: a top-k or
        argmax of the raw outputs picks the same tokens."""
        logits = raw * self.config.output_multiplier
        cap = self.config.final_logit_softcapping
        return torch.tanh(logits / cap) * cap if cap else logits

"""Block FP8 (DeepSeek-V3 style): the format, its dequantisation and quantisation.

A quantised weight `W` [out, in] is stored as `W8` (float8_e4m3fn) and `scale_inv` (float32,
[ceil(out/128), ceil(in/128)]) with W = W8 * scale_inv broadcast over 128 x 128 blocks, edge
blocks partial. Leading batch dimensions (fused experts, [E, out, in]) are allowed throughout.
Converting a checkpoint folder is models/fp8.py's.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_SUFFIX = "_scale_inv"
KEPT_BLOCK = 128  # the scale block the kernels that run FP8 weights as stored take (128 x 128)

# model.md section 6: the Linear weights that published FP8 checkpoints quantise. Norms, the
# router, embeddings, lm_head, indexer.weights_proj / k_norm and eh_proj stay unquantised.
QUANTIZED_WEIGHT_RE = re.compile(
    r"\.(self_attn\.(q_a_proj|q_b_proj|kv_a_proj_with_mqa|kv_b_proj|o_proj|indexer\.wq_b"
    r"|indexer\.wk)|mlp\.(gate_proj|up_proj|down_proj)|mlp\.experts\.\d+\.(gate_proj|up_proj"
    r"|down_proj)|mlp\.shared_experts\.(gate_proj|up_proj|down_proj))\.weight$"
)

Block = int | tuple[int, int]


def block_pair(block: Block) -> tuple[int, int]:
    pair = (block, block) if isinstance(block, int) else tuple(block)
    if len(pair) != 2 or not all(isinstance(b, int) and b > 0 for b in pair):
        raise ValueError(f"block must be a positive int or a pair of them, got {block!r}")
    return pair  # type: ignore[return-value]


def scale_shape(weight_shape: torch.Size | tuple[int, ...], block: Block = 128) -> tuple[int, ...]:
    """The `scale_inv` shape for a weight of `weight_shape`: last two dims ceil-divided."""
    rows, cols = block_pair(block)
    *lead, out_dim, in_dim = weight_shape
    return (*lead, -(-out_dim // rows), -(-in_dim // cols))


def _pad_to_blocks(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    out_dim, in_dim = w.shape[-2:]
    return F.pad(w, (0, -in_dim % cols, 0, -out_dim % rows))


def _blocked(w: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """View a padded [..., out, in] tensor as [..., out/rows, rows, in/cols, cols]."""
    *lead, out_dim, in_dim = w.shape
    return w.reshape(*lead, out_dim // rows, rows, in_dim // cols, cols)


def e4m3_to_float(w8: torch.Tensor) -> torch.Tensor:
    """float8_e4m3fn -> float32, the same values as `.float()` at several times its speed on
    CPU (torch converts one element at a time there; a block-FP8 prefill spent most of its time
    in it). The byte's exponent and mantissa bits, moved into a half float's, are the value
    times 2^-8, normals and subnormals alike (kernels/cpu_decode_math.h makes them the same
    way); a NaN byte (S.1111.111, which no quantiser writes) becomes +-480. Other dtypes: their
    `.float()`."""
    if w8.dtype != FP8_DTYPE:
        return w8.float()
    bits = w8.view(torch.uint8).to(torch.int16)
    half = ((bits & 0x7F) << 7) | ((bits & 0x80) << 8)
    return half.view(torch.float16).float() * 256.0


def dequantize_block_fp8(
    w8: torch.Tensor, scale_inv: torch.Tensor, block: Block = 128
) -> torch.Tensor:
    """W8 * scale_inv over blocks, as float32. Raises ValueError on mismatched shapes."""
    rows, cols = block_pair(block)
    if w8.dim() < 2:
        raise ValueError(f"an FP8 weight needs at least 2 dims, got shape {list(w8.shape)}")
    expected = scale_shape(w8.shape, (rows, cols))
    if tuple(scale_inv.shape) != expected:
        raise ValueError(
            f"scale shape {list(scale_inv.shape)} does not fit weight shape {list(w8.shape)} "
            f"with {rows}x{cols} blocks (expected {list(expected)})"
        )
    out_dim, in_dim = w8.shape[-2:]
    padded = _blocked(_pad_to_blocks(e4m3_to_float(w8), rows, cols), rows, cols)
    w = padded * scale_inv.float()[..., :, None, :, None]  # [..., ob, rows, ib, cols]
    w = w.reshape(*w8.shape[:-2], padded.shape[-4] * rows, padded.shape[-2] * cols)
    return w[..., :out_dim, :in_dim].contiguous()


def quantize_block_fp8(w: torch.Tensor, block: Block = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(W8, scale_inv) with scale_inv = amax / 448 per block (1.0 for an all-zero block)."""
    rows, cols = block_pair(block)
    if w.dim() < 2 or not w.is_floating_point():
        raise ValueError(f"cannot quantize a {w.dtype} tensor of shape {list(w.shape)}")
    out_dim, in_dim = w.shape[-2:]
    padded = _blocked(_pad_to_blocks(w.float(), rows, cols), rows, cols)
    amax = padded.abs().amax(dim=(-3, -1))  # [..., ob, ib]
    scale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    scaled = (padded / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX)
    w8 = scaled.to(FP8_DTYPE).reshape(*w.shape[:-2], *_padded_dims(padded))
    return w8[..., :out_dim, :in_dim].contiguous(), scale.float().contiguous()


def _padded_dims(blocked: torch.Tensor) -> tuple[int, int]:
    return (blocked.shape[-4] * blocked.shape[-3], blocked.shape[-2] * blocked.shape[-1])

"""Triton: one output tile of y = a @ w^T with gathered rows, shared by the FP8 GEMM and the MoE.

A program computes the BLOCK_M x BLOCK_N tile of rows `arow` of a (written at rows `orow` of
the output) against BLOCK_N rows of w, walking K:

- **FP8** (e4m3 a and w, DeepSeek-V3's scales: one per token and 128 columns of a, one per
  128x128 block of w): one e4m3 dot per 128 of K into a fresh fp32 tile, times both scales,
  added to the accumulator (the per-128 promotion DeepGEMM does for Hopper's FP8 accumulator).
  On sm_80 (no FP8 hardware) the bytes are decoded to fp16 with integer ops first (exact).
- **16-bit** (bf16 / fp16 a and w): tensor-core dots with fp32 accumulation.
- **fp32** (either operand fp32): IEEE fp32 dots (FMAs), the exact path of fp32 engines.

Below 64 rows (every decode step) the tile is computed transposed (swap-AB: w's 128 rows are the
M of the instruction, the tokens its N), so Hopper and Blackwell still issue wgmma / tcgen05,
whose M is at least 64, instead of falling back to mma.sync.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from dsaserve.kernels.gpu_target import fp8_in_hardware, has_wgmma
from dsaserve.kernels.triton_support import e4m3_to_f32

FP8 = torch.float8_e4m3fn
SCALE_BLOCK = 128  # K (and N) of one FP8 scale block
SWAP_BELOW = 64  # rows a tile: below this, swap-AB


class Tile(NamedTuple):
    """Launch parameters of a tile: kernel constexprs and options."""

    BLOCK_M: int
    BLOCK_N: int
    BLOCK_K: int
    IS_FP8: bool
    SOFT_FP8: bool
    IEEE: bool
    SWAP: bool
    num_warps: int
    num_stages: int


def tile(block_m: int, a_dtype: torch.dtype, w_dtype: torch.dtype, device: torch.device) -> Tile:
    """The tile for `block_m` rows of a over weights of `w_dtype` (at most 24 KB of shared
    memory a stage, 3 stages: within the 99 KB of sm_89 / sm_120). IEEE fp32 dots are FMAs
    whose operands sit in registers: 16 of K a step, 8 warps."""
    fp8 = w_dtype == FP8
    ieee = not fp8 and torch.float32 in (a_dtype, w_dtype)
    block_k = SCALE_BLOCK if fp8 else (16 if ieee else 64)
    swap = block_m < SWAP_BELOW and not ieee
    soft = fp8 and not fp8_in_hardware(device)
    # off wgmma / tcgen05, a 64-row mma.sync tile spilled at 4 warps (docs/gpu.md): 8 warps there
    wide = ieee or (block_m >= SWAP_BELOW and not has_wgmma(device))
    return Tile(block_m, SCALE_BLOCK, block_k, fp8, soft, ieee, swap, 8 if wide else 4, 3)


def operands(a: torch.Tensor, w: torch.Tensor, t: Tile) -> tuple[torch.Tensor, torch.Tensor]:
    """What the kernel reads: FP8 as raw bytes where it decodes them itself."""
    return (a.view(torch.uint8), w.view(torch.uint8)) if t.SOFT_FP8 else (a, w)


@triton.jit
def gemm_tile(
    a_ptr, as_ptr, w_ptr, ws_row, out_ptr, arow, orow, in_m, rn, N, K, KB,
    IS_FP8: tl.constexpr, SOFT_FP8: tl.constexpr, IEEE: tl.constexpr, SWAP: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """out[orow, rn] = a[arow] @ w[rn]^T (fp32). w_ptr is this tile's weight matrix [N, K];
    ws_row its scales' row of this N block ([KB] fp32); as_ptr a's scales [rows, KB]."""
    rk = tl.arange(0, BLOCK_K)
    in_n = rn < N
    if SWAP:
        acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    else:
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, tl.cdiv(K, BLOCK_K)):
        ks = kb * BLOCK_K + rk
        a = tl.load(a_ptr + arow[:, None] * K + ks[None, :],
                    mask=in_m[:, None] & (ks[None, :] < K), other=0.0)  # fmt: skip
        w = tl.load(w_ptr + rn[:, None] * K + ks[None, :],
                    mask=in_n[:, None] & (ks[None, :] < K), other=0.0)  # fmt: skip
        if IS_FP8:
            if SOFT_FP8:
                a, w = e4m3_to_f32(a).to(tl.float16), e4m3_to_f32(w).to(tl.float16)
            a_scale = tl.load(as_ptr + arow * KB + kb, mask=in_m, other=0.0)
            w_scale = tl.load(ws_row + kb)
            if SWAP:
                acc += tl.dot(w, tl.trans(a)) * a_scale[None, :] * w_scale
            else:
                acc += tl.dot(a, tl.trans(w)) * a_scale[:, None] * w_scale
        elif IEEE:
            acc = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), acc, input_precision="ieee")
        elif SWAP:
            acc = tl.dot(w, tl.trans(a.to(w.dtype)), acc)
        else:
            acc = tl.dot(a.to(w.dtype), tl.trans(w), acc)
    if SWAP:
        tl.store(out_ptr + orow[None, :] * N + rn[:, None], acc, mask=in_m[None, :] & in_n[:, None])
    else:
        tl.store(out_ptr + orow[:, None] * N + rn[None, :], acc, mask=in_m[:, None] & in_n[None, :])

"""The DFLASH part of bench/gpu_check.py: the drafter's `draft_attention` Triton kernel against
the torch reference at a GLM-5.3 DFlash2 drafter's shapes (hidden 6144, 32 query / 8 KV heads of
128, block 8; z-lab's published DFlash2 fixture uses the same heads), over 8k-token contexts
with and without a 2048 sliding window, from a bf16 context cache; and the DFLASH verify step
(8 rows a request, the target's hidden states of the drafter's 5 target layers returned with
the final ones) replayed through the engine's CUDA-graph runner against the same static step
run eagerly."""

from __future__ import annotations

import time

import torch
from gpu_check_kernels import DEVICE, _check, _gen, _rel
from gpu_check_run import _sync, decode_batch, rank_model, triton_kernels

from dsaserve.engine.decode.cuda_graph import CudaGraphRunner
from dsaserve.engine.kvcache.pool import KVPool
from dsaserve.kernels.draft_attention import draft_attention as reference
from dsaserve.models.dsa_moe import index_cache_ids

BLOCK = 8
HEADS, KV_HEADS, HEAD_DIM = 32, 8, 128
TAPS = (5, 14, 24, 33, 42)  # the guide's drafter's target layers (GLM-5.3, 78 layers)


GLM53_DRAFTER = (HEADS, KV_HEADS, HEAD_DIM)


def check_draft_attention(context: int, batch: int, window: int | None,
                          heads: tuple[int, int, int] = GLM53_DRAFTER) -> dict:  # fmt: skip
    from dsaserve.kernels.triton_draft_attention import draft_attention

    q_heads, kv_heads, dim = heads
    g = _gen(context + batch)
    slots = batch * context
    cache = torch.randn(slots, 2 * kv_heads * dim, device=DEVICE, generator=g).bfloat16()
    table = torch.randperm(slots, device=DEVICE, generator=g).view(batch, context)
    lens = torch.randint(context // 2, context + 1, (batch,), device=DEVICE, generator=g)
    key = torch.arange(context, device=DEVICE)
    allowed = (key[None] < lens[:, None])[:, None, :].expand(-1, BLOCK, -1).clone()
    if window:
        row = lens[:, None] + torch.arange(BLOCK, device=DEVICE)[None]  # [R, B] positions
        allowed &= row[..., None] - key[None, None] < window
    q = torch.randn(batch, BLOCK, q_heads, dim, device=DEVICE, generator=g).bfloat16()
    k = torch.randn(batch, BLOCK, kv_heads, dim, device=DEVICE, generator=g).bfloat16()
    v = torch.randn(batch, BLOCK, kv_heads, dim, device=DEVICE, generator=g).bfloat16()
    block = torch.ones(BLOCK, BLOCK, dtype=torch.bool, device=DEVICE)
    args = (q, cache, table, allowed, k, v, block, dim**-0.5)
    as_fp32 = [a.float() if a.is_floating_point() else a for a in args[:7]]
    got, want = draft_attention(*args), reference(*as_fp32, dim**-0.5)
    name = f"draft attention ctx {context} x{batch}" + (f" window {window}" if window else "")
    return _check(name, _rel(got.float(), want), 2e-2)  # bf16 inputs and output


def run_dflash_checks(contexts: list[int], tiny: bool) -> list[dict]:
    heads = (4, 2, 32) if tiny else GLM53_DRAFTER
    return [check_draft_attention(ctx, batch, window, heads)
            for ctx in contexts for batch in (1, 8) for window in (None, ctx // 4)]  # fmt: skip


def time_verify(model, kernels, requests: int, context: int, iters: int, taps=TAPS) -> dict:
    """One DFLASH verify step (requests x BLOCK rows, each over its own prefix) with the taps,
    through the CUDA-graph runner, and its replay against the eager static step."""
    config, page = model.config, 64
    taps = tuple(t for t in taps if t < config.num_hidden_layers) or (0,)
    rows = requests * BLOCK
    pages = -(-rows * context // page) + 1
    pool = KVPool(config, pages, page, len(index_cache_ids(config, False)), False,
                  torch.bfloat16, DEVICE, fp8=True)  # fmt: skip
    capture = DEVICE.type == "cuda"
    runner = CudaGraphRunner(model, pool, kernels, [rows], context, (pages - 1) * page, capture,
                             taps)  # fmt: skip
    step = decode_batch(model, pool, kernels, rows, context)
    runner(step)
    _sync()
    start = time.perf_counter()
    for _ in range(iters):
        out = runner(step)
    _sync()
    bucket = runner.bucket(step)
    runner.inputs.load(bucket, step)
    eager = runner._run(bucket)[:rows]
    finite = bool(out.isfinite().all()) and out.shape[1] == config.hidden_size * (1 + len(taps))
    error = _rel(out.float(), eager.float()) if finite else float("inf")
    check = _check(f"DFLASH verify {'graph replay' if capture else 'static'} with taps, "
                   f"{requests} x {BLOCK} rows", error, 1e-3)  # fmt: skip
    row = {"requests": requests, "rows": rows, "verify_ms": (time.perf_counter() - start) / iters
           * 1e3, "taps": list(taps), "cuda_graph": capture, "replay_check": check}  # fmt: skip
    del runner, pool, step
    return row


def verify_rows(s, batches: list[int], context: int, iters: int) -> list[dict]:
    """DFLASH verify steps (block 8, with taps) of 1 and 8 requests."""
    kernels = triton_kernels()
    model = rank_model(s, kernels)
    requests = sorted({1, min(8, max(batches))})
    return [time_verify(model, kernels, r, context, iters) for r in requests]

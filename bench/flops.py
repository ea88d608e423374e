"""Machine matmul peak and model FLOPs per token, for "achieved FLOP/s as a fraction of peak".

    python bench/flops.py [--threads N] [--model-path DIR]

The peak is the best fp32 GEMM rate of a few large square `torch.mm` calls at the given thread
count (what a perfect decode step could reach on this machine). A decode token costs
2 x active parameters (matmul weights used by one token: attention, indexer, dense MLPs, the
router, shared experts, top-k of the routed experts, lm_head; not the embedding lookup) plus the
attention over its context (absorbed MLA scores and values, and the indexer's scores).
"""

from __future__ import annotations

import argparse
import json
import statistics
import struct
import time
from pathlib import Path
from typing import NamedTuple

import torch

PEAK_SIZES = (1024, 2048)


class Peak(NamedTuple):
    """fp32 GEMM FLOP/s: the best and the median over all timed calls."""

    best: float
    median: float
    threads: int


def matmul_peak(threads: int, sizes: tuple[int, ...] = PEAK_SIZES, reps: int = 5) -> Peak:
    """Time `reps` n x n fp32 matmuls per size (after one warm-up) on `threads` threads."""
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    rates = []
    try:
        for n in sizes:
            a, b = torch.randn(n, n), torch.randn(n, n)
            torch.mm(a, b)
            for _ in range(reps):
                start = time.perf_counter()
                torch.mm(a, b)
                rates.append(2 * n**3 / (time.perf_counter() - start))
    finally:
        torch.set_num_threads(previous)
    return Peak(max(rates), statistics.median(rates), threads)


def _tensor_shapes(folder: Path) -> dict[str, list[int]]:
    """Every tensor's shape from the safetensors headers (no weights read)."""
    shapes = {}
    for path in sorted(folder.glob("*.safetensors")):
        with path.open("rb") as f:
            (size,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(size))
        shapes.update({k: v["shape"] for k, v in header.items() if k != "__metadata__"})
    return shapes


def _layer_of(name: str) -> int | None:
    parts = name.split(".")
    if "layers" in parts and parts.index("layers") + 1 < len(parts):
        return int(parts[parts.index("layers") + 1])
    return None


class ParamCount(NamedTuple):
    total: int
    active: int  # matmul weights one token multiplies by


def active_params(folder: Path) -> ParamCount:
    """Total parameters and the matmul weights a token uses (MTP layers and embedding excluded)."""
    config = json.loads((folder / "config.json").read_text())
    layers = config["num_hidden_layers"]
    routed_share = config["num_experts_per_tok"] / config["n_routed_experts"]
    total = active = 0.0
    for name, shape in _tensor_shapes(folder).items():
        numel = 1
        for dim in shape:
            numel *= dim
        total += numel
        layer = _layer_of(name)
        if len(shape) < 2 or "embed_tokens" in name or (layer is not None and layer >= layers):
            continue
        if "weight_scale" in name:
            continue
        active += numel * (routed_share if ".mlp.experts." in name else 1.0)
    return ParamCount(int(total), int(active))


def attention_flops_per_token(config: dict, context_len: float) -> float:
    """Absorbed MLA over `context_len` cached entries (topk-capped) plus the indexer scores."""
    heads, rank = config["num_attention_heads"], config["kv_lora_rank"]
    entry = rank + config["qk_rope_head_dim"]
    attended = min(context_len, config.get("index_topk") or context_len)
    mla = 2 * heads * (entry + rank) * attended
    indexer = 2 * config.get("index_n_heads", 0) * config.get("index_head_dim", 0) * context_len
    return config["num_hidden_layers"] * (mla + indexer)


def decode_flops_per_token(folder: Path, context_len: float) -> float:
    config = json.loads((folder / "config.json").read_text())
    return 2 * active_params(folder).active + attention_flops_per_token(config, context_len)


def prefill_flops(folder: Path, prompt_len: int) -> float:
    """FLOPs of prefilling `prompt_len` tokens: every token's weights plus its attention over
    the tokens before it (the indexer's scan is the part quadratic in the prompt)."""
    config = json.loads((folder / "config.json").read_text())
    weights = 2 * active_params(folder).active * prompt_len
    topk, layers = config.get("index_topk") or prompt_len, config["num_hidden_layers"]
    heads, rank = config["num_attention_heads"], config["kv_lora_rank"]
    entry = rank + config["qk_rope_head_dim"]
    dense = min(prompt_len, topk)  # tokens 1..dense attend all of their context
    attended = dense * (dense + 1) / 2 + (prompt_len - dense) * topk
    scanned = prompt_len * (prompt_len + 1) / 2
    indexer = 2 * config.get("index_n_heads", 0) * config.get("index_head_dim", 0) * scanned
    return weights + layers * (2 * heads * (entry + rank) * attended + indexer)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=torch.get_num_threads())
    ap.add_argument("--model-path", help="also print FLOPs per decode token of this checkpoint")
    ap.add_argument("--context-len", type=float, default=192.0)
    ap.add_argument("--prefill-len", type=int, help="also print FLOPs of a prefill this long")
    args = ap.parse_args()
    peak = matmul_peak(args.threads)
    print(f"fp32 matmul peak on {peak.threads} thread(s): best {peak.best / 1e9:.1f} GFLOP/s, "
          f"median {peak.median / 1e9:.1f} GFLOP/s")  # fmt: skip
    if args.model_path:
        folder = Path(args.model_path)
        count = active_params(folder)
        per_token = decode_flops_per_token(folder, args.context_len)
        context = args.context_len
        print(f"params: {count.total / 1e6:.2f}M total, {count.active / 1e6:.2f}M active matmul;"
              f" {per_token / 1e6:.2f} MFLOP per decode token at context {context:g}")  # fmt: skip
        if args.prefill_len:
            flops = prefill_flops(folder, args.prefill_len)
            print(f"prefill of {args.prefill_len} tokens: {flops / 1e9:.1f} GFLOP, at least "
                  f"{flops / peak.best:.1f} s at the peak")  # fmt: skip


if __name__ == "__main__":
    main()

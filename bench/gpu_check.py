"""The prepared GPU check: kernel correctness at GLM-5.3 TP8 per-rank shapes, then the decode
step time of a 78-layer TP8-rank slice with random FP8 weights against the HBM bytes floor.

    python bench/gpu_check.py --out gpu_check.json          # one H200/B200, < 10 minutes
    TRITON_INTERPRET=1 python bench/gpu_check.py --tiny     # the same code at toy shapes, CPU

Part 1 runs each Triton kernel (indexer scores + earliest-wins top-k at contexts 8k and 32k,
sparse MLA decode over index_topk 2048 entries with 8 heads a rank from bf16 and FP8 caches, the
block-FP8 GEMM at the rank's Linear shapes, the MoE slices as TP8 (256 experts, 1/8 of each) and
EP8 (32 whole experts), the grouped FP8 expert GEMMs in both layouts at batch 1 and 32, and the
prefill (contiguous) layout at a 4096-row chunk with half the experts idle) against the torch
reference. Part 2 builds the engine's own model classes as one TP8 rank's slice (8 heads, every
expert's eighth; 78 layers; random block-FP8 Linears and experts, bf16 elsewhere, FP8 KV cache)
and times one decode step through the engine's CUDA-graph runner (engine/decode/cuda_graph.py:
the static decode forward captured once per batch, replayed) at batch 1, 8, 32, 64, over every
Triton kernel (indexer, sparse MLA, block-FP8 GEMM, grouped masked MoE), and divides by the
bytes-moved floor at the measured copy bandwidth; then the DFLASH parts (bench/gpu_check_dflash.py:
the drafter's attention kernel, and the verify step with the drafter's target layers through the
same graph runner); then the indexer and sparse MLA on tensor cores against the FMA forms they
replaced and the torch reference at 4k / 64k / 256k contexts (bench/gpu_check_attention.py);
then, where two GPUs are, `--tp 2` CUDA-graph decode against eager (bench/gpu_check_ranks.py).
It prints a table and writes JSON. One routed
expert set is shared by the MoE layers (75 would not fit beside the KV; each layer still reads
its experts' bytes from HBM).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dsaserve.deploy.models import BUILTIN_MODELS, ModelSpec  # noqa: E402

BATCHES = (1, 8, 32, 64)
CONTEXTS = (8192, 32768)
ATTENTION_CONTEXTS = (4096, 65536, 262144)  # the indexer and sparse MLA, old kernels and new
TOP_K_EXPERTS = 8  # GLM-5.3 num_experts_per_tok
INDEX_TOPK = 2048
FP8_WEIGHT = 1 + 4 / (128 * 128)  # bytes a weight: e4m3 + its 128x128 block's fp32 scale


@dataclass(frozen=True)
class RankShapes:
    """The per-rank shapes of one TP rank of `spec` (MoE split as TP or as EP)."""

    hidden: int
    heads: int  # attention heads a rank
    q_lora: int
    rank: int  # kv_lora_rank
    rope: int
    nope: int
    v_dim: int
    index_heads: int
    index_dim: int
    experts: int  # routed experts this rank holds
    expert_inter: int  # intermediate size of each held expert (a slice under TP)
    shared_inter: int
    dense_inter: int
    layers: int
    dense_layers: int
    vocab: int
    index_topk: int = INDEX_TOPK

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(out, in) of each FP8 Linear of an attention block on one rank (q_a, kv_a and the
        indexer replicated, the head-split ones divided by TP, as SGLang shards them)."""
        s = self
        return {
            "q_a_proj": (s.q_lora, s.hidden),
            "q_b_proj": (s.heads * (s.nope + s.rope), s.q_lora),
            "kv_a_proj_with_mqa": (s.rank + s.rope, s.hidden),
            "o_proj": (s.hidden, s.heads * s.v_dim),
            "indexer.wq_b": (s.index_heads * s.index_dim, s.q_lora),
            "indexer.wk": (s.index_dim, s.hidden),
        }  # fmt: skip


def rank_shapes(spec: ModelSpec, tp: int = 8, moe: str = "tp") -> RankShapes:
    if moe not in ("tp", "ep"):
        raise ValueError(f"moe must be tp or ep, got {moe!r}")
    ep = moe == "ep"
    return RankShapes(
        hidden=spec.hidden_size, heads=spec.num_attention_heads // tp, q_lora=spec.q_lora_rank,
        rank=spec.kv_lora_rank, rope=spec.qk_rope_head_dim, nope=spec.qk_nope_head_dim,
        v_dim=spec.v_head_dim, index_heads=spec.index_n_heads, index_dim=spec.index_head_dim,
        experts=spec.n_routed_experts // tp if ep else spec.n_routed_experts,
        expert_inter=spec.moe_intermediate_size if ep else spec.moe_intermediate_size // tp,
        shared_inter=spec.moe_intermediate_size * spec.n_shared_experts // tp,
        dense_inter=spec.intermediate_size // tp, layers=spec.num_hidden_layers,
        dense_layers=spec.first_k_dense_replace, vocab=spec.vocab_size,
    )  # fmt: skip


def experts_touched(batch: int, experts: int = 256, k: int = TOP_K_EXPERTS) -> float:
    """Expected distinct routed experts a decode step of `batch` tokens uses (uniform routing)."""
    return experts * (1 - (1 - k / experts) ** batch)


def floor_bytes(s: RankShapes, batch: int, context: int, kv_fp8: bool = True) -> dict[str, float]:
    """Bytes one decode step must read on one rank: weights, touched experts, KV, indexer keys."""
    attn = sum(o * i for o, i in s.linear_shapes().values()) * FP8_WEIGHT
    attn += s.heads * (s.nope + s.v_dim) * s.rank * 2  # kv_b (W_UK, W_UV) kept bf16
    moe_layers = s.layers - s.dense_layers
    expert = 3 * s.hidden * s.expert_inter * FP8_WEIGHT
    touched = min(experts_touched(batch), s.experts)  # EP: at most the rank's experts
    if s.experts < 256:  # EP: this rank's share of the touched experts
        touched = experts_touched(batch) * s.experts / 256
    entry = (s.rank + 4 * (s.rank // 128) + 2 * s.rope) if kv_fp8 else 2 * (s.rank + s.rope)
    kv = batch * min(context, s.index_topk) * entry + batch * context * (s.index_dim + 4)
    parts = {
        "attention_weights": s.layers * attn,
        "dense_mlp": s.dense_layers * 3 * s.hidden * s.dense_inter * FP8_WEIGHT,
        "shared_experts": moe_layers * 3 * s.hidden * s.shared_inter * FP8_WEIGHT,
        "routed_experts": moe_layers * touched * expert,
        "kv_and_index_keys": s.layers * kv,
        "lm_head": s.vocab / 8 * s.hidden * 2,
    }
    parts["total"] = sum(parts.values())
    return parts


def floor_ms(total_bytes: float, bandwidth: float) -> float:
    return total_bytes / bandwidth * 1e3


def tiny_shapes() -> RankShapes:
    return RankShapes(hidden=256, heads=2, q_lora=128, rank=128, rope=32, nope=32, v_dim=32,
                      index_heads=4, index_dim=64, experts=8, expert_inter=64, shared_inter=64,
                      dense_inter=128, layers=2, dense_layers=1, vocab=512,
                      index_topk=64)  # fmt: skip


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="GLM-5.3 TP8-rank kernel check and decode time")
    parser.add_argument("--model", default="GLM-5.3", choices=sorted(BUILTIN_MODELS))
    parser.add_argument("--tp", type=int, default=8)
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES))
    parser.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS))
    parser.add_argument("--decode-context", type=int, default=8192)
    parser.add_argument("--attention-contexts", type=int, nargs="+",
                        default=list(ATTENTION_CONTEXTS))  # fmt: skip
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--tiny", action="store_true", help="toy shapes (CPU, interpreter)")
    parser.add_argument("--skip-timing", action="store_true")
    parser.add_argument("--out", default="gpu_check.json")
    args = parser.parse_args(argv)
    if args.tp < 1 or min(args.batches + args.attention_contexts) < 1 or args.iters < 1:
        parser.error("--tp, --batches, --attention-contexts and --iters must be positive")
    return args


def table(rows: list[dict]) -> str:
    head = "| batch | step ms | floor ms | x floor | GB read |\n|---:|---:|---:|---:|---:|"
    lines = [f"| {r['batch']} | {r['step_ms']:.2f} | {r['floor_ms']:.2f} | "
             f"{r['step_ms'] / r['floor_ms']:.2f} | {r['floor_bytes'] / 1e9:.1f} |"
             for r in rows]  # fmt: skip
    return "\n".join([head, *lines])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from gpu_check_attention import run_attention_timing
    from gpu_check_attention import table as attention_table
    from gpu_check_dflash import run_dflash_checks, verify_rows  # the torch / Triton part
    from gpu_check_ranks import run_rank_graphs
    from gpu_check_run import run_checks, run_timing

    spec = BUILTIN_MODELS[args.model]
    shapes = {"tp": tiny_shapes(), "ep": tiny_shapes()} if args.tiny else {
        moe: rank_shapes(spec, args.tp, moe) for moe in ("tp", "ep")}  # fmt: skip
    contexts = [256, 512] if args.tiny else args.contexts
    started = time.perf_counter()
    report = {"model": args.model, "tp": args.tp, "tiny": args.tiny,
              "shapes": {k: dataclasses.asdict(v) for k, v in shapes.items()},
              "checks": run_checks(shapes, contexts, 96 if args.tiny else 4096)}  # fmt: skip
    report["checks"] += run_dflash_checks([256] if args.tiny else [8192], args.tiny)
    failed = [c for c in report["checks"] if not c["ok"]]
    print(f"kernel checks: {len(report['checks']) - len(failed)} ok, {len(failed)} failed")
    for check in report["checks"]:
        print(f"  {'ok ' if check['ok'] else 'BAD'} {check['name']}: {check['error']:.2e}")
    if not args.skip_timing:
        context = 256 if args.tiny else args.decode_context
        report["bandwidth"], rows = run_timing(shapes["tp"], args.batches, context, args.iters)
        for row in rows:
            row["floor_bytes"] = floor_bytes(shapes["tp"], row["batch"], context)["total"]
            row["floor_ms"] = floor_ms(row["floor_bytes"], report["bandwidth"])
        report["decode"] = rows
        print(f"copy bandwidth {report['bandwidth'] / 1e12:.2f} TB/s, context {context}")
        print(table(rows))
        report["dflash_verify"] = verify_rows(shapes["tp"], args.batches, context, args.iters)
        print(
            "DFLASH verify (block 8, taps):",
            ", ".join(
                f"{r['requests']} req {r['verify_ms']:.2f} ms" for r in report["dflash_verify"]
            ),
        )
        replays = [row.pop("replay_check") for row in rows + report["dflash_verify"]]
        for check in replays:
            print(f"  {'ok ' if check['ok'] else 'BAD'} {check['name']}: {check['error']:.2e}")
        report["checks"] += replays
        failed += [c for c in replays if not c["ok"]]
        attention = [256, 512] if args.tiny else args.attention_contexts
        report["attention"] = run_attention_timing(shapes["tp"], attention, 1, args.iters,
                                                   report["bandwidth"])  # fmt: skip
        print(attention_table(report["attention"]))
    report["ranks"] = run_rank_graphs()
    print(f"  {report['ranks']['name']}: {report['ranks']['ok']} ({report['ranks']['detail']})")
    failed += [report["ranks"]] if report["ranks"]["ok"] is False else []
    report["wall_s"] = time.perf_counter() - started
    Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    raise SystemExit(main())

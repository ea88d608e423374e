"""Offline throughput: dsaserve `LLM.generate` vs transformers `generate`, same random checkpoint.

    python bench/offline.py [--num-prompts 64] [--batch 32] [--output-len 64] [--threads N]

Both run greedy with a fixed output length on the same prompts; transformers runs padded
batches of `--batch` prompts, dsaserve continuous batching capped at `--batch` requests.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from tiny_models import load_reference, make_checkpoint  # noqa: E402

from dsaserve import LLM, SamplingParams  # noqa: E402

MODEL = dict(
    vocab_size=8192, hidden_size=256, intermediate_size=512, moe_intermediate_size=256,
    num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=128,
    kv_lora_rank=64, qk_rope_head_dim=32, qk_nope_head_dim=32, v_head_dim=32,
    n_routed_experts=8, num_experts_per_tok=2, index_topk=64, index_n_heads=8, index_head_dim=32,
)  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--input-len", type=int, default=128)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", default="bench/results/offline.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    folder = make_checkpoint(Path(tempfile.mkdtemp()) / "bench-model", "glm", seed=0, **MODEL)
    params = sum(p.numel() for p in load_reference(folder).parameters())
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(args.input_len // 2, args.input_len * 3 // 2, (args.num_prompts,))
    prompts = [torch.randint(0, 8000, (int(n),), generator=gen).tolist() for n in lengths]
    results = {"ours": run_dsaserve(folder, prompts, args), "hf": run_hf(folder, prompts, args)}
    ratio = results["ours"]["tokens_per_s"] / results["hf"]["tokens_per_s"]
    print(f"\nmodel: {params / 1e6:.1f}M params, {args.num_prompts} prompts, batch {args.batch}")
    print(f"{'engine':<14}{'seconds':>10}{'output tok/s':>15}")
    for name, r in (("dsaserve", results["ours"]), ("transformers", results["hf"])):
        print(f"{name:<14}{r['seconds']:>10.2f}{r['tokens_per_s']:>15.1f}")
    print(f"{'ratio':<14}{'':>10}{ratio:>14.2f}x")
    record = {"args": vars(args), "params": params, "ratio": ratio, **results}
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record, indent=2))


def run_dsaserve(folder: Path, prompts: list[list[int]], args) -> dict:
    llm = LLM(str(folder), max_running_requests=args.batch, max_total_tokens=65536)
    sp = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    llm.generate(prompts[:2], sp, use_tqdm=False)  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, sp, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(o.token_ids) for o in outs)
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}


@torch.no_grad()
def run_hf(folder: Path, prompts: list[list[int]], args) -> dict:
    model = load_reference(folder)
    tokens, start = 0, time.perf_counter()
    for i in range(0, len(prompts), args.batch):
        chunk = prompts[i : i + args.batch]
        width = max(map(len, chunk))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in chunk])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in chunk])
        out = model.generate(
            input_ids=ids, attention_mask=mask, max_new_tokens=args.output_len,
            min_new_tokens=args.output_len, do_sample=False, pad_token_id=0,
        )  # fmt: skip
        tokens += (out.shape[1] - width) * len(chunk)
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "tokens": tokens, "tokens_per_s": tokens / seconds}


if __name__ == "__main__":
    main()

"""Batch-1 decode speed with MTP speculative decoding on vs off, in one run.

    python bench/spec_decode.py [--model-path DIR] [--steps 1,2,3] [--output-len 256]
                                [--ignore-eos] [--threads N] [--json bench/results/spec_decode.json]

Prompts: for the embedded model, its own kind: the first user turn (with its tools and template
kwargs) of held-out conversations from `scripts/default_model_data.py`; for other checkpoints,
the chat questions below through their chat template. Each prompt runs alone (batch 1), greedy,
until the model stops (or --output-len tokens; --ignore-eos forces that many); decode tokens/s
counts the tokens after the first over the time after the first (prefill excluded). The
speculative outputs are checked token-for-token against the plain ones.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

import torch
from transformers import AutoTokenizer

from dsaserve import LLM, SamplingParams
from dsaserve.assets import default_model_path
from dsaserve.engine.io import GenerateRequest
from dsaserve.layers.forward_batch import current_batch

QUESTIONS = [
    "What is 15% of 240?",
    "What is 37 times 24?",
    "What's the weather in Paris?",
    "What is 8% of 1250?",
    "What time is it in Tokyo?",
    "What is 125 times 16?",
    "Search the web for the tallest building in Europe.",
    "What is 45% of 680?",
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model-path", default=str(default_model_path()))
    ap.add_argument("--steps", default="3", help="comma list of --speculative-num-steps")
    ap.add_argument("--num-prompts", type=int, default=16)
    ap.add_argument("--output-len", type=int, default=256, help="max tokens per request")
    ap.add_argument("--ignore-eos", action="store_true", help="always generate --output-len")
    ap.add_argument("--repeats", type=int, default=2, help="timed passes over the prompts")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--json-model-override-args", default=None,
                    help='e.g. \'{"index_share_for_mtp_iteration": true}\'')  # fmt: skip
    ap.add_argument("--json", default="bench/results/spec_decode.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if not (Path(args.model_path) / "config.json").is_file():
        raise SystemExit(f"no checkpoint at {args.model_path} (config.json missing)")
    record = run(args)
    print_table(record)
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(record, indent=2))


def run(args) -> dict:
    """All modes measured in turn within each repeat, so machine drift hits them alike."""
    if Path(args.model_path).resolve() == default_model_path().resolve():
        prompts = own_kind_prompts(args.model_path, args.num_prompts)
    else:
        prompts = chat_prompts(args.model_path, args.num_prompts)
    base_args = {"max_total_tokens": 16384, "device": args.device,
                 "json_model_override_args": args.json_model_override_args}  # fmt: skip
    modes = {0: LLM(args.model_path, **base_args)}
    for steps in [int(s) for s in args.steps.split(",")]:
        modes[steps] = LLM(args.model_path, speculative_algorithm="EAGLE",
                           speculative_num_steps=steps, **base_args)  # fmt: skip
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=args.ignore_eos)
    totals = {steps: {"decode_tokens": 0, "decode_seconds": 0.0} for steps in modes}
    outputs, timers = {}, {steps: time_forwards(llm) for steps, llm in modes.items()}
    for llm in modes.values():
        one(llm, prompts[0], params)  # warm-up
    for timer in timers.values():
        for counts in timer.values():
            counts[:] = [0, 0.0]
    for _ in range(args.repeats):
        for steps, llm in modes.items():
            outputs[steps] = []
            for prompt in prompts:
                tokens, seconds, ids = one(llm, prompt, params)
                totals[steps]["decode_tokens"] += tokens
                totals[steps]["decode_seconds"] += seconds
                outputs[steps].append(ids)
    rows = []
    for steps, llm in modes.items():
        row = {"mode": "EAGLE" if steps else "off", "steps": steps, **totals[steps]}
        row["decode_tokens_per_s"] = row["decode_tokens"] / row["decode_seconds"]
        plain = rows[0]["decode_tokens_per_s"] if rows else row["decode_tokens_per_s"]
        row["speedup"] = row["decode_tokens_per_s"] / plain
        row["identical"] = outputs[steps] == outputs[0]
        for name, (calls, seconds) in timers[steps].items():
            row[f"{name}_ms"] = 1e3 * seconds / max(calls, 1)
        if steps:
            stats = llm.engine.stats()
            row |= {"accept_length": stats["avg_spec_accept_length"],
                    "accept_rate": stats["spec_accept_rate"]}  # fmt: skip
        rows.append(row)
    return {"args": vars(args), "num_prompts": len(prompts), "rows": rows,
            "torch_threads": torch.get_num_threads()}  # fmt: skip


def time_forwards(llm: LLM) -> dict[str, list]:
    """Wrap the target and MTP forwards of `llm`'s model: name -> [calls, seconds], counting
    only decode-row forwards (decode steps, verifies, draft steps, catch-ups), not prefills."""
    model, timers = llm.engine.model, {}
    for name, attr in (("target_forward", "forward"), ("mtp_forward", "forward_mtp")):
        timers[name] = [0, 0.0]

        def timed(*a, _inner=getattr(model, attr), _t=timers[name], **kw):
            start = time.perf_counter()
            try:
                return _inner(*a, **kw)
            finally:
                if not current_batch().extends:
                    _t[0] += 1
                    _t[1] += time.perf_counter() - start

        setattr(model, attr, timed)
    return timers


def chat_prompts(model_path: str, n: int) -> list[list[int]]:
    """The questions through the checkpoint's chat template (plain text without one)."""
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = []
    for question in (QUESTIONS * (n // len(QUESTIONS) + 1))[:n]:
        if tokenizer.chat_template is None:
            prompts.append(tokenizer(question, add_special_tokens=False).input_ids)
            continue
        messages = [{"role": "user", "content": question}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        prompts.append(tokenizer(text, add_special_tokens=False).input_ids)
    return prompts


def own_kind_prompts(model_path: str, n: int) -> list[list[int]]:
    """First user turns of held-out training-style conversations, rendered as in training."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "scripts"))
    from default_model_data import Generator  # noqa: PLC0415  (the training data's generator)

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    gen, prompts = Generator(2024, "test"), []
    for _ in range(n):
        sample = gen.sample()
        first_user = next(i for i, m in enumerate(sample.messages) if m["role"] == "user")
        text = tokenizer.apply_chat_template(
            sample.messages[: first_user + 1], tools=sample.tools, add_generation_prompt=True,
            tokenize=False, **sample.kwargs,
        )  # fmt: skip
        prompts.append(tokenizer(text, add_special_tokens=False).input_ids)
    return prompts


def one(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple[int, float, list[int]]:
    """Run one request alone; (tokens after the first, seconds after the first, all ids)."""
    engine = llm.engine
    rid = f"bench-{time.perf_counter_ns()}"
    engine.add_request(GenerateRequest(rid=rid, input_ids=prompt, sampling=asdict(params)))
    ids: list[int] = []
    first_at = None
    while engine.has_work():
        for out in engine.step():
            ids += out.token_ids
        if ids and first_at is None:
            first_at, first_len = time.perf_counter(), len(ids)
    return len(ids) - first_len, time.perf_counter() - first_at, ids


def print_table(record: dict) -> None:
    print(f"\nbatch 1, {record['num_prompts']} prompts, torch threads {record['torch_threads']}")
    head = f"{'mode':<7}{'steps':>6}{'decode tok/s':>14}{'speedup':>9}{'accept len':>12}"
    print(head + f"{'accept rate':>13}{'identical':>11}{'target fwd ms':>15}{'MTP fwd ms':>12}")
    for r in record["rows"]:
        accept = f"{r['accept_length']:.2f}" if "accept_length" in r else "-"
        rate = f"{r['accept_rate']:.2f}" if "accept_rate" in r else "-"
        mtp = f"{r['mtp_forward_ms']:.2f}" if r["steps"] else "-"
        print(f"{r['mode']:<7}{r['steps']:>6}{r['decode_tokens_per_s']:>14.1f}"
              f"{r['speedup']:>8.2f}x{accept:>12}{rate:>13}{str(r['identical']):>11}"
              f"{r['target_forward_ms']:>15.2f}{mtp:>12}")  # fmt: skip


if __name__ == "__main__":
    main()

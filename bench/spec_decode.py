"""Decode speed with speculative decoding (EAGLE/MTP, DFLASH) vs none, side by side in one run.

    python bench/spec_decode.py [--model-path DIR] [--modes off,eagle3,eagle5,dflash]
                                [--concurrency 1,8,32] [--output-len 256] [--ignore-eos]
                                [--draft-model DIR] [--threads N] [--json FILE]

Modes: `off`; `eagleK` (`--speculative-algorithm EAGLE --speculative-num-steps K`, the
checkpoint's MTP layer); `dflash` (`--speculative-algorithm DFLASH`; the drafter is
`--draft-model`, by default the embedded model's own; its block size is the checkpoint's).

Prompts: for the embedded model, its own kind: the first user turn (with its tools and template
kwargs) of held-out conversations from `scripts/default_model_data.py`; for other checkpoints,
the chat questions below through their chat template. Greedy, until the model stops (or
--output-len tokens; --ignore-eos forces that many). Concurrency 1: each prompt runs alone and
decode tokens/s counts the tokens after the first over the time after the first (prefill
excluded). Concurrency C > 1: the prompts run in waves of C at once, and tokens/s is every
generated token over the waves' wall time (prefill included). Every mode runs in turn within
each repeat, so machine drift hits them alike; outputs are checked token for token against `off`.
"""

# ruff: noqa: E402 (torch is imported after GOMP_SPINCOUNT is set)
from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import asdict
from pathlib import Path

from dsaserve.runtime.omp import limit_omp_spinning

limit_omp_spinning()  # before torch is imported, as the server's engine processes (runtime/omp.py)

import torch
from transformers import AutoTokenizer

from dsaserve import LLM, SamplingParams
from dsaserve.assets import default_drafter_path, default_model_path
from dsaserve.engine.messages import GenerateRequest
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
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model-path", default=str(default_model_path()))
    ap.add_argument("--modes", default="off,eagle3,eagle5,dflash")
    ap.add_argument("--concurrency", default="1", help="comma list, e.g. 1,8,32")
    ap.add_argument("--draft-model", default=None, help="DFLASH drafter (default: embedded)")
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


def engines(args) -> dict[str, LLM]:
    # --threads goes to the engine: it sets torch's threads itself (default: the cores)
    base = {"max_total_tokens": 65536, "device": args.device, "max_running_requests": 64,
            "json_model_override_args": args.json_model_override_args,
            "threads": args.threads}  # fmt: skip
    out = {}
    for mode in args.modes.split(","):
        if mode == "off":
            out[mode] = LLM(args.model_path, **base)
        elif mode.startswith("eagle"):
            out[mode] = LLM(args.model_path, speculative_algorithm="EAGLE",
                            speculative_num_steps=int(mode[5:]), **base)  # fmt: skip
        elif mode == "dflash":
            draft = args.draft_model or str(default_drafter_path())
            out[mode] = LLM(args.model_path, speculative_algorithm="DFLASH",
                            speculative_draft_model_path=draft, **base)  # fmt: skip
        else:
            raise SystemExit(f"--modes: unknown mode {mode!r} (off, eagleK, dflash)")
    if "off" not in out:
        raise SystemExit("--modes must include off (the reference)")
    return out


def run(args) -> dict:
    if Path(args.model_path).resolve() == default_model_path().resolve():
        prompts = own_kind_prompts(args.model_path, args.num_prompts)
    else:
        prompts = chat_prompts(args.model_path, args.num_prompts)
    modes = engines(args)
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=args.ignore_eos)
    timers = {mode: time_forwards(llm) for mode, llm in modes.items()}
    for llm in modes.values():
        wave(llm, prompts[:1], params)  # warm-up
    rows = []
    for concurrency in [int(c) for c in args.concurrency.split(",")]:
        rows += measure(args, modes, timers, prompts, params, concurrency)
    return {"args": vars(args), "num_prompts": len(prompts), "rows": rows,
            "torch_threads": torch.get_num_threads()}  # fmt: skip


def measure(args, modes, timers, prompts, params, concurrency: int) -> list[dict]:
    totals = {m: {"tokens": 0, "seconds": 0.0} for m in modes}
    outputs: dict[str, list] = {}
    for timer in timers.values():
        for counts in timer.values():
            counts[:] = [0, 0.0]
    before = {m: spec_counts(llm) for m, llm in modes.items()}
    for _ in range(args.repeats):
        for mode, llm in modes.items():
            outputs[mode] = []
            for start in range(0, len(prompts), concurrency):
                tokens, seconds, ids = wave(llm, prompts[start : start + concurrency], params)
                totals[mode]["tokens"] += tokens
                totals[mode]["seconds"] += seconds
                outputs[mode] += ids
    rows = []
    for mode, llm in modes.items():
        row = {"mode": mode, "concurrency": concurrency, "tokens": totals[mode]["tokens"],
               "seconds": totals[mode]["seconds"]}  # fmt: skip
        row["tokens_per_s"] = row["tokens"] / row["seconds"]
        row["identical"] = outputs[mode] == outputs["off"]
        for name, (calls, seconds) in timers[mode].items():
            row[f"{name}_ms"] = 1e3 * seconds / max(calls, 1)
        verify, emitted, correct, proposed = (a - b for a, b in zip(spec_counts(llm), before[mode]))
        if verify:
            row |= {"accept_length": emitted / verify, "accept_rate": correct / proposed}
        rows.append(row)
    plain = rows[0]["tokens_per_s"]
    for row in rows:
        row["speedup"] = row["tokens_per_s"] / plain
    return rows


def spec_counts(llm: LLM) -> tuple[int, int, int, int]:
    spec = llm.engine.spec
    if spec is None:
        return 0, 0, 0, 0
    t = spec.report.total
    return t.verify_ct, t.verify_tokens, t.correct_drafts, t.proposed_drafts


def time_forwards(llm: LLM) -> dict[str, list]:
    """Wrap the target and drafter forwards of `llm`: name -> [calls, seconds]. The target's:
    a plain step's forward (`ModelRunner.forward`) or a verify (`ModelRunner.run_verify`), only
    those whose rows are all decode rows (no prefill chunk); the drafter's: an MTP-layer forward
    (draft step or catch-up, decode rows only) or a DFlash block proposal."""
    engine, timers = llm.engine, {}
    runner = engine.runner
    plain = ("target_forward", runner, "forward",
             lambda a: all(e - s == 1 for s, e in zip(a[0].starts, a[0].ends)))  # fmt: skip
    wrapped = [plain, ("draft_forward", engine.model, "forward_mtp",
                       lambda a: not current_batch().extends)]  # fmt: skip
    if engine.spec is not None:
        wrapped[0] = ("target_forward", runner, "run_verify", lambda a: not a[0].extends)
    if engine.spec is not None and hasattr(engine.spec, "drafter"):
        wrapped[1] = ("draft_forward", engine.spec.drafter, "propose", lambda a: True)
    for name, owner, attr, counted in wrapped:
        timers[name] = [0, 0.0]

        def timed(*a, _inner=getattr(owner, attr), _t=timers[name], _c=counted, **kw):
            start = time.perf_counter()
            try:
                return _inner(*a, **kw)
            finally:
                if _c(a):
                    _t[0] += 1
                    _t[1] += time.perf_counter() - start

        setattr(owner, attr, timed)
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


def wave(llm: LLM, prompts: list[list[int]], params: SamplingParams):
    """Run `prompts` at once; (tokens, seconds, ids per prompt). One prompt: the tokens and time
    after its first token (decode only); several: all tokens over the whole wave."""
    engine = llm.engine
    rids = [f"bench-{time.perf_counter_ns()}-{i}" for i in range(len(prompts))]
    for rid, prompt in zip(rids, prompts):
        engine.add_request(GenerateRequest(rid=rid, input_ids=prompt, sampling=asdict(params)))
    ids: dict[str, list[int]] = {rid: [] for rid in rids}
    started, first_at, first_len = time.perf_counter(), None, 0
    while engine.has_work():
        for out in engine.step():
            ids[out.rid] += out.token_ids
        if first_at is None and len(prompts) == 1 and ids[rids[0]]:
            first_at, first_len = time.perf_counter(), len(ids[rids[0]])
    total = sum(len(v) for v in ids.values())
    if len(prompts) == 1:
        return total - first_len, time.perf_counter() - first_at, [ids[rids[0]]]
    return total, time.perf_counter() - started, [ids[rid] for rid in rids]


def print_table(record: dict) -> None:
    print(f"\n{record['num_prompts']} prompts, torch threads {record['torch_threads']}")
    head = f"{'mode':<8}{'conc':>5}{'tok/s':>9}{'speedup':>9}{'accept len':>12}"
    print(head + f"{'accept rate':>13}{'identical':>11}{'target fwd ms':>15}{'draft ms':>10}")
    for r in record["rows"]:
        accept = f"{r['accept_length']:.2f}" if "accept_length" in r else "-"
        rate = f"{r['accept_rate']:.2f}" if "accept_rate" in r else "-"
        draft = f"{r['draft_forward_ms']:.2f}" if r["mode"] != "off" else "-"
        print(f"{r['mode']:<8}{r['concurrency']:>5}{r['tokens_per_s']:>9.1f}"
              f"{r['speedup']:>8.2f}x{accept:>12}{rate:>13}{str(r['identical']):>11}"
              f"{r['target_forward_ms']:>15.2f}{draft:>10}")  # fmt: skip


if __name__ == "__main__":
    main()

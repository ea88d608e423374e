"""Side by side: dsaserve vs llama.cpp on one checkpoint, batch-1 decode, prefill and 32 chats.

    python bench/llamacpp.py [--model-path DIR] [--threads 1,2] [--contexts 512,4096,16384] \
        [--decode-tokens 128] [--chats 32] [--chat-input 128] [--chat-output 100] \
        [--repeats 2] [--cache ~/.cache/dsaserve/llamacpp] [--json bench/results/llamacpp.json]

llama.cpp is built once from the `llama-cpp-python` sdist's vendored copy and the checkpoint
converted with its own converter (bench/llamacpp_setup.py says how). Both engines get token ids
(no tokenizer on either side), greedy, fp32. First, both engines' greedy tokens are checked
against transformers on a few prompts. Then for each thread count and each repeat, every
workload runs on llama.cpp and then on dsaserve, so machine noise hits both alike; every run is
reported. llama.cpp is `llama-server` (one slot for batch 1, `--chats` slots for the chats), its
own `timings` giving prefill and decode rates; dsaserve is the in-process engine, its steps timed
(prefill: until the first token; decode: the tokens after it). `llama-bench tg` is listed too.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from dsaserve.runtime.omp import limit_omp_spinning

PEER_ENV = dict(os.environ)  # llama.cpp (its ggml on OpenMP) runs with the environment it was given
limit_omp_spinning()  # dsaserve's, before torch is imported (runtime/omp.py)

sys.path.insert(0, str(Path(__file__).resolve().parent))
import llamacpp_setup as setup  # noqa: E402

WORKLOADS = ("decode", "prefill", "chats")
START_TIMEOUT_S = 300.0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model-path", help="checkpoint folder; default: the embedded model")
    p.add_argument("--threads", default="1,2", help="comma-separated thread counts")
    p.add_argument("--contexts", default="512,4096,16384", help="prompt lengths (batch 1)")
    p.add_argument("--decode-tokens", type=int, default=128, help="batch-1 tokens to generate")
    p.add_argument("--chats", type=int, default=32, help="concurrent chats")
    p.add_argument("--chat-input", type=int, default=128)
    p.add_argument("--chat-output", type=int, default=100)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--check-prompts", type=int, default=3, help="prompts checked vs transformers")
    p.add_argument("--check-tokens", type=int, default=24)
    p.add_argument("--version", default=setup.DEFAULT_VERSION, help="llama-cpp-python sdist")
    p.add_argument("--cache", default=str(Path.home() / ".cache" / "dsaserve" / "llamacpp"))
    p.add_argument("--jobs", type=int, default=2, help="parallel compile jobs for the build")
    p.add_argument("--enable-torch-compile", action="store_true", help="dsaserve flag")
    p.add_argument("--json", default="bench/results/llamacpp.json")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.threads = _ints(args.threads, "--threads")
    args.contexts = _ints(args.contexts, "--contexts")
    return args


def _ints(text: str, flag: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"{flag}: comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise SystemExit(f"{flag}: positive integers, got {text!r}")
    return values


def random_prompt(length: int, vocab: int, seed: int) -> list[int]:
    """Token ids that avoid the low (special) ids; distinct per seed so no prefix is reused."""
    rng = random.Random(seed)
    return [rng.randrange(32, vocab) for _ in range(length)]


# ---- results ------------------------------------------------------------------------------
def summarise(runs: list[dict]) -> list[dict]:
    """Median per (workload, size, threads, engine) and the dsaserve / llama.cpp ratio."""
    keys = sorted({(r["workload"], r["size"], r["threads"]) for r in runs},
                  key=lambda k: (WORKLOADS.index(k[0]), k[1], k[2]))  # fmt: skip
    rows = []
    for workload, size, threads in keys:
        row: dict[str, Any] = {"workload": workload, "size": size, "threads": threads}
        for engine in ("llamacpp", "dsaserve"):
            rates = [r["tok_s"] for r in runs if (r["workload"], r["size"], r["threads"],
                     r["engine"]) == (workload, size, threads, engine)]  # fmt: skip
            row[engine] = statistics.median(rates) if rates else None
            row[f"{engine}_runs"] = rates
        both = row["llamacpp"] and row["dsaserve"]
        row["ratio"] = row["dsaserve"] / row["llamacpp"] if both else None
        rows.append(row)
    return rows


def table(rows: list[dict], bench_tg: dict[int, float] | None = None) -> str:
    label = {"decode": "batch-1 decode, {size}-token prompt", "prefill": "prefill, {size} tokens",
             "chats": "{size} concurrent chats"}  # fmt: skip
    lines = ["| workload | threads | llama.cpp tok/s | dsaserve tok/s | dsaserve ÷ llama.cpp "
             "| runs (llama.cpp / dsaserve) |", "|---|---:|---:|---:|---:|---|"]  # fmt: skip
    for row in rows:
        runs = " / ".join(", ".join(f"{v:.0f}" for v in row[f"{e}_runs"])
                          for e in ("llamacpp", "dsaserve"))  # fmt: skip
        ratio = f"**{row['ratio']:.2f}×**" if row["ratio"] else "–"
        lines.append(
            f"| {label[row['workload']].format(size=row['size'])} | {row['threads']} "
            f"| {_num(row['llamacpp'])} | {_num(row['dsaserve'])} | {ratio} | {runs} |"
        )
    for threads, rate in (bench_tg or {}).items():
        lines.append(f"| `llama-bench tg` (reference) | {threads} | {rate:.0f} | | | |")
    return "\n".join(lines)


def _num(value: float | None) -> str:
    return "–" if value is None else f"{value:,.0f}"


# ---- llama.cpp ----------------------------------------------------------------------------
class LlamaServer:
    """One llama-server process (its own process group), stopped on exit whatever happens."""

    def __init__(self, bin_dir: Path, gguf: Path, threads: int, slots: int, ctx: int) -> None:
        self.port = _free_port()
        cmd = [str(bin_dir / "llama-server"), "-m", str(gguf), "--port", str(self.port),
               "--host", "127.0.0.1", "-t", str(threads), "-tb", str(threads), "-np", str(slots),
               "-c", str(ctx), "-b", "2048", "-ub", "512", "--no-warmup"]  # fmt: skip
        self.log = open(Path(gguf).parent / f"server-{self.port}.log", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT,
                                     env=PEER_ENV, start_new_session=True)  # fmt: skip

    def __enter__(self) -> LlamaServer:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"llama-server exited ({self.proc.returncode}): {self.log.name}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/health", timeout=5):
                    return self
            except OSError:
                time.sleep(0.5)
        raise RuntimeError("llama-server did not become healthy")

    def __exit__(self, *exc: object) -> None:
        try:
            os.killpg(self.proc.pid, 15)
            self.proc.wait(30)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(self.proc.pid, 9)
        self.log.close()

    def complete(self, prompt: list[int], n_predict: int, ignore_eos: bool = True) -> dict:
        """Greedy. With ignore_eos llama-server bans the end-of-generation tokens (a logit bias
        of -inf), so the exactness check asks without it and compares up to the first one."""
        body = {"prompt": prompt, "n_predict": n_predict, "temperature": 0.0, "top_k": 1,
                "ignore_eos": ignore_eos, "cache_prompt": False, "return_tokens": True,
                "stream": False}  # fmt: skip
        request = urllib.request.Request(f"http://127.0.0.1:{self.port}/completion",
                                         json.dumps(body).encode(),
                                         {"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=3600) as response:
            return json.loads(response.read())


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def llama_bench_tg(bin_dir: Path, gguf: Path, threads: int, tokens: int) -> float:
    out = subprocess.run([str(bin_dir / "llama-bench"), "-m", str(gguf), "-t", str(threads),
                          "-p", "0", "-n", str(tokens), "-r", "2", "-o", "json"],
                         check=True, capture_output=True, text=True).stdout  # fmt: skip
    return float(json.loads(out)[0]["avg_ts"])


def llama_single(server: LlamaServer, prompt: list[int], new: int) -> tuple[float, float]:
    """(prefill tok/s, decode tok/s) from the server's own timings."""
    timings = server.complete(prompt, new)["timings"]
    return timings["prompt_per_second"], timings["predicted_per_second"]


def llama_chats(server: LlamaServer, prompts: list[list[int]], new: int) -> float:
    results: list[dict] = [{}] * len(prompts)

    def one(i: int) -> None:
        results[i] = server.complete(prompts[i], new)

    start = time.perf_counter()
    workers = [threading.Thread(target=one, args=(i,)) for i in range(len(prompts))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    elapsed = time.perf_counter() - start
    return sum(len(r["tokens"]) for r in results) / elapsed


# ---- dsaserve -----------------------------------------------------------------------------
def dsaserve_engine(model_path: Path, max_tokens: int, compile_step: bool):
    from dsaserve.args import ServerArgs
    from dsaserve.engine.engine import Engine

    extra = {"enable_torch_compile": True} if compile_step else {}
    args = ServerArgs(model_path=str(model_path), max_total_tokens=max_tokens, dtype="float32",
                      disable_radix_cache=True, **extra)  # fmt: skip
    return Engine(args, show_progress=False)


def _add(engine, rid: str, prompt: list[int], new: int):
    from dsaserve.engine.messages import GenerateRequest

    sampling = {"max_tokens": new, "temperature": 0.0, "ignore_eos": True}
    engine.add_request(GenerateRequest(rid=rid, input_ids=prompt, sampling=sampling, stream=False))
    return engine.reqs[rid]


def dsaserve_single(engine, prompt: list[int], new: int, rid: str) -> tuple[float, float]:
    """(prefill tok/s: until the first token, decode tok/s: the tokens after it)."""
    req = _add(engine, rid, prompt, new)
    start = time.perf_counter()
    while not req.output_ids:
        engine.step()
    first = time.perf_counter()
    while engine.has_work():
        engine.step()
    end = time.perf_counter()
    return len(prompt) / (first - start), (len(req.output_ids) - 1) / (end - first)


def dsaserve_tokens(engine, prompt: list[int], new: int, rid: str) -> list[int]:
    req = _add(engine, rid, prompt, new)
    while engine.has_work():
        engine.step()
    return list(req.output_ids)


def dsaserve_chats(engine, prompts: list[list[int]], new: int, tag: str) -> float:
    reqs = [_add(engine, f"{tag}-{i}", p, new) for i, p in enumerate(prompts)]
    start = time.perf_counter()
    while engine.has_work():
        engine.step()
    return sum(len(r.output_ids) for r in reqs) / (time.perf_counter() - start)


# ---- the run ------------------------------------------------------------------------------
@functools.lru_cache(maxsize=1)
def _reference(model_path: Path):
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()  # the MTP layer's weights are "unexpected" to it
    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()


def reference_greedy(model_path: Path, prompt: list[int], new: int) -> list[int]:
    """transformers' greedy tokens by full forwards (its own cache path is not the reference)."""
    import torch

    model, ids = _reference(model_path), list(prompt)
    with torch.no_grad():
        for _ in range(new):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt) :]


def until_eog(tokens: list[int], eog: set[int]) -> list[int]:
    """The tokens before the first end-of-generation token."""
    for i, token in enumerate(tokens):
        if token in eog:
            return tokens[:i]
    return tokens


def check_exact(args, model_path: Path, bin_dir: Path, gguf: Path, engine, vocab: int) -> list:
    """transformers' greedy tokens (no stop) vs dsaserve's (ignore_eos) whole, and vs
    llama.cpp's (which stops at an end-of-generation token) up to the first such token."""
    eog = set(_reference(model_path).generation_config.eos_token_id or [])
    checks = []
    prompts = [random_prompt(n, vocab, 1000 + n) for n in (7, 40, 100)[: args.check_prompts]]
    with LlamaServer(bin_dir, gguf, 1, 1, 1024) as server:
        for i, prompt in enumerate(prompts):
            expected = reference_greedy(model_path, prompt, args.check_tokens)
            answer = server.complete(prompt, args.check_tokens, False)
            llama = until_eog(answer["tokens"], eog)
            ours = dsaserve_tokens(engine, prompt, args.check_tokens, f"check-{i}")
            upto = until_eog(expected, eog)
            # where the reference writes an end token, llama.cpp must stop there on one
            ended = len(upto) == len(expected) or answer.get("stop_type") == "eos"
            checks.append({"prompt_len": len(prompt), "llamacpp_matches": llama == upto and ended,
                           "llamacpp_compared": len(upto), "dsaserve_matches": ours == expected,
                           "dsaserve_compared": len(expected)})  # fmt: skip
            print(
                f"exactness, prompt of {len(prompt)}: llama.cpp {llama == upto and ended} (first "
                f"{len(upto)} tokens, up to an end token), dsaserve {ours == expected} "
                f"({len(expected)} tokens)",
                flush=True,
            )
    return checks


def measure(args, bin_dir: Path, gguf: Path, engine, vocab: int) -> list[dict]:
    import torch

    runs: list[dict] = []
    ctx = max(args.contexts) + args.decode_tokens + 64
    chat_ctx = args.chats * (args.chat_input + args.chat_output + 32)

    def record(workload: str, size: int, threads: int, engine_name: str, rate: float) -> None:
        runs.append({"workload": workload, "size": size, "threads": threads,
                     "engine": engine_name, "tok_s": rate})  # fmt: skip
        print(
            f"  {workload:8s} {size:6d}  t={threads}  {engine_name:9s} {rate:9.1f} tok/s",
            flush=True,
        )

    for threads in args.threads:
        torch.set_num_threads(threads)
        for rep in range(args.repeats):
            with LlamaServer(bin_dir, gguf, threads, 1, ctx) as single:
                for n in args.contexts:
                    prompt = random_prompt(n, vocab, seed=10 * n + rep)
                    pre, dec = llama_single(single, prompt, args.decode_tokens)
                    record("prefill", n, threads, "llamacpp", pre)
                    record("decode", n, threads, "llamacpp", dec)
                    pre, dec = dsaserve_single(
                        engine, prompt, args.decode_tokens, f"s{threads}{rep}{n}"
                    )
                    record("prefill", n, threads, "dsaserve", pre)
                    record("decode", n, threads, "dsaserve", dec)
            prompts = [
                random_prompt(args.chat_input, vocab, 7 * i + rep) for i in range(args.chats)
            ]
            with LlamaServer(bin_dir, gguf, threads, args.chats, chat_ctx) as many:
                record("chats", args.chats, threads, "llamacpp",
                       llama_chats(many, prompts, args.chat_output))  # fmt: skip
            rate = dsaserve_chats(engine, prompts, args.chat_output, f"c{threads}{rep}")
            record("chats", args.chats, threads, "dsaserve", rate)
    return runs


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    from dsaserve.assets import default_model_path

    model_path = Path(args.model_path) if args.model_path else default_model_path()
    cache = Path(args.cache).expanduser()
    bin_dir = setup.build(cache, args.version, args.jobs)
    gguf = setup.convert(
        setup.source_dir(cache, args.version), model_path, cache / "models" / model_path.name
    )
    vocab = json.loads((model_path / "config.json").read_text())["vocab_size"]
    total = (
        max(args.contexts)
        + args.decode_tokens
        + args.chats * (args.chat_input + args.chat_output)
        + 4096
    )
    engine = dsaserve_engine(model_path, total, args.enable_torch_compile)
    checks = check_exact(args, model_path, bin_dir, gguf, engine, vocab)
    runs = measure(args, bin_dir, gguf, engine, vocab)
    bench_tg = {t: llama_bench_tg(bin_dir, gguf, t, args.decode_tokens) for t in args.threads}
    rows = summarise(runs)
    print(table(rows, bench_tg))
    load = os.getloadavg()
    result = {"when": datetime.now(UTC).isoformat(timespec="seconds"), "load_average": load,
              "cpu_count": os.cpu_count(), "args": vars(args), "exactness": checks, "runs": runs,
              "summary": rows, "llama_bench_tg": bench_tg}  # fmt: skip
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    print(f"load average {load[0]:.1f}; JSON: {args.json}")
    return 0 if all(c["llamacpp_matches"] and c["dsaserve_matches"] for c in checks) else 1


if __name__ == "__main__":
    sys.exit(main())

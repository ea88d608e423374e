"""Prefill/decode disaggregation on this machine: colocated vs 1 prefill + 1 decode behind the
real sglang-router, and the raw transfer speed of each transfer engine.

    python bench/pd.py [--model-path DIR] [--num-prompts 8] [--input-len 256] [--output-len 64]
                       [--concurrency 1,4] [--backends nixl,mooncake] [--threads 1]
                       [--tp 1,2] [--json bench/results/pd.json]

Serving: the same prompts (random words, --input-len tokens), greedy with ignore_eos, streamed
through the openai SDK; TTFT is the time to the first streamed token, output tok/s counts every
generated token over the wall time of the batch. Colocated is one `dsaserve serve`; PD is one
prefill and one decode (NIXL) behind `sglang_router.launch_router --pd-disaggregation`. With
`--tp 1,2` each layout runs in turn: the colocated server, the prefill and the decode all at
`--tp N` (a `--tp N` prefill's first rank writes every page; the decode's first rank receives).
Transfer: two processes, the initiator writes a 64 MiB registered buffer into the target's, as
one segment and as 64 KiB segments (KV pages are that order of size), through
`dsaserve.disaggregation.transfer`, and the target checks the bytes.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import random
import sys
import threading
import time
from pathlib import Path

import openai
import torch

from dsaserve.assets import default_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from pd_harness import PD_ENV, free_port, launch, running_router, stop_all  # noqa: E402
from server_harness import _wait_ready  # noqa: E402

TRANSFER_BYTES = 64 << 20
SEGMENT_SIZES = (64 << 20, 64 << 10)  # one segment; KV-page-sized segments


# ---- transfer engines ----------------------------------------------------------------------
def _target(backend: str, to_initiator: mp.Queue, from_initiator: mp.Queue) -> None:
    """The receiving side: register a buffer, publish it, report its checksum when told."""
    from dsaserve.disaggregation.transfer import create

    engine = create(backend, f"bench-target-{os.getpid()}", "127.0.0.1", None)
    buffer = torch.zeros(TRANSFER_BYTES, dtype=torch.uint8)
    engine.register([(buffer.data_ptr(), TRANSFER_BYTES, "DRAM")])
    to_initiator.put((engine.metadata(), buffer.data_ptr()))
    from_initiator.get()  # the initiator is done
    to_initiator.put(hashlib.blake2b(buffer.numpy().tobytes(), digest_size=8).hexdigest())


def transfer_speed(backend: str, segment_bytes: int, repeats: int = 5) -> dict:
    os.environ.update(PD_ENV)
    from dsaserve.disaggregation.transfer import create

    context = mp.get_context("spawn")
    to_initiator, from_initiator = context.Queue(), context.Queue()
    target = context.Process(target=_target, args=(backend, to_initiator, from_initiator))
    target.start()
    try:
        engine = create(backend, f"bench-initiator-{os.getpid()}", "127.0.0.1", None)
        source = torch.randint(0, 256, (TRANSFER_BYTES,), dtype=torch.uint8)
        engine.register([(source.data_ptr(), TRANSFER_BYTES, "DRAM")])
        metadata, remote = to_initiator.get(timeout=120)
        peer = engine.add_peer(metadata)
        segments = [(source.data_ptr() + o, remote + o, segment_bytes)
                    for o in range(0, TRANSFER_BYTES, segment_bytes)]  # fmt: skip
        engine.write(peer, segments, b"warmup")
        times = []
        for i in range(repeats):
            started = time.perf_counter()
            engine.write(peer, segments, f"run{i}".encode())
            times.append(time.perf_counter() - started)
        from_initiator.put("done")
        received = to_initiator.get(timeout=120)
        sent = hashlib.blake2b(source.numpy().tobytes(), digest_size=8).hexdigest()
    finally:
        target.join(30)
        if target.is_alive():
            target.kill()
    best = min(times)
    return {"backend": backend, "bytes": TRANSFER_BYTES, "segment_bytes": segment_bytes,
            "best_s": best, "gib_per_s": TRANSFER_BYTES / best / 2**30,
            "bytes_match": received == sent}  # fmt: skip


# ---- serving --------------------------------------------------------------------------------
def _prompts(n: int, input_len: int, seed: int = 0) -> list[str]:
    words = "the of and to in is was for on are with as by at from this that which".split()
    words += "river mountain engine signal market garden system window winter theory".split()
    rng = random.Random(seed)
    # ~1 token per word for these common words with the embedded tokenizer
    return [" ".join(rng.choice(words) for _ in range(input_len)) for _ in range(n)]


def _one(client: openai.OpenAI, prompt: str, output_len: int) -> tuple[float, int]:
    started = time.perf_counter()
    ttft, tokens = None, 0
    stream = client.completions.create(
        model="m", prompt=prompt, max_tokens=output_len, temperature=0, stream=True,
        extra_body={"ignore_eos": True}, stream_options={"include_usage": True},
    )  # fmt: skip
    for chunk in stream:
        if ttft is None and chunk.choices and chunk.choices[0].text:
            ttft = time.perf_counter() - started
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return ttft or 0.0, tokens


def serve_numbers(base: str, prompts: list[str], output_len: int, concurrency: int) -> dict:
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=600)
    _one(client, prompts[0], 4)  # warm up
    results: list[tuple[float, int]] = []
    queue = list(prompts)
    lock = threading.Lock()

    def worker() -> None:
        while True:
            with lock:
                if not queue:
                    return
                prompt = queue.pop()
            result = _one(client, prompt, output_len)
            with lock:
                results.append(result)

    started = time.perf_counter()
    threads = [threading.Thread(target=worker) for _ in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - started
    ttfts = sorted(r[0] for r in results)
    return {"concurrency": concurrency, "requests": len(results),
            "mean_ttft_ms": 1000 * sum(ttfts) / len(ttfts),
            "p50_ttft_ms": 1000 * ttfts[len(ttfts) // 2],
            "output_tok_s": sum(r[1] for r in results) / wall}  # fmt: skip


def serving(args: argparse.Namespace, tp: int) -> list[dict]:
    model = Path(args.model_path)
    env = {"OMP_NUM_THREADS": str(args.threads)}
    base = ["--max-total-tokens", "16384", "--page-size", "16", "--tp", str(tp)]
    bootstrap = free_port()
    pd = ["--disaggregation-transfer-backend", "nixl", "--disaggregation-bootstrap-port",
          str(bootstrap)]  # fmt: skip
    servers = [
        launch(model, *base, env=env),
        launch(model, *base, "--disaggregation-mode", "prefill", *pd, env=env),
        launch(model, *base, "--disaggregation-mode", "decode", *pd, env=env),
    ]
    rows = []
    try:
        for server in servers:
            server.url = _wait_ready(server)
        colocated, prefill, decode = servers
        prompts = _prompts(args.num_prompts, args.input_len)
        router_flags = ["--pd-disaggregation", "--prefill", prefill.url, str(bootstrap),
                        "--decode", decode.url]  # fmt: skip
        with running_router(*router_flags) as router:
            for concurrency in args.concurrency:
                setups = ((f"colocated, tp {tp}", colocated.url),
                          (f"1P+1D (NIXL), tp {tp}", router.url))  # fmt: skip
                for name, url in setups:
                    row = serve_numbers(url, prompts, args.output_len, concurrency)
                    rows.append({"setup": name, "tp": tp, **row})
                    print(f"  {name:<20} c={concurrency}: TTFT {row['mean_ttft_ms']:.0f} ms, "
                          f"{row['output_tok_s']:.1f} tok/s", flush=True)  # fmt: skip
    finally:
        stop_all(servers)
    return rows


def int_list(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model-path", default=str(default_model_path()))
    ap.add_argument("--num-prompts", type=int, default=8)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--concurrency", type=int_list, default=[1, 4])
    ap.add_argument("--backends", default="nixl,mooncake")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--tp", type=int_list, default=[1], help="tensor-parallel sizes, in turn")
    ap.add_argument("--skip-serving", action="store_true")
    ap.add_argument("--json", default="bench/results/pd.json")
    args = ap.parse_args()
    transfers = []
    for backend in args.backends.split(","):
        for segment in SEGMENT_SIZES:
            try:
                transfers.append(transfer_speed(backend, segment))
            except ImportError as e:
                transfers.append({"backend": backend, "skipped": str(e)})
                break
    rows = [] if args.skip_serving else [row for tp in args.tp for row in serving(args, tp)]
    print("\n| setup | concurrency | mean TTFT (ms) | p50 TTFT (ms) | output tok/s |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['setup']} | {r['concurrency']} | {r['mean_ttft_ms']:.0f} | "
              f"{r['p50_ttft_ms']:.0f} | {r['output_tok_s']:.1f} |")  # fmt: skip
    print("\n| transfer engine | segment | 64 MiB in | GiB/s | bytes match |")
    print("|---|---:|---:|---:|---|")
    for t in transfers:
        if "skipped" in t:
            print(f"| {t['backend']} | skipped: {t['skipped'][:60]} | | | |")
        else:
            print(f"| {t['backend']} | {t['segment_bytes'] >> 10} KiB | {1000 * t['best_s']:.1f} ms"
                  f" | {t['gib_per_s']:.2f} | {t['bytes_match']} |")  # fmt: skip
    result = {"args": {k: v for k, v in vars(args).items()}, "serving": rows,
              "transfer": transfers, "cpu_count": os.cpu_count()}  # fmt: skip
    Path(args.json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.json).write_text(json.dumps(result, indent=2))
    print(f"\nwrote {args.json}")


if __name__ == "__main__":
    main()

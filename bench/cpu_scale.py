"""CPU decode at a size beyond the cache: dsaserve against llama.cpp, bf16, block FP8 and NVFP4.

The model is bench/resident_memory.py's random one of GLM-5.3's shape at reduced width, here 12
layers deep (the first dense, then MoE; 1.44B parameters, ~0.4B active per token, 2.9 GB in
bf16), built once and cached with its block-FP8 and NVFP4 copies. llama.cpp is built from the
`llama-cpp-python` sdist (bench/llamacpp_setup.py) and reads the bf16 checkpoint converted to
GGUF bf16 and Q8_0 (where its Q8_0 aborts, that is said and the FP8 engine is compared with the
bf16 GGUF only).

Every engine runs as its own server (`dsaserve serve`, `llama-server`), one at a time, on the
same thread count, and answers the same token ids, greedy, with end tokens ignored and no prefix
reuse. Every request streams; a decode rate is the tokens that arrive while all requests decode,
over that time (prefill falls outside): for batch 1, a 512-token prompt answered with `--tokens`
tokens; for `--concurrent` requests at once (128-token prompts, `--chat-tokens` each), from the
last request's first token to the first request's last.
Within a repeat the servers alternate; every repeat is listed. Also printed: each server's
resident memory (PSS summed over its processes) against its checkpoint's bytes, and the share of
this machine's streaming read (bench/decode_profile.py's probe, same thread count, measured
between the servers) that a batch-1 step's weight bytes reach at the measured rate.

    python bench/cpu_scale.py [--layers 12] [--threads 1 2] [--repeats 2] [--tokens 64] \
        [--concurrent 8] [--json bench/results/cpu_scale.json]
"""

# ruff: noqa: E402 (llama.cpp keeps the environment it was given; ours is set after)
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from datetime import UTC, datetime
from pathlib import Path

PEER_ENV = dict(os.environ)

import httpx
import llamacpp_setup as setup  # (bench/ is the script's folder)
from decode_profile import stream_bandwidth
from llamacpp import random_prompt
from resident_memory import checkpoints, model_arguments
from sbs_servers import ServerSpec, dsaserve_command, free_port, group_members, running

PROMPT, CHAT_PROMPT = 512, 128
START_TIMEOUT_S = 600.0


# ---- what a step must read ----------------------------------------------------------------
def safetensors_sizes(folder: Path) -> dict[str, int]:
    """Every tensor's bytes, from the safetensors headers (nothing is loaded)."""
    sizes: dict[str, int] = {}
    for file in sorted(folder.glob("*.safetensors")):
        with open(file, "rb") as f:
            header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
        for name, entry in header.items():
            if name != "__metadata__":
                begin, end = entry["data_offsets"]
                sizes[name] = end - begin
    return sizes


def step_weight_bytes(folder: Path) -> int:
    """The weight bytes one batch-1 decode step reads: every decoder layer's tensors (the
    routed experts' at top_k / n_routed_experts of their size), one embedding row, the final
    norm and the LM head; the MTP layer is not run."""
    config = json.loads((folder / "config.json").read_text())
    layers = config["num_hidden_layers"]
    share = config["num_experts_per_tok"] / config["n_routed_experts"]
    total = 0.0
    for name, size in safetensors_sizes(folder).items():
        if name == "model.embed_tokens.weight":
            total += size / config["vocab_size"]
        elif name.startswith("model.layers."):
            if int(name.split(".")[2]) < layers:
                total += size * share if ".mlp.experts." in name else size
        else:
            total += size
    return int(total)


def checkpoint_bytes(path: Path) -> int:
    files = [path] if path.is_file() else list(path.glob("*.safetensors"))
    return sum(f.stat().st_size for f in files)


# ---- the servers --------------------------------------------------------------------------
def dsaserve_spec(folder: Path, threads: int, kv_tokens: int) -> ServerSpec:
    extra = ["--threads", str(threads), "--disable-radix-cache", "--max-total-tokens",
             str(kv_tokens)]  # fmt: skip
    return ServerSpec("dsaserve", dsaserve_command(folder, extra, "auto"))


def llama_spec(bin_dir: Path, gguf: Path, threads: int, slots: int, kv_tokens: int) -> ServerSpec:
    port = free_port()  # llama-server cannot report a port-0 bind
    command = [str(bin_dir / "llama-server"), "-m", str(gguf), "--host", "127.0.0.1",
               "--port", str(port), "-t", str(threads), "-tb", str(threads), "-np", str(slots),
               "-c", str(kv_tokens), "-b", "2048", "-ub", "512", "--no-warmup"]  # fmt: skip
    return ServerSpec("llama.cpp", command, f"http://127.0.0.1:{port}")


def stream(engine: str, url: str, prompt: list[int], tokens: int) -> list[tuple[float, int]]:
    """One greedy streamed request of `tokens` new tokens, end tokens ignored: (arrival time,
    tokens so far) for each chunk."""
    common = {"temperature": 0.0, "ignore_eos": True}
    if engine == "dsaserve":
        sampling = {"max_new_tokens": tokens, **common}
        path, body = "/generate", {"input_ids": prompt, "stream": True, "sampling_params": sampling}
    else:
        path, body = "/completion", {"prompt": prompt, "n_predict": tokens, "top_k": 1,
                                     "cache_prompt": False, "return_tokens": True,
                                     "stream": True, **common}  # fmt: skip
    marks, count = [], 0
    with httpx.stream("POST", url + path, json=body, timeout=3600) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[len("data: ") :])
            if engine == "dsaserve":
                count = chunk["meta_info"]["completion_tokens"]
            else:  # (a chunk may hold back a token whose text is not whole UTF-8 yet)
                count = chunk.get("tokens_predicted", count)
            marks.append((time.perf_counter(), count))
    if count != tokens:
        raise RuntimeError(f"{engine} answered {count} tokens, asked {tokens}")
    return marks


def streams(engine: str, url: str, batch: list[list[int]], tokens: int) -> list[list]:
    """Every prompt of `batch` streamed at once; each request's marks."""
    marks: list = [None] * len(batch)

    def one(i: int) -> None:
        try:
            marks[i] = stream(engine, url, batch[i], tokens)
        except (RuntimeError, httpx.HTTPError) as exc:
            marks[i] = exc

    workers = [threading.Thread(target=one, args=(i,)) for i in range(len(batch))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    for result in marks:
        if not isinstance(result, list):
            raise RuntimeError(f"{engine}: {result!r}")
    return marks


def tokens_at(marks: list[tuple[float, int]], when: float) -> int:
    return max((count for at, count in marks if at <= when), default=0)


def prompts(count: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """`count` of bench/llamacpp.py's random prompts, distinct per seed: no prefix is reused."""
    return [random_prompt(length, vocab, 1000 * seed + i) for i in range(count)]


def decode_rate(engine: str, url: str, shape: tuple[int, int], tokens: int, vocab: int) -> float:
    """Tokens per second while every request of `shape` = (requests, prompt length) decodes:
    from the last request's first token to the first request's last, all requests' tokens
    (prefill falls outside). One round of the same shape before, unmeasured (first-time costs:
    buffers sized, pages touched)."""
    streams(engine, url, prompts(*shape, vocab, seed=0), 2)
    marks = streams(engine, url, prompts(*shape, vocab, seed=1), tokens)
    begin = max(m[0][0] for m in marks)
    end = min(m[-1][0] for m in marks)
    if end <= begin:
        raise RuntimeError(f"{engine}: no moment when all {shape[0]} requests were decoding")
    return sum(tokens_at(m, end) - tokens_at(m, begin) for m in marks) / (end - begin)


def resident_bytes(pgid: int) -> int:
    """PSS summed over the live processes of a server's group (a shared page counted once)."""
    total = 0
    for pid in group_members(pgid):
        try:
            lines = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
        except OSError:
            continue
        total += next(int(line.split()[1]) * 1024 for line in lines if line.startswith("Pss:"))
    return total


def kv_pool_bytes(url: str) -> int:
    stats = httpx.get(f"{url}/get_server_info", timeout=30).json()["internal_states"][0]
    return stats["kv_total_tokens"] * stats["kv_bytes_per_token"]


def serve_and_measure(spec: ServerSpec, args, env: dict, vocab: int) -> dict:
    """Start one server, warm it, measure batch 1 and the concurrent requests, read its memory."""
    engine = "dsaserve" if spec.name == "dsaserve" else "llama.cpp"
    with running([spec], env, START_TIMEOUT_S) as (server,):
        row = {"batch1_tok_s": decode_rate(engine, server.url, (1, PROMPT), args.tokens, vocab),
               "concurrent_tok_s": decode_rate(engine, server.url, (args.concurrent, CHAT_PROMPT),
                                               args.chat_tokens, vocab),
               "resident_bytes": resident_bytes(server.process.pid)}  # fmt: skip
        if engine == "dsaserve":
            row["kv_pool_bytes"] = kv_pool_bytes(server.url)
    return row


def try_measure(spec: ServerSpec, args, env: dict, vocab: int) -> dict:
    """A server that cannot start or answer (llama.cpp's Q8_0 of this architecture may abort)
    is a row with its error, not the end of the run."""
    try:
        return serve_and_measure(spec, args, env, vocab)
    except (RuntimeError, httpx.HTTPError) as exc:
        return {"error": str(exc).strip().splitlines()[-1][:200]}


# ---- the run ------------------------------------------------------------------------------
def contenders(args) -> list[dict]:
    """(engine, checkpoint) pairs in the order they alternate: llama.cpp's bf16 GGUF, ours on
    bf16, llama.cpp's Q8_0, ours on block FP8 and on NVFP4."""
    folders = checkpoints(args.cache, args.layers)
    cache = Path(args.llamacpp_cache).expanduser()
    bin_dir = setup.build(cache, setup.DEFAULT_VERSION, args.jobs)
    source = setup.source_dir(cache, setup.DEFAULT_VERSION)
    work = cache / "models" / folders["bf16"].name
    gguf = {kind: setup.convert(source, folders["bf16"], work, kind) for kind in ("bf16", "q8_0")}
    steps = {name: step_weight_bytes(folder) for name, folder in folders.items()}
    entries = [
        {"engine": "llama.cpp", "checkpoint": "bf16 GGUF", "path": gguf["bf16"], "bin": bin_dir,
         "step_bytes": steps["bf16"]},
        {"engine": "dsaserve", "checkpoint": "bf16", "path": folders["bf16"],
         "step_bytes": steps["bf16"]},
        {"engine": "llama.cpp", "checkpoint": "Q8_0 GGUF", "path": gguf["q8_0"], "bin": bin_dir,
         "step_bytes": None},
        {"engine": "dsaserve", "checkpoint": "block-FP8", "path": folders["block-FP8"],
         "step_bytes": steps["block-FP8"]},
        {"engine": "dsaserve", "checkpoint": "NVFP4", "path": folders["NVFP4"],
         "step_bytes": steps["NVFP4"]},
    ]  # fmt: skip
    return [{**entry, "bytes": checkpoint_bytes(entry["path"])} for entry in entries]


def run(args) -> list[dict]:
    rows, entries = [], contenders(args)
    vocab = json.loads((entries[1]["path"] / "config.json").read_text())["vocab_size"]
    kv_tokens = max(PROMPT + args.tokens, CHAT_PROMPT + args.chat_tokens) * args.concurrent + 256
    print("| engine | checkpoint | threads | repeat | batch 1 tok/s | "
          f"{args.concurrent} concurrent tok/s | resident GB | ÷ (checkpoint + KV) | "
          "of stream |")  # fmt: skip
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    for threads in args.threads:
        for repeat in range(args.repeats):
            stream_rate = stream_bandwidth(threads) * 1e9
            for c in entries:
                env = {**(PEER_ENV if c["engine"] == "llama.cpp" else os.environ),
                       "OMP_NUM_THREADS": str(threads), "PYTHONUNBUFFERED": "1"}  # fmt: skip
                spec = (llama_spec(c["bin"], c["path"], threads, args.concurrent, kv_tokens)
                        if c["engine"] == "llama.cpp"
                        else dsaserve_spec(c["path"], threads, kv_tokens))  # fmt: skip
                row = {"engine": c["engine"], "checkpoint": c["checkpoint"], "threads": threads,
                       "repeat": repeat + 1, "stream_bytes_s": stream_rate,
                       "checkpoint_bytes": c["bytes"], "step_bytes": c["step_bytes"],
                       **try_measure(spec, args, env, vocab)}  # fmt: skip
                rows.append(row)
                print(row_line(row), flush=True)
    return rows


def row_line(row: dict) -> str:
    head = f"| {row['engine']} | {row['checkpoint']} | {row['threads']} | {row['repeat']} |"
    if "error" in row:
        return f"{head} {row['error']} | | | | |"
    share = (f"{100 * row['step_bytes'] * row['batch1_tok_s'] / row['stream_bytes_s']:.0f}%"
             if row["step_bytes"] else "–")  # fmt: skip
    held = (f"{row['resident_bytes'] / (row['checkpoint_bytes'] + row['kv_pool_bytes']):.2f}"
            if "kv_pool_bytes" in row else "–")  # fmt: skip
    return (f"{head} {row['batch1_tok_s']:.1f} | {row['concurrent_tok_s']:.1f} | "
            f"{row['resident_bytes'] / 1e9:.2f} | {held} | {share} |")  # fmt: skip


def summary(rows: list[dict]) -> list[str]:
    """Medians of each dsaserve row against each llama.cpp GGUF at the same thread count."""

    def median(engine: str, checkpoint: str, threads: int, key: str) -> float | None:
        values = [r[key] for r in rows if (r["engine"], r["checkpoint"], r["threads"]) ==
                  (engine, checkpoint, threads) and key in r]  # fmt: skip
        return statistics.median(values) if values else None

    lines = ["| dsaserve checkpoint | threads | vs llama.cpp | batch 1 ratio | concurrent ratio |",
             "|---|---:|---|---:|---:|"]  # fmt: skip
    for threads in sorted({r["threads"] for r in rows}):
        for ours in ("bf16", "block-FP8", "NVFP4"):
            for peer in ("bf16 GGUF", "Q8_0 GGUF"):
                cells = []
                for key in ("batch1_tok_s", "concurrent_tok_s"):
                    a = median("dsaserve", ours, threads, key)
                    b = median("llama.cpp", peer, threads, key)
                    cells.append(f"{a / b:.2f}×" if a and b else "–")
                lines.append(f"| {ours} | {threads} | {peer} | {cells[0]} | {cells[1]} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    model_arguments(parser, "cpu_scale.json")
    parser.set_defaults(layers=12)
    parser.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--tokens", type=int, default=64, help="batch-1 tokens per request")
    parser.add_argument("--concurrent", type=int, default=8)
    parser.add_argument("--chat-tokens", type=int, default=64, help="tokens per concurrent request")
    parser.add_argument("--llamacpp-cache", default="~/.cache/dsaserve/llamacpp")
    parser.add_argument("--jobs", type=int, default=2, help="parallel compile jobs for llama.cpp")
    args = parser.parse_args()
    rows = run(args)
    print("\n".join(["", *summary(rows)]))
    load = os.getloadavg()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps({"when": datetime.now(UTC).isoformat(timespec="seconds"),
                                     "load_average": load, "args": vars(args), "rows": rows},
                                    indent=1, default=str))  # fmt: skip
    print(f"load average {load[0]:.1f}; JSON: {args.json}")


if __name__ == "__main__":
    sys.exit(main())

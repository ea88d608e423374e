"""`dsaserve bench`: a serving benchmark against any OpenAI-compatible or SGLang endpoint.

Modelled on `python -m sglang.bench_serving`: it sends a random or shared-prefix workload at a
Poisson request rate under a concurrency cap, streams every response, and reports throughput,
TTFT, ITL, TPOT and end-to-end latency (mean, p50, p99), the cached-token ratio and the server's
speculative accept length, as a table and as one JSON line appended to `--output-file`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from datetime import UTC, datetime
from typing import Any

import httpx

from dsaserve.bench import server_probe
from dsaserve.bench.backends import BACKENDS, RequestOptions
from dsaserve.bench.client import RequestResult
from dsaserve.bench.datasets import (
    BenchRequest,
    TokenCounter,
    load_tokenizer,
    random_requests,
    shared_prefix_requests,
)
from dsaserve.bench.metrics import format_table, summarize
from dsaserve.bench.runner import Runner


def build_parser() -> argparse.ArgumentParser:
    """The `dsaserve bench` flags (names follow sglang.bench_serving where it has them)."""
    p = argparse.ArgumentParser(prog="dsaserve bench", description=__doc__.splitlines()[0])
    p.add_argument("--base-url", help="server URL; default http://HOST:PORT")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--backend", choices=sorted(BACKENDS), default="openai-chat")
    p.add_argument("--model", help="model name to send; default: the first of GET /v1/models")
    p.add_argument("--tokenizer", help="local tokenizer folder; default: the server's model_path")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY"))
    p.add_argument("--dataset", choices=["random", "shared-prefix"], default="random")
    p.add_argument("--num-prompts", type=int, default=100)
    p.add_argument("--random-input-len", type=int, default=1024)
    p.add_argument("--random-output-len", type=int, default=128)
    p.add_argument("--random-range-ratio", type=float, default=0.0)
    p.add_argument("--num-prefixes", type=int, default=4, help="shared-prefix: distinct prefixes")
    p.add_argument("--prefix-len", type=int, default=1024, help="shared-prefix: prefix tokens")
    p.add_argument("--suffix-len", type=int, default=64, help="shared-prefix: suffix tokens")
    p.add_argument("--request-rate", type=float, default=math.inf, help="req/s (Poisson); inf")
    p.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per request, in total")
    p.add_argument("--warmup-requests", type=int, default=1)
    p.add_argument("--disable-ignore-eos", action="store_true", help="do not send ignore_eos")
    p.add_argument("--extra-request-body", type=json.loads, default={}, help="JSON merged in")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--output-file", help="append the result as one JSON line")
    p.add_argument("--output-details", action="store_true", help="per-request data in the JSON")
    p.add_argument("--disable-progress", action="store_true")
    return p


def _validate(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    positive = ["num_prompts", "random_input_len", "random_output_len", "timeout"]
    if args.dataset == "shared-prefix":
        positive += ["num_prefixes", "prefix_len", "suffix_len"]
    for name in positive:
        if getattr(args, name) <= 0:
            parser.error(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.max_concurrency is not None and args.max_concurrency <= 0:
        parser.error(f"--max-concurrency must be > 0, got {args.max_concurrency}")
    if not args.request_rate > 0:
        parser.error(f"--request-rate must be > 0 (or inf), got {args.request_rate}")
    if not 0.0 <= args.random_range_ratio <= 1.0:
        parser.error(f"--random-range-ratio must be in [0, 1], got {args.random_range_ratio}")
    if not isinstance(args.extra_request_body, dict):
        parser.error("--extra-request-body must be a JSON object")


def _token_counter(args: argparse.Namespace, info: dict[str, Any] | None) -> TokenCounter:
    if args.tokenizer:
        return TokenCounter(load_tokenizer(args.tokenizer), args.tokenizer)
    path = server_probe.model_path(info)
    if path and os.path.isdir(path):
        try:
            return TokenCounter(load_tokenizer(path), path)
        except ValueError as exc:
            print(f"warning: {exc}; estimating tokens as chars/4", file=sys.stderr)
    return TokenCounter()


def _workload(args: argparse.Namespace, counter: TokenCounter) -> list[BenchRequest]:
    output = (args.random_output_len, args.random_range_ratio, counter, args.seed)
    if args.dataset == "shared-prefix":
        sizes = (args.num_prefixes, args.prefix_len, args.suffix_len)
        return shared_prefix_requests(args.num_prompts, *sizes, *output)
    return random_requests(args.num_prompts, args.random_input_len, *output)


def _hint(result: RequestResult) -> str:
    if "ignore_eos" in result.error:  # e.g. transformers serve answers 422 to unknown fields
        return "\nhint: this server rejects ignore_eos; rerun with --disable-ignore-eos"
    return ""


def _details(results: list[RequestResult]) -> list[dict[str, Any]]:
    fields = ("success", "error", "prompt_len", "output_len", "cached_tokens", "ttft", "latency")
    return [{name: getattr(r, name) for name in fields} | {"itl": r.itl} for r in results]


class BenchError(Exception):
    """The run cannot start: no model name, or the warmup request failed."""


async def _bench(args: argparse.Namespace, base_url: str) -> dict[str, Any]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        info = await server_probe.server_info(client, base_url)
        model = args.model or await server_probe.served_model(client, base_url)
        if model is None and args.backend != "generate":
            raise BenchError(f"no model from {base_url}/v1/models; pass --model")
        counter = _token_counter(args, info)
        requests = _workload(args, counter)
        options = RequestOptions(model, not args.disable_ignore_eos, args.extra_request_body)
        backend = BACKENDS[args.backend]()
        runner = Runner(client, base_url, backend, options, counter, args.timeout)
        for _ in range(args.warmup_requests):
            warm = await runner.warmup(requests[0])
            if not warm.success:
                raise BenchError(f"warmup request failed: {warm.error}{_hint(warm)}")
        results, duration = await runner.run(
            requests, args.request_rate, args.max_concurrency, args.seed, not args.disable_progress
        )
        accept = server_probe.accept_length(await server_probe.server_info(client, base_url))
    record = _record(args, model, counter, summarize(results, duration, accept), results)
    return record | {"server_threads": server_probe.server_threads(info)}


def _public_args(args: argparse.Namespace) -> dict[str, Any]:
    values = vars(args) | {"api_key": "***" if args.api_key else None}
    return {name: _json_number(value) for name, value in values.items()}


def _json_number(value: Any) -> Any:
    """`inf` as the string "inf": strict JSON has no infinity."""
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value


def _record(
    args: argparse.Namespace,
    model: str | None,
    counter: TokenCounter,
    report: dict[str, Any],
    results: list[RequestResult],
) -> dict[str, Any]:
    record = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "backend": args.backend,
        "model": model,
        "dataset_name": args.dataset,
        "request_rate": _json_number(args.request_rate),
        "max_concurrency": args.max_concurrency,
        "tokenizer": counter.source or "chars/4 estimate",
        **report,
        "args": _public_args(args),
    }
    if args.output_details:
        record["requests"] = _details(results)
    return record


def run(argv: list[str]) -> dict[str, Any]:
    """Run one benchmark from `dsaserve bench` flags and return its JSON record (no printing).

    Raises SystemExit on bad flags, ValueError on a tokenizer that cannot be loaded, and
    BenchError when the run cannot start. Scripts such as bench/side_by_side.py use this.
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    _validate(parser, args)
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    return asyncio.run(_bench(args, base_url))


def _table(record: dict[str, Any]) -> str:
    header = {
        "Backend": record["backend"],
        "Model": record["model"],
        "Dataset": record["dataset_name"],
        "Traffic request rate": record["request_rate"],
        "Max request concurrency": record["max_concurrency"],
        "Tokenizer": record["tokenizer"],
        "Server CPU threads": record.get("server_threads") or "not reported",
    }
    return format_table(record, header)


def main(argv: list[str] | None = None) -> int:
    """Entry point of `dsaserve bench`: print the table, append JSON; return the exit code."""
    argv = sys.argv[1:] if argv is None else argv
    try:
        record = run(argv)
    except ValueError as exc:  # a tokenizer that cannot be loaded
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except BenchError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(_table(record))
    output_file = record["args"]["output_file"]
    if output_file:
        with open(output_file, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())

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
import random
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import httpx
from tqdm import tqdm

from dsaserve.bench import server_probe
from dsaserve.bench.backends import BACKENDS, Backend, RequestOptions
from dsaserve.bench.client import RequestResult, send_request
from dsaserve.bench.datasets import (
    BenchRequest,
    TokenCounter,
    load_tokenizer,
    random_requests,
    shared_prefix_requests,
)
from dsaserve.bench.metrics import format_table, summarize

WARMUP_OUTPUT_LEN = 16


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


async def _arrivals(requests: list[BenchRequest], rate: float, seed: int):
    """Yield requests at Poisson arrival times (all at once when rate is inf)."""
    rng = random.Random(seed)
    for index, request in enumerate(requests):
        if index and math.isfinite(rate):
            await asyncio.sleep(rng.expovariate(rate))
        yield request


@dataclass
class _Runner:
    """One benchmark run's shared state: the client, the backend and request settings."""

    client: httpx.AsyncClient
    args: argparse.Namespace
    base_url: str
    backend: Backend
    options: RequestOptions
    counter: TokenCounter

    async def send(self, request: BenchRequest) -> RequestResult:
        return await send_request(
            self.client,
            self.base_url,
            self.backend,
            request,
            self.options,
            self.args.timeout,
            self.counter,
        )

    async def warmup(self, request: BenchRequest) -> RequestResult:
        short = BenchRequest(request.prompt, request.prompt_len, WARMUP_OUTPUT_LEN)
        return await self.send(short)

    async def run(self, requests: list[BenchRequest]) -> tuple[list[RequestResult], float]:
        limit = self.args.max_concurrency
        semaphore = asyncio.Semaphore(limit) if limit else None
        bar = tqdm(total=len(requests), disable=self.args.disable_progress, file=sys.stderr)

        async def one(request: BenchRequest) -> RequestResult:
            if semaphore is None:
                result = await self.send(request)
            else:
                async with semaphore:
                    result = await self.send(request)
            bar.update(1)
            return result

        start = time.perf_counter()
        tasks = []
        async for request in _arrivals(requests, self.args.request_rate, self.args.seed):
            tasks.append(asyncio.create_task(one(request)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
        return list(results), duration


def _hint(result: RequestResult) -> str:
    if "ignore_eos" in result.error:  # e.g. transformers serve answers 422 to unknown fields
        return "\nhint: this server rejects ignore_eos; rerun with --disable-ignore-eos"
    return ""


def _details(results: list[RequestResult]) -> list[dict[str, Any]]:
    fields = ("success", "error", "prompt_len", "output_len", "cached_tokens", "ttft", "latency")
    return [{name: getattr(r, name) for name in fields} | {"itl": r.itl} for r in results]


async def _bench(args: argparse.Namespace, base_url: str) -> int:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(args.timeout)
    async with httpx.AsyncClient(headers=headers, limits=limits, timeout=timeout) as client:
        info = await server_probe.server_info(client, base_url)
        model = args.model or await server_probe.served_model(client, base_url)
        if model is None and args.backend != "generate":
            print(f"error: no model from {base_url}/v1/models; pass --model", file=sys.stderr)
            return 1
        counter = _token_counter(args, info)
        requests = _workload(args, counter)
        options = RequestOptions(model, not args.disable_ignore_eos, args.extra_request_body)
        backend = BACKENDS[args.backend]()
        runner = _Runner(client, args, base_url, backend, options, counter)
        for _ in range(args.warmup_requests):
            warm = await runner.warmup(requests[0])
            if not warm.success:
                print(f"error: warmup request failed: {warm.error}{_hint(warm)}", file=sys.stderr)
                return 1
        results, duration = await runner.run(requests)
        accept = server_probe.accept_length(await server_probe.server_info(client, base_url))
    report = summarize(results, duration, accept)
    header = {
        "Backend": args.backend,
        "Model": model,
        "Dataset": args.dataset,
        "Traffic request rate": args.request_rate,
        "Max request concurrency": args.max_concurrency,
        "Tokenizer": counter.source or "chars/4 estimate",
    }
    print(format_table(report, header))
    if args.output_file:
        _write_json(args, report, header, results)
    return 0


def _public_args(args: argparse.Namespace) -> dict[str, Any]:
    values = vars(args) | {"api_key": "***" if args.api_key else None}
    return {name: _json_number(value) for name, value in values.items()}


def _json_number(value: Any) -> Any:
    """`inf` as the string "inf": strict JSON has no infinity."""
    return str(value) if isinstance(value, float) and not math.isfinite(value) else value


def _write_json(
    args: argparse.Namespace,
    report: dict[str, Any],
    header: dict[str, Any],
    results: list[RequestResult],
) -> None:
    record = {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "backend": args.backend,
        "model": header["Model"],
        "dataset_name": args.dataset,
        "request_rate": _json_number(args.request_rate),
        "max_concurrency": args.max_concurrency,
        "tokenizer": header["Tokenizer"],
        **report,
        "args": _public_args(args),
    }
    if args.output_details:
        record["requests"] = _details(results)
    with open(args.output_file, "a", encoding="utf-8") as f:
        f.write(json.dumps(record) + "\n")


def main(argv: list[str] | None = None) -> int:
    """Entry point of `dsaserve bench`; returns the process exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _validate(parser, args)
    base_url = (args.base_url or f"http://{args.host}:{args.port}").rstrip("/")
    try:
        return asyncio.run(_bench(args, base_url))
    except ValueError as exc:  # a tokenizer that cannot be loaded
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())

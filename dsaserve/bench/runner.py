"""Drive a workload: Poisson arrivals, a concurrency cap, a progress bar, one result per request."""

from __future__ import annotations

import asyncio
import math
import random
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
from tqdm import tqdm

from dsaserve.bench.backends import Backend, RequestOptions
from dsaserve.bench.client import RequestResult, send_request
from dsaserve.bench.datasets import BenchRequest, TokenCounter

WARMUP_OUTPUT_LEN = 16


async def poisson_arrivals(
    requests: list[BenchRequest], rate: float, seed: int
) -> AsyncIterator[BenchRequest]:
    """Yield requests at Poisson arrival times (all at once when rate is inf)."""
    rng = random.Random(seed)
    for index, request in enumerate(requests):
        if index and math.isfinite(rate):
            await asyncio.sleep(rng.expovariate(rate))
        yield request


@dataclass
class Runner:
    """One run's shared state: the HTTP client, the backend, and the request settings."""

    client: httpx.AsyncClient
    base_url: str
    backend: Backend
    options: RequestOptions
    counter: TokenCounter
    timeout: float

    async def send(self, request: BenchRequest) -> RequestResult:
        return await send_request(
            self.client, self.base_url, self.backend, request, self.options, self.timeout,
            self.counter,
        )  # fmt: skip

    async def warmup(self, request: BenchRequest) -> RequestResult:
        """A short version of `request`, not measured."""
        return await self.send(BenchRequest(request.prompt, request.prompt_len, WARMUP_OUTPUT_LEN))

    async def run(
        self,
        requests: list[BenchRequest],
        request_rate: float,
        max_concurrency: int | None,
        seed: int,
        progress: bool = True,
    ) -> tuple[list[RequestResult], float]:
        """Send every request; return the results in workload order and the wall time."""
        semaphore = asyncio.Semaphore(max_concurrency) if max_concurrency else None
        bar = tqdm(total=len(requests), disable=not progress, file=sys.stderr)

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
        async for request in poisson_arrivals(requests, request_rate, seed):
            tasks.append(asyncio.create_task(one(request)))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
        return list(results), duration

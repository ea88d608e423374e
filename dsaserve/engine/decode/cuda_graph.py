"""CUDA-graph decode: the static decode forward captured once per (rows, context) bucket, replayed.

`--cuda-graph-max-bs N` (default: the running-request limit, at most 256) sets the largest batch;
the batch buckets are SGLang's capture sizes (1, 2, 4, 8, then every 8 up to 256, every 16 up to
512, every 32 beyond) up to N. A bucket counts decode *rows*: a speculative verify of R requests
with K drafts is R * (K + 1) rows, each over its own prefix, so those row counts are buckets too.
The slot table is padded to a context bucket (powers of two from 64 up to the pool's size). A
step whose rows and context fit a bucket copies its inputs into the static buffers and replays
that bucket's graph (captured the first time it is needed, all graphs sharing one memory pool);
anything else (prefill, mixed batches, larger batches) runs eagerly as before.
`--disable-cuda-graph` turns it off. Only CUDA builds it; CPU keeps the fused / layered paths
(the tests run this runner on CPU with `capture=False`: the same padded static step, eagerly).

Padding never touches real KV: padded rows decode token 0 at position 0 with one valid context
entry, a scratch slot, and write their KV there. The scratch slot is the first slot of a page
taken from the pool at start and never given back (the pool has one page fewer).
"""

from __future__ import annotations

import bisect
import logging
import time
from typing import NamedTuple

import torch
from torch import nn

from dsaserve.engine.decode.static import StaticDecode
from dsaserve.engine.kvcache.pool import KVPool
from dsaserve.kernels.registry import Kernels
from dsaserve.layers.forward_batch import ForwardBatch, installed

logger = logging.getLogger(__name__)

# device types the engine builds the runner for: a seam a test widens to ("cuda", "cpu"), where
# the runner runs the padded static step eagerly (tests/cpu_graphs/ does it in every process)
GRAPH_DEVICES = ("cuda",)
MAX_DEFAULT_BS = 256
FIRST_CONTEXT = 64
MAX_TABLE_ENTRIES = 1 << 24  # rows x context of the largest slot table kept static (144 MB)


def batch_buckets(max_bs: int) -> list[int]:
    """SGLang's decode capture sizes up to max_bs (max_bs itself always included)."""
    sizes = [1, 2, 4, 8, *range(16, 257, 8), *range(272, 513, 16), *range(544, max_bs + 1, 32)]
    out = [s for s in sizes if s <= max_bs]
    return out if out and out[-1] == max_bs else [*out, max_bs]


def row_buckets(max_bs: int, spec_steps: int = 0) -> list[int]:
    """Row counts captured: every batch bucket, and with K drafts each bucket times K + 1."""
    sizes = batch_buckets(max_bs)
    return sorted({*sizes, *(s * (spec_steps + 1) for s in sizes)})


def context_buckets(max_context: int, first: int = FIRST_CONTEXT) -> list[int]:
    """Slot-table widths: powers of two from `first`, the last one clipped to max_context."""
    sizes, width = [], first
    while width < max_context:
        sizes.append(width)
        width *= 2
    return [*sizes, max_context]


class Bucket(NamedTuple):
    rows: int
    context: int


def _pick(sizes: list[int], need: int) -> int | None:
    at = bisect.bisect_left(sizes, need)
    return sizes[at] if at < len(sizes) else None


class StaticInputs:
    """The buffers every graph reads: ids, positions, out slots, and one flat slot table and mask
    that each bucket views as [rows, context] (contiguous, so kernels need no copies)."""

    def __init__(self, rows: int, entries: int, scratch: int, device: torch.device) -> None:
        long = dict(dtype=torch.long, device=device)
        self.scratch = scratch
        self.input_ids = torch.zeros(rows, **long)
        self.positions = torch.zeros(rows, **long)
        self.out_slots = torch.full((rows,), scratch, **long)
        self.row_ids = torch.arange(rows, **long)
        self.slots = torch.full((entries,), scratch, **long)
        self.valid = torch.zeros(entries, dtype=torch.bool, device=device)

    def table(self, bucket: Bucket) -> tuple[torch.Tensor, torch.Tensor]:
        size = bucket.rows * bucket.context
        shape = (bucket.rows, bucket.context)
        return self.slots[:size].view(shape), self.valid[:size].view(shape)

    def batch(self, bucket: Bucket, pool: KVPool, kernels: Kernels) -> ForwardBatch:
        """The ForwardBatch of `bucket`: views of the buffers, the pool's caches."""
        rows = bucket.rows
        slots, valid = self.table(bucket)
        return ForwardBatch(
            input_ids=self.input_ids[:rows], positions=self.positions[:rows],
            out_slots=self.out_slots[:rows], extends=[], decode_rows=self.row_ids[:rows],
            decode_slots=slots, decode_valid=valid, logits_rows=self.row_ids[:rows],
            kv_cache=pool.kv_cache, index_cache=pool.index_cache, kernels=kernels,
        )  # fmt: skip

    def load(self, bucket: Bucket, batch: ForwardBatch | None) -> None:
        """Copy `batch`'s decode rows in, padding the rest (None: padding only)."""
        rows, width = (0, 0) if batch is None else tuple(batch.decode_slots.shape)
        slots, valid = self.table(bucket)
        slots.fill_(self.scratch)
        valid.zero_()
        valid[rows:, 0] = True  # a padded row attends its own scratch entry: no empty softmax
        self.input_ids[rows : bucket.rows].zero_()
        self.positions[rows : bucket.rows].zero_()
        self.out_slots[rows : bucket.rows].fill_(self.scratch)
        if batch is None:
            return
        self.input_ids[:rows].copy_(batch.input_ids)
        self.positions[:rows].copy_(batch.positions)
        self.out_slots[:rows].copy_(batch.out_slots)
        slots[:rows, :width].copy_(batch.decode_slots)
        valid[:rows, :width].copy_(batch.decode_valid)


class CudaGraphRunner:
    """Decode steps through per-bucket CUDA graphs of `StaticDecode` (eager with capture=False)."""

    def __init__(self, model: nn.Module, pool: KVPool, kernels: Kernels, rows: list[int],
                 max_context: int, scratch: int, capture: bool,
                 taps: tuple[int, ...] = ()) -> None:  # fmt: skip
        self.forward = StaticDecode(model, taps).forward  # taps: a DFlash drafter's layers
        self.taps = taps
        self.pool, self.kernels, self.capture = pool, kernels, capture
        self.rows = rows
        self.contexts = context_buckets(max_context)
        device = pool.kv_cache.device
        entries = min(rows[-1] * self.contexts[-1], MAX_TABLE_ENTRIES)
        self.inputs = StaticInputs(rows[-1], entries, scratch, device)
        self.graphs: dict[Bucket, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.mempool = torch.cuda.graph_pool_handle() if capture else None
        self.steps = 0

    @classmethod
    def build(cls, model: nn.Module, pool: KVPool, kernels: Kernels, max_bs: int | None,
              running: int, spec_steps: int, disabled: bool,
              taps: tuple[int, ...] = ()) -> CudaGraphRunner | None:  # fmt: skip
        """The runner for this rank, or None: disabled, not CUDA, or a model / pool the static
        forward does not cover (expert parallel, a layer-split cache). With ranks every rank
        builds its own over its shard and its pool, whose first page (a fresh pool's, the same
        on every rank) holds the scratch slot."""
        device = pool.index_cache.device
        if disabled or device.type not in GRAPH_DEVICES:
            return None
        if not isinstance(pool.kv_cache, torch.Tensor) or not StaticDecode.supports(model):
            logger.info("CUDA graphs: not for this model layout (expert parallel or split KV)")
            return None
        page = pool.pages.alloc(1)  # the padded rows' scratch slot lives on this page
        if page is None:
            return None
        rows = row_buckets(max_bs or min(running, MAX_DEFAULT_BS), spec_steps)
        scratch = page[0] * pool.page_size
        return cls(
            model, pool, kernels, rows, pool.num_tokens, scratch, device.type == "cuda", taps
        )

    def bucket(self, batch: ForwardBatch) -> Bucket | None:
        """The bucket an all-decode batch replays in, or None (run it eagerly)."""
        rows = batch.input_ids.shape[0]
        if batch.extends or rows == 0 or batch.decode_rows.shape[0] != rows:
            return None
        picked = _pick(self.rows, rows), _pick(self.contexts, batch.decode_slots.shape[1])
        if None in picked or picked[0] * picked[1] > self.inputs.slots.shape[0]:
            return None
        return Bucket(*picked)

    def accepts(self, batch: ForwardBatch) -> bool:
        return self.bucket(batch) is not None

    def common_bucket(self, rows: int, context: int) -> Bucket | None:
        """The bucket every attention group replays together under DP attention: rows for the
        largest group's, the widest group's context bucket (None: it does not fit)."""
        picked = _pick(self.rows, rows)
        if picked is None or picked * context > self.inputs.slots.shape[0]:
            return None
        return Bucket(picked, context)

    def stats(self) -> dict:
        """For /get_server_info: the largest bucket, graphs captured, steps run through them."""
        return {"max_rows": self.rows[-1], "max_context": self.contexts[-1],
                "captured": len(self.graphs), "steps": self.steps}  # fmt: skip

    def __call__(self, batch: ForwardBatch, bucket: Bucket | None = None) -> torch.Tensor:
        """Hidden states [T, H] of the batch's rows (a copy: the graph's output is reused);
        with taps, [T, H * (1 + len(taps))] as `StaticDecode.forward`. `bucket`: the one the
        rank rounds agreed on (DP attention; a group with no rows replays padding only)."""
        bucket = bucket or self.bucket(batch)
        if bucket is None:
            raise ValueError("this batch fits no CUDA-graph bucket; check accepts() first")
        rows = batch.input_ids.shape[0]
        self.steps += 1
        if not self.capture:
            self.inputs.load(bucket, batch)
            return self._run(bucket)[:rows].clone()
        if bucket not in self.graphs:
            self.graphs[bucket] = self._capture(bucket)
        graph, out = self.graphs[bucket]
        self.inputs.load(bucket, batch)
        graph.replay()
        return out[:rows].clone()

    def _run(self, bucket: Bucket) -> torch.Tensor:
        with installed(self.inputs.batch(bucket, self.pool, self.kernels)):
            return self.forward()

    def _capture(self, bucket: Bucket) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Warm up (Triton compiles) on a side stream, then capture, over padding only."""
        start = time.perf_counter()
        self.inputs.load(bucket, None)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                self._run(bucket)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        # thread_local: another thread's CUDA work (HiCache copies) must not void the capture
        with torch.cuda.graph(graph, pool=self.mempool, capture_error_mode="thread_local"):
            out = self._run(bucket)
        logger.info("captured the decode graph for %d rows x %d context in %.2f s",
                    bucket.rows, bucket.context, time.perf_counter() - start)  # fmt: skip
        return graph, out

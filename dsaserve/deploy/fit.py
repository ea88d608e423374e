"""The memory-fit report of a layout: weights and KV per GPU, tokens that fit, concurrency."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from dsaserve.deploy.layout import Layout
from dsaserve.deploy.memory import (
    ParamCounts,
    kv_bytes_per_token,
    layer_split_kv_bytes_per_token,
    main_params,
    mtp_params,
    weight_bytes,
    weight_bytes_per_gpu,
)


@dataclass(frozen=True)
class MemoryReport:
    """Per-GPU memory of one layout; token counts are per KV pool (one per DP-attention rank)."""

    precision: str
    params_main: int
    params_mtp: int  # loaded MTP parameters (0 without MTP drafting)
    weight_bytes_total: int
    weight_bytes_per_gpu: int
    device_bytes: int
    mem_fraction_static: float
    budget_bytes_per_gpu: int
    kv_dtype: str
    kv_bytes_per_token: int  # the main model's layers
    kv_bytes_per_token_served: int  # plus the MTP layer's entries when drafting
    kv_pool_bytes_per_gpu: int
    tokens_per_rank: int
    kv_ranks: int
    tokens_per_request: int
    hicache_host_bytes_per_gpu: int
    cp_size: int = 1  # --attn-cp-size when context parallelism is planned
    # one CP rank's KV bytes per token with --enable-dsa-cache-layer-split (0: no CP planned)
    kv_bytes_per_token_layer_split: int = 0

    @property
    def total_tokens(self) -> int:
        return self.tokens_per_rank * self.kv_ranks

    @property
    def concurrency(self) -> int:
        """Requests of `tokens_per_request` tokens whose KV fits at once (a request stays on one
        rank, so each rank's pool is divided separately)."""
        return self.kv_ranks * (self.tokens_per_rank // self.tokens_per_request)

    @property
    def weights_fit(self) -> bool:
        return self.weight_bytes_per_gpu <= self.budget_bytes_per_gpu

    def to_json(self) -> dict[str, Any]:
        return {**asdict(self), "total_tokens": self.total_tokens, "concurrency": self.concurrency}


def memory_report(layout: Layout) -> MemoryReport:
    """Compute the memory-fit report of `layout` from the model's config and its precision."""
    m, precision = layout.model, layout.model.precision
    with_mtp = layout.with_mtp
    counts = main_params(m) + (mtp_params(m) if with_mtp else ParamCounts())
    per_gpu = weight_bytes_per_gpu(m, precision, layout.tp, layout.attn_tp, with_mtp)
    device = layout.hardware.memory_bytes
    budget = int(device * layout.mem_fraction)
    pool = max(budget - per_gpu, 0)
    kv_served = kv_bytes_per_token(m, layout.kv_dtype, with_mtp)
    hicache_ratio = float(layout.flags.get("--hicache-ratio") or 0.0)
    planned_cp = "--enable-prefill-cp" in layout.flags
    cp = int(layout.flags.get("--attn-cp-size") or 1) if planned_cp else 1
    split = layer_split_kv_bytes_per_token(m, layout.kv_dtype, cp, with_mtp) if cp > 1 else 0
    return MemoryReport(
        precision=precision,
        params_main=main_params(m).total(),
        params_mtp=mtp_params(m).total() if with_mtp else 0,
        weight_bytes_total=weight_bytes(counts, precision).total(),
        weight_bytes_per_gpu=per_gpu,
        device_bytes=device,
        mem_fraction_static=layout.mem_fraction,
        budget_bytes_per_gpu=budget,
        kv_dtype=layout.kv_dtype,
        kv_bytes_per_token=kv_bytes_per_token(m, layout.kv_dtype),
        kv_bytes_per_token_served=kv_served,
        kv_pool_bytes_per_gpu=pool,
        tokens_per_rank=pool // kv_served,
        kv_ranks=layout.kv_ranks,
        tokens_per_request=layout.request.input_len + layout.request.output_len,
        hicache_host_bytes_per_gpu=int(pool * hicache_ratio),
        cp_size=cp,
        kv_bytes_per_token_layer_split=split,
    )

"""The engine's start-up choices: device and dtype, this rank's model, the KV pool's size and
layout hooks, the checkpoint's generation defaults. Shared by `Engine` and the follower ranks."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from dsaserve.args import ArgsError, ServerArgs
from dsaserve.distributed.parallel_state import ParallelState
from dsaserve.engine.kv_pool import KVPool
from dsaserve.model_config import ModelConfig
from dsaserve.models.dsa_moe import DsaMoeForCausalLM, index_cache_ids
from dsaserve.models.loader import load_checkpoint

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}  # fmt: skip
CPU_MAX_TOTAL_TOKENS = 1 << 18


def load_model(args: ServerArgs, config: ModelConfig, dtype: torch.dtype, device: torch.device,
               with_mtp: bool, parallel: ParallelState, show_progress: bool = True,
               before_load: Callable[[nn.Module], object] | None = None,
               ) -> DsaMoeForCausalLM:  # fmt: skip
    """This rank's model (all of it in a single process), loaded and on `device`;
    `before_load` may swap modules first (FP8 Linears kept FP8)."""
    with torch.device("meta"):
        model = DsaMoeForCausalLM(config, with_mtp=with_mtp, parallel=parallel)
    if before_load is not None:
        before_load(model)
    load_checkpoint(model, args.model_path, dtype, show_progress=show_progress)
    model.to(device).eval().requires_grad_(False)
    model.rotary.inv_freq = model.rotary.inv_freq.to(device)
    return model


def pool_bytes_per_token(config: ModelConfig, with_mtp: bool, stored: torch.dtype) -> int:
    """KV bytes a token takes; `stored` is the pool's dtype (uint8: the FP8 layout)."""
    return KVPool.bytes_per_token(config, len(index_cache_ids(config, with_mtp)), with_mtp,
                                  stored.itemsize, stored == torch.uint8)  # fmt: skip


def layer_split(args: ServerArgs, parallel: ParallelState):
    """The KV pool's LayerSplit hook (None unless --enable-dsa-cache-layer-split)."""
    if not args.enable_dsa_cache_layer_split:
        return None
    from functools import partial

    from dsaserve.distributed.layer_split import split_kv_cache

    return partial(split_kv_cache, args, parallel)


def pool_pages(args: ServerArgs, config: ModelConfig, with_mtp: bool, stored: torch.dtype,
               device: torch.device, parallel: ParallelState,
               extra_per_token: int = 0) -> int:  # fmt: skip
    """KV pages; every rank computes it and the smallest wins, so all pools have one layout.
    `extra_per_token`: bytes a token also takes beside the pool (a DFlash drafter's context)."""
    per_token = pool_bytes_per_token(config, with_mtp, stored) + extra_per_token
    tokens = args.max_total_tokens or tokens_from_memory(args, per_token, device)
    pages = max(tokens // (args.page_size or 64), 2)
    if parallel.world > 1:
        agreed = torch.tensor([pages])
        torch.distributed.all_reduce(agreed, torch.distributed.ReduceOp.MIN,
                                     group=parallel.cpu_group)  # fmt: skip
        pages = int(agreed)
    return pages


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ArgsError("--device cuda: no CUDA device is available")
    return torch.device(name)


def pick_dtype(name: str, config: ModelConfig, device: torch.device) -> torch.dtype:
    if name == "auto":
        name = config.torch_dtype if config.quantization is None else "bfloat16"
    dtype = DTYPES.get(name.replace("torch.", ""), torch.bfloat16)
    if device.type == "cpu" and dtype == torch.float16:
        return torch.bfloat16  # CPU kernels: fp32 or bf16
    return dtype


def tokens_from_memory(args: ServerArgs, per_token: int, device: torch.device) -> int:
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free * (args.mem_fraction_static or 0.85) // per_token)
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return min(int(total * (args.mem_fraction_static or 0.05) // per_token), CPU_MAX_TOTAL_TOKENS)


def generation_defaults(path: Path) -> dict:
    file = path / "generation_config.json"
    if not file.is_file():
        return {}
    raw = json.loads(file.read_text())
    eos = raw.get("eos_token_id", [])
    raw["eos_token_id"] = eos if isinstance(eos, list) else [eos]
    keep = ("temperature", "top_p", "top_k", "eos_token_id")
    return {k: raw[k] for k in keep if raw.get(k) is not None}

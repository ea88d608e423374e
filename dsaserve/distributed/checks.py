"""Refuse a parallel layout that cannot work before any process starts: one line, naming the
flag. The tp / ep / DP-attention / nodes layout against the model's shapes (`check_parallel`), and
the context-parallel and LayerSplit flags (`check_context_parallel`); runtime/preflight.py runs
them."""

from __future__ import annotations

import logging
from typing import Any

from dsaserve.args import ArgsError
from dsaserve.distributed.parallel_state import ParallelSizes
from dsaserve.model_config import ModelConfig

logger = logging.getLogger(__name__)


def check_parallel(args: Any, config: ModelConfig, device_type: str) -> None:
    sizes = ParallelSizes.from_args(args)
    _check_flags(args, sizes)
    _check_model(sizes, config)
    if device_type == "cuda":
        import torch

        have = torch.cuda.device_count()
        need = sizes.ranks_per_node * sizes.replicas
        if have < need:
            flag = f"--tp {sizes.tp}" + (f" --dp {sizes.dp}" if sizes.replicas > 1 else "")
            raise ArgsError(f"{flag}: needs {need} CUDA devices on this node, found {have}")


def _check_flags(args: Any, sizes: ParallelSizes) -> None:
    if sizes.dp_attention and (sizes.dp > sizes.tp or sizes.tp % sizes.dp):
        raise ArgsError(f"--dp {sizes.dp} must divide --tp {sizes.tp}")
    if sizes.replicas > 1 and args.nnodes > 1:
        raise ArgsError(f"--dp {sizes.dp} replicas (without --enable-dp-attention) run on one "
                        "node in this build; use --nnodes 1")  # fmt: skip
    if sizes.replicas > 1 and args.disaggregation_mode != "null":
        raise ArgsError(f"--disaggregation-mode with --dp {sizes.dp} replicas: a PD role runs "
                        "one engine in this build; use --dp 1")  # fmt: skip
    if sizes.tp % sizes.ep:
        raise ArgsError(f"--ep {sizes.ep} must divide --tp {sizes.tp}")
    if sizes.tp % args.nnodes:
        raise ArgsError(f"--nnodes {args.nnodes} must divide --tp {sizes.tp}")
    if not 0 <= args.node_rank < args.nnodes:
        raise ArgsError(f"--node-rank {args.node_rank} must be in [0, --nnodes {args.nnodes})")
    if args.nnodes > 1 and not args.dist_init_addr:
        raise ArgsError("--nnodes > 1 needs --dist-init-addr HOST:PORT (node 0's address)")
    if args.enable_hierarchical_cache and sizes.cp > 1:
        raise ArgsError("--enable-hierarchical-cache with --enable-prefill-cp: the host tier "
                        "does not move context-parallel pools yet; drop one")  # fmt: skip
    if args.dist_init_addr and not _is_host_port(args.dist_init_addr):
        raise ArgsError(f"--dist-init-addr {args.dist_init_addr}: expected HOST:PORT")
    if args.dist_init_addr and args.node_rank > 0 and args.dist_init_addr.endswith(":0"):
        raise ArgsError(f"--dist-init-addr {args.dist_init_addr} --node-rank {args.node_rank}: "
                        "port 0 is node 0's (it picks a port and prints it); give the other "
                        "nodes that port")  # fmt: skip


def _is_host_port(text: str) -> bool:
    host, _, port = text.rpartition(":")
    return bool(host) and port.isdigit() and 0 <= int(port) < 65536  # 0: node 0 picks


def _check_model(sizes: ParallelSizes, config: ModelConfig) -> None:
    heads = config.num_attention_heads
    if heads % sizes.attn_tp:
        flag = f"--tp {sizes.tp}" + (f" --dp {sizes.dp}" if sizes.dp_attention else "")
        raise ArgsError(f"{flag}: attention TP {sizes.attn_tp} does not divide the model's "
                        f"{heads} attention heads")  # fmt: skip
    if config.n_routed_experts % sizes.ep:
        raise ArgsError(f"--ep {sizes.ep} does not divide the model's {config.n_routed_experts} "
                        "routed experts")  # fmt: skip
    if config.moe_intermediate_size % sizes.moe_tp:
        raise ArgsError(f"--tp {sizes.tp} --ep {sizes.ep}: {sizes.moe_tp} does not divide the "
                        f"expert size {config.moe_intermediate_size}")  # fmt: skip
    inter = [config.intermediate_size, config.moe_intermediate_size * config.n_shared_experts]
    for size in inter:
        if size and size % sizes.tp:
            raise ArgsError(f"--tp {sizes.tp} does not divide the MLP size {size}")


def moe_backend_note(args: Any, device_type: str) -> str | None:
    """--moe-a2a-backend deepep: what runs instead (printed at start). This build dispatches
    experts with torch.distributed everywhere; DeepEP kernels are not wired in yet."""
    if args.moe_a2a_backend != "deepep":
        return None
    fallback = "experts are dispatched with torch.distributed (all-reduce of partial outputs)"
    if device_type == "cuda":
        try:
            import deep_ep  # noqa: F401

            why = "deep_ep imports but its kernels are not used yet"
        except ImportError:
            why = "DeepEP is not available (deep_ep is not importable)"
    else:
        why = "DeepEP is not available on CPU"
    return f"--moe-a2a-backend deepep: {why}; {fallback}"


ZIGZAG_REFUSAL = ("--cp-strategy zigzag is temporarily unavailable for GLM-5.3 and DeepSeek-V3.2;"
                  " use --cp-strategy interleave with --dp 1")  # fmt: skip


def check_context_parallel(args: Any) -> None:
    """Refuse a CP layout this build cannot run, in one line naming the flag (CP on a decode
    worker and `interleave` with DP attention are refused when ServerArgs is built)."""
    n = args.attn_cp_size
    if n == 1 and not args.enable_prefill_cp:
        check_layer_split(args)
        return
    if not args.enable_prefill_cp:
        raise ArgsError(f"--attn-cp-size {n}: context parallelism here is for prefill; add "
                        "--enable-prefill-cp --cp-strategy interleave")  # fmt: skip
    if n == 1:
        raise ArgsError("--enable-prefill-cp needs --attn-cp-size > 1 (the CP ranks)")
    if args.cp_strategy == "zigzag":
        raise ArgsError(ZIGZAG_REFUSAL)
    if args.dp_size != 1:
        raise ArgsError(f"--cp-strategy interleave needs --dp 1 (got --dp {args.dp_size}; "
                        "SGLang requires dp_size == 1)")  # fmt: skip
    if str(args.kv_cache_dtype).startswith("fp8"):
        raise ArgsError("--enable-prefill-cp with --kv-cache-dtype fp8_e4m3: the CP all-gathers "
                        "move unquantised entries; use the default KV dtype")  # fmt: skip
    check_layer_split(args)
    if args.tp_size != n:
        raise ArgsError(
            f"--attn-cp-size {n} must equal --tp {args.tp_size}: the CP ranks are the TP ranks "
            "(attention TP inside a CP group is not supported yet)"
        )


def check_layer_split(args: Any) -> None:
    on_cp = args.enable_prefill_cp and args.attn_cp_size > 1
    if args.enable_dsa_cache_layer_split and not on_cp:
        raise ArgsError(
            "--enable-dsa-cache-layer-split splits the KV over the CP ranks: it needs "
            "--attn-cp-size N --enable-prefill-cp --cp-strategy interleave"
        )

"""Server arguments: one frozen dataclass, flag names as SGLang names them.

`ServerArgs.from_cli(argv)` parses and checks a command line; `add_server_args(parser)` is the one
place every flag is declared, so `dsaserve serve`, the offline `LLM` and the deploy planner agree.
Building a `ServerArgs` checks each value and the combinations of flags alone; what needs the
device or the checkpoint is checked once at start (runtime/preflight.py).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass, field
from typing import Any

from dsaserve.assets import default_model_path
from dsaserve.flags import SECTIONS, Flag
from dsaserve.kernels.registry import (
    ATTENTION_BACKENDS,
    DSA_BACKENDS,
    FP8_GEMM_BACKENDS,
    MOE_BACKENDS,
)

BACKEND_FLAGS = {"attention_backend": ATTENTION_BACKENDS, "dsa_prefill_backend": DSA_BACKENDS,
                 "dsa_decode_backend": DSA_BACKENDS, "moe_runner_backend": MOE_BACKENDS,
                 "fp8_gemm_backend": FP8_GEMM_BACKENDS}  # fmt: skip

API_KEY_ENV = "DSASERVE_API_KEY"
SECRET_ENVS = ("DSASERVE_CLUSTER_SECRET", "SGLANG_DISAGGREGATION_BOOTSTRAP_AUTH_TOKEN")


class ArgsError(ValueError):
    """A flag value or combination that cannot work; the message says what to change."""


@dataclass(frozen=True)
class ServerArgs:
    # model and tokenizer
    model_path: str = field(default_factory=lambda: str(default_model_path()))
    tokenizer_path: str | None = None
    revision: str | None = None  # of a Hub id (runtime/hub.py)
    download_dir: str | None = None
    model_id: str | None = None  # not a flag: the Hub id --model-path named, once resolved
    served_model_name: str | None = None
    dtype: str = "auto"
    context_length: int | None = None
    json_model_override_args: str | None = None
    trust_remote_code: bool = False
    device: str = "auto"
    random_seed: int = 0
    # HTTP
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = field(default=None, repr=False)  # secrets stay out of reprs and logs
    cluster_secret: str | None = field(default=None, repr=False)  # dsaserve/cluster/secret.py
    reasoning_parser: str | None = "auto"
    tool_call_parser: str | None = "auto"
    default_chat_template_kwargs: str | None = None
    enable_metrics: bool = False
    enable_cache_report: bool = True  # on by default; --disable-cache-report turns it off
    grammar_backend: str = "xgrammar"
    keep_anthropic_billing_header: bool = False
    max_queued_requests: int | None = None
    watchdog_timeout: float = 300.0
    disable_custom_all_reduce: bool = False  # CPU ranks: gloo instead of shared memory
    shutdown_timeout: float = 30.0
    log_level: str = "info"
    skip_server_warmup: bool = False
    skip_memory_check: bool = False  # runtime/memory_fit.py
    max_request_bytes: int = 32 * 1024 * 1024
    max_n: int = 64
    max_sequences_per_request: int = 256
    responses_store_size: int = 1024
    header_timeout: float = 10.0
    # memory and scheduling
    mem_fraction_static: float | None = None
    max_total_tokens: int | None = None
    page_size: int | None = None
    chunked_prefill_size: int | None = None
    max_prefill_tokens: int = 16384
    max_running_requests: int | None = None
    disable_radix_cache: bool = False
    schedule_policy: str = "fcfs"
    radix_eviction_policy: str = "lru"
    kv_cache_dtype: str = "auto"
    # attention backends (GPU)
    attention_backend: str | None = None
    dsa_prefill_backend: str | None = None
    dsa_decode_backend: str | None = None
    moe_runner_backend: str = "auto"
    fp8_gemm_backend: str = "auto"
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    # CPU decode step (dsaserve/engine/decode/fused_step.py)
    disable_fused_decode: bool = False
    disable_native_decode: bool = False
    enable_torch_compile: bool = False
    threads: int | None = None
    # speculative decoding
    speculative_algorithm: str | None = None
    speculative_num_steps: int | None = None
    speculative_eagle_topk: int | None = None
    speculative_num_draft_tokens: int | None = None
    speculative_draft_model_path: str | None = None  # DFLASH (dsaserve/dflash_args.py)
    speculative_dflash_block_size: int | None = None
    speculative_draft_window_size: int | None = None
    speculative_draft_attention_backend: str | None = None
    # HiCache
    enable_hierarchical_cache: bool = False
    hicache_ratio: float = 2.0
    hicache_size: int = 0
    hicache_write_policy: str = "write_through"
    hicache_mem_layout: str = "layer_first"
    hicache_io_backend: str = "direct"
    hicache_storage_backend: str | None = None
    hicache_storage_backend_extra_config: str | None = None
    hicache_storage_prefetch_policy: str = "best_effort"
    # parallelism
    tp_size: int = 1
    dp_size: int = 1
    ep_size: int = 1
    enable_dp_attention: bool = False
    load_balance_method: str = "round_robin"
    moe_a2a_backend: str | None = None
    enable_prefill_cp: bool = False
    cp_strategy: str | None = None
    attn_cp_size: int = 1
    enable_dsa_cache_layer_split: bool = False
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    enable_flashinfer_allreduce_fusion: bool = False
    # disaggregation
    disaggregation_mode: str = "null"
    disaggregation_transfer_backend: str = "mooncake"
    disaggregation_bootstrap_port: int = 8998
    disaggregation_advertise_host: str | None = None
    disaggregation_ib_device: str | None = None
    disaggregation_timeout: float = 300.0
    disaggregation_heartbeat_interval: float = 5.0
    disaggregation_checksum: bool = False

    @classmethod
    def from_cli(cls, argv: list[str] | None = None) -> ServerArgs:
        parser = argparse.ArgumentParser(prog="dsaserve serve", allow_abbrev=False)
        add_server_args(parser)
        return cls.from_namespace(parser.parse_args(argv))

    @classmethod
    def from_namespace(cls, ns: argparse.Namespace) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        values = {k: v for k, v in vars(ns).items() if k in names}
        if values.get("api_key") is None:  # a key in the environment stays out of `ps`
            values["api_key"] = os.environ.get(API_KEY_ENV) or None
        if values.get("cluster_secret") is None:
            values["cluster_secret"] = next(filter(None, map(os.environ.get, SECRET_ENVS)), None)
        return cls(**values)

    def __post_init__(self) -> None:
        _check(self)

    def replace(self, **changes: Any) -> ServerArgs:
        return dataclasses.replace(self, **changes)

    def chat_template_defaults(self) -> dict:
        return json.loads(self.default_chat_template_kwargs or "{}")


def _check(args: ServerArgs) -> None:
    """Reject values and combinations that cannot work, naming the flag."""
    positive = ["tp_size", "dp_size", "ep_size", "max_prefill_tokens", "attn_cp_size", "nnodes"]
    for name in positive:
        if getattr(args, name) < 1:
            raise ArgsError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    for name in [
        "max_total_tokens",
        "page_size",
        "max_running_requests",
        "max_queued_requests",
        "max_n",
        "max_sequences_per_request",
        "threads",
    ]:
        value = getattr(args, name)
        if value is not None and value < 1:
            raise ArgsError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.responses_store_size < 0:
        raise ArgsError(f"--responses-store-size must be >= 0, got {args.responses_store_size}")
    if not args.header_timeout > 0:
        raise ArgsError(f"--header-timeout must be > 0, got {args.header_timeout}")
    if args.mem_fraction_static is not None and not 0 < args.mem_fraction_static < 1:
        raise ArgsError(f"--mem-fraction-static must be in (0, 1), got {args.mem_fraction_static}")
    if args.chunked_prefill_size is not None and args.chunked_prefill_size == 0:
        raise ArgsError("--chunked-prefill-size must be positive, or -1 to disable chunking")
    if args.default_chat_template_kwargs:
        try:
            if not isinstance(json.loads(args.default_chat_template_kwargs), dict):
                raise ValueError
        except ValueError as e:
            raise ArgsError("--default-chat-template-kwargs must be a JSON object") from e
    if args.kv_cache_dtype not in ("auto", "bf16", "bfloat16", "fp8_e4m3", "float32", "fp32"):
        raise ArgsError(
            f"--kv-cache-dtype {args.kv_cache_dtype}: DSA models support only bf16 or fp8_e4m3"
        )
    for name, choices in BACKEND_FLAGS.items():
        value = getattr(args, name)
        if value is not None and value != "auto" and value not in choices:
            flag = name.replace("_", "-")
            raise ArgsError(f"--{flag} {value}: choose one of {', '.join(choices)}")
    if args.cuda_graph_max_bs is not None and args.cuda_graph_max_bs < 1:
        raise ArgsError(f"--cuda-graph-max-bs must be >= 1, got {args.cuda_graph_max_bs}")
    if args.cp_strategy == "interleave" and args.enable_prefill_cp and args.dp_size != 1:
        raise ArgsError("--cp-strategy interleave does not support DP attention: use --dp 1")
    if args.enable_prefill_cp and args.disaggregation_mode == "decode":
        raise ArgsError("--enable-prefill-cp is for prefill; it is not allowed on decode workers")
    for name in ("disaggregation_timeout", "disaggregation_heartbeat_interval"):
        if getattr(args, name) <= 0:
            raise ArgsError(f"--{name.replace('_', '-')} must be > 0, got {getattr(args, name)}")
    if args.hicache_storage_backend_extra_config:
        try:
            if not isinstance(json.loads(args.hicache_storage_backend_extra_config), dict):
                raise ValueError
        except ValueError as e:
            raise ArgsError("--hicache-storage-backend-extra-config must be a JSON object") from e
    max_gb = json.loads(args.hicache_storage_backend_extra_config or "{}").get("max_size_gb", 1)
    if isinstance(max_gb, bool) or not isinstance(max_gb, int | float) or not max_gb > 0:
        raise ArgsError(f"--hicache-storage-backend-extra-config: max_size_gb must be a number "
                        f"> 0 (GB), got {max_gb!r}")  # fmt: skip
    if args.hicache_storage_backend and not args.enable_hierarchical_cache:
        raise ArgsError("--hicache-storage-backend needs --enable-hierarchical-cache")
    if args.enable_hierarchical_cache and args.disable_radix_cache:
        raise ArgsError("--enable-hierarchical-cache needs the radix cache: drop "
                        "--disable-radix-cache")  # fmt: skip
    if args.hicache_ratio <= 0 or args.hicache_size < 0:
        raise ArgsError(
            "--hicache-ratio must be > 0 and --hicache-size >= 0 (GB; 0: use the ratio)"
        )
    if args.speculative_algorithm in (None, "EAGLE", "NEXTN"):
        speculative_settings(args)  # other algorithms parse (SGLang's names) and fail at start


SPEC_DEFAULT_STEPS = 3


def speculative_settings(args: ServerArgs) -> tuple[int, int, int] | None:
    """(num_steps, eagle_topk, num_draft_tokens) with SGLang's defaults for this family (3, 1,
    4), or None when speculation is off; ArgsError for a combination that cannot work."""
    steps, topk, drafts = (args.speculative_num_steps, args.speculative_eagle_topk,
                           args.speculative_num_draft_tokens)  # fmt: skip
    if args.speculative_algorithm is None:
        if (steps, topk, drafts) != (None, None, None):
            raise ArgsError("--speculative-num-steps/-eagle-topk/-num-draft-tokens need "
                            "--speculative-algorithm EAGLE (or NEXTN)")  # fmt: skip
        return None
    if args.speculative_algorithm in ("DFLASH", "DFLASH2"):
        return None  # no MTP steps: a separate drafter (dsaserve/dflash_args.py)
    if args.speculative_algorithm not in ("EAGLE", "NEXTN"):
        raise ArgsError(f"--speculative-algorithm {args.speculative_algorithm} is not supported: "
                        "use EAGLE (or its alias NEXTN), which drafts with the checkpoint's MTP "
                        "layer")  # fmt: skip
    topk = 1 if topk is None else topk
    if topk != 1:
        raise ArgsError(f"--speculative-eagle-topk {topk}: tree drafting is not supported; use "
                        "--speculative-eagle-topk 1")  # fmt: skip
    steps = steps if steps is not None else (drafts - 1 if drafts else SPEC_DEFAULT_STEPS)
    if steps < 1:
        raise ArgsError(f"--speculative-num-steps must be >= 1, got {steps}")
    drafts = steps + 1 if drafts is None else drafts
    if drafts != steps + 1:
        raise ArgsError(
            f"--speculative-num-draft-tokens {drafts} does not match --speculative-num-steps "
            f"{steps}: with --speculative-eagle-topk 1 it must be steps + 1; set "
            f"--speculative-num-draft-tokens {steps + 1}"
        )
    return steps, topk, drafts


def default_text(flag: Flag) -> str:
    """The default as `--help` and docs/flags.md show it: the flag's own words, else the value."""
    if flag.default is not None:
        return flag.default
    value = _default(flag.kw.get("dest") or _dest(flag.names[0]))
    if isinstance(value, bool):
        return "on" if value else "off"
    return "none" if value is None else str(value)


def _dest(name: str) -> str:
    return name.lstrip("-").replace("-", "_")


def _default(dest: str) -> Any:
    default = ServerArgs.__dataclass_fields__[dest]
    factory = default.default_factory
    return factory() if factory is not dataclasses.MISSING else default.default


def _flag(parser: argparse._ActionsContainer, flag: Flag) -> None:
    kw = {"dest": _dest(flag.names[0]), **flag.kw}
    if kw.get("action") != "store_false":  # --disable-cache-report: the dest of the flag before
        kw["default"] = _default(kw["dest"])
    help_text = f"{flag.help} (default: {default_text(flag)})".replace("%", "%%")
    parser.add_argument(*flag.names, help=help_text, **kw)


def add_server_args(parser: argparse.ArgumentParser) -> None:
    """Declare every `dsaserve serve` flag (dsaserve/flags.py), one argparse group a section."""
    for section, flags in SECTIONS.items():
        group = parser.add_argument_group(section)
        for flag in flags:
            _flag(group, flag)

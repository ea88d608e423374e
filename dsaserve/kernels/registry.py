"""The backend seam: per hot op, named implementations imported lazily, chosen once at start.

Ops (and the flags that pick them, SGLang's names where SGLang has one):

| op | flag | implementations |
|---|---|---|
| `indexer` (scores + top-k) | `--dsa-prefill-backend` / `--dsa-decode-backend` | torch, triton |
| `sparse_mla` (selected entries, absorbed) | `--dsa-decode-backend` | torch, triton, flashmla |
| `kv_store` (write / read the MLA entry and the index key) | `--kv-cache-dtype` | torch |
| `moe` (routed-expert GEMMs) | `--moe-runner-backend` | torch, cpu, triton, deep_gemm |
| `fp8_gemm` (block-FP8 128x128 linear) | `--fp8-gemm-backend` | torch, cpu, triton, deep_gemm |
| `draft_attention` (DFlash block) | `--speculative-draft-attention-backend` | torch, triton |

`torch` is today's eager code, always importable and the `auto` choice on CPU, except for the two
ops that take quantised weights: on CPU their `auto` is `cpu` (kernels/cpu_fp8.py), which keeps them
as stored, block FP8 and NVFP4 experts (an explicit `torch` dequantises them on load, the
reference). On CUDA `auto` takes our Triton kernel where it imports, else the reference. The vendor
adapters (`deep_gemm`: kernels/deep_gemm_adapter.py; `flashmla` for SGLang's `flashmla_sparse` /
`flashmla_kv` / `flashmla_auto`: kernels/flash_mla_adapter.py) were never run on a GPU, so only an
explicit flag takes them, and only on CUDA where `import deep_gemm` / `import flash_mla` succeeds;
otherwise our Triton kernel stands in (logged). Any other SGLang name without a kernel here (e.g.
`fa3`) resolves to our Triton kernel on CUDA. On CPU every CUDA-only name is refused in one line,
and on a GPU older than sm_80 or a ROCm one so is `triton` (`auto` takes torch;
kernels/gpu_target.py).
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dsaserve.kernels.gpu_target import unsupported

logger = logging.getLogger(__name__)

TORCH, TRITON, DEEP_GEMM, FLASHMLA, CPU = "torch", "triton", "deep_gemm", "flashmla", "cpu"
VENDOR = (DEEP_GEMM, FLASHMLA)  # adapters over an external package: an explicit flag only

# op -> backend -> "module:attribute" (imported only when chosen)
IMPLEMENTATIONS: dict[str, dict[str, str]] = {
    "indexer": {
        TORCH: "dsaserve.kernels.reference:indexer_decode_topk",
        TRITON: "dsaserve.kernels.triton_indexer:indexer_decode_topk",
    },
    "sparse_mla": {
        TORCH: "dsaserve.kernels.reference:sparse_mla_decode",
        TRITON: "dsaserve.kernels.triton_sparse_mla:sparse_mla_decode",
        FLASHMLA: "dsaserve.kernels.flash_mla_adapter:sparse_mla_decode",
    },
    "kv_store": {TORCH: "dsaserve.kernels.kv_quant:KV_STORE"},
    "moe": {
        TORCH: "dsaserve.kernels.static_moe:static_experts",
        CPU: "dsaserve.kernels.cpu_fp8:kept_experts",
        TRITON: "dsaserve.kernels.triton_moe:grouped_experts",
        DEEP_GEMM: "dsaserve.kernels.deep_gemm_adapter:grouped_experts",
    },
    "fp8_gemm": {
        TORCH: "dsaserve.kernels.reference:fp8_linear",
        CPU: "dsaserve.kernels.cpu_fp8:fp8_linear",
        TRITON: "dsaserve.kernels.triton_fp8_gemm:fp8_linear",
        DEEP_GEMM: "dsaserve.kernels.deep_gemm_adapter:fp8_linear",
    },
    "draft_attention": {
        TORCH: "dsaserve.kernels.draft_attention:draft_attention",
        TRITON: "dsaserve.kernels.triton_draft_attention:draft_attention",
    },
}

# SGLang names for its kernels -> the implementation of ours that stands in for them on CUDA
ALIASES = {"flashmla_sparse": FLASHMLA, "flashmla_kv": FLASHMLA, "flashmla_auto": FLASHMLA}
SGLANG_ATTENTION = ("flashmla_sparse", "flashmla_sparse_q8", "flashmla_kv", "flashmla_auto",
                    "fa3", "tilelang", "aiter", "trtllm")  # fmt: skip
ATTENTION_BACKENDS = ("auto", "dsa", "nsa", "torch", "triton")
DSA_BACKENDS = ("auto", *SGLANG_ATTENTION, "torch", "triton")
MOE_BACKENDS = ("auto", "torch", "triton", "deep_gemm", "flashinfer_cutlass", "cutlass")
FP8_GEMM_BACKENDS = ("auto", "torch", "triton", "deep_gemm", "cutlass", "flashinfer_trtllm")


class BackendError(ValueError):
    """A backend flag that cannot work on this device; the message names the flag."""


def available(op: str, backend: str) -> bool:
    """Whether `backend` of `op` imports here (Triton needs its package; on CPU, the
    interpreter: TRITON_INTERPRET=1 set before the import)."""
    try:
        load(op, backend)
    except (ImportError, RuntimeError):
        return False
    return True


@functools.cache
def load(op: str, backend: str) -> Callable:
    module, _, attr = IMPLEMENTATIONS[op][backend].partition(":")
    return getattr(importlib.import_module(module), attr)


def gpu_refusal(device_type: str) -> str | None:
    """Why our Triton kernels cannot run on this CUDA device (kernels/gpu_target.py), or None."""
    return unsupported(torch.device("cuda")) if device_type == "cuda" else None


def resolve(op: str, requested: str | None, device_type: str, flag: str) -> str:
    """The backend `op` runs with: `requested` (a flag value; None or auto = choose)."""
    impls = IMPLEMENTATIONS[op]
    refusal = gpu_refusal(device_type)
    if requested in (None, "auto", "dsa", "nsa"):
        if device_type == "cuda" and TRITON in impls and not refusal and available(op, TRITON):
            return TRITON
        return CPU if device_type == "cpu" and CPU in impls else TORCH
    name = ALIASES.get(requested, requested)
    if name == TRITON and refusal:
        raise BackendError(f"{flag} triton: {refusal}; use torch")
    if name in (TORCH, TRITON):
        if name == TRITON and device_type != "cuda" and not available(op, TRITON):
            raise BackendError(f"{flag} triton: needs CUDA (or TRITON_INTERPRET=1 on CPU)")
        return name
    if device_type != "cuda":
        raise BackendError(f"{flag} {requested}: a CUDA kernel; on CPU use auto or torch")
    if name in impls and available(op, name):
        return name
    if TRITON in impls and not refusal and available(op, TRITON):
        if name in VENDOR:
            logger.warning("%s %s: %s does not import here; using the Triton kernel", flag,
                           requested, "flash_mla" if name == FLASHMLA else name)  # fmt: skip
        return TRITON  # our Triton kernel stands in for the SGLang-named one
    raise BackendError(f"{flag} {requested}: no implementation importable here; use torch")


@dataclass(frozen=True)
class Kernels:
    """The chosen implementation of each op (names, and the loaded callables)."""

    names: dict[str, str] = field(default_factory=lambda: {op: TORCH for op in IMPLEMENTATIONS})

    @property
    def eager(self) -> bool:
        """Every op on eager torch code (`torch`, or the CPU FP8 ops): the fused decode step,
        which reads the pool and the weights itself, runs over these only."""
        return set(self.names.values()) <= {TORCH, CPU}

    def __getattr__(self, op: str) -> Callable:
        if op.startswith("_") or op not in IMPLEMENTATIONS:
            raise AttributeError(op)
        return load(op, self.names[op])


def choose_kernels(args: object, device_type: str) -> Kernels:
    """Resolve every op's backend from the server args (`ServerArgs` fields)."""
    get = lambda name: getattr(args, name, None)  # noqa: E731
    names = {
        "indexer": resolve("indexer", get("dsa_decode_backend"), device_type,
                           "--dsa-decode-backend"),
        "sparse_mla": resolve("sparse_mla", get("dsa_decode_backend") or get("attention_backend"),
                              device_type, "--dsa-decode-backend"),
        "kv_store": TORCH,
        "moe": resolve("moe", get("moe_runner_backend"), device_type, "--moe-runner-backend"),
        "fp8_gemm": resolve("fp8_gemm", get("fp8_gemm_backend"), device_type,
                            "--fp8-gemm-backend"),
        "draft_attention": resolve("draft_attention", get("speculative_draft_attention_backend"),
                                   device_type, "--speculative-draft-attention-backend"),
    }  # fmt: skip
    prefill = get("dsa_prefill_backend")
    if prefill not in (None, "auto", "torch", "triton"):
        resolve("sparse_mla", prefill, device_type, "--dsa-prefill-backend")  # validate only
    return Kernels(names)


DEFAULT_KERNELS = Kernels()

"""The engine's start-up choices: the device, the compute dtype, how many KV tokens fit in
memory, the checkpoint's generation defaults (engine/shard.py builds a rank's shard with them)."""

from __future__ import annotations

import ctypes
import json
import os
from pathlib import Path

import torch

from dsaserve.args import ArgsError, ServerArgs
from dsaserve.model_config import ModelConfig

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16,
          "bf16": torch.bfloat16, "float16": torch.float16, "fp16": torch.float16}  # fmt: skip


def physical_cores() -> int:
    """The physical cores this process may run on (hyper-threads of one core count once)."""
    cores = set()
    for cpu in os.sched_getaffinity(0):
        topology = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            cores.add(((topology / "physical_package_id").read_text().strip(),
                       (topology / "core_id").read_text().strip()))  # fmt: skip
        except OSError:  # no sysfs topology: count the logical CPU
            cores.add(("cpu", str(cpu)))
    return max(1, len(cores))


def default_threads(threads: int | None) -> int:
    """`--threads`, else OMP_NUM_THREADS when set, else one per physical core."""
    if threads is not None:
        return threads
    env = os.environ.get("OMP_NUM_THREADS", "")
    return int(env) if env.isdigit() and int(env) > 0 else physical_cores()


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


def max_running(args: ServerArgs, speculative: bool, device: torch.device) -> int:
    """`--max-running-requests`, else 48 with speculation (SGLang's), 256 on CUDA, 64 on CPU."""
    default = 48 if speculative else (256 if device.type == "cuda" else 64)
    return args.max_running_requests or default


def generation_defaults(path: Path) -> dict:
    file = path / "generation_config.json"
    if not file.is_file():
        return {}
    raw = json.loads(file.read_text())
    eos = raw.get("eos_token_id", [])
    raw["eos_token_id"] = eos if isinstance(eos, list) else [eos]
    keep = ("temperature", "top_p", "top_k", "eos_token_id")
    return {k: raw[k] for k in keep if raw.get(k) is not None}


def release_free_heap() -> None:
    """Give back to the OS the heap glibc keeps after frees (`malloc_trim`): loading and
    converting weights, and stacking them for the decode step, free large temporaries that would
    otherwise stay resident (~8% of a block-FP8 engine's bytes). Without glibc: nothing."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass

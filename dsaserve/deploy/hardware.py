"""The accelerators the planner knows: memory, vendor, architecture, GPUs per node, and what
dsaserve's Triton kernels do on each (`TRITON_SUPPORT`, by compute capability)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

GIB = 1 << 30


class PlanError(ValueError):
    """A planner input that cannot be used (unknown name, unreadable config): exit code 2."""


@dataclass(frozen=True)
class Hardware:
    """One accelerator model and the node it usually comes in.

    `memory_gib` is the device memory as PyTorch reports it (the "total capacity" of its
    out-of-memory message, in GiB), which is what `--mem-fraction-static` is a fraction of;
    the vendor's figure is in the comment.
    """

    name: str
    vendor: str  # "nvidia", "amd" or "cpu"
    arch: str  # "hopper", "blackwell", "cdna3", "cdna4" or "cpu"
    memory_gib: float
    gpus_per_node: int
    sm: int | None = None  # NVIDIA compute capability (90 = sm_90); None elsewhere

    @property
    def triton_kernels(self) -> str:
        """What our Triton kernels do on this accelerator (docs/gpu.md's compile report)."""
        if self.sm is None:
            return TRITON_SUPPORT[self.vendor]
        return TRITON_SUPPORT.get(self.sm) or TRITON_SUPPORT["older"]

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * GIB)

    @property
    def is_hopper(self) -> bool:
        return self.arch == "hopper"

    @property
    def is_blackwell(self) -> bool:
        return self.arch == "blackwell"

    @property
    def is_amd(self) -> bool:
        return self.vendor == "amd"

    @property
    def is_cpu(self) -> bool:
        return self.vendor == "cpu"


# Compiled ahead of time for each target by bench/gpu_check_compile.py; sm_90 and sm_100 in CI
# (tests/test_gpu_compile.py). None of it has run on a GPU yet.
TRITON_SUPPORT = {
    90: "checked in CI for sm_90: compiles without spills, wgmma (mma.sync for 16-head attention)",
    100: "checked in CI for sm_100: compiles without spills, tcgen05 (mma.sync for 16-head "
    "attention)",
    103: "the sm_100 kernels (compile report, not CI: no spills, tcgen05)",
    89: "the same kernels on mma.sync within 99 KB of shared memory (compile report: no spills "
    "but 16 B in the fp32 drafter attention)",
    120: "the same kernels on mma.sync within 99 KB of shared memory (compile report: no spills)",
    80: "FP8 kept as bytes and decoded to fp16 inside the kernels, no FP8 in hardware (compile "
    "report: the 64-row FP8 GEMM tiles spill ~2.6 KB)",
    "older": "refused at start (needs sm_80): use the torch backends",
    "amd": "built and checked for NVIDIA only: refused at start, auto picks the torch backends",
    "cpu": "the torch kernels (the Triton ones run only under TRITON_INTERPRET=1, as in tests)",
}

HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in [
        Hardware("H100", "nvidia", "hopper", 79.1, 8, 90),  # 80 GB HBM3
        Hardware("H200", "nvidia", "hopper", 139.8, 8, 90),  # 141 GB HBM3e
        Hardware("B200", "nvidia", "blackwell", 178.3, 8, 100),  # 180 GB HBM3e (HGX B200)
        Hardware("B300", "nvidia", "blackwell", 267.7, 8, 103),  # 288 GB HBM3e (2.1 TiB a node)
        Hardware("GB300", "nvidia", "blackwell", 267.7, 4, 103),  # 288 GB HBM3e, 4 GPUs a tray
        Hardware("MI300X", "amd", "cdna3", 191.9, 8),  # 192 GB HBM3
        Hardware("MI325X", "amd", "cdna3", 255.9, 8),  # 256 GB HBM3e
        Hardware("MI355X", "amd", "cdna4", 287.9, 8),  # 288 GB HBM3e
        Hardware("CPU", "cpu", "cpu", 16.0, 1),  # host memory; set --device-memory-gib
    ]
}


def get_hardware(name: str, memory_gib: float | None = None) -> Hardware:
    """Look a hardware name up (case-insensitive); `memory_gib` overrides its memory."""
    by_upper = {key.upper(): hw for key, hw in HARDWARE.items()}
    hw = by_upper.get(name.upper())
    if hw is None:
        raise PlanError(f"unknown --hardware {name!r}; choose from {', '.join(HARDWARE)}")
    if memory_gib is not None:
        if memory_gib <= 0:
            raise PlanError(f"--device-memory-gib must be positive, got {memory_gib}")
        hw = dataclasses.replace(hw, memory_gib=memory_gib)
    return hw

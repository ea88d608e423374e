"""The accelerators the planner knows: memory, vendor, architecture, GPUs per node."""

from __future__ import annotations

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


HARDWARE: dict[str, Hardware] = {
    h.name: h
    for h in [
        Hardware("H100", "nvidia", "hopper", 79.1, 8),  # 80 GB HBM3
        Hardware("H200", "nvidia", "hopper", 139.8, 8),  # 141 GB HBM3e
        Hardware("B200", "nvidia", "blackwell", 178.3, 8),  # 180 GB HBM3e (HGX B200)
        Hardware("B300", "nvidia", "blackwell", 267.7, 8),  # 288 GB HBM3e (2.1 TiB a node)
        Hardware("GB300", "nvidia", "blackwell", 267.7, 4),  # 288 GB HBM3e, 4 GPUs a tray
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
        hw = Hardware(hw.name, hw.vendor, hw.arch, memory_gib, hw.gpus_per_node)
    return hw

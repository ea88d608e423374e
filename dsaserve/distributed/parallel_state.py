"""`ParallelState`: the layout's group sizes, this rank's place in each, and the collectives.

Ranks 0..tp-1 form the world. Attention runs in attention-TP groups of `attn_tp` consecutive
ranks (tp / dp under DP attention, else tp); every part outside attention (dense MLP, shared and
routed experts, the LM head) spans the whole world, over the tokens of every attention group
gathered together. Experts are split `ep` ways (whole experts) and each expert `moe_tp = tp / ep`
ways inside. Built once per process and passed down to the layers; a single process gets
`ParallelState.single()`, whose collectives are no-ops.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(frozen=True)
class ParallelSizes:
    """The sizes the flags ask for (checked by `dsaserve.distributed.checks`)."""

    tp: int = 1
    dp: int = 1
    ep: int = 1
    dp_attention: bool = False
    nnodes: int = 1
    cp: int = 1  # context-parallel prefill ranks (the attention group's, see context_parallel)

    @classmethod
    def from_args(cls, args: Any) -> ParallelSizes:
        cp = args.attn_cp_size if getattr(args, "enable_prefill_cp", False) else 1
        return cls(args.tp_size, args.dp_size, args.ep_size, args.enable_dp_attention, args.nnodes,
                   cp)  # fmt: skip

    @property
    def attn_tp(self) -> int:
        return self.tp // self.dp if self.dp_attention else self.tp

    @property
    def head_tp(self) -> int:
        """Ways the attention heads are split: the attention group's ranks over the CP ranks."""
        return self.attn_tp // self.cp

    @property
    def groups(self) -> int:
        """Attention groups, each with its own scheduler, KV pool and radix cache."""
        return self.dp if self.dp_attention else 1

    @property
    def replicas(self) -> int:
        """`--dp N` without DP attention: N independent engines of `tp` ranks each."""
        return 1 if self.dp_attention else self.dp

    @property
    def moe_tp(self) -> int:
        return self.tp // self.ep

    @property
    def ranks_per_node(self) -> int:
        return self.tp // self.nnodes

    def leader(self, group: int) -> int:
        """The rank that schedules attention group `group` (its first rank)."""
        return group * self.attn_tp


@dataclass
class ParallelState:
    sizes: ParallelSizes
    rank: int = 0
    world_group: Any = None  # the device process group (NCCL or gloo); None: single process
    cpu_group: Any = None  # gloo group for the small host-side messages (headers, payloads)
    attn_group: Any = None  # this rank's attention-TP group (None when attn_tp == 1)
    attn_cpu_group: Any = None
    # shared-memory collectives over the same ranks (CPU ranks of one node, shm_comm.py)
    world_shm: Any = None
    attn_shm: Any = None
    # rows of every attention group in the op being run (set per op by the rank loop)
    group_rows: list[int] = field(default_factory=lambda: [0])
    comm_seconds: float = 0.0  # time spent inside the model's collectives (bench/parallel.py)
    store: Any = None  # the rendezvous store (other nodes' heartbeats, runtime/heartbeat.py)

    @classmethod
    def single(cls) -> ParallelState:
        return cls(ParallelSizes())

    # ---- this rank's place ----------------------------------------------------------------
    @property
    def world(self) -> int:
        return self.sizes.tp

    @property
    def attn_tp(self) -> int:
        return self.sizes.attn_tp

    @property
    def attn_rank(self) -> int:
        return self.rank % self.sizes.attn_tp

    @property
    def head_rank(self) -> int:
        return self.attn_rank // self.sizes.cp

    @property
    def cp_group(self) -> Any:
        """The CP ranks' device group: the attention group (CP spans it, heads are whole)."""
        return self.attn_group

    @property
    def dp_rank(self) -> int:
        return self.rank // self.sizes.attn_tp

    @property
    def ep_rank(self) -> int:
        return self.rank // self.sizes.moe_tp

    @property
    def moe_tp_rank(self) -> int:
        return self.rank % self.sizes.moe_tp

    @property
    def is_leader(self) -> bool:
        return self.attn_rank == 0

    # ---- collectives ----------------------------------------------------------------------
    def all_reduce_attn(self, x: torch.Tensor) -> torch.Tensor:
        """Sum partial results over the attention-TP group (row-parallel o_proj, embedding)."""
        if self.attn_tp > 1 and x.numel():
            start = time.perf_counter()
            if self.attn_shm is not None:
                self.attn_shm.all_reduce(x)
            else:
                torch.distributed.all_reduce(x, group=self.attn_group)
            self.comm_seconds += time.perf_counter() - start
        return x

    def all_reduce_world(self, x: torch.Tensor) -> torch.Tensor:
        if self.world > 1 and x.numel():
            start = time.perf_counter()
            if self.world_shm is not None:
                self.world_shm.all_reduce(x)
            else:
                torch.distributed.all_reduce(x, group=self.world_group)
            self.comm_seconds += time.perf_counter() - start
        return x

    def _all_gather_world(self, x: torch.Tensor) -> list[torch.Tensor]:
        start = time.perf_counter()
        if self.world_shm is not None:
            parts = self.world_shm.all_gather(x)
        else:
            parts = [torch.empty_like(x) for _ in range(self.world)]
            torch.distributed.all_gather(parts, x.contiguous(), group=self.world_group)
        self.comm_seconds += time.perf_counter() - start
        return parts

    def gather_groups(self, x: torch.Tensor) -> torch.Tensor:
        """The rows of every attention group, in group order (identity without DP attention).
        Every rank sends its group's rows padded to the largest group; one copy per group is
        kept."""
        rows = self.group_rows
        if self.sizes.groups == 1:
            return x
        width = max(rows)
        if width == 0:
            return x.new_zeros(0, *x.shape[1:])
        padded = x.new_zeros(width, *x.shape[1:])
        padded[: x.shape[0]] = x
        parts = self._all_gather_world(padded)
        leaders = [parts[self.sizes.leader(g)][:n] for g, n in enumerate(rows)]
        return torch.cat(leaders)

    def own_rows(self, x: torch.Tensor) -> torch.Tensor:
        """This group's rows of a tensor over every group's rows (inverse of gather_groups)."""
        if self.sizes.groups == 1:
            return x
        start = sum(self.group_rows[: self.dp_rank])
        return x[start : start + self.group_rows[self.dp_rank]]

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's x along the last dim (vocab-parallel logits)."""
        if self.world == 1:
            return x
        if x.numel() == 0:
            return x.new_zeros(*x.shape[:-1], x.shape[-1] * self.world)
        return torch.cat(self._all_gather_world(x), dim=-1)

    @contextmanager
    def rows(self, group_rows: list[int]) -> Iterator[None]:
        """Install the per-group row counts of the op about to run."""
        previous, self.group_rows = self.group_rows, list(group_rows)
        try:
            yield
        finally:
            self.group_rows = previous

"""The shared-memory collectives of CPU ranks on one node (dsaserve/distributed/shm_comm.py).

Real processes joined by gloo: the shared-memory all-reduce gives every rank the same bits, equal
to the rank-order sum and to gloo's all-reduce, through chunks (a tensor larger than a slot),
non-contiguous and bf16 inputs, many back-to-back calls (the alternating areas), and sub-groups;
all-gather returns every rank's part, broadcast the source's; the file is gone once mapped; a
rank that never arrives makes the others fail after the timeout, naming it.
"""

from __future__ import annotations

import datetime
import os
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from server_harness import wait_for

from dsaserve.distributed import shm_comm
from dsaserve.distributed.shm_comm import ShmGroup

pytestmark = pytest.mark.x86_64  # shm_comm.supported: x86's store ordering


def _join(rank: int, world: int, store: str) -> None:
    """Join through a file store (no port to pick: gloo's own sockets take the OS's)."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))  # fmt: skip


def _inputs(rank: int, shape: tuple[int, ...], dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(100 + rank)).to(dtype)


def _collectives(rank: int, world: int, store: str) -> None:
    _join(rank, world, store)
    shm = ShmGroup.create(list(range(world)), rank, None, timeout=30)
    if rank == 0:  # the creator unlinks it once every rank has mapped it
        mine = f"dsaserve-{os.getpid()}-"
        assert not [n for n in os.listdir(shm_comm._shm_dir()) if n.startswith(mine)]
    big = (3, shm_comm.SLOT_BYTES // 4 // 3 + 1000)  # fp32: more than one slot -> two chunks
    for shape, dtype in (
        ((32, 1024), torch.float32),
        (big, torch.float32),
        ((7, 5), torch.bfloat16),
    ):
        x = _inputs(rank, shape, dtype)
        want = _inputs(0, shape, dtype)
        for r in range(1, world):
            want = want + _inputs(r, shape, dtype)
        got = shm.all_reduce(x.clone())
        assert torch.equal(got, want)  # the rank-order sum, so the same bits on every rank
        if dtype == torch.float32:
            ref = x.clone()
            dist.all_reduce(ref)
            torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-5)
        everyone = shm.all_gather(x)
        assert all(torch.equal(part, _inputs(r, shape, dtype)) for r, part in enumerate(everyone))
        assert torch.equal(shm.broadcast(x.clone(), 2), _inputs(2, shape, dtype))
    wide = _inputs(rank, (8, 6))
    column = wide[:, 1]  # not contiguous: summed through a copy, written back in place
    shm.all_reduce(column)
    assert torch.equal(wide[:, 1], sum(_inputs(r, (8, 6))[:, 1] for r in range(world)))
    for step in range(200):  # back to back: each area is reused only once every rank read it
        got = shm.all_reduce(torch.full((4,), float(rank + step)))
        assert got.tolist() == [float(sum(range(world)) + world * step)] * 4
    if world == 4:  # sub-groups, as under DP attention: {0, 1} and {2, 3}
        mine = [0, 1] if rank < 2 else [2, 3]
        groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
        sub = ShmGroup.create(mine, rank, groups[rank // 2], timeout=30)
        got = sub.all_reduce(torch.full((3,), float(rank)))
        assert got.tolist() == [float(sum(mine))] * 3
    dist.barrier()
    dist.destroy_process_group()


def test_shared_memory_collectives_match_the_rank_order_sum(tmp_path):
    mp.spawn(_collectives, args=(4, str(tmp_path / "store")), nprocs=4)


def _absent_peer(rank: int, store: str, out: str) -> None:
    _join(rank, 2, store)
    shm = ShmGroup.create([0, 1], rank, None, timeout=1)
    if rank == 0:
        start = time.monotonic()
        try:
            shm.all_reduce(torch.ones(4))
        except TimeoutError as e:  # the lower bound: it gave rank 1 its whole timeout
            waited = time.monotonic() - start  # not a speed bound: checked >= 1 s only
            Path(out).write_text(f"{waited:.2f} {e}")
        Path(out + ".done").touch()
    else:  # never joins the all-reduce: stays until rank 0 gave up on it
        wait_for(lambda: os.path.exists(out + ".done"), "rank 0 giving up on rank 1")


def test_a_rank_that_never_arrives_times_out_naming_it(tmp_path):
    out = tmp_path / "error"
    mp.spawn(_absent_peer, args=(str(tmp_path / "store"), str(out)), nprocs=2)
    waited, message = out.read_text().split(" ", 1)
    assert float(waited) >= 1  # it waited out its timeout before naming the absent rank
    assert "group ranks [1] did not arrive within 1s" in message

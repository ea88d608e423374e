"""The engine starts no process; the runtime owns them; every rank builds its shard one way.

- `Engine(args, parallel)` with a one-rank `ParallelState` is built and stepped here, in this
  process: no child process, no process group, and it is what the engine process drives
  (`DrivenEngine`).
- The leader's `Engine` and a follower rank (runtime/follower.py) build their shard through
  `engine/shard.py`'s `build_shard`: both pools are the ones it returned, with one layout.
- Flags are checked once, before any process starts: `dsaserve serve` refuses speculation on a
  checkpoint without an MTP layer in one line (exit 2) instead of failing in its engine process.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from scripted_engine import ScriptedEngine
from tiny_models import make_checkpoint

from dsaserve.args import ServerArgs
from dsaserve.disaggregation.decode import DecodeEngine
from dsaserve.disaggregation.prefill import PrefillEngine
from dsaserve.distributed.parallel_state import ParallelState
from dsaserve.engine import engine as engine_module
from dsaserve.engine import shard as shard_module
from dsaserve.engine.engine import Engine
from dsaserve.engine.messages import GenerateRequest
from dsaserve.runtime import follower
from dsaserve.runtime.engine_process import DrivenEngine

GREEDY = {"max_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint(tmp_path_factory.mktemp("runtime") / "ckpt", "glm", seed=3)


def args_for(checkpoint: Path, **flags) -> ServerArgs:
    return ServerArgs(model_path=str(checkpoint), max_total_tokens=512, page_size=8, **flags)


def children() -> list[int]:
    """This process's child processes (Linux /proc)."""
    found = []
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        text = (task / "children").read_text().split()
        found += [int(pid) for pid in text]
    return found


def spy_on_build_shard(monkeypatch: pytest.MonkeyPatch, module) -> list:
    """Record every shard `module` builds through engine/shard.py's `build_shard`."""
    built, real = [], shard_module.build_shard

    def spy(*args, **kwargs):
        built.append(real(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(module, "build_shard", spy)
    return built


def test_engine_is_built_and_stepped_on_one_rank_without_processes(checkpoint: Path):
    before = children()
    engine = Engine(args_for(checkpoint), ParallelState.single())
    assert isinstance(engine, DrivenEngine)  # what runtime/engine_process.py drives
    engine.add_request(GenerateRequest(rid="a", input_ids=list(range(1, 20)), sampling=GREEDY))
    engine.add_request(GenerateRequest(rid="b", input_ids=list(range(5, 12)), sampling=GREEDY))
    outputs, steps = {}, 0
    while engine.has_work():
        for out in engine.step():
            outputs.setdefault(out.rid, []).extend(out.token_ids)
        steps += 1
        assert steps < 50
    assert {rid: len(ids) for rid, ids in outputs.items()} == {"a": 6, "b": 6}
    assert engine.idle() is False  # one rank: nobody else's rounds to join
    engine.close()
    assert children() == before and not torch.distributed.is_initialized()


@pytest.mark.parametrize("driven", [PrefillEngine, DecodeEngine, ScriptedEngine])
def test_every_engine_the_process_drives_has_the_protocols_calls(driven: type):
    """The engine process calls each of these on whatever its factory built (no getattr)."""
    calls = [name for name, value in vars(DrivenEngine).items() if callable(value)]
    calls = [name for name in calls if not name.startswith("_")]
    assert {"step", "idle", "close", "add_request"} <= set(calls)
    assert [name for name in calls if not callable(getattr(driven, name, None))] == []
    if driven is not ScriptedEngine:  # the PD roles answer these from their engine
        assert all(isinstance(getattr(driven, name), property) for name in
                   ("model_config", "context_length", "generation_defaults"))  # fmt: skip


def test_engine_refuses_several_ranks_without_their_state(checkpoint: Path):
    with pytest.raises(ValueError, match="pass the ParallelState of running ranks"):
        Engine(args_for(checkpoint, tp_size=2))


@pytest.mark.parametrize("flags", [{}, {"kv_cache_dtype": "fp8_e4m3"}])
def test_leader_and_follower_pools_come_from_build_shard(
    checkpoint: Path, monkeypatch: pytest.MonkeyPatch, flags: dict
):
    leader_shards = spy_on_build_shard(monkeypatch, engine_module)
    follower_shards = spy_on_build_shard(monkeypatch, follower)
    args = args_for(checkpoint, **flags)
    engine = Engine(args, ParallelState.single(), show_progress=False)
    runner = follower.follower_runner(args, ParallelState.single())
    assert len(leader_shards) == len(follower_shards) == 1
    assert engine.pool is leader_shards[0].pool  # the leader's pool is build_shard's
    follower_pool = follower_shards[0].pool
    assert runner.kv_cache is follower_pool.kv_cache  # and so is the follower's
    assert runner.index_cache is follower_pool.index_cache
    assert runner.model is follower_shards[0].model

    def layout(pool) -> tuple:
        kv, index = pool.kv_cache, pool.index_cache
        return (pool.page_size, pool.pages.num_pages, kv.shape, kv.dtype, index.shape, index.dtype)

    assert layout(follower_pool) == layout(engine.pool)


def test_unrunnable_flags_are_refused_before_any_process_starts(tmp_path: Path):
    """EAGLE on a checkpoint without its MTP layer: one line from `dsaserve serve` itself, not
    an engine process that fails to start."""
    ckpt = make_checkpoint(tmp_path / "no_mtp", "glm", seed=1, num_nextn_predict_layers=0)
    command = [sys.executable, "-m", "dsaserve.cli", "serve", "--model-path", str(ckpt),
               "--port", "0", "--speculative-algorithm", "EAGLE"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "dsaserve serve: error: --speculative-algorithm EAGLE" in done.stderr
    assert "no MTP" in done.stderr and "engine failed to start" not in done.stderr

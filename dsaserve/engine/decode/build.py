"""`build_runner`: how this engine runs its steps, chosen once: the ranks it drives, its CUDA
graphs, the fused / native decode step, and the scheduler sized to them.

The choices (each path's cost stays in its own module):

- ranks (`--tp` and the other layouts): the model is the leader's `DistributedModel`
  (engine/ranks/rounds.py), every rank replaying its own CUDA graphs in the rounds; not with a
  DFLASH drafter, whose taps are the leader's alone;
- CUDA graphs (cuda_graph.py): CUDA only, unless `--disable-cuda-graph`;
- the fused decode step (fused_step.py) over the torch kernels on one rank, unless
  `--disable-fused-decode`; its native layers (native.py) unless `--disable-native-decode` or
  `--enable-torch-compile`; with ranks on one CPU node (--tp, --ep, DP attention; not context
  parallel), every rank's native layers over its shard where every rank built them
  (`rank_native`, which the followers call too);
- the speculative shape the runner must hold room for: K drafts per verify and a DFLASH
  drafter's tapped layers (read from its config; spec/ builds the drafter itself).
"""

from __future__ import annotations

import logging
from typing import NamedTuple

import torch

from dsaserve.args import ServerArgs
from dsaserve.dflash_args import dflash_settings
from dsaserve.distributed.parallel_state import ParallelState
from dsaserve.engine.decode.cuda_graph import CudaGraphRunner
from dsaserve.engine.decode.fused_step import DecodeStep
from dsaserve.engine.decode.runner import ModelRunner
from dsaserve.engine.kvcache.prefix_cache import PrefixCache
from dsaserve.engine.ranks.rounds import DistributedModel, RankRunner
from dsaserve.engine.scheduler import Scheduler, SchedulerConfig
from dsaserve.engine.shard import Shard
from dsaserve.engine.startup import max_running, release_free_heap
from dsaserve.models.dflash_config import DFlashConfig

logger = logging.getLogger(__name__)


class SpecShape(NamedTuple):
    """What speculation asks of the runner: drafts per verify, tapped layers, a drafter."""

    drafts: int
    taps: tuple[int, ...] = ()
    drafter: bool = False


class Built(NamedTuple):
    runner: ModelRunner
    scheduler: Scheduler
    context_length: int
    graphs: CudaGraphRunner | None  # this rank's, wherever they run (the runner or the rounds)


def spec_shape(args: ServerArgs, shard: Shard) -> SpecShape:
    """EAGLE/MTP: K drafts; DFLASH: the block size - 1 drafts over the drafter's target layers
    (--speculative-dflash-block-size, else the checkpoint's)."""
    settings = dflash_settings(args)
    if settings is None:
        return SpecShape(shard.spec_steps)
    config = DFlashConfig.from_dir(settings.draft_path)
    drafts = config.verify_block(settings.block_size) - 1
    return SpecShape(drafts, tuple(config.target_layer_ids), drafter=True)


def build_runner(args: ServerArgs, shard: Shard, cache: PrefixCache,
                 parallel: ParallelState) -> Built:  # fmt: skip
    spec = spec_shape(args, shard)
    running = max_running(args, shard.with_mtp or spec.drafter, shard.device)
    model, rank_runner = shard.model, None
    if parallel.world > 1:
        rank_runner = RankRunner(model, shard.pool.kv_cache, shard.pool.index_cache, parallel,
                                 shard.device)  # fmt: skip
        model = DistributedModel(rank_runner)
        rank_native(args, shard, parallel, rank_runner)
        if args.enable_hierarchical_cache:  # the group repeats the tiers' moves (kvcache/moves.py)
            rank_runner.tiers = cache.moves
    graphs = build_graphs(args, shard, spec, ranks=rank_runner is not None)
    if rank_runner is not None:
        rank_runner.graphs = graphs  # every rank replays its own in the FORWARD rounds
    step = decode_step(args, shard, parallel)
    release_free_heap()  # the copies the decode step's stacks replaced (fused.py `stacked`)
    runner = ModelRunner(model, shard.pool, shard.device, shard.kernels, step,
                         None if rank_runner else graphs)  # fmt: skip
    context = context_length(args, shard, graphs, spec.drafts)
    chunk = args.chunked_prefill_size or (8192 if shard.device.type == "cuda" else 2048)
    config = SchedulerConfig(running, chunk, context, decode_tokens=spec.drafts + 1)
    return Built(runner, Scheduler(config, shard.pool, cache), context, graphs)


def rank_native(args: ServerArgs, shard: Shard, parallel: ParallelState,
                runner: RankRunner) -> None:  # fmt: skip
    """This rank's native decode layers for the all-decode rounds, kept only where every rank
    built its own (a rank on the layered path would leave the others' collectives unanswered):
    each rank's path is gathered (a collective: the leader's build_runner and every follower
    call this once, right after making their RankRunner) and kept for /get_server_info."""
    sizes, step = parallel.sizes, None
    wanted = not (args.disable_native_decode or args.disable_fused_decode)
    if wanted and shard.kernels.eager and parallel.world_shm is not None and sizes.cp == 1:
        dtype = shard.pool.index_cache.dtype
        step = DecodeStep.build(shard.model, enabled=True, compiled=False, cache_dtype=dtype,
                                parallel=parallel)  # fmt: skip
    fused = step.fused if step is not None and step.native is not None else None
    mine = "native" if fused is not None else "layered"
    everyone: list = [mine] * parallel.world
    if parallel.world > 1:  # (a rank runner of one rank: tests/test_runtime.py)
        torch.distributed.all_gather_object(everyone, mine, group=parallel.cpu_group)
    runner.rank_paths = everyone
    runner.native = fused if all(path == "native" for path in everyone) else None
    if mine == "native" and runner.native is None:
        logger.warning("native decode: rank paths %s; every rank runs the layered model",
                       everyone)  # fmt: skip


def build_graphs(args: ServerArgs, shard: Shard, spec: SpecShape,
                 ranks: bool) -> CudaGraphRunner | None:  # fmt: skip
    """This rank's CUDA graphs (they take one scratch page from its pool), built alike by the
    leader and every follower (runtime/follower.py), so their buckets agree. None with ranks and
    a DFLASH drafter: its taps are the leader's alone."""
    if ranks and spec.drafter:
        return None
    running = max_running(args, shard.with_mtp or spec.drafter, shard.device)
    return CudaGraphRunner.build(shard.model, shard.pool, shard.kernels, args.cuda_graph_max_bs,
                                 running, spec.drafts, args.disable_cuda_graph,
                                 spec.taps)  # fmt: skip


def decode_step(args: ServerArgs, shard: Shard, parallel: ParallelState) -> DecodeStep | None:
    """The fused decode step reads the pool and the weights itself: only over the eager torch
    kernels, on one rank (Triton kernels, the ranks: layered). The native layers read an fp32,
    bf16 or FP8 pool; the Python fused path an fp32 one."""
    plain = shard.kernels.eager and parallel.world == 1
    return DecodeStep.build(shard.model, plain and not args.disable_fused_decode,
                            args.enable_torch_compile, native=not args.disable_native_decode,
                            cache_dtype=shard.pool.index_cache.dtype)  # fmt: skip


def context_length(args: ServerArgs, shard: Shard, graphs: CudaGraphRunner | None,
                   drafts: int) -> int:  # fmt: skip
    """--context-length (else the model's), within the pool less the graphs' scratch page and
    the room a verify computes past the last kept token (drafts + 1 tokens)."""
    reserved = shard.pool.page_size if graphs is not None else 0
    limit = args.context_length or shard.config.context_length
    return min(limit, shard.pool.num_tokens - reserved - drafts)

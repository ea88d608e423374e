"""What a spawned rank runs: the rank loop over its model shard, or another group's engine.

A follower (any rank but its attention group's first) builds its shard (engine/shard.py, the
function the leader's `Engine` builds its own with: the same model slice and KV pool layout), then
joins every round until STOP (repeating its leader's HiCache moves on its own host and storage
tiers, when on). Under DP attention the first rank of groups 1..dp-1 is a full engine
(scheduler, KV pool, radix cache) with its own request socket.
"""

from __future__ import annotations

from dsaserve.distributed.parallel_state import ParallelState
from dsaserve.distributed.rendezvous import init_rank
from dsaserve.engine.decode.build import build_graphs, rank_native, spec_shape
from dsaserve.engine.kvcache.build import build_rank_tiers
from dsaserve.engine.ranks.rounds import RankRunner
from dsaserve.engine.shard import build_shard
from dsaserve.engine.startup import pick_device
from dsaserve.runtime import heartbeat
from dsaserve.runtime.engine_process import run_group_leader
from dsaserve.runtime.ranks import RankJob, rank_threads, share_paths


def run_rank(job: RankJob) -> int:
    device = pick_device(job.args.device)
    parallel = init_rank(job.args, job.rank, job.where, device.type)
    if job.args.node_rank > 0:  # node 0's /health hears of it through the store
        heartbeat.beat_to_store(parallel.store, job.rank)
    paths = share_paths(parallel, job.paths)
    rank_threads(job.args, parallel)
    if parallel.is_leader:  # another DP-attention group's scheduler
        return run_group_leader(job.args, paths, parallel, job.factory)
    runner = follower_runner(job.args, parallel)
    runner.follow()
    if runner.tiers is not None:
        runner.tiers.finish()
    return 0


def follower_runner(args, parallel: ParallelState) -> RankRunner:
    """This rank's shard behind the rank rounds (with its own decode graphs, built as its
    leader's Engine builds them: the same buckets, the scratch slot on the same first page)."""
    shard = build_shard(args, parallel, show_progress=False)
    pool = shard.pool
    runner = RankRunner(shard.model, pool.kv_cache, pool.index_cache, parallel, shard.device)
    rank_native(args, shard, parallel, runner)
    runner.graphs = build_graphs(args, shard, spec_shape(args, shard), ranks=True)
    if args.enable_hierarchical_cache:  # its own host and storage tiers, its leader's moves
        runner.tiers = build_rank_tiers(args, pool, shard.dtype, shard.with_mtp, parallel)
    return runner

"""What `dsaserve serve` drives: the engine in its `--disaggregation-mode` role (none, prefill,
decode). `serving_engine` is the engine process's default EngineFactory."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from dsaserve.args import ServerArgs

if TYPE_CHECKING:  # the API process pickles `serving_engine` for the spawn: it stays light
    from dsaserve.disaggregation.role_engine import Reject
    from dsaserve.distributed.parallel_state import ParallelState


def serving_engine(args: ServerArgs, parallel: ParallelState, reject: Reject) -> Any:
    """The engine on this attention group's ranks, wrapped in its PD role when one is set."""
    from dsaserve.engine.engine import Engine  # the engine process's: the API process has none

    engine = Engine(args, parallel, show_progress=parallel.rank == 0)
    if args.disaggregation_mode == "null":
        return engine
    groups = parallel.sizes.groups
    free_port = not args.disaggregation_bootstrap_port
    if args.disaggregation_mode == "prefill" and groups > 1 and free_port:
        return _prefill_on_a_free_port(engine, args, reject, parallel)
    return wrap(engine, args, reject, parallel.dp_rank, groups)


def _prefill_on_a_free_port(engine: Any, args: ServerArgs, reject: Reject,
                            parallel: ParallelState) -> Any:  # fmt: skip
    """`--disaggregation-bootstrap-port 0` under DP attention: every group registers at group
    0's bootstrap server, so rank 0 makes its role first (binding a free port) and tells every
    rank that port; the others make theirs with it."""
    import torch.distributed as dist

    groups = parallel.sizes.groups
    role = wrap(engine, args, reject, 0, groups) if parallel.rank == 0 else None
    box = [role.bootstrap_port if role else None]
    dist.broadcast_object_list(box, src=0, group=parallel.cpu_group)
    if role is not None:
        return role
    args = dataclasses.replace(args, disaggregation_bootstrap_port=box[0])
    return wrap(engine, args, reject, parallel.dp_rank, groups)


def wrap(engine: Any, args: ServerArgs, reject: Reject, group: int = 0, groups: int = 1) -> Any:
    """`group` of `groups`: the attention group this engine is (DP attention), for a prefill."""
    if args.disaggregation_mode == "prefill":
        from dsaserve.disaggregation.prefill import PrefillEngine

        return PrefillEngine(engine, args, reject, group, groups)
    from dsaserve.disaggregation.decode import DecodeEngine

    return DecodeEngine(engine, args, reject)

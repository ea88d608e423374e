"""`build_spec`: the speculative decoder the flags ask for, behind one interface (`Speculator`):
EAGLE / NEXTN over the checkpoint's MTP layer (eagle.py), or `--speculative-algorithm DFLASH`'s
block drafter (dflash.py; its drafter loaded and checked against the target here). Both verify
and accept the same way (verify.py). A new drafter is a `Speculator` built here."""

from __future__ import annotations

from typing import Protocol

from dsaserve.args import ServerArgs
from dsaserve.dflash_args import dflash_settings
from dsaserve.engine.decode.runner import ModelRunner
from dsaserve.engine.sampler import Sampler
from dsaserve.engine.scheduler import ScheduledBatch
from dsaserve.engine.shard import Shard
from dsaserve.engine.spec.dflash_load import build_decoder, load_dflash
from dsaserve.engine.spec.eagle import EagleDecoder
from dsaserve.engine.spec.report import SpecReport
from dsaserve.engine.spec.verify import Append


class Speculator(Protocol):
    """One engine step with drafting and verification; `report` counts its acceptance."""

    report: SpecReport

    def step(self, scheduled: ScheduledBatch, sampler: Sampler, append: Append) -> None: ...


def build_spec(args: ServerArgs, runner: ModelRunner, shard: Shard) -> Speculator | None:
    """The step decoder of --speculative-algorithm (None: none). `runner` is the target's."""
    settings = dflash_settings(args)
    if settings is not None:
        drafter = load_dflash(settings, shard.config, shard.dtype, shard.device)
        return build_decoder(runner, drafter, shard.kernels, shard.pool.num_tokens, settings,
                             native=not args.disable_native_decode)  # fmt: skip
    if shard.with_mtp:
        share = shard.config.index_share_for_mtp_iteration
        return EagleDecoder(runner.model, runner, shard.spec_steps, share)
    return None

"""`wrap(engine, args, reject)`: the engine in its `--disaggregation-mode` role."""

from __future__ import annotations

from typing import Any

from dsaserve.args import ArgsError, ServerArgs
from dsaserve.disaggregation.common import Reject


def wrap(engine: Any, args: ServerArgs, reject: Reject) -> Any:
    if not hasattr(engine, "pool"):
        raise ArgsError("--disaggregation-mode needs the real engine (not a scripted one)")
    if args.disaggregation_mode == "prefill":
        from dsaserve.disaggregation.prefill import PrefillEngine

        return PrefillEngine(engine, args, reject)
    from dsaserve.disaggregation.decode import DecodeEngine

    return DecodeEngine(engine, args, reject)

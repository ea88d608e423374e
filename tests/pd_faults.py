"""PD fault injection, the test side of `dsaserve/disaggregation/transfer/base.py`'s `WRITE_HOOK`
seam. `FaultyEngineFactory` installs a `ControlledFaults` hook in each engine process (and each
DP-attention group leader rank) before it builds the engine as `dsaserve serve` does; the hook
reads its mode from a control file the test rewrites while the server runs:

- "" (or no file): no fault.
- "transfer": every write fails.
- "pause": before a room's aux write (its KV is already written) the writer writes "PID ROOM" to
  CONTROL.paused and waits until the mode changes (a test kills it there, or releases it).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PAUSE_POLL_S = 0.05


@dataclass(frozen=True)
class ControlledFaults:
    """The write hook: called before every write with its tag (b"" for KV, the room id for aux)."""

    control: str

    def mode(self) -> str:
        try:
            return Path(self.control).read_text().strip()
        except OSError:
            return ""

    def __call__(self, tag: bytes) -> None:
        from dsaserve.disaggregation.transfer.base import TransferError

        mode = self.mode()
        if mode == "transfer":
            raise TransferError("fault injection: the transfer engine is broken on purpose")
        if mode == "pause" and tag:  # the room's aux write: its KV went in the write before
            Path(self.control + ".paused").write_text(f"{os.getpid()} {int(tag)}")
            while self.mode() == "pause":  # the marker lets the test act at exactly this point
                time.sleep(PAUSE_POLL_S)


@dataclass(frozen=True)
class FaultyEngineFactory:
    """The engine process's EngineFactory (runtime/engine_process.py) with the hook installed
    first; picklable, for the spawn and for the ranks."""

    control: str

    def __call__(self, args: Any, parallel: Any, reject: Any) -> Any:
        from dsaserve.disaggregation import roles
        from dsaserve.disaggregation.transfer import base

        base.WRITE_HOOK = ControlledFaults(self.control)
        return roles.serving_engine(args, parallel, reject)

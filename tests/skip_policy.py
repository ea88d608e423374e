"""What may skip: only tests that need hardware this machine lacks, named by a marker.

A test that needs hardware carries its marker (`@pytest.mark.gpu`); this plugin skips it where
the hardware is missing, so no test writes its own hardware check. Every skip of the run is
printed in one line at the end, with its reason. In CI (`CI` set) a test that skips without a
hardware marker fails the run: a missing package, browser or library is an install step to add
to scripts/install.sh, not a skip nobody sees.

Tests marked `nightly` (long runs: the fuzz at nightly size, the compiled decode step) are left
out unless `--nightly` is given; the end line counts them too.
"""

from __future__ import annotations

import os
import platform
from collections.abc import Callable
from typing import NamedTuple

import pytest

HARDWARE: dict[str, tuple[str, Callable[[], bool]]] = {
    "gpu": ("needs a CUDA device", lambda: _cuda()),
    "x86_64": ("needs an x86-64 CPU", lambda: platform.machine() in ("x86_64", "AMD64")),
}


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() not in ("", "0", "false", "no")


def add_options(parser: pytest.Parser) -> None:
    parser.addoption(
        "--nightly", action="store_true", help="also the tests marked nightly (long fuzz, compile)"
    )


class Skip(NamedTuple):
    nodeid: str
    reason: str
    hardware: bool  # the test carries a HARDWARE marker


class SkipPolicy:
    """The pytest plugin (registered by tests/conftest.py)."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self.skips: list[Skip] = []
        self.nightly = 0
        for name, (reason, _) in HARDWARE.items():
            config.addinivalue_line("markers", f"{name}: {reason} (skipped without it)")
        config.addinivalue_line("markers", "nightly: long runs, only with --nightly")

    def pytest_collection_modifyitems(self, items: list[pytest.Item]) -> None:
        """Skip hardware tests where the hardware is missing; leave nightly ones out without
        --nightly (deselected, and counted in the end line)."""
        present = {name: check() for name, (_, check) in HARDWARE.items()}
        kept, nightly = [], []
        for item in items:
            if item.get_closest_marker("nightly") and not self.config.getoption("--nightly"):
                nightly.append(item)
                continue
            kept.append(item)
            for name, (reason, _) in HARDWARE.items():
                if item.get_closest_marker(name) and not present[name]:
                    item.add_marker(pytest.mark.skip(reason=f"{reason} [{name}]"))
        if nightly:
            self.config.hook.pytest_deselected(items=nightly)
            items[:] = kept
            self.nightly = len(nightly)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if not report.skipped or hasattr(report, "wasxfail"):
            return
        longrepr = report.longrepr
        reason = longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)
        hardware = any(name in report.keywords for name in HARDWARE)
        self.skips.append(Skip(report.nodeid, reason.removeprefix("Skipped: "), hardware))

    def outside_hardware(self) -> list[Skip]:
        return [skip for skip in self.skips if not skip.hardware]

    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if hasattr(self.config, "workeroutput"):  # an xdist worker: the controller prints the line
            self.config.workeroutput["nightly"] = self.nightly
        if in_ci() and self.outside_hardware() and session.exitstatus == 0:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    @pytest.hookimpl(optionalhook=True)
    def pytest_testnodedown(self, node, error) -> None:
        """An xdist worker's count (each worker collects every test, so each counts them all)."""
        self.nightly = max(self.nightly, getattr(node, "workeroutput", {}).get("nightly", 0))

    def pytest_terminal_summary(self, terminalreporter) -> None:
        listed = "; ".join(f"{s.nodeid} ({s.reason})" for s in self.skips) or "none"
        tail = f"; {self.nightly} nightly test(s) not run (--nightly)" if self.nightly else ""
        terminalreporter.write_line(f"skipped {len(self.skips)}: {listed}{tail}")
        bad = self.outside_hardware()
        if bad and in_ci():
            terminalreporter.write_line(
                f"CI FAILS: {len(bad)} test(s) skipped for something other than missing hardware "
                f"({', '.join(HARDWARE)}): install what they need (scripts/install.sh) or make "
                "them fail", red=True)  # fmt: skip

"""Shared server fixtures: one tiny checkpoint per session and one main server per session.

Other test files may keep their own fixtures in their own modules; these only start processes
when a test asks for them.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import skip_policy
import triton_env  # noqa: F401  (first: TRITON_INTERPRET=1 on CPU before anything imports triton)
import worker_threads  # noqa: F401  (before torch: one thread per xdist worker)
from server_harness import (
    Server,
    make_server_checkpoint,
    readme_block,
    running_command,
    running_server,
    write_scripts,
)

THINK_TOOL = (
    "The user wants the weather.</think>Let me check.<tool_call>get_weather"
    "<arg_key>location</arg_key><arg_value>Beijing</arg_value>"
    "<arg_key>days</arg_key><arg_value>3</arg_value></tool_call>"
)
SCRIPTS = {
    "weather": {"text": THINK_TOOL, "chunk": 3},
    "parallel": {"text": "Two calls.</think><tool_call>get_weather<arg_key>location</arg_key>"
                 "<arg_value>Paris</arg_value></tool_call><tool_call>get_time</tool_call>",
                 "chunk": 2},
    "answer": {"text": "Reasoning here.</think>The answer is 42.", "chunk": 4},
    "nothink": {"text": "Just the answer, no thinking.", "chunk": 5},
    "stopseq": {"text": "</think>count: one two STOP three", "chunk": 3},
    "unknown": {"text": "</think><tool_call>rm_rf<arg_key>path</arg_key><arg_value>/"
                "</arg_value></tool_call>Done.", "chunk": 4},
    "typed": {"text": "</think><tool_call>lookup<arg_key>order_id</arg_key><arg_value>12345"
              "</arg_value><arg_key>count</arg_key><arg_value>7</arg_value><arg_key>express"
              "</arg_key><arg_value>true</arg_value></tool_call>", "chunk": 1},
    "long": {"text": "</think>" + " ".join(f"w{i}" for i in range(3000)), "chunk": 2,
             "delay": 0.005},  # runs for a minute unless the client goes away
}  # fmt: skip
MAX_REQUEST_BYTES = 200_000


# ---- what may skip: hardware only, and one line listing every skip (tests/skip_policy.py) ----


def pytest_addoption(parser: pytest.Parser) -> None:
    skip_policy.add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    config.pluginmanager.register(skip_policy.SkipPolicy(config), "dsaserve-skip-policy")


# The files that take longest (a serial run's --durations), longest first: pyproject's `-n 2
# --dist loadfile` hands files out in collection order, so these start early and the run does
# not end on one of them alone. Only the order changes; every file still runs.
LONGEST_FIRST = (
    "test_parallel_serve", "test_native_build", "test_hicache_parallel", "test_hub",
    "test_dflash_server", "test_pd_router", "test_responses_embedded", "test_pd_failures",
    "test_server_lifecycle", "test_cuda_graph_decode", "test_console_browser",
    "test_structured_invariant", "test_plan_commands_serve", "test_default_model",
)  # fmt: skip


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: index for index, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.stem, len(rank)))


@pytest.fixture(scope="session")
def server_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_server_checkpoint(tmp_path_factory.mktemp("server_ckpt"))


@pytest.fixture(scope="session")
def scripts_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_scripts(tmp_path_factory.mktemp("scripts"), SCRIPTS)


@pytest.fixture(scope="session")
def main_server(server_checkpoint: Path, scripts_path: Path) -> Iterator[Server]:
    """The real engine (random weights) plus scripted outputs for `[[script:KEY]]` prompts."""
    flags = ["--enable-metrics", "--enable-cache-report", "--served-model-name", "glm-test",
             "--max-request-bytes", str(MAX_REQUEST_BYTES)]  # fmt: skip
    with running_server(server_checkpoint, *flags, scripts=scripts_path) as server:
        yield server


@pytest.fixture(scope="session")
def readme_server() -> Iterator[Server]:
    """The README's own start, shared by the tests that chat with the embedded model: its command
    run as written through the installed `dsaserve` console script, with only `--port 0` added,
    and the environment a user has (the default page size, the memory-sized KV pool, the default
    `--threads`)."""
    argv = shlex.split(readme_block("Start the server on the embedded default model"))
    assert argv == ["dsaserve", "serve"], argv
    script = Path(sys.executable).with_name("dsaserve")  # the console script pip installed
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    with running_command([str(script), *argv[1:], "--port", "0"], env) as server:
        yield server

"""The two servers of the side-by-side benchmark, and the checkpoint they share.

`dsaserve serve` and `transformers serve` (the reference peer) each run as a subprocess in its own
process group, on the same checkpoint folder, with the same thread count; `running` always stops
the whole group (API process, engine, workers) when its block exits.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import NamedTuple

import httpx

from dsaserve.assets import default_model_path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from server_harness import group_members, stop_group  # noqa: E402, F401  (one process-group stopper)

DSASERVE_READY = re.compile(r"dsaserve ready: (http://\S+)")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")


def default_model_config(vocab_size: int, eos_ids: list[int]) -> dict:
    """The embedded model's architecture, as in scripts/train_default_model.py (no MTP layer)."""
    return dict(
        vocab_size=vocab_size, hidden_size=192, intermediate_size=512, moe_intermediate_size=192,
        num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=4, n_shared_experts=1,
        n_routed_experts=8, num_experts_per_tok=2, routed_scaling_factor=2.5, kv_lora_rank=64,
        q_lora_rank=128, qk_rope_head_dim=16, qk_nope_head_dim=32, v_head_dim=32, n_group=1,
        topk_group=1, norm_topk_prob=True, max_position_embeddings=65536, rms_norm_eps=1e-5,
        first_k_dense_replace=1, index_topk=64, index_head_dim=32, index_n_heads=8,
        rope_parameters={"rope_theta": 8000000.0, "rope_type": "default"},
        tie_word_embeddings=False, bos_token_id=None, eos_token_id=eos_ids,
        pad_token_id=eos_ids[0],
    )  # fmt: skip


def has_weights(folder: Path) -> bool:
    return (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))


def prepare_checkpoint(model_path: str | None, scratch: Path, **overrides) -> tuple[Path, str]:
    """The folder to serve and how it was chosen ("given", "embedded" or "random").

    Without `--model-path`, the embedded model when its weights exist, else a random checkpoint
    of its architecture with its tokenizer, template and generation config.
    """
    if model_path:
        return Path(model_path), "given"
    embedded = default_model_path()
    if has_weights(embedded) and not overrides:
        return embedded, "embedded"
    return make_random_checkpoint(embedded, scratch / "random-default-model", **overrides), "random"


def make_random_checkpoint(source: Path, folder: Path, **overrides) -> Path:
    """Random GlmMoeDsaForCausalLM weights (fp32) with `source`'s tokenizer files."""
    import torch
    from transformers import AutoTokenizer, GlmMoeDsaConfig, GlmMoeDsaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    for name in TOKENIZER_FILES:
        shutil.copy(source / name, folder / name)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    eos = json.loads((source / "generation_config.json").read_text())["eos_token_id"]
    eos_ids = eos if isinstance(eos, list) else [eos]
    config = GlmMoeDsaConfig(**{**default_model_config(len(tokenizer), eos_ids), **overrides})
    torch.manual_seed(0)
    GlmMoeDsaForCausalLM(config).to(torch.float32).eval().save_pretrained(folder)
    shutil.copy(source / "generation_config.json", folder / "generation_config.json")
    return folder


@dataclass
class Server:
    """A started server: its URL, process (group leader) and the tail of its log."""

    name: str
    url: str
    process: subprocess.Popen
    log: list[str] = field(default_factory=list)

    def output(self, lines: int = 60) -> str:
        return "".join(self.log[-lines:])


def free_port() -> int:
    """A port the OS says is free now (for servers that cannot report a port-0 bind)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_env(threads: int) -> dict[str, str]:
    return {**os.environ, "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": str(threads),
            "MKL_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}  # fmt: skip


def dsaserve_command(model: Path, extra: list[str], dtype: str = "float32") -> list[str]:
    return [sys.executable, "-m", "dsaserve.cli", "serve", "--model-path", str(model),
            "--host", "127.0.0.1", "--port", "0", "--dtype", dtype, *extra]  # fmt: skip


def peer_command(model: Path, port: int) -> list[str]:
    exe = shutil.which("transformers") or "transformers"
    return [exe, "serve", str(model), "--host", "127.0.0.1", "--port", str(port),
            "--device", "cpu", "--dtype", "float32", "--log-level", "warning"]  # fmt: skip


def peer_available() -> bool:
    """Whether `transformers serve` can start here (CLI, serving extras, and accelerate, which
    it needs to place a model on `--device cpu`)."""
    try:
        from transformers.utils.import_utils import is_serve_available
    except ImportError:
        return False
    found = shutil.which("transformers") is not None and is_serve_available()
    return found and importlib.util.find_spec("accelerate") is not None


class ServerSpec(NamedTuple):
    """What to start. With `url`, readiness is `GET {url}/health` answering 200; without, the
    dsaserve ready line (which carries the URL of its port-0 bind)."""

    name: str
    command: list[str]
    url: str | None = None


@contextlib.contextmanager
def running(specs: list[ServerSpec], env: dict, timeout: float) -> Iterator[list[Server]]:
    """Start every server (each in its own process group) at once, wait until all serve, and
    always stop every group when the block exits."""
    started: list[Server] = []
    try:
        events = []
        for spec in specs:
            process = subprocess.Popen(
                spec.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env,
                text=True, start_new_session=True,
            )  # fmt: skip
            started.append(Server(spec.name, spec.url or "", process))
            events.append(_pump_log(started[-1]))
        for server, ready_line in zip(started, events, strict=True):
            server.url = _wait_ready(server, ready_line, timeout)
        yield started
    finally:
        for server in started:
            stop_group(server.process)


def _pump_log(server: Server) -> threading.Event:
    ready = threading.Event()

    def pump() -> None:
        for line in server.process.stdout:
            server.log.append(line)
            match = DSASERVE_READY.search(line)
            if match and not server.url:
                server.url = match.group(1)
                ready.set()
        ready.set()

    threading.Thread(target=pump, daemon=True, name=f"log-{server.name}").start()
    return ready


def _wait_ready(server: Server, ready_line: threading.Event, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if server.process.poll() is not None:
            break
        if server.url and _healthy(server.url):
            return server.url
        ready_line.wait(0.5)
    raise RuntimeError(f"{server.name} did not start in {timeout:.0f}s:\n{server.output()}")


def _healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=2.0).status_code == 200
    except httpx.HTTPError:
        return False

"""A start whose weights cannot fit is refused before any weight file is opened: exit 2, one line
naming the bytes needed and available and a `dsaserve plan` line that fits; the count it uses is
the one the loader reports holding after a real load (runtime/memory_fit.py)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import torch
from server_harness import HANG_GUARD_S
from transformers import GlmMoeDsaConfig

from dsaserve.args import ServerArgs
from dsaserve.deploy.models import _GLM5
from dsaserve.distributed.parallel_state import ParallelState
from dsaserve.engine.shard import held_weight_bytes, load_model
from dsaserve.model_config import ModelConfig
from dsaserve.plan_cli import main as plan_main
from dsaserve.runtime.memory_fit import host_available

ACCOUNT = re.compile(
    r"does not fit: (\d+) bytes \(.* GiB\) needed \(1 rank\(s\) x \((\d+) weights \+ (\d+) KV "
    r"pool\)\), (\d+) bytes \(.* GiB\) of host memory available; this fits: (dsaserve plan [^(]+)"
)


def glm53_without_weights(folder: Path) -> Path:
    """GLM-5.3's config (bf16: ~1.5 TB of weights) and an index claiming its shards, which are
    not there."""
    sizes = {k: v for k, v in _GLM5.items() if k != "model_type"}
    GlmMoeDsaConfig(**sizes, dtype="bfloat16").save_pretrained(folder)
    shards = {f"model.layers.{i}.mlp.gate.weight": f"model-{i + 1:05d}-of-00078.safetensors"
              for i in range(78)}  # fmt: skip
    index = {"metadata": {"total_size": 1_488_058_404_864}, "weight_map": shards}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def serve(folder: Path, *flags: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "dsaserve.cli", "serve", "--model-path", str(folder),
               "--port", "0", "--device", "cpu", *flags]  # fmt: skip
    # hang guard
    return subprocess.run(command, capture_output=True, text=True, timeout=HANG_GUARD_S)


def test_a_model_over_the_host_is_refused_before_loading(tmp_path: Path) -> None:
    folder = glm53_without_weights(tmp_path / "GLM-5.3-BF16")
    run = serve(folder)
    assert run.returncode == 2, run.stderr
    errors = [line for line in run.stderr.splitlines() if "error" in line]
    assert len(errors) == 1 and "Traceback" not in run.stderr, run.stderr
    match = ACCOUNT.search(errors[0])
    assert match, errors[0]
    needed, weights, kv, available = map(int, match.groups()[:4])
    assert needed == weights + kv and weights > 1300 * 2**30  # bf16 GLM-5.3 (~1.4 TB), one rank
    assert needed > available and abs(available - host_available()) < available // 2
    plan_line = shlex.split(match.group(5))
    assert plan_line[:2] == ["dsaserve", "plan"]
    assert plan_main(plan_line[2:]) == 0  # the line it names plans (fits)
    skipped = serve(folder, "--skip-memory-check")  # goes on, to the tokenizer (there is none)
    assert skipped.returncode == 2 and "does not fit" not in skipped.stderr, skipped.stderr
    assert "cannot load the tokenizer" in skipped.stderr, skipped.stderr


def test_the_fit_counts_what_the_loader_holds(server_checkpoint: Path) -> None:
    for dtype in ("float32", "bfloat16"):
        args = ServerArgs(model_path=str(server_checkpoint), dtype=dtype, device="cpu")
        parallel, cpu = ParallelState.single(), torch.device("cpu")
        predicted = held_weight_bytes(args, parallel, cpu)
        config = ModelConfig.from_hf(args.model_path)
        model = load_model(args, config, getattr(torch, dtype), cpu, False, parallel, False)
        tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
        persistent = dict(model.state_dict(keep_vars=True))
        held = sum(t.numel() * t.element_size() for t in tensors.values()
                   if any(t is p for p in persistent.values()))  # fmt: skip
        assert predicted == held, dtype


# What a start's fit runs (runtime/memory_fit.py), in a fresh process: which torch._dynamo
# modules it imported
FIT_IMPORTS = """
import sys
from dsaserve.args import ServerArgs
from dsaserve.runtime.memory_fit import memory_need
memory_need(ServerArgs(model_path=sys.argv[1], device="cpu", max_total_tokens=4096))
print(sorted(m for m in sys.modules if m.startswith("torch._dynamo")))
"""


def test_the_fit_does_not_import_torch_dynamo(server_checkpoint: Path) -> None:
    """Every start builds the fit's meta model; none of it imports torch._dynamo, 2 s of a
    start's imports (nn.Embedding's normal_ on the meta device runs through torch's Python refs:
    layers/linear.py VocabParallelEmbedding.reset_parameters skips it there)."""
    run = subprocess.run([sys.executable, "-c", FIT_IMPORTS, str(server_checkpoint)],
                         capture_output=True, text=True, timeout=HANG_GUARD_S)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]", run.stdout

"""The GPU check's rank part: CUDA-graph decode under `--tp 2` (engine/decode/cuda_graph.py:
every rank replays its own graph in the rank rounds, NCCL all-reduces captured inside). A tiny
random GLM checkpoint with an MTP layer, EAGLE on, three prompts (one padded row in bucket 4):
greedy tokens with graphs must equal `--disable-cuda-graph` on the same two GPUs, with graphs
captured. Needs two CUDA devices (NCCL refuses two ranks on one); with fewer it reports why it
did not run.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
PROMPTS = [[5, 9, 13], list(range(20, 29)), list(range(40, 80))]
NEW_TOKENS = 16


def run_rank_graphs() -> dict:
    """{"name", "ok" (None: not run), "detail"}."""
    name = "tp2 CUDA-graph decode equals eager"
    if torch.cuda.device_count() < 2:
        return {"name": name, "ok": None, "detail": "needs 2 CUDA devices"}
    from speculative_models import make_mtp_checkpoint  # tests/: transformers builds it

    from dsaserve import LLM, SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    args = dict(tp_size=2, device="cuda", dtype="bfloat16", page_size=16,
                max_total_tokens=4096, speculative_algorithm="EAGLE",
                speculative_num_steps=2)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        folder = str(make_mtp_checkpoint(Path(tmp) / "ckpt", "glm", 0))
        outputs = {}
        for graphs in (False, True):
            with LLM(folder, disable_cuda_graph=not graphs, **args) as llm:
                outputs[graphs] = [o.token_ids for o in llm.generate(PROMPTS, params,
                                                                      use_tqdm=False)]  # fmt: skip
                stats = llm.engine.stats()["cuda_graph"]
    same = outputs[True] == outputs[False]
    ok = same and stats is not None and stats["captured"] > 0 and stats["steps"] > 0
    return {"name": name, "ok": ok, "detail": f"tokens equal: {same}; graphs: {stats}"}

"""Helpers for the tie-break tests: an independent "earlier position wins" top-k patched into the
transformers reference (in the test, never in the library), and logprob extraction.

The reference rule is a full stable sort, written without `dsaserve.kernels.topk`, so the engine's
O(length) trick is checked against the plain definition.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import pytest
import torch
from transformers.models.deepseek_v32.modeling_deepseek_v32 import DeepseekV32Indexer
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaIndexer

from dsaserve import LLM, SamplingParams

TOP_N = 5  # alternatives compared at every step, besides the chosen token


def stable_topk(scores: torch.Tensor, k: int, dim: int = -1, largest: bool = True,
                sorted: bool = True):  # noqa: A002 (torch.Tensor.topk's signature)  # fmt: skip
    """torch.topk with equal values ordered by position (a stable descending sort)."""
    if not largest:
        raise NotImplementedError("only largest=True is used by the indexers")
    order = torch.sort(scores, dim=dim, descending=True, stable=True).indices.narrow(dim, 0, k)
    return torch.return_types.topk((scores.gather(dim, order), order))


def _with_stable_topk(forward: Callable) -> Callable:
    @functools.wraps(forward)
    def patched(*args, **kwargs):
        plain = torch.Tensor.topk
        torch.Tensor.topk = stable_topk
        try:
            return forward(*args, **kwargs)
        finally:
            torch.Tensor.topk = plain

    return patched


def patch_reference_tie_break(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make both transformers indexers keep the earlier position among equal scores."""
    for cls in (GlmMoeDsaIndexer, DeepseekV32Indexer):
        monkeypatch.setattr(cls, "forward", _with_stable_topk(cls.forward))


def params(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=TOP_N,
                          **kw)  # fmt: skip


def logprob_table(output) -> torch.Tensor:
    """[steps, 1 + TOP_N] float64: the chosen token's logprob, then the top alternatives'."""
    return torch.tensor(
        [[lp.logprob, *[v for _, v in lp.top]] for lp in output.logprobs], dtype=torch.float64
    )


def generate(llm: LLM, prompts: list[list[int]], max_tokens: int, **kw) -> list:
    return llm.generate(prompts, params(max_tokens, **kw), use_tqdm=False)


@torch.no_grad()
def reference_table(reference, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """What logprob_table must read, from one full forward of prompt + tokens (each step's row
    sees exactly its prefix, so this is every decode step recomputed from scratch)."""
    logits = reference(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1]
    logp = logits.double().log_softmax(-1)
    chosen = logp.gather(1, torch.tensor(tokens)[:, None])
    return torch.cat([chosen, logp.topk(TOP_N, dim=-1).values], dim=1)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max())

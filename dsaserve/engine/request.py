"""`Req`: one completion moving through the engine (waiting -> running -> finished)."""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any

import torch

from dsaserve.engine.detokenizer import IncrementalDetokenizer
from dsaserve.engine.kvcache.radix import TreeNode
from dsaserve.engine.messages import RequestOutput, TokenLogprob
from dsaserve.engine.sampler import SamplingState
from dsaserve.sampling_params import SamplingParams

_arrival = itertools.count()


@dataclass(eq=False)
class Req:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    sampling: SamplingState
    detok: IncrementalDetokenizer
    stream: bool = True
    order: int = field(default_factory=lambda: next(_arrival))
    kv_len: int = 0  # tokens of fill_ids whose KV is in the pool
    pages: list[int] = field(default_factory=list)
    slots: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    prefix_node: TreeNode | None = None
    cached_tokens: int | None = None  # set at first admission
    finish_reason: dict | None = None
    error: str | None = None  # why the request was refused after admission (a 400)
    # what the next RequestOutput will carry
    pending_ids: list[int] = field(default_factory=list)
    pending_text: str = ""
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    # speculative decoding: the next round's first draft, and counters for reporting
    spec_draft: Any = None  # speculative.Draft
    spec_verify_ct: int = 0
    spec_correct_drafts: int = 0
    spec_proposed_drafts: int = 0

    @property
    def output_ids(self) -> list[int]:
        return self.sampling.output_ids

    @property
    def fill_ids(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    @property
    def fill_len(self) -> int:
        """len(fill_ids), without building the list."""
        return len(self.prompt_ids) + len(self.sampling.output_ids)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def finish(self, kind: str, matched: int | str | None = None) -> None:
        if self.finish_reason is None:
            self.finish_reason = {"type": kind, "matched": matched}
            tail = self.detok.flush()
            # cut by the limit inside a character: that character was never written
            self.pending_text += tail.rstrip("\ufffd") if kind == "length" else tail

    def append(
        self, token: int, logprob: TokenLogprob | None, eos_ids: list[int], context: int
    ) -> None:
        """Take one sampled token, and finish on a stop string or token, EOS (unless
        ignore_eos), a completed grammar, max_tokens or the context length."""
        self.sampling.append(token)
        self.pending_ids.append(token)
        if logprob is not None:
            self.pending_logprobs.append(logprob)
        text, matched = self.detok.push([token])
        self.pending_text += text
        params, n_out = self.params, len(self.output_ids)
        if matched is not None:
            self.finish("stop", matched)
        elif token in params.stop_token_ids:
            self.finish("stop", token)
        elif token in eos_ids and not params.ignore_eos:
            self.finish("stop", token)
        elif self.sampling.grammar is not None and self.sampling.grammar.terminated:
            self.finish("stop", token)  # the grammar is complete (it accepted a stop token)
        elif params.max_tokens is not None and n_out >= params.max_tokens:
            self.finish("length")
        elif len(self.prompt_ids) + n_out >= context:
            self.finish("length")

    def fail(self, message: str, status: int = 500) -> None:
        """End with an error for this request alone (the engine keeps serving the others)."""
        if self.finish_reason is None:
            self.finish_reason = {"type": "error", "matched": None, "message": message[:500],
                                  "status": status}  # fmt: skip

    def take_output(self) -> RequestOutput:
        out = RequestOutput(
            rid=self.rid,
            token_ids=self.pending_ids,
            text=self.pending_text,
            finished=self.finished,
            finish_reason=self.finish_reason,
            prompt_tokens=len(self.prompt_ids),
            completion_tokens=len(self.output_ids),
            cached_tokens=self.cached_tokens or 0,
            error=self.error,
            logprobs=self.pending_logprobs if self.params.logprobs is not None else None,
            **self._spec_report(),
        )
        self.pending_ids, self.pending_text, self.pending_logprobs = [], "", []
        return out

    def _spec_report(self) -> dict:
        """SGLang's meta_info fields: accept length = completion tokens per verify step."""
        if not self.spec_verify_ct:
            return {}
        proposed = self.spec_proposed_drafts
        return {
            "spec_verify_ct": self.spec_verify_ct,
            "spec_accept_length": len(self.output_ids) / self.spec_verify_ct,
            "spec_accept_rate": self.spec_correct_drafts / proposed if proposed else 0.0,
            "spec_num_correct_drafts": self.spec_correct_drafts,
            "spec_num_proposed_drafts": proposed,
        }

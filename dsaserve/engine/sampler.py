"""Token sampling for one engine step: penalties, min_tokens, greedy / filtered random draws.

Order per row (SGLang/vLLM/OpenAI conventions): repetition penalty (HF style, prompt + output),
frequency and presence penalties (OpenAI style, output only), min_tokens masking, then either
argmax (greedy) or temperature → top-k → top-p → min-p and an inverse-CDF draw from one
uniform per row. A row whose request has an active grammar (structured output) is masked to the
tokens the grammar allows before any of that (`dsaserve.grammar.bitmask`); the other rows are not
touched. Logprobs always come from the raw logits.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from dsaserve.engine.messages import TokenLogprob
from dsaserve.grammar.bitmask import Filled, apply_grammars, constrained_rows
from dsaserve.grammar.state import GrammarState
from dsaserve.sampling_params import SamplingParams

_MASK64 = (1 << 64) - 1
_NUCLEUS_CANDIDATES = 256


def step_seed(seed: int, step: int) -> int:
    """A well-mixed 63-bit generator seed for draw number `step` of a request seeded `seed`."""
    x = (seed * 0x9E3779B97F4A7C15 + step + 1) & _MASK64  # splitmix64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 1


class SamplingState:
    """Sampling state of one request: resolved params, output so far, precomputed masks."""

    def __init__(
        self,
        params: SamplingParams,
        prompt_ids: list[int],
        vocab_size: int,
        eos_token_ids: list[int],
    ) -> None:
        if params.temperature is None or params.top_p is None or params.top_k is None:
            raise ValueError("SamplingState needs resolved params: call params.with_defaults()")
        self.params = params
        self.vocab_size = vocab_size
        self.eos_token_ids = list(eos_token_ids)
        self.output_ids: list[int] = []
        self.has_penalties = (
            params.repetition_penalty != 1.0
            or params.frequency_penalty != 0.0
            or params.presence_penalty != 0.0
        )
        in_vocab = lambda ids: sorted({t for t in ids if 0 <= t < vocab_size})
        self.min_tokens_block = in_vocab([*self.eos_token_ids, *params.stop_token_ids])
        self._prompt_unique: dict[torch.device, torch.Tensor] = {}
        if params.repetition_penalty != 1.0:
            cpu_ids = torch.tensor(in_vocab(prompt_ids), dtype=torch.long)
            self._prompt_unique[cpu_ids.device] = cpu_ids
        self._out_buf = torch.empty(64 if self.has_penalties else 0, dtype=torch.long)
        self._out_len = 0
        self.grammar: GrammarState | None = None  # set by the engine once compiled

    def append(self, token_id: int) -> None:
        self.output_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)
        if not self.has_penalties:
            return
        if self._out_len == self._out_buf.numel():
            self._out_buf = torch.cat([self._out_buf, torch.empty_like(self._out_buf)])
        self._out_buf[self._out_len] = token_id
        self._out_len += 1

    def output_tensor(self) -> torch.Tensor:
        """Output ids as a CPU long tensor (a view; rebuilt if output_ids was edited directly)."""
        if self._out_len != len(self.output_ids):
            self._out_buf = torch.tensor(self.output_ids + [0], dtype=torch.long)
            self._out_len = len(self.output_ids)
        return self._out_buf[: self._out_len]

    def prompt_on(self, device: torch.device) -> torch.Tensor:
        """The distinct prompt ids (only kept when repetition_penalty != 1), on `device`."""
        if not self._prompt_unique:
            return torch.empty(0, dtype=torch.long, device=device)
        if device not in self._prompt_unique:
            self._prompt_unique[device] = self._prompt_unique[torch.device("cpu")].to(device)
        return self._prompt_unique[device]

    @property
    def blocks_stop_now(self) -> bool:
        """True while min_tokens is not reached, or while a grammar waits for its trigger (the
        answer has not started; it may not end before): EOS and stop_token_ids are masked."""
        waiting = self.grammar is not None and self.grammar.armed
        short = len(self.output_ids) < self.params.min_tokens
        return (short or waiting) and bool(self.min_tokens_block)


class SampleResult(NamedTuple):
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


class Sampler:
    """Samples one token per row of [B, V] logits; row i belongs to states[i].

    A random row draws one uniform u and takes the token where the cumulative (float64)
    probability passes u. A seeded request's u is a hash of (seed, len(output_ids)), so its tokens
    do not depend on the batch it shares or its row; unseeded rows share one torch generator.
    """

    def __init__(self, seed: int = 0) -> None:
        self._generator = torch.Generator().manual_seed(seed)  # CPU: one scalar per row

    def __call__(
        self, logits: torch.Tensor, states: list[SamplingState], filled: Filled | None = None
    ) -> SampleResult:
        """`filled`: the grammar bitmask of these states, filled ahead (see grammar.bitmask)."""
        if logits.dim() != 2 or logits.shape[0] != len(states):
            raise ValueError(f"logits {tuple(logits.shape)} do not match {len(states)} states")
        if not states:
            return SampleResult([], [])
        logits = logits[:, : states[0].vocab_size]
        constrained = constrained_rows(states)
        if not constrained and all(_plain_greedy(s) for s in states):
            token_ids = logits.argmax(dim=-1).tolist()
        else:
            work = logits.to(torch.float32, memory_format=torch.contiguous_format, copy=True)
            token_ids = self._sample(work, states, constrained, filled)
        return SampleResult(token_ids, _logprobs(logits, token_ids, states))

    def _sample(
        self,
        logits: torch.Tensor,
        states: list[SamplingState],
        constrained: list[int],
        filled: Filled | None = None,
    ) -> list[int]:
        apply_grammars(logits, states, constrained, filled)
        _apply_penalties(logits, states)
        _mask_min_tokens(logits, states)
        token_ids = logits.argmax(dim=-1)
        rows = [i for i, s in enumerate(states) if not s.params.greedy]
        if rows:
            row_idx = torch.tensor(rows, device=logits.device)
            row_states = [states[i] for i in rows]
            probs = _filtered_probs(logits[row_idx], [s.params for s in row_states])
            token_ids[row_idx] = _inverse_cdf(probs, self._uniforms(row_states, logits.device))
        return token_ids.tolist()

    def distribution(self, logits: torch.Tensor, states: list[SamplingState]) -> torch.Tensor:
        """[B, V] fp32, each sampled row's normalised distribution: what `__call__` draws it from
        (grammar, penalties, min_tokens, then temperature / top-k / top-p / min-p). For
        speculative rejection sampling; greedy rows are not meant (their draw is the argmax)."""
        work = logits[:, : states[0].vocab_size].to(torch.float32, copy=True)
        apply_grammars(work, states, constrained_rows(states), None)
        _apply_penalties(work, states)
        _mask_min_tokens(work, states)
        probs = _filtered_probs(work, [s.params for s in states])
        return probs / probs.sum(dim=-1, keepdim=True)

    def random(self, count: int) -> torch.Tensor:
        """`count` U[0, 1) float64 draws from the shared (unseeded rows') generator."""
        return torch.rand(count, generator=self._generator, dtype=torch.float64)

    def _uniforms(self, states: list[SamplingState], device: torch.device) -> torch.Tensor:
        """One U[0, 1) per row: from (seed, step) when seeded, else from the shared generator."""
        values = torch.rand(len(states), generator=self._generator, dtype=torch.float64).tolist()
        for j, state in enumerate(states):
            if state.params.seed is not None:
                values[j] = step_seed(state.params.seed, len(state.output_ids)) / 2.0**63
        return torch.tensor(values, dtype=torch.float64, device=device)


def _plain_greedy(state: SamplingState) -> bool:
    return state.params.greedy and not state.has_penalties and not state.blocks_stop_now


def _apply_penalties(logits: torch.Tensor, states: list[SamplingState]) -> None:
    """Repetition (prompt + output), then frequency and presence (output) penalties, in place.

    Works on flat keys row * V + token of the seen tokens only, never on whole [B, V] rows.
    """
    rows = [i for i, s in enumerate(states) if s.has_penalties]
    if not rows:
        return
    device, vocab = logits.device, logits.shape[1]
    flat = logits.view(-1)
    per_row = lambda values: torch.tensor(values, device=device)  # [B], indexed by key // V
    outs = [states[i].output_tensor().to(device) + i * vocab for i in rows]
    out_keys, out_counts = torch.unique(torch.cat(outs), return_counts=True)
    params = [s.params for s in states]
    if any(p.repetition_penalty != 1.0 for p in params):
        prompts = [states[i].prompt_on(device) + i * vocab for i in rows]
        seen = torch.unique(torch.cat([out_keys, *prompts]))
        penalty = per_row([p.repetition_penalty for p in params])[seen // vocab]
        values = flat[seen]
        flat[seen] = torch.where(values > 0, values / penalty, values * penalty)
    frequency = per_row([p.frequency_penalty for p in params])[out_keys // vocab]
    presence = per_row([p.presence_penalty for p in params])[out_keys // vocab]
    flat[out_keys] -= frequency * out_counts + presence


def _mask_min_tokens(logits: torch.Tensor, states: list[SamplingState]) -> None:
    """EOS and stop ids where `blocks_stop_now`; and while a grammar waits for its trigger, the
    tokens that would end thinking elsewhere (grammar/thinking.py)."""
    rows: list[int] = []
    cols: list[int] = []
    for i, state in enumerate(states):
        if state.blocks_stop_now:
            banned = state.min_tokens_block
            if state.grammar is not None:
                banned = [*banned, *state.grammar.banned_now()]
            rows.extend([i] * len(banned))
            cols.extend(banned)
    if rows:
        index = (torch.tensor(rows), torch.tensor(cols))
        logits[tuple(t.to(logits.device) for t in index)] = float("-inf")


def _filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature, top-k, top-p, min-p over [S, V] fp32 logits; returns unnormalised probs."""
    device, vocab = logits.device, logits.shape[1]
    temperatures = [p.temperature for p in params]
    if any(t != 1.0 for t in temperatures):
        logits = logits / torch.tensor(temperatures, device=device).unsqueeze(1)
    top_ks = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
    if min(top_ks) < vocab:
        logits = _top_k(logits, top_ks)
    probs = logits.softmax(dim=-1)
    top_ps = [p.top_p for p in params]
    if min(top_ps) < 1.0:
        probs = _top_p(probs, torch.tensor(top_ps, device=device).unsqueeze(1))
    min_ps = [p.min_p for p in params]
    if max(min_ps) > 0.0:
        floor = torch.tensor(min_ps, device=device).unsqueeze(1) * probs.amax(-1, keepdim=True)
        probs = probs.masked_fill(probs < floor, 0.0)
    return probs


def _top_k(logits: torch.Tensor, top_ks: list[int]) -> torch.Tensor:
    vocab = logits.shape[1]
    max_k = max(k for k in top_ks if k < vocab)
    values = logits.topk(max_k, dim=-1).values  # [S, max_k], best first
    kth_pos = torch.tensor([min(k, max_k) - 1 for k in top_ks], device=logits.device)
    kth = values.gather(1, kth_pos.unsqueeze(1))
    active = torch.tensor([k < vocab for k in top_ks], device=logits.device).unsqueeze(1)
    return logits.masked_fill(active & (logits < kth), float("-inf"))


def _top_p(probs: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Keep the smallest best-first set whose probability reaches top_p (at least one token);
    tokens tied with the last one kept are kept too.

    Sorting the whole vocabulary is the slow part, so the nucleus is first looked for among the
    best _NUCLEUS_CANDIDATES tokens, which is exact whenever their mass already reaches top_p.
    """
    candidates = probs.topk(min(_NUCLEUS_CANDIDATES, probs.shape[1]), dim=-1).values
    if not bool(((candidates.sum(-1, keepdim=True) >= top_ps) | (top_ps >= 1.0)).all()):
        candidates = probs.sort(dim=-1, descending=True).values
    mass_before = candidates.cumsum(dim=-1) - candidates
    kept = (mass_before < top_ps).sum(-1, keepdim=True).clamp_min(1)  # [S, 1]
    cutoff = candidates.gather(1, kept - 1)
    return probs.masked_fill((probs < cutoff) & (top_ps < 1.0), 0.0)


def _inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the first token whose cumulative probability exceeds u × total (never p = 0)."""
    cdf = probs.to(torch.float64).cumsum(dim=-1)
    chosen = torch.searchsorted(cdf, uniforms.unsqueeze(1) * cdf[:, -1:], right=True).squeeze(1)
    past_end = chosen >= probs.shape[1]  # u × total rounded up to total
    if bool(past_end.any()):
        chosen = torch.where(past_end, probs.argmax(dim=-1), chosen)
    return chosen


def filtered_probs(logits: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Temperature / top-k / top-p / min-p of fp32 logits [S, V], normalised (a speculative
    drafter's q for sampled rows)."""
    probs = _filtered_probs(logits.float(), params)
    return probs / probs.sum(dim=-1, keepdim=True)


def token_logprobs(
    logits: torch.Tensor, token_ids: list[int], states: list[SamplingState]
) -> list[TokenLogprob | None]:
    """The logprobs `__call__` reports for `token_ids` (rows asking for them; else None)."""
    return _logprobs(logits[:, : states[0].vocab_size] if states else logits, token_ids, states)


def _logprobs(
    logits: torch.Tensor, token_ids: list[int], states: list[SamplingState]
) -> list[TokenLogprob | None]:
    """log_softmax of the raw logits: the chosen token's value and the top alternatives."""
    out: list[TokenLogprob | None] = [None] * len(states)
    rows = [i for i, s in enumerate(states) if s.params.logprobs is not None]
    if not rows:
        return out
    row_idx = torch.tensor(rows, device=logits.device)
    logp = torch.log_softmax(logits[row_idx].float(), dim=-1)
    chosen_idx = torch.tensor([token_ids[i] for i in rows], device=logits.device)
    chosen = logp.gather(1, chosen_idx.unsqueeze(1)).squeeze(1).tolist()
    max_n = max(states[i].params.logprobs for i in rows)
    top_vals, top_ids = logp.topk(max_n, dim=-1) if max_n else (logp[:, :0], logp[:, :0].long())
    top_vals, top_ids = top_vals.tolist(), top_ids.tolist()
    for r, i in enumerate(rows):
        n = states[i].params.logprobs
        top = list(zip(top_ids[r][:n], top_vals[r][:n]))
        out[i] = TokenLogprob(token_ids[i], chosen[r], top)
    return out

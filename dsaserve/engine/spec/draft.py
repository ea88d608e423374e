"""The DFlash drafter beside the engine: its context entries per pool slot, and block proposals.

**Context entries.** A drafter layer keys and values a context token from the target's tapped
hidden states at that token alone (`DFlashDraftModel.context_entries`), so each token's entry is
computed once, in the step where the target computes (and keeps) that token, and stored at the
token's KV-pool slot: `DraftContext.cache` [draft layers, pool slots, 2 * kv_heads * d]. For
every request, slots [0, kv_len) hold exact entries after every step, like the target's KV, so
pages handed to the radix cache carry them, a radix hit drafts from them, and nothing per
request is copied or kept beyond its slots. Entries at positions >= kv_len (rejected drafts)
are never written.

**Proposals.** A decoding request's block is [its last token, mask x (B - 1)] at positions
kv_len .. kv_len + B - 1: the target's embedding of those tokens, through the drafter's layers,
each attending (the `draft_attention` op) over the request's context entries and the block;
rows 1..B-1 give the drafts through the target's LM head. Greedy and seeded rows draft greedily
(argmax, or DFlash2's selector walk at temperature 0); other sampled rows draw each draft from
the drafter's q at the request's temperature (DFlash: also its top-k / top-p / min-p, as the
reference's `_sampling_probs`; DFlash2: the selector's softmax), and q is kept for rejection
sampling (`verify.py`).

On CPU the drafter's layers and its context entries run as C++ calls instead
(`draft_native.py`, the same math in fp32; the torch path above stays the reference).
"""

from __future__ import annotations

import functools

import torch
from torch.nn.utils.rnn import pad_sequence

from dsaserve.engine.request import Req
from dsaserve.engine.sampler import Sampler, filtered_probs
from dsaserve.engine.spec import draft_native
from dsaserve.engine.spec.verify import Proposals
from dsaserve.kernels.registry import Kernels
from dsaserve.models.dflash import DFlashDraftModel


class DraftContext:
    """The drafter's context entries, indexed by the target's KV-pool slots."""

    def __init__(self, drafter: DFlashDraftModel, num_slots: int, dtype, device) -> None:
        config = drafter.config
        self.cache = torch.zeros(config.num_layers, num_slots, config.kv_dim, dtype=dtype,
                                 device=device)  # fmt: skip
        self.drafter = drafter
        self.native = None  # draft_native.NativeBlock, set by the Drafter on CPU

    def write(self, taps: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor) -> None:
        """Entries of the tokens whose tapped target states are `taps` [N, n * H]."""
        if taps.shape[0] and self.native is not None:
            self.native.write(self.cache, taps, positions, slots)
        elif taps.shape[0]:
            entries = self.drafter.context_entries(taps, positions)  # [layers, N, kv_dim]
            self.cache.index_copy_(1, slots, entries.to(self.cache.dtype))


class Drafter:
    """Proposes each decoding request's block (see the module doc)."""

    def __init__(self, drafter: DFlashDraftModel, target, context: DraftContext,
                 kernels: Kernels, block_size: int, window: int | None,
                 native: bool = True) -> None:  # fmt: skip
        self.drafter, self.target, self.context = drafter, target, context
        self.kernels = kernels
        self.block_size = block_size
        config = drafter.config
        self.windows = [_tighter(w, window) for w in config.windows]
        self.causal = config.causal
        self.scale = config.head_dim**-0.5
        self.mask_id = config.mask_token_id
        # on CPU, the block forward and the context entries as C++ calls (draft_native.py) in
        # place of the torch `draft_attention` path; None (not on CPU, no build, another
        # draft_attention backend, or native=False): the torch path, the reference
        native = native and kernels.names.get("draft_attention") == "torch"
        self.native = (draft_native.build(drafter, context.cache, self.windows, self.scale)
                       if native else None)  # fmt: skip
        context.native = self.native

    @torch.inference_mode()
    def propose(self, reqs: list[Req], sampled: list[bool], sampler: Sampler) -> Proposals:
        """Drafts for `reqs` (each decoding: fill_ids = KV + its last token); `sampled[i]`:
        request i drafts from q (unseeded random sampling) instead of greedily."""
        device, block = self.context.cache.device, self.block_size
        positions = torch.tensor([range(req.kv_len, req.kv_len + block) for req in reqs],
                                 device=device)  # [R, B]  # fmt: skip
        ids = torch.tensor([[req.fill_ids[req.kv_len]] + [self.mask_id] * (block - 1)
                            for req in reqs], device=device)  # fmt: skip
        noise = self.target.embed(ids)
        if self.drafter.config.input_embedding_scale != 1.0:
            noise = noise * self.drafter.config.input_embedding_scale
        if self.native is not None:
            slots = [req.slots.contiguous() for req in reqs]
            hidden = self.native.hidden(noise, positions, self.context.cache, slots,
                                        [req.kv_len for req in reqs])  # fmt: skip
        else:
            hidden = self.drafter.block_hidden(noise, positions, self._attend(reqs, positions))
        hidden = hidden[:, 1:]  # [R, K, H]
        raw = self._lm_head(hidden)  # [R, K, V] before the drafter's multiplier and softcap
        return self._choose(reqs, sampled, sampler, hidden, raw, ids[:, 0])

    def _lm_head(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.target.logits(hidden.reshape(-1, hidden.shape[-1])).view(*hidden.shape[:-1], -1)

    def _attend(self, reqs: list[Req], positions: torch.Tensor):
        """The attend callback: the `draft_attention` op over each request's context entries."""
        device, block = positions.device, positions.shape[1]
        ctx = [req.slots[: req.kv_len] for req in reqs]
        slots = pad_sequence(ctx, batch_first=True).to(device)  # [R, L]
        lens = torch.tensor([c.shape[0] for c in ctx], device=device)
        key = torch.arange(slots.shape[1], device=device)
        valid = (key[None] < lens[:, None])[:, None, :].expand(-1, block, -1)  # [R, B, L]
        allowed = {}
        for window in set(self.windows):  # a row at p sees context positions c with p - c < window
            near = positions[..., None] - key[None, None] < window if window else None
            allowed[window] = valid if near is None else valid & near
        causal = self._block_masks(block, device)
        op, cache = self.kernels.draft_attention, self.context.cache

        def attend(layer: int, q, k, v):
            return op(q, cache[layer], slots, allowed[self.windows[layer]], k, v,
                      causal[self.causal[layer]], self.scale)  # fmt: skip

        return attend

    @functools.cache  # noqa: B019 (one drafter per engine)
    def _block_masks(self, block: int, device: torch.device) -> dict[bool, torch.Tensor]:
        """The block's own mask: every row (non-causal) or the rows up to it (causal)."""
        full = torch.ones(block, block, dtype=torch.bool, device=device)
        return {True: full.tril(), False: full}

    def _choose(self, reqs, sampled, sampler, hidden, raw, anchors) -> Proposals:
        """Greedy drafts take the raw outputs' argmax / top-k (the drafter's logit map keeps
        their order), so only the candidates' logits (DFlash2) or the sampled rows' (DFlash)
        are mapped."""
        rows = [i for i, s in enumerate(sampled) if s]
        selector, logits = self.drafter.candidate_selector, raw
        temperatures = torch.zeros(len(reqs), device=logits.device)
        uniforms = torch.zeros(logits.shape[:2], device=logits.device, dtype=torch.float64)
        if rows:
            index = torch.tensor(rows, device=logits.device)
            temperatures[index] = torch.tensor([reqs[i].params.temperature for i in rows],
                                               device=logits.device)  # fmt: skip
            uniforms[index] = sampler.random(len(rows) * logits.shape[1]).view(len(rows), -1).to(
                logits.device)  # fmt: skip
        if selector is not None:
            values, ids = selector.candidates(raw)
            unary = self.drafter.scale_logits(values)
            path = selector.walk(hidden, unary, ids, anchors, temperatures, uniforms)
            return Proposals(path.tokens.tolist(), path.probs, path.ids)
        tokens = raw.argmax(dim=-1)
        probs = None
        if rows:
            logits = self.drafter.scale_logits(raw)
            params = [reqs[i].params for i in rows for _ in range(logits.shape[1])]
            q = filtered_probs(logits[index].flatten(0, 1), params)  # [rows * K, V]
            cdf = q.double().cumsum(-1)
            drawn = torch.searchsorted(cdf, uniforms[index].reshape(-1, 1) * cdf[:, -1:],
                                       right=True).clamp_max(q.shape[-1] - 1)  # fmt: skip
            tokens[index] = drawn.view(len(rows), -1)
            probs = torch.zeros_like(logits)
            probs[index] = q.view(len(rows), logits.shape[1], -1)
        return Proposals(tokens.tolist(), probs, None)


def _tighter(layer_window: int | None, flag_window: int | None) -> int | None:
    windows = [w for w in (layer_window, flag_window) if w]
    return min(windows) if windows else None

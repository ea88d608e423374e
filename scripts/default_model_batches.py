"""Tokenised training examples for the default model: ids plus a loss mask on the model's turns."""

from __future__ import annotations

import random
import sys
from pathlib import Path
from typing import NamedTuple

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from default_model_data import Sample  # noqa: E402
from default_model_tokenizer import render  # noqa: E402


class Example(NamedTuple):
    ids: list[int]
    loss: list[int]  # 1 where the token is a training target (predicted from the position before)


class Batch(NamedTuple):
    input_ids: torch.Tensor  # [B, S]
    attention_mask: torch.Tensor  # [B, S]
    loss_mask: torch.Tensor  # [B, S] float, 1 on target tokens


def encode(sample: Sample, tokenizer) -> Example:
    """Mark the tokens of each assistant turn the model would generate, stop marker included.

    A turn starts after `<|assistant|><think>` (thinking on) or `<|assistant|><think></think>`
    (thinking off) and ends with the next role marker. Turns whose reasoning the template cleared
    (clear_thinking=true, before the last user message) are not trained on.
    """
    ids = tokenizer(render(sample), add_special_tokens=False)["input_ids"]
    special = tokenizer.convert_tokens_to_ids
    assistant, markers = (
        special("<|assistant|>"),
        {special(t) for t in ("<|user|>", "<|observation|>", "<|system|>", "<|assistant|>")},
    )
    trained = _trained_turns(sample)
    loss = [0] * len(ids)
    turn = -1
    for pos, tok in enumerate(ids):
        if tok == assistant:
            turn += 1
            if trained[turn]:
                _mark_from(loss, ids, pos + (2 if sample.thinking else 3), markers)
    return Example(ids, loss)


def _mark_from(loss: list[int], ids: list[int], start: int, markers: set[int]) -> None:
    for pos in range(start, len(ids)):
        loss[pos] = 1
        if ids[pos] in markers:
            return


def _trained_turns(sample: Sample) -> list[bool]:
    msgs = sample.messages
    last_user = max((i for i, m in enumerate(msgs) if m["role"] == "user"), default=-1)
    clear = sample.kwargs.get("clear_thinking") is True
    flags = []
    for i, m in enumerate(msgs):
        if m["role"] == "assistant":
            cleared = clear and i < last_user and bool(m.get("reasoning_content"))
            flags.append(not cleared)
    return flags


def batches(examples: list[Example], token_budget: int, rng: random.Random, pad_id: int):
    """Endless stream of length-bucketed, padded batches of about `token_budget` tokens."""
    while True:
        order = list(range(len(examples)))
        rng.shuffle(order)
        for chunk_start in range(0, len(order), 512):
            chunk = sorted(
                order[chunk_start : chunk_start + 512], key=lambda i: len(examples[i].ids)
            )
            group: list[int] = []
            planned = []
            for i in chunk:
                longest = max([len(examples[j].ids) for j in group] + [len(examples[i].ids)])
                if group and longest * (len(group) + 1) > token_budget:
                    planned.append(group)
                    group = []
                group.append(i)
            if group:
                planned.append(group)
            rng.shuffle(planned)
            for group in planned:
                yield collate([examples[i] for i in group], pad_id)


def collate(group: list[Example], pad_id: int) -> Batch:
    width = max(len(e.ids) for e in group)
    ids = torch.full((len(group), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(group), width), dtype=torch.long)
    loss = torch.zeros((len(group), width))
    for row, e in enumerate(group):
        ids[row, : len(e.ids)] = torch.tensor(e.ids)
        mask[row, : len(e.ids)] = 1
        loss[row, : len(e.loss)] = torch.tensor(e.loss, dtype=torch.float)
    return Batch(ids, mask, loss)

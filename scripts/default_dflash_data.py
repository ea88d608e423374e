"""Training data for the embedded model's DFlash2 drafter: the target's own hidden states and its
own greedy continuations.

Each example is one synthetic conversation (`default_model_data.py`) run through the frozen
embedded model once (the training-speed forward, DSA top-k on, as served): the hidden states of
the tapped layers at every position (the drafter's context), and the target's greedy next token
at every position. A block anchored at position p of an assistant turn (token p known, the
drafter proposes p+1 .. p+B-1) is labelled with the target's greedy continuation from p: label j
is the target's argmax at p+j-1, kept while every earlier label equals the conversation's token
(then the prefix the target would have written is the conversation's own, so the label is exactly
what greedy decoding would produce there) and while the turn lasts; later labels are dropped.
The conversations are the embedded model's training distribution, and its greedy continuations
agree with them on 99.96% of assistant tokens, so these are its own generations nearly always.
"""

from __future__ import annotations

import json
import multiprocessing
import random
import sys
import time
from pathlib import Path
from typing import NamedTuple

import default_model_fast as fast
import torch
from transformers import AutoTokenizer, GlmMoeDsaForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from default_model_batches import batches, encode  # noqa: E402
from default_model_data import samples  # noqa: E402

IGNORE = -100


class Example(NamedTuple):
    ids: torch.Tensor  # [S] the conversation's tokens
    taps: torch.Tensor  # [S, len(taps) * H] float16, the target's tapped hidden states
    labels: torch.Tensor  # [S, B - 1] per anchor position, the greedy labels (IGNORE: none)
    anchors: torch.Tensor  # [A] positions where a block may be anchored


@torch.no_grad()
def tapped_forward(model, input_ids, attention_mask, taps: list[int]):
    """(tapped hidden states [B, S, len(taps) * H], final normed hidden [B, S, H]): layer i's
    output, the last layer's after `model.norm` (transformers' hidden_states[i + 1])."""
    inner = model.model
    h = inner.embed_tokens(input_ids)
    positions = torch.arange(input_ids.shape[1])[None].expand(input_ids.shape[0], -1)
    cos_sin = inner.rotary_emb(h, position_ids=positions)
    allowed = fast.allowed_mask(attention_mask)
    outs, last = {}, len(inner.layers) - 1
    for i, layer in enumerate(inner.layers):
        h, _ = fast.layer_forward(layer, h, cos_sin, allowed, sparse=True, kl_rows=0)
        outs[i] = h
    final = inner.norm(h)
    outs[last] = final
    return torch.cat([outs[i] for i in taps], dim=-1), final


def greedy_labels(ids: torch.Tensor, greedy: torch.Tensor, loss: torch.Tensor, block: int):
    """(labels [S, block - 1], anchors [A]) of one conversation (see the module doc)."""
    seq = ids.shape[0]
    labels = torch.full((seq, block - 1), IGNORE, dtype=torch.long)
    anchors = []
    for p in range(seq - 1):
        if not (loss[p] and loss[p + 1]):  # p must be a generated token that does not end a turn
            continue
        anchors.append(p)
        for j in range(1, block):
            if p + j >= seq or not loss[p + j]:
                break
            labels[p, j - 1] = greedy[p + j - 1]
            if greedy[p + j - 1] != ids[p + j]:
                break  # the target leaves the conversation here: later labels are unknown
    return labels, torch.tensor(anchors, dtype=torch.long)


def build(target_dir: Path, seed: int, split: str, count: int, taps: list[int], block: int,
          workers: int = 1, token_budget: int = 2048) -> list[Example]:  # fmt: skip
    """`count` conversations of `split` as drafter examples, over `workers` processes (one
    torch thread each: on a shared machine that is faster than one process with threads)."""
    jobs = [(target_dir, seed, split, count, taps, block, token_budget, w, workers)
            for w in range(workers)]  # fmt: skip
    if workers == 1:
        return _build_part(*jobs[0])
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        parts = pool.starmap(_build_part, jobs)
    return [e for part in parts for e in part]


def _build_part(target_dir, seed, split, count, taps, block, token_budget, part, parts):
    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = GlmMoeDsaForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    data = [encode(s, tokenizer) for s in samples(seed, split, count)][part::parts]
    stream = batches(data, token_budget, random.Random(seed), tokenizer.pad_token_id)
    examples, seen, started = [], 0, time.time()
    while seen < len(data):
        batch = next(stream)
        tapped, final = tapped_forward(model, batch.input_ids, batch.attention_mask, taps)
        greedy = model.lm_head(final).argmax(-1)
        for row in range(batch.input_ids.shape[0]):
            length = int(batch.attention_mask[row].sum())
            ids = batch.input_ids[row, :length]
            loss = batch.loss_mask[row, :length].bool()
            labels, anchors = greedy_labels(ids, greedy[row, :length], loss, block)
            if anchors.numel():
                examples.append(Example(ids, tapped[row, :length].half(), labels, anchors))
        seen += batch.input_ids.shape[0]
        print(json.dumps({"stage": "data", "split": split, "part": part, "done": seen,
                          "of": len(data), "elapsed_s": round(time.time() - started, 1)}),
              flush=True)  # fmt: skip
    return examples

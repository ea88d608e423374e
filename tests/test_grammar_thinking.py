"""Thinking ends at the trigger token only, before a grammar starts (dsaserve/grammar/thinking.py
and the sampler): the end tokens cannot be sampled while the grammar waits, nor any token that
would spell a reasoning exit (`</think>`, `<tool_call>`, ...) from other tokens, given what the
output ends with; the trigger itself always can."""

from __future__ import annotations

import torch
from transformers import AutoTokenizer

from dsaserve import SamplingParams
from dsaserve.assets import default_model_path
from dsaserve.engine.sampler import Sampler, SamplingState
from dsaserve.grammar.backend import make_backend
from dsaserve.grammar.state import GrammarState
from dsaserve.grammar.thinking import ThinkingExits, token_bytes

VOCAB = [b"</think>", b"</", b"think", b">", b"a>", b"x</think>y", b"<tool", b"_call>", b"ok",
         b"<tool_call>", b"</thi", b"nk>", b">!"]  # fmt: skip
TRIGGER = 0


def test_banned_tokens_follow_the_tail():
    exits = ThinkingExits(VOCAB, ["</think>", "<tool_call>"], TRIGGER)
    ids = {data: i for i, data in enumerate(VOCAB)}
    assert exits.banned(b"") == [ids[b"x</think>y"], ids[b"<tool_call>"]]  # whole tags inside
    after = exits.banned(b"so </think")  # `>` or `>!` would complete it, `a>` would not
    assert {ids[b">"], ids[b">!"]} <= set(after) and ids[b"a>"] not in after
    assert TRIGGER not in after
    assert ids[b"nk>"] in exits.banned(b"</thi") and ids[b"_call>"] in exits.banned(b"<tool")
    assert ids[b"ok"] not in exits.banned(b"</thi")
    tail = b""
    for token in (ids[b"ok"], ids[b"</"], ids[b"think"]):
        tail = exits.tail(tail, token)
    assert tail == b"ok</think"[-exits.keep :] and ids[b">"] in exits.banned(tail)


def test_armed_rows_never_end_nor_leave_thinking_but_by_the_trigger():
    tokenizer = AutoTokenizer.from_pretrained(default_model_path())
    vocab = len(tokenizer)
    eos = [0, 7, 9]
    think_end, tool_call = (tokenizer.convert_tokens_to_ids(t) for t in ("</think>", "<tool_call>"))
    backend = make_backend("xgrammar", tokenizer, vocab, eos)
    exits = ThinkingExits(token_bytes(tokenizer, vocab), ["</think>", "<tool_call>"], think_end)
    states = []
    for _ in range(2):
        state = SamplingState(SamplingParams(temperature=0).with_defaults({}), [1], vocab, eos)
        state.grammar = GrammarState(backend.matcher(backend.compile("regex", "[0-9]+")),
                                     after_token_id=think_end, exits=exits)  # fmt: skip
        states.append(state)
    logits = torch.zeros(2, vocab)
    logits[0, eos] = 10.0  # the model wants to stop, or to call a tool, inside its thinking
    logits[0, tool_call] = 9.0
    logits[0, 5] = 1.0
    logits[1, think_end] = 5.0
    out = Sampler(seed=0)(logits, states).token_ids
    assert out == [5, think_end]  # the end and the exit tokens were masked; the trigger was not
    states[1].append(think_end)
    assert not states[1].grammar.armed and not states[1].blocks_stop_now  # the grammar decides

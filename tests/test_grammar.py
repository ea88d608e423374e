"""The grammar engine below the server: bitmask masking in the sampler (only constrained rows),
the `</think>` trigger, compile failures and compiles that do not hold up other requests, and
the offline `LLM` producing schema-valid JSON, regex and EBNF matches from a random model."""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import jsonschema
import pytest
import torch
import xgrammar as xgr
from transformers import AutoTokenizer

from dsaserve import LLM, SamplingParams
from dsaserve.assets import default_model_path
from dsaserve.engine.sampler import Sampler, SamplingState
from dsaserve.grammar.backend import GrammarBackend, make_backend
from dsaserve.grammar.bitmask import unpack
from dsaserve.grammar.compiler import GrammarCompiler
from dsaserve.grammar.state import GrammarState

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 8},
    "n": {"type": "integer", "minimum": 0, "maximum": 99},
    "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "minItems": 1, "maxItems": 3}},
    "required": ["name", "n", "tags"], "additionalProperties": False}  # fmt: skip
EOS = [0, 7, 9]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(default_model_path())


@pytest.fixture(scope="module")
def backend(tokenizer) -> GrammarBackend:
    return make_backend("xgrammar", tokenizer, len(tokenizer), EOS)


@pytest.fixture(scope="module")
def llm(server_checkpoint: Path) -> LLM:
    return LLM(str(server_checkpoint), max_total_tokens=4096, page_size=16)


def test_unpacked_bitmask_masks_like_xgrammar(backend, tokenizer):
    matcher = backend.matcher(backend.compile("json_schema", json.dumps(SCHEMA)))
    vocab = len(tokenizer)
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    matcher.fill_bitmask(bitmask, 0)
    logits = torch.randn(1, vocab)
    reference = logits.clone()
    xgr.apply_token_bitmask_inplace(reference, bitmask)
    ours = logits.masked_fill(~unpack(bitmask, vocab), float("-inf"))
    assert torch.equal(ours, reference)
    assert 0 < int(unpack(bitmask, vocab).sum()) < vocab


def test_sampler_masks_only_rows_with_an_active_grammar(backend, tokenizer):
    vocab = len(tokenizer)
    compiled = backend.compile("regex", "[0-9]{3}")
    digits = {tokenizer.convert_tokens_to_ids(str(d)) for d in range(10)}
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(0))
    states = [SamplingState(SamplingParams(temperature=t).with_defaults({}), [1], vocab, EOS)
              for t in (0.0, 0.0, 1.0)]  # fmt: skip
    states[0].grammar = GrammarState(backend.matcher(compiled))
    states[2].grammar = GrammarState(backend.matcher(compiled))
    out = Sampler(seed=1)(logits, states).token_ids
    assert out[0] in digits and out[2] in digits
    assert out[1] == int(logits[1].argmax())  # the unconstrained row is untouched
    assert int(logits[0].argmax()) not in digits  # (so the mask did change row 0)


def test_a_bitmask_filled_ahead_is_the_one_applied(backend, tokenizer, llm: LLM):
    from dsaserve.grammar.bitmask import Filled, fill_bitmask

    vocab = len(tokenizer)
    state = SamplingState(SamplingParams(temperature=0).with_defaults({}), [1], vocab, EOS)
    state.grammar = GrammarState(backend.matcher(backend.compile("regex", "[0-9]{3}")))
    filled = fill_bitmask([state], vocab)
    seven = tokenizer.convert_tokens_to_ids("7")
    only_seven = torch.zeros_like(filled.bitmask)
    only_seven[0, seven // 32] = 1 << (seven % 32)
    logits = torch.randn(1, vocab)
    assert Sampler()(logits, [state], Filled([0], only_seven)).token_ids == [seven]
    assert Sampler()(logits, [state], filled).token_ids == Sampler()(logits, [state]).token_ids
    engine = llm.engine  # the plain step fills ahead for the rows it will sample
    assert engine.grammar.fill_ahead(_one_batch(engine, state)).result().rows == [0]


def _one_batch(engine, state):
    from dsaserve.engine.request import Req
    from dsaserve.engine.scheduler import ScheduledBatch

    req = Req("ahead", [1, 2], state.params, state, None)
    return ScheduledBatch([req], [0], [2])


def test_grammar_waits_for_the_trigger_token(backend):
    state = GrammarState(backend.matcher(backend.compile("regex", "ab")), after_token_id=11)
    assert not state.active
    for token in (5, 6, 11):  # free tokens, then </think>
        state.accept(token)
    assert state.active and not state.terminated


def test_offline_llm_outputs_validate(llm: LLM):
    params = SamplingParams(max_tokens=80, temperature=1.0, seed=3, n=4,
                            json_schema=json.dumps(SCHEMA))  # fmt: skip
    out = llm.generate(["Hello there", "Tell me a story"], params, use_tqdm=False)
    for prompt in out:
        for sample in prompt.samples:
            assert sample.finish_reason["type"] == "stop", sample.text
            jsonschema.validate(json.loads(sample.text), SCHEMA)
    regex = r"(yes|no), [a-z]{2,5} [0-9]{1,3}"
    out = llm.generate(["Hi"], SamplingParams(max_tokens=40, temperature=1.0, seed=2, n=4,
                                              regex=regex), use_tqdm=False)  # fmt: skip
    assert all(re.fullmatch(regex, s.text) for s in out[0].samples), out[0].samples
    free = llm.generate(["Hi"], SamplingParams(max_tokens=20, temperature=0), use_tqdm=False)
    assert not re.fullmatch(regex, free[0].text)  # without the grammar: noise


def test_trigger_leaves_the_prefix_free_then_constrains(llm: LLM):
    free = llm.generate(["Hi"], SamplingParams(max_tokens=8, temperature=0), use_tqdm=False)[0]
    trigger = free.token_ids[2]
    params = SamplingParams(max_tokens=60, temperature=0, regex="[0-9]{4}",
                            grammar_after_token_id=trigger)  # fmt: skip
    out = llm.generate(["Hi"], params, use_tqdm=False)[0]
    cut = out.token_ids.index(trigger) + 1
    assert out.token_ids[:cut] == free.token_ids[:cut]
    rest = llm.tokenizer.decode(out.token_ids[cut:], skip_special_tokens=True)
    assert re.fullmatch("[0-9]{4}", rest), rest


def test_uncompilable_grammar_is_refused_naming_the_field(llm: LLM):
    bad = SamplingParams(max_tokens=4, json_schema='{"type": "strin"}')
    with pytest.raises(ValueError, match="json_schema: cannot compile"):
        llm.generate(["Hi"], bad, use_tqdm=False)
    with pytest.raises(ValueError, match="regex cannot be combined with json_schema"):
        SamplingParams(json_schema="{}", regex="a")


def test_a_slow_compile_does_not_hold_up_other_requests(llm: LLM, backend):
    from dsaserve.engine.messages import GenerateRequest

    release = threading.Event()

    class Slow(GrammarBackend):
        def compile(self, kind, source):
            release.wait(30)
            return backend.compile(kind, source)

        def matcher(self, compiled):
            return backend.matcher(compiled)

    engine, saved = llm.engine, llm.engine.grammar.compiler
    engine.grammar.compiler = GrammarCompiler(Slow)
    try:
        sampling = lambda **kw: dict(vars(SamplingParams(max_tokens=6, temperature=0, **kw)))  # noqa: E731
        engine.add_request(GenerateRequest(rid="g", input_ids=[5, 6], sampling=sampling(
            regex="[0-9]{2}")))  # fmt: skip
        engine.add_request(GenerateRequest(rid="p", input_ids=[5, 6], sampling=sampling()))
        seen: dict[str, list] = {"g": [], "p": []}
        for _ in range(40):
            for out in engine.step():
                seen[out.rid].append(out)
            if seen["p"] and seen["p"][-1].finished:
                break
        assert seen["p"][-1].finished and not seen["g"]  # the plain one ran meanwhile
        release.set()
        while engine.has_work():
            for out in engine.step():
                seen[out.rid].append(out)
        assert re.fullmatch("[0-9]{2}", "".join(o.text for o in seen["g"]))
    finally:
        release.set()
        engine.grammar.compiler = saved


def test_llguidance_backend(server_checkpoint: Path):
    from dsaserve.grammar.tool_calls import tool_call_grammar
    from dsaserve.server.structured import StructuredOutput
    from dsaserve.web.errors import APIError

    llm = LLM(str(server_checkpoint), max_total_tokens=2048, page_size=16,
              grammar_backend="llguidance")  # fmt: skip
    params = SamplingParams(max_tokens=80, temperature=1.0, seed=4, n=4,
                            json_schema=json.dumps(SCHEMA))  # fmt: skip
    for sample in llm.generate(["Hello there"], params, use_tqdm=False)[0].samples:
        assert sample.finish_reason["type"] == "stop", sample.text
        jsonschema.validate(json.loads(sample.text), SCHEMA)
    ebnf = 'root ::= ("yes" | "no") ", " [a-z]{2,5}'
    params = SamplingParams(max_tokens=30, temperature=1.0, seed=1, n=3, ebnf=ebnf)
    for sample in llm.generate(["Hi"], params, use_tqdm=False)[0].samples:
        assert re.fullmatch("(yes|no), [a-z]{2,5}", sample.text), sample.text
    checker = StructuredOutput("llguidance", {})
    tool = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}}}}}  # fmt: skip
    checker.check("tool_call_grammar", tool_call_grammar("glm47", [tool], "required", True), "t")
    tool["function"]["parameters"]["properties"]["a"] = {"type": "string", "pattern": "(x"}
    with pytest.raises(APIError, match="tool_choice"):
        checker.check("tool_call_grammar", tool_call_grammar("glm47", [tool], "required", True),
                      "tool_choice")  # fmt: skip
    with pytest.raises(APIError, match="format"):
        checker.check("tool_call_grammar", "{}", "tool_choice")
    with pytest.raises(APIError, match="invalid regex"):
        checker.check("regex", "(abc", "regex")


def test_a_compile_past_the_limit_fails_the_request(monkeypatch):
    from concurrent.futures import Future

    from dsaserve.grammar import compiler

    monkeypatch.setattr(compiler, "COMPILE_TIMEOUT_S", 0.0)
    pending, item = compiler.PendingGrammars(), object()
    pending.add(item, Future())  # never completes
    pending.wait(0.01)
    resolved = pending.resolve()
    assert resolved.failed[0][0] is item and "took over" in resolved.failed[0][1]
    assert not len(pending) and not resolved.ready

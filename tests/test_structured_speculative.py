"""Structured output under MTP speculative decoding (EAGLE): draft tokens the grammar forbids are
never accepted, so greedy constrained output is token for token the non-speculative one, offline
and through `dsaserve serve` with the openai SDK; drafts are still accepted inside the grammar."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest
from server_harness import running_server
from speculative_models import make_mtp_checkpoint

from dsaserve import LLM, SamplingParams

SCHEMA = {"type": "object", "properties": {
    "word": {"type": "string", "maxLength": 12},
    "count": {"type": "integer", "minimum": 0, "maximum": 500},
    "flags": {"type": "array", "items": {"type": "boolean"}, "minItems": 1, "maxItems": 4}},
    "required": ["word", "count", "flags"]}  # fmt: skip
REGEX = r"[a-z]{4,12}( [a-z]{2,12}){1,3}\."
LOOSE = r"[^<]{1,80}"  # lets the random model's own repetition loops through: drafts accepted
GRAMMARS = [("json_schema", json.dumps(SCHEMA)), ("regex", REGEX), ("regex", LOOSE)]
PROMPTS = ["The quick brown fox", "What is 15% of 240?", "Hello world! Bonjour"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return make_mtp_checkpoint(tmp_path_factory.mktemp("spec_grammar") / "ckpt", "glm", seed=3)


def greedy(**grammar) -> SamplingParams:
    return SamplingParams(max_tokens=80, temperature=0, **grammar)


@pytest.fixture(scope="module")
def plain(checkpoint):
    llm = LLM(str(checkpoint), max_total_tokens=4096, page_size=16)
    return {
        value: llm.generate(PROMPTS, greedy(**{kind: value}), use_tqdm=False)
        for kind, value in GRAMMARS
    }


def test_eagle_constrained_tokens_equal_plain(checkpoint, plain):
    spec = LLM(
        str(checkpoint),
        max_total_tokens=4096,
        page_size=16,
        speculative_algorithm="EAGLE",
        speculative_num_steps=3,
    )  # the server runs 2
    for kind, value in GRAMMARS:
        out = spec.generate(PROMPTS, greedy(**{kind: value}), use_tqdm=False)
        assert [o.token_ids for o in out] == [o.token_ids for o in plain[value]], value
    assert spec.engine.stats()["spec_accept_rate"] > 0  # drafts inside a grammar were accepted
    for o in plain[json.dumps(SCHEMA)]:
        assert o.finish_reason["type"] == "stop"
        jsonschema.validate(json.loads(o.text), SCHEMA)


def test_eagle_server_matches_through_the_sdk(checkpoint, plain):
    flags = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2"]
    with running_server(checkpoint, *flags) as server:
        client = openai.OpenAI(base_url=server.base, api_key="x", max_retries=0, timeout=120)
        for kind, value in GRAMMARS[:2]:
            for prompt, want in zip(PROMPTS, plain[value]):
                out = client.completions.create(
                    model="m", prompt=prompt, max_tokens=80, temperature=0, extra_body={kind: value}
                )
                assert out.choices[0].text == want.text

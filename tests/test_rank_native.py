"""The ranks' native decode layers are used by every rank or by none (engine/decode/build.py
`rank_native`): a rank whose layers did not build puts the whole layout on the layered model,
says so per rank in the engine's report, and the tokens do not change. Under DP attention the
plain decode steps of both groups (one of them maybe without rows) run natively, with the
one-process engine's tokens."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from server_harness import running_server
from tiny_models import make_checkpoint

from dsaserve import LLM, SamplingParams
from dsaserve.engine.decode import native

PROMPTS = [[(7 * i + 3) % 300 + 1 for i in range(40)], [5, 17, 99, 3, 250]]  # 40 > index_topk
KW = dict(dtype="float32", max_total_tokens=2048, page_size=16, chunked_prefill_size=16)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(make_checkpoint(tmp_path_factory.mktemp("rank_native") / "ckpt", "deepseek", 4))


def run(checkpoint: str) -> tuple[list[list[int]], dict]:
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    with LLM(checkpoint, tp_size=2, **KW) as llm:
        tokens = [o.token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
        return tokens, llm.engine.stats()


def test_one_rank_without_native_layers_puts_all_on_the_layered_model(checkpoint, monkeypatch):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in LLM(checkpoint, **KW).generate(PROMPTS, params, use_tqdm=False)]
    tokens, stats = run(checkpoint)
    assert tokens == want
    assert stats["rank_decode_paths"] == ["native", "native"] and stats["native_rank_rounds"] > 0
    monkeypatch.setattr(native, "extension", lambda: None)  # rank 0 (this process) only
    tokens, stats = run(checkpoint)
    assert tokens == want
    assert stats["rank_decode_paths"] == ["layered", "native"]
    assert stats["native_rank_rounds"] == 0 and stats["decode_path"] == "layered"


def test_dp_attention_groups_decode_natively_with_one_process_tokens(checkpoint):
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=0)
    prompts = [*PROMPTS, [(11 * i) % 290 + 2 for i in range(23)]]
    outs = LLM(checkpoint, **KW).generate(prompts, params, use_tqdm=False)
    want = [(o.text, [lp.logprob for lp in o.logprobs]) for o in outs]
    flags = ["--dtype", "float32", "--chunked-prefill-size", "16", "--tp", "2", "--dp", "2",
             "--enable-dp-attention"]  # fmt: skip
    with running_server(checkpoint, *flags) as server:
        client = openai.OpenAI(base_url=server.base, api_key="x", max_retries=0, timeout=240)

        def complete(prompt: list[int]) -> tuple[str, list[float]]:
            r = client.completions.create(model="m", prompt=prompt, max_tokens=6, temperature=0,
                                          logprobs=1, extra_body={"ignore_eos": True})  # fmt: skip
            return r.choices[0].text, list(r.choices[0].logprobs.token_logprobs)

        got = [complete(prompts[0])]  # alone: the other group joins each step without rows
        with ThreadPoolExecutor(len(prompts)) as pool:
            got += list(pool.map(complete, prompts))
        stats = httpx.get(server.url + "/get_server_info", timeout=60).json()["internal_states"][0]
    for (text, lps), (want_text, want_lps) in zip(got, [want[0], *want]):
        assert text == want_text
        assert max(abs(a - b) for a, b in zip(lps, want_lps, strict=True)) < 1e-4
    assert [g["rank_decode_paths"] for g in stats["dp_groups"]] == [["native"] * 2] * 2
    assert stats["native_rank_rounds"] > 0

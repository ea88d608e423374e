"""DeepSeek-V3.2 (`deepseek_v32`, with an MTP layer) through prefill/decode disaggregation behind
the real sglang-router: a `--tp 2 --dp 2 --enable-dp-attention` prefill (room r prefilled by
attention group r % 2) into a `--tp 2 --dp 2 --enable-dp-attention` decode over NIXL, EAGLE at
the decode, fp32, prompts longer than index_topk: through the openai SDK the greedy tokens equal
the single-process server's and every logprob is within 1e-4; every layer's checksum matched,
every room the prefill wrote arrived, and both decode groups served rooms."""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from pd_harness import (
    bootstrap_port,
    idle,
    pd_flags,
    requires_nixl,
    requires_router,
    running_router,
    running_servers,
    stats,
)
from server_harness import Server, wait_for
from speculative_models import make_mtp_checkpoint

pytestmark = [requires_router, requires_nixl]
FP32 = ["--dtype", "float32", "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2"]
DPA = ["--tp", "2", "--dp", "2", "--enable-dp-attention"]
WORDS = "the sea wind lighthouse keeper volcano river mountain village morning quiet old".split()
PROMPTS = [" ".join(WORDS[(k * 5 + 3 * i) % len(WORDS)] for i in range(24 + 6 * k))
           for k in range(6)]  # fmt: skip
NEW = 8


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Server]]:
    folder = tmp_path_factory.mktemp("pd_deepseek") / "ckpt"
    checkpoint = make_mtp_checkpoint(folder, "deepseek", seed=4)
    specs = [(checkpoint, FP32, None),
             (checkpoint, FP32 + pd_flags("prefill", *DPA), None),
             (checkpoint, FP32 + pd_flags("decode", *DPA), None)]  # fmt: skip
    with running_servers(specs) as (single, prefill, decode):
        yield {"single": single, "prefill": prefill, "decode": decode,
               "bootstrap_port": bootstrap_port(prefill)}  # fmt: skip


def _complete(base: str) -> list[tuple[list[str], list[float]]]:
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=240)
    out = []
    for prompt in PROMPTS:
        reply = client.completions.create(model="m", prompt=prompt, max_tokens=NEW,
                                          temperature=0, logprobs=1,
                                          extra_body={"ignore_eos": True})  # fmt: skip
        assert reply.usage.prompt_tokens > 16  # > index_topk (8), over one page
        logprobs = reply.choices[0].logprobs
        out.append((logprobs.tokens, logprobs.token_logprobs))
    return out


def test_dp_attention_prefill_into_a_dp_attention_decode_matches_one_process(servers) -> None:
    want = _complete(servers["single"].url)
    prefill, decode = servers["prefill"], servers["decode"]
    flags = ["--pd-disaggregation", "--prefill", prefill.url, str(servers["bootstrap_port"]),
             "--decode", decode.url]  # fmt: skip
    with running_router(*flags) as router:
        got = _complete(router.url)
    for (tokens, lps), (want_tokens, want_lps) in zip(got, want):
        assert tokens == want_tokens and len(lps) == NEW
        assert max(abs(a - b) for a, b in zip(lps, want_lps)) < 1e-4
    sent, received = stats(prefill.url), stats(decode.url)
    assert sent["pd_rooms_ok"] == received["pd_rooms_ok"] == len(PROMPTS)
    assert received["pd_checksum_mismatches"] == 0 and received["pd_checksum_layers_ok"] > 0
    assert all(g["pd_rooms_ok"] > 0 for g in received["dp_groups"])  # round robin: both
    assert sum(g["pd_rooms_ok"] for g in sent["dp_groups"]) == len(PROMPTS)
    assert received["spec_verify_ct"] > 0, "EAGLE ran at the decode"
    for server in (prefill, decode):
        wait_for(lambda s=server: idle(s.url), f"{server.url} idle")

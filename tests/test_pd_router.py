"""Prefill/decode disaggregation behind the real sglang-router, KV moved by NIXL: greedy output
through 1 prefill + 1 decode (and + 2 decodes) equals one colocated `dsaserve serve` on the same
checkpoint, EAGLE at the decode, prompts longer than index_topk; the per-room checksums show the
decode received exactly the bytes the prefill computed for every layer, indexer layer and MTP.
The NIXL prefill runs `--tp 2` (its first rank writes every page); its decodes run `--tp 1`,
`--tp 2` (the first rank copies what it received to the other: KV_SHARE) and `--tp 2 --dp 2
--enable-dp-attention`; the Mooncake prefill runs `--tp 2 --dp 2 --enable-dp-attention` (room r
prefilled by attention group r % 2, each group writing from its own pool) into a `--tp 2`
decode and into a DP-attention one. The PD roles hold a cluster secret:
their bootstrap routes and ZMQ frames are authenticated."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from pd_harness import (
    bootstrap_port,
    idle,
    launch,
    pd_flags,
    requires_nixl,
    requires_router,
    running_router,
    stats,
    stop_all,
)
from server_harness import Server, _wait_ready, make_server_checkpoint, wait_for
from speculative_models import add_mtp_layer

from dsaserve.model_config import ModelConfig
from dsaserve.models.dsa_moe import index_cache_ids

pytestmark = [requires_router, requires_nixl]
EAGLE = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2"]
DPA = ["--tp", "2", "--dp", "2", "--enable-dp-attention"]
PROMPTS = [
    "Write a short poem about the sea, the wind and the old lighthouse keeper who lives there.",
    "List three facts about volcanoes, and explain why each one matters to people nearby.",
]
SECRET = {"DSASERVE_CLUSTER_SECRET": "pd-router-secret"}  # bootstrap and ZMQ authenticated
QUICK = [0, 4, 5, 9]  # _answers(quick=True) of the full list: each prompt's chat and /generate


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return add_mtp_layer(make_server_checkpoint(tmp_path_factory.mktemp("pd_ckpt")))


def mooncake_available() -> bool:
    try:
        from mooncake.engine import TransferEngine  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.fixture(scope="module")
def servers(checkpoint: Path) -> Iterator[dict[str, Server]]:
    """Colocated; a `--tp 2` prefill with three decodes (NIXL): `--tp 1`, `--tp 2` and
    `--tp 2 --dp 2 --enable-dp-attention`; and (where Mooncake imports) a DP-attention prefill
    with a `--tp 2` and a DP-attention decode. The `--tp 1` and `--tp 2` decodes are told the
    NIXL prefill's bootstrap port (for the router that sends none), so they start once the
    prefill reported it, while the others are still starting."""
    specs = {
        "colocated": EAGLE,
        "prefill": EAGLE + pd_flags("prefill", "--tp", "2"),
        "dpa_decode": EAGLE + pd_flags("decode", *DPA),
    }
    if mooncake_available():
        for name, role, layout in (("mooncake_prefill", "prefill", DPA),
                                   ("mooncake_decode", "decode", ["--tp", "2"]),
                                   ("mooncake_dpa_decode", "decode", DPA)):  # fmt: skip
            flags = pd_flags(role, "--disaggregation-transfer-backend", "mooncake", *layout)
            specs[name] = EAGLE + flags
    started: dict = {}
    try:
        for name, flags in specs.items():
            started[name] = launch(checkpoint, *flags, env=None if name == "colocated" else SECRET)
        started["prefill"].url = _wait_ready(started["prefill"])
        port = bootstrap_port(started["prefill"])
        for name, layout in (("decode", []), ("decode2", ["--tp", "2"])):
            flags = pd_flags("decode", *layout, bootstrap_port=port)
            started[name] = launch(checkpoint, *EAGLE, *flags, env=SECRET)
        for server in started.values():
            server.url = server.url or _wait_ready(server)
        ports = {"bootstrap_port": port}
        if "mooncake_prefill" in started:
            ports["mooncake_bootstrap_port"] = bootstrap_port(started["mooncake_prefill"])
        yield {**started, **ports}
    finally:
        stop_all(list(started.values()))


@pytest.fixture(scope="module")
def expected(servers: dict) -> list:
    return _answers(servers["colocated"].url)


def _answers(base: str, quick: bool = False) -> list:
    """Chat (plain, streamed, with logprobs), completions and /generate, all greedy (`quick`:
    the plain chat and /generate only, QUICK of the full list)."""
    client = openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0)
    out = []
    for prompt in PROMPTS:
        messages = [{"role": "user", "content": prompt}]
        reply = client.chat.completions.create(
            model="pd", messages=messages, max_tokens=12, temperature=0
        )
        message = reply.choices[0].message
        out.append((message.content, (message.model_extra or {}).get("reasoning_content")))
        assert reply.usage.prompt_tokens > 16  # > index_topk (8) and over one page
        if quick:
            out.append(_generate(base, prompt))
            continue
        streamed = client.chat.completions.create(
            model="pd", messages=messages, max_tokens=12, temperature=0, stream=True
        )
        deltas = [c.choices[0].delta for c in streamed if c.choices]
        out.append("".join((d.content or "") + ((d.model_extra or {}).get("reasoning_content")
                                                 or "") for d in deltas))  # fmt: skip
        completion = client.completions.create(
            model="pd", prompt=prompt, max_tokens=12, temperature=0
        )
        out.append(completion.choices[0].text)
        scored = client.chat.completions.create(
            model="pd",
            messages=messages,
            max_tokens=4,
            temperature=0,
            logprobs=True,
            top_logprobs=2,
        )  # the first token's logprob comes from the prefill's aux record
        out.append(
            [
                (
                    t.token,
                    round(t.logprob, 3),
                    [(a.token, round(a.logprob, 3)) for a in t.top_logprobs],
                )
                for t in scored.choices[0].logprobs.content
            ]
        )
        out.append(_generate(base, prompt))
    return out


def _generate(base: str, prompt: str) -> list[int]:
    native = httpx.post(base + "/generate", timeout=120, json={
        "text": prompt, "sampling_params": {"max_new_tokens": 12, "temperature": 0},
    }).json()  # fmt: skip
    return native["output_ids"]


def _prefix(servers: dict, backend: str) -> str:
    """The servers' name prefix of a transfer backend's pair."""
    prefix = "" if backend == "nixl" else "mooncake_"
    if prefix + "prefill" not in servers:
        pytest.skip("Mooncake does not import here (pip install mooncake-transfer-engine-non-cuda "
                    "with libibverbs1 libnl-3-200 libnl-route-3-200)")  # fmt: skip
    return prefix


def _layers_per_room(checkpoint: Path) -> int:
    config = ModelConfig.from_hf(str(checkpoint), {})
    return config.num_hidden_layers + 1 + len(index_cache_ids(config, True))  # + the MTP layer


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_one_prefill_one_decode_matches_colocated(
    servers: dict, expected: list, checkpoint: Path, backend: str
) -> None:
    prefix = _prefix(servers, backend)
    prefill, decode = servers[prefix + "prefill"], servers[prefix + "decode"]
    before = stats(decode.url)
    assert before["pd_transfer_backend"] == backend
    flags = ["--pd-disaggregation", "--prefill", prefill.url,
             str(servers[prefix + "bootstrap_port"]), "--decode", decode.url]  # fmt: skip
    with running_router(*flags) as router:
        assert _answers(router.url) == expected
    after = stats(decode.url)
    rooms = after["pd_rooms_ok"] - before["pd_rooms_ok"]
    assert rooms == 5 * len(PROMPTS)
    assert after["pd_checksum_mismatches"] == 0
    layers = after["pd_checksum_layers_ok"] - before["pd_checksum_layers_ok"]
    assert layers == rooms * _layers_per_room(checkpoint)
    assert after["pd_bytes"] > before["pd_bytes"]
    assert after["spec_verify_ct"] > 0, "EAGLE ran at the decode"
    if backend == "mooncake":  # the DP-attention prefill: rooms of both parities, both groups
        _until_every_group_served(router_flags=flags, prefill=prefill)
    for server in (prefill, decode):
        wait_for(lambda s=server: idle(s.url), f"{server.url} idle")


def _until_every_group_served(router_flags: list[str], prefill: Server) -> None:
    """The router picks rooms at random: send more until each group has prefilled one (10
    rooms all of one parity happen once in 512 runs), then check each served its own."""
    groups = stats(prefill.url)["dp_groups"]
    with running_router(*router_flags) as router:
        for _ in range(40):
            if all(g["pd_rooms_ok"] > 0 for g in groups):
                break
            _generate(router.url, PROMPTS[0])
            groups = stats(prefill.url)["dp_groups"]
    assert len(groups) == 2 and all(g["pd_rooms_ok"] > 0 for g in groups), groups
    assert stats(prefill.url)["pd_rooms_failed"] == 0


@pytest.mark.parametrize("backend", ["nixl", "mooncake"])
def test_a_tp2_prefill_into_a_dp_attention_decode_behind_the_router(
    servers: dict, expected: list, checkpoint: Path, backend: str
) -> None:
    """The `--tp 2` prefill into a `--tp 2 --dp 2 --enable-dp-attention` decode (each attention
    group its own decode role, receiving its rooms' KV): the same answers, every layer's
    checksum matching, both groups served rooms. Over Mooncake the prefill is under DP
    attention too (each room from its group r % 2 to the decode group that holds it)."""
    prefix = _prefix(servers, backend)
    prefill, decode = servers[prefix + "prefill"], servers[prefix + "dpa_decode"]
    before = stats(decode.url)
    flags = ["--pd-disaggregation", "--prefill", prefill.url,
             str(servers[prefix + "bootstrap_port"]), "--decode", decode.url]  # fmt: skip
    with running_router(*flags) as router:
        assert _answers(router.url, quick=True) == [expected[i] for i in QUICK]
    after = stats(decode.url)
    rooms = after["pd_rooms_ok"] - before["pd_rooms_ok"]
    assert rooms == 2 * len(PROMPTS) and after["pd_checksum_mismatches"] == 0
    layers = after["pd_checksum_layers_ok"] - before["pd_checksum_layers_ok"]
    assert layers == rooms * _layers_per_room(checkpoint)
    groups = after["dp_groups"]
    assert len(groups) == 2 and all(g["pd_rooms_ok"] > 0 for g in groups)
    for server in (prefill, decode):
        wait_for(lambda s=server: idle(s.url), f"{server.url} idle")


def test_one_prefill_two_decodes_without_bootstrap_port(servers: dict, expected: list) -> None:
    """decode2 runs `--tp 2`: without its KV_SHARE round its second rank attends to pages it
    never received, and the answers differ."""
    prefill, decodes = servers["prefill"], [servers["decode"], servers["decode2"]]
    before = [stats(d.url)["pd_rooms_ok"] for d in decodes]
    flags = ["--pd-disaggregation", "--prefill", prefill.url, "--decode", decodes[0].url,
             "--decode", decodes[1].url, "--decode-policy", "round_robin"]  # fmt: skip
    with running_router(*flags) as router:
        assert _answers(router.url) == expected
    after = [stats(d.url)["pd_rooms_ok"] for d in decodes]
    assert all(a > b for a, b in zip(after, before)), "both decodes served rooms"
    assert sum(after) - sum(before) == 5 * len(PROMPTS)
    for server in (prefill, *decodes):
        wait_for(lambda s=server: idle(s.url), f"{server.url} idle")


def test_direct_requests_without_a_room_are_refused(servers: dict) -> None:
    for role in ("prefill", "decode"):
        reply = httpx.post(servers[role].url + "/generate", json={"text": "hi"}, timeout=30)
        assert reply.status_code == 400
        assert "bootstrap_room" in reply.json()["error"]["message"]

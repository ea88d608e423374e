"""`dsaserve serve --speculative-algorithm DFLASH`: the same greedy tokens as without speculation
through /generate and the chat route (openai SDK), on random GLM and DeepSeek-V3.2 targets with
random drafters, on the embedded model with its shipped drafter (no draft path) and with that
drafter's weights perturbed (only the speed may change); accept length in /generate meta_info,
/get_server_info and /metrics; structured output masks verification; a client that disconnects
mid-stream frees its KV."""

from __future__ import annotations

import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import httpx
import jsonschema
import openai
import pytest
import torch
from deepseek_checkpoint import make_deepseek_server_checkpoint
from dflash_models import write_drafter
from safetensors.torch import load_file, save_file
from server_harness import Server, make_server_checkpoint, running_server, wait_for

from dsaserve.assets import default_drafter_path, default_model_path

PROMPTS = [[5, 17, 99, 3, 250, 41, 7, 12, 300, 2, 64, 8], [9, 8], list(range(40, 95))]
CHATS = ["What is 15% of 240?", "What's the weather in Paris?", "Hello!", "What is 37 times 24?"]
SCHEMA = {"type": "object", "properties": {"answer": {"type": "integer"}},
          "required": ["answer"]}  # fmt: skip


@pytest.fixture(scope="module", params=["glm", "deepseek"])
def served(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"dflash_srv_{request.param}")
    make = make_server_checkpoint if request.param == "glm" else make_deepseek_server_checkpoint
    target = make(folder / "ckpt")
    return target, write_drafter(folder / "drafter", target, seed=4, block_size=6)


def generate_all(server, max_new=16) -> list[list[int]]:
    def one(ids):
        sampling = {"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True}
        body = {"input_ids": ids, "sampling_params": sampling}
        return httpx.post(server.url + "/generate", json=body, timeout=300).json()

    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # one batch of mixed lengths
        return list(pool.map(one, PROMPTS))


def chat_all(server, questions, max_tokens=48, **extra) -> list:
    client = openai.OpenAI(base_url=server.base, api_key="x", max_retries=0, timeout=300)

    def one(question):
        return client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": question}], temperature=0,
            max_tokens=max_tokens, **extra).choices[0]  # fmt: skip

    with ThreadPoolExecutor(len(questions)) as pool:
        return list(pool.map(one, questions))


def test_random_targets_equal_plain_and_report(served):
    target, drafter = served
    with running_server(target, "--chunked-prefill-size", "16") as server:
        want = [r["output_ids"] for r in generate_all(server)]
        chats = [c.message.content for c in chat_all(server, CHATS[:2])]
    flags = ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(drafter),
             "--chunked-prefill-size", "16", "--enable-metrics"]  # fmt: skip
    with running_server(target, *flags) as server:
        got = generate_all(server)
        assert [r["output_ids"] for r in got] == want
        again = generate_all(server)  # radix hits: the prompts' pages (drafter entries too)
        assert [r["output_ids"] for r in again] == want
        assert any(r["meta_info"]["cached_tokens"] > 0 for r in again)
        assert [c.message.content for c in chat_all(server, CHATS[:2])] == chats
        meta = got[0]["meta_info"]
        assert meta["spec_verify_ct"] > 0
        assert meta["spec_num_proposed_drafts"] == 5 * meta["spec_verify_ct"]  # block size 6
        info = httpx.get(server.url + "/get_server_info", timeout=30).json()
        state = info["internal_states"][0]
        assert state["spec_algorithm"] == "DFLASH" and state["spec_block_size"] == 6
        assert state["avg_spec_accept_length"] >= 1.0
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
        line = next(m for m in metrics.splitlines() if m.startswith("sglang:spec_accept_length"))
        assert float(line.rsplit(" ", 1)[1]) >= 1.0


def _embedded_runs(*flags) -> tuple[list, list, float]:
    with running_server(default_model_path(), *flags) as server:
        return _runs(server)


def _runs(server: Server) -> tuple[list, list, float]:
    native = generate_all(server, max_new=32)
    chats = chat_all(server, CHATS)
    structured = chat_all(server, CHATS[:1], max_tokens=200, response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": SCHEMA}})  # fmt: skip
    info = httpx.get(server.url + "/get_server_info", timeout=30).json()
    accept = info["internal_states"][0].get("avg_spec_accept_length", 0.0)
    texts = [(c.message.content, getattr(c.message, "reasoning_content", None)) for c in chats]
    return (
        [r["output_ids"] for r in native] + [s.message.content for s in structured],
        texts,
        accept,
    )


@pytest.fixture(scope="module")
def embedded_plain(readme_server: Server):
    """Plain decoding's answers from the README's server (tests/conftest.py): its page size,
    pool and threads differ from the DFLASH servers', and the tokens must not."""
    return _runs(readme_server)


def test_embedded_model_with_its_drafter_equals_plain(embedded_plain):
    native, texts, accept = _embedded_runs("--speculative-algorithm", "DFLASH")  # no draft path
    assert (native, texts) == embedded_plain[:2]
    assert accept >= 3.0  # the shipped drafter predicts the model (bench: >= 4 on its prompts)
    jsonschema.validate(json.loads(native[-1]), SCHEMA)


def test_perturbed_drafter_changes_only_speed(embedded_plain, tmp_path):
    folder = tmp_path / "perturbed"
    shutil.copytree(default_drafter_path(), folder)
    tensors = load_file(str(folder / "model.safetensors"))
    gen = torch.Generator().manual_seed(0)
    for name, t in tensors.items():
        if t.dim() > 1:
            noise = torch.randn(t.shape, generator=gen) * t.float().std()
            tensors[name] = (t.float() + 0.7 * noise).to(t.dtype)
    save_file(tensors, str(folder / "model.safetensors"))
    flags = ["--speculative-algorithm", "DFLASH2", "--speculative-draft-model-path", str(folder)]
    native, texts, accept = _embedded_runs(*flags)
    assert (native, texts) == embedded_plain[:2]
    assert 1.0 <= accept < 3.0


@pytest.mark.parametrize("served", ["glm"], indirect=True)  # the target's kind changes nothing
def test_disconnect_mid_stream_frees_kv(served):
    target, drafter = served
    flags = ["--speculative-algorithm", "DFLASH", "--speculative-draft-model-path", str(drafter),
             "--enable-metrics"]  # fmt: skip
    with running_server(target, *flags) as server:
        body = {
            "input_ids": PROMPTS[0],
            "stream": True,
            "sampling_params": {"max_new_tokens": 400, "temperature": 0, "ignore_eos": True},
        }
        with httpx.stream("POST", server.url + "/generate", json=body, timeout=120) as stream:
            for _ in zip(range(3), stream.iter_lines()):
                pass
        state = wait_for(lambda: _state_once_idle(server.url), "the disconnected request ended")
        # it ended by the disconnect's abort, not by running its 400 tokens to the end
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
        assert 'finish_reason="client_cancel"' in metrics and re.search(
            r'num_requests_total\{finish_reason="client_cancel"[^}]*\} 1\.0', metrics
        ), metrics
        used = state["internal_states"][0]["kv_used_tokens"]
        assert used == 0, used  # its pages went back (the radix cache may keep evictable ones)


def _state_once_idle(url: str) -> dict | None:
    """/get_server_info's answer, once no request runs (None while one does)."""
    state = httpx.get(url + "/get_server_info", timeout=30).json()
    return None if state["internal_states"][0]["num_running"] else state

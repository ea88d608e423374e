"""`dsaserve serve` with real ranks (gloo, OS-picked ports) against the single-process engine.

Through the openai SDK, fp32 random checkpoints (GLM with a shared indexer layer and an MTP layer,
EAGLE on; DeepSeek-V3.2 with YaRN), prompts longer than index_topk and than the prefill chunk,
a radix-cache hit: greedy tokens identical and per-step logprobs within 1e-4 for every layout.
Faults: kill -9 of a rank mid-stream, of node 1 (the stream ends in the server's engine error);
SIGSTOP of node 1's rank (/health 503 naming it, runtime/heartbeat.py); the process tree is
checked empty after.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from proc_sockets import alive
from server_harness import (
    Server,
    children,
    group_members,
    rendezvous_address,
    running_server,
    stop_group,
    wait_for,
    wait_unhealthy,
)
from speculative_models import make_mtp_checkpoint
from tiny_models import make_checkpoint

from dsaserve import LLM, SamplingParams

LONG = [(7 * i + 3) % 300 + 1 for i in range(40)]  # > index_topk (8), > the chunk (16)
PROMPTS = [LONG, [5, 17, 99, 3, 250], [(11 * i) % 290 + 2 for i in range(23)]]
CACHED = LONG[:32] + [9, 8, 7, 6]  # two cached pages of 16
NEW = 6
COMMON = ["--dtype", "float32", "--chunked-prefill-size", "16", "--watchdog-timeout", "60"]
EAGLE = ["--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2"]
NODE0_ADDR = "127.0.0.1:0"  # node 0 takes a port from the OS and prints it (Node1 reads it)


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("par_glm") / "ckpt"
    return make_mtp_checkpoint(folder, "glm", seed=3, indexer_types=["full", "shared", "full"])


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    # vocab 383: not a multiple of 2, so the vocab-parallel embedding and LM head are padded
    folder = tmp_path_factory.mktemp("par_dsv") / "ckpt"
    return make_checkpoint(folder, "deepseek", seed=2, vocab_size=383)


@pytest.fixture(scope="module")
def glm_expected(glm):
    return reference(glm, spec=True)


def reference(model, spec: bool) -> list[tuple[str, list[float]]]:
    extra = {"speculative_algorithm": "EAGLE", "speculative_num_steps": 2} if spec else {}
    llm = LLM(str(model), dtype="float32", max_total_tokens=4096, page_size=16,
              chunked_prefill_size=16, **extra)  # fmt: skip
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=0)
    outs = llm.generate([*PROMPTS, CACHED], params, use_tqdm=False)
    return [(o.text, [lp.logprob for lp in o.logprobs]) for o in outs]


def complete(client: openai.OpenAI, prompt: list[int]) -> tuple[str, list[float]]:
    """Greedy text and the logprob of each step's token."""
    r = client.completions.create(model="m", prompt=prompt, max_tokens=NEW, temperature=0,
                                  logprobs=1, extra_body={"ignore_eos": True})  # fmt: skip
    return r.choices[0].text, list(r.choices[0].logprobs.token_logprobs)


def check_layout(server, expected, paths: list[str]) -> dict:
    """The layout's tokens and logprobs are the one-process engine's; `paths`: the decode path
    each rank reports for all-decode steps (native ones must have run)."""
    client = openai.OpenAI(base_url=server.base, api_key="x", max_retries=0, timeout=240)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # batched together (and across DP groups)
        got = list(pool.map(lambda p: complete(client, p), PROMPTS))
    got.append(complete(client, CACHED))  # after LONG finished: a radix-cache hit
    for (text, lps), (want_text, want_lps) in zip(got, expected):
        assert text == want_text and len(lps) == len(want_lps) == NEW
        assert max(abs(a - b) for a, b in zip(lps, want_lps)) < 1e-4
    info = httpx.get(server.url + "/get_server_info", timeout=60).json()
    stats = info["internal_states"][0]
    assert stats["cached_tokens"] >= 32
    assert (stats.get("dp_groups") or [stats])[0]["rank_decode_paths"] == paths
    assert (stats["native_rank_rounds"] > 0) == (paths[0] == "native")
    return stats


def assert_gone(pids: list[int]) -> None:
    wait_for(lambda: not any(alive(pid) for pid in pids),
             f"{[pid for pid in pids if alive(pid)]} gone")  # fmt: skip


def disconnect_mid_stream(server) -> None:
    """A client that goes away after two chunks: its group goes idle (the caller checks that it
    was through an abort, counted as a client_cancel, not by running to the end)."""
    body = {"model": "m", "prompt": LONG, "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=120) as r:
        for n, _ in enumerate(r.iter_lines()):
            if n >= 2:
                break
    wait_for(lambda: not httpx.get(server.url + "/get_server_info", timeout=30).json()[
        "internal_states"][0]["num_running"], "the disconnected request to end")  # fmt: skip


def kill_rank_mid_stream(server, rank_pid: int) -> None:
    """kill -9 `rank_pid` while a stream runs: the stream errors, /health turns 503, and the
    engine process and every rank are gone (the API process stays, answering 503)."""
    engine = engine_pids(server)
    ranks = [pid for e in engine for pid in children(e)]
    client = openai.OpenAI(base_url=server.base, api_key="x", max_retries=0, timeout=120)
    stream = client.completions.create(model="m", prompt=LONG, max_tokens=400, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    with pytest.raises(openai.APIError) as failed:
        for i, chunk in enumerate(stream):
            if i == 2:
                os.kill(rank_pid, signal.SIGKILL)
            if chunk.choices and chunk.choices[0].finish_reason == "length":
                break
        else:
            raise AssertionError("stream ended without an error")
    assert_engine_dead(failed.value)  # the stream's error event (not a dropped connection)
    wait_unhealthy(server)
    assert_gone([*engine, *ranks])


def assert_engine_dead(error: openai.APIError) -> None:
    """The error the server sends when its engine is gone (server/engine_client.py EngineDead):
    neither a client-side timeout nor a dropped connection."""
    assert type(error) in (openai.APIError, openai.InternalServerError), repr(error)
    assert isinstance(error.body, dict) and error.body.get("code") == "engine_dead", error.body
    assert "engine unavailable" in error.message, error.message


def engine_pids(server) -> list[int]:
    """The engine process (rank 0), as the server reports it: the API process has other
    children too (the large-body decoder's worker)."""
    return [httpx.get(server.url + "/get_server_info", timeout=30).json()["engine_pid"]]


def rank_pids(api_pid: int) -> list[int]:
    """The ranks the engine process (rank 0) started."""
    engine = [p for p in children(api_pid) if "resource_tracker" not in cmdline(p)]
    return [pid for e in engine for pid in children(e)]


def cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace")
    except OSError:
        return ""


def test_glm_eagle_tp_and_dp_attention_layouts(glm, glm_expected):
    expected = glm_expected
    with running_server(glm, *COMMON, *EAGLE, "--tp", "2") as server:  # verify rows: native
        check_layout(server, expected, ["native"] * 2)
    flags = ["--tp", "4", "--dp", "2", "--ep", "4", "--enable-dp-attention",
             "--moe-a2a-backend", "deepep"]  # fmt: skip
    with running_server(glm, *COMMON, *EAGLE, *flags) as server:
        stats = check_layout(server, expected, ["native"] * 4)
        assert len(stats["dp_groups"]) == 2
        assert "DeepEP is not available" in server.output()
    flags = ["--tp", "2", "--dp", "2", "--enable-dp-attention",
             "--load-balance-method", "shortest_queue", "--enable-metrics"]  # fmt: skip
    with running_server(glm, *COMMON, *EAGLE, *flags) as server:
        stats = check_layout(server, expected, ["native"] * 2)
        groups = stats["dp_groups"]
        assert all(g["prompt_tokens"] > 0 for g in groups)  # both groups served requests
        assert stats["prompt_tokens"] == sum(g["prompt_tokens"] for g in groups)
        load = httpx.get(server.url + "/get_load", timeout=30).json()
        assert [entry["dp_rank"] for entry in load] == [0, 1]
        metrics = httpx.get(server.url + "/metrics", timeout=30).text
        assert 'sglang:dp_kv_used_tokens{model_name="ckpt",dp_rank="1"}' in metrics
        for _ in range(2):  # both groups: each abort goes to the group that holds the request
            disconnect_mid_stream(server)
        cancels = 'sglang:num_requests_total{finish_reason="client_cancel",model_name="ckpt"} 2.0'
        assert cancels in httpx.get(server.url + "/metrics").text
        kill_rank_mid_stream(server, rank_pids(server.process.pid)[0])


def test_dp_replicas_each_of_tp_ranks(glm, glm_expected):
    """`--dp 2` without DP attention: two engine processes of two ranks each behind one server
    (SGLang's data-parallel replicas, each with its own HiCache tiers), both used; kill -9 of
    one ends the other; SIGTERM leaves no process of the server's group."""
    flags = ["--tp", "2", "--dp", "2", "--load-balance-method", "round_robin",
             "--enable-hierarchical-cache"]  # fmt: skip
    with running_server(glm, *COMMON, *EAGLE, *flags) as server:
        check_layout(server, glm_expected, ["native"] * 2)
        client = openai.OpenAI(base_url=server.base, api_key="x", max_retries=0, timeout=240)
        for k in range(2):  # new prefixes, one after the other: one to each replica (whole pages)
            complete(client, [(7 * i + k) % 290 + 3 for i in range(20)])
        info = httpx.get(server.url + "/get_server_info", timeout=30).json()
        stats = info["internal_states"][0]
        assert all(g["hicache_d2h_bytes"] > 0 for g in stats["dp_groups"])  # each its own tiers
        assert info["dp_size"] == 2 and not info["enable_dp_attention"]
        groups = stats["dp_groups"]
        assert len(groups) == 2 and all(g["prompt_tokens"] > 0 for g in groups)
        assert stats["prompt_tokens"] == sum(g["prompt_tokens"] for g in groups)
        assert min(stats["dp_dispatched"]) > 0 and sum(stats["dp_dispatched"]) == 6
        replicas = info["dp_group_pids"]
        assert len(set(replicas)) == 2 and replicas[0] == info["engine_pid"]
        assert set(replicas) <= set(children(server.process.pid))  # two engine processes
        ranks = [pid for r in replicas for pid in children(r)]
        assert len(ranks) == 2  # one more rank each (--tp 2)
        load = httpx.get(server.url + "/get_load", timeout=30).json()
        assert [entry["dp_rank"] for entry in load] == [0, 1]
        os.kill(replicas[1], signal.SIGKILL)
        wait_unhealthy(server)
        assert_gone([*replicas, *ranks])  # the surviving replica was ended too
        server.process.send_signal(signal.SIGTERM)
        assert server.process.wait(60) == 0
        assert_gone(group_members(server.process.pid))


def test_offline_llm_drives_the_same_ranks(deepseek, monkeypatch):
    """The offline LLM's ranks, each bound to its core (SGLANG_CPU_OMP_THREADS_BIND) with
    `threads` per rank, decode on their native layers; rank 0 is this process (its binding and
    threads are put back after)."""
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=0)
    kw = dict(dtype="float32", max_total_tokens=2048, page_size=16, chunked_prefill_size=16)
    want = LLM(str(deepseek), **kw).generate(PROMPTS, params, use_tqdm=False)
    before = children(os.getpid())
    cores, threads = os.sched_getaffinity(0), torch.get_num_threads()
    first, second = sorted(cores)[:2]
    monkeypatch.setenv("SGLANG_CPU_OMP_THREADS_BIND", f"{first}|{second}")
    try:
        with LLM(str(deepseek), tp_size=2, ep_size=2, threads=1, **kw) as llm:
            ranks = [pid for pid in children(os.getpid()) if pid not in before]
            assert len(ranks) == 1
            assert os.sched_getaffinity(0) == {first} and os.sched_getaffinity(ranks[0]) == {second}
            assert torch.get_num_threads() == 1
            got = llm.generate(PROMPTS, params, use_tqdm=False)
            stats = llm.engine.stats()
            assert stats["rank_decode_paths"] == ["native"] * 2
            assert stats["native_rank_rounds"] > 0
    finally:
        os.sched_setaffinity(0, cores)
        torch.set_num_threads(threads)
    for a, b in zip(want, got):
        assert a.token_ids == b.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    assert_gone(ranks)


class Node1:
    """Node 1's own command (`--node-rank 1`), started while node 0 starts: node 0 runs
    `--dist-init-addr 127.0.0.1:0`, holds the port the OS gave it and prints it; node 1 is given
    that address (no port probed, closed and bound again later)."""

    def __init__(self, model: Path, *flags: str) -> None:
        self.command = [sys.executable, "-m", "dsaserve.cli", "serve", "--model-path", str(model),
                        "--max-total-tokens", "4096", "--page-size", "16", *flags,
                        "--node-rank", "1"]  # fmt: skip
        self.process: subprocess.Popen | None = None

    def __call__(self, node0: Server) -> None:
        where = rendezvous_address(node0)
        self.process = subprocess.Popen(
            [*self.command, "--dist-init-addr", where], start_new_session=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip

    def stop(self) -> None:
        if self.process is not None:
            stop_group(self.process)
            assert not group_members(self.process.pid)


def hang_rank(server) -> None:
    """SIGSTOP a rank: the watchdog (--watchdog-timeout) ends the engine, so the request fails
    with the server's engine error (not the client's own timeout), /health turns 503 and the
    engine and every rank (the stopped one too) are gone."""
    engine = engine_pids(server)
    ranks = [pid for e in engine for pid in children(e)]
    os.kill(ranks[0], signal.SIGSTOP)
    client = openai.OpenAI(base_url=server.base, api_key="x", max_retries=0,
                           timeout=240)  # hang guard  # fmt: skip
    with pytest.raises(openai.APIError) as failed:
        client.completions.create(model="m", prompt=LONG, max_tokens=4)
    assert_engine_dead(failed.value)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 503
    assert_gone([*engine, *ranks])


def stop_node1_rank(server, rank_pid: int) -> None:
    """SIGSTOP of node 1's rank: /health 503 naming rank 1 (its heartbeat comes through the
    store; runtime/heartbeat.py's STALE_S after its last beat), 200 again after SIGCONT."""
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200  # it beats
    os.kill(rank_pid, signal.SIGSTOP)
    try:
        assert "no heartbeat from rank 1" in wait_unhealthy(server)
    finally:
        os.kill(rank_pid, signal.SIGCONT)
    wait_for(lambda: httpx.get(server.url + "/health", timeout=10).status_code == 200,
             "node 1's rank beats again, /health stays 503")  # fmt: skip


def test_deepseek_tp_ep_and_two_nodes(deepseek):
    expected = reference(deepseek, spec=False)
    flags = [*COMMON, "--tp", "2", "--ep", "2", "--watchdog-timeout", "15"]
    with running_server(deepseek, *flags) as server:
        check_layout(server, expected, ["native"] * 2)
        hang_rank(server)
    nodes = ["--tp", "2", "--nnodes", "2"]
    node1 = Node1(deepseek, *COMMON, *nodes)
    try:
        with running_server(deepseek, *COMMON, *nodes, "--dist-init-addr", NODE0_ADDR,
                            "--node-rank", "0", while_starting=node1) as server:  # fmt: skip
            check_layout(server, expected, ["layered"] * 2)  # no shared memory across nodes
            stop_node1_rank(server, children(node1.process.pid)[0])
            kill_rank_mid_stream(server, node1.process.pid)  # node 1 (launcher; its rank follows)
        assert node1.process.wait(30) is not None  # hang guard
    finally:
        node1.stop()


def test_dp_attention_across_two_nodes(glm, glm_expected):
    """`--tp 2 --dp 2 --enable-dp-attention --nnodes 2`: group 1's engine runs on node 1 (its
    own command), driven from node 0's controller over TCP; the MoE step spans both nodes.
    kill -9 of node 1 mid-stream: 503, nothing left on either node."""
    nodes = ["--tp", "2", "--dp", "2", "--enable-dp-attention", "--nnodes", "2"]
    node1 = Node1(glm, *COMMON, *EAGLE, *nodes)
    try:
        with running_server(glm, *COMMON, *EAGLE, *nodes, "--dist-init-addr", NODE0_ADDR,
                            "--node-rank", "0", while_starting=node1) as server:  # fmt: skip
            stats = check_layout(server, glm_expected, ["layered"] * 2)
            assert all(g["prompt_tokens"] > 0 for g in stats["dp_groups"])  # both groups
            info = httpx.get(server.url + "/get_server_info", timeout=30).json()
            assert info["dp_group_pids"][1] in group_members(node1.process.pid)  # group 1, node 1
            kill_rank_mid_stream(server, node1.process.pid)
        assert node1.process.wait(30) is not None  # hang guard
    finally:
        node1.stop()


def test_port_zero_is_node_0s_alone(deepseek):
    """Node 0 may take `--dist-init-addr HOST:0` (the two-node tests above do); a later node
    cannot join a port it was not told."""
    command = [sys.executable, "-m", "dsaserve.cli", "serve", "--model-path", str(deepseek),
               "--tp", "2", "--nnodes", "2", "--node-rank", "1",
               "--dist-init-addr", NODE0_ADDR]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=120)  # hang guard
    assert done.returncode == 2, done.stderr
    assert "port 0 is node 0's" in done.stderr and "Traceback" not in done.stderr


def test_unreachable_dist_init_addr_fails_naming_it(deepseek):
    with socket.socket() as held:  # bound (nobody else takes the port), never listening: refused
        held.bind(("127.0.0.1", 0))
        addr = f"127.0.0.1:{held.getsockname()[1]}"
        command = [sys.executable, "-m", "dsaserve.cli", "serve", "--model-path", str(deepseek),
                   "--tp", "2", "--nnodes", "2", "--node-rank", "1", "--dist-init-addr", addr,
                   "--watchdog-timeout", "2"]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True,
                              timeout=120)  # hang guard  # fmt: skip
    assert done.returncode == 1
    assert addr in done.stderr and "within 2s" in done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--tp", "3"], "does not divide the model's 4 attention heads"),
        (["--tp", "2", "--ep", "3"], "--ep 3 must divide --tp 2"),
        (["--tp", "2", "--dp", "4", "--enable-dp-attention"], "--dp 4 must divide --tp 2"),
        (
            ["--tp", "2", "--dp", "2", "--nnodes", "2", "--dist-init-addr", "127.0.0.1:1"],
            "replicas (without --enable-dp-attention) run on one node",
        ),
    ],
)
def test_layout_refused_before_any_process(deepseek, flags, message, capsys):
    from dsaserve.server.launch import main

    before = children(os.getpid())
    assert main(["--model-path", str(deepseek), "--port", "0", *flags]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1
    assert children(os.getpid()) == before  # nothing was started

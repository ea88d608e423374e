"""CUDA-graph decode (dsaserve/engine/decode/cuda_graph.py, engine/decode/static.py).

On CPU the runner is forced on with `capture=False`: every decode step then runs the static,
padded step a graph would replay (rows padded to the bucket, the slot table to the context
bucket), so the engine's greedy tokens and logprobs must equal the layered path's (fp32, 1e-5),
on both families, with rows below and above index_topk, and padded rows must leave every real
KV slot alone. The `meta`-device tests show the captured step has no host synchronisation (a
read of a device value raises there) and that today's layered and fused decode paths do have
one. The `gpu` tests capture and replay real graphs and skip without CUDA.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
import torch
from server_harness import running_server
from speculative_models import make_mtp_checkpoint
from tiny_models import make_checkpoint
from triton_env import gpu, needs_triton

from dsaserve import LLM, SamplingParams
from dsaserve.engine.decode import cuda_graph
from dsaserve.engine.decode.cuda_graph import (
    Bucket,
    CudaGraphRunner,
    batch_buckets,
    context_buckets,
    row_buckets,
)
from dsaserve.engine.decode.fused import FusedDecode
from dsaserve.engine.decode.static import StaticDecode
from dsaserve.engine.kvcache.pool import KVPool
from dsaserve.kernels.registry import DEFAULT_KERNELS
from dsaserve.layers.forward_batch import ForwardBatch, forward_context
from dsaserve.model_config import ModelConfig
from dsaserve.models.dsa_moe import DsaMoeForCausalLM, index_cache_ids

CASES = [
    ("glm", 0, {"indexer_types": ["full", "shared", "full"]}),  # context bucket > index_topk 8
    ("deepseek", 2, {"index_topk": 16}),  # grouped routing, YaRN
    ("glm", 1, {"index_topk": 96}),  # every bucket <= index_topk: dense attention
]
PROMPT_LENS = (3, 9, 40)  # 3 rows: bucket 4, one padded row
NEW_TOKENS = 24
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=2)


def test_buckets_follow_sglang() -> None:
    assert batch_buckets(32) == [1, 2, 4, 8, 16, 24, 32]
    assert batch_buckets(20) == [1, 2, 4, 8, 16, 20]
    assert batch_buckets(300)[-4:] == [256, 272, 288, 300]
    assert row_buckets(4, 2) == [1, 2, 3, 4, 6, 12]  # verify rows: bs x (K + 1)
    assert context_buckets(300) == [64, 128, 256, 300]
    assert context_buckets(64) == [64]


@pytest.fixture
def forced_graphs(monkeypatch):
    """Build the runner on CPU too (eager replays of the static step); count its steps and
    check after each that no real KV slot but the batch's own out slots changed."""
    monkeypatch.setattr(cuda_graph, "GRAPH_DEVICES", ("cuda", "cpu"))
    steps: list[int] = []
    original = CudaGraphRunner.__call__

    def spy(self: CudaGraphRunner, batch: ForwardBatch, bucket=None) -> torch.Tensor:
        before = self.pool.kv_cache.clone(), self.pool.index_cache.clone()
        out = original(self, batch, bucket)
        after = self.pool.kv_cache, self.pool.index_cache
        changed = set()
        for old, new in zip(before, after):
            changed |= set((old != new).flatten(2).any(-1).any(0).nonzero()[:, 0].tolist())
        allowed = set(batch.out_slots.tolist()) | {self.inputs.scratch}
        assert changed <= allowed, changed - allowed
        rows = batch.input_ids.shape[0]
        steps.append((rows, (bucket or self.bucket(batch)).rows - rows))  # (rows, padded rows)
        return out

    monkeypatch.setattr(CudaGraphRunner, "__call__", spy)
    return steps


def _prompts(seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 380, (n,), generator=generator).tolist() for n in PROMPT_LENS]


def _assert_same(reference, got) -> None:
    for want, out in zip(reference, got):
        assert out.token_ids == want.token_ids
        for a, b in zip(want.logprobs, out.logprobs):
            assert abs(a.logprob - b.logprob) < 1e-5
            assert [t for t, _ in a.top] == [t for t, _ in b.top]
            assert max(abs(x - y) for (_, x), (_, y) in zip(a.top, b.top)) < 1e-5


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-seed{c[1]}")
def test_static_decode_matches_layered_model(case, tmp_path, forced_graphs):
    kind, seed, overrides = case
    folder = make_checkpoint(tmp_path / "ckpt", kind, seed, **overrides)
    prompts = _prompts(seed)
    args = dict(page_size=4, max_total_tokens=2048, disable_fused_decode=True)
    eager = LLM(str(folder), disable_cuda_graph=True, **args)
    layered = eager.generate(prompts, GREEDY, use_tqdm=False)
    assert not forced_graphs  # --disable-cuda-graph: no runner
    llm = LLM(str(folder), **args)
    graphs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert len(forced_graphs) >= NEW_TOKENS - 1  # every all-decode step took the runner
    assert llm.engine.stats()["cuda_graph"]["steps"] == len(forced_graphs)
    assert max(padded for _, padded in forced_graphs) >= 1  # 3 rows in bucket 4: one padded
    _assert_same(layered, graphs)


@needs_triton
def test_static_decode_with_the_triton_moe_op(tmp_path, forced_graphs):
    """--moe-runner-backend triton: the grouped GEMMs over the masked table (interpreter)."""
    folder = make_checkpoint(tmp_path / "ckpt", "deepseek", 2, index_topk=16)
    prompts = _prompts(2)
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, logprobs=2)
    args = dict(page_size=4, max_total_tokens=2048)
    eager = LLM(str(folder), disable_cuda_graph=True, disable_fused_decode=True, **args)
    layered = eager.generate(prompts, params, use_tqdm=False)
    llm = LLM(str(folder), moe_runner_backend="triton", **args)
    assert llm.engine.kernels.names["moe"] == "triton"
    _assert_same(layered, llm.generate(prompts, params, use_tqdm=False))
    assert forced_graphs


def test_static_decode_with_an_fp8_kv_cache(tmp_path, forced_graphs):
    folder = make_checkpoint(tmp_path / "ckpt", "glm", 0)
    prompts = _prompts(0)
    # the layered model against the graphs (an FP8 cache also decodes natively on CPU now)
    args = dict(page_size=4, max_total_tokens=2048, kv_cache_dtype="fp8_e4m3",
                disable_fused_decode=True)  # fmt: skip
    eager = LLM(str(folder), disable_cuda_graph=True, **args)
    layered = eager.generate(prompts, GREEDY, use_tqdm=False)
    graphs = LLM(str(folder), **args).generate(prompts, GREEDY, use_tqdm=False)
    assert forced_graphs
    _assert_same(layered, graphs)


def test_speculative_verify_runs_in_the_row_buckets(tmp_path, forced_graphs):
    """A verify of R requests with K drafts is R * (K + 1) decode rows: a bucket of its own."""
    folder = str(make_mtp_checkpoint(tmp_path / "ckpt", "glm", seed=3))
    prompts = _prompts(3)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    plain = LLM(folder, max_total_tokens=4096, page_size=4, disable_cuda_graph=True)
    want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    assert not forced_graphs
    spec = LLM(folder, max_total_tokens=4096, page_size=4, speculative_algorithm="EAGLE",
               speculative_num_steps=2)  # fmt: skip
    assert 12 in spec.engine.runner.graphs.rows  # bucket 4 x (2 drafts + 1): 3 verifying
    got = [o.token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert max(rows for rows, _ in forced_graphs) > 3  # verify forwards: 3 rows a request


def test_dflash_verify_with_taps_runs_in_the_row_buckets(tmp_path, forced_graphs):
    """DFLASH's verify (block 4: R * 4 rows) replays the graphs built with the drafter's target
    layers, whose outputs come back beside the final hidden states: plain decoding's tokens."""
    from dflash_models import write_drafter

    folder = make_checkpoint(tmp_path / "ckpt", "glm", seed=3)
    drafter = write_drafter(tmp_path / "drafter", folder, seed=1, block_size=4)
    prompts = _prompts(3)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    plain = LLM(str(folder), max_total_tokens=4096, page_size=4, disable_cuda_graph=True)
    want = [o.token_ids for o in plain.generate(prompts, params, use_tqdm=False)]
    spec = LLM(str(folder), max_total_tokens=4096, page_size=4, speculative_algorithm="DFLASH",
               speculative_draft_model_path=str(drafter))  # fmt: skip
    assert 16 in spec.engine.runner.graphs.rows  # bucket 4 x 4 rows: 3 verifying pad into it
    got = [o.token_ids for o in spec.generate(prompts, params, use_tqdm=False)]
    assert got == want
    assert max(rows for rows, _ in forced_graphs) > 4  # verify forwards: 4 rows a request


# ---- no host synchronisation: the step on the meta device -----------------------------------


def _meta_model(tmp_path, kind: str, seed: int) -> DsaMoeForCausalLM:
    folder = make_checkpoint(tmp_path / "ckpt", kind, seed)
    config = ModelConfig.from_hf(str(folder), {})
    with torch.device("meta"):
        model = DsaMoeForCausalLM(config).eval()
    model.rotary.inv_freq = model.rotary.inv_freq.to("meta")
    return model


def _meta_runner(model, fp8: bool, rows: int) -> CudaGraphRunner:
    config = model.config
    pool = KVPool(config, 16, 4, len(index_cache_ids(config, False)), False, torch.float32,
                  "meta", fp8=fp8)  # fmt: skip
    return CudaGraphRunner(model, pool, DEFAULT_KERNELS, [rows], 64, 0, capture=False)


def test_meta_device_refuses_host_reads() -> None:
    """The check itself: each kind of host synchronisation raises on `meta`."""
    x = torch.ones(4, device="meta")
    for read in (x.sum().item, x.tolist, lambda: int(x.max()), lambda: bool(x.all()),
                 x.nonzero, lambda: x[x > 0]):  # fmt: skip
        with pytest.raises((NotImplementedError, RuntimeError)):
            read()


@pytest.mark.parametrize("kind", ["glm", "deepseek"])
@pytest.mark.parametrize("rows", [1, 4])  # gathered and dense expert forms
@pytest.mark.parametrize("fp8", [False, True], ids=["float-kv", "fp8-kv"])
def test_captured_step_has_no_host_sync(tmp_path, kind, rows, fp8):
    runner = _meta_runner(_meta_model(tmp_path, kind, 0), fp8, rows)
    out = runner._run(Bucket(rows, 64))  # the function a graph captures
    hidden = runner.forward.__self__.model.config.hidden_size
    assert out.device.type == "meta" and out.shape == (rows, hidden)


@pytest.mark.parametrize("path", ["layered", "fused"])
def test_todays_decode_paths_do_sync(tmp_path, path):
    """The same batch through the layered model or FusedDecode reads routing on the host."""
    model = _meta_model(tmp_path, "glm", 0)
    runner = _meta_runner(model, False, 4)
    forward = model.forward if path == "layered" else FusedDecode.build(model).forward
    with forward_context(runner.inputs.batch(Bucket(4, 64), runner.pool, DEFAULT_KERNELS)):
        with pytest.raises(NotImplementedError, match="meta") as raised:
            forward()
    assert raised.traceback[-1].path.name in ("moe.py", "_tensor.py", "_meta_registrations.py")
    assert any(entry.path.name == "moe.py" for entry in raised.traceback)


def cpu_graphs_path() -> str:
    """PYTHONPATH with tests/cpu_graphs/ first: the processes started with it build the graphs'
    runner on CPU (its sitecustomize.py)."""
    here = Path(__file__).resolve().parent / "cpu_graphs"
    return os.pathsep.join(filter(None, [str(here), os.environ.get("PYTHONPATH")]))


def test_tp2_every_rank_replays_the_same_bucket(tmp_path, monkeypatch, forced_graphs):
    """`--tp 2`, EAGLE on: each rank builds its own runner over its shard and pool, and every
    FORWARD round runs it on both ranks in the same bucket (the leader's steps are counted; a
    follower running the layered model instead would all-reduce other sizes, which the
    shared-memory collectives refuse). Greedy tokens and logprobs equal the same layout without
    graphs, padded rows and verify rows included."""
    monkeypatch.setenv("PYTHONPATH", cpu_graphs_path())  # the spawned follower's
    folder = str(make_mtp_checkpoint(tmp_path / "ckpt", "glm", 0,
                                     indexer_types=["full", "shared", "full"]))  # fmt: skip
    prompts = _prompts(0)
    args = dict(tp_size=2, page_size=4, max_total_tokens=2048, speculative_algorithm="EAGLE",
                speculative_num_steps=2)  # fmt: skip
    with LLM(folder, disable_cuda_graph=True, **args) as eager:
        want = eager.generate(prompts, GREEDY, use_tqdm=False)
    with LLM(folder, **args) as llm:
        assert llm.engine.runner.graphs is None  # the rounds run them, on every rank
        got = llm.generate(prompts, GREEDY, use_tqdm=False)
        steps = llm.engine.stats()["cuda_graph"]["steps"]
    assert steps > 0 and steps == len(forced_graphs)
    assert max(rows for rows, _ in forced_graphs) > len(prompts)  # verify rows
    assert max(padded for _, padded in forced_graphs) >= 1
    _assert_same(want, got)


def test_dp_attention_groups_replay_one_common_bucket(tmp_path):
    """`--tp 2 --dp 2 --enable-dp-attention`, EAGLE on, requests on both groups at once, then
    one long request alone, through the openai SDK: every forward's groups replay the bucket of
    the largest group's rows and the widest context (the group without rows over padding), so
    the MLP's gather over the groups has the graphs' shapes on every rank (other sizes fail in
    the shared-memory collectives). The tokens and logprobs equal the same layout without
    graphs; both groups ran their graphs."""
    folder = make_mtp_checkpoint(tmp_path / "ckpt", "glm", 0,
                                 indexer_types=["full", "shared", "full"])  # fmt: skip
    prompts = [*_prompts(0), _prompts(1)[2]]
    flags = ["--tp", "2", "--dp", "2", "--enable-dp-attention", "--dtype", "float32",
             "--speculative-algorithm", "EAGLE", "--speculative-num-steps", "2",
             "--page-size", "4", "--max-total-tokens", "2048"]  # fmt: skip
    runs = {}
    for graphs in (False, True):
        env = {"PYTHONPATH": cpu_graphs_path()} if graphs else {}
        with running_server(folder, *flags, env=env) as server:
            client = openai.OpenAI(base_url=server.base, api_key="x", max_retries=0, timeout=300)
            lengths = [NEW_TOKENS] + [4] * (len(prompts) - 1)  # then one group decodes alone
            with ThreadPoolExecutor(len(prompts)) as pool:
                runs[graphs] = list(pool.map(_complete, [client] * len(prompts), prompts,
                                             lengths))  # fmt: skip
            info = httpx.get(server.url + "/get_server_info", timeout=60).json()
            groups = info["internal_states"][0]["dp_groups"]
        steps = [(g["cuda_graph"] or {}).get("steps", 0) for g in groups]
        assert all(n > 0 for n in steps) if graphs else steps == [0, 0], steps
    for (tokens, lps), (want_tokens, want_lps) in zip(runs[True], runs[False]):
        assert tokens == want_tokens
        assert max(abs(a - b) for a, b in zip(lps, want_lps)) < 1e-5


def _complete(client: openai.OpenAI, prompt: list[int], new: int) -> tuple[list[str], list[float]]:
    out = client.completions.create(model="m", prompt=prompt, max_tokens=new,
                                    temperature=0, logprobs=1,
                                    extra_body={"ignore_eos": True})  # fmt: skip
    return out.choices[0].logprobs.tokens, out.choices[0].logprobs.token_logprobs


def test_static_decode_refuses_split_models(tmp_path) -> None:
    model = _meta_model(tmp_path, "glm", 0)
    assert StaticDecode.supports(model)
    experts = model.model.layers[1].mlp.experts
    experts.num_experts *= 2  # as if this rank held half of the experts (EP)
    assert not StaticDecode.supports(model)


# ---- real capture and replay (CUDA only) -----------------------------------------------------


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kind", ["glm", "deepseek"])
def test_cuda_graph_replay_matches_eager(tmp_path, kind):
    folder = make_checkpoint(tmp_path / "ckpt", kind, 0, index_topk=16)
    prompts = _prompts(0)
    args = dict(device="cuda", dtype="float32", page_size=4, max_total_tokens=4096,
                dsa_decode_backend="torch", moe_runner_backend="torch")  # fmt: skip
    eager = LLM(str(folder), disable_cuda_graph=True, disable_fused_decode=True, **args)
    want = eager.generate(prompts, GREEDY, use_tqdm=False)
    graphed = LLM(str(folder), disable_fused_decode=True, **args)
    got = graphed.generate(prompts, GREEDY, use_tqdm=False)
    assert graphed.engine.runner.graphs.graphs  # graphs were captured and replayed
    _assert_same(want, got)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_every_replay_equals_the_eager_static_step(tmp_path, monkeypatch, kv):
    """Triton kernels (auto on CUDA), bf16: after each replay the same static step runs eagerly
    on the same buffers and must give the same hidden states."""
    original = CudaGraphRunner.__call__
    replays = []

    def check(self: CudaGraphRunner, batch: ForwardBatch) -> torch.Tensor:
        out = original(self, batch)
        eager = self._run(self.bucket(batch))[: out.shape[0]]
        torch.testing.assert_close(out, eager, rtol=1e-2, atol=1e-2)  # bf16; same kernels
        replays.append(out.shape[0])
        return out

    monkeypatch.setattr(CudaGraphRunner, "__call__", check)
    folder = make_checkpoint(tmp_path / "ckpt", "glm", 0, index_topk=16)
    llm = LLM(str(folder), device="cuda", dtype="bfloat16", page_size=64, max_total_tokens=8192,
              kv_cache_dtype=kv)  # fmt: skip
    assert llm.engine.kernels.names["moe"] == "triton"
    llm.generate(_prompts(0), SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True),
                 use_tqdm=False)  # fmt: skip
    assert len(replays) >= NEW_TOKENS - 1 and llm.engine.runner.graphs.graphs

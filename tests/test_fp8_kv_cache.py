"""The FP8 KV cache (FlashMLA's 656-byte entry, fp8 index keys) end to end on CPU.

The bound. e4m3 keeps 3 mantissa bits, bf16 keeps 7: a stored value's relative rounding error is
at most 2^-4 against 2^-8, 16x. While no discrete choice flips (dense attention: the context is
within index_topk, so the indexer selects everything), the logits' error is first order in the
cache's error, so FP8's error is at most ~16x that of a bf16 cache of the same fp32 model; we
allow 20x for second-order terms (softmax, the router). With the sparse path on, the indexer's
fp8 keys can flip a top-k choice, so there the check is on greedy tokens and their logprobs.
"""

from __future__ import annotations

import json

import torch
from engine_score import score
from tiny_models import make_checkpoint

from dsaserve import LLM, SamplingParams
from dsaserve.deploy.memory import kv_bytes_per_layer
from dsaserve.deploy.models import load_model
from dsaserve.kernels.kv_quant import (
    dequantize_entry,
    dequantize_key,
    index_key_bytes,
    mla_entry_bytes,
    quantize_entry,
    quantize_key,
)

PROMPT = torch.randint(0, 380, (60,), generator=torch.Generator().manual_seed(3)).tolist()


def _engine(folder, kv: str, **kw):
    return LLM(str(folder), dtype="float32", max_total_tokens=512, page_size=4,
               kv_cache_dtype=kv, **kw).engine  # fmt: skip


def _error(x: torch.Tensor, exact: torch.Tensor) -> float:
    return ((x - exact).abs().mean() / exact.abs().mean()).item()


def test_layout_is_flashmla_656_bytes_and_round_trips() -> None:
    assert mla_entry_bytes(512, 64) == 656 and index_key_bytes(128) == 132
    glm = load_model("GLM-5.3")
    assert kv_bytes_per_layer(glm, "fp8_e4m3") == 656 + 132  # the planner's figure agrees
    entry = torch.randn(5, 576) * torch.logspace(-3, 2, 576)
    raw = quantize_entry(entry, 512)
    assert raw.dtype == torch.uint8 and raw.shape == (5, 656)
    back = dequantize_entry(raw, 512, torch.float32)
    assert torch.equal(back[:, 512:], entry[:, 512:].bfloat16().float())  # rope stays bf16
    lat, got = entry[:, :512].view(5, 4, 128), back[:, :512].view(5, 4, 128)
    amax = lat.abs().amax(-1, keepdim=True)  # per-128 scale: error <= 2^-4 of value or ulp
    assert ((got - lat).abs() <= lat.abs() / 16 + amax / 448 * 2**-9 + 1e-12).all()
    key = torch.randn(7, 128)
    assert ((dequantize_key(quantize_key(key), torch.float32) - key).abs()
            <= key.abs() / 16 + 1e-6).all()  # fmt: skip


def test_fp8_cache_memory_and_dense_error_bound(tmp_path) -> None:
    folder = make_checkpoint(tmp_path / "dense", "glm", seed=7, index_topk=128)
    exact, bf16, fp8 = (_engine(folder, kv) for kv in ("auto", "bf16", "fp8_e4m3"))
    assert fp8.pool.kv_cache.dtype == torch.uint8 and fp8.kv_dtype == "fp8_e4m3"
    nbytes = lambda e: e.pool.kv_cache.nbytes + e.pool.index_cache.nbytes  # noqa: E731
    assert fp8.stats()["kv_bytes_per_token"] * fp8.pool.num_tokens == nbytes(fp8)
    assert nbytes(fp8) < 0.7 * nbytes(bf16) and nbytes(fp8) < 0.35 * nbytes(exact)
    logits = {name: score(e, PROMPT) for name, e in (("exact", exact), ("bf16", bf16),
                                                      ("fp8", fp8))}  # fmt: skip
    err_bf16, err_fp8 = (
        _error(logits["bf16"], logits["exact"]),
        _error(logits["fp8"], logits["exact"]),
    )
    assert 2 * err_bf16 < err_fp8 < 20 * err_bf16, (err_bf16, err_fp8)


def test_fp8_cache_greedy_tokens_and_logprobs_dense(tmp_path) -> None:
    folder = make_checkpoint(tmp_path / "m", "glm", seed=7, index_topk=128)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
    runs = {}
    for kv in ("auto", "fp8_e4m3"):
        llm = LLM(str(folder), dtype="float32", max_total_tokens=512, page_size=4,
                  kv_cache_dtype=kv)  # fmt: skip
        runs[kv] = llm.generate([PROMPT], params, use_tqdm=False)[0]
    exact, fp8 = runs["auto"], runs["fp8_e4m3"]
    assert exact.token_ids == fp8.token_ids
    for a, b in zip(exact.logprobs, fp8.logprobs):  # measured: < 0.03 nats
        assert abs(a.logprob - b.logprob) < 0.1


def test_bf16_cache_under_fp32_decodes_on_the_native_path(tmp_path):
    """`--kv-cache-dtype bf16` with an fp32 model (what the planner prints for GPUs): the native
    decode step reads the bf16 pool itself (the Python fused path reads only the compute dtype),
    with the layered path's tokens and logprobs over the same pool (1e-5)."""
    folder = make_checkpoint(tmp_path / "m", "glm", seed=7, index_topk=128)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    runs = []
    for layered in (False, True):
        llm = LLM(str(folder), dtype="float32", max_total_tokens=512, page_size=4,
                  kv_cache_dtype="bf16", disable_fused_decode=layered)  # fmt: skip
        step = llm.engine.runner.decode_step
        assert (step is None) == layered and (layered or step.native is not None)
        runs.append(llm.generate([PROMPT, PROMPT[:9]], params, use_tqdm=False))
    for a, b in zip(*runs):
        assert len(a.token_ids) == 6 and a.token_ids == b.token_ids
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-5


def test_fp8_cache_on_the_trained_model_sparse_path() -> None:
    """The embedded (trained) model, a prompt three times its index_topk: the indexer path with
    fp8 keys. Teacher-forced over prompt + greedy continuation, FP8's mean logprob error stays
    within the 16x unit-roundoff ratio of bf16's (measured ~5x: 0.22 vs 0.043 nats), top-1
    agrees at >= 85% of positions (measured 93%), and greedy decoding keeps the first tokens."""
    prompt = "The history of the city of Paris begins " * 12
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    engines = {kv: LLM(None, max_total_tokens=2048, kv_cache_dtype=kv)
               for kv in ("auto", "bf16", "fp8_e4m3")}  # fmt: skip
    outs = {kv: llm.generate([prompt], params, use_tqdm=False)[0] for kv, llm in engines.items()}
    exact = outs["auto"]
    assert len(exact.prompt_token_ids) > 2 * engines["auto"].engine.model_config.index_topk
    assert outs["fp8_e4m3"].token_ids[:4] == exact.token_ids[:4]
    seq = exact.prompt_token_ids + exact.token_ids
    target = torch.tensor(seq[1:])[:, None]
    logp = {kv: score(llm.engine, seq).log_softmax(-1) for kv, llm in engines.items()}
    error = lambda kv: (logp[kv][:-1].gather(1, target)  # noqa: E731
                        - logp["auto"][:-1].gather(1, target)).abs().mean().item()  # fmt: skip
    assert 0 < error("fp8_e4m3") < 16 * error("bf16")
    agree = (logp["fp8_e4m3"].argmax(-1) == logp["auto"].argmax(-1)).float().mean().item()
    assert agree >= 0.85


def test_server_reports_the_fp8_cache(server_checkpoint) -> None:
    """`dsaserve serve --kv-cache-dtype fp8_e4m3` serves, and /get_server_info shows the bytes."""
    import httpx
    from server_harness import running_server

    with running_server(server_checkpoint, "--kv-cache-dtype", "fp8_e4m3") as server:
        body = {"model": "x", "prompt": "Hello there", "max_tokens": 4, "temperature": 0}
        done = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
        assert done.status_code == 200 and done.json()["usage"]["completion_tokens"] == 4
        info = httpx.get(server.url + "/get_server_info", timeout=30).json()
    state = info["internal_states"][0]
    assert info["kv_cache_dtype"] == "fp8_e4m3" and state["kv_cache_dtype"] == "fp8_e4m3"
    assert state["kernel_backends"]["sparse_mla"] == "torch"
    config = json.loads((server_checkpoint / "config.json").read_text())
    layers = config["num_hidden_layers"]
    entry = mla_entry_bytes(config["kv_lora_rank"], config["qk_rope_head_dim"])
    assert state["kv_bytes_per_token"] == layers * (entry + index_key_bytes(
        config["index_head_dim"]))  # fmt: skip

"""The native decode step (kernels/cpu_decode.cpp) against the layered model: its thread pool,
batched decode rows, each KV cache dtype and bf16 weights.

- threads: 1, 2 and 3 threads give the layered path's greedy tokens and logprobs (fp32, 1e-5),
  and exactly the same bits as each other (every output element is one thread's fixed-order sum);
- batched rows: 24 requests decoding together give the layered path's answers, and a row's
  logits in a step of 24 are bit for bit its logits alone (weights are read once for all rows;
  no result depends on the batch);
- KV dtypes: with a bf16 or an FP8 pool, the native step (which dequantises in its inner loop)
  gives the layered path's tokens and logprobs over the same pool, and its stored bytes are
  kernels/kv_quant.py's, bit for bit;
- bf16 weights: a bf16 checkpoint decodes natively with its weights kept bf16, within the bf16
  path bound of docs/determinism.md.
"""

from __future__ import annotations

import pytest
import torch
from test_fused_decode import Counted
from tiny_models import make_checkpoint

from dsaserve import LLM, SamplingParams
from dsaserve.engine.decode import native as cpu_decode
from dsaserve.kernels.kv_quant import quantize_entry, quantize_key

pytestmark = pytest.mark.skipif(
    cpu_decode.extension() is None, reason="the native decode extension does not build here"
)


def run(folder, prompts, params, native: bool = True, native_threads: int = 0, **kw):
    """(outputs, native calls): native=False is the layered model for every step;
    `native_threads` sets the native step's pool threads apart from torch's."""
    kw = {"page_size": 4, "max_total_tokens": 4096, "disable_fused_decode": not native, **kw}
    llm = LLM(str(folder), **kw)
    step = llm.engine.runner.decode_step
    counted = None
    if native:
        assert step is not None and step.native is not None
        step.native.threads = native_threads
        step.fused.native = counted = Counted(step.native)
    outs = llm.generate(prompts, params, use_tqdm=False)
    return outs, counted.calls if counted is not None else 0


def prompts_of(lengths, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 380, (n,), generator=g).tolist() for n in lengths]


def assert_close(layered, native, tol: float = 1e-5) -> None:
    for a, b in zip(layered, native):
        assert b.token_ids == a.token_ids
        for x, y in zip(a.logprobs, b.logprobs):
            assert abs(x.logprob - y.logprob) < tol
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            assert max(abs(p - q) for (_, p), (_, q) in zip(x.top, y.top)) < tol


def errors(reference, outs) -> list[float]:
    """|logprob - the reference's| at every step up to each request's first differing token."""
    errs = []
    for a, b in zip(reference, outs):
        same = [x == y for x, y in zip(a.token_ids, b.token_ids)] + [False]
        errs += [abs(x.logprob - y.logprob)
                 for x, y in zip(a.logprobs[: same.index(False)], b.logprobs)]  # fmt: skip
    return errs


def logprobs(outs) -> list[list[float]]:
    return [[lp.logprob for lp in o.logprobs] + [v for lp in o.logprobs for _, v in lp.top]
            for o in outs]  # fmt: skip


PARAMS = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, logprobs=2)


@pytest.mark.parametrize("kind,overrides", [
    ("glm", {"indexer_types": ["full", "shared", "full"]}),
    ("deepseek", {"index_topk": 16, "hidden_size": 40}),  # a width that is no multiple of 16
], ids=["glm-shared-indexer", "deepseek-grouped"])  # fmt: skip
def test_threads_change_nothing(kind, overrides, tmp_path):
    folder = make_checkpoint(tmp_path / "m", kind, 1, **overrides)
    prompts = prompts_of((3, 9, 40, 70))
    layered, _ = run(folder, prompts, PARAMS, native=False, threads=1)
    for threads in (1, 2, 3):  # the engine's threads (prefill included)
        native, calls = run(folder, prompts, PARAMS, threads=threads)
        assert calls >= PARAMS.max_tokens - 1 and torch.get_num_threads() == threads
        assert_close(layered, native)
    torch.set_num_threads(1)
    # The decode steps alone on 1, 2, 3 pool threads (a one-thread prefill, whose GEMMs' sums
    # depend on torch's thread count): the same bits.
    runs = [run(folder, prompts, PARAMS, threads=1, native_threads=n)[0] for n in (1, 2, 3)]
    assert logprobs(runs[0]) == logprobs(runs[1]) == logprobs(runs[2])


def test_batched_rows_match_the_layered_path(tmp_path):
    """24 requests decode together on the native step (each weight row read once for all the
    rows): each answer is the layered path's."""
    folder = make_checkpoint(tmp_path / "m", "glm", 2)
    prompts = prompts_of([3 + 5 * i for i in range(24)], seed=2)  # 3..118: both sides of topk
    params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, logprobs=2)
    batched, calls = run(folder, prompts, params, threads=2, max_running_requests=32)
    torch.set_num_threads(1)
    assert calls <= 3 * params.max_tokens  # decoded together, not one request at a time
    layered, _ = run(folder, prompts, params, native=False, max_running_requests=32)
    assert_close(layered, batched)


@pytest.mark.parametrize("kv", ["auto", "bf16", "fp8_e4m3"])
def test_a_row_gets_the_same_bits_in_any_batch(kv, tmp_path):
    """The native step over a random pool: 24 rows (contexts 1..300, both sides of topk) in one
    step give, bit for bit, the logits each row gets alone, on 2 threads."""
    folder = make_checkpoint(tmp_path / "m", "glm", 6, indexer_types=["full", "shared", "full"])
    llm = LLM(str(folder), page_size=4, max_total_tokens=8192, kv_cache_dtype=kv)
    step, pool = llm.engine.runner.decode_step, llm.engine.pool
    step.native.threads = 2
    g = torch.Generator().manual_seed(6)
    for cache in (pool.kv_cache, pool.index_cache):  # random contents, the pool's own dtype
        if cache.dtype == torch.uint8:
            cache.copy_(torch.randint(0, 120, cache.shape, generator=g, dtype=torch.uint8))
        else:
            cache.copy_(torch.randn(cache.shape, generator=g).to(cache.dtype))
    rows = 24
    positions = torch.tensor([12 * t for t in range(rows)])
    slots = torch.randperm(pool.num_tokens, generator=g)[: rows * 300].view(rows, 300)
    ids = torch.randint(0, 380, (rows,), generator=g)
    saved = (pool.kv_cache.clone(), pool.index_cache.clone())
    together = step.fused.decode_logits(ids, positions, slots, pool.kv_cache, pool.index_cache)
    for t in range(rows):
        pool.kv_cache.copy_(saved[0]), pool.index_cache.copy_(saved[1])
        alone = step.fused.decode_logits(ids[t : t + 1], positions[t : t + 1], slots[t : t + 1],
                                         pool.kv_cache, pool.index_cache)  # fmt: skip
        assert torch.equal(alone[0], together[t]), t


@pytest.mark.parametrize("kv", ["bf16", "fp8_e4m3"])
def test_kv_dtypes_on_the_native_path(kv, tmp_path):
    folder = make_checkpoint(tmp_path / "m", "glm", 3, indexer_types=["full", "shared", "full"])
    prompts = prompts_of((5, 30, 60), seed=3)
    layered, _ = run(folder, prompts, PARAMS, native=False, kv_cache_dtype=kv)
    native, calls = run(folder, prompts, PARAMS, kv_cache_dtype=kv, threads=2)
    torch.set_num_threads(1)
    assert calls >= PARAMS.max_tokens - 1
    assert_close(layered, native)


def test_native_stores_the_pool_bytes_of_kv_quant():
    """The bytes the native layers write for a new token: FP8 entries (e4m3 latent, per-group
    scales, bf16 rope) and keys (e4m3 + scale), and bf16 rows, equal kv_quant.py's."""
    ext = cpu_decode.extension()
    g = torch.Generator().manual_seed(4)
    entry = torch.randn(33, 96, generator=g) * torch.logspace(-6, 3, 96)  # subnormals, clamping
    entry[3, :64] = 0  # an all-zero group (scale 1)
    fp8_entry = ext.store_rows(entry, torch.zeros(1, 1, 64 + 4 + 64, dtype=torch.uint8), 64)
    assert torch.equal(fp8_entry, quantize_entry(entry, 64))
    key = torch.randn(17, 40, generator=g) * torch.logspace(-5, 2, 40)
    fp8_key = ext.store_rows(key, torch.zeros(1, 1, 44, dtype=torch.uint8), 0)
    assert torch.equal(fp8_key, quantize_key(key))
    bf16 = ext.store_rows(entry, torch.zeros(1, 1, 96, dtype=torch.bfloat16), 64)
    assert torch.equal(bf16, entry.bfloat16())


@pytest.mark.parametrize("seed", [5, 6])
def test_bf16_weights_decode_natively(seed, tmp_path):
    """A bf16 checkpoint (bf16 model, bf16 pool): the native layers read the weights as bf16
    (half the bytes) and compute in fp32. Against the same checkpoint computed in fp32 (layered),
    up to each path's first differing greedy token: within 0.1 in logprob (docs/determinism.md's
    bf16 bound) and, on average, no further off than the layered bf16 path (measured on seeds
    5-7: 0.0033 / 0.0006 / 0.0051 vs the layered path's 0.0048 / 0.0013 / 0.0035)."""
    folder = make_checkpoint(tmp_path / "m", "glm", seed, dtype=torch.bfloat16)
    prompts = prompts_of((4, 20, 50), seed=seed)
    reference, _ = run(folder, prompts, PARAMS, native=False, dtype="float32")
    layered, _ = run(folder, prompts, PARAMS, native=False)
    llm = LLM(str(folder), page_size=4, max_total_tokens=4096)
    step = llm.engine.runner.decode_step
    assert step.fused.weights[0].w_in.dtype == torch.bfloat16
    step.fused.native = counted = Counted(step.native)
    native = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert counted.calls >= PARAMS.max_tokens - 1
    ours, theirs = errors(reference, native), errors(reference, layered)
    assert max(ours) < 0.1
    assert sum(ours) / len(ours) <= 2 * sum(theirs) / len(theirs) + 0.002

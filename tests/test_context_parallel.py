"""Context-parallel prefill (`--attn-cp-size 2 --enable-prefill-cp --cp-strategy interleave`).

Real ranks on gloo driven by the offline `LLM`, fp32 random checkpoints (GLM with a shared
indexer layer and an MTP layer, EAGLE on; DeepSeek-V3.2 with YaRN): prompts from shorter than
index_topk (8) to 20x it, several in one prefill batch, chunked prefill (chunks of 16, each
split over the 2 CP ranks) and a radix-cache hit. Greedy tokens identical and per-step
logprobs within 1e-4 of the single-process engine; the split really ran (all-gathers counted).
The layouts the guide refuses are refused in one line.
"""

from __future__ import annotations

import httpx
import openai
import pytest
from server_harness import running_server
from speculative_models import make_mtp_checkpoint
from tiny_models import make_checkpoint

from dsaserve import LLM, SamplingParams
from dsaserve.args import ArgsError, ServerArgs
from dsaserve.deploy.memory import kv_bytes_per_token, layer_split_kv_bytes_per_token
from dsaserve.deploy.models import load_model
from dsaserve.engine.ranks.rounds import DistributedModel
from dsaserve.runtime.preflight import refuse_unrunnable

TOPK = 8
PROMPTS = [[(7 * i + 3) % 300 + 1 for i in range(n)] for n in (20 * TOPK, 5, 40, 3 * TOPK + 1)]
CACHED = PROMPTS[0][:48] + [9, 8, 7, 6, 5]  # three cached pages of 16
NEW = 6
CP = dict(tp_size=2, attn_cp_size=2, enable_prefill_cp=True, cp_strategy="interleave")
BASE = dict(dtype="float32", max_total_tokens=4096, page_size=16, chunked_prefill_size=16)
EAGLE = dict(speculative_algorithm="EAGLE", speculative_num_steps=2)


@pytest.fixture(scope="module")
def glm(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cp_glm") / "ckpt"
    return make_mtp_checkpoint(folder, "glm", seed=3, indexer_types=["full", "shared", "full"])


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cp_dsv") / "ckpt"  # 6 layers: LayerSplit keeps 3 + 1
    return make_checkpoint(folder, "deepseek", seed=2, num_hidden_layers=6)


@pytest.fixture(scope="module")
def references(glm, deepseek):
    return {"glm": run(glm, **EAGLE), "deepseek": run(deepseek)}


def run(model, **kw) -> tuple[list, dict]:
    """Outputs of PROMPTS (batched), then of CACHED (a radix hit), and rank 0's counters: bytes
    received in CP all-gathers, bytes of LayerSplit fetches, bytes of its MLA KV tensors, KV
    bytes per token slot (MLA entries and indexer keys)."""
    params = SamplingParams(max_tokens=NEW, temperature=0, ignore_eos=True, logprobs=0)
    with LLM(str(model), **BASE, **kw) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        outs += llm.generate([CACHED], params, use_tqdm=False)
        model = llm.engine.model
        model = model.model if isinstance(model, DistributedModel) else model
        cps = [layer.self_attn.cp for layer in model.model.layers]
        pool = llm.engine.pool
        kv, slots = pool.kv_cache, pool.index_cache.shape[1]
        counters = {
            "gathered": sum(cp.gathered_bytes for cp in cps if cp is not None),
            "fetched": getattr(kv, "fetched_bytes", 0),
            "kv_bytes": kv.nbytes,
            "per_token": (kv.nbytes + pool.index_cache.nbytes) / slots,
        }
    return outs, counters


def check_same(want: list, got: list) -> None:
    for a, b in zip(want, got, strict=True):
        assert a.token_ids == b.token_ids
        assert len(b.logprobs) == NEW
        assert max(abs(x.logprob - y.logprob) for x, y in zip(a.logprobs, b.logprobs)) < 1e-4
    assert got[-1].cached_tokens >= 48


@pytest.mark.parametrize(
    ("kind", "split"), [("glm", False), ("glm", True), ("deepseek", False), ("deepseek", True)]
)
def test_cp2_matches_single_process(kind, split, glm, deepseek, references):
    model, extra = (glm, EAGLE) if kind == "glm" else (deepseek, {})
    flags = {**CP, **extra, "enable_dsa_cache_layer_split": split}
    want, whole = references[kind]
    got, counters = run(model, **flags)
    check_same(want, got)
    # every prompt token's latent entry (and indexer key) crossed from the other rank once
    assert counters["gathered"] > sum(len(p) for p in PROMPTS) * 32 * 4
    assert (counters["fetched"] > 0) == split
    # LayerSplit: rank 0 holds main layers 0, 2, ..., the MTP layer and one scratch layer (the
    # same slots as the unsplit pool): deepseek's 6 layers -> 4/6 of the bytes; glm's 3 + MTP
    # -> 4/4, no saving at 3 layers (the scratch costs one layer)
    main, mtp = (3, 1) if kind == "glm" else (6, 0)
    held = (len(range(0, main, 2)) + mtp + 1) if split else main + mtp
    assert counters["kv_bytes"] * (main + mtp) == whole["kv_bytes"] * held
    if kind == "deepseek":  # every layer has its own indexer: the planner's formulas hold
        spec = load_model(str(deepseek))
        assert whole["per_token"] == kv_bytes_per_token(spec, "fp32")  # 6 x (48 + 32) x 4 B
        expected = layer_split_kv_bytes_per_token(spec, "fp32", 2) if split else whole["per_token"]
        assert counters["per_token"] == expected  # split: 4 x 48 x 4 + 6 x 32 x 4 B


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (dict(cp_strategy="zigzag"), "zigzag is temporarily unavailable for GLM-5.3"),
        (dict(tp_size=4, dp_size=2, enable_dp_attention=True, cp_strategy=None),
         "needs --dp 1"),
        (dict(tp_size=4), "must equal --tp 4"),
        (dict(enable_prefill_cp=False), "add --enable-prefill-cp"),
        (dict(attn_cp_size=1), "needs --attn-cp-size > 1"),
        (dict(enable_prefill_cp=False, attn_cp_size=1, enable_dsa_cache_layer_split=True),
         "layer-split splits the KV over the CP ranks"),
    ],
)  # fmt: skip
def test_refused_layouts(flags, message):
    args = ServerArgs(**{**CP, **flags})
    with pytest.raises(ArgsError, match=message):
        refuse_unrunnable(args, "cpu")
    assert "\n" not in message


def test_refused_at_parse_time():
    with pytest.raises(ArgsError, match="use --dp 1"):
        ServerArgs(**{**CP, "tp_size": 4, "dp_size": 2, "enable_dp_attention": True})
    with pytest.raises(ArgsError, match="not allowed on decode workers"):
        ServerArgs(**CP, disaggregation_mode="decode")


def test_served_through_openai_sdk(deepseek, references):
    """`dsaserve serve --tp 2 --attn-cp-size 2 --enable-prefill-cp --cp-strategy interleave`:
    the longest prompt, then the radix hit, through the openai SDK match the single process."""
    want, _ = references["deepseek"]
    flags = ["--dtype", "float32", "--chunked-prefill-size", "16", "--watchdog-timeout", "120",
             "--tp", "2", "--attn-cp-size", "2", "--enable-prefill-cp", "--cp-strategy",
             "interleave"]  # fmt: skip
    with running_server(deepseek, *flags) as server:
        client = openai.OpenAI(base_url=server.base, api_key="x", max_retries=0, timeout=240)
        for prompt, expected in [(PROMPTS[0], want[0]), (CACHED, want[-1])]:
            r = client.completions.create(model="m", prompt=prompt, max_tokens=NEW, temperature=0,
                                          logprobs=1, extra_body={"ignore_eos": True})  # fmt: skip
            lps = r.choices[0].logprobs.token_logprobs
            assert r.choices[0].text == expected.text and len(lps) == NEW
            assert max(abs(a - b.logprob) for a, b in zip(lps, expected.logprobs)) < 1e-4
        info = httpx.get(server.url + "/get_server_info", timeout=60).json()
        assert info["internal_states"][0]["cached_tokens"] >= 48

"""Checkpoint loader and block-FP8 tools, checked against tiny transformers models."""

from __future__ import annotations

import json
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from dsaserve.kernels.block_fp8 import dequantize_block_fp8, quantize_block_fp8
from dsaserve.models.fp8 import quantize_checkpoint
from dsaserve.models.loader import load_checkpoint

transformers = pytest.importorskip("transformers")

REPO = Path(__file__).resolve().parents[1]
FAMILIES = {
    "glm": ("GlmMoeDsaConfig", "GlmMoeDsaForCausalLM"),
    "deepseek": ("DeepseekV32Config", "DeepseekV32ForCausalLM"),
}
TINY = dict(
    hidden_size=64, num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=4,
    num_experts_per_tok=2, n_group=1, topk_group=1, n_shared_experts=1, intermediate_size=96,
    moe_intermediate_size=48, q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=16,
    qk_nope_head_dim=16, v_head_dim=16, num_attention_heads=2, num_key_value_heads=2,
    index_n_heads=8, index_head_dim=32, vocab_size=200,
    rope_parameters={"rope_theta": 10000.0, "rope_type": "default"},
)  # fmt: skip
ROUTER = (".mlp.gate.weight", ".mlp.gate.e_score_correction_bias")
MTP = 2  # the MTP layer index = num_hidden_layers


def make_model(family: str, seed: int, device: str = "cpu") -> nn.Module:
    config_cls, model_cls = (getattr(transformers, n) for n in FAMILIES[family])
    torch.manual_seed(seed)
    with torch.device(device):
        model = model_cls(config_cls(**TINY))
    if device == "cpu":  # norms start at 1 and the router bias at 0: make every tensor distinct
        with torch.no_grad():
            for tensor in model.state_dict().values():
                tensor.normal_(0.0, 0.5)
    return model


def reference_state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone().contiguous() for n, t in model.state_dict().items()}


def write_fused(state: dict[str, torch.Tensor], folder: Path, model: nn.Module) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(folder)
    save_file(state, str(folder / "model.safetensors"))
    return folder


def reshard(folder: Path, parts: int = 3) -> None:
    """Split model.safetensors round-robin (experts and weight/scale pairs straddle files)."""
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        state = {n: f.get_tensor(n) for n in f.keys()}
    (folder / "model.safetensors").unlink()
    shards = [f"model-{i + 1:05d}-of-{parts:05d}.safetensors" for i in range(parts)]
    weight_map = {n: shards[i % parts] for i, n in enumerate(sorted(state))}
    for shard in shards:
        save_file({n: state[n] for n, s in weight_map.items() if s == shard}, str(folder / shard))
    index = {"metadata": {}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def assert_loaded(model: nn.Module, expected: dict[str, torch.Tensor]) -> None:
    state = model.state_dict()
    assert state.keys() == expected.keys()
    for name, want in expected.items():
        assert torch.equal(state[name], want.to(state[name].dtype)), name


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(scope="module")
def source(family: str) -> tuple[nn.Module, dict[str, torch.Tensor]]:
    model = make_model(family, seed=1)
    return model, reference_state(model)


@pytest.fixture(scope="module")
def fused_dir(tmp_path_factory, source) -> Path:
    model, state = source
    folder = write_fused(state, tmp_path_factory.mktemp("fused"), model)
    (folder / "tokenizer_config.json").write_text("{}")  # must be copied by quantize_checkpoint
    return folder


# ---------------------------------------------------------------- fp8 helpers


def test_quantize_block_fp8_partial_blocks_within_fp8_error() -> None:
    torch.manual_seed(0)
    w = torch.randn(2, 300, 200) * torch.logspace(-3, 1, 200)  # [E, out, in], varied magnitudes
    w8, scale = quantize_block_fp8(w, block=128)
    assert w8.dtype == torch.float8_e4m3fn and w8.shape == w.shape
    assert scale.dtype == torch.float32 and scale.shape == (2, 3, 2)
    assert torch.allclose(scale[1, 2, 1], w[1, 256:, 128:].abs().max() / 448)
    deq = dequantize_block_fp8(w8, scale, block=128)
    for i, j in [(0, 0), (299, 199), (130, 5), (5, 130)]:  # element-wise reference
        assert deq[1, i, j] == w8[1, i, j].float() * scale[1, i // 128, j // 128]
    per_element_scale = scale.repeat_interleave(128, 1)[:, :300].repeat_interleave(128, 2)
    bound = w.abs() / 16 + per_element_scale[:, :, :200] * 2**-9  # e4m3: 3 mantissa bits
    assert ((deq - w).abs() <= bound).all()
    assert not torch.equal(deq, w)


def test_dequantize_rejects_wrong_scale_shape() -> None:
    w8, _ = quantize_block_fp8(torch.randn(300, 200))
    with pytest.raises(ValueError, match=r"expected \[3, 2\]"):
        dequantize_block_fp8(w8, torch.ones(2, 2))


def test_zero_block_quantizes_to_zero() -> None:
    w = torch.zeros(130, 10)
    w[129, 3] = 2.0
    w8, scale = quantize_block_fp8(w)
    assert scale.shape == (2, 1) and scale[0, 0] == 1.0
    assert torch.equal(dequantize_block_fp8(w8, scale), w)


# ---------------------------------------------------------------- bf16 / fp32 layouts


@pytest.mark.parametrize("layout", ["fused", "per_expert", "sharded_per_expert", "sharded_fused"])
def test_load_layouts_exactly(family, source, fused_dir, tmp_path, layout) -> None:
    model, state = source
    folder = fused_dir
    if "per_expert" in layout:  # transformers 5 saves the published per-expert layout
        folder = tmp_path / "ckpt"
        model.save_pretrained(folder)
        with safe_open(str(folder / "model.safetensors"), "pt") as f:
            assert "model.layers.1.mlp.experts.3.up_proj.weight" in f.keys()
    elif layout == "sharded_fused":
        folder = write_fused(state, tmp_path / "ckpt", model)
    if layout.startswith("sharded"):
        reshard(folder)
    fresh = make_model(family, seed=2)
    load_checkpoint(fresh, folder, torch.float32, show_progress=False)
    assert_loaded(fresh, state)


def test_bf16_load_keeps_router_fp32(source, fused_dir, family) -> None:
    _, state = source
    fresh = make_model(family, seed=3)
    load_checkpoint(fresh, fused_dir, torch.bfloat16, show_progress=False)
    for name, tensor in fresh.state_dict().items():
        assert tensor.dtype == (torch.float32 if name.endswith(ROUTER) else torch.bfloat16), name
        assert torch.equal(tensor, state[name].to(tensor.dtype)), name


@pytest.mark.parametrize("fp8", [False, True])
def test_meta_model_is_materialised(source, fused_dir, family, tmp_path, capsys, fp8) -> None:
    _, state = source
    folder = fused_dir
    if fp8:
        folder = tmp_path / "fp8"
        quantize_checkpoint(fused_dir, folder, block=32)
        state = fp8_expectation(folder)
        state.update(merge_experts(state))
        state = {n: state[n] for n in source[1]}
    fresh = make_model(family, seed=0, device="meta")
    load_checkpoint(fresh, folder, torch.float32, show_progress=True)
    assert all(not t.is_meta for t in fresh.state_dict().values())
    assert all(isinstance(p, nn.Parameter) for p in fresh.parameters())
    assert_loaded(fresh, state)
    assert "Loading" in capsys.readouterr().err


def test_tied_embedding_needs_one_copy(family, source, tmp_path) -> None:
    model, state = source
    untied = {n: t for n, t in state.items() if n != "lm_head.weight"}
    folder = write_fused(untied, tmp_path / "ckpt", model)
    fresh = make_model(family, seed=11)
    fresh.lm_head.weight = fresh.model.embed_tokens.weight
    load_checkpoint(fresh, folder, torch.bfloat16, show_progress=False)
    assert fresh.lm_head.weight is fresh.model.embed_tokens.weight
    assert torch.equal(fresh.lm_head.weight, state["model.embed_tokens.weight"].bfloat16())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fp8", [False, True])
def test_load_into_cuda_model(family, source, fused_dir, tmp_path, fp8) -> None:
    _, state = source
    folder = fused_dir
    if fp8:
        folder = tmp_path / "fp8"
        quantize_checkpoint(fused_dir, folder, block=32)
        state = fp8_expectation(folder)
        state.update(merge_experts(state))
    fresh = make_model(family, seed=12).to("cuda", torch.bfloat16)
    load_checkpoint(fresh, folder, torch.bfloat16, show_progress=False)
    for name, tensor in fresh.state_dict().items():
        assert tensor.is_cuda, name
        assert torch.equal(tensor.cpu(), state[name].to(tensor.dtype)), name


# ---------------------------------------------------------------- FP8


def fp8_expectation(folder: Path) -> dict[str, torch.Tensor]:
    """What loading the FP8 folder must give: dequantised weights, the rest as stored."""
    files = sorted(folder.glob("*.safetensors"))
    tensors = {}
    for file in files:
        with safe_open(str(file), "pt") as f:
            tensors.update({n: f.get_tensor(n) for n in f.keys()})
    block = json.loads((folder / "config.json").read_text())["quantization_config"]
    block = tuple(block["weight_block_size"])
    out = {}
    for name, t in tensors.items():
        if name.endswith("_scale_inv"):
            continue
        scale = tensors.get(name + "_scale_inv")
        out[name] = t if scale is None else dequantize_block_fp8(t, scale, block)
    return out


def merge_experts(flat: dict[str, torch.Tensor], layer: int = 1) -> dict[str, torch.Tensor]:
    prefix = f"model.layers.{layer}.mlp.experts"
    experts = range(TINY["n_routed_experts"])
    gate_up = [
        torch.cat([flat[f"{prefix}.{e}.{p}_proj.weight"] for p in ("gate", "up")]) for e in experts
    ]
    down = [flat[f"{prefix}.{e}.down_proj.weight"] for e in experts]
    return {
        f"{prefix}.gate_up_proj": torch.stack(gate_up),
        f"{prefix}.down_proj": torch.stack(down),
    }


@pytest.mark.parametrize("sharded", [False, True])
def test_fp8_checkpoint_loads_dequantised(family, source, fused_dir, tmp_path, sharded) -> None:
    model, state = source
    fp8_dir = tmp_path / "fp8"
    quantize_checkpoint(fused_dir, fp8_dir, block=32)  # 32: several blocks, partial edges
    assert (fp8_dir / "tokenizer_config.json").is_file()
    config = json.loads((fp8_dir / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [32, 32]
    with safe_open(str(fp8_dir / "model.safetensors"), "pt") as f:
        dtypes = {n: f.get_slice(n).get_dtype() for n in f.keys()}
    assert dtypes["model.layers.1.mlp.experts.2.gate_proj.weight"] == "F8_E4M3"
    assert dtypes["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"] == "F32"
    kept = [
        "model.layers.1.mlp.gate.weight",
        "model.layers.1.self_attn.indexer.weights_proj.weight",
        "model.layers.0.self_attn.indexer.k_norm.bias",
        "model.embed_tokens.weight",
        "lm_head.weight",
        "model.norm.weight",
    ]
    assert all(dtypes[n] == "F32" for n in kept)
    if sharded:
        reshard(fp8_dir)
    expected = fp8_expectation(fp8_dir)
    expected.update(merge_experts(expected))
    fresh = make_model(family, seed=4)
    load_checkpoint(fresh, fp8_dir, torch.float32, show_progress=False)
    assert_loaded(fresh, {n: expected[n] for n in state})
    q_b = "model.layers.1.self_attn.q_b_proj.weight"
    error = (expected[q_b] - state[q_b]).abs()
    assert error.max() > 0 and (error <= state[q_b].abs() / 16 + 1e-3).all()


def test_fused_fp8_experts(family, source, tmp_path) -> None:
    model, state = source
    fp8_state = dict(state)
    expected = dict(state)
    for kind in ("gate_up_proj", "down_proj"):
        name = f"model.layers.1.mlp.experts.{kind}"
        fp8_state[name], fp8_state[name + "_scale_inv"] = quantize_block_fp8(state[name], 32)
        expected[name] = dequantize_block_fp8(fp8_state[name], fp8_state[name + "_scale_inv"], 32)
    folder = write_fused(fp8_state, tmp_path / "ckpt", model)
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [32, 32]}
    (folder / "config.json").write_text(json.dumps(config))
    fresh = make_model(family, seed=5)
    load_checkpoint(fresh, folder, torch.float32, show_progress=False)
    assert_loaded(fresh, expected)


# ---------------------------------------------------------------- MTP layer


def add_mtp_layer(model: nn.Module, family: str) -> nn.Module:
    """Stand-in for a model that loads the MTP layer: model.layers.2 = decoder layer + extras."""
    module = sys.modules[type(model).__module__]
    prefix = "GlmMoeDsa" if family == "glm" else "DeepseekV32"
    hidden = TINY["hidden_size"]
    layer = getattr(module, f"{prefix}DecoderLayer")(model.config, 1)
    layer.enorm, layer.hnorm = nn.RMSNorm(hidden), nn.RMSNorm(hidden)
    layer.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
    layer.shared_head = nn.Module()
    layer.shared_head.norm = nn.RMSNorm(hidden)
    model.model.layers.append(layer)
    with torch.no_grad():
        for tensor in layer.state_dict().values():
            tensor.normal_(0.0, 0.5)
    return model


def test_mtp_layer_loads_or_is_ignored(family, tmp_path) -> None:
    source = add_mtp_layer(make_model(family, seed=6), family)
    state = reference_state(source)
    mtp_state = {n: t for n, t in state.items() if n.startswith(f"model.layers.{MTP}.")}
    assert f"model.layers.{MTP}.eh_proj.weight" in mtp_state
    base_dir = tmp_path / "base"
    source.model.layers = source.model.layers[:MTP]
    source.save_pretrained(base_dir)  # per-expert main layers, without the MTP layer
    copies = {  # DeepSeek checkpoints ship copies of the embedding and head in the MTP layer
        f"model.layers.{MTP}.embed_tokens.weight": state["model.embed_tokens.weight"],
        f"model.layers.{MTP}.shared_head.head.weight": state["lm_head.weight"],
    }
    save_file({**mtp_state, **copies}, str(base_dir / "mtp.safetensors"))
    with safe_open(str(base_dir / "model.safetensors"), "pt") as f:
        weight_map = dict.fromkeys(f.keys(), "model.safetensors")
    weight_map.update(dict.fromkeys([*mtp_state, *copies], "mtp.safetensors"))
    (base_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))

    with_mtp = add_mtp_layer(make_model(family, seed=7), family)
    load_checkpoint(with_mtp, base_dir, torch.float32, show_progress=False)
    assert_loaded(with_mtp, state)
    without_mtp = make_model(family, seed=8)
    load_checkpoint(without_mtp, base_dir, torch.float32, show_progress=False)
    assert_loaded(without_mtp, {n: t for n, t in state.items() if n not in mtp_state})

    fp8_dir = tmp_path / "fp8"
    quantize_checkpoint(base_dir, fp8_dir)
    with safe_open(str(fp8_dir / "mtp.safetensors"), "pt") as f:
        assert f.get_slice(f"model.layers.{MTP}.eh_proj.weight").get_dtype() == "F32"
        assert f"model.layers.{MTP}.self_attn.o_proj.weight_scale_inv" in f.keys()
        assert f"model.layers.{MTP}.mlp.experts.1.up_proj.weight_scale_inv" in f.keys()
    fp8_model = add_mtp_layer(make_model(family, seed=9), family)
    load_checkpoint(fp8_model, fp8_dir, torch.float32, show_progress=False)
    expected = fp8_expectation(fp8_dir)
    expected.update(merge_experts(expected, 1) | merge_experts(expected, MTP))
    assert_loaded(fp8_model, {n: expected[n] for n in state})


def test_quantize_script(tmp_path, capsys) -> None:
    src, dst = tmp_path / "src", tmp_path / "out"
    src.mkdir()
    (src / "config.json").write_text(json.dumps({"model_type": "glm_moe_dsa"}))
    weight = torch.randn(80, 70)
    name = "model.layers.0.self_attn.q_a_proj.weight"
    save_file({name: weight, "model.norm.weight": torch.ones(70)}, str(src / "model.safetensors"))
    script = str(REPO / "scripts" / "quantize_fp8.py")
    run = [sys.executable, script, str(src), str(dst), "--block", "64"]
    done = subprocess.run(run, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    config = json.loads((dst / "config.json").read_text())
    assert config["quantization_config"]["weight_block_size"] == [64, 64]
    with safe_open(str(dst / "model.safetensors"), "pt") as f:
        assert f.get_tensor(name + "_scale_inv").shape == (2, 2)
        assert f.get_tensor("model.norm.weight").dtype == torch.float32
    main = runpy.run_path(script)["main"]
    assert main([str(src), str(dst)]) == 1
    assert "not empty" in capsys.readouterr().err

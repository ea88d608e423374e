"""The DFlash / DFlash2 drafter format: published configs and tensor names load unchanged, a
drafter for another target is refused in one line naming the field, and the served drafter
(paged context entries, the `draft_attention` op, the selector walk) computes what the reference
computes over plain tensors.

The reference here is written from z-lab/dflash's `dflash/model.py` semantics, over explicit
tensors: the context is hidden_norm(fc(taps)), every layer's keys and values are
k_proj / v_proj of [context ‖ block] with k_norm and NeoX RoPE at their positions, the block
queries attend all of them (non-causally), the DFlash2 grouped dynamic convolutions wrap the
attention and the MLP, and the selector walks each row's top-k.
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from dflash_models import drafter_config, random_tensors, write_drafter
from safetensors.torch import load_file, save_file
from tiny_models import make_checkpoint

from dsaserve.engine.spec.draft import DraftContext, Drafter
from dsaserve.kernels.registry import Kernels
from dsaserve.model_config import ModelConfig
from dsaserve.models.checkpoint_files import CheckpointError
from dsaserve.models.dflash_loader import load_drafter
from dsaserve.server import launch

# the reference fixture's tensor names (z-lab/dflash tests/fixtures/dflash2-safetensors-header.json)
TOP = [
    "candidate_selector.hidden_projection.weight",
    "candidate_selector.predecessor_codebook",
    "candidate_selector.successor_codebook",
    "fc.weight",
    "hidden_norm.weight",
    "norm.weight",
]
PER_LAYER = ["attention_conv.base_kernel", "attention_conv.kernel_projection.weight",
             "input_layernorm.weight", "mlp.down_proj.weight", "mlp.gate_proj.weight",
             "mlp.up_proj.weight", "mlp_conv.base_kernel", "mlp_conv.kernel_projection.weight",
             "post_attention_layernorm.weight", "self_attn.k_norm.weight",
             "self_attn.k_proj.weight", "self_attn.o_proj.weight", "self_attn.q_norm.weight",
             "self_attn.q_proj.weight", "self_attn.v_proj.weight"]  # fmt: skip


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("dflash_fmt") / "ckpt", "glm", seed=4)


def test_published_names(target):
    config = drafter_config(json.loads((target / "config.json").read_text()), layers=5)
    names = set(random_tensors(config))
    assert names == {*TOP, *(f"layers.{i}.{n}" for i in range(5) for n in PER_LAYER)}


@pytest.mark.parametrize("kw", [{}, {"v2": False}, {"window": 6},
                                {"window": 6, "causal": True}])  # fmt: skip
def test_loads_unchanged_and_keeps_every_tensor(target, tmp_path, kw):
    folder = write_drafter(tmp_path / "d", target, seed=3, **kw)
    model = load_drafter(folder, ModelConfig.from_hf(target), torch.float32)
    stored = load_file(str(folder / "model.safetensors"))
    params = dict(model.named_parameters())
    assert set(params) == set(stored)
    for name, tensor in stored.items():
        assert torch.equal(params[name], tensor.float()), name
    assert model.config.windows == ((6,) * 2 if "window" in kw else (None, None))


def test_codebooks_with_weight_suffix_and_shared_copies_load(target, tmp_path):
    folder = write_drafter(tmp_path / "d", target, seed=3)
    tensors = load_file(str(folder / "model.safetensors"))
    for name in ("predecessor_codebook", "successor_codebook"):
        tensors[f"candidate_selector.{name}.weight"] = tensors.pop(f"candidate_selector.{name}")
    tensors["lm_head.weight"] = torch.zeros(3, 3)  # a copy of the target's: skipped
    save_file(tensors, str(folder / "model.safetensors"))
    model = load_drafter(folder, ModelConfig.from_hf(target), torch.float32)
    params = dict(model.named_parameters())
    # each codebook under its bare name, the lm_head copy left out, every value as saved
    want = {name.removesuffix(".weight") if "codebook" in name else name: tensor
            for name, tensor in tensors.items() if name != "lm_head.weight"}  # fmt: skip
    assert set(params) == set(want)
    for name, tensor in want.items():
        assert torch.equal(params[name], tensor.float()), name


@pytest.mark.parametrize("change,field", [
    ({"hidden_size": 48}, "hidden_size 48"),
    ({"vocab_size": 1000}, "vocab_size 1000"),
    ({"dflash_config": {"target_layer_ids": [0, 7]}}, "target_layer_ids [7]"),
])  # fmt: skip
def test_misfit_refused_in_one_line(target, tmp_path, capsys, change, field):
    folder = write_drafter(tmp_path / "d", target, seed=3)
    raw = json.loads((folder / "config.json").read_text())
    for key, value in change.items():
        raw[key] = {**raw[key], **value} if isinstance(value, dict) else value
    (folder / "config.json").write_text(json.dumps(raw))
    code = launch.main(["--model-path", str(target), "--port", "0", "--speculative-algorithm",
                        "DFLASH", "--speculative-draft-model-path", str(folder)])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and field in err, err


def test_missing_or_foreign_tensor_named(target, tmp_path):
    folder = write_drafter(tmp_path / "d", target, seed=3)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors["layers.1.mlp_conv.base_kernel"]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="layers.1.mlp_conv.base_kernel is missing"):
        load_drafter(folder, ModelConfig.from_hf(target), torch.float32)
    tensors["layers.1.mlp_conv.base_kernel"] = torch.zeros(2, 2, 64)
    tensors["layers.9.extra.weight"] = torch.zeros(1)
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="unexpected tensor layers.9.extra.weight"):
        load_drafter(folder, ModelConfig.from_hf(target), torch.float32)


# ---- the reference math over plain tensors ---------------------------------------------------
def _rms(x, w, eps=1e-5):
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, pos, theta, dim):  # x [..., T, d] NeoX (rotate_half), as Qwen3
    inv = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    freqs = pos[:, None].float() * inv[None]
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    half = torch.cat([-x[..., dim // 2 :], x[..., : dim // 2]], -1)
    return x * cos + half * sin


def _conv(x, dynamic, base, group):  # x [T, H]; dynamic [T, K, G]; base [K, H]
    t, h = x.shape
    blocks, out = x.view(t, h // group, group), torch.zeros(t, h // group, group)
    for o in range(base.shape[0]):
        shifted = torch.cat([torch.zeros(o, h // group, group), blocks[: t - o]]) if o else blocks
        out += (base[o].view(h // group, group) + dynamic[:, o, :, None]) * shifted
    return out.view(t, h)


def reference_block(w, cfg, taps, ctx_pos, ids, pos, embed, head):
    """Block hidden states [B, H] and the greedy path, computed from explicit tensors."""
    d, heads, kv = cfg["head_dim"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    theta, draft = cfg["rope_parameters"]["rope_theta"], cfg["dflash_config"]
    ctx = _rms(taps @ w["fc.weight"].T, w["hidden_norm.weight"])
    x, k_conv = embed[ids], draft.get("conv_kernel_size")
    for i in range(cfg["num_hidden_layers"]):
        p = lambda n, i=i: w[f"layers.{i}.{n}"]  # noqa: E731
        h = _rms(x, p("input_layernorm.weight"))
        if k_conv:
            dyn = (h @ p("attention_conv.kernel_projection.weight").T).view(len(ids), 2, k_conv, -1)
            h = _conv(h, dyn[:, 0], p("attention_conv.base_kernel")[0], draft["conv_group_size"])
        q = _rms(
            (h @ p("self_attn.q_proj.weight").T).view(-1, heads, d), p("self_attn.q_norm.weight")
        )
        both = torch.cat([ctx, h])
        k = _rms(
            (both @ p("self_attn.k_proj.weight").T).view(-1, kv, d), p("self_attn.k_norm.weight")
        )
        v = (both @ p("self_attn.v_proj.weight").T).view(-1, kv, d)
        q = _rope(q.transpose(0, 1), pos, theta, d)
        k = _rope(k.transpose(0, 1), torch.cat([ctx_pos, pos]), theta, d)
        out = F.scaled_dot_product_attention(q, k, v.transpose(0, 1), enable_gqa=True)
        attn = out.transpose(0, 1).reshape(len(ids), -1) @ p("self_attn.o_proj.weight").T
        if k_conv:
            attn = _conv(
                attn, dyn[:, 1], p("attention_conv.base_kernel")[1], draft["conv_group_size"]
            )
        x = x + attn
        h = _rms(x, p("post_attention_layernorm.weight"))
        if k_conv:
            dyn = (h @ p("mlp_conv.kernel_projection.weight").T).view(len(ids), 2, k_conv, -1)
            h = _conv(h, dyn[:, 0], p("mlp_conv.base_kernel")[0], draft["conv_group_size"])
        mlp = (F.silu(h @ p("mlp.gate_proj.weight").T) * (h @ p("mlp.up_proj.weight").T)) @ p(
            "mlp.down_proj.weight").T  # fmt: skip
        if k_conv:
            mlp = _conv(mlp, dyn[:, 1], p("mlp_conv.base_kernel")[1], draft["conv_group_size"])
        x = x + mlp
    hidden = _rms(x, w["norm.weight"])[1:]
    logits = (hidden @ head.T) * draft.get("output_multiplier", 1.0)
    cap = draft.get("final_logit_softcapping")
    logits = torch.tanh(logits / cap) * cap if cap else logits
    if not k_conv:
        return hidden, logits.argmax(-1).tolist()
    unary, cand = logits.topk(draft["selector_top_k"], -1)
    proj = hidden @ w["candidate_selector.hidden_projection.weight"].T
    prev, path = ids[0], []
    for j in range(len(hidden)):
        ctxv = w["candidate_selector.predecessor_codebook"][prev] * proj[j]
        scores = unary[j] + w["candidate_selector.successor_codebook"][cand[j]] @ ctxv
        prev = int(cand[j][scores.argmax()])
        path.append(prev)
    return hidden, path


class _Target:  # the target's embedding and LM head, as the Drafter uses them
    def __init__(self, embed, head):
        self.embed_w, self.head = embed, head

    def embed(self, ids):
        return self.embed_w[ids]

    def logits(self, hidden):
        return (hidden @ self.head.T).float()


class _Req:
    def __init__(self, ids, kv_len, slots):
        self.fill_ids, self.kv_len, self.slots = ids, kv_len, slots


@pytest.mark.parametrize("backend", ["torch", "triton"])
@pytest.mark.parametrize("v2", [True, False])
def test_served_drafter_equals_reference(target, tmp_path, backend, v2):
    if backend == "triton":
        pytest.importorskip("triton")
    folder = write_drafter(tmp_path / "d", target, seed=6, v2=v2, block_size=5)
    cfg = json.loads((folder / "config.json").read_text())
    w = {k: v.float() for k, v in load_file(str(folder / "model.safetensors")).items()}
    model = load_drafter(folder, ModelConfig.from_hf(target), torch.float32)
    gen = torch.Generator().manual_seed(0)
    embed, head = torch.randn(384, 64, generator=gen), torch.randn(384, 64, generator=gen) * 0.3
    context = DraftContext(model, 64, torch.float32, "cpu")
    kernels = Kernels({**Kernels().names, "draft_attention": backend})
    drafter = Drafter(model, _Target(embed, head), context, kernels, 5, None)
    reqs, expected = [], []
    free = torch.randperm(64, generator=gen)  # scattered slots, as pages give, one set each
    for length in [7, 12, 3]:
        taps = torch.randn(length, 64 * 3, generator=gen)
        slots, free = free[: length + 5], free[length + 5 :]
        context.write(taps, torch.arange(length), slots[:length])
        last = int(torch.randint(0, 384, (1,), generator=gen))
        ids = torch.tensor([last] + [1] * 4)
        block = torch.arange(length, length + 5)
        expected.append(reference_block(w, cfg, taps, torch.arange(length), ids, block, embed,
                                        head)[1])  # fmt: skip
        reqs.append(_Req(list(range(length)) + [last], length, slots))
    proposals = drafter.propose(reqs, [False] * 3, sampler=None)
    assert proposals.tokens == expected

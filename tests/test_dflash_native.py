"""The native DFlash block forward (kernels/dflash_block.cpp) against the torch path it replaces
on CPU (`DFlashDraftModel.block_hidden` with the `draft_attention` op).

DFlash and DFlash2 drafters, fp32 and bf16, several block sizes, context lengths (one request
with a single context entry, others longer than the block), a causal drafter with a sliding
window, several requests in one call on scattered pool slots:

- fp32: the drafter's logits agree within 1e-5, every row's argmax and the proposed tokens are
  identical;
- bf16: the native loops read the bf16 weights and cache as they are and compute in fp32, so
  their fp32 output equals the torch path's over the same values upcast to fp32 (within 1e-5,
  same argmax); against the torch path in bf16 (which rounds every op to bf16) the logits stay
  within 0.1 of each other (logits of size ~3).
"""

from __future__ import annotations

import pytest
import torch
from dflash_models import write_drafter
from tiny_models import make_checkpoint

from dsaserve.engine.spec import draft_native as dflash_native
from dsaserve.engine.spec.draft import DraftContext, Drafter
from dsaserve.kernels.registry import Kernels
from dsaserve.model_config import ModelConfig
from dsaserve.models.dflash_loader import load_drafter


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("dflash_native") / "ckpt", "glm", seed=4)


class _Target:  # the target's embedding and LM head, as the Drafter uses them
    def __init__(self, embed, head):
        self.embed_w, self.head = embed, head

    def embed(self, ids):
        return self.embed_w[ids].to(self.head.dtype)

    def logits(self, hidden):
        return (hidden @ self.head.T.to(hidden.dtype)).float()


class _Req:
    def __init__(self, ids, kv_len, slots):
        self.fill_ids, self.kv_len, self.slots = ids, kv_len, slots


def _setup(target, folder, dtype, block, window, lengths, seed=0):
    """A Drafter (dtype) with context entries for `lengths` requests; its requests."""
    model = load_drafter(folder, ModelConfig.from_hf(target), dtype)
    gen = torch.Generator().manual_seed(seed)
    hidden, vocab = model.config.hidden_size, 384
    embed = torch.randn(vocab, hidden, generator=gen)
    head = torch.randn(vocab, hidden, generator=gen) * 0.3
    slots_total = sum(lengths) + block * len(lengths) + 32
    context = DraftContext(model, slots_total, dtype, "cpu")
    drafter = Drafter(model, _Target(embed, head.to(dtype)), context, Kernels(), block, window)
    free = torch.randperm(slots_total, generator=gen)  # scattered slots, as pages give
    reqs = []
    taps_width = len(model.config.target_layer_ids) * hidden
    for length in lengths:
        taps = torch.randn(length, taps_width, generator=gen).to(dtype)
        slots, free = free[: length + block], free[length + block :]
        context.write(taps, torch.arange(length), slots[:length])
        last = int(torch.randint(0, vocab, (1,), generator=gen))
        reqs.append(_Req(list(range(length)) + [last], length, slots))
    return drafter, reqs, head


def _block_inputs(drafter, reqs):
    block = drafter.block_size
    positions = torch.tensor([list(range(r.kv_len, r.kv_len + block)) for r in reqs])
    ids = torch.tensor([[r.fill_ids[r.kv_len]] + [drafter.mask_id] * (block - 1) for r in reqs])
    noise = drafter.target.embed(ids) * drafter.drafter.config.input_embedding_scale
    return noise, positions


def _torch_hidden(drafter, reqs, noise, positions):
    attend = drafter._attend(reqs, positions)
    return drafter.drafter.block_hidden(noise, positions, attend)


def _native_hidden_fp32(drafter, reqs, noise, positions):
    """The native forward's own fp32 output (before any cast to the drafter's dtype)."""
    native = drafter.native
    cos, sin = drafter.drafter.cos_sin(positions, torch.float32)
    rows, block, hidden = noise.shape
    out = native.block.forward(noise.reshape(-1, hidden).float().contiguous(), cos, sin,
                               drafter.context.cache, [r.slots for r in reqs],
                               [r.kv_len for r in reqs])  # fmt: skip
    return out.view(rows, block, hidden)


def _logits(drafter, hidden, head):
    return drafter.drafter.scale_logits(hidden[:, 1:].float() @ head.float().T)


CASES = [
    # (v2, block, lengths, drafter kw, flag window)
    (True, 8, [1, 9, 40], {}, None),
    (True, 5, [3, 17], {}, None),
    (True, 2, [12], {}, None),
    (False, 8, [1, 9, 40], {}, None),
    (False, 4, [6, 21], {}, None),
    (True, 6, [2, 30], {"causal": True, "window": 7}, None),
    (False, 5, [25, 4], {}, 9),
]


@pytest.fixture(scope="module")
def built():
    if dflash_native.extension() is None:
        pytest.fail("the native DFlash drafter did not build")


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"v{2 if c[0] else 1}-B{c[1]}-{c[2]}")
def test_fp32_native_equals_torch(built, target, tmp_path, case):
    v2, block, lengths, kw, window = case
    folder = write_drafter(tmp_path / "d", target, seed=block, v2=v2, block_size=block,
                           layers=3, **kw)  # fmt: skip
    drafter, reqs, head = _setup(target, folder, torch.float32, block, window, lengths)
    assert drafter.native is not None  # CPU, fp32: the native path is the one that serves
    noise, positions = _block_inputs(drafter, reqs)
    native = drafter.native.hidden(noise, positions, drafter.context.cache,
                                   [r.slots for r in reqs], [r.kv_len for r in reqs])  # fmt: skip
    reference = _torch_hidden(drafter, reqs, noise, positions)
    got, want = _logits(drafter, native, head), _logits(drafter, reference, head)
    assert (got - want).abs().max() <= 1e-5
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    served = drafter.propose(reqs, [False] * len(reqs), sampler=None)
    drafter.native = None  # the torch path's proposals
    assert served.tokens == drafter.propose(reqs, [False] * len(reqs), sampler=None).tokens


@pytest.mark.parametrize("case", CASES[:1] + CASES[3:4] + CASES[5:],
                         ids=lambda c: f"v{2 if c[0] else 1}-B{c[1]}-{c[2]}")  # fmt: skip
def test_bf16_native_equals_torch(built, target, tmp_path, case):
    v2, block, lengths, kw, window = case
    folder = write_drafter(tmp_path / "d", target, seed=block, v2=v2, block_size=block,
                           layers=3, **kw)  # fmt: skip
    drafter, reqs, head = _setup(target, folder, torch.bfloat16, block, window, lengths)
    assert drafter.native is not None
    # the same values upcast: the bf16 weights (the files hold bf16) and the bf16 cache
    upcast, _, _ = _setup(target, folder, torch.float32, block, window, lengths)
    upcast.context.cache.copy_(drafter.context.cache.float())
    noise, positions = _block_inputs(drafter, reqs)
    native = _native_hidden_fp32(drafter, reqs, noise, positions)
    reference = _torch_hidden(upcast, reqs, noise.float(), positions)
    got, want = _logits(drafter, native, head), _logits(upcast, reference, head)
    assert (got - want).abs().max() <= 1e-5
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    bf16_torch = _logits(drafter, _torch_hidden(drafter, reqs, noise, positions), head)
    served = drafter.native.hidden(noise, positions, drafter.context.cache,
                                   [r.slots for r in reqs], [r.kv_len for r in reqs])  # fmt: skip
    assert served.dtype == torch.bfloat16
    assert (_logits(drafter, served, head) - bf16_torch).abs().max() <= 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("v2", [True, False])
def test_context_entries_equal_torch(built, target, tmp_path, v2, dtype):
    """The entries the native path writes (fc, hidden_norm, each layer's k / v, k_norm, rotary)
    equal `context_entries` at the same slots: fp32 within 1e-5; bf16 within one bf16 rounding
    of the fp32 entries over the same (bf16) weights, and within 0.05 of the bf16 torch path."""
    folder = write_drafter(tmp_path / "d", target, seed=3, v2=v2, block_size=4, layers=3)
    drafter, _, _ = _setup(target, folder, dtype, 4, None, [])
    context, config = drafter.context, drafter.drafter.config
    gen = torch.Generator().manual_seed(1)
    n = 11
    taps = torch.randn(n, len(config.target_layer_ids) * config.hidden_size, generator=gen)
    positions = torch.arange(5, 5 + n)
    slots = torch.randperm(context.cache.shape[1], generator=gen)[:n]
    assert context.native is not None
    context.write(taps.to(dtype), positions, slots)
    native = context.cache[:, slots].float()
    upcast, _, _ = _setup(target, folder, torch.float32, 4, None, [])
    want = upcast.drafter.context_entries(taps.to(dtype).float(), positions)
    if dtype == torch.float32:
        assert (native - want).abs().max() <= 1e-5
        return
    assert ((native - want).abs() <= want.abs() * 2**-8 + 1e-6).all()
    context.native = None  # the torch path in bf16
    context.cache.zero_()
    context.write(taps.to(dtype), positions, slots)
    assert (native - context.cache[:, slots].float()).abs().max() <= 0.05

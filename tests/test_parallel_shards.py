"""Each rank loads only its slices: the shards equal the slices of the whole model (also from a
block-FP8 checkpoint whose blocks straddle the shard edges), and a rank's weight bytes after
load match what the planner (`dsaserve plan --model <folder>`) predicts for that layout."""

from __future__ import annotations

import pytest
import torch
from speculative_models import make_mtp_checkpoint

from dsaserve.deploy.memory import weight_bytes_per_gpu
from dsaserve.deploy.models import load_model as load_spec
from dsaserve.distributed.parallel_state import ParallelSizes, ParallelState
from dsaserve.model_config import ModelConfig
from dsaserve.models.dsa_moe import DsaMoeForCausalLM
from dsaserve.models.fp8 import quantize_checkpoint
from dsaserve.models.loader import load_checkpoint


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_mtp_checkpoint(tmp_path_factory.mktemp("shards") / "ckpt", "glm", seed=5)


def shard(folder, sizes: ParallelSizes, rank: int) -> DsaMoeForCausalLM:
    config = ModelConfig.from_hf(folder)
    with torch.device("meta"):
        model = DsaMoeForCausalLM(config, with_mtp=True, parallel=ParallelState(sizes, rank))
    load_checkpoint(model, folder, torch.float32, show_progress=False)
    return model


def weight_bytes(model: torch.nn.Module) -> int:
    tensors = [*model.parameters(), *model.buffers()]
    return sum(t.numel() * t.element_size() for t in tensors if t is not model.rotary.inv_freq)


@pytest.mark.parametrize("tp, dp", [(1, 1), (2, 1), (4, 1), (4, 2), (2, 2)])
def test_rank_weight_bytes_match_the_plan(folder, tp, dp):
    sizes = ParallelSizes(tp=tp, dp=dp, ep=1, dp_attention=dp > 1)
    predicted = weight_bytes_per_gpu(load_spec(str(folder)), "fp32", tp, sizes.attn_tp, True)
    for rank in (0, tp - 1):
        assert weight_bytes(shard(folder, sizes, rank)) == pytest.approx(predicted, rel=0.05)
    if tp > 1:  # and the split is real: much less than the whole model
        whole = weight_bytes(shard(folder, ParallelSizes(), 0))
        assert weight_bytes(shard(folder, sizes, 0)) < 0.8 * whole


def slices_of(whole: dict, sizes: ParallelSizes, rank: int) -> dict[str, torch.Tensor]:
    """What rank `rank` must hold, cut from the whole model's tensors."""
    p = ParallelState(sizes, rank)
    out = {}
    for name, t in whole.items():
        out[name] = t
        if name.endswith(("q_b_proj.weight", "kv_b_proj.weight")):
            out[name] = t.chunk(p.attn_tp, 0)[p.attn_rank]
        elif name.endswith("o_proj.weight"):
            out[name] = t.chunk(p.attn_tp, 1)[p.attn_rank]
        elif name.endswith("embed_tokens.weight"):
            out[name] = t.chunk(p.attn_tp, 0)[p.attn_rank]
        elif name.endswith(("lm_head.weight", "gate_proj.weight", "up_proj.weight")):
            out[name] = t.chunk(p.world, 0)[p.rank]
        elif name.endswith("down_proj.weight"):
            out[name] = t.chunk(p.world, 1)[p.rank]
        elif name.endswith("experts.gate_up_proj"):
            mine = t.chunk(sizes.ep, 0)[p.ep_rank]
            gate, up = mine.chunk(2, 1)
            part = p.moe_tp_rank
            out[name] = torch.cat([gate.chunk(sizes.moe_tp, 1)[part],
                                   up.chunk(sizes.moe_tp, 1)[part]], 1)  # fmt: skip
        elif name.endswith("experts.down_proj"):
            out[name] = t.chunk(sizes.ep, 0)[p.ep_rank].chunk(sizes.moe_tp, 2)[p.moe_tp_rank]
    return out


@pytest.mark.parametrize("block", [None, 24])  # 24: FP8 blocks straddle every shard edge
def test_shards_are_the_whole_models_slices(folder, tmp_path, block):
    check_slices(folder, tmp_path, block)


def test_odd_vocab_shards_are_zero_padded(tmp_path):
    odd = make_mtp_checkpoint(tmp_path / "odd", "glm", seed=6, vocab_size=381)
    check_slices(odd, tmp_path, None)


def check_slices(folder, tmp_path, block) -> None:
    source = folder
    if block is not None:
        source = tmp_path / "fp8"
        quantize_checkpoint(folder, source, block=block)
    whole = dict(shard(source, ParallelSizes(), 0).state_dict())
    sizes = ParallelSizes(tp=4, dp=2, ep=2, dp_attention=True)
    for rank in (1, 2):
        got = shard(source, sizes, rank).state_dict()
        for name, want in slices_of(whole, sizes, rank).items():
            have = got[name]
            if name.endswith(("embed_tokens.weight", "lm_head.weight")):  # padded vocab rows
                assert not have[want.shape[0] :].any(), name
                have = have[: want.shape[0]]
            assert torch.equal(have, want), name


def test_payload_round_trip():
    """What a leader broadcasts for an op is rebuilt exactly on the other ranks."""
    from dsaserve.engine.ranks.payload import Op, OpInputs, pack, unpack
    from dsaserve.layers.forward_batch import ExtendSeq, ForwardBatch
    from dsaserve.layers.indexer import Selection

    kv, index = torch.zeros(2, 64, 8), torch.zeros(1, 64, 4)
    long = lambda *v: torch.tensor(v, dtype=torch.long)  # noqa: E731
    batch = ForwardBatch(long(1, 2, 3, 4), long(0, 1, 2, 7), long(5, 6, 7, 9),
                         [ExtendSeq(0, 3, long(5, 6, 7))], long(3), long(8, 9).view(1, 2),
                         torch.tensor([[True, False]]), long(2, 3), kv, index)  # fmt: skip
    reuse = Selection([None, long(0, 2).view(1, 2)], torch.tensor([[True, False, True]]))
    hidden = torch.randn(4, 16)
    sent = OpInputs(Op.MTP, batch=batch, hidden=hidden, reuse=reuse)
    got = unpack(Op.MTP, *pack(sent), kv, index, torch.device("cpu"))
    for field in ("input_ids", "positions", "out_slots", "decode_rows", "decode_slots",
                  "decode_valid", "logits_rows"):  # fmt: skip
        want, have = getattr(batch, field), getattr(got.batch, field)
        assert have.dtype == want.dtype and torch.equal(have, want), field
    assert [(e.q_start, e.q_len, e.ctx_slots.tolist()) for e in got.batch.extends] == [
        (0, 3, [5, 6, 7])
    ]
    assert got.batch.kv_cache is kv and got.batch.index_cache is index
    assert torch.equal(got.hidden, hidden)
    assert got.reuse.extends[0] is None and torch.equal(got.reuse.extends[1], reuse.extends[1])
    assert got.reuse.decode.dtype == torch.bool and torch.equal(got.reuse.decode, reuse.decode)
    logits = unpack(Op.LOGITS, *pack(OpInputs(Op.LOGITS, hidden=hidden)), kv, index, "cpu")
    assert torch.equal(logits.hidden, hidden) and logits.batch is None

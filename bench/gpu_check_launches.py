"""Every Triton launch our launch code makes at the shapes we claim, recorded without a GPU.

The launch functions (`sparse_mla_decode`, `indexer_scores`, `fp8_gemm`, `grouped_experts`) run
on `meta` tensors with `JITFunction.run` swapped for a recorder, so what they pick (block sizes,
warps, dtypes, which integer arguments are multiples of 16) is exactly what a GPU would compile:
a new configuration in the launch code shows up here without editing this file.
bench/gpu_check_compile.py compiles each distinct one ahead of time (and imports this module with
TRITON_INTERPRET unset: the kernels must be JITFunctions).

Claimed: GLM-5.3 at TP1, TP8 (experts split) and EP8 (whole experts), its BF16 checkpoint at
TP8 and EP8, DeepSeek-V3.2 at TP1, TP8 and EP8, and the embedded model (fp32); the attention
kernels of GLM-5.3 and DeepSeek-V3.2 at TP2 and TP4 too; each with a bf16, FP8 and fp32 KV
cache; decode rows of every CUDA-graph bucket (MTP verify rows included) over every context
bucket, eager widths that are not multiples of 16, and one prefill chunk for the GEMMs. What
two claims would launch alike is recorded once: the indexer and sparse MLA of claims whose
attention shapes agree (`attention_shapes`: TP8 and EP8, GLM-5.3 and its BF16 checkpoint), an
FP8 Linear of a width and dtype already recorded (the replicated ones, TP8's under EP8).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import torch
from gpu_check import RankShapes, rank_shapes
from triton.runtime.jit import JITFunction

from dsaserve.deploy.models import BUILTIN_MODELS, spec_from_config
from dsaserve.engine.decode.cuda_graph import MAX_TABLE_ENTRIES, context_buckets, row_buckets
from dsaserve.kernels.fp8_kv_sizes import index_key_bytes, mla_entry_bytes
from dsaserve.kernels.gpu_target import as_target
from dsaserve.kernels.triton_draft_attention import draft_attention
from dsaserve.kernels.triton_fp8_gemm import fp8_linear
from dsaserve.kernels.triton_indexer import indexer_scores
from dsaserve.kernels.triton_moe import grouped_experts
from dsaserve.kernels.triton_sparse_mla import sparse_mla_decode

META = torch.device("meta")
EMBEDDED = Path(__file__).resolve().parents[1] / "dsaserve/assets/default_model/config.json"
MAX_BS = 256  # --cuda-graph-max-bs default
SPEC_STEPS = 3  # --speculative-num-steps of the GLM-5.3 guide: verify rows are batch x 4
PREFILL_ROWS = 8192  # one --chunked-prefill-size chunk through the Linears and the experts
EAGER_CONTEXTS = (1000, 5000)  # eager slot-table widths (no graph bucket): not multiples of 16
KV_CACHES = ("bf16", "fp8", "fp32")
# DFLASH drafters (they run whole on the leader rank): claim -> (heads, kv heads, head dim, block)
DRAFTERS = {"GLM-5.3 TP8": (32, 8, 128, 8), "embedded": (6, 2, 32, 8)}  # the guide's; ours
DRAFT_ROWS = (1, 8, MAX_BS)  # requests drafting at once
DRAFT_CONTEXTS = (1000, 4096)  # context widths: one not a multiple of 16


@dataclass(frozen=True)
class Claim:
    """One deployment whose kernels we claim: a rank's shapes, its dtypes, its context."""

    name: str
    shapes: RankShapes
    compute: torch.dtype  # activations, the query
    experts: str  # routed-expert weights: "fp8", "bf16" or "fp32"
    fp8_linears: bool  # block-FP8 Linears kept (the FP8 GEMM)
    max_context: int
    top_k: int = 8  # num_experts_per_tok
    attention_only: bool = False  # only the indexer and sparse MLA launches are claimed


@dataclass(frozen=True)
class ArgPtr:
    """A tensor argument as the specialisation sees it: its dtype and byte offset from an aligned
    allocation (the caching allocator aligns to 512 B)."""

    dtype: torch.dtype
    offset: int

    def data_ptr(self) -> int:
        return 512 + self.offset


@dataclass
class Launch:
    """One recorded launch: the kernel, its arguments (tensors as ArgPtr), and which claim,
    cache and rows asked for it."""

    kernel: JITFunction
    args: tuple
    kwargs: dict
    label: str


def claims() -> list[Claim]:
    glm, bf16, dsv = (BUILTIN_MODELS[n] for n in ("GLM-5.3", "GLM-5.3-BF16", "DeepSeek-V3.2"))
    bf = torch.bfloat16
    layouts = (("TP1", 1, "tp"), ("TP8", 8, "tp"), ("EP8", 8, "ep"))
    out = [Claim(f"GLM-5.3 {name}", rank_shapes(glm, tp, moe), bf, "fp8", True, 202752)
           for name, tp, moe in layouts]  # fmt: skip
    out += [Claim(f"GLM-5.3-BF16 {name}", rank_shapes(bf16, 8, moe), bf, "bf16", False, 202752)
            for name, moe in (("TP8", "tp"), ("EP8", "ep"))]  # fmt: skip
    out += [Claim(f"DeepSeek-V3.2 {name}", rank_shapes(dsv, tp, moe), bf, "fp8", True, 163840)
            for name, tp, moe in layouts]  # fmt: skip
    # TP2 / TP4: 32 / 16 heads a rank (GLM-5.3), 64 / 32 (DeepSeek-V3.2) for the attention
    # tiles; their GEMM and MoE tiles are TP1's and TP8's at other widths
    out += [Claim(f"{spec.name} TP{tp}", rank_shapes(spec, tp, "tp"), bf, "fp8", True, context,
                  attention_only=True)
            for spec, context in ((glm, 202752), (dsv, 163840)) for tp in (2, 4)]  # fmt: skip
    raw = json.loads(EMBEDDED.read_text())
    tiny = rank_shapes(spec_from_config(raw, "embedded", str(EMBEDDED.parent)), 1, "tp")
    tiny = dataclasses.replace(tiny, index_topk=raw["index_topk"])
    out.append(Claim("embedded", tiny, torch.float32, "fp32", False, 65536,
                     raw["num_experts_per_tok"]))  # fmt: skip
    return out


def attention_shapes(claim: Claim) -> tuple:
    """What the indexer and sparse MLA launches of a claim depend on: claims that agree here
    (TP8 and EP8, the BF16 checkpoint's) make the same attention launches."""
    s = claim.shapes
    return (s.heads, s.rank, s.rope, s.index_heads, s.index_dim, s.index_topk, claim.compute,
            claim.max_context)  # fmt: skip


def decode_shapes(claim: Claim) -> Iterator[tuple[int, int]]:
    """(rows, context width) of every decode step the graph buckets and eager steps allow."""
    contexts = context_buckets(claim.max_context)
    for rows in row_buckets(MAX_BS, SPEC_STEPS):
        for context in contexts:
            if rows * context <= MAX_TABLE_ENTRIES:
                yield rows, context
        for context in EAGER_CONTEXTS:
            yield rows, context


def _caches(claim: Claim, kv: str, slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Layer 1's MLA entries and index keys of a pool in the `kv` form (views, as the layers
    pass them)."""
    s = claim.shapes
    if kv == "fp8":
        entry, key = mla_entry_bytes(s.rank, s.rope), index_key_bytes(s.index_dim)
        dtype = torch.uint8
    else:
        entry, key = s.rank + s.rope, s.index_dim
        dtype = torch.bfloat16 if kv == "bf16" else torch.float32
    kv_cache = torch.empty(2, slots, entry, dtype=dtype, device=META)
    return kv_cache[1], torch.empty(2, slots, key, dtype=dtype, device=META)[1]


def _attention(claim: Claim, kv: str) -> None:
    s = claim.shapes
    cache, keys = _caches(claim, kv, 1 << 16)
    for rows, context in decode_shapes(claim):
        q = torch.empty(rows, s.index_heads, s.index_dim, dtype=claim.compute, device=META)
        table = torch.empty(rows, context, dtype=torch.long, device=META)
        valid = torch.empty(rows, context, dtype=torch.bool, device=META)
        weights = torch.empty(rows, s.index_heads, device=META)
        label = f"{claim.name} {kv} cache, {rows} rows x {context}"
        _until_launch(label, indexer_scores, q, weights, keys, table, valid)
        width = min(context, s.index_topk)  # the top-k entries (gathered), or the context
        q = torch.empty(rows, s.heads, s.rank + s.rope, dtype=claim.compute, device=META)
        table = torch.empty(rows, width, dtype=torch.long, device=META)
        valid = torch.empty(rows, width, dtype=torch.bool, device=META)
        _until_launch(label, sparse_mla_decode, q, cache, table, valid, s.rank, 0.1)


def _drafter(claim: Claim) -> None:
    """The DFLASH drafter's block attention over its context entries (`draft_attention`)."""
    heads, kv_heads, dim, block = DRAFTERS[claim.name]
    cache = torch.empty(1 << 16, 2 * kv_heads * dim, dtype=claim.compute, device=META)
    for rows in DRAFT_ROWS:
        for context in DRAFT_CONTEXTS:
            q = torch.empty(rows, block, heads, dim, dtype=claim.compute, device=META)
            kv = torch.empty(rows, block, kv_heads, dim, dtype=claim.compute, device=META)
            table = torch.empty(rows, context, dtype=torch.long, device=META)
            allowed = torch.empty(rows, block, context, dtype=torch.bool, device=META)
            own = torch.empty(block, block, dtype=torch.bool, device=META)
            label = f"{claim.name} DFLASH drafter, {rows} requests x {context}"
            _until_launch(label, draft_attention, q, cache, table, allowed, kv, kv, own,
                          dim**-0.5)  # fmt: skip


def _linears(claim: Claim, seen: set) -> None:
    """Each FP8 Linear of the claim at every row count, but a (width, dtype) already recorded
    for another claim (the replicated Linears; TP8 and EP8 agree on all of them) only once."""
    s = claim.shapes
    shapes = {**s.linear_shapes(), "dense gate/up": (s.dense_inter, s.hidden),
              "dense down": (s.hidden, s.dense_inter), "shared gate/up": (s.shared_inter, s.hidden),
              "shared down": (s.hidden, s.shared_inter)}  # fmt: skip
    shapes = {name: nk for name, nk in shapes.items() if (*nk, claim.compute) not in seen}
    seen |= {(*nk, claim.compute) for nk in shapes.values()}
    for rows in (*row_buckets(MAX_BS, SPEC_STEPS), PREFILL_ROWS):
        for name, (n, k) in shapes.items():
            w8 = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=META)
            scale = torch.empty(-(-n // 128), -(-k // 128), device=META)
            x = torch.empty(rows, k, dtype=claim.compute, device=META)
            _until_launch(f"{claim.name} {name}, {rows} rows", fp8_linear, x, w8, scale)


def _experts(claim: Claim) -> None:
    s = claim.shapes
    dtype = {"fp8": torch.float8_e4m3fn, "bf16": torch.bfloat16, "fp32": torch.float32}
    weights = {"gate_up_proj": (s.experts, 2 * s.expert_inter, s.hidden),
               "down_proj": (s.experts, s.hidden, s.expert_inter)}  # fmt: skip
    experts = SimpleNamespace()
    for name, shape in weights.items():
        setattr(experts, name, torch.empty(shape, dtype=dtype[claim.experts], device=META))
        blocks = (shape[0], -(-shape[1] // 128), -(-shape[2] // 128))
        setattr(experts, f"{name}_scale_inv", torch.empty(blocks, device=META))
    top_k = min(claim.top_k, s.experts)
    for rows in (*row_buckets(MAX_BS, SPEC_STEPS), PREFILL_ROWS):
        x = torch.empty(rows, s.hidden, dtype=claim.compute, device=META)
        index = torch.empty(rows, top_k, dtype=torch.long, device=META)
        weights = torch.empty(rows, top_k, device=META)
        _current["label"] = f"{claim.name} {claim.experts} experts, {rows} rows"
        grouped_experts(experts, x, index, weights)  # both GEMMs: run to the end


_current = {"label": "", "into": None, "stop": False}


class _Launched(Exception):
    """Raised by the recorder to skip what a launch function does after its one launch (the
    split merge on meta tensors costs more than the rest of the recording)."""


def _until_launch(label: str, launch_fn, *args) -> None:
    _current.update(label=label, stop=True)
    try:
        launch_fn(*args)
    except _Launched:
        pass
    finally:
        _current["stop"] = False


def _record(self: JITFunction, *args, grid, warmup, **kwargs) -> None:
    """JITFunction.run's stand-in: keep the launch, run nothing."""
    stubs = tuple(_stub(a) for a in args)
    kwargs = {k: _stub(v) for k, v in kwargs.items()}
    _current["into"].append(Launch(self, stubs, kwargs, _current["label"]))
    if _current["stop"]:
        raise _Launched


def _stub(value):
    if isinstance(value, torch.Tensor):
        return ArgPtr(value.dtype, value.storage_offset() * value.element_size())
    return value


def _record_claim(claim: Claim, seen: dict[str, set]) -> None:
    """The launches of one claim that no claim before it made (`seen`)."""
    if attention_shapes(claim) not in seen["attention"]:  # once per distinct attention
        seen["attention"].add(attention_shapes(claim))
        for kv in KV_CACHES:
            _attention(claim, kv)
    if claim.attention_only:
        return
    if claim.fp8_linears:
        _linears(claim, seen["linears"])
    _experts(claim)
    if claim.name in DRAFTERS:
        _drafter(claim)


def record_launches(cc: int = 90, only: str = "") -> list[Launch]:
    """Run the launch code of every claim (whose name contains `only`) on meta tensors as if on
    compute capability `cc`; the launches it makes, in order."""
    launches: list[Launch] = []
    original = JITFunction.run
    JITFunction.run = _record
    _current["into"] = launches
    seen = {"attention": set(), "linears": set()}
    try:
        for claim in (c for c in claims() if only in c.name):
            with as_target(cc // 10, cc % 10):
                _record_claim(claim, seen)
    finally:
        JITFunction.run = original
        _current["into"] = None
    return launches

"""The torch / Triton half of bench/gpu_check.py: kernel checks and the timed decode slice."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from dsaserve.engine.kv_quant import KV_STORE, quantize_entry, quantize_key
from dsaserve.kernels import reference
from dsaserve.kernels import triton_fp8_gemm as gemm
from dsaserve.kernels.triton_indexer import indexer_decode_topk, indexer_scores
from dsaserve.kernels.triton_sparse_mla import sparse_mla_decode
from dsaserve.models.fp8 import dequantize_block_fp8, quantize_block_fp8

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    finite = want.isfinite()
    got, want = got[finite].double(), want[finite].double()
    return ((got - want).norm() / want.norm().clamp(min=1e-30)).item()


def _check(name: str, error: float, bound: float) -> dict:
    return {"name": name, "error": error, "bound": bound, "ok": error <= bound}


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


def check_indexer(s, context: int, batch: int = 4) -> list[dict]:
    g = _gen(context)
    keys = torch.randn(batch * context, s.index_dim, device=DEVICE, generator=g)
    cache = quantize_key(keys)
    table = torch.randperm(batch * context, device=DEVICE, generator=g).view(batch, context)
    valid = torch.ones(batch, context, dtype=torch.bool, device=DEVICE)
    q = torch.randn(batch, s.index_heads, s.index_dim, device=DEVICE, generator=g)
    w = torch.randn(batch, s.index_heads, device=DEVICE, generator=g) * s.index_heads**-0.5
    got = indexer_scores(q, w, cache, table, valid)
    want = reference.indexer_scores(q, w, KV_STORE.read_key(cache, table, torch.float32), valid)
    topk = min(s.index_topk, context)
    picks = indexer_decode_topk(q, w, cache, table, valid, topk)
    ref = reference.indexer_decode_topk(q, w, cache, table, valid, topk)
    overlap = sum(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(picks, ref))
    zero = torch.zeros_like(cache)  # every score ties at 0.0: the earliest positions must win
    tied = indexer_decode_topk(q, w.abs(), zero, table, valid, topk)
    earliest = torch.arange(topk, device=DEVICE).expand(batch, -1)
    return [
        _check(f"indexer scores fp8 keys ctx {context}", _rel(got, want), 1e-4),
        _check(f"indexer top-{topk} overlap ctx {context}", 1 - overlap / picks.numel(), 1e-3),
        _check(f"indexer ties earliest ctx {context}", float(not torch.equal(tied, earliest)), 0),
    ]


def check_sparse_mla(s, batch: int = 4) -> list[dict]:
    g = _gen(1)
    topk, width = s.index_topk, s.rank + s.rope
    entries = torch.randn(batch * topk, width, device=DEVICE, generator=g)
    q = torch.randn(batch, s.heads, width, device=DEVICE, generator=g).bfloat16()
    slots = torch.randperm(batch * topk, device=DEVICE, generator=g).view(batch, topk)
    allowed = torch.rand(batch, topk, device=DEVICE, generator=g) < 0.9
    scale = (s.nope + s.rope) ** -0.5
    out = []
    for name, cache in (("bf16", entries.bfloat16()), ("fp8", quantize_entry(entries, s.rank))):
        got = sparse_mla_decode(q, cache, slots, allowed, s.rank, scale)
        want = reference.sparse_mla_decode(q.float(), cache, slots, allowed, s.rank, scale)
        out.append(_check(f"sparse MLA decode {s.heads} heads {name} cache top-{topk}",
                          _rel(got.float(), want), 1e-2))  # fmt: skip
    return out


def check_gemm(name: str, n: int, k: int, m: int) -> dict:
    g = _gen(n + k)
    w8, scale = quantize_block_fp8(torch.randn(n, k, device=DEVICE, generator=g))
    x = torch.randn(m, k, device=DEVICE, generator=g)
    a8, a_scale = gemm.act_quant(x)
    got = gemm.fp8_gemm(a8, a_scale, w8, scale)
    a = a8.float() * a_scale.repeat_interleave(128, 1)[:, :k]
    return _check(f"fp8 GEMM {name} [{m}x{k}]x[{n}x{k}]",
                  _rel(got, a @ dequantize_block_fp8(w8, scale).T), 1e-4)  # fmt: skip


def run_checks(shapes: dict, contexts: list[int]) -> list[dict]:
    from gpu_check import linear_shapes

    s = shapes["tp"]
    checks = [c for ctx in contexts for c in check_indexer(s, ctx)] + check_sparse_mla(s)
    for name, (n, k) in linear_shapes(s).items():
        checks += [check_gemm(name, n, k, m) for m in (1, 64)]
    for moe, r in shapes.items():
        checks.append(check_gemm(f"{moe} expert gate_up", 2 * r.expert_inter, r.hidden, 8))
        checks.append(check_gemm(f"{moe} expert down", r.hidden, r.expert_inter, 8))
    return checks


def copy_bandwidth() -> float:
    """Bytes a second of a device-to-device copy (read + write)."""
    n = (1 << 30) if DEVICE.type == "cuda" else (1 << 22)
    src = torch.empty(n, dtype=torch.uint8, device=DEVICE)
    dst = torch.empty_like(src)
    dst.copy_(src)
    _sync()
    start = time.perf_counter()
    for _ in range(10):
        dst.copy_(src)
    _sync()
    return 2 * n * 10 / (time.perf_counter() - start)


def _sync() -> None:
    if DEVICE.type == "cuda":
        torch.cuda.synchronize()


def _fp8(n: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random e4m3 bytes (no NaN patterns) and unit-ish scales, made on the device."""
    raw = torch.randint(0, 256, (n, k), dtype=torch.uint8, device=DEVICE) & 0xB7
    scale = torch.full((-(-n // 128), -(-k // 128)), 1e-2, device=DEVICE)
    return raw.view(torch.float8_e4m3fn), scale


class Slice:
    """One decode step of a rank: FP8 Linears, FP8 KV (one cache all layers share: the same
    bytes a layer reads, a fraction of the memory), routed experts as one GEMM pair per expert
    the batch is expected to touch (routing is computed; its result only weights the output)."""

    def __init__(self, s, batch: int, context: int) -> None:
        from gpu_check import experts_touched, linear_shapes

        self.s, self.batch = s, batch
        self.layers = [{name: _fp8(*shape) for name, shape in linear_shapes(s).items()}
                       for _ in range(s.layers)]  # fmt: skip
        absorbed = s.heads * (s.nope + s.v_dim) * s.rank
        self.kv_b = torch.randn(s.layers, absorbed, device=DEVICE, dtype=torch.bfloat16) * 0.02
        touched = min(round(experts_touched(batch)), s.experts)
        self.experts = [
            [
                (_fp8(2 * s.expert_inter, s.hidden), _fp8(s.hidden, s.expert_inter))
                for _ in range(touched)
            ]
            for _ in range(s.layers - s.dense_layers)
        ]
        self.router = torch.randn(256, s.hidden, device=DEVICE) * 0.01
        slots = batch * context
        self.kv = quantize_entry(torch.randn(slots, s.rank + s.rope, device=DEVICE), s.rank)
        self.keys = quantize_key(torch.randn(slots, s.index_dim, device=DEVICE))
        self.table = torch.arange(slots, device=DEVICE).view(batch, context)
        self.valid = torch.ones(batch, context, dtype=torch.bool, device=DEVICE)
        self.out_slots = self.table[:, -1].contiguous()
        self.x = torch.randn(batch, s.hidden, device=DEVICE, dtype=torch.bfloat16)

    def step(self) -> torch.Tensor:
        s, x, b = self.s, self.x, self.batch
        lin = lambda inp, w: gemm.fp8_linear(inp, *w)  # noqa: E731
        for i, w in enumerate(self.layers):
            h = F.rms_norm(x, (s.hidden,))
            qa = lin(h, w["q_a_proj"])
            q = lin(qa, w["q_b_proj"]).view(b, s.heads, s.nope + s.rope)
            kv_b = self.kv_b[i].view(s.heads, s.nope + s.v_dim, s.rank)
            q_lat = torch.einsum("bhd,hdr->bhr", q[..., : s.nope], kv_b[:, : s.nope])
            q_full = torch.cat([q_lat, q[..., s.nope :]], -1)
            KV_STORE.write_entry(self.kv, self.out_slots, lin(h, w["kv_a_proj_with_mqa"]), s.rank)
            iq = lin(qa, w["indexer.wq_b"]).view(b, s.index_heads, s.index_dim).float()
            KV_STORE.write_key(self.keys, self.out_slots, lin(h, w["indexer.wk"]))
            weights = torch.ones(b, s.index_heads, device=DEVICE)
            picks = indexer_decode_topk(iq, weights, self.keys, self.table, self.valid,
                                        min(s.index_topk, self.table.shape[1]))  # fmt: skip
            sel, allowed = self.table.gather(1, picks), self.valid.gather(1, picks)
            o = sparse_mla_decode(q_full, self.kv, sel, allowed, s.rank, 0.1)
            o = torch.einsum("bhr,hvr->bhv", o, kv_b[:, s.nope :]).reshape(b, -1)
            x = x + lin(o, w["o_proj"])
            if i >= s.dense_layers:
                x = x + self._moe(F.rms_norm(x, (s.hidden,)), self.experts[i - s.dense_layers])
        return x

    def _moe(self, h: torch.Tensor, experts) -> torch.Tensor:
        scores = F.linear(h.float(), self.router).sigmoid()
        gate = scores.topk(8, dim=-1).values.sum(-1, keepdim=True).to(h.dtype)
        out = torch.zeros_like(h)
        for up, down in experts:
            g, u = gemm.fp8_linear(h, *up).chunk(2, dim=-1)
            out = out + gemm.fp8_linear(F.silu(g) * u, *down)
        return out * gate / max(len(experts), 1)


def run_timing(s, batches: list[int], context: int, iters: int) -> tuple[float, list[dict]]:
    bandwidth = copy_bandwidth()
    rows = []
    for batch in batches:
        model = Slice(s, batch, context)
        model.step()  # compile the kernels
        _sync()
        if DEVICE.type == "cuda":
            graph = torch.cuda.CUDAGraph()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                model.step()
            torch.cuda.current_stream().wait_stream(stream)
            with torch.cuda.graph(graph):
                model.step()
            run = graph.replay
        else:
            run = model.step
        run()
        _sync()
        start = time.perf_counter()
        for _ in range(iters):
            run()
        _sync()
        rows.append({"batch": batch, "step_ms": (time.perf_counter() - start) / iters * 1e3,
                     "cuda_graph": DEVICE.type == "cuda"})  # fmt: skip
        del model
        if DEVICE.type == "cuda":
            torch.cuda.empty_cache()
    return bandwidth, rows

"""Lock-step model ops across ranks: every rank calls `round()` the same number of times.

One round: every rank all-gathers a 7-int header (the group leaders put their pending op, its
rows, its buffer sizes, for FORWARD_LOGITS its logits rows, for a forward a CUDA graph can
run its context bucket, and whether its native layers can run it; other ranks zeros). One op kind
is chosen (the first pending one, scanning from a group that rotates every round, so no group
starves); every group that wants that kind runs it, its leader broadcasting the inputs
(`payload`) to its attention-TP group; all other groups join with no tokens, so the MoE/MLP and
LM-head collectives, which span every rank, always match. A forward runs through every rank's
CUDA graphs (engine/decode/cuda_graph.py) when every running group's fits one: all ranks replay the
bucket of the largest group's rows and the widest context, the groups without rows over padding,
so the collectives captured in the graphs match too. On CPU, a forward round whose every
running group has all-decode rows (a decode step's, every row sampled, or a verify's) runs every
rank's native decode layers instead (`NativeStep`; every rank has them or none, agreed at build,
engine/decode/build.py), its collectives inside the C++ call; a group without rows joins them
with none, as it joins the layered model's. A round where nobody has work is a heartbeat. STOP ends
every rank's loop.

`DistributedModel` is the leader's stand-in for the model (same calls as DsaMoeForCausalLM), so
the engine, the speculative decoder and the sampler run unchanged on rank 0 of each group.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch

from dsaserve.distributed.parallel_state import ParallelState
from dsaserve.engine.kvcache.moves import TierMoves
from dsaserve.engine.ranks.payload import (
    Op,
    OpInputs,
    empty,
    pack,
    pool_entries,
    unpack,
    write_entries,
)
from dsaserve.layers.forward_batch import ForwardBatch, current_batch, installed
from dsaserve.layers.indexer import Selection
from dsaserve.models.dsa_moe import DsaMoeForCausalLM

HEADER = 7  # op, rows, int and float payload sizes, logits rows, CUDA-graph context bucket,
# and 1 where the op can run on the native layers


class Graphs(Protocol):
    """This rank's CUDA-graph decode (engine/decode/cuda_graph.py's `CudaGraphRunner`, which
    the rank's builder hands in): a bucket is a captured (rows, context) shape."""

    taps: tuple[int, ...]

    def common_bucket(self, rows: int, context: int) -> Any: ...

    def bucket(self, batch: ForwardBatch) -> Any: ...

    def __call__(self, batch: ForwardBatch, bucket: Any = None) -> torch.Tensor: ...


class NativeStep(Protocol):
    """This rank's native decode layers (engine/decode/fused.py's `FusedDecode` over its shard,
    exchanging their parts over the world's shared memory)."""

    native: Any  # the C++ DecodeLayers (its `comm_seq` continues the Python group's)

    def accepts(self, batch: ForwardBatch) -> bool: ...

    def decode_logits(self, ids, positions, slots, kv_cache, index_cache, last=None, taps=(),
                      with_logits=True, groups=None) -> Any: ...  # fmt: skip


class Stopped(Exception):
    """A STOP round ran: every rank leaves its loop."""


class RankRunner:
    """Runs rounds on one rank over its model shard and its own KV pool tensors."""

    def __init__(self, model: DsaMoeForCausalLM, kv_cache: torch.Tensor,
                 index_cache: torch.Tensor, parallel: ParallelState,
                 device: torch.device) -> None:  # fmt: skip
        self.model = model
        self.kv_cache, self.index_cache = kv_cache, index_cache
        self.parallel = parallel
        self.device = device
        # the hidden states' dtype (the payload's float buffer): the compute dtype, which a
        # --kv-cache-dtype (bf16 under fp32, FP8) may differ from
        self.dtype = model.model.embed_tokens.weight.dtype
        self.tiers: TierMoves | None = None  # this rank's HiCache tiers (HICACHE ops)
        self.graphs: Graphs | None = None  # this rank's decode graphs (FORWARD ops)
        self.native: NativeStep | None = None  # all-decode forwards (every rank or none)
        self.rank_paths: list[str] = []  # every rank's path for those rounds (get_server_info)
        self.native_rounds = 0  # rounds this rank ran on its native layers
        self.rounds = 0
        self.others_busy = False
        self.stopped = False
        self.sync_seconds = 0.0  # headers and payload broadcasts (bench/parallel.py)

    def round(self, mine: OpInputs | None) -> tuple[bool, Any]:
        """One round; (whether `mine` ran, its result). `mine` is None for a follower or an
        idle leader."""
        p, sizes = self.parallel, self.parallel.sizes
        buffers = pack(mine) if mine is not None else None
        header = torch.zeros(HEADER, dtype=torch.long)
        if mine is not None:
            header[:] = torch.tensor([int(mine.op), mine.rows, buffers[0].numel(),
                                      buffers[1].numel(), mine.logits_rows,
                                      self._graph_context(mine), self._native(mine)])  # fmt: skip
        table = self._gather_headers(header)
        leaders = [table[sizes.leader(g)] for g in range(sizes.groups)]
        ops = [int(row[0]) for row in leaders]
        self.rounds += 1
        if Op.STOP in ops:
            self.stopped = True
            raise Stopped
        chosen = self._choose(ops)
        own_op = ops[p.dp_rank]
        self.others_busy = any(op != Op.IDLE for g, op in enumerate(ops) if g != p.dp_rank)
        if chosen == Op.IDLE:
            return False, None
        rows = [int(row[1]) if op == chosen else 0 for row, op in zip(leaders, ops)]
        logits_rows = [int(row[4]) if op == chosen else 0 for row, op in zip(leaders, ops)]
        contexts = [int(row[5]) for row, op in zip(leaders, ops) if op == chosen]
        native = all(int(row[6]) for row, op in zip(leaders, ops) if op == chosen)
        runs = own_op == chosen
        inputs = self._inputs(chosen, runs, mine, buffers, leaders[p.dp_rank])
        bucket = None  # every rank derives the same one from the same headers
        if self.graphs is not None and min(contexts) > 0:
            bucket = self.graphs.common_bucket(max(rows), max(contexts))
        with p.rows(rows):
            if native and bucket is None:  # every rank decides alike, from the same headers
                result = self._native_forward(inputs, rows)
            else:
                result = self._execute(inputs, logits_rows, bucket)
        return runs and mine is not None, result

    def _graph_context(self, mine: OpInputs) -> int:
        """The context bucket of a forward a CUDA graph can run (0: it runs eagerly)."""
        graphs = self.graphs
        if graphs is None or mine.op not in (Op.FORWARD, Op.FORWARD_LOGITS):
            return 0
        bucket = graphs.bucket(mine.batch) if graphs.taps == mine.taps else None
        return bucket.context if bucket is not None else 0

    def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self._gather_headers(torch.tensor([int(Op.STOP)] + [0] * (HEADER - 1)))

    def _gather_headers(self, header: torch.Tensor) -> list[torch.Tensor]:
        start = time.perf_counter()
        if self.parallel.world_shm is not None:
            parts = self.parallel.world_shm.all_gather(header)
        else:
            parts = [torch.empty_like(header) for _ in range(self.parallel.world)]
            torch.distributed.all_gather(parts, header, group=self.parallel.cpu_group)
        self.sync_seconds += time.perf_counter() - start
        return parts

    def _choose(self, ops: list[int]) -> Op:
        groups = len(ops)
        for k in range(groups):
            op = ops[(self.rounds + k) % groups]
            if op != Op.IDLE:
                return Op(op)
        return Op.IDLE

    def _inputs(self, op: Op, runs: bool, mine, buffers, leader_row) -> OpInputs:
        p = self.parallel
        if not runs:
            hidden = self.model.config.hidden_size
            return empty(op, hidden, self.dtype, self.kv_cache, self.index_cache,
                         self.device)  # fmt: skip
        if p.attn_tp == 1:
            return mine
        if mine is not None:
            ints, floats = buffers
        else:
            ints = torch.empty(int(leader_row[2]), dtype=torch.long)
            floats = torch.empty(int(leader_row[3]), dtype=self.dtype)
        start = time.perf_counter()
        self._broadcast(ints)
        if floats.numel():
            self._broadcast(floats)
        self.sync_seconds += time.perf_counter() - start
        if mine is not None:
            return mine
        return unpack(op, ints, floats, self.kv_cache, self.index_cache, self.device)

    def _broadcast(self, x: torch.Tensor) -> None:
        """The group leader's x to its attention group."""
        p = self.parallel
        if p.attn_shm is not None:
            p.attn_shm.broadcast(x, 0)
        else:
            torch.distributed.broadcast(x, p.sizes.leader(p.dp_rank), group=p.attn_cpu_group)

    def _execute(self, inputs: OpInputs, logits_rows: list[int], bucket: Any) -> Any:
        model = self.model
        if inputs.op == Op.LOGITS:
            return model.logits(inputs.hidden)
        if inputs.op == Op.EMBED:
            return model.embed(inputs.hidden)
        if inputs.op == Op.HICACHE:  # the leader moved its own bytes already
            if inputs.moves is not None and not self.parallel.is_leader:
                self.tiers.replay(inputs.moves)
            return None
        if inputs.op == Op.KV_SHARE:  # the leader's pool has them already
            if inputs.moves is not None and not self.parallel.is_leader:
                write_entries(self.kv_cache, self.index_cache, inputs.moves)
            return None
        if inputs.op == Op.FORWARD:
            return self._forward(inputs.batch, bucket, inputs.taps)
        if inputs.op == Op.FORWARD_LOGITS:  # DP attention gathers each group's logits rows
            hidden = self._forward(inputs.batch, bucket)
            with self.parallel.rows(logits_rows), installed(inputs.batch):
                return model.logits(hidden[inputs.batch.logits_rows])
        with installed(inputs.batch):
            return model.forward_mtp(inputs.hidden, inputs.reuse)

    def _native(self, mine: OpInputs) -> int:
        """1 where this leader's op can run on the native layers: a forward of all-decode rows
        (a decode step's, every row sampled, for FORWARD_LOGITS; a verify's, for FORWARD)."""
        if self.native is None or mine.op not in (Op.FORWARD, Op.FORWARD_LOGITS):
            return 0
        batch = mine.batch
        if not self.native.accepts(batch):
            return 0
        return int(mine.op == Op.FORWARD or mine.logits_rows == batch.input_ids.shape[0])

    def _native_forward(self, inputs: OpInputs, group_rows: list[int]) -> torch.Tensor:
        """The op on this rank's native layers (this group's rows, maybe none, among every
        group's `group_rows`): FORWARD_LOGITS the logits of every row; FORWARD the states as
        the layered model returns them (`join_taps`: the final normed states, then each tapped
        layer's) in the model dtype, without the LM head (the leader asks for the verified rows'
        logits in a LOGITS round)."""
        if inputs.op == Op.FORWARD_LOGITS:
            return self._native_call(inputs.batch, group_rows)
        last = self.model.config.num_hidden_layers - 1
        _, states = self._native_call(inputs.batch, group_rows, taps=(last, *inputs.taps),
                                      with_logits=False)  # fmt: skip
        return states.to(self.dtype)

    def _native_call(self, batch: ForwardBatch, group_rows: list[int], **kw) -> Any:
        """This rank's native layers over `batch`: their collectives continue the world's (and
        a DP attention group's own) shared-memory messages, sequence numbers handed over and
        back."""
        p, layers = self.parallel, self.native.native
        shms = [("comm_seq", p.world_shm)]
        if p.attn_shm is not None and p.attn_shm is not p.world_shm:
            shms.append(("attn_seq", p.attn_shm))
        for name, shm in shms:
            setattr(layers, name, shm.seq)
        self.native_rounds += 1
        waited = layers.comm_wait
        try:
            groups = (group_rows, p.dp_rank, p.attn_tp)
            return self.native.decode_logits(batch.input_ids, batch.positions, batch.decode_slots,
                                              self.kv_cache, self.index_cache, groups=groups,
                                              **kw)  # fmt: skip
        finally:
            for name, shm in shms:
                shm.seq = getattr(layers, name)
            p.comm_seconds += layers.comm_wait - waited  # its waits (bench/parallel.py)

    def _forward(self, batch: ForwardBatch, bucket: Any,
                 taps: tuple[int, ...] = ()) -> torch.Tensor:  # fmt: skip
        """The model over `batch`: this rank's CUDA graph of `bucket`, which every rank replays
        in this round (a group without rows over padding only: every group's rows are padded to
        the bucket, so the MLP's gather has the graph's shapes), else the layered model."""
        if bucket is not None:
            with self.parallel.rows([bucket.rows] * self.parallel.sizes.groups):
                return self.graphs(batch, bucket)
        with installed(batch):
            return self.model(taps)

    def follow(self) -> None:
        """A non-leader rank's loop: join every round until STOP."""
        try:
            while True:
                self.round(None)
        except Stopped:
            return


class DistributedModel:
    """The group leader's model: each call becomes this group's op in the rank rounds."""

    def __init__(self, runner: RankRunner) -> None:
        self.runner = runner
        self.model = runner.model
        self.config = runner.model.config
        self.with_mtp = runner.model.with_mtp

    @property
    def mtp(self):
        return self.model.mtp

    @property
    def native(self) -> bool:
        """All-decode steps run every rank's native layers (`RankRunner.native`)."""
        return self.runner.native is not None

    @property
    def rank_paths(self) -> list[str]:
        return self.runner.rank_paths

    @property
    def native_rounds(self) -> int:
        return self.runner.native_rounds

    def _run(self, inputs: OpInputs) -> Any:
        if inputs.op != Op.HICACHE:
            self.sync_tiers()
        while True:
            ran, result = self.runner.round(inputs)
            if ran:
                return result

    def __call__(self, taps: tuple[int, ...] = ()) -> torch.Tensor:
        return self._run(OpInputs(Op.FORWARD, batch=current_batch(), taps=taps))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The target's embedding of `input_ids` (vocab-parallel: a round of its own)."""
        return self._run(OpInputs(Op.EMBED, hidden=input_ids))

    def sync_tiers(self) -> bool:
        """Send the HiCache moves made since the last op to the group, which repeats them
        before any forward reads or writes those pages; False if there were none."""
        tiers = self.runner.tiers
        moves = tiers.take_journal() if tiers is not None else None
        if moves is not None:
            self._run(OpInputs(Op.HICACHE, moves=moves))
        return moves is not None

    def share_slots(self, slots: torch.Tensor) -> None:
        """Copy these pool slots' entries (every layer) from this leader's pool into its group's
        (KV that arrived here only: a PD decode's)."""
        message = pool_entries(self.runner.kv_cache, self.runner.index_cache, slots)
        self._run(OpInputs(Op.KV_SHARE, moves=message))

    def forward_logits(self) -> torch.Tensor:
        """The installed batch's forward and the logits of its `logits_rows`, in one round
        (the FORWARD and LOGITS rounds' headers and payloads, once)."""
        return self._run(OpInputs(Op.FORWARD_LOGITS, batch=current_batch()))

    def forward_mtp(
        self, hidden: torch.Tensor, reuse: Selection | None = None
    ) -> tuple[torch.Tensor, Selection]:
        return self._run(OpInputs(Op.MTP, batch=current_batch(), hidden=hidden, reuse=reuse))

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._run(OpInputs(Op.LOGITS, hidden=hidden))

    def idle(self) -> bool:
        """One heartbeat round (joining any other group's op; or the HiCache moves still to
        send); True if another group is busy."""
        if not self.sync_tiers():
            self.runner.round(None)
        return self.runner.others_busy

    def stop(self) -> None:
        self.sync_tiers()
        self.runner.stop()

"""Turns a scheduled batch into a ForwardBatch, runs the model, returns next-token logits."""

from __future__ import annotations

import torch
from torch.nn.utils.rnn import pad_sequence

from dsaserve.engine.decode.cuda_graph import CudaGraphRunner
from dsaserve.engine.decode.fused_step import DecodeStep
from dsaserve.engine.decode.paths import DecodePath, Step, build_paths
from dsaserve.engine.kvcache.pool import KVPool
from dsaserve.engine.scheduler import ScheduledBatch
from dsaserve.kernels.registry import DEFAULT_KERNELS, Kernels
from dsaserve.layers.forward_batch import ExtendSeq, ForwardBatch, forward_context
from dsaserve.models.dsa_moe import DsaMoeForCausalLM


class ModelRunner:
    """Runs steps on this engine's forward paths (paths.py: the first that accepts a step runs
    it) and the speculative verify and target runs."""

    def __init__(
        self,
        model: DsaMoeForCausalLM,
        pool: KVPool,
        device: torch.device,
        kernels: Kernels = DEFAULT_KERNELS,
        decode_step: DecodeStep | None = None,
        graphs: CudaGraphRunner | None = None,
    ) -> None:
        self.kernels = kernels
        self.model = model
        self.pool = pool
        self.device = device
        self.decode_step = decode_step  # the all-decode forward (fused_step.py)
        self.graphs = graphs  # CUDA-graph decode (cuda_graph.py), CUDA only
        self.paths = build_paths(model, pool, decode_step, graphs)

    def forward(
        self, scheduled: ScheduledBatch, all_rows: bool = False
    ) -> tuple[list[int], torch.Tensor]:
        """Run one step; return the batch indices that produced logits and those logits [R, V]
        (with `all_rows`, the logits of every computed token instead)."""
        step = Step(scheduled, all_rows, self.build)
        return self.path(step).logits(step)

    def path(self, step: Step) -> DecodePath:
        """The first path that accepts `step`."""
        return next(path for path in self.paths if path.accepts(step))

    def run_target(self, batch: ForwardBatch, taps: tuple[int, ...] = ()) -> torch.Tensor:
        """Hidden states of every row of `batch` through the target model (a speculative verify
        batch): its CUDA graph where one fits, else the layered model. With `taps` (the graphs
        were built with the same), [final ‖ tapped layers] per row (`join_taps`)."""
        if self.graphs is not None and self.graphs.accepts(batch):
            return self.graphs(batch)
        with forward_context(batch):
            return self.model(taps) if taps else self.model()

    def run_verify(self, batch: ForwardBatch, rows: torch.Tensor,
                   taps: tuple[int, ...] = ()) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        """A speculative verify: (the logits [R, V] of `rows`, the states of every row): the
        final hidden states [T, H] (EAGLE's MTP reads them), or with `taps` (a DFlash drafter's
        target layers) those layers' [T, n * H]. Its CUDA graph where one fits; else an
        all-decode batch runs the native layers where they are built (CPU: the states copied out
        in the same C++ call, the final ones as the last layer's tap); else the layered model."""
        step = self.decode_step
        graphed = self.graphs is not None and self.graphs.accepts(batch)
        if not graphed and step is not None and step.native is not None and step.accepts(batch):
            final = (self.model.config.num_hidden_layers - 1,)
            logits, states = step.fused.decode_logits(batch.input_ids, batch.positions,
                                                      batch.decode_slots, self.pool.kv_cache,
                                                      self.pool.index_cache,
                                                      taps=taps or final)  # fmt: skip
            # the native layers compute in fp32: hand the states on in the model's dtype, as the
            # layered model's (a bf16 MTP layer or drafter multiplies them by bf16 weights)
            return logits[rows], states.to(self.model.model.embed_tokens.weight.dtype)
        hidden = self.run_target(batch, taps)
        width = hidden.shape[1] // (1 + len(taps))
        return self.model.logits(hidden[rows, :width]), hidden[:, width:] if taps else hidden

    def build(
        self, scheduled: ScheduledBatch, as_decodes: list[bool] | None = None
    ) -> tuple[ForwardBatch, list[int]]:
        """The ForwardBatch of a scheduled step. Entries flagged in `as_decodes` (short runs:
        speculative verify and catch-up) are attended as one decode row per token, each over its
        own prefix, in the batched decode pass instead of one extend pass per sequence."""
        ids, positions, out_slots, extends = [], [], [], []
        decode_rows, decode_ctx, logits_rows, sampled = [], [], [], []
        row = 0
        for i, (req, start, end) in enumerate(
            zip(scheduled.reqs, scheduled.starts, scheduled.ends)
        ):
            fill = req.fill_ids
            ids += fill[start:end] if scheduled.input_ids is None else scheduled.input_ids[i]
            positions += range(start, end)
            out_slots.append(req.slots[start:end])
            if end - start == 1 or (as_decodes is not None and as_decodes[i]):
                decode_rows += range(row, row + end - start)
                decode_ctx += [req.slots[: pos + 1] for pos in range(start, end)]
            else:
                extends.append(ExtendSeq(row, end - start, req.slots[:end].to(self.device)))
            row += end - start
            if end == len(fill):
                logits_rows.append(row - 1)
                sampled.append(i)
        batch = self._assemble(ids, positions, out_slots, extends, decode_rows, decode_ctx)
        batch.logits_rows = torch.tensor(logits_rows, dtype=torch.long, device=self.device)
        return batch, sampled

    def _assemble(
        self, ids, positions, out_slots, extends, decode_rows, decode_ctx
    ) -> ForwardBatch:
        dev = self.device
        if decode_ctx:
            lens = torch.tensor([c.shape[0] for c in decode_ctx])
            slots = pad_sequence(decode_ctx, batch_first=True)
            valid = torch.arange(slots.shape[1])[None, :] < lens[:, None]
        else:
            slots = torch.zeros(0, 0, dtype=torch.long)
            valid = torch.zeros(0, 0, dtype=torch.bool)
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            out_slots=torch.cat(out_slots).to(dev),
            extends=extends,
            decode_rows=torch.tensor(decode_rows, dtype=torch.long, device=dev),
            decode_slots=slots.to(dev),
            decode_valid=valid.to(dev),
            logits_rows=torch.zeros(0, dtype=torch.long, device=dev),
            kv_cache=self.pool.kv_cache,
            index_cache=self.pool.index_cache,
            kernels=self.kernels,
        )

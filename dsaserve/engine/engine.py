"""`Engine`: model, KV pool, radix cache, scheduler and sampler behind one `step()`.

`step()` = schedule -> run -> sample -> postprocess. The API process drives it over ZMQ; the
offline `LLM` drives it in-process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from dsaserve.args import ServerArgs
from dsaserve.distributed.parallel_state import ParallelSizes, ParallelState
from dsaserve.engine.admission import Admission
from dsaserve.engine.decode.build import build_runner
from dsaserve.engine.kvcache.build import build_cache
from dsaserve.engine.messages import GenerateRequest, RequestOutput, TokenLogprob
from dsaserve.engine.request import Req
from dsaserve.engine.sampler import Sampler
from dsaserve.engine.scheduler import ScheduledBatch
from dsaserve.engine.shard import Shard, build_shard
from dsaserve.engine.spec.build import build_spec
from dsaserve.engine.stats import report

logger = logging.getLogger(__name__)


class Engine:
    """The engine of one attention group, in this process. With `--tp N` it is the group's first
    rank and `parallel` its place among ranks that are already running (runtime/ranks.py starts
    them): it drives them through `DistributedModel`. It starts no process."""

    def __init__(
        self, args: ServerArgs, parallel: ParallelState | None = None, show_progress: bool = True
    ) -> None:
        self.args = args
        self.parallel = parallel or ParallelState.single()
        if parallel is None and ParallelSizes.from_args(args).tp > 1:
            raise ValueError(f"Engine(args) with --tp {args.tp_size}: pass the ParallelState of "
                             "running ranks (runtime/ranks.py start_ranks; LLM and dsaserve "
                             "serve start them)")  # fmt: skip
        shard = build_shard(args, self.parallel, show_progress, own_threads=True)
        self._init_shard(shard)
        self.cache = build_cache(args, shard.pool, shard.dtype, shard.with_mtp, self.parallel)
        built = build_runner(args, shard, self.cache, self.parallel)
        self.runner, self.scheduler, self.context_length, self.graphs = built
        self.model = self.runner.model  # with ranks, the leader's DistributedModel
        self.spec = build_spec(args, self.runner, shard)
        self._init_admission(Admission(args, shard.config, self.context_length))
        self.sampler = Sampler(seed=args.random_seed)
        self.reqs: dict[str, Req] = {}
        # disaggregation's hook: called on each finished request before its KV is released
        self.before_release: Callable[[Req], None] | None = None
        self.stats_counters = {"prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0}
        self._closed = False

    def _init_shard(self, shard: Shard) -> None:
        """This rank's model and KV pool (engine/shard.py, as every follower builds its own)."""
        self.shard, self.model_config, self.pool = shard, shard.config, shard.pool
        self.device, self.dtype, self.kernels = shard.device, shard.dtype, shard.kernels
        self.with_mtp = shard.with_mtp
        self.fp8_ranks = shard.fp8_ranks  # every rank's FP8 report (FP8 checkpoints)
        self.kv_dtype = self.pool.kv_dtype  # the stored form
        logger.info("KV pool: %d tokens in pages of %d (%d B/token)", self.pool.num_tokens,
                    self.pool.page_size, shard.kv_bytes_per_token)  # fmt: skip

    def _init_admission(self, admission: Admission) -> None:
        self.admission = admission
        self.tokenizer, self.grammar = admission.tokenizer, admission.grammar
        self.generation_defaults = admission.generation_defaults
        self.eos_token_ids = admission.eos_token_ids

    # ---- requests -------------------------------------------------------------------------
    def add_request(self, request: GenerateRequest) -> None:
        """Queue one completion. Raises ValueError (naming the field) for input it cannot serve;
        nothing is left behind when it raises."""
        self.enqueue(self.make_req(request))

    def enqueue(self, req: Req) -> None:
        self.reqs[req.rid] = req
        if req.params.grammar is None:
            self.scheduler.add(req)
        else:  # scheduled once its grammar is compiled (off the step)
            self.grammar.submit(req)

    def make_req(self, request: GenerateRequest) -> Req:
        """A checked `Req` for `request`, not yet queued (ValueError naming the field)."""
        return self.admission.make_req(request, self.reqs)

    def adopt(
        self, req: Req, pages: list[int], first: int, logprob: TokenLogprob | None
    ) -> list[RequestOutput]:
        """Start `req` decoding from KV computed elsewhere: `pages` hold its whole prompt and
        `first` is the token sampled after it (prefill/decode disaggregation)."""
        req.pages, req.kv_len, req.cached_tokens = list(pages), len(req.prompt_ids), 0
        if self.parallel.attn_tp > 1:  # it arrived in this rank's pool: the group needs it too
            self.model.share_slots(self.pool.slots(pages, 0, len(pages) * self.pool.page_size))
        self.scheduler.adopt(req)
        self.reqs[req.rid] = req
        self._append(req, first, logprob)
        return self._collect([req]) if req.finished or req.stream else []

    def abort(self, rid: str) -> RequestOutput | None:
        req = self.reqs.pop(rid, None)
        if req is None:
            return None
        self.grammar.pending.discard(req)
        self.scheduler.finish(req)
        req.finish("abort")
        return req.take_output()

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(len(self.grammar))

    # ---- the step -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One batch. A failure while running it ends that batch's requests with an error (their
        KV freed, nothing cached from the failed run); the engine serves everyone else."""
        refused = self._admit_compiled()
        scheduled = self.scheduler.schedule()
        if scheduled is None:
            if len(self.grammar):
                self.grammar.pending.wait(0.005)  # nothing runnable: let the compile thread work
            elif self.has_work():
                time.sleep(0.001)  # only waiting on a storage prefetch: let its thread run
            return refused
        try:
            self._count_prompt(scheduled)
            if self.spec is not None:
                self.spec.step(scheduled, self.sampler, self._append_isolated)
                self.spec.report.log_line(self.stats)
            else:
                self._step_plain(scheduled)
        except Exception as e:
            if self.parallel.world > 1:  # the ranks are out of lock-step: the engine must go
                raise
            logger.exception("a step failed; ending its %d request(s)", len(scheduled.reqs))
            for req in scheduled.reqs:
                req.fail(f"the engine could not run this request: {type(e).__name__}")
        return refused + self._collect(scheduled.reqs)

    def _admit_compiled(self) -> list[RequestOutput]:
        """Queue the requests whose grammar is ready; answer those whose grammar failed."""
        if not len(self.grammar):
            return []
        ready, failed = self.grammar.resolve()
        for req in ready:
            self.scheduler.add(req)
        for req in failed:
            self.reqs.pop(req.rid, None)
            req.finish("abort")
        return [req.take_output() for req in failed]

    def _step_plain(self, scheduled: ScheduledBatch) -> None:
        ahead = self.grammar.fill_ahead(scheduled)
        sampled, logits = self.runner.forward(scheduled)
        for req, end in zip(scheduled.reqs, scheduled.ends):
            req.kv_len = end
        reqs = [scheduled.reqs[i] for i in sampled]
        if reqs:
            filled = ahead.result() if ahead is not None else None
            result = self.sampler(logits, [r.sampling for r in reqs], filled)
            for req, token, lp in zip(reqs, result.token_ids, result.logprobs):
                self._append_isolated(req, token, lp)

    def _append_isolated(self, req: Req, token: int, logprob: TokenLogprob | None) -> None:
        """`_append`, where a failure (detokenizing, stop checks) ends this request alone."""
        try:
            self._append(req, token, logprob)
        except Exception as e:
            logger.exception("request %s failed after its step", req.rid)
            req.fail(f"the engine could not continue this request: {type(e).__name__}")

    def _count_prompt(self, scheduled: ScheduledBatch) -> None:
        for req, start in zip(scheduled.reqs, scheduled.starts):
            if start == req.cached_tokens and not req.output_ids:
                self.stats_counters["prompt_tokens"] += len(req.prompt_ids)
                self.stats_counters["cached_tokens"] += req.cached_tokens

    def _append(self, req: Req, token: int, logprob: TokenLogprob | None) -> None:
        self.stats_counters["generated_tokens"] += 1
        req.append(token, logprob, self.eos_token_ids, self.context_length)

    def _collect(self, reqs: list[Req]) -> list[RequestOutput]:
        outputs = []
        for req in dict.fromkeys(reqs):
            if req.finished:
                if self.before_release is not None:
                    self.before_release(req)
                self.scheduler.finish(req)
                self.reqs.pop(req.rid, None)
                outputs.append(req.take_output())
            elif req.stream and req.pending_ids:
                outputs.append(req.take_output())
        return outputs

    # ---- introspection --------------------------------------------------------------------
    def stats(self) -> dict:
        return report(self)

    def idle(self) -> bool:
        """Join the other ranks' heartbeat (and, under DP attention, other groups' ops) while
        this group has nothing to run; True when another group is busy."""
        return self.model.idle() if self.parallel.world > 1 else False

    def close(self, graceful: bool = True) -> None:
        """Leave the rank rounds: a STOP round ends the other ranks' loops (after a failure,
        `graceful=False`, there is none: whoever started the ranks ends them)."""
        if self.parallel.world > 1 and graceful and not self._closed:
            self._closed = True
            self.model.stop()

    def flush_cache(self) -> bool:
        if self.has_work():
            return False
        self.cache.clear()  # device and host tiers; a storage tier persists
        return True

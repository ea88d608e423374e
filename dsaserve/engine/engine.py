"""`Engine`: model, KV pool, radix cache, scheduler and sampler behind one `step()`.

`step()` = schedule -> run -> sample -> postprocess. The API process drives it over ZMQ; the
offline `LLM` drives it in-process.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path

import torch
from transformers import AutoTokenizer

from dsaserve.args import ServerArgs
from dsaserve.dflash_args import dflash_settings
from dsaserve.distributed.parallel_state import ParallelSizes, ParallelState
from dsaserve.engine.admission import check_params, check_request, sampling_params
from dsaserve.engine.cuda_graph import CudaGraphRunner
from dsaserve.engine.decode_step import DecodeStep
from dsaserve.engine.detokenizer import IncrementalDetokenizer
from dsaserve.engine.dflash_setup import block_size, build_decoder, load_dflash
from dsaserve.engine.grammar_gate import GrammarGate
from dsaserve.engine.io import GenerateRequest, RequestOutput, TokenLogprob
from dsaserve.engine.kv_pool import page_slots
from dsaserve.engine.model_runner import ModelRunner
from dsaserve.engine.radix_cache import RadixCache
from dsaserve.engine.report import report
from dsaserve.engine.request import Req
from dsaserve.engine.rounds import DistributedModel, RankRunner
from dsaserve.engine.sampler import Sampler, SamplingState
from dsaserve.engine.scheduler import ScheduledBatch, Scheduler, SchedulerConfig
from dsaserve.engine.shard import Shard, build_shard
from dsaserve.engine.speculative import SpecDecoder
from dsaserve.engine.startup import default_threads, generation_defaults, max_running, pick_device
from dsaserve.kernels.kv_quant import kv_dtype_name
from dsaserve.layers.fp8_experts import expert_bytes

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
        if pick_device(args.device).type == "cpu":  # default: OMP_NUM_THREADS, else the cores
            torch.set_num_threads(default_threads(args.threads))
        elif args.threads is not None:
            torch.set_num_threads(args.threads)
        self.dflash = dflash_settings(args)  # DFLASH: a separate block drafter (engine/dflash.py)
        self._init_shard(build_shard(args, self.parallel, show_progress))
        self._init_runner()
        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path)
        self.generation_defaults = generation_defaults(Path(args.model_path))
        self.eos_token_ids = list(self.generation_defaults.get("eos_token_id", []))
        self.eos_token_ids = self.eos_token_ids or list(self.model_config.eos_token_ids)
        self.sampler = Sampler(seed=args.random_seed)
        vocab, backend = self.model_config.vocab_size, args.grammar_backend
        self.grammar = GrammarGate(backend, self.tokenizer, vocab, self.eos_token_ids)
        self.reqs: dict[str, Req] = {}
        # disaggregation's hook: called on each finished request before its KV is released
        self.before_release: Callable[[Req], None] | None = None
        self.stats_counters = {"prompt_tokens": 0, "cached_tokens": 0, "generated_tokens": 0}
        self._closed = False

    def _init_shard(self, shard: Shard) -> None:
        """This rank's model and KV pool (engine/shard.py, as every follower builds its own)."""
        self.model_config, self.device, self.dtype = shard.config, shard.device, shard.dtype
        self.kernels, self.spec_steps = shard.kernels, shard.spec_steps
        self.with_mtp = shard.with_mtp
        self.model, self.pool = shard.model, shard.pool
        self.fp8_ranks = shard.fp8_ranks  # every rank's FP8 report (FP8 checkpoints)
        self.fp8_linears, self.fp8_experts = shard.fp8_kept.linears, shard.fp8_kept.expert_layers
        self.routed_expert_bytes = expert_bytes(self.model)  # this rank's
        self.drafter = None  # the DFLASH drafter runs on this (the group's first) rank only
        if self.dflash is not None:
            self.drafter = load_dflash(self.dflash, self.model_config, self.dtype, self.device)
        self.kv_dtype = kv_dtype_name(self.pool.index_cache.dtype)  # the stored form
        self.kv_bytes_per_token = shard.kv_bytes_per_token
        if self.parallel.world > 1:
            runner = RankRunner(self.model, self.pool.kv_cache, self.pool.index_cache,
                                self.parallel, self.device)  # fmt: skip
            self.model = DistributedModel(runner)
        page_size = self.pool.page_size
        self.cache = self._make_cache(page_size)
        if self.parallel.world > 1 and self.args.enable_hierarchical_cache:
            runner.tiers = self.cache.moves  # the group repeats its moves (hicache_moves.py)
        logger.info("KV pool: %d tokens in pages of %d (%d B/token)", self.pool.num_tokens,
                    page_size, self.kv_bytes_per_token)  # fmt: skip

    def _init_runner(self) -> None:
        """The scheduler, the decode step, the model runner (with CUDA graphs) and EAGLE/MTP."""
        cfg, args, mtp, page_size = self.model_config, self.args, self.with_mtp, self.pool.page_size
        stored = self.pool.index_cache.dtype  # the pool's storage dtype (uint8: FP8)
        running = max_running(args, mtp or self.drafter is not None, self.device)
        drafts = block_size(self.dflash, self.drafter) - 1 if self.drafter else self.spec_steps
        taps = self.drafter.config.target_layer_ids if self.drafter else ()
        # CUDA-graph decode (engine/cuda_graph.py; takes one scratch page). With ranks every
        # rank replays its own in the FORWARD rounds (followers: runtime/follower.py), so the
        # ModelRunner here keeps none; not with a DFLASH drafter (its taps are the leader's).
        ranks = self.parallel.world > 1
        self.graphs = None
        if not ranks or self.drafter is None:
            model = self.model.runner.model if ranks else self.model
            self.graphs = CudaGraphRunner.build(model, self.pool, self.kernels,
                                                args.cuda_graph_max_bs, running, drafts,
                                                args.disable_cuda_graph, taps)  # fmt: skip
        if ranks:
            self.model.runner.graphs = self.graphs
        reserved = page_size if self.graphs is not None else 0
        # Why the reserve: a verify run computes drafts + 1 tokens past the last kept one.
        context = min(args.context_length or cfg.context_length,
                      self.pool.num_tokens - reserved - drafts)  # fmt: skip
        self.context_length = context
        chunk = args.chunked_prefill_size or (8192 if self.device.type == "cuda" else 2048)
        config = SchedulerConfig(running, chunk, context, decode_tokens=drafts + 1)
        self.scheduler = Scheduler(config, self.pool, self.cache)
        # The fused decode path reads the pool and the weights itself: only over the torch
        # kernels, on one rank (Triton kernels, the ranks: layered). The native layers read an
        # fp32, bf16 or FP8 pool; the Python fused path an fp32 one (engine/decode_step.py).
        plain = set(self.kernels.names.values()) == {"torch"} and self.parallel.world == 1
        fused = plain and not args.disable_fused_decode
        native = not args.disable_native_decode
        step = DecodeStep.build(self.model, fused, args.enable_torch_compile, native=native,
                                cache_dtype=stored)  # fmt: skip
        self.runner = ModelRunner(self.model, self.pool, self.device, self.kernels, step,
                                  None if ranks else self.graphs)  # fmt: skip
        self.spec = None
        if mtp:
            share = cfg.index_share_for_mtp_iteration
            self.spec = SpecDecoder(self.model, self.runner, self.spec_steps, share)
        if self.drafter is not None:
            self.spec = build_decoder(self.runner, self.drafter, self.kernels,
                                      self.pool.num_tokens, self.dflash, native)  # fmt: skip

    def _make_cache(self, page_size: int) -> RadixCache:
        if not self.args.enable_hierarchical_cache:
            return RadixCache(self.pool.pages, page_size, enabled=not self.args.disable_radix_cache)
        from dsaserve.engine.hicache_setup import build_hicache

        return build_hicache(self.args, self.pool, self.dtype, self.with_mtp, self.parallel)

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
        vocab = self.model_config.vocab_size
        check_request(request, self.reqs, vocab, self.context_length)
        params = sampling_params(request.sampling, self.generation_defaults)
        check_params(params, vocab, self.grammar.compiler is not None)
        state = SamplingState(params, request.input_ids, vocab, self.eos_token_ids)
        detok = IncrementalDetokenizer(
            self.tokenizer, request.input_ids, params.stop, params.skip_special_tokens,
            params.no_stop_trim,
        )  # fmt: skip
        return Req(request.rid, list(request.input_ids), params, state, detok, request.stream)

    def adopt(
        self, req: Req, pages: list[int], first: int, logprob: TokenLogprob | None
    ) -> list[RequestOutput]:
        """Start `req` decoding from KV computed elsewhere: `pages` hold its whole prompt and
        `first` is the token sampled after it (prefill/decode disaggregation)."""
        req.pages, req.kv_len, req.cached_tokens = list(pages), len(req.prompt_ids), 0
        if self.parallel.attn_tp > 1:  # it arrived in this rank's pool: the group needs it too
            self.model.share_slots(page_slots(pages, self.pool.page_size))
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

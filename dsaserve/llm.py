"""The offline API: `LLM(model_path, **engine_args).generate(prompts, sampling_params)`.

It drives the same engine as the server, in-process (no HTTP, no ZMQ).
"""

from __future__ import annotations

import dataclasses
import sys
import time
from dataclasses import dataclass, field

from tqdm import tqdm

from dsaserve.args import ServerArgs
from dsaserve.distributed.parallel_state import ParallelSizes
from dsaserve.engine.engine import Engine
from dsaserve.engine.messages import GenerateRequest, RequestOutput, TokenLogprob
from dsaserve.engine.startup import pick_device
from dsaserve.runtime.hub import resolve_checkpoints
from dsaserve.runtime.memory_fit import check_memory_fit
from dsaserve.runtime.preflight import preflight
from dsaserve.runtime.ranks import LocalRanks, start_ranks
from dsaserve.sampling_params import SamplingParams

Prompt = str | list[int]


@dataclass
class Completion:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: dict | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class Output:
    """One prompt's result: its first completion's fields, and all `n` in `samples`."""

    prompt_token_ids: list[int]
    cached_tokens: int
    samples: list[Completion]

    @property
    def token_ids(self) -> list[int]:
        return self.samples[0].token_ids

    @property
    def text(self) -> str:
        return self.samples[0].text

    @property
    def finish_reason(self) -> dict | None:
        return self.samples[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.samples[0].logprobs


def _say(phase: str) -> None:
    print(f"dsaserve: {phase}", file=sys.stderr, flush=True)


class LLM:
    """The engine in this process; with `tp_size` > 1 this process is rank 0 and starts the
    node's other ranks (stopped by `close`, also on `with` exit)."""

    def __init__(self, model_path: str | None = None, **engine_args) -> None:
        if model_path is not None:
            engine_args["model_path"] = str(model_path)
        args = resolve_checkpoints(ServerArgs(**engine_args), _say)  # a Hub id: its snapshot
        preflight(args, offline=True)
        check_memory_fit(args)
        self.ranks: LocalRanks | None = None
        if ParallelSizes.from_args(args).tp > 1:
            self.ranks = start_ranks(args, pick_device(args.device).type)
        try:
            self.engine = Engine(args, self.ranks.parallel if self.ranks else None)
        except BaseException:
            if self.ranks is not None:
                self.ranks.kill()
            raise
        self.tokenizer = self.engine.tokenizer
        self._next_id = 0

    def close(self) -> None:
        """Stop the ranks this process started: a STOP round, then wait for them to exit."""
        self.engine.close()
        if self.ranks is not None:
            self.ranks.stop()
            self.ranks = None

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def generate(
        self,
        prompts: Prompt | list[Prompt],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[Output]:
        prompts = _as_list(prompts)
        params = sampling_params or SamplingParams()
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError("sampling_params must be one object or one per prompt")
        token_lists = [self._tokenize(p) for p in prompts]
        outputs = [Output(ids, 0, [Completion() for _ in range(sp.n)])
                   for ids, sp in zip(token_lists, params)]  # fmt: skip
        slots = {}
        for i, (ids, sp) in enumerate(zip(token_lists, params)):
            for j in range(sp.n):
                seed = None if sp.seed is None else sp.seed + j
                one = dataclasses.replace(sp, n=1, seed=seed)
                rid = f"llm-{self._next_id}"
                self._next_id += 1
                request = GenerateRequest(rid=rid, input_ids=ids, sampling=dataclasses.asdict(one))
                self.engine.add_request(request)
                slots[rid] = (i, j)
        self._run(slots, outputs, use_tqdm and len(slots) > 1)
        return outputs

    def _run(self, slots: dict, outputs: list[Output], show: bool) -> None:
        start, tokens = time.perf_counter(), 0
        with tqdm(total=len(slots), desc="Generating", unit="req", disable=not show) as bar:
            while self.engine.has_work():
                for out in self.engine.step():
                    if out.error is not None:
                        raise ValueError(out.error)
                    tokens += len(out.token_ids)
                    self._absorb(outputs, slots[out.rid], out)
                    if out.finished:
                        bar.update()
                bar.set_postfix(tok_s=f"{tokens / (time.perf_counter() - start):.1f}")

    @staticmethod
    def _absorb(outputs: list[Output], slot: tuple[int, int], out: RequestOutput) -> None:
        prompt, sample = outputs[slot[0]], outputs[slot[0]].samples[slot[1]]
        sample.token_ids += out.token_ids
        sample.text += out.text
        if out.logprobs is not None:
            sample.logprobs = (sample.logprobs or []) + list(out.logprobs)
        if out.finished:
            sample.finish_reason = out.finish_reason
            prompt.cached_tokens = max(prompt.cached_tokens, out.cached_tokens)

    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt, add_special_tokens=False).input_ids
        return list(prompt)


def _as_list(prompts: Prompt | list[Prompt]) -> list[Prompt]:
    if isinstance(prompts, str):
        return [prompts]
    if prompts and isinstance(prompts[0], int):
        return [prompts]
    return list(prompts)

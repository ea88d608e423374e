"""A test double: an engine that replays scripted outputs (for parser checks through HTTP).

Random weights produce random text, so end-to-end parser tests ask for a script: a prompt that
contains `[[script:KEY]]` gets the text of script KEY (the last such mark wins, so a conversation
can change script turn by turn), a few characters per step, honouring stop strings and
`max_tokens` (one step = one token). Other prompts go to the real engine, or, with no real engine,
produce filler words. A script with `"load": true` counts in the stats (`num_running`,
`kv_used_tokens`: what `/get_load` reports) beside the real engine's requests. A test serves it
with `python tests/scripted_serve.py` (server_harness.py's
`running_server(..., scripts=...)`), which hands `ScriptedEngineFactory` to `dsaserve serve`'s
engine process; the package knows nothing of it.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from dsaserve.args import ServerArgs
from dsaserve.distributed.parallel_state import ParallelState
from dsaserve.engine.messages import GenerateRequest, RequestOutput

SCRIPT_MARK = re.compile(r"\[\[script:([\w-]+)\]\]")


def load_scripts(path: str | None) -> dict[str, dict]:
    return json.loads(Path(path).read_text()) if path else {}


@dataclass
class _Script:
    rid: str
    text: str
    chunk: int
    finish: str
    max_tokens: int
    prompt_tokens: int
    delay: float = 0.0
    load: bool = False  # counted as a running request (and its KV) in the engine's stats
    pos: int = 0
    steps: int = 0
    matched: str | None = None
    aborted: bool = False
    extra: dict = field(default_factory=dict)


@dataclass(frozen=True)
class ScriptedEngineFactory:
    """The engine process's EngineFactory (runtime/engine_process.py): the scripts of
    `scripts_path` in front of the real engine, or (`real=False`) alone. Picklable, for the
    spawn."""

    scripts_path: str | None
    real: bool = True

    def __call__(self, args: ServerArgs, parallel: ParallelState, reject: Any) -> ScriptedEngine:
        from dsaserve.engine.engine import Engine

        real = Engine(args, parallel) if self.real else None
        return ScriptedEngine(args, load_scripts(self.scripts_path), real)


class _StandaloneConfig:
    def __init__(self, context_length: int) -> None:
        self.context_length = context_length
        self.vocab_size = None


class ScriptedEngine:
    """Scripted outputs in front of an optional real engine (same interface as `Engine`)."""

    def __init__(self, args: ServerArgs, scripts: dict[str, dict], real: Any | None) -> None:
        self.scripts = scripts
        self.real = real
        self.active: dict[str, _Script] = {}
        if real is not None:
            self.tokenizer = real.tokenizer
            self.model_config = real.model_config
            self.generation_defaults = real.generation_defaults
            self.context_length = getattr(real, "context_length", real.model_config.context_length)
        else:
            self._init_standalone(args)

    def _init_standalone(self, args: ServerArgs) -> None:
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_path or args.model_path)
        config = json.loads((Path(args.model_path) / "config.json").read_text())
        length = args.context_length or config.get("max_position_embeddings", 4096)
        self.model_config = _StandaloneConfig(length)
        self.context_length = length
        self.generation_defaults = {}

    def add_request(self, request: GenerateRequest) -> None:
        prompt = self.tokenizer.decode(request.input_ids)
        marks = SCRIPT_MARK.findall(prompt)  # the last one: a conversation's latest turn
        if marks and marks[-1] in self.scripts:
            self.active[request.rid] = self._script(request, self.scripts[marks[-1]])
        elif self.real is not None:
            self.real.add_request(request)
        else:
            filler = "".join(f" w{i}" for i in range(1024))
            self.active[request.rid] = self._script(request, {"text": filler, "finish": "length"})

    def _script(self, request: GenerateRequest, spec: dict) -> _Script:
        sampling = request.sampling
        script = _Script(
            rid=request.rid, text=spec["text"], chunk=int(spec.get("chunk", 3)),
            finish=spec.get("finish", "stop"), delay=float(spec.get("delay", 0.0)),
            load=bool(spec.get("load", False)),
            max_tokens=sampling.get("max_tokens") or 1 << 30, prompt_tokens=len(request.input_ids),
        )  # fmt: skip
        for stop in sampling.get("stop") or []:
            pos = script.text.find(stop)
            if pos != -1:  # the text is cut at each match, so the earliest one wins
                script.text, script.matched, script.finish = script.text[:pos], stop, "stop"
        if spec.get("crash"):
            script.extra["crash"] = True
        return script

    def step(self) -> list[RequestOutput]:
        outputs = self.real.step() if self.real is not None and self.real.has_work() else []
        for script in list(self.active.values()):
            outputs.append(self._advance(script))
        if any(s.delay for s in self.active.values()):
            time.sleep(max(s.delay for s in self.active.values()))
        for rid in [o.rid for o in outputs if o.finished and o.rid in self.active]:
            del self.active[rid]
        return outputs

    def _advance(self, s: _Script) -> RequestOutput:
        if s.extra.get("crash"):
            raise RuntimeError("scripted crash")
        if s.aborted:
            return self._output(s, "", {"type": "abort", "matched": None})
        piece = s.text[s.pos : s.pos + s.chunk]
        s.pos += len(piece)
        s.steps += 1
        if s.steps >= s.max_tokens and s.pos < len(s.text):
            return self._output(s, piece, {"type": "length", "matched": None})
        if s.pos >= len(s.text):
            reason = {"type": s.finish, "matched": s.matched if s.finish == "stop" else None}
            return self._output(s, piece, reason)
        return self._output(s, piece, None)

    def _output(self, s: _Script, text: str, finish: dict | None) -> RequestOutput:
        return RequestOutput(
            rid=s.rid, token_ids=[0] if text else [], text=text, finished=finish is not None,
            finish_reason=finish, prompt_tokens=s.prompt_tokens, completion_tokens=s.steps,
        )  # fmt: skip

    def abort(self, rid: str) -> RequestOutput | None:
        if rid in self.active:
            self.active[rid].aborted = True  # its final output comes with the next step
        elif self.real is not None:
            return self.real.abort(rid)
        return None

    def has_work(self) -> bool:
        return bool(self.active) or (self.real is not None and self.real.has_work())

    def stats(self) -> dict:
        stats = self.real.stats() if self.real is not None else {"num_running": 0, "num_waiting": 0}
        stats = dict(stats)
        stats["num_scripted"] = len(self.active)
        counted = list(self.active.values()) if self.real is None else [
            s for s in self.active.values() if s.load]  # fmt: skip
        if self.real is None:
            stats["num_running"] = stats["kv_used_tokens"] = 0
        stats["num_running"] += len(counted)
        stats["kv_used_tokens"] = stats.get("kv_used_tokens", 0) + sum(
            s.prompt_tokens + s.steps for s in counted)  # fmt: skip
        return stats

    def flush_cache(self) -> bool:
        return self.real.flush_cache() if self.real is not None else not self.active

    def idle(self) -> bool:
        return self.real.idle() if self.real is not None else False

    def close(self, graceful: bool = True) -> None:
        if self.real is not None:
            self.real.close(graceful)

"""Template and request preparation in the API process: messages -> prompt -> engine requests.

The checkpoint's `chat_template.jinja` is rendered through the tokenizer with
`chat_template_kwargs` merged over `--default-chat-template-kwargs`; a DeepSeek-V3.2 checkpoint
without one gets its built-in encoder (`templates/deepseek_v32.py`, thinking from the `thinking`
kwarg). OpenAI JSON-string tool-call
arguments in the history become objects (the GLM template renders them key by key). The parser
mode follows what the rendered prompt ends with: `<think>` means the output starts in reasoning.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dsaserve.args import ServerArgs
from dsaserve.engine.messages import GenerateRequest
from dsaserve.sampling_params import SamplingParams
from dsaserve.server.parsers.choice import (
    DEEPSEEK_V32,
    resolve_reasoning_parser,
    resolve_tool_parser,
)
from dsaserve.server.structured import StructuredOutput
from dsaserve.server.templates import deepseek_v32, model_type_of
from dsaserve.web.errors import APIError, bad_request

SAMPLING_FIELDS = [f.name for f in dataclasses.fields(SamplingParams)]


@dataclass
class PreparedChat:
    """A chat request ready for the engine: its prompt, its sampling, how to parse its output."""

    prompt: str
    input_ids: list[int]
    sampling: SamplingParams
    force_reasoning: bool
    reasoning_parser: str | None
    tool_parser: str | None
    tools: list[dict]
    tool_choice: Any


class TokenizerManager:
    """Owns the tokenizer and template; turns API requests into engine requests."""

    def __init__(self, args: ServerArgs, tokenizer: Any, engine_info: dict) -> None:
        self.args = args
        self.tokenizer = tokenizer
        template = tokenizer.chat_template if isinstance(tokenizer.chat_template, str) else ""
        self.template = template or ""
        self.context_length = int(args.context_length or engine_info["context_length"])
        self.generation_defaults = engine_info.get("generation_defaults") or {}
        vocab = set(tokenizer.get_vocab())
        model_type = model_type_of(args.model_path)
        deepseek = model_type == DEEPSEEK_V32 or args.tool_call_parser == "deepseekv32"
        self.builtin_encoder = not self.template and deepseek  # as sglang picks its dsv32 encoder
        self.vocab_size = int(engine_info.get("vocab_size") or len(tokenizer))
        self.reasoning_parser = resolve_reasoning_parser(
            args.reasoning_parser, self.template, vocab, model_type
        )
        self.tool_parser = resolve_tool_parser(args.tool_call_parser, self.template, model_type)
        self.default_kwargs = args.chat_template_defaults()
        self.model_name = args.served_model_name or args.model_id or Path(args.model_path).name
        self.structured = StructuredOutput(args.grammar_backend, tokenizer.get_vocab())

    # ---- chat
    def render_chat(self, messages: list[dict], tools: list[dict] | None, kwargs: dict) -> str:
        if self.builtin_encoder:
            try:
                return deepseek_v32.render_chat(messages, tools, bool(kwargs.get("thinking")))
            except (ValueError, KeyError, TypeError) as e:
                raise bad_request(f"cannot render the prompt: {e}", "messages") from e
        if not self.template:
            raise APIError(400, "this model has no chat template; use /v1/completions")
        try:
            return self.tokenizer.apply_chat_template(
                messages, tools=tools or None, tokenize=False, add_generation_prompt=True, **kwargs
            )
        except Exception as e:  # a template `raise_exception` or a malformed history
            raise bad_request(f"cannot render the chat template: {e}", "messages") from e

    def template_kwargs(self, request_kwargs: dict | None, reasoning_effort: str | None) -> dict:
        kwargs = {**self.default_kwargs, **(request_kwargs or {})}
        if reasoning_effort is not None:
            kwargs.setdefault("enable_thinking", reasoning_effort != "none")
            kwargs.setdefault("thinking", reasoning_effort != "none")  # DeepSeek's switch
            kwargs.setdefault("reasoning_effort", reasoning_effort)
        return kwargs

    def validation_context(self) -> dict:
        """What the request models check against: the vocabulary and the `n` cap."""
        return {"vocab_size": self.vocab_size, "max_n": self.args.max_n}

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; the Rust tokenizer's batch call releases the GIL, so a long
        prompt tokenized in a worker thread does not stall the event loop."""
        fast = getattr(self.tokenizer, "_tokenizer", None)
        if fast is not None and hasattr(fast, "encode_batch"):
            return fast.encode_batch([text], add_special_tokens=False)[0].ids
        return self.tokenizer.encode(text, add_special_tokens=False)

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    # ---- limits and sampling
    def fit_max_tokens(
        self, prompt_len: int, max_tokens: int | None, param: str, prompt_param: str = "messages"
    ) -> int:
        """Check the prompt against the context and return the effective max_tokens."""
        if prompt_len >= self.context_length:
            raise bad_request(
                f"the prompt has {prompt_len} tokens; this model's context length is "
                f"{self.context_length}",
                prompt_param,
                code="context_length_exceeded",
            )
        if max_tokens is not None and max_tokens > self.context_length:
            raise bad_request(
                f"{param} must be <= the context length {self.context_length}, got {max_tokens}",
                param,
            )
        room = self.context_length - prompt_len
        return room if max_tokens is None else min(max_tokens, room)

    def sampling(self, fields: dict, max_tokens: int) -> SamplingParams:
        values = {k: v for k, v in fields.items() if k in SAMPLING_FIELDS and v is not None}
        values["max_tokens"] = max_tokens
        if isinstance(values.get("stop"), str):
            values["stop"] = [values["stop"]]
        try:
            return SamplingParams(**values)
        except (ValueError, TypeError) as e:
            raise bad_request(str(e), str(e).split(" ")[0]) from e

    def check_sequences(self, count: int, param: str) -> None:
        """Bound the engine requests one HTTP request makes (prompts x n)."""
        limit = self.args.max_sequences_per_request
        if count > limit:
            raise bad_request(
                f"this request makes {count} sequences (prompts x n); at most {limit} are "
                "allowed (--max-sequences-per-request)",
                param,
            )

    def make_requests(
        self, input_ids: list[int], sampling: SamplingParams, rid: str | None
    ) -> list[GenerateRequest]:
        """One engine request per choice (`n` expanded; choice i uses seed + i)."""
        base = rid or uuid.uuid4().hex
        self.check_sequences(sampling.n, "n")
        requests = []
        for i in range(sampling.n):
            seed = None if sampling.seed is None else _wrap_int64(sampling.seed + i)
            choice = dataclasses.replace(sampling, n=1, seed=seed)
            requests.append(
                GenerateRequest(
                    rid=f"{base}-{i}", input_ids=input_ids, sampling=dataclasses.asdict(choice)
                )
            )
        return requests


def _wrap_int64(value: int) -> int:
    """Choice i's seed (seed + i) stays a 64-bit signed integer, as the IPC boundary needs."""
    return (value + 2**63) % 2**64 - 2**63


def normalize_messages(messages: list[Any]) -> list[dict]:
    """OpenAI messages (pydantic) -> plain dicts for the template, validating as we go."""
    out = []
    for i, message in enumerate(messages):
        item: dict[str, Any] = {"role": "system" if message.role == "developer" else message.role}
        item["content"] = _content_text(message.content, f"messages[{i}].content")
        if message.role == "user" and message.content is None:
            raise bad_request("a user message needs content", f"messages[{i}].content")
        if message.reasoning_content is not None:
            item["reasoning_content"] = message.reasoning_content
        if message.tool_calls:
            item["tool_calls"] = [
                _tool_call(call, f"messages[{i}].tool_calls[{j}]")
                for j, call in enumerate(message.tool_calls)
            ]
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            item["name"] = message.name
        out.append(item)
    return out


def _content_text(content: Any, param: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for part in content:
        if part.type != "text" or part.text is None:
            raise bad_request(f"content part type '{part.type}' is not supported", param)
        texts.append(part.text)
    return "".join(texts)


def _tool_call(call: Any, param: str) -> dict:
    arguments = call.function.arguments
    if arguments is None or arguments == "":
        arguments = {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError as e:
            raise bad_request("tool-call arguments are not valid JSON", f"{param}.arguments") from e
    if not isinstance(arguments, dict):
        raise bad_request("tool-call arguments must be a JSON object", f"{param}.arguments")
    return {
        "id": call.id or f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call.function.name, "arguments": arguments},
    }

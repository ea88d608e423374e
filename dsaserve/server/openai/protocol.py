"""OpenAI-compatible and SGLang-native request models (pydantic), one per route.

Every known field is typed and bounded (see `fields.py`); unknown top-level fields are ignored, so
a router may add its own. Wrong types, bad values and unknown roles fail validation and come back
as 400 naming the field. Internal sampling fields (`tool_call_grammar`, ...) are not fields of any
model, so a client cannot set them: they are ignored like any other unknown field. Adding a field
is one line in the model of its route.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from dsaserve.server.fields import (
    MAX_LIST_PROMPTS,
    MAX_MESSAGES,
    MAX_PROMPT_IDS,
    MAX_TOOLS,
    Bool,
    Count,
    GrammarText,
    Int64,
    N,
    Name,
    Penalty,
    PortNumber,
    RepetitionPenalty,
    Rid,
    RoomId,
    Schema,
    Stop,
    StopTokenIds,
    Strict,
    Temperature,
    TokenId,
    TokenIds,
    TopK,
    TopLogprobs,
    TopP,
    Unit,
    bounded_list,
)


class FunctionDef(Strict):
    name: str = Field(min_length=1, max_length=256)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: Bool | None = None


class Tool(Strict):
    type: Literal["function"] = "function"
    function: FunctionDef


class ToolChoiceFunction(Strict):
    name: Name


class NamedToolChoice(Strict):
    type: Literal["function"] = "function"
    function: ToolChoiceFunction


class FunctionCallIn(Strict):
    name: Name
    arguments: str | dict[str, Any] | None = None


class ToolCallIn(Strict):
    id: Name | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ContentPart(Strict):
    type: Name
    text: str | None = None


class ChatMessage(Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: Name | None = None
    tool_calls: bounded_list(ToolCallIn, MAX_TOOLS) | None = None
    tool_call_id: Name | None = None
    reasoning_content: str | None = None

    @model_validator(mode="after")
    def _tool_needs_its_call(self) -> ChatMessage:
        if self.role == "tool" and self.tool_call_id is None:
            raise ValueError("a tool message needs tool_call_id")
        return self


class StreamOptions(Strict):
    include_usage: Bool = False
    continuous_usage_stats: Bool = False


class JsonSchemaFormat(Strict):
    """`response_format.json_schema`: the schema is enforced by a grammar whatever `strict` says."""

    model_config = ConfigDict(extra="ignore", allow_inf_nan=False, populate_by_name=True)
    name: Name | None = None
    description: str | None = None
    schema_: dict[str, Any] | Bool | None = Field(default=None, alias="schema")
    strict: Bool | None = None


class ResponseFormat(Strict):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JsonSchemaFormat | None = None


class BootstrapFields(Strict):
    """What sglang-router adds in PD mode (see dsaserve/disaggregation/request_fields.py)."""

    bootstrap_host: Name | bounded_list(Name | None, MAX_LIST_PROMPTS) | None = None
    bootstrap_port: PortNumber | bounded_list(PortNumber | None, MAX_LIST_PROMPTS) | None = None
    bootstrap_room: RoomId | bounded_list(RoomId, MAX_LIST_PROMPTS) | None = None


class SamplerFields(Strict):
    """The sampling knobs every route spells the same way (OpenAI routes and `/generate`'s
    `sampling_params`), with SGLang's structured-output extras (dsaserve.server.structured)."""

    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: Unit = 0.0
    frequency_penalty: Penalty = 0.0
    presence_penalty: Penalty = 0.0
    repetition_penalty: RepetitionPenalty = 1.0
    n: N = 1
    stop: Stop | None = None
    stop_token_ids: StopTokenIds | None = None
    seed: Int64 | None = None
    ignore_eos: Bool = False
    skip_special_tokens: Bool = True
    no_stop_trim: Bool = False
    json_schema: Schema | None = None
    regex: GrammarText | None = None
    ebnf: GrammarText | None = None


class SamplingFields(SamplerFields, BootstrapFields):
    """Fields shared by chat and completions."""

    model: str | None = None
    max_tokens: Count | None = None
    min_tokens: Count = 0
    stream: Bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    rid: Rid | None = None


class ChatCompletionRequest(SamplingFields):
    messages: bounded_list(ChatMessage, MAX_MESSAGES, min_length=1)
    max_completion_tokens: Count | None = None
    logprobs: Bool = False
    top_logprobs: TopLogprobs | None = None
    tools: bounded_list(Tool, MAX_TOOLS) | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: Bool = True
    response_format: ResponseFormat | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    reasoning_effort: Name | None = None
    separate_reasoning: Bool = True
    stream_reasoning: Bool = True
    return_meta_info: Bool = False


Prompt = (
    Annotated[str, Field(min_length=1)]
    | bounded_list(Annotated[str, Field(min_length=1)], MAX_LIST_PROMPTS, min_length=1)
    | bounded_list(TokenId, MAX_PROMPT_IDS, min_length=1)
    | bounded_list(bounded_list(TokenId, MAX_PROMPT_IDS, 1), MAX_LIST_PROMPTS, min_length=1)
)  # fmt: skip


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: Count | None = 16
    echo: Bool = False
    logprobs: TopLogprobs | None = None
    suffix: str | None = None


class NativeSamplingParams(SamplerFields):
    """SGLang's `sampling_params` (names as SGLang spells them; `sampling_seed` or `seed`)."""

    max_new_tokens: Count | None = 128
    min_new_tokens: Count = 0
    spaces_between_special_tokens: Bool = True
    sampling_seed: Int64 | None = None

    def engine_fields(self) -> dict:
        """The values under `SamplingParams` names (max_tokens, min_tokens, seed)."""
        fields = self.model_dump()
        fields["max_tokens"] = fields.pop("max_new_tokens")
        fields["min_tokens"] = fields.pop("min_new_tokens")
        seed = fields.pop("sampling_seed")
        fields["seed"] = seed if seed is not None else fields["seed"]
        return fields


class GenerateRequestIn(BootstrapFields):
    """SGLang's native `/generate` body."""

    text: str | None = None
    input_ids: TokenIds | None = None
    sampling_params: NativeSamplingParams = Field(default_factory=NativeSamplingParams)
    stream: Bool = False
    return_logprob: Bool = False
    top_logprobs_num: TopLogprobs = 0
    rid: Rid | None = None


class AbortIn(Strict):
    """`/abort_request`: one request by rid, or all of them."""

    rid: Annotated[str, Field(max_length=256)] = ""
    abort_all: Bool = False

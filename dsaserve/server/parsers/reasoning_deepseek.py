"""The `deepseek-v3` reasoning parser (DeepSeek-V3.1 / V3.2): `<think>…</think>`, on request only.

As in sglang (a Qwen3-style detector with `reasoning_default="explicit_thinking"`), reasoning is
on only when the request asks for it (`chat_template_kwargs.thinking`): the rendered prompt then
ends with `<think>` and the output starts inside reasoning. Otherwise the prompt ends with
`</think>` and all output is content. Reasoning ends at `</think>`, or at a DSML tool call that
opens without it (kept for the tool parser). The rest is the `glm45` parser's behaviour,
including the answer that stops without `</think>` being kept as content (field report B15).
"""

from __future__ import annotations

from dsaserve.server.parsers.reasoning import Glm45ReasoningParser
from dsaserve.server.parsers.tool_dsml import REASONING_EXITS


class DeepSeekV3ReasoningParser(Glm45ReasoningParser):
    exits = REASONING_EXITS

    def __init__(self, force_reasoning: bool) -> None:
        super().__init__(force_reasoning)
        if not force_reasoning:
            self.state = "content"  # thinking off: a `<think>` in the output is plain text

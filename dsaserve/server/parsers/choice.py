"""Parser names (as `--reasoning-parser` / `--tool-call-parser` spell them) and `auto` detection.

`auto` reads the checkpoint's chat template: a GLM template (`[gMASK]<sop>` with an
`enable_thinking` switch) selects the `glm45` reasoning parser; a template whose tool
instructions put the arguments right after the name (`<tool_call>{function-name}<arg_key>`) selects
`glm47`, one with a newline there (GLM-4.5/4.6) `glm45`. A DeepSeek-V3.2 checkpoint (config
`model_type` `deepseek_v32`) without a template, whose prompt therefore comes from the built-in
encoder, or a template that writes DSML tool calls, selects `deepseek-v3` and `deepseekv32`.
Anything else gets no parser.
"""

from __future__ import annotations

import re

from dsaserve.server.parsers.reasoning import Glm45ReasoningParser
from dsaserve.server.parsers.reasoning_deepseek import DeepSeekV3ReasoningParser
from dsaserve.server.parsers.tool_dsml import DSML, DsmlToolParser
from dsaserve.server.parsers.tool_glm47 import Glm45ToolParser, Glm47ToolParser

REASONING_PARSERS = {"glm45": Glm45ReasoningParser, "deepseek-v3": DeepSeekV3ReasoningParser}
TOOL_PARSERS = {"glm47": Glm47ToolParser, "glm45": Glm45ToolParser, "deepseekv32": DsmlToolParser}
DEEPSEEK_V32 = "deepseek_v32"


class ParserConfigError(ValueError):
    """A parser flag that cannot work with this checkpoint."""


def is_deepseek_v32(template: str, model_type: str | None) -> bool:
    """DeepSeek-V3.2 output: the built-in encoder's prompt, or a template that writes DSML."""
    return (not template and model_type == DEEPSEEK_V32) or DSML in template


def resolve_reasoning_parser(
    flag: str | None, template: str, vocab: set[str], model_type: str | None = None
) -> str | None:
    """The reasoning parser name to use, or None for none."""
    if flag in (None, "none"):
        return None
    if flag == "auto" and is_deepseek_v32(template, model_type):
        return "deepseek-v3"
    if flag == "auto":
        glm = "[gMASK]<sop>" in template or "/nothink" in template
        toggle = "enable_thinking" in template
        markers = "<tool_call>" in vocab and ("<|user|>" in vocab or "<|endoftext|>" in vocab)
        return "glm45" if glm and toggle and markers else None
    if flag not in REASONING_PARSERS:
        raise ParserConfigError(f"--reasoning-parser {flag} is not supported by dsaserve yet")
    return flag


def resolve_tool_parser(
    flag: str | None, template: str, model_type: str | None = None
) -> str | None:
    """The tool-call parser name to use, or None for none."""
    if flag in (None, "none"):
        return None
    if flag == "auto" and is_deepseek_v32(template, model_type):
        return "deepseekv32"
    if flag == "auto":
        if "<tool_call>" not in template:
            return None
        newline_after_name = re.search(r"<tool_call>\{function-name\}(\n|\\n)", template)
        return "glm45" if newline_after_name else "glm47"
    if flag not in TOOL_PARSERS:
        raise ParserConfigError(f"--tool-call-parser {flag} is not supported by dsaserve yet")
    return flag

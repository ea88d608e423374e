"""Tool-call grammars in each model's own format, with arguments constrained by their schemas.

The API process sends `tool_call_grammar` as JSON: `{"format": <tool-call parser name>,
"tools": [OpenAI tools], "tool_choice": "auto" | "required" | {"type": "function", ...},
"parallel": bool}`. `"required"` and a named tool force calls (from the first constrained token);
`"auto"` (sent when some tool is `strict`) lets the model write text and constrains a call once
it opens one. Only `strict` tools (or all tools, when the choice forces a call) get their
`parameters` enforced; the others' arguments are free JSON, as OpenAI defines `strict`.

Formats are xgrammar's builtin structural tags (GLM-4.7/5: `<tool_call>name<arg_key>k</arg_key>
<arg_value>v</arg_value>…</tool_call>`, string values raw and the rest JSON, exactly what the
`glm47` parser reads), matched as their dedicated marker tokens when the vocabulary has them.
Seam: another parser's format is one more row in FORMATS (xgrammar ships `deepseek_v3_2` for
DeepSeek-V3.2's DSML; add it next to the `deepseekv32` parser once its output is checked
against that parser).
"""

from __future__ import annotations

import json
from typing import Any

from dsaserve.grammar.backend import GrammarError

# dsaserve tool-call parser name -> (xgrammar builtin structural-tag name, its marker tokens)
FORMATS: dict[str, tuple[str, tuple[str, ...]]] = {
    "glm47": ("glm_4_7", ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>",
                         "<arg_value>", "</arg_value>")),
}  # fmt: skip


def supports(parser: str | None) -> bool:
    return parser in FORMATS


def tool_call_grammar(
    parser: str, tools: list[dict], tool_choice: Any, parallel: bool
) -> str:
    """The `tool_call_grammar` source for a chat request (see the module doc)."""
    strict = tool_choice == "required" or isinstance(tool_choice, dict)
    prepared = [_prepared(tool, strict) for tool in tools]
    body = {"format": parser, "tools": prepared, "tool_choice": tool_choice or "auto",
            "parallel": parallel}  # fmt: skip
    return json.dumps(body, ensure_ascii=False, sort_keys=True)


def _prepared(tool: dict, forced: bool) -> dict:
    fn = dict(tool["function"])
    fn["strict"] = bool(forced or fn.get("strict"))
    fn.setdefault("parameters", {"type": "object"})
    return {"type": "function", "function": fn}


def xgrammar_structural_tag(source: str, vocab: set[str] | None) -> Any:
    """The xgrammar StructuralTag of a `tool_call_grammar` source (raises GrammarError)."""
    import xgrammar as xgr

    spec = _parse(source)
    name, markers = FORMATS[spec["format"]]
    token_markers = vocab is not None and all(m in vocab for m in markers)
    try:
        return xgr.get_model_structural_tag(
            name, tools=spec["tools"], tool_choice=spec["tool_choice"], reasoning="disabled",
            parallel_tool_calls=bool(spec.get("parallel", True)), token_markers=token_markers,
        )  # fmt: skip
    except (ValueError, TypeError) as e:
        raise GrammarError(f"cannot build the tool-call grammar: {e}") from e


def _parse(source: str) -> dict:
    try:
        spec = json.loads(source)
    except ValueError as e:
        raise GrammarError(f"tool_call_grammar is not JSON: {e}") from e
    if not isinstance(spec, dict) or spec.get("format") not in FORMATS:
        raise GrammarError(f"tool_call_grammar needs a format in {sorted(FORMATS)}")
    return spec

"""Tool-call grammars in each model's own format, with arguments constrained by their schemas.

The API process sends `tool_call_grammar` as JSON: `{"format": <tool-call parser name>,
"tools": [OpenAI tools], "tool_choice": "auto" | "required" | {"type": "function", ...},
"parallel": bool}`. "required" is calls only, back to back (at least one; one when `parallel`
is false); a named tool is exactly that call; "auto" (sent when some tool is `strict`) lets the
model write text and constrains a call once it opens `<tool_call>`. Every tool's `parameters`
are enforced when the choice forces a call; under "auto" only `strict` tools' are (OpenAI's
meaning of `strict`), the others take any `<arg_key>`/`<arg_value>` pairs.

GLM-4.7/5 (`glm47`): `<tool_call>name<arg_key>k</arg_key><arg_value>v</arg_value>…</tool_call>`
with the declared properties in order (required ones always, optional ones maybe), no
whitespace between markup, a string value raw (its enum, const, pattern or length as a regex)
and any other value compact JSON under its schema: exactly what the `glm47` parser types back,
so the parsed arguments validate against the tool's schema.

DeepSeek-V3.2 (`deepseekv32`): the DSML section as the encoder renders it
(`dsaserve.server.templates.deepseek_v32`) and the `deepseekv32` parser reads it:
`\n\n<｜DSML｜function_calls>\n`, per call `<｜DSML｜invoke name="NAME">\n`, per property
`<｜DSML｜parameter name="K" string="true|false">V</｜DSML｜parameter>\n` (declared order, required
ones always; `string="true"` and a raw value for a plain string schema, as for GLM, otherwise
`string="false"` and compact JSON), `</｜DSML｜invoke>\n`, and `</｜DSML｜function_calls>`. Under
"auto" the section opens on its own tag (the text before it stays free).

Each grammar is an xgrammar structural tag (`to_structural_tag`); another format is one more
builder in FORMATS: (tools, mode, one call only) -> the structural tag's format.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from dsaserve.grammar.backend import GrammarError
from dsaserve.grammar.tool_schema import allowed_types, is_plain_string

JSON_WHITESPACE = 1  # at most one whitespace character in a row inside JSON argument values
FREE_ARGS = r"(<arg_key>[^<]{1,64}</arg_key><arg_value>[^<]*</arg_value>)*"  # non-strict tools
DSML = "｜DSML｜"
DSML_OPEN = f"<{DSML}function_calls>"
DSML_FREE_ARGS = (f'(<{DSML}parameter name="[^"<]{{1,64}}" string="(true|false)">[^<]*'
                  f"</{DSML}parameter>\n)*")  # fmt: skip
_REGEX_SPECIAL = set("\\^$.|?*+()[]{}/-")


def supports(parser: str | None) -> bool:
    return parser in FORMATS


def tool_call_grammar(parser: str, tools: list[dict], tool_choice: Any, parallel: bool) -> str:
    """The `tool_call_grammar` source for a chat request (see the module doc)."""
    forced = tool_choice == "required" or isinstance(tool_choice, dict)
    prepared = [{"name": t["function"]["name"],
                 "parameters": t["function"].get("parameters") or {"type": "object"},
                 "strict": bool(forced or t["function"].get("strict"))}
                for t in tools]  # fmt: skip
    if isinstance(tool_choice, dict):
        prepared = [t for t in prepared if t["name"] == tool_choice["function"]["name"]]
    mode = "named" if isinstance(tool_choice, dict) else tool_choice or "auto"
    body = {"format": parser, "tools": prepared, "mode": mode, "parallel": parallel}
    return json.dumps(body, ensure_ascii=False)  # key order kept: it is the argument order


def to_structural_tag(source: str) -> dict:
    """The xgrammar structural tag (as JSON) of a `tool_call_grammar` source."""
    spec = _parse(source)
    if not spec["tools"]:
        raise GrammarError("tool_call_grammar has no tools")
    one = not spec.get("parallel", True)
    return {"type": "structural_tag",
            "format": FORMATS[spec["format"]](spec["tools"], spec["mode"], one)}  # fmt: skip


def glm47_format(tools: list[dict], mode: str, one: bool) -> dict:
    tags = [glm47_call(tool) for tool in tools]
    if mode == "named":
        return tags[0]
    if mode == "required":
        return {"type": "tags_with_separator", "tags": tags, "separator": "",
                "at_least_one": True, "stop_after_first": one}  # fmt: skip
    return {"type": "triggered_tags", "triggers": ["<tool_call>"], "tags": tags,
            "stop_after_first": one}  # fmt: skip


def glm47_call(tool: dict) -> dict:
    args = _glm47_args(tool["parameters"]) if tool["strict"] else _regex(FREE_ARGS)
    return {"type": "tag", "begin": f"<tool_call>{tool['name']}", "content": args,
            "end": "</tool_call>"}  # fmt: skip


def _glm47_args(parameters: dict) -> dict:
    properties = parameters.get("properties") or {}
    required = set(parameters.get("required") or [])
    parts = []
    for key, schema in properties.items():
        part = {"type": "sequence", "elements": [
            _const(f"<arg_key>{key}</arg_key><arg_value>"), _glm47_value(schema),
            _const("</arg_value>")]}  # fmt: skip
        parts.append(part if key in required else {"type": "optional", "content": part})
    return {"type": "sequence", "elements": parts} if parts else _const("")


def _glm47_value(schema: Any) -> dict:
    if is_plain_string(allowed_types(schema)):
        return _regex(raw_string_regex(schema))
    return _json_value(schema)


def _json_value(schema: Any) -> dict:
    """A non-string argument value: compact JSON under its schema."""
    return {"type": "json_schema", "json_schema": schema if schema is not None else True,
            "style": "json", "max_whitespace_cnt": JSON_WHITESPACE}  # fmt: skip


def dsml_format(tools: list[dict], mode: str, one: bool) -> dict:
    if mode == "named":
        calls = dsml_call(tools[0])
    else:
        calls = {"type": "tags_with_separator", "tags": [dsml_call(t) for t in tools],
                 "separator": "", "at_least_one": True, "stop_after_first": one}  # fmt: skip
    if mode in ("named", "required"):  # the whole answer is the section
        return {"type": "sequence", "elements": [
            _const(f"\n\n{DSML_OPEN}\n"), calls, _const(f"</{DSML}function_calls>")]}  # fmt: skip
    section = {"type": "tag", "begin": f"{DSML_OPEN}\n", "content": calls,
               "end": f"</{DSML}function_calls>"}  # fmt: skip
    return {"type": "triggered_tags", "triggers": [DSML_OPEN], "tags": [section],
            "stop_after_first": one}  # fmt: skip


def dsml_call(tool: dict) -> dict:
    params = _dsml_params(tool["parameters"]) if tool["strict"] else _regex(DSML_FREE_ARGS)
    return {"type": "tag", "begin": f'<{DSML}invoke name="{tool["name"]}">\n',
            "content": params, "end": f"</{DSML}invoke>\n"}  # fmt: skip


def _dsml_params(parameters: dict) -> dict:
    properties = parameters.get("properties") or {}
    if not properties:
        return _const("\n")  # the encoder's empty parameter list
    required = set(parameters.get("required") or [])
    parts = []
    for key, schema in properties.items():
        raw = is_plain_string(allowed_types(schema))
        value = _regex(raw_string_regex(schema)) if raw else _json_value(schema)
        flag = "true" if raw else "false"
        part = {"type": "sequence", "elements": [
            _const(f'<{DSML}parameter name="{key}" string="{flag}">'), value,
            _const(f"</{DSML}parameter>\n")]}  # fmt: skip
        parts.append(part if key in required else {"type": "optional", "content": part})
    return {"type": "sequence", "elements": parts}


def raw_string_regex(schema: dict) -> str:
    """A regex of a string value written raw (no quotes, no `<`: markup cannot start inside)."""
    if "const" in schema:
        return _escape(str(schema["const"]))
    if isinstance(schema.get("enum"), list):
        return "(" + "|".join(_escape(str(v)) for v in schema["enum"] if v is not None) + ")"
    if isinstance(schema.get("pattern"), str):
        return schema["pattern"].removeprefix("^").removesuffix("$")
    low, high = int(schema.get("minLength", 0)), schema.get("maxLength")
    return f"[^<\\uD800-\\uDFFF]{{{low},{'' if high is None else int(high)}}}"


def _escape(text: str) -> str:
    return "".join("\\" + c if c in _REGEX_SPECIAL else c for c in text)


def _const(text: str) -> dict:
    return {"type": "const_string", "value": text}


def _regex(pattern: str) -> dict:
    return {"type": "regex", "pattern": pattern}


def _parse(source: str) -> dict:
    try:
        spec = json.loads(source)
    except ValueError as e:
        raise GrammarError(f"tool_call_grammar is not JSON: {e}") from e
    if not isinstance(spec, dict) or spec.get("format") not in FORMATS:
        raise GrammarError(f"tool_call_grammar needs a format in {sorted(FORMATS)}")
    return spec


# dsaserve tool-call parser name -> builder of the structural tag's format
FORMATS: dict[str, Callable[[list[dict], str, bool], dict]] = {
    "glm47": glm47_format,
    "deepseekv32": dsml_format,
}

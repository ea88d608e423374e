"""Typing GLM tool-call argument values from the tool's JSON schema.

GLM writes every `<arg_value>` as raw text: strings bare, everything else as JSON. The declared
schema decides: a string stays a string even when it looks like a number ("12345"); integers,
numbers, booleans, null, objects and arrays decode as JSON; unions take the first reading whose
type is allowed; an undeclared key gets the decoded JSON when it parses, else the raw string.
"""

from __future__ import annotations

import ast
import json
from typing import Any

_PY_TO_JSON = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array",
               dict: "object", type(None): "null"}  # fmt: skip
_MISSING = object()


def allowed_types(schema: Any) -> frozenset[str] | None:
    """The JSON types a schema allows, or None when it does not say (or is too complex)."""
    if not isinstance(schema, dict):
        return None
    declared = schema.get("type")
    if isinstance(declared, str):
        return frozenset([declared])
    if isinstance(declared, list) and all(isinstance(t, str) for t in declared):
        return frozenset(declared)
    if "const" in schema:
        return frozenset([_json_type(schema["const"])])
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        return frozenset(_json_type(v) for v in schema["enum"])
    for union in ("anyOf", "oneOf", "allOf"):
        if isinstance(schema.get(union), list):
            parts = [allowed_types(s) for s in schema[union]]
            if not parts or any(p is None for p in parts):
                return None
            return frozenset().union(*parts)
    if "properties" in schema:
        return frozenset(["object"])
    if "items" in schema:
        return frozenset(["array"])
    return None


def is_plain_string(types: frozenset[str] | None) -> bool:
    """Values of this type are streamed as they arrive, as one JSON string."""
    return types is not None and types - {"null"} == {"string"}


def convert_value(raw: str, types: frozenset[str] | None) -> Any:
    """The typed value of a raw `<arg_value>` text under the allowed `types`."""
    if is_plain_string(types):
        return raw
    decoded = _decode(raw)
    if types is None:
        return raw if decoded is _MISSING else decoded
    if decoded is not _MISSING and _fits(decoded, types):
        return int(decoded) if _is_whole_float(decoded, types) else decoded
    if "string" in types:
        return raw
    if isinstance(decoded, str):  # a quoted number or boolean, e.g. "5"
        inner = _decode(decoded)
        if inner is not _MISSING and _fits(inner, types):
            return inner
    return raw if decoded is _MISSING else decoded


def _decode(raw: str) -> Any:
    text = raw.strip()
    try:
        return json.loads(text)
    except ValueError:
        pass
    if text in ("True", "False", "None"):
        return {"True": True, "False": False, "None": None}[text]
    if text[:1] in ("{", "["):
        try:
            return ast.literal_eval(text)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            pass
    return _MISSING


def _fits(value: Any, types: frozenset[str]) -> bool:
    kind = _json_type(value)
    if kind in types:
        return True
    if kind == "integer" and "number" in types:
        return True
    return _is_whole_float(value, types)


def _is_whole_float(value: Any, types: frozenset[str]) -> bool:
    return (
        isinstance(value, float) and value.is_integer() and "integer" in types
        and "number" not in types
    )  # fmt: skip


def _json_type(value: Any) -> str:
    return _PY_TO_JSON.get(type(value), "string")

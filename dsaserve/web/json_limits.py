"""Raw JSON bodies: decode, then bound what validation and the template will walk.

`decode_json` turns bytes into Python values and refuses, as 400 naming the path, nesting deeper
than `MAX_JSON_DEPTH` (the decoder's own RecursionError included). `check_strings` refuses lone
surrogates (`"a\\ud800b"` decodes in Python, but no tokenizer or UTF-8 encoder takes it) in the
known top-level fields of a request, free-form ones (tool schemas, template kwargs) included;
unknown fields are dropped by validation and never reach anything. Integers need no walk: every
integer field is bounded by its model. Walks are iterative; the path of a violation is found by a
second walk only when there is one.
"""

from __future__ import annotations

import json
import re
from typing import Any

from dsaserve.web.errors import bad_request

MAX_JSON_DEPTH = 64
# Only a \uD800-\uDFFF escape can produce a surrogate (raw surrogate bytes are invalid UTF-8).
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def decode_json(body: bytes) -> dict:
    """The body as a JSON object, or a 400 naming what is wrong and where."""
    try:
        data = json.loads(body)
    except RecursionError as e:
        raise bad_request(f"JSON nested deeper than {MAX_JSON_DEPTH} levels") from e
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"malformed JSON body: {e}"[:200]) from e
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    _raise_first(data, strings=False)
    return data


def may_hold_surrogates(body: bytes) -> bool:
    return _SURROGATE_ESCAPE.search(body) is not None


def check_strings(data: Any) -> None:
    """400 naming the first string (or key) of `data` with a lone surrogate."""
    _raise_first(data, strings=True)


def _raise_first(data: Any, strings: bool) -> None:
    if _first_violation(data, strings, with_path=False) is None:
        return
    path, problem = _first_violation(data, strings, with_path=True)  # type: ignore[misc]
    raise bad_request(f"{path or 'body'}: {problem}", path or None)


def _first_violation(data: Any, strings: bool, with_path: bool) -> tuple[str, str] | None:
    stack: list[tuple[Any, int, str]] = [(data, 0, "")]
    while stack:
        value, depth, path = stack.pop()
        if isinstance(value, dict | list) and depth >= MAX_JSON_DEPTH:
            return path, f"JSON nested deeper than {MAX_JSON_DEPTH} levels"
        if isinstance(value, dict):
            for key, item in value.items():
                if strings and isinstance(key, str) and _SURROGATE.search(key):
                    return path, "an object key contains a lone surrogate"
                stack.append((item, depth + 1, _join(path, key) if with_path else ""))
        elif isinstance(value, list | tuple):
            for i, item in enumerate(value):
                stack.append((item, depth + 1, f"{path}[{i}]" if with_path else ""))
        elif strings and isinstance(value, str) and _SURROGATE.search(value):
            return path, "the string contains a lone surrogate (invalid Unicode)"
    return None


def _join(path: str, key: Any) -> str:
    return f"{path}.{key}" if path else str(key)

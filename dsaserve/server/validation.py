"""Request bodies: size-limited reading (413), JSON parsing and schema validation (400 naming the
field, never echoing the input back)."""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from dsaserve.server.errors import APIError, bad_request

M = TypeVar("M", bound=BaseModel)
MAX_REPORTED_ERRORS = 3


async def read_body(request: Request, limit: int) -> bytes:
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise APIError(413, f"request body over {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:  # chunked uploads have no content-length
            raise APIError(413, f"request body over {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


async def parse(request: Request, model: type[M], limit: int) -> M:
    body = await read_body(request, limit)
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise bad_request(f"malformed JSON body: {e}"[:200]) from e
    if not isinstance(data, dict):
        raise bad_request("the request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise validation_error(e) from e


def validation_error(error: ValidationError) -> APIError:
    details = error.errors(include_input=False, include_url=False)
    params = [field_path(d["loc"]) for d in details[:MAX_REPORTED_ERRORS]]
    messages = [f"{p}: {d['msg']}" for p, d in zip(params, details)]
    more = len(details) - MAX_REPORTED_ERRORS
    text = "; ".join(messages) + (f"; and {more} more" if more > 0 else "")
    return bad_request(f"invalid request: {text}", params[0] if params else None)


def field_path(loc: tuple[Any, ...]) -> str:
    """('messages', 0, 'role') -> 'messages[0].role' (union branch names are skipped)."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        elif _is_type_tag(str(part)):
            continue
        else:
            path += ("." if path else "") + str(part)
    return path


def _is_type_tag(part: str) -> bool:
    """Pydantic names union branches by type ('str', 'list[ContentPart]', 'NamedToolChoice')."""
    if part in ("str", "int", "float", "bool", "dict", "list", "none"):
        return True
    prefixes = ("list[", "dict[", "literal[", "function-", "json-or-python[", "union[")
    return part.startswith(prefixes) or part[:1].isupper()

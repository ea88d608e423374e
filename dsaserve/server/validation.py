"""Request bodies: JSON content type (415), size-limited reading (413), JSON decoding with depth,
surrogate and integer limits, and schema validation (400 naming the field, never echoing the input
back). Decoding runs off the event loop for all but small bodies (see `body_decoder`)."""

from __future__ import annotations

import asyncio
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from dsaserve.web.errors import APIError, bad_request
from dsaserve.web.json_limits import check_strings, decode_json, may_hold_surrogates

M = TypeVar("M", bound=BaseModel)
MAX_REPORTED_ERRORS = 3
BODY_METHODS = ("POST", "PUT", "PATCH")
INLINE_MAX_BYTES = 16 * 1024  # decoded on the event loop (well under a millisecond)


def check_content_type(request: Request) -> None:
    """A body must be sent as JSON: a form or text/plain POST (which a web page can make without
    a CORS preflight) gets 415, so a browser cannot drive a keyless local server."""
    if request.method not in BODY_METHODS:
        return
    kind = request.headers.get("content-type")
    if kind is None:
        if _declares_body(request):
            raise APIError(415, "send the body with Content-Type: application/json",
                           code="unsupported_media_type")  # fmt: skip
        return
    media = kind.split(";", 1)[0].strip().lower()
    if media != "application/json" and not (
        media.startswith("application/") and media.endswith("+json")
    ):
        raise APIError(415, f"Content-Type {media[:60]!r} is not supported: use application/json",
                       code="unsupported_media_type")  # fmt: skip


def _declares_body(request: Request) -> bool:
    length = request.headers.get("content-length")
    return request.headers.get("transfer-encoding") is not None or (length not in (None, "0"))


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


async def parse(request: Request, model: type[M], limit: int, context: dict | None = None) -> M:
    """Read, decode and validate a body in one call, for routes that parse for themselves (a
    route declared with `route(..., body=Model)` gets this done for it, off the loop when
    large, with the vocabulary and `--max-n` in the context)."""
    check_content_type(request)
    body = await read_body(request, limit)
    if len(body) <= INLINE_MAX_BYTES:
        return decode_model(body, model, context)
    return await asyncio.to_thread(decode_model, body, model, context)


def decode_model(body: bytes, model: type[M], context: dict | None = None) -> M:
    """Bytes -> validated model, or APIError (400). Pure, so it can run in a worker process."""
    data = decode_json(body)
    if may_hold_surrogates(body):  # in known fields only: unknown ones are dropped unread
        check_strings({k: v for k, v in data.items() if k in model.model_fields})
    try:
        return model.model_validate(data, context=context)
    except ValidationError as e:
        raise validation_error(e) from e


def validation_error(error: ValidationError) -> APIError:
    details = error.errors(include_input=False, include_url=False, include_context=False)
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
    prefixes = ("list[", "dict[", "literal[", "function-", "json-or-python[", "union[",
                "constrained-", "lax-", "strict-")  # fmt: skip
    return part.startswith(prefixes) or part[:1].isupper()

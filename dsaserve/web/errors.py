"""API errors: one exception type, rendered in the envelope of the route's API: OpenAI chat's,
the Responses API's (OpenAI's error types, `code` a string or null), or Anthropic's.

User input errors are 400 with the offending field named in `param`; bodies stay small (messages
are truncated, inputs are never echoed back in full).
"""

from __future__ import annotations

from fastapi.responses import JSONResponse

MAX_MESSAGE_CHARS = 500
OPENAI_TYPES = {
    400: "BadRequestError", 401: "AuthenticationError", 404: "NotFoundError",
    405: "MethodNotAllowedError", 413: "RequestTooLargeError", 415: "UnsupportedMediaTypeError",
    422: "UnprocessableEntityError", 429: "RateLimitError", 500: "InternalServerError",
    503: "ServiceUnavailableError",
}  # fmt: skip
ANTHROPIC_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
    405: "invalid_request_error", 413: "request_too_large", 415: "invalid_request_error",
    422: "invalid_request_error", 429: "rate_limit_error", 503: "overloaded_error",
}  # fmt: skip
RESPONSES_TYPES = {429: "rate_limit_error", 500: "server_error", 503: "server_error"}


class APIError(Exception):
    """An error answer: HTTP status, message, and the request field at fault (if any)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        retry_after: int | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = _short(message)
        self.param = param
        self.code = code
        self.retry_after = retry_after

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}

    def openai_body(self) -> dict:
        kind = OPENAI_TYPES.get(self.status, "InternalServerError")
        code = self.code or self.status
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": code}}

    def responses_body(self) -> dict:
        kind = RESPONSES_TYPES.get(self.status, "invalid_request_error")
        code = self.code if isinstance(self.code, str) else None
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": code}}

    def anthropic_body(self) -> dict:
        kind = ANTHROPIC_TYPES.get(self.status, "api_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response_in(self, api: str) -> JSONResponse:
        """The error answer in `api`'s envelope: "openai", "responses" or "anthropic"."""
        body = {"openai": self.openai_body, "responses": self.responses_body,
                "anthropic": self.anthropic_body}[api]()  # fmt: skip
        return JSONResponse(body, self.status, headers=self.headers())


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def _short(message: str) -> str:
    if len(message) <= MAX_MESSAGE_CHARS:
        return message
    return message[: MAX_MESSAGE_CHARS - 3] + "..."

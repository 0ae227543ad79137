"""Errors in OpenAI's body shape: ``{"error": {"message", "type", "param", "code"}}``.

Source of the shape: openai-python's ``APIStatusError`` reads ``body["error"]``; every
peer server (vllm-omni, sglang-omni) answers the same way.
"""

from __future__ import annotations

from typing import Any

#: HTTP status -> OpenAI's error ``type``.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 409: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
               429: "rate_limit_error", 499: "request_cancelled", 500: "server_error", 503: "server_unavailable"}


class ApiError(Exception):
    """An answer that is an error: its status, what was wrong and what is allowed.

    Args:
        status: HTTP status (400 bad field, 401 bad key, 404 unknown model or voice, 413 over a
            size limit, 429 queue full, 503 not ready or stopping).
        message: what was wrong and what to do, for people.
        param: the request field at fault, or None.
        code: a stable machine-readable name (``unknown_field``, ``queue_full``, ...).
        headers: extra response headers (``Retry-After`` on a 429).
    """

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return error_body(self.status, self.message, self.param, self.code)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body for ``status``."""
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}

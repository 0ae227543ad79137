"""Errors in OpenAI's body shape: ``{"error": {"message", "type", "param", "code"}}``.

Source of the shape: openai-python's ``APIStatusError`` reads ``body["error"]``; every
peer server (vllm-omni, sglang-omni) answers the same way.
"""

from __future__ import annotations

from typing import Any

from higgs_pack.manifests.errors import HiggsPackError, InputError

#: HTTP status -> OpenAI's error ``type``.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 409: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
               429: "rate_limit_error", 499: "request_cancelled", 500: "server_error", 503: "server_unavailable"}


class ApiError(HiggsPackError):
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


def http_name(field: str | None) -> str | None:
    """A request field's name in the speech body (``max_frames`` -> ``max_new_tokens``; the
    runtime's one table, :data:`higgs_pack.runtime.request.FIELDS`), else the field itself."""
    from higgs_pack.runtime.request import FIELDS

    names = FIELDS.get(field or "")
    return names.http if names is not None and names.http else field


def from_input_error(exc: InputError, status: int = 400, code: str = "invalid_value",
                     param: str | None = None) -> ApiError:
    """An :class:`~higgs_pack.manifests.errors.InputError` said in this server's terms: each of its
    problems with the field's HTTP name (no CLI flag or Python keyword), every one at once, and
    the first named field as ``param`` (or ``param`` when none is named).

    Returns:
        The :class:`ApiError` to raise (``status`` 400 unless given).
    """
    message = exc.say(lambda problem: problem.render(name=http_name(problem.field)))
    named = next((http_name(problem.field) for problem in exc.problems if problem.field), None)
    return ApiError(status, message, param=named or param, code=code)


def from_clip(exc: BaseException) -> bool:
    """Whether ``exc`` was raised while reading or checking a reference clip: its traceback passes
    through :mod:`higgs_pack.runtime.audio` (unreadable, too short or long, silent, non-finite)."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_globals.get("__name__") == "higgs_pack.runtime.audio":
            return True
        tb = tb.tb_next
    return False


def speech_error(exc: InputError) -> ApiError:
    """What the engine refused of a speech request, in this server's terms: a problem of the
    reference clip names ``ref_audio``; any other problem its field (``input`` when none is named)."""
    if from_clip(exc):
        return ApiError(400, str(exc), param="ref_audio", code="invalid_value")
    return from_input_error(exc, param="input")


def upload_error(exc: InputError) -> ApiError:
    """What encoding a voice upload refused, in the upload's terms: a problem of the clip names
    ``audio`` (the runtime calls a clip ``ref_audio``), one of the text names ``transcript``."""
    if from_clip(exc):
        message = str(exc)
        if message.startswith("ref_audio "):
            message = "audio " + message.removeprefix("ref_audio ")
        return ApiError(400, message, param="audio", code="invalid_value")
    if any(problem.field for problem in exc.problems):
        lines = [problem.render(name="transcript" if problem.field else None) for problem in exc.problems]
        return ApiError(400, "; ".join(lines), param="transcript", code="invalid_value")
    return ApiError(400, str(exc), param="audio", code="invalid_value")

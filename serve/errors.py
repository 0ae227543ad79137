"""Errors in OpenAI's body shape: ``{"error": {"message", "type", "param", "code"}}``.

Source of the shape: openai-python's ``APIStatusError`` reads ``body["error"]``; every
peer server (vllm-omni, sglang-omni) answers the same way.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from higgs_pack.errors import HiggsPackError, InputError, Problem, clipped, encodable, said_all
from higgs_pack.runtime.text import plain_type

#: HTTP status -> OpenAI's error ``type``.
ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error", 404: "not_found_error", 409: "invalid_request_error",
               405: "invalid_request_error", 413: "invalid_request_error", 422: "invalid_request_error",
               429: "rate_limit_error", 499: "request_cancelled", 500: "server_error", 503: "server_unavailable"}

#: The transport's own ``code`` of each error that is not a request's problem
#: (:data:`higgs_pack.errors.CODES`, each a 400 unless its answer says otherwise): code ->
#: (HTTP status, what it means).  With ``CODES``, every ``code`` the server answers; the server's
#: page lists both from here (docs/hooks/generated.py), and a test holds every code the server's
#: source answers to being in one of them.
TRANSPORT_CODES = {
    "invalid_api_key": (401, "no Authorization: Bearer key, or not the server's (--api-key)"),
    "cross_origin": (403, "a web page whose origin is not allowed (--allow-origin) called the server"),
    "model_not_found": (404, "model names no model this server serves (GET /v1/models lists them)"),
    "not_found": (404, "no route at this path"),
    "method_not_allowed": (405, "the route does not take this method (the Allow header says which do)"),
    "too_large": (413, "the body or the upload is over its limit"),
    "unsupported_media_type": (415, "a body that is not JSON (Content-Type) where JSON is taken"),
    "unsupported_encoding": (415, "a body sent with a Content-Encoding (gzip, ...): send it uncompressed"),
    "upgrade_required": (426, "plain HTTP to the live WebSocket route"),
    "queue_full": (429, "every row of the batch and every place in the queue is taken (Retry-After says when "
                        "to retry)"),
    "cancelled": (499, "the client closed the request (in the metrics and the log: the client is gone)"),
    "internal_error": (500, "a bug: the message names the exception"),
    "generation_failed": (500, "the engine failed while generating this request"),
    "storage": (500, "a voice cannot be written to --voices-dir"),
    "engine_stopped": (503, "the engine has stopped and takes no requests (/ready answers 503)"),
    "not_ready": (503, "the bundle is still warming up (retry when /ready answers 200)"),
    "stopping": (503, "the server is shutting down and takes no new request"),
    "shutting_down": (503, "a request still running when the shutdown's grace period ended, cut off"),
    "out_of_disk": (507, "no room left to keep a voice in --voices-dir"),
}


class ApiError(HiggsPackError):
    """An answer that is an error: its status, what was wrong and what is allowed.

    A request's problems are not written here: they are :class:`Problem` objects, answered by
    :func:`from_input_error` (an :class:`InputError`) or :func:`refused` (problems this server
    found itself), which make the ApiError; one is written by hand for what is transport (401,
    403, 404, 405, 413, 415, 429, 503) or a failure of the server (499, 500, 507).

    Args:
        status: HTTP status (400 bad field, 401 bad key, 404 unknown model or voice, 413 over a
            size limit, 429 queue full, 503 not ready or stopping).
        message: what was wrong and what to do, for people.
        param: the request field at fault, or None.
        code: a stable machine-readable name (``unknown_field``, ``queue_full``, ...).
        headers: extra response headers (``Retry-After`` on a 429).
        lines: each problem's line when ``message`` says several
            (:func:`~higgs_pack.errors.said_all` of them), so that a door that joins errors (a live
            session.config's, :func:`~higgs_pack.serve.live.config_error`) says all their problems
            in the one shape; left out: the message is one line.
    """

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None, lines: tuple[str, ...] = ()):
        message, lines = encodable(message), tuple(map(encodable, lines))  # a lone surrogate echoed: escaped
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, echoed_name(param), code
        self.headers = headers or {}
        self.lines = lines or (message,)

    def body(self) -> dict[str, Any]:
        """The JSON body: ``{"error": {"message", "type", "param", "code"}}``."""
        return error_body(self.status, self.message, self.param, self.code)


def echoed_name(name: str | None) -> str | None:
    """A field's name as an answer's ``param`` carries it (the key the request sent, which may be an
    unknown one): :func:`~higgs_pack.errors.clipped`, so a lone surrogate is written as its escape and a
    huge key is not echoed whole."""
    return None if name is None else clipped(name)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error body for ``status``."""
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def http_name(field: str | None) -> str | None:
    """A request field's name in the speech body (``max_frames`` -> ``max_new_tokens``; the
    runtime's one table, :data:`higgs_pack.runtime.request.FIELDS`), else the field itself; in a
    path its last part (``turns[0].text`` -> ``turns[0].input``)."""
    from higgs_pack.runtime.options import FIELDS

    head, dot, last = (field or "").rpartition(".")
    if dot:  # a path into the body: a dialogue's turns[0].text is turns[0].input; voices.ANN.text is itself
        return f"{head}.{http_name(last)}" if head.startswith("turns[") else field
    names = FIELDS.get(field or "")
    return names.http if names is not None and names.http else field


def from_input_error(exc: InputError, status: int = 400, code: str | None = None,
                     param: str | None = None, names: Mapping[str, str] | None = None) -> ApiError:
    """The HTTP door: an :class:`~higgs_pack.errors.InputError` said in this server's
    terms: each of its problems with the field's HTTP name (no CLI flag or Python keyword), every
    one at once, the first named field as ``param`` (or ``param`` when none is named) and the
    first problem's :attr:`~higgs_pack.errors.Problem.code` as ``code`` (or ``code``
    when given).  The WebSocket door's ``error`` event is this answer's fields with its status.

    Args:
        names: a field's name where the request named it otherwise than the speech body does
            (``ref_text`` sent as ``references[0].text``: :attr:`~higgs_pack.serve.speech.SpeechJob.names`).

    Returns:
        The :class:`ApiError` to raise (``status`` 400 unless given).
    """
    return _said(exc, _renamed(http_name, names), status, code, param)


def _renamed(name: Any, names: Mapping[str, str] | None) -> Any:
    """``name`` (a door's field namer), except for the fields ``names`` renames."""
    return (lambda field: names[field] if field in names else name(field)) if names else name


def live_name(field: str | None) -> str | None:
    """A request field's name in a live session (``/v1/audio/speech/stream``): the text is
    ``input.text``'s ``text`` (the speech body's ``input``), the rest the speech body's (:func:`http_name`)."""
    return "text" if field == "text" else http_name(field)


def from_live_input_error(exc: InputError, status: int = 400, code: str | None = None,
                          param: str | None = None, names: Mapping[str, str] | None = None) -> ApiError:
    """:func:`from_input_error` in a live session's terms (:func:`live_name`): a problem of the
    text names ``text``, in its message and as ``param``."""
    return _said(exc, _renamed(live_name, names), status, code, param)


def refused(*problems: Problem, param: str | None = None, status: int = 400) -> ApiError:
    """The HTTP door's answer to ``problems`` of a request that this server found itself (a body,
    an upload, a barge-in): :func:`from_input_error` of them, ``param`` where none names a field."""
    return from_input_error(InputError.of(*problems), status=status, param=param)


def json_words(value: Any) -> str:
    """A value as a JSON body's sender wrote it: ``true``, ``null``, ``7``, ``2.5``, a string
    quoted; a list or an object by its kind (never a Python type name or repr)."""
    if value is None or isinstance(value, bool):
        return "null" if value is None else str(value).lower()
    if isinstance(value, (int, float, str)):
        return repr(value) if isinstance(value, str) else str(value)
    return plain_type(value)


def _said(exc: InputError, name: Any, status: int, code: str | None, param: str | None) -> ApiError:
    lines = tuple(problem.render(name=name(problem.field), show=json_words) for problem in exc.problems)
    named = next((name(problem.field) for problem in exc.problems if problem.field), None)
    return ApiError(status, said_all(lines), param=named or param, code=code or exc.code, lines=lines)


#: A voice upload's parts by the request fields the runtime names: the clip is ``audio``, its
#: transcript ``transcript``.
UPLOAD_PARTS = {"ref_audio": "audio", "ref_text": "transcript", "text": "transcript"}


def upload_error(exc: InputError) -> ApiError:
    """What encoding a voice upload refused, in the upload's terms: a problem of the clip names
    ``audio``, one of the transcript ``transcript`` (:data:`UPLOAD_PARTS`); ``audio`` when none is named."""
    return _said(exc, lambda field: UPLOAD_PARTS.get(field, field), 400, None, "audio")

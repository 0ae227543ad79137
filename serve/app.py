"""The ASGI app (FastAPI): every route of ``higgs-pack serve`` over one :class:`SpeechServer`.

Routes: ``POST /v1/audio/speech``; ``POST /v1/audio/dialogue``; ``GET/POST /v1/audio/voices`` and ``DELETE
/v1/audio/voices/{name}``; ``GET /v1/models``; ``GET /health`` (the process is up), ``GET
/ready`` (loaded and warmed up; 503 before and while stopping), ``GET /metrics``
(Prometheus); ``GET /`` (the demo page); ``GET /docs`` (the API docs: Swagger UI from the
``fastapi-offline`` package's own copy, no network needed; every body described by
:mod:`~higgs_pack.serve.schema`).  With an API key, ``/v1/*`` needs ``Authorization:
Bearer <key>`` (compared in constant time).  Every error is OpenAI's body shape, including a
request cut off at shutdown (a 503; see :class:`_CountRequests`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import threading
import time
import urllib.parse
from contextlib import asynccontextmanager
from importlib import resources
from typing import Any

import anyio
import anyio.to_thread
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from fastapi_offline import FastAPIOffline
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import Match

from higgs_pack.errors import (
    HiggsPackError,
    InputError,
    Problem,
    disk_full,
    disk_full_message,
)
from higgs_pack.runtime.text import decode
from higgs_pack.serve import schema
from higgs_pack.serve.errors import ApiError, error_body, from_input_error, refused, upload_error
from higgs_pack.serve.formats import FORMATS, media_type, sse_error
from higgs_pack.serve.live import ROUTE as LIVE_ROUTE
from higgs_pack.serve.live import live_route
from higgs_pack.serve.metrics import CONTENT_TYPE
from higgs_pack.serve.server import Answer, SpeechServer
from higgs_pack.serve.speech import (
    DEFAULT_VOICE,
    parse_dialogue,
    parse_speech,
    reference_clip,
    short,
    unique_json,
)
from higgs_pack.serve.upload import Upload, given_name, read_upload

log = logging.getLogger(__name__)

#: Routes as the metrics label them (a voice's name is not a label).
_ROUTES = ("/v1/audio/speech", "/v1/audio/dialogue", "/v1/audio/voices", "/v1/models", "/health", "/ready", "/metrics", "/")


def create_app(server: SpeechServer, *, warm_up: bool = True) -> FastAPI:
    """The app over ``server``.

    Args:
        server: the loaded bundle and its engine.
        warm_up: warm the engine up on a thread when the app starts (``/ready`` is 503 until
            it is done); False when the caller warmed it up already.

    Returns:
        A FastAPI app; its lifespan closes ``server`` at shutdown.
    """

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if warm_up and not server.ready:
            threading.Thread(target=_warm_up, args=(server,), name="higgs-pack-warm-up", daemon=True).start()
        yield
        server.stopping = True
        await anyio.to_thread.run_sync(server.close)

    # The docs page loads Swagger UI from the package's files, not a CDN: it works offline.
    app = FastAPIOffline(title="higgs-pack speech server", version="1", lifespan=lifespan, docs_url="/docs",
                         redoc_url=None, swagger_ui_parameters={"validatorUrl": None})
    app.state.server = server
    _handlers(app)
    # the last added is the outermost: a request the origin check refuses is counted too
    app.add_middleware(_SameOrigin, allow_origins=server.config.allow_origins, metrics=server.metrics)
    app.add_middleware(_CountRequests, metrics=server.metrics)
    app.router.default = _websocket_not_found(app.router.default)
    _routes(app, server)
    schema.add_bodies(app)
    return app


def _warm_up(server: SpeechServer) -> None:
    try:
        server.warm_up()
    except Exception:  # the server stays unready and says why in its log
        log.exception("warm-up failed; /ready stays 503")


def _handlers(app: FastAPI) -> None:
    @app.exception_handler(HiggsPackError)
    async def our_error(request: Request, exc: HiggsPackError) -> JSONResponse:
        """Every error of ours: an ApiError as it is; a request's problems (InputError) in this
        server's terms (a 400 naming the field); any other one a 500 that says what failed."""
        if isinstance(exc, InputError):
            exc = from_input_error(exc)
        elif not isinstance(exc, ApiError):
            log.error("%s answering %s %s: %s", type(exc).__name__, request.method, request.url.path, exc)
            exc = ApiError(500, f"{type(exc).__name__}: {exc}", code="internal_error")
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        path = short(request.url.path)[1:-1]
        headers = exc.headers
        if exc.status_code == 405:
            # Starlette's Allow names the first route of the path only (GET of /v1/audio/voices, not
            # its POST): every route of the path says what it answers
            methods = sorted({m for route in request.app.router.routes
                              if route.matches(request.scope)[0] != Match.NONE
                              for m in (getattr(route, "methods", None) or ())})
            allowed = ", ".join(methods) or (exc.headers or {}).get("Allow", "")
            headers = {**(exc.headers or {}), "Allow": allowed}
            message = (f"{request.method} is not allowed on {path}: it answers {allowed.replace(', ', ' and ')}; "
                       "see /docs for the routes")
            code = "method_not_allowed"
        elif exc.status_code == 404:
            message, code = f"no route {request.method} {path}; see /docs for the routes", "not_found"
        else:
            message, code = short(str(exc.detail))[1:-1], None
        return JSONResponse(error_body(exc.status_code, message, code=code), status_code=exc.status_code,
                            headers=headers)

    @app.exception_handler(ClientDisconnect)
    async def client_left(request: Request, exc: ClientDisconnect) -> Response:
        """A client that closed the connection while still sending its body: one info line, a 499
        (nginx's "client closed the request") in the metrics, nobody to answer."""
        log.info("client left while sending its body: %s %s", request.method, request.url.path)
        return Response(status_code=499)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        param = str(first.get("loc", ["", ""])[-1]) or None
        answer = refused(Problem.said(f"{param}: {first.get('msg', 'invalid request')}"), param=param)
        return JSONResponse(answer.body(), status_code=answer.status)

    @app.exception_handler(Exception)
    async def server_error(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error answering %s %s", request.method, request.url.path)
        return JSONResponse(error_body(500, f"internal error: {type(exc).__name__}: {exc}", code="internal_error"),
                            status_code=500)


#: What a request cut off at shutdown is told (a 503, or an SSE stream's last event).
CUT_OFF = ("the server is shutting down: this request was still running when its grace period "
           "(--grace-seconds) ended, and was stopped; send it again (to another replica)")


class _SameOrigin:
    """Pure ASGI middleware refusing what a web page of another origin asks of this server: a
    request that changes or spends something (any method but GET, HEAD and OPTIONS) and the live
    WebSocket's handshake, when the browser's ``Origin`` header names neither this server (its
    ``Host``) nor one of ``ServeConfig.allow_origins``.

    Why: a page the user opens anywhere may POST a form (a voice upload) or a ``text/plain`` body
    to a server on the user's machine without the browser asking first (a CORS "simple request"),
    and may open a WebSocket to it and read what it says (WebSockets are not under CORS): without
    this check any site could speak in the user's stored voices and take the audio.  Clients
    that are not browsers (curl, the ``openai`` client, Pipecat, LiveKit) send no ``Origin`` and
    are not affected.  A refused request or WebSocket handshake is a 403 (code ``cross_origin``)."""

    def __init__(self, app: Any, allow_origins: tuple[str, ...] = (), metrics: Any = None):
        self.app, self.allow, self.metrics = app, frozenset(o.lower() for o in allow_origins), metrics

    def _refused(self, scope) -> str | None:
        """The page's origin when it may not ask this of the server, else None."""
        if scope["type"] == "http" and scope["method"] in ("GET", "HEAD", "OPTIONS"):
            return None
        headers = dict(scope.get("headers") or ())
        origin = headers.get(b"origin", b"").decode("latin-1").strip().lower()
        if not origin or "*" in self.allow or origin in self.allow:
            return None
        host = headers.get(b"host", b"").decode("latin-1").strip().lower()
        return None if host and origin.split("://", 1)[-1] == host else origin

    async def __call__(self, scope, receive, send) -> None:
        origin = self._refused(scope) if scope["type"] in ("http", "websocket") else None
        if origin is None:
            await self.app(scope, receive, send)
            return
        log.info("refused %s %s from a page of origin %s", scope.get("method", "WebSocket"), scope["path"], origin[:80])
        if scope["type"] == "websocket" and self.metrics is not None:  # HTTP answers are counted by _CountRequests
            self.metrics.requests.labels(LIVE_ROUTE if scope["path"] == LIVE_ROUTE else "other", "403").inc()
        message = (f"a web page of origin {short(origin)} may not call this server; start it with "
                   "--allow-origin ORIGIN to let that page's scripts use it")
        await _refuse(scope, receive, send, 403, message, "cross_origin")


async def _refuse(scope, receive, send, status: int, message: str, code: str) -> None:
    """Answer an HTTP request, or a WebSocket's handshake, with an error in OpenAI's shape.  A
    WebSocket gets it as the handshake's HTTP answer where the server has ASGI's denial-response
    extension (uvicorn does), else it is closed before it is accepted (code 1008; the client sees
    a 403)."""
    if scope["type"] == "websocket" and "websocket.http.response" not in scope.get("extensions", {}):
        await send({"type": "websocket.close", "code": 1008})
        return
    await JSONResponse(error_body(status, message, code=code), status_code=status)(scope, receive, send)


def _websocket_not_found(default: Any) -> Any:
    """The router's answer for a path no route takes: a WebSocket to an unknown path is a 404
    naming the live route (Starlette closes it, which a client sees as a 403, the answer of a
    refused origin or key); an HTTP request goes to ``default`` (the 404 handler)."""
    async def not_found(scope, receive, send) -> None:
        if scope["type"] != "websocket":
            await default(scope, receive, send)
            return
        await _refuse(scope, receive, send, 404, f"no WebSocket route {short(scope['path'])[1:-1]}; the live "
                      f"speech WebSocket is {LIVE_ROUTE}", "not_found")

    return not_found


class _CountRequests:
    """Pure ASGI middleware counting answers by route and status (``requests_total``), and
    answering for a request cut off at shutdown.

    A request's task is cancelled only when the server stops it (uvicorn past
    ``--grace-seconds``; Ray Serve dropping the request): one with no answer started then gets a
    503 in OpenAI's shape (:data:`CUT_OFF`, code ``shutting_down``) instead of the server's
    plain-text 500; an SSE stream ends with a ``speech.audio.error`` event saying so; an audio
    stream is cut (a truncated stream, never a wrong one).  The cancellation is then re-raised.

    Not Starlette's ``BaseHTTPMiddleware``: that one passes every streamed chunk through a
    memory stream and a task group, which cost the server 5 ms of CPU per request at 16
    clients on the tiny bundle (measured by the serve load test with py-spy)."""

    def __init__(self, app: Any, metrics: Any):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        route = next((r for r in _ROUTES if path == r or (r != "/" and path.startswith(r + "/"))), "other")
        status = [500]
        started, sse, ended = [False], [False], [False]

        async def sending(message) -> None:
            if message["type"] == "http.response.start":
                status[0], started[0] = message["status"], True
                sse[0] = any(k.lower() == b"content-type" and v.startswith(b"text/event-stream")
                             for k, v in message.get("headers", ()))
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                ended[0] = True
            await send(message)

        key = object()
        client = scope.get("client") or ("?", 0)
        IN_FLIGHT[key] = (f"{scope['method']} {path} from {client[0]}:{client[1]}", time.monotonic())
        try:
            await self.app(scope, receive, sending)
        except asyncio.CancelledError:
            if not started[0]:
                body = json.dumps(error_body(503, CUT_OFF, code="shutting_down")).encode()
                await sending({"type": "http.response.start", "status": 503, "headers": [
                    (b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
                await sending({"type": "http.response.body", "body": body})
            elif sse[0] and not ended[0]:
                await sending({"type": "http.response.body", "body": sse_error(CUT_OFF, "shutting_down")})
            raise
        finally:
            del IN_FLIGHT[key]
            self.metrics.requests.labels(route, str(status[0])).inc()


#: The HTTP requests being answered now: key -> (``"METHOD PATH from HOST:PORT"``, monotonic start),
#: kept by :class:`_CountRequests`; :class:`CutOffLog` names them when the grace period ends.
IN_FLIGHT: dict[object, tuple[str, float]] = {}


#: uvicorn's log templates CutOffLog reads (uvicorn has no exception or event for them: it logs):
#: ``Server.shutdown``'s when the graceful timeout is over (it then cancels the requests' tasks),
#: and each protocol's ``run_asgi`` when an application raised (here: that cancellation).  A
#: record's ``msg`` is the template, never the message filled in; tests/test_errors.py runs a real
#: uvicorn past its timeout to check both.
UVICORN_GRACE_OVER = "Cancel %s running task(s), timeout graceful shutdown exceeded"
UVICORN_APP_RAISED = "Exception in ASGI application"


class CutOffLog(logging.Filter):
    """The one adapter of uvicorn's log: a filter for its ``uvicorn.error`` logger that makes a
    stop past the grace period one clean line: uvicorn's "Cancel N running task(s), timeout
    graceful shutdown exceeded" (:data:`UVICORN_GRACE_OVER`) becomes a warning naming the
    requests cut off (what, from whom, how long they ran), and its "Exception in ASGI
    application" traceback of each of them (the cancellation uvicorn itself sent) is dropped.  A client's WebSocket text frame that is not UTF-8 (uvicorn logs the
    UnicodeDecodeError with its traceback, then closes with 1007) is one INFO line.  Other records
    pass unchanged.

    Args:
        grace_seconds: the ``--grace-seconds`` the line quotes.
    """

    def __init__(self, grace_seconds: float):
        super().__init__()
        self.grace_seconds = grace_seconds
        self.cutting = False

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == UVICORN_GRACE_OVER:
            now = time.monotonic()
            named = [f"{what} ({now - since:.1f} s in)" for what, since in list(IN_FLIGHT.values())]
            record.msg, record.args = ("grace period of %g s over: cutting off %d request(s) still in flight: %s",
                                       (self.grace_seconds, len(named), "; ".join(named) or "none"))
            record.levelno, record.levelname = logging.WARNING, "WARNING"
            self.cutting = True
            return True
        exc = record.exc_info[1] if record.exc_info else None
        if isinstance(exc, UnicodeDecodeError):  # uvicorn's WebSocket protocol decoding a client's text frame
            record.msg, record.args, record.exc_info, record.exc_text = (
                "a WebSocket client sent a text frame that is not UTF-8 (%s); closed it with 1007", (exc.reason,),
                None, None)
            record.levelno, record.levelname = logging.INFO, "INFO"
            return True
        return not (self.cutting and isinstance(exc, asyncio.CancelledError)
                    and str(record.msg).startswith(UVICORN_APP_RAISED))


def _check_key(server: SpeechServer, request: Request) -> None:
    server.check_key(request.headers.get("authorization", ""))


def _check_encoding(request: Request) -> None:
    """Refuse a body sent compressed (``Content-Encoding``): the server reads plain bodies only."""
    encoding = request.headers.get("content-encoding", "identity").strip().lower()
    if encoding not in ("", "identity"):
        raise ApiError(415, f"Content-Encoding {short(encoding)} is not supported: send the body uncompressed "
                       "(no Content-Encoding header)", param="Content-Encoding", code="unsupported_encoding")


def _check_json_type(request: Request) -> None:
    """Refuse a body whose ``Content-Type`` is not JSON (``application/json`` or ``application/*+json``; none
    given is read as JSON).  A ``text/plain`` or form body is what a web page of any origin may
    POST to this server without the browser asking first (a CORS "simple request"), so reading
    it as JSON would let any page a user opens run speech on this server (its cores, its queue);
    FastAPI refuses it for the same reason."""
    kind = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if kind and kind != "application/json" and not (kind.startswith("application/") and kind.endswith("+json")):
        raise ApiError(415, f"Content-Type {short(kind)} is not JSON: send the body as application/json "
                       "(curl: -H 'Content-Type: application/json', or --json)", param="Content-Type",
                       code="unsupported_media_type")


#: Bodies up to this many bytes are parsed on the event loop (microseconds); larger ones (a base64
#: ref_audio: up to ~21 MB) off it, in the server's parse limiter.
JSON_ON_LOOP_BYTES = 64 * 1024


async def _json_body(request: Request, limit: int, server: SpeechServer, model: Any) -> Any:
    """The JSON body of a request to a route whose body is ``model`` (a :mod:`~higgs_pack.serve.schema`
    body, whose fields a refusal names: :func:`~higgs_pack.serve.schema.body_hint`).

    Raises:
        ApiError: 415 (compressed, not JSON's Content-Type), 413 (over ``limit`` bytes), 400
            ``invalid_json`` (not JSON).
    """
    _check_encoding(request)
    _check_json_type(request)
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:
        raise ApiError(413, f"the body is {size[:20]} bytes; the limit is {limit} (--max-upload-mb)", code="too_large")
    data = bytearray()
    async for piece in request.stream():
        data += piece
        if len(data) > limit:
            raise ApiError(413, f"the body is over the limit of {limit} bytes (--max-upload-mb)", code="too_large")
    try:
        parse = functools.partial(_parse_json, data)
        return parse() if len(data) <= JSON_ON_LOOP_BYTES else await server.off_loop(parse)
    except InputError as exc:  # not UTF-8: said as every door says bytes that are not
        raise refused(Problem.said(str(exc), code="invalid_json")) from None
    except json.JSONDecodeError as exc:
        raise refused(Problem.said(f"the body is not JSON ({exc}); {schema.body_hint(model)}", code="invalid_json")) from exc
    except RecursionError as exc:
        raise refused(Problem.said("the body nests JSON arrays or objects too deeply to read; "
                                   f"{schema.body_hint(model, 'a flat JSON object')}", code="invalid_json")) from exc


def _parse_json(data: bytes | bytearray) -> Any:
    """A JSON body's bytes read as the one text rule reads bytes (:func:`~higgs_pack.runtime.text.decode`:
    UTF-8 only, a leading BOM dropped), then parsed (``json.loads`` of bytes would guess UTF-16 or
    UTF-32 and let UTF-8-encoded surrogates through).

    Raises:
        InputError: not UTF-8 (the byte named).
        json.JSONDecodeError: not JSON.
    """
    return unique_json(decode(data, "the body", fix="send the JSON as UTF-8"))


def _routes(app: FastAPI, server: SpeechServer) -> None:
    """Every route: the server's own (demo page, health, readiness, metrics, models), speech, voices."""
    _service_routes(app, server)
    _speech_route(app, server)
    _voice_routes(app, server)
    live_route(app, server)


def _service_routes(app: FastAPI, server: SpeechServer) -> None:
    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def demo() -> HTMLResponse:
        page = resources.files("higgs_pack.serve").joinpath("demo.html").read_text(encoding="utf-8")
        return HTMLResponse(page)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> JSONResponse:
        state = "ready" if server.ready else ("stopping" if server.stopping else "warming up")
        return JSONResponse({"status": state, **server.describe()}, status_code=200 if server.ready else 503)

    # HEAD for load balancers' probes, each its own route out of the schema: one route with both
    # methods gave the two operations one id (FastAPI's "Duplicate Operation ID" warning on /docs)
    app.add_api_route("/health", health, methods=["HEAD"], include_in_schema=False)
    app.add_api_route("/ready", ready, methods=["HEAD"], include_in_schema=False)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(server.metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        _check_key(server, request)
        about = server.describe()
        return {"object": "list", "data": [{"id": name, "object": "model", "created": 0, "owned_by": "higgs-pack",
                                            **about} for name in server.models]}


def _speech_route(app: FastAPI, server: SpeechServer) -> None:
    body_limit = server.config.max_upload_bytes * 4 // 3 + 65536
    audio = {media_type(name): {"schema": {"type": "string", "format": "binary"}} for name in FORMATS}

    @app.post("/v1/audio/speech", response_class=Response, openapi_extra=schema.json_body(schema.SpeechBody),
              responses={
        200: {"description": "The audio: whole, or streamed as it is generated (stream_format)",
              "content": {**audio, "text/event-stream": {"schema": {"type": "string"}}}},
        **schema.errors(400, 401, 404, 413, 429, 503)})
    async def speech(request: Request) -> Response:
        """Speak ``input``; every field is described by the body's schema (SpeechBody)."""
        _check_key(server, request)
        t0 = time.perf_counter()
        async with _admitted(server):  # admission first: a flood gets its 429s before any body is decoded
            body = await _json_body(request, body_limit, server, schema.SpeechBody)
            parse = functools.partial(parse_speech, body, models=server.models, voices=server.voices,
                                      config=server.config)
            # Checking the fields takes microseconds: off the event loop only when it reads a file or decodes
            # a clip (a ref_audio, or a stored voice in --voices-dir), not a thread round trip for every request.
            job = await server.off_loop(parse) if _parse_blocks(body, server) else parse()
        return await _answer(server, job, request, t0)

    @app.post("/v1/audio/dialogue", response_class=Response, openapi_extra=schema.json_body(schema.DialogueBody),
              responses={
        200: {"description": "The dialogue's audio, as /v1/audio/speech answers (whole, streamed, or JSON with "
                             "segments)", "content": {**audio, "text/event-stream": {"schema": {"type": "string"}}}},
        **schema.errors(400, 401, 404, 413, 429, 503)})
    async def dialogue(request: Request) -> Response:
        """Speak a dialogue: turns of several speakers, a voice per speaker (DialogueBody)."""
        _check_key(server, request)
        t0 = time.perf_counter()
        async with _admitted(server):
            body = await _json_body(request, body_limit, server, schema.DialogueBody)
            job = await server.off_loop(functools.partial(
                parse_dialogue, body, models=server.models, voices=server.voices, config=server.config))
        return await _answer(server, job, request, t0)


@asynccontextmanager
async def _admitted(server: SpeechServer) -> Any:
    """Admit a request (:meth:`SpeechServer.admit`: a 429 or 503 at once) for the reading and checking
    of its body; its place is given back when they fail (:func:`_answer` keeps it for a good one)."""
    server.admit()
    try:
        yield
    except BaseException:
        server.release()
        raise


async def _answer(server: SpeechServer, job: Any, request: Request, t0: float) -> Response:
    """Run a checked, admitted speech or dialogue job and answer it: the whole file (or JSON with
    its segments), or a stream (``stream_format``); its place is given back when it ends."""
    try:
        handle = await server.submit(job)
    except BaseException:
        server.release()
        raise
    answer = Answer(route=request.scope["path"])
    headers = {"x-sample-rate": str(server.tts.sample_rate)}
    if job.stream_format is None:
        try:
            data, answer = await server.whole(handle, job, request.receive)
        finally:
            _finish(server, t0, answer)
        kind = "application/json" if job.segments else media_type(job.response_format)
        return Response(data, media_type=kind, headers=headers)

    def close() -> None:  # the one cancel of a stream: a no-op once it finished, frees the row when the client left
        handle.cancel()
        _finish(server, t0, answer)

    kind = "text/event-stream" if job.stream_format == "sse" else media_type(job.response_format)
    return _Stream(server.chunks(handle, job, answer), close, media_type=kind,
                   headers={**headers, "Cache-Control": "no-cache"})


# Over 80 lines because it registers the three voice routes (list, upload, delete), each short, as
# FastAPI closures over the server, where a reader of the API finds them together.
def _voice_routes(app: FastAPI, server: SpeechServer) -> None:
    config = server.config

    @app.get("/v1/audio/voices")
    async def list_voices(request: Request) -> dict[str, Any]:
        _check_key(server, request)
        own = {"name": DEFAULT_VOICE, "transcript": None, "seconds": 0.0, "frames": 0, "created": 0.0}
        return {"voices": [own, *(server.voices.describe(n) for n in server.voices.names())],
                "response_formats": list(FORMATS)}

    @app.post("/v1/audio/voices", status_code=201, openapi_extra=schema.form_body(schema.VoiceUpload),
              responses=schema.errors(400, 401, 409, 413, 507))
    async def add_voice(request: Request) -> JSONResponse:
        """Encode a clip once with the bundle's codec and keep it by name; ``voice: NAME`` then uses it."""
        _check_key(server, request)
        size = request.headers.get("content-length")
        if size is not None and size.isdigit() and int(size) > config.max_upload_bytes + 65536:
            raise ApiError(413, f"the upload is {size[:20]} bytes; the limit is {config.max_upload_bytes} "
                           "(--max-upload-mb)", param="audio", code="too_large")
        _check_encoding(request)
        upload = await read_upload(request, config.max_upload_bytes)
        name = upload.name
        # claimed on the event loop, between no two awaits: a second upload of the name (or of a name that
        # differs by case: Narrator and narrator are one file on Windows) cannot pass while this one runs
        if name.lower() in server.uploading:
            raise refused(Problem.said(f"voice {name!r} is being uploaded by another request; wait for it, then "
                                       f"DELETE /v1/audio/voices/{name} to replace it", "name", name,
                                       code="voice_exists"), status=409)
        server.uploading.add(name.lower())
        try:
            return JSONResponse(await server.off_loop(functools.partial(keep, upload)), status_code=201)
        finally:
            server.uploading.discard(name.lower())

    def keep(upload: Upload) -> dict[str, Any]:
        """Check the name is free, decode and encode the clip, keep the voice (a worker thread)."""
        name = upload.name
        same = next((n for n in server.voices.names() if n.lower() == name.lower()), None)
        if same is not None:
            raise refused(Problem.said(f"voice {same!r} exists (names differ by more than case); DELETE "
                                       f"/v1/audio/voices/{same} first to replace it", "name", name,
                                       code="voice_exists"), status=409)
        clip = reference_clip(upload.audio, config, "audio")
        try:
            voice = server.tts.prepare_voice(clip, upload.transcript, name)
        except InputError as exc:
            raise upload_error(exc) from exc
        try:
            return server.voices.add(voice)
        except OSError as exc:
            if disk_full(exc):
                raise ApiError(507, disk_full_message(config.voices_dir, f"keeping voice {name!r}",
                                                      "free space there or choose another --voices-dir"),
                               code="out_of_disk") from exc
            raise ApiError(500, f"cannot keep voice {name!r} in {config.voices_dir}: {exc}", code="storage") from exc

    @app.delete("/v1/audio/voices/{name}", responses=schema.errors(401, 404))
    async def delete_voice(name: str, request: Request) -> dict[str, Any]:
        """Forget a stored voice (and its file in --voices-dir)."""
        _check_key(server, request)
        raw = urllib.parse.unquote_to_bytes(request.scope.get("raw_path", b"").rpartition(b"/")[2])
        # the path's bytes, not Starlette's text (bytes that are not UTF-8 become U+FFFD there): read as an
        # upload's name part is (not UTF-8, a control character: a 400 naming name; a BOM dropped)
        name = given_name(raw if raw.decode("utf-8", "replace") == name else name, "the NAME of "
                          "DELETE /v1/audio/voices/NAME")
        if name == DEFAULT_VOICE:
            raise refused(Problem.said(f"voice {DEFAULT_VOICE!r} is the bundle's built-in voice: it cannot be deleted "
                                       "(only uploaded voices can)", "name", name, code="builtin_voice"))
        if not server.voices.delete(name):
            raise ApiError(404, f"voice {short(name)} is not known; GET /v1/audio/voices lists them", param="name",
                           code="unknown_voice")
        return {"name": name, "deleted": True}


class _Stream(StreamingResponse):
    """A streamed answer that runs ``close`` however it ends: sent, failed, or dropped by a
    client that left before its first byte (then the body's generator never starts, so its
    own ``finally`` would never run).  A stream that is sent whole runs it when its last piece
    is out and before the response's end, so its place is free before the client can send the
    next request (after the end it came too late for a client that did at once: a 429
    queue_full with no other request out, seen by the load test on a loaded machine)."""

    def __init__(self, content: Any, close: Any, **keywords: Any):
        closed = []

        def once() -> None:
            if not closed:
                closed.append(True)
                close()

        async def body() -> Any:
            try:
                async for piece in content:
                    yield piece
            finally:
                once()

        super().__init__(body(), **keywords)
        self._close = once

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._close()


def _parse_blocks(body: Any, server: SpeechServer) -> bool:
    """Whether checking ``body`` may block: it carries a reference clip (decoded, or read under
    --allow-local-media), or names a voice other than the default that the store reads from its folder."""
    if not isinstance(body, dict):
        return False
    if body.get("ref_audio") is not None or body.get("references") is not None:
        return True
    return server.voices.folder is not None and body.get("voice", DEFAULT_VOICE) != DEFAULT_VOICE


def _finish(server: SpeechServer, t0: float, answer: Answer) -> None:
    """Release the request's place and record its figures (once)."""
    if answer.finished:
        return
    answer.finished = True
    seconds = time.perf_counter() - t0
    server.release(seconds)
    m = server.metrics
    m.request_seconds.labels(answer.route).observe(seconds)
    if answer.frames:
        m.frames.inc(answer.frames)
        m.audio_seconds.inc(answer.audio_seconds)
        if answer.audio_seconds > 0:
            m.real_time_factor.observe(seconds / answer.audio_seconds)
    if answer.first_audio_s == answer.first_audio_s:  # not NaN
        m.first_audio.observe(answer.first_audio_s)

"""One loaded bundle served over HTTP: :class:`SpeechServer`.

It owns the :class:`~higgs_pack.runtime.api.TTS`, its continuous-batching
:class:`~higgs_pack.runtime.engine.engine.Engine`, the voice store and the metrics, and turns a
checked :class:`~higgs_pack.serve.speech.SpeechJob` into the bytes of an answer:

- admission: at most ``max_batch + max_queue`` requests in flight; one more is a 429 with
  ``Retry-After`` (the queue is full), never a silent wait;
- the engine's blocking calls (its ``submit``, which codec-encodes a reference clip, and the
  reading of a handle, which codec-decodes the chunks) run on worker threads, bounded by one
  limiter sized to the requests in flight;
- a client that goes away cancels its request: the engine frees its row before its next step;
- readiness: :meth:`warm_up` runs one short request through the engine; ``/ready`` is 503 until
  then and again once the server is stopping.
"""

from __future__ import annotations

import functools
import hmac
import logging
import math
import os
import threading
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import anyio
import anyio.to_thread

from higgs_pack.errors import HiggsPackError, InputError
from higgs_pack.runtime.engine.decoders import openvino_engine_of
from higgs_pack.runtime.engine.handle import EngineHandle, RequestCancelled
from higgs_pack.serve.config import ServeConfig
from higgs_pack.serve.errors import ApiError, from_input_error
from higgs_pack.serve.formats import (
    StreamEncoder,
    encode_whole,
    segments_answer,
    sse_delta,
    sse_done,
    sse_error,
    sse_segment,
)
from higgs_pack.serve.metrics import Metrics
from higgs_pack.serve.speech import SpeechJob
from higgs_pack.serve.tempo import TimeStretch, at_speed, retimed
from higgs_pack.serve.voices import VoiceStore, default_prefix_key_file, load_prefix_key

log = logging.getLogger(__name__)

#: Default rows when ``max_batch`` is not given and the backend batches.
DEFAULT_MAX_BATCH = 4
#: Text and frame cap of the warm-up request (:meth:`SpeechServer.warm_up`).
WARM_UP = ("Hello.", 8)


@dataclass
class Answer:
    """What a finished request produced (for the metrics and the ``done`` event)."""

    frames: int = 0
    audio_seconds: float = 0.0
    first_audio_s: float = math.nan
    finished: bool = False
    segments: list = field(default_factory=list)
    """The :class:`~higgs_pack.runtime.loop.synthesis.Segment` items of the speech."""
    route: str = "/v1/audio/speech"
    """The route it answered (its request time is recorded under it)."""


class SpeechServer:
    """A bundle, its engine, its voices and metrics, and the request bookkeeping.

    Args:
        tts: a loaded :class:`~higgs_pack.runtime.api.TTS` (the server closes it).
        config: :class:`~higgs_pack.serve.config.ServeConfig`.

    Attributes:
        models: names ``model`` may take: the bundle's name, its model slug, then
            ``config.model_names``.
        engine: the :class:`~higgs_pack.runtime.engine.engine.Engine`.
        batching_note: why the engine serves one request at a time, when it does ("" otherwise).
        openvino_engine: ``"paged"`` for an OpenVINO bundle served with ``max_batch > 1``
            (:func:`~higgs_pack.runtime.engine.decoders.openvino_engine_of`); None otherwise.
        ready: loaded and warmed up, and not stopping.
        in_flight: requests admitted and not finished.

    Raises:
        InputError: ``config.max_batch`` more than the bundle's backend can batch (its reason).
    """

    def __init__(self, tts: Any, config: ServeConfig):
        self.tts, self.config = tts, config
        self.engine, self.batching_note = _make_engine(tts, config.max_batch, config.max_kv_bytes)
        info = tts.info
        self.openvino_engine = openvino_engine_of(info.backend, self.engine.max_batch)
        log.info("engine: %s", self.engine_summary())
        self.models = tuple(dict.fromkeys((info.bundle, info.model, *config.model_names)))
        self.voices = VoiceStore(config.voices_dir, _codec_sha256(tts), _prefix_key(config))
        if self.engine.prefix_cache is not None:  # named voices' prefix KV persists beside them
            self.engine.prefix_cache.store = self.voices
        self.in_flight = 0
        self.stopping = False
        self._warm = False
        self._lock = threading.Lock()
        self._mean_seconds = 2.0  # running mean of seconds in flight (queue wait included), for Retry-After
        self.limiter = anyio.CapacityLimiter(self.capacity + 4)
        # CPU work a request brings (a big JSON body, a clip to decode, a whole answer to encode, a
        # sentence to tokenize) runs here, off the event loop, at most one per core at a time
        self.parse_limiter = anyio.CapacityLimiter(max(2, os.cpu_count() or 2))
        self.uploading: set[str] = set()  # voice names (lower case) being uploaded now
        self.metrics = Metrics(self)

    @classmethod
    def open(cls, source: str | os.PathLike, config: ServeConfig, *, device: str | None = None) -> SpeechServer:
        """Load ``source`` (anything :func:`higgs_pack.load` takes) and serve it.

        Raises:
            HiggsPackError: the source cannot be loaded (its own message), or a bad config.
        """
        import higgs_pack

        tts = higgs_pack.load(source, **({"device": device} if device else {}))
        try:
            return cls(tts, config)
        except BaseException:
            tts.close()
            raise

    @property
    def capacity(self) -> int:
        """Most requests in flight: the batch's rows plus the queue."""
        return self.engine.max_batch + self.config.max_queue

    @property
    def ready(self) -> bool:
        """Warmed up, not stopping, and the engine's thread alive."""
        return self._warm and not self.stopping and self.engine.crashed is None

    def warm_up(self) -> float:
        """Run one short request through the engine (compiles kernels, touches the weights);
        then :attr:`ready`.  Returns its seconds."""
        t0 = time.perf_counter()
        text, frames = WARM_UP
        self.engine.submit(text, max_frames=frames).result(timeout=600)
        self._warm = True
        seconds = time.perf_counter() - t0
        log.info("warmed up in %.2f s; ready", seconds)
        return seconds

    def close(self) -> None:
        """Stop the engine and unload the bundle (idempotent)."""
        self.stopping = True
        self.engine.close(timeout=30)
        self.tts.close()

    @property
    def batching(self) -> str:
        """How requests share the engine, in words: ``continuous batching``, or ``one request at a
        time`` and why (the backend's reason, or ``--max-batch 1``)."""
        if self.batching_note:
            return self.batching_note
        return "continuous batching" if self.engine.max_batch > 1 else "one request at a time: max_batch is 1 (--max-batch)"

    def engine_summary(self) -> str:
        """The engine in the startup line's and the log's words: ``max_batch 4`` and, for an
        OpenVINO bundle that batches, ``openvino_engine paged``."""
        engine = f", openvino_engine {self.openvino_engine}" if self.openvino_engine else ""
        return f"max_batch {self.engine.max_batch}{engine}"

    def describe(self) -> dict[str, Any]:
        """What ``/ready`` and ``/v1/models`` tell about the bundle and the engine (``openvino_engine``
        only where an OpenVINO bundle batches: :attr:`openvino_engine`)."""
        info = self.tts.info
        engine = {"openvino_engine": self.openvino_engine} if self.openvino_engine else {}
        return {"bundle": info.bundle, "model": info.model, "target": info.target, "precision": info.precision,
                "backend": info.backend, "device": info.device, "sample_rate": info.sample_rate,
                "max_batch": self.engine.max_batch, **engine, "max_queue": self.config.max_queue,
                "batching": self.batching,
                "kv_bytes_per_position": self.engine.kv_bytes_per_position,
                "kv_budget_bytes": self.engine.kv_budget_bytes}

    def check_key(self, authorization: str, query_key: str | None = None) -> None:
        """The one API-key check of every route (HTTP and the live WebSocket).

        Args:
            authorization: the ``Authorization`` header (``Bearer KEY``), or ``""``.
            query_key: the ``api_key`` query parameter where the route takes one (a browser's
                WebSocket cannot set headers), or None where it does not.

        Raises:
            ApiError: 401 ``invalid_api_key`` (with ``WWW-Authenticate: Bearer``) when the server has
                a key and neither gives it (compared in constant time).
        """
        key = self.config.api_key
        if key is None:
            return
        scheme, _, token = authorization.partition(" ")
        token = token.strip() if scheme.lower() == "bearer" else (query_key or "")
        if not hmac.compare_digest(token.encode(), key.encode()):
            browser = " (or, from a browser, ?api_key=<key>)" if query_key is not None else ""
            raise ApiError(401, f"missing or wrong API key: send Authorization: Bearer <key>{browser}, the --api-key "
                           "the server was started with", code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def off_loop(self, work: Any) -> Any:
        """``work()`` on a worker thread of the parse limiter (CPU work off the event loop)."""
        return await anyio.to_thread.run_sync(work, limiter=self.parse_limiter)

    # admission
    def admit(self) -> None:
        """Count one more request in flight.

        Raises:
            ApiError: 503 while not ready or stopping, 429 (with Retry-After) when full.
        """
        if self.stopping:
            raise ApiError(503, "the server is stopping; retry on another replica", code="stopping")
        if not self._warm:
            raise ApiError(503, "the bundle is still warming up; retry when /ready answers 200", code="not_ready",
                           headers={"Retry-After": "1"})
        with self._lock:
            if self.in_flight >= self.capacity:
                # A place frees when any request in flight finishes: by Little's law, one does every
                # (mean seconds in flight) / (requests in flight) seconds.
                wait = max(1, math.ceil(self._mean_seconds / max(self.in_flight, 1)))
                raise ApiError(429, f"the queue is full: {self.engine.max_batch} requests in the batch and "
                               f"{self.config.max_queue} waiting (--max-batch, --max-queue); retry after {wait} s",
                               code="queue_full", headers={"Retry-After": str(wait)})
            self.in_flight += 1

    def release(self, seconds: float | None = None) -> None:
        """One request in flight fewer; ``seconds`` (when it finished) feeds Retry-After."""
        with self._lock:
            self.in_flight -= 1
            if seconds is not None:
                self._mean_seconds = 0.9 * self._mean_seconds + 0.1 * seconds

    async def submit(self, job: SpeechJob, said: Any = from_input_error) -> EngineHandle:
        """Hand ``job`` to the engine (on a worker thread: a reference clip is encoded there);
        ``said``: how its refusal is said (a live session's text is ``text``:
        :func:`~higgs_pack.serve.errors.from_live_input_error`).

        Raises:
            ApiError: 400 for what the engine refuses at once (a special token in the text, a
                sentence too long, an unusable clip, more KV than the budget), its problems in
                this server's terms (:func:`~higgs_pack.serve.errors.from_input_error`: ``param``
                the field at fault, ``max_new_tokens`` for the frame cap); 503 when the engine
                stopped.
        """
        request = job.request
        plan = getattr(request, "plan", None)  # a dialogue: planned here, on the worker thread

        def submit() -> EngineHandle:
            return self.engine.submit(request if plan is None else plan(self.tts.pipeline))

        try:
            return await anyio.to_thread.run_sync(submit, limiter=self.limiter)
        except InputError as exc:
            raise said(exc, param="input" if plan is None else "turns", names=dict(job.names)) from exc
        except HiggsPackError as exc:
            raise ApiError(503, f"the engine cannot take requests: {exc}", code="engine_stopped") from exc

    # answers
    async def whole(self, handle: EngineHandle, job: SpeechJob, receive: Any) -> tuple[bytes, Answer]:
        """The whole file of a request; cancels it when the client disconnects first.

        Raises:
            ApiError: 500 when generation failed (a non-finite output: run higgs-pack verify),
                499 when the client went away.
        """
        failure: BaseException | None = None
        async with anyio.create_task_group() as group:
            group.start_soon(_cancel_on_disconnect, receive, handle, group.cancel_scope)
            try:
                result = await anyio.to_thread.run_sync(handle.result, abandon_on_cancel=True, limiter=self.limiter)
            except HiggsPackError as exc:  # raised below, outside the group (it would wrap it)
                failure = exc
            finally:
                group.cancel_scope.cancel()
        if isinstance(failure, RequestCancelled):
            log.info("a client left before its answer was ready; its request was cancelled")
            raise ApiError(499, "the client closed the request", code="cancelled") from failure
        if failure is not None:
            raise ApiError(500, f"generation failed: {failure}", code="generation_failed") from failure
        result, body = await self.off_loop(functools.partial(_whole_file, result, job))
        return body, Answer(int(result.codes.shape[0]), len(result.samples) / result.sample_rate,
                            segments=result.segments)

    async def chunks(self, handle: EngineHandle, job: SpeechJob, answer: Answer) -> AsyncIterator[bytes]:
        """The bytes of a streamed answer (``stream_format`` "audio" or "sse") as chunks are
        generated.  The caller cancels ``handle`` once the stream ends however it ends (the app's
        ``_Stream`` does, also when the client left before the first byte and this generator
        never started), so a dropped stream frees its row."""
        sse = job.stream_format == "sse"
        rate = self.tts.sample_rate
        encoder, tempo = StreamEncoder(job.response_format, rate), TimeStretch(job.speed, rate)
        held: list[Any] = []  # segments (at speed) whose audio is not all in the encoder yet
        stream = iter(handle)
        started = time.perf_counter()

        def send(data: bytes, final: bool = False) -> list[bytes]:
            """``data`` as the stream carries it, then the segments whose audio is now all in the
            encoder (a stretch holds some back; ``final``: all of them), as SSE events."""
            if math.isnan(answer.first_audio_s) and data:
                answer.first_audio_s = time.perf_counter() - started
            count = len(held) if final else sum(round(s.end * rate) <= tempo.samples_out for s in held)
            done, held[:] = held[:count], held[count:]
            answer.segments += done
            if not sse:
                return [data] if data else []
            return ([sse_delta(data)] if data else []) + [sse_segment(s) for s in done]

        def step() -> tuple[Any, bytes]:
            """The next piece and its bytes, stretched and encoded on the worker thread, off the event
            loop (mp3 costs about 11 ms of CPU per second of audio); at the end, None and the rest."""
            chunk = next(stream, None)
            if chunk is None:
                return None, encoder.chunk(tempo.finish()) + encoder.finish()
            return chunk, encoder.chunk(tempo.push(chunk.samples))

        try:
            pending = encoder.start()
            if pending and not sse:
                yield pending
                pending = b""
            while True:
                chunk, data = await anyio.to_thread.run_sync(step, abandon_on_cancel=True, limiter=self.limiter)
                if chunk is not None:
                    held.extend(retimed(chunk, job.speed).segments)
                for out in send(pending + data, final=chunk is None):
                    yield out
                pending = b""
                if chunk is None:
                    break
            answer.frames = int(sum(r.codes.shape[0] for r in stream.results))
            answer.audio_seconds = tempo.samples_out / rate
            if sse:
                encode = functools.partial(self.tts.pipeline.tokenizer.encode, job.request.text,
                                           add_special_tokens=False)
                tokens = len((await self.off_loop(encode)).ids)
                yield sse_done(tokens, answer.frames)
        except HiggsPackError as exc:
            log.warning("stream failed after it started: %s", exc)
            if not sse:
                raise  # the connection is cut: a truncated stream, never a wrong one
            yield sse_error(f"generation failed: {exc}", "generation_failed")


def _whole_file(result: Any, job: SpeechJob) -> tuple[Any, bytes]:
    """``result`` at ``job.speed`` and its answer's bytes: the file in ``job.response_format``, or the
    JSON with it and the segments (run on a worker thread: an hour of mp3 is about 40 s of CPU)."""
    result = at_speed(result, job.speed)
    body = encode_whole(result.samples, result.sample_rate, job.response_format)
    if job.segments:
        body = segments_answer(body, job.response_format, result.sample_rate, result.segments)
    return result, body


async def _cancel_on_disconnect(receive: Any, handle: EngineHandle, scope: anyio.CancelScope) -> None:
    """Wait for the client's ``http.disconnect`` and cancel its request."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            handle.cancel()
            return


def _make_engine(tts: Any, max_batch: int | None, max_kv_bytes: int | None) -> tuple[Any, str]:
    """The engine for ``max_batch`` rows; None: :data:`DEFAULT_MAX_BATCH` where the backend
    batches, else one row with the backend's reason (logged, and shown by ``/ready``).

    Raises:
        InputError: as ``TTS.engine``.
    """
    if max_batch is not None:
        return tts.engine(max_batch, max_kv_bytes=max_kv_bytes), ""
    try:
        return tts.engine(DEFAULT_MAX_BATCH, max_kv_bytes=max_kv_bytes), ""
    except InputError as exc:  # the backend cannot batch (a problem of another kind recurs at one row)
        note = f"one request at a time: {exc}"
        log.info("serving %s", note)
        return tts.engine(1, max_kv_bytes=max_kv_bytes), note


def _codec_sha256(tts: Any) -> str:
    """sha256 of the file that encodes voices (the ``audio_encoder`` sub-part's entry, as the
    manifest records it); a voice's codes are only meaningful to the codec that made them."""
    manifest = tts.bundle.manifest
    entry = manifest.get("subparts", {}).get("audio_encoder", {}).get("entry")
    for record in manifest.get("files", []):
        if record.get("path") == entry:
            return record["sha256"]
    return ""


def _prefix_key(config: ServeConfig) -> bytes:
    """The secret that signs the voices' persisted prefixes (``--prefix-key-file``, made on first
    start); none without ``--voices-dir`` (nothing persists).

    Raises:
        InputError: the key file is inside the voices folder, or does not hold a key.
        HiggsPackError: it cannot be read or made (the path and the reason named).
    """
    if config.voices_dir is None:
        return b""
    path = config.prefix_key_file or default_prefix_key_file()
    try:
        return load_prefix_key(path, config.voices_dir)
    except OSError as exc:
        raise HiggsPackError(f"cannot read or make the voice prefix key {path} ({exc.strerror or exc}); give a "
                             "file this server may read and create with --prefix-key-file") from exc

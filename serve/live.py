"""Text streamed in, speech streamed out: the ``/v1/audio/speech/stream`` WebSocket.

The protocol is vllm-omni's (``vllm_omni/entrypoints/openai``; ../shared/SPEECH-AT-LENGTH.md), so
its clients work unchanged; docs/serving/live.md describes it for users.  The client sends JSON
text messages:

- ``{"type": "session.config", ...}`` (optional, first): ``voice``, ``response_format``
  (``pcm``, the default, or ``wav``), ``speed`` (0.25 to 4.0: each sentence's audio, its pause
  too, stretched with the pitch kept by :class:`~higgs_pack.serve.tempo.TimeStretch` as it is
  made, its times divided by ``speed``) and the sampling fields of ``POST /v1/audio/speech``
  (``seed``, ``temperature``, ``top_k``, ``top_p``, ``max_new_tokens``, ``ref_audio`` with
  ``ref_text``, ``references``, ``context_chunks``, ``context_frames``, ``initial_chunk_frames``), checked by the
  HTTP route's own :func:`~higgs_pack.serve.speech.parse_speech`, and the live route's own
  ``split_granularity`` (``clause``, the default, or ``sentence``) and ``first_commit_words`` (default 3) (:func:`live_options`);
- ``{"type": "input.text", "text": ...}`` pieces (an LLM's tokens, or whole sentences);
- ``{"type": "input.done"}``: speak what is left and end the session.

The server answers per sentence ``{"type": "audio.start", "sentence_index", "sentence_text",
"format", "sample_rate"}``, binary messages of audio (16-bit little-endian mono PCM at 24 kHz; with
``wav`` a binary message of its own, a WAV header of open length, comes before each sentence's
audio, so each sentence's bytes are a playable stream), ``{"type": "audio.done", "sentence_index", "start",
"end", "frames", "first_audio_s", "prefill_s", "prefilled", "words"}`` (``words``: each word's
``text``, ``start``, ``end`` and ``exact``, estimated: :mod:`~higgs_pack.runtime.loop.words`), and at the end ``{"type": "session.done",
"total_sentences"}``, then closes the socket (code 1000).  Beyond vllm-omni:

- each sentence is generated with the rolling context of a long text
  (:func:`~higgs_pack.runtime.loop.plan.chunk_context`): its prompt opens with the session's
  voice (with none, the first sentence's own speech is the voice of the rest), then the previous
  ``context_chunks`` sentences' text and codes as pairs of their own, so voice and prosody carry
  across sentences and the voice stays the prompt's prefix: every sentence after the first
  restores the voice's KV from the prefix cache and prefills only the context and its own text;
- ``audio.done``'s ``start`` and ``end`` are the sentence's speech in the session's audio as
  sent (seconds, at the session's ``speed``; ``frames`` are generated frames; the audio before ``start`` in a sentence's frames is the
  :data:`~higgs_pack.runtime.loop.synthesis.SENTENCE_PAUSE_S` pause that separates it from the
  previous sentence);
- ``{"type": "input.cancel"}`` stops the sentence being spoken (its row leaves the engine), drops
  its audio not yet sent and all buffered text, and answers ``{"type": "audio.cancelled",
  "sentence_index", "end"}`` (``end``: the session's audio sent so far, seconds); the session goes
  on with the next text.  With ``played_ms`` (and optionally ``sentence_index``: the audio the
  client played of a sentence, at the session's speed) it also answers ``played_ms``, ``heard_text``, ``heard_words``
  and ``words`` (the heard words' times in the session's audio, as ``audio.done``'s) and keeps only the heard words and their frames as the rolling context (:func:`~higgs_pack.serve.barge_in.heard_part`);
- ``{"type": "input.flush"}`` speaks buffered text that has no sentence end yet and ends a
  response (as ``input.cancel`` does): the next text's first words are committed alone again;
- a bad message gets ``{"type": "error", "message", "param", "code", "status"}`` naming the
  field; the session goes on.  A bad ``session.config`` is refused whole, its event naming every
  bad field (:func:`config_error`); text sent before a valid config is then refused too (never
  spoken with default settings) (a sentence the engine refuses, say one too long for the context,
  gets one with its ``sentence_text`` and is skipped).

Text is committed to speech where :class:`~higgs_pack.runtime.loop.sentences.TextCommits` says
(each committed part is a "sentence" of the protocol: its own ``audio.start`` and ``audio.done``):
with ``split_granularity`` ``clause`` at clause ends too, and a response's first
``first_commit_words`` words alone.  Sentences end where
:class:`~higgs_pack.runtime.loop.sentences.SentenceSplitter` says, the rule
the long-text planner uses too: punctuation (``. ! ? ; …``) followed by whitespace, a CJK (or
other script's) full stop once the next character came, or a line break; a ``.`` at the end of
what arrived so far may still be ``3.5`` and waits for the next piece.

Sessions share the server's engine.  A session holds one of the server's places in flight for
its whole life (``--max-batch`` + ``--max-queue``; one more is refused with a 429 ``error`` event
and close code 1013), and one engine request at a time.  Audio goes out through a bounded queue
(:data:`OUTBOX`): a client that reads slowly stops the session's reading of the engine (the
server never buffers its audio without bound).  The API key is the ``Authorization: Bearer``
header, or an ``api_key`` query parameter for browsers (which cannot set WebSocket headers).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import logging
import math
import time
from dataclasses import dataclass
from typing import Any

import anyio
import anyio.to_thread
import numpy as np
from fastapi import FastAPI, WebSocket
from starlette.websockets import WebSocketDisconnect, WebSocketState

from higgs_pack.errors import HiggsPackError, InputError, Problem, clipped, said_all
from higgs_pack.runtime import text as text_rule
from higgs_pack.runtime.engine.handle import EngineHandle, RequestCancelled
from higgs_pack.runtime.loop.decode import GenerationResult
from higgs_pack.runtime.loop.sentences import GRANULARITIES, TextCommits
from higgs_pack.runtime.loop.synthesis import SENTENCE_PAUSE_S
from higgs_pack.runtime.loop.text_chunks import frame_cap_problems
from higgs_pack.runtime.loop.words import words_json
from higgs_pack.runtime.request import PreparedVoice, SynthesisRequest, Voice
from higgs_pack.serve.barge_in import PLAYED_KEPT, Played, cancel_fields, heard_part, played_record
from higgs_pack.serve.errors import ApiError, from_input_error, from_live_input_error, refused
from higgs_pack.serve.formats import PCM_FORMATS, StreamEncoder
from higgs_pack.serve.schema import (
    FIRST_COMMIT_WORDS_MAX,
    LIVE_FIRST_CHUNK_FRAMES,
    NOT_IN_CONFIG,
    SessionFields,
    config_fields,
)
from higgs_pack.serve.speech import (
    SpeechJob,
    chosen_names,
    got,
    parse_speech,
    unique_json,
    unknown_fields,
)
from higgs_pack.serve.tempo import TimeStretch, scale_spans

log = logging.getLogger(__name__)

#: The route.
ROUTE = "/v1/audio/speech/stream"
#: Messages (JSON events and audio pieces of at most ``max_chunk_frames``, 4 s) waiting for a slow
#: client, at most, per session, besides what the socket's buffers hold (measured on Linux loopback:
#: with a client that stopped reading, the codec stood still after some 2,500 frames, about 4 MB of
#: audio, most of it in the kernel's send buffer).
OUTBOX = 4
#: The client's message types.
MESSAGES = ("session.config", "input.text", "input.flush", "input.done", "input.cancel")
#: Fields each client message takes besides ``type``; ``session.config``'s are :data:`CONFIG_FIELDS`.
FIELDS = {"input.text": ("text",), "input.flush": (), "input.done": (), "input.cancel": ("played_ms", "sentence_index")}
#: The fields a ``session.config`` takes besides ``type`` (:func:`~higgs_pack.serve.schema.config_fields`).
CONFIG_FIELDS = config_fields()
#: Close code of a session refused for load (RFC 6455 1013 "try again later").
TRY_AGAIN_LATER = 1013
#: Close code of a refused API key (RFC 6455 1008 "policy violation").
POLICY_VIOLATION = 1008
#: Close code of a text frame that is not UTF-8 (RFC 6455 1007 "invalid frame payload data"; uvicorn sends it).
INVALID_PAYLOAD = 1007


@dataclass
class _Spoken:
    """A sentence kept as rolling context: its index, text, frame cap and codes (all of it, or
    the part its listener heard before a barge-in)."""

    index: int
    text: str
    cap: int
    result: GenerationResult


@dataclass
class _Sentence:
    text: str
    complete_at: float  # perf_counter when its last text arrived (or the flush / done)


_DONE = object()  # the sentence queue's end: input.done


@dataclass
class _Item:
    """One message for the client: a JSON event or audio bytes, from one cancel epoch."""

    epoch: int
    event: dict[str, Any] | None = None
    audio: bytes = b""
    samples: int = 0  # samples of session audio in ``audio`` (a WAV header has none)
    speech: bool = False  # the sentence's speech (not its leading pause)
    keep: bool = False  # sent even after a cancel (audio.start, errors, audio.cancelled)
    played: Played | None = None  # with audio.start: the sentence's record


def live_route(app: FastAPI, server: Any) -> None:
    """Register :data:`ROUTE` on ``app`` for ``server`` (a
    :class:`~higgs_pack.serve.server.SpeechServer`)."""

    @app.websocket(ROUTE)
    async def speech_stream(websocket: WebSocket) -> None:
        await Session(server, websocket).run()

    @app.get(ROUTE, include_in_schema=False)
    async def speech_stream_without_upgrade() -> None:
        """A plain GET (a browser's address bar, curl): 426 saying the route is a WebSocket (it
        was a 404 'no route', though the route exists)."""
        raise ApiError(426, f"{ROUTE} is a WebSocket: connect with ws:// (or wss://) and an Upgrade: websocket "
                       "request; docs/serving/live.md describes its messages", code="upgrade_required",
                       headers={"Upgrade": "websocket", "Connection": "Upgrade"})


class Session:
    """One WebSocket session (see the module docstring): three tasks, the client's messages
    (:meth:`_receive`), the sentences spoken one at a time (:meth:`_speak`) and the bounded
    queue of what goes out (:meth:`_send`).

    Args:
        server: the :class:`~higgs_pack.serve.server.SpeechServer`.
        websocket: the accepted-to-be socket.
    """

    def __init__(self, server: Any, websocket: WebSocket):
        self.server, self.ws = server, websocket
        self.rate = server.tts.sample_rate
        self.job: SpeechJob | None = None
        self.voice: PreparedVoice | None = None
        self.configured = False
        self.config_refused = False  # a session.config was refused and no valid one came since
        self.text_seen = False
        self.not_utf8 = False  # the session ended on a text frame that is not UTF-8 (closed 1007)
        self.ended = False  # input.done received
        self.text = TextCommits(**live_options({}))  # text received, cut where it is committed to speech
        self.sentences: list[_Sentence | object] = []
        self.wake = anyio.Event()
        self.epoch = 0
        self.handle: EngineHandle | None = None
        self.speaking: int | None = None  # index of the sentence being spoken
        self.next_index = 0
        self.spoken: list[_Spoken] = []
        self.samples_sent = 0
        self.started = time.perf_counter()
        self.gone = False
        self.speech_start: float | None = None  # where the sentence being sent began speaking (seconds)
        self.played: list[Played] = []  # the last PLAYED_KEPT sentences whose audio went out, oldest first
        self.send_out, self.outbox = anyio.create_memory_object_stream[_Item](OUTBOX)

    async def run(self) -> None:
        """Accept, check the key and admit the session, then serve it until ``session.done`` or
        the client leaves; the engine request of a client that left is cancelled."""
        status = "101"
        await self.ws.accept()
        try:
            self.server.check_key(self.ws.headers.get("authorization", ""), self.ws.query_params.get("api_key", ""))
            self.server.admit()
        except ApiError as exc:
            status = str(exc.status)
            await self.ws.send_json(error_event(exc))
            await self.ws.close(POLICY_VIOLATION if exc.status == 401 else TRY_AGAIN_LATER)
            self.server.metrics.requests.labels(ROUTE, status).inc()
            return
        try:
            async with anyio.create_task_group() as group:
                group.start_soon(self._receive, group.cancel_scope)
                group.start_soon(self._speak)
                await self._send()
                group.cancel_scope.cancel()
            if self.gone and self.not_utf8:
                status = "400"
                log.info("a live session sent a text frame that is not UTF-8 after %d sentence(s); closed with 1007",
                         self.next_index)
            elif self.gone:
                status = "499"
                if self.server.stopping:  # the server closed it (1012), the client did not leave
                    log.info("a live session was closed by the server stopping, after %d sentence(s)",
                             self.next_index)
                else:
                    log.info("a live session's client left after %d sentence(s)", self.next_index)
            elif self.ws.application_state == WebSocketState.CONNECTED:
                with contextlib.suppress(WebSocketDisconnect, OSError):  # a client that closed first, once
                    await self.ws.close(1000)  # it had session.done, is done too (not a traceback in the log)
        finally:
            if self.handle is not None:
                self.handle.cancel()  # frees its row (a no-op when it finished)
            seconds = time.perf_counter() - self.started
            self.server.release(None)
            self.server.metrics.requests.labels(ROUTE, status).inc()
            self.server.metrics.request_seconds.labels(ROUTE).observe(seconds)

    # the client's messages
    async def _receive(self, scope: anyio.CancelScope) -> None:
        """Read the client's messages until it leaves (then stop the session's tasks)."""
        while True:
            try:
                message = await self.ws.receive()
            except (WebSocketDisconnect, OSError):
                message = {"type": "websocket.disconnect"}
            if message["type"] == "websocket.disconnect":
                self.not_utf8 = message.get("code") == INVALID_PAYLOAD  # the server closed it: not the client leaving
                self._leave(scope)
                return
            try:
                await self._handle(message)
            except ApiError as exc:
                await self._put(_Item(self.epoch, error_event(exc), keep=True))

    def _leave(self, scope: anyio.CancelScope) -> None:
        """The client left: cancel the sentence being spoken (its engine row frees) and the tasks."""
        self.gone = True
        if self.handle is not None:
            self.handle.cancel()
        scope.cancel()

    async def _handle(self, message: dict[str, Any]) -> None:
        if message.get("bytes") is not None:
            raise _bad("binary messages are not taken: send JSON text messages (session.config, input.text, "
                       "input.flush, input.done, input.cancel)", "type", "invalid_message")
        text = text_rule.clean(message.get("text") or "")  # a BOM before the JSON dropped, as an HTTP body's
        try:
            data = unique_json(text, "the message")
        except json.JSONDecodeError as exc:
            raise _bad(f"the message is not JSON ({exc}); send a JSON object with a \"type\"", "type",
                       "invalid_json") from exc
        except ApiError as exc:  # a field given twice (the HTTP door's refusal): a config so is refused whole
            if _message_type(text) != "session.config" or self.configured or self.text_seen:
                raise
            self.config_refused = True
            raise ApiError(exc.status, f"{_ended(exc.message)} {CONFIG_REFUSED}", param=exc.param,
                           code=exc.code) from exc
        if not isinstance(data, dict):
            raise _bad("a message is a JSON object with a \"type\"", "type", "invalid_message")
        data = chosen_names(data)  # "\ufeffinput.text" is input.text, as a config's "\ufeffwav" is wav
        kind = data.get("type")
        if kind not in MESSAGES:
            raise _bad(f"type {got(kind)} is not a message of this protocol; use one of {', '.join(MESSAGES)}",
                       "type", "unknown_type")
        extra = [] if kind == "session.config" else sorted(set(data) - {"type", *FIELDS[kind]})
        if extra:
            raise _bad(f"{kind} takes no {', '.join(map(repr, extra[:5]))}", extra[0][:80], "unknown_field")
        if kind == "session.config":
            await self._configure(data)
        elif kind == "input.cancel":
            await self._cancel(data)
        elif self.ended:
            raise _bad(f"{kind} after input.done: the session is ending; open a new one", "type", "session_ended")
        elif kind == "input.text":
            if self.config_refused:
                raise _bad("input.text before a valid session.config: the session.config sent was refused (see its "
                           "error event); send a corrected session.config, then the text (this text was dropped, "
                           "not spoken with default settings)", "session.config", "config_refused")
            self._add_text(data.get("text"))
        elif kind == "input.flush":
            self._queue_rest()
        else:  # input.done
            self._queue_rest()
            self.ended = True
            self.sentences.append(_DONE)
            self.wake.set()

    async def _configure(self, data: dict[str, Any]) -> None:
        if self.configured or self.text_seen:
            raise _bad("session.config comes once, before any input.text; this one was ignored", "type",
                       "config_too_late")
        try:
            self.job, self.voice = await anyio.to_thread.run_sync(self._parse_config, data,
                                                                  limiter=self.server.limiter)
        except ApiError:
            self.config_refused = True  # text now waits for a valid config: no speaking with defaults
            raise
        self.configured, self.config_refused = True, False
        self.text = TextCommits(**live_options(chosen_names(data)))

    def _parse_config(self, data: dict[str, Any]) -> tuple[SpeechJob, PreparedVoice | None]:
        """The session's :class:`SpeechJob` (its ``input`` a placeholder) and voice: the HTTP route's
        checks, a reference clip encoded once here.

        Raises:
            ApiError: the config refused as a whole, naming every bad field (:func:`config_error`).
        """
        fields = {k: v for k, v in data.items() if k != "type"}
        check = functools.partial(config_job, self.server)
        try:
            job = check(fields)
        except ApiError as exc:
            raise config_error(exc, fields, check) from exc
        voice = job.request.voice
        if isinstance(voice, Voice):
            try:
                voice = self.server.tts.prepare_voice(voice.audio, voice.transcript, "ref_audio")
            except InputError as exc:
                raise config_error(from_input_error(exc, param="ref_audio", names=dict(job.names)), {}, check) from exc
            try:  # the frame cap beside this voice (config_job checked it beside none)
                check_frame_cap(self.server, job.request.max_frames, voice)
            except ApiError as exc:
                raise config_error(exc, {}, check) from exc
        return job, voice

    def _add_text(self, text: Any) -> None:
        if not isinstance(text, str):
            raise _bad(f"input.text needs \"text\", a string, got {got(text)}", "text",
                       "missing_field" if text is None else "invalid_value")
        if (problem := text_rule.character_problem(text, "text")) is not None:  # the one text rule
            raise _bad(problem, "text", "invalid_value")
        text = text_rule.clean(text, start=not self.text_seen)  # a BOM is a byte-order mark only where the text starts
        waiting = len(self.text.pending) + sum(len(s.text) for s in self.sentences if isinstance(s, _Sentence))
        limit = self.server.config.max_input_chars
        if waiting + len(text) > limit:
            raise _bad(f"the session would hold {waiting + len(text)} characters not yet spoken; the limit is "
                       f"{limit} (--max-input-chars): send the rest once more has been spoken", "text",
                       "input_too_long")
        self.text_seen = True
        complete = self.text.feed(text)
        now = time.perf_counter()
        for sentence in complete:
            self.sentences.append(_Sentence(sentence, now))
        if complete:
            self.wake.set()

    def _queue_rest(self) -> None:
        """Speak the buffered text with no sentence end yet (``input.flush``, ``input.done``)."""
        now = time.perf_counter()
        complete = self.text.flush()
        for sentence in complete:
            self.sentences.append(_Sentence(sentence, now))
        self.wake.set()

    async def _cancel(self, data: dict[str, Any]) -> None:
        """``input.cancel``: stop the sentence being spoken, drop the text not yet spoken; with ``played_ms``,
        answer what was heard and keep only that as context (:func:`heard_part`).  Raises ApiError for a bad
        ``played_ms`` or ``sentence_index`` (:func:`cancel_fields`, :func:`played_record`; nothing is cancelled)."""
        played_ms, index = cancel_fields(data)
        record, self.epoch = played_record(self.played, index) if played_ms is not None else None, self.epoch + 1
        self.text.restart()
        self.sentences = [s for s in self.sentences if s is _DONE]
        event = {"type": "audio.cancelled", "sentence_index": self.speaking}
        if self.handle is not None:
            self.handle.cancel()
        if played_ms is not None:  # the context: the sentences before the one played, then what was heard of it
            frame_s = self.server.engine.pipeline.constants.hop_length / self.rate
            words, text, result = heard_part(record, played_ms, self.played, self.rate, frame_s)
            event.update({"played_ms": played_ms, "heard_text": text, "heard_words": len(words), "words": []})
            if words:  # in the session's audio as sent, as audio.done's words
                event["words"] = words_json(scale_spans(words, record.speed), round(record.speech / self.rate, 4))
            if record is not None:
                event["sentence_index"] = record.index
                self.spoken = [s for s in self.spoken if s.index < record.index]
            if result is not None:
                self._keep(_Spoken(record.index, text, record.cap, result))
        await self._put(_Item(self.epoch, event, keep=True))

    # speaking
    async def _speak(self) -> None:
        while True:
            while not self.sentences:
                self.wake = anyio.Event()
                await self.wake.wait()
            sentence = self.sentences.pop(0)
            if sentence is _DONE:
                await self._put(_Item(self.epoch, {"type": "session.done", "total_sentences": self.next_index},
                                      keep=True))
                return
            try:
                await self._say(sentence)
            except ApiError as exc:  # this sentence is not spoken; the session goes on
                event = {**error_event(exc, "text"), "sentence_text": clipped(sentence.text)}  # never echoed whole
                await self._put(_Item(self.epoch, event, keep=True))

    async def _say(self, sentence: _Sentence) -> None:
        """Speak one sentence: submit it with its rolling context, stream its audio out, keep its
        codes as the next sentence's context (unless it was cancelled)."""
        epoch, index = self.epoch, self.next_index
        job = await self._sentence_job(sentence.text, index)
        handle = await self.server.submit(job, said=from_live_input_error)
        if epoch != self.epoch or self.gone:  # cancelled (or left) while it was being submitted
            handle.cancel()
            return
        self.handle, self.speaking = handle, index
        self.next_index += 1
        fmt, stream, speed = job.response_format, iter(handle), job.speed
        record = Played(index, sentence.text, 0, stream, max(c for _, c in handle.plan.chunks), speed=speed)
        await self._put(_Item(epoch, {"type": "audio.start", "sentence_index": index, "sentence_text": sentence.text,
                                      "format": fmt, "sample_rate": self.rate}, keep=True, played=record))
        encoder, tempo = StreamEncoder(fmt, self.rate), TimeStretch(speed, self.rate)
        head = encoder.start()
        if head:
            await self._put(_Item(epoch, audio=head))
        if index and self.samples_sent:
            pause = np.zeros(round(SENTENCE_PAUSE_S * self.rate / speed), np.float32)
            await self._put(_Item(epoch, audio=encoder.chunk(pause), samples=len(pause)))

        def step() -> tuple[Any, np.ndarray]:
            """The next piece and its audio at the session's speed, on a worker thread (the stretch
            is FFmpeg's); at the end, None and the stretch's rest."""
            chunk = next(stream, None)
            return chunk, tempo.finish() if chunk is None else tempo.push(chunk.samples)

        first = math.nan
        t0 = time.perf_counter()
        try:
            while True:
                chunk, samples = await anyio.to_thread.run_sync(step, abandon_on_cancel=True,
                                                                limiter=self.server.limiter)
                if epoch != self.epoch:
                    handle.cancel()
                    return
                if chunk is not None and math.isnan(first):
                    first = time.perf_counter() - sentence.complete_at
                    self.server.metrics.first_audio.observe(first)
                if samples.size:  # a stretch holds its first window back: an empty piece is not sent
                    await self._put(_Item(epoch, audio=encoder.chunk(samples), samples=samples.size, speech=True))
                if chunk is None:
                    break
        except RequestCancelled:
            return
        except HiggsPackError as exc:
            raise ApiError(500, f"generation failed: {exc}", code="generation_failed") from exc
        finally:
            self.handle, self.speaking = None, None
        if epoch != self.epoch:
            return
        results = stream.results
        frames = int(sum(r.codes.shape[0] for r in results))
        seconds = tempo.samples_out / self.rate  # the audio sent, at speed
        record.words = tuple(word for segment in stream.segments for word in segment.words)
        if results:  # kept whole as context
            self._keep(_Spoken(index, sentence.text, record.cap, dataclasses.replace(
                results[0], codes=np.concatenate([r.codes for r in results], axis=0))))
        m = self.server.metrics
        m.frames.inc(frames)
        m.audio_seconds.inc(seconds)
        if seconds > 0:
            m.real_time_factor.observe((time.perf_counter() - t0) / seconds)
        prefill = sum(r.prefill_s for r in results if not math.isnan(r.prefill_s))
        await self._put(_Item(epoch, {"type": "audio.done", "sentence_index": index, "frames": frames,
                                      "first_audio_s": None if math.isnan(first) else round(first, 4),
                                      "prefill_s": round(prefill, 4),
                                      "prefilled": int(sum(max(r.prefilled, 0) for r in results)),
                                      "words": tuple(scale_spans(record.words, speed))}))

    async def _sentence_job(self, text: str, index: int) -> SpeechJob:
        """The engine request of sentence ``index``: the session's options, its seed plus
        ``index`` (a seeded session repeats; its sentences do not share one random stream's
        start), and the voice with its rolling context as the request's prepared voice."""
        if self.job is None:
            self.job, self.voice = await anyio.to_thread.run_sync(self._parse_config, {}, limiter=self.server.limiter)
        base = self.job.request
        seed = None if base.seed is None else base.seed + index
        spoken = list(self.spoken)

        def request() -> SynthesisRequest:  # checks its text: off the event loop
            voice, context = sentence_context(self.voice, spoken, base.context_chunks)
            return dataclasses.replace(base, text=text, voice=voice, context=context, seed=seed)

        try:  # a sentence the request refuses is this sentence's error (the engine's plan refuses the rest)
            return dataclasses.replace(self.job, request=await self.server.off_loop(request))
        except InputError as exc:
            raise from_live_input_error(exc, param="text") from exc

    def _keep(self, spoken: _Spoken) -> None:
        """Keep a sentence (or the part of it heard) as context: the first one (the voice of the
        rest when the session has none) and the last ``context_chunks``, no more."""
        self.spoken.append(spoken)
        keep = self.job.request.context_chunks
        first = self.spoken[:1] if self.voice is None else []
        recent = self.spoken[len(first):][-keep:] if keep else []
        self.spoken = first + recent

    # what goes out
    async def _put(self, item: _Item) -> None:
        await self.send_out.send(item)

    async def _send(self) -> None:
        """Send the outbox in order until ``session.done`` or the client leaves: audio and
        ``audio.done`` of a cancelled sentence are dropped (their ``epoch`` is behind)."""
        async for item in self.outbox:
            if item.epoch != self.epoch and not item.keep:
                continue
            try:
                if not await self._send_one(item):
                    return
            except (WebSocketDisconnect, OSError):  # the client left while we wrote (uvicorn: ClientDisconnected)
                self.gone = True
                if self.handle is not None:
                    self.handle.cancel()
                return

    async def _send_one(self, item: _Item) -> bool:
        """Send one item; ``audio.done`` gets ``start``/``end`` from the audio sent (seconds of the
        session's audio), ``audio.cancelled`` its ``end``.  False once ``session.done`` is sent."""
        event = item.event
        if event is None:
            if item.speech and self.speech_start is None:
                self.speech_start = self.samples_sent / self.rate
                self.played[-1].speech = self.samples_sent  # its audio.start went out before it
            await self.ws.send_bytes(item.audio)
            self.samples_sent += item.samples
            return True
        kind = event["type"]
        now = round(self.samples_sent / self.rate, 4)
        if kind == "audio.start":
            self.speech_start = None
            item.played.first = self.samples_sent
            self.played = [*self.played[1 - PLAYED_KEPT:], item.played]
        elif kind == "audio.done":
            start = now if self.speech_start is None else round(self.speech_start, 4)
            event = {**event, "start": start, "end": now, "words": words_json(event["words"], start)}
        elif kind == "audio.cancelled":
            event = {**event, "end": now}
        await self.ws.send_text(json.dumps(event))
        return kind != "session.done"


def config_job(server: Any, fields: dict[str, Any]) -> SpeechJob:
    """``fields`` of a session.config on ``server`` (its models, voices and limits), checked by the
    HTTP route's :func:`parse_speech`.

    Raises:
        ApiError: the first bad field.
    """
    for name, why in NOT_IN_CONFIG.items():
        if name in fields:
            raise _bad(f"session.config takes no {name}: {why}", name, "unknown_field")
    unknown = [name for name in fields if name not in CONFIG_FIELDS]
    if unknown:  # the session's fields listed, not the HTTP body's (parse_speech would list those)
        raise _bad(unknown_fields(unknown, CONFIG_FIELDS, fix="one of these fields of session.config "
                                  "(docs/serving/live.md)"), unknown[0][:80], "unknown_field")
    fields = chosen_names(fields)  # "\ufeffpcm" is "pcm", as the HTTP body's names are read
    live_options(fields)
    fields = {k: v for k, v in fields.items() if k not in SessionFields.model_fields}
    fmt = fields.get("response_format")
    if fmt is not None and fmt not in PCM_FORMATS:
        raise _bad(f"response_format {got(fmt)} is not carried by a live session: its binary messages are "
                   f"{' or '.join(PCM_FORMATS)}", "response_format", "unsupported_value")
    if all(fields.get(name) is None for name in ("initial_chunk_frames", "initial_codec_chunk_frames")):
        fields = {**fields, "initial_chunk_frames": LIVE_FIRST_CHUNK_FRAMES}  # first audio after lookahead + 1 frames
    body = {"model": server.models[0], "response_format": "pcm", **fields, "input": "session",
            "stream_format": "audio"}
    job = parse_speech(body, models=server.models, voices=server.voices, config=server.config)
    voice = job.request.voice  # a stored voice; a clip is checked once encoded (Session._parse_config)
    check_frame_cap(server, job.request.max_frames, voice if isinstance(voice, PreparedVoice) else None)
    return job


def check_frame_cap(server: Any, max_frames: int | None, voice: PreparedVoice | None) -> None:
    """Refuse at config time what the HTTP route refuses at once and every sentence of a session
    would be refused for: a frame cap (``max_new_tokens``) past the bundle's context less the
    prompt, or a voice that leaves no room for a word
    (:func:`~higgs_pack.runtime.loop.text_chunks.frame_cap_problems`).

    Raises:
        ApiError: 400 naming ``max_new_tokens`` (or ``ref_text``), in the HTTP route's words.
    """
    codes, transcript = (None, None) if voice is None else (voice.codes, voice.transcript)
    problems = frame_cap_problems(server.tts.pipeline, max_frames, codes, transcript)
    if problems:
        raise from_input_error(InputError(problems=problems))


def sentence_context(voice: PreparedVoice | None, spoken: list[_Spoken],
                     context_chunks: int) -> tuple[PreparedVoice | None, tuple[PreparedVoice, ...]]:
    """The voice and the earlier sentences a live sentence's request carries
    (:attr:`~higgs_pack.runtime.request.SynthesisRequest.context`), whole: the request's plan
    chooses and cuts them as it does a long text's chunks (:func:`~higgs_pack.runtime.loop.plan.chunk_context`:
    the last ``context_chunks``, each cut to ``context_frames``, the oldest left out while the prompt
    would not fit), so the route neither plans nor cuts.  The voice goes apart, so the prompt opens
    with it alone and its KV comes from the prefix cache after the first sentence.

    Args:
        voice: the session's voice, or None (the bundle's own: the first sentence's speech is then
            the voice of the rest, as a long text's first chunk is; the same codes and text each
            time, so its prefix is cached too).
        spoken: the sentences kept as context (:meth:`Session._keep`), oldest first.
        context_chunks: the session's; 0: each sentence is spoken on its own (no earlier sentence, and
            no first-sentence voice).

    Returns:
        ``(voice, context)``: the voice (``voice`` itself, the first sentence's, or None) and the
        earlier sentences as :class:`~higgs_pack.runtime.request.PreparedVoice` (codes int64
        [frames, N] and text), oldest first.
    """
    if not spoken or context_chunks == 0:
        return voice, ()
    if voice is None:
        first, *spoken = spoken
        voice = PreparedVoice(first.result.codes, first.text, "live first sentence")
    return voice, tuple(PreparedVoice(s.result.codes, s.text, "live context") for s in spoken if len(s.result.codes))


#: session.config fields checked together when each bad field is looked for (one needs the other).
CONFIG_GROUPS = (("ref_audio", "ref_text"),)
#: Said of every refused session.config.
CONFIG_REFUSED = ("session.config refused whole: none of its settings were taken; send a corrected "
                  "session.config before any input.text (text sent before one is refused, never spoken with "
                  "default settings)")


def config_error(first: ApiError, fields: dict[str, Any], check: Any) -> ApiError:
    """The error of a refused session.config, naming every bad field, not only the first.

    Each field (``ref_audio`` with ``ref_text``: :data:`CONFIG_GROUPS`) is checked alone with
    ``check``; a problem only of fields together (``voice`` with ``ref_audio``) is ``first``'s.

    Args:
        first: what checking the whole config raised.
        fields: the config's fields (without ``type``).
        check: ``fields -> SpeechJob``, raising :class:`ApiError` for the first bad field.

    Returns:
        An ApiError with ``first``'s status and code when one field is bad (``invalid_config``
        with several), ``param`` the first bad field's, and a message listing each problem as the
        HTTP route lists a body's (:func:`~higgs_pack.errors.said_all`: "N problems with the
        request:" and a line each), then that the config was refused whole.
    """
    grouped = {name for group in CONFIG_GROUPS for name in group}
    groups = [tuple(n for n in g if n in fields) for g in CONFIG_GROUPS] + [(n,) for n in fields if n not in grouped]
    errors: list[ApiError] = []
    for group in filter(None, groups):
        try:
            check({name: fields[name] for name in group})
        except ApiError as exc:
            errors.append(exc)
    if first.param not in [e.param for e in errors]:
        errors.insert(0, first)
    lines = [line for error in errors for line in error.lines]
    said = said_all(lines)  # several: the HTTP route's shape (higgs_pack.errors.said_all)
    message = f"{_ended(said)} {CONFIG_REFUSED}" if len(lines) == 1 else f"{said}\n{CONFIG_REFUSED}"
    if len(errors) == 1:
        return ApiError(first.status, message, param=first.param, code=first.code)
    return ApiError(max(e.status for e in errors), message, param=errors[0].param, code="invalid_config")


def _ended(message: str) -> str:
    """``message`` ending with one full stop (a message may end with its own)."""
    return message if message.endswith(".") else f"{message}."


def live_options(fields: dict[str, Any]) -> dict[str, Any]:
    """The :class:`~higgs_pack.runtime.loop.sentences.TextCommits` options of a session.config's
    ``split_granularity`` and ``first_commit_words`` (declared, with their defaults, by
    :class:`~higgs_pack.serve.schema.SessionFields`).

    Raises:
        ApiError: 400 naming the bad field.
    """
    defaults = SessionFields.model_fields  # null counts as left out, as in the speech body
    granularity = fields.get("split_granularity")
    granularity = defaults["split_granularity"].default if granularity is None else granularity
    words = fields.get("first_commit_words")
    words = defaults["first_commit_words"].default if words is None else words
    if granularity not in GRANULARITIES:
        raise _bad(f"split_granularity is one of {', '.join(GRANULARITIES)} (text committed to speech at sentence "
                   f"ends, or at clause ends too); got {got(granularity)}", "split_granularity", "invalid_value")
    if not isinstance(words, int) or isinstance(words, bool) or not 0 <= words <= FIRST_COMMIT_WORDS_MAX:
        raise _bad(f"first_commit_words is the most words of a response's first commit, 0 to {FIRST_COMMIT_WORDS_MAX} "
                   f"(0: none); got "
                   f"{got(words)}", "first_commit_words", "invalid_value")
    return {"granularity": granularity, "first_words": words}


def _message_type(text: str) -> Any:
    """The ``type`` of a JSON message read without the duplicate check (None when it has none)."""
    data = json.loads(text)
    return chosen_names(data).get("type") if isinstance(data, dict) else None


def error_event(exc: ApiError, text_param: str | None = None) -> dict[str, Any]:
    """An ``error`` event of ``exc``: ``message``, ``param`` (the field; the HTTP body's ``input``
    is the session's ``text``), ``code`` and ``status`` (what HTTP would have answered)."""
    param = text_param if text_param and exc.param in (None, "input") else exc.param
    return {"type": "error", "message": exc.message, "param": param, "code": exc.code, "status": exc.status}


def _bad(message: str, param: str | None, code: str) -> ApiError:
    """The 400 of one problem a live message's own checks found, answered as the HTTP door answers it."""
    return refused(Problem.said(message, code=code), param=param)


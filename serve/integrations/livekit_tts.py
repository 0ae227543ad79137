"""A LiveKit Agents TTS plugin for ``higgs-pack serve``: :class:`HiggsTTS` (the ``[livekit]`` extra).

It speaks to the server's live WebSocket (``/v1/audio/speech/stream``, docs/serving/live.md)
the way LiveKit's streaming TTS plugins do (``livekit.agents.tts.TTS`` with
``TTSCapabilities(streaming=True, aligned_transcript=True)``; ``SynthesizeStream._run`` with an
``AudioEmitter``; source: livekit-agents 1.8 ``livekit/agents/tts/tts.py``):

- one session per :class:`HiggsTTS`, kept open across the agent's turns (one stream at a
  time), so the rolling context carries the voice and prosody from turn to turn;
- a stream's text goes out as it is pushed (``input.text``), its ``flush()`` and end as
  ``input.flush``; its audio comes back as the server's sentences end, resampled to the
  ``sample_rate`` asked for (LiveKit's own ``rtc.AudioResampler``);
- each word is a ``TimedString`` with its ``start_time``/``end_time`` in the segment's audio
  (``aligned_transcript``; the server's estimates, docs/serving/live.md), so the agent's
  transcript stops at the word where speech was interrupted;
- a stream closed before its end (the agent interrupted) sends ``input.cancel`` with
  ``played_ms`` (:meth:`~higgs_pack.serve.integrations.protocol.Reader.played_now`): the
  sentence being spoken stops on the server, its row leaves the engine, the server keeps only
  the words heard as context, and the session stays open for the next turn;
- a sentence still being generated when its playback has run :data:`EARLY_WORDS_AFTER_S` (its
  ``audio.done``, which times its words, not come) has its words given as playback reaches them
  (:data:`EARLY_WORDS_LEAD_S` ahead), timed as the server times the words heard of a sentence cut
  there (:meth:`~higgs_pack.serve.integrations.protocol.Reader.estimated_words`); its
  ``audio.done`` gives the rest.  LiveKit cuts the transcript of an interrupted turn at the
  playback position from the words it was given before the interruption (the stream's tasks are
  cancelled first), so a sentence cut before its ``audio.done`` would leave nothing of it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import websockets
from livekit import rtc
from livekit.agents import tts, utils
from livekit.agents._exceptions import APIConnectionError, APIStatusError
from livekit.agents.types import DEFAULT_API_CONNECT_OPTIONS, APIConnectOptions, TimedString

from higgs_pack.serve.integrations.protocol import (
    FLUSH,
    SERVER_RATE,
    Event,
    Pending,
    Reader,
    auth_headers,
    cancel_message,
    config_message,
    stream_url,
    text_message,
)

log = logging.getLogger(__name__)

#: Seconds a sentence plays without its ``audio.done`` before its words are given from the
#: estimate (a sentence whose generation keeps ahead of playback has its ``audio.done`` sooner
#: and keeps the server's times for every word).
EARLY_WORDS_AFTER_S = 0.5
#: Seconds ahead of playback at which such a word is given, so that LiveKit's transcript
#: synchronizer has it before it is heard.
EARLY_WORDS_LEAD_S = 0.3


class HiggsTTS(tts.TTS):
    """Higgs-Audio-v3 speech from a ``higgs-pack serve`` server, streamed.

    Args:
        base_url: the server (``http://127.0.0.1:8000``) or its live route's ``ws://`` address.
        api_key: the server's ``--api-key``, if it has one.
        voice: ``"default"`` or a voice stored on the server (``POST /v1/audio/voices``).
        sample_rate: Hz of the audio frames this plugin gives LiveKit (the server speaks at
            24000; other rates are resampled).
        options: other ``session.config`` fields (``seed``, ``temperature``, ``top_k``,
            ``top_p``, ``max_new_tokens``, ``context_chunks``, ``context_frames``, ``initial_chunk_frames``).
    """

    def __init__(self, *, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None,
                 voice: str = "default", sample_rate: int = SERVER_RATE, **options: Any):
        super().__init__(capabilities=tts.TTSCapabilities(streaming=True, aligned_transcript=True),
                         sample_rate=sample_rate, num_channels=1)
        self._url, self._headers = stream_url(base_url), auth_headers(api_key)
        self._config = config_message(voice, **options)
        self._speed = float(options.get("speed") or 1.0)
        self._ws: Any = None
        self._reader = Reader(self._speed)
        self._lock = asyncio.Lock()

    @property
    def model(self) -> str:
        return "higgs-audio-v3"

    @property
    def provider(self) -> str:
        return "higgs-pack"

    def synthesize(self, text: str, *,
                   conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS) -> tts.ChunkedStream:
        """Whole text: one stream with ``text`` pushed and ended (LiveKit's helper)."""
        return self._synthesize_with_stream(text, conn_options=conn_options)

    def stream(self, *, conn_options: APIConnectOptions = DEFAULT_API_CONNECT_OPTIONS) -> HiggsStream:
        return HiggsStream(tts=self, conn_options=conn_options)

    async def _session(self) -> Any:
        """The open session (connected and configured on first use, or after it dropped)."""
        if self._ws is None or self._ws.state is not websockets.protocol.State.OPEN:
            try:
                self._ws = await websockets.connect(self._url, additional_headers=self._headers, max_size=None)
            except (OSError, websockets.InvalidHandshake) as exc:
                raise APIConnectionError(f"cannot reach higgs-pack serve at {self._url}: {exc}") from exc
            self._reader = Reader(self._speed)
            await self._ws.send(self._config)
        return self._ws

    async def aclose(self) -> None:
        if self._ws is not None:
            await self._ws.close()
            self._ws = None


class HiggsStream(tts.SynthesizeStream):
    """One turn's text in, its speech out, over the :class:`HiggsTTS`'s session."""

    def __init__(self, *, tts: HiggsTTS, conn_options: APIConnectOptions):
        super().__init__(tts=tts, conn_options=conn_options)
        self._higgs = tts
        self._speaking = False  # a sentence of this stream started and is not done
        self._given = 0  # words of that sentence given before its audio.done (from the estimate)
        self._last = 0.0  # where the last word given ends (seconds of the segment's audio)

    async def _run(self, output_emitter: tts.AudioEmitter) -> None:
        higgs = self._higgs
        request_id = utils.shortuuid()
        output_emitter.initialize(request_id=request_id, sample_rate=higgs.sample_rate, num_channels=1,
                                  mime_type="audio/pcm", stream=True)
        output_emitter.start_segment(segment_id=request_id)
        async with higgs._lock:
            ws = await higgs._session()
            finished = False
            try:
                await self._speak(ws, higgs._reader, output_emitter)
                finished = True
            except websockets.ConnectionClosed as exc:
                higgs._ws = None
                raise APIConnectionError(f"higgs-pack serve closed the session: {exc}") from exc
            finally:
                if not finished and higgs._ws is not None:  # interrupted: stop the sentence, keep the session
                    played = higgs._reader.played_now()
                    higgs._reader.cancelling()
                    try:
                        await asyncio.shield(ws.send(cancel_message(played)))
                    except (websockets.ConnectionClosed, asyncio.CancelledError):
                        higgs._ws = None
        output_emitter.end_segment()

    async def _speak(self, ws: Any, reader: Reader, emitter: tts.AudioEmitter) -> None:
        """Send this stream's text while reading its sentences, until every text it sent was spoken
        (or refused) and its input ended."""
        pending = Pending()
        ended = asyncio.Event()
        origin = reader.position  # where this stream's audio begins in the session's audio
        reader.new_turn()
        rate = self._higgs.sample_rate
        resampler = rtc.AudioResampler(SERVER_RATE, rate, num_channels=1) if rate != SERVER_RATE else None

        async def send() -> None:
            async for data in self._input_ch:
                if isinstance(data, self._FlushSentinel):
                    await ws.send(FLUSH)
                    continue
                self._mark_started()
                pending.sent(self, data)
                await ws.send(text_message(data))
            await ws.send(FLUSH)
            ended.set()

        sender = asyncio.create_task(send(), name="higgs-pack.send")
        try:
            while not (ended.is_set() and not pending.waiting(self) and not self._speaking):
                if sender.done() and sender.exception():
                    raise sender.exception()
                try:
                    message = await asyncio.wait_for(ws.recv(), 0.05)
                except asyncio.TimeoutError:
                    continue
                event = reader.read(message)
                if event is not None:
                    self._on(event, pending, emitter, resampler, origin)
                if self._speaking:
                    self._give_early_words(reader, emitter, origin)
        finally:
            sender.cancel()
        if resampler is not None:
            for frame in resampler.flush():
                emitter.push(frame.data.tobytes())

    def _on(self, event: Event, pending: Pending, emitter: tts.AudioEmitter, resampler: Any, origin: float) -> None:
        if event.kind == "audio":
            if resampler is None:
                emitter.push(event.audio)
            else:
                for frame in resampler.push(bytearray(event.audio)):
                    emitter.push(frame.data.tobytes())
        elif event.kind == "start":
            pending.spoken(event.text)
            self._speaking, self._given = True, 0
        elif event.kind == "done":
            self._speaking = False
            words = event.words or ((event.text, event.start, event.end),)
            self._give(emitter, words[self._given:], origin)
        elif event.kind == "error":
            if event.param in ("text", None) and event.text:  # one sentence refused; the rest go on
                pending.spoken(event.text)
                log.warning("higgs-pack serve refused a sentence: %s", event.message)
            else:
                raise APIStatusError(f"higgs-pack serve: {event.message}", status_code=400, body=event.message,
                                     retryable=False)

    def _give(self, emitter: tts.AudioEmitter, words: Any, origin: float) -> None:
        """Give LiveKit ``words`` (``(word, start, end)``, session seconds) as TimedStrings in the
        segment's audio (from ``origin``), never before the end of a word given earlier."""
        for word, start, end in words:
            start = max(start - origin, self._last)
            self._last = max(end - origin, start)
            emitter.push_timed_transcript(TimedString(word + " ", start_time=start, end_time=self._last))

    def _give_early_words(self, reader: Reader, emitter: tts.AudioEmitter, origin: float) -> None:
        """The sentence being received has played :data:`EARLY_WORDS_AFTER_S` without its
        ``audio.done``: give its words that playback will reach within :data:`EARLY_WORDS_LEAD_S`,
        timed by :meth:`Reader.estimated_words`."""
        at = reader.played_position()
        if at is None or reader.open is None or at < reader.open[2] + EARLY_WORDS_AFTER_S:
            return
        due = [w for w in reader.estimated_words()[self._given:] if w[1] <= at + EARLY_WORDS_LEAD_S]
        self._give(emitter, due, origin)
        self._given += len(due)

"""A Pipecat TTS service for ``higgs-pack serve``: :class:`HiggsTTSService` (the ``[pipecat]`` extra).

It speaks to the server's live WebSocket (``/v1/audio/speech/stream``, docs/serving/live.md) as
Pipecat's WebSocket TTS services do (``pipecat.services.tts_service.WebsocketTTSService``:
``run_tts`` sends text and yields None, a receive task appends the audio to the turn's audio
context; source: pipecat-ai 1.14 ``pipecat/services/tts_service.py`` and its Gradium service):

- one session for the service's life (reconnected by ``WebsocketService`` when it drops), so
  the rolling context carries the voice and prosody from sentence to sentence and turn to turn;
- with sentence aggregation (Pipecat's default) each sentence is sent and flushed at once; with
  ``TextAggregationMode.TOKEN`` tokens go out as they come and the server finds the sentence
  ends, the turn's end flushing the rest (``flush_audio``);
- audio comes back at 24 kHz and is resampled to the pipeline's output rate (Pipecat's own
  stream resampler);
- each word is passed with its time in the turn's audio (``supports_word_timestamps``,
  ``add_word_timestamps``; the server's estimates, docs/serving/live.md), so Pipecat's context
  keeps only the words spoken before an interruption;
- an interruption (``on_audio_context_interrupted``) sends ``input.cancel`` with ``played_ms``
  (:meth:`~higgs_pack.serve.integrations.protocol.Reader.played_now`): the sentence being
  spoken stops on the server, its row leaves the engine, the server keeps only the words heard
  as context, and the session stays open;
- a sentence cut before its ``audio.done`` (still being generated, its words not yet timed) has
  its heard words from the server's ``audio.cancelled`` (each with its time): they reach the
  assistant aggregator after the interruption (Pipecat's output transport lets the
  ``InterruptionFrame`` overtake every frame), so they are pushed as an utterance of their own,
  ``TTSStartedFrame``, a ``TTSTextFrame`` per word at its time, then
  ``LLMAssistantPushAggregationFrame`` (as Pipecat commits a ``TTSSpeakFrame``'s words), and
  the context gets them as an assistant message after the words of the turn's earlier sentences.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass
from typing import Any

from loguru import logger
from pipecat.audio.utils import create_stream_resampler
from pipecat.frames.frames import (
    CancelFrame,
    EndFrame,
    ErrorFrame,
    Frame,
    LLMAssistantPushAggregationFrame,
    TTSAudioRawFrame,
    TTSStartedFrame,
    TTSStoppedFrame,
    TTSTextFrame,
)
from pipecat.processors.frame_processor import FrameProcessorSetup
from pipecat.services.settings import TTSSettings
from pipecat.services.tts_service import WebsocketTTSService
from pipecat.utils.text.base_text_aggregator import TextType
from pipecat.utils.time import seconds_to_nanoseconds
from websockets.protocol import State

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


@dataclass(frozen=True)
class _Cut:
    """A sentence interrupted before its ``audio.done``: whose words the server's ``audio.cancelled``
    will say were heard.

    Attributes:
        context_id: its Pipecat audio context.
        sentence: its index on the server.
        origin: session seconds where the context's audio begins (its words' times count from there).
        clock: the pipeline clock (ns) when the context's first audio arrived.
    """

    context_id: str
    sentence: int
    origin: float
    clock: int


@dataclass
class HiggsTTSSettings(TTSSettings):
    """Settings of :class:`HiggsTTSService` (``voice``: ``"default"`` or a stored voice's name)."""


class HiggsTTSService(WebsocketTTSService):
    """Higgs-Audio-v3 speech from a ``higgs-pack serve`` server.

    Args:
        base_url: the server (``http://127.0.0.1:8000``) or its live route's ``ws://`` address.
        api_key: the server's ``--api-key``, if it has one.
        voice: ``"default"`` or a voice stored on the server (``POST /v1/audio/voices``).
        sample_rate: Hz of the audio frames (None: the pipeline's output rate); the server's
            24 kHz is resampled.
        options: other ``session.config`` fields (``seed``, ``temperature``, ``top_k``,
            ``top_p``, ``max_new_tokens``, ``context_chunks``, ``context_frames``, ``initial_chunk_frames``).
        settings: Pipecat's runtime-updatable settings (a new ``voice`` reconnects).
        kwargs: :class:`~pipecat.services.tts_service.TTSService`'s (``text_aggregation_mode``, ...).
    """

    Settings = HiggsTTSSettings
    _settings: HiggsTTSSettings

    def __init__(self, *, base_url: str = "http://127.0.0.1:8000", api_key: str | None = None,
                 voice: str = "default", sample_rate: int | None = None, options: dict[str, Any] | None = None,
                 settings: HiggsTTSSettings | None = None, **kwargs: Any):
        defaults = self.Settings(model="higgs-audio-v3", voice=voice, language=None)
        if settings is not None:
            defaults.apply_update(settings)
        super().__init__(push_stop_frames=True, push_start_frame=True, push_text_frames=False,
                         pause_frame_processing=True, sample_rate=sample_rate, settings=defaults,
                         supports_word_timestamps=True, **kwargs)
        self._url, self._headers, self._options = stream_url(base_url), auth_headers(api_key), dict(options or {})
        self._receive_task = None
        self._reader, self._pending = Reader(), Pending()
        self._current: str | None = None  # the context of the sentence being received
        self._sentence: int | None = None  # that sentence's index (started, not done)
        self._origins: dict[str, float] = {}  # session seconds where a context's audio begins
        self._clocks: dict[str, int] = {}  # the pipeline clock (ns) at a context's first audio
        self._ending: set[str] = set()  # contexts whose turn ended (flushed)
        self._cut: _Cut | None = None  # a sentence interrupted before its audio.done
        self._resampler = create_stream_resampler()

    def can_generate_metrics(self) -> bool:
        return True

    async def _update_settings(self, delta: TTSSettings) -> dict[str, Any]:
        changed = await super()._update_settings(delta)
        if "voice" in changed:  # a new session.config needs a new session
            await self._disconnect()
            await self._connect()
        else:
            self._warn_unhandled_updated_settings(changed)
        return changed

    # the connection (as Pipecat's WebSocket services keep theirs)
    async def setup(self, setup: FrameProcessorSetup) -> None:
        await super().setup(setup)
        await self._connect()

    async def stop(self, frame: EndFrame) -> None:
        await super().stop(frame)
        await self._disconnect()

    async def cancel(self, frame: CancelFrame) -> None:
        await super().cancel(frame)
        await self._disconnect()

    async def _connect(self) -> None:
        await super()._connect()
        if (self._websocket is None or self._websocket.state is not State.OPEN) and self._receive_task:
            await self.cancel_task(self._receive_task)  # the server closed it: a new receive task below
            self._receive_task = None
        await self._connect_websocket()
        if self._websocket and not self._receive_task:
            self._receive_task = self.create_task(self._receive_task_handler(self._report_error))

    async def _disconnect(self) -> None:
        await super()._disconnect()
        if self._receive_task:
            await self.cancel_task(self._receive_task)
            self._receive_task = None
        await self._disconnect_websocket()

    async def _connect_websocket(self) -> None:
        try:
            if self._websocket and self._websocket.state is State.OPEN:
                return
            self._websocket = await self._websocket_connect(self._url, additional_headers=self._headers,
                                                            max_size=None)
            self._reader, self._pending = Reader(), Pending()
            self._current, self._sentence, self._origins, self._clocks, self._ending = None, None, {}, {}, set()
            self._cut = None
            await self._websocket.send(config_message(self._settings.voice or "default", **self._options))
            await self._call_event_handler("on_connected")
        except Exception as exc:
            self._websocket = None
            await self.push_error(error_msg=f"cannot reach higgs-pack serve at {self._url}: {exc}", exception=exc)
            await self._call_event_handler("on_connection_error", f"{exc}")

    async def _disconnect_websocket(self) -> None:
        try:
            await self.stop_all_metrics()
            if self._websocket:
                await self._websocket.close()
        finally:
            self._websocket = None
            await self._call_event_handler("on_disconnected")

    # text out
    async def run_tts(self, text: str, context_id: str) -> AsyncGenerator[Frame | None, None]:
        """Send ``text``: a sentence (flushed at once) or, in token mode, a token."""
        if not self._websocket or self._websocket.state is not State.OPEN:
            await self._connect()
        if not self._websocket:
            yield ErrorFrame(error=f"higgs-pack serve at {self._url} is not connected")
            return
        try:
            self._pending.sent(context_id, text)
            await self._websocket.send(text_message(text))
            if not self._is_streaming_tokens:  # sentence aggregation: Pipecat cut the sentence
                await self._websocket.send(FLUSH)
            await self.start_tts_usage_metrics(text)
        except Exception as exc:
            yield ErrorFrame(error=f"higgs-pack serve: {exc}")
            yield TTSStoppedFrame(context_id=context_id)
            await self._disconnect()
            await self._connect()
            return
        yield None

    async def flush_audio(self, context_id: str | None = None) -> None:
        """The turn ended: speak the text left without a sentence end; the context ends when its
        last sentence is done."""
        context_id = context_id or self.get_active_audio_context_id()
        if not context_id or not self._websocket:
            return
        self._ending.add(context_id)
        await self._websocket.send(FLUSH)
        await self._finish_if_spoken(context_id)

    async def on_audio_context_interrupted(self, context_id: str) -> None:
        """Barge-in: stop the sentence on the server (``input.cancel`` with ``played_ms``), forget
        the text sent; when the sentence played is this context's one still without its
        ``audio.done``, its heard words are added once the server's ``audio.cancelled`` names them."""
        played = self._reader.played_now()
        origin, clock = self._origins.pop(context_id, None), self._clocks.pop(context_id, None)
        tts_context = getattr(self, "_tts_contexts", {}).get(context_id)  # Pipecat's: its append_to_context
        if (played is not None and played[0] == self._sentence and self._current == context_id
                and origin is not None and clock is not None and getattr(tts_context, "append_to_context", True)):
            self._cut = _Cut(context_id, played[0], origin, clock)
        self._reader.cancelling()
        self._reader.new_turn()
        self._pending.clear()
        self._current = self._sentence = None
        self._ending.discard(context_id)
        if self._websocket and self._websocket.state is State.OPEN:
            await self._websocket.send(cancel_message(played))
        await self.stop_all_metrics()
        await super().on_audio_context_interrupted(context_id)

    # audio in
    async def _receive_messages(self) -> None:
        async for message in self._get_websocket():
            event = self._reader.read(message)
            if event is not None:
                await self._on(event)

    def _get_websocket(self) -> Any:
        if self._websocket:
            return self._websocket
        raise ConnectionError("not connected to higgs-pack serve")

    async def _on(self, event: Event) -> None:
        if event.kind == "start":
            self._current, self._sentence = self._pending.spoken(event.text), event.sentence
            if self._current is not None and self._current not in self._origins:
                self._origins[self._current] = self._reader.position
                self._reader.new_turn()
        elif event.kind == "audio":
            context_id = self._current
            if context_id and self.audio_context_available(context_id):
                self._clocks.setdefault(context_id, self.get_clock().get_time())
                audio = await self._resampler.resample(event.audio, SERVER_RATE, self.sample_rate)
                await self.append_to_audio_context(context_id, TTSAudioRawFrame(
                    audio=audio, sample_rate=self.sample_rate, num_channels=1, context_id=context_id))
        elif event.kind == "done":
            context_id, self._current, self._sentence = self._current, None, None
            if context_id and self.audio_context_available(context_id):
                origin = self._origins.get(context_id, event.start)
                words = [(word, start - origin) for word, start, _ in event.words] or [(event.text, event.start - origin)]
                await self.add_word_timestamps(words, context_id)
                await self._finish_if_spoken(context_id)
        elif event.kind == "cancelled":
            cut, self._cut = self._cut, None
            if cut is not None and event.sentence == cut.sentence and event.words:
                await self._add_heard(cut, event.words)
        elif event.kind == "error":
            context_id = self._pending.spoken(event.text) if event.text else None
            logger.warning(f"{self}: higgs-pack serve: {event.message}")
            await self.push_error(error_msg=f"higgs-pack serve: {event.message}")
            if context_id:
                await self._finish_if_spoken(context_id)

    async def _add_heard(self, cut: _Cut, words: Sequence[tuple[str, float, float]]) -> None:
        """Push the words heard of ``cut``'s sentence (``(word, start, end)``, session seconds) as an
        utterance of their own: each word's ``TTSTextFrame`` at its time in the turn's audio (the
        clock at its first audio plus its offset; in the past, so the output transport's clock
        releases it at once), between a ``TTSStartedFrame`` that opens an assistant turn in the
        aggregator (the interruption closed the turn) and an ``LLMAssistantPushAggregationFrame``
        just after the last word, which commits them to the context."""
        times = [cut.clock + seconds_to_nanoseconds(max(0.0, start - cut.origin)) for _, start, _ in words]
        started = TTSStartedFrame(context_id=cut.context_id)
        started.pts = max(1, times[0] - 1)  # through the transport's clock queue, before the words
        await self.push_frame(started)
        for (word, _, _), pts in zip(words, times, strict=True):
            frame = TTSTextFrame(word, text_type=TextType.WORD, context_id=cut.context_id)
            frame.pts = pts
            await self.push_frame(frame)
        commit = LLMAssistantPushAggregationFrame()
        commit.pts = times[-1] + 1
        await self.push_frame(commit)

    async def _finish_if_spoken(self, context_id: str) -> None:
        """End ``context_id``'s audio once its turn ended and every sentence of it is done."""
        if context_id in self._ending and not self._pending.waiting(context_id) and self._current != context_id:
            self._ending.discard(context_id)
            self._origins.pop(context_id, None)
            self._clocks.pop(context_id, None)
            if self.audio_context_available(context_id):
                await self.append_to_audio_context(context_id, TTSStoppedFrame(context_id=context_id))
                await self.remove_audio_context(context_id)
            await self.stop_all_metrics()

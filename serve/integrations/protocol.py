"""The client side of ``higgs-pack serve``'s live WebSocket (``/v1/audio/speech/stream``;
docs/serving/live.md), shared by the Pipecat service and the LiveKit plugin.

It only builds messages and reads them (:class:`Reader`): each framework keeps its own
connection (Pipecat's ``WebsocketService`` reconnects its socket itself).  Needs nothing but
the standard library (and the runtime's word-timing rule, :mod:`higgs_pack.runtime.loop.words`,
itself standard library only), so the frameworks' processes need no server dependencies.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

from higgs_pack.runtime.loop.words import word_timings

#: The server's audio: 16-bit little-endian mono PCM at this rate (Hz).
SERVER_RATE = 24000
#: Seconds of silence before each sentence's speech but the session's first, at speed 1 (the
#: server's :data:`~higgs_pack.runtime.loop.synthesis.SENTENCE_PAUSE_S`).
SENTENCE_PAUSE_S = 0.2
#: Characters (whitespace not counted) per second of speech at speed 1 by which the server times
#: the words of a sentence cut off before its end was generated, until the session has spoken a
#: sentence to measure its own rate: about 150 words a minute (a common conversational rate) of 5
#: characters with punctuation.
SPEECH_CHARS_PER_S = 12.5
#: Finished sentences whose speaking rate the estimate uses: the last ones whose audio went out
#: (the server's ``PLAYED_KEPT``).
RATE_KEPT = 8
#: The route on a server's address.
ROUTE = "/v1/audio/speech/stream"


def stream_url(base_url: str) -> str:
    """The WebSocket address of the live route on a server (``http://host:port`` or
    ``ws://host:port``, with or without the route)."""
    url = base_url.rstrip("/")
    if url.startswith("http"):
        url = "ws" + url[4:]
    return url if url.endswith(ROUTE) else url + ROUTE


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The ``Authorization`` header of ``api_key`` (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def config_message(voice: str = "default", **fields: Any) -> str:
    """``session.config`` with ``response_format`` pcm, ``voice`` and the speech body's
    sampling ``fields`` (``seed``, ``temperature``, ``top_k``, ``top_p``, ``max_new_tokens``,
    ``context_chunks``, ``context_frames``, ``initial_chunk_frames``; None values left out)."""
    body = {"type": "session.config", "voice": voice, "response_format": "pcm"}
    body.update({k: v for k, v in fields.items() if v is not None})
    return json.dumps(body)


def text_message(text: str) -> str:
    """``input.text`` carrying ``text`` (a token, or sentences)."""
    return json.dumps({"type": "input.text", "text": text})


FLUSH = json.dumps({"type": "input.flush"})
DONE = json.dumps({"type": "input.done"})
CANCEL = json.dumps({"type": "input.cancel"})


def cancel_message(played: tuple[int, float] | None = None) -> str:
    """``input.cancel``; with ``played`` (a sentence's index and the milliseconds of its audio the
    client played: :meth:`Reader.played`) also ``sentence_index`` and ``played_ms``, so the
    server answers the text heard and keeps only that as context."""
    if played is None:
        return CANCEL
    return json.dumps({"type": "input.cancel", "sentence_index": played[0], "played_ms": round(played[1], 1)})


@dataclass(frozen=True)
class Event:
    """One thing the server said, read by :class:`Reader`.

    Attributes:
        kind: ``"start"`` (a sentence begins), ``"audio"``, ``"done"`` (a sentence ended),
            ``"cancelled"``, ``"error"``, ``"session.done"``.
        sentence: the sentence's index (start, done; cancelled: the one stopped, or None).
        text: the sentence's text (start, done; error: the sentence refused, or "").
        audio: PCM bytes (audio; 16-bit mono at :data:`SERVER_RATE`).
        start: seconds where the sentence's speech begins in the session's audio (done).
        end: seconds where it ends (done, cancelled: the audio sent so far).
        param: the field an error names.
        message: an error's message.
        words: ``(word, start, end)`` of each word (done; cancelled with played_ms: each word
            heard; seconds in the session's audio, estimated by the server), in order.
        heard: the text the listener heard of the sentence cut off (cancelled, with played_ms).
    """

    kind: str
    sentence: int | None = None
    text: str = ""
    audio: bytes = b""
    start: float = 0.0
    end: float = 0.0
    param: str | None = None
    message: str = ""
    words: tuple[tuple[str, float, float], ...] = ()
    heard: str = ""


class Reader:
    """Reads the server's messages into :class:`Event`; after :meth:`cancelling` it drops audio
    until the server's ``audio.cancelled`` (audio of the stopped sentence already on the wire),
    so what follows is the next text's.

    Args:
        speed: the session's ``speed`` (its audio and times are ``1 / speed`` as long).

    Raises:
        ValueError: a message that is not this protocol's (not JSON, no known ``type``).
    """

    def __init__(self, speed: float = 1.0) -> None:
        self.speed = speed
        self.dropping = False
        self.position = 0.0
        """Seconds of the session's audio the server has sent, as of its last ``audio.done`` or
        ``audio.cancelled`` (where the next sentence's audio begins)."""
        self.received = 0.0
        """Seconds of the session's audio read so far (that :meth:`read` dropped included)."""
        self._texts: dict[int, str] = {}
        self._starts: list[tuple[int, float]] = []  # (sentence, session seconds of its first audio), recent
        self._playing: tuple[float, float] | None = None  # (monotonic time, session seconds) of a turn's first audio
        self.open: tuple[int, str, float] | None = None
        """The sentence being received, started and not done: its index, text and session seconds
        where its speech begins (after its pause)."""
        self._rates: list[tuple[int, int, float]] = []  # (sentence, characters, seconds of speech) of finished ones

    def cancelling(self) -> None:
        """The client sent ``input.cancel``."""
        self.dropping = True

    def new_turn(self) -> None:
        """A turn begins: its first audio starts the player's clock (:meth:`played_now`)."""
        self._playing = None

    def played_position(self) -> float | None:
        """Seconds of the session's audio played now by a player that started playing the turn's
        first audio when it was read and plays in real time (at most what was read); None before
        the turn's first audio."""
        if self._playing is None:
            return None
        since, position = self._playing
        return min(position + time.monotonic() - since, self.received)

    def played_now(self) -> tuple[int, float] | None:
        """:meth:`played` at :meth:`played_position`: what a barge-in now interrupted, as near as a
        client that does not see its player can tell."""
        at = self.played_position()
        return None if at is None else self.played(at)

    def played(self, played_s: float) -> tuple[int, float] | None:
        """The sentence playing at ``played_s`` seconds of the session's audio (a player's
        position) and the milliseconds of it played (from its first audio, its pause included),
        for :func:`cancel_message`; None before any sentence's audio."""
        found = [(index, start) for index, start in self._starts if start <= played_s + 1e-9]
        if not found:
            return None
        index, start = found[-1]
        return index, max(0.0, min(played_s, self.received) - start) * 1000

    def estimated_words(self) -> tuple[tuple[str, float, float], ...]:
        """``(word, start, end)`` of each word of the sentence being received (:attr:`open`; ``()``
        when none), in seconds of the session's audio, estimated as the server estimates the words
        heard of a sentence cut off before its end was generated (``barge_in.estimated_words``):
        spread over its characters at the session's own speaking rate (its last finished
        sentences', else :data:`SPEECH_CHARS_PER_S`), or over the audio read of it so far, whichever
        is longer.  Before its ``audio.done`` these are the times by which a barge-in's
        ``audio.cancelled`` will say which words were heard."""
        if self.open is None:
            return ()
        _, text, speech = self.open
        recent = {index for index, _ in self._starts}
        chars = sum(c for index, c, _ in self._rates if index in recent)
        seconds = sum(s for index, _, s in self._rates if index in recent)
        rate = chars / seconds if chars and seconds > 0 else SPEECH_CHARS_PER_S * self.speed
        length = max(spoken_chars(text) / rate, self.received - speech)
        return tuple((w.text, w.start, w.end) for w in word_timings(text, speech, speech + length))

    def read(self, message: str | bytes) -> Event | None:
        """The event of one message, or None for one to ignore (stale audio, unknown events)."""
        if isinstance(message, (bytes, bytearray)):
            if self._playing is None and not self.dropping:
                self._playing = (time.monotonic(), self.received)
            self.received += len(message) / 2 / SERVER_RATE
            return None if self.dropping else Event("audio", audio=bytes(message))
        data = json.loads(message)
        kind = data.get("type")
        if kind == "audio.cancelled":
            self.dropping, self.open = False, None
            self.position = self.received = data.get("end", self.position)
            return Event("cancelled", data.get("sentence_index"), end=self.position, heard=data.get("heard_text", ""),
                         words=_words(data))
        if kind == "error":
            return Event("error", text=data.get("sentence_text", ""), param=data.get("param"),
                         message=data.get("message", ""))
        if kind == "session.done":
            return Event("session.done")
        if self.dropping:
            return None
        index = data.get("sentence_index")
        if kind == "audio.start":
            self._texts[index] = data.get("sentence_text", "")
            pause = SENTENCE_PAUSE_S / self.speed if index and self.received else 0.0  # as the server pauses
            self.open = (index, self._texts[index], self.received + pause)
            self._starts = [*self._starts[1 - RATE_KEPT:], (index, self.received)]
            return Event("start", index, self._texts[index])
        if kind == "audio.done":
            self.position, self.open = data["end"], None
            event = Event("done", index, self._texts.pop(index, ""), start=data["start"], end=data["end"],
                          words=_words(data))
            if event.words:  # the session's speaking rate: characters per second of speech
                self._rates = [*self._rates[1 - RATE_KEPT:],
                               (index, spoken_chars(event.text), event.words[-1][2] - event.start)]
            return event
        return None


def _words(data: dict[str, Any]) -> tuple[tuple[str, float, float], ...]:
    """An event's ``words`` as ``(word, start, end)``."""
    return tuple((w["text"], w["start"], w["end"]) for w in data.get("words") or ())


def spoken_chars(text: str) -> int:
    """Characters of ``text`` that are not whitespace: the server cuts sentences out of what it
    is sent and strips only whitespace, so these counts let a client tell which of its texts a
    sentence came from."""
    return sum(not c.isspace() for c in text)


class Pending:
    """Which of a client's texts each sentence of the server came from: the texts sent, each
    with its owner (a Pipecat context, a LiveKit stream) and its :func:`spoken_chars`, consumed
    in order as the server's sentences (their texts) start, are refused or are cancelled."""

    def __init__(self) -> None:
        self._texts: list[list[Any]] = []  # [owner, characters not yet in a sentence]

    def sent(self, owner: Any, text: str) -> None:
        """``owner`` sent ``text`` (``input.text``)."""
        chars = spoken_chars(text)
        if chars:
            self._texts.append([owner, chars])

    def spoken(self, sentence: str) -> Any:
        """A sentence began (or was refused): its owner (the owner of its first characters), its
        characters consumed; None when nothing was waiting."""
        owner = self._texts[0][0] if self._texts else None
        chars = spoken_chars(sentence)
        while chars and self._texts:
            take = min(chars, self._texts[0][1])
            self._texts[0][1] -= take
            chars -= take
            if not self._texts[0][1]:
                self._texts.pop(0)
        return owner

    def waiting(self, owner: Any) -> bool:
        """Whether some text of ``owner`` has not become a sentence yet."""
        return any(entry[0] == owner for entry in self._texts)

    def clear(self) -> None:
        """Forget every text (the client cancelled: the server dropped what it buffered)."""
        self._texts.clear()

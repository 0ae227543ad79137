"""What an answer carries: whole files in each response format, and the streamed forms.

- ``pcm`` is raw 24 kHz 16-bit signed little-endian mono, as OpenAI defines it.
- ``wav`` whole is a 16-bit PCM WAV of exact length; streamed, one header with open
  (``0xFFFFFFFF``) sizes then the samples: what players accept (Kokoro-FastAPI#94, #57),
  not a header per chunk.
- ``flac``, ``mp3`` and ``opus`` (Ogg Opus) are written by libsndfile where the installed
  one has them (:func:`response_formats`); they come whole, not streamed.
- ``sse``: ``speech.audio.delta`` events whose base64 ``audio`` decoded and joined are the
  bytes ``stream_format="audio"`` sends, then ``speech.audio.done`` with ``usage``, or
  ``speech.audio.error`` (OpenAI's event names; ../shared/SERVING.md); between them, right after
  the delta that completes a sentence's audio, a ``speech.segment`` event with its timings
  (:func:`segment_json`; an event of ours, which OpenAI's clients pass over).
- a whole answer with ``segments: true``: a JSON object with the file base64-encoded and the
  segments (:func:`segments_answer`).
"""

from __future__ import annotations

import base64
import functools
import io
import json
from typing import Any

import numpy as np
import soundfile as sf

from higgs_pack.runtime.audio import pcm_samples, streaming_wav_header
from higgs_pack.runtime.loop.words import words_json

#: Response format -> (media type, libsndfile format, subtype); pcm has no container.
FORMATS: dict[str, tuple[str, str | None, str | None]] = {
    "wav": ("audio/wav", "WAV", "PCM_16"),
    "pcm": ("audio/pcm", None, None),
    "flac": ("audio/flac", "FLAC", "PCM_16"),
    "mp3": ("audio/mpeg", "MP3", "MPEG_LAYER_III"),
    "opus": ("audio/ogg", "OGG", "OPUS"),
}
#: Formats a stream carries (bytes as they are generated).
STREAMABLE = ("pcm", "wav")


@functools.cache
def response_formats() -> tuple[str, ...]:
    """The formats this process can write: every one of :data:`FORMATS` whose libsndfile
    format and subtype the installed libsndfile has (mp3 needs libsndfile >= 1.1)."""
    return tuple(name for name, (_, fmt, subtype) in FORMATS.items()
                 if fmt is None or sf.check_format(fmt, subtype))


def media_type(response_format: str) -> str:
    """The Content-Type of ``response_format``."""
    return FORMATS[response_format][0]


def encode_whole(samples: np.ndarray, sample_rate: int, response_format: str) -> bytes:
    """A whole file of float32 [n] mono samples (clipped to [-1, 1], as a stream clips them).

    Args:
        samples: float32 [n], nominally in [-1, 1].
        sample_rate: Hz (24000).
        response_format: one of :func:`response_formats`.
    """
    samples = np.clip(np.asarray(samples, dtype=np.float32).reshape(-1), -1.0, 1.0)
    pcm = pcm_samples(samples)
    if response_format == "pcm":
        return pcm.tobytes()
    _, fmt, subtype = FORMATS[response_format]
    out = io.BytesIO()
    # 16-bit containers get the very samples pcm and the stream carry (int16 is written as is;
    # libsndfile would scale floats by 32767, not 32768); lossy codecs take the floats.
    sf.write(out, pcm if subtype == "PCM_16" else samples, sample_rate, format=fmt, subtype=subtype)
    return out.getvalue()


class StreamEncoder:
    """Bytes of a streamed answer, chunk by chunk: :meth:`start` once, then :meth:`chunk`.

    Args:
        response_format: ``"pcm"`` or ``"wav"``.
        sample_rate: Hz.
    """

    def __init__(self, response_format: str, sample_rate: int):
        if response_format not in STREAMABLE:
            raise ValueError(f"{response_format} is not streamable; use one of {STREAMABLE}")
        self.response_format, self.sample_rate = response_format, sample_rate
        self.bytes_sent = 0

    def start(self) -> bytes:
        """The bytes before any audio: a WAV header of open length, or nothing for pcm."""
        head = streaming_wav_header(self.sample_rate) if self.response_format == "wav" else b""
        self.bytes_sent += len(head)
        return head

    def chunk(self, samples: np.ndarray) -> bytes:
        """16-bit little-endian PCM of float32 [n] samples (clipped to [-1, 1])."""
        data = pcm_samples(np.clip(np.asarray(samples, dtype=np.float32).reshape(-1), -1.0, 1.0)).tobytes()
        self.bytes_sent += len(data)
        return data


def sse_event(event: dict[str, Any]) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def sse_delta(audio: bytes) -> bytes:
    """A ``speech.audio.delta`` event carrying ``audio`` base64-encoded."""
    return sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(audio).decode("ascii")})


def segment_json(segment: Any) -> dict[str, Any]:
    """A :class:`~higgs_pack.runtime.loop.generate.Segment` as JSON: ``text``, ``start`` and ``end``
    (seconds from the start of the audio, to the microsecond), ``chunk`` (the text chunk it was
    generated in), ``exact`` (false: an end estimated inside a chunk), ``words`` (its estimated
    word timings: :func:`~higgs_pack.runtime.loop.words.words_json`) and, in a dialogue, ``speaker``."""
    out = {"text": segment.text, "start": round(segment.start, 6), "end": round(segment.end, 6),
           "chunk": segment.chunk, "exact": segment.exact, "words": words_json(segment.words)}
    if segment.speaker is not None:
        out["speaker"] = segment.speaker
    return out


def sse_segment(segment: Any) -> bytes:
    """A ``speech.segment`` event: one sentence's (or turn's) timings (:func:`segment_json`), sent once
    the audio up to its ``end`` has been sent."""
    return sse_event({"type": "speech.segment", **segment_json(segment)})


def segments_answer(audio: bytes, response_format: str, sample_rate: int, segments: list[Any]) -> bytes:
    """The JSON of a whole answer with timings: ``{"audio": base64 of the file in
    response_format, "response_format", "sample_rate", "segments": [segment_json, ...]}``."""
    return json.dumps({"audio": base64.b64encode(audio).decode("ascii"), "response_format": response_format,
                       "sample_rate": sample_rate, "segments": [segment_json(s) for s in segments]},
                      separators=(",", ":")).encode()


def sse_done(input_tokens: int, output_tokens: int) -> bytes:
    """The ``speech.audio.done`` event; ``output_tokens`` counts frames (25 per second)."""
    return sse_event({"type": "speech.audio.done", "usage": {
        "input_tokens": input_tokens, "output_tokens": output_tokens, "total_tokens": input_tokens + output_tokens}})


def sse_error(message: str, code: str | None = None) -> bytes:
    """A ``speech.audio.error`` event: the stream failed after it started."""
    return sse_event({"type": "speech.audio.error", "error": {"message": message, "code": code}})

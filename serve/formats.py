"""What an answer carries: a file in each response format, whole or streamed, and the SSE events.

The formats are OpenAI's six (openai-python ``types/audio/speech_create_params.py``:
``response_format`` "mp3", "opus", "aac", "flac", "wav" or "pcm"; OpenAI's OpenAPI document,
``CreateSpeechRequest``: default "mp3"), each
encoded from the same 16-bit samples (:func:`~higgs_pack.runtime.audio.pcm_samples`), and each
streamed as it is generated in a form that players play while it arrives:

- ``pcm`` is raw 24 kHz 16-bit signed little-endian mono, as OpenAI defines it.
- ``wav`` whole is a 16-bit PCM WAV of exact length; streamed, one header with open
  (``0xFFFFFFFF``) sizes then the samples: what players accept (Kokoro-FastAPI#94, #57),
  not a header per chunk.
- ``mp3`` (MPEG-2 Layer III frames by LAME, an ID3v2 tag first), ``opus`` (Opus in Ogg pages,
  one 20 ms packet per page), ``aac`` (AAC-LC in ADTS frames) and ``flac`` (a native FLAC stream)
  are encoded by FFmpeg through PyAV, frame by frame (:class:`StreamEncoder`).  A whole answer
  is the same encoder fed the whole audio at once, so it holds the stream's very bytes, except
  that a whole FLAC's header gets its length and MD5 (a stream's says "length unknown", which
  FFmpeg reads to the end but libsndfile refuses).  An mp3 carries no Xing/LAME
  header (a stream cannot write one), so decoders keep LAME's delay (1105 samples) and its
  padding to a whole frame; an AAC keeps its 1024 samples of priming.
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
import io
import json
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np

from higgs_pack.runtime.audio import pcm_samples, streaming_wav_header
from higgs_pack.runtime.loop.words import words_json


@dataclass(frozen=True)
class Format:
    """One response format.

    Attributes:
        media_type: its Content-Type.
        container: FFmpeg's muxer for it (``ffmpeg -muxers``); None: bytes written here (pcm, wav).
        codec: FFmpeg's encoder (``ffmpeg -encoders``); None for pcm and wav.
        bit_rate: bits per second of a lossy codec; None: lossless.
        options: the muxer's options (FFmpeg's names and string values).
    """

    media_type: str
    container: str | None = None
    codec: str | None = None
    bit_rate: int | None = None
    options: dict[str, str] = field(default_factory=dict)


#: Response format -> how it is written, in OpenAI's order.  Bit rates are ours for 24 kHz mono
#: speech; ``write_xing`` 0: no Xing/LAME header, which only a file sought back into can fill in
#: (a whole mp3 is the stream's bytes); ``page_duration`` (microseconds): an Ogg page per 20 ms
#: Opus packet, not per second (FFmpeg's default), so a stream is not held back a second.
FORMATS: dict[str, Format] = {
    "mp3": Format("audio/mpeg", "mp3", "libmp3lame", 64_000, {"write_xing": "0"}),
    "opus": Format("audio/ogg", "ogg", "libopus", 32_000, {"page_duration": "20000"}),
    "aac": Format("audio/aac", "adts", "aac", 64_000),
    "flac": Format("audio/flac", "flac", "flac"),
    "wav": Format("audio/wav"),
    "pcm": Format("audio/pcm"),
}
#: The format of a request that names none: OpenAI's default.
DEFAULT_FORMAT = "mp3"
#: Formats whose bytes are the 16-bit samples themselves (after a WAV header): what a live
#: session's binary messages carry.
PCM_FORMATS = ("pcm", "wav")


def media_type(response_format: str) -> str:
    """The Content-Type of ``response_format``."""
    return FORMATS[response_format].media_type


def encode_whole(samples: np.ndarray, sample_rate: int, response_format: str) -> bytes:
    """A whole file of float32 [n] mono samples (clipped to [-1, 1], as a stream clips them).

    The same encoder as a stream's (:class:`StreamEncoder`), fed everything at once; a WAV's header
    has its sizes.

    Args:
        samples: float32 [n], nominally in [-1, 1].
        sample_rate: Hz (24000).
        response_format: a key of :data:`FORMATS`.
    """
    encoder = StreamEncoder(response_format, sample_rate, whole=True)
    head = encoder.start()
    body = encoder.chunk(samples) + encoder.finish()
    if response_format == "wav":  # the header with its sizes, not the stream's open ones
        head = streaming_wav_header(sample_rate, samples=encoder.samples_in)
    return head + body


class _Pipe:
    """A write-only file for PyAV: what the muxer wrote since the last :meth:`take`.  It has no
    ``seek``, so the muxer writes front to back, as into a pipe."""

    def __init__(self) -> None:
        self.parts: list[bytes] = []

    def write(self, data: Any) -> int:
        self.parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out, self.parts = b"".join(self.parts), []
        return out


class StreamEncoder:
    """Bytes of an answer, chunk by chunk: :meth:`start` once, :meth:`chunk` per piece of audio,
    :meth:`finish` once.  Joined, they are a whole file of ``response_format``.

    pcm and wav are written here; the others by FFmpeg's encoder and muxer through PyAV
    (:data:`FORMATS`), each packet handed on as soon as the encoder makes it (a lossy encoder
    holds back a frame or two of lookahead until :meth:`finish`).

    Args:
        response_format: a key of :data:`FORMATS`.
        sample_rate: Hz.
        whole: the file is written at once, into memory that can be sought back into (a FLAC
            header then gets its length and MD5); False: as a stream, front to back.

    Raises:
        ValueError: an unknown ``response_format``.
    """

    def __init__(self, response_format: str, sample_rate: int, *, whole: bool = False):
        if response_format not in FORMATS:
            raise ValueError(f"response_format must be one of {', '.join(FORMATS)}, got {response_format!r}")
        self.response_format, self.sample_rate = response_format, sample_rate
        self.bytes_sent = self.samples_in = 0
        spec = FORMATS[response_format]
        self._container = self._stream = None
        if spec.container is not None:
            import av

            self._out: Any = io.BytesIO() if whole else _Pipe()
            # flush_packets: each packet leaves the muxer's buffer at once; bitexact: no random Ogg
            # serial number or encoder tag, so the same audio gives the same bytes.
            self._container = av.open(self._out, "w", format=spec.container,
                                      options={"flush_packets": "1", "fflags": "+bitexact", **spec.options})
            self._stream = self._container.add_stream(spec.codec, rate=sample_rate, layout="mono")
            if spec.bit_rate is not None:
                self._stream.bit_rate = spec.bit_rate

    def start(self) -> bytes:
        """The bytes before any audio: a WAV header of open length, or nothing (a muxer's header
        comes with the first audio)."""
        head = streaming_wav_header(self.sample_rate) if self.response_format == "wav" else b""
        self.bytes_sent += len(head)
        return head

    def chunk(self, samples: np.ndarray) -> bytes:
        """The bytes of float32 [n] samples (clipped to [-1, 1]): 16-bit little-endian PCM for pcm
        and wav; else the packets the encoder made of them (maybe none yet)."""
        pcm = pcm_samples(np.clip(np.asarray(samples, dtype=np.float32).reshape(-1), -1.0, 1.0))
        if self._container is None:
            data = pcm.tobytes()
        else:
            import av

            frame = av.AudioFrame.from_ndarray(pcm.reshape(1, -1), format="s16", layout="mono")
            frame.sample_rate, frame.time_base, frame.pts = self.sample_rate, Fraction(1, self.sample_rate), self.samples_in
            data = self._encode(frame) if pcm.size else b""
        self.samples_in += pcm.size
        self.bytes_sent += len(data)
        return data

    def finish(self) -> bytes:
        """The last bytes: the encoder's held frames and the muxer's trailer (nothing for pcm and wav)."""
        if self._container is None:
            return b""
        data = self._encode(None)
        self._container.close()
        self._container = None
        data += self._out.getvalue() if isinstance(self._out, io.BytesIO) else self._out.take()
        self.bytes_sent += len(data)
        return data

    def _encode(self, frame: Any) -> bytes:
        for packet in self._stream.encode(frame):
            self._container.mux(packet)
        return self._out.take() if isinstance(self._out, _Pipe) else b""


def decode_with_ffmpeg(data: bytes, max_seconds: float) -> tuple[np.ndarray, int] | None:
    """A clip libsndfile cannot read (AAC in ADTS or MP4, say: what this server itself writes for
    ``response_format`` aac), decoded by FFmpeg through PyAV: its first audio stream, channels mixed
    to mono, at its own rate; decoding stops once past ``max_seconds``, so a long file costs no more
    than a clip.

    Returns:
        ``(float32 [samples] in [-1, 1], sample rate in Hz)``, or None when FFmpeg finds no audio
        it can decode.
    """
    import av

    try:
        with av.open(io.BytesIO(data)) as container:
            stream = next((s for s in container.streams if s.type == "audio"), None)
            if stream is None or not stream.rate:
                return None
            resampler = av.AudioResampler(format="flt", layout="mono", rate=stream.rate)
            pieces: list[np.ndarray] = []
            cap, total = int(max_seconds * stream.rate) + 1, 0
            for frame in container.decode(stream):
                for out in resampler.resample(frame):
                    pieces.append(out.to_ndarray().reshape(-1))
                    total += len(pieces[-1])
                if total >= cap:
                    break
            pieces += [out.to_ndarray().reshape(-1) for out in resampler.resample(None)]
    except (av.error.FFmpegError, ValueError):
        return None
    if not pieces:
        return None
    return np.concatenate(pieces).astype(np.float32, copy=False), int(stream.rate)


def sse_event(event: dict[str, Any]) -> bytes:
    """One server-sent event: ``data: <json>`` and a blank line."""
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def sse_delta(audio: bytes) -> bytes:
    """A ``speech.audio.delta`` event carrying ``audio`` base64-encoded."""
    return sse_event({"type": "speech.audio.delta", "audio": base64.b64encode(audio).decode("ascii")})


def segment_json(segment: Any) -> dict[str, Any]:
    """A :class:`~higgs_pack.runtime.loop.synthesis.Segment` as JSON: ``text``, ``start`` and ``end``
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

"""The load test's requests (:class:`Job`), references (:class:`Expected`), what a client saw
(:class:`Observed`) and the judge of an answer (:func:`check`, a :class:`Verdict` in
:data:`CATEGORIES`).  Frames of 960 samples at 24 kHz; 16-bit little-endian PCM.
"""

from __future__ import annotations

import hashlib
import io
import json
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

FRAME_SAMPLES = 960
SAMPLE_RATE = 24000
#: ok: complete audio of the reference length; length_differs: complete, another length (an int4
#: request's codes can depend on the rows sharing its steps; alone it is truncated or malformed);
#: rejected: 429 queue_full while the queue was full; error: another status with OpenAI's error
#: body; lost: no answer; truncated: audio that broke off; malformed: not what it says;
#: unjustified_429: a 429 while fewer than max_batch + max_queue others were out, or not queue_full.
CATEGORIES = ("ok", "length_differs", "rejected", "error", "lost", "truncated", "malformed", "unjustified_429")
#: The categories the goals allow none of.
FAILURES = ("lost", "truncated", "malformed", "unjustified_429")
#: The fields of each answer a level keeps (``answers``): times in ms from the level's first send.
ANSWER_COLUMNS = ("job", "stream", "status", "category", "sent_ms", "latency_ms", "first_audio_ms", "frames",
                  "retry_after_s")


@dataclass(frozen=True)
class Job:
    """One request of the pool: its index (also its seed), text, a PCM stream or a whole WAV, frames."""

    index: int
    text: str
    seed: int
    stream: bool
    frames: int

    def body(self, model: str) -> dict[str, Any]:
        """The ``POST /v1/audio/speech`` body."""
        return {"model": model, "input": self.text, "voice": "default", "seed": self.seed,
                "max_new_tokens": self.frames, "response_format": "pcm" if self.stream else "wav",
                **({"stream_format": "audio"} if self.stream else {})}


@dataclass(frozen=True)
class Expected:
    """A job's reference (the engine, one request at a time): samples and the sha256 of their PCM."""

    samples: int
    sha256: str


@dataclass
class Observed:
    """What a client saw of one request: status (None: no answer), headers, body, the transport
    error, ``time.monotonic()`` at the send, first audio byte and end, and ``peak_others`` (most
    other requests out at once meanwhile)."""

    job: Job
    status: int | None = None
    content_type: str = ""
    retry_after: str | None = None
    body: bytes = b""
    error: str | None = None
    started: float = 0.0
    first_audio: float | None = None
    ended: float = 0.0
    peak_others: int = 0


@dataclass(frozen=True)
class Verdict:
    """How one answer counts: a category, why, its frames and whether its PCM equals the reference's."""

    category: str
    detail: str = ""
    frames: float = 0.0
    exact: bool = False


def case_texts(cases: Path) -> list[str]:
    """The non-empty lines of the cases' English and Chinese texts; InputError when there are none."""
    texts = [line.strip() for name in ("text_en_basic.txt", "text_zh.txt") if (cases / name).is_file()
             for line in (cases / name).read_text(encoding="utf-8").splitlines() if line.strip()]
    if not texts:
        from higgs_pack.errors import InputError

        raise InputError(f"no texts in {cases} (text_en_basic.txt, text_zh.txt); give --cases or $HIGGS_PACK_CASES")
    return texts


def request_pool(texts: Sequence[str], size: int, frames: int) -> list[Job]:
    """``size`` jobs: text ``i mod len(texts)``, seed ``i``, whole and streamed in turn (shifted by
    one each pass over an even number of texts, so every text is asked both ways)."""
    shift = len(texts) % 2 == 0
    return [Job(i, texts[i % len(texts)], i, (i + (i // len(texts) if shift else 0)) % 2 == 1, frames)
            for i in range(size)]


def pcm16(samples: np.ndarray) -> bytes:
    """Float samples as the server sends them: clipped to [-1, 1], 16-bit little-endian."""
    from higgs_pack.runtime.audio import pcm_samples

    return pcm_samples(np.clip(np.asarray(samples, dtype=np.float32).reshape(-1), -1.0, 1.0)).tobytes()


def check(obs: Observed, expected: Expected | None, capacity: int | None, *, alone: bool = False) -> Verdict:
    """Judge one answer against the job's reference (None: length not compared) and the server's
    ``max_batch + max_queue`` (None: a 429 is not judged by it); ``alone``: no other request was out."""
    if obs.status is None:
        return Verdict("lost", obs.error or "no answer")
    if obs.status == 200:
        if obs.error:
            return Verdict("truncated", f"the body broke off after {len(obs.body)} bytes: {obs.error}")
        return _check_audio(obs, expected, alone)
    try:
        error = json.loads(obs.body).get("error")
    except (ValueError, UnicodeDecodeError, AttributeError):
        error = None
    if not (isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error)
            and isinstance(error["message"], str) and error["message"]):
        return Verdict("malformed", f"status {obs.status} without OpenAI's error body: {obs.body[:160]!r}"
                       + (f" ({obs.error})" if obs.error else ""))
    if obs.status != 429:
        return Verdict("error", f"{obs.status} {error.get('code')}: {str(error.get('message'))[:160]}")
    if error.get("code") != "queue_full" or not (obs.retry_after or "").isdigit():
        return Verdict("unjustified_429", f"429 with code {error.get('code')!r} and Retry-After {obs.retry_after!r} "
                       "(expected queue_full and whole seconds)")
    if capacity is not None and obs.peak_others < capacity:
        return Verdict("unjustified_429", f"429 queue_full while at most {obs.peak_others} other requests were out "
                       f"(the queue holds {capacity})")
    return Verdict("rejected", f"429 queue_full, Retry-After {obs.retry_after} s")


def _check_audio(obs: Observed, expected: Expected | None, alone: bool) -> Verdict:
    job, want = obs.job, "audio/pcm" if obs.job.stream else "audio/wav"
    if not obs.content_type.startswith(want):
        return Verdict("malformed", f"Content-Type {obs.content_type!r}, expected {want}")
    if job.stream and len(obs.body) % 2:
        return Verdict("truncated", f"{len(obs.body)} bytes of 16-bit PCM: it broke off inside a sample")
    pcm, problem = (obs.body, "") if job.stream else wav_pcm(obs.body)
    if problem:
        return Verdict("truncated" if problem.startswith("short") else "malformed", problem)
    samples = len(pcm) // 2
    frames = samples / FRAME_SAMPLES
    if samples == 0:
        return Verdict("malformed", "no audio samples")
    if expected is None:
        return Verdict("ok", "", frames)
    if samples == expected.samples:
        return Verdict("ok", "", frames, hashlib.sha256(pcm).hexdigest() == expected.sha256)
    what = f"{samples} samples, the reference has {expected.samples}"
    if samples > job.frames * FRAME_SAMPLES * 2:
        return Verdict("malformed", f"{what}: more than the {job.frames} frames asked")
    if alone:
        return Verdict("truncated" if samples < expected.samples else "malformed", f"{what}, with no other request out")
    return Verdict("length_differs", what, frames)


def wav_pcm(data: bytes) -> tuple[bytes, str]:
    """A whole WAV's 16-bit PCM and "" or what is wrong: its ``data`` chunk must be there in full
    ("short: ..." otherwise), 16-bit PCM mono at 24 kHz, and read by libsndfile to the same samples."""
    import soundfile as sf

    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return b"", f"not a RIFF/WAVE file ({len(data)} bytes, starts {data[:12]!r})"
    pos, fmt = 12, None
    while pos + 8 <= len(data):
        tag, size = data[pos:pos + 4], struct.unpack("<I", data[pos + 4:pos + 8])[0]
        body = data[pos + 8:pos + 8 + size]
        if tag == b"fmt ":
            fmt = struct.unpack("<HHIIHH", body[:16]) if len(body) >= 16 else None
        elif tag == b"data":
            if len(body) < size:
                return b"", f"short: the data chunk declares {size} bytes and {len(body)} came"
            if fmt is None or fmt[0] != 1 or fmt[1] != 1 or fmt[2] != SAMPLE_RATE or fmt[5] != 16:
                return b"", f"format {fmt} is not 16-bit PCM mono at {SAMPLE_RATE} Hz"
            try:
                read, rate = sf.read(io.BytesIO(data), dtype="int16")
            except (RuntimeError, sf.LibsndfileError) as exc:
                return b"", f"libsndfile cannot read it: {exc}"
            if rate != SAMPLE_RATE or read.ndim != 1 or read.astype("<i2").tobytes() != body:
                return b"", "libsndfile reads other samples than the data chunk holds"
            return body, ""
        pos += 8 + size + (size & 1)
    return b"", "short: no complete data chunk" if fmt is not None else "no fmt and data chunks"

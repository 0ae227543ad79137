"""Streaming codec decoding with the bundle's stateful decoder (sub-part ``audio_tokenizer_stream``).

:class:`StatefulCodec` feeds a stream's frames of codes to the stateful decoder once each, keeps its
state (the convolutions' cached left context, float32 [S]) between calls, and returns the audio as
soon as the decoder's lookahead allows: the decoder's output is the one-shot waveform delayed by
``delay_samples`` (``exporters/pytorch/stream_codec.py`` says why), so the first
``delay_samples`` samples it returns are dropped, and at the end ``ceil(delay_samples / hop)`` pad
frames are fed with ``end_frame`` set, which the decoder reads as its zero padding.  Joined, the
pieces equal one-shot decoding of the same codes within the codec's parity limit
(:func:`stream_decode` measures it; verification judges it, ``runtime/verification/report.py``).

Bundles built before the sub-part existed stream with windows that recompute their context
(:class:`higgs_pack.runtime.loop.chunking.StreamingCodec`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

#: ``end_frame`` while a stream's end is not known: 2^20 frames (11.6 h at 25 fps), so that a position
#: times 960 stays inside int32 (OpenVINO's CPU plugin computes int64 tensors as int32: with 2^40 the
#: mask overflowed and zeroed every sample, measured).  Also the longest stream the decoder takes.
OPEN_END = 1 << 20

#: Frames a stream's codec is fed at a time while its next chunk is not yet due
#: (:class:`StatefulCodec`), so that a chunk's decoding is spread over the decoder steps that make its
#: frames instead of one run when the chunk is due.  Such a run beside a batch's steps shares the
#: cores with them: a stream joining a batch of 4 at full size decoded its first chunk (20 frames, 10
#: of them lookahead) in one 410-655 ms run, and the running rows waited 2.0-3.4 of their steps for
#: a frame meanwhile (issue 39's trace, Intel Xeon, 2 vCPUs).  ``None`` feeds only when a chunk is due.
FEED_FRAMES: int | None = 4


class Step(Protocol):
    """``step(codes, start_frame, end_frame, state, first_audio=False)``: int64 codes [T, N] of one
    stream, its frame offset and end, float32 state [S] -> (float32 samples [T * hop], new state [S]).
    ``first_audio`` is True on the call after which the stream returns its first audio (what its
    listener waits for: the engine's codec thread tells its engine, ``CodecBatcher.first_steps``)."""

    def __call__(self, codes: np.ndarray, start: int, end: int, state: np.ndarray, first_audio: bool = False,
                 ) -> tuple[np.ndarray, np.ndarray]: ...


@dataclass(frozen=True)
class StreamCodecSpec:
    """What the runtime reads from the manifest's ``audio_tokenizer_stream`` options.

    Attributes:
        lookahead_frames: frames of codes past a frame before its audio is complete.
        delay_samples: samples the decoder's output lags the one-shot waveform (<= lookahead * hop).
        state_size: S, float32 values of state per stream.
        hop: samples per frame (960).
    """

    lookahead_frames: int
    delay_samples: int
    state_size: int
    hop: int

    @classmethod
    def from_options(cls, options: dict[str, Any], hop: int) -> StreamCodecSpec:
        return cls(int(options["lookahead_frames"]), int(options["delay_samples"]), int(options["state_size"]),
                   int(hop))

    @property
    def pad_frames(self) -> int:
        """Frames fed after the last one so that its audio comes out."""
        return math.ceil(self.delay_samples / self.hop)

    @property
    def first_frames(self) -> int:
        """Frames needed before the first call returns at least one frame of audio."""
        return math.ceil((self.delay_samples + self.hop) / self.hop)


def first_call_feeds(codes: np.ndarray, state_size: int) -> dict[str, np.ndarray]:
    """The ``audio_tokenizer_stream`` feeds of a new stream's first call on int64 codes [B, N, T]
    (zero state, start 0, end unknown)."""
    rows = codes.shape[0]
    return {"audio_codes": np.ascontiguousarray(codes, dtype=np.int64),
            "start_frame": np.zeros(rows, dtype=np.int64), "end_frame": np.full(rows, OPEN_END, dtype=np.int64),
            "codec_state": np.zeros((rows, int(state_size)), dtype=np.float32)}


def runner_step(run: Callable[[dict[str, np.ndarray]], dict[str, np.ndarray]]) -> Step:
    """A :data:`Step` that runs the sub-part's runner on one row."""

    def step(codes: np.ndarray, start: int, end: int, state: np.ndarray, first_audio: bool = False,
             ) -> tuple[np.ndarray, np.ndarray]:
        out = run({"audio_codes": np.ascontiguousarray(codes.T[None], dtype=np.int64),
                   "start_frame": np.array([start], dtype=np.int64), "end_frame": np.array([end], dtype=np.int64),
                   "codec_state": state[None].astype(np.float32, copy=False)})
        return out["waveform"].reshape(-1), out["codec_state_out"][0]

    return step


class StatefulCodec:
    """Decodes one stream's frames as they arrive, each frame once (same interface as
    :class:`~higgs_pack.runtime.loop.chunking.StreamingCodec`).

    A chunk is due once the schedule's next size of audio can be complete: for the first, its
    frames plus the decoder's lookahead (:attr:`StreamCodecSpec.first_frames` - 1) have arrived;
    then each further size of frames.  The push that makes a chunk due returns exactly that chunk's
    audio (``first_chunk_frames`` means the same with either codec: the audio of the first chunk,
    not the frames fed; a remainder of the delay short of a frame waits for the next chunk, so
    every piece but the last is whole frames).  Until then the decoder is fed ``feed_frames`` at
    a time (:data:`FEED_FRAMES`) and keeps what it made, so the push that makes a chunk due
    decodes only the frames since the last feed: a chunk's decoding is spread over the steps that
    make it, not run at once when it is due.

    Args:
        step: one decoder call (:func:`runner_step`, or the engine's batched one).
        spec: the decoder's lookahead, delay and state size.
        schedule: frames of audio per chunk (:func:`~higgs_pack.runtime.loop.chunking.chunk_schedule`).
        feed_frames: frames per call before a chunk is due (>= 1); ``None`` feeds only when a chunk
            is due (one call per chunk); default :data:`FEED_FRAMES`.

    Attributes:
        fed: frames given to the decoder so far.
        calls: decoder calls so far.

    Raises:
        ValueError: ``feed_frames`` below 1.
    """

    def __init__(self, step: Step, spec: StreamCodecSpec, schedule: Iterator[int],
                 feed_frames: int | None = FEED_FRAMES):
        if feed_frames is not None and feed_frames < 1:
            raise ValueError(f"feed_frames must be None or >= 1, got {feed_frames}")
        self._step, self.spec, self._schedule, self.feed_frames = step, spec, schedule, feed_frames
        self._state = np.zeros(spec.state_size, dtype=np.float32)
        self._codes: list[np.ndarray] = []
        self._due = spec.first_frames - 1 + max(1, int(next(schedule)))  # frames when the next chunk is due
        self.fed = 0
        self.calls = 0
        self._skip = spec.delay_samples  # delayed samples still to drop
        self._held = np.zeros(0, dtype=np.float32)  # decoded samples not returned yet
        self._out = 0  # samples returned

    @property
    def frames(self) -> int:
        return len(self._codes)

    def push(self, frame: np.ndarray) -> np.ndarray | None:
        """Add one frame (int64 [N]); return float32 samples (whole frames: the first chunk, then
        each chunk of the schedule) when a chunk is due, else None (the frames may have been fed)."""
        self._codes.append(np.asarray(frame, dtype=np.int64))
        due = self.frames >= self._due
        if due or (self.feed_frames is not None and self.frames - self.fed >= self.feed_frames):
            made = self._feed(np.stack(self._codes[self.fed:]), OPEN_END, first_audio=due and self._out == 0)
            self._held = np.concatenate([self._held, made])
        if not due:
            return None
        samples = self._held
        whole = len(samples) // self.spec.hop * self.spec.hop
        self._held = samples[whole:]
        self._out += whole
        self._due += max(1, int(next(self._schedule)))
        return samples[:whole]

    def finish(self, codes: np.ndarray) -> np.ndarray:
        """Decode the rest, given all frames of the utterance (int64 [T, N]).

        Returns:
            float32 samples from the end of the last piece returned to ``T * hop``.

        Raises:
            ValueError: ``codes`` does not start with the frames pushed.
        """
        codes = np.asarray(codes, dtype=np.int64)
        pushed = self.frames
        if len(codes) < pushed or (pushed and not np.array_equal(codes[:pushed], np.stack(self._codes))):
            raise ValueError("the final codes do not start with the frames streamed so far")
        total, before = len(codes), self._out
        pieces = [self._held]
        self._held = self._held[:0]
        if total > self.fed:
            pieces.append(self._feed(codes[self.fed:], total))
        if total and before + sum(len(p) for p in pieces) < total * self.spec.hop:
            pad = np.zeros((self.spec.pad_frames, codes.shape[1]), dtype=np.int64)
            pieces.append(self._feed(pad, total))
        self._codes = list(codes)
        out = np.concatenate(pieces)
        self._out = max(before, total * self.spec.hop)
        return out[:max(total * self.spec.hop - before, 0)].astype(np.float32, copy=False)

    def _feed(self, codes: np.ndarray, end: int, first_audio: bool = False) -> np.ndarray:
        samples, self._state = self._step(codes, self.fed, end, self._state, first_audio=first_audio)
        self.fed += len(codes)
        self.calls += 1
        drop = min(self._skip, len(samples))
        self._skip -= drop
        return samples[drop:].astype(np.float32, copy=False)


def stream_decode(step: Step, spec: StreamCodecSpec, codes: np.ndarray, sizes: Iterator[int],
                  feed_frames: int | None = None) -> np.ndarray:
    """Decode ``codes`` (int64 [T, N]) through a :class:`StatefulCodec`, pushing frame by frame
    with chunks of ``sizes`` frames after the first (fed ``feed_frames`` at a time, default one
    call per chunk); returns the joined float32 samples [T * hop]."""
    codec = StatefulCodec(step, spec, sizes, feed_frames)
    pieces = [p for frame in codes if (p := codec.push(frame)) is not None]
    pieces.append(codec.finish(codes))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)

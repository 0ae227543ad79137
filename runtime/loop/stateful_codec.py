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
from typing import Any

import numpy as np

#: ``end_frame`` while a stream's end is not known: 2^20 frames (11.6 h at 25 fps), so that a position
#: times 960 stays inside int32 (OpenVINO's CPU plugin computes int64 tensors as int32: with 2^40 the
#: mask overflowed and zeroed every sample, measured).  Also the longest stream the decoder takes.
OPEN_END = 1 << 20

Step = Callable[[np.ndarray, int, int, np.ndarray], tuple[np.ndarray, np.ndarray]]
"""``step(codes, start_frame, end_frame, state)``: int64 codes [T, N] of one stream, its frame
offset and end, float32 state [S] -> (float32 samples [T * hop], new state [S])."""


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

    def step(codes: np.ndarray, start: int, end: int, state: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        out = run({"audio_codes": np.ascontiguousarray(codes.T[None], dtype=np.int64),
                   "start_frame": np.array([start], dtype=np.int64), "end_frame": np.array([end], dtype=np.int64),
                   "codec_state": state[None].astype(np.float32, copy=False)})
        return out["waveform"].reshape(-1), out["codec_state_out"][0]

    return step


class StatefulCodec:
    """Decodes one stream's frames as they arrive, each frame once (same interface as
    :class:`~higgs_pack.runtime.loop.chunking.StreamingCodec`).

    The first call is made once the schedule's first size of frames, plus the decoder's lookahead
    (:attr:`StreamCodecSpec.first_frames` - 1), have arrived, and returns that many frames of audio
    (``first_chunk_frames`` means the same with either codec: the audio of the first chunk, not the
    frames fed); later calls take the next scheduled number of frames and return as many frames of
    audio (a remainder of the delay short of a frame waits for the next call, so every piece but the
    last is whole frames).

    Args:
        step: one decoder call (:func:`runner_step`, or the engine's batched one).
        spec: the decoder's lookahead, delay and state size.
        schedule: frames of audio per call (:func:`~higgs_pack.runtime.loop.chunking.chunk_schedule`).

    Attributes:
        fed: frames given to the decoder so far.
        calls: decoder calls so far.
    """

    def __init__(self, step: Step, spec: StreamCodecSpec, schedule: Iterator[int]):
        self._step, self.spec, self._schedule = step, spec, schedule
        self._state = np.zeros(spec.state_size, dtype=np.float32)
        self._codes: list[np.ndarray] = []
        self._next = spec.first_frames - 1 + max(1, int(next(schedule)))
        self.fed = 0
        self.calls = 0
        self._skip = spec.delay_samples  # delayed samples still to drop
        self._held = np.zeros(0, dtype=np.float32)  # decoded samples short of a whole frame
        self._out = 0  # samples returned

    @property
    def frames(self) -> int:
        return len(self._codes)

    def push(self, frame: np.ndarray) -> np.ndarray | None:
        """Add one frame (int64 [N]); return float32 samples (whole frames: the first call's one
        frame, then each call's frames) when a call was due, else None."""
        self._codes.append(np.asarray(frame, dtype=np.int64))
        if self.frames - self.fed < self._next:
            return None
        samples = np.concatenate([self._held, self._feed(np.stack(self._codes[self.fed:]), OPEN_END)])
        whole = len(samples) // self.spec.hop * self.spec.hop
        self._held = samples[whole:]
        self._out += whole
        self._next = max(1, int(next(self._schedule)))
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

    def _feed(self, codes: np.ndarray, end: int) -> np.ndarray:
        samples, self._state = self._step(codes, self.fed, end, self._state)
        self.fed += len(codes)
        self.calls += 1
        drop = min(self._skip, len(samples))
        self._skip -= drop
        return samples[drop:].astype(np.float32, copy=False)


def stream_decode(step: Step, spec: StreamCodecSpec, codes: np.ndarray, sizes: Iterator[int]) -> np.ndarray:
    """Decode ``codes`` (int64 [T, N]) through a :class:`StatefulCodec`, pushing frame by frame
    with calls of ``sizes`` frames after the first; returns the joined float32 samples [T * hop]."""
    codec = StatefulCodec(step, spec, sizes)
    pieces = [p for frame in codes if (p := codec.push(frame)) is not None]
    pieces.append(codec.finish(codes))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.float32)

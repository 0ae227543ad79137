"""Decoding a sequence in windows that give the same output as one pass over all of it.

Two users share this one mechanism: the codec decoder of a static-shape (NPU)
bundle, whose graph takes a fixed number of frames (``OvStaticSubPart``), and
streaming synthesis, which decodes codec frames while the decoder is still
generating them (:class:`StreamingCodec`).  Both cut the frame axis into
*cores* that tile the input and decode each core with ``context`` real frames
of neighbours on each side (fewer at the ends of the input); only the core's
output is kept.

``context`` comes from the codec's receptive field: how far, in frames, one
changed input frame changes the output (:func:`receptive_reach`).  Builds
measure it on the PyTorch codec and record ``reach + 1`` in the manifest
(``subparts.audio_tokenizer.options.stream_context_frames``; static bundles also
in ``options.chunking.context``); bundles built before that have it measured
on the exported codec when first needed (:func:`~higgs_pack.runtime.loop.streaming.codec_context_frames`), with
the same function.

Why a window with ``context >= reach`` gives the one-pass output on its core:
an output frame depends only on inputs within ``reach`` frames of it, and a
layer's zero padding at a window edge stands in for activations that are
themselves at least ``reach`` frames from the core (the receptive cone of every
intermediate layer lies inside the whole network's).  One frame more than the
measured reach covers upsampling layers whose outputs straddle a frame.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np

#: Frames of the random probe decoded to measure a codec's reach (doubled until the
#: reach stays clear of the probe's ends).
PROBE_FRAMES = 64
#: Longest probe tried before giving up (a codec whose reach exceeds this is not local).
MAX_PROBE_FRAMES = 1024


class NotLocalError(ValueError):
    """The output depends on inputs farther away than the probe can show."""


def receptive_reach(run: Callable[[np.ndarray], np.ndarray], example: np.ndarray, axis: int, out_axis: int,
                    *, atol: float = 0.0) -> int:
    """How far (in input positions along ``axis``) one changed input position changes the output.

    Changes the example's middle position (floats +0.5; integers to the next value,
    wrapping at the example's maximum) and compares ``run`` on both inputs.

    Args:
        run: The model as a function of one array (numpy in, numpy out).
        example: An input whose length along ``axis`` leaves room for the reach on both
            sides (for a codec: int64 codes [1, N, T]).
        axis: The input's sequence axis.
        out_axis: The output's sequence axis (its length may be a multiple of the input's,
            e.g. ``T * 960`` samples for ``T`` frames).
        atol: Output changes up to this are ignored (0 for exact arithmetic; a small
            value where a backend's kernels round differently across a tile).

    Returns:
        The reach in input positions (0: no effect beyond the changed position).

    Raises:
        NotLocalError: The change reaches an end of the example (make it longer).
    """
    n = int(example.shape[axis])
    center = n // 2
    index: list[Any] = [slice(None)] * example.ndim
    index[axis] = center
    changed = np.array(example, copy=True)
    if np.issubdtype(changed.dtype, np.floating):
        changed[tuple(index)] += 0.5
    else:
        changed[tuple(index)] = (changed[tuple(index)] + 1) % (int(example.max()) + 1)
    base, other = np.asarray(run(example)), np.asarray(run(changed))
    diff = np.abs(other.astype(np.float64) - base.astype(np.float64))
    diff = np.moveaxis(diff, out_axis, 0).reshape(other.shape[out_axis], -1).max(axis=1)
    where = np.flatnonzero(diff > atol)
    if where.size == 0:
        return 0
    out_len = int(other.shape[out_axis])
    first = int(where.min()) * n // out_len
    last = -(-(int(where.max()) + 1) * n // out_len) - 1
    if first <= 0 or last >= n - 1:
        raise NotLocalError(
            f"the output changes at input positions {first}..{last} of {n} for a change at {center}: the "
            "receptive field reaches the ends of the probe"
        )
    return max(center - first, last - center)


def measure_codec_context(decode: Callable[[np.ndarray], np.ndarray], num_codebooks: int, codebook_size: int,
                          *, atol: float = 0.0, seed: int = 0) -> int:
    """Context frames a codec decoder needs per side: its measured reach + 1.

    Args:
        decode: int64 codes [1, N, T] -> waveform [1, 1, T * hop] (the ``audio_tokenizer``).
        num_codebooks: N.
        codebook_size: codes are drawn from ``0..codebook_size-1``.
        atol: See :func:`receptive_reach`.
        seed: Seed of the random probe codes.

    Raises:
        NotLocalError: The reach exceeds :data:`MAX_PROBE_FRAMES` / 2 (the codec mixes the
            whole sequence, so no window gives the one-pass output).
    """
    rng = np.random.default_rng(seed)
    frames = PROBE_FRAMES
    while True:
        codes = rng.integers(0, codebook_size, size=(1, num_codebooks, frames), dtype=np.int64)
        try:
            return receptive_reach(decode, codes, axis=2, out_axis=-1, atol=atol) + 1
        except NotLocalError:
            if frames >= MAX_PROBE_FRAMES:
                raise
            frames *= 2


def context_window(core_start: int, core_end: int, length: int, context: int) -> tuple[int, int]:
    """The input window ``[start, end)`` that decodes the core ``[core_start, core_end)``.

    ``context`` positions on each side, cut at ``0`` and at ``length`` (the input's
    real ends, where the one-pass output sees the same edge).
    """
    return max(0, core_start - context), min(length, core_end + context)


def chunk_windows(length: int, chunk: int, context: int = 0) -> list[tuple[int, int, int, int]]:
    """Cut ``length`` positions into windows of at most ``chunk`` for a static graph.

    Each window carries up to ``context`` positions of real neighbours on each side
    (fewer at the ends of the input); only its core is kept, and the cores tile
    ``[0, length)`` without gaps or overlaps. With ``context`` at least the graph's
    receptive field, every kept position sees the same inputs as in one pass over
    the whole input.

    Args:
        length: Positions of the real input (>= 1).
        chunk: Positions the static graph takes.
        context: Positions of context per side (``2 * context < chunk``).

    Returns:
        ``[(window_start, window_end, keep_start, keep_end), ...]`` in input positions.

    Raises:
        ValueError: ``length < 1`` or ``2 * context >= chunk``.
    """
    if length < 1 or chunk < 1:
        raise ValueError(f"need length >= 1 and chunk >= 1, got {length}, {chunk}")
    if length > chunk and 2 * context >= chunk:
        raise ValueError(f"context {context} leaves no core in a {chunk}-position chunk")
    windows, core = [], 0
    while core < length:
        start, _ = context_window(core, core, length, context)
        end = min(start + chunk, length)
        keep_end = end if end == length else end - context
        windows.append((start, end, core, keep_end))
        core = keep_end
    return windows


def chunk_schedule(first: int, growth: float, largest: int) -> Iterator[int]:
    """Core sizes in frames for streaming: ``first``, then each ``growth`` times the last, at most ``largest``.

    Raises:
        ValueError: ``first < 1``, ``growth < 1`` or ``largest < first``.
    """
    if first < 1 or not growth >= 1 or largest < first:
        raise ValueError(
            f"stream chunks need first_chunk_frames >= 1, chunk_growth >= 1 and max_chunk_frames >= "
            f"first_chunk_frames; got {first}, {growth}, {largest}"
        )
    size = float(first)
    while True:
        yield int(min(largest, math.floor(size)))
        size = min(float(largest), size * growth)


class StreamingCodec:
    """Codec-decodes frames as they arrive; the joined output equals one decode of all frames.

    Frames are pushed as the generation loop produces them.  A core of the next
    scheduled size is decoded once ``context`` frames beyond it have arrived (its
    right context), with ``context`` frames before it (its left context); the
    last frames are decoded by :meth:`finish`, where the input really ends.  At
    least one frame is always held back for :meth:`finish`, so the end of the
    audio is always in its output.

    Args:
        decode: int64 codes [T, N] -> float32 samples [T * hop] (``generate.decode_codes``).
        context: Frames of context per side (:func:`~higgs_pack.runtime.loop.streaming.codec_context_frames`).
        hop: Samples per frame (960).
        schedule: Core sizes in frames (:func:`chunk_schedule`).

    Attributes:
        frames: Frames pushed so far.
        done: Frames whose audio has been returned.
    """

    def __init__(self, decode: Callable[[np.ndarray], np.ndarray], context: int, hop: int,
                 schedule: Iterator[int]):
        self._decode, self.context, self.hop = decode, int(context), int(hop)
        self._schedule = schedule
        self._next = next(schedule)
        self._codes: list[np.ndarray] = []
        self.done = 0

    @property
    def frames(self) -> int:
        return len(self._codes)

    def push(self, frame: np.ndarray) -> np.ndarray | None:
        """Add one frame (int64 [N]); return float32 samples when a core became decodable, else None."""
        self._codes.append(frame)
        if self.frames < self.done + self._next + max(self.context, 1):
            return None
        out = self._window(self.done + self._next, self.done + self._next + self.context)
        self._next = next(self._schedule)
        return out

    def finish(self, codes: np.ndarray) -> np.ndarray:
        """Decode the rest, given all frames of the utterance.

        Args:
            codes: int64 [T, N], every frame (those pushed must be its first ones).

        Returns:
            float32 samples of frames ``done..T``.

        Raises:
            ValueError: ``codes`` does not start with the frames pushed.
        """
        pushed = np.asarray(self._codes, dtype=np.int64).reshape(-1, codes.shape[1]) if self._codes else None
        if pushed is not None and (len(codes) < len(pushed) or not np.array_equal(codes[: len(pushed)], pushed)):
            raise ValueError("the final codes do not start with the frames streamed so far")
        self._codes = list(codes)
        if self.done >= len(codes):
            return np.zeros(0, dtype=np.float32)
        return self._window(len(codes), len(codes))

    def _window(self, core_end: int, available: int) -> np.ndarray:
        start, end = context_window(self.done, core_end, available, self.context)
        window = np.asarray(self._codes[start:end], dtype=np.int64)
        samples = self._decode(window)
        out = samples[(self.done - start) * self.hop:(core_end - start) * self.hop]
        self.done = core_end
        return out

"""``speed``: speech made faster or slower without changing its pitch, and its timings to match.

The stretch is FFmpeg's ``atempo`` filter (a WSOLA-style overlap-add: it keeps the pitch) run
through PyAV's filter graph.  ``atempo`` takes a factor of 0.5 to 100, and FFmpeg's filter
documentation says a factor above 2 "will skip some samples rather than blend them in" and that
several instances may be "daisy-chained" instead (https://ffmpeg.org/ffmpeg-filters.html#atempo):
a ``speed`` outside 0.5-2.0 is a chain of factors each within it (:func:`atempo_factors`).

A stream and a whole answer go through the same :class:`TimeStretch`: ``atempo``'s output does
not depend on how its input was cut (measured: the same samples for one piece and for 13), and
its length is made exactly ``round(n / speed)`` for ``n`` samples in, so a sentence that ends at
``t`` seconds ends at ``t / speed`` (:func:`scale_spans`).
"""

from __future__ import annotations

import dataclasses
import math
from fractions import Fraction
from typing import Any, TypeVar

import numpy as np

#: The speeds a request may ask for: OpenAI's range for ``speed`` (openai-python
#: ``types/audio/speech_create_params.py``: "Select a value from `0.25` to `4.0`").
SPEED_RANGE = (0.25, 4.0)
#: The range of one ``atempo`` factor that blends every sample (see the module's docstring).
ATEMPO_RANGE = (0.5, 2.0)
#: Fields of a result (or a streamed piece) that hold timed spans: sentences' ``segments`` and,
#: where a result carries them, ``words``.
TIMED_FIELDS = ("segments", "words")

Span = TypeVar("Span")


def atempo_factors(speed: float) -> list[float]:
    """``speed`` as a chain of ``atempo`` factors, each in :data:`ATEMPO_RANGE`, whose product is
    ``speed`` (2.0, 2.0 for 4.0; 0.5, 0.5 for 0.25; 0.5, 0.6 for 0.3).

    Raises:
        ValueError: ``speed`` outside :data:`SPEED_RANGE` or not finite.
    """
    low, high = SPEED_RANGE
    if not (math.isfinite(speed) and low <= speed <= high):
        raise ValueError(f"speed must be from {low} to {high}, got {speed!r}")
    factors: list[float] = []
    rest = float(speed)
    while rest > ATEMPO_RANGE[1]:
        factors.append(ATEMPO_RANGE[1])
        rest /= ATEMPO_RANGE[1]
    while rest < ATEMPO_RANGE[0]:
        factors.append(ATEMPO_RANGE[0])
        rest /= ATEMPO_RANGE[0]
    return [*factors, rest]


class TimeStretch:
    """A pitch-keeping time stretch of float32 mono audio by ``speed``, piece by piece.

    :meth:`push` each piece as it is made and :meth:`finish` once; joined, what they return is
    exactly ``round(n / speed)`` samples for ``n`` pushed (``atempo``'s own output differs by up
    to a few of its windows, about 1000 samples at 0.25: the tail is cut, or padded with silence).
    Speed 1 is the samples themselves, untouched.

    Args:
        speed: from 0.25 to 4.0 (2.0: half as long).
        sample_rate: Hz.

    Raises:
        ValueError: ``speed`` outside :data:`SPEED_RANGE`.
    """

    def __init__(self, speed: float, sample_rate: int):
        factors = atempo_factors(speed)
        self.speed, self.sample_rate = float(speed), sample_rate
        self.samples_in = self.samples_out = 0
        self._held: list[np.ndarray] = []  # atempo's output beyond what round(samples_in / speed) allows yet
        self._graph = None if self.speed == 1.0 else _atempo_graph(factors, sample_rate)

    def _target(self) -> int:
        return round(self.samples_in / self.speed)

    def push(self, samples: np.ndarray) -> np.ndarray:
        """The stretched audio available after ``samples`` (float32 [n]; may be empty: ``atempo``
        holds a window before its first output)."""
        samples = np.asarray(samples, dtype=np.float32).reshape(-1)
        if self._graph is None:
            self.samples_in += samples.size
            self.samples_out += samples.size
            return samples
        import av

        if samples.size:
            frame = av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="flt", layout="mono")
            frame.sample_rate, frame.time_base, frame.pts = self.sample_rate, Fraction(1, self.sample_rate), self.samples_in
            self._graph.push(frame)
            self.samples_in += samples.size
        return self._release(self._pull(), self._target())

    def finish(self) -> np.ndarray:
        """The rest: ``atempo`` flushed, then cut or padded with silence to ``round(n / speed)``
        samples in all."""
        if self._graph is None:
            return np.zeros(0, np.float32)
        self._graph.push(None)
        target = self._target()
        out = self._release(self._pull(), target)
        self._graph = None
        short = target - self.samples_out
        self.samples_out += short
        return np.concatenate([out, np.zeros(short, np.float32)])

    def _pull(self) -> list[np.ndarray]:
        import av

        pieces = []
        while True:
            try:
                frame = self._graph.pull()
            except (av.BlockingIOError, av.EOFError):
                return pieces
            pieces.append(frame.to_ndarray().reshape(-1))

    def _release(self, pieces: list[np.ndarray], limit: int) -> np.ndarray:
        """What was held and ``pieces``, up to ``limit`` samples out in all; the rest held."""
        ready = np.concatenate([*self._held, *pieces]) if self._held or pieces else np.zeros(0, np.float32)
        room = max(limit - self.samples_out, 0)
        self._held = [ready[room:]] if ready.size > room else []
        out = ready[:room]
        self.samples_out += out.size
        return out


def _atempo_graph(factors: list[float], sample_rate: int) -> Any:
    """A configured PyAV filter graph: float mono at ``sample_rate`` -> ``atempo`` per factor -> out."""
    import av.filter

    graph = av.filter.Graph()
    node = graph.add_abuffer(format="flt", sample_rate=sample_rate, layout="mono", time_base=f"1/{sample_rate}")
    for factor in factors:
        tempo = graph.add("atempo", repr(factor))
        node.link_to(tempo)
        node = tempo
    node.link_to(graph.add("abuffersink"))
    graph.configure()
    return graph


def stretch(samples: np.ndarray, sample_rate: int, speed: float) -> np.ndarray:
    """``samples`` (float32 [n] mono) at ``speed``: float32 [round(n / speed)], the same pitch
    (one :class:`TimeStretch` fed all at once, as a stream feeds it piece by piece)."""
    tempo = TimeStretch(speed, sample_rate)
    return np.concatenate([tempo.push(samples), tempo.finish()])


def scale_spans(spans: Any, speed: float) -> list[Span]:
    """Timed spans at ``speed``: each a copy with ``start`` and ``end`` (seconds) divided by ``speed``.

    Takes any dataclass with ``start`` and ``end`` fields: a sentence's
    :class:`~higgs_pack.runtime.loop.synthesis.Segment` (its ``words`` scaled too), or a word's
    :class:`~higgs_pack.runtime.loop.words.Word`.

    Raises:
        TypeError: an item that is not a dataclass with ``start`` and ``end``.
    """
    out = []
    for span in spans:
        if not (dataclasses.is_dataclass(span) and hasattr(span, "start") and hasattr(span, "end")):
            raise TypeError(f"a timed span is a dataclass with start and end, got {type(span).__name__}")
        words = {"words": tuple(scale_spans(span.words, speed))} if getattr(span, "words", None) else {}
        out.append(dataclasses.replace(span, start=span.start / speed, end=span.end / speed, **words))
    return out


def retimed(item: Any, speed: float) -> Any:
    """A copy of the dataclass ``item`` (a result, a streamed piece) with each of its
    :data:`TIMED_FIELDS` that it has scaled by :func:`scale_spans`, kept as the same kind of
    sequence (a list stays a list, a tuple a tuple); ``item`` itself at speed 1."""
    if speed == 1.0:
        return item
    fields = {f.name for f in dataclasses.fields(item)}  # SynthesisResult.words: a property (its segments' words)
    changes = {name: type(getattr(item, name))(scale_spans(getattr(item, name), speed))
               for name in TIMED_FIELDS if name in fields}
    return dataclasses.replace(item, **changes)


def at_speed(result: Any, speed: float) -> Any:
    """A whole result (:class:`~higgs_pack.runtime.loop.synthesis.SynthesisResult`: ``samples``,
    ``sample_rate`` and timed spans) at ``speed``: its samples stretched (:func:`stretch`) and its
    :data:`TIMED_FIELDS` scaled to match (:func:`retimed`); ``result`` itself at speed 1."""
    if speed == 1.0:
        return result
    return dataclasses.replace(retimed(result, speed), samples=stretch(result.samples, result.sample_rate, speed))

"""The MusicGen-style delay pattern and sampling of Higgs-Audio-v3 codes.

Source (MODEL.md, "Generation loop"): codebook ``c`` lags ``c`` frames; BOC (1024)
fills the ramp at the start, EOC (1025) the ramp at the end; codes 0..1023 are
real codec entries.
"""

from __future__ import annotations

from dataclasses import dataclass
from numbers import Integral, Real

import numpy as np


def apply_delay(codes: np.ndarray, boc: int, eoc: int) -> np.ndarray:
    """Delay-pattern ``codes`` for feeding them to the model (voice-clone prompts).

    Args:
        codes: int64 [frames T, codebooks N], values 0..1023.
        boc, eoc: begin/end-of-codes ids.

    Returns:
        int64 [T + N - 1, N] where column ``c`` is the codes shifted down by ``c``
        rows, the rows above filled with BOC and the rows below with EOC.
    """
    frames, n = codes.shape
    out = np.empty((frames + n - 1, n), dtype=np.int64)
    for c in range(n):
        out[:c, c] = boc
        out[c : c + frames, c] = codes[:, c]
        out[c + frames :, c] = eoc
    return out


def undo_delay(delayed: np.ndarray, codebook_size: int) -> np.ndarray:
    """Invert :func:`apply_delay` on generated codes and keep real frames only.

    Args:
        delayed: int64 [steps S, codebooks N] as generated (BOC ramp first).
        codebook_size: 1024; values >= it (BOC, EOC) are not codec entries.

    Returns:
        int64 [frames, N] with frames = S - N + 1 (0 if S < N), where frame
        ``t`` codebook ``c`` is ``delayed[t + c, c]``.  Frames still holding a
        BOC/EOC in any codebook (an unfinished ramp) are dropped.
    """
    steps, n = delayed.shape
    frames = max(steps - n + 1, 0)
    out = np.empty((frames, n), dtype=np.int64)
    for c in range(n):
        out[:, c] = delayed[c : c + frames, c]
    valid = (out < codebook_size).all(axis=1)
    return out[valid]


@dataclass(frozen=True)
class SamplingOptions:
    """How each codebook's next code is drawn.

    Attributes:
        temperature: 0 means greedy (argmax); the model's authors' common default is
            0.8 (MODEL.md: greedy alone degenerates into a buzz on the real model).
        top_k: keep the k most likely codes (0 = all); default 50.
        top_p: nucleus mass in (0, 1]; 1.0 = off.
        seed: seed of the numpy PCG64 generator; same seed, same logits -> same codes.
        repeat_guard_frames: stop once codebook 0 repeats one code this many frames
            in a row (0 = off).
    """

    temperature: float = 0.8
    top_k: int = 50
    top_p: float = 1.0
    seed: int | None = 0
    repeat_guard_frames: int = 50

    def validate(self) -> SamplingOptions:
        """Raise ``ValueError`` naming the bad option and its allowed type and range."""
        for name in ("top_k", "repeat_guard_frames", "seed"):
            value = getattr(self, name)
            if not (value is None and name == "seed") and (isinstance(value, bool) or not isinstance(value, Integral)):
                raise ValueError(f"{name} must be a whole number, got {value!r} ({type(value).__name__})")
        for name in ("temperature", "top_p"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, Real):
                raise ValueError(f"{name} must be a number, got {value!r} ({type(value).__name__})")
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"seed must be >= 0 (numpy's PCG64 seeds are non-negative) or None, got {self.seed}")
        if not 0 <= self.temperature < float("inf"):
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.repeat_guard_frames < 0:
            raise ValueError(f"repeat_guard_frames must be >= 0, got {self.repeat_guard_frames}")
        return self


def sample_codes(
    logits: np.ndarray, allowed: np.ndarray, options: SamplingOptions, rng: np.random.Generator
) -> np.ndarray:
    """Draw one code per codebook.

    Args:
        logits: float32 [N, V] (V = 1026) for one frame.
        allowed: bool [N, V]; False entries can never be drawn.
        options: sampling options.
        rng: the request's generator (advanced by exactly N draws unless greedy).

    Returns:
        int64 [N].
    """
    # Selection (argmax, top-k) on the logits' own float32 values, which order exactly as their
    # float64 copies; only the k kept values are widened to float64 for the probabilities.
    x = np.where(allowed, logits, np.float32(-np.inf))
    if options.temperature == 0:
        return x.argmax(axis=-1).astype(np.int64)
    keep = None
    if 0 < options.top_k < x.shape[-1]:
        # Work on the k best codes only (kept in vocabulary order, so the draw is the
        # same as masking the rest): about half the per-frame sampling time.
        keep = np.sort(np.argpartition(x, -options.top_k, axis=-1)[:, -options.top_k :], axis=-1)
        x = np.take_along_axis(x, keep, axis=-1)
    x = x.astype(np.float64) / options.temperature
    x = x - x.max(axis=-1, keepdims=True)
    probs = np.exp(x)
    probs /= probs.sum(axis=-1, keepdims=True)
    if options.top_p < 1.0:
        order = np.argsort(-probs, axis=-1, kind="stable")
        sorted_p = np.take_along_axis(probs, order, axis=-1)
        drop_sorted = (np.cumsum(sorted_p, axis=-1) - sorted_p) >= options.top_p
        drop = np.zeros_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, axis=-1)
        probs = np.where(drop, 0.0, probs)
        probs /= probs.sum(axis=-1, keepdims=True)
    cdf = np.cumsum(probs, axis=-1)
    u = rng.random(probs.shape[0])[:, None] * cdf[:, -1:]
    index = np.minimum((cdf <= u).sum(axis=-1), probs.shape[-1] - 1)
    if keep is not None:
        index = keep[np.arange(len(index)), index]
    return index.astype(np.int64)

"""The MusicGen-style delay pattern and sampling of Higgs-Audio-v3 codes.

Source (MODEL.md, "Generation loop"): codebook ``c`` lags ``c`` frames; BOC (1024)
fills the ramp at the start, EOC (1025) the ramp at the end; codes 0..1023 are
real codec entries.
"""

from __future__ import annotations

import numpy as np

from higgs_pack.runtime.options import SamplingOptions


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


#: Largest top-k whose kept codes are gathered into [N, k] buffers (:class:`Sampler`); the
#: gather's index array is N * k int64, at most 8 KB for the 8 codebooks.
KEPT_CODES_MAX = 128


class Sampler:
    """Draws one code per codebook for every frame of a request, from buffers made once.

    All codebooks are sampled at once on the [N, V] logits (V = 1026), in float32 for
    the selection and float64 for the probabilities:

    1. disallowed codes get -inf (one add of a preallocated 0 / -inf mask);
    2. greedy (temperature 0): argmax;
    3. top-k: the k-th largest logit of each row (an in-place partition of a copy) is
       the threshold; the codes at or above it are kept.  Every code tied with the k-th
       largest is kept (an arbitrary pick among ties would depend on the partition
       algorithm);
    4. weights ``exp((x - max) / T)`` in float64 for the kept codes only;
    5. top-p (only when < 1; this step allocates): the smallest set of codes, most
       likely first, whose mass reaches ``top_p``;
    6. inverse CDF: with ``u`` from ``rng.random`` (N draws per frame), the code is the
       first whose cumulative weight exceeds ``u`` times the row's total.

    When every row keeps exactly k codes (no ties at the threshold, k at most
    :data:`KEPT_CODES_MAX`, top-p off: the default options), steps 4 and 6 run on the
    [N, k] kept codes gathered in vocabulary order; that gather allocates its index
    array, N * k int64 (3.2 KB at the default k = 50), the only array a draw allocates.
    Otherwise they run on all [N, V] codes with exact zeros for the others (a float64
    cumulative sum over 8 x 1026 codes costs ~35 us on an AVX2 CPU, over 8 x 50 ~2 us).
    Both give the same codes: zeros leave the running sums unchanged.

    Same logits, options and generator state give the same codes as drawing from the
    top-k codes alone in vocabulary order (the dense path checked on 5,400 random frames
    against the implementation before it, the kept path on 21,000 against the dense one;
    tests/test_loop_allocations.py and tests/test_delay.py check both).

    Args:
        allowed: bool [N, V]; False entries are never drawn.
        options: sampling options (checked when they were made).
    """

    def __init__(self, allowed: np.ndarray, options: SamplingOptions):
        self.options = options
        n, v = allowed.shape
        self._allowed = np.array(allowed, dtype=bool)
        self._mask = np.where(allowed, np.float32(0), np.float32(-np.inf)).astype(np.float32)
        self._k = options.top_k if 0 < options.top_k < v else 0
        self._x = np.empty((n, v), np.float32)
        self._part = np.empty((n, v), np.float32)
        self._kth = self._part[:, v - self._k : v - self._k + 1] if self._k else None
        # Comparisons against a per-row value run on full-size copies of it: a broadcast
        # [N, 1] operand makes the ufunc allocate iteration buffers (measured, numpy 2.4).
        self._row32 = np.empty((n, v), np.float32)
        self._row64 = np.empty((n, v), np.float64)
        self._keep = np.empty((n, v), bool)
        self._flags = np.empty((n, v), bool)
        self._max32 = np.empty((n, 1), np.float32)
        self._w = np.empty((n, v), np.float64)
        self._e = np.empty((n, v), np.float64)
        self._cdf = np.empty((n, v), np.float64)
        self._row = np.empty((n, 1), np.float64)
        self._total = self._cdf[:, v - 1 :]
        self._temperature = np.array(options.temperature, np.float64)
        self._zero = np.array(0.0, np.float64)
        self._below = np.empty((n, 1), np.float64)
        self._u = np.empty(n, np.float64)
        self._u_col = self._u[:, None]
        self._codes = np.empty(n, np.int64)
        # The [N, k] kept codes (see the class docstring): values, weights, running sums.
        k = self._k if self._k <= KEPT_CODES_MAX and options.top_p == 1.0 else 0
        self._kept = k
        self._kept_x = np.empty((n, k), np.float32)
        self._kept_w = np.empty((n, k), np.float64)
        self._kept_cdf = np.empty((n, k), np.float64)
        self._kept_row = np.empty((n, k), np.float64)
        self._kept_flags = np.empty((n, k), bool)
        self._kept_total = self._kept_cdf[:, k - 1 :]
        self._kept_at = np.empty(n, np.int64)
        self._row_start = np.arange(n, dtype=np.int64) * k
        self._row_base = np.arange(n, dtype=np.int64) * v

    def draw(self, logits: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Draw one code per codebook.

        Args:
            logits: float32 [N, V] for one frame (finite).
            rng: the request's generator (advanced by exactly N draws unless greedy).

        Returns:
            int64 [N]: a buffer of this sampler, overwritten by the next draw (copy to keep).
        """
        x = self._x
        np.add(logits, self._mask, out=x)
        if self.options.temperature == 0:
            return x.argmax(axis=-1, out=self._codes)
        keep = self._keep
        if self._k:
            np.copyto(self._part, x)
            self._part.partition(x.shape[-1] - self._k, axis=-1)
            np.copyto(self._row32, self._kth)
            np.greater_equal(x, self._row32, out=keep)
        else:
            np.copyto(keep, self._allowed)
        # (x - max) / T as the previous float64 code computed it: max(x / T) == max(x) / T.
        np.maximum.reduce(x, axis=-1, keepdims=True, out=self._max32)
        np.copyto(self._row, self._max32)
        np.divide(self._row, self._temperature, out=self._row)
        if self._kept and np.count_nonzero(keep) == keep.shape[0] * self._kept:
            return self._draw_kept(x, keep, rng)
        np.copyto(self._row64, self._row)
        w = self._w
        np.copyto(w, x)
        np.divide(w, self._temperature, out=w)
        np.subtract(w, self._row64, out=w)
        e = self._e
        e.fill(0.0)
        np.exp(w, out=e, where=keep)
        if self.options.top_p < 1.0:
            _nucleus(e, self.options.top_p)
        np.add.accumulate(e, axis=-1, out=self._cdf)
        return self._inverse_cdf(self._cdf, self._total, self._row64, self._flags, rng, self._codes)

    def _draw_kept(self, x: np.ndarray, keep: np.ndarray, rng: np.random.Generator) -> np.ndarray:
        """Steps 4 and 6 on the k kept codes of each row (exactly k per row), in vocabulary order."""
        at = np.flatnonzero(keep)  # N * k flat indices, row by row, each row ascending
        np.take(x, at, out=self._kept_x.reshape(-1), mode="clip")
        w = self._kept_w
        np.copyto(w, self._kept_x)
        np.divide(w, self._temperature, out=w)
        np.copyto(self._kept_row, self._row)
        np.subtract(w, self._kept_row, out=w)
        np.exp(w, out=w)
        np.add.accumulate(w, axis=-1, out=self._kept_cdf)
        pick = self._inverse_cdf(self._kept_cdf, self._kept_total, self._kept_row, self._kept_flags, rng,
                                 self._kept_at)
        np.add(pick, self._row_start, out=pick)
        np.take(at, pick, out=self._codes, mode="clip")
        return np.subtract(self._codes, self._row_base, out=self._codes)

    def _inverse_cdf(self, cdf: np.ndarray, total: np.ndarray, row: np.ndarray, flags: np.ndarray,
                     rng: np.random.Generator, out: np.ndarray) -> np.ndarray:
        """Step 6: per row, the first column whose running sum ``cdf`` ([N, C] float64, ``total``
        its last column) exceeds a uniform draw times the total; ``row`` and ``flags`` are [N, C]
        work buffers, ``out`` int64 [N] receives the columns."""
        # u * total, kept below the total (rounding could reach it) so a drawable code is found.
        rng.random(out=self._u)
        np.multiply(self._u_col, total, out=self._u_col)
        np.nextafter(total, self._zero, out=self._below)
        np.minimum(self._u_col, self._below, out=self._u_col)
        np.copyto(row, self._u_col)
        np.greater(cdf, row, out=flags)
        return flags.argmax(axis=-1, out=out)


def _nucleus(weights: np.ndarray, top_p: float) -> None:
    """Zero, in place, the codes outside each row's nucleus: codes ranked by weight (ties in
    vocabulary order) are dropped once the mass ranked above them reaches ``top_p``.

    Args:
        weights: float64 [N, V] non-negative; normalised in place to sum to 1 per row.
    """
    weights /= weights.sum(axis=-1, keepdims=True)
    order = np.argsort(-weights, axis=-1, kind="stable")
    ranked = np.take_along_axis(weights, order, axis=-1)
    drop_ranked = (np.cumsum(ranked, axis=-1) - ranked) >= top_p
    drop = np.zeros_like(drop_ranked)
    np.put_along_axis(drop, order, drop_ranked, axis=-1)
    weights[drop] = 0.0

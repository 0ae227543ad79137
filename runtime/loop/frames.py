"""One request's per-step code rules: sampling, the delay-pattern ramps and the stop rules.

:class:`CodeSteps` holds what a request's steps need between decoder calls (its sampler,
its random generator, the codes drawn so far), so the same rules serve the one-request
loop (:func:`higgs_pack.runtime.loop.decode.generate_steps`) and the batched engine
(:mod:`higgs_pack.runtime.engine`), where each row of a batch has its own.
"""

from __future__ import annotations

import numpy as np

from higgs_pack.runtime.loop.delay import Sampler, undo_delay
from higgs_pack.runtime.loop.pipeline import ModelConstants
from higgs_pack.runtime.options import SamplingOptions


class CodeSteps:
    """The codes of one text chunk, drawn step by step (MODEL.md "Generation loop").

    Per step: sample each codebook from the audio heads' logits with this request's own
    generator (seeded with ``options.seed``, so the codes depend on the logits alone, not on
    other requests); during the first N steps codebooks above the step are forced to BOC;
    after codebook 0 emits EOC (or the repeat guard fires) codebook ``c`` is forced to EOC
    from ``c`` steps later, and the chunk is done when all are EOC or at the frame cap.
    Every buffer is made here, once (no per-step allocation).

    Args:
        constants: the model constants.
        options: sampling options (validated here).
        max_frames: frame cap (steps = max_frames + N - 1 at most).

    Raises:
        ValueError: invalid options.
    """

    def __init__(self, constants: ModelConstants, options: SamplingOptions, max_frames: int):
        c = constants
        self._c = c
        self.options = options
        n, vocab = c.num_codebooks, c.audio_vocab_size
        self.max_steps = max_frames + n - 1
        self.rng = np.random.default_rng(options.seed)
        allowed = np.zeros((n, vocab), dtype=bool)
        allowed[:, : c.codebook_size] = True
        allowed[0, c.eoc] = True  # only codebook 0 may start the end (MODEL.md)
        self.sampler = Sampler(allowed, options)
        # every step's codes; the rows handed out stay valid (a row is written once)
        self._delayed = np.empty((self.max_steps, n), dtype=np.int64)
        self.steps = 0
        self.stop_reason = "max_frames"
        self._eoc_step: int | None = None
        self._run_value, self._run_length = -1, 0

    def draw(self, logits: np.ndarray) -> np.ndarray:
        """Draw the next step's codes.

        Args:
            logits: float32 [N, V] of the audio heads for this step (finite).

        Returns:
            int64 [N]: the step's codes (delay pattern applied), a row of this object's
            buffer that is never overwritten.

        Raises:
            RuntimeError: called after :attr:`done`.
        """
        if self.done:
            raise RuntimeError("CodeSteps.draw after the chunk was done; start a new CodeSteps")
        c, step = self._c, self.steps
        n = c.num_codebooks
        codes = self._delayed[step]
        np.copyto(codes, self.sampler.draw(logits, self.rng))
        self.steps = step + 1
        if step < n - 1:
            codes[step + 1:] = c.boc
        if self._eoc_step is not None:
            codes[: step - self._eoc_step + 1] = c.eoc
        elif codes[0] == c.eoc:
            self._eoc_step, self.stop_reason = step, "eoc"
        else:
            code0 = int(codes[0])
            self._run_length = self._run_length + 1 if code0 == self._run_value else 1
            self._run_value = code0
            guard = self.options.repeat_guard_frames
            if guard and self._run_length >= guard:
                self._eoc_step, self.stop_reason = step + 1, "repeat_guard"
        return codes

    @property
    def done(self) -> bool:
        """Whether the chunk has ended: the EOC ramp is complete or the step cap is reached."""
        last = self.steps - 1
        ended = self._eoc_step is not None and last - self._eoc_step >= self._c.num_codebooks - 1
        return ended or self.steps >= self.max_steps

    @property
    def delayed(self) -> np.ndarray:
        """int64 [steps, N]: a copy of the codes drawn so far, as sampled."""
        return self._delayed[: self.steps].copy()

    def codes(self, delayed: np.ndarray) -> np.ndarray:
        """int64 [frames, N] real frames of ``delayed`` (:func:`~higgs_pack.runtime.loop.delay.undo_delay`)."""
        return undo_delay(delayed, self._c.codebook_size)

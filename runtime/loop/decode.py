"""The decode loop of one prompt: the decoder with audio feedback until EOC, the repeat guard or the
frame cap (MODEL.md "Generation loop"), in numpy, for every backend and the PyTorch oracle: it
only talks to a :class:`~higgs_pack.runtime.loop.pipeline.Pipeline`.

:func:`generate_steps` yields each step's codes as they are drawn (streaming reads them),
:func:`generate_codes` runs it to its end; either returns a :class:`GenerationResult`.  The
per-step finiteness checks (:class:`FiniteChecks`) are shared with the batched engine
(:mod:`higgs_pack.runtime.engine`).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass

import numpy as np

from higgs_pack.errors import InputError, NumericalError, Problem
from higgs_pack.runtime.loop.frames import CodeSteps
from higgs_pack.runtime.loop.pipeline import Pipeline
from higgs_pack.runtime.loop.prefix_cache import Prompt, prefill_prompt
from higgs_pack.runtime.options import SamplingOptions

ProgressCallback = Callable[[int, int], None]
"""Called as ``progress(frames_done, frame_cap)`` after every generated frame."""


@dataclass
class GenerationResult:
    """Codes generated for one prompt.

    Attributes:
        delayed: int64 [steps, N] as sampled (delay pattern applied).
        codes: int64 [frames, N] after undoing the delay, values 0..1023.
        stop_reason: ``"eoc"``, ``"repeat_guard"`` or ``"max_frames"``.
        prompt_length: prompt positions fed to the decoder.
        first_frame_s: seconds from the start until the first frame was sampled.
        seconds: seconds spent in the loop (prefill included, codec excluded).
        decoder_seconds: of which inside ``decoder.forward``.
        prefilled: prompt positions the decoder computed (``prompt_length`` less a voice prefix
            restored from the prefix cache); -1 where not recorded.
        prefill_s: seconds of the prompt's prefill (a cached prefix's restore included); NaN
            where not recorded.
    """

    delayed: np.ndarray
    codes: np.ndarray
    stop_reason: str
    prompt_length: int
    first_frame_s: float
    seconds: float
    decoder_seconds: float
    prefilled: int = -1
    prefill_s: float = math.nan


def check_finite(name: str, array: np.ndarray, pipeline: Pipeline) -> np.ndarray:
    if not np.isfinite(array).all():
        raise NumericalError(
            f"{name} returned non-finite values (NaN/inf) on {pipeline.description.get(name, 'its backend')}; "
            "the export or the execution provider is broken for this input: run `higgs-pack verify` "
            "on the bundle, or try another --execution-provider / --device"
        )
    return array


def check_context(prompt_len: int, max_steps: int, max_length: int) -> None:
    """Refuse a chunk whose prompt positions plus audio steps exceed ``max_length``.

    Raises:
        InputError: naming the three numbers and what to shorten.
    """
    if prompt_len + max_steps > max_length:
        raise InputError.of(Problem.said(
            f"prompt of {prompt_len} positions + up to {max_steps} audio steps exceeds the "
            f"decoder's context of {max_length} positions; shorten the text "
            "or the reference audio, or lower --max-frames"
        ))


def generate_codes(
    pipeline: Pipeline,
    prompt_embeds: np.ndarray | Prompt,
    options: SamplingOptions,
    max_frames: int,
    progress: ProgressCallback | None = None,
) -> GenerationResult:
    """Run the decoder loop to its end (:func:`generate_steps`) and return its result.

    Args and raises: as :func:`generate_steps`.
    """
    steps = generate_steps(pipeline, prompt_embeds, options, max_frames, progress)
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


def generate_steps(
    pipeline: Pipeline,
    prompt_embeds: np.ndarray | Prompt,
    options: SamplingOptions,
    max_frames: int,
    progress: ProgressCallback | None = None,
) -> Generator[np.ndarray, None, GenerationResult]:
    """Run the decoder loop with audio feedback until EOC, the repeat guard or the cap.

    Per step (MODEL.md "Generation loop"): audio_heads on the last hidden state
    -> logits [N, 1026]; sample each codebook; during the first N steps codebooks
    above the step are forced to BOC; after codebook 0 emits EOC (or the repeat
    guard fires) codebook ``c`` is forced to EOC from ``c`` steps later and the
    loop stops when all are EOC; the N codes go through audio_embed as the next
    decoder input.

    Args:
        pipeline: the backend; its decoder is reset first.
        prompt_embeds: float32 [1, P, H], or a :class:`~higgs_pack.runtime.loop.prefix_cache.Prompt`
            (:func:`~higgs_pack.runtime.loop.prompt.prompt_of`), whose voice prefix comes from ``pipeline.prefix_cache`` when it
            holds it (:func:`~higgs_pack.runtime.loop.prefix_cache.prefill_prompt`).
        options: sampling options (checked when they were made).
        max_frames: frame cap (steps = max_frames + N - 1 at most).
        progress: optional callback, see :data:`ProgressCallback`.

    Yields:
        int64 [N]: each step's codes as sampled (delay pattern applied), as soon as
        they are drawn (streaming reads frames from them).

    Returns:
        A :class:`GenerationResult` (the generator's return value).

    Raises:
        InputError: prompt + cap exceed the decoder's context length.
        NumericalError: a sub-part returned NaN/inf or an all-zero hidden state.
    """
    # Over 80 lines with its docstring on purpose: the body is the per-frame hot loop, kept in one
    # frame so a step makes no call beyond the sub-parts and the sampler.
    c = pipeline.constants
    n, vocab, h = c.num_codebooks, c.audio_vocab_size, c.hidden_size
    prompt = prompt_embeds if isinstance(prompt_embeds, Prompt) else Prompt(prompt_embeds)
    prompt_len = prompt.length
    max_steps = max_frames + n - 1
    check_context(prompt_len, max_steps, pipeline.decoder.max_length)
    # Everything a step touches is made here, once per request (issue 9: no per-step
    # allocation): the code rules' sampler and codes, the sub-parts' feeds and the
    # finiteness flags.
    rules = CodeSteps(c, options, max_frames)
    last = np.empty((1, 1, h), dtype=np.float32)
    step_codes = np.empty((1, 1, n), dtype=np.int64)
    heads_feed, embed_feed = {"hidden_states": last}, {"codes": step_codes}
    checks = FiniteChecks(pipeline, {"hidden": (1, 1, h), "logits": (n, vocab)})

    start = time.perf_counter()
    decoder_s = 0.0
    first_frame_s = math.nan
    t0 = time.perf_counter()
    hidden, restored = prefill_prompt(pipeline.decoder, prompt, pipeline.prefix_cache)
    prefill_s = time.perf_counter() - t0
    decoder_s += prefill_s
    for step in range(max_steps):
        np.copyto(last, hidden[:, -1:])
        checks.hidden(last, step)
        # A view of the heads' buffer (valid until their next run): read before that.
        logits = pipeline.audio_heads.run(heads_feed)["audio_logits"][0, -1].reshape(n, vocab)
        checks.finite("audio_heads", logits, "logits")
        codes = rules.draw(logits)
        if step == 0:
            first_frame_s = time.perf_counter() - start
        if progress is not None:
            progress(step + 1, max_steps)
        yield codes
        if rules.done:
            break
        np.copyto(step_codes[0, 0], codes)
        embeds = pipeline.audio_embed.run(embed_feed)["audio_embeds"]
        checks.finite("audio_embed", embeds, None)
        t0 = time.perf_counter()
        hidden = pipeline.decoder.forward(embeds)
        decoder_s += time.perf_counter() - t0
    delayed = rules.delayed
    return GenerationResult(
        delayed=delayed,
        codes=rules.codes(delayed),
        stop_reason=rules.stop_reason,
        prompt_length=prompt_len,
        first_frame_s=first_frame_s,
        seconds=time.perf_counter() - start,
        decoder_seconds=decoder_s,
        prefilled=prompt_len - restored,
        prefill_s=prefill_s,
    )


class FiniteChecks:
    """The loop's per-step checks for NaN/inf and all-zero outputs, on flag buffers made once.

    Args:
        pipeline: for the error message.
        shapes: buffer name -> shape of the arrays checked with it.
    """

    def __init__(self, pipeline: Pipeline, shapes: dict[str, tuple[int, ...]]):
        self._pipeline = pipeline
        self._flags = {name: np.empty(shape, dtype=bool) for name, shape in shapes.items()}

    def finite(self, name: str, array: np.ndarray, buffer: str | None) -> None:
        """Raise :class:`NumericalError` naming sub-part ``name`` if ``array`` holds NaN/inf
        (``buffer``: the flags of its shape; None: an other shape, checked with a new array)."""
        flags = self._flags.get(buffer) if buffer is not None else None
        ok = np.isfinite(array, out=flags).all() if flags is not None and flags.shape == array.shape \
            else np.isfinite(array).all()
        if not ok:
            check_finite(name, array, self._pipeline)

    def any_nonzero(self, array: np.ndarray, buffer: str) -> bool:
        """Whether ``array`` (the shape of ``buffer``) has a non-zero element."""
        return bool(np.not_equal(array, 0, out=self._flags[buffer]).any())

    def hidden(self, last: np.ndarray, step: int) -> None:
        """Check a step's last decoder hidden state (the ``"hidden"`` buffer's shape).

        Raises:
            NumericalError: NaN/inf or all zeros (naming the step and the backend).
        """
        self.finite("llm_decoder", last, "hidden")
        if not self.any_nonzero(last, "hidden"):
            raise NumericalError(
                f"llm_decoder returned an all-zero hidden state at step {step} on "
                f"{self._pipeline.description.get('llm_decoder', 'its backend')}; run `higgs-pack verify`"
            )

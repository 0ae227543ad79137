"""Issue 9 item 4: the generation loop allocates no per-step arrays and samples all codebooks at
once, and its codes are those of the textbook sampler (previous semantics) for the same seed."""

from __future__ import annotations

import gc
import tracemalloc

import numpy as np
import pytest

from higgs_pack.runtime.loop.decode import generate_steps
from higgs_pack.runtime.loop.prompt import build_prompt
from higgs_pack.runtime.options import SamplingOptions
from higgs_pack.runtime.sources.bundle import load_pipeline as load

TEXT = "Count the bytes of every step."


@pytest.fixture(scope="module")
def pipeline(cpu_int4_bundle):
    return load(cpu_int4_bundle)


def _retained(snapshot: tracemalloc.Snapshot) -> int:
    return sum(s.size for s in snapshot.statistics("filename"))


def test_steps_allocate_no_arrays_and_retain_nothing(pipeline):
    """tracemalloc sees every Python and numpy allocation (not ONNX Runtime's own C++ heap).
    Per step, the peak above the memory held before it stays under a quarter of one
    [8, 1026] float32 logits array (the loop before this change peaked at ~105 KB per step
    on this bundle: logits copies, masks, argpartition indices); the memory held after the
    steps does not grow with their number (before: one codes array per step kept in a list).
    ONNX Runtime's Python binding keeps a few hundred bytes of its own over the first calls:
    its frames are left out of the retained count."""
    c = pipeline.constants
    logits_bytes = c.num_codebooks * c.audio_vocab_size * 4
    steps = generate_steps(pipeline, build_prompt(pipeline, TEXT), SamplingOptions(seed=0, repeat_guard_frames=0),
                           max_frames=400)
    for _ in range(50):  # warm-up: the bound buffers are made on the first steps
        next(steps)
    ignore = [tracemalloc.Filter(False, "*onnxruntime*", all_frames=True), tracemalloc.Filter(False, __file__)]
    tracemalloc.start(8)
    try:
        gc.collect()
        before = _retained(tracemalloc.take_snapshot().filter_traces(ignore))
        peaks, held = [], []
        for n in range(200):
            tracemalloc.reset_peak()
            start = tracemalloc.get_traced_memory()[0]
            next(steps)
            peaks.append(tracemalloc.get_traced_memory()[1] - start)
            if n in (49, 199):
                gc.collect()
                held.append(_retained(tracemalloc.take_snapshot().filter_traces(ignore)) - before)
    finally:
        tracemalloc.stop()
        steps.close()
    assert max(peaks) < logits_bytes / 4, f"per-step peaks (bytes): max {max(peaks)}, median {np.median(peaks)}"
    assert held[1] - held[0] < 1024 and held[1] < 4096, f"bytes held after 50 / 200 steps: {held}"


def _textbook_codes(logits: np.ndarray, allowed: np.ndarray, options: SamplingOptions,
                    rng: np.random.Generator) -> np.ndarray:
    """The sampler as it was before the change: mask, the codes at or above each row's k-th
    largest logit kept in vocabulary order (every code tied with the k-th is kept, as
    Hugging Face's TopKLogitsWarper does), float64 softmax at the temperature, one uniform
    draw per codebook through the CDF.  Ties are real: int4 heads with int8 compute
    (accuracy_level 4) gave two equal logits at the threshold on an AVX-512 VNNI CPU, where
    keeping an arbitrary one of them (argpartition) drew another code at step 41."""
    x = np.where(allowed, logits, np.float32(-np.inf))
    threshold = np.partition(x, -options.top_k, axis=-1)[:, -options.top_k:].min(axis=-1, keepdims=True)
    out = np.empty(x.shape[0], dtype=np.int64)
    draws = rng.random(x.shape[0])
    for row in range(x.shape[0]):
        keep = np.flatnonzero(x[row] >= threshold[row])
        w = x[row, keep].astype(np.float64) / options.temperature
        p = np.exp(w - w.max())
        p /= p.sum()
        cdf = np.cumsum(p)
        u = draws[row] * cdf[-1]
        out[row] = keep[min(int((cdf <= u).sum()), len(keep) - 1)]
    return out


class _Recording:
    def __init__(self, inner, log):
        self.inner, self.log = inner, log

    def run(self, feeds):
        out = self.inner.run(feeds)
        self.log.append(out["audio_logits"][0, -1].copy())
        return out


@pytest.mark.parametrize("temperature", [0.8, 1.3])
def test_codes_are_the_textbook_samplers_for_the_same_seed(pipeline, temperature):
    c, n = pipeline.constants, pipeline.constants.num_codebooks
    options = SamplingOptions(temperature=temperature, top_k=40, seed=11, repeat_guard_frames=0)
    prompt = build_prompt(pipeline, TEXT)
    logits: list[np.ndarray] = []
    heads = pipeline.audio_heads
    pipeline.audio_heads = _Recording(heads, logits)
    try:
        steps = generate_steps(pipeline, prompt, options, max_frames=60)
        delayed = [row.copy() for row in steps]
    finally:
        pipeline.audio_heads = heads
    allowed = np.zeros((n, c.audio_vocab_size), bool)
    allowed[:, :c.codebook_size] = True
    allowed[0, c.eoc] = True
    rng = np.random.default_rng(options.seed)
    for step, (row, frame_logits) in enumerate(zip(delayed, logits, strict=True)):
        want = _textbook_codes(frame_logits.reshape(n, -1), allowed, options, rng)
        live = slice(0, min(step + 1, n))  # codebooks above the step are forced to BOC
        if (row == c.eoc).any():
            break  # the end ramp forces codes; the draws before it were compared
        assert np.array_equal(row[live], want[live]), f"step {step}"
        assert (row[min(step + 1, n):] == c.boc).all()
    assert step > 20
    # The plain loop (no recording wrapper) draws the same codes.
    again = np.stack([r.copy() for r in generate_steps(pipeline, prompt, options, max_frames=60)])
    assert np.array_equal(again, np.stack(delayed))

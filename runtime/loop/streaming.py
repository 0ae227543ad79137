"""Streaming synthesis: the TTS loop of :mod:`higgs_pack.runtime.loop.generate` with the codec
decoding frames as they arrive (:func:`stream`, :class:`SpeechStream`, :class:`AudioChunk`).

Windows carry the codec's receptive-field context (:func:`codec_context_frames`,
:class:`higgs_pack.runtime.loop.chunking.StreamingCodec`), so the joined chunks equal the
one-shot decode of :func:`~higgs_pack.runtime.loop.generate.synthesize`.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np

from higgs_pack.manifests.errors import InputError
from higgs_pack.runtime.loop.chunking import (
    NotLocalError,
    StreamingCodec,
    chunk_schedule,
    measure_codec_context,
)
from higgs_pack.runtime.loop.delay import SamplingOptions
from higgs_pack.runtime.loop.generate import (
    GenerationResult,
    ProgressCallback,
    SynthesisPlan,
    build_prompt,
    chunk_voice,
    decode_codes,
    fade_edges,
    generate_steps,
    plan_synthesis,
    sentence_pause,
)
from higgs_pack.runtime.loop.pipeline import Pipeline
from higgs_pack.runtime.request import FIRST_CHUNK_FRAMES, StreamSchedule  # noqa: F401 (the bench reads the default here)

StepsSource = Callable[[int, str, int], Generator[np.ndarray, None, GenerationResult]]
"""``steps(text_chunk_index, chunk_text, frame_cap)`` -> the codes of one text chunk (see
:class:`SpeechStream`)."""


def codec_context_frames(pipeline: Pipeline) -> int:
    """Frames of codes each side of a window for chunked codec decoding to equal one pass.

    The bundle's recorded value (``Pipeline.codec_context_frames``); for bundles built
    before it was recorded (and the oracle) it is measured once on the pipeline's own
    codec decoder with :func:`higgs_pack.runtime.loop.chunking.measure_codec_context` and
    kept on the pipeline.

    Raises:
        InputError: the codec mixes the whole sequence (no chunked decode can match).
    """
    if pipeline.codec_context_frames is None:
        c = pipeline.constants

        def run(codes: np.ndarray) -> np.ndarray:
            return pipeline.audio_tokenizer.run({"audio_codes": codes})["waveform"]

        try:
            pipeline.codec_context_frames = measure_codec_context(run, c.num_codebooks, c.codebook_size,
                                                                  atol=CONTEXT_ATOL)
        except NotLocalError as exc:
            raise InputError(f"this bundle's codec cannot be decoded in chunks ({exc}); use synthesize, "
                             "not streaming") from exc
    return pipeline.codec_context_frames


#: Output changes below this (float32 samples in [-1, 1]) do not count when measuring an
#: exported codec's reach: kernels may round differently across a tile.
CONTEXT_ATOL = 1e-6

@dataclass(frozen=True)
class AudioChunk:
    """One piece of streamed speech.

    Attributes:
        samples: float32 [n] mono, nominally in [-1, 1].
        offset: index of ``samples[0]`` in the whole stream (samples at ``sample_rate``).
        sample_rate: Hz (24000).
        text_chunk: index of the text chunk (sentence group) it belongs to; the pause
            between two text chunks comes as a chunk of its own.
    """

    samples: np.ndarray
    offset: int
    sample_rate: int
    text_chunk: int

    @property
    def end(self) -> int:
        """Sample index just after this chunk."""
        return self.offset + len(self.samples)


class SpeechStream(Iterator[AudioChunk]):
    """Iterator of :class:`AudioChunk` for one text; made by :func:`stream`.

    Joined in order, the chunks' samples equal ``synthesize(...).samples`` for the same
    arguments (codes identical, audio within float rounding).  Iterating drives the
    generation loop; :meth:`close` (or dropping the iterator) stops it at the next frame.
    The pipeline serves one stream at a time.

    ``steps`` (optional) gives each text chunk's codes instead of running
    :func:`~higgs_pack.runtime.loop.generate.generate_steps` here: called as
    ``steps(index, chunk_text, frame_cap)``, it returns a generator with that function's
    yields and return value (the batched engine feeds its rows' codes this way).  ``decode``
    (optional) codec-decodes one window, int64 codes [T, N] -> float32 samples [T * hop],
    instead of :func:`~higgs_pack.runtime.loop.generate.decode_codes` on the iterating thread;
    ``reading`` (optional) is a context manager held while the stream runs (from its first
    chunk asked for until it ends or is closed): the engine hands both to its codec thread
    (:class:`~higgs_pack.runtime.loop.codec_batch.CodecBatcher`).

    Attributes:
        results: :class:`GenerationResult` of each text chunk finished so far.
        samples_out: samples yielded so far.
        first_audio_s: seconds from the :func:`stream` call to the first yielded chunk
            (prefill and the first chunk's frames and codec decode included); NaN before.
        context_frames: codec context used per side of each decoded window (frames).
    """

    def __init__(self, pipeline: Pipeline, plan: SynthesisPlan, progress: ProgressCallback | None,
                 started: float, steps: StepsSource | None = None,
                 decode: Callable[[np.ndarray], np.ndarray] | None = None,
                 reading: Callable[[], AbstractContextManager] | None = None):
        self.results: list[GenerationResult] = []
        self.samples_out = 0
        self.first_audio_s = math.nan
        self.context_frames = codec_context_frames(pipeline)
        self._started = started
        self._steps = steps
        self._decode = decode or (lambda codes: decode_codes(pipeline, codes))
        self._reading = reading or contextlib.nullcontext
        self._gen = self._run(pipeline, plan, progress)

    def __next__(self) -> AudioChunk:
        chunk = next(self._gen)
        if self.samples_out == 0:
            self.first_audio_s = time.perf_counter() - self._started
        self.samples_out = chunk.end
        return chunk

    def close(self) -> None:
        """Stop generating (idempotent)."""
        self._gen.close()

    @property
    def codes(self) -> np.ndarray:
        """int64 [frames, N] of the text chunks finished so far."""
        if not self.results:
            return np.zeros((0, 0), dtype=np.int64)
        return np.concatenate([r.codes for r in self.results], axis=0)

    def _run(self, pipeline: Pipeline, plan: SynthesisPlan,
             progress: ProgressCallback | None) -> Generator[AudioChunk, None, None]:
        with self._reading():
            yield from self._chunks(pipeline, plan, progress)

    def _chunks(self, pipeline: Pipeline, plan: SynthesisPlan,
                progress: ProgressCallback | None) -> Generator[AudioChunk, None, None]:
        c, chunks, schedule = pipeline.constants, plan.chunks, plan.schedule
        n, rate = c.num_codebooks, c.sample_rate
        offset = 0

        def piece(samples: np.ndarray, index: int) -> AudioChunk:
            nonlocal offset
            out = AudioChunk(samples.astype(np.float32, copy=False), offset, rate, index)
            offset += len(samples)
            return out

        for index, (chunk_text, cap) in enumerate(chunks):
            if index:
                yield piece(sentence_pause(pipeline), index)
            inner_out = index < len(chunks) - 1
            codec = StreamingCodec(self._decode, self.context_frames,
                                   c.hop_length, chunk_schedule(schedule.first_chunk_frames, schedule.chunk_growth,
                                                                schedule.max_chunk_frames))
            if self._steps is not None:
                steps = self._steps(index, chunk_text, cap)
            else:
                voice = chunk_voice(pipeline, plan, index, self.results)
                steps = generate_steps(pipeline, build_prompt(pipeline, chunk_text, *voice), plan.options, cap,
                                       progress)
            rows: list[np.ndarray] = []
            columns = np.arange(n)
            live, first = True, True
            while True:
                try:
                    rows.append(next(steps))
                except StopIteration as stop:
                    result: GenerationResult = stop.value
                    break
                t = len(rows) - n
                if not live or t < 0:
                    continue
                frame = np.asarray([rows[t + k][k] for k in columns], dtype=np.int64)
                if (frame >= c.codebook_size).any():
                    live = False  # the EOC ramp: no further real frames (undo_delay drops them)
                    continue
                samples = codec.push(frame)
                if samples is not None:
                    yield piece(fade_edges(samples, pipeline, fade_in=first and index > 0, fade_out=False), index)
                    first = False
            self.results.append(result)
            tail = codec.finish(result.codes)
            if len(tail):
                yield piece(fade_edges(tail, pipeline, fade_in=first and index > 0, fade_out=inner_out), index)


def stream(
    pipeline: Pipeline,
    text: str,
    *,
    ref_samples: np.ndarray | None = None,
    ref_text: str | None = None,
    options: SamplingOptions | None = None,
    max_frames: int | None = None,
    progress: ProgressCallback | None = None,
    schedule: StreamSchedule | None = None,
    ref_codes: np.ndarray | None = None,
) -> SpeechStream:
    """Speak ``text`` as a stream of audio chunks, decoded while frames are generated.

    Same arguments and the same speech as :func:`synthesize`: the same codes and stop
    frame for the same seed, and the joined chunks equal its samples within float
    rounding (1e-4).  The codec decodes each core of frames with
    ``codec_context_frames`` frames of context per side
    (:class:`higgs_pack.runtime.loop.chunking.StreamingCodec`), so a core is ready once that
    many frames after it exist: the first audio arrives after the prompt, about
    ``first_chunk_frames + context + 7`` decoder steps (7: the delay pattern) and one
    codec decode.  Text chunks (long texts split into sentences) follow each other
    with the same pause as in :func:`synthesize`, ramped at its edges (no click).

    Args:
        pipeline, text, ref_samples, ref_text, options, max_frames, progress, ref_codes: as
            :func:`synthesize`.
        schedule: chunk sizes (:class:`~higgs_pack.runtime.request.StreamSchedule`; default
            10 frames = 0.4 s at 25 fps first, doubling up to 100 frames = 4 s).

    Returns:
        A :class:`SpeechStream`: iterate it for :class:`AudioChunk` (float32 samples and
        their offset in samples at 24000 Hz); its ``results`` hold each text chunk's
        :class:`GenerationResult`.

    Raises:
        InputError: as :func:`synthesize`, raised here, before the first chunk.
        NumericalError: during iteration, as :func:`synthesize`.
    """
    started = time.perf_counter()
    plan = plan_synthesis(pipeline, text, options=options, ref_samples=ref_samples, ref_codes=ref_codes,
                          ref_text=ref_text, max_frames=max_frames, schedule=schedule)
    return SpeechStream(pipeline, plan, progress, started)


def stream_plan(pipeline: Pipeline, plan: SynthesisPlan, progress: ProgressCallback | None = None,
                started: float | None = None) -> SpeechStream:
    """A :class:`SpeechStream` of a planned request (:func:`~higgs_pack.runtime.loop.generate.plan_request`); ``started`` (``time.perf_counter()``,
    default now) is when ``first_audio_s`` counts from."""
    return SpeechStream(pipeline, plan, progress, time.perf_counter() if started is None else started)

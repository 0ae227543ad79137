"""Streaming synthesis: the TTS loop of :mod:`higgs_pack.runtime.loop.decode` with the codec
decoding frames as they arrive (:func:`stream`, :class:`SpeechStream`, :class:`AudioChunk`).

A bundle with the stateful streaming codec (sub-part ``audio_tokenizer_stream``) decodes each frame
once, its left context kept as the decoder's state, the first audio coming once the decoder's
lookahead (and one frame) has arrived (:class:`higgs_pack.runtime.loop.stateful_codec.StatefulCodec`).
A bundle built before it decodes windows that carry the codec's receptive-field context on both
sides (:func:`codec_context_frames`, :class:`higgs_pack.runtime.loop.chunking.StreamingCodec`) and
says so once (:func:`window_codec_notice`).  Either way the joined chunks equal the one-shot decode
of :func:`~higgs_pack.runtime.loop.synthesis.synthesize` within the codec's parity limit.
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import math
import time
from collections.abc import Callable, Generator, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass

import numpy as np

from higgs_pack.runtime.loop.chunking import StreamingCodec, chunk_schedule
from higgs_pack.runtime.loop.codec import codec_context_frames, decode_codes
from higgs_pack.runtime.loop.decode import GenerationResult, ProgressCallback, generate_steps
from higgs_pack.runtime.loop.pipeline import Pipeline
from higgs_pack.runtime.loop.plan import SynthesisPlan, chunk_prompt, plan_synthesis
from higgs_pack.runtime.loop.stateful_codec import StatefulCodec, Step, runner_step
from higgs_pack.runtime.loop.synthesis import Segment, chunk_segments
from higgs_pack.runtime.options import SamplingOptions
from higgs_pack.runtime.request import FIRST_CHUNK_FRAMES, StreamSchedule  # noqa: F401 (the bench reads the default here)

log = logging.getLogger(__name__)
_NOTICED: set[int] = set()


def window_codec_notice(pipeline: Pipeline, context: int) -> str | None:
    """The one-line notice a bundle without the stateful streaming codec gives when it first streams
    (logged once per pipeline, at WARNING); None for a bundle that has it."""
    if pipeline.stream_codec is not None:
        return None
    line = (f"this bundle has no stateful streaming codec (built before manifest format 2): streaming "
            f"decodes windows of the one-shot codec with {context} frames of context each side; rebuild "
            "the bundle for one decode per frame")
    if id(pipeline) not in _NOTICED:
        _NOTICED.add(id(pipeline))
        log.warning(line)
    return line


StepsSource = Callable[[int, str, int], Generator[np.ndarray, None, GenerationResult]]
"""``steps(text_chunk_index, chunk_text, frame_cap)`` -> the codes of one text chunk (see
:class:`SpeechStream`)."""


@dataclass(frozen=True)
class AudioChunk:
    """One piece of streamed speech.

    Attributes:
        samples: float32 [n] mono, nominally in [-1, 1].
        offset: index of ``samples[0]`` in the whole stream (samples at ``sample_rate``).
        sample_rate: Hz (24000).
        text_chunk: index of the text chunk (sentence group) its samples belong to (a
            decoded core that straddles a seam between text chunks comes as two pieces).
        segments: the :class:`~higgs_pack.runtime.loop.synthesis.Segment` items (sentences, or a
            dialogue's turns) whose audio this piece completes: with the last piece of a text
            chunk, the segments of that chunk (a chunk's timings are known once its last frame
            is); else empty.
    """

    samples: np.ndarray
    offset: int
    sample_rate: int
    text_chunk: int
    segments: tuple[Segment, ...] = ()

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
    :func:`~higgs_pack.runtime.loop.decode.generate_steps` here: called as
    ``steps(index, chunk_text, frame_cap)``, it returns a generator with that function's
    yields and return value (the batched engine feeds its rows' codes this way).  ``decode``
    (optional) codec-decodes one window, int64 codes [T, N] -> float32 samples [T * hop],
    instead of :func:`~higgs_pack.runtime.loop.codec.decode_codes` on the iterating thread;
    ``codec_step`` (optional) is one call of the stateful streaming codec
    (:data:`~higgs_pack.runtime.loop.stateful_codec.Step`) instead of running its sub-part here;
    ``reading`` (optional) is a context manager held while the stream runs (from its first
    chunk asked for until it ends or is closed): the engine hands all three to its codec thread
    (:class:`~higgs_pack.runtime.engine.codec_batch.CodecBatcher`).

    Attributes:
        results: :class:`GenerationResult` of each text chunk finished so far.
        segments: the :class:`~higgs_pack.runtime.loop.synthesis.Segment` items of those chunks
            (as :attr:`~higgs_pack.runtime.loop.synthesis.SynthesisResult.segments`).
        samples_out: samples yielded so far.
        pushed: the frames handed to the codec so far (int64 [N] each, every text chunk's in
            order, an unfinished chunk's too): the codes of the audio made or being made
            (:attr:`pushed_codes`; a live session keeps the part its listener heard).
        first_audio_s: seconds from the :func:`stream` call to the first yielded chunk
            (prefill and the first chunk's frames and codec decode included); NaN before.
        context_frames: codec context used per side of each decoded window (frames); 0 with the
            stateful streaming codec.
        lookahead_frames: frames after a frame before its audio is complete: the stateful
            codec's lookahead, else ``context_frames``.
    """

    def __init__(self, pipeline: Pipeline, plan: SynthesisPlan, progress: ProgressCallback | None,
                 started: float, steps: StepsSource | None = None,
                 decode: Callable[[np.ndarray], np.ndarray] | None = None,
                 reading: Callable[[], AbstractContextManager] | None = None,
                 codec_step: Step | None = None):
        self.results: list[GenerationResult] = []
        self.segments: list[Segment] = []
        self.samples_out = 0
        self.pushed: list[np.ndarray] = []
        self.first_audio_s = math.nan
        spec = pipeline.stream_codec
        self.context_frames = 0 if spec is not None else codec_context_frames(pipeline)
        self.lookahead_frames = spec.lookahead_frames if spec is not None else self.context_frames
        if spec is None:
            window_codec_notice(pipeline, self.context_frames)
        else:
            self._codec_step = codec_step or runner_step(pipeline.audio_tokenizer_stream.run)
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
    def pushed_codes(self) -> np.ndarray:
        """int64 [frames, N] of :attr:`pushed` (``[0, 0]`` before the first)."""
        return np.stack(self.pushed) if self.pushed else np.zeros((0, 0), dtype=np.int64)

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
        """One codec stream over all text chunks: a chunk's last frames are decoded with the next
        chunk's first frames as their right context (and its first with the last chunk's as their
        left), so the stream is continuous speech across seams and equals one decode of all codes.
        A decoded core that straddles a seam is yielded as two pieces, one per text chunk."""
        c, schedule = pipeline.constants, plan.schedule
        n, hop = c.num_codebooks, c.hop_length
        sizes = chunk_schedule(schedule.first_chunk_frames, schedule.chunk_growth, schedule.max_chunk_frames)
        if pipeline.stream_codec is not None:
            codec = StatefulCodec(self._codec_step, pipeline.stream_codec, sizes, pipeline.codec_feed_frames)
        else:
            codec = StreamingCodec(self._decode, self.context_frames, hop, sizes)
        seams: list[int] = []  # the sample index where each finished text chunk ends
        ready: list[tuple[int, list[Segment]]] = []  # (seam, segments) of chunks whose audio is not all out
        offset = 0

        def pieces(samples: np.ndarray | None) -> Iterator[AudioChunk]:
            nonlocal offset
            if samples is None:
                return
            samples = samples.astype(np.float32, copy=False)
            base, end = offset, offset + len(samples)
            while offset < end:
                index = bisect.bisect_right(seams, offset)
                cut = min(end, seams[index]) if index < len(seams) else end
                done = [segment for seam, found in ready if seam <= cut for segment in found]
                ready[:] = [(seam, found) for seam, found in ready if seam > cut]
                yield AudioChunk(samples[offset - base:cut - base], offset, c.sample_rate, index, tuple(done))
                offset = cut

        for index, (chunk_text, cap) in enumerate(plan.chunks):
            if self._steps is not None:
                steps = self._steps(index, chunk_text, cap)
            else:
                steps = generate_steps(pipeline, chunk_prompt(pipeline, plan, index, self.results), plan.options, cap,
                                       progress)
            start = codec.frames  # this chunk's first frame in the stream
            rows: list[np.ndarray] = []
            columns = np.arange(n)
            live = True
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
                self.pushed.append(frame)
                yield from pieces(codec.push(frame))
            self.results.append(result)
            seams.append((start + len(result.codes)) * hop)
            found = chunk_segments(plan, index, [seam // hop for seam in seams], hop, c.sample_rate)
            self.segments += found
            ready.append((seams[-1], found))
            # Frames the loop's stop left unpushed (a stop at the frame cap cuts the delay ramp).
            for frame in result.codes[codec.frames - start:]:
                self.pushed.append(frame)
                yield from pieces(codec.push(frame))
        if self.results:
            yield from pieces(codec.finish(self.codes))


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
    codec decode.  Text chunks (a long text split at sentence ends) follow each other as
    continuous speech, as in :func:`synthesize`: one codec stream runs across their seams.

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
    """A :class:`SpeechStream` of a planned request (:func:`~higgs_pack.runtime.loop.plan.plan_request`); ``started`` (``time.perf_counter()``,
    default now) is when ``first_audio_s`` counts from."""
    return SpeechStream(pipeline, plan, progress, time.perf_counter() if started is None else started)

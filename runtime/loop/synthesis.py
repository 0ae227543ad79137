"""One request's speech: a plan's text chunks generated one after another (:func:`run_plan`,
:func:`synthesize`) and joined as one continuous utterance (:func:`join_results`) into a
:class:`SynthesisResult` with its :class:`Segment` items (sentences, or dialogue turns).

Streaming (the same loop, its codes decoded as they arrive) is in
:mod:`higgs_pack.runtime.loop.streaming`; many requests at once in :mod:`higgs_pack.runtime.engine`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from higgs_pack.runtime.loop.chunking import context_window
from higgs_pack.runtime.loop.codec import codec_context_frames, decode_codes
from higgs_pack.runtime.loop.decode import GenerationResult, ProgressCallback, generate_codes
from higgs_pack.runtime.loop.pipeline import Pipeline
from higgs_pack.runtime.loop.plan import SynthesisPlan, chunk_prompt, plan_synthesis
from higgs_pack.runtime.loop.sentences import split_sentences
from higgs_pack.runtime.loop.words import Word, proportional_bounds, word_timings
from higgs_pack.runtime.options import SamplingOptions


@dataclass(frozen=True)
class Segment:
    """Where one sentence (or, in a dialogue, one turn) is in the audio.

    Timings come from frame counts, not from an aligner: a text chunk's span is exact by
    construction (its first and last frame, 25 frames per second), and so is a segment that is a
    whole text chunk (a one-sentence chunk, a dialogue turn).  Sentences that share one chunk
    share one generation, whose frames say nothing of where one sentence ends: their inner
    boundaries are estimated by dividing the chunk's frames in proportion to the sentences'
    characters (whitespace not counted), to a whole frame, and marked ``exact=False``.  Its
    words' timings are estimated the same way within its span (:mod:`~higgs_pack.runtime.loop.words`).

    Attributes:
        text: the sentence (or turn) as spoken.
        start: seconds from the start of the audio to its first sample.
        end: seconds to just after its last sample (``end >= start``; equal for a chunk that
            produced no frame).
        chunk: index of the text chunk it was generated in (:attr:`~higgs_pack.runtime.loop.plan.SynthesisPlan.chunks`; a
            dialogue turn longer than one chunk: its first chunk).
        exact: both ends are frame-exact (the segment is a whole chunk or turn); False: one or
            both ends are the estimate above.
        speaker: the speaker of a dialogue turn; None outside a dialogue.
        words: its :class:`~higgs_pack.runtime.loop.words.Word` items, in order, within
            ``[start, end]`` (estimates: :func:`~higgs_pack.runtime.loop.words.word_timings`; a
            turn of several chunks: each chunk's words within that chunk's exact span).
    """

    text: str
    start: float
    end: float
    chunk: int
    exact: bool
    speaker: str | None = None
    words: tuple[Word, ...] = ()


@dataclass
class SynthesisResult:
    """Speech for one text.

    Attributes:
        samples: float32 [samples], mono, nominally in [-1, 1].
        sample_rate: Hz (24000 for Higgs-Audio-v3).
        codes: int64 [frames, N], all chunks joined.
        chunks: per-chunk :class:`~higgs_pack.runtime.loop.decode.GenerationResult` (one unless the text was split).
        segments: one :class:`Segment` per sentence (per turn in a dialogue), in order (empty
            when the result was joined without its plan).
        words: every segment's :attr:`Segment.words`, in order (estimated word timings).
        frame_cap_hit: True when some chunk stopped at its frame cap, not at EOC.
    """

    samples: np.ndarray
    sample_rate: int
    codes: np.ndarray
    chunks: list[GenerationResult] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)

    @property
    def words(self) -> list[Word]:
        return [word for segment in self.segments for word in segment.words]

    @property
    def frame_cap_hit(self) -> bool:
        return any(c.stop_reason == "max_frames" for c in self.chunks)

    @property
    def seconds_of_audio(self) -> float:
        return len(self.samples) / self.sample_rate


def synthesize(
    pipeline: Pipeline,
    text: str,
    *,
    ref_samples: np.ndarray | None = None,
    ref_text: str | None = None,
    options: SamplingOptions | None = None,
    max_frames: int | None = None,
    progress: ProgressCallback | None = None,
    ref_codes: np.ndarray | None = None,
) -> SynthesisResult:
    """Speak ``text`` (optionally in the voice of a reference clip).

    Text whose prompt plus frame cap does not fit the decoder's context is split
    into sentences, each spoken with the same options and joined.

    Args:
        pipeline: a loaded bundle (``higgs_pack.runtime.sources.bundle.load_pipeline``) or the oracle.
        text: what to say; inline controls like ``<|emotion:amusement|>`` pass as text.
        ref_samples: float32 [samples] mono at ``sample_rate`` Hz, a multiple of
            ``hop_length`` long (see ``audio.prepare_reference``), or None.
        ref_text: transcript of ``ref_samples``.
        options: sampling options (default: manifest defaults, else temperature 0.8, top-k 50).
        max_frames: frame cap per chunk; default derived from the text length
            (:func:`~higgs_pack.runtime.loop.text_chunks.frame_cap`).
        progress: per-frame callback.
        ref_codes: int64 [frames, N] codes of a voice encoded before
            (:meth:`higgs_pack.runtime.api.TTS.prepare_voice`), instead of ``ref_samples``;
            needs ``ref_text``.

    Returns:
        A :class:`SynthesisResult` (float32 samples at 24000 Hz).

    Raises:
        InputError: empty/whitespace text, a special token of the tokenizer in the text or
            the transcript (:func:`~higgs_pack.runtime.loop.prompt.check_text_tokens`), ``ref_samples`` without ``ref_text``
            (or the reverse), or one sentence too long.
        NumericalError: non-finite or all-zero sub-part output.
    """
    plan = plan_synthesis(pipeline, text, options=options, ref_samples=ref_samples, ref_codes=ref_codes,
                          ref_text=ref_text, max_frames=max_frames)
    return run_plan(pipeline, plan, progress)


def join_results(pipeline: Pipeline, results: list[GenerationResult],
                 decode: Callable[[list[np.ndarray]], list[np.ndarray]] | None = None,
                 plan: SynthesisPlan | None = None) -> SynthesisResult:
    """Codec-decode the text chunks' codes as one continuous utterance: one :class:`SynthesisResult`.

    The chunks join as continuous speech, with no inserted silence: each chunk is decoded in a
    window holding :func:`~higgs_pack.runtime.loop.codec.codec_context_frames` frames of its neighbours' codes on each side
    (:func:`~higgs_pack.runtime.loop.chunking.context_window`), and only its own frames' samples
    are kept, so the joined samples equal one codec decode of all chunks' codes concatenated
    (within float rounding; tests/test_streaming.py holds it to 1e-4) while the codec never runs
    on more than one chunk and its context at once.  Pauses come from the speech itself (a
    sentence's end), never from the join.

    Args:
        pipeline: the backend.
        results: each text chunk's :class:`~higgs_pack.runtime.loop.decode.GenerationResult`, in order.
        decode: optional; decodes all windows (int64 codes [T, N] each) to their samples
            (float32 [T * hop] each) instead of :func:`~higgs_pack.runtime.loop.codec.decode_codes` one by one (the engine's
            batched codec thread, :class:`~higgs_pack.runtime.engine.codec_batch.CodecBatcher`).
        plan: the plan the results are of: gives the result its :attr:`SynthesisResult.segments`
            (:func:`chunk_segments`); None: no segments.

    Raises:
        InputError: the codec mixes the whole sequence (:func:`~higgs_pack.runtime.loop.codec.codec_context_frames`).
        NumericalError: the codec returned NaN/inf.
    """
    codes = np.concatenate([r.codes for r in results], axis=0) if results else np.zeros((0, 0), np.int64)
    hop = pipeline.constants.hop_length
    ends = np.cumsum([len(r.codes) for r in results]).tolist()
    spans = [(end - len(r.codes), end) for r, end in zip(results, ends, strict=True) if len(r.codes)]
    if len(spans) > 1:
        context = codec_context_frames(pipeline)
        windows = [context_window(start, end, len(codes), context) for start, end in spans]
    else:
        windows = spans
    pieces = [codes[start:end] for start, end in windows]
    decoded = [decode_codes(pipeline, piece) for piece in pieces] if decode is None else decode(pieces)
    kept = [samples[(start - w_start) * hop:(end - w_start) * hop]
            for samples, (start, end), (w_start, _) in zip(decoded, spans, windows, strict=True)]
    samples = np.concatenate(kept).astype(np.float32, copy=False) if kept else np.zeros(0, np.float32)
    segments: list[Segment] = []
    if plan is not None:
        for index in range(len(results)):
            segments += chunk_segments(plan, index, ends, hop, pipeline.constants.sample_rate)
    return SynthesisResult(samples, pipeline.constants.sample_rate, codes, results, segments)


def chunk_segments(plan: SynthesisPlan, index: int, ends: list[int], hop: int, sample_rate: int) -> list[Segment]:
    """The :class:`Segment` items text chunk ``index`` of ``plan`` completes, once its frames are
    known: one per sentence (:func:`split_sentences` of the chunk's text), the chunk's ends exact and
    the boundaries between its sentences estimated by their characters (see :class:`Segment`); in a
    dialogue, the whole turn (exact) when ``index`` is its last chunk, else none.

    Args:
        plan: the request's plan.
        index: the text chunk.
        ends: the frame just after each text chunk ``0 .. index`` (at least) in the whole audio.
        hop: samples per frame (960).
        sample_rate: Hz (24000).
    """
    first_frame = ends[index - 1] if index else 0
    frames = ends[index] - first_frame
    seconds = hop / sample_rate  # of one frame
    if plan.cast is not None:
        turn = plan.cast.turns[index]
        if index + 1 < len(plan.chunks) and plan.cast.turns[index + 1] == turn:
            return []
        first = plan.cast.turns.index(turn)
        start = ends[first - 1] if first else 0
        words = tuple(word for j in range(first, index + 1)
                      for word in word_timings(plan.chunks[j][0], (ends[j - 1] if j else 0) * seconds, ends[j] * seconds))
        return [Segment(plan.cast.texts[turn], start * seconds, ends[index] * seconds, first,
                        True, plan.cast.names[plan.cast.speakers[index]], words)]
    sentences = split_sentences(plan.chunks[index][0]) or [plan.chunks[index][0]]
    bounds = [first_frame + round(b) for b in proportional_bounds([sum(not ch.isspace() for ch in s)
                                                                   for s in sentences], 0, frames)]
    return [Segment(sentence, bounds[i] * seconds, bounds[i + 1] * seconds, index, len(sentences) == 1,
                    words=word_timings(sentence, bounds[i] * seconds, bounds[i + 1] * seconds))
            for i, sentence in enumerate(sentences)]


def run_plan(pipeline: Pipeline, plan: SynthesisPlan, progress: ProgressCallback | None = None) -> SynthesisResult:
    """Generate every text chunk of ``plan`` and join them (:func:`join_results`).

    Raises:
        InputError: a prompt and cap past the decoder's context.
        NumericalError: non-finite or all-zero sub-part output.
    """
    results: list[GenerationResult] = []
    for index, (_, cap) in enumerate(plan.chunks):
        prompt = chunk_prompt(pipeline, plan, index, results)
        results.append(generate_codes(pipeline, prompt, plan.options, cap, progress))
    return join_results(pipeline, results, plan=plan)


#: Silence between two sentences generated as separate requests (a live session's sentences,
#: serve/live.py), seconds.  Text chunks of one request never get it: they join as continuous
#: speech (:func:`join_results`).
SENTENCE_PAUSE_S = 0.2

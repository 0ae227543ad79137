"""One request resolved against one loaded bundle, once: the :class:`SynthesisPlan` that the loop,
streaming and the engine run (:func:`plan_request`, :func:`plan_synthesis`), and the rolling
context of its chunks (:func:`chunk_context`): the voice and the earlier chunks that open a
chunk's prompt, cut to fit, and the most positions a chunk of the plan can hold with it at its
largest (:func:`most_positions`).  Both read one choice of context (:func:`_context_parts`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from higgs_pack.errors import InputError, Problem
from higgs_pack.runtime.loop.codec import check_voice_codes, encode_reference
from higgs_pack.runtime.loop.decode import GenerationResult
from higgs_pack.runtime.loop.pipeline import Pipeline
from higgs_pack.runtime.loop.prefix_cache import Prompt
from higgs_pack.runtime.loop.prompt import Context, check_text_tokens, prompt_of, special_tokens
from higgs_pack.runtime.loop.text_chunks import chunk_positions, plan_chunks, token_count
from higgs_pack.runtime.options import SamplingOptions, bundle_sampling
from higgs_pack.runtime.request import (
    CONTEXT_CHUNKS,
    PreparedVoice,
    StreamSchedule,
    SynthesisRequest,
    Voice,
    refuse,
    text_problems,
    voice_pair_problems,
)

#: Most words in one text chunk when a rolling context is kept (Higgs' ``chunk_max_word_num``, 200).
CHUNK_WORDS = 200


@dataclass(frozen=True, eq=False)
class SynthesisPlan:
    """One request resolved against one loaded bundle, once: what the loop runs.

    Made by :func:`plan_request`
    (every front door) or :func:`plan_synthesis` (pipeline-level callers); run by
    :func:`~higgs_pack.runtime.loop.synthesis.run_plan`, :func:`higgs_pack.runtime.loop.streaming.stream_plan` and the engine.

    Attributes:
        options: the sampling options (the bundle's defaults with the request's choices).
        ref_codes: int64 [frames, N] codes of the voice (its clip encoded by this bundle's
            codec, or a prepared voice's), or None for the bundle's own voice.
        ref_text: the voice's transcript, or None.
        chunks: ``(text, frame cap)`` per text chunk, in order (one unless the text does not
            fit the decoder's context).
        schedule: the chunk sizes a stream of this request yields.
        positions: most decoder positions one chunk holds (prompt, rolling context at its
            largest, and audio steps of its cap; at most ``max_length``): KV bytes are this times
            the decoder's bytes per position.
        context_chunks: previous text chunks whose text and codes follow the voice in a chunk's
            prompt (:func:`chunk_context`); 0: the voice alone.
        max_length: the decoder context the chunks were planned for (positions).
        max_prompt_length: the longest prompt the decoder takes, where it has a limit of its own
            (an NPU bundle's static prompt, ``generation.max_prompt_length``), else None.
        cast: the speakers of a dialogue, else None.
        context_frames: most frames of each context chunk kept in a prompt (its end, cut at a
            word, :func:`context_tail`); None: whole chunks.
        context: earlier speech before the first text chunk, ``(codes int64 [frames, N], text)``
            oldest first (a live session's previous sentences,
            :attr:`~higgs_pack.runtime.request.SynthesisRequest.context`): rolling context of the
            first chunks, as if they were chunks before chunk 0 (:func:`chunk_context`).
    """

    options: SamplingOptions
    ref_codes: np.ndarray | None
    ref_text: str | None
    chunks: tuple[tuple[str, int], ...]
    schedule: StreamSchedule
    positions: int
    context_chunks: int = CONTEXT_CHUNKS
    max_length: int = 0
    max_prompt_length: int | None = None
    cast: Cast | None = None
    context_frames: int | None = None
    context: tuple[tuple[np.ndarray, str], ...] = ()

    def speaker_of(self, index: int) -> int:
        """The speaker of text chunk ``index`` (an index into ``cast.names``; 0 outside a dialogue)."""
        return 0 if self.cast is None else self.cast.speakers[index]

    def voice_of(self, index: int) -> tuple[np.ndarray | None, str | None]:
        """The voice of text chunk ``index``'s speaker: ``(codes int64 [frames, N], transcript)``, or
        ``(None, None)`` when the speaker's first chunk is its voice (:func:`chunk_context`)."""
        return (self.ref_codes, self.ref_text) if self.cast is None else self.cast.voices[self.speaker_of(index)]


@dataclass(frozen=True, eq=False)
class Cast:
    """The speakers of a dialogue's :class:`SynthesisPlan` (made by
    :func:`higgs_pack.runtime.loop.dialogue.plan_dialogue`): each text chunk belongs to one turn,
    each turn to one speaker, each speaker has its own voice.

    Attributes:
        names: the speakers' names, in order of their first turn.
        voices: per speaker ``(codes int64 [frames, N], transcript)``, or ``(None, None)``: the
            speaker's first chunk becomes its voice.
        speakers: the speaker (index into ``names``) of each text chunk.
        turns: the turn (index into ``texts``) of each text chunk; a turn's chunks are consecutive.
        texts: each turn's text, as spoken.
    """

    names: tuple[str, ...]
    voices: tuple[tuple[np.ndarray | None, str | None], ...]
    speakers: tuple[int, ...]
    turns: tuple[int, ...]
    texts: tuple[str, ...]


def plan_synthesis(pipeline: Pipeline, text: str, *, options: SamplingOptions | None = None,
                   ref_samples: np.ndarray | None = None, ref_codes: np.ndarray | None = None,
                   ref_text: str | None = None, max_frames: int | None = None,
                   schedule: StreamSchedule | None = None, checked: bool = False,
                   context_chunks: int = CONTEXT_CHUNKS, context_frames: int | None = None,
                   context: Context = ()) -> SynthesisPlan:
    """Check what only the bundle can judge and plan the request: a :class:`SynthesisPlan`.

    Everything the loop can refuse is refused here, before a frame is generated or a byte
    written: the text (:func:`higgs_pack.runtime.request.text_problems`, unless ``checked``),
    its special tokens (:func:`~higgs_pack.runtime.loop.prompt.check_text_tokens`), the voice pairing, a voice's codes against
    the codec (:func:`~higgs_pack.runtime.loop.codec.check_voice_codes`), a sentence too long for the context.

    Args:
        pipeline: a loaded bundle or the oracle.
        text: what to say.
        options: sampling options; None: the bundle's defaults
            (:func:`~higgs_pack.runtime.options.bundle_sampling`).
        ref_samples: float32 [samples] mono at the codec's rate, a multiple of ``hop_length``
            long (``audio.prepare_reference``): encoded here.  Or
        ref_codes: int64 [frames, N] codes encoded before (never both).
        ref_text: the voice's transcript (with either).
        max_frames: frame cap per chunk; None: from each chunk's length (:func:`~higgs_pack.runtime.loop.text_chunks.frame_cap`).
        schedule: stream chunk sizes (default :class:`~higgs_pack.runtime.request.StreamSchedule`).
        checked: the text and voice pairing were checked already (a
            :class:`~higgs_pack.runtime.request.SynthesisRequest` checks them when made).
        context_frames: most frames of each context chunk kept (:attr:`SynthesisPlan.context_frames`).
        context: earlier speech after the voice, ``(codes int64 [frames, N], text)`` oldest first
            (:attr:`SynthesisPlan.context`); needs a voice.
        context_chunks: the rolling context (:func:`chunk_context`): with it (default
            :data:`CONTEXT_CHUNKS`) a long text is cut into chunks of at most
            :data:`CHUNK_WORDS` words; 0 packs each chunk up to the decoder's context and
            opens its prompt with the voice alone (the clip's, or the first chunk's).

    Raises:
        InputError: as listed above.
    """
    if ref_samples is not None and ref_codes is not None:
        raise InputError.of(Problem.said("give a voice as reference samples or as prepared codes, not both",
                                         code="conflicting_fields"))
    if not checked:
        voice = ref_samples if ref_codes is None else ref_codes
        refuse(text_problems(text) or voice_pair_problems(voice, ref_text))
    if context and ref_samples is None and ref_codes is None:
        raise InputError.of(Problem.said("a rolling context (earlier speech) follows the voice in the prompt and needs one; "
                         "give a voice (with none, make the oldest speech the voice)"))
    if ref_codes is not None:
        check_voice_codes(pipeline, ref_codes)
    for codes, words in context:
        check_voice_codes(pipeline, codes)
        check_text_tokens(pipeline, words, "context")
    options = bundle_sampling(pipeline.generation_defaults) if options is None else options
    refuse(special_tokens(pipeline, text, "text")[1]  # both fields' problems at once
           + (special_tokens(pipeline, ref_text, "ref_text")[1] if ref_text is not None else []))
    if ref_samples is not None:
        ref_codes = encode_reference(pipeline, ref_samples)
    chunks = tuple(plan_chunks(pipeline, text.strip(), ref_codes, ref_text, max_frames,
                               max_words=CHUNK_WORDS if context_chunks else None))
    plan = SynthesisPlan(options, ref_codes, ref_text, chunks, schedule or StreamSchedule(), 0, context_chunks,
                         pipeline.decoder.max_length, getattr(pipeline.decoder, "max_prompt_length", None),
                         context_frames=context_frames, context=tuple(context))
    return dataclasses.replace(plan, positions=most_positions(pipeline, plan))


def plan_request(pipeline: Pipeline, request: SynthesisRequest) -> SynthesisPlan:
    """A request resolved once against a loaded bundle: the frozen :class:`SynthesisPlan` that
    ``TTS.synthesize``, ``TTS.stream`` and the engine run: the sampling options (the bundle's
    defaults with the request's choices), the voice's codes (a clip read, resampled and encoded
    here; a prepared voice's checked against the codec), the text chunks with their frame caps,
    the stream schedule.  The request's own fields were checked when it was made.

    Raises:
        InputError: the reference clip cannot be read or used, a special token of the
            tokenizer in the text or transcript, a sentence too long for the context, the
            bundle's own sampling defaults out of range.
    """
    c, voice = pipeline.constants, request.voice
    return plan_synthesis(
        pipeline, request.text, options=request.sampling_options(pipeline.generation_defaults),
        ref_samples=voice.prepared(c.sample_rate, c.hop_length) if isinstance(voice, Voice) else None,
        ref_codes=voice.codes if isinstance(voice, PreparedVoice) else None,
        ref_text=voice.transcript if voice is not None else None,
        max_frames=request.max_frames, schedule=request.schedule, checked=True,
        context_chunks=request.context_chunks, context_frames=request.context_frames,
        context=[(part.codes, part.transcript) for part in request.context])


def chunk_prompt(pipeline: Pipeline, plan: SynthesisPlan, index: int, results: list[GenerationResult]) -> Prompt:
    """Text chunk ``index``'s prompt (:func:`~higgs_pack.runtime.loop.prompt.prompt_of`) with its voice and rolling context
    (:func:`chunk_context`).  The voice's pair opens it whatever the context, so its voice
    prefix is cached once and restored for every later chunk (the request's voice, a dialogue
    speaker's, or with none the first chunk's own speech)."""
    codes, words, context = chunk_context(pipeline, plan, index, results)
    return prompt_of(pipeline, plan.chunks[index][0], codes, words, context=context)


def chunk_context(pipeline: Pipeline, plan: SynthesisPlan, index: int,
                  results: list[GenerationResult]) -> tuple[np.ndarray | None, str | None, Context]:
    """The voice and rolling context that open text chunk ``index``'s prompt.

    The voice is the request's (a reference clip's codes and transcript; in a dialogue the
    chunk's speaker's, :meth:`SynthesisPlan.voice_of`); with none, the first chunk's own codes
    and text (whole) become the voice of every later chunk.  After it come the last
    ``plan.context_chunks`` chunks before ``index`` (text and codes, oldest first, the plan's
    earlier speech :attr:`SynthesisPlan.context` counted as chunks before chunk 0; each cut to its
    last ``plan.context_frames`` frames, :func:`context_tail`), as Higgs' own long-form
    generation keeps its ``generation_chunk_buffer_size`` chunks (../shared/SPEECH-AT-LENGTH.md);
    the oldest are left out while the prompt and the chunk's cap would not fit
    ``plan.max_length`` (or the prompt alone ``plan.max_prompt_length``), and a first-chunk voice
    that cannot fit is left out too.  The same function serves :func:`~higgs_pack.runtime.loop.synthesis.run_plan`, streaming and
    the engine, so each gives the same codes for the same seed.

    Args:
        pipeline: the backend (its tokenizer and constants).
        plan: the request's plan.
        index: the text chunk about to be generated.
        results: the :class:`~higgs_pack.runtime.loop.decode.GenerationResult` of chunks ``0 .. index - 1``.

    Returns:
        ``(voice codes int64 [frames, N], voice transcript, context)`` for :func:`~higgs_pack.runtime.loop.prompt.prompt_of`, or
        ``(None, None, [])`` (zero-shot).
    """
    ref_codes, ref_text, parts = _context_parts(plan, index, lambda j: results[j].codes)
    if ref_codes is not None and ref_codes is not plan.voice_of(index)[0] and not len(ref_codes):
        return None, None, []  # a first-chunk voice of no frames
    parts = [context_tail(pipeline, codes, words, plan.context_frames) for codes, words in parts if len(codes)]
    if not parts and ref_codes is plan.voice_of(index)[0]:
        return ref_codes, ref_text, []
    text, cap = plan.chunks[index]
    steps = cap + pipeline.constants.num_codebooks - 1
    prompt_limit = plan.max_prompt_length or plan.max_length
    while ref_codes is not None:
        positions = chunk_positions(pipeline, text, cap, ref_codes, ref_text, parts)
        if positions <= plan.max_length and positions - steps <= prompt_limit:
            return ref_codes, ref_text, parts
        if parts:  # the oldest context goes first; a first-chunk voice (with no reference) last
            del parts[0]
        else:
            ref_codes, ref_text = plan.voice_of(index)
            if ref_codes is None:
                break
            return ref_codes, ref_text, []
    return None, None, []


def context_tail(pipeline: Pipeline, codes: np.ndarray, text: str, frames: int | None) -> tuple[np.ndarray, str]:
    """An earlier chunk's ``(codes, text)`` cut to about its last ``frames`` frames, at a word
    boundary, for a rolling context (None: whole).

    Where in the codes a word starts is estimated as :class:`~higgs_pack.runtime.loop.synthesis.Segment` estimates sentence
    boundaries: the chunk's frames divided in proportion to its words' characters (whitespace not
    counted), to a whole frame.  The kept words are the longest run ending the chunk whose
    estimated frames fit ``frames``, starting at a sentence start when one of those words does
    (a pause, where an estimate's error falls in silence); the codes kept start at the first kept
    word's estimated frame.  At least the last word is kept.

    Args:
        pipeline: unused today (kept for a tokenizer-aware cut).
        codes: int64 [F, N], the chunk's codes.
        text: the chunk's text.
        frames: most frames to keep (>= 1), or None.

    Returns:
        ``(codes int64 [<= max(frames, last word's frames), N], text)``.
    """
    del pipeline
    words = text.split()
    if frames is None or len(codes) <= frames or len(words) < 2:
        return codes, text
    weights = np.cumsum([0] + [len(w) for w in words])
    starts = [round(len(codes) * w / weights[-1]) for w in weights[:-1]]
    fits = [i for i, start in enumerate(starts) if len(codes) - start <= frames] or [len(words) - 1]
    sentence_starts = {0} | {i + 1 for i, w in enumerate(words[:-1]) if w[-1] in ".!?;:"}
    first = next((i for i in fits if i in sentence_starts), fits[0])
    return codes[starts[first]:], " ".join(words[first:])


def _context_of(plan: SynthesisPlan, index: int) -> list[int]:
    """The earlier text chunks whose text and codes follow the voice in chunk ``index``'s prompt at
    most, oldest first: when the speaker has no voice of its own, its first chunk (the voice of
    the rest, whatever ``plan.context_chunks``), then the speaker's last ``plan.context_chunks``
    chunks after it.  Only the same speaker's chunks: a dialogue's prompt format has no speaker
    tag, so another speaker's audio there would pull the voice towards that speaker."""
    speaker, (codes, _) = plan.speaker_of(index), plan.voice_of(index)
    first = None if codes is not None else (0 if plan.cast is None else plan.cast.speakers.index(speaker))
    if index == 0 or first == index:
        return []
    recent: list[int] = []
    j = index - 1
    while j >= 0 and j != first and len(recent) < plan.context_chunks:
        if plan.speaker_of(j) == speaker:
            recent.append(j)
        j -= 1
    return ([] if first is None else [first]) + recent[::-1]


def _earlier(plan: SynthesisPlan, taken: int) -> Context:
    """The plan's earlier speech (:attr:`SynthesisPlan.context`) that a chunk's prompt holds
    besides ``taken`` earlier chunks of the plan: the last ``plan.context_chunks - taken`` of it."""
    room = plan.context_chunks - taken
    return list(plan.context[-room:]) if room > 0 and plan.cast is None else []


def _context_parts(plan: SynthesisPlan, index: int,
                   codes_of: Callable[[int], np.ndarray]) -> tuple[np.ndarray | None, str | None, Context]:
    """The voice and the rolling context of chunk ``index`` before any cut (the one choice
    :func:`chunk_context` cuts and :func:`most_positions` bounds): the speaker's voice
    (:meth:`SynthesisPlan.voice_of`) or, with none, its first chunk (whole); then the plan's
    earlier speech (:func:`_earlier`) and the chunks of :func:`_context_of`, oldest first.

    Args:
        codes_of: the codes int64 [frames, N] of the plan's text chunk ``j`` (its result's, or a
            stand-in of its frame cap for the bound).
    """
    chosen = _context_of(plan, index)
    ref_codes, ref_text = plan.voice_of(index)
    parts = _earlier(plan, len(chosen)) + [(codes_of(j), plan.chunks[j][0]) for j in chosen]
    if ref_codes is None and parts:  # the speaker's first chunk is its voice (whole)
        (ref_codes, ref_text), parts = parts[0], parts[1:]
    return ref_codes, ref_text, parts


def _tail_most(frames: int, text: str, keep: int | None) -> tuple[int, int]:
    """The most frames :func:`context_tail` keeps of a chunk of ``frames`` frames and ``text`` cut
    to ``keep`` (None: whole), and the tokens to spare for its cut text (1 when it may be cut: a
    cut text may tokenize one token longer than the whole's count gives)."""
    if keep is None or frames <= keep:
        return frames, 0
    words = text.split()
    last = frames * len(words[-1]) // sum(len(w) for w in words) + 1  # the last word's frames, kept whole
    return min(frames, max(keep, last)), 1


def most_positions(pipeline: Pipeline, plan: SynthesisPlan) -> int:
    """Most decoder positions a chunk of ``plan`` can hold: its prompt and cap, with the rolling
    context of :func:`chunk_context` at its largest (:func:`_context_parts` with every chunk at its
    frame cap, and the plan's earlier speech at its length, each cut at most as
    :func:`context_tail` keeps it, :func:`_tail_most`, with its whole text and a token to spare for
    a cut), and never more than ``plan.max_length`` (:func:`chunk_context` drops context past it)."""
    n = pipeline.constants.num_codebooks

    def at_cap(j: int) -> np.ndarray:  # a stand-in of chunk j's most frames (no memory of its own)
        return np.broadcast_to(np.int64(0), (plan.chunks[j][1], n))

    most = 0
    for index, (text, cap) in enumerate(plan.chunks):
        ref_codes, ref_text, parts = _context_parts(plan, index, at_cap)
        extra = 0
        for codes, words in parts:
            frames, spare = _tail_most(len(codes), words, plan.context_frames)
            extra += spare + token_count(pipeline, words) + 2 + frames + n - 1
        most = max(most, min(plan.max_length, chunk_positions(pipeline, text, cap, ref_codes, ref_text) + extra))
    return most

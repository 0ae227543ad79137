"""One synthesis request: what to say, in which voice, how to sample, how to stream.

Every front door builds a :class:`SynthesisRequest` before anything is loaded or
written: the Python API (:meth:`higgs_pack.runtime.api.TTS.synthesize` and
:meth:`~higgs_pack.runtime.api.TTS.stream`, from their keywords) and the CLI's
``synthesize`` (from its flags).  A request is frozen and checked when it is made:
every bad field is named with the value given, what is allowed, and the flag and
keyword that set it, all in one :class:`~higgs_pack.errors.InputError`.

What needs the loaded bundle is resolved afterwards, each in one place: the sampling
options (:meth:`SynthesisRequest.sampling_options`: the bundle's manifest
``generation`` defaults fill the fields the request leaves unset), the reference clip
(:meth:`Voice.prepared`: resampled to the codec's rate) and the text against the
tokenizer's special tokens (:func:`higgs_pack.runtime.loop.prompt.check_text_tokens`).

Runtime code: no torch, no build tools.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from numbers import Integral
from typing import Any

import numpy as np

from higgs_pack.errors import InputError, Problem, literal, unknown_choice
from higgs_pack.runtime.options import (
    CHUNK_GROWTH,
    CONTEXT_CHUNKS,
    CONTEXT_FRAMES,
    FIELDS,
    FIRST_CHUNK_FRAMES,
    MAX_CHUNK_FRAMES,
    SamplingOptions,
    bundle_sampling,
    cli_name,
    how_set,
    python_name,
    value_problems,
)
from higgs_pack.runtime.text import clean, plain_type
from higgs_pack.runtime.text import problem as unspeakable  # the one text check of every front door

Audio = str | os.PathLike | tuple[np.ndarray, int]
"""A reference clip: a file libsndfile reads, or ``(samples, sample_rate)`` (float32 [samples]
or [samples, channels] in [-1, 1], Hz)."""


def say(problem: Problem) -> str:
    """A problem in the Python API's terms: the keyword, and how to set it (``; set it with top_p=``);
    the CLI says it again in its own (:func:`cli_say`)."""
    return problem.render(name=python_name(problem.field), how=how_set(problem.field))


def cli_say(problem: Problem, text: str = "--text") -> str:
    """A problem in the CLI's terms: the flag (``--top-p must be ...``), the words' source for the
    text (``text``: ``--text``, ``--text-file FILE``, ``standard input``), no Python keyword; a
    whole sentence that does not name its field ends "; set it with FLAG"."""
    name = cli_name(problem.field, text)
    unnamed = problem.message and "{name}" not in problem.message and name != problem.field
    return problem.render(name=name, how=name if unnamed else None)


def refuse(problems: list[Problem]) -> None:
    """Raise one :class:`InputError` carrying every problem (:func:`say` for its message);
    nothing when there is none."""
    if problems:
        raise InputError(problems=problems, render=say)


def _is_whole(value: Any) -> bool:
    return isinstance(value, Integral) and not isinstance(value, bool)


def _unspeakable_problems(field: str, value: Any, fix: str = "", why: str = "there is nothing to speak"
                          ) -> list[Problem]:
    """:func:`unspeakable` of ``value`` as the problem of ``field`` (each front door names the field
    in its own terms), else ``[]``."""
    problem = unspeakable(value, "\0", why)
    return [] if problem is None else [Problem(field, value, message=literal(problem).replace("\0", "{name}"),
                                                fix=fix)]


def text_problems(text: Any) -> list[Problem]:
    """The problem of text that cannot be spoken (:func:`unspeakable`), else ``[]``."""
    return _unspeakable_problems("text", text)


def voice_pair_problems(audio: Any, transcript: Any) -> list[Problem]:
    """The message when only one of a reference clip and its transcript is given, else ``[]``.

    The one pairing rule of every path into the loop; the transcript, when given beside a clip,
    must be speakable text (:func:`unspeakable`: a string, valid Unicode, not blank).
    """
    if audio is None and transcript is None:
        return []
    if audio is not None and transcript is not None:
        return _unspeakable_problems("ref_text", transcript, "give the exact transcript of the reference audio",
                                     why="a transcript holds the words the clip says")
    return [Problem(None, None, message=(
        "voice cloning needs both ref_audio= and ref_text= (--ref-audio with --ref-text): the reference "
        "clip and its exact transcript; give both, or neither for the bundle's own voice"))]


@dataclass(frozen=True)
class Voice:
    """The voice to clone: a reference clip and its exact transcript.

    Attributes:
        audio: a file path, or ``(samples, sample_rate)`` (see :data:`Audio`).
        transcript: what is said in the clip (non-empty).

    Raises:
        InputError: a missing file, a malformed tuple or an empty transcript.
    """

    audio: Audio
    transcript: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "transcript", clean(self.transcript))  # the one text rule (runtime/text.py)
        refuse(voice_problems(self.audio, self.transcript))

    def prepared(self, sample_rate: int, hop_length: int) -> np.ndarray:
        """The clip as the codec encoder takes it (:func:`higgs_pack.runtime.audio.prepare_reference`).

        Args:
            sample_rate: the codec's rate in Hz (24000).
            hop_length: samples per codec frame (960).

        Returns:
            float32 [k * hop_length] mono at ``sample_rate``.

        Raises:
            InputError: unreadable, too short or long, silent, or non-finite.
        """
        from higgs_pack.runtime.audio import load_audio, prepare_reference

        if isinstance(self.audio, tuple):
            samples = np.asarray(self.audio[0], dtype=np.float32)
            samples = samples.mean(axis=1) if samples.ndim == 2 else samples
            return prepare_reference(samples, int(self.audio[1]), sample_rate, hop_length, "ref_audio")
        samples, rate = load_audio(self.audio)
        return prepare_reference(samples, rate, sample_rate, hop_length, str(self.audio))


@dataclass(frozen=True, eq=False)
class PreparedVoice:
    """A voice encoded once by a bundle's codec and used by many requests (no clip to read
    or encode per request): made by :meth:`higgs_pack.runtime.api.TTS.prepare_voice`, kept
    by the server's voice store (:mod:`higgs_pack.serve.voices`).

    Attributes:
        codes: int64 [frames, N] codec codes of the reference clip (N = 8 codebooks).
        transcript: what is said in the clip (non-empty).
        name: a label for messages and listings ("" when unnamed).

    Raises:
        InputError: codes that are not int [frames >= 1, codebooks], or a blank transcript.
            The values are checked against the bundle when a request uses the voice
            (:func:`higgs_pack.runtime.loop.codec.check_voice_codes`).
    """

    codes: np.ndarray
    transcript: str
    name: str = ""

    def __post_init__(self) -> None:
        object.__setattr__(self, "transcript", clean(self.transcript))  # the one text rule (runtime/text.py)
        codes = np.asarray(self.codes)
        found = voice_pair_problems(codes, self.transcript)
        if codes.ndim != 2 or codes.shape[0] < 1 or not np.issubdtype(codes.dtype, np.integer):
            found.append(Problem("voice", None, message=f"a prepared voice's codes must be int64 [frames >= 1, "
                                                        f"codebooks], got {codes.dtype} {list(codes.shape)}"))
        refuse(found)
        object.__setattr__(self, "codes", codes.astype(np.int64, copy=False))

    @property
    def seconds(self) -> float:
        """Length of the reference clip (25 frames per second)."""
        return self.codes.shape[0] / 25.0


def voice_problems(audio: Any, transcript: Any) -> list[Problem]:
    """One problem per bad part of a voice; ``[]`` when usable.  A clip file is checked to exist and
    its header is read (audio libsndfile reads, 0.5 s to 60 s); its samples are read later."""
    from higgs_pack.runtime.audio import check_audio_file

    found = voice_pair_problems(audio, transcript)
    if audio is None:
        return found
    if isinstance(audio, tuple):
        found += _tuple_problems(audio)
    elif isinstance(audio, (str, os.PathLike)):
        try:
            check_audio_file(audio)
        except InputError as exc:
            found.append(Problem("ref_audio", os.fspath(audio), message=literal(str(exc))))
    else:
        found.append(Problem("ref_audio", audio, message="{name} must be a file path or a (samples, sample_rate) "
                                                         f"tuple, got {plain_type(audio)}"))
    return found


def _tuple_problems(audio: tuple) -> list[Problem]:
    if len(audio) != 2:
        return [Problem("ref_audio", None, message="{name}= takes a file path or a (samples, sample_rate) tuple, "
                                                   f"got a tuple of {len(audio)}")]
    try:
        shape = np.shape(audio[0])
    except ValueError:
        shape = None
    found = []
    if shape is None or len(shape) not in (1, 2):
        found.append(Problem("ref_audio", None, message="{name} samples must be [samples] or [samples, channels], "
                                                        f"got shape {shape}"))
    elif np.asarray(audio[0]).dtype.kind not in "fiub":
        found.append(Problem("ref_audio", None, message="{name} samples must be real numbers (float32 in [-1, 1]), "
                                                        f"got {np.asarray(audio[0]).dtype}"))
    if not _is_whole(audio[1]) or audio[1] <= 0:
        found.append(Problem("ref_audio", audio[1], message="{name}'s sample rate must be a whole number of Hz > 0, "
                                                            f"got {audio[1]!r}"))
    return found


@dataclass(frozen=True)
class StreamSchedule:
    """Sizes of the audio chunks a stream yields, in frames (25 per second).

    Attributes:
        first_chunk_frames: frames in the first chunk (default 10 = 0.4 s).
        chunk_growth: each later chunk is this many times the previous one (>= 1; default 2).
        max_chunk_frames: largest chunk (>= ``first_chunk_frames``; default 100 = 4 s).

    Raises:
        InputError: a field out of range (each named, with its flag and keyword).
    """

    first_chunk_frames: int = FIRST_CHUNK_FRAMES
    chunk_growth: float = CHUNK_GROWTH
    max_chunk_frames: int = MAX_CHUNK_FRAMES

    def __post_init__(self) -> None:
        refuse(schedule_problems(self.first_chunk_frames, self.chunk_growth, self.max_chunk_frames))


def schedule_problems(first_chunk_frames: Any, chunk_growth: Any, max_chunk_frames: Any) -> list[Problem]:
    """One problem per bad field of a :class:`StreamSchedule` (the declared limits,
    :func:`~higgs_pack.runtime.options.value_problems`, then the largest chunk against the first);
    ``[]`` when usable."""
    found = value_problems({"first_chunk_frames": first_chunk_frames, "chunk_growth": chunk_growth,
                            "max_chunk_frames": max_chunk_frames})
    if not {p.field for p in found} & {"first_chunk_frames", "max_chunk_frames"} \
            and max_chunk_frames < first_chunk_frames:
        found.append(Problem("max_chunk_frames", max_chunk_frames, f">= first_chunk_frames ({first_chunk_frames})",
                             fix=f"first_chunk_frames is set with {how_set('first_chunk_frames')}",
                             code="conflicting_fields"))  # two fields that disagree
    return found


@dataclass(frozen=True)
class SynthesisRequest:
    """Everything one utterance needs besides the bundle, checked when made.

    Build it with :meth:`create` (the keywords the Python API and the CLI take) or field
    by field.  ``None`` in a sampling field means "the bundle's default"
    (:meth:`sampling_options`).

    Attributes:
        text: what to say (not empty; inline controls like ``<|emotion:amusement|>`` pass
            as text unless the tokenizer has them as special tokens).
        voice: the :class:`Voice` (a clip) or :class:`PreparedVoice` (codes) to clone, or
            None for the bundle's own voice.
        seed: seed of the sampler (>= 0), or None for a fresh one each time.
        temperature: >= 0 (0 = greedy), or None.
        top_k: >= 0 (0 = all codes), or None.
        top_p: in (0, 1], or None.
        max_frames: frame cap per text chunk, >= 1 (25 frames per second), or None: from
            the text length.
        schedule: the :class:`StreamSchedule` a stream of this request follows.
        context_chunks: a long text's rolling context: how many previous text chunks (their
            text and codes) open each chunk's prompt, after the voice (>= 0; default
            :data:`CONTEXT_CHUNKS`; 0: chunks packed to the context, each opening with the voice
            alone: the clip's, or with none the first chunk's speech).
        context_frames: most frames of each context chunk kept in a prompt (its end, cut at a
            word; >= 1; default :data:`CONTEXT_FRAMES`), or None: whole chunks.
        context: earlier speech that follows the voice in the first text chunk's prompt, oldest
            first, each a :class:`PreparedVoice` (its codes and what it says): a live session's
            previous sentences (serve/live.py).  Each becomes one ``<|ref_text|> text
            <|ref_audio|> codes`` pair after the voice's, as a long text's earlier chunks do
            (:func:`higgs_pack.runtime.loop.plan.chunk_context`), so the voice stays the
            prompt's prefix and its KV is restored from the prefix cache.  Needs ``voice``; the
            last ``context_chunks`` are used (fewer where the decoder's context is short).
            Not a keyword of :meth:`create` (set the field).

    Raises:
        InputError: one message naming every bad field, its value and what is allowed.
    """

    text: str
    voice: Voice | PreparedVoice | None = None
    seed: int | None = 0
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    max_frames: int | None = None
    schedule: StreamSchedule = field(default_factory=StreamSchedule)
    context_chunks: int = CONTEXT_CHUNKS
    context_frames: int | None = CONTEXT_FRAMES
    context: tuple[PreparedVoice, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "text", clean(self.text))  # the one text rule (runtime/text.py)
        refuse(request_problems(self.text, self._chosen(), self.max_frames, self.context_chunks, self.context_frames)
               + context_problems(self.context, self.voice))

    def _chosen(self) -> dict[str, Any]:
        """The sampling fields this request sets (the seed always; the others unless None)."""
        return _chosen(self.seed, self.temperature, self.top_k, self.top_p)

    @classmethod
    def create(
        cls,
        text: str,
        *,
        ref_audio: Audio | None = None,
        ref_text: str | None = None,
        voice: PreparedVoice | None = None,
        seed: int | None = 0,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        max_frames: int | None = None,
        first_chunk_frames: int = FIRST_CHUNK_FRAMES,
        chunk_growth: float = CHUNK_GROWTH,
        max_chunk_frames: int = MAX_CHUNK_FRAMES,
        context_chunks: int = CONTEXT_CHUNKS,
        context_frames: int | None = CONTEXT_FRAMES,
        **unknown: Any,
    ) -> SynthesisRequest:
        """A request from the keywords of ``TTS.synthesize`` / ``TTS.stream`` (the CLI's flags).

        Args:
            text: what to say.
            ref_audio: reference voice to clone, a file or ``(samples, sample_rate)``; needs ``ref_text``.
            ref_text: exact transcript of ``ref_audio``.
            voice: a :class:`PreparedVoice` (``tts.prepare_voice``), instead of ``ref_audio``.
            seed: sampler seed (same seed, bundle and device -> same audio); None: random.
            temperature: 0 = greedy; None = the bundle's default (0.8).
            top_k: keep the k most likely codes (0 = all); None = the bundle's default (50).
            top_p: nucleus mass in (0, 1]; None = the bundle's default (1.0 = off).
            max_frames: frame cap per chunk at 25 frames per second; None: from the text length.
            first_chunk_frames, chunk_growth, max_chunk_frames: the :class:`StreamSchedule`.
            context_chunks: previous text chunks kept as context of a long text's next one
                (>= 0, default 1).
            context_frames: most frames of each such chunk kept (its end, cut at a word;
                >= 1; default :data:`CONTEXT_FRAMES`, 10 s), or None: whole chunks.

        Raises:
            InputError: every bad field at once (field, value, what is allowed, flag/keyword), or
                an unknown keyword (with a close match).
        """
        if unknown:
            _refuse_unknown(unknown)
        if voice is not None:
            found = [] if isinstance(voice, PreparedVoice) else [Problem("voice", None, message=(
                f"{{name}} must be a PreparedVoice (from tts.prepare_voice), got {plain_type(voice)}; for a clip "
                "use ref_audio= with ref_text="))]
            if ref_audio is not None or ref_text is not None:
                found.append(Problem("voice", None, message="give a voice as voice= (prepared) or as ref_audio= "
                                                            "with ref_text=, not both", code="conflicting_fields"))
        else:
            found = voice_problems(ref_audio, ref_text)
        refuse(found
                + schedule_problems(first_chunk_frames, chunk_growth, max_chunk_frames)
                + request_problems(text, _chosen(seed, temperature, top_k, top_p), max_frames, context_chunks,
                                   context_frames))
        if voice is None and ref_audio is not None:
            voice = Voice(ref_audio, ref_text)  # type: ignore[arg-type]
        return cls(text, voice,
                   seed, temperature, top_k, top_p, max_frames,
                   StreamSchedule(first_chunk_frames, chunk_growth, max_chunk_frames), context_chunks, context_frames)

    @classmethod
    def of(cls, text: str | SynthesisRequest, keywords: dict[str, Any]) -> SynthesisRequest:
        """``text`` if it already is a request (then no keywords), else :meth:`create` of ``text`` and ``keywords``.

        Raises:
            InputError: an unknown keyword (with a close match), keywords beside a request,
                or a bad field.
        """
        if isinstance(text, SynthesisRequest):
            if keywords:
                raise InputError.of(Problem.said(f"a SynthesisRequest carries its own options; got {', '.join(sorted(keywords))} "
                                 "beside it (set them when making the request)"))
            return text
        return cls.create(text, **keywords)

    def sampling_options(self, generation_defaults: dict[str, Any]) -> SamplingOptions:
        """The options the loop samples with: the bundle's defaults, then this request's choices.

        Args:
            generation_defaults: ``Pipeline.generation_defaults`` (from the manifest's ``generation``).

        Raises:
            InputError: the bundle's own defaults are out of range (names the option).
        """
        try:
            return bundle_sampling(generation_defaults, **self._chosen())
        except InputError as exc:
            raise InputError.of(Problem.said(f"{exc} (the bundle's manifest 'generation' defaults with this request's "
                             "options); rebuild the bundle or set the option explicitly")) from exc


def _chosen(seed: Any, temperature: Any, top_k: Any, top_p: Any) -> dict[str, Any]:
    chosen = {"temperature": temperature, "top_k": top_k, "top_p": top_p}
    return {"seed": seed, **{k: v for k, v in chosen.items() if v is not None}}


def _refuse_unknown(keywords: dict[str, Any]) -> None:
    """Refuse keywords that are not request fields, with the closest known one."""
    known = [name for name in FIELDS if name != "text"]
    name = next(iter(keywords))
    raise InputError(problems=[Problem(name, None, message=literal(unknown_choice(
        "synthesis option", name, known, "the keywords of SynthesisRequest.create")))])


def context_problems(context: Any, voice: Any) -> list[Problem]:
    """The problem of a request's ``context`` (:attr:`SynthesisRequest.context`): not a tuple of
    :class:`PreparedVoice`, or given without a voice; ``[]`` when usable."""
    if not isinstance(context, tuple) or not all(isinstance(part, PreparedVoice) for part in context):
        kinds = ", ".join(sorted({plain_type(part) for part in context})) if isinstance(context, (tuple, list)) \
            else plain_type(context)
        return [Problem("context", None, message="{name} must be a tuple of PreparedVoice (earlier speech's codes "
                                                 f"and text), got {kinds}")]
    if context and voice is None:
        return [Problem("context", None, message="{name} follows the voice in the prompt and needs one: give voice= "
                                                 "(with none, make the oldest speech the voice)")]
    return []


def request_problems(text: Any, sampling: dict[str, Any], max_frames: Any,
                     context_chunks: Any = CONTEXT_CHUNKS, context_frames: Any = None) -> list[Problem]:
    """One problem per bad field of the text, the chosen sampling fields, the frame cap and the
    rolling context; ``[]`` when usable.  The values are judged by their declaration
    (:func:`~higgs_pack.runtime.options.value_problems`); ``None`` leaves the frame cap and
    ``context_frames`` unset."""
    values = {**sampling, "context_chunks": context_chunks, "max_frames": max_frames, "context_frames": context_frames}
    return text_problems(text) + value_problems({k: v for k, v in values.items() if v is not None})

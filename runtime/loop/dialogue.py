"""Dialogue: a script of turns, each with a speaker, spoken in one audio with a voice per speaker.

Every front door (``TTS.dialogue`` and ``TTS.stream_dialogue``, ``higgs-pack dialogue``,
``POST /v1/audio/dialogue``) makes one :class:`DialogueRequest`, checked when made; it is
planned against a loaded bundle into one :class:`~higgs_pack.runtime.loop.plan.SynthesisPlan`
(:func:`plan_dialogue`) whose text chunks are the turns' chunks in order and whose
:class:`~higgs_pack.runtime.loop.plan.Cast` says each chunk's turn and speaker.  That plan
runs where any plan runs (``run_plan``, ``stream_plan``, the engine), with the same rolling
context: each chunk's prompt opens with its speaker's voice (a named voice, a clip with its
transcript, or none: then the speaker's first turn becomes its voice) and the speaker's last
``context_chunks`` chunks (:func:`~higgs_pack.runtime.loop.plan.chunk_context`).  The turns join
as continuous speech (:func:`~higgs_pack.runtime.loop.synthesis.join_results`) with one exact
segment per turn.

Why only the speaker's own turns as context: the TTS prompt (MODEL.md) has no speaker tag, so
another speaker's codes in the reference slot would pull the voice towards that speaker; Higgs'
own multi-speaker generator tags turns with ``[SPEAKERn]`` in a chat prompt that this model's
TTS prompt does not have (../shared/SPEECH-AT-LENGTH.md).

Runtime code: no torch, no build tools.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from higgs_pack.errors import HiggsPackError, InputError, Problem, literal
from higgs_pack.runtime.loop.codec import check_voice_codes, encode_reference
from higgs_pack.runtime.loop.pipeline import Pipeline
from higgs_pack.runtime.loop.plan import CHUNK_WORDS, Cast, SynthesisPlan, most_positions
from higgs_pack.runtime.loop.prompt import check_text_tokens
from higgs_pack.runtime.loop.text_chunks import plan_chunks, voice_room_problems
from higgs_pack.runtime.request import (
    PreparedVoice,
    SynthesisRequest,
    Voice,
    plain_type,
    refuse,
    say,
    unspeakable,
)
from higgs_pack.runtime.text import clean
from higgs_pack.runtime.text import lines as text_lines

#: Most turns in one dialogue: an hour of conversation is some hundreds; a script past this is
#: refused before anything is generated (split it into several dialogues).
MAX_TURNS = 1000
#: Most problems of a dialogue's turns said at once (enough to fix first: a broken file would list
#: every line); past it :data:`MORE_PROBLEMS` says there may be more.
TURN_PROBLEMS_SAID = 10
MORE_PROBLEMS = Problem("turns", None, message="(and maybe more: fix these first)")
#: Longest speaker name (characters).
MAX_SPEAKER_CHARS = 64
_LINE = re.compile(r"^\s*(?P<speaker>[^:]{1,200}?)\s*:\s*(?P<text>.*)$")


@dataclass(frozen=True)
class Turn:
    """One turn of a dialogue.

    Attributes:
        speaker: who says it (1 to :data:`MAX_SPEAKER_CHARS` characters, no ``:``).
        text: what they say (speakable text; inline controls pass as text).
        where: how errors name it, in its door's terms (:func:`turn_label`): a script's line
            (``line 4 of talk.txt``, counted from 1 as editors count), the HTTP body's JSON path
            (``turns[3]``, counted from 0 as the error's ``param`` is); None: ``turn N`` (the
            Python API's, counted from 1).  Not part of its value.
    """

    speaker: str
    text: str
    where: str | None = dataclasses.field(default=None, compare=False, repr=False)


def turn_label(turn: Any, index: int) -> str:
    """How every message names the turn at ``index`` (from 0): its :attr:`Turn.where` (a script's
    ``line 4 of talk.txt``, the HTTP body's ``turns[3]``), else ``turn N`` counted from 1 (the
    Python API's); one label per turn, whichever check finds its problem."""
    where = turn.where if isinstance(turn, Turn) else None
    return where or f"turn {index + 1}"


def turn_problems(turns: Any) -> list[Problem]:
    """One problem per bad turn (each named by :func:`turn_label`), and one for no turns or more
    than :data:`MAX_TURNS`; ``[]`` when the turns can be spoken."""
    if not isinstance(turns, (list, tuple)):
        return [Problem("turns", None, message=f"{{name}} must be a list of turns, got {plain_type(turns)}")]
    if not turns:
        return [Problem("turns", None, message="{name} is empty: a dialogue needs at least one turn")]
    if len(turns) > MAX_TURNS:
        return [Problem("turns", None, message=f"{{name}} holds {len(turns)} turns; at most {MAX_TURNS} are spoken "
                                               "in one dialogue: split the script into several")]
    found: list[Problem] = []
    for index, turn in enumerate(turns):
        label = turn_label(turn, index)
        if not isinstance(turn, Turn):
            if isinstance(turn, (list, tuple)):
                got = f"{len(turn)} item{'s' * (len(turn) != 1)} ({repr(turn)[:60]})"
            elif isinstance(turn, Mapping):
                got = f"a mapping with {sorted(map(str, turn))[:5]} (it needs exactly speaker and text)"
            else:
                got = plain_type(turn)
            found.append(Problem("turns", None, message=literal(f"{label} must be a Turn(speaker, text) or "
                                                                f"a (speaker, text) pair, got {got}")))
            continue
        found += _speaker_problems(turn.speaker, label, f"turns[{index}].speaker")
        name = turn.speaker[:40] if isinstance(turn.speaker, str) else turn.speaker
        problem = unspeakable(turn.text, f"the text of {label} ({name!r})")
        if problem is not None:
            found.append(Problem(f"turns[{index}].text", None, message=literal(problem)))
        if len(found) >= TURN_PROBLEMS_SAID:
            found.append(MORE_PROBLEMS)
            break
    return found


#: A voice's parts by the request fields the runtime names them with.
VOICE_PARTS = {"ref_text": "text", "ref_audio": "audio"}


def voice_problem(name: str, problem: Problem) -> Problem:
    """``problem`` of speaker ``name``'s voice: one of its transcript or clip (``ref_text``,
    ``ref_audio``) as the field ``voices.NAME.text`` / ``voices.NAME.audio``, which each door names
    in its terms (HTTP: that path; the CLI: ``--voice NAME``'s transcript); another one of the voice."""
    part = VOICE_PARTS.get(problem.field or "")
    if part is not None and "{name}" in problem.message:  # "{name} is empty": named by each door
        return dataclasses.replace(problem, field=f"voices.{name}.{part}")
    return Problem(f"voices.{name}" + (f".{part}" if part else ""), None,
                   message=literal(f"the voice of {name!r}: {problem.render()}"), code=problem.code)


def plain(exc: BaseException) -> str:
    """An error said without the Python keyword / CLI flag that sets its field (a turn's text is
    a script line or a ``turns`` item, a voice a ``--voice`` or a ``voices`` entry, not
    ``--text / text=`` or ``--ref-audio / ref_audio=``): the dialogue names where it is instead."""
    return exc.say(Problem.render) if isinstance(exc, InputError) else str(exc)


def _speaker_problems(speaker: Any, where: str, field: str = "turns") -> list[Problem]:
    problem = unspeakable(speaker, f"the speaker of {where}", "a speaker is named by a word or more")
    if problem is None and (len(speaker) > MAX_SPEAKER_CHARS or ":" in speaker or "\n" in speaker):
        problem = (f"the speaker of {where} ({speaker[:40]!r}) must be a name of at most {MAX_SPEAKER_CHARS} "
                   "characters without ':' or a line break")
    return [] if problem is None else [Problem(field, None, message=literal(problem))]


def speaker_name(name: Any) -> Any:
    """A speaker's name as every door reads one (a turn's, a voice's key, ``--voice NAME=``): the one
    text rule's :func:`~higgs_pack.runtime.text.clean` (a leading BOM dropped) and surrounding
    whitespace stripped (" ANN " is ANN, as in a script); what is not a string is kept as it is."""
    name = clean(name)
    return name.strip() if isinstance(name, str) else name


def named_twice(keys: Iterable[Any]) -> dict[Any, list[Any]]:
    """The speakers that more than one of ``keys`` names once read as :func:`speaker_name` reads
    them (``"A"``, ``" A "`` and ``"A\\n"`` are one speaker), each with those keys in their order:
    every door refuses them (HTTP ``duplicate_field``, ``--voice``, Python ``voices``)."""
    seen: dict[Any, list[Any]] = {}
    for key in keys:
        seen.setdefault(speaker_name(key), []).append(key)
    return {speaker: given for speaker, given in seen.items() if len(given) > 1}


def twice_message(speaker: Any, keys: Iterable[Any], show: Callable[[Any], str]) -> str:
    """What every door says of a speaker that several ``voices`` keys name (:func:`named_twice`),
    each name shown by ``show`` (each door's own quoting)."""
    return (f"voices gives {show(speaker)} more than once (the keys {', '.join(map(show, keys))} are one "
            "speaker's name); give each speaker one voice")


def key_problem(name: Any, what: str, who: str = "a speaker of the turns") -> str | None:
    """Why ``name``, given as the speaker of a voice (a ``voices`` key, ``--voice NAME=``), cannot
    name a speaker, or None: the one text rule (:func:`~higgs_pack.runtime.text.problem`), said
    with ``what`` (each door's own name of the field) at every door."""
    problem = unspeakable(name, what, "")
    return None if problem is None else f"{problem}; {what} is the name of {who}"


def as_turns(turns: Iterable[Any]) -> list[Any]:
    """``turns`` as :class:`Turn` items where they are ``Turn``, ``(speaker, text)`` pairs or
    ``{"speaker", "text"}`` mappings, each speaker's name stripped of surrounding whitespace;
    other items are kept as they are for :func:`turn_problems` to name."""
    out: list[Any] = []
    for turn in turns:
        if isinstance(turn, Mapping) and set(turn) == {"speaker", "text"}:
            turn = Turn(turn["speaker"], turn["text"])
        elif isinstance(turn, tuple) and len(turn) == 2:
            turn = Turn(*turn)
        if isinstance(turn, Turn):  # the one text rule (runtime/text.py); " ANN " is ANN, as in a script
            turn = dataclasses.replace(turn, speaker=speaker_name(turn.speaker), text=clean(turn.text))
        out.append(turn)
    return out


def stray_voices(voices: Iterable[Any], speakers: list[str]) -> list[Problem]:
    """The problem of voices given for names that speak no turn (``[]`` with no speakers: the turns'
    own problems are said instead)."""
    stray = [name for name in voices if name not in speakers] if speakers else []
    if not stray:
        return []
    who = "who speaks" if len(stray) == 1 else "who speak"
    return [Problem("voices", None, message="{name} names " + literal(
        f"{', '.join(repr(str(n)[:40]) for n in stray[:5])}, {who} no turn; the speakers "
        f"are {', '.join(repr(n) for n in speakers[:20])}"))]


def parse_script(script: str, source: str = "the script", voices: Iterable[str] = ()) -> list[Turn]:
    """The turns of a plain-text script: one turn per line, ``NAME: text``; blank lines and lines
    starting with ``#`` are skipped.

    Args:
        script: the script's text (decoded).
        source: how messages name it (a file path).
        voices: the speakers a voice is given for (``--voice``): one named by no line of the script
            is said with the script's own problems, all at once.

    Raises:
        InputError: a line without ``NAME:``, a control character (:func:`~higgs_pack.runtime.text.problem`), a turn with nothing
            to say, no turns, more than :data:`MAX_TURNS`: each named by its line number.
    """
    turns: list[Turn] = []
    found: list[Problem] = []
    for number, line in enumerate(text_lines(script), 1):  # LF, CR LF, CR: the one line rule (runtime/text.py)
        if not line.strip() or line.lstrip().startswith("#"):
            continue
        match = _LINE.match(line)
        if match is None or not match["speaker"].strip():
            found.append(Problem("turns", None, message=literal(
                f"line {number} of {source} has no speaker: write it as NAME: text (got {line.strip()[:60]!r})")))
        else:
            turns.append(Turn(match["speaker"].strip(), match["text"].strip(), f"line {number} of {source}"))
        if len(found) >= TURN_PROBLEMS_SAID:
            break
    if len(turns) > MAX_TURNS:
        found.append(Problem("turns", None, message=literal(
            f"{source} holds {len(turns)} turns; at most {MAX_TURNS} are spoken in one dialogue: split it")))
    elif turns and len(found) < TURN_PROBLEMS_SAID:
        found += turn_problems(turns)  # named by their lines in the file (each turn's where)
    if found:  # said beside the script's problems (DialogueRequest.create says it of a good script)
        found += stray_voices(voices, list(dict.fromkeys(turn.speaker for turn in turns)))
    if not turns and not found:
        found = [Problem("turns", None, message=literal(f"{source} holds no turns: write one per line, NAME: text"))]
    refuse(found)
    return turns


VoiceChoice = Voice | PreparedVoice | None
"""A speaker's voice: a clip with its transcript, a prepared (named) voice, or None (its first
turn becomes its voice)."""


@dataclass(frozen=True, eq=False)
class DialogueRequest:
    """A dialogue, checked when made: its turns, a voice per speaker, and the sampling, frame cap,
    stream schedule and rolling context of :class:`~higgs_pack.runtime.request.SynthesisRequest`.

    Attributes:
        turns: the :class:`Turn` items, in order.
        voices: speaker -> its :data:`VoiceChoice`; a speaker left out has no voice of its own.
        options: a request that holds the shared fields (seed, temperature, top_k, top_p,
            max_frames, schedule, context_chunks); its text is the first turn's.

    Raises:
        InputError: every bad turn named (``turn N``), a voice for a speaker with no turn (the
            speakers listed), a voice that is not a clip or a prepared voice.
    """

    turns: tuple[Turn, ...]
    voices: Mapping[str, VoiceChoice]
    options: SynthesisRequest

    @classmethod
    def create(cls, turns: Iterable[Any], voices: Mapping[str, Any] | None = None,
               **keywords: Any) -> DialogueRequest:
        """A dialogue from the keywords of ``TTS.dialogue``.

        Args:
            turns: :class:`Turn` items, ``(speaker, text)`` pairs or ``{"speaker", "text"}`` mappings.
            voices: speaker -> a :class:`~higgs_pack.runtime.request.PreparedVoice`, a
                :class:`~higgs_pack.runtime.request.Voice`, an ``(audio, transcript)`` pair (a file
                or ``(samples, sample_rate)``, and the clip's exact words), or None.
            keywords: those of :meth:`SynthesisRequest.create
                <higgs_pack.runtime.request.SynthesisRequest.create>` but the voice's (``seed``,
                ``temperature``, ``top_k``, ``top_p``, ``max_frames``, the stream schedule,
                ``context_chunks``).

        Raises:
            InputError: as the class says, and every bad keyword.
        """
        turns = as_turns(turns) if isinstance(turns, (list, tuple)) else turns
        found: list[Problem] = turn_problems(turns)  # every problem of the dialogue at once
        if voices is not None and not isinstance(voices, Mapping):
            raise InputError(problems=[*found, Problem("voices", None, message=literal(
                f"voices must be a mapping of speaker name to voice (a prepared voice, a (clip, transcript) "
                f"pair or None), got {plain_type(voices)}"))])
        voices = dict(voices or {})
        for name in list(voices):  # a key is a speaker's name: the text rule, as a turn's speaker and HTTP's key
            if (problem := key_problem(name, f"voices[{name!r:.60}]")) is not None:
                found.append(Problem.said(problem, "voices"))
                del voices[name]
        for speaker, given in named_twice(voices).items():  # one speaker, two keys: as HTTP and --voice refuse it
            found.append(Problem.said(twice_message(speaker, given, lambda key: f"{key!r:.60}"), "voices"))
        voices = {speaker_name(name): voice for name, voice in voices.items()}  # as the turns' speakers
        speakers = [] if found else list(dict.fromkeys(turn.speaker for turn in turns))  # (bad turns: no speakers)
        found += stray_voices(voices, speakers)
        chosen: dict[str, VoiceChoice] = {}
        for name, voice in voices.items():
            if isinstance(voice, tuple) and len(voice) == 2 and not isinstance(voice[0], np.ndarray):
                try:
                    voice = Voice(*voice)
                except InputError as exc:
                    found += [voice_problem(name, problem) for problem in exc.problems]
                    continue
            if voice is not None and not isinstance(voice, (Voice, PreparedVoice)):
                found.append(Problem("voices", None, message=literal(
                    f"the voice of {str(name)[:40]!r} must be a prepared voice (tts.prepare_voice), a Voice, an "
                    f"(audio, transcript) pair or None, got {plain_type(voice)}")))
                continue
            chosen[name] = voice
        for key in ("ref_audio", "ref_text", "voice"):
            if key in keywords:
                raise InputError.of(Problem.said(f"a dialogue takes its voices as voices={{speaker: voice}}, not {key}=", code="unknown_field"))
        try:
            options = SynthesisRequest.create(turns[0].text if speakers else "Hi.", **keywords)  # (turns: above)
        except InputError as exc:
            found += exc.problems
        refuse(found)
        return cls(tuple(turns), chosen, options)

    @property
    def text(self) -> str:
        """Every turn's text, one per line (what is spoken, for counting its tokens)."""
        return "\n".join(turn.text for turn in self.turns)

    def plan(self, pipeline: Pipeline) -> SynthesisPlan:
        """:func:`plan_dialogue` of this request."""
        return plan_dialogue(pipeline, self)


def plan_dialogue(pipeline: Pipeline, request: DialogueRequest) -> SynthesisPlan:
    """A dialogue resolved against a loaded bundle: one :class:`~higgs_pack.runtime.loop.plan.SynthesisPlan`
    of every turn's text chunks, in order, with its :class:`~higgs_pack.runtime.loop.plan.Cast`.

    Each speaker's clip is read and codec-encoded once (a prepared voice's codes checked against
    the codec); each turn is cut at sentence ends into chunks of at most
    :data:`~higgs_pack.runtime.loop.plan.CHUNK_WORDS` words that fit the context with its
    speaker's voice (:func:`~higgs_pack.runtime.loop.text_chunks.plan_chunks`).

    Raises:
        InputError: a clip that cannot be read or used, a special token in a turn or a
            transcript, a sentence too long for the context; each names the turn or speaker.
    """
    options = request.options
    sampling = options.sampling_options(pipeline.generation_defaults)
    c = pipeline.constants
    names = tuple(dict.fromkeys(turn.speaker for turn in request.turns))
    voices: list[tuple[np.ndarray | None, str | None]] = []
    for name in names:
        voice = request.voices.get(name)
        try:
            if isinstance(voice, Voice):
                check_text_tokens(pipeline, voice.transcript, "ref_text")
                voices.append((encode_reference(pipeline, voice.prepared(c.sample_rate, c.hop_length)),
                               voice.transcript))
            elif isinstance(voice, PreparedVoice):
                check_voice_codes(pipeline, voice.codes)
                check_text_tokens(pipeline, voice.transcript, "ref_text")
                voices.append((voice.codes, voice.transcript))
            else:
                voices.append((None, None))
            if voices[-1][0] is not None:  # a voice with no room left is the voice's problem, not a turn's
                refuse(voice_room_problems(pipeline, *voices[-1]))
        except InputError as exc:  # a transcript's or a clip's problem names that part of the voice
            raise InputError(problems=[voice_problem(name, problem) for problem in exc.problems],
                             render=say) from exc  # (Python: "the transcript of voices['ANN']")
        except HiggsPackError as exc:
            raise InputError(problems=[Problem(f"voices.{name}", None, message=literal(
                f"the voice of {name!r}: {plain(exc)}"))]) from exc
    chunks: list[tuple[str, int]] = []
    speakers: list[int] = []
    turns: list[int] = []
    bad: list[Problem] = []  # every turn's problem at once (up to 10), as the script's are
    for number, turn in enumerate(request.turns):
        speaker = names.index(turn.speaker)
        try:
            check_text_tokens(pipeline, turn.text)
            found = plan_chunks(pipeline, turn.text.strip(), *voices[speaker], options.max_frames, CHUNK_WORDS)
        except InputError as exc:
            said = exc.say(lambda problem: problem.render(name="its text" if problem.field == "text" else None))
            bad.append(Problem(f"turns[{number}].text", None, message=literal(
                f"{turn_label(turn, number)} ({turn.speaker!r}): {said}")))
            if len(bad) >= TURN_PROBLEMS_SAID:
                bad.append(MORE_PROBLEMS)
                break
            continue
        chunks += found
        speakers += [speaker] * len(found)
        turns += [number] * len(found)
    refuse(bad)
    cast = Cast(names, tuple(voices), tuple(speakers), tuple(turns), tuple(turn.text.strip() for turn in request.turns))
    plan = SynthesisPlan(sampling, None, None, tuple(chunks), options.schedule, 0, options.context_chunks,
                         pipeline.decoder.max_length, getattr(pipeline.decoder, "max_prompt_length", None), cast,
                         options.context_frames)
    return dataclasses.replace(plan, positions=most_positions(pipeline, plan))

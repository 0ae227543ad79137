"""Barge-in on the live route (``input.cancel`` with ``played_ms``; docs/serving/live.md): which
sentence the client was playing, which of its words the listener heard, and the codes of those
words, so the session's rolling context keeps only what was heard.  Word times are estimates
(:mod:`~higgs_pack.runtime.loop.words`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from higgs_pack.errors import Problem
from higgs_pack.runtime.loop.decode import GenerationResult
from higgs_pack.runtime.loop.words import Word, heard_words, word_timings, words_prefix
from higgs_pack.serve.errors import refused
from higgs_pack.serve.integrations.protocol import SPEECH_CHARS_PER_S, spoken_chars
from higgs_pack.serve.speech import got

#: Sentences whose audio went out that a barge-in's ``sentence_index`` may name (the last ones).
PLAYED_KEPT = 8


@dataclass
class Played:
    """A sentence whose audio went out (from its ``audio.start``): what a barge-in's
    ``played_ms`` is measured against.

    Attributes:
        index: the sentence's index.
        text: its text.
        first: session samples sent before its first audio (its pause included).
        speech: session samples before its speech (after the pause); None before its speech.
        stream: its :class:`~higgs_pack.runtime.loop.streaming.SpeechStream` (codes pushed so far).
        cap: its frame cap.
        words: its word timings, seconds from its speech's start as generated (at speed 1; from
            ``audio.done``); None while it is still being generated.
        speed: the session's ``speed`` (0.25 to 4.0): its audio went out stretched, ``1 / speed``
            times as long as generated (:mod:`~higgs_pack.serve.tempo`).
    """

    index: int
    text: str
    first: int
    stream: Any
    cap: int
    speech: int | None = None
    words: tuple[Word, ...] | None = None
    speed: float = 1.0


def played_record(played: list[Played], index: int | None) -> Played | None:
    """The sentence a barge-in's ``played_ms`` is of: ``index``'s among ``played`` (the sentences
    whose audio went out, oldest first), or the last (None when there is none).

    Raises:
        ApiError: ``index`` names no sentence of ``played``.
    """
    if index is None:
        return played[-1] if played else None
    found = [p for p in played if p.index == index]
    if not found:
        known = ", ".join(str(p.index) for p in played) or "none yet"
        raise refused(Problem.said(f"sentence_index {index} is not a sentence whose audio was sent (of the last "
                                   f"{PLAYED_KEPT}: {known}); give an audio.start's sentence_index", "sentence_index",
                                   index))
    return found[0]


def cancel_fields(data: dict[str, Any]) -> tuple[float | None, int | None]:
    """``input.cancel``'s ``played_ms`` and ``sentence_index`` (None where absent).

    Raises:
        ApiError: 400 naming a bad one (``sentence_index`` needs ``played_ms``).
    """
    played_ms, index = data.get("played_ms"), data.get("sentence_index")
    if played_ms is not None and not (isinstance(played_ms, (int, float)) and not isinstance(played_ms, bool)
                                      and math.isfinite(played_ms) and played_ms >= 0):
        raise refused(Problem.said(f"played_ms is the milliseconds of the sentence's audio the client played, a "
                                   f"number >= 0; got {got(played_ms)}", "played_ms", played_ms))
    if index is not None and (played_ms is None or not isinstance(index, int) or isinstance(index, bool)):
        raise refused(Problem.said(f"sentence_index names the sentence played_ms is of (an audio.start's "
                                   f"sentence_index, with played_ms); got {got(index)}"
                                   f"{'' if played_ms is not None else ' without played_ms'}", "sentence_index",
                                   index))
    return played_ms, index


def estimated_words(record: Played, played: list[Played], frame_s: float) -> tuple[Word, ...]:
    """Word timings of ``record``'s sentence, cut off before its end was generated: its length
    estimated from the session's own speaking rate (characters per second of the finished
    sentences of ``played``, else :data:`SPEECH_CHARS_PER_S`), at least the audio made so far
    (its pushed frames of ``frame_s`` seconds each)."""
    done = [p for p in played if p.words]
    chars = sum(spoken_chars(p.text) for p in done)
    seconds = sum(p.words[-1].end for p in done)
    rate = chars / seconds if chars and seconds > 0 else SPEECH_CHARS_PER_S
    made = len(record.stream.pushed) * frame_s
    return word_timings(record.text, 0.0, max(spoken_chars(record.text) / rate, made))


def heard_part(record: Played | None, played_ms: float, played: list[Played], rate: int,
               frame_s: float) -> tuple[list[Word], str, GenerationResult | None]:
    """What a listener heard of ``record``'s sentence in ``played_ms`` of its audio (from its first
    byte, its pause included): the words ended by then (:func:`heard_words`; a sentence still
    being generated has its words from :func:`estimated_words`).

    Args:
        record: the sentence (None: none had audio sent; nothing was heard).
        played_ms: milliseconds of its audio played, as the client played it: at the session's
            speed (``record.speed``), mapped back to generated time (times ``speed``) before its
            words and frames are looked up.
        played: the session's sentences whose audio went out (their speaking rate).
        rate: samples per second (24000).
        frame_s: seconds per frame (0.04).

    Returns:
        ``(the words heard, their times in seconds from the sentence's speech as generated (at
        speed 1), the text up to the last of them, a GenerationResult holding the int64 codes
        [frames, N] of those words (stop_reason "cancelled"), or None when none was heard)``.
    """
    if record is None or record.speech is None:
        return [], "", None
    speech_s = (played_ms / 1000 - (record.speech - record.first) / rate) * record.speed  # generated seconds
    heard = heard_words(record.words or estimated_words(record, played, frame_s), speech_s)
    pushed = list(record.stream.pushed)[:round(heard[-1].end / frame_s)] if heard else []
    if not pushed:
        return heard, words_prefix(record.text, len(heard)), None
    codes = np.stack(pushed)
    return heard, words_prefix(record.text, len(heard)), GenerationResult(codes[:0], codes, "cancelled", 0,
                                                                          math.nan, 0.0, 0.0)


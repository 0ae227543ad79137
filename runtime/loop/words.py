"""Word timings, estimated within a span whose ends are known: a text chunk's frames.

Higgs-Audio-v3 has no duration model and this runtime no forced aligner, so where a word is
inside its chunk's audio is not measured: the span (the chunk's first and last frame, 25 frames
per second, exact by construction) is divided in proportion to the words' characters
(whitespace not counted), as :class:`~higgs_pack.runtime.loop.synthesis.Segment` divides a chunk
between its sentences and :func:`~higgs_pack.runtime.loop.plan.context_tail` cuts a context.
A word's start and end are such estimates (:attr:`Word.exact` False) unless the word is the
whole span.  Peers that give word timings measure them: ElevenLabs and Cartesia from their
models' alignment, Kokoro-FastAPI from its duration predictor, vllm-omni with a forced aligner
(Qwen3-ForcedAligner-0.6B) per finished sentence (../shared/AGENTS-AND-SHIPPING.md).

A word is a run of characters between whitespace; in scripts written without spaces (Chinese
ideographs, Japanese kana) each character is a word, with the punctuation that follows it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass

#: Characters of scripts written without spaces between words: each is a word of its own
#: (CJK ideographs and their extensions and compatibility forms, hiragana, katakana).
_UNSPACED = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff"
#: One word: an unspaced character with the CJK punctuation and full-width forms after it, or a
#: run of other characters up to whitespace or an unspaced character.
_WORD = re.compile(f"[{_UNSPACED}][\u3000-\u303f\uff00-\uffef]*|[^\\s{_UNSPACED}]+")


@dataclass(frozen=True)
class Word:
    """Where one word is in the audio.

    Attributes:
        text: the word as written (with its punctuation).
        start: seconds from the start of the audio to the word's estimated first sample.
        end: seconds to just after its estimated last sample (``start <= end``).
        exact: True when both ends are frame-exact (the word is its whole span); else the
            character-proportional estimate of the module docstring.
    """

    text: str
    start: float
    end: float
    exact: bool = False


def split_words(text: str) -> list[str]:
    """The words of ``text`` (see the module docstring), in order; ``[]`` for blank text."""
    return _WORD.findall(text)


def proportional_bounds(weights: Sequence[int], start: float, length: float) -> list[float]:
    """Cut ``[start, start + length]`` in proportion to ``weights``: ``len(weights) + 1``
    ascending bounds, the first ``start`` and the last ``start + length`` (exactly).

    Args:
        weights: one positive weight per part (characters); a zero counts as 1.
        start: where the span begins (seconds or frames).
        length: the span's length (>= 0).
    """
    total, bounds, seen = sum(max(w, 1) for w in weights), [start], 0
    for weight in weights:
        seen += max(weight, 1)
        bounds.append(start + length * seen / total)
    bounds[-1] = start + length
    return bounds


def word_timings(text: str, start: float, end: float) -> tuple[Word, ...]:
    """The :class:`Word` items of ``text`` spoken from ``start`` to ``end`` (seconds), each
    given a share of the span proportional to its characters (whitespace not counted).

    Args:
        text: a sentence, a chunk or a turn.
        start: seconds where its speech begins (frame-exact or itself an estimate).
        end: seconds where it ends (``>= start``).

    Returns:
        One Word per :func:`split_words` word, in order, covering ``[start, end]`` without gaps;
        ``()`` for blank text.  ``exact`` is True only for a single word.
    """
    words = split_words(text)
    bounds = proportional_bounds([len(w) for w in words], start, max(end - start, 0.0))
    return tuple(Word(w, bounds[i], bounds[i + 1], len(words) == 1) for i, w in enumerate(words))


def heard_words(words: Sequence[Word], played: float) -> list[Word]:
    """The words of ``words`` (in order) whose speech had ended by ``played`` seconds: what a
    listener heard of them when playback stopped there (a word cut in its middle was not heard
    whole and is not counted).  A tolerance of half a frame (20 ms) keeps a word whose end
    rounds to ``played``."""
    return [w for w in words if w.end <= played + 0.02]


def word_ends(text: str, start: int = 0) -> list[int]:
    """Where each word (:func:`split_words`) of ``text`` from ``start`` on ends: the index after its
    last character, in order.  A word ending before ``len(text)`` is whole: what follows it has
    arrived (for text that arrives in pieces, the last word may still grow)."""
    return [m.end() for m in _WORD.finditer(text, start)]


def words_prefix(text: str, count: int) -> str:
    """``text`` up to the end of its ``count``-th word (:func:`split_words`), as written: what was
    said when ``count`` words were heard (``""`` for 0; the whole text, stripped, for all)."""
    if count <= 0:
        return ""
    ends = word_ends(text)
    start = len(text) - len(text.lstrip())
    return text[start:ends[min(count, len(ends)) - 1]] if ends else ""


def words_json(words: Sequence[Word], offset: float = 0.0) -> list[dict]:
    """``words`` as JSON objects ``{"text", "start", "end", "exact"}``, their times in seconds
    plus ``offset`` (where their audio begins in a longer one), to the microsecond."""
    return [{"text": w.text, "start": round(offset + w.start, 6), "end": round(offset + w.end, 6), "exact": w.exact}
            for w in words]

"""Where sentences end: one rule for a whole text (the long-text planner, subtitles' segments)
and for text that arrives in pieces (the live WebSocket route, ``serve/live.py``).

A sentence ends

- after ``. ! ? ; …`` (a run of them, then any closing quotes or brackets) followed by
  whitespace or by a CJK character (Chinese and Japanese put no space after an ASCII ``!``):
  so ``3.5``, ``1,000.25``, ``v1.2.3``, ``example.com/a.b?c=d`` and ``ann@example.com`` are not
  cut, and a ``.`` at the very end of text that is still arriving (``3.`` of ``3.5``) is no end
  yet.  Not after the short forms in :data:`ABBREVIATIONS` (``Dr.``, ``e.g.``), nor after a
  list number that is the whole sentence so far (``1.`` of ``1. Buy milk``);
- after a full stop of a script that writes no space before the next sentence, or never uses it
  inside a number: ``。！？；`` (CJK, full width), ``｡`` (half width), ``। ॥`` (Devanagari,
  Bengali), ``؟ ۔`` (Arabic, Urdu), ``։`` (Armenian), ``።`` (Ethiopic), ``။`` (Myanmar), ``។``
  (Khmer), with any closing quotes or brackets after it; it is known once the character after
  those has arrived (``好。”`` might still grow a closing quote);
- at a line break.

Scripts without sentence punctuation (Thai) are one sentence per line.  Splitting is linear in
the text's length: :class:`SentenceSplitter` looks at each character a bounded number of times
however the text is cut into pieces, and a whole text is the same splitter fed everything, then
flushed, so both give the same sentences for the same text.
"""

from __future__ import annotations

import re

from higgs_pack.runtime.loop.words import split_words, word_ends
from higgs_pack.runtime.text import blank

#: Latin-style sentence punctuation: an end only when whitespace (or a CJK character) follows.
LATIN_STOPS = ".!?;…"
#: Full stops of scripts that never use them inside numbers, addresses or short forms.
SCRIPT_STOPS = "。！？；｡।॥؟۔։።။។"
#: Closing quotes and brackets that belong to the sentence before them.
CLOSERS = "\"')]}»’”」』）】》〉"
#: Characters of scripts written without spaces between sentences (CJK ideographs, kana, full-width forms).
_CJK = "\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uf900-\ufaff\uff00-\uffef"
#: Short forms whose ``.`` does not end a sentence (compared as written; a title is capitalised).
#: Kept short on purpose: ``etc.``, ``Jr.``, ``a.m.`` and the like end sentences too often.
ABBREVIATIONS = frozenset({"Mr", "Mrs", "Ms", "Dr", "Prof", "e.g", "i.e", "E.g", "I.e", "cf", "vs", "approx"})

_END = re.compile(
    rf"[{re.escape(LATIN_STOPS)}]+[{re.escape(CLOSERS)}]*(?=\s|[{_CJK}])"  # Latin: confirmed by what follows
    rf"|[{SCRIPT_STOPS}]+[{re.escape(CLOSERS)}]*(?=[^{SCRIPT_STOPS}{re.escape(CLOSERS)}])"  # known once more text came
    r"|\r\n|[\n\r\u2028\u2029]"
)
#: A run that may still become (part of) an end once more text arrives: stops and closers.
_OPEN_TAIL = frozenset(LATIN_STOPS + SCRIPT_STOPS + CLOSERS)
#: A list number that is the whole sentence so far: ``1.`` ``12.`` (not an end).
_LIST_NUMBER = re.compile(r"\s*\d{1,3}")
#: The word before a ``.`` (looked back at most this many characters for :data:`ABBREVIATIONS`).
_LOOK_BACK = 8


class SentenceSplitter:
    """Cut text into sentences as it arrives (see the module docstring for the rule).

    ``feed`` returns the sentences its text completed; ``flush`` returns the rest as the last
    sentence (the text is over, or the caller wants it spoken now).  Sentences are stripped of
    surrounding whitespace and never blank (:func:`~higgs_pack.runtime.text.blank`: only whitespace
    and format characters, such as U+200B, is nothing to speak and is dropped).  Each character is scanned a bounded number of
    times, so feeding a text in any number of pieces is linear in its length.
    """

    def __init__(self) -> None:
        self._buffer = ""
        self._scan = 0  # where the next search starts: text before it holds no end to come

    @property
    def pending(self) -> str:
        """The text received after the last sentence end (not yet returned)."""
        return self._buffer

    def feed(self, text: str) -> list[str]:
        """Add ``text`` (a piece of any length); return the sentences it completed, in order."""
        buffer = self._buffer + text
        sentences, at = [], 0
        for match in _END.finditer(buffer, self._scan):
            if match.start() > at and not self._ends(buffer, at, match):
                continue
            sentence = buffer[at:match.end()].strip()
            if not blank(sentence):  # only whitespace and format characters: nothing to speak (runtime/text.py)
                sentences.append(sentence)
            at = match.end()
        self._buffer = buffer[at:]
        # the next search starts at the run of stops and closers at the end, which more text may confirm
        tail = len(self._buffer)
        while tail and self._buffer[tail - 1] in _OPEN_TAIL:
            tail -= 1
        self._scan = tail
        return sentences

    def flush(self) -> list[str]:
        """The rest as the last sentence (``[]`` when it is blank); the splitter starts afresh."""
        rest = self._buffer.strip()
        self._buffer, self._scan = "", 0
        return [] if blank(rest) else [rest]

    @staticmethod
    def _ends(buffer: str, at: int, match: re.Match[str]) -> bool:
        """Whether ``match`` (a stop run, the sentence begun at ``at``) ends it: not after a
        short form of :data:`ABBREVIATIONS` nor a list number that is the whole sentence."""
        if match.group()[0] != "." or len(match.group().rstrip(CLOSERS)) != 1:
            return True
        start = match.start()
        if _LIST_NUMBER.fullmatch(buffer, at, start):
            return False
        before = buffer[max(at, start - _LOOK_BACK):start]
        word = before.split()[-1].lstrip("\"'([{«‘“") if before.split() else ""
        return word not in ABBREVIATIONS


def split_sentences(text: str) -> list[str]:
    """The sentences of a whole text: a :class:`SentenceSplitter` fed ``text``, then flushed.

    Returns:
        the sentences in order, stripped, none blank (``[]`` for blank text).
    """
    splitter = SentenceSplitter()
    return splitter.feed(text) + splitter.flush()


#: How text that arrives in pieces is committed to speech (``split_granularity``): at sentence
#: ends, or also at clause ends (vllm-omni's ``split_granularity`` has the same two, and ``none``).
GRANULARITIES = ("sentence", "clause")
#: Clause marks: an end of a clause when whitespace follows (Latin) or at once (CJK full width and
#: the ideographic comma).  ``;`` already ends a sentence.
LATIN_CLAUSE_MARKS = ",:"
CJK_CLAUSE_MARKS = "，、：；"
#: Fewest words (:func:`~higgs_pack.runtime.loop.words.split_words`) of a clause committed on its
#: own: a shorter one ("Well,", "Yes, ") waits and joins the next.
MIN_CLAUSE_WORDS = 3
_CLAUSE_END = re.compile(rf"[{LATIN_CLAUSE_MARKS}][{re.escape(CLOSERS)}]*(?=\s)|[{CJK_CLAUSE_MARKS}]")


class TextCommits:
    """Cut text that arrives in pieces into the parts spoken one after another: the sentences of
    :class:`SentenceSplitter`, cut also at clause ends with ``granularity`` ``"clause"`` (a clause
    mark, :data:`LATIN_CLAUSE_MARKS` then whitespace or one of :data:`CJK_CLAUSE_MARKS`, once the
    clause has :data:`MIN_CLAUSE_WORDS` words), and, first of all, the ``first_words`` first
    words of a response alone when they arrive before any other cut (so its speech starts sooner;
    0: no such rule): while the text received holds no clause or sentence end after them, and
    does not end in a stop that may be one (``five.`` waits for the next piece); when an end has
    arrived, the first part runs to it (a sentence that arrives whole is one part).  Words are
    counted as word timings count them (:func:`~higgs_pack.runtime.loop.words.split_words`: in
    Chinese and Japanese each ideograph or kana is a word), a word whole once what follows it
    has arrived.  A response ends at :meth:`flush` (its text all committed: the end of an
    LLM's turn) or at :meth:`restart` (a barge-in, its text dropped): the next words are a
    response's first again.

    Args:
        granularity: one of :data:`GRANULARITIES`.
        first_words: the first commit's most words (>= 0).

    Raises:
        ValueError: a granularity not in :data:`GRANULARITIES` or a negative ``first_words``.
    """

    def __init__(self, granularity: str = "sentence", first_words: int = 0):
        if granularity not in GRANULARITIES or first_words < 0:
            raise ValueError(f"granularity is one of {GRANULARITIES} (got {granularity!r}) and first_words >= 0 "
                             f"(got {first_words})")
        self.granularity, self.first_words = granularity, first_words
        self.sentences = SentenceSplitter()
        self._taken = 0  # characters of sentences.pending already committed
        self._first = True

    @property
    def pending(self) -> str:
        """Text received and not yet committed."""
        return self.sentences.pending[self._taken:]

    def restart(self) -> None:
        """Drop the text not committed; the next words are a response's first."""
        self.sentences, self._taken, self._first = SentenceSplitter(), 0, True

    def feed(self, text: str) -> list[str]:
        """Add ``text``; return the parts it completed, in order (stripped, none blank)."""
        before = self.sentences.pending[:self._taken].lstrip()
        parts, sentences = [], self.sentences.feed(text)
        for i, sentence in enumerate(sentences):
            rest = sentence[len(before):].strip() if i == 0 and before else sentence
            parts += [] if blank(rest) else self._cut(rest + " ", final=True)
        if sentences:
            self._taken = 0
        parts += self._cut(self.pending, final=False)
        return parts

    def flush(self) -> list[str]:
        """The text not committed as one last part (``[]`` when blank); the response ends: the next
        words are a response's first."""
        rest = self.pending.strip()
        self.sentences.flush()
        self._taken, self._first = 0, True
        return [] if blank(rest) else [rest]

    def _cut(self, text: str, final: bool) -> list[str]:
        """The parts at the front of ``text`` that may be committed now (the whole of a complete
        sentence's when ``final``), advancing past them in the pending text when not ``final``."""
        parts, at = [], 0
        while True:
            end = self._next_end(text, at, final)
            if end is None:
                break
            part = text[at:end].strip()
            if not blank(part):
                parts.append(part)
                self._first = False
            at = end
        if final:
            rest = text[at:].strip()
            if not blank(rest):
                parts.append(rest)
                self._first = False
        else:
            self._taken += at
        return parts

    def _next_end(self, text: str, at: int, final: bool) -> int | None:
        """Where the next part that starts at ``at`` ends: a clause end after :data:`MIN_CLAUSE_WORDS`
        words (clause mode), else the first words' cut when no end has arrived (``text`` is not a
        whole sentence, ``final``, nor ends in a stop that may be an end); None when none is due yet."""
        if self.granularity == "clause":
            for match in _CLAUSE_END.finditer(text, at):
                if len(split_words(text[at:match.end()])) >= MIN_CLAUSE_WORDS:
                    return match.end()
        if final or not (self._first and self.first_words) or self._may_end(text):
            return None
        whole = [end for end in word_ends(text, at) if end < len(text)]
        return whole[self.first_words - 1] if len(whole) >= self.first_words else None

    def _may_end(self, text: str) -> bool:
        """Whether ``text`` ends in a stop (or, in clause mode, a clause mark) that the next piece
        may confirm as an end (``five.`` of ``five. Six``)."""
        marks = LATIN_STOPS + SCRIPT_STOPS + (LATIN_CLAUSE_MARKS if self.granularity == "clause" else "")
        return text.rstrip(CLOSERS)[-1:] in tuple(marks)

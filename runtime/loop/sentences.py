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
    surrounding whitespace and never blank.  Each character is scanned a bounded number of
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
            if sentence:
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
        return [rest] if rest else []

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

"""Text in at every front door: one rule for what a text is, applied wherever text enters.

The words to speak, a transcript, a voice or speaker name, a script or a ``--batch`` file, an HTTP
field, a multipart part and a WebSocket message all pass through this module, so one text is the
same text at every door:

- **bytes** (a file, standard input, a multipart part, a WebSocket frame) are UTF-8 or refused,
  naming the field and the first bad byte (:func:`decode`); never guessed as Latin-1;
- **a leading byte-order mark** (U+FEFF, which Windows Notepad writes) is dropped (:func:`clean`);
- **lines** end at LF, CR LF or a lone CR (Unix, Windows and old Mac files), which :func:`clean`
  turns into LF; that is all.  U+2028 LINE SEPARATOR, U+2029 PARAGRAPH SEPARATOR are text inside
  a line, as an editor shows them (the sentence splitter,
  :mod:`higgs_pack.runtime.loop.sentences`, still ends a sentence at them), so a script line or an
  HTTP turn holding one is one turn;
- **nothing to speak**: text made only of whitespace and format characters (Unicode category Cf:
  U+200B ZERO WIDTH SPACE, U+200D ZERO WIDTH JOINER, a U+FEFF that is not leading) is
  :func:`blank`, as whitespace is: a whole text so is refused as empty (:func:`problem`), and a
  sentence so is dropped as a blank one is (never spoken, never a segment or a subtitle cue; a
  ``--batch`` line so is skipped; a live ``input.text`` so is taken in silence);
- **control characters** inside text are refused (:func:`problem`): the C0 set other than tab and
  line feed (NUL, U+0001-U+0008, U+000B-U+001F), DEL and the C1 set (U+0080-U+009F), each named
  with its position; a lone surrogate (U+D800-U+DFFF: what bytes that are not UTF-8 become in a
  command-line argument, Python's ``surrogateescape``, or a JSON ``"\\ud800"`` escape) is refused
  the same way.

Runtime code: no torch.
"""

from __future__ import annotations

import re
import unicodedata
from typing import Any

from higgs_pack.errors import InputError, Problem, literal

#: The byte-order mark, dropped where a text starts.
BOM = "\ufeff"
#: Characters refused inside text: C0 controls but tab (U+0009) and line feed (U+000A), DEL, C1.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
_SURROGATE = re.compile("[\ud800-\udfff]")
_LINE_END = re.compile("\r\n?")


def clean(value: Any, start: bool = True) -> Any:
    """``value`` with a leading byte-order mark dropped and CR LF / CR as LF; anything that is
    not a string is returned as it is (its check, :func:`problem`, names its type).

    Args:
        start: whether ``value`` starts a text (False for a later piece of one, a live session's
            second ``input.text``: a U+FEFF there is inside the text, not a byte-order mark, and is kept).
    """
    if not isinstance(value, str):
        return value
    return _LINE_END.sub("\n", value.removeprefix(BOM) if start else value)


def blank(value: str) -> bool:
    """Whether ``value`` holds nothing to speak: only whitespace and format characters (Unicode
    category Cf, such as U+200B, U+200D, U+FEFF), or nothing.  A blank text is empty at every door;
    a blank sentence is dropped, as a whitespace-only one is."""
    return all(char.isspace() or unicodedata.category(char) == "Cf" for char in value)


def lines(text: str) -> list[str]:
    """The lines of ``text`` (:func:`clean`-ed): split at LF, CR LF and CR only, never at U+2028,
    U+2029, U+0085, VT or FF (:meth:`str.splitlines` splits at all of these)."""
    return clean(text).split("\n")


def decode(data: bytes, where: str, fix: str = "save it as UTF-8") -> str:
    """UTF-8 bytes as :func:`clean` text.

    Args:
        data: the bytes (a file, standard input, a multipart part, a WebSocket frame).
        where: the field or source in the caller's terms (``"--text-file notes.txt"``,
            ``"standard input"``, ``"the transcript part"``), for the message.
        fix: what the user should do.

    Raises:
        InputError: the bytes are not UTF-8: the message names ``where`` and the offset and value
            of the first bad byte (e.g. Latin-1 or UTF-16 text, or a binary file).
    """
    try:
        return clean(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InputError(problems=[Problem(None, message=literal(
            f"{where} is not UTF-8 text (byte {exc.start + 1} is 0x{data[exc.start]:02X}, which UTF-8 does not "
            f"allow there)"), fix=fix)]) from None


def problem(value: Any, what: str, why: str = "there is nothing to speak") -> str | None:
    """Why the text ``value`` cannot be used, or None (after :func:`clean`: CR and a leading BOM are
    not held against it).

    Args:
        value: the text given.
        what: its name in messages (``"text"``, ``"ref_text"``, ``"voice name"``, ``"line 3"``).
        why: what an empty value means, after a colon (``""``: nothing, the caller says it).

    Returns:
        None when ``value`` is a string without control characters or lone surrogates, holding at
        least one character that is neither whitespace nor a format character (Unicode category
        Cf, such as U+200B); else one sentence saying what is wrong.
    """
    if not isinstance(value, str):
        return f"{what} must be text (a string), got {plain_type(value)}"
    value = clean(value)
    if (bad := character_problem(value, what)) is not None:
        return bad
    if blank(value):
        kind = "empty" if not value else ("only whitespace" if value.isspace() else
                                            "only whitespace and format characters")
        return f"{what} is {kind}" + (f": {why}" if why else "")
    return None


def character_problem(value: str, what: str) -> str | None:
    """Why ``value`` holds a character no text may hold (a lone surrogate, a control character other
    than tab and line feed; CR is taken as a line end, :func:`clean`), or None.  For pieces of a
    text (a WebSocket's ``input.text``), where whitespace alone is a fine piece."""
    value = _LINE_END.sub("\n", value)
    if (bad := _SURROGATE.search(value)) is not None:
        return (f"{what} is not valid Unicode: character {bad.start() + 1} is a lone surrogate "
                f"(U+{ord(bad.group()):04X}; bytes that are not UTF-8 arrive as these); send UTF-8 text")
    if (bad := _CONTROL.search(value)) is not None:
        char = bad.group()
        name = unicodedata.name(char, "") or _CONTROL_NAMES.get(char, "")
        return (f"{what} holds a control character at character {bad.start() + 1} (U+{ord(char):04X}"
                f"{', ' + name if name else ''}): "
                "text may hold tab and line breaks, no other control character; remove it")
    return None


def plain_type(value: Any) -> str:
    """The JSON-ish name of ``value``'s type for messages (``null``, a number, a list...), not Python's."""
    if value is None:
        return "nothing (null/None)"
    if isinstance(value, bool):
        return f"a boolean ({str(value).lower()})"
    if isinstance(value, (int, float)):
        return f"a number ({value!r})"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, bytes):
        return "bytes"
    if isinstance(value, str):
        shown = repr(value)
        return f"text ({shown if len(shown) <= 40 else shown[:37] + '...'})"
    return f"a {type(value).__name__}"


#: Names of the control characters people meet (unicodedata has no name for Cc characters).
_CONTROL_NAMES = {"\x00": "NUL", "\x1b": "ESCAPE", "\x7f": "DELETE", "\x0b": "VERTICAL TAB",
                  "\x0c": "FORM FEED", "\x85": "NEXT LINE", "\x08": "BACKSPACE"}

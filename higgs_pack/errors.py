"""Every error higgs-pack raises on purpose, in one place.

Each message says what is wrong, what is allowed, and the flag (CLI) or keyword
(Python) that fixes it.  All derive from :class:`HiggsPackError`, so callers can
catch one type; the CLI turns them into a one-line message and exit status 2.
"""

from __future__ import annotations

import difflib
import errno
import os
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any


class HiggsPackError(Exception):
    """Base class of every error raised on purpose by higgs-pack."""


class ManifestError(HiggsPackError):
    """``manifest.json`` is missing, not JSON, or breaks the schema."""


class UnsupportedFormatVersion(ManifestError):
    """The manifest was written by a newer higgs-pack than this one."""


class BundleError(HiggsPackError):
    """A bundle's files disagree with its manifest (missing, tampered, outside it)."""


class SignatureMismatch(BundleError):
    """A graph's inputs or outputs differ from the I/O signature in the manifest."""


class HubError(HiggsPackError):
    """A bundle cannot be fetched from a model hub (offline, unknown repository or revision, no
    access, no room in the cache).  Not a :class:`BundleError`: nothing is wrong with a bundle's
    files; a pulled bundle whose files disagree with its manifest raises that."""


class CheckpointError(HiggsPackError):
    """A Higgs-Audio-v3 checkpoint cannot be found or read, or its layout is wrong."""


class BuildPlanError(HiggsPackError):
    """An unknown target or precision, or a combination that is not supported."""


class BuildError(HiggsPackError):
    """An exporter or a pass failed, or the built bundle failed its own checks."""


class ExecutionProviderUnavailable(HiggsPackError):
    """The execution provider or OpenVINO device asked for is not usable here."""


#: How many characters of a text an error echoes back (:func:`clipped`).
ECHO_LIMIT = 80


def encodable(text: str) -> str:
    """``text`` as an error may carry it to any door: every lone surrogate (U+D800-U+DFFF, not valid
    Unicode, which UTF-8 cannot encode: a JSON ``"\\ud800"`` key, a command-line argument's bytes
    that are not UTF-8) written as its escape ``\\ud800``; other text as it is.  The one place an
    echoed key or value is made safe for an HTTP body, a live ``error`` event and a terminal."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8") if isinstance(text, str) else text


def clipped(text: str, limit: int = ECHO_LIMIT) -> str:
    """``text`` (:func:`encodable`) as an error echoes it back: whole when it has at most ``limit``
    characters, else its first ``limit`` characters, an ellipsis and its length
    (``"Lorem ipsum…" (49000 characters)``), so an error never echoes a huge input whole."""
    text = encodable(text)
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


def literal(sentence: str) -> str:
    """``sentence`` as a :attr:`Problem.message` that is shown as it is: its braces escaped, so a
    text quoted in it (a sentence, a token) is never read as a ``{name}`` field."""
    return sentence.replace("{", "{{").replace("}", "}}")


#: Every :attr:`Problem.code` and what it means: what kind of thing is wrong, for programs (the
#: server's error ``code``; the server's page lists them from here: docs/hooks/generated.py).
CODE_MEANINGS = {
    "invalid_value": "a field holds a value it does not take",
    "missing_field": "a field that is needed was not given",
    "unknown_field": "a field (or part) that does not exist",
    "duplicate_field": "a field given more than once",
    "conflicting_fields": "two fields whose values disagree",
    "unknown_value": "a name that is not one of the known choices (a voice, a format)",
    "unsupported_value": "a value the bundle or this machine cannot do (a length, an option of its decoder)",
    "input_too_long": "text or audio over its limit",
    "invalid_body": "the request as a whole is not the shape it must be",
    "invalid_json": "the body is not JSON",
    "invalid_name": "a name (of a voice) that cannot be kept",
    "builtin_voice": "the bundle's own voice, which cannot be deleted",
    "voice_exists": "a voice's name that is taken",
    "invalid_barge_in": "a barge-in names audio that was not sent",
    "unreadable_audio": "bytes that are not audio the reader knows",
    "unknown_voice": "a voice that is not stored",
    "unknown_speaker": "a dialogue's voice for a speaker who says no turn",
    "too_many_turns": "a dialogue longer than one request takes",
    "reference_too_long": "a reference clip over the server's limit",
    "url_refused": "a URL where the server fetches none",
    "local_media_refused": "a file path the server may not read",
    "local_media_missing": "a file path that names no file in the allowed folder",
    "unknown_type": "a live message of no known type",
    "invalid_message": "a live message that is not a JSON object",
    "invalid_config": "a live session.config with several bad fields",
    "config_refused": "live text sent before a valid session.config",
    "config_too_late": "a live session.config after text",
    "session_ended": "a live message after input.done",
}
#: Every :attr:`Problem.code`, in the order declared.
CODES = tuple(CODE_MEANINGS)


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a request, as data: each front door says it in its own terms.

    Attributes:
        field: the request field at fault, by its Python keyword (``"top_p"``,
            ``"max_frames"``), or None when the problem is the request as a whole.
        value: the value given (never shown whole: :meth:`shown` clips it, :func:`clipped`).
        allowed: what the field takes ("in (0, 1]", "a whole number >= 1 (frames, 25 per second)").
        fix: what to do besides setting the field ("" when setting it is the fix).
        message: the whole sentence, for problems that are not "FIELD must be ALLOWED, got
            VALUE"; ``{name}`` in it stands for the field's name in the front door's terms
            (``str(problem)`` fills it in with the Python keyword).
        code: a stable machine-readable name of the kind of problem, one of :data:`CODES`
            (the server's error ``code``; default ``invalid_value``).
    """

    field: str | None
    value: Any = None
    allowed: str = ""
    fix: str = ""
    message: str = ""
    code: str = "invalid_value"

    def __post_init__(self) -> None:
        if self.code not in CODES:
            raise ValueError(f"Problem code {self.code!r} is not one of {', '.join(CODES)}")

    @classmethod
    def said(cls, sentence: str, field: str | None = None, value: Any = None,
             code: str = "invalid_value") -> Problem:
        """A problem said as one whole sentence, shown as it is (:func:`literal`: braces in it are
        not fields), of ``field`` (None: the request as a whole)."""
        return cls(field, value, message=literal(sentence), code=code)

    def shown(self, show: Callable[[Any], str] | None = None) -> str:
        """The value as messages show it: ``show(value)`` when given (a door's own words: JSON's at
        the server), else numbers as written and other values as repr; :func:`clipped`."""
        if show is not None:
            text = show(self.value)
        else:
            text = str(self.value) if isinstance(self.value, (int, float)) and not isinstance(self.value, bool) \
                else repr(self.value)
        return clipped(text)

    def render(self, name: str | None = None, how: str | None = None,
               show: Callable[[Any], str] | None = None) -> str:
        """The problem as one sentence.

        Args:
            name: the field's name in the caller's terms (the HTTP field ``max_new_tokens``
                for ``max_frames``); default the Python keyword.
            how: how the caller's user sets the field (``"--top-p / top_p="``), appended as
                "; set it with HOW"; None: not appended (an HTTP error names the field in ``param``).
            show: how the door writes a value (:meth:`shown`).
        """
        name = name or self.field or "request"
        text = self.message.format(name=name) if self.message else f"{name} must be {self.allowed}, got {self.shown(show)}"
        if self.fix:
            text += f"; {self.fix}"
        if how:
            text += f"; set it with {how}"
        return text

    def __str__(self) -> str:
        """The sentence in the Python API's terms (``print(problem)``); the fields stay data."""
        return self.render()


class InputError(HiggsPackError):
    """Bad user input: empty text, text too long, unreadable or unusable audio.

    Built from problems: ``InputError.of(Problem(...), ...)`` (:meth:`of`), or
    ``InputError(problems=[...])``; a plain ``message`` with no problems is the old form (one
    problem of the request as a whole, ``invalid_value``), kept for modules not yet converted
    (tests/test_errors_model.py names them).

    Args:
        message: the whole message; when None, made from ``problems`` in the Python API's and
            the CLI's terms (one line, or "N problems with the request:" and one line each).
        problems: every bad field of the request, as data (:class:`Problem`).
        render: how to say one problem for ``message`` (default :meth:`Problem.render`).

    Attributes:
        problems: tuple of :class:`Problem`; every front door renders them in its own terms
            (the server: each field's HTTP name, the first one's as the error's ``param``).
    """

    def __init__(self, message: str | None = None, problems: Iterable[Problem] = (),
                 render: Any = None):
        self.problems = tuple(problems) or (Problem(None, message=literal(message or "")),)
        super().__init__(self.say(render or Problem.render) if message is None else message)

    @classmethod
    def of(cls, *problems: Problem, render: Any = None) -> InputError:
        """The error of ``problems`` (at least one), its message each said with ``render``
        (default :meth:`Problem.render`: the Python API's terms)."""
        if not problems:
            raise ValueError("InputError.of needs at least one Problem")
        return cls(problems=problems, render=render)

    @property
    def code(self) -> str:
        """The first problem's :attr:`Problem.code`: the error's kind, for programs."""
        return self.problems[0].code

    def say(self, render: Any) -> str:
        """Every problem said with ``render`` (a :class:`Problem` -> one line), as :func:`said_all`
        says several; how each front door words it."""
        return said_all([render(problem) for problem in self.problems])


def said_all(lines: Sequence[str]) -> str:
    """Several problems of one request as every front door says them (the Python API, the CLI, the
    HTTP routes, a live session's ``error`` event): the one line, or "N problems with the request:"
    and one indented line each (``  - LINE``)."""
    if len(lines) == 1:
        return lines[0]
    return f"{len(lines)} problems with the request:\n" + "\n".join(f"  - {line}" for line in lines)


class NumericalError(HiggsPackError):
    """A sub-part produced non-finite or all-zero output."""


class PackagingError(HiggsPackError):
    """A bundle cannot be packaged, or an archive or wheel is damaged."""


def unknown_choice(kind: str, value: str, known: Iterable[str], fix: str) -> str:
    """Format "unknown <kind> 'x'; known: a, b (did you mean 'a'?) <fix>".

    Args:
        kind: What was asked for, for example ``"target"``.
        value: The value given.
        known: The accepted values.
        fix: The flag or keyword that sets the value, for example ``"--target / target="``.
    """
    known = sorted(known)
    return f"unknown {kind} {value!r}{did_you_mean(value, known)}; known: {', '.join(known)}. Set it with {fix}."


def did_you_mean(value: Any, known: Iterable[str]) -> str:
    """`` (did you mean 'x'?)`` naming the known name closest to ``value`` (one that differs only by
    case first: ``CPU`` is ``cpu``; else :func:`difflib.get_close_matches`), or ``""``: the one
    "did you mean" of every message."""
    known = list(known)
    lower = {k.lower(): k for k in known}
    if not isinstance(value, str):
        return ""
    close = [lower[value.lower()]] if value.lower() in lower else difflib.get_close_matches(value, known, n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""


def install_extra(extra: str) -> str:
    """How to install an extra of higgs-pack, for messages: it is installed from a clone of the
    repository (it is not on a package index), ``pip install '.[EXTRA]'`` there."""
    return f"install the [{extra}] extra: pip install '.[{extra}]' in a clone of higgs-pack"


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (a tool's summary before its details), or an
    empty string when the message is empty."""
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""


def last_line(exc: BaseException) -> str:
    """The last non-empty line of an exception's message (a tool's own error is often many
    lines of context and then the reason), or the exception's type name when it has none."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


#: errno values that mean "the disk (or the user's quota) is full".
DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def disk_full(exc: BaseException | None) -> OSError | None:
    """The ``OSError`` saying the disk is full in ``exc`` or in its causes and contexts
    (libraries such as huggingface_hub re-raise a failed write as their own error), or None."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in DISK_FULL_ERRNOS:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def disk_full_message(folder: str | os.PathLike, what: str, fix: str) -> str:
    """"out of disk space in FOLDER (N GiB free) while WHAT; FIX", naming the free space of the
    nearest existing folder above ``folder``."""
    path = os.fspath(folder)
    while path and not os.path.exists(path) and os.path.dirname(path) != path:
        path = os.path.dirname(path)
    try:
        free = f"{shutil.disk_usage(path).free / 2**30:.1f} GiB free"
    except OSError:
        free = "free space unknown"
    return f"out of disk space in {folder} ({free}) while {what}; {fix}"

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
from collections.abc import Iterable


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


class InputError(HiggsPackError):
    """Bad user input: empty text, text too long, unreadable or unusable audio."""


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
    close = difflib.get_close_matches(value, known, n=1)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    return f"unknown {kind} {value!r}{hint}; known: {', '.join(known)}. Set it with {fix}."


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

"""Subtitles of a result's segments: SubRip (``.srt``, with the ``srt`` library) or WebVTT
(``.vtt``, with ``webvtt-py``), chosen by the file's suffix (the ``[subtitles]`` extra).

The cues are :attr:`~higgs_pack.runtime.loop.synthesis.SynthesisResult.segments`: one per
sentence (per turn in a dialogue), timed from frame counts, not by an aligner; a sentence that
shared its text chunk with others has estimated ends (see
:class:`~higgs_pack.runtime.loop.synthesis.Segment`), and there are no word timings.  A dialogue's
cue starts with its speaker (``NAME: text``).

Runtime code: no torch, no build tools.
"""

from __future__ import annotations

import datetime
import html
import importlib.util
import os
from collections.abc import Sequence
from pathlib import Path

from higgs_pack.errors import InputError, Problem, install_extra
from higgs_pack.runtime.audio import check_writable, write_file
from higgs_pack.runtime.loop.synthesis import Segment

#: Suffix -> (what it is, the module that writes it).
FORMATS = {".srt": ("SubRip", "srt"), ".vtt": ("WebVTT", "webvtt")}


def check_subtitles_path(path: str | os.PathLike, option: str = "--subtitles") -> Path:
    """Refuse a subtitles file that cannot be written, before anything is generated.

    Args:
        path: where the subtitles go.
        option: how the caller names it in messages (a CLI flag, a keyword).

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        InputError: a suffix other than ``.srt`` or ``.vtt`` (naming both), a folder that does
            not exist, a directory, the library of the format missing (with the extra that
            installs it), or a file that cannot be opened for writing
            (:func:`~higgs_pack.runtime.audio.check_writable`).
    """
    path = Path(path)
    suffix = path.suffix.lower()
    if suffix not in FORMATS:
        raise InputError.of(Problem.said(f"{option} {path}: a subtitles file is SubRip (.srt) or WebVTT (.vtt), chosen by its "
                                         f"suffix; got {suffix or 'no suffix'}: name it .srt or .vtt"))
    if path.is_dir():
        raise InputError.of(Problem.said(f"{option} {path} is a directory; give a file name ending in {suffix}"))
    if not path.resolve().parent.is_dir():
        raise InputError.of(Problem.said(f"{option} {path}: folder {path.resolve().parent} does not exist; create it first"))
    kind, module = FORMATS[suffix]
    if importlib.util.find_spec(module) is None:
        raise InputError.of(Problem.said(f"{option} {path}: writing {kind} needs the {module!r} module; "
                                         f"{install_extra('subtitles')}"))
    check_writable(path, option)
    return path


def _cue_text(segment: Segment) -> str:
    return segment.text if segment.speaker is None else f"{segment.speaker}: {segment.text}"


def cues(segments: Sequence[Segment]) -> list[tuple[float, float, str]]:
    """``(start, end, text)`` of each cue: a segment each, except that a segment with no time
    (its end not after its start at millisecond resolution: a text chunk that ended after fewer
    frames than it has sentences gives some of its sentences none) is joined to the next cue, or
    to the one before when it is last, so its words are shown rather than dropped (SubRip's
    composer drops a cue that ends where it starts)."""
    out: list[list] = []
    waiting: list[tuple[float, str]] = []  # segments with no time, for the next cue
    for s in segments:
        text = _cue_text(s)
        if round(s.end * 1000) <= round(s.start * 1000):
            waiting.append((s.start, text))
            continue
        if waiting:
            out.append([min(waiting[0][0], s.start), s.end, " ".join([*(t for _, t in waiting), text])])
            waiting = []
        else:
            out.append([s.start, s.end, text])
    if waiting and out:
        out[-1][2] = " ".join([out[-1][2], *(t for _, t in waiting)])
    elif waiting:  # nothing has time: one cue of the words, as long as a millisecond
        out.append([waiting[0][0], waiting[0][0] + 0.001, " ".join(t for _, t in waiting)])
    return [(start, end, text) for start, end, text in out]


def subtitles_text(segments: Sequence[Segment], suffix: str) -> str:
    """The subtitles of ``segments`` as text in the format of ``suffix`` (``.srt`` or ``.vtt``),
    one cue per :func:`cues` item.

    Raises:
        InputError: another suffix.
    """
    suffix = suffix.lower()
    if suffix == ".srt":
        import srt

        return srt.compose([srt.Subtitle(i + 1, datetime.timedelta(seconds=start), datetime.timedelta(seconds=end),
                                         text) for i, (start, end, text) in enumerate(cues(segments))])
    if suffix == ".vtt":
        import webvtt

        vtt = webvtt.WebVTT()
        for start, end, text in cues(segments):
            # WebVTT cue text is markup: "<|emotion:...|>" or "-->" must be escaped (&lt; &gt; &amp;).
            vtt.captions.append(webvtt.Caption(_stamp(start), _stamp(end), html.escape(text, False)))
        return vtt.content
    raise InputError.of(Problem.said(f"subtitles are .srt or .vtt, got {suffix or 'no suffix'}"))


def _stamp(seconds: float) -> str:
    """WebVTT's ``HH:MM:SS.mmm``, to the nearest millisecond."""
    ms = round(seconds * 1000)
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}.{ms % 1000:03d}"


def write_subtitles(path: str | os.PathLike, segments: Sequence[Segment], option: str = "path") -> int:
    """Write ``segments`` as subtitles to ``path`` (format by suffix, UTF-8); ``option`` is how
    messages name ``path`` (the CLI passes ``--subtitles``).

    Returns:
        The number of cues written (:func:`cues`: a segment with no time shares the next cue).

    Raises:
        InputError: as :func:`check_subtitles_path`, or the file could not be written (out of
            disk space said as such: :func:`~higgs_pack.runtime.audio.cannot_write`).
    """
    path = check_subtitles_path(path, option)
    write_file(path, subtitles_text(segments, path.suffix).encode("utf-8"), option)
    return len(cues(segments))

"""``higgs-pack synthesize BUNDLE --text-file lines.txt --batch N -o outdir/``: a folder of wavs.

One wav per non-empty line of the text file, named by its line number zero-padded to the
width of the file's line count (``07.wav`` for line 7 of a 12-line file), spoken through one
engine (:meth:`higgs_pack.runtime.api.TTS.synthesize_many`, ``N`` requests per decoder step)
with seed ``--seed + line - 1``: with an fp32 bundle a line gets the codes it gets alone
(``higgs-pack synthesize BUNDLE --text "…" --seed S`` repeats it), whichever lines run beside
it; int4 kernels may round differently with more rows (:mod:`higgs_pack.runtime.engine`).

Files are written as they finish, each to a hidden temporary name in the folder and then
renamed, and after each one :data:`MANIFEST` (JSON) is rewritten the same way: what was
written (line, text, file, seconds, frames, stop reasons, seed, sha256), the lines that
failed and why, and ``state`` (``running``, ``interrupted``, ``stopped by an error``,
``finished``).  A run stopped by Ctrl-C, a crash or a kill keeps its finished files, and the
manifest lists exactly those.  Running the same command again resumes: a line whose file is
listed with the same text and seed and still has the listed sha256 is skipped (the command
says how many); a manifest written with other settings (bundle, sampling, voice, format, the
OpenVINO engine) is refused rather than mixed with.

Runtime code: no torch.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from higgs_pack.errors import InputError, Problem, literal
from higgs_pack.manifests.manifest import sha256_file

#: The manifest of a batch folder.
MANIFEST = "batch-manifest.json"
#: Its format (a reader refuses another).
MANIFEST_FORMAT = "higgs-pack-batch/1"
#: Prefix of the temporary names files are written under before their rename (left-overs of
#: a killed run are removed by the next one).
PARTIAL_PREFIX = ".partial-"


@dataclass(frozen=True)
class Line:
    """One non-empty line of the text file.

    Attributes:
        number: 1-based line number in the file (empty lines count).
        text: the line without surrounding whitespace (non-empty).
        seed: the sampler seed it is spoken with (``--seed + number - 1``), or None (random).
    """

    number: int
    text: str
    seed: int | None


def read_lines(text: str, base_seed: int | None, source: str = "the text file") -> tuple[list[Line], int]:
    """The lines to speak of a text file's contents, and the file's line count.

    Args:
        text: the whole file (UTF-8 decoded).
        base_seed: ``--seed`` (line ``n`` gets ``base_seed + n - 1``), or None.
        source: how messages name the file (its path, or ``standard input``).

    Returns:
        ``(lines, line_count)``; empty and whitespace-only lines (also after a leading byte-order
        mark is dropped, :func:`~higgs_pack.runtime.text.clean`, as from HTTP's ``input``), and lines
        of only whitespace and format characters (:func:`~higgs_pack.runtime.text.blank`), are left
        out but counted.

    Raises:
        InputError: no line holds any text, or a line cannot be spoken (only control
            characters, or not valid Unicode: :func:`~higgs_pack.runtime.request.unspeakable`),
            every such line named.
    """
    from higgs_pack.runtime.request import refuse, unspeakable
    from higgs_pack.runtime.text import blank, clean
    from higgs_pack.runtime.text import lines as text_lines

    raw = text_lines(text)  # LF, CR LF, CR: the one line rule (runtime/text.py)
    if raw and raw[-1] == "":
        raw.pop()  # the line feed that ends the last line ends no line of its own
    # each line is one text, read as HTTP's input is (clean: a leading BOM dropped); a line empty
    # after that is skipped as a whitespace-only line is, keeping its number, and so is a line of only
    # whitespace and format characters (U+200B: blank, nothing to speak, the one rule of runtime/text.py)
    said = [(n, clean(s).strip()) for n, s in enumerate(raw, start=1)]
    lines = [Line(n, s, None if base_seed is None else base_seed + n - 1) for n, s in said if not blank(s)]
    if not lines:
        raise InputError.of(Problem.said(f"{source} has no non-empty line ({len(raw)} lines); --batch speaks one wav per "
                                         "non-empty line"))
    refuse([_line_problem(line, problem) for line in lines
            if (problem := unspeakable(line.text, _where(line, source))) is not None])
    return lines, len(raw)


def refuse_unplannable(pipeline: Any, lines: list[Line], requests: list[Any], source: str = "the text file") -> None:
    """Every line's text checked against the loaded bundle before any line is spoken, as
    :func:`read_lines` checks its characters: each request planned
    (:func:`~higgs_pack.runtime.loop.plan.plan_request`: a special token of the tokenizer, a
    sentence too long for the decoder's context), every line's problem named with its number.
    What is the same for every line (a voice or a frame cap that leaves no room for a word:
    :func:`~higgs_pack.runtime.loop.text_chunks.frame_cap_problems`) is refused first, once.

    Args:
        pipeline: the loaded bundle's pipeline (``TTS.pipeline``).
        lines, requests: the lines to speak and their ``SynthesisRequest`` (same order; a voice
            prepared once, ``TTS.prepare_voice``, not a clip each line would encode again).
        source: how messages name the file (its path, or ``standard input``).

    Raises:
        InputError: every line that cannot be spoken, each named by its number.
    """
    from higgs_pack.runtime.loop.plan import plan_request
    from higgs_pack.runtime.loop.text_chunks import frame_cap_problems
    from higgs_pack.runtime.request import PreparedVoice, refuse, say

    if not requests:
        return
    voice = requests[0].voice
    prepared = (voice.codes, voice.transcript) if isinstance(voice, PreparedVoice) else ()
    refuse(frame_cap_problems(pipeline, requests[0].max_frames, *prepared))
    found: list[Problem] = []
    for line, request in zip(lines, requests, strict=True):
        try:
            plan_request(pipeline, request)
        except InputError as exc:  # a line is not set with --text: its text's problems named by the line
            where = _where(line, source)
            found += [_line_problem(line, problem.render(name=where) if problem.field == "text"
                                    else f"{where}: {say(problem)}") for problem in exc.problems]
    refuse(found)


def _where(line: Line, source: str) -> str:
    """How messages name a line: ``line 3 of notes.txt``."""
    return f"line {line.number} of {source}"


def _line_problem(line: Line, sentence: str) -> Problem:
    """The problem of a line that cannot be spoken, ``sentence`` naming it (:func:`_where`)."""
    return Problem(None, line.text, message=literal(sentence), fix="fix or remove that line of --text-file")


def file_name(number: int, line_count: int) -> str:
    """``'0007.wav'``: the line number zero-padded to the width of ``line_count``."""
    return f"{number:0{len(str(line_count))}d}.wav"


def _atomic_write(path: Path, write: Callable[[Path], None]) -> None:
    """``write(tmp)`` to a hidden temporary name beside ``path``, then rename it over ``path``
    (a reader sees the old file or the new one, never half of one)."""
    tmp = path.parent / f"{PARTIAL_PREFIX}{os.getpid()}-{path.name}"  # made as any file is (umask)
    try:
        write(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


@dataclass
class BatchManifest:
    """What a batch folder holds (:data:`MANIFEST`).

    Attributes:
        settings: what every line was spoken with besides its text and seed (bundle, sampling,
            frame cap, voice, sample format); a resumed run must match them.
        text_file: the text file's path as given (``-``: stdin).
        line_count: lines in the file; to_speak: its non-empty lines.
        files: line number -> entry (``line``, ``text``, ``file``, ``seconds``, ``frames``,
            ``stop_reasons``, ``seed``, ``sha256``) of each wav written and renamed into place.
        errors: line number -> ``{"line", "text", "error"}`` of the lines that failed.
        state: ``running``, ``interrupted``, ``stopped by an error`` or ``finished``.
    """

    settings: dict[str, Any]
    text_file: str
    line_count: int
    to_speak: int
    files: dict[int, dict[str, Any]] = field(default_factory=dict)
    errors: dict[int, dict[str, Any]] = field(default_factory=dict)
    state: str = "running"

    def to_dict(self) -> dict[str, Any]:
        """The JSON object written to :data:`MANIFEST`."""
        return {
            "format": MANIFEST_FORMAT, "state": self.state, "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "text_file": self.text_file, "line_count": self.line_count, "to_speak": self.to_speak,
            "written": len(self.files), "failed": len(self.errors), "settings": self.settings,
            "files": [self.files[n] for n in sorted(self.files)],
            "errors": [self.errors[n] for n in sorted(self.errors)],
        }

    def save(self, folder: Path) -> None:
        """Write :data:`MANIFEST` into ``folder`` atomically."""
        text = json.dumps(self.to_dict(), indent=2, ensure_ascii=False) + "\n"
        _atomic_write(folder / MANIFEST, lambda tmp: tmp.write_text(text, encoding="utf-8"))

    @staticmethod
    def read(folder: Path) -> dict[str, Any] | None:
        """The manifest a previous run left in ``folder``, or None when there is none.

        Raises:
            InputError: it is not JSON, or not a batch manifest of this format.
        """
        path = folder / MANIFEST
        if not path.is_file():
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise InputError.of(Problem.said(f"{path} cannot be read as JSON ({exc}); move it away to start this folder over, "
                                             "or choose another -o")) from exc
        if not isinstance(data, dict) or data.get("format") != MANIFEST_FORMAT:
            raise InputError.of(Problem.said(f"{path} is not a {MANIFEST_FORMAT} manifest; choose another -o"))
        return data


def finished_lines(previous: dict[str, Any] | None, settings: dict[str, Any], lines: list[Line],
                   folder: Path) -> dict[int, dict[str, Any]]:
    """The entries of a previous run's manifest that this run need not redo: same settings,
    and per line the same text and seed, its file still there with the listed sha256.

    Raises:
        InputError: the previous run used other settings (each difference named).
    """
    if previous is None:
        return {}
    before = previous.get("settings", {})
    changed = sorted(k for k in set(before) | set(settings) if before.get(k) != settings.get(k))
    if changed:
        diffs = "; ".join(f"{k}: {before.get(k)!r} there, {settings.get(k)!r} now" for k in changed)
        raise InputError.of(Problem.said(f"{folder / MANIFEST} was written with other settings ({diffs}); rerun with the same "
                                         "options to resume, choose another -o, or delete that manifest to start the folder over"))
    now = {line.number: line for line in lines}
    keep = {}
    for entry in previous.get("files", []):
        line = now.get(entry.get("line"))
        path = folder / str(entry.get("file", ""))
        if line is None or entry.get("text") != line.text or entry.get("seed") != line.seed:
            continue
        if path.parent == folder and path.is_file() and sha256_file(path) == entry.get("sha256"):
            keep[line.number] = entry
    return keep


def remove_partials(folder: Path) -> int:
    """Delete the temporary files a killed run left in ``folder``; returns how many."""
    found = [p for p in folder.glob(f"{PARTIAL_PREFIX}*") if p.is_file()]
    for path in found:
        path.unlink(missing_ok=True)
    return len(found)


def refuse_strangers(folder: Path, names: list[str], previous: dict[str, Any] | None) -> None:
    """Refuse to start when a file this run would write, or its manifest, is already in
    ``folder`` without ``previous`` (the earlier run's manifest) listing it (a user's file is never
    overwritten; a folder in its place would stop the run half way).

    Raises:
        InputError: naming up to five such paths and what to do.
    """
    listed = {str(entry.get("file")) for entry in (previous or {}).get("files", [])}  # redone when damaged
    found = [name for name in names if name not in listed and ((folder / name).exists() or (folder / name).is_symlink())]
    if (folder / MANIFEST).exists() and not (folder / MANIFEST).is_file():
        found.insert(0, MANIFEST)
    if found:
        shown = ", ".join(found[:5]) + (f" and {len(found) - 5} more" if len(found) > 5 else "")
        raise InputError.of(Problem.said(f"{folder} already holds {shown}, which no earlier run of this batch wrote (the batch "
                                         "manifest does not list them); move them away or choose another -o"))


@dataclass
class BatchOutcome:
    """What :func:`run_batch` did.

    Attributes:
        written: files written by this run; skipped: lines already finished by an earlier run;
        failed: lines that failed (their errors are in the manifest); to_speak: non-empty lines.
    """

    written: int
    skipped: int
    failed: int
    to_speak: int


def run_batch(tts: Any, lines: list[Line], requests: list[Any], manifest: BatchManifest, folder: Path, *,
              max_batch: int, subtype: str, say: Callable[[str, bool], None],
              progress: Callable[[int], None] | None = None) -> BatchOutcome:
    """Speak ``requests`` (one per entry of ``lines``, those not yet in ``manifest.files``)
    through one engine and write each finished wav and the manifest into ``folder``.

    Args:
        tts: the loaded :class:`~higgs_pack.runtime.api.TTS`.
        lines, requests: the lines to speak now and their ``SynthesisRequest`` (same order).
        manifest: the manifest to update (it may hold the lines a previous run finished).
        folder: the output folder (exists).
        max_batch: requests decoded together.
        subtype: ``"PCM_16"`` or ``"FLOAT"``.
        say: ``say(message, is_error)`` prints one line per file written or line failed.
        progress: called with the number of lines done after each.

    Returns:
        A :class:`BatchOutcome`.

    Raises:
        KeyboardInterrupt, or the error that stopped the engine: after the manifest says so
        (``state`` ``interrupted`` / ``stopped by an error``) and lists every file written.
    """
    from higgs_pack.runtime.audio import write_wav

    skipped = len(manifest.files)
    written = failed = 0
    manifest.state = "running"
    manifest.save(folder)
    try:
        for index, result in tts.synthesize_many(requests, max_batch=max_batch, in_order=False):
            line = lines[index]
            if isinstance(result, Exception):
                # a line's text is not set with --text: its problems said without how to set them
                error = result.say(Problem.render) if isinstance(result, InputError) else str(result)
                manifest.errors[line.number] = {"line": line.number, "text": line.text, "error": error}
                failed += 1
                say(f"line {line.number} failed: {error}", True)
            else:
                name = file_name(line.number, manifest.line_count)
                holder: dict[str, Any] = {}

                def write(tmp: Path, result=result, holder=holder) -> None:
                    holder["written"] = write_wav(tmp, result.samples, result.sample_rate, subtype=subtype)
                    holder["sha256"] = sha256_file(tmp)

                _atomic_write(folder / name, write)
                manifest.errors.pop(line.number, None)
                manifest.files[line.number] = {
                    "line": line.number, "text": line.text, "file": name,
                    "seconds": round(result.seconds_of_audio, 4), "frames": len(result.codes),
                    "stop_reasons": [r.stop_reason for r in result.chunks], "seed": line.seed,
                    "sha256": holder["sha256"]}
                written += 1
                scaled = " (scaled down to 16-bit range)" if holder["written"].scaled else ""
                say(f"wrote {name}: line {line.number}, {result.seconds_of_audio:.2f} s, {len(result.codes)} "
                    f"frames, stop: {', '.join(r.stop_reason for r in result.chunks)}{scaled}", False)
            manifest.save(folder)
            if progress is not None:
                progress(written + failed)
    except KeyboardInterrupt:
        manifest.state = "interrupted"
        manifest.save(folder)
        raise
    except BaseException:
        manifest.state = "stopped by an error"
        manifest.save(folder)
        raise
    manifest.state = "finished"
    manifest.save(folder)
    return BatchOutcome(written, skipped, failed, manifest.to_speak)


def batch_settings(bundle_name: str, request: Any, base_seed: int | None, subtype: str,
                   ref_audio: Path | None, openvino_engine: str | None = None) -> dict[str, Any]:
    """What a batch folder's lines share besides text and seed (compared when resuming).

    Args:
        bundle_name: the loaded bundle's name.
        request: any line's ``SynthesisRequest`` (its sampling fields and frame cap).
        base_seed: ``--seed``.
        subtype: the wav sample format (``PCM_16`` or ``FLOAT``).
        ref_audio: the reference clip (its sha256 is recorded), or None.
        openvino_engine: the OpenVINO engine that batches the lines
            (:func:`~higgs_pack.runtime.engine.decoders.openvino_engine_of`: ``"paged"``, or None
            where the lines are not batched on OpenVINO; the kernels are not bit-identical).

    Returns:
        A JSON-ready dict.
    """
    return {
        "bundle": bundle_name, "temperature": request.temperature, "top_k": request.top_k,
        "top_p": request.top_p, "max_frames": request.max_frames, "base_seed": base_seed, "format": subtype,
        "ref_audio_sha256": sha256_file(ref_audio) if ref_audio is not None else None,
        "ref_text": getattr(request.voice, "transcript", None), "openvino_engine": openvino_engine,
    }

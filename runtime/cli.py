"""The ``higgs-pack`` command line (one thin click group).

Runtime commands (synthesize, inspect, verify, list) are defined here; build
commands (build, package, make-tiny-checkpoint) live beside targets/ and are
found through the ``higgs_pack.commands`` entry points, imported only when one
of them runs, so a runtime-only install (no torch) works.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from higgs_pack.errors import HiggsPackError, install_extra
from higgs_pack.manifests.model import NAME_WIDTH
from higgs_pack.manifests.providers import EXECUTION_PROVIDERS
from higgs_pack.runtime.exit_status import EXIT_INTERRUPTED, EXIT_TERMINATED
from higgs_pack.runtime.options import MAX_CHUNK_FRAMES, click_options
from higgs_pack.runtime.speech_output import (
    Terminated,
    check_subtitles,
    how_stopped,
    say_notes,
    sigterm_as_interrupt,
    stop_summary,
    stream_out,
    write_out,
    write_subtitles,
)
from higgs_pack.runtime.text import decode

COMMAND_GROUP = "higgs_pack.commands"


class MissingExtra(click.ClickException):
    """A command whose extra is not installed: exit 2, as every other error of the environment."""

    exit_code = 2


class _Group(click.Group):
    """Adds lazily imported plugin commands and turns HiggsPackError into exit status 2."""

    def _plugins(self) -> dict[str, importlib.metadata.EntryPoint]:
        return {ep.name: ep for ep in importlib.metadata.entry_points(group=COMMAND_GROUP)}

    def list_commands(self, ctx):
        return sorted(set(super().list_commands(ctx)) | set(self._plugins()))

    def get_command(self, ctx, name):
        command = super().get_command(ctx, name)
        if command is not None:
            return command
        ep = self._plugins().get(name)
        if ep is None:
            return None
        try:
            return ep.load()
        except ImportError as exc:
            extra = ep.extras[0] if ep.extras else "build"  # `name = "module:command [extra]"`
            what = "the build tools" if extra == "build" else f"the [{extra}] extra"
            raise MissingExtra(
                f"`higgs-pack {name}` needs {what}, which is not installed ({exc}); " + install_extra(extra)
            ) from exc

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except HiggsPackError as exc:
            click.echo(f"error: {_said(exc, ctx)}", err=True)
            ctx.exit(2)
        except KeyboardInterrupt:
            # Ctrl-C anywhere a command does not handle it itself (loading, preparing the text):
            # the status of a program stopped by SIGINT, not click's "Aborted!" and 1.
            click.echo("interrupted (Ctrl-C)", err=True)
            ctx.exit(EXIT_INTERRUPTED)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(package_name="higgs-pack")
@click.option("-v", "--verbose", count=True, help="More logging (-vv for debug).")
def main(verbose: int) -> None:
    """Build, package, verify and run Higgs-Audio-v3 bundles."""
    level = logging.WARNING - 10 * min(verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")


#: Where ``click`` context's ``meta`` keeps the source of the words to speak, for messages.
TEXT_SOURCE = "higgs_pack.text_source"


def _said(exc: HiggsPackError, ctx: click.Context) -> str:
    """An error in the CLI's terms: a request's problems said again with the flags
    (:func:`~higgs_pack.runtime.request.cli_say`; the words named by where they came from), the
    rest as raised."""
    from higgs_pack.errors import InputError

    if not isinstance(exc, InputError) or all(problem.field is None for problem in exc.problems):
        return str(exc)
    from higgs_pack.errors import Problem
    from higgs_pack.runtime.request import cli_say, say

    if str(exc) not in (exc.say(say), exc.say(Problem.render)):  # a message of its own (serve's settings)
        return str(exc)

    source = ctx.meta.get(TEXT_SOURCE, "--text")
    return exc.say(lambda problem: cli_say(problem, source))


def _read_text(text: str | None, text_file: Path | None, one_text: bool = True) -> str:
    """The words to speak: ``--text``, ``--text-file``, or stdin (``--text -``, ``--text-file -`` or neither),
    as the one text rule reads bytes (:func:`higgs_pack.runtime.text.decode`: UTF-8, a leading BOM dropped).
    ``one_text=False``: a file of texts (``--batch``), whose lines are checked each, named by line.

    Raises:
        click.UsageError: both given, or no text and a terminal on stdin.
        InputError: the file, stdin or ``--text`` is not UTF-8 (the byte named), or the file or stdin
            holds a control character or nothing but whitespace (the file named; ``--text``'s is the
            request's check).
    """
    if text is not None and text_file is not None:
        raise click.UsageError("give the text once: --text or --text-file, not both")
    from_stdin = text == "-" or str(text_file) == "-" or (text is None and text_file is None)
    context = click.get_current_context(silent=True)
    if context is not None:  # how a problem of the words names them (_said)
        context.meta[TEXT_SOURCE] = ("standard input" if from_stdin else
                                     f"--text-file {text_file}" if text_file is not None else "--text")
    if from_stdin:
        if sys.stdin is None or sys.stdin.isatty():
            raise click.UsageError("no text: pass --text \"…\", --text-file FILE, or pipe text on stdin")
        return _read_bytes(sys.stdin.buffer.read(), "standard input", one_text,
                           "pipe the words in, or give them with --text or --text-file")
    if text_file is not None:
        return _read_bytes(text_file.read_bytes(), f"--text-file {text_file}", one_text,
                           "write the words to speak in it, or give them with --text")
    return argument_text(text, "--text")


def _read_bytes(data: bytes, where: str, check: bool = True, fix: str = "") -> str:
    """A file's or stdin's bytes as text (:func:`~higgs_pack.runtime.text.decode`), checked
    (``check``) by the one text rule (:func:`~higgs_pack.runtime.text.problem`: a control
    character, or nothing but whitespace) naming ``where`` as a byte that is not UTF-8 is.

    Args:
        fix: what to do when there is nothing to speak in it (after "there is nothing to speak").

    Raises:
        InputError: not UTF-8, a control character other than tab and line breaks, or empty
            or whitespace-only.
    """
    from higgs_pack.errors import InputError, Problem, literal
    from higgs_pack.runtime.text import problem

    text = decode(data, where)
    if check and (bad := problem(text, where, f"there is nothing to speak; {fix}" if fix else "")) is not None:
        raise InputError.of(Problem(None, message=literal(bad)))
    return text


def argument_text(value: str, flag: str) -> str:
    """A command-line argument's text, its bytes judged as a file's are: Python hands bytes that are
    not UTF-8 over as lone surrogates (``surrogateescape``), which are turned back into those bytes
    and refused naming the byte (:func:`~higgs_pack.runtime.text.decode`), not the surrogate.

    Raises:
        InputError: ``flag``'s bytes are not UTF-8 (the byte named).
    """
    if not any("\udc80" <= char <= "\udcff" for char in value):
        return value
    try:
        data = value.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        return value  # a surrogate no byte makes: the text check names it
    return decode(data, flag, fix="give it as UTF-8 text (is the shell's locale UTF-8?)")


def _check_output(output: Path, bundle: str, inputs: list[Path | None], fmt: str = "wav") -> None:
    """Refuse an -o that would overwrite an input, land inside the bundle, or is not a .wav.

    ``-`` (stdout) must not be a terminal; ``--format raw`` only goes to stdout.  A device or a
    named pipe that exists (``/dev/null``) is taken as it is named.
    """
    if str(output) == "-":
        if sys.stdout.isatty():
            raise click.BadParameter("-o - writes binary audio to stdout, which is a terminal here; pipe it "
                                     "(… -o - | aplay) or give a .wav file", param_hint="-o")
        return
    if fmt == "raw":
        raise click.BadParameter("--format raw writes to stdout: use -o - (or --format wav for a file)",
                                 param_hint="--format")
    from higgs_pack.runtime.audio import written_in_place

    out = output.resolve()
    if written_in_place(out):
        return  # /dev/null or a named pipe: the WAV goes into it in place, whatever its name
    if output.suffix.lower() != ".wav":
        bare = output.name.lower() == ".wav"  # a name that is only the suffix: Path sees a hidden file, no suffix
        raise click.BadParameter(f"{output}: the output is a WAV file; give it a "
                                 f"{'name before .wav (out.wav)' if bare else '.wav name'}", param_hint="-o")
    if not out.parent.is_dir():
        raise click.BadParameter(f"{output}: folder {out.parent} does not exist; create it first", param_hint="-o")
    if out.is_dir():
        raise click.BadParameter(f"{output} is a directory; give a file name ending in .wav", param_hint="-o")
    for path in inputs:
        if path is not None and str(path) != "-" and path.exists() and path.resolve() == out:
            raise click.BadParameter(f"{output} is also an input of this command; it would be overwritten",
                                     param_hint="-o")
    bundle_path = Path(bundle)
    if bundle_path.is_dir() and (out == bundle_path.resolve() or bundle_path.resolve() in out.parents):
        raise click.BadParameter(f"{output} is inside the bundle {bundle}; write the audio elsewhere",
                                 param_hint="-o")
    from higgs_pack.runtime.audio import check_writable

    check_writable(output, "-o")  # /proc/x.wav, a read-only folder: refused now, not after generating


def _progress_bar(no_progress: bool):
    """A tqdm bar on stderr, or a disabled one with ``--no-progress`` or when stderr is not a
    terminal (a log would fill with its carriage-return redraws)."""
    from tqdm import tqdm

    quiet = no_progress or not (sys.stderr is not None and sys.stderr.isatty())
    return tqdm(total=0, unit="frame", disable=quiet, desc="synthesizing", leave=False)


@dataclass(frozen=True)
class SynthesizeFlags:
    """The flags of ``higgs-pack synthesize``, as click parsed them (one object, not 24 parameters).

    Attributes are the command's options by their click names (``--float`` is ``as_float``,
    ``--stream`` is ``streaming``, ``--format`` is ``fmt``, ``--bundles`` is ``bundle_dirs``).
    """

    bundle: str
    text: str | None
    text_file: Path | None
    output: Path
    ref_audio: Path | None
    ref_text: str | None
    execution_provider: str | None
    device: str | None
    allow_fallback: bool
    seed: int
    temperature: float | None
    top_k: int | None
    top_p: float | None
    max_frames: int | None
    as_float: bool
    no_progress: bool
    bundle_dirs: tuple[Path, ...]
    variant: str | None
    streaming: bool
    fmt: str
    first_chunk_frames: int
    chunk_growth: float
    max_chunk_frames: int
    batch: int | None
    context_chunks: int
    context_frames: int | None
    subtitles: Path | None

    def sampling(self) -> dict[str, Any]:
        """The request's sampling keywords, frame cap and rolling context (``SynthesisRequest.create``'s)."""
        return {"seed": self.seed, "temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p,
                "max_frames": self.max_frames, "context_chunks": self.context_chunks,
                "context_frames": self.context_frames}

    def voice(self) -> dict[str, Any]:
        """The reference clip and its transcript (``SynthesisRequest.create``'s keywords)."""
        ref_text = None if self.ref_text is None else argument_text(self.ref_text, "--ref-text")
        return {"ref_audio": self.ref_audio, "ref_text": ref_text}

    def load_keywords(self) -> dict[str, Any]:
        """Where to run the bundle (:func:`higgs_pack.runtime.api.load`'s keywords)."""
        return {"device": self.device, "execution_provider": self.execution_provider,
                "allow_fallback": self.allow_fallback, "bundle_dirs": self.bundle_dirs, "variant": self.variant}

    @property
    def subtype(self) -> str:
        """libsndfile's subtype of the written audio: ``FLOAT`` with ``--float``, else ``PCM_16``."""
        return "FLOAT" if self.as_float else "PCM_16"


#: ``--subtitles FILE`` of ``synthesize`` and ``dialogue``.
def _options(*decorators: Any) -> Any:
    """One decorator applying click ``decorators`` in the order written (top first)."""
    def apply(command: Any) -> Any:
        for decorator in reversed(decorators):
            command = decorator(command)
        return command

    return apply


#: Where a speaking command runs and how it samples (``synthesize`` and ``dialogue``).
SPEAKING_OPTIONS = _options(
    click.option("--execution-provider", help=f"ONNX Runtime bundles: {', '.join(EXECUTION_PROVIDERS)}."),
    click.option("--device", help="OpenVINO bundles: CPU, GPU, NPU, AUTO, HETERO:…."),
    click.option("--allow-fallback", is_flag=True, help="Permit another provider/device if the one asked for is missing."),
    click_options("seed", "temperature", "top_k", "top_p"),  # from the request's one declaration (runtime/options.py)
)
SUBTITLES_OPTION = click.option(
    "--subtitles", type=click.Path(path_type=Path, dir_okay=False),
    help="Also write subtitles, one cue per sentence (per turn in a dialogue), timed from frame counts: "
         "SubRip for .srt, WebVTT for .vtt (the [subtitles] extra).")


@main.command()
@click.argument("bundle")
@click.option("--text", "-t", help="Text to speak ('-' or omitted: read stdin).")
@click.option("--text-file", type=click.Path(path_type=Path, dir_okay=False, allow_dash=True, exists=True),
              help="Read the text from a file ('-' for stdin).")
@click.option("-o", "--output", type=click.Path(path_type=Path, allow_dash=True), required=True,
              help="Output .wav (24 kHz mono), or - for stdout; with --batch a folder.")
@click.option("--ref-audio", type=click.Path(path_type=Path),  # checked by the request (one rule)
              help="Reference voice to clone (any sample rate / channels libsndfile reads).")
@click.option("--ref-text", help="Exact transcript of --ref-audio.")
@SPEAKING_OPTIONS
@click_options("max_frames")
@click.option("--float", "as_float", is_flag=True, help="Write 32-bit float wav instead of 16-bit PCM.")
@click.option("--no-progress", is_flag=True, help="No progress bar (there is none when stderr is not a terminal).")
@click.option("--bundles", "bundle_dirs", multiple=True, type=click.Path(path_type=Path, file_okay=False, exists=True),
              help="For a model slug: also choose among the bundles in this folder (repeatable).")
@click.option("--variant", help="For a hub repository holding several bundles: the folder to use.")
@click.option("--stream", "streaming", is_flag=True,
              help="Write audio while it is generated (first chunk: --first-chunk-frames of audio).")
@click.option("--format", "fmt", type=click.Choice(["wav", "raw"]), default="wav", show_default=True,
              help="With -o -: a WAV stream, or raw little-endian PCM (s16le; f32le with --float), mono 24 kHz.")
@click_options("first_chunk_frames", "chunk_growth", "max_chunk_frames", "context_chunks", "context_frames")
@click.option("--batch", type=click.IntRange(min=1),
              help="Speak every non-empty line of --text-file into its own wav in the folder -o, this many "
                   "lines decoded together; rerun to resume.")
@SUBTITLES_OPTION
def synthesize(**flags: Any) -> None:
    """Speak TEXT with BUNDLE into a wav (or, with -o -, to stdout).

    BUNDLE is a bundle directory, a folder of bundles (the best for this machine is
    chosen), an archive (.tar.gz, .zip, .whl), an installed bundle name, a model slug
    (higgs-audio-v3-tiny: the best variant for this machine is chosen, and the choice
    is said), or hf://ORG/REPO[@REVISION].

    The whole request (text, voice, sampling, frame cap, stream schedule) is checked
    before the bundle is loaded or anything is written.  Without --stream a .wav is
    written a few seconds at a time (memory stays that of one piece, whatever the text's
    length) to a hidden file beside it, which takes its name only when complete: after
    Ctrl-C or an error there is no new file.  With --stream the audio is
    written while it is generated (a .wav file's header is completed at the end, also
    after Ctrl-C); `-o -` writes to stdout for a player:
    higgs-pack synthesize BUNDLE --stream -t "…" -o - | aplay

    With --batch N and --text-file FILE, each non-empty line becomes OUTDIR/<line>.wav
    (line numbers zero-padded), N lines decoded together, line n with seed --seed + n - 1;
    OUTDIR/batch-manifest.json lists what was written.  An interrupted run keeps its
    finished files; the same command again skips them and does the rest:
    higgs-pack synthesize BUNDLE --text-file lines.txt --batch 8 -o outdir/
    """
    from higgs_pack.runtime.api import load
    from higgs_pack.runtime.request import SynthesisRequest
    from higgs_pack.runtime.sources.bundle import require_bundle_dir

    f = SynthesizeFlags(**flags)
    output = f.output
    require_bundle_dir(Path(f.bundle), folders_of_bundles=True)  # before -o is judged against it
    _refuse_schedule_without_stream(click.get_current_context(), f.streaming)
    if f.batch is not None:
        if f.subtitles is not None:
            raise click.UsageError("--subtitles writes one file for one text; --batch writes a wav per line: "
                                   "drop one of them")
        _synthesize_batch(f)
        return
    _check_output(output, f.bundle, [f.text_file, f.ref_audio], f.fmt)
    check_subtitles(f.subtitles, output, [f.text_file, f.ref_audio])
    to_file = not f.streaming and str(output) != "-"  # written piece by piece all the same (FILE_SCHEDULE)
    schedule = FILE_SCHEDULE if to_file else {"first_chunk_frames": f.first_chunk_frames,
                                              "chunk_growth": f.chunk_growth, "max_chunk_frames": f.max_chunk_frames}
    request = SynthesisRequest.create(_read_text(f.text, f.text_file), **f.voice(), **f.sampling(), **schedule)
    tts = load(f.bundle, **f.load_keywords())
    if not f.streaming:  # no one hears a piece before the whole: one codec call per piece, the fewest
        tts.pipeline.codec_feed_frames = None
    click.echo(f"using {tts.info}", err=True)
    for name, why in tts.info.not_chosen.items():
        click.echo(f"  not chosen: {name}: {why}", err=True)
    bar = _progress_bar(f.no_progress)

    def progress(done: int, total: int) -> None:
        if bar.total != total:
            bar.reset(total=total)
        bar.n = done
        bar.refresh()

    subtype = f.subtype
    if f.streaming or str(output) == "-":
        stream_out(tts, request, output, subtype, f.fmt, bar, f.streaming, progress, f.subtitles)
        return
    written, samples, results, segments = write_out(tts.stream(request, progress=progress), tts.sample_rate,
                                                     output, subtype, bar)
    write_subtitles(f.subtitles, segments, output)
    frames = sum(len(r.codes) for r in results)
    click.echo(f"wrote {output}: {samples / tts.sample_rate:.2f} s at {tts.sample_rate} Hz, "
               f"{frames} frames in {len(results)} text chunk(s), stop: {stop_summary(results)}")
    say_notes(results, written)


#: The chunk schedule of audio written to a file without --stream: even pieces of the stream's
#: largest chunk (4 s), so that no more than a piece of audio is held (:func:`write_out`).
FILE_SCHEDULE = {"first_chunk_frames": MAX_CHUNK_FRAMES, "chunk_growth": 1.0, "max_chunk_frames": MAX_CHUNK_FRAMES}


def _refuse_schedule_without_stream(ctx: click.Context, streaming: bool) -> None:
    """Refuse the stream-schedule flags given without ``--stream`` (they would do nothing).

    Raises:
        click.UsageError: naming the flags given.
    """
    from click.core import ParameterSource

    given = [f"--{name.replace('_', '-')}" for name in ("first_chunk_frames", "chunk_growth", "max_chunk_frames")
             if ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE]
    if given and not streaming:
        raise click.UsageError(f"{' and '.join(given)} shape{'s' if len(given) == 1 else ''} the chunks of "
                               "--stream, and --stream is not given: add --stream, or drop "
                               f"{'it' if len(given) == 1 else 'them'}")


def _check_output_folder(output: Path, bundle: str, inputs: list[Path | None]) -> None:
    """Refuse a --batch -o that is not a folder (or cannot become one), or lies inside the bundle."""
    if str(output) == "-":
        raise click.BadParameter("--batch writes a folder of wavs, one per line; give a folder (-o outdir/), "
                                 "or drop --batch to send one text to stdout", param_hint="-o")
    if output.suffix.lower() == ".wav" and not output.is_dir():
        raise click.BadParameter(f"{output}: with --batch, -o is a folder that gets one wav per line; give a "
                                 "folder name (-o outdir/)", param_hint="-o")
    if output.exists() and not output.is_dir():
        raise click.BadParameter(f"{output} is a file; with --batch, -o is a folder that gets one wav per line",
                                 param_hint="-o")
    out = output.resolve()
    if not output.exists() and not out.parent.is_dir():
        raise click.BadParameter(f"{output}: folder {out.parent} does not exist; create it first", param_hint="-o")
    for path in inputs:
        if path is not None and str(path) != "-" and path.exists() and path.resolve() == out:
            raise click.BadParameter(f"{output} is also an input of this command", param_hint="-o")
    bundle_path = Path(bundle)
    if bundle_path.is_dir() and (out == bundle_path.resolve() or bundle_path.resolve() in out.parents):
        raise click.BadParameter(f"{output} is inside the bundle {bundle}; write the audio elsewhere",
                                 param_hint="-o")


def _batch_lines(f: SynthesizeFlags) -> tuple[list[Any], int, list[Any]]:
    """``synthesize --batch``'s flags and lines checked, before the bundle is looked at:
    ``(lines, the file's line count, one SynthesisRequest per line)``.

    Raises:
        click.UsageError: a flag that does not go with --batch; click.BadParameter: a bad -o.
        InputError: a line that cannot be spoken, or a bad option.
    """
    from dataclasses import replace

    from higgs_pack.runtime.batch import read_lines
    from higgs_pack.runtime.request import SynthesisRequest

    text, text_file, output = f.text, f.text_file, f.output
    if text_file is None:
        raise click.UsageError("--batch N speaks one wav per line of a text file: give --text-file FILE (and a "
                               "folder as -o), or drop --batch to speak one text")
    if text is not None:
        raise click.UsageError("--batch reads its lines from --text-file; --text gives one text (drop --batch)")
    if f.streaming:
        raise click.UsageError("--stream writes one text while it is generated; --batch writes one finished wav "
                               "per line: use one of them")
    if f.fmt != "wav":
        raise click.UsageError("--format raw writes one text to stdout; --batch writes wav files: drop --format")
    _check_output_folder(output, f.bundle, [text_file, f.ref_audio])
    lines, line_count = read_lines(_read_text(None, text_file, one_text=False), f.seed, _source_name(text_file))
    first = SynthesisRequest.create(lines[0].text, **f.voice(), **{**f.sampling(), "seed": lines[0].seed})
    return lines, line_count, [first] + [replace(first, text=line.text, seed=line.seed) for line in lines[1:]]


def _synthesize_batch(f: SynthesizeFlags) -> None:
    """``synthesize --batch``: every non-empty line of ``--text-file`` into its own wav in the
    folder ``-o`` (:mod:`higgs_pack.runtime.batch`).  Exit 1 when some line failed, 130 after
    Ctrl-C (the finished files and the manifest stay)."""
    from dataclasses import replace

    from higgs_pack.runtime.api import load
    from higgs_pack.runtime.batch import (
        MANIFEST,
        BatchManifest,
        batch_settings,
        file_name,
        finished_lines,
        refuse_strangers,
        refuse_unplannable,
        remove_partials,
        run_batch,
    )
    from higgs_pack.runtime.engine.decoders import openvino_engine_of

    lines, line_count, requests = _batch_lines(f)
    first, output, text_file, ref_audio, ref_text = requests[0], f.output, f.text_file, f.ref_audio, f.ref_text
    subtype, no_progress, batch = f.subtype, f.no_progress, f.batch
    tts = load(f.bundle, **f.load_keywords())
    click.echo(f"using {tts.info}", err=True)
    engine = openvino_engine_of(tts.info.backend, batch)
    settings = batch_settings(tts.info.bundle, first, f.seed, subtype, ref_audio, openvino_engine=engine)
    previous = BatchManifest.read(output)
    done = finished_lines(previous, settings, lines, output)
    manifest = BatchManifest(settings, str(text_file), line_count, len(lines), files=done)
    todo = [i for i, line in enumerate(lines) if line.number not in done]
    refuse_strangers(output, [file_name(lines[i].number, line_count) for i in todo], previous)
    if ref_audio is not None and todo:
        prepared = tts.prepare_voice(ref_audio, ref_text)  # encoded once for every line
        requests = [replace(r, voice=prepared) for r in requests]
    # every line's text against the bundle before any is spoken, as its characters were (read_lines)
    refuse_unplannable(tts.pipeline, [lines[i] for i in todo], [requests[i] for i in todo], _source_name(text_file))
    output.mkdir(exist_ok=True)
    removed = remove_partials(output)
    if removed:
        click.echo(f"removed {removed} unfinished file(s) a stopped run left in {output}", err=True)
    if done:
        click.echo(f"skipping {len(done)} of {len(lines)} lines: already written ({output / MANIFEST})", err=True)
    from tqdm import tqdm

    quiet = no_progress or not (sys.stderr is not None and sys.stderr.isatty())
    bar = tqdm(total=len(todo), unit="line", disable=quiet, desc="synthesizing", leave=False)

    def say(message: str, is_error: bool) -> None:
        (bar.write if not quiet else click.echo)(message, **({"file": sys.stderr} if is_error else {}))

    try:
        with sigterm_as_interrupt():
            outcome = run_batch(tts, [lines[i] for i in todo], [requests[i] for i in todo], manifest, output,
                                max_batch=batch, subtype=subtype, say=say,
                                progress=lambda n: bar.update(n - bar.n))
    except KeyboardInterrupt as exc:
        bar.close()
        click.echo(f"{how_stopped(exc)}: {len(manifest.files)} of {len(lines)} lines written, listed in "
                   f"{output / MANIFEST}; run the same command again to do the rest", err=True)
        sys.exit(EXIT_TERMINATED if isinstance(exc, Terminated) else EXIT_INTERRUPTED)
    bar.close()
    notes = [f"{outcome.skipped} skipped: already written"] if outcome.skipped else []
    notes += [f"{outcome.failed} failed, listed in its errors"] if outcome.failed else []
    notes_text = f" ({'; '.join(notes)})" if notes else ""
    click.echo(f"wrote {outcome.written} file(s) to {output}{notes_text}; {len(manifest.files)} of {len(lines)} "
               f"lines done, manifest {output / MANIFEST}")
    if outcome.failed:
        click.echo(f"error: {outcome.failed} line(s) failed; fix them and run the same command again to do only "
                   "those", err=True)
        sys.exit(1)




@main.command()
@click.argument("bundle")
@click.argument("script", type=click.Path(path_type=Path, dir_okay=False, exists=True, allow_dash=True))
@click.option("-o", "--output", type=click.Path(path_type=Path), required=True, help="Output .wav (24 kHz mono).")
@click.option("--voice", "voices", multiple=True, metavar="NAME=CLIP:TRANSCRIPT",
              help="The voice of speaker NAME: a reference clip and its exact words (repeatable). A speaker "
                   "without one speaks its first turn in a voice of the model's choosing, kept after that.")
@SUBTITLES_OPTION
@SPEAKING_OPTIONS
@click_options("max_frames", "context_chunks", "context_frames")
@click.option("--float", "as_float", is_flag=True, help="Write 32-bit float wav instead of 16-bit PCM.")
@click.option("--no-progress", is_flag=True, help="No progress bar (there is none when stderr is not a terminal).")
def dialogue(bundle, script, output, voices, subtitles, execution_provider, device, allow_fallback, seed,
             temperature, top_k, top_p, max_frames, context_chunks, context_frames, as_float, no_progress) -> None:
    """Speak SCRIPT, a dialogue, with BUNDLE into one wav.

    SCRIPT is UTF-8 text with one turn per line, NAME: text ('-' for stdin); blank lines and
    lines starting with # are skipped.  Each turn is spoken in its speaker's voice, with that
    speaker's recent turns as context; the turns join as continuous speech.  The whole script
    and every voice are checked before the bundle loads:

    higgs-pack dialogue BUNDLE script.txt -o talk.wav --subtitles talk.srt --voice ANN=ann.wav:"Words of the clip."
    """
    from higgs_pack.runtime.api import load
    from higgs_pack.runtime.loop.dialogue import DialogueRequest, named_twice, parse_script
    from higgs_pack.runtime.sources.bundle import require_bundle_dir

    require_bundle_dir(Path(bundle), folders_of_bundles=True)
    if str(output) == "-":
        raise click.BadParameter("dialogue writes a .wav file; -o - (stdout) is not supported: give a file name "
                                 "(-o talk.wav), then play it", param_hint="-o")
    chosen = [_voice_flag(v) for v in voices]
    inputs = [script, *(clip for _, (clip, _words) in chosen)]  # -o or --subtitles on a clip would overwrite it
    _check_output(output, bundle, inputs)
    check_subtitles(subtitles, output, inputs)
    turns = parse_script(_read_script(script), _source_name(script), voices=[name for name, _ in chosen])
    twice = sorted(named_twice(name for name, _ in chosen))
    if twice:
        raise click.BadParameter(f"--voice gives {', '.join(map(repr, twice))} more than once; give each speaker "
                                 "one voice", param_hint="--voice")
    request = DialogueRequest.create(turns, dict(chosen), seed=seed, temperature=temperature, top_k=top_k,
                                     top_p=top_p, max_frames=max_frames, context_chunks=context_chunks,
                                     context_frames=context_frames,
                                     **FILE_SCHEDULE)
    tts = load(bundle, device=device, execution_provider=execution_provider, allow_fallback=allow_fallback)
    click.echo(f"using {tts.info}", err=True)
    bar = _progress_bar(no_progress)

    def progress(done: int, total: int) -> None:
        if bar.total != total:
            bar.reset(total=total)
        bar.n = done
        bar.refresh()

    written, samples, results, segments = write_out(tts.stream_dialogue(request, progress=progress),
                                                     tts.sample_rate, output, "FLOAT" if as_float else "PCM_16", bar, keep_hint="")
    click.echo(f"wrote {output}: {samples / tts.sample_rate:.2f} s at {tts.sample_rate} Hz, {len(turns)} "
               f"turn(s) in {len(results)} text chunk(s), {sum(len(r.codes) for r in results)} frames")
    write_subtitles(subtitles, segments, output)
    say_notes(results, written)


def _read_script(script: Path) -> str:
    """The script's text (``-``: stdin), as the one text rule reads bytes
    (:func:`higgs_pack.runtime.text.decode`: UTF-8, a leading BOM dropped).

    Raises:
        InputError: not UTF-8 (a binary file, or another encoding), the byte named.
    """
    data = sys.stdin.buffer.read() if str(script) == "-" else script.read_bytes()
    return decode(data, _source_name(script), fix="a script is UTF-8 text with one turn per line, NAME: text "
                  "(is it a binary file?)")


def _source_name(path: Path) -> str:
    """How messages name a file argument: ``standard input`` for ``-``."""
    return "standard input" if str(path) == "-" else str(path)


def _voice_flag(value: str) -> tuple[str, tuple[Path, str]]:
    """``--voice NAME=CLIP:TRANSCRIPT`` as ``(NAME, (clip, transcript))``: CLIP is the longest part
    before a ``:`` that is an existing file (a path may hold ``:`` itself).

    Raises:
        click.BadParameter: no ``=``, no file, or no transcript (each with the form expected).
        InputError: the transcript's bytes are not UTF-8 (:func:`argument_text`, as ``--ref-text``'s).
    """
    from higgs_pack.runtime.loop.dialogue import key_problem, speaker_name

    name, sep, rest = value.partition("=")
    if sep:  # the speaker's name: its bytes and characters judged as a script's speaker's are
        from higgs_pack.errors import InputError, Problem

        name = argument_text(name, "the NAME of --voice")
        if speaker_name(name) and (problem := key_problem(name, "the NAME of --voice", "a speaker of the script")):
            raise InputError.of(Problem.said(problem, "voices"))
    name = speaker_name(name)  # as a script's speaker: a leading BOM dropped
    if not sep or not name:
        raise click.BadParameter(f"{value[:80]!r}: write a voice as NAME=clip.wav:\"exact words of the clip\"",
                                 param_hint="--voice")
    cuts = [i for i, char in enumerate(rest) if char == ":"]
    for cut in reversed(cuts):
        if Path(rest[:cut]).is_file():  # an empty transcript is the request's to refuse, as every text is
            words = argument_text(rest[cut + 1:], f"the transcript in --voice {name!r}")  # as --ref-text's
            return name, (Path(rest[:cut]), words)
    if not rest.split(":", 1)[0].strip():
        raise click.BadParameter(f"the voice of {name!r} names no clip: write {name}=clip.wav:"
                                 "\"exact words\"", param_hint="--voice")
    clip = Path(rest.split(":", 1)[0])
    if Path(rest).is_file() or (cuts and clip.is_file()):
        raise click.BadParameter(f"the voice of {name!r} needs the exact words said in its clip: "
                                 f"{name}=clip.wav:\"exact words\"", param_hint="--voice")
    what = f"{clip} is a folder, not an audio file" if clip.is_dir() else f"no file {clip}"
    raise click.BadParameter(f"the voice of {name!r}: {what} (write NAME=clip.wav:\"exact words\")",
                             param_hint="--voice")


@main.command()
@click.argument("bundle")
@click.option("--json", "as_json", is_flag=True, help="Print the whole manifest as JSON.")
def inspect(bundle, as_json):
    """Describe BUNDLE: target, precision, provider, sub-parts, sizes, tools."""
    from higgs_pack.runtime.backends import placement_of
    from higgs_pack.runtime.sources.bundle import open_bundle

    opened = open_bundle(bundle, check_hashes=False)
    m = opened.manifest
    if as_json:
        click.echo(json.dumps(m, indent=2, sort_keys=True))
        return
    size = sum(f["size"] for f in m["files"])
    where = placement_of(m)
    click.echo(f"{m['name']}  ({opened.path})")
    click.echo(f"  model      {m['model']['id']}  checkpoint sha256 {m['model']['checkpoint_sha256'][:16]}…")
    click.echo(f"  target     {m['target']}  precision {m['precision']}  backend {m['backend']} on {where}")
    click.echo(f"  requires   {', '.join(m['runtime_requirements'])}")
    click.echo(f"  size       {size / 1e6:.1f} MB in {len(m['files'])} files")
    for part, spec in m["subparts"].items():
        part_size = sum(f["size"] for f in m["files"] if f["path"] in spec["files"])
        passes = "+".join(spec["passes"]) or "-"
        click.echo(f"  {part:<{NAME_WIDTH}} {spec['format']:<8} {spec['precision']:<5} {part_size / 1e6:8.2f} MB  "
                   f"{spec['exporter']}: {passes}")
    ins = ", ".join(f"{t['name']}{t['shape']}" for t in m["subparts"]["llm_decoder"]["inputs"][:3])
    click.echo(f"  decoder in {ins}, …")


@main.command()
@click.argument("bundle")
@click.option("--execution-provider", help="ONNX Runtime bundles: provider to verify on.")
@click.option("--device", help="OpenVINO bundles: device to verify on.")
@click.option("--allow-fallback", is_flag=True, help="Permit another provider/device if missing.")
@click.option("--cases", type=click.Path(path_type=Path, file_okay=False, exists=True),
              help="Folder of cases to synthesize (text_en_basic.txt, text_zh.txt, ref_en_16k.wav/.txt).")
@click.option("--report", type=click.Path(path_type=Path, dir_okay=False),
              help="Also write the report: .html (one self-contained page with plots and audio; needs "
                   "higgs-pack[report]) or .json.")
@click.option("--require-gpu", is_flag=True,
              help="GPU-provider bundles: fail (not skip) when the provider's hardware is not usable here.")
@click.option("--skip-parity", is_flag=True,
              help="No parity/greedy/cases run on the bundle's (or the CPU) provider: file and static checks "
                   "(and the GPU provider run where present).")
@click.option("--low-memory", is_flag=True,
              help="ONNX Runtime fp32/fp16 bundles on the CPU provider: read the decoder's weights in place and "
                   "give their pages back after every step (the 4B fp32 decoder's 14.5 GB need not be resident; "
                   "slower). What the build's own verification does.")
def verify(bundle, execution_provider, device, allow_fallback, cases, report, require_gpu, skip_parity, low_memory):
    """Check BUNDLE (directory, installed name, archive or hf://ORG/REPO[@REV]): files, static checks,
    signatures, parity, speech; a GPU bundle also on its GPU provider where present (else skipped, naming it)."""
    from higgs_pack.runtime.sources.bundle import require_bundle_dir
    from higgs_pack.runtime.sources.hub import is_hub_ref
    from higgs_pack.runtime.verification.verify import require_cases, verify_any


    if cases is not None:
        require_cases(cases)  # a wrong folder is an error before minutes of checks, not a PASS
    as_html = report is not None and report.suffix.lower() in (".html", ".htm")
    if report is not None and not as_html and report.suffix.lower() != ".json":
        raise click.BadParameter(f"{report}: the report is .html or .json", param_hint="--report")
    if report is not None and not report.absolute().parent.is_dir():
        raise click.BadParameter(f"{report}: folder {report.absolute().parent} does not exist; create it first",
                                 param_hint="--report")
    if as_html:
        from higgs_pack.runtime.verification.html_report import require_matplotlib

        require_matplotlib()  # before minutes of verification, not after

    require_bundle_dir(Path(bundle))  # a wrong folder is a wrong argument (exit 2), not a failed check
    if is_hub_ref(bundle):
        from higgs_pack.runtime.sources.hub import pull as run_pull

        got = run_pull(bundle)
        click.echo(f"{got.repo_id}@{got.commit}: {got.reason} ({got.path})", err=True)
        bundle = str(got.path)
    result = verify_any(bundle, execution_provider=execution_provider, device=device,
                        allow_fallback=allow_fallback, cases_dir=cases, require_gpu=require_gpu,
                        parity=not skip_parity, low_memory=low_memory)
    click.echo(result.render())
    if as_html:
        from higgs_pack.runtime.verification.html_report import verify_html

        report.write_text(verify_html(result), encoding="utf-8")
        click.echo(f"wrote {report}", err=True)
    elif report:
        report.write_text(json.dumps(result.to_dict(), indent=2) + "\n", encoding="utf-8")
    if not result.ok:
        sys.exit(1)


@main.command()
@click.argument("repo")
@click.option("--variant", help="The bundle folder to take when the repository holds several "
              "(default: the best for this machine, see `higgs-pack devices`).")
@click.option("--cache-dir", type=click.Path(path_type=Path, file_okay=False),
              help="Hugging Face cache folder (default: $HF_HUB_CACHE).")
def pull(repo, variant, cache_dir):
    """Download a bundle from the Hugging Face Hub: REPO is ORG/NAME[@REVISION].

    Resumable, pinned to the commit the revision resolves to, HF_TOKEN respected,
    offline (HF_HUB_OFFLINE=1) from the cache; every file is checked against the
    manifest before the path is printed.
    """
    from higgs_pack.runtime.sources.hub import pull as run_pull

    got = run_pull(repo, variant=variant, cache_dir=cache_dir)
    click.echo(f"{got.repo_id}@{got.commit}: {got.reason}; {got.files_checked} files verified", err=True)
    click.echo(str(got.path))


@main.command()
@click.option("--bundles", "bundle_dirs", multiple=True, type=click.Path(path_type=Path, file_okay=False, exists=True),
              help="Also judge the bundles in this folder (repeatable; $HIGGS_PACK_BUNDLES adds more).")
@click.option("--json", "as_json", is_flag=True, help="Print the inventory and the verdicts as JSON.")
def devices(bundle_dirs, as_json):
    """What this machine offers, and which visible bundles run here (and why not)."""
    from higgs_pack.runtime.machine.inventory import describe

    text, data = describe(bundle_dirs)
    click.echo(json.dumps(data, indent=2) if as_json else text)


@main.command(name="list")
def list_bundles():
    """List bundles installed as wheels (usable by name)."""
    from higgs_pack.runtime.sources.bundle import open_bundle
    from higgs_pack.runtime.sources.installed import installed_bundles

    found = installed_bundles()
    if not found:
        click.echo("no bundles installed (pip install a bundle wheel built by `higgs-pack package`)")
        return
    for name, path in sorted(found.items()):
        try:
            m = open_bundle(path, check_hashes=False).manifest
            click.echo(f"{name:<44} {m['target']:<9} {m['precision']:<5} {path}")
        except HiggsPackError as exc:
            click.echo(f"{name:<44} BROKEN: {exc}")


if __name__ == "__main__":
    main()

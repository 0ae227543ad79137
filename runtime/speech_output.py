"""What the speaking commands (``higgs-pack synthesize`` and ``dialogue``) write and say: the wav
written a piece at a time or streamed as generated, the subtitles beside it, the notes on what was
made, and how a run stopped by Ctrl-C or SIGTERM is reported (:mod:`higgs_pack.runtime.cli` holds
the commands and their flags).

Runtime code: no torch, no build tools.
"""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

import click

from higgs_pack.errors import HiggsPackError
from higgs_pack.runtime.exit_status import EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, EXIT_TERMINATED


def write_out(speech, rate: int, output: Path, subtype: str, bar, keep_hint: str = "--stream writes a file that keeps it"):
    """Write a stream's audio to the .wav ``output`` piece by piece, put in place when complete.

    Memory stays that of one piece whatever the length (``tts.synthesize`` would hold the whole
    audio, its join and its encoding).  The pieces go to a hidden file beside ``output``
    (:class:`~higgs_pack.runtime.audio.WavFileWriter`), renamed over it at the end: Ctrl-C (exit
    130), SIGTERM (exit 143) or an error removes it and leaves ``output`` as it was, so no file
    claims to be a whole speech that is not (``--stream`` keeps what was written instead).

    Args:
        speech: a :class:`~higgs_pack.runtime.loop.streaming.SpeechStream`.
        rate: its sample rate, Hz.
        output: the .wav path.
        subtype: ``"PCM_16"`` (scaled to a 0.999 peak if it goes beyond [-1, 1]) or ``"FLOAT"``.
        bar: the progress bar, closed at the end.
        keep_hint: how this command keeps what was generated when stopped, said after Ctrl-C
            (``""``: it has no way).

    Returns:
        ``(written, samples, results, segments)``: the :class:`~higgs_pack.runtime.audio.WavWritten`,
        the samples written, each text chunk's result, every segment.
    """
    from higgs_pack.runtime.audio import WavFileWriter

    segments: list = []
    try:
        with sigterm_as_interrupt(), WavFileWriter(output, rate, subtype=subtype, option="-o") as writer:
            for chunk in speech:
                writer.write(chunk.samples)
                segments += chunk.segments
            written = writer.finish()
    except KeyboardInterrupt as exc:
        bar.close()
        click.echo(f"{how_stopped(exc)}: nothing written to {output}; the audio generated so far was not kept"
                   + (f" ({keep_hint})" if keep_hint else ""), err=True)
        sys.exit(EXIT_TERMINATED if isinstance(exc, Terminated) else EXIT_INTERRUPTED)
    finally:
        speech.close()
        bar.close()
    return written, writer.samples_written, speech.results, segments


def say_notes(results: list, written) -> None:
    """The notes after a file is written: the frame cap reached, audio scaled into 16 bits."""
    if any(r.stop_reason == "max_frames" for r in results):
        click.echo(FRAME_CAP_NOTE, err=True)
    if written.scaled:
        say_scaled(written.peak)


def say_scaled(peak: float) -> None:
    click.echo(f"note: peak {peak:.2f} exceeded 16-bit range; audio was scaled down "
               "(use --float to keep it unscaled)", err=True)


def check_subtitles(subtitles: Path | None, output: Path, inputs: list[Path | None]) -> None:
    """Refuse a ``--subtitles`` file that cannot be written (suffix, folder, library), or that is
    the audio output or an input, before the bundle loads (:func:`~higgs_pack.runtime.subtitles.check_subtitles_path`)."""
    if subtitles is None:
        return
    from higgs_pack.runtime.subtitles import check_subtitles_path

    check_subtitles_path(subtitles)
    for path in [output, *inputs]:
        if path is not None and str(path) != "-" and subtitles.resolve() == path.resolve():
            raise click.BadParameter(f"{subtitles} is also {'the audio output' if path is output else 'an input'} "
                                     "of this command; give the subtitles their own file", param_hint="--subtitles")


def write_subtitles(subtitles: Path | None, segments: list, audio: str | Path | None = None) -> None:
    """Write ``--subtitles`` after the audio; a failure (the disk filled up meanwhile) is one line
    and exit 2, saying that the audio already written (``audio``) is kept."""
    if subtitles is None:
        return
    from higgs_pack.runtime.subtitles import write_subtitles

    try:
        count = write_subtitles(subtitles, segments, "--subtitles")
    except HiggsPackError as exc:
        kept = f"; the audio in {audio} is written and kept" if audio is not None and str(audio) != "-" else ""
        click.echo(f"error: {exc}{kept}", err=True)
        sys.exit(2)
    click.echo(f"wrote {subtitles}: {count} cue(s), timed from frame counts (no word timings)", err=True)


class Terminated(KeyboardInterrupt):
    """SIGTERM during a batch or a stream: handled as Ctrl-C is (a batch's manifest says
    ``interrupted``; a streamed file is closed as a complete WAV of what was written)."""


@contextlib.contextmanager
def sigterm_as_interrupt():
    """While inside: SIGTERM (a timeout, systemd, Kubernetes) raises :class:`Terminated`, a
    KeyboardInterrupt, so it stops the work as Ctrl-C does; the previous handler after."""
    import signal

    def terminated(signum, frame) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def how_stopped(exc: KeyboardInterrupt) -> str:
    return "stopped (SIGTERM)" if isinstance(exc, Terminated) else "interrupted (Ctrl-C)"


def stop_summary(results: list) -> str:
    """Why each text chunk stopped: ``"eos, max_frames"`` for a few chunks; counts for many
    (``"997 max_frames, 3 eos"``, most first), not a line of a thousand words."""
    from collections import Counter

    reasons = [r.stop_reason for r in results]
    if len(reasons) <= 8:
        return ", ".join(reasons)
    return ", ".join(f"{n} {reason}" for reason, n in Counter(reasons).most_common())


#: Said when some text chunk stopped at its frame cap, not where the model ended the speech.
FRAME_CAP_NOTE = "note: the frame cap was reached before the model ended the speech (raise it with --max-frames)"


def stream_out(tts, request, output: Path, subtype: str, fmt: str, bar, streaming: bool, progress,
                subtitles: Path | None = None) -> None:
    """Write speech to ``output`` (a .wav path or ``-``) piece by piece as it is generated.

    Ctrl-C (exit 130) or SIGTERM (exit 143) stops generation and leaves a valid WAV of what
    was written (its header's sizes set to it, and said so); a closed stdout pipe stops it quietly (exit 141), with or without --stream. Without
    --stream (stdout only) the whole utterance is synthesized first and written at once.
    Nothing is opened or written before the loop has accepted the request.
    """
    import os

    from higgs_pack.runtime.audio import PCM16_PEAK, AudioSink

    to_stdout = str(output) == "-"
    where = "stdout" if to_stdout else str(output)
    rate = tts.sample_rate
    speech = tts.stream(request, progress=progress) if streaming else None
    sink, results, segments = None, [], []
    status, note, scaled, peak = 0, "", False, 0.0
    try:
        with sigterm_as_interrupt():
            if speech is None:
                result = tts.synthesize(request, progress=progress)
                results, segments = result.chunks, result.segments
                sink = AudioSink(sys.stdout.buffer, rate, subtype=subtype, container=fmt)
                peak = float(abs(result.samples).max(initial=0.0))
                scaled = subtype == "PCM_16" and peak > 1.0  # the whole audio is known: scaled as a file is
                sink.write(result.samples * (PCM16_PEAK / peak) if scaled else result.samples)
            else:
                sink = AudioSink(sys.stdout.buffer if to_stdout else output, rate, subtype=subtype, container=fmt)
                for chunk in speech:
                    sink.write(chunk.samples)
                    segments += chunk.segments
                results = speech.results
    except KeyboardInterrupt as exc:
        status = EXIT_TERMINATED if isinstance(exc, Terminated) else EXIT_INTERRUPTED
        note = f"{how_stopped(exc)}: "
    except BrokenPipeError:
        # The reader went away: nothing more can reach it. Point stdout at /dev/null so
        # that Python's own flush at exit does not fail again (Python's signal docs).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        status, note = EXIT_BROKEN_PIPE, "stopped, the reader closed the pipe: "
    finally:
        if speech is not None:
            speech.close()
        if sink is not None:
            sink.close()
        bar.close()
    say_written(note, sink, rate, where, results if not status else [], speech)
    if scaled:
        say_scaled(peak)
    if status != EXIT_BROKEN_PIPE:
        write_subtitles(subtitles, segments, output)  # after a stop: the segments whose audio was written
    if status in (EXIT_INTERRUPTED, EXIT_TERMINATED) and sink is not None and not to_stdout:
        click.echo(f"{output} is a complete WAV of the audio written before the stop (its RIFF and data sizes "
                   "were set to it)", err=True)
    if status:
        sys.exit(status)


def say_written(note: str, sink, rate: int, where: str, results: list, speech) -> None:
    """The closing lines of a stream: what was written where, and the notes (frame cap, clipping)."""
    seconds = (sink.samples_written if sink is not None else 0) / rate
    details = ""
    if results:
        stops = stop_summary(results)
        frames = sum(len(r.codes) for r in results)
        details = f", {frames} frames in {len(results)} text chunk(s), stop: {stops}"
        if speech is not None:
            details += f", first audio after {speech.first_audio_s:.2f} s"
    click.echo(f"{note}wrote {seconds:.2f} s at {rate} Hz to {where}{details}", err=True)
    if any(r.stop_reason == "max_frames" for r in results):
        click.echo(FRAME_CAP_NOTE, err=True)
    if sink is not None and sink.clipped:
        click.echo(f"note: {sink.clipped} samples beyond [-1, 1] were clipped in 16-bit output "
                   "(use --float to keep them)", err=True)



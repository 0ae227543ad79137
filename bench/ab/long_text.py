"""Peak memory of a long text spoken to a file (issue 30 item 1): ``python -m bench.ab long-text
BUNDLE [--copies 40,160] [--text-file F]``.

For each count N of ``--copies``, the text (the cases' English by default) said N times over is
spoken by ``higgs-pack synthesize BUNDLE --text-file T -o out.wav --subtitles out.srt`` in a
process of its own; per run: words, text KB, audio minutes (read back from the file), wall seconds
and the process's peak RSS (``os.wait4``).  Memory bounded by one chunk shows as the same peak for
every length.  The tiny bundle's random weights end chunks early: raise ``--copies`` until the
longest run holds the length wanted.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.ab.rolling import DEFAULT_TEXT
from bench.common.systems import machine_facts, markdown, print_report

HELP = "peak RSS of higgs-pack synthesize over long texts (bench/ab/long_text.py)"
HEADERS = ["copies", "words", "text KB", "audio min", "wall s", "peak RSS MB"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``long-text`` flags."""
    parser.add_argument("bundle", type=Path, help="a built bundle (folder or archive)")
    parser.add_argument("--text-file", type=Path, default=DEFAULT_TEXT, help="the text (default: the cases' English)")
    parser.add_argument("--copies", default="40,160", help="comma-separated counts of the text said over")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", type=Path, help="write the JSON report here")


def peak_rss_of(command: list[str]) -> tuple[float, str]:
    """Run ``command`` to its end; its own peak resident set in MB (Linux: ``ru_maxrss`` is in
    KiB) and its stderr.

    Raises:
        RuntimeError: the command failed (its exit status and stderr).
    """
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"})
    stderr = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(command[:4])}... exited with {proc.returncode}: {stderr.strip()[-2000:]}")
    return usage.ru_maxrss / 1024, stderr


def measure(args: argparse.Namespace) -> dict[str, Any]:
    """One run per count of ``--copies``, each in a scratch folder removed after it."""
    import soundfile as sf

    sentence = " ".join(args.text_file.read_text(encoding="utf-8").split())
    runs = []
    for copies in args.copies:
        with tempfile.TemporaryDirectory(prefix="higgs-pack-long-text-") as scratch:
            text = Path(scratch) / "text.txt"
            text.write_text(" ".join([sentence] * copies), encoding="utf-8")
            out = Path(scratch) / "out.wav"
            started = time.perf_counter()
            rss, _ = peak_rss_of([sys.executable, "-m", "higgs_pack.runtime.cli", "synthesize", str(args.bundle),
                                  "--text-file", str(text), "-o", str(out), "--subtitles",
                                  str(Path(scratch) / "out.srt"), "--seed", str(args.seed), "--no-progress"])
            runs.append({"copies": copies, "words": len(sentence.split()) * copies,
                         "text_kb": round(text.stat().st_size / 1024, 1),
                         "audio_min": round(sf.info(out).duration / 60, 2),
                         "wall_s": round(time.perf_counter() - started, 1), "peak_rss_mb": round(rss, 1)})
    return {"bundle": str(args.bundle), "text_file": args.text_file.name, "runs": runs}


def table(report: dict[str, Any]) -> str:
    """The runs as a Markdown table, a row per length."""
    return markdown(HEADERS, [[r["copies"], r["words"], r["text_kb"], r["audio_min"], r["wall_s"], r["peak_rss_mb"]]
                              for r in report["runs"]])


def command(args: argparse.Namespace) -> int:
    """``long-text``: measure, print, write ``--out``; 2 with the message on a bad input or a failed run."""
    given = args.copies
    try:
        args.copies = [int(c) for c in given.split(",") if c.strip()]
    except ValueError:
        args.copies = []
    if not args.copies or min(args.copies) < 1:
        print(f"error: --copies must be comma-separated whole numbers >= 1, got {given!r}", file=sys.stderr)
        return 2
    if not args.text_file.is_file():
        print(f"error: --text-file {args.text_file} is not a file", file=sys.stderr)
        return 2
    try:
        report = measure(args)
    except RuntimeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    machine = machine_facts()
    report = {"command": "long-text", "machine": machine, **report}
    return print_report(report, f"{machine['cpu']}, {args.bundle}", table(report), args.out)

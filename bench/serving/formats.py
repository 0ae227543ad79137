"""What each response format and each ``speed`` costs: CPU per second of audio, bits, first audio.

``python -m bench.serving.formats [--clip WAV] [--seconds 60] [--out run.json]`` streams real speech (the
cases' reference clip, resampled to 24 kHz and repeated to ``--seconds``) through each format's
:class:`~higgs_pack.serve.formats.StreamEncoder` in 0.4 s pieces (10 codec frames, as a stream
sends them; and in 10 ms pieces until what was sent decodes), through
:func:`~higgs_pack.serve.formats.encode_whole`, and through
:class:`~higgs_pack.serve.tempo.TimeStretch` at several speeds, all in one run, and prints JSON:
CPU milliseconds per audio second (process time, the least of ``--repeats``) and the bit rate on
the wire, with the CPU that measured them.  Kept in docs/benchmarks/runs/, a run is rendered in the
docs by the ``formats`` and ``atempo`` tables (:func:`formats_table`, :func:`atempo_table`).
"""

from __future__ import annotations

import argparse
import io
import json
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from bench.common.systems import machine_facts
from higgs_pack.runtime.audio import load_audio
from higgs_pack.serve.formats import FORMATS, StreamEncoder, encode_whole
from higgs_pack.serve.tempo import TimeStretch

RATE = 24000
#: Seconds of audio per piece of a stream: 10 codec frames of 40 ms.
PIECE_S = 0.4
SPEEDS = (0.25, 0.5, 1.25, 2.0, 4.0)


def speech(clip: Path, seconds: float) -> np.ndarray:
    """float32 [seconds * 24000]: ``clip`` at 24 kHz (linear interpolation; a load, not a listening
    test), repeated to length."""
    samples, rate = load_audio(clip)
    at_rate = np.interp(np.arange(int(samples.size * RATE / rate)) * rate / RATE, np.arange(samples.size), samples)
    return np.tile(at_rate, int(np.ceil(seconds * RATE / at_rate.size)))[: int(seconds * RATE)].astype(np.float32)


def cpu_ms_per_s(work: Callable[[], Any], seconds: float, repeats: int) -> float:
    """The least process CPU time of ``repeats`` runs of ``work``, in ms per second of audio."""
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        work()
        best = min(best, time.process_time() - start)
    return round(best / seconds * 1000, 3)


def first_audio_ms(samples: np.ndarray, response_format: str, step_ms: int = 10) -> float:
    """Milliseconds of audio a stream must be fed, in ``step_ms`` pieces, before the bytes it sent
    decode (FFmpeg, through PyAV) to at least one sample: the encoder's lookahead and frame, and the
    muxer's header, as a player sees them.

    Raises:
        ValueError: no decodable audio from all of ``samples``.
    """
    import av

    encoder, step = StreamEncoder(response_format, RATE), RATE * step_ms // 1000
    sent = encoder.start()
    for end in range(step, samples.size + 1, step):
        sent += encoder.chunk(samples[end - step:end])
        if response_format == "pcm":
            if sent:
                return end * 1000 / RATE
            continue
        try:
            with av.open(io.BytesIO(sent)) as container:
                if any(frame.samples for frame in container.decode(audio=0)):
                    return end * 1000 / RATE
        except av.FFmpegError:  # not yet a readable header
            continue
    raise ValueError(f"{response_format}: no decodable audio from {samples.size} samples")


def measure(samples: np.ndarray, repeats: int = 3) -> dict[str, Any]:
    """Per format (streamed, whole, kbit/s of the whole file) and per speed (the stretch alone)."""
    seconds = samples.size / RATE
    pieces = np.array_split(samples, max(1, round(seconds / PIECE_S)))

    def streamed(fmt: str) -> None:
        encoder = StreamEncoder(fmt, RATE)
        encoder.start()
        for piece in pieces:
            encoder.chunk(piece)
        encoder.finish()

    def stretched(speed: float) -> None:
        tempo = TimeStretch(speed, RATE)
        for piece in pieces:
            tempo.push(piece)
        tempo.finish()

    formats = {fmt: {"streamed_ms_per_s": cpu_ms_per_s(partial(streamed, fmt), seconds, repeats),
                     "whole_ms_per_s": cpu_ms_per_s(partial(encode_whole, samples, RATE, fmt), seconds, repeats),
                     "kbit_per_s": round(len(encode_whole(samples, RATE, fmt)) * 8 / seconds / 1000, 1),
                     "first_audio_ms": first_audio_ms(samples[:RATE], fmt)}
               for fmt in FORMATS}
    speeds = {str(speed): cpu_ms_per_s(partial(stretched, speed), seconds, repeats) for speed in SPEEDS}
    return {"machine": machine_facts(), "audio_seconds": seconds, "piece_seconds": PIECE_S, "repeats": repeats,
            "formats": formats, "atempo_ms_per_s": speeds}


def _facts(run: dict[str, Any]) -> list[str]:
    machine = run["machine"]
    return [f"{run['audio_seconds']:g} s of speech in {run['piece_seconds']:g} s pieces; process CPU time, the least "
            f"of {run['repeats']} runs; {machine['cpu']}, ISA {' '.join(machine['isa']['flags'])}"]


def formats_table(run: dict[str, Any]) -> tuple[list[str], list[list[str]], list[str]]:
    """(headers, rows, facts) of a run's formats: CPU ms per audio second streamed and whole, kbit/s,
    and the audio fed in 10 ms pieces before the stream decodes (:func:`first_audio_ms`)."""
    rows = [[f"`{fmt}`", f"{f['streamed_ms_per_s']:.2f}", f"{f['whole_ms_per_s']:.2f}", f"{f['kbit_per_s']:.1f}",
             f"{f['first_audio_ms']:.0f}"] for fmt, f in run["formats"].items()]
    return (["response_format", "CPU ms per audio s, streamed", "whole", "kbit/s sent", "ms in before audio decodes"],
            rows, _facts(run))


def atempo_table(run: dict[str, Any]) -> tuple[list[str], list[list[str]], list[str]]:
    """(headers, rows, facts) of a run's stretch: CPU ms per audio second at each speed."""
    rows = [[speed, f"{ms:.2f}"] for speed, ms in run["atempo_ms_per_s"].items()]
    return ["speed", "atempo CPU ms per audio s"], rows, _facts(run)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.serving.formats", description=__doc__.split("\n\n")[0])
    parser.add_argument("--clip", type=Path, default=Path(__file__).resolve().parents[3] / "shared" / "cases"
                        / "ref_en_16k.wav", help="speech to encode (default: the cases' reference clip)")
    parser.add_argument("--seconds", type=float, default=60.0, help="audio seconds per run")
    parser.add_argument("--repeats", type=int, default=3, help="runs per figure; the least is kept")
    parser.add_argument("--out", type=Path, help="also write the run here as JSON")
    args = parser.parse_args(argv)
    text = json.dumps(measure(speech(args.clip, args.seconds), args.repeats), indent=1)
    if args.out:
        args.out.write_text(text + "\n", encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()

"""Audio written to a file is held a piece at a time, whatever the length (issue 30, item 1).

``higgs-pack synthesize -o out.wav`` (and ``dialogue``) write the stream's pieces as they come
through :class:`~higgs_pack.runtime.audio.WavFileWriter`, to a hidden file renamed over the output
when complete; :func:`~higgs_pack.runtime.audio.write_wav` writes a whole array in blocks.
"""

import io
import os
import signal
import subprocess
import sys
import time
import tracemalloc

import numpy as np
import pytest
import soundfile as sf

from higgs_pack.errors import InputError
from higgs_pack.runtime.audio import PARTIAL_WAV_PREFIX, WavFileWriter, write_wav

HIGGS = [sys.executable, "-m", "higgs_pack.runtime.cli"]
SR = 24000
linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="ru_maxrss in KiB and /dev/full: Linux")


def _peak_rss_mb(command: list[str]) -> float:
    """The peak resident set of ``command``'s own process, MB (``ru_maxrss`` of its ``wait4``: KiB
    on Linux); AssertionError with its stderr when it fails."""
    child = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             env={**os.environ, "PYTHONWARNINGS": "ignore"})
    errors = child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, errors[-2000:]
    return usage.ru_maxrss / 1024


def _one_shot(samples: np.ndarray, subtype: str) -> bytes:
    """The WAV bytes libsndfile writes for the whole array at once (what write_wav wrote before)."""
    peak = float(np.abs(samples).max())
    if subtype == "PCM_16" and peak > 1.0:
        samples = samples * (0.999 / peak)
    encoded = io.BytesIO()
    sf.write(encoded, samples, SR, subtype=subtype, format="WAV")
    return encoded.getvalue()


@pytest.mark.parametrize("peak", [0.5, 1.7])
def test_pieces_written_equal_the_whole_audio_written_at_once(tmp_path, peak):
    """16-bit output written piece by piece, its peak unknown until the end, is byte for byte the
    file of the whole array (scaled to a 0.999 peak when beyond [-1, 1]); so is write_wav's."""
    x = np.clip(np.random.default_rng(0).standard_normal(2_500_000).astype(np.float32) * 0.1, -0.4, 0.4)
    x[1_234_567] = peak  # the peak comes late: earlier pieces are written before it is known
    with WavFileWriter(tmp_path / "pieces.wav", SR) as writer:
        for start in range(0, len(x), 96_000):
            writer.write(x[start:start + 96_000])
        written = writer.finish()
    assert (tmp_path / "pieces.wav").read_bytes() == _one_shot(x, "PCM_16")
    assert written.scaled == (peak > 1) and written.peak == pytest.approx(peak)
    assert write_wav(tmp_path / "whole.wav", x, SR).scaled == (peak > 1)
    assert (tmp_path / "whole.wav").read_bytes() == _one_shot(x, "PCM_16")
    with WavFileWriter(tmp_path / "float.wav", SR, subtype="FLOAT") as writer:
        writer.write(x[:1000])
        writer.write(x[1000:])
        assert not writer.finish().scaled
    assert np.array_equal(sf.read(tmp_path / "float.wav", dtype="float32")[0], x)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["float.wav", "pieces.wav", "whole.wav"]


def test_write_wav_makes_no_whole_copy_of_the_audio(tmp_path):
    """Writing 40 MB of float32 audio (scaled into 16 bits) allocates a block at a time, not a
    scaled copy and an encoded WAV in memory (before: 40 + 20 + 20 MB)."""
    x = np.full(10_000_000, 0.25, np.float32)
    x[7] = 1.5
    tracemalloc.start()
    try:
        write_wav(tmp_path / "a.wav", x, SR)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 12e6, f"write_wav held {peak / 1e6:.1f} MB beside 40 MB of audio"
    assert sf.info(tmp_path / "a.wav").frames == len(x)


def test_a_failed_or_interrupted_write_leaves_the_output_as_it_was(tmp_path):
    out = tmp_path / "out.wav"
    out.write_bytes(b"the old file")
    for stop in (KeyboardInterrupt(), RuntimeError("the codec failed")):
        try:
            with WavFileWriter(out, SR) as writer:
                writer.write(np.zeros(48_000, np.float32))
                assert [p.name for p in tmp_path.iterdir() if p.name.startswith(PARTIAL_WAV_PREFIX)]
                raise stop
        except BaseException as caught:
            assert caught is stop
        assert out.read_bytes() == b"the old file" and [p.name for p in tmp_path.iterdir()] == ["out.wav"]
    with pytest.raises(InputError, match="refusing to write audio with NaN/inf samples"), \
            WavFileWriter(out, SR) as writer:
        writer.write(np.array([0.0, np.nan], np.float32))
    assert out.read_bytes() == b"the old file" and [p.name for p in tmp_path.iterdir()] == ["out.wav"]
    with pytest.raises(InputError, match="already finished or discarded"):
        writer.write(np.zeros(10, np.float32))


@linux_only
def test_a_full_disk_is_named_and_nothing_is_left(tmp_path):
    """A link to /dev/full (a device: written in place) fails with ENOSPC said as such."""
    full = tmp_path / "full.wav"
    full.symlink_to("/dev/full")
    with pytest.raises(InputError, match=r"cannot write .*full.wav: out of disk space \(ENOSPC"), \
            WavFileWriter(full, SR) as writer:
        writer.write(np.zeros(200_000, np.float32))
        writer.finish()
    assert full.is_symlink() and [p.name for p in tmp_path.iterdir()] == ["full.wav"]


@linux_only
def test_a_long_text_to_a_file_is_held_a_piece_at_a_time(cpu_int4_bundle, cases_dir, tmp_path):
    """synthesize -o out.wav (no --stream) of a text 4x longer: well over twice the audio (~3
    against ~8-13 minutes on the tiny bundle, whose random weights end each chunk at a random
    frame), the same peak RSS within 60 MB.  Holding the whole audio (its
    samples, their join and the WAV encoded in memory, ~280 KB per second of audio) grew it by
    ~170 MB here."""
    sentence = (cases_dir / "text_en_basic.txt").read_text(encoding="utf-8").strip()
    found = {}
    for copies in (40, 160):
        text = tmp_path / f"t{copies}.txt"
        text.write_text(" ".join([sentence] * copies), encoding="utf-8")
        out = tmp_path / f"t{copies}.wav"
        rss = _peak_rss_mb([*HIGGS, "synthesize", str(cpu_int4_bundle), "--text-file", str(text), "-o",
                            str(out), "--subtitles", str(tmp_path / f"t{copies}.srt"), "--no-progress"])
        found[copies] = (rss, sf.info(out).duration)
    (short_rss, short_s), (long_rss, long_s) = found[40], found[160]
    assert long_s > 2 * short_s > 120, found
    assert long_rss - short_rss < 60, f"peak RSS grew with the length: {found}"
    cues = (tmp_path / "t160.srt").read_text(encoding="utf-8").strip().split("\n\n")
    assert len(cues) == 2 * 160  # two sentences per copy, every one timed
    last_end = cues[-1].splitlines()[1].split(" --> ")[1]
    h, m, s = last_end.replace(",", ".").split(":")
    assert abs(int(h) * 3600 + int(m) * 60 + float(s) - long_s) < 0.05


@linux_only
def test_ctrl_c_while_writing_a_file_leaves_the_old_file_and_no_half_written_one(cpu_int4_bundle, tmp_path):
    out = tmp_path / "out.wav"
    out.write_bytes(b"the old file")
    text = " ".join(f"This is sentence number {i} of a long text to speak." for i in range(1, 200))
    proc = subprocess.Popen([*HIGGS, "synthesize", str(cpu_int4_bundle), "-t", text, "-o", str(out), "--no-progress"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"},
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    deadline = time.monotonic() + 240
    while not [p for p in tmp_path.glob(f"{PARTIAL_WAV_PREFIX}*") if p.stat().st_size > 44 + 4 * SR]:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no audio within 240 s"
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert f"interrupted (Ctrl-C): nothing written to {out}" in stderr and "Traceback" not in stderr, stderr
    assert out.read_bytes() == b"the old file" and [p.name for p in tmp_path.iterdir()] == ["out.wav"]


@linux_only
def test_the_long_text_benchmark_records_peak_rss_per_length(cpu_int4_bundle, tmp_path):
    """``python -m bench.ab long-text``: a row per length with its words, audio minutes and peak
    RSS, kept as JSON that the docs render as the tool printed it; a bad --copies is refused."""
    import json
    from pathlib import Path

    from bench.ab import settings

    root = Path(__file__).resolve().parents[1]
    out = tmp_path / "long.json"
    proc = subprocess.run([sys.executable, "-m", "bench.ab", "long-text", str(cpu_int4_bundle), "--copies", "1,2",
                           "--out", str(out)], cwd=root, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    report = json.loads(out.read_text())
    one, two = report["runs"]
    assert (one["copies"], two["copies"]) == (1, 2) and two["words"] == 2 * one["words"] > 0
    assert two["audio_min"] > one["audio_min"] > 0 and one["peak_rss_mb"] > 50
    assert settings.report_table(report) in proc.stdout and f"| 2 | {two['words']} |" in proc.stdout
    bad = subprocess.run([sys.executable, "-m", "bench.ab", "long-text", str(cpu_int4_bundle), "--copies", "0,x"],
                         cwd=root, capture_output=True, text=True)
    assert bad.returncode == 2 and "--copies must be comma-separated whole numbers >= 1, got '0,x'" in bad.stderr

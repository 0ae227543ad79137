"""The higgs-pack command line, run as a user runs it (subprocess of the console script)."""

import io
import itertools
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf

HIGGS = [sys.executable, "-m", "higgs_pack.runtime.cli"]


def run(*args, input=None, check=True):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    out = subprocess.run([*HIGGS, *map(str, args)], capture_output=True, text=True, input=input, env=env)
    if check and out.returncode != 0:
        raise AssertionError(f"exit {out.returncode}\n{out.stdout}\n{out.stderr}")
    return out


def test_synthesize_text_file_and_stdin(cpu_int4_bundle, cases_dir, tmp_path):
    wav = tmp_path / "a.wav"
    out = run("synthesize", cpu_int4_bundle, "--text-file", cases_dir / "text_en_basic.txt", "-o", wav,
              "--no-progress", "--max-frames", "30")
    assert "wrote" in out.stdout and "frames" in out.stdout
    info = sf.info(wav)
    assert (info.samplerate, info.channels, info.subtype) == (24000, 1, "PCM_16")
    wav2 = tmp_path / "b.wav"
    run("synthesize", cpu_int4_bundle, "-o", wav2, "--no-progress", "--max-frames", "20", "--float",
        input="Piped text works too.")
    assert sf.info(wav2).subtype == "FLOAT"
    # `--text -` reads stdin as its help says (it was spoken as the word "-"); the progress bar
    # stays out of stderr when that is not a terminal (no carriage-return redraws in a log).
    wav3 = tmp_path / "c.wav"
    out = run("synthesize", cpu_int4_bundle, "--text", "-", "-o", wav3, "--max-frames", "20",
              input="Piped text works too.")
    assert sf.read(wav3)[0].shape == sf.read(wav2)[0].shape
    assert "\r" not in out.stderr and "synthesizing" not in out.stderr, out.stderr


def test_synthesize_reports_the_frame_cap(cpu_int4_bundle, tmp_path):
    out = run("synthesize", cpu_int4_bundle, "--text", "Hi.", "-o", tmp_path / "c.wav", "--no-progress",
              "--max-frames", "10", "--seed", "5")
    stops = re.search(r"stop: (.+)$", out.stdout, re.MULTILINE).group(1).split(", ")
    assert set(stops) <= {"eoc", "max_frames", "repeat_guard"}, stops
    # The note is printed exactly when some chunk stopped at its cap (never otherwise).
    assert ("frame cap was reached" in out.stderr) == ("max_frames" in stops), (stops, out.stderr)


def test_synthesize_clone(cpu_int4_bundle, cases_dir, tmp_path):
    run("synthesize", cpu_int4_bundle, "--text", "Cloned voice.", "-o", tmp_path / "d.wav", "--no-progress",
        "--ref-audio", cases_dir / "ref_en_16k.wav", "--ref-text", (cases_dir / "ref_en_16k.txt").read_text(),
        "--max-frames", "15")
    assert sf.info(tmp_path / "d.wav").frames > 0


def test_bad_inputs_exit_2_with_a_message(cpu_int4_bundle, tmp_path):
    out = run("synthesize", cpu_int4_bundle, "--text", "   ", "-o", tmp_path / "e.wav", check=False)
    assert out.returncode == 2 and "text is only whitespace: there is nothing to speak" in out.stderr
    (tmp_path / "x.wav").write_text("not audio")
    out = run("synthesize", cpu_int4_bundle, "--text", "Hi.", "-o", tmp_path / "f.wav",
              "--ref-audio", tmp_path / "x.wav", "--ref-text", "Hi.", check=False)
    assert out.returncode == 2 and "not a readable audio file" in out.stderr
    out = run("synthesize", tmp_path / "nope", "--text", "Hi.", "-o", tmp_path / "g.wav", check=False)
    assert out.returncode == 2 and "no such bundle directory" in out.stderr
    out = run("synthesize", cpu_int4_bundle, "--text", "Hi.", "-o", tmp_path / "h.wav", "--top-p", "0", check=False)
    assert out.returncode == 2 and "--top-p must be in (0, 1]" in out.stderr


def test_inspect_and_verify(cpu_int4_bundle, cases_dir, tmp_path):
    out = run("inspect", cpu_int4_bundle)
    assert "higgs-audio-v3-tiny-cpu-int4" in out.stdout and "llm_decoder" in out.stdout
    assert "OnnxBlockWiseRtnQuantization" in out.stdout
    # every sub-part's row has its columns where the others have theirs (audio_tokenizer_stream's did not)
    rows = [line for line in out.stdout.splitlines() if line.split()[:1] and line.split()[0] in
            {"text_embed", "llm_decoder", "audio_embed", "audio_heads", "audio_tokenizer", "audio_encoder",
             "audio_tokenizer_stream"}]
    assert len(rows) == 7 and len({row.index(" onnx ") for row in rows}) == 1, rows
    report = tmp_path / "report.json"
    out = run("verify", cpu_int4_bundle, "--report", report)
    assert "result: PASS" in out.stdout and report.is_file()


def test_verify_fails_on_a_damaged_bundle(bundle_copy):
    (bundle_copy / "audio_heads.onnx").write_bytes(b"x")
    out = run("verify", bundle_copy, check=False)
    assert out.returncode == 1 and "result: FAIL" in out.stdout
    # The file check fails, naming the file; nothing else is blamed for it.
    failed = [line for line in out.stdout.splitlines() if re.match(r"\s*FAIL\s", line)]
    assert len(failed) == 1, out.stdout
    assert re.match(r"\s*FAIL\s+files\s.*audio_heads\.onnx \(size 1 bytes, expected \d+\)", failed[0]), failed


def test_build_plan_and_unknown_target():
    out = run("build", "--target", "cpu", "--plan")
    assert "llm_decoder" in out.stdout and "modelbuilder" in out.stdout
    rows = [line for line in out.stdout.splitlines() if line.startswith("  ") and line.split()[0].startswith(
        ("text_", "llm_", "audio_"))]
    assert len(rows) == 7 and len({row.index(" fp32 " if " fp32 " in row else " int4 ") for row in rows}) == 1, rows
    out = run("build", "--target", "gpu", check=False)
    assert out.returncode == 2 and "unknown target 'gpu'" in out.stderr
    out = run("build", "--target", "cpu", "--precision", "fp16", check=False)
    assert out.returncode == 2 and "target 'cpu' does not support precision 'fp16'" in out.stderr


@pytest.mark.slow  # a fresh interpreter importing torch (~20 s); tests/test_tiny_checkpoint.py covers determinism fast
def test_make_tiny_checkpoint_is_deterministic(tiny_checkpoint, tmp_path):
    # The session's tiny checkpoint (seed 0, made in this process) and one from the command.
    run("make-tiny-checkpoint", tmp_path / "a", "--seed", "0")
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == sorted(p.name for p in tiny_checkpoint.iterdir())
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tiny_checkpoint / name).read_bytes()


def test_runtime_commands_do_not_import_build_tools(cpu_int4_bundle, tmp_path):
    code = (
        "import sys\n"
        "from higgs_pack.runtime.cli import main\n"
        f"main(['synthesize', {str(cpu_int4_bundle)!r}, '--text', 'Hi.', '-o', {str(tmp_path / 'r.wav')!r},"
        " '--no-progress', '--max-frames', '10'], standalone_mode=False)\n"
        "heavy = sorted(m for m in ('torch', 'transformers', 'olive', 'onnxruntime_genai', 'optimum') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
        "import higgs_pack.runtime.sources.bundle, higgs_pack.runtime.verification.verify\n"
        "bad = sorted(m for m in sys.modules if m.startswith(('higgs_pack.targets', 'higgs_pack.exporters')))\n"
        "assert not bad, bad\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr


def test_installed_layout_has_no_bare_top_level_packages(tmp_path):
    """The wheel of higgs-pack itself holds only ``higgs_pack/…`` and its dist-info (DESIGN.md)."""
    import zipfile
    from importlib.metadata import version

    root = Path(__file__).resolve().parents[1]
    tracked = subprocess.run(["git", "ls-files"], cwd=root, capture_output=True, text=True, check=True)
    src = tmp_path / "src"  # a copy: setuptools writes build/ and *.egg-info beside the sources
    for rel in tracked.stdout.splitlines():
        if (root / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            (src / rel).write_bytes((root / rel).read_bytes())
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                    "-w", str(tmp_path / "dist"), str(src)], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"higgs_pack", f"higgs_pack-{version('higgs-pack')}.dist-info"}, tops
    for sub in ("runtime", "targets", "exporters", "manifests"):
        assert f"higgs_pack/{sub}/__init__.py" in names
    # every module and data file of the mapped folders is in the wheel: a sub-package cannot be left
    # out (serve/integrations/ was, when the package list was kept by hand)
    roots = {"higgs_pack": "higgs_pack", "targets": "higgs_pack/targets", "exporters": "higgs_pack/exporters",
             "runtime": "higgs_pack/runtime", "manifests": "higgs_pack/manifests", "serve": "higgs_pack/serve"}
    wanted = {roots[rel.split("/")[0]] + rel[len(rel.split("/")[0]):] for rel in tracked.stdout.splitlines()
              if rel.split("/")[0] in roots and rel.endswith((".py", ".json", ".html"))}
    assert "higgs_pack/serve/integrations/pipecat_tts.py" in wanted
    assert wanted <= set(names), sorted(wanted - set(names))


def test_output_that_would_overwrite_an_input_is_refused(cpu_int4_bundle, cases_dir, tmp_path):
    text = tmp_path / "t.wav"  # a text file with a .wav name: only the overwrite check can refuse it
    text.write_text("Hello.")
    out = run("synthesize", cpu_int4_bundle, "--text-file", text, "-o", text, check=False)
    assert out.returncode == 2 and f"{text} is also an input of this command" in out.stderr
    assert text.read_text() == "Hello."
    out = run("synthesize", cpu_int4_bundle, "--text", "Hi.", "-o", tmp_path / "t.txt", check=False)
    assert out.returncode == 2 and "give it a .wav name" in out.stderr
    out = run("synthesize", cpu_int4_bundle, "--text", "Hi.", "-o", tmp_path / ".wav", check=False)
    assert out.returncode == 2 and "give it a name before .wav (out.wav)" in out.stderr
    wav = tmp_path / "ref.wav"
    wav.write_bytes((cases_dir / "ref_en_16k.wav").read_bytes())
    out = run("synthesize", cpu_int4_bundle, "--text", "Hi.", "--ref-audio", wav, "--ref-text", "Hi.",
              "-o", wav, check=False)
    assert out.returncode == 2 and "is also an input of this command" in out.stderr
    out = run("synthesize", cpu_int4_bundle, "--text", "Hi.", "-o", cpu_int4_bundle / "x.wav", check=False)
    assert out.returncode == 2 and "inside the bundle" in out.stderr
    out = run("synthesize", cpu_int4_bundle, "--text", "Hi.", "-o", tmp_path / "nodir" / "x.wav", check=False)
    assert out.returncode == 2 and "does not exist; create it first" in out.stderr


def test_output_to_a_device_or_a_named_pipe_is_written_in_place(cpu_int4_bundle, tmp_path):
    """``-o /dev/null`` (throwing the audio away, timing a run) and ``-o`` a named pipe are taken
    whatever their names (it was refused: "give it a .wav name"); the pipe's reader gets the WAV."""
    import threading

    out = run("synthesize", cpu_int4_bundle, "--text", "Hi.", "--max-frames", "20", "--no-progress", "-o", os.devnull)
    assert "wrote" in out.stdout
    fifo = tmp_path / "audio"
    os.mkfifo(fifo)
    got = {}
    reader = threading.Thread(target=lambda: got.setdefault("bytes", fifo.read_bytes()))
    reader.start()
    run("synthesize", cpu_int4_bundle, "--text", "Hi.", "--max-frames", "20", "--no-progress", "-o", fifo)
    reader.join(60)
    data, rate = sf.read(io.BytesIO(got["bytes"]))
    assert rate == 24000 and data.size > 0 and fifo.is_fifo()


def test_whole_audio_to_stdout_is_scaled_as_a_file_is(cpu_int4_bundle, tmp_path):
    """``-o -`` without --stream has the whole audio before writing: audio beyond full scale is
    scaled down as in a file, never clipped (it was clipped; only a 16-bit --stream must clip)."""
    args = ("synthesize", cpu_int4_bundle, "--text", "Played as it is made.", "--no-progress")
    piped = subprocess.run([*HIGGS, *map(str, args), "-o", "-"], capture_output=True, timeout=600)
    assert piped.returncode == 0, piped.stderr
    filed = run(*args, "-o", tmp_path / "a.wav")
    assert "audio was scaled down" in filed.stderr  # this text's audio goes beyond full scale
    assert b"audio was scaled down" in piped.stderr and b"clipped" not in piped.stderr, piped.stderr
    streamed, _ = sf.read(io.BytesIO(piped.stdout), dtype="int16")
    written, _ = sf.read(tmp_path / "a.wav", dtype="int16")
    np.testing.assert_array_equal(streamed, written)


def test_unreadable_text_and_bad_numbers_are_usage_errors(cpu_int4_bundle, tmp_path):
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    out = run("synthesize", cpu_int4_bundle, "--text-file", latin, "-o", tmp_path / "a.wav", check=False)
    assert out.returncode == 2 and f"--text-file {latin} is not UTF-8 text (byte 4 is 0xE9" in out.stderr, out.stderr
    out = run("synthesize", cpu_int4_bundle, "--text-file", tmp_path / "nope.txt", "-o", tmp_path / "a.wav", check=False)
    assert out.returncode == 2 and "does not exist" in out.stderr
    for flag, value in (("--seed", "-1"), ("--max-frames", "0"), ("--temperature", "inf")):
        out = run("synthesize", cpu_int4_bundle, "--text", "Hi.", "-o", tmp_path / "a.wav", flag, value, check=False)
        assert out.returncode == 2, (flag, out.stderr)
    out = run("verify", cpu_int4_bundle, "--cases", tmp_path / "typo", check=False)
    assert out.returncode == 2 and "does not exist" in out.stderr


# ------------------------------------------------ the request is checked before anything is loaded


def invoke(*args, input=None):
    """The CLI in this process (click's CliRunner): ``(exit code, stderr)``."""
    from click.testing import CliRunner

    from higgs_pack.runtime.cli import main

    result = CliRunner().invoke(main, [str(a) for a in args], input=input)
    assert not isinstance(result.exception, Exception) or isinstance(result.exception, SystemExit), result.exception
    return result.exit_code, result.stderr


@pytest.mark.parametrize(("args", "input", "message"), [
    (["--text", "   "], None, "--text is only whitespace: there is nothing to speak"),  # issue 37: the flag, no Python keyword
    (["--text", "-"], "", "standard input is empty: there is nothing to speak; pipe the words in"),
    (["--text", "\x01\x02"], None, "text holds a control character"),
    (["--text", "\u200b\x00 "], None, "text holds a control character"),
    # Bytes that are not UTF-8 reach Python's argv as lone surrogates (surrogateescape): named as the
    # byte, as --text-file's and stdin's are
    (["--text", "\udced\udca0\udc80 bad \udcff"], None, "--text is not UTF-8 text (byte 1 is 0xED"),
    (["--text", "Hi.", "--ref-audio", "{ref}", "--ref-text", "\x07"], None,
     "--ref-text holds a control character"),
    (["--text", "Hi.", "--first-chunk-frames", "2"], None,
     "--first-chunk-frames shapes the chunks of --stream, and --stream is not given: add --stream, or drop it"),
    (["--text", "Hi.", "--chunk-growth", "3", "--max-chunk-frames", "5"], None,
     "--chunk-growth and --max-chunk-frames shape the chunks of --stream"),
    (["--text", "Hi.", "--top-p", "0"], None, r"--top-p must be in (0, 1], got 0.0"),
    (["--text", "Hi.", "--seed", "-1"], None, "seed must be >= 0"),
    (["--text", "Hi.", "--max-frames", "0"], None, "--max-frames must be >= 1 (frames, 25 per second), got 0"),
    (["--text", "Hi.", "--context-frames", "0"], None, "--context-frames must be >= 1 (frames of each context chunk, "
                                                       "25 per second), got 0"),
    (["--text", "Hi.", "--temperature", "inf"], None, "temperature must be a finite number >= 0 (0 = greedy), got inf"),
    (["--text", "Hi.", "--stream", "--first-chunk-frames", "50", "--max-chunk-frames", "5"], None,
     "--max-chunk-frames must be >= first_chunk_frames (50), got 5"),
    (["--text", "Hi.", "--stream", "--chunk-growth", "0.5"], None, "--chunk-growth must be a finite number >= 1"),
    (["--text", "Hi.", "--ref-text", "Hello."], None, "voice cloning needs both ref_audio= and ref_text="),
])
def test_a_bad_request_is_refused_before_the_bundle_is_looked_at(tmp_path, args, input, message):
    # The bundle does not exist: a message about the request proves it was checked first.
    ref = tmp_path / "ref.wav"
    sf.write(ref, np.zeros(24000, np.float32), 24000)
    args = [a.format(ref=ref) for a in args]
    code, err = invoke("synthesize", tmp_path / "no-bundle", "-o", tmp_path / "a.wav", *args, input=input)
    assert code == 2 and message in err and "no such bundle" not in err, err
    assert not (tmp_path / "a.wav").exists()


def test_every_bad_option_is_named_at_once(tmp_path):
    code, err = invoke("synthesize", tmp_path / "no-bundle", "-o", tmp_path / "a.wav", "--text", "Hi.",
                       "--top-k", "-3", "--top-p", "2", "--max-frames", "0")
    assert code == 2 and "3 problems with the request:" in err, err
    assert [line.split(" must ")[0] for line in err.splitlines() if line.startswith("  - ")] \
        == ["  - --top-k", "  - --top-p", "  - --max-frames"]


def test_stream_schedule_and_special_tokens_are_refused_before_a_byte_is_written(cpu_int4_bundle, tmp_path):
    wav = tmp_path / "s.wav"
    out = run("synthesize", cpu_int4_bundle, "-t", "Hi.", "--stream", "--first-chunk-frames", "50",
              "--max-chunk-frames", "5", "-o", wav, check=False)
    assert out.returncode == 2 and "--max-chunk-frames must be >= first_chunk_frames (50), got 5" in out.stderr
    assert "Traceback" not in out.stderr and not wav.exists()  # no 44-byte header left behind
    for text, token in (("Say <|endoftext|> now.", "<|endoftext|>"), ("<|im_start|>user", "<|im_start|>")):
        out = run("synthesize", cpu_int4_bundle, "-t", text, "--stream", "-o", wav, check=False)
        assert out.returncode == 2, out.stderr
        assert f"error: --text contains the tokenizer's special token(s) {token}" in out.stderr
        assert not wav.exists()


def test_closed_pipe_without_stream_is_reported_like_the_stream(cpu_int4_bundle):
    proc = subprocess.Popen([*HIGGS, "synthesize", str(cpu_int4_bundle), "-t", "A long answer nobody hears.",
                             "-o", "-", "--no-progress", "--max-frames", "200", "--seed", "1"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    assert len(proc.stdout.read(100)) == 100
    proc.stdout.close()  # the reader goes away, like `| head -c 100`
    rc = proc.wait(timeout=300)
    err = proc.stderr.read().decode()
    assert rc == 141, err
    assert "stopped, the reader closed the pipe: wrote" in err and "Traceback" not in err


# ------------------------------------------------ --batch: a folder of wavs, one per line


def _as_at_a_terminal() -> None:
    """``preexec_fn`` of a child that a test stops with SIGINT: restore SIGINT's default action.
    A shell that starts the test run in the background (``cmd &``, nohup) sets SIGINT to be
    ignored, children inherit that, and Python then installs no KeyboardInterrupt handler, so
    the signal would do nothing; Ctrl-C at a terminal meets the default action."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _manifest(folder: Path) -> dict:
    import json

    return json.loads((folder / "batch-manifest.json").read_text())


def _sha256(path: Path) -> str:
    import hashlib

    return hashlib.sha256(path.read_bytes()).hexdigest()


def _check_listed(folder: Path, manifest: dict) -> None:
    """Every listed file is there with the listed sha256 and length; nothing half-written is left."""
    for entry in manifest["files"]:
        path = folder / entry["file"]
        assert _sha256(path) == entry["sha256"], entry
        info = sf.info(path)
        assert info.frames == entry["frames"] * 960 and abs(info.duration - entry["seconds"]) < 1e-3, entry
    assert not list(folder.glob(".partial-*"))


def test_batch_writes_one_wav_per_line_and_a_manifest(cpu_int4_bundle, tmp_path):
    lines = tmp_path / "lines.txt"
    lines.write_text("Hello there.\n\n   \nSecond line here.\nThird one.\n")
    out = tmp_path / "out"
    done = run("synthesize", cpu_int4_bundle, "--text-file", lines, "--batch", "2", "-o", out, "--max-frames", "30",
               "--seed", "5")
    assert sorted(p.name for p in out.iterdir()) == ["1.wav", "4.wav", "5.wav", "batch-manifest.json"]
    assert "wrote 3 file(s) to" in done.stdout and "3 of 3 lines done" in done.stdout
    manifest = _manifest(out)
    assert (manifest["state"], manifest["line_count"], manifest["to_speak"], manifest["written"]) == \
        ("finished", 5, 3, 3)
    assert [(e["line"], e["text"], e["file"], e["seed"]) for e in manifest["files"]] == [
        (1, "Hello there.", "1.wav", 5), (4, "Second line here.", "4.wav", 8), (5, "Third one.", "5.wav", 9)]
    assert all(set(e["stop_reasons"]) <= {"eoc", "max_frames", "repeat_guard"} for e in manifest["files"])
    _check_listed(out, manifest)
    # Line 4 sounds as it does alone with its seed (--seed + line - 1): the same wav, byte for byte.
    single = tmp_path / "single.wav"
    run("synthesize", cpu_int4_bundle, "--text", "Second line here.", "--seed", "8", "--max-frames", "30",
        "-o", single, "--no-progress")
    assert single.read_bytes() == (out / "4.wav").read_bytes()
    # Twelve lines: names are padded to two digits.
    many = tmp_path / "many.txt"
    many.write_text("".join(f"Line {i}.\n" if i in (3, 12) else "\n" for i in range(1, 13)))
    run("synthesize", cpu_int4_bundle, "--text-file", many, "--batch", "3", "-o", tmp_path / "twelve",
        "--max-frames", "10")
    assert sorted(p.name for p in (tmp_path / "twelve").glob("*.wav")) == ["03.wav", "12.wav"]


def test_batch_never_overwrites_a_file_it_did_not_write(cpu_int4_bundle, tmp_path):
    lines = tmp_path / "lines.txt"
    lines.write_text("Hello there.\nSecond line.\n")
    out = tmp_path / "out"
    out.mkdir()
    (out / "1.wav").write_text("my precious")
    (out / "2.wav").mkdir()  # a folder where a wav would go
    refused = run("synthesize", cpu_int4_bundle, "--text-file", lines, "--batch", "2", "-o", out,
                  "--max-frames", "10", check=False)
    assert refused.returncode == 2 and "Traceback" not in refused.stderr
    assert "already holds 1.wav, 2.wav, which no earlier run of this batch wrote" in refused.stderr
    assert (out / "1.wav").read_text() == "my precious" and not (out / "batch-manifest.json").exists()


def test_batch_a_failing_line_is_reported_and_a_rerun_does_only_what_is_left(cpu_int4_bundle, tmp_path, monkeypatch):
    from higgs_pack.errors import NumericalError
    from higgs_pack.runtime.api import TTS

    lines = tmp_path / "lines.txt"
    lines.write_text("First line.\nSay it now.\nThird line.\n")
    out = tmp_path / "out"
    args = ("synthesize", cpu_int4_bundle, "--text-file", lines, "--batch", "3", "-o", out, "--max-frames", "30")
    spoken = TTS.synthesize_many

    def failing(self, requests, **options):
        # a line the engine fails while the others are spoken (a line's text problems are refused
        # before any line is spoken: tests/test_text_doors.py)
        for index, result in spoken(self, requests, **options):
            failed = requests[index].text == "Say it now."
            yield index, NumericalError("the decoder gave non-finite logits") if failed else result

    monkeypatch.setattr(TTS, "synthesize_many", failing)
    code, err = invoke(*args)
    monkeypatch.undo()
    assert code == 1, err
    assert "line 2 failed: the decoder gave non-finite logits" in err
    assert "1 line(s) failed" in err
    manifest = _manifest(out)
    assert [e["line"] for e in manifest["files"]] == [1, 3] and manifest["state"] == "finished"
    assert [(e["line"], e["text"]) for e in manifest["errors"]] == [(2, "Say it now.")]
    kept = {e["file"]: e["sha256"] for e in manifest["files"]}
    # Damage 3.wav: the rerun writes line 2 (failed) and 3 and skips line 1.
    (out / "3.wav").write_bytes(b"RIFF damaged")
    second = run(*args)
    assert "skipping 1 of 3 lines: already written" in second.stderr
    assert sorted(re.findall(r"wrote (\d\.wav):", second.stdout)) == ["2.wav", "3.wav"]
    assert "1 skipped: already written" in second.stdout
    manifest = _manifest(out)
    assert [e["line"] for e in manifest["files"]] == [1, 2, 3] and manifest["errors"] == []
    assert {e["file"]: e["sha256"] for e in manifest["files"] if e["line"] != 2} == kept  # same seed, same audio
    _check_listed(out, manifest)
    # Other settings than the folder's: refused, nothing touched.
    other = run(*args[:-1], "40", check=False)
    assert other.returncode == 2 and "was written with other settings (max_frames: 30 there, 40 now)" in other.stderr
    assert _manifest(out) == manifest


def test_batch_killed_or_interrupted_keeps_finished_files_and_resumes(cpu_int4_bundle, tmp_path):
    import json
    import signal
    import time

    lines = tmp_path / "lines.txt"
    lines.write_text("".join(f"Line {i} of a long story, with a few more words in it.\n" for i in range(1, 25)))
    out = tmp_path / "out"
    command = [*HIGGS, "synthesize", str(cpu_int4_bundle), "--text-file", str(lines), "--batch", "2", "-o", str(out),
               "--max-frames", "300"]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}

    def start_and_stop(sig: int, written_before: int) -> tuple[subprocess.CompletedProcess, dict]:
        proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                                preexec_fn=_as_at_a_terminal)
        deadline = time.monotonic() + 240
        while True:  # until the manifest lists a file this run wrote
            try:
                if json.loads((out / "batch-manifest.json").read_text())["written"] > written_before:
                    break
            except (FileNotFoundError, json.JSONDecodeError, KeyError):
                pass
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "no file within 240 s"
            time.sleep(0.01)
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=120)
        return subprocess.CompletedProcess(command, proc.returncode, stdout, stderr), _manifest(out)

    killed, manifest = start_and_stop(signal.SIGKILL, 0)  # a crash: no chance to say anything
    assert killed.returncode == -signal.SIGKILL
    assert manifest["state"] == "running" and 1 <= manifest["written"] < 24
    for entry in manifest["files"]:
        assert _sha256(out / entry["file"]) == entry["sha256"]
    first_files = {e["file"]: e["sha256"] for e in manifest["files"]}

    stopped, manifest = start_and_stop(signal.SIGINT, len(first_files))  # Ctrl-C
    assert stopped.returncode == 130, stopped.stderr
    assert f"skipping {len(first_files)} of 24 lines: already written" in stopped.stderr
    assert f"interrupted (Ctrl-C): {manifest['written']} of 24 lines written" in stopped.stderr
    assert manifest["state"] == "interrupted" and len(first_files) < manifest["written"] < 24
    _check_listed(out, manifest)

    before = manifest["written"]
    terminated, manifest = start_and_stop(signal.SIGTERM, before)  # timeout, systemd, Kubernetes
    if terminated.returncode != 0:  # (0: the run finished before the signal reached it)
        assert terminated.returncode == 143, terminated.stderr
        assert f"stopped (SIGTERM): {manifest['written']} of 24 lines written" in terminated.stderr
        assert manifest["state"] == "interrupted" and before < manifest["written"]
    _check_listed(out, manifest)

    finished = run(*command[len(HIGGS):])
    if manifest["written"] < 24:
        assert f"skipping {manifest['written']} of 24 lines: already written" in finished.stderr
    final = _manifest(out)
    assert final["state"] == "finished" and [e["line"] for e in final["files"]] == list(range(1, 25))
    assert {e["file"]: e["sha256"] for e in final["files"] if e["file"] in first_files} == first_files
    assert len(re.findall(r"^wrote \d+\.wav", finished.stdout, re.MULTILINE)) == 24 - manifest["written"]
    _check_listed(out, final)


@pytest.mark.parametrize(("args", "message"), [
    (["--text", "Hi.", "--batch", "2", "-o", "{tmp}/out"], "--batch N speaks one wav per line of a text file: give "
                                                          "--text-file FILE"),
    (["--text-file", "{tmp}/lines.txt", "--batch", "2", "--stream", "-o", "{tmp}/out"],
     "--stream writes one text while it is generated; --batch writes one finished wav per line"),
    (["--text-file", "{tmp}/lines.txt", "--batch", "2", "-o", "{tmp}/out.wav"],
     "with --batch, -o is a folder that gets one wav per line"),
    (["--text-file", "{tmp}/lines.txt", "--batch", "2", "-o", "{tmp}/lines.txt"], "is a file; with --batch, -o is a folder"),
    (["--text-file", "{tmp}/lines.txt", "--batch", "2", "-o", "{tmp}/no/out"], "does not exist; create it first"),
    (["--text-file", "{tmp}/lines.txt", "--batch", "2", "-o", "-"], "--batch writes a folder of wavs"),
    (["--text-file", "{tmp}/lines.txt", "--batch", "0", "-o", "{tmp}/out"], "0 is not in the range x>=1"),
    (["--text-file", "{tmp}/empty.txt", "--batch", "2", "-o", "{tmp}/out"], "empty.txt has no non-empty line"),
    (["--text-file", "{tmp}/lines.txt", "--batch", "2", "-o", "{tmp}/out", "--top-p", "2"], "--top-p must be in (0, 1]"),
])
def test_batch_usage_errors_before_the_bundle_is_looked_at(tmp_path, args, message):
    (tmp_path / "lines.txt").write_text("One.\nTwo.\n")
    (tmp_path / "empty.txt").write_text("\n  \n")
    code, err = invoke("synthesize", tmp_path / "no-bundle", *[a.format(tmp=tmp_path) for a in args])
    assert code == 2 and message in err and "no such bundle" not in err, err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
def test_a_streamed_wav_stopped_by_a_signal_is_a_complete_wav_of_what_was_written(cpu_int4_bundle, tmp_path, sig):
    import signal
    import struct
    import time

    wav = tmp_path / "out.wav"
    text = " ".join(f"This is sentence number {i} of a long text to speak." for i in range(1, 30))
    command = [*HIGGS, "synthesize", str(cpu_int4_bundle), "-t", text, "--stream", "-o", str(wav),
               "--max-frames", "2000", "--no-progress"]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONWARNINGS": "ignore"}, preexec_fn=_as_at_a_terminal)
    deadline = time.monotonic() + 240
    while not (wav.exists() and wav.stat().st_size > 44 + 2 * 24000):  # a second of audio is in the file
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no audio within 240 s"
        time.sleep(0.01)
    proc.send_signal(getattr(signal, sig))
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == {"SIGTERM": 143, "SIGINT": 130}[sig], stderr
    head = wav.read_bytes()[:44]
    size = wav.stat().st_size
    assert head[:4] == b"RIFF" and struct.unpack("<I", head[4:8])[0] == size - 8
    assert head[36:40] == b"data" and struct.unpack("<I", head[40:44])[0] == size - 44
    samples, rate = sf.read(wav, dtype="float32")
    assert rate == 24000 and len(samples) == (size - 44) // 2 >= 24000
    how = {"SIGTERM": "stopped (SIGTERM)", "SIGINT": "interrupted (Ctrl-C)"}[sig]
    assert f"{how}: wrote {len(samples) / 24000:.2f} s at 24000 Hz to {wav}" in stderr, stderr
    assert f"{wav} is a complete WAV of the audio written before the stop" in stderr
    assert "Traceback" not in stderr


# ------------------------------------------------ front doors: what a new user tried (issue 29)


def test_text_bytes_that_are_not_utf8_exit_2_naming_the_problem(tmp_path):
    # As a shell passes $'\xed\xa0\x80 bad \xff': raw bytes in argv, not a Python string.
    out = subprocess.run([*map(os.fsencode, HIGGS), b"synthesize", os.fsencode(tmp_path / "no-bundle"),
                          b"--text", b"\xed\xa0\x80 bad \xff", b"-o", os.fsencode(tmp_path / "o.wav")],
                         capture_output=True, text=True, errors="replace")
    assert out.returncode == 2, out.stderr
    assert "--text is not UTF-8 text (byte 1 is 0xED" in out.stderr
    assert "Traceback" not in out.stderr and not (tmp_path / "o.wav").exists()


def test_ctrl_c_before_generation_exits_130_without_aborted(tmp_path):
    import signal
    import time

    # The text is read from a pipe that stays open: the command waits there until SIGINT.
    proc = subprocess.Popen([*HIGGS, "synthesize", str(tmp_path / "no-bundle"), "-o", str(tmp_path / "o.wav")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_as_at_a_terminal)
    time.sleep(3)  # the interpreter is up and reading stdin
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert "interrupted (Ctrl-C)" in stderr and "Aborted!" not in stderr and "Traceback" not in stderr


def test_a_folder_that_is_not_a_bundle_is_named_as_such_first(tmp_path):
    (tmp_path / "x").mkdir()
    (tmp_path / "notes.txt").write_text("not a bundle")
    code, err = invoke("synthesize", tmp_path, "--text", "hi", "-o", tmp_path / "x" / "o.wav")
    assert code == 2 and f"{tmp_path} is not a bundle (manifest.json is missing; nor is it a folder of bundles" \
        in err, err
    assert "inside the bundle" not in err
    code, err = invoke("inspect", tmp_path)
    assert code == 2 and f"{tmp_path} is not a bundle (manifest.json is missing)" in err, err
    code, err = invoke("inspect", tmp_path / "notes.txt")  # it said "no such directory" of a file that is there
    assert code == 2 and "notes.txt: a file, not a bundle directory" in err, err


def test_a_batch_line_that_cannot_be_spoken_is_named(tmp_path):
    (tmp_path / "lines.txt").write_text("One.\n\x01\x02\nThree.\n\x00\n")
    code, err = invoke("synthesize", tmp_path / "no-bundle", "--text-file", tmp_path / "lines.txt", "--batch", "2",
                       "-o", tmp_path / "out")
    assert code == 2 and "2 problems with the request:" in err, err
    named = f"line 4 of {tmp_path / 'lines.txt'} holds a control character at character 1 (U+0000, NUL)"
    assert f"line 2 of {tmp_path / 'lines.txt'} holds a control character" in err and named in err, err
    assert not (tmp_path / "out").exists()


def test_verify_refuses_a_cases_folder_without_cases(tmp_path):
    (tmp_path / "cases").mkdir()
    (tmp_path / "cases" / "README.md").write_text("no cases here")
    code, err = invoke("verify", tmp_path / "no-bundle", "--cases", tmp_path / "cases")
    assert code == 2, err
    assert f"--cases {tmp_path / 'cases'} holds no verification cases (none of text_en_basic.txt" in err


def test_a_missing_bundle_says_what_is_installed_in_words(tmp_path):
    from higgs_pack.errors import BundleError
    from higgs_pack.runtime.sources.bundle import find_bundle

    with pytest.raises(BundleError) as caught:
        find_bundle("no-such-bundle-name")
    assert "none installed" not in str(caught.value)
    assert "no bundle wheels are installed" in str(caught.value) or "(installed: " in str(caught.value)


def test_a_gpu_device_on_an_onnx_runtime_bundle_names_the_gpu_providers(cpu_int4_bundle, tmp_path):
    out = run("synthesize", cpu_int4_bundle, "--text", "Hi.", "--device", "GPU", "-o", tmp_path / "g.wav",
              check=False)
    assert out.returncode == 2, out.stderr
    assert "'gpu' is an OpenVINO device name, not an ONNX Runtime execution provider" in out.stderr
    assert "cuda (an NVIDIA GPU) or dml (a DirectX 12 GPU (DirectML))" in out.stderr
    assert "did you mean 'cpu'" not in out.stderr and not (tmp_path / "g.wav").exists()
    out = run("synthesize", cpu_int4_bundle, "--text", "Hi.", "--device", "cdua", "-o", tmp_path / "g.wav",
              check=False)
    assert out.returncode == 2 and "did you mean 'cuda'" in out.stderr, out.stderr


def test_ctrl_c_at_start_up_of_the_console_script_is_one_line_and_130(tmp_path):
    """SIGINT a tenth of a second in (numpy, click and the runtime still importing, or the text
    being read): no traceback, whichever it hits."""
    import signal
    import time

    script = Path(sys.executable).with_name("higgs-pack")
    if not script.is_file():
        pytest.skip(f"no higgs-pack console script beside {sys.executable} (the package is not installed there)")
    proc = subprocess.Popen([str(script), "synthesize", str(tmp_path / "no-bundle"), "-o", str(tmp_path / "o.wav")],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_as_at_a_terminal)
    time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 130, stderr
    assert stderr.strip() == "interrupted (Ctrl-C)", stderr


def test_verify_and_devices_refuse_folders_that_are_not_what_they_should_be(tmp_path):
    code, err = invoke("verify", tmp_path)
    assert code == 2 and f"{tmp_path} is not a bundle (manifest.json is missing)" in err, err
    code, err = invoke("devices", "--bundles", tmp_path / "typo")
    assert code == 2 and "does not exist" in err, err


def test_a_complex_reference_array_is_refused():
    from higgs_pack.errors import InputError
    from higgs_pack.runtime.request import SynthesisRequest

    with pytest.raises(InputError, match=r"ref_audio samples must be real numbers .*, got complex128"):
        SynthesisRequest.create("Hi.", ref_audio=(np.zeros(24000, complex), 24000), ref_text="Hello.")


# ------------------------------------------------ subtitles


def test_synthesize_writes_subtitles_timed_by_frames(cpu_int4_bundle, tmp_path):
    """--subtitles: SubRip or WebVTT by suffix, one cue per sentence, back to back, the last ending
    where the audio ends; the same with --stream (each chunk's cues come with its audio)."""
    import srt
    import webvtt

    text = "The first sentence is here. A second one follows! And the third?"
    wav, subs = tmp_path / "a.wav", tmp_path / "a.srt"
    out = run("synthesize", cpu_int4_bundle, "--text", text, "-o", wav, "--subtitles", subs, "--max-frames", "20",
              "--no-progress")
    assert "wrote" in out.stderr and "3 cue(s)" in out.stderr, out.stderr
    cues = list(srt.parse(subs.read_text(encoding="utf-8")))
    assert [c.content for c in cues] == ["The first sentence is here.", "A second one follows!", "And the third?"]
    assert cues[0].start.total_seconds() == 0 and all(a.end == b.start for a, b in itertools.pairwise(cues))
    assert cues[-1].end.total_seconds() == pytest.approx(sf.info(wav).frames / 24000, abs=1e-3)
    vtt = tmp_path / "b.vtt"
    run("synthesize", cpu_int4_bundle, "--text", text, "-o", tmp_path / "b.wav", "--subtitles", vtt,
        "--max-frames", "20", "--stream", "--no-progress")
    captions = webvtt.read(str(vtt))
    assert [c.text for c in captions] == [c.content for c in cues]
    h, m, s = captions[-1].end.split(":")
    assert int(h) * 3600 + int(m) * 60 + float(s) == pytest.approx(cues[-1].end.total_seconds(), abs=2e-3)


def test_a_sentence_without_time_shares_the_next_cue_in_both_formats(tmp_path):
    """Four sentences in a chunk of 2 frames: two get no time.  Their words join the next cue (the
    last one's the cue before it), in SubRip as in WebVTT, and the count said is the count written
    (SubRip's composer dropped such cues, and the CLI said 4 where 2 were written)."""
    import srt
    import webvtt

    from higgs_pack.runtime.loop.synthesis import Segment
    from higgs_pack.runtime.subtitles import write_subtitles

    segments = [Segment("One.", 0.0, 0.0, 0, False), Segment("Two.", 0.0, 0.04, 0, False),
                Segment("Three.", 0.04, 0.04, 0, False), Segment("Four.", 0.04, 0.08, 0, False),
                Segment("Five.", 0.08, 0.08, 0, False)]
    srt_file, vtt_file = tmp_path / "s.srt", tmp_path / "s.vtt"
    assert write_subtitles(srt_file, segments) == write_subtitles(vtt_file, segments) == 2
    parsed = list(srt.parse(srt_file.read_text(encoding="utf-8")))
    assert [c.content for c in parsed] == ["One. Two.", "Three. Four. Five."]
    assert [(c.start.total_seconds(), c.end.total_seconds()) for c in parsed] == [(0.0, 0.04), (0.04, 0.08)]
    assert [c.text for c in webvtt.read(str(vtt_file))] == [c.content for c in parsed]
    # nothing with time at all: one cue with every word
    assert write_subtitles(srt_file, segments[:1] + segments[2:3]) == 1
    assert [c.content for c in srt.parse(srt_file.read_text(encoding="utf-8"))] == ["One. Three."]


@pytest.mark.parametrize(("name", "message"), [
    ("subs.txt", "a subtitles file is SubRip (.srt) or WebVTT (.vtt), chosen by its suffix; got .txt"),
    ("subs", "got no suffix: name it .srt or .vtt"),
    ("missing/subs.srt", "does not exist; create it first"),
    ("/proc/subs.srt", "cannot write /proc/subs.srt (--subtitles): No such file or directory"),  # not creatable
])
def test_a_bad_subtitles_file_is_refused_before_anything_is_generated(tmp_path, name, message):
    code, err = invoke("synthesize", tmp_path / "no-bundle", "-o", tmp_path / "a.wav", "--text", "Hi.",
                       "--subtitles", tmp_path / name)
    assert code == 2 and message in err and "no such bundle" not in err, err
    assert not (tmp_path / "a.wav").exists()
    script = tmp_path / "script.srt"
    script.write_text("Hi.", encoding="utf-8")
    code, err = invoke("synthesize", tmp_path / "no-bundle", "-o", tmp_path / "a.wav", "--text-file", script,
                       "--subtitles", script)
    assert code == 2 and "is also an input of this command" in err, err


def test_an_unwritable_output_is_refused_before_the_bundle_loads(tmp_path):
    """-o that cannot be created (/proc) is refused up front, for synthesize and dialogue, not
    after the whole generation (H-newuser 3)."""
    script = tmp_path / "s.txt"
    script.write_text("ANN: Hi.\n", encoding="utf-8")
    for command in (["synthesize", tmp_path / "no-bundle", "--text", "Hi."], ["dialogue", tmp_path / "no-bundle", script]):
        code, err = invoke(*command, "-o", "/proc/x.wav")
        assert code == 2 and "cannot write /proc/x.wav (-o): No such file or directory" in err, err
        assert "no such bundle" not in err, err


def test_a_full_disk_is_said_as_such_and_the_audio_is_kept(cpu_int4_bundle, tmp_path):
    """/dev/full (every write fails with ENOSPC): -o and --subtitles say "out of disk space", exit 2,
    no traceback; a subtitles failure after the audio says the audio is kept (H-newuser 2, 3)."""
    full = tmp_path / "full.wav"
    full.symlink_to("/dev/full")
    out = run("synthesize", cpu_int4_bundle, "--text", "Hi.", "-o", full, "--max-frames", "5", "--no-progress",
              check=False)
    assert out.returncode == 2 and "out of disk space (ENOSPC" in out.stderr, out.stderr
    assert "Traceback" not in out.stderr and "System error" not in out.stderr, out.stderr
    subs = tmp_path / "full.srt"
    subs.symlink_to("/dev/full")
    script = tmp_path / "s.txt"
    script.write_text("ANN: Hi.\nBEN: Hello.\n", encoding="utf-8")
    for command in (["synthesize", cpu_int4_bundle, "--text", "Hi."], ["dialogue", cpu_int4_bundle, script]):
        wav = tmp_path / f"{command[0]}.wav"
        out = run(*command, "-o", wav, "--subtitles", subs, "--max-frames", "5", "--no-progress", check=False)
        assert out.returncode == 2 and "cannot write" in out.stderr and "out of disk space" in out.stderr, out.stderr
        assert f"the audio in {wav} is written and kept" in out.stderr and "Traceback" not in out.stderr
        assert sf.info(wav).frames > 0


def test_the_stop_reasons_of_many_chunks_are_counted():
    """A 1000-chunk text's summary counts its stop reasons, not a list of 1000 (H-newuser 8)."""
    from types import SimpleNamespace

    from higgs_pack.runtime.speech_output import stop_summary

    few = [SimpleNamespace(stop_reason=r) for r in ("eos", "max_frames")]
    assert stop_summary(few) == "eos, max_frames"
    many = [SimpleNamespace(stop_reason="max_frames")] * 997 + [SimpleNamespace(stop_reason="eos")] * 3
    assert stop_summary(many) == "997 max_frames, 3 eos"


@pytest.mark.parametrize(("hidden", "argv", "said", "install"), [
    ("uvicorn", ["serve", "nowhere", "--port", "0"], "`higgs-pack serve` needs the [serve] extra", "[serve]"),
    ("torch", ["build", "--target", "cpu"], "building needs the build tools (torch missing)", "[build]"),
])
def test_a_command_without_its_extra_names_the_extra(hidden, argv, said, install):
    """``higgs-pack serve`` without uvicorn (a runtime installed with [cpu] only) and ``higgs-pack
    build`` without torch: exit 2, as every other missing part of the environment (build exited 1),
    with the install line and no traceback.  The module is hidden from the child process."""
    code = (f"import runpy, sys; sys.modules[{hidden!r}] = None; sys.argv = ['higgs-pack', *{argv!r}]; "
            "runpy.run_module('higgs_pack.runtime.cli', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert said in proc.stderr and f"pip install '.{install}'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_a_transcript_that_fills_the_context_is_named_as_such(cpu_int4_bundle, cases_dir, tmp_path):
    """--ref-text of 5,000 words: the voice is said to leave no room, naming --ref-text (it was
    reported as a sentence of the text to split with punctuation)."""
    out = run("synthesize", cpu_int4_bundle, "--text", "Hi.", "--ref-audio", cases_dir / "ref_en_16k.wav",
              "--ref-text", " ".join(["word"] * 5000), "-o", tmp_path / "a.wav", check=False)
    assert out.returncode == 2, out.stderr
    assert "the voice takes" in out.stderr and "--ref-text" in out.stderr and "split it" not in out.stderr
    assert not (tmp_path / "a.wav").exists()



def test_a_dialogue_stopped_by_ctrl_c_suggests_nothing_it_does_not_have(cpu_int4_bundle, tmp_path):
    """Issue 37 item 6: the Ctrl-C message of ``dialogue`` suggested --stream, which it does not have."""
    import signal
    import time

    wav = tmp_path / "talk.wav"
    script = tmp_path / "talk.txt"
    script.write_text("".join(f"{'ANN' if i % 2 else 'BEN'}: This is turn number {i} of a long talk.\n"
                              for i in range(30)))
    proc = subprocess.Popen([*HIGGS, "dialogue", str(cpu_int4_bundle), str(script), "-o", str(wav), "--max-frames",
                             "400", "--no-progress"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env={**os.environ, "PYTHONWARNINGS": "ignore"}, preexec_fn=_as_at_a_terminal)
    deadline = time.monotonic() + 240
    while not any(p.stat().st_size > 44 + 2 * 24000 for p in tmp_path.glob(".*")):  # a second in the hidden file
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no audio within 240 s"
        time.sleep(0.01)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr
    assert f"interrupted (Ctrl-C): nothing written to {wav}; the audio generated so far was not kept\n" in stderr
    assert "--stream" not in stderr and "Traceback" not in stderr and not wav.exists()


def test_a_batch_manifest_records_the_openvino_engine_and_a_resume_on_the_other_is_refused(tmp_path):
    """OpenVINO's paged engine, its batch-1 decoder and the spliced stateful engine of earlier
    versions are not bit-identical: a folder written on one is not resumed on another (the
    manifest's settings hold the engine that batched, naming openvino_engine)."""
    from higgs_pack.errors import InputError
    from higgs_pack.runtime.batch import batch_settings, finished_lines
    from higgs_pack.runtime.engine.decoders import openvino_engine_of
    from higgs_pack.runtime.request import SynthesisRequest

    assert openvino_engine_of("openvino", 4) == "paged"
    assert openvino_engine_of("openvino", 1) is None  # one row: the bundle's own decoder
    assert openvino_engine_of("onnxruntime", 4) is None
    request = SynthesisRequest.create("Hi.", seed=0)
    stateful = batch_settings("tiny-ov", request, 0, "PCM_16", None, openvino_engine="stateful")
    paged = batch_settings("tiny-ov", request, 0, "PCM_16", None, openvino_engine="paged")
    assert stateful["openvino_engine"] == "stateful"
    assert finished_lines({"settings": stateful, "files": []}, dict(stateful), [], tmp_path) == {}
    with pytest.raises(InputError, match=r"other settings \(openvino_engine: 'stateful' there, 'paged' now\)"):
        finished_lines({"settings": stateful, "files": []}, paged, [], tmp_path)
    onnx = batch_settings("tiny-cpu", request, 0, "PCM_16", None)
    assert onnx["openvino_engine"] is None

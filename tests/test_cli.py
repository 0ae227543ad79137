"""The higgs-pack command line, run as a user runs it (subprocess of the console script)."""

import os
import re
import subprocess
import sys
from pathlib import Path

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
    assert out.returncode == 2 and "text is empty or only whitespace" in out.stderr
    (tmp_path / "x.wav").write_text("not audio")
    out = run("synthesize", cpu_int4_bundle, "--text", "Hi.", "-o", tmp_path / "f.wav",
              "--ref-audio", tmp_path / "x.wav", "--ref-text", "Hi.", check=False)
    assert out.returncode == 2 and "not a readable audio file" in out.stderr
    out = run("synthesize", tmp_path / "nope", "--text", "Hi.", "-o", tmp_path / "g.wav", check=False)
    assert out.returncode == 2 and "no such bundle directory" in out.stderr
    out = run("synthesize", cpu_int4_bundle, "--text", "Hi.", "-o", tmp_path / "h.wav", "--top-p", "0", check=False)
    assert out.returncode == 2 and "top_p must be in (0, 1]" in out.stderr


def test_inspect_and_verify(cpu_int4_bundle, cases_dir, tmp_path):
    out = run("inspect", cpu_int4_bundle)
    assert "higgs-audio-v3-tiny-cpu-int4" in out.stdout and "llm_decoder" in out.stdout
    assert "OnnxBlockWiseRtnQuantization" in out.stdout
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
        "import higgs_pack.runtime.bundle, higgs_pack.runtime.verification.verify\n"
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


def test_output_that_would_overwrite_an_input_is_refused(cpu_int4_bundle, cases_dir, tmp_path):
    text = tmp_path / "t.wav"  # a text file with a .wav name: only the overwrite check can refuse it
    text.write_text("Hello.")
    out = run("synthesize", cpu_int4_bundle, "--text-file", text, "-o", text, check=False)
    assert out.returncode == 2 and f"{text} is also an input of this command" in out.stderr
    assert text.read_text() == "Hello."
    out = run("synthesize", cpu_int4_bundle, "--text", "Hi.", "-o", tmp_path / "t.txt", check=False)
    assert out.returncode == 2 and "give it a .wav name" in out.stderr
    wav = tmp_path / "ref.wav"
    wav.write_bytes((cases_dir / "ref_en_16k.wav").read_bytes())
    out = run("synthesize", cpu_int4_bundle, "--text", "Hi.", "--ref-audio", wav, "--ref-text", "Hi.",
              "-o", wav, check=False)
    assert out.returncode == 2 and "is also an input of this command" in out.stderr
    out = run("synthesize", cpu_int4_bundle, "--text", "Hi.", "-o", cpu_int4_bundle / "x.wav", check=False)
    assert out.returncode == 2 and "inside the bundle" in out.stderr
    out = run("synthesize", cpu_int4_bundle, "--text", "Hi.", "-o", tmp_path / "nodir" / "x.wav", check=False)
    assert out.returncode == 2 and "does not exist; create it first" in out.stderr


def test_unreadable_text_and_bad_numbers_are_usage_errors(cpu_int4_bundle, tmp_path):
    latin = tmp_path / "latin.txt"
    latin.write_bytes("caf\xe9".encode("latin-1"))
    out = run("synthesize", cpu_int4_bundle, "--text-file", latin, "-o", tmp_path / "a.wav", check=False)
    assert out.returncode == 2 and "not UTF-8" in out.stderr
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
    (["--text", "   "], None, "text is empty or only whitespace; give the words to speak with --text / text="),
    (["--text", "-"], "", "text is empty or only whitespace"),
    (["--text", "Hi.", "--top-p", "0"], None, r"top_p must be in (0, 1], got 0.0; set it with --top-p / top_p="),
    (["--text", "Hi.", "--seed", "-1"], None, "seed must be >= 0"),
    (["--text", "Hi.", "--max-frames", "0"], None, "max_frames must be >= 1 (frames, 25 per second), got 0"),
    (["--text", "Hi.", "--temperature", "inf"], None, "temperature must be a finite number >= 0 (0 = greedy), got inf"),
    (["--text", "Hi.", "--stream", "--first-chunk-frames", "50", "--max-chunk-frames", "5"], None,
     "max_chunk_frames must be >= first_chunk_frames (50), got 5"),
    (["--text", "Hi.", "--chunk-growth", "0.5"], None, "chunk_growth must be a finite number >= 1"),
    (["--text", "Hi.", "--ref-text", "Hello."], None, "voice cloning needs both ref_audio= and ref_text="),
])
def test_a_bad_request_is_refused_before_the_bundle_is_looked_at(tmp_path, args, input, message):
    # The bundle does not exist: a message about the request proves it was checked first.
    code, err = invoke("synthesize", tmp_path / "no-bundle", "-o", tmp_path / "a.wav", *args, input=input)
    assert code == 2 and message in err and "no such bundle" not in err, err
    assert not (tmp_path / "a.wav").exists()


def test_every_bad_option_is_named_at_once(tmp_path):
    code, err = invoke("synthesize", tmp_path / "no-bundle", "-o", tmp_path / "a.wav", "--text", "Hi.",
                       "--top-k", "-3", "--top-p", "2", "--max-frames", "0")
    assert code == 2 and "3 problems with the request:" in err, err
    assert [line.split(" must ")[0] for line in err.splitlines() if line.startswith("  - ")] \
        == ["  - top_k", "  - top_p", "  - max_frames"]


def test_stream_schedule_and_special_tokens_are_refused_before_a_byte_is_written(cpu_int4_bundle, tmp_path):
    wav = tmp_path / "s.wav"
    out = run("synthesize", cpu_int4_bundle, "-t", "Hi.", "--stream", "--first-chunk-frames", "50",
              "--max-chunk-frames", "5", "-o", wav, check=False)
    assert out.returncode == 2 and "max_chunk_frames must be >= first_chunk_frames (50), got 5" in out.stderr
    assert "Traceback" not in out.stderr and not wav.exists()  # no 44-byte header left behind
    for text, token in (("Say <|endoftext|> now.", "<|endoftext|>"), ("<|im_start|>user", "<|im_start|>")):
        out = run("synthesize", cpu_int4_bundle, "-t", text, "--stream", "-o", wav, check=False)
        assert out.returncode == 2, out.stderr
        assert f"the text contains the tokenizer's special token(s) {token}" in out.stderr
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

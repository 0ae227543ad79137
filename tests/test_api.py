"""The one-import Python API (``import higgs_pack; higgs_pack.load(...)``) and the Python examples of the
README and of the documentation's pages on using a bundle."""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from conftest import REPO_ROOT, write_voice_clip


def python_blocks(markdown: str) -> list[str]:
    """The ```python fenced blocks of a Markdown text, in order."""
    return [m.group(1) for m in re.finditer(r"^```python\n(.*?)^```", markdown, re.S | re.M)]


def doc_text(page: str) -> str:
    """A Markdown page of the repository (README.md, docs/...), as text."""
    return (REPO_ROOT / page).read_text(encoding="utf-8")


#: The pages whose Python examples run in order, as one reader's session (the server's examples
#: are in docs/serving/index.md; tests/test_serve.py and tests/test_serve_formats.py run them).
USING_PAGES = ("README.md", "docs/using/python.md", "docs/using/engine.md")


def test_readme_and_docs_python_examples_run(cpu_int4_bundle, tmp_path):
    blocks = [block for page in USING_PAGES for block in python_blocks(doc_text(page))]
    assert len(blocks) >= 2 and "import higgs_pack" in blocks[0]
    (tmp_path / "dist").mkdir()
    (tmp_path / "dist" / "higgs-audio-v3-tiny-cpu-int4").symlink_to(cpu_int4_bundle, target_is_directory=True)
    write_voice_clip(tmp_path / "voice.wav")
    # the reader's own long text, which the long-text example reads
    (tmp_path / "chapter.txt").write_text("It was a quiet night. The rain had stopped. Nobody spoke.", encoding="utf-8")
    # The blocks run in order in one namespace, as a reader would paste them, in a fresh
    # interpreter whose cwd is the folder they name.
    script = "\n".join(blocks) + textwrap.dedent("""
        import numpy as np
        assert result.samples.dtype == np.float32 and result.samples.ndim == 1 and result.samples.size
        assert result.sample_rate == 24000 and result.codes.shape[1] == 8
        assert clone.samples.dtype == np.float32 and clone.codes.shape[0] <= 100
        assert chunks and all(c.dtype == np.float32 for c in chunks)
        assert [v.codes.shape[1] for v in voiced] == [8, 8, 8] and streamed
        print("INFO", tts.info)
    """)
    out = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "INFO higgs-audio-v3-tiny-cpu-int4: target cpu precision int4" in out.stdout
    assert "CPUExecutionProvider" in out.stdout
    assert (tmp_path / "out.wav").stat().st_size > 44 and (tmp_path / "book.wav").stat().st_size > 44


def test_import_higgs_pack_is_cheap_and_lazy():
    code = ("import sys, higgs_pack\n"
            "assert 'higgs_pack.runtime.api' not in sys.modules\n"
            "assert callable(higgs_pack.load) and 'torch' not in sys.modules\n"
            "assert issubclass(higgs_pack.BundleError, higgs_pack.HiggsPackError)\n"
            "assert higgs_pack.__version__\n"
            "try:\n    higgs_pack.nope\nexcept AttributeError as e:\n    print(e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd="/")
    assert out.returncode == 0, out.stderr
    assert "has no attribute 'nope'" in out.stdout


def test_load_directory_synthesize_and_info(cpu_fp32_bundle):
    import higgs_pack

    tts = higgs_pack.load(cpu_fp32_bundle)
    info = tts.info
    assert (info.target, info.precision, info.backend, info.model) == ("cpu", "fp32", "onnxruntime",
                                                                       "higgs-audio-v3-tiny")
    assert info.device == "CPUExecutionProvider" and set(info.devices) >= {"llm_decoder", "audio_tokenizer"}
    assert "bundle directory" in info.reason and "own execution provider cpu" in info.reason
    a = tts.synthesize("Hello there.", seed=3, temperature=0.9, max_frames=12)
    b = tts.synthesize("Hello there.", seed=3, temperature=0.9, max_frames=12)
    assert a.samples.dtype == np.float32 and a.sample_rate == tts.sample_rate == 24000
    assert a.codes.shape[1] == 8 and a.codes.shape[0] <= 12
    assert np.array_equal(a.codes, b.codes)
    greedy = tts.synthesize("Hello there.", temperature=0, max_frames=12)
    assert greedy.codes.shape[1] == 8
    assert info.to_dict()["path"] == str(cpu_fp32_bundle.resolve())


def test_load_errors_say_what_to_do(cpu_fp32_bundle, tmp_path):
    import higgs_pack

    with pytest.raises(higgs_pack.BundleError, match="no such bundle directory"):
        higgs_pack.load(tmp_path / "nothing-here")
    with pytest.raises(higgs_pack.ExecutionProviderUnavailable, match=r"did you mean 'cuda'\?"):
        higgs_pack.load(cpu_fp32_bundle, device="cudaa")
    tts = higgs_pack.load(cpu_fp32_bundle, device="cpu")
    assert "asked for with device='cpu'" in tts.info.reason
    with pytest.raises(higgs_pack.InputError, match="top_p must be in"):
        tts.synthesize("Hi.", top_p=0)
    with pytest.raises(higgs_pack.InputError, match="both ref_audio= and ref_text="):
        tts.synthesize("Hi.", ref_text="Hello.")
    with pytest.raises(higgs_pack.InputError, match="max_frames must be >= 1"):
        tts.synthesize("Hi.", max_frames=0)
    # Wrong types are named, never a raw TypeError from deep inside the loop.
    for kwargs, words in (({"seed": -1}, "seed must be >= 0"), ({"seed": 1.5}, "seed must be a whole number"),
                          ({"top_k": 2.5}, "top_k must be a whole number"),
                          ({"temperature": "hot"}, "temperature must be a number"),
                          ({"max_frames": 1.5}, "max_frames must be a whole number")):
        with pytest.raises(higgs_pack.InputError, match=words):
            tts.synthesize("Hi.", **kwargs)
    assert tts.synthesize("Hi.", seed=np.int64(3), max_frames=np.int64(4)).codes.shape[0] <= 4


def test_load_archive_and_reference_tuple(cpu_fp32_bundle, tmp_path):
    import tarfile

    import higgs_pack

    # An archive as `higgs-pack package` lays it out: one folder + SHA256SUMS.
    from higgs_pack.manifests.manifest import sha256_file
    from higgs_pack.runtime.audio import load_audio
    from higgs_pack.runtime.sources.archive import CHECKSUMS_NAME

    root = cpu_fp32_bundle
    lines = [f"{sha256_file(p)}  {p.relative_to(root).as_posix()}" for p in sorted(root.rglob("*")) if p.is_file()]
    sums = tmp_path / CHECKSUMS_NAME
    sums.write_text("\n".join(lines) + "\n")
    archive = tmp_path / f"{root.name}.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(root, arcname=root.name)
        tar.add(sums, arcname=f"{root.name}/{CHECKSUMS_NAME}")
    with higgs_pack.load(archive) as tts:
        folder = tts.info.path
        assert folder.is_dir() and "archive" in tts.info.reason
        samples, rate = load_audio(write_voice_clip(tmp_path / "voice.wav"))
        out = tts.synthesize("Hi.", ref_audio=(samples, rate), ref_text="Hello there.", max_frames=8)
        assert out.samples.dtype == np.float32
    assert not Path(folder).exists()


def test_load_folder_of_bundles_chooses(cpu_fp32_bundle, cpu_int4_bundle, tmp_path):
    import higgs_pack

    folder = tmp_path / "dist"
    folder.mkdir()
    for b in (cpu_fp32_bundle, cpu_int4_bundle):
        (folder / b.name).symlink_to(b, target_is_directory=True)
    tts = higgs_pack.load(folder)
    assert tts.info.bundle == cpu_int4_bundle.name and tts.info.reason.startswith(f"folder of bundles {folder}")
    assert list(tts.info.not_chosen) == [cpu_fp32_bundle.name]


def test_a_request_carries_its_options_and_python_keywords_make_the_same_one(cpu_fp32_bundle, tmp_path):
    import higgs_pack

    tts = higgs_pack.load(cpu_fp32_bundle)
    request = higgs_pack.SynthesisRequest.create("Hello there.", seed=4, max_frames=30, first_chunk_frames=3)
    by_request = tts.synthesize(request)
    assert np.array_equal(by_request.codes, tts.synthesize("Hello there.", seed=4, max_frames=30).codes)
    pieces = list(tts.stream(request))
    # Its schedule, with either codec: first_chunk_frames (3), then each twice the one before (issue 37:
    # the stateful codec's first piece was one frame whatever the schedule said).
    sizes = [len(p.samples) // tts.pipeline.constants.hop_length for p in pieces]
    assert len(pieces) > 2 and sizes[:2] == [3, 6], sizes
    with pytest.raises(higgs_pack.InputError, match=r"unknown synthesis option 'temprature' \(did you mean "
                                                    r"'temperature'\?\)"):
        tts.synthesize("Hi.", temprature=0.5)
    with pytest.raises(higgs_pack.InputError, match="carries its own options; got seed beside it"):
        tts.synthesize(request, seed=1)
    with pytest.raises(higgs_pack.InputError, match="max_chunk_frames must be >= first_chunk_frames"):
        tts.stream("Hi.", first_chunk_frames=50, max_chunk_frames=5)
    with pytest.raises(higgs_pack.InputError, match=r"special token\(s\) <\|endoftext\|>"):
        tts.synthesize("Hi <|endoftext|>.")
    with pytest.raises(higgs_pack.InputError, match="first_chunk_frames shapes the chunks of a stream") as found:
        tts.synthesize("Hi.", first_chunk_frames=10)  # it was taken and did nothing (a new user's finding)
    assert "set it with" not in str(found.value) and found.value.problems[0].field == "first_chunk_frames"
    with pytest.raises(higgs_pack.InputError, match=r"variant 'foo' \(--variant\) picks the folder of a hub"):
        higgs_pack.load(cpu_fp32_bundle, variant="foo")  # it was taken and did nothing for a bundle folder
    with pytest.raises(higgs_pack.InputError) as both:  # both fields at once, each named (a new user's finding)
        tts.synthesize("Hi <|endoftext|>.", ref_audio=write_voice_clip(tmp_path / "voice.wav"), ref_text="<|audio|> words")
    assert [p.field for p in both.value.problems] == ["text", "ref_text"], both.value.problems
    assert "ref_text contains the prompt control token(s) <|audio|>" in str(both.value)
    assert "set it with ref_text=" in str(both.value) and "--ref-text" not in str(both.value)  # Python's terms


def test_requests_are_checked_without_a_bundle(tmp_path):
    from higgs_pack.errors import InputError
    from higgs_pack.runtime.request import StreamSchedule, SynthesisRequest, Voice

    request = SynthesisRequest.create("Hi.", top_k=5)
    assert request.schedule == StreamSchedule() and request.voice is None
    with pytest.raises(InputError, match=r"unknown synthesis option 'temprature' \(did you mean 'temperature'\?\)"):
        SynthesisRequest.create("Hi.", temprature=0.5)
    # The bundle's generation defaults fill what the request leaves unset; its choices win.
    options = request.sampling_options({"sampling": {"temperature": 0.6, "top_k": 40, "repeat_guard_frames": 9}})
    assert (options.temperature, options.top_k, options.top_p, options.seed, options.repeat_guard_frames) \
        == (0.6, 5, 1.0, 0, 9)
    with pytest.raises(InputError, match=r"top_p must be in \(0, 1\], got 2; set it with top_p=$"):
        SynthesisRequest("Hi.", top_p=2)  # made field by field: checked the same
    with pytest.raises(InputError, match=r"text must be text \(a string\), got bytes"):
        SynthesisRequest.create(b"Hi.")
    with pytest.raises(InputError, match=f"reference audio {tmp_path / 'none.wav'} does not exist"):
        SynthesisRequest.create("Hi.", ref_audio=tmp_path / "none.wav", ref_text="Hello.")
    with pytest.raises(InputError, match="ref_text is only whitespace: a transcript holds the words the clip says"):
        Voice((np.zeros(24000, np.float32), 24000), "  ")
    with pytest.raises(InputError, match=r"ref_text must be text \(a string\), got a number \(5\)"):
        Voice((np.zeros(24000, np.float32), 24000), 5)
    with pytest.raises(InputError, match=r"ref_audio samples must be \[samples\] or \[samples, channels\], "
                                         r"got shape \(1, 2, 3\)"):
        Voice((np.zeros((1, 2, 3), np.float32), 24000), "Hello.")
    with pytest.raises(InputError, match="ref_audio's sample rate must be a whole number of Hz > 0, got 0"):
        Voice((np.zeros(24000, np.float32), 0), "Hello.")
    with pytest.raises(InputError, match="ref_audio must be a file path or a \\(samples, sample_rate\\) tuple, "
                                         "got a list"):
        Voice([0.0], "Hello.")


def test_stream_equals_synthesize(cpu_fp32_bundle):
    import higgs_pack

    tts = higgs_pack.load(cpu_fp32_bundle)
    whole = tts.synthesize("Hello there.", seed=5, max_frames=30)
    stream = tts.stream("Hello there.", seed=5, max_frames=30, first_chunk_frames=4)
    pieces = list(stream)
    assert len(pieces) > 1 and pieces[0].sample_rate == tts.sample_rate
    joined = np.concatenate([c.samples for c in pieces])
    assert np.array_equal(stream.codes, whole.codes)
    assert joined.shape == whole.samples.shape and np.allclose(joined, whole.samples, atol=1e-4)
    with pytest.raises(higgs_pack.InputError, match="both ref_audio= and ref_text="):
        tts.stream("Hi.", ref_text="Hello.")


@pytest.mark.parametrize(("source", "words"), [(None, "got nothing (null/None)"), (5, "got a number (5)"), ("", "an empty string")])
def test_load_names_a_source_that_is_not_a_path_or_a_name(source, words):
    """load(None), load(5) and load("") raised TypeError from os.fspath, or said '. is not a
    bundle' (a new user's findings)."""
    import higgs_pack

    with pytest.raises(higgs_pack.InputError, match="load\\(\\) takes a bundle folder") as found:
        higgs_pack.load(source)
    assert words in str(found.value)


"""Shared fixtures: the tiny Higgs-Audio-v3 checkpoint (real layout, real tokenizer) and cases."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

#: Repository root (the folder holding pyproject.toml).
REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # the benchmark (bench/) is a folder of the checkout, not of the wheel
    # last: an installed (non-editable) higgs_pack must not be shadowed by the checkout's higgs_pack/ folder
    sys.path.append(str(REPO_ROOT))

#: Seconds of setup above which a fixture must be a :func:`slow_fixture` (builds of the tiny
#: bundles take 10-60 s on 2 cores; the tiny checkpoint and everything else a few at most).
SLOW_SETUP_S = 20.0


def slow_fixture(*args, **kwargs):
    """``@pytest.fixture`` for a fixture that builds a bundle or runs a whole export.

    Every test that needs one, directly or through other fixtures, is marked ``slow``
    (:func:`pytest_collection_modifyitems`), so the fast tier (``-m "not slow"``) never
    builds a bundle.  A fixture that takes longer than :data:`SLOW_SETUP_S` to set up
    without this decorator is reported at the end of the run and fails it
    (:func:`pytest_terminal_summary`), so a new one cannot be forgotten.  Tests that call
    ``build()`` or an exporter themselves carry ``@pytest.mark.slow`` in their file.
    """
    def mark(function):
        function.slow_fixture = True
        return pytest.fixture(function, *args, **kwargs)

    return mark


def _is_slow(fixturedef) -> bool:
    return getattr(fixturedef.func, "slow_fixture", False)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark every test whose fixture closure holds a :func:`slow_fixture` ``slow``."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        defs = info.name2fixturedefs.values() if info is not None else ()
        if any(_is_slow(d) for chain in defs for d in chain):
            item.add_marker(pytest.mark.slow)


_UNMARKED_SLOW: dict[str, float] = {}


@pytest.hookimpl(wrapper=True)
def pytest_fixture_setup(fixturedef, request):
    """Time each fixture's setup; remember those over :data:`SLOW_SETUP_S` not made with :func:`slow_fixture`."""
    import time

    start = time.perf_counter()
    try:
        return (yield)
    finally:
        seconds = time.perf_counter() - start
        if seconds > SLOW_SETUP_S and not _is_slow(fixturedef):
            _UNMARKED_SLOW[fixturedef.argname] = seconds


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    """Name the fixtures that were slow to set up but are not :func:`slow_fixture`."""
    if not _UNMARKED_SLOW:
        return
    terminalreporter.section("fixtures that should be slow_fixture")
    for name, seconds in sorted(_UNMARKED_SLOW.items()):
        terminalreporter.line(f"{name}: {seconds:.0f} s to set up (over {SLOW_SETUP_S:.0f} s); define it with "
                              "@slow_fixture(...) from conftest.py so the fast tier skips its tests")


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A run in which a fixture should have been a :func:`slow_fixture` fails (see its summary)."""
    if _UNMARKED_SLOW and exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``tiny`` preset, seed 0, written once per session (2 shards + index)."""
    from higgs_pack.exporters.checkpoint.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "higgs-audio-v3-tiny", "tiny", 0)


@pytest.fixture(scope="session")
def tiny_ckpt(tiny_checkpoint: Path):
    """:class:`HiggsCheckpoint` of :func:`tiny_checkpoint`, opened once per session."""
    from higgs_pack.exporters.checkpoint.reader import open_checkpoint

    return open_checkpoint(tiny_checkpoint)


@pytest.fixture(scope="session")
def cases_dir() -> Path:
    """``shared/cases`` beside the repository (real prompts and a reference clip)."""
    path = REPO_ROOT.parent / "shared" / "cases"
    if not path.is_dir():
        pytest.skip(f"test cases folder {path} is missing")
    return path


def _build(tmp_path_factory, checkpoint: Path, target: str, precision: str) -> Path:
    from higgs_pack.targets.build import build

    out = tmp_path_factory.mktemp(f"bundle-{target}-{precision}") / f"higgs-audio-v3-tiny-{target}-{precision}"
    return build(target, precision=precision, model=checkpoint, out=out)


@slow_fixture(scope="session")
def cpu_fp32_bundle(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path) -> Path:
    """A real cpu fp32 bundle of the tiny checkpoint, built once per session (~40 s)."""
    return _build(tmp_path_factory, tiny_checkpoint, "cpu", "fp32")


@slow_fixture(scope="session")
def cpu_int4_bundle(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Path:
    """A real cpu int4 bundle (the default precision), built once per session (~30 s); or the
    one ``$HIGGS_PACK_TEST_CPU_INT4_BUNDLE`` names, built from the same tiny checkpoint (``nox -s
    integrations`` builds it with the build venv for its venv, which cannot build)."""
    prebuilt = os.environ.get("HIGGS_PACK_TEST_CPU_INT4_BUNDLE")
    if prebuilt:
        if not (Path(prebuilt) / "manifest.json").is_file():
            raise FileNotFoundError(f"HIGGS_PACK_TEST_CPU_INT4_BUNDLE={prebuilt} is not a bundle (no manifest.json); "
                                    "build it with `higgs-pack build --target cpu --precision int4 --out PATH`")
        return Path(prebuilt)
    return _build(tmp_path_factory, request.getfixturevalue("tiny_checkpoint"), "cpu", "int4")


@slow_fixture(scope="session")
def ov_int4_bundle(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path) -> Path:
    """The openvino int4 bundle of the tiny checkpoint (its own model cache), built once per session."""
    pytest.importorskip("openvino")
    pytest.importorskip("optimum.intel")
    pytest.importorskip("nncf")
    from higgs_pack.targets.build import build

    root = tmp_path_factory.mktemp("ov-int4")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HIGGS_PACK_CACHE", str(root / "cache"))
        return build("openvino", model=tiny_checkpoint, out=root / "higgs-audio-v3-tiny-openvino-int4")


@pytest.fixture
def bundle_copy(tmp_path: Path, cpu_fp32_bundle: Path) -> Path:
    """A private copy of the cpu fp32 bundle that a test may damage."""
    import shutil

    return Path(shutil.copytree(cpu_fp32_bundle, tmp_path / cpu_fp32_bundle.name))


def write_voice_clip(path: Path, seconds: float = 1.5, rate: int = 16000) -> Path:
    """A voice-like test clip (a gliding harmonic tone with a little noise), 16-bit wav."""
    import numpy as np
    import soundfile as sf

    t = np.arange(int(seconds * rate)) / rate
    f0 = 120 + 40 * np.sin(2 * np.pi * 1.5 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    wave = sum(np.sin(k * phase) / k for k in range(1, 6)) * 0.2
    wave += 0.01 * np.random.default_rng(0).standard_normal(t.size)
    sf.write(path, wave.astype(np.float32), rate, subtype="PCM_16")
    return path


@pytest.fixture(scope="session")
def check_stream():
    """``check(pipeline, text, *, seed, max_frames, **schedule)`` (schedule: the fields of
    :class:`~higgs_pack.runtime.request.StreamSchedule`): stream and synthesize the same request and require
    the same codes and stop frames, and the joined chunks equal to the one-shot samples within
    1e-4 (contiguous offsets, no gap); returns ``(speech stream, chunks, one-shot result)``."""
    import numpy as np

    from higgs_pack.runtime.loop.streaming import stream
    from higgs_pack.runtime.loop.synthesis import synthesize
    from higgs_pack.runtime.options import SamplingOptions
    from higgs_pack.runtime.request import StreamSchedule

    def check(pipeline, text, *, seed=7, max_frames=None, **schedule):
        options = SamplingOptions(seed=seed)
        one = synthesize(pipeline, text, options=options, max_frames=max_frames)
        speech = stream(pipeline, text, options=options, max_frames=max_frames, schedule=StreamSchedule(**schedule))
        chunks = list(speech)
        assert [c.offset for c in chunks] == [0, *np.cumsum([len(c.samples) for c in chunks])[:-1].tolist()]
        joined = np.concatenate([c.samples for c in chunks])
        assert [r.stop_reason for r in speech.results] == [r.stop_reason for r in one.chunks]
        for got, want in zip(speech.results, one.chunks, strict=True):
            assert np.array_equal(got.delayed, want.delayed)
            assert np.array_equal(got.codes, want.codes)
        assert joined.dtype == np.float32 and joined.shape == one.samples.shape
        error = float(np.abs(joined - one.samples).max()) if joined.size else 0.0
        assert error <= 1e-4, f"stream differs from one-shot by {error}"
        return speech, chunks, one

    return check


def filesystem_type(path: Path) -> str:
    """The type of the file system ``path`` is on (longest mount point in /proc/mounts)."""
    best, kind = "", ""
    for line in Path("/proc/mounts").read_text().splitlines():
        fields = line.split()
        if len(fields) >= 3 and str(path.resolve()).startswith(fields[1]) and len(fields[1]) > len(best):
            best, kind = fields[1], fields[2]
    return kind


def skip_unless_reclaimable(path: Path) -> None:
    """MADV_PAGEOUT cannot reclaim tmpfs pages on a machine without swap: say so instead of failing."""
    if filesystem_type(path) in ("tmpfs", "ramfs"):
        pytest.skip(f"{path} is on {filesystem_type(path)}: its pages live in memory, nothing to page out")


@pytest.fixture(scope="session", autouse=True)
def _state_home(tmp_path_factory: pytest.TempPathFactory):
    """The servers the tests start make their voice prefix signing key under ``$XDG_STATE_HOME``
    (serve/voices.py): a folder of the run's, not the user's ``~/.local/state``."""
    before = os.environ.get("XDG_STATE_HOME")
    os.environ["XDG_STATE_HOME"] = str(tmp_path_factory.mktemp("state-home"))
    yield
    if before is None:
        del os.environ["XDG_STATE_HOME"]
    else:
        os.environ["XDG_STATE_HOME"] = before


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX (``amx_tile`` in /proc/cpuinfo's flags; False where there is none)."""
    try:
        return any(line.startswith("flags") and " amx_tile" in line for line in open("/proc/cpuinfo"))
    except OSError:
        return False


def skip_on_amx() -> None:
    """Skip a test that asserts an OpenVINO row bit-identical to the same row alone, on a CPU with
    AMX: there the CPU plugin's kernels round a forward of several rows differently from one row
    (measured 2026-12-06 on an Intel Xeon with AMX, OpenVINO 2026.4.1: hidden states 2e-6 to 2e-4
    apart, so sampled codes part after some frames), while on CPUs without AMX (AMD Zen 4, AVX-512
    BF16) they are bit-identical; docs/using/engine.md says so."""
    if cpu_has_amx():
        pytest.skip("this CPU has AMX: OpenVINO's kernels round a forward of several rows differently from one "
                    "row here (hidden states 2e-6 to 2e-4 apart), so a row is not bit-identical to itself alone; "
                    "exactness is checked on CPUs without AMX")

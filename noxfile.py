"""nox sessions: build-/verify-/package-/image-<target>, tests, lint, docs, bench, serve-bench.

Thin by design: every session calls the ``higgs-pack`` CLI, a module of the
package or the benchmark (``bench/``, a folder of this checkout, not of the wheel: run from
here with ``python -m bench``); the logic lives there.  Build-side sessions share one virtualenv
(``.nox/build-env``: torch, ModelBuilder, Olive, OpenVINO… about 6 GB) that is
created once and reused while pyproject.toml is unchanged.  verify-<target>
sessions use a runtime-only venv (no torch) per target, as a bundle user has.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import sys
from pathlib import Path

import nox

nox.needs_version = ">=2024.4.15"
nox.options.sessions = ["lint", "tests"]
nox.options.reuse_venv = "yes"

ROOT = Path(__file__).parent
BUILD_ENV = ROOT / ".nox" / "build-env"
# The project's shared test inputs (texts, a reference voice) beside the clone, or $HIGGS_PACK_CASES.
CASES = Path(os.environ.get("HIGGS_PACK_CASES", ROOT.parent / "shared" / "cases"))
#: What build-<target> speaks when the cases folder is not there.
FALLBACK_TEXT = "Packaging models is hard work, and this bundle was built to prove it."
#: The session table, generated from the target registry (python -m
#: higgs_pack.targets.nox_sessions --write; tests/test_declarations.py fails when it is stale).
#: Read as data: nox runs before the build environment, so it cannot import the declarations.
SESSIONS = json.loads((ROOT / "targets" / "sessions.json").read_text(encoding="utf-8"))
TARGETS: dict[str, dict] = SESSIONS["targets"]


def _hardware_found(probe: str) -> bool:
    """Run a provider row's hardware probe: ``command:<argv>`` exits 0, or ``platform:<sys.platform>``."""
    import shutil
    import subprocess

    kind, _, value = probe.partition(":")
    if kind == "platform":
        return sys.platform == value
    argv = shlex.split(value)
    return shutil.which(argv[0]) is not None and subprocess.run(argv, capture_output=True, check=False).returncode == 0


def _verify_runtime(target: str) -> tuple[str, bool]:
    """(extra to install, hardware known present) for verify-<target>.

    A GPU target whose probe finds the hardware gets its own extra (e.g. [cuda]:
    onnxruntime-gpu); otherwise the runtime extra of the provider it is checked on
    ([cpu]) and the GPU checks are skipped with a reason.  Only a command probe proves
    the hardware (a platform probe says only that the provider can exist).
    HIGGS_PACK_VERIFY_GPU=0/1 overrides the detection.
    """
    info = TARGETS[target]
    gpu = info["gpu"]
    if gpu is None:
        return info["runtime_extra"], False
    found = _hardware_found(gpu["probe"])
    forced = os.environ.get("HIGGS_PACK_VERIFY_GPU")
    if forced is not None:
        found = forced == "1"
    return (gpu["extra"] if found else info["runtime_extra"]), (found and gpu["probe"].startswith("command:"))


def _bin(name: str) -> str:
    return str(BUILD_ENV / ("Scripts" if sys.platform == "win32" else "bin") / name)


def build_env(session: nox.Session) -> None:
    """Create or refresh the shared build venv (editable install of .[build,dev])."""
    stamp = BUILD_ENV / ".stamp"
    want = hashlib.sha256((ROOT / "pyproject.toml").read_bytes()).hexdigest()
    if stamp.is_file() and stamp.read_text() == want:
        return
    if not (BUILD_ENV / "pyvenv.cfg").is_file():
        session.run(sys.executable, "-m", "venv", str(BUILD_ENV), external=True)
        session.run(_bin("python"), "-m", "pip", "install", "-q", "-U", "pip", external=True)
    session.run(_bin("python"), "-m", "pip", "install", "-q", "-e", f"{ROOT}[build,dev]", external=True)
    stamp.write_text(want)


def _bundle(session: nox.Session, higgs_pack: str, target: str, args: list[str] | tuple[str, ...] = ()) -> Path:
    """The bundle directory ``higgs-pack build --target TARGET ARGS`` writes, asked from the build
    itself (``--print-path``), so the name (variant included) has one definition: targets/plan.py."""
    printed = session.run(higgs_pack, "build", "--target", target, *args, "--print-path", silent=True,
                          external=True)
    return Path(str(printed).strip().splitlines()[-1])


for _target in TARGETS:

    @nox.session(name=f"build-{_target}", venv_backend="none", default=False, tags=["build"])
    def _build(session: nox.Session, target: str = _target) -> None:
        """Build dist/higgs-audio-v3-tiny-<target>-<precision>/ (args after -- go to `higgs-pack build`),
        then speak the English case with it."""
        build_env(session)
        args = list(session.posargs)
        session.run(_bin("higgs-pack"), "build", "--target", target, "--force", *args, external=True)
        if TARGETS[target]["runs_anywhere"] and not {"--plan", "--model", "-m"} & set(args):
            bundle = _bundle(session, _bin("higgs-pack"), target, args)
            wav = bundle.parent / f"{bundle.name}.wav"
            case = CASES / "text_en_basic.txt"
            text = ["--text-file", str(case)] if case.is_file() else ["--text", FALLBACK_TEXT]
            # --allow-fallback: a variant's device (the npu variant's NPU) may be missing here.
            session.run(_bin("higgs-pack"), "synthesize", str(bundle), *text, "-o", str(wav), "--no-progress",
                        "--allow-fallback", external=True)

    @nox.session(name=f"verify-{_target}", reuse_venv=True, default=False, tags=["verify"])
    def _verify(session: nox.Session, target: str = _target) -> None:
        """Verify the default bundle in a runtime-only venv (no torch) with `higgs-pack verify`:
        files, static ONNX checks (kernel coverage for GPU providers), signatures, parity vs
        golden outputs, synthesis of shared/cases; a GPU target's bundle also on its GPU
        provider where the hardware is found (else skipped, naming the hardware)."""
        extra, hardware = _verify_runtime(target)
        session.install(f"{ROOT}[{extra}]")
        bundle = session.posargs[0] if session.posargs else str(_bundle(session, "higgs-pack", target))
        if not Path(bundle).exists():
            session.error(f"{bundle} does not exist; run `nox -s build-{target}` first")
        session.run("python", "-c", "import importlib.util, sys; sys.exit(importlib.util.find_spec('torch') is not None)")
        args = ["--cases", str(CASES)] if CASES.is_dir() else []
        session.run("higgs-pack", "verify", bundle, *args, *(["--require-gpu"] if hardware else []),
                    *session.posargs[1:])

    @nox.session(name=f"package-{_target}", venv_backend="none", default=False, tags=["package"])
    def _package(session: nox.Session, target: str = _target) -> None:
        """Build the bundle if missing, package it as a wheel and an archive into dist/,
        then install-check the wheel in a fresh venv without torch."""
        build_env(session)
        bundle = _bundle(session, _bin("higgs-pack"), target)
        if not (bundle / "manifest.json").is_file():
            session.run(_bin("higgs-pack"), "build", "--target", target, external=True)
        session.run(_bin("higgs-pack"), "package", str(bundle), "--format", "all", "--force", external=True)
        session.run(_bin("python"), "-m", "higgs_pack.targets.packaging.install_check", "--target", target,
                    "--bundle", str(bundle), "--dist", str(ROOT / "dist"), "--higgs-pack-src", str(ROOT),
                    *(["--cases", str(CASES)] if CASES.is_dir() else []), external=True)


    @nox.session(name=f"image-{_target}", venv_backend="none", default=False, tags=["image"])
    def _image(session: nox.Session, target: str = _target) -> None:
        """Build the bundle if missing and package it as a container image of the speech server
        (`higgs-pack package --format image`: dist/image/<bundle>/ and the image; args after -- go
        to it).  HIGGS_PACK_LOCAL_BASE=1 makes the base image here with mmdebstrap, for machines that
        reach no registry (targets/packaging/local_base.py).  A Windows target's context is written
        alone off Windows (docker on Windows builds it)."""
        build_env(session)
        bundle = _bundle(session, _bin("higgs-pack"), target)
        if not (bundle / "manifest.json").is_file():
            session.run(_bin("higgs-pack"), "build", "--target", target, external=True)
        args = list(session.posargs)
        gpu = TARGETS[target]["gpu"]
        if gpu and gpu["probe"].startswith("platform:") and gpu["probe"] != f"platform:{sys.platform}":
            args.append("--no-build")
        elif os.environ.get("HIGGS_PACK_LOCAL_BASE") == "1" and "--base-image" not in args:
            cache = os.environ.get("HIGGS_PACK_CACHE", str(ROOT / ".nox" / "cache"))
            base = session.run(_bin("python"), "-m", "higgs_pack.targets.packaging.local_base", "--cache", cache,
                               silent=True, external=True)
            args += ["--base-image", str(base).strip().splitlines()[-1]]
        session.run(_bin("higgs-pack"), "package", str(bundle), "--format", "image", "--force", *args, external=True)


for _row in SESSIONS["provider_sessions"]:

    @nox.session(name=_row["session"], reuse_venv=True, default=False, tags=["verify"])
    def _verify_on_provider(session: nox.Session, row: dict = _row) -> None:
        """Verify a bundle on a provider whose onnxruntime distribution needs a venv of its own
        (args: [BUNDLE] [verify options]).

        onnxruntime-openvino ships the same `onnxruntime` module as onnxruntime, so higgs-pack
        goes in without a runtime extra (base + onnx). Fails loudly when the provider does not
        take a session; reports the nodes it leaves on the CPU provider."""
        session.install(*row["install"])
        session.install(str(ROOT))
        bundle = session.posargs[0] if session.posargs else str(_bundle(session, "higgs-pack", row["target"]))
        if not Path(bundle).exists():
            session.error(f"{bundle} does not exist; run `nox -s build-{row['target']}` first")
        args = ["--cases", str(CASES)] if CASES.is_dir() else []
        session.run("higgs-pack", "verify", bundle, "--execution-provider", row["provider"], *args, *session.posargs[1:])


@nox.session(venv_backend="none")
def tests(session: nox.Session) -> None:
    """Run the test suite (tiny checkpoint, real tools) in the shared build venv."""
    build_env(session)
    env = {"HIGGS_PACK_CACHE": str(ROOT / ".nox" / "cache")}
    session.run(_bin("python"), "-m", "pytest", "-q", *session.posargs, env=env, external=True)


#: The tests of the framework integrations (serve/integrations/), run by :func:`integrations`.
INTEGRATION_TESTS = ["tests/test_serve_integrations.py"]


@nox.session(reuse_venv=True, default=False)
def integrations(session: nox.Session) -> None:
    """Run the Pipecat and LiveKit tests (args after -- go to pytest) in a venv of their own: the
    runtime with [cpu,serve,pipecat,livekit] and pytest, no torch and no Ray.  [pipecat] cannot be
    installed beside [ray] (pyproject.toml: protobuf), and the build venv has [ray], so there those
    tests skip.  The tiny cpu int4 bundle they serve is built first by the build venv into
    ``$HIGGS_PACK_CACHE/bundles`` (default .nox/cache; its name asked from the build) and handed to the tests by
    ``HIGGS_PACK_TEST_CPU_INT4_BUNDLE`` (tests/conftest.py)."""
    cache = os.environ.get("HIGGS_PACK_CACHE", str(ROOT / ".nox" / "cache"))
    build_env(session)
    args = ["--target", "cpu", "--precision", "int4"]
    bundle = Path(cache) / "bundles" / _bundle(session, _bin("higgs-pack"), "cpu", args[2:]).name
    session.run(_bin("higgs-pack"), "build", *args, "--out", str(bundle), "--force", env={"HIGGS_PACK_CACHE": cache},
                external=True)
    # the built wheel, not an editable install: the tests see what a user gets (a sub-package missing
    # from the wheel fails here; an editable install hid it)
    session.install("--force-reinstall", "--no-deps", str(ROOT))
    session.install(f"{ROOT}[cpu,serve,pipecat,livekit]", "pytest>=8", "httpx")  # httpx: tests/live_server.py
    # the venv is the runtime's, as a user of the integrations has (-I: not the cwd's folders), and every
    # module of the server (ray_app needs [ray], which this venv must not have) imports from the wheel
    session.run("python", "-I", "-c", "import importlib.util as u, sys; found = [m for m in ('torch', 'ray') if "
                "u.find_spec(m)]; sys.exit(f'the integrations venv must hold no {found}' if found else 0)")
    session.run("python", "-I", "-c", "import importlib, pkgutil, higgs_pack.serve as s; "
                "assert 'site-packages' in s.__file__, s.__file__; "
                "[importlib.import_module(m.name) for m in pkgutil.walk_packages(s.__path__, 'higgs_pack.serve.') "
                "if m.name != 'higgs_pack.serve.ray_app']")
    # pytest's own script (not `python -m`, which puts the checkout's higgs_pack/ folder first on sys.path)
    session.run("pytest", "-q", *(str(ROOT / t) for t in INTEGRATION_TESTS), *session.posargs,
                env={"HIGGS_PACK_CACHE": cache, "HIGGS_PACK_TEST_CPU_INT4_BUNDLE": str(bundle)})


@nox.session(venv_backend="none")
def lint(session: nox.Session) -> None:
    """ruff check (the lint rules in pyproject.toml). Formatting is not checked: the tree is not
    ruff-formatted, and reformatting it would bury every other change."""
    build_env(session)
    session.run(_bin("ruff"), "check", ".", external=True)


@nox.session(default=False)
def docs(session: nox.Session) -> None:
    """Build the documentation site (mkdocs-material, mkdocs.yml) into dist/site/ with
    `mkdocs build --strict`: a broken link or anchor, or a page left out of the nav, fails it.
    Its own venv holds the [docs] extra (read from pyproject.toml) and higgs-pack without extras (no
    torch, no runtime backend): docs/hooks/bench_tables.py takes the benchmark pages' tables from
    docs/benchmarks/tables.json (kept JSON; `python -m bench.tables --write` renders it from the runs
    kept in docs/benchmarks/runs/ with the benchmark's own table code)."""
    extras = nox.project.load_toml(ROOT / "pyproject.toml")["project"]["optional-dependencies"]
    session.install(*extras["docs"], "-e", str(ROOT))
    session.run("mkdocs", "build", "--strict", "--config-file", str(ROOT / "mkdocs.yml"), *session.posargs,
                env={"NO_MKDOCS_2_WARNING": "1"})  # no banner about MkDocs 2 in every CI log


@nox.session(venv_backend="none", default=False)
def bench(session: nox.Session) -> None:
    """Benchmark PyTorch reference vs bundles side by side (-- --preset full for real size);
    writes dist/bench.json."""
    build_env(session)
    env = {"HIGGS_PACK_CACHE": os.environ.get("HIGGS_PACK_CACHE", str(ROOT / ".nox" / "cache")),
           "PYTHONPATH": str(ROOT)}  # bench/ is imported from the checkout
    session.run(_bin("python"), "-m", "bench", "--out", str(ROOT / "dist" / "bench.json"),
                *session.posargs, env=env, external=True)


@nox.session(name="agent-bench", venv_backend="none", default=False)
def agent_bench(session: nox.Session) -> None:
    """The agent benchmark (bench/serving/agent.py): live sessions fed an LLM's tokens at 20 and 40
    per second under each commit rule, first-token-to-speech beside this machine's floor (the bench
    preset's cpu int4 bundle; -- --preset tiny, --bundle PATH); writes dist/agent-bench.json."""
    build_env(session)
    env = {"HIGGS_PACK_CACHE": os.environ.get("HIGGS_PACK_CACHE", str(ROOT / ".nox" / "cache")),
           "PYTHONPATH": str(ROOT)}  # bench/ is imported from the checkout
    cases = ["--cases", str(CASES)] if CASES.is_dir() else []
    session.run(_bin("python"), "-m", "bench.serving.agent", "--out", str(ROOT / "dist" / "agent-bench.json"),
                *cases, *session.posargs, env=env, external=True)


@nox.session(name="serve-bench", venv_backend="none", default=False)
def serve_bench(session: nox.Session) -> None:
    """Load-test `higgs-pack serve` on 127.0.0.1 at 1, 4, 16 and 64 clients beside the engine in its
    own process (the tiny cpu int4 bundle; -- --preset bench for the bench one); writes
    dist/serve-bench.json and dist/serve-bench.html with the goals met or missed."""
    build_env(session)
    env = {"HIGGS_PACK_CACHE": os.environ.get("HIGGS_PACK_CACHE", str(ROOT / ".nox" / "cache")),
           "PYTHONPATH": str(ROOT)}  # bench/ is imported from the checkout
    cases = ["--cases", str(CASES)] if CASES.is_dir() else []
    session.run(_bin("python"), "-m", "bench.serving.load", "--out",
                str(ROOT / "dist" / "serve-bench.json"), *cases, *session.posargs, env=env, external=True)

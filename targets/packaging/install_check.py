"""Install a bundle wheel the way a user would and check that it works (nox ``package-<target>``).

Usage::

    python -m higgs_pack.targets.packaging.install_check --target cpu --wheel dist/<wheel>.whl \\
        [--cases ../shared/cases] [--higgs-pack-src .]
    python -m higgs_pack.targets.packaging.install_check --target cpu --bundle dist/<bundle> --dist dist …

Every target: the wheel's metadata is checked (name, entry point, the
``higgs-pack[<extra>]`` requirement and the target's platform marker, the bundled
manifest's target), and the wheel is installed with ``pip install --no-deps
--target`` and its bundle opened by name with every sha256 checked.

Targets whose runtime runs on this machine (``cpu``, ``openvino``): a fresh venv
(stdlib ``venv``) gets ``pip install <higgs-pack source>[<extra>]`` and then the
wheel; ``import torch`` must fail in it; then ``higgs-pack list``, ``higgs-pack
verify <bundle-name> --cases DIR`` and ``higgs-pack synthesize <bundle-name>``
run and the wav is checked (mono, the bundle's sample rate, not empty).

Targets whose hardware is not here (``cuda``: an NVIDIA GPU; ``dml``: Windows
with a DirectX 12 GPU): pip's resolver checks, for each platform the target
ships on, that every runtime requirement has a binary wheel in the allowed
version range (``pip install --dry-run --no-deps --only-binary=:all:
--platform …``); running the bundle is skipped, and the output says so and why.

Exit status 0 when every check passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import venv
import wave
import zipfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from email.parser import HeaderParser
from pathlib import Path
from typing import Any

from higgs_pack.errors import HiggsPackError


@dataclass(frozen=True)
class Platform:
    """A platform the resolver check covers.

    Attributes:
        label: for messages.
        tags: ``pip --platform`` tags, newest first (pip does not expand
            ``manylinux_2_28`` to older glibc tags by itself).
        markers: PEP 508 marker environment of the platform.
    """

    label: str
    tags: tuple[str, ...]
    markers: Mapping[str, str]


LINUX_X86_64 = Platform(
    "Linux x86-64 (glibc >= 2.28)",
    (*(f"manylinux_2_{minor}_x86_64" for minor in range(28, 16, -1)), "manylinux2014_x86_64"),
    {"sys_platform": "linux", "platform_system": "Linux", "os_name": "posix", "platform_machine": "x86_64"},
)
WINDOWS_AMD64 = Platform(
    "Windows x86-64",
    ("win_amd64",),
    {"sys_platform": "win32", "platform_system": "Windows", "os_name": "nt", "platform_machine": "AMD64"},
)


@dataclass(frozen=True)
class CheckPlan:
    """How a target's wheel is checked on this machine.

    Attributes:
        runs_here: install into a fresh venv and run verify + synthesize.
        platforms: platforms the resolver check covers (when not run here).
        needs: the hardware / OS the bundle needs, for the "skipped" message.
    """

    runs_here: bool
    platforms: tuple[Platform, ...] = ()
    needs: str = ""


#: Platforms a provider row's ``wheel_platforms`` may name.
PLATFORMS: dict[str, Platform] = {"linux_x86_64": LINUX_X86_64, "win_amd64": WINDOWS_AMD64}


def check_plan(target: Any) -> CheckPlan:
    """How a target's wheel is checked here, from its declaration and provider row.

    A target whose runtime runs on any machine (``verify_on`` unset: cpu, openvino) is
    installed and run; one that needs hardware is resolver-checked for the platforms its
    provider row lists.
    """
    if target.runs_anywhere:
        return CheckPlan(runs_here=True)
    row = target.provider
    if row is None or not row.packaging.wheel_platforms:
        raise HiggsPackError(f"target {target.name!r} needs hardware this machine may lack, but its execution "
                             "provider row lists no wheel_platforms to check the wheel's requirements for")
    return CheckPlan(runs_here=False, platforms=tuple(PLATFORMS[p] for p in row.packaging.wheel_platforms),
                     needs=row.hardware.needs if row.hardware else row.name)


@dataclass
class Results:
    """Lines of the check report; ``failed`` when any line failed."""

    lines: list[tuple[str, str, str]] = field(default_factory=list)

    def add(self, status: str, name: str, detail: str = "") -> None:
        self.lines.append((status, name, detail))
        print(f"[{status:>7}] {name}{': ' + detail if detail else ''}", flush=True)

    @property
    def failed(self) -> bool:
        return any(status == "FAIL" for status, _, _ in self.lines)


@dataclass(frozen=True)
class WheelInfo:
    """What the checks need from a bundle wheel.

    Attributes:
        path: the ``.whl`` file.
        metadata: parsed ``METADATA`` headers.
        bundle_name: the ``higgs_pack.bundles`` entry-point name.
        package: the package holding the bundle.
        manifest: the bundled ``manifest.json``.
    """

    path: Path
    metadata: Any
    bundle_name: str
    package: str
    manifest: dict[str, Any]

    @property
    def requires(self) -> list[str]:
        return self.metadata.get_all("Requires-Dist") or []


def read_wheel(path: Path) -> WheelInfo:
    """Read a bundle wheel's metadata, entry point and manifest (no extraction).

    Raises:
        HiggsPackError: not a bundle wheel (no ``higgs_pack.bundles`` entry point or manifest).
    """
    with zipfile.ZipFile(path) as zf:
        names = zf.namelist()
        info = next((n.split("/")[0] for n in names if n.endswith(".dist-info/METADATA")), None)
        if info is None:
            raise HiggsPackError(f"{path}: not a wheel (no .dist-info/METADATA)")
        metadata = HeaderParser().parsestr(zf.read(f"{info}/METADATA").decode("utf-8"))
        entry_points = zf.read(f"{info}/entry_points.txt").decode("utf-8") if f"{info}/entry_points.txt" in names else ""
        bundles = _entry_points(entry_points).get("higgs_pack.bundles", {})
        if len(bundles) != 1:
            raise HiggsPackError(f"{path}: not a bundle wheel (higgs_pack.bundles entry points: {bundles or 'none'})")
        (name, package), = bundles.items()
        manifest = json.loads(zf.read(f"{package}/manifest.json"))
    return WheelInfo(path, metadata, name, package, manifest)


def _entry_points(text: str) -> dict[str, dict[str, str]]:
    groups: dict[str, dict[str, str]] = {}
    current = None
    for line in text.splitlines():
        line = line.strip()
        if line.startswith("[") and line.endswith("]"):
            current = groups.setdefault(line[1:-1], {})
        elif "=" in line and current is not None:
            key, value = (s.strip() for s in line.split("=", 1))
            current[key] = value
    return groups


def check_metadata(wheel: WheelInfo, target: Any, results: Results) -> None:
    """The wheel names its bundle, requires ``higgs-pack[<extra>]`` with the target's marker."""
    from packaging.markers import Marker
    from packaging.requirements import Requirement

    m = wheel.manifest
    ok = m["target"] == target.name and m["name"] == wheel.bundle_name == wheel.metadata["Name"]
    results.add("ok" if ok else "FAIL", "wheel names its bundle",
                f"{wheel.metadata['Name']} {wheel.metadata['Version']}: entry point {wheel.bundle_name} -> "
                f"{wheel.package}, manifest target {m['target']}")
    own = [Requirement(r) for r in wheel.requires if Requirement(r).name == "higgs-pack"]
    want_marker = str(Marker(target.platform_marker)) if target.platform_marker else None
    good = [r for r in own if target.extra in r.extras
            and (str(r.marker) if r.marker else None) == want_marker]
    results.add("ok" if good else "FAIL", "Requires-Dist higgs-pack extra and marker",
                f"{', '.join(map(str, own)) or 'no higgs-pack requirement'} "
                f"(want higgs-pack[{target.extra}]{'; ' + want_marker if want_marker else ''})")
    results.add("ok" if wheel.metadata["License"] == m["model"]["license"] else "FAIL", "License is the model's",
                wheel.metadata["License"] or "missing")


def check_no_deps_install(wheel: WheelInfo, work: Path, results: Results) -> None:
    """``pip install --no-deps --target`` then open the bundle by name, every sha256 checked."""
    site = work / "no-deps-site"
    shutil.rmtree(site, ignore_errors=True)
    proc = _run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-compile", "--target", str(site),
                 str(wheel.path)])
    if proc.returncode:
        results.add("FAIL", "pip install --no-deps --target", _tail(proc))
        return
    code = ("import sys; from higgs_pack.runtime.sources.bundle import open_bundle; "
            "b = open_bundle(sys.argv[1], check_hashes=True); print(b.path, len(b.manifest['files']))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    proc = _run([sys.executable, "-c", code, wheel.bundle_name], env=env, cwd=work)
    results.add("FAIL" if proc.returncode else "ok", "installed bundle found by name, sha256 verified",
                _tail(proc) if proc.returncode else proc.stdout.strip())


def _extra_requirements(extra: str) -> list[str]:
    """higgs-pack's own requirements for ``[extra]`` (plus its base), from its installed metadata."""
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    out = []
    for raw in requires("higgs-pack") or []:
        req = Requirement(raw)
        if req.marker is None or "extra" not in str(req.marker) or req.marker.evaluate({"extra": extra}):
            out.append(raw)
    return out


def check_resolves(wheel: WheelInfo, target: Any, plan: CheckPlan, work: Path, results: Results) -> None:
    """For each platform: every runtime requirement (markers evaluated for that platform) has a wheel."""
    from packaging.requirements import Requirement

    pyver = f"{sys.version_info.major}.{sys.version_info.minor}"
    wanted = [r for r in wheel.requires if Requirement(r).name != "higgs-pack"] + _extra_requirements(target.extra)
    for platform in plan.platforms:
        env = {**platform.markers, "extra": target.extra}
        reqs, skipped = [], []
        for raw in wanted:
            req = Requirement(raw)
            if req.marker is not None and not req.marker.evaluate(env):
                skipped.append(req.name)
                continue
            req.marker = None
            reqs.append(str(req))
        reqs = list(dict.fromkeys(reqs))
        tags = [arg for tag in platform.tags for arg in ("--platform", tag)]
        cmd = [sys.executable, "-m", "pip", "install", "--dry-run", "--no-deps", "--only-binary=:all:",
               *tags, "--python-version", pyver, "--implementation", "cp",
               "--target", str(work / f"dry-{platform.tags[0]}"), *reqs]
        proc = _run(cmd)
        lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("Would install")]
        detail = lines[-1] if lines and not proc.returncode else _tail(proc)
        if skipped:
            detail += f" (not needed on {platform.label}: {', '.join(skipped)})"
        results.add("FAIL" if proc.returncode else "ok",
                    f"runtime requirements have wheels for {platform.label}, CPython {pyver}", detail)


def check_in_fresh_venv(wheel: WheelInfo, target: Any, source: str, cases: Path | None, work: Path,
                        results: Results) -> None:
    """Fresh venv: install higgs-pack[<extra>] and the wheel; no torch; list, verify, synthesize."""
    env_dir = work / "venv"
    venv.EnvBuilder(with_pip=True, clear=True).create(env_dir)
    bindir = env_dir / ("Scripts" if sys.platform == "win32" else "bin")
    python = str(bindir / "python")
    cli = str(bindir / "higgs-pack")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}
    env.update(VIRTUAL_ENV=str(env_dir), PATH=os.pathsep.join([str(bindir), env.get("PATH", "")]))
    steps: list[tuple[str, Sequence[str]]] = [
        (f"pip install higgs-pack[{target.extra}]", [python, "-m", "pip", "install", "-q", f"{source}[{target.extra}]"]),
        ("pip install the bundle wheel", [python, "-m", "pip", "install", "-q", str(wheel.path)]),
    ]
    for name, cmd in steps:
        proc = _run(cmd, env=env, cwd=work)
        results.add("FAIL" if proc.returncode else "ok", name, _tail(proc) if proc.returncode else "")
        if proc.returncode:
            return
    proc = _run([python, "-c", "import torch"], env=env, cwd=work)
    results.add("ok" if proc.returncode else "FAIL", "no torch in the runtime venv",
                "import torch fails, as it should" if proc.returncode else "torch is importable: a runtime "
                "dependency pulls torch in")
    proc = _run([cli, "list"], env=env, cwd=work)
    ok = proc.returncode == 0 and wheel.bundle_name in proc.stdout and "BROKEN" not in proc.stdout
    results.add("ok" if ok else "FAIL", "higgs-pack list", proc.stdout.strip() if ok else _tail(proc))
    args = ["--cases", str(cases)] if cases else []
    proc = _run([cli, "verify", wheel.bundle_name, *args], env=env, cwd=work)
    summary = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else ""
    results.add("FAIL" if proc.returncode else "ok", f"higgs-pack verify {wheel.bundle_name}",
                _tail(proc) if proc.returncode else summary)
    text_file = cases / "text_en_basic.txt" if cases and (cases / "text_en_basic.txt").is_file() else None
    if text_file is None:
        text_file = work / "text.txt"
        text_file.write_text("Hello from higgs-pack.", encoding="utf-8")
    out = work / "out.wav"
    proc = _run([cli, "synthesize", wheel.bundle_name, "--text-file", str(text_file), "-o", str(out),
                 "--no-progress"], env=env, cwd=work)
    if proc.returncode:
        results.add("FAIL", f"higgs-pack synthesize {wheel.bundle_name}", _tail(proc))
        return
    results.add("ok", f"higgs-pack synthesize {wheel.bundle_name}", proc.stdout.strip())
    check_wav(out, wheel.manifest["constants"]["sample_rate"], results)


def check_wav(path: Path, sample_rate: int, results: Results) -> None:
    """Mono, ``sample_rate`` Hz, at least one frame (read with the stdlib ``wave`` module)."""
    try:
        with wave.open(str(path), "rb") as w:
            channels, rate, frames = w.getnchannels(), w.getframerate(), w.getnframes()
    except (OSError, wave.Error, EOFError) as exc:
        results.add("FAIL", "output wav", f"{path}: {exc}")
        return
    ok = channels == 1 and rate == sample_rate and frames > 0
    results.add("ok" if ok else "FAIL", "output wav",
                f"{channels} channel(s), {rate} Hz (want 1, {sample_rate}), {frames} frames = {frames / rate:.2f} s")


def _run(cmd: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: Path | None = None,
         timeout: float = 3600) -> subprocess.CompletedProcess[str]:
    print("$ " + " ".join(str(c) for c in cmd), flush=True)
    try:
        return subprocess.run(list(cmd), env=dict(env) if env is not None else None, cwd=cwd, text=True,
                              capture_output=True, timeout=timeout, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return subprocess.CompletedProcess(list(cmd), 127, "", str(exc))


def _tail(proc: subprocess.CompletedProcess[str], lines: int = 12) -> str:
    """Exit status and the error lines (``ERROR…``, ``error:…``) or else the last ``lines`` lines."""
    text = (proc.stdout + "\n" + proc.stderr).strip().splitlines()
    errors = [ln for ln in text if ln.lstrip().lower().startswith("error")]
    return f"exit {proc.returncode}: " + " | ".join((errors or text)[-lines:])


def find_wheel(bundle: Path, dist: Path) -> Path:
    """The wheel ``higgs-pack package`` wrote for ``bundle`` into ``dist``.

    Raises:
        HiggsPackError: the bundle is not valid, or its wheel is not in ``dist``.
    """
    from higgs_pack.manifests.manifest import read_manifest
    from higgs_pack.targets.packaging import output_names

    name = output_names(read_manifest(bundle), ("wheel",))["wheel"]
    path = dist / name
    if not path.is_file():
        raise HiggsPackError(f"{path} not found; package the bundle first: higgs-pack package {bundle} --format wheel")
    return path


def _default_source() -> str | None:
    root = Path(__file__).resolve().parents[1]
    return str(root) if (root / "pyproject.toml").is_file() else None


def main(argv: Sequence[str] | None = None) -> int:
    """Command-line entry point; returns the exit status (0 = every check passed)."""
    parser = argparse.ArgumentParser(prog="python -m higgs_pack.targets.packaging.install_check", description=__doc__.split("\n")[0])
    parser.add_argument("--target", required=True, help="a registered target (an unknown name lists them).")
    parser.add_argument("--wheel", type=Path, help="The bundle wheel to check.")
    parser.add_argument("--bundle", type=Path, help="Bundle directory whose wheel is in --dist (instead of --wheel).")
    parser.add_argument("--dist", type=Path, default=Path("dist"), help="Where --bundle's wheel is (default: dist).")
    parser.add_argument("--cases", type=Path, help="shared/cases folder (text_en_basic.txt, …) for verify/synthesize.")
    parser.add_argument("--higgs-pack-src", help="higgs-pack source tree or wheel to install (default: this checkout).")
    parser.add_argument("--work-dir", type=Path, help="Keep the venv and outputs here (default: a temporary folder).")
    args = parser.parse_args(argv)

    from higgs_pack.targets.registry import get_target

    results = Results()
    try:
        target = get_target(args.target)
        plan = check_plan(target)
        if args.wheel is None and args.bundle is None:
            parser.error("give --wheel WHEEL or --bundle BUNDLE [--dist DIR]")
        wheel_path = args.wheel if args.wheel is not None else find_wheel(args.bundle, args.dist)
        wheel = read_wheel(wheel_path.resolve())
    except (HiggsPackError, OSError, KeyError, zipfile.BadZipFile) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    cases = args.cases.resolve() if args.cases and args.cases.is_dir() else None
    print(f"install check: {wheel.path.name} for target {target.name}", flush=True)
    with tempfile.TemporaryDirectory(prefix="higgs-pack-install-check-") as tmp:
        work = args.work_dir or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        check_metadata(wheel, target, results)
        check_no_deps_install(wheel, work, results)
        if plan.runs_here:
            source = args.higgs_pack_src or _default_source()
            if source is not None and Path(source).exists():
                source = str(Path(source).resolve())
            if source is None:
                results.add("FAIL", "higgs-pack source", "not found; pass --higgs-pack-src REPO_OR_WHEEL")
            else:
                check_in_fresh_venv(wheel, target, source, cases, work, results)
        else:
            check_resolves(wheel, target, plan, work, results)
            results.add("skipped", f"install + verify + synthesize with {target.name}",
                        f"the bundle needs {plan.needs}; this machine ({sys.platform}) cannot run it. "
                        "Run this check on such a machine to cover it")
    failed = sum(1 for s, _, _ in results.lines if s == "FAIL")
    skipped = sum(1 for s, _, _ in results.lines if s == "skipped")
    print(f"result: {'FAIL' if failed else 'PASS'} ({len(results.lines) - failed - skipped} ok, {failed} failed, "
          f"{skipped} skipped)")
    return 1 if results.failed else 0


if __name__ == "__main__":
    sys.exit(main())

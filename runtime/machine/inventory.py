"""What this machine offers, and which bundles are visible: the inputs of :func:`~higgs_pack.runtime.machine.choice.choose`.

:func:`inventory` probes the real machine: every ONNX Runtime provider the
installed onnxruntime lists is asked to create a session on a one-node graph (a
provider whose library fails to load is listed with ONNX Runtime's reason);
OpenVINO's devices with their ``FULL_DEVICE_NAME``; and, independent of any
runtime, NVIDIA GPUs, Intel GPUs and Intel NPUs seen on the PCI bus (Linux), so a
device whose driver or runtime is missing is still reported.

:func:`visible_bundles` lists installed bundle wheels, bundle folders given with
``--bundles`` (or ``$HIGGS_PACK_BUNDLES``, ``os.pathsep``-separated) and bundles in
repositories pulled into the Hugging Face cache.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import os
import platform
import sys
from collections.abc import Iterable
from pathlib import Path

from higgs_pack.errors import HiggsPackError, install_extra
from higgs_pack.manifests.manifest import MANIFEST_NAME, read_manifest
from higgs_pack.manifests.providers import EXECUTION_PROVIDERS
from higgs_pack.runtime.machine.choice import candidate_of
from higgs_pack.runtime.machine.cpu import cpu_info
from higgs_pack.runtime.machine.facts import Candidate, Inventory

log = logging.getLogger(__name__)

#: PCI vendor ids.
_INTEL, _NVIDIA = "0x8086", "0x10de"
#: PCI class prefixes: display controllers (0x03xxxx), processing accelerators (0x1200xx).
_DISPLAY, _ACCELERATOR = "0x03", "0x1200"


def _probe_model() -> bytes:
    """A one-node ONNX graph (Identity on float32 [1]) to prove a provider creates sessions."""
    from onnx import TensorProto, helper

    graph = helper.make_graph([helper.make_node("Identity", ["x"], ["y"])], "probe",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    model.ir_version = 8
    return model.SerializeToString()


def ort_providers() -> tuple[dict[str, str | None], tuple[str, ...]]:
    """Each provider the installed onnxruntime lists -> None if a session really runs on it, else why not.

    Returns:
        ``({bundle EP name: None | reason}, installed distributions)``; empty when
        onnxruntime is missing (or two distributions clash: the reason is logged).
    """
    from higgs_pack.runtime.backends.onnxruntime.distributions import (
        import_ort,
        installed_ort_distributions,
    )

    dists = tuple(installed_ort_distributions())
    try:
        ort = import_ort()
    except HiggsPackError as exc:
        log.info("ONNX Runtime unusable: %s", exc)
        return {}, dists
    by_ort = rows_by_ort_provider()
    try:
        model = _probe_model()
    except ImportError:  # pragma: no cover - onnx comes with every ONNX Runtime extra
        model = None
    out: dict[str, str | None] = {}
    for provider in ort.get_available_providers():
        names = by_ort.get(provider, ())
        if not names:
            continue
        if model is None:
            out.update(dict.fromkeys(names, "not probed (onnx is not installed)"))
            continue
        try:
            so = ort.SessionOptions()
            so.log_severity_level = 3
            session = ort.InferenceSession(model, sess_options=so, providers=[provider])
            used = session.get_providers()
            state = None if used and used[0] == provider else f"the session landed on {', '.join(used)}"
        except Exception as exc:  # ONNX Runtime raises its own types for a provider that fails to load
            state = str(exc).strip().splitlines()[-1][:200] if str(exc).strip() else type(exc).__name__
        out.update(dict.fromkeys(names, state))
    return out, dists


def rows_by_ort_provider() -> dict[str, tuple[str, ...]]:
    """ONNX Runtime provider name -> every bundle EP name that runs on it.

    Rows may share one provider: ``dml`` and ``winml`` both run ModelBuilder's dml graphs on
    ``DmlExecutionProvider``, from onnxruntime-directml or Windows ML's onnxruntime-windowsml,
    so where it creates sessions either bundle runs.
    """
    out: dict[str, tuple[str, ...]] = {}
    for name, row in EXECUTION_PROVIDERS.items():
        out[row.ort_provider] = (*out.get(row.ort_provider, ()), name)
    return out


def openvino_devices() -> tuple[str | None, dict[str, str]]:
    """``(OpenVINO version or None, {device: FULL_DEVICE_NAME})``."""
    try:
        import openvino as ov
    except ImportError:
        return None, {}
    from higgs_pack.runtime.backends.openvino.devices import runtime_versions

    core = ov.Core()
    devices: dict[str, str] = {}
    for device in core.available_devices:
        try:
            devices[device] = str(core.get_property(device, "FULL_DEVICE_NAME"))
        except Exception as exc:  # a plugin that lists a device but cannot describe it
            devices[device] = f"(name unavailable: {str(exc).strip().splitlines()[-1][:120]})"
    return runtime_versions()["openvino"], devices


def pci_hardware(root: Path = Path("/sys/bus/pci/devices")) -> dict[str, list[str]]:
    """GPUs and NPUs on the PCI bus (Linux sysfs), whatever drivers or runtimes are installed.

    Returns:
        kind (``nvidia-gpu``, ``intel-gpu``, ``intel-npu``) -> ``["0000:00:02.0 (driver i915)", …]``.
    """
    found: dict[str, list[str]] = {}
    if not root.is_dir():
        return found
    for dev in sorted(root.iterdir()):
        try:
            vendor = (dev / "vendor").read_text().strip()
            klass = (dev / "class").read_text().strip()
        except OSError:
            continue
        kind = None
        if vendor == _NVIDIA and klass.startswith(_DISPLAY):
            kind = "nvidia-gpu"
        elif vendor == _INTEL and klass.startswith(_DISPLAY):
            kind = "intel-gpu"
        elif vendor == _INTEL and klass.startswith(_ACCELERATOR):
            kind = "intel-npu"
        if kind:
            driver = (dev / "driver").resolve().name if (dev / "driver").exists() else "no driver"
            found.setdefault(kind, []).append(f"{dev.name} (driver {driver})")
    return found


def inventory() -> Inventory:
    """Probe this machine (see the module docstring); takes about a second."""
    providers, dists = ort_providers()
    ov_version, ov_devices = openvino_devices()
    hardware = pci_hardware()
    npu_driver = None
    if sys.platform.startswith("linux"):
        npu_driver = any(Path("/dev/accel").glob("accel*")) if "intel-npu" in hardware else None
    cpu, vendor = cpu_info().model, cpu_info().vendor
    return Inventory(ort_providers=providers, ort_distributions=dists, openvino=ov_version,
                     openvino_devices=ov_devices, hardware=hardware, npu_driver=npu_driver,
                     platform=sys.platform, cpu=cpu, cpu_vendor=vendor)


def bundles_in(folder: Path) -> list[Path]:
    """A bundle folder itself, or the bundle folders one level below ``folder``."""
    folder = Path(folder)
    if (folder / MANIFEST_NAME).is_file():
        return [folder]
    if not folder.is_dir():
        return []
    return sorted(p for p in folder.iterdir() if (p / MANIFEST_NAME).is_file())


def hub_cache_bundles(cache_dir: str | Path | None = None) -> list[tuple[Path, str]]:
    """Bundles in repositories pulled into the Hugging Face cache: ``[(folder, "hub ORG/REPO@commit")]``.

    Reads the cache with huggingface_hub's ``scan_cache_dir``; for each model
    repository the revision ``refs/main`` points at (else the newest) is used.
    """
    try:
        from huggingface_hub import scan_cache_dir
    except ImportError:  # pragma: no cover - huggingface_hub comes with the base install
        return []
    try:
        info = scan_cache_dir(cache_dir)
    except Exception as exc:  # CacheNotFound, or an unreadable cache: nothing pulled
        log.debug("no Hugging Face cache: %s", exc)
        return []
    out: list[tuple[Path, str]] = []
    for repo in sorted(info.repos, key=lambda r: r.repo_id):
        if repo.repo_type != "model" or not repo.revisions:
            continue
        revs = sorted(repo.revisions, key=lambda r: ("main" not in r.refs, -r.last_modified))
        rev = revs[0]
        for folder in bundles_in(rev.snapshot_path):
            out.append((folder, f"hub {repo.repo_id}@{rev.commit_hash[:12]}"))
    return out


def visible_bundles(bundle_dirs: Iterable[str | Path] = (), *, installed: bool = True, hub_cache: bool = True,
                    cache_dir: str | Path | None = None) -> tuple[list[Candidate], dict[str, str]]:
    """Every bundle this process can see, read from its manifest (hashes are checked at load).

    Args:
        bundle_dirs: folders holding bundles (or bundles); ``$HIGGS_PACK_BUNDLES`` adds more
            (when ``installed`` is true).
        installed: include installed bundle wheels and ``$HIGGS_PACK_BUNDLES``.
        hub_cache: include bundles pulled into the Hugging Face cache.
        cache_dir: the Hugging Face cache (default: huggingface_hub's, ``$HF_HUB_CACHE``).

    Returns:
        ``(candidates, broken)``: one :class:`Candidate` per readable manifest, and
        folder -> why for bundles whose manifest is unreadable.
    """
    from higgs_pack.runtime.sources.installed import installed_bundles

    found: list[tuple[Path, str]] = [(p, "installed") for p in installed_bundles().values()] if installed else []
    env = os.environ.get("HIGGS_PACK_BUNDLES", "") if installed else ""
    extra = [*bundle_dirs, *filter(None, env.split(os.pathsep))]
    for folder in extra:
        found += [(p, "--bundles") for p in bundles_in(Path(folder))]
    if hub_cache:
        found += hub_cache_bundles(cache_dir)
    candidates: list[Candidate] = []
    broken: dict[str, str] = {}
    seen: set[Path] = set()
    for folder, origin in found:
        key = folder.resolve()
        if key in seen:
            continue
        seen.add(key)
        try:
            candidates.append(candidate_of(read_manifest(folder), folder, origin))
        except HiggsPackError as exc:
            broken[str(folder)] = str(exc)
    return candidates, broken


def bench_speeds(path: str | Path | None = None, *, cpu: str | None = None) -> dict[str, float]:
    """Measured decode frames/s on the CPU per ``<target>-<precision>`` from a ``bench.json``.

    Uses the records of ``nox -s bench`` (``system``, ``precision``, ``frames_per_s``,
    ``device``, ``preset``, ``machine.cpu``) measured on the CPU, of the largest preset present.

    Args:
        path: the file (default ``dist/bench.json`` in the working directory, then
            ``$HIGGS_PACK_CACHE/bench.json``); missing or unreadable -> ``{}``.
        cpu: keep only records measured on this CPU model (records that do not name
            their machine are kept); None keeps all.
    """
    from higgs_pack.runtime.sources.paths import cache_root

    paths = [Path(path)] if path else [Path("dist/bench.json"), cache_root() / "bench.json"]
    for p in paths:
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            continue
        records = [r for r in (data if isinstance(data, list) else []) if isinstance(r, dict)
                   and isinstance(r.get("frames_per_s"), (int, float)) and not r.get("variant")
                   and str(r.get("device")) in ("cpu", "CPU") and r.get("system") != "pytorch"
                   and (cpu is None or (r.get("machine") or {}).get("cpu", cpu) == cpu)]
        # One preset only, the largest measured (full > bench > tiny): like is compared with like.
        for preset in ("full", "bench", "tiny"):
            same = [r for r in records if r.get("preset") == preset]
            if same:
                return {f"{r['system']}-{r['precision']}": float(r["frames_per_s"]) for r in same}
        return {}
    return {}


def describe(bundle_dirs: Iterable[str | Path] = (), inv: Inventory | None = None,
             candidates: list[Candidate] | None = None) -> tuple[str, dict]:
    """The ``higgs-pack devices`` report: the inventory, each visible bundle's verdict, the choice per model.

    Returns:
        ``(text for a terminal, the same as a JSON-ready dict)``.
    """
    from higgs_pack.runtime.machine.choice import choose, placements, preference

    inv = inv if inv is not None else inventory()
    broken: dict[str, str] = {}
    if candidates is None:
        candidates, broken = visible_bundles(bundle_dirs)
    bench = bench_speeds(cpu=inv.cpu)
    lines = [f"CPU            {inv.cpu or 'unknown'} ({inv.cpu_vendor}, {platform.machine()}, {inv.platform})"]
    versions = []
    for dist in inv.ort_distributions:
        try:
            versions.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            versions.append(dist)
    lines.append(f"ONNX Runtime   {', '.join(versions) or 'not installed'}")
    for name, row in EXECUTION_PROVIDERS.items():
        if name in inv.ort_providers:
            state = "creates sessions" if inv.ort_providers[name] is None else f"FAILS: {inv.ort_providers[name]}"
        else:
            state = f"not available ({install_extra(row.packaging.extra)})"
            probe = (row.hardware.probe if row.hardware else None) or ""
            platform_only = probe.removeprefix("platform:")
            if probe != platform_only and not inv.platform.startswith(platform_only):
                state = f"not available ({platform_only} only)"
        lines.append(f"  {name:<9} {row.ort_provider:<27} {state}")
    lines.append(f"OpenVINO       {inv.openvino or 'not installed (' + install_extra('openvino') + ')'}")
    for device, full in inv.openvino_devices.items():
        lines.append(f"  {device:<9} {full}")
    for kind in ("GPU", "NPU"):
        if inv.openvino is not None and not inv.ov_has(kind):
            lines.append(f"  {kind:<9} not present")
    hw = {"nvidia-gpu": "NVIDIA GPU", "intel-gpu": "Intel GPU", "intel-npu": "Intel NPU"}
    lines.append("Hardware       " + "; ".join(
        f"{label}: {', '.join(inv.hardware.get(kind, [])) or 'none'}" for kind, label in hw.items())
        + ("" if inv.platform.startswith("linux") else " (PCI scan on Linux only)"))
    if inv.hardware.get("intel-npu") and inv.npu_driver is False:
        lines.append("               Intel NPU present but its driver is not loaded (no /dev/accel node)")
    verdicts: dict[str, dict] = {}
    lines.append(f"Bundles        {len(candidates)} visible (installed wheels, --bundles / $HIGGS_PACK_BUNDLES, "
                 "pulled hub repos)")
    for c in candidates:
        found, why_not = placements(c, inv, bench)
        where = ", ".join(f"{p.device} (preference {list(preference()).index(p.rung) + 1}: {p.why})" for p in found)
        verdict = f"runs here on {where}" if found else f"cannot run here: {why_not}"
        verdicts[c.name] = {"source": c.source, "origin": c.origin, "model": c.model, "target": c.target,
                            "precision": c.precision, "variant": c.variant, "runs": bool(found),
                            "placements": [p.device for p in found], "why": verdict}
        variant = f" {c.variant}" if c.variant else ""
        lines.append(f"  {c.name}  [{c.target} {c.precision}{variant}; {c.origin}: {c.source}]")
        lines.append(f"      {verdict}")
    for folder, why in broken.items():
        lines.append(f"  {folder}: unreadable: {why}")
    choices: dict[str, dict] = {}
    for model in sorted({c.model for c in candidates}):
        choice = choose(candidates, inv, model=model, bench=bench)
        choices[model] = {"chosen": choice.chosen.candidate.name if choice.chosen else None,
                          "device": choice.chosen.device if choice.chosen else None,
                          "reason": choice.reason, "notes": choice.notes}
        lines.append(f"Model {model}: {choice.reason}")
        lines += [f"  note: {n}" for n in choice.notes]
    if not candidates:
        notes = choose([], inv).notes
        lines += [f"note: {n}" for n in notes]
    data = {"inventory": {"cpu": inv.cpu, "cpu_vendor": inv.cpu_vendor, "platform": inv.platform,
                          "ort_distributions": list(inv.ort_distributions),
                          "ort_providers": dict(inv.ort_providers), "openvino": inv.openvino,
                          "openvino_devices": dict(inv.openvino_devices), "hardware": dict(inv.hardware),
                          "npu_driver": inv.npu_driver},
            "bundles": verdicts, "broken": broken, "choices": choices}
    return "\n".join(lines), data

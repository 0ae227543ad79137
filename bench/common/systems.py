"""What a run measures (system names, defaults, goals) and what every room shares: the machine,
memory and CPU readings, per-key medians, text tables and the worker processes."""

from __future__ import annotations

import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The checkout (``bench`` is not in the wheel): children get it first on ``PYTHONPATH``.
ROOT = Path(__file__).resolve().parents[2]

PYTORCH = "pytorch"
PRESETS = ("tiny", "bench", "full")
LLAMA_CPP = "llama.cpp"
#: The ``kind`` of the decoder-step records (ours beside llama.cpp).
STEP_KIND = "decoder_step"
#: Quant name -> llama.cpp's ``LLAMA_FTYPE_MOSTLY_*`` (Q4_0 = 2, Q4_K_M = 15).
QUANTS = {"q4_0": 2, "q4_k_m": 15}


@dataclass(frozen=True)
class SystemSpec:
    """One thing to measure: its label, target (None: PyTorch), precision, variant, ``@device``
    and an already built bundle (None: built or reused in the cache)."""

    label: str
    target: str | None = None
    precision: str | None = None
    variant: str | None = None
    device: str | None = None
    bundle: Path | None = None

    @property
    def is_pytorch(self) -> bool:
        return self.target is None and self.bundle is None

    @property
    def is_llama_cpp(self) -> bool:
        return self.target == LLAMA_CPP


def parse_quant(name: str) -> str:
    """``q4_0`` / ``q4_k_m`` from a quant name in any case; InputError for another."""
    key = name.strip().lower().replace("-", "_")
    if key not in QUANTS:
        from higgs_pack.errors import InputError

        raise InputError(f"unknown llama.cpp quant {name!r}; known: {', '.join(QUANTS)}")
    return key


def parse_system(text: str) -> SystemSpec:
    """``pytorch``, ``llama.cpp-<quant>`` or ``<target>[-<precision>[-<variant>]][@<device>]``,
    checked by the build planner (BuildPlanError names the known ones)."""
    text = text.strip()
    if text.lower() == PYTORCH:
        return SystemSpec(label=PYTORCH, precision="fp32")
    if text.lower().startswith(LLAMA_CPP + "-"):
        quant = parse_quant(text[len(LLAMA_CPP) + 1:])
        return SystemSpec(label=f"{LLAMA_CPP}-{quant}", target=LLAMA_CPP, precision=quant)
    from higgs_pack.errors import BuildPlanError
    from higgs_pack.targets.plan import make_plan

    base, _, device = text.partition("@")
    target, *rest = base.split("-")
    plan = make_plan(target, *[*rest, None, None][:2])
    if len(rest) > 2:
        raise BuildPlanError(f"system {text!r}: expected <target>[-<precision>[-<variant>]][@<device>]")
    label = "-".join(p for p in (plan.target.name, plan.precision, plan.variant) if p)
    return SystemSpec(label + (f"@{device}" if device else ""), plan.target.name, plan.precision, plan.variant,
                      device or None)


def bundle_spec(path: str | Path) -> SystemSpec:
    """The system of a built bundle (``PATH[@device]``), labelled ``<target>-<precision>[-<variant>]``
    plus ``-kv-<cache>`` for a quantized KV cache."""
    from higgs_pack.manifests.manifest import read_manifest

    text, device = str(path), None
    if "@" in Path(text).name:
        text, _, device = text.rpartition("@")
    m = read_manifest(Path(text))
    label = "-".join(p for p in (m["target"], m["precision"], m.get("variant")) if p)
    if m.get("kv_cache", "float") != "float":
        label += f"-kv-{m['kv_cache']}"
    return SystemSpec(label + (f"@{device}" if device else ""), m["target"], m["precision"], m.get("variant"),
                      device, Path(text))


def rss_mb(pid: int | str = "self") -> float | None:
    """Resident memory (``VmRSS``) of a process, MiB; None when unreadable."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            return next(int(line.split()[1]) / 1024 for line in f if line.startswith("VmRSS:"))
    except (OSError, ValueError, StopIteration):
        return None


def peak_rss_mb() -> float:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def cpu_s(pid: int | None = None) -> float | None:
    """CPU seconds (user + system, all threads) of process ``pid`` (None: this one)."""
    if pid is None:
        import resource

        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


def loadavg() -> list[float]:
    """The 1, 5 and 15 minute load averages (empty where the OS has none): other work skews timings."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except (AttributeError, OSError):
        return []


def load_1m() -> float | None:
    return (loadavg() or [None])[0]


def machine() -> dict[str, Any]:
    """What every record says of the machine: CPU model, logical CPUs, Python, ISA, last-level cache,
    and ``isa_ceiling``, oneDNN's ``ONEDNN_MAX_CPU_ISA`` where it is set (OpenVINO's CPU kernels then use
    no instructions above it, e.g. ``AVX512_CORE_BF16``: no AMX; CPUID still shows the host's flags)."""
    from higgs_pack.runtime.machine.cpu import cpu_info

    cpu = cpu_info()
    out = {"cpu": cpu.model, "cores": cpu.logical_cpus, "python": platform.python_version(), "isa": cpu.isa,
           "llc_bytes": cpu.llc_bytes, "llc_level": cpu.llc_level}
    if os.environ.get("ONEDNN_MAX_CPU_ISA"):
        out["isa_ceiling"] = os.environ["ONEDNN_MAX_CPU_ISA"]
    return out


def machine_line(m: dict[str, Any]) -> str:
    isa = m.get("isa") or {}
    llc = f", {m['llc_bytes'] / 2**20:g} MiB L{m.get('llc_level', '?')} cache" if m.get("llc_bytes") else ""
    ceiling = f", kernels capped at {m['isa_ceiling']}" if m.get("isa_ceiling") else ""
    return (f"machine: {m.get('cpu')}, {m.get('cores')} logical CPUs, {' '.join(isa.get('flags', [])) or 'no ISA flags'}"
            f" (AVX-512 {'yes' if isa.get('avx512') else 'no'}, VNNI {'yes' if isa.get('vnni') else 'no'}){llc}{ceiling}")


def ov_cache_dir(cache: Path, bundle: Path, spec: SystemSpec) -> Path:
    """The OpenVINO model cache of one system's bundle (and device) in the bench's cache."""
    return cache / "bench" / "ov-cache" / f"{bundle.name}{'@' + spec.device if spec.device else ''}"


def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per key over runs: numbers the median (the value when all equal), booleans all(), dicts
    per key, anything else the value when all equal, else the list."""
    out: dict[str, Any] = {}
    for key, first in runs[0].items():
        values = [r.get(key) for r in runs]
        if isinstance(first, bool):
            out[key] = all(values)
        elif isinstance(first, dict):
            out[key] = median_of([v for v in values if isinstance(v, dict)])
        elif all(v == first for v in values):
            out[key] = first
        elif all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values):
            out[key] = statistics.median(values)
        else:
            out[key] = values
    return out


def table(title: str, headers: list[str], rows: list[list[str]]) -> str:
    """A plain text table, cells right-aligned."""
    widths = [max([len(h), *(len(r[i]) for r in rows)]) for i, h in enumerate(headers)]
    return "\n".join([title, *("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True))
                               for r in [headers, *rows])]).lstrip("\n")


def markdown(headers: list[str], rows: list[list[Any]], facts: Sequence[str] = ()) -> str:
    """A Markdown table (None as ``-``, a ``|`` in a cell escaped), then ``facts`` as a list."""
    def line(cells: list[Any]) -> str:
        return "| " + " | ".join("-" if c is None else str(c).replace("|", "\\|") for c in cells) + " |"

    table = [line(headers), line(["---"] * len(headers)), *map(line, rows)]
    return "\n".join(table + ([""] + [f"- {f}" for f in facts] if facts else []))


def machine_facts() -> dict[str, Any]:
    """The CPU named in every ``python -m bench.ab`` report: description, model, ISA flags, logical CPUs."""
    from higgs_pack.runtime.machine.cpu import cpu_info

    cpu = cpu_info()
    return {"cpu": cpu.describe(), "model": cpu.model, "isa": cpu.isa, "logical_cpus": cpu.logical_cpus}


def print_report(report: dict[str, Any], head: str, text: str, out: Path | None) -> int:
    """An A/B tool's end: ``head`` and its table printed, the report written to ``out`` as JSON; 0."""
    print(f"{head}\n\n{text}")
    if out:
        out.write_text(json.dumps(report, indent=1) + "\n", encoding="utf-8")
    return 0


def child_env(**extra: str) -> dict[str, str]:
    """This environment with :data:`ROOT` first on ``PYTHONPATH``, plus ``extra``."""
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path, **extra}


class WorkerError(RuntimeError):
    """A worker subprocess failed; the message carries the tail of its output."""


#: Worker tasks -> the ``module:function`` that runs one in its own process.
WORKERS = {
    "measure": "bench.decoder.workers:worker_measure", "checkpoint": "bench.decoder.workers:worker_checkpoint",
    "build": "bench.decoder.workers:worker_build", "bandwidth": "bench.decoder.workers:worker_bandwidth",
    "batch": "bench.decoder.batch:measure_batches", "fit": "bench.decoder.batch:fit_run",
    "compile": "bench.decoder.batch:compile_engines",
    "gemm_peak": "bench.decoder.gemm:worker_gemm_peak", "our_steps": "bench.decoder.steps:measure_our_steps",
    "llama_steps": "bench.decoder.steps:measure_llama_steps",
}


def spawn(task: str, spec: dict[str, Any], *, cache: Path, stream: bool = False,
          timeout: float | None = None) -> dict[str, Any]:
    """Run one :data:`WORKERS` task in a fresh interpreter (its own peak RSS, ``HIGGS_PACK_CACHE=cache``)
    and return its JSON result; WorkerError when it fails."""
    with tempfile.TemporaryDirectory(prefix="higgs-pack-bench-") as tmp:
        spec = {**spec, "task": task, "result": str(Path(tmp) / "result.json")}
        (Path(tmp) / "spec.json").write_text(json.dumps(spec, default=str))
        out: Any = subprocess.PIPE
        if stream:  # builds show their progress on our stderr
            try:
                out = sys.stderr.fileno()
            except (AttributeError, OSError, ValueError):
                out = subprocess.PIPE
        proc = subprocess.run([sys.executable, "-m", "bench", "--worker", str(Path(tmp) / "spec.json")],
                              stdout=out, stderr=subprocess.STDOUT, text=True, timeout=timeout, check=False,
                              env=child_env(HIGGS_PACK_CACHE=str(cache)))
        result = Path(spec["result"])
        if proc.returncode != 0 or not result.is_file():
            tail = "\n".join((proc.stdout or "").strip().splitlines()[-25:])
            raise WorkerError(f"{task} worker exited with {proc.returncode}" + (f":\n{tail}" if tail else ""))
        return json.loads(result.read_text())


def run_worker(spec_file: str) -> int:
    """``--worker SPEC.json``: run the task, write its JSON result to ``spec["result"]``."""
    spec = json.loads(Path(spec_file).read_text())
    module, _, function = WORKERS[spec["task"]].partition(":")
    result = getattr(importlib.import_module(module), function)(spec)
    Path(spec["result"]).write_text(json.dumps(result))
    return 0

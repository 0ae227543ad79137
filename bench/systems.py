"""What a benchmark run measures: system names (``pytorch``, ``<target>-<precision>[-<variant>][@<device>]``)
and the run's defaults and goals.
"""

from __future__ import annotations

import io
import json
import os
import platform
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The repository root: ``bench`` is a folder of the checkout, not part of the wheel, so every
#: child process that imports it gets this folder on its ``PYTHONPATH`` (:func:`child_env`).
ROOT = Path(__file__).resolve().parents[1]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment with :data:`ROOT` first on ``PYTHONPATH``, plus ``extra``."""
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    return {**os.environ, "PYTHONPATH": path, **extra}

#: Systems measured when ``--systems`` is not given.
DEFAULT_SYSTEMS: tuple[str, ...] = (
    "pytorch", "cpu-int4", "cpu-fp32", "openvino-int4", "openvino-int8", "openvino-fp32",
)
#: Checkpoint presets (``higgs_pack.exporters.checkpoint.tiny.PRESETS``).
PRESETS: tuple[str, ...] = ("tiny", "bench", "full")
#: The text every system speaks (the frame count is fixed; the text only sets the prompt).
BENCH_TEXT = (
    "The quick brown fox jumps over the lazy dog, then runs back home before the evening rain."
)
DEFAULT_FRAMES = 100
#: Timed runs per system (median reported); the real-size preset defaults to one.
DEFAULT_REPEATS = {"tiny": 3, "bench": 3, "full": 1}
DEFAULT_BANDWIDTH_MIB = 1024
PYTORCH = "pytorch"

#: Context lengths (positions) at which the bare decoder's step is timed (``step_ms_ctx<N>``).
DEFAULT_CONTEXTS: tuple[int, ...] = (64, 900)
#: Timed decoder steps per context length and round (median over all rounds reported).
CONTEXT_STEPS = 8
#: Batch sizes of the decoder-step comparison with llama.cpp (``--step-batch``, issue 19).
DEFAULT_STEP_BATCHES: tuple[int, ...] = (1, 4)
#: Rounds over the context lengths, in turn: the full-size cpu int4 step drifted by up to 30%
#: between consecutive runs on a shared 2-core VM, which one block per length took for a
#: context effect (900/64 read 0.83x, 1.28x, 1.11x and 1.34x in four runs).
CONTEXT_ROUNDS = 3

#: Targets the runs are reported against (issues 2, 3 and 9).
GOAL_SPEEDUP_CPU_INT4 = 2.0
#: Heads, embed, sampling and Python: share of a decode step (issue 9 item 4; was 15 %).
GOAL_OUTSIDE_DECODER = 0.05
GOAL_WARM_LOAD_S = 1.0
#: The loop's time per frame over the bare decoder's (``loop_over_decoder``), at most.
GOAL_LOOP_OVER_DECODER = 1.1
#: First streamed audio within this factor of prefill + the first chunk's steps and codec decode.
GOAL_FIRST_AUDIO = 1.1
#: Full preset: the decoder step at the long context over the short one (``step_ms_ctx900 /
#: step_ms_ctx64``), at most.
GOAL_LONG_CONTEXT_STEP = 1.15
#: Full preset: the bare decoder's share of its memory-bandwidth roofline, at least.
GOAL_ROOFLINE = 0.9
#: Issue 19 (``--batch``), judged at the full preset only: the engine's aggregate frames/s at
#: batch 4 and batch 8 over batch 1, at least.
GOAL_BATCH4_SPEEDUP = 3.0
GOAL_BATCH8_SPEEDUP = 5.0
#: The engine's step (each request's time per frame) at batch 4 over batch 1, at most.
GOAL_BATCH4_STEP = 1.35
#: The engine's step over its bare batched decoder's step at the same batch, at most (every size).
GOAL_ENGINE_OVER_BARE = 1.1
#: Streamed aggregate frames/s over plain, at least (every size).
GOAL_STREAM_OVER_PLAIN = 0.9
#: The memory and context the largest batch is computed for (``fit_max_batch``; not run).
FIT_MEMORY_BYTES = 12 * 2**30
FIT_POSITIONS = 2000

#: Presets whose sizes make the speed goals meaningful, and the one holding the full-size goals.
SIZED_PRESETS: tuple[str, ...] = ("bench", "full")
FULL_PRESET = "full"


@dataclass(frozen=True)
class SystemSpec:
    """One thing to measure.

    Attributes:
        label: how it is named in the table (``pytorch``, ``cpu-int4``, ``openvino-int4@GPU``).
        target: registered target name, or None for the PyTorch reference.
        precision: bundle precision (None: the target's default).
        variant: target variant (``npu``) or None.
        device: ``@…`` override: the execution provider of an ONNX Runtime bundle or the
            device of an OpenVINO bundle.
        bundle: an already built bundle directory (``--bundle``); None: build or reuse one
            in the cache.
    """

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
        return self.target == "llama.cpp"


#: System names of llama.cpp GGUFs (``llama.cpp-q4_0``, ``llama.cpp-q4_k_m``): timed in the
#: decoder-step comparison only (:mod:`~bench.decoder_steps`).
LLAMA_CPP = "llama.cpp"
LLAMA_CPP_PREFIX = LLAMA_CPP + "-"
#: Quant name -> llama.cpp's ``LLAMA_FTYPE_MOSTLY_*`` (llama.h: Q4_0 = 2, Q4_K_M = 15).
QUANTS: dict[str, int] = {"q4_0": 2, "q4_k_m": 15}


def parse_quant(name: str) -> str:
    """``q4_0`` / ``q4_k_m`` (any case) from a quant name.

    Raises:
        InputError: an unknown quant, with the known ones.
    """
    key = name.strip().lower().replace("-", "_")
    if key not in QUANTS:
        from higgs_pack.manifests.errors import InputError

        raise InputError(f"unknown llama.cpp quant {name!r}; known: {', '.join(QUANTS)} "
                         f"(systems {', '.join(LLAMA_CPP_PREFIX + q for q in QUANTS)})")
    return key


def parse_system(text: str) -> SystemSpec:
    """Parse ``pytorch``, ``llama.cpp-<quant>`` or ``<target>[-<precision>[-<variant>]][@<device>]``.

    The target/precision/variant triple is validated with the build planner, so an unknown
    name fails at once with the known ones listed.

    Raises:
        BuildPlanError: unknown target, precision or variant.
        InputError: an unknown llama.cpp quant.
    """
    text = text.strip()
    if text.lower() == PYTORCH:
        return SystemSpec(label=PYTORCH, precision="fp32")
    if text.lower().startswith(LLAMA_CPP_PREFIX):
        quant = parse_quant(text[len(LLAMA_CPP_PREFIX):])
        return SystemSpec(label=f"{LLAMA_CPP}-{quant}", target=LLAMA_CPP, precision=quant)
    base, _, device = text.partition("@")
    target, *rest = base.split("-")
    precision = rest[0] if rest else None
    variant = rest[1] if len(rest) > 1 else None
    from higgs_pack.targets.plan import make_plan

    plan = make_plan(target, precision, variant)
    if len(rest) > 2:
        from higgs_pack.manifests.errors import BuildPlanError

        raise BuildPlanError(f"system {text!r}: expected <target>[-<precision>[-<variant>]][@<device>]")
    label = "-".join(p for p in (plan.target.name, plan.precision, plan.variant) if p)
    return SystemSpec(label=label + (f"@{device}" if device else ""), target=plan.target.name,
                      precision=plan.precision, variant=plan.variant, device=device or None)


def bundle_spec(path: str | Path) -> SystemSpec:
    """A system for an existing bundle directory (``--bundle PATH[@device]``); its label is
    ``<target>-<precision>[-<variant>][-kv-<kv cache>]`` (the KV cache only when quantized)."""
    text = str(path)
    device = None
    if "@" in Path(text).name:
        text, _, device = text.rpartition("@")
    from higgs_pack.manifests.manifest import read_manifest

    m = read_manifest(Path(text))
    label = "-".join(p for p in (m["target"], m["precision"], m.get("variant")) if p)
    if m.get("kv_cache", "float") != "float":  # a quantized KV cache (build --kv-cache int8): its own system
        label += f"-kv-{m['kv_cache']}"
    return SystemSpec(label=label + (f"@{device}" if device else ""), target=m["target"],
                      precision=m["precision"], variant=m.get("variant"), device=device,
                      bundle=Path(text))


def rss_now_mb() -> float | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def peak_rss_mb() -> float:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


def load_average() -> float | None:
    """The 1-minute load average (None where the OS has none): other work skews timings."""
    try:
        return round(os.getloadavg()[0], 2)
    except (AttributeError, OSError):
        return None


def machine() -> dict[str, Any]:
    """What every record says of the machine: CPU model, logical CPUs, Python, ISA, last-level cache."""
    from higgs_pack.runtime.machine.cpu import cpu_info

    cpu = cpu_info()
    return {"cpu": cpu.model, "cores": cpu.logical_cpus, "python": platform.python_version(), "isa": cpu.isa,
            "llc_bytes": cpu.llc_bytes, "llc_level": cpu.llc_level}


def ov_cache_dir(cache: Path, bundle: Path, spec: SystemSpec) -> Path:
    """The OpenVINO model cache of one system's bundle (and device) in the bench's cache."""
    return cache / "bench" / "ov-cache" / f"{bundle.name}{'@' + spec.device if spec.device else ''}"


def table(title: str, headers: list[str], rows: list[list[str]]) -> str:
    """A text table (rich when installed, else plain text), first column left-aligned."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
        lines = [title, "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        return "\n".join(lines)
    rich = Table(title=title)
    for i, h in enumerate(headers):
        rich.add_column(h, justify="left" if i == 0 else "right")
    for r in rows:
        rich.add_row(*r)
    buffer = io.StringIO()
    Console(file=buffer, width=200, color_system=None).print(rich)
    return buffer.getvalue().rstrip("\n")


class WorkerError(RuntimeError):
    """A worker subprocess failed; the message carries the tail of its output."""


def spawn(task: str, spec: dict[str, Any], *, cache: Path, stream: bool = False,
           timeout: float | None = None) -> dict[str, Any]:
    """Run one worker in a fresh interpreter (its own peak RSS) and return its JSON result.

    The worker sees ``HIGGS_PACK_CACHE=cache``, so checkpoints, bundles and OpenVINO model
    caches land where the parent looks for them.
    """
    with tempfile.TemporaryDirectory(prefix="higgs-pack-bench-") as tmp:
        spec = {**spec, "task": task, "result": str(Path(tmp) / "result.json")}
        spec_file = Path(tmp) / "spec.json"
        spec_file.write_text(json.dumps(spec, default=str))
        cmd = [sys.executable, "-m", "bench", "--worker", str(spec_file)]  # bench.workers.run_worker
        out: Any = subprocess.PIPE
        if stream:  # long tasks (builds) show their progress on our stderr, not our stdout
            try:
                out = sys.stderr.fileno()
            except (AttributeError, OSError, io.UnsupportedOperation):
                out = subprocess.PIPE
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout, check=False,
                              env=child_env(HIGGS_PACK_CACHE=str(cache)))
        result_file = Path(spec["result"])
        if proc.returncode != 0 or not result_file.is_file():
            tail = "\n".join((proc.stdout or "").strip().splitlines()[-25:])
            raise WorkerError(f"{task} worker exited with {proc.returncode}" + (f":\n{tail}" if tail else ""))
        return json.loads(result_file.read_text())

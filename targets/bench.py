"""Benchmark the PyTorch reference and built bundles side by side (``nox -s bench``).

``python -m higgs_pack.targets.bench [--preset tiny|bench|full] [--systems pytorch,cpu-int4,…]
[--frames N] [--out dist/bench.json]``

One run measures every system with the same text, the same fixed frame count and the same
sampling (temperature 0.8, top-k 50, seed 0, repeat guard off, EOC suppressed so that every
system generates exactly ``--frames`` frames), after one warm-up run:

``frames_per_s``
    decode steps per second of the generation loop (prefill excluded): each step is audio
    embed + decoder + audio heads + sampling for one frame.
``first_frame_ms``
    prompt embedding + prefill + the first sampled frame.
``rtf``
    real-time factor: wall time (prompt, loop, codec decode) / seconds of audio.
``peak_rss_mb``
    peak resident memory of the process that ran the system (each system runs in its own
    subprocess of this module: ``--worker``).
``bundle_mb``
    sum of the manifest's file sizes (PyTorch: the checkpoint's files).
``outside_decoder_frac``
    share of a decode step spent outside ``decoder.forward`` (heads, sampling, embedding,
    Python), with the per-step breakdown in ``step_ms``.
``load_s`` / ``load_warm_s``
    model load time; OpenVINO bundles are loaded once with an empty model cache (``load_s``,
    in its own process) and then with the cache filled (``load_warm_s``, the measuring process).
``bandwidth_gbps``, ``roofline_frac``
    the machine's memory read bandwidth measured in the same run (numpy, a 1 GiB buffer,
    best of several, all cores) and the decoder's fraction of the bandwidth roofline:
    (decoder weight bytes read per frame / bandwidth) / measured time per frame.

Checkpoints come from ``higgs-pack make-tiny-checkpoint --preset …`` (cached under
``$HIGGS_PACK_CACHE/checkpoints``); bundles are built with
:func:`higgs_pack.targets.build.build` into ``$HIGGS_PACK_CACHE/bundles/`` and reused while
they are valid and newer than the checkpoint (``--rebuild`` forces a build). Records are
generic: ``system``/``precision``/``variant`` come from the bundle manifest, so a new target
adds records by being named in ``--systems``.
"""

from __future__ import annotations

import argparse
import importlib
import io
import itertools
import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from higgs_pack.exporters.result import tool_versions

#: Systems measured when ``--systems`` is not given.
DEFAULT_SYSTEMS: tuple[str, ...] = (
    "pytorch", "cpu-int4", "cpu-fp32", "openvino-int4", "openvino-int8", "openvino-fp32",
)
#: Checkpoint presets (``higgs_pack.exporters.tiny.PRESETS``).
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

#: Targets the runs are reported against (issues 2 and 3).
GOAL_SPEEDUP_CPU_INT4 = 2.0
GOAL_OUTSIDE_DECODER = 0.15
GOAL_WARM_LOAD_S = 1.0


# ----------------------------------------------------------------------------- systems


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


def parse_system(text: str) -> SystemSpec:
    """Parse ``pytorch`` or ``<target>[-<precision>[-<variant>]][@<device>]``.

    The target/precision/variant triple is validated with the build planner, so an unknown
    name fails at once with the known ones listed.

    Raises:
        BuildPlanError: unknown target, precision or variant.
    """
    text = text.strip()
    if text.lower() == PYTORCH:
        return SystemSpec(label=PYTORCH, precision="fp32")
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
    """A system for an existing bundle directory (``--bundle PATH[@device]``)."""
    text = str(path)
    device = None
    if "@" in Path(text).name:
        text, _, device = text.rpartition("@")
    from higgs_pack.manifests.manifest import read_manifest

    m = read_manifest(Path(text))
    label = "-".join(p for p in (m["target"], m["precision"], m.get("variant")) if p)
    return SystemSpec(label=label + (f"@{device}" if device else ""), target=m["target"],
                      precision=m["precision"], variant=m.get("variant"), device=device,
                      bundle=Path(text))


# ----------------------------------------------------------------------------- workers


def _rss_now_mb() -> float | None:
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _peak_rss_mb() -> float:
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 1024


class _TimedRunner:
    """Wraps a ``SubPartRunner`` and records the seconds of every ``run``."""

    def __init__(self, inner: Any, log: list[float], after: Callable[[dict], dict] | None = None):
        self.inner, self.log, self.after = inner, log, after

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        t = time.perf_counter()
        out = self.inner.run(feeds)
        if self.after is not None:
            out = self.after(out)
        self.log.append(time.perf_counter() - t)
        return out


class _TimedDecoder:
    """Wraps a ``Decoder`` and records the seconds of every ``forward``."""

    def __init__(self, inner: Any, log: list[float]):
        self.inner, self.log = inner, log

    @property
    def max_length(self) -> int:
        return self.inner.max_length

    def reset(self) -> None:
        self.inner.reset()

    def forward(self, inputs_embeds: np.ndarray) -> np.ndarray:
        t = time.perf_counter()
        out = self.inner.forward(inputs_embeds)
        self.log.append(time.perf_counter() - t)
        return out


def _instrument(pipeline: Any) -> dict[str, list[float]]:
    """Time the sub-parts of ``pipeline`` in place; suppress EOC so the frame count is fixed.

    The EOC logit of codebook 0 is set to a large negative finite value (not -inf: the loop
    rejects non-finite logits), which keeps the random bench models from stopping early.
    """
    logs: dict[str, list[float]] = {"decoder": [], "heads": [], "embed": [], "text_embed": []}
    eoc = pipeline.constants.eoc

    def no_eoc(out: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        logits = out["audio_logits"]
        if not logits.flags.writeable:
            logits = logits.copy()
        logits[..., 0, eoc] = -1e30
        return {**out, "audio_logits": logits}

    pipeline.decoder = _TimedDecoder(pipeline.decoder, logs["decoder"])
    pipeline.audio_heads = _TimedRunner(pipeline.audio_heads, logs["heads"], no_eoc)
    pipeline.audio_embed = _TimedRunner(pipeline.audio_embed, logs["embed"])
    pipeline.text_embed = _TimedRunner(pipeline.text_embed, logs["text_embed"])
    return logs


def _one_run(pipeline: Any, logs: dict[str, list[float]], text: str, frames: int,
             options: Any) -> dict[str, Any]:
    """One prompt -> loop -> codec decode, with per-step timestamps."""
    from higgs_pack.runtime.generate import build_prompt, decode_codes, generate_codes

    for log in logs.values():
        log.clear()
    marks: list[float] = []
    t_start = time.perf_counter()
    embeds = build_prompt(pipeline, text)
    result = generate_codes(pipeline, embeds, options, frames,
                            progress=lambda done, cap: marks.append(time.perf_counter()))
    t_gen = time.perf_counter()
    samples = decode_codes(pipeline, result.codes)
    t_end = time.perf_counter()
    n = pipeline.constants.num_codebooks
    steps = len(marks)
    if result.stop_reason != "max_frames" or result.codes.shape[0] != frames:
        raise RuntimeError(f"expected {frames} frames at the cap, got {result.codes.shape[0]} "
                           f"({result.stop_reason})")
    decode_s = marks[-1] - marks[0]
    dec = logs["decoder"]
    # decoder calls: prefill + one per later step; embed calls: one per later step;
    # heads calls: one per step (the first belongs to the prefill frame).
    per_step = {
        "decoder": sum(dec[1:]),
        "heads": sum(logs["heads"][1:]),
        "embed": sum(logs["embed"]),
    }
    per_step["other"] = decode_s - sum(per_step.values())
    audio_s = len(samples) / pipeline.constants.sample_rate
    return {
        "steps": steps,
        "frames": int(result.codes.shape[0]),
        "prompt_length": int(result.prompt_length),
        "frames_per_s": (steps - 1) / decode_s,
        "first_frame_ms": (marks[0] - t_start) * 1e3,
        "first_full_frame_ms": (marks[min(n, steps) - 1] - t_start) * 1e3,
        "prefill_ms": dec[0] * 1e3,
        "prompt_embed_ms": sum(logs["text_embed"]) * 1e3,
        "outside_decoder_frac": 1.0 - per_step["decoder"] / decode_s,
        "step_ms": {k: v / (steps - 1) * 1e3 for k, v in per_step.items()},
        "loop_s": result.seconds,
        "codec_s": t_end - t_gen,
        "wall_s": t_end - t_start,
        "audio_s": audio_s,
        "rtf": (t_end - t_start) / audio_s,
    }


def _median_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-metric median over runs (nested ``step_ms`` too), plus the frames/s spread."""
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        if isinstance(value, dict):
            out[key] = {k: statistics.median(r[key][k] for r in runs) for k in value}
        elif isinstance(value, float):
            out[key] = statistics.median(r[key] for r in runs)
        else:
            out[key] = value
    fps = [r["frames_per_s"] for r in runs]
    out["frames_per_s_min"], out["frames_per_s_max"] = min(fps), max(fps)
    out["repeats"] = len(runs)
    return out


def _load_bundle(spec: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Open (validate, hash) and load a bundle; returns the pipeline and timings."""
    from higgs_pack.runtime.bundle import load, open_bundle

    backend = spec["backend"]
    t0 = time.perf_counter()  # imports are reported apart: they are not model loading
    modules = ["higgs_pack.runtime.openvino_backend"] if backend == "openvino" else [
        "onnxruntime", "higgs_pack.runtime.ort_backend"]
    for module in ("tokenizers", *modules):
        importlib.import_module(module)
    import_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    opened = open_bundle(spec["bundle"])
    t1 = time.perf_counter()
    kwargs: dict[str, Any] = {}
    if spec.get("device"):
        kwargs["device" if backend == "openvino" else "execution_provider"] = spec["device"]
    if backend == "openvino":
        kwargs["cache_dir"] = spec["ov_cache"]
    pipeline = load(opened, **kwargs)
    t2 = time.perf_counter()
    info = {"load_s": t2 - t0, "validate_s": t1 - t0, "import_s": import_s,
            "description": dict(pipeline.description),
            "versions": tool_versions("onnxruntime", "openvino")}
    return pipeline, info


def _load_pytorch(spec: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    t0 = time.perf_counter()
    import torch
    import transformers

    from higgs_pack.exporters.checkpoint import open_checkpoint
    from higgs_pack.exporters.reference import reference_pipeline

    for name in ("Qwen3Model", "HiggsAudioV2TokenizerModel", "DynamicCache"):
        getattr(transformers, name, None)  # transformers imports these lazily (seconds)
    import_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ckpt = open_checkpoint(spec["checkpoint"])
    pipeline = reference_pipeline(ckpt, with_encoder=False)
    load_s = time.perf_counter() - t0
    decoder = pipeline.decoder.model
    decoder_bytes = sum(p.numel() * p.element_size() for n, p in decoder.named_parameters()
                        if "embed_tokens" not in n)
    info = {"load_s": load_s, "import_s": import_s, "decoder_weight_bytes": int(decoder_bytes),
            "torch_threads": torch.get_num_threads(),
            "versions": tool_versions("torch", "transformers")}
    return pipeline, info


def worker_measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Measure one system in this process (run as ``--worker``): load, warm up, timed runs."""
    from higgs_pack.runtime.delay import SamplingOptions

    loadavg = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    pipeline, info = (_load_pytorch if spec["kind"] == PYTORCH else _load_bundle)(spec)
    info["rss_after_load_mb"] = _rss_now_mb()
    if spec.get("load_only"):
        info["peak_rss_mb"] = _peak_rss_mb()
        return info
    logs = _instrument(pipeline)
    options = SamplingOptions(temperature=spec["temperature"], top_k=spec["top_k"], top_p=1.0,
                              seed=spec["seed"], repeat_guard_frames=0)
    for _ in range(spec["warmup"]):
        _one_run(pipeline, logs, spec["text"], spec["frames"], options)
    runs = [_one_run(pipeline, logs, spec["text"], spec["frames"], options)
            for _ in range(spec["repeats"])]
    # the 1-minute load average before and after: other work on the machine skews timings
    after = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {**info, **_median_runs(runs), "peak_rss_mb": _peak_rss_mb(), "loadavg_1m": [loadavg, after]}


def worker_checkpoint(spec: dict[str, Any]) -> dict[str, Any]:
    from higgs_pack.targets.build import default_checkpoint

    t0 = time.perf_counter()
    path = default_checkpoint(spec["preset"], spec["seed"])
    return {"checkpoint": str(path), "seconds": time.perf_counter() - t0, "peak_rss_mb": _peak_rss_mb()}


def worker_build(spec: dict[str, Any]) -> dict[str, Any]:
    from higgs_pack.targets.build import build

    t0 = time.perf_counter()
    out = build(spec["target"], precision=spec["precision"], model=spec["checkpoint"],
                out=spec["out"], variant=spec["variant"], force=True,
                progress=lambda msg: print(f"  [build {spec['label']}] {msg}", file=sys.stderr, flush=True))
    return {"bundle": str(out), "seconds": time.perf_counter() - t0, "peak_rss_mb": _peak_rss_mb()}


def measure_bandwidth(mib: int = DEFAULT_BANDWIDTH_MIB, repeats: int = 5,
                      threads: int | None = None) -> dict[str, float]:
    """Memory bandwidth with numpy over a buffer far larger than the caches.

    Read: a float64 sum over the buffer (split across ``threads``, numpy releases the GIL);
    copy: ``copyto`` into a second buffer, counted as bytes read + written. Best of ``repeats``.

    Returns:
        ``bandwidth_gbps`` (the best read rate, used for the roofline), ``bandwidth_read_gbps``
        (read, all threads), ``bandwidth_read_1t_gbps`` (read, one thread),
        ``bandwidth_copy_gbps`` (copy, all threads), ``bandwidth_buffer_mib``,
        ``bandwidth_threads``; GB = 1e9 bytes.
    """
    threads = threads or os.cpu_count() or 1
    n = mib * 2**20 // 8
    src = np.ones(n, dtype=np.float64)
    dst = np.zeros(n, dtype=np.float64)
    bounds = np.linspace(0, n, threads + 1, dtype=np.int64)
    parts = [slice(int(a), int(b)) for a, b in itertools.pairwise(bounds)]

    def best(fn: Callable[[], Any], nbytes: int) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return nbytes / min(times) / 1e9

    with ThreadPoolExecutor(threads) as pool:
        read = best(lambda: list(pool.map(lambda s: src[s].sum(), parts)), src.nbytes)
        copy = best(lambda: list(pool.map(lambda s: np.copyto(dst[s], src[s]), parts)), 2 * src.nbytes)
    read_1t = best(lambda: src.sum(), src.nbytes)
    # the roofline uses the best read rate: on a busy machine one thread can beat two
    return {"bandwidth_gbps": max(read, read_1t), "bandwidth_read_gbps": read,
            "bandwidth_read_1t_gbps": read_1t, "bandwidth_copy_gbps": copy,
            "bandwidth_buffer_mib": mib, "bandwidth_threads": threads}


def worker_bandwidth(spec: dict[str, Any]) -> dict[str, Any]:
    return measure_bandwidth(spec["mib"])


WORKERS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "measure": worker_measure, "checkpoint": worker_checkpoint, "build": worker_build,
    "bandwidth": worker_bandwidth,
}


def run_worker(spec_file: str) -> int:
    """Entry of ``--worker SPEC.json``: run the task, write its JSON result to ``spec["result"]``."""
    spec = json.loads(Path(spec_file).read_text())
    result = WORKERS[spec["task"]](spec)
    Path(spec["result"]).write_text(json.dumps(result))
    return 0


class WorkerError(RuntimeError):
    """A worker subprocess failed; the message carries the tail of its output."""


def _spawn(task: str, spec: dict[str, Any], *, cache: Path, stream: bool = False,
           timeout: float | None = None) -> dict[str, Any]:
    """Run one worker in a fresh interpreter (its own peak RSS) and return its JSON result.

    The worker sees ``HIGGS_PACK_CACHE=cache``, so checkpoints, bundles and OpenVINO model
    caches land where the parent looks for them.
    """
    with tempfile.TemporaryDirectory(prefix="higgs-pack-bench-") as tmp:
        spec = {**spec, "task": task, "result": str(Path(tmp) / "result.json")}
        spec_file = Path(tmp) / "spec.json"
        spec_file.write_text(json.dumps(spec, default=str))
        cmd = [sys.executable, "-m", "higgs_pack.targets.bench", "--worker", str(spec_file)]
        out: Any = subprocess.PIPE
        if stream:  # long tasks (builds) show their progress on our stderr, not our stdout
            try:
                out = sys.stderr.fileno()
            except (AttributeError, OSError, io.UnsupportedOperation):
                out = subprocess.PIPE
        proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout, check=False,
                              env={**os.environ, "HIGGS_PACK_CACHE": str(cache)})
        result_file = Path(spec["result"])
        if proc.returncode != 0 or not result_file.is_file():
            tail = "\n".join((proc.stdout or "").strip().splitlines()[-25:])
            raise WorkerError(f"{task} worker exited with {proc.returncode}" + (f":\n{tail}" if tail else ""))
        return json.loads(result_file.read_text())


# ----------------------------------------------------------------------------- orchestration


@dataclass
class BenchOptions:
    """What one benchmark run measures (the command-line flags)."""

    preset: str = "bench"
    systems: tuple[str, ...] = DEFAULT_SYSTEMS
    bundles: tuple[str, ...] = ()
    frames: int = DEFAULT_FRAMES
    repeats: int | None = None
    rounds: int = 1
    warmup: int = 1
    seed: int = 0
    temperature: float = 0.8
    top_k: int = 50
    text: str = BENCH_TEXT
    checkpoint: str | None = None
    cache: str | None = None
    rebuild: bool = False
    bandwidth_mib: int = DEFAULT_BANDWIDTH_MIB
    out: str | None = "dist/bench.json"
    append: bool = False
    timeout: float | None = None
    quiet: bool = False


def _cache(options: BenchOptions) -> Path:
    from higgs_pack.runtime.paths import cache_root

    return Path(options.cache) if options.cache else cache_root()


def _say(options: BenchOptions, msg: str) -> None:
    if not options.quiet:
        print(msg, file=sys.stderr, flush=True)


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _reusable(bundle: Path, checkpoint: Path) -> bool:
    """A cached bundle is reused if it opens (manifest, sizes, paths), names this checkpoint as
    its source and is newer than it."""
    from higgs_pack.manifests.errors import HiggsPackError
    from higgs_pack.runtime.bundle import open_bundle

    if not (bundle / "manifest.json").is_file():
        return False
    try:
        m = open_bundle(bundle, check_hashes=False).manifest
    except HiggsPackError:
        return False
    source = m["build"].get("checkpoint_source")
    if source is None or Path(source).resolve() != checkpoint.resolve():
        return False
    return (bundle / "manifest.json").stat().st_mtime >= (checkpoint / "config.json").stat().st_mtime


def _subpart_weight_bytes(manifest: dict[str, Any], part: str) -> int:
    """Bytes of a sub-part's weight files (ONNX external data / OpenVINO .bin, else the graph)."""
    sizes = {f["path"]: f["size"] for f in manifest["files"]}
    files = [f for f in manifest["subparts"][part]["files"] if not f.endswith(".json")]
    weights = [f for f in files if f.endswith((".data", ".bin"))] or files
    return sum(sizes[f] for f in weights)


def base_record(manifest: dict[str, Any] | None, spec: SystemSpec, preset: str) -> dict[str, Any]:
    """The identifying part of a record, from the bundle manifest (PyTorch: fixed)."""
    if manifest is None:
        return {"system": PYTORCH, "precision": "fp32", "label": spec.label, "preset": preset,
                "backend": "torch", "device": "cpu"}
    device = spec.device or manifest.get("device") or manifest.get("execution_provider")
    return {
        "system": manifest["target"], "precision": manifest["precision"], "label": spec.label,
        "preset": preset, "variant": manifest.get("variant"), "backend": manifest["backend"],
        "device": device, "bundle": manifest["name"],
        "bundle_mb": sum(f["size"] for f in manifest["files"]) / 1e6,
        "decoder_weight_mb": _subpart_weight_bytes(manifest, "llm_decoder") / 1e6,
        "heads_weight_mb": _subpart_weight_bytes(manifest, "audio_heads") / 1e6,
    }


def _roofline(record: dict[str, Any], bandwidth: dict[str, float] | None) -> None:
    if not bandwidth or not record.get("frames_per_s") or not record.get("decoder_weight_mb"):
        return
    bw = bandwidth["bandwidth_gbps"] * 1e9
    min_s = record["decoder_weight_mb"] * 1e6 / bw
    record["roofline_min_frame_ms"] = min_s * 1e3
    record["roofline_frac"] = min_s * record["frames_per_s"]
    decoder_ms = record.get("step_ms", {}).get("decoder")
    if decoder_ms:
        record["roofline_frac_decoder"] = min_s * 1e3 / decoder_ms


def add_ratios(records: list[dict[str, Any]]) -> None:
    """Ratios between records of one preset: vs PyTorch, and vs the cpu bundle of the same
    precision (openvino-int4 vs cpu-int4, …)."""
    def fps(r):
        return r.get("frames_per_s") or None

    for preset in {r["preset"] for r in records}:
        same = [r for r in records if r["preset"] == preset and fps(r)]
        ref = next((r for r in same if r["system"] == PYTORCH), None)
        cpu = {r["precision"]: r for r in same if r["system"] == "cpu" and not r.get("variant")
               and r.get("device") in (None, "cpu")}
        for r in same:
            if ref is not None and r is not ref:
                r["speedup_vs_pytorch"] = r["frames_per_s"] / ref["frames_per_s"]
                r["rtf_vs_pytorch"] = r["rtf"] / ref["rtf"]
                r["peak_rss_vs_pytorch"] = r["peak_rss_mb"] / ref["peak_rss_mb"]
            other = cpu.get(r["precision"])
            if other is not None and r is not other and r["system"] != PYTORCH:
                r["speedup_vs_cpu"] = r["frames_per_s"] / other["frames_per_s"]
                r["vs_cpu"] = other["label"]


def goal_checks(records: list[dict[str, Any]]) -> list[tuple[str, bool, str]]:
    """The issues' targets met or missed by ``records``, as ``(goal, met, numbers)``.

    Speed goals are judged on the ``bench`` and ``full`` presets (the tiny model's decoder is
    too small for them to mean anything), the warm-load goal on ``tiny``; goals whose
    systems were not measured are left out.
    """
    sized = [r for r in records if r.get("preset") != "tiny" and r.get("frames_per_s")]

    def find(system, precision):
        return next((r for r in sized if r["system"] == system and r["precision"] == precision
                     and not r.get("variant") and r.get("device") in ("cpu", "CPU")), None)

    checks: list[tuple[str, bool | None, str]] = []
    cpu4, ov4 = find("cpu", "int4"), find("openvino", "int4")
    if cpu4 and "speedup_vs_pytorch" in cpu4:
        s = cpu4["speedup_vs_pytorch"]
        checks.append((f"cpu int4 >= {GOAL_SPEEDUP_CPU_INT4:g}x PyTorch frames/s", s >= GOAL_SPEEDUP_CPU_INT4,
                       f"{s:.2f}x"))
    for r in sized:
        if r["system"] != PYTORCH:
            f = r["outside_decoder_frac"]
            checks.append((f"{r['label']}: outside-decoder time < {GOAL_OUTSIDE_DECODER:.0%} of a frame",
                           f < GOAL_OUTSIDE_DECODER, f"{f:.1%}"))
    if cpu4 and ov4:
        s = ov4["frames_per_s"] / cpu4["frames_per_s"]
        checks.append(("openvino int4 >= cpu int4 frames/s", s >= 1.0, f"{s:.2f}x"))
    for r in records:
        if r["system"] == "openvino" and r.get("load_warm_s") is not None and r["preset"] == "tiny":
            checks.append((f"{r['label']} warm-cache load < {GOAL_WARM_LOAD_S:g} s (tiny)",
                           r["load_warm_s"] < GOAL_WARM_LOAD_S, f"{r['load_warm_s']:.3f} s"))
    return checks


def _checkpoint(options: BenchOptions, cache: Path) -> tuple[Path, dict[str, Any]]:
    if options.checkpoint:
        return Path(options.checkpoint), {}
    path = cache / "checkpoints" / f"{options.preset}-seed{options.seed}"
    if (path / "config.json").is_file():
        return path, {"checkpoint_cached": True}
    _say(options, f"writing the {options.preset} checkpoint to {path}")
    res = _spawn("checkpoint", {"preset": options.preset, "seed": options.seed}, cache=cache,
                 stream=not options.quiet)
    return Path(res["checkpoint"]), {"checkpoint_s": res["seconds"], "checkpoint_cached": False}


def _bundle_for(spec: SystemSpec, options: BenchOptions, checkpoint: Path, cache: Path
                ) -> tuple[Path, dict[str, Any]]:
    """Reuse or build the bundle of ``spec``; returns it and the build facts for the record."""
    if spec.bundle is not None:
        return spec.bundle, {}
    name = "-".join(p for p in (checkpoint.name, spec.target, spec.precision, spec.variant) if p)
    path = cache / "bundles" / name
    if not options.rebuild and _reusable(path, checkpoint):
        from higgs_pack.manifests.manifest import read_manifest

        return path, {"build_s": read_manifest(path)["build"]["seconds"], "build_cached": True}
    _say(options, f"building {spec.label} into {path}")
    res = _spawn("build", {"label": spec.label, "target": spec.target, "precision": spec.precision,
                           "variant": spec.variant, "checkpoint": str(checkpoint), "out": str(path)},
                 cache=cache, stream=not options.quiet)
    return path, {"build_s": res["seconds"], "build_cached": False, "build_peak_rss_mb": res["peak_rss_mb"]}


def _machine() -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version()}


def run_bench(options: BenchOptions) -> list[dict[str, Any]]:
    """Measure every system of ``options`` and return the records (ratios included).

    Systems that fail are recorded with an ``error`` and no numbers; the others still run.
    """
    from higgs_pack.manifests.manifest import read_manifest

    cache = _cache(options)
    specs = [parse_system(s) for s in options.systems] + [bundle_spec(b) for b in options.bundles]
    repeats = options.repeats or DEFAULT_REPEATS.get(options.preset, 1)
    need_ckpt = any(s.bundle is None for s in specs)
    checkpoint, ckpt_facts = _checkpoint(options, cache) if need_ckpt else (None, {})
    machine = _machine()
    common = {"frames": options.frames, "seed": options.seed, "temperature": options.temperature,
              "top_k": options.top_k, "text": options.text, "warmup": options.warmup, "repeats": repeats}

    # 1. bundles first (builds are long and load the CPUs; nothing is timed meanwhile)
    prepared: list[tuple[SystemSpec, Path | None, dict[str, Any] | None, dict[str, Any]]] = []
    for spec in specs:
        if spec.is_pytorch:
            facts = {"bundle_mb": _dir_bytes(checkpoint) / 1e6, **ckpt_facts}
            prepared.append((spec, None, None, facts))
            continue
        try:
            path, facts = _bundle_for(spec, options, checkpoint, cache)
            prepared.append((spec, path, read_manifest(path), facts))
        except Exception as exc:  # a failed build is a record, not the end of the run
            prepared.append((spec, None, None, {"error": f"build: {exc}"}))

    # 2. the machine's memory bandwidth, in the same run
    bandwidth = None
    if options.bandwidth_mib > 0:
        _say(options, f"measuring memory bandwidth ({options.bandwidth_mib} MiB buffer)")
        try:
            bandwidth = _spawn("bandwidth", {"mib": options.bandwidth_mib}, cache=cache,
                               timeout=options.timeout)
        except (WorkerError, subprocess.TimeoutExpired) as exc:
            _say(options, f"bandwidth measurement failed: {exc}")

    # 3. every system in its own process; with several rounds the systems take turns and
    #    each keeps its fastest round (other work on a shared machine only ever slows a run)
    records = []
    for spec, _path, manifest, facts in prepared:
        record = base_record(manifest, spec, options.preset)
        record.update(facts)
        record.update({"frames": options.frames, "machine": machine, **(bandwidth or {})})
        records.append(record)
    results: list[list[dict[str, Any]]] = [[] for _ in prepared]
    for round_ in range(max(1, options.rounds)):
        for i, (spec, path, manifest, _) in enumerate(prepared):
            if "error" in records[i]:
                continue
            try:
                results[i].append(_measure_system(spec, path, manifest, checkpoint, cache, common,
                                                  options, cold=round_ == 0))
            except (WorkerError, subprocess.TimeoutExpired) as exc:
                records[i]["error"] = str(exc)
    for (spec, *_), record, runs in zip(prepared, records, results, strict=True):
        if "error" in record or not runs:
            continue
        cold = {k: v for k, v in runs[0].items() if k in ("load_s", "peak_rss_cold_load_mb")
                and record["backend"] == "openvino"}
        record.update(max(runs, key=lambda r: r["frames_per_s"]))
        record.update(cold)
        record["rounds_frames_per_s"] = [r["frames_per_s"] for r in runs]
        if spec.is_pytorch and record.get("decoder_weight_bytes"):
            record["decoder_weight_mb"] = record.pop("decoder_weight_bytes") / 1e6
        _roofline(record, bandwidth)
    add_ratios(records)
    return records


def _measure_system(spec: SystemSpec, path: Path | None, manifest: dict[str, Any] | None,
                    checkpoint: Path | None, cache: Path, common: dict[str, Any],
                    options: BenchOptions, *, cold: bool = True) -> dict[str, Any]:
    """Measure one system; OpenVINO bundles get a cold-cache load first when ``cold``."""
    _say(options, f"measuring {spec.label}")
    if spec.is_pytorch:
        return _spawn("measure", {**common, "kind": PYTORCH, "checkpoint": str(checkpoint)},
                      cache=cache, timeout=options.timeout)
    job = {**common, "kind": "bundle", "bundle": str(path), "backend": manifest["backend"],
           "device": spec.device}
    out: dict[str, Any] = {}
    if manifest["backend"] == "openvino":
        ov_cache = cache / "bench" / "ov-cache" / f"{path.name}{'@' + spec.device if spec.device else ''}"
        job["ov_cache"] = str(ov_cache)
        if cold:
            shutil.rmtree(ov_cache, ignore_errors=True)
            first = _spawn("measure", {**job, "load_only": True}, cache=cache, timeout=options.timeout)
            out = {"load_s": first["load_s"], "peak_rss_cold_load_mb": first["peak_rss_mb"]}
    res = _spawn("measure", job, cache=cache, timeout=options.timeout)
    if manifest["backend"] == "openvino":
        res["load_warm_s"] = res.pop("load_s")
    return {**res, **out}


# ----------------------------------------------------------------------------- report

#: (header, record key, format) of the printed table.
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("system", "label", "{}"),
    ("frames/s", "frames_per_s", "{:.1f}"),
    ("vs torch", "speedup_vs_pytorch", "{:.2f}x"),
    ("vs cpu", "speedup_vs_cpu", "{:.2f}x"),
    ("1st frame ms", "first_frame_ms", "{:.0f}"),
    ("RTF", "rtf", "{:.3f}"),
    ("peak RSS MB", "peak_rss_mb", "{:.0f}"),
    ("bundle MB", "bundle_mb", "{:.0f}"),
    ("outside dec.", "outside_decoder_frac", "{:.1%}"),
    ("load s", "load_s", "{:.2f}"),
    ("warm load s", "load_warm_s", "{:.2f}"),
    ("roofline", "roofline_frac", "{:.1%}"),
)


def _cell(record: dict[str, Any], key: str, fmt: str) -> str:
    value = record.get(key)
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "error" if key == "frames_per_s" and "error" in record else "-"
    return fmt.format(value)


def render_table(records: list[dict[str, Any]]) -> str:
    """The records as a table (rich when installed, else plain text)."""
    rows = [[_cell(r, key, fmt) for _, key, fmt in COLUMNS] for r in records]
    headers = [h for h, _, _ in COLUMNS]
    presets = sorted({r["preset"] for r in records})
    title = f"higgs-pack bench, preset {', '.join(presets)}"
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
        lines = [title, "  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True))]
        lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
        return "\n".join(lines)
    table = Table(title=title)
    for i, h in enumerate(headers):
        table.add_column(h, justify="left" if i == 0 else "right")
    for r in rows:
        table.add_row(*r)
    buffer = io.StringIO()
    Console(file=buffer, width=200, color_system=None).print(table)
    return buffer.getvalue().rstrip("\n")


def render_details(records: list[dict[str, Any]]) -> str:
    """Per-step breakdown, build and roofline facts, and the goals met or missed."""
    lines = []
    bw = next((r for r in records if r.get("bandwidth_gbps")), None)
    if bw:
        lines.append(f"memory bandwidth: read {bw['bandwidth_read_gbps']:.1f} GB/s ({bw['bandwidth_threads']} threads), "
                     f"{bw['bandwidth_read_1t_gbps']:.1f} GB/s one thread, copy {bw['bandwidth_copy_gbps']:.1f} GB/s")
    for r in records:
        if "error" in r:
            lines.append(f"{r['label']}: ERROR {r['error']}")
            continue
        step = r.get("step_ms", {})
        parts = ", ".join(f"{k} {v:.2f}" for k, v in step.items())
        build = ""
        if r.get("build_s") is not None:
            build = f"; build {r['build_s']:.0f} s{' (cached)' if r.get('build_cached') else ''}"
        roof = ""
        if r.get("roofline_min_frame_ms") is not None:
            roof = (f"; decoder weights {r['decoder_weight_mb']:.0f} MB -> roofline "
                    f"{r['roofline_min_frame_ms']:.2f} ms/frame")
        lines.append(f"{r['label']}: step ms [{parts}]; prefill {r.get('prefill_ms', 0):.0f} ms"
                     f"{build}{roof}")
    for goal, met, numbers in goal_checks(records):
        state = "met" if met else "MISSED"
        lines.append(f"goal {goal}: {numbers} -> {state}")
    return "\n".join(lines)


def write_records(records: list[dict[str, Any]], out: Path, append: bool = False) -> None:
    """Write the records as a JSON list; ``append`` keeps earlier records of other systems."""
    keep: list[dict[str, Any]] = []
    if append and out.is_file():
        fresh = {(r["label"], r["preset"]) for r in records}
        keep = [r for r in json.loads(out.read_text()) if (r.get("label"), r.get("preset")) not in fresh]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(keep + records, indent=2, default=str) + "\n")
    tmp.replace(out)


def write_html(out: Path) -> Path:
    """Write ``<out>.html`` beside the JSON records file: every record of ``out``, charted.

    Raises:
        HiggsPackError: matplotlib is missing (``pip install 'higgs-pack[report]'``).
    """
    from higgs_pack.runtime.html_report import bench_html

    records = json.loads(out.read_text())
    path = out.with_suffix(".html")
    marks = {"outside_decoder_frac": (GOAL_OUTSIDE_DECODER * 100, f"goal: under {GOAL_OUTSIDE_DECODER:.0%}")}
    path.write_text(bench_html(records, goal_checks(records), marks), encoding="utf-8")
    return path


# ----------------------------------------------------------------------------- CLI


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m higgs_pack.targets.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=PRESETS, default="bench", help="checkpoint preset (default: bench)")
    p.add_argument("--systems", default=",".join(DEFAULT_SYSTEMS),
                   help="comma-separated: pytorch, <target>-<precision>[-<variant>][@<device>] "
                        f"(default: {','.join(DEFAULT_SYSTEMS)}); empty for none")
    p.add_argument("--bundle", action="append", default=[], metavar="PATH[@DEVICE]",
                   help="also measure this built bundle (repeatable)")
    p.add_argument("--frames", type=int, default=DEFAULT_FRAMES, help="audio frames per run (25 per second)")
    p.add_argument("--repeats", type=int, help="timed runs per system, median reported "
                                               "(default 3, 1 for --preset full)")
    p.add_argument("--rounds", type=int, default=1,
                   help="measure all systems this many times in turn and keep each one's fastest "
                        "round (for shared machines; default 1)")
    p.add_argument("--warmup", type=int, default=1, help="untimed runs first (default 1)")
    p.add_argument("--seed", type=int, default=0, help="checkpoint and sampling seed")
    p.add_argument("--text", default=BENCH_TEXT, help="text spoken by every system")
    p.add_argument("--checkpoint", help="use this checkpoint directory instead of the preset's")
    p.add_argument("--cache", help="cache directory (default $HIGGS_PACK_CACHE or ~/.cache/higgs-pack)")
    p.add_argument("--rebuild", action="store_true", help="rebuild cached bundles")
    p.add_argument("--bandwidth-mib", type=int, default=DEFAULT_BANDWIDTH_MIB,
                   help="buffer for the memory-bandwidth measurement (0 = skip)")
    p.add_argument("--timeout", type=float, help="seconds allowed per measuring process")
    p.add_argument("--out", default="dist/bench.json",
                   help="JSON records file, charted into the same name with .html ('' = do not write)")
    p.add_argument("--append", action="store_true", help="keep records of other systems already in --out")
    p.add_argument("--quiet", action="store_true", help="no progress messages")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.worker:
        return run_worker(args.worker)
    if args.frames < 2:
        _parser().error("--frames must be at least 2")
    options = BenchOptions(
        preset=args.preset, systems=tuple(s for s in args.systems.split(",") if s.strip()),
        bundles=tuple(args.bundle), frames=args.frames, repeats=args.repeats, rounds=args.rounds,
        warmup=args.warmup,
        seed=args.seed, text=args.text, checkpoint=args.checkpoint, cache=args.cache,
        rebuild=args.rebuild, bandwidth_mib=args.bandwidth_mib, out=args.out or None,
        append=args.append, timeout=args.timeout, quiet=args.quiet,
    )
    from higgs_pack.manifests.errors import HiggsPackError

    try:
        records = run_bench(options)
    except HiggsPackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(render_table(records))
    print(render_details(records))
    if options.out:
        write_records(records, Path(options.out), options.append)
        print(f"wrote {options.out}")
        try:
            print(f"wrote {write_html(Path(options.out))}")
        except HiggsPackError as exc:
            print(f"note: no HTML report: {exc}", file=sys.stderr)
    return 1 if any("error" in r for r in records) else 0


if __name__ == "__main__":
    sys.exit(main())

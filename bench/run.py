"""Orchestration of a benchmark run: checkpoints and bundles built once into the cache and
reused, every system measured by a worker, the records put together.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.decoder_steps import run_step_comparison
from bench.records import (
    add_ratios,
    base_record,
    batch_memory,
    first_audio_budget,
    roofline,
)
from bench.systems import (
    BENCH_TEXT,
    CONTEXT_ROUNDS,
    DEFAULT_BANDWIDTH_MIB,
    DEFAULT_CONTEXTS,
    DEFAULT_FRAMES,
    DEFAULT_REPEATS,
    DEFAULT_STEP_BATCHES,
    DEFAULT_SYSTEMS,
    FIT_MEMORY_BYTES,
    PYTORCH,
    SystemSpec,
    WorkerError,
    bundle_spec,
    machine,
    ov_cache_dir,
    parse_system,
    spawn,
)
from higgs_pack.runtime.backends import registered


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
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    out: str | None = "dist/bench.json"
    append: bool = False
    timeout: float | None = None
    quiet: bool = False
    build_only: bool = False
    batch: tuple[int, ...] = ()
    """Engine batch sizes to measure every bundle at (``--batch 1,2,4,8``; empty: none)."""
    fit_memory_bytes: int = FIT_MEMORY_BYTES
    """The memory budget of the computed (and with ``fit_run``, run) largest batch."""
    fit_run: bool = False
    """Also run ``fit_max_batch`` rows at ``FIT_POSITIONS`` (:mod:`~bench.kv_fit`)."""
    step_batch: tuple[int, ...] = DEFAULT_STEP_BATCHES
    """Batch sizes of the decoder-step comparison with llama.cpp (``--step-batch``)."""
    steps_only: bool = False
    """Measure only the decoder-step comparison (``--steps-only``), not the loop."""
    llama_threads: int | None = None
    """llama.cpp's ``n_threads`` (``--llama-threads``; None: the CPUs this process may use)."""


def cache_dir(options: BenchOptions) -> Path:
    from higgs_pack.runtime.sources.paths import cache_root

    return Path(options.cache) if options.cache else cache_root()


def say(options: BenchOptions, msg: str) -> None:
    if not options.quiet:
        print(msg, file=sys.stderr, flush=True)


def _dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def _reusable(bundle: Path, checkpoint: Path) -> bool:
    """A cached bundle is reused if it opens (manifest, sizes, paths), names this checkpoint as
    its source and is newer than it."""
    from higgs_pack.manifests.errors import HiggsPackError
    from higgs_pack.runtime.sources.bundle import open_bundle

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


def checkpoint_for(options: BenchOptions, cache: Path) -> tuple[Path, dict[str, Any]]:
    if options.checkpoint:
        return Path(options.checkpoint), {}
    path = cache / "checkpoints" / f"{options.preset}-seed{options.seed}"
    if (path / "config.json").is_file():
        return path, {"checkpoint_cached": True}
    say(options, f"writing the {options.preset} checkpoint to {path}")
    res = spawn("checkpoint", {"preset": options.preset, "seed": options.seed}, cache=cache,
                 stream=not options.quiet)
    return Path(res["checkpoint"]), {"checkpoint_s": res["seconds"], "checkpoint_cached": False}


def bundle_for(spec: SystemSpec, options: BenchOptions, checkpoint: Path, cache: Path
                ) -> tuple[Path, dict[str, Any]]:
    """Reuse or build the bundle of ``spec``; returns it and the build facts for the record."""
    if spec.bundle is not None:
        return spec.bundle, {}
    name = "-".join(p for p in (checkpoint.name, spec.target, spec.precision, spec.variant) if p)
    path = cache / "bundles" / name
    if not options.rebuild and _reusable(path, checkpoint):
        from higgs_pack.manifests.manifest import read_manifest

        return path, {"build_s": read_manifest(path)["build"]["seconds"], "build_cached": True}
    say(options, f"building {spec.label} into {path}")
    res = spawn("build", {"label": spec.label, "target": spec.target, "precision": spec.precision,
                           "variant": spec.variant, "checkpoint": str(checkpoint), "out": str(path)},
                 cache=cache, stream=not options.quiet)
    return path, {"build_s": res["seconds"], "build_cached": False, "build_peak_rss_mb": res["peak_rss_mb"]}


def run_bench(options: BenchOptions) -> list[dict[str, Any]]:
    """Measure every system of ``options`` and return the records (ratios included).

    Systems that fail are recorded with an ``error`` and no numbers; the others still run.
    """
    from higgs_pack.manifests.manifest import read_manifest

    cache = cache_dir(options)
    specs = [parse_system(s) for s in options.systems] + [bundle_spec(b) for b in options.bundles]
    llama = [s for s in specs if s.is_llama_cpp]  # GGUFs: the decoder-step comparison only
    specs = [s for s in specs if not s.is_llama_cpp]
    repeats = options.repeats or DEFAULT_REPEATS.get(options.preset, 1)
    need_ckpt = bool(llama) or any(s.bundle is None for s in specs)
    checkpoint, ckpt_facts = checkpoint_for(options, cache) if need_ckpt else (None, {})
    machine_facts = machine()
    common = {"frames": options.frames, "seed": options.seed, "temperature": options.temperature,
              "top_k": options.top_k, "text": options.text, "warmup": options.warmup, "repeats": repeats,
              "contexts": list(options.contexts)}

    # 1. bundles first (builds are long and load the CPUs; nothing is timed meanwhile)
    prepared: list[tuple[SystemSpec, Path | None, dict[str, Any] | None, dict[str, Any]]] = []
    for spec in specs:
        if spec.is_pytorch:
            facts = {"bundle_mb": _dir_bytes(checkpoint) / 1e6, **ckpt_facts}
            prepared.append((spec, None, None, facts))
            continue
        try:
            path, facts = bundle_for(spec, options, checkpoint, cache)
            prepared.append((spec, path, read_manifest(path), facts))
        except Exception as exc:  # a failed build is a record, not the end of the run
            prepared.append((spec, None, None, {"error": f"build: {exc}"}))

    builds = [build_record(spec, manifest, facts, options.preset, machine_facts)
              for spec, _path, manifest, facts in prepared if not spec.is_pytorch and spec.bundle is None]
    if options.build_only:
        return builds
    records = [] if options.steps_only else _measure_all(prepared, options, machine_facts, common, checkpoint, cache)
    if llama:  # 5. the bare decoder step of our bundles beside llama.cpp's, in turns
        ours = [(spec, path, manifest) for spec, path, manifest, _ in prepared
                if path is not None and not spec.is_pytorch]
        records += run_step_comparison(
            llama, ours, checkpoint, cache, preset=options.preset, contexts=options.contexts or DEFAULT_CONTEXTS,
            batches=options.step_batch, rounds=options.rounds if options.rounds > 1 else CONTEXT_ROUNDS,
            text=options.text, machine=machine_facts, threads=options.llama_threads, timeout=options.timeout,
            say=lambda m: say(options, m))
    return builds + records


def _measure_all(prepared: list[tuple[SystemSpec, Path | None, dict[str, Any] | None, dict[str, Any]]],
                 options: BenchOptions, machine: dict[str, Any], common: dict[str, Any],
                 checkpoint: Path | None, cache: Path) -> list[dict[str, Any]]:
    """Steps 2 to 4 of :func:`run_bench`: the bandwidth, every system's loop, the engine's batches."""

    # 2. the machine's memory bandwidth, in the same run
    bandwidth = None
    if options.bandwidth_mib > 0:
        say(options, f"measuring memory bandwidth ({options.bandwidth_mib} MiB buffer)")
        try:
            bandwidth = spawn("bandwidth", {"mib": options.bandwidth_mib}, cache=cache,
                               timeout=options.timeout)
        except (WorkerError, subprocess.TimeoutExpired) as exc:
            say(options, f"bandwidth measurement failed: {exc}")

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
                and _compiles(record["backend"])}
        record.update(max(runs, key=lambda r: r["frames_per_s"]))
        record.update(cold)
        record["rounds_frames_per_s"] = [r["frames_per_s"] for r in runs]
        if spec.is_pytorch and record.get("decoder_weight_bytes"):
            record["decoder_weight_mb"] = record.pop("decoder_weight_bytes") / 1e6
        record["first_audio_budget_ms"] = first_audio_budget(record)
        roofline(record, bandwidth)
    add_ratios(records)

    # 4. the engine at each batch size, every bundle in its own process (PyTorch has no engine)
    if options.batch:
        for (spec, path, manifest, _), record in zip(prepared, records, strict=True):
            if not spec.is_pytorch and path is not None:
                record["batch"] = _measure_batches(spec, path, manifest, cache, common, options)
    return records


def build_record(spec: SystemSpec, manifest: dict[str, Any] | None, facts: dict[str, Any], preset: str,
                 machine: dict[str, Any]) -> dict[str, Any]:
    """The ``"kind": "build"`` record of one system's bundle, from its manifest's ``build.resources``.

    Fields: ``system`` (label, e.g. ``cpu-int4``), ``preset``, ``peak_rss_mb`` (peak
    resident memory of the build's whole process tree), ``build_s``, ``bundle_mb``,
    ``scratch_peak_mb``, ``phases`` (name, seconds, peak_rss_mb of each step), ``cached``
    (the bundle was reused: its numbers are those of the build that made it), ``machine``;
    a failed build has ``error`` instead.
    """
    record: dict[str, Any] = {"kind": "build", "system": spec.label, "preset": preset, "machine": machine}
    if manifest is None:
        record["error"] = facts.get("error", "no bundle")
        return record
    resources = manifest["build"].get("resources", {})
    record.update({
        "cached": bool(facts.get("build_cached")),
        "build_s": manifest["build"].get("seconds"),
        "bundle_mb": round(sum(f["size"] for f in manifest["files"]) / 2**20, 1),
        "peak_rss_mb": resources.get("peak_rss_mb"),
        "peak_anon_mb": resources.get("peak_anon_mb"),
        "scratch_peak_mb": resources.get("scratch_peak_mb"),
        "phases": resources.get("phases", []),
        "built_on": resources.get("cpu"),
        "verified": manifest.get("verification", {}).get("build_time", {}).get("ok"),
    })
    return record


def _compiles(backend: str) -> bool:
    """Whether a backend compiles into a model cache (its cold and warm loads are measured)."""
    return backend in registered() and registered()[backend].compile_cache


def _measure_system(spec: SystemSpec, path: Path | None, manifest: dict[str, Any] | None,
                    checkpoint: Path | None, cache: Path, common: dict[str, Any],
                    options: BenchOptions, *, cold: bool = True) -> dict[str, Any]:
    """Measure one system; OpenVINO bundles get a cold-cache load first when ``cold``."""
    say(options, f"measuring {spec.label}")
    if spec.is_pytorch:
        return spawn("measure", {**common, "kind": PYTORCH, "checkpoint": str(checkpoint)},
                      cache=cache, timeout=options.timeout)
    job = {**common, "kind": "bundle", "bundle": str(path), "backend": manifest["backend"],
           "device": spec.device}
    out: dict[str, Any] = {}
    if _compiles(manifest["backend"]):
        ov_cache = ov_cache_dir(cache, path, spec)
        job["ov_cache"] = str(ov_cache)
        if cold:
            shutil.rmtree(ov_cache, ignore_errors=True)
            first = spawn("measure", {**job, "load_only": True}, cache=cache, timeout=options.timeout)
            out = {"load_s": first["load_s"], "peak_rss_cold_load_mb": first["peak_rss_mb"]}
    res = spawn("measure", job, cache=cache, timeout=options.timeout)
    if _compiles(manifest["backend"]):
        res["load_warm_s"] = res.pop("load_s")
    return {**res, **out}


def _measure_batches(spec: SystemSpec, path: Path, manifest: dict[str, Any], cache: Path,
                     common: dict[str, Any], options: BenchOptions) -> dict[str, Any]:
    """The ``batch`` field of one bundle's record: the ``batch`` worker's figures
    (:func:`~bench.batch.measure_batches`) and the computed memory fit
    (:func:`~bench.records.batch_memory`); ``error`` when the worker failed."""
    say(options, f"measuring {spec.label} at batch {','.join(map(str, options.batch))}")
    job = {**common, "bundle": str(path), "device": spec.device, "batch": list(options.batch),
           "ov_cache": str(ov_cache_dir(cache, path, spec)) if _compiles(manifest["backend"]) else None}
    out: dict[str, Any] = {"sizes": list(options.batch)}
    try:
        out.update(spawn("batch", job, cache=cache, timeout=options.timeout))
    except (WorkerError, subprocess.TimeoutExpired) as exc:
        out["error"] = str(exc)
        return out
    out.update(batch_memory(manifest, out.get("kv_bytes_per_position"), out.get("bench_kv_bytes_per_position"),
                            options.fit_memory_bytes))
    if options.fit_run and out.get("fit_max_batch"):
        say(options, f"running {spec.label} at its computed fit: {out['fit_max_batch']} rows x {out['fit_positions']} "
                      "positions")
        fit_job = {**job, "backend": manifest["backend"], "batch": out["fit_max_batch"],
                   "positions": out["fit_positions"]}
        try:
            out.update(spawn("fit", fit_job, cache=cache, timeout=options.timeout))
        except (WorkerError, subprocess.TimeoutExpired) as exc:
            out["fit_run_error"] = str(exc)
        if out.get("fit_run_peak_rss_mb") is not None:
            out["fit_run_fits"] = out["fit_run_peak_rss_mb"] * 2**20 <= out["fit_memory_bytes"]
    return out

"""``python -m bench`` (``nox -s bench``): the PyTorch reference and built bundles side by side.

Every system speaks the same text for the same frame count (temperature 0.8, top-k 50, seed 0,
repeat guard off, EOC suppressed) after a warm-up, each in its own process; ``--batch`` adds the
engine at several batch sizes, llama.cpp systems the bare decoder step beside llama.cpp's.  The
checkpoint and bundles are built once into the cache and reused.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from bench.common import systems
from bench.common.systems import SystemSpec, WorkerError, machine, ov_cache_dir, parse_system, spawn
from bench.decoder import records as rec
from bench.decoder import report
from bench.decoder.gemm import PREFILL_LENGTHS, layer_shapes, ops_per_row
from bench.decoder.steps import run_step_comparison
from bench.decoder.workers import CONTEXT_ROUNDS
from higgs_pack.runtime.backends import registered

DEFAULT_SYSTEMS = ("pytorch", "cpu-int4", "cpu-fp32", "openvino-int4", "openvino-int8", "openvino-fp32")
BENCH_TEXT = "The quick brown fox jumps over the lazy dog, then runs back home before the evening rain."
#: Timed runs per system (median reported) by preset.
DEFAULT_REPEATS = {"tiny": 3, "bench": 3, "full": 1}
#: The reference clip of ``first_audio_ms_by_voice`` (a 7-second voice; its transcript beside it, .txt).
DEFAULT_VOICE_CLIP = systems.ROOT.parent / "shared" / "cases" / "ref_en_16k.wav"
#: What a failed worker raises.
FAILED = (WorkerError, subprocess.TimeoutExpired)


@dataclass
class BenchOptions:
    """What one run measures: the command-line flags (``fit_memory_bytes``: ``--fit-memory-gib``)."""

    preset: str = "bench"
    systems: tuple[str, ...] = DEFAULT_SYSTEMS
    bundles: tuple[str, ...] = ()
    frames: int = 100
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
    bandwidth_mib: int = 1024
    contexts: tuple[int, ...] = (64, 900)
    out: str | None = "dist/bench.json"
    append: bool = False
    timeout: float | None = None
    quiet: bool = False
    build_only: bool = False
    batch: tuple[int, ...] = ()
    fit_memory_bytes: int = rec.FIT_MEMORY_BYTES
    fit_run: bool = False
    step_batch: tuple[int, ...] = (1, 4)
    steps_only: bool = False
    llama_threads: int | None = None
    prefill_lengths: tuple[int, ...] = PREFILL_LENGTHS
    gemm_peak: bool = True
    voice_clip: str | None = str(DEFAULT_VOICE_CLIP) if DEFAULT_VOICE_CLIP.is_file() else None


Prepared = tuple[SystemSpec, "Path | None", "dict[str, Any] | None", dict[str, Any]]


def cache_dir(options: BenchOptions) -> Path:
    from higgs_pack.runtime.sources.paths import cache_root

    return Path(options.cache) if options.cache else cache_root()


def say(options: BenchOptions, msg: str) -> None:
    if not options.quiet:
        print(msg, file=sys.stderr, flush=True)


def _reusable(bundle: Path, checkpoint: Path) -> bool:
    """A cached bundle opens, names this checkpoint as its source and is newer than it."""
    from higgs_pack.errors import HiggsPackError
    from higgs_pack.runtime.sources.bundle import open_bundle

    try:
        source = open_bundle(bundle, check_hashes=False).manifest["build"].get("checkpoint_source")
    except (HiggsPackError, OSError):
        return False
    return (source is not None and Path(source).resolve() == checkpoint.resolve()
            and (bundle / "manifest.json").stat().st_mtime >= (checkpoint / "config.json").stat().st_mtime)


def checkpoint_for(options: BenchOptions, cache: Path) -> tuple[Path, dict[str, Any]]:
    if options.checkpoint:
        return Path(options.checkpoint), {}
    path = cache / "checkpoints" / f"{options.preset}-seed{options.seed}"
    if (path / "config.json").is_file():
        return path, {"checkpoint_cached": True}
    say(options, f"writing the {options.preset} checkpoint to {path}")
    res = spawn("checkpoint", {"preset": options.preset, "seed": options.seed}, cache=cache, stream=not options.quiet)
    return Path(res["checkpoint"]), {"checkpoint_s": res["seconds"], "checkpoint_cached": False}


def bundle_for(spec: SystemSpec, options: BenchOptions, checkpoint: Path, cache: Path) -> tuple[Path, dict[str, Any]]:
    """Reuse or build the bundle of ``spec``: its path and the build facts for the record."""
    if spec.bundle is not None:
        return spec.bundle, {}
    path = cache / "bundles" / "-".join(p for p in (checkpoint.name, spec.target, spec.precision, spec.variant) if p)
    if not options.rebuild and _reusable(path, checkpoint):
        from higgs_pack.manifests.manifest import read_manifest

        return path, {"build_s": read_manifest(path)["build"]["seconds"], "build_cached": True}
    say(options, f"building {spec.label} into {path}")
    res = spawn("build", {"label": spec.label, "target": spec.target, "precision": spec.precision,
                          "variant": spec.variant, "checkpoint": str(checkpoint), "out": str(path)},
                cache=cache, stream=not options.quiet)
    return path, {"build_s": res["seconds"], "build_cached": False, "build_peak_rss_mb": res["peak_rss_mb"]}


def build_record(spec: SystemSpec, manifest: dict[str, Any] | None, facts: dict[str, Any], preset: str,
                 machine: dict[str, Any]) -> dict[str, Any]:
    """The ``"kind": "build"`` record of a bundle, from its manifest's ``build.resources`` (``cached``:
    reused, with the numbers of the build that made it); ``error`` for a failed build."""
    record: dict[str, Any] = {"kind": "build", "system": spec.label, "preset": preset, "machine": machine}
    if manifest is None:
        return {**record, "error": facts.get("error", "no bundle")}
    resources = manifest["build"].get("resources", {})
    return {**record, "cached": bool(facts.get("build_cached")), "build_s": manifest["build"].get("seconds"),
            "bundle_mb": round(sum(f["size"] for f in manifest["files"]) / 2**20, 1),
            **{k: resources.get(k) for k in ("peak_rss_mb", "peak_anon_mb", "scratch_peak_mb")},
            "phases": resources.get("phases", []), "built_on": resources.get("cpu"),
            "verified": manifest.get("verification", {}).get("build_time", {}).get("ok")}


def run_bench(options: BenchOptions) -> list[dict[str, Any]]:
    """Build (or reuse) every system's bundle, then measure them: the build records, then the
    measurement records (ratios included), then the decoder-step ones.  A failing system is a
    record with ``error``; the others still run."""
    from higgs_pack.manifests.manifest import read_manifest

    cache = cache_dir(options)
    specs = [parse_system(s) for s in options.systems] + [systems.bundle_spec(b) for b in options.bundles]
    llama = [s for s in specs if s.is_llama_cpp]
    specs = [s for s in specs if not s.is_llama_cpp]
    need = bool(llama) or any(s.bundle is None for s in specs)
    checkpoint, ckpt_facts = checkpoint_for(options, cache) if need else (None, {})
    machine_facts = machine()
    prepared: list[Prepared] = []  # builds first: long, and nothing is timed meanwhile
    for spec in specs:
        if spec.is_pytorch:
            size = sum(p.stat().st_size for p in checkpoint.rglob("*") if p.is_file())
            prepared.append((spec, None, None, {"bundle_mb": size / 1e6, **ckpt_facts}))
            continue
        try:
            path, facts = bundle_for(spec, options, checkpoint, cache)
            prepared.append((spec, path, read_manifest(path), facts))
        except Exception as exc:  # a failed build is a record, not the end of the run
            prepared.append((spec, None, None, {"error": f"build: {exc}"}))
    builds = [build_record(spec, manifest, facts, options.preset, machine_facts)
              for spec, _, manifest, facts in prepared if not spec.is_pytorch and spec.bundle is None]
    if options.build_only:
        return builds
    peak = gemm_peak(options, checkpoint, prepared, cache)
    records = [] if options.steps_only else _measure_all(prepared, options, machine_facts, checkpoint, cache, peak)
    if llama:
        ours = [(spec, path, manifest) for spec, path, manifest, _ in prepared if path is not None]
        records += run_step_comparison(
            llama, ours, checkpoint, cache, preset=options.preset, contexts=options.contexts or BenchOptions.contexts,
            batches=options.step_batch, rounds=options.rounds if options.rounds > 1 else CONTEXT_ROUNDS,
            text=options.text, machine=machine_facts, threads=options.llama_threads, timeout=options.timeout,
            say=lambda m: say(options, m), prefill_lengths=options.prefill_lengths, extra=peak)
        for record in records:
            rec.prefill_vs_peak(record)
    return builds + records


def decoder_config(checkpoint: Path | None, prepared: list[Prepared]) -> dict[str, Any] | None:
    """The decoder's ``text_config`` (hidden, intermediate, heads, KV heads, head_dim, layers):
    the checkpoint's, else that of a measured bundle's source checkpoint (its manifest's
    ``build.checkpoint_source``) where it is still there; None without."""
    import json

    sources = [(manifest or {}).get("build", {}).get("checkpoint_source") for _, _, manifest, _ in prepared]
    for config in [Path(p) / "config.json" for p in [checkpoint, *sources] if p]:
        if config.is_file():
            data = json.loads(config.read_text(encoding="utf-8"))
            text = data.get("text_config", data)
            if all(k in text for k in ("hidden_size", "intermediate_size", "num_attention_heads", "head_dim")):
                return text
    return None


def gemm_peak(options: BenchOptions, checkpoint: Path | None, prepared: list[Prepared], cache: Path
              ) -> dict[str, Any]:
    """The machine's GEMM peak on the decoder layer's shapes, once per run (``gemm_peak`` worker:
    :func:`bench.decoder.gemm.gemm_peak`), and ``decoder_ops_per_position`` (the decoder's MatMul operations
    per prompt position, attention left out), for every record; ``gemm_peak_error`` when it failed,
    nothing with ``gemm_peak`` off or no decoder config."""
    config = decoder_config(checkpoint, prepared)
    if config is None or not options.gemm_peak:
        return {}
    out: dict[str, Any] = {"decoder_ops_per_position": ops_per_row(layer_shapes(config)) * int(config["num_hidden_layers"])}
    say(options, "measuring the GEMM peak (float32 and int8, ONNX Runtime, the decoder layer's shapes)")
    try:
        out.update(spawn("gemm_peak", {"config": config, "rows": list(options.prefill_lengths)}, cache=cache,
                         timeout=options.timeout))
    except FAILED as exc:
        out["gemm_peak_error"] = str(exc)
    return out


def _compiles(backend: str) -> bool:
    """The backend compiles into a model cache (its cold and warm loads are measured)."""
    return backend in registered() and registered()[backend].compile_cache


def _measure_all(prepared: list[Prepared], options: BenchOptions, machine: dict[str, Any],
                 checkpoint: Path | None, cache: Path, peak: dict[str, Any]) -> list[dict[str, Any]]:
    """The bandwidth, every system's loop in its own process (``rounds`` in turn, each keeping its
    fastest: other work on a shared machine only slows a run), then the engine's batches."""
    bandwidth = None
    if options.bandwidth_mib > 0:
        say(options, f"measuring memory bandwidth ({options.bandwidth_mib} MiB buffer)")
        try:
            bandwidth = spawn("bandwidth", {"mib": options.bandwidth_mib}, cache=cache, timeout=options.timeout)
        except FAILED as exc:
            say(options, f"bandwidth measurement failed: {exc}")
    job = {"frames": options.frames, "seed": options.seed, "temperature": options.temperature,
           "top_k": options.top_k, "text": options.text, "warmup": options.warmup,
           "repeats": options.repeats or DEFAULT_REPEATS.get(options.preset, 1), "contexts": list(options.contexts),
           "prefill_lengths": list(options.prefill_lengths), **voice_job(options.voice_clip)}
    records = [{**rec.base_record(manifest, spec, options.preset), **facts, "frames": options.frames,
                "machine": machine, **(bandwidth or {}), **peak} for spec, _, manifest, facts in prepared]
    results: list[list[dict[str, Any]]] = [[] for _ in prepared]
    for round_ in range(max(1, options.rounds)):
        for i, (spec, path, manifest, _) in enumerate(prepared):
            if "error" not in records[i]:
                try:
                    results[i].append(_measure_system(spec, path, manifest, checkpoint, cache, job, options,
                                                      cold=round_ == 0))
                except FAILED as exc:
                    records[i]["error"] = str(exc)
    for (spec, *_), record, runs in zip(prepared, records, results, strict=True):
        if "error" in record or not runs:
            continue
        cold = {k: v for k, v in runs[0].items() if k in ("load_s", "peak_rss_cold_load_mb")
                and _compiles(record["backend"])}
        record.update({**max(runs, key=lambda r: r["frames_per_s"]), **cold,
                       "rounds_frames_per_s": [r["frames_per_s"] for r in runs]})
        if spec.is_pytorch and record.get("decoder_weight_bytes"):
            record["decoder_weight_mb"] = record.pop("decoder_weight_bytes") / 1e6
        record["first_audio_budget_ms"] = rec.first_audio_budget(record)
        rec.roofline(record, bandwidth)
        rec.prefill_vs_peak(record)
    rec.add_ratios(records)
    for (spec, path, manifest, _), record in zip(prepared, records, strict=True):
        if options.batch and not spec.is_pytorch and path is not None:
            record["batch"] = _measure_batches(spec, path, manifest, cache, job, options)
    return records


def voice_job(clip: str | None) -> dict[str, Any]:
    """The ``measure`` job's ``voice_clip`` and ``voice_transcript`` (the clip's ``.txt`` beside it);
    InputError naming ``--voice-clip`` when the clip or its transcript is missing."""
    if not clip:
        return {}
    from higgs_pack.errors import InputError

    path = Path(clip)
    transcript = path.with_suffix(".txt")
    if not path.is_file() or not transcript.is_file():
        raise InputError(f"--voice-clip {clip}: needs the clip and its transcript {transcript.name} beside it "
                         f"({'no clip' if not path.is_file() else 'no transcript'}); '' measures zero-shot only")
    return {"voice_clip": str(path), "voice_transcript": transcript.read_text(encoding="utf-8").strip()}


def _measure_system(spec: SystemSpec, path: Path | None, manifest: dict[str, Any] | None, checkpoint: Path | None,
                    cache: Path, job: dict[str, Any], options: BenchOptions, *, cold: bool) -> dict[str, Any]:
    """One system's ``measure`` worker; a compiling backend gets a cold-cache load first when ``cold``."""
    say(options, f"measuring {spec.label}")
    if spec.is_pytorch:
        return spawn("measure", {**job, "kind": systems.PYTORCH, "checkpoint": str(checkpoint)}, cache=cache,
                     timeout=options.timeout)
    job = {**job, "kind": "bundle", "bundle": str(path), "backend": manifest["backend"], "device": spec.device}
    if not _compiles(manifest["backend"]):
        return spawn("measure", job, cache=cache, timeout=options.timeout)
    job["ov_cache"] = str(ov_cache_dir(cache, path, spec))
    out: dict[str, Any] = {}
    if cold:
        shutil.rmtree(job["ov_cache"], ignore_errors=True)
        first = spawn("measure", {**job, "load_only": True}, cache=cache, timeout=options.timeout)
        out = {"load_s": first["load_s"], "peak_rss_cold_load_mb": first["peak_rss_mb"]}
    res = spawn("measure", job, cache=cache, timeout=options.timeout)
    res["load_warm_s"] = res.pop("load_s")
    return {**res, **out}


def _measure_batches(spec: SystemSpec, path: Path, manifest: dict[str, Any], cache: Path, job: dict[str, Any],
                     options: BenchOptions) -> dict[str, Any]:
    """A record's ``batch``: the ``batch`` worker's figures, the computed memory fit and, with
    ``fit_run``, the ``fit`` worker's run of that batch; ``error`` when the worker failed."""
    say(options, f"measuring {spec.label} at batch {','.join(map(str, options.batch))}")
    job = {**job, "bundle": str(path), "device": spec.device, "batch": list(options.batch),
           "ov_cache": str(ov_cache_dir(cache, path, spec)) if _compiles(manifest["backend"]) else None}
    out: dict[str, Any] = {"sizes": list(options.batch)}
    try:
        out.update(spawn("batch", job, cache=cache, timeout=options.timeout))
    except FAILED as exc:
        return {**out, "error": str(exc)}
    out.update(rec.batch_memory(manifest, out.get("kv_bytes_per_position"), out.get("bench_kv_bytes_per_position"),
                            options.fit_memory_bytes))
    if options.fit_run and out.get("fit_max_batch"):
        say(options, f"running {spec.label} at its computed fit: {out['fit_max_batch']} rows x {out['fit_positions']}")
        try:
            out.update(spawn("fit", {**job, "backend": manifest["backend"], "batch": out["fit_max_batch"],
                                     "positions": out["fit_positions"]}, cache=cache, timeout=options.timeout))
        except FAILED as exc:
            out["fit_run_error"] = str(exc)
        if out.get("fit_run_peak_rss_mb") is not None:
            out["fit_run_fits"] = out["fit_run_peak_rss_mb"] * 2**20 <= out["fit_memory_bytes"]
    return out


# ----------------------------------------------------------------------------- command line


def parse_batch(text: str, flag: str = "--batch") -> tuple[int, ...] | str:
    """``"1,2,4,8"`` -> ``(1, 2, 4, 8)`` (empty: none), or the error message."""
    try:
        sizes = tuple(int(b) for b in text.split(",") if b.strip())
    except ValueError:
        return f"{flag} must be comma-separated batch sizes such as 1,2,4,8, got {text!r}"
    if any(b < 1 for b in sizes) or len(set(sizes)) != len(sizes):
        return f"{flag} sizes must be distinct whole numbers >= 1, got {text!r}"
    return sizes


def _sizes(flag: str) -> Any:
    def parse(text: str) -> tuple[int, ...]:
        got = parse_batch(text, flag)
        if isinstance(got, str):
            raise argparse.ArgumentTypeError(got)
        return got

    return parse


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    add = p.add_argument
    add("--preset", choices=systems.PRESETS)
    add("--systems", type=lambda s: tuple(x for x in s.split(",") if x.strip()),
        help="comma-separated: pytorch, llama.cpp-<quant>, <target>-<precision>[-<variant>][@<device>]; empty: none")
    add("--bundle", dest="bundles", action="append", default=[], metavar="PATH[@DEVICE]",
        help="also measure this built bundle (repeatable)")
    add("--frames", type=int, help="audio frames per run (25 per second), >= 2")
    add("--repeats", type=int, help="timed runs per system, median reported (default 3, 1 for --preset full)")
    add("--rounds", type=int, help="measure all systems this many times in turn, keep each one's fastest")
    for flag, kind in (("--warmup", int), ("--seed", int), ("--text", str), ("--checkpoint", str), ("--cache", str),
                       ("--llama-threads", int), ("--timeout", float)):
        add(flag, type=kind)
    add("--bandwidth-mib", type=int, help="memory-bandwidth buffer (0: skip)")
    add("--voice-clip", type=lambda s: s or None,
        help="reference clip of the first audio per voice kind, its transcript in the .txt beside it ('': zero-shot only)")
    add("--no-gemm-peak", dest="gemm_peak", action="store_false", help="skip the GEMM peak")
    for flag, what in (("--contexts", "contexts of the bare decoder's step (empty: none)"),
                       ("--batch", "engine batch sizes to measure, e.g. 1,2,4,8"),
                       ("--step-batch", "batch sizes of the decoder-step comparison with llama.cpp systems"),
                       ("--prefill-lengths", "prompt positions of prefill_positions_per_s (empty: none)")):
        add(flag, type=_sizes(flag), help=what)
    add("--fit-memory-gib", type=float, default=rec.FIT_MEMORY_BYTES / 2**30, help="memory budget of the largest batch")
    add("--out", type=lambda s: s or None, help="JSON records, charted into the same name with .html ('': none)")
    for flag, what in (("--rebuild", "rebuild cached bundles"), ("--fit-run", "with --batch: run the largest batch"),
                       ("--steps-only", "with llama.cpp systems: only the decoder-step comparison"),
                       ("--append", "keep records of other systems in --out"), ("--quiet", "no progress"),
                       ("--build-only", "build (or reuse) the bundles, measure nothing")):
        add(flag, action="store_true", help=what)
    add("--worker", help=argparse.SUPPRESS)
    p.set_defaults(**{k: v for k, v in asdict(BenchOptions()).items() if k != "bundles"})
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.worker:
        return systems.run_worker(args.worker)
    for bad, why in ((args.frames < 2, "--frames must be at least 2"),
                     (not args.fit_memory_gib > 0, "--fit-memory-gib must be positive"),
                     (args.fit_run and not args.batch, "--fit-run needs --batch"),
                     (args.llama_threads is not None and args.llama_threads < 1, "--llama-threads must be >= 1"),
                     (not args.step_batch, "--step-batch: give at least one size")):
        if bad:
            parser.error(why)
    options = BenchOptions(**{f.name: getattr(args, f.name) for f in fields(BenchOptions)})
    options.bundles, options.fit_memory_bytes = tuple(options.bundles), int(args.fit_memory_gib * 2**30)
    from higgs_pack.errors import HiggsPackError

    try:
        records = run_bench(options)
    except HiggsPackError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    builds = [r for r in records if r.get("kind") == "build"]
    steps = [r for r in records if r.get("kind") == systems.STEP_KIND]
    measured = [r for r in records if r.get("kind") is None]
    print("\n".join(filter(None, [report.render_builds(builds), *([report.render_table(measured), report.render_batch(measured),
                                                            report.render_details(measured)] if measured else []),
                                  report.render_prefill(measured + steps), report.render_steps(steps)])))
    if options.out:
        rec.write_records(builds + measured + steps, Path(options.out), options.append)
        print(f"wrote {options.out}")
        try:
            print(f"wrote {report.write_html(Path(options.out))}")
        except HiggsPackError as exc:
            print(f"note: no HTML report: {exc}", file=sys.stderr)
    over = [b["system"] for b in builds if (b.get("peak_rss_mb") or 0) > rec.BUILD_MEMORY_BUDGET_MB]
    if over:
        print(f"builds over the {rec.BUILD_MEMORY_BUDGET_MB} MB memory budget: {', '.join(over)}", file=sys.stderr)
    return 1 if over or any("error" in r or "error" in (r.get("batch") or {}) for r in records) else 0

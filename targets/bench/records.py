"""Benchmark records: their identifying fields, ratios to PyTorch and to the cpu bundle,
the goals they are judged against, the printed table and the JSON file.
"""

from __future__ import annotations

import io
import json
import math
from pathlib import Path
from typing import Any

from higgs_pack.targets.bench.systems import (
    GOAL_OUTSIDE_DECODER,
    GOAL_SPEEDUP_CPU_INT4,
    GOAL_WARM_LOAD_S,
    PYTORCH,
    SystemSpec,
)


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


#: Peak resident memory a build's whole process tree may use (DESIGN.md, real size: 12 GiB).
BUILD_MEMORY_BUDGET_MB = 12 * 1024


def render_builds(builds: list[dict[str, Any]]) -> str:
    """A text table of the ``"kind": "build"`` records: memory, scratch, time, size, per phase."""
    if not builds:
        return ""
    lines = [f"{'build':<22} {'peak RSS MB':>11} {'scratch MB':>10} {'time s':>7} {'bundle MB':>9}  verified  phases (s / peak MB)"]
    for b in builds:
        if "error" in b:
            lines.append(f"{b['system']:<22} error: {b['error']}")
            continue
        phases = "; ".join(f"{p['name'].split(' (')[0].replace('exporting ', '')}: {p['seconds']:.0f} s / "
                           f"{p['peak_rss_mb']:.0f}" for p in b.get("phases", []))
        budget = "" if (b.get("peak_rss_mb") or 0) <= BUILD_MEMORY_BUDGET_MB else "  OVER BUDGET"
        lines.append(f"{b['system'] + (' (cached)' if b.get('cached') else ''):<22} {b.get('peak_rss_mb') or 0:>11.0f} "
                     f"{b.get('scratch_peak_mb') or 0:>10.0f} {b.get('build_s') or 0:>7.0f} {b.get('bundle_mb') or 0:>9.0f}"
                     f"  {b.get('verified')!s:<8}  {phases}{budget}")
    return "\n".join(lines)


def write_records(records: list[dict[str, Any]], out: Path, append: bool = False) -> None:
    """Write the records as a JSON list; ``append`` keeps earlier records of other systems."""
    keep: list[dict[str, Any]] = []
    if append and out.is_file():
        fresh = {(r.get("kind"), r.get("label", r.get("system")), r["preset"]) for r in records}
        keep = [r for r in json.loads(out.read_text())
                if (r.get("kind"), r.get("label", r.get("system")), r.get("preset")) not in fresh]
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

    records = [r for r in json.loads(out.read_text()) if r.get("kind") != "build"]
    path = out.with_suffix(".html")
    marks = {"outside_decoder_frac": (GOAL_OUTSIDE_DECODER * 100, f"goal: under {GOAL_OUTSIDE_DECODER:.0%}")}
    path.write_text(bench_html(records, goal_checks(records), marks), encoding="utf-8")
    return path

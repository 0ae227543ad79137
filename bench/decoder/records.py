"""Benchmark records: identifying fields, the roofline, ratios, the goals they are judged against
(README, Benchmark), the ``--batch`` memory fit and the records' JSON file (goal states and the
file written whole: :mod:`bench.common.report`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bench.common.report import NOT_JUDGED, Goal, write_json
from bench.common.systems import PRESETS, PYTORCH, SystemSpec

# The issues' goals (2, 3, 9; 19 for --batch, judged at the full preset only).
GOAL_SPEEDUP_CPU_INT4 = 2.0
GOAL_OUTSIDE_DECODER = 0.05
GOAL_WARM_LOAD_S = 1.0
GOAL_LOOP_OVER_DECODER = 1.1
GOAL_FIRST_AUDIO = 1.1
GOAL_LONG_CONTEXT_STEP = 1.15
GOAL_ROOFLINE = 0.9
GOAL_BATCH4_SPEEDUP = 3.0
GOAL_BATCH8_SPEEDUP = 5.0
GOAL_BATCH4_STEP = 1.35
GOAL_ENGINE_OVER_BARE = 1.1
GOAL_STREAM_OVER_PLAIN = 0.9
#: Issue 32's prefill goal: at least 3x the positions/s measured before (full size, AMD EPYC 2 vCPUs,
#: a 219-position prompt: cpu int4 about 21, openvino int4 about 16) at 256 positions.
GOAL_PREFILL_SPEEDUP = 3.0
PREFILL_BEFORE = {"cpu": 21.0, "openvino": 16.0}
GOAL_PREFILL_LENGTH = "256"
#: Issue 30's goal: a named voice's first audio (with its prefix cached) over zero-shot's.
GOAL_NAMED_VOICE_FIRST_AUDIO = 1.15
#: Presets whose sizes make the speed goals mean something, and the full one.
SIZED_PRESETS = ("bench", "full")
FULL_PRESET = "full"
#: The memory budget and context of the largest batch (``fit_max_batch``).
FIT_MEMORY_BYTES = 12 * 2**30
FIT_POSITIONS = 2000
#: Peak RSS a build's whole process tree may use (12 GiB).
BUILD_MEMORY_BUDGET_MB = 12 * 1024
#: The bundles every sized preset must measure (else their goals read "not measured").
REQUIRED_SYSTEMS = (("cpu", "int4"), ("openvino", "int4"))


def subpart_weight_bytes(manifest: dict[str, Any], part: str) -> int:
    """Bytes of a sub-part's weight files (ONNX external data / OpenVINO .bin, else the graph)."""
    sizes = {f["path"]: f["size"] for f in manifest["files"]}
    files = [f for f in manifest["subparts"][part]["files"] if not f.endswith(".json")]
    return sum(sizes[f] for f in [f for f in files if f.endswith((".data", ".bin"))] or files)


def base_record(manifest: dict[str, Any] | None, spec: SystemSpec, preset: str) -> dict[str, Any]:
    """The identifying part of a record, from the bundle manifest (PyTorch: fixed)."""
    if manifest is None:
        return {"system": PYTORCH, "precision": "fp32", "label": spec.label, "preset": preset,
                "backend": "torch", "device": "cpu"}
    return {
        "system": manifest["target"], "precision": manifest["precision"], "label": spec.label, "preset": preset,
        "variant": manifest.get("variant"), "backend": manifest["backend"],
        "device": spec.device or manifest.get("device") or manifest.get("execution_provider"),
        "bundle": manifest["name"], "bundle_mb": sum(f["size"] for f in manifest["files"]) / 1e6,
        "decoder_weight_mb": subpart_weight_bytes(manifest, "llm_decoder") / 1e6,
        "heads_weight_mb": subpart_weight_bytes(manifest, "audio_heads") / 1e6,
    }


def roofline(record: dict[str, Any], bandwidth: dict[str, float] | None) -> None:
    """Add the memory-bandwidth roofline in place: a step reads the decoder weights and the KV of
    ``prompt_length + steps / 2`` positions on average (``kv_read_mb_per_step``); at that read rate
    (``roofline_min_frame_ms``) the loop, the bare decoder and each ``step_ms_ctx<L>`` reach
    ``roofline_frac``, ``roofline_frac_decoder``, ``roofline_frac_ctx<L>``.  ``cache_resident``:
    the weights fit the last-level cache (no fractions), None when its size is unknown."""
    weights = (record.get("decoder_weight_mb") or 0) * 1e6
    if not weights or not record.get("frames_per_s"):
        return
    llc = (record.get("machine") or {}).get("llc_bytes")
    record["cache_resident"] = None if not llc else weights <= llc
    if record["cache_resident"] or not bandwidth:
        return
    bw = bandwidth["bandwidth_gbps"] * 1e9
    per_position = record.get("kv_bytes_per_position") or 0
    kv = per_position * (record.get("prompt_length", 0) + record.get("steps", 0) / 2)
    min_s = (weights + kv) / bw
    record.update(kv_read_mb_per_step=kv / 1e6, roofline_min_frame_ms=min_s * 1e3,
                  roofline_frac=min_s * record["frames_per_s"])
    decoder_ms = record.get("step_ms", {}).get("decoder")
    if record.get("decoder_only_frames_per_s"):
        record["roofline_frac_decoder"] = min_s * record["decoder_only_frames_per_s"]
    elif decoder_ms:
        record["roofline_frac_decoder"] = min_s * 1e3 / decoder_ms
    for key in [k for k in record if k.startswith("step_ms_ctx")]:
        length = int(key.removeprefix("step_ms_ctx"))
        record[f"roofline_frac_ctx{length}"] = (weights + per_position * length) / bw * 1e3 / record[key]


def prefill_vs_peak(record: dict[str, Any]) -> None:
    """In place, from ``prefill_positions_per_s`` (``{"L": positions/s}``), the run's
    ``decoder_ops_per_position`` and ``gemm_peak_gops`` (``{"float32", "int8"}``): ``prefill_gops``
    ``{"L": GOP/s}`` of the decoder's MatMuls (attention left out) and ``prefill_vs_peak``
    ``{"float32": {"L": share}, "int8": {...}}`` of each peak; nothing without them."""
    rates, ops = record.get("prefill_positions_per_s"), record.get("decoder_ops_per_position")
    if not rates or not ops:
        return
    record["prefill_gops"] = {n: round(v * ops / 1e9, 2) for n, v in rates.items()}
    peaks = record.get("gemm_peak_gops") or {}
    record["prefill_vs_peak"] = {kind: {n: round(g / peak, 3) for n, g in record["prefill_gops"].items()}
                                 for kind, peak in peaks.items() if peak}


def first_audio_budget(record: dict[str, Any]) -> float | None:
    """Ms the first streamed audio should take, from the same streamed run's parts (prompt embed,
    prefill, steps to the first chunk, its codec decode: a shared VM's step drifts too much between
    runs to borrow them; the codec fed between the steps, ``first_chunk_codec_fed_ms``, is inside
    the steps' span and counted once); None without them."""
    need = ("first_audio_prefill_ms", "first_audio_steps_ms", "first_chunk_codec_ms")
    if any(record.get(k) is None for k in need):
        return None
    return (record.get("first_audio_prompt_embed_ms", 0.0) + sum(record[k] for k in need)
            - record.get("first_chunk_codec_fed_ms", 0.0))


def add_ratios(records: list[dict[str, Any]]) -> None:
    """In place, per preset: ratios to PyTorch, and ``speedup_vs_cpu`` to the cpu bundle of the same precision."""
    for preset in {r["preset"] for r in records}:
        same = [r for r in records if r["preset"] == preset and r.get("frames_per_s")]
        ref = next((r for r in same if r["system"] == PYTORCH), None)
        cpu = {r["precision"]: r for r in same if r["system"] == "cpu" and not r.get("variant")
               and r.get("device") in (None, "cpu")}
        for r in same:
            if ref is not None and r is not ref:
                r.update(speedup_vs_pytorch=r["frames_per_s"] / ref["frames_per_s"], rtf_vs_pytorch=r["rtf"] / ref["rtf"],
                         peak_rss_vs_pytorch=r["peak_rss_mb"] / ref["peak_rss_mb"])
            other = cpu.get(r["precision"])
            if other is not None and r is not other and r["system"] != PYTORCH:
                r.update(speedup_vs_cpu=r["frames_per_s"] / other["frames_per_s"], vs_cpu=other["label"])


def _find(measured: list[dict[str, Any]], preset: str, system: str, precision: str) -> dict[str, Any] | None:
    """One system's base variant on the CPU in one preset."""
    return next((r for r in measured if r["preset"] == preset and r["system"] == system
                 and r["precision"] == precision and not r.get("variant")
                 and r.get("device") in (None, "cpu", "CPU")), None)


def _missing(goal: str, **named: dict | None) -> Goal:
    return goal, None, f"no {' / '.join(n.replace('_', '-') for n, r in named.items() if r is None)} record"


def goal_checks(records: list[dict[str, Any]]) -> list[Goal]:
    """The issues' goals met, missed or not measured: speed and per-bundle goals per sized preset
    (``bench`` when none ran), the full-size goals, the tiny warm load and the ``--batch`` ones."""
    measured = [r for r in records if r.get("frames_per_s") and "error" not in r]
    presets = [p for p in SIZED_PRESETS if any(r["preset"] == p for r in measured)] or [SIZED_PRESETS[0]]
    checks: list[Goal] = []
    for preset in presets:
        cpu4, ov4 = _find(measured, preset, "cpu", "int4"), _find(measured, preset, "openvino", "int4")
        ref = _find(measured, preset, PYTORCH, "fp32")
        for goal, num, den, bound, names in (
                (f"cpu int4 >= {GOAL_SPEEDUP_CPU_INT4:g}x PyTorch frames/s", cpu4, ref, GOAL_SPEEDUP_CPU_INT4,
                 ("cpu_int4", "pytorch")),
                ("openvino int4 >= cpu int4 frames/s", ov4, cpu4, 1.0, ("openvino_int4", "cpu_int4"))):
            goal = f"[{preset}] {goal}"
            if num and den:
                s = num["frames_per_s"] / den["frames_per_s"]
                checks.append((goal, s >= bound, f"{s:.2f}x"))
            else:
                checks.append(_missing(goal, **dict(zip(names, (num, den), strict=True))))
        checks += _per_bundle_goals(measured, preset)
    checks += _full_size_goals(measured) + prefill_goals(measured)
    checks += [(f"{r['label']} warm-cache load < {GOAL_WARM_LOAD_S:g} s (tiny)", r["load_warm_s"] < GOAL_WARM_LOAD_S,
                f"{r['load_warm_s']:.3f} s") for r in records
               if r["system"] == "openvino" and r.get("load_warm_s") is not None and r["preset"] == "tiny"]
    return checks + batch_goals(records)


def _per_bundle_goals(measured: list[dict[str, Any]], preset: str) -> list[Goal]:
    """Outside-decoder share, loop over bare decoder and first audio, for every bundle measured
    and the required ones."""
    bundles = [r for r in measured if r["preset"] == preset and r["system"] != PYTORCH]
    bundles += [{"label": f"{s}-{p}", "missing": True} for s, p in REQUIRED_SYSTEMS
                if _find(measured, preset, s, p) is None]
    checks: list[Goal] = []
    for r in bundles:
        heads, decoder = r.get("heads_weight_mb"), r.get("decoder_weight_mb")
        share = f" (heads weights {heads / decoder:.1%} of the decoder's)" if heads and decoder else ""
        for goal, key, judge in (
                (f"outside-decoder time < {GOAL_OUTSIDE_DECODER:.0%} of a frame", "outside_decoder_frac",
                 lambda v, s=share: (v < GOAL_OUTSIDE_DECODER, f"{v:.1%}{s}")),
                (f"loop within {GOAL_LOOP_OVER_DECODER:g}x of its bare decoder", "loop_over_decoder",
                 lambda v: (v <= GOAL_LOOP_OVER_DECODER, f"{v:.3f}x")),
                (f"first audio <= {GOAL_FIRST_AUDIO:g} x (prefill + first chunk)", "first_audio_budget_ms",
                 lambda v, r=r: (r["first_audio_ms"] <= GOAL_FIRST_AUDIO * v,
                                 f"{r['first_audio_ms']:.0f} ms vs {v:.0f} ms ({r['first_audio_ms'] / v:.2f}x)"))):
            goal, value = f"[{preset}] {r['label']}: {goal}", r.get(key)
            checks.append((goal, None, "no record" if r.get("missing") else f"no {key}") if value is None
                          else (goal, *judge(value)))
    return checks


def _full_size_goals(measured: list[dict[str, Any]]) -> list[Goal]:
    """Long-context step, decoder weight bytes and the roofline, on the full preset."""
    cpu4, ov4 = _find(measured, FULL_PRESET, "cpu", "int4"), _find(measured, FULL_PRESET, "openvino", "int4")
    tag = f"[{FULL_PRESET}] "
    goal = tag + f"cpu int4 step at a 900-position context <= {GOAL_LONG_CONTEXT_STEP:g}x its 64-position step"
    if cpu4 and cpu4.get("step_ms_ctx900") and cpu4.get("step_ms_ctx64"):
        s = cpu4["step_ms_ctx900"] / cpu4["step_ms_ctx64"]
        checks = [(goal, s <= GOAL_LONG_CONTEXT_STEP,
                   f"{cpu4['step_ms_ctx900']:.1f} / {cpu4['step_ms_ctx64']:.1f} ms = {s:.2f}x")]
    else:
        checks = [(goal, None, "no step_ms_ctx64 / step_ms_ctx900") if cpu4 else _missing(goal, cpu_int4=None)]
    goal = tag + "cpu int4 decoder weight bytes <= openvino int4's"
    if cpu4 and ov4:
        a, b = cpu4["decoder_weight_mb"], ov4["decoder_weight_mb"]
        checks.append((goal, a <= b, f"{a:.0f} MB vs {b:.0f} MB"))
    else:
        checks.append(_missing(goal, cpu_int4=cpu4, openvino_int4=ov4))
    for name, r in (("cpu_int4", cpu4), ("openvino_int4", ov4)):
        goal = tag + f"{name.replace('_', '-')}: decoder >= {GOAL_ROOFLINE:g} of its memory-bandwidth roofline"
        if r is None:
            checks.append(_missing(goal, **{name: None}))
        elif r.get("cache_resident"):
            checks.append((goal, None, "cache-resident: the decoder weights fit in the last-level cache"))
        elif r.get("roofline_frac_decoder") is None:
            checks.append((goal, None, "no bandwidth measurement"))
        else:
            checks.append((goal, r["roofline_frac_decoder"] >= GOAL_ROOFLINE, f"{r['roofline_frac_decoder']:.2f}"))
    return checks


def prefill_goals(measured: list[dict[str, Any]]) -> list[Goal]:
    """Issue 32's prefill goal (cpu int4 and openvino int4 at 256 positions >= 3x before) and
    issue 30's named-voice first audio (cached prefix, <= 1.15x zero-shot), at full size."""
    checks: list[Goal] = []
    for system in ("cpu", "openvino"):
        r, goal = _find(measured, FULL_PRESET, system, "int4"), (
            f"[{FULL_PRESET}] {system} int4 prefill at {GOAL_PREFILL_LENGTH} positions >= {GOAL_PREFILL_SPEEDUP:g}x "
            f"before ({PREFILL_BEFORE[system]:g} positions/s)")
        rate = (r or {}).get("prefill_positions_per_s", {}).get(GOAL_PREFILL_LENGTH)
        if r is None:
            checks.append(_missing(goal, **{f"{system}_int4": None}))
        elif rate is None:
            checks.append((goal, None, "no prefill_positions_per_s at 256"))
        else:
            s = rate / PREFILL_BEFORE[system]
            checks.append((goal, s >= GOAL_PREFILL_SPEEDUP, f"{rate:.1f} positions/s ({s:.2f}x)"))
        goal = (f"[{FULL_PRESET}] {system} int4: named voice's first audio (cached prefix) <= "
                f"{GOAL_NAMED_VOICE_FIRST_AUDIO:g}x zero-shot")
        ratio = (r or {}).get("first_audio_vs_zero_shot", {})
        if r is None:
            checks.append(_missing(goal, **{f"{system}_int4": None}))
        elif "named_cached" not in ratio:
            checks.append((goal, None, "no named_cached first audio" + (
                f" (without the cache {ratio['named']:.2f}x)" if "named" in ratio else "")))
        else:
            checks.append((goal, ratio["named_cached"] <= GOAL_NAMED_VOICE_FIRST_AUDIO, f"{ratio['named_cached']:.2f}x"))
    return checks


def batch_memory(manifest: dict[str, Any], engine_per_position: int | None, bench_per_position: int | None,
                 memory_bytes: int = FIT_MEMORY_BYTES) -> dict[str, Any]:
    """The largest batch whose KV cache at :data:`FIT_POSITIONS` positions fits ``memory_bytes``
    beside every sub-part's weights: ``floor((memory - weights) / (positions x KV bytes per
    position))``, those bytes the engine's, else the bench's reading (``fit_kv_source``)."""
    weights = sum(subpart_weight_bytes(manifest, part) for part in manifest["subparts"])
    per_position, source = ((engine_per_position, "engine") if engine_per_position
                            else (bench_per_position, "bench") if bench_per_position else (None, None))
    fit = max(0, (memory_bytes - weights) // (per_position * FIT_POSITIONS)) if per_position else None
    return {"fit_memory_bytes": memory_bytes, "fit_positions": FIT_POSITIONS, "fit_weight_bytes": weights,
            "fit_kv_bytes_per_position": per_position, "fit_kv_source": source, "fit_max_batch": fit,
            "fit_computed": True}


def batch_rows(record: dict[str, Any]) -> list[dict[str, Any]]:
    """A record's ``--batch`` rows with ``vs_batch1``, ``step_vs_batch1`` and ``max_kv_kib_in_use``."""
    batch = record.get("batch")
    rows = {row["batch"]: row for row in batch.get("rows", [])} if isinstance(batch, dict) else {}
    one, out = rows.get(1, {}), []
    for row in map(dict, rows.values()):
        if row.get("aggregate_frames_per_s") and one.get("aggregate_frames_per_s"):
            row["vs_batch1"] = row["aggregate_frames_per_s"] / one["aggregate_frames_per_s"]
        if row.get("engine_step_ms") and one.get("engine_step_ms"):
            row["step_vs_batch1"] = row["engine_step_ms"] / one["engine_step_ms"]
        if row.get("max_kv_bytes_in_use") is not None:
            row["max_kv_kib_in_use"] = row["max_kv_bytes_in_use"] / 1024
        out.append(row)
    return out


def batch_goals(records: list[dict[str, Any]]) -> list[Goal]:
    """Issue 19's engine goals per preset with a ``--batch`` measurement, for every bundle there and
    the required ones: batch 4 and 8 over batch 1, the step at batch 4, engine over bare and
    streamed over plain at every size; judged at full size, elsewhere ``met`` None and
    "would be met/missed; judged at full size only"."""
    batched = [r for r in records if isinstance(r.get("batch"), dict)]
    checks: list[Goal] = []
    for preset in [p for p in PRESETS if any(r["preset"] == p for r in batched)]:
        here = [r for r in batched if r["preset"] == preset]
        here += [{"label": f"{s}-{p}", "missing": True} for s, p in REQUIRED_SYSTEMS
                 if not any(r["system"] == s and r["precision"] == p and not r.get("variant") for r in here)]
        for r in here:
            checks += _batch_goals_of(r, preset)
    return checks


def _batch_goals_of(record: dict[str, Any], preset: str) -> list[Goal]:
    rows = {row["batch"]: row for row in batch_rows(record)}
    measured = [b for b, row in sorted(rows.items()) if "refused" not in row]

    def judged(goal: str, ok: bool, text: str) -> Goal:
        if preset == FULL_PRESET:
            return goal, ok, text
        return goal, None, f"{text}: would be {'met' if ok else 'missed'}; {NOT_JUDGED}"

    def figure(size: int, key: str) -> tuple[float | None, str]:
        row = rows.get(size)
        if row is None:
            return None, f"batch {size} not measured (not in --batch)"
        if "refused" in row:
            return None, f"batch {size} refused: {row['refused'].split(';')[0]}"
        value = row.get(key)
        return (value, "") if isinstance(value, (int, float)) and value else (None, f"no {key} at batch {size}")

    def ratio(goal: str, key: str, size: int, bound: float, at_least: bool) -> Goal:
        (num, why_num), (den, why_den) = figure(size, key), figure(1, key)
        if num is None or den is None:
            return goal, None, why_num or why_den
        s = num / den
        return judged(goal, s >= bound if at_least else s <= bound, f"{num:.3g} / {den:.3g} = {s:.2f}x")

    def every(goal: str, key: str, bound: float, at_least: bool) -> Goal:
        values = {b: rows[b].get(key) for b in measured}
        if not values or any(not isinstance(v, (int, float)) for v in values.values()):
            return goal, None, f"no {key} at batch {', '.join(map(str, measured))}" if measured else "no batch measured"
        ok = min(values.values()) >= bound if at_least else max(values.values()) <= bound
        return judged(goal, ok, ", ".join(f"B={b} {v:.2f}x" for b, v in values.items()))

    goals = (
        (f"aggregate frames/s at batch 4 >= {GOAL_BATCH4_SPEEDUP:g}x batch 1",
         lambda g: ratio(g, "aggregate_frames_per_s", 4, GOAL_BATCH4_SPEEDUP, True)),
        (f"aggregate frames/s at batch 8 >= {GOAL_BATCH8_SPEEDUP:g}x batch 1",
         lambda g: ratio(g, "aggregate_frames_per_s", 8, GOAL_BATCH8_SPEEDUP, True)),
        (f"per-request step at batch 4 <= {GOAL_BATCH4_STEP:g}x batch 1",
         lambda g: ratio(g, "engine_step_ms", 4, GOAL_BATCH4_STEP, False)),
        (f"engine step within {GOAL_ENGINE_OVER_BARE:g}x of its bare batched decoder at every batch",
         lambda g: every(g, "engine_over_bare", GOAL_ENGINE_OVER_BARE, False)),
        (f"streamed aggregate frames/s >= {GOAL_STREAM_OVER_PLAIN:g}x plain at every batch",
         lambda g: every(g, "stream_over_plain", GOAL_STREAM_OVER_PLAIN, True)),
    )
    name = f"[{preset}] {record['label']}: "
    error = None if record.get("missing") else record["batch"].get("error")
    if record.get("missing") or error:
        why = "no --batch record" if record.get("missing") else f"the batch run failed: {error.splitlines()[0]}"
        return [(name + goal, None, why) for goal, _ in goals]
    return [judge(name + goal) for goal, judge in goals]


def write_records(records: list[dict[str, Any]], out: Path, append: bool = False) -> None:
    """Write the records as a JSON list ending with one ``{"kind": "goals", "goals": [{"goal",
    "met", "measured"}]}`` of every measurement written; ``append`` keeps earlier records of other
    systems (an earlier goals record is replaced)."""
    def key(r: dict[str, Any]) -> tuple:
        return r.get("kind"), r.get("label", r.get("system")), r.get("preset")

    keep: list[dict[str, Any]] = []
    if append and out.is_file():
        fresh = {key(r) for r in records}
        keep = [r for r in json.loads(out.read_text()) if r.get("kind") != "goals" and key(r) not in fresh]
    rows = keep + [r for r in records if r.get("kind") != "goals"]
    goals = {"kind": "goals", "goals": [{"goal": g, "met": met, "measured": m}
                                        for g, met, m in goal_checks([r for r in rows if r.get("kind") is None])]}
    write_json([*rows, goals], out)

"""Benchmark records: their identifying fields, ratios to PyTorch and to the cpu bundle,
the goals they are judged against, the printed table and the JSON file.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from bench.systems import (
    FIT_MEMORY_BYTES,
    FIT_POSITIONS,
    FULL_PRESET,
    GOAL_BATCH4_SPEEDUP,
    GOAL_BATCH4_STEP,
    GOAL_BATCH8_SPEEDUP,
    GOAL_ENGINE_OVER_BARE,
    GOAL_FIRST_AUDIO,
    GOAL_LONG_CONTEXT_STEP,
    GOAL_LOOP_OVER_DECODER,
    GOAL_OUTSIDE_DECODER,
    GOAL_ROOFLINE,
    GOAL_SPEEDUP_CPU_INT4,
    GOAL_STREAM_OVER_PLAIN,
    GOAL_WARM_LOAD_S,
    PRESETS,
    PYTORCH,
    SIZED_PRESETS,
    SystemSpec,
    table,
)


def _subpart_weight_bytes(manifest: dict[str, Any], part: str) -> int:
    """Bytes of a sub-part's weight files (ONNX external data / OpenVINO .bin, else the graph)."""
    sizes = {f["path"]: f["size"] for f in manifest["files"]}
    files = [f for f in manifest["subparts"][part]["files"] if not f.endswith(".json")]
    weights = [f for f in files if f.endswith((".data", ".bin"))] or files
    return sum(sizes[f] for f in weights)


def _heads_share(record: dict[str, Any]) -> str:
    """``" (heads weights X% of the decoder's)"``: the audio heads run every frame and read all
    their weights, so at the same speed per byte as the decoder they alone take about that
    share of a frame (a floor for the outside-decoder goal); empty when the sizes are unknown."""
    heads, decoder = record.get("heads_weight_mb"), record.get("decoder_weight_mb")
    return f" (heads weights {heads / decoder:.1%} of the decoder's)" if heads and decoder else ""


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


def roofline(record: dict[str, Any], bandwidth: dict[str, float] | None) -> None:
    """Add the memory-bandwidth roofline of a measured record, in place.

    A decode step reads every decoder weight once plus the KV cache of every earlier
    position: ``kv_bytes_per_position`` (key and value of every layer,
    ``2 * num_layers * num_key_value_heads * head_dim * KV itemsize``, from the manifest's
    constants and the loaded decoder's KV dtype) times the positions attended. The loop's
    timed steps attend ``prompt_length + 1`` … ``prompt_length + steps - 1`` positions, so
    they read on average ``prompt_length + steps / 2`` positions (``kv_read_mb_per_step``);
    a step at context ``L`` (``step_ms_ctx<L>``) reads ``L`` positions. The fastest a
    step can be is those bytes over the measured read bandwidth (``roofline_min_frame_ms``).

    Fields: ``cache_resident`` (True: the decoder's weight bytes fit in the last-level
    cache, ``machine.llc_bytes``, so DRAM bandwidth does not bound the step and no roofline
    fraction is given; False: they do not fit; None: the cache size is unknown, the fractions
    are given), ``roofline_frac`` (the loop's frames/s over the roofline's),
    ``roofline_frac_decoder`` (the bare decoder's: ``decoder_only_frames_per_s``, else the
    loop's decoder time), ``roofline_frac_ctx<L>`` (the bare decoder's step at context ``L``).
    GB = 1e9 bytes, MB = 1e6.
    """
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
    record["kv_read_mb_per_step"] = kv / 1e6
    min_s = (weights + kv) / bw
    record["roofline_min_frame_ms"] = min_s * 1e3
    record["roofline_frac"] = min_s * record["frames_per_s"]
    decoder_ms = record.get("step_ms", {}).get("decoder")
    if record.get("decoder_only_frames_per_s"):
        record["roofline_frac_decoder"] = min_s * record["decoder_only_frames_per_s"]
    elif decoder_ms:
        record["roofline_frac_decoder"] = min_s * 1e3 / decoder_ms
    for key in [k for k in record if k.startswith("step_ms_ctx")]:
        length = int(key.removeprefix("step_ms_ctx"))
        record[f"roofline_frac_ctx{length}"] = (weights + per_position * length) / bw * 1e3 / record[key]


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


#: One goal row: ``(goal, met, measured)``; ``met`` is None when the goal was not measured
#: (its systems or preset are missing from the records, or the measure does not apply), and
#: ``measured`` then says why.
Goal = tuple[str, bool | None, str]


def goal_checks(records: list[dict[str, Any]]) -> list[Goal]:
    """The issues' targets met, missed or not measured by ``records``, as ``(goal, met, numbers)``.

    Speed goals are judged per sized preset (``bench`` and ``full``; the tiny model's decoder
    is too small for them to mean anything; when neither was run they are listed for
    ``bench`` as not measured), the full-size goals on ``full``, the warm-load goal on
    ``tiny``. A goal whose systems are missing is listed with ``met`` None, never as met:

    * cpu int4 at least ``GOAL_SPEEDUP_CPU_INT4`` x PyTorch frames/s; openvino int4 at
      least cpu int4 frames/s;
    * cpu int4 and openvino int4 (and every other bundle measured): outside-decoder share
      under ``GOAL_OUTSIDE_DECODER``, loop time per frame within ``GOAL_LOOP_OVER_DECODER``
      of the bare decoder's (``loop_over_decoder``), first streamed audio at most
      ``GOAL_FIRST_AUDIO`` x (prompt + prefill + the steps before the first chunk at the
      loop's step time + the first chunk's codec decode);
    * full preset: cpu int4 ``step_ms_ctx900`` within ``GOAL_LONG_CONTEXT_STEP`` of
      ``step_ms_ctx64``; cpu int4 decoder weight bytes at most openvino int4's; both decoders
      at least ``GOAL_ROOFLINE`` of their roofline (``roofline_frac_decoder``) unless
      cache-resident;
    * where records carry a ``--batch`` measurement: the engine's goals (:func:`batch_goals`).
    """
    measured = [r for r in records if r.get("frames_per_s") and "error" not in r]
    presets = [p for p in SIZED_PRESETS if any(r["preset"] == p for r in measured)] or [SIZED_PRESETS[0]]
    checks: list[Goal] = []
    for preset in presets:
        checks += _speed_goals(measured, preset)
        checks += _per_bundle_goals(measured, preset)
    checks += _full_size_goals(measured)
    checks += [(f"{r['label']} warm-cache load < {GOAL_WARM_LOAD_S:g} s (tiny)",
                r["load_warm_s"] < GOAL_WARM_LOAD_S, f"{r['load_warm_s']:.3f} s")
               for r in records
               if r["system"] == "openvino" and r.get("load_warm_s") is not None and r["preset"] == "tiny"]
    checks += batch_goals(records)
    return checks


#: The bundles every sized preset must measure (their goals are listed as not measured otherwise).
REQUIRED_SYSTEMS = (("cpu", "int4"), ("openvino", "int4"))


def _find(measured: list[dict[str, Any]], preset: str, system: str, precision: str) -> dict[str, Any] | None:
    """The record of one system's base variant on the CPU in one preset, or None."""
    return next((r for r in measured if r["preset"] == preset and r["system"] == system
                 and r["precision"] == precision and not r.get("variant")
                 and r.get("device") in (None, "cpu", "CPU")), None)


def _missing(preset: str, goal: str, *what: str) -> Goal:
    return (f"[{preset}] {goal}", None, f"no {' / '.join(what)} record")


def _ratio_goal(preset: str, goal: str, num: dict | None, den: dict | None, names: tuple[str, str],
                at_least: float) -> Goal:
    """``num/den`` frames/s at least ``at_least``, or which of the two records is missing."""
    if num and den:
        s = num["frames_per_s"] / den["frames_per_s"]
        return (f"[{preset}] {goal}", s >= at_least, f"{s:.2f}x")
    return _missing(preset, goal, *([] if num else [names[0]]), *([] if den else [names[1]]))


def _speed_goals(measured: list[dict[str, Any]], preset: str) -> list[Goal]:
    """cpu int4 against PyTorch, openvino int4 against cpu int4 (frames/s, side by side)."""
    cpu4, ov4 = _find(measured, preset, "cpu", "int4"), _find(measured, preset, "openvino", "int4")
    ref = _find(measured, preset, PYTORCH, "fp32")
    return [
        _ratio_goal(preset, f"cpu int4 >= {GOAL_SPEEDUP_CPU_INT4:g}x PyTorch frames/s", cpu4, ref,
                    ("cpu-int4", "pytorch"), GOAL_SPEEDUP_CPU_INT4),
        _ratio_goal(preset, "openvino int4 >= cpu int4 frames/s", ov4, cpu4, ("openvino-int4", "cpu-int4"), 1.0),
    ]


def _per_bundle_goals(measured: list[dict[str, Any]], preset: str) -> list[Goal]:
    """Outside-decoder share, loop over bare decoder and first audio, for every bundle measured
    (and the required ones, listed as not measured when missing)."""
    bundles = [r for r in measured if r["preset"] == preset and r["system"] != PYTORCH]
    bundles += [{"label": f"{system}-{precision}", "missing": True} for system, precision in REQUIRED_SYSTEMS
                if _find(measured, preset, system, precision) is None]
    checks: list[Goal] = []
    for r in bundles:
        per_system = (
            (f"outside-decoder time < {GOAL_OUTSIDE_DECODER:.0%} of a frame", "outside_decoder_frac",
             lambda v, r=r: (v < GOAL_OUTSIDE_DECODER, f"{v:.1%}{_heads_share(r)}")),
            (f"loop within {GOAL_LOOP_OVER_DECODER:g}x of its bare decoder", "loop_over_decoder",
             lambda v: (v <= GOAL_LOOP_OVER_DECODER, f"{v:.3f}x")),
            (f"first audio <= {GOAL_FIRST_AUDIO:g} x (prefill + first chunk)", "first_audio_budget_ms",
             lambda v, r=r: (r["first_audio_ms"] <= GOAL_FIRST_AUDIO * v,
                             f"{r['first_audio_ms']:.0f} ms vs {v:.0f} ms ({r['first_audio_ms'] / v:.2f}x)")),
        )
        for goal, key, judge in per_system:
            value = r.get(key)
            if value is None:
                checks.append((f"[{preset}] {r['label']}: {goal}", None,
                               "no record" if r.get("missing") else f"no {key}"))
            else:
                checks.append((f"[{preset}] {r['label']}: {goal}", *judge(value)))
    return checks


def _full_size_goals(measured: list[dict[str, Any]]) -> list[Goal]:
    """Long-context step, decoder weight bytes and the roofline, on the full preset."""
    full = FULL_PRESET
    cpu4, ov4 = _find(measured, full, "cpu", "int4"), _find(measured, full, "openvino", "int4")
    checks: list[Goal] = []
    goal = f"cpu int4 step at a 900-position context <= {GOAL_LONG_CONTEXT_STEP:g}x its 64-position step"
    if cpu4 and cpu4.get("step_ms_ctx900") and cpu4.get("step_ms_ctx64"):
        s = cpu4["step_ms_ctx900"] / cpu4["step_ms_ctx64"]
        checks.append((f"[{full}] {goal}", s <= GOAL_LONG_CONTEXT_STEP,
                       f"{cpu4['step_ms_ctx900']:.1f} / {cpu4['step_ms_ctx64']:.1f} ms = {s:.2f}x"))
    elif cpu4:
        checks.append((f"[{full}] {goal}", None, "no step_ms_ctx64 / step_ms_ctx900"))
    else:
        checks.append(_missing(full, goal, "cpu-int4"))
    goal = "cpu int4 decoder weight bytes <= openvino int4's"
    if cpu4 and ov4:
        a, b = cpu4["decoder_weight_mb"], ov4["decoder_weight_mb"]
        checks.append((f"[{full}] {goal}", a <= b, f"{a:.0f} MB vs {b:.0f} MB"))
    else:
        checks.append(_missing(full, goal, *([] if cpu4 else ["cpu-int4"]), *([] if ov4 else ["openvino-int4"])))
    for name, r in (("cpu-int4", cpu4), ("openvino-int4", ov4)):
        goal = f"{name}: decoder >= {GOAL_ROOFLINE:g} of its memory-bandwidth roofline"
        if r is None:
            checks.append(_missing(full, goal, name))
        elif r.get("cache_resident"):
            checks.append((f"[{full}] {goal}", None, "cache-resident: the decoder weights fit in the last-level cache"))
        elif r.get("roofline_frac_decoder") is None:
            checks.append((f"[{full}] {goal}", None, "no bandwidth measurement"))
        else:
            f = r["roofline_frac_decoder"]
            checks.append((f"[{full}] {goal}", f >= GOAL_ROOFLINE, f"{f:.2f}"))
    return checks


#: Ends the ``measured`` text of a goal computed at a preset where it is not judged (``met`` None).
NOT_JUDGED = "judged at full size only"


def goal_state(met: bool | None, measured: str = "") -> str:
    """How a goal row reads: ``met``, ``MISSED``, ``not measured``, or ``not judged`` (a goal
    computed at a preset where it is not judged, :data:`NOT_JUDGED`)."""
    if met is None:
        return "not judged" if measured.endswith(NOT_JUDGED) else "not measured"
    return "met" if met else "MISSED"


# ----------------------------------------------------------------------------- --batch


def batch_memory(manifest: dict[str, Any], engine_per_position: int | None,
                 bench_per_position: int | None, memory_bytes: int = FIT_MEMORY_BYTES) -> dict[str, Any]:
    """The largest batch whose KV cache fits ``memory_bytes`` (default :data:`FIT_MEMORY_BYTES`)
    beside the bundle's weights at :data:`FIT_POSITIONS` positions per request: computed (``--fit-run``
    runs it: :mod:`~bench.kv_fit`).

    ``fit_max_batch = floor((memory_bytes - fit_weight_bytes) / (FIT_POSITIONS x
    fit_kv_bytes_per_position))``, where the weight bytes are every sub-part's weight files
    (ONNX external data, OpenVINO ``.bin``, else the graph) and the KV bytes per position are
    the engine's (``engine.kv_bytes_per_position``: the KV dtype its decoder binds), else the
    bench's own reading of the loaded decoder (OpenVINO's ``KV_CACHE_PRECISION``, its per-group
    scales not counted; ``fit_kv_source`` says which).  Codec, activations and the OS are
    not counted.
    """
    weights = sum(_subpart_weight_bytes(manifest, part) for part in manifest["subparts"])
    per_position, source = ((engine_per_position, "engine") if engine_per_position
                            else (bench_per_position, "bench") if bench_per_position else (None, None))
    fit = None
    if per_position:
        fit = max(0, (memory_bytes - weights) // (per_position * FIT_POSITIONS))
    return {"fit_memory_bytes": memory_bytes, "fit_positions": FIT_POSITIONS, "fit_weight_bytes": weights,
            "fit_kv_bytes_per_position": per_position, "fit_kv_source": source, "fit_max_batch": fit,
            "fit_computed": True}


def batch_rows(record: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """A record's ``--batch`` rows by batch size (empty without a batch measurement)."""
    batch = record.get("batch")
    return {row["batch"]: row for row in batch.get("rows", [])} if isinstance(batch, dict) else {}


def _refusal(reason: str) -> str:
    """The engine's refusal up to its advice (``…; use engine(max_batch=1) …``)."""
    return reason.split(";")[0]


def _batch_figure(rows: dict[int, dict[str, Any]], size: int, key: str) -> tuple[float | None, str]:
    """``rows[size][key]``, or None and why it is missing."""
    row = rows.get(size)
    if row is None:
        return None, f"batch {size} not measured (not in --batch)"
    if "refused" in row:
        return None, f"batch {size} refused: {_refusal(row['refused'])}"
    value = row.get(key)
    return (value, "") if isinstance(value, (int, float)) and value else (None, f"no {key} at batch {size}")


def batch_goals(records: list[dict[str, Any]]) -> list[Goal]:
    """Issue 19's goals for the engine, from the records' ``batch`` measurements (``--batch``).

    For every preset with a batch measurement, every bundle measured there, and cpu int4 and
    openvino int4 (listed as not measured when missing): aggregate frames/s at batch 4 at least
    ``GOAL_BATCH4_SPEEDUP`` x batch 1 and at batch 8 at least ``GOAL_BATCH8_SPEEDUP`` x;
    the engine's step at batch 4 at most ``GOAL_BATCH4_STEP`` x batch 1; the engine's step
    within ``GOAL_ENGINE_OVER_BARE`` of its bare batched decoder at every batch measured;
    streamed aggregate frames/s at least ``GOAL_STREAM_OVER_PLAIN`` x plain at every batch.
    Each ratio is of figures measured side by side in one process.  They are judged on the
    full preset only; elsewhere they are computed and printed with ``met`` None and the
    measured text ending in :data:`NOT_JUDGED` (``would be met`` / ``would be missed``).
    """
    batched = [r for r in records if isinstance(r.get("batch"), dict)]
    checks: list[Goal] = []
    for preset in [p for p in PRESETS if any(r["preset"] == p for r in batched)]:
        here = [r for r in batched if r["preset"] == preset]
        here += [{"label": f"{system}-{precision}", "missing": True} for system, precision in REQUIRED_SYSTEMS
                 if not any(r["system"] == system and r["precision"] == precision and not r.get("variant")
                            for r in here)]
        for r in here:
            checks += _batch_goals_of(r, preset)
    return checks


def _batch_goals_of(record: dict[str, Any], preset: str) -> list[Goal]:
    rows = batch_rows(record)
    error = record.get("batch", {}).get("error") if not record.get("missing") else None
    measured = [b for b, row in sorted(rows.items()) if "refused" not in row]

    def verdict(goal: str, ok: bool, text: str) -> Goal:
        if preset == FULL_PRESET:
            return goal, ok, text
        return goal, None, f"{text}: would be {'met' if ok else 'missed'}; {NOT_JUDGED}"

    def ratio(goal: str, key: str, size: int, bound: float, at_least: bool) -> Goal:
        num, why_num = _batch_figure(rows, size, key)
        den, why_den = _batch_figure(rows, 1, key)
        if num is None or den is None:
            return goal, None, why_num or why_den
        s = num / den
        return verdict(goal, s >= bound if at_least else s <= bound, f"{num:.3g} / {den:.3g} = {s:.2f}x")

    def every(goal: str, key: str, bound: float, at_least: bool) -> Goal:
        values = {b: rows[b].get(key) for b in measured}
        if not values or any(not isinstance(v, (int, float)) for v in values.values()):
            return goal, None, f"no {key} at batch {', '.join(map(str, measured))}" if measured else "no batch measured"
        worst = min(values.values()) if at_least else max(values.values())
        ok = worst >= bound if at_least else worst <= bound
        return verdict(goal, ok, ", ".join(f"B={b} {v:.2f}x" for b, v in values.items()))

    name = f"[{preset}] {record['label']}: "
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
    if record.get("missing"):
        return [(name + goal, None, "no --batch record") for goal, _ in goals]
    if error:
        return [(name + goal, None, f"the batch run failed: {error.splitlines()[0]}") for goal, _ in goals]
    return [judge(name + goal) for goal, judge in goals]


#: (header, row key, format) of the printed ``--batch`` table.
BATCH_COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("B", "batch", "{}"),
    ("aggregate f/s", "aggregate_frames_per_s", "{:.1f}"),
    ("per request f/s", "per_request_frames_per_s", "{:.1f}"),
    ("vs B=1", "vs_batch1", "{:.2f}x"),
    ("step ms", "engine_step_ms", "{:.2f}"),
    ("step vs B=1", "step_vs_batch1", "{:.2f}x"),
    ("bare step ms", "bare_step_ms", "{:.2f}"),
    ("engine/bare", "engine_over_bare", "{:.3f}x"),
    ("streamed f/s", "stream_aggregate_frames_per_s", "{:.1f}"),
    ("streamed/plain", "stream_over_plain", "{:.2f}x"),
    ("join 1st audio ms", "join_first_audio_ms", "{:.0f}"),
    ("join splice ms", "join_splice_ms", "{:.1f}"),
    ("KV in use KiB", "max_kv_kib_in_use", "{:.0f}"),
)


def batch_table_rows(record: dict[str, Any]) -> list[dict[str, Any]]:
    """A record's ``--batch`` rows with the derived columns of :data:`BATCH_COLUMNS`
    (``vs_batch1``, ``step_vs_batch1``: over batch 1 of the same run; ``max_kv_kib_in_use``)."""
    rows = batch_rows(record)
    one = rows.get(1, {})
    out = []
    for size, row in rows.items():
        row = dict(row)
        if row.get("aggregate_frames_per_s") and one.get("aggregate_frames_per_s"):
            row["vs_batch1"] = row["aggregate_frames_per_s"] / one["aggregate_frames_per_s"]
        if row.get("engine_step_ms") and one.get("engine_step_ms"):
            row["step_vs_batch1"] = row["engine_step_ms"] / one["engine_step_ms"]
        if row.get("max_kv_bytes_in_use") is not None:
            row["max_kv_kib_in_use"] = row["max_kv_bytes_in_use"] / 1024
        row.setdefault("batch", size)
        out.append(row)
    return out


def batch_facts(record: dict[str, Any]) -> str:
    """One line per record: KV bytes per position, the computed memory fit, the load average."""
    batch = record.get("batch") or {}
    if batch.get("error"):
        return f"{record['label']} [{record['preset']}] --batch: ERROR {batch['error']}"
    per = batch.get("kv_bytes_per_position")
    kv = (f"KV {per} B per position (engine.kv_bytes_per_position)" if per is not None else
          "KV bytes per position: the engine cannot say (engine.kv_bytes_per_position is None)")
    fit = ""
    if batch.get("fit_max_batch") is not None:
        fit = (f"; largest batch in {batch['fit_memory_bytes'] / 2**30:g} GiB at {batch['fit_positions']} positions: "
               f"{batch['fit_max_batch']} (computed, not run: weights {batch['fit_weight_bytes'] / 2**20:.0f} MiB + "
               f"B x {batch['fit_positions']} x {batch['fit_kv_bytes_per_position']} B, KV bytes from the "
               f"{batch['fit_kv_source']})")
        if batch.get("fit_run_peak_rss_mb") is not None:
            fit += (f"; run: {batch['fit_run_batch']} rows full, peak RSS {batch['fit_run_peak_rss_mb']:.0f} MB "
                    f"({'fits' if batch.get('fit_run_fits') else 'EXCEEDS'} the budget), step "
                    f"{batch['fit_run_step_ms']:.0f} ms")
        elif batch.get("fit_run_skipped") or batch.get("fit_run_error"):
            fit += f"; run: {batch.get('fit_run_skipped') or 'ERROR ' + batch['fit_run_error']}"
    load = batch.get("loadavg_1m") or []
    load_text = (f"; load average {load[0]:.2f} before, {load[1]:.2f} after"
                 if len(load) == 2 and None not in load else "")
    return f"{record['label']} [{record['preset']}] --batch: {kv}{fit}{load_text}"


def render_batch(records: list[dict[str, Any]]) -> str:
    """The ``--batch`` measurements as a table (one row per system and batch size) and a line
    of facts per system; empty when no record has one."""
    batched = [r for r in records if isinstance(r.get("batch"), dict)]
    if not batched:
        return ""
    rows, facts = [], []
    for r in batched:
        facts.append(batch_facts(r))
        for row in batch_table_rows(r):
            if "refused" in row:
                rows.append([r["label"], str(row["batch"]), "refused"] + ["-"] * (len(BATCH_COLUMNS) - 2))
                facts.append(f"{r['label']} [{r['preset']}] batch {row['batch']} refused by the engine: "
                             f"{row['refused']}")
            else:
                rows.append([r["label"]] + [cell(row, key, fmt) for _, key, fmt in BATCH_COLUMNS])
    presets = sorted({r["preset"] for r in batched})
    text = table(f"higgs-pack bench --batch, preset {', '.join(presets)}",
                 ["system"] + [h for h, _, _ in BATCH_COLUMNS], rows)
    return text + "\n" + "\n".join(facts)


def first_audio_budget(record: dict[str, Any]) -> float | None:
    """Milliseconds the first streamed audio should take, from the parts of the streamed run
    itself: its prompt embedding, its prefill, the span of its decode steps up to the first
    chunk (heads, embed and sampling included) and the first chunk's codec decode.  What
    ``first_audio_ms`` adds on top is the streaming path's own cost.

    The parts come from the same streamed run, not from the plain run before it: on a shared
    2-core VM the full-size cpu int4 step drifted between 130 and 182 ms from one run to the
    next (AMD EPYC, AVX2), which alone moved the ratio between 1.02x and 1.24x.  None when
    the streaming fields are missing.
    """
    need = ("first_audio_prefill_ms", "first_audio_steps_ms", "first_chunk_codec_ms")
    if any(record.get(k) is None for k in need):
        return None
    return (record.get("first_audio_prompt_embed_ms", 0.0) + record["first_audio_prefill_ms"]
            + record["first_audio_steps_ms"] + record["first_chunk_codec_ms"])


#: (header, record key, format) of the printed table.
COLUMNS: tuple[tuple[str, str, str], ...] = (
    ("system", "label", "{}"),
    ("frames/s", "frames_per_s", "{:.1f}"),
    ("vs torch", "speedup_vs_pytorch", "{:.2f}x"),
    ("vs cpu", "speedup_vs_cpu", "{:.2f}x"),
    ("1st frame ms", "first_frame_ms", "{:.0f}"),
    ("1st audio ms", "first_audio_ms", "{:.0f}"),
    ("stream f/s", "stream_frames_per_s", "{:.1f}"),
    ("dec-only f/s", "decoder_only_frames_per_s", "{:.1f}"),
    ("loop/dec", "loop_over_decoder", "{:.3f}x"),
    ("RTF", "rtf", "{:.3f}"),
    ("peak RSS MB", "peak_rss_mb", "{:.0f}"),
    ("bundle MB", "bundle_mb", "{:.0f}"),
    ("outside dec.", "outside_decoder_frac", "{:.1%}"),
    ("load s", "load_s", "{:.2f}"),
    ("warm load s", "load_warm_s", "{:.2f}"),
    ("roofline", "roofline_frac", "{:.1%}"),
)


def cell(record: dict[str, Any], key: str, fmt: str) -> str:
    value = record.get(key)
    if key.startswith("roofline") and record.get("cache_resident"):
        return "in LLC"
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "error" if key == "frames_per_s" and "error" in record else "-"
    return fmt.format(value)


def render_table(records: list[dict[str, Any]]) -> str:
    """The records as a table (rich when installed, else plain text)."""
    rows = [[cell(r, key, fmt) for _, key, fmt in COLUMNS] for r in records]
    presets = sorted({r["preset"] for r in records})
    return table(f"higgs-pack bench, preset {', '.join(presets)}", [h for h, _, _ in COLUMNS], rows)


def _llc(record: dict[str, Any]) -> str:
    machine = record.get("machine") or {}
    return f"{machine.get('llc_bytes', 0) / 2**20:g} MiB L{machine.get('llc_level', '?')} cache"


def render_details(records: list[dict[str, Any]]) -> str:
    """Per-step breakdown, build and roofline facts, and the goals met or missed."""
    lines = []
    machine = next((r["machine"] for r in records if r.get("machine")), None)
    if machine:
        isa = machine.get("isa") or {}
        llc = f", {_llc({'machine': machine})}" if machine.get("llc_bytes") else ", last-level cache unknown"
        load = next((r["loadavg_1m"] for r in records if r.get("loadavg_1m")), None)
        lines.append(f"machine: {machine.get('cpu')}, {machine.get('cores')} logical CPUs, "
                     f"{' '.join(isa.get('flags', [])) or 'no ISA flags'} (VNNI {'yes' if isa.get('vnni') else 'no'})"
                     f"{llc}" + (f"; load average {load[0]:.2f} before the first system" if load and load[0] else ""))
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
            roof = (f"; decoder weights {r['decoder_weight_mb']:.3g} MB + KV {r.get('kv_read_mb_per_step', 0):.3g} MB/step -> roofline "
                    f"{r['roofline_min_frame_ms']:.2f} ms/frame")
        if r.get("cache_resident"):
            roof = (f"; decoder weights {r['decoder_weight_mb']:.3g} MB fit the {_llc(r)}: cache-resident, "
                    "no roofline")
        elif r.get("roofline_frac_decoder") is not None:
            roof += f" (bare decoder {r['roofline_frac_decoder']:.0%} of it)"
        stream = ""
        if r.get("first_audio_ms") is not None:
            stream = (f"; stream: first audio {r['first_audio_ms']:.0f} ms after {r['first_audio_steps']} steps "
                      f"(first chunk {r['stream_chunk_frames']} frames + {r['stream_context_frames']} context; "
                      f"budget {r.get('first_audio_budget_ms') or math.nan:.0f} ms), "
                      f"{r['stream_frames_per_s']:.1f} frames/s, codes "
                      f"{'equal' if r.get('stream_codes_match') else 'DIFFER'}")
        ctx = ", ".join(f"ctx {k.removeprefix('step_ms_ctx')} {v:.2f} ms" for k, v in r.items()
                        if k.startswith("step_ms_ctx"))
        lines.append(f"{r['label']}: step ms [{parts}]; prefill {r.get('prefill_ms', 0):.0f} ms"
                     f"{'; decoder step ' + ctx if ctx else ''}{stream}{build}{roof}")
    for goal, met, numbers in goal_checks(records):
        lines.append(f"goal {goal}: {numbers} -> {goal_state(met, numbers)}")
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
    """Write the records as a JSON list; ``append`` keeps earlier records of other systems.

    The list ends with one ``{"kind": "goals", "goals": [{"goal", "met", "measured"}, …]}``
    record: :func:`goal_checks` of every measurement record written (``met`` null: not
    measured); an earlier goals record is replaced.
    """
    keep: list[dict[str, Any]] = []
    if append and out.is_file():
        fresh = {(r.get("kind"), r.get("label", r.get("system")), r["preset"]) for r in records}
        keep = [r for r in json.loads(out.read_text())
                if r.get("kind") != "goals"
                and (r.get("kind"), r.get("label", r.get("system")), r.get("preset")) not in fresh]
    rows = keep + [r for r in records if r.get("kind") != "goals"]
    measured = [r for r in rows if r.get("kind") is None]
    goals = {"kind": "goals", "goals": [{"goal": g, "met": met, "measured": numbers}
                                        for g, met, numbers in goal_checks(measured)]}
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps([*rows, goals], indent=2, default=str) + "\n")
    tmp.replace(out)

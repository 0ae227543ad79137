"""The benchmark's tables, each built once and printed as text or written into ``dist/bench.html``
(matplotlib figures as inline PNGs in the runtime's page; without matplotlib, the ``report``
extra, no page); the HTML pieces every page shares are in :mod:`bench.common.report`."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np

from bench.common.report import axes, esc, facts_list, goal_state, goals_table, html_table, img
from bench.common.systems import PRESETS, STEP_KIND, machine_line, table
from bench.decoder.records import BUILD_MEMORY_BUDGET_MB, batch_rows, goal_checks
from bench.decoder.records import GOAL_LOOP_OVER_DECODER as LOOP
from bench.decoder.records import GOAL_OUTSIDE_DECODER as OUTSIDE
from higgs_pack.runtime.verification.html_report import page, require_matplotlib

#: (header, record key, format) of the per-system table.
COLUMNS = (
    ("system", "label", "{}"), ("frames/s", "frames_per_s", "{:.1f}"), ("vs torch", "speedup_vs_pytorch", "{:.2f}x"),
    ("vs cpu", "speedup_vs_cpu", "{:.2f}x"), ("1st frame ms", "first_frame_ms", "{:.0f}"),
    ("1st audio ms", "first_audio_ms", "{:.0f}"), ("stream f/s", "stream_frames_per_s", "{:.1f}"),
    ("dec-only f/s", "decoder_only_frames_per_s", "{:.1f}"), ("loop/dec", "loop_over_decoder", "{:.3f}x"),
    ("step 64 ms", "step_ms_ctx64", "{:.2f}"), ("step 900 ms", "step_ms_ctx900", "{:.2f}"), ("RTF", "rtf", "{:.3f}"),
    ("peak RSS MB", "peak_rss_mb", "{:.0f}"), ("bundle MB", "bundle_mb", "{:.0f}"),
    ("outside dec.", "outside_decoder_frac", "{:.1%}"), ("load s", "load_s", "{:.2f}"),
    ("warm load s", "load_warm_s", "{:.2f}"), ("roofline", "roofline_frac", "{:.1%}"),
)
#: (header, row key, format) of the ``--batch`` table.
BATCH_COLUMNS = (
    ("B", "batch", "{}"), ("aggregate f/s", "aggregate_frames_per_s", "{:.1f}"),
    ("per request f/s", "per_request_frames_per_s", "{:.1f}"), ("vs B=1", "vs_batch1", "{:.2f}x"),
    ("step ms", "engine_step_ms", "{:.2f}"), ("step vs B=1", "step_vs_batch1", "{:.2f}x"),
    ("bare step ms", "bare_step_ms", "{:.2f}"), ("engine/bare", "engine_over_bare", "{:.3f}x"),
    ("streamed f/s", "stream_aggregate_frames_per_s", "{:.1f}"), ("streamed/plain", "stream_over_plain", "{:.2f}x"),
    ("delivered f/s (codec incl.)", "delivered_frames_per_s", "{:.1f}"),
    ("streamed/plain delivered", "stream_delivered_over_plain", "{:.2f}x"),
    ("join 1st audio ms", "join_first_audio_ms", "{:.0f}"),
    ("join splice ms", "join_splice_ms", "{:.1f}"),  # kept runs of the spliced OpenVINO engine (before issue 39)
    ("voice join 1st audio ms", "join_voice_first_audio_ms", "{:.0f}"),
    ("voice join: longest frame gap ms", "join_max_frame_gap_ms", "{:.0f}"),
    ("cold voice join: longest frame gap ms", "join_cold_max_frame_gap_ms", "{:.0f}"),
    ("KV in use KiB", "max_kv_kib_in_use", "{:.0f}"),
)
#: (record key, chart title, scale, dashed line (value, label) or None) of the per-system charts.
MEASURES = (
    ("frames_per_s", "decode frames per second (higher is faster; 25 frames = 1 s of audio)", 1.0, None),
    ("first_frame_ms", "time to the first audio frame, ms (prompt prefill + first step; lower is better)", 1.0, None),
    ("first_audio_ms", "streaming: time to the first audio sample, ms (prefill + first chunk; lower is better)",
     1.0, None),
    ("loop_over_decoder", "loop time per frame over the bare decoder's (1.0: no overhead; lower is better)", 1.0,
     (LOOP, f"goal: at most {LOOP:g}x")),
    ("outside_decoder_frac", "share of a frame spent outside the decoder, % (lower is better)", 100.0,
     (OUTSIDE * 100, f"goal: under {OUTSIDE:.0%}")),
    ("roofline_frac", "decoder speed as a share of the memory-bandwidth roofline, %", 100.0, (100.0, "roofline (100%)")),
)


def cell(record: dict[str, Any], key: str, fmt: str) -> str:
    value = record.get(key)
    if key.startswith("roofline") and record.get("cache_resident"):
        return "in LLC"
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "error" if key == "frames_per_s" and "error" in record else "-"
    return fmt.format(value)


def _title(what: str, records: list[dict[str, Any]]) -> str:
    return f"{what}, preset {', '.join(sorted({r['preset'] for r in records}))}"


def render_table(records: list[dict[str, Any]]) -> str:
    """The per-system table as text."""
    return table(_title("higgs-pack bench", records), [h for h, _, _ in COLUMNS],
                 [[cell(r, k, f) for _, k, f in COLUMNS] for r in records])


def render_details(records: list[dict[str, Any]]) -> str:
    """The machine, bandwidth, each system's step breakdown, stream, roofline, and the goals."""
    lines = []
    m = next((r["machine"] for r in records if r.get("machine")), None)
    if m:
        load = next((r["loadavg_1m"] for r in records if r.get("loadavg_1m")), None)
        lines.append(machine_line(m) + (f"; load average {load[0]:.2f} before the first system"
                                        if load and load[0] else ""))
    bw = next((r for r in records if r.get("bandwidth_gbps")), None)
    if bw:
        lines.append(f"memory bandwidth: read {bw['bandwidth_read_gbps']:.1f} GB/s ({bw['bandwidth_threads']} threads), "
                     f"{bw['bandwidth_read_1t_gbps']:.1f} GB/s one thread, copy {bw['bandwidth_copy_gbps']:.1f} GB/s")
    for r in records:
        if "error" in r:
            lines.append(f"{r['label']}: ERROR {r['error']}")
            continue
        text = f"{r['label']}: step ms [{', '.join(f'{k} {v:.2f}' for k, v in r.get('step_ms', {}).items())}]; " \
               f"prefill {r.get('prefill_ms', 0):.0f} ms"
        ctx = ", ".join(f"ctx {k.removeprefix('step_ms_ctx')} {v:.2f} ms" for k, v in r.items() if k.startswith("step_ms_ctx"))
        text += f"; decoder step {ctx}" if ctx else ""
        if r.get("first_audio_ms") is not None:
            text += (f"; stream: first audio {r['first_audio_ms']:.0f} ms after {r['first_audio_steps']} steps "
                     f"(first chunk {r['stream_chunk_frames']} frames + {r['stream_context_frames']} context; budget "
                     f"{r.get('first_audio_budget_ms') or math.nan:.0f} ms), {r['stream_frames_per_s']:.1f} frames/s, "
                     f"codes {'equal' if r.get('stream_codes_match') else 'DIFFER'}")
        if r.get("build_s") is not None:
            text += f"; build {r['build_s']:.0f} s{' (cached)' if r.get('build_cached') else ''}"
        if r.get("cache_resident"):
            text += f"; decoder weights {r['decoder_weight_mb']:.3g} MB fit the last-level cache: cache-resident, no roofline"
        elif r.get("roofline_min_frame_ms") is not None:
            text += (f"; decoder weights {r['decoder_weight_mb']:.3g} MB + KV {r.get('kv_read_mb_per_step', 0):.3g} "
                     f"MB/step -> roofline {r['roofline_min_frame_ms']:.2f} ms/frame")
            if r.get("roofline_frac_decoder") is not None:
                text += f" (bare decoder {r['roofline_frac_decoder']:.0%} of it)"
        lines.append(text)
    lines += [f"goal {goal}: {m} -> {goal_state(met, m)}" for goal, met, m in goal_checks(records)]
    return "\n".join(lines)


def prefill_table(records: list[dict[str, Any]]) -> tuple[list[str], list[list[str]], list[str]]:
    """Prefill beside decode, one row per system with ``prefill_positions_per_s`` (ours from the
    ``measure`` records, llama.cpp's prompt processing from its decoder-step record): positions/s
    per length, GOP/s and the share of the run's float32 and int8 GEMM peaks at each length, decode
    frames/s and the first audio per voice kind; the facts name the peaks."""
    have = [r for r in records if r.get("prefill_positions_per_s")]
    lengths = sorted({n for r in have for n in r["prefill_positions_per_s"]}, key=int)
    kinds = [k for k in ("zero_shot", "clip", "named", "named_cached")
             if any(k in (r.get("first_audio_ms_by_voice") or {}) for r in have)]
    headers = (["system", "preset"] + [f"prefill {n} pos/s" for n in lengths] + [f"{n}: GOP/s (int8 / fp32 peak)"
                                                                                for n in lengths]
               + ["decode f/s"] + [f"1st audio {k} ms" for k in kinds])
    rows, facts = [], []
    for r in have:
        rates, gops, share = r["prefill_positions_per_s"], r.get("prefill_gops", {}), r.get("prefill_vs_peak", {})
        ratio = r.get("first_audio_vs_zero_shot") or {}
        voice = r.get("first_audio_ms_by_voice") or {}
        rows.append([r["label"], r["preset"]] + [f"{rates[n]:.1f}" if n in rates else "-" for n in lengths]
                    + [f"{gops[n]:.0f} ({share.get('int8', {}).get(n, math.nan):.0%} / "
                       f"{share.get('float32', {}).get(n, math.nan):.0%})" if n in gops else "-" for n in lengths]
                    + [f"{r['frames_per_s']:.1f}" if r.get("frames_per_s") else "-"]
                    + [f"{voice[k]:.0f} ({ratio.get(k, math.nan):.2f}x)" if k in voice else "-" for k in kinds])
    peak = next((r for r in records if r.get("gemm_peak_gops")), None)
    if peak:
        g = peak["gemm_peak_gops"]
        facts.append(f"GEMM peak on this machine, one decoder layer's MatMuls ({peak.get('gemm_runtime')}, best of "
                     f"{', '.join(map(str, peak.get('gemm_peak_rows', {}).get('int8', {})))} rows): int8 "
                     f"{g['int8']:.0f} GOP/s, float32 {g['float32']:.0f} GOP/s; prefill GOP/s count the decoder's "
                     f"MatMuls ({peak.get('decoder_ops_per_position', 0) / 1e9:.2f} GOP per position), not attention")
    elif any(r.get("gemm_peak_error") for r in records):
        facts.append("GEMM peak: ERROR " + next(r["gemm_peak_error"] for r in records if r.get("gemm_peak_error")))
    positions = next((r["voice_prompt_positions"] for r in have if r.get("voice_prompt_positions")), None)
    if positions:
        facts.append("first audio per voice: ms from the stream call, fastest round, x zero-shot's; prompt positions "
                     + ", ".join(f"{k} {v}" for k, v in positions.items()))
    return headers, rows, facts


def render_prefill(records: list[dict[str, Any]]) -> str:
    """The prefill table and its facts as text; empty without prefill figures."""
    headers, rows, facts = prefill_table(records)
    return "\n".join([table("prefill beside decode", headers, rows), *facts]) if rows else ""


def render_builds(builds: list[dict[str, Any]]) -> str:
    """The ``"kind": "build"`` records: memory, scratch, time, size, per phase."""
    rows = []
    for b in builds:
        if "error" in b:
            rows.append([b["system"], "error: " + b["error"], "", "", "", "", ""])
            continue
        phases = "; ".join(f"{p['name'].split(' (')[0].replace('exporting ', '')}: {p['seconds']:.0f} s / "
                           f"{p['peak_rss_mb']:.0f}" for p in b.get("phases", []))
        over = (b.get("peak_rss_mb") or 0) > BUILD_MEMORY_BUDGET_MB
        rows.append([b["system"] + (" (cached)" if b.get("cached") else ""), f"{b.get('peak_rss_mb') or 0:.0f}",
                     f"{b.get('scratch_peak_mb') or 0:.0f}", f"{b.get('build_s') or 0:.0f}",
                     f"{b.get('bundle_mb') or 0:.0f}", str(b.get("verified")), phases + ("  OVER BUDGET" if over else "")])
    return table("", ["build", "peak RSS MB", "scratch MB", "time s", "bundle MB", "verified",
                      "phases (s / peak MB)"], rows) if builds else ""


def batch_facts(record: dict[str, Any]) -> str:
    """KV bytes per position, the memory fit (computed or run) and the load average of one record."""
    batch, head = record.get("batch") or {}, f"{record['label']} [{record['preset']}] --batch"
    if batch.get("error"):
        return f"{head}: ERROR {batch['error']}"
    per = batch.get("kv_bytes_per_position")
    text = (f"{head}: KV {per} B per position (engine.kv_bytes_per_position)" if per is not None else
            f"{head}: KV bytes per position: the engine cannot say (engine.kv_bytes_per_position is None)")
    if batch.get("fit_max_batch") is not None:
        text += (f"; largest batch in {batch['fit_memory_bytes'] / 2**30:g} GiB at {batch['fit_positions']} positions: "
                 f"{batch['fit_max_batch']} (computed, not run: weights {batch['fit_weight_bytes'] / 2**20:.0f} MiB + "
                 f"B x {batch['fit_positions']} x {batch['fit_kv_bytes_per_position']} B, KV bytes from the "
                 f"{batch['fit_kv_source']})")
        if batch.get("fit_run_peak_rss_mb") is not None:
            text += (f"; run: {batch['fit_run_batch']} rows full, peak RSS {batch['fit_run_peak_rss_mb']:.0f} MB "
                     f"({'fits' if batch.get('fit_run_fits') else 'EXCEEDS'} the budget), step "
                     f"{batch['fit_run_step_ms']:.0f} ms")
        elif batch.get("fit_run_skipped") or batch.get("fit_run_error"):
            text += f"; run: {batch.get('fit_run_skipped') or 'ERROR ' + batch['fit_run_error']}"
    load = batch.get("loadavg_1m") or []
    if len(load) == 2 and None not in load:
        text += f"; load average {load[0]:.2f} before, {load[1]:.2f} after"
    return text


def batch_table(records: list[dict[str, Any]], *, reasons: bool = False) -> tuple[list[str], list[list[str]], list[str]]:
    """Headers, rows (one per system and size; a refused size says so, ``reasons``: why) and facts."""
    rows, facts = [], []
    for r in (r for r in records if isinstance(r.get("batch"), dict)):
        facts.append(batch_facts(r))
        for row in batch_rows(r):
            if "refused" in row:
                rows.append([r["label"], str(row["batch"]), f"refused: {row['refused']}" if reasons else "refused"]
                            + ["-"] * (len(BATCH_COLUMNS) - 2) * (not reasons))
                facts.append(f"{r['label']} [{r['preset']}] batch {row['batch']} refused by the engine: {row['refused']}")
            else:
                rows.append([r["label"]] + [cell(row, k, f) for _, k, f in BATCH_COLUMNS])
    return ["system", *(h for h, _, _ in BATCH_COLUMNS)], rows, facts


def render_batch(records: list[dict[str, Any]]) -> str:
    """The ``--batch`` table and facts as text; empty without a batch measurement."""
    headers, rows, facts = batch_table(records)
    batched = [r for r in records if isinstance(r.get("batch"), dict)]
    return "\n".join([table(_title("higgs-pack bench --batch", batched), headers, rows), *facts]) if facts else ""


def step_table_rows(records: list[dict[str, Any]]) -> tuple[list[str], list[list[str]]]:
    """The decoder-step comparison: a row per (batch, context), a column per system's ``step_ms``
    (llama.cpp also without output) and per llama.cpp-over-ours ratio."""
    measured = [r for r in records if r.get("kind") == STEP_KIND and r.get("rows")]
    ours = [r for r in measured if r.get("backend") != "llama.cpp"]
    llama = [r for r in measured if r.get("backend") == "llama.cpp"]
    headers = ["B", "ctx"] + [f"{r['label']} ms" for r in ours]
    for r in llama:
        headers += [f"{r['label']} ms", f"{r['label']} no-out ms"] + [f"{r['label']}/{o['label']}" for o in ours]
    rows = []
    for batch, context in sorted({(row["batch"], row["context"]) for r in measured for row in r["rows"]}):
        def at(rec: dict[str, Any], b: int = batch, n: int = context) -> dict[str, Any]:
            return next((x for x in rec["rows"] if x["batch"] == b and x["context"] == n), {})

        def ms(rec: dict[str, Any], field: str) -> str:
            value = at(rec).get(field)
            return "refused" if "refused" in at(rec) else f"{value:.2f}" if isinstance(value, (int, float)) else "-"

        line = [str(batch), str(context)] + [ms(r, "step_ms") for r in ours]
        for r in llama:
            over = at(r).get("over", {})
            line += [ms(r, "step_ms"), ms(r, "step_ms_no_output")]
            line += [f"{over[o['label']]:.2f}x" if o["label"] in over else "-" for o in ours]
        rows.append(line)
    return headers, rows


def step_facts(records: list[dict[str, Any]]) -> list[str]:
    """One line per decoder-step system: weights, threads, versions, load average (or its error)."""
    lines = []
    for r in (r for r in records if r.get("kind") == STEP_KIND):
        head = f"{r['label']} [{r['preset']}]: "
        if "error" in r:
            lines.append(head + f"ERROR {r['error']}")
            continue
        load = [x for x in r.get("loadavg", []) if x is not None]
        load_text = f"load average {min(load):.2f}-{max(load):.2f}" if load else "load average unknown"
        if r.get("backend") == "llama.cpp":
            conv = (r.get("conversion") or {}).get("float") or {}
            lines.append(head + f"llama-cpp-python {r['llama_cpp_python']} (llama.cpp {r.get('llama_cpp_commit')}), "
                         f"{r['threads']} threads, decoder layers {r['decoder_bytes'] / 1e6:.1f} MB + text head "
                         f"{r['head_tensor']} {r['head_type']} {r['head_bytes'] / 1e6:.1f} MB (run on every row that "
                         f"asks for logits), GGUF {r['gguf_bytes'] / 1e6:.1f} MB; dims {r.get('dims')}; converter "
                         f"{conv.get('convert_s')} s, peak RSS {conv.get('convert_peak_rss_mb')} MiB (anon "
                         f"{conv.get('convert_peak_anon_mb')})"
                         f"{' (cached)' if (r.get('conversion') or {}).get('cached') else ''}; {load_text}")
        else:
            lines.append(head + f"decoder weights {r.get('decoder_weight_mb', 0):.1f} MB, KV itemsize "
                         f"{r.get('kv_itemsize')}, ONNX Runtime/OpenVINO default threads; {load_text}")
    return lines


def render_steps(records: list[dict[str, Any]]) -> str:
    """The decoder-step comparison as text and its facts; empty without such records."""
    mine = [r for r in records if r.get("kind") == STEP_KIND]
    headers, rows = step_table_rows(mine)
    text = table(_title("decoder step (ms), ours beside llama.cpp", mine), headers, rows) if rows else ""
    return "\n".join([text, *step_facts(mine)]).strip("\n")


def preset_section(preset: str, rows: list[dict[str, Any]]) -> str:
    """One preset's bar charts (one per measure any system has) and its table."""
    plt = require_matplotlib()
    labels = [str(r.get("label") or r.get("system")) for r in rows]
    charts = []
    for key, title, scale, mark in MEASURES:
        values = [r.get(key) for r in rows]
        if not any(isinstance(v, (int, float)) for v in values):
            continue
        fig, ax = axes(plt, (9, 0.5 * len(rows) + 1.3), title)
        y = np.arange(len(rows))
        vals = [float(v) * scale if isinstance(v, (int, float)) else 0.0 for v in values]
        ax.barh(y, vals, color="#0969da", height=0.55)
        for yi, v, raw, r in zip(y, vals, values, rows, strict=True):
            note = " cache-resident" if key == "roofline_frac" and r.get("cache_resident") else " not measured"
            ax.text(v, yi, f" {v:.3g}" if isinstance(raw, (int, float)) else note, va="center", fontsize=8)
        if mark:
            ax.axvline(mark[0], color="#1b1f24", linestyle="--", linewidth=1.5, label=mark[1])
            ax.legend(loc="lower right", fontsize=8)
        ax.set_yticks(y, labels)
        ax.invert_yaxis()
        ax.margins(x=0.15)
        charts.append(img(fig, title))
    return (f"<h2>Preset {esc(preset)}</h2>" + "".join(charts)
            + html_table([h for h, _, _ in COLUMNS], [[cell(r, k, f) for _, k, f in COLUMNS] for r in rows]))


def batch_section(records: list[dict[str, Any]]) -> str:
    """Per preset, aggregate frames/s against the batch size (plain solid, streamed dashed), the
    table and the facts; empty without a ``--batch`` measurement."""
    batched = [r for r in records if isinstance(r.get("batch"), dict)]
    if not batched:
        return ""
    plt = require_matplotlib()
    parts = ["<h2>Many requests at once (--batch)</h2><p class=\"explain\">Each bundle's continuous-batching "
             "engine (<code>tts.engine(max_batch=B)</code>): B requests of the same text read with "
             "<code>result()</code> (plain) or each on its own thread (streamed); aggregate frames/s over the steps "
             "with all B rows busy; the bare step is the engine's batched decoder alone; the join time is the first "
             "streamed audio of a request submitted while B-1 others run.</p>"]
    for preset in [p for p in PRESETS if any(r["preset"] == p for r in batched)]:
        here = [r for r in batched if r["preset"] == preset]
        fig, ax = axes(plt, (8, 4.2), f"aggregate frames per second against the batch, preset {preset}",
                       "batch size (requests decoded together)", "aggregate frames/s (25 frames = 1 s of audio)")
        for i, r in enumerate(here):
            rows = batch_rows(r)
            refused = [str(row["batch"]) for row in rows if "refused" in row]
            for key, style, what in (("aggregate_frames_per_s", "-", "plain"),
                                     ("stream_aggregate_frames_per_s", "--", "streamed")):
                points = [(row["batch"], row[key]) for row in rows if "refused" not in row and row.get(key)]
                note = f" (refused at {', '.join(refused)})" if refused and what == "plain" else ""
                if points:
                    ax.plot(*zip(*points, strict=True), style, marker="o", color=f"C{i % 10}",
                            label=f"{r['label']} {what}{note}")
        sizes = sorted({row["batch"] for r in here for row in batch_rows(r)})
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.legend(fontsize=8)
        headers, rows, facts = batch_table(here, reasons=True)
        parts.append(f"<h3>Preset {esc(preset)}</h3>" + img(fig, f"aggregate frames/s vs batch, {preset}")
                     + html_table(headers, rows) + facts_list(facts))
    return "\n".join(parts)


def steps_section(records: list[dict[str, Any]]) -> str:
    """The decoder step beside llama.cpp, a table per preset and the facts; empty without records."""
    mine = [r for r in records if r.get("kind") == STEP_KIND]
    if not mine:
        return ""
    parts = ["<h2>Decoder step beside llama.cpp</h2><p class=\"explain\">The bare decoder step of B rows at once "
             "after a prefill of ctx positions each, every system in its own process, in turns; fastest round. "
             "llama.cpp's 'ms' asks logits for every row (its text head runs, ours has none), 'no-out' asks none (a "
             "lower bound). Ratios: llama.cpp's step over ours (above 1: ours is faster).</p>"]
    for preset in sorted({r["preset"] for r in mine}):
        here = [r for r in mine if r["preset"] == preset]
        parts.append(f"<h3>Preset {esc(preset)}</h3>" + html_table(*step_table_rows(here)) + facts_list(step_facts(here)))
    return "\n".join(parts)


def prefill_section(records: list[dict[str, Any]]) -> str:
    """Prefill positions/s against the prompt length per system (log-log) beside the GEMM peaks
    as positions/s, the table and its facts; empty without prefill figures."""
    headers, rows, facts = prefill_table(records)
    if not rows:
        return ""
    plt = require_matplotlib()
    fig, ax = axes(plt, (8, 4.2), "prefill positions per second against the prompt length",
                   "prompt positions", "positions/s (higher is faster)")
    have = [r for r in records if r.get("prefill_positions_per_s")]
    for i, r in enumerate(have):
        points = sorted((int(n), v) for n, v in r["prefill_positions_per_s"].items())
        ax.plot(*zip(*points, strict=True), "-o", color=f"C{i % 10}", label=f"{r['label']} [{r['preset']}]")
    peak = next((r for r in have if r.get("gemm_peak_gops") and r.get("decoder_ops_per_position")), None)
    if peak:
        for kind, style in (("int8", "--"), ("float32", ":")):
            ax.axhline(peak["gemm_peak_gops"][kind] * 1e9 / peak["decoder_ops_per_position"], color="#1b1f24",
                       linestyle=style, linewidth=1.2, label=f"{kind} GEMM peak as positions/s")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.legend(fontsize=8)
    return ("<h2>Prefill beside decode</h2><p class=\"explain\">A prompt prefill runs every decoder MatMul with "
            "one row per position: bound by compute, unlike the decode step. Positions/s of one prefill into an "
            "empty KV cache (ours: the bundle's own decoder; llama.cpp: its prompt processing), fastest round; "
            "GOP/s of the decoder's MatMuls as a share of the GEMM peaks measured in the same run; the first audio "
            "of a request with no voice, a reference clip, and a named voice.</p>"
            + img(fig, "prefill positions/s") + html_table(headers, rows) + facts_list(facts))


def write_html(out: Path) -> Path:
    """Write ``<out>.html`` beside the JSON records, every record charted; HiggsPackError without matplotlib."""
    everything = json.loads(out.read_text())
    records = [r for r in everything if r.get("kind") is None]  # not builds, steps or goals
    require_matplotlib()
    intro = ("<p class=\"explain\">Each system decodes the same text for a fixed number of frames at temperature "
             "0.8, seed 0, after one warm-up, in its own process; frames/s excludes the prefill. The same request "
             "also runs streamed (first audio) and through the bare decoder alone (loop / decoder). The roofline "
             "share is the decoder weights' and KV cache's bytes per step against the bandwidth measured in the same "
             "run, given only where the weights exceed the last-level cache.</p>")
    sections = [goals_table(goal_checks(records)), intro]
    sections += [preset_section(p, [r for r in records if r.get("preset", "?") == p])
                 for p in sorted({r.get("preset", "?") for r in records})]
    sections += [prefill_section(everything), batch_section(records), steps_section(everything)]
    path = out.with_suffix(".html")
    path.write_text(page("higgs-pack benchmark", f"{len(records)} records", [s for s in sections if s]),
                    encoding="utf-8")
    return path

"""The benchmark's HTML pages, ``dist/bench.html`` (:func:`write_html`) and the pieces the load
test's ``dist/serve-bench.html`` shares: one self-contained file each, matplotlib figures as
inline PNGs in the runtime's page (:mod:`higgs_pack.runtime.verification.html_report`; matplotlib
comes with the ``report`` extra and a page without it is an error naming the extra).
"""

from __future__ import annotations

import html
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.decoder_steps import KIND as STEP_KIND
from bench.decoder_steps import step_facts, step_table_rows
from bench.records import (
    BATCH_COLUMNS,
    Goal,
    batch_facts,
    batch_table_rows,
    cell,
    goal_checks,
    goal_state,
)
from bench.systems import GOAL_LOOP_OVER_DECODER, GOAL_OUTSIDE_DECODER, PRESETS
from higgs_pack.runtime.verification.html_report import figure_png, page, require_matplotlib


def esc(text: Any) -> str:
    return html.escape(str(text))


def img(fig: Any, alt: str) -> str:
    """A matplotlib figure as an inline PNG (the figure is closed)."""
    return f'<img src="{figure_png(fig)}" alt="{esc(alt)}">'


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    body = "".join("<tr>" + "".join(f"<td>{esc(c)}</td>" for c in row) + "</tr>" for row in rows)
    return "<table><tr>" + "".join(f"<th>{esc(h)}</th>" for h in headers) + f"</tr>{body}</table>"


def goals_table(goals: Sequence[Goal]) -> str:
    """The goals met, missed, not measured or not judged, first on a page."""
    css = {"met": "ok", "MISSED": "FAIL"}
    rows = "".join(f"<tr><td class=\"{css.get(goal_state(met, m), 'skipped')}\">{goal_state(met, m)}</td>"
                   f"<td>{esc(goal)}</td><td>{esc(m)}</td></tr>" for goal, met, m in goals)
    return f"<h2>Goals</h2><table><tr><th>result</th><th>goal</th><th>measured</th></tr>{rows}</table>"


#: (record key, chart title, scale, dashed line: (value, label) or None) of each per-system bar chart.
MEASURES: tuple[tuple[str, str, float, tuple[float, str] | None], ...] = (
    ("frames_per_s", "decode frames per second (higher is faster; 25 frames = 1 s of audio)", 1.0, None),
    ("first_frame_ms", "time to the first audio frame, ms (prompt prefill + first step; lower is better)", 1.0, None),
    ("first_audio_ms", "streaming: time to the first audio sample, ms (prefill + first chunk; lower is better)",
     1.0, None),
    ("loop_over_decoder", "loop time per frame over the bare decoder's (1.0: no overhead; lower is better)", 1.0,
     (GOAL_LOOP_OVER_DECODER, f"goal: at most {GOAL_LOOP_OVER_DECODER:g}x")),
    ("outside_decoder_frac", "share of a frame spent outside the decoder, % (lower is better)", 100.0,
     (GOAL_OUTSIDE_DECODER * 100, f"goal: under {GOAL_OUTSIDE_DECODER:.0%}")),
    ("roofline_frac", "decoder speed as a share of the memory-bandwidth roofline, %", 100.0, (100.0, "roofline (100%)")),
)
#: (record key, column, scale) of the per-preset table.
COLUMNS = (("frames_per_s", "frames/s", 1.0), ("stream_frames_per_s", "frames/s streaming", 1.0),
           ("decoder_only_frames_per_s", "bare decoder frames/s", 1.0), ("loop_over_decoder", "loop / decoder", 1.0),
           ("first_frame_ms", "first frame (ms)", 1.0), ("first_audio_ms", "first audio (ms)", 1.0),
           ("stream_chunk_frames", "first chunk (frames)", 1.0), ("step_ms_ctx64", "step at 64 (ms)", 1.0),
           ("step_ms_ctx900", "step at 900 (ms)", 1.0), ("rtf", "real-time factor", 1.0),
           ("outside_decoder_frac", "outside decoder (%)", 100.0), ("roofline_frac", "of roofline (%)", 100.0),
           ("peak_rss_mb", "peak RSS (MB)", 1.0), ("bundle_mb", "bundle (MB)", 1.0))


def number(value: Any, scale: float = 1.0) -> str:
    return format(value * scale, ".3g") if isinstance(value, (int, float)) and not isinstance(value, bool) else "-"


def preset_section(preset: str, rows: list[dict[str, Any]]) -> str:
    """One preset's bar charts (one per measure any system has) and its table."""
    plt = require_matplotlib()
    labels = [str(r.get("label") or r.get("system")) for r in rows]
    charts = []
    for key, title, scale, mark in MEASURES:
        values = [r.get(key) for r in rows]
        if not any(isinstance(v, (int, float)) for v in values):
            continue
        fig, ax = plt.subplots(figsize=(9, 0.5 * len(rows) + 1.3))
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
        ax.set_title(title)
        ax.margins(x=0.15)
        ax.grid(axis="x", alpha=0.25)
        charts.append(img(fig, title))
    cells = [[label] + ["cache-resident" if k == "roofline_frac" and r.get("cache_resident") else number(r.get(k), s)
                        for k, _, s in COLUMNS] for label, r in zip(labels, rows, strict=True)]
    return f"<h2>Preset {esc(preset)}</h2>" + "".join(charts) + table(["system", *(c for _, c, _ in COLUMNS)], cells)


def batch_section(records: list[dict[str, Any]]) -> str:
    """Per preset, aggregate frames/s against the batch size (a line per system; plain solid,
    streamed dashed) and the table; empty when no record has a ``--batch`` measurement."""
    batched = [r for r in records if isinstance(r.get("batch"), dict)]
    if not batched:
        return ""
    plt = require_matplotlib()
    parts = ["<h2>Many requests at once (--batch)</h2><p class=\"explain\">Each bundle's continuous-batching "
             "engine (<code>tts.engine(max_batch=B)</code>) in its own process: B requests of the same text and "
             "frame cap submitted together, read with <code>result()</code> (plain) or each iterated on its own "
             "thread (streamed). Aggregate frames/s counts every row's frames over the steps with all B rows busy; "
             "the bare step is the engine's batched decoder alone; the join time is the first streamed audio of a "
             "request submitted while B-1 others run. Sizes the engine refuses are listed with its reason. The "
             "largest batch in 12 GiB is computed unless --fit-run ran it.</p>"]
    for preset in [p for p in PRESETS if any(r["preset"] == p for r in batched)]:
        here = [r for r in batched if r["preset"] == preset]
        fig, ax = plt.subplots(figsize=(8, 4.2))
        for i, r in enumerate(here):
            rows = batch_table_rows(r)
            refused = [str(row["batch"]) for row in rows if "refused" in row]
            note = f" (refused at {', '.join(refused)})" if refused else ""
            for key, style, what in (("aggregate_frames_per_s", "-", "plain"),
                                     ("stream_aggregate_frames_per_s", "--", "streamed")):
                points = [(row["batch"], row[key]) for row in rows if "refused" not in row and row.get(key)]
                if points:
                    ax.plot(*zip(*points, strict=True), style, marker="o", color=f"C{i % 10}",
                            label=f"{r['label']} {what}{note if what == 'plain' else ''}")
        sizes = sorted({row["batch"] for r in here for row in batch_table_rows(r)})
        ax.set_xscale("log", base=2)
        ax.set_xticks(sizes, [str(b) for b in sizes])
        ax.set_xlabel("batch size (requests decoded together)")
        ax.set_ylabel("aggregate frames/s (25 frames = 1 s of audio)")
        ax.set_title(f"aggregate frames per second against the batch, preset {preset}")
        ax.grid(alpha=0.25)
        ax.legend(fontsize=8)
        rows = [[r["label"], row["batch"], f"refused: {row['refused']}"] if "refused" in row else
                [r["label"], *(cell(row, key, fmt) for _, key, fmt in BATCH_COLUMNS)]
                for r in here for row in batch_table_rows(r)]
        facts = "".join(f"<li>{esc(batch_facts(r))}</li>" for r in here)
        parts.append(f"<h3>Preset {esc(preset)}</h3>" + img(fig, f"aggregate frames/s vs batch, {preset}")
                     + table(["system", *(h for h, _, _ in BATCH_COLUMNS)], rows) + f"<ul class=\"explain\">{facts}</ul>")
    return "\n".join(parts)


def steps_section(records: list[dict[str, Any]]) -> str:
    """The decoder step beside llama.cpp: a table per preset and the facts; empty without records."""
    mine = [r for r in records if r.get("kind") == STEP_KIND]
    if not mine:
        return ""
    parts = ["<h2>Decoder step beside llama.cpp</h2><p class=\"explain\">The bare decoder step of B rows at once "
             "after a prefill of ctx positions each, every system in its own process, in turns; fastest round. "
             "llama.cpp runs the same Qwen3 weights converted with its own convert_hf_to_gguf.py and quantized "
             "with llama_model_quantize; its 'ms' column asks logits for every row (its text head runs, ours has "
             "none), 'no-out' asks none (no head, and its last layer's feed-forward skipped too: a lower bound). "
             "Ratios: llama.cpp's step over ours (above 1: ours is faster).</p>"]
    for preset in sorted({r["preset"] for r in mine}):
        here = [r for r in mine if r["preset"] == preset]
        facts = "".join(f"<li>{esc(line)}</li>" for line in step_facts(here))
        parts.append(f"<h3>Preset {esc(preset)}</h3>" + table(*step_table_rows(here))
                     + f"<ul class=\"explain\">{facts}</ul>")
    return "\n".join(parts)


def write_html(out: Path) -> Path:
    """Write ``<out>.html`` beside the JSON records file: every record of ``out``, charted.

    Raises:
        HiggsPackError: matplotlib is missing (``pip install 'higgs-pack[report]'``).
    """
    everything = json.loads(out.read_text())
    records = [r for r in everything if r.get("kind") is None]  # not builds, steps or goals
    require_matplotlib()
    intro = ("<p class=\"explain\">Each system decodes the same text for a fixed number of frames at temperature "
             "0.8, seed 0, after one warm-up, in its own process. Frames per second excludes the prompt "
             "(prefill). The same request also runs through the streaming API (first audio, frames/s "
             "streaming) and the bare decoder alone with the same bindings (loop / decoder). The roofline share "
             "is the decoder weights' and KV cache's bytes read per step against the memory bandwidth measured in "
             "the same run, given only where the weights exceed the last-level cache (else cache-resident).</p>")
    sections = [goals_table(goal_checks(records)), intro]
    sections += [preset_section(p, [r for r in records if r.get("preset", "?") == p])
                 for p in sorted({r.get("preset", "?") for r in records})]
    sections += [batch_section(records), steps_section(everything)]
    path = out.with_suffix(".html")
    path.write_text(page("higgs-pack benchmark", f"{len(records)} records", [s for s in sections if s]),
                    encoding="utf-8")
    return path

"""The load test's goals, printed table, JSON file and HTML page (``dist/serve-bench.json`` and
``dist/serve-bench.html``), for the records of :mod:`bench.serve_load`.

The HTML page is its own file, not a section of ``dist/bench.html``: the two come from different
runs (``nox -s bench`` rewrites bench.html from bench.json alone), so a section there would be
lost at the next bench run.  It is drawn the same way: matplotlib figures as inline PNGs, in the
page of :mod:`higgs_pack.runtime.verification.html_report`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from bench.records import Goal, goal_state
from bench.report import esc, goals_table, img
from bench.serve_checks import CATEGORIES, FAILURES
from higgs_pack.runtime.verification.html_report import page, require_matplotlib

#: The concurrency at which no answer may be lost, truncated or malformed.
GOAL_CLEAN_CLIENTS = 64
#: Most RSS growth of the server over :data:`GOAL_SOAK_REQUESTS` requests.
GOAL_RSS_GROWTH = 0.05
GOAL_SOAK_REQUESTS = 500
#: At one client, HTTP time to first audio at most the in-process stream's plus this (ms, p50s).
GOAL_FIRST_AUDIO_MARGIN_MS = 50.0
#: The concurrency, and the share of the engine's in-process frames/s the server must reach there.
GOAL_THROUGHPUT_CLIENTS = 16
GOAL_THROUGHPUT_RATIO = 0.9


def _level(record: dict[str, Any], clients: int) -> dict[str, Any] | None:
    return next((lv for lv in record.get("levels", []) if lv["clients"] == clients), None)


def _p50(figures: dict[str, Any] | None, key: str) -> float | None:
    value = ((figures or {}).get(key) or {}).get("p50")
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


def goal_checks(record: dict[str, Any]) -> list[Goal]:
    """The four goals of issue 20 item 8 as ``(goal, met, measured)``; ``met`` None when the run
    did not measure it (its level, the soak or the engine figures are missing):

    * at :data:`GOAL_CLEAN_CLIENTS` clients no answer lost, truncated or malformed, and every
      429 a ``queue_full`` that came while the queue was full;
    * server RSS growth under :data:`GOAL_RSS_GROWTH` over :data:`GOAL_SOAK_REQUESTS` requests;
    * at one client, HTTP time to first audio (p50) within the in-process stream's (p50) +
      :data:`GOAL_FIRST_AUDIO_MARGIN_MS`;
    * at :data:`GOAL_THROUGHPUT_CLIENTS` clients, aggregate frames/s at least
      :data:`GOAL_THROUGHPUT_RATIO` x the engine's in-process figure at the same batch.
    """
    tag = f"[{record.get('preset')}] {record.get('label')}"
    checks: list[Goal] = []

    goal = (f"{tag}: {GOAL_CLEAN_CLIENTS} clients: no lost, truncated or malformed answer; 429 only "
            "queue_full while the queue is full")
    level = _level(record, GOAL_CLEAN_CLIENTS)
    if level is None:
        checks.append((goal, None, f"no {GOAL_CLEAN_CLIENTS}-client level"))
    else:
        c = level.get("checks_all_rounds") or level["checks"]
        bad = sum(c.get(k, 0) for k in FAILURES)
        checks.append((goal, bad == 0, f"{sum(c.values())} sent: " + ", ".join(
            f"{c.get(k, 0)} {k.replace('_', ' ')}" for k in CATEGORIES)))

    goal = f"{tag}: server RSS growth < {GOAL_RSS_GROWTH:.0%} over {GOAL_SOAK_REQUESTS} requests"
    soak = record.get("soak")
    if not soak or soak.get("rss_growth") is None:
        checks.append((goal, None, "no soak" if not soak else "the server's RSS was not read (no pid)"))
    elif soak["requests"] < GOAL_SOAK_REQUESTS:
        checks.append((goal, None, f"only {soak['requests']} soak requests"))
    else:
        g = soak["rss_growth"]
        checks.append((goal, g < GOAL_RSS_GROWTH, f"{soak['rss_start_mb']:.1f} -> {soak['rss_end_mb']:.1f} MiB "
                       f"({g:+.2%}) over {soak['requests']} requests at {soak['clients']} clients"))

    goal = f"{tag}: 1 client: HTTP first audio <= in-process stream's + {GOAL_FIRST_AUDIO_MARGIN_MS:g} ms (p50)"
    level = _level(record, 1)
    http, engine = _p50(level, "first_audio_ms"), _p50((level or {}).get("engine"), "first_audio_ms")
    if http is None or engine is None:
        checks.append((goal, None, "no 1-client level" if level is None else "no streamed answers or engine figures"))
    else:
        checks.append((goal, http <= engine + GOAL_FIRST_AUDIO_MARGIN_MS,
                       f"{http:.0f} ms vs {engine:.0f} ms in-process (+{http - engine:.0f} ms)"))

    goal = (f"{tag}: {GOAL_THROUGHPUT_CLIENTS} clients: frames/s >= {GOAL_THROUGHPUT_RATIO:g}x the engine's "
            "in-process figure at the same batch")
    level = _level(record, GOAL_THROUGHPUT_CLIENTS)
    engine_fps = ((level or {}).get("engine") or {}).get("frames_per_s")
    if level is None or not engine_fps:
        checks.append((goal, None, f"no {GOAL_THROUGHPUT_CLIENTS}-client level" if level is None
                       else "no engine figures"))
    else:
        ratio = level["frames_per_s"] / engine_fps
        rounds = level.get("paired_ratios") or []
        more = (f"; rounds paired {'/'.join(f'{r:.2f}' for r in rounds)}" if len(rounds) > 1 else "")
        if level.get("cpu_efficiency"):
            more += f"; frames per CPU second {level['cpu_efficiency']:.2f}x the engine's"
        if level.get("client_cpu_s") is not None and level.get("server_cpu_s"):
            # The same cores run the load generator: say what it took beside the server (the engine's
            # own client threads, PCM conversion and hashing, are inside its process's CPU seconds).
            more += (f"; the HTTP clients took {level['client_cpu_s']:.1f} CPU s beside the server's "
                     f"{level['server_cpu_s']:.1f}")
        checks.append((goal, ratio >= GOAL_THROUGHPUT_RATIO, f"{level['frames_per_s']:.1f} vs {engine_fps:.1f} "
                       f"frames/s ({ratio:.2f}x) at max_batch {record['server']['max_batch']}{more}"))
    return checks


def _f(value: Any, spec: str = ".0f") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return format(value, spec)


def _pcts(figures: dict[str, Any] | None) -> str:
    if not figures:
        return "-"
    return "/".join(_f(figures.get(k)) for k in ("p50", "p95", "p99"))


#: (header, cell of a level) of the printed table and the HTML one.
COLUMNS: tuple[tuple[str, Any], ...] = (
    ("clients", lambda lv: str(lv["clients"])),
    ("sent", lambda lv: str(lv["requests"])),
    ("audio", lambda lv: str(lv["answered_audio"])),
    ("req/s", lambda lv: _f(lv["requests_per_s"], ".2f")),
    ("frames/s", lambda lv: _f(lv["frames_per_s"], ".1f")),
    ("engine f/s", lambda lv: _f((lv.get("engine") or {}).get("frames_per_s"), ".1f")),
    ("http/engine", lambda lv: _f(lv["frames_per_s"] / lv["engine"]["frames_per_s"], ".2f")
     if (lv.get("engine") or {}).get("frames_per_s") else "-"),
    ("paired", lambda lv: _f(lv.get("paired_ratio_median"), ".2f")),
    ("CPU eff.", lambda lv: _f(lv.get("cpu_efficiency"), ".2f")),
    ("1st audio ms p50/95/99", lambda lv: _pcts(lv.get("first_audio_ms"))),
    ("engine 1st audio p50", lambda lv: _f(_p50(lv.get("engine"), "first_audio_ms"))),
    ("server's own 1st audio mean", lambda lv: _f(lv.get("server_first_audio_ms_mean"))),
    ("latency ms p50/95/99", lambda lv: _pcts(lv.get("latency_ms"))),
    ("engine latency p50", lambda lv: _f(_p50(lv.get("engine"), "latency_ms"))),
    ("exact", lambda lv: f"{lv['exact']}/{lv['answered_audio']}"),
    ("server CPU s", lambda lv: _f(lv.get("server_cpu_s"), ".1f")),
    ("client CPU s", lambda lv: _f(lv.get("client_cpu_s"), ".1f")),
    ("engine CPU s", lambda lv: _f((lv.get("engine") or {}).get("cpu_s"), ".1f")),
    ("rows/step", lambda lv: _f(lv.get("mean_rows_per_step"), ".2f")),
    ("engine rows/step", lambda lv: _f((lv.get("engine") or {}).get("mean_rows_per_step"), ".2f")),
    ("status", lambda lv: " ".join(f"{k}:{v}" for k, v in sorted(lv["by_status"].items()))),
    ("checks", lambda lv: " ".join(f"{k}:{v}" for k, v in lv["checks"].items() if v)),
    ("RSS MiB", lambda lv: f"{_f(lv.get('rss_start_mb'), '.1f')}->{_f(lv.get('rss_end_mb'), '.1f')}"),
)


def _machine_line(record: dict[str, Any]) -> str:
    m = record.get("machine_before") or {}
    isa = m.get("isa") or {}
    after = (record.get("machine_after") or {}).get("uptime")
    return (f"machine: {m.get('cpu')}, {m.get('cores')} logical CPUs, {' '.join(isa.get('flags', []))} "
            f"(AVX2 {'yes' if 'avx2' in isa.get('flags', []) else 'no'}, AVX-512 {'yes' if isa.get('avx512') else 'no'}, "
            f"VNNI {'yes' if isa.get('vnni') else 'no'}); uptime before: {m.get('uptime')}"
            + (f"; after: {after}" if after else ""))


def render(record: dict[str, Any]) -> str:
    """The run as text: machine, server, one row per level, the soak and the goals."""
    s = record.get("server") or {}
    lines = [f"higgs-pack serve load test, preset {record.get('preset')}, {record.get('label')} "
             f"({record.get('model')}): max_batch {s.get('max_batch')}, max_queue {s.get('max_queue')}, "
             f"{record.get('frames_per_request')} frames per request, {record.get('pool')} distinct requests",
             _machine_line(record)]
    rows = [[cell(lv) for _, cell in COLUMNS] for lv in record.get("levels", [])]
    headers = [h for h, _ in COLUMNS]
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines.append("  ".join(h.rjust(w) for h, w in zip(headers, widths, strict=True)))
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    for level in record.get("levels", []):
        for problem in level.get("problems", [])[:3]:
            lines.append(f"  {level['clients']} clients, job {problem['job']}: {problem['category']}: "
                         f"{problem['detail']}")
    soak = record.get("soak")
    if soak:
        lines.append(f"soak: {soak['requests']} requests at {soak['clients']} clients in {soak['seconds']:.1f} s, "
                     f"{soak['frames_per_s']:.1f} frames/s; RSS {_f(soak.get('rss_start_mb'), '.1f')} -> "
                     f"{_f(soak.get('rss_end_mb'), '.1f')} MiB; checks "
                     + " ".join(f"{k}:{v}" for k, v in soak["checks"].items() if v))
    for goal, met, measured in goal_checks(record):
        lines.append(f"goal {goal}: {measured} -> {goal_state(met)}")
    return "\n".join(lines)


def write_run(record: dict[str, Any], out: Path) -> None:
    """Add ``record`` to the JSON list in ``out``, replacing a run of the same label and preset."""
    runs: list[dict[str, Any]] = []
    if out.is_file():
        try:
            runs = [r for r in json.loads(out.read_text()) if isinstance(r, dict)]
        except (ValueError, TypeError):
            runs = []
    key = (record.get("label"), record.get("preset"))
    runs = [r for r in runs if (r.get("label"), r.get("preset")) != key] + [record]
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    tmp.write_text(json.dumps(runs, indent=2, default=str) + "\n")
    tmp.replace(out)


def _charts(record: dict[str, Any]) -> list[str]:
    """frames/s, first audio, latency and answers per level, and the soak's RSS, as PNGs."""
    plt = require_matplotlib()
    levels = record.get("levels", [])
    x = [lv["clients"] for lv in levels]
    charts = []
    if levels:
        fig, axes = plt.subplots(1, 3, figsize=(13, 3.6))
        ax = axes[0]
        ax.plot(x, [lv["frames_per_s"] for lv in levels], "o-", color="#0969da", label="HTTP")
        eng = [(lv["clients"], lv["engine"]["frames_per_s"]) for lv in levels if lv.get("engine")]
        if eng:
            ax.plot(*zip(*eng, strict=True), "s--", color="#1b1f24", label="engine in-process")
        ax.set_title("aggregate frames/s (25 = 1 s of audio per s)")
        for i, (key, title) in enumerate((("first_audio_ms", "time to first audio, ms (streams)"),
                                          ("latency_ms", "total latency, ms"))):
            ax = axes[i + 1]
            for pct, style in (("p50", "o-"), ("p95", "^-"), ("p99", "v-")):
                pts = [(lv["clients"], lv[key][pct]) for lv in levels if lv.get(key)]
                if pts:
                    ax.plot(*zip(*pts, strict=True), style, label=f"HTTP {pct}")
            pts = [(lv["clients"], _p50(lv.get("engine"), key)) for lv in levels if _p50(lv.get("engine"), key)]
            if pts:
                ax.plot(*zip(*pts, strict=True), "s--", color="#1b1f24", label="engine p50")
            ax.set_title(title)
            ax.set_yscale("log")
        for ax in axes:
            ax.set_xscale("log", base=2)
            ax.set_xticks(x, [str(c) for c in x])
            ax.set_xlabel("concurrent clients")
            ax.grid(alpha=0.25)
            ax.legend(fontsize=7)
        charts.append(img(fig, "frames/s, first audio and latency by concurrency"))

        fig, ax = plt.subplots(figsize=(9, 0.5 * len(levels) + 1.4))
        colors = {"ok": "#1a7f37", "length_differs": "#8c959f", "rejected": "#bf8700", "error": "#cf222e",
                  "lost": "#82071e", "truncated": "#a40e26", "malformed": "#6639ba", "unjustified_429": "#0550ae"}
        left = [0] * len(levels)
        for cat in CATEGORIES:
            vals = [lv["checks"].get(cat, 0) for lv in levels]
            if any(vals):
                ax.barh(range(len(levels)), vals, left=left, color=colors[cat], label=cat.replace("_", " "))
                left = [a + b for a, b in zip(left, vals, strict=True)]
        ax.set_yticks(range(len(levels)), [f"{c} clients" for c in x])
        ax.invert_yaxis()
        ax.set_title("answers by check (429 rejected: queue full)")
        ax.legend(fontsize=7, loc="lower right")
        charts.append(img(fig, "answers by check"))
    soak = record.get("soak") or {}
    readings = [(n, mb) for n, mb in soak.get("rss_readings", []) if mb is not None]
    if len(readings) >= 2:
        fig, ax = plt.subplots(figsize=(9, 3.2))
        ax.plot(*zip(*readings, strict=True), "o-", color="#0969da", label="server RSS")
        base = readings[0][1]
        ax.axhline(base * (1 + GOAL_RSS_GROWTH), color="#1b1f24", linestyle="--", linewidth=1.2,
                   label=f"goal: under +{GOAL_RSS_GROWTH:.0%}")
        ax.set_xlabel("soak answers")
        ax.set_ylabel("MiB")
        ax.set_title(f"server RSS over the soak ({soak['clients']} clients)")
        ax.grid(alpha=0.25)
        ax.legend(fontsize=8)
        charts.append(img(fig, "server RSS over the soak"))
    return charts


def run_section(record: dict[str, Any]) -> str:
    """One run's HTML: what was served, the charts and the level table."""
    s = record.get("server") or {}
    head = "".join(f"<th>{esc(h)}</th>" for h, _ in COLUMNS)
    body = "".join("<tr>" + "".join(f"<td>{esc(cell(lv))}</td>" for _, cell in COLUMNS) + "</tr>"
                   for lv in record.get("levels", []))
    soak = record.get("soak")
    soak_line = (f"<p>Soak: {soak['requests']} requests at {soak['clients']} clients, "
                 f"{_f(soak['frames_per_s'], '.1f')} frames/s; server RSS {_f(soak.get('rss_start_mb'), '.1f')} -> "
                 f"{_f(soak.get('rss_end_mb'), '.1f')} MiB.</p>") if soak else ""
    return (f"<h2>{esc(record.get('label'))}, preset {esc(record.get('preset'))}</h2>"
            f"<p class=\"meta\">{esc(record.get('model'))}: {esc(s.get('backend'))} on {esc(s.get('device'))}, "
            f"max_batch {esc(s.get('max_batch'))}, max_queue {esc(s.get('max_queue'))}, "
            f"{esc(record.get('frames_per_request'))} frames per request; {esc(_machine_line(record))}</p>"
            + "".join(_charts(record)) + f"<table><tr>{head}</tr>{body}</table>" + soak_line)


def serve_bench_html(runs: list[dict[str, Any]]) -> str:
    """The page of every run in ``dist/serve-bench.json``: the goals first, then each run."""
    intro = ("<p class=\"explain\">Concurrent HTTP clients (httpx, one asyncio loop) against <code>higgs-pack serve"
             "</code> on 127.0.0.1, mixed whole WAV files and streamed PCM, fixed seeds and texts; each level bounded "
             "by its request count and seconds. The engine line is the same requests through "
             "<code>tts.engine(max_batch)</code> in its own process, from as many threads. Frames are counted "
             "from the audio bytes (960 samples at 24 kHz). Every answer is checked against the request's reference "
             "(the engine, one request at a time).</p>")
    sections = [intro, goals_table([g for r in runs for g in goal_checks(r)]), *(run_section(r) for r in runs)]
    return page("higgs-pack serve load test", f"{len(runs)} runs", sections)


def write_html(out: Path) -> Path:
    """Write ``<out>.html`` beside the JSON file of runs.

    Raises:
        HiggsPackError: matplotlib is missing (``pip install 'higgs-pack[report]'``).
    """
    runs = [r for r in json.loads(out.read_text()) if r.get("kind") == "serve-bench"]
    path = out.with_suffix(".html")
    path.write_text(serve_bench_html(runs), encoding="utf-8")
    return path

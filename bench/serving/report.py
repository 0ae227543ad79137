"""The load test's goals (issue 20 item 8), its table as text or HTML, ``dist/serve-bench.json``
and ``dist/serve-bench.html`` (its own page: ``nox -s bench`` rewrites bench.html from bench.json)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from bench.common.report import (
    Goal,
    axes,
    esc,
    goal_state,
    goals_table,
    html_table,
    img,
    write_json,
)
from bench.common.systems import machine_line, table
from bench.serving.checks import CATEGORIES, FAILURES
from higgs_pack.runtime.verification.html_report import page, require_matplotlib

#: No lost, truncated or malformed answer at this concurrency.
GOAL_CLEAN_CLIENTS = 64
#: Server RSS growth under this over this many soak requests.
GOAL_RSS_GROWTH = 0.05
GOAL_SOAK_REQUESTS = 500
#: At one client, HTTP first audio (p50) within the in-process stream's + this, ms.
GOAL_FIRST_AUDIO_MARGIN_MS = 50.0
#: At this concurrency, frames/s at least this share of the engine's in-process figure.
GOAL_THROUGHPUT_CLIENTS = 16
GOAL_THROUGHPUT_RATIO = 0.9
#: Live sessions at once whose audio must come whole and in order (issue 31 item 2).
GOAL_LIVE_SESSIONS = 8


def _level(record: dict[str, Any], clients: int) -> dict[str, Any] | None:
    return next((lv for lv in record.get("levels", []) if lv["clients"] == clients), None)


def _p50(figures: dict[str, Any] | None, key: str) -> float | None:
    value = ((figures or {}).get(key) or {}).get("p50")
    return None if value is None or (isinstance(value, float) and math.isnan(value)) else value


def _live_run(record: dict[str, Any], sessions: int) -> dict[str, Any] | None:
    """The live runs of ``sessions`` sessions as one (their sentences pooled), or None."""
    from bench.serving.live import spread

    runs = [r for r in record.get("live") or [] if r["sessions"] == sessions]
    if len(runs) < 2:
        return runs[0] if runs else None
    pooled = {"sessions": sessions, "tokens_per_s": runs[0]["tokens_per_s"], "runs": len(runs),
              **{k: sum(r.get(k, 0) for r in runs) for k in ("seconds", "sentences", "audio_s", "gaps")},
              "max_gap_s": max(r["max_gap_s"] for r in runs), "problems": [p for r in runs for p in r["problems"]]}
    sentences = [s for r in runs for one in r.get("session_records", []) for s in one["sentences"]]
    for key in ("first_audio_after_ready_less_prefill_s", "prefill_s"):
        pooled[key] = spread([s[key] for s in sentences if s.get(key) is not None])
    return pooled


def live_checks(record: dict[str, Any]) -> list[Goal]:
    """The live WebSocket's goals (issue 31 item 2), text arriving like an LLM's: at one session a
    sentence's first speech after it was ready, less its own prefill (the server's ``prefill_s``),
    within the engine's in-process first audio at 1 client + one piece + the HTTP margin; no playback
    gap; at :data:`GOAL_LIVE_SESSIONS` sessions no audio lost or reordered.  ``met`` None without."""
    tag, checks = f"[{record.get('preset')}] {record.get('label')}", []
    one = _live_run(record, 1)
    rate = (one or {}).get("tokens_per_s", 30.0)
    goal = (f"{tag}: live, 1 session, text at {rate:g} tokens/s: a sentence's first speech after it was ready (its "
            f"last piece and the sentence before done) <= its prefill + the in-process stream's first audio + one "
            f"piece + {GOAL_FIRST_AUDIO_MARGIN_MS:g} ms (p50)")
    engine = _p50((_level(record, 1) or {}).get("engine"), "first_audio_ms")
    after = (one or {}).get("first_audio_after_ready_less_prefill_s")
    if one is None or engine is None or not after:
        checks.append((goal, None, "no 1-session live run" if one is None else "no engine figures or no sentence"))
    else:
        piece, prefill = 1000 / rate, _p50(one, "prefill_s")
        checks.append((goal, 1000 * after["p50"] <= engine + piece + GOAL_FIRST_AUDIO_MARGIN_MS,
                       f"{1000 * after['p50']:.0f} ms beyond the prefill (max {1000 * after['max']:.0f}, {after['n']} "
                       f"sentences; prefill p50 {_f(None if prefill is None else 1000 * prefill)} ms) vs "
                       f"{engine:.0f} + {piece:.0f} ms"))
    goal = f"{tag}: live, 1 session: consecutive sentences play with no gap"
    if one is None:
        checks.append((goal, None, "no 1-session live run"))
    else:
        checks.append((goal, one["gaps"] == 0, f"{one['gaps']} gaps (longest {one['max_gap_s']:.2f} s); "
                       f"{one.get('audio_s', 0):.1f} s of audio in {one['seconds']:.1f} s"))
    goal = f"{tag}: live, {GOAL_LIVE_SESSIONS} sessions at once: no audio lost or reordered"
    many = _live_run(record, GOAL_LIVE_SESSIONS)
    if many is None:
        checks.append((goal, None, f"no {GOAL_LIVE_SESSIONS}-session live run"))
    else:
        checks.append((goal, not many["problems"], f"{many['sentences']} sentences, "
                       f"{len(many['problems'])} problems" + "".join(f"; {p}" for p in many["problems"][:2])))
    return checks


def goal_checks(record: dict[str, Any]) -> list[Goal]:
    """The load test's goals as ``(goal, met, measured)``, ``met`` None where the run lacks the
    level, the soak or the engine figures; the live goals (:func:`live_checks`) where it has live runs."""
    tag = f"[{record.get('preset')}] {record.get('label')}"
    goal = f"{tag}: {GOAL_CLEAN_CLIENTS} clients: no lost, truncated or malformed answer; 429 only queue_full " \
           "while the queue is full"
    level = _level(record, GOAL_CLEAN_CLIENTS)
    if level is None:
        checks = [(goal, None, f"no {GOAL_CLEAN_CLIENTS}-client level")]
    else:
        c = level.get("checks_all_rounds") or level["checks"]
        checks = [(goal, sum(c.get(k, 0) for k in FAILURES) == 0,
                   f"{sum(c.values())} sent: " + ", ".join(f"{c.get(k, 0)} {k.replace('_', ' ')}" for k in CATEGORIES))]

    goal, soak = f"{tag}: server RSS growth < {GOAL_RSS_GROWTH:.0%} over {GOAL_SOAK_REQUESTS} requests", record.get("soak")
    if not soak or soak.get("rss_growth") is None:
        checks.append((goal, None, "no soak" if not soak else "the server's RSS was not read (no pid)"))
    elif soak["requests"] < GOAL_SOAK_REQUESTS:
        checks.append((goal, None, f"only {soak['requests']} soak requests"))
    else:
        checks.append((goal, soak["rss_growth"] < GOAL_RSS_GROWTH, f"{soak['rss_start_mb']:.1f} -> "
                       f"{soak['rss_end_mb']:.1f} MiB ({soak['rss_growth']:+.2%}) over {soak['requests']} requests at "
                       f"{soak['clients']} clients"))

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
        checks.append((goal, None, f"no {GOAL_THROUGHPUT_CLIENTS}-client level" if level is None else "no engine figures"))
    else:
        ratio, rounds = level["frames_per_s"] / engine_fps, level.get("paired_ratios") or []
        more = f"; rounds paired {'/'.join(f'{r:.2f}' for r in rounds)}" if len(rounds) > 1 else ""
        if level.get("cpu_efficiency"):
            more += f"; frames per CPU second {level['cpu_efficiency']:.2f}x the engine's"
        if level.get("client_cpu_s") is not None and level.get("server_cpu_s"):  # the load generator shares the cores
            more += f"; the HTTP clients took {level['client_cpu_s']:.1f} CPU s beside the server's " \
                    f"{level['server_cpu_s']:.1f}"
        checks.append((goal, ratio >= GOAL_THROUGHPUT_RATIO, f"{level['frames_per_s']:.1f} vs {engine_fps:.1f} "
                       f"frames/s ({ratio:.2f}x) at max_batch {record['server']['max_batch']}{more}"))
    return checks + (live_checks(record) if record.get("live") else [])


def _f(value: Any, spec: str = ".0f") -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, spec)


def _pcts(figures: dict[str, Any] | None) -> str:
    return "/".join(_f(figures.get(k)) for k in ("p50", "p95", "p99")) if figures else "-"


#: (header, cell of a level) of the level table.
COLUMNS: tuple[tuple[str, Any], ...] = (
    ("clients", lambda lv: str(lv["clients"])), ("sent", lambda lv: str(lv["requests"])),
    ("audio", lambda lv: str(lv["answered_audio"])), ("req/s", lambda lv: _f(lv["requests_per_s"], ".2f")),
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


def _level_table(record: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    return [h for h, _ in COLUMNS], [[cell(lv) for _, cell in COLUMNS] for lv in record.get("levels", [])]


def _lines(record: dict[str, Any]) -> tuple[str, str, str]:
    """What was served, the machine (uptime before and after) and the soak, one line each."""
    s, m, soak = record.get("server") or {}, record.get("machine_before") or {}, record.get("soak")
    after = (record.get("machine_after") or {}).get("uptime")
    return (f"higgs-pack serve load test, preset {record.get('preset')}, {record.get('label')} ({record.get('model')}): "
            f"{s.get('backend')} on {s.get('device')}, max_batch {s.get('max_batch')}, max_queue {s.get('max_queue')}, "
            f"{record.get('frames_per_request')} frames per request, {record.get('pool')} distinct requests",
            machine_line(m) + f"; uptime before: {m.get('uptime')}" + (f"; after: {after}" if after else ""),
            f"soak: {soak['requests']} requests at {soak['clients']} clients in {soak['seconds']:.1f} s, "
            f"{soak['frames_per_s']:.1f} frames/s; RSS {_f(soak.get('rss_start_mb'), '.1f')} -> "
            f"{_f(soak.get('rss_end_mb'), '.1f')} MiB; checks " + " ".join(f"{k}:{v}" for k, v in soak["checks"].items()
                                                                         if v) if soak else "")


def render(record: dict[str, Any]) -> str:
    """The run as text: what was served, the machine, a row per level, problems, the soak, the goals."""
    served, machine, soak = _lines(record)
    lines = [served, table(machine, *_level_table(record))]
    lines += [f"  {lv['clients']} clients, job {p['job']}: {p['category']}: {p['detail']}"
              for lv in record.get("levels", []) for p in lv.get("problems", [])[:3]]
    lines += [soak] * bool(soak) + [_live_line(run) for run in record.get("live") or []]
    lines += [_stall_line(record["stall"])] if record.get("stall") else []
    lines += [f"goal {g}: {m} -> {goal_state(met)}" for g, met, m in goal_checks(record)]
    return "\n".join(lines)


def _stall_line(stall: dict[str, Any]) -> str:
    """The event loop's stall (bench/serving/stall.py) in a line: /health latency idle and busy."""
    def said(phase: dict[str, Any] | None) -> str:
        return "not measured" if not phase else (f"p50 {phase['p50_ms']:.1f} ms, p99 {phase['p99_ms']:.1f} ms, "
                                                  f"max {phase['max_ms']:.1f} ms ({phase['n']} probes)")
    statuses = ", ".join(f"{n} x {code}" for code, n in sorted(stall["statuses"].items()))
    return (f"stall: /health idle {said(stall['idle'])}; while {stall['clones']} cloning requests "
            f"({stall['clip_seconds']:g}-s clips) and a voice upload ran {said(stall['busy'])}; answers {statuses}")


def _live_line(run: dict[str, Any]) -> str:
    """One live run in a line: sessions, sentences, first speech after the text, gaps, problems."""
    def cells(key: str) -> str:
        return "/".join(_f((run.get(key) or {}).get(k), ".2f") for k in ("p50", "p90", "max"))

    return (f"live: {run['sessions']} sessions, text at {run['tokens_per_s']:g} tokens/s: {run['sentences']} "
            f"sentences, {run.get('audio_s', 0):.1f} s of audio in {run['seconds']:.1f} s; first speech p50/p90/max "
            f"after a sentence's last piece {cells('first_audio_after_text_s')} s, after it was ready "
            f"{cells('first_audio_after_ready_s')} s (its prefill {cells('prefill_s')} s; the server's own from its "
            f"text {cells('server_first_audio_s')} s); {run['gaps']} gaps; "
            f"{len(run['problems'])} problems")


def write_run(record: dict[str, Any], out: Path) -> None:
    """Add ``record`` to the JSON list in ``out``, replacing a run of the same label and preset."""
    try:
        runs = [r for r in json.loads(out.read_text()) if isinstance(r, dict)] if out.is_file() else []
    except (ValueError, TypeError):
        runs = []
    key = (record.get("label"), record.get("preset"))
    write_json([r for r in runs if (r.get("label"), r.get("preset")) != key] + [record], out)


def _charts(record: dict[str, Any]) -> list[str]:
    """frames/s, first audio and latency per level beside the engine's; answers by check; the soak's RSS."""
    plt = require_matplotlib()
    levels, charts = record.get("levels", []), []
    x = [lv["clients"] for lv in levels]
    if levels:
        fig, panels = plt.subplots(1, 3, figsize=(13, 3.6))
        panels[0].plot(x, [lv["frames_per_s"] for lv in levels], "o-", color="#0969da", label="HTTP")
        engine = [(lv["clients"], lv["engine"]["frames_per_s"]) for lv in levels if lv.get("engine")]
        if engine:
            panels[0].plot(*zip(*engine, strict=True), "s--", color="#1b1f24", label="engine in-process")
        panels[0].set_title("aggregate frames/s (25 = 1 s of audio per s)")
        for ax, (key, title) in zip(panels[1:], (("first_audio_ms", "time to first audio, ms (streams)"),
                                                 ("latency_ms", "total latency, ms")), strict=True):
            for pct, style in (("p50", "o-"), ("p95", "^-"), ("p99", "v-")):
                pts = [(lv["clients"], lv[key][pct]) for lv in levels if lv.get(key)]
                if pts:
                    ax.plot(*zip(*pts, strict=True), style, label=f"HTTP {pct}")
            pts = [(lv["clients"], _p50(lv.get("engine"), key)) for lv in levels if _p50(lv.get("engine"), key)]
            if pts:
                ax.plot(*zip(*pts, strict=True), "s--", color="#1b1f24", label="engine p50")
            ax.set(title=title, yscale="log")
        for ax in panels:
            ax.set_xscale("log", base=2)
            ax.set_xticks(x, [str(c) for c in x])
            ax.set_xlabel("concurrent clients")
            ax.grid(alpha=0.25)
            ax.legend(fontsize=7)
        charts.append(img(fig, "frames/s, first audio and latency by concurrency"))
        fig, ax = axes(plt, (9, 0.5 * len(levels) + 1.4), "answers by check (429 rejected: queue full)")
        left = [0] * len(levels)
        colors = ("#1a7f37", "#8c959f", "#bf8700", "#cf222e", "#82071e", "#a40e26", "#6639ba", "#0550ae")
        for cat, color in zip(CATEGORIES, colors, strict=True):
            vals = [lv["checks"].get(cat, 0) for lv in levels]
            if any(vals):
                ax.barh(range(len(levels)), vals, left=left, color=color, label=cat.replace("_", " "))
                left = [a + b for a, b in zip(left, vals, strict=True)]
        ax.set_yticks(range(len(levels)), [f"{c} clients" for c in x])
        ax.invert_yaxis()
        ax.legend(fontsize=7, loc="lower right")
        charts.append(img(fig, "answers by check"))
    soak = record.get("soak") or {}
    readings = [(n, mb) for n, mb in soak.get("rss_readings", []) if mb is not None]
    if len(readings) >= 2:
        fig, ax = axes(plt, (9, 3.2), f"server RSS over the soak ({soak['clients']} clients)", "soak answers", "MiB")
        ax.plot(*zip(*readings, strict=True), "o-", color="#0969da", label="server RSS")
        ax.axhline(readings[0][1] * (1 + GOAL_RSS_GROWTH), color="#1b1f24", linestyle="--", linewidth=1.2,
                   label=f"goal: under +{GOAL_RSS_GROWTH:.0%}")
        ax.legend(fontsize=8)
        charts.append(img(fig, "server RSS over the soak"))
    return charts


def write_html(out: Path) -> Path:
    """Write ``<out>.html`` beside the JSON runs: the goals, then each run's charts and table;
    HiggsPackError without matplotlib."""
    runs = [r for r in json.loads(out.read_text()) if r.get("kind") == "serve-bench"]
    intro = ("<p class=\"explain\">Concurrent HTTP clients (httpx, one asyncio loop) against <code>higgs-pack serve"
             "</code> on 127.0.0.1, whole WAV files and streamed PCM, fixed seeds and texts; the engine line is the "
             "same requests through <code>tts.engine(max_batch)</code> in its own process. Frames are counted from "
             "the audio bytes (960 samples at 24 kHz); every answer is checked against its reference.</p>")
    sections = [intro, goals_table([g for r in runs for g in goal_checks(r)])]
    for r in runs:
        served, machine, soak = _lines(r)
        sections.append(f"<h2>{esc(r.get('label'))}, preset {esc(r.get('preset'))}</h2><p class=\"meta\">"
                        f"{esc(served)}; {esc(machine)}</p>" + "".join(_charts(r)) + html_table(*_level_table(r))
                        + (f"<p>{esc(soak)}</p>" if soak else ""))
    path = out.with_suffix(".html")
    path.write_text(page("higgs-pack serve load test", f"{len(runs)} runs", sections), encoding="utf-8")
    return path

"""MkDocs hook: the benchmark pages' tables are rendered from benchmark JSON kept in the
repository (``docs/benchmarks/runs/*.json``, each the ``--out`` file of one ``python -m bench``
run), never typed by hand.

A page asks for a table with a comment on a line of its own::

    <!-- bench-table full-2026-12-05.json prefill -->

``KIND`` is one of :data:`KINDS`; the table is built by the same functions that print the
benchmark's text tables and write ``dist/bench.html`` (``bench.decoder.report``), so the page, the
terminal and the HTML report cannot disagree.  The kind ``ab`` renders the ``--out`` report of a
``python -m bench.ab`` tool (a JSON object with its ``command``) as that tool printed it
(``bench.ab.report_table``), and ``agent`` the ``--out`` of ``python -m bench.serving.agent`` (a JSON
object of kind ``agent-bench``: ``bench.serving.agent.agent_table``).  A missing file, an unknown kind or a run without
the figures a kind needs fails the build (``mkdocs build --strict``) naming the page and marker.
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "docs" / "benchmarks" / "runs"
MARKER = re.compile(r"^<!--[ \t]*bench-table[ \t]+(\S+)[ \t]+(\S+)[ \t]*-->[ \t]*$", re.MULTILINE)


class BenchTableError(Exception):
    """A marker names a run or kind that cannot be rendered."""


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _systems(records: list[dict[str, Any]]) -> tuple[list[str], list[list[str]], list[str]]:
    from bench.decoder.report import COLUMNS, cell

    measured = [r for r in records if r.get("kind") is None]
    keep = [c for c in COLUMNS if any(r.get(c[1]) is not None for r in measured)]
    return [h for h, _, _ in keep], [[cell(r, k, f) for _, k, f in keep] for r in measured], []


def _goals(records: list[dict[str, Any]]) -> tuple[list[str], list[list[str]], list[str]]:
    from bench.common.report import goal_state

    goals = next((r["goals"] for r in records if r.get("kind") == "goals"), [])
    return ["goal", "measured", "state"], [[g["goal"], g["measured"], goal_state(g["met"], g["measured"])]
                                            for g in goals], []


def _serve_goals(records: list[dict[str, Any]]) -> tuple[list[str], list[list[str]], list[str]]:
    """The goals of load-test runs (``dist/serve-bench.json``: a record per label and preset)."""
    from bench.common.report import goal_state
    from bench.serving import report as serve_report

    runs = [r for r in records if "levels" in r and "server" in r]
    return ["goal", "measured", "state"], [[g, m, goal_state(met, m)] for r in runs
                                            for g, met, m in serve_report.goal_checks(r)], []


def _machine(records: list[dict[str, Any]]) -> tuple[list[str], list[list[str]], list[str]]:
    from bench.common.systems import machine_line

    machine = next((r["machine"] for r in records if r.get("machine")), None)
    return ["recorded on"], [[machine_line(machine)]] if machine else [], []


def _builds(records: list[dict[str, Any]]) -> tuple[list[str], list[list[str]], list[str]]:
    rows = [[b["system"] + (" (reused)" if b.get("cached") else ""), f"{b.get('peak_rss_mb') or 0:.0f}",
             f"{b.get('build_s') or 0:.0f}", f"{b.get('bundle_mb') or 0:.0f}", str(b.get("verified"))]
            for b in records if b.get("kind") == "build" and "error" not in b]
    return ["bundle", "build peak RSS MB", "build s", "bundle MB", "verified"], rows, []


def _kinds() -> dict[str, Any]:
    from bench.decoder import report

    return {"systems": _systems, "prefill": report.prefill_table, "batch": report.batch_table,
            "steps": lambda r: (*report.step_table_rows(r), []), "builds": _builds, "goals": _goals,
            "machine": _machine, "serve-goals": _serve_goals}


KINDS = ("systems", "prefill", "batch", "steps", "builds", "goals", "machine", "serve-goals", "ab", "formats", "atempo",
         "agent")
#: Kinds of a ``python -m bench.serving.formats --out`` run (a JSON object with ``formats``).
FORMAT_KINDS = ("formats", "atempo")


def render(name: str, kind: str) -> str:
    """The markdown table ``kind`` of the run ``docs/benchmarks/runs/name``.

    Raises:
        BenchTableError: no such run file, not a JSON list of records, an unknown ``kind``, or a
            run without the figures ``kind`` needs.
    """
    path = RUNS / name
    if not path.is_file():
        raise BenchTableError(f"no benchmark run {_shown(path)} (runs: "
                              f"{', '.join(sorted(p.name for p in RUNS.glob('*.json'))) or 'none'})")
    records = json.loads(path.read_text(encoding="utf-8"))
    if kind not in KINDS:
        raise BenchTableError(f"unknown table kind {kind!r} (one of {', '.join(KINDS)})")
    if kind == "ab":
        from bench.ab.settings import report_table

        if not isinstance(records, dict) or "command" not in records:
            raise BenchTableError(f"{_shown(path)} is not a python -m bench.ab report (a JSON object with its command)")
        try:
            return report_table(records)
        except KeyError as exc:
            raise BenchTableError(f"{_shown(path)}: {exc.args[0]}") from None
    from bench.common.systems import markdown

    if kind == "agent":
        from bench.serving.agent import agent_table

        if not isinstance(records, dict) or records.get("kind") != "agent-bench":
            raise BenchTableError(f"{_shown(path)} is not a python -m bench.serving.agent run (kind agent-bench)")
        return markdown(*agent_table(records))
    if kind in FORMAT_KINDS:
        from bench.serving import formats

        if not isinstance(records, dict) or "formats" not in records:
            raise BenchTableError(f"{_shown(path)} is not a python -m bench.serving.formats run (a JSON object with formats)")
        return markdown(*getattr(formats, f"{kind}_table")(records))
    if not isinstance(records, list):
        raise BenchTableError(f"{_shown(path)} is not a list of benchmark records")
    headers, rows, facts = _kinds()[kind](records)
    if not rows:
        raise BenchTableError(f"{_shown(path)} has no figures for a {kind!r} table")
    return markdown(headers, rows, facts)


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """Replace every ``bench-table`` marker of a page by its table (MkDocs event)."""
    if "bench-table" not in markdown:
        return markdown
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))  # bench/ is imported from the checkout, as `nox -s bench` does

    def one(match: re.Match[str]) -> str:
        try:
            return render(match.group(1), match.group(2))
        except BenchTableError as exc:
            from mkdocs.exceptions import PluginError

            raise PluginError(f"{page.file.src_path}: {match.group(0).strip()}: {exc}") from None

    return MARKER.sub(one, markdown)

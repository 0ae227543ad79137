"""The documentation's benchmark tables, rendered from the runs kept in the repository
(``docs/benchmarks/runs/*.json``, each the ``--out`` file of one benchmark run) into
``docs/benchmarks/tables.json``, which the docs hook (docs/hooks/bench_tables.py) reads without
importing the benchmark: ``python -m bench.tables --write`` after a run is kept or a page gains a
marker; tests/test_docs_bench_tables.py fails while the file is stale.

A page asks for a table with a comment on a line of its own::

    <!-- bench-table full-2026-12-05.json prefill -->

``KIND`` is one of :data:`KINDS`; the table is built by the same functions that print the
benchmark's text tables and write ``dist/bench.html`` (``bench.decoder.report``), so the page, the
terminal and the HTML report cannot disagree.  The kind ``ab`` renders the ``--out`` report of a
``python -m bench.ab`` tool (a JSON object with its ``command``) as that tool printed it
(``bench.ab.settings.report_table``), ``agent`` the ``--out`` of ``python -m bench.serving.agent``
(a JSON object of kind ``agent-bench``: ``bench.serving.agent.agent_table``) and ``formats`` and
``atempo`` that of ``python -m bench.serving.formats``.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common.report import goal_state
from bench.common.systems import ROOT, machine_line, markdown

RUNS = ROOT / "docs" / "benchmarks" / "runs"
#: What the docs hook reads: ``{"kinds": [...], "tables": {run: {kind: markdown}}}``.
TABLES = ROOT / "docs" / "benchmarks" / "tables.json"
#: A marker: ``<!-- bench-table RUN KIND -->`` on a line of its own.
MARKER = re.compile(r"^<!--[ \t]*bench-table[ \t]+(\S+)[ \t]+(\S+)[ \t]*-->[ \t]*$", re.MULTILINE)
KINDS = ("systems", "prefill", "batch", "steps", "builds", "goals", "machine", "serve-goals", "ab", "formats", "atempo",
         "agent")
#: Kinds of a ``python -m bench.serving.formats --out`` run (a JSON object with ``formats``).
FORMAT_KINDS = ("formats", "atempo")
Table = tuple[list[str], list[list[str]], list[str]]


class TableError(Exception):
    """A run or kind that cannot be rendered."""


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def _systems(records: list[dict[str, Any]]) -> Table:
    from bench.decoder.report import COLUMNS, cell

    measured = [r for r in records if r.get("kind") is None]
    keep = [c for c in COLUMNS if any(r.get(c[1]) is not None for r in measured)]
    return [h for h, _, _ in keep], [[cell(r, k, f) for _, k, f in keep] for r in measured], []


def _goals(records: list[dict[str, Any]]) -> Table:
    goals = next((r["goals"] for r in records if r.get("kind") == "goals"), [])
    return ["goal", "measured", "state"], [[g["goal"], g["measured"], goal_state(g["met"], g["measured"])]
                                            for g in goals], []


def _serve_goals(records: list[dict[str, Any]]) -> Table:
    """The goals of load-test runs (``dist/serve-bench.json``: a record per label and preset)."""
    from bench.serving import report as serve_report

    runs = [r for r in records if "levels" in r and "server" in r]
    return ["goal", "measured", "state"], [[g, m, goal_state(met, m)] for r in runs
                                            for g, met, m in serve_report.goal_checks(r)], []


def _machine(records: list[dict[str, Any]]) -> Table:
    machine = next((r["machine"] for r in records if r.get("machine")), None)
    return ["recorded on"], [[machine_line(machine)]] if machine else [], []


def _builds(records: list[dict[str, Any]]) -> Table:
    rows = [[b["system"] + (" (reused)" if b.get("cached") else ""), f"{b.get('peak_rss_mb') or 0:.0f}",
             f"{b.get('build_s') or 0:.0f}", f"{b.get('bundle_mb') or 0:.0f}", str(b.get("verified"))]
            for b in records if b.get("kind") == "build" and "error" not in b]
    return ["bundle", "build peak RSS MB", "build s", "bundle MB", "verified"], rows, []


def _kinds() -> dict[str, Any]:
    from bench.decoder import report

    return {"systems": _systems, "prefill": report.prefill_table, "batch": report.batch_table,
            "steps": lambda r: (*report.step_table_rows(r), []), "builds": _builds, "goals": _goals,
            "machine": _machine, "serve-goals": _serve_goals}


def render(path: Path, kind: str) -> str:
    """The markdown table ``kind`` of the run kept at ``path``.

    Raises:
        TableError: no such run file, an unknown ``kind``, a run not of the shape ``kind`` reads,
            or a run without the figures ``kind`` needs.
    """
    if not path.is_file():
        raise TableError(f"no benchmark run {_shown(path)} (runs: "
                         f"{', '.join(sorted(p.name for p in path.parent.glob('*.json'))) or 'none'})")
    records = json.loads(path.read_text(encoding="utf-8"))
    if kind not in KINDS:
        raise TableError(f"unknown table kind {kind!r} (one of {', '.join(KINDS)})")
    if kind == "ab":
        from bench.ab.settings import report_table

        if not isinstance(records, dict) or "command" not in records:
            raise TableError(f"{_shown(path)} is not a python -m bench.ab report (a JSON object with its command)")
        try:
            return report_table(records)
        except KeyError as exc:
            raise TableError(f"{_shown(path)}: {exc.args[0]}") from None
    if kind == "agent":
        from bench.serving.agent import agent_table

        if not isinstance(records, dict) or records.get("kind") != "agent-bench":
            raise TableError(f"{_shown(path)} is not a python -m bench.serving.agent run (kind agent-bench)")
        return markdown(*agent_table(records))
    if kind in FORMAT_KINDS:
        from bench.serving import formats

        if not isinstance(records, dict) or "formats" not in records:
            raise TableError(f"{_shown(path)} is not a python -m bench.serving.formats run (a JSON object with formats)")
        return markdown(*getattr(formats, f"{kind}_table")(records))
    if not isinstance(records, list):
        raise TableError(f"{_shown(path)} is not a list of benchmark records")
    headers, rows, facts = _kinds()[kind](records)
    if not rows:
        raise TableError(f"{_shown(path)} has no figures for a {kind!r} table")
    return markdown(headers, rows, facts)


def markers(docs: Path = ROOT / "docs") -> list[tuple[str, str, str]]:
    """``(page, run, kind)`` of every marker of the documentation's pages (a marker quoted inside a
    sentence is text, not a marker)."""
    found = []
    for page in sorted(docs.rglob("*.md")):
        found += [(str(page.relative_to(docs)), *m) for m in MARKER.findall(page.read_text(encoding="utf-8"))]
    return found


def render_all(runs: Path = RUNS, docs: Path = ROOT / "docs") -> dict[str, Any]:
    """What :data:`TABLES` holds: every table a page's marker asks for, by run and kind.

    Raises:
        TableError: a marker that cannot be rendered, naming its page and marker.
    """
    tables: dict[str, dict[str, str]] = {}
    for page, run, kind in markers(docs):
        try:
            tables.setdefault(run, {})[kind] = render(runs / run, kind)
        except TableError as exc:
            raise TableError(f"{page}: <!-- bench-table {run} {kind} -->: {exc}") from None
    return {"kinds": list(KINDS), "tables": {run: dict(sorted(t.items())) for run, t in sorted(tables.items())}}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.tables", description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true", help=f"write {_shown(TABLES)} (default: check it is current)")
    args = p.parse_args(argv)
    try:
        fresh = render_all()
    except TableError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    text = json.dumps(fresh, indent=1, ensure_ascii=False) + "\n"
    if args.write:
        TABLES.write_text(text, encoding="utf-8")
        print(f"wrote {_shown(TABLES)}: {sum(map(len, fresh['tables'].values()))} tables")
        return 0
    if not TABLES.is_file() or TABLES.read_text(encoding="utf-8") != text:
        print(f"{_shown(TABLES)} is stale: python -m bench.tables --write", file=sys.stderr)
        return 1
    print(f"{_shown(TABLES)} is current")
    return 0


if __name__ == "__main__":
    sys.exit(main())

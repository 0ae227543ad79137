"""MkDocs hook: the benchmark pages' tables come from the benchmark runs kept in the repository
(``docs/benchmarks/runs/*.json``, each the ``--out`` file of one run), never typed by hand.

A page asks for a table with a comment on a line of its own::

    <!-- bench-table full-2026-12-05.json prefill -->

The hook reads kept JSON only and imports no code of the benchmark: each marker's table is taken
from ``docs/benchmarks/tables.json``, which ``python -m bench.tables --write`` renders from the
kept runs with the benchmark's own table code (so the page, the terminal and ``dist/bench.html``
cannot disagree; tests/test_docs_bench_tables.py fails while it is stale).  A missing run, an
unknown kind or a table not rendered fails the build (``mkdocs build --strict``) naming the page
and marker.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / "docs" / "benchmarks" / "runs"
#: The tables rendered from the runs: ``{"kinds": [...], "tables": {run: {kind: markdown}}}``.
TABLES = ROOT / "docs" / "benchmarks" / "tables.json"
MARKER = re.compile(r"^<!--[ \t]*bench-table[ \t]+(\S+)[ \t]+(\S+)[ \t]*-->[ \t]*$", re.MULTILINE)


class BenchTableError(Exception):
    """A marker names a run or kind that cannot be rendered."""


def _shown(path: Path) -> str:
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def render(name: str, kind: str) -> str:
    """The markdown table ``kind`` of the run ``docs/benchmarks/runs/name``, as rendered into
    :data:`TABLES`.

    Raises:
        BenchTableError: no such run file, an unknown ``kind``, or no such table in :data:`TABLES`.
    """
    path = RUNS / name
    if not path.is_file():
        raise BenchTableError(f"no benchmark run {_shown(path)} (runs: "
                              f"{', '.join(sorted(p.name for p in RUNS.glob('*.json'))) or 'none'})")
    kept = json.loads(TABLES.read_text(encoding="utf-8")) if TABLES.is_file() else {"kinds": [], "tables": {}}
    if kind not in kept["kinds"]:
        raise BenchTableError(f"unknown table kind {kind!r} (one of {', '.join(kept['kinds'])})")
    table = kept["tables"].get(name, {}).get(kind)
    if table is None:
        raise BenchTableError(f"no {kind!r} table of {name} in {_shown(TABLES)}: python -m bench.tables --write "
                              "renders every marker's table (and says why one cannot be)")
    return table


def on_page_markdown(markdown: str, page: Any, **_: Any) -> str:
    """Replace every ``bench-table`` marker of a page by its table (MkDocs event)."""
    if "bench-table" not in markdown:
        return markdown

    def one(match: re.Match[str]) -> str:
        try:
            return render(match.group(1), match.group(2))
        except BenchTableError as exc:
            from mkdocs.exceptions import PluginError

            raise PluginError(f"{page.file.src_path}: {match.group(0).strip()}: {exc}") from None

    return MARKER.sub(one, markdown)

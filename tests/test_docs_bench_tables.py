"""The documentation's benchmark tables (docs/hooks/bench_tables.py) render from the runs kept in
docs/benchmarks/runs/, and a marker that cannot be rendered fails naming the run or kind."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HOOK = ROOT / "docs" / "hooks" / "bench_tables.py"


@pytest.fixture(scope="module")
def hook():
    spec = importlib.util.spec_from_file_location("bench_tables", HOOK)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _markers(hook) -> list[tuple[str, str, str]]:
    """Every marker the hook replaces (a line of its own: one quoted inside a sentence is text)."""
    found = []
    for page in sorted((ROOT / "docs").rglob("*.md")):
        found += [(page.name, *m) for m in hook.MARKER.findall(page.read_text())]
    return found


def test_every_marker_of_the_docs_renders_from_its_kept_run(hook):
    markers = _markers(hook)
    assert markers, "the benchmark results page shows no table from a kept run"
    for page, run, kind in markers:
        table = hook.render(run, kind)
        lines = table.split("\n")  # an A/B tool's tables may open with a line of facts
        header, rule, *rows = lines[next(i for i, line in enumerate(lines) if line.startswith("| ")):]
        assert header.startswith("| ") and rule.replace(" ", "").startswith("|---"), (page, run, kind)
        assert rows and rows[0].startswith("| "), (page, run, kind)


def test_a_table_shows_the_figures_of_its_run(hook):
    run = next(p for p in sorted(hook.RUNS.glob("full-*.json")))  # a nox -s bench run (bench.ab reports are objects)
    records = json.loads(run.read_text())
    measured = [r for r in records if r.get("kind") is None and r.get("prefill_positions_per_s")]
    assert measured, f"{run.name} has no prefill figures"
    table = hook.render(run.name, "prefill")
    for record in measured:
        rate = record["prefill_positions_per_s"]["256"]
        assert f"{rate:.1f}" in table and record["label"] in table


def test_an_ab_report_renders_as_its_tool_printed_it(hook):
    """The rolling-context report kept from the full-size run: each K's prefill share as
    bench/ab/rolling.py prints it."""
    from bench.ab import rolling

    report = json.loads((hook.RUNS / "rolling-context-full-2026-12-05.json").read_text())
    table = hook.render("rolling-context-full-2026-12-05.json", "ab")
    assert table == rolling.table(report)
    for run in report["runs"]:
        assert f"| {run['k']} | {run['keep_frames'] or 'all'} | {100 * run['later_prefill_share']:.1f}% |" in table


def test_bad_markers_name_what_is_wrong(hook, tmp_path, monkeypatch):
    with pytest.raises(hook.BenchTableError, match=r"no benchmark run .*nothing\.json"):
        hook.render("nothing.json", "prefill")
    run = next(p.name for p in sorted(hook.RUNS.glob("*.json")))
    with pytest.raises(hook.BenchTableError, match="unknown table kind 'speed'"):
        hook.render(run, "speed")
    with pytest.raises(hook.BenchTableError, match=rf"no 'agent' table of {run} in .*python -m bench\.tables --write"):
        hook.render(run, "agent")


def test_runs_that_cannot_be_rendered_name_what_is_wrong(tmp_path):
    from bench.tables import TableError, render, render_all

    (tmp_path / "empty.json").write_text(json.dumps([{"kind": "goals", "goals": []}]))
    with pytest.raises(TableError, match="no figures for a 'prefill' table"):
        render(tmp_path / "empty.json", "prefill")
    (tmp_path / "object.json").write_text("{}")
    with pytest.raises(TableError, match="not a list of benchmark records"):
        render(tmp_path / "object.json", "systems")
    with pytest.raises(TableError, match=r"not a python -m bench\.ab report"):
        render(tmp_path / "empty.json", "ab")
    with pytest.raises(TableError, match=r"not a python -m bench\.serving\.formats run"):
        render(tmp_path / "empty.json", "atempo")
    (tmp_path / "other.json").write_text(json.dumps({"command": "ort-fp8"}))
    with pytest.raises(TableError, match=r"unknown bench\.ab command 'ort-fp8'"):
        render(tmp_path / "other.json", "ab")
    with pytest.raises(TableError, match="unknown table kind 'speed'"):
        render(tmp_path / "empty.json", "speed")
    # a page's marker that cannot be rendered is named with its page
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "page.md").write_text("Text.\n\n<!-- bench-table empty.json prefill -->\n")
    with pytest.raises(TableError, match=r"page\.md: <!-- bench-table empty\.json prefill -->: .*no figures"):
        render_all(tmp_path, tmp_path / "docs")


def test_the_hook_reads_kept_json_only_and_its_tables_are_current(hook):
    """The hook imports nothing of the benchmark (the docs' venv has no bench/ on its path):
    docs/benchmarks/tables.json holds every marker's table, as the benchmark's own table code
    renders it from the kept run now (``python -m bench.tables --write`` refreshes it)."""
    import ast

    from bench import tables

    imported = {alias.name.split(".")[0] for node in ast.walk(ast.parse(HOOK.read_text()))
                if isinstance(node, ast.Import | ast.ImportFrom)
                for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module or "")])}
    assert imported <= {"__future__", "json", "re", "pathlib", "typing", "mkdocs"}, imported
    assert hook.MARKER.pattern == tables.MARKER.pattern
    kept = json.loads(hook.TABLES.read_text(encoding="utf-8"))
    assert kept == tables.render_all(), "docs/benchmarks/tables.json is stale: python -m bench.tables --write"
    assert {(run, kind) for _, run, kind in _markers(hook)} == {(run, k) for run, t in kept["tables"].items() for k in t}


def test_cells_with_a_bar_do_not_break_the_table():
    from bench.common.systems import markdown

    text = markdown(["a", "b"], [["x|y", None]], ["fact"])
    assert "| x\\|y | - |" in text and text.endswith("- fact")


def test_a_marker_keeps_the_blank_lines_around_it(hook):
    """The table replaces the marker's line only: the blank line after it stays, so the text that
    follows is a paragraph of its own (it ran into the table's last line), and a line of facts
    before an A/B table is apart from it, so Markdown still sees a table."""
    page = "Before.\n\n<!-- bench-table ab-ort-int4-bench-2026-12-05.json ab -->\n\nAfter.\n"
    out = hook.on_page_markdown(page, None)
    assert out.startswith("Before.\n\ndefault ") and out.endswith(" |\n\nAfter.\n"), out[-200:]
    assert "\n\n| variant |" in out


def test_the_formats_tables_show_the_figures_of_their_run(hook):
    run = json.loads((hook.RUNS / "formats-2026-12-06.json").read_text())
    table = hook.render("formats-2026-12-06.json", "formats")
    mp3 = run["formats"]["mp3"]
    assert f"| `mp3` | {mp3['streamed_ms_per_s']:.2f} | {mp3['whole_ms_per_s']:.2f} | {mp3['kbit_per_s']:.1f} |" in table
    assert run["machine"]["cpu"] in table
    assert f"| 4.0 | {run['atempo_ms_per_s']['4.0']:.2f} |" in hook.render("formats-2026-12-06.json", "atempo")

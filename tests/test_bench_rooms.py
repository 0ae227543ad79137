"""The benchmark's rooms (``bench/``, one per tool) and who imports it, checked on the source with
:mod:`ast`: every tool imports ``common/``; ``serving/`` and ``ab/`` may import ``decoder/``;
``common/`` imports no tool and ``decoder/`` neither of the others.  The tests of the product do not
import the benchmark at their top, nor do the tests' helpers (only the benchmark's own tests do,
and a test of a benchmark tool inside another file imports it where it runs)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: bench's room -> bench's rooms it must never import.
BENCH_FORBIDDEN = {
    "common": frozenset({"decoder", "serving", "ab"}),
    "decoder": frozenset({"serving", "ab"}),
    "serving": frozenset({"ab"}),
    "ab": frozenset({"serving"}),
}
#: The tests of the benchmark itself, besides tests/test_bench*.py: they import it at their top.
BENCHMARK_TESTS = frozenset({"test_llama_cpp_bench.py", "test_serve_load.py", "test_ov_properties.py",
                             "test_ort_int4_options.py", "test_docs_bench_tables.py"})


def bench_imports(tree: ast.AST) -> list[tuple[int, list[str]]]:
    """``(line, dotted parts)`` of every absolute import of ``bench`` among ``tree``'s nodes."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name.split(".")) for a in node.names if a.name.split(".")[0] == "bench"]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "bench":
            parts = node.module.split(".")
            found += [(node.lineno, parts if len(parts) > 1 else [*parts, a.name]) for a in node.names]
    return found


def room_violations(root: Path) -> list[str]:
    out = []
    for room, banned in BENCH_FORBIDDEN.items():
        for path in sorted((root / "bench" / room).rglob("*.py")):
            for line, parts in bench_imports(ast.parse(path.read_text(encoding="utf-8"))):
                if len(parts) > 1 and parts[1] in banned:
                    out.append(f"{path.relative_to(root).as_posix()}:{line}: bench/{room} imports bench/{parts[1]}")
    return out


def test_every_module_of_bench_is_in_a_room():
    loose = sorted(p.name for p in (ROOT / "bench").glob("*.py"))
    assert loose == ["__init__.py", "__main__.py", "tables.py"], loose  # tables.py: every tool's docs tables
    assert sorted(p.name for p in (ROOT / "bench").iterdir() if p.is_dir() and p.name != "__pycache__") == sorted(
        BENCH_FORBIDDEN)


def test_the_benchmark_rooms_follow_their_rules(tmp_path):
    assert room_violations(ROOT) == []
    (tmp_path / "bench" / "common").mkdir(parents=True)
    (tmp_path / "bench" / "common" / "x.py").write_text("def f():\n    from bench.decoder import run\n")
    assert room_violations(tmp_path) == ["bench/common/x.py:2: bench/common imports bench/decoder"]


def test_tests_of_the_product_do_not_import_the_benchmark():
    found = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        if path.name.startswith("test_bench") or path.name in BENCHMARK_TESTS:
            continue
        tree = ast.parse(path.read_text(encoding="utf-8"))
        helper = not path.name.startswith("test_")  # conftest.py, live_server.py...: imported by product tests
        top = tree if helper else ast.Module(body=[n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)],
                                             type_ignores=[])
        found += [f"tests/{path.name}:{line}: imports {'.'.join(parts)}" for line, parts in bench_imports(top)]
    assert found == []

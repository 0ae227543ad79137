"""Issue 28's rule for the package's code: no function over 80 lines (signature, docstring and
body) without a comment saying why (``# Over 80 lines ...``) just above it or opening its body.  Checked on the
source with :mod:`ast`; ``bench/`` and the tests are not the package."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ("higgs_pack", "targets", "exporters", "runtime", "serve", "manifests")
MOST_LINES = 80


def unexplained_long_functions(root: Path, folders: tuple[str, ...] = PACKAGE) -> list[str]:
    """``path:line name (N lines)`` of every function longer than :data:`MOST_LINES` whose
    lines from three above its decorators to its first statement after the docstring hold no
    ``# Over 80 lines``."""
    found = []
    for folder in folders:
        for path in sorted((root / folder).rglob("*.py")):
            lines = path.read_text(encoding="utf-8").splitlines()
            for node in ast.walk(ast.parse("\n".join(lines), str(path))):
                if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    continue
                length = node.end_lineno - node.lineno + 1
                first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                body = node.body[1:] if ast.get_docstring(node) is not None and len(node.body) > 1 else node.body
                near = "\n".join(lines[max(first - 4, 0):body[0].lineno - 1])
                if length > MOST_LINES and "# Over 80 lines" not in near:
                    found.append(f"{path.relative_to(root)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_every_long_package_function_says_why():
    assert unexplained_long_functions(ROOT) == []


def test_a_long_function_without_a_reason_is_found(tmp_path):
    room = tmp_path / "runtime"
    room.mkdir()
    body = "".join(f"    x{i} = {i}\n" for i in range(MOST_LINES))
    (room / "long.py").write_text(f"def plain():\n{body}\n\n# Over 80 lines because: a reason.\n"
                                  f"def explained():\n{body}\n\ndef short():\n    return 1\n")
    assert unexplained_long_functions(tmp_path, ("runtime",)) == ["runtime/long.py:1 plain (81 lines)"]

"""DESIGN.md's import rules, checked on the source with :mod:`ast` (no imports run).

The runtime never imports exporters or targets (it ships without torch); manifests
import none of the other three (pure data and validation); exporters never import
targets (mechanisms do not know the declarations that compose them); the server uses the
runtime and no build code, and nothing below it imports the server (the runtime needs no web
stack).  The benchmark (``bench/``, a folder of the checkout that is not in the wheel) may
import the whole package, and no part of the package imports it.  Every import
counts, also one inside a function: a lazy import still ties the rooms together.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROOMS = ("targets", "exporters", "serve", "runtime", "manifests")
#: The benchmark: a top-level package of the checkout (``import bench``), outside the wheel.
BENCH = "bench"

#: room -> rooms it must never import (``higgs_pack`` is the top-level package's own folder).
FORBIDDEN: dict[str, frozenset[str]] = {
    "serve": frozenset({"exporters", "targets", BENCH}),
    "runtime": frozenset({"exporters", "targets", "serve", BENCH}),
    "manifests": frozenset({"runtime", "exporters", "targets", "serve", BENCH}),
    "exporters": frozenset({"targets", "serve", BENCH}),
    "targets": frozenset({BENCH}),
    "higgs_pack": frozenset({BENCH}),
}


def imported_rooms(path: Path, room: str) -> list[tuple[int, str]]:
    """``(line, room)`` for every import in ``path`` (a module of ``room``) that reaches a room.

    Absolute imports (``higgs_pack.<room>…``, and ``bench…`` as the room :data:`BENCH`) and
    relative ones (``from ..<room> import``) both count; ``from . import x`` stays in ``room``.
    """
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0 and node.module == "higgs_pack":  # from higgs_pack import targets
                names = [f"higgs_pack.{alias.name}" for alias in node.names]
            elif node.level == 0:
                names = [node.module or ""]
            elif node.level == 1:
                names = [f"higgs_pack.{room}"]
            else:  # from ..x import y: a sibling room (or the namespace package itself)
                head = (node.module or "").split(".")[0]
                names = [f"higgs_pack.{head}"] if head else [f"higgs_pack.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if len(parts) >= 2 and parts[0] == "higgs_pack" and parts[1] in ROOMS:
                found.append((node.lineno, parts[1]))
            elif parts[0] == BENCH:
                found.append((node.lineno, BENCH))
    return found


def violations(root: Path) -> list[str]:
    """``path:line: <room> imports <room>`` for every forbidden import under ``root``'s rooms."""
    out = []
    for room, banned in FORBIDDEN.items():
        for path in sorted((root / room).rglob("*.py")):
            for line, other in imported_rooms(path, room):
                if other in banned:
                    out.append(f"{path.relative_to(root).as_posix()}:{line}: {room} imports {other}")
    return out


def test_the_repository_follows_the_import_rules():
    assert not violations(ROOT), "\n".join(violations(ROOT))


def test_every_room_is_checked():
    for room in FORBIDDEN:
        assert list((ROOT / room).glob("*.py")), room


@pytest.mark.parametrize(
    ("room", "source", "expected"),
    [
        ("runtime", "from higgs_pack.targets.base import get_target\n", "1: runtime imports targets"),
        ("runtime", "def f():\n    import higgs_pack.exporters.tiny\n", "2: runtime imports exporters"),
        ("runtime", "from ..exporters import catalog\n", "1: runtime imports exporters"),
        ("manifests", "import os\nfrom higgs_pack.runtime import bundle\n", "2: manifests imports runtime"),
        ("exporters", "from higgs_pack import targets\n", "1: exporters imports targets"),
        ("exporters", "import higgs_pack.targets.declarations as d\n", "1: exporters imports targets"),
        ("targets", "def f():\n    from bench.run import run_bench\n", "2: targets imports bench"),
        ("runtime", "import bench.html\n", "1: runtime imports bench"),
        ("higgs_pack", "from bench import records\n", "1: higgs_pack imports bench"),
    ],
)
def test_a_violation_is_found(tmp_path, room, source, expected):
    (tmp_path / room).mkdir()
    (tmp_path / room / "bad.py").write_text(source)
    assert violations(tmp_path) == [f"{room}/bad.py:{expected}"]


def test_allowed_directions_pass(tmp_path):
    for room, source in (("targets", "from higgs_pack.exporters import catalog\n"),
                         ("exporters", "from higgs_pack.runtime.loop.generate import synthesize\n"),
                         ("runtime", "from higgs_pack.manifests.errors import BundleError\n"),
                         ("bench", "from higgs_pack.targets.build import build\nimport bench.records\n")):
        (tmp_path / room).mkdir()
        (tmp_path / room / "ok.py").write_text(source)
    assert violations(tmp_path) == []

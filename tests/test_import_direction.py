"""DESIGN.md's import rules, checked on the source with :mod:`ast` (no imports run).

The runtime never imports exporters or targets (it ships without torch); manifests
import none of the other three (pure data and validation); exporters never import
targets (mechanisms do not know the declarations that compose them); the server uses the
runtime and no build code, and nothing below it imports the server (the runtime needs no web
stack).  The benchmark (``bench/``, a folder of the checkout that is not in the wheel) may
import the whole package, and no part of the package imports it.  Every import
counts, also one inside a function: a lazy import still ties the rooms together.

Inside exporters/ the rooms are folders too: checkpoint/ (reading and writing checkpoints),
pytorch/ (the sub-part modules and the oracle, which read checkpoints), onnx/ and openvino/
(the exporters: openvino's static shapes run a pytorch module); the shared modules at its root
(catalog, result, process, space) know no room: the catalogue names its exporters only as
``"module:function"`` strings.  And no import from higgs-pack binds the name of a package the
code imports (``onnx``, ``openvino``, ``torch``...): the rooms named for them would hide them.

Inside runtime/ the backends run a bundle they are handed (they never find, open or choose
one), the loop (one request) knows no bundle source and no serving engine, the engine (many
requests on the loop's plans) knows no bundle source, and the types both sides name
(machine/facts.py, sources/opened.py) import nothing of the runtime.  No module of the package reaches itself
through its imports.
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


#: The rooms of exporters/ (folders) and, as ``"exporters"``, its root's shared modules.
EXPORTER_ROOMS = ("checkpoint", "pytorch", "onnx", "openvino")
#: exporters' room -> exporters' rooms it must never import.
EXPORTER_FORBIDDEN: dict[str, frozenset[str]] = {
    "exporters": frozenset(EXPORTER_ROOMS),
    "checkpoint": frozenset({"pytorch", "onnx", "openvino"}),
    "pytorch": frozenset({"onnx", "openvino"}),
    "onnx": frozenset({"checkpoint", "pytorch", "openvino"}),
    "openvino": frozenset({"onnx"}),
}
#: Third-party packages whose names a room of ours also has (or that the code imports beside one).
HIDDEN = frozenset({"onnx", "onnxruntime", "openvino", "torch", "nncf"})


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


def imported_modules(path: Path, package: str) -> list[tuple[int, str, str]]:
    """``(line, module, bound name)`` for every import in ``path``, a module of the dotted
    ``package``, relative imports resolved (``from . import x`` in ``a.b`` is ``a.b.x``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, a.asname or a.name.split(".")[0]) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            found += [(node.lineno, f"{base}.{a.name}", a.asname or a.name) for a in node.names]
    return found


def exporter_violations(root: Path) -> list[str]:
    """``path:line: exporters/<room> imports exporters/<room>`` against :data:`EXPORTER_FORBIDDEN`
    (``exporters imports …`` for a module at its root)."""
    out = []
    for path in sorted((root / "exporters").rglob("*.py")):
        rel = path.relative_to(root / "exporters")
        room = rel.parts[0] if len(rel.parts) > 1 else "exporters"
        if room not in EXPORTER_FORBIDDEN:
            continue
        package = "higgs_pack.exporters" + ("" if room == "exporters" else f".{room}")
        for line, module, _ in imported_modules(path, package):
            parts = module.split(".")
            if parts[:2] == ["higgs_pack", "exporters"] and len(parts) > 2 and parts[2] in EXPORTER_FORBIDDEN[room]:
                where = "exporters" if room == "exporters" else f"exporters/{room}"
                out.append(f"exporters/{rel.as_posix()}:{line}: {where} imports exporters/{parts[2]}")
    return out


def hiding_imports(root: Path) -> list[str]:
    """``path:line: binds <name>`` for an import of higgs-pack (or ``bench``) that binds a
    name of :data:`HIDDEN` (``from higgs_pack.exporters import onnx`` hides the onnx package)."""
    out = []
    for folder in (*ROOMS, "higgs_pack", BENCH, "tests"):
        for path in sorted((root / folder).rglob("*.py")):
            for line, module, bound in imported_modules(path, f"higgs_pack.{folder}"):
                if bound in HIDDEN and module.split(".")[0] != bound:
                    out.append(f"{path.relative_to(root).as_posix()}:{line}: binds {bound}")
    return out


#: runtime's modules that only name types for the rooms above them: they import nothing of the runtime.
RUNTIME_TYPES = ("machine/facts.py", "sources/opened.py")
#: runtime room -> runtime modules (dotted, below ``higgs_pack.runtime``) it must never import: a
#: backend runs a bundle it is handed and never finds, opens or chooses one (it names their
#: types through :data:`RUNTIME_TYPES`); the loop runs one request on sub-parts and knows no source
#: and no serving engine; the engine serves many requests with the loop's plans and knows no source.
RUNTIME_FORBIDDEN: dict[str, tuple[str, ...]] = {
    "backends": ("api", "cli", "batch", "machine.choice", "machine.inventory", "sources.bundle", "sources.hub",
                 "sources.archive", "sources.installed"),
    "loop": ("api", "cli", "batch", "machine", "sources", "verification", "engine"),
    "engine": ("api", "cli", "batch", "machine", "sources", "verification"),
}


def runtime_violations(root: Path) -> list[str]:
    """``path:line: runtime/<room> imports runtime.<module>`` against :data:`RUNTIME_FORBIDDEN`,
    and ``path:line: imports <module>`` for any runtime import of a :data:`RUNTIME_TYPES` module."""
    out = []
    for rel in RUNTIME_TYPES:
        path = root / "runtime" / rel
        if path.is_file():
            package = "higgs_pack.runtime." + ".".join(Path(rel).with_suffix("").parts[:-1])
            out += [f"runtime/{rel}:{line}: imports {module}" for line, module, _ in imported_modules(path, package)
                    if module.startswith("higgs_pack.runtime")]
    for room, banned in RUNTIME_FORBIDDEN.items():
        for path in sorted((root / "runtime" / room).rglob("*.py")):
            package = "higgs_pack.runtime." + ".".join(path.relative_to(root / "runtime").with_suffix("").parts[:-1])
            for line, module, _ in imported_modules(path, package):
                inner = module.removeprefix("higgs_pack.runtime.")
                if module.startswith("higgs_pack.runtime.") and any(inner == b or inner.startswith(b + ".")
                                                                    for b in banned):
                    out.append(f"{path.relative_to(root).as_posix()}:{line}: runtime/{room} imports runtime.{inner}")
    return out


def import_circles(root: Path) -> list[list[str]]:
    """Groups of package modules that import each other, directly or around a loop (every import
    counts: lazy ones and those under ``TYPE_CHECKING`` too), each sorted; [] when there is none."""
    packages = {"higgs_pack": "higgs_pack", **{room: f"higgs_pack.{room}" for room in ROOMS}}
    modules: dict[str, Path] = {}
    for folder, package in packages.items():
        for path in (root / folder).rglob("*.py"):
            parts = [p for p in path.relative_to(root / folder).with_suffix("").parts if p != "__init__"]
            modules[".".join([package, *parts])] = path
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        edges[name] = set()
        for _, module, _ in imported_modules(path, package):
            while module and module not in modules:
                module = module.rpartition(".")[0]
            if module and module not in (name, "higgs_pack"):
                edges[name].add(module)
    reach = {name: set() for name in modules}  # modules each one reaches (small graph: a walk from each)
    for start in modules:
        todo, seen = list(edges[start]), reach[start]
        while todo:
            module = todo.pop()
            if module not in seen:
                seen.add(module)
                todo.extend(edges[module])
    groups = {tuple(sorted({name} | {m for m in reach[name] if name in reach[m]}))
              for name in modules if name in reach[name]}
    return sorted(list(g) for g in groups)


def test_the_runtime_rooms_follow_their_rules():
    assert not runtime_violations(ROOT), "\n".join(runtime_violations(ROOT))


def test_no_module_of_the_package_imports_itself_around_a_circle():
    assert import_circles(ROOT) == []


def test_a_runtime_room_violation_and_a_circle_are_found(tmp_path):
    (tmp_path / "runtime" / "machine").mkdir(parents=True)
    (tmp_path / "runtime" / "backends").mkdir()
    (tmp_path / "runtime" / "machine" / "facts.py").write_text("from higgs_pack.runtime.machine import choice\n")
    (tmp_path / "runtime" / "machine" / "choice.py").write_text("def f():\n    from ..backends import x\n")
    (tmp_path / "runtime" / "backends" / "x.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from higgs_pack.runtime.machine.choice import f\n")
    (tmp_path / "runtime" / "loop").mkdir()
    (tmp_path / "runtime" / "loop" / "plan.py").write_text("from higgs_pack.runtime.engine.engine import Engine\n")
    assert runtime_violations(tmp_path) == [
        "runtime/machine/facts.py:1: imports higgs_pack.runtime.machine.choice",
        "runtime/backends/x.py:3: runtime/backends imports runtime.machine.choice.f",
        "runtime/loop/plan.py:1: runtime/loop imports runtime.engine.engine.Engine"]
    assert import_circles(tmp_path) == [["higgs_pack.runtime.backends.x", "higgs_pack.runtime.machine.choice"]]


def test_the_repository_follows_the_import_rules():
    assert not violations(ROOT), "\n".join(violations(ROOT))


def test_the_exporters_rooms_follow_their_rules():
    assert not exporter_violations(ROOT), "\n".join(exporter_violations(ROOT))
    assert {p.name for p in (ROOT / "exporters").iterdir() if (p / "__init__.py").is_file()} == set(EXPORTER_ROOMS)


def test_no_import_hides_a_package():
    assert not hiding_imports(ROOT), "\n".join(hiding_imports(ROOT))


@pytest.mark.parametrize(
    ("path", "source", "expected"),
    [
        ("checkpoint/x.py", "from higgs_pack.exporters.pytorch.modules import TextEmbed\n",
         "exporters/checkpoint/x.py:1: exporters/checkpoint imports exporters/pytorch"),
        ("onnx/x.py", "def f():\n    from ..openvino import ir\n",
         "exporters/onnx/x.py:2: exporters/onnx imports exporters/openvino"),
        ("catalog.py", "from higgs_pack.exporters import onnx as o\n",
         "exporters/catalog.py:1: exporters imports exporters/onnx"),
    ],
)
def test_an_exporters_room_violation_is_found(tmp_path, path, source, expected):
    (tmp_path / "exporters" / path).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / "exporters" / path).write_text(source)
    assert exporter_violations(tmp_path) == [expected]


def test_a_hiding_import_is_found(tmp_path):
    (tmp_path / "exporters" / "onnx").mkdir(parents=True)
    (tmp_path / "exporters" / "onnx" / "x.py").write_text(
        "import onnx\nfrom higgs_pack.exporters import onnx\nfrom . import graphs\n"
        "import higgs_pack.exporters.pytorch as torch\nimport onnx.helper\n")
    assert hiding_imports(tmp_path) == ["exporters/onnx/x.py:2: binds onnx", "exporters/onnx/x.py:4: binds torch"]


def test_every_room_is_checked():
    for room in FORBIDDEN:
        assert list((ROOT / room).glob("*.py")), room


@pytest.mark.parametrize(
    ("room", "source", "expected"),
    [
        ("runtime", "from higgs_pack.targets.base import get_target\n", "1: runtime imports targets"),
        ("runtime", "def f():\n    import higgs_pack.exporters.checkpoint.tiny\n", "2: runtime imports exporters"),
        ("runtime", "from ..exporters import catalog\n", "1: runtime imports exporters"),
        ("manifests", "import os\nfrom higgs_pack.runtime import bundle\n", "2: manifests imports runtime"),
        ("exporters", "from higgs_pack import targets\n", "1: exporters imports targets"),
        ("exporters", "import higgs_pack.targets.declarations as d\n", "1: exporters imports targets"),
        ("targets", "def f():\n    from bench.decoder.run import run_bench\n", "2: targets imports bench"),
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
                         ("exporters", "from higgs_pack.runtime.loop.synthesis import synthesize\n"),
                         ("runtime", "from higgs_pack.errors import BundleError\n"),
                         ("bench", "from higgs_pack.targets.build import build\nimport bench.decoder.records\n")):
        (tmp_path / room).mkdir()
        (tmp_path / room / "ok.py").write_text(source)
    assert violations(tmp_path) == []

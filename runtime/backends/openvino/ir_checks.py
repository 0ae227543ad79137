"""What ``verify`` reads from an OpenVINO IR bundle without compiling it: the state
variables of an IR and whether the static shapes a bundle promises hold.
"""

from __future__ import annotations

import os
from typing import Any

import openvino as ov


def ir_state_variables(xml_path: str | os.PathLike) -> list[str]:
    """Names of the state variables (ReadValue/Assign) of an IR; empty for a stateless one.

    Reads the graph only (no compilation).
    """
    model = ov.Core().read_model(str(xml_path))
    return sorted(v.info.variable_id for v in model.get_variables())


def static_shape_problems(bundle: Any) -> dict[str, list[str]]:
    """Where a bundle promises static shapes but its IRs or manifest do not have them.

    A sub-part promises static shapes with ``options.static = true``; then every
    input and output of its IR must have a fixed shape, equal to
    ``options.static_shapes[name]`` and to the shape its manifest signature declares.

    Args:
        bundle: an opened ``runtime.sources.opened.Bundle``.

    Returns:
        sub-part -> problems (human-readable), for the sub-parts that promise
        static shapes (an empty list: the promise holds).
    """
    core = ov.Core()
    found: dict[str, list[str]] = {}
    for part, spec in bundle.manifest["subparts"].items():
        options = spec["options"]
        if not options.get("static"):
            continue
        problems: list[str] = []
        promised = options.get("static_shapes") or {}
        declared = {t["name"]: t["shape"] for t in (*spec["inputs"], *spec["outputs"])}
        model = core.read_model(str(bundle.file(spec["entry"])))
        for port in (*model.inputs, *model.outputs):
            name, shape = port.get_any_name(), port.get_partial_shape()
            if shape.is_dynamic:
                problems.append(f"{name} is {shape} in the IR")
                continue
            dims = [int(d.get_length()) for d in shape]
            if name in promised and list(promised[name]) != dims:
                problems.append(f"{name} is {dims} in the IR, options.static_shapes says {promised[name]}")
            if name in declared and list(declared[name]) != dims:
                problems.append(f"{name} is {dims} in the IR, the manifest signature says {declared[name]}")
        for name, shape in declared.items():
            if any(not isinstance(d, int) for d in shape):
                problems.append(f"the manifest signature declares {name} {shape} (not static)")
        found[part] = problems
    return found

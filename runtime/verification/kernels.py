"""Kernel coverage: which ops (opset, element types) an execution provider implements.

GPU providers' tables are JSON files in ``runtime/verification/ops/`` named by the provider row's
``kernel_table`` (read from ONNX Runtime's OperatorKernels.md; each file names its
source); the CPU provider's table is read from the installed onnxruntime's registry.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from typing import Any

from higgs_pack.errors import HiggsPackError
from higgs_pack.manifests.providers import CPU_PROVIDER, EXECUTION_PROVIDERS
from higgs_pack.runtime.verification.onnx_types import (
    ONNX_DOMAIN,
    GraphTypes,
    TypedNode,
    _domain,
    _type_str,
)


def provider_tables() -> dict[str, str]:
    """Bundle EP name -> supported-op table in ``runtime/verification/ops/`` (the provider rows' ``kernel_table``)."""
    return {name: row.sessions.kernel_table for name, row in EXECUTION_PROVIDERS.items() if row.sessions.kernel_table}


@dataclass(frozen=True)
class KernelTable:
    """Which ops a provider implements: (domain, op) -> kernels ``{"versions": [lo, hi], "types": {...}}``."""

    provider: str
    ops: dict[tuple[str, str], list[dict[str, Any]]]
    graph_level: frozenset[tuple[str, str]] = frozenset()
    source: str = ""
    notes: dict[str, str] = field(default_factory=dict)

    def find(self, node: TypedNode) -> tuple[bool, str]:
        """Whether a kernel takes the node: ``(True, "")`` or ``(False, why not)``."""
        key = (_domain(node.domain), node.op_type)
        if key in self.graph_level:
            return True, ""
        kernels = self.ops.get(key)
        if not kernels:
            return False, f"{self.provider} has no {node.op_type} kernel"
        in_range = [k for k in kernels if k["versions"][0] <= node.since_version
                    and (k["versions"][1] is None or node.since_version <= k["versions"][1])]
        if not in_range:
            spans = ", ".join(f"[{k['versions'][0]}, {k['versions'][1] or ''}]" for k in kernels)
            return False, f"{self.provider} implements {node.op_type} for opsets {spans}, not {node.since_version}"
        for kernel in in_range:
            types = kernel.get("types")
            if types is None or all(node.bindings.get(p) in allowed for p, allowed in types.items()
                                    if p in node.bindings):
                return True, ""
        wanted = ", ".join(f"{p}={t}" for p, t in sorted(node.bindings.items()))
        return False, f"{self.provider}'s {node.op_type} kernel has no {wanted} variant"


def load_kernel_table(ep: str) -> KernelTable:
    """The supported-op table of a bundle EP with a ``kernel_table`` (cuda, dml) from ``runtime/verification/ops/``."""
    if ep not in provider_tables():
        raise HiggsPackError(f"no supported-op table for execution provider {ep!r}; tables exist for "
                             f"{', '.join(sorted(provider_tables()))} (runtime/verification/ops/)")
    text = resources.files("higgs_pack.runtime.verification").joinpath("ops", provider_tables()[ep]).read_text(encoding="utf-8")
    data = json.loads(text)
    ops = {(domain, op): kernels for domain, entries in data["ops"].items() for op, kernels in entries.items()}
    graph_level = frozenset((d, op) for d, names in data.get("graph_level_ops", {}).items() for op in names)
    src = data["source"]
    return KernelTable(data["provider"], ops, graph_level, f"{src['repository']} {src['document']} @ {src['commit'][:12]}",
                       data.get("notes", {}))


@cache
def cpu_kernel_table() -> KernelTable:
    """The CPU provider's kernels, read from the installed onnxruntime's own registry."""
    from higgs_pack.runtime.backends.onnxruntime.distributions import import_ort

    ort = import_ort()
    from onnxruntime.capi import onnxruntime_pybind11_state as C

    ops: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for kernel in C.get_all_opkernel_def():
        if kernel.provider != CPU_PROVIDER.ort_provider:
            continue
        lo, hi = kernel.version_range
        types = {p: sorted({_type_str(t) for t in allowed if _type_str(t)}) for p, allowed in kernel.type_constraints.items()}
        ops.setdefault((_domain(kernel.domain), kernel.op_name), []).append(
            {"versions": [lo, None if hi >= 2**31 - 1 else hi], "types": types})
    return KernelTable(CPU_PROVIDER.ort_provider, ops, frozenset({(ONNX_DOMAIN, "Constant")}),
                       f"onnxruntime {ort.__version__} kernel registry")


@dataclass
class Coverage:
    """Nodes of one graph a provider has no kernel for."""

    missing: list[tuple[TypedNode, str]] = field(default_factory=list)
    checked: int = 0

    def summary(self) -> str:
        counts = Counter((n.describe(), why) for n, why in self.missing)
        return "; ".join(f"{n}x {desc}: {why}" for (desc, why), n in sorted(counts.items()))


def coverage(types: GraphTypes, table: KernelTable) -> Coverage:
    """Check every typed node of a graph against a provider's kernel table."""
    result = Coverage()
    for node in types.nodes:
        ok, why = table.find(node)
        result.checked += 1
        if not ok:
            result.missing.append((node, why))
    return result

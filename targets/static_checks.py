"""Checks of an ONNX Runtime bundle that need no GPU, for the cuda and dml targets.

``nox -s verify-cuda`` / ``verify-dml`` run ``python -m higgs_pack.targets.static_checks``
in a runtime-only venv (onnxruntime + onnx, no torch).  One run does, in order:

1. **manifest + files**: schema, every file's size and sha256, every path inside the bundle.
2. **onnx.checker** ``check_model(path, full_check=True)`` on every ONNX file, external
   data resolved inside the bundle.  ModelBuilder puts ONNX Runtime's own
   ``SimplifiedLayerNormalization`` in the default domain, which the onnx package does
   not know: its schema is taken from the installed onnxruntime and registered for the
   check (said in the report), so the node is still checked against a real schema.
3. **dtypes**: every node's inputs agree with the op's type constraints (schemas of the
   installed onnxruntime, contrib ops included), every declared tensor type equals the
   type its producer makes, and a ``Cast``'s ``to`` is what its consumers need: no
   fp32/fp16 mismatch at a Cast boundary.
4. **op coverage**: every node has a kernel on the target's provider for its opset and
   dtypes, per the supported-op tables in ``targets/ops/<ep>.json`` (read from ONNX
   Runtime's OperatorKernels.md; the files name their source).  Nodes that would fall back
   to the CPU provider are listed; on the decoder's data path that fails the check (it
   would defeat the target), elsewhere it is reported.  The CPU provider's own coverage is
   read from the installed onnxruntime's kernel registry.
5. **decoder I/O** against the manifest and the model constants.
6. **CPU parity**: the bundle's sub-parts on the CPU provider against the golden outputs,
   where the CPU provider can execute them (otherwise skipped with ONNX Runtime's reason).
7. **GPU runtime** (:func:`higgs_pack.runtime.verify.check_gpu_provider`): on the target's
   provider when it is usable here, else skipped with a reason naming the hardware.

Command line::

    python -m higgs_pack.targets.static_checks BUNDLE [--cases DIR] [--report JSON]
        [--require-gpu] [--skip-parity]

Exit status 0 when no check failed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from dataclasses import dataclass, field
from functools import cache
from importlib import resources
from pathlib import Path
from typing import Any

from higgs_pack.manifests.constants import EXECUTION_PROVIDERS, SubPart
from higgs_pack.manifests.errors import HiggsPackError
from higgs_pack.runtime.backend_checks import check_gpu_provider
from higgs_pack.runtime.bundle import Bundle, open_bundle
from higgs_pack.runtime.report import VerifyReport
from higgs_pack.runtime.verify import verify_bundle

#: bundle EP name -> supported-op table shipped in ``targets/ops/``.
PROVIDER_TABLES = {"cuda": "cuda.json", "dml": "dml.json"}
#: Floating element types: a node binding one of these is on the data path.
FLOAT_TYPES = frozenset({"float", "float16", "bfloat16", "double"})
#: The sub-part whose fallbacks fail the coverage check (it runs once per generated frame
#: as one graph: a CPU node in it means device<->host copies inside every step).
STRICT_SUBPARTS = frozenset({SubPart.LLM_DECODER.value})
ONNX_DOMAIN = "ai.onnx"


def _domain(domain: str) -> str:
    return domain or ONNX_DOMAIN


def _dtype(elem_type: int) -> str:
    """ONNX element type -> the lower-case name OperatorKernels.md uses (float, float16, int64…)."""
    import onnx

    return onnx.TensorProto.DataType.Name(elem_type).lower()


def _np_dtype(elem_type: int) -> str:
    """ONNX element type -> the numpy name the manifest records (float32, float16, int64…)."""
    import onnx

    try:
        return onnx.helper.tensor_dtype_to_np_dtype(elem_type).name
    except (KeyError, TypeError, ValueError):
        return _dtype(elem_type)


def _type_str(type_str: str) -> str | None:
    """``tensor(float16)`` -> ``float16``; a type parameter (``T``) -> None."""
    if type_str.startswith("tensor(") and type_str.endswith(")"):
        return type_str[len("tensor("):-1]
    return None


# --------------------------------------------------------------------------- schemas


@cache
def _ort_schemas() -> dict[tuple[str, str], list[Any]]:
    """(domain, op) -> ONNX Runtime's schemas (every since_version), contrib ops included."""
    from higgs_pack.runtime.ort_backend import import_ort

    import_ort()
    from onnxruntime.capi import onnxruntime_pybind11_state as C

    table: dict[tuple[str, str], list[Any]] = {}
    for schema in C.get_all_operator_schema():
        table.setdefault((_domain(schema.domain), schema.name), []).append(schema)
    for schemas in table.values():
        schemas.sort(key=lambda s: s.since_version)
    return table


def schema_for(domain: str, op_type: str, opset: int):
    """The schema a node resolves to: the newest ``since_version`` <= the model's opset."""
    candidates = [s for s in _ort_schemas().get((_domain(domain), op_type), []) if s.since_version <= opset]
    return candidates[-1] if candidates else None


def register_runtime_schemas(model) -> list[str]:
    """Teach onnx.checker the default-domain ops that only ONNX Runtime defines.

    ModelBuilder writes ``SimplifiedLayerNormalization`` in the default domain; the onnx
    package has no schema for it and its checker refuses the node.  The schema is copied
    from the installed onnxruntime (inputs, outputs, type constraints, attributes), so
    the checker still verifies the node against the op's real contract.

    Returns:
        ``op@since_version`` of each schema registered (empty when none was needed).
    """
    from onnx import defs

    opsets = {_domain(o.domain): o.version for o in model.opset_import}
    registered: list[str] = []
    for op_type in sorted({n.op_type for n in model.graph.node if _domain(n.domain) == ONNX_DOMAIN}):
        if defs.has(op_type, ""):
            continue
        ort = schema_for("", op_type, opsets.get(ONNX_DOMAIN, 1))
        if ort is None:
            continue  # the checker will name it: an op nobody defines
        option = {"Single": defs.OpSchema.FormalParameterOption.Single,
                  "Optional": defs.OpSchema.FormalParameterOption.Optional,
                  "Variadic": defs.OpSchema.FormalParameterOption.Variadic}

        def params(items, option=option):
            return [defs.OpSchema.FormalParameter(p.name, p.typeStr, "",
                                                  param_option=option[str(p.option).rsplit(".", 1)[-1]])
                    for p in items]

        attributes = [
            defs.OpSchema.Attribute(name, getattr(defs.OpSchema.AttrType, str(a.type).rsplit(".", 1)[-1]), "",
                                    required=bool(a.required))
            for name, a in ort.attributes.items()
        ]
        schema = defs.OpSchema(
            op_type, "", ort.since_version, "registered by higgs-pack from onnxruntime for onnx.checker",
            inputs=params(ort.inputs), outputs=params(ort.outputs),
            type_constraints=[(t.type_param_str, list(t.allowed_type_strs), "") for t in ort.type_constraints],
            attributes=attributes,
        )
        defs.register_schema(schema)
        registered.append(f"{op_type}@{ort.since_version}")
    return registered


# --------------------------------------------------------------------------- dtypes


@dataclass(frozen=True)
class TypedNode:
    """One node with the element types bound to its op's type parameters.

    Attributes:
        name, domain, op_type: the node.
        since_version: the since_version of the schema the node resolves to (what kernels match on).
        bindings: type parameter -> element type (``{"T": "float16", "M": "int32"}``).
    """

    name: str
    domain: str
    op_type: str
    since_version: int
    bindings: dict[str, str]

    @property
    def data_path(self) -> bool:
        """True when the node carries floating tensors (not only shape arithmetic)."""
        return any(t in FLOAT_TYPES for t in self.bindings.values())

    def describe(self) -> str:
        kinds = ", ".join(f"{k}={v}" for k, v in sorted(self.bindings.items()))
        return f"{self.op_type}({_domain(self.domain)} v{self.since_version}{'; ' + kinds if kinds else ''})"


@dataclass
class GraphTypes:
    """Result of :func:`type_graph`: typed nodes, and every dtype inconsistency found."""

    nodes: list[TypedNode] = field(default_factory=list)
    issues: list[str] = field(default_factory=list)
    untyped: list[str] = field(default_factory=list)


def _formal(schema, index: int, kind: str):
    items = schema.inputs if kind == "in" else schema.outputs
    if not items:
        return None
    if index < len(items):
        return items[index]
    last = items[-1]
    return last if str(last.option).endswith("Variadic") else None


def _attr(node, name: str):
    from onnx import helper

    for attribute in node.attribute:
        if attribute.name == name:
            return helper.get_attribute_value(attribute)
    return None


def type_graph(model) -> GraphTypes:
    """Propagate element types through a graph and check them against the op schemas.

    Types come from graph inputs, initializers, ``Cast``'s ``to``, ``Constant`` /
    ``ConstantOfShape`` values and the op schemas of the installed onnxruntime (outputs
    whose type parameter is bound by an input); onnx's shape inference and the file's
    declared ``value_info`` fill the rest.  Problems found: inputs of one type parameter
    with different types (the fp32/fp16 mismatch at a Cast boundary is one of these; the
    message names the Cast), a type outside the parameter's allowed list, a fixed-type
    input (``tensor(int64)``) fed something else, and a declared tensor type (``value_info``
    or graph output) that differs from what its producer makes.  Subgraphs (If, Loop) are
    not entered: no higgs-pack graph has one.
    """
    import onnx

    result = GraphTypes()
    graph = model.graph
    opsets = {_domain(o.domain): o.version for o in model.opset_import}
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # inference is only a fallback source of types
        inferred = model
    declared: dict[str, str] = {}
    for value in [*graph.value_info, *graph.output]:
        if value.type.HasField("tensor_type") and value.type.tensor_type.elem_type:
            declared[value.name] = _dtype(value.type.tensor_type.elem_type)
    guessed = {v.name: _dtype(v.type.tensor_type.elem_type) for v in inferred.graph.value_info
               if v.type.HasField("tensor_type") and v.type.tensor_type.elem_type}
    types: dict[str, str] = {}
    for value in graph.input:
        types[value.name] = _dtype(value.type.tensor_type.elem_type)
    for init in graph.initializer:
        types[init.name] = _dtype(init.data_type)
    cast_of: dict[str, str] = {}

    def cast_note(tensor: str) -> str:
        return f" (made by Cast {cast_of[tensor]!r})" if tensor in cast_of else ""

    for node in graph.node:
        domain = _domain(node.domain)
        label = f"{node.op_type} {node.name or '(unnamed)'}"
        schema = schema_for(domain, node.op_type, opsets.get(domain, 1))
        if schema is None:
            result.issues.append(f"{label}: no schema for {domain}::{node.op_type} in the installed onnxruntime")
            continue
        bindings: dict[str, str] = {}
        bound_by: dict[str, str] = {}
        for index, name in enumerate(node.input):
            if not name:
                continue
            formal = _formal(schema, index, "in")
            dtype = types.get(name) or declared.get(name) or guessed.get(name)
            if formal is None or dtype is None:
                if dtype is None:
                    result.untyped.append(name)
                continue
            fixed = _type_str(formal.typeStr)
            where = cast_note(name)
            if fixed is not None:
                if dtype != fixed:
                    result.issues.append(f"{label}: input {formal.name} {name!r} is {dtype}{where}, "
                                         f"the op takes {fixed}")
                continue
            bound = bindings.get(formal.typeStr)
            if bound is not None and bound != dtype:
                first = bound_by[formal.typeStr]
                result.issues.append(f"{label}: inputs of type {formal.typeStr} disagree: {first!r} is "
                                     f"{bound}{cast_note(first)}, {formal.name} {name!r} is {dtype}{where}")
                continue
            bindings[formal.typeStr] = dtype
            bound_by[formal.typeStr] = name
        allowed = {t.type_param_str: {_type_str(s) for s in t.allowed_type_strs} for t in schema.type_constraints}
        for param, dtype in bindings.items():
            if param in allowed and dtype not in allowed[param]:
                result.issues.append(f"{label}: {param}={dtype} is not allowed by {node.op_type} "
                                     f"(allowed: {', '.join(sorted(t for t in allowed[param] if t))})")
        for index, name in enumerate(node.output):
            if not name:
                continue
            made = _output_type(node, schema, index, bindings)
            if made is not None and declared.get(name) not in (None, made):
                result.issues.append(f"{label}: output {name!r} is declared {declared[name]} but the node "
                                     f"makes {made}")
            dtype = made or declared.get(name) or guessed.get(name)
            if dtype is not None:
                types[name] = dtype
            if node.op_type == "Cast" and domain == ONNX_DOMAIN:
                cast_of[name] = node.name or "(unnamed)"
        result.nodes.append(TypedNode(node.name, domain, node.op_type, schema.since_version, bindings))
    return result


def _output_type(node, schema, index: int, bindings: dict[str, str]) -> str | None:
    """The element type a node's output has (None when neither attributes nor inputs fix it)."""
    import onnx

    if _domain(node.domain) == ONNX_DOMAIN:
        if node.op_type == "Cast":
            return _dtype(_attr(node, "to"))
        if node.op_type in ("Constant", "ConstantOfShape"):
            value = _attr(node, "value")
            if isinstance(value, onnx.TensorProto):
                return _dtype(value.data_type)
            if node.op_type == "ConstantOfShape":
                return "float"
            for name, dtype in (("value_float", "float"), ("value_floats", "float"), ("value_int", "int64"),
                                ("value_ints", "int64")):
                if _attr(node, name) is not None:
                    return dtype
            return None
    formal = _formal(schema, index, "out")
    if formal is None:
        return None
    fixed = _type_str(formal.typeStr)
    if fixed is not None:
        return fixed
    bound = bindings.get(formal.typeStr)
    return bound


# --------------------------------------------------------------------------- kernels


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
    """The supported-op table of a bundle EP (``cuda`` or ``dml``) from ``targets/ops/``."""
    if ep not in PROVIDER_TABLES:
        raise HiggsPackError(f"no supported-op table for execution provider {ep!r}; tables exist for "
                             f"{', '.join(sorted(PROVIDER_TABLES))} (targets/ops/)")
    text = resources.files("higgs_pack.targets").joinpath("ops", PROVIDER_TABLES[ep]).read_text(encoding="utf-8")
    data = json.loads(text)
    ops = {(domain, op): kernels for domain, entries in data["ops"].items() for op, kernels in entries.items()}
    graph_level = frozenset((d, op) for d, names in data.get("graph_level_ops", {}).items() for op in names)
    src = data["source"]
    return KernelTable(data["provider"], ops, graph_level, f"{src['repository']} {src['document']} @ {src['commit'][:12]}",
                       data.get("notes", {}))


@cache
def cpu_kernel_table() -> KernelTable:
    """The CPU provider's kernels, read from the installed onnxruntime's own registry."""
    from higgs_pack.runtime.ort_backend import import_ort

    ort = import_ort()
    from onnxruntime.capi import onnxruntime_pybind11_state as C

    ops: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for kernel in C.get_all_opkernel_def():
        if kernel.provider != "CPUExecutionProvider":
            continue
        lo, hi = kernel.version_range
        types = {p: sorted({_type_str(t) for t in allowed if _type_str(t)}) for p, allowed in kernel.type_constraints.items()}
        ops.setdefault((_domain(kernel.domain), kernel.op_name), []).append(
            {"versions": [lo, None if hi >= 2**31 - 1 else hi], "types": types})
    return KernelTable("CPUExecutionProvider", ops, frozenset({(ONNX_DOMAIN, "Constant")}),
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


# --------------------------------------------------------------------------- bundle checks


def _load_model(bundle: Bundle, spec: dict[str, Any]):
    import onnx

    return onnx.load(str(bundle.file(spec["entry"])), load_external_data=False)


def check_onnx_files(bundle: Bundle, report: VerifyReport) -> None:
    """onnx.checker (full check, external data inside the bundle) on every ONNX sub-part."""
    import onnx

    for part, spec in bundle.manifest["subparts"].items():
        if spec["format"] != "onnx":
            continue
        path = bundle.file(spec["entry"])
        registered = register_runtime_schemas(_load_model(bundle, spec))
        try:
            # A path (not a proto): the checker resolves external data relative to the file,
            # and open_bundle() has proved every location stays inside the bundle.
            onnx.checker.check_model(str(path), full_check=True)
        except Exception as exc:
            report.add(f"onnx.checker {part}", False, f"{type(exc).__name__}: {str(exc).strip()[:400]}")
            continue
        note = (f"; schema of {', '.join(registered)} registered from onnxruntime (an ONNX Runtime op "
                "in the default domain)") if registered else ""
        report.add(f"onnx.checker {part}", True, f"{spec['entry']} passes full_check{note}")


def check_dtypes(bundle: Bundle, report: VerifyReport) -> dict[str, GraphTypes]:
    """Type consistency of every ONNX sub-part (no fp32/fp16 mismatch at Cast boundaries)."""
    typed: dict[str, GraphTypes] = {}
    for part, spec in bundle.manifest["subparts"].items():
        if spec["format"] != "onnx":
            continue
        model = _load_model(bundle, spec)
        types = type_graph(model)
        typed[part] = types
        casts = sum(1 for n in types.nodes if n.op_type == "Cast")
        floats = sorted({t for n in types.nodes for t in n.bindings.values() if t in FLOAT_TYPES})
        if types.issues:
            shown = "; ".join(types.issues[:4])
            more = f" (and {len(types.issues) - 4} more)" if len(types.issues) > 4 else ""
            report.add(f"dtypes {part}", False, f"{len(types.issues)} inconsistencies: {shown}{more}")
        else:
            report.add(f"dtypes {part}", True, f"{len(types.nodes)} nodes consistent ({casts} Cast, floating "
                       f"types {'/'.join(floats) or 'none'})")
    return typed


def check_op_coverage(bundle: Bundle, typed: dict[str, GraphTypes], report: VerifyReport,
                      ep: str | None = None) -> dict[str, Coverage]:
    """Every node has a kernel on the bundle's provider; fallbacks to the CPU provider listed."""
    ep = ep or bundle.manifest["execution_provider"]
    table = load_kernel_table(ep)
    results: dict[str, Coverage] = {}
    for part, types in typed.items():
        cov = coverage(types, table)
        results[part] = cov
        data = [(n, why) for n, why in cov.missing if n.data_path]
        if not cov.missing:
            report.add(f"ops {part}", True, f"all {cov.checked} nodes have {table.provider} kernels ({table.source})")
            continue
        notes = sorted({table.notes[n.op_type] for n, _ in cov.missing if n.op_type in table.notes})
        detail = (f"would fall back to CPUExecutionProvider: {cov.summary()}"
                  f"{' [' + ' '.join(notes) + ']' if notes else ''}")
        if data and part in STRICT_SUBPARTS:
            report.add(f"ops {part}", False, f"{len(data)} data-path nodes {detail}")
        else:
            kind = "data-path" if data else "int64 shape-arithmetic"
            report.add(f"ops {part}", True, f"{len(cov.missing)} {kind} nodes {detail} (reported, not failed: "
                       f"{'this sub-part runs outside the per-step decoder graph' if data else 'ONNX Runtime keeps shape subgraphs on the CPU anyway'})")
    return results


def check_cpu_coverage(bundle: Bundle, typed: dict[str, GraphTypes], report: VerifyReport) -> None:
    """Which sub-parts the installed CPU provider has kernels for (informational)."""
    try:
        table = cpu_kernel_table()
    except Exception as exc:  # an onnxruntime build without the registry API
        report.add("CPU kernels", None, f"not read from the installed onnxruntime: {type(exc).__name__}: {exc}")
        return
    upcast: Counter[str] = Counter()
    missing: dict[str, Coverage] = {}
    for part, types in typed.items():
        cov = coverage(types, table)
        for node, why in cov.missing:
            widened = TypedNode(node.name, node.domain, node.op_type, node.since_version,
                                {p: "float" if t == "float16" else t for p, t in node.bindings.items()})
            if widened.bindings != node.bindings and table.find(widened)[0]:
                # ONNX Runtime's CPU provider wraps such nodes in Casts (InsertedPrecisionFreeCast_*)
                # and runs them in float32: measured with onnxruntime 1.32's profiler.
                upcast[f"{node.op_type}"] += 1
            else:
                missing.setdefault(part, Coverage()).missing.append((node, why))
    lines = []
    if upcast:
        lines.append("float16 nodes the CPU provider runs in float32 through Casts it inserts: "
                     + ", ".join(f"{op} x{n}" for op, n in sorted(upcast.items())))
    if missing:
        lines.append("no CPU kernel: " + "; ".join(f"{part}: {cov.summary()}" for part, cov in missing.items()))
    report.add("CPU kernels", True, f"{table.source}: " + ("; ".join(lines) if lines else
               "a kernel for every node") + " (informational; limits inside a kernel show up in CPU parity)")


def check_decoder_io(bundle: Bundle, report: VerifyReport) -> None:
    """The decoder graph's I/O equals the manifest's and fits the model constants."""
    m = bundle.manifest
    spec = m["subparts"][SubPart.LLM_DECODER.value]
    if spec["format"] != "onnx":
        return
    model = _load_model(bundle, spec)
    problems: list[str] = []

    def sig(values):
        out = {}
        for v in values:
            dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?") for d in v.type.tensor_type.shape.dim]
            out[v.name] = (_np_dtype(v.type.tensor_type.elem_type), dims)
        return out

    inits = {i.name for i in model.graph.initializer}
    graph_in = sig(v for v in model.graph.input if v.name not in inits)
    graph_out = sig(model.graph.output)
    for kind, graph, listed in (("input", graph_in, spec["inputs"]), ("output", graph_out, spec["outputs"])):
        want = {t["name"]: (t["dtype"], t["shape"]) for t in listed}
        for name in sorted(set(graph) | set(want)):
            if name not in graph:
                problems.append(f"manifest {kind} {name!r} is not in the graph")
            elif name not in want:
                problems.append(f"graph {kind} {name!r} is not in the manifest")
            else:
                (gd, gs), (wd, ws) = graph[name], want[name]
                fixed_differ = len(gs) != len(ws) or any(isinstance(a, int) and isinstance(b, int) and a != b
                                                         for a, b in zip(gs, ws, strict=False))
                if gd != wd or fixed_differ:
                    problems.append(f"{kind} {name!r}: graph {gd}{gs}, manifest {wd}{ws}")
    c = m["constants"]
    past = sorted(n for n in graph_in if n.startswith("past_key_values."))
    present = sorted(n for n in graph_out if n.startswith("present."))
    if "inputs_embeds" not in graph_in or "hidden_states" not in graph_out:
        problems.append("the decoder must take inputs_embeds and return hidden_states (llm_decoder contract)")
    else:
        embed_dtype, embed_shape = graph_in["inputs_embeds"]
        if embed_shape[-1] != c["hidden_size"]:
            problems.append(f"inputs_embeds width {embed_shape[-1]} != hidden_size {c['hidden_size']}")
        if graph_out["hidden_states"][0] != embed_dtype:
            problems.append(f"hidden_states is {graph_out['hidden_states'][0]}, inputs_embeds {embed_dtype}")
        for name in past:
            dtype, shape = graph_in[name]
            if dtype != embed_dtype:
                problems.append(f"{name} is {dtype}, inputs_embeds {embed_dtype}")
            if len(shape) != 4 or shape[1] != c["num_key_value_heads"]:
                problems.append(f"{name} shape {shape}: expected [batch, {c['num_key_value_heads']}, past, head_dim]")
    if len(past) != 2 * c["num_layers"]:
        problems.append(f"{len(past)} past_key_values inputs for {c['num_layers']} layers (want key+value per layer)")
    if [p.replace("past_key_values.", "present.") for p in past] != present:
        problems.append("present.* outputs do not mirror past_key_values.* inputs")
    if m["precision"] in ("fp16", "int4") and m["execution_provider"] in ("cuda", "dml") and graph_in.get(
            "inputs_embeds", ("float16",))[0] != "float16":
        problems.append(f"a {m['execution_provider']} {m['precision']} decoder should take float16 embeddings "
                        f"(ModelBuilder's io dtype), found {graph_in['inputs_embeds'][0]}")
    if problems:
        report.add("decoder I/O", False, "; ".join(problems[:6]))
    else:
        dtype = graph_in["inputs_embeds"][0]
        extra = ", position_ids" if "position_ids" in graph_in else ""
        report.add("decoder I/O", True, f"matches the manifest: inputs_embeds {dtype}[..,{c['hidden_size']}], "
                   f"attention_mask{extra}, {len(past)} KV tensors {dtype} for {c['num_layers']} layers, "
                   f"hidden_states {dtype}")


def static_checks(bundle: Bundle, report: VerifyReport, *, ep: str | None = None) -> dict[str, Any]:
    """Run checks 2-5 of the module docstring on an opened bundle, adding to ``report``."""
    check_onnx_files(bundle, report)
    typed = check_dtypes(bundle, report)
    cov = check_op_coverage(bundle, typed, report, ep)
    check_cpu_coverage(bundle, typed, report)
    check_decoder_io(bundle, report)
    return {"types": typed, "coverage": cov}


def verify_gpu_target(
    bundle_path: str | Path,
    *,
    cases_dir: Path | None = None,
    require_gpu: bool = False,
    parity: bool = True,
) -> VerifyReport:
    """Everything ``nox -s verify-cuda`` / ``verify-dml`` checks, as one report.

    Args:
        bundle_path: a cuda or dml bundle directory (or installed bundle name).
        cases_dir: ``shared/cases`` for synthesis on the GPU provider (when present).
        require_gpu: fail, instead of skip, when the target's provider is unusable here
            (the nox session sets it when it found the hardware).
        parity: run the CPU-provider parity against the golden outputs.

    Returns:
        A :class:`~higgs_pack.runtime.verify.VerifyReport`; ``ok`` is False when any check failed.
    """
    report = VerifyReport(bundle=str(bundle_path), backend="static + CPUExecutionProvider")
    try:
        bundle = open_bundle(bundle_path, check_hashes=True)
    except HiggsPackError as exc:
        report.add("manifest+files", False, str(exc))
        return report
    m = bundle.manifest
    report.bundle = m["name"]
    if m["backend"] != "onnxruntime" or m["execution_provider"] not in PROVIDER_TABLES:
        report.add("target", False, f"{m['name']} is a {m['backend']} bundle for {m['execution_provider'] or m['device']}; "
                   f"these checks are for ONNX Runtime bundles on {', '.join(sorted(PROVIDER_TABLES))}")
        return report
    files = sum(1 for _ in m["files"])
    report.add("manifest+files", True, f"format {m['format_version']}, target {m['target']} {m['precision']}, "
               f"{files} files, sha256 ok, every path inside the bundle")
    static_checks(bundle, report)
    if parity:
        cpu = verify_bundle(bundle, execution_provider="cpu", synthesize_cases=False)
        for check in cpu.checks:
            if check.name in ("manifest", "files"):
                continue
            report.add(f"CPU {check.name}", check.ok, check.detail, check.value)
    check_gpu_provider(bundle, report, cases_dir=cases_dir, require=require_gpu)
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m higgs_pack.targets.static_checks",
                                     description="Verify a cuda/dml bundle: static checks, CPU parity, GPU run "
                                                 "where the hardware exists.")
    parser.add_argument("bundle", help="bundle directory or installed bundle name")
    parser.add_argument("--cases", type=Path, help="shared/cases folder to synthesize on the GPU provider")
    parser.add_argument("--report", type=Path, help="also write the report as JSON")
    parser.add_argument("--require-gpu", action="store_true",
                        help="fail (not skip) when the target's GPU provider is unusable here")
    parser.add_argument("--skip-parity", action="store_true", help="no CPU-provider parity run")
    args = parser.parse_args(argv)
    report = verify_gpu_target(args.bundle, cases_dir=args.cases, require_gpu=args.require_gpu,
                               parity=not args.skip_parity)
    print(report.render())
    if args.report:
        args.report.write_text(json.dumps(report.to_dict(), indent=2) + "\n", encoding="utf-8")
    return 0 if report.ok else 1


__all__ = [
    "EXECUTION_PROVIDERS",
    "Coverage",
    "GraphTypes",
    "KernelTable",
    "TypedNode",
    "check_decoder_io",
    "check_dtypes",
    "check_onnx_files",
    "check_op_coverage",
    "coverage",
    "cpu_kernel_table",
    "load_kernel_table",
    "main",
    "register_runtime_schemas",
    "static_checks",
    "type_graph",
    "verify_gpu_target",
]

if __name__ == "__main__":
    sys.exit(main())

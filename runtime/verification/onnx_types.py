"""Typing an ONNX graph with ONNX Runtime's operator schemas (needs ``onnx`` and ``onnxruntime``).

Every node gets the element type bound to each of its type parameters (``T`` ->
``float16``), read from the schemas of the installed onnxruntime, contrib ops
included; inconsistencies (a declared type that is not what the producer makes, a
``Cast`` whose ``to`` is not what its consumers need) are listed.  Also teaches
``onnx.checker`` the default-domain ops only ONNX Runtime defines
(:func:`register_runtime_schemas`).  Used by :mod:`higgs_pack.runtime.verification.static_checks`
and :mod:`higgs_pack.runtime.verification.kernels`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cache
from typing import Any

#: Floating element types: a node binding one of these is on the data path.
FLOAT_TYPES = frozenset({"float", "float16", "bfloat16", "double"})
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
    from higgs_pack.runtime.backends.onnxruntime.distributions import import_ort

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
        ``op@since_version`` of each schema this model needs from onnxruntime (registered
        now, or earlier in this process: the registration is process-wide); empty when
        none was needed.
    """
    from onnx import defs

    opsets = {_domain(o.domain): o.version for o in model.opset_import}
    registered: list[str] = []
    for op_type in sorted({n.op_type for n in model.graph.node if _domain(n.domain) == ONNX_DOMAIN}):
        if op_type in _REGISTERED:
            registered.append(_REGISTERED[op_type])
            continue
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
        _REGISTERED[op_type] = f"{op_type}@{ort.since_version}"
        registered.append(_REGISTERED[op_type])
    return registered


#: Default-domain op -> ``op@since_version`` registered into onnx's schema table by this process.
_REGISTERED: dict[str, str] = {}


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


def _known_types(model) -> tuple[dict[str, str], dict[str, str], dict[str, str]]:
    """The element types a graph states before any node is typed: ``(types, declared, guessed)``:
    its inputs' and initializers' types, its ``value_info`` and outputs' declared types, and
    onnx shape inference's (a fallback; empty when inference fails).  Tensor name -> dtype name."""
    import onnx

    graph = model.graph
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
    types: dict[str, str] = {value.name: _dtype(value.type.tensor_type.elem_type) for value in graph.input}
    types.update({init.name: _dtype(init.data_type) for init in graph.initializer})
    return types, declared, guessed


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
    result = GraphTypes()
    graph = model.graph
    opsets = {_domain(o.domain): o.version for o in model.opset_import}
    types, declared, guessed = _known_types(model)
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

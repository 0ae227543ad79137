"""Reading what an ONNX file declares, without loading its weights.

Every function here opens the graph with ``onnx.load(path,
load_external_data=False)``, so a 1.5 GB embedding table costs nothing to
inspect.  Used by the ModelBuilder and Olive exporters to fill
:class:`~higgs_pack.exporters.result.ExportResult` and to check that a bundle's
external data stays inside the bundle.
"""

from __future__ import annotations

import os
from collections import Counter
from pathlib import Path, PurePosixPath
from typing import Any

import onnx

from higgs_pack.errors import BuildError
from higgs_pack.exporters.result import TensorSpec

#: Weight-only quantized ops (ONNX Runtime contrib ops) whose settings we record.
QUANTIZED_OP_TYPES = ("MatMulNBits", "GatherBlockQuantized")


def _load_graph(path: str | os.PathLike) -> onnx.ModelProto:
    path = Path(path)
    if not path.is_file():
        raise BuildError(f"ONNX file {path} does not exist; the exporter did not write it.")
    return onnx.load(str(path), load_external_data=False)


def dtype_name(elem_type: int) -> str:
    """Map an ONNX ``TensorProto`` element type to its numpy name.

    Args:
        elem_type: ``onnx.TensorProto.FLOAT`` (1), ``INT64`` (7), ``FLOAT16`` (10)...

    Returns:
        ``"float32"``, ``"int64"``, ``"float16"``...; types numpy lacks
        (``bfloat16``, ``float8e4m3fn``...) are returned as ONNX spells them, lower-cased.
    """
    try:
        return onnx.helper.tensor_dtype_to_np_dtype(elem_type).name
    except (KeyError, TypeError, ValueError):
        return onnx.TensorProto.DataType.Name(elem_type).lower()


def _tensor_spec(value: onnx.ValueInfoProto, where: str) -> TensorSpec:
    tensor_type = value.type.tensor_type
    if not value.type.HasField("tensor_type"):
        raise BuildError(
            f"{where}: {value.name!r} is not a tensor; only tensor I/O can be recorded."
        )
    if not tensor_type.HasField("shape"):
        raise BuildError(
            f"{where}: {value.name!r} has no declared rank; the exporter must declare the shape "
            "(symbolic axes through dynamic_axes=...)."
        )
    shape: list[int | str] = []
    for dim in tensor_type.shape.dim:
        if dim.HasField("dim_value"):
            shape.append(int(dim.dim_value))
        elif dim.HasField("dim_param") and dim.dim_param:
            shape.append(dim.dim_param)
        else:
            shape.append("?")
    return TensorSpec(name=value.name, dtype=dtype_name(tensor_type.elem_type), shape=shape)


def onnx_io_signature(path: str | os.PathLike) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Read the inputs and outputs an ONNX graph declares.

    Initializers that some exporters also list as graph inputs are left out.

    Args:
        path: The ``.onnx`` file (its external data is not read).

    Returns:
        ``(inputs, outputs)``, each a list of :class:`TensorSpec` in graph order;
        dtypes as numpy names, symbolic axes as their ``dim_param`` strings.

    Raises:
        BuildError: The file is missing, or an input/output has no declared rank.
    """
    model = _load_graph(path)
    initializers = {init.name for init in model.graph.initializer}
    inputs = [_tensor_spec(v, str(path)) for v in model.graph.input if v.name not in initializers]
    outputs = [_tensor_spec(v, str(path)) for v in model.graph.output]
    return inputs, outputs


def external_data_locations(path: str | os.PathLike) -> list[str]:
    """The ``location`` of every external-data tensor, as written in the graph.

    Args:
        path: The ``.onnx`` file.

    Returns:
        Distinct locations in first-seen order (usually one, ``"model.onnx.data"``).
    """
    from higgs_pack.runtime.sources.bundle import external_data_refs

    return list(external_data_refs(Path(path)))


def check_external_data(path: str | os.PathLike, bundle_dir: str | os.PathLike) -> None:
    """Check that every external-data file of a graph is a relative path inside the bundle.

    Args:
        path: The ``.onnx`` file, somewhere inside ``bundle_dir``.
        bundle_dir: The bundle root.

    Raises:
        BuildError: A location is absolute, climbs out with ``..``, resolves outside
            ``bundle_dir``, or names a file that does not exist.
    """
    path = Path(path)
    root = Path(bundle_dir).resolve()
    for location in external_data_locations(path):
        posix = PurePosixPath(location.replace("\\", "/"))
        if posix.is_absolute() or Path(location).is_absolute() or ".." in posix.parts:
            raise BuildError(
                f"{path}: external data location {location!r} must be a relative path next to "
                "the model; re-save the model with onnx.save(..., location='<name>.onnx.data')."
            )
        target = (path.parent / posix).resolve()
        if not target.is_relative_to(root):
            raise BuildError(
                f"{path}: external data {location!r} resolves to {target}, outside the bundle {root}."
            )
        if not target.is_file():
            raise BuildError(f"{path}: external data file {location!r} is missing ({target}).")


def onnx_files(path: str | os.PathLike, bundle_dir: str | os.PathLike) -> list[str]:
    """The model file and its external-data files, relative to the bundle.

    Args:
        path: The ``.onnx`` file, somewhere inside ``bundle_dir``.
        bundle_dir: The bundle root.

    Returns:
        POSIX paths relative to ``bundle_dir``: the model first, then each external
        data file once, for example ``["llm_decoder/model.onnx",
        "llm_decoder/model.onnx.data"]``.

    Raises:
        BuildError: As :func:`check_external_data`, or the model is outside the bundle.
    """
    path = Path(path).resolve()
    root = Path(bundle_dir).resolve()
    if not path.is_relative_to(root):
        raise BuildError(f"ONNX file {path} is outside the bundle {root}.")
    check_external_data(path, root)
    files = [path.relative_to(root).as_posix()]
    for location in external_data_locations(path):
        rel = (path.parent / location.replace("\\", "/")).resolve().relative_to(root).as_posix()
        if rel not in files:
            files.append(rel)
    return files


def op_type_counts(path: str | os.PathLike) -> dict[str, int]:
    """Count nodes per op type in the main graph.

    Args:
        path: The ``.onnx`` file.

    Returns:
        ``{"MatMulNBits": 14, "GroupQueryAttention": 2, ...}``, sorted by op type.
    """
    counts = Counter(node.op_type for node in _load_graph(path).graph.node)
    return dict(sorted(counts.items()))


def quantized_ops(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """Summarise the weight-only quantized nodes of a graph.

    Reads the attributes the quantizer wrote, so the record is what was used, not
    what was asked for.

    Args:
        path: The ``.onnx`` file.

    Returns:
        op type -> ``{"count": n, "bits": [...], "block_size": [...],
        "accuracy_level": [...]}`` (the distinct attribute values, sorted; an
        attribute the nodes do not set is omitted) for each op in
        :data:`QUANTIZED_OP_TYPES` present in the graph.
    """
    summary: dict[str, dict[str, Any]] = {}
    for node in _load_graph(path).graph.node:
        if node.op_type not in QUANTIZED_OP_TYPES:
            continue
        entry = summary.setdefault(node.op_type, {"count": 0})
        entry["count"] += 1
        for attr in node.attribute:
            if attr.name in ("bits", "block_size", "accuracy_level", "quantize_axis"):
                values = entry.setdefault(attr.name, [])
                value = onnx.helper.get_attribute_value(attr)
                if value not in values:
                    values.append(value)
                    values.sort()
    return summary


def onnx_tool_versions() -> dict[str, str]:
    """Versions of ``onnx`` and ``onnxruntime`` in this interpreter (distribution names)."""
    import onnxruntime

    return {"onnx": onnx.__version__, "onnxruntime": onnxruntime.__version__}


def rename_graph_outputs(
    path: str | os.PathLike, names: list[str] | tuple[str, ...]
) -> dict[str, str]:
    """Give a graph's outputs the declared names, in place (weights untouched).

    Olive's ``OnnxBlockWiseRtnQuantization`` renames the output of every node it
    quantizes to ``<name>_Q4`` / ``_Q8``; when a quantized Gather feeds a graph
    output directly (``text_embed``), the graph output is renamed with it. The
    bundle's I/O contract (``SUBPART_IO``) needs the declared names back.

    Args:
        path: The ``.onnx`` file (external data, if any, stays where it is).
        names: Wanted output names, in graph output order.

    Returns:
        ``{old: new}`` for each output that was renamed (empty when none was).

    Raises:
        BuildError: The graph has a different number of outputs, or a wanted name
            is already taken by another tensor of the graph.
    """
    model = onnx.load(str(path), load_external_data=False)
    graph = model.graph
    if len(graph.output) != len(names):
        raise BuildError(
            f"{path}: the graph has {len(graph.output)} outputs "
            f"{[o.name for o in graph.output]}, expected {len(names)} ({list(names)}); "
            "fix output_names=."
        )
    renamed = {
        o.name: wanted for o, wanted in zip(graph.output, names, strict=True) if o.name != wanted
    }
    if not renamed:
        return {}
    taken = {i.name for i in graph.input} | {i.name for i in graph.initializer}
    taken |= {name for node in graph.node for name in node.output}
    clashes = sorted(set(renamed.values()) & (taken - set(renamed)))
    if clashes:
        raise BuildError(
            f"{path}: cannot rename outputs to {clashes}: the graph already uses those names."
        )
    for node in graph.node:
        node.output[:] = [renamed.get(o, o) for o in node.output]
        node.input[:] = [renamed.get(i, i) for i in node.input]
    for value in [*graph.output, *graph.value_info]:
        value.name = renamed.get(value.name, value.name)
    onnx.save_model(model, str(path))
    return renamed

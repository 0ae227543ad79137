"""OpenVINO IR helpers shared by the OpenVINO exporters: read an IR's signature, state and
weight storage; name, reshape, stamp and save a converted model; the precision check; and
what the stateful and the static decoder exports share (the Qwen3 directory's config, the
:class:`ExportResult` of a saved decoder IR).

Gotchas measured here (openvino 2026.4.1):

* ``openvino.save_model`` compresses float32 constants to float16 unless
  ``compress_to_fp16=False``; every save here passes it explicitly. That flag is
  also how an fp16 IR is made: weights stored as f16 constants followed by a
  Convert to f32; the compute precision is the device's
  ``INFERENCE_PRECISION_HINT``.
* Stateful IRs keep their state after ``compress_weights`` and ``reshape``; the
  state shapes stay dynamic.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import openvino as ov

from higgs_pack.errors import BuildError, BuildPlanError, unknown_choice
from higgs_pack.exporters.catalog import OPTIMUM_OPENVINO
from higgs_pack.exporters.result import ExportResult, TensorSpec
from higgs_pack.manifests.model import FP32_ONLY, SubPart
from higgs_pack.runtime.backends.openvino.devices import decoder_compile_properties

Precision = Literal["fp32", "fp16", "int8", "int4"]

#: Precisions the OpenVINO exporters accept.
PRECISIONS: tuple[str, ...] = ("fp32", "fp16", "int8", "int4")


#: Key under which higgs-pack writes its own entries into an IR's ``rt_info``.
RT_INFO_KEY = "higgs_pack"

_INT_WEIGHT_TYPES = {"u4": "int4", "i4": "int4", "u8": "int8", "i8": "int8"}
_FLOAT_WEIGHT_TYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}


def check_precision(precision: str, subpart: SubPart) -> None:
    if precision not in PRECISIONS:
        raise BuildPlanError(unknown_choice("precision", precision, PRECISIONS, "--precision / precision="))
    if subpart in FP32_ONLY and precision != "fp32":
        raise BuildPlanError(
            f"sub-part {subpart.value} is always exported at fp32 (int4/fp16 codecs are too lossy), "
            f"got precision {precision!r}; pass precision='fp32' for it"
        )


def _dtype_name(element_type: ov.Type) -> str:
    try:
        return np.dtype(element_type.to_dtype()).name
    except (RuntimeError, TypeError, ValueError):
        return element_type.get_type_name()


def _spec(port: ov.Output) -> TensorSpec:
    shape: list[int | str] = []
    for dim in port.get_partial_shape():
        shape.append(dim.get_length() if dim.is_static else ("?" if dim.get_max_length() < 0 else str(dim)))
    return TensorSpec(name=port.get_any_name(), dtype=_dtype_name(port.get_element_type()), shape=shape)


def read_ir(xml: str | Path | ov.Model) -> ov.Model:
    if isinstance(xml, ov.Model):
        return xml
    path = Path(xml)
    if not path.is_file():
        raise BuildError(f"OpenVINO IR {path} does not exist; the exporter did not write it.")
    return ov.Core().read_model(path)


def ir_io_signature(xml: str | Path | ov.Model) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Read the inputs and outputs an OpenVINO IR declares.

    Args:
        xml: The ``.xml`` file (its ``.bin`` beside it) or an ``openvino.Model``.

    Returns:
        ``(inputs, outputs)``, lists of :class:`TensorSpec` in graph order; dtypes as
        numpy names (``"float32"``, ``"int64"``, ``"int32"``...), fixed axes as ints,
        dynamic axes as ``"?"`` (bounded ones as OpenVINO prints them, ``"1..8"``).
        State variables of a stateful IR are not inputs and are not listed.

    Raises:
        BuildError: The file does not exist.
    """
    model = read_ir(xml)
    return [_spec(p) for p in model.inputs], [_spec(p) for p in model.outputs]


def is_stateful(xml: str | Path | ov.Model) -> bool:
    """Whether an IR keeps state (the KV cache) in ReadValue/Assign variables.

    Args:
        xml: The ``.xml`` file or an ``openvino.Model``.

    Returns:
        ``True`` if the model has sinks (Assign) or variables.

    Raises:
        BuildError: The file does not exist.
    """
    model = read_ir(xml)
    return bool(model.get_sinks()) or bool(model.get_variables())


def weight_summary(xml: str | Path | ov.Model) -> dict[str, Any]:
    """Count the weight constants of an IR by storage type, as NNCF left them.

    Weights are constants of rank >= 2 whose last axis is not 1 (that excludes
    the per-group scales and zero points).

    Args:
        xml: The ``.xml`` file or an ``openvino.Model``.

    Returns:
        ``{"weights": {"int4": n, "int8": n, "float16": n, "float32": n},
        "int4_group_sizes": [64, 128]}`` (zero counts and an empty group-size list
        are left out). An int4 weight ``[out, groups, group_size]`` gives its group size.
    """
    model = read_ir(xml)
    counts: Counter[str] = Counter()
    group_sizes: set[int] = set()
    for node in model.get_ordered_ops():
        if node.get_type_name() != "Constant":
            continue
        shape = node.get_output_partial_shape(0)
        if shape.rank.get_length() < 2 or not shape.is_static or shape[-1].get_length() == 1:
            continue
        kind = node.get_output_element_type(0).get_type_name()
        label = _INT_WEIGHT_TYPES.get(kind) or _FLOAT_WEIGHT_TYPES.get(kind)
        if label is None:
            continue
        counts[label] += 1
        if label == "int4" and shape.rank.get_length() == 3:
            group_sizes.add(shape[-1].get_length())
    summary: dict[str, Any] = {"weights": dict(sorted(counts.items()))}
    if group_sizes:
        summary["int4_group_sizes"] = sorted(group_sizes)
    return summary


def set_rt_info(model: ov.Model, subpart: SubPart, precision: str, quantization: Mapping[str, Any],
                versions: Mapping[str, str]) -> None:
    model.set_rt_info(subpart.value, [RT_INFO_KEY, "subpart"])
    model.set_rt_info(precision, [RT_INFO_KEY, "precision"])
    model.set_rt_info(json.dumps(dict(quantization), sort_keys=True), [RT_INFO_KEY, "quantization"])
    model.set_rt_info(json.dumps(dict(versions), sort_keys=True), [RT_INFO_KEY, "tool_versions"])


def save_ir(model: ov.Model, xml: Path, precision: str) -> None:
    xml.parent.mkdir(parents=True, exist_ok=True)
    ov.save_model(model, xml, compress_to_fp16=(precision == "fp16"))


def relative_files(xml: Path, bundle_dir: Path) -> list[str]:
    root = bundle_dir.resolve()
    files = []
    for path in (xml, xml.with_suffix(".bin")):
        path = path.resolve()
        if not path.is_relative_to(root):
            raise BuildError(f"{path} is outside the bundle {root}; pass out_dir inside bundle_dir.")
        files.append(path.relative_to(root).as_posix())
    return files


def _partial_shape(shape: Sequence[int | str | None]) -> ov.PartialShape:
    dims = []
    for d in shape:
        if d is None or isinstance(d, str) or (isinstance(d, int) and d < 0):
            dims.append(ov.Dimension())
        else:
            dims.append(ov.Dimension(int(d)))
    return ov.PartialShape(dims)


def name_and_shape(model: ov.Model, input_names: Sequence[str], output_names: Sequence[str],
                   input_shapes: Sequence[Sequence[int | str | None]] | None, where: str) -> None:
    """Give the IR's ports their contract names (by position) and, optionally, shapes."""
    if len(model.inputs) != len(input_names):
        got = [p.get_names() for p in model.inputs]
        raise BuildError(f"{where}: the converted graph has {len(got)} inputs {got}, expected {list(input_names)}")
    if len(model.outputs) != len(output_names):
        raise BuildError(
            f"{where}: the converted graph has {len(model.outputs)} outputs, expected {list(output_names)}; "
            "the module's forward must return exactly those tensors"
        )
    for port, name in zip(model.inputs, input_names, strict=True):
        port.get_tensor().set_names({name})
    for port, name in zip(model.outputs, output_names, strict=True):
        port.get_tensor().set_names({name})
    if input_shapes is not None:
        if len(input_shapes) != len(input_names):
            raise BuildError(f"{where}: {len(input_shapes)} input shapes given for inputs {list(input_names)}")
        try:
            model.reshape({name: _partial_shape(s) for name, s in zip(input_names, input_shapes, strict=True)})
        except RuntimeError as exc:
            raise BuildError(f"{where}: cannot reshape inputs {list(input_names)} to {input_shapes}: {exc}") from exc


# ----------------------------------------------------------------------------- static shapes


def reshape_static(xml: str | Path, shapes: Mapping[str, Sequence[int]], out_xml: str | Path | None = None) -> Path:
    """Write a copy of an IR with fixed input shapes (for NPU builds).

    NPUs compile static graphs only: for example ``text_embed`` / ``audio_embed`` /
    ``audio_heads`` for one frame (``{"codes": [1, 1, 8]}``) and the codec for a
    fixed chunk of frames. On a stateful decoder only the inputs become static;
    its state keeps dynamic shapes (NPU runs such IRs through the NPUW LLM
    pipeline instead).

    Args:
        xml: The dynamic ``.xml`` file.
        shapes: Input name -> fixed shape (non-negative ints) for every input
            that has a dynamic axis; inputs already static may be left out.
        out_xml: Where to write the static IR (default ``<stem>_static.xml`` beside
            ``xml``). Must differ from ``xml``.

    Returns:
        The path of the written ``.xml`` (its ``.bin`` beside it). Weights are
        saved as they are (no fp16 compression).

    Raises:
        BuildError: ``xml`` is missing, ``out_xml`` equals it, a name is not an input
            (the message lists the inputs), a shape is not all fixed sizes, the
            reshape fails, or an input would stay dynamic.
    """
    xml = Path(xml)
    out_xml = Path(out_xml) if out_xml is not None else xml.with_name(f"{xml.stem}_static.xml")
    if out_xml.resolve() == xml.resolve():
        raise BuildError(f"reshape_static would overwrite {xml} while reading it; pass another out_xml=")
    model = read_ir(xml)
    names = [p.get_any_name() for p in model.inputs]
    target: dict[str, ov.PartialShape] = {}
    for input_name, shape in shapes.items():
        if input_name not in names:
            raise BuildError(unknown_choice("input", input_name, names, "shapes={name: [dims]}"))
        if not all(isinstance(d, (int, np.integer)) and d >= 0 for d in shape):
            raise BuildError(f"{xml.name}: static shape for {input_name!r} must be non-negative ints, got {shape}")
        target[input_name] = ov.PartialShape([int(d) for d in shape])
    try:
        model.reshape(target)
    except RuntimeError as exc:
        raise BuildError(f"{xml.name}: reshape to {dict(shapes)} failed: {exc}") from exc
    dynamic = [p.get_any_name() for p in model.inputs if p.get_partial_shape().is_dynamic]
    if dynamic:
        raise BuildError(
            f"{xml.name}: inputs {dynamic} are still dynamic; give their shapes in shapes= "
            f"(inputs: {names})"
        )
    out_xml.parent.mkdir(parents=True, exist_ok=True)
    ov.save_model(model, out_xml, compress_to_fp16=False)
    return out_xml


# ----------------------------------------------------------------------------- decoders


def qwen3_config(hf_dir: Path):
    """The transformers config of a standard Qwen3 directory (the checkpoint's body, remapped).

    Raises:
        CheckpointError: no ``config.json``, or a ``model_type`` other than ``qwen3``.
    """
    from transformers import AutoConfig

    from higgs_pack.errors import CheckpointError

    if not (hf_dir / "config.json").is_file():
        raise CheckpointError(f"{hf_dir} has no config.json; pass a Qwen3 Hugging Face directory as hf_dir=")
    config = AutoConfig.from_pretrained(hf_dir)
    if config.model_type != "qwen3":
        raise CheckpointError(
            f"{hf_dir}: model_type is {config.model_type!r}, expected 'qwen3' (the checkpoint's body "
            "remapped to a standard Qwen3 directory)"
        )
    return config


def decoder_result(xml: Path, bundle_dir: Path, subpart: str, precision: str, settings: Mapping[str, Any],
                   quantization: dict[str, Any], versions: dict[str, str], *, export_pass: str,
                   options: dict[str, Any]) -> ExportResult:
    """The :class:`ExportResult` of a saved decoder IR (stateful or static: both are the
    ``optimum-openvino`` exporter): passes from the compression settings, I/O signature and
    weight storage read back from the file."""
    passes = [export_pass]
    if settings:
        passes.append(f"nncf.compress_weights({settings['mode'].upper()})")
    elif precision == "fp16":
        passes.append("save_model(compress_to_fp16)")
    inputs, outputs = ir_io_signature(xml)
    files = relative_files(xml, bundle_dir)
    if options.get("static"):
        options = {**options, "static_shapes": {t.name: list(t.shape) for t in (*inputs, *outputs)}}
    options = {**options, "compile_properties": decoder_compile_properties(precision,
                                                                          stateful=bool(options.get("stateful")))}
    return ExportResult(
        subpart=subpart, format="openvino", files=files, entry=files[0], exporter=OPTIMUM_OPENVINO, passes=passes,
        tool_versions=versions, precision=precision, quantization=quantization, inputs=inputs, outputs=outputs,
        options={**options, "compress_to_fp16": precision == "fp16", "weight_storage": weight_summary(xml)},
    )

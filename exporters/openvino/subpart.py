"""OpenVINO IR conversion of the small sub-parts: ``text_embed``, ``audio_embed``,
``audio_heads``, ``audio_tokenizer``, ``audio_encoder``.

:func:`convert_subpart`: by default (``engine="olive"``)
Olive's passes run one by one, without a workflow or its cache:
``OpenVINOConversion`` (``static=False`` with an ``example_input_func``: that
is the only way to give it int64 inputs; it takes input names from the
module's ``forward`` signature and ignores ``io_config``) then, for int8/int4,
``OpenVINOWeightCompression``. Olive cannot name outputs nor give partial shapes
such as ``[?, ?, 8]``, so a last plain-OpenVINO step sets the ``SUBPART_IO``
names, reshapes and saves. ``engine="openvino"`` does the same with
``openvino.convert_model`` + ``nncf.compress_weights`` directly (no Olive
import, which costs about 7 s, and real exceptions: Olive's conversion replaces
any converter error by "Invalid config file").

With ``static_axes`` (the ``npu`` variant) every axis gets a fixed size, planned by
:class:`higgs_pack.exporters.openvino.static_shapes.StaticPlan`.

Gotcha measured here (olive 0.13): Olive's ``OpenVINOWeightCompression`` saves with the
default ``compress_to_fp16=True``, so float weights NNCF leaves alone come out f16;
:func:`~higgs_pack.exporters.openvino.ir.weight_summary` records what the IR really holds.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import openvino as ov

from higgs_pack.errors import BuildError, BuildPlanError, unknown_choice
from higgs_pack.exporters.catalog import OLIVE_OPENVINO
from higgs_pack.exporters.openvino.compression import nncf_compress
from higgs_pack.exporters.openvino.ir import (
    Precision,
    check_precision,
    ir_io_signature,
    name_and_shape,
    relative_files,
    save_ir,
    set_rt_info,
    weight_summary,
)
from higgs_pack.exporters.openvino.plan import SUBPART_NNCF, compress_settings
from higgs_pack.exporters.openvino.static_shapes import StaticPlan
from higgs_pack.exporters.result import ExportResult, tool_versions
from higgs_pack.manifests.model import SUBPART_IO, SubPart

if TYPE_CHECKING:
    import torch

#: Sub-part conversion mechanisms for :func:`convert_subpart`.
ENGINES: tuple[str, ...] = ("olive", "openvino")


def _shapes_from_dynamic_axes(example_inputs: Sequence[Any], input_names: Sequence[str],
                              dynamic_axes: Mapping[str, Any]) -> list[list[int | str]]:
    """``torch.onnx``-style dynamic axes -> one partial shape per input (example sizes elsewhere)."""
    if len(example_inputs) != len(input_names):
        raise BuildError(f"{len(example_inputs)} example inputs given for inputs {list(input_names)}")
    shapes: list[list[int | str]] = []
    for example, input_name in zip(example_inputs, input_names, strict=True):
        shape: list[int | str] = [int(d) for d in example.shape]
        axes = dynamic_axes.get(input_name) or {}
        named = axes.items() if isinstance(axes, Mapping) else ((a, f"{input_name}_dim{a}") for a in axes)
        for axis, label in named:
            if not -len(shape) <= int(axis) < len(shape):
                raise BuildError(f"dynamic axis {axis} of {input_name!r} is outside its rank {len(shape)}")
            shape[int(axis)] = str(label)
        shapes.append(shape)
    return shapes


def _convert_olive(module: torch.nn.Module, example_inputs: tuple, precision: str, settings: Mapping[str, Any],
                   name: str, work: Path) -> tuple[ov.Model, list[str]]:
    from olive.model import PyTorchModelHandler
    from olive.passes.olive_pass import create_pass_from_dict
    from olive.passes.openvino.compression import OpenVINOWeightCompression
    from olive.passes.openvino.conversion import OpenVINOConversion

    handler = PyTorchModelHandler(model_loader=lambda _path: module)
    conversion = create_pass_from_dict(
        OpenVINOConversion,
        {
            # A function, so Olive calls it; it is the only way to give int64 examples.
            "example_input_func": lambda: tuple(example_inputs),
            "static": False,
            "compress_to_fp16": precision == "fp16",
            "model_name": name,
        },
        disable_search=True,
    )
    try:
        converted = conversion.run(handler, str(work / "conversion"))
    except ValueError as exc:
        raise BuildError(
            f"Olive OpenVINOConversion failed for {name} ({exc}); Olive hides the converter's error: "
            "rerun with engine='openvino' to see it"
        ) from exc
    passes = ["OpenVINOConversion"]
    if settings:
        compress_config = {k: v for k, v in settings.items() if k in ("mode", "group_size", "ratio", "all_layers")}
        extra: dict[str, Any] = {}
        if "group_size_fallback_mode" in settings:
            extra["advanced_compression_parameters"] = {
                "group_size_fallback_mode": settings["group_size_fallback_mode"]
            }
        compression = create_pass_from_dict(
            OpenVINOWeightCompression,
            {"compress_config": compress_config, "extra_args": extra or None},
            disable_search=True,
        )
        converted = compression.run(converted, str(work / "compression"))
        passes.append(f"OpenVINOWeightCompression({settings['mode'].upper()})")
    return ov.Core().read_model(converted.model_config["model"]), passes


def _convert_openvino(module: torch.nn.Module, example_inputs: tuple, precision: str,
                      settings: Mapping[str, Any]) -> tuple[ov.Model, list[str]]:
    try:
        model = ov.convert_model(module, example_input=tuple(example_inputs))
    except Exception as exc:
        raise BuildError(f"openvino.convert_model failed: {exc}") from exc
    passes = ["convert_model"]
    if settings:
        model, _ = nncf_compress(model, precision, settings.get("group_size", SUBPART_NNCF.group_size),
                                 settings.get("ratio", SUBPART_NNCF.ratio),
                                 settings.get("all_layers", SUBPART_NNCF.all_layers), settings.get("mode") == "int4_sym")
        passes.append(f"nncf.compress_weights({settings['mode'].upper()})")
    return model, passes


# ----------------------------------------------------------------------------- static sub-parts (npu)


# Over 80 lines because of its signature and docstring (100 of them): the 22 keywords are the
# catalogue's options for olive-openvino, real keyword parameters (tests/test_plan.py checks this),
# each documented here; the body is one conversion read top to bottom (resolve, convert, name, save).
def convert_subpart(
    module: torch.nn.Module,
    example_inputs: tuple,
    *,
    subpart: SubPart | str,
    out_dir: str | Path,
    precision: Precision,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    input_shapes: Sequence[Sequence[int | str | None]] | None = None,
    dynamic_axes: Mapping[str, Any] | None = None,
    name: str | None = None,
    group_size: int = SUBPART_NNCF.group_size,
    ratio: float = SUBPART_NNCF.ratio,
    all_layers: bool = SUBPART_NNCF.all_layers,
    engine: Literal["olive", "openvino"] = "olive",
    bundle_dir: str | Path | None = None,
    work_dir: str | Path | None = None,
    static_axes: Mapping[str, int] | None = None,
    chunk_context: int | Literal["auto"] = 0,
    pad_mask: bool = False,
    allow_chunks: bool = True,
    device_overrides: Mapping[str, str] | None = None,
    device_override_reason: str | None = None,
    symmetric: bool = SUBPART_NNCF.symmetric,
) -> ExportResult:
    """Convert one small sub-part (embeddings, audio heads, codec) to OpenVINO IR.

    With ``static_axes`` (the ``npu`` variant) every input axis gets a fixed size
    and the manifest options say how the runtime pads or chunks real inputs into
    that shape (``static``, ``static_shapes``, ``chunking``); see
    ``higgs_pack.runtime.backends.openvino.static_runners.OvStaticSubPart``.

    Args:
        module: The PyTorch module, in eval mode; ``forward`` takes the inputs in
            the order of ``input_names`` and returns the outputs in the order of
            ``output_names`` (a tensor or a tuple).
        example_inputs: One tensor per input, for tracing: int64 for ids/codes
            (``codes`` int64 [batch, frames, 8]), float32 otherwise. Their sizes only
            shape the trace; axes stay dynamic unless ``input_shapes`` fixes them.
        subpart: Which sub-part (``"text_embed"``, ``"audio_embed"``,
            ``"audio_heads"``, ``"audio_tokenizer"``, ``"audio_encoder"``).
        out_dir: Where ``<name>.xml`` / ``<name>.bin`` are written.
        precision: ``"fp32"``, ``"fp16"`` (weights stored as float16), ``"int8"``
            (NNCF INT8_ASYM per channel) or ``"int4"`` (NNCF INT4_ASYM grouped). The
            codec sub-parts accept fp32 only.
        input_names: Graph input names, default ``SUBPART_IO[subpart][0]``.
        output_names: Graph output names, default ``SUBPART_IO[subpart][1]``.
        input_shapes: One shape per input; each axis an int (fixed) or ``None``,
            ``-1`` or a string (dynamic), e.g. ``[[None, None, 8]]`` for ``codes``.
            ``None`` (the default) leaves every axis dynamic. All-int shapes give
            a static IR (see also
            :func:`~higgs_pack.exporters.openvino.ir.reshape_static`).
        dynamic_axes: Alternative to ``input_shapes``, as for ``torch.onnx.export``:
            input name -> ``{axis: symbolic name}`` or a list of axes. Those axes are
            dynamic, every other axis keeps the example's size (``{"codes": {0:
            "batch", 1: "frames"}}`` with a [1, 3, 8] example gives [?, ?, 8]).
            Output entries are ignored (OpenVINO infers output shapes); OpenVINO IR
            keeps no axis names, so the signature says ``"?"``.
        name: File stem (default the sub-part name).
        group_size: int4 only: NNCF group size (adjusted down where it does not divide).
        ratio: int4 only: share of weights in int4, the rest int8.
        all_layers: int4 only: compress every layer to int4 (default ``True``: a
            one-MatMul head would otherwise stay in NNCF's int8 backup).
        engine: ``"olive"`` (Olive's OpenVINOConversion + OpenVINOWeightCompression
            passes) or ``"openvino"`` (``openvino.convert_model`` + ``nncf.compress_weights``).
        bundle_dir: Root the returned file paths are relative to (default ``out_dir``).
        work_dir: Parent of the temporary directory for intermediate IRs (default
            ``out_dir``); it is removed afterwards.
        static_axes: Symbolic axis name (as in ``dynamic_axes``: ``"batch"``,
            ``"sequence"``, ``"frames"``, ``"samples"``) -> fixed size, for every
            symbolic axis of the inputs, e.g. ``{"batch": 1, "frames": 1}``. The
            one non-batch axis is the chunk axis the runtime pads or splits along.
        chunk_context: Static only: input positions of context the runtime adds on
            each side of a chunk when it splits a longer input, then drops from the
            output; ``"auto"`` measures the module's receptive field (perturb one
            position, see how far the output changes) and adds one.
        pad_mask: Static only, single-input convolutional modules (the codec
            decoder): add an int64 [1] input ``valid_<axis>`` and zero every
            Conv1d/ConvTranspose1d input beyond that many positions (scaled to each
            layer's rate), so a zero-padded chunk decodes exactly like the unpadded
            input (every conv sees the zeros its own padding would add).
        allow_chunks: Static only: whether the runtime may split inputs longer than
            the static axis into chunks (False for ``text_embed``: a longer prompt is
            refused with an error naming both lengths).
        device_overrides: Recorded in the manifest: bundle device -> device this
            sub-part is compiled for instead (``{"NPU": "CPU"}`` keeps a dynamic
            sub-part off the NPU).
        device_override_reason: Recorded in the manifest beside ``device_overrides``: why.
        symmetric: int4 only: NNCF INT4_SYM instead of INT4_ASYM (NPU bundles).

    Returns:
        An :class:`ExportResult` (``exporter="olive-openvino"``; ``options["engine"]`` the engine), with the
        I/O signature read back from the saved IR.

    Raises:
        BuildPlanError: Unknown sub-part, precision or engine, a codec at a
            precision other than fp32, both ``input_shapes`` and ``dynamic_axes``, or
            static options that do not fit the sub-part's axes.
        BuildError: Conversion, compression or renaming failed, or the graph's
            inputs/outputs do not match the names.
    """
    subpart = _checked_subpart(subpart, precision, engine)
    default_in, default_out = SUBPART_IO[subpart]
    input_names = list(input_names or default_in)
    output_names = list(output_names or default_out)
    name = name or subpart.value
    out_dir = Path(out_dir)
    bundle_dir = Path(bundle_dir) if bundle_dir is not None else out_dir
    xml = out_dir / f"{name}.xml"
    settings = compress_settings(precision, group_size, ratio, all_layers, symmetric)
    if dynamic_axes is not None:
        if input_shapes is not None:
            raise BuildPlanError("pass input_shapes= or dynamic_axes=, not both")
        input_shapes = _shapes_from_dynamic_axes(example_inputs, input_names, dynamic_axes)

    import torch

    module = module.eval()
    static = None
    if static_axes is not None:
        static = StaticPlan.make(subpart, module, example_inputs, input_names, output_names, input_shapes,
                                  dynamic_axes, static_axes, chunk_context, pad_mask, allow_chunks)
        module, example_inputs, input_names, input_shapes = static.traced()
    elif pad_mask or chunk_context:
        raise BuildPlanError(f"{subpart.value}: pad_mask= and chunk_context= need static_axes=")
    out_dir.mkdir(parents=True, exist_ok=True)
    work_parent = Path(work_dir) if work_dir is not None else out_dir
    work_parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{name}-convert-", dir=work_parent))
    try:
        with torch.no_grad():
            if engine == "olive":
                model, passes = _convert_olive(module, example_inputs, precision, settings, name, work)
            else:
                model, passes = _convert_openvino(module, example_inputs, precision, settings)
        name_and_shape(model, input_names, output_names, input_shapes, f"{subpart.value} ({engine})")
        if static is not None:
            static.check_static(model)
        versions = tool_versions("openvino", "nncf", "torch", *(("olive-ai",) if engine == "olive" else ()))
        if not settings:
            versions.pop("nncf", None)
        quantization = {**settings, "effective": weight_summary(model)} if settings else {}
        set_rt_info(model, subpart, precision, quantization, versions)
        save_ir(model, xml, precision)
        del model
    finally:
        if static is not None:
            static.release()
        shutil.rmtree(work, ignore_errors=True)
    if precision == "fp16":
        passes.append("compress_to_fp16")
    inputs, outputs = ir_io_signature(xml)
    files = relative_files(xml, bundle_dir)
    return ExportResult(
        subpart=subpart,
        format="openvino",
        files=files,
        entry=files[0],
        exporter=OLIVE_OPENVINO,
        passes=passes,
        tool_versions=versions,
        precision=precision,
        quantization=quantization,
        inputs=inputs,
        outputs=outputs,
        options=_manifest_options(xml, engine, precision, input_shapes, static, inputs, outputs, device_overrides,
                                  device_override_reason),
    )


def _checked_subpart(subpart: SubPart | str, precision: str, engine: str) -> SubPart:
    """The sub-part :func:`convert_subpart` was asked for, once its precision and engine are checked.

    Raises:
        BuildPlanError: an unknown sub-part or engine, the decoder, or a precision it does not take.
    """
    try:
        subpart = SubPart(subpart)
    except ValueError:
        raise BuildPlanError(
            unknown_choice("sub-part", str(subpart), [s.value for s in SubPart], "subpart=")
        ) from None
    if subpart is SubPart.LLM_DECODER:
        raise BuildPlanError("llm_decoder is exported with convert_llm_decoder(), not convert_subpart()")
    check_precision(precision, subpart)
    if engine not in ENGINES:
        raise BuildPlanError(unknown_choice("OpenVINO conversion engine", engine, ENGINES, "engine="))
    return subpart


def _manifest_options(xml: Path, engine: str, precision: str, input_shapes: Any, static: StaticPlan | None,
                      inputs: Any, outputs: Any, device_overrides: Mapping[str, str] | None,
                      device_override_reason: str | None = None) -> dict[str, Any]:
    """The sub-part's manifest ``options``: engine, shapes, weight storage read from the IR, the
    static plan's entries (npu) and device overrides."""
    options: dict[str, Any] = {
        "engine": engine,
        "input_shapes": [list(sh) for sh in input_shapes] if input_shapes is not None else None,
        "compress_to_fp16": precision == "fp16",
        "weight_storage": weight_summary(xml),
    }
    if static is not None:
        options.update(static.manifest_options(inputs, outputs))
    if device_overrides:
        options["device_overrides"] = dict(device_overrides)
    if device_override_reason:
        options["device_override_reason"] = device_override_reason
    return options

"""Small sub-parts (embeddings, audio heads, codec) to ONNX through Olive passes.

The conversion and every precision step are Olive 0.13 passes, run one after the
other on an in-memory module:

==========  =====================================================================
precision   passes
==========  =====================================================================
fp32        ``OnnxConversion``
fp16        ``OnnxConversion`` with ``torch_dtype=float16`` (``keep_io_types``:
            ``OnnxConversion`` → ``OnnxFloatToFloat16``)
int8        ``OnnxConversion`` → ``OnnxBlockWiseRtnQuantization`` (bits=8)
int4        ``OnnxConversion`` → ``OnnxBlockWiseRtnQuantization`` (bits=4)
==========  =====================================================================

``OnnxConversion`` uses the TorchScript exporter (``torch.onnx.export(...,
dynamo=False)``) at opset 20: that is what was measured to export the codec with
a dynamic frame axis.  fp16 casts the module in the conversion (Olive's ``torch_dtype``) rather than with
``OnnxFloatToFloat16`` afterwards: the latter loads the float32 graph, converts every
initializer through numpy and re-serialises it, several copies of the weights at once
(the 4B text embedding, 1.56 GB of float32: 11.3 GB anonymous memory; measured on an
AMD EPYC, 2 vCPUs).  Casting before tracing leaves one float16 copy.
``OnnxBlockWiseRtnQuantization`` replaces ``MatMul`` with
a constant 2-D weight by ``MatMulNBits`` and ``Gather`` on a constant table by
``GatherBlockQuantized`` (ONNX Runtime contrib ops).

How Olive is driven: the module is wrapped in an Olive ``PyTorchModelHandler``
whose ``model_loader`` returns it and whose ``dummy_inputs_func`` returns the
example inputs; each pass is built with ``create_pass_from_dict(PassClass,
config, disable_search=True)`` and applied with ``Pass.run(model_handler,
output_path)``.  No Olive engine, no workflow cache, no footprint files.
Everything Olive writes (intermediate models, the TorchScript export's temporary
files, its log) stays in a private temporary directory under ``work_dir`` that is
removed afterwards; only the final ``<name>.onnx`` (+ ``<name>.onnx.data``)
lands in ``out_dir``.
"""

from __future__ import annotations

import contextlib
import logging
import shutil
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from higgs_pack.errors import (
    BuildError,
    BuildPlanError,
    InputError,
    Problem,
    unknown_choice,
)
from higgs_pack.exporters.catalog import OLIVE_ONNX
from higgs_pack.exporters.onnx import graphs
from higgs_pack.exporters.result import ExportResult, installed_version, log_tail

if TYPE_CHECKING:
    import torch

#: Olive pass class names (as recorded in ``ExportResult.passes``).
CONVERSION_PASS = "OnnxConversion"
FP16_PASS = "OnnxFloatToFloat16"
RTN_PASS = "OnnxBlockWiseRtnQuantization"


@dataclass(frozen=True)
class PrecisionPlan:
    """How one precision is reached after conversion.

    Attributes:
        passes: Olive pass class names, in order, after ``OnnxConversion``.
        bits: Weight bits for RTN quantization (``None`` when not quantized).
        torch_dtype: the dtype ``OnnxConversion`` casts the module to before tracing
            (``None``: float32 as built).
    """

    passes: tuple[str, ...]
    bits: int | None = None
    torch_dtype: str | None = None


#: precision -> Olive passes after conversion (data; nothing heavy imported to plan).
PRECISION_PLANS: dict[str, PrecisionPlan] = {
    "fp32": PrecisionPlan(()),
    "fp16": PrecisionPlan((), torch_dtype="float16"),
    "int8": PrecisionPlan((RTN_PASS,), bits=8),
    "int4": PrecisionPlan((RTN_PASS,), bits=4),
}

#: Opset of the conversion (measured to work for the codec).
OPSET = 20
#: Above this many bytes of weights the tensors go to ``<name>.onnx.data``.
EXTERNAL_DATA_THRESHOLD = 16 * 1024 * 1024
#: Defaults of the RTN pass as this exporter uses them (``accuracy_level``: unset, the op's own).
RTN_BLOCK_SIZE = 128
RTN_SYMMETRIC = True


#: fp16 that keeps float32 graph inputs/outputs: only ``OnnxFloatToFloat16`` inserts the
#: boundary casts, so this one route still converts after tracing.
FP16_KEEP_IO_PLAN = PrecisionPlan((FP16_PASS,))


def precision_plan(precision: str, *, keep_io_types: bool = False, name: str = "sub-part") -> PrecisionPlan:
    """The :class:`PrecisionPlan` :func:`export_onnx` follows (no heavy import).

    Args:
        precision: ``"fp32"``, ``"fp16"``, ``"int8"`` or ``"int4"``.
        keep_io_types: fp16 only: float32 graph inputs/outputs (:data:`FP16_KEEP_IO_PLAN`).
        name: The sub-part, for the error message.

    Raises:
        BuildPlanError: Unknown precision (the message lists the known ones).
    """
    if precision not in PRECISION_PLANS:
        raise BuildPlanError(
            unknown_choice(
                f"precision for the Olive ONNX exporter ({name})",
                precision,
                PRECISION_PLANS,
                "--precision / precision=",
            )
        )
    return FP16_KEEP_IO_PLAN if precision == "fp16" and keep_io_types else PRECISION_PLANS[precision]


def plan_passes(precision: str, *, keep_io_types: bool = False, name: str = "sub-part") -> list[str]:
    """The Olive pass class names :func:`export_onnx` runs, ``OnnxConversion`` first
    (see :func:`precision_plan`)."""
    return [CONVERSION_PASS, *precision_plan(precision, keep_io_types=keep_io_types, name=name).passes]


def _float16_record(keep_io_types: bool) -> dict[str, Any]:
    """The manifest's ``quantization`` for fp16: where the weights were cast."""
    cast = FP16_PASS if keep_io_types else f"{CONVERSION_PASS}(torch_dtype=float16)"
    return {"method": "float16-cast", "cast_by": cast, "keep_io_types": keep_io_types}


def plan(precision: str, options: Mapping[str, Any]) -> tuple[tuple[str, ...], dict[str, Any]]:
    """``(passes, quantization)`` that :func:`export_onnx` records (no heavy import; for the build plan)."""
    keep_io_types = bool(options.get("keep_io_types", False))
    passes = tuple(plan_passes(precision, keep_io_types=keep_io_types))
    bits = PRECISION_PLANS[precision].bits
    if bits is not None:
        return passes, _rtn_record(bits, options.get("block_size", RTN_BLOCK_SIZE),
                                   options.get("is_symmetric", RTN_SYMMETRIC), options.get("accuracy_level"))
    return passes, (_float16_record(keep_io_types) if precision == "fp16" else {})


def _rtn_record(bits: int, block_size: int, is_symmetric: bool, accuracy_level: int | None) -> dict[str, Any]:
    """The manifest's ``quantization`` settings of an RTN (int4/int8) export: every one the
    plan declares, compared by the build with what the export recorded."""
    return {"method": "rtn", "bits": bits, "block_size": block_size, "is_symmetric": is_symmetric,
            "accuracy_level": accuracy_level}



@contextlib.contextmanager
def _olive_log(log_path: Path) -> Iterator[None]:
    """Copy Olive's (and ONNX Runtime's quantizer's) log records into ``log_path``."""
    handler = logging.FileHandler(log_path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    handler.setLevel(logging.DEBUG)
    loggers = [logging.getLogger(name) for name in ("olive", "onnxruntime")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.addHandler(handler)
        if lg.level == logging.NOTSET or lg.level > logging.INFO:
            lg.setLevel(logging.INFO)
    try:
        yield
    finally:
        for lg, level in zip(loggers, levels, strict=True):
            lg.removeHandler(handler)
            lg.setLevel(level)
        handler.close()


@contextlib.contextmanager
def _tempdir_under(path: Path) -> Iterator[None]:
    """Point ``tempfile`` at ``path`` (Olive's TorchScript export writes the full model there)."""
    saved = tempfile.tempdir
    tempfile.tempdir = str(path)
    try:
        yield
    finally:
        tempfile.tempdir = saved


def _normalise_dynamic_axes(
    dynamic_axes: Mapping[str, Any], names: Sequence[str]
) -> dict[str, dict[int, str]]:
    normalised: dict[str, dict[int, str]] = {}
    for tensor, axes in dynamic_axes.items():
        if tensor not in names:
            raise BuildPlanError(
                f"dynamic_axes names {tensor!r}, which is neither an input nor an output "
                f"({', '.join(names)}); fix dynamic_axes=."
            )
        if isinstance(axes, Mapping):
            normalised[tensor] = {int(axis): str(label) for axis, label in axes.items()}
        else:
            normalised[tensor] = {int(axis): f"{tensor}_dim{int(axis)}" for axis in axes}
    return normalised


def _finalize(model_path: Path, out_dir: Path, name: str, threshold: int) -> Path:
    """Move Olive's last model to ``out_dir/<name>.onnx`` (+ ``<name>.onnx.data``).

    Weights above ``threshold`` bytes stay external in one file named after the
    model; smaller models are written as one self-contained file.
    """
    import onnx

    final = out_dir / f"{name}.onnx"
    data_name = f"{name}.onnx.data"
    for stale in (final, out_dir / data_name):
        stale.unlink(missing_ok=True)

    locations = graphs.external_data_locations(model_path)
    weight_bytes = model_path.stat().st_size + sum(
        (model_path.parent / loc).stat().st_size for loc in locations
    )
    if weight_bytes <= threshold or len(locations) != 1:
        # Small (or split over several files): load it whole and re-save.
        proto = onnx.load(str(model_path), load_external_data=True)
        if weight_bytes <= threshold:
            onnx.save_model(proto, str(final))
        else:
            onnx.save_model(
                proto,
                str(final),
                save_as_external_data=True,
                all_tensors_to_one_file=True,
                location=data_name,
                size_threshold=1024,
            )
    else:
        # One external file: move it and rewrite the locations (no copy of the weights).
        from onnx import external_data_helper

        proto = onnx.load(str(model_path), load_external_data=False)
        shutil.move(str(model_path.parent / locations[0]), str(out_dir / data_name))
        for tensor in external_data_helper._get_all_tensors(proto):
            if external_data_helper.uses_external_data(tensor):
                for entry in tensor.external_data:
                    if entry.key == "location":
                        entry.value = data_name
        onnx.save_model(proto, str(final))
    for path in (final, out_dir / data_name):
        if path.exists():
            path.chmod(0o644)
    return final


def _check_request(name: str, input_names: list[str], output_names: list[str], example_inputs: tuple,
                   dynamic_axes: Mapping[str, Any], plan: PrecisionPlan, block_size: int, work_dir: Path,
                   bundle_dir: Path) -> dict[str, dict[int, str]]:
    """Validate an :func:`export_onnx` call (nothing heavy imported); return the normalised dynamic axes.

    Raises:
        BuildPlanError: as :func:`export_onnx` documents.
    """
    if len(input_names) != len(example_inputs):
        raise BuildPlanError(
            f"{name}: {len(input_names)} input_names {input_names} for {len(example_inputs)} "
            "example_inputs; give one name per positional example."
        )
    axes = _normalise_dynamic_axes(dynamic_axes, input_names + output_names)
    if plan.bits is not None and (block_size < 16 or block_size & (block_size - 1)):
        raise BuildPlanError(
            f"{name}: block_size={block_size} for {RTN_PASS}; it must be a power of two >= 16."
        )
    if work_dir.resolve().is_relative_to(bundle_dir.resolve()):
        raise InputError(problems=[Problem(
            "work_dir", str(work_dir), allowed=f"a folder outside the bundle {bundle_dir}",
            fix="Olive's scratch files would be packaged")])
    return axes


def _pass_configs(plan: PrecisionPlan, opset: int, keep_io_types: bool, block_size: int, is_symmetric: bool,
                  accuracy_level: int | None) -> dict[str, dict[str, Any]]:
    """Each Olive pass's config (by class name), all writing one external data file."""
    external = {"save_as_external_data": True, "all_tensors_to_one_file": True}
    return {
        CONVERSION_PASS: {
            "target_opset": opset,
            "use_dynamo_exporter": False,
            "device": "cpu",
            **({"torch_dtype": plan.torch_dtype} if plan.torch_dtype else {}),
            **external,
        },
        FP16_PASS: {"keep_io_types": keep_io_types, **external},
        RTN_PASS: {
            "bits": plan.bits,
            "block_size": block_size,
            "is_symmetric": is_symmetric,
            **({"accuracy_level": accuracy_level} if accuracy_level is not None else {}),
            **external,
        },
    }


def _run_passes(module: torch.nn.Module, examples: tuple, io_config: dict[str, Any], passes: list[str],
                configs: dict[str, dict[str, Any]], scratch: Path, what: str) -> Path:
    """Run the Olive passes in order on ``module`` inside ``scratch`` (Olive's log and temporary
    files there too); return the last model's path.

    Raises:
        BuildError: a pass failed (quoting the tail of Olive's log).
    """
    import torch
    from olive.model import PyTorchModelHandler
    from olive.passes.olive_pass import create_pass_from_dict
    from olive.passes.onnx.conversion import OnnxConversion
    from olive.passes.onnx.float16_conversion import OnnxFloatToFloat16
    from olive.passes.onnx.rtn_quantization import OnnxBlockWiseRtnQuantization

    pass_classes = {cls.__name__: cls for cls in (OnnxConversion, OnnxFloatToFloat16, OnnxBlockWiseRtnQuantization)}
    model = PyTorchModelHandler(model_loader=lambda _path: module, io_config=io_config,
                                dummy_inputs_func=lambda _handler: examples)
    log_path = scratch / "olive.log"
    tmp = scratch / "tmp"
    tmp.mkdir()
    with _olive_log(log_path), _tempdir_under(tmp), torch.no_grad():
        for index, pass_name in enumerate(passes):
            step_dir = scratch / f"{index}-{pass_name}"
            step_dir.mkdir()
            olive_pass = create_pass_from_dict(pass_classes[pass_name], configs[pass_name], disable_search=True)
            try:
                model = olive_pass.run(model, str(step_dir / "model.onnx"))
            except Exception as error:
                raise BuildError(
                    f"Olive {pass_name} failed on {what}: {type(error).__name__}: {error}\n"
                    f"Olive log tail ({log_path}):\n{log_tail(log_path)}"
                ) from error
    return Path(model.model_path)


# Over 80 lines because of its docstring (75 of them: the catalogue's keyword options, each
# documented); the body is Olive's one run of passes with its check before and its record after.
def export_onnx(
    module: torch.nn.Module,
    example_inputs: tuple,
    *,
    input_names: Sequence[str],
    output_names: Sequence[str],
    dynamic_axes: Mapping[str, Any],
    out_dir: Path,
    name: str,
    precision: str,
    work_dir: Path,
    subpart: str | None = None,
    bundle_dir: Path | None = None,
    opset: int = OPSET,
    block_size: int = RTN_BLOCK_SIZE,
    accuracy_level: int | None = None,
    is_symmetric: bool = RTN_SYMMETRIC,
    keep_io_types: bool = False,
    external_data_threshold: int = EXTERNAL_DATA_THRESHOLD,
    keep_work_dir: bool = False,
) -> ExportResult:
    """Export a PyTorch module to ONNX with Olive, then cast or quantize it.

    Runs :func:`plan_passes` ``(precision)``: Olive ``OnnxConversion`` (TorchScript
    exporter, ``opset``; fp16 casts the module to float16 first), then
    ``OnnxFloatToFloat16`` (fp16 with ``keep_io_types`` only) or
    ``OnnxBlockWiseRtnQuantization`` (int4 / int8: MatMul → MatMulNBits, Gather →
    GatherBlockQuantized, symmetric, ``block_size`` along the reduction axis /
    the table's row axis).

    Writes ``out_dir/<name>.onnx`` and, when the weights exceed
    ``external_data_threshold`` bytes, ``out_dir/<name>.onnx.data`` (all tensors in
    that one file, referenced by the relative location ``<name>.onnx.data``). A
    previous ``<name>.onnx`` / ``<name>.onnx.data`` is replaced; nothing else in
    ``out_dir`` is touched. The RTN pass renames a quantized node's output
    (``<out>_Q4``); when that node is a graph output (``text_embed``'s Gather) the
    declared ``output_names`` are restored and the rename is recorded in
    ``options["renamed_outputs"]``.

    Dtypes: fp32 and int4/int8 graphs take and return float32 (int4/int8 only
    change the stored weights). fp16 graphs are cast end to end with
    ``keep_io_types=False`` by default, so their floating inputs and outputs are
    **float16** and the recorded I/O signature says so (a runtime casts its
    float32 arrays to the declared dtype); integer I/O (token ids, codes) stays
    int64. ``keep_io_types=True`` keeps float32 at the boundary instead.

    Args:
        module (`torch.nn.Module`): The sub-part module, on CPU, in float32; put
            in eval mode here.  fp16 casts it to float16 **in place** (Olive's
            ``torch_dtype``; no second copy of the weights).
        example_inputs (`tuple` of `torch.Tensor`): One positional example per
            input, for example ``(codes,)`` with ``codes`` int64 [1, 3, 8]. Use a
            length other than the one you test with, and at least 2 on a dynamic
            axis (a size-1 axis can be specialised by tracing).
        input_names (`Sequence[str]`): Graph input names, one per example input.
        output_names (`Sequence[str]`): Graph output names, in ``forward``'s order.
        dynamic_axes (`Mapping`): tensor name -> ``{axis: symbolic name}`` (or a list
            of axes, named ``<tensor>_dim<axis>``), as for ``torch.onnx.export``.
        out_dir (`Path`): Directory of the final files (created if missing).
        name (`str`): File stem: ``<name>.onnx``.
        precision (`str`): ``"fp32"``, ``"fp16"``, ``"int8"`` or ``"int4"``.
        work_dir (`Path`): Parent of Olive's private temporary directory; must be
            outside the bundle. Large exports need free space there of about twice
            the fp32 weights.
        subpart (`str`, *optional*): The ``ExportResult.subpart``; defaults to ``name``.
        bundle_dir (`Path`, *optional*): Root the returned ``files`` are relative to;
            defaults to ``out_dir``.
        opset (`int`, *optional*, defaults to 20): Default-domain opset.
        block_size (`int`, *optional*, defaults to 128): RTN block size (a power of
            two ≥ 16; along K for MatMul, along the row for Gather tables).
        accuracy_level (`int`, *optional*): MatMulNBits ``accuracy_level`` (0/1 fp32,
            2 fp16, 3 bf16, 4 int8 activations); unset leaves ONNX Runtime's default.
        is_symmetric (`bool`, *optional*, defaults to `True`): Symmetric RTN (no zero
            points).
        keep_io_types (`bool`, *optional*, defaults to `False`): fp16 only: keep
            float32 graph inputs/outputs (Cast nodes at the boundary).
        external_data_threshold (`int`, *optional*, defaults to 16 MiB): Model bytes
            above which the weights are stored in ``<name>.onnx.data``.
        keep_work_dir (`bool`, *optional*, defaults to `False`): Keep Olive's
            temporary directory (intermediate models, ``olive.log``) for debugging.

    Returns:
        `ExportResult`: ``exporter="olive-onnx"``, ``passes`` = Olive class names,
        ``files`` = ``[<name>.onnx(, <name>.onnx.data)]`` relative to ``bundle_dir``,
        ``quantization`` = the RTN settings and quantized op counts/attributes read
        from the graph (int4/int8) or the fp16 settings, tool versions of olive-ai,
        onnx, onnxruntime, onnxscript and torch, and the graph's I/O signature.

    Raises:
        BuildPlanError: Unknown precision; names/examples/dynamic axes that do not
            match.
        InputError: ``work_dir`` inside the bundle (before anything is written).
        BuildError: An Olive pass failed (the message quotes the tail of Olive's
            log), or int4/int8 found no MatMul/Gather with constant weights to
            quantize.
    """
    plan = precision_plan(precision, keep_io_types=keep_io_types, name=name)
    passes = [CONVERSION_PASS, *plan.passes]
    out_dir, work_dir = Path(out_dir), Path(work_dir)
    bundle_dir = Path(bundle_dir) if bundle_dir is not None else out_dir
    input_names, output_names = list(input_names), list(output_names)
    axes = _check_request(name, input_names, output_names, example_inputs, dynamic_axes, plan, block_size,
                          work_dir, bundle_dir)
    import torch

    configs = _pass_configs(plan, opset, keep_io_types, block_size, is_symmetric, accuracy_level)
    io_config = {"input_names": input_names, "output_names": output_names, "dynamic_axes": axes}
    work_dir.mkdir(parents=True, exist_ok=True)
    out_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f"olive-{name}-{precision}-", dir=work_dir))
    try:
        model_path = _run_passes(module.eval(), tuple(example_inputs), io_config, passes, configs, scratch,
                                 f"{name} ({precision})")
        final = _finalize(model_path, out_dir, name, external_data_threshold)
        renamed = graphs.rename_graph_outputs(final, output_names)
    finally:
        if not keep_work_dir:
            shutil.rmtree(scratch, ignore_errors=True)

    inputs, outputs = graphs.onnx_io_signature(final)
    quantization: dict[str, Any] = {}
    if plan.bits is not None:
        ops = graphs.quantized_ops(final)
        if not ops:
            raise BuildError(
                f"{RTN_PASS} quantized nothing in {name} ({precision}): the graph has no MatMul "
                "with a constant 2-D weight and no Gather on a constant table. Export it at "
                "fp32/fp16 instead (precision=)."
            )
        quantization = {**_rtn_record(plan.bits, block_size, is_symmetric, accuracy_level), "quantized_ops": ops}
    elif precision == "fp16":
        quantization = _float16_record(keep_io_types)

    return ExportResult(
        subpart=subpart or name,
        format="onnx",
        files=graphs.onnx_files(final, bundle_dir),
        entry=final.resolve().relative_to(bundle_dir.resolve()).as_posix(),
        exporter=OLIVE_ONNX,
        passes=passes,
        tool_versions={
            "olive-ai": installed_version("olive-ai"),
            **graphs.onnx_tool_versions(),
            "onnxscript": installed_version("onnxscript"),
            "torch": torch.__version__,
        },
        precision=precision,
        quantization=quantization,
        inputs=inputs,
        outputs=outputs,
        options={
            "opset": opset,
            "exporter": "torchscript",
            "dynamic_axes": {k: {str(a): v for a, v in ax.items()} for k, ax in axes.items()},
            "op_types": graphs.op_type_counts(final),
            "renamed_outputs": renamed,
        },
    )

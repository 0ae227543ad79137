"""Data-only catalogue of exporters: what each one builds, at which precisions, with which options.

Planning reads this table without importing anything heavy (torch, Olive,
OpenVINO); the build loop imports ``module:function`` only when it runs.  Like
Olive's ``olive_config.json``: one row per exporter, looked up by name.  The passes
of a plan come from each exporter's own planning function (``plan``: a light module
the exporter itself names its passes with), never from a copy here.  The keyword
options a recipe or variant may set are typed per exporter and checked when a target
is registered and when a build is planned (like onnxruntime-genai's
``check_extra_options``): a bad key is named with the allowed ones.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from higgs_pack.errors import BuildPlanError, unknown_choice


@dataclass(frozen=True)
class ExporterInfo:
    """One exporter.

    Attributes:
        name: catalogue key (used in target declarations and recorded in the manifest;
            one of the name constants above).
        entry: ``"module:function"`` that runs it.
        plan: ``"module:function"`` of a light function ``(precision, options) ->
            (passes, quantization)``: the tool passes it runs, in order, and the
            quantization settings the manifest will record (a subset).
        kind: ``"decoder"`` (takes a standard Qwen3 HF directory) or ``"module"``
            (takes a torch module and example inputs).
        format: ``"onnx"`` or ``"openvino"``: must be the format of the target's
            backend (:func:`~higgs_pack.runtime.backends.registered`).
        precisions: the precisions it builds.
        options: keyword options a recipe or variant may set -> their type(s) (the
            build loop supplies the others: paths, precision, names).
        scratch: the keyword that takes its scratch directory (outside the bundle).
        tool: the tool's distribution names, for version recording.
        space: ``"module:function"`` estimating its disk use (see
            :mod:`higgs_pack.exporters.space`).
    """

    name: str
    entry: str
    plan: str
    kind: str
    format: str
    precisions: tuple[str, ...]
    options: Mapping[str, type | tuple[type, ...]] = field(default_factory=dict)
    scratch: str = "work_dir"
    tool: tuple[str, ...] = field(default_factory=tuple)
    space: str = "higgs_pack.exporters.space:olive"

    def load(self) -> Callable[..., Any]:
        """Import and return the exporter function."""
        module, function = self.entry.split(":")
        return getattr(importlib.import_module(module), function)

    def planned(self, precision: str, options: Mapping[str, Any]) -> tuple[tuple[str, ...], dict[str, Any]]:
        """``(passes, quantization)`` for one sub-part, from the exporter's own planning function."""
        module, function = self.plan.split(":")
        passes, quantization = getattr(importlib.import_module(module), function)(precision, options)
        return tuple(passes), dict(quantization)

    def check_options(self, options: Mapping[str, Any], where: str) -> None:
        """Refuse an option this exporter does not take, or a value of the wrong type.

        Raises:
            BuildPlanError: naming ``where`` (target, sub-part, recipe or variant), the
                bad key and the allowed ones (with a close match), or the expected type.
        """
        for key, value in options.items():
            if key not in self.options:
                raise BuildPlanError(f"{where}: " + unknown_choice(
                    f"option of exporter {self.name!r}", key, self.options, "the Recipe/Variant options"))
            expected = self.options[key]
            types = expected if isinstance(expected, tuple) else (expected,)
            if value is not None and not (isinstance(value, types) and not (isinstance(value, bool) and bool not in types)):
                names = " or ".join(t.__name__ for t in types)
                raise BuildPlanError(f"{where}: option {key}={value!r} of exporter {self.name!r} must be {names}")


    def estimate_space(self, params: int, stored_itemsize: int, precision: str,
                       options: dict[str, Any]) -> tuple[int, int]:
        """(scratch bytes, bundle bytes) this exporter needs for ``params`` weights."""
        module, function = self.space.split(":")
        return getattr(importlib.import_module(module), function)(params, stored_itemsize, precision, options)


#: The exporters' names, stated once: catalogue keys, what target recipes name and what a
#: manifest records as a sub-part's ``exporter`` (the tool or engine that ran is in its
#: ``passes`` and ``tool_versions``; bundles built before 0.1 recorded ``olive``,
#: ``optimum-intel`` or ``openvino`` there, which nothing reads back).
MODELBUILDER = "modelbuilder"
OLIVE_ONNX = "olive-onnx"
OPTIMUM_OPENVINO = "optimum-openvino"
OLIVE_OPENVINO = "olive-openvino"

#: Options of the two OpenVINO exporters' NNCF weight compression.
_NNCF_OPTIONS: dict[str, type | tuple[type, ...]] = {
    "group_size": int, "ratio": (int, float), "all_layers": bool, "symmetric": bool}

EXPORTERS: dict[str, ExporterInfo] = {
    e.name: e
    for e in (
        ExporterInfo(
            MODELBUILDER,
            "higgs_pack.exporters.onnx.modelbuilder:build_llm_decoder",
            "higgs_pack.exporters.onnx.modelbuilder:plan",
            "decoder",
            "onnx",
            ("int4", "fp16", "fp32"),
            {"execution_provider": str, "extra_options": dict, "timeout_s": (int, float), "kv_cache": str},
            scratch="cache_dir",
            tool=("onnxruntime-genai", "onnxruntime", "onnx"),
            space="higgs_pack.exporters.space:modelbuilder",
        ),
        ExporterInfo(
            OLIVE_ONNX,
            "higgs_pack.exporters.onnx.olive:export_onnx",
            "higgs_pack.exporters.onnx.olive:plan",
            "module",
            "onnx",
            ("fp32", "fp16", "int4"),
            {"opset": int, "block_size": int, "accuracy_level": int, "is_symmetric": bool,
             "keep_io_types": bool, "external_data_threshold": int},
            tool=("olive-ai", "onnx", "onnxruntime", "torch"),
        ),
        ExporterInfo(
            OPTIMUM_OPENVINO,
            "higgs_pack.exporters.openvino.decoder:convert_llm_decoder",
            "higgs_pack.exporters.openvino.plan:decoder_plan",
            "decoder",
            "openvino",
            ("int4", "int8", "fp16", "fp32"),
            {**_NNCF_OPTIONS, "static_kv_length": int, "static_step": int},
            tool=("optimum-intel", "openvino", "nncf", "transformers"),
            space="higgs_pack.exporters.space:optimum_openvino",
        ),
        ExporterInfo(
            OLIVE_OPENVINO,
            "higgs_pack.exporters.openvino.subpart:convert_subpart",
            "higgs_pack.exporters.openvino.plan:subpart_plan",
            "module",
            "openvino",
            ("fp32", "fp16", "int8", "int4"),
            {**_NNCF_OPTIONS, "engine": str, "static_axes": dict, "chunk_context": (int, str), "pad_mask": bool,
             "allow_chunks": bool, "device_overrides": dict, "device_override_reason": str},
            tool=("olive-ai", "openvino", "nncf", "torch"),
        ),
    )
}


def get_exporter(name: str) -> ExporterInfo:
    """Look up an exporter by name; unknown names list the known ones."""
    try:
        return EXPORTERS[name]
    except KeyError:
        raise BuildPlanError(unknown_choice("exporter", name, EXPORTERS, "the target declaration")) from None

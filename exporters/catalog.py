"""Data-only catalogue of exporters: what each one builds, at which precisions, with which passes.

Planning reads this table without importing anything heavy (torch, Olive,
OpenVINO); the build loop imports ``module:function`` only when it runs.  Like
Olive's ``olive_config.json``: one row per exporter, looked up by name.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from higgs_pack.manifests.errors import BuildPlanError, unknown_choice


@dataclass(frozen=True)
class ExporterInfo:
    """One exporter.

    Attributes:
        name: catalogue key (used in target declarations and the manifest).
        entry: ``"module:function"`` that runs it.
        kind: ``"decoder"`` (takes a standard Qwen3 HF directory) or ``"module"``
            (takes a torch module and example inputs).
        format: ``"onnx"`` or ``"openvino"``.
        passes: precision -> the tool passes it runs, in order (Olive class names
            where Olive runs them).
        tool: the tool's distribution names, for version recording.
    """

    name: str
    entry: str
    kind: str
    format: str
    passes: dict[str, tuple[str, ...]]
    tool: tuple[str, ...] = field(default_factory=tuple)

    @property
    def precisions(self) -> tuple[str, ...]:
        return tuple(self.passes)

    def load(self) -> Callable[..., Any]:
        """Import and return the exporter function."""
        module, function = self.entry.split(":")
        return getattr(importlib.import_module(module), function)


EXPORTERS: dict[str, ExporterInfo] = {
    e.name: e
    for e in (
        ExporterInfo(
            "modelbuilder",
            "higgs_pack.exporters.modelbuilder:build_llm_decoder",
            "decoder",
            "onnx",
            {
                "int4": ("ModelBuilder(int4, exclude_embeds, exclude_lm_head)",),
                "fp16": ("ModelBuilder(fp16, exclude_embeds, exclude_lm_head)",),
                "fp32": ("ModelBuilder(fp32, exclude_embeds, exclude_lm_head)",),
            },
            ("onnxruntime-genai", "onnxruntime", "onnx"),
        ),
        ExporterInfo(
            "olive-onnx",
            "higgs_pack.exporters.olive:export_onnx",
            "module",
            "onnx",
            {
                "fp32": ("OnnxConversion",),
                "fp16": ("OnnxConversion", "OnnxFloatToFloat16"),
                "int4": ("OnnxConversion", "OnnxBlockWiseRtnQuantization"),
            },
            ("olive-ai", "onnx", "onnxruntime", "torch"),
        ),
        ExporterInfo(
            "optimum-openvino",
            "higgs_pack.exporters.openvino:convert_llm_decoder",
            "decoder",
            "openvino",
            {
                "int4": ("optimum-intel stateful export (inputs_embeds)", "nncf.compress_weights(INT4_ASYM)"),
                "int8": ("optimum-intel stateful export (inputs_embeds)", "nncf.compress_weights(INT8_ASYM)"),
                "fp16": ("optimum-intel stateful export (inputs_embeds)", "save_model(compress_to_fp16)"),
                "fp32": ("optimum-intel stateful export (inputs_embeds)",),
            },
            ("optimum-intel", "openvino", "nncf", "transformers"),
        ),
        ExporterInfo(
            "olive-openvino",
            "higgs_pack.exporters.openvino:convert_subpart",
            "module",
            "openvino",
            {
                "fp32": ("OpenVINOConversion",),
                "fp16": ("OpenVINOConversion", "compress_to_fp16"),
                "int8": ("OpenVINOConversion", "OpenVINOWeightCompression(INT8_ASYM)"),
                "int4": ("OpenVINOConversion", "OpenVINOWeightCompression(INT4_ASYM)"),
            },
            ("olive-ai", "openvino", "nncf", "torch"),
        ),
    )
}


def get_exporter(name: str) -> ExporterInfo:
    """Look up an exporter by name; unknown names list the known ones."""
    try:
        return EXPORTERS[name]
    except KeyError:
        raise BuildPlanError(unknown_choice("exporter", name, EXPORTERS, "the target declaration")) from None

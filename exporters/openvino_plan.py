"""What the OpenVINO exporters will do, as data: pass names and NNCF modes (imports no OpenVINO).

The OpenVINO exporters (``openvino_decoder``, ``openvino_static_decoder``,
``openvino_subpart``) name their passes and compression modes with
these, and the build plan (``higgs-pack build --plan``) reads them through the
exporter catalogue, so the plan and the manifest say the same thing; the build
loop refuses a sub-part whose recorded passes differ from the plan.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

#: How the stateful decoder export is named in ``ExportResult.passes``.
DECODER_EXPORT_PASS = "optimum-intel stateful export (inputs_embeds)"
#: How the static decoder export (``static_kv_length``: the npu variant) is named.
STATIC_DECODER_PASS = "convert_model(static KV-window decoder)"
#: Conversion pass of a small sub-part, per ``engine``.
SUBPART_CONVERSION = {"olive": "OpenVINOConversion", "openvino": "convert_model"}
#: Weight compression pass of a small sub-part, per ``engine`` (``{mode}``: NNCF's mode, upper case).
SUBPART_COMPRESSION = {"olive": "OpenVINOWeightCompression({mode})", "openvino": "nncf.compress_weights({mode})"}
#: fp16 weights are stored with ``save_model(compress_to_fp16=True)``.
DECODER_FP16_PASS = "save_model(compress_to_fp16)"
SUBPART_FP16_PASS = "compress_to_fp16"


def compress_mode(precision: str, symmetric: bool = False) -> str | None:
    """NNCF's weight-compression mode for a precision (as NNCF spells its values), or None.

    int4: ``int4_asym`` (``int4_sym`` with ``symmetric``: what Intel's NPU plugin wants);
    int8: ``int8_asym`` per channel; fp16/fp32: no compression.
    """
    if precision == "int4":
        return "int4_sym" if symmetric else "int4_asym"
    if precision == "int8":
        return "int8_asym"
    return None


def decoder_plan(precision: str, options: Mapping[str, Any]) -> tuple[tuple[str, ...], dict[str, Any]]:
    """``(passes, quantization)`` of ``convert_llm_decoder(precision=…, **options)``."""
    mode = compress_mode(precision, bool(options.get("symmetric", False)))
    export = STATIC_DECODER_PASS if options.get("static_kv_length") is not None else DECODER_EXPORT_PASS
    passes = [export]
    if mode:
        passes.append(f"nncf.compress_weights({mode.upper()})")
    elif precision == "fp16":
        passes.append(DECODER_FP16_PASS)
    return tuple(passes), ({"mode": mode} if mode else {})


def subpart_plan(precision: str, options: Mapping[str, Any]) -> tuple[tuple[str, ...], dict[str, Any]]:
    """``(passes, quantization)`` of ``convert_subpart(precision=…, **options)``."""
    engine = options.get("engine", "olive")
    mode = compress_mode(precision, bool(options.get("symmetric", False)))
    passes = [SUBPART_CONVERSION[engine]]
    if mode:
        passes.append(SUBPART_COMPRESSION[engine].format(mode=mode.upper()))
    if precision == "fp16":
        passes.append(SUBPART_FP16_PASS)
    return tuple(passes), ({"mode": mode} if mode else {})

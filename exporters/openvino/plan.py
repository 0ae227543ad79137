"""What the OpenVINO exporters will do, as data: pass names and NNCF modes (imports no OpenVINO).

The OpenVINO exporters (``openvino_decoder``, ``openvino_static_decoder``,
``openvino_subpart``) name their passes and compression modes with
these, and the build plan (``higgs-pack build --plan``) reads them through the
exporter catalogue, so the plan and the manifest say the same thing; the build
loop refuses a sub-part whose recorded passes differ from the plan.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
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


@dataclass(frozen=True)
class NNCFDefaults:
    """The NNCF settings an OpenVINO exporter uses where its recipe sets none (its keyword defaults).

    Attributes:
        group_size: int4 weights per group along the input axis.
        ratio: int4 share of the ratio-defining layers (the rest int8).
        all_layers: int4 also for the layers NNCF keeps in int8 by default.
        symmetric: INT4_SYM instead of INT4_ASYM.
    """

    group_size: int = 128
    ratio: float = 1.0
    all_layers: bool = False
    symmetric: bool = False


#: ``convert_llm_decoder``'s (and the static decoder's it delegates to).
DECODER_NNCF = NNCFDefaults()
#: ``convert_subpart``'s: every layer int4 (the small sub-parts have no layer worth keeping int8).
SUBPART_NNCF = NNCFDefaults(all_layers=True)


def compress_settings(precision: str, group_size: int, ratio: float, all_layers: bool,
                      symmetric: bool = False) -> dict[str, Any]:
    """The NNCF settings asked for, JSON-ready (mode names as NNCF spells their values): what
    the manifest records and the plan declares.

    ``symmetric`` selects INT4_SYM for int4 (what Intel's NPU plugin wants, per the
    OpenVINO GenAI NPU guide); int8 stays INT8_ASYM per channel; other precisions: ``{}``.
    """
    if precision == "int4":
        return {
            "mode": compress_mode(precision, symmetric),
            "group_size": group_size,
            "ratio": ratio,
            "all_layers": all_layers,
            "group_size_fallback_mode": "adjust",
            "backup_mode": "int8_asym",
        }
    if precision == "int8":
        return {"mode": compress_mode(precision), "granularity": "per_channel"}
    return {}


def planned_settings(precision: str, options: Mapping[str, Any], defaults: NNCFDefaults) -> dict[str, Any]:
    """:func:`compress_settings` of a recipe's options over an exporter's :class:`NNCFDefaults`."""
    return compress_settings(precision, options.get("group_size", defaults.group_size),
                             options.get("ratio", defaults.ratio), options.get("all_layers", defaults.all_layers),
                             bool(options.get("symmetric", defaults.symmetric)))


def decoder_plan(precision: str, options: Mapping[str, Any]) -> tuple[tuple[str, ...], dict[str, Any]]:
    """``(passes, quantization)`` of ``convert_llm_decoder(precision=…, **options)``: the
    quantization holds every NNCF setting (mode, group size, ratio, all_layers…)."""
    mode = compress_mode(precision, bool(options.get("symmetric", DECODER_NNCF.symmetric)))
    export = STATIC_DECODER_PASS if options.get("static_kv_length") is not None else DECODER_EXPORT_PASS
    passes = [export]
    if mode:
        passes.append(f"nncf.compress_weights({mode.upper()})")
    elif precision == "fp16":
        passes.append(DECODER_FP16_PASS)
    return tuple(passes), planned_settings(precision, options, DECODER_NNCF)


def subpart_plan(precision: str, options: Mapping[str, Any]) -> tuple[tuple[str, ...], dict[str, Any]]:
    """``(passes, quantization)`` of ``convert_subpart(precision=…, **options)`` (every NNCF setting,
    as :func:`decoder_plan`)."""
    engine = options.get("engine", "olive")
    mode = compress_mode(precision, bool(options.get("symmetric", SUBPART_NNCF.symmetric)))
    passes = [SUBPART_CONVERSION[engine]]
    if mode:
        passes.append(SUBPART_COMPRESSION[engine].format(mode=mode.upper()))
    if precision == "fp16":
        passes.append(SUBPART_FP16_PASS)
    return tuple(passes), planned_settings(precision, options, SUBPART_NNCF)

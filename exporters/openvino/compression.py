"""NNCF weight compression of an OpenVINO model (int8 per channel, int4 grouped).

Gotchas measured here (nncf 3.4):

* NNCF's default group size 128 must divide the input width of every MatMul:
  ``AdvancedCompressionParameters(group_size_fallback_mode=ADJUST)`` picks a
  smaller one where needed (the tiny model's 64-wide layers get 64); the group
  sizes actually used are recorded. Without ``all_layers=True`` NNCF keeps one
  layer in INT8 (the backup mode).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import openvino as ov

from higgs_pack.errors import BuildError
from higgs_pack.exporters.openvino.plan import compress_settings


def _nncf_kwargs(settings: Mapping[str, Any]) -> dict[str, Any]:
    import nncf
    from nncf.quantization.advanced_parameters import GroupSizeFallbackMode

    kwargs: dict[str, Any] = {"mode": nncf.CompressWeightsMode(settings["mode"])}
    if settings["mode"] in ("int4_asym", "int4_sym"):
        kwargs.update(
            group_size=settings["group_size"],
            ratio=settings["ratio"],
            all_layers=settings["all_layers"],
            advanced_parameters=nncf.AdvancedCompressionParameters(
                group_size_fallback_mode=GroupSizeFallbackMode(settings["group_size_fallback_mode"])
            ),
        )
    return kwargs


def nncf_compress(model: ov.Model, precision: str, group_size: int, ratio: float, all_layers: bool,
                  symmetric: bool = False) -> tuple[ov.Model, dict[str, Any]]:
    """Apply ``nncf.compress_weights`` for int8/int4; return the model and the settings used."""
    settings = compress_settings(precision, group_size, ratio, all_layers, symmetric)
    if not settings:
        return model, {}
    import nncf

    try:
        model = nncf.compress_weights(model, **_nncf_kwargs(settings))
    except Exception as exc:  # NNCF raises many types; keep the cause
        raise BuildError(f"nncf.compress_weights failed for precision {precision!r} ({settings}): {exc}") from exc
    return model, settings

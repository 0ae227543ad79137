"""Disk space each exporter needs, estimated from parameter counts before anything runs.

Every rule returns ``(scratch_bytes, output_bytes)`` for one sub-part: ``scratch`` is what
the exporter writes outside the bundle and removes (ModelBuilder's float graph before
int4, OpenVINO's unconverted IR, Olive's float model), ``output`` what the sub-part
occupies in the bundle.  The rules are upper bounds read from the tools' formats; the
build adds :data:`MARGIN`.  They need only counts (no torch, no tool import).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from higgs_pack.manifests.providers import EXECUTION_PROVIDERS

#: Bytes per weight stored at each precision, with the quantization metadata:
#: int4 = 4 bits + one fp32 scale per block of 32 (ModelBuilder/ORT; OpenVINO's group of
#: 128 with zero points needs less); int8 = 1 byte + a per-channel scale.
BYTES_PER_WEIGHT: dict[str, float] = {"fp32": 4.0, "fp16": 2.0, "int8": 1.05, "int4": 0.5 + 4 / 32}
#: Relative safety margin on every estimate, plus a fixed one for small files.
MARGIN = 0.10
FIXED_MARGIN = 256 << 20


def _output(params: int, precision: str) -> int:
    return int(params * BYTES_PER_WEIGHT[precision])


def modelbuilder(params: int, stored_itemsize: int, precision: str, options: Mapping[str, Any]) -> tuple[int, int]:
    """ModelBuilder decoder: int4 first writes the float graph (fp32 on cpu, fp16 on cuda/dml).
    A quantized KV cache (``options["kv_cache"]``) first builds a calibration baseline of the
    same precision (for int4 its float graph and the int4 one side by side), removed before
    the decoder is built: the larger of the two phases counts (the baseline's embedding, not
    in ``params``, is inside the margin)."""
    scratch = 0
    row = EXECUTION_PROVIDERS[options.get("execution_provider", "cpu")]
    float_graph = _output(params, row.modelbuilder.int4_float_base)
    if precision == "int4":
        scratch = float_graph
    if (options.get("kv_cache") or "float") != "float":
        scratch = max(scratch, _output(params, precision) + (float_graph if precision == "int4" else 0))
    return scratch, _output(params, precision)


def optimum_openvino(params: int, stored_itemsize: int, precision: str, options: Mapping[str, Any]) -> tuple[int, int]:
    """optimum-intel decoder: the unconverted IR keeps the stored dtype (bf16), then NNCF/fp16 output."""
    return params * max(stored_itemsize, 2), _output(params, precision)


def olive(params: int, stored_itemsize: int, precision: str, options: Mapping[str, Any]) -> tuple[int, int]:
    """Olive passes: a float32 conversion first, then the pass's output, both in Olive's cache."""
    return params * 4 + _output(params, precision), _output(params, precision)

"""The GEMM micro-benchmark (``bench.decoder.gemm``, ``python -m bench.ab gemm-peak``): one decoder
layer's MatMuls built, quantized and timed for real at the tiny checkpoint's shapes."""

from __future__ import annotations

import pytest

from bench.decoder import gemm
from higgs_pack.errors import InputError

TINY = {"hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "num_hidden_layers": 2}


def test_layer_shapes_and_operations():
    shapes = gemm.layer_shapes(gemm.QWEN3_4B)
    assert shapes == [("q", 2560, 4096), ("k", 2560, 1024), ("v", 2560, 1024), ("o", 4096, 2560),
                      ("gate", 2560, 9728), ("up", 2560, 9728), ("down", 9728, 2560)]
    assert gemm.ops_per_row(shapes) == 2 * 100_925_440  # Qwen3-4B: ~0.2 GOP per layer and position


@pytest.mark.parametrize(("name", "want"), [
    ("fp32", gemm.Variant("fp32", "ort", "fp32")),
    ("int4_b128_l4", gemm.Variant("int4_b128_l4", "ort", "int4", block=128, level=4)),
    ("int4_b32_l1_asym", gemm.Variant("int4_b32_l1_asym", "ort", "int4", block=32, level=1, symmetric=False)),
    ("ov_int4_sym_g64_dq0", gemm.Variant("ov_int4_sym_g64_dq0", "ov", "int4", block=64,
                                         properties=(("DYNAMIC_QUANTIZATION_GROUP_SIZE", "0"),))),
    ("ov_int8_sym", gemm.Variant("ov_int8_sym", "ov", "int8")),
])
def test_parse_variant(name, want):
    assert gemm.parse_variant(name) == want


@pytest.mark.parametrize("bad", ["int4", "int4_b32", "int4_bx_l4", "int4_b32_l4_sym", "ov_int4_asym_g64", "bf16", ""])
def test_parse_variant_refuses_unknown_names(bad):
    with pytest.raises(InputError, match="unknown GEMM variant"):
        gemm.parse_variant(bad)


def test_every_arithmetic_runs_and_agrees_with_float():
    """fp32, int8 and int4 (ONNX Runtime) and OpenVINO's int4 give the float layer's outputs within
    their quantization error, and the timing reports positions/s and GOP/s per row count."""
    import numpy as np

    shapes = gemm.layer_shapes(TINY)
    model = gemm.float_layer(shapes)
    x = np.random.default_rng(1).standard_normal((8, 64), dtype=np.float32)
    ref = gemm.runner(model, "fp32", {})(x)
    for name in ("int8", "int4_b32_l4", "int4_b64_l1_asym", "ov_int4_sym_g32"):
        got = gemm.runner(model, name, {})(x)
        got = list(got.values()) if hasattr(got, "values") else got
        for a, b in zip(ref, got, strict=True):
            assert np.linalg.norm(a - b) / np.linalg.norm(a) < 0.2, name
    report = gemm.measure(TINY, ["fp32", "int4_b32_l4"], [1, 16], rounds=1, session_options={}, min_seconds=0.01)
    row = report["results"]["int4_b32_l4"][16]
    assert row["positions_per_s"] > 0
    assert row["gops"] == pytest.approx(row["positions_per_s"] * report["ops_per_row"] / 1e9, rel=0.05)
    assert "| int4_b32_l4 |" in gemm.table(report) and "M=16 vs fp32" in gemm.table(report)
    import json

    kept = json.loads(json.dumps({**report, "results": {"fp32": {m: report["results"]["fp32"][1] for m in (1, 16, 256)}}}))
    head = gemm.table(kept).splitlines()[0]  # read back from JSON, the row counts are strings: still in order
    assert head.index("M=1 ") < head.index("M=16 ") < head.index("M=256 "), head


def test_each_variant_quantizes_the_float_layer_not_the_one_before():
    """ONNX Runtime's MatMulNBitsQuantizer rewrites the model it is given: every int4 variant after
    the first, and OpenVINO's, were timing the first int4 variant's graph.  Each now gets its own."""
    model = gemm.float_layer(gemm.layer_shapes(TINY))
    before = model.SerializeToString()
    for name in ("int4_b32_l4", "int4_b64_l1_asym", "ov_fp32"):
        gemm.runner(model, name, {})
    assert model.SerializeToString() == before
    attributes = {}
    for name in ("int4_b32_l4", "int4_b64_l1_asym"):
        (node, *_) = [n for n in gemm.ort_model(model, gemm.parse_variant(name)).graph.node if n.op_type == "MatMulNBits"]
        attributes[name] = {a.name: a.i for a in node.attribute if a.name in ("block_size", "accuracy_level")}
    assert attributes == {"int4_b32_l4": {"block_size": 32, "accuracy_level": 4},
                          "int4_b64_l1_asym": {"block_size": 64, "accuracy_level": 1}}, attributes


def test_gemm_peak_and_profile():
    peak = gemm.gemm_peak(TINY, rows=[16], rounds=1)
    assert set(peak["gemm_peak_gops"]) == {"float32", "int8"} and min(peak["gemm_peak_gops"].values()) > 0
    prof = gemm.profile_ops(gemm.float_layer(gemm.layer_shapes(TINY)), "int4_b32_l4", 16, {}, calls=1)
    assert "MatMulNBits" in prof["kernel_us"]
    prof = gemm.profile_ops(gemm.float_layer(gemm.layer_shapes(TINY)), "int8", 16, {}, calls=1)
    assert any(op in prof["kernel_us"] for op in ("DynamicQuantizeMatMul", "MatMulInteger"))

"""Streamed int4: the same bytes as ModelBuilder's in-memory int4, read back exactly, in bounded memory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("onnxruntime_genai")

from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from higgs_pack.exporters.checkpoint.models import write_qwen3_hf_dir  # noqa: E402
from higgs_pack.exporters.onnx.matmul_nbits import quantize_matmuls  # noqa: E402
from higgs_pack.exporters.process import run_step  # noqa: E402
from higgs_pack.exporters.pytorch.dequantize import OnnxWeights  # noqa: E402


def _modelbuilder(hf_dir: Path, out: Path, precision: str, ep: str, cache: Path) -> Path:
    subprocess.run([sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(hf_dir), "-o", str(out),
                    "-p", precision, "-e", ep, "-c", str(cache), "--extra_options", "exclude_embeds=true",
                    "exclude_lm_head=true"], check=True, capture_output=True)
    return out / "model.onnx"


def _signature(model) -> tuple[list, dict]:
    nodes = [(n.name, n.op_type, list(n.input), list(n.output),
              sorted((a.name, str(helper.get_attribute_value(a))) for a in n.attribute)) for n in model.graph.node]
    return nodes, {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


@pytest.mark.slow
@pytest.mark.parametrize(("ep", "float_precision"), [("cpu", "fp32"), ("dml", "fp16")])
def test_streamed_int4_is_modelbuilders_int4_byte_for_byte(tiny_ckpt, tmp_path, ep, float_precision):
    from higgs_pack.manifests.providers import EXECUTION_PROVIDERS

    hf = write_qwen3_hf_dir(tiny_ckpt, tmp_path / "hf")
    native = _modelbuilder(hf, tmp_path / "native", "int4", ep, tmp_path / "cache")
    float_graph = _modelbuilder(hf, tmp_path / "float", float_precision, ep, tmp_path / "cache")
    (tmp_path / "ours").mkdir()
    stats = quantize_matmuls(float_graph, tmp_path / "ours" / "model.onnx",
                             accuracy_level=EXECUTION_PROVIDERS[ep].modelbuilder.accuracy_level)
    want_nodes, want_weights = _signature(onnx.load(str(native)))
    got_nodes, got_weights = _signature(onnx.load(str(tmp_path / "ours" / "model.onnx")))
    assert got_nodes == want_nodes
    assert sorted(got_weights) == sorted(want_weights)
    for name, value in want_weights.items():
        np.testing.assert_array_equal(got_weights[name], value, err_msg=name)
    assert stats["quantized"] == sum(op == "MatMulNBits" for _, op, *_ in want_nodes) > 0
    assert stats["kept_float"] == []


def _matmul_chain(path: Path, k: int, n: int, count: int, seed: int = 0) -> list[np.ndarray]:
    """x -> MatMul(W0) -> MatMul(W1) ... with square-ish float32 weights in external data."""
    rng = np.random.default_rng(seed)
    weights, nodes, inits = [], [], []
    current = "x"
    for i in range(count):
        w = rng.standard_normal((k, n) if i % 2 == 0 else (n, k)).astype(np.float32)
        weights.append(w)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes.append(helper.make_node("MatMul", [current, f"w{i}"], [f"y{i}"], name=f"/mm{i}/MatMul"))
        current = f"y{i}"
    out_dim = n if count % 2 else k
    graph = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, k])],
                              [helper.make_tensor_value_info(current, TensorProto.FLOAT, [1, out_dim])],
                              initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.save_model(model, str(path), save_as_external_data=True, location=f"{path.name}.data",
                    size_threshold=0)
    return weights


def test_read_back_weights_are_what_onnxruntime_computes_with(tmp_path):
    """``OnnxWeights.weight`` of a MatMulNBits node == the weight ONNX Runtime's kernel uses."""
    weights = _matmul_chain(tmp_path / "f.onnx", 96, 64, 2)
    quantize_matmuls(tmp_path / "f.onnx", tmp_path / "q.onnx", block_size=32, accuracy_level=0)
    reader = OnnxWeights(tmp_path / "q.onnx")
    x = np.random.default_rng(1).standard_normal((1, 96)).astype(np.float32)
    got = ort.InferenceSession(str(tmp_path / "q.onnx"), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    w0, w1 = reader.weight("/mm0/MatMul_Q4"), reader.weight("/mm1/MatMul_Q4")
    assert w0.shape == (64, 96) and w1.shape == (96, 64)  # [N, K] like a torch Linear weight
    np.testing.assert_allclose(got, (x @ w0.T) @ w1.T, rtol=1e-4, atol=1e-4)
    rel = np.linalg.norm(w0 - weights[0].T) / np.linalg.norm(weights[0])
    assert 0.02 < rel < 0.2  # int4 round-to-nearest noise, not a different matrix


def test_quantization_memory_scales_with_the_largest_weight_not_the_model(tmp_path):
    """48 weights of 16 MiB (768 MiB of float32): the quantizer's peak stays near one weight
    (it holds the weight as a proto, as an array and packed: about six weights' worth at peak).

    Fails if someone loads the whole model (onnx.load with its external data, or
    MatMulNBitsQuantizer over the full proto) again.
    """
    k, n, count = 2048, 2048, 48
    _matmul_chain(tmp_path / "big.onnx", k, n, count)
    largest = k * n * 4
    _matmul_chain(tmp_path / "small.onnx", 64, 64, 1)  # the baseline: the same imports, one small weight
    _, baseline = run_step("higgs_pack.exporters.onnx.matmul_nbits:quantize_matmuls",
                           {"source": str(tmp_path / "small.onnx"), "target": str(tmp_path / "small-q.onnx")},
                           name="baseline")
    _, record = run_step("higgs_pack.exporters.onnx.matmul_nbits:quantize_matmuls",
                         {"source": str(tmp_path / "big.onnx"), "target": str(tmp_path / "q.onnx")},
                         name="quantize")
    model_bytes = count * largest
    grown = (record.peak_rss_mb - baseline.peak_rss_mb) * 2**20
    assert grown < 10 * largest < model_bytes / 4, (f"quantizing grew the process tree by {grown / 2**20:.0f} MiB for a "
                                 f"{model_bytes / 2**20:.0f} MiB model (largest weight {largest / 2**20:.0f} MiB)")
    assert (tmp_path / "q.onnx.data").stat().st_size < model_bytes / 5

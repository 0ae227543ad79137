"""ONNX bundles on ONNX Runtime's OpenVINO execution provider: the refusals and the node-placement report.

The build venv has onnxruntime, not onnxruntime-openvino (they cannot share a venv), so
the OpenVINO EP is absent here: what is tested is that its absence, a silent fallback to
the CPU EP, and two onnxruntime distributions installed together are all loud errors,
and that node placement is read correctly from a real ONNX Runtime profile. The EP
itself runs in ``nox -s verify-cpu-on-openvino-ep`` (its own venv).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

ort = pytest.importorskip("onnxruntime")
onnx = pytest.importorskip("onnx")

from onnx import TensorProto, helper  # noqa: E402

from higgs_pack.errors import ExecutionProviderUnavailable  # noqa: E402
from higgs_pack.runtime.backends.onnxruntime import sessions as ort_backend  # noqa: E402
from higgs_pack.runtime.backends.onnxruntime.distributions import (  # noqa: E402
    import_ort,
    installed_ort_distributions,
)
from higgs_pack.runtime.backends.onnxruntime.placement import (  # noqa: E402
    bundle_node_placement,
    parse_profile,
    profile_node_placement,
)
from higgs_pack.runtime.backends.onnxruntime.sessions import create_session  # noqa: E402
from higgs_pack.runtime.verification.backend_checks import check_node_placement  # noqa: E402
from higgs_pack.runtime.verification.report import VerifyReport  # noqa: E402

OV_EP = "OpenVINOExecutionProvider"
#: The graph's nodes (name, op type), in order.
NODES = [("mm", "MatMul"), ("add", "Add"), ("act", "Relu")]


@pytest.fixture(scope="module")
def small_onnx(tmp_path_factory) -> Path:
    """x float32 [1, 4] -> Relu(x @ W + b) [1, 3], three named nodes."""
    rng = np.random.default_rng(0)
    w = helper.make_tensor("W", TensorProto.FLOAT, [4, 3], rng.standard_normal(12).astype(np.float32))
    b = helper.make_tensor("B", TensorProto.FLOAT, [3], rng.standard_normal(3).astype(np.float32))
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["h"], name="mm"),
         helper.make_node("Add", ["h", "B"], ["z"], name="add"),
         helper.make_node("Relu", ["z"], ["y"], name="act")],
        "small",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 3])],
        initializer=[w, b],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    path = tmp_path_factory.mktemp("onnx") / "small.onnx"
    onnx.save(model, path)
    return path


def _fake_dist(root: Path, name: str, version: str) -> None:
    info = root / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_two_onnxruntime_distributions_are_refused(tmp_path, monkeypatch):
    present = installed_ort_distributions()
    assert present, "the build venv has an onnxruntime distribution"
    other = "onnxruntime-openvino" if "onnxruntime-openvino" not in present else "onnxruntime"
    _fake_dist(tmp_path, other, "1.24.1")
    monkeypatch.syspath_prepend(str(tmp_path))
    both = installed_ort_distributions()
    assert set(both) == {*present, other}
    with pytest.raises(ExecutionProviderUnavailable) as info:
        import_ort()
    message = str(info.value)
    assert f"{' and '.join(both)} are installed together" in message
    assert "ship the same `onnxruntime` module" in message
    assert f"pip uninstall -y {' '.join(both)}" in message


@pytest.mark.skipif(OV_EP in ort.get_available_providers(), reason="onnxruntime-openvino is installed here")
def test_openvino_ep_missing_is_an_error_naming_providers_and_fix(small_onnx):
    with pytest.raises(ExecutionProviderUnavailable) as info:
        create_session(small_onnx, "openvino")
    message = str(info.value)
    assert f"{OV_EP} was asked for but is not available here" in message
    assert f"installed providers: {', '.join(ort.get_available_providers())}" in message
    assert "pip uninstall -y onnxruntime && pip install 'onnxruntime-openvino>=1.24'" in message
    assert "cannot share a venv" in message
    assert "--execution-provider cpu (execution_provider='cpu')" in message
    # Only an explicit fallback runs elsewhere, and it says so.
    session, note = create_session(small_onnx, "openvino", allow_fallback=True)
    assert session.get_providers() == ["CPUExecutionProvider"]
    assert note == f"CPUExecutionProvider (fallback from {OV_EP})"


def test_session_that_silently_lands_on_cpu_is_an_error(small_onnx, monkeypatch):
    """onnxruntime-openvino whose OpenVINO library is missing lists the EP but creates the
    session on the CPU EP without a word (MODEL.md); get_providers() is the check."""
    fake = SimpleNamespace(
        get_available_providers=lambda: [OV_EP, "CPUExecutionProvider"],
        InferenceSession=lambda path, sess_options, providers: ort.InferenceSession(
            path, sess_options=sess_options, providers=["CPUExecutionProvider"]),
        SessionOptions=ort.SessionOptions,
        GraphOptimizationLevel=ort.GraphOptimizationLevel,
        ExecutionMode=ort.ExecutionMode,
    )
    monkeypatch.setattr(ort_backend, "import_ort", lambda: fake)
    with pytest.raises(ExecutionProviderUnavailable,
                       match=f"small.onnx: asked for {OV_EP} but ONNX Runtime created the session on "
                             r"CPUExecutionProvider \(its library failed to load\?\)"):
        create_session(small_onnx, "openvino")


def test_parse_a_real_cpu_profile(small_onnx):
    feeds = {"x": np.ones((1, 4), np.float32)}
    placement = profile_node_placement(
        small_onnx, "cpu", lambda s: [s.run(None, feeds) for _ in range(3)],
        session_options={"graph_optimization_level": "ORT_DISABLE_ALL"},
    )
    assert placement.on("CPUExecutionProvider") == NODES  # each node once, though it ran 3 times
    assert placement.op_counts("CPUExecutionProvider") == {"MatMul": 1, "Add": 1, "Relu": 1}
    assert placement.on(OV_EP) == []


def test_parse_profile_with_fused_openvino_subgraphs(tmp_path):
    """Events as onnxruntime-openvino 1.24.1 wrote them for the ModelBuilder decoder (trimmed)."""
    def event(name, provider, op):
        return {"cat": "Node", "ph": "X", "name": f"{name}_kernel_time", "dur": 5,
                "args": {"provider": provider, "op_name": op, "node_index": "1"}}

    events = [
        {"cat": "Session", "name": "model_loading_uri", "args": {}},
        event("OpenVINOExecutionProvider_OpenVINO-EP-subgraph_1_0", OV_EP, "OpenVINO-EP-subgraph_1"),
        {"cat": "Node", "name": "/model/layers.0/attn/GroupQueryAttention_fence_before", "args": {}},
        event("/model/layers.0/attn/GroupQueryAttention", "CPUExecutionProvider", "GroupQueryAttention"),
        event("OpenVINOExecutionProvider_OpenVINO-EP-subgraph_2_1", OV_EP, "OpenVINO-EP-subgraph_2"),
        event("/model/layers.1/attn/GroupQueryAttention", "CPUExecutionProvider", "GroupQueryAttention"),
        event("OpenVINOExecutionProvider_OpenVINO-EP-subgraph_1_0", OV_EP, "OpenVINO-EP-subgraph_1"),
    ]
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(events))
    placement = parse_profile(path)
    assert placement.op_counts("CPUExecutionProvider") == {"GroupQueryAttention": 2}
    assert [n for n, _ in placement.on(OV_EP)] == ["OpenVINOExecutionProvider_OpenVINO-EP-subgraph_1_0",
                                                   "OpenVINOExecutionProvider_OpenVINO-EP-subgraph_2_1"]
    path.write_text('{"not": "a profile"}')
    with pytest.raises(ValueError, match="not an ONNX Runtime profile"):
        parse_profile(path)


def test_node_placement_check(small_onnx, tmp_path):
    """The check measures for real: profiles of the bundle's own sub-part on the provider it
    reports on (nothing patched).  Without the OpenVINO EP the measurement cannot run, and the
    check fails saying so; with it, the nodes the EP left on the CPU EP are named and counted."""
    golden = {"audio_heads/in/x": np.ones((1, 4), np.float32)}
    np.savez(tmp_path / "golden.npz", **golden)
    (tmp_path / small_onnx.name).write_bytes(small_onnx.read_bytes())
    manifest = {"constants": {}, "provider_options": {}, "execution_provider": "cpu",
                "session_options": {"graph_optimization_level": "ORT_DISABLE_ALL"},
                "subparts": {"audio_heads": {"entry": small_onnx.name}}, "reference": {"file": "golden.npz"}}
    bundle = SimpleNamespace(manifest=manifest, file=lambda rel: tmp_path / rel, path=tmp_path)
    placements = bundle_node_placement(bundle, "cpu", golden)
    assert placements["audio_heads"].on("CPUExecutionProvider") == NODES

    # On the CPU EP there is nothing to report.
    report = VerifyReport("b")
    check_node_placement(bundle, SimpleNamespace(description={"audio_heads": "CPUExecutionProvider"}), report)
    assert report.checks[-1].ok is None and "placement is checked on other providers" in report.checks[-1].detail

    check_node_placement(bundle, SimpleNamespace(description={"audio_heads": OV_EP}), report)
    check = report.checks[-1]
    if OV_EP not in ort.get_available_providers():
        assert check.ok is False, check
        assert f"{OV_EP} was asked for but is not available here" in check.detail
        return
    measured = bundle_node_placement(bundle, "openvino", golden)["audio_heads"]
    left = measured.on("CPUExecutionProvider")
    assert check.ok is True and check.value == len(left)
    if left:
        assert check.detail.startswith(f"{len(left)} nodes left on CPUExecutionProvider")
        assert all(name in check.detail for name, _ in left[:4])
    else:
        assert check.detail.startswith(f"{OV_EP} ran every node")

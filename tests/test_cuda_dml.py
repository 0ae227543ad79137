"""The cuda, dml and winml targets on a machine without their GPUs.

The tiny cuda fp16, dml fp16 and winml fp16 bundles are built once for the module.  What needs no
GPU runs for real here (build, CPU parity, fp16 casting, static checks, guards); what
needs one is skipped with a reason naming the hardware.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import onnx
import pytest
from click.testing import CliRunner
from conftest import slow_fixture
from onnx import TensorProto, helper

from higgs_pack.errors import ExecutionProviderUnavailable, NumericalError
from higgs_pack.manifests.manifest import file_entry, read_manifest, write_manifest
from higgs_pack.runtime.backends.onnxruntime.distributions import import_ort
from higgs_pack.runtime.backends.onnxruntime.sessions import session_options_for
from higgs_pack.runtime.loop.synthesis import synthesize
from higgs_pack.runtime.options import SamplingOptions
from higgs_pack.runtime.sources.bundle import load_pipeline as load
from higgs_pack.runtime.sources.bundle import open_bundle
from higgs_pack.runtime.verification.backend_checks import compare_providers
from higgs_pack.runtime.verification.kernels import KernelTable, coverage, load_kernel_table
from higgs_pack.runtime.verification.onnx_types import TypedNode, type_graph
from higgs_pack.runtime.verification.report import VerifyReport, compare, read_golden
from higgs_pack.runtime.verification.verify import check_gpu_provider, verify_bundle

pytestmark = pytest.mark.slow

CUDA = "CUDAExecutionProvider"
DML = "DmlExecutionProvider"


def _available() -> list[str]:
    return import_ort().get_available_providers()


@slow_fixture(scope="module")
def cuda_fp16(tmp_path_factory, tiny_checkpoint) -> Path:
    from higgs_pack.targets.build import build

    return build("cuda", model=tiny_checkpoint, out=tmp_path_factory.mktemp("cuda") / "cuda-fp16")


@slow_fixture(scope="module")
def dml_fp16(tmp_path_factory, tiny_checkpoint) -> Path:
    from higgs_pack.targets.build import build

    return build("dml", model=tiny_checkpoint, out=tmp_path_factory.mktemp("dml") / "dml-fp16")


@slow_fixture(scope="module")
def winml_fp16(tmp_path_factory, tiny_checkpoint) -> Path:
    from higgs_pack.targets.build import build

    return build("winml", model=tiny_checkpoint, out=tmp_path_factory.mktemp("winml") / "winml-fp16")


def _checks(manifest: dict) -> dict[str, dict]:
    return {c["name"]: c for c in manifest["verification"]["build_time"]["checks"]}


def _rehash(bundle: Path) -> None:
    m = read_manifest(bundle)
    m["files"] = [file_entry(bundle, f["path"]) for f in m["files"]]
    write_manifest(bundle, m)


def _overwrite_initializer(bundle: Path, name: str, value: float) -> None:
    """Fill one decoder weight (stored in model.onnx.data) with ``value``, then re-hash."""
    model_path = bundle / "llm_decoder" / "model.onnx"
    model = onnx.load(str(model_path), load_external_data=False)
    tensor = next(t for t in model.graph.initializer if t.name == name)
    info = {e.key: e.value for e in tensor.external_data}
    dtype = helper.tensor_dtype_to_np_dtype(tensor.data_type)
    data = np.full(int(np.prod(tensor.dims)), value, dtype=dtype).tobytes()
    assert len(data) == int(info["length"])
    with open(model_path.parent / info["location"], "r+b") as handle:
        handle.seek(int(info["offset"]))
        handle.write(data)
    _rehash(bundle)


def _final_norm(bundle: Path) -> str:
    model = onnx.load(str(bundle / "llm_decoder" / "model.onnx"), load_external_data=False)
    return next(t.name for t in model.graph.initializer if "final_norm" in t.name)


# ----------------------------------------------------------------------------- builds and manifests


def test_cuda_fp16_manifest(cuda_fp16, tiny_ckpt):
    m = read_manifest(cuda_fp16)
    layers = tiny_ckpt.constants.num_layers
    assert (m["name"], m["target"], m["precision"]) == ("higgs-audio-v3-tiny-cuda-fp16", "cuda", "fp16")
    assert (m["backend"], m["execution_provider"], m["provider_options"]) == ("onnxruntime", "cuda", {"device_id": 0})
    assert m["runtime_requirements"][0].startswith("onnxruntime-gpu>=1.31")
    subs = m["subparts"]
    dec = {t["name"]: t["dtype"] for t in subs["llm_decoder"]["inputs"]}
    assert dec["inputs_embeds"] == dec["past_key_values.0.key"] == "float16" and dec["attention_mask"] == "int64"
    assert "position_ids" not in dec  # cuda fuses rotary embedding into GroupQueryAttention
    assert subs["llm_decoder"]["outputs"][0] == {"name": "hidden_states", "dtype": "float16",
                                                 "shape": ["batch_size", "sequence_length", 64]}
    assert subs["llm_decoder"]["options"]["op_types"]["GroupQueryAttention"] == layers  # one per layer
    for part in ("text_embed", "audio_embed", "audio_heads"):
        assert subs[part]["passes"] == ["OnnxConversion"]
        assert subs[part]["quantization"]["cast_by"] == "OnnxConversion(torch_dtype=float16)"
        assert subs[part]["outputs"][0]["dtype"] == "float16"
        assert subs[part]["parity"]["threshold"] == 0.995  # looser fp16 rule, recorded
    for part in ("audio_tokenizer", "audio_encoder"):
        assert subs[part]["precision"] == "fp32" and subs[part]["passes"] == ["OnnxConversion"]
    # The CPU provider cannot run ModelBuilder's cuda attention: skipped with ORT's reason, not faked.
    checks = _checks(m)
    assert checks["parity llm_decoder"]["status"] == "skipped"
    assert "q_norm_weight" in checks["parity llm_decoder"]["detail"]
    assert subs["llm_decoder"]["parity"]["measured"] is None
    assert checks["greedy codes"]["status"] == "skipped"
    for part in ("text_embed", "audio_embed", "audio_heads", "audio_tokenizer"):
        assert subs[part]["parity"]["measured"] >= subs[part]["parity"]["threshold"]
    assert m["verification"]["build_time"]["ok"] is True


def test_dml_fp16_manifest_and_marker(dml_fp16, tiny_ckpt):
    from packaging.requirements import Requirement

    m = read_manifest(dml_fp16)
    assert (m["target"], m["execution_provider"], m["precision"]) == ("dml", "dml", "fp16")
    dec = {t["name"]: t["dtype"] for t in m["subparts"]["llm_decoder"]["inputs"]}
    assert dec["position_ids"] == "int64" and dec["inputs_embeds"] == "float16"
    assert m["subparts"]["llm_decoder"]["options"]["op_types"]["RotaryEmbedding"] == 2 * tiny_ckpt.constants.num_layers  # q and k per layer
    reqs = [Requirement(r) for r in m["runtime_requirements"]]
    assert reqs[0].name == "onnxruntime-directml"
    for req in reqs:  # every requirement is Windows-only, like the wheel's metadata
        assert req.marker is not None
        assert req.marker.evaluate({"sys_platform": "win32"}) and not req.marker.evaluate({"sys_platform": "linux"})
    from higgs_pack.targets.registry import get_target

    assert get_target("dml").platform_marker == "sys_platform == 'win32'"
    checks = _checks(m)
    dec_parity = m["subparts"]["llm_decoder"]["parity"]
    assert checks["parity llm_decoder"]["status"] == "ok" and dec_parity["measured"] >= dec_parity["threshold"] == 0.995
    assert checks["greedy codes"]["status"] == "info"  # fp16: measured, not judged
    assert "explicit --execution-provider cpu; bundle built for dml" in m["verification"]["build_time"]["backend"]


def test_winml_fp16_is_the_dml_bundle_for_windows_ml(winml_fp16, dml_fp16):
    """The winml bundle holds dml's graphs byte for byte (ModelBuilder ``-e dml``, the same
    Olive sub-parts and golden outputs); only its manifest differs: the target, the provider,
    and Windows ML's requirements on x64 Windows."""
    from packaging.requirements import Requirement

    m, dml = read_manifest(winml_fp16), read_manifest(dml_fp16)
    assert (m["target"], m["execution_provider"], m["precision"]) == ("winml", "winml", "fp16")
    assert m["provider_options"] == dml["provider_options"] == {"device_id": 0}
    hashes = {f["path"]: f["sha256"] for f in m["files"]}
    assert hashes == {f["path"]: f["sha256"] for f in dml["files"]}
    assert {"llm_decoder/model.onnx", "llm_decoder/model.onnx.data", "reference/golden.npz"} <= set(hashes)
    assert m["subparts"]["llm_decoder"]["options"]["execution_provider"] == "winml"
    reqs = [Requirement(r) for r in m["runtime_requirements"]]
    assert [r.name for r in reqs] == ["onnxruntime-windowsml", "onnxruntime-genai-winml", "onnx"]
    x64 = {"sys_platform": "win32", "platform_machine": "AMD64"}
    for req in reqs:
        assert req.marker.evaluate(x64) and not req.marker.evaluate({**x64, "platform_machine": "ARM64"})
        assert not req.marker.evaluate({"sys_platform": "linux", "platform_machine": "x86_64"})
    checks = _checks(m)
    assert checks["parity llm_decoder"]["status"] == "ok" and m["verification"]["build_time"]["ok"] is True
    assert "explicit --execution-provider cpu; bundle built for winml" in m["verification"]["build_time"]["backend"]


# ----------------------------------------------------------------------------- runtime dtypes and session rules


def test_fp16_graphs_take_fp16_and_runtime_math_stays_fp32(dml_fp16):
    pipe = load(dml_fp16, execution_provider="cpu")
    decoder = pipe.decoder
    assert {i.name: i.type for i in decoder.session.get_inputs()}["inputs_embeds"] == "tensor(float16)"
    assert decoder._embed_type == np.float16 and decoder._kv_type == np.float16
    golden = read_golden(open_bundle(dml_fp16))
    decoder.reset()
    hidden = decoder.forward(golden["llm_decoder/in/inputs_embeds"].astype(np.float32))
    assert hidden.dtype == np.float32
    assert all(v.data_type() == "tensor(float16)" for v in decoder._cache.values())  # KV cache stays fp16
    step = decoder.forward(golden["llm_decoder/in/step_embeds"].astype(np.float32))
    assert compare(golden["llm_decoder/out/step_hidden_states"], step, "cosine")[0] > 0.995
    logits = pipe.audio_heads.run({"hidden_states": golden["audio_heads/in/hidden_states"].astype(np.float32)})
    assert logits["audio_logits"].dtype == np.float32
    embeds = pipe.text_embed.run({"input_ids": golden["text_embed/in/input_ids"]})["inputs_embeds"]
    assert embeds.dtype == np.float32  # cast back at the runner's boundary
    wave = pipe.audio_tokenizer.run({"audio_codes": golden["audio_tokenizer/in/audio_codes"]})["waveform"]
    assert wave.dtype == np.float32


def test_directml_session_rules():
    ort = import_ort()
    so = session_options_for("dml", {"enable_mem_pattern": True})
    assert so.enable_mem_pattern is False and so.execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL
    assert session_options_for("cuda", {}).enable_mem_pattern is True
    assert session_options_for("cpu", {"enable_mem_pattern": True}).enable_mem_pattern is True


def test_dml_rules_on_every_session_even_in_fallback(dml_fp16):
    ort = import_ort()
    pipe = load(dml_fp16, allow_fallback=True)
    sessions = [pipe.decoder.session, pipe.text_embed.session, pipe.audio_heads.session, pipe.audio_tokenizer.session]
    for session in sessions:
        options = session.get_session_options()
        assert options.enable_mem_pattern is False
        assert options.execution_mode == ort.ExecutionMode.ORT_SEQUENTIAL


def test_allowed_fallback_from_dml_is_recorded(dml_fp16):
    if DML in _available():
        pytest.skip(f"this machine has a DirectML GPU ({DML}); there is no fallback to show")
    pipe = load(dml_fp16, allow_fallback=True)
    assert pipe.description["llm_decoder"] == f"CPUExecutionProvider (fallback from {DML})"


def test_a_fallback_is_said_once_not_once_per_sub_part(cpu_int4_bundle, caplog):
    """Loading a cpu bundle on the CUDA provider with fallback allowed: one warning for the
    bundle, not one per sub-part's session (7 before; a new user's finding)."""
    import logging

    from higgs_pack.runtime.backends.onnxruntime import sessions

    if "CUDAExecutionProvider" in _available():
        pytest.skip("this machine has a CUDA GPU; there is no fallback to show")
    sessions._FALLBACKS_SAID.discard("CUDAExecutionProvider")
    with caplog.at_level(logging.WARNING, logger="higgs_pack"):
        load(cpu_int4_bundle, execution_provider="cuda", allow_fallback=True)
    said = [r for r in caplog.records if "falling back" in r.getMessage()]
    assert len(said) == 1, [r.getMessage() for r in said]


# ----------------------------------------------------------------------------- guards


def test_cuda_bundle_here_names_the_missing_provider(cuda_fp16, tmp_path):
    if CUDA in _available():
        pytest.skip("this machine has CUDAExecutionProvider; the missing-CUDA message cannot be shown")
    with pytest.raises(ExecutionProviderUnavailable,
                       match=r"CUDAExecutionProvider was asked for but is not available here \(installed "
                             r"providers: .*CPUExecutionProvider.*--execution-provider cpu"):
        load(cuda_fp16)
    from higgs_pack.runtime.cli import main

    result = CliRunner().invoke(main, ["synthesize", str(cuda_fp16), "--text", "Hello.", "-o",
                                       str(tmp_path / "x.wav"), "--no-progress"])
    assert result.exit_code == 2
    assert "CUDAExecutionProvider" in result.output and "CPUExecutionProvider" in result.output


def test_explicit_cpu_fallback_runs_dml_fp16_and_is_recorded(dml_fp16):
    pipe = load(dml_fp16, execution_provider="cpu")
    assert set(pipe.description.values()) == {
        "CPUExecutionProvider (explicit --execution-provider cpu; bundle built for dml)"}
    out = synthesize(pipe, "Hello there.", options=SamplingOptions(seed=0), max_frames=12)
    assert out.samples.dtype == np.float32 and out.samples.size > 0 and np.isfinite(out.samples).all()


@pytest.mark.parametrize("how", ["explicit", "fallback"])
def test_float16_graphs_on_the_cpu_cast_per_node(dml_fp16, how):
    """A GPU provider's fp16 graph on the CPU provider gets FLOAT16_ON_CPU_OPTIONS: no constant
    folding of the inserted casts (a float32 copy of every weight, 15.6 GB at 4B dims) and
    casts ordered next to their consumers."""
    if how == "fallback" and DML in _available():
        pytest.skip(f"this machine has a DirectML GPU ({DML}); there is no fallback to show")
    ort = import_ort()
    pipe = load(dml_fp16, **({"execution_provider": "cpu"} if how == "explicit" else {"allow_fallback": True}))
    for session in (pipe.decoder.session, pipe.text_embed.session, pipe.audio_heads.session):
        options = session.get_session_options()
        assert options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_DISABLE_ALL
        assert options.execution_order == ort.ExecutionOrder.PRIORITY_BASED
    out = synthesize(pipe, "Hello there.", options=SamplingOptions(seed=0), max_frames=8)
    assert np.isfinite(out.samples).all() and out.samples.size > 0


def test_cpu_bundles_keep_full_graph_optimization(cpu_fp32_bundle):
    ort = import_ort()
    options = load(cpu_fp32_bundle).decoder.session.get_session_options()
    assert options.graph_optimization_level == ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    assert options.execution_order == ort.ExecutionOrder.DEFAULT


def test_explicit_cpu_on_cuda_fp16_says_which_subpart_cannot_run(cuda_fp16):
    pipe = load(cuda_fp16, execution_provider="cpu")  # every session opens on the CPU provider
    with pytest.raises(ExecutionProviderUnavailable,
                       match=r"llm_decoder cannot run on CPUExecutionProvider: .*q_norm_weight"):
        synthesize(pipe, "Hello.", options=SamplingOptions(seed=0), max_frames=4)


@pytest.fixture
def dml_copy(tmp_path, dml_fp16) -> Path:
    return Path(shutil.copytree(dml_fp16, tmp_path / "bundle"))


def test_nan_decoder_raises_numerical_error(dml_copy):
    _overwrite_initializer(dml_copy, _final_norm(dml_copy), np.nan)
    pipe = load(dml_copy, execution_provider="cpu")
    with pytest.raises(NumericalError, match=r"llm_decoder returned non-finite values .* on CPUExecutionProvider"):
        synthesize(pipe, "Hello.", options=SamplingOptions(seed=0), max_frames=4)
    report = verify_bundle(dml_copy, execution_provider="cpu", synthesize_cases=False)
    assert not report.ok
    assert next(c for c in report.checks if c.name == "parity llm_decoder").ok is False


def test_all_zero_decoder_raises_numerical_error(dml_copy):
    _overwrite_initializer(dml_copy, _final_norm(dml_copy), 0.0)
    pipe = load(dml_copy, execution_provider="cpu")
    with pytest.raises(NumericalError, match=r"llm_decoder returned an all-zero hidden state .* CPUExecutionProvider"):
        synthesize(pipe, "Hello.", options=SamplingOptions(seed=0), max_frames=4)


def test_provider_comparison_flags_nan_and_passes_identical(dml_fp16, dml_copy):
    reference = load(dml_fp16, execution_provider="cpu")
    report = VerifyReport(bundle="dml")
    compare_providers(open_bundle(dml_fp16), load(dml_fp16, execution_provider="cpu"), reference, report, label="cpu")
    names = [c.name for c in report.checks]
    assert any("one-token prompt" in n for n in names) and any("low-magnitude" in n for n in names)
    assert report.ok and all(c.value is None or c.value > 0.9999 for c in report.checks)
    _overwrite_initializer(dml_copy, _final_norm(dml_copy), np.nan)
    bad = VerifyReport(bundle="nan")
    compare_providers(open_bundle(dml_copy), load(dml_copy, execution_provider="cpu"), reference, bad, label="cpu")
    failed = [c for c in bad.checks if c.ok is False]
    assert failed and all("non-finite" in c.detail for c in failed)
    assert all("llm_decoder" in c.name for c in failed)


def test_provider_comparison_when_the_reference_cannot_run_the_decoder(cuda_fp16, dml_fp16):
    # The cuda decoder as the CPU reference cannot run (fused Q/K-norm attention): said, not failed.
    report = VerifyReport(bundle="cuda")
    compare_providers(open_bundle(cuda_fp16), load(dml_fp16, execution_provider="cpu"),
                      load(cuda_fp16, execution_provider="cpu"), report, label="gpu")
    decoder = [c for c in report.checks if "llm_decoder" in c.name]
    assert report.ok and len(decoder) == 3
    assert all("comparison skipped: the reference provider cannot execute this graph" in c.detail
               and "q_norm_weight" in c.detail for c in decoder)


def test_gpu_provider_path_runs_end_to_end_on_a_stand_in_provider(dml_fp16):
    # The code a CUDA/DirectML machine runs, exercised with the CPU provider standing in for the GPU.
    report = VerifyReport(bundle="dml")
    check_gpu_provider(open_bundle(dml_fp16), report, ep="cpu")
    names = {c.name for c in report.checks}
    assert report.ok, report.render()
    assert {"cpu sessions", "cpu: parity llm_decoder", "cpu: greedy codes"} <= names
    assert "cpu vs CPU: llm_decoder, low-magnitude embeddings" in names


# ----------------------------------------------------------------------------- static verification


def test_static_verification_of_the_cuda_bundle(cuda_fp16):
    report = verify_bundle(cuda_fp16)  # what `higgs-pack verify` / `nox -s verify-cuda` run
    checks = {c.name: c for c in report.checks}
    assert report.ok, report.render()
    assert all(checks[f"onnx.checker {p}"].ok for p in ("llm_decoder", "text_embed", "audio_tokenizer"))
    assert "SimplifiedLayerNormalization@1 registered from onnxruntime" in checks["onnx.checker llm_decoder"].detail
    assert all(checks[f"ops {p}"].detail.startswith("all ") for p in ("llm_decoder", "audio_encoder", "text_embed"))
    assert checks["dtypes llm_decoder"].ok and "float16" in checks["dtypes llm_decoder"].detail
    assert checks["decoder I/O"].ok
    # Parity on the CPU provider (no CUDA here): the fused decoder is skipped with ORT's reason.
    assert checks["parity llm_decoder"].ok is None and "q_norm_weight" in checks["parity llm_decoder"].detail
    assert checks["parity audio_heads"].ok is True
    assert "cuda runtime" in checks


def test_static_verification_skips_the_missing_gpu_naming_it(cuda_fp16, dml_fp16, tmp_path):
    if CUDA in _available() or DML in _available():
        pytest.skip("this machine has a CUDA or DirectML GPU; the skipped-GPU lines cannot be shown")
    gpu = {c.name: c for c in verify_bundle(cuda_fp16, parity=False).checks}["cuda runtime"]
    assert gpu.ok is None and gpu.detail.startswith("no CUDA GPU: CUDAExecutionProvider not available")
    out = tmp_path / "report.json"
    assert _verify_cli(dml_fp16, "--report", out, "--skip-parity").exit_code == 0
    checks = {c["name"]: c for c in json.loads(out.read_text())["checks"]}
    assert checks["dml runtime"]["status"] == "skipped"
    assert checks["dml runtime"]["detail"].startswith("no DirectML GPU")


def _verify_cli(bundle, *args):
    from higgs_pack.runtime.cli import main

    return CliRunner().invoke(main, ["verify", str(bundle), *map(str, args)])


def test_static_verification_of_the_dml_bundle(dml_fp16, tmp_path):
    out = tmp_path / "report.json"
    result = _verify_cli(dml_fp16, "--report", out, "--skip-parity")
    assert result.exit_code == 0, result.output
    checks = {c["name"]: c for c in json.loads(out.read_text())["checks"]}
    assert checks["ops llm_decoder"]["status"] == "ok" and checks["ops llm_decoder"]["detail"].startswith("all ")
    assert "Gelu" in checks["ops audio_encoder"]["detail"] and "fall back" in checks["ops audio_encoder"]["detail"]
    assert "Mod" in checks["ops audio_heads"]["detail"]  # int64 shape arithmetic DirectML has no kernel for
    assert "dml runtime" in checks


def test_static_verification_of_the_winml_bundle(winml_fp16):
    """What `higgs-pack verify` / `nox -s verify-winml` check without Windows: DirectML's kernel
    table against the graphs, and the Windows ML run skipped naming the hardware and Windows."""
    report = verify_bundle(winml_fp16, parity=False)
    checks = {c.name: c for c in report.checks}
    assert report.ok, report.render()
    assert checks["ops llm_decoder"].ok and checks["ops llm_decoder"].detail.startswith("all ")
    assert "Gelu" in checks["ops audio_encoder"].detail and "fall back" in checks["ops audio_encoder"].detail
    assert checks["decoder I/O"].ok
    if DML not in _available():
        gpu = checks["winml runtime"]
        assert gpu.ok is None and gpu.detail.startswith(
            "no DirectML GPU (Windows ML: Windows 11 24H2 or later, x64): DmlExecutionProvider not available")


def test_winml_wheel_resolves_for_windows_x64(winml_fp16, tmp_path):
    """The winml wheel's metadata, its bundle found by name once installed, and pip's resolver
    (``--platform win_amd64 --only-binary=:all:``) finding a wheel of every requirement: what
    `nox -s package-winml` checks where Windows is missing.  Needs the package index."""
    from higgs_pack.targets.packaging import package_bundle
    from higgs_pack.targets.packaging.install_check import (
        Results,
        check_metadata,
        check_no_deps_install,
        check_plan,
        check_resolves,
        read_wheel,
    )
    from higgs_pack.targets.registry import get_target

    target = get_target("winml")
    whl, = package_bundle(winml_fp16, formats="wheel", out_dir=tmp_path / "dist")
    wheel = read_wheel(whl)
    results = Results()
    check_metadata(wheel, target, results)
    check_no_deps_install(wheel, tmp_path, results)
    assert not results.failed, results.lines
    resolved = Results()
    check_resolves(wheel, target, check_plan(target), tmp_path, resolved)
    ((status, name, detail),) = resolved.lines
    if status == "FAIL" and any(w in detail for w in ("NewConnectionError", "Could not fetch", "Failed to establish",
                                                      "Temporary failure in name resolution")):
        pytest.skip(f"the package index is not reachable: {detail[:200]}")
    assert status == "ok" and name.startswith("runtime requirements have wheels for Windows x86-64"), detail
    assert "onnxruntime-windowsml-1.3" in detail and "onnxruntime-genai-winml-0.18" in detail, detail
    assert "onnxruntime-winml-" not in detail


def test_op_tables_cover_every_node_with_types(cuda_fp16, dml_fp16):
    """Every op the built bundles contain is in the tables with its type constraints."""
    for bundle, ep in ((cuda_fp16, "cuda"), (dml_fp16, "dml")):
        table = load_kernel_table(ep)
        m = read_manifest(bundle)
        for part, spec in m["subparts"].items():
            types = type_graph(onnx.load(str(bundle / spec["entry"]), load_external_data=False))
            assert not types.issues, (part, types.issues)
            for node in types.nodes:
                key = (node.domain, node.op_type)
                if key in table.graph_level or key not in table.ops:
                    continue  # graph-level, or reported as a fallback
                assert all("types" in k for k in table.ops[key]), (ep, key)


def test_kernel_tables_name_their_source():
    for ep in ("cuda", "dml"):
        table = load_kernel_table(ep)
        assert "OperatorKernels.md" in table.source
        for op in ("GroupQueryAttention", "MatMulNBits", "SkipSimplifiedLayerNormalization", "RotaryEmbedding"):
            assert ("com.microsoft", op) in table.ops
    assert ("com.microsoft", "GatherBlockQuantized") in load_kernel_table("cuda").ops
    assert ("com.microsoft", "GatherBlockQuantized") not in load_kernel_table("dml").ops


def test_coverage_finds_missing_types_and_ops():
    cuda = load_kernel_table("cuda")
    gqa32 = TypedNode("gqa", "com.microsoft", "GroupQueryAttention", 1, {"T": "float", "M": "int32"})
    gqa16 = TypedNode("gqa", "com.microsoft", "GroupQueryAttention", 1, {"T": "float16", "M": "int32"})
    assert cuda.find(gqa16) == (True, "")
    ok, why = cuda.find(gqa32)
    assert not ok and "no M=int32, T=float variant" in why  # CUDA's GQA is fp16/bf16 only
    dml = load_kernel_table("dml")
    ok, why = dml.find(TypedNode("g", "com.microsoft", "GatherBlockQuantized", 1, {"T2": "float"}))
    assert not ok and "no GatherBlockQuantized kernel" in why
    table = KernelTable("X", {("ai.onnx", "Add"): [{"versions": [14, None], "types": {"T": ["float"]}}]})
    cov = coverage(type(
        "T", (), {"nodes": [TypedNode("a", "ai.onnx", "Add", 13, {"T": "float"})]})(), table)
    assert cov.missing and "opsets [14, ]" in cov.missing[0][1]


def test_dtype_check_finds_a_cast_boundary_mismatch():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT16, [1, 4])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT16, [1, 4])
    out = helper.make_tensor_value_info("out", TensorProto.FLOAT16, [1, 4])
    nodes = [helper.make_node("Cast", ["x"], ["x32"], name="up", to=TensorProto.FLOAT),
             helper.make_node("Add", ["x32", "y"], ["out"], name="add")]
    model = helper.make_model(helper.make_graph(nodes, "g", [x, y], [out]), opset_imports=[helper.make_opsetid("", 20)])
    issues = type_graph(model).issues
    assert any("Add add" in i and "made by Cast 'up'" in i and "float16" in i for i in issues), issues
    # A Cast whose declared output type is not its `to`:
    nodes = [helper.make_node("Cast", ["x"], ["out"], name="down", to=TensorProto.FLOAT)]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], [out]), opset_imports=[helper.make_opsetid("", 20)])
    assert any("declared float16 but the node makes float" in i for i in type_graph(model).issues)


# ----------------------------------------------------------------------------- the fp32 decoder and GPU runs


def test_cuda_fp32_decoder_works_around_modelbuilder(tmp_path, tiny_ckpt):
    """ModelBuilder 0.18's packed Attention writes no present KV for cuda fp32: built with MultiHeadAttention."""
    from higgs_pack.exporters.checkpoint.models import write_qwen3_hf_dir
    from higgs_pack.exporters.onnx.modelbuilder import build_llm_decoder

    hf = write_qwen3_hf_dir(tiny_ckpt, tmp_path / "hf")
    result = build_llm_decoder(hf, tmp_path / "b" / "llm_decoder", precision="fp32", execution_provider="cuda",
                               cache_dir=tmp_path / "cache")
    assert result.options["workarounds"] and result.options["op_types"]["MultiHeadAttention"] == tiny_ckpt.constants.num_layers
    ort = import_ort()
    session = ort.InferenceSession(str(tmp_path / "b" / "llm_decoder" / "model.onnx"), providers=["CPUExecutionProvider"])
    assert {o.name for o in session.get_outputs()} >= {"hidden_states", "present.0.key", "present.1.value"}
    onnx.checker.check_model(str(tmp_path / "b" / "llm_decoder" / "model.onnx"), full_check=False)


EXEC = {"cuda": CUDA, "dml": DML, "winml": DML}
#: GPU provider -> (the skip's label, what makes the provider available).
HARDWARE = {"cuda": ("no CUDA GPU", "pip install onnxruntime-gpu on an NVIDIA machine"),
            "dml": ("no DirectML GPU", "onnxruntime-directml on Windows"),
            "winml": ("no DirectML GPU (Windows ML: Windows 11 24H2 or later, x64)", "onnxruntime-windowsml there")}


@pytest.mark.parametrize("ep", list(EXEC))
def test_gpu_check_is_skipped_with_the_hardware_named(request, ep):
    if EXEC[ep] in _available():
        pytest.skip(f"this machine has the GPU ({EXEC[ep]}); the skipped line cannot be shown")
    bundle = request.getfixturevalue(f"{ep}_fp16")
    report = VerifyReport(bundle=ep)
    check_gpu_provider(open_bundle(bundle), report)
    (line,) = report.checks
    assert line.ok is None and line.detail.startswith(HARDWARE[ep][0]) and f"{EXEC[ep]} not available" in line.detail
    strict = VerifyReport(bundle=ep)
    check_gpu_provider(open_bundle(bundle), strict, require=True)
    assert strict.checks[0].ok is False


@pytest.mark.gpu
@pytest.mark.parametrize("ep", list(EXEC))
def test_gpu_bundle_verifies_on_its_gpu(request, ep, cases_dir):
    label, fix = HARDWARE[ep]
    if EXEC[ep] not in _available():
        pytest.skip(f"{label}: {EXEC[ep]} not available ({fix})")
    bundle = request.getfixturevalue(f"{ep}_fp16")  # built only where its GPU is present
    report = verify_bundle(bundle, cases_dir=cases_dir, require_gpu=True)
    assert report.ok, report.render()


def test_plan_equals_manifest(cuda_fp16, dml_fp16, winml_fp16):
    from higgs_pack.targets.plan import make_plan, plan_mismatches

    for bundle in (cuda_fp16, dml_fp16, winml_fp16):
        m = read_manifest(bundle)
        assert plan_mismatches(make_plan(m["target"], m["precision"], m["variant"]), m["subparts"]) == []


# ------------------------------------------------------------------ the engine (issue 19)


def test_cuda_bundle_engine_takes_eight_rows_and_dml_is_refused_saying_why(cuda_fp16, dml_fp16):
    """CPU-side checks of batching a cuda bundle: its GroupQueryAttention decoder shares its KV
    buffers, so ``engine(max_batch=8)`` makes the batched decoder with the graph's float16 cache
    (here on the CPU provider, where the buffers are host memory; the device path's
    ``OrtValue`` buffers are run on the host in tests/test_engine.py).  A dml decoder (position_ids,
    a copied cache) is refused above batch 1, naming why; batch 1 runs everywhere."""
    import higgs_pack

    with higgs_pack.load(cuda_fp16, execution_provider="cpu") as tts:
        c = tts.pipeline.constants
        engine = tts.engine(max_batch=8, max_length=256)
        with engine:
            decoder = engine.decoder
            assert decoder.max_batch == 8 and decoder.kv_device == "cpu"
            assert {b.dtype for b in decoder.kv.values()} == {np.dtype(np.float16)}
            assert engine.kv_bytes_per_position == c.num_layers * 2 * c.num_key_value_heads * c.head_dim * 2
    with higgs_pack.load(dml_fp16, execution_provider="cpu") as tts:
        with pytest.raises(Exception, match=r"copies its cache every step \(a graph with position_ids"):
            tts.engine(max_batch=2)
        with tts.engine(max_batch=1) as engine:
            assert engine.max_batch == 1


@pytest.mark.gpu
def test_cuda_engine_serves_eight_concurrent_requests_on_the_gpu(cuda_fp16, capsys):
    """On an NVIDIA GPU: eight concurrent requests on eight rows whose KV buffers are in the
    GPU's memory; every request ends, and the agreement with its run alone is reported (fp16
    kernels may round differently with more rows)."""
    if EXEC["cuda"] not in _available():
        label, fix = HARDWARE["cuda"]
        pytest.skip(f"{label}: {EXEC['cuda']} not available ({fix})")
    from test_engine import EIGHT, codes_agreement, run_eight_concurrent

    import higgs_pack

    with higgs_pack.load(cuda_fp16) as tts:
        single = [tts.synthesize(text, seed=seed, max_frames=cap) for text, seed, cap in EIGHT]
        engine = tts.engine(max_batch=8)
        assert engine.decoder.kv_device == "cuda" and engine.decoder.kv == {}
        batched = run_eight_concurrent(tts, engine)
    same, total = codes_agreement(single, batched)
    with capsys.disabled():
        print(f"\ncuda fp16, 8 concurrent requests batched vs alone: {same}/{total} frames equal")

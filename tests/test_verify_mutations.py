"""The verifier against broken exports: mutate a correct bundle, re-hash it, and require failure.

Each mutation is an export bug a build could make (issue 8: a swapped pair of layers, a
wrong rope theta, a dropped q/k norm, a transposed projection, a wrong codebook offset in
the audio embedding, a codec weight scaled by 1.01; and MODEL.md's embedding scaled by
1.05, which cosine alone missed).  The files are re-hashed into the manifest, so the hash
check passes and only the numerical checks stand between the bug and the user.  The
unmutated bundles pass, at fp32 and at int4.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow

onnx = pytest.importorskip("onnx")
from onnx import numpy_helper  # noqa: E402

from higgs_pack.manifests.manifest import file_entry, read_manifest, write_manifest  # noqa: E402
from higgs_pack.runtime.sources.bundle import load_pipeline as load  # noqa: E402
from higgs_pack.runtime.sources.bundle import open_bundle  # noqa: E402
from higgs_pack.runtime.verification.backend_checks import compare_providers, device_parity  # noqa: E402
from higgs_pack.runtime.verification.report import VerifyReport  # noqa: E402
from higgs_pack.runtime.verification.verify import verify_bundle  # noqa: E402

DECODER = "llm_decoder/model.onnx"


def _load(bundle: Path, rel: str):
    return onnx.load(str(bundle / rel))


def _save(model, bundle: Path, rel: str) -> None:
    path = bundle / rel
    data = path.parent / f"{path.name}.data"
    if data.exists():
        data.unlink()
        onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                        location=data.name, size_threshold=0)
    else:
        onnx.save_model(model, str(path))
    manifest = read_manifest(bundle)
    manifest["files"] = [file_entry(bundle, f["path"]) for f in manifest["files"]]
    write_manifest(bundle, manifest)


def _initializer(model, name: str):
    return next(t for t in model.graph.initializer if t.name == name)


def _set(model, name: str, array: np.ndarray) -> None:
    _initializer(model, name).CopyFrom(numpy_helper.from_array(array.astype(np.float32), name))


def swap_layers(bundle: Path) -> None:
    """Layers 0 and 1 exchange their projection weights (every MatMul of the two layers)."""
    model = _load(bundle, DECODER)
    nodes = {n.name: n for n in model.graph.node if n.op_type in ("MatMul", "MatMulNBits")}
    for name, node in nodes.items():
        if name.startswith("/model/layers.0/"):
            other = nodes[name.replace("/model/layers.0/", "/model/layers.1/")]
            a, b = list(node.input[1:]), list(other.input[1:])
            del node.input[1:], other.input[1:]
            node.input.extend(b)
            other.input.extend(a)
    _save(model, bundle, DECODER)


def wrong_rope_theta(bundle: Path) -> None:
    """The rotary caches computed with theta 10,000 instead of the checkpoint's 1,000,000."""
    model = _load(bundle, DECODER)
    cos = numpy_helper.to_array(_initializer(model, "cos_cache"))
    positions, half = cos.shape
    inv_freq = 1.0 / (10_000.0 ** (np.arange(0, 2 * half, 2, dtype=np.float64) / (2 * half)))
    angles = np.outer(np.arange(positions), inv_freq)
    _set(model, "cos_cache", np.cos(angles))
    _set(model, "sin_cache", np.sin(angles))
    _save(model, bundle, DECODER)


def drop_qk_norm(bundle: Path) -> None:
    """Every q_norm and k_norm RMSNorm removed (its input wired straight through)."""
    model = _load(bundle, DECODER)
    drop = [n for n in model.graph.node if n.op_type == "SimplifiedLayerNormalization"
            and ("/q_norm/" in n.name or "/k_norm/" in n.name)]
    assert drop, "the decoder has no q/k norm nodes to drop"
    for node in drop:
        for consumer in model.graph.node:
            for i, name in enumerate(consumer.input):
                if name == node.output[0]:
                    consumer.input[i] = node.input[0]
        model.graph.node.remove(node)
    _save(model, bundle, DECODER)


def transpose_projection(bundle: Path) -> None:
    """Layer 0's o_proj weight transposed (square in the tiny model, so shapes still fit)."""
    model = _load(bundle, DECODER)
    name = "model.layers.0.attn.o_proj.MatMul.weight"
    weight = numpy_helper.to_array(_initializer(model, name))
    assert weight.shape[0] == weight.shape[1]
    _set(model, name, weight.T.copy())
    _save(model, bundle, DECODER)


def wrong_codebook_offset(bundle: Path) -> None:
    """Codebook c read from row ``codes + c*1025`` of the fused table instead of ``c*1026``."""
    model = _load(bundle, "audio_embed.onnx")
    for node in model.graph.node:
        if node.op_type == "Constant":
            value = numpy_helper.to_array(node.attribute[0].t)
            if value.ndim == 1 and value.size == 8 and value[1] == 1026:
                node.attribute[0].t.CopyFrom(numpy_helper.from_array(value // 1026 * 1025, node.attribute[0].t.name))
                break
    else:
        raise AssertionError("no codebook offset constant in audio_embed.onnx")
    _save(model, bundle, "audio_embed.onnx")


def scale_codec_weight(bundle: Path) -> None:
    """The codec decoder's first convolution weight x1.01."""
    model = _load(bundle, "audio_tokenizer.onnx")
    name = "acoustic_decoder.conv1.weight"
    _set(model, name, numpy_helper.to_array(_initializer(model, name)) * 1.01)
    _save(model, bundle, "audio_tokenizer.onnx")


def scale_stream_codec_weight(bundle: Path) -> None:
    """The streaming codec's first convolution weight x1.01 (its own copy of the codec's weights)."""
    model = _load(bundle, "audio_tokenizer_stream.onnx")
    name = "dac.conv1.weight"
    _set(model, name, numpy_helper.to_array(_initializer(model, name)) * 1.01)
    _save(model, bundle, "audio_tokenizer_stream.onnx")


def scale_text_embedding(bundle: Path) -> None:
    """The text embedding x1.05 (its float table, or its int4 block scales)."""
    model = _load(bundle, "text_embed.onnx")
    name = "weight" if any(t.name == "weight" for t in model.graph.initializer) else "weight_scales"
    _set(model, name, numpy_helper.to_array(_initializer(model, name)).astype(np.float32) * 1.05)
    _save(model, bundle, "text_embed.onnx")


def scale_final_norm(bundle: Path) -> None:
    """The decoder's final RMSNorm weight x1.05: every hidden state x1.05, its cosine still 1.0."""
    model = _load(bundle, DECODER)
    name = next(t.name for t in model.graph.initializer if "final_norm" in t.name)
    _set(model, name, numpy_helper.to_array(_initializer(model, name)) * 1.05)
    _save(model, bundle, DECODER)


MUTATIONS = {
    "swapped layers": (swap_layers, "parity llm_decoder"),
    "rope theta": (wrong_rope_theta, "parity llm_decoder"),
    "dropped q/k norm": (drop_qk_norm, "parity llm_decoder"),
    "transposed projection": (transpose_projection, "parity llm_decoder"),
    "codebook offset": (wrong_codebook_offset, "parity audio_embed"),
    "codec weight x1.01": (scale_codec_weight, "parity audio_tokenizer"),
    "stream codec weight x1.01": (scale_stream_codec_weight, "parity audio_tokenizer_stream"),
    "text embedding x1.05": (scale_text_embedding, "parity text_embed"),
}
#: Mutations that need a float weight to rewrite (int4 packs it).
FLOAT_ONLY = {"transposed projection"}


@pytest.fixture(params=["fp32", "int4"])
def correct_bundle(request, cpu_fp32_bundle, cpu_int4_bundle) -> Path:
    return cpu_fp32_bundle if request.param == "fp32" else cpu_int4_bundle


def test_correct_bundles_pass(correct_bundle):
    report = verify_bundle(correct_bundle, synthesize_cases=False)
    assert report.ok, report.render()
    parity = [c for c in report.checks if c.name.startswith("parity")]
    assert len(parity) == 7 and all(c.ok for c in parity)  # the six sub-parts and the streaming codec


@pytest.mark.parametrize("mutation", list(MUTATIONS))
def test_mutated_bundle_fails_its_parity_check(mutation, correct_bundle, tmp_path):
    precision = read_manifest(correct_bundle)["precision"]
    if mutation in FLOAT_ONLY and precision != "fp32":
        pytest.skip(f"{mutation}: int4 weights are packed; the build-time weight check covers it (next test)")
    bundle = Path(shutil.copytree(correct_bundle, tmp_path / correct_bundle.name))
    mutate, check = MUTATIONS[mutation]
    mutate(bundle)
    report = verify_bundle(bundle, synthesize_cases=False)
    failed = {c.name for c in report.checks if c.ok is False}
    assert check in failed, f"{mutation} at {precision} was not caught:\n{report.render()}"
    assert "files" not in failed  # re-hashed: the numbers caught it, not the hashes


@pytest.fixture(scope="module")
def scaled_decoder(cpu_fp32_bundle, tmp_path_factory) -> Path:
    """A copy of the fp32 bundle whose decoder outputs are x1.05 (:func:`scale_final_norm`)."""
    bundle = Path(shutil.copytree(cpu_fp32_bundle, tmp_path_factory.mktemp("scaled") / cpu_fp32_bundle.name))
    scale_final_norm(bundle)
    return bundle


def _cosine_would_pass(bundle: Path, checks) -> None:
    """Each check's cosine reaches the threshold: a cosine-only rule (the old GPU/NPU one) passed it."""
    threshold = read_manifest(bundle)["subparts"]["llm_decoder"]["parity"]["threshold"]
    assert checks and all(c.value >= threshold for c in checks), [(c.name, c.value) for c in checks]


def test_provider_comparison_judges_relative_l2(cpu_fp32_bundle, scaled_decoder):
    """The GPU-vs-CPU provider comparison with two CPU sessions standing in, one of a decoder x1.05."""
    report = VerifyReport(bundle="stand-in")
    compare_providers(open_bundle(cpu_fp32_bundle), load(scaled_decoder), load(cpu_fp32_bundle), report,
                      label="stand-in")
    decoder = [c for c in report.checks if "llm_decoder" in c.name]
    heads = [c for c in report.checks if "audio_heads" in c.name]
    _cosine_would_pass(cpu_fp32_bundle, decoder)
    assert len(decoder) == 3 and all(c.ok is False and "rel L2 0.05 (limit 0.01)" in c.detail for c in decoder), \
        report.render()
    assert heads and all(c.ok for c in heads)  # the audio heads read the same golden hidden states


def test_device_parity_judges_relative_l2(cpu_fp32_bundle, scaled_decoder):
    """The OpenVINO GPU/NPU parity check's judging, with CPU sessions of the decoder x1.05 standing in."""
    report = VerifyReport(bundle="stand-in")
    device_parity("GPU", open_bundle(cpu_fp32_bundle), load(scaled_decoder), report)
    checks = {c.name: c for c in report.checks}
    assert set(checks) == {f"GPU: parity {p}" for p in read_manifest(cpu_fp32_bundle)["subparts"]}
    _cosine_would_pass(cpu_fp32_bundle, [checks["GPU: parity llm_decoder"]])
    assert checks["GPU: parity llm_decoder"].ok is False
    assert "rel L2 0.05 (limit 0.01)" in checks["GPU: parity llm_decoder"].detail
    assert all(c.ok for n, c in checks.items() if n != "GPU: parity llm_decoder"), report.render()


def test_build_refuses_a_read_back_weight_that_is_not_its_tensor(cpu_int4_bundle, tiny_ckpt, tmp_path):
    """A misplaced layer in the exported graph fails the build's weight check (before any golden)."""
    from higgs_pack.errors import BuildError
    from higgs_pack.exporters.pytorch.golden import capture_golden

    bundle = Path(shutil.copytree(cpu_int4_bundle, tmp_path / "b"))
    swap_layers(bundle)
    subparts = {p: {k: s[k] for k in ("format", "entry", "precision")}
                for p, s in read_manifest(bundle)["subparts"].items()}
    with pytest.raises(BuildError, match=r"body\.layers\.0\..* differs from the checkpoint's by relative L2"):
        capture_golden(tiny_ckpt, tmp_path / "golden.npz", bundle_dir=bundle, subparts=subparts)

"""The cpu bundle's quantized KV cache (``higgs-pack build --kv-cache int8``): ModelBuilder's
``kv_cache_quant_scheme=int8_per_channel`` with scales from its ``kv_cache_calibration`` tool.

Real tiny bundles (tests/conftest.py): the int8-KV int4 bundle is built once per session and
compared with the float-KV int4 bundle of the same checkpoint.  Tolerances (measured on the
tiny model, AMD EPYC AVX-512, ONNX Runtime 1.32): the int8 cache moves the decoder's hidden
states by relative L2 0.002 (median) to 0.009 (worst) over a 72-position teacher-forced
sequence, and never changed a greedy code there; the tests allow 0.03 per position and 90%
code agreement.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from conftest import slow_fixture

from higgs_pack.errors import BuildError, BuildPlanError, ManifestError
from higgs_pack.exporters.onnx import kv_quantization as kv
from higgs_pack.manifests.model import SubPart
from higgs_pack.targets.plan import bundle_name, make_plan, plan_mismatches

#: Largest relative L2 difference of one position's hidden states, int8 vs float KV cache.
HIDDEN_REL_L2 = 0.03
#: Fewest frames whose 8 greedy codes (teacher-forced) equal the float KV cache's.
CODE_AGREEMENT = 0.9
DECODER = "llm_decoder/model.onnx"


@slow_fixture(scope="session")
def kv8_bundle(tmp_path_factory: pytest.TempPathFactory, tiny_checkpoint: Path) -> Path:
    """A cpu int4 bundle of the tiny checkpoint with an int8 KV cache (~3 min on 2 cores)."""
    from higgs_pack.targets.build import build

    out = tmp_path_factory.mktemp("bundle-cpu-int4-kv8") / "higgs-audio-v3-tiny-cpu-int4-kv-int8"
    return build("cpu", precision="int4", kv_cache="int8", model=tiny_checkpoint, out=out)


@pytest.fixture(scope="module")
def kv8(kv8_bundle):
    from higgs_pack.runtime.sources.bundle import load_pipeline as load

    return load(kv8_bundle)


@pytest.fixture(scope="module")
def float_kv(cpu_int4_bundle):
    from higgs_pack.runtime.sources.bundle import load_pipeline as load

    return load(cpu_int4_bundle)


# -- the choice and the plan (no build) -----------------------------------------------------


def test_calibration_corpus_is_the_cases_texts(cases_dir):
    """The fixed calibration corpus is the project's cases texts, as the files hold them."""
    for name, text in kv.CALIBRATION_TEXTS.items():
        assert (cases_dir / f"{name}.txt").read_text(encoding="utf-8").strip() == text


def test_the_plan_records_the_kv_cache_and_names_the_bundle():
    plan = make_plan("cpu", "int4", kv_cache="int8")
    row = {r.subpart: r for r in plan.rows}[SubPart.LLM_DECODER]
    assert plan.kv_cache == "int8" and row.options["kv_cache"] == "int8"
    assert row.quantization["kv_cache"] == kv.planned_record("int8") == {
        "precision": "int8", "dtype": "int8", "scheme": "int8_per_channel", "calibration": kv.calibration_record()}
    assert row.quantization["block_size"] == 128  # the int4 settings stay planned beside it
    assert row.passes[0].startswith("ModelBuilder kv_cache_calibration(int8_per_channel")
    assert "kv_cache_quant_scheme=int8_per_channel" in row.passes[1]
    assert "KV cache int8" in plan.render()
    default = make_plan("cpu", "int4")
    assert default.kv_cache == default.target.default_kv_cache
    assert bundle_name("m", plan) == ("m-cpu-int4" if plan.kv_cache == default.kv_cache else "m-cpu-int4-kv-int8")
    assert bundle_name("m", make_plan("cpu", "int4", kv_cache="float")).endswith(
        "-cpu-int4" if default.kv_cache == "float" else "-cpu-int4-kv-float")
    # Other targets keep their float KV cache; openvino's is not a build choice.
    assert make_plan("cuda", "fp16").kv_cache == "float" and make_plan("openvino", "int4").kv_cache is None


@pytest.mark.parametrize(("target", "kv_cache", "allowed"), [
    ("cpu", "int4", "float, int8"), ("cpu", "fp8", "float, int8"), ("cuda", "int8", "float"),
    ("openvino", "int8", "none"),
])
def test_the_plan_refuses_a_kv_cache_the_target_does_not_offer(target, kv_cache, allowed):
    with pytest.raises(BuildPlanError, match=rf"target '{target}' does not offer KV cache '{kv_cache}'; "
                                             rf"it offers {allowed}.*--kv-cache"):
        make_plan(target, kv_cache=kv_cache)


def test_plan_mismatches_name_a_kv_cache_other_than_planned():
    int8 = make_plan("cpu", "fp32", kv_cache="int8")
    flt = make_plan("cpu", "fp32", kv_cache="float")
    record = kv.planned_record("int8")
    built = {r.subpart.value: {"exporter": r.exporter.name, "passes": list(r.passes), "precision": r.precision,
                               "quantization": dict(r.quantization)} for r in flt.rows}
    assert plan_mismatches(flt, built) == []
    built["llm_decoder"]["quantization"]["kv_cache"] = record
    assert plan_mismatches(flt, built, [SubPart.LLM_DECODER]) == [
        f"llm_decoder: quantization kv_cache={record!r}, planned a float KV cache"]
    built["llm_decoder"]["quantization"] = {}
    built["llm_decoder"]["passes"] = list({r.subpart: r for r in int8.rows}[SubPart.LLM_DECODER].passes)
    assert plan_mismatches(int8, built, [SubPart.LLM_DECODER]) == [
        f"llm_decoder: quantization kv_cache=None, planned {record!r}"]


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"kv_cache": "int4"}, r"unknown KV cache 'int4'.*float, int8"),
    ({"kv_cache": "int8", "execution_provider": "cuda"}, r"kv_cache='int8' is built for execution provider\(s\) cpu"),
    ({"extra_options": {"kv_cache_quant_scheme": "int8_per_tensor"}},
     r"\['kv_cache_quant_scheme'\] are set by the build from kv_cache="),
])
def test_the_exporter_refuses_kv_cache_requests_before_any_work(tmp_path, kwargs, message):
    """Bad requests are refused before ModelBuilder runs (the folders stay empty)."""
    from higgs_pack.exporters.onnx.modelbuilder import build_llm_decoder

    args = {"precision": "fp32", "execution_provider": "cpu", "cache_dir": tmp_path / "cache", **kwargs}
    with pytest.raises(BuildPlanError, match=message):
        build_llm_decoder(tmp_path / "hf", tmp_path / "bundle" / "llm_decoder", **args)
    assert not (tmp_path / "cache").exists() and not (tmp_path / "bundle").exists()


# -- a real int8-KV bundle ------------------------------------------------------------------


def test_manifest_records_the_kv_cache(kv8_bundle):
    from higgs_pack.manifests.manifest import read_manifest

    m = read_manifest(kv8_bundle)
    decoder = m["subparts"]["llm_decoder"]
    assert m["kv_cache"] == "int8" and m["precision"] == "int4"
    assert decoder["quantization"]["kv_cache"] == kv.planned_record("int8")
    rule = decoder["parity"]["kv_cache"]
    assert rule["reference"] == "matched"  # int4 weights: the oracle with the bundle's weights
    assert rule["measured"] >= rule["threshold"] and rule["rel_l2"] <= rule["max_rel_l2"]
    calibration = decoder["options"]["kv_cache_calibration"]
    assert calibration["calibration"]["tokens"] == kv.CALIBRATION["target_seq"] * kv.CALIBRATION["num_seqs"]
    assert calibration["baseline"]["peak_rss_mb"] > 0 and calibration["calibration"]["peak_rss_mb"] > 0
    assert "kv_cache_scale_file" not in decoder["options"]["extra_options"]  # a scratch path is not recorded
    kv_inputs = [t for t in decoder["inputs"] if t["name"].startswith("past_key_values.")]
    assert kv_inputs and {t["dtype"] for t in kv_inputs} == {"int8"}


def test_the_schema_refuses_an_unknown_kv_cache(kv8_bundle, tmp_path):
    from higgs_pack.manifests.manifest import read_manifest

    copy = Path(shutil.copytree(kv8_bundle, tmp_path / "b"))
    data = json.loads((copy / "manifest.json").read_text())
    data["kv_cache"] = "int4"
    (copy / "manifest.json").write_text(json.dumps(data))
    with pytest.raises(ManifestError, match="kv_cache"):
        read_manifest(copy)


def test_the_session_takes_int8_kv_and_the_decoder_binds_int8_buffers(kv8):
    decoder = kv8.decoder
    kv_inputs = [i for i in decoder.session.get_inputs() if i.name.startswith("past_key_values.")]
    assert kv_inputs and {i.type for i in kv_inputs} == {"tensor(int8)"}
    assert decoder.shared_kv
    decoder.reset()
    decoder.forward(np.zeros((1, 3, kv8.constants.hidden_size), np.float32))
    assert {buffer.dtype for buffer in decoder._kv_host.values()} == {np.dtype(np.int8)}


def _prompt(pipeline) -> np.ndarray:
    from higgs_pack.runtime.loop.prompt import build_prompt

    return build_prompt(pipeline, kv.CALIBRATION_TEXTS["ref_en_16k"])


def _teacher_forced(reference, other, frames: int = 64):
    """Both decoders on one prompt, then ``frames`` frames of the reference's greedy codes fed
    back through its audio embedding: the hidden states (one array per position) of each."""
    prompt = _prompt(reference)
    outs: list[list[np.ndarray]] = [[], []]
    for i, p in enumerate((reference, other)):
        p.decoder.reset()
        outs[i].append(p.decoder.forward(prompt)[:, -1:])
    for _ in range(frames):
        logits = reference.audio_heads.run({"hidden_states": outs[0][-1]})["audio_logits"]
        codes = logits.argmax(axis=-1).astype(np.int64).reshape(1, 1, -1)
        embed = reference.audio_embed.run({"codes": codes})["audio_embeds"].copy()
        for i, p in enumerate((reference, other)):
            outs[i].append(p.decoder.forward(embed))
    return outs


def test_hidden_states_and_codes_agree_with_the_float_kv_bundle(kv8, float_kv):
    """Teacher-forced on a case text and 64 frames, every position's hidden states lie within
    :data:`HIDDEN_REL_L2` of the float KV cache's, and the greedy codes agree on at least
    :data:`CODE_AGREEMENT` of the frames."""
    from higgs_pack.runtime.verification.report import rel_l2

    want, got = _teacher_forced(float_kv, kv8)
    errors = [rel_l2(a, b) for a, b in zip(want, got, strict=True)]
    assert max(errors) <= HIDDEN_REL_L2, errors
    assert max(errors) > 0  # the int8 cache is really in use

    def codes(h):
        return float_kv.audio_heads.run({"hidden_states": h})["audio_logits"].argmax(axis=-1)

    same = [np.array_equal(codes(a), codes(b)) for a, b in zip(want, got, strict=True)]
    assert np.mean(same) >= CODE_AGREEMENT, same


def test_synthesize_runs_on_the_int8_kv_bundle(kv8, float_kv):
    from higgs_pack.runtime.loop.synthesis import synthesize
    from higgs_pack.runtime.options import SamplingOptions

    text = kv.CALIBRATION_TEXTS["text_en_basic"]
    out = synthesize(kv8, text, options=SamplingOptions(seed=0), max_frames=48)
    assert out.samples.size > 0 and np.isfinite(out.samples).all()
    assert out.codes.shape[1] == kv8.constants.num_codebooks
    assert ((out.codes >= 0) & (out.codes < kv8.constants.codebook_size)).all()
    # Greedy codes: the first frames agree with the float KV cache's (free-running decoding
    # parts for good at the first flip, so only a prefix is asked for).
    greedy = SamplingOptions(temperature=0.0, repeat_guard_frames=0)
    a = synthesize(float_kv, text, options=greedy, max_frames=24).codes
    b = synthesize(kv8, text, options=greedy, max_frames=24).codes
    n = min(len(a), len(b))
    assert n and np.array_equal(a[:8], b[:8]), (a[:8], b[:8])


def test_batched_rows_at_their_own_lengths_give_separate_runs(kv8):
    """The batched decoder on the int8 graph binds int8 buffers, and rows at their own lengths
    (prompts of 5, 9 and 3 on rows 0, 2, 3; row 1 a hole) give each row's batch-1 hidden states."""
    from higgs_pack.runtime.backends.onnxruntime.batched import BatchedOrtDecoder

    c = kv8.constants
    batched = BatchedOrtDecoder(kv8.decoder.session, max_batch=4, max_length=64, kv_heads=c.num_key_value_heads,
                                head_dim=c.head_dim)
    assert {b.dtype for b in batched.kv.values()} == {np.dtype(np.int8)}
    rng = np.random.default_rng(3)
    prompts = [rng.standard_normal((1, n, c.hidden_size)).astype(np.float32) for n in (5, 9, 3)]
    feeds = [rng.standard_normal((20, 1, 1, c.hidden_size)).astype(np.float32) for _ in prompts]
    rows = np.array([0, 2, 3])
    together = [[batched.prefill(int(r), p)] for r, p in zip(rows, prompts, strict=True)]
    for t in range(20):
        out = batched.step(rows, np.concatenate([f[t] for f in feeds]))
        for i in range(3):
            together[i].append(out[i:i + 1])
    single = kv8.decoder
    for prompt, steps, got in zip(prompts, feeds, together, strict=True):
        single.reset()
        expected = [single.forward(prompt)] + [single.forward(x) for x in steps]
        for a, b in zip(expected, got, strict=True):
            np.testing.assert_allclose(b, a, rtol=0, atol=1e-5)


def test_verify_passes_the_int8_kv_bundle(kv8_bundle):
    from higgs_pack.runtime.verification.verify import verify_bundle

    report = verify_bundle(kv8_bundle)
    assert report.ok, report.render()
    line = next(c for c in report.checks if c.name == "parity llm_decoder KV cache")
    assert line.ok and "int8_per_channel" in line.detail
    assert report.parity["llm_decoder"]["kv_cache"]["rel_l2"] > 0


def _scale_kv_scales(bundle: Path, factor: float, layer: int | None = None) -> list[str]:
    """Multiply the decoder graph's KV scale initializers by ``factor`` (all layers, or one),
    rewrite the graph file (its external data untouched) and re-hash the manifest, as a build
    that wrote wrong scales would leave it.  Returns the initializers changed."""
    import onnx
    from onnx import numpy_helper

    from higgs_pack.manifests.manifest import file_entry, read_manifest, write_manifest
    from higgs_pack.runtime.verification.kv_parity import K_SCALE_INPUT, V_SCALE_INPUT

    path = bundle / DECODER
    model = onnx.load(str(path), load_external_data=False)
    names = []
    for node in (n for n in model.graph.node if n.op_type == "GroupQueryAttention"):
        if layer is None or node.input[3] == f"past_key_values.{layer}.key":
            names += [node.input[K_SCALE_INPUT], node.input[V_SCALE_INPUT]]
    inline = False
    for tensor in model.graph.initializer:
        if tensor.name not in names:
            continue
        if tensor.data_location == onnx.TensorProto.EXTERNAL:  # float32 bytes in the external data file
            where = {e.key: e.value for e in tensor.external_data}
            with (path.parent / where["location"]).open("r+b") as data:
                data.seek(int(where["offset"]))
                values = np.frombuffer(data.read(int(where["length"])), np.float32) * np.float32(factor)
                data.seek(int(where["offset"]))
                data.write(values.astype(np.float32).tobytes())
        else:
            tensor.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(tensor) * np.float32(factor), tensor.name))
            inline = True
    if inline:
        onnx.save_model(model, str(path))
    manifest = read_manifest(bundle)
    manifest["files"] = [file_entry(bundle, f["path"]) for f in manifest["files"]]
    write_manifest(bundle, manifest)
    return names


@pytest.mark.parametrize(("factor", "layer"), [(10.0, None), (0.1, None), (10.0, 1)])
def test_verify_catches_wrong_kv_scales(kv8_bundle, tmp_path, factor, layer):
    """Scales x10 (coarse steps), /10 (values clipped at +-127) in every layer, or x10 in one
    layer: the KV cache check fails, naming the scheme and its error."""
    from higgs_pack.runtime.verification.verify import verify_bundle

    copy = Path(shutil.copytree(kv8_bundle, tmp_path / kv8_bundle.name))
    assert _scale_kv_scales(copy, factor, layer)
    report = verify_bundle(copy)
    line = next(c for c in report.checks if c.name == "parity llm_decoder KV cache")
    assert line.ok is False and not report.ok, report.render()
    assert "int8_per_channel" in line.detail and "rel L2" in line.detail


def test_verify_refuses_a_float_graph_recorded_as_int8(kv8_bundle, cpu_int4_bundle, tmp_path):
    """A bundle whose manifest says int8 KV but whose decoder graph is the float one: the decoder
    I/O check names the dtype, and the KV cache check fails."""
    from higgs_pack.manifests.manifest import file_entry, read_manifest, write_manifest
    from higgs_pack.runtime.verification.verify import verify_bundle

    copy = Path(shutil.copytree(kv8_bundle, tmp_path / kv8_bundle.name))
    shutil.rmtree(copy / "llm_decoder")
    shutil.copytree(cpu_int4_bundle / "llm_decoder", copy / "llm_decoder")
    manifest = read_manifest(copy)
    manifest["subparts"]["llm_decoder"]["inputs"] = read_manifest(cpu_int4_bundle)["subparts"]["llm_decoder"]["inputs"]
    manifest["subparts"]["llm_decoder"]["outputs"] = read_manifest(cpu_int4_bundle)["subparts"]["llm_decoder"]["outputs"]
    manifest["files"] = [file_entry(copy, f["path"]) for f in manifest["files"]]
    write_manifest(copy, manifest)
    report = verify_bundle(copy)
    checks = {c.name: c for c in report.checks}
    assert checks["decoder I/O"].ok is False and "KV cache int8" in checks["decoder I/O"].detail
    assert checks["parity llm_decoder KV cache"].ok is False
    assert "float" in checks["parity llm_decoder KV cache"].detail


@pytest.mark.slow
def test_a_decoder_built_with_another_kv_cache_than_planned_is_refused(tmp_path, tiny_checkpoint, monkeypatch):
    """The plan says int8; the decoder exporter is handed float (the option removed after
    planning), so ModelBuilder really writes a float KV cache: the build names the difference
    and keeps nothing."""
    from higgs_pack.targets import build as build_module

    def mutated_plan(*args, **kwargs):
        plan = make_plan(*args, **kwargs)
        rows = tuple(replace(r, options={k: v for k, v in r.options.items() if k != "kv_cache"})
                     if r.subpart == SubPart.LLM_DECODER else r for r in plan.rows)
        return replace(plan, rows=rows)

    monkeypatch.setattr(build_module, "make_plan", mutated_plan)
    out, work = tmp_path / "dist" / "b", tmp_path / "work"
    work.mkdir()
    with pytest.raises(BuildError, match=r"did not build what the plan says.*llm_decoder: passes .*"
                                         r"llm_decoder: quantization kv_cache=None, planned \{'precision': 'int8'"):
        build_module.build("cpu", precision="fp32", kv_cache="int8", model=tiny_checkpoint, out=out, work_dir=work)
    assert not out.exists() and list(work.iterdir()) == []

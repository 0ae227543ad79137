"""The ONNX Runtime decoder's KV cache: one preallocated buffer per layer bound as both past and
present (IOBinding, GroupQueryAttention shares it) against the plain path that copies the cache
in and out every step. Same hidden states, same codes."""

from __future__ import annotations

import numpy as np
import pytest

from higgs_pack.errors import InputError
from higgs_pack.runtime.backends.onnxruntime import runners
from higgs_pack.runtime.backends.onnxruntime import sessions as ort_backend
from higgs_pack.runtime.backends.onnxruntime.runners import OrtDecoder, OrtSubPart
from higgs_pack.runtime.loop.synthesis import synthesize
from higgs_pack.runtime.options import SamplingOptions
from higgs_pack.runtime.sources.bundle import load_pipeline as load


@pytest.fixture(scope="module")
def pipeline(cpu_int4_bundle):
    return load(cpu_int4_bundle)


def _twin(decoder: OrtDecoder, shared: bool) -> OrtDecoder:
    return OrtDecoder(decoder.session, max_length=decoder.max_length, kv_heads=decoder._kv_heads,
                      head_dim=decoder._head_dim, shared_kv=shared)


def test_cpu_decoder_shares_its_kv_buffers_by_default(pipeline):
    assert pipeline.decoder.shared_kv


def test_shared_buffers_give_the_hidden_states_of_the_copying_path(pipeline, monkeypatch):
    # A small first buffer, so that growing it (with a copy of the used rows) is exercised too.
    monkeypatch.setattr(runners, "INITIAL_KV_CAPACITY", 8)
    shared, copies = _twin(pipeline.decoder, True), _twin(pipeline.decoder, False)
    rng = np.random.default_rng(0)
    h = pipeline.constants.hidden_size
    feeds = [rng.standard_normal((1, 5, h)).astype(np.float32)]
    feeds += [rng.standard_normal((1, 1, h)).astype(np.float32) for _ in range(20)]
    for _ in range(2):  # the second round reuses the buffers after reset()
        shared.reset()
        copies.reset()
        for x in feeds:
            a, b = shared.forward(x), copies.forward(x)
            assert a.dtype == np.float32 and a.shape == x.shape
            np.testing.assert_array_equal(a, b)
    assert shared._capacity == 32  # 8 -> 16 -> 32 for 25 positions


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_codes_identical_to_the_copying_path(pipeline, temperature):
    options = SamplingOptions(temperature=temperature, seed=4)
    shared = synthesize(pipeline, "Same codes either way.", options=options, max_frames=200)
    original = pipeline.decoder
    pipeline.decoder = _twin(original, False)
    try:
        copies = synthesize(pipeline, "Same codes either way.", options=options, max_frames=200)
    finally:
        pipeline.decoder = original
    assert np.array_equal(shared.codes, copies.codes)
    assert [r.stop_reason for r in shared.chunks] == [r.stop_reason for r in copies.chunks]


def test_shared_decoder_refuses_more_than_max_length(pipeline):
    decoder = _twin(pipeline.decoder, True)
    decoder.max_length = 6
    decoder.forward(np.zeros((1, 5, pipeline.constants.hidden_size), np.float32))
    decoder.forward(np.zeros((1, 1, pipeline.constants.hidden_size), np.float32))
    with pytest.raises(InputError, match="more than max_length=6"):
        decoder.forward(np.zeros((1, 1, pipeline.constants.hidden_size), np.float32))


def test_cuda_shared_buffers_live_on_the_device(cpu_int4_bundle):
    ort = ort_backend.import_ort()
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("needs an NVIDIA GPU with onnxruntime-gpu (CUDAExecutionProvider); this machine has none")
    from higgs_pack.runtime.sources.bundle import open_bundle

    bundle = open_bundle(cpu_int4_bundle)
    m = bundle.manifest
    session, _ = ort_backend.create_session(bundle.file(m["subparts"]["llm_decoder"]["entry"]), "cuda")
    c = m["constants"]
    shared = OrtDecoder(session, max_length=64, kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"])
    copies = OrtDecoder(session, max_length=64, kv_heads=c["num_key_value_heads"], head_dim=c["head_dim"],
                        shared_kv=False)
    assert shared.shared_kv and shared._device == "cuda"
    rng = np.random.default_rng(1)
    for x in [rng.standard_normal((1, 4, c["hidden_size"])).astype(np.float32)] + \
            [rng.standard_normal((1, 1, c["hidden_size"])).astype(np.float32) for _ in range(6)]:
        np.testing.assert_allclose(shared.forward(x), copies.forward(x), atol=1e-5)
    assert all(v.device_name().lower() == "cuda" for v in shared._kv.values())


# ------------------------------------------------------------------ heads and embed: per-step IOBinding

def _plain(runner: OrtSubPart) -> OrtSubPart:
    return OrtSubPart(runner.session, runner.name)  # no step shapes: every call is a plain run


def test_heads_and_embed_bind_their_step_shapes_and_give_the_plain_outputs(pipeline):
    c = pipeline.constants
    rng = np.random.default_rng(2)
    cases = {
        "audio_heads": ("hidden_states", lambda s: rng.standard_normal((1, s, c.hidden_size)).astype(np.float32)),
        "audio_embed": ("codes", lambda s: rng.integers(0, c.audio_vocab_size, (1, s, c.num_codebooks))),
    }
    for part, (name, draw) in cases.items():
        bound = getattr(pipeline, part)
        fresh = OrtSubPart(bound.session, part, {name: (1, 1, bound_shape(part, c))})
        plain = _plain(bound)
        assert not fresh.bound
        kept = []
        for x in [draw(1) for _ in range(4)]:
            got, want = fresh.run({name: x}), plain.run({name: x})
            assert fresh.bound  # the first step-shaped call made the buffers
            for key in want:
                assert got[key].dtype == want[key].dtype and got[key].shape == want[key].shape
                np.testing.assert_array_equal(got[key], want[key])
            kept.append(got)
        # Ownership: once bound, per-step outputs are views of one buffer, overwritten by the next
        # step (the first call, which made the buffers, returned arrays of its own).
        key = next(iter(kept[0]))
        assert np.shares_memory(kept[1][key], kept[-1][key])
        assert not np.shares_memory(kept[0][key], kept[-1][key])
        # Other shapes (a prompt) are plain runs with arrays of their own.
        wide = draw(3)
        got, want = fresh.run({name: wide}), plain.run({name: wide})
        for key in want:
            np.testing.assert_array_equal(got[key], want[key])
            assert not np.shares_memory(got[key], kept[-1][key])


def bound_shape(part: str, c) -> int:
    return c.hidden_size if part == "audio_heads" else c.num_codebooks


def test_loaded_cpu_bundle_binds_heads_and_embed(pipeline):
    synthesize(pipeline, "Bound.", options=SamplingOptions(seed=1), max_frames=12)
    assert pipeline.audio_heads.bound and pipeline.audio_embed.bound


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_codes_identical_with_and_without_heads_embed_binding(pipeline, temperature):
    options = SamplingOptions(temperature=temperature, seed=5)
    text = "Binding changes no code."
    bound = synthesize(pipeline, text, options=options, max_frames=120)
    heads, embed = pipeline.audio_heads, pipeline.audio_embed
    pipeline.audio_heads, pipeline.audio_embed = _plain(heads), _plain(embed)
    try:
        plain = synthesize(pipeline, text, options=options, max_frames=120)
    finally:
        pipeline.audio_heads, pipeline.audio_embed = heads, embed
    assert heads.bound and embed.bound
    assert np.array_equal(bound.codes, plain.codes) and len(bound.codes) > 8
    np.testing.assert_array_equal(bound.samples, plain.samples)
    assert [r.stop_reason for r in bound.chunks] == [r.stop_reason for r in plain.chunks]


def test_low_memory_decoder_reads_weights_in_place_and_computes_the_same(cpu_fp32_bundle):
    """``load(low_memory=True)`` (the build's verification): the fp32 decoder keeps no packed
    copy, reads its weights from the mapped external data, gives the pages back after every
    step, and returns the hidden states of a normally loaded decoder: the prompt bit for bit,
    the one-position steps within a few float32 ulps (without packed weights MLAS takes its
    other single-row path; 2.4e-7 at most measured here)."""
    import gc
    import sys

    from higgs_pack.runtime.machine.mapped_pages import file_mappings, resident_bytes

    if not sys.platform.startswith("linux"):
        pytest.skip("/proc/self/smaps and madvise are Linux's")
    data = cpu_fp32_bundle / "llm_decoder" / "model.onnx.data"
    lean = load(cpu_fp32_bundle, low_memory=True)
    assert lean.decoder.page_out_weights == (data,)
    h = lean.constants.hidden_size
    rng = np.random.default_rng(5)
    feeds = [rng.standard_normal((1, 6, h)).astype(np.float32)]
    feeds += [rng.standard_normal((1, 1, h)).astype(np.float32) for _ in range(12)]
    got = []
    for x in feeds:
        got.append(lean.decoder.forward(x))
        assert resident_bytes(data) < data.stat().st_size / 4, "the decoder's weight pages stayed resident"
    mapped = sum(n for _, n in file_mappings(data))
    assert mapped >= data.stat().st_size / 2, f"only {mapped} of {data.stat().st_size} bytes read in place"
    del lean
    gc.collect()
    normal = load(cpu_fp32_bundle)
    assert normal.decoder.page_out_weights == ()
    want = [normal.decoder.forward(x) for x in feeds]
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_allclose(np.concatenate(got, axis=1), np.concatenate(want, axis=1), rtol=1e-5, atol=1e-6)


def test_low_memory_leaves_quantized_decoders_as_built(pipeline, cpu_int4_bundle):
    """An int4 decoder's MatMulNBits weights are read in place already: low_memory changes
    nothing (parity stays measured on the kernels users run)."""
    lean = load(cpu_int4_bundle, low_memory=True)
    assert lean.decoder.page_out_weights == () and pipeline.decoder.page_out_weights == ()


def test_sessions_spin_within_a_run_and_stop_after_it_unless_the_manifest_says_otherwise():
    """Every session spins between its own operators and stops when its run ends (the
    decoder, heads and embed sessions take turns every frame); a manifest entry wins."""
    from higgs_pack.runtime.backends.onnxruntime.sessions import session_options_for

    so = session_options_for("cpu", {})
    assert so.get_session_config_entry("session.intra_op.allow_spinning") == "1"
    assert so.get_session_config_entry("session.force_spinning_stop") == "1"
    so = session_options_for("cpu", {"session.intra_op.allow_spinning": 0})
    assert so.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    assert so.get_session_config_entry("session.force_spinning_stop") == "1"


def test_the_decoder_session_does_not_spin(pipeline):
    """The loaded decoder's workers do not spin (a prefill's long operators, issue 32: sessions.
    DECODER_THREAD_POOL); the heads keep the spinning defaults."""
    decoder = pipeline.decoder.session.get_session_options()
    assert decoder.get_session_config_entry("session.intra_op.allow_spinning") == "0"
    heads = pipeline.audio_heads.session.get_session_options()
    assert heads.get_session_config_entry("session.intra_op.allow_spinning") == "1"


def test_the_streaming_codec_session_leaves_the_decoder_cores(pipeline, monkeypatch):
    """The streaming codec (it runs beside the decoder) gets half the CPUs this process may use,
    at least one (sessions.stream_codec_thread_pool); the one-shot codec keeps ONNX Runtime's
    default (0: one worker per core)."""
    import os

    from higgs_pack.runtime.backends.onnxruntime.sessions import stream_codec_thread_pool

    cpus = len(os.sched_getaffinity(0))
    stream = pipeline.audio_tokenizer_stream.session.get_session_options()
    assert stream.intra_op_num_threads == max(1, cpus // 2)
    assert pipeline.audio_tokenizer.session.get_session_options().intra_op_num_threads == 0
    for seen, threads in ((1, 1), (2, 1), (3, 1), (16, 8)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _pid, n=seen: set(range(n)))
        assert stream_codec_thread_pool() == {"intra_op_num_threads": threads}

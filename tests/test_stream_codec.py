"""The stateful streaming codec (sub-part ``audio_tokenizer_stream``, issue 31 item 1): the torch
stream module against one-shot decoding of the real tiny codec, its lookahead table, the bundle's
exported graph (rows batched, calls of any size), a bundle built before it (windows and a notice),
and streaming through the engine's codec thread with its steps batched."""

from __future__ import annotations

import itertools
import json
import logging
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from higgs_pack.exporters.pytorch.modules import build_modules
from higgs_pack.exporters.pytorch.stream_codec import (
    StreamCodecDecoder,
    measured_stream,
    torch_runner,
)
from higgs_pack.manifests.manifest import FORMAT_VERSION, file_entry, read_manifest, write_manifest
from higgs_pack.manifests.model import SubPart
from higgs_pack.runtime.loop.stateful_codec import (
    OPEN_END,
    StatefulCodec,
    StreamCodecSpec,
    runner_step,
    stream_decode,
)
from higgs_pack.runtime.verification.report import rel_l2

STREAM = SubPart.AUDIO_TOKENIZER_STREAM


@pytest.fixture(scope="module")
def stream_module(tiny_ckpt) -> StreamCodecDecoder:
    return build_modules(tiny_ckpt, [STREAM])[STREAM]


def one_shot(module: StreamCodecDecoder, codes: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return module.one_shot(torch.from_numpy(np.ascontiguousarray(codes.T[None]))).numpy().reshape(-1)


def random_codes(frames: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1024, (frames, 8), dtype=np.int64)


@pytest.mark.parametrize("sizes", [[1], [4, 9], [30]], ids=str)
def test_stream_equals_one_shot_whatever_the_call_sizes(stream_module, sizes):
    """Exact lookahead: every frame decoded once, the joined audio equal to one pass (float rounding)."""
    codes = random_codes(27)
    spec = StreamCodecSpec.from_options(stream_module.options(), 960)
    got = stream_decode(runner_step(torch_runner(stream_module)), spec, codes, itertools.cycle(sizes))
    want = one_shot(stream_module, codes)
    assert got.shape == want.shape
    assert rel_l2(want, got) < 1e-5 and float(np.abs(got - want).max()) < 1e-5


def test_the_published_layout_needs_ten_frames(stream_module):
    """DAC's decoder (strides 8,5,4,2,3, kernel-7 convolutions dilated 1,3,9): 9458 samples of delay,
    10 frames, as audio.cpp's 10-frame lookahead (SPEECH-AT-LENGTH.md)."""
    assert stream_module.delay_samples == 9458 and stream_module.exact_frames == 10
    spec = StreamCodecSpec.from_options(stream_module.options(), 960)
    assert spec.first_frames == 11 and spec.pad_frames == 10  # first audio 1 frame past the lookahead


def test_a_stream_codec_first_returns_its_first_chunk_once_the_lookahead_past_it_arrived(stream_module):
    """The first call returns the schedule's first size of audio (issue 37: it returned one frame
    whatever first_chunk_frames said), made once that many frames and the lookahead have arrived."""
    spec = StreamCodecSpec.from_options(stream_module.options(), 960)
    codec = StatefulCodec(runner_step(torch_runner(stream_module)), spec, itertools.chain([3], itertools.repeat(2)),
                          feed_frames=None)
    out = [codec.push(frame) for frame in random_codes(17)]
    assert all(o is None for o in out[:12]) and out[12] is not None
    assert len(out[12]) == 3 * 960  # one call for the first 13 frames: 3 frames of audio, 10 of lookahead
    assert out[13] is None and len(out[14]) == 2 * 960 and out[15] is None and len(out[16]) == 2 * 960
    assert codec.calls == 3  # then 2 a call
    single = StatefulCodec(runner_step(torch_runner(stream_module)), spec, itertools.repeat(1), feed_frames=None)
    first = [single.push(frame) for frame in random_codes(11)]
    assert first[:10] == [None] * 10 and len(first[10]) == 960  # the earliest audio: 1 frame past the lookahead
    with pytest.raises(ValueError, match="do not start with the frames streamed"):
        codec.finish(random_codes(17, seed=1))


def test_a_stream_codec_feeds_its_frames_before_the_chunk_is_due(stream_module):
    """Fed 4 frames at a time (FEED_FRAMES), the codec has decoded all but the last frames when a
    chunk is due: the chunks are those of one call per chunk, the same audio within float rounding,
    and only the call that makes the first chunk says ``first_audio`` (what the engine's hold
    waits on)."""
    spec = StreamCodecSpec.from_options(stream_module.options(), 960)
    run, calls = runner_step(torch_runner(stream_module)), []

    def step(codes, start, end, state, first_audio=False):
        calls.append((start, len(codes), first_audio))
        return run(codes, start, end, state)

    codes = random_codes(31)
    sizes = [10, 20, 40]  # the default schedule's first chunks: due at 20 (10 + lookahead) and 40 frames
    fed = StatefulCodec(step, spec, iter(sizes), feed_frames=4)
    once = StatefulCodec(runner_step(torch_runner(stream_module)), spec, iter(sizes), feed_frames=None)
    got = [fed.push(frame) for frame in codes[:30]]
    want = [once.push(frame) for frame in codes[:30]]
    assert [i for i, o in enumerate(got) if o is not None] == [19] == [i for i, o in enumerate(want) if o is not None]
    assert len(got[19]) == 10 * 960 and rel_l2(want[19], got[19]) < 1e-5
    # calls of 4 frames as they arrive; the due one takes the rest: 20 = 4 * 4 + 4, then 4, 4 of the next
    assert calls[:5] == [(0, 4, False), (4, 4, False), (8, 4, False), (12, 4, False), (16, 4, True)]
    assert [c[1] for c in calls[5:]] == [4, 4] and not any(c[2] for c in calls[5:])
    assert fed.fed == 28 and once.fed == 20
    np.testing.assert_allclose(fed.finish(codes), once.finish(codes), atol=1e-5)
    with pytest.raises(ValueError, match="feed_frames must be None or >= 1"):
        StatefulCodec(step, spec, iter(sizes), feed_frames=0)


@pytest.mark.parametrize("feed", [1, 3, 4], ids=lambda f: f"feed{f}")
def test_a_fed_stream_equals_one_shot(stream_module, feed):
    codes = random_codes(47, seed=2)
    spec = StreamCodecSpec.from_options(stream_module.options(), 960)
    got = stream_decode(runner_step(torch_runner(stream_module)), spec, codes, iter([10, 20, 40, 80]), feed)
    want = one_shot(stream_module, codes)
    assert got.shape == want.shape and rel_l2(want, got) < 1e-5


def test_a_stream_yields_the_chunk_sizes_its_caller_asked_for(cpu_fp32_bundle):
    import higgs_pack

    tts = higgs_pack.load(cpu_fp32_bundle)
    assert tts.pipeline.stream_codec is not None
    for first, growth, largest, want in ((25, 1.0, 25, [1.0, 1.0]), (5, 2.0, 20, [0.2, 0.4, 0.8, 0.8])):
        stream = tts.stream("Chunks of the size asked for.", seed=3, max_frames=80, first_chunk_frames=first,
                            chunk_growth=growth, max_chunk_frames=largest)
        seconds = [round(len(chunk.samples) / tts.sample_rate, 3) for chunk in stream]
        # the last piece is the rest, at the end of the frames: up to a chunk and the lookahead (10 frames)
        assert seconds[:-1] == want and seconds[-1] <= (largest + 10) / 25, seconds


def test_rows_of_one_run_are_separate_streams(stream_module):
    """Two streams at different offsets in one batched call give each its own single-row output."""
    run = torch_runner(stream_module)
    s = stream_module.state_size
    rng = np.random.default_rng(3)
    codes = rng.integers(0, 1024, (2, 8, 3), dtype=np.int64)
    state = rng.standard_normal((2, s)).astype(np.float32) * 0.1
    start, end = np.array([0, 17], dtype=np.int64), np.array([OPEN_END, 19], dtype=np.int64)
    both = run({"audio_codes": codes, "start_frame": start, "end_frame": end, "codec_state": state})
    for i in range(2):
        alone = run({"audio_codes": codes[i:i + 1], "start_frame": start[i:i + 1], "end_frame": end[i:i + 1],
                     "codec_state": state[i:i + 1]})
        for name in ("waveform", "codec_state_out"):
            np.testing.assert_allclose(both[name][i], alone[name][0], atol=1e-5)  # float rounding (BATCH_ATOL)


def test_lookahead_table_keeps_the_smallest_k_inside_the_limit(stream_module):
    chosen = measured_stream(stream_module.one_shot, 8, 1024, 960, 1e-3, frames=14)
    table = chosen.options()["lookahead_table"]
    assert [row["frames"] for row in table] == list(range(11))
    assert table[0]["rel_l2"] is None and "transposed convolutions" in table[0]["note"]
    # Read as zeros, the future the random tiny codec lacks changes its audio a lot: only k = 10 fits.
    assert all(row["rel_l2"] > 1e-3 for row in table[1:10]) and table[10]["rel_l2"] <= 1e-3
    assert chosen.lookahead_frames == 10 and chosen.delay_samples == 9458
    # The delays grow with k and never pass the budget.
    delays = [row["delay_samples"] for row in table[1:]]
    assert delays == sorted(delays) and all(d <= k * 960 for k, d in enumerate(delays, 1))


def test_a_lookahead_below_the_transposed_convolutions_is_refused(stream_module):
    with pytest.raises(ValueError, match="below the 1 frame"):
        StreamCodecDecoder(stream_module.one_shot, 0)


# ----------------------------------------------------------------------------- bundles


def test_the_bundle_records_and_runs_its_stream_codec(cpu_fp32_bundle):
    from higgs_pack.runtime.sources.bundle import load_pipeline

    m = read_manifest(cpu_fp32_bundle)
    assert m["format_version"] == FORMAT_VERSION == 2
    entry = m["subparts"][STREAM.value]
    assert entry["precision"] == "fp32" and entry["entry"] == "audio_tokenizer_stream.onnx"
    options = entry["options"]
    assert options["lookahead_frames"] == 10 and options["delay_samples"] == 9458
    assert len(options["lookahead_table"]) == 11
    assert [i["name"] for i in entry["inputs"]] == ["audio_codes", "start_frame", "end_frame", "codec_state"]
    pipeline = load_pipeline(cpu_fp32_bundle)
    assert pipeline.stream_codec == StreamCodecSpec(10, 9458, options["state_size"], 960)
    codes = random_codes(33, seed=5)
    want = pipeline.audio_tokenizer.run({"audio_codes": codes.T[None]})["waveform"].reshape(-1)
    got = stream_decode(runner_step(pipeline.audio_tokenizer_stream.run), pipeline.stream_codec, codes,
                        itertools.cycle([1, 5, 2]))
    assert rel_l2(want, got) < 1e-5


def as_format_one(bundle: Path) -> None:
    """Make ``bundle`` what a build before the streaming codec wrote: no such sub-part, format 1."""
    m = read_manifest(bundle)
    entry = m["subparts"].pop(STREAM.value)
    for f in entry["files"]:
        (bundle / f).unlink()
    m["files"] = [file_entry(bundle, f["path"]) for f in m["files"] if f["path"] not in entry["files"]]
    m["format_version"] = 1
    m.get("verification", {}).get("parity", {}).pop(STREAM.value, None)
    write_manifest(bundle, m)


def test_a_bundle_built_before_streams_with_windows_and_says_so(bundle_copy, check_stream, caplog):
    from higgs_pack.runtime.sources.bundle import load_pipeline

    as_format_one(bundle_copy)
    assert STREAM.value not in json.loads((bundle_copy / "manifest.json").read_text())["subparts"]
    pipeline = load_pipeline(bundle_copy)
    assert pipeline.stream_codec is None and pipeline.audio_tokenizer_stream is None
    with caplog.at_level(logging.WARNING, logger="higgs_pack.runtime.loop.streaming"):
        speech, chunks, _ = check_stream(pipeline, "Old bundles still stream.", max_frames=60)
        check_stream(pipeline, "Said once.", max_frames=30)
    notices = [r.getMessage() for r in caplog.records if "no stateful streaming codec" in r.getMessage()]
    assert len(notices) == 1 and "frames of context each side" in notices[0]
    assert speech.context_frames > 0 and len(chunks[0].samples) == 10 * 960  # the window schedule


def test_the_engine_batches_the_stream_steps_of_its_requests(cpu_fp32_bundle):
    """Two streams through the engine: their codec steps share runs (rows stacked), each stream's
    audio equal to its one-shot result; with batching off, one row per run and the same audio."""
    import higgs_pack

    tts = higgs_pack.load(cpu_fp32_bundle)
    pipeline = tts.pipeline
    texts = ["Two streams share the codec.", "A second stream beside it."]
    joined = {}
    for batched in (True, False):
        with tts.engine(max_batch=2) as engine:
            engine.codec.batch_streams = batched
            handles = [engine.submit(t, seed=4, max_frames=60, first_chunk_frames=3, chunk_growth=1.0,
                                     max_chunk_frames=3) for t in texts]
            streams = [iter(h) for h in handles]
            pieces: list[list[np.ndarray]] = [[], []]
            readers = [threading.Thread(target=lambda i=i, pieces=pieces, streams=streams: pieces[i].extend(c.samples for c in streams[i]))
                       for i in range(2)]  # two clients, each reading its own stream
            for r in readers:
                r.start()
            for r in readers:
                r.join(timeout=300)
            stats = engine.codec.stats
            joined[batched] = [np.concatenate(p) for p in pieces]
            codes = [s.codes for s in streams]
        if batched:
            assert stats.max_rows == 2, stats
        else:
            assert stats.max_rows == 1, stats
    from higgs_pack.runtime.loop.codec import decode_codes

    for i in range(2):
        want = decode_codes(pipeline, codes[i])
        for batched in (True, False):
            assert joined[batched][i].shape == want.shape
            assert float(np.abs(joined[batched][i] - want).max()) < 1e-4


def test_verify_catches_a_stream_codec_that_drops_its_state(bundle_copy):
    """A stream graph whose state output is zeros (each call forgets its left context) decodes every
    call as a new stream: one-shot parity of ``audio_tokenizer`` cannot see it, the stream's can."""
    onnx = pytest.importorskip("onnx")
    from onnx import helper

    from higgs_pack.runtime.verification.verify import verify_bundle

    path = bundle_copy / "audio_tokenizer_stream.onnx"
    model = onnx.load(str(path))
    graph = model.graph
    out = next(o for o in graph.output if o.name == "codec_state_out")
    for node in graph.node:
        node.output[:] = ["codec_state_kept" if n == out.name else n for n in node.output]
    graph.node.append(helper.make_node("Mul", ["codec_state_kept", "zero_state_scale"], [out.name]))
    graph.initializer.append(onnx.numpy_helper.from_array(np.zeros(1, dtype=np.float32), "zero_state_scale"))
    onnx.save_model(model, str(path))
    m = read_manifest(bundle_copy)
    m["files"] = [file_entry(bundle_copy, f["path"]) for f in m["files"]]
    write_manifest(bundle_copy, m)
    report = verify_bundle(bundle_copy, synthesize_cases=False)
    failed = {c.name for c in report.checks if c.ok is False}
    assert failed == {"parity audio_tokenizer_stream"}, report.render()


def test_openvino_exports_the_same_stream(stream_module, tiny_ckpt, tmp_path):
    """The openvino target's exporter on the stream module: the IR streams like torch (f32 inference)."""
    ov = pytest.importorskip("openvino")
    from higgs_pack.exporters.openvino.subpart import convert_subpart
    from higgs_pack.exporters.pytorch.modules import DYNAMIC_AXES, example_inputs

    module = StreamCodecDecoder(stream_module.one_shot)
    result = convert_subpart(module, example_inputs(STREAM, tiny_ckpt.constants, module=module), subpart=STREAM.value,
                             out_dir=tmp_path / "b", precision="fp32", dynamic_axes=DYNAMIC_AXES[STREAM],
                             work_dir=tmp_path / "w")
    compiled = ov.Core().compile_model(str(tmp_path / "b" / result.entry), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})

    def run(feeds):
        res = compiled(feeds)
        return {o.get_any_name(): res[o] for o in compiled.outputs}

    codes = random_codes(23, seed=9)
    spec = StreamCodecSpec.from_options(module.options(), 960)
    got = stream_decode(runner_step(run), spec, codes, itertools.cycle([1, 6]))
    assert rel_l2(one_shot(module, codes), got) < 1e-5
    shutil.rmtree(tmp_path / "b")


def test_every_target_builds_it_and_the_npu_variant_says_why_it_stays_on_the_cpu():
    from higgs_pack.targets.plan import make_plan
    from higgs_pack.targets.registry import targets

    for name, target in targets().items():
        for precision in target.precisions:
            row = next(r for r in make_plan(name, precision).rows if r.subpart == STREAM)
            assert row.precision == "fp32" and row.exporter.name == target.recipes[SubPart.AUDIO_TOKENIZER].exporter
    npu = next(r for r in make_plan("openvino", variant="npu").rows if r.subpart == STREAM)
    assert npu.options["device_overrides"] == {"NPU": "CPU"} and "state size" in npu.options["device_override_reason"]

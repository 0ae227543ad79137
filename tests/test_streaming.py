"""Streaming synthesis: chunked codec decoding with receptive-field context, the stream API,
and ``higgs-pack synthesize --stream`` to files and pipes (subprocesses, as a user runs it).

The openvino target and its npu variant are checked in test_openvino_target.py (with the
same ``check_stream`` fixture from conftest.py) on the bundles that module builds.
"""

from __future__ import annotations

import io
import itertools
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import soundfile as sf

from higgs_pack.errors import InputError
from higgs_pack.runtime.audio import AudioSink, streaming_wav_header
from higgs_pack.runtime.loop.chunking import (
    NotLocalError,
    StreamingCodec,
    chunk_schedule,
    measure_codec_context,
)
from higgs_pack.runtime.loop.codec import codec_context_frames, decode_codes
from higgs_pack.runtime.loop.streaming import stream
from higgs_pack.runtime.options import SamplingOptions
from higgs_pack.runtime.request import StreamSchedule
from higgs_pack.runtime.sources.bundle import load_pipeline as load

HIGGS = [sys.executable, "-m", "higgs_pack.runtime.cli"]
HOP = 4


def local_codec(reach: int):
    """A small non-linear codec with a known receptive field: codes [1, N, T] -> [1, 1, T*HOP].

    Two stacked zero-padded convolutions (reach ``reach`` frames in all) with a tanh
    between them, upsampled by repetition: edges behave as a real convolutional codec's.
    """
    first = reach // 2
    k1 = np.cos(np.arange(2 * first + 1)) + 1.5
    k2 = np.sin(np.arange(2 * (reach - first) + 1)) + 1.5

    def same(x, k):  # zero-padded convolution, output as long as x (np's "same" is not, for short x)
        return np.convolve(x, k, mode="full")[len(k) // 2:len(k) // 2 + len(x)]

    def decode(codes: np.ndarray) -> np.ndarray:
        x = codes[0].astype(np.float64)
        x = (x * np.arange(1, x.shape[0] + 1)[:, None]).sum(axis=0) / 100000.0
        y = np.tanh(same(x, k1) - 1.0)
        z = same(y, k2)
        return np.repeat(z, HOP)[None, None].astype(np.float32)

    return decode


@pytest.mark.parametrize("reach", [0, 3, 11])
def test_measure_codec_context_is_the_reach_plus_one(reach):
    assert measure_codec_context(local_codec(reach), 8, 1024) == reach + 1


def test_measure_codec_context_refuses_a_global_codec():
    def global_codec(codes):
        x = codes[0].sum(axis=0).astype(np.float32)
        return np.repeat(x - x.mean(), HOP)[None, None]

    with pytest.raises(NotLocalError, match="reaches the ends"):
        measure_codec_context(global_codec, 8, 1024)


def test_chunk_schedule_grows_to_its_limit():
    schedule = chunk_schedule(10, 2.0, 100)
    assert [next(schedule) for _ in range(7)] == [10, 20, 40, 80, 100, 100, 100]
    schedule = chunk_schedule(3, 1.5, 10)
    assert [next(schedule) for _ in range(6)] == [3, 4, 6, 10, 10, 10]
    for bad in ((0, 2.0, 10), (10, 0.5, 100), (10, 2.0, 5)):
        with pytest.raises(ValueError, match="first_chunk_frames"):
            next(chunk_schedule(*bad))


@pytest.mark.parametrize("frames", [1, 4, 15, 37, 250])
@pytest.mark.parametrize("first", [1, 10])
def test_streaming_codec_equals_one_pass(frames, first):
    reach = 5
    decode_raw = local_codec(reach)

    def decode(codes):  # [T, N] -> [T * HOP], as generate.decode_codes
        return decode_raw(codes.T[None])[0, 0]

    codes = np.random.default_rng(frames).integers(0, 1024, size=(frames, 8))
    context = measure_codec_context(decode_raw, 8, 1024)
    codec = StreamingCodec(decode, context, HOP, chunk_schedule(first, 2.0, 40))
    pieces = [p for p in (codec.push(f) for f in codes) if p is not None]
    assert codec.done < frames  # the last frame is always left for finish()
    pieces.append(codec.finish(codes))
    joined = np.concatenate(pieces)
    np.testing.assert_array_equal(joined, decode(codes))
    if frames >= first + context + 1:
        assert len(pieces[0]) == first * HOP
    other = StreamingCodec(decode, context, HOP, chunk_schedule(first, 2.0, 40))
    other.push(codes[0] + 1)
    with pytest.raises(ValueError, match="do not start with"):
        other.finish(codes)


def test_streaming_codec_without_context_decodes_wrongly():
    """The context is what makes it exact: with none, the joins differ (the test can fail)."""
    decode_raw = local_codec(6)

    def decode(codes):
        return decode_raw(codes.T[None])[0, 0]

    codes = np.random.default_rng(0).integers(0, 1024, size=(60, 8))
    codec = StreamingCodec(decode, 0, HOP, chunk_schedule(10, 1.0, 10))
    pieces = [p for p in (codec.push(f) for f in codes) if p is not None] + [codec.finish(codes)]
    assert np.abs(np.concatenate(pieces) - decode(codes)).max() > 1e-3


def test_streaming_wav_header_is_read_to_the_end():
    samples = np.sin(np.arange(2400) / 10.0).astype(np.float32) * 0.5
    for subtype, tolerance in (("PCM_16", 1 / 32768), ("FLOAT", 0.0)):
        buffer = io.BytesIO()
        sink = AudioSink(buffer, 24000, subtype=subtype)
        sink.write(samples[:1000])
        sink.write(samples[1000:])
        data = buffer.getvalue()
        assert data.startswith(streaming_wav_header(24000, subtype))
        back, rate = sf.read(io.BytesIO(data), dtype="float32")
        assert rate == 24000 and back.shape == samples.shape
        assert np.abs(back - samples).max() <= tolerance


# ----------------------------------------------------------------------------- real bundles


@pytest.fixture(scope="module")
def cpu_pipeline(cpu_int4_bundle):
    return load(cpu_int4_bundle)


def test_cpu_bundle_records_its_codec_context(cpu_pipeline):
    recorded = cpu_pipeline.codec_context_frames
    assert recorded is not None and 1 <= recorded < 64
    # A bundle built before the context was recorded: measured on its exported codec instead.
    cpu_pipeline.codec_context_frames = None
    try:
        assert codec_context_frames(cpu_pipeline) == recorded
    finally:
        cpu_pipeline.codec_context_frames = recorded


def test_cpu_stream_equals_one_shot(cpu_pipeline, check_stream):
    speech, chunks, one = check_stream(cpu_pipeline, "Streaming speech starts early.", max_frames=150)
    hop = cpu_pipeline.constants.hop_length
    frames = len(one.codes)
    spec = cpu_pipeline.stream_codec  # the stateful codec: its first call once the first chunk + lookahead are in
    assert spec is not None and speech.context_frames == 0 and speech.lookahead_frames == spec.lookahead_frames
    assert frames > spec.first_frames + 30, "too short to see the chunk schedule"
    assert len(chunks[0].samples) == 10 * hop  # the schedule's first chunk: 10 frames (0.4 s; issue 37)
    assert len(chunks[1].samples) == 20 * hop  # then growing
    assert speech.first_audio_s > 0


def test_cpu_stream_chunk_sizes_are_configurable(cpu_pipeline, check_stream):
    _, chunks, _ = check_stream(cpu_pipeline, "Small chunks.", max_frames=80, first_chunk_frames=3,
                                chunk_growth=1.0, max_chunk_frames=3, seed=1)
    hop = cpu_pipeline.constants.hop_length
    assert len(chunks) > 3 and all(len(c.samples) == 3 * hop for c in chunks[:-1])  # the first one too


def test_cpu_stream_across_sentences_is_continuous_speech(cpu_pipeline, check_stream):
    """Text chunks join with no inserted silence and no click: the stream and the one-shot result
    both equal one codec decode of all chunks' codes concatenated (the codec's window context
    runs across the seams), and each streamed piece lies inside its own text chunk."""
    text = "The first sentence is here. A second one follows! And the third?"
    limit = cpu_pipeline.decoder.max_length
    cpu_pipeline.decoder.max_length = 121  # each sentence fits with 100 frames, the whole text does not
    try:
        speech, chunks, one = check_stream(cpu_pipeline, text, max_frames=100, seed=3, first_chunk_frames=7)
    finally:
        cpu_pipeline.decoder.max_length = limit
    assert len(speech.results) >= 2
    hop = cpu_pipeline.constants.hop_length
    joined = np.concatenate([c.samples for c in chunks])
    whole = decode_codes(cpu_pipeline, one.codes)
    assert joined.shape == whole.shape == (len(one.codes) * hop,)  # not a sample of inserted pause
    assert float(np.abs(one.samples - whole).max()) <= 1e-4
    seams = np.cumsum([len(r.codes) for r in speech.results])[:-1] * hop
    for seam in seams:  # no run of silence where the chunks meet (the tiny codec's output is never still)
        around = np.abs(joined[max(0, seam - 2400):seam + 2400])
        assert (around > 1e-6).all()
    bounds = [0, *seams.tolist(), len(joined)]
    for c in chunks:
        assert bounds[c.text_chunk] <= c.offset and c.end <= bounds[c.text_chunk + 1]
    assert any(c.end == seam for c in chunks for seam in seams)  # a core straddling a seam came in two
    # Segments: one per sentence, back to back from 0 to the end, a chunk's ends exact (frame counts);
    # the stream hands each chunk's segments over with the piece that completes its audio.
    rate = cpu_pipeline.constants.sample_rate
    assert [s.text for s in one.segments] == ["The first sentence is here.", "A second one follows!",
                                              "And the third?"]
    assert one.segments[0].start == 0 and one.segments[-1].end == len(joined) / rate
    assert all(a.end == b.start for a, b in itertools.pairwise(one.segments))
    for segment in one.segments:
        result = speech.results[segment.chunk]
        spoken = [s for s in one.segments if s.chunk == segment.chunk]
        assert segment.exact == (len(spoken) == 1)
        assert round((spoken[-1].end - spoken[0].start) * rate) == len(result.codes) * hop
    assert speech.segments == one.segments
    carried = [(c.end, s) for c in chunks for s in c.segments]
    assert [s for _, s in carried] == one.segments
    for end, segment in carried:
        assert end == round(max(s.end for s in one.segments if s.chunk == segment.chunk) * rate)
    # Words: each sentence's words share out its span (estimates), back to back, the text's words in order.
    assert np.array_equal(speech.pushed_codes, one.codes)  # every frame went to the codec, in order
    assert [w.text for w in one.words] == text.split() and speech.segments[0].words == one.segments[0].words
    for segment in one.segments:
        assert segment.words[0].start == segment.start and segment.words[-1].end == segment.end
        assert all(a.end == b.start and a.start < a.end for a, b in itertools.pairwise(segment.words))
        assert not any(w.exact for w in segment.words)


def test_stream_refuses_bad_requests_before_generating(cpu_pipeline):
    with pytest.raises(InputError, match="only whitespace: there is nothing to speak"):
        stream(cpu_pipeline, "   ")
    # Refused when stream() is called, not when the first chunk is asked for.
    with pytest.raises(InputError, match=r"special token\(s\) <\|im_start\|>"):
        stream(cpu_pipeline, "Hi <|im_start|> there.")
    with pytest.raises(InputError, match=r"prompt control token\(s\) <\|text\|>"):
        stream(cpu_pipeline, "Hi.", ref_samples=np.zeros(24000, np.float32), ref_text="I said <|text|>.")


@pytest.mark.parametrize(("schedule", "message"), [
    ({"first_chunk_frames": 0}, r"first_chunk_frames must be >= 1 \(frames, 25 per second\), got 0; "
                                r"set it with first_chunk_frames="),
    ({"first_chunk_frames": 50, "max_chunk_frames": 5}, r"max_chunk_frames must be >= first_chunk_frames \(50\), "
                                                         r"got 5"),
    ({"chunk_growth": 0.5}, r"chunk_growth must be a finite number >= 1 \(1 = equal chunks\), got 0.5"),
    ({"max_chunk_frames": 2.5}, r"max_chunk_frames must be a whole number, got 2.5"),
])
def test_a_bad_stream_schedule_names_its_field(schedule, message):
    with pytest.raises(InputError, match=message):
        StreamSchedule(**schedule)


def test_stream_stops_when_closed(cpu_pipeline):
    speech = stream(cpu_pipeline, "Stop me early.", options=SamplingOptions(seed=2), max_frames=200,
                    schedule=StreamSchedule(first_chunk_frames=2))
    first = next(speech)
    speech.close()
    assert len(first.samples) == 2 * cpu_pipeline.constants.hop_length  # the first chunk: the 2 frames asked for
    assert not speech.results  # generation ended mid-utterance
    with pytest.raises(StopIteration):
        next(speech)


# ----------------------------------------------------------------------------- the command line


def _default_sigint() -> None:
    """Give the child the default SIGINT action, as an interactive terminal does.  A test run
    started in the background by a non-interactive shell (`.ci/run &`) ignores SIGINT, every
    child inherits that, and Python then never installs its KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _cli(*args, **kwargs):
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen([*HIGGS, *map(str, args)], env=env, stderr=subprocess.PIPE,
                            preexec_fn=_default_sigint, **kwargs)


def test_cli_stream_to_stdout_wav_and_raw_equal_the_file(cpu_int4_bundle, tmp_path):
    # 32-bit float: the one-shot file is not rescaled or clipped, so all outputs compare.
    common = ["-t", "Pipe me to a player.", "--no-progress", "--max-frames", "60", "--seed", "4", "--float"]
    wav = tmp_path / "one-shot.wav"
    proc = _cli("synthesize", cpu_int4_bundle, *common, "-o", wav)
    assert proc.wait(timeout=300) == 0, proc.stderr.read().decode()
    reference, _ = sf.read(wav, dtype="float32")
    streamed = tmp_path / "streamed.wav"
    proc = _cli("synthesize", cpu_int4_bundle, *common, "--stream", "-o", streamed)
    assert proc.wait(timeout=300) == 0, proc.stderr.read().decode()
    assert "first audio after" in proc.stderr.read().decode()
    for args, read in ((["--stream"], None), (["--stream", "--format", "raw"], "raw"), ([], None)):
        proc = _cli("synthesize", cpu_int4_bundle, *common, *args, "-o", "-", stdout=subprocess.PIPE)
        data, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err.decode()
        got = np.frombuffer(data, dtype="<f4") if read == "raw" else sf.read(io.BytesIO(data), dtype="float32")[0]
        assert got.shape == reference.shape
        assert np.abs(got - reference).max() <= 1e-4
    file_samples, _ = sf.read(streamed, dtype="float32")
    assert np.abs(file_samples - reference).max() <= 1e-4


def test_cli_raw_needs_stdout_and_stdout_needs_a_pipe(cpu_int4_bundle, tmp_path):
    proc = _cli("synthesize", cpu_int4_bundle, "-t", "x", "-o", tmp_path / "a.wav", "--format", "raw")
    assert proc.wait(timeout=120) == 2 and b"--format raw writes to stdout" in proc.stderr.read()


def test_cli_closed_pipe_stops_cleanly(cpu_int4_bundle):
    proc = _cli("synthesize", cpu_int4_bundle, "-t", "A long answer that nobody listens to.", "--stream",
                "-o", "-", "--no-progress", "--max-frames", "400", "--seed", "1", "--first-chunk-frames", "2",
                stdout=subprocess.PIPE)
    assert proc.stdout.read(100)
    proc.stdout.close()  # the reader goes away, like `| head -c 100`
    rc = proc.wait(timeout=300)
    err = proc.stderr.read().decode()
    assert rc == 141, err
    assert "closed the pipe" in err and "Traceback" not in err and "Exception ignored" not in err


def test_cli_ctrl_c_leaves_a_valid_wav(cpu_int4_bundle, tmp_path):
    wav = tmp_path / "interrupted.wav"
    # Long enough (many sentence chunks, each running to its own stop) that the process is
    # still generating when the first audio lands.
    text = " ".join(f"Sentence number {i} goes on for a while." for i in range(120))
    proc = _cli("synthesize", cpu_int4_bundle, "-t", text, "--stream", "-o", wav, "--no-progress",
                "--max-frames", "4000", "--seed", "2", "--first-chunk-frames", "2")
    deadline = time.monotonic() + 240
    while (not wav.exists() or wav.stat().st_size <= 44 + 2 * 960) and proc.poll() is None:
        assert time.monotonic() < deadline, "no audio was written"
        time.sleep(0.01)
    assert proc.poll() is None, "finished before it could be interrupted: " + proc.stderr.read().decode()
    proc.send_signal(signal.SIGINT)
    rc = proc.wait(timeout=120)
    err = proc.stderr.read().decode()
    assert rc == 130, err
    assert "interrupted" in err and "Traceback" not in err
    info = sf.info(wav)
    samples, rate = sf.read(wav, dtype="float32")
    assert rate == 24000 and info.frames == len(samples) > 0
    assert info.frames * 2 + 44 == wav.stat().st_size  # the header was finalised with the real length
    assert info.frames % 960 == 0  # whole frames: no piece was cut by the interruption

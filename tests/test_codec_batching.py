"""Issue 19: the engine's codec thread decodes several requests' windows in one batched run
(:mod:`higgs_pack.runtime.engine.codec_batch`), on the real tiny cpu bundles (fp32 and int4).

Every request's audio must equal the same codes decoded alone (within
:data:`~higgs_pack.runtime.engine.codec_batch.BATCH_ATOL`), streamed chunks must still join to the
one-shot decode, and a cancelled, failing or closing request must not hold up the others.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from conftest import slow_fixture
from test_engine import _wait_for

import higgs_pack
from higgs_pack.runtime.engine.codec_batch import (
    BATCH_ATOL,
    CodecBatcher,
    CodecRunError,
    batch_support,
)
from higgs_pack.runtime.engine.handle import RequestCancelled
from higgs_pack.runtime.loop.chunking import StreamingCodec, chunk_schedule
from higgs_pack.runtime.loop.codec import codec_context_frames, decode_codes
from higgs_pack.runtime.request import StreamSchedule

#: (text, seed, max_frames, schedule keywords): different lengths and stream schedules.
MIXED = [
    ("Hello there, this is the first one.", 0, 70, {}),
    ("A second voice with the same schedule.", 1, 70, {}),
    ("Short one.", 2, 33, {"first_chunk_frames": 4, "chunk_growth": 1.5, "max_chunk_frames": 12}),
    ("Number four takes equal chunks.", 3, 58, {"first_chunk_frames": 7, "chunk_growth": 1,
                                                "max_chunk_frames": 7}),
]


@slow_fixture(scope="module", params=["fp32", "int4"])
def tts(request):
    """The tiny cpu fp32 and int4 bundles, loaded (built once per session by conftest.py)."""
    bundle = request.getfixturevalue(f"cpu_{request.param}_bundle")
    with higgs_pack.load(bundle) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def tts_fp32(cpu_fp32_bundle):
    with higgs_pack.load(cpu_fp32_bundle) as loaded:
        yield loaded


def _codes(tts, frames: int, seed: int) -> np.ndarray:
    c = tts.pipeline.constants
    return np.random.default_rng(seed).integers(0, c.codebook_size, size=(frames, c.num_codebooks), dtype=np.int64)


def test_the_exported_codec_takes_a_batch_axis(tts):
    """The cpu bundles' codec has a symbolic batch axis (so batching is on), and one [3, N, T]
    run gives each row the samples of that row decoded alone."""
    batched, reason = batch_support(tts.pipeline.audio_tokenizer)
    assert batched and reason == ""
    shape = tts.pipeline.audio_tokenizer.session.get_inputs()[0].shape
    assert isinstance(shape[0], str) and isinstance(shape[2], str), shape


def test_a_batched_run_equals_each_window_decoded_alone(tts):
    """Windows of three owners, two lengths, from three threads: the codec thread runs each
    length as one run (all three open streams had a window waiting) and every reader gets the
    samples ``decode_codes`` gives for its window alone."""
    windows = {0: [_codes(tts, 21, 0), _codes(tts, 42, 1)], 1: [_codes(tts, 21, 2), _codes(tts, 42, 3)],
               2: [_codes(tts, 21, 4)]}
    alone = {k: [decode_codes(tts.pipeline, w) for w in ws] for k, ws in windows.items()}
    batcher = CodecBatcher(tts.pipeline, gather_s=2.0, max_gather_s=5.0)
    start = threading.Barrier(3)

    def read(owner: int) -> list[np.ndarray]:
        with batcher.stream():
            start.wait()
            return [batcher.decode(w, owner) for w in windows[owner]]

    try:
        with ThreadPoolExecutor(3) as pool:
            got = dict(zip(windows, pool.map(read, windows), strict=True))
    finally:
        batcher.close()
    for k in windows:
        for a, b in zip(got[k], alone[k], strict=True):
            assert a.shape == b.shape and a.dtype == np.float32
            np.testing.assert_allclose(a, b, atol=BATCH_ATOL, rtol=0)
    assert batcher.stats.max_rows == 3  # the three 21-frame windows in one run
    assert batcher.stats.runs == 2 and batcher.stats.windows == 5
    assert not batcher.alive


def test_windows_of_different_lengths_are_never_padded_together(tts_fp32):
    """One owner's windows of 30, 31 and 30 frames: the two of 30 share a run, the one of 31 runs
    alone (its last frame is the input's real end: no padding can stand in for it)."""
    ws = [_codes(tts_fp32, 30, 5), _codes(tts_fp32, 31, 6), _codes(tts_fp32, 30, 7)]
    batcher = CodecBatcher(tts_fp32.pipeline)
    try:
        got = batcher.decode_many(ws)
    finally:
        batcher.close()
    assert batcher.stats.runs == 2 and batcher.stats.max_rows == 2
    for a, w in zip(got, ws, strict=True):
        assert len(a) == len(w) * tts_fp32.pipeline.constants.hop_length
        np.testing.assert_allclose(a, decode_codes(tts_fp32.pipeline, w), atol=BATCH_ATOL, rtol=0)


def _streamed_alone(pipeline, codes: np.ndarray, sched: dict) -> np.ndarray:
    """The stream of ``codes`` with every window decoded alone on this thread (what a stream
    outside the engine gives for these codes: one text chunk, so no fades)."""
    s = StreamSchedule(**sched)
    codec = StreamingCodec(lambda w: decode_codes(pipeline, w), codec_context_frames(pipeline),
                           pipeline.constants.hop_length,
                           chunk_schedule(s.first_chunk_frames, s.chunk_growth, s.max_chunk_frames))
    pieces = [out for frame in codes if (out := codec.push(frame)) is not None]
    return np.concatenate([*pieces, codec.finish(codes)])


def test_streams_of_mixed_schedules_and_lengths_equal_their_windows_alone(tts):
    """Four streams (two sharing a schedule and length, two with their own) and one result()
    reader through one engine: each stream's joined chunks equal its codes streamed with every
    window decoded alone (within BATCH_ATOL) and their one-shot decode (1e-4); the result()
    equals its codes decoded alone; the codec thread decoded more than one window in some run
    (the two alike streams are due together).  On fp32 the codes also equal the requests run
    alone (int4 kernels may round differently with more rows: test_engine.py)."""
    p = tts.pipeline
    with tts.engine(max_batch=5) as engine:
        engine.codec.close()  # waits long enough for the two alike streams' windows on a loaded machine
        engine.codec = CodecBatcher(engine.pipeline, gather_s=0.1, max_gather_s=0.3)
        handles = [engine.submit(text, seed=seed, max_frames=cap, **sched) for text, seed, cap, sched in MIXED]
        whole = engine.submit("And one read whole.", seed=9, max_frames=45)

        def read(handle):
            stream = iter(handle)
            chunks = list(stream)
            return stream, chunks

        with ThreadPoolExecutor(5) as pool:
            futures = [pool.submit(read, h) for h in handles]
            whole_result = pool.submit(whole.result, 60).result()
            results = [f.result() for f in futures]
        stats = engine.codec.stats
    for (stream, chunks), (text, seed, cap, sched) in zip(results, MIXED, strict=True):
        assert stream.codes.shape == (cap, p.constants.num_codebooks)
        assert [c.offset for c in chunks] == [0] + [c.end for c in chunks[:-1]]
        joined = np.concatenate([c.samples for c in chunks])
        np.testing.assert_allclose(joined, _streamed_alone(p, stream.codes, sched), atol=BATCH_ATOL, rtol=0)
        np.testing.assert_allclose(joined, decode_codes(p, stream.codes), atol=1e-4, rtol=0)
        if tts.info.precision == "fp32":
            np.testing.assert_array_equal(stream.codes, tts.synthesize(text, seed=seed, max_frames=cap).codes)
    np.testing.assert_allclose(whole_result.samples, decode_codes(p, whole_result.codes), atol=BATCH_ATOL, rtol=0)
    assert stats.windows > stats.runs, stats
    assert not engine.codec.alive


def test_a_cancelled_window_leaves_the_queue_and_others_go_on(tts_fp32):
    """A window waiting for the codec thread (it waits for the second open stream) is withdrawn
    when its request is cancelled: its reader gets RequestCancelled without a run, the queue is
    empty, and the other stream's window is decoded right."""
    batcher = CodecBatcher(tts_fp32.pipeline, gather_s=30.0, max_gather_s=30.0)
    a, b = object(), object()
    window = _codes(tts_fp32, 25, 8)
    errors: list[BaseException] = []
    opened = threading.Event()

    def cancelled_reader() -> None:
        with batcher.stream():
            opened.set()
            try:
                batcher.decode(_codes(tts_fp32, 25, 9), a)
            except RequestCancelled as exc:
                errors.append(exc)

    try:
        with batcher.stream():  # b's stream is open, its window not yet due: the codec thread waits
            reader = threading.Thread(target=cancelled_reader)
            reader.start()
            opened.wait(10)
            _wait_for(lambda: batcher.pending == 1, "a's window to be waiting", timeout=30.0)
            assert batcher.withdraw(a, RequestCancelled("cancelled mid-window")) == 1
            reader.join(10)
            assert len(errors) == 1 and "mid-window" in str(errors[0])
            assert batcher.pending == 0 and batcher.stats.runs == 0
            got = batcher.decode(window, b)  # the only open stream now: runs at once
    finally:
        batcher.close()
    np.testing.assert_allclose(got, decode_codes(tts_fp32.pipeline, window), atol=BATCH_ATOL, rtol=0)
    assert batcher.stats.withdrawn == 1 and batcher.stats.runs == 1


def test_cancelling_a_stream_mid_way_does_not_hold_the_others(tts_fp32):
    """Through the engine: one of three streams is cancelled after its first chunk; it raises
    RequestCancelled, the other two finish with their audio alone, nothing is left queued."""
    text, seed, cap, _ = MIXED[0]
    alone = tts_fp32.synthesize(text, seed=seed, max_frames=cap)
    with tts_fp32.engine(max_batch=3) as engine:
        handles = [engine.submit(text, seed=seed, max_frames=cap) for _ in range(3)]

        def read(i: int):
            stream = iter(handles[i])
            chunks = [next(stream)]
            if i == 1:
                handles[i].cancel()
                with pytest.raises(RequestCancelled):
                    chunks.extend(stream)
                return None
            chunks.extend(stream)
            return np.concatenate([c.samples for c in chunks])

        with ThreadPoolExecutor(3) as pool:
            out = list(pool.map(read, range(3)))
        assert engine.codec.pending == 0
    assert out[1] is None
    for samples in (out[0], out[2]):
        np.testing.assert_allclose(samples, alone.samples, atol=1e-4, rtol=0)


def test_closing_with_windows_pending_hands_them_back(tts_fp32):
    """Closing the batcher while a window waits (for a second stream that never comes) stops the
    codec thread at once; the window is decoded on its reader's thread, and so is every later
    one."""
    batcher = CodecBatcher(tts_fp32.pipeline, gather_s=30.0, max_gather_s=30.0)
    window = _codes(tts_fp32, 40, 10)
    got: list[np.ndarray] = []
    with batcher.stream(), batcher.stream():
        reader = threading.Thread(target=lambda: got.append(batcher.decode(window, "a")))
        reader.start()
        _wait_for(lambda: batcher.pending == 1, "the window to be waiting", timeout=30.0)
        t0 = time.perf_counter()
        batcher.close(timeout=10)
        assert time.perf_counter() - t0 < 10 and not batcher.alive
        reader.join(30)
    expected = decode_codes(tts_fp32.pipeline, window)
    np.testing.assert_array_equal(got[0], expected)  # decoded alone, as before
    np.testing.assert_array_equal(batcher.decode(window), expected)
    assert batcher.stats.runs == 0


def test_a_closed_engine_stops_its_codec_thread_and_finished_requests_stay_readable(tts_fp32):
    text, seed, cap, _ = MIXED[2]
    alone = tts_fp32.synthesize(text, seed=seed, max_frames=cap)
    engine = tts_fp32.engine(max_batch=2)
    handle = engine.submit(text, seed=seed, max_frames=cap)
    assert handle.wait(60)
    engine.close()
    assert not engine.codec.alive
    np.testing.assert_array_equal(handle.result().samples, alone.samples)


def test_a_failing_window_fails_only_its_request(tts_fp32):
    """Three windows of one length due together, one with a code the codec's codebook does not
    hold: the batched run fails in ONNX Runtime, is retried one window per run, and only that
    window's reader gets CodecRunError (naming the codec and the window, the runtime's error as
    its cause); the others get their samples."""
    c = tts_fp32.pipeline.constants
    good = [_codes(tts_fp32, 24, 11), _codes(tts_fp32, 24, 12)]
    bad = _codes(tts_fp32, 24, 13)
    bad[5, 2] = c.codebook_size + 4000
    batcher = CodecBatcher(tts_fp32.pipeline, gather_s=5.0, max_gather_s=10.0)
    start = threading.Barrier(3)

    def read(i: int):
        with batcher.stream():
            start.wait()
            try:
                return batcher.decode([*good, bad][i], i)
            except CodecRunError as exc:
                return exc

    try:
        with ThreadPoolExecutor(3) as pool:
            out = list(pool.map(read, range(3)))
    finally:
        batcher.close()
    assert isinstance(out[2], CodecRunError)
    assert "audio_tokenizer" in str(out[2]) and "24 frames" in str(out[2]) and out[2].__cause__ is not None
    for got, w in zip(out[:2], good, strict=True):
        np.testing.assert_allclose(got, decode_codes(tts_fp32.pipeline, w), atol=BATCH_ATOL, rtol=0)
    assert batcher.stats.retried == 1 and batcher.stats.max_rows == 3


def test_a_failing_window_fails_that_request_alone_through_the_engine(tts_fp32):
    """A request's result() whose codec run fails raises CodecRunError; another request of the
    same engine reads right afterwards."""
    text, seed, cap, _ = MIXED[2]
    alone = tts_fp32.synthesize(text, seed=seed, max_frames=cap)
    with tts_fp32.engine(max_batch=2) as engine:
        broken, fine = (engine.submit(text, seed=seed, max_frames=cap) for _ in range(2))
        assert broken.wait(60) and fine.wait(60)
        window = _codes(tts_fp32, 10, 14)
        window[0, 0] = -5000
        with pytest.raises(CodecRunError, match="10 frames"):
            engine.codec.decode(window, broken)
        np.testing.assert_array_equal(fine.result().samples, alone.samples)

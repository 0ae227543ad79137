"""Issue 19 item 2: the continuous-batching engine on ONNX Runtime's CPU provider.

The batched decoder (one KV buffer per layer [max_batch, kv_heads, max_length, head_dim],
prefill at batch 1 on a row view, all rows decoding together at their own lengths) against the
batch-1 decoder, and the engine's requests against the same requests run alone through
``TTS.synthesize`` / ``TTS.stream`` with the same seed, on the real tiny bundles.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

import higgs_pack
from higgs_pack.errors import InputError
from higgs_pack.runtime.backends import get_backend
from higgs_pack.runtime.backends.onnxruntime.batched import BatchedOrtDecoder
from higgs_pack.runtime.engine.engine import Engine
from higgs_pack.runtime.engine.handle import EngineClosed, RequestCancelled

#: (text, seed, max_frames): different text lengths and frame caps.
REQUESTS = [
    ("Hello there.", 0, 60),
    ("A somewhat longer sentence to say, with more words in it than the others.", 1, 90),
    ("Short one.", 2, 40),
    ("Number four is here too.", 3, 75),
    ("Five.", 4, 55),
]

#: Eight requests for the eight-rows checks: :data:`REQUESTS` and three more.
EIGHT = [
    *REQUESTS,
    ("The sixth request speaks now.", 5, 45),
    ("Seven is said to be a lucky number.", 6, 65),
    ("And the eighth one closes the batch.", 7, 50),
]


@pytest.fixture(scope="module")
def tts(cpu_fp32_bundle):
    with higgs_pack.load(cpu_fp32_bundle) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def alone(tts):
    """Each request of :data:`REQUESTS` run alone: its codes and samples."""
    return [tts.synthesize(text, seed=seed, max_frames=cap) for text, seed, cap in REQUESTS]


def _submit(engine, tts, i: int, **kwargs):
    text, seed, cap = REQUESTS[i]
    return engine.submit(text, seed=seed, max_frames=cap, **kwargs)


def _wait_for(predicate, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.002)


def _batched(tts, max_batch: int = 4, max_length: int = 512, **kwargs) -> BatchedOrtDecoder:
    c = tts.pipeline.constants
    return BatchedOrtDecoder(tts.pipeline.decoder.session, max_batch=max_batch, max_length=max_length,
                             kv_heads=c.num_key_value_heads, head_dim=c.head_dim, **kwargs)


def run_eight_concurrent(tts, engine=None, timeout: float = 120.0, **engine_options) -> list:
    """:data:`EIGHT` submitted at once from eight threads to an engine of eight rows
    (``tts.engine(max_batch=8, **engine_options)`` unless ``engine`` is given; the threads' submits
    can land after the engine's first step, so a prompt may join mid-flight: ``prefill_chunk=0``
    prefills it whole); every request ends with its frames and the batch held all eight rows at
    once.  Returns the results in :data:`EIGHT`'s order.  Shared by every backend's tests
    (issue 19: eight concurrent requests per bundle)."""
    engine = tts.engine(max_batch=8, **engine_options) if engine is None else engine
    handles: list = [None] * len(EIGHT)
    go = threading.Barrier(len(EIGHT))

    def submit(i: int) -> None:
        go.wait()
        text, seed, cap = EIGHT[i]
        handles[i] = engine.submit(text, seed=seed, max_frames=cap)

    with engine:
        threads = [threading.Thread(target=submit, args=(i,)) for i in range(len(EIGHT))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        results = [h.result(timeout=timeout) for h in handles]
        assert engine.max_batch == 8 and engine.stats.max_rows == 8
        assert engine.busy_rows == 0 and engine.waiting == 0
    for (_, _, cap), result in zip(EIGHT, results, strict=True):
        assert 0 < len(result.codes) <= cap and result.samples.size > 0
    return results


def codes_agreement(single: list, batched: list) -> tuple[int, int]:
    """(frames equal, frames in all) of each batched result's codes against its run alone."""
    same = total = 0
    for a, b in zip(single, batched, strict=True):
        n = min(len(a.codes), len(b.codes))
        same += int((a.codes[:n] == b.codes[:n]).all(axis=1).sum())
        total += max(len(a.codes), len(b.codes))
    return same, total


def test_prefill_on_a_row_view_writes_into_the_shared_buffer(tts):
    """The prompt's K/V land in row 2 of the one [B, kv_heads, L, head_dim] buffer per layer (no
    copy: the bound memory is the buffer's own), equal to what the batch-1 decoder holds; the
    other rows stay untouched."""
    batched, single = _batched(tts), tts.pipeline.decoder
    prompt = np.random.default_rng(0).standard_normal((1, 7, tts.pipeline.constants.hidden_size)).astype(np.float32)
    single.reset()
    expected = single.forward(prompt)
    got = batched.prefill(2, prompt)
    np.testing.assert_array_equal(got, expected)
    assert batched.lengths.tolist() == [0, 0, 7, 0]
    for name, buffer in batched.kv.items():
        assert buffer.shape == (4, tts.pipeline.constants.num_key_value_heads, 512, tts.pipeline.constants.head_dim)
        np.testing.assert_array_equal(buffer[2, :, :7], single._kv_host[name][0, :, :7])
        assert np.any(buffer[2, :, :7] != 0)
        assert not buffer[[0, 1, 3]].any() and not buffer[2, :, 7:].any()


def test_rows_at_their_own_lengths_give_the_hidden_states_of_separate_runs(tts):
    """Three prompts of 5, 9 and 3 positions on rows 0, 2, 3 (row 1 a hole), then 30 steps all
    together: every row's hidden states equal its own batch-1 run exactly (fp32)."""
    batched, single = _batched(tts), tts.pipeline.decoder
    rng = np.random.default_rng(1)
    h = tts.pipeline.constants.hidden_size
    prompts = [rng.standard_normal((1, n, h)).astype(np.float32) for n in (5, 9, 3)]
    steps = [rng.standard_normal((30, 1, 1, h)).astype(np.float32) for _ in prompts]
    rows = np.array([0, 2, 3])
    together = [[batched.prefill(int(r), p)] for r, p in zip(rows, prompts, strict=True)]
    for t in range(30):
        out = batched.step(rows, np.concatenate([s[t] for s in steps]))
        for i in range(3):
            together[i].append(out[i:i + 1])
    assert batched.lengths.tolist() == [35, 0, 39, 33]
    for prompt, feeds, got in zip(prompts, steps, together, strict=True):
        single.reset()
        expected = [single.forward(prompt)] + [single.forward(x) for x in feeds]
        for a, b in zip(expected, got, strict=True):
            np.testing.assert_array_equal(a, b)


def test_device_buffers_give_the_host_buffers_hidden_states_and_kv(tts):
    """The GPU path (KV buffers as ``OrtValue``s, bound by pointer: what a cuda bundle's engine
    runs) made on the host: rows at their own lengths give exactly the host buffers' hidden
    states, and each row holds the same K/V."""
    host, device = _batched(tts), _batched(tts, device_buffers=True)
    assert device.kv == {} and set(device.kv_values) == set(host.kv) and device.kv_device == "cpu"
    assert device.kv_bytes_per_position == host.kv_bytes_per_position == 512
    h = tts.pipeline.constants.hidden_size
    rows = np.array([0, 1, 3])
    outs = {}
    for decoder in (host, device):
        rng = np.random.default_rng(5)
        outs[decoder] = [decoder.prefill(int(r), rng.standard_normal((1, n, h)).astype(np.float32))
                         for r, n in zip(rows, (6, 11, 4), strict=True)]
        outs[decoder] += [decoder.step(rows, rng.standard_normal((3, 1, h)).astype(np.float32)) for _ in range(20)]
    for a, b in zip(outs[host], outs[device], strict=True):
        np.testing.assert_array_equal(a, b)
    assert device.lengths.tolist() == host.lengths.tolist() == [26, 31, 0, 24]
    for name in host.kv:
        for row, n in zip(rows, (26, 31, 24), strict=True):
            np.testing.assert_array_equal(device.kv_row(name, int(row))[:, :n], host.kv[name][row, :, :n])
    device.release(1)
    assert device.positions_held == 50


def test_kv_buffers_that_do_not_fit_are_refused_naming_their_size(tts):
    """Device buffers are allocated whole: a cache the device has no room for is a MemoryError
    giving its size and what to lower (shown on the host, where the same OrtValue path runs)."""
    with pytest.raises(MemoryError, match=r"out of cpu memory for the batched KV cache: 65536 rows x 16777216 "
                                          r"positions x 512 B = 536870912\.00 MiB in all; lower max_batch or max_length"):
        _batched(tts, max_batch=2**16, max_length=2**24, device_buffers=True)


def test_eight_concurrent_requests_give_their_codes_alone(tts):
    """Issue 19: eight requests at once, from eight threads, on eight rows: each gives the codes
    and samples of its run alone (fp32), on host KV buffers and on the device path's
    ``OrtValue`` buffers (made on the host)."""
    single = [tts.synthesize(text, seed=seed, max_frames=cap) for text, seed, cap in EIGHT]
    c = tts.pipeline.constants
    on_values = BatchedOrtDecoder(tts.pipeline.decoder.session, max_batch=8, max_length=512, device_buffers=True,
                                  kv_heads=c.num_key_value_heads, head_dim=c.head_dim)
    for engine in (None, Engine(tts.pipeline, on_values)):
        for got, want in zip(run_eight_concurrent(tts, engine), single, strict=True):
            np.testing.assert_array_equal(got.codes, want.codes)
            np.testing.assert_array_equal(got.samples, want.samples)


def test_a_step_needs_prefilled_rows_and_room(tts):
    batched = _batched(tts, max_batch=2, max_length=8)
    h = tts.pipeline.constants.hidden_size
    with pytest.raises(InputError, match=r"rows \[1\] were not prefilled"):
        batched.step(np.array([1]), np.zeros((1, 1, h), np.float32))
    batched.prefill(0, np.ones((1, 8, h), np.float32))
    with pytest.raises(InputError, match="9 positions, more than max_length=8"):
        batched.step(np.array([0]), np.zeros((1, 1, h), np.float32))


def run_joining_mid_flight(tts, timeout: float = 60.0, check_engine=None, **engine_options) -> list:
    """Two requests start together, a third joins after 10 steps, a fourth and fifth after 25
    (one of them waits: 3 rows); returns their results once every row is free again.
    ``check_engine(engine)`` runs before the engine closes; ``engine_options`` go to
    ``tts.engine`` (``prefill_chunk=0``: joining prompts prefilled whole).  Shared by every
    backend's tests."""
    with tts.engine(max_batch=3, **engine_options) as engine:
        handles = [_submit(engine, tts, 0), _submit(engine, tts, 1)]
        _wait_for(lambda: engine.stats.steps >= 10, "10 steps")
        handles.append(_submit(engine, tts, 2))
        _wait_for(lambda: engine.stats.steps >= 25, "25 steps")
        handles += [_submit(engine, tts, 3), _submit(engine, tts, 4)]
        results = [h.result(timeout=timeout) for h in handles]
        assert engine.stats.max_rows == 3
        assert engine.busy_rows == 0 and engine.waiting == 0
        if check_engine is not None:
            check_engine(engine)
    return results


def check_synthesize_after_an_engine(tts) -> None:
    """The order of issue 30 item 5: ``synthesize`` on a loaded bundle, an engine on that same
    object (:func:`run_joining_mid_flight`), then ``synthesize`` again: the codes and samples
    after equal those before.  Shared by every backend's tests (on OpenVINO the batched
    decoder's infers wrote into the batch-1 decoder's shared input arrays)."""
    before = [tts.synthesize(text, seed=seed, max_frames=cap) for text, seed, cap in REQUESTS[:2]]
    run_joining_mid_flight(tts, timeout=120)
    after = [tts.synthesize(text, seed=seed, max_frames=cap) for text, seed, cap in REQUESTS[:2]]
    for got, want in zip(after, before, strict=True):
        np.testing.assert_array_equal(got.codes, want.codes)
        np.testing.assert_array_equal(got.samples, want.samples)


def test_synthesize_after_an_engine_gives_the_codes_of_before(cpu_fp32_bundle):
    with higgs_pack.load(cpu_fp32_bundle) as fresh:
        check_synthesize_after_an_engine(fresh)


def test_requests_together_and_joining_mid_flight_give_their_codes_alone(tts, alone):
    """Requests joining mid-flight (:func:`run_joining_mid_flight`): each one's codes and samples
    equal its run alone."""
    results = run_joining_mid_flight(tts)
    for got, want in zip(results, alone, strict=True):
        np.testing.assert_array_equal(got.codes, want.codes)
        np.testing.assert_array_equal(got.samples, want.samples)
        assert got.chunks[0].stop_reason == want.chunks[0].stop_reason


def test_requests_beyond_max_batch_wait_then_run(tts, alone):
    with tts.engine(max_batch=2) as engine:
        handles = [_submit(engine, tts, i) for i in range(5)]
        assert all(h.wait(60) for h in handles)  # all codes drawn; the codec runs in result()
        assert engine.busy_rows == 0 and engine.stats.max_rows == 2
        results = [h.result(timeout=60) for h in handles]
    for got, want in zip(results, alone, strict=True):
        np.testing.assert_array_equal(got.codes, want.codes)


def test_submit_together_queues_all_or_none(tts, alone):
    """``submit_together``: the requests wait in one queue turn (all rows busy from the first
    step) and give their codes alone; a request without text, or a bad one, queues none."""
    with tts.engine(max_batch=3) as engine:
        with pytest.raises(InputError, match="request 1 has no 'text'"):
            engine.submit_together([{"text": "Hello.", "seed": 1}, {"seed": 2}])
        with pytest.raises(InputError):
            engine.submit_together([{"text": "Hello.", "seed": 1}, {"text": "Hi.", "temperature": -1.0}])
        assert engine.waiting == 0 and engine.busy_rows == 0 and engine.stats.steps == 0
        handles = engine.submit_together([{"text": t, "seed": s, "max_frames": c} for t, s, c in REQUESTS[:3]])
        assert all(h.wait(60) for h in handles) and engine.stats.max_rows == 3
        results = [h.result(timeout=60) for h in handles]
    for got, want in zip(results, alone[:3], strict=True):
        np.testing.assert_array_equal(got.codes, want.codes)


def test_streamed_chunks_join_to_the_result(tts, alone):
    text, seed, cap = REQUESTS[1]
    streamed = tts.stream(text, seed=seed, max_frames=cap, first_chunk_frames=8)
    stream_alone = np.concatenate([c.samples for c in streamed])
    with tts.engine(max_batch=3) as engine:
        other = _submit(engine, tts, 0)
        handle = _submit(engine, tts, 1, first_chunk_frames=8)
        stream = iter(handle)
        chunks = list(stream)
        other.result(timeout=60)
    assert len(stream.results) == 1
    np.testing.assert_array_equal(stream.codes, alone[1].codes)
    assert len(chunks) > 2
    assert [c.offset for c in chunks] == [0] + [c.end for c in chunks[:-1]]
    joined = np.concatenate([c.samples for c in chunks])
    np.testing.assert_array_equal(joined, stream_alone)
    np.testing.assert_allclose(joined, alone[1].samples, atol=1e-4)
    with pytest.raises(InputError, match="already read"):
        handle.result()


def _first_audio_beside(engine, tts, lead_frames: int):
    """A long request (not streamed) on one row, ``lead_frames`` of its codes sent, then request
    1 streamed with the earliest first audio; returns the stream, read to its end."""
    other = engine.submit("A request that runs well ahead of real time.", seed=9, max_frames=3000)
    _wait_for(lambda: engine.stats.frames >= lead_frames, f"{lead_frames} frames of the running request")
    stream = iter(_submit(engine, tts, 1, first_chunk_frames=1))
    for _ in stream:
        pass
    assert not other.done, "the long request ran beside the stream throughout"
    other.cancel()
    return stream


def test_a_streams_first_audio_holds_the_steps_where_no_listener_can_hear_it(tts, alone, monkeypatch):
    """Issue 41: a stream alone holds the steps once, while its first codec step runs; beside a
    row with the lead in hand it holds too, beside a row short of it (a lead no row reaches) it
    does not; the codes are the stream's alone whatever holds.  The codec is fed once, when the first
    chunk is due (fed 4 frames at a time, the slowed calls below leave the reader behind a tiny
    engine that has ended before the first audio's call), and each call takes 50 ms more, as a
    full-size codec call outlasts a step (140 ms against 110-190): the tiny codec's call could end
    before the engine's next turn looked, and the engine has nothing to hold then."""
    from higgs_pack.runtime.engine import engine as engine_module

    class SlowCodec:
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def run(self, feeds):
            time.sleep(0.05)
            return self.inner.run(feeds)

    monkeypatch.setattr(tts.pipeline, "audio_tokenizer_stream", SlowCodec(tts.pipeline.audio_tokenizer_stream))
    monkeypatch.setattr(tts.pipeline, "codec_feed_frames", None)

    with tts.engine(max_batch=2) as engine:
        stream = iter(_submit(engine, tts, 1, first_chunk_frames=1))
        for _ in stream:
            pass
        # (counted by the engine's thread once its hold ends, after the first audio is out)
        assert engine.stats.first_audio_holds == 1 and engine.stats.first_audio_hold_seconds > 0
    np.testing.assert_array_equal(stream.codes, alone[1].codes)
    monkeypatch.setattr(engine_module, "HOLD_LEAD_S", 0.5)
    with tts.engine(max_batch=2) as engine:
        # 200 frames are 8 s of audio, made here in well under 7.5 s: 0.5 s in hand
        stream = _first_audio_beside(engine, tts, 200)
        assert engine.stats.first_audio_holds == 1
    np.testing.assert_array_equal(stream.codes, alone[1].codes)
    monkeypatch.setattr(engine_module, "HOLD_LEAD_S", 1e9)
    with tts.engine(max_batch=2) as engine:
        stream = _first_audio_beside(engine, tts, 200)
        assert engine.stats.first_audio_holds == 0, "a row short of the lead keeps the steps running"
    np.testing.assert_array_equal(stream.codes, alone[1].codes)


def check_cancel_frees_the_row(tts, alone, timeout: float = 60.0, **engine_options) -> None:
    """Two long requests fill both rows and a short one waits; cancelling the first lets the
    short one in (it finishes with its codes alone) while the second goes on.  Shared by every
    backend's engine tests (``engine_options`` as :func:`run_joining_mid_flight`'s)."""
    with tts.engine(max_batch=2, **engine_options) as engine:
        first = engine.submit("A long request that will be cancelled.", seed=7, max_frames=3000)
        second = engine.submit("A long request that goes on.", seed=7, max_frames=400)
        queued = _submit(engine, tts, 2)
        # both long ones on their rows (each submit embeds its prompt first, which can take the
        # engine's first steps under load)
        _wait_for(lambda: engine.stats.steps >= 5 and engine.busy_rows == 2, "5 steps of both rows")
        assert engine.waiting == 1 and not queued.done
        first.cancel()
        got = queued.result(timeout=timeout)
        assert not second.done, "the short request should finish while the long one still runs"
        with pytest.raises(RequestCancelled):
            first.result(timeout=60)
        assert second.result(timeout=timeout).codes.shape[0] > 0
    np.testing.assert_array_equal(got.codes, alone[2].codes)


def test_cancel_frees_the_row_and_a_queued_request_runs(tts, alone):
    check_cancel_frees_the_row(tts, alone)


def test_cancel_after_the_last_code_still_reads_as_cancelled(tts):
    """cancel() is the reader's last word: once the engine has drawn every code, the request's
    events and windows are all there, yet result() and iteration raise RequestCancelled."""
    with tts.engine(max_batch=2) as engine:
        handles = [engine.submit("Done before it is cancelled.", seed=3, max_frames=40) for _ in range(2)]
        for handle in handles:
            assert handle.wait(60)
            handle.cancel()
        with pytest.raises(RequestCancelled):
            handles[0].result(timeout=60)
        with pytest.raises(RequestCancelled):
            list(handles[1])
        assert engine.codec.pending == 0


def test_submit_from_several_threads(tts, alone):
    results: dict[int, np.ndarray] = {}
    errors: list[BaseException] = []
    with tts.engine(max_batch=3) as engine:
        def client(i: int) -> None:
            try:
                results[i] = _submit(engine, tts, i).result(timeout=60).codes
            except BaseException as exc:  # reported below
                errors.append(exc)

        threads = [threading.Thread(target=client, args=(i,)) for i in range(len(REQUESTS))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert not errors, errors
    for i, want in enumerate(alone):
        np.testing.assert_array_equal(results[i], want.codes)


def test_a_bad_request_fails_alone(tts, alone):
    """A prompt control token in the text is refused at submit, before it takes a row; the
    requests beside it finish with their own codes."""
    with tts.engine(max_batch=3) as engine:
        good = _submit(engine, tts, 0)
        with pytest.raises(InputError, match="prompt control token"):
            engine.submit("Say <|audio|> here.", seed=0, max_frames=30)
        other = _submit(engine, tts, 3)
        np.testing.assert_array_equal(good.result(timeout=60).codes, alone[0].codes)
        np.testing.assert_array_equal(other.result(timeout=60).codes, alone[3].codes)


def test_bad_submissions_are_refused_at_once_and_close_stops_everything(tts):
    engine = tts.engine(max_batch=1)
    with pytest.raises(InputError, match="only whitespace: there is nothing to speak"):
        engine.submit("   ")
    with pytest.raises(InputError, match="first_chunk_frames"):
        engine.submit("Hi.", first_chunk_frames=0)
    running = engine.submit("A long one.", seed=0, max_frames=3000)
    waiting = engine.submit("Waits.", seed=0, max_frames=30)
    _wait_for(lambda: engine.stats.steps >= 3, "3 steps")
    engine.close(timeout=30)
    for handle in (running, waiting):
        with pytest.raises(EngineClosed):
            handle.result(timeout=30)
    with pytest.raises(EngineClosed, match="closed"):
        engine.submit("Too late.")


def test_max_batch_is_checked_and_openvino_refuses_a_decoder_it_cannot_batch(tts):
    """OpenVINO batches its stateful decoder (tests/test_engine_openvino.py); any other decoder
    (the npu variant's static one; here ONNX Runtime's) is refused above batch 1, saying why."""
    with pytest.raises(InputError, match="max_batch must be a whole number >= 1"):
        tts.engine(max_batch=0)
    with pytest.raises(InputError, match="more than the decoder's context"):
        tts.engine(max_batch=2, max_length=10 ** 7)
    openvino = get_backend("openvino")
    with pytest.raises(InputError, match=r"static shapes take batch 1.*without --npu"):
        openvino.batched_decoder(tts.pipeline, 2, 512)
    assert openvino.batched_decoder(tts.pipeline, 1, 512).max_batch == 1


def test_int4_agreement_batched_versus_alone(cpu_int4_bundle, capsys):
    """int4 kernels may round differently with more rows (MatMulNBits tiles M > 1): eight
    concurrent requests on eight rows all end, and the fraction of frames equal to the run
    alone is reported (on the tiny bundle 456 of 480 frames, 0.95).  Prompts are prefilled whole
    (``prefill_chunk=0``): a prompt prefilled in chunks rounds differently again with each chunk's
    M (chunks of 2 positions and up: 417 of 480, 0.87), which is not what this measures."""
    with higgs_pack.load(cpu_int4_bundle) as int4:
        single = [int4.synthesize(text, seed=seed, max_frames=cap) for text, seed, cap in EIGHT]
        batched = run_eight_concurrent(int4, prefill_chunk=0)
    same, total = codes_agreement(single, batched)
    with capsys.disabled():
        print(f"\nint4, 8 concurrent requests batched vs alone: {same}/{total} frames equal ({same / total:.3f})")
    assert same / total >= 0.9


class _PoisonedRow:
    """The real batched decoder, with row ``row``'s hidden state made NaN from step ``after`` on
    (a broken kernel on one row: the fault is ours, the decoder is ONNX Runtime's)."""

    def __init__(self, decoder: BatchedOrtDecoder, row: int, after: int):
        self._decoder, self._row, self._after, self._steps = decoder, row, after, 0
        self.max_batch, self.max_length = decoder.max_batch, decoder.max_length

    def prefill(self, row, inputs_embeds, start=0, final=True):
        return self._decoder.prefill(row, inputs_embeds, start, final)

    def release(self, row):
        self._decoder.release(row)

    def step(self, rows, inputs_embeds):
        out = self._decoder.step(rows, inputs_embeds)
        self._steps += 1
        if self._steps >= self._after and self._row in rows.tolist():
            out[rows.tolist().index(self._row)] = np.nan
        return out


def test_a_row_with_non_finite_output_fails_that_request_alone(tts, alone):
    from higgs_pack.errors import NumericalError
    from higgs_pack.runtime.engine.engine import Engine

    with Engine(tts.pipeline, _PoisonedRow(_batched(tts, max_batch=3, max_length=1024), row=1, after=5)) as engine:
        # A decoder that does not state its KV bytes (as OpenVINO's): admission by free rows only.
        assert (engine.kv_bytes_per_position, engine.kv_budget_bytes) == (None, None)
        # admitted together (prefilled whole, stepping together from the first step): joined one
        # by one, the later ones' chunks could outlast the poisoned row's 5 steps
        handles = engine.submit_together([{"text": t, "seed": s, "max_frames": c} for t, s, c in REQUESTS[:3]])
        with pytest.raises(NumericalError, match="llm_decoder returned non-finite"):
            handles[1].result(timeout=60)
        assert engine.stats.max_rows == 3
        for i in (0, 2):
            np.testing.assert_array_equal(handles[i].result(timeout=60).codes, alone[i].codes)


def test_a_prepared_voice_gives_the_codes_of_its_clip(tts, cases_dir):
    """A voice encoded once (``tts.prepare_voice``) speaks as its clip does, alone and in the engine."""
    clip, transcript = cases_dir / "ref_en_16k.wav", (cases_dir / "ref_en_16k.txt").read_text().strip()
    voice = tts.prepare_voice(clip, transcript, name="ref")
    assert voice.codes.dtype == np.int64 and voice.codes.shape[1] == tts.pipeline.constants.num_codebooks
    from_clip = tts.synthesize("Hello there.", ref_audio=clip, ref_text=transcript, seed=3, max_frames=40)
    from_voice = tts.synthesize("Hello there.", voice=voice, seed=3, max_frames=40)
    np.testing.assert_array_equal(from_voice.codes, from_clip.codes)
    with tts.engine(max_batch=2, max_length=512) as engine:
        handle = engine.submit("Hello there.", voice=voice, seed=3, max_frames=40)
        np.testing.assert_array_equal(handle.result(timeout=60).codes, from_clip.codes)
    with pytest.raises(InputError, match="not both"):
        tts.synthesize("Hi.", voice=voice, ref_audio=clip, ref_text=transcript)
    with pytest.raises(InputError, match="voice must be a PreparedVoice"):
        tts.synthesize("Hi.", voice="alloy")
    from higgs_pack.runtime.request import PreparedVoice
    with pytest.raises(InputError, match=r"must lie in 0\.\.1023, got 0\.\.5000"):
        tts.synthesize("Hi.", voice=PreparedVoice(np.full((4, 8), 5000) * np.eye(4, 8, dtype=np.int64), "hi"))


# ------------------------------------------------------------------ KV memory and admission by it


def _positions(tts, i: int) -> int:
    """Peak positions of :data:`REQUESTS` ``i`` on a row (its prompt + audio steps)."""
    from higgs_pack.runtime.loop.text_chunks import chunk_positions

    text, _seed, cap = REQUESTS[i]
    return chunk_positions(tts.pipeline, text, cap)


def test_kv_bytes_per_position_is_layers_x_2_x_kv_heads_x_head_dim_x_itemsize(tts):
    """Read from the dtypes the decoder binds (float32 here): 2 x 2 x 2 x 16 x 4 = 512 B on the
    tiny model, for the batched decoder, the batch-1 decoder and the engine over either."""
    c = tts.pipeline.constants
    expected = c.num_layers * 2 * c.num_key_value_heads * c.head_dim * 4
    assert expected == 512
    batched = _batched(tts)
    assert {b.dtype for b in batched.kv.values()} == {np.dtype(np.float32)} and len(batched.kv) == c.num_layers * 2
    assert batched.kv_bytes_per_position == expected
    assert tts.pipeline.decoder.kv_bytes_per_position == expected and tts.pipeline.decoder.kv_device == "cpu"
    for rows in (3, 1):
        with tts.engine(max_batch=rows, max_length=512) as engine:
            assert engine.kv_bytes_per_position == expected
            assert engine.kv_bytes_in_use == 0
            # The default budget: half of MemAvailable, at most every row full (the tiny model's
            # 3 x 512 x 512 B = 768 KiB is far below half of any machine's free memory).
            assert engine.kv_budget_bytes == rows * 512 * expected


def test_default_budget_is_half_the_available_memory(monkeypatch, tmp_path):
    from higgs_pack.runtime.engine import kv_memory

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16000000 kB\nMemFree:         1000000 kB\nMemAvailable:    8000000 kB\n")
    monkeypatch.setattr(kv_memory, "MEMINFO", meminfo)
    assert kv_memory.available_memory() == (8_000_000 * 1024, f"MemAvailable of {meminfo}")
    # 288 KiB per position (the 4B model at fp32), 8 rows of 4096: 9 GiB full, half of 7.6 GiB wins.
    assert kv_memory.default_kv_budget(288 * 1024, 8, 4096) == 8_000_000 * 1024 // 2
    assert kv_memory.default_kv_budget(512, 8, 4096) == 512 * 8 * 4096
    assert kv_memory.default_kv_budget(None, 8, 4096) is None


def test_chunk_positions_are_the_prompt_and_the_audio_steps(tts, cases_dir):
    """What admission counts is exactly what the row holds: build_prompt's length + cap + N - 1."""
    from higgs_pack.runtime.loop.prompt import build_prompt
    from higgs_pack.runtime.loop.text_chunks import chunk_positions

    n = tts.pipeline.constants.num_codebooks
    clip, transcript = cases_dir / "ref_en_16k.wav", (cases_dir / "ref_en_16k.txt").read_text().strip()
    voice = tts.prepare_voice(clip, transcript)
    for text in ("Hello there.", REQUESTS[1][0]):
        for codes, ref_text in ((None, None), (voice.codes, voice.transcript)):
            prompt = build_prompt(tts.pipeline, text, codes, ref_text).shape[1]
            assert chunk_positions(tts.pipeline, text, 40, codes, ref_text) == prompt + 40 + n - 1


def test_a_budget_for_two_of_three_requests_holds_the_third_until_one_leaves(tts, alone):
    """Three requests, three free rows, KV for the first two: the third waits (for KV, not for a
    row), starts when one leaves, and gives the codes it gives alone."""
    per = tts.pipeline.constants.num_layers * 2 * tts.pipeline.constants.num_key_value_heads \
        * tts.pipeline.constants.head_dim * 4
    picks = [0, 1, 3]
    need = [_positions(tts, i) * per for i in picks]
    budget = need[0] + need[1] + need[2] // 2  # the first two fit, the third does not beside them
    with tts.engine(max_batch=3, max_length=512, max_kv_bytes=budget) as engine:
        assert engine.kv_budget_bytes == budget
        handles = [_submit(engine, tts, i) for i in picks]
        start = engine.stats.steps  # the first may step while the others are planned (a loaded machine)
        _wait_for(lambda: engine.stats.steps >= start + 3, "3 steps after the last submission")
        assert (engine.busy_rows, engine.waiting) == (2, 1)
        assert engine.kv_bytes_in_use == need[0] + need[1]
        results = [h.result(timeout=60) for h in handles]
        assert engine.stats.max_rows == 2 and engine.stats.kv_waits == 1
        assert [h.waited_for_kv for h in handles] == [False, False, True]
        assert engine.stats.max_kv_bytes_in_use <= budget and engine.kv_bytes_in_use == 0
    for got, i in zip(results, picks, strict=True):
        np.testing.assert_array_equal(got.codes, alone[i].codes)


def test_admission_is_first_in_first_out(tts, alone):
    """A large request that does not fit beside the running one holds back a small one behind
    it that would fit (no overtaking, so a stream of small requests cannot starve it)."""
    per = 512
    running, large, small = (_positions(tts, i) * per for i in (1, 3, 4))
    assert running + small < running + large
    budget = running + small  # small fits beside the running one; large does not
    assert large <= budget
    with tts.engine(max_batch=3, max_length=512, max_kv_bytes=budget) as engine:
        first = _submit(engine, tts, 1)
        _wait_for(lambda: engine.stats.steps >= 2, "2 steps")
        queued = [_submit(engine, tts, 3), _submit(engine, tts, 4)]
        _wait_for(lambda: engine.stats.steps >= 6, "6 steps")
        assert (engine.busy_rows, engine.waiting) == (1, 2)
        got = [h.result(timeout=60) for h in (first, *queued)]
    for result, i in zip(got, (1, 3, 4), strict=True):
        np.testing.assert_array_equal(result.codes, alone[i].codes)


def test_a_request_larger_than_the_whole_budget_is_refused_naming_both_sizes(tts, alone):
    from higgs_pack.runtime.engine.kv_memory import mib

    positions = _positions(tts, 0)
    budget = (positions - 10) * 512
    with tts.engine(max_batch=2, max_length=512, max_kv_bytes=budget) as engine:
        with pytest.raises(InputError) as refused:
            _submit(engine, tts, 0)
        message = str(refused.value)
        assert f"needs {mib(positions * 512)} of KV cache ({positions} positions x 512 B)" in message
        assert f"whole KV budget of {mib(budget)} (max_kv_bytes={budget})" in message
        assert "lower max_frames;" in message and message.endswith("set it with max_frames="), message
        assert "tts.engine(max_kv_bytes=...)" in message
        assert engine.waiting == 0
        small = engine.submit("Hi.", seed=0, max_frames=20)  # the engine goes on
        assert small.result(timeout=60).codes.shape[0] > 0
    with pytest.raises(InputError, match="max_kv_bytes must be a whole number >= 1, got 0"):
        tts.engine(max_batch=2, max_kv_bytes=0)


@pytest.mark.skipif(not hasattr(__import__("mmap"), "MAP_PRIVATE"), reason="no private anonymous mmap here")
def test_release_gives_the_rows_kv_pages_back(tts):
    """A released row reads as zeros (its pages were dropped, not just forgotten); the others keep theirs."""
    batched = _batched(tts, max_batch=3, max_length=512)
    h = tts.pipeline.constants.hidden_size
    rng = np.random.default_rng(3)
    for row in (0, 1, 2):
        batched.prefill(row, rng.standard_normal((1, 200, h)).astype(np.float32))
    assert batched.positions_held == 600
    kept = {name: buffer[2, :, :200].copy() for name, buffer in batched.kv.items()}
    batched.release(1)
    assert batched.positions_held == 400
    for name, buffer in batched.kv.items():
        assert buffer[1].nbytes >= 4 * 4096  # several whole pages per row
        page = 4096 // buffer.itemsize
        assert not buffer[1].reshape(-1)[page:-page].any(), name  # the row's whole pages
        np.testing.assert_array_equal(buffer[2, :, :200], kept[name])
        assert buffer[0, :, :200].any()


# ------------------------------------------------------------------ synthesize_many


def test_synthesize_many_in_order_deterministic_and_a_failing_text_alone(tts):
    texts = [text for text, _, _ in REQUESTS]
    texts.insert(2, "Say <|audio|> here.")
    want = {i: tts.synthesize(t, seed=10 + i, max_frames=50) for i, t in enumerate(texts) if i != 2}
    got = list(tts.synthesize_many(texts, max_batch=3, seed=10, max_frames=50))
    assert [i for i, _ in got] == list(range(len(texts)))
    assert isinstance(got[2][1], InputError) and "prompt control token" in str(got[2][1])
    for i, result in got:
        if i != 2:
            np.testing.assert_array_equal(result.codes, want[i].codes)
            np.testing.assert_array_equal(result.samples, want[i].samples)
    again = dict(tts.synthesize_many(iter(texts), max_batch=2, seed=10, max_frames=50, in_order=False))
    assert sorted(again) == list(range(len(texts)))
    for i, result in want.items():
        np.testing.assert_array_equal(again[i].codes, result.codes)


def test_synthesize_many_requests_keep_their_seed_and_bad_options_raise_at_once(tts, alone):
    from higgs_pack.runtime.request import SynthesisRequest

    requests = [SynthesisRequest.create(text, seed=seed, max_frames=cap) for text, seed, cap in REQUESTS[:3]]
    got = list(tts.synthesize_many(requests, max_batch=2, top_k=3))  # options are for str items only
    assert [i for i, _ in got] == [0, 1, 2]
    for (_, result), want in zip(got, alone[:3], strict=True):
        np.testing.assert_array_equal(result.codes, want.codes)
    with pytest.raises(InputError, match="top_p must be in"):
        tts.synthesize_many(["Hi."], top_p=2)  # at the call, before any iteration
    with pytest.raises(InputError, match="unknown synthesis option"):
        tts.synthesize_many(["Hi."], sead=1)
    with pytest.raises(InputError, match="max_batch must be a whole number"):
        tts.synthesize_many(["Hi."], max_batch=0)
    many = tts.synthesize_many(["A long one here."] * 6, max_batch=2, max_frames=300)
    assert next(many)[0] == 0
    many.close()  # leaving early closes the engine; nothing hangs


def test_synthesize_many_refuses_one_string(tts):
    with pytest.raises(InputError, match="got one string"):
        list(tts.synthesize_many("abc"))


def test_read_prefix_copies_the_prefix_alone(tts):
    """A voice prefix read out of a row copies its positions only: it had copied each buffer's
    whole row first (4096 positions: 1.2 GB at full size for a 60 MB prefix, 441 ms of one join)."""
    import tracemalloc

    batched = _batched(tts, max_batch=2, max_length=4096)
    h = tts.pipeline.constants.hidden_size
    batched.prefill(0, np.random.default_rng(0).standard_normal((1, 12, h)).astype(np.float32))
    tracemalloc.start()
    try:
        arrays = batched.read_prefix(0, 10)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    size = sum(a.nbytes for a in arrays.values())
    for name, a in arrays.items():
        np.testing.assert_array_equal(a, batched.kv[name][0, :, :10])
    row = next(iter(batched.kv.values()))[0].nbytes  # one buffer's whole row: 4096 positions
    assert peak < size + row // 2, f"reading {size} B of prefix allocated {peak} B at its peak (a row is {row} B)"

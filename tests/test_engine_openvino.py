"""Issue 19, OpenVINO: the continuous-batching engine on the stateful decoder IR.

:class:`~higgs_pack.runtime.backends.openvino.batched.OvBatchedDecoder` (rows right-aligned in
one state, a joining request prefilled alone and spliced in through the state API, rows that
left dropped by ``beam_idx``) against the batch-1 decoder and against the same requests run
alone, on the real tiny openvino int4 bundle.

Two KV caches: the bundle's own (u8, what the CPU plugin compiles it with), and the same IR
compiled with ``KV_CACHE_PRECISION=f32`` (a real decoder, only that property differs).  With
f32 every result is bit-identical to its run alone: the splice itself loses nothing.  With
u8 the plugin quantizes the dequantized state again on every splice, which can flip one code
of a cached value (measured at bench size: ~0.8 % relative max on a later hidden state), so
hidden states are compared within :data:`U8_TOLERANCE` and codes by agreement.
"""

from __future__ import annotations

import time

import numpy as np
import pytest
from conftest import skip_on_amx

# Without OpenVINO (a runtime venv with only [cpu]) this module skips, naming the package, instead of
# failing collection.
ov = pytest.importorskip("openvino", reason="the OpenVINO engine tests need the openvino package ([openvino] extra)",
                         exc_type=ImportError)
from test_engine import (  # noqa: E402
    EIGHT,
    REQUESTS,
    _PoisonedRow,
    _submit,
    check_cancel_frees_the_row,
    check_synthesize_after_an_engine,
    codes_agreement,
    run_eight_concurrent,
    run_joining_mid_flight,
)

import higgs_pack  # noqa: E402
from higgs_pack.errors import InputError, NumericalError  # noqa: E402
from higgs_pack.runtime.backends import get_backend  # noqa: E402
from higgs_pack.runtime.backends.openvino.batched import OvBatchedDecoder, cache_bytes_per_position  # noqa: E402
from higgs_pack.runtime.backends.openvino.runners import OvStatefulDecoder  # noqa: E402
from higgs_pack.runtime.engine.decoders import SingleRowDecoder  # noqa: E402
from higgs_pack.runtime.engine.engine import Engine  # noqa: E402

#: Largest |batched - alone| / max|alone| of a hidden state with the u8 KV cache (int4 weights
#: in both runs; the difference is the u8 cache quantized again at a splice).
U8_TOLERANCE = 0.03


@pytest.fixture(scope="module", autouse=True)
def stateful_engine():
    """This module tests the spliced stateful decoder, which ``tts.engine`` no longer picks (the
    paged one, tests/test_engine_paged.py): the backend's batched decoder is the stateful one here."""
    backend = type(get_backend("openvino"))

    def stateful(self, pipeline, max_batch, max_length):
        if max_batch == 1:
            return SingleRowDecoder(pipeline.decoder, max_length)
        return self.stateful_batched_decoder(pipeline, max_batch, max_length)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(backend, "batched_decoder", stateful)
        yield


@pytest.fixture(scope="module")
def tts(ov_int4_bundle):
    """The bundle as built: int4 weights, the CPU plugin's u8 KV cache."""
    with higgs_pack.load(ov_int4_bundle, "cpu", cache_dir=False) as loaded:
        yield loaded


def _load(bundle, f32: bool):
    """The bundle loaded on the CPU; ``f32``: its decoder compiled with an f32 KV cache instead."""
    loaded = higgs_pack.load(bundle, "cpu", cache_dir=False)
    if f32:
        old = loaded.pipeline.decoder
        loaded.pipeline.decoder = OvStatefulDecoder(
            ov.Core(), old.path, "CPU", None, {"KV_CACHE_PRECISION": "f32", "PERFORMANCE_HINT": "LATENCY"},
            max_length=old.max_length)
    return loaded


@pytest.fixture(scope="module")
def tts_f32(ov_int4_bundle):
    """The same bundle with its decoder compiled with an f32 KV cache (``KV_CACHE_PRECISION``)."""
    with _load(ov_int4_bundle, f32=True) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def alone_f32(tts_f32):
    return [tts_f32.synthesize(text, seed=seed, max_frames=cap) for text, seed, cap in REQUESTS]


def _decoder(tts, max_batch: int = 4, max_length: int = 512) -> OvBatchedDecoder:
    decoder = get_backend("openvino").stateful_batched_decoder(tts.pipeline, max_batch, max_length)
    assert isinstance(decoder, OvBatchedDecoder)
    return decoder


def _solo(tts, prompt: np.ndarray, steps: np.ndarray) -> np.ndarray:
    """Hidden states [1 + n, H] of ``prompt``'s last position then of each of ``steps`` [n, H],
    run alone on the batch-1 decoder."""
    single = tts.pipeline.decoder
    single.reset()
    out = [single.forward(prompt)[0, -1]]
    out += [single.forward(step[None, None])[0, -1] for step in steps]
    return np.stack(out)


def _schedule(tts, decoder: OvBatchedDecoder, plan: list[tuple[int, int, int]], steps: int, seed: int = 0):
    """Run rows on ``decoder``: ``plan`` = (row, prompt length, step at which it joins); every
    step, all rows that joined step together.  Returns ``{row: (prompt, step inputs, hidden)}``
    with the row's hidden states (prefill's last, then one per step) and the columns after each step."""
    h = tts.pipeline.constants.hidden_size
    rng = np.random.default_rng(seed)
    rows = {row: (rng.standard_normal((1, s, h)).astype(np.float32), rng.standard_normal((steps, h)).astype(np.float32),
                  join) for row, s, join in plan}
    got: dict[int, list[np.ndarray]] = {row: [] for row in rows}
    taken = dict.fromkeys(rows, 0)
    columns = []
    for t in range(steps):
        for row, (prompt, _, join) in rows.items():
            if join == t:
                got[row].append(decoder.prefill(row, prompt)[0, -1])
        busy = sorted(r for r, (_, _, join) in rows.items() if join <= t)
        embeds = np.stack([rows[r][1][taken[r]] for r in busy])[:, None]
        out = decoder.step(np.array(busy), embeds)
        for i, r in enumerate(busy):
            got[r].append(out[i, 0])
            taken[r] += 1
        columns.append(decoder.columns)
    return {r: (rows[r][0], rows[r][1][:taken[r]], np.stack(got[r])) for r in rows}, columns


def _relative(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_the_backend_batches_on_cpu_and_states_the_u8_cache(tts):
    """max_batch > 1 gives the OpenVINO batched decoder; 1 the pipeline's own; its KV bytes per
    position are counted from the precision the compiled model reports (u8: 2 layers x 2 heads
    x (K + V) x (16 + 8 scale/zero-point bytes) = 192 on the tiny model)."""
    openvino = get_backend("openvino")
    assert isinstance(openvino.batched_decoder(tts.pipeline, 1, 512), SingleRowDecoder)
    decoder = _decoder(tts)
    assert "uint8" in str(decoder.compiled.get_property("KV_CACHE_PRECISION"))
    assert decoder.kv_count == "key u8, value u8"
    assert decoder.kv_bytes_per_position == 2 * 2 * 2 * (16 + 8)
    c = tts.pipeline.constants
    assert c.num_layers == 2 and c.num_key_value_heads == 2 and c.head_dim == 16
    with tts.engine(max_batch=3) as engine:
        assert engine.max_batch == 3 and engine.kv_bytes_per_position == 192
    with pytest.raises(InputError, match="max_batch must be >= 1"):
        OvBatchedDecoder(tts.pipeline.decoder, max_batch=0, max_length=64, num_layers=2, kv_heads=2, head_dim=16)


def test_full_size_u8_cache_count():
    """The count at full size (36 layers, 8 KV heads, head_dim 128) from a plugin that reports u8."""
    class Reports:
        def get_property(self, name):
            if name.endswith("_CACHE_PRECISION"):
                return ov.Type.u8
            if name.endswith("GROUP_SIZE"):
                return 0
            raise RuntimeError(name)

    assert cache_bytes_per_position(Reports(), num_layers=36, kv_heads=8, head_dim=128) == (
        36 * 8 * 2 * (128 + 8), "key u8, value u8")

    class Silent:
        def get_property(self, name):
            raise RuntimeError(name)

    assert cache_bytes_per_position(Silent(), num_layers=36, kv_heads=8, head_dim=128)[0] is None


def test_rows_at_different_positions_give_their_hidden_states_alone(tts, tts_f32, capsys):
    """Four rows with prompts of 9, 30, 4 and 17 positions joining at steps 0, 0, 5 and 12:
    every hidden state equals the row's run alone, bit for bit with an f32 cache and within
    :data:`U8_TOLERANCE` with the bundle's u8 cache."""
    skip_on_amx()
    plan = [(0, 9, 0), (1, 30, 0), (2, 4, 5), (3, 17, 12)]
    for loaded, exact in ((tts_f32, True), (tts, False)):
        decoder = _decoder(loaded)
        rows, _ = _schedule(loaded, decoder, plan, steps=20)
        worst = 0.0
        for row, (prompt, steps, got) in rows.items():
            want = _solo(loaded, prompt, steps)
            assert got.shape == want.shape, row
            if exact:
                np.testing.assert_array_equal(got, want, err_msg=f"row {row}")
            worst = max(worst, _relative(got, want))
        assert worst <= U8_TOLERANCE, worst
        assert decoder.splices == 4
        with capsys.disabled():
            print(f"\n{decoder.kv_count} cache: batched vs alone hidden states, max relative difference {worst:.2e}")


def test_splices_shrink_and_grow_the_state(tts_f32):
    """The state is as long as its longest row: a long row that leaves lets the next splice
    shrink it (its padding is dropped), a longer prompt grows it; the rows that stay keep the
    hidden states of their runs alone."""
    loaded, h = tts_f32, tts_f32.pipeline.constants.hidden_size
    decoder = _decoder(loaded)
    rng = np.random.default_rng(3)
    prompts = {0: rng.standard_normal((1, 40, h)), 1: rng.standard_normal((1, 5, h)),
               2: rng.standard_normal((1, 3, h)), 3: rng.standard_normal((1, 60, h))}
    prompts = {r: p.astype(np.float32) for r, p in prompts.items()}
    steps = rng.standard_normal((30, h)).astype(np.float32)
    got1 = [decoder.prefill(1, prompts[1])[0, -1]]
    decoder.prefill(0, prompts[0])
    assert decoder.columns == 40
    for t in range(4):
        got1.append(decoder.step(np.array([0, 1]), np.stack([steps[t], steps[t]])[:, None])[1, 0])
    assert decoder.columns == 44 and decoder.lengths[:2].tolist() == [44, 9]
    decoder.release(0)  # the long row leaves: dropped by beam_idx at the next step
    got1.append(decoder.step(np.array([1]), steps[4][None, None])[0, 0])
    assert decoder.columns == 45  # beam_idx drops rows, not columns
    got2 = [decoder.prefill(2, prompts[2])[0, -1]]
    assert decoder.columns == 10, "the splice keeps row 1's 10 positions only"
    for t in range(5, 8):
        out = decoder.step(np.array([1, 2]), np.stack([steps[t], steps[t - 5]])[:, None])
        got1.append(out[0, 0])
        got2.append(out[1, 0])
    assert decoder.columns == 13
    decoder.prefill(3, prompts[3])
    assert decoder.columns == 60
    for t in range(8, 10):
        out = decoder.step(np.array([1, 2, 3]), np.stack([steps[t], steps[t - 5], steps[t]])[:, None])
        got1.append(out[0, 0])
        got2.append(out[1, 0])
    np.testing.assert_array_equal(np.stack(got1), _solo(loaded, prompts[1], steps[:10]))
    np.testing.assert_array_equal(np.stack(got2), _solo(loaded, prompts[2], steps[:5]))
    for row in (1, 2, 3):
        decoder.release(row)
    assert decoder.columns == 0 and decoder.positions_held == 0


def test_a_row_a_step_leaves_out_rides_along_masked(tts_f32):
    """A busy row that one step does not name keeps its place (a masked position) and goes on
    with the hidden states of its run alone."""
    loaded, h = tts_f32, tts_f32.pipeline.constants.hidden_size
    decoder = _decoder(loaded, max_batch=2)
    rng = np.random.default_rng(5)
    a, b = (rng.standard_normal((1, s, h)).astype(np.float32) for s in (6, 11))
    steps = rng.standard_normal((6, h)).astype(np.float32)
    got = [decoder.prefill(0, a)[0, -1]]
    decoder.prefill(1, b)
    got.append(decoder.step(np.array([0, 1]), np.stack([steps[0], steps[0]])[:, None])[0, 0])
    decoder.step(np.array([1]), steps[1][None, None])  # row 0 sits this one out
    assert decoder.lengths[:2].tolist() == [7, 13]
    for t in range(1, 4):
        got.append(decoder.step(np.array([0, 1]), np.stack([steps[t], steps[t]])[:, None])[0, 0])
    np.testing.assert_array_equal(np.stack(got), _solo(loaded, a, steps[:4]))


def test_a_step_needs_prefilled_rows_and_room(tts):
    decoder = _decoder(tts, max_batch=2, max_length=8)
    h = tts.pipeline.constants.hidden_size
    with pytest.raises(InputError, match=r"rows \[1\] were not prefilled"):
        decoder.step(np.array([1]), np.zeros((1, 1, h), np.float32))
    with pytest.raises(InputError, match=r"row 2 is outside 0\.\.1"):
        decoder.prefill(2, np.ones((1, 3, h), np.float32))
    decoder.prefill(0, np.ones((1, 8, h), np.float32))
    with pytest.raises(InputError, match="9 positions, more than max_length=8"):
        decoder.step(np.array([0]), np.zeros((1, 1, h), np.float32))


def test_the_batch_1_decoder_is_unchanged_by_a_batched_step(ov_int4_bundle):
    """Issue 30 item 5, at the decoder: the batch-1 decoder's hidden states for one prompt and
    its steps are the same before and after the batched decoder (its two infer requests on the
    same compiled model) prefilled two rows of different lengths and stepped them, bit for bit
    with an f32 cache and with the bundle's u8 cache.  With the batch-1 decoder's inputs shared
    (``share_inputs=True``, the default until then) the batched step's ``attention_mask`` landed
    in the batch-1 decoder's mask array, and its second step on differed (by up to 2.1 at
    ``synthesize``'s scale)."""
    for f32 in (True, False):
        with _load(ov_int4_bundle, f32) as loaded:
            h = loaded.pipeline.constants.hidden_size
            rng = np.random.default_rng(11)
            prompt = rng.standard_normal((1, 17, h)).astype(np.float32)
            steps = rng.standard_normal((30, h)).astype(np.float32)
            before = _solo(loaded, prompt, steps)
            decoder = _decoder(loaded, max_batch=3)
            decoder.prefill(0, prompt)
            decoder.prefill(1, prompt[:, :9])
            for t in range(3):
                decoder.step(np.array([0, 1]), np.stack([steps[t], steps[t + 1]])[:, None])
            np.testing.assert_array_equal(_solo(loaded, prompt, steps), before, err_msg=f"f32 cache: {f32}")


def test_a_batch_1_decoder_that_shares_its_inputs_is_refused(tts):
    """Its shared input arrays would receive the batched decoder's inputs (see the test above)."""
    old = tts.pipeline.decoder
    sharing = OvStatefulDecoder(ov.Core(), old.path, "CPU", None, {"PERFORMANCE_HINT": "LATENCY"},
                                max_length=64, share_inputs=True)
    with pytest.raises(InputError, match=r"share_inputs=True.*overwrite its input arrays.*share_inputs=False"):
        OvBatchedDecoder(sharing, max_batch=2, max_length=64, num_layers=2, kv_heads=2, head_dim=16)
    assert not old.shares_inputs


def test_a_per_step_output_outlives_calls_of_other_shapes(tts):
    """A sub-part's per-step outputs (``step_inputs`` shapes) stay as they were through calls of
    other shapes, as the pipeline's runner contract says (the engine embeds a joining prompt on
    the submitting thread while its own thread reads the last step's embedding); a per-step call
    may overwrite them.  OpenVINO's infer request wrote a [1, 50, 8] call's output over the
    [1, 1, 8] call's view once it had run a long one, and a 1-row engine then gave other codes
    from the frame a voice request was submitted at."""
    embed = tts.pipeline.audio_embed
    rng = np.random.default_rng(2)
    long, step, other = (rng.integers(0, 1024, shape) for shape in ((1, 80, 8), (1, 1, 8), (1, 50, 8)))
    embed.run({"codes": long})  # the request's output memory now holds 80 positions
    got = embed.run({"codes": step})["audio_embeds"]
    kept = got.copy()
    embed.run({"codes": other})
    np.testing.assert_array_equal(got, kept)
    again = embed.run({"codes": other[:, :1]})["audio_embeds"]
    assert again is got  # the per-step buffer, no allocation per frame
    np.testing.assert_array_equal(got, embed.run({"codes": other})["audio_embeds"][:, :1])


def test_synthesize_after_an_engine_gives_the_codes_of_before(ov_int4_bundle):
    """Issue 30 item 5 (the closing note of 2026-12-03): after an engine ran on an OpenVINO
    bundle, ``synthesize`` on that same object gave other codes from frame 0 (734... instead of
    725... for "Hello there."); now the same as before, with an f32 cache and with the
    bundle's own u8 cache."""
    for f32 in (True, False):
        with _load(ov_int4_bundle, f32) as loaded:
            check_synthesize_after_an_engine(loaded)


def test_requests_joining_and_leaving_mid_flight_give_their_codes_alone(tts_f32, alone_f32):
    """The joining scenario of tests/test_engine.py on the spliced state; rows leave as requests
    end. With the f32 cache each one's codes and samples equal its run alone."""
    def spliced_five(engine) -> None:
        assert engine.decoder.splices == 5 and engine.decoder.columns == 0

    # Whole prompts: OpenVINO's prefill of a prompt in chunks is not bit-identical to one infer
    # (kernel blocks differ with the length; tests/test_prefix_cache.py measures the agreement).
    results = run_joining_mid_flight(tts_f32, timeout=120, check_engine=spliced_five, prefill_chunk=0)
    for got, want in zip(results, alone_f32, strict=True):
        np.testing.assert_array_equal(got.codes, want.codes)
        np.testing.assert_array_equal(got.samples, want.samples)


def test_eight_concurrent_requests(ov_int4_bundle, capsys):
    """Issue 19: eight requests at once from eight threads on eight rows of the spliced state:
    with the f32 cache each gives its codes alone; with the bundle's own u8 cache every request
    ends and the agreement with its run alone is reported.  The runs alone come from a bundle
    loaded for them (written while ``synthesize`` after an engine gave other codes, issue 30
    item 5, since fixed)."""
    skip_on_amx()
    for f32 in (True, False):
        with _load(ov_int4_bundle, f32) as fresh:
            single = [fresh.synthesize(text, seed=seed, max_frames=cap) for text, seed, cap in EIGHT]
        with _load(ov_int4_bundle, f32) as loaded:
            # whole prompts: a submit that lands after the first step joins mid-flight, and a chunked
            # prefill is not bit-identical to a whole one on OpenVINO's CPU plugin (e2a9c2d)
            batched = run_eight_concurrent(loaded, timeout=240, prefill_chunk=0)
        if f32:
            for got, want in zip(batched, single, strict=True):
                np.testing.assert_array_equal(got.codes, want.codes)
        else:
            same, total = codes_agreement(single, batched)
            with capsys.disabled():
                print(f"\nOpenVINO u8 KV, 8 concurrent requests batched vs alone: {same}/{total} frames equal")
            assert same / total >= 0.5


def test_u8_codes_batched_versus_alone(tts, capsys):
    """The bundle's own u8 cache: report the fraction of frames equal to the run alone (a
    splice re-quantizes the rows it keeps, so sampling can part ways after one).  Prompts are
    prefilled whole (``prefill_chunk=0``): chunks riding in the steps round differently again with
    their size (chunks from 2 positions up: 150 of 320 frames), which is not what this measures."""
    single = [tts.synthesize(text, seed=seed, max_frames=cap) for text, seed, cap in REQUESTS]
    with tts.engine(max_batch=4, prefill_chunk=0) as engine:
        batched = [_submit(engine, tts, i).result(timeout=120) for i in range(1)]
        handles = [_submit(engine, tts, i) for i in range(1, len(REQUESTS))]
        batched += [h.result(timeout=120) for h in handles]
    same = total = exact = 0
    for a, b in zip(single, batched, strict=True):
        n = min(len(a.codes), len(b.codes))
        same += int((a.codes[:n] == b.codes[:n]).all(axis=1).sum())
        total += max(len(a.codes), len(b.codes))
        exact += int(np.array_equal(a.codes, b.codes))
    with capsys.disabled():
        print(f"\nOpenVINO u8 KV, batched vs alone: {same}/{total} frames equal ({same / total:.3f}), "
              f"{exact}/{len(REQUESTS)} requests identical")
    np.testing.assert_array_equal(batched[0].codes, single[0].codes)  # alone in the engine: no splice beside it
    assert same / total >= 0.5


def test_cancel_frees_the_row_at_the_next_step(tts_f32, alone_f32):
    """Cancelling a row drops its state row at the next step and a queued request runs with its
    codes alone (the scenario of tests/test_engine.py, on the spliced OpenVINO state)."""
    check_cancel_frees_the_row(tts_f32, alone_f32, timeout=120, prefill_chunk=0)  # it joins mid-stream


def test_a_row_with_non_finite_output_fails_that_request_alone(tts_f32, alone_f32):
    with Engine(tts_f32.pipeline, _PoisonedRow(_decoder(tts_f32, max_batch=3, max_length=1024), row=1,
                                                after=5), prefill_chunk=0) as engine:  # a late one: whole
        handles = [_submit(engine, tts_f32, i) for i in range(3)]
        with pytest.raises(NumericalError, match="llm_decoder returned non-finite"):
            handles[1].result(timeout=120)
        assert engine.stats.max_rows == 3
        for i in (0, 2):
            np.testing.assert_array_equal(handles[i].result(timeout=120).codes, alone_f32[i].codes)


def test_splice_time_is_recorded(tts):
    decoder = _decoder(tts)
    h = tts.pipeline.constants.hidden_size
    t = time.perf_counter()
    decoder.prefill(0, np.ones((1, 5, h), np.float32))
    decoder.prefill(1, np.ones((1, 7, h), np.float32))
    assert 0 < decoder.last_splice_seconds <= decoder.splice_seconds <= time.perf_counter() - t

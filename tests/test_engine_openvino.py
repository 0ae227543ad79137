"""The continuous-batching engine on an OpenVINO bundle (issues 19, 30 and 39), on the real tiny
openvino int4 bundle: the backend's engine for ``max_batch > 1`` is the paged one
(runtime/backends/openvino/paged.py; the decoder itself is tested in tests/test_engine_paged.py,
random join/leave/cancel schedules in tests/test_engine_schedules.py); here what any engine must
do on this backend: a batch-1 decoder that batched steps leave unchanged, eight concurrent
requests, a failing row that fails its request alone, and the sub-part runners' per-step outputs.

Exactness: the paged engine's codes are compared with the same request alone on the paged
engine (another attention kernel than the batch-1 decoder's; tests/test_engine_paged.py says
why), bit for bit under the compile properties where packed rows are bit-identical to rows alone
(``exact_config``: bf16 inference with a bf16 cache), by agreement with the bundle's own u8 cache.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import cpu_has_amx, skip_on_amx

# Without OpenVINO (a runtime venv with only [cpu]) this module skips, naming the package, instead of
# failing collection.
ov = pytest.importorskip("openvino", reason="the OpenVINO engine tests need the openvino package ([openvino] extra)",
                         exc_type=ImportError)
from test_engine import (  # noqa: E402
    EIGHT,
    REQUESTS,
    check_synthesize_after_an_engine,
    codes_agreement,
    run_eight_concurrent,
)
from test_engine_paged import _alone, exact_config  # noqa: E402

import higgs_pack  # noqa: E402
from higgs_pack.errors import NumericalError  # noqa: E402
from higgs_pack.runtime.backends import get_backend  # noqa: E402
from higgs_pack.runtime.backends.openvino.devices import thread_config  # noqa: E402
from higgs_pack.runtime.backends.openvino.paged import OvPagedDecoder  # noqa: E402
from higgs_pack.runtime.backends.openvino.runners import OvStatefulDecoder  # noqa: E402
from higgs_pack.runtime.engine.decoders import SingleRowDecoder  # noqa: E402
from higgs_pack.runtime.engine.engine import Engine  # noqa: E402

#: Compile properties of a decoder whose every cache and product is f32.
F32 = {"KV_CACHE_PRECISION": "f32", "INFERENCE_PRECISION_HINT": "f32"}


def _load(bundle, config: dict[str, str] | None = None):
    """The bundle loaded on the CPU; ``config``: its decoder compiled with these properties instead."""
    loaded = higgs_pack.load(bundle, "cpu", cache_dir=False)
    if config is not None:
        old = loaded.pipeline.decoder
        loaded.pipeline.decoder = OvStatefulDecoder(ov.Core(), old.path, "CPU", None,
                                                    {**config, "PERFORMANCE_HINT": "LATENCY"}, max_length=old.max_length)
    return loaded


@pytest.fixture(scope="module")
def tts(ov_int4_bundle):
    """The bundle as built: int4 weights, the CPU plugin's u8 KV cache."""
    with _load(ov_int4_bundle) as loaded:
        yield loaded


def test_the_backend_batches_on_the_paged_decoder_and_one_row_on_the_bundles_own(tts):
    """``max_batch > 1`` is the paged decoder, stating its KV bytes from the cache it compiled
    (the CPU's u8 blocks: 176 B a position on the tiny model); 1 the bundle's own decoder."""
    openvino = get_backend("openvino")
    one = openvino.batched_decoder(tts.pipeline, 1, 512)
    assert isinstance(one, SingleRowDecoder)
    paged = openvino.batched_decoder(tts.pipeline, 3, 512)
    assert isinstance(paged, OvPagedDecoder) and paged.max_batch == 3 and paged.packs_prefill
    with tts.engine(max_batch=3) as engine:
        assert isinstance(engine.decoder, OvPagedDecoder) and engine.kv_bytes_per_position == 176


def test_the_engine_decodes_on_unpinned_cpu_threads(ov_int4_bundle):
    """The CPU plugin's threads are not pinned to cores (``thread_config``): pinned, a fresh engine
    whose thread the kernel put on a pinned worker's core stepped 1.8x slower for its whole life."""
    tts = higgs_pack.load(ov_int4_bundle)
    assert tts.pipeline.decoder.config["ENABLE_CPU_PINNING"] is False  # the batch-1 decoder's properties
    with tts.engine(max_batch=2) as engine:  # the paged decoder, compiled from them
        assert engine.decoder.compiled.get_property("ENABLE_CPU_PINNING") is False
    assert thread_config("CPU") == {"ENABLE_CPU_PINNING": False} and thread_config("GPU.0") == {}


def test_the_batch_1_decoder_is_unchanged_by_a_batched_engine(ov_int4_bundle):
    """Issue 30 item 5: after an engine ran on an OpenVINO bundle, ``synthesize`` on that same
    object gave other codes from frame 0 (the spliced engine's infers wrote into the batch-1
    decoder's shared input arrays).  On the paged engine, with f32 products and cache and with
    the bundle's own u8 cache: the codes and samples after equal those before."""
    for config in (F32, None):
        with _load(ov_int4_bundle, config) as loaded:
            check_synthesize_after_an_engine(loaded)


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


def test_eight_concurrent_requests(ov_int4_bundle, capsys):
    """Issue 19: eight requests at once from eight threads on eight rows of the paged engine: under
    ``exact_config`` each gives its codes alone on the paged engine; with the bundle's own u8 cache
    every request ends and the agreement with its run alone is reported."""
    skip_on_amx()
    for config in (exact_config(), None):
        with _load(ov_int4_bundle, config) as loaded:
            single = [_alone(loaded, *request) for request in EIGHT]
            batched = run_eight_concurrent(loaded, timeout=240)
        if config is not None:
            for got, want in zip(batched, single, strict=True):
                np.testing.assert_array_equal(got.codes, want.codes)
        else:
            same, total = codes_agreement(single, batched)
            with capsys.disabled():
                print(f"\nOpenVINO paged, u8 KV, 8 concurrent requests batched vs alone: {same}/{total} frames equal")
            # Sampled codes part at the first frame the u8 rounding of 8 rows differs from one's, and
            # random weights amplify it: 205-210 of 480 frames on an Intel Xeon with AVX-512 VNNI and
            # no AMX (OpenVINO 2026.4.1); the exact run above is the equality check.
            assert same / total >= 0.25


class _PoisonedPaged:
    """The real paged decoder, with row ``row``'s hidden state made NaN from step ``after`` on (a
    broken kernel on one row: the fault is ours, the decoder is OpenVINO's), in plain steps and in
    steps a prompt chunk rides in alike."""

    def __init__(self, decoder: OvPagedDecoder, row: int, after: int):
        self._decoder, self._row, self._after, self._steps = decoder, row, after, 0

    def __getattr__(self, name):
        return getattr(self._decoder, name)

    def step(self, rows, inputs_embeds, prefill=None):
        out = self._decoder.step(rows, inputs_embeds, prefill)
        hidden = out[0] if prefill is not None else out
        self._steps += 1
        if self._steps >= self._after and self._row in rows.tolist():
            hidden[rows.tolist().index(self._row)] = np.nan
        return out


def test_a_row_with_non_finite_output_fails_that_request_alone(ov_int4_bundle):
    """The poisoned row's request fails with the non-finite output named; the other rows go on to
    their whole frame caps, under ``exact_config`` with their codes alone on the paged engine
    (on a CPU without AMX)."""
    with _load(ov_int4_bundle, exact_config()) as tts:
        alone = [_alone(tts, *request) for request in REQUESTS[:3]]
        decoder = _PoisonedPaged(get_backend("openvino").batched_decoder(tts.pipeline, 3, 1024), row=1, after=5)
        with Engine(tts.pipeline, decoder) as engine:
            handles = engine.submit_together([{"text": t, "seed": s, "max_frames": c} for t, s, c in REQUESTS[:3]])
            with pytest.raises(NumericalError, match="llm_decoder returned non-finite"):
                handles[1].result(timeout=120)
            assert engine.stats.max_rows == 3
            for i in (0, 2):
                got = handles[i].result(timeout=120).codes
                if cpu_has_amx():  # several rows round apart from one there (conftest.skip_on_amx): whole, not equal
                    assert got.shape == alone[i].codes.shape
                else:
                    np.testing.assert_array_equal(got, alone[i].codes)

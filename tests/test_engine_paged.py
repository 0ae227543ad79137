"""Issue 39: the OpenVINO engine on PagedAttention (runtime/backends/openvino/paged.py), on the
real tiny openvino int4 bundle: OpenVINO's own SDPAToPagedAttention pass applied at load to its
stateful decoder IR, driven row by row, packed, and with voice prefixes as shared blocks.

Exactness: the paged model with an f32 cache and f32 inference gives the stateful decoder's
hidden states to ~5e-7 (another attention kernel: not bit-identical, so the paged engine's
codes are compared with the same request alone *on the paged decoder*).  With the CPU plugin's
bf16 inference and a bf16 cache (this CPU's default inference precision), a row's hidden states
in a packed forward (decode rows with a joining row's prompt chunk riding along) are
bit-identical to the same row run alone; with f32 inference the matrix products of several
tokens round ~1e-7 apart from those of one.
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import skip_on_amx, slow_fixture

ov = pytest.importorskip("openvino", reason="the paged engine tests need the openvino package ([openvino] extra)",
                         exc_type=ImportError)

import higgs_pack  # noqa: E402
from higgs_pack.errors import ExecutionProviderUnavailable, SignatureMismatch  # noqa: E402
from higgs_pack.runtime.backends.openvino.paged import (  # noqa: E402
    PAGED_INPUTS,
    OvPagedDecoder,
    compile_paged,
    paged_model,
)
from higgs_pack.runtime.backends.openvino.runners import OvStatefulDecoder  # noqa: E402

F32 = {"KV_CACHE_PRECISION": "f32", "INFERENCE_PRECISION_HINT": "f32"}
H = 64  # the tiny model's hidden size


def exact_config() -> dict[str, str]:
    """Compile properties under which packed rows are bit-identical to rows alone (module
    docstring): the CPU's bf16 inference with a bf16 cache; skips where the CPU computes in f32."""
    hint = str(ov.Core().get_property("CPU", "INFERENCE_PRECISION_HINT"))
    if "bf16" not in hint and "bfloat16" not in hint:
        pytest.skip(f"this CPU infers in {hint}: packed rows are bit-identical to rows alone with bf16 inference")
    return {"KV_CACHE_PRECISION": "bf16"}


def _stateful(bundle, config) -> OvStatefulDecoder:
    return OvStatefulDecoder(ov.Core(), bundle / "llm_decoder" / "llm_decoder.xml", "CPU", None, config,
                             max_length=512)


def _paged(bundle, config, max_batch: int = 4) -> OvPagedDecoder:
    return OvPagedDecoder(compile_paged(_stateful(bundle, config), 2), max_batch=max_batch, max_length=512,
                          device="CPU", initial_blocks=2)


def _embeds(rng, n: int) -> np.ndarray:
    return rng.standard_normal((1, n, H)).astype(np.float32)


def test_the_pass_gives_one_paged_attention_per_layer(ov_int4_bundle):
    """The bundle's decoder IR as OpenVINO's pass turns it, compiled with the bundle's own
    properties (int4 weights, u8 cache): the inputs this module feeds, the CPU's 32-position
    blocks, bytes counted from the cache layout; an IR the pass does not match is refused."""
    core = ov.Core()
    model = paged_model(core, ov_int4_bundle / "llm_decoder" / "llm_decoder.xml", 2)
    names = {p.get_any_name() for p in model.inputs}
    assert set(PAGED_INPUTS) <= names and {"key_cache.0", "value_cache.1"} <= names
    assert "attention_mask" not in names and "beam_idx" not in names
    with higgs_pack.load(ov_int4_bundle, "cpu", cache_dir=False) as tts, tts.engine(max_batch=2) as engine:
        decoder = engine.decoder
        assert isinstance(decoder, OvPagedDecoder) and decoder.block_size == 32
        # u8: value [2 heads, 32, 16 + 8 scale/zero point], key by channel [2, 32 + 8, 16]
        assert decoder.prefix_layout == "openvino:paged:CPU:32:key_cacheu8[2, 40, 16]/value_cacheu8[2, 32, 24]"
        assert decoder.block_bytes == 2 * (2 * 40 * 16 + 2 * 32 * 24)
        assert engine.kv_bytes_per_position == -(-decoder.block_bytes // 32)
    with pytest.raises(SignatureMismatch, match=r"SDPAToPagedAttention refused the decoder IR .*stateful"):
        paged_model(core, ov_int4_bundle / "audio_heads.xml", 2)  # a stateless IR
    with pytest.raises(SignatureMismatch, match="gave 2 PagedAttentionExtension ops for 3 layers"):
        paged_model(core, ov_int4_bundle / "llm_decoder" / "llm_decoder.xml", 3)


def test_an_f32_cache_with_bf16_inference_is_refused_naming_both(ov_int4_bundle):
    exact_config()  # only where the CPU infers in bf16 by default
    with pytest.raises(ExecutionProviderUnavailable, match="KV_CACHE_PRECISION=f32 and INFERENCE_PRECISION_HINT="
                                                           "the device's default"):
        _paged(ov_int4_bundle, {"KV_CACHE_PRECISION": "f32"})


def test_a_row_gives_the_stateful_decoders_hidden_states(ov_int4_bundle):
    """One row prefilled (45 positions: two blocks) then 60 steps (into a third and fourth
    block, the pool growing from 2 blocks) against the stateful decoder, both f32."""
    rng = np.random.default_rng(0)
    stateful, paged = _stateful(ov_int4_bundle, F32), _paged(ov_int4_bundle, F32)
    prompt = _embeds(rng, 45)
    worst = np.abs(stateful.forward(prompt) - paged.prefill(0, prompt)).max()
    for _ in range(60):
        step = _embeds(rng, 1)
        worst = max(worst, np.abs(stateful.forward(step) - paged.step(np.array([0]), step)).max())
    assert worst < 5e-6, worst
    assert paged.lengths[0] == 105 and len(paged.tables[0]) == 4 and paged.pool.capacity >= 4
    paged.release(0)
    assert paged.pool.in_use == 0 and paged.kv_bytes_in_use == 0


def test_engines_share_one_compiled_paged_model(ov_int4_bundle):
    """The paged model is compiled once per stateful decoder: every engine of a bundle (each with
    its own infer request and block pool) runs the same compiled model, not a copy of the weights
    each; two decoders on it, stepped in turn, give the hidden states of a decoder compiled apart."""
    with (higgs_pack.load(ov_int4_bundle, "cpu", cache_dir=False) as tts, tts.engine(max_batch=2) as first,
          tts.engine(max_batch=3) as second):
        assert first.decoder.compiled is second.decoder.compiled
        assert first.decoder._request is not second.decoder._request
    stateful = _stateful(ov_int4_bundle, F32)
    assert compile_paged(stateful, 2) is compile_paged(stateful, 2)
    a, b = (OvPagedDecoder(compile_paged(stateful, 2), max_batch=2, max_length=512, device="CPU", initial_blocks=2)
            for _ in range(2))
    apart = _paged(ov_int4_bundle, F32)
    assert apart.compiled is not a.compiled
    rng = np.random.default_rng(3)
    prompts, steps = (_embeds(rng, 40), _embeds(rng, 33)), rng.standard_normal((5, 2, 1, H)).astype(np.float32)
    got = [[a.prefill(0, prompts[0])], [b.prefill(0, prompts[1])]]
    for s in steps:
        got[0].append(a.step(np.array([0]), s[:1]))
        got[1].append(b.step(np.array([0]), s[1:]))
    for i in (0, 1):
        want = [apart.prefill(0, prompts[i])] + [apart.step(np.array([0]), s[i:i + 1]) for s in steps]
        for g, w in zip(got[i], want, strict=True):
            np.testing.assert_array_equal(g, w)


def test_a_packed_forward_gives_each_row_its_hidden_states_alone(ov_int4_bundle):
    """Two rows decoding while a third's 45-position prompt rides along in chunks of 9: the
    chunks' hidden states equal the prompt prefilled whole alone, and the rows' steps equal
    their steps alone, bit for bit (bf16 inference and cache)."""
    skip_on_amx()
    config = exact_config()
    rng = np.random.default_rng(1)
    alone, packed = _paged(ov_int4_bundle, config), _paged(ov_int4_bundle, config)
    prompts = [_embeds(rng, n) for n in (20, 70, 45)]
    steps = rng.standard_normal((6, 2, 1, H)).astype(np.float32)
    want = []
    for row in (0, 1):
        alone.prefill(0, prompts[row])
        want.append(np.concatenate([alone.step(np.array([0]), s[row:row + 1]) for s in steps]))
    whole = alone.prefill(0, prompts[2])
    for row in (0, 1):
        packed.prefill(row, prompts[row])
    got, chunks = [], []
    for i, start in enumerate(range(0, 45, 9)):
        hidden, chunk = packed.step(np.array([0, 1]), steps[i], prefill=(2, prompts[2][:, start:start + 9], start))
        got.append(hidden)
        chunks.append(chunk)
    got.append(packed.step(np.array([0, 1]), steps[5]))
    np.testing.assert_array_equal(np.concatenate(chunks, axis=1), whole)
    for row in (0, 1):
        np.testing.assert_array_equal(np.stack([g[row] for g in got]), want[row])
    assert packed.packed_forwards == 5 and packed.lengths[:3].tolist() == [26, 76, 45]


class _Recorder:
    """An infer request that keeps a copy of every feed and gives zeros of the output's shape
    [T, 1, H]."""

    def __init__(self, request, output):
        self.request, self.output, self.feeds = request, output, []

    def infer(self, feeds):
        self.feeds.append({k: np.array(v, copy=True) for k, v in feeds.items()})
        return {self.output: np.zeros((feeds["inputs_embeds"].shape[0], 1, H), np.float32)}

    def set_tensor(self, name, tensor):
        self.request.set_tensor(name, tensor)


def test_a_packed_forward_feeds_the_paged_inputs(ov_int4_bundle):
    """What a forward feeds: two decode rows (at 40 and 3 positions) and a 5-position chunk
    riding along from position 32 give the packed positions, past lengths, sequence begins and
    block tables the PagedAttention inputs take, in the types the transformed model declares."""
    rng = np.random.default_rng(4)
    decoder = _paged(ov_int4_bundle, F32)
    decoder._request = recorder = _Recorder(decoder._request, decoder._output)
    decoder.prefill(0, _embeds(rng, 40))
    decoder.prefill(1, _embeds(rng, 3))
    decoder.prefill(2, _embeds(rng, 32))
    steps, chunk = rng.standard_normal((2, 1, H)).astype(np.float32), _embeds(rng, 5)
    decoder.step(np.array([0, 1]), steps, prefill=(2, chunk, 32))
    fed = recorder.feeds[-1]
    np.testing.assert_array_equal(fed["inputs_embeds"], np.concatenate([steps[:, 0], chunk[0]]))
    assert fed["position_ids"].tolist() == [40, 3, 32, 33, 34, 35, 36]
    assert fed["past_lens"].tolist() == [40, 3, 32] and fed["subsequence_begins"].tolist() == [0, 1, 2, 7]
    tables = [decoder.tables[r] for r in (0, 1, 2)]
    assert [len(t) for t in tables] == [2, 1, 2]
    assert fed["block_indices"].tolist() == tables[0] + tables[1] + tables[2]
    assert fed["block_indices_begins"].tolist() == [0, 2, 3, 5] and int(fed["max_context_len"]) == 41
    assert {k: v.dtype for k, v in fed.items() if k != "inputs_embeds"} == {
        "position_ids": np.int64, "past_lens": np.int32, "subsequence_begins": np.int32, "block_indices": np.int32,
        "block_indices_begins": np.int32, "max_context_len": np.int32}
    assert decoder.lengths[:3].tolist() == [41, 4, 37]


def test_a_voice_prefix_is_shared_blocks(ov_int4_bundle):
    """A 40-position prefix read from the row that computed it: a second row restoring it names
    its full block (one more reference, no copy) and gets its own copy of the partly filled
    second block; both rows then go on exactly as the row alone.  A persisted copy of the same
    blocks (another object) restores into blocks of its own, bit for bit.  Bytes in use count
    a shared block once; blocks that do not fit are refused with nothing changed."""
    rng = np.random.default_rng(2)
    decoder = _paged(ov_int4_bundle, F32)
    prefix, rest, step = _embeds(rng, 40), _embeds(rng, 7), _embeds(rng, 1)
    decoder.prefill(0, prefix)
    arrays = decoder.read_prefix(0, 40)
    assert {a.shape[0] for a in arrays.values()} == {2} and arrays["key_cache.0"].dtype == np.float32
    want = decoder.prefill(0, rest, start=40)
    want_step = decoder.step(np.array([0]), step)
    decoder.write_prefix(1, arrays, 40)
    first, second = decoder.tables[0], decoder.tables[1]
    assert second[0] == first[0] and decoder.pool.refs(first[0]) == 2, "the full block is shared"
    assert second[1] != first[1], "the partly filled block is the row's own copy"
    assert decoder.shared_prefix_blocks == 1 and decoder.kv_bytes_in_use == 3 * decoder.block_bytes
    np.testing.assert_array_equal(decoder.prefill(1, rest, start=40), want)
    np.testing.assert_array_equal(decoder.step(np.array([1]), step), want_step)
    persisted = {name: a.copy() for name, a in arrays.items()}  # as read back from a safetensors file
    decoder.write_prefix(2, persisted, 40)
    assert not set(decoder.tables[2]) & set(first)
    np.testing.assert_array_equal(decoder.prefill(2, rest, start=40), want)
    decoder.release(0)
    assert decoder.pool.refs(first[0]) == 1, "row 1 still names the prefix block"
    with pytest.raises(KeyError, match="not the paged cache"):
        decoder.write_prefix(3, {"key_cache.0": arrays["key_cache.0"]}, 40)
    with pytest.raises(ValueError, match="not the 1 blocks of float32"):
        decoder.write_prefix(3, arrays, 20)
    assert 3 not in decoder.tables
    for row in (1, 2):
        decoder.release(row)
    assert decoder.pool.in_use == 0


@slow_fixture(scope="module")
def tts_exact(ov_int4_bundle):
    """The bundle with its decoder compiled as :func:`exact_config` says (the paged engine's
    rows then give their codes alone bit for bit)."""
    config = exact_config()
    with higgs_pack.load(ov_int4_bundle, "cpu", cache_dir=False) as loaded:
        old = loaded.pipeline.decoder
        loaded.pipeline.decoder = OvStatefulDecoder(ov.Core(), old.path, "CPU", None, config, max_length=old.max_length)
        yield loaded


REQUESTS = [("Hello there.", 0, 40), ("A somewhat longer sentence to say, with more words in it.", 1, 50),
            ("Short one.", 2, 30)]


def _alone(tts, text, seed, cap, **extra):
    """The request alone on a paged engine of its own: the result its runs beside others must give."""
    with tts.engine(max_batch=2) as engine:
        return engine.submit(text, seed=seed, max_frames=cap, **extra).result(timeout=120)


def test_admission_counts_blocks_and_a_request_waits_never_fails(tts_exact):
    """A KV budget of the blocks two requests need: the third waits for a row's blocks (admitted
    by whole blocks, its peak), every request ends with its codes alone, and the pool never
    grows past the budget."""
    skip_on_amx()
    alone = [_alone(tts_exact, *r).codes for r in REQUESTS]
    with tts_exact.engine(max_batch=3) as probe:
        block_bytes, per_block = probe.decoder.block_bytes, probe.decoder.block_size
        need = [probe.kv.request_bytes(probe.submit(t, seed=s, max_frames=c).plan.positions) for t, s, c in REQUESTS]
    assert all(n % block_bytes == 0 for n in need), "a request counts whole blocks"
    budget = max(need[0] + need[1], need[1] + need[2], need[0] + need[2])
    with tts_exact.engine(max_batch=3, max_kv_bytes=budget) as engine:
        assert engine.decoder.max_blocks == -(-budget // block_bytes) and per_block == 32
        handles = [engine.submit(t, seed=s, max_frames=c) for t, s, c in REQUESTS]
        codes = [h.result(timeout=120).codes for h in handles]
        assert engine.stats.kv_waits == 1 and engine.stats.max_rows == 2
        assert engine.decoder.pool.capacity <= engine.decoder.max_blocks
        assert engine.kv_blocks_in_use == 0 and engine.kv_bytes_in_use == 0
    for got, want in zip(codes, alone, strict=True):
        np.testing.assert_array_equal(got, want)


def test_rows_of_one_voice_name_its_prefix_blocks_once(tts_exact, cases_dir):
    """Three requests of one prepared voice at once: the first computes the voice prefix and
    keeps it; the two that restore it name its full blocks (shared, not copied), the blocks in
    use are one prefix plus three tails, and each request gives its codes alone."""
    clip, transcript = cases_dir / "ref_en_16k.wav", (cases_dir / "ref_en_16k.txt").read_text().strip()
    voice = tts_exact.prepare_voice(clip, transcript, "clip")
    texts = [("The voice reads this line.", 3, 30), ("Another line, same voice.", 4, 30), ("A third.", 5, 30)]
    tts_exact.pipeline.prefix_cache.clear()
    alone = [_alone(tts_exact, t, s, c, voice=voice).codes for t, s, c in texts]
    tts_exact.pipeline.prefix_cache.clear()
    seen = []
    with tts_exact.engine(max_batch=3, prefill_chunk=0) as engine:
        first = engine.submit(texts[0][0], seed=texts[0][1], max_frames=texts[0][2], voice=voice)
        while engine.stats.steps < 2:  # the first has computed and kept the prefix
            pass
        others = [engine.submit(t, seed=s, max_frames=c, voice=voice) for t, s, c in texts[1:]]
        while not all(h.done for h in [first, *others]):
            seen.append((engine.prefix_blocks_shared or 0, engine.kv_blocks_in_use or 0, engine.busy_rows))
        codes = [h.result(timeout=120).codes for h in [first, *others]]
        assert engine.stats.prefix_hits == 2 and engine.stats.prefix_misses == 1
        decoder = engine.decoder
    prefix = max(s for s, _, _ in seen)
    assert prefix >= 1, "the restoring rows named the prefix's blocks"
    # three rows at once: one prefix (full blocks) + each row's own partial block and tail blocks
    three = [blocks for shared, blocks, rows in seen if rows == 3 and shared == prefix]
    assert three and min(three) < 3 * (prefix + 1), (prefix, min(three))
    assert decoder.pool.in_use == 0
    for got, want in zip(codes, alone, strict=True):
        np.testing.assert_array_equal(got, want)


class _Store:
    """A voices folder: every voice's prefix persists in ``root`` (the server's store names them),
    signed with a key of its own (the PrefixStore protocol's signing_key)."""

    signing_key = b"k" * 32

    def __init__(self, root):
        self.root = root

    def prefix_path(self, voice: str):
        return self.root / f"{voice[:16]}.prefix.safetensors"


def test_a_persisted_voice_prefix_restores_into_blocks(tts_exact, cases_dir, tmp_path):
    """The paged engine's prefix entry (raw u8/bf16 blocks) persisted as safetensors, read back
    by a fresh cache (memory empty) and restored into blocks: the request gives its codes alone."""
    from higgs_pack.runtime.loop.prefix_cache import PrefixCache

    voice = tts_exact.prepare_voice(cases_dir / "ref_en_16k.wav", (cases_dir / "ref_en_16k.txt").read_text().strip(),
                                    "clip")
    kept = tts_exact.pipeline.prefix_cache
    try:
        want = _alone(tts_exact, "Read back from the voices folder.", 6, 30, voice=voice).codes
        for round_ in range(2):
            cache = tts_exact.pipeline.prefix_cache = PrefixCache(kept.identity, store=_Store(tmp_path))
            got = _alone(tts_exact, "Read back from the voices folder.", 6, 30, voice=voice).codes
            np.testing.assert_array_equal(got, want)
            assert (cache.stats.disk_writes, cache.stats.disk_loads) == ((1, 0) if round_ == 0 else (0, 1))
        assert len(list(tmp_path.glob("*.prefix.safetensors"))) == 1
    finally:
        tts_exact.pipeline.prefix_cache = kept


def test_the_paged_engine_joins_at_one_and_a_half_steps_by_default(ov_int4_bundle):
    """A chunk that rides in the step defaults to half a step (issue 39's goal); a decoder whose
    chunks are forwards of their own (ONNX Runtime's) keeps two; a value given is kept."""
    from higgs_pack.runtime.engine.engine import DEFAULT_JOIN_GAP_STEPS, PACKED_JOIN_GAP_STEPS

    tts = higgs_pack.load(ov_int4_bundle, "cpu")
    with tts.engine(max_batch=2) as engine:
        assert engine.decoder.packs_prefill and engine.join_gap_steps == PACKED_JOIN_GAP_STEPS == 1.5
    with tts.engine(max_batch=2, join_gap_steps=2.5) as engine:
        assert engine.join_gap_steps == 2.5
    assert DEFAULT_JOIN_GAP_STEPS == 2.0


def test_verify_judges_the_paged_decoder_and_fails_it_against_a_broken_reference(ov_int4_bundle, tmp_path):
    """``verify``'s OpenVINO check of the paged engine's decoder (issue 39 item 4): on the bundle
    as built its u8 cache passes the decoder's parity rule against the oracle's references; the
    same bundle whose stored step reference is off by 10 % fails it, saying the export error."""
    import shutil

    from higgs_pack.runtime.sources.bundle import load_pipeline, open_bundle
    from higgs_pack.runtime.verification.backend_checks import check_paged_decoder
    from higgs_pack.runtime.verification.report import VerifyReport

    pipeline = load_pipeline(ov_int4_bundle, device="CPU")

    def judged(bundle_dir):  # the references and rule of bundle_dir, the decoder of the bundle as built
        report = VerifyReport(bundle_dir.name)
        check_paged_decoder(open_bundle(bundle_dir, check_hashes=False), pipeline, report)
        (check,) = report.checks
        return check

    good = judged(ov_int4_bundle)
    assert good.ok is True and good.name == "paged decoder (max_batch > 1)", good
    assert good.detail.startswith("u8 KV cache in blocks of 32: export error"), good.detail
    broken = tmp_path / ov_int4_bundle.name
    shutil.copytree(ov_int4_bundle, broken)
    golden_file = broken / "reference" / "golden.npz"
    with np.load(golden_file, allow_pickle=False) as data:
        golden = {k: data[k] for k in data.files}
    for key in ("llm_decoder/out/step_hidden_states", "llm_decoder/matched/step_hidden_states"):
        if key in golden:
            golden[key] = golden[key] * np.float32(1.1)
    np.savez(golden_file, **golden)
    bad = judged(broken)
    assert bad.ok is False and "export error" in bad.detail, bad.detail

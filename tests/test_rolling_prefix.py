"""Issue 30 items 1 and 4 together: the voice is a true prefix of every chunk's prompt.

A rolling context's chunk prompt is ``[voice pair] [earlier chunk pairs] <|text|> text <|audio|>``
(:func:`~higgs_pack.runtime.loop.prompt.prompt_of`): the voice's pair is the same first positions
as a prompt of the voice alone, so every chunk after the first restores the voice's cached KV and
prefills only its context and its own text.  On the real tiny cpu fp32 bundle: the positions
prefilled per chunk, codes with the cache equal to codes without, a dialogue's speakers each with
their own prefix, ``context_frames`` cutting the context, and the ``bench.ab rolling-context``
measurement.
"""

from __future__ import annotations

import json

import numpy as np
import pytest

import higgs_pack
from higgs_pack.errors import InputError
from higgs_pack.runtime.loop.plan import chunk_context, context_tail, plan_request
from higgs_pack.runtime.loop.prefix_cache import PrefixCache, bundle_identity
from higgs_pack.runtime.loop.prompt import prompt_of
from higgs_pack.runtime.request import PreparedVoice, SynthesisRequest

#: Three chunks of at most 200 words (CHUNK_WORDS) each.
STORY = " ".join(["This is one more sentence of a long story told in one steady voice."] * 40)  # 560 words


@pytest.fixture(scope="module")
def tts(cpu_fp32_bundle):
    with higgs_pack.load(cpu_fp32_bundle) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def voice(tts, cases_dir):
    return tts.prepare_voice(cases_dir / "ref_en_16k.wav", (cases_dir / "ref_en_16k.txt").read_text().strip(), "ref")


def _fresh(tts) -> PrefixCache:
    tts.prefix_cache = PrefixCache(bundle_identity(tts.bundle.manifest, tts.pipeline.description["llm_decoder"]))
    return tts.prefix_cache


def test_every_later_chunk_restores_the_voice_and_prefills_only_the_rest(tts, voice):
    cache = _fresh(tts)
    result = tts.synthesize(STORY, voice=voice, seed=4, max_frames=12, context_chunks=2)
    assert len(result.chunks) == 3
    # One miss (the first chunk computes the voice prefix and keeps it), then a hit per chunk.
    assert (cache.stats.misses, cache.stats.hits, cache.stats.entries) == (1, 2, 1)
    voice_only = prompt_of(tts.pipeline, "x", voice.codes, voice.transcript).prefix_length
    first, *later = result.chunks
    assert first.prefilled == first.prompt_length  # a miss: the whole prompt computed
    for chunk in later:
        assert chunk.prefilled == chunk.prompt_length - voice_only > 0
        assert chunk.prefill_s > 0
    # The later prompts do hold their context: longer than the voice and their own text.
    plan = plan_request(tts.pipeline, SynthesisRequest(STORY, voice, 4, max_frames=12, context_chunks=2))
    texts = [text for text, _ in plan.chunks]
    own = prompt_of(tts.pipeline, texts[2], voice.codes, voice.transcript).length
    assert later[1].prompt_length > own
    prompt = prompt_of(tts.pipeline, texts[2], voice.codes, voice.transcript,
                       context=[(result.chunks[0].codes, texts[0]), (result.chunks[1].codes, texts[1])])
    assert later[1].prompt_length == prompt.length


def test_codes_with_the_cache_equal_codes_without_it_over_many_chunks(tts, voice):
    options = {"voice": voice, "seed": 9, "max_frames": 12, "context_chunks": 1}
    tts.prefix_cache = None
    try:
        base = tts.synthesize(STORY, **options)
    finally:
        cache = _fresh(tts)
    got = tts.synthesize(STORY, **options)
    again = tts.synthesize(STORY, **options)  # every chunk a hit now
    assert (cache.stats.misses, cache.stats.hits) == (1, 5)
    assert all(chunk.prefilled == chunk.prompt_length for chunk in base.chunks)
    for result in (got, again):
        np.testing.assert_array_equal(result.codes, base.codes)
        assert [c.prompt_length for c in result.chunks] == [c.prompt_length for c in base.chunks]
    # The engine restores the same prefix for its later chunks and gives the same codes.
    with tts.engine(max_batch=2) as engine:
        handle = engine.submit(STORY, **options)
        engine_result = handle.result()
    np.testing.assert_array_equal(engine_result.codes, base.codes)
    assert [c.prefilled for c in engine_result.chunks] == [c.prefilled for c in again.chunks]


def test_without_a_voice_the_first_chunk_becomes_a_cached_voice_prefix(tts):
    cache = _fresh(tts)
    result = tts.synthesize(STORY, seed=2, max_frames=12, context_chunks=1)
    first, second, third = result.chunks
    assert first.prefilled == first.prompt_length  # zero-shot: nothing cacheable
    # Chunk 1 opens with chunk 0 as its voice (a miss, kept); chunk 2 restores it.
    assert (cache.stats.misses, cache.stats.hits) == (1, 1)
    assert second.prefilled == second.prompt_length
    plan = plan_request(tts.pipeline, SynthesisRequest(STORY, None, 2, max_frames=12, context_chunks=1))
    prefix = prompt_of(tts.pipeline, "x", first.codes, plan.chunks[0][0]).prefix_length
    assert third.prefilled == third.prompt_length - prefix


def test_a_dialogue_caches_each_speakers_voice(tts, voice, cases_dir):
    other = PreparedVoice(voice.codes[:-10], voice.transcript, "shorter")
    turns = [("ANN", "Hello there, how are you?"), ("BEN", "Fine, thanks, and you?"),
             ("ANN", "Very well indeed."), ("BEN", "Glad to hear it."), ("ANN", "Goodbye now.")]
    voices = {"ANN": voice, "BEN": other}
    tts.prefix_cache = None
    try:
        base = tts.dialogue(turns, voices=voices, seed=6, max_frames=10)
    finally:
        cache = _fresh(tts)
    got = tts.dialogue(turns, voices=voices, seed=6, max_frames=10)
    np.testing.assert_array_equal(got.codes, base.codes)
    assert (cache.stats.misses, cache.stats.hits, cache.stats.entries) == (2, 3, 2)  # one prefix per speaker
    prefixes = {name: prompt_of(tts.pipeline, "x", v.codes, v.transcript).prefix_length for name, v in voices.items()}
    assert prefixes["ANN"] != prefixes["BEN"]
    for index, chunk in enumerate(got.chunks):
        speaker = turns[index][0]
        expected = chunk.prompt_length - (prefixes[speaker] if index >= 2 else 0)
        assert chunk.prefilled == expected, index
    assert [s.speaker for s in got.segments] == [speaker for speaker, _ in turns]


def test_context_frames_keeps_the_end_of_each_context_chunk_cut_at_a_word(tts, voice):
    codes = np.arange(100 * 8, dtype=np.int64).reshape(100, 8) % 1024
    text = "One two three. Four five six seven. Eight nine ten."
    kept, words = context_tail(tts.pipeline, codes, text, 40)
    assert len(kept) <= 40 and words == "Eight nine ten."  # a sentence start within the last 40 frames
    np.testing.assert_array_equal(kept, codes[-len(kept):])
    kept, words = context_tail(tts.pipeline, codes, "Averyveryverylongword short", 5)
    assert words == "short" and len(kept) == 19  # the last word is kept, however long: 100 * 5 / 26 frames
    assert context_tail(tts.pipeline, codes, text, None) == (codes, text)
    assert context_tail(tts.pipeline, codes, text, 100)[0] is codes
    # Through a request: the later chunks' context pairs are cut, the voice stays whole.
    _fresh(tts)
    result = tts.synthesize(STORY, voice=voice, seed=4, max_frames=12, context_chunks=1, context_frames=4)
    plan = plan_request(tts.pipeline, SynthesisRequest(STORY, voice, 4, max_frames=12, context_chunks=1,
                                                       context_frames=4))
    voice_codes, _, context = chunk_context(tts.pipeline, plan, 2, result.chunks)
    assert voice_codes is voice.codes and len(context) == 1 and len(context[0][0]) <= 4
    assert len(context[0][0]) < len(result.chunks[1].codes) and context[0][1] != plan.chunks[1][0]
    for chunk in result.chunks:
        assert chunk.prompt_length + 12 + 7 <= plan.positions
    for bad in (0, -1, 1.5, "3"):
        with pytest.raises(InputError, match="context_frames"):
            SynthesisRequest.create("Hi.", context_frames=bad)


def test_a_requests_earlier_speech_is_a_rolling_context_after_the_voice(tts, voice):
    """SynthesisRequest.context (a live session's previous sentences, serve/live.py): the request's
    first chunk gets the prompt a long text's later chunk gets with the same context, its voice
    restored from the prefix cache; refused without a voice or when not PreparedVoices."""
    from higgs_pack.runtime.loop.plan import chunk_prompt

    result = tts.synthesize(STORY, voice=voice, seed=4, max_frames=12, context_chunks=2)
    long_plan = plan_request(tts.pipeline, SynthesisRequest(STORY, voice, 4, max_frames=12, context_chunks=2))
    texts = [text for text, _ in long_plan.chunks]
    earlier = tuple(PreparedVoice(result.chunks[j].codes, texts[j], "earlier") for j in (0, 1))
    request = SynthesisRequest(texts[2], voice, 4, max_frames=12, context_chunks=2, context=earlier)
    plan = plan_request(tts.pipeline, request)
    assert plan.context and len(plan.chunks) == 1
    got, want = chunk_prompt(tts.pipeline, plan, 0, []), chunk_prompt(tts.pipeline, long_plan, 2, result.chunks)
    assert (got.length, got.prefix_length) == (want.length, want.prefix_length)
    np.testing.assert_array_equal(got.embeds, want.embeds)
    assert plan.positions >= got.length + 12 + 7
    # context_chunks bounds it: the last one only.
    one = plan_request(tts.pipeline, SynthesisRequest(texts[2], voice, 4, max_frames=12, context_chunks=1,
                                                      context=earlier))
    assert chunk_prompt(tts.pipeline, one, 0, []).length == result.chunks[2].prompt_length - len(earlier[0].codes) \
        - len(tts.pipeline.tokenizer.encode(texts[0], add_special_tokens=False).ids) - 2 - 7
    cache = _fresh(tts)
    tts.synthesize(request)  # a miss: the voice prefix computed and kept
    spoken = tts.synthesize(request)
    assert (cache.stats.misses, cache.stats.hits) == (1, 1)
    assert spoken.chunks[0].prefilled == got.length - got.prefix_length
    with pytest.raises(InputError, match=r"context .*needs one"):
        SynthesisRequest("Hi.", None, context=earlier)
    with pytest.raises(InputError, match="tuple of PreparedVoice"):
        SynthesisRequest("Hi.", voice, context=((result.chunks[0].codes, texts[0]),))


def test_the_rolling_context_measurement_on_the_tiny_bundle(cpu_fp32_bundle, cases_dir, tmp_path):
    from bench.ab.settings import main

    text = tmp_path / "story.txt"
    text.write_text("The first short chunk is here. And a second one follows it. Then a third one ends it.")
    out = tmp_path / "rolling.json"
    main(["rolling-context", str(cpu_fp32_bundle), "--text-file", str(text), "--k", "0,1",
          "--keep-frames", "all,5", "--words", "6", "--repeat", "1", "--max-frames", "10", "--out", str(out)])
    record = json.loads(out.read_text())
    runs = record["runs"]
    assert [(r["k"], r["keep_frames"]) for r in runs] == [(0, None), (1, None), (1, 5)]  # K = 0 keeps nothing: once
    for run in runs:
        assert len(run["chunks"]) == 3
        for index, chunk in enumerate(run["chunks"]):
            assert set(chunk) >= {"prompt_positions", "prefilled", "prefill_ms", "generation_ms", "frames",
                                  "prefill_share"}
            assert 0 < chunk["prefilled"] <= chunk["prompt_positions"]
            assert 0 <= chunk["prefill_share"] <= 1
            if index:  # the voice restored from the cache
                assert chunk["prefilled"] < chunk["prompt_positions"]
    k0, k1, cut = (run["chunks"] for run in runs)
    assert k1[2]["prompt_positions"] > cut[2]["prompt_positions"] > k0[2]["prompt_positions"]  # context, cut
    assert record["voice_prefix"]["positions"] == k0[2]["prompt_positions"] - k0[2]["prefilled"]
    for bad in (["--k", "1,x"], ["--keep-frames", "0"], ["--repeat", "0"], ["--voice-clip", str(tmp_path / "none.wav")]):
        assert main(["rolling-context", str(cpu_fp32_bundle), "--text-file", str(text), *bad]) == 2

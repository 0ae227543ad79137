"""The generation loop's own rules (MODEL.md "Generation loop") on the tiny model's oracle."""

from dataclasses import replace

import numpy as np
import pytest

from higgs_pack.runtime.loop.decode import generate_codes
from higgs_pack.runtime.loop.prompt import build_prompt, prompt_of
from higgs_pack.runtime.options import SamplingOptions

BOC, EOC, N = 1024, 1025, 8


@pytest.fixture(scope="module")
def oracle(tiny_ckpt):
    from higgs_pack.exporters.pytorch.reference import reference_pipeline

    return reference_pipeline(tiny_ckpt)


class BiasedHeads:
    """Wraps the real audio head and pushes chosen codes up at chosen steps (tests the loop, not the head)."""

    def __init__(self, inner, bias):
        self.inner, self.bias, self.step = inner, bias, 0

    def run(self, feeds):
        out = self.inner.run(feeds)
        logits = out["audio_logits"].copy()
        for codebook, code in self.bias(self.step):
            logits[0, -1, codebook, code] += 1000.0
        self.step += 1
        return {"audio_logits": logits}


def _run(oracle, bias=None, **options):
    pipe = replace(oracle, audio_heads=BiasedHeads(oracle.audio_heads, bias)) if bias else oracle
    opts = SamplingOptions(**{"seed": 0, **options})
    return generate_codes(pipe, build_prompt(pipe, "Hello world."), opts, max_frames=30)


def test_start_ramp_forces_boc_above_the_step(oracle):
    delayed = _run(oracle, repeat_guard_frames=0).delayed
    for step in range(N - 1):
        assert (delayed[step, step + 1 :] == BOC).all()
        assert (delayed[step, : step + 1] < 1024).all()
    assert (delayed[N - 1 :] < 1024).all()


def test_eoc_on_codebook_0_ends_after_n_minus_1_more_frames(oracle):
    result = _run(oracle, bias=lambda s: [(0, EOC)] if s == 12 else [], repeat_guard_frames=0)
    d = result.delayed
    assert result.stop_reason == "eoc"
    assert len(d) == 12 + N  # EOC at step 12, then 7 more steps
    for j in range(N):
        assert (d[12 + j, : j + 1] == EOC).all()
        assert (d[12 + j, j + 1 :] < 1024).all()
    assert result.codes.shape == (12 + N - (N - 1) - 1, N)  # frames whose every codebook is real


def test_only_codebook_0_may_emit_eoc_and_boc_is_never_sampled(oracle):
    result = _run(oracle, bias=lambda s: [(3, EOC), (5, BOC)], repeat_guard_frames=0)
    d = result.delayed
    assert result.stop_reason == "max_frames"
    assert (d[N - 1 :] < 1024).all()


def test_repeat_guard_stops_runaway_codebook_0(oracle):
    result = _run(oracle, bias=lambda s: [(0, 7)], repeat_guard_frames=10)
    assert result.stop_reason == "repeat_guard"
    assert len(result.delayed) == 10 + N


def test_frame_cap(oracle):
    result = _run(oracle, repeat_guard_frames=0)
    assert result.stop_reason == "max_frames"
    assert len(result.delayed) == 30 + N - 1 and result.codes.shape == (30, N)


def test_audio_feedback_changes_the_next_step(oracle):
    a = _run(oracle, temperature=0, repeat_guard_frames=0).delayed
    b = _run(oracle, bias=lambda s: [(0, 3)] if s == 2 else [], temperature=0, repeat_guard_frames=0).delayed
    assert np.array_equal(a[:2], b[:2]) and b[2, 0] == 3
    assert not np.array_equal(a[3:], b[3:])


def test_prompt_layout_zero_shot_and_clone(oracle):
    sp = oracle.constants.special_tokens
    text_ids = oracle.tokenizer.encode("Hello world.", add_special_tokens=False).ids
    zero = build_prompt(oracle, "Hello world.")
    ids = np.array([[sp["tts"], sp["text"], *text_ids, sp["audio"]]])
    assert np.allclose(zero, oracle.text_embed.run({"input_ids": ids})["inputs_embeds"])
    ref = np.random.default_rng(0).integers(0, 1024, size=(5, N))
    clone = build_prompt(oracle, "Hello world.", ref, "Ref.")
    ref_ids = oracle.tokenizer.encode("Ref.", add_special_tokens=False).ids
    assert clone.shape[1] == 3 + len(ref_ids) + (5 + N - 1) + len(text_ids) + 2


class _Altered:
    """Wraps a sub-part (``run``) or the decoder (``forward``) and rewrites its output at step
    ``at`` of the loop (the checks under test see the real loop, not a stub)."""

    def __init__(self, inner, at, change):
        self.inner, self.at, self.change, self.calls = inner, at, change, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def _alter(self, out):
        self.calls += 1
        return self.change(out.copy()) if self.calls == self.at else out

    def run(self, feeds):
        return {k: self._alter(v) for k, v in self.inner.run(feeds).items()}

    def forward(self, embeds):
        return self._alter(self.inner.forward(embeds))


def _set(index, value):
    def change(out):
        out[index] = value
        return out
    return change


@pytest.mark.parametrize(("part", "change", "error"), [
    ("decoder", _set((0, -1, 3), np.nan), r"llm_decoder returned non-finite"),
    ("decoder", _set((0, -1, 0), np.inf), r"llm_decoder returned non-finite"),
    ("decoder", lambda out: out * 0, r"llm_decoder returned an all-zero hidden state at step 4"),
    ("audio_heads", _set((0, -1, 5, 7), np.nan), r"audio_heads returned non-finite"),
    ("audio_heads", _set((0, -1, 2, 9), -np.inf), r"audio_heads returned non-finite"),
    ("audio_embed", _set((0, 0, 1), np.inf), r"audio_embed returned non-finite"),
])
def test_loop_stops_on_a_broken_output_and_names_the_subpart(oracle, part, change, error):
    from higgs_pack.errors import NumericalError

    pipe = replace(oracle, **{part: _Altered(getattr(oracle, part), 5, change)})
    with pytest.raises(NumericalError, match=error):
        generate_codes(pipe, build_prompt(pipe, "Hello world."), SamplingOptions(seed=0), max_frames=30)


@pytest.mark.parametrize(("part", "change"), [
    ("decoder", lambda out: out * 1e-30),  # the sum of squares underflows to zero
    ("decoder", _set((0, -1, 0), 3e38)),  # the sum of squares overflows
    ("audio_heads", lambda out: out + 3e38),  # the sum of the logits overflows
])
def test_loop_accepts_extreme_but_finite_outputs(oracle, part, change):
    pipe = replace(oracle, **{part: _Altered(getattr(oracle, part), 5, change)})
    result = generate_codes(pipe, build_prompt(pipe, "Hello world."), SamplingOptions(seed=0), max_frames=30)
    assert result.codes.shape[1] == N


@pytest.mark.parametrize(("text", "message"), [
    ("Say <|audio|> now.", r"the prompt control token\(s\) <\|audio\|>, which the model reserves"),
    ("Hi <|endoftext|> and <|im_start|>", r"the tokenizer's special token\(s\) <\|endoftext\|>, <\|im_start\|>, "
                                          r"which would reach the model as control ids"),
    ("<|higgs_reserved_3|>", r"special token\(s\) <\|higgs_reserved_3\|>"),
])
def test_special_tokens_of_the_tokenizer_are_refused(oracle, text, message):
    from higgs_pack.errors import InputError
    from higgs_pack.runtime.loop.prompt import check_text_tokens
    from higgs_pack.runtime.loop.synthesis import synthesize

    with pytest.raises(InputError, match=message):
        check_text_tokens(oracle, text)
    with pytest.raises(InputError, match=message):  # refused before any frame is generated
        synthesize(oracle, text, progress=lambda *_: pytest.fail("a frame was generated"))


def test_ordinary_and_non_special_added_tokens_pass(oracle):
    from higgs_pack.runtime.loop.prompt import check_text_tokens

    tok = oracle.tokenizer
    assert check_text_tokens(oracle, "Hello world.") == tok.encode("Hello world.", add_special_tokens=False).ids
    # Qwen3's <tool_call> is an added token the tokenizer does not mark special: vocabulary, not control.
    assert tok.token_to_id("<tool_call>") in check_text_tokens(oracle, "a <tool_call> b")


# ------------------------------------------------ long text: chunks by a word budget, a rolling context


STORY = " ".join(["This is one more sentence of a long story told in one steady voice."] * 40)  # 560 words


def test_a_long_text_is_chunked_by_words_and_each_chunk_opens_with_the_voice_and_the_last_chunk(oracle):
    from higgs_pack.runtime.loop.plan import CHUNK_WORDS, plan_synthesis
    from higgs_pack.runtime.loop.synthesis import run_plan

    plan = plan_synthesis(oracle, STORY, options=SamplingOptions(seed=3), max_frames=12)
    assert len(plan.chunks) == 3 and all(len(chunk.split()) <= CHUNK_WORDS for chunk, _ in plan.chunks)
    assert " ".join(chunk for chunk, _ in plan.chunks) == STORY
    result = run_plan(oracle, plan)
    (first, second, third), texts = result.chunks, [chunk for chunk, _ in plan.chunks]
    assert first.prompt_length == build_prompt(oracle, texts[0]).shape[1]  # zero-shot: a voice of its own
    # No reference voice: the first chunk is the voice of the rest, then the last chunk before.
    assert second.prompt_length == build_prompt(oracle, texts[1], first.codes, texts[0]).shape[1]
    third_prompt = prompt_of(oracle, texts[2], first.codes, texts[0], context=[(second.codes, texts[1])])
    assert third.prompt_length == third_prompt.length
    for chunk in result.chunks:  # the KV a request reserves covers its largest chunk with its context
        assert chunk.prompt_length + 12 + N - 1 <= plan.positions <= plan.max_length


def test_a_reference_voice_leads_the_context_and_zero_context_keeps_chunks_apart(oracle):
    from higgs_pack.runtime.loop.plan import chunk_context, plan_synthesis
    from higgs_pack.runtime.loop.synthesis import run_plan

    voice = np.random.default_rng(0).integers(0, 1024, size=(20, N))
    plan = plan_synthesis(oracle, STORY, options=SamplingOptions(seed=3), ref_codes=voice, ref_text="A voice.",
                          max_frames=12, context_chunks=1)
    result = run_plan(oracle, plan)
    texts = [chunk for chunk, _ in plan.chunks]
    codes, words, context = chunk_context(oracle, plan, 2, result.chunks)
    assert codes is voice and words == "A voice." and len(context) == 1
    assert np.array_equal(context[0][0], result.chunks[1].codes) and context[0][1] == texts[1]
    prompt = prompt_of(oracle, texts[2], codes, words, context=context)
    assert result.chunks[2].prompt_length == prompt.length
    # The voice's pair opens the prompt whatever follows: its prefix (and cache key) is the voice's alone.
    alone = prompt_of(oracle, texts[2], voice, "A voice.")
    assert (prompt.prefix_length, prompt.voice, prompt.material) == (alone.prefix_length, alone.voice, alone.material)
    np.testing.assert_array_equal(prompt.embeds[:, :prompt.prefix_length], alone.embeds[:, :alone.prefix_length])
    apart = plan_synthesis(oracle, STORY, options=SamplingOptions(seed=3), max_frames=12, context_chunks=0)
    assert len(apart.chunks) == 1  # packed up to the context, as before the rolling context
    alone = run_plan(oracle, apart)
    assert alone.chunks[0].prompt_length == build_prompt(oracle, STORY).shape[1]


def test_a_sentence_too_long_names_the_frame_cap_only_where_lowering_it_helps(oracle):
    from higgs_pack.errors import InputError
    from higgs_pack.runtime.loop.plan import plan_synthesis

    endless = "x" * 60000  # one word with no space or comma: nowhere to cut it, longer than the context
    with pytest.raises(InputError) as caught:
        plan_synthesis(oracle, endless, max_frames=2, context_chunks=0)
    assert "no space or comma to cut it at" in str(caught.value) and "lower" not in str(caught.value)
    assert caught.value.problems[0].field == "text"
    limit = oracle.decoder.max_length
    largest = limit - 10 - 1  # the prompt's 3 + N - 1 positions (N = 8 codebooks) and one text token
    with pytest.raises(InputError, match="or lower max_frames") as caught:  # a word of many tokens: no room
        plan_synthesis(oracle, "supercalifragilistic" * 3, max_frames=largest, context_chunks=0)
    assert caught.value.problems[0].field == "max_frames"
    # a cap no text fits beside (issue 37: "hi" with --max-frames 5000 was told to split the sentence)
    with pytest.raises(InputError, match=f"^max_frames is at most {largest} for this bundle .*, got {limit}; ") as caught:
        plan_synthesis(oracle, "hi", max_frames=limit, context_chunks=0)
    assert caught.value.problems[0].field == "max_frames"
    assert plan_synthesis(oracle, "hi", max_frames=largest, context_chunks=0).chunks[0][1] == largest


@pytest.mark.parametrize("text", ["word, " * 1500, ", ".join(str(i) for i in range(1, 1200)),
                                  "\u4e2d\u6587\u5b57\uff0c" * 1500],
                         ids=["commas", "numbers", "cjk-commas"])
def test_text_of_clauses_without_a_full_stop_is_cut_until_it_fits(oracle, text):
    """A list or a paragraph of commas with no sentence end (a new user's report: 'one sentence needs
    4410 positions' for 250 items): its pieces are halved at spaces, or after clause marks in text
    without spaces (CJK), until each chunk's prompt and frames fit the context; nothing is lost."""
    from higgs_pack.runtime.loop.plan import plan_synthesis
    from higgs_pack.runtime.loop.text_chunks import chunk_positions

    plan = plan_synthesis(oracle, text, options=None, context_chunks=0)
    assert len(plan.chunks) > 1
    for chunk, cap in plan.chunks:
        assert chunk_positions(oracle, chunk, cap) <= oracle.decoder.max_length
    squeeze = (lambda t: "".join(t.split())) if " " not in text.strip() else (lambda t: " ".join(t.split()))
    assert squeeze(" ".join(c for c, _ in plan.chunks)) == squeeze(text)


def test_the_rolling_context_respects_a_decoders_own_prompt_limit(oracle):
    """An NPU bundle's static prompt (generation.max_prompt_length) is shorter than its KV window:
    a context that fits the window but not the prompt is dropped, not sent."""
    from dataclasses import replace as with_fields

    from higgs_pack.runtime.loop.plan import chunk_context, plan_synthesis
    from higgs_pack.runtime.loop.synthesis import run_plan

    plan = plan_synthesis(oracle, STORY, options=SamplingOptions(seed=3), max_frames=12)
    results = run_plan(oracle, plan).chunks
    codes, words, context = chunk_context(oracle, plan, 2, results)
    prompt = prompt_of(oracle, plan.chunks[2][0], codes, words, context=context).length
    assert codes is not None and len(context) == 1
    assert chunk_context(oracle, with_fields(plan, max_prompt_length=prompt), 2, results)[2] == context
    # One position short: the context chunk goes first, the first-chunk voice stays
    shorter = chunk_context(oracle, with_fields(plan, max_prompt_length=prompt - 1), 2, results)
    assert shorter[0] is codes and shorter[2] == []
    alone = prompt_of(oracle, plan.chunks[2][0], codes, words).length
    assert chunk_context(oracle, with_fields(plan, max_prompt_length=alone - 1), 2, results) == (None, None, [])

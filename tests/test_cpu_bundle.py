"""The cpu target end to end on the tiny checkpoint: build, manifest, load, speech, parity."""

import json

import numpy as np
import pytest

from higgs_pack.manifests.manifest import FORMAT_VERSION, read_manifest, schema
from higgs_pack.manifests.model import SubPart
from higgs_pack.runtime.audio import load_audio, prepare_reference
from higgs_pack.runtime.loop.decode import generate_codes
from higgs_pack.runtime.loop.prompt import build_prompt
from higgs_pack.runtime.loop.sentences import split_sentences
from higgs_pack.runtime.loop.synthesis import synthesize
from higgs_pack.runtime.loop.text_chunks import plan_chunks
from higgs_pack.runtime.options import SamplingOptions
from higgs_pack.runtime.sources.bundle import load_pipeline as load
from higgs_pack.runtime.verification.verify import verify_bundle


def test_bundle_layout_and_manifest(cpu_int4_bundle):
    m = read_manifest(cpu_int4_bundle)
    assert m["format_version"] == FORMAT_VERSION
    assert m["name"] == "higgs-audio-v3-tiny-cpu-int4"
    assert (m["target"], m["precision"], m["backend"], m["execution_provider"]) == ("cpu", "int4", "onnxruntime", "cpu")
    assert any(r.startswith("onnxruntime") for r in m["runtime_requirements"])
    assert len(m["model"]["checkpoint_sha256"]) == 64
    c = m["constants"]
    assert (c["num_codebooks"], c["codebook_size"], c["boc"], c["eoc"]) == (8, 1024, 1024, 1025)
    assert (c["sample_rate"], c["frame_rate"], c["hop_length"]) == (24000, 25, 960)
    assert set(c["special_tokens"]) >= {"tts", "audio", "text", "ref_audio", "ref_text"}
    subs = m["subparts"]
    assert set(subs) == {p.value for p in SubPart}
    dec = subs["llm_decoder"]
    assert dec["exporter"] == "modelbuilder" and dec["entry"] == "llm_decoder/model.onnx"
    assert "llm_decoder/model.onnx.data" in dec["files"]
    names = [t["name"] for t in dec["inputs"]]
    assert {"inputs_embeds", "attention_mask", "past_key_values.0.key", "past_key_values.0.value"} <= set(names)
    assert subs["audio_heads"]["passes"] == ["OnnxConversion", "OnnxBlockWiseRtnQuantization"]
    assert subs["audio_heads"]["quantization"]["bits"] == 4
    assert subs["audio_tokenizer"]["precision"] == subs["audio_encoder"]["precision"] == "fp32"
    assert subs["audio_heads"]["outputs"][0]["shape"][-2:] == [8, 1026]
    for spec in subs.values():
        assert spec["tool_versions"] and spec["parity"]["measured"] is not None
    assert m["verification"]["build_time"]["ok"] is True
    listed = {f["path"] for f in m["files"]}
    on_disk = {p.relative_to(cpu_int4_bundle).as_posix() for p in cpu_int4_bundle.rglob("*") if p.is_file()}
    assert on_disk == listed | {"manifest.json"}


def test_manifest_schema_is_strict(cpu_int4_bundle):
    import jsonschema

    m = read_manifest(cpu_int4_bundle)
    m["surprise"] = 1
    assert not jsonschema.Draft202012Validator(schema()).is_valid(m)
    m.pop("surprise")
    m["subparts"]["audio_heads"]["surprise"] = 1
    assert not jsonschema.Draft202012Validator(schema()).is_valid(m)


def test_fp32_greedy_reproduces_the_pytorch_reference(cpu_fp32_bundle, tiny_ckpt):
    from higgs_pack.exporters.pytorch.reference import reference_pipeline

    text = "Packaging models for every device is hard work."
    greedy = SamplingOptions(temperature=0, repeat_guard_frames=0)
    oracle = reference_pipeline(tiny_ckpt)
    bundle = load(cpu_fp32_bundle)
    want = generate_codes(oracle, build_prompt(oracle, text), greedy, max_frames=20).delayed
    got = generate_codes(bundle, build_prompt(bundle, text), greedy, max_frames=20).delayed
    assert want.shape == got.shape == (27, 8)
    assert np.array_equal(want, got)


def test_synthesis_of_the_cases(cpu_int4_bundle, cases_dir):
    pipe = load(cpu_int4_bundle)
    for name in ("text_en_basic.txt", "text_zh.txt"):
        out = synthesize(pipe, (cases_dir / name).read_text(encoding="utf-8"), options=SamplingOptions(seed=3))
        assert out.sample_rate == 24000
        assert out.samples.dtype == np.float32 and np.isfinite(out.samples).all()
        frames = sum(len(r.codes) for r in out.chunks)
        assert len(out.samples) == frames * 960 + (len(out.chunks) - 1) * 4800
        assert frames > 0 and out.codes.max() < 1024


def test_same_seed_same_audio_other_seed_other_audio(cpu_int4_bundle):
    pipe = load(cpu_int4_bundle)
    a = synthesize(pipe, "Hello there.", options=SamplingOptions(seed=1), max_frames=20)
    b = synthesize(pipe, "Hello there.", options=SamplingOptions(seed=1), max_frames=20)
    c = synthesize(pipe, "Hello there.", options=SamplingOptions(seed=2), max_frames=20)
    assert np.array_equal(a.codes, b.codes) and np.array_equal(a.samples, b.samples)
    assert not np.array_equal(a.codes, c.codes)


def test_frame_cap_applies_and_is_reported(cpu_int4_bundle):
    pipe = load(cpu_int4_bundle)
    out = synthesize(pipe, "Hi.", options=SamplingOptions(seed=0, repeat_guard_frames=0), max_frames=12)
    chunk, eoc = out.chunks[0], pipe.constants.eoc
    assert len(chunk.delayed) <= 12 + 7
    # The reason matches the codes: EOC on codebook 0 ends the run after 7 more steps;
    # otherwise the run is exactly the cap (12 frames + 7 delay steps) and is reported.
    if (chunk.delayed[:, 0] == eoc).any():
        assert chunk.stop_reason == "eoc" and not out.frame_cap_hit
        first = int(np.argmax(chunk.delayed[:, 0] == eoc))
        assert len(chunk.delayed) in (first + 8, 19)
    else:
        assert chunk.stop_reason == "max_frames" and out.frame_cap_hit
        assert len(chunk.delayed) == 12 + 7


def test_voice_clone_from_the_case_clip(cpu_fp32_bundle, cases_dir):
    pipe = load(cpu_fp32_bundle)
    samples, rate = load_audio(cases_dir / "ref_en_16k.wav")
    ref = prepare_reference(samples, rate, 24000, 960)
    ref_text = (cases_dir / "ref_en_16k.txt").read_text()
    out = synthesize(pipe, "The sun rises in the east.", ref_samples=ref, ref_text=ref_text,
                     options=SamplingOptions(seed=0), max_frames=30)
    assert out.chunks[0].prompt_length > len(ref) // 960  # the reference codes are in the prompt
    assert np.isfinite(out.samples).all() and len(out.samples) > 0


def test_verify_passes_with_cases(cpu_int4_bundle, cases_dir):
    report = verify_bundle(cpu_int4_bundle, cases_dir=cases_dir)
    assert report.ok, report.render()
    names = [c.name for c in report.checks]
    assert "synthesize text_zh" in names and "synthesize clone ref_en_16k" in names
    assert json.loads(json.dumps(report.to_dict()))["ok"] is True


def test_long_text_is_split_into_sentences(cpu_int4_bundle):
    pipe = load(cpu_int4_bundle)
    limit = pipe.decoder.max_length
    sentence = "This sentence is spoken once more. "
    n_tokens = len(pipe.tokenizer.encode(sentence, add_special_tokens=False).ids)
    text = sentence * (limit // (n_tokens * 10) + 4)
    chunks = plan_chunks(pipe, text)
    assert len(chunks) > 1
    assert " ".join(c for c, _ in chunks).split() == text.split()
    for chunk, cap in chunks:
        assert cap >= 50
        assert len(pipe.tokenizer.encode(chunk, add_special_tokens=False).ids) + cap + 10 <= limit


def test_text_without_sentence_ends_is_cut_at_word_boundaries(cpu_int4_bundle):
    """A sentence over the word budget is cut into pieces of that many words, not one chunk of
    3000 words or a refusal of 6000 (H-newuser 7); every word kept, in order."""
    pipe = load(cpu_int4_bundle)
    text = " ".join(f"w{i}" for i in range(450))
    chunks = plan_chunks(pipe, text, max_frames=50, max_words=200)
    assert [len(c.split()) for c, _ in chunks] == [200, 200, 50]
    assert " ".join(c for c, _ in chunks).split() == text.split()
    chunks = plan_chunks(pipe, "Short one. " + text, max_frames=50, max_words=200)
    assert [len(c.split()) for c, _ in chunks] == [2, 200, 200, 50]
    assert plan_chunks(pipe, text, max_frames=50) == [(text, 50)]  # no word budget: whole when it fits


def test_planning_a_long_text_tokenizes_each_sentence_once(cpu_int4_bundle, cases_dir):
    """A book-length text is planned in work linear in its length: the tokenizer sees the whole
    text, each sentence (in one batch) and each chunk once; the plan equals packing sentences
    greedily by exact token counts (issue 30: a 313 KB text took 78.6 s, re-tokenizing the
    growing chunk for every sentence)."""
    pipe = load(cpu_int4_bundle)
    text = " ".join([(cases_dir / "text_en_basic.txt").read_text().strip(),
                     (cases_dir / "text_zh.txt").read_text().strip(), "1. (2) «three»!"] * 200)
    tokenizer = pipe.tokenizer
    calls = {"encode": 0, "encode_batch": 0}

    class Counting:
        def encode(self, *args, **kwargs):
            calls["encode"] += 1
            return tokenizer.encode(*args, **kwargs)

        def encode_batch(self, *args, **kwargs):
            calls["encode_batch"] += 1
            return tokenizer.encode_batch(*args, **kwargs)

    pipe.tokenizer = Counting()
    try:
        chunks = plan_chunks(pipe, text, max_frames=1000)
    finally:
        pipe.tokenizer = tokenizer
    assert len(chunks) > 3
    assert calls == {"encode": 1 + len(chunks), "encode_batch": 1}, calls
    assert "".join("".join(c.split()) for c, _ in chunks) == "".join(text.split())  # every character, in order
    limit = pipe.decoder.max_length
    count = [len(tokenizer.encode(c, add_special_tokens=False).ids) for c, _ in chunks]
    n = pipe.constants.num_codebooks
    for i, (chunk, cap) in enumerate(chunks):
        assert cap == 1000 and count[i] + 3 + cap + n - 1 <= limit  # fits
        if i + 1 < len(chunks):  # and is full: the next chunk's first sentence would not have fitted
            first = split_sentences(chunks[i + 1][0])[0]
            grown = len(tokenizer.encode(f"{chunk} {first}", add_special_tokens=False).ids)
            assert grown + 3 + cap + n - 1 > limit


@pytest.mark.parametrize("text", ["", "   \n\t "])
def test_empty_text_is_refused(cpu_int4_bundle, text):
    from higgs_pack.errors import InputError

    with pytest.raises(InputError, match=r"text is (empty|only whitespace): there is nothing to speak"):
        synthesize(load(cpu_int4_bundle), text)


def test_one_sentence_longer_than_the_context_is_refused(cpu_int4_bundle):
    from higgs_pack.errors import InputError

    pipe = load(cpu_int4_bundle)
    # One word, no place to cut it: many words without a sentence end are cut at word boundaries
    # into chunks of CHUNK_WORDS words since H-newuser 7, so they are spoken, not refused.
    words = "w-" * pipe.decoder.max_length
    with pytest.raises(InputError, match=r"one sentence needs .* more than the decoder's context"):
        synthesize(pipe, words)


def test_clone_needs_both_audio_and_transcript(cpu_int4_bundle):
    from higgs_pack.errors import InputError

    with pytest.raises(InputError, match=r"voice cloning needs both ref_audio= and ref_text="):
        synthesize(load(cpu_int4_bundle), "Hi.", ref_samples=np.zeros(24000, np.float32))


def test_plan_equals_manifest(cpu_int4_bundle, cpu_fp32_bundle):
    from higgs_pack.targets.plan import make_plan, plan_mismatches

    for bundle in (cpu_int4_bundle, cpu_fp32_bundle):
        m = read_manifest(bundle)
        assert plan_mismatches(make_plan(m["target"], m["precision"], m["variant"]), m["subparts"]) == []

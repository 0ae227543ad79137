"""Sub-part torch modules (contracts, ONNX export vs ONNX Runtime) and the PyTorch oracle."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
pytest.importorskip("transformers")

from higgs_pack.errors import InputError  # noqa: E402
from higgs_pack.exporters.checkpoint.models import codec_model, qwen3_model  # noqa: E402
from higgs_pack.exporters.pytorch.modules import (  # noqa: E402
    DYNAMIC_AXES,
    AudioEmbed,
    AudioHeads,
    CodecEncoder,
    build_modules,
    example_inputs,
)
from higgs_pack.exporters.pytorch.reference import (  # noqa: E402
    TorchDecoder,
    reference_pipeline,
)
from higgs_pack.manifests.model import SUBPART_IO, SubPart  # noqa: E402
from higgs_pack.runtime.loop.pipeline import Pipeline  # noqa: E402

EXPORTED = [p for p in DYNAMIC_AXES if p != SubPart.AUDIO_TOKENIZER_STREAM]  # its own test: test_stream_codec.py


@pytest.fixture(scope="module")
def modules(tiny_ckpt):
    return build_modules(tiny_ckpt)


@pytest.fixture(scope="module")
def pipeline(tiny_ckpt) -> Pipeline:
    return reference_pipeline(tiny_ckpt)


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.ravel().astype(np.float64), b.ravel().astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


# ----------------------------------------------------------------------------- module contracts


def test_audio_embed_sums_offset_rows():
    table = torch.randn(3 * 5, 4)
    module = AudioEmbed(table, num_codebooks=3, audio_vocab_size=5)
    codes = torch.tensor([[[0, 4, 2], [1, 1, 3]]])
    out = module(codes)
    expected = torch.stack(
        [sum(table[codes[0, t, c] + 5 * c] for c in range(3)) for t in range(2)]
    ).unsqueeze(0)
    torch.testing.assert_close(out, expected)


def test_audio_heads_reshape_per_codebook():
    weight = torch.randn(3 * 5, 4)
    hidden = torch.randn(2, 6, 4)
    out = AudioHeads(weight, 3, 5)(hidden)
    assert out.shape == (2, 6, 3, 5)
    torch.testing.assert_close(out[1, 2, 2], hidden[1, 2] @ weight[10:15].T)


def test_codec_modules_match_transformers(tiny_ckpt, modules):
    codec = codec_model(tiny_ckpt)
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for frames in (4, 9):
            wave = 0.1 * torch.randn(2, 1, frames * 960, generator=g)
            codes = modules[SubPart.AUDIO_ENCODER](wave)
            assert codes.dtype == torch.int64 and codes.shape == (2, 8, frames)
            assert torch.equal(codes, codec.encode(wave).audio_codes)
            out = modules[SubPart.AUDIO_TOKENIZER](codes)
            assert out.shape == (2, 1, frames * 960)
            torch.testing.assert_close(out, codec.decode(codes).audio_values)


def test_codec_encoder_refuses_partial_frames(modules):
    with pytest.raises(InputError, match=r"not a multiple of 960; pad"):
        modules[SubPart.AUDIO_ENCODER](torch.zeros(1, 1, 1000))
    assert isinstance(modules[SubPart.AUDIO_ENCODER], CodecEncoder)


# ----------------------------------------------------------------------------- ONNX export


@pytest.mark.slow
@pytest.mark.parametrize("subpart", EXPORTED, ids=str)
def test_onnx_export_runs_on_ort_at_other_lengths(subpart, modules, tiny_ckpt, tmp_path: Path):
    """Exported at length 5 by the build's exporter (Olive, fp32), run at 3 and 11 with batch 2:
    same as torch."""
    from higgs_pack.exporters.onnx.olive import export_onnx

    module = modules[subpart]
    inputs, outputs = SUBPART_IO[subpart]
    result = export_onnx(module, example_inputs(subpart, tiny_ckpt.constants, 5), input_names=inputs,
                         output_names=outputs, dynamic_axes=DYNAMIC_AXES[subpart], out_dir=tmp_path / "b",
                         name=subpart.value, precision="fp32", work_dir=tmp_path / "work")
    session = ort.InferenceSession(str(tmp_path / "b" / result.entry), providers=["CPUExecutionProvider"])
    assert [i.name for i in session.get_inputs()] == list(inputs)
    assert [o.name for o in session.get_outputs()] == list(outputs)
    for length in (3, 11):
        (x,) = example_inputs(subpart, tiny_ckpt.constants, length)
        x = torch.cat([x, x.flip(1) if x.dtype == torch.int64 else 0.5 * x])  # batch 2
        with torch.no_grad():
            expected = module(x).numpy()
        (got,) = session.run(None, {inputs[0]: x.numpy()})
        assert got.shape == expected.shape
        if subpart == SubPart.AUDIO_ENCODER:
            assert got.dtype == np.int64
            np.testing.assert_array_equal(got, expected)
        else:
            assert got.dtype == np.float32
            assert cosine(got, expected) > 0.9999
            np.testing.assert_allclose(got, expected, atol=1e-4, rtol=1e-3)


# ----------------------------------------------------------------------------- the oracle


def test_the_oracle_speaks_with_the_loops_own_defaults(pipeline: Pipeline):
    """The oracle has no manifest: ``options=None`` samples exactly as ``SamplingOptions()``, its
    prompt starts with the tokenizer's ``<|tts|> <|text|>`` found by name, and a text too long
    for the checkpoint's context (4096 positions) is refused naming that context."""
    from higgs_pack.runtime.loop.prompt import build_prompt
    from higgs_pack.runtime.loop.synthesis import synthesize
    from higgs_pack.runtime.options import SamplingOptions

    default = synthesize(pipeline, "Hello.", max_frames=6)
    explicit = synthesize(pipeline, "Hello.", options=SamplingOptions(), max_frames=6)
    assert np.array_equal(default.codes, explicit.codes) and default.codes.shape[1] == 8
    tok = pipeline.tokenizer
    head = [tok.token_to_id("<|tts|>"), tok.token_to_id("<|text|>")]
    want = pipeline.text_embed.run({"input_ids": np.array([head])})["inputs_embeds"]
    np.testing.assert_array_equal(build_prompt(pipeline, "Hello.")[:, :2], want)
    with pytest.raises(InputError, match="decoder's context of 4096"):
        # One word with no place to cut it (many words without a sentence end are cut into chunks
        # of CHUNK_WORDS words at word boundaries since H-newuser 7, so they are spoken).
        synthesize(pipeline, "x" * 40000, max_frames=1200)


def test_runners_take_and_give_numpy(pipeline: Pipeline):
    ids = np.array([pipeline.tokenizer.encode("<|tts|><|text|>Hello<|audio|>").ids])
    embeds = pipeline.text_embed.run({"input_ids": ids})["inputs_embeds"]
    assert embeds.dtype == np.float32 and embeds.shape == (1, ids.shape[1], 64)
    codes = np.random.default_rng(0).integers(0, 1026, (1, 4, 8))
    audio = pipeline.audio_embed.run({"codes": codes.astype(np.int32)})["audio_embeds"]
    assert audio.shape == (1, 4, 64)
    logits = pipeline.audio_heads.run({"hidden_states": embeds})["audio_logits"]
    assert logits.shape == (1, ids.shape[1], 8, 1026) and logits.dtype == np.float32
    wave = pipeline.audio_tokenizer.run({"audio_codes": codes.transpose(0, 2, 1) % 1024})[
        "waveform"
    ]
    assert wave.shape == (1, 1, 4 * 960) and wave.dtype == np.float32
    back = pipeline.audio_encoder.run({"waveform": wave})["audio_codes"]
    assert back.shape == (1, 8, 4) and back.dtype == np.int64
    with pytest.raises(InputError, match="missing input 'input_ids'"):
        pipeline.text_embed.run({"ids": ids})


def test_decoder_with_cache_equals_full_sequence(pipeline: Pipeline):
    rng = np.random.default_rng(0)
    ids = np.array([pipeline.tokenizer.encode("<|tts|><|text|>Hello world.<|audio|>").ids])
    prompt = pipeline.text_embed.run({"input_ids": ids})["inputs_embeds"]
    frames = pipeline.audio_embed.run({"codes": rng.integers(0, 1024, (1, 4, 8))})["audio_embeds"]
    decoder = pipeline.decoder

    decoder.reset()
    full = decoder.forward(np.concatenate([prompt, frames], axis=1))
    decoder.reset()
    steps = [decoder.forward(prompt)] + [decoder.forward(frames[:, i : i + 1]) for i in range(4)]
    assert decoder.length == prompt.shape[1] + 4
    incremental = np.concatenate(steps, axis=1)
    np.testing.assert_allclose(incremental, full, atol=1e-5, rtol=0)
    assert float(full.std()) > 0.5  # final-norm hidden states, not degenerate
    logits = pipeline.audio_heads.run({"hidden_states": full[:, -1:]})["audio_logits"][0, 0]
    assert len(set(logits.argmax(-1).tolist())) > 1  # codebooks disagree: not a constant model

    decoder.reset()
    np.testing.assert_allclose(decoder.forward(prompt), steps[0], atol=1e-6, rtol=0)


def test_decoder_refuses_bad_shapes_and_overflow(tiny_ckpt):
    decoder = TorchDecoder(qwen3_model(tiny_ckpt), max_length=6)
    with pytest.raises(InputError, match=r"expected \[1, S, 64\]"):
        decoder.forward(np.zeros((1, 3, 32), np.float32))
    decoder.forward(np.zeros((1, 4, 64), np.float32))
    with pytest.raises(InputError, match="more than the decoder's 6"):
        decoder.forward(np.zeros((1, 3, 64), np.float32))

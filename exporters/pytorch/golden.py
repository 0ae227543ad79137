"""Golden inputs/outputs captured from the PyTorch oracle at build time.

Saved as ``reference/golden.npz`` in the bundle (plain numpy arrays; loaded with
``allow_pickle=False``).  Keys are ``<sub-part>/in/<tensor>`` and
``<sub-part>/out/<tensor>`` (see :func:`higgs_pack.runtime.verification.report.subpart_parity`),
plus ``greedy/delayed``: the oracle's greedy codes for :data:`GREEDY_TEXT`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from higgs_pack.runtime.loop.decode import generate_codes
from higgs_pack.runtime.loop.prompt import build_prompt
from higgs_pack.runtime.options import SamplingOptions
from higgs_pack.runtime.verification.kv_parity import GOLDEN_KV

#: Text of the greedy-parity check (recorded in the manifest's ``reference.cases``).
GREEDY_TEXT = "The quick brown fox jumps over the lazy dog."
#: Frames of greedy decoding captured: fp32 bundles must reproduce every one of them.
#: 200 for models up to :data:`LONG_GREEDY_MAX_PARAMS` decoder weights (the tiny and
#: bench presets: seconds of oracle time), :data:`SHORT_GREEDY_FRAMES` above (the 4B
#: oracle runs each layer in float32 from bf16, about a second per frame on 2 cores).
GREEDY_FRAMES = 200
SHORT_GREEDY_FRAMES = 16
LONG_GREEDY_MAX_PARAMS = 1_000_000_000


def greedy_frames(decoder_params: int, precision: str = "fp32") -> int:
    """Frames of greedy codes captured for a decoder of ``decoder_params`` weights.

    Large decoders below fp32 capture none: there the comparison is only reported (random
    weights amplify quantization error until greedy codes part at the first frames), and
    each oracle frame of the 4B model costs seconds of build time.
    """
    if decoder_params <= LONG_GREEDY_MAX_PARAMS:
        return GREEDY_FRAMES
    return SHORT_GREEDY_FRAMES if precision == "fp32" else 0
#: Seconds of the synthetic codec-encoder probe (a whole number of 960-sample frames at 24 kHz).
ENCODER_PROBE_FRAMES = 30


def _probe_waveform(sample_rate: int, hop: int, rng: np.random.Generator) -> np.ndarray:
    """A deterministic voiced-like signal: a 120->300 Hz chirp with harmonics plus noise."""
    n = ENCODER_PROBE_FRAMES * hop
    t = np.arange(n) / sample_rate
    f0 = 120 + 180 * t / t[-1]
    phase = 2 * np.pi * np.cumsum(f0) / sample_rate
    wave = sum(np.sin(k * phase) / k for k in range(1, 6)) * 0.3
    wave = wave * (0.6 + 0.4 * np.sin(2 * np.pi * 3 * t)) + 0.01 * rng.standard_normal(n)
    return wave.astype(np.float32)


def capture_golden(ckpt, out_path: Path, *, seed: int = 1234, bundle_dir: Path | None = None,
                   subparts: dict[str, dict[str, Any]] | None = None) -> dict[str, Any]:
    """Run the oracle on fixed inputs and save the results.

    With ``bundle_dir`` and ``subparts`` (sub-part -> ``{"format", "entry", "precision"}``
    of the bundle being built, and for the decoder ``"kv_cache"``: its quantized KV cache
    record or None), every sub-part whose weights were quantized or cast is
    also run as the *matched* oracle: the same torch code with the weights read back
    from the bundle (:mod:`higgs_pack.exporters.pytorch.dequantize`), saved as
    ``<sub-part>/matched/<tensor>``.  Verification measures the export error against it
    and the quantization error between it and the float outputs.  For a decoder with a
    quantized KV cache the oracle's K/V after the golden prompt are saved too
    (``llm_decoder/kv/present.{i}.key|value``, and ``llm_decoder/kv_matched/...`` of the
    matched oracle): verification compares the bundle's dequantized cache with them.

    Args:
        ckpt: an open :class:`~higgs_pack.exporters.checkpoint.reader.HiggsCheckpoint`.
        out_path: where to write the ``.npz`` (parent directories are created).
        seed: seed of the random probe codes.
        bundle_dir: the bundle the matched references are read from.
        subparts: its sub-parts (from the exporters' results).

    Returns:
        ``{"frames": greedy frames captured, "weights": {sub-part: {"max_rel_l2": the
        largest relative L2 difference of a read-back weight to the checkpoint's,
        "tensor": its name}}}``.

    Raises:
        BuildError: a read-back weight does not fit its model parameter (wrong layout).
    """
    from higgs_pack.exporters.pytorch.reference import reference_pipeline

    pipe = reference_pipeline(ckpt)
    c = pipe.constants
    rng = np.random.default_rng(seed)
    g: dict[str, np.ndarray] = {}

    sp = c.special_tokens
    text_ids = pipe.tokenizer.encode(GREEDY_TEXT, add_special_tokens=False).ids
    ids = np.asarray([[sp["tts"], sp["text"], *text_ids, sp["audio"]]], dtype=np.int64)
    embeds = pipe.text_embed.run({"input_ids": ids})["inputs_embeds"]
    g["text_embed/in/input_ids"], g["text_embed/out/inputs_embeds"] = ids, embeds

    pipe.decoder.reset()
    hidden = pipe.decoder.forward(embeds)
    if (subparts or {}).get("llm_decoder", {}).get("kv_cache"):  # a quantized KV cache: the oracle's K/V
        g.update({f"{GOLDEN_KV}{name}": value for name, value in pipe.decoder.kv_cache().items()})
    step_codes = rng.integers(0, c.codebook_size, size=(1, 1, c.num_codebooks), dtype=np.int64)
    step_embeds = pipe.audio_embed.run({"codes": step_codes})["audio_embeds"]
    g["llm_decoder/in/inputs_embeds"], g["llm_decoder/out/hidden_states"] = embeds, hidden
    g["llm_decoder/in/step_embeds"] = step_embeds
    g["llm_decoder/out/step_hidden_states"] = pipe.decoder.forward(step_embeds)

    codes = rng.integers(0, c.codebook_size, size=(1, 6, c.num_codebooks), dtype=np.int64)
    codes[0, 0, 1:] = c.boc
    codes[0, -1, 0] = c.eoc
    g["audio_embed/in/codes"] = codes
    g["audio_embed/out/audio_embeds"] = pipe.audio_embed.run({"codes": codes})["audio_embeds"]

    g["audio_heads/in/hidden_states"] = hidden
    g["audio_heads/out/audio_logits"] = pipe.audio_heads.run({"hidden_states": hidden})["audio_logits"]

    g.update(_codec_probes(pipe, rng))
    precision = (subparts or {}).get("llm_decoder", {}).get("precision", "fp32")
    g["greedy/delayed"] = _greedy_delayed(pipe, precision)
    weights: dict[str, Any] = {}
    if bundle_dir is not None and subparts:
        from higgs_pack.exporters.pytorch.matched import capture_matched

        weights = capture_matched(ckpt, pipe, g, Path(bundle_dir), subparts)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with open(out_path, "wb") as handle:
        np.savez(handle, **g)
    return {"frames": int(g["greedy/delayed"].shape[0]), "weights": weights}


def _codec_probes(pipe, rng: np.random.Generator) -> dict[str, np.ndarray]:
    """The codec's golden entries: the decoder on random codes, the encoder on the probe waveform,
    and for the streaming codec (``audio_tokenizer_stream``) longer random codes with their one-shot
    decode: verification streams them through the bundle's stateful decoder and compares."""
    c = pipe.constants
    audio_codes = rng.integers(0, c.codebook_size, size=(1, c.num_codebooks, 12), dtype=np.int64)
    wave = _probe_waveform(c.sample_rate, c.hop_length, rng)[None, None]
    stream_codes = rng.integers(0, c.codebook_size, size=(1, c.num_codebooks, STREAM_PROBE_FRAMES), dtype=np.int64)
    return {
        "audio_tokenizer/in/audio_codes": audio_codes,
        "audio_tokenizer/out/waveform": pipe.audio_tokenizer.run({"audio_codes": audio_codes})["waveform"],
        "audio_encoder/in/waveform": wave,
        "audio_encoder/out/audio_codes": pipe.audio_encoder.run({"waveform": wave})["audio_codes"],
        "audio_tokenizer_stream/in/audio_codes": stream_codes,
        "audio_tokenizer_stream/out/waveform": pipe.audio_tokenizer.run({"audio_codes": stream_codes})["waveform"],
    }


#: Frames of the streaming codec's golden codes: several calls past the lookahead (10 frames at
#: the published dims) with the call sizes verification uses.
STREAM_PROBE_FRAMES = 40


def _greedy_delayed(pipe, precision: str) -> np.ndarray:
    """The oracle's greedy delayed codes for :data:`GREEDY_TEXT` (:func:`greedy_frames` of them)."""
    frames = greedy_frames(sum(p.numel() for p in pipe.decoder.model.parameters()), precision)
    if not frames:
        return np.zeros((0, pipe.constants.num_codebooks), dtype=np.int64)
    greedy = generate_codes(pipe, build_prompt(pipe, GREEDY_TEXT),
                            SamplingOptions(temperature=0.0, repeat_guard_frames=0), max_frames=frames)
    return greedy.delayed

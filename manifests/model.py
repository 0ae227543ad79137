"""The model's own facts (pure data): its sub-parts and their tensor names, and the Higgs
special tokens, from ``shared/MODEL.md`` (Higgs-Audio-v3, bosonai/higgs-audio-v3-tts-4b)."""

from __future__ import annotations

import enum


class SubPart(str, enum.Enum):
    """The exported pieces of Higgs-Audio-v3 (names as in MODEL.md): six, and the codec decoder a
    second time as a stateful stream (:data:`OPTIONAL_SUBPARTS`: bundles built before it lack it)."""

    TEXT_EMBED = "text_embed"
    """input_ids int64 [batch, sequence] -> inputs_embeds float [batch, sequence, hidden]."""
    LLM_DECODER = "llm_decoder"
    """Qwen3 body: inputs_embeds + KV cache -> hidden_states (no embedding, no LM head)."""
    AUDIO_EMBED = "audio_embed"
    """codes int64 [batch, frames, 8] -> audio_embeds [batch, frames, hidden] (fused table, summed)."""
    AUDIO_HEADS = "audio_heads"
    """hidden_states [batch, frames, hidden] -> audio_logits [batch, frames, 8, 1026]."""
    AUDIO_TOKENIZER = "audio_tokenizer"
    """Codec decoder: audio_codes int64 [batch, 8, frames] -> waveform float32 [batch, 1, frames*960]."""
    AUDIO_ENCODER = "audio_encoder"
    """Codec encoder: waveform float32 [batch, 1, samples] -> audio_codes int64 [batch, 8, samples/960]."""
    AUDIO_TOKENIZER_STREAM = "audio_tokenizer_stream"
    """Codec decoder, one stream step: audio_codes int64 [batch, 8, frames], start_frame and end_frame
    int64 [batch], codec_state float32 [batch, S] -> waveform float32 [batch, 1, frames*960] (the
    one-shot waveform delayed by the manifest's ``delay_samples``), codec_state_out [batch, S]
    (``exporters/pytorch/stream_codec.py``)."""

    def __str__(self) -> str:
        return self.value


#: Characters of the longest sub-part name: the width of the name column in tables (inspect, --plan).
NAME_WIDTH = max(len(part.value) for part in SubPart)


#: Input and output tensor names of each sub-part except the decoder, whose
#: names depend on the exporter (ModelBuilder or optimum-intel).
SUBPART_IO: dict[SubPart, tuple[tuple[str, ...], tuple[str, ...]]] = {
    SubPart.TEXT_EMBED: (("input_ids",), ("inputs_embeds",)),
    SubPart.AUDIO_EMBED: (("codes",), ("audio_embeds",)),
    SubPart.AUDIO_HEADS: (("hidden_states",), ("audio_logits",)),
    SubPart.AUDIO_TOKENIZER: (("audio_codes",), ("waveform",)),
    SubPart.AUDIO_ENCODER: (("waveform",), ("audio_codes",)),
    SubPart.AUDIO_TOKENIZER_STREAM: (("audio_codes", "start_frame", "end_frame", "codec_state"),
                                     ("waveform", "codec_state_out")),
}

#: Sub-parts that are always exported at fp32 (int4/fp16 DAC is too lossy, per the seed).
FP32_ONLY = frozenset({SubPart.AUDIO_TOKENIZER, SubPart.AUDIO_ENCODER, SubPart.AUDIO_TOKENIZER_STREAM})

#: Sub-parts a bundle may lack: those added after bundles were first built (manifest format 1
#: has no ``audio_tokenizer_stream``; such bundles stream with windows of the one-shot codec).
OPTIONAL_SUBPARTS = frozenset({SubPart.AUDIO_TOKENIZER_STREAM})


#: Higgs special tokens, by role -> token text.  Ids are resolved by name from the
#: tokenizer, never hard-coded (MODEL.md: reported ids 151667..151680).
SPECIAL_TOKENS: dict[str, str] = {
    "tts": "<|tts|>",
    "audio": "<|audio|>",
    "text": "<|text|>",
    "ref_audio": "<|ref_audio|>",
    "ref_text": "<|ref_text|>",
}

"""Names and tables shared by every part of higgs-pack (pure data).

Sub-part names, execution providers and model facts come from
``shared/MODEL.md`` (Higgs-Audio-v3, bosonai/higgs-audio-v3-tts-4b).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

#: Version of the manifest format this higgs-pack writes and the newest it reads.
FORMAT_VERSION = 1


class SubPart(str, enum.Enum):
    """The six exported pieces of Higgs-Audio-v3 (names as in MODEL.md)."""

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

    def __str__(self) -> str:
        return self.value


#: Input and output tensor names of each sub-part except the decoder, whose
#: names depend on the exporter (ModelBuilder or optimum-intel).
SUBPART_IO: dict[SubPart, tuple[tuple[str, ...], tuple[str, ...]]] = {
    SubPart.TEXT_EMBED: (("input_ids",), ("inputs_embeds",)),
    SubPart.AUDIO_EMBED: (("codes",), ("audio_embeds",)),
    SubPart.AUDIO_HEADS: (("hidden_states",), ("audio_logits",)),
    SubPart.AUDIO_TOKENIZER: (("audio_codes",), ("waveform",)),
    SubPart.AUDIO_ENCODER: (("waveform",), ("audio_codes",)),
}

#: Sub-parts that are always exported at fp32 (int4/fp16 DAC is too lossy, per the seed).
FP32_ONLY = frozenset({SubPart.AUDIO_TOKENIZER, SubPart.AUDIO_ENCODER})


@dataclass(frozen=True)
class ExecutionProvider:
    """One row of the execution-provider table.

    Attributes:
        name: The bundle's name for it (``cpu``, ``cuda``, ``dml``, ``openvino``).
        ort_provider: ONNX Runtime's provider name, for example ``CUDAExecutionProvider``.
        distribution: The PyPI distribution that provides it.
        requirement: The requirement string a bundle records for it.
        extra: The ``higgs-pack[extra]`` that installs it.
    """

    name: str
    ort_provider: str
    distribution: str
    requirement: str
    extra: str


#: Bundle EP name -> provider, package and extra (the one table; see STYLE.md #6).
EXECUTION_PROVIDERS: dict[str, ExecutionProvider] = {
    ep.name: ep
    for ep in (
        ExecutionProvider(
            "cpu", "CPUExecutionProvider", "onnxruntime", "onnxruntime>=1.31,<1.33", "cpu"
        ),
        ExecutionProvider(
            "cuda", "CUDAExecutionProvider", "onnxruntime-gpu", "onnxruntime-gpu>=1.31,<1.33", "cuda"
        ),
        ExecutionProvider(
            "dml",
            "DmlExecutionProvider",
            "onnxruntime-directml",
            "onnxruntime-directml>=1.24,<1.33; sys_platform == 'win32'",
            "dml",
        ),
        ExecutionProvider(
            "openvino",
            "OpenVINOExecutionProvider",
            "onnxruntime-openvino",
            "onnxruntime-openvino>=1.24",
            "openvino-ep",
        ),
    )
}

#: OpenVINO runtime requirement for bundles in OpenVINO IR.
OPENVINO_REQUIREMENT = "openvino>=2026.4,<2027"

#: Higgs special tokens, by role -> token text.  Ids are resolved by name from the
#: tokenizer, never hard-coded (MODEL.md: reported ids 151667..151680).
SPECIAL_TOKENS: dict[str, str] = {
    "tts": "<|tts|>",
    "audio": "<|audio|>",
    "text": "<|text|>",
    "ref_audio": "<|ref_audio|>",
    "ref_text": "<|ref_text|>",
}

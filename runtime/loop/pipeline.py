"""The backend interface the generation loop talks to.

A :class:`Pipeline` is the six sub-parts of Higgs-Audio-v3 served by one backend
(ONNX Runtime, OpenVINO, or the PyTorch oracle in ``exporters/pytorch/reference.py``),
plus the tokenizer and the model constants.  The loop in
:mod:`higgs_pack.runtime.loop.decode` only sees this interface, so the same loop
runs every target and the oracle.

All arrays crossing the interface are numpy, batch 1:

===============  =======================================  ======================================
sub-part          input                                    output
===============  =======================================  ======================================
text_embed       ``input_ids`` int64 [1, S]               ``inputs_embeds`` float32 [1, S, H]
llm_decoder      ``inputs_embeds`` float32 [1, S, H]      hidden_states float32 [1, S, H]
audio_embed      ``codes`` int64 [1, L, 8]                ``audio_embeds`` float32 [1, L, H]
audio_heads      ``hidden_states`` float32 [1, L, H]      ``audio_logits`` float32 [1, L, 8, 1026]
audio_tokenizer  ``audio_codes`` int64 [1, 8, T]          ``waveform`` float32 [1, 1, T*960]
audio_encoder    ``waveform`` float32 [1, 1, N*960]       ``audio_codes`` int64 [1, 8, N]
===============  =======================================  ======================================

Runners may compute in another dtype (fp16 graphs); they cast at their boundary
and always return float32 / int64 as above.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np

from higgs_pack.errors import InputError, Problem, SignatureMismatch
from higgs_pack.manifests.model import SubPart
from higgs_pack.runtime.loop.stateful_codec import FEED_FRAMES


class SubPartRunner(Protocol):
    """One stateless sub-part: named numpy inputs in, named numpy outputs out."""

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Run once.  Keys are the tensor names in ``SUBPART_IO``.

        Ownership: for the per-step shapes (:func:`step_input_shapes`) a runner may return
        views of its own preallocated buffers, valid until its next call with those shapes
        (the generation loop reads them before that; copy what must live longer).  Other
        calls return arrays the caller owns.
        """
        ...


class Decoder(Protocol):
    """The Qwen3 decoder with its KV cache held by the runner.

    ``forward`` appends ``inputs_embeds`` to the sequence seen since the last
    ``reset`` (positions continue, attention is causal over all of it) and
    returns the final-norm hidden states of the new positions.
    """

    max_length: int
    """Most positions (prompt + frames) one request may use."""

    def reset(self) -> None:
        """Forget the KV cache; the next ``forward`` starts at position 0."""
        ...

    def forward(self, inputs_embeds: np.ndarray) -> np.ndarray:
        """float32 [1, S, H] -> float32 [1, S, H]."""
        ...


@dataclass(frozen=True)
class ModelConstants:
    """Model facts the loop needs (stored in the manifest's ``constants``).

    Attributes:
        hidden_size: H, decoder width.
        num_codebooks: N = 8 codebooks (MODEL.md).
        codebook_size: 1024 codes per codebook; 1024 is BOC, 1025 is EOC.
        audio_vocab_size: 1026 = codebook_size + BOC + EOC.
        boc: begin-of-codes id (1024).
        eoc: end-of-codes id (1025).
        sample_rate: Codec sample rate in Hz (24000).
        frame_rate: Codec frames per second (25).
        hop_length: Samples per frame (960).
        special_tokens: role -> token id, resolved by name from the tokenizer.
        num_layers, num_attention_heads, num_key_value_heads, head_dim: decoder shape.
        max_position_embeddings: decoder context length in positions.
    """

    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int
    special_tokens: dict[str, int]
    num_codebooks: int = 8
    codebook_size: int = 1024
    audio_vocab_size: int = 1026
    boc: int = 1024
    eoc: int = 1025
    sample_rate: int = 24000
    frame_rate: int = 25
    hop_length: int = 960
    text_vocab_size: int = 151936

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict (the manifest's ``constants`` object)."""
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in self.__dict__.items()}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConstants:
        """Inverse of :meth:`to_dict`."""
        return cls(**data)


@dataclass
class Pipeline:
    """The six sub-parts on one backend, plus tokenizer and constants.

    Attributes:
        tokenizer: a ``tokenizers.Tokenizer`` with the Higgs special tokens.
        constants: the model constants.
        text_embed, audio_embed, audio_heads, audio_tokenizer, audio_encoder: runners.
        decoder: the stateful decoder.
        description: human-readable backend description (provider / device per sub-part).
        generation_defaults: default sampling options from the manifest.
        codec_context_frames: frames of codes each side of a window that the codec decoder
            needs for chunked decoding to equal one pass (``stream_context_frames`` in the
            manifest); None until known (then measured on first use, see
            :func:`higgs_pack.runtime.loop.streaming.codec_context_frames`).
        audio_tokenizer_stream: the stateful streaming codec decoder's runner, None in bundles
            built before it (manifest format 1): they stream with windows of ``audio_tokenizer``.
        stream_codec: its lookahead, delay and state size
            (:class:`~higgs_pack.runtime.loop.stateful_codec.StreamCodecSpec`), None without it.
        codec_feed_frames: frames a stream feeds that codec at a time before its next chunk is
            due (:class:`~higgs_pack.runtime.loop.stateful_codec.StatefulCodec`; default
            :data:`~higgs_pack.runtime.loop.stateful_codec.FEED_FRAMES`), None for one call per chunk.
    """

    tokenizer: Any
    constants: ModelConstants
    text_embed: SubPartRunner
    decoder: Decoder
    audio_embed: SubPartRunner
    audio_heads: SubPartRunner
    audio_tokenizer: SubPartRunner
    audio_encoder: SubPartRunner | None = None
    description: dict[str, str] = field(default_factory=dict)
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    codec_context_frames: int | None = None
    prefix_cache: Any = None
    """The :class:`~higgs_pack.runtime.loop.prefix_cache.PrefixCache` of voice prefixes' KV that
    the loop and the engine use (None: every prompt is prefilled whole)."""
    audio_tokenizer_stream: SubPartRunner | None = None
    stream_codec: Any = None
    codec_feed_frames: int | None = FEED_FRAMES


def step_input_shapes(part: str, constants: ModelConstants) -> dict[str, tuple[int, ...]] | None:
    """Input shapes of a sub-part's once-per-frame call in the generation loop.

    ``audio_heads``: ``{"hidden_states": (1, 1, H)}`` (-> ``audio_logits`` [1, 1, N, 1026]);
    ``audio_embed``: ``{"codes": (1, 1, N)}`` (-> ``audio_embeds`` [1, 1, H]); None for the
    other sub-parts.  Runners may preallocate and bind buffers for these shapes.
    """
    if part == SubPart.AUDIO_HEADS:
        return {"hidden_states": (1, 1, constants.hidden_size)}
    if part == SubPart.AUDIO_EMBED:
        return {"codes": (1, 1, constants.num_codebooks)}
    return None


def check_io_signature(subpart: str, what: str, inputs: dict[str, tuple[str, int]],
                       outputs: dict[str, tuple[str, int]], spec: dict[str, Any]) -> None:
    """Compare a loaded model's I/O with the manifest's signature (every backend uses this).

    Args:
        subpart: sub-part name, for the message.
        what: what was loaded, for the message (``"graph"`` for ONNX, ``"IR"`` for OpenVINO).
        inputs, outputs: tensor name -> (numpy dtype name, rank) as the model declares them.
        spec: the manifest's sub-part entry (``inputs`` / ``outputs`` lists of name, dtype, shape).

    Names, element types and ranks must match; symbolic dims may differ in name.

    Raises:
        SignatureMismatch: naming the sub-part and both signatures.
    """
    def want(items):
        return {t["name"]: (t["dtype"], len(t["shape"])) for t in items}

    for kind, got, expected in (("inputs", inputs, want(spec["inputs"])), ("outputs", outputs, want(spec["outputs"]))):
        if got != expected:
            diff = sorted(set(got.items()) ^ set(expected.items()))
            raise SignatureMismatch(
                f"{subpart}: {what} {kind} differ from the manifest: {what} has {got}, manifest says "
                f"{expected} (differences: {diff}). The bundle's files and manifest do not belong "
                "together: rebuild the bundle"
            )


def check_decoder_room(total: int, max_length: int) -> None:
    """Refuse a decoder call that would make the KV cache hold more than ``max_length``
    positions (every backend's decoder runner calls this before it runs).

    Args:
        total: positions the cache would hold after the call (past + new).
        max_length: the runner's ``Decoder.max_length``.

    Raises:
        InputError: naming both numbers and what to shorten.
    """
    if total > max_length:
        raise InputError.of(
            Problem.said(f"the decoder would hold {total} positions, more than max_length={max_length}; "
                         "shorten the text or lower max_frames=", code="input_too_long")
        )

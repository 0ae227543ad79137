"""PyTorch modules of the Higgs-Audio-v3 sub-parts: what gets exported, and the oracle.

One ``nn.Module`` per stateless sub-part, float32, with the tensor names of
:data:`higgs_pack.manifests.model.SUBPART_IO` and the contracts of
``shared/MODEL.md`` (B batch, S/L sequence, N = 8 codebooks, V = 1026, H hidden):

===============  =====================================  =========================================
module           input                                  output
===============  =====================================  =========================================
TextEmbed        ``input_ids`` int64 [B, S]             ``inputs_embeds`` float32 [B, S, H]
AudioEmbed       ``codes`` int64 [B, L, N]              ``audio_embeds`` float32 [B, L, H]
AudioHeads       ``hidden_states`` float32 [B, L, H]    ``audio_logits`` float32 [B, L, N, V]
CodecDecoder     ``audio_codes`` int64 [B, N, T]        ``waveform`` float32 [B, 1, T*960]
CodecEncoder     ``waveform`` float32 [B, 1, T*960]     ``audio_codes`` int64 [B, N, T]
===============  =====================================  =========================================

Every module exports with ``torch.onnx.export(..., dynamo=False, opset_version=20)``
(Olive's ``OnnxConversion``: :func:`higgs_pack.exporters.onnx.olive.export_onnx`) with dynamic
batch and sequence/frame/sample axes (:data:`DYNAMIC_AXES`), and the
exported graph accepts lengths other than the example's.  The codec encoder is written
so that tracing folds nothing length-dependent: the 24 kHz -> 16 kHz resampling of the
semantic branch (transformers calls ``torchaudio.functional.resample``, whose output
length is computed in Python) is a fixed-kernel strided convolution here, and the
acoustic branch never takes the "pad when lengths disagree" branch of
``HiggsAudioV2TokenizerModel.encode``, which is why its input must be a whole number of
960-sample frames (pad with silence; MODEL.md's encoder caveat).  For such inputs it
returns exactly the codes of ``HiggsAudioV2TokenizerModel.encode``.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from higgs_pack.errors import InputError, Problem
from higgs_pack.manifests.model import SubPart

if TYPE_CHECKING:
    from higgs_pack.exporters.checkpoint.reader import HiggsCheckpoint
    from higgs_pack.runtime.loop.pipeline import ModelConstants

#: Symbolic axes of every exported input and output.
DYNAMIC_AXES: dict[SubPart, dict[str, dict[int, str]]] = {
    SubPart.TEXT_EMBED: {
        "input_ids": {0: "batch", 1: "sequence"},
        "inputs_embeds": {0: "batch", 1: "sequence"},
    },
    SubPart.AUDIO_EMBED: {
        "codes": {0: "batch", 1: "frames"},
        "audio_embeds": {0: "batch", 1: "frames"},
    },
    SubPart.AUDIO_HEADS: {
        "hidden_states": {0: "batch", 1: "frames"},
        "audio_logits": {0: "batch", 1: "frames"},
    },
    SubPart.AUDIO_TOKENIZER: {
        "audio_codes": {0: "batch", 2: "frames"},
        "waveform": {0: "batch", 2: "samples"},
    },
    SubPart.AUDIO_ENCODER: {
        "waveform": {0: "batch", 2: "samples"},
        "audio_codes": {0: "batch", 2: "frames"},
    },
    SubPart.AUDIO_TOKENIZER_STREAM: {
        "audio_codes": {0: "batch", 2: "frames"},
        "start_frame": {0: "batch"},
        "end_frame": {0: "batch"},
        "codec_state": {0: "batch"},
        "waveform": {0: "batch", 2: "samples"},
        "codec_state_out": {0: "batch"},
    },
}


class TextEmbed(nn.Module):
    """Token embedding lookup (a Gather on the text embedding; MODEL.md).

    Args:
        weight: float [text_vocab, H] (``tied.embedding.text_embedding.weight``).

    Inputs: ``input_ids`` int64 [B, S], ids in [0, text_vocab).
    Output: ``inputs_embeds`` float32 [B, S, H].

    With ``keep_dtype`` the table stays in its stored dtype (bf16: half the memory of
    the 1.56 GB float32 table of the 4B model) and only the looked-up rows are cast,
    which gives the same float32 values; the oracle uses this, exports use float32.
    """

    def __init__(self, weight: torch.Tensor, *, keep_dtype: bool = False) -> None:
        super().__init__()
        weight = weight.detach() if keep_dtype else weight.detach().float()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.upcast = keep_dtype  # a module cast later (fp16 export) returns its own dtype

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        rows = F.embedding(input_ids, self.weight)
        return rows.float() if self.upcast else rows


class AudioEmbed(nn.Module):
    """Fused multi-codebook audio embedding (MODEL.md).

    ``audio_embeds[b, l] = sum_c table[codes[b, l, c] + c * V]``.

    Args:
        table: float [N * V, H] (``tied.embedding.modality_embeddings.0.embedding.weight``).
        num_codebooks: N (8).
        audio_vocab_size: V (1026: codes 0..1023, BOC 1024, EOC 1025).

    Inputs: ``codes`` int64 [B, L, N], each in [0, V).
    Output: ``audio_embeds`` float32 [B, L, H].
    """

    def __init__(
        self, table: torch.Tensor, num_codebooks: int = 8, audio_vocab_size: int = 1026
    ) -> None:
        super().__init__()
        if table.shape[0] != num_codebooks * audio_vocab_size:
            raise ValueError(
                f"audio table has {table.shape[0]} rows, expected {num_codebooks} x {audio_vocab_size}"
            )
        self.weight = nn.Parameter(table.detach().float(), requires_grad=False)
        self.register_buffer(
            "offsets",
            torch.arange(num_codebooks, dtype=torch.int64) * audio_vocab_size,
            persistent=False,
        )

    def forward(self, codes: torch.Tensor) -> torch.Tensor:
        return F.embedding(codes + self.offsets, self.weight).sum(dim=-2)


class AudioHeads(nn.Module):
    """Audio logits of all codebooks at once: ``hidden @ Wᵀ`` reshaped (MODEL.md).

    Args:
        weight: float [N * V, H], the fused audio table when tied (the default).
        num_codebooks: N (8).
        audio_vocab_size: V (1026).

    Inputs: ``hidden_states`` float32 [B, L, H] (final-norm decoder output).
    Output: ``audio_logits`` float32 [B, L, N, V].
    """

    def __init__(
        self, weight: torch.Tensor, num_codebooks: int = 8, audio_vocab_size: int = 1026
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight.detach().float(), requires_grad=False)
        self.num_codebooks = num_codebooks
        self.audio_vocab_size = audio_vocab_size

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        logits = F.linear(hidden_states, self.weight)
        return logits.unflatten(-1, (self.num_codebooks, self.audio_vocab_size))


class CodecDecoder(nn.Module):
    """Codes -> 24 kHz waveform: RVQ decode, ``fc2``, DAC acoustic decoder.

    Same computation as ``HiggsAudioV2TokenizerModel.decode``; accepts any frame count.

    Args:
        codec: A float32, eval-mode ``HiggsAudioV2TokenizerModel``
            (:meth:`HiggsCheckpoint.codec`).

    Inputs: ``audio_codes`` int64 [B, N, T], each in [0, 1024) (no BOC/EOC).
    Output: ``waveform`` float32 [B, 1, T * 960], samples at 24 kHz, nominally in [-1, 1].
    """

    def __init__(self, codec: Any) -> None:
        super().__init__()
        self.quantizers = codec.quantizer.quantizers
        self.fc2 = codec.fc2
        self.acoustic_decoder = codec.acoustic_decoder

    def forward(self, audio_codes: torch.Tensor) -> torch.Tensor:
        quantized = self.quantizers[0].decode(audio_codes[:, 0])
        for i in range(1, len(self.quantizers)):
            quantized = quantized + self.quantizers[i].decode(audio_codes[:, i])
        acoustic = self.fc2(quantized.transpose(1, 2)).transpose(1, 2)
        return self.acoustic_decoder(acoustic)


class Resample(nn.Module):
    """Band-limited resampling with a fixed sinc kernel (torchaudio's ``sinc_interp_hann``,
    lowpass width 6, rolloff 0.99), as a strided Conv1d that traces for any length.

    Matches ``torchaudio.functional.resample`` exactly for inputs whose length is a
    multiple of ``orig_freq / gcd`` (3 for 24 kHz -> 16 kHz).

    Inputs: float32 [B, L]. Output: float32 [B, L * new / orig].
    """

    def __init__(self, orig_freq: int, new_freq: int) -> None:
        super().__init__()
        from torchaudio.functional.functional import _get_sinc_resample_kernel

        gcd = math.gcd(int(orig_freq), int(new_freq))
        kernel, width = _get_sinc_resample_kernel(orig_freq, new_freq, gcd, dtype=torch.float32)
        self.register_buffer("kernel", kernel, persistent=False)
        self.orig = int(orig_freq) // gcd
        self.new = int(new_freq) // gcd
        self.width = int(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = F.pad(x, (self.width, self.width + self.orig))
        y = F.conv1d(x.unsqueeze(1), self.kernel, stride=self.orig)  # [B, new, L/orig + 1]
        y = y.transpose(1, 2).flatten(1)
        return y[:, : -self.new]  # torchaudio keeps ceil(new * L / orig) samples


class CodecEncoder(nn.Module):
    """24 kHz waveform -> codes, as ``HiggsAudioV2TokenizerModel.encode`` (max bandwidth).

    Semantic branch: resample to 16 kHz, pad 160 samples each side, HuBERT, mean of all
    hidden states, keep every ``semantic_downsample_factor``-th frame,
    ``encoder_semantic``.  Acoustic branch: the DAC encoder on the 24 kHz input.  Then
    ``fc`` on their concatenation and residual VQ over all quantizers.

    Args:
        codec: A float32, eval-mode ``HiggsAudioV2TokenizerModel``.

    Inputs: ``waveform`` float32 [B, 1, L], 24 kHz mono in [-1, 1], L a multiple of 960
        (pad with silence).
    Output: ``audio_codes`` int64 [B, N, L / 960].

    Raises:
        InputError: (eager mode only) L is not a multiple of the hop.
    """

    def __init__(self, codec: Any) -> None:
        super().__init__()
        cfg = codec.config
        self.hop = int(cfg.hop_length)
        self.semantic_stride = int(cfg.semantic_downsample_factor)
        self.resample = (
            Resample(cfg.sample_rate, cfg.semantic_sample_rate)
            if cfg.sample_rate != cfg.semantic_sample_rate
            else nn.Identity()
        )
        if getattr(codec.config.semantic_model_config, "do_stable_layer_norm", False):
            raise ValueError(
                "codec semantic model uses HuBERT's stable-layer-norm variant; higgs-pack "
                "supports the published HuBERT-base layout (do_stable_layer_norm=false)"
            )
        self.semantic_model = codec.semantic_model
        self.encoder_semantic = codec.encoder_semantic
        self.acoustic_encoder = codec.acoustic_encoder
        self.fc = codec.fc
        self.quantizers = codec.quantizer.quantizers

    def _hubert_hidden_states(self, x: torch.Tensor) -> list[torch.Tensor]:
        """HuBERT's ``output_hidden_states`` (embedding output + every layer), computed
        from its submodules: ``HubertModel.forward`` builds its attention mask with
        Python ints taken from traced shapes, which breaks ONNX tracing; with no padding
        mask the mask is all-ones anyway, so the layers run with ``attention_mask=None``."""
        hubert = self.semantic_model
        encoder = hubert.encoder
        hidden = hubert.feature_projection(hubert.feature_extractor(x).transpose(1, 2))
        hidden = encoder.layer_norm(hidden + encoder.pos_conv_embed(hidden))
        states = [hidden]
        for layer in encoder.layers:
            hidden = layer(hidden, attention_mask=None)[0]
            states.append(hidden)
        return states

    def forward(self, waveform: torch.Tensor) -> torch.Tensor:
        if not torch.jit.is_tracing() and waveform.shape[-1] % self.hop:
            raise InputError.of(
                Problem.said(f"codec encoder input has {waveform.shape[-1]} samples, not a multiple of "
                             f"{self.hop}; pad the 24 kHz waveform with silence to whole frames.")
            )
        semantic_in = F.pad(self.resample(waveform[:, 0, :]), (160, 160))
        hidden = self._hubert_hidden_states(semantic_in)
        semantic = torch.stack(hidden, dim=1).mean(dim=1)[:, :: self.semantic_stride, :]
        e_semantic = self.encoder_semantic(semantic.transpose(1, 2))
        e_acoustic = self.acoustic_encoder(waveform)
        embeddings = torch.cat([e_acoustic, e_semantic], dim=1)
        residual = self.fc(embeddings.transpose(1, 2)).transpose(1, 2)
        codes = []
        for quantizer in self.quantizers:
            indices = quantizer.encode(residual)  # [B, T]
            residual = residual - quantizer.decode(indices)
            codes.append(indices)
        return torch.stack(codes, dim=1)


# --------------------------------------------------------------------------- building


def build_modules(
    ckpt: HiggsCheckpoint, subparts: list[SubPart] | None = None, *, keep_dtype: bool = False
) -> dict[SubPart, nn.Module]:
    """The float32 eval modules of the stateless sub-parts of ``ckpt``.

    Args:
        ckpt: An opened checkpoint.
        subparts: Which ones (default: all six; the codec is loaded once for the codec
            sub-parts; ``audio_tokenizer_stream`` is the exact stream,
            :class:`~higgs_pack.exporters.pytorch.stream_codec.StreamCodecDecoder` with every
            layer's whole reach: :func:`~higgs_pack.exporters.pytorch.stream_codec.measured_stream`
            picks the lookahead the build exports).
        keep_dtype: keep the text embedding table in its stored dtype (see
            :class:`TextEmbed`; the oracle's choice, not an export's).

    Returns:
        ``{subpart: module}``; ``SubPart.LLM_DECODER`` is not among them (see
        :class:`higgs_pack.exporters.pytorch.reference.TorchDecoder`).
    """
    from higgs_pack.exporters.checkpoint.layout import TEXT_EMBEDDING
    from higgs_pack.exporters.checkpoint.models import codec_model

    wanted = list(subparts or DYNAMIC_AXES)
    c = ckpt.constants
    out: dict[SubPart, nn.Module] = {}
    codec = None
    for sp in wanted:
        if sp == SubPart.TEXT_EMBED:
            out[sp] = TextEmbed(ckpt.tensor(TEXT_EMBEDDING), keep_dtype=keep_dtype)
        elif sp == SubPart.AUDIO_EMBED:
            out[sp] = AudioEmbed(ckpt.audio_table(), c.num_codebooks, c.audio_vocab_size)
        elif sp == SubPart.AUDIO_HEADS:
            out[sp] = AudioHeads(ckpt.audio_head_weight(), c.num_codebooks, c.audio_vocab_size)
        elif sp in (SubPart.AUDIO_TOKENIZER, SubPart.AUDIO_ENCODER):
            codec = codec if codec is not None else codec_model(ckpt)
            cls = CodecDecoder if sp == SubPart.AUDIO_TOKENIZER else CodecEncoder
            out[sp] = cls(codec)
        elif sp == SubPart.AUDIO_TOKENIZER_STREAM:
            from higgs_pack.exporters.pytorch.stream_codec import StreamCodecDecoder

            codec = codec if codec is not None else codec_model(ckpt)
            out[sp] = StreamCodecDecoder(CodecDecoder(codec), hop=c.hop_length)
        else:
            raise ValueError(f"{sp} has no stateless torch module")
    return {sp: m.eval() for sp, m in out.items()}


def example_inputs(
    subpart: SubPart, constants: ModelConstants, length: int = 5, module: nn.Module | None = None
) -> tuple[torch.Tensor, ...]:
    """Deterministic example inputs for export (batch 1, ``length`` tokens/frames).

    Returns:
        A 1-tuple with the sub-part's input: ``input_ids`` [1, length],
        ``codes`` [1, length, N], ``hidden_states`` [1, length, H],
        ``audio_codes`` [1, N, length] or ``waveform`` [1, 1, length * hop]; for
        ``audio_tokenizer_stream`` (``module`` is then the stream module, for its state size)
        its four inputs (:func:`higgs_pack.exporters.pytorch.stream_codec.example_inputs`).
    """
    if subpart == SubPart.AUDIO_TOKENIZER_STREAM:
        from higgs_pack.exporters.pytorch.stream_codec import example_inputs as stream_inputs

        if module is None:
            raise ValueError("audio_tokenizer_stream's example inputs need its module (module=) for the state size")
        return stream_inputs(module, constants.num_codebooks, constants.codebook_size, length)
    g = torch.Generator().manual_seed(1234 + length)
    n, v, h = constants.num_codebooks, constants.audio_vocab_size, constants.hidden_size
    if subpart == SubPart.TEXT_EMBED:
        return (torch.randint(0, constants.text_vocab_size, (1, length), generator=g),)
    if subpart == SubPart.AUDIO_EMBED:
        return (torch.randint(0, v, (1, length, n), generator=g),)
    if subpart == SubPart.AUDIO_HEADS:
        return (torch.randn(1, length, h, generator=g),)
    if subpart == SubPart.AUDIO_TOKENIZER:
        return (torch.randint(0, constants.codebook_size, (1, n, length), generator=g),)
    if subpart == SubPart.AUDIO_ENCODER:
        return (0.1 * torch.randn(1, 1, length * constants.hop_length, generator=g),)
    raise ValueError(f"{subpart} is not exported with torch.onnx.export")


def numpy_function(module: nn.Module):
    """``module`` as a function of one numpy array (no grad), returning numpy."""

    def run(x):
        with torch.no_grad():
            return module(torch.from_numpy(np.ascontiguousarray(x))).numpy()

    return run


def codec_stream_context(module: nn.Module, constants: ModelConstants) -> dict[str, Any]:
    """Measure the codec decoder's context for chunked decoding (streaming, static chunks).

    Runs :func:`higgs_pack.runtime.loop.chunking.measure_codec_context` on the PyTorch
    ``audio_tokenizer`` module (exact arithmetic: any change counts).

    Returns:
        The manifest options entry: ``{"stream_context_frames": reach + 1}`` (frames of
        codes each side of a decoded window).

    Raises:
        BuildError: the codec is not local (its reach exceeds the longest probe).
    """
    from higgs_pack.errors import BuildError
    from higgs_pack.runtime.loop.chunking import NotLocalError, measure_codec_context

    try:
        context = measure_codec_context(numpy_function(module), constants.num_codebooks, constants.codebook_size)
    except NotLocalError as exc:
        raise BuildError(f"audio_tokenizer: {exc}; it cannot be decoded in chunks or streamed") from exc
    return {"stream_context_frames": context}

"""The layout of a Higgs-Audio-v3 checkpoint, as data (MODEL.md): tensor names and prefixes,
file names, the published codec config, and what follows from a config without reading a
tensor (codec sample rate / hop / quantizers, the Qwen3 tensor shapes, the standard Qwen3
names). Imports neither torch nor transformers.
"""

from __future__ import annotations

import json
import math
from typing import Any

#: ``config.json`` ``model_type`` of a Higgs-Audio-v3 checkpoint (MODEL.md).
MODEL_TYPE = "higgs_multimodal_qwen3"
#: Token embedding [vocab, hidden], tied to the text head (MODEL.md).
TEXT_EMBEDDING = "tied.embedding.text_embedding.weight"
#: Qwen3 decoder layers and final norm live under this prefix.
BODY_PREFIX = "body."
#: Fused audio embedding [num_codebooks * 1026, hidden] (MODEL.md).
AUDIO_EMBEDDING = "tied.embedding.modality_embeddings.0.embedding.weight"
#: Audio head, present only when not tied to :data:`AUDIO_EMBEDDING`.
AUDIO_HEAD_PREFIX = "tied.head.modality_heads.0."
#: The codec (Higgs Audio v2 tokenizer) state dict.
CODEC_PREFIX = "tied.embedding.modality_embeddings.0.model."
#: Key in ``config.json`` where higgs-pack checkpoints store the codec config
#: (``HiggsAudioV2TokenizerConfig.to_dict()``); absent from the published checkpoint.
CODEC_CONFIG_KEY = "audio_tokenizer_config"
#: ``rope_theta`` to use when ``text_config.rope_theta`` is null (MODEL.md).
DEFAULT_ROPE_THETA = 1_000_000.0
#: Name of the shard index, as transformers writes it.
INDEX_NAME = "model.safetensors.index.json"
#: Name of an unsharded weights file.
SINGLE_NAME = "model.safetensors"
#: Tokenizer files copied into bundles and HF directories, when present.
TOKENIZER_FILE_NAMES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
)
#: Codec tensors that may be present or absent without harm: HuBERT's
#: ``masked_spec_embed`` exists only when ``mask_time_prob > 0`` (training-time
#: masking); the published checkpoint stores it while its config sets the prob to 0.
CODEC_OPTIONAL_KEYS = frozenset({"semantic_model.masked_spec_embed"})

#: The published codec config (bosonai/higgs-audio-v2-tokenizer, MODEL.md):
#: 24 kHz, DAC acoustic model (encoder 64, decoder 1024, latent 256, ratios
#: [8, 5, 4, 2, 3] = hop 960), HuBERT-base semantic model at 16 kHz, downsample 320,
#: bandwidths up to 2 kbps (8 quantizers of 1024 entries, codebook_dim 64).
PUBLISHED_CODEC_CONFIG: dict[str, Any] = {
    "model_type": "higgs_audio_v2_tokenizer",
    "sample_rate": 24000,
    "semantic_sample_rate": 16000,
    "downsample_factor": 320,
    "target_bandwidths": [0.5, 1, 1.5, 2],
    "codebook_size": 1024,
    "codebook_dim": 64,
    "kernel_size": 3,
    "unit_kernel_size": 3,
    "channel_ratios": [1, 1],
    "strides": [1, 1],
    "block_dilations": [1, 1],
    "acoustic_model_config": {
        "model_type": "dac",
        "encoder_hidden_size": 64,
        "decoder_hidden_size": 1024,
        "hidden_size": 256,
        "downsampling_ratios": [8, 5, 4, 2, 3],
        "upsampling_ratios": [8, 5, 4, 2, 3],
    },
    "semantic_model_config": {"model_type": "hubert", "mask_time_prob": 0.0},
}


def codec_config_dict(config: dict[str, Any]) -> dict[str, Any]:
    """The codec config of a checkpoint's ``config.json`` dict.

    ``config[CODEC_CONFIG_KEY]`` when present (higgs-pack checkpoints), else
    :data:`PUBLISHED_CODEC_CONFIG` (MODEL.md).
    """
    found = config.get(CODEC_CONFIG_KEY)
    return json.loads(json.dumps(found if isinstance(found, dict) else PUBLISHED_CODEC_CONFIG))


def codec_facts(codec: dict[str, Any]) -> dict[str, int]:
    """Derive sample rate, hop, frame rate, quantizers from a codec config dict.

    Same formulas as transformers' ``HiggsAudioV2TokenizerConfig`` (hop = product of
    the DAC downsampling ratios; quantizers = 1000 * max bandwidth //
    (frame_rate * log2(codebook_size))), computed without importing transformers.

    Raises:
        KeyError, TypeError, ValueError: on a malformed dict (callers wrap them).
    """
    acoustic = codec.get("acoustic_model_config") or {}
    ratios = acoustic.get("downsampling_ratios", [8, 5, 4, 2])
    sample_rate = int(codec.get("sample_rate", 24000))
    hop = int(math.prod(int(r) for r in ratios))
    frame_rate = math.ceil(sample_rate / hop)
    codebook_size = int(codec.get("codebook_size", 1024))
    bandwidths = codec.get("target_bandwidths", [0.5, 1, 1.5, 2, 4])
    nbits = math.ceil(math.log2(codebook_size))
    quantizers = int(1000 * float(bandwidths[-1]) // (frame_rate * nbits))
    return {
        "sample_rate": sample_rate,
        "hop_length": hop,
        "frame_rate": frame_rate,
        "codebook_size": codebook_size,
        "num_quantizers": quantizers,
    }


def fixed_text_config(text_config: dict[str, Any]) -> dict[str, Any]:
    """A copy of ``text_config`` with a null ``rope_theta`` read as 1,000,000 (MODEL.md).

    Both spellings are fixed: top-level ``rope_theta`` and
    ``rope_parameters.rope_theta`` (transformers 5).  ``head_dim`` defaults to
    ``hidden_size // num_attention_heads`` when absent.
    """
    fixed = json.loads(json.dumps(text_config))
    if fixed.get("rope_theta") is None:
        fixed["rope_theta"] = DEFAULT_ROPE_THETA
    params = fixed.get("rope_parameters")
    if isinstance(params, dict) and params.get("rope_theta") is None:
        params["rope_theta"] = fixed["rope_theta"]
    if fixed.get("head_dim") is None and fixed.get("num_attention_heads"):
        fixed["head_dim"] = int(fixed["hidden_size"]) // int(fixed["num_attention_heads"])
    return fixed


def llm_tensor_shapes(text_config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Expected names and shapes of the Qwen3 tensors (embedding, body) in checkpoint names.

    Args:
        text_config: The (fixed) Qwen3 text config.

    Returns:
        ``{name: shape}`` in layout order: text embedding, layers, final norm.
    """
    h = int(text_config["hidden_size"])
    heads = int(text_config["num_attention_heads"])
    kv = int(text_config.get("num_key_value_heads") or heads)
    hd = int(text_config.get("head_dim") or h // heads)
    inter = int(text_config["intermediate_size"])
    shapes: dict[str, tuple[int, ...]] = {TEXT_EMBEDDING: (int(text_config["vocab_size"]), h)}
    for i in range(int(text_config["num_hidden_layers"])):
        p = f"{BODY_PREFIX}layers.{i}."
        shapes.update(
            {
                p + "input_layernorm.weight": (h,),
                p + "self_attn.q_proj.weight": (heads * hd, h),
                p + "self_attn.k_proj.weight": (kv * hd, h),
                p + "self_attn.v_proj.weight": (kv * hd, h),
                p + "self_attn.o_proj.weight": (h, heads * hd),
                p + "self_attn.q_norm.weight": (hd,),
                p + "self_attn.k_norm.weight": (hd,),
                p + "post_attention_layernorm.weight": (h,),
                p + "mlp.gate_proj.weight": (inter, h),
                p + "mlp.up_proj.weight": (inter, h),
                p + "mlp.down_proj.weight": (h, inter),
            }
        )
    shapes[BODY_PREFIX + "norm.weight"] = (h,)
    return shapes


def hf_qwen3_name(name: str) -> str:
    """Checkpoint name -> standard Qwen3 HF name (MODEL.md remap).

    ``tied.embedding.text_embedding.`` -> ``model.embed_tokens.``; ``body.`` -> ``model.``.
    """
    prefix = TEXT_EMBEDDING.rsplit(".", 1)[0] + "."
    if name.startswith(prefix):
        return "model.embed_tokens." + name[len(prefix) :]
    if name.startswith(BODY_PREFIX):
        return "model." + name[len(BODY_PREFIX) :]
    raise ValueError(f"{name!r} is not a Qwen3 tensor of the checkpoint")

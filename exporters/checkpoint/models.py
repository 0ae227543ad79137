"""Torch model building from a Higgs-Audio-v3 checkpoint: transformers' ``Qwen3Model`` (the
oracle's decoder) and ``HiggsAudioV2TokenizerModel`` (the codec), each built on the meta
device and filled one tensor at a time, strictly (every tensor present, no extra, shapes
checked); and the backbone written as a standard Qwen3 HF directory for ModelBuilder /
optimum-intel.

Plain functions of an opened :class:`~higgs_pack.exporters.checkpoint.reader.HiggsCheckpoint`,
using only its public reading interface (``text_config``, ``codec_config_dict``,
``tensor``, ``tensor_shape``, ``tensor_dtype``, ``tensor_names``, ``weight_files``,
``index_path``, ``tokenizer_files``, ``close``, ``root``).
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from higgs_pack.errors import CheckpointError, first_line
from higgs_pack.exporters.checkpoint.layout import (
    BODY_PREFIX,
    CODEC_CONFIG_KEY,
    CODEC_OPTIONAL_KEYS,
    CODEC_PREFIX,
    TEXT_EMBEDDING,
    hf_qwen3_name,
    llm_tensor_shapes,
)
from higgs_pack.exporters.checkpoint.safetensors_writer import LazyTensor, write_sharded_safetensors

if TYPE_CHECKING:  # heavy imports stay lazy: planning must not import torch
    import torch
    from transformers import HiggsAudioV2TokenizerModel, Qwen3Config, Qwen3Model

    from higgs_pack.exporters.checkpoint.reader import HiggsCheckpoint


def _weights_file(ckpt: HiggsCheckpoint) -> Path:
    """The file a tensor error names: the shard index, else the single weights file."""
    return ckpt.index_path or ckpt.weight_files()[0]


# ---------------------------------------------------------------------- torch models


def qwen3_config(ckpt: HiggsCheckpoint) -> Qwen3Config:
    """transformers ``Qwen3Config`` of the checkpoint's backbone (rope_theta fixed).

    Raises:
        CheckpointError: the text config is not a valid Qwen3 config.
    """
    from transformers import Qwen3Config

    cfg = hf_qwen3_config_dict(ckpt)
    cfg.pop("architectures", None)
    try:
        return Qwen3Config(**{k: v for k, v in cfg.items() if k != "model_type"})
    except Exception as exc:
        raise CheckpointError(
            f"{ckpt.root / 'config.json'}: text_config is not a valid Qwen3 config "
            f"({first_line(exc)})."
        ) from exc


def hf_qwen3_config_dict(ckpt: HiggsCheckpoint) -> dict[str, Any]:
    """config.json of the standard Qwen3 HF directory (:func:`write_qwen3_hf_dir`): the text
    config as ``qwen3`` / ``Qwen3ForCausalLM``, embeddings tied, the stored dtype."""
    cfg = ckpt.text_config
    cfg.update(
        {
            "architectures": ["Qwen3ForCausalLM"],
            "model_type": "qwen3",
            "tie_word_embeddings": True,
            "torch_dtype": str(ckpt.tensor_dtype(TEXT_EMBEDDING)).removeprefix("torch."),
        }
    )
    cfg.pop("dtype", None)
    return dict(sorted(cfg.items()))


def qwen3_model(ckpt: HiggsCheckpoint, *, stored_dtype: bool = False, projections: bool = True) -> Qwen3Model:
    """The checkpoint's Qwen3 body as an eval-mode transformers ``Qwen3Model`` (the oracle's decoder).

    Built on the meta device and filled from the checkpoint one tensor at a time (no
    random init, one copy of the weights).  The token embedding is left out
    (``embed_tokens`` is ``None``): the oracle feeds ``inputs_embeds``, and the text
    embedding lives in the ``text_embed`` module.  The checkpoint's files are closed
    afterwards (their pages are not kept resident for this process).

    Args:
        ckpt: the opened checkpoint.
        stored_dtype: keep the weights in the checkpoint's dtype (bf16 for the real
            model: 7.3 GiB instead of 14.6 GiB for the 4B body); the caller then runs
            each layer in float32 with :func:`higgs_pack.exporters.pytorch.reference.upcast_per_layer`.
            Default: a float32 model.
        projections: load the attention and MLP projection weights (False: they stay
            on the meta device, for a caller that supplies every layer's projections
            itself, like the matched oracle; only the norms are read).

    Raises:
        CheckpointError: the tensors do not load into the model.
    """
    import torch
    from transformers import Qwen3Model
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

    config = qwen3_config(ckpt)
    with torch.device("meta"):
        model = Qwen3Model(config)
    model.embed_tokens = None
    state = {}
    skipped = []
    for n in llm_tensor_shapes(ckpt.text_config):
        if n == TEXT_EMBEDDING:
            continue
        if not projections and n.endswith("_proj.weight"):
            skipped.append(hf_qwen3_name(n).removeprefix("model."))
            continue
        t = ckpt.tensor(n)
        state[hf_qwen3_name(n).removeprefix("model.")] = t if stored_dtype else t.float()
    ckpt.close()
    _load_strict(model, state, where=_weights_file(ckpt), prefix=BODY_PREFIX, optional=skipped)
    del state
    model.rotary_emb = Qwen3RotaryEmbedding(config=config)
    if projections:
        _check_no_meta(model, "Qwen3Model")
    if not stored_dtype:
        model = model.float()
    return model.eval().requires_grad_(False)


def codec_config(ckpt: HiggsCheckpoint) -> Any:
    """transformers ``HiggsAudioV2TokenizerConfig`` of the checkpoint's codec.

    Raises:
        CheckpointError: the codec config does not load.
    """
    from transformers import HiggsAudioV2TokenizerConfig

    try:
        return HiggsAudioV2TokenizerConfig.from_dict(ckpt.codec_config_dict)
    except Exception as exc:
        raise CheckpointError(
            f"{ckpt.root / 'config.json'}: {CODEC_CONFIG_KEY} is not a valid "
            f"HiggsAudioV2TokenizerConfig ({first_line(exc)})."
        ) from exc


def codec_state_dict(ckpt: HiggsCheckpoint) -> dict[str, torch.Tensor]:
    """The codec tensors, prefix stripped, float32 (integer tensors unchanged)."""
    out = {}
    for name in ckpt.tensor_names():
        if name.startswith(CODEC_PREFIX):
            t = ckpt.tensor(name)
            out[name[len(CODEC_PREFIX) :]] = t.float() if t.is_floating_point() else t
    return out


def codec_model(ckpt: HiggsCheckpoint) -> HiggsAudioV2TokenizerModel:
    """The checkpoint's codec as a float32, eval-mode transformers ``HiggsAudioV2TokenizerModel``.

    The state dict under :data:`CODEC_PREFIX` is loaded strictly (only
    :data:`CODEC_OPTIONAL_KEYS` may be absent or extra).  Weight-norm forms are
    accepted: old-style ``weight_g``/``weight_v`` and ``parametrizations.weight
    .original0/1``; all weight norms are folded into plain weights after loading,
    so the module exports to plain Conv nodes.

    Raises:
        CheckpointError: missing, unexpected or mis-shaped codec tensors.
    """
    import torch
    from torch.nn.utils import parametrize
    from transformers import HiggsAudioV2TokenizerModel

    config = codec_config(ckpt)
    state = codec_state_dict(ckpt)
    acoustic_norm = any(
        k.startswith(("acoustic_encoder.", "acoustic_decoder."))
        and (k.endswith((".weight_g", ".weight_v")) or ".parametrizations.weight." in k)
        for k in state
    )
    with torch.device("meta"):
        model = HiggsAudioV2TokenizerModel(config)
        if acoustic_norm:
            model.apply_weight_norm()
    state = {_new_weight_norm_name(k): v for k, v in state.items()}
    for key, ref in model.state_dict().items():
        if key in CODEC_OPTIONAL_KEYS and key not in state:
            state[key] = torch.zeros(ref.shape, dtype=ref.dtype)  # unused at inference
    _load_strict(model, state, where=_weights_file(ckpt), prefix=CODEC_PREFIX, optional=CODEC_OPTIONAL_KEYS)
    _check_no_meta(model, "HiggsAudioV2TokenizerModel")
    for module in model.modules():
        if parametrize.is_parametrized(module, "weight"):
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
    return model.float().eval().requires_grad_(False)


# ---------------------------------------------------------------------- HF directory


def write_qwen3_hf_dir(ckpt: HiggsCheckpoint, out_dir: str | Path, *, max_shard_bytes: int = 4_500_000_000) -> Path:
    """Write the checkpoint's backbone as a standard Qwen3 HF directory (for ModelBuilder / optimum-intel).

    ``config.json`` is :func:`hf_qwen3_config_dict` (the text config with ``model_type:
    qwen3``, ``architectures: [Qwen3ForCausalLM]``, ``rope_theta`` fixed (MODEL.md) and
    ``tie_word_embeddings: true``); weights are remapped
    (``tied.embedding.text_embedding.`` -> ``model.embed_tokens.``, ``body.`` ->
    ``model.``), kept in their stored dtype, and written shard by shard, one tensor
    in memory at a time; the tokenizer files are copied.  No audio tensors.

    Args:
        ckpt: the opened checkpoint.
        out_dir: Directory to create or overwrite.
        max_shard_bytes: Most data bytes per shard.

    Returns:
        ``out_dir`` as a Path.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    specs = [
        LazyTensor(hf_qwen3_name(name), ckpt.tensor_shape(name), ckpt.tensor_dtype(name),
                   lambda name=name: ckpt.tensor(name))
        for name in llm_tensor_shapes(ckpt.text_config)
    ]
    write_sharded_safetensors(out, specs, max_shard_bytes)
    (out / "config.json").write_text(json.dumps(hf_qwen3_config_dict(ckpt), indent=2) + "\n", encoding="utf-8")
    for f in ckpt.tokenizer_files():
        shutil.copyfile(f, out / f.name)
    return out


def _new_weight_norm_name(name: str) -> str:
    if name.endswith(".weight_g"):
        return name[: -len("weight_g")] + "parametrizations.weight.original0"
    if name.endswith(".weight_v"):
        return name[: -len("weight_v")] + "parametrizations.weight.original1"
    return name


def _load_strict(
    model: Any,
    state: dict[str, Any],
    *,
    where: Path,
    prefix: str,
    optional: Iterable[str] = (),
) -> None:
    """load_state_dict(assign=True) with CheckpointErrors naming the first bad tensor."""
    optional = set(optional)
    expected = model.state_dict()
    missing = [k for k in expected if k not in state and k not in optional]
    if missing:
        raise CheckpointError(
            f"{where}: tensor {prefix + missing[0]!r} is missing ({len(missing)} missing in "
            f"all). The checkpoint is incomplete or not Higgs-Audio-v3; re-download it."
        )
    unexpected = [k for k in state if k not in expected and k not in optional]
    if unexpected:
        raise CheckpointError(
            f"{where}: unexpected tensor {prefix + unexpected[0]!r} ({len(unexpected)} in "
            f"all); the checkpoint does not match its config."
        )
    for k, v in state.items():
        if k in expected and tuple(v.shape) != tuple(expected[k].shape):
            raise CheckpointError(
                f"{where}: tensor {prefix + k!r} has shape {list(v.shape)}, expected "
                f"{list(expected[k].shape)} from config.json. The weights do not belong to "
                f"this config."
            )
    model.load_state_dict(
        {k: v for k, v in state.items() if k in expected}, strict=False, assign=True
    )


def _check_no_meta(model: Any, what: str) -> None:
    for name, t in [*model.named_parameters(), *model.named_buffers()]:
        if t.is_meta:
            raise CheckpointError(f"internal: {what}.{name} was not filled from the checkpoint")

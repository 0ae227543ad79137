"""Read a Higgs-Audio-v3 checkpoint: config, tokenizer, tensors, codec and Qwen3 body.

A Higgs-Audio-v3 checkpoint (``bosonai/higgs-audio-v3-tts-4b``, see
``shared/MODEL.md``) is a directory with

* ``config.json``: ``model_type: "higgs_multimodal_qwen3"``, a Qwen3 ``text_config``
  (its ``rope_theta`` ships as ``null`` and means 1,000,000) and
  ``audio_encoder_config = {encoder_type: "discrete", num_codebooks: 8,
  vocab_size: 1026, tie_word_embeddings: true}``;
* the weights as ``model.safetensors`` or shards listed in
  ``model.safetensors.index.json``, under the prefixes of :data:`TEXT_EMBEDDING`,
  :data:`BODY_PREFIX`, :data:`AUDIO_EMBEDDING`, :data:`AUDIO_HEAD_PREFIX` and
  :data:`CODEC_PREFIX` (the Higgs Audio v2 tokenizer's state dict, in the naming of
  transformers' ``HiggsAudioV2TokenizerModel``);
* ``tokenizer.json`` (Qwen3 BPE plus the Higgs special tokens) and its companions.

The published checkpoint carries the codec weights but not the codec's config.
higgs-pack's own checkpoints (:mod:`higgs_pack.exporters.tiny`) add the key
``audio_tokenizer_config`` to ``config.json``: the ``to_dict()`` of the
``HiggsAudioV2TokenizerConfig`` their codec was built from.  When the key is absent,
the reader uses :data:`PUBLISHED_CODEC_CONFIG` (bosonai/higgs-audio-v2-tokenizer,
MODEL.md).

Only safetensors are read (never pickles), one tensor at a time through
``safetensors.safe_open``.  Every problem is a
:class:`~higgs_pack.manifests.errors.CheckpointError` that names the file, says what is
wrong and what to do.

This module also holds the small streaming safetensors writer (:func:`write_safetensors`,
:func:`write_sharded_safetensors`) shared by the tiny-checkpoint generator and
:meth:`HiggsCheckpoint.write_qwen3_hf_dir`: it writes one tensor at a time, so neither
ever holds a whole model in memory.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import os
import re
import shutil
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from higgs_pack.manifests.constants import SPECIAL_TOKENS
from higgs_pack.manifests.errors import CheckpointError
from higgs_pack.runtime.pipeline import ModelConstants

if TYPE_CHECKING:  # heavy imports stay lazy: planning must not import torch
    import torch
    from tokenizers import Tokenizer
    from transformers import HiggsAudioV2TokenizerModel, Qwen3Config, Qwen3Model

#: ``config.json`` ``model_type`` of a Higgs-Audio-v3 checkpoint (MODEL.md).
MODEL_TYPE = "higgs_multimodal_qwen3"
#: Token embedding [vocab, hidden], tied to the text head (MODEL.md).
TEXT_EMBEDDING = "tied.embedding.text_embedding.weight"
#: Text LM head, present only when not tied.
TEXT_HEAD = "tied.head.text_head.weight"
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

_FIX_MODEL = "Pass a Higgs-Audio-v3 checkpoint directory or Hub repo id with --model / model=."
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_CHUNK = 1 << 20


# --------------------------------------------------------------------------- writing


_ST_DTYPES: dict[str, tuple[str, int]] = {
    "torch.bfloat16": ("BF16", 2),
    "torch.float16": ("F16", 2),
    "torch.float32": ("F32", 4),
    "torch.float64": ("F64", 8),
    "torch.int64": ("I64", 8),
    "torch.int32": ("I32", 4),
    "torch.int16": ("I16", 2),
    "torch.int8": ("I8", 1),
    "torch.uint8": ("U8", 1),
    "torch.bool": ("BOOL", 1),
}


@dataclass(frozen=True)
class LazyTensor:
    """A tensor to be written: its name, shape and dtype, and how to make it.

    ``make`` is called exactly once, when the tensor's bytes are written, so a writer
    holds one tensor in memory at a time.

    Attributes:
        name: Tensor name in the safetensors file.
        shape: Tensor shape.
        dtype: ``torch.dtype`` the made tensor must have.
        make: Zero-argument callable returning a ``torch.Tensor`` of ``shape``/``dtype``.
    """

    name: str
    shape: tuple[int, ...]
    dtype: Any
    make: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        """Size of the tensor's data in bytes."""
        return math.prod(self.shape) * _st_dtype(self.dtype)[1]


def _st_dtype(dtype: Any) -> tuple[str, int]:
    try:
        return _ST_DTYPES[str(dtype)]
    except KeyError:
        raise ValueError(f"dtype {dtype} cannot be written to safetensors by higgs-pack") from None


def write_safetensors(
    path: Path, specs: Sequence[LazyTensor], metadata: dict[str, str] | None = None
) -> int:
    """Write one safetensors file, streaming: one tensor in memory at a time.

    The header (names, dtypes, shapes, offsets) is computed from ``specs`` before any
    tensor is made; then each tensor is made, written and freed.  The file is written
    to ``path + ".partial"`` and renamed at the end.  Output is byte-identical for
    identical specs and tensor values (sorted header keys, no timestamps).

    Args:
        path: Destination file.
        specs: The tensors, in the order their data is laid out.
        metadata: Optional ``__metadata__`` string map (default ``{"format": "pt"}``).

    Returns:
        The number of data bytes written (excluding the header).

    Raises:
        ValueError: duplicate names, or a made tensor whose shape or dtype differs
            from its spec.
    """
    import torch

    entries: dict[str, dict[str, Any]] = {}
    offset = 0
    for spec in specs:
        if spec.name in entries:
            raise ValueError(f"tensor {spec.name!r} appears twice")
        code, _ = _st_dtype(spec.dtype)
        entries[spec.name] = {
            "dtype": code,
            "shape": list(spec.shape),
            "data_offsets": [offset, offset + spec.nbytes],
        }
        offset += spec.nbytes
    header: dict[str, Any] = {"__metadata__": dict(metadata or {"format": "pt"})}
    header.update(sorted(entries.items()))
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for spec in specs:
            tensor = spec.make()
            if tuple(tensor.shape) != tuple(spec.shape) or tensor.dtype != spec.dtype:
                raise ValueError(
                    f"tensor {spec.name!r}: made {tuple(tensor.shape)} {tensor.dtype}, "
                    f"spec says {tuple(spec.shape)} {spec.dtype}"
                )
            data = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8)
            f.write(memoryview(data.numpy()))
            del tensor, data
    os.replace(partial, path)
    return offset


def plan_shards(specs: Sequence[LazyTensor], max_shard_bytes: int) -> list[list[LazyTensor]]:
    """Split ``specs`` in order into shards of at most ``max_shard_bytes`` data bytes.

    A tensor larger than the limit gets a shard of its own.
    """
    shards: list[list[LazyTensor]] = [[]]
    size = 0
    for spec in specs:
        if shards[-1] and size + spec.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(spec)
        size += spec.nbytes
    return shards


def write_sharded_safetensors(
    out_dir: Path, specs: Sequence[LazyTensor], max_shard_bytes: int
) -> list[Path]:
    """Write ``specs`` as ``model.safetensors`` or as shards with an index.

    One shard is written as ``model.safetensors``; several as
    ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``
    (``{"metadata": {"total_size": N}, "weight_map": {name: file}}``, as transformers
    writes it).  Weight files already in ``out_dir`` are removed first.  Streaming:
    one tensor in memory at a time.

    Args:
        out_dir: Existing directory to write into.
        specs: Tensors in layout order.
        max_shard_bytes: Most data bytes per shard.

    Returns:
        The written weight files (plus the index when sharded), in order.
    """
    out_dir = Path(out_dir)
    for old in [*out_dir.glob("model*.safetensors"), out_dir / INDEX_NAME]:
        if old.is_file():
            old.unlink()
    shards = plan_shards(specs, max_shard_bytes)
    if len(shards) == 1:
        path = out_dir / SINGLE_NAME
        write_safetensors(path, shards[0])
        return [path]
    written: list[Path] = []
    weight_map: dict[str, str] = {}
    total = 0
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        total += write_safetensors(out_dir / name, shard)
        weight_map.update({spec.name: name for spec in shard})
        written.append(out_dir / name)
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (out_dir / INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return [*written, out_dir / INDEX_NAME]


# --------------------------------------------------------------------------- reading


def open_checkpoint(
    path_or_repo: str | Path,
    *,
    revision: str | None = None,
    cache_dir: str | Path | None = None,
    local_files_only: bool = False,
) -> HiggsCheckpoint:
    """Open a Higgs-Audio-v3 checkpoint from a local directory or the Hugging Face Hub.

    A path that exists is used as is.  A string of the form ``owner/name`` that is not
    a local path is downloaded with ``huggingface_hub.snapshot_download`` (only
    ``*.json``, ``*.safetensors`` and tokenizer files; never pickles).

    Args:
        path_or_repo: Checkpoint directory, or Hub repo id such as
            ``bosonai/higgs-audio-v3-tts-4b``.
        revision: Hub revision (branch, tag or commit) when downloading.
        cache_dir: Hub cache directory (default: the huggingface_hub cache).
        local_files_only: Use only the Hub cache, never the network.

    Returns:
        The opened :class:`HiggsCheckpoint`; its layout has been checked.

    Raises:
        CheckpointError: the directory does not exist, the repo cannot be downloaded
            (offline, unknown, gated), or the checkpoint is incomplete or malformed.
    """
    text = str(path_or_repo)
    path = Path(text).expanduser()
    if path.exists():
        if not path.is_dir():
            raise CheckpointError(
                f"{path} is a file; a Higgs-Audio-v3 checkpoint is a directory holding "
                f"config.json, model*.safetensors and tokenizer.json. {_FIX_MODEL}"
            )
        return HiggsCheckpoint(path, source=text)
    if isinstance(path_or_repo, Path) or not _REPO_ID.match(text):
        raise CheckpointError(
            f"checkpoint directory {path} does not exist (and {text!r} is not a Hub repo id "
            f"of the form owner/name). {_FIX_MODEL}"
        )
    try:
        from huggingface_hub import snapshot_download

        local = snapshot_download(
            text,
            revision=revision,
            cache_dir=cache_dir,
            local_files_only=local_files_only,
            allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"],
        )
    except Exception as exc:  # offline, DNS, 401/404, gated: all mean "pass a path"
        raise CheckpointError(
            f"{text!r} is not a local directory, and downloading it from the Hugging Face "
            f"Hub failed ({type(exc).__name__}: {_first_line(exc)}). If you are offline or "
            f"the repo is gated, download it elsewhere and pass the local path with "
            f"--model / model=."
        ) from exc
    return HiggsCheckpoint(Path(local), source=text)


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else ""


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


class HiggsCheckpoint:
    """An opened Higgs-Audio-v3 checkpoint (use :func:`open_checkpoint`).

    Opening reads ``config.json``, the safetensors headers (not the data) and
    ``tokenizer.json``, and checks the layout: every Qwen3 tensor and the fused audio
    table present with the shape the config implies, codec tensors present, special
    tokens present.  Tensor data is read lazily, one tensor at a time.

    Attributes:
        root: The checkpoint directory.
        source: What the caller passed (path or repo id).
        config: ``config.json`` as a dict.
    """

    def __init__(self, root: Path, *, source: str | None = None) -> None:
        self.root = Path(root)
        self.source = source if source is not None else str(root)
        self.config = self._read_config()
        self._text_config = self._check_text_config()
        self._audio_config = self._check_audio_config()
        self._handles: dict[str, Any] = {}
        self._files, self._name_to_file, self._index_path = self._read_weights()
        self._check_layout()
        self.tokenizer: Tokenizer = self._read_tokenizer()
        self.constants = self._make_constants()

    def __repr__(self) -> str:
        return f"HiggsCheckpoint({str(self.root)!r})"

    def __enter__(self) -> HiggsCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Release the open safetensors files."""
        self._handles.clear()

    # ------------------------------------------------------------------ config

    def _read_config(self) -> dict[str, Any]:
        path = self.root / "config.json"
        if not path.is_file():
            raise CheckpointError(
                f"{self.root}: no config.json. A Higgs-Audio-v3 checkpoint directory holds "
                f"config.json, model*.safetensors and tokenizer.json. {_FIX_MODEL}"
            )
        config = _read_json(path, "config.json")
        model_type = config.get("model_type")
        if model_type != MODEL_TYPE:
            hint = (
                " This looks like a plain Qwen3 checkpoint, not Higgs-Audio-v3."
                if model_type == "qwen3"
                else ""
            )
            raise CheckpointError(
                f"{path}: model_type is {model_type!r}, expected {MODEL_TYPE!r} "
                f"(Higgs-Audio-v3, e.g. bosonai/higgs-audio-v3-tts-4b).{hint} {_FIX_MODEL}"
            )
        return config

    def _check_text_config(self) -> dict[str, Any]:
        path = self.root / "config.json"
        text = self.config.get("text_config")
        if not isinstance(text, dict):
            raise CheckpointError(
                f"{path}: no text_config object (the Qwen3 backbone config). The file is "
                f"incomplete; re-download the checkpoint."
            )
        for key in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "intermediate_size",
            "vocab_size",
        ):
            if not isinstance(text.get(key), int):
                raise CheckpointError(
                    f"{path}: text_config.{key} is missing or not an integer "
                    f"(found {text.get(key)!r}). Re-download the checkpoint."
                )
        return fixed_text_config(text)

    def _check_audio_config(self) -> dict[str, Any]:
        path = self.root / "config.json"
        audio = self.config.get("audio_encoder_config")
        if not isinstance(audio, dict):
            raise CheckpointError(
                f"{path}: no audio_encoder_config object (expected {{encoder_type: "
                f"'discrete', num_codebooks: 8, vocab_size: 1026, ...}}). Re-download the "
                f"checkpoint."
            )
        for key in ("num_codebooks", "vocab_size"):
            if not isinstance(audio.get(key), int):
                raise CheckpointError(
                    f"{path}: audio_encoder_config.{key} is missing or not an integer "
                    f"(found {audio.get(key)!r})."
                )
        if audio.get("encoder_type", "discrete") != "discrete":
            raise CheckpointError(
                f"{path}: audio_encoder_config.encoder_type is {audio['encoder_type']!r}; "
                f"higgs-pack supports 'discrete' (Higgs-Audio-v3)."
            )
        return dict(audio)

    @property
    def text_config(self) -> dict[str, Any]:
        """The Qwen3 ``text_config`` with ``rope_theta`` null read as 1,000,000 (a copy)."""
        return json.loads(json.dumps(self._text_config))

    @property
    def audio_config(self) -> dict[str, Any]:
        """``audio_encoder_config`` (num_codebooks, vocab_size = 1026, ...), a copy."""
        return dict(self._audio_config)

    @property
    def codec_config_dict(self) -> dict[str, Any]:
        """The codec config dict (``audio_tokenizer_config`` or the published one)."""
        return codec_config_dict(self.config)

    @property
    def model_id(self) -> str:
        """A name for manifests: ``higgs-audio-v3-<preset>`` for generated checkpoints,
        else the repo id or directory name given to :func:`open_checkpoint`."""
        synthetic = self.config.get("higgs_pack_synthetic")
        if isinstance(synthetic, dict) and synthetic.get("preset"):
            return f"higgs-audio-v3-{synthetic['preset']}"
        return self.source.rstrip("/\\") or str(self.root)

    # ------------------------------------------------------------------ weights

    def _read_weights(self) -> tuple[list[Path], dict[str, Path], Path | None]:
        index_path = self.root / INDEX_NAME
        single = self.root / SINGLE_NAME
        if index_path.is_file():
            index = _read_json(index_path, INDEX_NAME)
            weight_map = index.get("weight_map")
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(
                    f"{index_path}: no weight_map object; the index is damaged. "
                    f"Re-download the checkpoint."
                )
            files = sorted({self.root / str(f) for f in weight_map.values()})
            for f in files:
                if not f.is_file():
                    raise CheckpointError(
                        f"{index_path} lists shard {f.name}, which is missing from "
                        f"{self.root}. The download is incomplete; re-download the checkpoint."
                    )
            name_to_file: dict[str, Path] = {}
            for f in files:
                names = set(self._handle(f).keys())
                for name, fname in weight_map.items():
                    if self.root / str(fname) == f and name not in names:
                        raise CheckpointError(
                            f"{index_path} maps tensor {name!r} to {f.name}, which does not "
                            f"contain it. The index and shards disagree; re-download."
                        )
                name_to_file.update({n: f for n in names})
            return files, name_to_file, index_path
        if single.is_file():
            names = self._handle(single).keys()  # safe_open handles are not iterable
            return [single], {n: single for n in names}, None
        pickles = sorted(p.name for p in self.root.glob("*.bin")) + sorted(
            p.name for p in self.root.glob("*.pt")
        )
        extra = (
            f" Found {', '.join(pickles)}: pickled weights are never loaded; convert them "
            f"to safetensors."
            if pickles
            else ""
        )
        raise CheckpointError(
            f"{self.root}: no {SINGLE_NAME} and no {INDEX_NAME}; the weights are missing."
            f"{extra} {_FIX_MODEL}"
        )

    def _handle(self, path: Path) -> Any:
        key = str(path)
        if key not in self._handles:
            from safetensors import safe_open

            try:
                self._handles[key] = safe_open(str(path), framework="pt")
            except Exception as exc:
                raise CheckpointError(
                    f"{path}: cannot read safetensors file ({_first_line(exc)}). The file is "
                    f"damaged or incomplete; re-download the checkpoint."
                ) from exc
        return self._handles[key]

    def _shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self._name_to_file[name]).get_slice(name).get_shape())

    def _check_layout(self) -> None:
        where = self._index_path or self._files[0]
        expected = llm_tensor_shapes(self._text_config)
        n = int(self._audio_config["num_codebooks"])
        v = int(self._audio_config["vocab_size"])
        expected[AUDIO_EMBEDDING] = (n * v, int(self._text_config["hidden_size"]))
        for name, shape in expected.items():
            if name not in self._name_to_file:
                raise CheckpointError(
                    f"{where}: tensor {name!r} is missing (expected under prefix "
                    f"{_prefix_of(name)!r}, shape {list(shape)}). This is not a complete "
                    f"Higgs-Audio-v3 checkpoint; re-download it."
                )
            found = self._shape(name)
            if found != shape:
                raise CheckpointError(
                    f"{self._name_to_file[name]}: tensor {name!r} has shape {list(found)}, "
                    f"expected {list(shape)} from config.json. The weights do not belong to "
                    f"this config; re-download the checkpoint."
                )
        if not any(n.startswith(CODEC_PREFIX) for n in self._name_to_file):
            raise CheckpointError(
                f"{where}: no codec tensors under prefix {CODEC_PREFIX!r} (e.g. "
                f"{CODEC_PREFIX}acoustic_decoder.conv1.weight). The audio codec is missing; "
                f"re-download the checkpoint."
            )

    def tensor_names(self) -> list[str]:
        """All tensor names, sorted."""
        return sorted(self._name_to_file)

    def tensor_file(self, name: str) -> Path:
        """The safetensors file holding ``name``."""
        self._require(name)
        return self._name_to_file[name]

    def tensor_shape(self, name: str) -> tuple[int, ...]:
        """Shape of ``name`` from the file header (no data read)."""
        self._require(name)
        return self._shape(name)

    def _require(self, name: str) -> None:
        if name not in self._name_to_file:
            close = difflib.get_close_matches(name, self._name_to_file, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise CheckpointError(f"{self.root}: no tensor {name!r}{hint}.")

    def tensor(self, name: str) -> torch.Tensor:
        """Read one tensor, in its stored dtype (bf16 in the real checkpoint).

        Raises:
            CheckpointError: no such tensor, or its data cannot be read.
        """
        self._require(name)
        path = self._name_to_file[name]
        try:
            # A handle of its own, closed at once: safetensors memory-maps the file, and the
            # pages a read touches stay in this process's resident set while the map lives
            # (measured: loading the 4B body through cached handles doubled its RSS).
            from safetensors import safe_open

            with safe_open(str(path), framework="pt") as handle:
                return handle.get_tensor(name)
        except Exception as exc:
            raise CheckpointError(
                f"{path}: cannot read tensor {name!r} ({_first_line(exc)}). The file is "
                f"damaged; re-download the checkpoint."
            ) from exc

    def weight_files(self) -> list[Path]:
        """The safetensors files, sorted."""
        return list(self._files)

    @property
    def index_path(self) -> Path | None:
        """``model.safetensors.index.json`` when sharded, else ``None``."""
        return self._index_path

    # ------------------------------------------------------------------ tokenizer

    def _read_tokenizer(self) -> Tokenizer:
        from tokenizers import Tokenizer

        path = self.root / "tokenizer.json"
        if not path.is_file():
            raise CheckpointError(
                f"{self.root}: no tokenizer.json (the Qwen3 tokenizer with the Higgs special "
                f"tokens). The checkpoint is incomplete; re-download it. {_FIX_MODEL}"
            )
        try:
            return Tokenizer.from_file(str(path))
        except Exception as exc:
            raise CheckpointError(
                f"{path}: cannot load the tokenizer ({_first_line(exc)}). The file is "
                f"damaged; re-download the checkpoint."
            ) from exc

    def special_token_ids(self) -> dict[str, int]:
        """Role -> id of every Higgs special token, resolved by name (MODEL.md).

        Raises:
            CheckpointError: a special token is not an added token of the tokenizer, or
                its id is outside the embedding.
        """
        added = {
            tok.content: int(i) for i, tok in self.tokenizer.get_added_tokens_decoder().items()
        }
        vocab = int(self._text_config["vocab_size"])
        ids: dict[str, int] = {}
        for role, text in SPECIAL_TOKENS.items():
            if text not in added:
                raise CheckpointError(
                    f"{self.root / 'tokenizer.json'}: special token {text!r} ({role}) is not "
                    f"in the tokenizer's added tokens. This tokenizer is not the Higgs-Audio-v3 "
                    f"one; use the checkpoint's own tokenizer.json."
                )
            if not 0 <= added[text] < vocab:
                raise CheckpointError(
                    f"{self.root / 'tokenizer.json'}: special token {text!r} has id "
                    f"{added[text]}, outside the {vocab}-row text embedding."
                )
            ids[role] = added[text]
        return ids

    def tokenizer_files(self) -> list[Path]:
        """Tokenizer files to copy into a bundle (those of :data:`TOKENIZER_FILE_NAMES` present)."""
        return [self.root / n for n in TOKENIZER_FILE_NAMES if (self.root / n).is_file()]

    # ------------------------------------------------------------------ constants

    def _make_constants(self) -> ModelConstants:
        path = self.root / "config.json"
        try:
            codec = codec_facts(self.codec_config_dict)
        except (KeyError, TypeError, ValueError, ZeroDivisionError) as exc:
            raise CheckpointError(
                f"{path}: {CODEC_CONFIG_KEY} is malformed ({exc!r}); remove the key to use "
                f"the published codec config, or fix it."
            ) from exc
        n = int(self._audio_config["num_codebooks"])
        v = int(self._audio_config["vocab_size"])
        if v != codec["codebook_size"] + 2:
            raise CheckpointError(
                f"{path}: audio_encoder_config.vocab_size is {v}, expected codebook_size + 2 "
                f"= {codec['codebook_size'] + 2} (codes, BOC, EOC)."
            )
        if n != codec["num_quantizers"]:
            raise CheckpointError(
                f"{path}: audio_encoder_config.num_codebooks is {n} but the codec has "
                f"{codec['num_quantizers']} quantizers."
            )
        if codec["sample_rate"] % codec["hop_length"]:
            raise CheckpointError(
                f"{path}: codec sample rate {codec['sample_rate']} Hz is not a whole number "
                f"of {codec['hop_length']}-sample frames."
            )
        t = self._text_config
        return ModelConstants(
            hidden_size=int(t["hidden_size"]),
            num_layers=int(t["num_hidden_layers"]),
            num_attention_heads=int(t["num_attention_heads"]),
            num_key_value_heads=int(t.get("num_key_value_heads") or t["num_attention_heads"]),
            head_dim=int(t["head_dim"]),
            max_position_embeddings=int(t.get("max_position_embeddings") or 4096),
            special_tokens=self.special_token_ids(),
            num_codebooks=n,
            codebook_size=codec["codebook_size"],
            audio_vocab_size=v,
            boc=codec["codebook_size"],
            eoc=codec["codebook_size"] + 1,
            sample_rate=codec["sample_rate"],
            frame_rate=codec["sample_rate"] // codec["hop_length"],
            hop_length=codec["hop_length"],
            text_vocab_size=int(t["vocab_size"]),
        )

    # ------------------------------------------------------------------ digest

    @cached_property
    def _digest(self) -> str:
        h = hashlib.sha256()
        files = [self.root / "config.json"]
        if self._index_path is not None:
            files.append(self._index_path)
        files += self._files + self.tokenizer_files()
        for path in files:
            h.update(path.name.encode("utf-8") + b"\0")
            with open(path, "rb") as f:
                while chunk := f.read(_CHUNK):
                    h.update(chunk)
            h.update(b"\0")
        return h.hexdigest()

    def digest(self) -> str:
        """sha256 (hex) over config.json, the shard index, the weight files and the
        tokenizer files (each as its name then its bytes), streamed in 1 MiB chunks."""
        return self._digest

    # ------------------------------------------------------------------ tensors as fp32

    def text_embedding(self) -> torch.Tensor:
        """Token embedding, float32 [text_vocab, hidden]."""
        return self.tensor(TEXT_EMBEDDING).float()

    def audio_table(self) -> torch.Tensor:
        """Fused audio embedding, float32 [num_codebooks * 1026, hidden] (row
        ``c * 1026 + code`` embeds ``code`` of codebook ``c``; MODEL.md)."""
        return self.tensor(AUDIO_EMBEDDING).float()

    def audio_head_weight(self) -> torch.Tensor:
        """Audio head W, float32 [num_codebooks * 1026, hidden]: logits = hidden @ Wᵀ.

        The fused audio table (tied, MODEL.md) unless the checkpoint has an untied head
        under ``tied.head.modality_heads.0.`` (one ``weight`` tensor of shape
        [N*1026, hidden] or [N, 1026, hidden]).

        Raises:
            CheckpointError: an untied head of another layout.
        """
        names = [n for n in self._name_to_file if n.startswith(AUDIO_HEAD_PREFIX)]
        if not names:
            return self.audio_table()
        n = int(self._audio_config["num_codebooks"])
        v = int(self._audio_config["vocab_size"])
        h = int(self._text_config["hidden_size"])
        name = AUDIO_HEAD_PREFIX + "weight"
        if names != [name] or self._shape(name) not in ((n * v, h), (n, v, h)):
            found = {k: list(self._shape(k)) for k in sorted(names)}
            raise CheckpointError(
                f"{self._name_to_file[names[0]]}: untied audio head {found} is not supported; "
                f"expected one tensor {name!r} of shape [{n * v}, {h}] or [{n}, {v}, {h}]."
            )
        return self.tensor(name).float().reshape(n * v, h)

    # ------------------------------------------------------------------ torch models

    def qwen3_config(self) -> Qwen3Config:
        """transformers ``Qwen3Config`` of the backbone (rope_theta fixed)."""
        from transformers import Qwen3Config

        cfg = self.hf_qwen3_config_dict()
        cfg.pop("architectures", None)
        try:
            return Qwen3Config(**{k: v for k, v in cfg.items() if k != "model_type"})
        except Exception as exc:
            raise CheckpointError(
                f"{self.root / 'config.json'}: text_config is not a valid Qwen3 config "
                f"({_first_line(exc)})."
            ) from exc

    def hf_qwen3_config_dict(self) -> dict[str, Any]:
        """config.json of the standard Qwen3 HF directory (:meth:`write_qwen3_hf_dir`)."""
        cfg = self.text_config
        cfg.update(
            {
                "architectures": ["Qwen3ForCausalLM"],
                "model_type": "qwen3",
                "tie_word_embeddings": True,
                "torch_dtype": str(self.tensor_dtype(TEXT_EMBEDDING)).removeprefix("torch."),
            }
        )
        cfg.pop("dtype", None)
        return dict(sorted(cfg.items()))

    def tensor_dtype(self, name: str) -> torch.dtype:
        """Stored dtype of ``name`` (reads the header only)."""
        import torch

        self._require(name)
        code = self._handle(self._name_to_file[name]).get_slice(name).get_dtype()
        by_code = {v[0]: k for k, v in _ST_DTYPES.items()}
        return getattr(torch, by_code[code].removeprefix("torch."))

    def qwen3_model(self, *, stored_dtype: bool = False) -> Qwen3Model:
        """The Qwen3 body as an eval-mode transformers ``Qwen3Model`` (the oracle's decoder).

        Built on the meta device and filled from the checkpoint one tensor at a time (no
        random init, one copy of the weights).  The token embedding is left out
        (``embed_tokens`` is ``None``): the oracle feeds ``inputs_embeds``, and the text
        embedding lives in the ``text_embed`` module.

        Args:
            stored_dtype: keep the weights in the checkpoint's dtype (bf16 for the real
                model: 7.3 GiB instead of 14.6 GiB for the 4B body); the caller then runs
                each layer in float32 with :func:`higgs_pack.exporters.reference.upcast_per_layer`.
                Default: a float32 model.

        Raises:
            CheckpointError: the tensors do not load into the model.
        """
        import torch
        from transformers import Qwen3Model
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        config = self.qwen3_config()
        with torch.device("meta"):
            model = Qwen3Model(config)
        model.embed_tokens = None
        state = {}
        for n in llm_tensor_shapes(self._text_config):
            if n == TEXT_EMBEDDING:
                continue
            t = self.tensor(n)
            state[hf_qwen3_name(n).removeprefix("model.")] = t if stored_dtype else t.float()
        self.close()  # unmap the files read: their pages are not kept resident for this process
        _load_strict(model, state, where=self._index_path or self._files[0], prefix=BODY_PREFIX)
        del state
        model.rotary_emb = Qwen3RotaryEmbedding(config=config)
        _check_no_meta(model, "Qwen3Model")
        if not stored_dtype:
            model = model.float()
        return model.eval().requires_grad_(False)

    def codec_config(self) -> Any:
        """transformers ``HiggsAudioV2TokenizerConfig`` of the codec."""
        from transformers import HiggsAudioV2TokenizerConfig

        data = self.codec_config_dict
        try:
            return HiggsAudioV2TokenizerConfig.from_dict(data)
        except Exception as exc:
            raise CheckpointError(
                f"{self.root / 'config.json'}: {CODEC_CONFIG_KEY} is not a valid "
                f"HiggsAudioV2TokenizerConfig ({_first_line(exc)})."
            ) from exc

    def codec_state_dict(self) -> dict[str, torch.Tensor]:
        """The codec tensors, prefix stripped, float32 (integer tensors unchanged)."""
        out = {}
        for name in self.tensor_names():
            if name.startswith(CODEC_PREFIX):
                t = self.tensor(name)
                out[name[len(CODEC_PREFIX) :]] = t.float() if t.is_floating_point() else t
        return out

    def codec(self) -> HiggsAudioV2TokenizerModel:
        """The codec as a float32, eval-mode transformers ``HiggsAudioV2TokenizerModel``.

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

        config = self.codec_config()
        state = self.codec_state_dict()
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
        _load_strict(
            model,
            state,
            where=self._index_path or self._files[0],
            prefix=CODEC_PREFIX,
            optional=CODEC_OPTIONAL_KEYS,
        )
        _check_no_meta(model, "HiggsAudioV2TokenizerModel")
        for module in model.modules():
            if parametrize.is_parametrized(module, "weight"):
                parametrize.remove_parametrizations(module, "weight", leave_parametrized=True)
        return model.float().eval().requires_grad_(False)

    # ------------------------------------------------------------------ HF directory

    def write_qwen3_hf_dir(
        self, out_dir: str | Path, *, max_shard_bytes: int = 4_500_000_000
    ) -> Path:
        """Write the backbone as a standard Qwen3 HF directory (for ModelBuilder / optimum-intel).

        ``config.json`` is the text config with ``model_type: qwen3``,
        ``architectures: [Qwen3ForCausalLM]``, ``rope_theta`` fixed (MODEL.md) and
        ``tie_word_embeddings: true``; weights are remapped
        (``tied.embedding.text_embedding.`` -> ``model.embed_tokens.``, ``body.`` ->
        ``model.``), kept in their stored dtype, and written shard by shard, one tensor
        in memory at a time; the tokenizer files are copied.  No audio tensors.

        Args:
            out_dir: Directory to create or overwrite.
            max_shard_bytes: Most data bytes per shard.

        Returns:
            ``out_dir`` as a Path.
        """
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        specs = [
            LazyTensor(
                hf_qwen3_name(name),
                self._shape(name),
                self.tensor_dtype(name),
                lambda name=name: self.tensor(name),
            )
            for name in llm_tensor_shapes(self._text_config)
        ]
        write_sharded_safetensors(out, specs, max_shard_bytes)
        (out / "config.json").write_text(
            json.dumps(self.hf_qwen3_config_dict(), indent=2) + "\n", encoding="utf-8"
        )
        for f in self.tokenizer_files():
            shutil.copyfile(f, out / f.name)
        return out


def _prefix_of(name: str) -> str:
    for prefix in (TEXT_EMBEDDING, AUDIO_EMBEDDING, BODY_PREFIX, CODEC_PREFIX):
        if name.startswith(prefix):
            return prefix
    return name


def _read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(
            f"{path}: cannot read {what} ({exc}). The file is damaged; re-download the checkpoint."
        ) from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: {what} is not a JSON object; re-download the checkpoint.")
    return data


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

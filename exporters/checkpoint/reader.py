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
higgs-pack's own checkpoints (:mod:`higgs_pack.exporters.checkpoint.tiny`) add the key
``audio_tokenizer_config`` to ``config.json``: the ``to_dict()`` of the
``HiggsAudioV2TokenizerConfig`` their codec was built from.  When the key is absent,
the reader uses
:data:`~higgs_pack.exporters.checkpoint.layout.PUBLISHED_CODEC_CONFIG` (bosonai/higgs-audio-v2-tokenizer,
MODEL.md).

Only safetensors are read (never pickles), one tensor at a time through
``safetensors.safe_open``.  Every problem is a
:class:`~higgs_pack.errors.CheckpointError` that names the file, says what is
wrong and what to do.

The layout facts live in :mod:`higgs_pack.exporters.checkpoint.layout`, the transformers
models a checkpoint becomes in :mod:`higgs_pack.exporters.checkpoint.models`, the
safetensors writer in :mod:`higgs_pack.exporters.checkpoint.safetensors_writer`.  What is left here
(about 600 lines) is one concern, reading and checking: :class:`HiggsCheckpoint` checks
config, shards, layout, tokenizer and derived constants as it opens, and splitting its
checks from the reads they guard would scatter one class's invariants over modules.
"""

from __future__ import annotations

import hashlib
import json
import re
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

from higgs_pack.errors import (
    CheckpointError,
    did_you_mean,
    disk_full,
    disk_full_message,
    first_line,
)
from higgs_pack.exporters.checkpoint.layout import (
    AUDIO_EMBEDDING,
    AUDIO_HEAD_PREFIX,
    BODY_PREFIX,
    CODEC_CONFIG_KEY,
    CODEC_PREFIX,
    INDEX_NAME,
    MODEL_TYPE,
    SINGLE_NAME,
    TEXT_EMBEDDING,
    TOKENIZER_FILE_NAMES,
    codec_config_dict,
    codec_facts,
    fixed_text_config,
    llm_tensor_shapes,
)
from higgs_pack.exporters.checkpoint.safetensors_writer import ST_DTYPES
from higgs_pack.manifests.model import SPECIAL_TOKENS
from higgs_pack.runtime.loop.pipeline import ModelConstants

if TYPE_CHECKING:  # heavy imports stay lazy: planning must not import torch
    import torch
    from tokenizers import Tokenizer

_FIX_MODEL = "Pass a Higgs-Audio-v3 checkpoint directory or Hub repo id with --model / model=."
_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_CHUNK = 1 << 20


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
    if isinstance(path_or_repo, Path) or not _REPO_ID.fullmatch(text):
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
    except Exception as exc:  # offline, DNS, 401/404, gated: all mean "pass a path"; a full disk does not
        if disk_full(exc) is not None:
            from huggingface_hub import constants

            raise CheckpointError(disk_full_message(
                cache_dir or constants.HF_HUB_CACHE, f"downloading the checkpoint {text!r}",
                "free space there, or point HF_HUB_CACHE (cache_dir=) at a disk with room "
                "(the 4B checkpoint is about 8 GB); the partial download is resumed next time")) from exc
        raise CheckpointError(
            f"{text!r} is not a local directory, and downloading it from the Hugging Face "
            f"Hub failed ({type(exc).__name__}: {first_line(exc)}). If you are offline or "
            f"the repo is gated, download it elsewhere and pass the local path with "
            f"--model / model=."
        ) from exc
    return HiggsCheckpoint(Path(local), source=text)


def read_config(root: Path) -> dict[str, Any]:
    """``root/config.json`` of a Higgs-Audio-v3 checkpoint.

    Raises:
        CheckpointError: no config.json, or another model type.
    """
    path = root / "config.json"
    if not path.is_file():
        raise CheckpointError(
            f"{root}: no config.json. A Higgs-Audio-v3 checkpoint directory holds "
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

def checked_text_config(path: Path, config: dict[str, Any]) -> dict[str, Any]:
    """The ``text_config`` (the Qwen3 backbone's) of ``config`` read from ``path``, its sizes checked.

    Raises:
        CheckpointError: missing, or a size that is not an integer.
    """
    text = config.get("text_config")
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

def checked_audio_config(path: Path, config: dict[str, Any]) -> dict[str, Any]:
    """The ``audio_encoder_config`` of ``config`` read from ``path``, checked to be discrete codebooks.

    Raises:
        CheckpointError: missing, a size that is not an integer, or another encoder type.
    """
    audio = config.get("audio_encoder_config")
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
        self.config = read_config(self.root)
        self._text_config = checked_text_config(self.root / "config.json", self.config)
        self._audio_config = checked_audio_config(self.root / "config.json", self.config)
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
                    f"{path}: cannot read safetensors file ({first_line(exc)}). The file is "
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
            raise CheckpointError(f"{self.root}: no tensor {name!r}{did_you_mean(name, self._name_to_file)}.")

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
                f"{path}: cannot read tensor {name!r} ({first_line(exc)}). The file is "
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
                f"{path}: cannot load the tokenizer ({first_line(exc)}). The file is "
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

    def tensor_dtype(self, name: str) -> torch.dtype:
        """Stored dtype of ``name`` (reads the header only)."""
        import torch

        self._require(name)
        code = self._handle(self._name_to_file[name]).get_slice(name).get_dtype()
        by_code = {v[0]: k for k, v in ST_DTYPES.items()}
        return getattr(torch, by_code[code].removeprefix("torch."))


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

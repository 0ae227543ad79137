"""Reading a Higgs-Audio-v3 checkpoint: layout, constants, digest, HF remap, codec, errors."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from higgs_pack.errors import CheckpointError  # noqa: E402
from higgs_pack.exporters.checkpoint.layout import (  # noqa: E402
    AUDIO_EMBEDDING,
    AUDIO_HEAD_PREFIX,
    CODEC_PREFIX,
    INDEX_NAME,
    TEXT_EMBEDDING,
)
from higgs_pack.exporters.checkpoint.models import (  # noqa: E402
    codec_model,
    qwen3_config,
    qwen3_model,
    write_qwen3_hf_dir,
)
from higgs_pack.exporters.checkpoint.reader import HiggsCheckpoint, open_checkpoint  # noqa: E402
from higgs_pack.manifests.model import SPECIAL_TOKENS  # noqa: E402
from higgs_pack.runtime.loop.pipeline import ModelConstants  # noqa: E402

SHARD2 = "model-00002-of-00002.safetensors"


# ----------------------------------------------------------------------------- helpers


def copy_of(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def rewrite_as_single_file(root: Path, drop=(), add=None, transform=None) -> None:
    """Read every tensor, then write them back as one model.safetensors (no index)."""
    tensors = {}
    for path in sorted(root.glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                tensors[name] = f.get_tensor(name)
        path.unlink()
    (root / INDEX_NAME).unlink(missing_ok=True)
    for name in drop:
        del tensors[name]
    if transform:
        tensors = transform(tensors)
    tensors.update(add or {})
    save_file(tensors, str(root / "model.safetensors"), metadata={"format": "pt"})


def edit_json(path: Path, edit: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text())
    edit(data)
    path.write_text(json.dumps(data))


# ----------------------------------------------------------------------------- happy path


def test_constants_resolved_by_name(tiny_ckpt: HiggsCheckpoint):
    c = tiny_ckpt.constants
    assert isinstance(c, ModelConstants)
    assert c.special_tokens == {
        "tts": 151667,
        "audio": 151670,
        "text": 151672,
        "ref_audio": 151679,
        "ref_text": 151680,
    }
    assert set(c.special_tokens) == set(SPECIAL_TOKENS)
    assert (c.hidden_size, c.num_layers, c.num_attention_heads, c.num_key_value_heads) == (
        64,
        2,
        4,
        2,
    )
    assert (c.head_dim, c.max_position_embeddings, c.text_vocab_size) == (16, 4096, 151936)
    assert (c.num_codebooks, c.codebook_size, c.audio_vocab_size, c.boc, c.eoc) == (
        8,
        1024,
        1026,
        1024,
        1025,
    )
    assert (c.sample_rate, c.frame_rate, c.hop_length) == (24000, 25, 960)
    assert ModelConstants.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_config_views(tiny_ckpt: HiggsCheckpoint):
    assert tiny_ckpt.config["text_config"]["rope_theta"] is None
    assert tiny_ckpt.text_config["rope_theta"] == 1_000_000.0  # MODEL.md
    assert qwen3_config(tiny_ckpt).rope_parameters["rope_theta"] == 1_000_000.0
    assert tiny_ckpt.model_id == "higgs-audio-v3-tiny"
    assert tiny_ckpt.index_path is not None and tiny_ckpt.index_path.name == INDEX_NAME
    assert len(tiny_ckpt.weight_files()) == 2
    assert [p.name for p in tiny_ckpt.tokenizer_files()] == [
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
    ]


def test_lazy_tensors(tiny_ckpt: HiggsCheckpoint):
    names = tiny_ckpt.tensor_names()
    assert names == sorted(names) and TEXT_EMBEDDING in names
    t = tiny_ckpt.tensor(TEXT_EMBEDDING)
    assert t.dtype == torch.bfloat16 and tuple(t.shape) == (151936, 64)
    assert 0.015 < float(t.float().std()) < 0.025
    assert tiny_ckpt.tensor_shape(AUDIO_EMBEDDING) == (8 * 1026, 64)
    assert tiny_ckpt.tensor_file(AUDIO_EMBEDDING).name == SHARD2
    assert tiny_ckpt.audio_table().dtype == torch.float32
    assert torch.equal(tiny_ckpt.audio_head_weight(), tiny_ckpt.audio_table())  # tied
    with pytest.raises(
        CheckpointError,
        match=r"no tensor 'body\.norm\.weigth' \(did you mean 'body\.norm\.weight'\?\)",
    ):
        tiny_ckpt.tensor("body.norm.weigth")


def test_digest_is_stable_and_sees_every_weight_byte(tiny_checkpoint: Path, tmp_path: Path):
    first = open_checkpoint(tiny_checkpoint).digest()
    assert re.fullmatch(r"[0-9a-f]{64}", first)
    assert open_checkpoint(tiny_checkpoint).digest() == first
    changed = copy_of(tiny_checkpoint, tmp_path / "changed")
    data = bytearray((changed / SHARD2).read_bytes())
    data[-1] ^= 0x01  # last byte of the last tensor's data
    (changed / SHARD2).write_bytes(bytes(data))
    assert open_checkpoint(changed).digest() != first


def test_qwen3_hf_dir_loads_and_matches_the_oracle(tiny_ckpt: HiggsCheckpoint, tmp_path: Path):
    from transformers import AutoModel

    out = write_qwen3_hf_dir(tiny_ckpt, tmp_path / "hf", max_shard_bytes=10_000_000)
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3" and config["rope_theta"] == 1_000_000.0
    assert config["tie_word_embeddings"] is True
    index = json.loads((out / INDEX_NAME).read_text())
    assert index["weight_map"]["model.embed_tokens.weight"] == "model-00001-of-00002.safetensors"
    assert "model.layers.1.mlp.down_proj.weight" in index["weight_map"]
    assert "model.norm.weight" in index["weight_map"]
    assert not any(k.startswith("tied.") or k.startswith("body.") for k in index["weight_map"])
    assert (out / "tokenizer.json").is_file()

    loaded = AutoModel.from_pretrained(str(out), dtype=torch.float32).eval()
    assert type(loaded).__name__ == "Qwen3Model"
    oracle = qwen3_model(tiny_ckpt)
    x = torch.randn(1, 7, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        a = loaded(inputs_embeds=x).last_hidden_state
        b = oracle(inputs_embeds=x).last_hidden_state
    torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    assert float(b.std()) > 0.5  # final RMSNorm output, not degenerate


def test_codec_decodes_t_frames_to_t_times_960_samples(tiny_ckpt: HiggsCheckpoint):
    codec = codec_model(tiny_ckpt)
    assert not codec.training and next(codec.parameters()).dtype == torch.float32
    for frames in (1, 7):
        codes = torch.randint(0, 1024, (1, 8, frames))
        with torch.no_grad():
            wave = codec.decode(codes).audio_values
        assert wave.shape == (1, 1, frames * 960)


def test_codec_accepts_weight_norm_checkpoints(tiny_checkpoint: Path, tmp_path: Path):
    """Old-style ``weight_g``/``weight_v`` acoustic convs load and fold to the same weights."""
    root = copy_of(tiny_checkpoint, tmp_path / "wn")
    convs = re.compile(
        re.escape(CODEC_PREFIX) + r"acoustic_(en|de)coder\..*(conv1|conv2|conv_t1)\.weight$"
    )

    def to_weight_norm(tensors):
        out = {}
        for name, t in tensors.items():
            if convs.match(name):
                base = name[: -len("weight")]
                v = t.float()
                out[base + "weight_v"] = v
                out[base + "weight_g"] = v.norm(dim=(1, 2), keepdim=True)
            else:
                out[name] = t
        return out

    rewrite_as_single_file(root, transform=to_weight_norm)
    codes = torch.randint(0, 1024, (1, 8, 4))
    with torch.no_grad():
        plain = codec_model(open_checkpoint(tiny_checkpoint)).decode(codes).audio_values
        folded = codec_model(open_checkpoint(root)).decode(codes).audio_values
    torch.testing.assert_close(folded, plain, atol=1e-5, rtol=1e-4)


def test_untied_audio_head_is_used(tiny_checkpoint: Path, tmp_path: Path):
    root = copy_of(tiny_checkpoint, tmp_path / "untied")
    head = torch.full((8, 1026, 64), 0.5, dtype=torch.bfloat16)
    rewrite_as_single_file(root, add={AUDIO_HEAD_PREFIX + "weight": head})
    ckpt = open_checkpoint(root)
    assert ckpt.audio_head_weight().shape == (8 * 1026, 64)
    assert float(ckpt.audio_head_weight()[5, 3]) == 0.5


def test_published_codec_config_is_the_fallback(tiny_checkpoint: Path, tmp_path: Path):
    root = copy_of(tiny_checkpoint, tmp_path / "nocodeccfg")
    edit_json(root / "config.json", lambda c: c.pop("audio_tokenizer_config"))
    ckpt = open_checkpoint(root)
    assert ckpt.codec_config_dict["acoustic_model_config"]["decoder_hidden_size"] == 1024
    assert (ckpt.constants.hop_length, ckpt.constants.num_codebooks) == (960, 8)
    # The tiny codec's weights do not fit the published dimensions: a clear error.
    message = r"tensor 'tied\.embedding\.modality_embeddings\.0\.model\.\S+' (is missing|has shape)"
    with pytest.raises(CheckpointError, match=message):
        codec_model(ckpt)


def test_hub_download_failure_says_to_pass_a_local_path(tmp_path: Path):
    with pytest.raises(CheckpointError) as info:
        open_checkpoint("nobody-here/higgs-missing", local_files_only=True, cache_dir=tmp_path)
    message = str(info.value)
    assert "'nobody-here/higgs-missing' is not a local directory" in message
    assert "Hugging Face Hub failed" in message
    assert "--model / model=" in message


# ----------------------------------------------------------------------------- one broken copy per failure mode


def _no_config(root: Path) -> None:
    (root / "config.json").unlink()


def _config_not_json(root: Path) -> None:
    (root / "config.json").write_text('{"model_type": "higgs_multimodal_qwen3",')


def _plain_qwen3(root: Path) -> None:
    edit_json(root / "config.json", lambda c: c.update(model_type="qwen3"))


def _no_weights(root: Path) -> None:
    for p in [*root.glob("*.safetensors"), root / INDEX_NAME]:
        p.unlink()
    (root / "pytorch_model.bin").write_bytes(b"not loaded")


def _missing_shard(root: Path) -> None:
    (root / SHARD2).unlink()


def _truncated_shard(root: Path) -> None:
    data = (root / SHARD2).read_bytes()
    (root / SHARD2).write_bytes(data[:100])


def _index_not_json(root: Path) -> None:
    (root / INDEX_NAME).write_text("{ nope")


def _missing_tensor(root: Path) -> None:
    rewrite_as_single_file(root, drop=["body.layers.1.mlp.down_proj.weight"])


def _wrong_shape(root: Path) -> None:
    edit_json(root / "config.json", lambda c: c["text_config"].update(intermediate_size=96))


def _no_codec(root: Path) -> None:
    def drop_codec(tensors):
        return {k: v for k, v in tensors.items() if not k.startswith(CODEC_PREFIX)}

    rewrite_as_single_file(root, transform=drop_codec)


def _no_tokenizer(root: Path) -> None:
    (root / "tokenizer.json").unlink()


def _tokenizer_without_ref_text(root: Path) -> None:
    path = root / "tokenizer.json"
    path.write_text(
        path.read_text(encoding="utf-8").replace("<|ref_text|>", "<|ref_txt|>"), encoding="utf-8"
    )


BROKEN = {
    "no-config": (_no_config, r"no config\.json.*--model / model="),
    "config-not-json": (_config_not_json, r"config\.json: cannot read config\.json .*re-download"),
    "wrong-model-type": (
        _plain_qwen3,
        r"model_type is 'qwen3', expected 'higgs_multimodal_qwen3'.*plain Qwen3 checkpoint",
    ),
    "no-weights": (
        _no_weights,
        r"no model\.safetensors and no model\.safetensors\.index\.json.*pytorch_model\.bin: pickled weights are never loaded",
    ),
    "missing-shard": (
        _missing_shard,
        r"index\.json lists shard model-00002-of-00002\.safetensors, which is missing",
    ),
    "truncated-shard": (
        _truncated_shard,
        r"model-00002-of-00002\.safetensors: cannot read safetensors file .*damaged",
    ),
    "index-not-json": (_index_not_json, r"model\.safetensors\.index\.json: cannot read"),
    "missing-tensor": (
        _missing_tensor,
        r"model\.safetensors: tensor 'body\.layers\.1\.mlp\.down_proj\.weight' is missing",
    ),
    "shape-mismatch": (
        _wrong_shape,
        r"tensor 'body\.layers\.0\.mlp\.gate_proj\.weight' has shape \[128, 64\], expected \[96, 64\]",
    ),
    "no-codec": (
        _no_codec,
        r"no codec tensors under prefix 'tied\.embedding\.modality_embeddings\.0\.model\.'",
    ),
    "no-tokenizer": (_no_tokenizer, r"no tokenizer\.json"),
    "missing-special-token": (
        _tokenizer_without_ref_text,
        r"tokenizer\.json: special token '<\|ref_text\|>' \(ref_text\) is not in the tokenizer's added tokens",
    ),
}


@pytest.fixture(params=sorted(BROKEN))
def broken(request, tiny_checkpoint: Path, tmp_path: Path):
    """A copy of the tiny checkpoint with one thing broken, and the expected message."""
    breaker, message = BROKEN[request.param]
    root = copy_of(tiny_checkpoint, tmp_path / request.param)
    breaker(root)
    return root, message


def test_broken_checkpoint_is_a_clear_checkpoint_error(broken):
    root, message = broken
    with pytest.raises(CheckpointError, match=message) as info:
        open_checkpoint(root)
    assert str(root) in str(info.value)  # the message names the file or directory


def test_missing_directory_and_file_instead_of_directory(tmp_path: Path):
    with pytest.raises(
        CheckpointError, match=r"checkpoint directory .*nothere does not exist.*--model / model="
    ):
        open_checkpoint(tmp_path / "nothere")
    with pytest.raises(CheckpointError, match="does not exist"):
        open_checkpoint(str(tmp_path / "a" / "b" / "c"))
    (tmp_path / "file").write_text("x")
    with pytest.raises(
        CheckpointError, match=r"is a file; a Higgs-Audio-v3 checkpoint is a directory"
    ):
        open_checkpoint(tmp_path / "file")


def test_codec_tensor_missing_is_named_when_the_codec_loads(tiny_checkpoint: Path, tmp_path: Path):
    root = copy_of(tiny_checkpoint, tmp_path / "nofc2")
    rewrite_as_single_file(root, drop=[CODEC_PREFIX + "fc2.weight"])
    ckpt = open_checkpoint(root)  # the layout check only needs some codec tensors
    with pytest.raises(
        CheckpointError,
        match=r"tensor 'tied\.embedding\.modality_embeddings\.0\.model\.fc2\.weight' is missing",
    ):
        codec_model(ckpt)


def test_codec_shape_mismatch_names_tensor_and_shapes(tiny_checkpoint: Path, tmp_path: Path):
    root = copy_of(tiny_checkpoint, tmp_path / "dim8")
    edit_json(root / "config.json", lambda c: c["audio_tokenizer_config"].update(codebook_dim=8))
    with pytest.raises(
        CheckpointError,
        match=r"quantizer\.quantizers\.0\.codebook\.embed' has shape \[1024, 16\], expected \[1024, 8\]",
    ):
        codec_model(open_checkpoint(root))


def test_inconsistent_audio_config(tiny_checkpoint: Path, tmp_path: Path):
    root = copy_of(tiny_checkpoint, tmp_path / "nq")
    edit_json(
        root / "config.json", lambda c: c["audio_tokenizer_config"].update(target_bandwidths=[4])
    )
    with pytest.raises(
        CheckpointError, match=r"num_codebooks is 8 but the codec has 16 quantizers"
    ):
        open_checkpoint(root)


def test_text_embedding_matches_tokenizer(tiny_ckpt: HiggsCheckpoint):
    ids = tiny_ckpt.tokenizer.encode("<|tts|><|text|>Hi<|audio|>").ids
    table = tiny_ckpt.text_embedding()
    assert table.shape[0] > max(ids)
    assert np.isfinite(table[ids].numpy()).all()

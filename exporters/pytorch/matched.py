"""The matched oracle: the PyTorch reference run with the weights read back from a bundle.

See :mod:`higgs_pack.exporters.pytorch.dequantize` for why.  For each sub-part whose weights
were quantized or cast (precision other than fp32) this captures, on the golden inputs
already in ``g``, the oracle's outputs with the bundle's own weights
(``<part>/matched/<tensor>``), and checks every read-back weight against the
checkpoint's: a relative L2 difference above :data:`WEIGHT_REL_L2_LIMIT` for the
precision is a wrong export (a misplaced layer, a transposed projection, a broken
quantizer), not quantization, and fails the build.
"""

from __future__ import annotations

import gc
import math
from pathlib import Path
from typing import Any

import numpy as np

from higgs_pack.errors import BuildError
from higgs_pack.manifests.model import SUBPART_IO, SubPart
from higgs_pack.runtime.verification.kv_parity import GOLDEN_KV_MATCHED

#: Largest relative L2 difference a read-back weight may have from the checkpoint's, per
#: precision.  Round-to-nearest int4 of Gaussian weights lands near 0.10 with blocks of
#: 32 and 0.12-0.13 with groups of 128 (measured on the tiny/bench/full presets); int8
#: near 0.01; fp16 only rounds (bf16 values are exact in fp16 within its range).  A
#: swapped pair of layers gives ~1.4 (two independent random matrices), a transposed
#: square projection the same.
WEIGHT_REL_L2_LIMIT = {"int4": 0.25, "int8": 0.03, "fp16": 1e-3, "fp32": 1e-6}


def _rel_l2(got: np.ndarray, want: np.ndarray) -> float:
    denom = float(np.linalg.norm(want))
    return float(np.linalg.norm(got - want)) / denom if denom else float(np.linalg.norm(got))


def _layer_sizes(ckpt: Any) -> dict[str, int]:
    cfg = ckpt.text_config
    heads = int(cfg["num_attention_heads"])
    kv = int(cfg.get("num_key_value_heads") or heads)
    hd = int(cfg.get("head_dim") or int(cfg["hidden_size"]) // heads)
    inter = int(cfg["intermediate_size"])
    h = int(cfg["hidden_size"])
    return {"self_attn.q_proj.weight": heads * hd, "self_attn.k_proj.weight": kv * hd,
            "self_attn.v_proj.weight": kv * hd, "self_attn.o_proj.weight": h,
            "mlp.gate_proj.weight": inter, "mlp.up_proj.weight": inter, "mlp.down_proj.weight": h}


def _decoder_reader(bundle_dir: Path, info: dict[str, Any], ckpt: Any):
    """``f(layer) -> {param: float32 array}`` for the bundle's decoder, by its format."""
    entry = bundle_dir / info["entry"]
    if info["format"] == "onnx":
        from higgs_pack.exporters.pytorch.dequantize import OnnxWeights

        reader = OnnxWeights(entry)
        sizes = _layer_sizes(ckpt)
        return lambda layer: reader.modelbuilder_layer(layer, sizes)
    from higgs_pack.exporters.pytorch.dequantize import OpenVinoWeights

    reader = OpenVinoWeights(entry)
    return reader.optimum_layer


def _single_weight(path: Path, fmt: str) -> np.ndarray:
    """The one weight table of a small sub-part file, read back (ONNX or OpenVINO IR)."""
    if fmt == "onnx":
        from higgs_pack.exporters.pytorch.dequantize import OnnxWeights

        reader = OnnxWeights(path)
        nodes = reader.weight_nodes()
        if len(nodes) != 1:
            raise BuildError(f"{path}: expected one weight node, found {nodes}")
        return reader.weight(nodes[0])
    from higgs_pack.exporters.pytorch.dequantize import OpenVinoWeights

    return OpenVinoWeights(path).single_weight()


def _check_weights(name_of, read: dict[str, np.ndarray], ckpt: Any, limit: float, worst: dict[str, Any]) -> None:
    for param, array in read.items():
        ref = ckpt.tensor(name_of(param)).float().numpy()
        if ref.shape != array.shape:
            raise BuildError(f"read-back {name_of(param)} has shape {list(array.shape)}, the checkpoint's "
                             f"{list(ref.shape)}: the export changed the layout")
        rel = _rel_l2(array, ref)
        if rel > worst["max_rel_l2"]:
            worst.update(max_rel_l2=rel, tensor=name_of(param))
    if worst["max_rel_l2"] > limit:
        raise BuildError(
            f"the bundle's weight {worst['tensor']} differs from the checkpoint's by relative L2 "
            f"{worst['max_rel_l2']:.3f} (at most {limit} is quantization): the export misplaced, "
            "transposed or corrupted it")


def capture_matched(ckpt: Any, pipe: Any, g: dict[str, np.ndarray], bundle_dir: Path,
                    subparts: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Add ``<part>/matched/<tensor>`` entries to ``g``; return the weight check per sub-part.

    Args:
        ckpt: the open checkpoint.
        pipe: the float oracle pipeline the golden outputs came from (its decoder's model
            is reused with read-back weights, so no second copy of the body is held).
        g: the golden arrays so far (inputs are read from it).
        bundle_dir: the bundle being built.
        subparts: sub-part -> ``{"format", "entry", "precision"}`` (+ the decoder's ``"kv_cache"``
            record: the matched oracle's K/V after the golden prompt are then saved as
            ``llm_decoder/kv_matched/present.{i}.key|value``).

    Returns:
        ``{part: {"max_rel_l2": float, "tensor": name}}`` for every matched sub-part.

    Raises:
        BuildError: a read-back weight's shape or values do not fit the checkpoint's.
    """
    out: dict[str, Any] = {}
    for part, info in subparts.items():
        precision = info["precision"]
        if precision == "fp32":
            continue
        limit = WEIGHT_REL_L2_LIMIT[precision]
        if part == SubPart.LLM_DECODER.value:
            worst = _matched_decoder(ckpt, pipe, g, bundle_dir, info, limit)
        elif part in (SubPart.TEXT_EMBED.value, SubPart.AUDIO_EMBED.value, SubPart.AUDIO_HEADS.value):
            worst = _matched_table(ckpt, pipe, g, bundle_dir, part, info, limit)
        else:
            continue
        worst["max_rel_l2"] = round(worst["max_rel_l2"], 6) if math.isfinite(worst["max_rel_l2"]) else None
        out[part] = worst
    return out


def _matched_decoder(ckpt: Any, pipe: Any, g: dict[str, np.ndarray], bundle_dir: Path, info: dict[str, Any],
                     limit: float) -> dict[str, Any]:
    """The decoder's part of :func:`capture_matched`: check every read-back layer, then run the matched
    oracle on the golden prompt and step; returns the worst weight."""
    from higgs_pack.exporters.checkpoint.layout import BODY_PREFIX
    from higgs_pack.exporters.checkpoint.models import qwen3_model
    from higgs_pack.exporters.pytorch.reference import TorchDecoder, upcast_per_layer

    worst: dict[str, Any] = {"max_rel_l2": 0.0, "tensor": None}
    read = _decoder_reader(bundle_dir, info, ckpt)
    layers = int(ckpt.text_config["num_hidden_layers"])
    for layer in range(layers):
        _check_weights(lambda p, i=layer: f"{BODY_PREFIX}layers.{i}.{p}", read(layer), ckpt, limit, worst)
        ckpt.close()
    # The float oracle's weights are done with: drop them, and run the matched oracle on
    # a body holding only the norms, every projection read back layer by layer (so the
    # 4B model is never in memory twice: measured 14 GiB before, at full size).
    pipe.decoder.model = None
    gc.collect()
    skeleton = upcast_per_layer(qwen3_model(ckpt, stored_dtype=True, projections=False), read)
    decoder = TorchDecoder(skeleton, pipe.constants.max_position_embeddings)
    g["llm_decoder/matched/hidden_states"] = decoder.forward(g["llm_decoder/in/inputs_embeds"])
    if info.get("kv_cache"):  # a quantized KV cache is judged against these K/V
        g.update({f"{GOLDEN_KV_MATCHED}{name}": value for name, value in decoder.kv_cache().items()})
    g["llm_decoder/matched/step_hidden_states"] = decoder.forward(g["llm_decoder/in/step_embeds"])
    del decoder, skeleton
    gc.collect()
    return worst


def _matched_table(ckpt: Any, pipe: Any, g: dict[str, np.ndarray], bundle_dir: Path, part: str,
                   info: dict[str, Any], limit: float) -> dict[str, Any]:
    """A one-table sub-part's part of :func:`capture_matched` (text or audio embedding, audio heads):
    check its read-back table, then run it on the golden inputs; returns the weight's difference."""
    import torch

    from higgs_pack.exporters.checkpoint.layout import AUDIO_EMBEDDING, TEXT_EMBEDDING
    from higgs_pack.exporters.pytorch.modules import AudioEmbed, AudioHeads, TextEmbed
    from higgs_pack.exporters.pytorch.reference import TorchRunner

    c = pipe.constants
    table = torch.from_numpy(_single_weight(bundle_dir / info["entry"], info["format"]))
    source = TEXT_EMBEDDING if part == SubPart.TEXT_EMBED.value else AUDIO_EMBEDDING
    ref = ckpt.tensor(source).float()
    if part == SubPart.AUDIO_HEADS.value:
        ref = pipe.audio_heads.module.weight.detach()  # tied or separate head, as the oracle uses it
    if tuple(ref.shape) != tuple(table.shape):
        raise BuildError(f"read-back {part} weight has shape {list(table.shape)}, expected {list(ref.shape)}")
    worst: dict[str, Any] = {"max_rel_l2": _rel_l2(table.numpy(), ref.numpy()), "tensor": source}
    if worst["max_rel_l2"] > limit:
        raise BuildError(f"the bundle's {part} weight differs from the checkpoint's by relative L2 "
                         f"{worst['max_rel_l2']:.3f} (at most {limit} is quantization)")
    if part == SubPart.TEXT_EMBED.value:
        module = TextEmbed(table)
    elif part == SubPart.AUDIO_EMBED.value:
        module = AudioEmbed(table, c.num_codebooks, c.audio_vocab_size)
    else:
        module = AudioHeads(table, c.num_codebooks, c.audio_vocab_size)
    runner = TorchRunner(module, *SUBPART_IO[SubPart(part)])
    feeds = {k.split("/", 2)[2]: v for k, v in g.items() if k.startswith(f"{part}/in/")}
    for name, value in runner.run(feeds).items():
        g[f"{part}/matched/{name}"] = value
    return worst

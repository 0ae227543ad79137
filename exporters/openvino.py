"""OpenVINO IR export: the stateful Qwen3 decoder and the small sub-parts.

Two mechanisms, one per kind of sub-part:

* ``llm_decoder`` -- :func:`convert_llm_decoder`. optimum-intel's OpenVINO
  exporter, called through its Python API because the export takes
  ``inputs_embeds`` (no embedding inside) and returns the final hidden state (no
  LM head inside)::

      cfg = optimum.exporters.openvino.model_configs.get_vlm_text_generation_config(
          "qwen3", model.config, int_dtype="int64", float_dtype="fp32")
      optimum.exporters.openvino.convert.export_models(
          {"llm_decoder": (model_with_identity_lm_head, cfg)}, tmp_dir,
          output_names=["llm_decoder.xml"], stateful=True)

  The KV cache becomes ReadValue/Assign state and a ``beam_idx`` input is added.
  Olive's ``OpenVINOOptimumConversion`` cannot express this: it runs
  ``main_export`` from JSON with an ``input_ids`` input only (custom export
  configs are Python objects). The IR is then renamed (``logits`` ->
  ``hidden_states``) and its weights compressed with ``nncf.compress_weights``.

* ``text_embed``, ``audio_embed``, ``audio_heads``, ``audio_tokenizer``,
  ``audio_encoder`` -- :func:`convert_subpart`. By default (``engine="olive"``)
  Olive's passes run one by one, without a workflow or its cache:
  ``OpenVINOConversion`` (``static=False`` with an ``example_input_func``: that
  is the only way to give it int64 inputs; it takes input names from the
  module's ``forward`` signature and ignores ``io_config``) then, for int8/int4,
  ``OpenVINOWeightCompression``. Olive cannot name outputs nor give partial shapes
  such as ``[?, ?, 8]``, so a last plain-OpenVINO step sets the ``SUBPART_IO``
  names, reshapes and saves. ``engine="openvino"`` does the same with
  ``openvino.convert_model`` + ``nncf.compress_weights`` directly (no Olive
  import, which costs about 7 s, and real exceptions: Olive's conversion replaces
  any converter error by "Invalid config file").

NPU bundles (the openvino target's ``npu`` variant) are fully static: the decoder
comes from :func:`convert_static_decoder` (stateless, fixed-size KV buffers; the
docstring says why not the stateful IR with NPUW properties), the small sub-parts
from ``convert_subpart(static_axes=...)``, which also records how the runtime pads
or chunks real inputs into the static shapes (``options.chunking``). The codec
decoder gets a ``valid_frames`` input that zeroes every convolution input past the
real frames, so a padded chunk decodes exactly like the unpadded codes.

Gotchas measured here (openvino 2026.4.1, nncf 3.4, optimum-intel 2.2, olive 0.13):

* ``openvino.save_model`` compresses float32 constants to float16 unless
  ``compress_to_fp16=False``; every save here passes it explicitly. That flag is
  also how an fp16 IR is made: weights stored as f16 constants followed by a
  Convert to f32; the compute precision is the device's
  ``INFERENCE_PRECISION_HINT``.
* Olive's ``OpenVINOWeightCompression`` saves with the default
  ``compress_to_fp16=True``, so float weights NNCF leaves alone come out f16;
  :func:`weight_summary` records what the IR really holds.
* NNCF's default group size 128 must divide the input width of every MatMul:
  ``AdvancedCompressionParameters(group_size_fallback_mode=ADJUST)`` picks a
  smaller one where needed (the tiny model's 64-wide layers get 64); the group
  sizes actually used are recorded. Without ``all_layers=True`` NNCF keeps one
  layer in INT8 (the backup mode).
* Stateful IRs keep their state after ``compress_weights`` and ``reshape``; the
  state shapes stay dynamic.
"""

from __future__ import annotations

import gc
import json
import logging
import shutil
import tempfile
from collections import Counter
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import openvino as ov

from higgs_pack.exporters.openvino_plan import (
    DECODER_EXPORT_PASS,
    STATIC_DECODER_PASS,
    compress_mode,
)
from higgs_pack.exporters.process import disk_note
from higgs_pack.exporters.result import ExportResult, TensorSpec, tool_versions
from higgs_pack.manifests.constants import FP32_ONLY, SUBPART_IO, SubPart
from higgs_pack.manifests.errors import BuildError, BuildPlanError, unknown_choice
from higgs_pack.runtime.openvino_backend import (  # noqa: F401 (one copy of the names)
    DECODER_INPUTS,
    DECODER_OUTPUT,
    decoder_compile_properties,
)

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

Precision = Literal["fp32", "fp16", "int8", "int4"]

#: Precisions the OpenVINO exporters accept.
PRECISIONS: tuple[str, ...] = ("fp32", "fp16", "int8", "int4")

#: Sub-part conversion mechanisms for :func:`convert_subpart`.
ENGINES: tuple[str, ...] = ("olive", "openvino")

# The stateful decoder IR's inputs (optimum-intel writes attention_mask, position_ids,
# inputs_embeds, beam_idx) and its single output after renaming: the runtime's names,
# DECODER_INPUTS / DECODER_OUTPUT of higgs_pack.runtime.openvino_backend (imported above).


#: Key under which higgs-pack writes its own entries into an IR's ``rt_info``.
RT_INFO_KEY = "higgs_pack"

_INT_WEIGHT_TYPES = {"u4": "int4", "i4": "int4", "u8": "int8", "i8": "int8"}
_FLOAT_WEIGHT_TYPES = {"f32": "float32", "f16": "float16", "bf16": "bfloat16"}


# ----------------------------------------------------------------------------- helpers


def _qwen3_config(hf_dir: Path):
    """The transformers config of a standard Qwen3 directory (the checkpoint's body, remapped).

    Raises:
        CheckpointError: no ``config.json``, or a ``model_type`` other than ``qwen3``.
    """
    from transformers import AutoConfig

    from higgs_pack.manifests.errors import CheckpointError

    if not (hf_dir / "config.json").is_file():
        raise CheckpointError(f"{hf_dir} has no config.json; pass a Qwen3 Hugging Face directory as hf_dir=")
    config = AutoConfig.from_pretrained(hf_dir)
    if config.model_type != "qwen3":
        raise CheckpointError(
            f"{hf_dir}: model_type is {config.model_type!r}, expected 'qwen3' (the checkpoint's body "
            "remapped to a standard Qwen3 directory)"
        )
    return config


def _check_precision(precision: str, subpart: SubPart) -> None:
    if precision not in PRECISIONS:
        raise BuildPlanError(unknown_choice("precision", precision, PRECISIONS, "--precision / precision="))
    if subpart in FP32_ONLY and precision != "fp32":
        raise BuildPlanError(
            f"sub-part {subpart.value} is always exported at fp32 (int4/fp16 codecs are too lossy), "
            f"got precision {precision!r}; pass precision='fp32' for it"
        )


def _dtype_name(element_type: ov.Type) -> str:
    try:
        return np.dtype(element_type.to_dtype()).name
    except (RuntimeError, TypeError, ValueError):
        return element_type.get_type_name()


def _spec(port: ov.Output) -> TensorSpec:
    shape: list[int | str] = []
    for dim in port.get_partial_shape():
        shape.append(dim.get_length() if dim.is_static else ("?" if dim.get_max_length() < 0 else str(dim)))
    return TensorSpec(name=port.get_any_name(), dtype=_dtype_name(port.get_element_type()), shape=shape)


def _read(xml: str | Path | ov.Model) -> ov.Model:
    if isinstance(xml, ov.Model):
        return xml
    path = Path(xml)
    if not path.is_file():
        raise BuildError(f"OpenVINO IR {path} does not exist; the exporter did not write it.")
    return ov.Core().read_model(path)


def ir_io_signature(xml: str | Path | ov.Model) -> tuple[list[TensorSpec], list[TensorSpec]]:
    """Read the inputs and outputs an OpenVINO IR declares.

    Args:
        xml: The ``.xml`` file (its ``.bin`` beside it) or an ``openvino.Model``.

    Returns:
        ``(inputs, outputs)``, lists of :class:`TensorSpec` in graph order; dtypes as
        numpy names (``"float32"``, ``"int64"``, ``"int32"``...), fixed axes as ints,
        dynamic axes as ``"?"`` (bounded ones as OpenVINO prints them, ``"1..8"``).
        State variables of a stateful IR are not inputs and are not listed.

    Raises:
        BuildError: The file does not exist.
    """
    model = _read(xml)
    return [_spec(p) for p in model.inputs], [_spec(p) for p in model.outputs]


def is_stateful(xml: str | Path | ov.Model) -> bool:
    """Whether an IR keeps state (the KV cache) in ReadValue/Assign variables.

    Args:
        xml: The ``.xml`` file or an ``openvino.Model``.

    Returns:
        ``True`` if the model has sinks (Assign) or variables.

    Raises:
        BuildError: The file does not exist.
    """
    model = _read(xml)
    return bool(model.get_sinks()) or bool(model.get_variables())


def weight_summary(xml: str | Path | ov.Model) -> dict[str, Any]:
    """Count the weight constants of an IR by storage type, as NNCF left them.

    Weights are constants of rank >= 2 whose last axis is not 1 (that excludes
    the per-group scales and zero points).

    Args:
        xml: The ``.xml`` file or an ``openvino.Model``.

    Returns:
        ``{"weights": {"int4": n, "int8": n, "float16": n, "float32": n},
        "int4_group_sizes": [64, 128]}`` (zero counts and an empty group-size list
        are left out). An int4 weight ``[out, groups, group_size]`` gives its group size.
    """
    model = _read(xml)
    counts: Counter[str] = Counter()
    group_sizes: set[int] = set()
    for node in model.get_ordered_ops():
        if node.get_type_name() != "Constant":
            continue
        shape = node.get_output_partial_shape(0)
        if shape.rank.get_length() < 2 or not shape.is_static or shape[-1].get_length() == 1:
            continue
        kind = node.get_output_element_type(0).get_type_name()
        label = _INT_WEIGHT_TYPES.get(kind) or _FLOAT_WEIGHT_TYPES.get(kind)
        if label is None:
            continue
        counts[label] += 1
        if label == "int4" and shape.rank.get_length() == 3:
            group_sizes.add(shape[-1].get_length())
    summary: dict[str, Any] = {"weights": dict(sorted(counts.items()))}
    if group_sizes:
        summary["int4_group_sizes"] = sorted(group_sizes)
    return summary


def _compress_settings(precision: str, group_size: int, ratio: float, all_layers: bool,
                       symmetric: bool = False) -> dict[str, Any]:
    """The NNCF settings asked for, JSON-ready (mode names as NNCF spells their values).

    ``symmetric`` selects INT4_SYM for int4 (what Intel's NPU plugin wants, per the
    OpenVINO GenAI NPU guide); int8 stays INT8_ASYM per channel.
    """
    if precision == "int4":
        return {
            "mode": compress_mode(precision, symmetric),
            "group_size": group_size,
            "ratio": ratio,
            "all_layers": all_layers,
            "group_size_fallback_mode": "adjust",
            "backup_mode": "int8_asym",
        }
    if precision == "int8":
        return {"mode": compress_mode(precision), "granularity": "per_channel"}
    return {}


def _nncf_kwargs(settings: Mapping[str, Any]) -> dict[str, Any]:
    import nncf
    from nncf.quantization.advanced_parameters import GroupSizeFallbackMode

    kwargs: dict[str, Any] = {"mode": nncf.CompressWeightsMode(settings["mode"])}
    if settings["mode"] in ("int4_asym", "int4_sym"):
        kwargs.update(
            group_size=settings["group_size"],
            ratio=settings["ratio"],
            all_layers=settings["all_layers"],
            advanced_parameters=nncf.AdvancedCompressionParameters(
                group_size_fallback_mode=GroupSizeFallbackMode(settings["group_size_fallback_mode"])
            ),
        )
    return kwargs


def _compress(model: ov.Model, precision: str, group_size: int, ratio: float, all_layers: bool,
              symmetric: bool = False) -> tuple[ov.Model, dict[str, Any]]:
    """Apply ``nncf.compress_weights`` for int8/int4; return the model and the settings used."""
    settings = _compress_settings(precision, group_size, ratio, all_layers, symmetric)
    if not settings:
        return model, {}
    import nncf

    try:
        model = nncf.compress_weights(model, **_nncf_kwargs(settings))
    except Exception as exc:  # NNCF raises many types; keep the cause
        raise BuildError(f"nncf.compress_weights failed for precision {precision!r} ({settings}): {exc}") from exc
    return model, settings


def _set_rt_info(model: ov.Model, subpart: SubPart, precision: str, quantization: Mapping[str, Any],
                 versions: Mapping[str, str]) -> None:
    model.set_rt_info(subpart.value, [RT_INFO_KEY, "subpart"])
    model.set_rt_info(precision, [RT_INFO_KEY, "precision"])
    model.set_rt_info(json.dumps(dict(quantization), sort_keys=True), [RT_INFO_KEY, "quantization"])
    model.set_rt_info(json.dumps(dict(versions), sort_keys=True), [RT_INFO_KEY, "tool_versions"])


def _save(model: ov.Model, xml: Path, precision: str) -> None:
    xml.parent.mkdir(parents=True, exist_ok=True)
    ov.save_model(model, xml, compress_to_fp16=(precision == "fp16"))


def _relative_files(xml: Path, bundle_dir: Path) -> list[str]:
    root = bundle_dir.resolve()
    files = []
    for path in (xml, xml.with_suffix(".bin")):
        path = path.resolve()
        if not path.is_relative_to(root):
            raise BuildError(f"{path} is outside the bundle {root}; pass out_dir inside bundle_dir.")
        files.append(path.relative_to(root).as_posix())
    return files


def _partial_shape(shape: Sequence[int | str | None]) -> ov.PartialShape:
    dims = []
    for d in shape:
        if d is None or isinstance(d, str) or (isinstance(d, int) and d < 0):
            dims.append(ov.Dimension())
        else:
            dims.append(ov.Dimension(int(d)))
    return ov.PartialShape(dims)


def _name_and_shape(model: ov.Model, input_names: Sequence[str], output_names: Sequence[str],
                    input_shapes: Sequence[Sequence[int | str | None]] | None, where: str) -> None:
    """Give the IR's ports their contract names (by position) and, optionally, shapes."""
    if len(model.inputs) != len(input_names):
        got = [p.get_names() for p in model.inputs]
        raise BuildError(f"{where}: the converted graph has {len(got)} inputs {got}, expected {list(input_names)}")
    if len(model.outputs) != len(output_names):
        raise BuildError(
            f"{where}: the converted graph has {len(model.outputs)} outputs, expected {list(output_names)}; "
            "the module's forward must return exactly those tensors"
        )
    for port, name in zip(model.inputs, input_names, strict=True):
        port.get_tensor().set_names({name})
    for port, name in zip(model.outputs, output_names, strict=True):
        port.get_tensor().set_names({name})
    if input_shapes is not None:
        if len(input_shapes) != len(input_names):
            raise BuildError(f"{where}: {len(input_shapes)} input shapes given for inputs {list(input_names)}")
        try:
            model.reshape({name: _partial_shape(s) for name, s in zip(input_names, input_shapes, strict=True)})
        except RuntimeError as exc:
            raise BuildError(f"{where}: cannot reshape inputs {list(input_names)} to {input_shapes}: {exc}") from exc


# ----------------------------------------------------------------------------- decoder


def convert_llm_decoder(
    hf_dir: str | Path,
    out_dir: str | Path,
    *,
    precision: Precision,
    group_size: int = 128,
    ratio: float = 1.0,
    all_layers: bool = False,
    bundle_dir: str | Path | None = None,
    name: str = "llm_decoder",
    work_dir: str | Path | None = None,
    static_kv_length: int | None = None,
    static_step: int = 1,
    symmetric: bool = False,
) -> ExportResult:
    """Export the Qwen3 body as a stateful OpenVINO IR and compress its weights.

    With ``static_kv_length`` (the ``npu`` variant) the decoder is exported instead
    by :func:`convert_static_decoder`: stateless, every shape fixed, the KV cache
    in fixed-size buffers the runtime owns.

    The graph takes embeddings and returns final-norm hidden states: the LM head
    is replaced by an identity before export and the output renamed
    ``hidden_states``. The KV cache lives in the IR's state.

    IR inputs: ``attention_mask`` int64 [batch, past+sequence] (ones),
    ``position_ids`` int64 [batch, sequence], ``inputs_embeds`` float32
    [batch, sequence, hidden], ``beam_idx`` int32 [batch] (``[0]`` for batch 1).
    Output: ``hidden_states`` float32 [batch, sequence, hidden].

    Args:
        hf_dir: A standard Qwen3 Hugging Face directory (``config.json`` with
            ``model_type: "qwen3"`` and safetensors weights).
        out_dir: Where ``<name>.xml`` and ``<name>.bin`` are written (created if needed).
        precision: ``"int4"`` (NNCF INT4_ASYM, grouped), ``"int8"`` (NNCF INT8_ASYM,
            per output channel), ``"fp16"`` (weights stored as float16) or ``"fp32"``.
        group_size: int4 only: weights per quantization group along the input axis;
            where it does not divide a layer's width NNCF uses a smaller one
            (recorded in ``quantization["effective"]``).
        ratio: int4 only: share of the ratio-defining layers in int4, the rest in int8.
        all_layers: int4 only: also put the layers NNCF keeps in int8 by default
            into int4.
        bundle_dir: Root the returned file paths are relative to (default ``out_dir``).
        name: File stem of the IR.
        work_dir: Parent of the temporary export directory (default ``out_dir``);
            it is removed afterwards.
        static_kv_length: Export the fully static, stateless decoder with KV buffers
            of this many positions (see :func:`convert_static_decoder`).
        static_step: With ``static_kv_length``: positions per decoder call (1).
        symmetric: int4 only: INT4_SYM instead of INT4_ASYM (NPU bundles).

    Returns:
        An :class:`ExportResult` with ``exporter="optimum-intel"``, the passes
        applied, tool versions (openvino, nncf, optimum-intel, transformers, torch),
        the NNCF settings asked for and the weight types found in the IR, and the
        IR's I/O signature. ``options`` records ``stateful=True`` and the export config.

    Raises:
        BuildPlanError: Unknown precision.
        CheckpointError: ``hf_dir`` is not a Qwen3 directory.
        BuildError: The export or the compression failed.
    """
    if static_kv_length is not None:
        return convert_static_decoder(
            hf_dir, out_dir, precision=precision, kv_length=static_kv_length, step=static_step,
            group_size=group_size, ratio=ratio, all_layers=all_layers, symmetric=symmetric,
            bundle_dir=bundle_dir, name=name,
        )
    import torch
    from optimum.exporters.openvino.convert import export_models
    from optimum.exporters.openvino.model_configs import get_vlm_text_generation_config
    from transformers import AutoModelForCausalLM


    subpart = SubPart.LLM_DECODER
    _check_precision(precision, subpart)
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    bundle_dir = Path(bundle_dir) if bundle_dir is not None else out_dir
    config = _qwen3_config(hf_dir)  # refuses a directory that is not a standard Qwen3 one
    # Load in the stored dtype and let OpenVINO's PyTorch frontend keep 16-bit weights
    # as constants decompressed to f32 in the graph (patch_16bit_model, what
    # `optimum-cli export openvino` does): compute stays f32 on the exact checkpoint
    # weights, while the export holds one 8 GB bf16 copy of the 4B body instead of a
    # 16 GB float32 one (measured peak 21.4 GB before).
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    stored = getattr(torch, stored) if isinstance(stored, str) else stored
    load_dtype = stored if stored in (torch.bfloat16, torch.float16) else torch.float32
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=load_dtype).eval()
    model.lm_head = torch.nn.Identity()
    export_config = get_vlm_text_generation_config("qwen3", model.config, int_dtype="int64", float_dtype="fp32")

    out_dir.mkdir(parents=True, exist_ok=True)
    xml = out_dir / f"{name}.xml"
    work_parent = Path(work_dir) if work_dir is not None else out_dir
    work_parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-export-", dir=work_parent))
    try:
        try:
            export_models({name: (model, export_config)}, tmp, output_names=[f"{name}.xml"], stateful=True,
                          patch_16bit_model=load_dtype != torch.float32)
        except Exception as exc:
            raise BuildError(f"optimum-intel export of {hf_dir} failed: {exc}{disk_note([tmp])}") from exc
        del model
        gc.collect()
        ov_model = ov.Core().read_model(tmp / f"{name}.xml")
        if not is_stateful(ov_model):
            raise BuildError(f"optimum-intel exported {hf_dir} without state; expected a stateful KV cache")
        ov_model.outputs[0].get_tensor().set_names({DECODER_OUTPUT})
        ov_model, settings = _compress(ov_model, precision, group_size, ratio, all_layers, symmetric)
        versions = tool_versions("openvino", "nncf", "optimum-intel", "transformers", "torch")
        quantization = {**settings, "effective": weight_summary(ov_model)} if settings else {}
        _set_rt_info(ov_model, subpart, precision, quantization, versions)
        _save(ov_model, xml, precision)
        del ov_model
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    return _decoder_result(
        xml, bundle_dir, subpart, precision, settings, quantization, versions,
        exporter="optimum-intel", export_pass=DECODER_EXPORT_PASS,
        options={
            "stateful": True,
            "export_config": "get_vlm_text_generation_config('qwen3', int_dtype='int64', float_dtype='fp32')",
            "lm_head": "identity",
            "weights_loaded_as": str(load_dtype).removeprefix("torch."),
        },
    )


def _decoder_result(xml: Path, bundle_dir: Path, subpart: str, precision: str, settings: Mapping[str, Any],
                    quantization: dict[str, Any], versions: dict[str, str], *, exporter: str, export_pass: str,
                    options: dict[str, Any]) -> ExportResult:
    """The :class:`ExportResult` of a saved decoder IR: passes from the compression
    settings, I/O signature and weight storage read back from the file."""
    passes = [export_pass]
    if settings:
        passes.append(f"nncf.compress_weights({settings['mode'].upper()})")
    elif precision == "fp16":
        passes.append("save_model(compress_to_fp16)")
    inputs, outputs = ir_io_signature(xml)
    files = _relative_files(xml, bundle_dir)
    if options.get("static"):
        options = {**options, "static_shapes": {t.name: list(t.shape) for t in (*inputs, *outputs)}}
    options = {**options, "compile_properties": decoder_compile_properties(precision,
                                                                          stateful=bool(options.get("stateful")))}
    return ExportResult(
        subpart=subpart, format="openvino", files=files, entry=files[0], exporter=exporter, passes=passes,
        tool_versions=versions, precision=precision, quantization=quantization, inputs=inputs, outputs=outputs,
        options={**options, "compress_to_fp16": precision == "fp16", "weight_storage": weight_summary(xml)},
    )


# ----------------------------------------------------------------------------- static decoder (npu)

#: Names of the static decoder's KV inputs/outputs (as ModelBuilder names them), per layer ``i``.
STATIC_PAST = "past_key_values.{i}.{kind}"
STATIC_PRESENT = "present.{i}.{kind}"
#: Non-KV inputs of the static decoder IR, in graph order.
STATIC_DECODER_INPUTS: tuple[str, ...] = ("inputs_embeds", "attention_mask", "position_ids")


def _static_decoder_module(body: Any, kv_length: int) -> torch.nn.Module:
    """Wrap a transformers ``Qwen3Model`` as a stateless step over fixed-size KV buffers.

    ``forward(inputs_embeds [1, S, H], attention_mask int64 [1, kv_length + S],
    position_ids int64 [1, S], *past)`` where ``past`` is ``key_0, value_0, key_1, …``,
    each float32 [1, kv_heads, kv_length, head_dim] (post-RoPE keys, as transformers
    caches them). ``attention_mask[:, :kv_length]`` says which buffer slots hold
    real positions, ``attention_mask[:, kv_length:]`` which of the S new rows are real
    (padding rows come last); new rows attend causally among themselves. Returns the
    final-norm hidden states [1, S, H] and, per layer, the new keys and values
    [1, kv_heads, S, head_dim] for the runtime to write into its buffers. The layer
    arithmetic is transformers' Qwen3 (same modules, ``apply_rotary_pos_emb``,
    ``repeat_kv``, eager softmax attention in float32).
    """
    import torch
    from transformers.models.qwen3.modeling_qwen3 import apply_rotary_pos_emb, repeat_kv

    class StaticKVDecoder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = body

        def forward(self, inputs_embeds, attention_mask, position_ids, *past):
            b, s, _ = inputs_embeds.shape
            cos, sin = self.body.rotary_emb(inputs_embeds, position_ids)
            valid = attention_mask.to(torch.bool)
            causal = torch.ones(s, s, dtype=torch.bool).tril()
            allowed = torch.cat(
                [valid[:, None, None, :kv_length].expand(b, 1, s, kv_length),
                 causal[None, None] & valid[:, None, None, kv_length:]],
                dim=-1,
            )
            dtype = inputs_embeds.dtype
            bias = torch.zeros(allowed.shape, dtype=dtype).masked_fill(~allowed, torch.finfo(dtype).min)
            hidden = inputs_embeds
            presents = []
            for i, layer in enumerate(self.body.layers):
                attn = layer.self_attn
                h = layer.input_layernorm(hidden)
                shape = (b, s, -1, attn.head_dim)
                q = attn.q_norm(attn.q_proj(h).view(shape)).transpose(1, 2)
                k = attn.k_norm(attn.k_proj(h).view(shape)).transpose(1, 2)
                v = attn.v_proj(h).view(shape).transpose(1, 2)
                q, k = apply_rotary_pos_emb(q, k, cos, sin)
                keys = repeat_kv(torch.cat([past[2 * i], k], dim=2), attn.num_key_value_groups)
                values = repeat_kv(torch.cat([past[2 * i + 1], v], dim=2), attn.num_key_value_groups)
                scores = torch.matmul(q, keys.transpose(2, 3)) * attn.scaling + bias
                probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(dtype)
                out = torch.matmul(probs, values).transpose(1, 2).reshape(b, s, -1)
                hidden = hidden + attn.o_proj(out)
                hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
                presents += [k, v]
            return (self.body.norm(hidden), *presents)

    return StaticKVDecoder().eval()


def convert_static_decoder(
    hf_dir: str | Path,
    out_dir: str | Path,
    *,
    precision: Precision,
    kv_length: int,
    step: int = 1,
    group_size: int = 128,
    ratio: float = 1.0,
    all_layers: bool = False,
    symmetric: bool = False,
    bundle_dir: str | Path | None = None,
    name: str = "llm_decoder",
) -> ExportResult:
    """Export the Qwen3 body as a fully static, stateless OpenVINO IR (the NPU decoder).

    Why this and not the stateful IR with the NPU plugin's NPUW LLM properties
    (``NPU_USE_NPUW``, ``NPUW_LLM``, ``NPUW_LLM_MAX_PROMPT_LEN``…, as OpenVINO GenAI
    sets them): NPUW reshapes the stateful graph into its own static prefill and
    generate models *inside the NPU plugin*, so on a machine without an NPU (all of
    ours, and CI) nothing of what the NPU would run can be compiled or checked, and
    the stateful IR keeps dynamic state shapes that verify cannot prove static. This
    graph is what the NPU compiles, byte for byte, and it runs on the CPU device
    too: its static shapes, its parity against PyTorch (cosine 1.0 at fp32 on the
    tiny model, token by token) and the whole TTS loop on it are tested here. It
    needs no plugin-specific properties. The price: the KV buffers cross the device
    boundary on every call, and the prompt is fed ``step`` positions per call (1:
    prefill is token by token) since every call has the same shape.

    IR inputs (all shapes fixed, batch 1): ``inputs_embeds`` float32 [1, step, H],
    ``attention_mask`` int64 [1, kv_length + step] (buffer slots in use, then the
    real new rows), ``position_ids`` int64 [1, step], and per layer ``i``
    ``past_key_values.{i}.key`` / ``.value`` float32 [1, kv_heads, kv_length, head_dim].
    Outputs: ``hidden_states`` float32 [1, step, H] and ``present.{i}.key`` /
    ``.value`` float32 [1, kv_heads, step, head_dim] (only the new positions; the
    runtime writes them into its buffers, see
    ``higgs_pack.runtime.openvino_backend.OvStaticKVDecoder``).

    Args:
        hf_dir: A standard Qwen3 Hugging Face directory.
        out_dir: Where ``<name>.xml`` / ``.bin`` are written.
        precision: As :func:`convert_llm_decoder` (NNCF weight compression).
        kv_length: Positions the KV buffers hold (prompt + generated frames).
        step: Positions per call.
        group_size, ratio, all_layers, symmetric: NNCF settings, as :func:`convert_llm_decoder`.
        bundle_dir: Root the returned file paths are relative to (default ``out_dir``).
        name: File stem of the IR.

    Returns:
        An :class:`ExportResult` (``exporter="openvino"``); ``options`` records
        ``stateful=False``, ``static=True``, ``kv_length``, ``step`` and ``static_shapes``.

    Raises:
        BuildPlanError: Unknown precision, or ``kv_length`` / ``step`` not positive.
        CheckpointError: ``hf_dir`` is not a Qwen3 directory.
        BuildError: Conversion or compression failed, or a shape stayed dynamic.
    """
    import torch
    from transformers import AutoModelForCausalLM


    subpart = SubPart.LLM_DECODER
    _check_precision(precision, subpart)
    if int(kv_length) < 1 or int(step) < 1:
        raise BuildPlanError(
            f"static decoder needs kv_length >= 1 and step >= 1, got kv_length={kv_length}, step={step} "
            "(set static_kv_length= / static_step= in the variant's llm_decoder options)"
        )
    kv_length, step = int(kv_length), int(step)
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    bundle_dir = Path(bundle_dir) if bundle_dir is not None else out_dir
    config = _qwen3_config(hf_dir)
    if kv_length + step > config.max_position_embeddings:
        raise BuildPlanError(
            f"static kv_length {kv_length} + step {step} exceeds the model's context of "
            f"{config.max_position_embeddings} positions; lower static_kv_length"
        )
    layers, kv_heads = config.num_hidden_layers, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    hidden = config.hidden_size
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    module = _static_decoder_module(model.model, kv_length)
    past_names = [STATIC_PAST.format(i=i, kind=kind) for i in range(layers) for kind in ("key", "value")]
    input_names = [*STATIC_DECODER_INPUTS, *past_names]
    output_names = [DECODER_OUTPUT, *(STATIC_PRESENT.format(i=i, kind=kind)
                                      for i in range(layers) for kind in ("key", "value"))]
    shapes = {
        "inputs_embeds": [1, step, hidden],
        "attention_mask": [1, kv_length + step],
        "position_ids": [1, step],
        **{n: [1, kv_heads, kv_length, head_dim] for n in past_names},
    }
    example = (
        torch.zeros(1, step, hidden),
        torch.ones(1, kv_length + step, dtype=torch.int64),
        torch.arange(step, dtype=torch.int64)[None],
        *(torch.zeros(*shapes[n]) for n in past_names),
    )
    try:
        with torch.no_grad():
            ov_model = ov.convert_model(module, example_input=example)
    except Exception as exc:
        raise BuildError(f"openvino.convert_model failed on the static decoder of {hf_dir}: {exc}") from exc
    del model, module
    _name_and_shape(ov_model, input_names, output_names, [shapes[n] for n in input_names], "static llm_decoder")
    dynamic = [p.get_any_name() for p in (*ov_model.inputs, *ov_model.outputs) if p.get_partial_shape().is_dynamic]
    if dynamic:
        raise BuildError(f"static llm_decoder: {dynamic} stayed dynamic after reshaping to {shapes}")
    ov_model, settings = _compress(ov_model, precision, group_size, ratio, all_layers, symmetric)
    versions = tool_versions("openvino", "nncf", "transformers", "torch")
    if not settings:
        versions.pop("nncf", None)
    quantization = {**settings, "effective": weight_summary(ov_model)} if settings else {}
    _set_rt_info(ov_model, subpart, precision, quantization, versions)
    xml = out_dir / f"{name}.xml"
    _save(ov_model, xml, precision)
    del ov_model

    return _decoder_result(
        xml, bundle_dir, subpart, precision, settings, quantization, versions,
        exporter="openvino", export_pass=STATIC_DECODER_PASS,
        options={
            "stateful": False,
            "static": True,
            "kv_length": kv_length,
            "step": step,
            "kv_layout": "past_key_values.{i}.key|value [1, kv_heads, kv_length, head_dim] in, "
                         "present.{i}.key|value [1, kv_heads, step, head_dim] out (new positions only)",
            "lm_head": "none",
        },
    )


# ----------------------------------------------------------------------------- sub-parts


def _shapes_from_dynamic_axes(example_inputs: Sequence[Any], input_names: Sequence[str],
                              dynamic_axes: Mapping[str, Any]) -> list[list[int | str]]:
    """``torch.onnx``-style dynamic axes -> one partial shape per input (example sizes elsewhere)."""
    if len(example_inputs) != len(input_names):
        raise BuildError(f"{len(example_inputs)} example inputs given for inputs {list(input_names)}")
    shapes: list[list[int | str]] = []
    for example, input_name in zip(example_inputs, input_names, strict=True):
        shape: list[int | str] = [int(d) for d in example.shape]
        axes = dynamic_axes.get(input_name) or {}
        named = axes.items() if isinstance(axes, Mapping) else ((a, f"{input_name}_dim{a}") for a in axes)
        for axis, label in named:
            if not -len(shape) <= int(axis) < len(shape):
                raise BuildError(f"dynamic axis {axis} of {input_name!r} is outside its rank {len(shape)}")
            shape[int(axis)] = str(label)
        shapes.append(shape)
    return shapes


def _convert_olive(module: torch.nn.Module, example_inputs: tuple, precision: str, settings: Mapping[str, Any],
                   name: str, work: Path) -> tuple[ov.Model, list[str]]:
    from olive.model import PyTorchModelHandler
    from olive.passes.olive_pass import create_pass_from_dict
    from olive.passes.openvino.compression import OpenVINOWeightCompression
    from olive.passes.openvino.conversion import OpenVINOConversion

    handler = PyTorchModelHandler(model_loader=lambda _path: module)
    conversion = create_pass_from_dict(
        OpenVINOConversion,
        {
            # A function, so Olive calls it; it is the only way to give int64 examples.
            "example_input_func": lambda: tuple(example_inputs),
            "static": False,
            "compress_to_fp16": precision == "fp16",
            "model_name": name,
        },
        disable_search=True,
    )
    try:
        converted = conversion.run(handler, str(work / "conversion"))
    except ValueError as exc:
        raise BuildError(
            f"Olive OpenVINOConversion failed for {name} ({exc}); Olive hides the converter's error: "
            "rerun with engine='openvino' to see it"
        ) from exc
    passes = ["OpenVINOConversion"]
    if settings:
        compress_config = {k: v for k, v in settings.items() if k in ("mode", "group_size", "ratio", "all_layers")}
        extra: dict[str, Any] = {}
        if "group_size_fallback_mode" in settings:
            extra["advanced_compression_parameters"] = {
                "group_size_fallback_mode": settings["group_size_fallback_mode"]
            }
        compression = create_pass_from_dict(
            OpenVINOWeightCompression,
            {"compress_config": compress_config, "extra_args": extra or None},
            disable_search=True,
        )
        converted = compression.run(converted, str(work / "compression"))
        passes.append(f"OpenVINOWeightCompression({settings['mode'].upper()})")
    return ov.Core().read_model(converted.model_config["model"]), passes


def _convert_openvino(module: torch.nn.Module, example_inputs: tuple, precision: str,
                      settings: Mapping[str, Any]) -> tuple[ov.Model, list[str]]:
    try:
        model = ov.convert_model(module, example_input=tuple(example_inputs))
    except Exception as exc:
        raise BuildError(f"openvino.convert_model failed: {exc}") from exc
    passes = ["convert_model"]
    if settings:
        model, _ = _compress(model, precision, settings.get("group_size", 128), settings.get("ratio", 1.0),
                             settings.get("all_layers", False), settings.get("mode") == "int4_sym")
        passes.append(f"nncf.compress_weights({settings['mode'].upper()})")
    return model, passes


# ----------------------------------------------------------------------------- static sub-parts (npu)


def _resize(example: torch.Tensor, axis: int, size: int) -> torch.Tensor:
    """Repeat (then cut) an example tensor along ``axis`` to ``size`` positions."""
    import torch

    n = int(example.shape[axis])
    reps = -(-size // n)
    return torch.cat([example] * reps, dim=axis).narrow(axis, 0, size).contiguous()


def _receptive_field(module: torch.nn.Module, example: torch.Tensor, axis: int, out_axis: int) -> int:
    """How far (in input positions along ``axis``) one changed input position changes the output
    (:func:`higgs_pack.runtime.chunking.receptive_reach` on the PyTorch module)."""
    from higgs_pack.exporters.torch_modules import numpy_function
    from higgs_pack.runtime.chunking import NotLocalError, receptive_reach

    try:
        return receptive_reach(numpy_function(module), example.numpy(), axis, out_axis)
    except NotLocalError as exc:
        raise BuildError(f"{exc}; raise the chunk size in static_axes= or give chunk_context= explicitly") from exc


class _StaticPlan:
    """The static-shape options of one sub-part (see ``convert_subpart(static_axes=...)``)."""

    def __init__(self, subpart: SubPart, module: Any, examples: tuple, input_names: list[str],
                 shapes: list[list[int]], chunking: dict[str, Any], wrapper: Any = None) -> None:
        self.subpart, self.module, self.examples = subpart, module, examples
        self.input_names, self.shapes, self.chunking, self.wrapper = input_names, shapes, chunking, wrapper

    @classmethod
    def make(cls, subpart: SubPart, module: Any, example_inputs: Sequence[Any], input_names: list[str],
             output_names: list[str], input_shapes: Sequence[Sequence[int | str | None]] | None,
             dynamic_axes: Mapping[str, Any] | None, static_axes: Mapping[str, int], chunk_context: int | str,
             pad_mask: bool, allow_chunks: bool) -> _StaticPlan:
        import torch

        where = f"{subpart.value}: static_axes={dict(static_axes)}"
        if dynamic_axes is None or input_shapes is None:
            raise BuildPlanError(f"{where} needs dynamic_axes= naming the symbolic axes")
        if len(input_names) != 1 or len(output_names) != 1:
            raise BuildPlanError(f"{where}: static sub-parts take one input and give one output, "
                                 f"got {input_names} -> {output_names}")
        labels = [d for d in input_shapes[0] if isinstance(d, str)]
        missing = sorted(set(labels) - set(static_axes))
        if missing:
            raise BuildPlanError(f"{where} gives no size for axes {missing} of {input_names[0]} {list(input_shapes[0])}")
        if any(not isinstance(v, int) or v < 1 for v in static_axes.values()):
            raise BuildPlanError(f"{where}: sizes must be positive ints")
        shape = [static_axes[d] if isinstance(d, str) else int(d) for d in input_shapes[0]]
        seq = [i for i, d in enumerate(input_shapes[0]) if isinstance(d, str) and d != "batch"]
        out_axes = dynamic_axes.get(output_names[0]) or {}
        out_seq = [int(a) for a, label in (out_axes.items() if isinstance(out_axes, Mapping) else ())
                   if label != "batch"]
        if len(seq) != 1 or len(out_seq) != 1:
            raise BuildPlanError(f"{where}: expected one non-batch symbolic axis on {input_names[0]} and "
                                 f"{output_names[0]}, dynamic_axes are {dict(dynamic_axes)}")
        axis, out_axis = seq[0], out_seq[0]
        chunk = shape[axis]
        example = example_inputs[0]
        for i, size in enumerate(shape):
            example = _resize(example, i, size)
        if chunk_context == "auto":
            context = _receptive_field(module, example, axis, out_axis) + 1 if allow_chunks and chunk > 1 else 0
        else:
            context = int(chunk_context)
        if allow_chunks and context and 2 * context >= chunk:
            raise BuildPlanError(f"{where}: chunk_context {context} leaves no core in a {chunk}-position chunk; "
                                 "raise the static size or lower chunk_context")
        label = input_shapes[0][axis]
        chunking = {"input": input_names[0], "input_axis": axis, "output": output_names[0],
                    "output_axis": out_axis, "context": context, "split": bool(allow_chunks),
                    "valid_input": None}
        names, shapes, examples, wrapper = [input_names[0]], [shape], (example,), None
        if pad_mask:
            wrapper = _pad_masked(module, chunk)
            valid = f"valid_{label}"
            chunking["valid_input"] = valid
            names, shapes = [*names, valid], [*shapes, [1]]
            examples = (example, torch.tensor([chunk], dtype=torch.int64))
        return cls(subpart, wrapper if wrapper is not None else module, examples, names, shapes, chunking, wrapper)

    def traced(self) -> tuple[Any, tuple, list[str], list[list[int]]]:
        """What to convert: module, example inputs (at the static shape), input names and shapes."""
        return self.module, self.examples, self.input_names, self.shapes

    def check_static(self, model: ov.Model) -> None:
        dynamic = [f"{p.get_any_name()} {p.get_partial_shape()}" for p in (*model.inputs, *model.outputs)
                   if p.get_partial_shape().is_dynamic]
        if dynamic:
            raise BuildError(f"{self.subpart.value}: {dynamic} stayed dynamic after reshaping to {self.shapes}")

    def release(self) -> None:
        if self.wrapper is not None:
            self.wrapper.remove_hooks()

    def manifest_options(self, inputs: Sequence[TensorSpec], outputs: Sequence[TensorSpec]) -> dict[str, Any]:
        return {
            "static": True,
            "static_shapes": {t.name: list(t.shape) for t in (*inputs, *outputs)},
            "chunking": dict(self.chunking),
        }


def _pad_masked(module: Any, chunk: int) -> Any:
    """Wrap a one-input convolutional module: ``forward(inputs, valid)`` zeroes every
    Conv1d/ConvTranspose1d input beyond ``valid`` positions of the chunk (scaled to the
    layer's rate, ``length // chunk`` samples per position)."""
    import torch

    class PadMasked(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = module
            self._valid: Any = None
            self._handles = [m.register_forward_pre_hook(self._mask) for m in module.modules()
                             if isinstance(m, (torch.nn.Conv1d, torch.nn.ConvTranspose1d))]
            if not self._handles:
                raise BuildPlanError("pad_mask=True needs a module with Conv1d/ConvTranspose1d layers")

        def _mask(self, _layer: Any, args: tuple) -> tuple | None:
            if self._valid is None:
                return None
            x = args[0]
            length = int(x.shape[-1])
            if length % chunk:
                raise BuildError(f"pad_mask: a convolution input has {length} positions, not a multiple of "
                                 f"the {chunk}-position chunk; this module cannot be masked per layer")
            keep = torch.arange(length) < self._valid * (length // chunk)
            return (x * keep.to(x.dtype), *args[1:])

        def forward(self, inputs: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
            self._valid = valid
            try:
                return self.inner(inputs)
            finally:
                self._valid = None

        def remove_hooks(self) -> None:
            for handle in self._handles:
                handle.remove()

    return PadMasked().eval()


def convert_subpart(
    module: torch.nn.Module,
    example_inputs: tuple,
    *,
    subpart: SubPart | str,
    out_dir: str | Path,
    precision: Precision,
    input_names: Sequence[str] | None = None,
    output_names: Sequence[str] | None = None,
    input_shapes: Sequence[Sequence[int | str | None]] | None = None,
    dynamic_axes: Mapping[str, Any] | None = None,
    name: str | None = None,
    group_size: int = 128,
    ratio: float = 1.0,
    all_layers: bool = True,
    engine: Literal["olive", "openvino"] = "olive",
    bundle_dir: str | Path | None = None,
    work_dir: str | Path | None = None,
    static_axes: Mapping[str, int] | None = None,
    chunk_context: int | Literal["auto"] = 0,
    pad_mask: bool = False,
    allow_chunks: bool = True,
    device_overrides: Mapping[str, str] | None = None,
    symmetric: bool = False,
) -> ExportResult:
    """Convert one small sub-part (embeddings, audio heads, codec) to OpenVINO IR.

    With ``static_axes`` (the ``npu`` variant) every input axis gets a fixed size
    and the manifest options say how the runtime pads or chunks real inputs into
    that shape (``static``, ``static_shapes``, ``chunking``); see
    ``higgs_pack.runtime.openvino_backend.OvStaticSubPart``.

    Args:
        module: The PyTorch module, in eval mode; ``forward`` takes the inputs in
            the order of ``input_names`` and returns the outputs in the order of
            ``output_names`` (a tensor or a tuple).
        example_inputs: One tensor per input, for tracing: int64 for ids/codes
            (``codes`` int64 [batch, frames, 8]), float32 otherwise. Their sizes only
            shape the trace; axes stay dynamic unless ``input_shapes`` fixes them.
        subpart: Which sub-part (``"text_embed"``, ``"audio_embed"``,
            ``"audio_heads"``, ``"audio_tokenizer"``, ``"audio_encoder"``).
        out_dir: Where ``<name>.xml`` / ``<name>.bin`` are written.
        precision: ``"fp32"``, ``"fp16"`` (weights stored as float16), ``"int8"``
            (NNCF INT8_ASYM per channel) or ``"int4"`` (NNCF INT4_ASYM grouped). The
            codec sub-parts accept fp32 only.
        input_names: Graph input names, default ``SUBPART_IO[subpart][0]``.
        output_names: Graph output names, default ``SUBPART_IO[subpart][1]``.
        input_shapes: One shape per input; each axis an int (fixed) or ``None``,
            ``-1`` or a string (dynamic), e.g. ``[[None, None, 8]]`` for ``codes``.
            ``None`` (the default) leaves every axis dynamic. All-int shapes give
            a static IR (see also :func:`reshape_static`).
        dynamic_axes: Alternative to ``input_shapes``, as for ``torch.onnx.export``:
            input name -> ``{axis: symbolic name}`` or a list of axes. Those axes are
            dynamic, every other axis keeps the example's size (``{"codes": {0:
            "batch", 1: "frames"}}`` with a [1, 3, 8] example gives [?, ?, 8]).
            Output entries are ignored (OpenVINO infers output shapes); OpenVINO IR
            keeps no axis names, so the signature says ``"?"``.
        name: File stem (default the sub-part name).
        group_size: int4 only: NNCF group size (adjusted down where it does not divide).
        ratio: int4 only: share of weights in int4, the rest int8.
        all_layers: int4 only: compress every layer to int4 (default ``True``: a
            one-MatMul head would otherwise stay in NNCF's int8 backup).
        engine: ``"olive"`` (Olive's OpenVINOConversion + OpenVINOWeightCompression
            passes) or ``"openvino"`` (``openvino.convert_model`` + ``nncf.compress_weights``).
        bundle_dir: Root the returned file paths are relative to (default ``out_dir``).
        work_dir: Parent of the temporary directory for intermediate IRs (default
            ``out_dir``); it is removed afterwards.
        static_axes: Symbolic axis name (as in ``dynamic_axes``: ``"batch"``,
            ``"sequence"``, ``"frames"``, ``"samples"``) -> fixed size, for every
            symbolic axis of the inputs, e.g. ``{"batch": 1, "frames": 1}``. The
            one non-batch axis is the chunk axis the runtime pads or splits along.
        chunk_context: Static only: input positions of context the runtime adds on
            each side of a chunk when it splits a longer input, then drops from the
            output; ``"auto"`` measures the module's receptive field (perturb one
            position, see how far the output changes) and adds one.
        pad_mask: Static only, single-input convolutional modules (the codec
            decoder): add an int64 [1] input ``valid_<axis>`` and zero every
            Conv1d/ConvTranspose1d input beyond that many positions (scaled to each
            layer's rate), so a zero-padded chunk decodes exactly like the unpadded
            input (every conv sees the zeros its own padding would add).
        allow_chunks: Static only: whether the runtime may split inputs longer than
            the static axis into chunks (False for ``text_embed``: a longer prompt is
            refused with an error naming both lengths).
        device_overrides: Recorded in the manifest: bundle device -> device this
            sub-part is compiled for instead (``{"NPU": "CPU"}`` keeps a dynamic
            sub-part off the NPU).
        symmetric: int4 only: NNCF INT4_SYM instead of INT4_ASYM (NPU bundles).

    Returns:
        An :class:`ExportResult` (``exporter`` ``"olive"`` or ``"openvino"``), with the
        I/O signature read back from the saved IR.

    Raises:
        BuildPlanError: Unknown sub-part, precision or engine, a codec at a
            precision other than fp32, both ``input_shapes`` and ``dynamic_axes``, or
            static options that do not fit the sub-part's axes.
        BuildError: Conversion, compression or renaming failed, or the graph's
            inputs/outputs do not match the names.
    """
    try:
        subpart = SubPart(subpart)
    except ValueError:
        raise BuildPlanError(
            unknown_choice("sub-part", str(subpart), [s.value for s in SubPart], "subpart=")
        ) from None
    if subpart is SubPart.LLM_DECODER:
        raise BuildPlanError("llm_decoder is exported with convert_llm_decoder(), not convert_subpart()")
    _check_precision(precision, subpart)
    if engine not in ENGINES:
        raise BuildPlanError(unknown_choice("OpenVINO conversion engine", engine, ENGINES, "engine="))
    default_in, default_out = SUBPART_IO[subpart]
    input_names = list(input_names or default_in)
    output_names = list(output_names or default_out)
    name = name or subpart.value
    out_dir = Path(out_dir)
    bundle_dir = Path(bundle_dir) if bundle_dir is not None else out_dir
    xml = out_dir / f"{name}.xml"
    settings = _compress_settings(precision, group_size, ratio, all_layers, symmetric)
    if dynamic_axes is not None:
        if input_shapes is not None:
            raise BuildPlanError("pass input_shapes= or dynamic_axes=, not both")
        input_shapes = _shapes_from_dynamic_axes(example_inputs, input_names, dynamic_axes)

    import torch

    module = module.eval()
    static = None
    if static_axes is not None:
        static = _StaticPlan.make(subpart, module, example_inputs, input_names, output_names, input_shapes,
                                  dynamic_axes, static_axes, chunk_context, pad_mask, allow_chunks)
        module, example_inputs, input_names, input_shapes = static.traced()
    elif pad_mask or chunk_context:
        raise BuildPlanError(f"{subpart.value}: pad_mask= and chunk_context= need static_axes=")
    out_dir.mkdir(parents=True, exist_ok=True)
    work_parent = Path(work_dir) if work_dir is not None else out_dir
    work_parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{name}-convert-", dir=work_parent))
    try:
        with torch.no_grad():
            if engine == "olive":
                model, passes = _convert_olive(module, example_inputs, precision, settings, name, work)
            else:
                model, passes = _convert_openvino(module, example_inputs, precision, settings)
        _name_and_shape(model, input_names, output_names, input_shapes, f"{subpart.value} ({engine})")
        if static is not None:
            static.check_static(model)
        versions = tool_versions("openvino", "nncf", "torch", *(("olive-ai",) if engine == "olive" else ()))
        if not settings:
            versions.pop("nncf", None)
        quantization = {**settings, "effective": weight_summary(model)} if settings else {}
        _set_rt_info(model, subpart, precision, quantization, versions)
        _save(model, xml, precision)
        del model
    finally:
        if static is not None:
            static.release()
        shutil.rmtree(work, ignore_errors=True)
    if precision == "fp16":
        passes.append("compress_to_fp16")
    inputs, outputs = ir_io_signature(xml)
    files = _relative_files(xml, bundle_dir)
    options: dict[str, Any] = {
        "engine": engine,
        "input_shapes": [list(sh) for sh in input_shapes] if input_shapes is not None else None,
        "compress_to_fp16": precision == "fp16",
        "weight_storage": weight_summary(xml),
    }
    if static is not None:
        options.update(static.manifest_options(inputs, outputs))
    if device_overrides:
        options["device_overrides"] = dict(device_overrides)
    return ExportResult(
        subpart=subpart,
        format="openvino",
        files=files,
        entry=files[0],
        exporter=engine,
        passes=passes,
        tool_versions=versions,
        precision=precision,
        quantization=quantization,
        inputs=inputs,
        outputs=outputs,
        options=options,
    )


# ----------------------------------------------------------------------------- static shapes


def reshape_static(xml: str | Path, shapes: Mapping[str, Sequence[int]], out_xml: str | Path | None = None) -> Path:
    """Write a copy of an IR with fixed input shapes (for NPU builds).

    NPUs compile static graphs only: for example ``text_embed`` / ``audio_embed`` /
    ``audio_heads`` for one frame (``{"codes": [1, 1, 8]}``) and the codec for a
    fixed chunk of frames. On a stateful decoder only the inputs become static;
    its state keeps dynamic shapes (NPU runs such IRs through the NPUW LLM
    pipeline instead).

    Args:
        xml: The dynamic ``.xml`` file.
        shapes: Input name -> fixed shape (non-negative ints) for every input
            that has a dynamic axis; inputs already static may be left out.
        out_xml: Where to write the static IR (default ``<stem>_static.xml`` beside
            ``xml``). Must differ from ``xml``.

    Returns:
        The path of the written ``.xml`` (its ``.bin`` beside it). Weights are
        saved as they are (no fp16 compression).

    Raises:
        BuildError: ``xml`` is missing, ``out_xml`` equals it, a name is not an input
            (the message lists the inputs), a shape is not all fixed sizes, the
            reshape fails, or an input would stay dynamic.
    """
    xml = Path(xml)
    out_xml = Path(out_xml) if out_xml is not None else xml.with_name(f"{xml.stem}_static.xml")
    if out_xml.resolve() == xml.resolve():
        raise BuildError(f"reshape_static would overwrite {xml} while reading it; pass another out_xml=")
    model = _read(xml)
    names = [p.get_any_name() for p in model.inputs]
    target: dict[str, ov.PartialShape] = {}
    for input_name, shape in shapes.items():
        if input_name not in names:
            raise BuildError(unknown_choice("input", input_name, names, "shapes={name: [dims]}"))
        if not all(isinstance(d, (int, np.integer)) and d >= 0 for d in shape):
            raise BuildError(f"{xml.name}: static shape for {input_name!r} must be non-negative ints, got {shape}")
        target[input_name] = ov.PartialShape([int(d) for d in shape])
    try:
        model.reshape(target)
    except RuntimeError as exc:
        raise BuildError(f"{xml.name}: reshape to {dict(shapes)} failed: {exc}") from exc
    dynamic = [p.get_any_name() for p in model.inputs if p.get_partial_shape().is_dynamic]
    if dynamic:
        raise BuildError(
            f"{xml.name}: inputs {dynamic} are still dynamic; give their shapes in shapes= "
            f"(inputs: {names})"
        )
    out_xml.parent.mkdir(parents=True, exist_ok=True)
    ov.save_model(model, out_xml, compress_to_fp16=False)
    return out_xml

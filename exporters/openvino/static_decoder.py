"""OpenVINO IR export of the fully static, stateless Qwen3 decoder (the ``npu`` variant).

:func:`convert_static_decoder` traces transformers' Qwen3 layers over fixed-size KV
buffers the runtime owns (``higgs_pack.runtime.backends.openvino.static_runners.OvStaticKVDecoder``);
its docstring says why not the stateful IR with NPUW properties.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import openvino as ov

from higgs_pack.errors import BuildError, BuildPlanError
from higgs_pack.exporters.openvino.compression import nncf_compress
from higgs_pack.exporters.openvino.ir import (
    Precision,
    check_precision,
    decoder_result,
    name_and_shape,
    qwen3_config,
    save_ir,
    set_rt_info,
    weight_summary,
)
from higgs_pack.exporters.openvino.plan import DECODER_NNCF, STATIC_DECODER_PASS
from higgs_pack.exporters.result import ExportResult, tool_versions
from higgs_pack.manifests.model import SubPart
from higgs_pack.runtime.backends.openvino.runners import DECODER_OUTPUT

if TYPE_CHECKING:
    import torch


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


# Over 80 lines because of its docstring and one straight conversion (check sizes, build the fixed
# I/O, openvino.convert_model, NNCF, save), whose names, shapes and examples are read together.
def convert_static_decoder(
    hf_dir: str | Path,
    out_dir: str | Path,
    *,
    precision: Precision,
    kv_length: int,
    step: int = 1,
    group_size: int = DECODER_NNCF.group_size,
    ratio: float = DECODER_NNCF.ratio,
    all_layers: bool = DECODER_NNCF.all_layers,
    symmetric: bool = DECODER_NNCF.symmetric,
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
    ``higgs_pack.runtime.backends.openvino.static_runners.OvStaticKVDecoder``).

    Args:
        hf_dir: A standard Qwen3 Hugging Face directory.
        out_dir: Where ``<name>.xml`` / ``.bin`` are written.
        precision: As :func:`~higgs_pack.exporters.openvino.decoder.convert_llm_decoder` (NNCF weight compression).
        kv_length: Positions the KV buffers hold (prompt + generated frames).
        step: Positions per call.
        group_size, ratio, all_layers, symmetric: NNCF settings, as :func:`~higgs_pack.exporters.openvino.decoder.convert_llm_decoder`.
        bundle_dir: Root the returned file paths are relative to (default ``out_dir``).
        name: File stem of the IR.

    Returns:
        An :class:`ExportResult` (``exporter="optimum-openvino"``); ``options`` records
        ``stateful=False``, ``static=True``, ``kv_length``, ``step`` and ``static_shapes``.

    Raises:
        BuildPlanError: Unknown precision, or ``kv_length`` / ``step`` not positive.
        CheckpointError: ``hf_dir`` is not a Qwen3 directory.
        BuildError: Conversion or compression failed, or a shape stayed dynamic.
    """
    import torch
    from transformers import AutoModelForCausalLM


    subpart = SubPart.LLM_DECODER
    check_precision(precision, subpart)
    if int(kv_length) < 1 or int(step) < 1:
        raise BuildPlanError(
            f"static decoder needs kv_length >= 1 and step >= 1, got kv_length={kv_length}, step={step} "
            "(set static_kv_length= / static_step= in the variant's llm_decoder options)"
        )
    kv_length, step = int(kv_length), int(step)
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    bundle_dir = Path(bundle_dir) if bundle_dir is not None else out_dir
    config = qwen3_config(hf_dir)
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
    name_and_shape(ov_model, input_names, output_names, [shapes[n] for n in input_names], "static llm_decoder")
    dynamic = [p.get_any_name() for p in (*ov_model.inputs, *ov_model.outputs) if p.get_partial_shape().is_dynamic]
    if dynamic:
        raise BuildError(f"static llm_decoder: {dynamic} stayed dynamic after reshaping to {shapes}")
    ov_model, settings = nncf_compress(ov_model, precision, group_size, ratio, all_layers, symmetric)
    versions = tool_versions("openvino", "nncf", "transformers", "torch")
    if not settings:
        versions.pop("nncf", None)
    quantization = {**settings, "effective": weight_summary(ov_model)} if settings else {}
    set_rt_info(ov_model, subpart, precision, quantization, versions)
    xml = out_dir / f"{name}.xml"
    save_ir(ov_model, xml, precision)
    del ov_model

    return decoder_result(
        xml, bundle_dir, subpart, precision, settings, quantization, versions,
        export_pass=STATIC_DECODER_PASS,
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

"""OpenVINO IR export of the stateful Qwen3 decoder (``llm_decoder``).

:func:`convert_llm_decoder` uses optimum-intel's OpenVINO
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

With ``static_kv_length`` (the ``npu`` variant) it hands over to
:func:`higgs_pack.exporters.openvino.static_decoder.convert_static_decoder`.
"""

from __future__ import annotations

import gc
import logging
import shutil
import tempfile
from pathlib import Path

import openvino as ov

from higgs_pack.errors import BuildError
from higgs_pack.exporters.openvino.compression import nncf_compress
from higgs_pack.exporters.openvino.ir import (
    Precision,
    check_precision,
    decoder_result,
    is_stateful,
    qwen3_config,
    save_ir,
    set_rt_info,
    weight_summary,
)
from higgs_pack.exporters.openvino.plan import DECODER_EXPORT_PASS, DECODER_NNCF
from higgs_pack.exporters.openvino.static_decoder import convert_static_decoder
from higgs_pack.exporters.process import disk_note
from higgs_pack.exporters.result import ExportResult, tool_versions
from higgs_pack.manifests.model import SubPart
from higgs_pack.runtime.backends.openvino.runners import DECODER_OUTPUT
from higgs_pack.runtime.machine.mapped_pages import paging_out

# The stateful decoder IR's inputs (optimum-intel writes attention_mask, position_ids,
# inputs_embeds, beam_idx) and its single output after renaming: the runtime's names,
# DECODER_INPUTS / DECODER_OUTPUT of higgs_pack.runtime.backends.openvino.runners.


class ExpectedWrapperFallback(logging.Filter):
    """OpenVINO's PyTorch frontend logs ``ERROR ... Failed to build model wrapper.`` on every
    decoder build that succeeds.  What happens (``openvino/frontend/pytorch/utils.py``,
    ``build_wrapper``, OpenVINO 2026.4): a model called with keyword inputs (optimum-intel hands
    ``input_ids``, ``attention_mask``, ``past_key_values``... as a dict) is wrapped in a class
    generated from the text of ``forward``'s signature and ``exec``-ed; the Qwen3 signature's
    annotations name transformers' types, which the ``exec`` namespace lacks, so the wrapper fails
    and the frontend traces the model itself (torch >= 2 traces keyword inputs), as the comment
    there intends.  The IR is then checked against the PyTorch reference (``verify``'s parity).

    The record is an expected step, not an error: dropped from the terminal, said at INFO (``-v``)
    with this reason.  Matched by its logger and its constant message (it carries no exception)."""

    LOGGER = "openvino.frontend.pytorch.utils"
    MESSAGE = "Failed to build model wrapper."

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name != self.LOGGER or record.msg != self.MESSAGE:
            return True
        if not logging.getLogger().isEnabledFor(logging.INFO):
            return False
        record.levelno, record.levelname = logging.INFO, "INFO"
        record.msg = ("OpenVINO's PyTorch frontend could not build its positional wrapper of the decoder (the "
                      "generated code cannot resolve transformers' annotations) and converts the model itself, "
                      "as intended: expected, not an error")
        return True


# Over 80 lines because of its docstring and optimum-intel's steps in order (load in the stored dtype,
# strip the head, export stateful, compress with NNCF while paging out, save): one tool, read whole.
def convert_llm_decoder(
    hf_dir: str | Path,
    out_dir: str | Path,
    *,
    precision: Precision,
    group_size: int = DECODER_NNCF.group_size,
    ratio: float = DECODER_NNCF.ratio,
    all_layers: bool = DECODER_NNCF.all_layers,
    bundle_dir: str | Path | None = None,
    name: str = "llm_decoder",
    work_dir: str | Path | None = None,
    static_kv_length: int | None = None,
    static_step: int = 1,
    symmetric: bool = DECODER_NNCF.symmetric,
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
        An :class:`ExportResult` with ``exporter="optimum-openvino"``, the passes
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
    frontend = logging.getLogger(ExpectedWrapperFallback.LOGGER)
    if not any(isinstance(f, ExpectedWrapperFallback) for f in frontend.filters):  # once a process
        frontend.addFilter(ExpectedWrapperFallback())
    from optimum.exporters.openvino.convert import export_models
    from optimum.exporters.openvino.model_configs import get_vlm_text_generation_config
    from transformers import AutoModelForCausalLM


    subpart = SubPart.LLM_DECODER
    check_precision(precision, subpart)
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    bundle_dir = Path(bundle_dir) if bundle_dir is not None else out_dir
    config = qwen3_config(hf_dir)  # refuses a directory that is not a standard Qwen3 one
    # Load in the stored dtype and let OpenVINO's PyTorch frontend keep 16-bit weights
    # as constants decompressed to f32 in the graph (patch_16bit_model, what
    # `optimum-cli export openvino` does): compute stays f32 on the exact checkpoint
    # weights, while the export holds one 8 GB bf16 copy of the 4B body instead of a
    # 16 GB float32 one (measured peak 21.4 GB before).
    stored = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    stored = getattr(torch, stored) if isinstance(stored, str) else stored
    load_dtype = stored if stored in (torch.bfloat16, torch.float16) else torch.float32
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=load_dtype).eval()
    # The graph takes inputs_embeds and returns hidden states: neither the token embedding nor
    # the (tied) LM head is traced, so both go before export (0.78 GB of bf16 at 4B dims,
    # the margin between this step's measured 12.46 GB peak and the 12 GiB budget).
    model.lm_head = torch.nn.Identity()
    model.model.embed_tokens = None
    gc.collect()
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
        # NNCF and the IR writer read the exported 16-bit weights once, from the memory-mapped
        # .bin; paged out as they go, those pages no longer sit beside the compressed copy
        # (full size, int8: 7.2 GB of them at the step's 11.9 GB peak).
        with paging_out(tmp / f"{name}.bin"):
            ov_model, settings = nncf_compress(ov_model, precision, group_size, ratio, all_layers, symmetric)
            versions = tool_versions("openvino", "nncf", "optimum-intel", "transformers", "torch")
            quantization = {**settings, "effective": weight_summary(ov_model)} if settings else {}
            set_rt_info(ov_model, subpart, precision, quantization, versions)
            save_ir(ov_model, xml, precision)
        del ov_model
    finally:
        shutil.rmtree(tmp, ignore_errors=True)

    return decoder_result(
        xml, bundle_dir, subpart, precision, settings, quantization, versions,
        export_pass=DECODER_EXPORT_PASS,
        options={
            "stateful": True,
            "export_config": "get_vlm_text_generation_config('qwen3', int_dtype='int64', float_dtype='fp32')",
            "lm_head": "identity",
            "weights_loaded_as": str(load_dtype).removeprefix("torch."),
        },
    )

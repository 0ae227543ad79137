"""The ``llm_decoder`` sub-part through onnxruntime-genai's ModelBuilder.

ModelBuilder turns a standard Qwen3 Hugging Face checkpoint into an ONNX decoder
with GroupQueryAttention and (for int4) MatMulNBits.  With ``exclude_embeds=true
exclude_lm_head=true`` the graph takes ``inputs_embeds`` and returns the final-norm
``hidden_states``: the contract of ``llm_decoder`` in MODEL.md.

ModelBuilder runs as a subprocess of its CLI with the current interpreter
(``python -m onnxruntime_genai.models.builder``): in 0.18 calling ``create_model``
from Python without its private ``parse_extra_options`` fails, and the CLI's own
``--help`` crashes, so the CLI with explicit arguments is the stable surface.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from higgs_pack.errors import (
    BuildError,
    BuildPlanError,
    CheckpointError,
    InputError,
    Problem,
    unknown_choice,
)
from higgs_pack.exporters.catalog import MODELBUILDER
from higgs_pack.exporters.onnx import graphs
from higgs_pack.exporters.onnx import kv_quantization as kv
from higgs_pack.exporters.onnx.matmul_nbits import quantize_matmuls, raise_disk_error
from higgs_pack.exporters.process import describe_exit, run_tool
from higgs_pack.exporters.result import ExportResult, installed_version, log_tail
from higgs_pack.manifests.model import SubPart
from higgs_pack.manifests.providers import EXECUTION_PROVIDERS as PROVIDER_ROWS

#: Precisions this exporter builds (ModelBuilder ``-p``).
PRECISIONS = ("fp32", "fp16", "int4")


def modelbuilder_providers() -> tuple[str, ...]:
    """Bundle EP names this exporter builds for: the provider rows that say how
    (``ModelBuilderSupport``: ModelBuilder's ``-e`` name, int4 accuracy_level, workarounds)."""
    return tuple(name for name, row in PROVIDER_ROWS.items() if row.modelbuilder is not None)


#: Options every build passes; they make the graph the ``llm_decoder`` contract.
REQUIRED_EXTRA_OPTIONS: dict[str, str] = {"exclude_embeds": "true", "exclude_lm_head": "true"}
#: Options that would break the contract or produce no model.
FORBIDDEN_EXTRA_OPTIONS = ("config_only", "include_hidden_states")
#: KV cache options the build sets itself from ``kv_cache=`` (with calibrated scales).
KV_CACHE_EXTRA_OPTIONS = ("kv_cache_quant_scheme", "kv_cache_scale_file", "kv_cache_rotation")
#: Execution providers a quantized KV cache is built for: ModelBuilder 0.18 writes one for cpu
#: and cuda; cpu is the one measured and verified here (``python -m bench.ab ort-kv-cache``).
KV_CACHE_PROVIDERS = ("cpu",)
#: ModelBuilder's documented int4 defaults (``--extra_options`` help, 0.18); the
#: recorded values are read back from the graph, these only fill what it omits.
INT4_DEFAULTS: dict[str, Any] = {
    "block_size": 32,
    # accuracy_level: per provider, ModelBuilderSupport.accuracy_level of its row
    "is_symmetric": True,
    "algo_config": "default",
    "op_types_to_quantize": ["MatMul"],
}
#: ``quantization.method`` of an int4 decoder.
INT4_METHOD = "onnxruntime-matmulnbits-streamed"


def _true(value: Any) -> bool:
    """A ModelBuilder boolean option: a bool, or its ``"true"``/``"false"`` string."""
    return value if isinstance(value, bool) else str(value).lower() == "true"


def int4_settings(execution_provider: str, extra_options: Mapping[str, Any] | None) -> dict[str, Any]:
    """The streamed int4 pass's settings, resolved once: the recipe's extra options over
    :data:`INT4_DEFAULTS` and the provider row's ``accuracy_level`` (no heavy import).

    Returns:
        ``{"block_size": int, "accuracy_level": int, "is_symmetric": bool,
        "nodes_to_exclude": [node names]}``: the keywords of
        :func:`~higgs_pack.exporters.onnx.matmul_nbits.quantize_matmuls`.
    """
    options = extra_options or {}
    return {
        "block_size": int(options.get("block_size", INT4_DEFAULTS["block_size"])),
        "accuracy_level": int(options.get("accuracy_level",
                                          PROVIDER_ROWS[execution_provider].modelbuilder.accuracy_level)),
        "is_symmetric": _true(options.get("is_symmetric", INT4_DEFAULTS["is_symmetric"])),
        "nodes_to_exclude": [n for n in str(options.get("nodes_to_exclude", "")).split(",") if n],
    }


def plan(precision: str, options: Any) -> tuple[tuple[str, ...], dict[str, Any]]:
    """``(passes, quantization)`` that :func:`build_llm_decoder` records (no heavy import; for the
    build plan): for int4 every declared setting (block size, accuracy level, symmetry), and for
    a quantized KV cache (``options["kv_cache"]``) its record under ``"kv_cache"`` (precision,
    dtype, scheme, calibration settings and corpus: :func:`~higgs_pack.exporters.onnx.kv_quantization.planned_record`),
    which the build compares with what it reads back from the graph.

    Raises:
        BuildPlanError: an unknown ``kv_cache``.
    """
    ep = options["execution_provider"]
    kv_cache = options.get("kv_cache") or kv.FLOAT
    quantization = _int4_record(ep, int4_settings(ep, options.get("extra_options"))) if precision == "int4" else {}
    record = kv.planned_record(kv_cache)
    if record is not None:
        quantization["kv_cache"] = record
    return passes_for(precision, ep, kv_cache), quantization


def _int4_record(execution_provider: str, settings: Mapping[str, Any]) -> dict[str, Any]:
    """The planned part of an int4 decoder's ``quantization`` record."""
    return {"method": INT4_METHOD, "float_graph": int4_float_base(execution_provider), "bits": 4,
            "block_size": settings["block_size"], "accuracy_level": settings["accuracy_level"],
            "is_symmetric": settings["is_symmetric"]}


#: int4 is built in two steps, so that no step holds the whole float model: ModelBuilder
#: writes the float graph ModelBuilder's own int4 build starts from (its I/O dtype per
#: execution provider: fp32 on cpu, fp16 on cuda and dml; read in builders/base.py,
#: 0.18), then :func:`~higgs_pack.exporters.onnx.matmul_nbits.quantize_matmuls` replaces its
#: MatMuls node by node.  The result is byte-identical to ModelBuilder's in-memory int4
#: build (tests/test_matmul_nbits.py), whose peak was 22.7 GB on the 4B checkpoint.
def int4_float_base(execution_provider: str) -> str:
    """Precision of the float graph an int4 decoder for this provider is quantized from
    (its row's ``ModelBuilderSupport.int4_float_base``)."""
    return PROVIDER_ROWS[execution_provider].modelbuilder.int4_float_base
#: int4 extra options the streamed pass implements (ModelBuilder's names).
INT4_STREAMED_OPTIONS = frozenset({"block_size", "accuracy_level", "is_symmetric", "nodes_to_exclude"})
#: int4 extra options only ModelBuilder's in-memory quantizer implements: refused.
INT4_IN_MEMORY_OPTIONS = frozenset(
    {"algo_config", "matmul_mixed_precision", "op_types_to_quantize", "use_qdq", "int4_algo_config"}
)
#: Name of the streamed quantization pass in the manifest.
STREAMED_INT4_PASS = "MatMulNBits int4 (onnxruntime DefaultWeightOnlyQuantizer, node by node)"


def passes_for(precision: str, execution_provider: str, kv_cache: str = kv.FLOAT) -> tuple[str, ...]:
    """The passes an ``llm_decoder`` build of ``precision`` (and ``kv_cache``) runs, as the
    manifest records them: for a quantized KV cache, first the calibration of its scales on a
    baseline decoder with ModelBuilder's embedding (the tool feeds ``input_ids``), then
    ModelBuilder with ``kv_cache_quant_scheme``."""
    base = int4_float_base(execution_provider) if precision == "int4" else precision
    calibrate: tuple[str, ...] = ()
    graph = f"ModelBuilder({base}, exclude_embeds, exclude_lm_head)"
    if kv_cache != kv.FLOAT:
        scheme = kv.SCHEMES[kv_cache]
        calibrate = (f"ModelBuilder kv_cache_calibration({scheme}, {kv.CALIBRATION['method']} "
                     f"{kv.CALIBRATION['percentile']}) on a {precision} baseline with input_ids",)
        graph = f"ModelBuilder({base}, exclude_embeds, exclude_lm_head, kv_cache_quant_scheme={scheme})"
    return (*calibrate, graph, *((STREAMED_INT4_PASS,) if precision == "int4" else ()))


#: Files ModelBuilder writes that the sub-part keeps besides the graph.
GENAI_CONFIG = "genai_config.json"
#: (execution provider, precision) pairs for which ModelBuilder 0.18 picks the packed
#: ``Attention`` contrib op and writes an invalid graph: the op gets no past/present
#: inputs (``make_packed_attention`` reads ``past_key_values``/``present_key_values``
#: keys that ``make_attention`` never passes), so ``present.{i}.key`` is a graph output
#: no node produces and ONNX Runtime refuses the file ("Graph output (present.0.key)
#: does not exist in the graph"); measured here for cuda and dml at fp32.  For these
#: pairs ModelBuilder runs with packed Attention switched off and falls through to its
#: ``MultiHeadAttention`` path (separate KV cache tensors, ``position_ids`` input),
#: which runs on CPU, CUDA (float and float16 kernels) and DirectML.
#: The pairs are the provider rows' ``ModelBuilderSupport.no_packed_attention``.
def no_packed_attention(execution_provider: str, precision: str) -> bool:
    """Whether ModelBuilder must build this (provider, precision) without packed attention."""
    row = PROVIDER_ROWS[execution_provider].modelbuilder
    return row is not None and precision in row.no_packed_attention

#: Runs ModelBuilder's CLI with ``Model.is_packed_attn_supported`` returning False.
_NO_PACKED_ATTENTION_LAUNCHER = (
    "import runpy\n"
    "import onnxruntime_genai.models  # puts ModelBuilder's own modules on sys.path\n"
    "import builders.base as base\n"
    "if not hasattr(base.Model, 'is_packed_attn_supported'):\n"
    "    raise SystemExit('higgs-pack: this ModelBuilder has no Model.is_packed_attn_supported; '\n"
    "                    'the packed-Attention workaround needs revisiting')\n"
    "base.Model.is_packed_attn_supported = lambda self: False\n"
    "runpy.run_module('onnxruntime_genai.models.builder', run_name='__main__', alter_sys=True)\n"
)


def _format_option(key: str, value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float, str)):
        return str(value)
    raise BuildPlanError(
        f"extra option {key}={value!r} must be a str, int, float or bool (ModelBuilder takes "
        f"KEY=VALUE strings; join lists as ModelBuilder documents, e.g. op_types_to_quantize='MatMul/Gather')."
    )


def _extra_options(extra_options: dict[str, Any] | None) -> dict[str, str]:
    options = {key: _format_option(key, value) for key, value in (extra_options or {}).items()}
    for key, required in REQUIRED_EXTRA_OPTIONS.items():
        if options.get(key, required).lower() != required:
            raise BuildPlanError(
                f"extra option {key}={options[key]} conflicts with the llm_decoder contract "
                f"(inputs_embeds in, hidden_states out), which needs {key}={required}; "
                "drop it from extra_options=."
            )
    for key in FORBIDDEN_EXTRA_OPTIONS:
        if key in options:
            raise BuildPlanError(
                f"extra option {key!r} is not allowed for the llm_decoder sub-part (it changes "
                "the graph's outputs or writes no model); drop it from extra_options=."
            )
    return {**options, **REQUIRED_EXTRA_OPTIONS}





def _run_modelbuilder(
    hf_dir: Path,
    out_dir: Path,
    precision: str,
    execution_provider: str,
    cache_dir: Path,
    options: dict[str, str],
    timeout_s: float | None,
    *,
    log_name: str | None = None,
    stats: dict[str, Any] | None = None,
) -> tuple[Path, Path]:
    """Run ModelBuilder's CLI once; return (graph path, log path).

    ``log_name`` names its log in ``cache_dir`` (default ``modelbuilder-<ep>-<precision>.log``);
    ``stats``, when given, gets its ``seconds`` and ``peak_rss_mb`` (its process tree's peak
    resident memory, MiB).

    Raises:
        BuildError: it failed, timed out, was killed (out of memory) or wrote no graph.
    """
    workaround = no_packed_attention(execution_provider, precision)
    launcher = ["-c", _NO_PACKED_ATTENTION_LAUNCHER] if workaround else ["-m", "onnxruntime_genai.models.builder"]
    command = [
        sys.executable,
        *launcher,
        "-i", str(hf_dir.resolve()),
        "-o", str(out_dir.resolve()),
        "-p", precision,
        "-e", PROVIDER_ROWS[execution_provider].modelbuilder.ep,
        "-c", str(cache_dir.resolve()),
        "--extra_options",
        *(f"{key}={value}" for key, value in options.items()),
    ]  # fmt: skip
    # The checkpoint is local: never let a typo turn into a Hub download.
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    log_path = cache_dir / (log_name or f"modelbuilder-{execution_provider}-{precision}.log")
    run = run_tool(command, log_path, env=env, timeout_s=timeout_s)
    if stats is not None:
        stats.update(seconds=round(run.seconds, 2), peak_rss_mb=round(run.peak_rss_mb, 1))
    if run.returncode is None:
        raise BuildError(
            f"ModelBuilder ({execution_provider}, {precision}) did not finish in {timeout_s} s; "
            f"log {log_path}:\n{log_tail(log_path)}"
        )

    genai_config_path = out_dir / GENAI_CONFIG
    if run.returncode != 0 or not genai_config_path.is_file():
        raise BuildError(
            f"ModelBuilder ({execution_provider}, {precision}) {describe_exit(run.returncode, out_dir)} "
            f"on {hf_dir}; log {log_path}:\n{log_tail(log_path)}"
        )
    genai_config = json.loads(genai_config_path.read_text())
    model_path = out_dir / genai_config["model"]["decoder"]["filename"]
    if not model_path.is_file():
        raise BuildError(
            f"ModelBuilder reported success but {model_path} is missing; log {log_path}:\n"
            f"{log_tail(log_path)}"
        )
    return model_path, log_path


# Over 80 lines because of its docstring (73 of them: the graph it writes and each option); the
# body is ModelBuilder's steps in order (KV calibration, build, repair, record), each already a helper.
def build_llm_decoder(
    hf_dir: Path,
    out_dir: Path,
    *,
    precision: str,
    execution_provider: str,
    cache_dir: Path,
    extra_options: dict[str, Any] | None = None,
    bundle_dir: Path | None = None,
    overwrite: bool = False,
    timeout_s: float | None = None,
    kv_cache: str = kv.FLOAT,
) -> ExportResult:
    """Build the ONNX ``llm_decoder`` with onnxruntime-genai's ModelBuilder.

    The graph has no embedding and no LM head. Inputs: ``inputs_embeds``
    [batch_size, sequence_length, hidden] (float32; float16 for the cuda/dml fp16
    graphs), ``attention_mask`` int64 [batch_size, total_sequence_length],
    ``past_key_values.{i}.key`` / ``.value`` [batch_size, kv_heads,
    past_sequence_length, head_dim] for every layer ``i`` (+ ``position_ids`` on
    dml, and on cuda fp32: see :func:`no_packed_attention`). Outputs: ``hidden_states`` [batch_size, sequence_length, hidden] after
    the final RMSNorm, and ``present.{i}.key`` / ``.value`` [batch_size, kv_heads,
    total_sequence_length, head_dim].

    Writes into ``out_dir``: the graph (``model.onnx`` unless ``extra_options``
    sets ``filename``), its external data (``model.onnx.data``) and
    ``genai_config.json``. The tokenizer files ModelBuilder also writes there are
    removed (the bundle keeps one tokenizer at its root) and listed in
    ``options["removed_files"]``. ModelBuilder's log goes to
    ``cache_dir/modelbuilder-<ep>-<precision>.log``.

    Args:
        hf_dir (`Path`): A standard Qwen3 Hugging Face checkpoint directory
            (``config.json`` with ``model_type: "qwen3"`` and safetensors weights
            named ``model.*``), read offline.
        out_dir (`Path`): Where the sub-part goes, normally ``<bundle>/llm_decoder/``.
            Created if missing; must be empty unless ``overwrite=True``.
        precision (`str`): ``"fp32"``, ``"fp16"`` or ``"int4"`` (ModelBuilder ``-p``).
        execution_provider (`str`): a bundle EP name from :func:`modelbuilder_providers`
            (``cpu``, ``cuda``, ``dml``; ModelBuilder ``-e``); the graph is specialised
            for it (fp16 KV on cuda/dml, ``position_ids`` on dml).
        cache_dir (`Path`): ModelBuilder's scratch directory (``-c``), the int4 float
            graph's and the log's home; must be outside the bundle.
        extra_options (`dict`, *optional*): More ModelBuilder ``--extra_options``,
            for example ``{"block_size": 64, "accuracy_level": 4}`` for int4. Values
            are str, int, float or bool. ``exclude_embeds`` / ``exclude_lm_head``
            are always ``true``.
        bundle_dir (`Path`, *optional*): The bundle root that ``ExportResult.files``
            are relative to. Defaults to ``out_dir.parent``.
        overwrite (`bool`, *optional*, defaults to `False`): Empty a non-empty
            ``out_dir`` first instead of refusing.
        timeout_s (`float`, *optional*): Kill ModelBuilder after this many seconds.
        kv_cache (`str`, *optional*, defaults to ``"float"``): the KV cache's precision:
            ``"float"`` (the graph's I/O dtype) or ``"int8"`` (cpu only: ModelBuilder's
            ``kv_cache_quant_scheme=int8_per_channel`` with scales calibrated by its
            ``kv_cache_calibration`` tool on a baseline of this precision built with the
            embedding kept, on the fixed corpus of :mod:`higgs_pack.exporters.onnx.kv_quantization`;
            the baseline is removed afterwards).  The KV inputs/outputs are then int8
            [batch_size, kv_heads, positions, head_dim] and each GroupQueryAttention node
            takes two float32 scale initializers.

    Returns:
        `ExportResult`: ``subpart="llm_decoder"``, ``exporter="modelbuilder"``,
        ``passes=["ModelBuilder"]``; ``files`` = graph, external data,
        ``genai_config.json``; ``quantization`` (int4) = the ``bits``,
        ``block_size`` and ``accuracy_level`` read from the MatMulNBits nodes, plus
        ``is_symmetric``, ``algo_config`` and the quantized op counts; tool versions
        of onnxruntime-genai, onnxruntime, onnx and transformers.  With a quantized KV
        cache ``quantization["kv_cache"]`` is what the graph holds (precision, dtype,
        scheme, read from its GroupQueryAttention nodes) and how it was calibrated, and
        ``options["kv_cache_calibration"]`` the baseline's and the tool's seconds and peak
        resident memory (MiB).

    Raises:
        BuildPlanError: Unknown precision, execution provider or ``kv_cache``, a KV cache
            extra option (``kv_cache_quant_scheme``...: set ``kv_cache=``), a quantized
            KV cache for a provider other than cpu, a forbidden or malformed extra
            option.
        InputError: a path that cannot be used (a non-empty ``out_dir`` without
            ``overwrite``, ``cache_dir`` inside the bundle), its problem naming the argument;
            raised before anything is written.
        CheckpointError: ``hf_dir`` has no ``config.json``.
        BuildError: ModelBuilder or the calibration failed or timed out (the message ends
            with the tail of its log), or wrote no graph, or its external data points
            outside the bundle, or the graph's KV cache is not the ``kv_cache`` asked for.
    """
    hf_dir, out_dir, cache_dir = Path(hf_dir), Path(out_dir), Path(cache_dir)
    bundle_dir = Path(bundle_dir) if bundle_dir is not None else out_dir.parent
    options = _check_request(hf_dir, out_dir, cache_dir, bundle_dir, precision, execution_provider,
                             extra_options, overwrite, kv_cache)
    int4_options = {k: options.pop(k) for k in list(options) if k in INT4_STREAMED_OPTIONS}
    settings = int4_settings(execution_provider, int4_options)
    calibration: dict[str, Any] = {}
    if kv_cache != kv.FLOAT:
        scale_file, calibration = _calibrate_kv_cache(hf_dir, cache_dir, precision, execution_provider, options,
                                                      settings, kv_cache, timeout_s)
        options = {**options, "kv_cache_quant_scheme": kv.SCHEMES[kv_cache], "kv_cache_scale_file": str(scale_file)}
    if precision == "int4":
        model_path, log_path, kept_float = _build_int4(hf_dir, out_dir, execution_provider, cache_dir, options,
                                                       settings, timeout_s)
    else:
        model_path, log_path = _run_modelbuilder(
            hf_dir, out_dir, precision, execution_provider, cache_dir, options, timeout_s
        )
        kept_float = []
    options = {**options, **int4_options}
    options.pop("kv_cache_scale_file", None)  # a scratch path; the scales are in the graph
    _check_outputs_produced(model_path, log_path)
    repaired = _repair_constant_shapes(model_path)
    files, removed = _keep_sub_part_files(model_path, out_dir, bundle_dir)
    quantization: dict[str, Any] = {}
    if precision == "int4":
        quantization = _int4_quantization(model_path, log_path, execution_provider, settings, options, kept_float)
    kv_record = _check_kv_cache(model_path, kv_cache, log_path)
    if kv_record is not None:
        quantization["kv_cache"] = kv_record
    inputs, outputs = graphs.onnx_io_signature(model_path)
    return ExportResult(
        subpart=SubPart.LLM_DECODER.value,
        format="onnx",
        files=files,
        entry=files[0],
        exporter=MODELBUILDER,
        passes=list(passes_for(precision, execution_provider, kv_cache)),
        tool_versions={
            "onnxruntime-genai": installed_version("onnxruntime-genai"),
            **graphs.onnx_tool_versions(),
            "transformers": installed_version("transformers"),
        },
        precision=precision,
        quantization=quantization,
        inputs=inputs,
        outputs=outputs,
        options={
            "execution_provider": execution_provider,
            "extra_options": options,
            "opset": _opsets(model_path),
            "op_types": graphs.op_type_counts(model_path),
            "removed_files": removed,
            "repaired_value_info": repaired,
            **({"kv_cache_calibration": calibration} if calibration else {}),
            **({"workarounds": ["packed Attention off (ModelBuilder 0.18 writes no present KV with it): "
                                "MultiHeadAttention path"]}
               if no_packed_attention(execution_provider, precision) else {}),
        },
    )


def _check_request(hf_dir: Path, out_dir: Path, cache_dir: Path, bundle_dir: Path, precision: str,
                   execution_provider: str, extra_options: dict[str, Any] | None, overwrite: bool,
                   kv_cache: str = kv.FLOAT) -> dict[str, str]:
    """Validate a :func:`build_llm_decoder` call and prepare its folders; return the extra options
    as ModelBuilder strings (the contract's own included).

    Raises:
        BuildPlanError, CheckpointError: as :func:`build_llm_decoder` documents.
    """
    if precision not in PRECISIONS:
        raise BuildPlanError(
            unknown_choice(
                "precision for ModelBuilder", precision, PRECISIONS, "--precision / precision="
            )
        )
    if execution_provider not in modelbuilder_providers():
        raise BuildPlanError(
            unknown_choice(
                "execution provider for ModelBuilder",
                execution_provider,
                modelbuilder_providers(),
                "--target / execution_provider=",
            )
        )
    kv.check_choice(kv_cache, "kv_cache= (higgs-pack build --kv-cache)")
    if kv_cache != kv.FLOAT and execution_provider not in KV_CACHE_PROVIDERS:
        raise BuildPlanError(
            f"kv_cache={kv_cache!r} is built for execution provider(s) {', '.join(KV_CACHE_PROVIDERS)} only "
            f"(measured and verified there), not {execution_provider!r}; build with kv_cache='float'.")
    options = _extra_options(extra_options)
    set_here = sorted(set(options) & set(KV_CACHE_EXTRA_OPTIONS))
    if set_here:
        raise BuildPlanError(
            f"extra option(s) {set_here} are set by the build from kv_cache= (the scheme, and scales "
            f"calibrated with ModelBuilder's tool); drop them from extra_options= and pass kv_cache= "
            f"({', '.join(kv.CHOICES)}; higgs-pack build --kv-cache).")
    if precision == "int4":
        unsupported = sorted(set(options) & INT4_IN_MEMORY_OPTIONS)
        if unsupported:
            raise BuildPlanError(
                f"extra option(s) {unsupported} need ModelBuilder's in-memory int4 quantizer, which "
                f"holds the whole float model (over 20 GiB for the 4B checkpoint); the streamed int4 "
                f"pass takes {sorted(INT4_STREAMED_OPTIONS)}. Drop them from extra_options=."
            )
    if not (hf_dir / "config.json").is_file():
        raise CheckpointError(
            f"{hf_dir} is not a Hugging Face checkpoint directory (no config.json); pass the "
            "remapped Qwen3 checkpoint as hf_dir=."
        )
    if cache_dir.resolve().is_relative_to(bundle_dir.resolve()):
        raise InputError(problems=[Problem(
            "cache_dir", str(cache_dir), allowed=f"a folder outside the bundle {bundle_dir}",
            fix="ModelBuilder's scratch files would be packaged")])
    if out_dir.exists() and any(out_dir.iterdir()):
        if not overwrite:
            raise InputError(problems=[Problem(
                "out_dir", str(out_dir), allowed="an empty or new folder",
                fix="stale files would mix with the new build; empty it or pass overwrite=True")])
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    cache_dir.mkdir(parents=True, exist_ok=True)
    return options


def _build_int4(hf_dir: Path, out_dir: Path, execution_provider: str, cache_dir: Path, options: dict[str, str],
                settings: dict[str, Any], timeout_s: float | None) -> tuple[Path, Path, list[str]]:
    """The int4 decoder in two steps: ModelBuilder's float graph in scratch, then the streamed
    MatMulNBits pass into ``out_dir`` (with ``genai_config.json``).

    Returns:
        (graph path, ModelBuilder log path, names of the MatMuls kept in float).

    Raises:
        BuildError: ModelBuilder failed, or the disk filled up while quantizing.
    """
    float_precision = int4_float_base(execution_provider)
    float_dir = cache_dir / f"float-{execution_provider}-{float_precision}"
    shutil.rmtree(float_dir, ignore_errors=True)
    float_dir.mkdir(parents=True)
    try:
        float_model, log_path = _run_modelbuilder(
            hf_dir, float_dir, float_precision, execution_provider, cache_dir, options, timeout_s
        )
        model_path = out_dir / float_model.name
        try:
            streamed = quantize_matmuls(float_model, model_path, **settings)
        except OSError as exc:
            raise_disk_error(exc, out_dir)
            raise
        shutil.copyfile(float_dir / GENAI_CONFIG, out_dir / GENAI_CONFIG)
    finally:
        shutil.rmtree(float_dir, ignore_errors=True)
    return model_path, log_path, streamed["kept_float"]


def _calibrate_kv_cache(hf_dir: Path, cache_dir: Path, precision: str, execution_provider: str,
                        options: dict[str, str], settings: dict[str, Any], kv_cache: str,
                        timeout_s: float | None) -> tuple[Path, dict[str, Any]]:
    """Calibrated KV scales for ``kv_cache``: ModelBuilder's calibration tool on a baseline
    decoder of the same checkpoint and precision built with its embedding (``exclude_embeds=false``:
    the tool feeds ``input_ids``) and a float KV cache, which is removed afterwards.

    Returns:
        (the scale file in ``cache_dir``, ``{"baseline": {"seconds", "peak_rss_mb"},
        "calibration": {"seconds", "peak_rss_mb", "tokens"}}``).

    Raises:
        BuildError: ModelBuilder or the tool failed (their logs' tails in the message).
    """
    base_dir = cache_dir / "kv-calibration-baseline"
    shutil.rmtree(base_dir, ignore_errors=True)
    base_dir.mkdir(parents=True)
    baseline_options = {**options, "exclude_embeds": "false"}
    built: dict[str, Any] = {}
    try:
        if precision == "int4":
            float_dir = cache_dir / "kv-calibration-float"
            shutil.rmtree(float_dir, ignore_errors=True)
            float_dir.mkdir()
            try:
                float_model, _ = _run_modelbuilder(
                    hf_dir, float_dir, int4_float_base(execution_provider), execution_provider, cache_dir,
                    baseline_options, timeout_s, log_name="modelbuilder-kv-calibration-baseline.log", stats=built)
                model = base_dir / float_model.name
                try:
                    quantize_matmuls(float_model, model, **settings)
                except OSError as exc:
                    raise_disk_error(exc, base_dir)
                    raise
                shutil.copyfile(float_dir / GENAI_CONFIG, base_dir / GENAI_CONFIG)  # the tool reads head_size there
            finally:
                shutil.rmtree(float_dir, ignore_errors=True)
        else:
            model, _ = _run_modelbuilder(hf_dir, base_dir, precision, execution_provider, cache_dir, baseline_options,
                                         timeout_s, log_name="modelbuilder-kv-calibration-baseline.log", stats=built)
        scale_file = cache_dir / f"kv-scales-{kv.SCHEMES[kv_cache]}.json"
        tool = kv.calibrate(model, hf_dir, scale_file, kv_cache, log_path=cache_dir / "kv-cache-calibration.log",
                            timeout_s=timeout_s)
    finally:
        shutil.rmtree(base_dir, ignore_errors=True)
    return scale_file, {"baseline": built, "calibration": tool}


def _check_kv_cache(model_path: Path, kv_cache: str, log_path: Path) -> dict[str, Any] | None:
    """The graph's ``quantization["kv_cache"]`` record (None: float), refused when it is not the
    ``kv_cache`` asked for (nothing falls back to another KV precision).

    Raises:
        BuildError: naming what was asked and what the graph holds.
    """
    record = kv.graph_record(model_path, kv_cache)
    asked = kv.SCHEMES.get(kv_cache)
    got = record["scheme"] if record else None
    if got != asked:
        raise BuildError(f"ModelBuilder wrote {model_path} with a {got or 'float'} KV cache, but kv_cache={kv_cache!r} "
                         f"asked for {asked or 'a float one'}; log {log_path}")
    return record


def _keep_sub_part_files(model_path: Path, out_dir: Path, bundle_dir: Path) -> tuple[list[str], list[str]]:
    """Remove what ModelBuilder wrote besides the graph, its data and ``genai_config.json``
    (its tokenizer copies: the bundle keeps one at its root).

    Returns:
        (the sub-part's files relative to ``bundle_dir``, graph first; the names removed).
    """
    files = graphs.onnx_files(model_path, bundle_dir)
    genai_config = (out_dir / GENAI_CONFIG).resolve().relative_to(bundle_dir.resolve()).as_posix()
    keep = {*files, genai_config}
    removed: list[str] = []
    for path in sorted(out_dir.iterdir()):
        if path.resolve().relative_to(bundle_dir.resolve()).as_posix() not in keep:
            removed.append(path.name)
            shutil.rmtree(path) if path.is_dir() else path.unlink()
    return [*files, genai_config], removed


def _int4_quantization(model_path: Path, log_path: Path, execution_provider: str, settings: dict[str, Any],
                       options: dict[str, str], kept_float: list[str]) -> dict[str, Any]:
    """The int4 decoder's ``quantization`` record, read back from its MatMulNBits nodes.

    Raises:
        BuildError: the graph has no MatMulNBits node.
    """
    ops = graphs.quantized_ops(model_path)
    if not ops:
        raise BuildError(
            f"ModelBuilder int4 build {model_path} has no MatMulNBits node; log {log_path}:\n"
            f"{log_tail(log_path)}"
        )
    matmul = ops.get("MatMulNBits", {})
    return {
        **_int4_record(execution_provider, settings),
        # What the graph holds (the planned value only where the nodes leave an attribute unset).
        "bits": _single(matmul.get("bits"), 4),
        "block_size": _single(matmul.get("block_size"), settings["block_size"]),
        "accuracy_level": _single(matmul.get("accuracy_level"), settings["accuracy_level"]),
        "algo_config": options.get("algo_config", INT4_DEFAULTS["algo_config"]),
        "quantized_ops": {op: entry["count"] for op, entry in ops.items()},
        "kept_float": kept_float,
    }


def _repair_constant_shapes(model_path: Path) -> list[str]:
    """Give Constant outputs the shape of their value in the graph's ``value_info``.

    ModelBuilder 0.18 declares its 1-D int64 constants (``/model/constant_nodes/INT64/[1]``,
    ``[0, -1, 16]``…) as rank-0 tensors in ``value_info``.  ONNX Runtime ignores that,
    but ``onnx.checker.check_model(full_check=True)`` refuses the graph ("Inferred shape and
    existing shape differ in rank", then every Reshape/Concat fed by one).  Only the
    declared shapes of those Constant outputs change; no node, weight or graph I/O does.

    Returns:
        The names of the tensors whose declared shape was corrected.
    """
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    values = {}
    for node in model.graph.node:
        if node.op_type == "Constant" and not node.domain:
            for attribute in node.attribute:
                if attribute.name == "value" and attribute.HasField("t"):
                    values[node.output[0]] = list(attribute.t.dims)
    repaired: list[str] = []
    for info in model.graph.value_info:
        dims = values.get(info.name)
        if dims is None or not info.type.HasField("tensor_type"):
            continue
        shape = info.type.tensor_type.shape
        declared = [d.dim_value if d.HasField("dim_value") else None for d in shape.dim]
        if declared != dims:
            shape.ClearField("dim")
            for size in dims:
                shape.dim.add().dim_value = size
            repaired.append(info.name)
    if repaired:
        onnx.save_model(model, str(model_path))  # weights stay in the external data file, untouched
    return repaired


def _check_outputs_produced(model_path: Path, log_path: Path) -> None:
    """Refuse a graph whose declared outputs no node produces (ModelBuilder bugs)."""
    import onnx

    graph = onnx.load(str(model_path), load_external_data=False).graph
    produced = {o for node in graph.node for o in node.output}
    produced |= {i.name for i in graph.input} | {i.name for i in graph.initializer}
    orphans = [o.name for o in graph.output if o.name not in produced]
    if orphans:
        raise BuildError(
            f"ModelBuilder wrote {model_path} with graph outputs no node produces: {orphans[:4]} "
            f"(ONNX Runtime would refuse it); log {log_path}. This is a ModelBuilder bug for this "
            "execution provider and precision: build another --precision or --target."
        )


def _single(values: list[Any] | None, default: Any) -> Any:
    """One value if every node agrees, the list if they differ, ``default`` if unset."""
    if not values:
        return default
    return values[0] if len(values) == 1 else values


def _opsets(model_path: Path) -> dict[str, int]:
    import onnx

    model = onnx.load(str(model_path), load_external_data=False)
    return {(entry.domain or "ai.onnx"): int(entry.version) for entry in model.opset_import}

"""The ModelBuilder decoder's quantized KV cache: the choices, their calibration, their record.

What ModelBuilder 0.18 offers (read in onnxruntime_genai/models/builder.py
``check_extra_options`` and builders/base.py ``make_kv_cache_init``):
``--extra_options kv_cache_quant_scheme=`` ``none`` | ``int8_per_tensor`` |
``int8_per_channel`` | ``int4_per_tensor`` | ``int4_per_channel`` | ``fp8_per_tensor`` |
``fp8_per_channel`` (+ ``int8_per_token`` / ``int4_per_token``, CUDA PagedAttention only),
for the CPU and CUDA providers, with ``kv_cache_scale_file=`` a JSON of calibrated
per-layer scales (``{"scales": {"k_scales": [...], "v_scales": [...]}, "qmax": 128,
"layer_ids": [...]}``) that becomes one float32 initializer per layer and key/value.  The
graph's KV inputs and outputs become int8 (uint8, last dimension halved, for int4) and
ModelBuilder's ``genai_config.json`` says ``past_present_share_buffer: false`` on the CPU;
ONNX Runtime 1.32's CPU GroupQueryAttention still writes in place when past and present
are bound to one buffer (measured: bit-identical hidden states either way).

The scales come from ModelBuilder's own tool,
``python -m onnxruntime_genai.models.quantization.kv_cache_calibration``: it runs a
*baseline* ONNX decoder (the same model built without ``kv_cache_quant_scheme``) over
token sequences of a text corpus and takes a percentile (default 99.99), the abs-max or
the MSE-optimal clip of every channel of ``present.*`` (K after RoPE taken as its
rotation-invariant pair norm), divided by 128 for int8.  It needs no torch model and no
dataset download, only the baseline graph and a tokenizer, but it feeds ``input_ids``
and refuses any other input ("Calibration model is missing required input 'input_ids'"),
so it cannot run on the ``llm_decoder`` itself (``inputs_embeds`` in): the build makes a
calibration baseline with ModelBuilder's embedding kept (``exclude_embeds=false``) at the
bundle's precision, calibrates it, and removes it (:mod:`higgs_pack.exporters.onnx.modelbuilder`).
Memory: the baseline's ONNX Runtime session plus the tool's per-layer samples (measured
on the bench preset: 1.9 GB peak, 13 s; most of it importing transformers for the
tokenizer).

The corpus is fixed (:data:`CALIBRATION_TEXTS`, the texts of the project's ``cases``
folder, English and Chinese, then the tool's own English corpus), so a build's scales
depend only on the checkpoint and the tool's version.  It is text only: the audio-frame positions of a TTS sequence (sums of codebook embeddings) are
never seen by the calibration, which is why the build verifies the KV cache and the
hidden states against the oracle before it keeps the bundle.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

from higgs_pack.errors import BuildError, BuildPlanError, unknown_choice
from higgs_pack.exporters.process import describe_exit, run_tool
from higgs_pack.exporters.result import log_tail

#: The ``--kv-cache`` value of a float KV cache (the I/O dtype: float32 on cpu, float16 for
#: cuda/dml fp16 and int4).
FLOAT = "float"
#: ``--kv-cache`` value -> ModelBuilder ``kv_cache_quant_scheme``.  int8 per channel: the
#: tool's and ModelBuilder's documented default; per channel costs no step time over per
#: tensor here (one scale vector per layer) and follows each channel's range.  int4 is not
#: offered: ModelBuilder packs it two per byte, which the runtime does not read.
SCHEMES: dict[str, str] = {"int8": "int8_per_channel"}
#: Every ``--kv-cache`` choice of the ModelBuilder exporter.
CHOICES = (FLOAT, *SCHEMES)
#: The KV cache's element type per choice (ModelBuilder's declared dtype).
DTYPES = {"int8": "int8"}
#: ModelBuilder's calibration tool (run as ``python -m``).
CALIBRATION_TOOL = "onnxruntime_genai.models.quantization.kv_cache_calibration"
#: The tool's settings: its own defaults (percentile 99.99, K by its rotation envelope), and
#: 8 windows of 256 tokens: the corpus (the cases' ~150 tokens and the tool's ~1,700) once.
CALIBRATION: dict[str, Any] = {"method": "percentile", "percentile": 99.99, "target_seq": 256, "num_seqs": 8,
                               "k_rotary_envelope": True}
#: The calibration corpus starts with the texts of ``shared/cases`` (``text_en_basic.txt``,
#: ``text_zh.txt``, ``ref_en_16k.txt``, stripped), kept here so that a build needs no folder
#: outside the package (tests/test_kv_cache.py checks they are the cases' texts), followed by
#: the tool's own corpus (``kv_cache_calibration.CORPUS``: 16 encyclopedic English passages,
#: read from the installed tool when the build runs).  The cases alone are too little: on
#: the bench preset (fp32, 400 teacher-forced audio frames after a case prompt; AMD EPYC,
#: ONNX Runtime 1.32) their scales moved the hidden states by relative L2 0.049 (median) /
#: 0.078 (worst), the tool's corpus added to them by 0.026 / 0.042; more windows of the cases
#: alone did not help (the same 0.078).
CALIBRATION_TEXTS: dict[str, str] = {
    "text_en_basic": "The sun rises in the east and sets in the west. This simple fact has been observed by "
                     "humans for thousands of years.",
    "text_zh": "大家好，欢迎收听本期的跟王老师学AI。今天王老师在忙着洗数据，所以由我，希格斯主播代替他讲这期视频。\n"
               "今天我们要聊的是一个你绝对不能忽视的话题\"多模态学习\"。\n"
               "无论你是开发者，数据科学爱好者，还是只是对人工智能感兴趣的人都一定听说过这个词。它已经成为AI时代的一个研究热点。\n"
               "那么，问题来了，你真的了解多模态吗 你知道如何自己动手构建多模态大模型吗。",
    "ref_en_16k": "The quick brown fox jumps over the lazy dog. Packaging models for every device is hard work.",
}


def check_choice(kv_cache: str, where: str = "--kv-cache / kv_cache=") -> str:
    """``kv_cache`` if it is one of :data:`CHOICES`.

    Raises:
        BuildPlanError: naming the value, the choices and ``where`` it is set.
    """
    if kv_cache not in CHOICES:
        raise BuildPlanError(unknown_choice("KV cache", kv_cache, CHOICES, where))
    return kv_cache


#: The corpus's second part, named as the record names it.
TOOL_CORPUS = "kv_cache_calibration.CORPUS"


def cases_sha256() -> str:
    """sha256 of :data:`CALIBRATION_TEXTS` (a JSON array of the texts, UTF-8)."""
    return hashlib.sha256(json.dumps(list(CALIBRATION_TEXTS.values()), ensure_ascii=False).encode("utf-8")).hexdigest()


def write_corpus(path: Path) -> tuple[Path, str]:
    """The calibration corpus as the tool's ``--corpus-file`` (a JSON array of strings): the
    cases' texts, then the installed tool's own ``CORPUS`` (imports onnxruntime_genai).

    Returns:
        (``path``, sha256 of the file's bytes).
    """
    from onnxruntime_genai.models.quantization.kv_cache_calibration import CORPUS

    text = json.dumps([*CALIBRATION_TEXTS.values(), *CORPUS], ensure_ascii=False)
    path.write_text(text, encoding="utf-8")
    return path, hashlib.sha256(text.encode("utf-8")).hexdigest()


def calibration_record() -> dict[str, Any]:
    """How the scales are calibrated, as the plan and the manifest record it (no heavy import):
    the tool and its version (its corpus is part of the calibration's), its settings, the
    corpus (the cases' names and sha256, and the tool's own corpus)."""
    from higgs_pack.exporters.result import installed_version

    return {"tool": CALIBRATION_TOOL, "tool_version": installed_version("onnxruntime-genai"), **CALIBRATION,
            "corpus": [*(f"cases/{name}.txt" for name in CALIBRATION_TEXTS), TOOL_CORPUS],
            "cases_sha256": cases_sha256()}


def planned_record(kv_cache: str) -> dict[str, Any] | None:
    """The ``quantization["kv_cache"]`` record a decoder built with ``kv_cache`` has (None for
    :data:`FLOAT`: no record): ``{"precision", "dtype", "scheme", "calibration"}``.

    Raises:
        BuildPlanError: an unknown ``kv_cache``.
    """
    if check_choice(kv_cache) == FLOAT:
        return None
    return {"precision": kv_cache, "dtype": DTYPES[kv_cache], "scheme": SCHEMES[kv_cache],
            "calibration": calibration_record()}


def graph_record(model_path: Path, kv_cache: str) -> dict[str, Any] | None:
    """The ``quantization["kv_cache"]`` record of a built decoder, read back from its graph
    (dtype and scheme from its GroupQueryAttention nodes: see
    :func:`higgs_pack.runtime.verification.kv_parity.graph_kv_cache`), with the calibration
    the build ran for ``kv_cache``; None when the graph's KV cache is float.

    The build compares it with :func:`planned_record` (the plan), so a graph whose KV
    cache is not what was asked for is refused, never kept.
    """
    from higgs_pack.runtime.verification.kv_parity import graph_kv_cache

    info = graph_kv_cache(model_path)
    if info is None:
        return None
    precision = next((name for name, dtype in DTYPES.items() if dtype == info["dtype"]), info["dtype"])
    record = {"precision": precision, "dtype": info["dtype"], "scheme": info["scheme"]}
    if kv_cache != FLOAT:
        record["calibration"] = calibration_record()
    return record


def calibrate(baseline_model: Path, tokenizer_dir: Path, out_json: Path, kv_cache: str, *,
              log_path: Path, timeout_s: float | None = None) -> dict[str, Any]:
    """Calibrated scales for ``kv_cache`` with ModelBuilder's tool, run as a child process.

    Args:
        baseline_model: the calibration baseline's ``model.onnx`` (``input_ids`` in, float
            KV, ``genai_config.json`` beside it: the tool reads the head size there).
        tokenizer_dir: a Hugging Face tokenizer folder (the Qwen3 directory).
        out_json: where the tool writes the scale file (ModelBuilder's ``kv_cache_scale_file``).
        kv_cache: one of :data:`SCHEMES`.
        log_path: the tool's log.
        timeout_s: kill it after this many seconds.

    Returns:
        ``{"seconds": wall time, "peak_rss_mb": the tool's peak resident memory (MiB),
        "tokens": tokens calibrated on, "corpus_sha256": of the corpus file it read}``.

    Raises:
        BuildError: the tool failed, timed out, was killed, or wrote no scale file (the
            message ends with its log's tail).
    """
    corpus, corpus_sha = write_corpus(out_json.with_name("kv-calibration-corpus.json"))
    command = [
        sys.executable, "-m", CALIBRATION_TOOL,
        "--model", str(baseline_model.resolve()),
        "--tokenizer", str(tokenizer_dir.resolve()),
        "--out", str(out_json.resolve()),
        "--quant-type", SCHEMES[kv_cache],
        "--method", CALIBRATION["method"],
        "--percentile", str(CALIBRATION["percentile"]),
        "--target-seq", str(CALIBRATION["target_seq"]),
        "--num-seqs", str(CALIBRATION["num_seqs"]),
        "--corpus-file", str(corpus.resolve()),
        *([] if CALIBRATION["k_rotary_envelope"] else ["--no-k-rotary-envelope"]),
    ]  # fmt: skip
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    run = run_tool(command, log_path, env=env, timeout_s=timeout_s)
    if run.returncode is None:
        raise BuildError(f"the KV cache calibration did not finish in {timeout_s} s; log {log_path}:\n"
                         f"{log_tail(log_path)}")
    if run.returncode != 0 or not out_json.is_file():
        raise BuildError(f"the KV cache calibration ({CALIBRATION_TOOL}) {describe_exit(run.returncode, out_json.parent)} "
                         f"on {baseline_model}; log {log_path}:\n{log_tail(log_path)}")
    return {"seconds": round(run.seconds, 2), "peak_rss_mb": round(run.peak_rss_mb, 1),
            "tokens": CALIBRATION["target_seq"] * CALIBRATION["num_seqs"], "corpus_sha256": corpus_sha}

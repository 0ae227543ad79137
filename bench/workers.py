"""The measuring side of the benchmark: each task runs in its own interpreter (``--worker``),
so every system gets its own peak RSS; timings of one generation loop, bandwidth.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

from bench.systems import (
    CONTEXT_ROUNDS,
    CONTEXT_STEPS,
    DEFAULT_BANDWIDTH_MIB,
    DEFAULT_CONTEXTS,
    PYTORCH,
    peak_rss_mb,
    rss_now_mb,
)
from higgs_pack.exporters.result import tool_versions
from higgs_pack.runtime.backends import registered


class _TimedRunner:
    """Wraps a ``SubPartRunner`` and records the seconds of every ``run``."""

    def __init__(self, inner: Any, log: list[float], after: Callable[[dict], dict] | None = None):
        self.inner, self.log, self.after = inner, log, after

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        t = time.perf_counter()
        out = self.inner.run(feeds)
        if self.after is not None:
            out = self.after(out)
        self.log.append(time.perf_counter() - t)
        return out


class _TimedDecoder:
    """Wraps a ``Decoder`` and records the seconds of every ``forward``."""

    def __init__(self, inner: Any, log: list[float]):
        self.inner, self.log = inner, log

    @property
    def max_length(self) -> int:
        return self.inner.max_length

    def reset(self) -> None:
        self.inner.reset()

    def forward(self, inputs_embeds: np.ndarray) -> np.ndarray:
        t = time.perf_counter()
        out = self.inner.forward(inputs_embeds)
        self.log.append(time.perf_counter() - t)
        return out


def _instrument(pipeline: Any) -> dict[str, list[float]]:
    """Time the sub-parts of ``pipeline`` in place; suppress EOC so the frame count is fixed.

    The EOC logit of codebook 0 is set to a large negative finite value (not -inf: the loop
    rejects non-finite logits), which keeps the random bench models from stopping early.
    """
    logs: dict[str, list[float]] = {"decoder": [], "heads": [], "embed": [], "text_embed": [], "codec": []}
    eoc = pipeline.constants.eoc

    def no_eoc(out: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        logits = out["audio_logits"]
        if not logits.flags.writeable:
            logits = logits.copy()
        logits[..., 0, eoc] = -1e30
        return {**out, "audio_logits": logits}

    pipeline.decoder = _TimedDecoder(pipeline.decoder, logs["decoder"])
    pipeline.audio_heads = _TimedRunner(pipeline.audio_heads, logs["heads"], no_eoc)
    pipeline.audio_embed = _TimedRunner(pipeline.audio_embed, logs["embed"])
    pipeline.text_embed = _TimedRunner(pipeline.text_embed, logs["text_embed"])
    pipeline.audio_tokenizer = _TimedRunner(pipeline.audio_tokenizer, logs["codec"])
    return logs


def _one_run(pipeline: Any, logs: dict[str, list[float]], text: str, frames: int,
             options: Any) -> tuple[dict[str, Any], np.ndarray]:
    """One prompt -> loop -> codec decode, with per-step timestamps; returns the numbers and
    the codes (int64 [frames, N])."""
    from higgs_pack.runtime.loop.generate import build_prompt, decode_codes, generate_codes

    for log in logs.values():
        log.clear()
    marks: list[float] = []
    t_start = time.perf_counter()
    embeds = build_prompt(pipeline, text)
    result = generate_codes(pipeline, embeds, options, frames,
                            progress=lambda done, cap: marks.append(time.perf_counter()))
    t_gen = time.perf_counter()
    samples = decode_codes(pipeline, result.codes)
    t_end = time.perf_counter()
    n = pipeline.constants.num_codebooks
    steps = len(marks)
    if result.stop_reason != "max_frames" or result.codes.shape[0] != frames:
        raise RuntimeError(f"expected {frames} frames at the cap, got {result.codes.shape[0]} "
                           f"({result.stop_reason})")
    decode_s = marks[-1] - marks[0]
    dec = logs["decoder"]
    # decoder calls: prefill + one per later step; embed calls: one per later step;
    # heads calls: one per step (the first belongs to the prefill frame).
    per_step = {
        "decoder": sum(dec[1:]),
        "heads": sum(logs["heads"][1:]),
        "embed": sum(logs["embed"]),
    }
    per_step["other"] = decode_s - sum(per_step.values())
    audio_s = len(samples) / pipeline.constants.sample_rate
    return {
        "steps": steps,
        "frames": int(result.codes.shape[0]),
        "prompt_length": int(result.prompt_length),
        "frames_per_s": (steps - 1) / decode_s,
        "first_frame_ms": (marks[0] - t_start) * 1e3,
        "first_full_frame_ms": (marks[min(n, steps) - 1] - t_start) * 1e3,
        "prefill_ms": dec[0] * 1e3,
        "prompt_embed_ms": sum(logs["text_embed"]) * 1e3,
        "outside_decoder_frac": 1.0 - per_step["decoder"] / decode_s,
        "step_ms": {k: v / (steps - 1) * 1e3 for k, v in per_step.items()},
        "loop_s": result.seconds,
        "codec_s": t_end - t_gen,
        "wall_s": t_end - t_start,
        "audio_s": audio_s,
        "rtf": (t_end - t_start) / audio_s,
    }, result.codes


def _stream_run(pipeline: Any, logs: dict[str, list[float]], text: str, frames: int, options: Any,
                codes: np.ndarray) -> dict[str, Any]:
    """The same request through the streaming API (:func:`higgs_pack.runtime.loop.streaming.stream`,
    default chunk schedule), with EOC suppressed as in :func:`_one_run`.

    Returns:
        ``first_audio_ms`` (the ``stream`` call to the first chunk, :attr:`SpeechStream.first_audio_s`),
        ``stream_chunk_frames`` (the first chunk's frames), ``stream_context_frames`` (codec
        context per side), ``first_audio_steps`` (decoder steps run before the first chunk),
        ``first_chunk_codec_ms`` (codec decodes before the first chunk), the stream's own
        ``first_audio_prompt_embed_ms``, ``first_audio_prefill_ms`` and ``first_audio_steps_ms``
        (the span of the decode steps after the prefill up to the first chunk), ``stream_frames_per_s``
        (decode steps per second between the first and the last step, chunk decodes included,
        as ``frames_per_s``), ``stream_codes_match`` (the streamed codes equal ``codes``).

    Raises:
        RuntimeError: the stream stopped before ``frames`` frames.
    """
    from higgs_pack.runtime.loop.streaming import FIRST_CHUNK_FRAMES, stream

    for log in logs.values():
        log.clear()
    marks: list[float] = []
    first_steps, first_codec_s = None, 0.0
    speech = stream(pipeline, text, options=options, max_frames=frames,
                    progress=lambda done, cap: marks.append(time.perf_counter()))
    first_parts = (0.0, 0.0, 0.0)
    for _chunk in speech:
        if first_steps is None:
            first_steps, first_codec_s = len(marks), sum(logs["codec"])
            first_parts = (sum(logs["text_embed"]), logs["decoder"][0], marks[-1] - marks[0])
    got = speech.codes
    if got.shape[0] != frames:
        raise RuntimeError(f"the stream gave {got.shape[0]} frames, expected {frames}")
    return {
        "first_audio_ms": speech.first_audio_s * 1e3,
        "stream_chunk_frames": FIRST_CHUNK_FRAMES,
        "stream_context_frames": int(speech.context_frames),
        "first_audio_steps": first_steps,
        "first_chunk_codec_ms": first_codec_s * 1e3,
        "first_audio_prompt_embed_ms": first_parts[0] * 1e3,
        "first_audio_prefill_ms": first_parts[1] * 1e3,
        "first_audio_steps_ms": first_parts[2] * 1e3,
        "stream_frames_per_s": (len(marks) - 1) / (marks[-1] - marks[0]),
        "stream_codes_match": bool(np.array_equal(got, codes)),
    }


def _decoder_only(decoder: Any, prompt: np.ndarray, step: np.ndarray, steps: int) -> dict[str, float]:
    """The bare decoder (the pipeline's own ``Decoder``: its bindings and KV handling) driven
    like the loop drives it, with nothing else: a prefill of ``prompt`` (float32 [1, P, H]),
    then ``steps - 1`` one-position forwards of the fixed ``step`` (float32 [1, 1, H]), as
    many as the loop's timed steps.

    Returns:
        ``decoder_only_frames_per_s``: those forwards per second (prefill excluded).
    """
    decoder.reset()
    decoder.forward(prompt)
    t = time.perf_counter()
    for _ in range(steps - 1):
        decoder.forward(step)
    return {"decoder_only_frames_per_s": (steps - 1) / (time.perf_counter() - t)}


def context_steps(decoder: Any, prompt: np.ndarray, step: np.ndarray, contexts: list[int],
                   steps: int = CONTEXT_STEPS, rounds: int = CONTEXT_ROUNDS) -> dict[str, float]:
    """The bare decoder's step time at each context length ``L`` in ``contexts``.

    ``rounds`` times, the lengths in turn (so that a machine that slows down or speeds up
    meanwhile weighs on every length alike): a prefill of ``L`` positions (the rows of
    ``prompt`` repeated), one untimed step, then ``steps`` timed one-position forwards of
    ``step`` (attending to ``L + 2`` … ``L + steps + 1`` positions). Lengths the decoder
    cannot hold are skipped.

    Returns:
        ``step_ms_ctx<L>``: the median of the ``rounds * steps`` timed steps, milliseconds.
    """
    lengths = [n for n in contexts if n + steps + 1 <= decoder.max_length]
    times: dict[int, list[float]] = {n: [] for n in lengths}
    for _ in range(rounds):
        for length in lengths:
            decoder.reset()
            decoder.forward(np.resize(prompt[0], (length, prompt.shape[-1]))[None].astype(np.float32))
            decoder.forward(step)
            for _ in range(steps):
                t = time.perf_counter()
                decoder.forward(step)
                times[length].append(time.perf_counter() - t)
    return {f"step_ms_ctx{n}": statistics.median(times[n]) * 1e3 for n in lengths}


def kv_itemsize(decoder: Any) -> int | None:
    """Bytes per element of the decoder's KV cache, read from the loaded decoder.

    ONNX Runtime: the type of its ``past_key_values.*`` inputs; OpenVINO: those inputs' type
    for the static (NPU) decoder, else the stateful model's compiled ``KV_CACHE_PRECISION`` (u8 by default on x86; the per-group scales it adds are
    not counted); the PyTorch reference (``TorchDecoder``): 4, its layers run in float32
    whatever the checkpoint's dtype. None when unknown.
    """
    session = getattr(decoder, "session", None)
    if session is not None:
        from higgs_pack.runtime.backends.onnxruntime.sessions import ORT_TYPES

        past = [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]
        return int(np.dtype(ORT_TYPES[past[0].type]).itemsize) if past else None
    compiled = getattr(decoder, "compiled", None)
    if compiled is not None:
        past = [p for p in compiled.inputs if p.get_any_name().startswith("past_key_values.")]
        if past:  # the static (NPU) decoder: the cache is an input, read whole every step
            return int(past[0].get_element_type().size)
        try:
            return int(compiled.get_property("KV_CACHE_PRECISION").size)
        except Exception:  # the device has no such property (NPU, GPU plugins differ)
            return None
    if type(decoder).__name__ == "TorchDecoder":
        return 4
    return None


def kv_bytes_per_position(constants: Any, itemsize: int | None) -> int | None:
    """KV cache bytes one position holds (read once per later step): key and value, every
    layer, ``2 * num_layers * num_key_value_heads * head_dim * itemsize``; None if the
    itemsize is unknown."""
    if itemsize is None:
        return None
    return 2 * constants.num_layers * constants.num_key_value_heads * constants.head_dim * itemsize


def _median_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-metric median over runs (nested ``step_ms`` too), plus the frames/s spread."""
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        if isinstance(value, dict):
            out[key] = {k: statistics.median(r[key][k] for r in runs) for k in value}
        elif isinstance(value, float):
            out[key] = statistics.median(r[key] for r in runs)
        else:
            out[key] = value
    fps = [r["frames_per_s"] for r in runs]
    out["frames_per_s_min"], out["frames_per_s_max"] = min(fps), max(fps)
    out["repeats"] = len(runs)
    return out


def load_bundle(spec: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Open (validate, hash) and load a bundle; returns the pipeline and timings."""
    from higgs_pack.runtime.sources.bundle import load_pipeline as load
    from higgs_pack.runtime.sources.bundle import open_bundle

    backend = registered()[spec["backend"]]
    t0 = time.perf_counter()  # imports are reported apart: they are not model loading
    for module in ("tokenizers", *backend.modules):
        importlib.import_module(module)
    import_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    opened = open_bundle(spec["bundle"])
    t1 = time.perf_counter()
    kwargs: dict[str, Any] = {}
    if spec.get("device"):
        kwargs[backend.placement] = spec["device"]
    if backend.compile_cache:
        kwargs["cache_dir"] = spec["ov_cache"]
    pipeline = load(opened, **kwargs)
    t2 = time.perf_counter()
    info = {"load_s": t2 - t0, "validate_s": t1 - t0, "import_s": import_s,
            "description": dict(pipeline.description),
            "versions": tool_versions("onnxruntime", "openvino")}
    return pipeline, info


def _load_pytorch(spec: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    t0 = time.perf_counter()
    import torch
    import transformers

    from higgs_pack.exporters.checkpoint.reader import open_checkpoint
    from higgs_pack.exporters.pytorch.reference import reference_pipeline

    for name in ("Qwen3Model", "HiggsAudioV2TokenizerModel", "DynamicCache"):
        getattr(transformers, name, None)  # transformers imports these lazily (seconds)
    import_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    ckpt = open_checkpoint(spec["checkpoint"])
    pipeline = reference_pipeline(ckpt, with_encoder=False)
    load_s = time.perf_counter() - t0
    decoder = pipeline.decoder.model
    decoder_bytes = sum(p.numel() * p.element_size() for n, p in decoder.named_parameters()
                        if "embed_tokens" not in n)
    info = {"load_s": load_s, "import_s": import_s, "decoder_weight_bytes": int(decoder_bytes),
            "torch_threads": torch.get_num_threads(),
            "versions": tool_versions("torch", "transformers")}
    return pipeline, info


def worker_measure(spec: dict[str, Any]) -> dict[str, Any]:
    """Measure one system in this process (run as ``--worker``): load, warm up, timed runs."""
    from higgs_pack.runtime.loop.delay import SamplingOptions

    loadavg = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    pipeline, info = (_load_pytorch if spec["kind"] == PYTORCH else load_bundle)(spec)
    info["rss_after_load_mb"] = rss_now_mb()
    if spec.get("load_only"):
        info["peak_rss_mb"] = peak_rss_mb()
        return info
    bare = pipeline.decoder
    logs = _instrument(pipeline)
    options = SamplingOptions(temperature=spec["temperature"], top_k=spec["top_k"], top_p=1.0,
                              seed=spec["seed"], repeat_guard_frames=0)
    text, frames = spec["text"], spec["frames"]
    # fixed decoder inputs: the bench prompt, and the embedding of one frame of BOC codes
    from higgs_pack.runtime.loop.generate import build_prompt

    c = pipeline.constants
    prompt = build_prompt(pipeline, text).astype(np.float32)
    step = pipeline.audio_embed.run({"codes": np.full((1, 1, c.num_codebooks), c.boc, dtype=np.int64)})
    step = np.array(step["audio_embeds"], dtype=np.float32, copy=True)  # runners may return views they reuse
    # a bundle that does not record its codec context has it measured once per pipeline, on the
    # first stream: done here, so no timed first audio includes it (even with --warmup 0)
    from higgs_pack.runtime.loop.streaming import codec_context_frames

    codec_context_frames(pipeline)
    for _ in range(spec["warmup"]):
        _, codes = _one_run(pipeline, logs, text, frames, options)
        _stream_run(pipeline, logs, text, frames, options, codes)
        _decoder_only(bare, prompt, step, frames + c.num_codebooks - 1)
    runs = []
    for _ in range(spec["repeats"]):  # the three ways side by side in every repeat
        run, codes = _one_run(pipeline, logs, text, frames, options)
        run.update(_stream_run(pipeline, logs, text, frames, options, codes))
        run.update(_decoder_only(bare, prompt, step, run["steps"]))
        runs.append(run)
    out = {**info, **_median_runs(runs)}
    out["stream_codes_match"] = all(r["stream_codes_match"] for r in runs)
    out["loop_over_decoder"] = out["decoder_only_frames_per_s"] / out["frames_per_s"]
    out.update(context_steps(bare, prompt, step, list(spec.get("contexts", DEFAULT_CONTEXTS))))
    itemsize = kv_itemsize(bare)
    out.update({"kv_itemsize": itemsize, "kv_bytes_per_position": kv_bytes_per_position(c, itemsize)})
    # the 1-minute load average before and after: other work on the machine skews timings
    after = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {**out, "peak_rss_mb": peak_rss_mb(), "loadavg_1m": [loadavg, after]}


def worker_checkpoint(spec: dict[str, Any]) -> dict[str, Any]:
    from higgs_pack.targets.build import default_checkpoint

    t0 = time.perf_counter()
    path = default_checkpoint(spec["preset"], spec["seed"])
    return {"checkpoint": str(path), "seconds": time.perf_counter() - t0, "peak_rss_mb": peak_rss_mb()}


def worker_build(spec: dict[str, Any]) -> dict[str, Any]:
    from higgs_pack.targets.build import build

    t0 = time.perf_counter()
    out = build(spec["target"], precision=spec["precision"], model=spec["checkpoint"],
                out=spec["out"], variant=spec["variant"], force=True,
                progress=lambda msg: print(f"  [build {spec['label']}] {msg}", file=sys.stderr, flush=True))
    return {"bundle": str(out), "seconds": time.perf_counter() - t0, "peak_rss_mb": peak_rss_mb()}


def measure_bandwidth(mib: int = DEFAULT_BANDWIDTH_MIB, repeats: int = 5,
                      threads: int | None = None) -> dict[str, float]:
    """Memory bandwidth with numpy over a buffer far larger than the caches.

    Read: a float64 sum over the buffer (split across ``threads``, numpy releases the GIL);
    copy: ``copyto`` into a second buffer, counted as bytes read + written. Best of ``repeats``.

    Returns:
        ``bandwidth_gbps`` (the best read rate, used for the roofline), ``bandwidth_read_gbps``
        (read, all threads), ``bandwidth_read_1t_gbps`` (read, one thread),
        ``bandwidth_copy_gbps`` (copy, all threads), ``bandwidth_buffer_mib``,
        ``bandwidth_threads``; GB = 1e9 bytes.
    """
    threads = threads or os.cpu_count() or 1
    n = mib * 2**20 // 8
    src = np.ones(n, dtype=np.float64)
    dst = np.zeros(n, dtype=np.float64)
    bounds = np.linspace(0, n, threads + 1, dtype=np.int64)
    parts = [slice(int(a), int(b)) for a, b in itertools.pairwise(bounds)]

    def best(fn: Callable[[], Any], nbytes: int) -> float:
        fn()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return nbytes / min(times) / 1e9

    with ThreadPoolExecutor(threads) as pool:
        read = best(lambda: list(pool.map(lambda s: src[s].sum(), parts)), src.nbytes)
        copy = best(lambda: list(pool.map(lambda s: np.copyto(dst[s], src[s]), parts)), 2 * src.nbytes)
    read_1t = best(lambda: src.sum(), src.nbytes)
    # the roofline uses the best read rate: on a busy machine one thread can beat two
    return {"bandwidth_gbps": max(read, read_1t), "bandwidth_read_gbps": read,
            "bandwidth_read_1t_gbps": read_1t, "bandwidth_copy_gbps": copy,
            "bandwidth_buffer_mib": mib, "bandwidth_threads": threads}


def worker_bandwidth(spec: dict[str, Any]) -> dict[str, Any]:
    return measure_bandwidth(spec["mib"])


#: Worker tasks (``spawn(task, ...)``) -> the ``module:function`` that runs one in its process.
WORKERS: dict[str, str] = {
    "measure": "bench.workers:worker_measure", "checkpoint": "bench.workers:worker_checkpoint",
    "build": "bench.workers:worker_build", "bandwidth": "bench.workers:worker_bandwidth",
    "batch": "bench.batch:measure_batches", "fit": "bench.batch:fit_run",
    "our_steps": "bench.decoder_steps:measure_our_steps", "llama_steps": "bench.decoder_steps:measure_llama_steps",
}


def run_worker(spec_file: str) -> int:
    """Entry of ``--worker SPEC.json``: run the task, write its JSON result to ``spec["result"]``."""
    spec = json.loads(Path(spec_file).read_text())
    module, _, function = WORKERS[spec["task"]].partition(":")
    result = getattr(importlib.import_module(module), function)(spec)
    Path(spec["result"]).write_text(json.dumps(result))
    return 0



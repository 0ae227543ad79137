"""One system measured in its own process: the generation loop, the same request streamed, the
bare decoder, its step at each context, the memory bandwidth."""

from __future__ import annotations

import importlib
import itertools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from bench.common.systems import PYTORCH, load_1m, median_of, peak_rss_mb, rss_mb
from bench.decoder.gemm import PREFILL_LENGTHS
from higgs_pack.exporters.result import tool_versions
from higgs_pack.runtime.backends import registered

#: Timed steps per context and round of the bare decoder's step; rounds over the contexts in turn
#: (a shared 2-core VM drifted up to 30% between runs, which one block per length misread).
CONTEXT_STEPS = 8
CONTEXT_ROUNDS = 3
#: Rounds of the prefill timings (every length in turn each round, fastest kept) and of the
#: first audio per voice kind (issue 32 item 1, issue 30 item 4).
PREFILL_ROUNDS = 2
VOICE_ROUNDS = 2
#: The voice kinds of ``first_audio_ms_by_voice``: no voice, a reference clip encoded per request,
#: a named (prepared) voice's codes with no prefix cache, and with its prefix's KV cached.
VOICE_KINDS = ("zero_shot", "clip", "named", "named_cached")


class _Timed:
    """A runner (``run``) or decoder (``forward``) whose calls' seconds go to ``log``; ``after``
    rewrites each output inside the timing."""

    def __init__(self, inner: Any, log: list[float], after: Callable[[dict], dict] | None = None):
        self.inner, self.log, self.after = inner, log, after

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def _timed(self, call: Callable[[Any], Any], x: Any) -> Any:
        t = time.perf_counter()
        out = call(x)
        out = self.after(out) if self.after else out
        self.log.append(time.perf_counter() - t)
        return out

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self._timed(self.inner.run, feeds)

    def forward(self, inputs_embeds: np.ndarray) -> np.ndarray:
        self.positions.append(int(inputs_embeds.shape[1]))
        return self._timed(self.inner.forward, inputs_embeds)

    @property
    def positions(self) -> list[int]:
        """Positions of each ``forward`` call, beside ``log``."""
        return self.__dict__.setdefault("_positions", [])


def no_eoc(eoc: int) -> Callable[[dict], dict]:
    """An audio-heads output filter: codebook 0's EOC logit set to -1e30 (finite: the loop rejects
    -inf), so the random bench models run their frame cap."""
    def apply(out: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        logits = out["audio_logits"] if out["audio_logits"].flags.writeable else out["audio_logits"].copy()
        logits[..., 0, eoc] = -1e30
        return {**out, "audio_logits": logits}

    return apply


def _instrument(pipeline: Any) -> dict[str, list[float]]:
    """Time the sub-parts of ``pipeline`` in place and suppress EOC; returns the logs."""
    logs: dict[str, list[float]] = {k: [] for k in ("decoder", "heads", "embed", "text_embed", "codec")}
    pipeline.decoder = _Timed(pipeline.decoder, logs["decoder"])
    pipeline.audio_heads = _Timed(pipeline.audio_heads, logs["heads"], no_eoc(pipeline.constants.eoc))
    pipeline.audio_embed = _Timed(pipeline.audio_embed, logs["embed"])
    pipeline.text_embed = _Timed(pipeline.text_embed, logs["text_embed"])
    pipeline.audio_tokenizer = _Timed(pipeline.audio_tokenizer, logs["codec"])
    if getattr(pipeline, "audio_tokenizer_stream", None) is not None:  # the stateful streaming codec: streams run it
        pipeline.audio_tokenizer_stream = _Timed(pipeline.audio_tokenizer_stream, logs["codec"])
    return logs


def _one_run(pipeline: Any, logs: dict[str, list[float]], text: str, frames: int,
             options: Any) -> tuple[dict[str, Any], np.ndarray]:
    """Prompt, loop and codec decode timed step by step; the figures and the codes (int64 [frames, N])."""
    from higgs_pack.runtime.loop.codec import decode_codes
    from higgs_pack.runtime.loop.decode import generate_codes
    from higgs_pack.runtime.loop.prompt import build_prompt

    for log in logs.values():
        log.clear()
    marks: list[float] = []
    t_start = time.perf_counter()
    result = generate_codes(pipeline, build_prompt(pipeline, text), options, frames,
                            progress=lambda done, cap: marks.append(time.perf_counter()))
    t_gen = time.perf_counter()
    samples = decode_codes(pipeline, result.codes)
    t_end = time.perf_counter()
    if result.stop_reason != "max_frames" or result.codes.shape[0] != frames:
        raise RuntimeError(f"expected {frames} frames at the cap, got {result.codes.shape[0]} ({result.stop_reason})")
    steps, decode_s = len(marks), marks[-1] - marks[0]
    # decoder and heads: the prefill's call first; embed: one call per later step
    per_step = {"decoder": sum(logs["decoder"][1:]), "heads": sum(logs["heads"][1:]), "embed": sum(logs["embed"])}
    per_step["other"] = decode_s - sum(per_step.values())
    audio_s = len(samples) / pipeline.constants.sample_rate
    return {
        "steps": steps, "frames": int(result.codes.shape[0]), "prompt_length": int(result.prompt_length),
        "frames_per_s": (steps - 1) / decode_s, "first_frame_ms": (marks[0] - t_start) * 1e3,
        "first_full_frame_ms": (marks[min(pipeline.constants.num_codebooks, steps) - 1] - t_start) * 1e3,
        "prefill_ms": logs["decoder"][0] * 1e3, "prompt_embed_ms": sum(logs["text_embed"]) * 1e3,
        "outside_decoder_frac": 1.0 - per_step["decoder"] / decode_s,
        "step_ms": {k: v / (steps - 1) * 1e3 for k, v in per_step.items()},
        "loop_s": result.seconds, "codec_s": t_end - t_gen, "wall_s": t_end - t_start, "audio_s": audio_s,
        "rtf": (t_end - t_start) / audio_s,
    }, result.codes


def _stream_run(pipeline: Any, logs: dict[str, list[float]], text: str, frames: int, options: Any,
                codes: np.ndarray) -> dict[str, Any]:
    """The same request through ``streaming.stream``: first audio (ms from the call) and its parts
    (prompt embedding, prefill, steps, codec), the first chunk, frames/s, codes equal to ``codes``.
    ``first_chunk_codec_ms`` is all the codec's time until the first audio; with the stateful codec
    fed before the chunk is due (``Pipeline.codec_feed_frames``) ``first_chunk_codec_fed_ms`` of it
    ran between the steps, inside ``first_audio_steps_ms``."""
    from higgs_pack.runtime.loop.streaming import FIRST_CHUNK_FRAMES, stream

    for log in logs.values():
        log.clear()
    marks: list[tuple[float, float]] = []  # (time, codec seconds so far) per step
    first: tuple[float, ...] | None = None
    speech = stream(pipeline, text, options=options, max_frames=frames,
                    progress=lambda done, cap: marks.append((time.perf_counter(), sum(logs["codec"]))))
    for _chunk in speech:
        if first is None:
            first = (len(marks), sum(logs["codec"]), sum(logs["text_embed"]), logs["decoder"][0],
                     marks[-1][0] - marks[0][0], marks[-1][1] - marks[0][1])
    if speech.codes.shape[0] != frames:
        raise RuntimeError(f"the stream gave {speech.codes.shape[0]} frames, expected {frames}")
    steps, codec, embed, prefill, span, fed = first
    return {
        "first_audio_ms": speech.first_audio_s * 1e3, "stream_chunk_frames": FIRST_CHUNK_FRAMES,
        "stream_context_frames": int(speech.context_frames), "first_audio_steps": steps,
        "stream_lookahead_frames": int(speech.lookahead_frames or 0),
        "first_chunk_codec_ms": codec * 1e3, "first_chunk_codec_fed_ms": fed * 1e3,
        "first_audio_prompt_embed_ms": embed * 1e3,
        "first_audio_prefill_ms": prefill * 1e3, "first_audio_steps_ms": span * 1e3,
        "stream_frames_per_s": (len(marks) - 1) / (marks[-1][0] - marks[0][0]),
        "stream_codes_match": bool(np.array_equal(speech.codes, codes)),
    }


def _decoder_only(decoder: Any, prompt: np.ndarray, step: np.ndarray, steps: int) -> dict[str, float]:
    """The pipeline's own decoder alone: a prefill of ``prompt`` [1, P, H], then ``steps - 1``
    forwards of ``step`` [1, 1, H]; ``decoder_only_frames_per_s`` (prefill excluded)."""
    decoder.reset()
    decoder.forward(prompt)
    t = time.perf_counter()
    for _ in range(steps - 1):
        decoder.forward(step)
    return {"decoder_only_frames_per_s": (steps - 1) / (time.perf_counter() - t)}


def context_steps(decoder: Any, prompt: np.ndarray, step: np.ndarray, contexts: list[int],
                  steps: int = CONTEXT_STEPS, rounds: int = CONTEXT_ROUNDS) -> dict[str, float]:
    """``step_ms_ctx<L>``: the median ms of ``rounds * steps`` one-position steps after a prefill of
    ``L`` positions (``prompt``'s rows repeated), the lengths in turn each round; lengths the
    decoder cannot hold are skipped."""
    lengths = [n for n in contexts if n + steps + 1 <= decoder.max_length]
    times: dict[int, list[float]] = {n: [] for n in lengths}
    for _ in range(rounds):
        for length in lengths:
            decoder.reset()
            decoder.forward(np.resize(prompt[0], (length, prompt.shape[-1]))[None].astype(np.float32))
            decoder.forward(step)  # untimed
            for _ in range(steps):
                t = time.perf_counter()
                decoder.forward(step)
                times[length].append(time.perf_counter() - t)
    return {f"step_ms_ctx{n}": statistics.median(times[n]) * 1e3 for n in lengths}


def fastest_prefills(ready: Callable[[int], Callable[[], Any]], lengths: Sequence[int], rounds: int
                     ) -> dict[str, Any]:
    """``prefill_positions_per_s`` ``{"L": L / s}`` and ``prefill_ms_by_length`` (ms) of the call
    ``ready(L)`` returns (its set-up untimed), fastest of ``rounds`` with the lengths in turn."""
    best: dict[int, float] = {}
    for _ in range(max(1, rounds)):
        for length in lengths:
            call = ready(length)
            t = time.perf_counter()
            call()
            best[length] = min(best.get(length, math.inf), time.perf_counter() - t)
    return {"prefill_positions_per_s": {str(n): round(n / s, 2) for n, s in best.items()},
            "prefill_ms_by_length": {str(n): round(s * 1e3, 1) for n, s in best.items()}}


def prefill_rates(decoder: Any, prompt: np.ndarray, lengths: list[int], rounds: int = PREFILL_ROUNDS
                  ) -> dict[str, Any]:
    """:func:`fastest_prefills` of ``decoder`` for prefills of ``prompt``'s rows [1, P, H] repeated to
    each length into an empty KV cache (the first round also meets each shape once); lengths the
    decoder cannot hold are left out."""
    def ready(length: int) -> Callable[[], Any]:
        decoder.reset()
        x = np.resize(prompt[0], (length, prompt.shape[-1]))[None].astype(np.float32)
        return lambda: decoder.forward(x)

    out = fastest_prefills(ready, [n for n in lengths if n + 1 <= decoder.max_length], rounds)
    decoder.reset()
    return out


def _prefix_cache(pipeline: Any, bundle: str | None) -> tuple[Any, str | None]:
    """A fresh voice prefix cache for ``pipeline`` (:mod:`higgs_pack.runtime.loop.prefix_cache`,
    keyed as ``TTS`` keys one) and None, or None and why there is none."""
    if bundle is None:
        return None, "PyTorch: no prefix cache"
    try:
        from higgs_pack.runtime.loop.prefix_cache import PrefixCache, bundle_identity, prefix_layout
    except ImportError:
        return None, "this runtime has no voice prefix cache"
    if prefix_layout(pipeline.decoder) is None:
        return None, getattr(pipeline.decoder, "prefix_refusal", "the decoder does not export its KV cache")
    from higgs_pack.manifests.manifest import read_manifest

    return PrefixCache(bundle_identity(read_manifest(bundle), pipeline.description.get("llm_decoder", ""))), None


def first_audio_by_voice(pipeline: Any, logs: dict[str, list[float]], text: str, frames: int, options: Any,
                         clip: str | None, transcript: str | None, rounds: int = VOICE_ROUNDS,
                         bundle: str | None = None) -> dict[str, Any]:
    """First streamed audio (ms from the ``stream`` call) per :data:`VOICE_KINDS`, fastest of
    ``rounds`` (the kinds in turn): ``zero_shot``; ``clip``, the reference ``clip`` (a file) and its
    ``transcript`` read and encoded by the bundle's codec per request; ``named``, its codes encoded
    once beforehand (a prepared voice) with no prefix cache; ``named_cached``, the same with the
    voice prefix's KV cache warm (one untimed request first; the ``bundle`` path keys it).  Also
    each kind's ``voice_prompt_positions`` and ``voice_prefill_ms`` (the positions the decoder
    prefilled: after a cache hit, the prompt past the prefix), ``first_audio_vs_zero_shot``, the
    cache's ``voice_cache_stats`` (hits, misses, bytes) and, where
    ``named_cached`` is missing, ``voice_cache`` (why).  Without a clip, or a pipeline without an
    audio encoder (PyTorch here), only ``zero_shot``."""
    from higgs_pack.runtime.loop.codec import encode_reference
    from higgs_pack.runtime.loop.streaming import stream
    from higgs_pack.runtime.request import Voice

    c = pipeline.constants
    kinds: dict[str, dict[str, Any]] = {"zero_shot": {}}
    if clip and transcript and getattr(pipeline, "audio_encoder", None) is not None:
        samples = Voice(clip, transcript).prepared(c.sample_rate, c.hop_length)
        kinds["clip"] = {"ref_samples": samples, "ref_text": transcript}
        kinds["named"] = {"ref_codes": encode_reference(pipeline, samples), "ref_text": transcript}
    caches: dict[str, Any] = {kind: None for kind in kinds}
    cache, why = _prefix_cache(pipeline, bundle) if "named" in kinds else (None, None)
    if cache is not None:
        kinds["named_cached"], caches["named_cached"] = kinds["named"], cache
    best: dict[str, float] = {}
    positions: dict[str, int] = {}
    prefill: dict[str, float] = {}
    decoder = pipeline.decoder

    def first(kind: str) -> Any:
        pipeline.prefix_cache = caches[kind]
        try:
            speech = stream(pipeline, text, options=options, max_frames=frames, **kinds[kind])
            next(speech)
            speech.close()
        finally:
            pipeline.prefix_cache = None
        return speech

    if cache is not None:
        first("named_cached")  # untimed: the miss that fills the cache
    for _ in range(max(1, rounds)):
        for kind in kinds:
            for log in logs.values():
                log.clear()
            decoder.positions.clear()
            speech = first(kind)
            ms = speech.first_audio_s * 1e3
            if ms < best.get(kind, math.inf):
                best[kind], positions[kind] = ms, decoder.positions[0]
                prefill[kind] = logs["decoder"][0] * 1e3
    zero = best["zero_shot"]
    return {"first_audio_ms_by_voice": {k: round(v, 1) for k, v in best.items()},
            "voice_prompt_positions": positions, "voice_prefill_ms": {k: round(v, 1) for k, v in prefill.items()},
            "first_audio_vs_zero_shot": {k: round(v / zero, 3) for k, v in best.items()},
            "voice_clip": clip if len(kinds) > 1 else None,
            **({"voice_cache_stats": dict(vars(cache.stats))} if cache is not None else
               {"voice_cache": why} if why else {})}


def kv_itemsize(decoder: Any) -> int | None:
    """Bytes per KV cache element of a loaded decoder: ONNX Runtime's ``past_key_values.*`` input
    type, OpenVINO's (static decoder) or its compiled ``KV_CACHE_PRECISION``, 4 for PyTorch's
    float32 layers; None when unknown."""
    session = getattr(decoder, "session", None)
    if session is not None:
        from higgs_pack.runtime.backends.onnxruntime.sessions import ORT_TYPES

        past = [i for i in session.get_inputs() if i.name.startswith("past_key_values.")]
        return int(np.dtype(ORT_TYPES[past[0].type]).itemsize) if past else None
    compiled = getattr(decoder, "compiled", None)
    if compiled is not None:
        past = [p for p in compiled.inputs if p.get_any_name().startswith("past_key_values.")]
        if past:
            return int(past[0].get_element_type().size)
        try:
            return int(compiled.get_property("KV_CACHE_PRECISION").size)
        except Exception:  # a plugin without the property
            return None
    return 4 if type(decoder).__name__ == "TorchDecoder" else None


def kv_bytes_per_position(constants: Any, itemsize: int | None) -> int | None:
    """Key and value of every layer: ``2 * layers * kv_heads * head_dim * itemsize``."""
    if itemsize is None:
        return None
    return 2 * constants.num_layers * constants.num_key_value_heads * constants.head_dim * itemsize


def fixed_inputs(pipeline: Any, text: str) -> tuple[np.ndarray, np.ndarray]:
    """The bench prompt's embeddings (float32 [1, P, H]) and one frame of BOC codes embedded [1, 1, H]."""
    from higgs_pack.runtime.loop.prompt import build_prompt

    c = pipeline.constants
    step = pipeline.audio_embed.run({"codes": np.full((1, 1, c.num_codebooks), c.boc, dtype=np.int64)})
    # runners may return views of buffers they reuse
    return build_prompt(pipeline, text).astype(np.float32), np.array(step["audio_embeds"], np.float32, copy=True)


def load_bundle(spec: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    """Open (validate, hash) and load a bundle: the pipeline and ``load_s``, ``validate_s``, ``import_s``."""
    from higgs_pack.runtime.sources.bundle import load_pipeline, open_bundle

    backend = registered()[spec["backend"]]
    t0 = time.perf_counter()  # imports apart: they are not model loading
    for module in ("tokenizers", *backend.modules):
        importlib.import_module(module)
    t1 = time.perf_counter()
    opened = open_bundle(spec["bundle"])
    t2 = time.perf_counter()
    kwargs: dict[str, Any] = {backend.placement: spec["device"]} if spec.get("device") else {}
    if backend.compile_cache:
        kwargs["cache_dir"] = spec["ov_cache"]
    pipeline = load_pipeline(opened, **kwargs)
    return pipeline, {"load_s": time.perf_counter() - t1, "validate_s": t2 - t1, "import_s": t1 - t0,
                      "description": dict(pipeline.description), "versions": tool_versions("onnxruntime", "openvino")}


def _load_pytorch(spec: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    t0 = time.perf_counter()
    import torch
    import transformers

    from higgs_pack.exporters.checkpoint.reader import open_checkpoint
    from higgs_pack.exporters.pytorch.reference import reference_pipeline

    for name in ("Qwen3Model", "HiggsAudioV2TokenizerModel", "DynamicCache"):
        getattr(transformers, name, None)  # imported lazily (seconds)
    t1 = time.perf_counter()
    pipeline = reference_pipeline(open_checkpoint(spec["checkpoint"]), with_encoder=False)
    weights = sum(p.numel() * p.element_size() for n, p in pipeline.decoder.model.named_parameters()
                  if "embed_tokens" not in n)
    return pipeline, {"load_s": time.perf_counter() - t1, "import_s": t1 - t0, "decoder_weight_bytes": int(weights),
                      "torch_threads": torch.get_num_threads(), "versions": tool_versions("torch", "transformers")}


def worker_measure(spec: dict[str, Any]) -> dict[str, Any]:
    """The ``measure`` worker: load, warm up, then ``repeats`` times the loop, the stream and the
    bare decoder side by side (medians), the context steps and the KV bytes."""
    from higgs_pack.runtime.loop.codec import codec_context_frames
    from higgs_pack.runtime.options import SamplingOptions

    before = load_1m()
    pipeline, info = (_load_pytorch if spec["kind"] == PYTORCH else load_bundle)(spec)
    info["rss_after_load_mb"] = rss_mb()
    if spec.get("load_only"):
        return {**info, "peak_rss_mb": peak_rss_mb()}
    bare, c = pipeline.decoder, pipeline.constants
    prompt, step = fixed_inputs(pipeline, spec["text"])
    logs = _instrument(pipeline)
    options = SamplingOptions(temperature=spec["temperature"], top_k=spec["top_k"], top_p=1.0, seed=spec["seed"],
                              repeat_guard_frames=0)
    text, frames = spec["text"], spec["frames"]
    codec_context_frames(pipeline)  # measured once per pipeline where the bundle lacks it: not in a timed run
    for _ in range(spec["warmup"]):
        _, codes = _one_run(pipeline, logs, text, frames, options)
        _stream_run(pipeline, logs, text, frames, options, codes)
        _decoder_only(bare, prompt, step, frames + c.num_codebooks - 1)
    runs = []
    for _ in range(spec["repeats"]):
        run, codes = _one_run(pipeline, logs, text, frames, options)
        run.update(_stream_run(pipeline, logs, text, frames, options, codes))
        run.update(_decoder_only(bare, prompt, step, run["steps"]))
        runs.append(run)
    fps = [r["frames_per_s"] for r in runs]
    out = {**info, **median_of(runs), "frames_per_s_min": min(fps), "frames_per_s_max": max(fps),
           "repeats": len(runs)}
    out["loop_over_decoder"] = out["decoder_only_frames_per_s"] / out["frames_per_s"]
    out.update(context_steps(bare, prompt, step, list(spec["contexts"])))
    out.update(prefill_rates(bare, prompt, list(spec.get("prefill_lengths", PREFILL_LENGTHS)),
                             spec.get("prefill_rounds", PREFILL_ROUNDS)))
    out.update(first_audio_by_voice(pipeline, logs, text, frames, options, spec.get("voice_clip"),
                                    spec.get("voice_transcript"), spec.get("voice_rounds", VOICE_ROUNDS),
                                    spec.get("bundle")))
    itemsize = kv_itemsize(bare)
    return {**out, "kv_itemsize": itemsize, "kv_bytes_per_position": kv_bytes_per_position(c, itemsize),
            "peak_rss_mb": peak_rss_mb(), "loadavg_1m": [before, load_1m()]}


def worker_checkpoint(spec: dict[str, Any]) -> dict[str, Any]:
    from higgs_pack.targets.build import default_checkpoint

    t0 = time.perf_counter()
    path = default_checkpoint(spec["preset"], spec["seed"])
    return {"checkpoint": str(path), "seconds": time.perf_counter() - t0, "peak_rss_mb": peak_rss_mb()}


def worker_build(spec: dict[str, Any]) -> dict[str, Any]:
    from higgs_pack.targets.build import build

    t0 = time.perf_counter()
    out = build(spec["target"], precision=spec["precision"], model=spec["checkpoint"], out=spec["out"],
                variant=spec["variant"], force=True,
                progress=lambda msg: print(f"  [build {spec['label']}] {msg}", file=sys.stderr, flush=True))
    return {"bundle": str(out), "seconds": time.perf_counter() - t0, "peak_rss_mb": peak_rss_mb()}


def measure_bandwidth(mib: int = 1024, repeats: int = 5, threads: int | None = None
                      ) -> dict[str, float]:
    """numpy over a buffer far past the caches, best of ``repeats`` (GB = 1e9 bytes): read (a sum,
    split over ``threads``; and on one thread) and copy (read + written); ``bandwidth_gbps`` is the
    best read, the roofline's."""
    threads = threads or os.cpu_count() or 1
    n = mib * 2**20 // 8
    src, dst = np.ones(n, dtype=np.float64), np.zeros(n, dtype=np.float64)
    parts = [slice(int(a), int(b)) for a, b in itertools.pairwise(np.linspace(0, n, threads + 1, dtype=np.int64))]

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
    return {"bandwidth_gbps": max(read, read_1t), "bandwidth_read_gbps": read, "bandwidth_read_1t_gbps": read_1t,
            "bandwidth_copy_gbps": copy, "bandwidth_buffer_mib": mib, "bandwidth_threads": threads}


def worker_bandwidth(spec: dict[str, Any]) -> dict[str, Any]:
    return measure_bandwidth(spec["mib"])

"""The batching side of the benchmark (``--batch 1,2,4,8``): one bundle's continuous-batching
engine (:meth:`higgs_pack.TTS.engine`) measured at several batch sizes in one process
(:func:`measure_batches`, run as the ``batch`` worker of :mod:`~bench.workers`).

For every batch size ``B`` the engine refuses (OpenVINO's npu variant or a device other than
CPU, cuda or dml: its ``InputError``), the row says why and carries no number.  For the others, ``repeats`` rounds
take the sizes in turn (a machine that slows down meanwhile weighs on every size alike), each
size with a fresh engine per run, after ``warmup`` untimed plain and streamed runs per size:

* **plain**: ``B`` requests of the same text and frame cap submitted together to
  ``tts.engine(max_batch=B)``, read with ``handle.result()`` (the codec runs after the codes);
* **streamed**: the same, every handle iterated on its own thread (the engine's codec thread
  decodes their windows while the engine steps, those due together in one batched run);
* **join**: ``B - 1`` requests running (a few steps after they all started), then one more
  submitted and iterated: its first streamed chunk's time (``SpeechStream.first_audio_s``,
  from ``submit``); the running ones are not read meanwhile (their codec does not run);
* **bare**: the engine's own batched decoder after the plain run (the same object, bindings
  and buffers), ``B`` rows prefilled with the same prompt and stepped as many times as the
  engine stepped, with nothing else.

As in the single-request runs, EOC is suppressed and the repeat guard is off, so every
request runs exactly its frame cap.
"""

from __future__ import annotations

import os
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from bench.systems import peak_rss_mb, rss_now_mb
from bench.workers import kv_bytes_per_position, kv_itemsize

#: Decoder steps the ``B - 1`` running requests take with all of them on their rows before
#: the joining request is submitted.
JOIN_AFTER_STEPS = 3
#: Seconds the join run waits for those steps before it gives up (a stuck engine).
JOIN_WAIT_S = 120.0


class _HeadsProbe:
    """Wraps the audio-heads runner: one ``(time, rows)`` mark per call (the engine calls it
    once per step, for all busy rows, at the step's start) and EOC suppressed as in the
    single-request runs (a large negative finite logit)."""

    def __init__(self, inner: Any, eoc: int, marks: list[tuple[float, int]]):
        self.inner, self.eoc, self.marks = inner, eoc, marks

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.marks.append((time.perf_counter(), int(feeds["hidden_states"].shape[0])))
        out = self.inner.run(feeds)
        logits = out["audio_logits"]
        if not logits.flags.writeable:
            logits = logits.copy()
        logits[..., 0, self.eoc] = -1e30
        return {**out, "audio_logits": logits}


def full_batch_rate(marks: list[tuple[float, int]], batch: int) -> tuple[float | None, int]:
    """Frames per second over the steps that ran all ``batch`` rows, and how many did.

    The steps with every row busy are contiguous (the requests join, run the same number of
    steps, then leave): between the first and the last of them ``batch`` frames are made per
    step, prefills and leaving excluded, as ``frames_per_s`` excludes the prefill.

    Returns:
        ``(frames_per_s, full_steps)``; frames_per_s None when fewer than two steps were full.
    """
    full = [t for t, rows in marks if rows == batch]
    if len(full) < 2:
        return None, len(full)
    return batch * (len(full) - 1) / (full[-1] - full[0]), len(full)


def _stats(engine: Any) -> dict[str, float]:
    s = engine.stats
    return {"steps": s.steps, "frames": s.frames, "step_seconds": s.step_seconds,
            "prefill_seconds": s.prefill_seconds}


def _request(spec: dict[str, Any], index: int, frames: int) -> dict[str, Any]:
    return {"seed": spec["seed"] + index, "temperature": spec["temperature"], "top_k": spec["top_k"],
            "top_p": 1.0, "max_frames": frames}


def _check_frames(codes: np.ndarray, frames: int, what: str) -> None:
    if codes.shape[0] != frames:
        raise RuntimeError(f"{what}: expected {frames} frames at the cap, got {codes.shape[0]}")


def _engine_run(tts: Any, batch: int, spec: dict[str, Any], marks: list[tuple[float, int]], *,
                streamed: bool) -> tuple[dict[str, Any], Any, list[np.ndarray]]:
    """One plain or streamed run of ``batch`` requests on a fresh engine; returns its figures,
    the (closed) engine and each request's codes."""
    frames, text = spec["frames"], spec["text"]
    marks.clear()
    with tts.engine(max_batch=batch) as engine:
        t0 = time.perf_counter()
        handles = [engine.submit(text, **_request(spec, i, frames)) for i in range(batch)]
        if streamed:
            def read(handle: Any) -> np.ndarray:
                speech = iter(handle)
                for _chunk in speech:
                    pass
                return speech.codes

            with ThreadPoolExecutor(batch) as pool:
                codes = list(pool.map(read, handles))
            t_end = time.perf_counter()
        else:
            for handle in handles:
                handle.wait()
            t_end = time.perf_counter()
            codes = [handle.result().codes for handle in handles]  # the codec, after the timed part
        kv_in_use = engine.stats.max_kv_bytes_in_use
    stats = _stats(engine)  # the thread has stopped: final figures
    for i, c in enumerate(codes):
        _check_frames(c, frames, f"batch {batch}, request {i}")
    rate, full_steps = full_batch_rate(marks, batch)
    out = {
        "aggregate_frames_per_s": rate,
        "engine_step_ms": stats["step_seconds"] / stats["steps"] * 1e3,
        "engine_steps": stats["steps"],
        "full_batch_steps": full_steps,
        "joined_together": bool(marks) and marks[0][1] == batch,
        "wall_frames_per_s": stats["frames"] / (t_end - t0),
        "prefill_ms": stats["prefill_seconds"] / batch * 1e3,
        # None where the engine cannot say its KV bytes per position (it then counts none)
        "max_kv_bytes_in_use": int(kv_in_use) if engine.kv_bytes_per_position is not None else None,
    }
    return out, engine, codes


def _join_run(tts: Any, batch: int, spec: dict[str, Any], marks: list[tuple[float, int]]) -> dict[str, Any]:
    """First streamed audio of a request joining ``batch - 1`` running ones (alone at batch 1)."""
    frames, text = spec["frames"], spec["text"]
    from higgs_pack.runtime.loop.streaming import FIRST_CHUNK_FRAMES, codec_context_frames

    # the running ones outlast the joiner's way to its first chunk (then they are cancelled):
    # its prefill, the first chunk, the codec's right context and the delay ramp, twice over
    context = codec_context_frames(tts.pipeline)
    longer = frames + JOIN_AFTER_STEPS + 2 * (FIRST_CHUNK_FRAMES + context + tts.pipeline.constants.num_codebooks)
    marks.clear()
    with tts.engine(max_batch=batch) as engine:
        running = [engine.submit(text, **_request(spec, i, longer)) for i in range(batch - 1)]
        deadline = time.monotonic() + JOIN_WAIT_S
        while running and sum(1 for _, rows in list(marks) if rows == batch - 1) < JOIN_AFTER_STEPS:
            if time.monotonic() > deadline or any(h.done for h in running):
                raise RuntimeError(f"batch {batch}: the {batch - 1} running requests did not reach "
                                   f"{JOIN_AFTER_STEPS} steps together")
            time.sleep(0.001)
        start = len(marks)
        joiner = engine.submit(text, **_request(spec, batch - 1, frames))
        speech = iter(joiner)
        next(speech)
        first_audio_ms = speech.first_audio_s * 1e3
        splice_s = getattr(engine.decoder, "last_splice_seconds", None)  # OpenVINO: the joiner's splice
        rows_then = max((rows for _, rows in marks[start:]), default=0)
        joiner.cancel()
        for handle in running:
            handle.cancel()
    return {"join_first_audio_ms": first_audio_ms, "join_rows": rows_then,
            **({"join_splice_ms": splice_s * 1e3} if splice_s is not None else {})}


def _bare_run(decoder: Any, batch: int, prompt: np.ndarray, step: np.ndarray, steps: int) -> float:
    """Milliseconds per step of the engine's own batched decoder alone: ``batch`` rows
    prefilled with ``prompt`` (float32 [1, P, H]), one untimed step, then ``steps - 1`` timed
    ones of ``step`` (float32 [1, 1, H]) on every row; the rows are released after."""
    rows = np.arange(batch)
    embeds = np.repeat(step, batch, axis=0)
    for row in rows:
        decoder.prefill(int(row), prompt)
    decoder.step(rows, embeds)
    t = time.perf_counter()
    for _ in range(steps - 1):
        decoder.step(rows, embeds)
    ms = (time.perf_counter() - t) / (steps - 1) * 1e3
    for row in rows:
        decoder.release(int(row))
    return ms


def _one_round(tts: Any, batch: int, spec: dict[str, Any], marks: list[tuple[float, int]],
               prompt: np.ndarray, step: np.ndarray) -> dict[str, Any]:
    plain, engine, codes = _engine_run(tts, batch, spec, marks, streamed=False)
    bare_ms = _bare_run(engine.decoder, batch, prompt, step, plain["engine_steps"])
    streamed, _, stream_codes = _engine_run(tts, batch, spec, marks, streamed=True)
    join = _join_run(tts, batch, spec, marks)
    run = {**plain, "bare_step_ms": bare_ms, **join,
           "stream_aggregate_frames_per_s": streamed["aggregate_frames_per_s"],
           "stream_engine_step_ms": streamed["engine_step_ms"],
           "stream_codes_match": all(np.array_equal(a, b) for a, b in zip(codes, stream_codes, strict=True))}
    run["engine_over_bare"] = run["engine_step_ms"] / bare_ms
    if run["aggregate_frames_per_s"] and run["stream_aggregate_frames_per_s"]:
        run["stream_over_plain"] = run["stream_aggregate_frames_per_s"] / run["aggregate_frames_per_s"]
    return run


def _median_rows(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-field median over the rounds (ratios: the median of each round's own ratio)."""
    out: dict[str, Any] = {}
    for key, value in runs[0].items():
        values = [r.get(key) for r in runs]
        if isinstance(value, bool):
            out[key] = all(values)
        elif isinstance(value, (int, float)) and all(isinstance(v, (int, float)) for v in values):
            out[key] = statistics.median(values)
        else:
            out[key] = value if all(v == value for v in values) else values
    return out


def measure_batches(spec: dict[str, Any]) -> dict[str, Any]:
    """Measure the engine of ``spec["bundle"]`` at every batch size of ``spec["batch"]``.

    Args:
        spec: ``bundle``, ``device`` (None: the bundle's own), ``ov_cache`` (OpenVINO's model
            cache, or None), ``batch`` (sizes), ``frames``, ``text``, ``seed``, ``temperature``,
            ``top_k``, ``repeats``, ``warmup``.

    Returns:
        ``rows``: one dict per size, in the order given: ``batch`` and either ``refused``
        (the engine's reason) or the medians over the rounds of ``aggregate_frames_per_s``
        (plain; frames of all rows per second over the steps with every row busy),
        ``per_request_frames_per_s`` (that / B), ``stream_aggregate_frames_per_s``,
        ``stream_over_plain``, ``engine_step_ms`` (``EngineStats.step_seconds / steps``: heads,
        sampling, embedding and decoder), ``stream_engine_step_ms``, ``bare_step_ms`` (the
        engine's decoder alone), ``engine_over_bare``, ``join_first_audio_ms``,
        ``max_kv_bytes_in_use`` (``EngineStats.max_kv_bytes_in_use`` of the plain run),
        ``wall_frames_per_s`` (all frames over submit to the last code, prefills included),
        ``prefill_ms`` (per request), ``full_batch_steps``, ``engine_steps``,
        ``joined_together`` (every row busy from the first step), ``stream_codes_match`` (the
        streamed codes equal the plain run's), ``join_rows`` (most rows busy while the joining
        request waited for its first audio: ``B`` when it joined the busy batch), ``join_splice_ms`` (OpenVINO: the time its
        decoder took to splice the joining request into the batched KV state), and
        ``rounds`` (every round's figures); ``kv_bytes_per_position`` (the engine's,
        ``engine.kv_bytes_per_position``; None where it cannot say), ``bench_kv_bytes_per_position``
        (the bench's own reading of the loaded decoder's KV dtype, :func:`~higgs_pack.targets.
        bench.workers.kv_itemsize`: OpenVINO's ``KV_CACHE_PRECISION``), ``kv_budget_bytes``,
        ``prompt_length``, ``loadavg_1m`` (before, after), ``peak_rss_mb``.
    """
    import higgs_pack
    from higgs_pack.manifests.errors import InputError
    from higgs_pack.runtime.loop.generate import build_prompt
    from higgs_pack.runtime.loop.streaming import codec_context_frames

    loadavg = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    tts = higgs_pack.load(spec["bundle"], spec.get("device") or "auto", cache_dir=spec.get("ov_cache"))
    pipeline, c = tts.pipeline, tts.pipeline.constants
    defaults = dict(pipeline.generation_defaults)
    defaults["sampling"] = {**defaults.get("sampling", {}), "repeat_guard_frames": 0}
    pipeline.generation_defaults = defaults  # every request runs its frame cap, as in the single runs
    marks: list[tuple[float, int]] = []
    pipeline.audio_heads = _HeadsProbe(pipeline.audio_heads, c.eoc, marks)
    codec_context_frames(pipeline)  # measured once here where the bundle does not record it
    prompt = build_prompt(pipeline, spec["text"]).astype(np.float32)
    step = pipeline.audio_embed.run({"codes": np.full((1, 1, c.num_codebooks), c.boc, dtype=np.int64)})
    step = np.array(step["audio_embeds"], dtype=np.float32, copy=True)

    sizes = [int(b) for b in spec["batch"]]
    refused: dict[int, str] = {}
    per_position = budget = None
    for batch in dict.fromkeys(sizes):
        try:
            with tts.engine(max_batch=batch) as engine:
                if per_position is None:
                    per_position, budget = engine.kv_bytes_per_position, engine.kv_budget_bytes
        except InputError as exc:
            refused[batch] = str(exc)
    usable = [b for b in dict.fromkeys(sizes) if b not in refused]
    for batch in usable:  # warm-up: one plain and one streamed run per size (new shapes, the codec's chunks)
        for _ in range(spec.get("warmup", 1)):
            _engine_run(tts, batch, spec, marks, streamed=False)
            _engine_run(tts, batch, spec, marks, streamed=True)
    rounds: dict[int, list[dict[str, Any]]] = {b: [] for b in usable}
    for _ in range(max(1, spec.get("repeats", 1))):
        for batch in usable:
            rounds[batch].append(_one_round(tts, batch, spec, marks, prompt, step))
    rows = []
    for batch in sizes:
        if batch in refused:
            rows.append({"batch": batch, "refused": refused[batch]})
            continue
        row = {"batch": batch, **_median_rows(rounds[batch])}
        if row.get("aggregate_frames_per_s"):
            row["per_request_frames_per_s"] = row["aggregate_frames_per_s"] / batch
        row["rounds"] = rounds[batch]
        rows.append(row)
    after = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    return {"rows": rows, "kv_bytes_per_position": per_position, "kv_budget_bytes": budget,
            "bench_kv_bytes_per_position": kv_bytes_per_position(c, kv_itemsize(pipeline.decoder)),
            "prompt_length": int(prompt.shape[1]), "loadavg_1m": [loadavg, after], "peak_rss_mb": peak_rss_mb()}


# ----------------------------------------------------------------------------- --fit-run
# The largest batch whose KV cache fits the memory budget, run rather than only computed.
#
# :func:`~bench.records.batch_memory` computes ``fit_max_batch``, the most
# rows whose KV cache at :data:`~bench.systems.FIT_POSITIONS` positions
# fits :data:`~bench.systems.FIT_MEMORY_BYTES` beside the bundle's weights.
# That arithmetic leaves out what a real process also holds (activations, the codec, the
# runtime's own buffers, allocator slack).  ``--fit-run`` checks it: a fresh process loads
# the whole bundle, opens the engine's batched decoder with that many rows of that many
# positions, writes every position of every row's KV buffers (so every page is committed,
# as it would be once the requests reach that length), and runs decode steps with every row
# at its last positions.  Its peak resident memory (VmHWM, the whole process) is then judged
# against the budget.
#
# Only decoders whose KV cache is host memory the runtime owns can be filled this way (ONNX
# Runtime's :class:`~higgs_pack.runtime.backends.onnxruntime.batched.BatchedOrtDecoder`); an
# OpenVINO cache lives inside the plugin, which allocates it as positions are computed, so
# its fit stays computed (the record says why).

#: Decode steps timed once every row is full.
FIT_STEPS = 3


def fill_kv(decoder: Any, length: int, seed: int = 0) -> None:
    """Write ``length`` positions of every row of a batched decoder's KV buffers and mark the
    rows as holding them, as if each row had been prefilled with a ``length``-position prompt.

    Args:
        decoder: a :class:`~higgs_pack.runtime.backends.onnxruntime.batched.BatchedOrtDecoder`.
        length: positions per row (1 <= length < decoder.max_length).
        seed: seed of the values written (small normal floats; uniform integers for an
            int8/uint8 cache).

    Raises:
        ValueError: ``length`` out of range, or a decoder without host KV buffers.
    """
    kv = getattr(decoder, "kv", None)
    if not isinstance(kv, dict) or not kv or not hasattr(decoder, "lengths"):
        raise ValueError(f"{type(decoder).__name__} keeps no host KV buffers this bench can fill")
    if not 1 <= length < decoder.max_length:
        raise ValueError(f"length must be in 1..{decoder.max_length - 1}, got {length}")
    rng = np.random.default_rng(seed)
    for buffer in kv.values():
        for row in range(buffer.shape[0]):  # a row at a time: no second copy of the whole cache
            part = buffer[row, :, :length]
            if np.issubdtype(buffer.dtype, np.integer):
                info = np.iinfo(buffer.dtype)
                part[...] = rng.integers(info.min, info.max, size=part.shape, dtype=buffer.dtype, endpoint=True)
            else:
                part[...] = rng.standard_normal(part.shape, dtype=np.float32) * 0.1
    decoder.lengths[:] = length


def fit_run(spec: dict[str, Any]) -> dict[str, Any]:
    """The ``fit`` worker: load the bundle, fill ``spec["batch"]`` rows of ``spec["positions"]``
    positions, run :data:`FIT_STEPS` decode steps with every row busy.

    Args:
        spec: the bench worker's spec (``bundle``, ``backend``, ``device``, ``ov_cache``) plus
            ``batch`` (rows, >= 1) and ``positions`` (positions per row, >= 2).

    Returns:
        ``{"fit_run_batch", "fit_run_positions", "fit_run_kv_bytes" (bytes the rows' KV holds),
        "fit_run_step_ms" (median step, all rows), "fit_run_peak_rss_mb" (this process, whole
        run), "fit_run_load_rss_mb" (after loading the bundle, before the KV)}``, or
        ``{"fit_run_skipped": reason}`` for a decoder whose cache this bench cannot fill.
    """
    import higgs_pack
    from higgs_pack.runtime.backends import registered

    batch, positions = int(spec["batch"]), int(spec["positions"])
    pipeline = higgs_pack.load(spec["bundle"], spec.get("device") or "auto", cache_dir=spec.get("ov_cache")).pipeline
    load_rss = rss_now_mb()
    try:
        decoder = registered()[spec["backend"]].batched_decoder(pipeline, batch, positions + FIT_STEPS)
    except Exception as exc:  # a backend that does not batch says why
        return {"fit_run_skipped": f"{type(exc).__name__}: {exc}"}
    if not isinstance(getattr(decoder, "kv", None), dict):
        return {"fit_run_skipped": f"{type(decoder).__name__} keeps its KV cache inside the runtime (it is "
                                   "allocated as positions are computed): the fit is computed only"}
    if not decoder.kv:
        return {"fit_run_skipped": f"{type(decoder).__name__}'s KV cache is in {decoder.kv_device} memory, "
                                   "allocated whole: the fit is computed only"}
    fill_kv(decoder, positions - 1)
    rows = np.arange(batch)
    embeds = np.random.default_rng(1).standard_normal((batch, 1, decoder.hidden_size), dtype=np.float32) * 0.1
    times = []
    for _ in range(FIT_STEPS):
        t0 = time.perf_counter()
        decoder.step(rows, embeds)
        times.append(time.perf_counter() - t0)
    return {"fit_run_batch": batch, "fit_run_positions": positions,
            "fit_run_kv_bytes": int(decoder.positions_held) * int(decoder.kv_bytes_per_position),
            "fit_run_step_ms": float(np.median(times) * 1e3), "fit_run_peak_rss_mb": round(peak_rss_mb(), 1),
            "fit_run_load_rss_mb": None if load_rss is None else round(load_rss, 1)}

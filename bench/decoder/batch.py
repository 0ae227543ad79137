"""``--batch``: one bundle's engine (``tts.engine(max_batch=B)``) at several batch sizes in one
process (the ``batch`` worker), and ``--fit-run`` (the ``fit`` worker); docs/benchmarks/index.md.

Per size, in rounds over the sizes, each run on a fresh engine: **plain** (B requests submitted
together, read with ``result()``), **streamed** (each on its own thread), **join** (one more
request's first audio while B - 1 run; ``join_voice_cold_*`` and ``join_voice_*`` with a named
voice whose prefix is not yet cached and then cached, and the running rows' longest wait for a frame
meanwhile) and **bare** (the engine's batched decoder stepped alone as
often).  EOC suppressed, repeat guard off: every request runs its frame cap.
``aggregate_frames_per_s`` counts the steps with every row busy (a plain run decodes its audio
after them: ``stream_over_plain`` charges the codec to streaming only);
``delivered_frames_per_s`` is audio in the callers' hands per wall second, codec included for both.
"""

from __future__ import annotations

import itertools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from bench.common.systems import load_1m, median_of, peak_rss_mb, rss_mb
from bench.decoder.workers import fixed_inputs, kv_bytes_per_position, kv_itemsize, no_eoc

#: Steps the B - 1 running requests take together before one joins (their step time before the
#: join is the median of these steps' intervals: ``<key>_running_step_ms``); seconds to wait for them.
JOIN_AFTER_STEPS = 6
JOIN_WAIT_S = 120.0
#: Decode steps timed once every row of ``--fit-run`` is full.
FIT_STEPS = 3


class _HeadsProbe:
    """The audio-heads runner with one ``(time, rows)`` mark per call (once per engine step, for
    all busy rows) and EOC suppressed."""

    def __init__(self, inner: Any, eoc: int, marks: list[tuple[float, int]]):
        self.inner, self.no_eoc, self.marks = inner, no_eoc(eoc), marks

    def run(self, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        self.marks.append((time.perf_counter(), int(feeds["hidden_states"].shape[0])))
        return self.no_eoc(self.inner.run(feeds))


def probe(tts: Any) -> list[tuple[float, int]]:
    """Ready ``tts`` for engine runs: repeat guard off, EOC suppressed and the audio heads marking
    ``(time, rows)`` once per engine step into the returned list, the codec context measured."""
    from higgs_pack.runtime.loop.codec import codec_context_frames

    pipeline, marks = tts.pipeline, []
    defaults = dict(pipeline.generation_defaults)
    defaults["sampling"] = {**defaults.get("sampling", {}), "repeat_guard_frames": 0}
    pipeline.generation_defaults = defaults
    pipeline.audio_heads = _HeadsProbe(pipeline.audio_heads, pipeline.constants.eoc, marks)
    codec_context_frames(pipeline)  # measured once, outside the timed runs
    return marks


def full_batch_rate(marks: list[tuple[float, int]], batch: int) -> tuple[float | None, int]:
    """``(frames/s over the steps with all rows busy, how many)``; None under two such steps."""
    full = [t for t, rows in marks if rows == batch]
    if len(full) < 2:
        return None, len(full)
    return batch * (len(full) - 1) / (full[-1] - full[0]), len(full)


def _request(spec: dict[str, Any], index: int, frames: int) -> dict[str, Any]:
    return {"seed": spec["seed"] + index, "temperature": spec["temperature"], "top_k": spec["top_k"],
            "top_p": 1.0, "max_frames": frames}


def open_engine(tts: Any, batch: int, spec: dict[str, Any]) -> Any:
    """``tts.engine(max_batch=batch)`` with the job's engine settings: ``join_gap_steps`` where the
    job sets one (``python -m bench.ab.paged --engines paged:1.5``), else the engine's default."""
    settings = {"join_gap_steps": spec["join_gap_steps"]} if spec.get("join_gap_steps") else {}
    return tts.engine(max_batch=batch, **settings)


def engine_run(tts: Any, batch: int, spec: dict[str, Any], marks: list[tuple[float, int]], *,
                streamed: bool) -> tuple[dict[str, Any], Any, list[np.ndarray]]:
    """One plain or streamed run of ``batch`` requests on a fresh engine: its figures, the closed
    engine and each request's codes."""
    frames = spec["frames"]
    marks.clear()
    with open_engine(tts, batch, spec) as engine:
        t0 = time.perf_counter()
        # together: the engine admits all B in one turn (one by one, the first could step alone)
        handles = engine.submit_together([{"text": spec["text"], **_request(spec, i, frames)} for i in range(batch)])
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
            # the codec, after the generation's timed part; read together, as a server's B callers
            # would (their decodes batch in the engine's codec thread)
            with ThreadPoolExecutor(batch) as pool:
                codes = [r.codes for r in pool.map(lambda handle: handle.result(), handles)]
        t_audio = time.perf_counter()  # every request's audio decoded (streamed: the last chunk read)
        kv_in_use = engine.stats.max_kv_bytes_in_use
        pool = getattr(engine.decoder, "pool", None)  # a paged decoder's block pool
    s = engine.stats  # the thread has stopped: final figures
    for i, c in enumerate(codes):
        if c.shape[0] != frames:
            raise RuntimeError(f"batch {batch}, request {i}: expected {frames} frames at the cap, got {c.shape[0]}")
    rate, full_steps = full_batch_rate(marks, batch)
    return {
        "aggregate_frames_per_s": rate, "engine_step_ms": s.step_seconds / s.steps * 1e3, "engine_steps": s.steps,
        "full_batch_steps": full_steps, "joined_together": bool(marks) and marks[0][1] == batch,
        "wall_frames_per_s": s.frames / (t_end - t0), "prefill_ms": s.prefill_seconds / batch * 1e3,
        # frames of audio the callers hold per wall second from submission, the codec included for
        # both runs (plain: generate, then decode; streamed: decoded while generating)
        "delivered_frames_per_s": batch * frames / (t_audio - t0),
        # None where the engine cannot say its KV bytes per position
        "max_kv_bytes_in_use": int(kv_in_use) if engine.kv_bytes_per_position is not None else None,
        # the paged decoder's blocks at most in use (KV bytes really held: a shared block once)
        "kv_blocks_peak": None if pool is None else pool.peak_in_use,
        "kv_block_bytes": getattr(engine.decoder, "block_bytes", None),
    }, engine, codes


def max_gap_ms(marks: list[tuple[float, int]], since: float, until: float) -> float | None:
    """The longest time between engine steps (``marks``' times) from ``since`` to ``until``, those
    ends included: what a running row waited for its next frame; None without a step in between."""
    times = [since] + [t for t, _ in marks if since < t < until] + [until]
    return max(b - a for a, b in itertools.pairwise(times)) * 1e3 if len(times) > 2 else None


def _join_run(tts: Any, batch: int, spec: dict[str, Any], marks: list[tuple[float, int]], voice: Any = None,
              key: str = "join", gap: str = "join_text_max_frame_gap_ms") -> dict[str, Any]:
    """First streamed audio of a request joining ``batch - 1`` running ones (alone at batch 1),
    with ``voice`` (a prepared voice: its whole prompt prefilled at the join) or none, read with
    ``spec["join_first_chunk_frames"]`` as its first chunk where set:
    ``<key>_first_audio_ms``, ``<key>_rows``, the codec's part until then (only the joiner streams):
    ``<key>_codec_ms`` (the codec thread's time in runs, ms), ``<key>_codec_runs`` and
    ``<key>_max_codec_run_ms`` (its longest run: what ran beside the running rows' steps at once),
    and, beside running rows, ``gap`` (their longest wait for a frame, ms, from the submission to
    the joiner's first audio) and ``<key>_running_step_ms`` (their step just before the join: the
    median interval of their last steps together, which the gap is counted in, measured in the
    same run because a shared VM's speed drifts between runs) and, on a paged decoder,
    ``<key>_kv_blocks_in_use`` and ``<key>_prefix_blocks_shared`` at the joiner's first audio."""
    from higgs_pack.runtime.loop.codec import codec_context_frames
    from higgs_pack.runtime.loop.streaming import FIRST_CHUNK_FRAMES

    # the running ones outlast the joiner's prefill, first chunk, codec context and delay ramp, twice
    ramp = FIRST_CHUNK_FRAMES + codec_context_frames(tts.pipeline) + tts.pipeline.constants.num_codebooks
    longer = spec["frames"] + JOIN_AFTER_STEPS + 2 * ramp
    marks.clear()
    with open_engine(tts, batch, spec) as engine:
        running = [engine.submit(spec["text"], **_request(spec, i, longer)) for i in range(batch - 1)]
        deadline = time.monotonic() + JOIN_WAIT_S
        while running and sum(1 for _, rows in list(marks) if rows == batch - 1) < JOIN_AFTER_STEPS:
            if time.monotonic() > deadline or any(h.done for h in running):
                raise RuntimeError(f"batch {batch}: the {batch - 1} running requests did not reach "
                                   f"{JOIN_AFTER_STEPS} steps together")
            time.sleep(0.001)
        start, since = len(marks), time.perf_counter()
        extra = {"voice": voice} if voice is not None else {}
        if spec.get("join_first_chunk_frames"):
            extra["first_chunk_frames"] = spec["join_first_chunk_frames"]
        joiner = engine.submit(spec["text"], **_request(spec, batch - 1, spec["frames"]), **extra)
        speech = iter(joiner)
        next(speech)
        until = time.perf_counter()
        codec = engine.codec.stats  # a fresh engine whose running rows are not read: the joiner's runs
        out = {f"{key}_first_audio_ms": speech.first_audio_s * 1e3,
               f"{key}_rows": max((rows for _, rows in marks[start:]), default=0),
               f"{key}_codec_ms": codec.seconds * 1e3, f"{key}_codec_runs": codec.runs,
               f"{key}_max_codec_run_ms": codec.max_run_seconds * 1e3}
        if batch > 1:
            out[gap] = max_gap_ms(list(marks), since, until)
            together = [t for t, rows in marks[:start] if rows == batch - 1]
            out[f"{key}_running_step_ms"] = float(np.median(np.diff(together))) * 1e3
        if engine.kv_blocks_in_use is not None:  # paged: blocks held at the joiner's first audio
            out[f"{key}_kv_blocks_in_use"] = engine.kv_blocks_in_use
            out[f"{key}_prefix_blocks_shared"] = engine.prefix_blocks_shared
        for handle in [joiner, *running]:
            handle.cancel()
    return out


def _bare_run(decoder: Any, batch: int, prompt: np.ndarray, step: np.ndarray, steps: int) -> float:
    """Ms per step of the engine's batched decoder alone: ``batch`` rows prefilled with ``prompt``,
    one untimed step, ``steps - 1`` timed ones; the rows are released after."""
    rows, embeds = np.arange(batch), np.repeat(step, batch, axis=0)
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
               prompt: np.ndarray, step: np.ndarray, voice: Any = None) -> dict[str, Any]:
    plain, engine, codes = engine_run(tts, batch, spec, marks, streamed=False)
    bare_ms = _bare_run(engine.decoder, batch, prompt, step, plain["engine_steps"])
    streamed, _, stream_codes = engine_run(tts, batch, spec, marks, streamed=True)
    run = {**plain, "bare_step_ms": bare_ms, **_join_run(tts, batch, spec, marks),
           **({} if voice is None else _voice_joins(tts, batch, spec, marks, voice)),
           "stream_aggregate_frames_per_s": streamed["aggregate_frames_per_s"],
           "stream_delivered_frames_per_s": streamed["delivered_frames_per_s"],
           "stream_delivered_over_plain": streamed["delivered_frames_per_s"] / plain["delivered_frames_per_s"],
           "stream_engine_step_ms": streamed["engine_step_ms"],
           "stream_codes_match": all(np.array_equal(a, b) for a, b in zip(codes, stream_codes, strict=True)),
           "engine_over_bare": plain["engine_step_ms"] / bare_ms}
    if run["aggregate_frames_per_s"] and run["stream_aggregate_frames_per_s"]:
        run["stream_over_plain"] = run["stream_aggregate_frames_per_s"] / run["aggregate_frames_per_s"]
    return run


def _voice_joins(tts: Any, batch: int, spec: dict[str, Any], marks: list[tuple[float, int]],
                 voice: Any) -> dict[str, Any]:
    """The named voice joining twice: **cold** (the prefix cache emptied first, so the joiner prefills
    the voice's whole prompt and fills the cache: ``join_voice_cold_*``, ``join_cold_max_frame_gap_ms``),
    then **cached** (its prefix restored from the cache: ``join_voice_*``, ``join_max_frame_gap_ms``).
    A bundle without a prefix cache joins cold both times."""
    cache = getattr(tts, "prefix_cache", None)
    if cache is not None:
        cache.clear()
    cold = _join_run(tts, batch, spec, marks, voice, "join_voice_cold", "join_cold_max_frame_gap_ms")
    return {**cold, **_join_run(tts, batch, spec, marks, voice, "join_voice", "join_max_frame_gap_ms")}


def join_voice(tts: Any, spec: dict[str, Any]) -> tuple[Any, int | None]:
    """The prepared voice of ``spec["voice_clip"]`` (its transcript ``voice_transcript``) that a
    joining request of the ``join_voice`` run speaks in, and its prompt's positions with the bench
    text (a 7-second clip: about 219); ``(None, None)`` without a clip or an audio encoder."""
    from higgs_pack.errors import InputError
    from higgs_pack.runtime.loop.prompt import build_prompt

    if not spec.get("voice_clip"):
        return None, None
    try:
        voice = tts.prepare_voice(spec["voice_clip"], spec["voice_transcript"], "bench")
    except InputError:  # a bundle without an audio encoder
        return None, None
    return voice, int(build_prompt(tts.pipeline, spec["text"], voice.codes, voice.transcript).shape[1])


#: :func:`positions_count`: positions of each request (issue 39: "requests of 2,000 positions that
#: fit in a 4 GiB KV budget") and the budget, bytes.
COUNT_POSITIONS, COUNT_BUDGET_BYTES = 2000, 4 * 2**30


def voice_rows(tts: Any, batch: int, spec: dict[str, Any], voice: Any) -> dict[str, Any]:
    """``batch`` requests of one prepared voice submitted together on a fresh engine, the voice's
    prefix already in the prefix cache (one request of it run first): what the KV cache holds
    while all rows decode (issue 39, "eight rows of one voice hold its prefix once").

    Keys (``voice_rows_`` prefix): ``kv_bytes_in_use`` (max, the engine's reservation: each row's
    positions), and for a paged decoder ``blocks_in_use`` (max, a shared block once),
    ``blocks_named`` (blocks the rows name, a shared one per row), ``prefix_blocks_shared``,
    ``prefix_held_once`` (blocks in use = blocks named - (rows - 1) x shared prefix blocks: one
    prefix and every row's tail), ``pool_bytes`` (the pool's tensors, allocated), ``block_bytes``;
    ``rss_growth_mb`` (the process's RSS during the run minus before it, MiB): the RSS check."""
    with open_engine(tts, 1, spec) as engine:  # the prefix computed and kept by one request
        engine.submit(spec["text"], **_request(spec, 0, 4), voice=voice).wait()
    before = peak = rss_mb()
    seen: dict[str, Any] = {"kv_bytes_in_use": 0}
    with open_engine(tts, batch, spec) as engine:
        handles = engine.submit_together([{"text": spec["text"], "voice": voice, **_request(spec, i, spec["frames"])}
                                          for i in range(batch)])
        decoder, pool = engine.decoder, getattr(engine.decoder, "pool", None)
        while not all(h.done for h in handles):
            seen["kv_bytes_in_use"] = max(seen["kv_bytes_in_use"], engine.kv_bytes_in_use)
            peak = max(peak or 0.0, rss_mb() or 0.0)
            if pool is not None and engine.busy_rows == batch:
                tables = [len(t) for t in list(decoder.tables.values())]
                shared, in_use = engine.prefix_blocks_shared or 0, pool.in_use
                if in_use >= seen.get("blocks_in_use", 0):
                    seen.update(blocks_in_use=in_use, blocks_named=sum(tables), prefix_blocks_shared=shared)
            time.sleep(0.005)
        for handle in handles:
            handle.result()
        if pool is not None:
            seen.update(pool_bytes=pool.capacity * decoder.block_bytes, block_bytes=decoder.block_bytes)
    if "blocks_in_use" in seen:
        seen["prefix_held_once"] = seen["blocks_in_use"] == seen["blocks_named"] - (batch - 1) * seen["prefix_blocks_shared"]
    seen["rss_growth_mb"] = None if before is None else peak - before
    return {"voice_rows_batch": batch, **{f"voice_rows_{k}": v for k, v in seen.items()}}


def positions_count(engine: Any) -> dict[str, Any]:
    """How many requests of :data:`COUNT_POSITIONS` positions the engine's admission lets hold KV
    at once in a :data:`COUNT_BUDGET_BYTES` budget: the budget over the bytes its admission
    reserves for one (``KVBudget.request_bytes``: whole blocks on a paged decoder, positions x
    bytes per position otherwise); None where the engine cannot say its bytes."""
    need = engine.kv.request_bytes(COUNT_POSITIONS)
    return {"count_positions": COUNT_POSITIONS, "count_budget_bytes": COUNT_BUDGET_BYTES,
            "count_request_bytes": need, "count_requests": None if not need else COUNT_BUDGET_BYTES // need}


def compile_engines(spec: dict[str, Any]) -> dict[str, Any]:
    """The ``compile`` worker: load the bundle and open an engine of each of ``spec["batch"]`` (the
    job's engine), so that OpenVINO's model cache (``HIGGS_PACK_CACHE``) holds every compiled model
    the ``batch`` workers will load.  Run once before measuring: the first process to compile a
    model exports it and runs it as compiled, the others import it, and the two were not the same
    speed (full size, Intel Xeon, OpenVINO 2026.4.1: the first worker's batch-1 step 204 ms, every
    later worker's 126-131 ms, one and the same decoder).  Returns ``compile_s``, its seconds."""
    import higgs_pack

    started = time.perf_counter()
    tts = higgs_pack.load(spec["bundle"], spec.get("device") or "auto", cache_dir=spec.get("ov_cache"))
    for batch in dict.fromkeys(int(b) for b in spec["batch"]):
        with open_engine(tts, batch, spec):
            pass
    return {"compile_s": time.perf_counter() - started}


def measure_batches(spec: dict[str, Any]) -> dict[str, Any]:
    """The ``batch`` worker: ``rows`` (per size of ``spec["batch"]``: ``refused`` with the engine's
    reason, or the medians over the rounds and ``rounds``), the engine's ``kv_bytes_per_position``
    (None where it cannot say) and ``kv_budget_bytes``, the bench's own ``bench_kv_bytes_per_position``,
    ``prompt_length``, ``loadavg_1m`` (before, after), ``peak_rss_mb``."""
    import higgs_pack
    from higgs_pack.errors import InputError

    before = load_1m()
    tts = higgs_pack.load(spec["bundle"], spec.get("device") or "auto", cache_dir=spec.get("ov_cache"))
    pipeline, c = tts.pipeline, tts.pipeline.constants
    if "codec_feed_frames" in spec:  # python -m bench.ab.paged --engines paged:feed=N|none
        pipeline.codec_feed_frames = spec["codec_feed_frames"]
    marks = probe(tts)
    prompt, step = fixed_inputs(pipeline, spec["text"])
    voice, voice_positions = join_voice(tts, spec)
    sizes = [int(b) for b in spec["batch"]]
    refused: dict[int, str] = {}
    per_position = budget = None
    count: dict[str, Any] = {}
    for batch in dict.fromkeys(sizes):
        try:
            with open_engine(tts, batch, spec) as engine:
                if per_position is None:
                    per_position, budget = engine.kv_bytes_per_position, engine.kv_budget_bytes
                    count = positions_count(engine)
        except InputError as exc:
            refused[batch] = str(exc)
    usable = [b for b in dict.fromkeys(sizes) if b not in refused]
    for batch in usable:  # warm-up: new shapes, the codec's chunks
        for _ in range(spec.get("warmup", 1)):
            engine_run(tts, batch, spec, marks, streamed=False)
            engine_run(tts, batch, spec, marks, streamed=True)
    rounds: dict[int, list[dict[str, Any]]] = {b: [] for b in usable}
    for _ in range(max(1, spec.get("repeats", 1))):
        for batch in usable:
            rounds[batch].append(_one_round(tts, batch, spec, marks, prompt, step, voice))
    rows = []
    for batch in sizes:
        if batch in refused:
            rows.append({"batch": batch, "refused": refused[batch]})
            continue
        row = {"batch": batch, **median_of(rounds[batch])}
        if row.get("aggregate_frames_per_s"):
            row["per_request_frames_per_s"] = row["aggregate_frames_per_s"] / batch
        rows.append({**row, "rounds": rounds[batch]})
    shared: dict[str, Any] = {}
    if voice is not None and usable and spec.get("voice_rows"):
        try:
            shared = voice_rows(tts, max(usable), spec, voice)
        except Exception as exc:  # the rounds' figures are kept whatever this run does
            shared = {"voice_rows_error": f"{type(exc).__name__}: {exc}"}
    return {"rows": rows, **count, **shared, "kv_bytes_per_position": per_position, "kv_budget_bytes": budget,
            "bench_kv_bytes_per_position": kv_bytes_per_position(c, kv_itemsize(pipeline.decoder)),
            "prompt_length": int(prompt.shape[1]), "join_voice_prompt_length": voice_positions,
            "loadavg_1m": [before, load_1m()], "peak_rss_mb": peak_rss_mb()}


def fill_kv(decoder: Any, length: int, seed: int = 0) -> None:
    """Write ``length`` positions of every row of a batched decoder's host KV buffers (small normal
    floats, uniform integers for an integer cache) and mark the rows as holding them; ValueError
    for a decoder without such buffers or a length out of range."""
    kv = getattr(decoder, "kv", None)
    if not isinstance(kv, dict) or not kv or not hasattr(decoder, "lengths"):
        raise ValueError(f"{type(decoder).__name__} keeps no host KV buffers this bench can fill")
    if not 1 <= length < decoder.max_length:
        raise ValueError(f"length must be in 1..{decoder.max_length - 1}, got {length}")
    rng = np.random.default_rng(seed)
    for buffer in kv.values():
        for row in range(buffer.shape[0]):  # a row at a time: no second copy of the cache
            part = buffer[row, :, :length]
            if np.issubdtype(buffer.dtype, np.integer):
                info = np.iinfo(buffer.dtype)
                part[...] = rng.integers(info.min, info.max, size=part.shape, dtype=buffer.dtype, endpoint=True)
            else:
                part[...] = rng.standard_normal(part.shape, dtype=np.float32) * 0.1
    decoder.lengths[:] = length


def fit_run(spec: dict[str, Any]) -> dict[str, Any]:
    """The ``fit`` worker: ``spec["batch"]`` rows of ``spec["positions"]`` positions written whole
    (every KV page committed), then :data:`FIT_STEPS` steps with all rows busy; the process's peak
    RSS is what ``fit_run_fits`` judges.  OpenVINO's cache lives in the plugin: ``fit_run_skipped``."""
    import higgs_pack
    from higgs_pack.runtime.backends import registered

    batch, positions = int(spec["batch"]), int(spec["positions"])
    pipeline = higgs_pack.load(spec["bundle"], spec.get("device") or "auto", cache_dir=spec.get("ov_cache")).pipeline
    load_rss = rss_mb()
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

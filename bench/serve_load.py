"""Load test of ``higgs-pack serve`` (issue 20 item 8): concurrent HTTP clients against a live
server on 127.0.0.1, side by side with the same requests through the engine in its own process.

``python -m bench.serve_load [--preset tiny|bench | --bundle PATH | --url URL]
[--clients 1,4,16,64] [--requests N] [--level-seconds S] [--soak-requests 500] [--out dist/serve-bench.json]``

What one run does, in this order (nothing else runs meanwhile, so the two processes take turns
on the CPUs):

1. the server (``higgs-pack serve BUNDLE --host 127.0.0.1 --port 0``, a subprocess bounded in
   time and stopped by its process id) or ``--url``; its ``/ready`` gives the batch and queue;
2. the engine process (``tts.engine(max_batch)``, the server's batch) runs every request of the
   pool once, one at a time: the reference length (samples) and the sha256 of the 16-bit PCM of
   each request;
3. per concurrency level (1, 4, 16, 64 clients): the engine process runs the level's requests
   with as many threads as clients, then the server gets the same requests from as many
   asyncio clients (one ``httpx.AsyncClient``); at one client the two take turns request by
   request instead (the engine, then HTTP, job by job: both meet the same load on a shared
   machine, which moved a whole level's first audio by up to 2x); each level is bounded by its
   request count and its seconds (no request starts after them; one in flight gets
   ``--request-timeout``); with ``--rounds N`` the level runs N times in turn and each side
   keeps its fastest round, as ``nox -s bench --rounds`` does on a shared machine (every
   round's answers are checked);
4. the soak: ``--soak-requests`` (500) more requests at ``--soak-clients``, the server's RSS
   read every 50 answers; its growth from the first reading to the last is the leak figure.

Requests: a pool of ``--pool`` jobs over the lines of the cases' texts (``text_en_basic.txt``,
``text_zh.txt``), seed = the job's index, ``max_new_tokens = --frames``, whole WAV files and
``stream_format="audio"`` PCM streams in turn (every text asked both ways); request ``i`` of a
level is job ``i mod pool``, so every level and the engine run the same requests.

Every answer is checked (:func:`check`): complete audio (a whole WAV that libsndfile reads,
with its declared data length, of the job's reference length; or a PCM stream that ended
cleanly with the reference's bytes) or a clear error (OpenAI's error body); a 429 must say
``queue_full`` and come only while ``max_batch + max_queue`` other requests of this run were
out.  Answers are counted as ``ok``, ``length_differs`` (complete and well-formed, another
length than the one-at-a-time reference: see :data:`CATEGORIES`), ``rejected`` (a justified
429), ``error``, ``lost``, ``truncated``, ``malformed`` and ``unjustified_429``.

Units: frames of 960 samples at 24 kHz (25 per second), counted from the audio bytes; times in
milliseconds; RSS in MiB (``VmRSS`` of ``/proc/PID/status``); CPU seconds of each process (user +
system, every thread).

The rooms: this module (the clients, a level's figures, one run, the command line);
:mod:`~bench.serve_checks` (the requests and the judge of their answers);
:mod:`~bench.serve_workers` (the server and engine processes, ``/proc`` and
``/metrics``); :mod:`~bench.serve_report` (goals, table, ``dist/serve-bench.json``
and ``.html``).
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.serve_checks import (
    ANSWER_COLUMNS,
    CATEGORIES,
    FAILURES,
    FRAME_SAMPLES,
    SAMPLE_RATE,
    Expected,
    Job,
    Observed,
    Verdict,
    case_texts,
    check,
    request_pool,
)
from bench.serve_workers import (
    EngineProcess,
    ServerProcess,
    cpu_s,
    engine_worker,
    rss_mb,
    scrape,
)

__all__ = ["ANSWER_COLUMNS", "CATEGORIES", "FAILURES", "FRAME_SAMPLES", "SAMPLE_RATE", "Expected", "Job",
           "LoadOptions", "Observed", "Verdict", "check", "main", "request_pool", "run_clients", "run_load"]

DEFAULT_CLIENTS: tuple[int, ...] = (1, 4, 16, 64)
#: Frames per request (``max_new_tokens``): 2 s of audio.
DEFAULT_FRAMES = 50
#: Requests per level, at most, by preset (the level's seconds bound it too).
DEFAULT_REQUESTS = {"tiny": {1: 24, 4: 48, 16: 96, 64: 192}, "bench": {1: 12, 4: 24, 16: 48, 64: 128}}
DEFAULT_LEVEL_SECONDS = 120.0
DEFAULT_POOL = 48
DEFAULT_SOAK_REQUESTS = 500
DEFAULT_SOAK_CLIENTS = 16
#: The server's RSS is read every this many answers of the soak.
SOAK_READ_EVERY = 50
#: Most seconds one request may take from send to last byte (then it is ``lost`` or ``truncated``).
DEFAULT_REQUEST_TIMEOUT = 300.0


# ---------------------------------------------------------------------------------------------
# the HTTP clients


class _Outstanding:
    """The requests out now; each one's most others out at once (:attr:`Observed.peak_others`)."""

    def __init__(self) -> None:
        self._out: list[Observed] = []

    def enter(self, obs: Observed) -> None:
        others = len(self._out)
        obs.peak_others = max(obs.peak_others, others)
        for o in self._out:
            o.peak_others = max(o.peak_others, others)
        self._out.append(obs)

    def leave(self, obs: Observed) -> None:
        self._out.remove(obs)


async def _one(http: Any, url: str, model: str, obs: Observed, out: _Outstanding, timeout: float) -> None:
    """Send ``obs.job`` and fill ``obs`` with what came back (an error too)."""
    import httpx

    job = obs.job
    out.enter(obs)
    obs.started = time.monotonic()
    data = bytearray()

    async def read() -> None:
        async with http.stream("POST", url + "/v1/audio/speech", json=job.body(model)) as response:
            obs.status = response.status_code
            obs.content_type = response.headers.get("content-type", "")
            obs.retry_after = response.headers.get("retry-after")
            async for piece in response.aiter_raw():
                if piece and obs.first_audio is None and job.stream and obs.status == 200:
                    obs.first_audio = time.monotonic()
                data.extend(piece)

    try:
        await asyncio.wait_for(read(), timeout)
    except (httpx.HTTPError, asyncio.TimeoutError, OSError) as exc:
        obs.error = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    except asyncio.CancelledError:
        obs.error = "cancelled at the level's hard limit"
        raise
    finally:
        obs.body = bytes(data)
        obs.ended = time.monotonic()
        out.leave(obs)


@dataclass
class LevelRun:
    """The raw outcome of one level: the answers and the level's wall span."""

    observed: list[Observed] = field(default_factory=list)
    seconds: float = 0.0
    rss_mb: list[tuple[int, float | None]] = field(default_factory=list)  # (answers so far, RSS)


async def run_clients(url: str, model: str, jobs: Sequence[Job], clients: int, seconds: float, *,
                      timeout: float = DEFAULT_REQUEST_TIMEOUT, pid: int | None = None,
                      read_every: int = 0) -> LevelRun:
    """``clients`` concurrent clients send ``jobs`` in order (each takes the next one) until
    they are all sent or ``seconds`` have passed; a client answered 429 waits its
    ``Retry-After`` (at most what is left of ``seconds``) before its next request.

    Args:
        url: the server, ``http://127.0.0.1:PORT``.
        model: the ``model`` field.
        jobs: the requests, in order.
        clients: concurrent clients.
        seconds: no request starts after this; those in flight get ``timeout`` more.
        timeout: most seconds of one request.
        pid: the server's process id, whose RSS is read every ``read_every`` answers (0: never).

    Returns:
        A :class:`LevelRun` (answers in the order they were sent).
    """
    import httpx

    run = LevelRun()
    out = _Outstanding()
    pending = iter(jobs)
    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    answered = 0
    deadline = math.inf

    async def client(http: httpx.AsyncClient) -> None:
        nonlocal answered
        for job in pending:
            if time.monotonic() >= deadline:
                return
            obs = Observed(job)
            run.observed.append(obs)  # kept when the level's hard limit cancels it: lost or truncated
            await _one(http, url, model, obs, out, timeout)
            answered += 1
            if pid and read_every and answered % read_every == 0:
                run.rss_mb.append((answered, rss_mb(pid)))
            if obs.status == 429 and (obs.retry_after or "").isdigit():
                await asyncio.sleep(max(0.0, min(float(obs.retry_after), deadline - time.monotonic())))

    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0), limits=limits) as http:
        deadline = time.monotonic() + seconds
        tasks = [asyncio.create_task(client(http)) for _ in range(clients)]
        done, late = await asyncio.wait(tasks, timeout=seconds + timeout + 30.0)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        for task in done:
            task.result()
    if run.observed:  # from the first send to the last byte, not the client's own set-up
        run.seconds = max(o.ended for o in run.observed) - min(o.started for o in run.observed)
    return run


# ---------------------------------------------------------------------------------------------
# figures


def percentiles(values_s: Sequence[float]) -> dict[str, float] | None:
    """``{"n", "p50", "p95", "p99", "max", "mean"}`` of seconds, in milliseconds; None when empty."""
    if not values_s:
        return None
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    p50, p95, p99 = np.percentile(ms, [50, 95, 99])
    return {"n": len(ms), "p50": float(p50), "p95": float(p95), "p99": float(p99), "max": float(ms.max()),
            "mean": float(ms.mean())}


def summarize_http(run: LevelRun, verdicts: Sequence[Verdict], problems_kept: int = 8) -> dict[str, Any]:
    """A level's figures from its answers: requests and frames per second (answers with audio),
    time to first audio (streams) and total latency (audio answers), counts by status and by
    category, bit-exact answers, and the first problems."""
    audio = [(o, v) for o, v in zip(run.observed, verdicts, strict=True) if v.category in ("ok", "length_differs")]
    frames = sum(v.frames for _, v in audio)
    by_status: dict[str, int] = {}
    for o in run.observed:
        key = str(o.status) if o.status is not None else "none"
        by_status[key] = by_status.get(key, 0) + 1
    counts = {c: sum(v.category == c for v in verdicts) for c in CATEGORIES}
    span = run.seconds or math.nan
    t0 = min((o.started for o in run.observed), default=0.0)
    problems = [{"job": o.job.index, "category": v.category, "detail": v.detail}
                for o, v in zip(run.observed, verdicts, strict=True) if v.category not in ("ok", "rejected")]
    return {
        "requests": len(run.observed), "answered_audio": len(audio), "seconds": run.seconds,
        "requests_per_s": len(audio) / span, "sent_per_s": len(run.observed) / span,
        "frames": frames, "frames_per_s": frames / span, "audio_s": frames / 25.0,
        "first_audio_ms": percentiles([o.first_audio - o.started for o, _ in audio if o.first_audio is not None]),
        "latency_ms": percentiles([o.ended - o.started for o, _ in audio]),
        "latency_whole_ms": percentiles([o.ended - o.started for o, _ in audio if not o.job.stream]),
        "latency_stream_ms": percentiles([o.ended - o.started for o, _ in audio if o.job.stream]),
        "by_status": by_status, "checks": counts, "exact": sum(v.exact for v in verdicts),
        "problems": problems[:problems_kept], "problems_total": len(problems),
        "answers_columns": list(ANSWER_COLUMNS),
        "answers": [[o.job.index, o.job.stream, o.status, v.category, round(1e3 * (o.started - t0), 1),
                     round(1e3 * (o.ended - o.started), 1),
                     None if o.first_audio is None else round(1e3 * (o.first_audio - o.started), 1), v.frames,
                     int(o.retry_after) if (o.retry_after or "").isdigit() else None]
                    for o, v in zip(run.observed, verdicts, strict=True)],
    }


def summarize_engine(rows: Sequence[dict[str, Any]], seconds: float, stats: dict[str, float],
                     cpu: float | None = None) -> dict[str, Any]:
    """The engine process's figures of a level (rows: ``job``, ``latency_s``, ``first_audio_s``,
    ``samples``, ``category``, ``exact``, ``stream``; ``cpu``: the process's CPU seconds in it)."""
    audio = [r for r in rows if r["category"] in ("ok", "length_differs")]
    frames = sum(r["samples"] for r in audio) / FRAME_SAMPLES
    span = seconds or math.nan
    return {
        "requests": len(rows), "seconds": seconds, "requests_per_s": len(audio) / span,
        "frames": frames, "frames_per_s": frames / span, "cpu_s": cpu,
        "frames_per_cpu_s": frames / cpu if cpu else None,
        "first_audio_ms": percentiles([r["first_audio_s"] for r in audio if r["first_audio_s"] is not None]),
        "latency_ms": percentiles([r["latency_s"] for r in audio]),
        "submit_ms": percentiles([r["submit_s"] for r in audio if r.get("submit_s") is not None]),
        "checks": {c: sum(r["category"] == c for r in rows) for c in ("ok", "length_differs", "error")},
        "exact": sum(bool(r["exact"]) for r in rows), **_batch_figures(stats),
    }


def _batch_figures(stats: dict[str, float]) -> dict[str, Any]:
    """Mean rows per decode step and the decode steps' share of the level, from counter deltas."""
    steps, frames = stats.get("engine_steps"), stats.get("engine_frames")
    if not steps:
        return {}
    return {"engine_steps": steps, "mean_rows_per_step": frames / steps,
            "step_ms": 1e3 * stats.get("engine_step_seconds", math.nan) / steps}


# ---------------------------------------------------------------------------------------------
# one run


@dataclass
class LoadOptions:
    """What one load test runs (the command-line flags)."""

    bundle: str | None = None
    url: str | None = None
    server_pid: int | None = None
    preset: str = "tiny"
    label: str | None = None
    clients: tuple[int, ...] = DEFAULT_CLIENTS
    requests: dict[int, int] | None = None
    level_seconds: float = DEFAULT_LEVEL_SECONDS
    frames: int = DEFAULT_FRAMES
    pool: int = DEFAULT_POOL
    soak_requests: int = DEFAULT_SOAK_REQUESTS
    soak_clients: int = DEFAULT_SOAK_CLIENTS
    soak_seconds: float = 1800.0
    max_batch: int | None = None
    max_queue: int | None = None
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT
    engine: bool = True
    cases: str | None = None
    cache: str | None = None
    rounds: int = 1
    quiet: bool = False


def _say(options: LoadOptions, message: str) -> None:
    if not options.quiet:
        print(message, file=sys.stderr, flush=True)


def requests_per_level(options: LoadOptions) -> dict[int, int]:
    """Requests each level may send: ``options.requests``, else the preset's defaults (8x the
    clients, at least 24, for counts not listed)."""
    table = {**DEFAULT_REQUESTS.get(options.preset, {}), **(options.requests or {})}
    return {c: table.get(c, max(24, 8 * c)) for c in options.clients}


def _machine() -> dict[str, Any]:
    from bench.systems import machine as bench_machine

    machine = bench_machine()
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    try:
        uptime = subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        uptime = None
    return {**machine, "loadavg": list(load) if load else None, "uptime": uptime}


def _jobs_for(pool: Sequence[Job], count: int) -> list[Job]:
    return [pool[i % len(pool)] for i in range(count)]


def run_load(options: LoadOptions) -> dict[str, Any]:
    """One load test (see the module docstring); returns its record for
    :func:`bench.serve_report.write_run`.

    Raises:
        RuntimeError: the server or the engine process did not start.
        InputError: no bundle, URL or texts.
    """
    from higgs_pack.manifests.errors import InputError

    if not options.bundle and not options.url:
        raise InputError("give a bundle (--bundle, --preset) or a running server (--url)")
    cases = Path(options.cases or os.environ.get("HIGGS_PACK_CASES") or Path(__file__).resolve().parents[2]
                 / "shared" / "cases")
    pool = request_pool(case_texts(cases), options.pool, options.frames)
    counts = requests_per_level(options)
    record: dict[str, Any] = {
        "kind": "serve-bench", "preset": options.preset, "bundle": str(options.bundle or ""),
        "machine_before": _machine(), "frames_per_request": options.frames, "pool": len(pool),
        "level_seconds": options.level_seconds, "request_timeout_s": options.request_timeout,
        "client": "httpx.AsyncClient, one asyncio loop in the measuring process",
    }
    server: ServerProcess | None = None
    engine: EngineProcess | None = None
    try:
        if options.url:
            url, pid = options.url.rstrip("/"), options.server_pid
        else:
            args = [*(["--max-batch", str(options.max_batch)] if options.max_batch else []),
                    *(["--max-queue", str(options.max_queue)] if options.max_queue is not None else [])]
            _say(options, f"starting the server on {options.bundle}")
            t0 = time.monotonic()
            server = ServerProcess(options.bundle, args, options.cache)
            url, pid = server.url, server.pid
            record["server_start_s"] = time.monotonic() - t0
        import httpx

        ready = httpx.get(url + "/ready", timeout=30).json()
        model = ready["bundle"]
        capacity = ready["max_batch"] + ready["max_queue"]
        record.update({"label": options.label or f"{ready['target']}-{ready['precision']}", "model": model,
                       "server": {"url": url, "pid": pid, "max_batch": ready["max_batch"],
                                  "max_queue": ready["max_queue"], "capacity": capacity,
                                  "backend": ready["backend"], "device": ready["device"],
                                  "batching": ready["batching"], "started_here": server is not None},
                       "rss_start_mb": rss_mb(pid) if pid else None})
        expected: dict[int, Expected] = {}
        if options.engine and options.bundle:
            _say(options, f"starting the engine process (max_batch {ready['max_batch']})")
            engine = EngineProcess(options.bundle, ready["max_batch"], options.cache)
            _say(options, f"reference: {len(pool)} requests one at a time through the engine")
            rows = engine.ask({"task": "reference", "jobs": [asdict(j) for j in pool]},
                              timeout=options.request_timeout * len(pool))["rows"]
            bad = [r for r in rows if r["category"] == "error"]
            if bad:
                raise RuntimeError(f"the engine failed on its own: job {bad[0]['job']}: {bad[0]['detail']}")
            expected = {r["job"]: Expected(r["samples"], r["sha256"]) for r in rows}
            record["reference"] = {"requests": len(rows), "samples": [r["samples"] for r in rows],
                                   "frames_at_cap": sum(r["samples"] == options.frames * FRAME_SAMPLES for r in rows)}
        record["levels"] = []
        for clients in options.clients:
            jobs = _jobs_for(pool, counts[clients])
            rounds = []
            for round_ in range(max(1, options.rounds)):
                one: dict[str, Any] = {}
                if engine is not None and clients == 1:
                    _say(options, f"engine and server in turn, 1 client: {len(jobs)} requests"
                         + (f" (round {round_ + 1})" if options.rounds > 1 else ""))
                    rounds.append(_one_client_in_turn(url, model, pid, jobs, engine, capacity, expected, options))
                    continue
                if engine is not None:
                    _say(options, f"engine, {clients} clients: {len(jobs)} requests")
                    answer = engine.ask({"task": "level", "jobs": [asdict(j) for j in jobs], "clients": clients,
                                         "seconds": options.level_seconds,
                                         "expected": {str(k): asdict(v) for k, v in expected.items()}},
                                        timeout=options.level_seconds + options.request_timeout + 60)
                    one["engine"] = summarize_engine(answer["rows"], answer["seconds"], answer["stats"],
                                                     answer.get("cpu_s"))
                _say(options, f"server, {clients} clients: {len(jobs)} requests"
                     + (f" (round {round_ + 1})" if options.rounds > 1 else ""))
                one["http"] = _http_level(url, pid, clients, capacity, expected, lambda jobs=jobs, clients=clients:
                                          asyncio.run(run_clients(url, model, jobs, clients, options.level_seconds,
                                                                  timeout=options.request_timeout)))
                rounds.append(one)
            level = keep_fastest(clients, len(jobs), rounds)
            record["levels"].append(level)
            _say(options, _level_line(level))
        if engine is not None:
            engine.close()
            engine = None
        if options.soak_requests > 0:
            record["soak"] = _soak(url, model, pid, pool, capacity, expected, options)
        record["rss_end_mb"] = rss_mb(pid) if pid else None
        record["machine_after"] = {k: v for k, v in _machine().items() if k in ("loadavg", "uptime")}
    finally:
        if engine is not None:
            engine.close()
        if server is not None:
            record["server_exit"] = server.stop()
            record["server_log_tail"] = [line.rstrip() for line in server.log[-20:]]
    return record


def keep_fastest(clients: int, allowed: int, rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One level's record from its rounds (``{"http": ..., "engine": ...}`` each): the HTTP
    figures of the round with the most frames/s, the engine's of its own fastest round (other
    work on a shared machine only ever slows a round down, as ``nox -s bench --rounds``
    assumes); the checks of every round summed (``checks_all_rounds``: every answer counts),
    the RSS from the first round's start to the last one's end, and each round's main figures.
    Beside them, two figures less at the mercy of other work on the machine: ``paired_ratios``
    (each round's HTTP frames/s over the engine's, run one after the other) with their median,
    and ``cpu_efficiency``: frames per CPU second of the server process over those of the
    engine process, every round summed (1.0: HTTP costs no CPU; the client's CPU not counted)."""
    best = max(rounds, key=lambda r: r["http"]["frames_per_s"])
    level: dict[str, Any] = {"clients": clients, "requests_allowed": allowed, **best["http"]}
    engines = [r["engine"] for r in rounds if r.get("engine")]
    if engines:
        level["engine"] = max(engines, key=lambda e: e["frames_per_s"])
        paired = [r["http"]["frames_per_s"] / r["engine"]["frames_per_s"] for r in rounds
                  if (r.get("engine") or {}).get("frames_per_s")]
        level["paired_ratios"] = paired
        level["paired_ratio_median"] = float(np.median(paired)) if paired else None
        server_cpu = [r["http"].get("server_cpu_s") for r in rounds]
        if all(server_cpu) and all(e.get("cpu_s") for e in engines):
            per_server = sum(r["http"]["frames"] for r in rounds) / sum(server_cpu)
            per_engine = sum(e["frames"] for e in engines) / sum(e["cpu_s"] for e in engines)
            level["cpu_efficiency"] = per_server / per_engine
    level["checks_all_rounds"] = {c: sum(r["http"]["checks"][c] for r in rounds) for c in CATEGORIES}
    level["rss_start_mb"], level["rss_end_mb"] = rounds[0]["http"]["rss_start_mb"], rounds[-1]["http"]["rss_end_mb"]
    level["rounds"] = [{"frames_per_s": r["http"]["frames_per_s"],
                        "first_audio_p50_ms": (r["http"]["first_audio_ms"] or {}).get("p50"),
                        "engine_frames_per_s": (r.get("engine") or {}).get("frames_per_s"),
                        "engine_first_audio_p50_ms": ((r.get("engine") or {}).get("first_audio_ms") or {}).get("p50"),
                        "checks": r["http"]["checks"]} for r in rounds]
    return level


def _one_client_in_turn(url: str, model: str, pid: int | None, jobs: list[Job], engine: EngineProcess,
                        capacity: int, expected: dict[int, Expected], options: LoadOptions) -> dict[str, Any]:
    """The one-client level, request by request in turn: job ``i`` through the engine process,
    then the same job over HTTP (one kept-alive connection), so both meet the same load on the
    machine; each side's seconds are the sum of its requests' (one client: nothing overlaps).

    Returns:
        ``{"http": figures, "engine": figures}`` as the concurrent levels give them.
    """
    rows: list[dict[str, Any]] = []
    totals = {"seconds": 0.0, "cpu_s": 0.0, "engine_steps": 0.0, "engine_frames": 0.0, "engine_step_seconds": 0.0}

    async def turns() -> LevelRun:
        import httpx

        run, out = LevelRun(), _Outstanding()
        deadline = time.monotonic() + options.level_seconds
        loop = asyncio.get_running_loop()
        async with httpx.AsyncClient(timeout=httpx.Timeout(options.request_timeout, connect=30.0)) as http:
            for job in jobs:
                if time.monotonic() >= deadline:
                    break
                task = {"task": "level", "jobs": [asdict(job)], "clients": 1, "seconds": options.request_timeout,
                        "expected": {str(job.index): asdict(expected[job.index])} if job.index in expected else {}}
                answer = await loop.run_in_executor(None, engine.ask, task, options.request_timeout + 60)
                rows.extend(answer["rows"])
                totals["seconds"] += answer["seconds"]
                totals["cpu_s"] += answer.get("cpu_s") or 0.0
                for key, value in answer["stats"].items():
                    totals[key] += value
                obs = Observed(job)
                run.observed.append(obs)
                await _one(http, url, model, obs, out, options.request_timeout)
        run.seconds = sum(o.ended - o.started for o in run.observed)
        return run

    http = _http_level(url, pid, 1, capacity, expected, lambda: asyncio.run(turns()))
    stats = {k: totals[k] for k in ("engine_steps", "engine_frames", "engine_step_seconds")}
    return {"http": http, "engine": summarize_engine(rows, totals["seconds"], stats, totals["cpu_s"])}


def _http_level(url: str, pid: int | None, clients: int, capacity: int, expected: dict[int, Expected],
                measure: Any) -> dict[str, Any]:
    """The figures of one HTTP level: ``measure()`` runs its clients (a :class:`LevelRun`), with
    the server's counters, RSS and CPU seconds read around it and every answer checked."""
    before = scrape(url)
    rss_start = rss_mb(pid) if pid else None
    server_cpu, client_cpu = cpu_s(pid) if pid else None, cpu_s()
    run = measure()
    server_cpu = cpu_s(pid) - server_cpu if server_cpu is not None and cpu_s(pid) is not None else None
    client_cpu = cpu_s() - client_cpu
    rss_end = rss_mb(pid) if pid else None
    after = scrape(url)
    verdicts = [check(o, expected.get(o.job.index), capacity, alone=clients == 1) for o in run.observed]
    figures = summarize_http(run, verdicts)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    figures.update({"rss_start_mb": rss_start, "rss_end_mb": rss_end, "server_cpu_s": server_cpu,
                    "client_cpu_s": client_cpu, "server_frames": delta.get("frames"), **_batch_figures(delta)})
    if server_cpu:
        figures["frames_per_server_cpu_s"] = figures["frames"] / server_cpu
    if delta.get("first_audio_count"):  # the server's own view: its stream start to its first chunk
        figures["server_first_audio_ms_mean"] = 1e3 * delta["first_audio_seconds"] / delta["first_audio_count"]
    if delta.get("request_count"):
        figures["server_request_ms_mean"] = 1e3 * delta["request_seconds"] / delta["request_count"]
    return figures


def _soak(url: str, model: str, pid: int | None, pool: Sequence[Job], capacity: int,
          expected: dict[int, Expected], options: LoadOptions) -> dict[str, Any]:
    """``soak_requests`` requests at ``soak_clients``; the server's RSS before, every
    :data:`SOAK_READ_EVERY` answers, and after."""
    _say(options, f"soak: {options.soak_requests} requests at {options.soak_clients} clients")
    jobs = _jobs_for(pool, options.soak_requests)
    start = rss_mb(pid) if pid else None
    run = asyncio.run(run_clients(url, model, jobs, options.soak_clients, options.soak_seconds,
                                  timeout=options.request_timeout, pid=pid, read_every=SOAK_READ_EVERY))
    end = rss_mb(pid) if pid else None
    verdicts = [check(o, expected.get(o.job.index), capacity) for o in run.observed]
    figures = summarize_http(run, verdicts)
    readings = [(0, start), *run.rss_mb, (len(run.observed), end)]
    growth = (end - start) / start if start and end else None
    soak = {"clients": options.soak_clients, **figures, "rss_start_mb": start, "rss_end_mb": end,
            "rss_growth": growth, "rss_readings": [[n, mb] for n, mb in readings]}
    _say(options, f"soak: {soak['requests']} requests, RSS {start} -> {end} MiB"
         + (f" ({growth:+.2%})" if growth is not None else ""))
    return soak


def _level_line(level: dict[str, Any]) -> str:
    first = level.get("first_audio_ms") or {}
    engine = level.get("engine") or {}
    checks = ", ".join(f"{k} {v}" for k, v in level["checks"].items() if v)
    return (f"  {level['clients']:>3} clients: {level['requests']} requests in {level['seconds']:.1f} s, "
            f"{level['frames_per_s']:.1f} frames/s (engine {engine.get('frames_per_s', math.nan):.1f}), first audio "
            f"p50 {first.get('p50', math.nan):.0f} ms (engine "
            f"{(engine.get('first_audio_ms') or {}).get('p50', math.nan):.0f}); {checks}")


# ---------------------------------------------------------------------------------------------
# command line


def _bundle_for_preset(preset: str, cache: str | None, quiet: bool) -> str:
    """The bench's cpu int4 bundle of ``preset`` (built once into the bench cache and reused)."""
    from bench.run import BenchOptions, bundle_for, cache_dir, checkpoint_for
    from bench.systems import parse_system

    options = BenchOptions(preset=preset, cache=cache, quiet=quiet)
    root = cache_dir(options)
    checkpoint, _ = checkpoint_for(options, root)
    path, _ = bundle_for(parse_system("cpu-int4"), options, checkpoint, root)
    return str(path)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.serve_load",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", choices=tuple(DEFAULT_REQUESTS), default="tiny",
                   help="the bench's cpu int4 bundle of this checkpoint preset (built once into the cache)")
    p.add_argument("--bundle", help="serve this bundle instead of the preset's")
    p.add_argument("--url", help="load a running server instead (its RSS only with --server-pid)")
    p.add_argument("--server-pid", type=int, help="with --url: the server's process id, for its RSS")
    p.add_argument("--label", help="the run's name in the report (default: target-precision)")
    p.add_argument("--clients", default=",".join(map(str, DEFAULT_CLIENTS)), help="concurrency levels")
    p.add_argument("--requests", type=int, help="requests per level, at most (default: by preset and level)")
    p.add_argument("--level-seconds", type=float, default=DEFAULT_LEVEL_SECONDS,
                   help="no request of a level starts after this many seconds")
    p.add_argument("--frames", type=int, default=DEFAULT_FRAMES, help="max_new_tokens of every request (25 per s)")
    p.add_argument("--pool", type=int, default=DEFAULT_POOL, help="distinct requests (text, seed, whole or stream)")
    p.add_argument("--soak-requests", type=int, default=DEFAULT_SOAK_REQUESTS,
                   help="requests of the RSS soak after the levels (0: none)")
    p.add_argument("--soak-clients", type=int, default=DEFAULT_SOAK_CLIENTS)
    p.add_argument("--max-batch", type=int, help="the server's --max-batch (default: the server's)")
    p.add_argument("--max-queue", type=int, help="the server's --max-queue (default: the server's)")
    p.add_argument("--request-timeout", type=float, default=DEFAULT_REQUEST_TIMEOUT)
    p.add_argument("--rounds", type=int, default=1,
                   help="run each level this many times (engine, then server) and keep each side's fastest "
                        "round (for shared machines; every round's answers are checked)")
    p.add_argument("--no-engine", action="store_true", help="skip the in-process engine figures")
    p.add_argument("--cases", help="the cases folder (default $HIGGS_PACK_CASES or ../shared/cases)")
    p.add_argument("--cache", help="cache directory (default $HIGGS_PACK_CACHE or ~/.cache/higgs-pack)")
    p.add_argument("--out", default="dist/serve-bench.json",
                   help="JSON file of runs (a run of the same label and preset is replaced), charted into "
                        "the same name with .html ('' = do not write)")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--engine-worker", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.engine_worker:
        return engine_worker(args.engine_worker, args.max_batch or 4)
    try:
        clients = tuple(int(c) for c in args.clients.split(",") if c.strip())
    except ValueError:
        _parser().error(f"--clients must be comma-separated whole numbers, got {args.clients!r}")
    if not clients or min(clients) < 1:
        _parser().error(f"--clients must be whole numbers >= 1, got {args.clients!r}")
    from bench import serve_report
    from higgs_pack.manifests.errors import HiggsPackError

    try:
        bundle = args.bundle
        if bundle is None and args.url is None:
            bundle = _bundle_for_preset(args.preset, args.cache, args.quiet)
        options = LoadOptions(
            bundle=bundle, url=args.url, server_pid=args.server_pid, preset=args.preset, label=args.label,
            clients=clients, requests={c: args.requests for c in clients} if args.requests else None,
            level_seconds=args.level_seconds, frames=args.frames, pool=args.pool, soak_requests=args.soak_requests,
            soak_clients=args.soak_clients, max_batch=args.max_batch, max_queue=args.max_queue,
            request_timeout=args.request_timeout, engine=not args.no_engine, cases=args.cases, cache=args.cache,
            rounds=args.rounds, quiet=args.quiet)
        record = run_load(options)
    except (HiggsPackError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    record["goals"] = [{"goal": g, "met": met, "measured": m} for g, met, m in serve_report.goal_checks(record)]
    print(serve_report.render(record))
    if args.out:
        out = Path(args.out)
        serve_report.write_run(record, out)
        print(f"wrote {out}")
        try:
            print(f"wrote {serve_report.write_html(out)}")
        except HiggsPackError as exc:
            print(f"note: no HTML report: {exc}", file=sys.stderr)
    return 1 if any(g["met"] is False for g in record["goals"]) else 0


if __name__ == "__main__":
    sys.exit(main())

"""Load test of ``higgs-pack serve`` (``nox -s serve-bench``): concurrent HTTP clients against a
live server on 127.0.0.1, beside the same requests through the engine in its own process.

The server (started here, or ``--url``) and the engine process at the server's batch; the engine
runs every request of the pool alone (the references); then per level of clients the engine and
the server get the level's requests (at one client in turn, request by request), each level
bounded by its request count and seconds, ``--rounds`` keeping each side's fastest; then a soak
reading the server's RSS every 50 answers.  Every answer is checked (:mod:`bench.serving.checks`);
``--live-sessions``: the live WebSocket (:mod:`bench.serving.live`).  docs/benchmarks/serve-load.md.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from bench.common.systems import cpu_s, machine, rss_mb
from bench.serving import report as serve_report
from bench.serving.checks import (
    ANSWER_COLUMNS,
    CATEGORIES,
    FRAME_SAMPLES,
    Expected,
    Job,
    Observed,
    Verdict,
    case_texts,
    check,
    request_pool,
)
from bench.serving.live import run_live
from bench.serving.stall import run_stall
from bench.serving.workers import EngineProcess, ServerProcess, scrape
from higgs_pack.errors import HiggsPackError, InputError

DEFAULT_CLIENTS = (1, 4, 16, 64)
#: Requests per level, at most, by preset (the level's seconds bound it too).
DEFAULT_REQUESTS = {"tiny": {1: 24, 4: 48, 16: 96, 64: 192}, "bench": {1: 12, 4: 24, 16: 48, 64: 128}}
#: The server's RSS is read every this many answers of the soak.
SOAK_READ_EVERY = 50


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
    level_seconds: float = 120.0
    frames: int = 50
    pool: int = 48
    soak_requests: int = 500
    soak_clients: int = 16
    soak_seconds: float = 1800.0
    max_batch: int | None = None
    max_queue: int | None = None
    request_timeout: float = 300.0
    engine: bool = True
    cases: str | None = None
    cache: str | None = None
    rounds: int = 1
    live_sessions: tuple[int, ...] = ()
    live_tokens_per_s: float = 30.0
    stall: int = 0
    quiet: bool = False


@dataclass
class LevelRun:
    """One level's answers (in the order sent), its span and the RSS readings ``(answers, MiB)``."""

    observed: list[Observed] = field(default_factory=list)
    seconds: float = 0.0
    rss_mb: list[tuple[int, float | None]] = field(default_factory=list)


async def run_clients(url: str, model: str, jobs: Sequence[Job], clients: int, seconds: float, *,
                      timeout: float, pid: int | None = None, read_every: int = 0,
                      before: Callable[[Job], Any] | None = None) -> LevelRun:
    """``clients`` concurrent clients take the next job until all are sent or ``seconds`` passed (one
    in flight gets ``timeout``); a 429 waits its ``Retry-After``; ``pid``'s RSS is read every
    ``read_every`` answers; ``before(job)`` runs (in a thread) before each send, and then the level's
    seconds are the sum of the requests' (they take turns) instead of its span."""
    import httpx

    run, out, pending = LevelRun(), [], iter(jobs)
    deadline = math.inf

    async def send(http: httpx.AsyncClient, obs: Observed) -> None:
        out.append(obs)
        for o in out:  # each request's most others out at once
            o.peak_others = max(o.peak_others, len(out) - 1)
        obs.started, data = time.monotonic(), bytearray()

        async def read() -> None:
            async with http.stream("POST", url + "/v1/audio/speech", json=obs.job.body(model)) as response:
                obs.status, obs.retry_after = response.status_code, response.headers.get("retry-after")
                obs.content_type = response.headers.get("content-type", "")
                async for piece in response.aiter_raw():
                    if piece and obs.first_audio is None and obs.job.stream and obs.status == 200:
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
            obs.body, obs.ended = bytes(data), time.monotonic()
            out.remove(obs)

    async def client(http: httpx.AsyncClient) -> None:
        for job in pending:
            if time.monotonic() >= deadline:
                return
            if before is not None:
                await asyncio.get_running_loop().run_in_executor(None, before, job)
            obs = Observed(job)
            run.observed.append(obs)  # kept when the hard limit cancels it: lost or truncated
            await send(http, obs)
            if pid and read_every and len(run.observed) % read_every == 0:
                run.rss_mb.append((len(run.observed), rss_mb(pid)))
            if obs.status == 429 and (obs.retry_after or "").isdigit():
                await asyncio.sleep(max(0.0, min(float(obs.retry_after), deadline - time.monotonic())))

    limits = httpx.Limits(max_connections=clients + 4, max_keepalive_connections=clients + 4)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout, connect=30.0), limits=limits) as http:
        deadline = time.monotonic() + seconds
        done, late = await asyncio.wait([asyncio.create_task(client(http)) for _ in range(clients)],
                                        timeout=seconds + timeout + 30.0)
        for task in late:
            task.cancel()
        await asyncio.gather(*late, return_exceptions=True)
        for task in done:
            task.result()
    if run.observed:  # from the first send to the last byte
        run.seconds = (sum(o.ended - o.started for o in run.observed) if before is not None else
                       max(o.ended for o in run.observed) - min(o.started for o in run.observed))
    return run


def percentiles(values_s: Sequence[float]) -> dict[str, float] | None:
    """``{"n", "p50", "p95", "p99", "max", "mean"}`` of seconds, in ms; None when empty."""
    if not values_s:
        return None
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    p50, p95, p99 = np.percentile(ms, [50, 95, 99])
    return {"n": len(ms), "p50": float(p50), "p95": float(p95), "p99": float(p99), "max": float(ms.max()),
            "mean": float(ms.mean())}


def _batch_figures(stats: dict[str, float]) -> dict[str, Any]:
    """Mean rows per decode step and the step's ms, from engine counter deltas."""
    steps = stats.get("engine_steps")
    return {"engine_steps": steps, "mean_rows_per_step": stats.get("engine_frames", math.nan) / steps,
            "step_ms": 1e3 * stats.get("engine_step_seconds", math.nan) / steps} if steps else {}


def summarize_http(run: LevelRun, verdicts: Sequence[Verdict]) -> dict[str, Any]:
    """A level's figures: requests and frames per second (answers with audio), first audio (streams)
    and latency, counts by status and category, bit-exact answers, the first problems, every answer."""
    pairs = list(zip(run.observed, verdicts, strict=True))
    audio = [(o, v) for o, v in pairs if v.category in ("ok", "length_differs")]
    frames, span = sum(v.frames for _, v in audio), run.seconds or math.nan
    statuses = [str(o.status) if o.status is not None else "none" for o in run.observed]
    t0 = min((o.started for o in run.observed), default=0.0)
    problems = [{"job": o.job.index, "category": v.category, "detail": v.detail}
                for o, v in pairs if v.category not in ("ok", "rejected")]

    def ms(a: float | None, b: float) -> float | None:
        return None if a is None else round(1e3 * (a - b), 1)

    return {
        "requests": len(run.observed), "answered_audio": len(audio), "seconds": run.seconds,
        "requests_per_s": len(audio) / span, "sent_per_s": len(run.observed) / span,
        "frames": frames, "frames_per_s": frames / span, "audio_s": frames / 25.0,
        "first_audio_ms": percentiles([o.first_audio - o.started for o, _ in audio if o.first_audio is not None]),
        "latency_ms": percentiles([o.ended - o.started for o, _ in audio]),
        "latency_whole_ms": percentiles([o.ended - o.started for o, _ in audio if not o.job.stream]),
        "latency_stream_ms": percentiles([o.ended - o.started for o, _ in audio if o.job.stream]),
        "by_status": {s: statuses.count(s) for s in sorted(set(statuses))},
        "checks": {c: sum(v.category == c for v in verdicts) for c in CATEGORIES},
        "exact": sum(v.exact for v in verdicts), "problems": problems[:8], "problems_total": len(problems),
        "answers_columns": list(ANSWER_COLUMNS),
        "answers": [[o.job.index, o.job.stream, o.status, v.category, ms(o.started, t0), ms(o.ended, o.started),
                     ms(o.first_audio, o.started), v.frames,
                     int(o.retry_after) if (o.retry_after or "").isdigit() else None] for o, v in pairs],
    }


def summarize_engine(answer: dict[str, Any]) -> dict[str, Any]:
    """The engine process's figures of a level (its ``level`` answer)."""
    rows, span, cpu = answer["rows"], answer["seconds"] or math.nan, answer.get("cpu_s")
    audio = [r for r in rows if r["category"] in ("ok", "length_differs")]
    frames = sum(r["samples"] for r in audio) / FRAME_SAMPLES
    return {
        "requests": len(rows), "seconds": answer["seconds"], "requests_per_s": len(audio) / span,
        "frames": frames, "frames_per_s": frames / span, "cpu_s": cpu, "frames_per_cpu_s": frames / cpu if cpu else None,
        "first_audio_ms": percentiles([r["first_audio_s"] for r in audio if r["first_audio_s"] is not None]),
        "latency_ms": percentiles([r["latency_s"] for r in audio]),
        "submit_ms": percentiles([r["submit_s"] for r in audio if r.get("submit_s") is not None]),
        "checks": {c: sum(r["category"] == c for r in rows) for c in ("ok", "length_differs", "error")},
        "exact": sum(bool(r["exact"]) for r in rows), **_batch_figures(answer["stats"]),
    }


def _http_level(url: str, pid: int | None, clients: int, capacity: int, expected: dict[int, Expected],
                measure: Callable[[], LevelRun]) -> dict[str, Any]:
    """One HTTP level's figures: ``measure()`` runs its clients, the server's counters, RSS and CPU
    seconds read around it, every answer checked."""
    before, rss_start = scrape(url), rss_mb(pid) if pid else None
    server_cpu, client_cpu = cpu_s(pid) if pid else None, cpu_s()
    run = measure()
    server_now = cpu_s(pid) if pid else None
    server_cpu = server_now - server_cpu if server_cpu is not None and server_now is not None else None
    figures = summarize_http(run, [check(o, expected.get(o.job.index), capacity, alone=clients == 1)
                                   for o in run.observed])
    delta = {k: v - before.get(k, 0.0) for k, v in scrape(url).items()}
    figures.update({"rss_start_mb": rss_start, "rss_end_mb": rss_mb(pid) if pid else None, "server_cpu_s": server_cpu,
                    "client_cpu_s": cpu_s() - client_cpu, "server_frames": delta.get("frames"), **_batch_figures(delta)})
    if server_cpu:
        figures["frames_per_server_cpu_s"] = figures["frames"] / server_cpu
    if delta.get("first_audio_count"):  # the server's own view: its stream start to its first chunk
        figures["server_first_audio_ms_mean"] = 1e3 * delta["first_audio_seconds"] / delta["first_audio_count"]
    if delta.get("request_count"):
        figures["server_request_ms_mean"] = 1e3 * delta["request_seconds"] / delta["request_count"]
    return figures


def keep_fastest(clients: int, allowed: int, rounds: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """A level from its rounds (``{"http", "engine"}`` each): each side's fastest round, the checks of
    every round (``checks_all_rounds``), the RSS from the first start to the last end, each round's
    HTTP over engine frames/s (``paired_ratios``, median) and frames per CPU second of the server
    over the engine's (``cpu_efficiency``), and each round's main figures."""
    best = max(rounds, key=lambda r: r["http"]["frames_per_s"])
    level: dict[str, Any] = {"clients": clients, "requests_allowed": allowed, **best["http"]}
    engines = [r["engine"] for r in rounds if r.get("engine")]
    if engines:
        level["engine"] = max(engines, key=lambda e: e["frames_per_s"])
        paired = [r["http"]["frames_per_s"] / r["engine"]["frames_per_s"] for r in rounds
                  if (r.get("engine") or {}).get("frames_per_s")]
        level.update(paired_ratios=paired, paired_ratio_median=float(np.median(paired)) if paired else None)
        server_cpu = [r["http"].get("server_cpu_s") for r in rounds]
        if all(server_cpu) and all(e.get("cpu_s") for e in engines):
            level["cpu_efficiency"] = ((sum(r["http"]["frames"] for r in rounds) / sum(server_cpu))
                                       / (sum(e["frames"] for e in engines) / sum(e["cpu_s"] for e in engines)))
    level["checks_all_rounds"] = {c: sum(r["http"]["checks"][c] for r in rounds) for c in CATEGORIES}
    level["rss_start_mb"], level["rss_end_mb"] = rounds[0]["http"]["rss_start_mb"], rounds[-1]["http"]["rss_end_mb"]
    level["rounds"] = [{"frames_per_s": r["http"]["frames_per_s"],
                        "first_audio_p50_ms": (r["http"]["first_audio_ms"] or {}).get("p50"),
                        "engine_frames_per_s": (r.get("engine") or {}).get("frames_per_s"),
                        "engine_first_audio_p50_ms": ((r.get("engine") or {}).get("first_audio_ms") or {}).get("p50"),
                        "checks": r["http"]["checks"]} for r in rounds]
    return level


def _machine() -> dict[str, Any]:
    try:
        uptime = subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        uptime = None
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    return {**machine(), "loadavg": list(load) if load else None, "uptime": uptime}


def run_load(options: LoadOptions) -> dict[str, Any]:
    """One load test; its record for :func:`bench.serving.report.write_run`.  RuntimeError when the
    server or the engine does not start; InputError without a bundle, URL or texts."""
    if not options.bundle and not options.url:
        raise InputError("give a bundle (--bundle, --preset) or a running server (--url)")
    say = (lambda m: None) if options.quiet else (lambda m: print(m, file=sys.stderr, flush=True))
    cases = Path(options.cases or os.environ.get("HIGGS_PACK_CASES") or Path(__file__).resolve().parents[3]
                 / "shared" / "cases")
    pool = request_pool(case_texts(cases), options.pool, options.frames)
    counts = {**DEFAULT_REQUESTS.get(options.preset, {}), **(options.requests or {})}
    record: dict[str, Any] = {
        "kind": "serve-bench", "preset": options.preset, "bundle": str(options.bundle or ""),
        "machine_before": _machine(), "frames_per_request": options.frames, "pool": len(pool),
        "level_seconds": options.level_seconds, "request_timeout_s": options.request_timeout,
        "client": "httpx.AsyncClient, one asyncio loop in the measuring process"}
    server = engine = None
    timeout = options.request_timeout
    try:
        if options.url:
            url, pid = options.url.rstrip("/"), options.server_pid
        else:
            say(f"starting the server on {options.bundle}")
            t0 = time.monotonic()
            server = ServerProcess(options.bundle, [
                *(["--max-batch", str(options.max_batch)] if options.max_batch else []),
                *(["--max-queue", str(options.max_queue)] if options.max_queue is not None else [])], options.cache)
            url, pid, record["server_start_s"] = server.url, server.pid, time.monotonic() - t0
        import httpx

        ready = httpx.get(url + "/ready", timeout=30).json()
        model, capacity = ready["bundle"], ready["max_batch"] + ready["max_queue"]
        record.update({"label": options.label or f"{ready['target']}-{ready['precision']}", "model": model,
                       "server": {"url": url, "pid": pid, "capacity": capacity, "started_here": server is not None,
                                  **{k: ready[k] for k in ("max_batch", "max_queue", "backend", "device", "batching")}},
                       "rss_start_mb": rss_mb(pid) if pid else None})
        expected: dict[int, Expected] = {}
        if options.engine and options.bundle:
            say(f"starting the engine process (max_batch {ready['max_batch']}); references: {len(pool)} requests")
            engine = EngineProcess(options.bundle, ready["max_batch"], options.cache)
            rows = engine.ask({"task": "reference", "jobs": pool}, timeout * len(pool))["rows"]
            bad = [r for r in rows if r["category"] == "error"]
            if bad:
                raise RuntimeError(f"the engine failed on its own: job {bad[0]['job']}: {bad[0]['detail']}")
            expected = {r["job"]: Expected(r["samples"], r["sha256"]) for r in rows}
            record["reference"] = {"requests": len(rows), "samples": [r["samples"] for r in rows],
                                   "frames_at_cap": sum(r["samples"] == options.frames * FRAME_SAMPLES for r in rows)}
        record["levels"] = [_level(url, model, pid, capacity, clients, pool, counts, engine, expected, options, say)
                            for clients in options.clients]
        if engine is not None:
            engine.close()
            engine = None
        for n, sessions in enumerate(options.live_sessions):  # each run starts at another text and seed
            say(f"live: {sessions} sessions, text at {options.live_tokens_per_s:g} tokens/s")
            record.setdefault("live", []).append(run_live(url, case_texts(cases), sessions,
                                                          options.live_tokens_per_s, timeout, first=n))
        if options.stall > 0:
            say(f"stall: /health while {options.stall} cloning requests and a voice upload run")
            record["stall"] = run_stall(url, model, options.stall, timeout=timeout)
        if options.soak_requests > 0:
            say(f"soak: {options.soak_requests} requests at {options.soak_clients} clients")
            record["soak"] = _soak(url, model, pid, capacity, pool, expected, options)
        record["rss_end_mb"] = rss_mb(pid) if pid else None
        record["machine_after"] = {k: v for k, v in _machine().items() if k in ("loadavg", "uptime")}
    finally:
        if engine is not None:
            engine.close()
        if server is not None:
            record["server_exit"] = server.stop()
            record["server_log_tail"] = [line.rstrip() for line in server.log[-20:]]
    return record


def _level(url: str, model: str, pid: int | None, capacity: int, clients: int, pool: list[Job],
           counts: dict[int, int], engine: EngineProcess | None, expected: dict[int, Expected],
           options: LoadOptions, say: Callable[[str], None]) -> dict[str, Any]:
    """One level of ``clients``: its rounds (the engine's figures beside the server's, at one client
    in turn request by request), kept by :func:`keep_fastest`."""
    timeout = options.request_timeout

    def engine_level(jobs: list[Job], clients: int, seconds: float) -> dict[str, Any]:
        return engine.ask({"task": "level", "jobs": jobs, "clients": clients, "seconds": seconds,
                           "expected": expected}, timeout=seconds + timeout + 60)

    jobs = [pool[i % len(pool)] for i in range(counts.get(clients, max(24, 8 * clients)))]
    rounds = []
    for round_ in range(max(1, options.rounds)):
        say(f"{clients} clients: {len(jobs)} requests" + (f" (round {round_ + 1})" if options.rounds > 1 else ""))
        one: dict[str, Any] = {}
        turns: list[dict[str, Any]] = []
        if engine is not None and clients > 1:
            one["engine"] = summarize_engine(engine_level(jobs, clients, options.level_seconds))
        before = (lambda job, t=turns: t.append(engine_level([job], 1, timeout))) if engine and clients == 1 else None
        one["http"] = _http_level(url, pid, clients, capacity, expected, lambda b=before: asyncio.run(
            run_clients(url, model, jobs, clients, options.level_seconds, timeout=timeout, before=b)))
        if turns:  # one client: the engine and the server in turn, request by request
            one["engine"] = summarize_engine({
                "rows": [row for t in turns for row in t["rows"]], "seconds": sum(t["seconds"] for t in turns),
                "cpu_s": sum(t.get("cpu_s") or 0.0 for t in turns),
                "stats": {k: sum(t["stats"][k] for t in turns) for k in turns[0]["stats"]}})
        rounds.append(one)
    level = keep_fastest(clients, len(jobs), rounds)
    say(f"  {clients:>3} clients: {level['frames_per_s']:.1f} frames/s (engine "
        f"{(level.get('engine') or {}).get('frames_per_s', math.nan):.1f}); "
        + ", ".join(f"{k} {v}" for k, v in level["checks"].items() if v))
    return level


def _soak(url: str, model: str, pid: int | None, capacity: int, pool: list[Job], expected: dict[int, Expected],
          options: LoadOptions) -> dict[str, Any]:
    """The soak: its figures and the server's RSS every :data:`SOAK_READ_EVERY` answers."""
    start = rss_mb(pid) if pid else None
    run = asyncio.run(run_clients(url, model, [pool[i % len(pool)] for i in range(options.soak_requests)],
                                  options.soak_clients, options.soak_seconds, timeout=options.request_timeout,
                                  pid=pid, read_every=SOAK_READ_EVERY))
    end = rss_mb(pid) if pid else None
    return {"clients": options.soak_clients, **summarize_http(run, [
        check(o, expected.get(o.job.index), capacity) for o in run.observed]),
        "rss_start_mb": start, "rss_end_mb": end, "rss_growth": (end - start) / start if start and end else None,
        "rss_readings": [[n, mb] for n, mb in [(0, start), *run.rss_mb, (len(run.observed), end)]]}


def _bundle_for_preset(preset: str, cache: str | None, quiet: bool) -> str:
    """The bench's cpu int4 bundle of ``preset`` (built once into the bench cache and reused)."""
    from bench.common.systems import parse_system
    from bench.decoder.run import BenchOptions, bundle_for, cache_dir, checkpoint_for

    options = BenchOptions(preset=preset, cache=cache, quiet=quiet)
    checkpoint, _ = checkpoint_for(options, cache_dir(options))
    return str(bundle_for(parse_system("cpu-int4"), options, checkpoint, cache_dir(options))[0])


#: Help of the flags whose name does not say it all.
HELP = {"preset": "tiny or bench: the bench's cpu int4 bundle of this preset", "url": "load a running server instead",
        "server_pid": "with --url: the server's process id (its RSS)", "pool": "distinct requests",
        "level_seconds": "no request of a level starts after this", "frames": "max_new_tokens of every request",
        "rounds": "run each level this many times, keep each side's fastest", "soak_requests": "0: no soak",
        "live_tokens_per_s": "pieces of text (about 4 characters each) a live session sends per second",
        "stall": "cloning requests (10-s clips) sent with a voice upload while /health is timed: how long the "
                 "event loop is held (bench/serving/stall.py; 0: none)"}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.serving.load", description=__doc__.split("\n\n")[0])
    for f in fields(LoadOptions):  # a flag per option of a plain type, default and type from LoadOptions
        kind = {"int": int, "float": float, "str": str}.get(str(f.type).split(" |")[0])
        if kind is not None:
            p.add_argument("--" + f.name.replace("_", "-"), type=kind, default=f.default, help=HELP.get(f.name))
    p.add_argument("--clients", default=",".join(map(str, DEFAULT_CLIENTS)), help="concurrency levels")
    p.add_argument("--requests", type=int, help="requests per level, at most (default: by preset and level)")
    p.add_argument("--live-sessions", default="", help="live WebSocket sessions at once, text streamed in: a run "
                                                       "per comma-separated count, each from the next text (e.g. "
                                                       "1,1,1,8: three single sessions, then eight; default none)")
    p.add_argument("--no-engine", dest="engine", action="store_false", help="skip the in-process engine figures")
    p.add_argument("--quiet", action="store_true")
    p.add_argument("--out", default="dist/serve-bench.json", help="JSON runs (same label and preset replaced), .html")
    args = p.parse_args(argv)
    for flag, least in (("clients", 1), ("live_sessions", 0)):  # the counts it needs at least
        try:
            counts = tuple(int(c) for c in getattr(args, flag).split(",") if c.strip())
        except ValueError:
            counts = (0,)
        if len(counts) < least or min(counts, default=1) < 1:
            p.error(f"--{flag.replace('_', '-')} must be comma-separated whole numbers >= 1")
        setattr(args, flag, counts)
    args.requests = dict.fromkeys(args.clients, args.requests) if args.requests else None
    if args.preset not in DEFAULT_REQUESTS:
        p.error(f"--preset must be one of {', '.join(DEFAULT_REQUESTS)}")
    options = LoadOptions(**{f.name: getattr(args, f.name) for f in fields(LoadOptions)})
    try:
        if not options.bundle and not options.url:
            options.bundle = _bundle_for_preset(options.preset, options.cache, options.quiet)
        record = run_load(options)
    except (HiggsPackError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    record["goals"] = [{"goal": g, "met": met, "measured": m} for g, met, m in serve_report.goal_checks(record)]
    print(serve_report.render(record))
    if args.out:
        serve_report.write_run(record, Path(args.out))
        print(f"wrote {args.out}")
        try:
            print(f"wrote {serve_report.write_html(Path(args.out))}")
        except HiggsPackError as exc:
            print(f"note: no HTML report: {exc}", file=sys.stderr)
    return 1 if any(g["met"] is False for g in record["goals"]) else 0


if __name__ == "__main__":
    sys.exit(main())

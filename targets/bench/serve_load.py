"""Load test of ``higgs-pack serve`` (issue 20 item 8): concurrent HTTP clients against a live
server on 127.0.0.1, side by side with the same requests through the engine in its own process.

``python -m higgs_pack.targets.bench.serve_load [--preset tiny|bench | --bundle PATH | --url URL]
[--clients 1,4,16,64] [--requests N] [--level-seconds S] [--soak-requests 500] [--out dist/serve-bench.json]``

What one run does, in this order (nothing else runs meanwhile, so the two processes take turns
on the CPUs):

1. the engine process (``tts.engine(max_batch)``, the server's batch) runs every request of the
   pool once, one at a time: the reference length (samples) and the sha256 of the 16-bit PCM of
   each request;
2. the server (``higgs-pack serve BUNDLE --host 127.0.0.1 --port 0``, a subprocess bounded in
   time and stopped by its process id) or ``--url``;
3. per concurrency level (1, 4, 16, 64 clients): the engine process runs the level's requests
   with as many threads as clients, then the server gets the same requests from as many
   asyncio clients (one ``httpx.AsyncClient``); each level is bounded by its request count and
   its seconds (no request starts after them; one in flight gets ``--request-timeout``);
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
milliseconds; RSS in MiB (``VmRSS`` of ``/proc/PID/status``).  The figures are written by
:mod:`higgs_pack.targets.bench.serve_report` (``dist/serve-bench.json`` and ``.html``).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import io
import json
import math
import os
import queue
import re
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

#: Samples per audio frame at 24 kHz (25 frames per second).
FRAME_SAMPLES = 960
SAMPLE_RATE = 24000
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
#: Most seconds a server started here may live, and may take to get ready.
SERVER_LIFETIME_S = 3600.0
SERVER_START_S = 300.0
#: How an answer is counted.
#:
#: ``ok``: complete audio of the reference length; ``length_differs``: complete and well-formed
#: audio of another length (on an int4 bundle a request's codes can depend on which rows share
#: its steps, so a request run beside others may stop at another frame than alone; at one client
#: there are no others and this counts as ``truncated``); ``rejected``: 429 ``queue_full`` while
#: the queue was full; ``error``: another status with OpenAI's error body; ``lost``: no answer (a
#: refused connection, a timeout before the headers); ``truncated``: audio that broke off (the
#: body ended early, a WAV shorter than its header says, half a sample); ``malformed``: not what
#: it says (unreadable audio, a wrong media type or rate, no error body); ``unjustified_429``: a
#: 429 while fewer than ``max_batch + max_queue`` other requests were out, or one not saying
#: ``queue_full``.
CATEGORIES = ("ok", "length_differs", "rejected", "error", "lost", "truncated", "malformed", "unjustified_429")
#: The fields of each answer a level keeps (``answers``): times in ms from the level's first send.
ANSWER_COLUMNS = ("job", "stream", "status", "category", "sent_ms", "latency_ms", "first_audio_ms", "frames")
#: The categories the goals allow none of.
FAILURES = ("lost", "truncated", "malformed", "unjustified_429")


@dataclass(frozen=True)
class Job:
    """One request of the pool.

    Attributes:
        index: its place in the pool; also its seed.
        text: what is said.
        seed: sampling seed.
        stream: True: ``stream_format="audio"`` with ``response_format="pcm"``; False: a whole WAV.
        frames: ``max_new_tokens`` (25 per second).
    """

    index: int
    text: str
    seed: int
    stream: bool
    frames: int

    def body(self, model: str) -> dict[str, Any]:
        """The ``POST /v1/audio/speech`` body."""
        body = {"model": model, "input": self.text, "voice": "default", "seed": self.seed,
                "max_new_tokens": self.frames, "response_format": "pcm" if self.stream else "wav"}
        if self.stream:
            body["stream_format"] = "audio"
        return body


def case_texts(cases: Path) -> list[str]:
    """The non-empty lines of the cases' texts (English, then Chinese)."""
    texts = []
    for name in ("text_en_basic.txt", "text_zh.txt"):
        path = cases / name
        if path.is_file():
            texts += [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not texts:
        from higgs_pack.manifests.errors import InputError

        raise InputError(f"no texts in {cases} (text_en_basic.txt, text_zh.txt); give the cases folder with --cases "
                         "or $HIGGS_PACK_CASES")
    return texts


def request_pool(texts: Sequence[str], size: int, frames: int) -> list[Job]:
    """``size`` jobs: text ``i mod len(texts)``, seed ``i``, whole and streamed in turn; with an
    even number of texts the turn shifts by one at each pass over them, so every text is asked
    both ways."""
    shift = len(texts) % 2 == 0
    return [Job(i, texts[i % len(texts)], i, (i + (i // len(texts) if shift else 0)) % 2 == 1, frames)
            for i in range(size)]


def pcm16(samples: np.ndarray) -> bytes:
    """Float samples as the server sends them: clipped to [-1, 1], 16-bit little-endian."""
    from higgs_pack.runtime.audio import pcm_samples

    return pcm_samples(np.clip(np.asarray(samples, dtype=np.float32).reshape(-1), -1.0, 1.0)).tobytes()


@dataclass(frozen=True)
class Expected:
    """A job's reference answer (the engine, one request at a time): ``samples`` at 24 kHz and
    the sha256 of their 16-bit PCM."""

    samples: int
    sha256: str


# ---------------------------------------------------------------------------------------------
# the checker


@dataclass
class Observed:
    """What the client saw of one request.

    Attributes:
        job: the request.
        status: HTTP status, None when no answer came.
        content_type: the answer's ``Content-Type``.
        retry_after: its ``Retry-After`` header, or None.
        body: the bytes received.
        error: the transport error that ended the request (``ReadTimeout: ...``), or None.
        started, first_audio, ended: ``time.monotonic()`` at the send, at the first audio byte
            (streams; None otherwise) and at the end.
        peak_others: most other requests of this run out at once while it was.
    """

    job: Job
    status: int | None = None
    content_type: str = ""
    retry_after: str | None = None
    body: bytes = b""
    error: str | None = None
    started: float = 0.0
    first_audio: float | None = None
    ended: float = 0.0
    peak_others: int = 0


@dataclass(frozen=True)
class Verdict:
    """How one answer counts: a :data:`CATEGORIES` name, why, its audio frames (960 samples
    each; 0 when not audio) and whether its PCM equals the reference's bit for bit."""

    category: str
    detail: str = ""
    frames: float = 0.0
    exact: bool = False


def check(obs: Observed, expected: Expected | None, capacity: int | None, *, alone: bool = False) -> Verdict:
    """Judge one answer (see :data:`CATEGORIES`).

    Args:
        obs: what the client saw.
        expected: the job's reference, or None (the length is then not compared).
        capacity: ``max_batch + max_queue`` of the server (None: a 429 is not judged by it).
        alone: no other request was out (one client): a length other than the reference's is
            ``truncated`` (shorter) or ``malformed`` (longer), not ``length_differs``.

    Returns:
        A :class:`Verdict`.
    """
    if obs.status is None:
        return Verdict("lost", obs.error or "no answer")
    if obs.status == 200:
        if obs.error:
            return Verdict("truncated", f"the body broke off after {len(obs.body)} bytes: {obs.error}")
        return _check_audio(obs, expected, alone)
    error = _error_body(obs.body)
    if error is None:
        return Verdict("malformed", f"status {obs.status} without OpenAI's error body: {obs.body[:160]!r}"
                       + (f" ({obs.error})" if obs.error else ""))
    if obs.status == 429:
        if error.get("code") != "queue_full" or not (obs.retry_after or "").isdigit():
            return Verdict("unjustified_429", f"429 with code {error.get('code')!r} and Retry-After "
                           f"{obs.retry_after!r} (expected queue_full and whole seconds)")
        if capacity is not None and obs.peak_others < capacity:
            return Verdict("unjustified_429", f"429 queue_full while at most {obs.peak_others} other requests were "
                           f"out (the queue holds {capacity})")
        return Verdict("rejected", f"429 queue_full, Retry-After {obs.retry_after} s")
    return Verdict("error", f"{obs.status} {error.get('code')}: {str(error.get('message'))[:160]}")


def _error_body(body: bytes) -> dict[str, Any] | None:
    """The ``error`` object of OpenAI's body shape, or None when the body is not one."""
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    error = data.get("error") if isinstance(data, dict) else None
    if not isinstance(error, dict) or not {"message", "type", "param", "code"} <= set(error):
        return None
    return error if isinstance(error["message"], str) and error["message"] else None


def _check_audio(obs: Observed, expected: Expected | None, alone: bool) -> Verdict:
    job = obs.job
    want = "audio/pcm" if job.stream else "audio/wav"
    if not obs.content_type.startswith(want):
        return Verdict("malformed", f"Content-Type {obs.content_type!r}, expected {want}")
    if job.stream:
        if len(obs.body) % 2:
            return Verdict("truncated", f"{len(obs.body)} bytes of 16-bit PCM: it broke off inside a sample")
        pcm = obs.body
    else:
        pcm, problem = wav_pcm(obs.body)
        if problem:
            return Verdict("truncated" if problem.startswith("short") else "malformed", problem)
    samples = len(pcm) // 2
    frames = samples / FRAME_SAMPLES
    if samples == 0:
        return Verdict("malformed", "no audio samples")
    if expected is None:
        return Verdict("ok", "", frames)
    if samples == expected.samples:
        return Verdict("ok", "", frames, hashlib.sha256(pcm).hexdigest() == expected.sha256)
    what = f"{samples} samples, the reference has {expected.samples}"
    if samples > job.frames * FRAME_SAMPLES * 2:
        return Verdict("malformed", f"{what}: more than the {job.frames} frames asked")
    if alone:
        return Verdict("truncated" if samples < expected.samples else "malformed", f"{what}, with no other request out")
    return Verdict("length_differs", what, frames)


def wav_pcm(data: bytes) -> tuple[bytes, str]:
    """The 16-bit PCM of a whole WAV file, and "" or what is wrong with it.

    The RIFF chunks are walked to the ``data`` chunk, whose declared size must be there in full
    ("short: ..." when fewer bytes came: a truncated file); the format must be 16-bit PCM mono at
    24 kHz, and libsndfile must read the file to the same samples.
    """
    import soundfile as sf

    if len(data) < 12 or data[:4] != b"RIFF" or data[8:12] != b"WAVE":
        return b"", f"not a RIFF/WAVE file ({len(data)} bytes, starts {data[:12]!r})"
    pos, fmt = 12, None
    while pos + 8 <= len(data):
        tag, size = data[pos:pos + 4], struct.unpack("<I", data[pos + 4:pos + 8])[0]
        body = data[pos + 8:pos + 8 + size]
        if tag == b"fmt ":
            fmt = struct.unpack("<HHIIHH", body[:16]) if len(body) >= 16 else None
        elif tag == b"data":
            if len(body) < size:
                return b"", f"short: the data chunk declares {size} bytes and {len(body)} came"
            if fmt is None or fmt[0] != 1 or fmt[1] != 1 or fmt[2] != SAMPLE_RATE or fmt[5] != 16:
                return b"", f"format {fmt} is not 16-bit PCM mono at {SAMPLE_RATE} Hz"
            try:
                read, rate = sf.read(io.BytesIO(data), dtype="int16")
            except (RuntimeError, sf.LibsndfileError) as exc:
                return b"", f"libsndfile cannot read it: {exc}"
            if rate != SAMPLE_RATE or read.ndim != 1 or read.astype("<i2").tobytes() != body:
                return b"", "libsndfile reads other samples than the data chunk holds"
            return body, ""
        pos += 8 + size + (size & 1)
    return b"", "short: no complete data chunk" if fmt is not None else "no fmt and data chunks"


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
        A :class:`LevelRun` (answers in the order they ended).
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


def rss_mb(pid: int) -> float | None:
    """Resident memory of process ``pid`` (``VmRSS``), MiB; None when it cannot be read."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024
    except (OSError, ValueError):
        pass
    return None


def scrape(url: str) -> dict[str, float]:
    """The server's frame and step counters from ``/metrics`` ({} when it has none)."""
    import httpx

    names = ("higgs_pack_frames_total", "higgs_pack_engine_frames_total", "higgs_pack_engine_steps_total",
             "higgs_pack_engine_step_seconds_total")
    try:
        text = httpx.get(url + "/metrics", timeout=30).text
    except httpx.HTTPError:
        return {}
    found = {}
    for name in names:
        match = re.search("^" + re.escape(name) + r"(?:\{\})? (\S+)$", text, re.MULTILINE)
        if match:
            found[name.removeprefix("higgs_pack_").removesuffix("_total")] = float(match.group(1))
    return found


# ---------------------------------------------------------------------------------------------
# figures


def percentiles(values_s: Sequence[float]) -> dict[str, float] | None:
    """``{"n", "p50", "p95", "p99", "max"}`` of seconds, in milliseconds; None when empty."""
    if not values_s:
        return None
    ms = np.asarray(values_s, dtype=np.float64) * 1e3
    p50, p95, p99 = np.percentile(ms, [50, 95, 99])
    return {"n": len(ms), "p50": float(p50), "p95": float(p95), "p99": float(p99), "max": float(ms.max())}


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
                     None if o.first_audio is None else round(1e3 * (o.first_audio - o.started), 1), v.frames]
                    for o, v in zip(run.observed, verdicts, strict=True)],
    }


def summarize_engine(rows: Sequence[dict[str, Any]], seconds: float, stats: dict[str, float]) -> dict[str, Any]:
    """The engine process's figures of a level (rows: ``job``, ``latency_s``, ``first_audio_s``,
    ``samples``, ``category``, ``exact``, ``stream``)."""
    audio = [r for r in rows if r["category"] in ("ok", "length_differs")]
    frames = sum(r["samples"] for r in audio) / FRAME_SAMPLES
    span = seconds or math.nan
    return {
        "requests": len(rows), "seconds": seconds, "requests_per_s": len(audio) / span,
        "frames": frames, "frames_per_s": frames / span,
        "first_audio_ms": percentiles([r["first_audio_s"] for r in audio if r["first_audio_s"] is not None]),
        "latency_ms": percentiles([r["latency_s"] for r in audio]),
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
# the engine in its own process


class EngineProcess:
    """``python -m higgs_pack.targets.bench.serve_load --engine-worker``: the bundle loaded with
    ``tts.engine(max_batch)``, driven by one JSON line per task on its stdin, each answered by
    one JSON line on its stdout.

    Args:
        bundle: the bundle directory.
        max_batch: the engine's rows (the server's).
        cache: ``$HIGGS_PACK_CACHE`` for the process (None: inherited).
    """

    def __init__(self, bundle: str | os.PathLike, max_batch: int, cache: str | None = None):
        env = {**os.environ, **({"HIGGS_PACK_CACHE": cache} if cache else {})}
        cmd = [sys.executable, "-m", "higgs_pack.targets.bench.serve_load", "--engine-worker", str(bundle),
               "--max-batch", str(max_batch)]
        self.process = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        self._lines: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(target=self._read, daemon=True).start()
        self.info = self._answer(SERVER_START_S)

    def _read(self) -> None:
        for line in self.process.stdout:
            self._lines.put(line)
        self._lines.put(None)

    def _answer(self, timeout: float) -> dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            self.close()
            raise RuntimeError(f"the engine process gave no answer within {timeout:.0f} s") from None
        if line is None:
            raise RuntimeError(f"the engine process exited with {self.process.wait()}; its log is above")
        answer = json.loads(line)
        if "error" in answer:
            raise RuntimeError(f"the engine process failed: {answer['error']}")
        return answer

    def ask(self, task: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send one task; its answer (raises RuntimeError when the process fails or is late)."""
        self.process.stdin.write(json.dumps(task) + "\n")
        self.process.stdin.flush()
        return self._answer(timeout)

    def close(self) -> None:
        """Ask it to stop; kill it after 30 s."""
        if self.process.poll() is None:
            try:
                self.process.stdin.write(json.dumps({"task": "quit"}) + "\n")
                self.process.stdin.close()
                self.process.wait(30)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait(10)


def _jobs_of(items: Sequence[dict[str, Any]]) -> list[Job]:
    return [Job(**item) for item in items]


def engine_worker(bundle: str, max_batch: int) -> int:
    """The engine process (``--engine-worker``): tasks ``reference`` (every job alone: its
    samples and PCM sha256), ``level`` (the jobs from ``clients`` threads: per-request rows and
    the span) and ``quit``.  Only answers go to stdout; anything printed goes to stderr."""
    answers = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    import higgs_pack
    from higgs_pack.runtime.request import SynthesisRequest

    def say(answer: dict[str, Any]) -> None:
        answers.write(json.dumps(answer) + "\n")
        answers.flush()

    try:
        tts = higgs_pack.load(bundle)
        engine = tts.engine(max_batch)
        engine.submit("Hello.", max_frames=8).result(timeout=600)
    except Exception as exc:
        say({"error": f"{type(exc).__name__}: {exc}"})
        return 1
    say({"max_batch": engine.max_batch, "bundle": tts.info.bundle, "pid": os.getpid()})

    def one(job: Job, expected: Expected | None) -> dict[str, Any]:
        t0 = time.perf_counter()
        first = None
        try:
            handle = engine.submit(SynthesisRequest.create(job.text, seed=job.seed, max_frames=job.frames))
            if job.stream:
                pieces = []
                for chunk in handle:
                    if first is None and len(chunk.samples):
                        first = time.perf_counter() - t0
                    pieces.append(pcm16(chunk.samples))
                pcm = b"".join(pieces)
            else:
                pcm = pcm16(handle.result(timeout=600).samples)
        except Exception as exc:  # one request failing is a figure, not the end of the run
            return {"job": job.index, "stream": job.stream, "category": "error", "detail": repr(exc),
                    "latency_s": time.perf_counter() - t0, "first_audio_s": None, "samples": 0, "exact": False}
        latency = time.perf_counter() - t0
        sha = hashlib.sha256(pcm).hexdigest()
        samples = len(pcm) // 2
        category = "ok" if expected is None or samples == expected.samples else "length_differs"
        return {"job": job.index, "stream": job.stream, "category": category, "latency_s": latency,
                "first_audio_s": first, "samples": samples, "sha256": sha,
                "exact": expected is not None and sha == expected.sha256}

    def level(jobs: list[Job], clients: int, seconds: float, expected: dict[int, Expected]) -> dict[str, Any]:
        rows: list[dict[str, Any]] = []
        lock = threading.Lock()
        pending = iter(jobs)
        before = asdict(engine.stats)
        t0 = time.perf_counter()
        deadline = t0 + seconds

        def client() -> None:
            while time.perf_counter() < deadline:
                with lock:
                    job = next(pending, None)
                if job is None:
                    return
                row = one(job, expected.get(job.index))
                with lock:
                    rows.append(row)

        threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        span = time.perf_counter() - t0
        after = asdict(engine.stats)
        stats = {"engine_steps": after["steps"] - before["steps"], "engine_frames": after["frames"] - before["frames"],
                 "engine_step_seconds": after["step_seconds"] - before["step_seconds"]}
        return {"rows": rows, "seconds": span, "stats": stats}

    for line in sys.stdin:
        task = json.loads(line)
        try:
            if task["task"] == "quit":
                break
            if task["task"] == "reference":
                rows = [one(job, None) for job in _jobs_of(task["jobs"])]
                say({"rows": rows})
            elif task["task"] == "level":
                expected = {int(k): Expected(**v) for k, v in task["expected"].items()}
                say(level(_jobs_of(task["jobs"]), task["clients"], task["seconds"], expected))
        except Exception as exc:
            say({"error": f"{type(exc).__name__}: {exc}"})
    engine.close(timeout=30)
    tts.close()
    return 0


# ---------------------------------------------------------------------------------------------
# the server


class ServerProcess:
    """``higgs-pack serve BUNDLE --host 127.0.0.1 --port 0`` in a subprocess: ready when ``/ready``
    answers 200, killed after :data:`SERVER_LIFETIME_S`, stopped by its process id.

    Attributes:
        url: ``http://127.0.0.1:PORT``.
        pid: the server's process id (the process whose RSS is read).
        log: what it printed.
    """

    def __init__(self, bundle: str | os.PathLike, args: Sequence[str] = (), cache: str | None = None,
                 lifetime: float = SERVER_LIFETIME_S):
        import httpx

        env = {**os.environ, **({"HIGGS_PACK_CACHE": cache} if cache else {})}
        cmd = [sys.executable, "-m", "higgs_pack.runtime.cli", "serve", str(bundle), "--host", "127.0.0.1",
               "--port", "0", "--log-level", "warning", *args]
        self.process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
        self.pid = self.process.pid
        self.url = ""
        self.log: list[str] = []
        bound = threading.Event()
        threading.Thread(target=self._read, args=(bound,), daemon=True).start()
        self._killer = threading.Timer(lifetime, self._kill)
        self._killer.daemon = True
        self._killer.start()
        deadline = time.monotonic() + SERVER_START_S
        if not bound.wait(SERVER_START_S) or not self.url:
            self.stop()
            raise RuntimeError("the server did not start:\n" + "".join(self.log[-30:]))
        while time.monotonic() < deadline and self.process.poll() is None:
            try:
                if httpx.get(self.url + "/ready", timeout=10).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError("the server did not get ready:\n" + "".join(self.log[-30:]))

    def _read(self, bound: threading.Event) -> None:
        for line in self.process.stdout:
            self.log.append(line)
            match = re.search(r"serving (http://127\.0\.0\.1:\d+)", line)
            if match and not self.url:
                self.url = match.group(1)
                bound.set()
        bound.set()

    def _kill(self) -> None:
        if self.process.poll() is None:
            os.kill(self.pid, signal.SIGKILL)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM to its process id, SIGKILL after ``timeout``; its exit status."""
        self._killer.cancel()
        if self.process.poll() is None:
            os.kill(self.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                os.kill(self.pid, signal.SIGKILL)
                self.process.wait(10)
        return self.process.returncode


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
    from higgs_pack.targets.bench.run import _machine as bench_machine

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
    :func:`higgs_pack.targets.bench.serve_report.write_run`.

    Raises:
        RuntimeError: the server or the engine process did not start.
        InputError: no bundle, URL or texts.
    """
    from higgs_pack.manifests.errors import InputError

    if not options.bundle and not options.url:
        raise InputError("give a bundle (--bundle, --preset) or a running server (--url)")
    cases = Path(options.cases or os.environ.get("HIGGS_PACK_CASES") or Path(__file__).resolve().parents[3]
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
            level: dict[str, Any] = {"clients": clients, "requests_allowed": len(jobs)}
            if engine is not None:
                _say(options, f"engine, {clients} clients: {len(jobs)} requests")
                answer = engine.ask({"task": "level", "jobs": [asdict(j) for j in jobs], "clients": clients,
                                     "seconds": options.level_seconds,
                                     "expected": {str(k): asdict(v) for k, v in expected.items()}},
                                    timeout=options.level_seconds + options.request_timeout + 60)
                level["engine"] = summarize_engine(answer["rows"], answer["seconds"], answer["stats"])
            _say(options, f"server, {clients} clients: {len(jobs)} requests")
            level.update(_http_level(url, model, pid, jobs, clients, options.level_seconds, capacity, expected,
                                     options))
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


def _http_level(url: str, model: str, pid: int | None, jobs: list[Job], clients: int, seconds: float,
                capacity: int, expected: dict[int, Expected], options: LoadOptions) -> dict[str, Any]:
    before = scrape(url)
    rss_start = rss_mb(pid) if pid else None
    run = asyncio.run(run_clients(url, model, jobs, clients, seconds, timeout=options.request_timeout))
    rss_end = rss_mb(pid) if pid else None
    after = scrape(url)
    verdicts = [check(o, expected.get(o.job.index), capacity, alone=clients == 1) for o in run.observed]
    figures = summarize_http(run, verdicts)
    delta = {k: after[k] - before.get(k, 0.0) for k in after}
    figures.update({"rss_start_mb": rss_start, "rss_end_mb": rss_end,
                    "server_frames": delta.get("frames"), **_batch_figures(delta)})
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
    from higgs_pack.targets.bench.run import BenchOptions, _bundle_for, _cache, _checkpoint
    from higgs_pack.targets.bench.systems import parse_system

    options = BenchOptions(preset=preset, cache=cache, quiet=quiet)
    root = _cache(options)
    checkpoint, _ = _checkpoint(options, root)
    path, _ = _bundle_for(parse_system("cpu-int4"), options, checkpoint, root)
    return str(path)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m higgs_pack.targets.bench.serve_load",
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
    from higgs_pack.manifests.errors import HiggsPackError
    from higgs_pack.targets.bench import serve_report

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
            quiet=args.quiet)
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

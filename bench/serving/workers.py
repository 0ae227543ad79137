"""The load test's other processes: :class:`ServerProcess` (``higgs-pack serve`` on 127.0.0.1),
:class:`EngineProcess` and :func:`engine_worker` (the same bundle through
``tts.engine(max_batch)``), and the server's counters (:func:`scrape`)."""

from __future__ import annotations

import contextlib
import hashlib
import multiprocessing
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from typing import Any

from bench.common.systems import cpu_s
from bench.serving.checks import Expected, Job, pcm16

#: Most seconds a server started here may live, and may take to get ready (or the engine to load).
SERVER_LIFETIME_S = 3600.0
SERVER_START_S = 300.0
#: ``/metrics`` samples :func:`scrape` reads, and their keys.
SCRAPED = (
    ("higgs_pack_frames_total", "frames"), ("higgs_pack_engine_frames_total", "engine_frames"),
    ("higgs_pack_engine_steps_total", "engine_steps"),
    ("higgs_pack_engine_step_seconds_total", "engine_step_seconds"),
    ("higgs_pack_time_to_first_audio_seconds_sum", "first_audio_seconds"),
    ("higgs_pack_time_to_first_audio_seconds_count", "first_audio_count"),
    ('higgs_pack_request_seconds_sum{route="/v1/audio/speech"}', "request_seconds"),
    ('higgs_pack_request_seconds_count{route="/v1/audio/speech"}', "request_count"),
)


def scrape(url: str) -> dict[str, float]:
    """The :data:`SCRAPED` counters of the server's ``/metrics`` ({} when it has none)."""
    import httpx

    try:
        text = httpx.get(url + "/metrics", timeout=30).text
    except httpx.HTTPError:
        return {}
    found = {}
    for sample, key in SCRAPED:
        match = re.search("^" + re.escape(sample) + r"(?:\{\})? (\S+)$", text, re.MULTILINE)
        if match:
            found[key] = float(match.group(1))
    return found


class EngineProcess:
    """The same bundle in ``tts.engine(max_batch)`` in a process of its own (:func:`engine_worker`),
    asked one task at a time over a pipe."""

    def __init__(self, bundle: str | os.PathLike, max_batch: int, cache: str | None = None):
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(target=engine_worker, args=(child, str(bundle), max_batch, cache), daemon=True)
        self.process.start()
        self.info = self._answer(SERVER_START_S)

    def _answer(self, timeout: float) -> dict[str, Any]:
        if not self.conn.poll(timeout):
            self.close()
            raise RuntimeError(f"the engine process gave no answer within {timeout:.0f} s")
        try:
            answer = self.conn.recv()
        except EOFError:
            raise RuntimeError(f"the engine process exited with {self.process.join(10) or self.process.exitcode}; "
                               "its log is above") from None
        if "error" in answer:
            raise RuntimeError(f"the engine process failed: {answer['error']}")
        return answer

    def ask(self, task: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send one task and wait for its answer (RuntimeError when the process fails or is late)."""
        self.conn.send(task)
        return self._answer(timeout)

    def close(self) -> None:
        """Ask it to stop; kill it after 30 s."""
        if self.process.is_alive():
            with contextlib.suppress(OSError):
                self.conn.send({"task": "quit"})
            self.process.join(30)
            if self.process.is_alive():
                self.process.kill()
                self.process.join(10)


def engine_worker(conn: Any, bundle: str, max_batch: int, cache: str | None) -> int:
    """The engine process: tasks ``reference`` (every job alone) and ``level`` (the jobs from
    ``clients`` threads for at most ``seconds``: a row per request, the span, the engine's counter
    deltas and CPU seconds), then ``quit``."""
    if cache:
        os.environ["HIGGS_PACK_CACHE"] = cache
    import higgs_pack
    from higgs_pack.runtime.request import SynthesisRequest

    try:
        tts = higgs_pack.load(bundle)
        engine = tts.engine(max_batch)
        engine.submit("Hello.", max_frames=8).result(timeout=600)
    except Exception as exc:
        conn.send({"error": f"{type(exc).__name__}: {exc}"})
        return 1
    conn.send({"max_batch": engine.max_batch, "bundle": tts.info.bundle, "pid": os.getpid()})

    def one(job: Job, expected: Expected | None) -> dict[str, Any]:
        t0, first, submitted = time.perf_counter(), None, None
        row: dict[str, Any] = {"job": job.index, "stream": job.stream}
        try:
            handle = engine.submit(SynthesisRequest.create(job.text, seed=job.seed, max_frames=job.frames))
            submitted = time.perf_counter() - t0
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
            return {**row, "category": "error", "detail": repr(exc), "latency_s": time.perf_counter() - t0,
                    "first_audio_s": None, "samples": 0, "exact": False}
        sha = hashlib.sha256(pcm).hexdigest()
        same = expected is None or len(pcm) // 2 == expected.samples
        return {**row, "category": "ok" if same else "length_differs", "latency_s": time.perf_counter() - t0,
                "first_audio_s": first, "submit_s": submitted, "samples": len(pcm) // 2, "sha256": sha,
                "exact": expected is not None and sha == expected.sha256}

    def level(jobs: list[Job], clients: int, seconds: float, expected: dict[int, Expected]) -> dict[str, Any]:
        rows: list[dict[str, Any]] = []
        lock, pending = threading.Lock(), iter(jobs)
        before, cpu_before, t0 = asdict(engine.stats), cpu_s(), time.perf_counter()

        def client() -> None:
            while time.perf_counter() < t0 + seconds:
                with lock:
                    job = next(pending, None)
                if job is None:
                    return
                row = one(job, expected.get(job.index))
                with lock:
                    rows.append(row)

        with ThreadPoolExecutor(clients) as pool:
            for _ in range(clients):
                pool.submit(client)
        span, after = time.perf_counter() - t0, asdict(engine.stats)
        stats = {f"engine_{k}": after[k] - before[k] for k in ("steps", "frames", "step_seconds")}
        return {"rows": rows, "seconds": span, "stats": stats, "cpu_s": cpu_s() - cpu_before}

    while True:
        task = conn.recv()
        try:
            if task["task"] == "quit":
                break
            if task["task"] == "reference":
                conn.send({"rows": [one(job, None) for job in task["jobs"]]})
            else:
                conn.send(level(task["jobs"], task["clients"], task["seconds"], task["expected"]))
        except Exception as exc:
            conn.send({"error": f"{type(exc).__name__}: {exc}"})
    engine.close(timeout=30)
    tts.close()
    return 0


class ServerProcess:
    """``higgs-pack serve SOURCE --host 127.0.0.1 --port 0 ARGS...`` in a subprocess, at the address
    it prints: ready when ``/ready`` answers 200, killed after ``lifetime`` seconds, stopped by its
    process id (``url``, ``pid``, ``process``, ``log``); RuntimeError with its last log lines when it
    does not bind or get ready within ``start_timeout`` each."""

    def __init__(self, source: str | os.PathLike, args: Sequence[str] = (), cache: str | None = None,
                 lifetime: float = SERVER_LIFETIME_S, *, log_level: str = "warning",
                 env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None,
                 start_timeout: float = SERVER_START_S):
        import httpx

        cmd = [sys.executable, "-m", "higgs_pack.runtime.cli", "serve", str(source), "--host", "127.0.0.1",
               "--port", "0", "--log-level", log_level, *args]
        self.process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=cwd,
                                        env={**os.environ, **({"HIGGS_PACK_CACHE": cache} if cache else {}),
                                             **(env or {})})
        self.pid, self.url, self.log = self.process.pid, "", []
        bound = threading.Event()
        threading.Thread(target=self._read, args=(bound,), daemon=True).start()
        self._killer = threading.Timer(lifetime, lambda: self.process.poll() is None and self.signal(signal.SIGKILL))
        self._killer.daemon = True
        self._killer.start()
        if not bound.wait(start_timeout) or not self.url:
            self.stop()
            raise RuntimeError("the server did not start:\n" + "".join(self.log[-30:]))
        deadline = time.monotonic() + start_timeout
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

    def signal(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` to the server's process."""
        os.kill(self.pid, sig)

    def stop(self, timeout: float = 60.0) -> int | None:
        """SIGTERM, SIGKILL after ``timeout``; its exit status."""
        self._killer.cancel()
        if self.process.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.process.wait(10)
        return self.process.returncode

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

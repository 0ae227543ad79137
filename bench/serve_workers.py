"""The load test's two other processes and what it reads of them: :class:`ServerProcess`
(``higgs-pack serve`` on 127.0.0.1), :class:`EngineProcess` and :func:`engine_worker` (the same
bundle through ``tts.engine(max_batch)``), the resident memory and CPU seconds of a process
(``/proc``), and the server's counters (``/metrics``).
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from bench.serve_checks import Expected, Job, pcm16
from bench.systems import child_env

#: Most seconds a server started here may live, and may take to get ready (or the engine to load).
SERVER_LIFETIME_S = 3600.0
SERVER_START_S = 300.0



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


def cpu_s(pid: int | None = None) -> float | None:
    """CPU seconds (user + system, every thread) used so far by process ``pid`` (``/proc/PID/stat``),
    or by this process when None; None when it cannot be read."""
    if pid is None:
        import resource

        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return None


#: ``/metrics`` samples :func:`scrape` reads: (sample name with its labels, key).
SCRAPED = (
    ("higgs_pack_frames_total", "frames"),
    ("higgs_pack_engine_frames_total", "engine_frames"),
    ("higgs_pack_engine_steps_total", "engine_steps"),
    ("higgs_pack_engine_step_seconds_total", "engine_step_seconds"),
    ("higgs_pack_time_to_first_audio_seconds_sum", "first_audio_seconds"),
    ("higgs_pack_time_to_first_audio_seconds_count", "first_audio_count"),
    ('higgs_pack_request_seconds_sum{route="/v1/audio/speech"}', "request_seconds"),
    ('higgs_pack_request_seconds_count{route="/v1/audio/speech"}', "request_count"),
)


def scrape(url: str) -> dict[str, float]:
    """The server's counters of :data:`SCRAPED` from ``/metrics`` ({} when it has none): frames
    sent, the engine's frames, steps and step seconds, and the sums and counts of its own time
    to first audio (from the start of a stream's body to its first audio chunk) and request
    seconds (from the request to its last byte)."""
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


# ---------------------------------------------------------------------------------------------
# the engine in its own process


class EngineProcess:
    """``python -m bench.serve_load --engine-worker``: the bundle loaded with
    ``tts.engine(max_batch)``, driven by one JSON line per task on its stdin, each answered by
    one JSON line on its stdout.

    Args:
        bundle: the bundle directory.
        max_batch: the engine's rows (the server's).
        cache: ``$HIGGS_PACK_CACHE`` for the process (None: inherited).
    """

    def __init__(self, bundle: str | os.PathLike, max_batch: int, cache: str | None = None):
        env = child_env(**({"HIGGS_PACK_CACHE": cache} if cache else {}))
        cmd = [sys.executable, "-m", "bench.serve_load", "--engine-worker", str(bundle),
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
            return {"job": job.index, "stream": job.stream, "category": "error", "detail": repr(exc),
                    "latency_s": time.perf_counter() - t0, "first_audio_s": None, "samples": 0, "exact": False}
        latency = time.perf_counter() - t0
        sha = hashlib.sha256(pcm).hexdigest()
        samples = len(pcm) // 2
        category = "ok" if expected is None or samples == expected.samples else "length_differs"
        return {"job": job.index, "stream": job.stream, "category": category, "latency_s": latency,
                "first_audio_s": first, "submit_s": submitted, "samples": samples, "sha256": sha,
                "exact": expected is not None and sha == expected.sha256}

    def level(jobs: list[Job], clients: int, seconds: float, expected: dict[int, Expected]) -> dict[str, Any]:
        rows: list[dict[str, Any]] = []
        lock = threading.Lock()
        pending = iter(jobs)
        before = asdict(engine.stats)
        cpu_before = cpu_s()
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
        return {"rows": rows, "seconds": span, "stats": stats, "cpu_s": cpu_s() - cpu_before}

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
    """``higgs-pack serve SOURCE --host 127.0.0.1 --port 0 ARGS...`` in a subprocess, found at the
    address it prints (``serving http://127.0.0.1:PORT``): ready when ``/ready`` answers 200,
    killed after ``lifetime`` seconds, stopped by its process id.  The load test's server and the
    tests' (``tests/live_server.py``) are this one class.

    Args:
        source: a bundle directory (or anything ``higgs-pack serve`` takes).
        args: more ``higgs-pack serve`` flags.
        cache: ``$HIGGS_PACK_CACHE`` for the process (None: inherited).
        lifetime: seconds after which the process is killed.
        log_level: its ``--log-level`` (``warning``: the load test keeps its log short).
        env: more environment variables for the process.
        cwd: its working folder (None: this process's).
        start_timeout: most seconds to bind and most to get ready.

    Attributes:
        url: ``http://127.0.0.1:PORT``.
        pid: the server's process id (the process whose RSS is read).
        process: the :class:`subprocess.Popen`.
        log: what it printed (stdout and stderr), filled as it runs.

    Raises:
        RuntimeError: it did not bind or did not get ready (its last 30 lines of log said).
    """

    def __init__(self, source: str | os.PathLike, args: Sequence[str] = (), cache: str | None = None,
                 lifetime: float = SERVER_LIFETIME_S, *, log_level: str = "warning",
                 env: dict[str, str] | None = None, cwd: str | os.PathLike | None = None,
                 start_timeout: float = SERVER_START_S):
        import httpx

        env = {**os.environ, **({"HIGGS_PACK_CACHE": cache} if cache else {}), **(env or {})}
        cmd = [sys.executable, "-m", "higgs_pack.runtime.cli", "serve", str(source), "--host", "127.0.0.1",
               "--port", "0", "--log-level", log_level, *args]
        self.process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                        cwd=cwd)
        self.pid = self.process.pid
        self.url = ""
        self.log: list[str] = []
        bound = threading.Event()
        threading.Thread(target=self._read, args=(bound,), daemon=True).start()
        self._killer = threading.Timer(lifetime, self._kill)
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

    def _kill(self) -> None:
        if self.process.poll() is None:
            os.kill(self.pid, signal.SIGKILL)

    def signal(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` to the server's process."""
        os.kill(self.pid, sig)

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

    def __enter__(self) -> ServerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

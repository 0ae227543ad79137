"""A real ``higgs-pack serve`` process on 127.0.0.1 for the tests: a free port (``--port 0``, the
address read from the line the server prints), ready when ``/ready`` answers 200, killed after
:data:`LIFETIME_S`, stopped by its process id; at ``--log-level info`` (the tests read uvicorn's
lines) with this checkout first on ``PYTHONPATH``, and a reader of one ``/metrics`` sample.

The tests' own starter: product tests do not import the benchmark (``bench/``), whose load test
starts its servers with :class:`bench.serving.workers.ServerProcess`."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

REPO_ROOT = Path(__file__).resolve().parents[1]
#: Longest wait for a server to bind, and then to warm up, seconds.
START_TIMEOUT_S = 120.0
#: Longest a test server may live, seconds (it is killed after that).
LIFETIME_S = 900.0
#: The line ``higgs-pack serve`` prints once it listens.
SERVING = re.compile(r"serving (http://127\.0\.0\.1:\d+)")


class LiveServer:
    """``higgs-pack serve SOURCE --host 127.0.0.1 --port 0 --log-level info ARGS...``: ``url``,
    ``pid``, ``process`` and ``log`` (every line it printed so far); a context manager that stops it.

    Raises:
        AssertionError: it did not bind or get ready within :data:`START_TIMEOUT_S` each (with the
            last lines of its log).
    """

    def __init__(self, source: str | os.PathLike, *args: str, env: dict[str, str] | None = None):
        cmd = [sys.executable, "-m", "higgs_pack.runtime.cli", "serve", str(source), "--host", "127.0.0.1",
               "--port", "0", "--log-level", "info", *args]
        self.process = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                        cwd=REPO_ROOT, env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})})
        self.pid, self.url, self.log = self.process.pid, "", []
        listening = threading.Event()
        threading.Thread(target=self._follow, args=(listening,), daemon=True).start()
        self._deadline = threading.Timer(LIFETIME_S, self._kill_if_running)
        self._deadline.daemon = True
        self._deadline.start()
        if not listening.wait(START_TIMEOUT_S) or not self.url:
            self._fail("start")
        give_up = time.monotonic() + START_TIMEOUT_S
        while not self._ready():
            if self.process.poll() is not None or time.monotonic() > give_up:
                self._fail("get ready")
            time.sleep(0.2)

    def _ready(self) -> bool:
        """Whether ``/ready`` answers 200 now."""
        try:
            return httpx.get(self.url + "/ready", timeout=10).status_code == 200
        except httpx.TransportError:
            return False

    def _follow(self, listening: threading.Event) -> None:
        """Keep every line of the server's output; set ``listening`` once it prints its address."""
        for line in self.process.stdout:
            self.log.append(line)
            found = SERVING.search(line)
            if found and not self.url:
                self.url = found.group(1)
                listening.set()
        listening.set()  # it exited

    def _kill_if_running(self) -> None:
        if self.process.poll() is None:
            self.signal(signal.SIGKILL)

    def _fail(self, what: str) -> None:
        self.stop()
        raise AssertionError(f"the server did not {what}:\n" + "".join(self.log[-30:]))

    def signal(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` to the server's process."""
        os.kill(self.pid, sig)

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM, SIGKILL after ``timeout`` seconds; its exit status."""
        self._deadline.cancel()
        for sig, grace in ((signal.SIGTERM, timeout), (signal.SIGKILL, 10.0)):
            if self.process.poll() is not None:
                break
            self.signal(sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.process.wait(grace)
        return self.process.returncode

    def __enter__(self) -> LiveServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def metric(self, name: str, labels: str = "") -> float:
        """The value of one sample of ``/metrics`` (``name{labels}``); 0 when absent."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        pattern = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else r"(\{\})?") + r" (\S+)"
        match = re.search("^" + pattern + "$", text, re.MULTILINE)
        return float(match.group(2 if not labels else 1)) if match else 0.0

"""A real ``higgs-pack serve`` process on 127.0.0.1 for the tests: started on a free port,
waited for until ``/ready`` answers 200, bounded in time, and stopped by its process id."""

from __future__ import annotations

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
#: Longest wait for a server to bind and warm up, seconds.
START_TIMEOUT_S = 120.0
#: Longest a test server may live, seconds (it is killed after that).
LIFETIME_S = 900.0


class LiveServer:
    """``higgs-pack serve SOURCE --port 0 ARGS...`` in a subprocess.

    Attributes:
        url: ``http://127.0.0.1:PORT``.
        process: the :class:`subprocess.Popen`.
        log: what the server printed (stdout and stderr), filled as it runs.
    """

    def __init__(self, source: str | os.PathLike, *args: str, env: dict[str, str] | None = None):
        command = [sys.executable, "-m", "higgs_pack.runtime.cli", "serve", str(source), "--host", "127.0.0.1",
                   "--port", "0", *args]
        self.process = subprocess.Popen(command, cwd=REPO_ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                        text=True, env={**os.environ, "PYTHONPATH": str(REPO_ROOT), **(env or {})})
        self.log: list[str] = []
        self.url = ""
        found = threading.Event()
        threading.Thread(target=self._read, args=(found,), daemon=True).start()
        self._killer = threading.Timer(LIFETIME_S, self.process.kill)
        self._killer.daemon = True
        self._killer.start()
        if not found.wait(START_TIMEOUT_S) or not self.url:
            self.stop()
            raise AssertionError("the server did not start:\n" + "".join(self.log))
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.url + "/ready", timeout=5).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if self.process.poll() is not None:
                break
            time.sleep(0.2)
        self.stop()
        raise AssertionError("the server did not get ready:\n" + "".join(self.log))

    def _read(self, found: threading.Event) -> None:
        for line in self.process.stdout:
            self.log.append(line)
            match = re.search(r"serving (http://127\.0\.0\.1:\d+)", line)
            if match and not self.url:
                self.url = match.group(1)
                found.set()
        found.set()

    def signal(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` to the server's process."""
        os.kill(self.process.pid, sig)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit status."""
        self._killer.cancel()
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait(10)
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

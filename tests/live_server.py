"""A real ``higgs-pack serve`` process on 127.0.0.1 for the tests: the load test's own starter
(:class:`~bench.serving.workers.ServerProcess`: a free port, the printed
address, ready when ``/ready`` answers 200, bounded in time, stopped by its process id), with
the tests' settings and a reader of one ``/metrics`` sample."""

from __future__ import annotations

import os
import re
from pathlib import Path

import httpx

from bench.serving.workers import ServerProcess

REPO_ROOT = Path(__file__).resolve().parents[1]
#: Longest wait for a server to bind and warm up, seconds.
START_TIMEOUT_S = 120.0
#: Longest a test server may live, seconds (it is killed after that).
LIFETIME_S = 900.0


class LiveServer(ServerProcess):
    """``higgs-pack serve SOURCE --port 0 ARGS...`` at ``--log-level info`` (the tests read
    uvicorn's lines), with this checkout first on ``PYTHONPATH``.

    Raises:
        AssertionError: it did not start or get ready (with its log).
    """

    def __init__(self, source: str | os.PathLike, *args: str, env: dict[str, str] | None = None):
        try:
            super().__init__(source, args, lifetime=LIFETIME_S, log_level="info", cwd=REPO_ROOT,
                             env={"PYTHONPATH": str(REPO_ROOT), **(env or {})}, start_timeout=START_TIMEOUT_S)
        except RuntimeError as exc:
            raise AssertionError(str(exc)) from exc

    def stop(self, timeout: float = 30.0) -> int | None:
        return super().stop(timeout)

    def metric(self, name: str, labels: str = "") -> float:
        """The value of one sample of ``/metrics`` (``name{labels}``); 0 when absent."""
        text = httpx.get(self.url + "/metrics", timeout=10).text
        pattern = re.escape(name) + (r"\{" + re.escape(labels) + r"\}" if labels else r"(\{\})?") + r" (\S+)"
        match = re.search("^" + pattern + "$", text, re.MULTILINE)
        return float(match.group(2 if not labels else 1)) if match else 0.0

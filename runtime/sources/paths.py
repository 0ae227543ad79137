"""Where higgs-pack keeps caches (``$HIGGS_PACK_CACHE``, default ``~/.cache/higgs-pack``)."""

from __future__ import annotations

import os
from pathlib import Path


def cache_root() -> Path:
    """The cache root: built-in checkpoints, OpenVINO compiled-model caches."""
    return Path(os.environ.get("HIGGS_PACK_CACHE", Path.home() / ".cache" / "higgs-pack"))

"""Shared fixtures: the tiny Higgs-Audio-v3 checkpoint (real layout, real tokenizer) and cases."""

from __future__ import annotations

from pathlib import Path

import pytest

#: Repository root (the folder holding pyproject.toml).
REPO_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``tiny`` preset, seed 0, written once per session (2 shards + index)."""
    from higgs_pack.exporters.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt") / "higgs-audio-v3-tiny", "tiny", 0)


@pytest.fixture(scope="session")
def tiny_ckpt(tiny_checkpoint: Path):
    """:class:`HiggsCheckpoint` of :func:`tiny_checkpoint`, opened once per session."""
    from higgs_pack.exporters.checkpoint import open_checkpoint

    return open_checkpoint(tiny_checkpoint)


@pytest.fixture(scope="session")
def cases_dir() -> Path:
    """``shared/cases`` beside the repository (real prompts and a reference clip)."""
    path = REPO_ROOT.parent / "shared" / "cases"
    if not path.is_dir():
        pytest.skip(f"test cases folder {path} is missing")
    return path

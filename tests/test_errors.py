"""Errors that name their cause: a full disk during a download is said as such."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from higgs_pack.manifests.errors import (
    BundleError,
    HiggsPackError,
    HubError,
    disk_full,
    disk_full_message,
)

needs_dev_full = pytest.mark.skipif(not os.path.exists("/dev/full"), reason="no /dev/full on this OS (Linux has it)")


def _real_enospc() -> OSError:
    """A real ENOSPC from the kernel: every write to /dev/full fails with it."""
    try:
        with open("/dev/full", "wb") as full:
            full.write(b"x" * 4096)
            full.flush()
    except OSError as exc:
        return exc
    raise AssertionError("/dev/full accepted a write")


def test_hub_error_is_not_a_bundle_error():
    """A hub that cannot be reached says nothing about a bundle's files."""
    assert issubclass(HubError, HiggsPackError) and not issubclass(HubError, BundleError)


@needs_dev_full
def test_disk_full_is_found_through_the_errors_a_library_wraps_it_in():
    enospc = _real_enospc()
    try:
        try:
            raise enospc
        except OSError as inner:
            raise RuntimeError("download failed") from inner
    except RuntimeError as wrapped:
        assert disk_full(wrapped) is enospc
    assert disk_full(RuntimeError("offline")) is None
    assert disk_full(PermissionError(13, "denied")) is None


def test_disk_full_message_names_the_folder_and_its_free_space(tmp_path: Path):
    text = disk_full_message(tmp_path / "not" / "made", "downloading org/repo", "free space there")
    assert text.startswith(f"out of disk space in {tmp_path / 'not' / 'made'} (")
    assert " GiB free) while downloading org/repo; free space there" in text


@needs_dev_full
def test_a_hub_download_that_fills_the_disk_says_so(monkeypatch, tmp_path: Path):
    """The download itself is the hub client's (no network here): it is replaced by one whose
    write really fails with ENOSPC, and the classification under test is ours."""
    import huggingface_hub

    from higgs_pack.runtime.sources.hub import HubRef, _download

    def snapshot_download(*args, **kwargs):
        raise RuntimeError("a shard failed to download") from _real_enospc()

    monkeypatch.setattr(huggingface_hub, "snapshot_download", snapshot_download)
    with pytest.raises(HubError, match=rf"out of disk space in {tmp_path} \(\d+\.\d GiB free\) while downloading "
                                       r"org/bundles@main; free space there or point HF_HUB_CACHE"):
        _download(HubRef("org/bundles"), None, None, tmp_path, None)


def test_a_problem_prints_as_its_sentence_in_the_python_terms():
    """``print(problem)`` of a real InputError's problems: sentences with the keyword filled in,
    never the ``{name}`` template its message field keeps for the other front doors."""
    from higgs_pack.manifests.errors import InputError
    from higgs_pack.runtime.request import SynthesisRequest

    try:
        SynthesisRequest("Hi.", top_p=5, context_frames=0)
    except InputError as exc:
        problems = exc.problems
    else:
        raise AssertionError("a top_p of 5 and a context_frames of 0 were taken")
    said = [str(p) for p in problems]
    assert [p.field for p in problems] == ["top_p", "context_frames"], said
    assert all("{name}" not in s and s == p.render() for s, p in zip(said, problems, strict=True)), said
    assert said[0].startswith("top_p must be") and "got 5" in said[0], said


def test_an_unknown_choice_that_differs_by_case_is_named():
    """``--execution-provider CPU``: "did you mean 'cpu'?" (difflib finds no close match for a
    word that differs only by case)."""
    from higgs_pack.manifests.errors import unknown_choice

    said = unknown_choice("execution provider", "CPU", ["cpu", "cuda", "dml"], "--execution-provider")
    assert "unknown execution provider 'CPU' (did you mean 'cpu'?)" in said
    assert "did you mean 'cuda'" in unknown_choice("execution provider", "cudaa", ["cpu", "cuda"], "x")


def test_an_input_error_is_its_problems_and_each_door_says_their_code():
    """``InputError.of(Problem(...))``: the Python and CLI line is the problems' sentence, the HTTP
    answer names the field by its HTTP name and carries the problem's code (it was
    ``invalid_value`` for every problem)."""
    from higgs_pack.manifests.errors import InputError, Problem
    from higgs_pack.serve.errors import from_input_error, refused

    exc = InputError.of(Problem("max_frames", None, message="{name} is missing: give it", code="missing_field"),
                        Problem.said("odd {braces} kept", code="conflicting_fields"))
    assert exc.code == "missing_field" and [p.code for p in exc.problems] == ["missing_field", "conflicting_fields"]
    assert str(exc) == "2 problems with the request:\n  - max_frames is missing: give it\n  - odd {braces} kept"
    answer = from_input_error(exc)
    assert (answer.status, answer.param, answer.code) == (400, "max_new_tokens", "missing_field")
    assert answer.message.splitlines()[1] == "  - max_new_tokens is missing: give it", answer.message
    body = refused(Problem.said("the body is bad", code="invalid_body"), param="audio").body()["error"]
    assert (body["param"], body["code"], body["message"]) == ("audio", "invalid_body", "the body is bad")
    assert from_input_error(InputError("a plain message")).code == "invalid_value"
    with pytest.raises(ValueError, match="not one of"):
        Problem(None, code="bad_code")
    with pytest.raises(ValueError, match="at least one"):
        InputError.of()


#: Modules that still build an InputError from a plain message (being rewritten beside this change;
#: each leaves this list when it builds its errors from problems).  bench/ is outside the package.
PLAIN_MESSAGE_MODULES = frozenset({
    "runtime/request.py", "runtime/loop/delay.py", "runtime/loop/generate.py", "runtime/loop/engine.py",
    "runtime/loop/codec_batch.py", "runtime/loop/prefix_cache.py", "runtime/loop/kv_memory.py",
    "runtime/loop/kv_blocks.py", "serve/schema.py", "serve/speech.py", "serve/live.py", "runtime/cli.py",
    "serve/integrations/protocol.py",
})


def _plain_input_errors(path) -> list[int]:
    """Lines of ``path`` that build an InputError with no problems (``InputError("...")``)."""
    import ast

    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "InputError"
                and not any(k.arg == "problems" for k in node.keywords) and len(node.args) < 2):
            found.append(node.lineno)
    return found


def test_every_input_error_is_built_from_problems():
    """``InputError.of(Problem(...))`` (or ``problems=``), so every door has each problem's field
    and code as data; a plain message is one problem of nothing with the code ``invalid_value``."""
    root = Path(__file__).resolve().parents[1]
    plain = [f"{path.relative_to(root).as_posix()}:{line}"
             for room in ("targets", "exporters", "serve", "runtime", "manifests", "higgs_pack")
             for path in sorted((root / room).rglob("*.py"))
             if path.relative_to(root).as_posix() not in PLAIN_MESSAGE_MODULES
             for line in _plain_input_errors(path)]
    assert not plain, f"InputError built from a plain message (use InputError.of(Problem.said(...))): {plain}"

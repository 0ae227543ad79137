"""Errors that name their cause: a full disk during a download is said as such."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from higgs_pack.errors import (
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
    from higgs_pack.errors import InputError
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
    from higgs_pack.errors import unknown_choice

    said = unknown_choice("execution provider", "CPU", ["cpu", "cuda", "dml"], "--execution-provider")
    assert "unknown execution provider 'CPU' (did you mean 'cpu'?)" in said
    assert "did you mean 'cuda'" in unknown_choice("execution provider", "cudaa", ["cpu", "cuda"], "x")


def test_an_input_error_is_its_problems_and_each_door_says_their_code():
    """``InputError.of(Problem(...))``: the Python and CLI line is the problems' sentence, the HTTP
    answer names the field by its HTTP name and carries the problem's code (it was
    ``invalid_value`` for every problem)."""
    from higgs_pack.errors import InputError, Problem
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
             for line in _plain_input_errors(path)]
    assert not plain, f"InputError built from a plain message (use InputError.of(Problem.said(...))): {plain}"


def _ort_error(model_graph, feeds=None, bound: bool = False) -> Exception:
    """The error ONNX Runtime itself raises making (and, with ``feeds``, running: with an IOBinding
    when ``bound``) a CPU session of a one-node graph."""
    import onnxruntime as ort
    from onnx import helper

    model = helper.make_model(model_graph, opset_imports=[helper.make_opsetid("", 21),
                                                          helper.make_opsetid("com.microsoft", 1)])
    try:
        session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        if bound:
            binding = session.io_binding()
            for name, value in (feeds or {}).items():
                binding.bind_cpu_input(name, value)
            for out in session.get_outputs():
                binding.bind_output(out.name, "cpu")
            session.run_with_iobinding(binding)
        else:
            session.run(None, feeds or {})
    except Exception as exc:
        return exc
    raise AssertionError("ONNX Runtime took the graph")


def test_onnx_runtimes_real_errors_are_told_apart_by_type():
    """A node with no CPU kernel (Erf of float64) is ONNX Runtime's NotImplemented: the provider
    cannot run it.  GroupQueryAttention's q_norm_weight on the CPU is its generic InvalidArgument
    with the kernel's refusal: cannot run.  A wrong input shape is InvalidArgument too: a real
    failure.  A Python error whose text says "not supported" is not ONNX Runtime's."""
    import numpy as np
    from onnx import TensorProto, helper

    from higgs_pack.runtime.backends.onnxruntime.failures import provider_cannot_run

    info = helper.make_tensor_value_info
    erf = helper.make_graph([helper.make_node("Erf", ["x"], ["y"])], "g", [info("x", TensorProto.DOUBLE, [2])],
                            [info("y", TensorProto.DOUBLE, [2])])
    exc = _ort_error(erf)
    assert type(exc).__name__ == "NotImplemented", exc
    assert provider_cannot_run(exc) == "Could not find an implementation for Erf(13) node with name ''"

    h, d = 2, 8
    names = ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length",
             *[""] * 7, "q_norm_weight", "k_norm_weight"]
    shapes = {"query": [1, 1, h * d], "key": [1, 1, h * d], "value": [1, 1, h * d], "past_key": [1, h, 0, d],
              "past_value": [1, h, 0, d], "q_norm_weight": [d], "k_norm_weight": [d]}
    gqa = helper.make_graph(
        [helper.make_node("GroupQueryAttention", names, ["out", "present_key", "present_value"],
                          domain="com.microsoft", num_heads=h, kv_num_heads=h)], "g",
        [*(info(n, TensorProto.FLOAT, s) for n, s in shapes.items()), info("seqlens_k", TensorProto.INT32, [1]),
         info("total_sequence_length", TensorProto.INT32, [])],
        [info(n, TensorProto.FLOAT, None) for n in ("out", "present_key", "present_value")])
    feeds = {n: np.ones(s, np.float32) for n, s in shapes.items()}
    feeds = {**feeds, "seqlens_k": np.array([0], np.int32), "total_sequence_length": np.array(1, np.int32)}
    exc = _ort_error(gqa, feeds)
    assert type(exc).__name__ == "InvalidArgument", exc
    said = provider_cannot_run(exc)
    assert said is not None and said.startswith("GroupQueryAttention node '': GroupQueryAttention (CPU): q_norm"), said
    exc = _ort_error(gqa, feeds, bound=True)  # the runners' IOBinding: a plain RuntimeError, no status
    assert type(exc) is RuntimeError and "q_norm_weight" in (provider_cannot_run(exc) or ""), exc

    add = helper.make_graph([helper.make_node("Add", ["a", "b"], ["c"])], "g",
                            [info("a", TensorProto.FLOAT, [2]), info("b", TensorProto.FLOAT, [2])],
                            [info("c", TensorProto.FLOAT, [2])])
    exc = _ort_error(add, {"a": np.ones(3, np.float32), "b": np.ones(3, np.float32)})
    assert type(exc).__name__ == "InvalidArgument" and provider_cannot_run(exc) is None, exc
    assert provider_cannot_run(ValueError("this is not supported")) is None


def test_onnx_runtimes_real_allocation_errors_are_told_apart():
    """Memory running out is ONNX Runtime's MemoryError (a 4 TiB CPU buffer); asking the CPU-only
    package for a CUDA buffer ("Can't allocate memory on the CUDA device") and a size that overflows
    are RuntimeErrors that are not out of memory (the old "memory"/"alloc" substring took the first)."""
    import numpy as np
    import onnxruntime as ort

    from higgs_pack.runtime.backends.onnxruntime.failures import out_of_memory

    def error(shape: list[int], device: str) -> Exception:
        try:
            ort.OrtValue.ortvalue_from_shape_and_type(shape, np.float32, device, 0)
        except Exception as exc:
            return exc
        raise AssertionError(f"a {shape} buffer on {device} was made")

    assert out_of_memory(error([2**40], "cpu"))
    assert not out_of_memory(error([2**33, 2**33], "cpu"))
    if "CUDAExecutionProvider" not in ort.get_available_providers():
        wrong_package = error([4], "cuda")
        assert "allocate memory" in str(wrong_package) and not out_of_memory(wrong_package)


def test_cut_off_log_reads_a_real_uvicorn_past_its_graceful_timeout():
    """uvicorn (no exception or event for it: it logs) stopped with a request in flight past its
    timeout: its "Cancel N running task(s)" record becomes our one warning and its traceback of
    the cancelled request is dropped (serve.app.UVICORN_GRACE_OVER, UVICORN_APP_RAISED)."""
    import asyncio
    import logging
    import socket
    import threading
    import time

    uvicorn = pytest.importorskip("uvicorn")
    from higgs_pack.serve.app import CutOffLog

    async def app(scope, receive, send):
        await asyncio.sleep(30)

    heard: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = heard.append
    logger = logging.getLogger("uvicorn.error")
    cut_off = CutOffLog(0)
    logger.addFilter(cut_off)
    logger.addHandler(handler)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_config=None, timeout_graceful_shutdown=0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]})
    try:
        thread.start()
        while not server.started:
            time.sleep(0.01)
        client = socket.create_connection(sock.getsockname())
        client.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        while not server.server_state.tasks:
            time.sleep(0.01)
        server.should_exit = True
        thread.join(10)
        client.close()
    finally:
        logger.removeFilter(cut_off)
        logger.removeHandler(handler)
    said = [(r.levelname, r.getMessage()) for r in heard]
    assert ("WARNING", "grace period of 0 s over: cutting off 0 request(s) still in flight: none") in said, said
    assert not any("Exception in ASGI application" in m or "Cancel" in m for _, m in said), said


def test_openvinos_real_damaged_weights_error_is_a_bundle_error(tmp_path: Path):
    """OpenVINO raises a plain RuntimeError for a .bin that does not fit its IR (a truncated one
    here, compiled for real): compile_ir says the bundle is damaged, not that the device failed."""
    np = pytest.importorskip("numpy")
    ov = pytest.importorskip("openvino")
    import openvino.opset13 as ops

    from higgs_pack.runtime.backends.openvino.runners import compile_ir

    x = ops.parameter([1, 64], np.float32, name="x")
    model = ov.Model([ops.matmul(x, ops.constant(np.ones((64, 64), np.float32)), False, False)], [x], "tiny")
    ov.save_model(model, tmp_path / "tiny.xml", compress_to_fp16=False)
    weights = tmp_path / "tiny.bin"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(BundleError, match=r"cannot read tiny.xml with its weights tiny.bin \(Incorrect weights"):
        compile_ir(ov.Core(), tmp_path / "tiny.xml", "CPU")


#: Where serve/ passes a ``code`` by position: the function and the argument's index.
_CODE_POSITIONS = {"_bad": 2, "_refuse": 5, "sse_error": 1, "error_body": 3, "Problem.said": 3}


def _codes_answered() -> dict[str, str]:
    """Every literal ``code`` the server's source answers with (``code=...``, a ``code`` variable,
    or the code argument of the helpers that take it by position), by code: where it is."""
    import ast

    root = Path(__file__).resolve().parents[1] / "serve"
    found: dict[str, str] = {}

    def take(node, where):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.setdefault(node.value, where)

    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            where = f"{path.name}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, ast.Call):
                for keyword in node.keywords:
                    if keyword.arg == "code":
                        take(keyword.value, where)
                name = node.func.id if isinstance(node.func, ast.Name) else \
                    node.func.attr if isinstance(node.func, ast.Attribute) else ""
                index = _CODE_POSITIONS.get(name)
                if index is not None and len(node.args) > index:
                    take(node.args[index], where)
            elif isinstance(node, ast.Assign):
                for target in node.targets:
                    names = target.elts if isinstance(target, ast.Tuple) else [target]
                    values = node.value.elts if isinstance(node.value, ast.Tuple) else [node.value]
                    for name, value in zip(names, values, strict=False):
                        if isinstance(name, ast.Name) and name.id == "code":
                            take(value, where)
    return found


def test_every_code_the_server_answers_is_declared_and_listed_in_the_docs():
    """docs/serving/index.md's list of codes is made from CODE_MEANINGS and TRANSPORT_CODES (the
    generated tables, docs/hooks/generated.py); every code the server's source answers is in one of
    them, so in the list."""
    import importlib.util

    from higgs_pack.errors import CODE_MEANINGS, CODES
    from higgs_pack.serve.errors import TRANSPORT_CODES

    answered = _codes_answered()
    assert {"model_not_found", "upgrade_required", "method_not_allowed", "unsupported_encoding", "cross_origin",
            "shutting_down", "conflicting_fields"} <= set(answered)  # the scan sees each way a code is given
    declared = set(CODES) | set(TRANSPORT_CODES)
    missing = {code: where for code, where in answered.items() if code not in declared}
    assert not missing, f"codes the server answers that no declaration lists: {missing}"
    assert not set(CODES) & set(TRANSPORT_CODES) and tuple(CODE_MEANINGS) == CODES
    assert all(400 <= status < 600 for status, _ in TRANSPORT_CODES.values())
    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("generated_hook", root / "docs" / "hooks" / "generated.py")
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    page = hook.on_page_markdown("before\n<!-- error-codes -->\n<!-- /error-codes -->\nafter", page=None)
    kept = (root / "docs" / "serving" / "index.md").read_text(encoding="utf-8")
    for code in [*CODES, *TRANSPORT_CODES, "unreadable_audio"]:
        assert f"| `{code}` |" in page and f"| `{code}` |" in kept, code  # in the Markdown too, not the site only
    assert hook.fill(kept) == kept, "the error codes in docs/serving/index.md are stale: python -m docs.hooks.generated --write"
    assert "docs/hooks/generated.py" in (root / "mkdocs.yml").read_text(encoding="utf-8")


def test_several_problems_are_one_shape_on_http_and_on_the_live_route():
    """Issue 37: a live session.config with several bad fields was "N bad fields: (1) ...; (2) ...",
    a body with several "N problems with the request:" and a line each; both are now
    :func:`~higgs_pack.errors.said_all`'s, every problem a line (a field's own several too)."""
    pytest.importorskip("fastapi", reason="the server needs the [serve] extra")
    from higgs_pack.errors import InputError, Problem
    from higgs_pack.serve.errors import from_input_error, refused
    from higgs_pack.serve.live import config_error

    top_p = Problem("top_p", 2, allowed="in (0, 1]")
    seed = Problem("seed", -1, allowed=">= 0")
    cap = Problem("max_frames", 0, allowed=">= 1")
    http = from_input_error(InputError.of(top_p, seed, cap))
    bad = {"top_p": refused(top_p), "seed": refused(seed, cap)}  # one field's check may find two

    def check(fields):
        raise bad[next(iter(fields))]

    live = config_error(bad["top_p"], {"top_p": 2, "seed": -1}, check)
    assert (live.param, live.code) == ("top_p", "invalid_config")
    said, refused_whole = live.message.rsplit("\n", 1)
    assert said == http.message, live.message
    assert said.startswith("3 problems with the request:\n  - top_p must be in (0, 1], got 2\n")
    assert refused_whole.startswith("session.config refused whole")
    one = config_error(bad["top_p"], {"top_p": 2}, check)
    assert one.message.startswith("top_p must be in (0, 1], got 2. session.config refused whole"), one.message

"""What ONNX Runtime's errors mean: a provider that cannot execute a graph (a missing kernel)
told apart from a real failure.  The one adapter of ONNX Runtime's errors: its exception types
first, its message only where a type is shared with real failures."""

from __future__ import annotations

import re
import sys

from higgs_pack.errors import (
    ExecutionProviderUnavailable,
)

#: The module of ONNX Runtime's exception types (one per status code: ``NotImplemented``,
#: ``InvalidArgument``, ``Fail``, ...); loaded whenever onnxruntime is.
ORT_ERRORS = "onnxruntime.capi.onnxruntime_pybind11_state"

#: What a kernel says when it refuses one of its inputs on this provider, under ONNX Runtime's
#: generic statuses (``InvalidArgument``, ``Fail``: the types of every bad input too; a run with
#: an IOBinding loses the status: a plain ``RuntimeError`` "Error in execution: ...").  Measured
#: with onnxruntime 1.32 on the CPU provider, as ``InvalidArgument``: "GroupQueryAttention (CPU):
#: q_norm_weight / k_norm_weight inputs are not supported ... implemented only on the CUDA and
#: WebGPU EPs" (cuda fp16/int4 ModelBuilder decoders).  A node with no kernel at all ("Could not
#: find an implementation for <Op>(<version>) node") is ``NotImplemented``: its type says it.
_REFUSED_ON_PROVIDER = re.compile(r"not supported|not implemented|implemented only on", re.IGNORECASE)


def provider_cannot_run(exc: BaseException) -> str | None:
    """ONNX Runtime's own reason when a provider cannot execute a graph, else None.

    An ONNX Runtime ``NotImplemented`` (no kernel for a node) counts; its generic
    ``InvalidArgument``, ``Fail``, ``RuntimeException`` and ``EPFail``, and the ``RuntimeError`` of
    a run with an IOBinding, count only with a kernel's refusal of its provider
    (:data:`_REFUSED_ON_PROVIDER`); any other error (a shape mismatch, a damaged file, an error
    ONNX Runtime is not loaded to raise) is a real failure and returns None.

    Returns:
        The first line of the message, without ONNX Runtime's status prefix.
    """
    if isinstance(exc, ExecutionProviderUnavailable) and exc.__cause__ is not None:
        exc = exc.__cause__  # already translated by a runner: classify ONNX Runtime's own error
    errors = sys.modules.get(ORT_ERRORS)  # not loaded: the error cannot be ONNX Runtime's
    if errors is None:
        return None
    text = str(exc)
    generic = (errors.InvalidArgument, errors.Fail, errors.RuntimeException, errors.EPFail, RuntimeError)
    if not (isinstance(exc, errors.NotImplemented)
            or (isinstance(exc, generic) and _REFUSED_ON_PROVIDER.search(text))):
        return None
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : [A-Z_]+ : ", "", text.strip())
    running = re.match(r"Non-zero status code returned while running (\S+) node\. Name:'([^']*)' "
                       r"Status Message: (.*)", text, re.DOTALL)
    if running:
        op, node, message = running.groups()
        text = f"{op} node {node!r}: {message.strip()}"
    return text.splitlines()[0] if text else type(exc).__name__


#: What ONNX Runtime's allocators say when device memory runs out, as a plain ``RuntimeError`` (it has
#: no type for it): the BFC arena's "Failed to allocate memory for requested buffer of size N" and
#: "Available memory of N is smaller than requested bytes of M" (both in onnxruntime 1.32's library),
#: CUDA's "CUDA failure 2: out of memory".  The CPU allocator raises ``MemoryError`` (std::bad_alloc).
_OUT_OF_MEMORY = re.compile(r"Failed to allocate memory for requested buffer|Available memory of \d+ is smaller|"
                            r"out of memory", re.IGNORECASE)


def out_of_memory(exc: BaseException) -> bool:
    """Whether ONNX Runtime's ``exc`` means memory ran out: a ``MemoryError`` (the CPU's), or an
    allocator's ``RuntimeError`` (:data:`_OUT_OF_MEMORY`); never another failure whose message
    mentions memory ("Can't allocate memory on the CUDA device using this package", the CPU-only
    package asked for a CUDA buffer)."""
    return isinstance(exc, MemoryError) or (isinstance(exc, RuntimeError) and bool(_OUT_OF_MEMORY.search(str(exc))))


def _raise_unsupported(name: str, session, exc: Exception) -> None:
    """Re-raise "this provider cannot execute the graph" as an error naming sub-part and provider.

    Returns (so the caller re-raises ``exc`` unchanged) for any other error.
    """
    reason = provider_cannot_run(exc)
    if reason is None:
        return
    provider = (session.get_providers() or ["its provider"])[0]
    raise ExecutionProviderUnavailable(
        f"{name} cannot run on {provider}: {reason}. The bundle's graphs are built for one provider "
        "(`higgs-pack inspect` names it): run it there, or choose another --execution-provider "
        "(execution_provider=)"
    ) from exc

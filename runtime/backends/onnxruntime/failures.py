"""What ONNX Runtime's errors mean: a provider that cannot execute a graph (a missing kernel)
told apart from a real failure."""

from __future__ import annotations

import re

from higgs_pack.manifests.errors import (
    ExecutionProviderUnavailable,
)

#: What ONNX Runtime says when a provider has no kernel for a node or for one of its
#: inputs (at session creation or run), as opposed to a wrong result or a broken file.
#: Measured with onnxruntime 1.32 on the CPU provider: "GroupQueryAttention (CPU):
#: q_norm_weight / k_norm_weight inputs are not supported ... implemented only on the
#: CUDA and WebGPU EPs" (cuda fp16/int4 ModelBuilder decoders), and "Could not find an
#: implementation for <Op>(<version>) node" for a missing kernel.
_UNSUPPORTED = re.compile(
    r"not supported|not implemented|NOT_IMPLEMENTED|Could not find an implementation|implemented only on",
    re.IGNORECASE,
)


def provider_cannot_run(exc: BaseException) -> str | None:
    """ONNX Runtime's own reason when a provider cannot execute a graph, else None.

    Only messages of the kinds in ``_UNSUPPORTED`` count; any other error (a shape
    mismatch, a damaged file) is a real failure and returns None.

    Returns:
        The first line of the message, without ONNX Runtime's status prefix.
    """
    if isinstance(exc, ExecutionProviderUnavailable) and exc.__cause__ is not None:
        exc = exc.__cause__  # already translated by a runner: classify ONNX Runtime's own error
    text = str(exc)
    if not _UNSUPPORTED.search(text):
        return None
    text = re.sub(r"^\[ONNXRuntimeError\] : \d+ : [A-Z_]+ : ", "", text.strip())
    running = re.match(r"Non-zero status code returned while running (\S+) node\. Name:'([^']*)' "
                       r"Status Message: (.*)", text, re.DOTALL)
    if running:
        op, node, message = running.groups()
        text = f"{op} node {node!r}: {message.strip()}"
    return text.splitlines()[0] if text else type(exc).__name__


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

"""ONNX Runtime distributions: which are installed, importing the one ``onnxruntime`` module
they all provide (refusing two at once), and how to install a provider's."""

from __future__ import annotations

import importlib.metadata

from higgs_pack.errors import (
    ExecutionProviderUnavailable,
    install_extra,
)
from higgs_pack.manifests.providers import CPU_PROVIDER, EXECUTION_PROVIDERS


def ort_distributions() -> tuple[str, ...]:
    """Distributions that all install the one ``onnxruntime`` module (one per provider row)."""
    return tuple(dict.fromkeys(row.packaging.distribution for row in EXECUTION_PROVIDERS.values()))



def installed_ort_distributions() -> list[str]:
    """Names of the onnxruntime distributions installed in this environment."""
    found = []
    for name in ort_distributions():
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        found.append(name)
    return found


def import_ort():
    """Import onnxruntime, refusing a broken environment.

    Raises:
        ExecutionProviderUnavailable: onnxruntime is not installed, or two of its
            distributions are (they overwrite each other's files: measured with
            onnxruntime + onnxruntime-openvino).
    """
    dists = installed_ort_distributions()
    if len(dists) > 1:
        raise ExecutionProviderUnavailable(
            f"{' and '.join(dists)} are installed together; they ship the same `onnxruntime` module "
            "and overwrite each other. Keep exactly one: pip uninstall -y "
            f"{' '.join(dists)} && pip install <the one you need>"
        )
    try:
        import onnxruntime as ort
    except ImportError as exc:
        raise ExecutionProviderUnavailable(
            "onnxruntime is not installed; install the runtime for this bundle, e.g. "
            f"{install_extra(CPU_PROVIDER.packaging.extra)} (or "
            + ", ".join(f"[{row.packaging.extra}]" for row in EXECUTION_PROVIDERS.values() if not row.packaging.own_venv
                        and row is not CPU_PROVIDER) + ")"
        ) from exc
    return ort


def install_hint(row) -> str:
    """How to install the ONNX Runtime distribution of one EXECUTION_PROVIDERS row.

    A distribution that replaces onnxruntime (``own_venv``, e.g. onnxruntime-openvino:
    same ``onnxruntime`` module) gets a hint that removes the other distributions first.
    """
    if row.packaging.own_venv:
        others = [d for d in installed_ort_distributions() if d != row.packaging.distribution] or [CPU_PROVIDER.packaging.distribution]
        return (f"Install it in a venv of its own, or replace the installed one: pip uninstall -y "
                f"{' '.join(others)} && pip install '{row.packaging.requirement}' (it cannot share a venv with "
                "another onnxruntime distribution)")
    return f"To have it, {install_extra(row.packaging.extra)} ({row.packaging.requirement})"

"""Building blocks of verification: golden outputs, similarity, and the report.

Shared by :mod:`higgs_pack.runtime.verify` (the generic checks) and
:mod:`higgs_pack.runtime.backend_checks` (checks one backend or provider needs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from higgs_pack.manifests.constants import SubPart
from higgs_pack.runtime.bundle import Bundle
from higgs_pack.runtime.pipeline import Pipeline


def provider_cannot_run(exc: BaseException) -> str | None:
    """ONNX Runtime's own reason when a provider cannot execute a graph, else None
    (see :func:`higgs_pack.runtime.ort_backend.provider_cannot_run`)."""
    from higgs_pack.runtime.ort_backend import provider_cannot_run as classify

    return classify(exc)


def read_golden(bundle: Bundle) -> dict[str, np.ndarray]:
    """Load ``reference/golden.npz`` without pickles (object arrays are refused)."""
    path = bundle.file(bundle.manifest["reference"]["file"])
    with np.load(path, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


def compare(expected: np.ndarray, got: np.ndarray, metric: str) -> tuple[float, float | None]:
    """Similarity of two outputs.

    Returns:
        ``(measured, max_abs)``: cosine similarity (float outputs; 1.0 when both are
        all zero) or the fraction of equal codes (``code_agreement``), and the max
        absolute difference for float outputs (None for codes).
    """
    if expected.shape != got.shape:
        return 0.0, None
    if metric == "code_agreement":
        return float((expected == got).mean()) if expected.size else 1.0, None
    a = expected.astype(np.float64).ravel()
    b = got.astype(np.float64).ravel()
    if not np.isfinite(b).all():
        return 0.0, float("inf")
    denom = np.linalg.norm(a) * np.linalg.norm(b)
    cosine = float(a @ b / denom) if denom else float(np.array_equal(a, b))
    return cosine, float(np.abs(a - b).max()) if a.size else 0.0


def subpart_parity(pipeline: Pipeline, golden: dict[str, np.ndarray], part: str, metric: str
                   ) -> tuple[float, float | None]:
    """Run one sub-part on its golden inputs and compare with the golden outputs.

    Golden keys are ``<part>/in/<tensor>`` and ``<part>/out/<tensor>``; the
    decoder has a prefill (``inputs_embeds`` -> ``hidden_states``) and one cached
    step (``step_embeds`` -> ``step_hidden_states``); its score is the worse one.
    """
    if part == SubPart.LLM_DECODER:
        pipeline.decoder.reset()
        first = pipeline.decoder.forward(golden["llm_decoder/in/inputs_embeds"])
        second = pipeline.decoder.forward(golden["llm_decoder/in/step_embeds"])
        a = compare(golden["llm_decoder/out/hidden_states"], first, metric)
        b = compare(golden["llm_decoder/out/step_hidden_states"], second, metric)
        worst = min(a, b, key=lambda x: x[0])
        return worst[0], max(x[1] for x in (a, b) if x[1] is not None)
    runner = getattr(pipeline, part)
    prefix_in, prefix_out = f"{part}/in/", f"{part}/out/"
    feeds = {k[len(prefix_in):]: v for k, v in golden.items() if k.startswith(prefix_in)}
    outs = runner.run(feeds)
    results = [compare(v, outs[k[len(prefix_out):]], metric)
               for k, v in golden.items() if k.startswith(prefix_out)]
    worst = min(results, key=lambda x: x[0])
    return worst


@dataclass
class Check:
    """One line of a verification report."""

    name: str
    ok: bool | None
    detail: str
    value: float | None = None

    @property
    def status(self) -> str:
        return {True: "ok", False: "FAIL", None: "skipped"}[self.ok]


@dataclass
class VerifyReport:
    """All checks of one verification run.

    Attributes:
        bundle: bundle name.
        checks: every check, in order; ``ok`` None means skipped (detail says why).
        parity: sub-part -> measured similarity (for the manifest).
        summary: target, precision, backend, device/provider the bundle was built for.
        thresholds: sub-part -> ``{"metric", "threshold"}`` its parity was judged by.
        greedy: ``{"identical", "steps", "needed"}``: greedy codes vs the PyTorch reference
            (``needed`` None when informational).
        audio: case name -> ``{"samples": float32 [samples] mono, "sample_rate": Hz, "text": the
            text spoken, "ref_text": the reference transcript or None}`` for each synthesized case
            (for the HTML report; not in :meth:`to_dict`).
    """

    bundle: str
    backend: str = ""
    checks: list[Check] = field(default_factory=list)
    parity: dict[str, dict[str, float | None]] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    thresholds: dict[str, dict[str, Any]] = field(default_factory=dict)
    greedy: dict[str, int | None] = field(default_factory=dict)
    audio: dict[str, dict[str, Any]] = field(default_factory=dict, repr=False)

    @property
    def ok(self) -> bool:
        return all(c.ok is not False for c in self.checks)

    def add(self, name: str, ok: bool | None, detail: str, value: float | None = None) -> Check:
        check = Check(name, ok, detail, value)
        self.checks.append(check)
        return check

    def to_dict(self) -> dict[str, Any]:
        return {
            "bundle": self.bundle,
            "backend": self.backend,
            "ok": self.ok,
            "checks": [{"name": c.name, "status": c.status, "detail": c.detail, "value": c.value}
                       for c in self.checks],
        }

    def render(self) -> str:
        width = max((len(c.name) for c in self.checks), default=10)
        lines = [f"verify {self.bundle} ({self.backend})"]
        lines += [f"  {c.status:>7}  {c.name:<{width}}  {c.detail}" for c in self.checks]
        lines.append(f"result: {'PASS' if self.ok else 'FAIL'}")
        return "\n".join(lines)

"""Building blocks of verification: golden outputs, similarity, and the report.

Shared by :mod:`higgs_pack.runtime.verification.verify` (the generic checks) and
:mod:`higgs_pack.runtime.verification.backend_checks` (checks one backend or provider needs).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from higgs_pack.manifests.model import SubPart
from higgs_pack.runtime.loop.pipeline import Pipeline
from higgs_pack.runtime.sources.bundle import Bundle


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


def rel_l2(expected: np.ndarray, got: np.ndarray) -> float:
    """Relative L2 error ``||got - expected|| / ||expected||`` (scale-aware, unlike cosine).

    ``inf`` for a shape mismatch or non-finite output; the plain norm of ``got`` when
    ``expected`` is all zero.
    """
    if expected.shape != got.shape or not np.isfinite(got).all():
        return float("inf")
    a = expected.astype(np.float64).ravel()
    b = got.astype(np.float64).ravel()
    denom = float(np.linalg.norm(a))
    return float(np.linalg.norm(b - a)) / denom if denom else float(np.linalg.norm(b))


def _run_subpart(pipeline: Pipeline, golden: dict[str, np.ndarray], part: str) -> dict[str, np.ndarray]:
    """The sub-part's outputs on its golden inputs, by golden output name."""
    if part == SubPart.AUDIO_TOKENIZER_STREAM:
        return {"waveform": _stream_golden(pipeline, golden[f"{part}/in/audio_codes"])}
    if part == SubPart.LLM_DECODER:
        pipeline.decoder.reset()
        first = pipeline.decoder.forward(golden["llm_decoder/in/inputs_embeds"])
        second = pipeline.decoder.forward(golden["llm_decoder/in/step_embeds"])
        return {"hidden_states": first, "step_hidden_states": second}
    runner = getattr(pipeline, part)
    prefix_in = f"{part}/in/"
    return runner.run({k[len(prefix_in):]: v for k, v in golden.items() if k.startswith(prefix_in)})


#: Frames per call when verification streams the golden codes through ``audio_tokenizer_stream``
#: (after the first call, which takes the lookahead + 1): one frame, then several at once.
STREAM_CALLS = (1, 1, 3, 7, 2)


def _stream_golden(pipeline: Pipeline, codes: np.ndarray) -> np.ndarray:
    """The streaming codec's audio for golden ``codes`` int64 [1, N, T], streamed with
    :data:`STREAM_CALLS`: float32 [1, 1, T * hop], to compare with the one-shot decode."""
    import itertools

    from higgs_pack.runtime.loop.stateful_codec import runner_step, stream_decode

    if pipeline.audio_tokenizer_stream is None or pipeline.stream_codec is None:
        raise ValueError("the bundle lists audio_tokenizer_stream but the pipeline did not open it")
    samples = stream_decode(runner_step(pipeline.audio_tokenizer_stream.run), pipeline.stream_codec,
                            np.asarray(codes[0]).T, itertools.cycle(STREAM_CALLS))
    return samples.reshape(1, 1, -1)


def output_errors(pairs: list[tuple[np.ndarray, np.ndarray]], metric: str) -> dict[str, float | None]:
    """How far outputs are from their references, the worst over ``(expected, got)`` pairs.

    Returns:
        ``measured`` (the lowest cosine, or code agreement for ``code_agreement``),
        ``measured_max_abs`` (largest absolute difference; None for codes) and, for float
        outputs, ``rel_l2`` (the largest relative L2 error, see :func:`rel_l2`).
    """
    scores = [compare(want, got, metric) for want, got in pairs]
    result: dict[str, float | None] = {
        "measured": min(x[0] for x in scores),
        "measured_max_abs": max((x[1] for x in scores if x[1] is not None), default=None),
    }
    if metric != "code_agreement":
        result["rel_l2"] = max(rel_l2(want, got) for want, got in pairs)
    return result


def subpart_errors(pipeline: Pipeline, golden: dict[str, np.ndarray], part: str, metric: str
                   ) -> dict[str, float | None]:
    """Run one sub-part on its golden inputs and measure it against the references.

    Golden keys are ``<part>/in/<tensor>``, ``<part>/out/<tensor>`` (the float oracle)
    and, for sub-parts whose weights were quantized or cast, ``<part>/matched/<tensor>``
    (the oracle with the bundle's own weights, see ``exporters/pytorch/matched.py``).  The
    decoder has a prefill (``inputs_embeds`` -> ``hidden_states``) and one cached step
    (``step_embeds`` -> ``step_hidden_states``); every score is the worse of its outputs.

    Returns:
        :func:`output_errors` against the float oracle (``measured``, ``measured_max_abs``,
        ``rel_l2``) and, when matched references exist, ``matched_rel_l2`` and ``matched_cosine``.
    """
    return errors_against(golden, part, _run_subpart(pipeline, golden, part), metric)


def errors_against(golden: dict[str, np.ndarray], part: str, outs: dict[str, np.ndarray], metric: str
                   ) -> dict[str, float | None]:
    """:func:`subpart_errors` of outputs already computed: ``outs`` by golden output name (the
    decoder's ``hidden_states`` and ``step_hidden_states``, from any runner of it)."""
    result: dict[str, float | None] = {}
    for kind, prefix in (("", f"{part}/out/"), ("matched_", f"{part}/matched/")):
        pairs = [(v, outs[k[len(prefix):]]) for k, v in golden.items() if k.startswith(prefix)]
        if not pairs:
            continue
        errors = output_errors(pairs, metric)
        if kind:
            result["matched_cosine"] = errors["measured"]
            if "rel_l2" in errors:
                result["matched_rel_l2"] = errors["rel_l2"]
        else:
            result.update(errors)
    return result


def export_error(rule: dict[str, Any], errors: dict[str, float | None]) -> tuple[str, float, float | None]:
    """What decides a sub-part's parity under :func:`judge_parity`: ``(what it is, value, limit)``.

    The relative L2 error against the oracle with the bundle's own weights (matched
    references), else against the float oracle (where the rule has ``max_rel_l2``), else
    ``1 - similarity`` against ``1 - threshold`` (code agreement, and older bundles' rules).
    """
    limit = rule.get("max_rel_l2")
    if rule.get("reference") == "matched" and errors.get("matched_rel_l2") is not None:
        return "rel L2 vs the oracle with the bundle's weights", errors["matched_rel_l2"], limit
    if limit is not None and errors.get("rel_l2") is not None:
        return "rel L2 vs the float oracle", errors["rel_l2"], limit
    return f"1 - {rule['metric']}", 1.0 - errors["measured"], 1.0 - rule["threshold"]


def judge_parity(rule: dict[str, Any], errors: dict[str, float | None]) -> tuple[bool, str]:
    """The one parity rule of every comparison: (ok, one-line detail).

    Applied to :func:`subpart_errors` on the bundle's provider or device (``verify``), on an
    OpenVINO GPU/NPU (``backend_checks.check_gpu``/``check_npu``), and to
    :func:`output_errors` of a GPU provider against the CPU provider (``compare_providers``).

    With matched references (``rule["reference"] == "matched"`` and ``matched_rel_l2`` in
    ``errors``) the export error (:func:`export_error`) is judged against ``max_rel_l2``;
    the similarity to the float oracle is the quantization error and is reported, not
    judged (random deep models amplify it; the build checked every read-back weight
    instead).  Otherwise both the similarity (``threshold``) and, where the rule has
    ``max_rel_l2``, the relative L2 error are judged: cosine alone misses a scale error
    (an output x1.05 has cosine 1.0).
    """
    metric, threshold = rule["metric"], rule["threshold"]
    measured = errors["measured"]
    what, export, limit = export_error(rule, errors)
    if rule.get("reference") == "matched" and errors.get("matched_rel_l2") is not None:
        ok = limit is None or export <= limit
        return ok, (f"export error {export:.3g} {what} (limit {limit}); quantization: {metric} {measured:.6f}, "
                    f"rel L2 {errors['rel_l2']:.3g} vs the float oracle")
    ok = measured >= threshold
    detail = f"{metric} {measured:.6f} (threshold {threshold}"
    if errors.get("measured_max_abs") is not None:
        detail += f", max |diff| {errors['measured_max_abs']:.3g}"
    detail += ")"
    if rule.get("max_rel_l2") is not None and errors.get("rel_l2") is not None:
        ok = ok and export <= limit
        detail += f", rel L2 {export:.3g} (limit {limit})"
    return ok, detail


def judge_subpart(pipeline: Pipeline, golden: dict[str, np.ndarray], part: str, rule: dict[str, Any]
                  ) -> tuple[dict[str, float | None], bool, str]:
    """:func:`subpart_errors` of one sub-part judged by :func:`judge_parity`: ``(errors, ok, detail)``.

    Raises:
        whatever the sub-part's runner raises (HiggsPackError, the backend's own errors).
    """
    errors = subpart_errors(pipeline, golden, part, rule["metric"])
    ok, detail = judge_parity(rule, errors)
    return errors, ok, detail


@dataclass
class Check:
    """One line of a verification report.

    Attributes:
        name: what was checked.
        ok: True passed, False failed, None skipped (``detail`` says why).
        detail: the measurement or the reason, for people.
        value: the measured number, where there is one.
        informational: measured and shown but not judged (status ``info``; never fails the run).
    """

    name: str
    ok: bool | None
    detail: str
    value: float | None = None
    informational: bool = False

    @property
    def status(self) -> str:
        """``ok``, ``FAIL``, ``skipped`` or ``info``."""
        if self.informational:
            return "info"
        return {True: "ok", False: "FAIL", None: "skipped"}[self.ok]


@dataclass
class VerifyReport:
    """All checks of one verification run.

    Attributes:
        bundle: bundle name.
        checks: every check, in order; ``ok`` None means skipped (detail says why).
        parity: sub-part -> measured similarity (for the manifest).
        summary: target, precision, backend, device/provider the bundle was built for.
        thresholds: sub-part -> the manifest's parity rule it was judged by (``metric``,
            ``threshold`` and, where recorded, ``max_rel_l2`` and ``reference``).
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

    def add(self, name: str, ok: bool | None, detail: str, value: float | None = None, *,
            informational: bool = False) -> Check:
        check = Check(name, None if informational else ok, detail, value, informational)
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
        lines = [f"verify {self.bundle}" + (f" ({self.backend})" if self.backend else "")]
        lines += [f"  {c.status:>7}  {c.name:<{width}}  {c.detail}" for c in self.checks]
        lines.append(f"result: {'PASS' if self.ok else 'FAIL'}")
        return "\n".join(lines)

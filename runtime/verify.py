"""Verify a bundle with nothing but the bundle: files, signatures, parity, speech.

``verify_bundle`` returns a :class:`VerifyReport` instead of raising at the
first problem (like ``huggingface_hub``'s folder verification), so one run shows
everything that is wrong.  The same function runs at build time (its numbers are
recorded in the manifest) and in ``higgs-pack verify`` / ``nox -s verify-<target>``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from higgs_pack.manifests.constants import SubPart
from higgs_pack.manifests.errors import HiggsPackError
from higgs_pack.manifests.manifest import check_files
from higgs_pack.runtime.bundle import Bundle, load, open_bundle
from higgs_pack.runtime.delay import SamplingOptions
from higgs_pack.runtime.generate import build_prompt, generate_codes, synthesize
from higgs_pack.runtime.pipeline import Pipeline

#: Greedy decoding of an fp32 bundle must reproduce the oracle's codes for at least this many frames.
MIN_GREEDY_FRAMES = 16

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
    """

    bundle: str
    backend: str = ""
    checks: list[Check] = field(default_factory=list)
    parity: dict[str, dict[str, float | None]] = field(default_factory=dict)

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


def verify_bundle(
    bundle: str | Path | Bundle,
    *,
    execution_provider: str | None = None,
    device: str | None = None,
    allow_fallback: bool = False,
    cases_dir: Path | None = None,
    synthesize_cases: bool = True,
    extra_checks: list | None = None,
) -> VerifyReport:
    """Check a bundle end to end, on the runtime alone (no torch, no checkpoint).

    Checks, in order: manifest + every file's size and sha256; the backend's
    :data:`STRUCTURE_CHECKS` on the files (OpenVINO: the decoder's state, static
    shapes); sub-part I/O signatures (at load); per-sub-part parity against ``reference/golden.npz``
    with the manifest's thresholds; greedy codes vs the oracle (fp32: exact for
    at least 16 frames); the backend's :data:`RUNTIME_CHECKS` (OpenVINO: GPU and
    NPU devices where present; ONNX Runtime: node placement on a non-CPU provider);
    then, when ``cases_dir`` is given, synthesis of its
    English and Chinese texts and a voice clone from ``ref_en_16k.wav``.

    Args:
        bundle: directory, installed bundle name, or opened bundle.
        execution_provider, device, allow_fallback: as for :func:`~higgs_pack.runtime.bundle.load`.
        cases_dir: folder with ``text_en_basic.txt``, ``text_zh.txt``,
            ``ref_en_16k.wav`` and ``ref_en_16k.txt`` (``shared/cases``).
        synthesize_cases: set False to skip synthesis.
        extra_checks: callables ``f(bundle, pipeline, report)`` run after parity,
            after the backend's own :data:`RUNTIME_CHECKS`.

    Returns:
        A :class:`VerifyReport`; ``report.ok`` is False when any check failed.
    """
    name = str(bundle.path if isinstance(bundle, Bundle) else bundle)
    report = VerifyReport(bundle=name)
    try:
        opened = bundle if isinstance(bundle, Bundle) else open_bundle(bundle, check_hashes=False)
        files = check_files(opened.path, opened.manifest)
    except HiggsPackError as exc:
        report.add("manifest+files", False, str(exc))
        return report
    report.bundle = opened.name
    m = opened.manifest
    report.add("manifest", True, f"format {m['format_version']}, target {m['target']}, precision {m['precision']}")
    report.add("files", files.ok, f"{files.checked} files, sha256 ok" if files.ok else
               f"missing {files.missing}, changed {files.mismatched}")
    if not files.ok:
        return report
    for structure_check in STRUCTURE_CHECKS.get(m["backend"], ()):
        structure_check(opened, report)
    try:
        pipeline = load(opened, execution_provider=execution_provider, device=device,
                        allow_fallback=allow_fallback)
    except HiggsPackError as exc:
        report.add("load", False, str(exc))
        return report
    report.backend = ", ".join(sorted(set(pipeline.description.values())))
    report.add("load+signatures", True, f"6 sub-parts on {report.backend}")
    golden = read_golden(opened)
    # Verifying on a provider other than the bundle's own (cuda/dml bundles checked on
    # the CPU EP): a graph that provider cannot execute is skipped with ONNX Runtime's
    # reason, never failed and never faked.  On the bundle's own provider it fails.
    own = m["execution_provider"] if m["backend"] == "onnxruntime" else None
    substitute = own is not None and execution_provider not in (None, own)
    cannot_run: dict[str, str] = {}
    for part, spec in m["subparts"].items():
        rule = spec["parity"]
        try:
            measured, max_abs = subpart_parity(pipeline, golden, part, rule["metric"])
        except Exception as exc:  # HiggsPackError, or the backend's own error types
            reason = provider_cannot_run(exc) if substitute else None
            if reason is None:
                report.add(f"parity {part}", False,
                           str(exc) if isinstance(exc, HiggsPackError) else f"{type(exc).__name__}: {exc}")
                continue
            where = pipeline.description.get(part, execution_provider).split(" (")[0]
            cannot_run[part] = f"{where} cannot execute this graph (built for {own}): {reason}"
            report.parity[part] = {"measured": None, "measured_max_abs": None}
            report.add(f"parity {part}", None, f"skipped: {cannot_run[part]}; its parity is checked "
                       f"where the {own} provider exists (higgs-pack verify on that machine)")
            continue
        report.parity[part] = {"measured": measured, "measured_max_abs": max_abs}
        ok = measured >= rule["threshold"]
        extra = f", max |diff| {max_abs:.3g}" if max_abs is not None else ""
        report.add(f"parity {part}", ok,
                   f"{rule['metric']} {measured:.6f} (threshold {rule['threshold']}{extra})", measured)
    loop_parts = ("text_embed", "llm_decoder", "audio_embed", "audio_heads")
    blocked = [p for p in loop_parts if p in cannot_run]
    if blocked:
        report.add("greedy codes", None, f"skipped: {blocked[0]}: {cannot_run[blocked[0]]}")
    else:
        try:
            _check_greedy(pipeline, opened, golden, report)
        except HiggsPackError as exc:  # e.g. NumericalError from a decoder that returns NaN
            report.add("greedy codes", False, str(exc))
    for extra_check in (*RUNTIME_CHECKS.get(m["backend"], ()), *(extra_checks or [])):
        extra_check(opened, pipeline, report)
    if synthesize_cases and cases_dir is not None:
        if blocked:
            report.add("synthesize cases", None, f"skipped: {blocked[0]}: {cannot_run[blocked[0]]}")
        else:
            _check_cases(pipeline, Path(cases_dir), report)
    return report


def _check_greedy(pipeline: Pipeline, bundle: Bundle, golden: dict[str, np.ndarray], report: VerifyReport) -> None:
    expected = golden["greedy/delayed"]
    text = bundle.manifest["reference"]["cases"][0]
    result = generate_codes(
        pipeline, build_prompt(pipeline, text), SamplingOptions(temperature=0.0, repeat_guard_frames=0),
        max_frames=expected.shape[0] - pipeline.constants.num_codebooks + 1,
    )
    got = result.delayed
    n = min(len(got), len(expected))
    same = int(np.argmin(np.r_[(got[:n] == expected[:n]).all(axis=1), False]))
    exact_needed = bundle.manifest["precision"] == "fp32"
    if exact_needed:
        ok = same >= min(MIN_GREEDY_FRAMES, len(expected)) and len(expected) >= MIN_GREEDY_FRAMES
        report.add("greedy codes", ok, f"{same}/{len(expected)} steps identical to the PyTorch reference "
                   f"(fp32 needs >= {MIN_GREEDY_FRAMES})", same)
    else:
        report.add("greedy codes", True, f"{same}/{len(expected)} steps identical to the PyTorch reference "
                   f"(informational at {bundle.manifest['precision']})", same)


def _check_cases(pipeline: Pipeline, cases: Path, report: VerifyReport) -> None:
    from higgs_pack.runtime.audio import load_audio, prepare_reference

    c = pipeline.constants
    jobs: list[tuple[str, str, np.ndarray | None, str | None]] = []
    for name in ("text_en_basic", "text_zh"):
        path = cases / f"{name}.txt"
        if path.is_file():
            jobs.append((name, path.read_text(encoding="utf-8"), None, None))
        else:
            report.add(f"synthesize {name}", None, f"{path} not found")
    ref_wav, ref_txt = cases / "ref_en_16k.wav", cases / "ref_en_16k.txt"
    en = cases / "text_en_basic.txt"
    if ref_wav.is_file() and ref_txt.is_file() and en.is_file():
        samples, rate = load_audio(ref_wav)
        ref = prepare_reference(samples, rate, c.sample_rate, c.hop_length, str(ref_wav))
        jobs.append(("clone ref_en_16k", en.read_text(encoding="utf-8"), ref, ref_txt.read_text(encoding="utf-8")))
    for name, text, ref, ref_text in jobs:
        start = time.perf_counter()
        try:
            out = synthesize(pipeline, text, ref_samples=ref, ref_text=ref_text,
                             options=SamplingOptions(seed=0))
        except HiggsPackError as exc:
            report.add(f"synthesize {name}", False, str(exc))
            continue
        seconds = time.perf_counter() - start
        expected_len = sum(len(r.codes) for r in out.chunks) * c.hop_length
        gaps = (len(out.chunks) - 1) * int(0.2 * c.sample_rate)
        ok = (out.samples.size > 0 and bool(np.isfinite(out.samples).all())
              and out.samples.size == expected_len + gaps)
        stops = ",".join(r.stop_reason for r in out.chunks)
        report.add(f"synthesize {name}", ok,
                   f"{out.seconds_of_audio:.2f} s audio, {len(out.codes)} frames, stop {stops}, "
                   f"peak {float(np.abs(out.samples).max()) if out.samples.size else 0:.3f}, "
                   f"RTF {seconds / max(out.seconds_of_audio, 1e-9):.3f}")


# ----------------------------------------------------------------------------- backend checks


def check_decoder_state(bundle: Bundle, report: VerifyReport) -> None:
    """OpenVINO: the decoder IR keeps its KV cache as state exactly when the manifest says so."""
    from higgs_pack.runtime.openvino_backend import ir_state_variables

    spec = bundle.subpart(SubPart.LLM_DECODER)
    options = spec["options"]
    declared = bool(options.get("stateful", not options.get("static")))
    try:
        variables = ir_state_variables(bundle.file(spec["entry"]))
    except (HiggsPackError, RuntimeError) as exc:
        report.add("decoder state", False, f"cannot read {spec['entry']}: {exc}")
        return
    if declared and variables:
        report.add("decoder state", True, f"stateful as declared: {len(variables)} state variables (KV cache)")
    elif not declared and not variables:
        report.add("decoder state", True, f"stateless as declared (static KV window of "
                   f"{options.get('kv_length', '?')} positions held by the runtime)")
    else:
        said, found = ("stateful", "no state variables (a stateless IR)") if declared else \
            ("stateless", f"{len(variables)} state variables")
        report.add("decoder state", False, f"the manifest declares a {said} decoder but {spec['entry']} has "
                   f"{found}; the files and the manifest do not belong together: rebuild the bundle")


def check_static_shapes(bundle: Bundle, report: VerifyReport) -> None:
    """OpenVINO: every sub-part whose manifest promises static shapes has no dynamic dimension."""
    from higgs_pack.runtime.openvino_backend import static_shape_problems

    try:
        problems = static_shape_problems(bundle)
    except (HiggsPackError, RuntimeError) as exc:
        report.add("static shapes", False, f"cannot read the IRs: {exc}")
        return
    if not problems:
        report.add("static shapes", None, "no sub-part promises static shapes (a dynamic bundle; "
                   "NPUs need one built with --npu)")
        return
    bad = {part: p for part, p in problems.items() if p}
    if bad:
        report.add("static shapes", False, "; ".join(f"{part}: {', '.join(p)}" for part, p in bad.items()))
    else:
        dynamic = sorted(set(bundle.manifest["subparts"]) - set(problems))
        report.add("static shapes", True, f"{len(problems)} sub-parts fully static as promised"
                   + (f" (dynamic, not promised: {', '.join(dynamic)})" if dynamic else ""))


def _last_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[-1] if lines else type(exc).__name__


#: OpenVINO device -> what it is, for skip messages.
DEVICE_LABELS = {"GPU": "Intel GPU", "NPU": "Intel NPU"}


def _check_on_device(device: str, bundle: Bundle, pipeline: Pipeline, report: VerifyReport) -> None:
    """OpenVINO: load the bundle on ``device`` and check parity there, when the device exists."""
    import openvino as ov

    name = f"device {device}"
    available = list(ov.Core().available_devices)
    if not any(d.split(".")[0] == device for d in available):
        report.add(name, None, f"no {DEVICE_LABELS.get(device, device)} (OpenVINO '{device}' device) on this "
                   f"machine (devices: {', '.join(available) or 'none'})")
        return
    if any(desc.startswith(f"OpenVINO {device}") for desc in pipeline.description.values()):
        report.add(name, None, f"the checks above ran on {device}")
        return
    subparts = bundle.manifest["subparts"]
    if device == "NPU" and not all(s["options"].get("static") or s["options"].get("device_overrides", {}).get("NPU")
                                   for s in subparts.values()):
        report.add(name, None, "this bundle has dynamic shapes and the NPU compiles static ones only: "
                   "build the npu variant (higgs-pack build --target openvino --npu)")
        return
    try:
        other = load(bundle, device=device)
        golden = read_golden(bundle)
        scores = {part: subpart_parity(other, golden, part, spec["parity"]["metric"])[0]
                  for part, spec in subparts.items()}
    except Exception as exc:  # HiggsPackError, or OpenVINO's RuntimeError while inferring
        report.add(name, False, f"on {device}: {type(exc).__name__}: {_last_line(exc)}")
        return
    failed = [p for p, v in scores.items() if v < subparts[p]["parity"]["threshold"]]
    detail = ", ".join(f"{p} {v:.4f}" for p, v in scores.items())
    report.add(name, not failed, f"parity on {device}: {detail}" + (f"; below threshold: {failed}" if failed else ""),
               min(scores.values()))


def check_gpu(bundle: Bundle, pipeline: Pipeline, report: VerifyReport) -> None:
    """OpenVINO: parity on the Intel GPU (``GPU``), or skipped naming the missing device."""
    _check_on_device("GPU", bundle, pipeline, report)


def check_npu(bundle: Bundle, pipeline: Pipeline, report: VerifyReport) -> None:
    """OpenVINO: parity on the Intel NPU (``NPU``) for static bundles, or skipped with the reason."""
    _check_on_device("NPU", bundle, pipeline, report)


def check_node_placement(bundle: Bundle, pipeline: Pipeline, report: VerifyReport) -> None:
    """ONNX Runtime: on a provider other than CPU, which nodes it left on the CPU provider.

    Informational (the OpenVINO EP leaves ModelBuilder's GroupQueryAttention on the
    CPU EP): each sub-part is run once more with ORT profiling, and the profile says
    which provider ran each node.
    """
    from higgs_pack.manifests.constants import EXECUTION_PROVIDERS
    from higgs_pack.runtime.ort_backend import bundle_node_placement

    by_provider = {row.ort_provider: name for name, row in EXECUTION_PROVIDERS.items()}
    used = set(pipeline.description.values())
    eps = sorted({by_provider[u] for u in used if u in by_provider and u != "CPUExecutionProvider"})
    if not eps:
        report.add("node placement", None, f"every sub-part runs on {', '.join(sorted(used))}; placement is "
                   "checked on other providers")
        return
    ep = eps[0]
    provider = EXECUTION_PROVIDERS[ep].ort_provider
    try:
        placements = bundle_node_placement(bundle, ep, read_golden(bundle))
    except HiggsPackError as exc:
        report.add("node placement", False, str(exc))
        return
    except Exception as exc:  # onnxruntime's own error types: a graph this provider cannot run
        report.add("node placement", None, f"not measured: {type(exc).__name__}: {_last_line(exc)}")
        return
    on_cpu = {part: pl.on("CPUExecutionProvider") for part, pl in placements.items()}
    taken = sum(len(pl.on(provider)) for pl in placements.values())
    left = sum(len(nodes) for nodes in on_cpu.values())
    if not left:
        report.add("node placement", True, f"{provider} ran every node ({taken} nodes or fused subgraphs)", 0)
        return
    parts = []
    for part, nodes in on_cpu.items():
        if nodes:
            ops = ", ".join(f"{op} x{n}" for op, n in sorted(placements[part].op_counts("CPUExecutionProvider").items()))
            names = ", ".join(n for n, _ in nodes[:4]) + (" …" if len(nodes) > 4 else "")
            parts.append(f"{part}: {ops} ({names})")
    report.add("node placement", True, f"{left} nodes left on CPUExecutionProvider, {taken} nodes or fused "
               f"subgraphs on {provider}: " + "; ".join(parts), left)


# ----------------------------------------------------------------------------- GPU providers (cuda, dml)

#: bundle EP -> the hardware it needs, as skip reasons name it.
GPU_HARDWARE = {"cuda": "no CUDA GPU", "dml": "no DirectML GPU (Windows 10/11 with DirectX 12)"}
#: Scale of the low-magnitude probe: x**2 of values this small underflows in float16 (its
#: smallest normal is 6.1e-5), where fp16 RMS normalisation has been reported to return
#: zeros or NaN on some kernels.
LOW_MAGNITUDE = 1e-4


def _probe_inputs(golden: dict[str, np.ndarray]) -> dict[str, dict[str, np.ndarray]]:
    """Decoder / audio_heads inputs for the provider comparison, from the golden arrays."""
    prompt = golden["llm_decoder/in/inputs_embeds"].astype(np.float32)
    hidden = golden["audio_heads/in/hidden_states"].astype(np.float32)
    return {
        "golden prompt": {"llm_decoder": prompt, "audio_heads": hidden},
        "one-token prompt": {"llm_decoder": prompt[:, :1], "audio_heads": hidden[:, :1]},
        "low-magnitude embeddings": {"llm_decoder": prompt * LOW_MAGNITUDE, "audio_heads": hidden * LOW_MAGNITUDE},
    }


def _run_probe(pipeline: Pipeline, part: str, x: np.ndarray) -> np.ndarray:
    if part == SubPart.LLM_DECODER:
        pipeline.decoder.reset()
        return pipeline.decoder.forward(x)
    return pipeline.audio_heads.run({"hidden_states": x})["audio_logits"]


def compare_providers(bundle: Bundle, target: Pipeline, reference: Pipeline | None, report: VerifyReport, *,
                      label: str, reference_note: str = "") -> None:
    """Run the decoder and audio heads on ``target`` and ``reference`` with the same inputs.

    Probes: the golden prompt, a one-token prompt, and the golden prompt scaled by
    :data:`LOW_MAGNITUDE`.  Every target output must be finite and not all zero (the
    reported fp16 normalisation failure); where the reference can run the graph, the
    cosine must reach the sub-part's parity threshold from the manifest.  A reference
    that cannot execute a graph (the CPU provider and ModelBuilder's CUDA-only fused
    Q/K-norm attention) is said, and the finite/non-zero checks still run.
    """
    subparts = bundle.manifest["subparts"]
    golden = read_golden(bundle)
    ref_blocked: dict[str, str] = {}
    for probe, inputs in _probe_inputs(golden).items():
        for part, x in inputs.items():
            name = f"{label} vs CPU: {part}, {probe}"
            try:
                got = _run_probe(target, part, x)
            except Exception as exc:  # the provider's own error is the finding
                report.add(name, False, f"{type(exc).__name__}: {_last_line(exc)}")
                continue
            if not np.isfinite(got).all():
                report.add(name, False, f"{int((~np.isfinite(got)).sum())} non-finite values of {got.size}")
                continue
            if not got.any():
                report.add(name, False, f"all {got.size} outputs are zero")
                continue
            if reference is None or part in ref_blocked:
                why = ref_blocked.get(part, reference_note or "no reference provider")
                report.add(name, True, f"finite, not all zero (peak {float(np.abs(got).max()):.3g}); "
                           f"comparison skipped: {why}")
                continue
            try:
                want = _run_probe(reference, part, x)
            except Exception as exc:
                why = provider_cannot_run(exc)
                if why is None:
                    report.add(name, False, f"reference run failed: {type(exc).__name__}: {_last_line(exc)}")
                    continue
                ref_blocked[part] = f"the reference provider cannot execute this graph: {why}"
                report.add(name, True, f"finite, not all zero (peak {float(np.abs(got).max()):.3g}); "
                           f"comparison skipped: {ref_blocked[part]}")
                continue
            rule = subparts[part]["parity"]
            cosine, max_abs = compare(want, got, "cosine")
            report.add(name, cosine >= rule["threshold"],
                       f"cosine {cosine:.6f} (threshold {rule['threshold']}), max |diff| {max_abs:.3g}", cosine)


def check_gpu_provider(bundle: Bundle, report: VerifyReport, *, ep: str | None = None,
                       cases_dir: Path | None = None, require: bool = False) -> None:
    """Run an ONNX Runtime bundle on its GPU provider where the hardware exists.

    On CUDA (onnxruntime-gpu) or DirectML (onnxruntime-directml, Windows): the whole
    :func:`verify_bundle` on that provider (sessions proved to be on it, parity against
    the golden outputs, greedy codes, node placement, synthesis of ``cases_dir``), then
    :func:`compare_providers` against the CPU provider on the same inputs.  Without the
    provider: one skipped line naming the missing hardware, e.g. "no CUDA GPU:
    CUDAExecutionProvider not available".

    Args:
        bundle: an opened ONNX Runtime bundle.
        report: where the lines go (prefixed with the EP name).
        ep: provider to check; default the bundle's own.
        cases_dir: ``shared/cases``, synthesized on the provider when given.
        require: report a missing or unusable provider as a failure, not a skip (for a
            machine known to have the hardware).
    """
    from higgs_pack.manifests.constants import EXECUTION_PROVIDERS
    from higgs_pack.runtime.ort_backend import import_ort, installed_ort_distributions

    ep = ep or bundle.manifest["execution_provider"]
    row = EXECUTION_PROVIDERS[ep]
    missing = False if require else None
    ort = import_ort()
    available = ort.get_available_providers()
    if row.ort_provider not in available:
        report.add(f"{ep} runtime", missing, f"{GPU_HARDWARE.get(ep, ep)}: {row.ort_provider} not available "
                   f"(installed providers: {', '.join(available)}; distributions: "
                   f"{', '.join(installed_ort_distributions()) or 'none'}). Where the hardware exists: "
                   f"pip install '{row.requirement}', then nox -s verify-{bundle.manifest['target']}")
        return
    try:
        target = load(bundle, execution_provider=ep)
    except HiggsPackError as exc:
        report.add(f"{ep} runtime", missing, f"{row.ort_provider} is installed but unusable here "
                   f"({GPU_HARDWARE.get(ep, ep)}, or its libraries are missing?): {exc}")
        return
    elsewhere = {p: d for p, d in target.description.items() if d.split(" (")[0] != row.ort_provider}
    report.add(f"{ep} sessions", not elsewhere, f"every sub-part's session is on {row.ort_provider}" if not elsewhere
               else f"not on {row.ort_provider}: {elsewhere}")
    sub = verify_bundle(bundle, execution_provider=ep, cases_dir=cases_dir, synthesize_cases=cases_dir is not None)
    for check in sub.checks:
        if check.name not in ("manifest", "files"):
            report.add(f"{ep}: {check.name}", check.ok, check.detail, check.value)
    try:
        reference, note = load(bundle, execution_provider="cpu"), ""
    except HiggsPackError as exc:
        reference, note = None, f"the CPU provider cannot open the bundle: {exc}"
    compare_providers(bundle, target, reference, report, label=ep, reference_note=note)


#: backend -> checks on the bundle's files, run before any session is created.
STRUCTURE_CHECKS: dict[str, tuple] = {"openvino": (check_decoder_state, check_static_shapes)}
#: backend -> checks on the loaded pipeline, run after parity and greedy decoding.
RUNTIME_CHECKS: dict[str, tuple] = {"openvino": (check_gpu, check_npu), "onnxruntime": (check_node_placement,)}


def verify_any(target: str | Path, **kwargs: Any) -> VerifyReport:
    """Verify a bundle directory, an installed bundle name, or a bundle archive.

    Archives (``.tar.gz``, ``.zip``) are checked member by member and extracted
    into a temporary directory (never the working directory) before the bundle
    checks; see :mod:`higgs_pack.runtime.archive`.
    """
    path = Path(target)
    if path.is_file():
        from higgs_pack.runtime.archive import extracted_archive

        with extracted_archive(path) as bundle_dir:
            return verify_bundle(bundle_dir, **kwargs)
    return verify_bundle(target, **kwargs)

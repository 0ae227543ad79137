"""Verify a bundle with nothing but the bundle: files, static checks, signatures, parity, speech.

``verify_bundle`` returns a :class:`VerifyReport` instead of raising at the
first problem (like ``huggingface_hub``'s folder verification), so one run shows
everything that is wrong.  The same function runs at build time (its numbers are
recorded in the manifest) and in ``higgs-pack verify`` / every ``nox -s verify-<target>``,
for every target: what differs per backend or provider is registered here as data
(each backend object's :meth:`~higgs_pack.runtime.backends.Backend.structure_checks` and
:meth:`~higgs_pack.runtime.backends.Backend.runtime_checks`, the provider row's ``gpu`` flag),
never chosen by a target's name.  The bundle is opened once and loaded once per device
it is checked on.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np

from higgs_pack.errors import HiggsPackError, InputError, Problem
from higgs_pack.manifests.manifest import read_manifest
from higgs_pack.manifests.providers import CPU_PROVIDER, EXECUTION_PROVIDERS
from higgs_pack.runtime.backends import get_backend
from higgs_pack.runtime.backends.onnxruntime.distributions import (
    import_ort,
    installed_ort_distributions,
)
from higgs_pack.runtime.backends.onnxruntime.failures import provider_cannot_run
from higgs_pack.runtime.loop.decode import generate_codes
from higgs_pack.runtime.loop.pipeline import Pipeline
from higgs_pack.runtime.loop.prompt import build_prompt
from higgs_pack.runtime.loop.synthesis import synthesize
from higgs_pack.runtime.options import SamplingOptions
from higgs_pack.runtime.sources.bundle import Bundle, find_bundle, load_pipeline, open_bundle
from higgs_pack.runtime.sources.file_kinds import check_bundle_files
from higgs_pack.runtime.verification.backend_checks import (
    compare_providers,
)
from higgs_pack.runtime.verification.report import VerifyReport, judge_subpart, read_golden

#: Greedy decoding of an fp32 bundle must reproduce the oracle's codes for at least this many frames.
MIN_GREEDY_FRAMES = 16
#: Frames of the greedy comparison below fp32, where it is reported, not judged.
INFORMATIONAL_GREEDY_FRAMES = 32
#: The sub-parts the generation loop runs (a greedy or case run needs all of them).
LOOP_PARTS = ("text_embed", "llm_decoder", "audio_embed", "audio_heads")


def _structure_checks(backend: str) -> tuple[Callable[[Bundle, VerifyReport], None], ...]:
    """The file-level checks of ``backend``'s object (:meth:`~higgs_pack.runtime.backends.Backend.structure_checks`)."""
    return get_backend(backend).structure_checks()


def _runtime_checks(backend: str) -> tuple[Callable[[Bundle, Pipeline, VerifyReport], None], ...]:
    """The checks on a loaded pipeline of ``backend``'s object (:meth:`~higgs_pack.runtime.backends.Backend.runtime_checks`)."""
    return get_backend(backend).runtime_checks()


@dataclasses.dataclass(frozen=True)
class VerifyOptions:
    """What :func:`verify_bundle` checks, and where.

    Attributes:
        execution_provider, device, allow_fallback: as for :func:`~higgs_pack.runtime.sources.bundle.load_pipeline`.
        cases_dir: folder with ``text_en_basic.txt``, ``text_zh.txt``, ``ref_en_16k.wav``
            and ``ref_en_16k.txt`` (``shared/cases``); None: no synthesis.
        synthesize_cases: set False to skip synthesis even with ``cases_dir``.
        extra_checks: callables ``f(bundle, pipeline, report)`` run after the backend's own
            :meth:`~higgs_pack.runtime.backends.Backend.runtime_checks`.
        static: run the :meth:`~higgs_pack.runtime.backends.Backend.structure_checks` (the file-level checks).
        require_gpu: a GPU provider that is missing or unusable here fails the report
            instead of being skipped (for a machine known to have the hardware).
        parity: set False to stop after the file-level checks (no session on the
            bundle's or the CPU provider; the GPU provider run still happens).
        cache_dir: OpenVINO model cache (see :func:`~higgs_pack.runtime.sources.bundle.load_pipeline`). The
            build passes ``False``: verifying a staged bundle then writes no compiled blobs
            (8.3-9.0 GB per full-size openvino bundle were left in the user's cache before).
        low_memory: load as :func:`~higgs_pack.runtime.sources.bundle.load_pipeline` ``low_memory`` (a float
            ONNX Runtime decoder reads its weights in place and pages them out every step);
            the build passes True, so a 4B fp32 bundle verifies within its memory budget.
    """

    execution_provider: str | None = None
    device: str | None = None
    allow_fallback: bool = False
    cases_dir: Path | None = None
    synthesize_cases: bool = True
    extra_checks: tuple[Callable[[Bundle, Pipeline, VerifyReport], None], ...] = ()
    static: bool = True
    require_gpu: bool = False
    parity: bool = True
    cache_dir: Path | Literal[False] | None = None
    low_memory: bool = False

    @property
    def cases(self) -> Path | None:
        """The cases folder to synthesize, or None when synthesis is off."""
        return Path(self.cases_dir) if self.synthesize_cases and self.cases_dir is not None else None


def verify_bundle(bundle: str | Path | Bundle, options: VerifyOptions | None = None, **kwargs: Any
                  ) -> VerifyReport:
    """Check a bundle end to end, on the runtime alone (no torch, no checkpoint).

    Checks, in order: manifest + every file's size and sha256; the backend's
    :meth:`~higgs_pack.runtime.backends.Backend.structure_checks` on the files (ONNX Runtime: onnx.checker, dtypes, kernel
    coverage for GPU providers, decoder I/O; OpenVINO: the decoder's state, static
    shapes); sub-part I/O signatures (at load); per-sub-part parity against ``reference/golden.npz``
    with the manifest's rules; greedy codes vs the oracle (fp32: exact for at least 16
    frames); the backend's :meth:`~higgs_pack.runtime.backends.Backend.runtime_checks` (OpenVINO: GPU and NPU devices where
    present; ONNX Runtime: node placement on a non-CPU provider); then, with
    ``options.cases_dir``, synthesis of its English and Chinese texts and a voice clone
    from ``ref_en_16k.wav``.

    A bundle for a GPU provider (its provider row has ``hardware``) verified without
    ``execution_provider``: the checks above run on the CPU provider (graphs it cannot
    execute are skipped with ONNX Runtime's reason), then :func:`check_gpu_provider`
    loads it once more, on the GPU provider, where it is usable here, or says which
    hardware is missing.  The files are read and checked once; each device loads once.

    Args:
        bundle: directory, installed bundle name, or opened bundle.
        options: what to check (:class:`VerifyOptions`; default: everything on the bundle's
            own provider or device).
        **kwargs: :class:`VerifyOptions` fields, for callers that pass them one by one
            (they replace those of ``options``).

    Returns:
        A :class:`VerifyReport`; ``report.ok`` is False when any check failed.
    """
    options = dataclasses.replace(options or VerifyOptions(), **kwargs)
    if options.cases is not None:
        require_cases(options.cases)
    report = VerifyReport(bundle=str(bundle.path if isinstance(bundle, Bundle) else bundle))
    opened = _check_structure(bundle, options, report)
    if opened is None:
        return report
    row = EXECUTION_PROVIDERS.get(opened.manifest["execution_provider"] or "")
    gpu_run = row is not None and row.gpu and options.execution_provider is None and not options.allow_fallback
    if gpu_run:  # everything on the CPU provider first; the GPU provider after, where present
        options = dataclasses.replace(options, execution_provider=CPU_PROVIDER.name)
    pipeline = None
    if options.parity:
        pipeline = _load(opened, options, report)
        if pipeline is not None:
            check_loaded(opened, pipeline, options, report)
    if gpu_run:
        check_gpu_provider(opened, report, cases_dir=options.cases, require=options.require_gpu, reference=pipeline)
    return report


def _check_structure(bundle: str | Path | Bundle, options: VerifyOptions, report: VerifyReport) -> Bundle | None:
    """Manifest, files and the backend's file-level checks: the opened bundle, or None to stop.

    The files are checked as ``load()`` checks them (readable, size, sha256, each what its
    kind says: :func:`~higgs_pack.runtime.sources.file_kinds.check_bundle_files`), with its message.
    """
    try:
        path = bundle.path if isinstance(bundle, Bundle) else find_bundle(bundle)
        m = bundle.manifest if isinstance(bundle, Bundle) else read_manifest(path)
    except HiggsPackError as exc:
        report.add("manifest", False, str(exc))
        return None
    report.bundle = m["name"]
    report.summary = {k: m.get(k) for k in ("target", "precision", "variant", "backend", "execution_provider",
                                            "device")}
    report.thresholds = {part: {k: spec["parity"][k] for k in ("metric", "threshold", "max_rel_l2", "reference")
                                if k in spec["parity"]} for part, spec in m["subparts"].items()}
    report.add("manifest", True, f"format {m['format_version']}, target {m['target']}, precision {m['precision']}")
    try:
        if isinstance(bundle, Bundle):
            check_bundle_files(bundle.path, m)
            opened = bundle
        else:
            opened = open_bundle(path)
    except HiggsPackError as exc:
        report.add("files", False, str(exc))
        return None
    report.add("files", True, f"{len(m['files'])} files, sha256 ok, each what its kind says")
    for structure_check in _structure_checks(m["backend"]) if options.static else ():
        structure_check(opened, report)
    return opened


def _load(bundle: Bundle, options: VerifyOptions, report: VerifyReport) -> Pipeline | None:
    """The bundle loaded as ``options`` say, with its "load+signatures" line; None (and a FAIL) if it cannot be."""
    try:
        pipeline = load_pipeline(bundle, execution_provider=options.execution_provider, device=options.device,
                        allow_fallback=options.allow_fallback, check_hashes=False, cache_dir=options.cache_dir,
                        low_memory=options.low_memory)
    except HiggsPackError as exc:
        report.add("load", False, str(exc))
        return None
    report.backend = ", ".join(sorted(set(pipeline.description.values())))
    report.add("load+signatures", True, f"{len(pipeline.description)} sub-parts on {report.backend}")
    return pipeline


def check_loaded(bundle: Bundle, pipeline: Pipeline, options: VerifyOptions, report: VerifyReport) -> None:
    """Everything :func:`verify_bundle` checks on a loaded bundle: parity, greedy codes,
    the backend's :meth:`~higgs_pack.runtime.backends.Backend.runtime_checks` and ``options.extra_checks``, and the cases."""
    golden = read_golden(bundle)
    cannot_run = _check_parity(bundle, pipeline, golden, options.execution_provider, report)
    blocked = [p for p in LOOP_PARTS if p in cannot_run]
    if blocked:
        report.add("greedy codes", None, f"skipped: {blocked[0]}: {cannot_run[blocked[0]]}")
    else:
        try:
            _check_greedy(pipeline, bundle, golden, report)
        except HiggsPackError as exc:  # e.g. NumericalError from a decoder that returns NaN
            report.add("greedy codes", False, str(exc))
    for extra_check in (*_runtime_checks(bundle.manifest["backend"]), *options.extra_checks):
        extra_check(bundle, pipeline, report)
    if options.cases is not None:
        if blocked:
            report.add("synthesize cases", None, f"skipped: {blocked[0]}: {cannot_run[blocked[0]]}")
        else:
            _check_cases(pipeline, options.cases, report)


def _check_parity(bundle: Bundle, pipeline: Pipeline, golden: dict[str, np.ndarray], execution_provider: str | None,
                  report: VerifyReport) -> dict[str, str]:
    """One "parity <sub-part>" line each; returns sub-part -> why the provider cannot execute it.

    Verifying on a provider other than the bundle's own (cuda/dml bundles checked on the
    CPU EP): a graph that provider cannot execute is skipped with ONNX Runtime's reason,
    never failed and never faked.  On the bundle's own provider it fails.
    """
    own = bundle.manifest["execution_provider"]  # None for backends without execution providers
    substitute = own is not None and execution_provider not in (None, own)
    cannot_run: dict[str, str] = {}
    for part, spec in bundle.manifest["subparts"].items():
        try:
            errors, ok, detail = judge_subpart(pipeline, golden, part, spec["parity"])
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
        report.parity[part] = {k: (round(v, 9) if isinstance(v, float) and math.isfinite(v) else v)
                               for k, v in errors.items()}
        report.add(f"parity {part}", ok, detail, errors["measured"])
    return cannot_run


def check_gpu_provider(bundle: Bundle, report: VerifyReport, *, ep: str | None = None,
                       cases_dir: Path | None = None, require: bool = False,
                       reference: Pipeline | None = None) -> None:
    """Run an ONNX Runtime bundle on its GPU provider where the hardware exists.

    On CUDA (onnxruntime-gpu) or DirectML (onnxruntime-directml, Windows): the bundle is
    loaded once on that provider (sessions proved to be on it), then :func:`check_loaded`
    runs there (parity against the golden outputs, greedy codes, node placement, synthesis
    of ``cases_dir``; lines prefixed with the EP name), then
    :func:`~higgs_pack.runtime.verification.backend_checks.compare_providers` against the CPU
    provider on the same inputs.  Without the provider: one skipped line naming the missing
    hardware from the provider row, e.g. "no CUDA GPU: CUDAExecutionProvider not available".

    Args:
        bundle: an opened ONNX Runtime bundle (its files already checked).
        report: where the lines go.
        ep: provider to check; default the bundle's own.
        cases_dir: ``shared/cases``, synthesized on the provider when given.
        require: report a missing or unusable provider as a failure, not a skip (for a
            machine known to have the hardware).
        reference: the bundle already loaded on the CPU provider (:func:`verify_bundle`'s
            first pass); loaded here when None.
    """
    ep = ep or bundle.manifest["execution_provider"]
    row = EXECUTION_PROVIDERS[ep]
    missing = False if require else None
    available = import_ort().get_available_providers()
    if row.ort_provider not in available:
        report.add(f"{ep} runtime", missing, f"{row.hardware.missing if row.hardware else ep}: {row.ort_provider} not available "
                   f"(installed providers: {', '.join(available)}; distributions: "
                   f"{', '.join(installed_ort_distributions()) or 'none'}). Where the hardware exists: "
                   f"pip install '{row.packaging.requirement}', then nox -s verify-{bundle.manifest['target']}")
        return
    try:
        target = load_pipeline(bundle, execution_provider=ep, check_hashes=False)
    except HiggsPackError as exc:
        report.add(f"{ep} runtime", missing, f"{row.ort_provider} is installed but unusable here "
                   f"({row.hardware.missing if row.hardware else ep}, or its libraries are missing?): {exc}")
        return
    elsewhere = {p: d for p, d in target.description.items() if d.split(" (")[0] != row.ort_provider}
    report.add(f"{ep} sessions", not elsewhere, f"every sub-part's session is on {row.ort_provider}" if not elsewhere
               else f"not on {row.ort_provider}: {', '.join(f'{p} on {d}' for p, d in elsewhere.items())}")
    on_gpu = VerifyReport(bundle=report.bundle)
    check_loaded(bundle, target, VerifyOptions(execution_provider=ep, cases_dir=cases_dir), on_gpu)
    for check in on_gpu.checks:
        report.add(f"{ep}: {check.name}", check.ok, check.detail, check.value, informational=check.informational)
    note = ""
    if reference is None:
        try:
            reference = load_pipeline(bundle, execution_provider=CPU_PROVIDER.name, check_hashes=False)
        except HiggsPackError as exc:
            note = f"the CPU provider cannot open the bundle: {exc}"
    compare_providers(bundle, target, reference, report, label=ep, reference_note=note)


def exact_greedy(manifest: dict[str, Any]) -> bool:
    """Whether greedy codes must equal the oracle's: fp32 weights and a float KV cache (a
    quantized KV cache, like quantized weights, may flip a near-tie argmax; its own parity
    and the decoder's are judged instead)."""
    return manifest["precision"] == "fp32" and manifest.get("kv_cache") in (None, "float")


def _check_greedy(pipeline: Pipeline, bundle: Bundle, golden: dict[str, np.ndarray], report: VerifyReport) -> None:
    expected = golden["greedy/delayed"]
    if not len(expected):
        report.add("greedy codes", None, "skipped: no greedy codes captured for this model size and "
                   "precision (per-sub-part export errors above judge it)")
        return
    exact_needed = exact_greedy(bundle.manifest)
    if not exact_needed:  # informational: a short run says enough
        expected = expected[:INFORMATIONAL_GREEDY_FRAMES]
    text = bundle.manifest["reference"]["cases"][0]
    result = generate_codes(
        pipeline, build_prompt(pipeline, text), SamplingOptions(temperature=0.0, repeat_guard_frames=0),
        max_frames=expected.shape[0] - pipeline.constants.num_codebooks + 1,
    )
    got = result.delayed
    n = min(len(got), len(expected))
    same = int(np.argmin(np.r_[(got[:n] == expected[:n]).all(axis=1), False]))
    report.greedy = {"identical": same, "steps": len(expected), "needed": MIN_GREEDY_FRAMES if exact_needed else None}
    if exact_needed:
        ok = same == len(expected) and len(expected) >= MIN_GREEDY_FRAMES
        report.add("greedy codes", ok, f"{same}/{len(expected)} steps identical to the PyTorch reference "
                   f"(fp32 needs all, and at least {MIN_GREEDY_FRAMES})", same)
    else:
        kv = bundle.manifest.get("kv_cache")
        at = bundle.manifest["precision"] + (f", KV cache {kv}" if kv not in (None, "float") else "")
        report.add("greedy codes", None, f"not judged at {at}: {same}/{len(expected)} steps identical to the "
                   "PyTorch reference (quantized weights or KV cache may flip a near-tie argmax, after which "
                   "the codes part ways; the sub-part parity checks judge this bundle)", same, informational=True)


#: The files of a cases folder (``shared/cases``) that verification synthesizes.
CASE_FILES = ("text_en_basic.txt", "text_zh.txt", "ref_en_16k.wav", "ref_en_16k.txt")


def require_cases(cases: Path) -> None:
    """Refuse a cases folder that holds none of :data:`CASE_FILES` (a wrong folder would
    otherwise pass with every case "not found"); one missing case is skipped, naming it.

    Raises:
        InputError: ``cases`` is not a folder, or holds no case file.
    """
    cases = Path(cases)
    if not cases.is_dir():
        raise InputError.of(Problem.said(f"--cases {cases}: no such folder; give the project's shared/cases folder"))
    if not any((cases / name).is_file() for name in CASE_FILES):
        raise InputError.of(Problem.said(f"--cases {cases} holds no verification cases (none of {', '.join(CASE_FILES)}); "
                                         "give the folder that holds them (the project's shared/cases), or leave --cases out"))


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
        report.audio[name] = {"samples": out.samples, "sample_rate": out.sample_rate, "text": text,
                              "ref_text": ref_text}
        expected_len = sum(len(r.codes) for r in out.chunks) * c.hop_length
        ok = (out.samples.size > 0 and bool(np.isfinite(out.samples).all())
              and out.samples.size == expected_len)
        stops = ",".join(r.stop_reason for r in out.chunks)
        report.add(f"synthesize {name}", ok,
                   f"{out.seconds_of_audio:.2f} s audio, {len(out.codes)} frames, stop {stops}, "
                   f"peak {float(np.abs(out.samples).max()) if out.samples.size else 0:.3f}, "
                   f"RTF {seconds / max(out.seconds_of_audio, 1e-9):.3f}")


def verify_any(target: str | Path, options: VerifyOptions | None = None, **kwargs: Any) -> VerifyReport:
    """:func:`verify_bundle` of a bundle directory, an installed bundle name, or a bundle archive.

    Archives (``.tar.gz``, ``.zip``) are checked member by member and extracted
    into a temporary directory (never the working directory) before the bundle
    checks; see :mod:`higgs_pack.runtime.sources.archive`.
    """
    path = Path(target)
    if path.is_file():
        from higgs_pack.runtime.sources.archive import extracted_archive

        with extracted_archive(path) as bundle_dir:
            return verify_bundle(bundle_dir, options, **kwargs)
    return verify_bundle(target, options, **kwargs)

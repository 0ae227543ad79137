"""Checks that only some backends or providers need; :mod:`higgs_pack.runtime.verification.verify` registers them.

OpenVINO: the decoder's state, static-shape promises (NPU variant), the paged engine's
decoder, GPU and NPU devices where present.  ONNX Runtime: node placement on a non-CPU provider, and
the comparison of a GPU provider's outputs with the CPU provider's
(:func:`compare_providers`).  This module never imports :mod:`~higgs_pack.runtime.verification.verify`.
"""

from __future__ import annotations

import numpy as np

from higgs_pack.errors import HiggsPackError, last_line
from higgs_pack.manifests.model import SubPart
from higgs_pack.manifests.providers import CPU_PROVIDER, EXECUTION_PROVIDERS
from higgs_pack.runtime.backends.onnxruntime.failures import provider_cannot_run
from higgs_pack.runtime.loop.pipeline import Pipeline
from higgs_pack.runtime.sources.bundle import Bundle, load_pipeline
from higgs_pack.runtime.verification.report import (
    VerifyReport,
    errors_against,
    judge_parity,
    judge_subpart,
    output_errors,
    read_golden,
)


def check_decoder_state(bundle: Bundle, report: VerifyReport) -> None:
    """OpenVINO: the decoder IR keeps its KV cache as state exactly when the manifest says so."""
    from higgs_pack.runtime.backends.openvino.ir_checks import ir_state_variables

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
    from higgs_pack.runtime.backends.openvino.ir_checks import static_shape_problems

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
        other = load_pipeline(bundle, device=device)
    except Exception as exc:  # HiggsPackError, or OpenVINO's RuntimeError while compiling
        report.add(name, False, f"on {device}: {type(exc).__name__}: {last_line(exc)}")
        return
    device_parity(device, bundle, other, report)


def device_parity(device: str, bundle: Bundle, other: Pipeline, report: VerifyReport) -> None:
    """Every sub-part of ``other`` (the bundle opened on ``device``) against the golden outputs.

    Judged by the rule of the CPU path (:func:`~higgs_pack.runtime.verification.report.judge_parity`:
    the export error's relative L2 and the cosine), one line per sub-part named
    ``"<device>: parity <sub-part>"``.
    """
    golden = read_golden(bundle)
    for part, spec in bundle.manifest["subparts"].items():
        try:
            errors, ok, detail = judge_subpart(other, golden, part, spec["parity"])
        except Exception as exc:  # HiggsPackError, or OpenVINO's RuntimeError while inferring
            report.add(f"{device}: parity {part}", False, f"on {device}: {type(exc).__name__}: {last_line(exc)}")
            continue
        report.add(f"{device}: parity {part}", ok, detail, errors["measured"])


def check_gpu(bundle: Bundle, pipeline: Pipeline, report: VerifyReport) -> None:
    """OpenVINO: parity on the Intel GPU (``GPU``), or skipped naming the missing device."""
    _check_on_device("GPU", bundle, pipeline, report)


def check_npu(bundle: Bundle, pipeline: Pipeline, report: VerifyReport) -> None:
    """OpenVINO: parity on the Intel NPU (``NPU``) for static bundles, or skipped with the reason."""
    _check_on_device("NPU", bundle, pipeline, report)


def check_paged_decoder(bundle: Bundle, pipeline: Pipeline, report: VerifyReport) -> None:
    """OpenVINO: the paged engine's decoder, what ``max_batch > 1`` runs
    (:mod:`higgs_pack.runtime.backends.openvino.paged`: the decoder IR turned to PagedAttention at
    load), on the golden prompt and step, with the KV cache the device compiles it with (u8 on
    the CPU, where its prompt's attention already reads the quantized K/V), judged by the
    decoder's own parity rule (:func:`~higgs_pack.runtime.verification.report.judge_parity`)
    against the oracle's stored references: issue 39 keeps the u8 cache the default only where
    this holds.  Skipped for a decoder that does not batch (the NPU variant's static one)."""
    from higgs_pack.runtime.backends import get_backend
    from higgs_pack.runtime.backends.openvino.runners import OvStatefulDecoder

    name = "paged decoder (max_batch > 1)"
    if not isinstance(pipeline.decoder, OvStatefulDecoder):
        report.add(name, None, "this bundle's decoder takes one row (the NPU variant's static one): no engine batches it")
        return
    golden = read_golden(bundle)
    try:
        paged = get_backend("openvino").batched_decoder(pipeline, 2, pipeline.decoder.max_length)
        first = paged.prefill(0, golden["llm_decoder/in/inputs_embeds"])
        step = paged.step(np.array([0]), golden["llm_decoder/in/step_embeds"])
    except Exception as exc:  # HiggsPackError, or OpenVINO's RuntimeError while compiling or inferring
        report.add(name, False, f"{type(exc).__name__}: {last_line(exc)}")
        return
    rule = bundle.manifest["subparts"][SubPart.LLM_DECODER]["parity"]
    errors = errors_against(golden, SubPart.LLM_DECODER, {"hidden_states": first, "step_hidden_states": step},
                            rule["metric"])
    ok, detail = judge_parity(rule, errors)
    report.add(name, ok, f"{paged.cache_types} KV cache in blocks of {paged.block_size}: {detail}", errors["measured"])


def check_node_placement(bundle: Bundle, pipeline: Pipeline, report: VerifyReport) -> None:
    """ONNX Runtime: on a provider other than CPU, which nodes it left on the CPU provider.

    Informational (the OpenVINO EP leaves ModelBuilder's GroupQueryAttention on the
    CPU EP): each sub-part is run once more with ORT profiling, and the profile says
    which provider ran each node.
    """
    from higgs_pack.runtime.backends.onnxruntime.placement import bundle_node_placement

    by_provider = {row.ort_provider: name for name, row in EXECUTION_PROVIDERS.items()}
    own = bundle.manifest.get("execution_provider")
    if own in EXECUTION_PROVIDERS:  # rows that share an ORT provider (dml, winml): name the bundle's own
        by_provider[EXECUTION_PROVIDERS[own].ort_provider] = own
    used = set(pipeline.description.values())
    cpu = CPU_PROVIDER.ort_provider
    eps = sorted({by_provider[u] for u in used if u in by_provider and u != cpu})
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
        report.add("node placement", None, f"not measured: {type(exc).__name__}: {last_line(exc)}")
        return
    on_cpu = {part: pl.on(cpu) for part, pl in placements.items()}
    taken = sum(len(pl.on(provider)) for pl in placements.values())
    left = sum(len(nodes) for nodes in on_cpu.values())
    if not left:
        report.add("node placement", True, f"{provider} ran every node ({taken} nodes or fused subgraphs)", 0)
        return
    parts = []
    for part, nodes in on_cpu.items():
        if nodes:
            ops = ", ".join(f"{op} x{n}" for op, n in sorted(placements[part].op_counts(cpu).items()))
            names = ", ".join(n for n, _ in nodes[:4]) + (" …" if len(nodes) > 4 else "")
            parts.append(f"{part}: {ops} ({names})")
    report.add("node placement", True, f"{left} nodes left on {cpu}, {taken} nodes or fused "
               f"subgraphs on {provider}: " + "; ".join(parts), left)


# ----------------------------------------------------------------------------- GPU providers (cuda, dml)

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
    difference is judged by the rule of the CPU path
    (:func:`~higgs_pack.runtime.verification.report.judge_parity`: cosine against the sub-part's
    threshold and relative L2 against its ``max_rel_l2``, the reference being the same weights).  A reference
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
                report.add(name, False, f"{type(exc).__name__}: {last_line(exc)}")
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
                    report.add(name, False, f"reference run failed: {type(exc).__name__}: {last_line(exc)}")
                    continue
                ref_blocked[part] = f"the reference provider cannot execute this graph: {why}"
                report.add(name, True, f"finite, not all zero (peak {float(np.abs(got).max()):.3g}); "
                           f"comparison skipped: {ref_blocked[part]}")
                continue
            errors = output_errors([(want, got)], "cosine")
            ok, detail = judge_parity(subparts[part]["parity"], errors)
            report.add(name, ok, detail, errors["measured"])

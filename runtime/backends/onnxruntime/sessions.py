"""ONNX Runtime backend: sessions on the execution provider a bundle names.

Never falls back silently: the provider asked for must be the one the session
uses (``session.get_providers()``), unless the caller passed
``allow_fallback=True``, and then the fallback is logged and recorded in the
pipeline description.  Which provider ran which node (what ``verify`` reports)
is read in :mod:`higgs_pack.runtime.backends.onnxruntime.placement`.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import numpy as np

from higgs_pack.errors import (
    ExecutionProviderUnavailable,
    unknown_choice,
)
from higgs_pack.manifests.providers import CPU_PROVIDER, EXECUTION_PROVIDERS
from higgs_pack.runtime.backends.onnxruntime.distributions import (
    import_ort,
    install_hint,
    installed_ort_distributions,
)
from higgs_pack.runtime.loop.pipeline import check_io_signature

log = logging.getLogger(__name__)

#: ONNX element type strings -> numpy dtypes.
ORT_TYPES = {
    "tensor(float)": np.float32,
    "tensor(float16)": np.float16,
    "tensor(double)": np.float64,
    "tensor(int64)": np.int64,
    "tensor(int32)": np.int32,
    "tensor(int8)": np.int8,
    "tensor(uint8)": np.uint8,
    "tensor(bool)": np.bool_,
}



#: Session options for running a float16 graph (a cuda/dml fp16 bundle) on the CPU provider.
#: The CPU provider has no float16 kernels for most of the decoder's ops, so it inserts Cast
#: nodes to float32 in front of them.  With graph optimizations on, constant folding turns
#: every cast weight into a float32 initializer: a second, twice-as-large copy of the model
#: held for the session's life (4B dims: 15.6 GB anonymous on top of 7.3 GB of float16).
#: With optimizations off the casts run per node, and the priority-based execution order
#: places each cast right before its consumer, so one layer's float32 weights exist at a
#: time (bench preset: peak 531 -> 321 MB, 17 -> 48 ms per decode step).  Measured on an
#: AMD EPYC, AVX2, ONNX Runtime 1.32; the default (topological) order runs every
#: initializer's cast first and keeps them all alive.
FLOAT16_ON_CPU_OPTIONS: dict[str, Any] = {
    "graph_optimization_level": "ORT_DISABLE_ALL",
    "execution_order": "PRIORITY_BASED",
}


#: Thread-pool settings every session gets unless the manifest sets them.  The decoder, heads
#: and embed sessions take turns every frame.  Workers spin between the operators of one run
#: (with spinning off, every parallel operator wakes a sleeping worker), and stop spinning
#: when the run ends, so they do not keep the cores from the next session.  Bench preset,
#: cpu int4, 100 frames, 3 interleaved rounds on an AMD EPYC with 2 vCPUs (AVX2), ONNX
#: Runtime 1.32: spinning off 125-147 frames/s (decoder step 5.7-6.8 ms); spinning that stops
#: with the run 165-204 (4.1-5.0 ms); spinning that continues after the run 108-131.  Full
#: size (4B), cpu int4, 40 frames, 3 interleaved rounds: 11.6-11.8 -> 12.3-12.4 frames/s
#: (decoder step 85.3-85.5 -> 79.4-79.9 ms), streamed 11.2 -> 12.0-12.1.
THREAD_POOL_DEFAULTS: dict[str, str] = {
    "session.intra_op.allow_spinning": "1",
    "session.force_spinning_stop": "1",
}

#: Thread-pool settings of the ``llm_decoder`` session over :data:`THREAD_POOL_DEFAULTS` (a
#: manifest entry still wins): its workers do not spin.  A prompt prefill runs each operator on
#: hundreds of rows; a worker spinning at the end of its share takes the core from the thread
#: still working (or from the codec's session, which the engine runs beside the decoder) as soon
#: as the machine has other work.  bench preset cpu int4 decoder (``b128_l4``, exported as a
#: build does), AMD EPYC 2 vCPUs (AVX-512 VNNI), ONNX Runtime 1.32, load average 5-10 from other
#: jobs, 6-12 interleaved rounds, four runs: prefill of 256 positions 1.28-1.65x and of 64
#: 1.21-2.43x faster without spinning; the decode step's median round 3.1-7.4 ms against
#: 6.9-11.5 (best rounds 2.9-3.9 against 2.8-7.5); one thread alone beat two spinning ones
#: (``python -m bench.ab gemm-peak``, docs/measurements.md).  Earlier, on a quieter machine,
#: spinning gained about 5% per decode step at full size (above).
DECODER_THREAD_POOL: dict[str, str] = {"session.intra_op.allow_spinning": "0"}



#: Execution providers whose fallback to the CPU this process has already said.
_FALLBACKS_SAID: set[str] = set()

def stream_codec_thread_pool() -> dict[str, Any]:
    """Session options of the ``audio_tokenizer_stream`` session on the CPU provider (a manifest
    entry still wins): ``intra_op_num_threads`` = half the logical CPUs this process may run on
    (``os.sched_getaffinity``, else ``os.cpu_count()``), at least 1.

    The streaming codec runs only beside the decoder: the engine's codec thread steps it while
    the engine thread steps the decoder, and with ONNX Runtime's default (one worker per core)
    each run put a worker on every core the decoder's step was using.  Bench preset cpu int4
    (real codec dims), 100 frames, AMD EPYC 2 vCPUs, ONNX Runtime 1.32, load average 3-8 from
    other jobs, four runs of 3 interleaved rounds each (medians of per-round ratios): audio
    delivered per wall second, codec included (``bench.decoder.batch``'s ``delivered_frames_per_s``),
    streamed over plain 0.68-0.77x -> 0.95-1.27x at batch 1 and 0.73-0.83x -> 0.92-1.32x at
    batch 4; the engine's aggregate rate while streaming over plain's 0.20-0.50x -> 0.26-0.60x
    (batch 1), 0.20-0.31x -> 0.39-0.59x (batch 4); the slowest stream's first audio no later
    (batch 4: 710-1253 ms -> 515-1285 ms).  The codec alone at load 2: 6.8 -> 4.0 ms per frame
    (4 rows of 20 frames, 2 workers -> 1).  The one-shot ``audio_tokenizer`` keeps the default:
    it also decodes a whole utterance with nothing beside it, where every core helps.
    OpenVINO's streaming codec keeps its CPU plugin's default: the same cap
    (``INFERENCE_NUM_THREADS`` 1) measured worse there, full-size openvino int4 on a quiet machine
    (load 1.8-2.1), one run each way: streamed over plain 0.74x / 0.66x at batch 4 / 8 against
    0.83x / 0.76x uncapped (delivered, codec included: 0.85x / 0.80x against 0.96x / 0.93x).
    """
    import os

    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return {"intra_op_num_threads": max(1, cpus // 2)}



#: Device names of OpenVINO (and of people asking for a kind of hardware) that are not
#: ONNX Runtime provider names.
_DEVICE_WORDS = ("gpu", "npu", "igpu", "dgpu", "auto")


def unknown_provider(ep: str, fix: str) -> str:
    """The message for an execution provider name that is not one (:data:`EXECUTION_PROVIDERS`).

    A device word (``GPU``, ``NPU``, ``AUTO``: OpenVINO's device names) gets the providers
    that run on that hardware, not the closest spelling (``gpu`` is not a typo of ``cpu``).

    Args:
        ep: the name asked for (lower case).
        fix: the keyword or flag that sets it.
    """
    if ep.split(":", 1)[0] not in _DEVICE_WORDS and not ep.startswith("hetero"):
        return unknown_choice("execution provider", ep, EXECUTION_PROVIDERS, fix)
    gpus = [f"{row.name} ({row.hardware.short})" for row in EXECUTION_PROVIDERS.values()
            if row.hardware is not None and "GPU" in row.hardware.short]
    return (f"{ep!r} is an OpenVINO device name, not an ONNX Runtime execution provider: for a GPU name its "
            f"provider, {' or '.join(gpus)} (a bundle built for it: `higgs-pack build --target cuda`, or dml on "
            "Windows); NPUs and OpenVINO's devices run openvino bundles (`higgs-pack build --target openvino`). "
            f"Execution providers: {', '.join(sorted(EXECUTION_PROVIDERS))}; set it with {fix}.")


def session_options_for(ep: str, options: dict[str, Any]):
    """Build ``SessionOptions`` for a provider.

    The provider row's ``session_rules`` (DirectML: memory patterns off, sequential
    execution) are forced over whatever the manifest says.

    Args:
        ep: bundle EP name.
        options: manifest ``session_options`` (``intra_op_num_threads``, ``graph_optimization_level``,
            ``execution_order``, ``log_severity_level``, ``session.*`` config entries; enums by
            member name).  :data:`THREAD_POOL_DEFAULTS` fill the config entries it leaves out.
    """
    ort = import_ort()
    so = ort.SessionOptions()
    for key, value in options.items():
        if key == "graph_optimization_level":
            so.graph_optimization_level = getattr(ort.GraphOptimizationLevel, value)
        elif key == "execution_order":
            so.execution_order = getattr(ort.ExecutionOrder, value)
        elif key.startswith("session."):
            so.add_session_config_entry(key, str(value))
        else:
            setattr(so, key, value)
    for key, value in THREAD_POOL_DEFAULTS.items():
        if key not in options:
            so.add_session_config_entry(key, value)
    row = EXECUTION_PROVIDERS.get(ep)
    for key, value in (row.sessions.rules if row is not None else {}).items():
        setattr(so, key, getattr(ort.ExecutionMode, value) if key == "execution_mode" else value)
    return so


#: Session option that keeps the CPU provider from copying weights into packed buffers:
#: float MatMuls then read their weights in place from the memory-mapped external data
#: (512 MB of fp32 MatMul weights: 549 MB anonymous after load with prepacking, 25 MB
#: without; measured here, ONNX Runtime 1.32).
NO_PREPACKING = {"session.disable_prepacking": "1"}


def create_session(path: Path, ep: str, *, provider_options: dict[str, Any] | None = None,
                   session_options: dict[str, Any] | None = None,
                   allow_fallback: bool = False, float16_weights: bool = False,
                   prepacking: bool = True) -> tuple[Any, str]:
    """Create an InferenceSession on ``ep`` and prove it took the session.

    Args:
        path: the ``.onnx`` file (external data beside it).
        ep: bundle EP name: ``cpu``, ``cuda``, ``dml`` or ``openvino``.
        provider_options: options for that provider.
        session_options: see :func:`session_options_for`.
        allow_fallback: permit running on the CPU provider when ``ep`` is not
            available; the returned description then says so.
        float16_weights: the graph stores float16 weights (an fp16 bundle); when the
            session lands on the CPU provider, asked for or fallen back to, it gets
            :data:`FLOAT16_ON_CPU_OPTIONS` over ``session_options``.
        prepacking: False adds :data:`NO_PREPACKING`: weights stay in the mapped file
            (for :class:`OrtDecoder`'s ``page_out_weights``).

    Returns:
        ``(session, description)``, e.g. ``("…", "CUDAExecutionProvider")`` or
        ``"CPUExecutionProvider (fallback from CUDAExecutionProvider)"``.

    Raises:
        ExecutionProviderUnavailable: unknown EP, provider not installed, or the
            session silently landed on another provider.
    """
    ort = import_ort()
    if ep not in EXECUTION_PROVIDERS:
        raise ExecutionProviderUnavailable(
            unknown_provider(ep, "--execution-provider / execution_provider=")
        )
    row = EXECUTION_PROVIDERS[ep]
    available = ort.get_available_providers()
    wanted = row.ort_provider
    providers: list[Any] = [(wanted, provider_options or {})]
    note = wanted
    if wanted not in available:
        if not allow_fallback or row is CPU_PROVIDER:
            raise ExecutionProviderUnavailable(
                f"{wanted} was asked for but is not available here (installed providers: "
                f"{', '.join(available)}; distributions: {', '.join(installed_ort_distributions()) or 'none'}). "
                f"{install_hint(row)}, or run on the CPU explicitly with --execution-provider {CPU_PROVIDER.name} "
                f"(execution_provider={CPU_PROVIDER.name!r})"
            )
        cpu = CPU_PROVIDER.ort_provider
        if wanted not in _FALLBACKS_SAID:  # once, not once per sub-part's session
            _FALLBACKS_SAID.add(wanted)
            log.warning("%s is not available; falling back to %s as asked", wanted, cpu)
        providers = [cpu]
        wanted = cpu
        note = f"{cpu} (fallback from {row.ort_provider})"
    elif row is not CPU_PROVIDER:
        providers.append(CPU_PROVIDER.ort_provider)
    options = dict(session_options or {})
    if float16_weights and wanted == CPU_PROVIDER.ort_provider:
        options.update(FLOAT16_ON_CPU_OPTIONS)
    if not prepacking:
        options.update(NO_PREPACKING)
    so = session_options_for(ep, options)
    session = ort.InferenceSession(str(path), sess_options=so, providers=providers)
    used = session.get_providers()
    if not used or used[0] != wanted:
        raise ExecutionProviderUnavailable(
            f"{path.name}: asked for {wanted} but ONNX Runtime created the session on "
            f"{', '.join(used)} (its library failed to load?). Installed providers: {', '.join(available)}"
        )
    return session, note


def check_signature(session, subpart: str, spec: dict[str, Any]) -> None:
    """Compare a session's inputs/outputs with the manifest's I/O signature.

    Names, element types and ranks must match (symbolic dims may differ in name).

    Raises:
        SignatureMismatch: naming the sub-part, the tensor and both signatures.
    """
    def sig(items):
        return {i.name: (str(np.dtype(ORT_TYPES.get(i.type, np.void))), len(i.shape)) for i in items}

    check_io_signature(subpart, "graph", sig(session.get_inputs()), sig(session.get_outputs()), spec)

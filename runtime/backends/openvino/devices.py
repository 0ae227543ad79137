"""OpenVINO devices: the device string normalised once (:func:`normalize_device`), checked
against ``Core.available_devices`` (:func:`check_device`; a missing device is an error
unless the caller passed ``allow_fallback=True``, and then the fallback to CPU is logged),
the device a sub-part is compiled for (:func:`subpart_device`), and the compile
properties per device and precision (:func:`precision_config`,
:func:`decoder_compile_properties`).
"""

from __future__ import annotations

import importlib.metadata
import logging
import re
from collections.abc import Mapping
from typing import Any

import openvino as ov

from higgs_pack.errors import (
    ExecutionProviderUnavailable,
)

log = logging.getLogger(__name__)

#: Single OpenVINO devices a bundle may name (optionally with an index: ``GPU.1``).
PLAIN_DEVICES: tuple[str, ...] = ("CPU", "GPU", "NPU")

#: Virtual devices that take a list of devices after a colon (``AUTO`` alone is allowed).
META_DEVICES: tuple[str, ...] = ("AUTO", "HETERO", "MULTI")


_PLAIN_RE = re.compile(r"^(CPU|GPU|NPU)(\.\d+)?$")
_DEVICE_FIX = "--device / device="
_ALLOWED_FORMS = "CPU, GPU, GPU.<n>, NPU, AUTO, AUTO:<devices>, HETERO:<devices>, MULTI:<devices>"


def runtime_versions() -> dict[str, str]:
    """Versions of the runtime packages this backend uses.

    Returns:
        ``{"openvino": "2026.4.1"}`` (the distribution's version; the build string
        ``openvino.__version__`` if the distribution metadata is missing).
    """
    try:
        return {"openvino": importlib.metadata.version("openvino")}
    except importlib.metadata.PackageNotFoundError:
        return {"openvino": ov.__version__}


def normalize_device(device: str) -> str:
    """Upper-case and validate an OpenVINO device string.

    Accepted forms: ``CPU``, ``GPU``, ``GPU.<n>``, ``NPU``, ``AUTO``, and
    ``AUTO:`` / ``HETERO:`` / ``MULTI:`` followed by a comma-separated list of
    single devices (``"auto:gpu,cpu"`` -> ``"AUTO:GPU,CPU"``). Spaces are removed.

    Args:
        device: The device string from the user or the manifest.

    Returns:
        The normalised string.

    Raises:
        ExecutionProviderUnavailable: The string is not one of the accepted forms
            (the message lists them and the ``--device`` flag / ``device=`` keyword).
    """
    text = re.sub(r"\s+", "", str(device)).upper()
    base, sep, rest = text.partition(":")
    ok = False
    if not sep:
        ok = bool(_PLAIN_RE.fullmatch(text)) or text == "AUTO"
    elif base in META_DEVICES and rest:
        ok = all(_PLAIN_RE.fullmatch(part) for part in rest.split(","))
    if not ok:
        raise ExecutionProviderUnavailable(
            f"unknown OpenVINO device {device!r}; allowed forms: {_ALLOWED_FORMS}. "
            f"Set it with {_DEVICE_FIX}."
        )
    return text


def _present(name: str, available: list[str]) -> bool:
    """Whether one single device (``GPU``, ``GPU.1``) is among ``available``."""
    if name in available:
        return True
    base, _, index = name.partition(".")
    if not index:  # "GPU" while OpenVINO lists "GPU.0", "GPU.1"
        return any(a.startswith(base + ".") for a in available)
    return index == "0" and base in available  # "GPU.0" while OpenVINO lists one "GPU"


def check_device(core: ov.Core, device: str, allow_fallback: bool = False) -> tuple[str, str]:
    """Check that a device is usable here, before anything is compiled.

    A single device must be in ``core.available_devices``; ``HETERO:`` and
    ``MULTI:`` need every listed device; ``AUTO:`` needs at least one (choosing
    among them is what AUTO is asked to do); bare ``AUTO`` needs any device.

    Args:
        core: The ``openvino.Core``.
        device: The requested device (normalised here).
        allow_fallback: Run on ``CPU`` when the device is missing, with a warning,
            instead of raising.

    Returns:
        ``(device, description)``: the device to compile for and a description,
        ``"CPU"`` or ``"CPU (fallback from GPU)"``.

    Raises:
        ExecutionProviderUnavailable: The string is invalid, or the device is not
            available and ``allow_fallback`` is false (the message names the
            devices present and the ``--device`` flag / ``device=`` keyword).
    """
    available = list(core.available_devices)
    try:
        device = normalize_device(device)
    except ExecutionProviderUnavailable as exc:
        raise ExecutionProviderUnavailable(f"{exc} Devices present here: {', '.join(available) or 'none'}") from None
    base, _, rest = device.partition(":")
    if base in META_DEVICES:
        listed = rest.split(",") if rest else []
        missing = [d for d in listed if not _present(d, available)]
        ok = bool(available) and (len(missing) < len(listed) if base == "AUTO" and listed else not missing)
    else:
        missing = [device]
        ok = _present(device, available)
    if ok:
        return device, device
    if allow_fallback and "CPU" in available:
        log.warning("OpenVINO device %s is not available (present: %s); falling back to CPU as asked",
                    device, ", ".join(available))
        return "CPU", f"CPU (fallback from {device})"
    raise ExecutionProviderUnavailable(
        f"OpenVINO device {device} is not available here ({', '.join(missing)} missing); devices present: "
        f"{', '.join(available) or 'none'}. Choose one of them with {_DEVICE_FIX} (for example "
        f"--device {available[0] if available else 'CPU'}), or pass --allow-fallback (allow_fallback=True) "
        "to run on CPU"
    )


#: Bundle precisions the CPU plugin is told to compute in f32 (``INFERENCE_PRECISION_HINT``)
#: instead of its default, which is bf16 on CPUs with native bf16 (read back from the compiled
#: model: bf16 on an Intel Xeon with AMX and AVX-512 BF16, OpenVINO 2026.4; f32 on an AVX2
#: AMD EPYC, where the hint changes nothing).  int4 weights are decompressed or their
#: activations quantized to int8 per group either way; a one-position decode step is bound by
#: the weights read, and the bf16 conversions around every operator only add time.  Measured
#: on that Xeon (2 vCPUs), int4 INT4_SYM g64 decoder, best / median ms per step, interleaved:
#: bench preset (``python -m bench.ab ov-properties``, 15 rounds of 8 steps)
#: f32 5.19 / 6.70 vs bf16 8.67 / 9.91 at 64 positions, 9.31 / 10.67 vs 10.86 / 12.38 at
#: 768, the same rel_l2 against the fp32 IR (0.126 / 0.125); full size, 6 rounds of 4 steps:
#: 162.6 / 170.5 vs 194.7 / 206.2 ms at 64 positions, 162.9 / 171.2 vs 192.9 / 212.9 at 900,
#: bf16's hidden states 0.057-0.067 rel_l2 away from f32's; full-size audio heads 0.80 vs 1.10
#: ms (median).  A prefill is faster in bf16 (AMX tiles): 64 positions 1.22-1.53 vs
#: 1.06-1.09 s, 300 positions 6.3-6.8 vs 5.2-5.8 s; a 20 s utterance is ~75 prompt positions
#: and ~500 steps, so f32 wins by far, first audio included.  int8/fp16 bundles are not measured
#: and keep the plugin's default.
CPU_F32_PRECISIONS = frozenset({"int4"})


def thread_config(device: str) -> dict[str, Any]:
    """Compile properties for how a sub-part's inference threads run: on the CPU,
    ``ENABLE_CPU_PINNING`` off.

    With pinning on (the CPU plugin's default on Linux for the LATENCY hint) the plugin pins its
    worker threads to cores, but not the thread that calls ``infer``: the engine's thread, new with
    each engine. Where the kernel put that thread on a pinned worker's core, every step ran 1.8x
    slower for the engine's whole life. Measured at full size (openvino int4 paged decoder, 3 rows,
    8 fresh engines in one process, Intel Xeon, 2 vCPUs, AVX-512 VNNI, no AMX, OpenVINO 2026.4.1):
    step medians 138, 254, 139, 254, 138, 138, 257 and 141 ms pinned; 138-142 ms for all 8 unpinned.
    ``synthesize`` on the main thread ran at 139-141 ms a frame pinned and 137-142 unpinned (3
    processes each).  A manifest's ``compile_properties`` or ``provider_options`` may set it back.

    Args:
        device: The (normalised) device the model is compiled for.

    Returns:
        A properties dict to merge into ``compile_model``'s config (empty off the CPU).
    """
    return {"ENABLE_CPU_PINNING": False} if device_base(device) == "CPU" else {}


def precision_config(device: str, precision: str, *, stateful: bool = False) -> dict[str, str]:
    """Compile properties that keep a sub-part of ``precision`` in the arithmetic it was built for.

    OpenVINO's CPU plugin computes in bf16 on CPUs with native bf16 (AMX/AVX512-BF16) and
    keeps the KV cache in u8 by default; its GPU plugin computes in f16. For
    ``precision == "fp32"`` this returns ``INFERENCE_PRECISION_HINT=f32`` on CPU
    and GPU, and ``KV_CACHE_PRECISION=f32`` on CPU for a stateful decoder; for the
    precisions in :data:`CPU_F32_PRECISIONS` (int4), ``INFERENCE_PRECISION_HINT=f32`` on
    CPU (measured faster per decode step there). Other precisions and devices (NPU, AUTO,
    ...) get no override.

    Args:
        device: The (normalised) device the model is compiled for.
        precision: The sub-part's precision in the manifest.
        stateful: Whether the model is the stateful decoder.

    Returns:
        A properties dict to merge into ``compile_model``'s config.
    """
    base = device.split(".")[0]
    if base == "CPU" and precision in CPU_F32_PRECISIONS:
        return {"INFERENCE_PRECISION_HINT": "f32"}
    if precision != "fp32" or base not in ("CPU", "GPU"):
        return {}
    config = {"INFERENCE_PRECISION_HINT": "f32"}
    if stateful and base == "CPU":
        config["KV_CACHE_PRECISION"] = "f32"
    return config


#: Decoder precisions whose weights OpenVINO's CPU plugin copies into its own packed
#: buffers on the first inference (int4 it reads in place from the mapped ``.bin``).
#: Measured at full size (OpenVINO 2026.4, AMD EPYC AVX2): the fp16 decoder (6.9 GB
#: ``.bin``) ends its first inference with 7.0 GB anonymous + 7.0 GB of mapped file; the
#: int8 one verified at 5.0 GB anonymous for 4.0 GB of weights; the int4 one compiles and
#: runs with 0.5 GB anonymous.  fp32 weights are packed by the same kernels.
CPU_PACKED_PRECISIONS = frozenset({"int8", "fp16", "fp32"})


def cpu_packs_weights(device: str, precision: str) -> bool:
    """Whether the CPU plugin copies this decoder's weights into packed buffers.

    For such a decoder the runtime compiles without the model cache and pages the IR's
    mapping out during the first inference (``OvStatefulDecoder(page_out_weights=True)``):
    importing the cached blob of the full-size fp16 decoder peaked at 14.7 GB anonymous
    (the blob read into memory, then packed again) against 7.0 GB compiling from the IR,
    and took as long (0.2 s import + 16.6 s first inference vs 2.8 s + 15.7 s).

    Args:
        device: The (normalised) device the decoder is compiled for.
        precision: The decoder's precision in the manifest.
    """
    return device_base(device) == "CPU" and precision in CPU_PACKED_PRECISIONS


#: KV cache element type the CPU plugin keeps for a stateful decoder, per bundle precision.
#: u8 (the plugin's x86 default, made explicit): a quarter of f32's bytes read per step, what
#: matters once the cache is long (full size, Intel AVX-512 VNNI: 0.97 of the weight-read
#: roofline with u8, MODEL.md).  Measured on an AMD EPYC, AVX2 only, no VNNI (bench preset,
#: int4 decoder, ``python -m bench.ab ov-properties``, 15 interleaved rounds
#: of 8 steps, load 4.5-6 on 2 cores; best / median ms per step): u8 19.7 / 24.1, f16
#: 18.5 / 23.5, f32 20.1 / 25.7 at 64 positions; u8 22.5 / 26.5, f16 22.0 / 25.3, f32
#: 23.5 / 29.9 at 768 positions; the same hidden states to 4 digits.  The bench cache (6 MB
#: in u8 at 768 positions) is too small there to separate them, so the default stays u8,
#: the choice for long caches.  On an Intel Xeon with VNNI and AMX (bf16 inference) the
#: bench cache, in a 300 MiB L3, showed no byte saving either: u8 / f16 / f32 8.67 / 8.86 /
#: 8.70 at 64 positions and 10.86 / 9.83 / 9.82 (medians 12.38 / 11.74 / 11.54) at 768;
#: at full size u8 reads 5.6 MB a step where f32 would read 22.3 (~75 positions).
#: u4 and key u8 / value u4 (``python -m bench.ab ov-properties --settings
#: default,kv_u4,kv_key_u8_value_u4,kv_f16,kv_f32 --contexts 64 900``, bench preset, AMD EPYC
#: AVX-512 VNNI, 32 MiB L3, OpenVINO 2026.4.1, 15 rounds, load 1.9-2.5; best / median ms, then
#: rel_l2 against the same IR with an f32 cache): at 64 positions u8 4.18 / 6.22 0.0101, u4
#: 3.63 / 6.08 0.0312, key u8 value u4 3.54 / 6.21 0.0237, f16 3.74 / 6.17 0.0097, f32 3.87 /
#: 6.06; at 900 u8 5.14 / 6.28 0.0102, u4 4.96 / 5.78 0.0143, key u8 value u4 4.74 / 5.70
#: 0.0129, f16 5.35 / 5.87 0.0094, f32 6.17 / 6.81.  No setting is faster beyond this machine's
#: noise at bench size, and u4 triples u8's distance from f32 at 64 positions: u8 stays.
KV_CACHE_PRECISION = {"int4": "u8", "int8": "u8", "fp16": "f16", "fp32": "f32"}


def decoder_compile_properties(precision: str, *, stateful: bool) -> dict[str, dict[str, str]]:
    """Compile properties recorded in the decoder's manifest options (``compile_properties``),
    per device; :func:`~higgs_pack.runtime.backends.openvino.parts.open_openvino_parts` applies the
    entry of the device it compiles for.

    * every device: ``PERFORMANCE_HINT=LATENCY``: one request at a time (speech is one
      sequential decode), all cores on it, whatever a future OpenVINO's default is.
      Measured on the CPU (AMD EPYC, AVX2, bench preset, as :data:`KV_CACHE_PRECISION`):
      THROUGHPUT 20.0 / 28.4 ms vs LATENCY 19.7 / 24.1 ms per step at 64 positions,
      25.8 / 35.1 vs 22.5 / 26.5 at 768 (best / median): never faster; on an AMX Xeon
      THROUGHPUT 13.14 vs LATENCY 8.67 best at 64 positions;
    * CPU, stateful decoder: ``KV_CACHE_PRECISION`` from :data:`KV_CACHE_PRECISION`
      (the static npu decoder keeps its KV in buffers the runtime owns: nothing to set).

    ``share_inputs``/``share_outputs`` are not compile properties: the runners always pass
    them to ``infer`` (off measured 17.7 / 23.9 and 21.6 / 27.2 ms, the same within noise:
    the bench decoder's copies are 4 KB a step; on, they avoid the copies at any size).

    Args:
        precision: the decoder's precision.
        stateful: whether the IR keeps its KV cache as state.
    """
    cpu = {"PERFORMANCE_HINT": "LATENCY"}
    if stateful:
        cpu["KV_CACHE_PRECISION"] = KV_CACHE_PRECISION[precision]
    return {"CPU": cpu, "GPU": {"PERFORMANCE_HINT": "LATENCY"}, "NPU": {"PERFORMANCE_HINT": "LATENCY"}}


def device_base(device: str) -> str:
    """``GPU.1`` -> ``GPU``; ``HETERO:GPU,CPU`` -> ``HETERO``."""
    return device.split(":")[0].split(".")[0]


def subpart_device(device: str, options: Mapping[str, Any]) -> str:
    """The device one sub-part is compiled for: the bundle's, unless the sub-part's
    manifest options pin another for it (``device_overrides``: ``{"NPU": "CPU"}`` keeps
    the dynamic codec encoder of an NPU bundle on the CPU)."""
    overrides = options.get("device_overrides") or {}
    return normalize_device(overrides.get(device_base(device), device))

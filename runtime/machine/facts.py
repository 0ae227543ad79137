"""What the choice of a bundle speaks in: what this machine offers (:class:`Inventory`), a
visible bundle (:class:`Candidate`) and a bundle placed on a provider or device
(:class:`Placement`).

Data only, importing nothing of the runtime: a backend's interface names these types and
the choice (:mod:`higgs_pack.runtime.machine.choice`) calls the backends, so the types live
where both can import them without a circle.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Inventory:
    """What this machine offers (see :func:`higgs_pack.runtime.machine.inventory.inventory`).

    Attributes:
        ort_providers: bundle EP name (``cpu``, ``cuda``, ``dml``, ``openvino``) -> None
            when ONNX Runtime created a session on it here, else the reason it did not
            (only providers the installed onnxruntime lists; absent = not installed).
        ort_distributions: installed onnxruntime distributions.
        openvino: installed OpenVINO version, or None when it is not installed.
        openvino_devices: OpenVINO device (``CPU``, ``GPU.0``, ``NPU``) -> FULL_DEVICE_NAME.
        hardware: physical devices seen outside any runtime: kind (``nvidia-gpu``,
            ``intel-gpu``, ``intel-npu``) -> list of descriptions.
        npu_driver: Intel NPU kernel driver loaded (``/dev/accel`` node present), None if unknown.
        platform: ``sys.platform``.
        cpu: CPU model name.
        cpu_vendor: ``intel``, ``amd``, ``arm`` or ``other``.
    """

    ort_providers: Mapping[str, str | None] = field(default_factory=dict)
    ort_distributions: tuple[str, ...] = ()
    openvino: str | None = None
    openvino_devices: Mapping[str, str] = field(default_factory=dict)
    hardware: Mapping[str, list[str]] = field(default_factory=dict)
    npu_driver: bool | None = None
    platform: str = "linux"
    cpu: str = ""
    cpu_vendor: str = "other"

    def ort_ok(self, ep: str) -> bool:
        return ep in self.ort_providers and self.ort_providers[ep] is None

    def ov_has(self, base: str) -> str | None:
        """The first OpenVINO device of a kind (``GPU`` matches ``GPU.0``), or None."""
        return next((d for d in self.openvino_devices if d == base or d.startswith(base + ".")), None)


@dataclass(frozen=True)
class Candidate:
    """One visible bundle, as its manifest describes it.

    Attributes:
        name: bundle name.
        source: where it was found (a directory; for hub repos the snapshot folder).
        model: model slug.
        target, precision, variant, backend: from the manifest.
        built_for: the manifest's execution provider (ONNX Runtime) or device (OpenVINO).
        requirements: the manifest's runtime requirements.
        origin: how it was found (``installed``, ``--bundles``, ``hub ORG/REPO@rev``).
        damaged: why its files do not match its manifest (a missing file or a wrong size,
            checked with ``stat`` only; hashes are checked at load), or None.
    """

    name: str
    source: str
    model: str
    target: str
    precision: str
    variant: str | None
    backend: str
    built_for: str
    requirements: tuple[str, ...] = ()
    origin: str = ""
    damaged: str | None = None


@dataclass(frozen=True)
class Placement:
    """A candidate that can run here, on one provider/device, at one rung of :func:`preference`."""

    candidate: Candidate
    rung: str
    device: str
    """``device=`` for :func:`higgs_pack.load`: an EP name (ONNX Runtime) or an OpenVINO device."""
    speed: tuple
    why: str


#: Precision -> speed class on a CPU (lower is faster), when nothing was measured.
PRECISION_SPEED = {"int4": 0, "int8": 1, "fp16": 2, "fp32": 3}


def speed_key(c: Candidate, inv: Inventory, bench: Mapping[str, float], preferred_on_cpus: tuple[str, ...] = ()
              ) -> tuple:
    """Sort key on the cpu rung (lower first): measured frames/s first, then precision, then
    whether the candidate's backend prefers this CPU's vendor (``preferred_on_cpus``, the
    backend's own :attr:`~higgs_pack.runtime.backends.Backend.preferred_on_cpus`)."""
    measured = bench.get(f"{c.target}-{c.precision}")
    backend_order = 0 if inv.cpu_vendor in preferred_on_cpus else 1
    return (0 if measured is not None else 1, -(measured or 0.0), PRECISION_SPEED.get(c.precision, 9),
            backend_order)


def speed_words(c: Candidate, bench: Mapping[str, float]) -> str:
    """How fast a candidate is, in words: measured frames/s here, or its precision's speed class."""
    measured = bench.get(f"{c.target}-{c.precision}")
    return f"measured {measured:.0f} frames/s here" if measured is not None else f"{c.precision} speed class"

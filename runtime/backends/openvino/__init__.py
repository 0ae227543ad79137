"""The native OpenVINO backend: OpenVINO IR bundles on a device (CPU, GPU, NPU, AUTO, HETERO).

:data:`BACKEND` compiles a bundle's IRs on the device the manifest names
(:mod:`.parts`, with :mod:`.devices` for device strings and compile properties,
:mod:`.runners` and :mod:`.static_runners` for the runners), reads what ``verify``
needs from the IRs (:mod:`.ir_checks`), and places its bundles on the NPU, Intel GPU
and CPU rungs of the bundle choice.  openvino is imported only when a bundle is opened.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

from higgs_pack.errors import (
    ExecutionProviderUnavailable,
    InputError,
    Problem,
    install_extra,
)
from higgs_pack.manifests.providers import CPU_RUNG, OPENVINO_REQUIREMENT, ChoiceRung
from higgs_pack.runtime.backends import Backend, OpenedParts, OpenOptions, register

if TYPE_CHECKING:  # pragma: no cover - types only
    from higgs_pack.runtime.machine.facts import Candidate, Inventory, Placement
    from higgs_pack.runtime.sources.opened import Bundle

#: OpenVINO's device rungs of the choice ladder (device names are the backend's own).
NPU_RUNG = ChoiceRung("npu", 10, "OpenVINO NPU variant on an Intel NPU")
IGPU_RUNG = ChoiceRung("igpu", 30, "OpenVINO bundle on an Intel GPU")
NPU_ON_CPU_RUNG = ChoiceRung("npu-on-cpu", 60, "OpenVINO NPU variant on the CPU (static shapes, slower)")


class OpenVINOBackend(Backend):
    """OpenVINO IR bundles on OpenVINO; where they run is the manifest's ``device``."""

    name = "openvino"
    format = "openvino"
    placement = "device"
    label = "OpenVINO"
    modules = ("higgs_pack.runtime.backends.openvino.parts",)
    compile_cache = True
    preferred_on_cpus = ("intel",)
    rungs = (NPU_RUNG, IGPU_RUNG, NPU_ON_CPU_RUNG)
    install_hint = f"{install_extra('openvino')} ({OPENVINO_REQUIREMENT})"
    batching_refusal = "the NPU variant's static shapes take batch 1: its decoder is compiled for one row"

    def batched_decoder(self, pipeline, max_batch: int, max_length: int):
        """The decoder of an engine of ``max_batch`` rows: for ``max_batch > 1`` an
        :class:`~higgs_pack.runtime.backends.openvino.paged.OvPagedDecoder` on the stateful
        decoder IR turned to PagedAttention at load, compiled (once per decoder) on the
        decoder's own device with its own properties (CPU and GPU alike: the device picks the
        cache layout); ``max_batch=1`` the bundle's batch-1 decoder.

        The rows were once spliced into the stateful decoder's one batched state through the
        state API; the paged engine replaced that engine wherever PagedAttention runs (issue 39:
        at least as fast at full size, joins of 1.2-2.6 steps against 3.4-10.7;
        docs/using/engine.md).

        Raises:
            InputError: ``max_batch > 1`` on the NPU variant (its static decoder takes batch 1).
            SignatureMismatch, ExecutionProviderUnavailable: as
                :func:`~higgs_pack.runtime.backends.openvino.paged.compile_paged`.
        """
        from higgs_pack.runtime.backends.openvino.runners import OvStatefulDecoder

        decoder = pipeline.decoder
        if max_batch > 1 and isinstance(decoder, OvStatefulDecoder):
            from higgs_pack.runtime.backends.openvino.paged import OvPagedDecoder, compile_paged

            compiled = compile_paged(decoder, pipeline.constants.num_layers)
            return OvPagedDecoder(compiled, max_batch=max_batch, max_length=max_length, device=decoder.device)
        if max_batch > 1:
            raise InputError.of(
                Problem.said(f"this OpenVINO bundle's decoder cannot batch requests ({self.batching_refusal}); use "
                             "engine(max_batch=1) (the CLI's --batch 1), or the openvino bundle without --npu (it batches "
                             "on the CPU and GPU devices)", code="unsupported_value"))
        return super().batched_decoder(pipeline, max_batch, max_length)

    def open(self, bundle: Bundle, options: OpenOptions) -> OpenedParts:
        """Compile every IR on the device asked for (default: the manifest's); see
        :func:`~higgs_pack.runtime.backends.openvino.parts.open_openvino_parts`.

        ``low_memory`` needs nothing more here: where the CPU plugin packs a decoder's
        weights, the runner already gives the mapped IR's pages back.

        Raises:
            ExecutionProviderUnavailable: OpenVINO is not installed, ``--execution-provider``
                given, or the device is missing (and no fallback asked).
            SignatureMismatch: an IR's I/O differs from the manifest, or the decoder is stateless.
        """
        try:
            from higgs_pack.runtime.backends.openvino.parts import open_openvino_parts
        except ImportError as exc:
            raise ExecutionProviderUnavailable(
                f"{bundle.name} is an OpenVINO IR bundle but the OpenVINO runtime is not installed ({exc}); "
                f"{self.install_hint}") from exc
        self.refuse_foreign_options(bundle, options)
        return open_openvino_parts(bundle, device=options.device, allow_fallback=options.allow_fallback,
                                   cache_dir=options.cache_dir)

    def structure_checks(self):
        """The decoder's state and the static-shape promises, read from the IRs."""
        from higgs_pack.runtime.verification.backend_checks import (
            check_decoder_state,
            check_static_shapes,
        )

        return (check_decoder_state, check_static_shapes)

    def runtime_checks(self):
        """Parity of the paged engine's decoder, and on the GPU and NPU devices where they are present."""
        from higgs_pack.runtime.verification.backend_checks import (
            check_gpu,
            check_npu,
            check_paged_decoder,
        )

        return (check_paged_decoder, check_gpu, check_npu)

    def placements(self, candidate: Candidate, inventory: Inventory, bench: Mapping[str, float]
                   ) -> tuple[list[Placement], str | None]:
        """The NPU variant on an NPU, else any bundle on an Intel GPU; then the CPU device."""
        from higgs_pack.runtime.machine.facts import Placement, speed_key, speed_words

        inv, c = inventory, candidate
        if inv.openvino is None:
            return [], f"OpenVINO is not installed; {self.install_hint}"
        out: list[Placement] = []
        accelerator, rung_here, rung_cpu, on_cpu = (
            ("NPU", NPU_RUNG, NPU_ON_CPU_RUNG, "OpenVINO CPU (the NPU variant's static shapes run there too)")
            if c.variant == "npu" else
            ("GPU", IGPU_RUNG, CPU_RUNG, f"OpenVINO CPU, {speed_words(c, bench)}"))
        found = inv.ov_has(accelerator)
        if found:
            out.append(Placement(c, rung_here.name, found, (), f"OpenVINO {found}: {inv.openvino_devices[found]}"))
        if inv.ov_has("CPU"):
            out.append(Placement(c, rung_cpu.name, "CPU", speed_key(c, inv, bench, self.preferred_on_cpus), on_cpu))
        if not out:
            return [], f"OpenVINO sees no usable device for it (devices: {', '.join(inv.openvino_devices) or 'none'})"
        return out, None

    def notes(self, candidates: list[Candidate], inventory: Inventory, runnable: set[str], of: str) -> list[str]:
        """An NPU or Intel GPU that is present with nothing runnable on it, and why."""
        inv, notes = inventory, []
        npu_hw = inv.hardware.get("intel-npu")
        if npu_hw and not inv.ov_has("NPU"):
            why = ("its driver is not loaded (no /dev/accel node: install the Intel NPU driver)"
                   if inv.npu_driver is False else
                   "OpenVINO does not list it (NPU driver or OpenVINO missing: install both)")
            notes.append(f"an Intel NPU is present ({npu_hw[0]}) but cannot be used: {why}")
        if inv.ov_has("NPU") and NPU_RUNG.name not in runnable:
            notes.append(f"an NPU is present ({inv.openvino_devices[inv.ov_has('NPU')]}) but no runnable OpenVINO "
                         f"NPU variant{of} is visible; build one with `higgs-pack build --target openvino --npu`")
        gpu = inv.ov_has("GPU")
        if gpu and IGPU_RUNG.name not in runnable:
            notes.append(f"an Intel GPU is present ({inv.openvino_devices[gpu]}) but no runnable OpenVINO "
                         f"bundle{of} is visible; build one with `higgs-pack build --target openvino`")
        elif inv.hardware.get("intel-gpu") and not gpu and inv.openvino is not None:
            notes.append(f"an Intel GPU is present ({inv.hardware['intel-gpu'][0]}) but OpenVINO does not list it "
                         "(install the Intel GPU compute runtime)")
        return notes


BACKEND = register(OpenVINOBackend())

"""Runtime backends: one object per backend, found by the manifest's ``backend`` name.

A :class:`Backend` holds everything higgs-pack knows about one runtime: the sub-part file
format its bundles hold, the manifest field that says where a bundle runs
(``execution_provider`` or ``device``), how it opens a bundle (:meth:`Backend.open`),
its checks in ``verify`` (:meth:`Backend.structure_checks`, :meth:`Backend.runtime_checks`),
and where its bundles can run in the bundle choice (:meth:`Backend.placements`,
:attr:`Backend.rungs`).  The two built-in backends live in the folders beside this file
(``onnxruntime/``, ``openvino/``); a third is one more folder whose module calls
:func:`register` on import, listed in :data:`BUILTIN` or published by another
distribution in the ``higgs_pack.backends`` entry-point group.

This module imports nothing heavy: a backend imports its runtime (onnxruntime, openvino)
only when it opens a bundle.
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from higgs_pack.errors import (
    ExecutionProviderUnavailable,
    InputError,
    ManifestError,
    Problem,
)
from higgs_pack.manifests.model import SubPart
from higgs_pack.manifests.providers import ChoiceRung

if TYPE_CHECKING:  # pragma: no cover - types only
    from higgs_pack.runtime.machine.facts import Candidate, Inventory, Placement
    from higgs_pack.runtime.sources.opened import Bundle

log = logging.getLogger(__name__)

#: Modules of the built-in backends; importing one registers its backend.
BUILTIN = ("higgs_pack.runtime.backends.onnxruntime", "higgs_pack.runtime.backends.openvino")
#: Entry-point group through which other distributions add backends (each entry point
#: names a module that calls :func:`register` on import).
ENTRY_POINT_GROUP = "higgs_pack.backends"

#: ``f(bundle, report)``: a check on a bundle's files, before any session exists.
StructureCheck = Callable[..., None]
#: ``f(bundle, pipeline, report)``: a check on a loaded bundle.
RuntimeCheck = Callable[..., None]


@dataclass(frozen=True)
class OpenOptions:
    """How :func:`higgs_pack.runtime.sources.bundle.load_pipeline` asks a backend to open a bundle.

    Attributes:
        execution_provider: ONNX Runtime: a provider name overriding the manifest's.
        device: OpenVINO: a device overriding the manifest's.
        allow_fallback: permit another provider/device when the one asked for is missing
            (logged and written into :attr:`OpenedParts.where`).
        cache_dir: compiled-model cache folder, None for the backend's default, False for none.
        low_memory: keep as little of the weights resident as the backend allows.
    """

    execution_provider: str | None = None
    device: str | None = None
    allow_fallback: bool = False
    cache_dir: Path | Literal[False] | None = None
    low_memory: bool = False


@dataclass
class OpenedParts:
    """What :meth:`Backend.open` returns: one runner per sub-part and where each runs.

    Attributes:
        runners: sub-part -> its runner (a ``SubPartRunner``, or a ``Decoder`` for
            ``llm_decoder``; see :mod:`higgs_pack.runtime.loop.pipeline`).
        where: sub-part -> one phrase saying where it runs (``CPUExecutionProvider``,
            ``OpenVINO CPU (f32)``), shown in ``TTS.info``.
    """

    runners: dict[str, Any] = field(default_factory=dict)
    where: dict[str, str] = field(default_factory=dict)

    def add(self, part: SubPart | str, runner: Any, where: str) -> None:
        """Record one opened sub-part."""
        self.runners[str(part)] = runner
        self.where[str(part)] = where


class Backend:
    """One runtime a bundle can run on; subclass it and :func:`register` an instance.

    Class attributes (facts, no behaviour):
        name: the manifest's ``backend`` value.
        format: the sub-part file format its bundles hold (an exporter's ``format``).
        placement: the manifest field and the ``load()`` keyword that say where a bundle
            runs (``execution_provider`` or ``device``).
        label: its name in sentences and model cards (``ONNX Runtime``, ``OpenVINO``).
        modules: modules that load it (imported, and timed apart, by the benchmark).
        compile_cache: it compiles models into a cache (``load(cache_dir=)``): the
            benchmark measures a cold and a warm load.
        preferred_on_cpus: CPU vendors (``Inventory.cpu_vendor``) on whose CPUs its bundles
            rank first among equal speed classes when nothing was measured.
        rungs: the rungs of the choice ladder that belong to this backend alone
            (:func:`higgs_pack.runtime.machine.choice.preference`); shared rungs (the CPU's, an
            execution provider's) are declared where they are shared.
        install_hint: what to install to run its bundles, for messages.
    """

    name: ClassVar[str]
    format: ClassVar[str]
    placement: ClassVar[str]
    label: ClassVar[str]
    modules: ClassVar[tuple[str, ...]] = ()
    compile_cache: ClassVar[bool] = False
    preferred_on_cpus: ClassVar[tuple[str, ...]] = ()
    rungs: ClassVar[tuple[ChoiceRung, ...]] = ()
    install_hint: ClassVar[str] = ""

    def open(self, bundle: Bundle, options: OpenOptions) -> OpenedParts:
        """Open every sub-part of a validated bundle on this backend.

        Raises:
            ExecutionProviderUnavailable: the runtime, provider or device is missing.
            SignatureMismatch: a sub-part's I/O differs from the manifest.
        """
        raise NotImplementedError

    def structure_checks(self) -> tuple[StructureCheck, ...]:
        """Checks on the bundle's files that ``verify`` runs before any session exists."""
        return ()

    def runtime_checks(self) -> tuple[RuntimeCheck, ...]:
        """Checks on the loaded bundle that ``verify`` runs after parity and greedy codes."""
        return ()

    def placements(self, candidate: Candidate, inventory: Inventory, bench: Mapping[str, float]
                   ) -> tuple[list[Placement], str | None]:
        """Where one of its bundles can run on this machine (best first), or why it cannot."""
        return [], f"the {self.label} backend places no bundle"

    def notes(self, candidates: list[Candidate], inventory: Inventory, runnable: set[str], of: str) -> list[str]:
        """Preferred hardware of this backend that is present with nothing runnable on it.

        Args:
            candidates: every visible bundle; inventory: this machine; runnable: the rungs
            some bundle can take; of: `` of <model>`` or ``""``, for the sentences.
        """
        return []

    def load_keywords(self, bundle: Bundle, device: str) -> dict[str, str]:
        """Map ``higgs_pack.load(device=...)`` onto this backend's :class:`OpenOptions` field.

        Raises:
            ExecutionProviderUnavailable: ``device`` names nothing this backend runs on.
        """
        return {self.placement: device}

    def refuse_foreign_options(self, bundle: Bundle, options: OpenOptions) -> None:
        """Refuse the other backends' placement keyword (``--device`` on an ONNX Runtime bundle).

        Raises:
            ExecutionProviderUnavailable: the option that belongs to another backend is set.
        """
        for other in ("execution_provider", "device"):
            if other != self.placement and getattr(options, other) is not None:
                flag = "--" + other.replace("_", "-")
                raise ExecutionProviderUnavailable(
                    f"{bundle.name} is {'an' if self.label[:1] in 'AEIOU' else 'a'} {self.label} bundle; choose where "
                    f"it runs with "
                    f"--{self.placement.replace('_', '-')} ({self.placement}=), not {flag} ({other}=)"
                )

    def batched_decoder(self, pipeline: Any, max_batch: int, max_length: int) -> Any:
        """The decoder of a continuous-batching engine (:mod:`higgs_pack.runtime.engine`)
        for ``max_batch`` rows of at most ``max_length`` positions each; the base class serves
        ``max_batch=1`` through the pipeline's own decoder and refuses more.

        Raises:
            InputError: this backend (or this bundle's placement) cannot batch, saying why.
        """
        from higgs_pack.runtime.engine.decoders import SingleRowDecoder

        if max_batch == 1:
            return SingleRowDecoder(pipeline.decoder, max_length)
        raise InputError.of(
            Problem.said(f"{self.label} bundles do not decode several requests per step yet ({self.batching_refusal}); "
                         "use engine(max_batch=1) (the CLI's --batch 1), or a cpu ONNX Runtime bundle for batching", code="unsupported_value"))

    #: Why :meth:`batched_decoder` refuses ``max_batch > 1`` (for its message).
    batching_refusal: ClassVar[str] = "no batched decoder is written for this backend"

    def __repr__(self) -> str:
        return f"<{self.label} backend {self.name!r}>"


_REGISTRY: dict[str, Backend] = {}
_builtins_loaded = False


def register(backend: Backend) -> Backend:
    """Make a backend known by its ``name`` (what its bundles' manifests say).

    Returns:
        ``backend``, so a module can write ``BACKEND = register(MyBackend())``.

    Raises:
        ValueError: another backend of that name is registered already, or a class
            attribute of :class:`Backend` is missing.
    """
    for attr in ("name", "format", "placement", "label"):
        if not getattr(backend, attr, None):
            raise ValueError(f"{type(backend).__name__} has no {attr!r}: set it as a class attribute")
    if backend.placement not in ("execution_provider", "device"):
        raise ValueError(f"{type(backend).__name__}.placement must be 'execution_provider' or 'device' "
                         f"(a manifest field), not {backend.placement!r}")
    known = _REGISTRY.get(backend.name)
    if known is not None and type(known) is not type(backend):
        raise ValueError(f"backend {backend.name!r} is registered already ({known!r})")
    _REGISTRY[backend.name] = backend
    return backend


def unregister(name: str) -> None:
    """Forget a registered backend (tests that add a toy backend remove it again)."""
    _REGISTRY.pop(name, None)


def _load_builtins() -> None:
    global _builtins_loaded
    if _builtins_loaded:
        return
    _builtins_loaded = True
    for module in BUILTIN:
        importlib.import_module(module)
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        try:
            ep.load()
        except Exception as exc:  # a broken plugin must not break the built-in backends
            log.warning("backend entry point %s (%s) failed to load: %s", ep.name, ep.value, exc)


def registered() -> dict[str, Backend]:
    """Every known backend by name (built-ins first, then entry points, then :func:`register` calls)."""
    _load_builtins()
    return dict(_REGISTRY)


def get_backend(name: str | None) -> Backend:
    """The backend a manifest names.

    Raises:
        ManifestError: no backend of that name is known (names the known ones).
    """
    backends = registered()
    if name not in backends:
        raise ManifestError(f"unknown backend {name!r} (known: {', '.join(sorted(backends))}); "
                            "upgrade higgs-pack, install the distribution that provides it, or rebuild the bundle")
    return backends[name]


def backend_of(manifest: Mapping[str, Any]) -> Backend:
    """The backend of a manifest (see :func:`get_backend`)."""
    return get_backend(manifest.get("backend"))


def placement_of(manifest: Mapping[str, Any]) -> str:
    """Where a bundle was built to run: its ``execution_provider`` or ``device``, whichever
    field its backend's ``placement`` names.

    Raises:
        ManifestError: the manifest names an unknown backend.
    """
    return manifest[backend_of(manifest).placement]

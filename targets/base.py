"""What a target is: :class:`Target`, :class:`Recipe`, :class:`Variant`.

A :class:`Target` is data: where the bundle runs, what it needs installed, its
precisions, and a table sub-part -> :class:`Recipe` (which exporter builds it and
at which precision).  The build loop in :mod:`higgs_pack.targets.build` is
generic; adding a target is adding one declaration (see
:mod:`higgs_pack.targets.declarations`), checked when the registry
(:mod:`higgs_pack.targets.registry`) takes it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from higgs_pack.errors import BuildPlanError, unknown_choice
from higgs_pack.manifests.model import FP32_ONLY, SubPart
from higgs_pack.manifests.providers import EXECUTION_PROVIDERS, ExecutionProvider
from higgs_pack.runtime.backends import registered

#: Minimum similarity to the PyTorch reference's golden outputs, per sub-part
#: precision (cosine for float outputs).  Measured on the tiny checkpoint with margin;
#: recorded per sub-part in every manifest, so verify uses the build's own rule.
COSINE_THRESHOLDS = {"fp32": 0.9999, "fp16": 0.995, "int8": 0.98, "int4": 0.97}
#: The decoder stacks quantization error over its layers, and random weights (the
#: tiny/bench checkpoints) have none of the structure that keeps real int4 models close:
#: measured decoder cosine at int4 was 0.99 on the 2-layer tiny model but 0.90-0.93 on
#: the 8-layer bench model (cpu and openvino), so the decoder's int4 floor is lower.
DECODER_COSINE_THRESHOLDS = {**COSINE_THRESHOLDS, "int8": 0.97, "int4": 0.85}
#: Largest relative L2 error ``||bundle - reference|| / ||reference||`` a sub-part may
#: show, per precision: against the matched oracle (the bundle's own weights) where the
#: weights were quantized or cast, against the float oracle otherwise.  This is the export
#: error: compute noise only (float reordering, int8 activations of MatMulNBits
#: accuracy_level 4, fp16 arithmetic, OpenVINO's u8 KV cache), so it is independent of how
#: much quantization noise a random deep model amplifies.  Cosine alone misses scale
#: errors (a codec weight x1.01, an embedding x1.05): this bound does not.
EXPORT_REL_L2 = {"fp32": 1e-3, "fp16": 1e-2, "int8": 2e-2, "int4": 2e-2}
#: The decoder stacks compute noise over its layers (36 at full size; the limit grows with
#: sqrt(layers / 2), see ``higgs_pack.targets.build``).  Measured export errors of correct int4
#: decoders (AMD EPYC, AVX2): 0.0063 (tiny, 2 layers), 0.047 (full, cpu: int8 activations of
#: accuracy_level 4) and 0.018 (full, openvino); the subtlest mutation shown at full size, all
#: q/k norms dropped, measured 0.225, so 0.03 (0.127 at 36 layers) passes the correct exports
#: with a margin of 2.7x and fails that one by 1.8x, where 0.05 (0.212) failed it by only 6%.
DECODER_EXPORT_REL_L2 = {"fp32": 1e-2, "fp16": 0.03, "int8": 0.03, "int4": 0.03}
#: A quantized KV cache's own rule (``parity.kv_cache`` of the decoder): its cached K/V,
#: dequantized with the graph's scales, against the oracle's K/V on the golden prompt (the
#: float oracle, or the one with the bundle's weights where those are quantized), worst layer
#: and side.  Each layer's cache carries its own rounding (int8 per channel: relative L2
#: 0.007-0.014 in the first layer, tiny and bench presets) plus what the layers below it
#: changed, so ``max_rel_l2`` grows with depth like the decoder's (``* sqrt(layers / 2)``:
#: 0.03 tiny, 0.06 bench, 0.127 full).  Measured worst layers of correct bundles (AMD EPYC,
#: ONNX Runtime 1.32): tiny fp32 0.0097, tiny int4 0.0133, bench int4 0.0488 (against the
#: oracle with the bundle's weights: its int8 activations add noise that grows with depth).
#: The bench int4 bundle with its scales tampered: x10 in every layer 0.203, x10 in layer 3
#: alone 0.088, /10 1.01, /2 0.396 (clipped) all fail; x2 gives 0.049 and passes, hidden by
#: the deeper layers' noise.  The cosine floor is loose: the relative L2 decides (cosine
#: misses a scale).
KV_CACHE_PARITY: dict[str, dict[str, float]] = {"int8": {"threshold": 0.99, "max_rel_l2": 0.03}}
#: What a quantized KV cache adds to the decoder's hidden-state limit (per 2 layers, grown with
#: depth like :data:`DECODER_EXPORT_REL_L2`): no oracle quantizes its K/V, so the cache's effect
#: on the hidden states counts against the export limit.  Measured on the golden inputs (text
#: prompt + one step): tiny fp32 0.0073 (float KV: ~1e-6; limit 0.01 without this), tiny int4
#: 0.0107 against the matched oracle (float KV: 0.0063), bench int4 0.0421 (limit 0.06
#: without this, 0.08 with it); on random prompts (python -m bench.ab ort-kv-cache) bench int4
#: 0.0155, fp32 0.0050 against the float KV cache.
DECODER_KV_CACHE_REL_L2 = {"int8": 0.01}
#: The codec encoder outputs codes: fraction of equal codes at fp32 (near-ties in
#: the residual quantizer may flip under float reordering).
CODE_AGREEMENT_THRESHOLD = 0.9


@dataclass(frozen=True)
class Recipe:
    """How one sub-part is built for a target.

    Attributes:
        exporter: name in :data:`higgs_pack.exporters.catalog.EXPORTERS`.
        precision: ``"target"`` (follow the bundle's precision) or a fixed one (``"fp32"``).
        options: extra keyword arguments for the exporter (e.g. ``execution_provider``).
    """

    exporter: str
    precision: str = "target"
    options: Mapping[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Variant:
    """A named build variant of a target (``--variant NAME``): data the generic build loop applies.

    Declared in a target's ``variants``.

    Attributes:
        name: ``--variant`` value and bundle-name suffix (``npu`` ->
            ``<slug>-<target>-<precision>-npu``).
        description: one line for the plan and ``--help``.
        options: sub-part -> exporter keyword options laid over the recipe's
            (e.g. ``{SubPart.AUDIO_HEADS: {"static_axes": {"batch": 1, "frames": 1}}}``).
        manifest: top-level manifest entries: dict values are merged into the
            target's (``provider_options``, ``generation``), others replace it
            (``device``).
        verify_on: EP or device the build-time verification runs on (``None``: the
            target's ``verify_on``).
    """

    name: str
    description: str = ""
    options: Mapping[SubPart, Mapping[str, Any]] = field(default_factory=dict)
    manifest: Mapping[str, Any] = field(default_factory=dict)
    verify_on: str | None = None


@dataclass(frozen=True)
class Target:
    """One hardware target.

    An ONNX Runtime target names its execution provider; what the provider row of
    :data:`~higgs_pack.manifests.providers.EXECUTION_PROVIDERS` holds (extra,
    requirement, platform marker, wheel classifiers) is taken from it unless the
    target says otherwise, so a target on an existing provider is one declaration.

    Attributes:
        name: ``cpu``, ``cuda``, ``dml``, ``openvino``.
        description: one line for ``--help`` and wheel metadata.
        backend: a key of :func:`~higgs_pack.runtime.backends.registered`
            (``onnxruntime`` or ``openvino``).
        precisions: allowed bundle precisions; the first is the default.
        recipes: sub-part -> recipe; must cover all six sub-parts.
        extra: the ``higgs-pack[extra]`` a user of the bundle installs (default: the
            provider's).
        runtime_requirements: requirement strings recorded in the manifest (default:
            the provider's requirement, its companions and ``onnx``), each restricted to
            ``platform_marker``.
        execution_provider: bundle EP name (onnxruntime targets).
        device: default OpenVINO device (openvino targets).
        provider_options, session_options: recorded in the manifest for the runtime.
        platform_marker: PEP 508 marker for wheels and requirements (default: the
            provider's, ``sys_platform == 'win32'`` for dml).
        verify_on: EP or device the build-time checks run on when the target's own
            hardware is missing (``None`` = the target's own, which every machine has).
        variants: optional build variants (e.g. ``npu``: static shapes), see :class:`Variant`.
        classifiers: extra trove classifiers of its wheels (default: the provider's).
        kv_caches: the decoder KV cache precisions a build may choose (``--kv-cache``), the
            first the default: ``"float"`` (the graph's I/O dtype) and, where the decoder's
            exporter takes a ``kv_cache`` option, quantized ones (``"int8"``: see
            :mod:`higgs_pack.exporters.onnx.kv_quantization`).  Empty: not a build choice (OpenVINO picks
            its KV cache precision when it compiles the model); the manifest records null.
    """

    name: str
    description: str
    backend: str
    precisions: tuple[str, ...]
    recipes: Mapping[SubPart, Recipe]
    extra: str | None = None
    runtime_requirements: tuple[str, ...] | None = None
    execution_provider: str | None = None
    device: str | None = None
    provider_options: Mapping[str, Any] = field(default_factory=dict)
    session_options: Mapping[str, Any] = field(default_factory=dict)
    platform_marker: str | None = None
    verify_on: str | None = None
    variants: tuple[Variant, ...] = ()
    classifiers: tuple[str, ...] | None = None
    kv_caches: tuple[str, ...] = ("float",)

    def __post_init__(self) -> None:
        missing = set(SubPart) - set(self.recipes)
        if missing:
            raise BuildPlanError(f"target {self.name!r} declares no recipe for {sorted(map(str, missing))}")
        if self.backend not in registered():
            raise BuildPlanError(unknown_choice("backend", self.backend, registered(), f"Target(name={self.name!r}, backend=)"))
        object.__setattr__(self, "recipes", MappingProxyType(dict(self.recipes)))
        row = self.provider
        if self.execution_provider is not None and row is None:
            raise BuildPlanError(
                f"target {self.name!r}: " + unknown_choice("execution provider", self.execution_provider,
                                                            EXECUTION_PROVIDERS, "Target(execution_provider=)"))
        if row is not None:
            defaults = {"extra": row.packaging.extra, "platform_marker": row.packaging.platform_marker, "classifiers": row.packaging.classifiers,
                        "runtime_requirements": (row.packaging.requirement, *row.packaging.companions,
                                                 ONNX_REQUIREMENT)}
            for key, value in defaults.items():
                if getattr(self, key) is None:
                    object.__setattr__(self, key, value)
        if self.extra is None or self.runtime_requirements is None:
            raise BuildPlanError(f"target {self.name!r} on backend {self.backend!r} must declare extra= and "
                                 "runtime_requirements= (only an execution provider row supplies them)")
        if self.classifiers is None:
            object.__setattr__(self, "classifiers", ("Operating System :: OS Independent",))
        if self.platform_marker:
            object.__setattr__(self, "runtime_requirements",
                               on_platform(tuple(self.runtime_requirements), self.platform_marker))

    @property
    def provider(self) -> ExecutionProvider | None:
        """The execution-provider row of an ONNX Runtime target (``None`` for other backends)."""
        return EXECUTION_PROVIDERS.get(self.execution_provider) if self.execution_provider else None

    @property
    def placement(self) -> str:
        """The ``load()`` keyword / manifest field naming where it runs (``execution_provider``/``device``)."""
        return registered()[self.backend].placement

    @property
    def runs_anywhere(self) -> bool:
        """Its bundles run on any machine with the runtime installed (no special hardware)."""
        return self.verify_on is None

    @property
    def default_precision(self) -> str:
        return self.precisions[0]

    @property
    def default_kv_cache(self) -> str | None:
        """The KV cache precision of a build without ``--kv-cache`` (None: not a build choice)."""
        return self.kv_caches[0] if self.kv_caches else None

    def precision_for(self, part: SubPart, precision: str) -> str:
        """Effective precision of one sub-part in a bundle of ``precision``."""
        rule = self.recipes[part].precision
        if part in FP32_ONLY:
            return "fp32"
        return precision if rule == "target" else rule


#: The ``onnx`` requirement every ONNX Runtime bundle records (static checks read the graphs).
ONNX_REQUIREMENT = "onnx>=1.17"


def on_platform(requirements: tuple[str, ...], marker: str) -> tuple[str, ...]:
    """Each PEP 508 requirement restricted to ``marker`` (unchanged when it already is)."""
    out = []
    for requirement in requirements:
        spec, _, existing = (part.strip() for part in requirement.partition(";"))
        if existing.replace('"', "'") == marker:
            out.append(requirement)
        else:
            out.append(f"{spec}; ({existing}) and {marker}" if existing else f"{spec}; {marker}")
    return tuple(out)

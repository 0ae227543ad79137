"""Build plans: target x precision x sub-part -> exporter, passes, precision.

Computed and validated before anything heavy is imported, so a bad request
fails in milliseconds with a message naming both values.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from higgs_pack.errors import BuildPlanError
from higgs_pack.exporters.catalog import ExporterInfo, get_exporter
from higgs_pack.manifests.model import NAME_WIDTH, SubPart
from higgs_pack.targets.base import Target, Variant
from higgs_pack.targets.registry import get_target

#: Bundle-name slug of the embedded tiny checkpoint (the default ``--model``).
DEFAULT_MODEL_SLUG = "higgs-audio-v3-tiny"


@dataclass(frozen=True)
class PlannedSubPart:
    """One row of a build plan.

    Attributes:
        subpart: which sub-part.
        exporter: the catalogue row that builds it.
        precision: its effective precision.
        passes: tool passes, in order (from the exporter's own planning function).
        options: exporter keyword options from the recipe, with the variant's on top.
        variant_options: the part of ``options`` the variant set (shown by ``render``).
        quantization: every quantization setting the recipe declares or the exporter defaults
            (method, bits, block or group size, symmetry, accuracy level…), as the manifest
            will record them; the build refuses a sub-part whose record differs in any.
    """

    subpart: SubPart
    exporter: ExporterInfo
    precision: str
    passes: tuple[str, ...]
    options: dict[str, Any]
    variant_options: dict[str, Any] = field(default_factory=dict)
    quantization: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class BuildPlan:
    """A validated plan for one bundle."""

    target: Target
    precision: str
    rows: tuple[PlannedSubPart, ...]
    variant: str | None = None
    variant_spec: Variant | None = None
    kv_cache: str | None = None

    def render(self) -> str:
        """Human-readable table (``higgs-pack build --plan``)."""
        lines = [f"plan: target {self.target.name}, precision {self.precision}"
                 + (f", KV cache {self.kv_cache}" if self.kv_cache else "")
                 + (f", variant {self.variant}" if self.variant else "")]
        if self.variant_spec is not None and self.variant_spec.description:
            lines[0] += f" ({self.variant_spec.description})"
        for row in self.rows:
            lines.append(f"  {row.subpart.value:<{NAME_WIDTH}} {row.precision:<5} {row.exporter.name:<17} "
                         f"{' -> '.join(row.passes)}")
            if row.quantization:
                lines.append(f"  {'':<{NAME_WIDTH}} {'':<5} quantization: "
                             + ", ".join(f"{k}={v}" for k, v in row.quantization.items()))
            if row.variant_options:
                opts = ", ".join(f"{k}={v}" for k, v in row.variant_options.items())
                lines.append(f"  {'':<{NAME_WIDTH}} {'':<5} {self.variant}: {opts}")
        return "\n".join(lines)


def make_plan(target: str | Target, precision: str | None = None, variant: str | None = None,
              kv_cache: str | None = None) -> BuildPlan:
    """Plan a build.

    Args:
        target: target name or declaration.
        precision: bundle precision; default the target's default.
        variant: optional target variant (e.g. ``"npu"`` for openvino).
        kv_cache: the decoder's KV cache precision (``--kv-cache``: one of the target's
            ``kv_caches``); default the target's default.  A quantized one is handed to the
            decoder's exporter as its ``kv_cache`` option and planned in its ``quantization``.

    Raises:
        BuildPlanError: unknown target, a precision the target does not support
            (naming both and the allowed ones), an unknown variant, or a KV cache the
            target does not offer (naming both and the allowed ones).
    """
    t = get_target(target) if isinstance(target, str) else target
    precision = precision or t.default_precision
    if precision not in t.precisions:
        raise BuildPlanError(
            f"target {t.name!r} does not support precision {precision!r}; it supports "
            f"{', '.join(t.precisions)} (set it with --precision / precision=)"
        )
    variants = {v.name: v for v in t.variants}
    if variant is not None and variant not in variants:
        allowed = ", ".join(variants) or "none"
        raise BuildPlanError(f"target {t.name!r} has no variant {variant!r}; variants: {allowed} "
                             "(set it with --variant / variant=)")
    spec = variants[variant] if variant is not None else None
    if kv_cache is not None and kv_cache not in t.kv_caches:
        allowed = ", ".join(t.kv_caches) or "none (its runtime picks the KV cache precision)"
        raise BuildPlanError(f"target {t.name!r} does not offer KV cache {kv_cache!r}; it offers {allowed} "
                             "(set it with --kv-cache / kv_cache=)")
    kv_cache = kv_cache or t.default_kv_cache
    rows = []
    for part in SubPart:
        recipe = t.recipes[part]
        info = get_exporter(recipe.exporter)
        eff = t.precision_for(part, precision)
        extra = dict(spec.options.get(part, {})) if spec is not None else {}
        info.check_options(extra, f"target {t.name!r}, variant {variant!r}, {part.value}")
        options = {**recipe.options, **extra}
        if part == SubPart.LLM_DECODER and kv_cache not in (None, "float"):
            options["kv_cache"] = kv_cache
        passes, quantization = info.planned(eff, options)
        rows.append(PlannedSubPart(part, info, eff, passes, options, extra, quantization))
    # A variant that sets the decoder's kv_cache (the benchmarks' variants) decides it.
    kv_cache = next((r.options["kv_cache"] for r in rows if r.subpart == SubPart.LLM_DECODER
                     and "kv_cache" in r.options), kv_cache)
    return BuildPlan(t, precision, tuple(rows), variant, spec, kv_cache)


def plan_mismatches(plan: BuildPlan, recorded: Mapping[str, Mapping[str, Any]],
                    parts: Iterable[SubPart] | None = None) -> list[str]:
    """Where what was built differs from the plan: exporter name, passes, precision, planned
    quantization settings.

    Args:
        plan: the plan of the build.
        recorded: sub-part name -> its manifest entry (or ``ExportResult.to_dict()``).
        parts: check only these sub-parts (default: all; the build checks the decoders as
            soon as they are built).

    Returns:
        One line per difference (empty when the build did what the plan said).
    """
    out = []
    only = set(SubPart) if parts is None else set(parts)
    for row in (r for r in plan.rows if r.subpart in only):
        got = recorded.get(row.subpart.value)
        if got is None:
            out.append(f"{row.subpart.value}: not built")
            continue
        if got["exporter"] != row.exporter.name:
            out.append(f"{row.subpart.value}: exporter {got['exporter']!r}, planned {row.exporter.name!r}")
        if tuple(got["passes"]) != row.passes:
            out.append(f"{row.subpart.value}: passes {list(got['passes'])}, planned {list(row.passes)}")
        if got["precision"] != row.precision:
            out.append(f"{row.subpart.value}: precision {got['precision']}, planned {row.precision}")
        for key, value in row.quantization.items():
            if got["quantization"].get(key) != value:
                out.append(f"{row.subpart.value}: quantization {key}={got['quantization'].get(key)!r}, "
                           f"planned {value!r}")
        if "kv_cache" in got["quantization"] and "kv_cache" not in row.quantization:
            out.append(f"{row.subpart.value}: quantization kv_cache={got['quantization']['kv_cache']!r}, "
                       "planned a float KV cache")
    return out


def model_slug(model: str | Path | None) -> str:
    """Bundle-name slug of a checkpoint: its folder or repo name, lower case, runs of other
    characters as ``-`` (:data:`DEFAULT_MODEL_SLUG` for the default checkpoint, ``None``)."""
    if model is None:
        return DEFAULT_MODEL_SLUG
    name = Path(str(model).rstrip("/")).name or str(model)
    slug = re.sub(r"[^a-z0-9.]+", "-", name.lower()).strip("-.")
    return slug or "model"


def bundle_name(slug: str, plan: BuildPlan) -> str:
    """``<model-slug>-<target>-<precision>[-kv-<kv cache>][-<variant>]``: the bundle's folder and
    manifest name; ``-kv-<kv cache>`` only for a KV cache other than the target's default
    (``higgs-audio-v3-tiny-cpu-int4-kv-int8``), so default builds keep their names."""
    parts = [slug, plan.target.name, plan.precision]
    if plan.kv_cache is not None and plan.kv_cache != plan.target.default_kv_cache:
        parts.append(f"kv-{plan.kv_cache}")
    if plan.variant:
        parts.append(plan.variant)
    return "-".join(parts)


def bundle_path(plan: BuildPlan, model: str | Path | None = None, out: str | Path | None = None,
               dist_dir: str | Path = "dist") -> Path:
    """Where a build of ``plan`` puts its bundle: ``out`` when given, else
    ``<dist_dir>/<bundle_name>`` (``higgs-pack build --print-path`` prints it; the noxfile asks
    that instead of naming bundles itself).

    Args:
        plan: the build's plan (target, precision, KV cache, variant).
        model: the checkpoint directory or repo id (``None``: the embedded tiny one).
        out: an explicit bundle directory.
        dist_dir: parent of the default directory (relative paths: to the working directory).
    """
    if out is not None:
        return Path(out)
    return Path(dist_dir) / bundle_name(model_slug(model), plan)

"""The target registry: the built-in targets (:mod:`higgs_pack.targets.declarations`) and any
added with :func:`register`, each checked against the exporters' catalogue as it comes in.

Apart from :mod:`higgs_pack.targets.base` so that imports run one way: declarations import what
a target is (base), the registry imports the declarations.
"""

from __future__ import annotations

from higgs_pack.errors import BuildPlanError, unknown_choice
from higgs_pack.exporters.catalog import get_exporter
from higgs_pack.manifests.model import SubPart
from higgs_pack.runtime.backends import registered
from higgs_pack.targets import declarations
from higgs_pack.targets.base import Target

_REGISTRY: dict[str, Target] = {}
#: Whether :data:`~higgs_pack.targets.declarations.BUILTIN` is in :data:`_REGISTRY` yet.
_BUILTIN_REGISTERED = False


def register(target: Target) -> Target:
    """Add a target to the registry after checking its declaration.

    Checked: the name is new; every recipe's exporter writes the format of the target's
    backend; every recipe and variant option is one its exporter takes, with the right
    type; every sub-part's exporter builds every precision the target allows; a quantized
    KV cache choice has a decoder exporter that takes ``kv_cache``.

    Raises:
        BuildPlanError: naming the target, sub-part and the bad value with the allowed ones.
    """
    if target.name in _REGISTRY:
        raise BuildPlanError(f"target {target.name!r} is already registered")
    backend = registered()[target.backend]
    for part, recipe in target.recipes.items():
        info = get_exporter(recipe.exporter)
        if info.format != backend.format:
            raise BuildPlanError(
                f"target {target.name!r}: exporter {info.name!r} of {part} writes {info.format}, but the "
                f"{backend.name} backend runs {backend.format}; choose an exporter that writes {backend.format}")
        info.check_options(recipe.options, f"target {target.name!r}, {part} recipe")
        for variant in target.variants:
            info.check_options(variant.options.get(part, {}), f"target {target.name!r}, variant {variant.name!r}, {part}")
        for precision in target.precisions:
            eff = target.precision_for(part, precision)
            if eff not in info.precisions:
                raise BuildPlanError(
                    f"target {target.name!r}: exporter {info.name!r} of {part} cannot build {eff} "
                    f"(it builds {', '.join(info.precisions)})"
                )
    quantized = [kv for kv in target.kv_caches if kv != "float"]
    decoder = get_exporter(target.recipes[SubPart.LLM_DECODER].exporter)
    if quantized and "kv_cache" not in decoder.options:
        raise BuildPlanError(f"target {target.name!r}: KV cache choice(s) {quantized} need a decoder exporter that "
                             f"takes kv_cache; {decoder.name!r} does not")
    _REGISTRY[target.name] = target
    return target


def targets() -> dict[str, Target]:
    """All registered targets by name: the built-in declarations (registered on first use) and
    any :func:`register` added."""
    global _BUILTIN_REGISTERED
    if not _BUILTIN_REGISTERED:
        _BUILTIN_REGISTERED = True
        for target in declarations.BUILTIN:
            if _REGISTRY.get(target.name) is not target:
                register(target)
    return dict(_REGISTRY)


def get_target(name: str) -> Target:
    """Look up a target; unknown names raise :class:`BuildPlanError` listing the known ones."""
    known = targets()
    if name not in known:
        raise BuildPlanError(unknown_choice("target", name, known, "--target / target="))
    return known[name]

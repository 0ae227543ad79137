"""Bundles installed as wheels, found through the ``higgs_pack.bundles`` entry points.

A bundle wheel (``higgs-pack package --format wheel``) declares
``[project.entry-points."higgs_pack.bundles"] <bundle-name> = "<module>"``; the
module's package directory holds the bundle tree.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from pathlib import Path

ENTRY_POINT_GROUP = "higgs_pack.bundles"


def installed_bundles() -> dict[str, Path]:
    """Map installed bundle name -> bundle directory (entries whose module is missing are skipped)."""
    found: dict[str, Path] = {}
    for ep in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        spec = importlib.util.find_spec(ep.value)
        if spec is None or not spec.submodule_search_locations:
            continue
        found[ep.name] = Path(next(iter(spec.submodule_search_locations)))
    return found

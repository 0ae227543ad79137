"""The nox session table: what ``noxfile.py`` needs to know about each target, as data.

nox runs before the build environment exists, so the noxfile cannot import the
declarations; it reads ``targets/sessions.json`` instead.  That file is generated
from the registry by this module and a test fails when it is stale:

    python -m higgs_pack.targets.nox_sessions --write   # after adding or changing a target

Per target (bundle paths are not here: the noxfile asks ``higgs-pack build --print-path``):
whether its bundles run on any machine (``runs_anywhere``: the build session speaks a case, verify needs no GPU
probe), the runtime extra a verify venv installs when its hardware is missing, and
for a GPU provider the extra and the probe that finds the hardware.  Plus the extra
provider sessions: bundles of targets that run anywhere, verified on a provider whose
distribution needs a venv of its own (the OpenVINO EP).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from higgs_pack.manifests.providers import EXECUTION_PROVIDERS
from higgs_pack.targets.base import ONNX_REQUIREMENT
from higgs_pack.targets.registry import targets

#: Where the noxfile reads the table (beside this module, shipped as package data).
SESSIONS_JSON = Path(__file__).with_name("sessions.json")


def session_table() -> dict[str, Any]:
    """The table ``noxfile.py`` builds its sessions from (JSON-ready, sorted keys)."""
    table: dict[str, Any] = {"targets": {}, "provider_sessions": []}
    for name, target in sorted(targets().items()):
        row = target.provider
        fallback = EXECUTION_PROVIDERS.get(target.verify_on) if target.verify_on else None
        table["targets"][name] = {
            "runs_anywhere": target.runs_anywhere,
            "runtime_extra": fallback.packaging.extra if fallback is not None else target.extra,
            "gpu": {"extra": target.extra, "probe": row.hardware.probe} if row is not None and row.gpu else None,
        }
        if target.runs_anywhere and row is not None:
            for other in EXECUTION_PROVIDERS.values():
                if other.packaging.own_venv and other is not row:
                    table["provider_sessions"].append({
                        "session": f"verify-{name}-on-{other.name}-ep", "target": name, "provider": other.name,
                        "install": [other.packaging.requirement, ONNX_REQUIREMENT], "ort_provider": other.ort_provider})
    return table


def render() -> str:
    return json.dumps(session_table(), indent=2, sort_keys=True) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m higgs_pack.targets.nox_sessions", description=__doc__.split("\n")[0])
    parser.add_argument("--write", action="store_true", help=f"rewrite {SESSIONS_JSON.name} from the registry")
    args = parser.parse_args(argv)
    text = render()
    if args.write:
        SESSIONS_JSON.write_text(text, encoding="utf-8")
        print(f"wrote {SESSIONS_JSON}")
        return 0
    current = SESSIONS_JSON.read_text(encoding="utf-8") if SESSIONS_JSON.is_file() else ""
    if current != text:
        print(f"{SESSIONS_JSON} is stale; run python -m higgs_pack.targets.nox_sessions --write", file=sys.stderr)
        return 1
    print(f"{SESSIONS_JSON} matches the registry")
    return 0


if __name__ == "__main__":
    sys.exit(main())

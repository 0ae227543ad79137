"""The one place the import package's layout is declared: each root folder of the checkout and the
package it is installed as.  Every sub-package below a root is found, never listed by hand, so a new
folder cannot be left out of the wheel (tests/test_cli.py checks the built wheel holds every tracked
file of these folders).  Everything else about the distribution is in pyproject.toml."""

from setuptools import find_namespace_packages, setup

#: import package -> folder of the checkout (DESIGN.md: the four code folders at the root are
#: installed under ``higgs_pack``; no bare ``runtime`` lands in site-packages).
ROOTS = {
    "higgs_pack": "higgs_pack",
    "higgs_pack.targets": "targets",
    "higgs_pack.exporters": "exporters",
    "higgs_pack.runtime": "runtime",
    "higgs_pack.manifests": "manifests",
    "higgs_pack.serve": "serve",
}


def packages() -> list[str]:
    """Every package under :data:`ROOTS`: the roots and each folder below them (namespace folders
    too: ``runtime/verification/ops`` holds only its kernel tables), less caches."""
    found = []
    for package, folder in ROOTS.items():
        found.append(package)
        found += [f"{package}.{sub}" for sub in find_namespace_packages(where=folder, exclude=["*__pycache__*"])]
    return found


setup(package_dir=ROOTS, packages=packages())

"""The bundle manifest: JSON Schema, reading, writing and validation.

Pure data and validation; imports no other higgs-pack subpackage.
"""

from higgs_pack.errors import (
    BuildError,
    BuildPlanError,
    BundleError,
    CheckpointError,
    ExecutionProviderUnavailable,
    HiggsPackError,
    InputError,
    ManifestError,
    NumericalError,
    PackagingError,
    SignatureMismatch,
    UnsupportedFormatVersion,
)
from higgs_pack.manifests.manifest import FORMAT_VERSION
from higgs_pack.manifests.model import SubPart
from higgs_pack.manifests.providers import EXECUTION_PROVIDERS, ExecutionProvider

__all__ = [
    "EXECUTION_PROVIDERS",
    "FORMAT_VERSION",
    "BuildError",
    "BuildPlanError",
    "BundleError",
    "CheckpointError",
    "ExecutionProvider",
    "ExecutionProviderUnavailable",
    "HiggsPackError",
    "InputError",
    "ManifestError",
    "NumericalError",
    "PackagingError",
    "SignatureMismatch",
    "SubPart",
    "UnsupportedFormatVersion",
]

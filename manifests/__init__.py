"""The bundle manifest: JSON Schema, reading, writing and validation.

Pure data and validation; imports no other higgs-pack subpackage.
"""

from higgs_pack.manifests.constants import (
    EXECUTION_PROVIDERS,
    FORMAT_VERSION,
    ExecutionProvider,
    SubPart,
)
from higgs_pack.manifests.errors import (
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

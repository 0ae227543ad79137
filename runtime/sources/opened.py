"""The opened bundle: a directory whose manifest was read and validated (:class:`Bundle`).

Its own module, below the backends: a backend's interface names it, and the code that
opens bundles (:mod:`higgs_pack.runtime.sources.bundle`) uses the backends, so the type
lives where both can import it without a circle.  Runtime code: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from higgs_pack.manifests.manifest import resolve_inside
from higgs_pack.manifests.model import SubPart


@dataclass(frozen=True)
class Bundle:
    """A bundle directory whose manifest has been read and validated.

    Attributes:
        path: the bundle directory.
        manifest: the validated manifest dict.
        parsed: what :func:`open_bundle`'s file checks read, by relative path, so a load reads
            nothing twice (ONNX graph -> its external-data entries; tokenizer file -> the
            ``tokenizers.Tokenizer``); empty for a bundle made otherwise.
    """

    path: Path
    manifest: dict[str, Any]
    parsed: dict[str, Any] = field(default_factory=dict, repr=False, compare=False)

    @property
    def name(self) -> str:
        return self.manifest["name"]

    def file(self, relpath: str) -> Path:
        """Absolute path of a bundle file, proven to resolve inside the bundle.

        The path is returned as it sits in the bundle, not resolved, so that files
        found beside it (ONNX external data, an IR's ``.bin``) are found even when the
        bundle is a Hugging Face cache snapshot whose files are symlinks into ``blobs/``.

        Raises:
            BundleError: the path leaves the bundle (see ``manifests.manifest.resolve_inside``).
        """
        resolve_inside(self.path, relpath)
        return self.path / relpath

    def subpart(self, part: SubPart | str) -> dict[str, Any]:
        """The manifest entry of one sub-part."""
        return self.manifest["subparts"][str(part)]

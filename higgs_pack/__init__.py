"""higgs-pack: build, package, verify and run Higgs-Audio-v3 text-to-speech bundles.

The Python API is one import::

    import higgs_pack
    tts = higgs_pack.load("dist/higgs-audio-v3-tiny-cpu-int4")
    result = tts.synthesize("Hello there.")     # result.samples: float32 mono at result.sample_rate Hz

Names are imported on first use (PEP 562), so ``import higgs_pack`` stays cheap and
``import higgs_pack.targets`` does not pull in the runtime.  The subpackages
``higgs_pack.runtime``, ``.manifests``, ``.exporters`` and ``.targets`` live in the
repository's root folders (``pyproject.toml`` maps them).
"""

from __future__ import annotations

import importlib
import os
from typing import Any

# Run from a source checkout (the clone's root on sys.path), this folder shadows the
# installed package and holds none of the subpackages: find them in the root folders
# beside it, where pyproject.toml maps them from.
if not os.path.isdir(os.path.join(__path__[0], "runtime")):
    _root = os.path.dirname(os.path.abspath(__path__[0]))
    if os.path.isdir(os.path.join(_root, "runtime")) and _root not in __path__:
        __path__.append(_root)

#: public name -> module that defines it.
_EXPORTS = {
    "load": "higgs_pack.runtime.api",
    "TTS": "higgs_pack.runtime.api",
    "TTSInfo": "higgs_pack.runtime.api",
    "SynthesisResult": "higgs_pack.runtime.loop.synthesis",
    "SynthesisRequest": "higgs_pack.runtime.request",
    "write_wav": "higgs_pack.runtime.audio",
    "WavFileWriter": "higgs_pack.runtime.audio",
    "HiggsPackError": "higgs_pack.errors",
    "BundleError": "higgs_pack.errors",
    "ManifestError": "higgs_pack.errors",
    "ExecutionProviderUnavailable": "higgs_pack.errors",
    "InputError": "higgs_pack.errors",
    "PackagingError": "higgs_pack.errors",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from importlib.metadata import version

        return version("higgs-pack")
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'higgs_pack' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)

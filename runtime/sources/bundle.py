"""Open a bundle: validate everything, then create sessions on the right backend.

``load()`` checks the manifest schema and version, its backend and file formats, every
path (inside the bundle, no symlink escapes, ONNX external-data locations too) and the
sha256 of every file *before* any session is created; then asks the bundle's backend
(:mod:`higgs_pack.runtime.backends`) to open each sub-part, which checks its I/O
signature against the manifest.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import shutil
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

from higgs_pack.errors import BundleError, ManifestError
from higgs_pack.manifests.manifest import (
    MANIFEST_NAME,
    hub_cache_blobs,
    read_manifest,
    resolve_inside,
)
from higgs_pack.manifests.model import SubPart
from higgs_pack.runtime.backends import OpenOptions, backend_of
from higgs_pack.runtime.loop.pipeline import ModelConstants, Pipeline
from higgs_pack.runtime.loop.stateful_codec import StreamCodecSpec
from higgs_pack.runtime.sources.file_kinds import check_bundle_files, external_data_entries
from higgs_pack.runtime.sources.opened import Bundle

log = logging.getLogger(__name__)


@contextlib.contextmanager
def regular_files(bundle: Bundle, relpaths: Iterable[str]) -> Iterator[Path]:
    """A folder in which ``relpaths`` are regular files with the bundle's content (for onnx.checker).

    onnx.checker refuses external data that is a symbolic link or has several hard links
    (its guard against link attacks), and in a Hugging Face cache snapshot every file is a
    symlink into the repository's ``blobs/``.  For such a bundle this yields a temporary
    folder beside ``blobs/`` (the cache's own disk, not a RAM-backed /tmp) holding copies
    of ``relpaths`` under the bundle's names (in-kernel copies; disk: their size, removed
    afterwards).  Every other bundle is yielded as it is.

    Raises:
        OSError: the copies cannot be written (no space, read-only cache).
    """
    blobs = hub_cache_blobs(bundle.path)
    if blobs is None:
        yield bundle.path
        return
    with tempfile.TemporaryDirectory(prefix=".higgs-pack-check-", dir=blobs.parent) as tmp:
        for rel in relpaths:
            dest = Path(tmp, *rel.split("/"))
            dest.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(bundle.file(rel), dest)
        yield Path(tmp)


def find_bundle(name_or_path: str | Path) -> Path:
    """Resolve a bundle directory from a path or the name of an installed bundle.

    Installed bundle wheels register themselves in the ``higgs_pack.bundles``
    entry-point group (see ``higgs-pack list``).

    Raises:
        BundleError: neither a directory nor an installed bundle name, or a directory that
            holds no ``manifest.json`` (:func:`require_bundle_dir`).
    """
    path = Path(name_or_path)
    if path.exists():
        require_bundle_dir(path)
        return path
    from higgs_pack.runtime.sources.installed import installed_bundles

    found = installed_bundles()
    if str(name_or_path) in found:
        return found[str(name_or_path)]
    known = f"installed: {', '.join(sorted(found))}" if found else "no bundle wheels are installed"
    raise BundleError(
        f"{name_or_path}: no such bundle directory, and no installed bundle of that name "
        f"({known}), nor a model slug of a visible bundle (`higgs-pack devices` lists them). "
        "Pass a bundle directory, an archive, hf://ORG/REPO[@REVISION], or pip install a bundle wheel"
    )


def require_bundle_dir(path: Path, *, folders_of_bundles: bool = False) -> None:
    """Refuse a directory that is not a bundle, before anything else is said about it.

    Args:
        path: an existing path (a file is left to the archive reader).
        folders_of_bundles: also accept a folder whose sub-folders are bundles (what
            :func:`higgs_pack.runtime.api.load` chooses among).

    Raises:
        BundleError: ``path`` is a directory with no ``manifest.json`` (and, with
            ``folders_of_bundles``, no bundle folder one level below).
    """
    path = Path(path)
    if not path.is_dir() or (path / MANIFEST_NAME).is_file():
        return
    if folders_of_bundles and any((child / MANIFEST_NAME).is_file() for child in path.iterdir() if child.is_dir()):
        return
    below = "; nor is it a folder of bundles: none one level below" if folders_of_bundles else ""
    raise BundleError(f"{path} is not a bundle ({MANIFEST_NAME} is missing{below}); give a bundle directory "
                      "(as `higgs-pack build` writes), an archive, an installed bundle name, a model slug or "
                      "hf://ORG/REPO[@REVISION]")


def open_bundle(name_or_path: str | Path, *, check_hashes: bool = True) -> Bundle:
    """Read and validate a bundle without creating any session.

    Args:
        name_or_path: bundle directory or installed bundle name.
        check_hashes: compare every file's sha256 (streamed); sizes are always checked.

    Raises:
        BundleError: a file cannot be read, differs from the manifest, or is not what its
            kind says (:func:`~higgs_pack.runtime.sources.file_kinds.check_bundle_files`).
        ManifestError, UnsupportedFormatVersion: see ``manifests.manifest``.
    """
    path = find_bundle(name_or_path)
    manifest = read_manifest(path)
    check_formats(manifest)
    parsed = check_bundle_files(path, manifest, hashes=check_hashes)  # readable, size, sha256, and its kind
    bundle = Bundle(path.resolve(), manifest, parsed)
    for part, spec in manifest["subparts"].items():
        if spec["format"] == "onnx":
            check_external_data(bundle, part, spec)
    return bundle


def check_formats(manifest: dict[str, Any]) -> None:
    """The manifest names a known backend and every sub-part is in that backend's file format.

    Raises:
        ManifestError: an unknown backend (names the known ones), or a sub-part of another format.
    """
    backend = backend_of(manifest)
    for part, spec in manifest["subparts"].items():
        if spec["format"] != backend.format:
            raise ManifestError(f"{manifest['name']}: sub-part {part} is in {spec['format']!r} format, but its "
                                f"backend {backend.name} reads {backend.format!r} files; rebuild the bundle")


def external_data_refs(path: Path) -> dict[str, str]:
    """Every external-data ``location`` of an ONNX graph, read without its weights.

    Args:
        path: the ``.onnx`` file.

    Returns:
        location (as written in the graph, ``""`` when a tensor names none) -> the first
        tensor that uses it, in first-seen order; subgraphs included.
    """
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    return {location: first for location, (first, _) in external_data_entries(model).items()}


def check_external_data(bundle: Bundle, part: str, spec: dict[str, Any]) -> None:
    """Prove every ONNX external-data location of a sub-part stays inside the bundle.

    Reads the graph without its weights (``onnx.load(load_external_data=False)``).

    Raises:
        BundleError: a location is absolute, uses ``..``, leaves the bundle, or is
            not one of the files listed in the manifest.
    """
    if importlib.util.find_spec("onnx") is None:  # pragma: no cover - onnx comes with every ONNX Runtime extra
        log.warning("onnx is not installed; external-data locations of %s not checked", part)
        return
    entry = bundle.file(spec["entry"])
    base = entry.parent.relative_to(bundle.path)
    listed = set(spec["files"])
    entries = bundle.parsed.get(spec["entry"])
    refs = external_data_refs(entry) if entries is None else {loc: first for loc, (first, _) in entries.items()}
    for location, tensor_name in refs.items():
        rel = (base / location).as_posix() if location else ""
        if not location or Path(location).is_absolute() or ".." in Path(location).parts:
            raise BundleError(
                f"{part}: external data location {location!r} of tensor {tensor_name!r} points "
                "outside the bundle; the bundle is damaged or tampered with: rebuild it"
            )
        resolve_inside(bundle.path, rel)
        if rel not in listed:
            raise BundleError(
                f"{part}: external data file {rel!r} is not listed in the manifest; rebuild the bundle"
            )


def load_pipeline(
    bundle: str | Path | Bundle,
    *,
    execution_provider: str | None = None,
    device: str | None = None,
    allow_fallback: bool = False,
    check_hashes: bool = True,
    cache_dir: str | Path | Literal[False] | None = None,
    low_memory: bool = False,
) -> Pipeline:
    """Load a bundle for synthesis.

    Args:
        bundle: bundle directory, installed bundle name, or an opened :class:`Bundle`.
        execution_provider: ONNX Runtime bundles: override the manifest's provider
            (``cpu``, ``cuda``, ``dml``, ``openvino``).
        device: OpenVINO bundles: override the manifest's device (``CPU``, ``GPU``,
            ``NPU``, ``AUTO``, ``HETERO:…``).
        allow_fallback: permit another provider/device when the one asked for is
            missing; the fallback is logged and shown in ``Pipeline.description``.
        check_hashes: verify every file's sha256 before opening (default True).
        cache_dir: OpenVINO model cache directory (default:
            ``$HIGGS_PACK_CACHE/openvino/<bundle name>-<checkpoint digest>``, see
            :func:`~higgs_pack.runtime.backends.openvino.parts.open_openvino_parts`); ``False``
            compiles without the model cache.
        low_memory: hold as little of the weights resident as the backend allows, for
            some speed: an ONNX Runtime fp32/fp16 decoder on the CPU provider is opened
            without prepacking and pages its mapped weights out after every step
            (:class:`~higgs_pack.runtime.backends.onnxruntime.runners.OrtDecoder` ``page_out_weights``).
            The build verifies with it: the 4B fp32 decoder's 14.5 GB would not fit the
            12 GiB build budget resident.  Quantized decoders and OpenVINO bundles are
            opened as usual (their weights are read in place or already paged out).

    Returns:
        A :class:`~higgs_pack.runtime.loop.pipeline.Pipeline` ready for
        :func:`higgs_pack.runtime.loop.synthesis.synthesize`.

    Raises:
        BundleError, ManifestError, UnsupportedFormatVersion: the bundle is not valid.
        SignatureMismatch: a graph's I/O differs from the manifest.
        ExecutionProviderUnavailable: provider or device missing (and no fallback asked).
    """
    from tokenizers import Tokenizer

    opened = bundle if isinstance(bundle, Bundle) else open_bundle(bundle, check_hashes=check_hashes)
    m = opened.manifest
    options = OpenOptions(execution_provider=execution_provider, device=device, allow_fallback=allow_fallback,
                          cache_dir=cache_dir if cache_dir is False else Path(cache_dir) if cache_dir else None,
                          low_memory=low_memory)
    parts = backend_of(m).open(opened, options)
    runners = parts.runners
    tokenizer = opened.parsed.get(m["tokenizer"]["file"]) or Tokenizer.from_file(str(opened.file(m["tokenizer"]["file"])))
    gen = dict(m["generation"])
    sampling = {k: gen.pop(k) for k in ("temperature", "top_k", "top_p", "repeat_guard_frames") if k in gen}
    return Pipeline(
        tokenizer=tokenizer,
        constants=ModelConstants.from_dict(m["constants"]),
        text_embed=runners[SubPart.TEXT_EMBED],
        decoder=runners[SubPart.LLM_DECODER],
        audio_embed=runners[SubPart.AUDIO_EMBED],
        audio_heads=runners[SubPart.AUDIO_HEADS],
        audio_tokenizer=runners[SubPart.AUDIO_TOKENIZER],
        audio_encoder=runners.get(SubPart.AUDIO_ENCODER),
        description=parts.where,
        generation_defaults={**gen, "sampling": sampling},
        codec_context_frames=recorded_codec_context(m),
        audio_tokenizer_stream=runners.get(SubPart.AUDIO_TOKENIZER_STREAM),
        stream_codec=recorded_stream_codec(m),
    )


def recorded_stream_codec(manifest: dict) -> StreamCodecSpec | None:
    """The streaming codec's lookahead, delay and state size (``subparts.audio_tokenizer_stream.options``),
    or None for a bundle without it (built before format 2)."""
    spec = manifest["subparts"].get(SubPart.AUDIO_TOKENIZER_STREAM)
    if spec is None:
        return None
    return StreamCodecSpec.from_options(spec["options"], manifest["constants"]["hop_length"])


def recorded_codec_context(manifest: dict) -> int | None:
    """The codec decoder's chunking context in frames as the manifest records it.

    ``subparts.audio_tokenizer.options.stream_context_frames`` (every bundle built since
    streaming), else ``options.chunking.context`` (static npu bundles), else None (older
    bundles: the runtime measures it when first needed).
    """
    options = manifest["subparts"].get(SubPart.AUDIO_TOKENIZER, {}).get("options", {})
    value = options.get("stream_context_frames") or (options.get("chunking") or {}).get("context")
    return int(value) if value else None

"""Is every bundle file what its kind says?  Checked from headers and protos, never the weights.

A file can pass its sha256 and still be junk: a bundle written by a broken tool, or one
edited by hand with the manifest re-hashed.  Before anything parses a file for real (ONNX
Runtime, OpenVINO, the tokenizer), :func:`check_bundle_files` proves, for each file the
manifest lists:

- it can be read by this process (else: which file, and that it cannot be read);
- its size and sha256 (:func:`higgs_pack.manifests.manifest.check_files`);
- its kind, from the manifest's role for it: an ONNX graph parses as a ModelProto with
  nodes (read without external data); ONNX external data covers every offset and length
  its graph's tensors name, and a sample of its floating-point tensors holds no NaN
  (:func:`float_samples_problem`: random bytes of the right size give NaN there); an
  OpenVINO IR ``.xml`` is a ``<net>`` with layers, and its ``.bin`` covers every constant's
  offset and size, with the same float sample; the
  tokenizer opens with ``tokenizers.Tokenizer.from_file``; the golden outputs are an
  ``.npz`` of ``.npy`` arrays with readable headers and no object dtype; every other
  ``.json`` is UTF-8 JSON.

``load()`` (through ``open_bundle``) and ``verify`` both call it, so both refuse such a
file with the same :class:`~higgs_pack.errors.BundleError` naming it.
"""

from __future__ import annotations

import json
import os
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from higgs_pack.errors import BundleError, last_line
from higgs_pack.manifests.manifest import check_files

#: Bytes read to prove a file can be read.
_PROBE = 1
#: Floating-point tensors sampled per weights file, and bytes read from each (the check reads at
#: most 8 x 64 KiB per file: a load never reads the weights themselves).
FLOAT_SAMPLES, FLOAT_SAMPLE_BYTES = 8, 64 * 1024
#: ONNX TensorProto data types (onnx.TensorProto: FLOAT 1, FLOAT16 10, DOUBLE 11) and OpenVINO IR
#: element types -> numpy dtype, for the float sample.  bfloat16 has no numpy dtype: not sampled.
_ONNX_FLOATS = {1: np.float32, 10: np.float16, 11: np.float64}
_IR_FLOATS = {"f32": np.float32, "f16": np.float16, "f64": np.float64}


def float_samples_problem(data: Path, tensors: list[tuple[str, Any, int, int]]) -> str | None:
    """Read up to :data:`FLOAT_SAMPLES` of ``tensors`` (spread over the list) from the weights file
    ``data``, at most :data:`FLOAT_SAMPLE_BYTES` each, and say which holds a NaN.

    Trained weights, scales and norms hold no NaN (an infinity may be a mask constant, so only
    NaN is judged); bytes that are not weights (a broken writer, a file swapped for random bytes
    and re-hashed) do: in 16,384 random float32 values one is NaN with probability about
    1 - (255/256)^16384, 1 - 1e-28 (fp16: 1/32 of the values).  Tensors under 1 KiB are not
    sampled (constants, not weights).

    Args:
        data: the weights file (ONNX external data or an IR ``.bin``).
        tensors: ``(name, numpy dtype, offset, length in bytes)`` of its float tensors.

    Returns:
        ``"tensor NAME at byte OFFSET holds NaN values (not weights)"`` for the first bad one, else None.
    """
    tensors = [t for t in tensors if t[3] >= 1024]
    if not tensors:
        return None
    step = max(1, len(tensors) // FLOAT_SAMPLES)
    with open(data, "rb") as f:
        for name, dtype, offset, length in tensors[::step][:FLOAT_SAMPLES]:
            size = np.dtype(dtype).itemsize
            count = min(length, FLOAT_SAMPLE_BYTES) // size
            f.seek(offset)
            values = np.frombuffer(f.read(count * size), dtype=dtype)
            if np.isnan(values).any():
                return f"tensor {name} at byte {offset} holds NaN values (not weights)"
    return None


def unreadable_files(bundle: Path, manifest: dict[str, Any]) -> dict[str, str]:
    """Listed files this process cannot open (permissions, a directory in the file's place).

    Missing files are left to :func:`~higgs_pack.manifests.manifest.check_files`.

    Returns:
        relative path -> the operating system's reason.
    """
    found: dict[str, str] = {}
    for entry in manifest["files"]:
        path = bundle / entry["path"]
        if not os.path.lexists(path):
            continue
        try:
            with open(path, "rb") as handle:
                handle.read(_PROBE)
        except OSError as exc:
            found[entry["path"]] = exc.strerror or type(exc).__name__
    return found


def file_kinds(manifest: dict[str, Any]) -> dict[str, str]:
    """Each listed file's kind, from its role in the manifest.

    Returns:
        relative path -> one of ``onnx``, ``onnx-data``, ``ir-xml``, ``ir-bin``, ``tokenizer``,
        ``golden``, ``json``; files of no known kind (e.g. a ``.txt``) are left out.
    """
    kinds: dict[str, str] = {}
    for spec in manifest["subparts"].values():
        onnx = spec["format"] == "onnx"
        for rel in spec["files"]:
            if rel == spec["entry"]:
                kinds[rel] = "onnx" if onnx else "ir-xml"
            elif rel.endswith(".json"):
                kinds[rel] = "json"
            elif onnx:
                kinds[rel] = "onnx-data"
            elif rel.endswith(".bin"):
                kinds[rel] = "ir-bin"
    kinds[manifest["tokenizer"]["file"]] = "tokenizer"
    kinds[manifest["reference"]["file"]] = "golden"
    for entry in manifest["files"]:
        if entry["path"].endswith(".json"):
            kinds.setdefault(entry["path"], "json")
    return kinds


def external_data_entries(model: Any) -> dict[str, tuple[str, int]]:
    """Every external-data ``location`` of a loaded ONNX ``ModelProto`` (subgraphs included),
    in first-seen order: location (``""`` when a tensor names none) -> (the first tensor that
    uses it, the end in bytes of its furthest tensor there)."""
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    entries: dict[str, tuple[str, int]] = {}
    for tensor in _get_all_tensors(model):
        if uses_external_data(tensor):
            info = {e.key: e.value for e in tensor.external_data}
            location = info.get("location", "")
            first, end = entries.get(location, (tensor.name, 0))
            entries[location] = (first, max(end, int(info.get("offset", 0)) + int(info.get("length", 0))))
    return entries


def _onnx_extents(path: Path) -> dict[str, tuple[str, int]]:
    """An ONNX graph, parsed without external data: location -> (its first tensor, the end of its
    furthest tensor there in bytes), :func:`external_data_entries`.

    Raises:
        ValueError: not an ONNX model, or one with no nodes or no opset.
    """
    import onnx
    from google.protobuf.message import DecodeError

    try:
        model = onnx.load(str(path), load_external_data=False)
    except (DecodeError, ValueError, RuntimeError) as exc:
        raise ValueError(f"does not parse as an ONNX model ({type(exc).__name__}: {last_line(exc)})") from None
    if not model.graph.node or not model.opset_import:
        raise ValueError("parses, but as an ONNX model with no graph nodes or no opset")
    entries = external_data_entries(model)
    _sample_onnx_floats(path, model, entries)
    return entries


def _sample_onnx_floats(path: Path, model: Any, entries: dict[str, tuple[str, int]]) -> None:
    """:func:`float_samples_problem` on each external-data file of ``model`` that covers its tensors.

    Raises:
        ValueError: a sampled float tensor holds NaN.
    """
    from onnx.external_data_helper import _get_all_tensors, uses_external_data

    floats: dict[str, list[tuple[str, Any, int, int]]] = {}
    for tensor in _get_all_tensors(model):
        if uses_external_data(tensor) and tensor.data_type in _ONNX_FLOATS:
            info = {e.key: e.value for e in tensor.external_data}
            floats.setdefault(info.get("location", ""), []).append(
                (tensor.name, _ONNX_FLOATS[tensor.data_type], int(info.get("offset", 0)), int(info.get("length", 0))))
    for location, tensors in floats.items():
        data = path.parent / location
        if location and data.is_file() and data.stat().st_size >= entries[location][1]:
            problem = float_samples_problem(data, tensors)
            if problem:
                raise ValueError(f"its external data {location}: {problem}")


def _ir_extents(xml: Path) -> dict[str, tuple[str, int]]:
    """An OpenVINO IR ``.xml``: ``{its .bin's name: ("", end of the furthest constant there in bytes)}``.

    Raises:
        ValueError: not XML, not a ``<net>`` with layers, or a constant without a numeric extent.
    """
    import xml.etree.ElementTree as ElementTree

    try:
        root = ElementTree.parse(xml).getroot()
    except (ElementTree.ParseError, UnicodeDecodeError) as exc:
        raise ValueError(f"is not XML ({type(exc).__name__}: {exc})") from None
    layers = root.find("layers")
    if root.tag != "net" or layers is None or not len(layers):
        raise ValueError(f"is XML but not an OpenVINO IR (root <{root.tag}>, expected <net> with <layers>)")
    end = 0
    floats: list[tuple[str, Any, int, int]] = []
    for layer in root.iterfind("layers/layer[@type='Const']"):
        data = layer.find("data")
        if data is None:
            continue
        try:
            offset, size = int(data.get("offset", 0)), int(data.get("size", 0))
        except ValueError:
            raise ValueError(f"has a Const layer with offset {data.get('offset')!r}, size {data.get('size')!r}") \
                from None
        end = max(end, offset + size)
        if data.get("element_type") in _IR_FLOATS:
            floats.append((layer.get("name", "?"), _IR_FLOATS[data.get("element_type")], offset, size))
    binary = xml.with_suffix(".bin")
    if binary.is_file() and binary.stat().st_size >= end:
        problem = float_samples_problem(binary, floats)
        if problem:
            raise ValueError(f"its weights {binary.name}: {problem}")
    return {binary.name: ("", end)}


def _check_golden(path: Path) -> None:
    try:
        archive = zipfile.ZipFile(path)
    except zipfile.BadZipFile as exc:
        raise ValueError(f"is not an .npz archive ({exc})") from None
    with archive:
        names = archive.namelist()
        if not names:
            raise ValueError("is an empty .npz archive (no arrays)")
        for name in names:
            with archive.open(name) as member:
                try:
                    version = np.lib.format.read_magic(member)
                    header = {(1, 0): np.lib.format.read_array_header_1_0,
                              (2, 0): np.lib.format.read_array_header_2_0}.get(version)
                    if header is None:
                        raise ValueError(f".npy format version {version} is not one numpy writes for these arrays")
                    _, _, dtype = header(member)
                except ValueError as exc:
                    raise ValueError(f"member {name} is not a .npy array ({exc})") from None
            if dtype.hasobject:
                raise ValueError(f"member {name} holds Python objects (dtype {dtype}), which are never unpickled")


def _check_tokenizer(path: Path) -> Any:
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as exc:  # tokenizers raises a plain Exception for every problem
        raise ValueError(f"does not open as a tokenizers tokenizer ({last_line(exc)})") from None


def _check_json(path: Path) -> None:
    try:
        json.loads(path.read_bytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"is not UTF-8 JSON ({exc})") from None


#: kind -> (what it should be, a check that raises ValueError saying what it is instead).
_CHECKS: dict[str, tuple[str, Callable[[Path], Any]]] = {
    "onnx": ("an ONNX graph", _onnx_extents),
    "ir-xml": ("an OpenVINO IR .xml", _ir_extents),
    "tokenizer": ("a tokenizer.json", _check_tokenizer),
    "golden": ("the golden outputs (.npz)", _check_golden),
    "json": ("a JSON file", _check_json),
}


def file_kind_problems(bundle: Path, manifest: dict[str, Any],
                       parsed: dict[str, Any] | None = None) -> dict[str, str]:
    """Listed files that are not what their kind (:func:`file_kinds`) says.

    Reads graph protos without external data, IR XML, archive and array headers, the
    tokenizer and JSON files; never a weights file's content (only its size).

    Args:
        bundle: the bundle directory.
        manifest: its validated manifest.
        parsed: filled, when given, with what was read, so that nothing is parsed twice on a
            load: an ONNX graph's path -> its external-data entries (location -> (first
            tensor, end in bytes)); the tokenizer's path -> the ``tokenizers.Tokenizer``.

    Returns:
        relative path -> what it should be and what is wrong, e.g.
        ``"audio_heads.onnx is not an ONNX graph: does not parse as an ONNX model (DecodeError: ...)"``.
    """
    kinds = file_kinds(manifest)
    problems: dict[str, str] = {}
    extents: dict[str, tuple[str, int]] = {}  # weights file -> (its graph, the end the graph reads up to)
    for rel, kind in kinds.items():
        if kind not in _CHECKS:
            continue
        what, check = _CHECKS[kind]
        try:
            read = check(bundle / rel)
        except ValueError as exc:
            problems[rel] = f"{rel} is not {what}: {exc}"
            continue
        if parsed is not None and read is not None:
            parsed[rel] = read
        if kind not in ("onnx", "ir-xml"):
            continue
        base = Path(rel).parent
        for location, (_, end) in read.items():
            extents[(base / location).as_posix()] = (rel, end)
    for rel, (graph, end) in extents.items():
        size = (bundle / rel).stat().st_size if kinds.get(rel) in ("onnx-data", "ir-bin") else None
        if size is not None and size < end:
            what = "ONNX external data" if kinds[rel] == "onnx-data" else "an OpenVINO IR .bin"
            problems[rel] = f"{rel} is not {what} of {graph}: {size} bytes, but the graph reads up to byte {end}"
    return problems


def check_bundle_files(bundle: Path, manifest: dict[str, Any], *, hashes: bool = True) -> dict[str, Any]:
    """Every listed file readable, of its size and sha256, and what its kind says, in that order.

    Args:
        bundle: the bundle directory.
        manifest: its validated manifest.
        hashes: compare every file's sha256 (streamed); sizes are always compared.

    Returns:
        What the kind checks read, by relative path (see :func:`file_kind_problems`'s ``parsed``).

    Raises:
        BundleError: naming each unreadable file, then each file that differs from the
            manifest, then each file that is not what its kind says, and what to do.
    """
    unreadable = unreadable_files(bundle, manifest)
    if unreadable:
        raise BundleError(
            f"{bundle}: cannot read " + "; ".join(f"{rel} ({why})" for rel, why in unreadable.items())
            + f". The process (uid {os.getuid() if hasattr(os, 'getuid') else '?'}) needs read access to every "
            "bundle file: fix the permissions (chmod a+r), or copy the bundle somewhere it can read"
        )
    check_files(bundle, manifest, hashes=hashes).raise_for_problems(bundle)
    parsed: dict[str, Any] = {}
    problems = file_kind_problems(bundle, manifest, parsed)
    if problems:
        raise BundleError(
            f"{bundle}: " + "; ".join(problems.values()) + ". The file's sha256 matches the manifest, so the "
            "bundle was built by a broken tool or edited and re-hashed: rebuild it or re-download it"
        )
    return parsed
